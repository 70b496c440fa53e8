//! Autocast (automatic mixed precision) with a chosen dtype, for CPU and CUDA.

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
/// previous enabled flag and dtype and, when it closes the outermost autocast region of the
/// thread, clears autocast's cache of cast weights. Guards must be dropped in the reverse
/// order of their creation (let them go out of scope). Autocast state is thread-local, so the
/// guard is neither `Send` nor `Sync`: it must be dropped on the thread that made it.
#[derive(Debug)]
#[must_use = "autocast is disabled again when the guard is dropped"]
pub struct AutocastGuard {
    device: AutocastDevice,
    prev_enabled: bool,
    prev_dtype: c_int,
    /// Thread-local state: `!Send + !Sync`.
    _thread: PhantomData<*const ()>,
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
    let (mut prev_enabled, mut prev_dtype) = (false, 0);
    // SAFETY: plain values and two valid out-pointers for the duration of the call.
    let message = unsafe {
        ffi::tch_ext_autocast_enter(device.code(), code, &mut prev_enabled, &mut prev_dtype)
    };
    ffi::check(message, "autocast")?;
    Ok(AutocastGuard {
        device,
        prev_enabled,
        prev_dtype,
        _thread: PhantomData,
    })
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        // SAFETY: plain values; the shim restores the state saved by `autocast`.
        let message = unsafe {
            ffi::tch_ext_autocast_exit(self.device.code(), self.prev_enabled, self.prev_dtype)
        };
        // It cannot fail for a device code and dtype that `autocast` accepted; a drop has no
        // way to report an error anyway.
        let _ = ffi::check(message, "autocast exit");
    }
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
