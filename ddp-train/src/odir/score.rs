//! Scoring a folder with a trained model on N ranks, for `ddp-train predict` and
//! `ddp-train evaluate`: the model from `--checkpoint` ([`load_checkpoint`], the one place a
//! checkpoint is read for them), exact shards of whole batches, and every image's
//! probabilities gathered onto every rank in image order.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ddp_comm::{EnvConfig, ProcessGroup, ReduceOp};
use ddp_data::odir::{OdirDataset, OdirImages};
use ddp_data::{Dataset, Loader};
use ddp_model::weights::{self, LoadReport, Strictness, WeightsError};
use tch::{nn, Device, Kind, Tensor};

use super::challenge::EyeCombine;
use super::cli::TrainConfig;
use super::options::{EvalInterpolation, Normalize};
use super::predict::ModelFile;
use super::stats::{OdirStats, Patients};
use super::task::{default_eval_resize, eval_transform, odir_model};
use crate::amp::Precision;
use crate::error::{Context, TrainError};
use crate::task::Stats;

/// What [`load_checkpoint`] read.
#[derive(Debug)]
pub struct LoadedCheckpoint {
    /// What was loaded, and from which entry of the file.
    pub report: LoadReport,
    /// The file read: `--checkpoint`, or the latest checkpoint of the run directory it names.
    pub file: PathBuf,
    /// The epoch the file records (`"epoch"` in a safetensors header, as the training writes
    /// it), from the read that gave the weights; `None` for a file without one.
    pub epoch: Option<u64>,
    /// The settings and task the file records it was trained under (a best model or
    /// checkpoint the training wrote), from the same read; `None` for a file without them
    /// (an earlier version's, another program's).
    pub trained_under: Option<serde_json::Value>,
}

/// Reads the model's weights from `model.checkpoint` into `vs` (on the CPU): a model file of
/// ours (`best-*.safetensors`, a `checkpoints/epoch-*.safetensors` of a run), PyTorch's
/// `torch.save(model.state_dict())`, a training checkpoint holding it (its entry
/// `model.key`, or its one state_dict) or `safetensors.torch.save_file` of the same model
/// (`module.` and `_orig_mod.` prefixes stripped), or a run directory, whose latest
/// checkpoint is read.
/// Every name and shape is checked before anything is loaded (strictly, as
/// `--init-from`). The weights and the epoch come from one read of the file.
pub fn load_checkpoint(
    vs: &nn::VarStore,
    model: &ModelFile,
) -> Result<LoadedCheckpoint, TrainError> {
    let file = crate::state::model_file_of(
        "--checkpoint",
        &model.checkpoint,
        "a model file (best-*.safetensors, a .pth) or a run directory",
        "no such file or run directory",
    )?;
    let read = match model.key.as_deref() {
        Some(key) => weights::read_state_dict_entry(&file, key),
        None => weights::read_state_dict(&file),
    };
    let loaded = read.and_then(|state| {
        let report = weights::load_state_dict(vs, &state, Strictness::Strict)?;
        let metadata = state.metadata();
        let epoch = metadata.get("epoch").and_then(|e| e.parse().ok());
        Ok((report, epoch, crate::state::recorded(metadata)))
    });
    match loaded {
        Ok((report, epoch, trained_under)) => Ok(LoadedCheckpoint {
            report,
            file,
            epoch,
            trained_under,
        }),
        Err(e @ WeightsError::SeveralStateDicts { .. }) => {
            Err(TrainError::Invalid(format!("{e} (--checkpoint-key)")))
        }
        Err(e @ WeightsError::NoEntry { .. }) => {
            Err(TrainError::Invalid(format!("--checkpoint-key: {e}")))
        }
        Err(
            e @ WeightsError::Mismatch {
                file_holds: Some(kind),
                ..
            },
        ) => Err(TrainError::Invalid(format!(
            "{e} (give --model {} to score it)",
            kind.name()
        ))),
        // Another head (ImageNet's 1000 classes, say): scoring needs ODIR's 8.
        Err(e @ WeightsError::Mismatch { .. }) => Err(TrainError::Invalid(format!(
            "{e} (predict and evaluate score a model trained on ODIR's 8 classes: fine-tune \
             this one first, with --init-from FILE --init-partial)"
        ))),
        Err(e) => Err(e.into()),
    }
}

