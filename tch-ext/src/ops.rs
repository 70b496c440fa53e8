//! In-place operations with a scalar factor, which tch's bindings lack (its `g_add_`,
//! `addcmul_` and `addcdiv_` take no `alpha` / `value`): the fused kernels PyTorch's
//! optimizers use, one rounding and no temporary tensor per call. And the fused unscale of
//! PyTorch's `GradScaler` over a whole list of gradients (tch binds it for one tensor).

use tch::Tensor;

use crate::ffi;
use crate::TchExtError;

/// `this += alpha * other` (PyTorch's `this.add_(other, alpha=alpha)`).
///
/// # Errors
///
/// [`TchExtError::Torch`] when the shapes do not broadcast into `this`, or the dtypes or
/// devices do not fit.
pub fn add_(this: &mut Tensor, other: &Tensor, alpha: f64) -> Result<(), TchExtError> {
    // SAFETY: both are live tch tensors (`torch::Tensor*`) for the duration of the call; the
    // `&mut` borrow keeps this handle from being used meanwhile.
    let message =
        unsafe { ffi::tch_ext_add_(this.as_mut_ptr().cast(), other.as_ptr().cast(), alpha) };
    ffi::check(message, "add_")
}

/// `this += value * a * b` (PyTorch's `this.addcmul_(a, b, value=value)`).
///
/// # Errors
///
/// As [`add_`].
pub fn addcmul_(this: &mut Tensor, a: &Tensor, b: &Tensor, value: f64) -> Result<(), TchExtError> {
    // SAFETY: as in `add_`.
    let message = unsafe {
        ffi::tch_ext_addcmul_(
            this.as_mut_ptr().cast(),
            a.as_ptr().cast(),
            b.as_ptr().cast(),
            value,
        )
    };
    ffi::check(message, "addcmul_")
}

/// `this += value * a / b` (PyTorch's `this.addcdiv_(a, b, value=value)`).
///
/// # Errors
///
/// As [`add_`].
pub fn addcdiv_(this: &mut Tensor, a: &Tensor, b: &Tensor, value: f64) -> Result<(), TchExtError> {
    // SAFETY: as in `add_`.
    let message = unsafe {
        ffi::tch_ext_addcdiv_(
            this.as_mut_ptr().cast(),
            a.as_ptr().cast(),
            b.as_ptr().cast(),
            value,
        )
    };
    ffi::check(message, "addcdiv_")
}

/// PyTorch's `torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
/// inv_scale)`: multiplies every tensor of `grads` by `inv_scale` in place and sets
/// `found_inf` to 1 if any of them holds an inf or NaN (it is left as it is otherwise), in
/// one fused pass on the device (CUDA: one multi-tensor kernel per chunk of tensors; libtorch
/// has a CPU kernel too). Nothing is read back to the host.
///
/// `found_inf` and `inv_scale` are one-element `f32` tensors on the device of `grads`, which
/// all share one device and one floating dtype (PyTorch's `GradScaler` groups them so).
///
/// # Errors
///
/// [`TchExtError::Torch`] when the tensors break those rules.
pub fn amp_foreach_non_finite_check_and_unscale_(
    grads: &mut [Tensor],
    found_inf: &mut Tensor,
    inv_scale: &Tensor,
) -> Result<(), TchExtError> {
    let handles: Vec<*const std::ffi::c_void> = grads.iter().map(|g| g.as_ptr().cast()).collect();
    // SAFETY: every pointer is a live tch tensor (`torch::Tensor*`) borrowed for the call (the
    // `&mut` borrows keep the handles from being used meanwhile); `handles` holds `grads.len()`
    // of them.
    let message = unsafe {
        ffi::tch_ext_amp_foreach_non_finite_check_and_unscale_(
            handles.as_ptr(),
            handles.len(),
            found_inf.as_mut_ptr().cast(),
            inv_scale.as_ptr().cast(),
        )
    };
    ffi::check(message, "_amp_foreach_non_finite_check_and_unscale_")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_operations_scale_in_place() {
        let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let before = t.data_ptr();
        add_(&mut t, &Tensor::from_slice(&[2.0f32, 4.0, 6.0]), -0.5).unwrap();
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [0.0, 0.0, 0.0]);
        let (a, b) = (
            Tensor::from_slice(&[1.0f32, 2.0, 3.0]),
            Tensor::from_slice(&[4.0f32, 4.0, 2.0]),
        );
        addcmul_(&mut t, &a, &b, 0.5).unwrap();
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [2.0, 4.0, 3.0]);
        addcdiv_(&mut t, &a, &b, -2.0).unwrap();
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [1.5, 3.0, 0.0]);
        assert_eq!(t.data_ptr(), before, "the operations must work in place");
        let err = add_(&mut t, &Tensor::from_slice(&[1.0f32, 2.0]), 1.0).unwrap_err();
        assert!(
            matches!(err, TchExtError::Torch(ref m) if m.starts_with("add_: ")),
            "{err}"
        );
    }

    #[test]
    fn the_fused_unscale_multiplies_every_gradient_and_flags_inf_and_nan() {
        use tch::{Device, Kind};
        let inv = Tensor::from_slice(&[0.25f32]);
        let mut found = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        let mut grads = vec![
            Tensor::from_slice(&[4.0f32, -8.0]),
            Tensor::from_slice(&[1.0f32, 2.0, 3.0]).view([3, 1]),
        ];
        let before = grads[0].data_ptr();
        amp_foreach_non_finite_check_and_unscale_(&mut grads, &mut found, &inv).unwrap();
        assert_eq!(Vec::<f32>::try_from(&grads[0]).unwrap(), [1.0, -2.0]);
        assert_eq!(
            Vec::<f32>::try_from(grads[1].flatten(0, -1)).unwrap(),
            [0.25, 0.5, 0.75]
        );
        assert_eq!(
            grads[0].data_ptr(),
            before,
            "the unscale must work in place"
        );
        assert_eq!(Vec::<f32>::try_from(&found).unwrap(), [0.0]);
        for bad in [f32::INFINITY, f32::NAN] {
            let mut found = Tensor::zeros([1], (Kind::Float, Device::Cpu));
            let mut grads = vec![Tensor::from_slice(&[1.0f32]), Tensor::from_slice(&[bad])];
            amp_foreach_non_finite_check_and_unscale_(&mut grads, &mut found, &inv).unwrap();
            assert_eq!(Vec::<f32>::try_from(&found).unwrap(), [1.0], "{bad}");
        }
        let mut wrong = Tensor::zeros([1], (Kind::Double, Device::Cpu));
        let err =
            amp_foreach_non_finite_check_and_unscale_(&mut grads, &mut wrong, &inv).unwrap_err();
        assert!(
            matches!(err, TchExtError::Torch(ref m)
                if m.starts_with("_amp_foreach_non_finite_check_and_unscale_: ")),
            "{err}"
        );
    }
}
