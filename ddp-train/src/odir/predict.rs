//! `ddp-train predict` and `ddp-train evaluate`: a trained model on a folder, on N ranks.
//!
//! - [`predict`] reads an unlabelled folder of the challenge's test images
//!   (`<id>_left.jpg`, `<id>_right.jpg`) and writes `predictions.csv` (each image's 8
//!   probabilities), `submission.csv` (the challenge's format: `ID,N,D,G,C,A,H,M,O`, one row
//!   per patient in ascending ID, the eyes combined by `--eye-combine`) and `decisions.csv`
//!   (each patient's 0/1 decisions at the thresholds the training tuned, else 0.5).
//! - [`evaluate`] scores a labelled ODIR folder (either layout) with the challenge's metrics
//!   and writes them to `evaluation.json`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, Subcommand};
use ddp_data::odir::{parse_image_name, OdirDataset, LABELS};
use serde_json::{json, Map, Value};

use super::challenge::{below, EyeCombine, THRESHOLD};
use super::cli::{utf8_paths, TrainConfig};
use super::score::{score, LoadedModel, Scored};
use super::task::{rank_data_options, skipped_json, skipped_lines};
use crate::error::TrainError;
use crate::task::Stats;

/// `ddp-train`'s commands besides training.
#[derive(Debug, Clone, Subcommand)]
pub enum OdirCommand {
    /// Predict an unlabelled folder of the challenge's test images (`<id>_left.jpg`,
    /// `<id>_right.jpg`): writes predictions.csv, submission.csv and decisions.csv into the
    /// run directory (--out).
    Predict(PredictArgs),
    /// Score a labelled ODIR folder (either layout, every image) with the challenge's metrics:
    /// prints them and writes evaluation.json into the run directory (--out).
    Evaluate(EvaluateArgs),
}

/// `ddp-train predict`'s flags: the model file, the thresholds, and the training flags it
/// reads ([`PREDICT_FLAGS`]: `--data` is the folder to predict; the model, transform and
/// runtime flags are read as training reads them).
#[derive(Debug, Clone, Args)]
pub struct PredictArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelFile,

    /// Per-class thresholds for decisions.csv: a JSON file with `"thresholds": [8 numbers in
    /// 0..=1]` as `--tune-thresholds` writes beside each best model. Default: `<checkpoint>.json`
    /// where it exists (refused when it records another epoch than the checkpoint), else 0.5
    /// for every class.
    #[arg(long, value_name = "FILE")]
    pub thresholds: Option<PathBuf>,

    /// The training flags.
    #[command(flatten)]
    pub config: TrainConfig,
}

/// `ddp-train evaluate`'s flags: the model file and the training flags it reads
/// ([`PREDICT_FLAGS`] and [`EVALUATE_FLAGS`]: `--data` is the labelled folder to score, every
/// image of it).
#[derive(Debug, Clone, Args)]
pub struct EvaluateArgs {
    /// The model.
    #[command(flatten)]
    pub model: ModelFile,

    /// The training flags.
    #[command(flatten)]
    pub config: TrainConfig,
}

/// The training flags (their ids in [`TrainConfig`]'s command) that `predict` reads: the
/// model, the evaluation transform, the batches and the runtime. `ddp-train predict` hides
/// the others from its help and refuses them, so that none is given in vain.
pub const PREDICT_FLAGS: &[&str] = &[
    "data",
    "image_size",
    "normalize",
    "eval_resize",
    "eval_interpolation",
    "model",
    "dropout",
    "eye_combine",
    "batch_size",
    "precision",
    "out",
    "runtime.device",
    "runtime.threads",
    "runtime.workers",
    "runtime.prefetch",
    "runtime.collective_timeout_secs",
    "local_rank",
    "nproc_per_node",
];

/// ODIR's flags that only training reads: its augmentations and the reduced JPEG decode.
/// `--eval-only` refuses them, and leaves them out of the task's description, which it
/// compares with the model's run.
pub const ODIR_TRAINING_ONLY: [&str; 8] = [
    "min_crop_scale",
    "hflip",
    "vflip",
    "rotation",
    "brightness",
    "contrast",
    "saturation",
    "dct_upsampling",
];

