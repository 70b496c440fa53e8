//! The Trainer's error type.

use std::error::Error as StdError;

use serde_json::Value;

/// Everything the Trainer can fail with.
///
/// Errors that say what a person must change (a setting, a path, a checkpoint of another
/// model) carry the whole sentence; the others wrap the failing layer's typed error, with
/// what the Trainer was doing as context where that helps (`source()` gives the cause).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A setting, or a combination of settings and data, that cannot work; the message
    /// names the setting and what to do.
    #[error("{0}")]
    Invalid(String),
    /// A [`Settings`](crate::Settings) value that cannot work, naming the setting by its
    /// field; a command line names it by its flag ([`SettingError::render`]).
    #[error(transparent)]
    Setting(#[from] SettingError),
    /// The ranks were started with different settings, task options or builds: refused at
    /// start, on every rank alike, naming each setting that differs from rank 0's with both
    /// values and the ranks (what each rank may set its own way is left out, such as
    /// [`RuntimeSettings`](crate::RuntimeSettings)).
    #[error("{}", render_disagreements(settings, &|setting| setting.to_string()))]
    RanksDisagree {
        /// Each setting that differs, in the order of the settings' description.
        settings: Vec<Disagreement>,
    },
    /// A step's loss became NaN or infinite on some ranks (without fp16's scaler, which
    /// skips such a step instead): every rank returns this error at that step, naming them.
    #[error(
        "the training loss became {} at epoch {epoch} step {step}; lower the learning rate \
         (--lr)",
        on_ranks(ranks)
    )]
    NonFiniteLoss {
        /// Each rank that saw one, in rank order, with its first non-finite loss of the step.
        ranks: Vec<(usize, f64)>,
        /// Epoch (from 1).
        epoch: u64,
        /// Optimizer step within the epoch (from 0).
        step: usize,
    },
    /// The run stopped on request (a stop signal or its time limit) after writing a
    /// checkpoint it can continue from; the process should exit with
    /// [`EXIT_STOPPED`](crate::EXIT_STOPPED) ([`TrainError::exit_code`]).
    #[error(
        "stopped by {reason} at epoch {epoch} step {step} with checkpoint {}; start again \
         with --out {} to continue from it",
        checkpoint.display(),
        run.display()
    )]
    Stopped {
        /// Why.
        reason: crate::stop::StopReason,
        /// The epoch in progress.
        epoch: u64,
        /// Its optimizer steps done.
        step: usize,
        /// The checkpoint's model file.
        checkpoint: std::path::PathBuf,
        /// The run directory.
        run: std::path::PathBuf,
    },
    /// [`Trainer::run`](crate::Trainer::run) called again on a Trainer whose run returned
    /// [`TrainError::Stopped`]: it trains no further, and refuses on every rank before it
    /// trains or writes anything, so that the stop's checkpoint stays the run's `latest`; a
    /// new Trainer on the run directory continues from it.
    #[error(
        "this Trainer's run stopped by {reason} at epoch {epoch} step {step} and trains no \
         further; start again with --out {} (a new Trainer) to continue from checkpoint {}",
        run.display(),
        checkpoint.display()
    )]
    RunAfterStop {
        /// Why the run stopped.
        reason: crate::stop::StopReason,
        /// The epoch it stopped in.
        epoch: u64,
        /// That epoch's optimizer steps done.
        step: usize,
        /// The stop's checkpoint (its model file).
        checkpoint: std::path::PathBuf,
        /// The run directory.
        run: std::path::PathBuf,
    },
    /// [`Trainer::run`](crate::Trainer::run) called again on a Trainer whose run failed once
    /// an epoch began: its model, optimizer and data position may hold part of that epoch,
    /// so it trains no further and refuses before it trains or writes anything; a new
    /// Trainer on the run directory continues from the run's latest checkpoint.
    #[error(
        "this Trainer's run failed in epoch {epoch} and trains no further (its model and \
         optimizer may hold part of that epoch); start again with --out {} (a new Trainer) to \
         continue from the run's latest checkpoint",
        run.display()
    )]
    RunAfterFailure {
        /// The epoch the run failed in.
        epoch: u64,
        /// The run directory.
        run: std::path::PathBuf,
    },
    /// [`Trainer::evaluate`](crate::Trainer::evaluate) stopped on request (a stop signal
    /// reached some rank) before the evaluation's end, on every rank: there is no training
    /// position to save, so nothing was; the process should exit with
    /// [`EXIT_STOPPED`](crate::EXIT_STOPPED) ([`TrainError::exit_code`]), as after a training
    /// run's stop, and evaluate again when started again.
    #[error(
        "evaluation stopped by {reason} before its end; nothing was saved: start again to evaluate"
    )]
    EvaluationStopped {
        /// Why.
        reason: crate::stop::StopReason,
    },
    /// The validation split's per-sample rows ([`Stats::rows`](crate::Stats::rows)) would
    /// gather to more bytes than the process group accepts: refused at the start of a run
    /// or an evaluation, on every rank alike, rather than after the first epoch.
    #[error(
        "evaluation would gather {samples} rows of {width} numbers, {bytes} bytes on every \
         rank, over the process group's limit of {limit} bytes: raise it on every rank with \
         Trainer::process_group().set_max_gather_bytes, or send fewer numbers per sample \
         (Stats::rows)"
    )]
    RowsTooLarge {
        /// The validation split's samples, a row each.
        samples: usize,
        /// Numbers per row.
        width: usize,
        /// What the rows would gather to ([`gather_rows`](crate::gather_rows)).
        bytes: u64,
        /// The limit ([`ddp_comm::ProcessGroup::max_gather_bytes`]).
        limit: u64,
    },
    /// The loader delivered fewer batches than the epoch's steps need.
    #[error("the loader ended before the epoch's last step")]
    LoaderEnded,
    /// [`GradScaler::unscale`](crate::GradScaler::unscale) called again before
    /// [`GradScaler::update`](crate::GradScaler::update): it would divide the gradients by the
    /// scale twice (PyTorch's "unscale_() has already been called on this optimizer since the
    /// last update()"). The gradients stay as the first call left them.
    #[error(
        "unscale has already been called on this GradScaler since the last update: call it \
         once per optimizer step, after sync_gradients, and update after the step"
    )]
    AlreadyUnscaled,
    /// What the Trainer was doing, and why it failed.
    #[error("{context}")]
    Context {
        /// What the Trainer was doing.
        context: String,
        /// Why it failed.
        #[source]
        source: Box<dyn StdError + Send + Sync + 'static>,
    },
    /// The process group failed (a peer died, a collective timed out, ...).
    #[error(transparent)]
    Comm(#[from] ddp_comm::CommError),
    /// The DDP layer failed (ranks disagree on the model, a parameter got no gradient, ...).
    #[error(transparent)]
    Ddp(#[from] crate::ddp::DdpError),
    /// A batch could not be loaded.
    #[error(transparent)]
    Data(#[from] ddp_data::DataError),
    /// A checkpoint could not be read or written, or does not fit the model.
    #[error(transparent)]
    Checkpoint(#[from] ddp_model::checkpoint::CheckpointError),
    /// The initial weights (`checkpoint.init_from`) could not be read or do not fit the
    /// model; the message names the file.
    #[error(transparent)]
    Weights(#[from] ddp_model::weights::WeightsError),
    /// libtorch failed.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
    /// A file of the run directory could not be read or written.
    #[error("{what}")]
    Io {
        /// The file and the operation.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl TrainError {
    /// `source` with `context` in front.
    pub fn context(
        context: impl Into<String>,
        source: impl Into<Box<dyn StdError + Send + Sync + 'static>>,
    ) -> Self {
        Self::Context {
            context: context.into(),
            source: source.into(),
        }
    }

    /// The exit code a program should end with: [`EXIT_STOPPED`](crate::EXIT_STOPPED) after a
    /// requested stop (the launcher then neither restarts nor reports a failure), else 1.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Stopped { .. } | Self::EvaluationStopped { .. } => crate::stop::EXIT_STOPPED,
            _ => 1,
        }
    }

    /// An I/O failure on `what`.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }
}

/// `err` and its causes, `message: cause: cause`, each said once ([`ddp_run::join_causes`]):
/// for where an error is kept as text (a warning, another error's message), since a message
/// says its own level only and leaves its cause to `source()`.
pub(crate) fn with_causes(err: &(dyn StdError + 'static)) -> String {
    let chain = std::iter::successors(Some(err), |&e| e.source());
    ddp_run::join_causes(chain.map(ToString::to_string))
}

/// `inf on rank 1`, `NaN on ranks 0, 2 and inf on rank 1`: the ranks of each value, in the
/// order of their first rank.
fn on_ranks(ranks: &[(usize, f64)]) -> String {
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (rank, value) in ranks {
        let value = value.to_string();
        match groups.iter_mut().find(|(v, _)| *v == value) {
            Some((_, rs)) => rs.push(*rank),
            None => groups.push((value, vec![*rank])),
        }
    }
    groups
        .iter()
        .map(|(value, rs)| format!("{value} on {}", rank_list(rs)))
        .collect::<Vec<_>>()
        .join(" and ")
}

/// `rank 1`, `ranks 0, 2`; with more than 8, the first 8 and the count: `12 ranks (0, 1,
/// 2, 3, 4, 5, 6, 7, ...)`.
fn rank_list(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().take(8).map(usize::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        2..=8 => format!("ranks {}", list.join(", ")),
        n => format!("{n} ranks ({}, ...)", list.join(", ")),
    }
}

/// A setting the ranks were started with different values of
/// ([`TrainError::RanksDisagree`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Disagreement {
    /// The setting: a [`Settings`](crate::Settings) path (`optimizer.lr`), `task.` and a
    /// key of [`Task::describe`](crate::Task::describe) (`task.image_size`), or `build.`
    /// and a part of the program's build (`build.libtorch`).
    pub setting: String,
    /// Rank 0's value (`null` where it has none).
    pub rank0: Value,
    /// Every other value, with the ranks that have it, in the order of their first rank.
    pub others: Vec<(Value, Vec<usize>)>,
}

impl Disagreement {
    /// Rank 0 has `rank0` for `setting`, `rank` has `value`.
    pub(crate) fn new(setting: String, rank0: Value, rank: usize, value: Value) -> Self {
        Self {
            setting,
            rank0,
            others: vec![(value, vec![rank])],
        }
    }

    /// `rank` has `value` too.
    pub(crate) fn add(&mut self, rank: usize, value: Value) {
        match self.others.iter_mut().find(|(v, _)| *v == value) {
            Some((_, ranks)) => ranks.push(rank),
            None => self.others.push((value, vec![rank])),
        }
    }
}

/// The message of [`TrainError::RanksDisagree`], with each setting named by `name` (its
/// path in `Display`, its flag on a command line): `the ranks were started with different
/// settings: rank 1 has --lr 0.1, rank 0 0.001: give every rank the same command`.
pub(crate) fn render_disagreements(
    found: &[Disagreement],
    name: &dyn Fn(&str) -> String,
) -> String {
    const SHOWN: usize = 8;
    let value = |v: &Value| match v {
        Value::Null => "none".to_string(),
        Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    let mut parts: Vec<String> = found
        .iter()
        .take(SHOWN)
        .map(|d| {
            let mut others = d.others.iter().map(|(v, ranks)| (value(v), ranks));
            let mut part = match others.next() {
                Some((v, ranks)) => {
                    let has = if ranks.len() == 1 { "has" } else { "have" };
                    format!("{} {has} {} {v}", rank_list(ranks), name(&d.setting))
                }
                None => name(&d.setting),
            };
            for (v, ranks) in others {
                part.push_str(&format!(", {} {v}", rank_list(ranks)));
            }
            format!("{part}, rank 0 {}", value(&d.rank0))
        })
        .collect();
    if found.len() > SHOWN {
        parts.push(format!("and {} more settings", found.len() - SHOWN));
    }
    let build = found.iter().any(|d| d.setting.starts_with("build."));
    format!(
        "the ranks were started with different settings: {}: give every rank the same \
         command{}",
        match parts.is_empty() {
            true => "their descriptions differ in form only".to_string(),
            false => parts.join("; "),
        },
        if build {
            " and the same build of the program"
        } else {
            ""
        }
    )
}

/// A setting that cannot work: a message that names one or more settings by their path in
/// [`Settings`](crate::Settings) (`batch_size`, `checkpoint.every`, `lr_schedule.config.factor`:
/// the field, dotted through groups, as the settings serialize). `Display` names them so; the
/// command line renders the same message with its flags (`--batch-size must be at least 1`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.render(|field| field.to_string()))]
pub struct SettingError {
    pieces: Vec<Piece>,
}

/// A piece of a [`SettingError`]'s message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Setting(&'static str),
}

impl SettingError {
    /// A message that begins with the setting `field`, then `text`:
    /// `SettingError::new("batch_size", " must be at least 1")`.
    pub fn new(field: &'static str, text: impl Into<String>) -> Self {
        Self { pieces: Vec::new() }.setting(field).text(text)
    }

    /// A message that begins with `text`; add the settings it names with
    /// [`SettingError::setting`].
    pub fn starting(text: impl Into<String>) -> Self {
        Self { pieces: Vec::new() }.text(text)
    }

    /// Appends another setting's name.
    #[must_use]
    pub fn setting(mut self, field: &'static str) -> Self {
        self.pieces.push(Piece::Setting(field));
        self
    }

    /// Appends text.
    #[must_use]
    pub fn text(mut self, text: impl Into<String>) -> Self {
        self.pieces.push(Piece::Text(text.into()));
        self
    }

    /// The first setting the message names: the one to change.
    pub fn field(&self) -> &'static str {
        self.fields().next().unwrap_or_default()
    }

    /// Every setting the message names, in order.
    pub fn fields(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Setting(field) => Some(*field),
            Piece::Text(_) => None,
        })
    }

    /// The message with each setting named by `name` (its field path in `Display`).
    pub fn render(&self, name: impl Fn(&'static str) -> String) -> String {
        self.pieces
            .iter()
            .map(|p| match p {
                Piece::Text(t) => t.clone(),
                Piece::Setting(field) => name(field),
            })
            .collect()
    }
}

/// Adds context to a result's error.
pub(crate) trait Context<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T, TrainError>;
}

