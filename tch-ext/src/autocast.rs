//! Autocast (automatic mixed precision) with a chosen dtype, for CPU and CUDA.

use std::cell::Cell;
use std::ffi::c_int;
use std::marker::PhantomData;

use tch::Kind;

use crate::ffi;
use crate::TchExtError;

/// The device type whose autocast state is set: libtorch keeps one per device type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AutocastDevice {
    /// Operations on CPU tensors (`AutocastCPU`).
    Cpu,
    /// Operations on CUDA tensors (`AutocastCUDA`).
    Cuda,
}

impl AutocastDevice {
    fn code(self) -> c_int {
        match self {
            AutocastDevice::Cpu => 0,
            AutocastDevice::Cuda => 1,
        }
    }
}

/// Autocast enabled on one device type for this thread, until dropped; made by [`autocast`].
///
/// Dropping it does what leaving Python's `with torch.autocast(...)` does: it restores the
/// previous enabled flag and dtype and the cache-enabled flag ([`is_autocast_cache_enabled`])
/// and, when it closes the outermost autocast region of the thread, clears autocast's cache
/// of cast weights, so that the next region casts weights updated in place since.
///
/// Guards are meant to be dropped in the reverse order of their creation (let them go out of
/// scope, or use [`with_autocast`]). Each thread keeps a stack of its open regions, so that
/// a guard dropped out of order, or one that is never dropped, cannot leave the state wrong:
/// dropping a guard closes its region and every region opened after it that is still open
/// (a guard passed to `std::mem::forget`, or one dropped later), restoring the state from
/// before its own region and clearing the cache if no region is left open. The later guards'
/// drops then do nothing. A forgotten guard with no region around it keeps autocast, and its
/// cache, on for the rest of the thread, as a Python `__enter__` without `__exit__` does.
///
/// Autocast state is thread-local, so the guard is neither `Send` nor `Sync`: it must be
/// dropped on the thread that made it.
#[derive(Debug)]
#[must_use = "autocast is disabled again when the guard is dropped"]
pub struct AutocastGuard {
    /// The region's entry in `REGIONS`.
    id: u64,
    /// Thread-local state: `!Send + !Sync`.
    _thread: PhantomData<*const ()>,
}

/// An open autocast region: what its guard restores when it closes.
#[derive(Debug, Clone, Copy)]
struct Region {
    id: u64,
    device: AutocastDevice,
    prev_enabled: bool,
    prev_dtype: c_int,
    prev_cache_enabled: bool,
}

thread_local! {
    /// The thread's open regions, the innermost last (a `Cell`, taken and put back, so that
    /// nothing here can panic on a borrow).
    static REGIONS: Cell<Vec<Region>> = const { Cell::new(Vec::new()) };
    /// The id of the thread's next region.
    static NEXT_ID: Cell<u64> = const { Cell::new(0) };
}

/// Enables autocast for `device` on this thread with `dtype` (`Kind::BFloat16` or
/// `Kind::Half`), as `torch.autocast(device, dtype)` does: eligible operations (matmul,
/// linear, convolutions, ...) on that device's tensors run in `dtype`, others in float32.
///
/// # Errors
///
/// [`TchExtError::AutocastDtype`] for any other dtype.
pub fn autocast(device: AutocastDevice, dtype: Kind) -> Result<AutocastGuard, TchExtError> {
    let code = match dtype {
        Kind::BFloat16 => 15,
        Kind::Half => 5,
        other => return Err(TchExtError::AutocastDtype(other)),
    };
    let (mut prev_enabled, mut prev_dtype, mut prev_cache_enabled) = (false, 0, true);
    // SAFETY: plain values and three valid out-pointers for the duration of the call.
    let message = unsafe {
        ffi::tch_ext_autocast_enter(
            device.code(),
            code,
            &mut prev_enabled,
            &mut prev_dtype,
            &mut prev_cache_enabled,
        )
    };
    ffi::check(message, "autocast")?;
    // A `Cell<u64>` has no destructor: its thread-local storage is never torn down.
    let id = NEXT_ID.with(|next| next.replace(next.get() + 1));
    let region = Region {
        id,
        device,
        prev_enabled,
        prev_dtype,
        prev_cache_enabled,
    };
    let recorded = REGIONS.try_with(|regions| {
        let mut open = regions.take();
        open.push(region);
        regions.set(open);
    });
    if recorded.is_err() {
        // The thread is exiting (its regions are destroyed): no region can be opened.
        close(&region, true);
        return Err(TchExtError::Torch(
            "autocast: called while the thread exits".into(),
        ));
    }
    Ok(AutocastGuard {
        id,
        _thread: PhantomData,
    })
}