/// The model `predict` and `evaluate` score, built as the training built it and loaded from
/// `--checkpoint` ([`load_checkpoint`]) on the CPU, before the ranks meet: a bad file fails on
/// every rank alike. [`score`] then scores rank 0's.
#[derive(Debug)]
pub struct LoadedModel {
    vs: nn::VarStore,
    model: ddp_model::Model,
    /// What was read.
    pub checkpoint: LoadedCheckpoint,
}

impl LoadedModel {
    /// Builds the model of `c` and loads `model_file` into it.
    pub fn load(c: &TrainConfig, model_file: &ModelFile) -> Result<Self, TrainError> {
        let vs = nn::VarStore::new(Device::Cpu);
        let model = odir_model(&vs.root(), c);
        let checkpoint = load_checkpoint(&vs, model_file)
            .context(|| format!("loading the model from {}", model_file.checkpoint.display()))?;
        Ok(Self {
            vs,
            model,
            checkpoint,
        })
    }
}

/// What the run that trained the model recorded, and where (for the warnings): the settings
/// the file read, `loaded`, records it was trained under (a best model or checkpoint of the
/// training's), else the `config.json` of the run directory `checkpoint` lies in or is (an
/// earlier version's file; `config.json` holds the settings of the run's last start).
fn run_record(checkpoint: &Path, loaded: &LoadedCheckpoint) -> Option<(String, serde_json::Value)> {
    let dir = if checkpoint.is_dir() {
        checkpoint
    } else {
        checkpoint.parent()?
    };
    let own = loaded.trained_under.clone();
    let (record, file) = crate::state::training_record(&loaded.file, dir, own)?;
    Some((file, record))
}

/// The `--eye-combine` a run's `record` holds (`None` for a run that recorded none).
fn recorded_eye_combine(record: &serde_json::Value) -> Option<EyeCombine> {
    let combine = record.get("task")?.get("eye_combine")?;
    serde_json::from_value(combine.clone()).ok()
}

/// The settings of `c` that differ from those the run that trained the model recorded in
/// `record` (read from `source`), as warnings: the transform, the eyes' combination and the
/// precision. A setting the record lacks (an older run's) is not compared.
fn training_differences(c: &TrainConfig, source: &str, record: &serde_json::Value) -> Vec<String> {
    let trained = |key: &str| record.get("task").and_then(|t| t.get(key)).cloned();
    let mut lines = Vec::new();
    let mut differs = |flag: &str, then: String, now: String| {
        let why = match flag {
            "--eye-combine" => "to combine the eyes as its run's patient scores did",
            "--precision" => "to score it as its run evaluated it",
            _ => "to score it on what it learnt from",
        };
        if then != now {
            lines.push(format!(
                "the model was trained with {flag} {then} ({source}) and is scored with {now}: \
                 give {flag} {then} {why}"
            ));
        }
    };
    if let Some(Ok(size)) = trained("image_size").map(serde_json::from_value::<u32>) {
        differs("--image-size", size.to_string(), c.image_size.to_string());
    }
    if let Some(Ok(norm)) = trained("normalize").map(serde_json::from_value::<Normalize>) {
        differs("--normalize", norm.to_string(), c.normalize.to_string());
    }
    // The resizes compare as applied: a flag's value, or the default (8/7 of the image size)
    // of each side's image size. A run trained with the default at another image size than
    // the one scored is named above, by its image size.
    let trained_size = trained("image_size").and_then(|v| serde_json::from_value::<u32>(v).ok());
    let trained_resize = match trained("eval_resize").map(serde_json::from_value::<Option<u32>>) {
        Some(Ok(Some(resize))) => Some(resize),
        Some(Ok(None)) => trained_size
            .filter(|&size| size == c.image_size)
            .map(default_eval_resize),
        _ => None,
    };
    if let Some(then) = trained_resize {
        let now = c
            .eval_resize
            .unwrap_or_else(|| default_eval_resize(c.image_size));
        differs("--eval-resize", then.to_string(), now.to_string());
    }
    let interpolation = trained("eval_interpolation");
    if let Some(Ok(then)) = interpolation.map(serde_json::from_value::<EvalInterpolation>) {
        let now = c.eval_interpolation.to_string();
        differs("--eval-interpolation", then.to_string(), now);
    }
    // The eyes' combination gives the patients' scores the run reported, and evaluation ran
    // in the training's precision.
    if let Some(combine) = recorded_eye_combine(record) {
        let now = c.eye_combine.as_str().into();
        differs("--eye-combine", combine.as_str().into(), now);
    }
    let precision = record.get("settings").and_then(|s| s.get("precision"));
    if let Some(Ok(then)) = precision.map(|p| serde_json::from_value::<Precision>(p.clone())) {
        differs(
            "--precision",
            then.to_string(),
            c.settings().precision.to_string(),
        );
    }
    lines
}

