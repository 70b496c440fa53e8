//! The generic Trainer's command line (feature `cli`): [`TrainArgs`], every setting of
//! [`Settings`] as a flag, for a program to flatten into its own parser, with the program's
//! own defaults ([`Defaults`]); and [`run`], which runs the program as one rank, or starts all
//! its ranks when given `--nproc-per-node`, and turns the result into the process's exit code.
//!
//! The flags are derived from the settings' types (`Settings` and its groups implement
//! `clap::Args`): a flag's default is its setting's default, `--help` groups the flags as
//! `Settings` groups the settings, and an invalid setting is reported by its flag
//! (`error: --batch-size must be at least 1`) where code names the field
//! (`batch_size must be at least 1`).
//!
//! ```
//! use clap::Parser;
//! use ddp_train::cli::{Defaults, TrainArgs};
//! use ddp_train::Settings;
//!
//! /// The program's defaults: one line each.
//! struct MyDefaults;
//!
//! impl Defaults for MyDefaults {
//!     fn settings() -> Settings {
//!         Settings::default().epochs(3).batch_size(64)
//!     }
//! }
//!
//! /// My model's command line: its own flags, then every training flag.
//! #[derive(Parser)]
//! struct Cli {
//!     /// Width of the hidden layer.
//!     #[arg(long, default_value_t = 64)]
//!     hidden: i64,
//!     #[command(flatten)]
//!     train: TrainArgs<MyDefaults>,
//! }
//!
//! let cli = Cli::parse_from(["my-model", "--hidden", "32", "--precision", "bf16"]);
//! let settings = cli.train.settings();
//! assert_eq!((cli.hidden, settings.epochs, settings.batch_size), (32, 3, 64));
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

use std::collections::BTreeSet;
use std::marker::PhantomData;
use std::process::ExitCode;

use clap::{ArgMatches, Args, Command, FromArgMatches};

use crate::error::{SettingError, TrainError};
use crate::settings::Settings;

mod defaults;
mod launch;

pub use crate::settings::parse_duration_secs;
pub use ddp_run::NprocPerNode;
pub use defaults::{Defaults, GenericDefaults};

/// Every generic training flag (`#[command(flatten)]` it into your parser), with the defaults
/// of `D` ([`Defaults`]; without one, `Settings::default()`'s), and the two flags of a
/// launch (`--local-rank`, `--nproc-per-node`). [`TrainArgs::settings`] is what they stand
/// for: `D`'s settings with each given flag applied, so settings that no flag sets (the
/// best-model files, the metric the plateau scheduler and early stopping watch) come from `D`.
pub struct TrainArgs<D = GenericDefaults> {
    settings: Settings,
    /// The node-local rank, as `python -m torch.distributed.launch` passes it (`--local-rank`
    /// or `--local_rank`): it must agree with `LOCAL_RANK` where that is set, and is the
    /// rank's local rank where it is not.
    pub local_rank: Option<usize>,
    /// `--nproc-per-node`: start this many ranks of the program here (see [`run`]).
    pub nproc_per_node: Option<NprocPerNode>,
    defaults: PhantomData<fn() -> D>,
}

/// The launch's flags: not settings of the training, never recorded with them.
#[derive(clap::Args)]
struct LaunchArgs {
    /// The node-local rank, as `python -m torch.distributed.launch` passes it (`--local-rank`
    /// or `--local_rank`): it must agree with `LOCAL_RANK` where that is set, and is the
    /// rank's local rank where it is not.
    #[arg(long, alias = "local_rank", value_name = "N")]
    local_rank: Option<usize>,

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
    nproc_per_node: Option<NprocPerNode>,
}

