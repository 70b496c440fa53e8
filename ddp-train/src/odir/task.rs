//! [`OdirTask`]: the model of `--model` on ODIR-5K, 8-label BCE-with-logits, and exact per-class, macro
//! and micro F1.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use ddp_data::odir::transform::{Augment, Transform};
use ddp_data::odir::{
    split_by_patient, LabelMode, OdirDataset, OdirImages, OdirOptions, Sample, SkippedImage,
};
use ddp_data::{Batch, DataError, Subset};
use ddp_model::weights::LoadReport;
use ddp_model::{Model, ODIR_CLASSES};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tch::{nn, Reduction, Tensor};

use super::challenge::EyeCombine;
use super::cli::{Labels, TrainConfig};
use super::options::{auto_pos_weight, PosWeight};
use super::stats::{OdirStats, Patients};
use crate::error::{Context, TrainError};
use crate::task::Task;

/// Fundus photos to 8 multi-label classes (N D G C A H M O) with the model of `--model`.
#[derive(Debug, Clone)]
pub struct OdirTask {
    train: Subset<OdirImages>,
    val: Subset<OdirImages>,
    options: TrainConfig,
    patients: Arc<Patients>,
    eye_combine: EyeCombine,
    tune_thresholds: bool,
    /// BCE's `pos_weight` (`--pos-weight`).
    pos_weight: Option<Vec<f64>>,
    /// `pos_weight` as a tensor on the device last asked for, made once: a copy from the
    /// host per micro-batch would make the host wait for the GPU's queue every time.
    pos_weight_tensor: Arc<Mutex<Option<Tensor>>>,
    /// The images `--skip-corrupt` left out of `--data` and `--val-data`.
    skipped: Vec<SkippedImage>,
    /// Patient IDs both `--data` and `--val-data` hold.
    shared_patients: Vec<u64>,
    config: Value,
}

/// The ODIR application's model (`--model`, 8 outputs), built under `root`: the one place `ddp-train` (training,
/// `predict`, `evaluate`) constructs it.
pub fn odir_model(root: &nn::Path, c: &TrainConfig) -> Model {
    Model::new(root, c.model, ODIR_CLASSES.len() as i64, c.dropout)
}

impl OdirTask {
    /// Opens `--data` (and `--val-data`), checks every image exists, splits by patient and
    /// prepares the train (`RandomResizedCrop` + flip) and validation (`Resize` +
    /// `CenterCrop`) pipelines. `--skip-corrupt`'s scan, on every rank at once, takes this
    /// rank's share of its machine's cores (`LOCAL_WORLD_SIZE` ranks share them).
    pub fn new(c: &TrainConfig) -> Result<Self, TrainError> {
        let options = rank_data_options(c)?;
        let open = |dir: &Path| {
            // --image-dir is --data's.
            let mut options = options.clone();
            if dir != c.data {
                options.image_dir = None;
            }
            open_labelled(dir, &options, c.labels)
                .map(Arc::new)
                .context(|| format!("loading ODIR data from {}", dir.display()))
        };
        let train_set = open(&c.data)?;
        let mut skipped = train_set.skipped().to_vec();
        let mut shared_patients = Vec::new();
        let (val_set, train, val) = match &c.val_data {
            Some(dir) => {
                let val_set = open(dir)?;
                let ids = |set: &OdirDataset| -> BTreeSet<u64> {
                    set.samples().iter().map(|s| s.patient_id).collect()
                };
                shared_patients = ids(&train_set)
                    .intersection(&ids(&val_set))
                    .copied()
                    .collect();
                skipped.extend_from_slice(val_set.skipped());
                let train = ddp_data::odir::all_indices(&train_set)?;
                let val = ddp_data::odir::all_indices(&val_set)?;
                (val_set, train, val)
            }
            None => {
                let split = split_by_patient(&train_set, c.val_split, c.settings().seed)?;
                (train_set.clone(), split.train, split.val)
            }
        };
        let augment = Transform::random_resized_crop(
            c.image_size,
            (c.min_crop_scale, 1.0),
            ddp_data::odir::transform::DEFAULT_RATIO,
        )?
        .with_hflip(c.hflip)
        .with_augment(Augment {
            vflip: c.vflip,
            rotation: c.rotation,
            jitter: [c.brightness, c.contrast, c.saturation],
        })?;
        let augment = match c.dct_upsampling {
            Some(factor) => augment.with_dct_upsampling(factor)?,
            None => augment,
        };
        let eval = eval_transform(c)?;
        let augment = match c.normalize.mean_std() {
            Some((mean, std)) => augment.with_normalization(mean, std)?,
            None => augment,
        };
        // The training split's labels: the same on every rank (the split is by seed).
        let weights = match &c.pos_weight {
            None => None,
            Some(PosWeight::Given(w)) => Some(w.clone()),
            Some(PosWeight::Auto) => Some(
                auto_pos_weight(
                    train
                        .iter()
                        .filter_map(|&i| train_set.get(i))
                        .map(|s| s.labels),
                )
                .map_err(TrainError::Invalid)?,
            ),
        };
        // Fails only on a path that is not UTF-8, which `TrainConfig::validate` refuses.
        let mut config = serde_json::to_value(c)
            .map_err(|e| TrainError::Invalid(format!("recording the ODIR settings: {e}")))?;
        if let Some(o) = config.as_object_mut() {
            if let Some(w) = &weights {
                o.insert("pos_weight_values".into(), serde_json::json!(w));
            }
            if c.skip_corrupt {
                o.insert("skipped_images".into(), skipped_json(&skipped));
            }
            if c.settings().checkpoint.eval_only {
                for key in super::ODIR_TRAINING_ONLY {
                    o.remove(key);
                }
            }
        }
        let patients = Patients::new(val.iter().filter_map(|&i| val_set.get(i)));
        Ok(Self {
            train: Subset::new(OdirImages::new(train_set, augment), train)?,
            val: Subset::new(OdirImages::new(val_set, eval), val)?,
            options: c.clone(),
            patients: Arc::new(patients),
            eye_combine: c.eye_combine,
            tune_thresholds: c.tune_thresholds,
            pos_weight: weights,
            shared_patients,
            pos_weight_tensor: Arc::default(),
            skipped,
            config,
        })
    }

