//! A task without validation data (`Task::val_data` is `None`): the plateau scheduler, early
//! stopping and best-model monitors may watch only what an epoch's report holds without
//! evaluation. Anything else is refused by `Trainer::new`, before the run directory exists,
//! rather than after the first epoch has trained (every rank alike: the check reads only
//! the settings and the task). One rank, in this process.

mod common;

use std::path::Path;

use common::free_port;
use common::regression::{points, Regression};
use ddp_train::lr_schedule::{LrSchedule, Plateau};
use ddp_train::{EarlyStopping, Monitor, Settings, TrainError, Trainer};

/// The regression task on 64 points, without validation data.
fn without_validation() -> Regression {
    let mut task = Regression::new(points(64, 1), points(8, 2));
    task.val = None;
    task
}

/// 2 epochs of 4 steps into `out`, one thread, nothing drawn.
fn settings(out: &Path) -> Settings {
    common::regression::quiet_settings(out)
}

fn start(settings: Settings) -> Result<Trainer<Regression>, TrainError> {
    let env = ddp_comm::EnvConfig::new(0, 1, "127.0.0.1", free_port());
    Trainer::with_env(without_validation(), settings, &env)
}

/// The end of every refusal: why, and what to do.
const NO_VALIDATION: &str = "is no number of an epoch's report: the task has no validation \
                             data (Task::val_data is None), so the report holds only \
                             train_loss, lr; watch one of them, or give the task validation \
                             data";

#[test]
fn watching_what_only_validation_reports_is_refused_before_the_run_starts() {
    let _generator = common::regression::hold_generator();
    let tmp = common::temp_dir("ddp-train-no-validation");
    let base = settings(tmp.path());
    let cases = [
        (
            base.clone()
                .lr_schedule(LrSchedule::Plateau(Plateau::default())),
            "lr_schedule.metric",
            "lr_schedule.metric 'val_loss', which lr_schedule.kind plateau watches, ",
            "lr_schedule.metric 'val_loss', which --lr-schedule plateau watches, ",
        ),
        (
            base.clone()
                .early_stopping(EarlyStopping::default().after(3)),
            "early_stopping.metric",
            "early_stopping.metric 'val_loss', which early stopping \
             (early_stopping.patience 3) watches, ",
            "early_stopping.metric 'val_loss', which early stopping \
             (--early-stopping-patience 3) watches, ",
        ),
        (
            base.clone()
                .monitor(Monitor::max("val_accuracy", "best.safetensors")),
            "monitors",
            "monitors: 'val_accuracy', which the best-model file best.safetensors watches, ",
            "monitors: 'val_accuracy', which the best-model file best.safetensors watches, ",
        ),
        // Without clipping the report has no grad_norm either.
        (
            base.monitor(Monitor::min("grad_norm", "calm.safetensors")),
            "monitors",
            "monitors: 'grad_norm', which the best-model file calm.safetensors watches, ",
            "monitors: 'grad_norm', which the best-model file calm.safetensors watches, ",
        ),
    ];
    for (i, (watch, field, message, _flagged)) in cases.into_iter().enumerate() {
        let out = tmp.path().join(format!("run-{i}"));
        let Err(e) = start(watch.out(Some(out.clone()))) else {
            panic!("{message}: Trainer::new accepted it");
        };
        let TrainError::Setting(s) = &e else {
            panic!("not a setting error: {e}");
        };
        assert_eq!(s.field(), field);
        assert_eq!(e.to_string(), format!("{message}{NO_VALIDATION}"));
        // The command line names the flag that turned the watcher on.
        #[cfg(feature = "cli")]
        assert_eq!(
            ddp_train::cli::describe_error(&anyhow::Error::from(e)),
            format!("{_flagged}{NO_VALIDATION}")
        );
        assert!(!out.exists(), "{} was written", out.display());
    }
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
    let reports = start(s).unwrap().run().unwrap();
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
