//! The Trainer's [`Settings`]: a plain struct with defaults and a builder.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::amp::Precision;
use crate::ddp::BuiltinHook;
use crate::error::TrainError;
use crate::lr_schedule::LrSchedule;
use crate::optim::OptimizerConfig;
use crate::scheduler::PlateauConfig;

/// Which device a rank trains on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// `cuda:LOCAL_RANK` when CUDA is available, else the CPU.
    #[default]
    Auto,
    /// The CPU.
    Cpu,
    /// `cuda:LOCAL_RANK`; an error when CUDA is not available.
    Cuda,
}

impl DeviceChoice {
    /// The device of the rank with `local_rank` on its machine: `cuda:local_rank` (CUDA is
    /// made visible first, see `ddp_comm::cuda::load_torch_cuda`) or the CPU. An error names
    /// what is missing when `Cuda` is asked for without CUDA, or for a rank without a GPU.
    pub fn resolve(self, local_rank: usize) -> Result<tch::Device, TrainError> {
        if self == Self::Cpu {
            return Ok(tch::Device::Cpu);
        }
        // rustc links with --as-needed, so libtorch_cuda must be loaded before asking tch.
        let loaded = ddp_comm::cuda::load_torch_cuda().unwrap_or(false);
        let available = loaded && tch::Cuda::is_available();
        match (self, available) {
            (Self::Cuda, false) => Err(TrainError::Invalid(format!(
                "--device cuda: CUDA is not available here ({}); use --device cpu",
                ddp_comm::cuda::no_gpu_reason().unwrap_or_else(|| "no device".into())
            ))),
            (_, true) => {
                let count = tch::Cuda::device_count() as usize;
                if local_rank >= count {
                    return Err(TrainError::Invalid(format!(
                        "LOCAL_RANK {local_rank} needs cuda:{local_rank}, but only {count} \
                         CUDA devices are visible"
                    )));
                }
                Ok(tch::Device::Cuda(local_rank))
            }
            (_, false) => Ok(tch::Device::Cpu),
        }
    }
}

/// Whether a larger or a smaller value of a metric is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Goal {
    /// Larger is better (accuracy, F1).
    Max,
    /// Smaller is better (a loss).
    Min,
}

impl Goal {
    /// Whether `new` improves on `old`.
    pub fn improves(self, new: f64, old: f64) -> bool {
        match self {
            Self::Max => new > old,
            Self::Min => new < old,
        }
    }
}

/// A metric whose best epoch's model rank 0 keeps in the run directory (PyTorch Lightning's
/// `ModelCheckpoint(monitor=...)`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Monitor {
    /// The metric's name in an epoch's report (`val_loss`, `train_loss` or one the task's
    /// evaluation reports).
    pub metric: String,
    /// Which direction is better.
    pub goal: Goal,
    /// The model file's name in the run directory.
    pub file: String,
}

impl Monitor {
    /// Keeps the model of the epoch with the largest `metric` in `file`.
    pub fn max(metric: impl Into<String>, file: impl Into<String>) -> Self {
        Self {
            metric: metric.into(),
            goal: Goal::Max,
            file: file.into(),
        }
    }

    /// Keeps the model of the epoch with the smallest `metric` in `file`.
    pub fn min(metric: impl Into<String>, file: impl Into<String>) -> Self {
        Self {
            metric: metric.into(),
            goal: Goal::Min,
            file: file.into(),
        }
    }
}

/// Stop training when a metric of the epoch's report has not improved for `patience`
/// epochs (PyTorch Lightning's `EarlyStopping`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EarlyStopping {
    /// The metric it watches.
    pub metric: String,
    /// Which direction is better.
    pub goal: Goal,
    /// Epochs without improvement before stopping.
    pub patience: u32,
    /// The least change that counts as an improvement.
    pub min_delta: f64,
}

/// `ReduceLROnPlateau` on one metric of the epoch's report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plateau {
    /// The metric it watches.
    pub metric: String,
    /// Which direction is better.
    pub goal: Goal,
    /// Factor, patience, cooldown, threshold and floor.
    pub config: PlateauConfig,
}

