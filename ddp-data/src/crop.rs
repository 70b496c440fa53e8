//! Crop boxes: torchvision's `RandomResizedCrop.get_params`, reproduced draw for draw, and the
//! evaluation transform's resize-shorter-side + centre-crop box.

use crate::rng::SampleRng;

/// A crop box in source pixel coordinates, as torchvision's `(i, j, h, w)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropBox {
    /// First row (torchvision's `i`).
    pub top: u32,
    /// First column (torchvision's `j`).
    pub left: u32,
    /// Number of rows (torchvision's `h`).
    pub height: u32,
    /// Number of columns (torchvision's `w`).
    pub width: u32,
}

/// Python's `round()`: halves go to the even neighbour.
fn py_round(x: f64) -> i64 {
    x.round_ties_even() as i64
}

/// torchvision's `RandomResizedCrop.get_params(img, scale, ratio)` for an image of
/// `height x width` pixels.
///
/// Up to 10 attempts each draw a target area uniformly in `scale * area` and an aspect ratio
/// log-uniformly in `ratio`; `w = round(sqrt(area * ratio))`, `h = round(sqrt(area / ratio))`;
/// the first box that fits is placed uniformly (`i` in `[0, H - h]`, `j` in `[0, W - w]`).
/// If none fits, the centre crop with the aspect ratio clamped to `ratio` is returned.
pub fn random_resized_crop(
    rng: &mut SampleRng,
    height: u32,
    width: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
) -> CropBox {
    let area = f64::from(height) * f64::from(width);
    let (log_lo, log_hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target_area = area * rng.uniform(scale.0, scale.1);
        let aspect = rng.uniform(log_lo, log_hi).exp();
        let w = py_round((target_area * aspect).sqrt());
        let h = py_round((target_area / aspect).sqrt());
        if 0 < w && w <= i64::from(width) && 0 < h && h <= i64::from(height) {
            let (w, h) = (w as u32, h as u32);
            let top = rng.below(u64::from(height - h) + 1) as u32;
            let left = rng.below(u64::from(width - w) + 1) as u32;
            return CropBox {
                top,
                left,
                height: h,
                width: w,
            };
        }
    }
    fallback_centre_crop(height, width, ratio)
}

/// The branch torchvision takes when 10 attempts found no box: the whole image, or its centre
/// with the aspect ratio clamped to `ratio`.
pub fn fallback_centre_crop(height: u32, width: u32, ratio: (f64, f64)) -> CropBox {
    let in_ratio = f64::from(width) / f64::from(height);
    let (min_ratio, max_ratio) = (ratio.0.min(ratio.1), ratio.0.max(ratio.1));
    let (w, h) = if in_ratio < min_ratio {
        let h = py_round(f64::from(width) / min_ratio).clamp(1, i64::from(height)) as u32;
        (width, h)
    } else if in_ratio > max_ratio {
        let w = py_round(f64::from(height) * max_ratio).clamp(1, i64::from(width)) as u32;
        (w, height)
    } else {
        (width, height)
    };
    CropBox {
        top: (height - h) / 2,
        left: (width - w) / 2,
        height: h,
        width: w,
    }
}

/// A crop box with fractional coordinates (the source region the evaluation transform keeps).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SourceRegion {
    /// First row.
    pub top: f64,
    /// First column.
    pub left: f64,
    /// Number of rows.
    pub height: f64,
    /// Number of columns.
    pub width: f64,
}

impl From<CropBox> for SourceRegion {
    fn from(b: CropBox) -> Self {
        Self {
            top: f64::from(b.top),
            left: f64::from(b.left),
            height: f64::from(b.height),
            width: f64::from(b.width),
        }
    }
}

