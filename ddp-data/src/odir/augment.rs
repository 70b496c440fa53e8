//! The training augmentations after the crop, each the pixels torchvision's PIL path gives
//! for the same parameters: `RandomVerticalFlip`, `RandomRotation(degrees)` (nearest
//! neighbour, no expansion, black corners) and `ColorJitter(brightness, contrast,
//! saturation)` (`ImageEnhance`'s blends, in an order drawn per sample).
//!
//! The draws come from the sample's own stream, after the crop's and the horizontal flip's,
//! in torchvision's `Compose` order: vertical flip, rotation angle, then ColorJitter's order
//! and factors.

use crate::error::DataError;
use crate::rng::SampleRng;

/// Which augmentations run after `RandomResizedCrop` (and the horizontal flip); all off by
/// default.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Augment {
    /// Flip vertically with probability 1/2 (`RandomVerticalFlip()`).
    pub vflip: bool,
    /// Rotate by an angle uniform in `[-rotation, rotation]` degrees (`RandomRotation`); 0 is
    /// off.
    pub rotation: f64,
    /// `ColorJitter`'s brightness, contrast and saturation: each factor is uniform in
    /// `[max(0, 1 - v), 1 + v]`; 0 leaves that property alone.
    pub jitter: [f64; 3],
}

/// One of `ColorJitter`'s adjustments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColorOp {
    /// `adjust_brightness`: a blend with black.
    Brightness,
    /// `adjust_contrast`: a blend with the image's mean grey level.
    Contrast,
    /// `adjust_saturation`: a blend with each pixel's grey level.
    Saturation,
}

const OPS: [ColorOp; 3] = [ColorOp::Brightness, ColorOp::Contrast, ColorOp::Saturation];

/// What [`Augment::draw`] drew for one sample.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AugmentDraw {
    /// Mirrored top-bottom.
    pub vflip: bool,
    /// Counter-clockwise rotation in degrees (0: none).
    pub angle: f64,
    /// The colour adjustments in the order they apply, each with its factor.
    pub jitter: [Option<(ColorOp, f64)>; 3],
}

fn invalid(name: &'static str, expected: &str, value: impl std::fmt::Debug) -> DataError {
    DataError::InvalidParameter {
        name,
        expected: expected.to_string(),
        value: format!("{value:?}"),
    }
}

impl Augment {
    /// Checks the ranges: a rotation in `[0, 180]` degrees, jitter strengths `>= 0` (and
    /// finite).
    pub fn validate(&self) -> Result<(), DataError> {
        if !(0.0..=180.0).contains(&self.rotation) {
            return Err(invalid("rotation", "degrees in [0, 180]", self.rotation));
        }
        if self.jitter.iter().any(|&v| !(v >= 0.0 && v.is_finite())) {
            return Err(invalid(
                "colour jitter",
                "brightness, contrast and saturation >= 0",
                self.jitter,
            ));
        }
        Ok(())
    }

    /// Whether anything is drawn at all.
    pub fn is_active(&self) -> bool {
        self.vflip || self.rotation > 0.0 || self.jitter.iter().any(|&v| v > 0.0)
    }

