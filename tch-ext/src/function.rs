//! A backward function written in Rust, for an operation autograd cannot differentiate by
//! itself (PyTorch's `torch.autograd.Function`): a collective, say.

use std::ffi::c_void;

use tch::Tensor;

use crate::ffi;
use crate::TchExtError;

/// Makes `output` differentiable with respect to `input` with `backward` as its gradient:
/// autograd calls `backward(grad_output)` and passes what it returns on as the gradient of
/// `input`, which must have `input`'s shape, dtype and device.
///
/// `output` must have been computed from `input` without autograd (under `tch::no_grad`, or
/// from `input.detach()`), be a floating-point tensor, and be used only after this call.
/// When grad mode is off or `input` does not require grad, nothing is recorded and
/// `backward` is dropped.
///
/// `backward` runs on the thread that runs the backward pass (CPU tensors) or on autograd's
/// worker thread for the device (CUDA tensors), hence `Send + Sync`; for CUDA tensors with the
/// stream current that was current at the call to `set_backward`, on which the incoming
/// gradient is ready and the returned one must be. When it returns an error
/// or panics, the backward pass fails with that error (tch's `f_backward` returns it). It is
/// dropped with the graph that holds it.
///
/// ```
/// use tch::{Kind, Tensor};
///
/// # fn main() -> Result<(), tch_ext::TchExtError> {
/// let x = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
/// // The forward doubles; the backward triples, to show that it is the one that runs.
/// let y = tch::no_grad(|| &x * 2.0);
/// tch_ext::set_backward(&x, &y, |g| Ok(g * 3.0))?;
/// y.sum(Kind::Float).backward();
/// assert_eq!(Vec::<f32>::try_from(x.grad()).unwrap(), [3.0, 3.0]);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`TchExtError::Torch`] when a tensor is undefined, or `output` already requires grad or
/// is not of a floating-point dtype.
pub fn set_backward<F>(input: &Tensor, output: &Tensor, backward: F) -> Result<(), TchExtError>
where
    F: Fn(&Tensor) -> Result<Tensor, String> + Send + Sync + 'static,
{
    let ctx = Box::into_raw(Box::new(backward)).cast::<c_void>();
    // SAFETY: `input` and `output` are live tch tensors for the duration of the call. `ctx`
    // is a leaked `Box<F>`; the shim takes ownership of it on every path and calls
    // `drop_backward::<F>` exactly once, after its last `call_backward::<F>` returns.
    let message = unsafe {
        ffi::tch_ext_set_backward(
            input.as_ptr().cast(),
            output.as_ptr().cast(),
            call_backward::<F>,
            ctx,
            drop_backward::<F>,
        )
    };
    ffi::check(message, "set_backward")
}

/// The shim's call-back: runs the closure on the gradient, stopping any panic here.
extern "C" fn call_backward<F>(
    ctx: *mut c_void,
    grad: *mut c_void,
    result: *mut c_void,
    error: *mut c_void,
) -> bool
where
    F: Fn(&Tensor) -> Result<Tensor, String>,
{
    // SAFETY: the shim passes a heap `at::Tensor*` made for this call and gives up ownership;
    // the tch `Tensor` frees it when dropped below.
    let grad = unsafe { Tensor::from_ptr(grad.cast()) };
    // SAFETY: `ctx` is the `Box<F>` leaked in `set_backward`; the shim keeps it alive until
    // this call returns, and `F: Sync` allows calls from any thread.
    let f = unsafe { &*ctx.cast::<F>() };
    match ffi::catch_panic(|| f(&grad)) {
        Some(Ok(t)) => {
            // SAFETY: `result` is the shim's `at::Tensor` slot for this call; it copies the
            // handle (a new reference) while `t` is alive.
            unsafe { ffi::tch_ext_slot_set(result, t.as_ptr().cast()) };
            true
        }
        Some(Err(message)) => {
            // SAFETY: `error` is the shim's `std::string` for this call.
            unsafe { ffi::set_error(error, &message) };
            false
        }
        None => false,
    }
}

/// The shim's destructor call-back: drops the closure; a panic here aborts (it cannot be
/// reported through a C++ destructor).
extern "C" fn drop_backward<F>(ctx: *mut c_void) {
    // SAFETY: `ctx` is the `Box<F>` leaked in `set_backward`, and the shim calls this exactly
    // once, after the last call of the closure.
    let f = unsafe { Box::from_raw(ctx.cast::<F>()) };
    if ffi::catch_panic(move || drop(f)).is_none() {
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tch::Kind;

    #[test]
    fn an_error_of_the_backward_fails_the_backward_pass_with_its_message() {
        let x = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        let y = tch::no_grad(|| &x + 1.0);
        set_backward(&x, &y, |_| Err("the peer is gone".to_string())).unwrap();
        let e = (&y * 2.0).sum(Kind::Float).f_backward().unwrap_err();
        assert!(e.to_string().contains("the peer is gone"), "{e}");
    }

    /// Were the payload dropped outside `catch_unwind`, its destructor's panic would unwind
    /// out of the `extern "C"` call-back, which aborts the process: this test binary.
    #[test]
    fn a_panic_whose_payload_panics_on_drop_fails_the_backward_pass() {
        struct PanicsOnDrop;
        impl Drop for PanicsOnDrop {
            fn drop(&mut self) {
                panic!("the panic payload's destructor panics on purpose");
            }
        }
        let x = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        let y = tch::no_grad(|| &x + 1.0);
        set_backward(&x, &y, |_| std::panic::panic_any(PanicsOnDrop)).unwrap();
        assert!((&y * 2.0).sum(Kind::Float).f_backward().is_err());
    }

    #[test]
    fn the_closure_is_dropped_with_the_graph_or_at_once_without_grad() {
        struct Count(Arc<AtomicUsize>);
        impl Drop for Count {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let drops = Arc::new(AtomicUsize::new(0));
        let x = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        let y = tch::no_grad(|| x.copy());
        let count = Count(drops.clone());
        set_backward(&x, &y, move |g| {
            let _ = &count;
            Ok(g.copy())
        })
        .unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(y);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        let z = Tensor::from_slice(&[1.0f32]);
        let count = Count(drops.clone());
        set_backward(&z, &z.copy(), move |g| {
            let _ = &count;
            Ok(g.copy())
        })
        .unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 2, "no graph: dropped at once");
    }

    #[test]
    fn an_output_that_already_requires_grad_is_refused() {
        let x = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        let y = &x * 2.0;
        let e = set_backward(&x, &y, |g| Ok(g.copy())).unwrap_err();
        assert!(e.to_string().contains("without autograd"), "{e}");
    }
}
