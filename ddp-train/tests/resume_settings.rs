//! What a resumed or evaluated model's run recorded, against the settings given now: a resume
//! warns of each setting and task key that changes at the resume point; checkpoints as earlier
//! versions wrote them; a resume inside an epoch continues the run exactly. One rank, in this
//! process, on the regression task: each test holds libtorch's generator.

mod common;

use std::path::Path;

use common::free_port;
use common::regression::{hold_generator, points, quiet_settings, Regression};
use ddp_data::Batch;
use ddp_train::lr_schedule::{LrSchedule, Plateau};
use ddp_train::{RegressionStats, Settings, Task, TrainError, Trainer};
use serde_json::{json, Value};
use tch::{nn, Tensor};

/// The regression task on 64 points, described to `config.json` as `description`.
fn task(description: Value) -> Regression {
    let mut task = Regression::new(points(64, 1), points(8, 2));
    task.description = description;
    task
}

/// `epochs` of 4 steps into `out` with seed 3, one thread, nothing drawn.
fn settings(out: &Path, epochs: u64) -> Settings {
    quiet_settings(out).epochs(epochs)
}

/// The regression task with its validation samples fixed whatever the seed (`seeded` false),
/// the keys of its description that name where the data lies, and those of them whose
/// presence changes the data (`None`: all, the default).
struct Placed {
    inner: Regression,
    seeded: bool,
    locations: &'static [&'static str],
    presence: Option<&'static [&'static str]>,
}

impl Task for Placed {
    type Model = nn::Sequential;
    type Data = <Regression as Task>::Data;
    type Stats = RegressionStats;

    fn model(&self, root: &nn::Path) -> nn::Sequential {
        self.inner.model(root)
    }
    fn train_data(&self) -> Self::Data {
        self.inner.train_data()
    }
    fn val_data(&self) -> Option<Self::Data> {
        self.inner.val_data()
    }
    fn train_loss(&self, model: &nn::Sequential, batch: &Batch) -> Tensor {
        self.inner.train_loss(model, batch)
    }
    fn new_stats(&self) -> RegressionStats {
        self.inner.new_stats()
    }
    fn eval_batch(&self, model: &nn::Sequential, batch: &Batch, s: &mut RegressionStats) -> Tensor {
        self.inner.eval_batch(model, batch, s)
    }
    fn describe(&self) -> Value {
        self.inner.describe()
    }
    fn validation_depends_on_seed(&self) -> bool {
        self.seeded
    }
    fn location_keys(&self) -> &[&str] {
        self.locations
    }
    fn presence_keys(&self) -> &[&str] {
        self.presence.unwrap_or(self.locations)
    }
}

fn start<T: Task>(task: T, settings: Settings) -> Result<Trainer<T>, TrainError> {
    let env = ddp_comm::EnvConfig::new(0, 1, "127.0.0.1", free_port());
    Trainer::with_env(task, settings, &env)
}

/// Trains `task` with `settings` to their end.
fn train<T: Task>(task: T, settings: Settings) {
    start(task, settings).unwrap().run().unwrap();
}

/// `settings` resumed from `latest` for `epochs`.
fn resumed(mut s: Settings, epochs: u64) -> Settings {
    s.epochs = epochs;
    s.checkpoint.resume = Some("latest".into());
    s
}

/// Rewrites the training state in the checkpoint state file `state` with `edit`.
fn edit_state(state: &Path, edit: impl FnOnce(&mut Value)) {
    let mut file = ddp_model::checkpoint::read_tensors(state).unwrap();
    let mut st: Value = serde_json::from_str(&file.metadata["train_state"]).unwrap();
    edit(&mut st);
    file.metadata.insert("train_state".into(), st.to_string());
    ddp_model::checkpoint::write_tensors(file.tensors, &file.metadata, state).unwrap();
}

/// Writes the model of the checkpoint `from` to `to` as an earlier version wrote a best model:
/// recording its epoch alone, not the settings it was trained under.
fn as_an_earlier_version(from: &Path, to: &Path) {
    let mut file = ddp_model::checkpoint::read_tensors(from).unwrap();
    file.metadata.retain(|key, _| key == "epoch");
    ddp_model::checkpoint::write_tensors(file.tensors, &file.metadata, to).unwrap();
}

