//! The generic Trainer's command line (feature `cli`): [`TrainArgs`], every setting of
//! [`Settings`] as a flag, for a program to flatten into its own parser, and [`run`], which
//! runs the program as one rank, or starts all its ranks when given `--nproc-per-node`, and
//! turns the result into the process's exit code.
//!
//! ```
//! use clap::Parser;
//! use ddp_train::cli::TrainArgs;
//!
//! /// My model's command line: its own flags, then every training flag.
//! #[derive(Parser)]
//! struct Cli {
//!     /// Width of the hidden layer.
//!     #[arg(long, default_value_t = 64)]
//!     hidden: i64,
//!     #[command(flatten)]
//!     train: TrainArgs,
//! }
//!
//! let cli = Cli::parse_from(["my-model", "--hidden", "32", "--epochs", "3", "--precision", "bf16"]);
//! let settings = cli.train.settings();
//! assert_eq!((cli.hidden, settings.epochs), (32, 3));
//! assert_eq!(settings.precision, ddp_train::Precision::Bf16);
//! assert!(settings.validate().is_ok());
//!
//! // Without --nproc-per-node the body runs here, as one rank (`Trainer::new(..)?.run()` in a
//! // real program); with it, `run` starts the ranks that each run the body.
//! let mut trained = false;
//! let _exit = ddp_train::cli::run(&cli.train, || {
//!     trained = true;
//!     Ok(())
//! });
//! assert!(trained);
//! ```
//!
//! # One command, all devices
//!
//! PyTorch's ways to use every device of a machine from one command are `DataParallel` (one
//! process, a replica per GPU, slower than DDP) and `torch.multiprocessing.spawn` (the script
//! starts one DDP process per device). A program that flattens [`TrainArgs`] and calls
//! [`run`] does the second: `my-trainer --nproc-per-node gpu ...` (or a number, or `cpu`, or
//! `auto`, as `ddp-run` takes them) runs its own executable again once per rank, with the same
//! arguments minus `--nproc-per-node`, through [`ddp_run::launch`]. That is
//! `ddp-run --nproc-per-node N my-trainer ...` in one command, with the same supervision and
//! messages: the first rank to fail ends the job, signals are forwarded to every rank, the
//! exit status is `ddp-run`'s (0, 1 after a failed rank, 75 when every rank stopped at a
//! checkpoint, 128+N after signal N), the ranks meet on a free loopback port, and each rank's
//! output goes to the terminal and to `<run directory>/logs/rank-<r>.out`, next to the
//! Trainer's `rank-<r>.log` (without `--out`, the launching process chooses the run directory
//! and passes it to the ranks as `--out`). Several nodes, `--max-restarts` and the other
//! launcher settings are `ddp-run`'s (or torchrun's) to give; a process that already is a
//! launcher's rank refuses `--nproc-per-node` instead of starting ranks of its own.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::amp::Precision;
use crate::ddp::BuiltinHook;
use crate::error::TrainError;
use crate::lr_schedule::LrSchedule;
use crate::optim::{AdamConfig, OptimizerConfig, SgdConfig};
use crate::scheduler::PlateauConfig;
use crate::settings::{DeviceChoice, EarlyStopping, Goal, Plateau, Settings};

mod launch;

pub use ddp_run::NprocPerNode;

/// Every generic training setting as a flag (`#[command(flatten)]` it into your parser).
/// [`TrainArgs::settings`] turns them into [`Settings`]; the settings that name one of the
/// application's metrics (the plateau scheduler, early stopping, best-model files) are made
/// with [`TrainArgs::plateau_on`] and [`TrainArgs::early_stopping_on`].
#[derive(Debug, Clone, Args, Serialize, Deserialize)]
pub struct TrainArgs {
    /// Number of epochs.
    #[arg(long, default_value_t = 10)]
    pub epochs: u64,

    /// Batch size per rank (the global batch is this times the world size).
    #[arg(long, default_value_t = 16)]
    pub batch_size: usize,

    /// Micro-batches per optimizer step (gradient accumulation; one all-reduce per step).
    #[arg(long, default_value_t = 1)]
    pub accumulate: usize,

    /// Learning rate (the peak with --lr-schedule one-cycle).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,

    /// Weight decay: L2 added to the gradient (adam, sgd), or decoupled (adamw).
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,

    /// Loader threads per rank (default: the machine's cores shared among its ranks).
    #[arg(long)]
    pub workers: Option<usize>,

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

    /// Run directory (default: runs/YYYYMMDD-HHMMSS-PID, UTC).
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

    /// ReduceLROnPlateau (on the application's monitored metric): factor applied to the
    /// learning rate.
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

