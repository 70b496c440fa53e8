//! [`ProcessGroup`]: the collectives a data-parallel trainer calls, over tensors and slices.
//!
//! Beside it: `rendezvous.rs`, how a new group meets the others and connects its ring;
//! `tensor.rs`, what each backend needs of a tensor; `work.rs`, asynchronous collectives
//! ([`Work`]) and the communication thread that runs them.

mod cuda;
mod rendezvous;
pub(crate) mod tensor;
pub(crate) mod work;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tch::{Device, Tensor};

use crate::config::env::MAX_TIMEOUT;
use crate::config::options::{Backend, Options, DEFAULT_RENDEZVOUS_TIMEOUT};
use crate::element::{as_bytes_mut, Element, ReduceOp};
use crate::error::CommError;
use crate::group::rendezvous::Plan;
use crate::group::tensor::{
    bool_op, cpu_bytes, cpu_dtype, cuda_buffer, device_of, gather_source, unsupported_device,
    Collective,
};
use crate::group::work::{panic_text, Op, Queue, Work};
use crate::nccl::inflight::Aborted;
use crate::nccl::{NcclComm, NcclOp};
use crate::ring::{cpu::CpuBackend, link::LinkKind, shm};
use crate::security::secret::Secret;
use crate::store::heartbeat::{self, Heartbeat, StoreInfo};
use crate::store::{Store, StoreServer};
use crate::sync::lock;

/// How a rank is wired into the ring that carries CPU collectives
/// ([`ProcessGroup::ring_layout`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingLayout {
    /// The ranks in ring order: each host's ranks in a row.
    pub order: Vec<usize>,
    /// The rank this one sends to.
    pub next: usize,
    /// The rank this one receives from.
    pub prev: usize,
    /// What carries the link to `next` (`None` in a world of one).
    pub to_next: Option<LinkKind>,
    /// What carries the link from `prev` (`None` in a world of one).
    pub from_prev: Option<LinkKind>,
}

/// A group of ranks that run collectives together.
///
/// Every rank must call the same collectives in the same order with the same sizes. The CPU
/// ring checks it, and reports a mismatch as [`CommError::Mismatch`]; NCCL collectives are
/// not checked: a mismatch there corrupts the results or hangs until the collective's
/// timeout. Methods take `&self`
/// and serialise internally; the group is `Send + Sync`.
///
/// The group is one failure domain, as PyTorch's: after a collective failed on either backend (a
/// peer lost, a timeout, a mismatch, an aborted NCCL communicator), every later collective fails
/// with [`CommError::Poisoned`] naming the failure, CPU and CUDA alike, and the neighbours'
/// collectives fail too (the CPU ring's links are shut). Refusals before any communication (a
/// tensor, root or output the call cannot take; [`ProcessGroup::all_gather_bytes`]'
/// [`CommError::TooLarge`]) leave the group usable, and so does NCCL's initialisation failing
/// (every later CUDA collective fails with it, the CPU ring carries on). A wait on a CUDA
/// collective queued before a CPU failure still gets NCCL's answer.
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    /// The CUDA device of NCCL collectives (`Options::cuda_device`, else
    /// [`default_cuda_device`]).
    cuda_device: usize,
    backend: Backend,
    op_timeout: Duration,
    /// The bound of NCCL communicator init: the longer of the op and rendezvous timeouts.
    nccl_init_timeout: Duration,
    cpu: Mutex<CpuBackend>,
    /// Why the CPU ring failed, once it has (`cpu`'s flag): read by CUDA collectives without
    /// `cpu`'s lock, which a CPU collective may hold for up to the op timeout.
    ring_failed: Arc<OnceLock<String>>,
    /// Shared with the watchdog thread (started at the first asynchronous CUDA collective),
    /// which holds it weakly.
    nccl: Arc<Mutex<Option<NcclComm>>>,
    /// The communicator's abort flag, once it exists: read without `nccl`'s lock, which the
    /// thread that aborts holds while `ncclCommAbort` waits for the queued kernels.
    nccl_aborted: OnceLock<Arc<Aborted>>,
    /// Why the communicator's initialisation failed, once it has: it is not tried again
    /// (the peers may be past it, and rank 0's unique id in the store is spent).
    nccl_failed: OnceLock<String>,
    watchdog: std::sync::Once,
    store: Mutex<Option<Box<dyn Store>>>,
    /// The communication thread of asynchronous CPU collectives, started at the first one.
    queue: Mutex<Option<Queue>>,
    /// Dropped before the server, so that its last beat can still reach it.
    heartbeat: Arc<Heartbeat>,
    _server: Option<StoreServer>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // The communicator goes now, on this thread: the watchdog may hold the last other
        // reference for a moment, and would otherwise drop it (wait, abort or destroy)
        // after this group is gone.
        drop(lock(&self.nccl).take());
        // Rank 0 serves the store: after a failure, keep it up for one diagnosis window, so
        // that ranks still diagnosing their own timeouts can read the heartbeats (as the
        // rendezvous keeps it up after an abort).
        if self._server.is_some() {
            if let Some(linger) = self.heartbeat.linger() {
                std::thread::sleep(linger);
            }
        }
    }
}

