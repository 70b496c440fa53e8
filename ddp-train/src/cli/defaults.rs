//! A program's own defaults for the training flags ([`Defaults`]), and how they reach the
//! flags: each flag's id is its setting's path in the serialized [`Settings`]
//! (`batch_size`, `checkpoint.every`, `optimizer.lr`), so the program's settings, serialized,
//! give every flag its default, and an error naming a setting names the flag.

use std::collections::{BTreeMap, BTreeSet};

use clap::builder::{BoolValueParser, TypedValueParser};
use clap::{Arg, ArgAction, Args, Command};
use serde_json::Value;

use crate::settings::Settings;

/// A program's defaults for the training flags: the settings a command line without flags
/// stands for. One line each, with the settings' builder:
///
/// ```
/// use ddp_train::cli::Defaults;
/// use ddp_train::lr_schedule::{LrSchedule, Plateau};
/// use ddp_train::Settings;
///
/// struct MyDefaults;
///
/// impl Defaults for MyDefaults {
///     fn settings() -> Settings {
///         Settings::default()
///             .epochs(30)
///             .lr_schedule(LrSchedule::Plateau(Plateau::max("val_accuracy")))
///     }
/// }
/// ```
///
/// `TrainArgs<MyDefaults>` then shows these in `--help` (`--epochs <EPOCHS> [default: 30]`,
/// `--lr-schedule <LR_SCHEDULE> [default: plateau]`) and parses into them. Settings without a
/// flag (best-model files, the metric the plateau scheduler or early stopping watches) are
/// kept as given here.
pub trait Defaults {
    /// The settings of a command line without flags.
    fn settings() -> Settings;
}

/// `Settings::default()`: the generic defaults.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenericDefaults;

impl Defaults for GenericDefaults {
    fn settings() -> Settings {
        Settings::default()
    }
}

/// The leaves of `value` by their dotted path (`checkpoint.every`).
pub(super) fn leaves(value: &Value, path: &str, out: &mut BTreeMap<String, Value>) {
    match value {
        Value::Object(fields) => {
            for (key, v) in fields {
                let inner = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                leaves(v, &inner, out);
            }
        }
        leaf => {
            out.insert(path.to_string(), leaf.clone());
        }
    }
}

/// Gives each argument of `added` (ids that are setting paths) the default that `defaults`
/// holds for its setting. A flag whose setting `defaults` leaves out (SGD's momentum when the
/// default optimizer is Adam) keeps the setting type's default.
pub(super) fn install(mut cmd: Command, added: &BTreeSet<String>, defaults: &Settings) -> Command {
    let mut values = BTreeMap::new();
    if let Ok(json) = serde_json::to_value(defaults) {
        leaves(&json, "", &mut values);
    }
    for id in added {
        if let Some(value) = values.get(id) {
            cmd = cmd.mut_arg(id, |arg| with_default(arg, value));
        }
    }
    cmd
}

/// `arg` with `value` (a leaf of the serialized settings) as its default.
fn with_default(arg: Arg, value: &Value) -> Arg {
    match value {
        Value::Null => arg.default_value(None::<&'static str>),
        Value::Bool(on) => {
            // A switch (`--find-unused-parameters`, `--no-overlap`) can only move its setting
            // one way; when the program's default already is on that side the switch takes a
            // value instead (`--find-unused-parameters=false`), on by default.
            let sets = match arg.get_action() {
                ArgAction::SetTrue => Some(true),
                ArgAction::SetFalse => Some(false),
                _ => None,
            };
            match sets {
                Some(sets) if sets == *on => arg
                    .action(ArgAction::Set)
                    .num_args(0..=1)
                    .require_equals(true)
                    .value_name("BOOL")
                    .value_parser(BoolValueParser::new().map(move |given| given == sets))
                    .default_missing_value("true")
                    .default_value("true"),
                _ => arg.default_value(on.to_string()),
            }
        }
        Value::Number(n) => {
            let text = match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => u.to_string(),
                (None, Some(i), _) => i.to_string(),
                // Rust's formatting, as clap's own `default_value_t` writes floats.
                (None, None, Some(f)) => f.to_string(),
                (None, None, None) => n.to_string(),
            };
            arg.default_value(text)
        }
        Value::String(text) => arg.default_value(text.clone()),
        Value::Array(_) | Value::Object(_) => arg,
    }
}

/// Each setting's flag (`--batch-size`) by its path (`batch_size`).
pub(super) fn flag_names() -> BTreeMap<String, String> {
    Settings::augment_args(Command::new("flags"))
        .get_arguments()
        .filter_map(|a| Some((a.get_id().to_string(), format!("--{}", a.get_long()?))))
        .collect()
}
