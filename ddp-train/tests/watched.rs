//! What the plateau scheduler, early stopping and best-model monitors watch must be a number
//! of an epoch's report: with validation data, `train_loss`, `lr`, `val_loss` and the numbers
//! of the task's `Stats::report` (as a fresh `Task::new_stats` reports them); without, only
//! what the report holds without evaluation. Anything else is refused by `Trainer::new`,
//! before the run directory exists, rather than after the first epoch has trained (every
//! rank alike: the check reads only the settings and the task). One rank, in this process.

mod common;

use std::path::Path;

use common::free_port;
use common::regression::{points, Regression};
use ddp_train::lr_schedule::{LrSchedule, Plateau};
use ddp_train::{EarlyStopping, Monitor, Settings, TrainError, Trainer};

/// The regression task on 64 points, validated on 8 (`val_mse`, `val_mae`) or not.
fn regression(validated: bool) -> Regression {
    let mut task = Regression::new(points(64, 1), points(8, 2));
    if !validated {
        task.val = None;
    }
    task
}

/// 2 epochs of 4 steps into `out`, one thread, nothing drawn.
fn settings(out: &Path) -> Settings {
    common::regression::quiet_settings(out)
}

fn start(task: Regression, settings: Settings) -> Result<Trainer<Regression>, TrainError> {
    let env = ddp_comm::EnvConfig::new(0, 1, "127.0.0.1", free_port());
    Trainer::with_env(task, settings, &env)
}

/// Each watcher of `metric`: its settings, the setting refused, and the start of the refusal
/// by settings and by flags.
fn watchers(base: &Settings, metric: &str) -> [(Settings, &'static str, String, String); 3] {
    let plateau = "which lr_schedule.kind plateau watches";
    let early = "which early stopping (early_stopping.patience 3) watches";
    let monitor =
        format!("monitors: '{metric}', which the best-model file best.safetensors watches, ");
    [
        (
            base.clone()
                .lr_schedule(LrSchedule::Plateau(Plateau::min(metric))),
            "lr_schedule.metric",
            format!("lr_schedule.metric '{metric}', {plateau}, "),
            format!("lr_schedule.metric '{metric}', which --lr-schedule plateau watches, "),
        ),
        (
            base.clone()
                .early_stopping(EarlyStopping::min(metric).after(3)),
            "early_stopping.metric",
            format!("early_stopping.metric '{metric}', {early}, "),
            format!(
                "early_stopping.metric '{metric}', which early stopping \
                 (--early-stopping-patience 3) watches, "
            ),
        ),
        (
            base.clone()
                .monitor(Monitor::min(metric, "best.safetensors")),
            "monitors",
            monitor.clone(),
            monitor,
        ),
    ]
}

/// Starts each case and checks its refusal: the setting, the message (`why` at its end, by
/// settings and by flags), and that nothing was written.
fn refused(tmp: &Path, validated: bool, cases: Vec<(Settings, &str, String, String)>, why: &str) {
    for (i, (watch, field, message, _flagged)) in cases.into_iter().enumerate() {
        let out = tmp.join(format!("run-{i}"));
        let Err(e) = start(regression(validated), watch.out(Some(out.clone()))) else {
            panic!("{message}: Trainer::new accepted it");
        };
        let TrainError::Setting(s) = &e else {
            panic!("not a setting error: {e}");
        };
        assert_eq!(s.field(), field);
        assert_eq!(e.to_string(), format!("{message}{why}"));
        // The command line names the flag that turned the watcher on.
        #[cfg(feature = "cli")]
        assert_eq!(
            ddp_train::cli::describe_error(&anyhow::Error::from(e)),
            format!("{_flagged}{why}")
        );
        // No run directory: no checkpoint, no metrics.jsonl.
        assert!(!out.exists(), "{} was written", out.display());
    }
}

/// The end of every refusal without validation data: why, and what to do.
const NO_VALIDATION: &str = "is no number of an epoch's report: the task has no validation \
                             data (Task::val_data is None), so the report holds only \
                             train_loss, lr; watch one of them, or give the task validation \
                             data";

#[test]
fn watching_what_only_validation_reports_is_refused_before_the_run_starts() {
    let _generator = common::regression::hold_generator();
    let tmp = common::temp_dir("ddp-train-no-validation");
    let base = settings(tmp.path());
    let mut cases = Vec::from(watchers(&base, "val_loss"));
    // Without clipping the report has no grad_norm either.
    cases.extend(watchers(&base, "grad_norm").into_iter().skip(2));
    refused(tmp.path(), false, cases, NO_VALIDATION);
}

/// A misspelling of the task's metric (`val_mse`) is refused before the first step, naming
/// the report's numbers, by each watcher.
#[test]
fn watching_what_the_task_does_not_report_is_refused_before_the_run_starts() {
    let _generator = common::regression::hold_generator();
    let tmp = common::temp_dir("ddp-train-watched");
    let base = settings(tmp.path());
    let why = "is no number of an epoch's report, which holds only train_loss, lr, val_loss, \
               val_mae, val_mse; watch one of them";
    refused(tmp.path(), true, watchers(&base, "val_ms").into(), why);
}

/// The task's own numbers pass, with every watcher at once.
#[test]
fn watching_what_the_task_reports_starts() {
    let _generator = common::regression::hold_generator();
    let tmp = common::temp_dir("ddp-train-watched-ok");
    let out = tmp.path().join("run");
    let s = settings(&out)
        .lr_schedule(LrSchedule::Plateau(Plateau::min("val_mse")))
        .early_stopping(EarlyStopping::min("val_mae").after(5))
        .monitor(Monitor::min("val_mse", "best.safetensors"));
    start(regression(true), s).unwrap();
    assert!(out.join("config.json").exists());
}

#[test]
fn watching_what_training_reports_trains_every_epoch_without_validation() {
    let _generator = common::regression::hold_generator();
    let tmp = common::temp_dir("ddp-train-no-validation-ok");
    let out = tmp.path().join("run");
    let s = settings(&out)
        .clip_grad_norm(Some(10.0))
        .lr_schedule(LrSchedule::Plateau(Plateau::min("train_loss")))
        .early_stopping(EarlyStopping::min("train_loss").after(5))
        .monitor(Monitor::min("train_loss", "best.safetensors"))
        .monitor(Monitor::min("grad_norm", "calm.safetensors"));
    let reports = start(regression(false), s).unwrap().run().unwrap();
    assert_eq!(reports.iter().map(|r| r.epoch).collect::<Vec<_>>(), [1, 2]);
    for r in &reports {
        assert_eq!((r.val_loss, r.metrics.len(), r.steps), (None, 0, 4));
        assert!(r.grad_norm.is_some_and(f64::is_finite), "{r:?}");
    }
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 2, "{lines}");
    for file in ["best.safetensors", "calm.safetensors", "checkpoints/latest"] {
        assert!(out.join(file).exists(), "no {file}");
    }
}
