//! What the loader asks of a data set: how big one sample is, and a way to write sample `i`
//! straight into its place in a batch; and [`Subset`], a data set's samples at chosen indices.
//!
//! A [`Dataset`] never allocates a sample of its own: the loader hands each call a
//! [`SampleOut`], the sample's slice of a reusable batch buffer, so a finished batch is
//! already laid out as the tensor the training step reads.

use crate::error::DataError;
use crate::rng::SampleRng;
use crate::sample::{SampleLayout, SampleOut};

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
    ///
    /// `out`'s input and targets start zeroed, even in a reused batch buffer, so `write` may
    /// set only some values (one-hot targets, counts summed with `+=`). An error that does
    /// not say which sample it is about ([`DataError::other`], or a kind mismatch from
    /// [`Input::f32`](crate::Input::f32) and the like) reaches the consumer as
    /// [`DataError::Sample`], naming the sample with [`Dataset::describe`].
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
/// use ddp_data::{Dataset, Subset};
/// use ddp_data::{SampleLayout, SampleOut};
/// use ddp_data::DataError;
/// use ddp_data::rng::SampleRng;
///
/// /// Sample i is the single value i.
/// struct Count(usize);
/// impl Dataset for Count {
///     type Worker = ();
///     fn len(&self) -> usize { self.0 }
///     fn layout(&self) -> SampleLayout {
///         SampleLayout::new([1], [])
///     }
///     fn worker(&self) {}
///     fn write(&self, _: &mut (), i: usize, _: &mut SampleRng, out: SampleOut<'_>)
///         -> Result<(), DataError> {
///         out.input.f32()?[0] = i as f32;
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
