//! CUDA streams and events, through libtorch's device-generic `c10::Stream` and `c10::Event`.
//!
//! Nothing here needs CUDA at build time: the shim reaches the CUDA backend that
//! `libc10_cuda.so` registers when it is loaded. rustc links with `--as-needed`, so a program
//! that calls nothing in `libtorch_cuda.so` never loads it; load it first (ddp-comm's
//! `load_torch_cuda`), or every function here reports [`TchExtError::NoCuda`].

use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::ptr;

use tch::{Device, Tensor};

use crate::ffi;
use crate::TchExtError;

/// Whether libtorch's CUDA backend is loaded and sees at least one device.
pub fn cuda_is_available() -> bool {
    cuda_device_count() > 0
}

/// How many CUDA devices libtorch's CUDA backend sees; 0 when it is not loaded.
pub fn cuda_device_count() -> usize {
    // SAFETY: takes nothing, cannot fail (the shim's backend query is noexcept).
    let count = unsafe { ffi::tch_ext_cuda_device_count() };
    usize::try_from(count).unwrap_or(0)
}

/// Checks that `device` exists, as the shim's index type.
fn device_index(device: usize) -> Result<c_int, TchExtError> {
    let count = cuda_device_count();
    if count == 0 {
        return Err(TchExtError::NoCuda);
    }
    if device >= count {
        return Err(TchExtError::NoSuchDevice { device, count });
    }
    c_int::try_from(device).map_err(|_| TchExtError::NoSuchDevice { device, count })
}

/// A CUDA stream of one device: a handle (libtorch's stream id and the `cudaStream_t`), not
/// an owner. Streams come from libtorch (the current stream, or its pool of side streams) and
/// live as long as the process, so a handle can be copied and sent anywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaStream {
    id: i64,
    device: usize,
    raw: *mut c_void,
}

// SAFETY: a stream handle is plain data naming a process-wide CUDA stream; CUDA stream
// operations are thread-safe.
unsafe impl Send for CudaStream {}
// SAFETY: as above; no method mutates the handle.
unsafe impl Sync for CudaStream {}

impl CudaStream {
    /// This thread's current stream on `device` (where libtorch queues kernels).
    ///
    /// # Errors
    ///
    /// [`TchExtError::NoCuda`] or [`TchExtError::NoSuchDevice`].
    pub fn current(device: usize) -> Result<Self, TchExtError> {
        let index = device_index(device)?;
        let (mut id, mut raw) = (0, ptr::null_mut());
        // SAFETY: a valid device index and two valid out-pointers for the call.
        let message = unsafe { ffi::tch_ext_cuda_current_stream(index, &mut id, &mut raw) };
        ffi::check(message, "current CUDA stream")?;
        Ok(Self { id, device, raw })
    }

    /// A side stream from libtorch's pool for `device` (`c10::cuda::getStreamFromPool`:
    /// round-robin over a fixed set, so two calls may return the same stream).
    ///
    /// # Errors
    ///
    /// [`TchExtError::NoCuda`] or [`TchExtError::NoSuchDevice`].
    pub fn from_pool(device: usize, high_priority: bool) -> Result<Self, TchExtError> {
        let index = device_index(device)?;
        let (mut id, mut raw) = (0, ptr::null_mut());
        // SAFETY: a valid device index and two valid out-pointers for the call.
        let message =
            unsafe { ffi::tch_ext_cuda_pool_stream(index, high_priority, &mut id, &mut raw) };
        ffi::check(message, "CUDA stream from pool")?;
        Ok(Self { id, device, raw })
    }