impl ProcessGroup {
    /// Joins the group described by the environment: torchrun's variables, else SLURM's,
    /// else rank 0 of 1 (see [`EnvConfig`](crate::EnvConfig)).
    pub fn from_env() -> Result<Self, CommError> {
        Self::new(Options::from_env()?)
    }

    /// Joins the group `opts` describes (blocks until every rank arrives, or the timeout).
    pub fn new(opts: Options) -> Result<Self, CommError> {
        let env = &opts.env;
        if env.world_size == 0 {
            return Err(CommError::InvalidArgument("world size 0".into()));
        }
        let ring_bytes = opts.shm_ring_bytes;
        if !ring_bytes.is_power_of_two()
            || !(shm::MIN_CAPACITY..=shm::MAX_CAPACITY).contains(&ring_bytes)
        {
            return Err(CommError::InvalidArgument(format!(
                "shared-memory ring of {ring_bytes} bytes: expected a power of two from {} to {}",
                shm::MIN_CAPACITY,
                shm::MAX_CAPACITY
            )));
        }
        let backend = choose_backend(
            opts.backend,
            opts.cuda_device,
            crate::nccl::cuda::device_count,
            || nccl_sys::Nccl::load().map(drop),
        )?;
        let secret = match &env.secret {
            Some(secret) => secret.clone(),
            // A group of one makes no connection: nothing to prove, no key file to touch.
            None if env.world_size == 1 => Secret::unused()?,
            None => Secret::fallback(env.secret_file.as_deref(), &env.run_id)?,
        };
        // Capped here too: `EnvConfig`'s fields are public, so a value can bypass the setters'
        // cap, and every deadline is `Instant::now() + timeout`.
        let op_timeout = env
            .op_timeout
            .unwrap_or_else(|| backend.default_op_timeout())
            .min(MAX_TIMEOUT);
        let rendezvous_timeout = env
            .rendezvous_timeout
            .unwrap_or(DEFAULT_RENDEZVOUS_TIMEOUT)
            .min(MAX_TIMEOUT);
        let plan = Plan {
            rank: env.rank,
            world_size: env.world_size,
            single_node: env.local_world_size >= env.world_size && !env.local_world_size_guessed,
            master_addr: env.master_addr.clone(),
            master_port: env.master_port,
            secret,
            agent_store: env.agent_store,
            key_prefix: key_prefix(env.agent_store, &env.run_id),
            timeout: rendezvous_timeout,
            socket_buffer: opts.socket_buffer,
            transport: env.transport.unwrap_or_default(),
            host_id: env.host_id.clone(),
            shm_capacity: ring_bytes,
            attempt: env.launcher_attempt,
            retry: false,
        };
        let met = rendezvous::meet(&plan)?;
        let heartbeat = Arc::new(start_heartbeat(&plan, op_timeout, &met));
        let cpu = CpuBackend::new(
            env.rank,
            env.world_size,
            met.ring,
            met.link,
            op_timeout,
            heartbeat.clone(),
        )?;
        let group = ProcessGroup {
            rank: env.rank,
            world_size: env.world_size,
            local_rank: env.local_rank,
            local_world_size: env.local_world_size,
            cuda_device: opts.cuda_device.unwrap_or_else(|| {
                let visible_set = std::env::var_os("CUDA_VISIBLE_DEVICES").is_some();
                let count = crate::nccl::cuda::device_count;
                default_cuda_device(backend, env.local_rank, count, visible_set)
            }),
            backend,
            op_timeout,
            nccl_init_timeout: op_timeout.max(rendezvous_timeout),
            ring_failed: cpu.poisoned(),
            cpu: Mutex::new(cpu),
            nccl: Arc::new(Mutex::new(None)),
            nccl_aborted: OnceLock::new(),
            nccl_failed: OnceLock::new(),
            watchdog: std::sync::Once::new(),
            store: Mutex::new(met.store),
            queue: Mutex::new(None),
            heartbeat,
            _server: met.server,
        };
        if opts.backend == Some(Backend::Nccl) {
            drop(group.nccl("NCCL init")?);
        }
        Ok(group)
    }

