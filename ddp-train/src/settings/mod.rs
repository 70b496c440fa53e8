//! The Trainer's [`Settings`], grouped by job: the loop's own (epochs, batch, accumulation,
//! seed, precision, clipping, the run directory), the optimizer, the learning-rate schedule,
//! early stopping and best-model files, checkpoints ([`CheckpointSettings`]), DDP
//! ([`DdpOptions`]) and the runtime ([`RuntimeSettings`]).
//!
//! Each setting and its default is written once, here (or on its own type), and with feature
//! `cli` the same types derive the command line (`clap::Args`): a flag's default is the
//! setting's default, and `cli::TrainArgs` parses into a `Settings`. The enum-valued settings
//! (the optimizer, the schedule) have their flags in `flags.rs`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::amp::Precision;
use crate::ddp::DdpOptions;
use crate::error::SettingError;
use crate::lr_schedule::LrSchedule;
use crate::metrics::Goal;
use crate::optim::OptimizerConfig;

/// A builder method for each listed field of `$group`.
macro_rules! builder {
    ($group:ty { $($name:ident: $ty:ty),* $(,)? }) => {
        impl $group {
            $(
                #[doc = concat!("Sets [`", stringify!($group), "::", stringify!($name), "`].")]
                #[must_use]
                pub fn $name(mut self, value: $ty) -> Self {
                    self.$name = value;
                    self
                }
            )*
        }
    };
}

mod checkpoint;
#[cfg(feature = "cli")]
mod flags;
mod freeze;
mod monitor;
mod runtime;

pub use checkpoint::CheckpointSettings;
#[cfg(feature = "cli")]
pub use flags::parse_duration_secs;
pub(crate) use freeze::prefix_matches;
pub use freeze::FreezeSettings;
pub use monitor::Monitor;
pub use runtime::{DeviceChoice, RuntimeSettings};

/// The most epochs, samples of one rank's step (`batch_size × accumulate`) and planned
/// optimizer steps (`epochs × steps per epoch`, checked at start) a run takes: the bound
/// `state::check_state` puts on a checkpoint's counts, so that the run's own checkpoints
/// resume and the counts derived from them stay far from overflow.
pub(crate) const MAX_COUNT: u64 = 1 << 40;

/// The longest duration a setting takes, in seconds (`runtime.time_limit_secs`,
/// `checkpoint.minutes`): the launcher's and ddp-comm's longest wait, 10^9 s (about 31
/// years), so that a deadline of now plus it always exists.
pub(crate) const MAX_SECONDS: u64 = ddp_run::MAX_WAIT.as_secs();

/// Why `path` cannot be taken, as the words after the setting or flag that gave it, when it
/// is not valid UTF-8: the run records its paths as text (`config.json`, the run directory
/// the ranks agree on), which would change them. `None` for a path that is.
pub(crate) fn non_utf8(path: &Path) -> Option<String> {
    match path.to_str() {
        Some(_) => None,
        None => Some(format!(
            " {:?} is not valid UTF-8 (U+FFFD marks the bytes that are not): paths are \
             recorded as text, so rename it or give another path",
            path.to_string_lossy()
        )),
    }
}

/// Stop training when a metric of the epoch's report has not improved for `patience`
/// epochs (PyTorch Lightning's `EarlyStopping`); off without a patience. The metric is the
/// program's choice (no flag names it): `--early-stopping-patience` turns it on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(default)]
pub struct EarlyStopping {
    /// The metric it watches (default `val_loss`).
    #[cfg_attr(feature = "cli", arg(skip = EarlyStopping::default().metric))]
    pub metric: String,
    /// Which direction is better (default: smaller).
    #[cfg_attr(feature = "cli", arg(skip = EarlyStopping::default().goal))]
    pub goal: Goal,
    /// Epochs without improvement before stopping; `None`: never stop early.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "early_stopping.patience",
            long = "early-stopping-patience",
            value_name = "EPOCHS",
            help = "Stop when the program's watched metric has not improved (by more than \
                    --early-stopping-min-delta) for this many epochs"
        )
    )]
    pub patience: Option<u32>,
    /// The least change that counts as an improvement.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "early_stopping.min_delta",
            long = "early-stopping-min-delta",
            value_name = "EARLY_STOPPING_MIN_DELTA",
            default_value_t = EarlyStopping::default().min_delta,
            help = "The least change of the watched metric that counts as an improvement"
        )
    )]
    pub min_delta: f64,
}

impl Default for EarlyStopping {
    /// On the validation loss, off.
    fn default() -> Self {
        Self::min("val_loss")
    }
}

impl EarlyStopping {
    /// On `metric`, larger is better; off until given a patience ([`EarlyStopping::after`]).
    pub fn max(metric: impl Into<String>) -> Self {
        Self {
            metric: metric.into(),
            goal: Goal::Max,
            patience: None,
            min_delta: 0.0,
        }
    }

