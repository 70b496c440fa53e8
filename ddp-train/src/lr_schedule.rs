//! Learning-rate schedules stepped once per optimizer step, with warmup: the factor of the
//! base learning rate at optimizer step `t` (0 for the first step).
//!
//! | schedule | factor at step `t` (`w` warmup steps, `T` steps in all) | as |
//! |---|---|---|
//! | `constant` | `t / w` during warmup, then 1 | `get_constant_schedule_with_warmup` |
//! | `linear` | `t / w`, then `(T - t) / (T - w)`, down to 0 | `get_linear_schedule_with_warmup` |
//! | `cosine` | `t / w`, then `(1 + cos(pi p)) / 2` with `p = (t - w) / (T - w)` | `get_cosine_schedule_with_warmup` |
//! | `step` | `t / w`, then `gamma^floor((t - w) / every)` | `torch.optim.lr_scheduler.StepLR` |
//! | `one-cycle` | cosine from `1 / div` up to 1 over `pct_start * T` steps, then cosine down to `1 / (div * final_div)` | `torch.optim.lr_scheduler.OneCycleLR` (`anneal_strategy='cos'`) |
//!
//! The warmup and decay formulas are Hugging Face's `transformers` schedules (which take the
//! step count `t` as above), the step and one-cycle ones PyTorch's. A factor is a pure
//! function of the optimizer's step count, which checkpoints keep, so a resumed run
//! continues the schedule exactly.

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

/// The shape of a per-step schedule.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum LrSchedule {
    /// The base learning rate after warmup.
    Constant {
        /// Warmup steps (linear from 0).
        warmup: u64,
    },
    /// Linear warmup, then linear decay to 0 at the last step.
    Linear {
        /// Warmup steps.
        warmup: u64,
    },
    /// Linear warmup, then a half cosine down to 0 at the last step.
    Cosine {
        /// Warmup steps.
        warmup: u64,
    },
    /// Linear warmup, then multiplied by `gamma` every `every` steps.
    Step {
        /// Warmup steps.
        warmup: u64,
        /// Steps between decays.
        every: u64,
        /// The factor of each decay.
        gamma: f64,
    },
    /// PyTorch's `OneCycleLR` with cosine annealing; the base learning rate is `max_lr`.
    OneCycle {
        /// Share of the steps spent rising (PyTorch's default 0.3).
        pct_start: f64,
        /// The initial learning rate is the base divided by this (default 25).
        div_factor: f64,
        /// The last learning rate is the initial one divided by this (default 1e4).
        final_div_factor: f64,
    },
}

impl LrSchedule {
    /// One-cycle with PyTorch's defaults.
    pub fn one_cycle() -> Self {
        LrSchedule::OneCycle {
            pct_start: 0.3,
            div_factor: 25.0,
            final_div_factor: 1e4,
        }
    }

    /// The factor of the base learning rate at optimizer step `t` of `total`.
    pub fn factor(&self, t: u64, total: u64) -> f64 {
        let warmup = match *self {
            LrSchedule::Constant { warmup }
            | LrSchedule::Linear { warmup }
            | LrSchedule::Cosine { warmup }
            | LrSchedule::Step { warmup, .. } => warmup,
            LrSchedule::OneCycle { .. } => 0,
        };
        if t < warmup {
            return t as f64 / warmup.max(1) as f64;
        }
        let after = (t - warmup) as f64;
        let decay_steps = total.saturating_sub(warmup).max(1) as f64;
        match *self {
            LrSchedule::Constant { .. } => 1.0,
            LrSchedule::Linear { .. } => ((decay_steps - after) / decay_steps).max(0.0),
            LrSchedule::Cosine { .. } => {
                let progress = after / decay_steps;
                (0.5 * (1.0 + (PI * progress).cos())).max(0.0)
            }
            LrSchedule::Step { every, gamma, .. } => {
                gamma.powf((after as u64 / every.max(1)) as f64)
            }
            LrSchedule::OneCycle {
                pct_start,
                div_factor,
                final_div_factor,
            } => {
                // PyTorch's phase ends: pct_start * total - 1, then total - 1.
                let initial = 1.0 / div_factor;
                let last = initial / final_div_factor;
                let rise_end = pct_start * total as f64 - 1.0;
                let end = total as f64 - 1.0;
                let cos_anneal = |from: f64, to: f64, pct: f64| {
                    to + (from - to) / 2.0 * ((PI * pct).cos() + 1.0)
                };
                let t = t as f64;
                if t <= rise_end {
                    cos_anneal(initial, 1.0, t / rise_end.max(f64::MIN_POSITIVE))
                } else {
                    let pct = ((t - rise_end) / (end - rise_end).max(f64::MIN_POSITIVE)).min(1.0);
                    cos_anneal(1.0, last, pct)
                }
            }
        }
    }

    /// Checks the parameters; the message names the flag.
    pub fn validate(&self) -> Result<(), String> {
        match *self {
            LrSchedule::Step { every, gamma, .. } => {
                if every == 0 {
                    return Err("--lr-step-every must be at least 1".into());
                }
                if !(gamma > 0.0 && gamma.is_finite()) {
                    return Err(format!("--lr-gamma {gamma} must be a positive number"));
                }
            }
            LrSchedule::OneCycle {
                pct_start,
                div_factor,
                final_div_factor,
            } => {
                if !(pct_start > 0.0 && pct_start < 1.0) {
                    return Err(format!("one-cycle pct_start {pct_start} must be in (0, 1)"));
                }
                if !(div_factor >= 1.0 && final_div_factor >= 1.0) {
                    return Err("one-cycle div factors must be at least 1".into());
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn warmup_then_decay_as_transformers_defines_it() {
        let linear = LrSchedule::Linear { warmup: 10 };
        let f: Vec<f64> = [0, 5, 10, 55, 100, 120]
            .iter()
            .map(|&t| linear.factor(t, 100))
            .collect();
        assert_eq!(f, [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]);
        let cosine = LrSchedule::Cosine { warmup: 10 };
        assert!(close(cosine.factor(10, 110), 1.0));
        assert!(close(cosine.factor(60, 110), 0.5));
        assert!(close(cosine.factor(110, 110), 0.0));
        let constant = LrSchedule::Constant { warmup: 4 };
        assert_eq!(constant.factor(1, 100), 0.25);
        assert_eq!(constant.factor(99, 100), 1.0);
        let step = LrSchedule::Step {
            warmup: 0,
            every: 30,
            gamma: 0.1,
        };
        assert!(close(step.factor(29, 100), 1.0));
        assert!(close(step.factor(30, 100), 0.1));
        assert!(close(step.factor(65, 100), 0.01));
    }

    /// The values of `torch.optim.lr_scheduler.OneCycleLR(max_lr=1, total_steps=100)` (its
    /// defaults, cosine annealing), printed by PyTorch 2.13 for steps 0, 15, 29, 30, 64, 99.
    #[test]
    fn one_cycle_matches_pytorch() {
        let s = LrSchedule::one_cycle();
        let got: Vec<f64> = [0, 15, 29, 30, 64, 99]
            .iter()
            .map(|&t| s.factor(t, 100))
            .collect();
        let want = [
            0.040000000000000036,
            0.5459866761210004,
            1.0,
            0.9994965352845243,
            0.500002,
            4e-6,
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-9, "{got:?} vs {want:?}");
        }
    }
}