/// Everything the generic Trainer needs besides the task. `Default` gives a sensible run
/// (10 epochs of batch 32 with Adam at 1e-3); each field has a builder method of its name.
///
/// The Trainer's settings: a plain struct with defaults and a builder.
///
/// ```
/// use ddp_train::optim::{OptimizerConfig, SgdConfig};
/// use ddp_train::{Monitor, Settings};
///
/// let settings = Settings::default()
///     .epochs(5)
///     .batch_size(16)
///     .optimizer(OptimizerConfig::Sgd(SgdConfig { lr: 0.1, ..Default::default() }))
///     .monitor(Monitor::max("val_accuracy", "best-accuracy.safetensors"));
/// assert_eq!(settings.epochs, 5);
/// assert!(settings.validate().is_ok());
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Settings {
    /// Epochs to train (the last epoch's number).
    pub epochs: u64,
    /// Samples per rank per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub accumulate: usize,
    /// The optimizer and its hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Lowers the learning rate when a metric stops improving.
    pub plateau: Option<Plateau>,
    /// Best-model files rank 0 keeps.
    pub monitors: Vec<Monitor>,
    /// Seed of the model's initialisation, the shuffling, the augmentations and dropout.
    pub seed: u64,
    /// Where each rank trains.
    pub device: DeviceChoice,
    /// Intra-op threads per rank on the CPU (default: the cores divided among the ranks).
    pub threads: Option<usize>,
    /// Loader threads per rank (default: `ddp_data::default_workers`).
    pub workers: Option<usize>,
    /// Batches the loader prepares ahead (default: 2 on the CPU, 4 on a GPU).
    pub prefetch: Option<usize>,
    /// The run directory (default: `runs/<UTC date-time>`).
    pub out: Option<PathBuf>,
    /// A checkpoint to start from: `latest` (of `out`) or a path to a model file.
    pub resume: Option<String>,
    /// Load only the model weights from `resume` (for [`crate::Trainer::evaluate`]; no
    /// optimizer state is needed).
    pub eval_only: bool,
    /// After a launcher's restart (`TORCHELASTIC_RESTART_COUNT` > 0), resume from the
    /// run's latest checkpoint when `out` has one and `resume` is not set.
    pub resume_after_restart: bool,
    /// Log a rank's loss every this many steps (0: never).
    pub log_every: usize,
    /// Stop each epoch after this many optimizer steps.
    pub max_steps_per_epoch: Option<usize>,
    /// Seconds a collective may take before the job fails.
    pub collective_timeout_secs: u64,
    /// Also checkpoint inside epochs, every this many optimizer steps (counted over the run).
    pub checkpoint_every: Option<u64>,
    /// Also checkpoint inside epochs when this many minutes have passed since the last
    /// checkpoint (or the start).
    pub checkpoint_minutes: Option<f64>,
    /// Step checkpoints kept (the newest); epoch-end checkpoints and best models are all kept.
    pub keep_checkpoints: usize,
    /// Stop cleanly, with a checkpoint, before this many seconds have passed since the
    /// Trainer was created (for a scheduler's time limit); the next start continues.
    pub time_limit_secs: Option<u64>,
    /// Stop cleanly, with a checkpoint, at the next step when SIGTERM or SIGUSR1 arrives
    /// (see [`StopReason`](crate::StopReason)); when false the signals keep their previous
    /// behaviour.
    pub stop_on_signals: bool,
    /// Show rank 0's progress: a bar when stdout is a terminal, else a log line every tenth
    /// of an epoch. (Log lines are `tracing` events and go to `logs/rank-<r>.log`; the
    /// program's subscriber decides where else.)
    pub progress: bool,
    /// Draw `curves.png` after every epoch (needs the `plot` feature).
    pub plot: bool,
    /// Precision of the forward pass and the loss (autocast); weights, gradients and
    /// optimizer state stay fp32. fp16 adds a gradient scaler.
    #[serde(default)]
    pub precision: Precision,
    /// Allow parameters that get no gradient on some ranks (PyTorch DDP's
    /// `find_unused_parameters`).
    #[serde(default)]
    pub find_unused_parameters: bool,
    /// How DDP averages a bucket of gradients.
    #[serde(default)]
    pub comm_hook: BuiltinHook,
    /// Reduce gradient buckets while backward runs (PyTorch's behaviour); off: after it.
    #[serde(default = "yes")]
    pub overlap: bool,
    /// Clip the gradients' global 2-norm to this value after DDP's average (and after the
    /// fp16 scaler's unscale), before the optimizer step.
    #[serde(default)]
    pub clip_grad_norm: Option<f64>,
    /// A learning-rate schedule stepped every optimizer step (warmup, linear, cosine, step,
    /// one-cycle), over `epochs` epochs; not together with `plateau`.
    #[serde(default)]
    pub lr_schedule: Option<LrSchedule>,
    /// Stop before `epochs` when a metric stops improving.
    #[serde(default)]
    pub early_stopping: Option<EarlyStopping>,
}

