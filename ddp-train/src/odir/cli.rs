//! The `ddp-train` command line: the ODIR application's flags, which become the
//! [`OdirTask`](super::OdirTask)'s options (written to `config.json` as the task's), and the
//! generic Trainer's flags with ODIR's defaults ([`OdirDefaults`]), which become its
//! [`Settings`].

use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};

use ddp_model::ModelKind;

use super::challenge::EyeCombine;
use super::options::{EvalInterpolation, Normalize, PosWeight};
use crate::cli::{Defaults, TrainArgs};
use crate::error::TrainError;
use crate::lr_schedule::{LrSchedule, Plateau};
use crate::scheduler::PlateauConfig;
use crate::settings::{non_utf8, EarlyStopping, Monitor, Settings};

/// ODIR's defaults for the generic flags: batches of 16, `ReduceLROnPlateau` on validation
/// macro-F1 (halving at the third epoch without improvement, patience 2, down to 1e-6),
/// early stopping on it once given a patience, and the best macro-F1, micro-F1 and
/// challenge-score models kept.
#[derive(Debug, Clone, Copy, Default)]
pub struct OdirDefaults;

impl Defaults for OdirDefaults {
    fn settings() -> Settings {
        let plateau = PlateauConfig {
            factor: 0.5,
            patience: 2,
            min_lr: 1e-6,
            ..PlateauConfig::default()
        };
        Settings::default()
            .batch_size(16)
            .lr_schedule(LrSchedule::Plateau(
                Plateau::max("val_macro_f1").with(plateau),
            ))
            .early_stopping(EarlyStopping::max("val_macro_f1"))
            .monitor(Monitor::max("val_macro_f1", "best-macro.safetensors"))
            .monitor(Monitor::max("val_micro_f1", "best-micro.safetensors"))
            .monitor(Monitor::max("odir_score", "best-score.safetensors"))
    }
}

/// Which labels to train on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Labels {
    /// Per-eye labels (`target`) where the annotations have them, else patient labels.
    Auto,
    /// Per-eye labels; an error when the annotations have none.
    #[value(alias = "per-eye")]
    Eye,
    /// Patient labels (`N`..`O`), the same for both eyes.
    Patient,
}

/// One rank of a data-parallel training of a ConvNet, ResNet or EfficientNet on ODIR-5K.
///
/// The rank, world size and rendezvous address come from torchrun's environment (`RANK`,
/// `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), or SLURM's;
/// without them this is a single-process run. `cargo xtask train` starts N of these.
#[derive(Debug, Clone, Parser, Serialize, Deserialize)]
#[command(name = "ddp-train", version, about, long_about = None)]
pub struct TrainConfig {
    /// ODIR folder: `full_df.csv` + `preprocessed_images/` (or Kaggle's
    /// `ODIR-5K/ODIR-5K/Training Images/`), the challenge workbook (`data.xlsx`) +
    /// `Training Images/`, or an OIA-ODIR set (`Training Set/`: `Annotation/` + `Images/`).
    #[arg(long)]
    pub data: PathBuf,

    /// The folder that holds --data's images, when it is none of the layout's usual ones
    /// (preprocessed_images/, Training Images/, ODIR-5K/ODIR-5K/Training Images/, ...).
    #[arg(long, value_name = "DIR")]
    #[serde(default)]
    pub image_dir: Option<PathBuf>,

    /// A separate ODIR folder for validation (instead of splitting --data).
    #[arg(long, conflicts_with = "val_split")]
    pub val_data: Option<PathBuf>,

    /// Fraction of --data's patients held out for validation (both eyes of a patient always
    /// fall on the same side).
    #[arg(long, default_value_t = 0.2)]
    pub val_split: f64,

    /// Labels: per-eye (`target`) by default, because a patient's diagnosis may concern only
    /// one eye, and each image shows one eye; `patient` uses the patient-level N..O columns.
    #[arg(long, value_enum, default_value_t = Labels::Auto)]
    pub labels: Labels,

    /// Skip images that fail to decode (each one is reported) instead of stopping; a file
    /// that cannot be read still stops the run.
    #[arg(long)]
    pub skip_corrupt: bool,

    /// Side of the square training crops (RandomResizedCrop) and of the validation crops.
    #[arg(long, default_value_t = 224)]
    pub image_size: u32,

