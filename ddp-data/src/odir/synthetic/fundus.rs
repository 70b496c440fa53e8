//! Painting one synthetic fundus photo: dark surround, orange retina, optic disc and cup,
//! macula, vessels, and one visual cue per ODIR label.

use crate::rng::SampleRng;

/// Label positions in the N, D, G, C, A, H, M, O vector.
pub(crate) const N: usize = 0;
const D: usize = 1;
const G: usize = 2;
const C: usize = 3;
const A: usize = 4;
const H: usize = 5;
const M: usize = 6;
const O: usize = 7;

/// A float RGB canvas, values in [0, 255].
struct Canvas {
    size: usize,
    px: Vec<[f32; 3]>,
}

impl Canvas {
    /// Blends `colour` into a disc of radius `r` at `(x, y)` with opacity `alpha`, fading over
    /// the last pixel of the radius.
    fn disc(&mut self, x: f32, y: f32, r: f32, colour: [f32; 3], alpha: f32) {
        let s = self.size as i64;
        let (x0, x1) = (
            ((x - r - 1.0).floor() as i64).max(0),
            ((x + r + 1.0).ceil() as i64).min(s - 1),
        );
        let (y0, y1) = (
            ((y - r - 1.0).floor() as i64).max(0),
            ((y + r + 1.0).ceil() as i64).min(s - 1),
        );
        for py in y0..=y1 {
            for px in x0..=x1 {
                let d = ((px as f32 - x).powi(2) + (py as f32 - y).powi(2)).sqrt();
                let cover = (r + 0.5 - d).clamp(0.0, 1.0) * alpha;
                if cover > 0.0 {
                    let p = &mut self.px[py as usize * self.size + px as usize];
                    for c in 0..3 {
                        p[c] += (colour[c] - p[c]) * cover;
                    }
                }
            }
        }
    }

    /// Multiplies a soft-edged disc region by `factor` per channel.
    fn shade(&mut self, x: f32, y: f32, r: f32, factor: [f32; 3]) {
        let s = self.size as i64;
        let (x0, x1) = (
            ((x - r).floor() as i64).max(0),
            ((x + r).ceil() as i64).min(s - 1),
        );
        let (y0, y1) = (
            ((y - r).floor() as i64).max(0),
            ((y + r).ceil() as i64).min(s - 1),
        );
        for py in y0..=y1 {
            for px in x0..=x1 {
                let d = ((px as f32 - x).powi(2) + (py as f32 - y).powi(2)).sqrt() / r;
                if d < 1.0 {
                    let w = 1.0 - d * d;
                    let p = &mut self.px[py as usize * self.size + px as usize];
                    for c in 0..3 {
                        p[c] *= 1.0 + (factor[c] - 1.0) * w;
                    }
                }
            }
        }
    }
}

/// Geometry shared by the painting steps.
struct Eye {
    cx: f32,
    cy: f32,
    radius: f32,
    disc_x: f32,
    disc_y: f32,
    disc_r: f32,
    mac_x: f32,
    mac_y: f32,
}

fn jitter(rng: &mut SampleRng, amount: f32) -> f32 {
    (rng.unit() as f32 * 2.0 - 1.0) * amount
}

/// A point uniformly inside the circle of radius `r` around `(x, y)`.
fn point_in(rng: &mut SampleRng, x: f32, y: f32, r: f32) -> (f32, f32) {
    let a = rng.unit() as f32 * std::f32::consts::TAU;
    let d = r * (rng.unit() as f32).sqrt();
    (x + d * a.cos(), y + d * a.sin())
}

