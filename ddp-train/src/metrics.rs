//! Classification counts and F1 scores ([`Confusion`]), the built-in [`Stats`], and which
//! direction of a metric is better ([`Goal`]).
//!
//! Each `add` takes a batch whose shapes it checks, and panics on shapes it cannot count (a
//! caller's bug, as a shape mismatch in a tch operation is), naming both shapes: counting a
//! `[B]` output as `[B, classes]`, or broadcasting `[B, 1]` predictions against `[B]` targets,
//! would give plausible wrong metrics. Each `try_add` returns the [`StatsError`] instead.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::task::{Metrics, Stats};

/// Whether a larger or a smaller value of a metric is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Goal {
    /// Larger is better (accuracy, F1).
    Max,
    /// Smaller is better (a loss).
    Min,
}

impl Goal {
    /// Whether `new` improves on `old`.
    pub fn improves(self, new: f64, old: f64) -> bool {
        match self {
            Self::Max => new > old,
            Self::Min => new < old,
        }
    }
}

/// A batch that a statistic cannot count.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StatsError {
    /// The outputs or targets do not have the shapes, classes or values the statistic counts.
    #[error("{0}")]
    Shape(String),
    /// Reading the counts back from the tensors failed.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
}

/// True positives, false positives and false negatives per class.
///
/// Classification counts and F1 scores, and built-in [`Stats`] for the usual tasks:
/// [`MultiLabelStats`] (thresholded per-class, macro and micro F1), [`MultiClassStats`]
/// (accuracy, per-class, macro and micro F1 of the arg-max) and [`RegressionStats`] (MSE, MAE).
/// All count or sum, so the Trainer's all-reduce gives exactly the whole split's metrics.
///
/// A prediction is positive when its logit is above 0 (probability above 0.5). Per-class F1 is
/// `2TP / (2TP + FP + FN)`, and 0 for a class with no positives and no predictions (sklearn's
/// `zero_division=0`); macro-F1 is their mean; micro-F1 pools the counts of all classes.
/// Counts add across ranks, so an all-reduced sum of [`Confusion::to_vec`] gives exactly what
/// one process would compute on the whole split.
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
    ///
    /// # Panics
    /// On shapes [`Confusion::try_add`] refuses, naming them.
    pub fn add(&mut self, logits: &Tensor, labels: &Tensor) {
        self.try_add(logits, labels)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Adds a batch as [`Confusion::add`] does, or says why it cannot: `logits` not
    /// `[B, classes]`, or `labels` of another shape.
    pub fn try_add(&mut self, logits: &Tensor, labels: &Tensor) -> Result<(), StatsError> {
        let classes = self.tp.len() as i64;
        let (shape, label_shape) = (logits.size(), labels.size());
        if shape.len() != 2 || shape[1] != classes || label_shape != shape {
            return Err(StatsError::Shape(format!(
                "counting {classes} classes needs logits and labels of shape [batch, {classes}], \
                 got logits {shape:?} and labels {label_shape:?}"
            )));
        }
        let pred = logits.gt(0.0).to_kind(Kind::Int64);
        let truth = labels.gt(0.5).to_kind(Kind::Int64);
        let not_pred = pred.neg() + 1;
        let not_truth = truth.neg() + 1;
        // tp, fp and fn per class, read in one transfer.
        let counts = Tensor::stack(&[&pred * &truth, &pred * &not_truth, &not_pred * &truth], 0)
            .sum_dim_intlist(1, false, Kind::Int64)
            .reshape([-1]);
        let counts = Vec::<i64>::try_from(counts.to_device(tch::Device::Cpu))?;
        let per_class = counts.chunks_exact(self.tp.len().max(1));
        for (acc, v) in [&mut self.tp, &mut self.fp, &mut self.fn_]
            .into_iter()
            .zip(per_class)
        {
            for (a, x) in acc.iter_mut().zip(v) {
                *a += x;
            }
        }
        Ok(())
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
        self.mean_f1(|_| true)
    }

    /// The mean F1 of the classes `k` that `counted(k)`; 0 when none is.
    fn mean_f1(&self, counted: impl Fn(usize) -> bool) -> f64 {
        let f1s: Vec<f64> = (0..self.tp.len())
            .filter(|&k| counted(k))
            .map(|k| f1(self.tp[k], self.fp[k], self.fn_[k]))
            .collect();
        if f1s.is_empty() {
            return 0.0;
        }
        f1s.iter().sum::<f64>() / f1s.len() as f64
    }

    /// The mean of the per-class F1 scores over the classes that occur, as target or as
    /// prediction (sklearn's single-label `f1_score(average="macro")`, which averages over
    /// `unique_labels(y_true, y_pred)`); 0 when none does.
    pub fn macro_f1_of_present(&self) -> f64 {
        self.mean_f1(|k| self.tp[k] + self.fp[k] + self.fn_[k] > 0)
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

impl Confusion {
    /// Adds `val_macro_f1`, `val_micro_f1` and `val_f1_per_class` to `m`.
    fn report_into(&self, m: Metrics) -> Metrics {
        m.number("val_macro_f1", self.macro_f1())
            .number("val_micro_f1", self.micro_f1())
            .list("val_f1_per_class", self.f1_per_class())
    }

    /// The counts from the all-reduced sums of [`Confusion::sums`].
    fn set_from_sums(&mut self, sums: &[f64]) {
        let counts: Vec<i64> = sums.iter().map(|&v| v.round() as i64).collect();
        *self = Confusion::from_vec(&counts);
    }

    /// The counts as numbers to all-reduce.
    fn sums(&self) -> Vec<f64> {
        self.to_vec().iter().map(|&v| v as f64).collect()
    }
}

/// Multi-label classification (one logit per class, several classes may be true): a class is
/// predicted when its logit is above 0. Reports `val_macro_f1`, `val_micro_f1` and
/// `val_f1_per_class`.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiLabelStats {
    /// The counts.
    pub confusion: Confusion,
}

impl MultiLabelStats {
    /// Empty counts for `classes` classes.
    pub fn new(classes: usize) -> Self {
        Self {
            confusion: Confusion::new(classes),
        }
    }

    /// Adds a batch: `logits` and 0/1 `labels`, both `[B, classes]`.
    ///
    /// # Panics
    /// On shapes [`Confusion::try_add`] refuses, naming them.
    pub fn add(&mut self, logits: &Tensor, labels: &Tensor) {
        self.confusion.add(logits, labels);
    }

    /// Adds a batch as [`MultiLabelStats::add`] does, or says why it cannot.
    pub fn try_add(&mut self, logits: &Tensor, labels: &Tensor) -> Result<(), StatsError> {
        self.confusion.try_add(logits, labels)
    }
}

impl Stats for MultiLabelStats {
    fn to_sums(&self) -> Vec<f64> {
        self.confusion.sums()
    }

    fn set_sums(&mut self, sums: &[f64]) {
        self.confusion.set_from_sums(sums);
    }

    fn report(&self) -> Metrics {
        self.confusion.report_into(Metrics::new())
    }

    /// The per-class counts `tp`, `fp` and `fn`.
    fn details(&self) -> Metrics {
        let c = &self.confusion;
        Metrics::new()
            .counts("tp", c.tp.iter().copied())
            .counts("fp", c.fp.iter().copied())
            .counts("fn", c.fn_.iter().copied())
    }

    fn summary(&self) -> String {
        format!(
            "val macro-F1 {:.3}  micro-F1 {:.3}",
            self.confusion.macro_f1(),
            self.confusion.micro_f1()
        )
    }
}

/// Single-label multi-class classification: the prediction is the arg-max of `[B, classes]`
/// logits, the target a class index. Reports `val_accuracy`, `val_macro_f1`, `val_micro_f1`
/// (equal to the accuracy when every sample has one class) and `val_f1_per_class`, as
/// sklearn's `f1_score(average=...)` with `zero_division=0`: the macro average leaves out a
/// class that is neither a target nor a prediction in the split, `val_f1_per_class` lists
/// every class.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiClassStats {
    /// Per-class counts of the arg-max predictions.
    pub confusion: Confusion,
    /// Correct predictions.
    pub correct: i64,
    /// Samples seen.
    pub total: i64,
}