    /// Smallest crop area as a fraction of the image (RandomResizedCrop's scale lower bound;
    /// torchvision's default is 0.08, milder here for fundus photos).
    #[arg(long, default_value_t = 0.2)]
    pub min_crop_scale: f64,

    /// Also flip training images horizontally with probability 1/2.
    #[arg(long)]
    pub hflip: bool,

    /// Also flip training images vertically with probability 1/2 (RandomVerticalFlip).
    #[arg(long)]
    #[serde(default)]
    pub vflip: bool,

    /// Rotate training images by up to this many degrees either way (RandomRotation:
    /// nearest neighbour, black corners); 0 is off.
    #[arg(long, value_name = "DEGREES", default_value_t = 0.0)]
    #[serde(default)]
    pub rotation: f64,

    /// ColorJitter's brightness: a factor in [max(0, 1 - B), 1 + B] per image; 0 is off.
    #[arg(long, value_name = "B", default_value_t = 0.0)]
    #[serde(default)]
    pub brightness: f64,

    /// ColorJitter's contrast: a factor in [max(0, 1 - C), 1 + C] per image; 0 is off.
    #[arg(long, value_name = "C", default_value_t = 0.0)]
    #[serde(default)]
    pub contrast: f64,

    /// ColorJitter's saturation: a factor in [max(0, 1 - S), 1 + S] per image; 0 is off.
    #[arg(long, value_name = "S", default_value_t = 0.0)]
    #[serde(default)]
    pub saturation: f64,

    /// Normalize after ToTensor: imagenet (the means and deviations pretrained torchvision
    /// models expect), none, or MEAN,STD for all channels.
    #[arg(long, value_name = "imagenet|none|MEAN,STD", default_value_t = Normalize::None)]
    #[serde(default)]
    pub normalize: Normalize,

    /// The evaluation transform's Resize (shorter side, bilinear, antialiased) before
    /// CenterCrop(--image-size); default 8/7 of --image-size (256 for 224). Equal to
    /// --image-size: Resize(S) + CenterCrop(S).
    #[arg(long, value_name = "PIXELS")]
    #[serde(default)]
    pub eval_resize: Option<u32>,

    /// The evaluation transform's Resize filter: bilinear (torchvision's default, its ResNet
    /// weights' transforms) or bicubic (EfficientNet-B0's ImageNet weights evaluate with
    /// Resize(256, BICUBIC): give --eval-resize 256 --eval-interpolation bicubic).
    #[arg(long, value_enum, value_name = "bilinear|bicubic", default_value_t = EvalInterpolation::Bilinear)]
    #[serde(default)]
    pub eval_interpolation: EvalInterpolation,

    /// BCE's pos_weight per class: auto (negatives / positives over the training split,
    /// recorded in config.json) or W1,...,W8 in N D G C A H M O order.
    #[arg(long, value_name = "auto|W1,...,W8")]
    #[serde(default)]
    pub pos_weight: Option<PosWeight>,

    /// The model: convnet (the small ConvNet, from scratch), or torchvision's resnet18,
    /// resnet34, resnet50 or efficientnet_b0, with torchvision's parameter names (so a
    /// torchvision state_dict loads by name).
    #[arg(long, value_name = "MODEL", default_value_t = ModelKind::Convnet)]
    #[serde(default)]
    pub model: ModelKind,

    /// Dropout probability before the classifier: the ConvNet's (default 0.5) or
    /// EfficientNet's `classifier.0` (default torchvision's 0.2). The ResNets have none, and
    /// refuse it as torchvision's `resnet50(dropout=...)` does.
    #[arg(long)]
    #[serde(default)]
    pub dropout: Option<f64>,

    /// Decode training JPEGs at 1/2, 1/4 or 1/8 scale when the crop then needs enlarging by
    /// at most this factor (1: only while the final resize still shrinks it; 2: about what
    /// PIL's `draft` does): faster on large photos, but the pixels are no longer
    /// torchvision's (a few levels apart). Without it every JPEG is decoded in full, as
    /// torchvision does; evaluation always is.
    #[arg(long, value_name = "F")]
    #[serde(default)]
    pub dct_upsampling: Option<f64>,

