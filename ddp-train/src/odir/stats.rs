//! [`OdirStats`]: ODIR's evaluation statistics. Per image, the exact thresholded counts of
//! [`MultiLabelStats`] (macro and micro F1); per patient, the challenge's score
//! ([`ChallengeScores`]) from every image's probabilities, gathered exactly across ranks.

use std::collections::BTreeMap;
use std::sync::Arc;

use ddp_data::odir::{Sample, LABELS};
use ddp_data::Batch;
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

use super::challenge::{best_f1_threshold, ChallengeScores, EyeCombine};
use crate::gather::Rows;
use crate::metrics::{MultiLabelStats, StatsError};
use crate::task::{Metrics, Stats};

/// Who each sample of an evaluated split is, and each patient's labels.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Patients {
    /// The patient of each sample, by the sample's index in the split.
    of_sample: Vec<u64>,
    /// Each patient's labels.
    truth: BTreeMap<u64, [f32; 8]>,
}

impl Patients {
    /// The patients of `samples`, in split order. A patient's labels are the annotations'
    /// patient columns (`N`..`O`); where they have none, the union of the eyes' labels, with
    /// `N` only when no disease is set (the challenge's rule for a patient).
    pub fn new<'a>(samples: impl IntoIterator<Item = &'a Sample>) -> Self {
        let mut p = Self::default();
        let mut eyes: BTreeMap<u64, [f32; 8]> = BTreeMap::new();
        for s in samples {
            p.of_sample.push(s.patient_id);
            match s.patient_labels {
                Some(labels) => {
                    p.truth.insert(s.patient_id, labels);
                }
                None => {
                    let union = eyes.entry(s.patient_id).or_default();
                    for (u, &l) in union.iter_mut().zip(&s.labels) {
                        *u = u.max(l);
                    }
                }
            }
        }
        for (id, mut union) in eyes {
            union[0] = if union[1..].iter().any(|&l| l > 0.5) {
                0.0
            } else {
                1.0
            };
            p.truth.entry(id).or_insert(union);
        }
        p
    }

    /// The patient of the split's sample `index`.
    pub fn patient_of(&self, index: usize) -> Option<u64> {
        self.of_sample.get(index).copied()
    }

    /// Patient `id`'s labels.
    pub fn labels(&self, id: u64) -> Option<&[f32; 8]> {
        self.truth.get(&id)
    }
}

/// Patient-level predictions: each patient's combined probabilities, ascending by ID.
#[derive(Debug, Clone, PartialEq)]
pub struct PatientPredictions {
    /// `(ID, probabilities in N..O order)`.
    pub rows: Vec<(u64, [f64; 8])>,
    /// Patients that had one image only (predicted from it alone).
    pub one_eye: Vec<u64>,
}

/// Each sample's probabilities (`rows`, keyed by split index) combined per patient.
pub fn combine_patients(
    patients: &Patients,
    rows: &Rows,
    combine: EyeCombine,
) -> PatientPredictions {
    let mut by_patient: BTreeMap<u64, Vec<[f64; 8]>> = BTreeMap::new();
    for (key, row) in rows.iter() {
        let Some(id) = patients.patient_of(key as usize) else {
            continue;
        };
        let mut p = [0.0; 8];
        p.copy_from_slice(&row[..8]);
        by_patient.entry(id).or_default().push(p);
    }
    let one_eye = by_patient
        .iter()
        .filter(|(_, eyes)| eyes.len() == 1)
        .map(|(&id, _)| id)
        .collect();
    PatientPredictions {
        rows: by_patient
            .into_iter()
            .map(|(id, eyes)| (id, combine.combine(&eyes)))
            .collect(),
        one_eye,
    }
}

/// ODIR's evaluation: per-image counts and F1 (`val_macro_f1`, `val_micro_f1`,
/// `val_f1_per_class`), and per patient the challenge's `odir_kappa`, `odir_f1`, `odir_auc`,
/// `odir_score` and `odir_auc_per_class`, with the eyes combined as chosen; with tuned
/// thresholds also `odir_thresholds`, each class's F1-maximising threshold on the split's
/// patients, which [`Stats::beside_best_model`] saves beside the best models.
#[derive(Debug, Clone)]
pub struct OdirStats {
    eyes: MultiLabelStats,
    rows: Rows,
    patients: Arc<Patients>,
    combine: EyeCombine,
    tune_thresholds: bool,
}

impl OdirStats {
    /// Empty statistics of the split whose samples `patients` describes.
    pub fn new(patients: Arc<Patients>, combine: EyeCombine, tune_thresholds: bool) -> Self {
        Self {
            eyes: MultiLabelStats::new(LABELS.len()),
            rows: Rows::new(LABELS.len()),
            patients,
            combine,
            tune_thresholds,
        }
    }

