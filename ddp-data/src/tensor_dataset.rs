//! [`TensorDataset`]: samples held in memory, and its [`Array`]s.

use std::sync::Arc;

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::item::{write_input, write_targets, Values, ValuesRef};
use crate::rng::SampleRng;
use crate::sample::{Affine, Padding, SampleLayout, SampleOut, Storage, ValueKind};

/// Values with a shape: `shape[0]` samples of `shape[1..]` values each, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    shape: Vec<usize>,
    values: Values,
}

impl Array {
    /// `values` in `shape`; fails when the number of values is not the product of the shape
    /// or the shape has no first (sample) axis.
    pub fn new(values: impl Into<Values>, shape: impl Into<Vec<usize>>) -> Result<Self, DataError> {
        let (values, shape) = (values.into(), shape.into());
        let expected: usize = shape.iter().product();
        if shape.is_empty() || expected != values.len() {
            return Err(DataError::InvalidParameter {
                name: "array shape",
                expected: format!(
                    "a shape [samples, ...] whose product is the number of values ({})",
                    values.len()
                ),
                value: format!("{shape:?}"),
            });
        }
        Ok(Self { shape, values })
    }

    /// The shape, samples first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The values, row-major.
    pub fn values(&self) -> &Values {
        &self.values
    }

    /// Number of samples (`shape[0]`).
    pub fn samples(&self) -> usize {
        self.shape[0]
    }

    /// Values per sample.
    fn per_sample(&self) -> usize {
        self.shape[1..].iter().product()
    }

    /// Sample `i`'s values.
    fn row(&self, i: usize) -> ValuesRef<'_> {
        let n = self.per_sample();
        self.values.view().slice(i * n..(i + 1) * n)
    }

    /// The values of a tch tensor `[samples, ...]`, copied to the host: floating-point kinds
    /// as `f32`, `Uint8` as bytes, other integer kinds as `i64`, booleans as `f32` 0/1.
    #[cfg(feature = "tch")]
    pub fn from_tensor(tensor: &tch::Tensor) -> Result<Self, DataError> {
        use tch::Kind;
        let shape: Vec<usize> = tensor.size().iter().map(|&d| d as usize).collect();
        let flat = tensor
            .f_to_device(tch::Device::Cpu)?
            .f_contiguous()?
            .f_view([-1])?;
        let values = match tensor.kind() {
            Kind::Uint8 => Values::U8(Vec::try_from(&flat)?),
            Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64 => {
                Values::I64(Vec::try_from(&flat.f_to_kind(Kind::Int64)?)?)
            }
            _ => Values::F32(Vec::try_from(&flat.f_to_kind(Kind::Float)?)?),
        };
        Self::new(values, shape)
    }
}

/// A 1-D array: one value per sample (class indices, regression targets).
impl<T> From<Vec<T>> for Array
where
    Vec<T>: Into<Values>,
{
    fn from(values: Vec<T>) -> Self {
        let values = values.into();
        Self {
            shape: vec![values.len()],
            values,
        }
    }
}

/// The inputs: an array, or sequences of different lengths.
#[derive(Debug, Clone)]
enum Inputs {
    Fixed(Array),
    Ragged {
        values: Values,
        /// Sample `i` is `values[offsets[i]..offsets[i + 1]]`.
        offsets: Vec<usize>,
    },
}

#[derive(Debug, Clone)]
struct Inner {
    inputs: Inputs,
    targets: Array,
    layout: SampleLayout,
}

