//! Communication hooks: how a bucket of gradients is averaged over the ranks (PyTorch's
//! `DistributedDataParallel.register_comm_hook`).
//!
//! A hook receives a [`GradBucket`] as soon as the bucket is complete (during backward, when
//! DDP overlaps) and starts its communication; the [`HookWork`] it returns is waited for
//! before the optimizer step, and after that the bucket's buffer must hold the average of the
//! ranks' gradients. The built-ins ([`BuiltinHook`]) are PyTorch's `allreduce_hook`,
//! `bf16_compress_hook` and `fp16_compress_hook`.

use std::str::FromStr;
use std::sync::Arc;

use ddp_comm::{CommError, ProcessGroup, ReduceOp, Work};
use tch::{Kind, Tensor};

/// A bucket of gradients handed to a [`CommHook`].
#[derive(Debug)]
pub struct GradBucket<'a> {
    pub(crate) index: usize,
    pub(crate) count: usize,
    pub(crate) buffer: &'a Tensor,
    pub(crate) names: Vec<&'a str>,
}

impl GradBucket<'_> {
    /// The bucket's position in reduction order (0 first).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether this is the last bucket of the step.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// The flat buffer: the bucket's gradients end to end. The hook may compute from it and
    /// must leave the average in it by the time its [`HookWork`] has been waited for.
    pub fn buffer(&self) -> &Tensor {
        self.buffer
    }

    /// The names of the parameters whose gradients the buffer holds, in buffer order.
    pub fn parameter_names(&self) -> &[&str] {
        &self.names
    }
}

/// A hook's communication in flight: a collective's [`Work`] and what to do once it has
/// completed (e.g. decompress into the bucket).
#[must_use = "the bucket holds the average only after `wait`"]
pub struct HookWork {
    work: Work,
    then: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for HookWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookWork")
            .field("work", &self.work)
            .field("then", &self.then.is_some())
            .finish()
    }
}

impl HookWork {
    /// The work of a collective that leaves the average in the bucket itself.
    pub fn new(work: Work) -> Self {
        HookWork { work, then: None }
    }

    /// Runs `f` after the collective has completed, before the average is used.
    pub fn then(mut self, f: impl FnOnce() + Send + 'static) -> Self {
        self.then = Some(Box::new(f));
        self
    }

    /// Waits for the collective, then runs the follow-up. For a CUDA bucket the wait is on
    /// the device, as in PyTorch's DDP: the calling thread's current stream waits for the
    /// collective ([`Work::wait_stream`]) and the host goes on; the follow-up's kernels and
    /// every later reader of the gradients on that stream come after the result. An error of
    /// the collective is then reported by the process group's next call.
    pub fn wait(self) -> Result<(), CommError> {
        self.work.wait_stream()?;
        if let Some(f) = self.then {
            tch::no_grad(f);
        }
        Ok(())
    }
}

/// How a bucket is averaged over the ranks. Runs on the thread that runs backward (or
/// autograd's device thread), so it must be `Send + Sync`; it must issue the same collectives
/// on every rank.
pub trait CommHook: Send + Sync + std::fmt::Debug {
    /// Starts averaging `bucket`'s buffer over `pg`'s ranks.
    fn start(&self, pg: &Arc<ProcessGroup>, bucket: &GradBucket<'_>) -> HookWork;
}

/// The built-in hooks.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum BuiltinHook {
    /// All-reduce the bucket with `Avg` (the default; PyTorch's `allreduce_hook`).
    #[default]
    Allreduce,
    /// Cast the bucket to bfloat16, divide by the world size, all-reduce (sum), copy back
    /// (PyTorch's `bf16_compress_hook`): half the bytes, bfloat16's precision.
    Bf16Compress,
    /// The same in IEEE half (PyTorch's `fp16_compress_hook`).
    Fp16Compress,
}

impl BuiltinHook {
    /// The name used by `--comm-hook` and in `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            BuiltinHook::Allreduce => "allreduce",
            BuiltinHook::Bf16Compress => "bf16_compress",
            BuiltinHook::Fp16Compress => "fp16_compress",
        }
    }
}

impl std::fmt::Display for BuiltinHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BuiltinHook {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            BuiltinHook::Allreduce,
            BuiltinHook::Bf16Compress,
            BuiltinHook::Fp16Compress,
        ]
        .into_iter()
        .find(|h| h.name() == s.replace('-', "_"))
        .ok_or_else(|| {
            format!("unknown communication hook '{s}': expected allreduce, bf16_compress or fp16_compress")
        })
    }
}

impl CommHook for BuiltinHook {
    fn start(&self, pg: &Arc<ProcessGroup>, bucket: &GradBucket<'_>) -> HookWork {
        let kind = match self {
            BuiltinHook::Allreduce => {
                return HookWork::new(pg.all_reduce_async(bucket.buffer(), ReduceOp::Avg))
            }
            BuiltinHook::Bf16Compress => Kind::BFloat16,
            BuiltinHook::Fp16Compress => Kind::Half,
        };
        let world = pg.world_size() as f64;
        let compressed = tch::no_grad(|| {
            let mut c = bucket.buffer().to_kind(kind);
            let _ = c.g_div_scalar_(world);
            c
        });
        let work = pg.all_reduce_async(&compressed, ReduceOp::Sum);
        let mut target = bucket.buffer().shallow_clone();
        HookWork::new(work).then(move || {
            target.copy_(&compressed);
        })
    }
}
