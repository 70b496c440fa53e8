//! Multi-label classification counts and F1 scores.
//!
//! A prediction is positive when its logit is above 0 (probability above 0.5). Per-class F1 is
//! `2TP / (2TP + FP + FN)`, and 0 for a class with no positives and no predictions (sklearn's
//! `zero_division=0`); macro-F1 is their mean; micro-F1 pools the counts of all classes.
//! Counts add across ranks, so an all-reduced sum of [`Confusion::to_vec`] gives exactly what
//! one process would compute on the whole split.

use tch::{Kind, Tensor};

/// True positives, false positives and false negatives per class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confusion {
    /// True positives per class.
    pub tp: Vec<i64>,
    /// False positives per class.
    pub fp: Vec<i64>,
    /// False negatives per class.
    pub fn_: Vec<i64>,
}

impl Confusion {
    /// Zero counts for `classes` classes.
    pub fn new(classes: usize) -> Self {
        Self {
            tp: vec![0; classes],
            fp: vec![0; classes],
            fn_: vec![0; classes],
        }
    }

    /// Adds a batch: `logits` and 0/1 `labels`, both `[B, classes]`.
    pub fn add(&mut self, logits: &Tensor, labels: &Tensor) {
        let pred = logits.gt(0.0).to_kind(Kind::Int64);
        let truth = labels.gt(0.5).to_kind(Kind::Int64);
        let not_pred = pred.neg() + 1;
        let not_truth = truth.neg() + 1;
        let per_class = |t: Tensor| t.sum_dim_intlist(0, false, Kind::Int64);
        let tp = per_class(&pred * &truth);
        let fp = per_class(&pred * &not_truth);
        let fn_ = per_class(&not_pred * &truth);
        for (acc, t) in [(&mut self.tp, tp), (&mut self.fp, fp), (&mut self.fn_, fn_)] {
            let v = Vec::<i64>::try_from(t.to_device(tch::Device::Cpu)).unwrap_or_default();
            for (a, x) in acc.iter_mut().zip(v) {
                *a += x;
            }
        }
    }

    /// The counts as one vector `[tp.., fp.., fn..]`, for an all-reduce.
    pub fn to_vec(&self) -> Vec<i64> {
        [self.tp.as_slice(), &self.fp, &self.fn_].concat()
    }

    /// The inverse of [`Confusion::to_vec`].
    pub fn from_vec(v: &[i64]) -> Self {
        let c = v.len() / 3;
        Self {
            tp: v[..c].to_vec(),
            fp: v[c..2 * c].to_vec(),
            fn_: v[2 * c..3 * c].to_vec(),
        }
    }

    /// F1 of each class.
    pub fn f1_per_class(&self) -> Vec<f64> {
        (0..self.tp.len())
            .map(|k| f1(self.tp[k], self.fp[k], self.fn_[k]))
            .collect()
    }

    /// The mean of the per-class F1 scores.
    pub fn macro_f1(&self) -> f64 {
        let per = self.f1_per_class();
        if per.is_empty() {
            return 0.0;
        }
        per.iter().sum::<f64>() / per.len() as f64
    }

    /// F1 of the pooled counts of all classes.
    pub fn micro_f1(&self) -> f64 {
        f1(
            self.tp.iter().sum(),
            self.fp.iter().sum(),
            self.fn_.iter().sum(),
        )
    }
}

fn f1(tp: i64, fp: i64, fn_: i64) -> f64 {
    let denom = 2 * tp + fp + fn_;
    if denom == 0 {
        0.0
    } else {
        2.0 * tp as f64 / denom as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_scores_match_hand_computation() {
        // 4 samples, 3 classes.
        let logits = Tensor::from_slice(&[
            2.0f32, -1.0, 0.5, //
            -3.0, 1.0, -0.5, //
            1.0, 1.0, 1.0, //
            -1.0, -1.0, -1.0,
        ])
        .view([4, 3]);
        let labels = Tensor::from_slice(&[
            1.0f32, 0.0, 0.0, //
            0.0, 1.0, 0.0, //
            0.0, 1.0, 1.0, //
            1.0, 0.0, 0.0,
        ])
        .view([4, 3]);
        let mut c = Confusion::new(3);
        c.add(&logits, &labels);
        assert_eq!(c.tp, [1, 2, 1]);
        assert_eq!(c.fp, [1, 0, 1]);
        assert_eq!(c.fn_, [1, 0, 0]);
        let per = c.f1_per_class();
        assert!((per[0] - 0.5).abs() < 1e-12);
        assert!((per[1] - 1.0).abs() < 1e-12);
        assert!((per[2] - 2.0 / 3.0).abs() < 1e-12);
        assert!((c.macro_f1() - (0.5 + 1.0 + 2.0 / 3.0) / 3.0).abs() < 1e-12);
        // micro: tp 4, fp 2, fn 1 -> 8 / 11.
        assert!((c.micro_f1() - 8.0 / 11.0).abs() < 1e-12);
        assert_eq!(Confusion::from_vec(&c.to_vec()), c);
    }

    #[test]
    fn a_class_never_present_nor_predicted_scores_zero() {
        let mut c = Confusion::new(2);
        c.add(
            &Tensor::from_slice(&[1.0f32, -1.0]).view([1, 2]),
            &Tensor::from_slice(&[1.0f32, 0.0]).view([1, 2]),
        );
        assert_eq!(c.f1_per_class(), [1.0, 0.0]);
        assert_eq!(c.macro_f1(), 0.5);
        assert_eq!(c.micro_f1(), 1.0);
    }
}