/// The training flags `evaluate` reads besides [`PREDICT_FLAGS`]: how the labelled folder is
/// opened.
pub const EVALUATE_FLAGS: &[&str] = &["labels", "skip_corrupt", "image_dir"];

/// The model `predict` and `evaluate` run, and where in its file it is.
#[derive(Debug, Clone, Args)]
pub struct ModelFile {
    /// The model: a best-model file or checkpoint of a run (`.safetensors`), a run directory
    /// (its latest checkpoint), or a PyTorch file of the same model (`torch.save` of its
    /// state_dict, or a training checkpoint holding it).
    #[arg(long = "checkpoint", value_name = "FILE")]
    pub checkpoint: PathBuf,

    /// The entry of a PyTorch `--checkpoint` that holds the state_dict (`checkpoint[KEY]`),
    /// for a file with several; a training checkpoint with one (`{"epoch": 3, "model":
    /// ...}`) is read without it.
    #[arg(long = "checkpoint-key", value_name = "KEY")]
    pub key: Option<String>,
}

/// What `predict` did.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Images predicted.
    pub images: usize,
    /// Patients in submission.csv.
    pub patients: usize,
    /// Patients predicted from one eye only.
    pub one_eye: Vec<u64>,
    /// The entry of the checkpoint's file that held the model (a PyTorch training
    /// checkpoint's).
    pub checkpoint_entry: Option<String>,
    /// The model file read and its epoch ([`Scored::model`]).
    pub model: (PathBuf, Option<u64>),
    /// The thresholds of decisions.csv, and the file they came from (`None`: 0.5).
    pub thresholds: ([f64; 8], Option<PathBuf>),
    /// The files written (rank 0 only; empty on the other ranks).
    pub files: Vec<PathBuf>,
    /// The number of ranks.
    pub world_size: usize,
    /// Whether this is rank 0.
    pub rank0: bool,
}

/// Runs `ddp-train predict` as this rank.
pub fn predict(args: &PredictArgs) -> Result<Prediction, TrainError> {
    let c = &args.config;
    c.validate()?;
    utf8_paths([
        ("--checkpoint", Some(args.model.checkpoint.as_path())),
        ("--thresholds", args.thresholds.as_deref()),
    ])?;
    let set = Arc::new(OdirDataset::open_unlabelled(&c.data)?);
    // Read before meeting the other ranks: a bad file fails on every rank alike. The
    // thresholds are checked against the model read, not the file as it is now.
    let model = LoadedModel::load(c, &args.model)?;
    let ThresholdFile {
        thresholds,
        tuned_with,
        unchecked,
    } = read_thresholds(
        args.thresholds.as_deref(),
        &args.model.checkpoint,
        model.checkpoint.epoch,
    )?;
    let scored = score(c, &args.model, model, set)?;
    if let (Some(why), 0) = (&unchecked, scored.rank) {
        tracing::warn!("warning: {why}");
    }
    let beside = args.model.checkpoint.with_extension("json");
    if thresholds.1.is_none() && scored.trained_tuned_thresholds && !beside.exists() {
        // A best model saved while its thresholds were being replaced, or a copy of it.
        tracing::warn!(
            "warning: the model's run tuned thresholds (--tune-thresholds), and none are \
             beside {} ({} is not there), so the patients are decided at 0.5; give \
             --thresholds FILE (the run's checkpoints/epoch-NNNN.<model>.json keep the tuned \
             ones of each best epoch)",
            args.model.checkpoint.display(),
            beside.display()
        );
    }
    let combine = c.eye_combine.as_str();
    // Thresholds tuned with the combination the model's run recorded (those beside its best
    // model) are named by score's warning already, which gives the same flag.
    let trained = scored.trained_eye_combine.map(EyeCombine::as_str);
    if let (Some(tuned), Some(file), 0) = (&tuned_with, &thresholds.1, scored.rank) {
        if tuned != combine && trained != Some(tuned.as_str()) {
            tracing::warn!(
                "warning: the thresholds of {} were tuned with --eye-combine {tuned}, and the \
                 eyes are combined with {combine}: give --eye-combine {tuned}",
                file.display()
            );
        }
    }
    let patients = scored.stats.patient_predictions();
    // Every rank has the same list; rank 0 names them.
    if scored.rank == 0 {
        let eye = |id: u64| {
            scored
                .set
                .samples()
                .iter()
                .find(|s| s.patient_id == id)
                .map(|s| file_name(&s.path))
                .unwrap_or_default()
        };
        if let Some(warning) = one_eye_warning(&patients.one_eye, eye) {
            tracing::warn!("{warning}");
        }
    }
    let mut files = Vec::new();
    if scored.rank == 0 {
        let write = |name: &str, text: String| -> Result<PathBuf, TrainError> {
            let path = scored.out.join(name);
            ddp_model::checkpoint::write_atomic(&path, text.as_bytes())
                .map_err(|e| TrainError::io(format!("cannot write {}", path.display()), e))?;
            Ok(path)
        };
        // The three belong together: an earlier prediction's go first, so that a crash
        // between the writes leaves none of another model's beside the new ones.
        for name in ["submission.csv", "predictions.csv", "decisions.csv"] {
            let path = scored.out.join(name);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(TrainError::io(
                        format!("cannot replace {}", path.display()),
                        e,
                    ))
                }
                _ => {}
            }
        }
        files.push(write("submission.csv", submission_csv(&patients.rows))?);
        files.push(write("predictions.csv", predictions_csv(&scored))?);
        files.push(write(
            "decisions.csv",
            decisions_csv(&patients.rows, &thresholds.0),
        )?);
    }
    Ok(Prediction {
        images: scored.set.len(),
        patients: patients.rows.len(),
        one_eye: patients.one_eye,
        checkpoint_entry: scored.checkpoint_entry,
        model: scored.model,
        thresholds,
        files,
        world_size: scored.world_size,
        rank0: scored.rank == 0,
    })
}