/// What the ranks scored: the statistics of the whole folder (on every rank), the run
/// directory, and this rank's place.
#[derive(Debug)]
pub struct Scored {
    /// Every image's probabilities ([`OdirStats::image_rows`], keyed by the image's index in
    /// `set`), and per-image counts against the folder's labels (zeros for an unlabelled
    /// folder).
    pub stats: OdirStats,
    /// The folder scored.
    pub set: Arc<OdirDataset>,
    /// The entry of the checkpoint's file that held the model, for a PyTorch training
    /// checkpoint ([`LoadReport::entry`]).
    pub checkpoint_entry: Option<String>,
    /// The file the weights came from (the latest checkpoint when `--checkpoint` named a run
    /// directory) and the epoch it records: this rank's read, which on rank 0 is the model
    /// every rank scored.
    pub model: (PathBuf, Option<u64>),
    /// The run directory every rank agreed on (rank 0's), created.
    pub out: PathBuf,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// On rank 0, the `--eye-combine` the model's run recorded, of which [`score`] warned
    /// when the one given differs (`None`: another rank, no run, or one that recorded none).
    pub(super) trained_eye_combine: Option<EyeCombine>,
    /// On rank 0, whether the model's run recorded `--tune-thresholds` (`false`: another
    /// rank, no run, or one that tuned none).
    pub(super) trained_tuned_thresholds: bool,
}