impl<D: Defaults> Args for TrainArgs<D> {
    fn augment_args(cmd: Command) -> Command {
        let heading = cmd.get_next_help_heading().map(str::to_owned);
        let before: BTreeSet<String> = ids(&cmd);
        let cmd = Settings::augment_args(cmd);
        let added: BTreeSet<String> = ids(&cmd).difference(&before).cloned().collect();
        let cmd = defaults::install(cmd, &added, &D::settings());
        let cmd = LaunchArgs::augment_args(cmd.next_help_heading("Launching"));
        // The program's own flags after these keep the heading they had before.
        match heading {
            Some(heading) => cmd.next_help_heading(heading),
            None => cmd.next_help_heading(None::<&'static str>),
        }
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

/// Refuses a flag given on the command line that the other settings leave unused (SGD's
/// `--momentum` with Adam, a schedule's parameters under another schedule, the early-stopping
/// threshold without early stopping), naming the setting it needs: nothing given is silently
/// dropped.
fn refuse_unused_flags(matches: &ArgMatches, s: &Settings) -> Result<(), clap::Error> {
    use crate::lr_schedule::ScheduleKind;
    use crate::optim::OptimizerConfig;
    let given = |id: &str| {
        matches.ids().any(|i| i.as_str() == id)
            && matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
    };
    let flags = defaults::flag_names();
    let flag = |id: &str| flags.get(id).cloned().unwrap_or_else(|| id.to_string());
    let conflict = |text: String| {
        Err(clap::Error::raw(
            clap::error::ErrorKind::ArgumentConflict,
            text,
        ))
    };
    if s.checkpoint.eval_only {
        if let Some(id) = TRAINING_ONLY.iter().find(|id| given(id)) {
            return conflict(format!(
                "{} is a training flag, which --eval-only does not read",
                flag(id)
            ));
        }
    }
    let kind = s.lr_schedule.kind();
    let schedule = clap::ValueEnum::to_possible_value(&kind)
        .map_or_else(String::new, |v| v.get_name().to_string());
    let for_schedules = |kinds: &[ScheduleKind], which: &str| {
        (!kinds.contains(&kind))
            .then(|| format!("applies to {which} (--lr-schedule is {schedule})"))
    };
    use ScheduleKind::{Constant, Cosine, Linear, Plateau, Step};
    let rules: [(&str, Option<String>); 8] = [
        (
            "optimizer.momentum",
            match s.optimizer {
                OptimizerConfig::Sgd(_) => None,
                OptimizerConfig::Adam(_) => Some("applies to --optimizer sgd only (it is adam)"),
                OptimizerConfig::AdamW(_) => Some("applies to --optimizer sgd only (it is adamw)"),
            }
            .map(str::to_string),
        ),
        (
            "lr_schedule.warmup",
            for_schedules(
                &[Constant, Linear, Cosine, Step],
                "the constant, linear, cosine and step schedules",
            ),
        ),
        (
            "lr_schedule.every",
            for_schedules(&[Step], "--lr-schedule step only"),
        ),
        (
            "lr_schedule.gamma",
            for_schedules(&[Step], "--lr-schedule step only"),
        ),
        (
            "lr_schedule.config.factor",
            for_schedules(&[Plateau], "--lr-schedule plateau only"),
        ),
        (
            "lr_schedule.config.patience",
            for_schedules(&[Plateau], "--lr-schedule plateau only"),
        ),
        (
            "lr_schedule.config.min_lr",
            for_schedules(&[Plateau], "--lr-schedule plateau only"),
        ),
        (
            "early_stopping.min_delta",
            s.early_stopping
                .patience
                .is_none()
                .then(|| "needs --early-stopping-patience (early stopping is off)".to_string()),
        ),
    ];
    match rules
        .into_iter()
        .find_map(|(id, why)| why.filter(|_| given(id)).map(|why| (id, why)))
    {
        Some((id, why)) => conflict(format!("{} {why}", flag(id))),
        None => Ok(()),
    }
}

/// The flags (by id) of settings that only training reads: `--eval-only` refuses them.
const TRAINING_ONLY: [&str; 32] = [
    "epochs",
    "accumulate",
    "max_steps_per_epoch",
    "optimizer.kind",
    "optimizer.lr",
    "optimizer.weight_decay",
    "optimizer.momentum",
    "clip_grad_norm",
    "lr_schedule.kind",
    "lr_schedule.warmup",
    "lr_schedule.every",
    "lr_schedule.gamma",
    "lr_schedule.config.factor",
    "lr_schedule.config.patience",
    "lr_schedule.config.min_lr",
    "early_stopping.patience",
    "early_stopping.min_delta",
    "checkpoint.every",
    "checkpoint.minutes",
    "checkpoint.keep",
    "checkpoint.init_from",
    "checkpoint.init_key",
    "checkpoint.init_partial",
    "freeze.prefixes",
    "freeze.unfreeze_at",
    "sync_batchnorm",
    "ddp.find_unused_parameters",
    "ddp.overlap",
    "ddp.comm_hook",
    "ddp.gradient_as_bucket_view",
    "runtime.time_limit_secs",
    "runtime.log_every",
];

/// The ids of `cmd`'s arguments.
fn ids(cmd: &Command) -> BTreeSet<String> {
    cmd.get_arguments()
        .map(|a| a.get_id().to_string())
        .collect()
}

impl<D: Defaults> FromArgMatches for TrainArgs<D> {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut args = Self::default();
        args.update_from_arg_matches(matches)?;
        Ok(args)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        self.settings.update_from_arg_matches(matches)?;
        refuse_unused_flags(matches, &self.settings)?;
        let launch = LaunchArgs::from_arg_matches(matches)?;
        self.local_rank = launch.local_rank;
        self.nproc_per_node = launch.nproc_per_node;
        Ok(())
    }
}

impl<D: Defaults> Default for TrainArgs<D> {
    /// `D`'s settings, as a command line without flags gives them.
    fn default() -> Self {
        Self {
            settings: D::settings(),
            local_rank: None,
            nproc_per_node: None,
            defaults: PhantomData,
        }
    }
}

impl<D> Clone for TrainArgs<D> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings.clone(),
            local_rank: self.local_rank,
            nproc_per_node: self.nproc_per_node,
            defaults: PhantomData,
        }
    }
}

