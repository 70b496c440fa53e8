//! The shim's `extern "C"` surface (`csrc/*.cpp`) and the conversion of its error strings.
//!
//! Every function returning `*mut c_char` returns null on success and otherwise an error
//! message to be released with [`tch_ext_free_error`]; [`check`] does both. Tensor pointers
//! are tch's `*mut C_tensor`, which torch-sys's wrapper defines as `torch::Tensor*`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::TchExtError;

/// Calls the closure behind `ctx` with a new tensor handle it owns; false when it failed
/// (its message stored into `error`) or panicked. See `csrc/hooks.cpp`.
pub(crate) type HookCallFn =
    extern "C" fn(ctx: *mut c_void, param: *mut c_void, error: *mut c_void) -> bool;
/// Drops the closure behind `ctx`.
pub(crate) type HookDropFn = extern "C" fn(ctx: *mut c_void);

/// Calls a backward closure on a new gradient handle it owns; see `csrc/function.cpp`.
pub(crate) type BackwardCallFn = extern "C" fn(
    ctx: *mut c_void,
    grad: *mut c_void,
    result: *mut c_void,
    error: *mut c_void,
) -> bool;

extern "C" {
    pub(crate) fn tch_ext_free_error(message: *mut c_char);
    pub(crate) fn tch_ext_torch_version() -> *const c_char;

    pub(crate) fn tch_ext_set_backward(
        input: *const c_void,
        output: *const c_void,
        call: BackwardCallFn,
        ctx: *mut c_void,
        drop: HookDropFn,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_slot_set(slot: *mut c_void, tensor: *const c_void);
    pub(crate) fn tch_ext_message_set(sink: *mut c_void, text: *const c_char, len: usize);

    pub(crate) fn tch_ext_set_post_acc_grad_hook(
        param: *const c_void,
        call: HookCallFn,
        ctx: *mut c_void,
        drop: HookDropFn,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_clear_post_acc_grad_hook(param: *const c_void) -> *mut c_char;
    pub(crate) fn tch_ext_has_post_acc_grad_hook(
        param: *const c_void,
        out: *mut bool,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_set_grad(param: *const c_void, grad: *const c_void) -> *mut c_char;
    pub(crate) fn tch_ext_tensor_id(t: *const c_void, out: *mut usize) -> *mut c_char;

    pub(crate) fn tch_ext_add_(this: *mut c_void, other: *const c_void, alpha: f64) -> *mut c_char;
    pub(crate) fn tch_ext_addcmul_(
        this: *mut c_void,
        a: *const c_void,
        b: *const c_void,
        value: f64,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_addcdiv_(
        this: *mut c_void,
        a: *const c_void,
        b: *const c_void,
        value: f64,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_amp_foreach_non_finite_check_and_unscale_(
        grads: *const *const c_void,
        n: usize,
        found_inf: *mut c_void,
        inv_scale: *const c_void,
    ) -> *mut c_char;
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn tch_ext_foreach_adam_(
        params: *const *const c_void,
        grads: *const *const c_void,
        exp_avgs: *const *const c_void,
        exp_avg_sqs: *const *const c_void,
        n: usize,
        neg_step_sizes: *const f64,
        bias_correction2_sqrts: *const f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        param_factor: f64,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_foreach_sgd_(
        params: *const *const c_void,
        grads: *const *const c_void,
        momentum_buffers: *const *const c_void,
        n: usize,
        lr: f64,
        momentum: f64,
        weight_decay: f64,
    ) -> *mut c_char;

    pub(crate) fn tch_ext_foreach_norm_stacked(
        tensors: *const *const c_void,
        n: usize,
        ord: f64,
        out: *mut c_void,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_foreach_mul_tensor_(
        tensors: *const *const c_void,
        n: usize,
        factor: *const c_void,
    ) -> *mut c_char;

    pub(crate) fn tch_ext_storage_use_count(t: *const c_void, out: *mut usize) -> *mut c_char;

    pub(crate) fn tch_ext_autocast_state(
        device: c_int,
        enabled: *mut bool,
        dtype: *mut c_int,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_autocast_enter(
        device: c_int,
        dtype: c_int,
        prev_enabled: *mut bool,
        prev_dtype: *mut c_int,
        prev_cache_enabled: *mut bool,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_autocast_exit(
        device: c_int,
        prev_enabled: bool,
        prev_dtype: c_int,
        prev_cache_enabled: bool,
        outermost: bool,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_autocast_cache_enabled(enabled: *mut bool) -> *mut c_char;
    pub(crate) fn tch_ext_set_autocast_cache_enabled(enabled: bool) -> *mut c_char;

    pub(crate) fn tch_ext_cuda_device_count() -> c_int;
    pub(crate) fn tch_ext_cuda_current_stream(
        device: c_int,
        id: *mut i64,
        raw: *mut *mut c_void,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_cuda_pool_stream(
        device: c_int,
        high_priority: bool,
        id: *mut i64,
        raw: *mut *mut c_void,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_cuda_exchange_stream(
        id: i64,
        device: c_int,
        previous: *mut i64,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_cuda_stream_synchronize(id: i64, device: c_int) -> *mut c_char;
    pub(crate) fn tch_ext_cuda_stream_query(id: i64, device: c_int, done: *mut bool)
        -> *mut c_char;
    pub(crate) fn tch_ext_cuda_event_new(device: c_int, out: *mut *mut c_void) -> *mut c_char;
    pub(crate) fn tch_ext_cuda_event_free(event: *mut c_void);
    pub(crate) fn tch_ext_cuda_event_record(
        event: *mut c_void,
        id: i64,
        device: c_int,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_cuda_stream_wait_event(
        id: i64,
        device: c_int,
        event: *mut c_void,
    ) -> *mut c_char;
    pub(crate) fn tch_ext_cuda_event_query(event: *mut c_void, done: *mut bool) -> *mut c_char;
    pub(crate) fn tch_ext_cuda_event_synchronize(event: *mut c_void) -> *mut c_char;
}

/// Turns a shim return value into a result, naming the operation `op` in the error, and
/// releases the message.
pub(crate) fn check(message: *mut c_char, op: &str) -> Result<(), TchExtError> {
    if message.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string from the shim, valid until freed.
    let text = unsafe { CStr::from_ptr(message) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: `message` came from the shim and is released exactly once, here.
    unsafe { tch_ext_free_error(message) };
    Err(TchExtError::Torch(format!("{op}: {text}")))
}

extern "C" {
    pub(crate) fn tch_ext_reachable_leaves(
        root: *const c_void,
        leaves: *const *const c_void,
        n: usize,
        reached: *mut bool,
    ) -> *mut c_char;
}

/// Hands a call-back's error `message` to the shim's `sink` (the call's `std::string`). The
/// shim takes an empty message for a panic, so an empty one is given words.
///
/// # Safety
///
/// `sink` must be the shim's message sink of the call in progress.
pub(crate) unsafe fn set_error(sink: *mut c_void, message: &str) {
    let message = if message.is_empty() {
        "(an error without a message)"
    } else {
        message
    };
    // SAFETY: `sink` is the call's sink (the caller's contract); the shim copies the bytes.
    unsafe { tch_ext_message_set(sink, message.as_ptr().cast(), message.len()) };
}

/// Runs `f` for a call-back of the shim, stopping any panic: `None` when it panicked. The
/// panic's payload is dropped here as well, under a second `catch_unwind`, because its
/// destructor may panic too (`panic_any` of a value whose `Drop` panics), and a panic must not
/// unwind out of an `extern "C"` function (that aborts the process); the payload of such a
/// second panic is leaked.
pub(crate) fn catch_panic<R>(f: impl FnOnce() -> R) -> Option<R> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(value) => Some(value),
        Err(payload) => {
            if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
                std::mem::forget(again);
            }
            None
        }
    }
}

extern "C" {
    pub(crate) fn tch_ext_cuda_record_stream(
        tensor: *const c_void,
        id: i64,
        device: c_int,
    ) -> *mut c_char;
}