/// Runs `loaded`, the model of `model_file`, on every image of `set` through the evaluation
/// transform of `c`, as this rank of the job in the environment.
///
/// Every rank scores rank 0's model: its weights are sent to all first, as DDP starts from
/// rank 0's, so ranks that read the file at other moments (a run directory whose `latest`
/// moved on, a best model replaced meanwhile) score what rank 0 read.
///
/// Each rank takes whole batches of the folder in turn (batch `b` goes to rank
/// `b % world_size`), so every image is scored once, in a batch of the same images whatever
/// the number of ranks. A rank that cannot read an image still meets the others: every rank
/// then fails with that rank's error, which names the image.
pub fn score(
    c: &TrainConfig,
    model_file: &ModelFile,
    loaded: LoadedModel,
    set: Arc<OdirDataset>,
) -> Result<Scored, TrainError> {
    let checkpoint = &model_file.checkpoint;
    let env = EnvConfig::from_env().context(|| "reading the rank's environment".into())?;
    ddp_run::die_with_launcher().map_err(|e| TrainError::Invalid(e.to_string()))?;
    let settings = c.settings();
    settings.validate()?;
    let (device, _) = settings
        .runtime
        .place(env.local_rank, env.local_world_size)?;
    let LoadedModel {
        mut vs,
        model,
        checkpoint: loaded,
    } = loaded;
    vs.set_device(device);
    let images = OdirImages::new(set.clone(), eval_transform(c)?);
    let all: Vec<usize> = (0..images.len()).collect();
    let patients = Arc::new(Patients::new(set.samples()));

    let mut opts = ddp_comm::Options::from_config(&env).device(device);
    if let Some(secs) = settings.runtime.collective_timeout_secs {
        opts = opts.op_timeout(Duration::from_secs(secs));
    }
    let pg = ProcessGroup::new(opts).context(|| "joining the process group".into())?;
    let (rank, world) = (pg.rank(), pg.world_size());
    // Rank 0 alone warns, and alone reads what its run recorded.
    let record = if rank == 0 {
        run_record(checkpoint, &loaded)
    } else {
        None
    };
    if let Some((source, recorded)) = &record {
        for line in training_differences(c, source, recorded) {
            tracing::warn!("warning: {line}");
        }
    }
    // Every rank must score the same folder with the same model, on the same type of device
    // (NCCL and the CPU ring would meet as mismatched collectives), agreed over the CPU links.
    let key = score_key(
        images.len(),
        &names_digest(&set),
        set.root(),
        checkpoint,
        device,
    );
    check_score_agreement(&pg.all_gather_bytes(key.as_bytes())?)?;
    // Rank 0's model on every rank, in the order of the names.
    tch::no_grad(|| {
        ddp_model::checkpoint::named_tensors(&vs)
            .into_iter()
            .try_for_each(|(_, mut t)| pg.broadcast(&mut t, 0))
    })?;
    let proposed = settings
        .out
        .clone()
        .unwrap_or_else(crate::trainer::default_run_dir);
    let gathered = pg.all_gather_bytes(proposed.to_string_lossy().as_bytes())?;
    let out = PathBuf::from(String::from_utf8_lossy(&gathered[0]).into_owned());
    // Rank 0 makes the run directory before the scoring, not after it: a bad --out fails
    // every rank now, with rank 0's reason.
    let made = match rank {
        0 => ddp_model::checkpoint::create_dir_all_synced(&out)
            .err()
            .map(|e| format!("cannot create run directory {}: {e}", out.display())),
        _ => None,
    };
    let made = pg.all_gather_bytes(made.unwrap_or_default().as_bytes())?;
    if !made[0].is_empty() {
        return Err(TrainError::Invalid(format!(
            "rank 0 {}",
            String::from_utf8_lossy(&made[0])
        )));
    }

    let batch = settings.batch_size;
    let mine: Vec<usize> = all
        .chunks(batch)
        .enumerate()
        .filter(|(b, _)| b % world == rank)
        .flat_map(|(_, chunk)| chunk.iter().copied())
        .collect();
    let mut stats = OdirStats::new(patients, c.eye_combine, false);
    let outcome = run_batches(&settings, &images, mine, device, &model, &mut stats, &env);
    // Every rank learns whether any failed, before the collectives that would wait for it.
    let failure = match &outcome {
        Ok(()) => String::new(),
        Err(e) => crate::error::with_causes(e),
    };
    let failures = pg.all_gather_bytes(failure.as_bytes())?;
    if let Some((r, why)) = failures.iter().enumerate().find(|(_, f)| !f.is_empty()) {
        return Err(TrainError::Invalid(format!(
            "rank {r} could not score its images: {}",
            String::from_utf8_lossy(why)
        )));
    }
    let sums = stats.to_sums();
    let mut t = Tensor::from_slice(&sums).to_kind(Kind::Double);
    pg.all_reduce(&mut t, ReduceOp::Sum)?;
    stats.set_sums(&Vec::<f64>::try_from(&t)?);
    if let Some(rows) = stats.rows() {
        let rows = crate::gather::gather_rows(&pg, &rows)?;
        if rows.len() != images.len() {
            return Err(TrainError::Invalid(format!(
                "the ranks scored {} of the {} images",
                rows.len(),
                images.len()
            )));
        }
        stats.set_rows(rows);
    }
    // Every rank has every row: all refuse alike (sklearn refuses NaN; a submission of NaN or
    // inf is no submission).
    let not_finite: Vec<String> = stats
        .image_rows()
        .iter()
        .filter(|(_, row)| row.iter().any(|p| !p.is_finite()))
        .filter_map(|(key, _)| set.samples().get(key as usize))
        .map(|s| {
            s.path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    if let Some(first) = not_finite.first() {
        return Err(TrainError::Invalid(format!(
            "the model's outputs are NaN or infinite for {} of the {} images (first: {first}): \
             {} holds weights that are not finite, or comes from a training that diverged; \
             nothing was written",
            not_finite.len(),
            images.len(),
            checkpoint.display()
        )));
    }
    Ok(Scored {
        stats,
        set,
        checkpoint_entry: loaded.report.entry,
        model: (loaded.file, loaded.epoch),
        out,
        rank,
        world_size: world,
        trained_eye_combine: record.as_ref().and_then(|(_, r)| recorded_eye_combine(r)),
        trained_tuned_thresholds: record.as_ref().is_some_and(|(_, r)| {
            r.pointer("/task/tune_thresholds") == Some(&serde_json::Value::Bool(true))
        }),
    })
}

/// This rank's batches through the model.
fn run_batches(
    settings: &crate::settings::Settings,
    images: &OdirImages,
    indices: Vec<usize>,
    device: Device,
    model: &ddp_model::Model,
    stats: &mut OdirStats,
    env: &EnvConfig,
) -> Result<(), TrainError> {
    if indices.is_empty() {
        return Ok(());
    }
    let config = settings.loader_config(device, env.local_world_size);
    let mut loader = Loader::on_device(images.clone(), indices, &config, device)?;
    tch::no_grad(|| -> Result<(), TrainError> {
        let mut upcoming = loader.next();
        while let Some(batch) = upcoming {
            let batch = batch?;
            // The next batch's copy is queued before the statistics make the host wait for
            // the device (on a GPU).
            upcoming = loader.next();
            let _autocast = settings.precision.autocast(device)?;
            let logits = model.forward_t(batch.inputs(), false);
            stats.add(&logits, &batch);
        }
        Ok(())
    })
}

/// What every rank must agree on to score: the folder's images (their count and `names`,
/// [`names_digest`]: batches are dealt by position, so ranks that read other copies of a
/// folder, each with other images `--skip-corrupt` left out, would score some images twice
/// and others never), the model file, and the type of the device (not its index, which
/// differs from rank to rank).
fn score_key(images: usize, names: &str, root: &Path, checkpoint: &Path, device: Device) -> String {
    format!(
        "{images} images (names {names}) of {} with {} on {}",
        root.display(),
        checkpoint.display(),
        crate::ddp::device_type(device)
    )
}

/// The first 8 bytes, in hexadecimal, of the SHA-256 of the file names of `set`'s images in
/// its order (each after its length).
fn names_digest(set: &OdirDataset) -> String {
    use sha2::{Digest, Sha256};
    let mut digest = Sha256::new();
    for sample in set.samples() {
        let name = sample
            .path
            .file_name()
            .unwrap_or_default()
            .as_encoded_bytes();
        digest.update((name.len() as u64).to_le_bytes());
        digest.update(name);
    }
    digest.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Fails, with the same error on every rank, when the ranks' [`score_key`]s (gathered in rank
/// order) differ: naming rank 0's and the first other one.
fn check_score_agreement(keys: &[Vec<u8>]) -> Result<(), TrainError> {
    match crate::state::first_disagreement(keys) {
        None => Ok(()),
        Some((first, rank, other)) => Err(TrainError::Invalid(format!(
            "the ranks disagree on what to score: rank 0 has {first}, rank {rank} {other}: give \
             every rank the same --data (the same images: --skip-corrupt leaves out what each \
             rank's copy cannot decode), --checkpoint and --device (--device cuda fails where \
             CUDA is missing instead of scoring on the CPU)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use clap::Parser;
    use tch::Device;

    use super::{
        check_score_agreement, load_checkpoint, run_record, score_key, training_differences,
        ModelFile, TrainConfig,
    };

    /// The warnings for `best-score.safetensors` in a run directory whose `config.json` is
    /// `config`, recording the run's record `own` (`None`: a file of an earlier version, which
    /// records none), scored with `flags`; and that file.
    fn scored_against(config: &str, own: Option<&str>, flags: &[&str]) -> (Vec<String>, PathBuf) {
        let tmp = ddp_testkit::temp_dir("ddp-train-training-differences");
        std::fs::write(tmp.path().join("config.json"), config).unwrap();
        let model = tmp.path().join("best-score.safetensors");
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let _ = vs.root().zeros("w", &[1]);
        let mut meta = std::collections::HashMap::from([("epoch".into(), "3".into())]);
        if let Some(own) = own {
            meta.extend([crate::state::model_record(
                &serde_json::from_str(own).unwrap(),
            )]);
        }
        ddp_model::checkpoint::save(&vs, &model, &meta).unwrap();
        let file = ModelFile {
            checkpoint: model.clone(),
            key: None,
        };
        let loaded = load_checkpoint(&vs, &file).unwrap();
        let args = ["ddp-train", "--data", "d", "--image-size", "32"];
        let c = TrainConfig::try_parse_from(args.iter().chain(flags)).unwrap();
        let (source, record) = run_record(&model, &loaded).unwrap();
        (training_differences(&c, &source, &record), model)
    }

    /// `--checkpoint` reads a run's latest model from the run directory or its
    /// `checkpoints/`, and a checkpoint's model from its state file's name; a folder without
    /// checkpoints is refused naming the flag.
    #[test]
    fn a_checkpoint_folder_or_state_file_names_the_model_file() {
        let tmp = ddp_testkit::temp_dir("ddp-train-checkpoint-folder");
        let run = tmp.path();
        let dir = crate::state::checkpoint_dir(run);
        std::fs::create_dir_all(&dir).unwrap();
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let _ = vs.root().zeros("w", &[1]);
        let meta = std::collections::HashMap::from([("epoch".into(), "2".into())]);
        let model = dir.join("epoch-0002.safetensors");
        ddp_model::checkpoint::save(&vs, &model, &meta).unwrap();
        let state = dir.join("epoch-0002.state.safetensors");
        std::fs::write(&state, b"the optimizer's").unwrap();
        std::fs::write(dir.join("latest"), "epoch-0002\n").unwrap();
        let read = |checkpoint: &Path| {
            let file = ModelFile {
                checkpoint: checkpoint.to_path_buf(),
                key: None,
            };
            load_checkpoint(&vs, &file).map(|l| (l.file, l.epoch))
        };
        for given in [run, dir.as_path(), state.as_path(), model.as_path()] {
            assert_eq!(read(given).unwrap(), (model.clone(), Some(2)), "{given:?}");
        }
        let empty = run.join("logs");
        std::fs::create_dir_all(&empty).unwrap();
        match read(&empty) {
            Err(crate::TrainError::Invalid(m)) => assert_eq!(
                m,
                format!(
                    "--checkpoint {}: a folder without checkpoints (no {}); give a model file \
                     (best-*.safetensors, a .pth) or a run directory",
                    empty.display(),
                    empty.join("checkpoints/latest").display()
                )
            ),
            other => panic!("{other:?}"),
        }
    }

    /// The warnings for a model file of an earlier version in a run directory whose
    /// `config.json` is `config`, scored with `flags`.
    fn differences(config: &str, flags: &[&str]) -> Vec<String> {
        scored_against(config, None, flags).0
    }

    /// A best model is compared with the settings it records it was made under: of a run
    /// trained in fp32 and resumed in bf16 (which `config.json` now holds), the best model of
    /// an fp32 epoch scored in bf16 is advised fp32, and scored in fp32 warns of nothing. A
    /// model of an earlier version, which records none, is compared with `config.json`.
    #[test]
    fn a_model_is_compared_with_its_own_record_before_config_json() {
        let task = r#""image_size": 32, "normalize": "none", "eval_resize": null"#;
        let record = |precision: &str| {
            format!(r#"{{"settings": {{"precision": "{precision}"}}, "task": {{{task}}}}}"#)
        };
        let (config, own) = (record("bf16"), record("fp32"));
        let warning = |then: &str, now: &str, source: &str| {
            format!(
                "the model was trained with --precision {then} ({source}) and is scored with \
                 {now}: give --precision {then} to score it as its run evaluated it"
            )
        };
        let (lines, model) = scored_against(&config, Some(&own), &["--precision", "bf16"]);
        let source = format!("{}, its own record", model.display());
        assert_eq!(lines, [warning("fp32", "bf16", &source)]);
        let given = ["--precision", "fp32"];
        let (lines, _) = scored_against(&config, Some(&own), &given);
        assert_eq!(lines, Vec::<String>::new());
        // An earlier version's best model: config.json's precision.
        let (lines, model) = scored_against(&config, None, &given);
        let config_json = model.with_file_name("config.json");
        let source = config_json.display().to_string();
        assert_eq!(lines, [warning("bf16", "fp32", &source)]);
    }

    /// The resizes compare as applied: an explicit `--eval-resize` equal to the default of the
    /// image size scored is no difference (the warning said "its default" before).
    #[test]
    fn eval_resizes_compare_as_applied() {
        let warnings = |trained: &str, flags: &[&str]| {
            let task = r#""image_size": 32, "normalize": "none""#;
            differences(&format!(r#"{{"task": {{{task}, {trained}}}}}"#), flags)
        };
        // 36 is 8/7 of 32: the same resize, given or not.
        for (trained, flags) in [
            (r#""eval_resize": 36"#, &[][..]),
            (r#""eval_resize": null"#, &["--eval-resize", "36"][..]),
            (r#""eval_resize": null"#, &[][..]),
            (r#""eval_resize": 40"#, &["--eval-resize", "40"][..]),
        ] {
            assert_eq!(warnings(trained, flags), Vec::<String>::new(), "{trained}");
        }
        for (trained, flags, then, now) in [
            (r#""eval_resize": 40"#, &[][..], 40, 36),
            (r#""eval_resize": 36"#, &["--eval-resize", "40"][..], 36, 40),
            (
                r#""eval_resize": null"#,
                &["--eval-resize", "40"][..],
                36,
                40,
            ),
        ] {
            let lines = warnings(trained, flags);
            assert_eq!(lines.len(), 1, "{lines:?}");
            assert!(
                lines[0].starts_with(&format!(
                    "the model was trained with --eval-resize {then} ("
                )) && lines[0].contains(&format!(") and is scored with {now}: give")),
                "{lines:?}"
            );
        }
    }

    /// `--eval-interpolation` compares with the run's; an older run that recorded none is
    /// not compared.
    #[test]
    fn eval_interpolations_compare_with_the_runs() {
        let task = r#""image_size": 32, "normalize": "none", "eval_resize": null"#;
        let config = format!(r#"{{"task": {{{task}, "eval_interpolation": "bicubic"}}}}"#);
        let lines = differences(&config, &[]);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with("the model was trained with --eval-interpolation bicubic (")
                && lines[0].ends_with(
                    ") and is scored with bilinear: give --eval-interpolation bicubic to score \
                     it on what it learnt from"
                ),
            "{lines:?}"
        );
        let given = ["--eval-interpolation", "bicubic"];
        assert_eq!(differences(&config, &given), Vec::<String>::new());
        let older = format!(r#"{{"task": {{{task}}}}}"#);
        assert_eq!(differences(&older, &given), Vec::<String>::new());
    }

    /// The eyes' combination and the precision the run recorded are compared as the
    /// transform is: a run trained with `--eye-combine mean` and `--precision bf16`, scored
    /// with the defaults (max, fp32), warns of each once; given them, or for an older run
    /// that recorded neither, nothing.
    #[test]
    fn eye_combine_and_precision_compare_with_the_runs() {
        let task = r#""image_size": 32, "normalize": "none", "eval_resize": null"#;
        let config = format!(
            r#"{{"settings": {{"precision": "bf16"}}, "task": {{{task}, "eye_combine": "mean"}}}}"#
        );
        let lines = differences(&config, &[]);
        assert_eq!(lines.len(), 2, "{lines:?}");
        for (flag, then, now, why) in [
            (
                "--eye-combine",
                "mean",
                "max",
                "to combine the eyes as its run's patient scores did",
            ),
            (
                "--precision",
                "bf16",
                "fp32",
                "to score it as its run evaluated it",
            ),
        ] {
            let start = format!("the model was trained with {flag} {then} (");
            let end = format!(") and is scored with {now}: give {flag} {then} {why}");
            let matching: Vec<_> = lines
                .iter()
                .filter(|l| l.starts_with(&start) && l.ends_with(&end))
                .collect();
            assert_eq!(matching.len(), 1, "{flag}: {lines:?}");
        }
        let given = ["--eye-combine", "mean", "--precision", "bf16"];
        assert_eq!(differences(&config, &given), Vec::<String>::new());
        // An older run's record, without either: nothing to compare.
        let older = format!(r#"{{"settings": {{"seed": 1}}, "task": {{{task}}}}}"#);
        for flags in [&[][..], &given[..]] {
            assert_eq!(
                differences(&older, flags),
                Vec::<String>::new(),
                "{flags:?}"
            );
        }
    }

    /// A rank that would score on the CPU while rank 0 uses CUDA (`--device auto` where one
    /// host has no usable GPU) disagrees with rank 0 before the first CUDA collective, naming
    /// both devices and the setting to change; another GPU index is no disagreement.
    #[test]
    fn ranks_scoring_on_different_device_types_disagree() {
        let (root, model) = (
            Path::new("/data/odir"),
            Path::new("/runs/r/best.safetensors"),
        );
        let key = |device| score_key(12, "0123", root, model, device).into_bytes();
        let (cpu, cuda0, cuda1) = (key(Device::Cpu), key(Device::Cuda(0)), key(Device::Cuda(1)));
        assert!(check_score_agreement(&[cuda0.clone(), cuda1]).is_ok());
        // Other images, as many: a disagreement.
        let other = score_key(12, "4567", root, model, Device::Cuda(0)).into_bytes();
        assert!(check_score_agreement(&[cuda0.clone(), other]).is_err());
        let e = check_score_agreement(&[cuda0, cpu])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "the ranks disagree on what to score: rank 0 has 12 images (names 0123) of \
             /data/odir with /runs/r/best.safetensors on cuda, rank 1 12 images (names 0123) \
             of /data/odir with /runs/r/best.safetensors on cpu: give every rank the same \
             --data (the same images: --skip-corrupt leaves out what each rank's copy cannot \
             decode), --checkpoint and --device (--device cuda fails where CUDA is missing \
             instead of scoring on the CPU)"
        );
    }
}