impl<D> std::fmt::Debug for TrainArgs<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainArgs")
            .field("settings", &self.settings)
            .field("local_rank", &self.local_rank)
            .field("nproc_per_node", &self.nproc_per_node)
            .finish()
    }
}

impl<D> TrainArgs<D> {
    /// The settings these flags stand for: the program's defaults with every given flag
    /// applied. Add what needs the program (`monitor`) or change anything before handing
    /// them to the Trainer.
    pub fn settings(&self) -> Settings {
        self.settings.clone()
    }

    /// Checks what only the command line can get wrong: `--local-rank` against the
    /// launcher's local rank (`LOCAL_RANK` or `SLURM_LOCALID`) where it gave one. (The
    /// settings' own checks are [`Settings::validate`].) Where a launcher of torchrun's
    /// variables gave none (`python -m torch.distributed.launch` before PyTorch 1.9, or
    /// without `--use-env`, passes only the flag), [`run`] makes the flag the rank's
    /// `LOCAL_RANK` before its body starts.
    pub fn validate(&self) -> Result<(), TrainError> {
        self.local_rank_to_set().map(|_| ())
    }

    /// `--local-rank`, where the launcher set torchrun's variables without a local rank; an
    /// error where it gave another local rank.
    fn local_rank_to_set(&self) -> Result<Option<usize>, TrainError> {
        let Some(flag) = self.local_rank else {
            return Ok(None);
        };
        let env = ddp_comm::EnvConfig::from_env()?;
        match env.source {
            ddp_comm::EnvSource::Single => Ok(None),
            ddp_comm::EnvSource::Torchrun if !env.local_rank_given => Ok(Some(flag)),
            _ if env.local_rank == flag => Ok(None),
            _ => Err(TrainError::Invalid(format!(
                "--local-rank {flag} disagrees with the launcher's local rank {} (LOCAL_RANK \
                 or SLURM_LOCALID): both must name the same device",
                env.local_rank
            ))),
        }
    }
}

