//! [`MapDataset`]: a data set that returns each sample as owned values, and its [`Item`].

use crate::dataset::Dataset;
use crate::error::DataError;
use crate::rng::SampleRng;
use crate::sample::{Input, SampleLayout, SampleOut, Targets};

/// Owned values of one kind: a sample's input or targets.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// Bytes, for layouts with a byte form ([`SampleLayout::bytes`]): copied as they are
    /// into byte batches, through the layout's affine map into `f32` batches.
    U8(Vec<u8>),
    /// `f32` values.
    F32(Vec<f32>),
    /// `i64` values.
    I64(Vec<i64>),
}

impl Values {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.view().len()
    }

    /// Whether there is no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The kind's name, for messages.
    pub fn kind_name(&self) -> &'static str {
        self.view().kind_name()
    }
}

/// Borrowed values of one kind (a sample's slice of a bigger array).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValuesRef<'a> {
    /// Bytes.
    U8(&'a [u8]),
    /// `f32` values.
    F32(&'a [f32]),
    /// `i64` values.
    I64(&'a [i64]),
}

impl<'a> ValuesRef<'a> {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::F32(v) => v.len(),
            Self::I64(v) => v.len(),
        }
    }

    /// Whether there is no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `range` of these.
    pub fn slice(&self, range: std::ops::Range<usize>) -> ValuesRef<'a> {
        match *self {
            Self::U8(v) => Self::U8(&v[range]),
            Self::F32(v) => Self::F32(&v[range]),
            Self::I64(v) => Self::I64(&v[range]),
        }
    }

    /// The kind's name, for messages.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Self::U8(_) => "u8",
            Self::F32(_) => "f32",
            Self::I64(_) => "i64",
        }
    }
}

impl Values {
    /// The values, borrowed.
    pub fn view(&self) -> ValuesRef<'_> {
        match self {
            Self::U8(v) => ValuesRef::U8(v),
            Self::F32(v) => ValuesRef::F32(v),
            Self::I64(v) => ValuesRef::I64(v),
        }
    }
}

impl From<Vec<f32>> for Values {
    fn from(v: Vec<f32>) -> Self {
        Self::F32(v)
    }
}

impl From<Vec<i64>> for Values {
    fn from(v: Vec<i64>) -> Self {
        Self::I64(v)
    }
}

impl From<Vec<u8>> for Values {
    fn from(v: Vec<u8>) -> Self {
        Self::U8(v)
    }
}

impl From<f32> for Values {
    fn from(v: f32) -> Self {
        Self::F32(vec![v])
    }
}

impl From<i64> for Values {
    fn from(v: i64) -> Self {
        Self::I64(vec![v])
    }
}

impl<const N: usize> From<[f32; N]> for Values {
    fn from(v: [f32; N]) -> Self {
        Self::F32(v.to_vec())
    }
}

impl<const N: usize> From<[i64; N]> for Values {
    fn from(v: [i64; N]) -> Self {
        Self::I64(v.to_vec())
    }
}

/// One sample as owned values.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    /// The input, row-major. For a padded layout, the sample's own length times the values
    /// per position (the loader pads the rest).
    pub input: Values,
    /// The targets, row-major.
    pub target: Values,
}

impl Item {
    /// A sample of `input` and `target` (anything that converts: `Vec<f32>`, `Vec<i64>`,
    /// one `f32` or `i64`, arrays).
    pub fn new(input: impl Into<Values>, target: impl Into<Values>) -> Self {
        Self {
            input: input.into(),
            target: target.into(),
        }
    }
}

/// A data set that returns sample `index` as an [`Item`] (PyTorch's map-style data set).
/// Every `MapDataset` is a [`Dataset`] the loader reads on its worker threads.
///
/// `get` is called from several threads at once and must be a pure function of `index` and
/// the draws from `rng`, as [`Dataset::write`].
///
/// The simple way to write a data set: return each sample as owned values
/// ([`MapDataset::get`], PyTorch's map-style `__getitem__`), and the loader copies them into
/// their place in the batch.
///
/// Every [`MapDataset`] is a [`Dataset`]: the copy is checked against the layout (kind,
/// number of values, length for padded layouts), so a sample that does not fit is an error
/// naming it, never a silently truncated batch. Image data sets that decode straight into
/// the batch keep implementing [`Dataset::write`] themselves.
///
/// ```
/// use ddp_data::{DataError, HostLoader, Item, LoaderConfig, MapDataset, SampleLayout, ValueKind};
/// use ddp_data::rng::SampleRng;
///
/// /// Sample i: the point (i, 2i) and the class i % 3.
/// struct Points;
/// impl MapDataset for Points {
///     fn len(&self) -> usize { 10 }
///     fn layout(&self) -> SampleLayout {
///         SampleLayout::new([2], []).target_kind(ValueKind::I64)
///     }
///     fn get(&self, i: usize, _: &mut SampleRng) -> Result<Item, DataError> {
///         Ok(Item::new(vec![i as f32, 2.0 * i as f32], (i % 3) as i64))
///     }
/// }
///
/// let batch = HostLoader::new(Points, vec![4, 5], &LoaderConfig::new(2))?.next().unwrap()?;
/// assert_eq!(batch.input_f32(), Some(&[4.0, 8.0, 5.0, 10.0][..]));
/// assert_eq!(batch.targets_i64(), Some(&[1, 2][..]));
/// # Ok::<(), DataError>(())
/// ```
pub trait MapDataset: Send + Sync + 'static {
    /// Number of samples.
    fn len(&self) -> usize;

    /// Whether the data set has no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape and kinds every sample has: asked when a loader is made and once by each
    /// of its workers, and the same each time.
    fn layout(&self) -> SampleLayout;

    /// Sample `index`, taking its random draws from `rng`.
    fn get(&self, index: usize, rng: &mut SampleRng) -> Result<Item, DataError>;

    /// A name for sample `index` in error messages.
    fn describe(&self, index: usize) -> String {
        format!("sample {index}")
    }
}