impl MultiClassStats {
    /// Empty counts for `classes` classes.
    pub fn new(classes: usize) -> Self {
        Self {
            confusion: Confusion::new(classes),
            correct: 0,
            total: 0,
        }
    }

    /// Adds a batch: `[B, classes]` logits and `B` class indices (any integer or float kind,
    /// shape `[B]` or `[B, 1]`).
    ///
    /// # Panics
    /// On inputs [`MultiClassStats::try_add`] refuses, naming them.
    pub fn add(&mut self, logits: &Tensor, targets: &Tensor) {
        self.try_add(logits, targets)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Adds a batch as [`MultiClassStats::add`] does, or says why it cannot: logits not
    /// `[B, classes]`, targets not `[B]` or `[B, 1]`, or a target outside `0..classes`.
    pub fn try_add(&mut self, logits: &Tensor, targets: &Tensor) -> Result<(), StatsError> {
        let classes = self.confusion.tp.len() as i64;
        let (shape, target_shape) = (logits.size(), targets.size());
        let batch = shape.first().copied().unwrap_or(-1);
        if shape.len() != 2
            || shape[1] != classes
            || !(target_shape == [batch] || target_shape == [batch, 1])
        {
            return Err(StatsError::Shape(format!(
                "counting {classes} classes needs logits of shape [batch, {classes}] and targets \
                 of shape [batch] or [batch, 1], got logits {shape:?} and targets \
                 {target_shape:?}"
            )));
        }
        let pred = logits.argmax(-1, false).to_kind(Kind::Int64);
        let truth = targets.reshape([-1]).to_kind(Kind::Int64);
        // Targets outside the classes and correct predictions, in one read (before one_hot,
        // which needs valid classes); the bad target is looked up only when there is one.
        let outside = truth.lt(0).logical_or(&truth.ge(classes)).sum(Kind::Int64);
        let correct = pred.eq_tensor(&truth).sum(Kind::Int64);
        let read = Tensor::stack(&[outside, correct], 0).to_device(tch::Device::Cpu);
        let (outside, correct) = (read.int64_value(&[0]), read.int64_value(&[1]));
        if outside > 0 {
            let low = truth.min().int64_value(&[]);
            let bad = if low < 0 {
                low
            } else {
                truth.max().int64_value(&[])
            };
            return Err(StatsError::Shape(format!(
                "target {bad} is not a class index in 0..{classes}"
            )));
        }
        let pred_hot = pred.one_hot(classes).to_kind(Kind::Float);
        let truth_hot = truth.one_hot(classes).to_kind(Kind::Float);
        // One-hot predictions as logits above/below 0, so the multi-label counts apply.
        self.confusion
            .try_add(&(pred_hot * 2.0 - 1.0), &truth_hot)?;
        self.correct += correct;
        self.total += batch;
        Ok(())
    }

    /// Correct predictions over samples (0 before any).
    pub fn accuracy(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.correct as f64 / self.total as f64
        }
    }
}