fn log_of(run: &Path) -> String {
    std::fs::read_to_string(run.join("logs/rank-0.log")).unwrap()
}

/// The lines of `log` that warn of a changed setting.
fn changes(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.starts_with("warning: ") && l.contains(" from here on"))
        .collect()
}

/// A run trained with `{"image_size": 32}` and the first layer frozen until epoch 3, resumed
/// with `{"image_size": 64}` and no freeze, warns of the three changes, each with the run's
/// value and the new one, and of nothing the resume handles elsewhere (the epochs).
#[test]
fn a_resume_warns_of_each_setting_and_task_key_it_changes() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-settings");
    let run = tmp.path().join("run");
    let mut first = settings(&run, 1);
    first.freeze.prefixes = vec!["0".into()];
    first.freeze.unfreeze_at = Some(3);
    train(task(json!({ "image_size": 32 })), first);

    let mut again = resumed(settings(&run, 2), 2);
    // DDP's overlap and bucket views give the same bytes either way: no change.
    again.ddp.overlap = !again.ddp.overlap;
    again.ddp.gradient_as_bucket_view = !again.ddp.gradient_as_bucket_view;
    train(task(json!({ "image_size": 64 })), again);
    let log = log_of(&run);
    assert_eq!(
        changes(&log),
        [
            "warning: freeze.prefixes was [\"0\"] in the run and is [] from here on: the run \
             does not continue as it began (resume with [\"0\"] to continue it exactly)",
            "warning: freeze.unfreeze_at was 3 in the run and is null from here on: the run \
             does not continue as it began (resume with 3 to continue it exactly)",
            "warning: task.image_size was 32 in the run and is 64 from here on: the run does \
             not continue as it began (resume with 32 to continue it exactly)",
        ],
        "{log}"
    );
}

/// A task key whose value is a float that JSON's shortest text reads back exactly only with a
/// correctly rounded parser (283 / 3, as `--pos-weight auto` computes such ratios) is the same
/// on a resume with the same description: nothing warns that it changed.
#[test]
fn a_resume_with_the_same_float_keys_warns_of_no_change() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-floats");
    let run = tmp.path().join("run");
    let description = || json!({ "w": 283.0 / 3.0, "weights": [283.0 / 3.0, 0.1 + 0.2] });
    train(task(description()), settings(&run, 1));
    train(task(description()), resumed(settings(&run, 2), 2));
    let log = log_of(&run);
    assert_eq!(changes(&log), Vec::<&str>::new(), "{log}");
}

/// A checkpoint written before a setting or task key existed (its record lacks
/// `freeze.prefixes` and `task.vflip`) resumes without warning of them, and still of a key it
/// records (`task.image_size`).
#[test]
fn a_resume_warns_of_no_key_the_runs_record_lacks() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-older");
    let run = tmp.path().join("run");
    let description = |size| json!({ "image_size": size, "vflip": true });
    train(task(description(32)), settings(&run, 1));
    edit_state(
        &run.join("checkpoints/epoch-0001.state.safetensors"),
        |st| {
            let config = &mut st["config"];
            config["task"].as_object_mut().unwrap().remove("vflip");
            let freeze = config["settings"]["freeze"].as_object_mut().unwrap();
            assert!(freeze.remove("prefixes").is_some(), "{st}");
        },
    );

    train(task(description(64)), resumed(settings(&run, 2), 2));
    let log = log_of(&run);
    assert_eq!(
        changes(&log),
        [
            "warning: task.image_size was 32 in the run and is 64 from here on: the run does not \
          continue as it began (resume with 32 to continue it exactly)"
        ],
        "{log}"
    );
}

