//! How the learning rate changes: [`LrSchedule`], one choice among schedules stepped once
//! per optimizer step, with warmup (below: the factor of the base learning rate at optimizer
//! step `t`, 0 for the first step), and `ReduceLROnPlateau` on a metric after each epoch
//! ([`Plateau`]). `T` is the run's planned total, recorded when it starts (`--epochs` times
//! the starting allocation's steps per epoch), so that a resume on another number of ranks
//! keeps the curve; past `T` the `linear`, `cosine` and `one-cycle` factors stay at their
//! last value.
//!
//! | schedule | factor at step `t` (`w` warmup steps, `T` steps in all) | as |
//! |---|---|---|
//! | `constant` | `t / w` during warmup, then 1 | `get_constant_schedule_with_warmup` |
//! | `linear` | `t / w`, then `(T - t) / (T - w)`, down to 0 | `get_linear_schedule_with_warmup` |
//! | `cosine` | `t / w`, then `(1 + cos(pi p)) / 2` with `p = (t - w) / (T - w)` | `get_cosine_schedule_with_warmup` |
//! | `step` | `t / w`, then times `gamma` every `every` steps | `torch.optim.lr_scheduler.StepLR` |
//! | `one-cycle` | cosine from `1 / div` up to 1 over `pct_start * T` steps, then cosine down to `1 / (div * final_div)` | `torch.optim.lr_scheduler.OneCycleLR` (`anneal_strategy='cos'`, `cycle_momentum=False`) |
//! | `plateau` | 1, times `factor` after each `patience` epochs without improvement | `torch.optim.lr_scheduler.ReduceLROnPlateau` |
//!
//! The warmup and decay formulas are Hugging Face's `transformers` schedules (which take the
//! step count `t` as above), the step and one-cycle ones PyTorch's, each rounded as its
//! source computes it ([`LrSchedule::lr`]). A per-step rate is a pure function of the
//! optimizer's step count, which checkpoints keep, so a resumed run continues the schedule
//! exactly; the plateau scheduler's history is in the checkpoint too.

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

use crate::error::SettingError;
use crate::metrics::Goal;
use crate::scheduler::PlateauConfig;

/// Decays of `step` taken one multiplication each, as PyTorch's `StepLR` does; past them (a
/// decay every few steps of a very long run) `gamma` is raised to the power instead, which
/// keeps the rate a quick function of `t`.
const MAX_REPEATED_DECAYS: u64 = 1 << 16;

/// How the learning rate changes over the run. The default, `Constant` without warmup, keeps
/// the optimizer's learning rate throughout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// PyTorch's `OneCycleLR` with cosine annealing; the base learning rate is `max_lr`. The
    /// momentum (Adam's beta1) stays as set: PyTorch's `cycle_momentum=False`, not its
    /// default, which also moves it between 0.95 and 0.85.
    OneCycle {
        /// Share of the steps spent rising (PyTorch's default 0.3).
        pct_start: f64,
        /// The initial learning rate is the base divided by this (default 25).
        div_factor: f64,
        /// The last learning rate is the initial one divided by this (default 1e4).
        final_div_factor: f64,
    },
    /// `ReduceLROnPlateau` on one metric of the epoch's report, after each epoch.
    Plateau(Plateau),
}

impl Default for LrSchedule {
    fn default() -> Self {
        Self::Constant { warmup: 0 }
    }
}

/// The kinds of [`LrSchedule`], as `--lr-schedule` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// Warmup, then the base learning rate.
    Constant,
    /// Warmup, then linear decay to 0.
    Linear,
    /// Warmup, then cosine decay to 0.
    Cosine,
    /// Warmup, then decays by --lr-gamma every --lr-step-every steps.
    Step,
    /// PyTorch's OneCycleLR (--lr is the peak).
    OneCycle,
    /// ReduceLROnPlateau, per epoch, on the metric the program watches.
    Plateau,
}

/// `ReduceLROnPlateau` on one metric of the epoch's report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plateau {
    /// The metric it watches (`val_loss`, `train_loss` or one the task's evaluation reports).
    pub metric: String,
    /// Which direction is better.
    pub goal: Goal,
    /// Factor, patience, cooldown, threshold and floor.
    pub config: PlateauConfig,
}

impl Default for Plateau {
    /// On the validation loss, with PyTorch's defaults.
    fn default() -> Self {
        Self::min("val_loss")
    }
}