    /// On `metric`, smaller is better; off until given a patience.
    pub fn min(metric: impl Into<String>) -> Self {
        Self {
            goal: Goal::Min,
            ..Self::max(metric)
        }
    }

    /// Stops after `patience` epochs without an improvement.
    #[must_use]
    pub fn after(self, patience: u32) -> Self {
        Self {
            patience: Some(patience),
            ..self
        }
    }
}

/// Everything the generic Trainer needs besides the task. `Default` gives a sensible run
/// (10 epochs of batch 32 with Adam at 1e-3, a constant learning rate); each field has a
/// builder method of its name, and so has each field of `CheckpointSettings` and
/// `RuntimeSettings` (`DdpOptions` is built as a struct).
///
/// Errors name a setting by its path: the field, dotted through its group
/// (`checkpoint.every`), as the settings serialize in `config.json`.
///
/// ```
/// use ddp_train::lr_schedule::LrSchedule;
/// use ddp_train::optim::{OptimizerConfig, SgdConfig};
/// use ddp_train::{CheckpointSettings, Monitor, Settings};
///
/// let settings = Settings::default()
///     .epochs(5)
///     .batch_size(16)
///     .optimizer(OptimizerConfig::Sgd(SgdConfig { lr: 0.1, ..Default::default() }))
///     .lr_schedule(LrSchedule::Cosine { warmup: 100 })
///     .checkpoint(CheckpointSettings::default().every(Some(500)))
///     .monitor(Monitor::max("val_accuracy", "best-accuracy.safetensors"));
/// assert_eq!((settings.epochs, settings.checkpoint.every), (5, Some(500)));
/// assert!(settings.validate().is_ok());
///
/// let error = Settings::default().batch_size(0).validate().unwrap_err();
/// assert_eq!(error.to_string(), "batch_size must be at least 1");
/// assert_eq!(error.field(), "batch_size");
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(default)]
#[non_exhaustive]
pub struct Settings {
    /// Epochs to train (the last epoch's number).
    #[cfg_attr(
        feature = "cli",
        arg(long, default_value_t = Settings::default().epochs, help = "Number of epochs")
    )]
    pub epochs: u64,
    /// Samples per rank per micro-batch (the global batch is this times the world size).
    /// Training drops each rank's last incomplete step of an epoch (`drop_last=True`, as
    /// both of PyTorch's DDP tutorials set it); evaluation keeps every sample.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            default_value_t = Settings::default().batch_size,
            help = "Batch size per rank (the global batch is this times the world size)"
        )
    )]
    pub batch_size: usize,
    /// Micro-batches per optimizer step (gradient accumulation; one all-reduce per step).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = Settings::default().accumulate))]
    pub accumulate: usize,
    /// Seed of everything random: the model's initialisation, the sampling order, the
    /// augmentations and dropout (and a task's own draws, such as ODIR's validation split).
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            default_value_t = Settings::default().seed,
            help = "Seed of everything random: model init, sampling order, augmentation, dropout \
                    (and ODIR's validation split)"
        )
    )]
    pub seed: u64,
    /// Stop each epoch after this many optimizer steps (for quick runs and benchmarks).
    #[cfg_attr(feature = "cli", arg(long))]
    pub max_steps_per_epoch: Option<usize>,
    /// Precision of the forward pass and the loss (autocast); weights, gradients and
    /// optimizer state stay fp32. fp16 adds a gradient scaler.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            value_enum,
            default_value_t = Settings::default().precision,
            help = "Precision of the forward pass and the loss (autocast): fp32, bf16, or fp16 \
                    with a dynamic gradient scaler. Weights, gradients and Adam's state stay fp32"
        )
    )]
    pub precision: Precision,
    /// The run directory (default: `runs/<UTC date-time>-<pid>`): logs, metrics,
    /// checkpoints, best models.
    #[cfg_attr(
        feature = "cli",
        arg(long, help = "Run directory (default: runs/YYYYMMDD-HHMMSS-PID, UTC)")
    )]
    pub out: Option<PathBuf>,
    /// The optimizer and its hyper-parameters.
    #[cfg_attr(feature = "cli", command(flatten, next_help_heading = "Optimizer"))]
    pub optimizer: OptimizerConfig,
    /// Clip the gradients' global 2-norm to this value after DDP's average (and after the
    /// fp16 scaler's unscale), before the optimizer step.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            value_name = "MAX_NORM",
            help_heading = "Optimizer",
            help = "Clip the gradients' global 2-norm to this value after they are averaged \
                    over ranks (the norm is logged with --log-every)"
        )
    )]
    pub clip_grad_norm: Option<f64>,
    /// How the learning rate changes: a schedule per optimizer step, or `ReduceLROnPlateau`
    /// per epoch.
    #[cfg_attr(feature = "cli", command(flatten, next_help_heading = "Learning rate"))]
    pub lr_schedule: LrSchedule,
    /// Stop before `epochs` when a metric stops improving (off by default).
    #[cfg_attr(
        feature = "cli",
        command(flatten, next_help_heading = "Early stopping")
    )]
    pub early_stopping: EarlyStopping,
    /// Best-model files rank 0 keeps.
    #[cfg_attr(feature = "cli", arg(skip))]
    pub monitors: Vec<Monitor>,
    /// When to checkpoint and what to start from.
    #[cfg_attr(feature = "cli", command(flatten, next_help_heading = "Checkpoints"))]
    pub checkpoint: CheckpointSettings,
    /// Parameters that do not train until an epoch (`--freeze`, `--unfreeze-at`).
    #[cfg_attr(feature = "cli", command(flatten, next_help_heading = "Fine-tuning"))]
    pub freeze: FreezeSettings,
    /// Take BatchNorm's training statistics over every rank's batch (PyTorch's
    /// `SyncBatchNorm.convert_sync_batchnorm`, Lightning's `sync_batchnorm=True`): every
    /// [`ddp_model::norm::BatchNorm2d`] the task's model builds is switched; a model without
    /// one is an error.
    #[cfg_attr(
        feature = "cli",
        arg(
            long,
            help_heading = "DDP",
            help = "Take BatchNorm's training statistics over all ranks' batches together \
                    (PyTorch's SyncBatchNorm): for small per-rank batches"
        )
    )]
    pub sync_batchnorm: bool,
    /// DistributedDataParallel's options.
    #[cfg_attr(feature = "cli", command(flatten, next_help_heading = "DDP"))]
    pub ddp: DdpOptions,
    /// Device, threads, loader, time limits, logging.
    #[cfg_attr(feature = "cli", command(flatten, next_help_heading = "Runtime"))]
    pub runtime: RuntimeSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            epochs: 10,
            batch_size: 32,
            accumulate: 1,
            seed: 0,
            max_steps_per_epoch: None,
            precision: Precision::Fp32,
            out: None,
            optimizer: OptimizerConfig::default(),
            clip_grad_norm: None,
            lr_schedule: LrSchedule::default(),
            early_stopping: EarlyStopping::default(),
            monitors: Vec::new(),
            checkpoint: CheckpointSettings::default(),
            freeze: FreezeSettings::default(),
            sync_batchnorm: false,
            ddp: DdpOptions::default(),
            runtime: RuntimeSettings::default(),
        }
    }
}