/// Samples held in memory (PyTorch's `TensorDataset`): sample `i` is row `i` of the inputs
/// and of the targets. Cloning shares the data.
///
/// Inputs of bytes get an identity byte form ([`SampleLayout::bytes`]; batches hold their
/// values as `f32`, or as bytes for a GPU, converted there); [`TensorDataset::with_affine`]
/// scales them (`1/255` for pixels, say).
///
/// [`TensorDataset`]: samples held in memory, as PyTorch's `TensorDataset`: inputs and
/// targets of any shape, `f32`, `i64` or bytes, and variable-length sequences padded per
/// batch (PyTorch's `pad_sequence` in a `collate_fn`).
///
/// ```
/// use ddp_data::{Array, DataError, HostLoader, LoaderConfig, PadTo, Padding, TensorDataset};
///
/// // Four points with two features each, and a class index per point.
/// let points = TensorDataset::new(
///     Array::new(vec![0f32, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0], [4, 2])?,
///     Array::from(vec![0i64, 1, 1, 0]),
/// )?;
/// assert_eq!(points.len(), 4);
/// assert_eq!(points.layout().target_shape, Vec::<usize>::new()); // one class per sample
///
/// // Token sequences of different lengths, padded with 0 to the longest of each batch.
/// let texts = TensorDataset::sequences(
///     vec![vec![5i64, 6, 7], vec![8], vec![9, 10]],
///     Array::from(vec![1i64, 0, 1]),
///     Padding { value: 0.0, to: PadTo::Longest },
/// )?;
/// let batch = HostLoader::new(texts, vec![1, 2], &LoaderConfig::new(2))?.next().unwrap()?;
/// assert_eq!(batch.lengths(), Some(&[1, 2][..]));
/// assert_eq!(batch.padded_len(), 2);
/// assert_eq!(batch.input_i64(), Some(&[8, 0, 0, 9, 10, 0][..])); // rows of the maximum, 3
/// # Ok::<(), DataError>(())
/// ```
#[derive(Debug, Clone)]
pub struct TensorDataset {
    inner: Arc<Inner>,
}

fn kind_of(values: &Values) -> ValueKind {
    match values {
        Values::I64(_) => ValueKind::I64,
        Values::F32(_) | Values::U8(_) => ValueKind::F32,
    }
}

fn target_kind(targets: &Array) -> Result<ValueKind, DataError> {
    match targets.values {
        Values::F32(_) => Ok(ValueKind::F32),
        Values::I64(_) => Ok(ValueKind::I64),
        Values::U8(_) => Err(DataError::InvalidParameter {
            name: "targets",
            expected: "f32 or i64 values".to_string(),
            value: "bytes (convert them to i64 class indices or f32 values)".to_string(),
        }),
    }
}

fn same_count(inputs: usize, targets: usize) -> Result<(), DataError> {
    if inputs == targets {
        return Ok(());
    }
    Err(DataError::InvalidParameter {
        name: "targets",
        expected: format!("one row per input sample ({inputs})"),
        value: format!("{targets} rows"),
    })
}

impl TensorDataset {
    /// Sample `i` is `inputs[i]` with `targets[i]`; both must have the same number of
    /// samples.
    pub fn new(inputs: Array, targets: Array) -> Result<Self, DataError> {
        same_count(inputs.samples(), targets.samples())?;
        let mut layout = SampleLayout::new(&inputs.shape[1..], &targets.shape[1..])
            .input_kind(kind_of(&inputs.values))
            .target_kind(target_kind(&targets)?);
        if let Values::U8(_) = inputs.values {
            let affine = identity(&layout.shape);
            layout = layout.bytes(affine);
        }
        Ok(Self::from_parts(Inputs::Fixed(inputs), targets, layout))
    }

    /// Sequences of different lengths (one value per position: token ids, say) with
    /// `targets[i]` for sequence `i`, padded per batch as `padding` says; the maximum length
    /// is the longest sequence ([`TensorDataset::max_len`] raises it). All sequences must be
    /// of one kind.
    pub fn sequences<V: Into<Values>>(
        sequences: Vec<V>,
        targets: Array,
        padding: Padding,
    ) -> Result<Self, DataError> {
        same_count(sequences.len(), targets.samples())?;
        let sequences: Vec<Values> = sequences.into_iter().map(Into::into).collect();
        let mut offsets = Vec::with_capacity(sequences.len() + 1);
        offsets.push(0);
        let mut all = match sequences.first() {
            Some(Values::U8(_)) => Values::U8(Vec::new()),
            Some(Values::I64(_)) => Values::I64(Vec::new()),
            _ => Values::F32(Vec::new()),
        };
        for (i, s) in sequences.into_iter().enumerate() {
            match (&mut all, s) {
                (Values::U8(a), Values::U8(s)) => a.extend(s),
                (Values::F32(a), Values::F32(s)) => a.extend(s),
                (Values::I64(a), Values::I64(s)) => a.extend(s),
                (a, s) => {
                    return Err(DataError::SampleKind {
                        sample: format!("sequence {i}"),
                        what: "input",
                        expected: a.kind_name().to_string(),
                        found: s.kind_name().to_string(),
                    })
                }
            }
            offsets.push(all.len());
        }
        let longest = offsets.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        let mut layout = SampleLayout::new([longest.max(1)], &targets.shape[1..])
            .input_kind(kind_of(&all))
            .target_kind(target_kind(&targets)?)
            .padded(padding);
        if let Values::U8(_) = all {
            layout = layout.bytes(identity(&[1]));
        }
        let inputs = Inputs::Ragged {
            values: all,
            offsets,
        };
        Ok(Self::from_parts(inputs, targets, layout))
    }