impl Plateau {
    /// Lowers the learning rate when `metric` stops growing (PyTorch's `mode='max'`), with
    /// PyTorch's defaults.
    pub fn max(metric: impl Into<String>) -> Self {
        Self {
            metric: metric.into(),
            goal: Goal::Max,
            config: PlateauConfig::default(),
        }
    }

    /// Lowers the learning rate when `metric` stops falling (`mode='min'`).
    pub fn min(metric: impl Into<String>) -> Self {
        Self {
            goal: Goal::Min,
            ..Self::max(metric)
        }
    }

    /// The same with `config`.
    #[must_use]
    pub fn with(self, config: PlateauConfig) -> Self {
        Self { config, ..self }
    }
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

    /// A schedule of `kind` with its defaults: no warmup, the step schedule's decay by 0.1
    /// every 1000 steps, one-cycle's and the plateau scheduler's PyTorch defaults (on
    /// `val_loss`).
    pub fn of_kind(kind: ScheduleKind) -> Self {
        match kind {
            ScheduleKind::Constant => LrSchedule::Constant { warmup: 0 },
            ScheduleKind::Linear => LrSchedule::Linear { warmup: 0 },
            ScheduleKind::Cosine => LrSchedule::Cosine { warmup: 0 },
            ScheduleKind::Step => LrSchedule::Step {
                warmup: 0,
                every: 1000,
                gamma: 0.1,
            },
            ScheduleKind::OneCycle => Self::one_cycle(),
            ScheduleKind::Plateau => LrSchedule::Plateau(Plateau::default()),
        }
    }

    /// Its kind.
    pub fn kind(&self) -> ScheduleKind {
        match self {
            LrSchedule::Constant { .. } => ScheduleKind::Constant,
            LrSchedule::Linear { .. } => ScheduleKind::Linear,
            LrSchedule::Cosine { .. } => ScheduleKind::Cosine,
            LrSchedule::Step { .. } => ScheduleKind::Step,
            LrSchedule::OneCycle { .. } => ScheduleKind::OneCycle,
            LrSchedule::Plateau(_) => ScheduleKind::Plateau,
        }
    }

    /// Whether it sets the learning rate at every optimizer step (all but `Plateau`, which
    /// changes it between epochs).
    pub fn per_step(&self) -> bool {
        !matches!(self, LrSchedule::Plateau(_))
    }

    /// The warmup steps (0 for one-cycle and plateau, which have none).
    pub fn warmup(&self) -> u64 {
        match *self {
            LrSchedule::Constant { warmup }
            | LrSchedule::Linear { warmup }
            | LrSchedule::Cosine { warmup }
            | LrSchedule::Step { warmup, .. } => warmup,
            LrSchedule::OneCycle { .. } | LrSchedule::Plateau(_) => 0,
        }
    }

    /// The learning rate at optimizer step `t` of `total`, for the base rate `base` (`base`
    /// for `Plateau`, whose changes come from the epochs' metrics instead), rounded as
    /// PyTorch computes it: `base * factor` for the warmup and the `transformers` schedules
    /// (`LambdaLR`); `base` times `gamma` once per decay for `step` (`StepLR` multiplies the
    /// current rate, up to 65536 decays, then `base * gamma^k`); and the one-cycle curve
    /// between absolute rates (`OneCycleLR`'s `max_lr / div_factor`, and that over
    /// `final_div_factor`). `t` is a whole number of steps but after a change of the global
    /// batch, whose steps count by their share of the planned one (see
    /// [`crate::allocation::Plan`]).
    pub fn lr(&self, base: f64, t: f64, total: u64) -> f64 {
        let warmup = self.warmup();
        if t < warmup as f64 {
            return base * (t / warmup.max(1) as f64);
        }
        let after = t - warmup as f64;
        let decay_steps = total.saturating_sub(warmup).max(1) as f64;
        match *self {
            LrSchedule::Constant { .. } | LrSchedule::Plateau(_) => base,
            LrSchedule::Linear { .. } => base * ((decay_steps - after) / decay_steps).max(0.0),
            LrSchedule::Cosine { .. } => {
                // Past the planned total (a run resumed on a smaller global batch takes more
                // steps) the rate stays at the curve's end instead of rising again.
                let progress = (after / decay_steps).min(1.0);
                base * (0.5 * (1.0 + (PI * progress).cos())).max(0.0)
            }
            LrSchedule::Step { every, gamma, .. } => {
                // Exact for whole steps: below 2^40 steps, `after / every` is never rounded
                // up to the next whole number.
                let decays = (after / every.max(1) as f64).floor() as u64;
                if decays <= MAX_REPEATED_DECAYS {
                    (0..decays).fold(base, |lr, _| lr * gamma)
                } else {
                    base * gamma.powf(decays as f64)
                }
            }
            LrSchedule::OneCycle {
                pct_start,
                div_factor,
                final_div_factor,
            } => {
                // PyTorch's phase ends: pct_start * total - 1, then total - 1.
                let initial = base / div_factor;
                let last = initial / final_div_factor;
                let rise_end = pct_start * total as f64 - 1.0;
                let end = total as f64 - 1.0;
                let cos_anneal = |from: f64, to: f64, pct: f64| {
                    to + (from - to) / 2.0 * ((PI * pct).cos() + 1.0)
                };
                if t <= rise_end {
                    cos_anneal(initial, base, t / rise_end.max(f64::MIN_POSITIVE))
                } else {
                    let pct = ((t - rise_end) / (end - rise_end).max(f64::MIN_POSITIVE)).min(1.0);
                    cos_anneal(base, last, pct)
                }
            }
        }
    }

