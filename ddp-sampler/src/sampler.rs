//! The sampler itself: its builder, its validation and the iterator over one rank's epoch.

use std::iter::FusedIterator;

use crate::batch::Batches;
use crate::error::SamplerError;
use crate::permutation::{fits_u32, shuffled};
use crate::shard::{Layout, Partition, Rule, Shard};

/// Which dataset indices one rank reads in each epoch: PyTorch's `DistributedSampler`, with a
/// specified random source, exact evaluation shards and mid-epoch resume.
///
/// Build one per rank with [`DistributedSampler::builder`] (or [`DistributedSampler::new`]
/// for PyTorch's defaults), call [`set_epoch`](Self::set_epoch) at the start of every epoch,
/// then read [`indices`](Self::indices), [`iter`](Self::iter) or
/// [`batches`](Self::batches). The crate documentation specifies the order exactly.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DistributedSampler {
    layout: Layout,
    rank: usize,
    shuffle: bool,
    seed: u64,
    epoch: u64,
}

/// Sets up a [`DistributedSampler`]; made by [`DistributedSampler::builder`].
///
/// Defaults are PyTorch's: `shuffle(true)`, `seed(0)`, `drop_last(false)`,
/// `partition(Partition::Padded)`. Nothing is checked until [`build`](Self::build).
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct SamplerBuilder {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    partition: Partition,
    allow_empty: bool,
}

impl SamplerBuilder {
    /// Whether a rank may get no samples of a non-empty dataset under [`Partition::Exact`]
    /// (default `false`): an evaluation of fewer samples than replicas, where the ranks
    /// without samples still take part in combining the results. The padded partitions
    /// refuse empty shards whatever this says.
    pub fn allow_empty_shards(mut self, allow: bool) -> Self {
        self.allow_empty = allow;
        self
    }

    /// Whether each epoch's order is a seeded random permutation (`true`, the default) or
    /// `0..dataset_len`.
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The seed of the permutation (default 0). Every rank of a job must use the same seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// With [`Partition::Padded`]: cut the order to `floor(N / R) * R` instead of padding it to
    /// `ceil(N / R) * R` (default `false`). Cannot be combined with [`Partition::Exact`].
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// How the order is cut into shards (default [`Partition::Padded`]).
    pub fn partition(mut self, partition: Partition) -> Self {
        self.partition = partition;
        self
    }

    /// Checks the configuration and makes the sampler, at epoch 0.
    ///
    /// # Errors
    ///
    /// [`SamplerError::ZeroReplicas`], [`SamplerError::RankOutOfRange`],
    /// [`SamplerError::DropLastWithExact`], and [`SamplerError::EmptyShard`] when some rank
    /// would get no samples: an empty dataset, or fewer samples than replicas with `drop_last`
    /// or [`Partition::Exact`] (unless [`SamplerBuilder::allow_empty_shards`]).
    pub fn build(self) -> Result<DistributedSampler, SamplerError> {
        let num_replicas = self.num_replicas;
        if num_replicas == 0 {
            return Err(SamplerError::ZeroReplicas);
        }
        if self.rank >= num_replicas {
            return Err(SamplerError::RankOutOfRange {
                rank: self.rank,
                num_replicas,
            });
        }
        let rule = match (self.partition, self.drop_last) {
            (Partition::Padded, false) => Rule::Pad,
            (Partition::Padded, true) => Rule::Drop,
            (Partition::Exact, false) => Rule::Exact,
            (Partition::Exact, true) => return Err(SamplerError::DropLastWithExact),
        };
        let layout = Layout::epoch(self.dataset_len, num_replicas, rule);
        // The last rank has the shortest shard under every rule.
        let allowed = self.allow_empty && self.dataset_len > 0 && rule == Rule::Exact;
        if layout.len_of_rank(num_replicas - 1) == 0 && !allowed {
            return Err(SamplerError::EmptyShard {
                dataset_len: self.dataset_len,
                num_replicas,
                partition: rule.describe(),
                min_dataset_len: if rule == Rule::Pad || (self.allow_empty && rule == Rule::Exact) {
                    1
                } else {
                    num_replicas
                },
            });
        }
        Ok(DistributedSampler {
            layout,
            rank: self.rank,
            shuffle: self.shuffle,
            seed: self.seed,
            epoch: 0,
        })
    }
}

