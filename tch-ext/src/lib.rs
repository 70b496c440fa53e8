//! What tch lacks for a PyTorch-grade data-parallel trainer, as a small C++ shim over the
//! same libtorch: post-accumulate-grad hooks, autocast with a chosen dtype, CUDA streams and
//! events, and in-place operations with a scalar factor.
//!
//! - [`set_post_accumulate_grad_hook`] runs a closure each time autograd has accumulated a
//!   gradient into a parameter (PyTorch's `register_post_accumulate_grad_hook`), so gradient
//!   communication can start while backward is still running; [`set_grad`] is
//!   `param.grad = None`; [`tensor_id`] tells tensor objects apart (a tied weight is one).
//! - [`set_backward`] gives a result computed outside autograd a backward function written
//!   in Rust (PyTorch's `torch.autograd.Function`), e.g. a differentiable all-reduce.
//! - [`autocast`] returns an [`AutocastGuard`]: mixed precision in `BFloat16` or `Half` on CPU
//!   or CUDA until it is dropped (`with torch.autocast(device, dtype)`); [`with_autocast`]
//!   runs a closure so.
//! - [`CudaStream`], [`CudaEvent`] and [`set_current_stream`] order work between streams,
//!   e.g. to run gradient all-reduces on a side stream; [`record_stream`] keeps the caching
//!   allocator from reusing a tensor's memory before another stream is done with it.
//! - [`add_`], [`addcmul_`], [`addcdiv_`]: in-place operations with a scalar factor, the
//!   fused kernels PyTorch's optimizers are written with;
//!   [`amp_foreach_non_finite_check_and_unscale_`], `GradScaler`'s fused unscale of a list
//!   of gradients; [`foreach_adam_`] and [`foreach_sgd_`], optimizer steps over lists of
//!   tensors; [`foreach_norm_stacked`] and [`foreach_mul_tensor_`], gradient clipping's.
//! - [`torch_version`]: the libtorch version it is compiled against, for processes to compare.
//!
//! The C++ side (`csrc/`) is a narrow `extern "C"` surface: every entry point catches all
//! exceptions and returns an error string, which becomes [`TchExtError`]; no C++ exception or
//! Rust panic crosses the boundary.
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::sync::Arc;
//! use tch::{Kind, Tensor};
//! use tch_ext::{autocast, set_post_accumulate_grad_hook, AutocastDevice};
//!
//! # fn main() -> Result<(), tch_ext::TchExtError> {
//! let w = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
//! let calls = Arc::new(AtomicUsize::new(0));
//! let seen = Arc::clone(&calls);
//! set_post_accumulate_grad_hook(&w, move |p| {
//!     assert_eq!(Vec::<f32>::try_from(p.grad()).unwrap(), [3.0, 4.0]);
//!     seen.fetch_add(1, Ordering::Relaxed);
//! })?;
//! (&w * Tensor::from_slice(&[3.0f32, 4.0])).sum(Kind::Float).backward();
//! assert_eq!(calls.load(Ordering::Relaxed), 1);
//!
//! let a = Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu));
//! {
//!     let _bf16 = autocast(AutocastDevice::Cpu, Kind::BFloat16)?;
//!     assert_eq!(a.matmul(&a).kind(), Kind::BFloat16);
//! }
//! assert_eq!(a.matmul(&a).kind(), Kind::Float);
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

mod autocast;
mod cuda;
mod error;
mod ffi;
mod function;
mod graph;
mod hooks;
mod ops;

pub use autocast::{
    autocast, autocast_dtype, is_autocast_cache_enabled, is_autocast_enabled,
    set_autocast_cache_enabled, with_autocast, AutocastDevice, AutocastGuard,
};
pub use cuda::{
    cuda_device_count, cuda_is_available, record_current_stream, record_stream, set_current_stream,
    CudaEvent, CudaStream, StreamGuard,
};
pub use error::TchExtError;
pub use function::set_backward;
pub use graph::reachable_leaves;
pub use hooks::{
    clear_post_accumulate_grad_hook, has_post_accumulate_grad_hook,
    set_fallible_post_accumulate_grad_hook, set_grad, set_post_accumulate_grad_hook, tensor_id,
};
pub use ops::{
    add_, addcdiv_, addcmul_, amp_foreach_non_finite_check_and_unscale_, foreach_adam_,
    foreach_mul_tensor_, foreach_norm_stacked, foreach_sgd_, storage_use_count, AdamHyper,
};

/// The version of the libtorch this crate was compiled against, as its headers name it
/// (`TORCH_VERSION`, `"2.13.0"`): processes built against another libtorch version say
/// another; a CPU and a CUDA build of one version say the same.
pub fn torch_version() -> &'static str {
    // SAFETY: the shim returns a pointer to a NUL-terminated string literal, which lives as
    // long as the process.
    let version = unsafe { std::ffi::CStr::from_ptr(ffi::tch_ext_torch_version()) };
    version.to_str().unwrap_or("(not UTF-8)")
}

#[cfg(test)]
mod tests {
    include!("../../shared-src/torch_version.rs");

    /// The headers' version is the one the workspace installs.
    #[test]
    fn the_torch_version_is_the_headers() {
        assert_eq!(super::torch_version(), TORCH_VERSION);
    }
}