    /// Adds a batch: `[B, 8]` logits of the batch's samples.
    ///
    /// # Panics
    /// When the logits are not `[B, 8]` for the batch's `B` samples, naming the shapes.
    pub fn add(&mut self, logits: &Tensor, batch: &Batch) {
        self.try_add(logits, batch)
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Adds a batch as [`OdirStats::add`] does, or says why it cannot.
    pub fn try_add(&mut self, logits: &Tensor, batch: &Batch) -> Result<(), StatsError> {
        let samples = batch.indices().len();
        if logits.size() != [samples as i64, LABELS.len() as i64] {
            return Err(StatsError::Shape(format!(
                "ODIR needs logits of shape [{samples}, {}] for a batch of {samples} images, \
                 got {:?}",
                LABELS.len(),
                logits.size()
            )));
        }
        self.eyes.try_add(logits, batch.targets())?;
        let probs = logits
            .detach()
            .to_kind(Kind::Double)
            .sigmoid()
            .to_device(Device::Cpu)
            .reshape([-1]);
        let probs = Vec::<f64>::try_from(probs)?;
        for (&index, row) in batch.indices().iter().zip(probs.chunks_exact(LABELS.len())) {
            self.rows.push(index as u64, row);
        }
        Ok(())
    }

    /// Every image's probabilities, keyed by its index in the split (after
    /// [`Stats::set_rows`]: every rank's).
    pub fn image_rows(&self) -> &Rows {
        &self.rows
    }

    /// The patients' combined predictions.
    pub fn patient_predictions(&self) -> PatientPredictions {
        combine_patients(&self.patients, &self.rows, self.combine)
    }

    /// The challenge's scores of the patients evaluated; `None` before any.
    pub fn challenge(&self) -> Option<ChallengeScores> {
        let (truth, probs) = self.truth_and_probs();
        (!probs.is_empty()).then(|| ChallengeScores::compute(&truth, &probs))
    }

    /// Each class's F1-maximising threshold over the patients evaluated.
    pub fn tuned_thresholds(&self) -> [f64; 8] {
        let (truth, probs) = self.truth_and_probs();
        let mut out = [0.0; 8];
        for (k, t) in out.iter_mut().enumerate() {
            let gt: Vec<bool> = truth.iter().map(|r| r[k] > 0.5).collect();
            let pr: Vec<f64> = probs.iter().map(|r| r[k]).collect();
            *t = best_f1_threshold(&gt, &pr);
        }
        out
    }

    fn truth_and_probs(&self) -> (Vec<[f32; 8]>, Vec<[f64; 8]>) {
        self.patient_predictions()
            .rows
            .into_iter()
            .filter_map(|(id, p)| Some((*self.patients.labels(id)?, p)))
            .unzip()
    }
}

impl Stats for OdirStats {
    fn to_sums(&self) -> Vec<f64> {
        self.eyes.to_sums()
    }

    fn set_sums(&mut self, sums: &[f64]) {
        self.eyes.set_sums(sums);
    }

    fn rows(&self) -> Option<Rows> {
        Some(self.rows.clone())
    }

    fn set_rows(&mut self, rows: Rows) {
        self.rows = rows;
    }

    /// Before any patient, the challenge's numbers are NaN (the same names either way).
    fn report(&self) -> Metrics {
        let challenge = self.challenge();
        let c = challenge.unwrap_or(ChallengeScores {
            kappa: f64::NAN,
            f1: f64::NAN,
            auc: f64::NAN,
            score: f64::NAN,
            auc_per_class: [f64::NAN; 8],
        });
        let m = self
            .eyes
            .report()
            .number("odir_kappa", c.kappa)
            .number("odir_f1", c.f1)
            .number("odir_auc", c.auc)
            .number("odir_score", c.score)
            .list("odir_auc_per_class", c.auc_per_class);
        match (self.tune_thresholds, challenge) {
            (true, Some(_)) => m.list("odir_thresholds", self.tuned_thresholds()),
            (true, None) => m.list("odir_thresholds", [f64::NAN; 8]),
            (false, _) => m,
        }
    }

    fn details(&self) -> Metrics {
        let p = self.patient_predictions();
        self.eyes
            .details()
            .count("odir_patients", p.rows.len() as i64)
    }

    fn summary(&self) -> String {
        let eyes = self.eyes.summary();
        match self.challenge() {
            Some(c) => format!(
                "{eyes}  challenge score {:.3} (kappa {:.3}, F1 {:.3}, AUC {:.3})",
                c.score, c.kappa, c.f1, c.auc
            ),
            None => eyes,
        }
    }

    fn beside_best_model(&self) -> Option<Value> {
        self.tune_thresholds.then(|| {
            json!({
                "classes": LABELS,
                "thresholds": self.tuned_thresholds(),
                "eye_combine": self.combine.as_str(),
                "tuned_on_patients": self.patient_predictions().rows.len(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::cli::Defaults;
    use crate::odir::OdirDefaults;

    /// Two patients of one eye each, a normal one and a diabetic one.
    fn patients() -> Arc<Patients> {
        let sample = |id: u64, disease: usize| {
            let mut labels = [0.0; 8];
            labels[disease] = 1.0;
            Sample {
                path: PathBuf::from(format!("{id}_left.jpg")),
                patient_id: id,
                labels,
                patient_labels: Some(labels),
            }
        };
        Arc::new(Patients::new(&[sample(1, 0), sample(2, 1)]))
    }

    /// The Trainer checks what ODIR's defaults watch against a fresh report at start: it
    /// names every metric a scored one does (NaN before any patient), `odir_score` included.
    #[test]
    fn a_fresh_report_names_what_a_scored_one_does() {
        for tune in [false, true] {
            let fresh = OdirStats::new(patients(), EyeCombine::Max, tune).report();
            let mut scored = OdirStats::new(patients(), EyeCombine::Max, tune);
            let mut rows = Rows::new(LABELS.len());
            rows.push(0, &[0.9, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
            rows.push(1, &[0.2, 0.8, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
            scored.set_rows(rows);
            let scored = scored.report().into_map();
            assert_eq!(scored["odir_score"], 1.0, "{scored:?}");
            let fresh = fresh.into_map();
            let keys = |m: &serde_json::Map<String, Value>| m.keys().cloned().collect::<Vec<_>>();
            assert_eq!(keys(&fresh), keys(&scored));
            assert_eq!(fresh["odir_score"], Value::Null);
            assert_eq!(fresh.contains_key("odir_thresholds"), tune);
            assert_eq!(OdirDefaults::settings().check_watched(Some(&fresh)), Ok(()));
        }
    }
}
