//! In-place operations with a scalar factor, which tch's bindings lack (its `g_add_`,
//! `addcmul_` and `addcdiv_` take no `alpha` / `value`): the fused kernels PyTorch's
//! optimizers use, one rounding and no temporary tensor per call. And the fused unscale of
//! PyTorch's `GradScaler` over a whole list of gradients (tch binds it for one tensor), and
//! Adam's and SGD's steps and clipping's norms and scaling over lists of tensors with the
//! `_foreach_*` kernels (tch binds none).

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

/// Adam's hyper-parameters for [`foreach_adam_`], as PyTorch's `Adam` and `AdamW` take them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamHyper {
    /// The learning rate.
    pub lr: f64,
    /// The first moment's decay.
    pub beta1: f64,
    /// The second moment's decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay: Adam's L2 term added to the gradients, or AdamW's decoupled decay.
    pub weight_decay: f64,
    /// AdamW: the parameters are multiplied by `1 - lr * weight_decay` instead.
    pub decoupled: bool,
}

/// One Adam step over lists of tensors, as PyTorch's `torch.optim.Adam(foreach=True)`
/// (`_multi_tensor_adam`, without `amsgrad` or `maximize`) computes it: for parameter `i`,
/// after its `steps[i]`-th gradient, `exp_avg.lerp_(grad, 1 - beta1)`,
/// `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)`, and
/// `param.addcdiv_(exp_avg, exp_avg_sq.sqrt() / sqrt(1 - beta2^t) + eps, -lr / (1 - beta1^t))`.
/// Each of those is one `_foreach_*` call for the whole list: on CUDA a handful of kernel
/// launches per step instead of several per parameter; on the CPU libtorch runs the same
/// per-tensor operations, so the result is the for-loop's, bit for bit.
///
/// # Errors
///
/// [`TchExtError::Torch`] when the lists differ in length, or when libtorch refuses the
/// tensors (shapes, dtypes or devices that do not fit together).
pub fn foreach_adam_(
    params: &mut [Tensor],
    grads: &[Tensor],
    exp_avgs: &mut [Tensor],
    exp_avg_sqs: &mut [Tensor],
    steps: &[i64],
    h: &AdamHyper,
) -> Result<(), TchExtError> {
    let n = params.len();
    let lengths = [grads.len(), exp_avgs.len(), exp_avg_sqs.len(), steps.len()];
    if lengths.iter().any(|&len| len != n) {
        return Err(TchExtError::Torch(format!(
            "foreach_adam_: {n} parameters, but {} gradients, {} first and {} second moments, \
             and {} step counts",
            lengths[0], lengths[1], lengths[2], lengths[3]
        )));
    }
    let neg_step_sizes: Vec<f64> = steps
        .iter()
        .map(|&t| -(h.lr / (1.0 - h.beta1.powf(t as f64))))
        .collect();
    let bias_correction2_sqrts: Vec<f64> = steps
        .iter()
        .map(|&t| (1.0 - h.beta2.powf(t as f64)).sqrt())
        .collect();
    // (L2 weight decay, the parameters' factor before the step).
    let (weight_decay, param_factor) = if h.weight_decay == 0.0 {
        (0.0, 1.0)
    } else if h.decoupled {
        (0.0, 1.0 - h.lr * h.weight_decay)
    } else {
        (h.weight_decay, 1.0)
    };
    let handles = |ts: &[Tensor]| -> Vec<*const std::ffi::c_void> {
        ts.iter().map(|t| t.as_ptr().cast()).collect()
    };
    let (p, g, m, v) = (
        handles(params),
        handles(grads),
        handles(exp_avgs),
        handles(exp_avg_sqs),
    );
    // SAFETY: every pointer is a live tch tensor (`torch::Tensor*`) borrowed for the call (the
    // `&mut` borrows keep the written handles from being used meanwhile); each list, and the
    // two scalar lists, hold `n` entries.
    let message = unsafe {
        ffi::tch_ext_foreach_adam_(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            n,
            neg_step_sizes.as_ptr(),
            bias_correction2_sqrts.as_ptr(),
            h.beta1,
            h.beta2,
            h.eps,
            weight_decay,
            param_factor,
        )
    };
    ffi::check(message, "foreach_adam_")
}