impl DistributedSampler {
    /// A builder for rank `rank` of `num_replicas`, over a dataset of `dataset_len` samples.
    pub fn builder(dataset_len: usize, num_replicas: usize, rank: usize) -> SamplerBuilder {
        SamplerBuilder {
            dataset_len,
            num_replicas,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            partition: Partition::Padded,
            allow_empty: false,
        }
    }

    /// A sampler with PyTorch's defaults: shuffled with seed 0, padded, no `drop_last`.
    ///
    /// # Errors
    ///
    /// As [`SamplerBuilder::build`].
    pub fn new(
        dataset_len: usize,
        num_replicas: usize,
        rank: usize,
    ) -> Result<DistributedSampler, SamplerError> {
        Self::builder(dataset_len, num_replicas, rank).build()
    }

    /// Selects the epoch whose order the sampler yields; call it at the start of every epoch,
    /// with the same value on every rank. Without it every epoch repeats epoch 0's order.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch (0 until [`set_epoch`](Self::set_epoch) is called).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How many samples this rank yields per epoch.
    pub fn len(&self) -> usize {
        self.layout.len_of_rank(self.rank)
    }

    /// Whether this rank yields no samples: only possible under
    /// [`SamplerBuilder::allow_empty_shards`], since [`SamplerBuilder::build`] otherwise
    /// refuses configurations that leave a rank without samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many samples rank `rank` yields per epoch, or `None` when `rank` is not below
    /// [`num_replicas`](Self::num_replicas). With [`Partition::Padded`] every rank has the same
    /// count; with [`Partition::Exact`] the counts differ by at most one and ranks below
    /// `dataset_len % num_replicas` have the extra sample. Lets every rank know every other
    /// rank's count without communication.
    pub fn len_of_rank(&self, rank: usize) -> Option<usize> {
        (rank < self.layout.num_replicas).then(|| self.layout.len_of_rank(rank))
    }

    /// The number of ranks the dataset is shared among.
    pub fn num_replicas(&self) -> usize {
        self.layout.num_replicas
    }

    /// This sampler's rank, below [`num_replicas`](Self::num_replicas).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of samples in the whole dataset.
    pub fn dataset_len(&self) -> usize {
        self.layout.dataset_len
    }

    /// Whether each epoch's order is shuffled.
    pub fn shuffle(&self) -> bool {
        self.shuffle
    }

    /// The seed of the permutation.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether the order is cut (rather than padded) to a multiple of the replica count.
    pub fn drop_last(&self) -> bool {
        self.layout.rule == Rule::Drop
    }

    /// How the order is cut into shards.
    pub fn partition(&self) -> Partition {
        match self.layout.rule {
            Rule::Pad | Rule::Drop => Partition::Padded,
            Rule::Exact => Partition::Exact,
        }
    }

    /// This rank's indices for the current epoch, in the order it should read them.
    ///
    /// A shuffled epoch costs one permutation of `0..dataset_len` (4 bytes per index while
    /// `dataset_len` fits in `u32`, else 8 bytes, reused in place) that is freed on return.
    pub fn indices(&self) -> Vec<usize> {
        self.indices_of(self.shard())
    }

    /// The indices of `shard` (of this sampler's dataset) in the current epoch's order.
    pub(crate) fn indices_of(&self, shard: Shard) -> Vec<usize> {
        if !self.shuffle || shard.len == 0 {
            return shard.sequential();
        }
        let n = self.layout.dataset_len;
        if fits_u32(n) {
            shard.gather(shuffled::<u32>(n, self.seed, self.epoch))
        } else {
            shard.gather(shuffled::<usize>(n, self.seed, self.epoch))
        }
    }