builder!(Settings {
    epochs: u64,
    batch_size: usize,
    accumulate: usize,
    seed: u64,
    max_steps_per_epoch: Option<usize>,
    precision: Precision,
    out: Option<PathBuf>,
    optimizer: OptimizerConfig,
    clip_grad_norm: Option<f64>,
    lr_schedule: LrSchedule,
    early_stopping: EarlyStopping,
    monitors: Vec<Monitor>,
    checkpoint: CheckpointSettings,
    freeze: FreezeSettings,
    sync_batchnorm: bool,
    ddp: DdpOptions,
    runtime: RuntimeSettings,
});

impl Settings {
    /// Adds a best-model file.
    #[must_use]
    pub fn monitor(mut self, monitor: Monitor) -> Self {
        self.monitors.push(monitor);
        self
    }

    /// Checks the settings that can be checked without data or peers; the error names the
    /// setting by its path (`batch_size`, `checkpoint.every`).
    pub fn validate(&self) -> Result<(), SettingError> {
        let positive = |x: f64| x > 0.0 && x.is_finite();
        let at_least_one = [
            ("batch_size", self.batch_size as u64),
            ("accumulate", self.accumulate as u64),
            ("epochs", self.epochs),
            (
                "max_steps_per_epoch",
                self.max_steps_per_epoch.map_or(1, |m| m as u64),
            ),
            (
                "runtime.collective_timeout_secs",
                self.runtime.collective_timeout_secs.unwrap_or(1),
            ),
            (
                "runtime.prefetch",
                self.runtime.prefetch.map_or(1, |p| p as u64),
            ),
            (
                "runtime.threads",
                self.runtime.threads.map_or(1, |t| t as u64),
            ),
            (
                "runtime.workers",
                self.runtime.workers.map_or(1, |w| w as u64),
            ),
        ];
        if self.checkpoint.eval_only && self.checkpoint.resume.is_none() {
            return Err(SettingError::new(
                "checkpoint.eval_only",
                " needs the model file to evaluate: set ",
            )
            .setting("checkpoint.resume"));
        }
        if let Some(&(field, _)) = at_least_one.iter().find(|(_, v)| *v == 0) {
            return Err(SettingError::new(field, " must be at least 1"));
        }
        if let Some(threads) = self.runtime.threads {
            runtime::torch_threads(threads)?;
        }
        for (field, path) in [
            ("out", &self.out),
            ("checkpoint.init_from", &self.checkpoint.init_from),
        ] {
            if let Some(why) = path.as_deref().and_then(non_utf8) {
                return Err(SettingError::new(field, why));
            }
        }
        if self.epochs >= MAX_COUNT {
            return Err(SettingError::new(
                "epochs",
                format!(" {} must be below 2^40 ({MAX_COUNT})", self.epochs),
            ));
        }
        let (b, a) = (self.batch_size, self.accumulate);
        if b.checked_mul(a).is_none_or(|n| n as u64 >= MAX_COUNT) {
            return Err(SettingError::new("batch_size", format!(" {b} times "))
                .setting("accumulate")
                .text(format!(
                    " {a} must be below 2^40 (samples of one rank's step)"
                )));
        }
        if let Some(c) = self.clip_grad_norm.filter(|&c| !positive(c)) {
            return Err(SettingError::new(
                "clip_grad_norm",
                format!(" {c} must be a positive number"),
            ));
        }
        let lr = self.optimizer.lr();
        if !positive(lr) {
            return Err(SettingError::new(
                "optimizer.lr",
                format!(" {lr} must be a positive number"),
            ));
        }
        self.check_optimizer()?;
        self.lr_schedule.validate()?;
        let e = &self.early_stopping;
        if e.patience == Some(0) {
            return Err(SettingError::new(
                "early_stopping.patience",
                " must be at least 1 (epochs without improvement)",
            ));
        }
        if !(e.min_delta >= 0.0 && e.min_delta.is_finite()) {
            return Err(SettingError::new(
                "early_stopping.min_delta",
                format!(" {} must be a number >= 0", e.min_delta),
            ));
        }
        self.check_checkpoints()?;
        self.freeze.validate()?;
        if let Some(t) = self
            .runtime
            .collective_timeout_secs
            .filter(|&t| t > MAX_SECONDS)
        {
            return Err(SettingError::new(
                "runtime.collective_timeout_secs",
                format!(" {t} must be at most {MAX_SECONDS} seconds (about 31 years)"),
            ));
        }
        match self.runtime.time_limit_secs {
            Some(0) => {
                return Err(SettingError::new(
                    "runtime.time_limit_secs",
                    " must be more than 0 seconds",
                ))
            }
            Some(t) if t > MAX_SECONDS => {
                return Err(SettingError::new(
                    "runtime.time_limit_secs",
                    format!(" {t} must be at most {MAX_SECONDS} seconds (about 31 years)"),
                ))
            }
            _ => {}
        }
        monitor::check_monitors(&self.monitors)
    }

