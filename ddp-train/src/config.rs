//! The `ddp-train` command line (feature `odir`): the ODIR application's flags, which become
//! the generic Trainer's [`Settings`] and the [`crate::odir::OdirTask`]'s options, and are
//! written to `config.json`.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::amp::Precision;
use crate::ddp::BuiltinHook;
use crate::error::TrainError;
use crate::lr_schedule::LrSchedule;
use crate::optim::{AdamConfig, OptimizerConfig};
use crate::scheduler::PlateauConfig;
pub use crate::settings::DeviceChoice;
use crate::settings::{EarlyStopping, Goal, Monitor, Plateau, Settings};

/// Which labels to train on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Labels {
    /// Per-eye labels (`target`) where the annotations have them, else patient labels.
    Auto,
    /// Per-eye labels; an error when the annotations have none.
    Eye,
    /// Patient labels (`N`..`O`), the same for both eyes.
    Patient,
}

/// One rank of a data-parallel training of the ConvNet on ODIR-5K.
///
/// The rank, world size and rendezvous address come from torchrun's environment (`RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), or SLURM's;
/// without them this is a single-process run. `cargo xtask train` starts N of these.
#[derive(Debug, Clone, Parser, Serialize, Deserialize)]
#[command(name = "ddp-train", version, about, long_about = None)]
pub struct TrainConfig {
    /// ODIR folder: `full_df.csv` + `preprocessed_images/` (or `ODIR-5K/Training Images/`),
    /// or the challenge workbook (`data.xlsx`) + `Training Images/`.
    #[arg(long)]
    pub data: PathBuf,

    /// A separate ODIR folder for validation (instead of splitting --data).
    #[arg(long, conflicts_with = "val_split")]
    pub val_data: Option<PathBuf>,

    /// Fraction of --data's patients held out for validation (both eyes of a patient always
    /// fall on the same side).
    #[arg(long, default_value_t = 0.2)]
    pub val_split: f64,

    /// Labels: per-eye (`target`) by default, because a patient's diagnosis may concern only
    /// one eye, and each image shows one eye; `patient` uses the patient-level N..O columns.
    #[arg(long, value_enum, default_value_t = Labels::Auto)]
    pub labels: Labels,

    /// Skip images that fail to decode (each one is reported) instead of stopping.
    #[arg(long)]
    pub skip_corrupt: bool,

    /// Number of epochs.
    #[arg(long, default_value_t = 10)]
    pub epochs: u64,

    /// Batch size per rank (the global batch is this times the world size).
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,

    /// Micro-batches per optimizer step (gradient accumulation; one all-reduce per step).
    #[arg(long, default_value_t = 1)]
    pub accumulate: usize,

    /// Adam learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,

    /// Adam weight decay (L2 added to the gradient, as torch.optim.Adam).
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,

    /// Side of the square training crops (RandomResizedCrop) and of the validation crops.
    #[arg(long, default_value_t = 224)]
    pub image_size: u32,

    /// Smallest crop area as a fraction of the image (RandomResizedCrop's scale lower bound).
    #[arg(long, default_value_t = 0.2)]
    pub min_crop_scale: f64,

    /// Also flip training images horizontally with probability 1/2.
    #[arg(long)]
    pub hflip: bool,

    /// Dropout probability before the classifier.
    #[arg(long, default_value_t = 0.5)]
    pub dropout: f64,

    /// Loader threads per rank (default: the machine's cores shared among its ranks).
    #[arg(long)]
    pub workers: Option<usize>,

    /// Let a JPEG be decoded at 1/2, 1/4 or 1/8 scale when the crop then needs enlarging by
    /// at most this factor (1: never enlarge, the exact torchvision result; 2: about what
    /// PIL's `draft` does, up to 35% faster on large photos, pixels within ~1/255 on average).
    #[arg(long, default_value_t = 1.0)]
    #[serde(default = "one")]
    pub dct_upsampling: f64,

