//! The NCCL backend: one communicator per process group, on the device `cuda:LOCAL_RANK`.
//!
//! **Stream invariant.** Collectives are issued on the legacy default stream (the null
//! `cudaStream_t`). tch has no stream API, and PyTorch runs every kernel of a device on that
//! device's default stream, which is the legacy default stream unless a program selects
//! another one (tch programs cannot). So the collective is ordered after the kernels that
//! produced the tensor (e.g. backward) and before the kernels that read the result, exactly
//! as if PyTorch had queued it.
//!
//! **Asynchronous collectives** ([`NcclComm::all_reduce_async`]) run on a side stream of the
//! communicator's own (non-blocking, so it does not serialise with the default stream): an
//! event recorded on the default stream orders the collective after the tensor's producer,
//! and an event recorded after it on the side stream is what [`NcclWork`] waits for, so
//! kernels queued on the default stream in the meantime (the rest of backward) overlap with
//! the communication.
//!
//! **Completion.** Each call waits until the stream has drained, polling `cudaStreamQuery`
//! and `ncclCommGetAsyncError`; a peer that died or an operation that exceeds the timeout
//! makes the communicator abort (`ncclCommAbort`) so that nothing hangs, and the group is
//! unusable afterwards. Before aborting on a timeout, the rank reads every rank's heartbeat
//! (`store/heartbeat.rs`) so that the error names the hung rank.
//!
//! **Init.** The communicator is non-blocking (`ncclCommInitRankConfig` with `blocking = 0`):
//! init returns at once, possibly with `ncclInProgress`, and this rank polls
//! `ncclCommGetAsyncError` until it is done, for at most the collective timeout. A peer that
//! dies or stops between the CPU barrier that precedes init and its own init therefore fails
//! this rank's init with [`CommError::NcclInit`] (the communicator aborted) instead of
//! hanging it. With a non-blocking communicator, enqueuing a collective may also return
//! `ncclInProgress`; the same polling, under the same deadline, waits for it.
//!
//! Beside it, `cuda.rs` (the public [`cuda`] module) makes CUDA visible to the program.

pub mod cuda;

use std::ffi::{c_int, c_void, CStr};
use std::time::{Duration, Instant};

use std::sync::Arc;

use nccl_sys::{
    cudaError_t, cudaEvent_t, cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t,
    ncclResult_t, ncclUniqueId, Cudart, Nccl,
};

use crate::element::{DType, ReduceOp};
use crate::error::{CommError, Diagnosis};
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
    fn name(self) -> &'static str {
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
    /// The side stream of asynchronous collectives, created at the first one.
    side: Option<cudaStream_t>,
    device: c_int,
    timeout: Duration,
    aborted: bool,
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
            detail: nccl_text(nccl, rc),
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
            detail: nccl_text(nccl, rc),
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

/// How long to sleep between polls of a pending NCCL call: doubling from 20 us to 1 ms.
fn next_pause(pause: Duration) -> Duration {
    (pause * 2).min(Duration::from_millis(1))
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
    let mut pause = Duration::from_micros(20);
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
        std::thread::sleep(pause);
        pause = next_pause(pause);
    }
}

impl NcclComm {
    /// `cudaSetDevice(device)`, then a non-blocking `ncclCommInitRankConfig`, polled until
    /// it is done, it fails, or `timeout` passes (see the module's documentation).
    pub(crate) fn init(
        rank: usize,
        world: usize,
        device: usize,
        id: ncclUniqueId,
        timeout: Duration,
        heartbeat: Arc<Heartbeat>,
    ) -> Result<Self, CommError> {
        let nccl = Nccl::load()?;
        let cudart = Cudart::load()?;
        let ordinal = device as c_int;
        // SAFETY: plain CUDA runtime call with a device ordinal.
        check_cuda("cudaSetDevice", unsafe { (cudart.cudaSetDevice)(ordinal) })?;
        let failed = |what: String, diagnosis: Diagnosis| CommError::NcclInit {
            rank,
            device,
            what,
            diagnosis: Box::new(diagnosis),
        };
        let abort = |comm: ncclComm_t| {
            if !comm.is_null() {
                // SAFETY: `comm` came from ncclCommInitRankConfig and is not used again.
                unsafe { (nccl.ncclCommAbort)(comm) };
            }
        };
        let mut config = ncclConfig_t::initializer();
        config.blocking = 0;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let start = Instant::now();
        // SAFETY: `comm` is a valid out-pointer, `config` a valid config that outlives the
        // call (NCCL copies it); `id` is passed by value as the C API expects.
        let rc = unsafe {
            (nccl.ncclCommInitRankConfig)(&mut comm, world as c_int, id, rank as c_int, &mut config)
        };
        let nccl_failed = |prefix: &str, rc: ncclResult_t| {
            let what = format!(
                "failed: {prefix}{} {}",
                nccl_text(nccl, rc),
                last_error(nccl, comm)
            );
            abort(comm);
            Err(failed(what.trim_end().to_string(), Diagnosis::default()))
        };
        if rc != ncclResult_t::ncclSuccess && rc != ncclResult_t::ncclInProgress {
            return nccl_failed("ncclCommInitRankConfig: ", rc);
        }
        if comm.is_null() {
            let what = "failed: ncclCommInitRankConfig returned no communicator".to_string();
            return Err(failed(what, Diagnosis::default()));
        }
        match settle(nccl, comm, "ncclCommInitRankConfig", start, timeout) {
            Ok(()) => {}
            Err(Unsettled::Failed { rc, .. }) => return nccl_failed("", rc),
            Err(Unsettled::TimedOut) => {
                // Diagnose first: the heartbeats say which rank never joined.
                let diagnosis = heartbeat.diagnose();
                abort(comm);
                return Err(failed(format!("timed out after {timeout:?}"), diagnosis));
            }
        }
        Ok(NcclComm {
            nccl,
            cudart,
            comm,
            side: None,
            device: ordinal,
            timeout,
            aborted: false,
            heartbeat,
        })
    }