    /// This process's rank, `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Rank on this node. NCCL collectives run on `cuda:local_rank`, or on `cuda:0` when
    /// `CUDA_VISIBLE_DEVICES` shows this rank one device
    /// ([`cuda::rank_device`](crate::cuda::rank_device)), unless [`Options::cuda_device`]
    /// names another.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Number of ranks on this node.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }

    /// The backend that carries CUDA tensors ([`Backend::Cpu`]: none, CPU only).
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// How long one collective may take before it fails with [`CommError::Timeout`]: the
    /// options' or `DDP_OP_TIMEOUT_S`'s value, else [`Backend::default_op_timeout`].
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// How this rank is wired into the ring that carries CPU collectives.
    pub fn ring_layout(&self) -> RingLayout {
        let cpu = lock(&self.cpu);
        let order = cpu.order().to_vec();
        let pos = order.iter().position(|&r| r == self.rank).unwrap_or(0);
        let n = order.len();
        let (to_next, from_prev) = cpu.link_kinds().unzip();
        RingLayout {
            next: order[(pos + 1) % n],
            prev: order[(pos + n - 1) % n],
            to_next,
            from_prev,
            order,
        }
    }

    /// In-place all-reduce of a contiguous tensor (CPU: the ring of shared-memory and TCP
    /// links; CUDA: NCCL). A bool tensor's `Sum` and `Max` say whether any rank is true, its
    /// `Min` whether every rank is, and its `Avg` is refused (as in PyTorch).
    pub fn all_reduce(&self, t: &mut Tensor, op: ReduceOp) -> Result<(), CommError> {
        let op = bool_op(t, op)?;
        self.drain();
        self.all_reduce_now(t, op)
    }

    /// Starts an in-place all-reduce of a contiguous tensor and returns at once (c10d's
    /// `all_reduce(..., async_op=True)`). CPU tensors are reduced by the group's
    /// communication thread, in the order the asynchronous collectives were issued; CUDA
    /// tensors by NCCL on a side stream, after the work queued so far on the calling
    /// thread's current stream. `t` (and every tensor sharing its storage) must be left
    /// alone until [`Work::wait`] (or [`Work::wait_stream`]) has returned; dropping `t` is
    /// safe, the group keeps its storage until the collective has completed. A tensor the
    /// backend does not take is refused at the call: the `Work` is complete, with the error.
    pub fn all_reduce_async(self: &Arc<Self>, t: &Tensor, op: ReduceOp) -> Work {
        let op = match bool_op(t, op) {
            Ok(op) => op,
            Err(e) => return Work::done(Err(e)),
        };
        match device_of(t) {
            // NCCL takes worlds of one too, so that one GPU exercises this path.
            Ok(Device::Cuda(_)) => self.cuda_async(t, NcclOp::AllReduce(op)),
            Err(e) => Work::done(Err(e)),
            _ if self.world_size == 1 => Work::done(refuse_cpu(t)),
            _ => self.submit(t, Op::AllReduce(op)),
        }
    }