    /// How a patient's two eyes combine into the patient's prediction, for the challenge's
    /// patient-level score (`odir_score`) and `predict`'s submission: each disease's larger
    /// probability and N's smaller, normal only when both eyes are (`max`), or each class's
    /// mean (`mean`).
    #[arg(long, value_enum, default_value_t = EyeCombine::Max)]
    #[serde(default)]
    pub eye_combine: EyeCombine,

    /// Tune each class's threshold on the validation split's patients to maximise its F1,
    /// saved as `<best model>.json` beside each best model for `predict` (the challenge's
    /// own metrics stay at 0.5).
    #[arg(long)]
    #[serde(default)]
    pub tune_thresholds: bool,

    /// Every generic training flag (epochs, batch size, optimizer, schedule, precision, DDP,
    /// checkpoints, ...); `config.json` records their settings on their own.
    #[command(flatten)]
    #[serde(skip)]
    pub train: TrainArgs<OdirDefaults>,
}

impl TrainConfig {
    /// Checks the settings that can be checked without data or peers.
    pub fn validate(&self) -> Result<(), TrainError> {
        let invalid = |m: String| Err(TrainError::Invalid(m));
        utf8_paths([
            ("--data", Some(self.data.as_path())),
            ("--image-dir", self.image_dir.as_deref()),
            ("--val-data", self.val_data.as_deref()),
        ])?;
        let min = self.model.min_image_size() as u32;
        if self.image_size < min {
            let why = match self.model {
                ModelKind::Convnet => "the ConvNet's four 2x poolings need",
                _ => "the model needs",
            };
            return invalid(format!(
                "--image-size {} is too small: {why} at least {min}",
                self.image_size
            ));
        }
        if let Some(f) = self
            .dct_upsampling
            .filter(|f| !(*f >= 1.0 && f.is_finite()))
        {
            return invalid(format!(
                "--dct-upsampling {f} must be a number >= 1 (leave it out to decode every JPEG \
                 in full, as torchvision does)"
            ));
        }
        if !(0.0..=180.0).contains(&self.rotation) {
            return invalid(format!(
                "--rotation {} must be degrees in [0, 180]",
                self.rotation
            ));
        }
        for (flag, v) in [
            ("--brightness", self.brightness),
            ("--contrast", self.contrast),
            ("--saturation", self.saturation),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return invalid(format!("{flag} {v} must be a number >= 0"));
            }
        }
        if let Some(r) = self.eval_resize.filter(|&r| r < self.image_size) {
            return invalid(format!(
                "--eval-resize {r} is smaller than --image-size {}: the centre crop would \
                 not fit",
                self.image_size
            ));
        }
        if let Some(d) = self.dropout.filter(|d| !(0.0..1.0).contains(d)) {
            return invalid(format!("--dropout {d} must be in [0, 1)"));
        }
        // An architecture without a default dropout has no dropout layer (the ResNets).
        if self.dropout.is_some() && self.model.default_dropout().is_none() {
            return invalid(format!(
                "--dropout applies to the convnet and efficientnet_b0 models: torchvision's \
                 {} has no dropout layer (leave the flag out)",
                self.model
            ));
        }
        // Read only when --data is split (no --val-data), but checked before any data is.
        if self.val_data.is_none() && !(self.val_split > 0.0 && self.val_split < 1.0) {
            return invalid(format!(
                "--val-split {} must be a fraction strictly between 0 and 1 (of the \
                 patients held out for validation)",
                self.val_split
            ));
        }
        if !(self.min_crop_scale > 0.0 && self.min_crop_scale <= 1.0) {
            return invalid(format!(
                "--min-crop-scale {} must be in (0, 1]",
                self.min_crop_scale
            ));
        }
        self.train.validate()?;
        Ok(self.settings().validate()?)
    }

    /// The generic Trainer's settings these flags stand for ([`OdirDefaults`] with the given
    /// flags applied).
    pub fn settings(&self) -> Settings {
        self.train.settings()
    }

    /// Settings that are valid but probably not meant, one sentence each.
    pub fn warnings(&self) -> Vec<String> {
        let mut lines = Vec::new();
        // torchvision's pretrained weights were trained on Normalize(ImageNet).
        if let (Some(file), Normalize::None, false) = (
            &self.settings().checkpoint.init_from,
            self.normalize,
            self.model == ModelKind::Convnet,
        ) {
            lines.push(format!(
                "--init-from {} into torchvision's {} with --normalize none: torchvision's \
                 pretrained weights expect ImageNet's normalisation, so give --normalize \
                 imagenet unless these weights were trained on unnormalised pixels",
                file.display(),
                self.model
            ));
        }
        lines
    }
}

