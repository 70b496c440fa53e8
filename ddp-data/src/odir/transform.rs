//! The image transforms: torchvision's `RandomResizedCrop` (+ optional horizontal flip, and
//! the augmentations of [`Augment`]: vertical flip, rotation, colour jitter) for training,
//! `Resize` + `CenterCrop` for evaluation, then `ToTensor` (CHW, f32 in [0, 1]) and an
//! optional `Normalize`, written straight into a batch buffer.

use std::path::Path;

use fast_image_resize::images::{Image, ImageRef};
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};

pub use super::augment::{Augment, AugmentDraw, ColorOp};
use super::decode::{Decoder, RgbView};
use crate::crop::{random_resized_crop, resize_centre_crop_region, SourceRegion};
use crate::error::DataError;
use crate::rng::SampleRng;
use crate::sample::Affine;

/// Which geometric transform runs before `ToTensor`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Geometry {
    /// `RandomResizedCrop(size, scale, ratio)` with bilinear, antialiased resizing, then a
    /// horizontal flip with probability 1/2 when `hflip` is set.
    RandomResizedCrop {
        /// Output side in pixels.
        size: u32,
        /// Range of the crop's area as a fraction of the image's.
        scale: (f64, f64),
        /// Range of the crop's aspect ratio (width / height), sampled log-uniformly.
        ratio: (f64, f64),
        /// Flip horizontally with probability 1/2 (`RandomHorizontalFlip()`).
        hflip: bool,
    },
    /// `Resize(resize)` (shorter side) then `CenterCrop(crop)`.
    ResizeCentreCrop {
        /// The shorter side after resizing.
        resize: u32,
        /// Output side in pixels.
        crop: u32,
        /// `Resize`'s interpolation (antialiased, as PIL's).
        interpolation: Interpolation,
    },
}

/// The resampling filter of the evaluation transform's `Resize`, as torchvision's
/// `InterpolationMode` on PIL images (antialiased: the filter widens when shrinking).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Interpolation {
    /// `InterpolationMode.BILINEAR`, torchvision's default.
    #[default]
    Bilinear,
    /// `InterpolationMode.BICUBIC` (PIL's cubic, `a = -0.5`), as the ImageNet weights of
    /// EfficientNet and ViT evaluate.
    Bicubic,
}

impl Interpolation {
    fn filter(self) -> FilterType {
        match self {
            Interpolation::Bilinear => FilterType::Bilinear,
            // Catmull-Rom is the cubic of a = -0.5, PIL's BICUBIC.
            Interpolation::Bicubic => FilterType::CatmullRom,
        }
    }
}

/// A training or evaluation transform from an image file to a `[3, size, size]` f32 tensor.
///
/// ```
/// use ddp_data::odir::transform::Transform;
/// let train = Transform::train(224).with_hflip(true);
/// assert_eq!(train.output_size(), 224);
/// let eval = Transform::eval(256, 224).unwrap();
/// assert_eq!(eval.sample_len(), 3 * 224 * 224);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transform {
    geometry: Geometry,
    /// Per channel: `out = byte * scale + bias`, folding `ToTensor` and `Normalize` together.
    scale: [f32; 3],
    bias: [f32; 3],
    normalized: bool,
    /// How much the final resize may enlarge a crop decoded at reduced JPEG scale; `None`:
    /// every JPEG is decoded at full size, as PIL does.
    dct_upsampling: Option<f64>,
    /// What follows the training crop (nothing for the evaluation transform).
    augment: Augment,
}

/// torchvision's default `RandomResizedCrop` aspect-ratio range.
pub const DEFAULT_RATIO: (f64, f64) = (3.0 / 4.0, 4.0 / 3.0);
/// The area range the project's training recipe uses (`scale=(0.2, 1.0)`).
pub const DEFAULT_SCALE: (f64, f64) = (0.2, 1.0);
/// The ImageNet channel means that pretrained torchvision models expect.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// The ImageNet channel standard deviations.
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

fn invalid(name: &'static str, expected: &str, value: impl std::fmt::Debug) -> DataError {
    DataError::InvalidParameter {
        name,
        expected: expected.to_string(),
        value: format!("{value:?}"),
    }
}

impl Transform {
    fn with_geometry(geometry: Geometry) -> Self {
        Self {
            geometry,
            scale: [1.0 / 255.0; 3],
            bias: [0.0; 3],
            normalized: false,
            dct_upsampling: None,
            augment: Augment::default(),
        }
    }