/// Closes `region` in libtorch: restores the state it saved, and clears the cache when it is
/// the `outermost` open region.
fn close(region: &Region, outermost: bool) {
    // SAFETY: plain values; the shim restores the state saved by `autocast`.
    let message = unsafe {
        ffi::tch_ext_autocast_exit(
            region.device.code(),
            region.prev_enabled,
            region.prev_dtype,
            region.prev_cache_enabled,
            outermost,
        )
    };
    // It cannot fail for a device code and dtype that `autocast` accepted; a drop has no way
    // to report an error anyway.
    let _ = ffi::check(message, "autocast exit");
}

/// Runs `f` with autocast enabled for `device` in `dtype` on this thread, and restores the
/// state when `f` returns or panics: [`autocast`] as a scope, whose region, and any region
/// opened inside it, ends with `f`.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// use tch_ext::{with_autocast, AutocastDevice};
///
/// let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
/// let product = with_autocast(AutocastDevice::Cpu, Kind::BFloat16, || a.matmul(&a))?;
/// assert_eq!(product.kind(), Kind::BFloat16);
/// # Ok::<(), tch_ext::TchExtError>(())
/// ```
///
/// # Errors
///
/// [`TchExtError::AutocastDtype`] for a dtype other than `BFloat16` and `Half`; `f` does not
/// run.
pub fn with_autocast<R>(
    device: AutocastDevice,
    dtype: Kind,
    f: impl FnOnce() -> R,
) -> Result<R, TchExtError> {
    let _guard = autocast(device, dtype)?;
    Ok(f())
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // Thread-local storage being torn down has no regions left to close.
        let Ok((closed, outermost)) = REGIONS.try_with(|regions| {
            let mut open = regions.take();
            let closed = match open.iter().rposition(|r| r.id == self.id) {
                Some(at) => open.split_off(at),
                // Closed already, with a region opened before it.
                None => Vec::new(),
            };
            let outermost = open.is_empty();
            regions.set(open);
            (closed, outermost)
        }) else {
            return;
        };
        // Innermost first, as their guards' drops would have: the state ends as it was before
        // this guard's region, on every device type.
        for (i, region) in closed.iter().enumerate().rev() {
            close(region, outermost && i == 0);
        }
    }
}

/// Whether autocast caches, on this thread, the casts of leaf tensors that require grad (the
/// weights), so that a weight used several times in one region is cast once: PyTorch's
/// `torch.is_autocast_cache_enabled()`, on by default. The cache is cleared when the
/// outermost region closes.
pub fn is_autocast_cache_enabled() -> bool {
    let mut enabled = true;
    // SAFETY: a valid out-pointer for the duration of the call.
    let message = unsafe { ffi::tch_ext_autocast_cache_enabled(&mut enabled) };
    // Reading a thread-local flag cannot fail.
    ffi::check(message, "autocast cache state").map_or(true, |()| enabled)
}

/// Turns autocast's cache of cast weights on or off for this thread
/// (`torch.set_autocast_cache_enabled`), e.g. off for a region that updates weights in place
/// and uses them again. A guard restores, when dropped, the setting it found.
pub fn set_autocast_cache_enabled(enabled: bool) {
    // SAFETY: a plain value.
    let message = unsafe { ffi::tch_ext_set_autocast_cache_enabled(enabled) };
    // Setting a thread-local flag cannot fail.
    let _ = ffi::check(message, "set autocast cache");
}

/// Whether autocast is enabled for `device` on this thread.
pub fn is_autocast_enabled(device: AutocastDevice) -> bool {
    state(device).0
}

/// The dtype autocast uses (or would use) for `device` on this thread: libtorch's defaults
/// are `BFloat16` for CPU and `Half` for CUDA.
pub fn autocast_dtype(device: AutocastDevice) -> Kind {
    kind_of(state(device).1)
}

fn state(device: AutocastDevice) -> (bool, c_int) {
    let (mut enabled, mut dtype) = (false, 0);
    // SAFETY: a plain value and two valid out-pointers for the duration of the call.
    let message = unsafe { ffi::tch_ext_autocast_state(device.code(), &mut enabled, &mut dtype) };
    // The state of a known device type cannot fail to be read.
    match ffi::check(message, "autocast state") {
        Ok(()) => (enabled, dtype),
        Err(_) => (false, 6),
    }
}

/// The tch kind of a `c10::ScalarType` code (tch keeps its own conversion private).
fn kind_of(code: c_int) -> Kind {
    match code {
        5 => Kind::Half,
        7 => Kind::Double,
        15 => Kind::BFloat16,
        23 => Kind::Float8e5m2,
        24 => Kind::Float8e4m3fn,
        25 => Kind::Float8e5m2fnuz,
        26 => Kind::Float8e4m3fnuz,
        // Autocast dtypes are floating point; Float (6) and anything unknown read as Float.
        _ => Kind::Float,
    }
}