/// A resume with the data given at another place (a link, a job's staging copy) warns of
/// none of the keys the task lists as locations, and still of the others.
#[test]
fn a_resume_compares_no_location_of_the_data() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-locations");
    let run = tmp.path().join("run");
    let placed = |data: &str, size: u32| Placed {
        inner: task(json!({ "data": data, "image_size": size, "tmp": data })),
        seeded: true,
        locations: &["data"],
        presence: None,
    };
    train(placed("/data/odir", 32), settings(&run, 1));
    train(placed("/tmp/job-7/odir", 32), resumed(settings(&run, 2), 2));
    let log = log_of(&run);
    assert_eq!(
        changes(&log),
        [
            "warning: task.tmp was \"/data/odir\" in the run and is \"/tmp/job-7/odir\" from \
          here on: the run does not continue as it began (resume with \"/data/odir\" to \
          continue it exactly)"
        ],
        "{log}"
    );
}

/// Validation data given at the start and dropped at the resume is a change, though its
/// folder is a location: without it the task validates on another set.
#[test]
fn a_resume_warns_of_a_location_given_or_dropped() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-dropped");
    let run = tmp.path().join("run");
    let placed = |val_data: Value| Placed {
        inner: task(json!({ "val_data": val_data })),
        seeded: true,
        locations: &["val_data"],
        presence: None,
    };
    train(placed(json!("/data/offsite")), settings(&run, 1));
    train(placed(Value::Null), resumed(settings(&run, 2), 2));
    let log = log_of(&run);
    assert_eq!(
        changes(&log),
        [
            "warning: task.val_data was \"/data/offsite\" in the run and is null from here on: \
             the run does not continue as it began (resume with \"/data/offsite\" to continue \
             it exactly)"
        ],
        "{log}"
    );
}

/// A location that is not a presence key (ODIR's `image_dir`: another folder, or none, with
/// the same images) may be given at a resume where the run had none: no change.
#[test]
fn a_resume_warns_of_no_location_given_whose_presence_changes_nothing() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-image-dir");
    let run = tmp.path().join("run");
    let placed = |image_dir: Value| Placed {
        inner: task(json!({ "val_data": null, "image_dir": image_dir })),
        seeded: true,
        locations: &["val_data", "image_dir"],
        presence: Some(&["val_data"]),
    };
    train(placed(Value::Null), settings(&run, 1));
    train(
        placed(json!("/scratch/job-7/images")),
        resumed(settings(&run, 2), 2),
    );
    let log = log_of(&run);
    assert!(log.contains("resumed from"), "{log}");
    assert_eq!(changes(&log), Vec::<&str>::new(), "{log}");
}

/// A task whose validation samples do not depend on the seed evaluates a model trained with
/// seed 3 with seed 0; one whose samples do (the default) is refused.
#[test]
fn an_evaluation_takes_another_seed_when_the_validation_set_is_fixed() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-eval-fixed");
    let run = tmp.path().join("run");
    let placed = |seeded| Placed {
        inner: task(json!({ "val_data": "/data/offsite" })),
        seeded,
        locations: &[],
        presence: None,
    };
    train(placed(false), settings(&run, 1));
    let evaluation = |seeded, out: &str| {
        let mut s = settings(&tmp.path().join(out), 1).seed(0);
        s.checkpoint.eval_only = true;
        s.checkpoint.resume = Some(
            run.join("checkpoints/epoch-0001.safetensors")
                .to_str()
                .unwrap()
                .into(),
        );
        start(placed(seeded), s)
    };
    let report = evaluation(false, "fixed").unwrap().evaluate().unwrap();
    assert!(
        report.val_loss.is_finite() && report.val_loss > 0.0,
        "{report:?}"
    );
    let Err(TrainError::Setting(e)) = evaluation(true, "seeded") else {
        panic!("an evaluation of a seeded validation split with seed 0 was not refused");
    };
    assert_eq!(e.field(), "seed");
}