/// Paints a `size x size` RGB fundus image (row-major, 3 bytes per pixel) showing `labels`
/// (N, D, G, C, A, H, M, O); the optic disc sits on the left for a left eye.
pub(crate) fn paint(size: u32, labels: &[bool; 8], left_eye: bool, rng: &mut SampleRng) -> Vec<u8> {
    let s = size as f32;
    let radius = s * (0.44 + jitter(rng, 0.02));
    let (cx, cy) = (
        s / 2.0 + jitter(rng, 0.02 * s),
        s / 2.0 + jitter(rng, 0.02 * s),
    );
    let side = if left_eye { -1.0 } else { 1.0 };
    let disc_r = radius * (0.15 + jitter(rng, 0.015)) * if labels[G] { 1.15 } else { 1.0 };
    let eye = Eye {
        cx,
        cy,
        radius,
        disc_x: cx + side * radius * (0.42 + jitter(rng, 0.05)),
        disc_y: cy + jitter(rng, 0.08 * radius),
        disc_r,
        mac_x: cx - side * radius * (0.08 + jitter(rng, 0.04)),
        mac_y: cy + jitter(rng, 0.05 * radius),
    };
    let mut canvas = Canvas {
        size: size as usize,
        px: vec![[0.0; 3]; size as usize * size as usize],
    };
    retina(&mut canvas, &eye, labels, rng);
    vessels(&mut canvas, &eye, labels[H], rng);
    optic_disc(&mut canvas, &eye, labels, rng);
    if labels[D] {
        diabetic_lesions(&mut canvas, &eye, rng);
    }
    if labels[H] {
        cotton_wool_spots(&mut canvas, &eye, rng);
    }
    if labels[A] {
        drusen(&mut canvas, &eye, rng);
    }
    if labels[O] {
        laser_scars(&mut canvas, &eye, rng);
    }
    if labels[C] {
        haze(&mut canvas, &eye, rng);
    }
    finish(&canvas, &eye, rng)
}

/// The retina's base colour with vignetting, the macula, and the myopic tessellation (M).
fn retina(canvas: &mut Canvas, eye: &Eye, labels: &[bool; 8], rng: &mut SampleRng) {
    let pale = labels[M];
    let tone = if pale {
        [
            226.0 + jitter(rng, 12.0),
            150.0 + jitter(rng, 12.0),
            112.0 + jitter(rng, 10.0),
        ]
    } else {
        [
            196.0 + jitter(rng, 18.0),
            88.0 + jitter(rng, 14.0),
            38.0 + jitter(rng, 10.0),
        ]
    };
    let gain = 0.9 + jitter(rng, 0.12);
    // Low-frequency illumination: two random gentle gradients.
    let (gx, gy) = (jitter(rng, 0.12), jitter(rng, 0.12));
    let freq = 2.0 * std::f32::consts::PI / (eye.radius * (0.11 + jitter(rng, 0.02)));
    let angle = rng.unit() as f32 * std::f32::consts::PI;
    let (ca, sa) = (angle.cos(), angle.sin());
    let size = canvas.size;
    for y in 0..size {
        for x in 0..size {
            let (dx, dy) = (
                (x as f32 - eye.cx) / eye.radius,
                (y as f32 - eye.cy) / eye.radius,
            );
            let d2 = dx * dx + dy * dy;
            if d2 > 1.0 {
                continue;
            }
            let light = gain * (1.0 - 0.38 * d2) * (1.0 + gx * dx + gy * dy);
            let mut p = [tone[0] * light, tone[1] * light, tone[2] * light];
            if pale {
                // Choroidal vessels showing through: dark red tessellated stripes.
                let u = (x as f32 * ca + y as f32 * sa) * freq;
                let v = (-(x as f32) * sa + y as f32 * ca) * freq * 0.55;
                let t = ((u + 1.3 * v.sin()).sin() * 0.5 + 0.5).powi(3);
                p[0] *= 1.0 - 0.22 * t;
                p[1] *= 1.0 - 0.45 * t;
                p[2] *= 1.0 - 0.45 * t;
            }
            canvas.px[y * size + x] = p;
        }
    }
    let mac_r = eye.radius * (0.2 + jitter(rng, 0.03));
    canvas.shade(eye.mac_x, eye.mac_y, mac_r, [0.7, 0.62, 0.62]);
    canvas.shade(eye.mac_x, eye.mac_y, mac_r * 0.25, [0.85, 0.8, 0.8]);
}

