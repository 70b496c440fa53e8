//! Best values (of the best-model monitors and of early stopping) as checkpoints hold them.
//!
//! Only a finite value becomes the best: JSON has no infinities, so serde_json writes one as
//! `null`, which no `f64` reads back. Checkpoints written before that rule may hold such a
//! `null`: it reads as no best.

use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

/// A best score and the epoch it was reached in.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Best {
    /// The score (finite).
    pub value: f64,
    /// The epoch.
    pub epoch: u64,
}

impl Best {
    /// Whether `value` replaces `previous` as the best, `better(value, previous)` deciding
    /// between finite values: a NaN (a diverged model's) or an infinity (an overflowing loss)
    /// never does.
    pub(crate) fn replaced(
        previous: Option<&Best>,
        value: f64,
        better: impl FnOnce(f64, f64) -> bool,
    ) -> bool {
        value.is_finite() && previous.is_none_or(|b| better(value, b.value))
    }
}

/// Where early stopping stands: the best value so far and the epochs since it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EarlyStopState {
    /// The best value and its epoch (none before the first finite evaluation).
    #[serde(default, deserialize_with = "finite_best")]
    pub best: Option<Best>,
    /// Epochs since the best one.
    pub bad_epochs: u32,
}

impl EarlyStopState {
    /// Counts epoch `epoch`'s `value`; true when training should stop. A value that is not
    /// finite is an epoch without improvement, and never the best.
    pub fn observe(&mut self, rule: &crate::EarlyStopping, epoch: u64, value: f64) -> bool {
        let improved = Best::replaced(self.best.as_ref(), value, |value, best| match rule.goal {
            crate::Goal::Max => value > best + rule.min_delta,
            crate::Goal::Min => value < best - rule.min_delta,
        });
        if improved {
            self.best = Some(Best { value, epoch });
            self.bad_epochs = 0;
        } else {
            self.bad_epochs = self.bad_epochs.saturating_add(1);
        }
        rule.patience
            .is_some_and(|patience| self.bad_epochs >= patience)
    }
}

/// A [`Best`] as a checkpoint may hold it: `null` for an infinite value.
#[derive(Deserialize)]
struct SavedBest {
    value: Option<f64>,
    epoch: u64,
}

impl SavedBest {
    fn finite(self) -> Option<Best> {
        let value = self.value.filter(|v| v.is_finite())?;
        Some(Best {
            value,
            epoch: self.epoch,
        })
    }
}

fn finite_best<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Best>, D::Error> {
    Ok(Option::<SavedBest>::deserialize(d)?.and_then(SavedBest::finite))
}

/// The monitors' bests, less those a checkpoint holds as `null`.
pub(super) fn finite_bests<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, Best>, D::Error> {
    let saved = BTreeMap::<String, SavedBest>::deserialize(d)?;
    Ok(saved
        .into_iter()
        .filter_map(|(file, b)| Some((file, b.finite()?)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(goal: crate::Goal, min_delta: f64) -> crate::EarlyStopping {
        crate::EarlyStopping {
            metric: "val_loss".into(),
            goal,
            patience: Some(2),
            min_delta,
        }
    }

    fn observe(rule: &crate::EarlyStopping, values: &[f64]) -> (Vec<bool>, EarlyStopState) {
        let mut st = EarlyStopState::default();
        let stops = values
            .iter()
            .enumerate()
            .map(|(e, &v)| st.observe(rule, e as u64 + 1, v))
            .collect();
        (stops, st)
    }

    #[test]
    fn early_stopping_counts_epochs_without_a_large_enough_improvement() {
        let min = rule(crate::Goal::Min, 0.01);
        let (stops, st) = observe(&min, &[1.0, 0.9, 0.895, 0.89, 0.85, 0.86, 0.86]);
        assert_eq!(stops, [false, false, false, true, false, false, true]);
        let best = |value, epoch| Some(Best { value, epoch });
        assert_eq!(st.best, best(0.85, 5));
        // NaN epochs count as bad, the first included, and never become the best.
        let (stops, st) = observe(&min, &[f64::NAN, 1.0, f64::NAN, f64::NAN]);
        assert_eq!(stops, [false, false, false, true]);
        assert_eq!(st.best, best(1.0, 2));
    }

    /// An infinite value (an overflowing loss) is a bad epoch and never the best, for
    /// either goal: the best stays one that a checkpoint can hold.
    #[test]
    fn an_infinite_value_is_never_the_best() {
        let min = rule(crate::Goal::Min, 0.0);
        let (stops, st) = observe(&min, &[f64::INFINITY]);
        assert_eq!((stops, st.best, st.bad_epochs), (vec![false], None, 1));
        let (stops, st) = observe(&min, &[1.0, f64::NEG_INFINITY, f64::INFINITY, 0.5]);
        assert_eq!(stops, [false, false, true, false]);
        assert_eq!(
            (st.best, st.bad_epochs),
            (
                Some(Best {
                    value: 0.5,
                    epoch: 4
                }),
                0
            )
        );
        let max = rule(crate::Goal::Max, 0.0);
        let (_, st) = observe(&max, &[1.0, f64::INFINITY, 2.0]);
        assert_eq!(
            (st.best, st.bad_epochs),
            (
                Some(Best {
                    value: 2.0,
                    epoch: 3
                }),
                0
            )
        );
    }

    /// Checkpoints written while an infinity could be the best hold it as `null`: it reads
    /// as no best, and the finite ones as they were.
    #[test]
    fn a_null_best_reads_as_none() {
        let st: EarlyStopState =
            serde_json::from_str(r#"{"best":{"value":null,"epoch":1},"bad_epochs":3}"#).unwrap();
        assert_eq!((st.best, st.bad_epochs), (None, 3));
        let json = r#"{"best-loss.safetensors":{"value":null,"epoch":1},
            "best-macro.safetensors":{"value":0.75,"epoch":2}}"#;
        let mut d = serde_json::Deserializer::from_str(json);
        let bests = finite_bests(&mut d).unwrap();
        let expected = [(
            "best-macro.safetensors".to_owned(),
            Best {
                value: 0.75,
                epoch: 2,
            },
        )];
        assert_eq!(bests, BTreeMap::from(expected));
    }
}
