//! `ReduceLROnPlateau`, as PyTorch defines it, on a validation metric to maximise (mode
//! "max") or to minimise (mode "min").

use crate::metrics::Goal;

/// Settings of [`ReduceLrOnPlateau`] (PyTorch's defaults, threshold mode "rel").
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PlateauConfig {
    /// Multiplier applied to the learning rate on a plateau.
    pub factor: f64,
    /// Epochs without improvement tolerated before reducing.
    pub patience: u32,
    /// Relative improvement that counts: `metric > best * (1 + threshold)` for a metric to
    /// maximise, `metric < best * (1 - threshold)` for one to minimise.
    pub threshold: f64,
    /// Epochs to wait after a reduction before counting bad epochs again.
    pub cooldown: u32,
    /// The learning rate never goes below this.
    pub min_lr: f64,
}

impl Default for PlateauConfig {
    fn default() -> Self {
        Self {
            factor: 0.1,
            patience: 10,
            threshold: 1e-4,
            cooldown: 0,
            min_lr: 0.0,
        }
    }
}

/// Reduces the learning rate when a metric stops improving.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ReduceLrOnPlateau {
    /// The settings.
    pub config: PlateauConfig,
    /// Best metric so far, signed so that larger is better (a metric to minimise is stored
    /// negated); `-inf` before the first epoch, and `+inf` after an infinite metric in the
    /// right direction, which nothing improves on (as in PyTorch). JSON has no infinities:
    /// `-inf` is written as `null` (a checkpoint inside the first epoch has no best yet),
    /// `+inf` as `"inf"`.
    #[serde(with = "infinite_best")]
    pub best: f64,
    /// Consecutive epochs without improvement.
    pub num_bad_epochs: u32,
    /// Epochs of cooldown left.
    pub cooldown_counter: u32,
}

/// `-inf` (no best yet) as JSON's `null`, `+inf` as `"inf"`, and back.
mod infinite_best {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// A best as JSON holds it.
    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Saved {
        Number(Option<f64>),
        Word(String),
    }

    pub(super) fn serialize<S: Serializer>(best: &f64, s: S) -> Result<S::Ok, S::Error> {
        let saved = if *best == f64::INFINITY {
            Saved::Word("inf".into())
        } else {
            Saved::Number(best.is_finite().then_some(*best))
        };
        saved.serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match Saved::deserialize(d)? {
            Saved::Number(best) => Ok(best.unwrap_or(f64::NEG_INFINITY)),
            Saved::Word(word) if word == "inf" => Ok(f64::INFINITY),
            Saved::Word(word) => Err(D::Error::custom(format!(
                "the plateau scheduler's best is {word:?}: expected a number, null or \"inf\""
            ))),
        }
    }
}

/// Reductions smaller than this are ignored, as in PyTorch.
const MIN_CHANGE: f64 = 1e-8;

impl ReduceLrOnPlateau {
    /// A scheduler with no history.
    pub fn new(config: PlateauConfig) -> Self {
        Self {
            config,
            best: f64::NEG_INFINITY,
            num_bad_epochs: 0,
            cooldown_counter: 0,
        }
    }