/// Arcades of arteries and veins leaving the disc; with `hypertensive`, narrowed, straighter
/// pale arteries and tortuous veins.
fn vessels(canvas: &mut Canvas, eye: &Eye, hypertensive: bool, rng: &mut SampleRng) {
    let count = 8 + rng.below(4) as usize;
    let step = eye.radius * 0.012;
    let towards_macula = (eye.mac_y - eye.disc_y).atan2(eye.mac_x - eye.disc_x);
    for k in 0..count {
        let vein = k % 2 == 0;
        let base =
            towards_macula + (k as f32 / count as f32 - 0.5) * 2.0 * std::f32::consts::PI * 0.9;
        let mut angle = base + jitter(rng, 0.25);
        // Arcades curve around the macula.
        let curl = if (angle - towards_macula).sin() > 0.0 {
            -0.012
        } else {
            0.012
        };
        let mut width = eye.radius * if vein { 0.026 } else { 0.019 };
        let mut colour = if vein {
            [110.0, 22.0, 18.0]
        } else {
            [150.0, 40.0, 25.0]
        };
        let mut tortuous = 0.0;
        if hypertensive {
            if vein {
                tortuous = 0.8;
                width *= 1.3; // dilated veins
            } else {
                width *= 0.45;
                colour = [205.0, 110.0, 60.0]; // "copper wiring"
            }
        }
        let (mut x, mut y) = (eye.disc_x, eye.disc_y);
        let steps = (eye.radius * (1.0 + jitter(rng, 0.3)) / step) as usize;
        let phase = rng.unit() as f32 * 6.0;
        for i in 0..steps {
            let wiggle = tortuous * (i as f32 * 0.45 + phase).sin();
            x += step * (angle + wiggle).cos();
            y += step * (angle + wiggle).sin();
            angle += curl + jitter(rng, 0.05);
            let (dx, dy) = ((x - eye.cx) / eye.radius, (y - eye.cy) / eye.radius);
            if dx * dx + dy * dy > 0.97 {
                break;
            }
            let w = width * (1.0 - 0.6 * i as f32 / steps as f32);
            canvas.disc(x, y, (w * 0.5).max(0.5), colour, 0.85);
            // Branch now and then.
            if i > 10 && rng.below(40) == 0 {
                let mut a2 = angle + jitter(rng, 0.9);
                let (mut bx, mut by) = (x, y);
                for j in 0..(steps / 3) {
                    bx += step * a2.cos();
                    by += step * a2.sin();
                    a2 += jitter(rng, 0.06);
                    let (dx, dy) = ((bx - eye.cx) / eye.radius, (by - eye.cy) / eye.radius);
                    if dx * dx + dy * dy > 0.97 {
                        break;
                    }
                    let w2 = w * 0.6 * (1.0 - j as f32 / steps as f32);
                    canvas.disc(bx, by, (w2 * 0.5).max(0.5), colour, 0.8);
                }
            }
        }
    }
}

/// The optic disc and cup; glaucoma (G) enlarges and brightens the cup; myopia (M) adds a
/// pale peripapillary crescent.
fn optic_disc(canvas: &mut Canvas, eye: &Eye, labels: &[bool; 8], rng: &mut SampleRng) {
    if labels[M] {
        let side = if eye.disc_x > eye.cx { -1.0 } else { 1.0 };
        canvas.disc(
            eye.disc_x + side * eye.disc_r * 0.35,
            eye.disc_y,
            eye.disc_r * 1.25,
            [240.0, 215.0, 185.0],
            0.85,
        );
    }
    canvas.disc(
        eye.disc_x,
        eye.disc_y,
        eye.disc_r,
        [240.0, 190.0, 115.0],
        0.95,
    );
    let cup = if labels[G] {
        0.78 + jitter(rng, 0.06)
    } else {
        0.32 + jitter(rng, 0.06)
    };
    let cup_colour = if labels[G] {
        [255.0, 250.0, 235.0]
    } else {
        [250.0, 222.0, 165.0]
    };
    canvas.disc(
        eye.disc_x + jitter(rng, 0.1 * eye.disc_r),
        eye.disc_y + jitter(rng, 0.1 * eye.disc_r),
        eye.disc_r * cup,
        cup_colour,
        0.95,
    );
}

/// D: red dot and blot haemorrhages and yellow hard exudates.
fn diabetic_lesions(canvas: &mut Canvas, eye: &Eye, rng: &mut SampleRng) {
    let reds = 14 + rng.below(20);
    let red = Spots {
        radius: (0.012, 0.032),
        colour: [105.0, 8.0, 8.0],
        alpha: 0.95,
    };
    red.scatter(canvas, eye, rng, reds, (eye.cx, eye.cy), 0.8);
    let exudates = 8 + rng.below(16);
    let centre = point_in(rng, eye.mac_x, eye.mac_y, eye.radius * 0.35);
    let yellow = Spots {
        radius: (0.01, 0.022),
        colour: [250.0, 235.0, 95.0],
        alpha: 0.95,
    };
    yellow.scatter(canvas, eye, rng, exudates, centre, 0.3);
}