/// ODIR's validation set depends on the seed only when split from `--data`, and its
/// description differs only in its location keys when `--data` is given as a link.
#[cfg(feature = "odir")]
#[test]
fn odir_lists_its_locations_and_a_fixed_validation_set() {
    use clap::Parser;
    use ddp_data::odir::synthetic::{generate, SyntheticConfig};
    use ddp_train::odir::{OdirTask, TrainConfig};

    let tmp = common::temp_dir("ddp-train-odir-locations");
    let data = tmp.path().join("data");
    let sample = SyntheticConfig {
        images: 40,
        size: 32,
        ..Default::default()
    };
    generate(&data, &sample).unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&data, &link).unwrap();
    let odir = |args: &[&Path]| {
        let mut line = vec!["ddp-train".to_string(), "--data".into()];
        line.push(args[0].to_str().unwrap().into());
        if let Some(val) = args.get(1) {
            line.extend(["--val-data".into(), val.to_str().unwrap().into()]);
        }
        OdirTask::new(&TrainConfig::try_parse_from(line).unwrap()).unwrap()
    };
    let (split, fixed) = (odir(&[&data]), odir(&[&data, &data]));
    assert!(split.validation_depends_on_seed());
    assert!(!fixed.validation_depends_on_seed());
    let linked = odir(&[&link, &link]);
    let (was, now) = (fixed.describe(), linked.describe());
    let differ: Vec<&String> = was
        .as_object()
        .unwrap()
        .iter()
        .filter(|(key, value)| now[key.as_str()] != **value)
        .map(|(key, _)| key)
        .collect();
    assert_eq!(differ, ["data", "val_data"]);
    assert!(differ
        .iter()
        .all(|k| linked.location_keys().contains(&k.as_str())));
    assert_eq!(linked.presence_keys(), ["val_data"]);
}

/// Checks that an evaluation with seed 0 of each model file, whose run was trained with seed 3,
/// is refused naming the file that records the run's seed.
fn refused_another_seed(models: &[(&Path, &Path)]) {
    let tmp = common::temp_dir("ddp-train-eval-other-seed");
    for (model, record) in models {
        let mut s = settings(tmp.path(), 1).seed(0);
        s.checkpoint.eval_only = true;
        s.checkpoint.resume = Some(model.to_str().unwrap().into());
        let Err(TrainError::Setting(e)) = start(task(json!({})), s) else {
            panic!(
                "an evaluation with seed 0 of {} was not refused",
                model.display()
            );
        };
        assert_eq!(e.field(), "seed");
        assert!(
            e.to_string().starts_with(&format!(
                "seed 0 differs from the seed 3 of {}: a task's validation split",
                record.display()
            )),
            "{e}"
        );
    }
}

/// An evaluation of a model trained with seed 3 is refused with another seed (the task's
/// validation split derives from it), from a checkpoint (its state file's record) or a model
/// file of an earlier version in the run's folder (its `config.json`'s); with seed 3 it
/// evaluates, warning of a task key that differs from the run's.
#[test]
fn an_evaluation_refuses_another_seed_than_the_models_run() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-eval-settings");
    let run = tmp.path().join("run");
    train(task(json!({ "image_size": 32 })), settings(&run, 1));
    let epoch = run.join("checkpoints/epoch-0001.safetensors");
    let weights = run.join("model.safetensors");
    as_an_earlier_version(&epoch, &weights);
    let evaluation = |model: &Path, seed: u64, out: &str| {
        let mut s = settings(&tmp.path().join(out), 1).seed(seed);
        s.checkpoint.eval_only = true;
        s.checkpoint.resume = Some(model.to_str().unwrap().into());
        start(task(json!({ "image_size": 64 })), s)
    };
    refused_another_seed(&[(&epoch, &epoch), (&weights, &run.join("config.json"))]);
    let mut same = evaluation(&weights, 3, "same-seed").unwrap();
    same.evaluate().unwrap();
    let log = log_of(&tmp.path().join("same-seed"));
    assert!(
        log.contains(&format!(
            "warning: task.image_size was 32 in the run that trained the model ({}) and is 64 \
             in this evaluation",
            run.join("config.json").display()
        )),
        "{log}"
    );
    assert!(!log.contains("precision was"), "{log}");
    // Evaluated in another precision than the run evaluated in (autocast).
    assert_eq!(
        bf16_evaluation_warnings(&weights, &tmp.path().join("bf16")),
        [format!(
            "warning: precision was \"fp32\" in the run that trained the model ({}) and is \
             \"bf16\" in this evaluation: give \"fp32\" to evaluate it as it was trained",
            run.join("config.json").display()
        )]
    );
}