/// What `evaluate` measured: the challenge's metrics and the per-image ones, with what was
/// scored; rank 0 has written it to `evaluation.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// The report: `odir_*` and `val_*` metrics, the counts, and what was scored.
    pub report: Map<String, Value>,
    /// Where rank 0 wrote it.
    pub file: PathBuf,
    /// The model file read and its epoch ([`Scored::model`]).
    pub model: (PathBuf, Option<u64>),
    /// The entry of the checkpoint's file that held the model (a PyTorch training
    /// checkpoint's).
    pub checkpoint_entry: Option<String>,
    /// Whether this is rank 0.
    pub rank0: bool,
}

/// Runs `ddp-train evaluate` as this rank.
pub fn evaluate(args: &EvaluateArgs) -> Result<Evaluation, TrainError> {
    let c = &args.config;
    c.validate()?;
    utf8_paths([("--checkpoint", Some(args.model.checkpoint.as_path()))])?;
    let set = super::task::open_labelled(&c.data, &rank_data_options(c)?, c.labels)?;
    // A folder whose every image --skip-corrupt left out has nothing to score (its metrics
    // would be NaN): refused as training refuses it, naming the folder and the first image.
    ddp_data::odir::all_indices(&set)?;
    let model = LoadedModel::load(c, &args.model)?;
    let scored = score(c, &args.model, model, Arc::new(set))?;
    let mut report = scored.stats.report();
    report.extend(scored.stats.details());
    let mut report = report.into_map();
    report.insert(
        "checkpoint".into(),
        json!(args.model.checkpoint.to_string_lossy()),
    );
    if let Some(entry) = &scored.checkpoint_entry {
        report.insert("checkpoint_entry".into(), json!(entry));
    }
    let (model_file, model_epoch) = &scored.model;
    report.insert("model_file".into(), json!(model_file.to_string_lossy()));
    report.insert("model_epoch".into(), json!(model_epoch));
    report.insert("data".into(), json!(c.data.to_string_lossy()));
    report.insert("images".into(), json!(scored.set.len()));
    if c.skip_corrupt {
        report.insert("skipped_images".into(), skipped_json(scored.set.skipped()));
        if scored.rank == 0 {
            for line in skipped_lines(scored.set.skipped()) {
                tracing::warn!("warning: {line}");
            }
        }
    }
    report.insert("eye_combine".into(), json!(c.eye_combine.as_str()));
    report.insert("world_size".into(), json!(scored.world_size));
    let file = scored.out.join("evaluation.json");
    if scored.rank == 0 {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| TrainError::Invalid(format!("encoding evaluation.json: {e}")))?;
        ddp_model::checkpoint::write_atomic(&file, text.as_bytes())
            .map_err(|e| TrainError::io(format!("cannot write {}", file.display()), e))?;
    }
    Ok(Evaluation {
        report,
        file,
        rank0: scored.rank == 0,
        model: scored.model,
        checkpoint_entry: scored.checkpoint_entry,
    })
}

