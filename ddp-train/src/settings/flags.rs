//! The flags of the two settings that are enums with data, which clap cannot derive:
//! [`OptimizerConfig`] (`--optimizer`, `--lr`, `--weight-decay`, `--momentum`) and
//! [`LrSchedule`] (`--lr-schedule` and each kind's parameters). Each flag's id is its
//! setting's path (`optimizer.lr`), its default the value in the type's `Default` (or, for a
//! kind's parameters, in that kind's defaults).
//!
//! And [`parse_duration_secs`], `--time-limit`'s parser.
//!
//! Parsing updates a value: a parameter no flag sets (Adam's betas, the metric the plateau
//! scheduler watches) keeps the value it had when the kind is unchanged.

use clap::builder::EnumValueParser;
use clap::parser::ValueSource;
use clap::{value_parser, Arg, ArgMatches, Args, Command, FromArgMatches, ValueEnum};

use crate::lr_schedule::{LrSchedule, Plateau, ScheduleKind};
use crate::optim::{AdamConfig, OptimizerConfig, SgdConfig};
use crate::scheduler::PlateauConfig;

/// `--optimizer`: the kinds of [`OptimizerConfig`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OptimizerKind {
    /// torch.optim.Adam, weight decay as L2 in the gradient.
    Adam,
    /// torch.optim.AdamW, decoupled weight decay.
    Adamw,
    /// torch.optim.SGD with optional momentum.
    Sgd,
}

fn kind_of(config: &OptimizerConfig) -> OptimizerKind {
    match config {
        OptimizerConfig::Adam(_) => OptimizerKind::Adam,
        OptimizerConfig::AdamW(_) => OptimizerKind::Adamw,
        OptimizerConfig::Sgd(_) => OptimizerKind::Sgd,
    }
}

/// The name clap gives a value of a `ValueEnum`.
fn name<E: ValueEnum>(value: &E) -> String {
    value
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_string())
}