/// The warnings of a changed setting of an evaluation of `model` in bf16 into `out`, on the
/// task described as `{"image_size": 32}`.
fn bf16_evaluation_warnings(model: &Path, out: &Path) -> Vec<String> {
    let mut s = settings(out, 1);
    s.checkpoint.eval_only = true;
    s.checkpoint.resume = Some(model.to_str().unwrap().into());
    s.precision = ddp_train::Precision::Bf16;
    start(task(json!({ "image_size": 32 })), s)
        .unwrap()
        .evaluate()
        .unwrap();
    let log = log_of(out);
    log.lines()
        .filter(|l| l.contains(" was "))
        .map(str::to_string)
        .collect()
}

/// A best model records the settings it was made under: of a run trained in fp32 and resumed
/// in bf16, whose best model stays epoch 1's (its `lr` never falls), the best model records
/// fp32 and the resumed epoch's checkpoint bf16, and an evaluation of the best model in bf16
/// warns of fp32, naming the model's record, though `config.json` now holds bf16.
#[test]
fn a_best_model_records_the_precision_it_was_trained_in_across_a_resume() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-best-record");
    let run = tmp.path().join("run");
    let s = settings(&run, 1).monitor(ddp_train::Monitor::min("lr", "best-lr.safetensors"));
    train(task(json!({ "image_size": 32 })), s.clone());
    let mut bf16 = resumed(s, 2);
    bf16.precision = ddp_train::Precision::Bf16;
    train(task(json!({ "image_size": 32 })), bf16);
    let best = run.join("best-lr.safetensors");
    let metadata = |file: &Path| ddp_model::checkpoint::read_tensors(file).unwrap().metadata;
    let precision = |file: &Path| -> Value {
        let record: Value = serde_json::from_str(&metadata(file)["trained_under"]).unwrap();
        record["settings"]["precision"].clone()
    };
    assert_eq!(metadata(&best)["epoch"], "1");
    assert_eq!(precision(&best), "fp32");
    assert_eq!(
        precision(&run.join("checkpoints/epoch-0002.safetensors")),
        "bf16"
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["settings"]["precision"], "bf16");

    assert_eq!(
        bf16_evaluation_warnings(&best, &tmp.path().join("evaluated")),
        [format!(
            "warning: precision was \"fp32\" in the run that trained the model ({}, its own \
             record) and is \"bf16\" in this evaluation: give \"fp32\" to evaluate it as it \
             was trained",
            best.display()
        )]
    );
}

/// An evaluation is refused another seed than the model's run's in earlier versions' records
/// too: a checkpoint whose record has no settings (the first version's, whose command line
/// held the seed; the state holds it in every version), and a `config.json` holding the
/// command line under `config` (the first version's).
#[test]
fn an_evaluation_refuses_another_seed_than_an_earlier_versions_run() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-eval-older");
    let run = tmp.path().join("run");
    train(task(json!({})), settings(&run, 1));
    let epoch = run.join("checkpoints/epoch-0001.safetensors");
    edit_state(
        &run.join("checkpoints/epoch-0001.state.safetensors"),
        |st| {
            st["config"] = json!({ "data": "data", "epochs": 1 });
        },
    );
    let weights = run.join("model.safetensors");
    as_an_earlier_version(&epoch, &weights);
    let config = run.join("config.json");
    std::fs::write(&config, r#"{"config": {"data": "data", "seed": 3}}"#).unwrap();
    refused_another_seed(&[(&epoch, &epoch), (&weights, &config)]);
}

/// Makes the checkpoints of `run`, trained to the end of epoch 2 with a checkpoint every 2
/// steps, what a stop at epoch 2's step 2 left; returns their folder.
fn stop_at_epoch_2_step_2(run: &Path) -> std::path::PathBuf {
    let dir = run.join("checkpoints");
    for file in ["epoch-0002.safetensors", "epoch-0002.state.safetensors"] {
        std::fs::remove_file(dir.join(file)).unwrap();
    }
    std::fs::write(dir.join("latest"), "epoch-0002-step-000002\n").unwrap();
    dir
}

