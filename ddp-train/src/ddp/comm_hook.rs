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
    pub(crate) scaled: bool,
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

    /// Whether the buffer holds the gradients times `1/world size` already (the hook asked
    /// for it: [`CommHook::scaled_on_copy`]), so that their sum over the ranks is the
    /// average.
    pub fn is_scaled(&self) -> bool {
        self.scaled
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

    /// Whether DDP should scale each gradient by `1/world size` as it copies it into its
    /// bucket ([`GradBucket::is_scaled`]): one pass over the gradients instead of a copy and
    /// a scaling, what PyTorch's reducer does when no hook is registered. `false` by
    /// default: the buffer holds the rank's own gradients.
    fn scaled_on_copy(&self) -> bool {
        false
    }
}

/// The built-in hooks.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum BuiltinHook {
    /// Each gradient times `1/world size` (as DDP copies it into the bucket:
    /// [`CommHook::scaled_on_copy`]), then all-reduced (sum): the default, what PyTorch's
    /// reducer does without a hook. Scaled first, fp16 gradients whose average fits do not
    /// overflow in their sum, and the rounding is PyTorch's.
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
    /// Only the plain all-reduce: the compressing hooks divide their compressed copy.
    fn scaled_on_copy(&self) -> bool {
        *self == BuiltinHook::Allreduce
    }

    fn start(&self, pg: &Arc<ProcessGroup>, bucket: &GradBucket<'_>) -> HookWork {
        let world = pg.world_size() as f64;
        let kind = match self {
            BuiltinHook::Allreduce => {
                if !bucket.is_scaled() {
                    // In place, on the stream where the hook runs, before the collective's
                    // ready event (a hook of a user's that calls this one).
                    let mut buffer = bucket.buffer().shallow_clone();
                    // `allreduce_hook`'s `tensor.div_(world_size)`.
                    tch::no_grad(|| {
                        let _ = buffer.g_div_scalar_(world);
                    });
                }
                return HookWork::new(pg.all_reduce_async(bucket.buffer(), ReduceOp::Sum));
            }
            BuiltinHook::Bf16Compress => Kind::BFloat16,
            BuiltinHook::Fp16Compress => Kind::Half,
        };
        let compressed = tch::no_grad(|| {
            let mut c = bucket.buffer().to_kind(kind);
            if !bucket.is_scaled() {
                let _ = c.g_div_scalar_(world);
            }
            c
        });
        let work = pg.all_reduce_async(&compressed, ReduceOp::Sum);
        let mut target = bucket.buffer().shallow_clone();
        HookWork::new(work).then(move || {
            target.copy_(&compressed);
            // `compressed` was allocated on the stream current where the hook ran (autograd's,
            // the forward's) and is read here on this thread's current stream: recorded, the
            // caching allocator keeps its memory from the allocating stream's next tensors
            // until this copy has run.
            if let Err(e) = tch_ext::record_current_stream(&compressed) {
                tracing::warn!("ddp: a compressed bucket was released without its stream: {e}");
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::gpu_tests::{gpu, keep_busy, settle, two_streams};
    use super::*;
    use tch::Device;
    use tch_ext::{set_current_stream, CudaEvent};

    /// A compress hook casts the bucket on the stream where the hook runs (the forward's:
    /// pool stream A here) and copies the result back on the syncing thread's stream (B,
    /// behind half a second of work). The compressed copy is freed while that copy is still
    /// queued on B; a tensor of its size and dtype allocated on A next and filled at once (A
    /// is idle) must not get its memory. Without `record_stream`, libtorch's caching
    /// allocator hands the block straight back on A, the fill lands before B's copy reads
    /// it, and the bucket ends up holding the fill instead of its average.
    #[test]
    fn a_compress_hook_keeps_its_copy_until_the_syncing_stream_has_read_it() {
        if !gpu() {
            return;
        }
        let device = Device::Cuda(0);
        let opts = ddp_comm::Options::new(0, 1, "127.0.0.1", 0).backend(ddp_comm::Backend::Nccl);
        let pg = Arc::new(ProcessGroup::new(opts).unwrap());
        let (a, b) = two_streams();
        // An odd size, so that no other free block fits it exactly.
        let len = 1_000_003;
        let buffer = Tensor::full([len], 3.0, (Kind::Float, device));
        let on_a = set_current_stream(a).unwrap();
        let bucket = GradBucket {
            index: 0,
            count: 1,
            scaled: false,
            buffer: &buffer,
            names: vec!["w"],
        };
        let work = BuiltinHook::Fp16Compress.start(&pg, &bucket);
        drop(on_a);
        let on_b = set_current_stream(b).unwrap();
        keep_busy(0.5);
        work.wait().unwrap();
        let b_done = CudaEvent::new(0).unwrap();
        b_done.record(&b).unwrap();
        drop(on_b);
        let on_a = set_current_stream(a).unwrap();
        // A blocking collective from A (idle): the hook's one has completed by its end, and
        // the group has let go of the compressed copy.
        let mut tiny = Tensor::ones([1], (Kind::Float, device));
        pg.all_reduce(&mut tiny, ReduceOp::Sum).unwrap();
        let intruder = Tensor::full([len], 99.0, (Kind::Half, device));
        drop(on_a);
        settle(&b_done, &a, &b, &intruder);
        assert_eq!(
            (
                buffer.min().double_value(&[]),
                buffer.max().double_value(&[])
            ),
            (3.0, 3.0),
            "the bucket read memory that stream A reused"
        );
    }
}

/// What the GPU unit tests share (here, in `bucket.rs` and `amp.rs`); each skips without a
/// GPU.
#[cfg(test)]
pub(crate) mod gpu_tests {
    use tch::{Device, Kind, Tensor};
    use tch_ext::CudaStream;

    /// Whether cuda:0 can run the test (libtorch's CUDA side loaded); says `skipped:` if not.
    pub(crate) fn gpu() -> bool {
        let reason =
            ddp_comm::cuda::no_gpu_reason().or_else(|| match ddp_comm::cuda::load_torch_cuda() {
                Ok(true) if tch::Cuda::device_count() > 0 => None,
                Ok(true) => Some("libtorch sees no CUDA device".into()),
                Ok(false) => Some("libtorch has no libtorch_cuda.so (CPU-only build)".into()),
                Err(e) => Some(e.to_string()),
            });
        if let Some(reason) = &reason {
            println!("skipped: {reason}");
        }
        reason.is_none()
    }

    /// Queues about `seconds` of matmuls on the current stream of cuda:0, returns at once.
    pub(crate) fn keep_busy(seconds: f64) {
        let x = Tensor::randn([4096, 4096], (Kind::Float, Device::Cuda(0))) / 64.0;
        let stream = CudaStream::current(0).unwrap();
        let _ = x.mm(&x);
        stream.synchronize().unwrap();
        let start = std::time::Instant::now();
        for _ in 0..4 {
            let _ = x.mm(&x);
        }
        stream.synchronize().unwrap();
        let each = start.elapsed().as_secs_f64() / 4.0;
        for _ in 0..(seconds / each).ceil() as usize {
            let _ = x.mm(&x);
        }
    }

    /// Waits for streams `a` and `b` after a test queued work on `b` (ending with `b_done`)
    /// and allocated `intruder` (filled with 99) on `a`: asserts that `b` was still busy then,
    /// so the test saw what a reuse of `b`'s memory by `a` would do, and that `intruder` kept
    /// its values.
    pub(in crate::ddp) fn settle(
        b_done: &tch_ext::CudaEvent,
        a: &CudaStream,
        b: &CudaStream,
        intruder: &Tensor,
    ) {
        let pending = !b_done.query().unwrap();
        b.synchronize().unwrap();
        a.synchronize().unwrap();
        assert!(pending, "stream B finished its work too early for the test");
        assert_eq!(intruder.min().double_value(&[]), 99.0);
    }

    /// Two different pool streams of cuda:0 (the pool is round-robin over several).
    pub(in crate::ddp) fn two_streams() -> (CudaStream, CudaStream) {
        let a = CudaStream::from_pool(0, false).unwrap();
        let b = std::iter::repeat_with(|| CudaStream::from_pool(0, false).unwrap())
            .find(|s| *s != a)
            .unwrap();
        (a, b)
    }
}