/// One SGD step over lists of tensors whose momentum buffers all exist, as PyTorch's
/// `torch.optim.SGD(foreach=True)` (`_multi_tensor_sgd`, without dampening, Nesterov or
/// `maximize`) computes it: `grad + weight_decay * param`, then with momentum
/// `buf.mul_(momentum).add_(grad)` and the buffer as the update, then
/// `param.add_(update, alpha=-lr)`, each one `_foreach_*` call for the whole list. Without
/// momentum `momentum_buffers` is empty. A parameter's first step, which makes its buffer
/// from its gradient, is the caller's (PyTorch too takes it one parameter at a time). On
/// the CPU the result is the for-loop's, bit for bit.
///
/// # Errors
///
/// [`TchExtError::Torch`] when the lists differ in length, or libtorch refuses the tensors.
pub fn foreach_sgd_(
    params: &mut [Tensor],
    grads: &[Tensor],
    momentum_buffers: &mut [Tensor],
    lr: f64,
    momentum: f64,
    weight_decay: f64,
) -> Result<(), TchExtError> {
    let n = params.len();
    let buffers = if momentum == 0.0 { 0 } else { n };
    if grads.len() != n || momentum_buffers.len() != buffers {
        return Err(TchExtError::Torch(format!(
            "foreach_sgd_: {n} parameters, but {} gradients and {} momentum buffers (expected \
             {buffers})",
            grads.len(),
            momentum_buffers.len()
        )));
    }
    let handles = |ts: &[Tensor]| -> Vec<*const std::ffi::c_void> {
        ts.iter().map(|t| t.as_ptr().cast()).collect()
    };
    let (p, g, b) = (handles(params), handles(grads), handles(momentum_buffers));
    // SAFETY: every pointer is a live tch tensor (`torch::Tensor*`) borrowed for the call (the
    // `&mut` borrows keep the written handles from being used meanwhile); `p` and `g` hold
    // `n` entries, and `b` too when the shim reads it (momentum not 0).
    let message = unsafe {
        ffi::tch_ext_foreach_sgd_(
            p.as_ptr(),
            g.as_ptr(),
            b.as_ptr(),
            n,
            lr,
            momentum,
            weight_decay,
        )
    };
    ffi::check(message, "foreach_sgd_")
}

/// The `ord`-norm of each tensor, stacked into one 1-D tensor in their order:
/// `torch.stack(torch._foreach_norm(tensors, ord))`, which `clip_grad_norm_` takes on devices
/// with foreach kernels (CUDA's is one multi-tensor kernel, whose sums round differently from
/// one `norm()` per tensor; the CPU's is `linalg_vector_norm` per tensor). The tensors must
/// share a device.
///
/// # Errors
///
/// [`TchExtError::Torch`] for an empty list, or when libtorch refuses the tensors.
pub fn foreach_norm_stacked(tensors: &[Tensor], ord: f64) -> Result<Tensor, TchExtError> {
    let handles: Vec<*const std::ffi::c_void> = tensors.iter().map(|t| t.as_ptr().cast()).collect();
    let mut out = Tensor::new();
    // SAFETY: every pointer is a live tch tensor borrowed for the call, `handles` holds
    // `tensors.len()` of them, and `out` is a tensor of our own that the shim assigns.
    let message = unsafe {
        ffi::tch_ext_foreach_norm_stacked(
            handles.as_ptr(),
            handles.len(),
            ord,
            out.as_mut_ptr().cast(),
        )
    };
    ffi::check(message, "foreach_norm_stacked")?;
    Ok(out)
}

/// Each tensor times the 0-dimensional tensor `factor`, in place: `torch._foreach_mul_(tensors,
/// factor)`, as `clip_grad_norm_` scales the gradients. The result of each is `mul_`'s.
///
/// # Errors
///
/// [`TchExtError::Torch`] when libtorch refuses the tensors (devices or dtypes that do not
/// fit, a `factor` that is not 0-dimensional).
pub fn foreach_mul_tensor_(tensors: &mut [Tensor], factor: &Tensor) -> Result<(), TchExtError> {
    let handles: Vec<*const std::ffi::c_void> = tensors.iter().map(|t| t.as_ptr().cast()).collect();
    // SAFETY: every pointer is a live tch tensor borrowed for the call (the `&mut` borrow keeps
    // the written handles from being used meanwhile), and `handles` holds `tensors.len()`.
    let message = unsafe {
        ffi::tch_ext_foreach_mul_tensor_(handles.as_ptr(), handles.len(), factor.as_ptr().cast())
    };
    ffi::check(message, "foreach_mul_tensor_")
}

