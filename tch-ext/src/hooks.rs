//! Post-accumulate-grad hooks and `param.grad = ...`, the autograd pieces tch lacks.

use std::ffi::c_void;
use std::ptr;

use tch::Tensor;

use crate::ffi;
use crate::TchExtError;

/// Calls `f(param)` each time autograd has accumulated a gradient into `param.grad()`: once
/// per backward pass that reaches `param`, after the accumulation, with `param.grad()` holding
/// the sum so far. This is PyTorch's `Tensor.register_post_accumulate_grad_hook`, except that
/// a tensor holds at most one such hook: setting one replaces (and drops) the previous one.
///
/// `param` must be a leaf tensor that requires grad. The closure lives as long as the hook:
/// until [`clear_post_accumulate_grad_hook`], the next `set_post_accumulate_grad_hook` on the
/// same tensor, or the tensor's death (every handle to it dropped). A closure that owns a
/// handle to its own `param` therefore keeps the tensor alive for ever; capture something
/// else (an index, a channel) instead.
///
/// The hook runs on the thread that runs the backward pass (CPU tensors) or on autograd's
/// worker thread for the tensor's device (CUDA tensors), hence `Send + Sync`. For a CUDA
/// tensor the engine makes current, while the hook runs, the stream that was current when a
/// forward pass first used the parameter since its last backward (the stream of its
/// gradient accumulator): the gradient is ready on that stream. It may set or clear its own
/// hook. Setting or clearing a tensor's hook from another thread while a
/// backward pass is running through that tensor is a data race in libtorch itself (PyTorch
/// avoids it with the GIL): don't.
///
/// If `f` panics, the panic message is printed by the panic hook as usual, the panic stops at
/// the C++ boundary (so does a panic of the payload's own destructor), and the backward pass
/// fails with an error (tch's `f_backward` returns it, `backward` panics with it). A hook
/// that is meant to fail returns its error instead: [`set_fallible_post_accumulate_grad_hook`].
///
/// # Errors
///
/// [`TchExtError::Torch`] when `param` is undefined, not a leaf, or does not require grad.
pub fn set_post_accumulate_grad_hook<F>(param: &Tensor, f: F) -> Result<(), TchExtError>
where
    F: Fn(&Tensor) + Send + Sync + 'static,
{
    set_fallible_post_accumulate_grad_hook(param, move |p| {
        f(p);
        Ok(())
    })
}

/// [`set_post_accumulate_grad_hook`] with a hook that can fail the backward pass, as a
/// PyTorch hook that raises does: when `f` returns an error, the backward pass stops with
/// that message (tch's `f_backward` returns it, `backward` panics with it). The gradient of
/// `param` has been accumulated before; autograd stays usable.
///
/// # Errors
///
/// [`TchExtError::Torch`] when `param` is undefined, not a leaf, or does not require grad.
pub fn set_fallible_post_accumulate_grad_hook<F>(param: &Tensor, f: F) -> Result<(), TchExtError>
where
    F: Fn(&Tensor) -> Result<(), String> + Send + Sync + 'static,
{
    let ctx = Box::into_raw(Box::new(f)).cast::<c_void>();
    // SAFETY: `param` is a live tch tensor (a `torch::Tensor*`) for the duration of the call.
    // `ctx` is a leaked `Box<F>`; the shim takes ownership of it on every path and calls
    // `drop_hook::<F>` exactly once, after its last `call_hook::<F>` returns.
    let message = unsafe {
        ffi::tch_ext_set_post_acc_grad_hook(
            param.as_ptr().cast(),
            call_hook::<F>,
            ctx,
            drop_hook::<F>,
        )
    };
    ffi::check(message, "set_post_accumulate_grad_hook")
}

/// Removes `param`'s post-accumulate-grad hook, dropping its closure; a no-op when it has none.
///
/// # Errors
///
/// [`TchExtError::Torch`] when `param` is undefined.
pub fn clear_post_accumulate_grad_hook(param: &Tensor) -> Result<(), TchExtError> {
    // SAFETY: `param` is a live tch tensor for the duration of the call.
    let message = unsafe { ffi::tch_ext_clear_post_acc_grad_hook(param.as_ptr().cast()) };
    ffi::check(message, "clear_post_accumulate_grad_hook")
}