    /// The optimizer: adam (torch.optim.Adam), adamw (decoupled weight decay) or sgd (with
    /// --momentum).
    #[arg(long, value_enum, default_value_t = OptimizerChoice::Adam)]
    #[serde(default)]
    pub optimizer: OptimizerChoice,

    /// SGD's momentum factor (0: plain SGD).
    #[arg(long, default_value_t = 0.0)]
    #[serde(default)]
    pub momentum: f64,

    /// Clip the gradients' global 2-norm to this value after they are averaged over ranks
    /// (the norm is logged with --log-every).
    #[arg(long, value_name = "MAX_NORM")]
    #[serde(default)]
    pub clip_grad_norm: Option<f64>,

    /// How the learning rate changes: plateau (per epoch, when the application's monitored
    /// metric stalls; the default where the application has one), or per optimizer step:
    /// constant, linear, cosine (each after --warmup-steps), step (times --lr-gamma every
    /// --lr-step-every steps), one-cycle (--lr is the peak).
    #[arg(long, value_enum)]
    #[serde(default)]
    pub lr_schedule: Option<ScheduleChoice>,

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

    /// Stop when the application's monitored metric has not improved (by more than
    /// --early-stopping-min-delta) for this many epochs.
    #[arg(long, value_name = "EPOCHS")]
    #[serde(default)]
    pub early_stopping_patience: Option<u32>,

    /// The least change of the monitored metric that counts as an improvement.
    #[arg(long, default_value_t = 0.0)]
    #[serde(default)]
    pub early_stopping_min_delta: f64,

    /// The node-local rank, as `python -m torch.distributed.launch` passes it (`--local-rank`
    /// or `--local_rank`); it must agree with `LOCAL_RANK` when both are given.
    #[arg(long, alias = "local_rank", value_name = "N")]
    #[serde(skip)]
    pub local_rank: Option<usize>,

    /// Start N ranks of this program on this machine, as `ddp-run --nproc-per-node N` would
    /// (what PyTorch does with DataParallel or mp.spawn): a number, `gpu` (one per visible
    /// GPU), `cpu` (one per core) or `auto`. Each rank runs the same command without this
    /// flag; its output also goes to `<run>/logs/rank-<r>.out`. For several nodes or
    /// restarts, use ddp-run.
    #[arg(
        long = "nproc-per-node",
        visible_alias = "nproc_per_node",
        value_name = "N",
        conflicts_with = "local_rank"
    )]
    #[serde(skip)]
    pub nproc_per_node: Option<NprocPerNode>,
}

/// `--optimizer`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerChoice {
    /// Adam, weight decay as L2 in the gradient.
    #[default]
    Adam,
    /// AdamW, decoupled weight decay.
    Adamw,
    /// SGD with optional momentum.
    Sgd,
}

/// `--lr-schedule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleChoice {
    /// ReduceLROnPlateau on the application's monitored metric, per epoch.
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

