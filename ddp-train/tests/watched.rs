//! What the plateau scheduler, early stopping and best-model monitors watch must be a number
//! of an epoch's report: with validation data, `train_loss`, `lr`, `val_loss` and the numbers
//! of the task's `Stats::report` (as a fresh `Task::new_stats` reports them); without, only
//! what the report holds without evaluation. Anything else is refused by `Trainer::new`,
//! before the run directory exists, rather than after the first epoch has trained (every
//! rank alike: the check reads only the settings and the task). Likewise a validation split
//! whose per-sample rows (`Stats::rows`) would gather past the process group's limit is
//! refused when a run or an evaluation starts, not after the first epoch. One rank, in this
//! process.

mod common;

use std::path::Path;

use common::free_port;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::regression::{points, Regression};
use ddp_data::{Batch, TensorDataset};
use ddp_train::lr_schedule::{LrSchedule, Plateau};
use ddp_train::{
    EarlyStopping, Metrics, Monitor, RegressionStats, Rows, Settings, Stats, Task, TrainError,
    Trainer,
};
use tch::{nn, Tensor};

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

fn start<T: Task>(task: T, settings: Settings) -> Result<Trainer<T>, TrainError> {
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

/// Numbers per sample of [`Wide`]'s rows.
const WIDTH: usize = 64;

/// The regression task on 64 points, validated on 8, whose statistics also keep a row of
/// [`WIDTH`] numbers per sample; it counts its training steps.
struct Wide {
    inner: Regression,
    steps: AtomicUsize,
}

struct WideStats {
    inner: RegressionStats,
    rows: Rows,
}

impl Stats for WideStats {
    fn to_sums(&self) -> Vec<f64> {
        self.inner.to_sums()
    }

    fn set_sums(&mut self, sums: &[f64]) {
        self.inner.set_sums(sums);
    }

    fn report(&self) -> Metrics {
        self.inner.report()
    }

    fn rows(&self) -> Option<Rows> {
        Some(self.rows.clone())
    }

    fn set_rows(&mut self, rows: Rows) {
        self.rows = rows;
    }
}

impl Task for Wide {
    type Model = nn::Sequential;
    type Data = TensorDataset;
    type Stats = WideStats;

    fn model(&self, root: &nn::Path) -> nn::Sequential {
        self.inner.model(root)
    }

    fn train_data(&self) -> TensorDataset {
        self.inner.train_data()
    }

    fn val_data(&self) -> Option<TensorDataset> {
        self.inner.val_data()
    }

    fn train_loss(&self, model: &nn::Sequential, batch: &Batch) -> Tensor {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.inner.train_loss(model, batch)
    }

    fn new_stats(&self) -> WideStats {
        WideStats {
            inner: self.inner.new_stats(),
            rows: Rows::new(WIDTH),
        }
    }

    fn eval_batch(&self, model: &nn::Sequential, batch: &Batch, stats: &mut WideStats) -> Tensor {
        for &i in batch.indices() {
            stats.rows.push(i as u64, &[i as f64; WIDTH]);
        }
        self.inner.eval_batch(model, batch, &mut stats.inner)
    }
}

/// What the 8 validation rows of one rank gather to: the width, then per row a key and
/// [`WIDTH`] numbers, 8 bytes each.
const WIDE_ROWS_BYTES: u64 = 8 + 8 * 8 * (1 + WIDTH as u64);

/// [`Wide`] started with the process group's gather limit at `limit`.
fn wide(out: &Path, limit: u64) -> Trainer<Wide> {
    let task = Wide {
        inner: regression(true),
        steps: AtomicUsize::new(0),
    };
    let trainer = start(task, settings(out)).unwrap();
    trainer.process_group().set_max_gather_bytes(limit);
    trainer
}

#[test]
fn rows_that_would_gather_past_the_limit_are_refused_before_the_first_epoch() {
    let _generator = common::regression::hold_generator();
    let tmp = common::temp_dir("ddp-train-wide-rows");
    let out = tmp.path().join("run");
    let mut trainer = wide(&out, WIDE_ROWS_BYTES - 1);
    let refused = |e: TrainError| {
        let TrainError::RowsTooLarge {
            samples,
            width,
            bytes,
            limit,
        } = e
        else {
            panic!("not RowsTooLarge: {e}");
        };
        assert_eq!(
            (samples, width, bytes, limit),
            (8, WIDTH, WIDE_ROWS_BYTES, WIDE_ROWS_BYTES - 1)
        );
    };
    let e = trainer.run().unwrap_err();
    assert_eq!(
        e.to_string(),
        "evaluation would gather 8 rows of 64 numbers, 4168 bytes on every rank, over the \
         process group's limit of 4167 bytes: raise it on every rank with \
         Trainer::process_group().set_max_gather_bytes, or send fewer numbers per sample \
         (Stats::rows)"
    );
    refused(e);
    refused(trainer.evaluate().unwrap_err());
    // Nothing trained: no step, no line of metrics.jsonl.
    assert_eq!(trainer.task().steps.load(Ordering::Relaxed), 0);
    assert!(!out.join("metrics.jsonl").exists());
    drop(trainer);
    // At the limit, the rows are gathered every epoch.
    let out = tmp.path().join("at-limit");
    let reports = wide(&out, WIDE_ROWS_BYTES).run().unwrap();
    assert_eq!(reports.iter().map(|r| r.epoch).collect::<Vec<_>>(), [1, 2]);
}