    /// Inputs and targets from tch tensors `[samples, ...]` (see [`Array::from_tensor`] for
    /// the kinds); copies them to host memory.
    #[cfg(feature = "tch")]
    pub fn from_tensors(inputs: &tch::Tensor, targets: &tch::Tensor) -> Result<Self, DataError> {
        Self::new(Array::from_tensor(inputs)?, Array::from_tensor(targets)?)
    }

    /// The same samples with the maximum length of variable-length inputs set to `len`
    /// (what [`PadTo::Fixed`](crate::PadTo::Fixed) pads to); fails when a sequence is
    /// longer, or the inputs are not sequences.
    pub fn max_len(self, len: usize) -> Result<Self, DataError> {
        let inner = Arc::unwrap_or_clone(self.inner);
        let Inputs::Ragged { offsets, .. } = &inner.inputs else {
            return Err(DataError::InvalidParameter {
                name: "maximum length",
                expected: "a data set of sequences (TensorDataset::sequences)".to_string(),
                value: format!("{len} for fixed-shape inputs"),
            });
        };
        if let Some(i) = (0..offsets.len() - 1).find(|&i| offsets[i + 1] - offsets[i] > len) {
            return Err(DataError::SampleShape {
                sample: format!("sequence {i}"),
                what: "input",
                expected: format!("at most {len} positions (the maximum length asked for)"),
                found: offsets[i + 1] - offsets[i],
            });
        }
        let mut layout = inner.layout;
        layout.shape[0] = len.max(1);
        Ok(Self::from_parts(inner.inputs, inner.targets, layout))
    }

    /// The same samples with bytes turned into `f32` by `affine`, whose scales are one for
    /// every channel (the first axis of a sample's shape) or one for all, with as many biases
    /// ([`SampleLayout::check`]); fails when the inputs are not bytes or the counts differ.
    pub fn with_affine(self, affine: Affine) -> Result<Self, DataError> {
        if self.inner.layout.bytes.is_none() {
            return Err(DataError::InvalidParameter {
                name: "byte affine map",
                expected: "byte inputs".to_string(),
                value: format!("{:?} inputs", self.inner.layout.input_kind),
            });
        }
        let mut inner = Arc::unwrap_or_clone(self.inner);
        inner.layout.bytes = Some(affine);
        inner.layout.check(Storage::U8)?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    fn from_parts(inputs: Inputs, targets: Array, layout: SampleLayout) -> Self {
        Self {
            inner: Arc::new(Inner {
                inputs,
                targets,
                layout,
            }),
        }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.inner.targets.samples()
    }

    /// Whether there is no sample.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape and kinds of every sample.
    pub fn layout(&self) -> SampleLayout {
        self.inner.layout.clone()
    }

    /// Sample `index`'s input values (unpadded).
    pub fn input(&self, index: usize) -> Result<ValuesRef<'_>, DataError> {
        self.check(index)?;
        Ok(match &self.inner.inputs {
            Inputs::Fixed(a) => a.row(index),
            Inputs::Ragged { values, offsets } => {
                values.view().slice(offsets[index]..offsets[index + 1])
            }
        })
    }