    /// BCE's `pos_weight` per class (N D G C A H M O), when `--pos-weight` is given.
    pub fn pos_weight(&self) -> Option<&[f64]> {
        self.pos_weight.as_deref()
    }

    /// The loss's `pos_weight` as a tensor on `device` (8 floats), copied there once.
    fn pos_weight_on(&self, device: tch::Device) -> Option<Tensor> {
        let w = self.pos_weight.as_ref()?;
        let mut cached = self
            .pos_weight_tensor
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match cached.as_ref() {
            Some(t) if t.device() == device => Some(t.shallow_clone()),
            _ => {
                let w: Vec<f32> = w.iter().map(|&v| v as f32).collect();
                let t = Tensor::from_slice(&w).to_device(device);
                *cached = Some(t.shallow_clone());
                Some(t)
            }
        }
    }
}

impl Task for OdirTask {
    type Model = Model;
    type Data = Subset<OdirImages>;
    type Stats = OdirStats;

    fn model(&self, root: &nn::Path) -> Model {
        odir_model(root, &self.options)
    }

    fn init_unloaded(&self, model: &Model, report: &LoadReport) -> Vec<String> {
        model.init_unloaded(report)
    }

    fn train_data(&self) -> Self::Data {
        self.train.clone()
    }

    fn val_data(&self) -> Option<Self::Data> {
        Some(self.val.clone())
    }

    fn train_loss(&self, model: &Model, batch: &Batch) -> Tensor {
        model
            .forward_t(batch.inputs(), true)
            .binary_cross_entropy_with_logits::<Tensor>(
                batch.targets(),
                None,
                self.pos_weight_on(batch.targets().device()),
                Reduction::Mean,
            )
    }

    fn new_stats(&self) -> OdirStats {
        OdirStats::new(
            self.patients.clone(),
            self.eye_combine,
            self.tune_thresholds,
        )
    }

    fn eval_batch(&self, model: &Model, batch: &Batch, stats: &mut OdirStats) -> Tensor {
        let logits = model.forward_t(batch.inputs(), false);
        stats.add(&logits, batch);
        // Each sample's loss is the mean over its classes.
        logits.binary_cross_entropy_with_logits::<Tensor>(
            batch.targets(),
            None,
            self.pos_weight_on(batch.targets().device()),
            Reduction::Sum,
        ) / ODIR_CLASSES.len() as f64
    }

    fn describe(&self) -> Value {
        self.config.clone()
    }

    /// `--val-data` is evaluated whole, whatever the seed.
    fn validation_depends_on_seed(&self) -> bool {
        self.options.val_data.is_none()
    }

