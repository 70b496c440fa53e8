//! The NCCL backend: one communicator per process group, on the group's CUDA device
//! (`Options::cuda_device`, by default `cuda:LOCAL_RANK`, or `cuda:0` for a rank bound to
//! one GPU).
//!
//! **Streams.** Every collective runs on the communicator's side stream, a high-priority
//! stream from libtorch's pool (non-blocking: it does not serialise with the legacy default
//! stream), in the order the collectives were issued. Before each one, an event recorded on
//! the caller's *current* stream (libtorch's, as tch-ext reads it: the stream the kernels
//! that produced the tensor were queued on) makes the side stream wait, so the collective
//! reads the finished tensor; kernels queued on the current stream afterwards overlap with
//! it. An event recorded on the side stream after the collective marks its end:
//!
//! - a blocking collective ([`NcclComm::run`]) and [`NcclComm::wait_work`] wait on the host
//!   for that event (polling it with `ncclCommGetAsyncError`, bounded by the timeout);
//! - [`NcclComm::wait_work_on_stream`] makes the caller's current stream wait for it
//!   (`cudaStreamWaitEvent`) and returns at once;
//! - [`NcclComm::synchronize`] (the barrier) waits for an event recorded on the side stream
//!   and one recorded on the current stream, so it covers queued collectives and compute.
//!
//! **Ownership.** `inflight.rs` keeps each queued collective's end event and a handle of
//! each tensor it touches until the event is seen complete, so a tensor whose caller dropped
//! it (and its [`crate::Work`]) goes back to the caching allocator only once NCCL is done
//! with it. Completed entries are retired at every call into the communicator, and handed
//! back to the allocator by the group once that call has let go of the communicator's lock
//! (never by the watchdog: see `inflight.rs`).
//!
//! **Failures.** A peer that died or an operation that exceeds the timeout makes the
//! communicator abort (`ncclCommAbort`) so that nothing hangs, and the group is unusable
//! afterwards: every later wait, of any collective, fails with [`CommError::Poisoned`]
//! without touching NCCL (the communicator is freed by the abort, and an aborted kernel's
//! end event completes on a half-reduced tensor), and so does every later CPU collective
//! of the group (see `ProcessGroup`). Before aborting on a timeout, the rank
//! reads every rank's heartbeat (`store/heartbeat.rs`) so that the error names the hung
//! rank. At each call, and every 100 ms from the group's watchdog thread, collectives still
//! pending past the timeout abort the communicator too, which catches the ones that only a
//! stream waits for. A communicator dropped with
//! collectives pending is aborted, never destroyed (`ncclCommDestroy` would wait for them,
//! forever if a peer is gone), once they have made no progress for a few seconds; the
//! tensors of collectives still running then are leaked rather than handed back to the
//! allocator under a running kernel.
//!
//! **Init.** The communicator is non-blocking (`ncclCommInitRankConfig` with `blocking = 0`):
//! init returns at once, possibly with `ncclInProgress`, and this rank polls
//! `ncclCommGetAsyncError` until it is done, for at most the init timeout: the longer of the
//! collective and the rendezvous timeouts, since init is a meeting of every rank, and the
//! first init in a process (NCCL loading its plugins and topology) can take about a second,
//! more than a short collective timeout. A peer that dies or stops between the CPU barrier
//! that precedes init and its own init therefore fails this rank's init with
//! [`CommError::NcclInit`] (the communicator aborted) instead of hanging it. With a
//! non-blocking communicator, enqueuing a collective may also return `ncclInProgress`; the
//! same polling, under the collective's deadline, waits for it.
//!
//! Beside it, `init.rs` creates the communicator, `teardown.rs` lets it go (destroyed, or
//! aborted with collectives pending), `poll.rs` paces the host's polls, and `cuda.rs` (the
//! public [`cuda`] module) makes CUDA visible to the program.

pub mod cuda;
pub(crate) mod inflight;
mod init;
mod poll;
mod teardown;

pub(crate) use init::refuse_blocking_init;

use std::ffi::{c_int, c_void, CStr};
use std::time::{Duration, Instant};

use std::sync::Arc;

use self::poll::Poll;
use nccl_sys::{
    cudaError_t, cudaEvent_t, cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t,
    ncclUniqueId, Cudart, Nccl,
};