    /// Starts a broadcast from `root` into every rank's `t` and returns at once (see
    /// [`ProcessGroup::all_reduce_async`]).
    pub fn broadcast_async(self: &Arc<Self>, t: &Tensor, root: usize) -> Work {
        if let Err(e) = self.check_root(root) {
            return Work::done(Err(e));
        }
        match device_of(t) {
            Ok(Device::Cuda(_)) => self.cuda_async(t, NcclOp::Broadcast(root)),
            Err(e) => Work::done(Err(e)),
            _ => self.submit(t, Op::Broadcast(root)),
        }
    }

    /// Queues a CPU collective, or refuses its tensor now, as PyTorch raises at the call.
    fn submit(self: &Arc<Self>, t: &Tensor, op: Op) -> Work {
        if let Err(e) = refuse_cpu(t) {
            return Work::done(Err(e));
        }
        let mut queue = lock(&self.queue);
        if queue.is_none() {
            // The thread holds the group only while it runs a job, so dropping the group's
            // last handle ends it.
            let group = Arc::downgrade(self);
            let run = move |t: &mut Tensor, op: Op| match group.upgrade() {
                Some(group) => group.run_queued(t, op),
                None => Err(CommError::Poisoned("the process group was dropped".into())),
            };
            match Queue::start(run, self.rank) {
                Ok(q) => *queue = Some(q),
                Err(e) => return Work::done(Err(e)),
            }
        }
        match queue.as_ref() {
            Some(q) => q.submit(t.shallow_clone(), op),
            None => Work::done(Err(CommError::Poisoned("no communication thread".into()))),
        }
    }

    /// Waits until the asynchronous CPU collectives issued so far have finished, so that a
    /// blocking collective keeps its place in the order of collectives.
    fn drain(&self) {
        if let Some(queue) = lock(&self.queue).as_ref() {
            queue.pending().drain();
        }
    }