/// Whether `param` has a post-accumulate-grad hook.
///
/// # Errors
///
/// [`TchExtError::Torch`] when `param` is undefined.
pub fn has_post_accumulate_grad_hook(param: &Tensor) -> Result<bool, TchExtError> {
    let mut out = false;
    // SAFETY: `param` is a live tch tensor and `out` a valid out-pointer during the call.
    let message = unsafe { ffi::tch_ext_has_post_acc_grad_hook(param.as_ptr().cast(), &mut out) };
    ffi::check(message, "has_post_accumulate_grad_hook").map(|()| out)
}

/// Sets `param.grad()` to `grad` (which it then aliases, as in PyTorch), or with `None`
/// resets it to an undefined tensor: PyTorch's `param.grad = None`, which optimizers use to
/// zero gradients "to none" so that the next backward pass writes instead of adding.
///
/// # Errors
///
/// [`TchExtError::Torch`] when `param` is undefined, `grad` is `param` itself (a handle to
/// the same tensor, such as its `shallow_clone`; `detach()` gives another tensor and is
/// accepted), or `grad` differs from it in dtype, device, shape, or layout and backend
/// (dense, MKL-DNN, ...; a sparse gradient of a dense parameter is allowed): PyTorch's checks.
pub fn set_grad(param: &Tensor, grad: Option<&Tensor>) -> Result<(), TchExtError> {
    let grad = grad.map_or(ptr::null(), |g| g.as_ptr().cast());
    // SAFETY: `param` and, when non-null, `grad` are live tch tensors during the call; the
    // shim copies the `grad` handle (a new reference) and keeps neither pointer.
    let message = unsafe { ffi::tch_ext_set_grad(param.as_ptr().cast(), grad) };
    ffi::check(message, "set_grad")
}

/// One number per tensor object (libtorch's `TensorImpl`, a Python tensor object): equal for
/// every tch handle of one tensor (its `shallow_clone`s, which `VarStore` hands out, so a
/// tied weight registered under two names), different for views, copies and `detach()`;
/// 0 for an undefined tensor. PyTorch's `id(t)`, by which `module.parameters()` yields a
/// tied parameter once. Meaningful while a handle of the tensor lives: a later tensor may
/// reuse the number of a freed one.
pub fn tensor_id(t: &Tensor) -> usize {
    let mut out = 0usize;
    // SAFETY: `t` is a live tch tensor and `out` a valid out-pointer during the call.
    let message = unsafe { ffi::tch_ext_tensor_id(t.as_ptr().cast(), &mut out) };
    // Reading a pointer out of a handle cannot fail.
    ffi::check(message, "tensor_id").map_or(0, |()| out)
}

/// The shim's call-back: runs the closure on the parameter, stopping any panic here.
extern "C" fn call_hook<F>(ctx: *mut c_void, param: *mut c_void, error: *mut c_void) -> bool
where
    F: Fn(&Tensor) -> Result<(), String>,
{
    // SAFETY: the shim passes a heap `at::Tensor*` made for this call and gives up ownership;
    // the tch `Tensor` frees it when dropped below.
    let param = unsafe { Tensor::from_ptr(param.cast()) };
    // SAFETY: `ctx` is the `Box<F>` leaked in `set_fallible_post_accumulate_grad_hook`; the
    // shim keeps it alive until this call returns, and `F: Sync` allows calls from any thread.
    let f = unsafe { &*ctx.cast::<F>() };
    match ffi::catch_panic(|| f(&param)) {
        Some(Ok(())) => true,
        Some(Err(message)) => {
            // SAFETY: `error` is the shim's `std::string` for this call.
            unsafe { ffi::set_error(error, &message) };
            false
        }
        None => false,
    }
}

/// The shim's destructor call-back: drops the closure. A panic in a drop cannot be reported
/// through a C++ destructor, so it aborts the process.
extern "C" fn drop_hook<F>(ctx: *mut c_void) {
    // SAFETY: `ctx` is the `Box<F>` leaked in `set_fallible_post_accumulate_grad_hook`, and
    // the shim calls this exactly once, after the last call of the closure.
    let f = unsafe { Box::from_raw(ctx.cast::<F>()) };
    if ffi::catch_panic(move || drop(f)).is_none() {
        std::process::abort();
    }
}
