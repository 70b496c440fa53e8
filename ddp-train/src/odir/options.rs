//! The values of the ODIR flags that are more than a number: `--normalize`,
//! `--eval-interpolation` and `--pos-weight`.

use std::fmt;
use std::str::FromStr;

use clap::ValueEnum;
use ddp_data::odir::transform::{Interpolation, IMAGENET_MEAN, IMAGENET_STD};
use serde::{Deserialize, Serialize};

/// `--eval-interpolation`: the evaluation transform's `Resize` filter, torchvision's
/// `InterpolationMode` on PIL images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvalInterpolation {
    /// `BILINEAR`, torchvision's default (and its ResNet weights' transforms).
    #[default]
    Bilinear,
    /// `BICUBIC`, as `EfficientNet_B0_Weights.IMAGENET1K_V1.transforms()` resizes.
    Bicubic,
}

impl EvalInterpolation {
    /// ddp-data's filter of the same name.
    pub fn interpolation(self) -> Interpolation {
        match self {
            EvalInterpolation::Bilinear => Interpolation::Bilinear,
            EvalInterpolation::Bicubic => Interpolation::Bicubic,
        }
    }
}

impl fmt::Display for EvalInterpolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EvalInterpolation::Bilinear => "bilinear",
            EvalInterpolation::Bicubic => "bicubic",
        })
    }
}

/// `--normalize`: `Normalize(mean, std)` after `ToTensor`, or none.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Normalize {
    /// Values in [0, 1] (`ToTensor` alone).
    #[default]
    None,
    /// ImageNet's channel means and deviations, what pretrained torchvision models expect.
    Imagenet,
    /// One mean and one deviation for all three channels.
    Custom {
        /// The mean.
        mean: f32,
        /// The standard deviation.
        std: f32,
    },
}

impl Normalize {
    /// The per-channel mean and deviation, if any.
    pub fn mean_std(&self) -> Option<([f32; 3], [f32; 3])> {
        match *self {
            Normalize::None => None,
            Normalize::Imagenet => Some((IMAGENET_MEAN, IMAGENET_STD)),
            Normalize::Custom { mean, std } => Some(([mean; 3], [std; 3])),
        }
    }
}

impl FromStr for Normalize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => return Ok(Normalize::None),
            "imagenet" => return Ok(Normalize::Imagenet),
            _ => {}
        }
        let bad = || format!("'{s}' is not imagenet, none or MEAN,STD (e.g. 0.5,0.25)");
        let (mean, std) = s.split_once(',').ok_or_else(bad)?;
        let mean: f32 = mean.trim().parse().map_err(|_| bad())?;
        let std: f32 = std.trim().parse().map_err(|_| bad())?;
        if !(mean.is_finite() && std > 0.0 && std.is_finite()) {
            return Err(format!("'{s}': the mean must be finite and STD positive"));
        }
        Ok(Normalize::Custom { mean, std })
    }
}

impl fmt::Display for Normalize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Normalize::None => f.write_str("none"),
            Normalize::Imagenet => f.write_str("imagenet"),
            Normalize::Custom { mean, std } => write!(f, "{mean},{std}"),
        }
    }
}

/// `--pos-weight`: BCE's `pos_weight` for the 8 classes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PosWeight {
    /// Per class, negatives / positives over the training split.
    Auto,
    /// Given weights, N D G C A H M O.
    Given(Vec<f64>),
}

impl FromStr for PosWeight {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(PosWeight::Auto);
        }
        let weights: Vec<f64> = s
            .split(',')
            .map(|w| w.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|_| format!("'{s}' is not auto or 8 comma-separated numbers"))?;
        if weights.len() != 8 {
            return Err(format!(
                "'{s}' has {} weights; give one per class N,D,G,C,A,H,M,O (8), or auto",
                weights.len()
            ));
        }
        if weights.iter().any(|w| !(*w > 0.0 && w.is_finite())) {
            return Err(format!("'{s}': every weight must be a positive number"));
        }
        Ok(PosWeight::Given(weights))
    }
}

impl fmt::Display for PosWeight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PosWeight::Auto => f.write_str("auto"),
            PosWeight::Given(w) => {
                let parts: Vec<String> = w.iter().map(f64::to_string).collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}

/// `auto`'s weights: per class, the training samples without the label over those with it.
pub fn auto_pos_weight(labels: impl Iterator<Item = [f32; 8]>) -> Result<Vec<f64>, String> {
    let (mut positives, mut total) = ([0u64; 8], 0u64);
    for l in labels {
        total += 1;
        for (p, &v) in positives.iter_mut().zip(&l) {
            *p += u64::from(v > 0.5);
        }
    }
    let names = ddp_model::ODIR_CLASSES;
    let missing: Vec<&str> = (0..8)
        .filter(|&c| positives[c] == 0)
        .map(|c| names[c])
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "--pos-weight auto: no training sample has class {}, so negatives/positives is \
             infinite; give the weights (--pos-weight W1,...,W8) or use more data",
            missing.join(", ")
        ));
    }
    let everywhere: Vec<&str> = (0..8)
        .filter(|&c| positives[c] == total)
        .map(|c| names[c])
        .collect();
    if !everywhere.is_empty() {
        return Err(format!(
            "--pos-weight auto: every training sample has class {}, so negatives/positives is \
             0 and the class would not be trained; give the weights (--pos-weight W1,...,W8) \
             or use more data",
            everywhere.join(", ")
        ));
    }
    Ok(positives
        .iter()
        .map(|&p| (total - p) as f64 / p as f64)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_and_print_back() {
        for s in ["none", "imagenet", "0.5,0.25"] {
            assert_eq!(s.parse::<Normalize>().unwrap().to_string(), s);
        }
        assert!("0.5".parse::<Normalize>().is_err());
        assert!("0.5,0".parse::<Normalize>().is_err());
        assert_eq!("auto".parse::<PosWeight>().unwrap(), PosWeight::Auto);
        let given = "1,2,3,4,5,6,7,8.5".parse::<PosWeight>().unwrap();
        assert_eq!(given.to_string(), "1,2,3,4,5,6,7,8.5");
        let e = "1,2".parse::<PosWeight>().unwrap_err();
        assert!(e.contains("has 2 weights"), "{e}");
        assert!("1,2,3,4,5,6,7,0".parse::<PosWeight>().is_err());
    }

    #[test]
    fn auto_is_negatives_over_positives_and_refuses_an_absent_or_universal_class() {
        let mut a = [0.0f32; 8];
        a[0] = 1.0;
        let b = [1.0f32; 8];
        let mut c = [0.0f32; 8];
        c[1] = 1.0;
        // Class N: 3 of 4 positive; the others 1 of 4.
        let w = auto_pos_weight([a, a, b, c].into_iter()).unwrap();
        assert_eq!(w[0], 1.0 / 3.0, "N: 1 negative / 3 positives");
        assert_eq!(w[1], 1.0, "D: 2 negatives / 2 positives");
        assert_eq!(w[2], 3.0);
        let e = auto_pos_weight([a].into_iter()).unwrap_err();
        assert!(
            e.contains("no training sample has class D, G, C, A, H, M, O"),
            "{e}"
        );
        // N in every sample: a weight of 0 would leave the class untrained.
        let e = auto_pos_weight([a, b].into_iter()).unwrap_err();
        assert!(e.contains("every training sample has class N,"), "{e}");
    }
}