fn yes() -> bool {
    true
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            epochs: 10,
            batch_size: 32,
            accumulate: 1,
            optimizer: OptimizerConfig::default(),
            plateau: None,
            monitors: Vec::new(),
            seed: 0,
            device: DeviceChoice::Auto,
            threads: None,
            workers: None,
            prefetch: None,
            out: None,
            resume: None,
            eval_only: false,
            resume_after_restart: true,
            log_every: 0,
            max_steps_per_epoch: None,
            collective_timeout_secs: 300,
            checkpoint_every: None,
            checkpoint_minutes: None,
            keep_checkpoints: 2,
            time_limit_secs: None,
            stop_on_signals: true,
            progress: true,
            plot: true,
            precision: Precision::Fp32,
            find_unused_parameters: false,
            comm_hook: BuiltinHook::Allreduce,
            overlap: true,
            clip_grad_norm: None,
            lr_schedule: None,
            early_stopping: None,
        }
    }
}

macro_rules! builder {
    ($($(#[$doc:meta])* $name:ident: $ty:ty),* $(,)?) => {
        impl Settings {
            $(
                $(#[$doc])*
                #[must_use]
                pub fn $name(mut self, value: $ty) -> Self {
                    self.$name = value;
                    self
                }
            )*
        }
    };
}

builder! {
    /// Sets [`Settings::epochs`].
    epochs: u64,
    /// Sets [`Settings::batch_size`].
    batch_size: usize,
    /// Sets [`Settings::accumulate`].
    accumulate: usize,
    /// Sets [`Settings::optimizer`].
    optimizer: OptimizerConfig,
    /// Sets [`Settings::plateau`].
    plateau: Option<Plateau>,
    /// Sets [`Settings::monitors`].
    monitors: Vec<Monitor>,
    /// Sets [`Settings::seed`].
    seed: u64,
    /// Sets [`Settings::device`].
    device: DeviceChoice,
    /// Sets [`Settings::threads`].
    threads: Option<usize>,
    /// Sets [`Settings::workers`].
    workers: Option<usize>,
    /// Sets [`Settings::prefetch`].
    prefetch: Option<usize>,
    /// Sets [`Settings::out`].
    out: Option<PathBuf>,
    /// Sets [`Settings::resume`].
    resume: Option<String>,
    /// Sets [`Settings::eval_only`].
    eval_only: bool,
    /// Sets [`Settings::resume_after_restart`].
    resume_after_restart: bool,
    /// Sets [`Settings::log_every`].
    log_every: usize,
    /// Sets [`Settings::max_steps_per_epoch`].
    max_steps_per_epoch: Option<usize>,
    /// Sets [`Settings::collective_timeout_secs`].
    collective_timeout_secs: u64,
    /// Sets [`Settings::checkpoint_every`].
    checkpoint_every: Option<u64>,
    /// Sets [`Settings::checkpoint_minutes`].
    checkpoint_minutes: Option<f64>,
    /// Sets [`Settings::keep_checkpoints`].
    keep_checkpoints: usize,
    /// Sets [`Settings::time_limit_secs`].
    time_limit_secs: Option<u64>,
    /// Sets [`Settings::stop_on_signals`].
    stop_on_signals: bool,
    /// Sets [`Settings::progress`].
    progress: bool,
    /// Sets [`Settings::plot`].
    plot: bool,
    /// Sets [`Settings::precision`].
    precision: Precision,
    /// Sets [`Settings::find_unused_parameters`].
    find_unused_parameters: bool,
    /// Sets [`Settings::comm_hook`].
    comm_hook: BuiltinHook,
    /// Sets [`Settings::overlap`].
    overlap: bool,
    /// Sets [`Settings::clip_grad_norm`].
    clip_grad_norm: Option<f64>,
    /// Sets [`Settings::lr_schedule`].
    lr_schedule: Option<LrSchedule>,
    /// Sets [`Settings::early_stopping`].
    early_stopping: Option<EarlyStopping>,
}

impl Settings {
    /// Adds a best-model file.
    #[must_use]
    pub fn monitor(mut self, monitor: Monitor) -> Self {
        self.monitors.push(monitor);
        self
    }

    /// Checks the settings that can be checked without data or peers; the message names
    /// the setting as the `ddp-train` command line spells it.
    pub fn validate(&self) -> Result<(), TrainError> {
        let invalid = |m: String| Err(TrainError::Invalid(m));
        if self.batch_size == 0 {
            return invalid("--batch-size must be at least 1".into());
        }
        if self.prefetch == Some(0) {
            return invalid("--prefetch must be at least 1".into());
        }
        if self.accumulate == 0 {
            return invalid("--accumulate must be at least 1".into());
        }
        if self.epochs == 0 {
            return invalid("--epochs must be at least 1".into());
        }
        if let Some(c) = self.clip_grad_norm {
            if !(c > 0.0 && c.is_finite()) {
                return invalid(format!("--clip-grad-norm {c} must be a positive number"));
            }
        }
        if let Some(e) = &self.early_stopping {
            if e.patience == 0 || !(e.min_delta >= 0.0 && e.min_delta.is_finite()) {
                return invalid(format!(
                    "early stopping on {}: the patience ({}) must be at least 1 and the \
                     minimum change ({}) a number >= 0",
                    e.metric, e.patience, e.min_delta
                ));
            }
        }
        if let Some(schedule) = &self.lr_schedule {
            schedule.validate().map_err(TrainError::Invalid)?;
            if self.plateau.is_some() {
                return invalid(
                    "a per-step learning-rate schedule and ReduceLROnPlateau cannot be combined: \
                     choose one (--lr-schedule)"
                        .into(),
                );
            }
        }
        let lr = self.optimizer.lr();
        if !(lr > 0.0 && lr.is_finite()) {
            return invalid(format!("--lr {lr} must be a positive number"));
        }
        if let Some(p) = &self.plateau {
            if !(p.config.factor > 0.0 && p.config.factor < 1.0) {
                return invalid(format!(
                    "--plateau-factor {} must be in (0, 1)",
                    p.config.factor
                ));
            }
        }
        if self.checkpoint_every == Some(0) {
            return invalid("--checkpoint-every must be at least 1 (optimizer steps)".into());
        }
        if let Some(m) = self.checkpoint_minutes {
            if !(m > 0.0 && m.is_finite()) {
                return invalid(format!(
                    "--checkpoint-minutes {m} must be a positive number"
                ));
            }
        }
        if self.keep_checkpoints == 0 {
            return invalid(
                "--keep-checkpoints must be at least 1 (the newest step checkpoint is what a \
                 restart continues from)"
                    .into(),
            );
        }
        if self.time_limit_secs == Some(0) {
            return invalid("--time-limit must be more than 0 seconds".into());
        }
        if self.resume.as_deref() == Some("latest") && self.out.is_none() {
            return invalid("--resume latest needs --out <run directory> to know which run".into());
        }
        let mut files: Vec<&str> = self.monitors.iter().map(|m| m.file.as_str()).collect();
        files.sort_unstable();
        if let Some(w) = files.windows(2).find(|w| w[0] == w[1]) {
            return invalid(format!("two monitors write the same file {}", w[0]));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_sets_fields_and_validation_names_the_setting() {
        let s = Settings::default().batch_size(0);
        assert_eq!(
            s.validate().unwrap_err().to_string(),
            "--batch-size must be at least 1"
        );
        let s = Settings::default().resume(Some("latest".into())).out(None);
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--resume latest needs --out"));
        let twice = Settings::default()
            .monitor(Monitor::max("a", "best.safetensors"))
            .monitor(Monitor::min("b", "best.safetensors"));
        assert!(twice.validate().is_err());
        let s = Settings::default().epochs(3).accumulate(2).seed(9);
        assert_eq!((s.epochs, s.accumulate, s.seed), (3, 2, 9));
        assert_eq!(
            Settings::default()
                .clip_grad_norm(Some(0.0))
                .validate()
                .unwrap_err()
                .to_string(),
            "--clip-grad-norm 0 must be a positive number"
        );
        let both = Settings::default()
            .lr_schedule(Some(crate::lr_schedule::LrSchedule::Cosine { warmup: 0 }))
            .plateau(Some(Plateau {
                metric: "val_loss".into(),
                goal: Goal::Min,
                config: Default::default(),
            }));
        assert!(both
            .validate()
            .unwrap_err()
            .to_string()
            .contains("cannot be combined"));
    }

    #[test]
    fn goals_compare_in_their_direction() {
        assert!(Goal::Max.improves(0.6, 0.5));
        assert!(!Goal::Max.improves(0.5, 0.5));
        assert!(Goal::Min.improves(0.4, 0.5));
        assert!(!Goal::Min.improves(0.6, 0.5));
    }
}
