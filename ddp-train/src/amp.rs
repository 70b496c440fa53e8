//! Mixed precision: [`Precision`] and [`GradScaler`].

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::TrainError;

/// The precision of the forward pass and the loss.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in fp32 (no autocast).
    #[default]
    Fp32,
    /// Autocast to bfloat16; no gradient scaling.
    Bf16,
    /// Autocast to IEEE half, with a [`GradScaler`].
    #[cfg_attr(
        feature = "cli",
        value(help = "Autocast to IEEE half, with a dynamic gradient scaler")
    )]
    Fp16,
}

impl Precision {
    /// The autocast dtype (`None` for fp32).
    pub fn autocast_kind(self) -> Option<Kind> {
        match self {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(Kind::BFloat16),
            Precision::Fp16 => Some(Kind::Half),
        }
    }

    /// Turns autocast on for `device` until the guard is dropped (`None` for fp32).
    pub fn autocast(self, device: Device) -> Result<Option<tch_ext::AutocastGuard>, TrainError> {
        let Some(kind) = self.autocast_kind() else {
            return Ok(None);
        };
        let on = match device {
            Device::Cuda(_) => tch_ext::AutocastDevice::Cuda,
            _ => tch_ext::AutocastDevice::Cpu,
        };
        tch_ext::autocast(on, kind)
            .map(Some)
            .map_err(|e| TrainError::Invalid(format!("--precision: {e}")))
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        })
    }
}

/// The scaler's state, saved in training checkpoints so that a resumed run scales as the
/// uninterrupted one would.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The current scale.
    pub scale: f64,
    /// Good steps in a row since the scale last changed.
    pub growth_tracker: u64,
    /// Steps skipped for inf/NaN gradients since the run began: per-step learning-rate
    /// schedules count them, as PyTorch's `scheduler.step()` after `scaler.step()` does.
    #[serde(default)]
    pub skipped_steps: u64,
}

/// Dynamic loss scaling for fp16, with PyTorch's `GradScaler` rules and defaults: initial
/// scale 2^16, growth factor 2, backoff factor 0.5, growth interval 2000.
///
/// Mixed precision: the [`Precision`] a model trains in and the [`GradScaler`] that keeps
/// fp16 gradients from underflowing (PyTorch's `torch.autocast` and `torch.amp.GradScaler`).
///
/// Weights, gradients and optimizer state stay in fp32 ("master weights"); only the forward
/// pass and the loss run under autocast, which casts each operation's inputs to bf16 or fp16
/// where libtorch's autocast lists say it is safe (matrix products, convolutions) and keeps
/// the rest in fp32 (losses, reductions). Autocast works on CPU and CUDA (`tch-ext`).
///
/// fp16's range is narrow, so small gradients vanish: the [`GradScaler`] multiplies the loss
/// by a large scale before backward and divides the gradients by it before the optimizer
/// (and before any clipping); a step whose gradients hold an inf or NaN is skipped and the
/// scale halved, and after `growth_interval` good steps in a row the scale doubles. The
/// scaler runs after DDP has averaged the gradients, which are then the same bytes on every
/// rank: every rank finds the same inf/NaN and takes the same decision without another
/// collective. bf16 has fp32's range and needs no scaler.
#[derive(Debug, Clone, PartialEq)]
pub struct GradScaler {
    state: ScalerState,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u64,
    /// Whether [`GradScaler::unscale`] ran since the last [`GradScaler::update`].
    unscaled: bool,
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler {
            state: ScalerState {
                scale: 65536.0,
                growth_tracker: 0,
                skipped_steps: 0,
            },
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            unscaled: false,
        }
    }
}

/// Whether the gradients a [`GradScaler::unscale`] divided hold an inf or NaN, still on
/// their device: one `f32` flag per device (1 when found), so reading it is one
/// synchronisation with each (for a rank on one device: one per step).
#[derive(Debug)]
#[must_use = "the optimizer step must be skipped when an inf or NaN was found"]
pub struct FoundInf {
    flags: Vec<Tensor>,
}

impl FoundInf {
    /// The one-element flags, one per device that holds gradients, in the order the
    /// parameters first name each (none when no parameter has a gradient).
    pub fn flags(&self) -> &[Tensor] {
        &self.flags
    }

    /// Reads the flags to the host: waits for the unscale to finish on each device.
    ///
    /// # Errors
    ///
    /// [`TrainError::Tch`] when a device reports an error.
    pub fn found(self) -> Result<bool, TrainError> {
        let mut found = false;
        for flag in &self.flags {
            found |= flag.f_double_value(&[0])? != 0.0;
        }
        Ok(found)
    }
}

impl GradScaler {
    /// A scaler with PyTorch's defaults but `growth_interval` good steps between growths.
    pub fn with_growth_interval(growth_interval: u64) -> Self {
        GradScaler {
            growth_interval: growth_interval.max(1),
            ..Default::default()
        }
    }