    /// `RandomResizedCrop(size, scale=(0.2, 1.0), ratio=(3/4, 4/3))` + `ToTensor`, the PyTorch
    /// ODIR scripts' training transform; no flip unless [`with_hflip`](Self::with_hflip) turns it on.
    pub fn train(size: u32) -> Self {
        Self::with_geometry(Geometry::RandomResizedCrop {
            size: size.max(1),
            scale: DEFAULT_SCALE,
            ratio: DEFAULT_RATIO,
            hflip: false,
        })
    }

    /// `RandomResizedCrop(size, scale, ratio)` + `ToTensor` with explicit ranges.
    pub fn random_resized_crop(
        size: u32,
        scale: (f64, f64),
        ratio: (f64, f64),
    ) -> Result<Self, DataError> {
        if size == 0 {
            return Err(invalid("crop size", "a positive number of pixels", size));
        }
        if !(scale.0 > 0.0 && scale.0 <= scale.1 && scale.1.is_finite()) {
            return Err(invalid("crop scale", "0 < min <= max", scale));
        }
        if !(ratio.0 > 0.0 && ratio.0 <= ratio.1 && ratio.1.is_finite()) {
            return Err(invalid("crop ratio", "0 < min <= max", ratio));
        }
        Ok(Self::with_geometry(Geometry::RandomResizedCrop {
            size,
            scale,
            ratio,
            hflip: false,
        }))
    }

    /// `Resize(resize)` + `CenterCrop(crop)` + `ToTensor`, the evaluation transform.
    pub fn eval(resize: u32, crop: u32) -> Result<Self, DataError> {
        if crop == 0 || resize < crop {
            return Err(invalid(
                "evaluation resize/crop",
                "0 < crop <= resize",
                (resize, crop),
            ));
        }
        Ok(Self::with_geometry(Geometry::ResizeCentreCrop {
            resize,
            crop,
            interpolation: Interpolation::Bilinear,
        }))
    }

    /// The evaluation transform with `Resize`'s `interpolation` (bilinear unless set); the
    /// training transform resizes bilinearly, and ignores it.
    pub fn with_interpolation(mut self, interpolation: Interpolation) -> Self {
        if let Geometry::ResizeCentreCrop {
            interpolation: i, ..
        } = &mut self.geometry
        {
            *i = interpolation;
        }
        self
    }

    /// Adds (or removes) a horizontal flip with probability 1/2 after the random crop; the
    /// evaluation transform never flips.
    pub fn with_hflip(mut self, on: bool) -> Self {
        if let Geometry::RandomResizedCrop { hflip, .. } = &mut self.geometry {
            *hflip = on;
        }
        self
    }

    /// Adds the augmentations of `augment` after the random crop and its horizontal flip
    /// (`RandomVerticalFlip`, `RandomRotation`, `ColorJitter`, in that order); the
    /// evaluation transform ignores them, as it ignores the flip.
    pub fn with_augment(mut self, augment: Augment) -> Result<Self, DataError> {
        augment.validate()?;
        if let Geometry::RandomResizedCrop { .. } = self.geometry {
            self.augment = augment;
        }
        Ok(self)
    }

    /// The augmentations after the crop.
    pub fn augment(&self) -> Augment {
        self.augment
    }

    /// Adds `Normalize(mean, std)` after `ToTensor`.
    pub fn with_normalization(mut self, mean: [f32; 3], std: [f32; 3]) -> Result<Self, DataError> {
        if std.iter().any(|&s| !(s > 0.0 && s.is_finite())) {
            return Err(invalid("normalisation std", "positive, finite values", std));
        }
        for c in 0..3 {
            self.scale[c] = 1.0 / (255.0 * std[c]);
            self.bias[c] = -mean[c] / std[c];
        }
        self.normalized = true;
        Ok(self)
    }

    /// Lets a JPEG be decoded at 1/2, 1/4 or 1/8 scale (libjpeg's scaled IDCT, faster on
    /// large photos) when the final resize then enlarges the crop by at most `factor` (1: only
    /// while it still shrinks it; PIL's `draft` enlarges by up to 2). The crop boxes are the
    /// same whatever the factor; the pixels inside them are no longer torchvision's, which
    /// decodes in full (a few levels apart, more on fine texture). Off by default.
    pub fn with_dct_upsampling(mut self, factor: f64) -> Result<Self, DataError> {
        if !(factor >= 1.0 && factor.is_finite()) {
            return Err(invalid(
                "DCT upsampling factor",
                "a finite number >= 1",
                factor,
            ));
        }
        self.dct_upsampling = Some(factor);
        Ok(self)
    }