/// `error` and its causes as [`ddp_run::cli::error_message`] writes them (`outer: cause:
/// cause`, each said once), with each setting an invalid-setting error or the ranks'
/// disagreement names written as its flag (`--batch-size`), or as its path when it has none.
pub fn describe_error(error: &anyhow::Error) -> String {
    let flags = defaults::flag_names();
    let name = |field: &str| {
        flags
            .get(field)
            .cloned()
            .unwrap_or_else(|| field.to_string())
    };
    let render = |e: &(dyn std::error::Error + 'static)| match e.downcast_ref::<TrainError>() {
        Some(TrainError::Setting(s)) => s.render(name),
        Some(TrainError::RanksDisagree { settings }) => {
            crate::error::render_disagreements(settings, &name)
        }
        _ => e
            .downcast_ref::<SettingError>()
            .map_or_else(|| e.to_string(), |s| s.render(name)),
    };
    ddp_run::join_causes(error.chain().map(render))
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
/// backtrace, and exit code 1. The error, or a panic, is recorded for the launcher as
/// [`exit_with`](crate::exit_with) records it: timed before the Trainer that failed is
/// dropped. When starting the ranks: `ddp-run`'s exit status for the job,
/// or `error: ...` and 1 when they cannot be started (among others in a process that is
/// already a launcher's rank).
///
/// As one rank, the stop signals are watched from before `body` runs (unless the settings
/// say `eval_only` or not `stop_on_signals`), so that one that comes while the body opens
/// its data is taken at the first step of the body's Trainer, which adopts the watch. One
/// that no Trainer took ends the process, as unwatched, when `body` returns.
pub fn run<D>(args: &TrainArgs<D>, body: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    run_checked(args, || Ok(()), body)
}

/// [`run`], where `check` tests the program's own settings (those beyond [`TrainArgs`]) that
/// every rank would refuse: when starting the ranks it runs first, so that they are refused
/// before any rank starts, as the generic settings are. (As one rank, `body` checks them.)
pub fn run_checked<D>(
    args: &TrainArgs<D>,
    check: impl FnOnce() -> anyhow::Result<()>,
    body: impl FnOnce() -> anyhow::Result<()>,
) -> ExitCode {
    let runtime = &args.settings.runtime;
    let watch = runtime.stop_on_signals && !args.settings.checkpoint.eval_only;
    run_with(args, check, body, watch)
}

/// [`run_checked`] for a program that runs a trained model without training it (ODIR's
/// `predict` and `evaluate`): it has no checkpoint to stop at, so the stop signals keep
/// their action (by default, ending the process) while `body` runs.
pub fn run_inference<D>(
    args: &TrainArgs<D>,
    check: impl FnOnce() -> anyhow::Result<()>,
    body: impl FnOnce() -> anyhow::Result<()>,
) -> ExitCode {
    run_with(args, check, body, false)
}

/// [`run_checked`], with the stop signals watched before `body` when `watch`.
fn run_with<D>(
    args: &TrainArgs<D>,
    check: impl FnOnce() -> anyhow::Result<()>,
    body: impl FnOnce() -> anyhow::Result<()>,
    watch: bool,
) -> ExitCode {
    crate::exit::caught(|| run_body(args, check, body, watch))
}

/// [`run_with`]'s work, inside its record of a panic.
fn run_body<D>(
    args: &TrainArgs<D>,
    check: impl FnOnce() -> anyhow::Result<()>,
    body: impl FnOnce() -> anyhow::Result<()>,
    watch: bool,
) -> ExitCode {
    // Ends the watch if no Trainer adopted it, after `finish` has printed the body's error: a
    // signal it caught then takes its action (by default, ending the process).
    let mut until_trainer = None;
    let result = match args.nproc_per_node {
        // Settings every rank would refuse are refused here, before any rank starts (and
        // before the run directory the ranks would be given exists).
        Some(nproc) => args
            .settings
            .validate()
            .map_err(anyhow::Error::from)
            .and_then(|()| check())
            .and_then(|()| {
                let (out, device) = (args.settings.out.as_deref(), args.settings.runtime.device);
                launch::start_ranks(out, device, nproc)
            }),
        None => args
            .local_rank_to_set()
            .map_err(anyhow::Error::from)
            .and_then(|local_rank| {
                if let Some(n) = local_rank {
                    // Read by the Trainer's `EnvConfig::from_env`; set before the body
                    // starts a thread that could read the environment at the same time.
                    std::env::set_var(ddp_run::env::LOCAL_RANK, n.to_string());
                }
                if watch {
                    until_trainer =
                        Some(crate::stop::watch_until_trainer().map_err(anyhow::Error::msg)?);
                }
                body()
            })
            .map(|()| ExitCode::SUCCESS),
    };
    let status = finish(result);
    drop(until_trainer);
    status
}

/// Prints a failure as a rank's program does, records it for the launcher
/// ([`ddp_run::record_error`], as arisen when a Trainer's failure was noted where it is that
/// Trainer's error, else now), and turns it into the
/// exit status: after a stop on request its message and 75 ([`crate::exit_with`]'s rule),
/// else `error: `.
fn finish(result: anyhow::Result<ExitCode>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(err) => {
            let status = crate::exit::exit_status(err.as_ref());
            // A missing folder or a bad setting is the user's to fix, not a bug: the message
            // and its causes, without a backtrace (bugs panic, and keep theirs).
            let error = if status == crate::EXIT_STOPPED {
                ""
            } else {
                "error: "
            };
            let message = describe_error(&err);
            crate::exit::record_error(err.as_ref(), &message);
            eprintln!("{error}{message}");
            ExitCode::from(status)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddp::DdpOptions;
    use crate::lr_schedule::{LrSchedule, Plateau};
    use crate::optim::{AdamConfig, OptimizerConfig, SgdConfig};
    use crate::scheduler::PlateauConfig;
    use crate::settings::{
        CheckpointSettings, DeviceChoice, EarlyStopping, Monitor, RuntimeSettings,
    };
    use crate::Precision;
    use clap::{CommandFactory, Parser};
    use serde_json::Value;
    use std::collections::BTreeMap;

    /// `--help` shows no rustdoc markup: clap takes value enums' doc comments as their help,
    /// where a link (`[`GradScaler`]`) would print as it is written.
    #[test]
    fn the_long_help_has_no_rustdoc_links() {
        let help = Cli::<GenericDefaults>::command()
            .render_long_help()
            .to_string();
        assert!(help.contains("fp16: Autocast to IEEE half"), "{help}");
        for markup in ["[`", "`]", "]("] {
            assert!(!help.contains(markup), "{markup} in:\n{help}");
        }
    }

    /// A stop on request gives 75 in anyhow's context too (a requeue), anything else 1.
    #[test]
    fn a_stop_on_request_exits_75_through_context() {
        use crate::exit::exit_status;
        use crate::stop::StopReason;
        let stopped = || TrainError::EvaluationStopped {
            reason: StopReason::Signal(15),
        };
        let status = |e: anyhow::Error| exit_status(e.as_ref());
        assert_eq!(status(anyhow::Error::from(stopped())), 75);
        assert_eq!(
            status(anyhow::Error::from(stopped()).context("training")),
            75
        );
        assert_eq!(status(TrainError::Invalid("bad".into()).into()), 1);
        assert_eq!(status(anyhow::anyhow!("no TrainError")), 1);
    }

    #[derive(Parser)]
    struct Cli<D: Defaults = GenericDefaults> {
        #[command(flatten)]
        train: TrainArgs<D>,
    }

    /// The settings' own flags, with the defaults their types derive (no program defaults).
    #[derive(Parser)]
    struct Raw {
        #[command(flatten)]
        settings: Settings,
    }

    fn parse<D: Defaults>(args: &[&str]) -> Settings {
        let argv = std::iter::once("x").chain(args.iter().copied());
        Cli::<D>::try_parse_from(argv)
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
            .train
            .settings()
    }

    /// The issue's drift check: every flag's default is its setting's default, so a command
    /// line without flags is `Settings::default()`, field for field.
    #[test]
    fn no_flags_are_the_default_settings() {
        assert_eq!(Raw::parse_from(["x"]).settings, Settings::default());
        assert_eq!(parse::<GenericDefaults>(&[]), Settings::default());
    }

    /// A program's defaults for every setting that has a flag, and some that have none.
    struct Everything;

    fn everything() -> Settings {
        Settings::default()
            .epochs(7)
            .batch_size(5)
            .accumulate(3)
            .seed(11)
            .max_steps_per_epoch(Some(9))
            .precision(Precision::Bf16)
            .out(Some("runs/x".into()))
            .optimizer(OptimizerConfig::Sgd(SgdConfig {
                lr: 0.25,
                momentum: 0.5,
                weight_decay: 0.125,
            }))
            .clip_grad_norm(Some(2.5))
            .lr_schedule(LrSchedule::Step {
                warmup: 4,
                every: 40,
                gamma: 0.5,
            })
            .early_stopping(EarlyStopping::max("val_f1").after(6))
            .monitor(Monitor::max("val_f1", "best.safetensors"))
            .checkpoint(
                CheckpointSettings::default()
                    .resume(Some("latest".into()))
                    .eval_only(true)
                    .resume_after_restart(false)
                    .every(Some(12))
                    .minutes(Some(1.5))
                    .keep(4),
            )
            .ddp(DdpOptions {
                broadcast_buffers: false,
                find_unused_parameters: true,
                overlap: false,
                comm_hook: crate::BuiltinHook::Bf16Compress,
                gradient_as_bucket_view: true,
                ..DdpOptions::default()
            })
            .runtime(
                RuntimeSettings::default()
                    .device(DeviceChoice::Cpu)
                    .threads(Some(2))
                    .workers(Some(3))
                    .prefetch(Some(6))
                    .collective_timeout_secs(Some(60))
                    .time_limit_secs(Some(3600))
                    .log_every(10)
                    .progress(false),
            )
    }

    impl Defaults for Everything {
        fn settings() -> Settings {
            everything()
        }
    }

    #[test]
    fn a_programs_defaults_are_what_no_flags_parse_to_and_what_help_shows() {
        assert_eq!(parse::<Everything>(&[]), everything());
        let cmd = Cli::<Everything>::command();
        let default_of = |id: &str| {
            let arg = cmd.get_arguments().find(|a| a.get_id() == id).unwrap();
            let values: Vec<String> = arg
                .get_default_values()
                .iter()
                .map(|v| v.to_string_lossy().into_owned())
                .collect();
            values.join(",")
        };
        for (id, shown) in [
            ("epochs", "7"),
            ("optimizer.kind", "sgd"),
            ("optimizer.lr", "0.25"),
            ("lr_schedule.kind", "step"),
            ("runtime.time_limit_secs", "3600"),
            ("ddp.comm_hook", "bf16_compress"),
            ("checkpoint.minutes", "1.5"),
        ] {
            assert_eq!(default_of(id), shown, "{id}");
        }
        let help = Cli::<Everything>::command().render_help().to_string();
        assert!(help.contains("[default: bf16_compress]"), "{help}");
        // Switches whose program default is already on their side take a value.
        assert!(help.contains("--find-unused-parameters[=<BOOL>]"), "{help}");
        // (Training flags need the program's --eval-only off.)
        let off = parse::<Everything>(&[
            "--resume",
            "latest",
            "--eval-only=false",
            "--find-unused-parameters=false",
            "--no-overlap=false",
        ]);
        assert!(!off.ddp.find_unused_parameters && off.ddp.overlap);
        assert!(!off.checkpoint.eval_only);
        // A given flag overrides the program's default; the others stay.
        let given = parse::<Everything>(&["--batch-size", "8", "--threads", "1"]);
        assert_eq!(
            given,
            everything()
                .batch_size(8)
                .runtime(everything().runtime.threads(Some(1)))
        );
    }

    #[test]
    fn flags_become_the_settings_they_name() {
        let s = parse::<GenericDefaults>(&[
            "--lr-schedule",
            "cosine",
            "--warmup-steps",
            "5",
            "--optimizer",
            "adamw",
            "--weight-decay",
            "0.01",
            "--clip-grad-norm",
            "1.5",
            "--checkpoint-every",
            "100",
            "--time-limit",
            "2m",
            "--no-broadcast-buffers",
            "--gradient-as-bucket-view",
            "--comm-hook",
            "fp16_compress",
            "--device",
            "cpu",
        ]);
        let want = Settings::default()
            .lr_schedule(LrSchedule::Cosine { warmup: 5 })
            .optimizer(OptimizerConfig::AdamW(AdamConfig {
                weight_decay: 0.01,
                ..AdamConfig::default()
            }))
            .clip_grad_norm(Some(1.5))
            .checkpoint(CheckpointSettings::default().every(Some(100)))
            .ddp(DdpOptions {
                broadcast_buffers: false,
                gradient_as_bucket_view: true,
                comm_hook: crate::BuiltinHook::Fp16Compress,
                ..DdpOptions::default()
            })
            .runtime(
                RuntimeSettings::default()
                    .time_limit_secs(Some(120))
                    .device(DeviceChoice::Cpu),
            );
        assert_eq!(s, want);
    }

    #[test]
    fn adamw_takes_torchs_weight_decay_unless_one_is_given() {
        let adamw = |args: &[&str]| match parse::<GenericDefaults>(args).optimizer {
            OptimizerConfig::AdamW(c) => c.weight_decay,
            other => panic!("{other:?}"),
        };
        assert_eq!(adamw(&["--optimizer", "adamw"]), 0.01);
        assert_eq!(adamw(&["--optimizer", "adamw", "--weight-decay", "0"]), 0.0);
        assert_eq!(
            parse::<GenericDefaults>(&["--optimizer", "adam"])
                .optimizer
                .weight_decay(),
            0.0
        );
        // SGD's learning rate is torch's 1e-3 from the flags and from the library alike.
        assert_eq!(
            parse::<GenericDefaults>(&["--optimizer", "sgd"])
                .optimizer
                .lr(),
            1e-3
        );
        assert_eq!(SgdConfig::default().lr, 1e-3);
    }

    struct Odirish;

    impl Defaults for Odirish {
        fn settings() -> Settings {
            let plateau = PlateauConfig {
                factor: 0.5,
                patience: 2,
                ..Default::default()
            };
            Settings::default()
                .optimizer(OptimizerConfig::Adam(AdamConfig {
                    beta2: 0.98,
                    ..Default::default()
                }))
                .lr_schedule(LrSchedule::Plateau(Plateau::max("val_f1").with(plateau)))
                .early_stopping(EarlyStopping::max("val_f1"))
        }
    }

    /// What no flag sets (the watched metric, Adam's beta2) comes from the program's
    /// defaults while the kind stays; another kind starts from its own defaults.
    #[test]
    fn parameters_without_flags_stay_with_their_kind() {
        let plain = parse::<Odirish>(&["--plateau-patience", "4", "--lr", "0.01"]);
        let LrSchedule::Plateau(p) = &plain.lr_schedule else {
            panic!("{:?}", plain.lr_schedule)
        };
        assert_eq!(
            (p.metric.as_str(), p.config.factor, p.config.patience),
            ("val_f1", 0.5, 4)
        );
        assert_eq!(
            plain.optimizer,
            OptimizerConfig::Adam(AdamConfig {
                lr: 0.01,
                beta2: 0.98,
                ..Default::default()
            })
        );
        let early = parse::<Odirish>(&["--early-stopping-patience", "3"]).early_stopping;
        assert_eq!(early, EarlyStopping::max("val_f1").after(3));
        let other = parse::<Odirish>(&["--lr-schedule", "step", "--optimizer", "sgd"]);
        assert_eq!(
            other.lr_schedule,
            LrSchedule::Step {
                warmup: 0,
                every: 1000,
                gamma: 0.1
            }
        );
        assert_eq!(
            other.optimizer,
            OptimizerConfig::Sgd(SgdConfig {
                lr: 1e-3,
                ..Default::default()
            })
        );
        // A generic program's plateau watches the validation loss.
        let generic = parse::<GenericDefaults>(&["--lr-schedule", "plateau"]).lr_schedule;
        assert_eq!(generic, LrSchedule::Plateau(Plateau::min("val_loss")));
    }

    /// Every setting has a flag whose id is its path, but for those listed here, which are
    /// the program's to choose; a new setting without a flag must be added to the list.
    #[test]
    fn every_setting_has_a_flag_named_by_its_path_or_is_listed_without_one() {
        let without_flag = [
            "monitors",
            "early_stopping.metric",
            "early_stopping.goal",
            "checkpoint.resume_after_restart",
            "ddp.bucket_cap_bytes",
            "ddp.first_bucket_cap_bytes",
            "runtime.stop_on_signals",
            "runtime.progress",
            "runtime.plot",
            "optimizer.beta1",
            "optimizer.beta2",
            "optimizer.eps",
            "lr_schedule.metric",
            "lr_schedule.goal",
            "lr_schedule.config.threshold",
            "lr_schedule.config.cooldown",
            "lr_schedule.pct_start",
            "lr_schedule.div_factor",
            "lr_schedule.final_div_factor",
        ];
        let ids = ids(&Raw::command());
        let mut paths = BTreeMap::new();
        let kinds = [
            Settings::default(),
            everything(),
            Settings::default().lr_schedule(LrSchedule::Plateau(Plateau::default())),
            Settings::default().lr_schedule(LrSchedule::one_cycle()),
        ];
        for s in &kinds {
            let json: Value = serde_json::to_value(s).unwrap();
            defaults::leaves(&json, "", &mut paths);
        }
        for path in paths.keys() {
            assert!(
                ids.contains(path) || without_flag.contains(&path.as_str()),
                "setting {path} has no flag"
            );
        }
        for id in &ids {
            assert!(
                paths.contains_key(id) || id == "optimizer.kind" || id == "lr_schedule.kind",
                "flag {id} names no setting"
            );
        }
        for id in TRAINING_ONLY {
            assert!(ids.contains(id), "TRAINING_ONLY's {id} is no flag");
        }
    }

    #[test]
    fn errors_name_settings_by_their_flags() {
        let batch = Settings::default().batch_size(0).validate().unwrap_err();
        let error = anyhow::Error::from(TrainError::from(batch)).context("starting");
        assert_eq!(
            describe_error(&error),
            "starting: --batch-size must be at least 1"
        );
        let latest = SettingError::new("checkpoint.resume", " latest needs ")
            .setting("out")
            .text(" to know which run");
        assert_eq!(
            describe_error(&anyhow::Error::from(latest)),
            "--resume latest needs --out to know which run"
        );
        for (settings, flagged) in [
            (
                Settings::default().max_steps_per_epoch(Some(0)),
                "--max-steps-per-epoch must be at least 1",
            ),
            (
                Settings::default()
                    .runtime(RuntimeSettings::default().collective_timeout_secs(Some(0))),
                "--collective-timeout must be at least 1",
            ),
        ] {
            let e = anyhow::Error::from(settings.validate().unwrap_err());
            assert_eq!(describe_error(&e), flagged);
        }
        // A setting without a flag keeps its path.
        let cycle = SettingError::new("lr_schedule.pct_start", " 2 must be in (0, 1)");
        assert_eq!(
            describe_error(&anyhow::Error::from(cycle)),
            "lr_schedule.pct_start 2 must be in (0, 1)"
        );
        // The ranks' disagreement names flags too, and keeps the paths of the rest.
        let lr = crate::Disagreement::new("optimizer.lr".into(), 0.001.into(), 1, 0.1.into());
        let hook = crate::Disagreement::new(
            "ddp.comm_hook".into(),
            "fp16_compress".into(),
            2,
            "bf16_compress".into(),
        );
        let size = crate::Disagreement::new("task.image_size".into(), 32.into(), 1, 48.into());
        let error = TrainError::RanksDisagree {
            settings: vec![lr, hook, size],
        };
        assert_eq!(
            describe_error(&anyhow::Error::from(error)),
            "the ranks were started with different settings: rank 1 has --lr 0.1, rank 0 \
             0.001; rank 2 has --comm-hook bf16_compress, rank 0 fp16_compress; rank 1 has \
             task.image_size 48, rank 0 32: give every rank the same command"
        );
    }

    #[test]
    fn the_old_launcher_spelling_of_local_rank_is_accepted() {
        let cli = Cli::<GenericDefaults>::parse_from(["x", "--local_rank", "3"]);
        assert_eq!(cli.train.local_rank, Some(3));
        let cli = Cli::<GenericDefaults>::parse_from(["x", "--local-rank", "1"]);
        assert_eq!(cli.train.local_rank, Some(1));
        assert_eq!(cli.train.settings(), Settings::default());
    }

    #[test]
    fn nproc_per_node_is_the_launchers_and_changes_no_setting() {
        let with =
            Cli::<GenericDefaults>::parse_from(["x", "--epochs", "2", "--nproc-per-node", "2"]);
        let without = Cli::<GenericDefaults>::parse_from(["x", "--epochs", "2"]);
        assert_eq!(with.train.nproc_per_node, Some(NprocPerNode::Count(2)));
        assert_eq!(without.train.nproc_per_node, None);
        assert_eq!(with.train.settings(), without.train.settings());
        let gpu = Cli::<GenericDefaults>::parse_from(["x", "--nproc_per_node=gpu"]);
        assert_eq!(gpu.train.nproc_per_node, Some(NprocPerNode::Gpu));
        // The ranks get their local rank from the launcher, not from a flag.
        let both = Cli::<GenericDefaults>::try_parse_from([
            "x",
            "--nproc-per-node",
            "2",
            "--local-rank",
            "0",
        ]);
        assert_eq!(
            both.err().map(|e| e.kind()),
            Some(clap::error::ErrorKind::ArgumentConflict)
        );
    }

    /// A flag the other settings leave unused is refused, naming what it needs; the same
    /// flag where it is used parses.
    #[test]
    fn a_flag_the_other_settings_leave_unused_is_refused() {
        let refusal = |args: &[&str]| {
            let argv = std::iter::once("x").chain(args.iter().copied());
            let e = Cli::<GenericDefaults>::try_parse_from(argv)
                .err()
                .unwrap_or_else(|| panic!("{args:?} parsed"));
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
            e.to_string().lines().next().unwrap_or_default().to_string()
        };
        let cases: [(&[&str], &str); 6] = [
            (
                &["--momentum", "0.9"],
                "--momentum applies to --optimizer sgd only (it is adam)",
            ),
            (
                &["--lr-schedule", "plateau", "--warmup-steps", "5"],
                "--warmup-steps applies to the constant, linear, cosine and step schedules \
                 (--lr-schedule is plateau)",
            ),
            (
                &["--lr-gamma", "0.5"],
                "--lr-gamma applies to --lr-schedule step only (--lr-schedule is constant)",
            ),
            (
                &["--lr-schedule", "cosine", "--min-lr", "0.1"],
                "--min-lr applies to --lr-schedule plateau only (--lr-schedule is cosine)",
            ),
            (
                &["--plateau-patience", "3"],
                "--plateau-patience applies to --lr-schedule plateau only (--lr-schedule is \
                 constant)",
            ),
            (
                &["--early-stopping-min-delta", "0.01"],
                "--early-stopping-min-delta needs --early-stopping-patience (early stopping \
                 is off)",
            ),
        ];
        for (args, first_line) in cases {
            assert_eq!(refusal(args), format!("error: {first_line}"), "{args:?}");
        }
        // An evaluation reads none of training's own flags.
        for flag in [
            &["--epochs", "5"][..],
            &["--lr", "0.1"],
            &["--optimizer", "sgd"],
            &["--checkpoint-every", "3"],
            &["--time-limit", "10"],
            &["--freeze", "layer1"],
            &["--comm-hook", "fp16_compress"],
            &["--log-every", "1"],
        ] {
            let mut args = vec!["--resume", "f", "--eval-only"];
            args.extend(flag);
            assert_eq!(
                refusal(&args),
                format!(
                    "error: {} is a training flag, which --eval-only does not read",
                    flag[0]
                )
            );
        }
        // What evaluation reads, it takes.
        let eval = parse::<GenericDefaults>(&[
            "--resume",
            "f",
            "--eval-only",
            "--batch-size",
            "8",
            "--precision",
            "bf16",
            "--threads",
            "2",
            "--collective-timeout",
            "60",
            "--no-broadcast-buffers",
        ]);
        assert_eq!((eval.batch_size, eval.runtime.threads), (8, Some(2)));
        let used = parse::<GenericDefaults>(&[
            "--optimizer",
            "sgd",
            "--momentum",
            "0.9",
            "--lr-schedule",
            "step",
            "--lr-gamma",
            "0.5",
            "--warmup-steps",
            "2",
        ]);
        assert_eq!(used.lr_schedule.warmup(), 2);
        // Defaults a program sets are never "given": its plateau parses without flags.
        assert_eq!(
            parse::<Odirish>(&["--plateau-factor", "0.3"])
                .lr_schedule
                .kind(),
            crate::lr_schedule::ScheduleKind::Plateau
        );
    }
}