    /// Checks the parameters; the error names them by their path in
    /// [`Settings`](crate::Settings) (`lr_schedule.every`).
    pub fn validate(&self) -> Result<(), SettingError> {
        let positive = |x: f64| x > 0.0 && x.is_finite();
        match self {
            LrSchedule::Step { every, gamma, .. } => {
                if *every == 0 {
                    return Err(SettingError::new(
                        "lr_schedule.every",
                        " must be at least 1",
                    ));
                }
                if !positive(*gamma) {
                    return Err(SettingError::new(
                        "lr_schedule.gamma",
                        format!(" {gamma} must be a positive number"),
                    ));
                }
            }
            LrSchedule::OneCycle {
                pct_start,
                div_factor,
                final_div_factor,
            } => {
                if !(*pct_start > 0.0 && *pct_start < 1.0) {
                    return Err(SettingError::new(
                        "lr_schedule.pct_start",
                        format!(" {pct_start} must be in (0, 1)"),
                    ));
                }
                for (field, value) in [
                    ("lr_schedule.div_factor", div_factor),
                    ("lr_schedule.final_div_factor", final_div_factor),
                ] {
                    if !(*value >= 1.0 && value.is_finite()) {
                        return Err(SettingError::new(
                            field,
                            format!(" {value} must be at least 1"),
                        ));
                    }
                }
            }
            LrSchedule::Plateau(p) => {
                let c = &p.config;
                if !(c.factor > 0.0 && c.factor < 1.0) {
                    return Err(SettingError::new(
                        "lr_schedule.config.factor",
                        format!(" {} must be in (0, 1)", c.factor),
                    ));
                }
                if !(c.min_lr >= 0.0 && c.min_lr.is_finite()) {
                    return Err(SettingError::new(
                        "lr_schedule.config.min_lr",
                        format!(" {} must be a number >= 0", c.min_lr),
                    ));
                }
                if !(c.threshold >= 0.0 && c.threshold.is_finite()) {
                    return Err(SettingError::new(
                        "lr_schedule.config.threshold",
                        format!(" {} must be a number >= 0", c.threshold),
                    ));
                }
            }
            LrSchedule::Constant { .. } | LrSchedule::Linear { .. } | LrSchedule::Cosine { .. } => {
            }
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
        let f: Vec<f64> = [0.0, 5.0, 10.0, 55.0, 100.0, 120.0]
            .iter()
            .map(|&t| linear.lr(1.0, t, 100))
            .collect();
        assert_eq!(f, [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]);
        let cosine = LrSchedule::Cosine { warmup: 10 };
        assert!(close(cosine.lr(1.0, 10.0, 110), 1.0));
        assert!(close(cosine.lr(1.0, 60.0, 110), 0.5));
        assert!(close(cosine.lr(1.0, 110.0, 110), 0.0));
        // Past the planned total (more steps than planned after a resume) it stays at 0.
        assert!(close(cosine.lr(1.0, 160.0, 110), 0.0));
        let constant = LrSchedule::Constant { warmup: 4 };
        assert_eq!(constant.lr(1.0, 1.0, 100), 0.25);
        assert_eq!(constant.lr(1.0, 99.0, 100), 1.0);
        let step = LrSchedule::Step {
            warmup: 0,
            every: 30,
            gamma: 0.1,
        };
        assert_eq!(step.lr(1e-3, 29.0, 100), 1e-3);
        assert_eq!(step.lr(1e-3, 30.0, 100), 1e-4);
        // StepLR's `lr * gamma` per decay: 1e-5 exactly, where `1e-3 * 0.1^2` is 1 ulp more.
        assert_eq!(step.lr(1e-3, 65.0, 100), 1e-5);
        assert_ne!(1e-3 * 0.1f64.powi(2), 1e-5);
        // Steps of a larger global batch count by their share: 29.5 is before the decay,
        // 30 at it; a warmup of 4 at 1.5 is 3/8 of the way.
        assert_eq!(step.lr(1e-3, 29.5, 100), 1e-3);
        assert_eq!(step.lr(1e-3, 30.0, 100), 1e-4);
        assert_eq!(constant.lr(1.0, 1.5, 100), 0.375);
        let between = 0.5 * (1.0 + (PI * 25.5 / 100.0).cos());
        assert!(close(cosine.lr(1.0, 35.5, 110), between));
    }

    /// The values of `torch.optim.lr_scheduler.OneCycleLR(max_lr=1, total_steps=100)` (its
    /// defaults, cosine annealing), printed by PyTorch 2.13 for steps 0, 15, 29, 30, 64, 99,
    /// then those of `max_lr=2e-3`.
    #[test]
    fn one_cycle_matches_pytorch() {
        let s = LrSchedule::one_cycle();
        let got: Vec<f64> = [0.0, 15.0, 29.0, 30.0, 64.0, 99.0]
            .iter()
            .map(|&t| s.lr(1.0, t, 100))
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
        // With `max_lr=2e-3`, bit for bit: PyTorch anneals between absolute rates, so
        // `2e-3 * factor` would round differently.
        let got: Vec<f64> = [0.0, 15.0, 29.0, 30.0, 64.0, 99.0]
            .iter()
            .map(|&t| s.lr(2e-3, t, 100))
            .collect();
        let want = [
            7.999999999999999e-05,
            0.0010919733522420007,
            0.002,
            0.0019989930705690486,
            0.0010000039999999999,
            8e-09,
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn every_kind_round_trips_and_only_plateau_leaves_the_steps_alone() {
        for kind in [
            ScheduleKind::Constant,
            ScheduleKind::Linear,
            ScheduleKind::Cosine,
            ScheduleKind::Step,
            ScheduleKind::OneCycle,
            ScheduleKind::Plateau,
        ] {
            let schedule = LrSchedule::of_kind(kind);
            assert_eq!(schedule.kind(), kind);
            assert!(schedule.validate().is_ok(), "{schedule:?}");
            assert_eq!(schedule.per_step(), kind != ScheduleKind::Plateau);
            let json = serde_json::to_value(&schedule).unwrap();
            assert_eq!(json["kind"], serde_json::to_value(kind).unwrap());
            assert_eq!(
                serde_json::from_value::<LrSchedule>(json).unwrap(),
                schedule
            );
        }
        assert_eq!(LrSchedule::default().lr(1.0, 7.0, 10), 1.0);
        assert_eq!(
            LrSchedule::Plateau(Plateau::max("f1")).lr(1.0, 0.0, 10),
            1.0
        );
    }

    #[test]
    fn invalid_parameters_are_named_by_their_path() {
        let bad = [
            (
                LrSchedule::Step {
                    warmup: 0,
                    every: 10,
                    gamma: 0.0,
                },
                "lr_schedule.gamma 0 must be a positive number",
            ),
            (
                LrSchedule::OneCycle {
                    pct_start: 1.5,
                    div_factor: 25.0,
                    final_div_factor: 1e4,
                },
                "lr_schedule.pct_start 1.5 must be in (0, 1)",
            ),
            (
                LrSchedule::OneCycle {
                    pct_start: 0.3,
                    div_factor: 0.5,
                    final_div_factor: 1e4,
                },
                "lr_schedule.div_factor 0.5 must be at least 1",
            ),
            (
                LrSchedule::Plateau(Plateau::min("val_loss").with(PlateauConfig {
                    min_lr: -1.0,
                    ..Default::default()
                })),
                "lr_schedule.config.min_lr -1 must be a number >= 0",
            ),
        ];
        for (schedule, message) in bad {
            assert_eq!(schedule.validate().unwrap_err().to_string(), message);
        }
    }
}