    /// The `cudaStream_t`, for CUDA libraries (NCCL) that take one. The default stream's is
    /// null, which the CUDA runtime reads as the legacy default stream of whichever device is
    /// current on the calling thread: pass it only with this stream's device current.
    pub fn as_raw(&self) -> *mut c_void {
        self.raw
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Makes the stream wait (on the device, not the host) until the work before `event`'s
    /// last record has finished; a no-op for an event never recorded.
    ///
    /// # Errors
    ///
    /// [`TchExtError::DeviceMismatch`] for an event of another device, or
    /// [`TchExtError::Torch`] for a CUDA error.
    pub fn wait_event(&self, event: &CudaEvent) -> Result<(), TchExtError> {
        event.check_device(self)?;
        let index = device_index(self.device)?;
        // SAFETY: `event.raw` is a live `c10::Event*` owned by `event`; the stream id came from
        // libtorch for this device.
        let message = unsafe { ffi::tch_ext_cuda_stream_wait_event(self.id, index, event.raw) };
        ffi::check(message, "CUDA stream wait for event")
    }

    /// Blocks the calling thread until all work queued on the stream has finished.
    ///
    /// # Errors
    ///
    /// [`TchExtError::Torch`] for a CUDA error (including one from an earlier kernel).
    pub fn synchronize(&self) -> Result<(), TchExtError> {
        let index = device_index(self.device)?;
        // SAFETY: the stream id came from libtorch for this device.
        let message = unsafe { ffi::tch_ext_cuda_stream_synchronize(self.id, index) };
        ffi::check(message, "CUDA stream synchronize")
    }

    /// Whether all work queued on the stream has finished, without blocking.
    ///
    /// # Errors
    ///
    /// [`TchExtError::Torch`] for a CUDA error.
    pub fn query(&self) -> Result<bool, TchExtError> {
        let index = device_index(self.device)?;
        let mut done = false;
        // SAFETY: the stream id came from libtorch for this device; `done` is a valid
        // out-pointer for the call.
        let message = unsafe { ffi::tch_ext_cuda_stream_query(self.id, index, &mut done) };
        ffi::check(message, "CUDA stream query").map(|()| done)
    }
}

/// Makes `stream` the current stream of its device on this thread (what libtorch's kernels
/// are queued on) until the returned guard is dropped. It does not change the current device
/// (PyTorch's `torch.cuda.set_stream` does): libtorch's operations pick each tensor's device
/// and that device's current stream, but raw CUDA calls on a null (default) stream go to the
/// current device's.
///
/// # Errors
///
/// [`TchExtError::NoCuda`] or [`TchExtError::NoSuchDevice`].
pub fn set_current_stream(stream: CudaStream) -> Result<StreamGuard, TchExtError> {
    let index = device_index(stream.device)?;
    let mut previous = 0;
    // SAFETY: the stream id came from libtorch for this device; `previous` is a valid
    // out-pointer for the call.
    let message = unsafe { ffi::tch_ext_cuda_exchange_stream(stream.id, index, &mut previous) };
    ffi::check(message, "set current CUDA stream")?;
    Ok(StreamGuard {
        device: stream.device,
        previous,
        _thread: PhantomData,
    })
}

/// Keeps a stream current on its device for this thread; dropping it restores the stream that
/// was current before. Made by [`set_current_stream`]. Current streams are thread-local, so
/// the guard is neither `Send` nor `Sync`; nested guards must be dropped in reverse order.
#[derive(Debug)]
#[must_use = "the previous stream is current again when the guard is dropped"]
pub struct StreamGuard {
    device: usize,
    previous: i64,
    /// Thread-local state: `!Send + !Sync`.
    _thread: PhantomData<*const ()>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        // The device existed when the guard was made and devices do not disappear.
        let Ok(index) = device_index(self.device) else {
            return;
        };
        let mut ignored = 0;
        // SAFETY: `previous` is the id libtorch returned for this device; `ignored` is a
        // valid out-pointer for the call.
        let message =
            unsafe { ffi::tch_ext_cuda_exchange_stream(self.previous, index, &mut ignored) };
        let _ = ffi::check(message, "restore current CUDA stream");
    }
}

/// Tells libtorch's caching allocator that `tensor`'s memory is used on `stream` (PyTorch's
/// `Tensor.record_stream`). The allocator keeps each freed block for the stream it was
/// allocated on and hands it out again to the next allocation there at once, not ordered
/// after work queued on other streams: a tensor read or written on another stream must be
/// recorded there before its last handle is dropped, so that its memory is reused only
/// once the work queued so far on `stream` has finished. Recording the stream it was
/// allocated on changes nothing.
///
/// A CPU (or undefined) tensor is a no-op, where PyTorch's `record_stream` raises: host
/// memory has no streams, and callers that hold tensors of either device need no branch.
///
/// # Errors
///
/// [`TchExtError::Torch`] for a tensor of another device than the stream's, or a CUDA
/// error; [`TchExtError::NoCuda`] or [`TchExtError::NoSuchDevice`] as for streams.
pub fn record_stream(tensor: &Tensor, stream: &CudaStream) -> Result<(), TchExtError> {
    if !tensor.defined() || !tensor.device().is_cuda() {
        return Ok(());
    }
    let index = device_index(stream.device)?;
    // SAFETY: `tensor` is a live, defined tch tensor (a `torch::Tensor*` in the shim); the
    // stream id came from libtorch for this device.
    let message =
        unsafe { ffi::tch_ext_cuda_record_stream(tensor.as_ptr().cast(), stream.id, index) };
    ffi::check(message, "record stream")
}