/// Round lesions of one kind: radius range (as fractions of the fundus radius) and colour.
struct Spots {
    radius: (f32, f32),
    colour: [f32; 3],
    alpha: f32,
}

impl Spots {
    /// Paints `count` spots uniformly within `spread * radius` of `centre`.
    fn scatter(
        &self,
        canvas: &mut Canvas,
        eye: &Eye,
        rng: &mut SampleRng,
        count: u64,
        centre: (f32, f32),
        spread: f32,
    ) {
        for _ in 0..count {
            let (x, y) = point_in(rng, centre.0, centre.1, eye.radius * spread);
            let r =
                eye.radius * (self.radius.0 + (self.radius.1 - self.radius.0) * rng.unit() as f32);
            canvas.disc(x, y, r, self.colour, self.alpha);
        }
    }
}

/// A: a pale patch of atrophy over the macula, ringed by large soft yellow drusen.
fn drusen(canvas: &mut Canvas, eye: &Eye, rng: &mut SampleRng) {
    canvas.disc(
        eye.mac_x,
        eye.mac_y,
        eye.radius * (0.1 + jitter(rng, 0.02)),
        [215.0, 170.0, 120.0],
        0.8,
    );
    let count = 20 + rng.below(25);
    let drusen = Spots {
        radius: (0.02, 0.04),
        colour: [240.0, 220.0, 150.0],
        alpha: 0.75,
    };
    drusen.scatter(canvas, eye, rng, count, (eye.mac_x, eye.mac_y), 0.3);
}

/// H: soft white cotton-wool spots around the optic disc.
fn cotton_wool_spots(canvas: &mut Canvas, eye: &Eye, rng: &mut SampleRng) {
    let count = 3 + rng.below(4);
    let spots = Spots {
        radius: (0.045, 0.07),
        colour: [238.0, 232.0, 220.0],
        alpha: 0.6,
    };
    spots.scatter(canvas, eye, rng, count, (eye.disc_x, eye.disc_y), 0.55);
}

/// O: a ring of dark pigmented laser scars with pale halos in the mid-periphery.
fn laser_scars(canvas: &mut Canvas, eye: &Eye, rng: &mut SampleRng) {
    let count = 14 + rng.below(12);
    let ring = eye.radius * (0.6 + jitter(rng, 0.08));
    let start = rng.unit() as f32 * std::f32::consts::TAU;
    for k in 0..count {
        let a = start + k as f32 * std::f32::consts::TAU / count as f32 + jitter(rng, 0.08);
        let (x, y) = (eye.cx + ring * a.cos(), eye.cy + ring * a.sin());
        let r = eye.radius * (0.025 + 0.01 * rng.unit() as f32);
        canvas.disc(x, y, r * 1.45, [225.0, 200.0, 160.0], 0.8);
        canvas.disc(x, y, r, [45.0, 38.0, 34.0], 0.95);
    }
}

/// C: a cataract's global haze: blur and wash towards a milky grey.
fn haze(canvas: &mut Canvas, eye: &Eye, rng: &mut SampleRng) {
    let size = canvas.size;
    let radius = ((size as f32 * 0.018).round() as usize).max(1);
    box_blur(canvas, radius);
    box_blur(canvas, radius);
    let amount = 0.5 + jitter(rng, 0.08);
    let milk = [205.0, 185.0, 165.0];
    for y in 0..size {
        for x in 0..size {
            let (dx, dy) = (
                (x as f32 - eye.cx) / eye.radius,
                (y as f32 - eye.cy) / eye.radius,
            );
            if dx * dx + dy * dy <= 1.0 {
                let p = &mut canvas.px[y * size + x];
                for c in 0..3 {
                    p[c] += (milk[c] - p[c]) * amount;
                }
            }
        }
    }
}

/// Separable box blur of the given radius, in place.
fn box_blur(canvas: &mut Canvas, radius: usize) {
    let size = canvas.size;
    let mut line = vec![[0f32; 3]; size];
    let norm = 1.0 / (2 * radius + 1) as f32;
    for pass in 0..2 {
        for a in 0..size {
            let at = |b: usize| {
                if pass == 0 {
                    a * size + b
                } else {
                    b * size + a
                }
            };
            for (b, slot) in line.iter_mut().enumerate() {
                *slot = canvas.px[at(b)];
            }
            let mut acc = [0f32; 3];
            for p in line.iter().take(radius.min(size - 1) + 1) {
                for c in 0..3 {
                    acc[c] += p[c];
                }
            }
            for c in 0..3 {
                acc[c] += line[0][c] * radius as f32;
            }
            for b in 0..size {
                canvas.px[at(b)] = [acc[0] * norm, acc[1] * norm, acc[2] * norm];
                let add = line[(b + radius + 1).min(size - 1)];
                let sub = line[b.saturating_sub(radius)];
                for c in 0..3 {
                    acc[c] += add[c] - sub[c];
                }
            }
        }
    }
}

