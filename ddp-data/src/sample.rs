//! What the loader asks of a data set: how big one sample is, and a way to write sample `i`
//! straight into its place in a batch.
//!
//! A [`Dataset`] never allocates a sample of its own: the loader hands each call a
//! [`SampleOut`], the sample's slice of a reusable batch buffer, so a finished batch is
//! already laid out as the tensor the training step reads.

use crate::error::DataError;
use crate::rng::SampleRng;

/// The element type of a batch's input buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Storage {
    /// One byte per value: image pixels as decoded. A quarter of the bytes of `F32` to move,
    /// converted to floats (and normalised) where the batch is used, e.g. on the GPU.
    U8,
    /// `f32` values, final.
    F32,
}

impl Storage {
    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::F32 => 4,
        }
    }
}

/// How the bytes of a [`Storage::U8`] sample become its `f32` values: per channel (the first
/// axis of the sample's shape), `value = byte as f32 * scale[c] + bias[c]`, a multiplication
/// and then an addition, each rounded to `f32` (no fused multiply-add), so the result is the
/// same bit for bit wherever it is computed.
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

    /// Converts `bytes` (one sample, channel-major) to floats into `out`.
    pub fn apply(&self, bytes: &[u8], out: &mut [f32]) {
        let channels = self.scale.len().max(1);
        let plane = bytes.len() / channels;
        for (c, (src, dst)) in bytes
            .chunks(plane.max(1))
            .zip(out.chunks_mut(plane.max(1)))
            .enumerate()
        {
            let (s, b) = (self.scale[c], self.bias[c]);
            for (o, &v) in dst.iter_mut().zip(src) {
                *o = f32::from(v) * s + b;
            }
        }
    }
}

/// The shape of one sample and what the data set can write.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleLayout {
    /// The input's shape, e.g. `[3, 224, 224]` (channels first).
    pub shape: Vec<usize>,
    /// `f32` targets per sample (e.g. 8 multi-hot labels).
    pub targets: usize,
    /// `Some` when the data set can write its input as bytes ([`Storage::U8`]) that this
    /// affine map turns into the `f32` values it would otherwise write; `None` when it writes
    /// `f32` only.
    pub bytes: Option<Affine>,
}