    /// Batches the loader threads may prepare ahead of the training step (default: 2 on the
    /// CPU, 4 on a GPU, where a slow image must not stall a fast step).
    #[arg(long)]
    #[serde(default)]
    pub prefetch: Option<usize>,

    /// Intra-op threads per rank on CPU (default: the machine's cores shared among its ranks).
    #[arg(long)]
    pub threads: Option<usize>,

    /// Seed of everything random: model init, sampling order, augmentation, dropout.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Run directory (default: runs/YYYYMMDD-HHMMSS, UTC).
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// Resume from a checkpoint: `latest` (the newest in --out) or a checkpoint file
    /// (`.../checkpoints/epoch-0003.safetensors`, or a step checkpoint inside an epoch,
    /// `epoch-0004-step-000120.safetensors`).
    #[arg(long)]
    pub resume: Option<String>,

    /// Only evaluate the model file given by --resume on the validation split (exact
    /// distributed evaluation) and print the metrics as JSON; no training.
    #[arg(long, requires = "resume")]
    pub eval_only: bool,

    /// Device of each rank.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,

    /// Print every rank's loss every N steps (0: never), as the PyTorch tutorial does per GPU.
    #[arg(long, default_value_t = 0)]
    pub log_every: usize,

    /// ReduceLROnPlateau (on validation macro-F1): factor applied to the learning rate.
    #[arg(long, default_value_t = 0.5)]
    pub plateau_factor: f64,

    /// ReduceLROnPlateau: epochs without improvement before reducing.
    #[arg(long, default_value_t = 2)]
    pub plateau_patience: u32,

    /// ReduceLROnPlateau: the learning rate never goes below this.
    #[arg(long, default_value_t = 1e-6)]
    pub min_lr: f64,

    /// Stop each epoch after this many optimizer steps (for quick runs and benchmarks).
    #[arg(long)]
    pub max_steps_per_epoch: Option<usize>,

    /// Seconds a collective may take before the job fails (a dead peer ends the job after
    /// at most this long).
    #[arg(long, default_value_t = 300)]
    pub collective_timeout: u64,

    /// Also checkpoint inside epochs, every N optimizer steps (a crash then loses at most N
    /// steps; a restart continues from the newest checkpoint).
    #[arg(long, value_name = "N")]
    #[serde(default)]
    pub checkpoint_every: Option<u64>,

    /// Also checkpoint inside epochs once M minutes have passed since the last checkpoint.
    #[arg(long, value_name = "M")]
    #[serde(default)]
    pub checkpoint_minutes: Option<f64>,

    /// Step checkpoints to keep (the newest); epoch-end checkpoints and best models stay.
    #[arg(long, default_value_t = 2, value_name = "K")]
    #[serde(default = "two")]
    pub keep_checkpoints: usize,

    /// Stop cleanly with a checkpoint before this much time has passed since the start
    /// (exit code 75); the same command started again continues. Seconds, or a number with
    /// s, m or h (`90s`, `55m`, `4h`).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration_secs)]
    #[serde(default)]
    pub time_limit: Option<u64>,

    /// Precision of the forward pass and the loss (autocast): fp32, bf16, or fp16 with a
    /// dynamic gradient scaler. Weights, gradients and Adam's state stay fp32.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    #[serde(default)]
    pub precision: Precision,

    /// Allow parameters that get no gradient on some ranks in a step (PyTorch DDP's
    /// find_unused_parameters): they count as zeros in the average.
    #[arg(long)]
    #[serde(default)]
    pub find_unused_parameters: bool,

    /// How gradient buckets are averaged: allreduce, bf16_compress or fp16_compress (half
    /// the bytes on the wire, half-precision averages).
    #[arg(long, default_value_t = BuiltinHook::Allreduce, value_name = "HOOK")]
    #[serde(default)]
    pub comm_hook: BuiltinHook,

    /// Reduce gradients after backward instead of while it runs (for comparison).
    #[arg(long)]
    #[serde(default)]
    pub no_overlap: bool,

