//! One sample as the loader sees it: its layout (shapes, value kinds, an optional byte form
//! and padding) and [`SampleOut`], its place in a batch buffer, where a
//! [`Dataset`](crate::dataset::Dataset) writes it.

use crate::error::DataError;

/// The kind of values a sample's input or targets hold, as the task sees them in a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ValueKind {
    /// `f32` (tch's `Kind::Float`): pixels, features, regression or multi-hot targets.
    #[default]
    F32,
    /// `i64` (tch's `Kind::Int64`): token ids, class indices for a cross-entropy loss.
    I64,
}

impl ValueKind {
    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::I64 => 8,
        }
    }
}

/// The element type of a batch's input buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Storage {
    /// One byte per value: image pixels as decoded. A quarter of the bytes of `F32` to move,
    /// converted to floats (and normalised) where the batch is used, e.g. on the GPU.
    U8,
    /// `f32` values, final.
    F32,
    /// `i64` values (inputs of [`ValueKind::I64`]).
    I64,
}

impl Storage {
    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::F32 => 4,
            Self::I64 => 8,
        }
    }

    /// The storage of a layout's final values: `F32` or `I64`, by [`SampleLayout::input_kind`].
    pub fn of(kind: ValueKind) -> Self {
        match kind {
            ValueKind::F32 => Self::F32,
            ValueKind::I64 => Self::I64,
        }
    }
}

/// How the bytes of a [`Storage::U8`] sample become its `f32` values: per channel (an index
/// of the first axis of the sample's shape), `value = byte as f32 * scale[c] + bias[c]`, a
/// multiplication and then an addition, each rounded to `f32` (no fused multiply-add), so the
/// result is the same bit for bit wherever it is computed. There is one scale for the whole
/// sample or one per index of the first axis (`shape[0]`, a padded layout's maximum length),
/// and as many biases ([`SampleLayout::check`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Affine {
    /// Per-channel factor.
    pub scale: Vec<f32>,
    /// Per-channel offset.
    pub bias: Vec<f32>,
}

impl Affine {
    /// Whether every offset is zero (then the addition can be skipped: `x + 0.0 == x` for the
    /// non-negative products of a byte and a positive scale).
    pub fn has_bias(&self) -> bool {
        self.bias.iter().any(|&b| b != 0.0)
    }

    /// Converts `bytes` (one sample, or the first positions of a padded one; channel-major)
    /// to floats into `out`, `step` values per channel ([`SampleLayout::step_len`]): value
    /// `j` takes scale `j / step`, or the one scale there is. Values past the last scale's
    /// channel are left as they are ([`SampleLayout::check`] refuses such a map).
    pub fn apply(&self, bytes: &[u8], step: usize, out: &mut [f32]) {
        let plane = if self.scale.len() == 1 {
            bytes.len()
        } else {
            step
        };
        let channels = self.scale.iter().zip(&self.bias);
        for ((src, dst), (&s, &b)) in bytes
            .chunks(plane.max(1))
            .zip(out.chunks_mut(plane.max(1)))
            .zip(channels)
        {
            for (o, &v) in dst.iter_mut().zip(src) {
                *o = f32::from(v) * s + b;
            }
        }
    }
}

/// The shape of one sample and what the data set can write.
///
/// `SampleLayout::new(shape, target_shape)` is `f32` inputs and targets; the builder methods
/// change the kinds, add a byte form or padding.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SampleLayout {
    /// The input's shape, e.g. `[3, 224, 224]` (channels first). With
    /// [`SampleLayout::padding`] the first axis is the variable one and `shape[0]` its
    /// maximum length.
    pub shape: Vec<usize>,
    /// The input's values.
    pub input_kind: ValueKind,
    /// The targets' shape per sample: `[8]` for 8 multi-hot labels, `[]` for one value (a
    /// class index; the batch's targets are then `[B]`).
    pub target_shape: Vec<usize>,
    /// The targets' values.
    pub target_kind: ValueKind,
    /// `Some` when the data set can write its input as bytes ([`Storage::U8`]) that this
    /// affine map turns into the `f32` values it would otherwise write; `None` when it writes
    /// final values only.
    pub bytes: Option<Affine>,
    /// `Some` for variable-length inputs: each sample says its length along the first axis
    /// ([`SampleOut::length`]), the loader fills the rest up to `shape[0]` with the padding
    /// value, and batches carry the lengths.
    pub padding: Option<Padding>,
}

/// How variable-length samples are padded in a batch (the job of a `collate_fn` with
/// `pad_sequence` in PyTorch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Padding {
    /// The value of the padding positions (0 for token id 0, say).
    pub value: f64,
    /// How long a batch's inputs are along the variable axis.
    pub to: PadTo,
}