/// Per-class thresholds and the file they came from (`None`: 0.5).
type Thresholds = ([f64; 8], Option<PathBuf>);

/// What [`read_thresholds`] found.
#[derive(Debug, PartialEq)]
struct ThresholdFile {
    thresholds: Thresholds,
    /// The `--eye-combine` the file says they were tuned with.
    tuned_with: Option<String>,
    /// Why thresholds found beside the model could not be checked to be its, or why a file
    /// found there was not used (a warning).
    unchecked: Option<String>,
}

/// The thresholds of `given`, else of `<checkpoint>.json` where it exists and holds
/// thresholds, else 0.5; and the `--eye-combine` the file says they were tuned with.
///
/// Thresholds found beside the model must be its: the training records the epoch in both
/// files, and a file of another epoch than `model_epoch` (that of the model read from
/// `checkpoint`) is refused (another model of the run had it). Where either file records no
/// epoch (thresholds written by hand, a model from elsewhere) they are used with a warning.
/// `given` files are the user's choice, and not checked.
fn read_thresholds(
    given: Option<&Path>,
    checkpoint: &Path,
    model_epoch: Option<u64>,
) -> Result<ThresholdFile, TrainError> {
    let beside = checkpoint.with_extension("json");
    let path = match given {
        Some(p) => p.to_path_buf(),
        None if checkpoint.is_file() && beside.is_file() => beside,
        None => {
            return Ok(ThresholdFile {
                thresholds: ([THRESHOLD; 8], None),
                tuned_with: None,
                unchecked: None,
            })
        }
    };
    let bad = |why: String| {
        let (what, or) = match given {
            Some(_) => (format!("--thresholds {}", path.display()), ""),
            None => (
                format!("the thresholds beside the model ({})", path.display()),
                " (or give --thresholds FILE, or remove it to decide at 0.5)",
            ),
        };
        TrainError::Invalid(format!(
            "{what}: {why}; expected a JSON object with \"thresholds\": [8 numbers in N, D, \
             G, C, A, H, M, O order], as --tune-thresholds writes{or}"
        ))
    };
    let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
    let doc = serde_json::from_str::<Value>(&text);
    // A JSON file of the model's name that holds no thresholds (a PyTorch model's config
    // beside its `.pth`, say) was not written for this program: 0.5, with a warning. One
    // that does not read (thresholds cut short, say) is refused below.
    if given.is_none() && matches!(&doc, Ok(d) if d.get("thresholds").is_none()) {
        return Ok(ThresholdFile {
            thresholds: ([THRESHOLD; 8], None),
            tuned_with: None,
            unchecked: Some(format!(
                "{} beside the model holds no \"thresholds\" (it is no file of \
                 --tune-thresholds), so the patients are decided at 0.5; give --thresholds \
                 FILE to decide at others",
                path.display()
            )),
        });
    }
    let doc = doc.map_err(|e| bad(e.to_string()))?;
    let list = doc
        .get("thresholds")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no \"thresholds\" list".into()))?;
    if list.len() != LABELS.len() {
        return Err(bad(format!("\"thresholds\" holds {} entries", list.len())));
    }
    let mut thresholds = [0.0; 8];
    for (k, (t, v)) in thresholds.iter_mut().zip(list).enumerate() {
        let refused = |what: &str| {
            bad(format!(
                "threshold {} (class {}) is {v}, not {what}",
                k + 1,
                LABELS[k]
            ))
        };
        *t = v
            .as_f64()
            .filter(|t| t.is_finite())
            .ok_or_else(|| refused("a finite number"))?;
        // They are compared with probabilities: 50 (a percentage) would decide 0 for every
        // patient, a negative threshold 1. But the tuner writes the negative float nearest
        // zero where its best decision takes every patient, those at probability 0 too.
        if !(below(0.0)..=1.0).contains(t) {
            return Err(refused("a probability in 0..=1"));
        }
    }
    if let Some(classes) = doc.get("classes") {
        let names: Option<Vec<&str>> = classes
            .as_array()
            .map(|c| c.iter().map(Value::as_str).collect::<Option<_>>())
            .unwrap_or_default();
        if names.as_deref() != Some(&LABELS[..]) {
            return Err(bad(format!(
                "its \"classes\" are {classes}, not {}",
                LABELS.join(", ")
            )));
        }
    }
    let tuned_with = doc
        .get("eye_combine")
        .and_then(Value::as_str)
        .map(str::to_string);
    let unchecked = match given {
        Some(_) => None,
        None => belongs_to_model(&path, doc.get("epoch"), checkpoint, model_epoch)?,
    };
    Ok(ThresholdFile {
        thresholds: (thresholds, Some(path)),
        tuned_with,
        unchecked,
    })
}