    /// Runs one job of the communication thread. A panic poisons the CPU ring (the job may
    /// have stopped half-way through a collective) before the thread reports it.
    fn run_queued(&self, t: &mut Tensor, op: Op) -> Result<(), CommError> {
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match op {
            Op::AllReduce(op) => self.all_reduce_now(t, op),
            Op::Broadcast(root) => self.broadcast_now(t, root),
        }));
        ran.unwrap_or_else(|payload| {
            let why = panic_text(payload.as_ref());
            lock(&self.cpu).fail(format!("the communication thread panicked: {why}"));
            std::panic::resume_unwind(payload)
        })
    }

    fn all_reduce_now(&self, t: &mut Tensor, op: ReduceOp) -> Result<(), CommError> {
        self.heartbeat.enter();
        self.run(Collective::AllReduce(t, op))
    }

    /// Broadcasts a contiguous tensor from `root` into every rank's `t` (same shape and
    /// dtype everywhere).
    pub fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
        self.drain();
        self.broadcast_now(t, root)
    }

    fn broadcast_now(&self, t: &mut Tensor, root: usize) -> Result<(), CommError> {
        self.heartbeat.enter();
        self.check_root(root)?;
        self.run(Collective::Broadcast(t, root))
    }

    /// Gathers every rank's `t` (same shape and dtype everywhere); element `r` of the result
    /// is rank `r`'s tensor. The results are views of one new tensor on `t`'s device.
    pub fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>, CommError> {
        device_of(t)?;
        let n = self.world_size as i64;
        let mut shape = vec![n];
        shape.extend(t.size());
        let mut out = Tensor::empty(shape.as_slice(), (t.kind(), t.device()));
        self.all_gather_into(t, &mut out)?;
        Ok((0..n).map(|r| out.get(r)).collect())
    }

    /// Gathers every rank's `input` into `output`, a contiguous tensor of the same dtype and
    /// device holding `world_size` times as many elements (any shape): rank `r`'s elements
    /// land at `r * input.numel()` in order. The counterpart of PyTorch's
    /// `all_gather_into_tensor`; reusing `output` saves an allocation per call. As there,
    /// `input` may be this rank's chunk of `output` (in place); one overlapping it elsewhere
    /// is gathered from a copy of its values at the call.
    pub fn all_gather_into(&self, input: &Tensor, output: &mut Tensor) -> Result<(), CommError> {
        self.drain();
        device_of(input)?;
        device_of(output)?;
        if output.kind() != input.kind()
            || output.device() != input.device()
            || output.numel() != input.numel() * self.world_size
        {
            return Err(CommError::InvalidArgument(format!(
                "all_gather_into: output is {:?} {:?} of {} elements, expected {:?} {:?} of {} \
                 (world size {} times the input's {})",
                output.kind(),
                output.device(),
                output.numel(),
                input.kind(),
                input.device(),
                input.numel() * self.world_size,
                self.world_size,
                input.numel()
            )));
        }
        let (copy, in_place) = gather_source(input, output, self.rank)?;
        self.heartbeat.enter(); // a refused call has not entered
        self.run(Collective::AllGather {
            input: copy.as_ref().unwrap_or(input),
            output,
            in_place,
        })
    }

    /// Runs `c` on the backend of its tensors' device: the device dispatch of every tensor
    /// collective.
    fn run(&self, c: Collective<'_>) -> Result<(), CommError> {
        match c.device()? {
            Device::Cpu => self.run_cpu(c),
            Device::Cuda(_) => self.run_nccl(c),
            other => Err(unsupported_device(other)),
        }
    }

    /// Each collective over the CPU ring.
    fn run_cpu(&self, c: Collective<'_>) -> Result<(), CommError> {
        match c {
            Collective::AllReduce(t, op) => {
                let (bytes, dtype) = cpu_bytes(t)?;
                self.ring("all_reduce")?.all_reduce(bytes, dtype, op)
            }
            Collective::Broadcast(t, root) => {
                let (bytes, _) = cpu_bytes(t)?;
                self.ring("broadcast")?.broadcast(bytes, root)
            }
            Collective::AllGather {
                output,
                in_place: true,
                ..
            } => {
                // The input is this rank's chunk of the output: one slice of its bytes.
                let (dst, _) = cpu_bytes(output)?;
                self.ring("all_gather")?.all_gather_in_place(dst)
            }
            Collective::AllGather { input, output, .. } => {
                let mut source = input.shallow_clone();
                let (src, _) = cpu_bytes(&mut source)?;
                let (dst, _) = cpu_bytes(output)?;
                self.ring("all_gather")?.all_gather(src, dst)
            }
        }
    }

    /// Each collective over NCCL (the communicator is created at the first).
    fn run_nccl(&self, c: Collective<'_>) -> Result<(), CommError> {
        let buffer = |t: &Tensor| cuda_buffer(t, self.backend, self.cuda_device);
        let (buf, op, keep) = match c {
            Collective::AllReduce(t, op) => {
                (buffer(t)?, NcclOp::AllReduce(op), vec![t.shallow_clone()])
            }
            Collective::Broadcast(t, root) => {
                (buffer(t)?, NcclOp::Broadcast(root), vec![t.shallow_clone()])
            }
            // In place (the input this rank's chunk of the output) is NCCL's own in-place
            // all-gather: the same two pointers.
            Collective::AllGather { input, output, .. } => {
                let buf = buffer(input)?;
                let recv = buffer(output)?.ptr;
                let keep = vec![input.shallow_clone(), output.shallow_clone()];
                (buf, NcclOp::AllGather { recv }, keep)
            }
        };
        let mut comm = self.nccl(op.name())?;
        // SAFETY: `cuda_buffer` checked that each tensor is a defined contiguous tensor of
        // its `count` elements of `dtype` on the communicator's device; an all-gather's
        // output (checked by `all_gather_into`: same dtype and device) holds `world_size`
        // times the input's elements.
        unsafe { comm.as_mut().map_or(Ok(()), |c| c.run(buf, op, keep)) }
    }

    /// Returns once every rank has called `barrier` (and, with NCCL initialised, this
    /// rank's queued GPU work has finished: every collective queued on NCCL's side stream,
    /// asynchronous ones included, and the work queued so far on the calling thread's
    /// current stream).
    pub fn barrier(&self) -> Result<(), CommError> {
        self.drain();
        self.heartbeat.enter();
        self.usable("barrier")?;
        if let Some(comm) = cuda::CommGuard::new(lock(&self.nccl)).as_mut() {
            comm.synchronize()?;
        }
        self.ring("barrier")?.barrier()
    }

    /// In-place all-reduce of a slice over the CPU links (no tensors involved).
    pub fn all_reduce_slice<T: Element>(
        &self,
        data: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.drain();
        self.heartbeat.enter();
        self.ring("all_reduce_slice")?
            .all_reduce(as_bytes_mut(data), T::DTYPE, op)
    }

    /// Broadcast of a slice from `root` over the CPU links.
    pub fn broadcast_slice<T: Element>(
        &self,
        data: &mut [T],
        root: usize,
    ) -> Result<(), CommError> {
        self.drain();
        self.heartbeat.enter();
        self.check_root(root)?;
        self.ring("broadcast_slice")?
            .broadcast(as_bytes_mut(data), root)
    }

    /// Gathers every rank's byte string (lengths may differ); element `r` is rank `r`'s.
    pub fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        self.drain();
        self.heartbeat.enter();
        self.ring("all_gather_bytes")?.all_gather_bytes(data)
    }

    /// The CPU ring, for `op`; once the NCCL communicator was aborted, the abort's error,
    /// having failed the ring with it (its links shut, so that the neighbours fail too), as
    /// after a panic that may have left a collective half-way (stale bytes in flight).
    fn ring(&self, op: &str) -> Result<MutexGuard<'_, CpuBackend>, CommError> {
        let mut cpu = self.cpu.lock().unwrap_or_else(|p| {
            let mut cpu = p.into_inner();
            cpu.fail("a thread panicked during a collective on the CPU ring".into());
            cpu
        });
        if let Err(e) = self.nccl_usable(op) {
            cpu.fail(crate::error::with_causes(&e));
            return Err(e);
        }
        Ok(cpu)
    }

    /// Sets the most bytes [`ProcessGroup::all_gather_bytes`] allocates for all ranks'
    /// contributions together (default
    /// [`DEFAULT_MAX_GATHER_BYTES`](crate::DEFAULT_MAX_GATHER_BYTES), 1 GiB). The lengths come from
    /// the peers: a larger total fails with [`CommError::TooLarge`], naming the rank, before
    /// anything is allocated. Every rank sees the same lengths, so give every rank the same limit.
    pub fn set_max_gather_bytes(&self, bytes: u64) {
        lock(&self.cpu).set_max_gather(bytes);
    }

    /// The limit [`ProcessGroup::set_max_gather_bytes`] sets: what a caller checks a gather
    /// it knows the size of against before the ranks meet.
    pub fn max_gather_bytes(&self) -> u64 {
        lock(&self.cpu).max_gather()
    }

    fn check_root(&self, root: usize) -> Result<(), CommError> {
        if root >= self.world_size {
            return Err(CommError::RankOutOfRange {
                rank: root,
                world_size: self.world_size,
            });
        }
        Ok(())
    }

    /// Overrides the ring pipeline segment size (for benchmarks).
    #[doc(hidden)]
    pub fn set_ring_segment(&self, bytes: usize) {
        lock(&self.cpu).set_segment(bytes);
    }

    /// Overrides the latency-path threshold of CPU all-reduces (for benchmarks).
    #[doc(hidden)]
    pub fn set_small_threshold(&self, bytes: usize) {
        lock(&self.cpu).set_small(bytes);
    }

    /// Overrides how long a rank polls its shared-memory rings before sleeping (for
    /// benchmarks).
    #[doc(hidden)]
    pub fn set_shm_spin(&self, spin: Duration) {
        lock(&self.cpu).set_spin(spin);
    }
}