    /// The enlargement allowed after a reduced-scale JPEG decode (see
    /// [`Transform::with_dct_upsampling`]); `None` when JPEGs are decoded in full.
    pub fn dct_upsampling(&self) -> Option<f64> {
        self.dct_upsampling
    }

    /// The map from the bytes [`Pipeline::run_u8`] writes to the values [`Pipeline::run`]
    /// writes: `ToTensor`'s 1/255, and `Normalize` when set.
    pub fn affine(&self) -> Affine {
        Affine {
            scale: self.scale.to_vec(),
            bias: self.bias.to_vec(),
        }
    }

    /// The geometric part of the transform.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Whether `Normalize` follows `ToTensor`.
    pub fn is_normalized(&self) -> bool {
        self.normalized
    }

    /// The output's side length: every sample becomes `[3, size, size]`.
    pub fn output_size(&self) -> u32 {
        match self.geometry {
            Geometry::RandomResizedCrop { size, .. } => size,
            Geometry::ResizeCentreCrop { crop, .. } => crop,
        }
    }

    /// The number of f32 values one sample occupies (`3 * size * size`).
    pub fn sample_len(&self) -> usize {
        let s = self.output_size() as usize;
        3 * s * s
    }
}

/// Decoding and resizing state for one thread: reused across images so the hot loop does not
/// allocate once the buffers have grown to the largest image.
#[derive(Debug)]
pub struct Pipeline {
    decoder: Decoder,
    resizer: Resizer,
    resized: Vec<u8>,
    /// The rotation's output, swapped with `resized`.
    scratch: Vec<u8>,
    /// A training crop's pixels, resized on their own.
    cropped: Vec<u8>,
}

impl Default for Pipeline {
    fn default() -> Self {
        Self::new()
    }
}

/// The crop and flip drawn for one sample, in the decoded image's pixel coordinates, and
/// the augmentations drawn after them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placement {
    /// The source region that is resized to the output.
    pub region: SourceRegion,
    /// Whether the output is mirrored left-right.
    pub flip: bool,
    /// The vertical flip, rotation and colour jitter.
    pub augment: AugmentDraw,
}

impl Transform {
    /// The crop box, flip and augmentations for an image of `height x width` pixels, drawn
    /// from `rng` in the same order as torchvision (crop parameters first, then the flips,
    /// the angle and the colour jitter).
    pub fn placement(&self, height: u32, width: u32, rng: &mut SampleRng) -> Placement {
        match self.geometry {
            Geometry::RandomResizedCrop {
                scale,
                ratio,
                hflip,
                ..
            } => {
                let b = random_resized_crop(rng, height, width, scale, ratio);
                let flip = hflip && rng.unit() < 0.5;
                Placement {
                    region: b.into(),
                    flip,
                    augment: self.augment.draw(rng),
                }
            }
            Geometry::ResizeCentreCrop { resize, crop, .. } => Placement {
                region: resize_centre_crop_region(height, width, resize, crop).0,
                flip: false,
                augment: AugmentDraw::default(),
            },
        }
    }
}

impl Pipeline {
    /// Empty buffers; they grow on first use.
    pub fn new() -> Self {
        Self {
            decoder: Decoder::new(),
            resizer: Resizer::new(),
            resized: Vec::new(),
            scratch: Vec::new(),
            cropped: Vec::new(),
        }
    }

    /// Decodes `path`, applies `transform` with draws from `rng`, and writes the
    /// `[3, size, size]` result into `out` (length [`Transform::sample_len`]).
    pub fn run(
        &mut self,
        transform: &Transform,
        path: &Path,
        rng: &mut SampleRng,
        out: &mut [f32],
    ) -> Result<(), DataError> {
        let flips = self.prepare(transform, path, rng)?;
        to_tensor(
            &self.resized,
            transform.output_size(),
            flips,
            transform,
            out,
        );
        Ok(())
    }

    /// Like [`Pipeline::run`], but writes the `[3, size, size]` bytes before `ToTensor`
    /// (channels first, flipped when drawn so); [`Transform::affine`] turns them into
    /// exactly the values `run` writes.
    pub fn run_u8(
        &mut self,
        transform: &Transform,
        path: &Path,
        rng: &mut SampleRng,
        out: &mut [u8],
    ) -> Result<(), DataError> {
        let flips = self.prepare(transform, path, rng)?;
        to_chw(&self.resized, transform.output_size(), flips, out);
        Ok(())
    }