/// The source region kept by torchvision's `Resize(resize)` (shorter side to `resize`, the
/// longer one to `int(resize * long / short)`) followed by `CenterCrop(crop)`
/// (offsets `int(round((resized - crop) / 2))`), mapped back to source pixels.
///
/// Returns the region and the size of the resized (pre-crop) image as `(height, width)`.
pub fn resize_centre_crop_region(
    height: u32,
    width: u32,
    resize: u32,
    crop: u32,
) -> (SourceRegion, (u32, u32)) {
    let (short, long) = (height.min(width), height.max(width));
    let new_long = (u64::from(resize) * u64::from(long) / u64::from(short.max(1))) as u32;
    let (rh, rw) = if height <= width {
        (resize, new_long)
    } else {
        (new_long, resize)
    };
    let top = py_round(f64::from(rh as i32 - crop as i32) / 2.0) as f64;
    let left = py_round(f64::from(rw as i32 - crop as i32) / 2.0) as f64;
    let sy = f64::from(height) / f64::from(rh);
    let sx = f64::from(width) / f64::from(rw);
    let region = SourceRegion {
        top: top * sy,
        left: left * sx,
        height: f64::from(crop) * sy,
        width: f64::from(crop) * sx,
    };
    (region, (rh, rw))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCALE: (f64, f64) = (0.2, 1.0);
    const RATIO: (f64, f64) = (3.0 / 4.0, 4.0 / 3.0);

    #[test]
    fn python_rounding_goes_to_even() {
        assert_eq!(py_round(2.5), 2);
        assert_eq!(py_round(3.5), 4);
        assert_eq!(py_round(-0.5), 0);
        assert_eq!(py_round(7.49), 7);
    }

    fn mean(v: &[f64]) -> f64 {
        v.iter().sum::<f64>() / v.len() as f64
    }

    fn var(v: &[f64]) -> f64 {
        let m = mean(v);
        v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len() as f64
    }

    /// 10,000 boxes on a `h x w` image: (area fraction, log aspect ratio, relative top offset).
    fn draw_boxes(h: u32, w: u32, scale: (f64, f64)) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut fractions, mut log_ratios, mut top_rel) = (vec![], vec![], vec![]);
        for i in 0..10_000 {
            let mut rng = SampleRng::new(42, 0, i);
            let b = random_resized_crop(&mut rng, h, w, scale, RATIO);
            assert!(b.top + b.height <= h && b.left + b.width <= w, "{b:?}");
            assert!(b.height > 0 && b.width > 0);
            fractions.push(f64::from(b.width * b.height) / f64::from(h * w));
            log_ratios.push((f64::from(b.width) / f64::from(b.height)).ln());
            if b.height < h {
                top_rel.push(f64::from(b.top) / f64::from(h - b.height));
            }
        }
        (fractions, log_ratios, top_rel)
    }

    /// When every draw fits (max side sqrt(0.5 * 4/3) < 1 of the image), the area fraction is
    /// uniform on `scale` and log(w/h) uniform on [log 3/4, log 4/3], up to the rounding of w
    /// and h; offsets are uniform over the free space.
    #[test]
    fn box_statistics_match_uniform_formulas_when_every_draw_fits() {
        let (fractions, log_ratios, top_rel) = draw_boxes(512, 512, (0.08, 0.5));
        // Uniform on [a, b]: mean (a+b)/2, variance (b-a)^2/12.
        assert!(
            (mean(&fractions) - 0.29).abs() < 0.005,
            "{}",
            mean(&fractions)
        );
        assert!((var(&fractions) - 0.42f64.powi(2) / 12.0).abs() < 0.001);
        let (lo, hi) = (RATIO.0.ln(), RATIO.1.ln());
        assert!(mean(&log_ratios).abs() < 0.01, "{}", mean(&log_ratios));
        assert!((var(&log_ratios) - (hi - lo).powi(2) / 12.0).abs() < 0.003);
        // Rounding w and h can push the ratio only a hair past the range.
        assert!(log_ratios.iter().all(|&r| r >= lo - 0.02 && r <= hi + 0.02));
        for d in 0..6 {
            let (a, b) = (0.08 + 0.07 * d as f64, 0.15 + 0.07 * d as f64);
            let share = fractions.iter().filter(|&&f| f >= a && f < b).count() as f64 / 1e4;
            assert!((share - 1.0 / 6.0).abs() < 0.02, "bin {d}: {share}");
        }
        assert!((mean(&top_rel) - 0.5).abs() < 0.015, "{}", mean(&top_rel));
        assert!((var(&top_rel) - 1.0 / 12.0).abs() < 0.005);
    }

    /// With `scale = (0.2, 1.0)` on a square image a draw (s, r) fits iff s <= min(r, 1/r):
    /// the boxes follow the uniform law conditioned on that, which is integrated here
    /// numerically and compared with 10,000 draws; the fallback (all 10 attempts rejected)
    /// is then rare.
    #[test]
    fn box_statistics_match_torchvision_rejection_law() {
        let (lo, hi) = (RATIO.0.ln(), RATIO.1.ln());
        let (s0, s1) = SCALE;
        let (mut accept, mut first_moment) = (0.0, 0.0);
        let steps = 4000;
        for k in 0..steps {
            let t = lo + (hi - lo) * (k as f64 + 0.5) / steps as f64;
            let cap = (-t.abs()).exp().min(s1);
            if cap > s0 {
                accept += (cap - s0) / (s1 - s0) / steps as f64;
                first_moment += (cap * cap - s0 * s0) / 2.0 / (s1 - s0) / steps as f64;
            }
        }
        let expected_mean = first_moment / accept;
        let (fractions, log_ratios, _) = draw_boxes(512, 512, SCALE);
        let fallback = fallback_centre_crop(512, 512, RATIO);
        assert_eq!(fallback.width * fallback.height, 512 * 512);
        let full = fractions.iter().filter(|&&f| f == 1.0).count();
        // P(fallback) = (1 - accept)^10 ~ 1e-7; whole-image boxes from the uniform branch are
        // possible but rare.
        assert!(full < 20, "{full} whole-image boxes");
        assert!(
            (mean(&fractions) - expected_mean).abs() < 0.006,
            "mean area fraction {} vs {expected_mean}",
            mean(&fractions)
        );
        // Accepted boxes never exceed min(r, 1/r) (up to rounding).
        for (&f, &r) in fractions.iter().zip(&log_ratios) {
            assert!(
                f <= (-r.abs()).exp() + 0.01,
                "fraction {f} with log ratio {r}"
            );
        }
        assert!(mean(&log_ratios).abs() < 0.01);
    }

    /// On a 10:1 panorama no box with ratio in [3/4, 4/3] and area >= 20% fits in height, so
    /// every draw falls back to the centre crop with the ratio clamped to 4/3.
    #[test]
    fn extreme_wide_image_falls_back_to_clamped_centre_crop() {
        for i in 0..100 {
            let mut rng = SampleRng::new(1, 0, i);
            let b = random_resized_crop(&mut rng, 100, 1000, SCALE, RATIO);
            // h = 100, w = round(100 * 4/3) = 133, centred: (1000 - 133) / 2 = 433.
            assert_eq!(
                b,
                CropBox {
                    top: 0,
                    left: 433,
                    height: 100,
                    width: 133
                }
            );
        }
    }

    #[test]
    fn extreme_tall_image_falls_back_to_clamped_centre_crop() {
        let mut rng = SampleRng::new(1, 0, 0);
        let b = random_resized_crop(&mut rng, 1000, 100, SCALE, RATIO);
        // w = 100, h = round(100 / (3/4)) = 133, top = (1000 - 133) // 2 = 433.
        assert_eq!(
            b,
            CropBox {
                top: 433,
                left: 0,
                height: 133,
                width: 100
            }
        );
    }

    #[test]
    fn fallback_keeps_whole_image_when_ratio_is_in_range() {
        assert_eq!(
            fallback_centre_crop(300, 360, RATIO),
            CropBox {
                top: 0,
                left: 0,
                height: 300,
                width: 360
            }
        );
    }

    /// A 3:1 image: most draws fail the height test, some succeed; successful boxes must still
    /// respect the image bounds, and the fallback appears with its exact box.
    #[test]
    fn moderately_wide_image_mixes_both_branches() {
        let mut fallbacks = 0;
        for i in 0..2_000 {
            let mut rng = SampleRng::new(5, 1, i);
            let b = random_resized_crop(&mut rng, 100, 300, (0.9, 1.0), RATIO);
            assert!(b.top + b.height <= 100 && b.left + b.width <= 300);
            if b == fallback_centre_crop(100, 300, RATIO) {
                fallbacks += 1;
            }
        }
        // Area >= 0.9 * 30000 with ratio <= 4/3 needs h >= 142 > 100: always the fallback.
        assert_eq!(fallbacks, 2_000);
    }

    #[test]
    fn eval_region_matches_resize_then_centre_crop() {
        // 2000 x 3000 (h x w), Resize(256) -> 256 x 384, CenterCrop(224) -> top 16, left 80.
        let (r, (rh, rw)) = resize_centre_crop_region(2000, 3000, 256, 224);
        assert_eq!((rh, rw), (256, 384));
        let s = 2000.0 / 256.0;
        assert!((r.top - 16.0 * s).abs() < 1e-9);
        assert!((r.left - 80.0 * 3000.0 / 384.0).abs() < 1e-9);
        assert!((r.height - 224.0 * s).abs() < 1e-9);
        assert!((r.width - 224.0 * 3000.0 / 384.0).abs() < 1e-9);
    }
}