/// How many tensors hold `t`'s storage: `t` itself, each view of it (`narrow`, `view`,
/// slices), and each tensor autograd saved for a backward pass; `shallow_clone`s share one
/// count. 0 for an undefined tensor. A buffer whose count is 1 in its owner's hands is
/// referenced nowhere else.
///
/// # Errors
///
/// [`TchExtError::Torch`] when libtorch refuses (a tensor without storage, such as a sparse
/// one).
pub fn storage_use_count(t: &Tensor) -> Result<usize, TchExtError> {
    let mut count = 0usize;
    // SAFETY: `t` is a live tch tensor during the call; the shim writes one `size_t`.
    let message = unsafe { ffi::tch_ext_storage_use_count(t.as_ptr().cast(), &mut count) };
    ffi::check(message, "storage_use_count")?;
    Ok(count)
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

    #[test]
    fn foreach_norms_and_scaling_are_the_per_tensor_ones() {
        let mut ts = vec![
            Tensor::from_slice(&[3.0f32, 4.0]),
            Tensor::from_slice(&[1.0f32, -2.0, 2.0]).view([3, 1]),
        ];
        let norms = foreach_norm_stacked(&ts, 2.0).unwrap();
        assert_eq!(Vec::<f32>::try_from(&norms).unwrap(), [5.0, 3.0]);
        let l1 = foreach_norm_stacked(&ts, 1.0).unwrap();
        assert_eq!(Vec::<f32>::try_from(&l1).unwrap(), [7.0, 5.0]);
        let before = ts[1].data_ptr();
        foreach_mul_tensor_(&mut ts, &Tensor::from(0.5f32)).unwrap();
        assert_eq!(Vec::<f32>::try_from(&ts[0]).unwrap(), [1.5, 2.0]);
        assert_eq!(
            Vec::<f32>::try_from(ts[1].flatten(0, -1)).unwrap(),
            [0.5, -1.0, 1.0]
        );
        assert_eq!(ts[1].data_ptr(), before, "the scaling must work in place");
        let err = foreach_norm_stacked(&[], 2.0).unwrap_err();
        assert!(
            matches!(err, TchExtError::Torch(ref m) if m.starts_with("foreach_norm_stacked: ")),
            "{err}"
        );
        let two = Tensor::from_slice(&[1.0f32, 2.0]);
        let err = foreach_mul_tensor_(&mut ts, &two).unwrap_err();
        assert!(
            matches!(err, TchExtError::Torch(ref m) if m.starts_with("foreach_mul_tensor_: ")),
            "{err}"
        );
    }

    /// The per-parameter Adam step `foreach_adam_` stands for, op by op.
    fn adam_one(p: &mut Tensor, g: &Tensor, m: &mut Tensor, v: &mut Tensor, t: i64, h: &AdamHyper) {
        let _guard = tch::no_grad_guard();
        let mut g = g.copy();
        if h.weight_decay != 0.0 {
            if h.decoupled {
                let _ = p.g_mul_scalar_(1.0 - h.lr * h.weight_decay);
            } else {
                add_(&mut g, p, h.weight_decay).unwrap();
            }
        }
        let _ = m.lerp_(&g, 1.0 - h.beta1);
        let _ = v.g_mul_scalar_(h.beta2);
        addcmul_(v, &g, &g, 1.0 - h.beta2).unwrap();
        let step_size = h.lr / (1.0 - h.beta1.powf(t as f64));
        let mut denom = v.sqrt() / (1.0 - h.beta2.powf(t as f64)).sqrt();
        let _ = denom.g_add_scalar_(h.eps);
        addcdiv_(p, m, &denom, -step_size).unwrap();
    }

    /// On the CPU the foreach step is the per-parameter step, bit for bit, for parameters at
    /// different step counts, with L2 and with decoupled weight decay; lists of different
    /// lengths are refused.
    #[test]
    fn the_foreach_adam_step_is_the_per_parameter_step() {
        use tch::{Device, Kind};
        let opts = (Kind::Float, Device::Cpu);
        tch::manual_seed(3);
        for (weight_decay, decoupled) in [(0.0, false), (0.1, false), (0.1, true)] {
            let h = AdamHyper {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay,
                decoupled,
            };
            let shapes: [&[i64]; 3] = [&[4, 3], &[7], &[2, 2, 2]];
            let make =
                || -> Vec<Tensor> { shapes.iter().map(|s| Tensor::randn(*s, opts)).collect() };
            let (params, grads, moments, squares) = (
                make(),
                make(),
                make(),
                make().iter().map(Tensor::abs).collect::<Vec<_>>(),
            );
            let steps = [1i64, 5, 30];
            let copies = |ts: &[Tensor]| -> Vec<Tensor> { ts.iter().map(Tensor::copy).collect() };
            let (mut p1, mut m1, mut v1) = (copies(&params), copies(&moments), copies(&squares));
            for k in 0..3 {
                adam_one(&mut p1[k], &grads[k], &mut m1[k], &mut v1[k], steps[k], &h);
            }
            let (mut p2, mut m2, mut v2) = (copies(&params), copies(&moments), copies(&squares));
            let before = p2[0].data_ptr();
            foreach_adam_(&mut p2, &grads, &mut m2, &mut v2, &steps, &h).unwrap();
            assert_eq!(p2[0].data_ptr(), before, "in place");
            for k in 0..3 {
                for (a, b, what) in [
                    (&p1[k], &p2[k], "param"),
                    (&m1[k], &m2[k], "exp_avg"),
                    (&v1[k], &v2[k], "exp_avg_sq"),
                ] {
                    assert!(
                        a.equal(b),
                        "{what} {k}, weight decay {weight_decay} decoupled {decoupled}"
                    );
                }
                assert!(!p2[k].equal(&params[k]), "param {k} moved");
            }
        }
        let mut one = vec![Tensor::zeros([2], opts)];
        let err = foreach_adam_(
            &mut one.iter().map(Tensor::copy).collect::<Vec<_>>(),
            &[],
            &mut one,
            &mut [],
            &[1],
            &AdamHyper {
                lr: 0.1,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.0,
                decoupled: false,
            },
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "foreach_adam_: 1 parameters, but 0 gradients, 1 first and 0 second moments, and 1 \
             step counts"
        );
    }

    /// On the CPU the foreach SGD step is the per-parameter step, bit for bit, with and
    /// without momentum and weight decay; a missing buffer list is refused.
    #[test]
    fn the_foreach_sgd_step_is_the_per_parameter_step() {
        use tch::{Device, Kind};
        let opts = (Kind::Float, Device::Cpu);
        tch::manual_seed(5);
        let _guard = tch::no_grad_guard();
        for (momentum, weight_decay) in [(0.0, 0.0), (0.9, 0.0), (0.9, 0.01), (0.0, 0.01)] {
            let shapes: [&[i64]; 2] = [&[3, 2], &[5]];
            let make =
                || -> Vec<Tensor> { shapes.iter().map(|s| Tensor::randn(*s, opts)).collect() };
            let (params, grads, buffers) = (make(), make(), make());
            let copies = |ts: &[Tensor]| -> Vec<Tensor> { ts.iter().map(Tensor::copy).collect() };
            let (mut p1, mut b1) = (copies(&params), copies(&buffers));
            for k in 0..2 {
                let mut g = grads[k].copy();
                if weight_decay != 0.0 {
                    add_(&mut g, &p1[k], weight_decay).unwrap();
                }
                let update = if momentum != 0.0 {
                    let _ = b1[k].g_mul_scalar_(momentum);
                    let _ = b1[k].g_add_(&g);
                    b1[k].shallow_clone()
                } else {
                    g
                };
                add_(&mut p1[k], &update, -0.1).unwrap();
            }
            let mut p2 = copies(&params);
            let mut b2 = if momentum != 0.0 {
                copies(&buffers)
            } else {
                Vec::new()
            };
            foreach_sgd_(&mut p2, &grads, &mut b2, 0.1, momentum, weight_decay).unwrap();
            for k in 0..2 {
                assert!(
                    p1[k].equal(&p2[k]),
                    "param {k}, momentum {momentum}, decay {weight_decay}"
                );
                assert!(!p2[k].equal(&params[k]), "param {k} moved");
                if momentum != 0.0 {
                    assert!(b1[k].equal(&b2[k]), "buffer {k}, decay {weight_decay}");
                }
            }
        }
        let mut one = vec![Tensor::zeros([2], opts)];
        let grads = [Tensor::ones([2], opts)];
        let err = foreach_sgd_(&mut one, &grads, &mut [], 0.1, 0.9, 0.0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "foreach_sgd_: 1 parameters, but 1 gradients and 0 momentum buffers (expected 1)"
        );
    }

    #[test]
    fn the_storage_count_follows_views_clones_and_saved_tensors() {
        let t = Tensor::zeros([4], (tch::Kind::Float, tch::Device::Cpu));
        assert_eq!(storage_use_count(&t).unwrap(), 1);
        let view = t.narrow(0, 1, 2);
        let same = t.shallow_clone();
        assert_eq!(storage_use_count(&t).unwrap(), 2);
        drop(view);
        drop(same);
        assert_eq!(storage_use_count(&t).unwrap(), 1);
        // A product with a parameter saves its input for the backward pass.
        let w = Tensor::ones([2], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let loss = (t.narrow(0, 0, 2) * &w).sum(tch::Kind::Float);
        assert_eq!(storage_use_count(&t).unwrap(), 2);
        drop(loss);
        assert_eq!(storage_use_count(&t).unwrap(), 1);
        assert_eq!(storage_use_count(&Tensor::new()).unwrap(), 0);
    }
}