/// Clears the surround to near-black, adds sensor noise and converts to bytes.
fn finish(canvas: &Canvas, eye: &Eye, rng: &mut SampleRng) -> Vec<u8> {
    let size = canvas.size;
    let mut out = vec![0u8; size * size * 3];
    let mut noise_state = rng.next_u64() | 1;
    for y in 0..size {
        for x in 0..size {
            let (dx, dy) = (
                (x as f32 - eye.cx) / eye.radius,
                (y as f32 - eye.cy) / eye.radius,
            );
            let d = (dx * dx + dy * dy).sqrt();
            // xorshift: cheap per-pixel noise, deterministic from the sample's stream.
            noise_state ^= noise_state << 13;
            noise_state ^= noise_state >> 7;
            noise_state ^= noise_state << 17;
            let n = ((noise_state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0;
            let edge = (1.0 - (d - 1.0) * eye.radius).clamp(0.0, 1.0);
            let p = canvas.px[y * size + x];
            let o = &mut out[(y * size + x) * 3..][..3];
            for c in 0..3 {
                o[c] = ((p[c] + n) * edge + 3.0).clamp(0.0, 255.0) as u8;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean_in_disc(px: &[u8], size: usize, cx: f32, cy: f32, r: f32) -> [f32; 3] {
        let mut sum = [0f64; 3];
        let mut n = 0.0;
        for y in 0..size {
            for x in 0..size {
                if (x as f32 - cx).powi(2) + (y as f32 - cy).powi(2) <= r * r {
                    for c in 0..3 {
                        sum[c] += f64::from(px[(y * size + x) * 3 + c]);
                    }
                    n += 1.0;
                }
            }
        }
        [
            (sum[0] / n) as f32,
            (sum[1] / n) as f32,
            (sum[2] / n) as f32,
        ]
    }

    #[test]
    fn surround_is_dark_and_retina_is_orange() {
        let mut rng = SampleRng::new(0, 0, 0);
        let labels = [true, false, false, false, false, false, false, false];
        let px = paint(128, &labels, true, &mut rng);
        assert_eq!(px.len(), 128 * 128 * 3);
        // Corners are outside the fundus circle.
        for &(x, y) in &[(0usize, 0usize), (127, 0), (0, 127), (127, 127)] {
            let p = &px[(y * 128 + x) * 3..][..3];
            assert!(p.iter().all(|&v| v < 20), "corner {x},{y}: {p:?}");
        }
        let m = mean_in_disc(&px, 128, 64.0, 64.0, 40.0);
        assert!(
            m[0] > m[1] && m[1] > m[2],
            "retina should be orange-red: {m:?}"
        );
        assert!(m[0] > 90.0, "{m:?}");
    }

    #[test]
    fn cataract_haze_lowers_contrast() {
        let std_dev = |px: &[u8]| {
            let g: Vec<f64> = px.chunks_exact(3).map(|p| f64::from(p[1])).collect();
            let n = g.len() as f64;
            let m = g.iter().sum::<f64>() / n;
            (g.iter().map(|v| (v - m).powi(2)).sum::<f64>() / n).sqrt()
        };
        let mut clear = [false; 8];
        clear[D] = true;
        let mut hazy = clear;
        hazy[C] = true;
        let a = paint(128, &clear, false, &mut SampleRng::new(4, 0, 0));
        let b = paint(128, &hazy, false, &mut SampleRng::new(4, 0, 0));
        // Inside the fundus the haze pulls everything towards one milky colour.
        let inner = |px: &[u8]| -> Vec<u8> {
            let mut v = Vec::new();
            for y in 40..88 {
                for x in 40..88 {
                    v.extend_from_slice(&px[(y * 128 + x) * 3..][..3]);
                }
            }
            v
        };
        assert!(std_dev(&inner(&b)) < 0.7 * std_dev(&inner(&a)));
    }
}
