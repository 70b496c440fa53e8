//! [`DdpError`], and the parts of its messages that take more than a format string.

use ddp_comm::CommError;

#[cfg(doc)]
use super::{DdpOptions, DistributedDataParallel};

/// Why a DDP operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DdpError {
    /// A collective failed (a peer died, a timeout, ...).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Rank `rank`'s model differs from rank 0's.
    #[error("rank {rank}'s model differs from rank 0's at tensor {detail}")]
    ModelMismatch {
        /// The rank whose model differs.
        rank: usize,
        /// The first differing tensor and both descriptions.
        detail: String,
    },
    /// Rank `rank`'s tensors are on another type of device than rank 0's (the CPU where
    /// rank 0 has CUDA, say): every collective would then meet a different one.
    #[error(
        "rank {rank}'s model is on {theirs}, rank 0's on {reference}: every rank must train on \
         the same type of device; give every rank the same --device (--device cuda fails \
         where CUDA is missing instead of training on the CPU)"
    )]
    DeviceMismatch {
        /// The rank whose devices differ.
        rank: usize,
        /// Its device types (`cpu`, `cuda`, ...).
        theirs: String,
        /// Rank 0's.
        reference: String,
    },
    /// Parameters got no gradient on some rank in this step, and
    /// [`DdpOptions::find_unused_parameters`] is off. Every rank reports the same list. A
    /// parameter that an undefined gradient reached counts as without gradient here, unlike
    /// in PyTorch (see that option).
    #[error(
        "rank {rank}: parameters received no gradient on some of the {world_size} ranks in \
         this step: {}; if parts of the model are skipped on purpose (branches, several \
         heads), turn on find_unused_parameters (DdpOptions::find_unused_parameters, \
         --find-unused-parameters), otherwise freeze those parameters or use them in the loss",
        describe_unused(.parameters)
    )]
    UnusedParameters {
        /// This rank.
        rank: usize,
        /// The number of ranks.
        world_size: usize,
        /// Each parameter that some rank did not use, with the number of ranks that used it.
        parameters: Vec<(String, usize)>,
    },
    /// [`DistributedDataParallel::sync_gradients`] followed backward passes with gradient sync
    /// off only (in [`DistributedDataParallel::no_sync`]), and some rank used a parameter in
    /// none with it on, without [`DdpOptions::find_unused_parameters`]. Returned on such a
    /// rank instead of [`DdpError::UnusedParameters`], which a rank that ran a synced backward
    /// reports.
    #[error(
        "rank {rank}: sync_gradients followed backward passes with gradient sync off only \
         (parameter '{parameter}' got a gradient in one, none with sync on): run the last \
         micro-batch's backward with gradient sync on (outside no_sync, or after \
         set_require_gradient_sync(true)), then call sync_gradients once, after it"
    )]
    NoSyncedBackward {
        /// This rank.
        rank: usize,
        /// A parameter that got a gradient with gradient sync off.
        parameter: String,
    },
    /// [`DistributedDataParallel::sync_gradients`] on a rank where no backward pass reached a
    /// parameter since the last call (or since [`DistributedDataParallel::new`]): a second
    /// call for one backward ([`DistributedDataParallel::backward`] makes the first), or a
    /// backward of a loss that depends on none of the model's parameters, without
    /// [`DdpOptions::find_unused_parameters`]. Returned on such a rank instead of
    /// [`DdpError::UnusedParameters`], which the ranks that ran a backward report, after the
    /// same collectives.
    #[error(
        "rank {rank}: sync_gradients found no gradient of a backward pass since the last \
         sync_gradients: call it once after each backward with gradient sync on \
         (DistributedDataParallel::backward calls it itself), of a loss computed from the \
         model's parameters; a rank with no batch to train on calls it without a backward only \
         with find_unused_parameters"
    )]
    SyncWithoutBackward {
        /// This rank.
        rank: usize,
    },
    /// A parameter's gradient was accumulated on some rank though
    /// [`DistributedDataParallel::prepare_for_backward`] had found it unreachable from the
    /// loss (PyTorch's "Expected to mark a variable ready only once"), or twice before
    /// `sync_gradients`, the first time with gradient sync on (that rank reports
    /// [`DdpError::SyncMissed`]). Every rank reports it, after the same collectives.
    #[error("{}", describe_twice(*.rank, .parameter.as_deref(), .ranks))]
    GradientTwice {
        /// This rank.
        rank: usize,
        /// The (first) parameter, when this rank is one of `ranks`.
        parameter: Option<String>,
        /// The ranks on which a parameter got a gradient twice.
        ranks: Vec<usize>,
    },
    /// A backward pass with gradient sync on ran, and the DDP call that followed was not
    /// [`DistributedDataParallel::sync_gradients`]: its gradients were never averaged (tch's
    /// `Optimizer::backward_step`). Returned by the next `broadcast_buffers`,
    /// `prepare_for_backward`, `backward` or `rebuild`, which then starts the step afresh.
    /// A second backward, with gradient sync on or off, fails with its message (`f_backward`
    /// returns it, tch's `backward_step` panics with it), and the `sync_gradients` after that
    /// returns it.
    /// After a failed backward, [`DistributedDataParallel::abandon_step`] prevents it.
    #[error(
        "rank {rank}: a backward pass with gradient sync on reached parameter \
         '{parameter}' and no sync_gradients followed it: {}",
        SYNC_MISSED_HINT
    )]
    SyncMissed {
        /// This rank.
        rank: usize,
        /// A parameter that backward reached.
        parameter: String,
    },
    /// The store changed on some rank after [`DistributedDataParallel::new`] or the last
    /// [`DistributedDataParallel::rebuild`] wrapped it: a variable was added (a new head), or
    /// a parameter wrapped frozen was unfrozen. DDP neither broadcasts nor averages what it
    /// did not wrap, while tch's optimizer steps it all the same. (A wrapped parameter frozen
    /// since is only unused, as in PyTorch: see [`DdpOptions::find_unused_parameters`].)
    /// Returned by `sync_gradients` on every rank, after the same collectives; a new buffer
    /// counts with [`DdpOptions::broadcast_buffers`] only.
    #[error("{}", describe_changed(*.rank, .change.as_ref(), .ranks))]
    ModelChanged {
        /// This rank.
        rank: usize,
        /// This rank's change, when it is one of `ranks`: the variable, by its name in the
        /// store, and `added to the store` or `unfrozen`.
        change: Option<(String, &'static str)>,
        /// The ranks whose store changed.
        ranks: Vec<usize>,
    },
    /// A parameter already has a post-accumulate-grad hook, which DDP would replace.
    #[error(
        "parameter '{0}' already has a post-accumulate-grad hook: another \
         DistributedDataParallel over these parameters is still alive (drop it before building \
         a new one, or wrap the store again with its rebuild), or the hook is your own (DDP \
         needs each parameter's only hook)"
    )]
    AlreadyHooked(String),
    /// No parameter of the model requires a gradient (PyTorch's "DistributedDataParallel is
    /// not needed when a module doesn't have any parameter that requires a gradient").
    #[error(
        "the model has no parameter that requires a gradient ({frozen} frozen): \
         DistributedDataParallel has no gradient to average; unfreeze some parameters, or \
         run the model without it"
    )]
    NothingToTrain {
        /// The frozen parameters (created trainable, `requires_grad` off).
        frozen: usize,
    },
    /// The C++ shim failed (setting a hook or a gradient).
    #[error(transparent)]
    Shim(#[from] tch_ext::TchExtError),
    /// libtorch failed.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
}