impl TrainArgs {
    /// The settings these flags stand for (Adam or AdamW, a per-step schedule if one was
    /// chosen; no plateau scheduler, early stopping or best-model file, which need one of the
    /// application's metrics: add them with [`TrainArgs::plateau_on`] and friends).
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
                match self.optimizer {
                    OptimizerChoice::Adam => OptimizerConfig::Adam(adam),
                    OptimizerChoice::Adamw => OptimizerConfig::AdamW(adam),
                    OptimizerChoice::Sgd => OptimizerConfig::Sgd(SgdConfig {
                        lr: self.lr,
                        momentum: self.momentum,
                        weight_decay: self.weight_decay,
                    }),
                }
            })
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
            .lr_schedule(self.per_step_schedule())
    }

    /// The plateau scheduler on `metric`, when `--lr-schedule` is `plateau` (or, with
    /// `by_default`, not given).
    pub fn plateau_on(&self, metric: &str, goal: Goal, by_default: bool) -> Option<Plateau> {
        let chosen = match self.lr_schedule {
            None => by_default,
            Some(choice) => choice == ScheduleChoice::Plateau,
        };
        chosen.then(|| Plateau {
            metric: metric.into(),
            goal,
            config: PlateauConfig {
                factor: self.plateau_factor,
                patience: self.plateau_patience,
                min_lr: self.min_lr,
                ..Default::default()
            },
        })
    }

    /// Early stopping on `metric`, when `--early-stopping-patience` is given.
    pub fn early_stopping_on(&self, metric: &str, goal: Goal) -> Option<EarlyStopping> {
        self.early_stopping_patience.map(|patience| EarlyStopping {
            metric: metric.into(),
            goal,
            patience,
            min_delta: self.early_stopping_min_delta,
        })
    }

    /// The per-step schedule `--lr-schedule` names (`None` without one, or for `plateau`).
    fn per_step_schedule(&self) -> Option<LrSchedule> {
        let warmup = self.warmup_steps;
        Some(match self.lr_schedule? {
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

    /// Checks what only the command line can get wrong: `--local-rank` against
    /// `LOCAL_RANK`. (The settings' own checks are [`Settings::validate`].)
    pub fn validate(&self) -> Result<(), TrainError> {
        let Some(flag) = self.local_rank else {
            return Ok(());
        };
        let env = ddp_comm::EnvConfig::from_env()?;
        if env.source == ddp_comm::EnvSource::Single || env.local_rank == flag {
            return Ok(());
        }
        Err(TrainError::Invalid(format!(
            "--local-rank {flag} disagrees with the launcher's local rank {} (LOCAL_RANK or \
             SLURM_LOCALID): both must name the same device",
            env.local_rank
        )))
    }
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

/// Runs a training program: its `body` as one rank, or, when `args` has `--nproc-per-node`,
/// all its ranks on this machine (see [One command, all devices](self#one-command-all-devices):
/// the answer to PyTorch's `DataParallel` and `mp.spawn`), and turns the result into the exit
/// code.
///
/// As one rank (the rank's place read from torchrun's or SLURM's environment by the
/// Trainer, or a single process without them): success, 75 ([`crate::EXIT_STOPPED`]) after a
/// requested stop (SIGTERM, SIGUSR1, `--time-limit`) and its checkpoint, which launchers and
/// schedulers requeue, and otherwise `error: ` and the error's chain on stderr, without a
/// backtrace, and exit code 1. When starting the ranks: `ddp-run`'s exit status for the job,
/// or `error: ...` and 1 when they cannot be started (among others in a process that is
/// already a launcher's rank).
pub fn run(args: &TrainArgs, body: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    let result = match args.nproc_per_node {
        Some(nproc) => launch::start_ranks(args, nproc),
        None => body().map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(err)
            if err
                .downcast_ref::<TrainError>()
                .is_some_and(|e| matches!(e, TrainError::Stopped { .. })) =>
        {
            eprintln!("{err}");
            ExitCode::from(crate::EXIT_STOPPED)
        }
        Err(err) => {
            // A missing folder or a bad setting is the user's to fix, not a bug: the message
            // and its causes, without a backtrace (bugs panic, and keep theirs).
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn two() -> usize {
    2
}

fn thousand() -> u64 {
    1000
}

fn tenth() -> f64 {
    0.1
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        train: TrainArgs,
    }

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

    #[test]
    fn flags_become_settings_and_the_old_launcher_spelling_of_local_rank_is_accepted() {
        let cli = Cli::parse_from([
            "x",
            "--lr-schedule",
            "cosine",
            "--warmup-steps",
            "5",
            "--optimizer",
            "adamw",
            "--clip-grad-norm",
            "1.5",
            "--local_rank",
            "3",
        ]);
        let s = cli.train.settings();
        assert_eq!(s.lr_schedule, Some(LrSchedule::Cosine { warmup: 5 }));
        assert!(matches!(s.optimizer, OptimizerConfig::AdamW(_)));
        assert_eq!(s.clip_grad_norm, Some(1.5));
        assert_eq!(cli.train.local_rank, Some(3));
        assert!(cli.train.plateau_on("m", Goal::Max, true).is_none());
        let plain = Cli::parse_from(["x", "--local-rank", "1"]);
        assert!(plain.train.plateau_on("m", Goal::Max, true).is_some());
        assert!(plain.train.plateau_on("m", Goal::Max, false).is_none());
        assert_eq!(plain.train.local_rank, Some(1));
    }

    #[test]
    fn nproc_per_node_is_the_launchers_and_changes_no_setting() {
        let with = Cli::parse_from(["x", "--epochs", "2", "--nproc-per-node", "2"]);
        let without = Cli::parse_from(["x", "--epochs", "2"]);
        assert_eq!(with.train.nproc_per_node, Some(NprocPerNode::Count(2)));
        assert_eq!(without.train.nproc_per_node, None);
        assert_eq!(with.train.settings(), without.train.settings());
        // Nor is it recorded with the flags (config.json).
        assert_eq!(
            serde_json::to_value(&with.train).unwrap(),
            serde_json::to_value(&without.train).unwrap()
        );
        let gpu = Cli::parse_from(["x", "--nproc_per_node=gpu"]);
        assert_eq!(gpu.train.nproc_per_node, Some(NprocPerNode::Gpu));
        // The ranks get their local rank from the launcher, not from a flag.
        let both = Cli::try_parse_from(["x", "--nproc-per-node", "2", "--local-rank", "0"]);
        assert_eq!(
            both.err().map(|e| e.kind()),
            Some(clap::error::ErrorKind::ArgumentConflict)
        );
    }
}