    /// This rank's indices for the current epoch, as an iterator. Without shuffling it
    /// computes each index as it goes; with shuffling it holds this rank's share of the
    /// permutation.
    pub fn iter(&self) -> Iter {
        let inner = if self.shuffle {
            IterInner::Shuffled(self.indices().into_iter())
        } else {
            IterInner::Sequential {
                shard: self.shard(),
                next: 0,
            }
        };
        Iter { inner }
    }

    /// Mid-epoch resume: this rank's indices for the current epoch from its `start`-th sample
    /// on, i.e. [`iter`](Self::iter) without its first `start` items. A run restored from a
    /// checkpoint taken after each rank had read `start` samples of this epoch continues with
    /// exactly the samples it had not yet read. `start == len()` gives an empty iterator.
    ///
    /// # Errors
    ///
    /// [`SamplerError::ResumePastEnd`] when `start > len()`.
    pub fn iter_from(&self, start: usize) -> Result<Iter, SamplerError> {
        let len = self.len();
        if start > len {
            return Err(SamplerError::ResumePastEnd { start, len });
        }
        let mut iter = self.iter();
        if let Some(skip) = start.checked_sub(1) {
            iter.nth(skip);
        }
        Ok(iter)
    }

    /// This rank's indices for the current epoch in batches of `batch_size`; every rank of
    /// the job yields the same number of batches, so per-batch collectives stay in step. See
    /// [`Batches`] for the batch count and the short or empty last batches of
    /// [`Partition::Exact`].
    ///
    /// # Errors
    ///
    /// [`SamplerError::ZeroBatchSize`], and [`SamplerError::BatchLargerThanShard`] when
    /// `drop_last` would leave no batches at all.
    pub fn batches(&self, batch_size: usize, drop_last: bool) -> Result<Batches, SamplerError> {
        let replicas = self.layout.num_replicas;
        let largest = self.layout.len_of_rank(0);
        let smallest = self.layout.len_of_rank(replicas - 1);
        Batches::new(self.indices(), batch_size, drop_last, largest, smallest)
    }

    fn shard(&self) -> Shard {
        self.layout.shard(self.rank)
    }

    /// The layout of a whole epoch.
    pub(crate) fn layout(&self) -> Layout {
        self.layout
    }
}

impl IntoIterator for &DistributedSampler {
    type Item = usize;
    type IntoIter = Iter;

    fn into_iter(self) -> Iter {
        self.iter()
    }
}

/// This rank's indices for one epoch; made by [`DistributedSampler::iter`] and
/// [`DistributedSampler::iter_from`]. Owns what it needs, so it outlives the sampler.
#[derive(Debug, Clone)]
pub struct Iter {
    inner: IterInner,
}

#[derive(Debug, Clone)]
enum IterInner {
    Sequential { shard: Shard, next: usize },
    Shuffled(std::vec::IntoIter<usize>),
}

impl Iterator for Iter {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        match &mut self.inner {
            IterInner::Sequential { shard, next } => {
                let k = *next;
                (k < shard.len).then(|| {
                    *next += 1;
                    shard.position(k)
                })
            }
            IterInner::Shuffled(rest) => rest.next(),
        }
    }

    /// Skips in constant time, so resuming deep into an epoch costs nothing extra.
    fn nth(&mut self, n: usize) -> Option<usize> {
        match &mut self.inner {
            IterInner::Sequential { shard, next } => {
                *next = next.saturating_add(n).min(shard.len);
                self.next()
            }
            IterInner::Shuffled(rest) => rest.nth(n),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let remaining = match &self.inner {
            IterInner::Sequential { shard, next } => shard.len - next,
            IterInner::Shuffled(rest) => rest.len(),
        };
        (remaining, Some(remaining))
    }
}

impl ExactSizeIterator for Iter {}

impl FusedIterator for Iter {}

#[cfg(test)]
mod tests {
    use super::*;