impl<M: MapDataset> Dataset for M {
    /// The layout, asked of the data set once per worker rather than once per sample.
    type Worker = SampleLayout;

    fn len(&self) -> usize {
        MapDataset::len(self)
    }

    fn layout(&self) -> SampleLayout {
        MapDataset::layout(self)
    }

    fn worker(&self) -> SampleLayout {
        MapDataset::layout(self)
    }

    fn write(
        &self,
        layout: &mut SampleLayout,
        index: usize,
        rng: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        let item = self.get(index, rng)?;
        let sample = || MapDataset::describe(self, index);
        write_input(layout, item.input.view(), out.input, out.length, sample)?;
        write_targets(item.target.view(), out.targets, sample)
    }

    fn describe(&self, index: usize) -> String {
        MapDataset::describe(self, index)
    }
}

/// Checks that `len` input values fit `layout` and returns the sample's length along the
/// first axis: exactly `input_len` without padding; a whole number of positions up to the
/// maximum with padding.
pub(crate) fn input_length(
    layout: &SampleLayout,
    len: usize,
    sample: impl Fn() -> String,
) -> Result<usize, DataError> {
    let mismatch = |expected: String| DataError::SampleShape {
        sample: sample(),
        what: "input",
        expected,
        found: len,
    };
    if layout.padding.is_none() {
        if len != layout.input_len() {
            return Err(mismatch(format!(
                "{} values {:?}",
                layout.input_len(),
                layout.shape
            )));
        }
        return Ok(layout.max_len());
    }
    let step = layout.step_len();
    if step == 0 || !len.is_multiple_of(step) || len / step > layout.max_len() {
        return Err(mismatch(format!(
            "a multiple of {step} values, at most {} positions of {:?}",
            layout.max_len(),
            &layout.shape[1..]
        )));
    }
    Ok(len / step)
}

/// Copies `values` into a sample's input buffer (checked against the layout) and sets its
/// length.
pub(crate) fn write_input(
    layout: &SampleLayout,
    values: ValuesRef<'_>,
    input: Input<'_>,
    length: &mut usize,
    sample: impl Fn() -> String,
) -> Result<(), DataError> {
    let n = values.len();
    *length = input_length(layout, n, &sample)?;
    match (values, input) {
        (ValuesRef::F32(v), Input::F32(out)) => out[..n].copy_from_slice(v),
        (ValuesRef::I64(v), Input::I64(out)) => out[..n].copy_from_slice(v),
        (ValuesRef::U8(v), Input::U8(out)) => out[..n].copy_from_slice(v),
        (ValuesRef::U8(v), Input::F32(out)) => match &layout.bytes {
            Some(affine) => affine.apply(v, layout.step_len(), &mut out[..n]),
            None => return Err(kind_error(sample(), "input", "f32", "u8")),
        },
        (v, out) => {
            let wanted = match out {
                Input::U8(_) => "u8",
                Input::F32(_) => "f32",
                Input::I64(_) => "i64",
            };
            return Err(kind_error(sample(), "input", wanted, v.kind_name()));
        }
    }
    Ok(())
}

/// Copies `values` into a sample's target buffer, checking kind and count.
pub(crate) fn write_targets(
    values: ValuesRef<'_>,
    targets: Targets<'_>,
    sample: impl Fn() -> String,
) -> Result<(), DataError> {
    let (expected, wanted) = match &targets {
        Targets::F32(t) => (t.len(), "f32"),
        Targets::I64(t) => (t.len(), "i64"),
    };
    if values.len() != expected {
        return Err(DataError::SampleShape {
            sample: sample(),
            what: "targets",
            expected: format!("{expected} values"),
            found: values.len(),
        });
    }
    match (values, targets) {
        (ValuesRef::F32(v), Targets::F32(t)) => t.copy_from_slice(v),
        (ValuesRef::I64(v), Targets::I64(t)) => t.copy_from_slice(v),
        (v, _) => return Err(kind_error(sample(), "targets", wanted, v.kind_name())),
    }
    Ok(())
}

fn kind_error(sample: String, what: &'static str, wanted: &str, found: &str) -> DataError {
    DataError::SampleKind {
        sample,
        what,
        expected: wanted.to_string(),
        found: found.to_string(),
    }
}