/// The length a batch is padded to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PadTo {
    /// The longest sample of the batch (`pad_sequence`).
    #[default]
    Longest,
    /// Always the layout's maximum, `shape[0]`.
    Fixed,
}

impl SampleLayout {
    /// `f32` inputs of `shape` and `f32` targets of `target_shape`, no byte form, no padding.
    pub fn new(shape: impl Into<Vec<usize>>, target_shape: impl Into<Vec<usize>>) -> Self {
        Self {
            shape: shape.into(),
            target_shape: target_shape.into(),
            ..Self::default()
        }
    }

    /// With inputs of `kind`.
    pub fn input_kind(mut self, kind: ValueKind) -> Self {
        self.input_kind = kind;
        self
    }

    /// With targets of `kind`.
    pub fn target_kind(mut self, kind: ValueKind) -> Self {
        self.target_kind = kind;
        self
    }

    /// With a byte form of the input.
    pub fn bytes(mut self, affine: Affine) -> Self {
        self.bytes = Some(affine);
        self
    }

    /// With variable lengths along the first axis, padded as `padding` says.
    pub fn padded(mut self, padding: Padding) -> Self {
        self.padding = Some(padding);
        self
    }

    /// Values in one sample's input (the product of `shape`; at its maximum length).
    pub fn input_len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Values per position of the variable axis (the product of `shape[1..]`).
    pub fn step_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// The input's maximum length along its first axis (1 for a scalar input).
    pub fn max_len(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Target values per sample (the product of `target_shape`; 1 for a scalar).
    pub fn targets_len(&self) -> usize {
        self.target_shape.iter().product()
    }

    /// Checks that the layout can be loaded in `storage`.
    pub fn check(&self, storage: Storage) -> Result<(), DataError> {
        let fits = match storage {
            Storage::U8 => self.input_kind == ValueKind::F32 && self.bytes.is_some(),
            Storage::F32 => self.input_kind == ValueKind::F32,
            Storage::I64 => self.input_kind == ValueKind::I64,
        };
        if !fits {
            return Err(DataError::InvalidParameter {
                name: "batch storage",
                expected: format!(
                    "{:?} for {:?} inputs{}",
                    Storage::of(self.input_kind),
                    self.input_kind,
                    if self.bytes.is_some() { " (or U8)" } else { "" }
                ),
                value: format!("{storage:?}"),
            });
        }
        if let Some(affine) = &self.bytes {
            let channels = self.max_len();
            let scales = affine.scale.len();
            if !(scales == 1 || scales == channels) || affine.bias.len() != scales {
                return Err(DataError::InvalidParameter {
                    name: "byte affine map",
                    expected: format!(
                        "1 or {channels} scales (one per index of the first axis of {:?}) \
                         and as many biases",
                        self.shape
                    ),
                    value: format!("{scales} scales and {} biases", affine.bias.len()),
                });
            }
        }
        if self.padding.is_some() && self.shape.is_empty() {
            return Err(DataError::InvalidParameter {
                name: "sample layout",
                expected: "a first axis to pad along, for a padded layout".to_string(),
                value: "a scalar input shape []".to_string(),
            });
        }
        Ok(())
    }
}

/// One sample's place in a batch buffer: its input, in the storage the loader chose, its
/// targets, and (for padded layouts) its length.
///
/// The input and the targets start zeroed: the loader clears them before each
/// [`Dataset::write`](crate::Dataset::write), whatever the buffer held for an earlier batch.
#[derive(Debug)]
pub struct SampleOut<'a> {
    /// The input values, `SampleLayout::input_len` of them (at the maximum length).
    pub input: Input<'a>,
    /// The targets, `SampleLayout::targets_len` of them, of the layout's target kind.
    pub targets: Targets<'a>,
    /// The sample's length along the first axis, preset to the maximum `shape[0]`. A padded
    /// layout's data set sets it and writes that many positions; the loader pads the rest.
    /// Without padding it must stay at the maximum.
    pub length: &'a mut usize,
}

/// A sample's input buffer.
#[derive(Debug)]
pub enum Input<'a> {
    /// Write bytes (asked only of data sets whose layout has [`SampleLayout::bytes`]).
    U8(&'a mut [u8]),
    /// Write final `f32` values.
    F32(&'a mut [f32]),
    /// Write `i64` values (layouts with `i64` inputs).
    I64(&'a mut [i64]),
}

/// A sample's target buffer, of the layout's target kind.
#[derive(Debug)]
pub enum Targets<'a> {
    /// `f32` targets.
    F32(&'a mut [f32]),
    /// `i64` targets.
    I64(&'a mut [i64]),
}

impl<'a> Input<'a> {
    /// The `f32` buffer, or an error naming the storage asked for instead.
    pub fn f32(self) -> Result<&'a mut [f32], DataError> {
        match self {
            Self::F32(v) => Ok(v),
            other => Err(kind_mismatch("input", "f32", other.kind_name())),
        }
    }

    /// The `i64` buffer, or an error naming the storage asked for instead.
    pub fn i64(self) -> Result<&'a mut [i64], DataError> {
        match self {
            Self::I64(v) => Ok(v),
            other => Err(kind_mismatch("input", "i64", other.kind_name())),
        }
    }

    /// Sets every value to zero.
    pub(crate) fn fill_zero(&mut self) {
        match self {
            Self::U8(v) => v.fill(0),
            Self::F32(v) => v.fill(0.0),
            Self::I64(v) => v.fill(0),
        }
    }

    fn kind_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "u8",
            Self::F32(_) => "f32",
            Self::I64(_) => "i64",
        }
    }
}