/// Whether the thresholds of `file`, tuned at `epoch` (its `"epoch"`), belong to the model
/// read from `checkpoint` beside it, of `model_epoch`: an error when the model is of another
/// epoch; a warning when either records none.
fn belongs_to_model(
    file: &Path,
    epoch: Option<&Value>,
    checkpoint: &Path,
    model_epoch: Option<u64>,
) -> Result<Option<String>, TrainError> {
    let tuned_at = match epoch {
        None => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            TrainError::Invalid(format!(
                "{}: its \"epoch\" is {v}, not the number of the epoch the thresholds were \
                 tuned at",
                file.display()
            ))
        })?),
    };
    let which = match (tuned_at, model_epoch) {
        (Some(a), Some(b)) if a == b => return Ok(None),
        (Some(a), Some(b)) => {
            return Err(TrainError::Invalid(format!(
                "the thresholds beside the model, {}, were tuned for the model of epoch {a}, \
                 and {} is the model of epoch {b}: give --thresholds FILE to decide at \
                 thresholds of your choice, or remove {} to decide at 0.5",
                file.display(),
                checkpoint.display(),
                file.display()
            )))
        }
        (None, Some(_)) => "the thresholds record no epoch",
        (Some(_), None) => "the model records no epoch",
        (None, None) => "neither records an epoch",
    };
    Ok(Some(format!(
        "the thresholds of {} are used for {} unchecked: {which}, so nothing shows they were \
         tuned for this model; give --thresholds {} to use them without this warning, or remove \
         it to decide at 0.5",
        file.display(),
        checkpoint.display(),
        file.display()
    )))
}

/// The warning for the patients predicted from one image (`eye` names it), one line
/// however many: the first [`ONE_EYE_SHOWN`] and how many more, as a folder of left eyes
/// only has thousands.
fn one_eye_warning(one_eye: &[u64], eye: impl Fn(u64) -> String) -> Option<String> {
    match one_eye {
        [] => None,
        [id] => Some(format!(
            "patient {id} has one image only ({}): its prediction is that eye's alone",
            eye(*id)
        )),
        _ => {
            let shown: Vec<String> = one_eye
                .iter()
                .take(ONE_EYE_SHOWN)
                .map(|&id| format!("{id} ({})", eye(id)))
                .collect();
            let more = match one_eye.len().saturating_sub(ONE_EYE_SHOWN) {
                0 => String::new(),
                n => format!(" and {n} more"),
            };
            Some(format!(
                "{} patients have one image only, each predicted from that eye alone: {}{more}",
                one_eye.len(),
                shown.join(", ")
            ))
        }
    }
}

/// The one-eyed patients [`one_eye_warning`] names.
const ONE_EYE_SHOWN: usize = 10;

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn header(first: &str) -> String {
    format!("{first},{}\n", LABELS.join(","))
}

fn push_row(out: &mut String, first: &str, values: impl IntoIterator<Item = String>) {
    let values: Vec<String> = values.into_iter().collect();
    // Infallible: writing to a String.
    let _ = writeln!(out, "{first},{}", values.join(","));
}

/// The challenge's submission: `ID,N,D,G,C,A,H,M,O` and one row per patient, in ascending
/// ID.
pub fn submission_csv(patients: &[(u64, [f64; 8])]) -> String {
    let mut out = header("ID");
    for (id, p) in patients {
        push_row(&mut out, &id.to_string(), p.iter().map(f64::to_string));
    }
    out
}

