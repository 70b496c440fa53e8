//! A non-finite training loss on some rank, decided alike on every rank.
//!
//! A rank's NaN or infinite loss reaches every rank through the step's gradient all-reduce:
//! backward starts from the loss times [`poison`], 1 for a finite loss and NaN for another,
//! so that the rank's gradients are NaN even where the loss's own are finite (`loss + inf`),
//! and so are the averaged gradients on every rank. Every rank then takes the same decision
//! from the same averaged bytes, at the same step, without another collective on a good step:
//!
//! - with fp16's scaler, its unscale finds the NaN: every rank skips the step and backs off
//!   the scale, as PyTorch's `GradScaler` does for the inf gradients such a loss gives;
//! - without one, [`non_finite_check`] (or the clipped norm) finds it, and the ranks learn
//!   which of them saw a non-finite loss ([`Trainer::stop_on_non_finite_loss`], one small
//!   all-reduce on that path only): every rank returns the same
//!   [`TrainError::NonFiniteLoss`] before the optimizer step.
//!
//! Either way the non-finite loss is left out of the epoch's loss mean.

use ddp_comm::ReduceOp;
use tch::Tensor;

use super::Trainer;
use crate::amp::{FoundInf, GradScaler, ScalerState};
use crate::error::TrainError;
use crate::task::Task;

/// 1 (of the loss's dtype) when `loss` is finite, NaN when not: `loss * 0 + 1`, computed on
/// the loss's device without waiting for it. Multiplying the loss by it before backward
/// leaves a finite loss's gradients the same bit for bit (times 1, exactly) and makes a
/// non-finite loss's NaN.
pub(super) fn poison(loss: &Tensor) -> Tensor {
    loss.detach() * 0.0 + 1.0
}

/// Whether some gradient of `params` holds an inf or NaN, still on the device: the scaler's
/// fused check at scale 1 (a multiplication by 1, which leaves the gradients as they were),
/// one per device and dtype.
pub(super) fn non_finite_check(params: &[(String, Tensor)]) -> Result<FoundInf, TrainError> {
    let mut unit = GradScaler::default();
    unit.set_state(ScalerState {
        scale: 1.0,
        growth_tracker: 0,
        skipped_steps: 0,
    });
    unit.unscale(params)
}

impl<T: Task> Trainer<T> {
    /// After averaged gradients that are not finite, without a scaler (every rank calls it
    /// at the same step, since every rank has the same averaged gradients): one all-reduce
    /// of each rank's non-finite loss of the step (`mine`), and, when some rank saw one, the
    /// same [`TrainError::NonFiniteLoss`] naming them on every rank. Non-finite gradients
    /// from finite losses are not this error: the step goes on as before.
    pub(super) fn stop_on_non_finite_loss(
        &self,
        mine: Option<f64>,
        epoch: u64,
        step: usize,
    ) -> Result<(), TrainError> {
        // Rank r's slot holds its non-finite loss, every other rank adds 0 to it.
        let mut seen = vec![0.0f64; self.pg.world_size()];
        seen[self.pg.rank()] = mine.unwrap_or(0.0);
        self.pg.all_reduce_slice(&mut seen, ReduceOp::Sum)?;
        let ranks: Vec<(usize, f64)> = seen
            .into_iter()
            .enumerate()
            .filter(|(_, v)| !v.is_finite())
            .collect();
        if ranks.is_empty() {
            return Ok(());
        }
        Err(TrainError::NonFiniteLoss { ranks, epoch, step })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn the_poison_is_one_for_a_finite_loss_and_nan_for_another() {
        for kind in [Kind::Float, Kind::Half, Kind::BFloat16, Kind::Double] {
            for (loss, finite) in [
                (0.25, true),
                (-0.0, true),
                (f64::INFINITY, false),
                (f64::NEG_INFINITY, false),
                (f64::NAN, false),
            ] {
                let p = poison(&Tensor::from(loss).to_kind(kind));
                assert_eq!(p.kind(), kind);
                let v = p.double_value(&[]);
                assert!(
                    if finite { v == 1.0 } else { v.is_nan() },
                    "{loss} {kind:?}"
                );
            }
        }
    }

    /// `loss + inf` has finite gradients; times the poison, NaN ones. A finite loss times
    /// the poison has the same gradients bit for bit.
    #[test]
    fn a_poisoned_non_finite_loss_has_nan_gradients_and_a_finite_one_its_own() {
        let w = Tensor::from_slice(&[0.3f32, -1.7, 2.5]).set_requires_grad(true);
        let x = Tensor::from_slice(&[1.1f32, 0.9, -0.4]);
        let grad = |shift: f64, poisoned: bool| {
            let _ = tch_ext::set_grad(&w, None);
            let loss = (&w * &x).square().sum(Kind::Float) / 3.0 + shift;
            let loss = if poisoned {
                &loss * poison(&loss)
            } else {
                loss
            };
            (loss / 2.0).backward();
            Vec::<f32>::try_from(&w.grad()).unwrap()
        };
        let plain = grad(0.0, false);
        assert!(plain.iter().all(|g| g.is_finite()));
        let bits = |v: &[f32]| v.iter().map(|g| g.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&grad(0.0, true)), bits(&plain));
        assert_eq!(bits(&grad(f64::INFINITY, false)), bits(&plain));
        assert!(grad(f64::INFINITY, true).iter().all(|g| g.is_nan()));
    }

    #[test]
    fn gradients_are_checked_for_finiteness_and_left_as_they_were() {
        let param = |g: &[f32]| {
            let p =
                Tensor::zeros([g.len() as i64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            tch_ext::set_grad(&p, Some(&Tensor::from_slice(g))).unwrap();
            ("p".to_string(), p)
        };
        let ok = [param(&[1e30, -3.5]), param(&[f32::MIN_POSITIVE])];
        assert!(!non_finite_check(&ok).unwrap().found().unwrap());
        assert_eq!(Vec::<f32>::try_from(&ok[0].1.grad()).unwrap(), [1e30, -3.5]);
        assert_eq!(
            Vec::<f32>::try_from(&ok[1].1.grad()).unwrap(),
            [f32::MIN_POSITIVE]
        );
        for bad in [f32::INFINITY, f32::NAN] {
            let bad = non_finite_check(&[param(&[1.0]), param(&[2.0, bad])]).unwrap();
            assert!(bad.found().unwrap());
        }
    }
}