    /// Like [`Pipeline::run_u8`] with the sample's draws given instead of drawn (to compare
    /// with another implementation of the same parameters); `placement.region` must lie in
    /// the decoded image, and is taken as it is (no reduced-size JPEG decoding).
    pub fn run_u8_placed(
        &mut self,
        transform: &Transform,
        path: &Path,
        placement: &Placement,
        out: &mut [u8],
    ) -> Result<(), DataError> {
        let image = self.decoder.decode_file(path)?;
        let size = transform.output_size();
        let resampling = transform.resampling();
        resize_region(
            &mut self.resizer,
            &mut self.resized,
            &mut self.cropped,
            image,
            (placement.region, resampling),
            size,
            path,
        )?;
        let flips = super::augment::apply(
            &placement.augment,
            placement.flip,
            &mut self.resized,
            &mut self.scratch,
            size,
        );
        to_chw(&self.resized, size, flips, out);
        Ok(())
    }

    /// Decodes, crops and resizes into `self.resized` (HWC bytes), then augments; returns the
    /// flips `(left-right, top-bottom)` still to apply.
    fn prepare(
        &mut self,
        transform: &Transform,
        path: &Path,
        rng: &mut SampleRng,
    ) -> Result<(bool, bool), DataError> {
        let size = transform.output_size();
        self.decoder.load(path)?;
        let scalable = match transform.dct_upsampling {
            Some(factor) => self
                .decoder
                .scalable_jpeg_size(path)?
                .map(|size| (size, factor)),
            None => None,
        };
        let (image, placement, region) = match scalable {
            Some(((width, height), factor)) => {
                // Choose the crop in full-resolution coordinates first (the same draws as a
                // full decode), then decode only what it needs, as small as it allows.
                let placement = transform.placement(height, width, rng);
                let denom = dct_reduction(placement.region, size, factor);
                let part = match denom {
                    1 => None,
                    _ => self
                        .decoder
                        .decode_jpeg_part(path, denom, placement.region)
                        .ok()
                        .map(|(_, region)| region),
                };
                if let Some(region) = part {
                    (self.decoder.decoded(), placement, region)
                } else {
                    // libjpeg refuses what the full decoder takes (a warning, such as an
                    // unknown JFIF revision, is an error there): the file, not the crop
                    // drawn, decides whether it decodes.
                    let image = self.decoder.decode_loaded_file(path)?;
                    (image, placement, placement.region)
                }
            }
            None => {
                let image = self.decoder.decode_loaded_file(path)?;
                let placement = transform.placement(image.height, image.width, rng);
                (image, placement, placement.region)
            }
        };
        resize_region(
            &mut self.resizer,
            &mut self.resized,
            &mut self.cropped,
            image,
            (region, transform.resampling()),
            size,
            path,
        )?;
        Ok(super::augment::apply(
            &placement.augment,
            placement.flip,
            &mut self.resized,
            &mut self.scratch,
            size,
        ))
    }
}

/// The largest JPEG DCT scale-down `d` (8, 4, 2 or 1) after which `region` still has at
/// least `size / upsampling` pixels in both directions: the final resize enlarges the
/// decoded crop by at most `upsampling` (1 = it only ever shrinks).
fn dct_reduction(region: SourceRegion, size: u32, upsampling: f64) -> u32 {
    let smaller = region.width.min(region.height);
    [8, 4, 2]
        .into_iter()
        .find(|&d| smaller / f64::from(d) * upsampling >= f64::from(size))
        .unwrap_or(1)
}

/// Where the resampling filter stops at the edges of the region it resizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Edges {
    /// At the region's own edges: torchvision's `crop` then `resize` (`RandomResizedCrop`).
    Region,
    /// At the image's edges: `Resize` of the whole image, then `CenterCrop`.
    Image,
}

impl Transform {
    /// Where the resize's filter stops, and which filter it is.
    fn resampling(&self) -> (Edges, FilterType) {
        match self.geometry {
            Geometry::RandomResizedCrop { .. } => (Edges::Region, FilterType::Bilinear),
            Geometry::ResizeCentreCrop { interpolation, .. } => {
                (Edges::Image, interpolation.filter())
            }
        }
    }
}