use tch::Tensor;
use tch_ext::CudaStream;

use crate::element::{DType, ReduceOp};
use crate::error::{CommError, NCCL_SYSTEM_ERROR_HINT};
use crate::nccl::inflight::{Event, InFlight, Marker, Status};
use crate::store::heartbeat::Heartbeat;

/// A tensor's memory on the communicator's device, as NCCL takes it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceBuffer {
    /// The first element.
    pub ptr: *mut c_void,
    /// Number of elements.
    pub count: usize,
    /// Their type.
    pub dtype: ncclDataType_t,
}

/// A collective on a [`DeviceBuffer`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum NcclOp {
    /// In place, on every rank.
    AllReduce(ReduceOp),
    /// In place, from rank `root`.
    Broadcast(usize),
    /// Every rank's buffer, in rank order, into `recv` (`world` times the buffer's
    /// elements).
    AllGather {
        /// Where the gathered elements go.
        recv: *mut c_void,
    },
}

impl NcclOp {
    /// NCCL's function, for messages.
    fn call(self) -> &'static str {
        match self {
            NcclOp::AllReduce(_) => "ncclAllReduce",
            NcclOp::Broadcast(_) => "ncclBroadcast",
            NcclOp::AllGather { .. } => "ncclAllGather",
        }
    }

    /// The collective's name, for messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            NcclOp::AllReduce(_) => "all_reduce",
            NcclOp::Broadcast(_) => "broadcast",
            NcclOp::AllGather { .. } => "all_gather",
        }
    }
}

/// An NCCL communicator bound to one device.
#[derive(Debug)]
pub(crate) struct NcclComm {
    nccl: &'static Nccl,
    cudart: &'static Cudart,
    comm: ncclComm_t,
    /// The side stream of every collective, taken from libtorch's pool at the first one.
    side: Option<CudaStream>,
    device: c_int,
    timeout: Duration,
    /// Queued collectives not yet seen complete, and whether the communicator was aborted.
    inflight: InFlight<Event, Vec<Tensor>>,
    heartbeat: Arc<Heartbeat>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `ProcessGroup` keeps it behind a mutex.
unsafe impl Send for NcclComm {}

fn nccl_text(nccl: &Nccl, rc: ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    unsafe { CStr::from_ptr((nccl.ncclGetErrorString)(rc)) }
        .to_string_lossy()
        .into_owned()
}

fn check_cuda(call: &'static str, rc: cudaError_t) -> Result<(), CommError> {
    if rc == cudaError_t::cudaSuccess {
        Ok(())
    } else {
        Err(CommError::Nccl {
            call,
            detail: crate::nccl::cuda::cuda_error_string(rc),
        })
    }
}

/// NCCL's element type for `dtype` (`Int16` has none).
pub(crate) fn nccl_dtype(dtype: DType) -> Option<ncclDataType_t> {
    Some(match dtype {
        DType::U8 => ncclDataType_t::ncclUint8,
        DType::I8 => ncclDataType_t::ncclInt8,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::I16 => return None,
    })
}

fn nccl_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
    }
}

/// Creates a fresh unique id (rank 0 does this and publishes it through the store).
pub(crate) fn unique_id() -> Result<ncclUniqueId, CommError> {
    let nccl = Nccl::load()?;
    let mut id = ncclUniqueId {
        internal: [0; nccl_sys::NCCL_UNIQUE_ID_BYTES],
    };
    // SAFETY: `id` is a valid, writable ncclUniqueId.
    let rc = unsafe { (nccl.ncclGetUniqueId)(&mut id) };
    if rc != ncclResult_t::ncclSuccess {
        return Err(CommError::Nccl {
            call: "ncclGetUniqueId",
            detail: with_last_error(rc, &nccl_text(nccl, rc), ""),
        });
    }
    Ok(id)
}

/// The loaded NCCL's version as `"major.minor.patch"`.
pub fn version() -> Result<String, CommError> {
    let nccl = Nccl::load()?;
    let mut code = 0;
    // SAFETY: `code` is a valid out-pointer.
    let rc = unsafe { (nccl.ncclGetVersion)(&mut code) };
    if rc != ncclResult_t::ncclSuccess {
        return Err(CommError::Nccl {
            call: "ncclGetVersion",
            detail: with_last_error(rc, &nccl_text(nccl, rc), ""),
        });
    }
    Ok(nccl_sys::version_string(code))
}