/// The last line of `run`'s `metrics.jsonl`.
fn last_metrics(run: &Path) -> Value {
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    serde_json::from_str(metrics.lines().last().unwrap()).unwrap()
}

/// A run resumed at a step checkpoint inside epoch 2 ends as the uninterrupted run did: the
/// same weights to the bit, the same losses (with the other tests of this file training in
/// parallel threads, each on the same generator).
#[test]
fn a_run_resumed_inside_an_epoch_ends_as_the_uninterrupted_one() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-exact");
    let run = tmp.path().join("run");
    let mut s = settings(&run, 2);
    s.checkpoint.every = Some(2);
    train(task(json!({})), s.clone());
    let end = run.join("checkpoints/epoch-0002.safetensors");
    let whole = ddp_model::checkpoint::read_tensors(&end).unwrap().tensors;
    let whole_metrics = last_metrics(&run);
    let dir = stop_at_epoch_2_step_2(&run);

    train(task(json!({})), resumed(s, 2));
    let log = log_of(&run);
    let step = dir.join("epoch-0002-step-000002.safetensors");
    let from = format!("resumed from {} (epoch 2 at step 2)", step.display());
    assert!(log.contains(&from), "{log}");
    let again = ddp_model::checkpoint::read_tensors(&end).unwrap().tensors;
    assert_eq!(
        again.keys().collect::<Vec<_>>(),
        whole.keys().collect::<Vec<_>>()
    );
    for (name, tensor) in &whole {
        assert!(again[name].equal(tensor), "{name} differs after the resume");
    }
    let metrics = last_metrics(&run);
    for key in ["epoch", "train_loss", "val_loss"] {
        assert_eq!(
            metrics[key], whole_metrics[key],
            "{key}: {metrics} vs {whole_metrics}"
        );
    }
}

/// A step checkpoint as the versions from 919690e to e6ca916 wrote it after an fp16 step
/// skipped with clipping (`"grad_norm_sum": null`, the sum having counted the step's infinite
/// norm) resumes at its step, not from an earlier checkpoint: with a warning, the epoch's
/// gradient norms count from the resume.
#[test]
fn a_step_checkpoint_without_its_norm_sum_resumes_at_its_step() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-norms");
    let run = tmp.path().join("run");
    let mut s = settings(&run, 2);
    s.clip_grad_norm = Some(1.0);
    s.checkpoint.every = Some(2);
    train(task(json!({})), s.clone());
    let dir = stop_at_epoch_2_step_2(&run);
    let state = dir.join("epoch-0002-step-000002.state.safetensors");
    edit_state(&state, |st| {
        let position = st["position"].as_object_mut().unwrap();
        position.insert("grad_norm_sum".into(), Value::Null);
        position.remove("grad_norm_steps");
    });

    s.checkpoint.every = Some(1);
    train(task(json!({})), resumed(s, 2));
    let log = log_of(&run);
    let step = dir.join("epoch-0002-step-000002.safetensors");
    let from = format!("resumed from {} (epoch 2 at step 2)", step.display());
    assert!(log.contains(&from), "{log}");
    assert!(
        log.contains(&format!(
            "warning: {}: the gradient norms of the 2 step(s) of epoch 2 before the checkpoint \
             are unknown",
            state.display()
        )),
        "{log}"
    );
    // The next step's checkpoint counts that step's norm alone.
    let next = dir.join("epoch-0002-step-000003.state.safetensors");
    let next = ddp_model::checkpoint::read_tensors(next).unwrap();
    let next: Value = serde_json::from_str(&next.metadata["train_state"]).unwrap();
    let position = &next["position"];
    assert_eq!(position["grad_norm_steps"], 1, "{next}");
    let first = position["grad_norm_sum"].as_f64().unwrap();
    // The epoch's mean is over its 2 steps after the resume: that one, and the last.
    let last = last_metrics(&run);
    let mean = last["grad_norm"].as_f64().unwrap();
    assert_eq!(last["epoch"], 2, "{last}");
    assert!(
        first > 0.0 && mean.is_finite() && 2.0 * mean > first,
        "{last}"
    );
}