/// The backend of a group: the one `requested`; else NCCL for a group that trains on a CUDA
/// device (`cuda_device` set), failing with NCCL's load error (every path tried, the
/// variable to set) rather than falling back to the CPU backend, which refuses CUDA tensors
/// only at the first collective; else NCCL when a GPU is visible and NCCL loads, else CPU.
fn choose_backend(
    requested: Option<Backend>,
    cuda_device: Option<usize>,
    device_count: impl FnOnce() -> usize,
    nccl_load: impl FnOnce() -> Result<(), nccl_sys::LoadError>,
) -> Result<Backend, CommError> {
    if let Some(backend) = requested {
        return Ok(backend);
    }
    if cuda_device.is_some() {
        nccl_load()?;
        return Ok(Backend::Nccl);
    }
    let nccl = device_count() > 0 && nccl_load().is_ok();
    Ok(if nccl { Backend::Nccl } else { Backend::Cpu })
}

/// The CUDA device of a group's NCCL collectives when the options name none: the one
/// [`cuda::rank_device`](crate::cuda::rank_device) gives the local rank among the `count`
/// devices the CUDA runtime sees, else (no NCCL backend, no device counted, or none that
/// rule allows) `cuda:local_rank`, which a CUDA collective's refusal then names.
fn default_cuda_device(
    backend: Backend,
    local_rank: usize,
    count: impl FnOnce() -> usize,
    visible_set: bool,
) -> usize {
    if backend != Backend::Nccl {
        return local_rank;
    }
    match count() {
        0 => local_rank,
        count => {
            crate::nccl::cuda::rank_device(local_rank, count, visible_set).unwrap_or(local_rank)
        }
    }
}