/// The detail NCCL keeps about the last error of `comm` (may be empty).
fn last_error(nccl: &Nccl, comm: ncclComm_t) -> String {
    // SAFETY: `comm` is a live communicator (or null, which NCCL accepts); the returned
    // string is owned by NCCL.
    let last = unsafe { (nccl.ncclGetLastError)(comm) };
    if last.is_null() {
        return String::new();
    }
    // SAFETY: non-null NUL-terminated string owned by NCCL.
    unsafe { CStr::from_ptr(last) }
        .to_string_lossy()
        .into_owned()
}

/// NCCL's `text` for a failed call that returned `rc`, then the detail it keeps about the last
/// error (`last`, may be empty: it names the peer or connection lost), as c10d's
/// `getNcclErrorDetailStr`; for a system error, then [`NCCL_SYSTEM_ERROR_HINT`].
fn with_last_error(rc: ncclResult_t, text: &str, last: &str) -> String {
    let detail = format!("{text} {last}").trim_end().to_string();
    if rc != ncclResult_t::ncclSystemError {
        return detail;
    }
    format!("{detail}; {NCCL_SYSTEM_ERROR_HINT}")
}

/// The error of an asynchronous NCCL failure (`rc`, `text`, `last`: see [`with_last_error`])
/// seen while `op` ran.
fn async_error(op: &str, rc: ncclResult_t, text: &str, last: &str) -> CommError {
    let detail = format!("{op}: {}", with_last_error(rc, text, last));
    let call = "ncclCommGetAsyncError";
    CommError::Nccl { call, detail }
}

/// Why a pending call on a non-blocking communicator did not settle.
enum Unsettled {
    /// `call` returned `rc` (`ncclCommGetAsyncError` itself, or the pending call's result).
    Failed {
        call: &'static str,
        rc: ncclResult_t,
    },
    /// Still `ncclInProgress` when the timeout passed since `start`.
    TimedOut,
}

/// Polls `ncclCommGetAsyncError` until the pending `call` on `comm` is no longer
/// `ncclInProgress`, or `timeout` has passed since `start`.
fn settle(
    nccl: &Nccl,
    comm: ncclComm_t,
    call: &'static str,
    start: Instant,
    timeout: Duration,
) -> Result<(), Unsettled> {
    let mut poll = Poll::new();
    loop {
        let mut state = ncclResult_t::ncclInProgress;
        // SAFETY: `comm` is live and `state` is a valid out-pointer.
        let rc = unsafe { (nccl.ncclCommGetAsyncError)(comm, &mut state) };
        if rc != ncclResult_t::ncclSuccess {
            let call = "ncclCommGetAsyncError";
            return Err(Unsettled::Failed { call, rc });
        }
        match state {
            ncclResult_t::ncclSuccess => return Ok(()),
            ncclResult_t::ncclInProgress if start.elapsed() > timeout => {
                return Err(Unsettled::TimedOut)
            }
            ncclResult_t::ncclInProgress => {}
            rc => return Err(Unsettled::Failed { call, rc }),
        }
        poll.pause();
    }
}

impl NcclComm {
    fn check(&mut self, call: &'static str, rc: ncclResult_t) -> Result<(), CommError> {
        if rc == ncclResult_t::ncclSuccess {
            return Ok(());
        }
        let last = last_error(self.nccl, self.comm);
        let detail = with_last_error(rc, &nccl_text(self.nccl, rc), &last);
        Err(self.abort(CommError::Nccl { call, detail }))
    }

    /// Checks what enqueuing a collective returned: with a non-blocking communicator,
    /// `ncclInProgress` means NCCL is still enqueuing it, so poll `ncclCommGetAsyncError`
    /// until it is done (the wait for the stream follows). `start` is when the collective
    /// began: the timeout covers both waits.
    fn issued(
        &mut self,
        call: &'static str,
        op: &'static str,
        rc: ncclResult_t,
        start: Instant,
    ) -> Result<(), CommError> {
        if rc != ncclResult_t::ncclInProgress {
            return self.check(call, rc);
        }
        match settle(self.nccl, self.comm, call, start, self.timeout) {
            Ok(()) => Ok(()),
            Err(Unsettled::Failed { call, rc }) => self.check(call, rc),
            Err(Unsettled::TimedOut) => Err(self.timed_out(op)),
        }
    }