impl Stats for MultiClassStats {
    fn to_sums(&self) -> Vec<f64> {
        let mut v = self.confusion.sums();
        v.extend([self.correct as f64, self.total as f64]);
        v
    }

    fn set_sums(&mut self, sums: &[f64]) {
        let (counts, tail) = sums.split_at(sums.len().saturating_sub(2));
        self.confusion.set_from_sums(counts);
        self.correct = tail.first().map_or(0, |v| v.round() as i64);
        self.total = tail.get(1).map_or(0, |v| v.round() as i64);
    }

    fn report(&self) -> Metrics {
        let m = Metrics::new().number("val_accuracy", self.accuracy());
        // Single-label: a class absent from the split's targets and predictions is left out
        // of the macro average, as sklearn leaves it out (multi-label averages every column).
        self.confusion
            .report_into(m)
            .number("val_macro_f1", self.confusion.macro_f1_of_present())
    }
}

/// Regression: sums of squared and absolute errors. Reports `val_mse` and `val_mae` (means
/// over every predicted value).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RegressionStats {
    /// Sum of squared errors.
    pub squared: f64,
    /// Sum of absolute errors.
    pub absolute: f64,
    /// Values compared.
    pub count: f64,
}

impl RegressionStats {
    /// Adds a batch of predictions and targets of the same shape.
    ///
    /// # Panics
    /// When the shapes differ (see [`RegressionStats::try_add`]), naming them.
    pub fn add(&mut self, predictions: &Tensor, targets: &Tensor) {
        self.try_add(predictions, targets)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Adds a batch as [`RegressionStats::add`] does, or says why it cannot: predictions and
    /// targets of different shapes, which broadcasting would compare pairwise (`[B, 1]`
    /// against `[B]` gives `B * B` errors).
    pub fn try_add(&mut self, predictions: &Tensor, targets: &Tensor) -> Result<(), StatsError> {
        let (shape, target_shape) = (predictions.size(), targets.size());
        if shape != target_shape {
            return Err(StatsError::Shape(format!(
                "predictions {shape:?} and targets {target_shape:?} differ in shape; \
                 reshape one to the other (broadcasting would compare every pair)"
            )));
        }
        let diff = (predictions.to_kind(Kind::Double) - targets.to_kind(Kind::Double)).detach();
        // Both sums in one transfer (one wait for the device).
        let sums = Tensor::stack(
            &[
                diff.square().sum(Kind::Double),
                diff.abs().sum(Kind::Double),
            ],
            0,
        );
        if let [squared, absolute] = Vec::<f64>::try_from(sums.to_device(tch::Device::Cpu))?[..] {
            self.squared += squared;
            self.absolute += absolute;
        }
        self.count += diff.numel() as f64;
        Ok(())
    }
}

impl Stats for RegressionStats {
    fn to_sums(&self) -> Vec<f64> {
        vec![self.squared, self.absolute, self.count]
    }