/// Each patient's 0/1 decisions, `probability > threshold` per class.
fn decisions_csv(patients: &[(u64, [f64; 8])], thresholds: &[f64; 8]) -> String {
    let mut out = header("ID");
    for (id, p) in patients {
        let decided = p
            .iter()
            .zip(thresholds)
            .map(|(p, t)| u8::from(p > t).to_string());
        push_row(&mut out, &id.to_string(), decided);
    }
    out
}

/// Each image's probabilities: `image,eye,N,..,O`, in the folder's order (ID, left first).
fn predictions_csv(scored: &Scored) -> String {
    let mut out = header("image,eye");
    for (key, row) in scored.stats.image_rows().iter() {
        let name = scored
            .set
            .get(key as usize)
            .map(|s| file_name(&s.path))
            .unwrap_or_default();
        let eye = parse_image_name(&name).map_or("", |(_, e)| e.as_str());
        push_row(
            &mut out,
            &format!("{name},{eye}"),
            row.iter().map(f64::to_string),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use std::path::Path;

    use super::super::score::load_checkpoint;
    use super::{
        one_eye_warning, read_thresholds, ModelFile, ThresholdFile, TrainConfig, TrainError,
        EVALUATE_FLAGS, PREDICT_FLAGS,
    };

    #[test]
    fn the_flags_predict_and_evaluate_read_are_training_flags() {
        let command = TrainConfig::command();
        let ids: Vec<&str> = command
            .get_arguments()
            .map(|a| a.get_id().as_str())
            .collect();
        for id in PREDICT_FLAGS.iter().chain(EVALUATE_FLAGS) {
            assert!(ids.contains(id), "no training flag has the id {id}");
        }
    }

    /// Each entry is read in its place: one that is no number was dropped before, which moved
    /// the later classes' thresholds onto their neighbours.
    #[test]
    fn thresholds_are_eight_finite_numbers_in_the_classes_order() {
        let tmp = ddp_testkit::temp_dir("ddp-train-thresholds");
        let file = tmp.path().join("t.json");
        let model = tmp.path().join("model.safetensors");
        let read = |text: &str| {
            std::fs::write(&file, text).unwrap();
            read_thresholds(Some(&file), &model, None).map(
                |ThresholdFile {
                     thresholds,
                     tuned_with,
                     ..
                 }| (thresholds.0, tuned_with),
            )
        };
        let ok = read(
            r#"{"classes": ["N","D","G","C","A","H","M","O"],
                "thresholds": [0.5, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.3], "eye_combine": "mean"}"#,
        )
        .unwrap();
        assert_eq!(
            ok,
            (
                [0.5, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.3],
                Some("mean".to_string())
            )
        );
        let refused = |text: &str, why: &str| match read(text) {
            Err(TrainError::Invalid(e)) => assert_eq!(
                e,
                format!(
                    "--thresholds {}: {why}; expected a JSON object with \"thresholds\": [8 \
                     numbers in N, D, G, C, A, H, M, O order], as --tune-thresholds writes",
                    file.display()
                )
            ),
            other => panic!("{text}: {other:?}"),
        };
        refused(
            r#"{"thresholds": [0.5, 0.5, "x", 0.5, 0.5, 0.5, 0.5, 0.5, 0.3]}"#,
            "\"thresholds\" holds 9 entries",
        );
        refused(
            r#"{"thresholds": [0.5, 0.5, "x", 0.5, 0.5, 0.5, 0.5, 0.3]}"#,
            "threshold 3 (class G) is \"x\", not a finite number",
        );
        refused(
            r#"{"thresholds": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, null]}"#,
            "threshold 8 (class O) is null, not a finite number",
        );
        // They are compared with probabilities: percentages typed by hand decided 0 for
        // every patient, a negative threshold 1.
        refused(
            r#"{"thresholds": [50, 40, 50, 50, 50, 50, 50, 30]}"#,
            "threshold 1 (class N) is 50, not a probability in 0..=1",
        );
        refused(
            r#"{"thresholds": [0.5, 0.5, 0.5, 0.5, 0.5, -0.1, 0.5, 0.5]}"#,
            "threshold 6 (class H) is -0.1, not a probability in 0..=1",
        );
        let bounds = read(r#"{"thresholds": [0, 1, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]}"#).unwrap();
        assert_eq!(bounds.0, [0.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5]);
        // What --tune-thresholds writes when its best decision takes every patient, those
        // at probability 0 too (serde_json writes it as -5e-324).
        let all = [super::below(0.0), 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5];
        let all = serde_json::json!({ "thresholds": all }).to_string();
        assert_eq!(read(&all).unwrap().0[0], -f64::from_bits(1));
        refused(
            r#"{"classes": ["N","D","G","C","A","H","O","M"],
                "thresholds": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]}"#,
            r#"its "classes" are ["N","D","G","C","A","H","O","M"], not N, D, G, C, A, H, M, O"#,
        );
    }

    /// One warning names the patients predicted from one image, however many: a folder of
    /// left eyes only logged a line per patient.
    #[test]
    fn one_warning_names_the_first_ten_one_eyed_patients_and_counts_the_rest() {
        let eye = |id: u64| format!("{id}_left.jpg");
        let twelve: Vec<u64> = (1..=12).collect();
        assert_eq!(
            one_eye_warning(&twelve, eye).as_deref(),
            Some(
                "12 patients have one image only, each predicted from that eye alone: \
                 1 (1_left.jpg), 2 (2_left.jpg), 3 (3_left.jpg), 4 (4_left.jpg), \
                 5 (5_left.jpg), 6 (6_left.jpg), 7 (7_left.jpg), 8 (8_left.jpg), \
                 9 (9_left.jpg), 10 (10_left.jpg) and 2 more"
            )
        );
        assert_eq!(
            one_eye_warning(&twelve[..10], eye).as_deref(),
            Some(
                "10 patients have one image only, each predicted from that eye alone: \
                 1 (1_left.jpg), 2 (2_left.jpg), 3 (3_left.jpg), 4 (4_left.jpg), \
                 5 (5_left.jpg), 6 (6_left.jpg), 7 (7_left.jpg), 8 (8_left.jpg), \
                 9 (9_left.jpg), 10 (10_left.jpg)"
            )
        );
        assert_eq!(
            one_eye_warning(&[17], eye).as_deref(),
            Some("patient 17 has one image only (17_left.jpg): its prediction is that eye's alone")
        );
        assert_eq!(one_eye_warning(&[], eye), None);
    }

    /// Thresholds beside a model must be its: of another epoch they are refused; where
    /// either file records no epoch they are used with a warning; a file given with
    /// --thresholds is the user's choice.
    #[test]
    fn thresholds_beside_a_model_of_another_epoch_are_refused() {
        let tmp = ddp_testkit::temp_dir("ddp-train-thresholds-epoch");
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let _ = vs.root().zeros("w", &[2]);
        let model = tmp.path().join("best-score.safetensors");
        let meta = std::collections::HashMap::from([("epoch".to_string(), "5".to_string())]);
        ddp_model::checkpoint::save(&vs, &model, &meta).unwrap();
        let epoch = |model: &Path| {
            let file = ModelFile {
                checkpoint: model.to_path_buf(),
                key: None,
            };
            load_checkpoint(&vs, &file).unwrap().epoch
        };
        let beside = tmp.path().join("best-score.json");
        let write = |epoch: &str| {
            let text =
                format!(r#"{{"thresholds": [0.5, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.3]{epoch}}}"#);
            std::fs::write(&beside, text).unwrap();
        };
        write(r#", "epoch": 5"#);
        let read = read_thresholds(None, &model, epoch(&model)).unwrap();
        assert_eq!(read.thresholds.1.as_deref(), Some(beside.as_path()));
        assert_eq!(read.thresholds.0[7], 0.3);
        assert_eq!(read.unchecked, None);

        write(r#", "epoch": 1"#);
        match read_thresholds(None, &model, epoch(&model)) {
            Err(TrainError::Invalid(e)) => assert_eq!(
                e,
                format!(
                    "the thresholds beside the model, {b}, were tuned for the model of epoch 1, \
                     and {m} is the model of epoch 5: give --thresholds FILE to decide at \
                     thresholds of your choice, or remove {b} to decide at 0.5",
                    b = beside.display(),
                    m = model.display()
                )
            ),
            other => panic!("{other:?}"),
        }
        // Given by name, they are used as they are.
        let given = read_thresholds(Some(&beside), &model, epoch(&model)).unwrap();
        assert_eq!((given.thresholds.0[7], given.unchecked), (0.3, None));

        write("");
        let unchecked = read_thresholds(None, &model, epoch(&model))
            .unwrap()
            .unchecked
            .unwrap();
        assert!(
            unchecked.contains("are used for")
                && unchecked.contains("unchecked: the thresholds record no epoch"),
            "{unchecked}"
        );
        // A JSON file of the model's name that is no thresholds file is not used, with a
        // warning; given by name, it is refused, and so is one that is no JSON (damaged).
        std::fs::write(&beside, r#"{"thresholds": [0.5, 0.4"#).unwrap();
        assert!(read_thresholds(None, &model, epoch(&model)).is_err());
        for text in [r#"{"hidden_size": 512}"#, "[1, 2]"] {
            std::fs::write(&beside, text).unwrap();
            let read = read_thresholds(None, &model, epoch(&model)).unwrap();
            assert_eq!(read.thresholds, ([super::THRESHOLD; 8], None));
            assert_eq!(
                read.unchecked.unwrap(),
                format!(
                    "{} beside the model holds no \"thresholds\" (it is no file of \
                     --tune-thresholds), so the patients are decided at 0.5; give \
                     --thresholds FILE to decide at others",
                    beside.display()
                )
            );
            assert!(read_thresholds(Some(&beside), &model, epoch(&model)).is_err());
        }
        // A model file without metadata (safetensors of PyTorch's, say).
        let plain = tmp.path().join("plain.safetensors");
        ddp_model::checkpoint::save(&vs, &plain, &Default::default()).unwrap();
        std::fs::write(
            plain.with_extension("json"),
            r#"{"thresholds": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], "epoch": 2}"#,
        )
        .unwrap();
        let unchecked = read_thresholds(None, &plain, epoch(&plain))
            .unwrap()
            .unchecked
            .unwrap();
        assert!(
            unchecked.contains("unchecked: the model records no epoch"),
            "{unchecked}"
        );
        write(r#", "epoch": "five""#);
        match read_thresholds(None, &model, epoch(&model)) {
            Err(TrainError::Invalid(e)) => assert!(e.contains(r#"its "epoch" is "five""#), "{e}"),
            other => panic!("{other:?}"),
        }
    }

    /// The thresholds are checked against the model read, not the file as it is after: a
    /// best model replaced (by a run still training) between the two reads paired the new
    /// model's epoch with the thresholds of the one scored.
    #[test]
    fn thresholds_are_checked_against_the_model_read() {
        let tmp = ddp_testkit::temp_dir("ddp-train-thresholds-model-read");
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let w = vs.root().zeros("w", &[1]);
        let model = tmp.path().join("best-score.safetensors");
        // The training's model, `w` = its epoch.
        let save = |epoch: u64| {
            let training = tch::nn::VarStore::new(tch::Device::Cpu);
            let _ = training
                .root()
                .var("w", &[1], tch::nn::Init::Const(epoch as f64));
            let meta = std::collections::HashMap::from([("epoch".into(), epoch.to_string())]);
            ddp_model::checkpoint::save(&training, &model, &meta).unwrap();
        };
        save(4);
        std::fs::write(
            model.with_extension("json"),
            r#"{"thresholds": [0.5, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.3], "epoch": 4}"#,
        )
        .unwrap();
        let file = ModelFile {
            checkpoint: model.clone(),
            key: None,
        };
        let read = load_checkpoint(&vs, &file).unwrap();
        // The training saves its next best model (the thresholds' file not yet replaced).
        save(5);
        assert_eq!(
            (read.epoch, read.file.as_path()),
            (Some(4), model.as_path())
        );
        assert_eq!(f64::try_from(&w).unwrap(), 4.0);
        let thresholds = read_thresholds(None, &model, read.epoch).unwrap();
        assert_eq!(
            (thresholds.thresholds.0[7], thresholds.unchecked),
            (0.3, None)
        );
        // Read after the save, the model is epoch 5's, and the thresholds are not its.
        let again = load_checkpoint(&vs, &file).unwrap();
        assert_eq!(f64::try_from(&w).unwrap(), 5.0);
        match read_thresholds(None, &model, again.epoch) {
            Err(TrainError::Invalid(e)) => assert!(
                e.contains("were tuned for the model of epoch 4") && e.contains("of epoch 5"),
                "{e}"
            ),
            other => panic!("{other:?}"),
        }
    }
}