    /// Sample `index`'s target values.
    pub fn target(&self, index: usize) -> Result<ValuesRef<'_>, DataError> {
        self.check(index)?;
        Ok(self.inner.targets.row(index))
    }

    fn check(&self, index: usize) -> Result<(), DataError> {
        if index < self.len() {
            return Ok(());
        }
        Err(DataError::IndexOutOfRange {
            index,
            len: self.len(),
        })
    }
}

/// `byte as f32` per channel.
fn identity(shape: &[usize]) -> Affine {
    let channels = shape.first().copied().unwrap_or(1);
    Affine {
        scale: vec![1.0; channels],
        bias: vec![0.0; channels],
    }
}

impl Dataset for TensorDataset {
    type Worker = ();

    fn len(&self) -> usize {
        TensorDataset::len(self)
    }

    fn layout(&self) -> SampleLayout {
        TensorDataset::layout(self)
    }

    fn worker(&self) {}

    fn write(
        &self,
        _: &mut (),
        index: usize,
        _: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        let layout = &self.inner.layout;
        let sample = || format!("sample {index}");
        write_input(layout, self.input(index)?, out.input, out.length, sample)?;
        write_targets(self.target(index)?, out.targets, sample)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::item::input_length;

    /// The sample's length in the data set's layout.
    fn length_of(set: &TensorDataset, index: usize) -> usize {
        let n = set.input(index).unwrap().len();
        input_length(&set.inner.layout, n, String::new).unwrap()
    }
    use crate::loader::{HostLoader, LoaderConfig};
    use crate::sample::PadTo;

    #[test]
    fn arrays_check_their_shape() {
        assert!(Array::new(vec![1f32, 2.0, 3.0], [3]).is_ok());
        assert!(matches!(
            Array::new(vec![1f32, 2.0, 3.0], [2, 2]),
            Err(DataError::InvalidParameter {
                name: "array shape",
                ..
            })
        ));
        assert!(matches!(
            Array::new(vec![1f32], Vec::<usize>::new()),
            Err(DataError::InvalidParameter { name: "array shape", ref value, .. })
                if value == "[]"
        ));
        let a = Array::from(vec![3i64, 4]);
        assert_eq!(a.shape(), [2]);
    }

    #[test]
    fn rows_keep_shapes_and_kinds() {
        let set = TensorDataset::new(
            Array::new((0..12).map(|v| v as f32).collect::<Vec<_>>(), [3, 2, 2]).unwrap(),
            Array::new(vec![7i64, 8, 9, 10, 11, 12], [3, 2]).unwrap(),
        )
        .unwrap();
        let layout = set.layout();
        assert_eq!((layout.shape, layout.target_shape), (vec![2, 2], vec![2]));
        assert_eq!(
            (layout.input_kind, layout.target_kind),
            (ValueKind::F32, ValueKind::I64)
        );
        let config = LoaderConfig {
            workers: 2,
            ..LoaderConfig::new(2)
        };
        let mut batches = HostLoader::new(set, vec![2, 0, 1], &config).unwrap();
        let first = batches.next().unwrap().unwrap();
        assert_eq!(
            first.input_f32().unwrap(),
            [8.0, 9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 3.0]
        );
        assert_eq!(first.targets_i64().unwrap(), [11, 12, 7, 8]);
        assert_eq!(first.lengths(), None);
        let last = batches.next().unwrap().unwrap();
        assert_eq!(last.targets_i64().unwrap(), [9, 10]);
    }

    #[test]
    fn mismatched_counts_and_byte_targets_are_refused() {
        let inputs = Array::from(vec![1f32, 2.0]);
        assert!(matches!(
            TensorDataset::new(inputs.clone(), Array::from(vec![1i64])),
            Err(DataError::InvalidParameter { name: "targets", ref value, .. })
                if value == "1 rows"
        ));
        assert!(matches!(
            TensorDataset::new(inputs, Array::from(vec![1u8, 2])),
            Err(DataError::InvalidParameter { name: "targets", ref value, .. })
                if value.starts_with("bytes")
        ));
    }

    #[test]
    fn sequences_pad_to_the_longest_of_each_batch_or_a_fixed_length() {
        let pad = Padding {
            value: -1.0,
            to: PadTo::Longest,
        };
        let set = TensorDataset::sequences(
            vec![vec![1i64, 2, 3, 4], vec![5], vec![6, 7]],
            Array::from(vec![0i64, 1, 2]),
            pad,
        )
        .unwrap();
        assert_eq!(set.layout().shape, [4]);
        assert_eq!(length_of(&set, 2), 2);
        let config = LoaderConfig::new(2);
        let batch = HostLoader::new(set.clone(), vec![1, 2], &config)
            .unwrap()
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(batch.lengths(), Some(&[1, 2][..]));
        assert_eq!(batch.padded_len(), 2);
        assert_eq!(batch.input_i64().unwrap(), [5, -1, -1, -1, 6, 7, -1, -1]);

        let fixed = TensorDataset::sequences(
            vec![vec![1f32, 2.0], vec![3.0]],
            Array::from(vec![0.5f32, 1.5]),
            Padding {
                value: 0.0,
                to: PadTo::Fixed,
            },
        )
        .unwrap()
        .max_len(3)
        .unwrap();
        let batch = HostLoader::new(fixed.clone(), vec![1], &config)
            .unwrap()
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(batch.padded_len(), 3);
        assert_eq!(batch.input_f32().unwrap(), [3.0, 0.0, 0.0]);
        assert!(matches!(
            fixed.max_len(1),
            Err(DataError::SampleShape { found: 2, .. })
        ));
    }

    #[test]
    fn sequences_of_mixed_kinds_are_refused() {
        let err = TensorDataset::sequences(
            vec![Values::I64(vec![1]), Values::F32(vec![1.0])],
            Array::from(vec![0i64, 1]),
            Padding {
                value: 0.0,
                to: PadTo::Longest,
            },
        )
        .unwrap_err();
        assert!(matches!(err, DataError::SampleKind { ref sample, .. } if sample == "sequence 1"));
    }

    #[test]
    fn bytes_go_through_the_affine_map_into_f32_batches() {
        let set = TensorDataset::new(
            Array::new(vec![0u8, 255, 10, 20], [2, 2]).unwrap(),
            Array::from(vec![0i64, 1]),
        )
        .unwrap()
        .with_affine(Affine {
            scale: vec![0.5, 2.0],
            bias: vec![0.0, 1.0],
        })
        .unwrap();
        let batch = HostLoader::new(set, vec![0, 1], &LoaderConfig::new(2))
            .unwrap()
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(batch.input_f32().unwrap(), [0.0, 511.0, 5.0, 41.0]);
    }

    #[test]
    fn one_scale_serves_every_channel_and_other_counts_are_refused() {
        let bytes = || {
            TensorDataset::new(
                Array::new(vec![0u8, 255, 10, 20], [2, 2]).unwrap(),
                Array::from(vec![0i64, 1]),
            )
            .unwrap()
        };
        let set = bytes()
            .with_affine(Affine {
                scale: vec![2.0],
                bias: vec![1.0],
            })
            .unwrap();
        let batch = HostLoader::new(set, vec![1], &LoaderConfig::new(1))
            .unwrap()
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(batch.input_f32().unwrap(), [21.0, 41.0]);
        for (scale, bias, value) in [
            (vec![1.0; 3], vec![0.0; 3], "3 scales and 3 biases"),
            (vec![1.0, 1.0], vec![0.0], "2 scales and 1 biases"),
        ] {
            let err = bytes().with_affine(Affine { scale, bias }).unwrap_err();
            assert!(
                matches!(&err, DataError::InvalidParameter { name: "byte affine map", value: v, .. }
                    if v == value),
                "{err:?}"
            );
        }
        let floats = TensorDataset::new(
            Array::new(vec![0.5f32, 1.5], [2, 1]).unwrap(),
            Array::from(vec![0i64, 1]),
        )
        .unwrap();
        let err = floats
            .with_affine(Affine {
                scale: vec![1.0],
                bias: vec![0.0],
            })
            .unwrap_err();
        assert!(
            matches!(&err, DataError::InvalidParameter { value, .. } if value == "F32 inputs"),
            "{err:?}"
        );
    }
}