/// [`record_stream`] on the calling thread's current stream of `tensor`'s device: where the
/// kernels queued from this thread (libtorch's) go. A no-op for a CPU (or undefined) tensor.
///
/// # Errors
///
/// As [`record_stream`].
pub fn record_current_stream(tensor: &Tensor) -> Result<(), TchExtError> {
    if !tensor.defined() {
        return Ok(());
    }
    match tensor.device() {
        Device::Cuda(index) => record_stream(tensor, &CudaStream::current(index)?),
        _ => Ok(()),
    }
}

/// A CUDA event of one device (timing disabled), destroyed on drop. The CUDA event itself is
/// created on the first [`record`](Self::record).
#[derive(Debug)]
pub struct CudaEvent {
    raw: *mut c_void,
    device: usize,
}

// SAFETY: the `c10::Event` is owned by this value alone, and CUDA events may be used and
// destroyed from any thread. It is not `Sync`: `record` updates the `c10::Event`'s fields.
unsafe impl Send for CudaEvent {}

impl CudaEvent {
    /// A new event for streams of `device`.
    ///
    /// # Errors
    ///
    /// [`TchExtError::NoCuda`] or [`TchExtError::NoSuchDevice`].
    pub fn new(device: usize) -> Result<Self, TchExtError> {
        let index = device_index(device)?;
        let mut raw = ptr::null_mut();
        // SAFETY: a valid device index and a valid out-pointer for the call; on success the
        // shim hands over a new `c10::Event*` that `Drop` frees.
        let message = unsafe { ffi::tch_ext_cuda_event_new(index, &mut raw) };
        ffi::check(message, "new CUDA event")?;
        Ok(Self { raw, device })
    }

    /// The device whose streams the event is for.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Records the event on `stream`: it completes when the work queued there so far has.
    ///
    /// # Errors
    ///
    /// [`TchExtError::DeviceMismatch`] for a stream of another device, or
    /// [`TchExtError::Torch`] for a CUDA error.
    pub fn record(&self, stream: &CudaStream) -> Result<(), TchExtError> {
        self.check_device(stream)?;
        let index = device_index(stream.device)?;
        // SAFETY: `self.raw` is the live `c10::Event*` this value owns; the stream id came from
        // libtorch for this device.
        let message = unsafe { ffi::tch_ext_cuda_event_record(self.raw, stream.id, index) };
        ffi::check(message, "CUDA event record")
    }

    /// Whether the work before the last record has finished (true if never recorded).
    ///
    /// # Errors
    ///
    /// [`TchExtError::Torch`] for a CUDA error.
    pub fn query(&self) -> Result<bool, TchExtError> {
        let mut done = false;
        // SAFETY: `self.raw` is the live `c10::Event*` this value owns; `done` is a valid
        // out-pointer for the call.
        let message = unsafe { ffi::tch_ext_cuda_event_query(self.raw, &mut done) };
        ffi::check(message, "CUDA event query").map(|()| done)
    }

    /// Blocks the calling thread until the work before the last record has finished.
    ///
    /// # Errors
    ///
    /// [`TchExtError::Torch`] for a CUDA error.
    pub fn synchronize(&self) -> Result<(), TchExtError> {
        // SAFETY: `self.raw` is the live `c10::Event*` this value owns.
        let message = unsafe { ffi::tch_ext_cuda_event_synchronize(self.raw) };
        ffi::check(message, "CUDA event synchronize")
    }

    fn check_device(&self, stream: &CudaStream) -> Result<(), TchExtError> {
        if self.device == stream.device {
            Ok(())
        } else {
            Err(TchExtError::DeviceMismatch {
                event: self.device,
                stream: stream.device,
            })
        }
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: `self.raw` is the `c10::Event*` made for this value, freed exactly once.
        unsafe { ffi::tch_ext_cuda_event_free(self.raw) };
    }
}