/// A run started from initial weights and resumed without them keeps its start's record of
/// them in `config.json` (a resume loads none), and adds where it resumed from; with a
/// plateau scheduler its learning rate and the scheduler's settings are those in effect
/// (the checkpoint's), not those given.
#[test]
fn a_resumed_runs_config_keeps_its_initial_weights_and_the_lr_in_effect() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-record");
    let run = tmp.path().join("run");
    let init = tmp.path().join("init.safetensors");
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let _model = ddp_train::Task::model(&task(Value::Null), &vs.root());
    ddp_model::checkpoint::save(&vs, &init, &Default::default()).unwrap();
    let plateau = |s: Settings| s.lr_schedule(LrSchedule::Plateau(Plateau::default()));
    let mut first = plateau(settings(&run, 1));
    first.checkpoint.init_from = Some(init.clone());
    train(task(Value::Null), first);

    let mut again = resumed(settings(&run, 2), 2);
    let mut other = Plateau::default();
    other.config.factor = 0.9;
    again = again.lr_schedule(LrSchedule::Plateau(other));
    let ddp_train::optim::OptimizerConfig::Adam(adam) = &mut again.optimizer else {
        panic!("the default optimizer is Adam");
    };
    adam.lr = 0.5;
    train(task(Value::Null), again);
    let text = std::fs::read_to_string(run.join("config.json")).unwrap();
    let config: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(config["init_weights"]["loaded"], true, "{text}");
    assert_eq!(config["init_weights"]["file"], init.to_str().unwrap());
    assert_eq!(
        config["settings"]["checkpoint"]["init_from"],
        init.to_str().unwrap()
    );
    assert_eq!(
        config["resumed_from"],
        run.join("checkpoints/epoch-0001.safetensors")
            .to_str()
            .unwrap()
    );
    assert_eq!(config["settings"]["optimizer"]["lr"], 1e-3);
    assert_eq!(
        config["settings"]["lr_schedule"]["config"]["factor"],
        Plateau::default().config.factor
    );
}

/// A resume on CPU ranks with another number of intra-op threads is warned of (the weights
/// leave an uninterrupted run's in the last bits); the thread count is read from the
/// checkpoint.
#[test]
fn a_resume_with_another_thread_count_is_warned_of() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-threads");
    let run = tmp.path().join("run");
    train(task(Value::Null), settings(&run, 1));
    let mut again = resumed(settings(&run, 2), 2);
    again.runtime.threads = Some(2);
    train(task(Value::Null), again);
    let log = log_of(&run);
    assert!(
        log.contains(
            "the run trained with 1 intra-op thread(s) per rank and continues with 2: \
             libtorch's CPU results differ in the last bits with the thread count"
        ),
        "{log}"
    );
}

/// A resume for more epochs plans per-step schedules from where the run stands: 2 epochs of
/// 4 steps (8 planned) resumed with 2 steps per epoch for 4 epochs takes 8 + 2 x 2 steps,
/// not 4 x 2.
#[test]
fn a_resume_for_more_epochs_plans_from_the_steps_taken() {
    let _generator = hold_generator();
    let tmp = common::temp_dir("ddp-train-resume-plan");
    let run = tmp.path().join("run");
    train(task(Value::Null), settings(&run, 2));

    let mut more = resumed(settings(&run, 4), 4);
    more.max_steps_per_epoch = Some(2);
    train(task(Value::Null), more);
    let log = log_of(&run);
    assert!(
        log.contains(
            "the run was planned for 2 epochs and continues for 4: per-step schedules now run \
             over 12 optimizer steps instead of 8"
        ),
        "{log}"
    );
    let state =
        ddp_model::checkpoint::read_tensors(run.join("checkpoints/epoch-0004.state.safetensors"))
            .unwrap();
    let st: Value = serde_json::from_str(&state.metadata["train_state"]).unwrap();
    assert_eq!(st["optimizer_steps"], 12);
    assert_eq!(
        st["plan"],
        json!({ "epochs": 4, "optimizer_steps": 12, "global_batch": 16 })
    );
    // Every step attempted, 12 of 16 samples.
    assert_eq!(st["scheduled_samples"], 192);
}