/// The prefix of a group's keys in the store. Rank 0's own store is new for each group, but
/// torchrun's agent store outlives them: there each group of the process gets a number, in
/// the order formed (every rank forms the same groups in the same order), as c10d names its
/// groups by a count (`_process_group_name`), and each start of the ranks a generation
/// under it (`rendezvous/generation.rs`), so that no group finds another's `join/<rank>`.
fn key_prefix(agent_store: bool, run_id: &str) -> String {
    static AGENT_STORE_GROUPS: AtomicU64 = AtomicU64::new(0);
    if agent_store {
        let n = AGENT_STORE_GROUPS.fetch_add(1, Ordering::Relaxed);
        format!("/ddp-comm/{run_id}/{n}/")
    } else {
        format!("/ddp-comm/{run_id}/")
    }
}

/// The refusal of a tensor an asynchronous CPU collective cannot take, if it is one: any
/// other device than the CPU, a layout or a dtype the ring does not carry.
fn refuse_cpu(t: &Tensor) -> Result<(), CommError> {
    match t.device() {
        Device::Cpu => cpu_dtype(t).map(drop),
        other => Err(unsupported_device(other)),
    }
}

/// The heartbeat of this rank (see `store/heartbeat.rs`), on its own store connection; without
/// one (a world of one, or a store that cannot be reached again) timeouts cannot name the
/// hung rank, and say so.
fn start_heartbeat(plan: &Plan, op_timeout: Duration, met: &rendezvous::Met) -> Heartbeat {
    let (rank, world) = (plan.rank, plan.world_size);
    let Some(store) = met.store.as_ref() else {
        return Heartbeat::without_thread(rank, world, "no store");
    };
    let info = StoreInfo {
        addr: store.addr().to_string(),
        served_by_rank0: !plan.agent_store,
    };
    let timeout = heartbeat::store_timeout(heartbeat::interval_for(op_timeout));
    match rendezvous::connector(plan, met, timeout) {
        Ok(connect) => Heartbeat::start(rank, world, op_timeout, info, connect),
        Err(e) => {
            let e = crate::error::with_causes(&e);
            tracing::warn!("ddp-comm: rank {rank} runs without a heartbeat: {e}");
            Heartbeat::without_thread(rank, world, format!("the store is unreachable: {e}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_can_be_shared_between_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ProcessGroup>();
    }

    /// A panic while a thread held the CPU ring (a collective left half-way through) fails
    /// the ring: the next collective is refused instead of pairing with stale bytes.
    #[test]
    fn a_panic_holding_the_ring_fails_the_collectives_after_it() {
        let group =
            ProcessGroup::new(Options::new(0, 1, "127.0.0.1", 0).backend(Backend::Cpu)).unwrap();
        let mut v = [1.0f32, 2.0];
        group.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        std::thread::scope(|s| {
            let held = s.spawn(|| {
                let _ring = group.cpu.lock();
                panic!("a collective panicked");
            });
            assert!(held.join().is_err());
        });
        match group.all_reduce_slice(&mut v, ReduceOp::Sum) {
            Err(CommError::Poisoned(why)) => {
                assert_eq!(why, "a thread panicked during a collective on the CPU ring")
            }
            other => panic!("expected Poisoned, got {other:?}"),
        }
    }

    #[test]
    fn an_unset_op_timeout_is_pytorchs_default_for_the_backend() {
        let cpu = |opts: Options| ProcessGroup::new(opts.backend(Backend::Cpu)).unwrap();
        let unset = cpu(Options::new(0, 1, "127.0.0.1", 0));
        assert_eq!(unset.op_timeout(), Duration::from_secs(30 * 60));
        let set = cpu(Options::new(0, 1, "127.0.0.1", 0).op_timeout(Duration::from_secs(7)));
        assert_eq!(set.op_timeout(), Duration::from_secs(7));
        assert_eq!(
            Backend::Nccl.default_op_timeout(),
            Duration::from_secs(10 * 60)
        );
    }

    /// A group that trains on a CUDA device and names no backend gets NCCL or NCCL's load
    /// error (every path tried, the variable to set), never the CPU backend.
    #[test]
    fn the_automatic_backend_of_a_cuda_device_is_nccl_or_its_load_error() {
        let missing = || {
            Err(nccl_sys::LoadError {
                library: nccl_sys::search::NCCL_NAME,
                attempts: vec![("/opt/typo/libnccl.so.2".into(), "no such file".into())],
                missing_symbol: None,
            })
        };
        let choose = |requested, cuda_device, devices, loads: bool| {
            let load = || if loads { Ok(()) } else { missing() };
            choose_backend(requested, cuda_device, || devices, load)
        };
        match choose(None, Some(0), 1, false) {
            Err(CommError::Load(e)) => {
                let text = e.to_string();
                assert!(text.contains("'/opt/typo/libnccl.so.2'"), "{text}");
                assert!(text.contains("set DDP_NCCL_LIBRARY"), "{text}");
            }
            other => panic!("expected CommError::Load, got {other:?}"),
        }
        // A named device needs NCCL whatever the GPU count says.
        assert!(matches!(
            choose(None, Some(1), 0, false),
            Err(CommError::Load(_))
        ));
        let chosen = [
            (None, Some(0), 1, true, Backend::Nccl),
            (None, None, 0, true, Backend::Cpu),
            (None, None, 1, false, Backend::Cpu),
            (None, None, 2, true, Backend::Nccl),
            (Some(Backend::Cpu), Some(0), 1, false, Backend::Cpu),
            (Some(Backend::Nccl), None, 0, false, Backend::Nccl),
        ];
        for (requested, cuda_device, devices, loads, want) in chosen {
            let got = choose(requested, cuda_device, devices, loads).unwrap();
            assert_eq!(got, want, "{requested:?} {cuda_device:?} {devices} {loads}");
        }
    }

    /// `srun --ntasks-per-node 4 --gpus-per-task 1`: local rank 2 sees its one GPU as
    /// `cuda:0`, and its NCCL collectives run there.
    #[test]
    fn the_default_cuda_device_of_a_rank_bound_to_one_gpu_is_cuda_0() {
        assert_eq!(default_cuda_device(Backend::Nccl, 2, || 1, true), 0);
        assert_eq!(default_cuda_device(Backend::Nccl, 2, || 4, true), 2);
        // No device counted, one shared GPU that nothing binds, or no NCCL: the local rank.
        assert_eq!(default_cuda_device(Backend::Nccl, 2, || 0, true), 2);
        assert_eq!(default_cuda_device(Backend::Nccl, 2, || 1, false), 2);
        let counted = std::cell::Cell::new(false);
        let count = || {
            counted.set(true);
            1
        };
        assert_eq!(default_cuda_device(Backend::Cpu, 2, count, true), 2);
        assert!(!counted.get(), "a CPU group asked the CUDA runtime");
    }

    #[test]
    fn a_ring_size_that_is_not_a_power_of_two_in_range_is_refused() {
        for bytes in [0, 5000, 1 << 31] {
            let mut opts = Options::new(0, 1, "127.0.0.1", 0);
            opts.shm_ring_bytes = bytes;
            match ProcessGroup::new(opts) {
                Err(CommError::InvalidArgument(why)) => {
                    assert!(why.contains(&format!("ring of {bytes} bytes")), "{why}")
                }
                other => panic!("{bytes}: expected InvalidArgument, got {other:?}"),
            }
        }
    }
}
