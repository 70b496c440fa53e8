//! The ODIR-2019 challenge's score, as the organisers' evaluation script computes it with
//! scikit-learn: the patients × 8 classes ground truth and probabilities flattened into one
//! vector each, then Cohen's kappa and micro-F1 of `probability > 0.5`, the ROC AUC of the
//! probabilities, and their mean. Also the per-class AUC, a patient's two eyes combined into
//! one prediction ([`EyeCombine`]), and per-class thresholds that maximise F1.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// The organisers' decision threshold.
pub const THRESHOLD: f64 = 0.5;

/// How a patient's two eye predictions become the patient's. The patient is normal (`N`)
/// only when neither eye shows a disease, so `max` takes `N`'s smaller probability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EyeCombine {
    /// Each disease's larger probability (a disease seen in either eye is the patient's), and
    /// `N`'s smaller (normal only when both eyes are).
    #[default]
    Max,
    /// Each class's mean probability.
    Mean,
}

impl EyeCombine {
    /// The patient's probabilities from those of the eyes there are (one or two). An eye's
    /// NaN makes the patient's NaN (`f64::max` would drop it for the other eye's value).
    pub fn combine(self, eyes: &[[f64; 8]]) -> [f64; 8] {
        let mut out = [0.0; 8];
        for (k, o) in out.iter_mut().enumerate() {
            let values = || eyes.iter().map(|e| e[k]);
            *o = match self {
                _ if values().any(f64::is_nan) => f64::NAN,
                EyeCombine::Max if k == 0 => values().fold(f64::INFINITY, f64::min),
                EyeCombine::Max => values().fold(f64::NEG_INFINITY, f64::max),
                EyeCombine::Mean => values().sum::<f64>() / eyes.len() as f64,
            };
        }
        out
    }

    /// `max` or `mean`.
    pub fn as_str(self) -> &'static str {
        match self {
            EyeCombine::Max => "max",
            EyeCombine::Mean => "mean",
        }
    }
}

/// The challenge's metrics of one set of patients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChallengeScores {
    /// `cohen_kappa_score(gt, pr > 0.5)`; NaN where sklearn's is undefined (truth and
    /// prediction both one constant class).
    pub kappa: f64,
    /// `f1_score(gt, pr > 0.5, average="micro")`: on the flattened binary vector, the share of
    /// cells decided right.
    pub f1: f64,
    /// `roc_auc_score(gt, pr)`; NaN when the truth has only one class.
    pub auc: f64,
    /// `(kappa + f1 + auc) / 3`, the challenge's final score.
    pub score: f64,
    /// Each class's ROC AUC over the patients (NaN for a class with only positives or only
    /// negatives).
    pub auc_per_class: [f64; 8],
}

impl ChallengeScores {
    /// The scores of `probs` against 0/1 `truth`, one row per patient.
    pub fn compute(truth: &[[f32; 8]], probs: &[[f64; 8]]) -> Self {
        let gt: Vec<bool> = truth.iter().flatten().map(|&t| t > 0.5).collect();
        let pr: Vec<f64> = probs.iter().flatten().copied().collect();
        let decided: Vec<bool> = pr.iter().map(|&p| p > THRESHOLD).collect();
        let kappa = cohen_kappa(&gt, &decided);
        let f1 = micro_f1(&gt, &decided);
        let auc = roc_auc(&gt, &pr);
        let mut auc_per_class = [f64::NAN; 8];
        for (k, a) in auc_per_class.iter_mut().enumerate() {
            let t: Vec<bool> = truth.iter().map(|row| row[k] > 0.5).collect();
            let p: Vec<f64> = probs.iter().map(|row| row[k]).collect();
            *a = roc_auc(&t, &p);
        }
        Self {
            kappa,
            f1,
            auc,
            score: (kappa + f1 + auc) / 3.0,
            auc_per_class,
        }
    }
}