    /// Records one epoch's `metric`, to maximise or minimise as `goal` says, and returns the
    /// learning rate to use from now on.
    pub fn step(&mut self, metric: f64, goal: Goal, lr: f64) -> f64 {
        // PyTorch's `is_better` in threshold mode "rel", on the signed value: "max" is
        // `m > best * (1 + t)`; "min" is `m < best * (1 - t)`, that is `-m > -best * (1 - t)`.
        let (signed, threshold) = match goal {
            Goal::Max => (metric, self.config.threshold),
            Goal::Min => (-metric, -self.config.threshold),
        };
        // As in PyTorch, whose best starts at the worst infinity: a NaN metric is no
        // improvement, also the first, nor is one infinite in the wrong direction; one infinite
        // in the right direction is the best for good.
        if signed > self.best * (1.0 + threshold) {
            self.best = signed;
            self.num_bad_epochs = 0;
        } else {
            self.num_bad_epochs += 1;
        }
        if self.cooldown_counter > 0 {
            self.cooldown_counter -= 1;
            self.num_bad_epochs = 0;
        }
        if self.num_bad_epochs > self.config.patience {
            self.cooldown_counter = self.config.cooldown;
            self.num_bad_epochs = 0;
            let new_lr = (lr * self.config.factor).max(self.config.min_lr);
            if lr - new_lr > MIN_CHANGE {
                return new_lr;
            }
        }
        lr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduces_after_patience_bad_epochs_and_respects_min_lr() {
        let config = PlateauConfig {
            factor: 0.5,
            patience: 2,
            min_lr: 0.2,
            ..Default::default()
        };
        let mut s = ReduceLrOnPlateau::new(config);
        let metrics = [0.5, 0.6, 0.6, 0.6, 0.6, 0.59, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6];
        let mut lr = 1.0;
        let mut lrs = Vec::new();
        for m in metrics {
            lr = s.step(m, Goal::Max, lr);
            lrs.push(lr);
        }
        // Bad epochs: 3rd, 4th (patience 2), reduction on the 3rd bad one (5th epoch), then
        // three more bad epochs (6th to 8th) before the next, and the floor of 0.2 after.
        assert_eq!(
            lrs,
            [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.2, 0.2]
        );
        assert_eq!(s.best, 0.6);
    }

    #[test]
    fn improvement_must_exceed_the_relative_threshold() {
        let config = PlateauConfig {
            patience: 0,
            threshold: 0.1,
            ..Default::default()
        };
        let mut s = ReduceLrOnPlateau::new(config);
        assert_eq!(s.step(1.0, Goal::Max, 1.0), 1.0);
        // 1.05 is not > 1.0 * 1.1: a bad epoch, and with patience 0 a reduction.
        assert!((s.step(1.05, Goal::Max, 1.0) - 0.1).abs() < 1e-12);
        assert_eq!(s.best, 1.0);
    }

    /// torch 2.13: `ReduceLROnPlateau(opt, mode="min", patience=2)` stepped with these
    /// losses gives these learning rates (a loss 5e-5 above the best is no improvement).
    #[test]
    fn a_metric_to_minimise_must_fall_below_the_relative_threshold() {
        let config = PlateauConfig {
            patience: 2,
            ..Default::default()
        };
        let mut s = ReduceLrOnPlateau::new(config);
        let losses = [1.0, 1.0, 1.0, 1.0, 1.00005, 1.00005, 1.00005, 1.00005];
        let mut lr = 1.0;
        let mut lrs = Vec::new();
        for m in losses {
            lr = s.step(m, Goal::Min, lr);
            lrs.push(lr);
        }
        let expected = [1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.01, 0.01];
        assert!(
            lrs.iter().zip(expected).all(|(a, b)| (a - b).abs() < 1e-12),
            "{lrs:?}"
        );
        assert_eq!(s.best, -1.0);
        // A loss below best * (1 - 1e-4) is an improvement.
        let mut s = ReduceLrOnPlateau::new(PlateauConfig {
            patience: 0,
            ..Default::default()
        });
        assert_eq!(s.step(1.0, Goal::Min, 1.0), 1.0);
        assert_eq!(s.step(0.9998, Goal::Min, 1.0), 1.0);
        assert_eq!(s.best, -0.9998);
    }

    /// torch 2.13: `ReduceLROnPlateau(opt, mode="min", patience=1)` stepped with NaN, 1.0,
    /// NaN, NaN, 0.5 keeps lr 1, 1, 1, then 0.1, 0.1; its best is 1.0 after the second step
    /// (a NaN is a bad epoch, and never the best).
    #[test]
    fn a_nan_metric_is_a_bad_epoch() {
        let mut s = ReduceLrOnPlateau::new(PlateauConfig {
            patience: 1,
            ..Default::default()
        });
        let mut lr = 1.0;
        let mut seen = Vec::new();
        for m in [f64::NAN, 1.0, f64::NAN, f64::NAN, 0.5] {
            lr = s.step(m, Goal::Min, lr);
            seen.push((lr, s.best, s.num_bad_epochs));
        }
        assert_eq!(
            seen,
            [
                (1.0, f64::NEG_INFINITY, 1),
                (1.0, -1.0, 0),
                (1.0, -1.0, 1),
                (0.1, -1.0, 0),
                (0.1, -0.5, 0)
            ]
        );
    }

    #[test]
    fn cooldown_suspends_counting() {
        let config = PlateauConfig {
            factor: 0.5,
            patience: 0,
            cooldown: 2,
            ..Default::default()
        };
        let mut s = ReduceLrOnPlateau::new(config);
        let lrs: Vec<f64> = [1.0, 0.9, 0.9, 0.9, 0.9]
            .iter()
            .scan(1.0, |lr, &m| {
                *lr = s.step(m, Goal::Max, *lr);
                Some(*lr)
            })
            .collect();
        assert_eq!(lrs, [1.0, 0.5, 0.5, 0.5, 0.25]);
    }

    #[test]
    fn a_scheduler_without_a_best_round_trips_through_json() {
        let fresh = ReduceLrOnPlateau::new(PlateauConfig::default());
        let json = serde_json::to_string(&fresh).unwrap();
        assert!(json.contains(r#""best":null"#), "{json}");
        let back: ReduceLrOnPlateau = serde_json::from_str(&json).unwrap();
        assert_eq!(back, fresh);
        let mut stepped = fresh;
        stepped.step(0.25, Goal::Max, 1.0);
        let back: ReduceLrOnPlateau =
            serde_json::from_str(&serde_json::to_string(&stepped).unwrap()).unwrap();
        assert_eq!(back.best, 0.25);
    }

    /// torch 2.13: `ReduceLROnPlateau(opt, mode="max", patience=1)` stepped with inf, 1.0,
    /// 2.0 keeps best inf with 0, 1, 0 bad epochs (lr 1, 1, 0.1); in mode "min", -inf is the
    /// best for good too, and a first inf is a bad epoch with no best.
    #[test]
    fn an_infinite_metric_is_as_in_pytorch_and_its_best_round_trips() {
        let run = |goal, metrics: &[f64]| {
            let mut s = ReduceLrOnPlateau::new(PlateauConfig {
                patience: 1,
                ..Default::default()
            });
            let mut lr = 1.0;
            let seen: Vec<_> = metrics
                .iter()
                .map(|&m| {
                    lr = s.step(m, goal, lr);
                    (lr, s.best, s.num_bad_epochs)
                })
                .collect();
            (seen, s)
        };
        let inf = f64::INFINITY;
        let (seen, max) = run(Goal::Max, &[inf, 1.0, 2.0]);
        assert_eq!(seen, [(1.0, inf, 0), (1.0, inf, 1), (0.1, inf, 0)]);
        let (seen, min) = run(Goal::Min, &[-inf, 1.0]);
        assert_eq!(seen, [(1.0, inf, 0), (1.0, inf, 1)]);
        let (seen, none) = run(Goal::Min, &[inf, 1.0]);
        assert_eq!(seen, [(1.0, -inf, 1), (1.0, -1.0, 0)]);
        let (_, worst) = run(Goal::Max, &[-inf]);
        assert_eq!((worst.best, worst.num_bad_epochs), (-inf, 1));
        for s in [max, min, none, worst] {
            let json = serde_json::to_string(&s).unwrap();
            let back: ReduceLrOnPlateau = serde_json::from_str(&json).unwrap();
            assert_eq!(back, s, "{json}");
        }
        let json = serde_json::to_string(&run(Goal::Max, &[inf]).1).unwrap();
        assert!(json.contains(r#""best":"inf""#), "{json}");
        let err = serde_json::from_str::<ReduceLrOnPlateau>(&json.replace(r#""inf""#, r#""big""#))
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with(r#"the plateau scheduler's best is "big": expected a number"#),
            "{err}"
        );
    }
}