/// Resizes `region` of `image` to `size x size` in one pass with `filter` and antialiasing,
/// as PIL's `resize(..., BILINEAR)` (or `BICUBIC`) that torchvision calls. With
/// [`Edges::Region`] the region's whole pixels are first copied into `cropped`, so that no
/// filter reaches past them.
fn resize_region(
    resizer: &mut Resizer,
    resized: &mut Vec<u8>,
    cropped: &mut Vec<u8>,
    image: RgbView<'_>,
    (region, (edges, filter)): (SourceRegion, (Edges, FilterType)),
    size: u32,
    path: &Path,
) -> Result<(), DataError> {
    let (image, region) = match edges {
        Edges::Image => (image, region),
        Edges::Region => crop_pixels(image, region, cropped),
    };
    let len = size as usize * size as usize * 3;
    resized.resize(len, 0);
    let fail = |e: &dyn std::fmt::Display| DataError::DecodeImage {
        path: path.to_path_buf(),
        message: format!("cannot resize: {e}"),
    };
    let src = ImageRef::new(image.width, image.height, image.pixels, PixelType::U8x3)
        .map_err(|e| fail(&e))?;
    let mut dst = Image::from_slice_u8(size, size, &mut resized[..], PixelType::U8x3)
        .map_err(|e| fail(&e))?;
    let options = ResizeOptions::new()
        .resize_alg(ResizeAlg::Convolution(filter))
        .crop(region.left, region.top, region.width, region.height);
    resizer
        .resize(&src, &mut dst, &options)
        .map_err(|e| fail(&e))?;
    Ok(())
}

/// Copies the whole pixels that `region` touches into `cropped`; returns them as an image
/// and `region` in its coordinates (the same box, for a box of whole pixels).
fn crop_pixels<'a>(
    image: RgbView<'_>,
    region: SourceRegion,
    cropped: &'a mut Vec<u8>,
) -> (RgbView<'a>, SourceRegion) {
    let clamp = |v: f64, max: u32| (v.max(0.0) as u32).min(max);
    let (x0, y0) = (
        clamp(region.left.floor(), image.width),
        clamp(region.top.floor(), image.height),
    );
    let x1 = clamp((region.left + region.width).ceil(), image.width).max(x0 + 1);
    let y1 = clamp((region.top + region.height).ceil(), image.height).max(y0 + 1);
    let (x1, y1) = (x1.min(image.width), y1.min(image.height));
    let (w, h) = ((x1 - x0) as usize, (y1 - y0) as usize);
    let stride = image.width as usize * 3;
    cropped.clear();
    for y in y0 as usize..y1 as usize {
        let start = y * stride + x0 as usize * 3;
        cropped.extend_from_slice(&image.pixels[start..start + w * 3]);
    }
    let view = RgbView {
        width: w as u32,
        height: h as u32,
        pixels: cropped,
    };
    let inner = SourceRegion {
        top: region.top - f64::from(y0),
        left: region.left - f64::from(x0),
        height: region.height,
        width: region.width,
    };
    (view, inner)
}

/// HWC bytes to CHW values, mirrored left-right and top-bottom as `(hflip, vflip)` say:
/// `value(channel, byte)` for each pixel (monomorphised, so each caller's loop is as tight as
/// a hand-written one).
fn hwc_to_chw<T>(
    pixels: &[u8],
    size: u32,
    (flip, vflip): (bool, bool),
    out: &mut [T],
    value: impl Fn(usize, u8) -> T,
) {
    let s = size as usize;
    let plane = s * s;
    let (r_out, rest) = out.split_at_mut(plane);
    let (g_out, b_out) = rest.split_at_mut(plane);
    for y in 0..s {
        let row = &pixels[y * s * 3..(y + 1) * s * 3];
        let dy = if vflip { s - 1 - y } else { y };
        let (r_row, g_row, b_row) = (
            &mut r_out[dy * s..(dy + 1) * s],
            &mut g_out[dy * s..(dy + 1) * s],
            &mut b_out[dy * s..(dy + 1) * s],
        );
        for (x, px) in row.chunks_exact(3).enumerate() {
            let dx = if flip { s - 1 - x } else { x };
            r_row[dx] = value(0, px[0]);
            g_row[dx] = value(1, px[1]);
            b_row[dx] = value(2, px[2]);
        }
    }
}

/// HWC bytes to CHW bytes, mirrored as `flips` say.
fn to_chw(pixels: &[u8], size: u32, flips: (bool, bool), out: &mut [u8]) {
    hwc_to_chw(pixels, size, flips, out, |_, byte| byte);
}

