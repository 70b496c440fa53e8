//! Train/validation splits by patient, so both eyes of a patient land on the same side.

use std::collections::HashSet;

use super::dataset::OdirDataset;
use crate::error::DataError;
use crate::rng::SampleRng;

/// Sample indices of the two sides of a split, each in ascending order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// Training sample indices.
    pub train: Vec<usize>,
    /// Validation sample indices.
    pub val: Vec<usize>,
}

/// Splits `dataset` by patient `ID`: the distinct patients are shuffled with a generator seeded
/// by `seed` and the first `round(val_fraction * patients)` go to validation.
///
/// The result depends only on the patient IDs, `val_fraction` and `seed` (not on row order or
/// on the machine), so every rank computes the same split.
pub fn split_by_patient(
    dataset: &OdirDataset,
    val_fraction: f64,
    seed: u64,
) -> Result<Split, DataError> {
    if !(val_fraction > 0.0 && val_fraction < 1.0) {
        return Err(DataError::InvalidParameter {
            name: "validation fraction",
            expected: "a number strictly between 0 and 1".to_string(),
            value: val_fraction.to_string(),
        });
    }
    if dataset.is_empty() {
        // Nothing left to split (every image skipped as corrupt): say so, not that the split
        // came out empty.
        all_indices(dataset)?;
    }
    let mut patients: Vec<u64> = dataset.samples().iter().map(|s| s.patient_id).collect();
    patients.sort_unstable();
    patients.dedup();
    let n = patients.len();
    let mut rng = SampleRng::from_seed_and_tag(seed, b"split\0\0\0", 0);
    // Fisher-Yates.
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        patients.swap(i, j);
    }
    let n_val = (val_fraction * n as f64).round() as usize;
    let val_patients: HashSet<u64> = patients[..n_val.min(n)].iter().copied().collect();
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (i, s) in dataset.samples().iter().enumerate() {
        if val_patients.contains(&s.patient_id) {
            val.push(i);
        } else {
            train.push(i);
        }
    }
    for (side, v) in [("train", &train), ("validation", &val)] {
        if v.is_empty() {
            return Err(DataError::EmptySplit {
                side,
                patients: n,
                fraction: val_fraction,
            });
        }
    }
    Ok(Split { train, val })
}

/// Every index of `dataset`, for a side given by its own folder (an explicit validation
/// folder); an error if it has no usable samples.
pub fn all_indices(dataset: &OdirDataset) -> Result<Vec<usize>, DataError> {
    if dataset.is_empty() {
        return Err(DataError::EmptyDataset {
            root: dataset.root().to_path_buf(),
            skipped: dataset.skipped().len(),
            first: dataset
                .skipped()
                .first()
                .map(|s| format!("{}: {}", s.path.display(), s.reason)),
        });
    }
    Ok((0..dataset.len()).collect())
}