    /// The folders, and the images `--skip-corrupt` left out by path (their number is
    /// checked as the samples' are).
    fn location_keys(&self) -> &[&str] {
        &["data", "val_data", "image_dir", "skipped_images"]
    }

    /// Only `--val-data`: another `--image-dir`, or none, holds the same images (their
    /// list is compared), and the images `--skip-corrupt` leaves out follow that flag.
    fn presence_keys(&self) -> &[&str] {
        &["val_data"]
    }

    /// `files`: the images (patient and file name, in order of both, wherever the folder
    /// lies), `split`: which of them train and which validate, `labels`: each image's labels
    /// and its patient's.
    fn data_fingerprint(&self) -> Option<Vec<(String, [u8; 32])>> {
        let lists = [&self.train, &self.val].map(|subset| {
            let set = subset.dataset().set();
            let samples = subset.indices().iter().filter_map(|&i| set.get(i));
            samples.collect::<Vec<_>>()
        });
        Some(data_fingerprint(&lists))
    }

    fn warnings(&self) -> Vec<String> {
        let mut lines = self.options.warnings();
        if let (Some(first), Some(val)) = (self.shared_patients.first(), &self.options.val_data) {
            lines.push(format!(
                "--val-data {} shares {} patient ID(s) with --data (the first: {first}): the \
                 validation scores then count patients the model trains on",
                val.display(),
                self.shared_patients.len()
            ));
        }
        lines.extend(skipped_lines(&self.skipped));
        lines
    }
}

/// One line per image `--skip-corrupt` left out, naming it and the decoder's reason.
pub(super) fn skipped_lines(skipped: &[SkippedImage]) -> Vec<String> {
    skipped
        .iter()
        .map(|s| {
            format!(
                "left out {} (--skip-corrupt): {}",
                s.path.display(),
                s.reason
            )
        })
        .collect()
}

/// [`OdirTask::data_fingerprint`] of the training and validation lists, in order.
fn data_fingerprint(lists: &[Vec<&Sample>; 2]) -> Vec<(String, [u8; 32])> {
    let image = |s: &Sample| {
        let name = s.path.file_name().unwrap_or_default().as_encoded_bytes();
        let mut bytes = s.patient_id.to_le_bytes().to_vec();
        bytes.extend_from_slice(&(name.len() as u64).to_le_bytes());
        bytes.extend_from_slice(name);
        bytes
    };
    let mut sorted: Vec<&Sample> = lists.iter().flatten().copied().collect();
    sorted.sort_by_key(|s| image(s));
    let (mut files, mut split, mut labels) = (Sha256::new(), Sha256::new(), Sha256::new());
    for s in &sorted {
        files.update(image(s));
        let patient = s.patient_labels.map_or([f32::NAN; 8], |l| l);
        for value in s.labels.iter().chain(&patient) {
            labels.update(value.to_bits().to_le_bytes());
        }
    }
    for list in lists {
        split.update((list.len() as u64).to_le_bytes());
        list.iter().for_each(|s| split.update(image(s)));
    }
    [("files", files), ("split", split), ("labels", labels)]
        .map(|(name, digest)| (name.to_string(), digest.finalize().into()))
        .to_vec()
}

/// The images `--skip-corrupt` left out, as `config.json` and `evaluation.json` list them.
pub(super) fn skipped_json(skipped: &[SkippedImage]) -> Value {
    skipped
        .iter()
        .map(|s| serde_json::json!({ "path": s.path.to_string_lossy(), "reason": s.reason }))
        .collect()
}

/// The evaluation transform (`Resize` to `--eval-resize`, by default 8/7 of `--image-size`,
/// with `--eval-interpolation`, then `CenterCrop`, then `--normalize`), for validation,
/// `predict` and `evaluate` alike.
pub(super) fn eval_transform(c: &TrainConfig) -> Result<Transform, TrainError> {
    let resize = c
        .eval_resize
        .unwrap_or_else(|| default_eval_resize(c.image_size));
    let eval = Transform::eval(resize, c.image_size)?
        .with_interpolation(c.eval_interpolation.interpolation());
    Ok(match c.normalize.mean_std() {
        Some((mean, std)) => eval.with_normalization(mean, std)?,
        None => eval,
    })
}

/// `--eval-resize`'s default for crops of `image_size`: 8/7 of it (256 for 224).
pub(super) fn default_eval_resize(image_size: u32) -> u32 {
    u32::try_from(u64::from(image_size) * 8 / 7).unwrap_or(u32::MAX)
}

