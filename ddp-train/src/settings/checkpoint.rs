//! [`CheckpointSettings`]: when to checkpoint, how many to keep, and what to start from.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::Settings;

/// When to checkpoint, how many to keep, and what to start from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(default)]
#[non_exhaustive]
pub struct CheckpointSettings {
    /// A checkpoint to start from: `latest` (the newest of the run directory,
    /// [`Settings::out`]), another run's directory (its newest), or a checkpoint file
    /// (`.../checkpoints/epoch-0003.safetensors` or its `.state.safetensors`, or a step
    /// checkpoint inside an epoch, `epoch-0004-step-000120.safetensors`).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "checkpoint.resume",
            long = "resume",
            value_name = "RESUME",
            help = "Resume from a checkpoint: `latest` (the newest in --out), a run directory \
                    (its newest), or a checkpoint file (`.../checkpoints/epoch-0003.safetensors`, \
                    or a step checkpoint inside an epoch, `epoch-0004-step-000120.safetensors`)"
        )
    )]
    pub resume: Option<String>,
    /// Load only the model weights from `resume` (for [`crate::Trainer::evaluate`]; no
    /// optimizer state is needed).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "checkpoint.eval_only",
            long = "eval-only",
            requires = "checkpoint.resume",
            help = "Only evaluate the model file given by --resume on the validation split \
                    (exact distributed evaluation) and print the metrics as JSON; no training"
        )
    )]
    pub eval_only: bool,
    /// When a start continues the run in `out` (a launcher's restart,
    /// `TORCHELASTIC_RESTART_COUNT` > 0, of the job that wrote the run, or of a job without a
    /// run id; a new start of a run that was stopped; the same job, by its run id), resume
    /// from the run's latest checkpoint, also over a `resume` that names where the run began
    /// (never with `eval_only`). Off, such a start into a run with checkpoints is refused
    /// rather than started over.
    #[cfg_attr(
        feature = "cli",
        arg(skip = CheckpointSettings::default().resume_after_restart)
    )]
    pub resume_after_restart: bool,
    /// Also checkpoint inside epochs, every this many optimizer steps (counted over the run,
    /// steps the fp16 scaler skips included).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "checkpoint.every",
            long = "checkpoint-every",
            value_name = "N",
            help = "Also checkpoint inside epochs, every N optimizer steps (a crash then loses \
                    at most N steps; a restart continues from the newest checkpoint)"
        )
    )]
    pub every: Option<u64>,
    /// Also checkpoint inside epochs when this many minutes have passed since the last
    /// checkpoint (or the start).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "checkpoint.minutes",
            long = "checkpoint-minutes",
            value_name = "M",
            help = "Also checkpoint inside epochs once M minutes have passed since the last \
                    checkpoint"
        )
    )]
    pub minutes: Option<f64>,
    /// Initial weights for the model: a PyTorch `torch.save` state_dict (`.pth`, `.pt`,
    /// `.bin`; DDP's `module.` and `torch.compile`'s `_orig_mod.` prefixes are stripped), a
    /// training checkpoint holding one (`{"epoch": 3, "model": state_dict, ...}`: see
    /// `init_key`), or a safetensors file,
    /// read with [`ddp_model::weights`]. Every rank loads it right after building the model, before
    /// DDP's broadcast; a resume (`resume`, or a restart that continues the run) takes
    /// precedence, and the file is then not read.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "checkpoint.init_from",
            long = "init-from",
            value_name = "FILE",
            help = "Start from these weights: a PyTorch torch.save state_dict (.pth, .pt, .bin; \
                    DDP's `module.` and torch.compile's `_orig_mod.` prefixes are stripped), a \
                    training checkpoint's state_dict \
                    entry (see --init-key), or a safetensors file. Every name and shape must \
                    match the model (see --init-partial). Ignored, with a note in the log, \
                    when the run resumes from a checkpoint"
        )
    )]
    pub init_from: Option<PathBuf>,
    /// The entry of `init_from` that holds the state_dict, when the file is a dict of
    /// several (`checkpoint["ema"]` of `{"model": ..., "ema": ..., "epoch": 3}`). Without
    /// it, a file that is not a state_dict itself is read from its one entry that is.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "checkpoint.init_key",
            long = "init-key",
            value_name = "KEY",
            requires = "checkpoint.init_from",
            help = "The entry of --init-from's dict that holds the state_dict (checkpoint[KEY] \
                    in PyTorch), for a file with several; a training checkpoint with one \
                    (e.g. {\"epoch\": 3, \"model\": ...}) is read without it"
        )
    )]
    pub init_key: Option<String>,
    /// Load from `init_from` only the tensors whose name and shape match the model (a new
    /// classification head keeps its initialisation, or gets the one
    /// [`Task::init_unloaded`](crate::Task::init_unloaded) gives); rank 0 logs the rest.
    /// Without it, any missing, unexpected or mis-shaped tensor is an error that lists them
    /// all.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "checkpoint.init_partial",
            long = "init-partial",
            requires = "checkpoint.init_from",
            help = "Load from --init-from only what matches the model by name and shape (e.g. \
                    a backbone with another head) and log what was left"
        )
    )]
    pub init_partial: bool,
    /// Step checkpoints kept (the newest); epoch-end checkpoints and best models are all kept.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "checkpoint.keep",
            long = "keep-checkpoints",
            value_name = "K",
            default_value_t = CheckpointSettings::default().keep,
            help = "Step checkpoints to keep (the newest); epoch-end checkpoints and best \
                    models stay"
        )
    )]
    pub keep: usize,
}

impl Default for CheckpointSettings {
    fn default() -> Self {
        Self {
            resume: None,
            eval_only: false,
            resume_after_restart: true,
            every: None,
            minutes: None,
            init_from: None,
            init_key: None,
            init_partial: false,
            keep: 2,
        }
    }
}

builder!(CheckpointSettings {
    resume: Option<String>,
    eval_only: bool,
    resume_after_restart: bool,
    every: Option<u64>,
    minutes: Option<f64>,
    init_from: Option<PathBuf>,
    init_key: Option<String>,
    init_partial: bool,
    keep: usize,
});
