//! Batching one rank's epoch so that every rank yields the same number of batches.

use std::iter::FusedIterator;

use crate::error::SamplerError;

/// This rank's indices for one epoch in batches; made by
/// [`DistributedSampler::batches`](crate::DistributedSampler::batches).
///
/// Every rank of a job yields the same number of batches, so a loop that runs a collective
/// per batch (a gradient all-reduce) never leaves one rank waiting for another:
///
/// - without `drop_last`: `ceil(largest shard / batch_size)` batches, each of `batch_size`
///   indices except possibly the last;
/// - with `drop_last`: `floor(smallest shard / batch_size)` batches, all full.
///
/// With [`Partition::Padded`](crate::Partition::Padded) all shards have the same length, so
/// this is plain chunking. With [`Partition::Exact`](crate::Partition::Exact) the lower ranks
/// may hold one sample more than the others. Without `drop_last` a rank with the shorter shard
/// then yields a shorter last batch, and, when its shard is a multiple of `batch_size`, an
/// **empty** last batch: it must still take part in that step's collectives (and skip its
/// forward pass or count nothing). With `drop_last` the ranks with the longer shard drop that
/// extra sample, so exact coverage is lost; an evaluation wants `drop_last = false`.
///
/// To resume after `b` finished batches, use `.skip(b)`: skipping costs constant time.
#[derive(Debug, Clone)]
pub struct Batches {
    indices: Vec<usize>,
    batch_size: usize,
    /// The next batch to yield.
    next: usize,
    /// How many batches every rank yields.
    count: usize,
}

impl Batches {
    /// Batches over `indices`, for a job whose largest and smallest shards have `largest` and
    /// `smallest` samples.
    pub(crate) fn new(
        indices: Vec<usize>,
        batch_size: usize,
        drop_last: bool,
        largest: usize,
        smallest: usize,
    ) -> Result<Self, SamplerError> {
        if batch_size == 0 {
            return Err(SamplerError::ZeroBatchSize);
        }
        let count = if drop_last {
            smallest / batch_size
        } else {
            largest.div_ceil(batch_size)
        };
        if count == 0 {
            return Err(SamplerError::BatchLargerThanShard {
                batch_size,
                shard_len: smallest,
            });
        }
        Ok(Batches {
            indices,
            batch_size,
            next: 0,
            count,
        })
    }

    /// The number of indices in a full batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// How many batches every rank yields per epoch (those already yielded included).
    pub fn num_batches(&self) -> usize {
        self.count
    }
}

impl Iterator for Batches {
    type Item = Vec<usize>;

    fn next(&mut self) -> Option<Vec<usize>> {
        if self.next >= self.count {
            return None;
        }
        let len = self.indices.len();
        let start = (self.next * self.batch_size).min(len);
        let end = (start + self.batch_size).min(len);
        self.next += 1;
        Some(self.indices[start..end].to_vec())
    }

    /// Skips in constant time, so `.skip(b)` resumes after `b` batches at no cost.
    fn nth(&mut self, n: usize) -> Option<Vec<usize>> {
        self.next = self.next.saturating_add(n).min(self.count);
        self.next()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let remaining = self.count - self.next;
        (remaining, Some(remaining))
    }
}

impl ExactSizeIterator for Batches {}

impl FusedIterator for Batches {}

#[cfg(test)]
mod tests {
    use super::*;

    fn batches(
        len: usize,
        size: usize,
        drop_last: bool,
        largest: usize,
        smallest: usize,
    ) -> Vec<Vec<usize>> {
        let indices = (100..100 + len).collect();
        Batches::new(indices, size, drop_last, largest, smallest)
            .expect("valid batches")
            .collect()
    }

    #[test]
    fn equal_shards_chunk_with_a_short_last_batch() {
        let got = batches(5, 2, false, 5, 5);
        assert_eq!(got, vec![vec![100, 101], vec![102, 103], vec![104]]);
    }

    #[test]
    fn drop_last_keeps_only_full_batches() {
        assert_eq!(
            batches(5, 2, true, 5, 5),
            vec![vec![100, 101], vec![102, 103]]
        );
    }

    #[test]
    fn shorter_exact_shard_pads_the_count_with_an_empty_batch() {
        // Shards of 5 and 4 samples, batches of 2: three batches on every rank.
        assert_eq!(
            batches(4, 2, false, 5, 4),
            vec![vec![100, 101], vec![102, 103], vec![]]
        );
    }

    #[test]
    fn longer_exact_shard_drops_its_extra_batch_under_drop_last() {
        // Shards of 5 and 4 samples, batches of 1, drop_last: four batches on every rank.
        assert_eq!(
            batches(5, 1, true, 5, 4),
            vec![vec![100], vec![101], vec![102], vec![103]]
        );
    }

    #[test]
    fn skip_resumes_after_finished_batches() {
        let indices = (0..7).collect();
        let mut rest = Batches::new(indices, 3, false, 7, 7)
            .expect("valid batches")
            .skip(2);
        assert_eq!(rest.len(), 1);
        assert_eq!(rest.next(), Some(vec![6]));
        assert_eq!(rest.next(), None);
    }

    #[test]
    fn invalid_batch_sizes_are_refused_with_their_values() {
        let zero = Batches::new(vec![0], 0, false, 1, 1).unwrap_err();
        assert_eq!(zero, SamplerError::ZeroBatchSize);
        assert_eq!(zero.to_string(), "batch_size must be at least 1, got 0");
        let large = Batches::new(vec![0, 1, 2], 4, true, 3, 3).unwrap_err();
        assert_eq!(
            large.to_string(),
            "batch_size 4 is larger than the smallest shard (3 samples), so drop_last would \
             leave no batches; use a batch_size of at most 3"
        );
        // Exact shards of more ranks than samples: some are empty, and no size fits them.
        let empty = Batches::new(vec![0], 1, true, 1, 0).unwrap_err();
        assert_eq!(
            empty.to_string(),
            "batch_size 1 is larger than the smallest shard (0 samples), so drop_last would \
             leave no batches; some ranks have no sample (more ranks than samples): use \
             drop_last = false"
        );
    }
}