/// Cohen's kappa of two binary ratings, as sklearn's `cohen_kappa_score`: `1 - Σ w·C / Σ w·E`
/// with `w` the off-diagonal, `C` the confusion matrix and `E` the outer product of its
/// marginals over the count. NaN when `Σ w·E` is 0 (sklearn's `replace_undefined_by`
/// default) and for no ratings.
pub fn cohen_kappa(a: &[bool], b: &[bool]) -> f64 {
    let mut c = [[0u64; 2]; 2];
    for (&x, &y) in a.iter().zip(b) {
        c[usize::from(x)][usize::from(y)] += 1;
    }
    let n = (c[0][0] + c[0][1] + c[1][0] + c[1][1]) as f64;
    if n == 0.0 {
        return f64::NAN;
    }
    // Marginals: sum0 over a's classes (columns of b), sum1 over b's.
    let sum0 = [(c[0][0] + c[1][0]) as f64, (c[0][1] + c[1][1]) as f64];
    let sum1 = [(c[0][0] + c[0][1]) as f64, (c[1][0] + c[1][1]) as f64];
    let observed = (c[0][1] + c[1][0]) as f64;
    let expected = (sum1[0] * sum0[1] + sum1[1] * sum0[0]) / n;
    if expected == 0.0 {
        return f64::NAN;
    }
    1.0 - observed / expected
}

/// sklearn's `f1_score(truth, pred, average="micro")` of two binary vectors: micro-averaged
/// over both labels, which is the share of equal entries (0 for none).
pub fn micro_f1(truth: &[bool], pred: &[bool]) -> f64 {
    if truth.is_empty() {
        return 0.0;
    }
    let same = truth.iter().zip(pred).filter(|(t, p)| t == p).count();
    same as f64 / truth.len() as f64
}

/// The area under the ROC curve of `scores` against binary `truth`, as sklearn's
/// `roc_auc_score`: the trapezoids between the curve's points at each distinct score, so
/// tied scores count half (the Mann–Whitney U statistic over positives × negatives). NaN
/// when `truth` lacks positives or negatives, and when a score is NaN (where sklearn raises).
pub fn roc_auc(truth: &[bool], scores: &[f64]) -> f64 {
    let Some(order) = descending(truth.len().min(scores.len()), scores) else {
        return f64::NAN;
    };
    let positives = order.iter().filter(|&&i| truth[i]).count() as f64;
    let negatives = order.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return f64::NAN;
    }
    // Walk the thresholds from the highest score down; each group of equal scores moves the
    // curve from (fp, tp) to (fp + its negatives, tp + its positives) in one straight step,
    // a trapezoid of width dfp.
    let (mut tp, mut area) = (0.0f64, 0.0f64);
    let mut i = 0;
    while i < order.len() {
        let s = scores[order[i]];
        let (mut dtp, mut dfp) = (0.0, 0.0);
        while i < order.len() && scores[order[i]] == s {
            if truth[order[i]] {
                dtp += 1.0;
            } else {
                dfp += 1.0;
            }
            i += 1;
        }
        area += dfp * (2.0 * tp + dtp) / 2.0;
        tp += dtp;
    }
    area / (positives * negatives)
}

/// The threshold that maximises the F1 of `scores > threshold` against `truth`, chosen
/// halfway between neighbouring distinct scores (ties: the higher threshold), and always at
/// least the highest score it leaves out and strictly below the lowest it keeps, even where
/// the halfway point rounds onto one of them (adjacent floats: then the score left out).
/// When every score is kept: half the lowest score if that is positive, else the float just
/// below it (a lowest score of 0 is kept too). [`THRESHOLD`] when `truth` has no positive; NaN when a score is NaN.
pub fn best_f1_threshold(truth: &[bool], scores: &[f64]) -> f64 {
    let positives = truth.iter().filter(|&&t| t).count() as f64;
    let Some(order) = descending(truth.len().min(scores.len()), scores) else {
        return f64::NAN;
    };
    if positives == 0.0 {
        return THRESHOLD;
    }
    let (mut tp, mut predicted) = (0.0f64, 0.0f64);
    let (mut best_f1, mut best) = (-1.0, THRESHOLD);
    let mut i = 0;
    while i < order.len() {
        let s = scores[order[i]];
        while i < order.len() && scores[order[i]] == s {
            tp += f64::from(u8::from(truth[order[i]]));
            predicted += 1.0;
            i += 1;
        }
        // Everything scored `s` or higher is predicted positive.
        let f1 = 2.0 * tp / (predicted + positives);
        if f1 > best_f1 {
            best_f1 = f1;
            best = match order.get(i) {
                Some(&next) => between(scores[next], s),
                None => below(s),
            };
        }
    }
    best
}