impl<'a> Targets<'a> {
    /// The `f32` buffer, or an error when the layout's targets are `i64`.
    pub fn f32(self) -> Result<&'a mut [f32], DataError> {
        match self {
            Self::F32(v) => Ok(v),
            Self::I64(_) => Err(kind_mismatch("targets", "f32", "i64")),
        }
    }

    /// The `i64` buffer, or an error when the layout's targets are `f32`.
    pub fn i64(self) -> Result<&'a mut [i64], DataError> {
        match self {
            Self::I64(v) => Ok(v),
            Self::F32(_) => Err(kind_mismatch("targets", "i64", "f32")),
        }
    }

    /// Sets every value to zero.
    pub(crate) fn fill_zero(&mut self) {
        match self {
            Self::F32(v) => v.fill(0.0),
            Self::I64(v) => v.fill(0),
        }
    }
}

fn kind_mismatch(what: &'static str, wanted: &str, found: &str) -> DataError {
    DataError::InvalidParameter {
        name: what,
        expected: format!("{wanted} values, as the data set's layout declares"),
        value: format!("a {found} buffer"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affine_is_per_channel_multiply_then_add() {
        let a = Affine {
            scale: vec![1.0 / 255.0, 2.0],
            bias: vec![0.0, -1.0],
        };
        let mut out = [0f32; 4];
        a.apply(&[255, 0, 3, 1], 2, &mut out);
        assert_eq!(out, [1.0, 0.0, 5.0, 1.0]);
        assert!(a.has_bias());
        let plain = Affine {
            scale: vec![0.5; 3],
            bias: vec![0.0; 3],
        };
        assert!(!plain.has_bias());
    }

    /// With one scale per position of a padded layout, the first positions of a sample take
    /// the first scales, `step` values each; a single scale serves every value.
    #[test]
    fn affine_takes_its_plane_from_the_step_not_from_the_sample() {
        let per_position = Affine {
            scale: vec![1.0, 10.0, 100.0, 1000.0],
            bias: vec![0.0; 4],
        };
        let mut out = [0f32; 4];
        per_position.apply(&[1, 2, 3, 4], 2, &mut out);
        assert_eq!(out, [1.0, 2.0, 30.0, 40.0]);
        let mut out = [0f32; 6];
        per_position.apply(&[1; 6], 2, &mut out);
        assert_eq!(out, [1.0, 1.0, 10.0, 10.0, 100.0, 100.0]);
        let one = Affine {
            scale: vec![2.0],
            bias: vec![1.0],
        };
        one.apply(&[1, 2, 3, 4, 5, 6], 2, &mut out);
        assert_eq!(out, [3.0, 5.0, 7.0, 9.0, 11.0, 13.0]);
    }

    /// A byte map must have 1 or `shape[0]` scales and as many biases; the error names both
    /// counts.
    #[test]
    fn layouts_refuse_a_byte_map_of_the_wrong_size() {
        let map = |scales: usize, biases: usize| Affine {
            scale: vec![1.0; scales],
            bias: vec![0.0; biases],
        };
        let padded = |affine| {
            SampleLayout::new([4, 2], []).bytes(affine).padded(Padding {
                value: 0.0,
                to: PadTo::Longest,
            })
        };
        for storage in [Storage::U8, Storage::F32] {
            padded(map(4, 4)).check(storage).unwrap();
            padded(map(1, 1)).check(storage).unwrap();
            for (scales, biases) in [(3, 3), (4, 1), (0, 0), (8, 8)] {
                let e = padded(map(scales, biases)).check(storage).unwrap_err();
                let text = e.to_string();
                assert!(
                    text.contains("byte affine map")
                        && text.contains(&format!("{scales} scales and {biases} biases"))
                        && text.contains("1 or 4 scales"),
                    "{text}"
                );
            }
        }
        let scalar = SampleLayout::new([], []).bytes(map(1, 1));
        scalar.check(Storage::U8).unwrap();
        assert!(SampleLayout::new([], [])
            .bytes(map(2, 2))
            .check(Storage::U8)
            .is_err());
    }
}