/// Opens a labelled folder with `options`; a folder without per-eye labels under `--labels
/// eye` is told to take the patient columns.
pub(super) fn open_labelled(
    dir: &Path,
    options: &OdirOptions,
    labels: Labels,
) -> Result<OdirDataset, TrainError> {
    OdirDataset::open(dir, options).map_err(|e| match &e {
        DataError::MissingColumn { column, .. } if column == "target" && labels == Labels::Eye => {
            TrainError::Invalid(format!(
                "{e}: --labels eye needs per-eye labels; --labels patient (or auto) takes the \
                 patient columns N..O"
            ))
        }
        _ => TrainError::from(e),
    })
}

/// How `--data` is opened: the labels and `--skip-corrupt` as given, its scan on the
/// machine's cores shared among the `ranks_on_machine` ranks that scan at once (as the
/// loader's workers share them).
fn data_options(c: &TrainConfig, ranks_on_machine: usize) -> OdirOptions {
    OdirOptions {
        labels: match c.labels {
            Labels::Auto => LabelMode::Auto,
            Labels::Eye => LabelMode::PerEye,
            Labels::Patient => LabelMode::Patient,
        },
        skip_corrupt: c.skip_corrupt,
        image_dir: c.image_dir.clone(),
        scan_threads: Some(ddp_data::default_workers(ranks_on_machine)),
    }
}

/// [`data_options`] for this rank: the ranks on its machine are the environment's
/// (`LOCAL_WORLD_SIZE`), read only for `--skip-corrupt`, the one option that needs them.
pub(super) fn rank_data_options(c: &TrainConfig) -> Result<OdirOptions, TrainError> {
    let ranks_on_machine = if c.skip_corrupt {
        ddp_comm::EnvConfig::from_env()
            .context(|| "reading the rank's environment".into())?
            .local_world_size
    } else {
        1
    };
    Ok(data_options(c, ranks_on_machine))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use clap::Parser;

    use super::*;

    /// Each part of the fingerprint changes with what it covers alone: another copy of the
    /// folder keeps all three.
    #[test]
    fn the_data_fingerprint_names_files_split_and_labels_apart() {
        let sample = |id: u64, file: &str, first: f32| Sample {
            path: format!("/copy-a/preprocessed_images/{file}").into(),
            patient_id: id,
            labels: [first, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            patient_labels: None,
        };
        let images = [
            sample(1, "1_left.jpg", 1.0),
            sample(1, "1_right.jpg", 0.0),
            sample(2, "2_left.jpg", 1.0),
        ];
        let parts = |lists: [Vec<&Sample>; 2]| data_fingerprint(&lists);
        let base = parts([vec![&images[0], &images[1]], vec![&images[2]]]);
        let names: Vec<&str> = base.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["files", "split", "labels"]);
        let differing = |other: &[(String, [u8; 32])]| -> Vec<String> {
            base.iter()
                .zip(other)
                .filter(|(a, b)| a.1 != b.1)
                .map(|(a, _)| a.0.clone())
                .collect()
        };
        let mut copy = images.clone();
        for s in &mut copy {
            s.path = PathBuf::from("/copy-b/preprocessed_images").join(s.path.file_name().unwrap());
        }
        let elsewhere = parts([vec![&copy[0], &copy[1]], vec![&copy[2]]]);
        assert!(differing(&elsewhere).is_empty());
        let mut relabelled = images.clone();
        relabelled[1].labels[0] = 1.0;
        let other_labels = parts([vec![&relabelled[0], &relabelled[1]], vec![&relabelled[2]]]);
        assert_eq!(differing(&other_labels), ["labels"]);
        let other_split = parts([vec![&images[2]], vec![&images[0], &images[1]]]);
        assert_eq!(differing(&other_split), ["split"]);
        let mut renamed = images.clone();
        renamed[2].path.set_file_name("2_right.jpg");
        let other_files = parts([vec![&renamed[0], &renamed[1]], vec![&renamed[2]]]);
        assert_eq!(differing(&other_files), ["files", "split"]);
    }

    #[test]
    fn the_corrupt_image_scan_takes_this_ranks_share_of_the_cores() {
        let args = ["ddp-train", "--data", "d", "--skip-corrupt"];
        let c = TrainConfig::try_parse_from(args).unwrap();
        for ranks in [1, 2, 8] {
            let options = data_options(&c, ranks);
            assert!(options.skip_corrupt);
            assert_eq!(options.scan_threads, Some(ddp_data::default_workers(ranks)));
        }
    }
}