    /// The timeout of `op`, diagnosed (which rank is hung), with the communicator aborted.
    fn timed_out(&mut self, op: &'static str) -> CommError {
        let err = self.heartbeat.explain(CommError::Timeout {
            op,
            timeout: self.timeout,
            peers: Vec::new(),
            diagnosis: Box::default(),
        });
        self.abort(err)
    }

    /// Polls `done` until it says the awaited work has completed, checking before each poll
    /// that the communicator was not aborted (then the answer is an error, and NCCL is not
    /// called again) and after it NCCL's asynchronous error and the timeout (counted from
    /// `start`), either of which aborts the communicator.
    fn wait_until(
        &mut self,
        op: &'static str,
        start: Instant,
        mut done: impl FnMut(&mut Self) -> Result<bool, CommError>,
    ) -> Result<(), CommError> {
        let mut poll = Poll::new();
        loop {
            if let Some(e) = self.inflight.aborted_error(op) {
                return Err(e);
            }
            match done(self) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                // The communicator was aborted meanwhile: already the answer.
                Err(e) if self.inflight.is_aborted() => return Err(e),
                Err(e) => return Err(self.abort(e)),
            }
            self.check_async(op)?;
            if start.elapsed() > self.timeout {
                return Err(self.timed_out(op));
            }
            poll.pause();
        }
    }

    /// Fails, aborting the communicator, if NCCL reports an asynchronous error. Must not be
    /// called after an abort (the communicator is gone).
    fn check_async(&mut self, op: &'static str) -> Result<(), CommError> {
        debug_assert!(!self.inflight.is_aborted());
        let mut async_rc = ncclResult_t::ncclSuccess;
        // SAFETY: `self.comm` is live (not aborted) and `async_rc` is a valid out-pointer.
        let rc = unsafe { (self.nccl.ncclCommGetAsyncError)(self.comm, &mut async_rc) };
        let bad = if rc != ncclResult_t::ncclSuccess {
            rc
        } else {
            async_rc
        };
        if bad == ncclResult_t::ncclSuccess || bad == ncclResult_t::ncclInProgress {
            return Ok(());
        }
        // Read before the abort frees the communicator.
        let last = last_error(self.nccl, self.comm);
        Err(self.abort(async_error(op, bad, &nccl_text(self.nccl, bad), &last)))
    }

    /// Aborts the communicator (once) because of `err`, and returns `err`. The abort flag is
    /// set before `ncclCommAbort`, which with more than one rank blocks until the queued
    /// kernels have exited, while this thread holds the communicator's lock: the group
    /// answers `Work::is_completed` and every later call from the flag meanwhile.
    fn abort(&mut self, err: CommError) -> CommError {
        self.heartbeat.mark_failed();
        let (nccl, comm) = (self.nccl, self.comm);
        let why = crate::error::with_causes(&err);
        self.inflight.aborted().abort_with(why, || {
            // SAFETY: `comm` is live; after abort it is never used again (every path to
            // NCCL checks `inflight.is_aborted()` first, and the flag is set now).
            unsafe { (nccl.ncclCommAbort)(comm) };
        });
        err
    }

    /// The end events of the collectives retired since the last call and the tensors they
    /// kept, for the caller to drop once it has let go of the communicator's lock.
    pub(crate) fn take_released(&mut self) -> Vec<(Event, Vec<Tensor>)> {
        self.inflight.take_released()
    }

    /// The flag that says whether this communicator was aborted, for readers that do not
    /// hold it.
    pub(crate) fn aborted(&self) -> std::sync::Arc<inflight::Aborted> {
        self.inflight.aborted().clone()
    }

    /// Checks the communicator is usable and selects its device; retires the collectives
    /// that have completed, and fails (aborting) when one still pending has exceeded the
    /// timeout or NCCL reports an error. Returns when the call began (its timeout starts
    /// there).
    fn enter(&mut self, op: &'static str) -> Result<Instant, CommError> {
        let start = Instant::now();
        if let Some(e) = self.inflight.aborted_error(op) {
            return Err(e);
        }
        // SAFETY: plain CUDA runtime call with the communicator's device ordinal.
        let selected = check_cuda("cudaSetDevice", unsafe {
            (self.cudart.cudaSetDevice)(self.device)
        });
        if let Err(e) = selected {
            // This rank cannot take part in what its peers are entering.
            return Err(self.abort(e));
        }
        self.inflight.retire_completed();
        if self.inflight.pending() > 0 {
            self.check_async(op)?;
            if let Some(late) = self.inflight.overdue(self.timeout) {
                return Err(self.timed_out(late));
            }
        }
        Ok(start)
    }

    /// Makes the communicator's device the calling thread's before a CUDA call that does
    /// not go through [`Self::enter`] (an event query, a destroy): on a thread that has no
    /// device yet, CUDA would otherwise create a context on device 0, about half a GiB on
    /// every rank of a node. A failure shows in the CUDA call that follows.
    fn select_device(&self) {
        // SAFETY: plain CUDA runtime call with the communicator's device ordinal.
        let _ = unsafe { (self.cudart.cudaSetDevice)(self.device) };
    }

    /// The watchdog's look: retires completed collectives; aborts when one pending has
    /// exceeded the timeout or NCCL reports an error (the error is what later waits report).
    pub(crate) fn watch(&mut self) {
        if !self.inflight.is_aborted() {
            let _ = self.enter("watchdog");
        }
    }

    /// The calling thread's current stream on the communicator's device.
    fn current_stream(&self) -> Result<CudaStream, CommError> {
        CudaStream::current(self.device as usize).map_err(|e| CommError::Nccl {
            call: "current CUDA stream",
            detail: e.to_string(),
        })
    }

    /// Enqueues `op` on `buf` on `stream` and returns what NCCL answered: the one place
    /// each collective is written for NCCL.
    ///
    /// # Safety
    /// As [`NcclComm::run`]; `stream` is this communicator's side stream.
    unsafe fn issue(&self, buf: DeviceBuffer, op: NcclOp, stream: cudaStream_t) -> ncclResult_t {
        let DeviceBuffer { ptr, count, dtype } = buf;
        let (nccl, comm) = (self.nccl, self.comm);
        // SAFETY: the caller guarantees the buffers and the stream; the communicator is live.
        unsafe {
            match op {
                NcclOp::AllReduce(op) => {
                    (nccl.ncclAllReduce)(ptr, ptr, count, dtype, nccl_op(op), comm, stream)
                }
                NcclOp::Broadcast(root) => {
                    (nccl.ncclBroadcast)(ptr, ptr, count, dtype, root as c_int, comm, stream)
                }
                NcclOp::AllGather { recv } => {
                    (nccl.ncclAllGather)(ptr, recv, count, dtype, comm, stream)
                }
            }
        }
    }

    /// Runs `op` on `buf` (after the work queued so far on the current stream) and waits
    /// on the host until it has completed; `keep` are the tensors behind the buffers.
    ///
    /// # Safety
    /// `buf.ptr` must point to `buf.count` elements of `buf.dtype` in memory of this
    /// communicator's device, and an all-gather's `recv` to `world * buf.count` of them.
    pub(crate) unsafe fn run(
        &mut self,
        buf: DeviceBuffer,
        op: NcclOp,
        keep: Vec<Tensor>,
    ) -> Result<(), CommError> {
        // SAFETY: as guaranteed by the caller.
        let work = unsafe { self.enqueue(buf, op, keep)? };
        self.wait_work(work)
    }

    /// Waits for the work queued so far on the side stream (every collective) and on the
    /// calling thread's current stream.
    pub(crate) fn synchronize(&mut self) -> Result<(), CommError> {
        let op = "barrier";
        let start = self.enter(op)?;
        let marked = self.current_stream().and_then(|current| {
            let mut marks = vec![self.record(current.as_raw())?];
            if let Some(side) = self.side {
                marks.push(self.record(side.as_raw())?);
            }
            Ok(marks)
        });
        let marks = marked.map_err(|e| self.abort(e))?;
        self.wait_until(op, start, |_| {
            for mark in &marks {
                if !mark.reached().map_err(|detail| CommError::Nccl {
                    call: "cudaEventQuery",
                    detail,
                })? {
                    return Ok(false);
                }
            }
            Ok(true)
        })?;
        self.inflight.retire_completed();
        Ok(())
    }

    /// The side stream, taken from libtorch's high-priority pool at first use.
    fn side_stream(&mut self) -> Result<CudaStream, CommError> {
        if let Some(s) = self.side {
            return Ok(s);
        }
        let s = CudaStream::from_pool(self.device as usize, true).map_err(|e| CommError::Nccl {
            call: "CUDA stream from pool",
            detail: e.to_string(),
        })?;
        self.side = Some(s);
        Ok(s)
    }

    /// The side stream, made to wait (on the device) for the work queued so far on the
    /// calling thread's current stream.
    fn side_after_current(&mut self) -> Result<CudaStream, CommError> {
        let side = self.side_stream()?;
        let current = self.current_stream()?;
        if current != side {
            let ready = self.record(current.as_raw())?;
            // SAFETY: both handles are live; the event is destroyed after the wait has been
            // queued, which CUDA allows (it releases it once the wait has been resolved).
            check_cuda("cudaStreamWaitEvent", unsafe {
                (self.cudart.cudaStreamWaitEvent)(side.as_raw(), ready.raw, 0)
            })?;
        }
        Ok(side)
    }

    /// A new event recorded on `stream` (timing disabled).
    fn record(&self, stream: cudaStream_t) -> Result<Event, CommError> {
        let mut raw: cudaEvent_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; 2 = cudaEventDisableTiming.
        check_cuda("cudaEventCreateWithFlags", unsafe {
            (self.cudart.cudaEventCreateWithFlags)(&mut raw, 2)
        })?;
        let event = Event {
            raw,
            cudart: self.cudart,
        };
        // SAFETY: the event was just created; `stream` is a live stream of this device.
        check_cuda("cudaEventRecord", unsafe {
            (self.cudart.cudaEventRecord)(event.raw, stream)
        })?;
        Ok(event)
    }

    /// Queues `op` on the side stream, after everything queued so far on the calling
    /// thread's current stream, and returns its handle; the communicator keeps `keep` (the
    /// tensors behind the buffers) until the collective has completed on the device.
    ///
    /// # Safety
    /// As [`NcclComm::run`]; in addition the buffers must not be written, nor read while the
    /// collective writes them, until the returned work has been waited for.
    pub(crate) unsafe fn enqueue(
        &mut self,
        buf: DeviceBuffer,
        op: NcclOp,
        keep: Vec<Tensor>,
    ) -> Result<NcclWork, CommError> {
        let start = self.enter(op.name())?;
        let side = match self.side_after_current() {
            Ok(side) => side,
            // The peers issue this collective: skipping it here would pair this rank's
            // next one with it.
            Err(e) => return Err(self.abort(e)),
        };
        // SAFETY: the caller guarantees the buffers; `side` is this communicator's stream.
        let rc = unsafe { self.issue(buf, op, side.as_raw()) };
        let accepted = rc == ncclResult_t::ncclSuccess || rc == ncclResult_t::ncclInProgress;
        let done = self.issued(op.call(), op.name(), rc, start).and_then(|()| {
            match self.record(side.as_raw()) {
                Ok(done) => Ok(done),
                // Without its end event nothing could tell when the collective is done.
                Err(e) => Err(self.abort(e)),
            }
        });
        let done = match done {
            Ok(done) => done,
            Err(e) => {
                if accepted {
                    // NCCL took the collective (its kernel may be queued, or launched
                    // later by NCCL's own thread) before the communicator was aborted:
                    // nothing tells when the kernel stops using the tensors, so they are
                    // leaked rather than handed back to the allocator under it.
                    std::mem::forget(keep);
                }
                return Err(e);
            }
        };
        let id = self.inflight.push(op.name(), start, done, keep);
        Ok(NcclWork {
            id,
            op: op.name(),
            start,
        })
    }

    /// Waits on the host until `work` has completed (bounded by the collective timeout,
    /// which counts from when it was queued); kernels queued afterwards on any stream then
    /// see the result. Fails without touching NCCL once the communicator was aborted.
    pub(crate) fn wait_work(&mut self, work: NcclWork) -> Result<(), CommError> {
        let NcclWork { id, op, start } = work;
        self.select_device();
        self.wait_until(op, start, |comm| {
            Ok(comm.inflight.status(id, op)? == Status::Done)
        })
    }

    /// Makes the calling thread's current stream wait (on the device) until `work` has
    /// completed, and returns at once. A failure of the collective is reported by the next
    /// call into the communicator.
    pub(crate) fn wait_work_on_stream(&mut self, work: NcclWork) -> Result<(), CommError> {
        let NcclWork { id, op, .. } = work;
        self.enter(op)?;
        if self.inflight.status(id, op)? == Status::Done {
            return Ok(());
        }
        let current = self.current_stream().map_err(|e| self.abort(e))?;
        let Some(done) = self.inflight.marker(id) else {
            return Ok(());
        };
        // SAFETY: both handles are live (the event stays in `inflight` until retired).
        let waits = check_cuda("cudaStreamWaitEvent", unsafe {
            (self.cudart.cudaStreamWaitEvent)(current.as_raw(), done.raw, 0)
        });
        // Without the wait, kernels queued next would read the buffer before the result.
        waits.map_err(|e| self.abort(e))
    }

    /// Whether `work` has completed on the device (`true` too once it has failed: its
    /// wait then returns the error).
    pub(crate) fn work_completed(&mut self, work: &NcclWork) -> bool {
        self.select_device();
        !matches!(self.inflight.status(work.id, work.op), Ok(Status::Pending))
    }
}