    /// Adam with decoupled weight decay (AdamW): --weight-decay shrinks the weights instead
    /// of entering the gradient.
    #[arg(long)]
    #[serde(default)]
    pub adamw: bool,

    /// Clip the gradients' global 2-norm to this value after they are averaged over ranks
    /// (the norm is logged with --log-every).
    #[arg(long, value_name = "MAX_NORM")]
    #[serde(default)]
    pub clip_grad_norm: Option<f64>,

    /// How the learning rate changes: plateau (halve it when validation macro-F1 stalls,
    /// per epoch), or per optimizer step: constant, linear, cosine (each after
    /// --warmup-steps), step (times --lr-gamma every --lr-step-every steps), one-cycle (--lr
    /// is the peak).
    #[arg(long, value_enum, default_value_t = ScheduleChoice::Plateau)]
    #[serde(default)]
    pub lr_schedule: ScheduleChoice,

    /// Optimizer steps of linear warmup from 0 (constant, linear, cosine, step schedules).
    #[arg(long, default_value_t = 0, value_name = "N")]
    #[serde(default)]
    pub warmup_steps: u64,

    /// Steps between decays of the step schedule.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    #[serde(default = "thousand")]
    pub lr_step_every: u64,

    /// Factor of each decay of the step schedule.
    #[arg(long, default_value_t = 0.1)]
    #[serde(default = "tenth")]
    pub lr_gamma: f64,

    /// Stop when validation macro-F1 has not improved (by more than
    /// --early-stopping-min-delta) for this many epochs.
    #[arg(long, value_name = "EPOCHS")]
    #[serde(default)]
    pub early_stopping_patience: Option<u32>,

    /// The least change of macro-F1 that counts as an improvement for early stopping.
    #[arg(long, default_value_t = 0.0)]
    #[serde(default)]
    pub early_stopping_min_delta: f64,
}

/// `--lr-schedule`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleChoice {
    /// ReduceLROnPlateau on validation macro-F1, per epoch.
    #[default]
    Plateau,
    /// Warmup, then the base learning rate.
    Constant,
    /// Warmup, then linear decay to 0.
    Linear,
    /// Warmup, then cosine decay to 0.
    Cosine,
    /// Warmup, then decays by --lr-gamma every --lr-step-every steps.
    Step,
    /// PyTorch's OneCycleLR.
    OneCycle,
}

fn thousand() -> u64 {
    1000
}

fn tenth() -> f64 {
    0.1
}

/// Seconds of a duration written as `N`, `Ns`, `Nm` or `Nh`.
pub fn parse_duration_secs(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (number, unit) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&text[..i], c),
        _ => (text, 's'),
    };
    let scale = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        _ => return Err(format!("'{text}': the unit must be s, m or h")),
    };
    let n: u64 = number
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a whole number of seconds, minutes or hours"))?;
    n.checked_mul(scale)
        .filter(|&s| s > 0)
        .ok_or_else(|| format!("'{text}' must be more than 0 and not absurdly large"))
}

impl TrainConfig {
    /// The per-step schedule `--lr-schedule` names (`None` for the plateau scheduler).
    fn per_step_schedule(&self) -> Option<LrSchedule> {
        let warmup = self.warmup_steps;
        Some(match self.lr_schedule {
            ScheduleChoice::Plateau => return None,
            ScheduleChoice::Constant => LrSchedule::Constant { warmup },
            ScheduleChoice::Linear => LrSchedule::Linear { warmup },
            ScheduleChoice::Cosine => LrSchedule::Cosine { warmup },
            ScheduleChoice::Step => LrSchedule::Step {
                warmup,
                every: self.lr_step_every,
                gamma: self.lr_gamma,
            },
            ScheduleChoice::OneCycle => LrSchedule::one_cycle(),
        })
    }