    /// The current scale.
    pub fn scale(&self) -> f64 {
        self.state.scale
    }

    /// The state to checkpoint.
    pub fn state(&self) -> ScalerState {
        self.state
    }

    /// Continues from a checkpoint's state, at the start of a step (not unscaled).
    pub fn set_state(&mut self, state: ScalerState) {
        self.state = state;
        self.unscaled = false;
    }

    /// `loss * scale`, to call backward on.
    pub fn scale_loss(&self, loss: &Tensor) -> Tensor {
        loss * self.state.scale
    }

    /// Divides every defined gradient by the scale (in place, in fp32: multiplied by
    /// `1/scale` rounded to f32, as PyTorch does) and records whether any of them holds an
    /// inf or NaN, in which case the optimizer step must be skipped. Like PyTorch's
    /// `unscale_`, it runs one fused `_amp_foreach_non_finite_check_and_unscale_` per device
    /// and dtype of the gradients, all writing one found-inf flag per device, and reads
    /// nothing back: [`FoundInf::found`] is the one host-device synchronisation. Once per
    /// step: the next call must follow [`GradScaler::update`].
    ///
    /// # Errors
    ///
    /// [`TrainError::AlreadyUnscaled`] when it ran since the last `update` (PyTorch's
    /// `unscale_` refuses alike), leaving the gradients as they are; [`TrainError::Invalid`]
    /// when libtorch refuses the gradients (a sparse or non-floating one).
    pub fn unscale(&mut self, params: &[(String, Tensor)]) -> Result<FoundInf, TrainError> {
        if self.unscaled {
            return Err(TrainError::AlreadyUnscaled);
        }
        let inv = f64::from((1.0 / self.state.scale) as f32);
        let found = tch::no_grad(|| -> Result<FoundInf, TrainError> {
            let mut groups: Vec<((Device, Kind), Vec<Tensor>)> = Vec::new();
            for (_, p) in params {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let key = (g.device(), g.kind());
                match groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, grads)) => grads.push(g),
                    None => groups.push((key, vec![g])),
                }
            }
            let mut flags: Vec<(Device, Tensor, Tensor)> = Vec::new();
            for ((device, _), mut grads) in groups {
                let k = match flags.iter().position(|(d, _, _)| *d == device) {
                    Some(k) => k,
                    None => {
                        // Made on the device by fill kernels: no copy from the host, no wait.
                        let found = Tensor::f_zeros([1], (Kind::Float, device))?;
                        let inv = Tensor::f_full([1], inv, (Kind::Float, device))?;
                        flags.push((device, found, inv));
                        flags.len() - 1
                    }
                };
                let (_, found, inv) = &mut flags[k];
                tch_ext::amp_foreach_non_finite_check_and_unscale_(&mut grads, found, inv)
                    .map_err(|e| TrainError::Invalid(format!("unscaling the gradients: {e}")))?;
            }
            Ok(FoundInf {
                flags: flags.into_iter().map(|(_, found, _)| found).collect(),
            })
        })?;
        // Only once it succeeded, as PyTorch marks the optimizer unscaled.
        self.unscaled = true;
        Ok(found)
    }

    /// After a step (taken or skipped): backs off on inf/NaN, else counts the good step and
    /// grows the scale after `growth_interval` of them (PyTorch's `_amp_update_scale_`). The
    /// next step may unscale again.
    pub fn update(&mut self, found_inf: bool) {
        self.unscaled = false;
        let s = &mut self.state;
        if found_inf {
            s.scale *= self.backoff_factor;
            s.growth_tracker = 0;
            s.skipped_steps += 1;
        } else {
            s.growth_tracker += 1;
            if s.growth_tracker == self.growth_interval {
                // PyTorch keeps the scale in f32 and does not grow it past f32's range.
                let grown = s.scale * self.growth_factor;
                if (grown as f32).is_finite() {
                    s.scale = grown;
                }
                s.growth_tracker = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(values: &[f32], grad: &[f32]) -> (String, Tensor) {
        let p = Tensor::from_slice(values).set_requires_grad(true);
        tch_ext::set_grad(&p, Some(&Tensor::from_slice(grad))).unwrap();
        ("p".into(), p)
    }

    #[test]
    fn the_scale_backs_off_on_overflow_and_grows_after_the_interval() {
        let mut s = GradScaler::with_growth_interval(3);
        assert_eq!(s.scale(), 65536.0);
        s.update(true);
        assert_eq!((s.scale(), s.state().growth_tracker), (32768.0, 0));
        s.update(false);
        s.update(false);
        assert_eq!((s.scale(), s.state().growth_tracker), (32768.0, 2));
        s.update(false);
        assert_eq!((s.scale(), s.state().growth_tracker), (65536.0, 0));
        s.update(false);
        s.update(true);
        assert_eq!((s.scale(), s.state().growth_tracker), (32768.0, 0));
        // Two skipped steps, counted for the schedules.
        assert_eq!(s.state().skipped_steps, 2);
        // The scale stays within f32's range, as PyTorch's f32 scale does.
        let top = 2f64.powi(127); // the largest power of two in f32
        s.set_state(ScalerState {
            scale: top,
            growth_tracker: 0,
            skipped_steps: 0,
        });
        for _ in 0..3 {
            s.update(false);
        }
        assert_eq!((s.scale(), s.state().growth_tracker), (top, 0));
    }

    /// What the fused unscale replaces: every gradient multiplied by `1/scale` (rounded to
    /// f32) one at a time, and one `isfinite().all()` read back per gradient.
    fn per_parameter(scale: f64, grads: &[Tensor]) -> (Vec<Tensor>, bool) {
        let inv = f64::from((1.0 / scale) as f32);
        let mut found = false;
        let out = grads
            .iter()
            .map(|g| {
                let mut g = g.copy();
                found |= !bool::try_from(g.isfinite().all()).unwrap();
                let _ = g.g_mul_scalar_(inv);
                g
            })
            .collect();
        (out, found)
    }

    fn same_bits(a: &Tensor, b: &Tensor) -> bool {
        let host = |t: &Tensor| t.to_device(Device::Cpu).to_kind(Kind::Double);
        let (a, b) = (host(a), host(b));
        let a = Vec::<f64>::try_from(a.flatten(0, -1)).unwrap();
        let b = Vec::<f64>::try_from(b.flatten(0, -1)).unwrap();
        a.len() == b.len()
            && a.iter()
                .zip(&b)
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    /// The fused unscale gives the per-parameter values bit for bit and the same decision,
    /// for finite gradients and for an inf or a NaN anywhere among them (first, middle, last
    /// gradient; f32 and f64 gradients mixed), and the decision is one flag tensor computed
    /// on the device: reading it is the step's one synchronisation.
    #[test]
    fn the_fused_unscale_equals_the_per_parameter_one_in_one_flag() {
        fused_unscale_equals_per_parameter(Device::Cpu);
    }

    /// The same on cuda:0, where `_amp_foreach_non_finite_check_and_unscale_` is CUDA's
    /// multi-tensor kernel (the CPU's is a loop of its own): what fp16 training on a GPU
    /// runs. `cargo xtask gpu-check` runs it; without a GPU it says `skipped:`.
    #[test]
    fn the_fused_unscale_equals_the_per_parameter_one_in_one_flag_on_cuda() {
        if crate::ddp::gpu_tests::gpu() {
            fused_unscale_equals_per_parameter(Device::Cuda(0));
        }
    }

    /// On cuda:0 `unscale` queues its kernels and returns: with a second of matmuls queued
    /// ahead of it, it returns while they still run (a read of each gradient's check, as the
    /// per-parameter unscale made, would have waited for them), and [`FoundInf::found`] then
    /// reads the answer. `cargo xtask gpu-check` runs it; without a GPU it says `skipped:`.
    #[test]
    fn the_fused_unscale_leaves_the_host_free_on_cuda() {
        if !crate::ddp::gpu_tests::gpu() {
            return;
        }
        let device = Device::Cuda(0);
        let params: Vec<(String, Tensor)> = (0..32)
            .map(|i| {
                let p = Tensor::zeros([257], (Kind::Float, device)).set_requires_grad(true);
                let g = Tensor::full([257], 65536.0 * 4.0, (Kind::Float, device));
                tch_ext::set_grad(&p, Some(&g)).unwrap();
                (format!("p{i}"), p)
            })
            .collect();
        let mut s = GradScaler::default();
        crate::ddp::gpu_tests::keep_busy(1.0);
        let busy = tch_ext::CudaEvent::new(0).unwrap();
        busy.record(&tch_ext::CudaStream::current(0).unwrap())
            .unwrap();
        let found = s.unscale(&params).unwrap();
        let host_free = !busy.query().unwrap();
        assert!(
            host_free,
            "unscale waited on the host: the second of work queued before it had finished"
        );
        assert!(!found.found().unwrap());
        for (name, p) in &params {
            let g = Vec::<f32>::try_from(p.grad().to_device(Device::Cpu)).unwrap();
            assert!(g.iter().all(|&v| v == 4.0), "{name}: {:?}", &g[..3]);
        }
    }

    fn fused_unscale_equals_per_parameter(device: Device) {
        let mut s = GradScaler::default();
        let finite =
            |n: usize, kind: Kind| Tensor::randn([n as i64], (kind, device)) * 65536.0 * (n as f64);
        for scale in [65536.0, 3.0, 1.0] {
            for bad in [
                None,
                Some(f32::INFINITY),
                Some(f32::NEG_INFINITY),
                Some(f32::NAN),
            ] {
                for at in 0..3 {
                    let grads = vec![
                        finite(5, Kind::Float),
                        finite(3, Kind::Double),
                        finite(7, Kind::Float),
                    ];
                    if let Some(v) = bad {
                        let _ = grads[at].get(1).fill_(f64::from(v));
                    }
                    let (expected, expected_found) = per_parameter(scale, &grads);
                    let params: Vec<(String, Tensor)> = grads
                        .iter()
                        .map(|g| {
                            let p = g.zeros_like().set_requires_grad(true);
                            tch_ext::set_grad(&p, Some(&g.copy())).unwrap();
                            ("p".to_string(), p)
                        })
                        .collect();
                    // Each case a step of its own, at `scale`.
                    s.set_state(ScalerState {
                        scale,
                        growth_tracker: 0,
                        skipped_steps: 0,
                    });
                    let found = s.unscale(&params).unwrap();
                    assert_eq!(found.flags().len(), 1, "one flag for one device");
                    assert_eq!(found.flags()[0].size(), [1]);
                    assert_eq!(found.flags()[0].kind(), Kind::Float);
                    assert_eq!(found.flags()[0].device(), device);
                    for ((_, p), e) in params.iter().zip(&expected) {
                        assert!(same_bits(&p.grad(), e), "scale {scale}, {bad:?} at {at}");
                    }
                    assert_eq!(found.found().unwrap(), expected_found, "{bad:?} at {at}");
                    assert_eq!(expected_found, bad.is_some());
                }
            }
        }
    }

    #[test]
    fn unscaling_divides_the_gradients_and_finds_non_finite_values() {
        let mut s = GradScaler::default();
        let ok = [param(&[1.0, 2.0], &[65536.0, -131072.0])];
        assert!(!s.unscale(&ok).unwrap().found().unwrap());
        assert_eq!(Vec::<f32>::try_from(&ok[0].1.grad()).unwrap(), [1.0, -2.0]);
        s.update(false);
        let bad = [param(&[1.0], &[f32::INFINITY]), param(&[1.0], &[2.0])];
        assert!(s.unscale(&bad).unwrap().found().unwrap());
        s.update(true);
        let nan = [param(&[1.0], &[f32::NAN])];
        assert!(s.unscale(&nan).unwrap().found().unwrap());
        s.update(true);
        // A parameter without a gradient is skipped; with none, there is no flag to read.
        let none = [(
            "n".to_string(),
            Tensor::from_slice(&[1f32]).set_requires_grad(true),
        )];
        let found = s.unscale(&none).unwrap();
        assert!(found.flags().is_empty());
        assert!(!found.found().unwrap());
    }

    /// A second unscale before `update` is refused and divides nothing (PyTorch's "unscale_()
    /// has already been called on this optimizer since the last update()"); `update` and
    /// `set_state` start a step that may unscale again.
    #[test]
    fn unscale_runs_once_per_step() {
        let mut s = GradScaler::default();
        let at_two = ScalerState {
            scale: 2.0,
            growth_tracker: 0,
            skipped_steps: 0,
        };
        s.set_state(at_two);
        let p = [param(&[1.0], &[4.0])];
        let grad = || Vec::<f32>::try_from(&p[0].1.grad()).unwrap();
        assert!(!s.unscale(&p).unwrap().found().unwrap());
        assert_eq!(grad(), [2.0]);
        match s.unscale(&p) {
            Err(e @ TrainError::AlreadyUnscaled) => assert_eq!(
                e.to_string(),
                "unscale has already been called on this GradScaler since the last update: \
                 call it once per optimizer step, after sync_gradients, and update after the \
                 step"
            ),
            other => panic!("expected AlreadyUnscaled, got {other:?}"),
        }
        assert_eq!(grad(), [2.0]);
        s.update(false);
        assert!(!s.unscale(&p).unwrap().found().unwrap());
        assert_eq!(grad(), [1.0]);
        s.set_state(at_two);
        assert!(!s.unscale(&p).unwrap().found().unwrap());
        assert_eq!(grad(), [0.5]);
    }

    #[test]
    fn autocast_follows_the_precision() {
        let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
        for (p, kind) in [
            (Precision::Fp32, Kind::Float),
            (Precision::Bf16, Kind::BFloat16),
            (Precision::Fp16, Kind::Half),
        ] {
            let guard = p.autocast(Device::Cpu).unwrap();
            assert_eq!(a.matmul(&a).kind(), kind, "{p}");
            drop(guard);
            assert_eq!(a.matmul(&a).kind(), Kind::Float);
        }
    }
}