    fn set_sums(&mut self, sums: &[f64]) {
        if let [squared, absolute, count] = *sums {
            (self.squared, self.absolute, self.count) = (squared, absolute, count);
        }
    }

    fn report(&self) -> Metrics {
        let n = self.count.max(1.0);
        Metrics::new()
            .number("val_mse", self.squared / n)
            .number("val_mae", self.absolute / n)
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

    const FLOAT: (Kind, tch::Device) = (Kind::Float, tch::Device::Cpu);

    #[test]
    fn goals_compare_in_their_direction() {
        assert!(Goal::Max.improves(0.6, 0.5));
        assert!(!Goal::Max.improves(0.5, 0.5));
        assert!(Goal::Min.improves(0.4, 0.5));
        assert!(!Goal::Min.improves(0.6, 0.5));
    }

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
    fn multi_class_scores_match_sklearn() {
        // Targets [0, 1, 2, 2, 1], arg-max predictions [0, 2, 2, 1, 1]:
        // sklearn f1_score(average=None) = [1.0, 0.5, 0.5], macro 2/3, micro = accuracy 3/5.
        let logits = Tensor::from_slice(&[
            3.0f32, 0.0, 0.0, //
            0.0, 1.0, 2.0, //
            0.0, 0.0, 1.0, //
            0.0, 5.0, 1.0, //
            0.0, 2.0, 1.0,
        ])
        .view([5, 3]);
        let targets = Tensor::from_slice(&[0i64, 1, 2, 2, 1]);
        let mut a = MultiClassStats::new(3);
        a.add(&logits.narrow(0, 0, 2), &targets.narrow(0, 0, 2));
        let mut b = MultiClassStats::new(3);
        b.add(
            &logits.narrow(0, 2, 3),
            &targets.narrow(0, 2, 3).to_kind(Kind::Float),
        );
        // What the Trainer's all-reduce does: add the sums.
        let sums: Vec<f64> = a
            .to_sums()
            .iter()
            .zip(b.to_sums())
            .map(|(x, y)| x + y)
            .collect();
        let mut all = MultiClassStats::new(3);
        all.set_sums(&sums);
        assert_eq!((all.correct, all.total), (3, 5));
        let r = all.report().into_map();
        assert_eq!(r["val_f1_per_class"], serde_json::json!([1.0, 0.5, 0.5]));
        assert!((r["val_macro_f1"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert!((r["val_micro_f1"].as_f64().unwrap() - 0.6).abs() < 1e-12);
        assert!((r["val_accuracy"].as_f64().unwrap() - 0.6).abs() < 1e-12);

        // Class 2 neither a target nor a prediction: targets [0, 0, 1, 1, 0], predictions
        // [0, 1, 1, 1, 0]; sklearn's macro F1 is 0.8 (0.5333 with labels=[0, 1, 2]).
        let logits = Tensor::from_slice(&[
            1.0f32, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0,
        ])
        .view([5, 3]);
        let mut absent = MultiClassStats::new(3);
        absent.add(&logits, &Tensor::from_slice(&[0i64, 0, 1, 1, 0]));
        let r = absent.report().into_map();
        assert!(
            (r["val_macro_f1"].as_f64().unwrap() - 0.8).abs() < 1e-12,
            "{r:?}"
        );
        assert_eq!(r["val_f1_per_class"].as_array().unwrap().len(), 3);
    }

    #[test]
    fn multi_label_and_regression_stats_add_across_ranks() {
        let mut m = MultiLabelStats::new(2);
        m.add(
            &Tensor::from_slice(&[1.0f32, -1.0, 1.0, 1.0]).view([2, 2]),
            &Tensor::from_slice(&[1.0f32, 0.0, 0.0, 1.0]).view([2, 2]),
        );
        let mut twice = MultiLabelStats::new(2);
        twice.set_sums(&m.to_sums().iter().map(|v| v * 2.0).collect::<Vec<_>>());
        assert_eq!(twice.confusion.tp, [2, 2]);
        assert_eq!(
            twice.report().into_map()["val_f1_per_class"],
            serde_json::json!([2.0 / 3.0, 1.0])
        );
        let mut r = RegressionStats::default();
        r.add(
            &Tensor::from_slice(&[1.0f32, 2.0, 4.0]),
            &Tensor::from_slice(&[1.0f32, 0.0, 5.0]),
        );
        let report = r.report().into_map();
        assert_eq!(report["val_mse"], serde_json::json!(5.0 / 3.0));
        assert_eq!(report["val_mae"], serde_json::json!(1.0));
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

    #[test]
    fn batches_of_shapes_that_cannot_be_counted_are_refused_and_leave_the_counts() {
        let shape_error = |r: Result<(), StatsError>| match r {
            Err(StatsError::Shape(m)) => m,
            other => panic!("expected a shape error, got {other:?}"),
        };
        // A [B] output counted as [B, 1] summed to a scalar before, and gave zero counts.
        let mut c = Confusion::new(1);
        let m = shape_error(c.try_add(
            &Tensor::from_slice(&[1.0f32, -1.0]),
            &Tensor::from_slice(&[1.0f32, 0.0]),
        ));
        assert!(m.contains("[batch, 1]") && m.contains("logits [2]"), "{m}");
        // Eight logit columns for five classes were counted for the first five only.
        let mut c = Confusion::new(5);
        let m =
            shape_error(c.try_add(&Tensor::zeros([2, 8], FLOAT), &Tensor::zeros([2, 8], FLOAT)));
        assert!(m.contains("logits [2, 8]"), "{m}");
        assert_eq!(c, Confusion::new(5));

        let mut a = MultiClassStats::new(3);
        let logits = Tensor::zeros([2, 3], FLOAT);
        let m = shape_error(a.try_add(&logits, &Tensor::from_slice(&[0i64, 3])));
        assert_eq!(m, "target 3 is not a class index in 0..3");
        let m = shape_error(a.try_add(&logits, &Tensor::from_slice(&[-1i64, 0])));
        assert_eq!(m, "target -1 is not a class index in 0..3");
        shape_error(a.try_add(&logits, &Tensor::from_slice(&[0i64, 1, 2])));
        assert_eq!((a.correct, a.total), (0, 0));
        a.try_add(&logits, &Tensor::from_slice(&[0i64, 2]).view([2, 1]))
            .expect("[B, 1] targets");
        assert_eq!((a.correct, a.total), (1, 2));
        a.try_add(&Tensor::zeros([0, 3], FLOAT), &Tensor::zeros([0], FLOAT))
            .expect("an empty batch");
        assert_eq!(a.total, 2);

        // [B, 1] predictions against [B] targets broadcast to B * B differences before.
        let mut r = RegressionStats::default();
        let m = shape_error(r.try_add(
            &Tensor::from_slice(&[1.0f32, 2.0]).view([2, 1]),
            &Tensor::from_slice(&[1.0f32, 2.0]),
        ));
        assert!(m.contains("[2, 1]") && m.contains("[2]"), "{m}");
        assert_eq!(r, RegressionStats::default());
    }

    #[test]
    #[should_panic(expected = "counting 3 classes needs logits and labels of shape [batch, 3]")]
    fn add_panics_with_the_shapes_it_cannot_count() {
        MultiLabelStats::new(3).add(&Tensor::zeros([2, 4], FLOAT), &Tensor::zeros([2, 4], FLOAT));
    }
}