/// A threshold `t` with `low <= t < high` (`low < high`): halfway where that lies strictly
/// below `high`, else `low` (the halfway point of adjacent floats rounds onto one of them).
fn between(low: f64, high: f64) -> f64 {
    let mid = (low + high) / 2.0;
    if low <= mid && mid < high {
        mid
    } else {
        low
    }
}

/// A threshold strictly below `s` (but for `-inf` and NaN): half of it when positive and
/// finite, else the next float down.
pub(super) fn below(s: f64) -> f64 {
    if s > 0.0 && s.is_finite() {
        s / 2.0
    } else if s == f64::NEG_INFINITY {
        s
    } else {
        s.next_down()
    }
}

/// The first `n` indices of `scores`, highest score first; `None` when one of them is NaN
/// (which equals nothing, so no group of equal scores could end).
fn descending(n: usize, scores: &[f64]) -> Option<Vec<usize>> {
    if scores[..n].iter().any(|s| s.is_nan()) {
        return None;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| scores[j].total_cmp(&scores[i]));
    Some(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_counts_ties_half() {
        // sklearn: roc_auc_score([0, 1, 0, 1], [0.5, 0.5, 0.2, 0.9]) = 0.875.
        let auc = roc_auc(&[false, true, false, true], &[0.5, 0.5, 0.2, 0.9]);
        assert!((auc - 0.875).abs() < 1e-15, "{auc}");
        assert!(roc_auc(&[true, true], &[0.1, 0.2]).is_nan());
        assert_eq!(roc_auc(&[false, true], &[0.3, 0.3]), 0.5);
    }

    #[test]
    fn kappa_and_micro_f1_match_sklearn_by_hand() {
        // sklearn: cohen_kappa_score([1, 0, 1], [1, 1, 1]) = 0.0, of equal constants NaN.
        assert_eq!(cohen_kappa(&[true, false, true], &[true, true, true]), 0.0);
        assert!(cohen_kappa(&[true; 3], &[true; 3]).is_nan());
        // f1_score([1, 1, 0, 0, 0], [1, 0, 0, 0, 0], average="micro") = 0.8.
        let (t, p) = (
            [true, true, false, false, false],
            [true, false, false, false, false],
        );
        assert_eq!(micro_f1(&t, &p), 0.8);
        // Kappa: po = 0.8, pe = (0.4 * 0.2 + 0.6 * 0.8) = 0.56 -> (0.8 - 0.56) / 0.44.
        assert!((cohen_kappa(&t, &p) - 0.24 / 0.44).abs() < 1e-12);
    }

    #[test]
    fn eyes_combine_by_max_or_mean() {
        let eyes = [
            [0.2, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
            [0.6, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ];
        // N is the patient's only when both eyes are normal: the smaller probability.
        assert_eq!(EyeCombine::Max.combine(&eyes)[..2], [0.2, 0.9]);
        assert_eq!(EyeCombine::Max.combine(&eyes)[7], 1.0);
        assert_eq!(EyeCombine::Max.combine(&eyes[1..]), eyes[1]);
        assert_eq!(EyeCombine::Mean.combine(&eyes)[..2], [0.4, 0.5]);
        assert_eq!(EyeCombine::Mean.combine(&eyes[..1]), eyes[0]);
        // A NaN eye makes the patient NaN, whichever way the eyes combine.
        let nan_eye = [[f64::NAN; 8], eyes[1]];
        for combine in [EyeCombine::Max, EyeCombine::Mean] {
            assert!(combine.combine(&nan_eye).iter().all(|p| p.is_nan()));
        }
    }

    /// A NaN score equals nothing: grouping tied scores by `==` never got past it.
    #[test]
    fn a_nan_score_gives_nan_instead_of_a_loop() {
        let truth = [true, false, true, false];
        let scores = [0.9, f64::NAN, 0.4, 0.1];
        assert!(roc_auc(&truth, &scores).is_nan());
        assert!(best_f1_threshold(&truth, &scores).is_nan());
        let probs = [[0.5; 8], [f64::NAN; 8]];
        let scores = ChallengeScores::compute(&[[1.0; 8], [0.0; 8]], &probs);
        assert!(scores.auc.is_nan() && scores.score.is_nan(), "{scores:?}");
    }

    #[test]
    fn the_tuned_threshold_maximises_f1() {
        // Scores 0.9 (pos), 0.7 (neg), 0.4 (pos), 0.1 (neg): predicting the top three gives
        // F1 2*2/(3+2) = 0.8, the best; halfway between 0.4 and 0.1.
        let t = best_f1_threshold(&[true, false, true, false], &[0.9, 0.7, 0.4, 0.1]);
        assert!((t - 0.25).abs() < 1e-15, "{t}");
        assert_eq!(best_f1_threshold(&[false, false], &[0.9, 0.1]), THRESHOLD);
        // Every score positive: below the lowest.
        assert_eq!(best_f1_threshold(&[true, true], &[0.8, 0.6]), 0.3);
    }

    /// The F1 of `scores > threshold` against `truth`.
    fn f1_at(truth: &[bool], scores: &[f64], threshold: f64) -> f64 {
        let (mut tp, mut fp, mut fn_) = (0.0, 0.0, 0.0);
        for (&t, &s) in truth.iter().zip(scores) {
            match (t, s > threshold) {
                (true, true) => tp += 1.0,
                (false, true) => fp += 1.0,
                (true, false) => fn_ += 1.0,
                (false, false) => {}
            }
        }
        2.0 * tp / (2.0 * tp + fp + fn_)
    }

    /// The best F1 any threshold gives: keeping every score, or those above each score.
    fn brute_force_f1(truth: &[bool], scores: &[f64]) -> f64 {
        let keep_all = f1_at(truth, scores, f64::NEG_INFINITY);
        scores
            .iter()
            .map(|&s| f1_at(truth, scores, s))
            .fold(keep_all, f64::max)
    }

    /// A lowest score of 0 that the best F1 keeps (a threshold of 0 left it out), and
    /// neighbouring scores that are adjacent floats (their halfway point rounds onto one).
    #[test]
    fn the_tuned_threshold_keeps_what_the_best_f1_keeps() {
        let half_down = f64::from_bits(0.5f64.to_bits() - 1);
        let one_down = f64::from_bits(1.0f64.to_bits() - 1);
        let cases: [(&[bool], &[f64]); 6] = [
            (&[true, true, false], &[0.9, 0.0, 0.0]),
            (&[true, true], &[0.0, 0.0]),
            (&[true, false], &[0.5, half_down]),
            (&[true, false], &[1.0, one_down]),
            (&[true, true, false], &[0.5, half_down, 0.1]),
            (&[true, true], &[-2.0, 0.5]),
        ];
        for (truth, scores) in cases {
            let t = best_f1_threshold(truth, scores);
            let (got, best) = (f1_at(truth, scores, t), brute_force_f1(truth, scores));
            assert_eq!(got, best, "{truth:?} {scores:?}: threshold {t}");
        }
        assert_eq!(below(0.0), -f64::from_bits(1));
        assert_eq!(below(-2.0), f64::from_bits((-2.0f64).to_bits() + 1));
        assert!(below(-2.0) < -2.0);
        assert_eq!(below(f64::INFINITY), f64::MAX);
        assert_eq!(between(half_down, 0.5), half_down);
    }
}