/// A collective queued on the side stream: its entry in the communicator's in-flight table.
#[derive(Debug)]
pub(crate) struct NcclWork {
    id: u64,
    op: &'static str,
    start: Instant,
}

impl NcclWork {
    /// The collective's name, for messages.
    pub(crate) fn op(&self) -> &'static str {
        self.op
    }

    /// The handle of collective `id`, queued now (for tests that need no communicator).
    #[cfg(test)]
    pub(crate) fn for_test(id: u64, op: &'static str) -> Self {
        NcclWork {
            id,
            op,
            start: Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer lost mid-collective: the error keeps NCCL's detail of what failed, after its
    /// generic text; without a detail there is nothing after the text.
    #[test]
    fn an_asynchronous_error_carries_nccls_last_error() {
        let text = "remote process exited or there was a network error";
        let last = "NET/Socket : peer 10.0.0.2<43512> closed the connection";
        let remote = ncclResult_t::ncclRemoteError;
        match async_error("all_reduce", remote, text, last) {
            CommError::Nccl { call, detail } => {
                assert_eq!(call, "ncclCommGetAsyncError");
                assert_eq!(detail, format!("all_reduce: {text} {last}"));
            }
            other => panic!("expected CommError::Nccl, got {other:?}"),
        }
        let bare = async_error("broadcast", remote, text, "").to_string();
        assert!(bare.ends_with(&format!("broadcast: {text}")), "{bare}");
    }

    /// A system error, often NCCL's shared memory not fitting in a container's `/dev/shm`,
    /// says so after NCCL's own words; other errors do not.
    #[test]
    fn a_system_error_points_at_dev_shm() {
        let text = "unhandled system error (run with NCCL_DEBUG=INFO for details)";
        let last = "Error while creating shared memory segment /dev/shm/nccl-x (size 9637888)";
        let detail = with_last_error(ncclResult_t::ncclSystemError, text, last);
        assert_eq!(
            detail,
            format!(
                "{text} {last}; in a container, NCCL's shared memory may not fit in /dev/shm \
                 (docker's default is 64 MiB): run it with --ipc=host or --shm-size=1g"
            )
        );
        let error = async_error("all_reduce", ncclResult_t::ncclSystemError, text, "");
        assert!(
            error
                .to_string()
                .ends_with(&format!("{text}; {NCCL_SYSTEM_ERROR_HINT}")),
            "{error}"
        );
        let internal = with_last_error(ncclResult_t::ncclInternalError, text, last);
        assert_eq!(internal, format!("{text} {last}"));
    }
}