/// HWC bytes to CHW floats (`byte * scale + bias`), mirrored as `flips` say.
fn to_tensor(pixels: &[u8], size: u32, flips: (bool, bool), t: &Transform, out: &mut [f32]) {
    hwc_to_chw(pixels, size, flips, out, |c, byte| {
        f32::from(byte) * t.scale[c] + t.bias[c]
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn to_tensor_is_chw_in_unit_range_and_flips_columns() {
        // A 2x2 image: (0,0) red, (0,1) green, (1,0) blue, (1,1) white.
        let px = [255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 255];
        let t = Transform::train(2);
        let mut out = [0f32; 12];
        to_tensor(&px, 2, (false, false), &t, &mut out);
        assert_eq!(
            out,
            [1., 0., 0., 1., 0., 1., 0., 1., 0., 0., 1., 1.],
            "R plane, G plane, B plane"
        );
        to_tensor(&px, 2, (true, false), &t, &mut out);
        assert_eq!(out, [0., 1., 1., 0., 1., 0., 1., 0., 0., 0., 1., 1.]);
        to_tensor(&px, 2, (false, true), &t, &mut out);
        assert_eq!(out, [0., 1., 1., 0., 0., 1., 0., 1., 1., 1., 0., 0.]);
    }

    #[test]
    fn normalisation_applies_mean_and_std_per_channel() {
        let t = Transform::train(1)
            .with_normalization([0.5, 0.25, 0.0], [0.5, 0.25, 2.0])
            .unwrap();
        let mut out = [0f32; 3];
        to_tensor(&[255, 0, 51], 1, (false, false), &t, &mut out);
        let want = [(1.0 - 0.5) / 0.5, (0.0 - 0.25) / 0.25, (0.2 - 0.0) / 2.0];
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 1e-6, "{out:?} vs {want:?}");
        }
        assert!(matches!(
            Transform::train(1).with_normalization([0.0; 3], [1.0, 0.0, 1.0]),
            Err(DataError::InvalidParameter { .. })
        ));
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        let refused = |r: Result<Transform, DataError>| match r {
            Err(DataError::InvalidParameter { name, value, .. }) => (name, value),
            other => panic!("expected InvalidParameter, got {:?}", other.map(|_| ())),
        };
        assert_eq!(
            refused(Transform::eval(200, 224)),
            ("evaluation resize/crop", "(200, 224)".to_string())
        );
        let crop = |size, scale, ratio| refused(Transform::random_resized_crop(size, scale, ratio));
        assert_eq!(
            crop(0, DEFAULT_SCALE, DEFAULT_RATIO),
            ("crop size", "0".to_string())
        );
        assert_eq!(
            crop(8, (0.5, 0.2), DEFAULT_RATIO),
            ("crop scale", "(0.5, 0.2)".to_string())
        );
        assert_eq!(
            crop(8, DEFAULT_SCALE, (0.0, 1.0)),
            ("crop ratio", "(0.0, 1.0)".to_string())
        );
    }

    #[test]
    fn resizing_a_uniform_region_keeps_its_colour() {
        let (w, h) = (40u32, 30u32);
        let mut px = vec![0u8; (w * h * 3) as usize];
        for p in px.chunks_exact_mut(3) {
            p.copy_from_slice(&[200, 100, 50]);
        }
        let view = RgbView {
            width: w,
            height: h,
            pixels: &px,
        };
        let mut resizer = Resizer::new();
        let mut out = Vec::new();
        let region = SourceRegion {
            top: 3.0,
            left: 5.0,
            height: 20.0,
            width: 25.0,
        };
        for edges in [Edges::Image, Edges::Region] {
            resize_region(
                &mut resizer,
                &mut out,
                &mut Vec::new(),
                view,
                (region, (edges, FilterType::Bilinear)),
                8,
                Path::new("x"),
            )
            .unwrap();
            assert!(out.chunks_exact(3).all(|p| p == [200, 100, 50]));
        }
        assert_eq!(out.len(), 8 * 8 * 3);
        assert!(out.chunks_exact(3).all(|p| p == [200, 100, 50]));
    }

    #[test]
    fn eval_placement_is_deterministic_and_never_flips() {
        let t = Transform::eval(256, 224).unwrap().with_hflip(true);
        let mut rng = SampleRng::new(0, 0, 0);
        let p = t.placement(512, 512, &mut rng);
        assert!(!p.flip);
        assert!((p.region.top - 32.0).abs() < 1e-9 && (p.region.height - 448.0).abs() < 1e-9);
    }
}
