//! Page-locked ring slots and copy-completion events, through the CUDA runtime that
//! `nccl-sys` loads (the same `libcudart` libtorch uses).
//!
//! A slot is plain heap memory on whole pages of the operating system's size, registered
//! once with `cudaHostRegister`, so every copy out of it can be asynchronous; it is
//! unregistered when the slot is freed. After a batch's copies are issued, an event is
//! recorded behind them on the consumer thread's current stream (libtorch's, as tch-ext reads
//! it: where the copies were queued) and becomes the slot's reuse hook:
//! the worker that next takes the slot waits for that event (without the ring's lock) before
//! writing into it, and the ring waits for it before it frees the slot. If the event cannot
//! be recorded, the hook waits for the whole device instead.

use std::any::Any;
use std::ffi::{c_int, c_void, CStr};
use std::sync::Arc;

use nccl_sys::{cudaError_t, cudaEvent_t, Cudart};

use crate::error::DataError;
use crate::memory::{BatchMemory, HeapMemory, SlotAllocator, SlotRequest};
use crate::ring::ReuseHook;

fn runtime(call: &'static str) -> Result<&'static Cudart, DataError> {
    Cudart::load().map_err(|e| DataError::Cuda {
        call,
        message: e.to_string(),
    })
}

fn check(rt: &Cudart, call: &'static str, rc: cudaError_t) -> Result<(), DataError> {
    if rc == cudaError_t::cudaSuccess {
        return Ok(());
    }
    // SAFETY: cudaGetErrorString returns a static NUL-terminated string for any code.
    let text = unsafe { CStr::from_ptr((rt.cudaGetErrorString)(rc)) };
    Err(DataError::Cuda {
        call,
        message: format!("{} (error {})", text.to_string_lossy(), rc.0),
    })
}

/// Makes `device` current on the calling thread, so that later runtime calls (events,
/// registration) use its context and no other device's context is created.
fn set_device(rt: &Cudart, device: c_int) -> Result<(), DataError> {
    // SAFETY: plain runtime call with a value argument.
    check(rt, "cudaSetDevice", unsafe { (rt.cudaSetDevice)(device) })
}

/// Runs `f` with `device` current on the calling thread, then makes the thread's own device
/// current again: for what a drop releases, on whichever thread drops it, so that no other
/// device's context is used (or made) for it and the thread's device is left as it was.
fn on_device<R>(rt: &Cudart, device: c_int, f: impl FnOnce() -> R) -> R {
    let mut previous: c_int = -1;
    // SAFETY: `previous` is a valid out-pointer.
    let known = unsafe { (rt.cudaGetDevice)(&mut previous) } == cudaError_t::cudaSuccess;
    let switch = !known || previous != device;
    if switch {
        // An error cannot be reported from a drop; the call that follows reports its own.
        let _ = set_device(rt, device);
    }
    let r = f();
    if switch && known {
        let _ = set_device(rt, previous);
    }
    r
}

/// A ring slot in page-locked host memory.
#[derive(Debug)]
pub(crate) struct PinnedMemory {
    heap: HeapMemory,
    rt: &'static Cudart,
    device: c_int,
}

impl Drop for PinnedMemory {
    /// Runs after the slot's last copy has completed: the ring runs a slot's pending reuse
    /// hook (the wait for its event) before it drops the slot's memory.
    fn drop(&mut self) {
        let regions = [
            self.heap.input.as_ptr(),
            self.heap.targets.as_ptr(),
            self.heap.lengths.as_ptr(),
        ];
        on_device(self.rt, self.device, || {
            for ptr in regions {
                // SAFETY: the three regions were registered in `PinnedAllocator::allocate`
                // and are unregistered once, before `heap` frees them. An error cannot be
                // reported from drop; the memory is freed either way.
                unsafe { (self.rt.cudaHostUnregister)(ptr.cast::<c_void>()) };
            }
        });
    }
}

// SAFETY: the regions are `HeapMemory`'s, owned by this value and freed only when it drops
// (after unregistering).
unsafe impl BatchMemory for PinnedMemory {
    fn input_ptr(&self) -> *mut u8 {
        self.heap.input.as_ptr()
    }

    fn targets_ptr(&self) -> *mut u8 {
        self.heap.targets.as_ptr()
    }

    fn lengths_ptr(&self) -> *mut i64 {
        self.heap.lengths.as_ptr().cast()
    }

    fn capacities(&self) -> [usize; 3] {
        self.heap.capacities()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Allocates page-locked slots for copies to CUDA device `device`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PinnedAllocator {
    pub device: c_int,
}

impl SlotAllocator for PinnedAllocator {
    fn allocate(&self, request: &SlotRequest) -> Result<Box<dyn BatchMemory>, DataError> {
        let rt = runtime("cudaHostRegister")?;
        set_device(rt, self.device)?;
        let heap = HeapMemory::new(request)?;
        let regions = [
            (heap.input.as_ptr(), heap.input.capacity()),
            (heap.targets.as_ptr(), heap.targets.capacity()),
            (heap.lengths.as_ptr(), heap.lengths.capacity()),
        ];
        for (k, &(ptr, len)) in regions.iter().enumerate() {
            // SAFETY: `ptr..ptr + len` is a live allocation owned by `heap` (whole pages).
            let rc = unsafe {
                (rt.cudaHostRegister)(
                    ptr.cast::<c_void>(),
                    len,
                    nccl_sys::cudaHostRegisterPortable,
                )
            };
            if let Err(e) = check(rt, "cudaHostRegister", rc) {
                for &(done, _) in &regions[..k] {
                    // SAFETY: registered just above; undone before `heap` is freed.
                    unsafe { (rt.cudaHostUnregister)(done.cast::<c_void>()) };
                }
                return Err(e);
            }
        }
        Ok(Box::new(PinnedMemory {
            heap,
            rt,
            device: self.device,
        }))
    }
}

/// A CUDA event, destroyed when the last of the loader and the hooks that wait on it drops
/// (a hook may outlive the loader: the ring runs pending hooks before it frees a slot).
#[derive(Debug)]
struct Event {
    raw: cudaEvent_t,
    rt: &'static Cudart,
    device: c_int,
}

// SAFETY: a CUDA event handle may be used from any thread of the process.
unsafe impl Send for Event {}
// SAFETY: as above; the runtime's event calls are thread-safe.
unsafe impl Sync for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by `CopyEvents::record`, destroyed once, when nothing can wait on
        // it any more (every holder is gone).
        on_device(self.rt, self.device, || unsafe {
            (self.rt.cudaEventDestroy)(self.raw)
        });
    }
}

/// One reusable event per ring slot, recorded after the slot's copies.
#[derive(Debug)]
pub(crate) struct CopyEvents {
    device: c_int,
    rt: &'static Cudart,
    events: Vec<Option<Arc<Event>>>,
}

impl CopyEvents {
    pub fn new(device: c_int) -> Result<Self, DataError> {
        Ok(Self {
            device,
            rt: runtime("cudaEventCreateWithFlags")?,
            events: Vec::new(),
        })
    }

    /// Makes the loader's device current on the calling (consumer) thread.
    pub fn make_current(&self) -> Result<(), DataError> {
        set_device(self.rt, self.device)
    }

    /// Records slot `slot`'s event on the calling thread's current stream of the device,
    /// behind the copies just issued there, and returns the hook that waits for it before the
    /// slot is reused.
    pub fn record(&mut self, slot: usize) -> Result<ReuseHook, DataError> {
        let rt = self.rt;
        let stream =
            tch_ext::CudaStream::current(self.device as usize).map_err(|e| DataError::Cuda {
                call: "current CUDA stream",
                message: e.to_string(),
            })?;
        if self.events.len() <= slot {
            self.events.resize(slot + 1, None);
        }
        let event = match &self.events[slot] {
            Some(e) => Arc::clone(e),
            None => {
                let mut raw: cudaEvent_t = std::ptr::null_mut();
                // SAFETY: `raw` is a valid out-pointer; the event belongs to the current
                // device (made current by `make_current`).
                let rc = unsafe {
                    (rt.cudaEventCreateWithFlags)(
                        &mut raw,
                        nccl_sys::cudaEventDisableTiming | nccl_sys::cudaEventBlockingSync,
                    )
                };
                check(rt, "cudaEventCreateWithFlags", rc)?;
                let e = Arc::new(Event {
                    raw,
                    rt,
                    device: self.device,
                });
                self.events[slot] = Some(Arc::clone(&e));
                e
            }
        };
        // SAFETY: a live event of the current device, and the stream libtorch queued the
        // copies on (the thread's current stream: the null stream unless the program made
        // another current). The slot's previous recording has been waited for (its hook ran
        // before the slot was refilled), so re-recording loses nothing.
        let rc = unsafe { (rt.cudaEventRecord)(event.raw, stream.as_raw().cast()) };
        check(rt, "cudaEventRecord", rc)?;
        let device = self.device;
        Ok(Box::new(move || {
            // The waiting thread is a loader worker (or whoever drops the ring): make the
            // loader's device current first, so the wait does not create a context on
            // device 0.
            set_device(rt, device)?;
            // SAFETY: the hook holds the event, so it is alive.
            check(rt, "cudaEventSynchronize", unsafe {
                (rt.cudaEventSynchronize)(event.raw)
            })
        }))
    }

    /// The hook for a slot whose event could not be recorded after copies were (maybe)
    /// queued out of it: waits for all work on the device, those copies included.
    pub fn device_wait(&self) -> ReuseHook {
        let (rt, device) = (self.rt, self.device);
        Box::new(move || {
            set_device(rt, device)?;
            // SAFETY: plain runtime call; the device is current.
            check(rt, "cudaDeviceSynchronize", unsafe {
                (rt.cudaDeviceSynchronize)()
            })
        })
    }
}