impl SampleLayout {
    /// Values in one sample's input (the product of `shape`).
    pub fn input_len(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One sample's place in a batch buffer: its input, in the storage the loader chose, and its
/// targets.
#[derive(Debug)]
pub struct SampleOut<'a> {
    /// The input values, `SampleLayout::input_len` of them.
    pub input: Input<'a>,
    /// The targets, `SampleLayout::targets` of them.
    pub targets: &'a mut [f32],
}

/// A sample's input buffer.
#[derive(Debug)]
pub enum Input<'a> {
    /// Write bytes (asked only of data sets whose layout has [`SampleLayout::bytes`]).
    U8(&'a mut [u8]),
    /// Write final `f32` values.
    F32(&'a mut [f32]),
}

/// A data set the loader can read in parallel.
///
/// `write` is called from several worker threads at once, each with its own
/// [`Dataset::Worker`] state (decoders, scratch buffers), and must be a pure function of
/// `index` and the draws from `rng`: that is what makes batches independent of the number
/// of workers and of their timing.
pub trait Dataset: Send + Sync + 'static {
    /// Per-thread state, made once per worker thread by [`Dataset::worker`].
    type Worker: Send + 'static;

    /// Number of samples; the loader reads indices below it.
    fn len(&self) -> usize;

    /// Whether the data set has no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape every sample has.
    fn layout(&self) -> SampleLayout;

    /// Fresh per-thread state.
    fn worker(&self) -> Self::Worker;

    /// Writes sample `index` into `out`, taking its random draws from `rng` (seeded from
    /// the loader's seed, the epoch and `index`).
    fn write(
        &self,
        worker: &mut Self::Worker,
        index: usize,
        rng: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError>;

    /// A name for sample `index` in error messages (a file path, say).
    fn describe(&self, index: usize) -> String {
        format!("sample {index}")
    }
}

/// The samples of a data set at chosen indices, in their order: sample `i` of the subset is
/// sample `indices[i]` of the data set (torch's `torch.utils.data.Subset`).
///
/// Indices may repeat and come in any order. The layout, the worker state and the names in
/// error messages are the data set's own. The loader keys a sample's random draws by the
/// index it asks for, here the position in the subset: the same underlying sample gets other
/// crops at another position, as it would in a different index list.
///
/// ```
/// use ddp_data::sample::{Dataset, Input, SampleLayout, SampleOut, Subset};
/// use ddp_data::{rng::SampleRng, DataError};
///
/// /// Sample i is the single value i.
/// struct Count(usize);
/// impl Dataset for Count {
///     type Worker = ();
///     fn len(&self) -> usize { self.0 }
///     fn layout(&self) -> SampleLayout {
///         SampleLayout { shape: vec![1], targets: 0, bytes: None }
///     }
///     fn worker(&self) {}
///     fn write(&self, _: &mut (), i: usize, _: &mut SampleRng, out: SampleOut<'_>)
///         -> Result<(), DataError> {
///         let Input::F32(x) = out.input else { unreachable!("f32 storage") };
///         x[0] = i as f32;
///         Ok(())
///     }
/// }
///
/// let odd = Subset::new(Count(10), vec![1, 3, 5, 7, 9])?;
/// assert_eq!(odd.len(), 5);
/// assert!(matches!(
///     Subset::new(Count(10), vec![2, 10]),
///     Err(DataError::IndexOutOfRange { index: 10, len: 10 })
/// ));
/// # Ok::<(), DataError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Subset<D> {
    dataset: D,
    indices: Vec<usize>,
}

impl<D: Dataset> Subset<D> {
    /// The samples `indices` of `dataset`, in that order.
    ///
    /// Fails with [`DataError::IndexOutOfRange`] naming the first index that is not below
    /// `dataset.len()`, and that length.
    pub fn new(dataset: D, indices: Vec<usize>) -> Result<Self, DataError> {
        let len = dataset.len();
        if let Some(&index) = indices.iter().find(|&&i| i >= len) {
            return Err(DataError::IndexOutOfRange { index, len });
        }
        Ok(Self { dataset, indices })
    }

    /// The underlying data set.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// The data set's index of each sample of the subset.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// The underlying data set and the indices, taken apart.
    pub fn into_parts(self) -> (D, Vec<usize>) {
        (self.dataset, self.indices)
    }

    fn inner(&self, index: usize) -> Result<usize, DataError> {
        self.indices
            .get(index)
            .copied()
            .ok_or(DataError::IndexOutOfRange {
                index,
                len: self.indices.len(),
            })
    }
}

impl<D: Dataset> Dataset for Subset<D> {
    type Worker = D::Worker;

    fn len(&self) -> usize {
        self.indices.len()
    }

    fn layout(&self) -> SampleLayout {
        self.dataset.layout()
    }

    fn worker(&self) -> Self::Worker {
        self.dataset.worker()
    }

    fn write(
        &self,
        worker: &mut Self::Worker,
        index: usize,
        rng: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        self.dataset.write(worker, self.inner(index)?, rng, out)
    }

    fn describe(&self, index: usize) -> String {
        match self.inner(index) {
            Ok(inner) => self.dataset.describe(inner),
            Err(_) => format!("sample {index}"),
        }
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
        a.apply(&[255, 0, 3, 1], &mut out);
        assert_eq!(out, [1.0, 0.0, 5.0, 1.0]);
        assert!(a.has_bias());
        let plain = Affine {
            scale: vec![0.5; 3],
            bias: vec![0.0; 3],
        };
        assert!(!plain.has_bias());
    }
}