/// What to do instead of a backward pass with gradient sync on that no `sync_gradients`
/// follows (the end of [`DdpError::SyncMissed`]'s message).
pub(super) const SYNC_MISSED_HINT: &str = "each rank trains a replica of its own; call \
    sync_gradients after every backward with gradient sync on, before the optimizer step, or \
    DistributedDataParallel::backward(&loss), which runs both (tch's Optimizer::backward_step \
    cannot be used with DDP: zero_grad, DistributedDataParallel::backward, then step); \
    accumulate micro-batches with gradient sync off (DistributedDataParallel::no_sync); a \
    reentrant backward, which gives a parameter a second gradient within one backward, is \
    refused so too, as PyTorch's DDP refuses it without static_graph";

/// [`DdpError::GradientTwice`]'s message.
fn describe_twice(rank: usize, parameter: Option<&str>, ranks: &[usize]) -> String {
    let what = match parameter {
        Some(name) => format!("parameter '{name}' received a gradient twice"),
        None => {
            let ranks: Vec<String> = ranks.iter().map(usize::to_string).collect();
            format!(
                "a parameter received a gradient twice on rank {} (its error names it)",
                ranks.join(", ")
            )
        }
    };
    format!(
        "rank {rank}: {what} before sync_gradients, or once after prepare_for_backward found it \
         unreachable from the loss: when accumulating gradients, run every backward but the last \
         micro-batch's with gradient sync off (DistributedDataParallel::no_sync or \
         set_require_gradient_sync(false)), and give prepare_for_backward the tensor that \
         backward runs from"
    )
}

/// [`DdpError::ModelChanged`]'s message.
fn describe_changed(rank: usize, change: Option<&(String, &str)>, ranks: &[usize]) -> String {
    let what = match change {
        Some((variable, change)) => format!("variable '{variable}' was {change}"),
        None => {
            let ranks: Vec<String> = ranks.iter().map(usize::to_string).collect();
            format!(
                "the store changed on rank {} (its error names the variable)",
                ranks.join(", ")
            )
        }
    };
    format!(
        "rank {rank}: {what} after DistributedDataParallel wrapped the store: DDP hooks, buckets \
         and broadcasts only what it wrapped, so the ranks' replicas would drift apart; call \
         DistributedDataParallel::rebuild(&vs) on every rank after adding or unfreezing \
         parameters"
    )
}

/// The parameters of [`DdpError::UnusedParameters`]' message.
fn describe_unused(parameters: &[(String, usize)]) -> String {
    parameters
        .iter()
        .map(|(name, used)| match used {
            0 => format!("{name} (used by no rank)"),
            n => format!("{name} (used by {n})"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}