/// Refuses the first given path that is not valid UTF-8, naming its flag (`--data`).
pub(super) fn utf8_paths<'a>(
    flags: impl IntoIterator<Item = (&'static str, Option<&'a Path>)>,
) -> Result<(), TrainError> {
    for (flag, path) in flags {
        if let Some(why) = path.and_then(non_utf8) {
            return Err(TrainError::Invalid(format!("{flag}{why}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validate(flags: &[&str]) -> Result<(), String> {
        let args = ["ddp-train", "--data", "d"].iter().chain(flags);
        TrainConfig::try_parse_from(args)
            .unwrap()
            .validate()
            .map_err(|e| e.to_string())
    }

    /// The folders' paths are recorded as text (`config.json`'s task, which `predict` reads
    /// back): one that is not UTF-8 is refused naming its flag, not recorded as `null`.
    #[test]
    fn a_folder_that_is_not_utf8_is_refused_by_its_flag() {
        use std::ffi::{OsStr, OsString};
        use std::os::unix::ffi::OsStrExt;
        let bad = OsStr::from_bytes(b"odir_\xff");
        let why = "\"odir_\u{FFFD}\" is not valid UTF-8 (U+FFFD marks the bytes that are not): \
                   paths are recorded as text, so rename it or give another path";
        for flag in ["--data", "--image-dir", "--val-data"] {
            let data: &[&OsStr] = match flag {
                "--data" => &[],
                _ => &[OsStr::new("--data"), OsStr::new("d")],
            };
            let args = [&[OsStr::new("ddp-train"), OsStr::new(flag), bad], data].concat();
            let c = TrainConfig::try_parse_from(args.into_iter().map(OsString::from)).unwrap();
            let e = c.validate().unwrap_err();
            assert!(matches!(e, TrainError::Invalid(_)), "{e:?}");
            assert_eq!(e.to_string(), format!("{flag} {why}"));
        }
        assert_eq!(validate(&["--image-dir", "odir_\u{FFFD}"]), Ok(()));
    }

    #[test]
    fn dropout_is_refused_with_a_model_that_has_none() {
        for model in ["resnet18", "resnet34", "resnet50"] {
            let e = validate(&["--model", model, "--dropout", "0.3"]).unwrap_err();
            assert_eq!(
                e,
                format!(
                    "--dropout applies to the convnet and efficientnet_b0 models: \
                     torchvision's {model} has no dropout layer (leave the flag out)"
                )
            );
            assert_eq!(validate(&["--model", model]), Ok(()));
        }
        for model in ["convnet", "efficientnet_b0"] {
            assert_eq!(validate(&["--model", model, "--dropout", "0.3"]), Ok(()));
        }
    }

    #[test]
    fn pretrained_weights_without_imagenet_normalisation_are_warned_of() {
        let warnings = |flags: &[&str]| {
            let args = ["ddp-train", "--data", "d"].iter().chain(flags);
            TrainConfig::try_parse_from(args).unwrap().warnings()
        };
        let init = ["--init-from", "r.pth", "--init-partial"];
        assert_eq!(
            warnings(&[&init[..], &["--model", "resnet50"]].concat()),
            [
                "--init-from r.pth into torchvision's resnet50 with --normalize none: \
              torchvision's pretrained weights expect ImageNet's normalisation, so give \
              --normalize imagenet unless these weights were trained on unnormalised pixels"
            ]
        );
        for quiet in [
            &[
                &init[..],
                &["--model", "resnet50", "--normalize", "imagenet"],
            ]
            .concat()[..],
            &[
                &init[..],
                &["--model", "resnet50", "--normalize", "0.5,0.25"],
            ]
            .concat(),
            &init[..],
            &["--model", "resnet50"],
        ] {
            assert_eq!(warnings(quiet), Vec::<String>::new(), "{quiet:?}");
        }
    }
}