    /// The sample's draws, continuing `rng` after the crop and the horizontal flip.
    pub fn draw(&self, rng: &mut SampleRng) -> AugmentDraw {
        let vflip = self.vflip && rng.unit() < 0.5;
        let angle = if self.rotation > 0.0 {
            rng.uniform(-self.rotation, self.rotation)
        } else {
            0.0
        };
        let mut jitter = [None; 3];
        if self.jitter.iter().any(|&v| v > 0.0) {
            // torch.randperm, then one factor per enabled property in a fixed order.
            let mut order = [0usize, 1, 2];
            for i in (1..order.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
            let mut factors = [None; 3];
            for (factor, &v) in factors.iter_mut().zip(&self.jitter) {
                if v > 0.0 {
                    *factor = Some(rng.uniform((1.0 - v).max(0.0), 1.0 + v));
                }
            }
            for (slot, &k) in jitter.iter_mut().zip(&order) {
                *slot = factors[k].map(|f| (OPS[k], f));
            }
        }
        AugmentDraw {
            vflip,
            angle,
            jitter,
        }
    }
}

/// Applies `draw` to the `size x size` RGB image in `pixels` (HWC), flipped left-right when
/// `hflip` is set. A rotation applies the flips on the way (into `scratch`, then swapped
/// with `pixels`); otherwise they are left to the conversion to CHW. Returns the flips still
/// to apply, `(hflip, vflip)`.
pub(crate) fn apply(
    draw: &AugmentDraw,
    hflip: bool,
    pixels: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
    size: u32,
) -> (bool, bool) {
    let mut flips = (hflip, draw.vflip);
    if draw.angle != 0.0 {
        scratch.resize(pixels.len(), 0);
        rotate(pixels, size as usize, draw.angle, flips, scratch);
        std::mem::swap(pixels, scratch);
        flips = (false, false);
    }
    // Pixel-wise or by the image's mean: the pending flips commute with the colour changes.
    for (op, factor) in draw.jitter.iter().flatten() {
        match op {
            ColorOp::Brightness => blend_with(pixels, *factor, |_| [0; 3]),
            ColorOp::Contrast => {
                let m = mean_grey(pixels);
                blend_with(pixels, *factor, |_| [m; 3]);
            }
            ColorOp::Saturation => blend_with(pixels, *factor, |px| [grey(px); 3]),
        }
    }
    flips
}

/// PIL's `convert("L")`: ITU-R 601-2 luma in 16-bit fixed point, rounded.
fn grey(px: &[u8]) -> u8 {
    let l = u32::from(px[0]) * 19595 + u32::from(px[1]) * 38470 + u32::from(px[2]) * 7471;
    ((l + 0x8000) >> 16) as u8
}

/// `ImageEnhance.Contrast`'s grey level: the mean of the luma, rounded half up.
fn mean_grey(pixels: &[u8]) -> u8 {
    let sum: u64 = pixels.chunks_exact(3).map(|px| u64::from(grey(px))).sum();
    let n = (pixels.len() / 3).max(1);
    (sum as f64 / n as f64 + 0.5) as u8
}

/// PIL's `Image.blend(degenerate, image, factor)` per byte: `d + factor * (v - d)` in single
/// precision, clipped to [0, 255] and truncated.
fn blend_with(pixels: &mut [u8], factor: f64, degenerate: impl Fn(&[u8]) -> [u8; 3]) {
    let alpha = factor as f32;
    for px in pixels.chunks_exact_mut(3) {
        let d = degenerate(px);
        for (v, d) in px.iter_mut().zip(d) {
            let t = f32::from(d) + alpha * (i32::from(*v) - i32::from(d)) as f32;
            *v = if t <= 0.0 {
                0
            } else if t >= 255.0 {
                255
            } else {
                t as u8
            };
        }
    }
}

/// Where output pixel `(x, y)` of a quarter-turn transpose of an `s`-pixel square comes from.
type SourceOf = fn(usize, usize, usize) -> (usize, usize);

/// PIL's `Image.rotate(angle)` (nearest neighbour, about the centre, no expansion, black
/// outside) of a square `s x s` image `src` read through `flips`, into `dst`: the same
/// special cases (multiples of 90 degrees are transposes), the same matrix (rounded to 15
/// decimals), and the same 16.16 fixed-point walk over the output.
fn rotate(src: &[u8], s: usize, angle: f64, flips: (bool, bool), dst: &mut [u8]) {
    let read = |x: usize, y: usize| {
        let x = if flips.0 { s - 1 - x } else { x };
        let y = if flips.1 { s - 1 - y } else { y };
        let i = (y * s + x) * 3;
        [src[i], src[i + 1], src[i + 2]]
    };
    dst.fill(0);
    let mut put = |x: usize, y: usize, px: [u8; 3]| {
        let i = (y * s + x) * 3;
        dst[i..i + 3].copy_from_slice(&px);
    };
    let angle = angle.rem_euclid(360.0);
    let transpose: Option<SourceOf> = if angle == 0.0 {
        Some(|x, y, _| (x, y))
    } else if angle == 90.0 {
        Some(|x, y, s| (s - 1 - y, x))
    } else if angle == 180.0 {
        Some(|x, y, s| (s - 1 - x, s - 1 - y))
    } else if angle == 270.0 {
        Some(|x, y, s| (y, s - 1 - x))
    } else {
        None
    };
    if let Some(source_of) = transpose {
        for y in 0..s {
            for x in 0..s {
                let (sx, sy) = source_of(x, y, s);
                put(x, y, read(sx, sy));
            }
        }
        return;
    }
    let a = rotation_matrix(angle, s as f64);
    let n = s as i64;
    let fits = |x: f64, y: f64| {
        (x * a[0] + y * a[1] + a[2]).abs() < 32768.0 && (x * a[3] + y * a[4] + a[5]).abs() < 32768.0
    };
    let w = s as f64;
    if fits(0.0, 0.0) && fits(w, w) && fits(0.0, w) && fits(w, 0.0) {
        let fix = |v: f64| {
            let t = v * 65536.0 + 0.5;
            (if t < 0.0 { t.floor() } else { t }) as i32
        };
        let (a0, a1, a3, a4) = (fix(a[0]), fix(a[1]), fix(a[3]), fix(a[4]));
        let mut row_x = fix(a[2] + a[0] * 0.5 + a[1] * 0.5);
        let mut row_y = fix(a[5] + a[3] * 0.5 + a[4] * 0.5);
        for y in 0..s {
            let (mut xx, mut yy) = (row_x, row_y);
            for x in 0..s {
                let (xin, yin) = (i64::from(xx >> 16), i64::from(yy >> 16));
                if (0..n).contains(&xin) && (0..n).contains(&yin) {
                    put(x, y, read(xin as usize, yin as usize));
                }
                xx = xx.wrapping_add(a0);
                yy = yy.wrapping_add(a3);
            }
            row_x = row_x.wrapping_add(a1);
            row_y = row_y.wrapping_add(a4);
        }
    } else {
        // Images too large for 16.16 fixed point: PIL's floating-point walk.
        let coord = |v: f64| if v < 0.0 { -1 } else { v as i64 };
        let mut xo = a[2] + a[1] * 0.5 + a[0] * 0.5;
        let mut yo = a[5] + a[4] * 0.5 + a[3] * 0.5;
        for y in 0..s {
            let (mut xx, mut yy) = (xo, yo);
            for x in 0..s {
                let (xin, yin) = (coord(xx), coord(yy));
                if (0..n).contains(&xin) && (0..n).contains(&yin) {
                    put(x, y, read(xin as usize, yin as usize));
                }
                xx += a[0];
                yy += a[3];
            }
            xo += a[1];
            yo += a[4];
        }
    }
}

/// The inverse affine map of `Image.rotate(angle)` about the centre of a `side`-pixel
/// square: output pixel centre to input coordinates, as PIL computes it.
fn rotation_matrix(angle: f64, side: f64) -> [f64; 6] {
    // Python's round(x, 15): the nearest 15-decimal number (no ties arise for these values).
    let round15 = |x: f64| format!("{x:.15}").parse::<f64>().unwrap_or(x);
    let t = -angle.to_radians();
    let (c, s) = (round15(t.cos()), round15(t.sin()));
    let mut m = [c, s, 0.0, round15(-t.sin()), c, 0.0];
    let (cx, cy) = (side / 2.0, side / 2.0);
    let (mx, my) = (
        m[0] * -cx + m[1] * -cy + m[2],
        m[3] * -cx + m[4] * -cy + m[5],
    );
    m[2] = mx + cx;
    m[5] = my + cy;
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_in_range_and_off_draws_nothing() {
        let off = Augment::default();
        let mut rng = SampleRng::new(1, 0, 0);
        assert_eq!(off.draw(&mut rng), AugmentDraw::default());
        let mut untouched = SampleRng::new(1, 0, 0);
        assert_eq!(rng.next_u64(), untouched.next_u64(), "no draw consumed");
        let on = Augment {
            vflip: true,
            rotation: 15.0,
            jitter: [0.2, 0.0, 0.5],
        };
        let (mut flips, mut orders) = (0, std::collections::HashSet::new());
        for i in 0..2000 {
            let d = on.draw(&mut SampleRng::new(7, 1, i));
            flips += usize::from(d.vflip);
            assert!(d.angle.abs() <= 15.0);
            let ops: Vec<_> = d.jitter.iter().flatten().collect();
            assert_eq!(ops.len(), 2, "contrast is off");
            for (op, f) in ops {
                match op {
                    ColorOp::Brightness => assert!((0.8..=1.2).contains(f)),
                    ColorOp::Saturation => assert!((0.5..=1.5).contains(f)),
                    ColorOp::Contrast => panic!("contrast is off"),
                }
            }
            orders.insert(format!("{:?}", d.jitter.map(|j| j.map(|(op, _)| op))));
        }
        assert!((900..1100).contains(&flips), "{flips} flips of 2000");
        // Brightness before or after saturation, with the disabled contrast anywhere.
        assert_eq!(orders.len(), 6, "{orders:?}");
    }

    #[test]
    fn invalid_ranges_are_refused() {
        let bad = |a: Augment| assert!(a.validate().is_err(), "{a:?}");
        bad(Augment {
            rotation: -1.0,
            ..Default::default()
        });
        bad(Augment {
            rotation: 181.0,
            ..Default::default()
        });
        bad(Augment {
            jitter: [0.0, f64::NAN, 0.0],
            ..Default::default()
        });
        assert!(Augment::default().validate().is_ok());
    }

    #[test]
    fn blends_clip_and_truncate_as_pil() {
        let mut px = vec![100u8, 200, 0];
        blend_with(&mut px, 1.5, |_| [0; 3]);
        assert_eq!(px, [150, 255, 0]);
        let mut px = vec![101u8, 3, 255];
        blend_with(&mut px, 0.5, |_| [0; 3]);
        assert_eq!(px, [50, 1, 127], "truncated, not rounded");
        assert_eq!(grey(&[255, 255, 255]), 255);
        assert_eq!(grey(&[10, 10, 10]), 10);
    }

    #[test]
    fn quarter_turns_are_transposes_and_half_turns_of_flips_cancel() {
        // 2x2: a b / c d, each pixel's red channel its letter.
        let src = [1u8, 0, 0, 2, 0, 0, 3, 0, 0, 4, 0, 0];
        let red = |d: &[u8]| d.chunks(3).map(|p| p[0]).collect::<Vec<_>>();
        let mut dst = [0u8; 12];
        rotate(&src, 2, 90.0, (false, false), &mut dst);
        assert_eq!(red(&dst), [2, 4, 1, 3], "counter-clockwise");
        rotate(&src, 2, -90.0, (false, false), &mut dst);
        assert_eq!(red(&dst), [3, 1, 4, 2]);
        rotate(&src, 2, 180.0, (true, true), &mut dst);
        assert_eq!(red(&dst), [1, 2, 3, 4]);
    }
}