    fn exact(dataset_len: usize, num_replicas: usize, rank: usize) -> DistributedSampler {
        DistributedSampler::builder(dataset_len, num_replicas, rank)
            .seed(9)
            .partition(Partition::Exact)
            .build()
            .expect("valid exact sampler")
    }

    #[test]
    fn new_has_pytorch_defaults() {
        let s = DistributedSampler::new(10, 4, 1).expect("valid sampler");
        assert_eq!(
            (
                s.dataset_len(),
                s.num_replicas(),
                s.rank(),
                s.len(),
                s.epoch()
            ),
            (10, 4, 1, 3, 0)
        );
        assert_eq!((s.shuffle(), s.seed(), s.drop_last()), (true, 0, false));
        assert_eq!(s.partition(), Partition::Padded);
        assert!(!s.is_empty());
    }

    #[test]
    fn builder_options_are_kept() {
        let s = DistributedSampler::builder(10, 4, 2)
            .shuffle(false)
            .seed(7)
            .drop_last(true)
            .build()
            .expect("valid sampler");
        assert_eq!(
            (s.shuffle(), s.seed(), s.drop_last(), s.len()),
            (false, 7, true, 2)
        );
        assert_eq!(s.indices(), [2, 6]);
    }

    #[test]
    fn invalid_configurations_name_their_values() {
        let err = |b: SamplerBuilder| b.build().unwrap_err().to_string();
        assert_eq!(
            err(DistributedSampler::builder(10, 0, 0)),
            "num_replicas must be at least 1, got 0"
        );
        assert_eq!(
            err(DistributedSampler::builder(10, 4, 7)),
            "rank 7 is out of range for 4 replicas (expected 0..4)"
        );
        assert_eq!(
            err(DistributedSampler::builder(0, 2, 0)),
            "dataset_len 0 leaves some of the 2 replicas without samples under \
             Partition::Padded, which needs dataset_len >= 1"
        );
        assert_eq!(
            err(DistributedSampler::builder(3, 4, 0).drop_last(true)),
            "dataset_len 3 leaves some of the 4 replicas without samples under \
             Partition::Padded with drop_last, which needs dataset_len >= 4"
        );
        assert_eq!(
            err(DistributedSampler::builder(3, 4, 0).partition(Partition::Exact)),
            "dataset_len 3 leaves some of the 4 replicas without samples under \
             Partition::Exact, which needs dataset_len >= 4"
        );
        assert_eq!(
            DistributedSampler::builder(10, 2, 0)
                .partition(Partition::Exact)
                .drop_last(true)
                .build(),
            Err(SamplerError::DropLastWithExact)
        );
    }

    #[test]
    fn exact_shards_may_be_empty_when_allowed() {
        let shard = |rank| {
            DistributedSampler::builder(3, 5, rank)
                .shuffle(false)
                .partition(Partition::Exact)
                .allow_empty_shards(true)
                .build()
                .map(|s| s.indices())
        };
        let shards: Vec<_> = (0..5).map(shard).collect();
        assert_eq!(
            shards,
            [
                Ok(vec![0]),
                Ok(vec![1]),
                Ok(vec![2]),
                Ok(vec![]),
                Ok(vec![])
            ]
        );
        assert!(shard(3).unwrap().is_empty() && !shard(2).unwrap().is_empty());
        // An empty dataset is still refused, and one sample is enough.
        assert_eq!(
            DistributedSampler::builder(0, 2, 0)
                .partition(Partition::Exact)
                .allow_empty_shards(true)
                .build()
                .unwrap_err()
                .to_string(),
            "dataset_len 0 leaves some of the 2 replicas without samples under \
             Partition::Exact, which needs dataset_len >= 1"
        );
        // The padded partitions ignore it: drop_last with fewer samples than replicas
        // still leaves every rank without a sample.
        assert!(matches!(
            DistributedSampler::builder(3, 4, 0)
                .drop_last(true)
                .allow_empty_shards(true)
                .build(),
            Err(SamplerError::EmptyShard {
                min_dataset_len: 4,
                ..
            })
        ));
    }