    fn check(&mut self, call: &'static str, rc: ncclResult_t) -> Result<(), CommError> {
        if rc == ncclResult_t::ncclSuccess {
            return Ok(());
        }
        let last = last_error(self.nccl, self.comm);
        Err(self.abort(CommError::Nccl {
            call,
            detail: format!("{} {last}", nccl_text(self.nccl, rc))
                .trim()
                .to_string(),
        }))
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

    /// Waits for the default stream to drain, aborting on an async error or the timeout.
    fn wait(&mut self, op: &'static str, start: Instant) -> Result<(), CommError> {
        let cudart = self.cudart;
        // SAFETY: querying the legacy default stream of the current device.
        self.wait_for(op, start, "cudaStreamQuery", || unsafe {
            (cudart.cudaStreamQuery)(std::ptr::null_mut())
        })
    }

    /// Polls `query` (a CUDA query: `cudaSuccess` when done, `cudaErrorNotReady` before)
    /// until it is done, aborting on an async NCCL error or the timeout.
    fn wait_for(
        &mut self,
        op: &'static str,
        start: Instant,
        call: &'static str,
        query: impl Fn() -> cudaError_t,
    ) -> Result<(), CommError> {
        let mut pause = Duration::from_micros(20);
        loop {
            let q = query();
            if q == cudaError_t::cudaSuccess {
                return Ok(());
            }
            if q != cudaError_t::cudaErrorNotReady {
                return Err(self.abort(CommError::Nccl {
                    call,
                    detail: crate::nccl::cuda::cuda_error_string(q),
                }));
            }
            let mut async_rc = ncclResult_t::ncclSuccess;
            // SAFETY: `self.comm` is live and `async_rc` is a valid out-pointer.
            let rc = unsafe { (self.nccl.ncclCommGetAsyncError)(self.comm, &mut async_rc) };
            if rc != ncclResult_t::ncclSuccess
                || (async_rc != ncclResult_t::ncclSuccess
                    && async_rc != ncclResult_t::ncclInProgress)
            {
                let bad = if rc != ncclResult_t::ncclSuccess {
                    rc
                } else {
                    async_rc
                };
                let detail = format!("{op}: {}", nccl_text(self.nccl, bad));
                return Err(self.abort(CommError::Nccl {
                    call: "ncclCommGetAsyncError",
                    detail,
                }));
            }
            if start.elapsed() > self.timeout {
                return Err(self.timed_out(op));
            }
            std::thread::sleep(pause);
            pause = next_pause(pause);
        }
    }

    fn abort(&mut self, err: CommError) -> CommError {
        self.heartbeat.mark_failed();
        if !self.aborted {
            // SAFETY: `self.comm` is live; after abort it is never used again.
            unsafe { (self.nccl.ncclCommAbort)(self.comm) };
            self.aborted = true;
        }
        err
    }

    /// Checks the communicator is usable and selects its device; returns when the call
    /// began (its timeout starts there).
    fn enter(&mut self) -> Result<Instant, CommError> {
        let start = Instant::now();
        if self.aborted {
            return Err(CommError::Poisoned(
                "the NCCL communicator was aborted".into(),
            ));
        }
        // SAFETY: plain CUDA runtime call with the communicator's device ordinal.
        check_cuda("cudaSetDevice", unsafe {
            (self.cudart.cudaSetDevice)(self.device)
        })?;
        Ok(start)
    }

    /// Enqueues `op` on `buf` on `stream` and returns what NCCL answered: the one place
    /// each collective is written for NCCL.
    ///
    /// # Safety
    /// As [`NcclComm::run`]; `stream` is the legacy default stream (null) or this
    /// communicator's side stream.
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

    /// Runs `op` on `buf` on the legacy default stream and waits until it has completed.
    ///
    /// # Safety
    /// `buf.ptr` must point to `buf.count` elements of `buf.dtype` in memory of this
    /// communicator's device, and an all-gather's `recv` to `world * buf.count` of them.
    pub(crate) unsafe fn run(&mut self, buf: DeviceBuffer, op: NcclOp) -> Result<(), CommError> {
        let start = self.enter()?;
        // SAFETY: the caller guarantees the buffers; stream null = legacy default stream.
        let rc = unsafe { self.issue(buf, op, std::ptr::null_mut()) };
        self.issued(op.call(), op.name(), rc, start)?;
        self.wait(op.name(), start)
    }

    /// Waits for all queued work on the device's default stream.
    pub(crate) fn synchronize(&mut self) -> Result<(), CommError> {
        let start = self.enter()?;
        self.wait("synchronize", start)
    }

    /// The side stream, created at first use.
    fn side_stream(&mut self) -> Result<cudaStream_t, CommError> {
        if let Some(s) = self.side {
            return Ok(s);
        }
        let mut s: cudaStream_t = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-pointer; 1 = cudaStreamNonBlocking.
        check_cuda("cudaStreamCreateWithFlags", unsafe {
            (self.cudart.cudaStreamCreateWithFlags)(&mut s, 1)
        })?;
        self.side = Some(s);
        Ok(s)
    }

    /// A new event recorded on `stream` (timing disabled).
    fn record(&self, stream: cudaStream_t) -> Result<cudaEvent_t, CommError> {
        let mut e: cudaEvent_t = std::ptr::null_mut();
        // SAFETY: `e` is a valid out-pointer; 2 = cudaEventDisableTiming.
        check_cuda("cudaEventCreateWithFlags", unsafe {
            (self.cudart.cudaEventCreateWithFlags)(&mut e, 2)
        })?;
        // SAFETY: `e` was just created; `stream` is the null stream or our side stream.
        let rc = unsafe { (self.cudart.cudaEventRecord)(e, stream) };
        if rc != cudaError_t::cudaSuccess {
            // SAFETY: `e` is ours and unused.
            unsafe { (self.cudart.cudaEventDestroy)(e) };
            return Err(CommError::Nccl {
                call: "cudaEventRecord",
                detail: crate::nccl::cuda::cuda_error_string(rc),
            });
        }
        Ok(e)
    }

    /// Queues an in-place all-reduce on the side stream, after everything queued so far on
    /// the default stream, and returns the event that marks its end.
    ///
    /// # Safety
    /// As [`NcclComm::run`]; in addition the buffer must stay allocated, and must not
    /// be written, until the returned work has been waited for.
    pub(crate) unsafe fn all_reduce_async(
        &mut self,
        buf: DeviceBuffer,
        op: ReduceOp,
    ) -> Result<NcclWork, CommError> {
        let start = self.enter()?;
        let side = self.side_stream()?;
        let ready = self.record(std::ptr::null_mut())?;
        // SAFETY: both handles are live; destroying a recorded event that a stream waits
        // on is allowed (CUDA releases it when the wait has been resolved).
        let rc = unsafe {
            let rc = (self.cudart.cudaStreamWaitEvent)(side, ready, 0);
            (self.cudart.cudaEventDestroy)(ready);
            rc
        };
        check_cuda("cudaStreamWaitEvent", rc)?;
        let op = NcclOp::AllReduce(op);
        // SAFETY: the caller guarantees the buffer; `side` is this communicator's stream.
        let rc = unsafe { self.issue(buf, op, side) };
        self.issued(op.call(), op.name(), rc, start)?;
        Ok(NcclWork {
            done: self.record(side)?,
            start,
        })
    }

    /// Waits until `work` has completed (bounded by the collective timeout, which counts
    /// from when it was queued); kernels queued afterwards on the default stream then see
    /// the result.
    pub(crate) fn wait_work(&mut self, work: NcclWork) -> Result<(), CommError> {
        let cudart = self.cudart;
        let done = work.done;
        // SAFETY: `done` is a live event owned by `work`.
        let result = self.wait_for("all_reduce", work.start, "cudaEventQuery", || unsafe {
            (cudart.cudaEventQuery)(done)
        });
        drop(work);
        result
    }
}

/// An asynchronous NCCL collective in flight: the event recorded after it on the side
/// stream.
#[derive(Debug)]
pub(crate) struct NcclWork {
    done: cudaEvent_t,
    start: Instant,
}

// SAFETY: a CUDA event handle may be queried and destroyed from any thread.
unsafe impl Send for NcclWork {}

impl Drop for NcclWork {
    fn drop(&mut self) {
        if let Ok(cudart) = Cudart::load() {
            // SAFETY: the event is ours; CUDA defers its release until it has completed.
            unsafe { (cudart.cudaEventDestroy)(self.done) };
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if let Some(side) = self.side.take() {
            // SAFETY: the stream is ours; CUDA releases it once its work is done.
            unsafe { (self.cudart.cudaStreamDestroy)(side) };
        }
        if !self.aborted {
            // SAFETY: `self.comm` is live and not used after this point.
            unsafe { (self.nccl.ncclCommDestroy)(self.comm) };
        }
    }
}