    /// Checks the settings that can be checked without data or peers.
    pub fn validate(&self) -> Result<(), TrainError> {
        let invalid = |m: String| Err(TrainError::Invalid(m));
        let min = ddp_model::ConvNet::MIN_IMAGE_SIZE as u32;
        if self.image_size < min {
            return invalid(format!(
                "--image-size {} is too small: the ConvNet's four 2x poolings need at least {min}",
                self.image_size
            ));
        }
        if !(self.dct_upsampling >= 1.0 && self.dct_upsampling.is_finite()) {
            return invalid(format!(
                "--dct-upsampling {} must be a number >= 1 (1 decodes exactly as torchvision)",
                self.dct_upsampling
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return invalid(format!("--dropout {} must be in [0, 1)", self.dropout));
        }
        if !(self.min_crop_scale > 0.0 && self.min_crop_scale <= 1.0) {
            return invalid(format!(
                "--min-crop-scale {} must be in (0, 1]",
                self.min_crop_scale
            ));
        }
        self.settings().validate()
    }

    /// The generic Trainer's settings these flags stand for: Adam, `ReduceLROnPlateau` on
    /// validation macro-F1, and the best macro-F1 and micro-F1 models kept.
    pub fn settings(&self) -> Settings {
        Settings::default()
            .epochs(self.epochs)
            .batch_size(self.batch_size)
            .accumulate(self.accumulate)
            .optimizer({
                let adam = AdamConfig {
                    lr: self.lr,
                    weight_decay: self.weight_decay,
                    ..Default::default()
                };
                if self.adamw {
                    OptimizerConfig::AdamW(adam)
                } else {
                    OptimizerConfig::Adam(adam)
                }
            })
            .plateau(
                (self.lr_schedule == ScheduleChoice::Plateau).then(|| Plateau {
                    metric: "val_macro_f1".into(),
                    goal: Goal::Max,
                    config: PlateauConfig {
                        factor: self.plateau_factor,
                        patience: self.plateau_patience,
                        min_lr: self.min_lr,
                        ..Default::default()
                    },
                }),
            )
            .lr_schedule(self.per_step_schedule())
            .early_stopping(self.early_stopping_patience.map(|patience| EarlyStopping {
                metric: "val_macro_f1".into(),
                goal: Goal::Max,
                patience,
                min_delta: self.early_stopping_min_delta,
            }))
            .monitor(Monitor::max("val_macro_f1", "best-macro.safetensors"))
            .monitor(Monitor::max("val_micro_f1", "best-micro.safetensors"))
            .seed(self.seed)
            .device(self.device)
            .threads(self.threads)
            .workers(self.workers)
            .prefetch(self.prefetch)
            .out(self.out.clone())
            .resume(self.resume.clone())
            .eval_only(self.eval_only)
            .log_every(self.log_every)
            .max_steps_per_epoch(self.max_steps_per_epoch)
            .collective_timeout_secs(self.collective_timeout)
            .checkpoint_every(self.checkpoint_every)
            .checkpoint_minutes(self.checkpoint_minutes)
            .keep_checkpoints(self.keep_checkpoints)
            .time_limit_secs(self.time_limit)
            .precision(self.precision)
            .find_unused_parameters(self.find_unused_parameters)
            .comm_hook(self.comm_hook)
            .overlap(!self.no_overlap)
            .clip_grad_norm(self.clip_grad_norm)
    }
}

fn one() -> f64 {
    1.0
}

fn two() -> usize {
    2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_a_unit() {
        assert_eq!(parse_duration_secs("90"), Ok(90));
        assert_eq!(parse_duration_secs("90s"), Ok(90));
        assert_eq!(parse_duration_secs("55m"), Ok(3300));
        assert_eq!(parse_duration_secs("4h"), Ok(14400));
        assert_eq!(
            parse_duration_secs("4d"),
            Err("'4d': the unit must be s, m or h".into())
        );
        assert_eq!(
            parse_duration_secs("m"),
            Err("'m' is not a whole number of seconds, minutes or hours".into())
        );
        assert!(parse_duration_secs("0s").is_err());
    }
}
