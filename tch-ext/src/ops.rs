//! In-place operations with a scalar factor, which tch's bindings lack (its `g_add_`,
//! `addcmul_` and `addcdiv_` take no `alpha` / `value`): the fused kernels PyTorch's
//! optimizers use, one rounding and no temporary tensor per call.

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
}