impl Args for OptimizerConfig {
    fn augment_args(cmd: Command) -> Command {
        let default = OptimizerConfig::default();
        let momentum = SgdConfig::default().momentum;
        cmd.arg(
            Arg::new("optimizer.kind")
                .long("optimizer")
                .value_name("OPTIMIZER")
                .value_parser(EnumValueParser::<OptimizerKind>::new())
                .default_value(name(&kind_of(&default)))
                .help(
                    "The optimizer: adam (torch.optim.Adam), adamw (decoupled weight decay) or \
                     sgd (with --momentum)",
                ),
        )
        .arg(
            Arg::new("optimizer.lr")
                .long("lr")
                .value_name("LR")
                .value_parser(value_parser!(f64))
                .default_value(default.lr().to_string())
                .help("Learning rate (the peak with --lr-schedule one-cycle)"),
        )
        .arg(
            Arg::new("optimizer.weight_decay")
                .long("weight-decay")
                .value_name("WEIGHT_DECAY")
                .value_parser(value_parser!(f64))
                .default_value(default.weight_decay().to_string())
                .help(
                    "Weight decay: L2 added to the gradient (adam, sgd), or decoupled (adamw; \
                     0.01 when --optimizer adamw is given without it, torch.optim.AdamW's \
                     default)",
                ),
        )
        .arg(
            Arg::new("optimizer.momentum")
                .long("momentum")
                .value_name("MOMENTUM")
                .value_parser(value_parser!(f64))
                .default_value(momentum.to_string())
                .help("SGD's momentum factor (0: plain SGD)"),
        )
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for OptimizerConfig {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut config = Self::default();
        config.update_from_arg_matches(matches)?;
        Ok(config)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        let number = |id: &str| matches.get_one::<f64>(id).copied();
        let kind = matches
            .get_one::<OptimizerKind>("optimizer.kind")
            .copied()
            .unwrap_or_else(|| kind_of(self));
        // Adam and AdamW share their hyper-parameters; a change to or from SGD starts from
        // the new kind's defaults.
        let adam = match *self {
            OptimizerConfig::Adam(c) | OptimizerConfig::AdamW(c) => c,
            OptimizerConfig::Sgd(_) => AdamConfig::default(),
        };
        *self = match kind {
            OptimizerKind::Adam => OptimizerConfig::Adam(adam),
            OptimizerKind::Adamw => OptimizerConfig::AdamW(adam),
            OptimizerKind::Sgd => OptimizerConfig::Sgd(match *self {
                OptimizerConfig::Sgd(c) => c,
                _ => SgdConfig::default(),
            }),
        };
        let on_command_line = |id: &str| {
            matches.ids().any(|i| i.as_str() == id)
                && matches.value_source(id) == Some(ValueSource::CommandLine)
        };
        // `--optimizer adamw` without `--weight-decay` is `torch.optim.AdamW(params)`, whose
        // weight decay is 0.01; a program whose own default is AdamW keeps its own.
        let adamw_by_flag = kind == OptimizerKind::Adamw
            && on_command_line("optimizer.kind")
            && !on_command_line("optimizer.weight_decay")
            && number("optimizer.weight_decay") == Some(AdamConfig::default().weight_decay);
        match self {
            OptimizerConfig::AdamW(c) if adamw_by_flag => {
                c.lr = number("optimizer.lr").unwrap_or(c.lr);
                c.weight_decay = AdamConfig::adamw().weight_decay;
            }
            OptimizerConfig::Adam(c) | OptimizerConfig::AdamW(c) => {
                c.lr = number("optimizer.lr").unwrap_or(c.lr);
                c.weight_decay = number("optimizer.weight_decay").unwrap_or(c.weight_decay);
            }
            OptimizerConfig::Sgd(c) => {
                c.lr = number("optimizer.lr").unwrap_or(c.lr);
                c.weight_decay = number("optimizer.weight_decay").unwrap_or(c.weight_decay);
                c.momentum = number("optimizer.momentum").unwrap_or(c.momentum);
            }
        }
        Ok(())
    }
}

impl Args for LrSchedule {
    fn augment_args(cmd: Command) -> Command {
        let default = LrSchedule::default();
        let step = LrSchedule::of_kind(ScheduleKind::Step);
        let (every, gamma) = match step {
            LrSchedule::Step { every, gamma, .. } => (every, gamma),
            _ => (1, 1.0),
        };
        let plateau = PlateauConfig::default();
        let number = |id: &'static str, long: &'static str, default: String| {
            Arg::new(id)
                .long(long)
                .value_parser(value_parser!(f64))
                .default_value(default)
        };
        let count = |id: &'static str, long: &'static str, default: String| {
            Arg::new(id)
                .long(long)
                .value_name("N")
                .value_parser(value_parser!(u64))
                .default_value(default)
        };
        cmd.arg(
            Arg::new("lr_schedule.kind")
                .long("lr-schedule")
                .value_name("LR_SCHEDULE")
                .value_parser(EnumValueParser::<ScheduleKind>::new())
                .default_value(name(&default.kind()))
                .help(
                    "How the learning rate changes: per optimizer step, constant, linear, \
                     cosine (each after --warmup-steps), step (times --lr-gamma every \
                     --lr-step-every steps), one-cycle (--lr is the peak); or plateau (per \
                     epoch, when the program's watched metric stalls)",
                ),
        )
        .arg(
            count(
                "lr_schedule.warmup",
                "warmup-steps",
                default.warmup().to_string(),
            )
            .help(
                "Optimizer steps of linear warmup from 0 (constant, linear, cosine, step \
                 schedules)",
            ),
        )
        .arg(
            count("lr_schedule.every", "lr-step-every", every.to_string())
                .help("Steps between decays of the step schedule"),
        )
        .arg(
            number("lr_schedule.gamma", "lr-gamma", gamma.to_string())
                .value_name("LR_GAMMA")
                .help("Factor of each decay of the step schedule"),
        )
        .arg(
            number(
                "lr_schedule.config.factor",
                "plateau-factor",
                plateau.factor.to_string(),
            )
            .value_name("PLATEAU_FACTOR")
            .help("ReduceLROnPlateau: factor applied to the learning rate"),
        )
        .arg(
            Arg::new("lr_schedule.config.patience")
                .long("plateau-patience")
                .value_name("PLATEAU_PATIENCE")
                .value_parser(value_parser!(u32))
                .default_value(plateau.patience.to_string())
                .help(
                    "ReduceLROnPlateau: epochs without improvement tolerated; the next one \
                     reduces the rate (PyTorch's patience)",
                ),
        )
        .arg(
            number(
                "lr_schedule.config.min_lr",
                "min-lr",
                plateau.min_lr.to_string(),
            )
            .value_name("MIN_LR")
            .help("ReduceLROnPlateau: the learning rate never goes below this"),
        )
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for LrSchedule {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut schedule = Self::default();
        schedule.update_from_arg_matches(matches)?;
        Ok(schedule)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        let steps = |id: &str| matches.get_one::<u64>(id).copied();
        let number = |id: &str| matches.get_one::<f64>(id).copied();
        let kind = matches
            .get_one::<ScheduleKind>("lr_schedule.kind")
            .copied()
            .unwrap_or_else(|| self.kind());
        if kind != self.kind() {
            *self = LrSchedule::of_kind(kind);
        }
        match self {
            LrSchedule::Constant { warmup }
            | LrSchedule::Linear { warmup }
            | LrSchedule::Cosine { warmup } => {
                *warmup = steps("lr_schedule.warmup").unwrap_or(*warmup);
            }
            LrSchedule::Step {
                warmup,
                every,
                gamma,
            } => {
                *warmup = steps("lr_schedule.warmup").unwrap_or(*warmup);
                *every = steps("lr_schedule.every").unwrap_or(*every);
                *gamma = number("lr_schedule.gamma").unwrap_or(*gamma);
            }
            LrSchedule::OneCycle { .. } => {}
            LrSchedule::Plateau(Plateau { config, .. }) => {
                config.factor = number("lr_schedule.config.factor").unwrap_or(config.factor);
                config.min_lr = number("lr_schedule.config.min_lr").unwrap_or(config.min_lr);
                config.patience = matches
                    .get_one::<u32>("lr_schedule.config.patience")
                    .copied()
                    .unwrap_or(config.patience);
            }
        }
        Ok(())
    }
}

/// Whole seconds of a duration (`--time-limit`): a number of seconds, or humantime's
/// notation, units after numbers (`90s`, `55m`, `4h`, `3h55m`, `1h 30m`); from 1 second to
/// 10^9 (about 31 years).
pub fn parse_duration_secs(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let secs = match text.parse::<u64>() {
        Ok(secs) => secs,
        Err(_) => humantime::parse_duration(text)
            .map_err(|e| {
                format!("'{text}': {e}; give seconds, or units after numbers (`55m`, `3h55m`)")
            })?
            .as_secs(),
    };
    if secs == 0 {
        return Err(format!("'{text}' must be at least 1 second"));
    }
    if secs > super::MAX_SECONDS {
        return Err(format!(
            "'{text}' must be at most {} seconds (about 31 years)",
            super::MAX_SECONDS
        ));
    }
    Ok(secs)
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
        assert_eq!(parse_duration_secs("3h55m"), Ok(14100));
        assert_eq!(parse_duration_secs(" 1h 30m "), Ok(5400));
        let unknown = parse_duration_secs("4x").unwrap_err();
        assert!(
            unknown.starts_with("'4x': unknown time unit \"x\""),
            "{unknown}"
        );
        assert!(unknown.ends_with("give seconds, or units after numbers (`55m`, `3h55m`)"));
        assert!(parse_duration_secs("m").unwrap_err().starts_with("'m': "));
        assert_eq!(
            parse_duration_secs("0s"),
            Err("'0s' must be at least 1 second".into())
        );
        // Under a second rounds down to nothing.
        assert!(parse_duration_secs("500ms").is_err());
        // At most ddp-comm's longest timeout, 10^9 s: a deadline always exists.
        assert_eq!(parse_duration_secs("1000000000"), Ok(1_000_000_000));
        for text in ["18446744073709551615", "1000000001", "100000000h"] {
            assert_eq!(
                parse_duration_secs(text),
                Err(format!(
                    "'{text}' must be at most 1000000000 seconds (about 31 years)"
                ))
            );
        }
    }
}