    #[test]
    fn padding_to_fewer_samples_than_replicas_is_allowed() {
        let s = DistributedSampler::builder(3, 4, 3).shuffle(false).build();
        assert_eq!(s.map(|s| s.indices()), Ok(vec![0]));
    }

    #[test]
    fn exact_shards_of_a_shuffled_order() {
        // permutation(7, 9, 2) = [0, 2, 3, 1, 4, 5, 6]
        let shards: Vec<Vec<usize>> = (0..3)
            .map(|rank| {
                let mut s = exact(7, 3, rank);
                s.set_epoch(2);
                s.indices()
            })
            .collect();
        assert_eq!(shards, [vec![0, 1, 6], vec![2, 4], vec![3, 5]]);
        let s = exact(7, 3, 0);
        let lens: Vec<Option<usize>> = (0..4).map(|r| s.len_of_rank(r)).collect();
        assert_eq!(lens, [Some(3), Some(2), Some(2), None]);
    }

    #[test]
    fn set_epoch_selects_that_epochs_permutation() {
        let mut s = DistributedSampler::builder(7, 3, 2)
            .seed(9)
            .build()
            .expect("valid");
        s.set_epoch(2);
        assert_eq!(s.epoch(), 2);
        // Padded: positions 2, 5, 8 % 7 = 1 of [0, 2, 3, 1, 4, 5, 6].
        assert_eq!(s.indices(), [3, 5, 2]);
    }

    #[test]
    fn iter_matches_indices_in_both_modes() {
        for shuffle in [false, true] {
            let mut s = DistributedSampler::builder(23, 5, 4)
                .shuffle(shuffle)
                .build()
                .expect("valid");
            s.set_epoch(4);
            let iter = s.iter();
            assert_eq!(iter.len(), 5);
            assert_eq!(iter.collect::<Vec<_>>(), s.indices(), "shuffle {shuffle}");
            assert_eq!((&s).into_iter().count(), 5);
        }
    }

    #[test]
    fn iter_from_resumes_at_the_given_sample() {
        let s = DistributedSampler::builder(10, 4, 3)
            .shuffle(false)
            .build()
            .expect("valid");
        assert_eq!(
            s.iter_from(0).map(Iterator::collect::<Vec<_>>),
            Ok(vec![3, 7, 1])
        );
        assert_eq!(s.iter_from(2).map(Iterator::collect::<Vec<_>>), Ok(vec![1]));
        assert_eq!(s.iter_from(3).map(|it| it.len()), Ok(0));
        let err = s.iter_from(4).unwrap_err();
        assert_eq!(err, SamplerError::ResumePastEnd { start: 4, len: 3 });
        assert_eq!(
            err.to_string(),
            "cannot resume at sample 4: this rank has only 3 samples per epoch"
        );
        let shuffled = exact(7, 3, 0);
        let rest: Vec<usize> = shuffled.iter_from(1).expect("in range").collect();
        assert_eq!(rest, shuffled.indices()[1..]);
    }

    #[test]
    fn nth_past_the_end_exhausts_the_iterator() {
        let s = DistributedSampler::builder(10, 2, 0)
            .shuffle(false)
            .build()
            .expect("valid");
        let mut it = s.iter();
        assert_eq!(it.nth(9), None);
        assert_eq!(it.next(), None);
    }

    #[test]
    fn exact_batches_have_the_same_count_on_every_rank() {
        // Shards of 3, 2, 2 samples in batches of 2: two batches each, the last one short.
        let all: Vec<Vec<Vec<usize>>> = (0..3)
            .map(|rank| {
                let s = DistributedSampler::builder(7, 3, rank)
                    .shuffle(false)
                    .partition(Partition::Exact)
                    .build()
                    .expect("valid");
                s.batches(2, false).expect("valid batches").collect()
            })
            .collect();
        assert_eq!(
            all,
            [
                vec![vec![0, 3], vec![6]],
                vec![vec![1, 4], vec![]],
                vec![vec![2, 5], vec![]],
            ]
        );
    }
}