    /// The optimizer's hyper-parameters, in the ranges `torch.optim` accepts.
    fn check_optimizer(&self) -> Result<(), SettingError> {
        let at_least_zero = |field: &'static str, x: f64| {
            if x >= 0.0 && x.is_finite() {
                Ok(())
            } else {
                Err(SettingError::new(
                    field,
                    format!(" {x} must be a number >= 0"),
                ))
            }
        };
        let below_one = |field: &'static str, x: f64| {
            if (0.0..1.0).contains(&x) {
                Ok(())
            } else {
                Err(SettingError::new(
                    field,
                    format!(" {x} must be at least 0 and less than 1"),
                ))
            }
        };
        at_least_zero("optimizer.weight_decay", self.optimizer.weight_decay())?;
        match self.optimizer {
            OptimizerConfig::Sgd(c) => at_least_zero("optimizer.momentum", c.momentum),
            OptimizerConfig::Adam(c) | OptimizerConfig::AdamW(c) => {
                below_one("optimizer.beta1", c.beta1)?;
                below_one("optimizer.beta2", c.beta2)?;
                at_least_zero("optimizer.eps", c.eps)
            }
        }
    }

    fn check_checkpoints(&self) -> Result<(), SettingError> {
        let c = &self.checkpoint;
        if c.every == Some(0) {
            return Err(SettingError::new(
                "checkpoint.every",
                " must be at least 1 (optimizer steps)",
            ));
        }
        let minutes = |m: f64| m > 0.0 && m * 60.0 <= MAX_SECONDS as f64;
        if let Some(m) = c.minutes.filter(|&m| !minutes(m)) {
            return Err(SettingError::new(
                "checkpoint.minutes",
                format!(
                    " {m} must be a positive number of minutes, at most {} (10^9 seconds)",
                    MAX_SECONDS / 60
                ),
            ));
        }
        if c.keep == 0 {
            return Err(SettingError::new(
                "checkpoint.keep",
                " must be at least 1 (the newest step checkpoint is what a restart continues \
                 from)",
            ));
        }
        for (set, field) in [
            (c.init_partial, "checkpoint.init_partial"),
            (c.init_key.is_some(), "checkpoint.init_key"),
        ] {
            if set && c.init_from.is_none() {
                return Err(SettingError::new(field, " needs ")
                    .setting("checkpoint.init_from")
                    .text(" (the weights file to load from)"));
            }
        }
        if c.resume.as_deref() == Some("latest") && self.out.is_none() {
            return Err(SettingError::new("checkpoint.resume", " latest needs ")
                .setting("out")
                .text(" (the run directory) to know which run"));
        }
        Ok(())
    }

    /// What the plateau scheduler, early stopping (with a patience) and each best-model
    /// monitor watch must be a number of an epoch's report ([`crate::report::numbers`]), or
    /// the first epoch would train and then fail without its checkpoint. `stats` is a fresh
    /// `Stats::report` of a task with validation data (its keys are those of every epoch's),
    /// `None` for a task without.
    pub(crate) fn check_watched(
        &self,
        stats: Option<&Map<String, Value>>,
    ) -> Result<(), SettingError> {
        let known = crate::report::numbers(self.clip_grad_norm.is_some(), stats);
        let (why, otherwise) = match stats {
            Some(_) => (", which", ""),
            None => (
                ": the task has no validation data (Task::val_data is None), so the report",
                ", or give the task validation data",
            ),
        };
        let missing = || {
            format!(
                ", is no number of an epoch's report{why} holds only {}; watch one of \
                 them{otherwise}",
                known.join(", ")
            )
        };
        if let LrSchedule::Plateau(p) = &self.lr_schedule {
            if !known.contains(&p.metric.as_str()) {
                return Err(SettingError::new(
                    "lr_schedule.metric",
                    format!(" '{}', which ", p.metric),
                )
                .setting("lr_schedule.kind")
                .text(format!(" plateau watches{}", missing())));
            }
        }
        let e = &self.early_stopping;
        if let (Some(patience), false) = (e.patience, known.contains(&e.metric.as_str())) {
            return Err(SettingError::new(
                "early_stopping.metric",
                format!(" '{}', which early stopping (", e.metric),
            )
            .setting("early_stopping.patience")
            .text(format!(" {patience}) watches{}", missing())));
        }
        match self
            .monitors
            .iter()
            .find(|m| !known.contains(&m.metric.as_str()))
        {
            Some(m) => Err(SettingError::new(
                "monitors",
                format!(
                    ": '{}', which the best-model file {} watches{}",
                    m.metric,
                    m.file,
                    missing()
                ),
            )),
            None => Ok(()),
        }
    }

    /// The loader of a rank on `device` among the `local_world_size` ranks of its machine:
    /// the batch size and seed; `runtime.workers`, else the machine's cores shared among the
    /// ranks; `runtime.prefetch`, else 2 on the CPU and 4 on a GPU; epoch 0, no drop_last.
    pub(crate) fn loader_config(
        &self,
        device: tch::Device,
        local_world_size: usize,
    ) -> ddp_data::LoaderConfig {
        let default_workers = || ddp_data::default_workers(local_world_size);
        let default_prefetch = if device.is_cuda() { 4 } else { 2 };
        ddp_data::LoaderConfig {
            seed: self.seed,
            workers: self.runtime.workers.unwrap_or_else(default_workers),
            prefetch: self.runtime.prefetch.unwrap_or(default_prefetch),
            ..ddp_data::LoaderConfig::new(self.batch_size)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lr_schedule::Plateau;
    use crate::task::Stats;

    fn error(s: Settings) -> String {
        s.validate().unwrap_err().to_string()
    }

    /// With validation data, what is watched must be a number of a fresh `Stats::report`
    /// (here `MultiClassStats`', before any sample): its numbers pass, as do the epoch's own;
    /// a misspelling, a list or `grad_norm` without clipping is refused by each watcher,
    /// naming the numbers.
    #[test]
    fn watched_metrics_are_numbers_of_a_fresh_report() {
        let stats = crate::MultiClassStats::new(3).report().into_map();
        let watching = |metric: &str, clip: Option<f64>| {
            let plateau = LrSchedule::Plateau(Plateau::max(metric));
            let early = EarlyStopping::max(metric).after(2);
            let monitor = Settings::default().monitor(Monitor::max(metric, "best.safetensors"));
            [
                Settings::default().lr_schedule(plateau),
                Settings::default().early_stopping(early),
                monitor,
            ]
            .map(|s| s.clip_grad_norm(clip).check_watched(Some(&stats)))
        };
        for metric in [
            "val_accuracy",
            "val_macro_f1",
            "val_loss",
            "train_loss",
            "lr",
        ] {
            assert_eq!(watching(metric, None), [Ok(()), Ok(()), Ok(())], "{metric}");
        }
        assert_eq!(watching("grad_norm", Some(1.0)), [Ok(()), Ok(()), Ok(())]);
        let numbers = "train_loss, lr, val_loss, val_accuracy, val_macro_f1, val_micro_f1";
        for (metric, clip, known) in [
            ("val_macro_f", None, numbers.to_string()),
            ("val_f1_per_class", None, numbers.to_string()),
            ("grad_norm", None, numbers.to_string()),
            (
                "val_acc",
                Some(1.0),
                numbers.replace("lr,", "lr, grad_norm,"),
            ),
        ] {
            let tail = format!(
                " watches, is no number of an epoch's report, which holds only {known}; watch \
                 one of them"
            );
            let (m, patience) = (format!("'{metric}', which"), "(early_stopping.patience 2)");
            let expected = [
                (
                    "lr_schedule.metric",
                    format!("lr_schedule.metric {m} lr_schedule.kind plateau{tail}"),
                ),
                (
                    "early_stopping.metric",
                    format!("early_stopping.metric {m} early stopping {patience}{tail}"),
                ),
                (
                    "monitors",
                    format!("monitors: {m} the best-model file best.safetensors{tail}"),
                ),
            ];
            let errors = watching(metric, clip).map(|r| r.unwrap_err());
            assert_eq!(errors.map(|e| (e.field(), e.to_string())), expected);
        }
    }

    /// The loader's defaults, one definition for training, evaluation and `predict`: 2
    /// batches ahead on the CPU, 4 on a GPU; the machine's cores shared among its ranks;
    /// the settings' values where given.
    #[test]
    fn the_loader_prefetches_more_on_a_gpu_and_shares_the_cores_among_ranks() {
        let cores = std::thread::available_parallelism().unwrap().get();
        let s = Settings::default().batch_size(5).seed(9);
        let cpu = s.loader_config(tch::Device::Cpu, 1);
        let got = (cpu.batch_size, cpu.seed, cpu.epoch, cpu.drop_last);
        assert_eq!(got, (5, 9, 0, false));
        assert_eq!((cpu.workers, cpu.prefetch), (cores, 2));
        let gpu = s.loader_config(tch::Device::Cuda(1), 2);
        assert_eq!((gpu.workers, gpu.prefetch), ((cores / 2).max(1), 4));
        // More ranks than cores: one worker each.
        let crowded = s.loader_config(tch::Device::Cpu, cores + 1);
        assert_eq!(crowded.workers, 1);
        let given = RuntimeSettings::default()
            .workers(Some(3))
            .prefetch(Some(7));
        let s = s.runtime(given);
        for device in [tch::Device::Cpu, tch::Device::Cuda(0)] {
            let c = s.loader_config(device, 4);
            assert_eq!((c.workers, c.prefetch), (3, 7), "{device:?}");
        }
    }

    #[test]
    fn validation_names_the_field_by_its_path() {
        assert_eq!(
            error(Settings::default().batch_size(0)),
            "batch_size must be at least 1"
        );
        assert_eq!(
            error(Settings::default().checkpoint(CheckpointSettings::default().eval_only(true))),
            "checkpoint.eval_only needs the model file to evaluate: set checkpoint.resume"
        );
        assert_eq!(
            error(Settings::default().runtime(RuntimeSettings::default().prefetch(Some(0)))),
            "runtime.prefetch must be at least 1"
        );
        assert_eq!(
            error(Settings::default().max_steps_per_epoch(Some(0))),
            "max_steps_per_epoch must be at least 1"
        );
        let no_time = RuntimeSettings::default().collective_timeout_secs(Some(0));
        assert_eq!(
            error(Settings::default().runtime(no_time)),
            "runtime.collective_timeout_secs must be at least 1"
        );
        assert_eq!(
            error(Settings::default().clip_grad_norm(Some(0.0))),
            "clip_grad_norm 0 must be a positive number"
        );
        assert_eq!(
            error(Settings::default().checkpoint(CheckpointSettings::default().every(Some(0)))),
            "checkpoint.every must be at least 1 (optimizer steps)"
        );
        let latest = Settings::default()
            .checkpoint(CheckpointSettings::default().resume(Some("latest".into())))
            .out(None);
        let e = latest.validate().unwrap_err();
        assert_eq!(
            e.to_string(),
            "checkpoint.resume latest needs out (the run directory) to know which run"
        );
        assert_eq!(e.fields().collect::<Vec<_>>(), ["checkpoint.resume", "out"]);
        let plateau = LrSchedule::Plateau(Plateau::max("val_f1").with(
            crate::scheduler::PlateauConfig {
                factor: 1.5,
                ..Default::default()
            },
        ));
        assert_eq!(
            error(Settings::default().lr_schedule(plateau)),
            "lr_schedule.config.factor 1.5 must be in (0, 1)"
        );
        let step = LrSchedule::Step {
            warmup: 0,
            every: 0,
            gamma: 0.1,
        };
        assert_eq!(
            error(Settings::default().lr_schedule(step)),
            "lr_schedule.every must be at least 1"
        );
        assert_eq!(
            error(Settings::default().early_stopping(EarlyStopping::max("f1").after(0))),
            "early_stopping.patience must be at least 1 (epochs without improvement)"
        );
        let twice = Settings::default()
            .monitor(Monitor::max("a", "best.safetensors"))
            .monitor(Monitor::min("b", "best.safetensors"));
        assert_eq!(
            error(twice),
            "monitors: two write the same file best.safetensors"
        );
        let best = |file: &str| Settings::default().monitor(Monitor::max("a", file));
        assert_eq!(
            error(best("models/best.safetensors")),
            "monitors: \"models/best.safetensors\" is not a plain file name (best models are \
             written in the run directory itself; hidden names are the run's own)"
        );
        assert_eq!(
            error(best("config.safetensors")),
            "monitors: config.safetensors would write config.json, a name the run directory \
             keeps for its own"
        );
        assert_eq!(
            error(best("best.json")),
            "monitors: best.json would be its own document best.json (give the model file \
             another extension, e.g. .safetensors)"
        );
        for file in ["", ".lock", "..", "/tmp/best.safetensors"] {
            let e = best(file).validate().unwrap_err();
            assert_eq!(e.field(), "monitors", "{file:?}");
        }
        let docs = best("best.safetensors").monitor(Monitor::min("b", "best.pt"));
        assert_eq!(
            error(docs),
            "monitors: best.safetensors and best.pt both write best.json"
        );
        assert!(best("best-f1.safetensors")
            .monitor(Monitor::min("val_loss", "best-loss.safetensors"))
            .validate()
            .is_ok());
        let partial =
            Settings::default().checkpoint(CheckpointSettings::default().init_partial(true));
        assert_eq!(
            error(partial),
            "checkpoint.init_partial needs checkpoint.init_from (the weights file to load from)"
        );
        let key = Settings::default()
            .checkpoint(CheckpointSettings::default().init_key(Some("ema".into())));
        assert_eq!(
            error(key),
            "checkpoint.init_key needs checkpoint.init_from (the weights file to load from)"
        );
        assert!(Settings::default().validate().is_ok());
    }

    /// Counts and durations that would overflow the Trainer's arithmetic (`epochs × steps`,
    /// `batch_size × accumulate`, the time limit's deadline, the checkpoint interval) are
    /// refused, each naming its setting.
    #[test]
    fn counts_and_durations_are_bounded() {
        let refused = |s: Settings| {
            let e = s.validate().unwrap_err();
            (e.fields().collect::<Vec<_>>(), e.to_string())
        };
        assert_eq!(
            refused(Settings::default().epochs(1 << 40)),
            (
                vec!["epochs"],
                "epochs 1099511627776 must be below 2^40 (1099511627776)".into()
            )
        );
        assert!(Settings::default().epochs((1 << 40) - 1).validate().is_ok());
        for (batch, accumulate) in [(1 << 32, 1 << 32), (usize::MAX, 2), (1 << 20, 1 << 20)] {
            assert_eq!(
                refused(Settings::default().batch_size(batch).accumulate(accumulate)),
                (
                    vec!["batch_size", "accumulate"],
                    format!(
                        "batch_size {batch} times accumulate {accumulate} must be below 2^40 \
                         (samples of one rank's step)"
                    )
                )
            );
        }
        let step = Settings::default()
            .batch_size(1 << 20)
            .accumulate((1 << 20) - 1);
        assert!(step.validate().is_ok());
        let limit = |secs| {
            Settings::default().runtime(RuntimeSettings::default().time_limit_secs(Some(secs)))
        };
        for secs in [u64::MAX, MAX_SECONDS + 1] {
            assert_eq!(
                refused(limit(secs)),
                (
                    vec!["runtime.time_limit_secs"],
                    format!(
                        "runtime.time_limit_secs {secs} must be at most 1000000000 seconds \
                         (about 31 years)"
                    )
                )
            );
        }
        assert!(limit(MAX_SECONDS).validate().is_ok());
        let timeout = |secs| {
            Settings::default()
                .runtime(RuntimeSettings::default().collective_timeout_secs(Some(secs)))
        };
        assert_eq!(
            refused(timeout(MAX_SECONDS + 1)),
            (
                vec!["runtime.collective_timeout_secs"],
                "runtime.collective_timeout_secs 1000000001 must be at most 1000000000 seconds \
                 (about 31 years)"
                    .to_string()
            )
        );
        assert!(timeout(MAX_SECONDS).validate().is_ok());
        let minutes =
            |m| Settings::default().checkpoint(CheckpointSettings::default().minutes(Some(m)));
        for m in [1e300, 3e17, f64::INFINITY, f64::NAN, 0.0, -1.0] {
            assert_eq!(
                refused(minutes(m)),
                (
                    vec!["checkpoint.minutes"],
                    format!(
                        "checkpoint.minutes {m} must be a positive number of minutes, at most \
                         16666666 (10^9 seconds)"
                    )
                )
            );
        }
        assert!(minutes(MAX_SECONDS as f64 / 60.0).validate().is_ok());
    }

    /// The run records its paths as text (`config.json`, the run directory the ranks agree
    /// on): one that is not UTF-8 is refused naming its setting, not changed or a panic.
    #[test]
    fn paths_that_are_not_utf8_are_refused_by_their_setting() {
        use std::os::unix::ffi::OsStrExt;
        let bad = PathBuf::from(std::ffi::OsStr::from_bytes(b"runs/w_\xff"));
        let why = " \"runs/w_\u{FFFD}\" is not valid UTF-8 (U+FFFD marks the bytes that are \
                   not): paths are recorded as text, so rename it or give another path";
        let e = Settings::default().out(Some(bad.clone())).validate();
        assert_eq!(e, Err(SettingError::new("out", why)));
        let init = CheckpointSettings::default().init_from(Some(bad));
        let e = Settings::default().checkpoint(init).validate();
        assert_eq!(e, Err(SettingError::new("checkpoint.init_from", why)));
        let fine = CheckpointSettings::default().init_from(Some("w_\u{FFFD}.pt".into()));
        assert!(Settings::default()
            .out(Some("runs/\u{FFFD}".into()))
            .checkpoint(fine)
            .validate()
            .is_ok());
    }

    #[test]
    fn the_optimizer_and_threads_take_the_ranges_pytorch_accepts() {
        use crate::optim::{AdamConfig, SgdConfig};
        let sgd = |momentum, weight_decay| {
            Settings::default().optimizer(OptimizerConfig::Sgd(SgdConfig {
                momentum,
                weight_decay,
                ..Default::default()
            }))
        };
        assert_eq!(
            error(sgd(-5.0, 0.0)),
            "optimizer.momentum -5 must be a number >= 0"
        );
        assert_eq!(
            error(sgd(0.9, -1.0)),
            "optimizer.weight_decay -1 must be a number >= 0"
        );
        assert_eq!(
            error(sgd(0.9, f64::NAN)),
            "optimizer.weight_decay NaN must be a number >= 0"
        );
        assert!(sgd(0.0, 0.0).validate().is_ok());
        let adam = |beta2| {
            Settings::default().optimizer(OptimizerConfig::AdamW(AdamConfig {
                beta2,
                ..Default::default()
            }))
        };
        assert_eq!(
            error(adam(1.0)),
            "optimizer.beta2 1 must be at least 0 and less than 1"
        );
        assert!(adam(0.0).validate().is_ok());
        for (runtime, field) in [
            (
                RuntimeSettings::default().threads(Some(0)),
                "runtime.threads",
            ),
            (
                RuntimeSettings::default().workers(Some(0)),
                "runtime.workers",
            ),
        ] {
            assert_eq!(
                error(Settings::default().runtime(runtime)),
                format!("{field} must be at least 1")
            );
        }
        // libtorch takes an int: 2^31 threads would be negative, 2^32 none.
        for threads in [1 << 31, 1 << 32] {
            let runtime = RuntimeSettings::default().threads(Some(threads));
            assert_eq!(
                error(Settings::default().runtime(runtime)),
                format!("runtime.threads {threads} must be at most 2147483647 (libtorch's limit)")
            );
        }
        let most = RuntimeSettings::default().threads(Some(i32::MAX as usize));
        assert!(Settings::default().runtime(most).validate().is_ok());
    }

    #[test]
    fn builders_set_their_fields() {
        let s = Settings::default()
            .epochs(3)
            .accumulate(2)
            .seed(9)
            .runtime(
                RuntimeSettings::default()
                    .device(DeviceChoice::Cpu)
                    .log_every(5),
            )
            .early_stopping(EarlyStopping::max("val_f1").after(4));
        assert_eq!((s.epochs, s.accumulate, s.seed), (3, 2, 9));
        assert_eq!(
            (s.runtime.device, s.runtime.log_every),
            (DeviceChoice::Cpu, 5)
        );
        assert_eq!(
            s.runtime.collective_timeout_secs, None,
            "the rest stays default"
        );
        assert_eq!(
            (s.early_stopping.goal, s.early_stopping.patience),
            (Goal::Max, Some(4))
        );
    }

    /// The serialized settings (`config.json`, a checkpoint's state) are grouped as the
    /// struct is, and a partial or older document fills what it lacks with the defaults.
    #[test]
    fn settings_serialize_by_group_and_missing_fields_take_their_defaults() {
        let s = Settings::default()
            .lr_schedule(LrSchedule::Plateau(Plateau::max("val_macro_f1")))
            .checkpoint(CheckpointSettings::default().every(Some(7)));
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["checkpoint"]["every"], 7);
        assert_eq!(json["ddp"]["comm_hook"], "allreduce");
        assert_eq!(json["lr_schedule"]["kind"], "plateau");
        assert_eq!(json["lr_schedule"]["metric"], "val_macro_f1");
        assert_eq!(json["optimizer"]["kind"], "adam");
        let back: Settings = serde_json::from_value(json).unwrap();
        assert_eq!(back, s);
        let partial: Settings =
            serde_json::from_str(r#"{"epochs": 4, "runtime": {"threads": 2}}"#).unwrap();
        assert_eq!(
            partial,
            Settings::default()
                .epochs(4)
                .runtime(RuntimeSettings::default().threads(Some(2)))
        );
    }
}
