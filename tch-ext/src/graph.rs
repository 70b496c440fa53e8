//! Which leaves a backward pass would reach: a walk over the autograd graph.

use std::ffi::c_void;

use tch::Tensor;

use crate::ffi;
use crate::TchExtError;

/// For each of `leaves`, whether `root.backward()` would accumulate a gradient into it: its
/// gradient accumulator is reachable from `root`'s `grad_fn` along the graph's edges. This is
/// the walk PyTorch's DDP makes over the outputs of a forward pass when
/// `find_unused_parameters` is on (`Reducer::search_unused_parameters`).
///
/// A `root` without `grad_fn` that requires grad (a leaf) reaches only itself; one that does
/// not require grad reaches nothing. A leaf that no graph alive uses has no accumulator and
/// is never reached. The answer is about the graph's structure: a node on the way may still
/// return an undefined gradient for an input at run time (then libtorch accumulates nothing
/// there), so `true` means "may get a gradient", `false` means "cannot get one from `root`".
/// The walk visits each node of the graph once.
///
/// # Errors
///
/// [`TchExtError::Torch`] when `root` or a leaf is undefined.
pub fn reachable_leaves(root: &Tensor, leaves: &[&Tensor]) -> Result<Vec<bool>, TchExtError> {
    let pointers: Vec<*const c_void> = leaves.iter().map(|t| t.as_ptr().cast()).collect();
    let mut reached = vec![false; leaves.len()];
    // SAFETY: `root` and every pointer in `pointers` are live tch tensors (`torch::Tensor*`)
    // borrowed for the call; `reached` has room for `pointers.len()` values. The shim keeps
    // none of the pointers.
    let message = unsafe {
        ffi::tch_ext_reachable_leaves(
            root.as_ptr().cast(),
            pointers.as_ptr(),
            pointers.len(),
            reached.as_mut_ptr(),
        )
    };
    ffi::check(message, "reachable_leaves").map(|()| reached)
}