impl<T, E: Into<Box<dyn StdError + Send + Sync + 'static>>> Context<T> for Result<T, E> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T, TrainError> {
        self.map_err(|e| TrainError::context(what(), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file error of a lower layer, kept as text, says its cause once: its message names
    /// the file, its source the OS error.
    #[test]
    fn an_error_kept_as_text_says_its_cause_once() {
        let missing = std::env::temp_dir().join("ddp-train-no-such-dir/absent.safetensors");
        let err = TrainError::from(ddp_model::checkpoint::read_tensors(&missing).unwrap_err());
        let cause = StdError::source(&err).expect("the OS error").to_string();
        assert!(cause.starts_with("No such file"), "{cause}");
        assert_eq!(
            err.to_string(),
            format!("checkpoint '{}'", missing.display())
        );
        let text = with_causes(&err);
        assert_eq!(text, format!("checkpoint '{}': {cause}", missing.display()));
        assert_eq!(text.matches(&cause).count(), 1, "{text}");
    }

    #[test]
    fn a_non_finite_loss_names_the_ranks_of_each_value() {
        let message = |ranks: Vec<(usize, f64)>| {
            TrainError::NonFiniteLoss {
                ranks,
                epoch: 2,
                step: 5,
            }
            .to_string()
        };
        assert_eq!(
            message(vec![(1, f64::INFINITY)]),
            "the training loss became inf on rank 1 at epoch 2 step 5; lower the learning \
             rate (--lr)"
        );
        assert_eq!(
            message(vec![(0, f64::NAN), (1, f64::NEG_INFINITY), (3, f64::NAN)]),
            "the training loss became NaN on ranks 0, 3 and -inf on rank 1 at epoch 2 step 5; \
             lower the learning rate (--lr)"
        );
        assert_eq!(
            message((0..12).map(|r| (r, f64::NAN)).collect()),
            "the training loss became NaN on 12 ranks (0, 1, 2, 3, 4, 5, 6, 7, ...) at epoch 2 \
             step 5; lower the learning rate (--lr)"
        );
    }
}
