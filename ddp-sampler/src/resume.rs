//! The rest of an epoch on a new number of ranks: after a job consumed the first positions of
//! an epoch's order on some ranks, the positions that remain, dealt over this sampler's ranks.

use crate::error::SamplerError;
use crate::sampler::DistributedSampler;
use crate::shard::{Layout, Rule};

impl DistributedSampler {
    /// The rest of the current epoch after the job consumed its first `consumed` positions,
    /// dealt over this sampler's ranks: for a run that stopped inside an epoch and continues
    /// on another number of ranks (or the same).
    ///
    /// Every rank of a job reads positions `r, r + R, ...` of the epoch's (padded) order, so
    /// after each rank read `c` samples the job has read exactly the first `c * R` positions,
    /// whatever `R` was: a prefix. The rest, positions `consumed..N` of the order, is dealt
    /// over this sampler's `R'` ranks as a whole epoch is (rank `r'` takes
    /// `consumed + r', consumed + r' + R', ...`) under this sampler's rule applied to the
    /// `N - consumed` positions left:
    ///
    /// | partition | samples of rank `r'` |
    /// |---|---|
    /// | [`Partition::Padded`](crate::Partition::Padded) | `ceil((N - consumed) / R')`, padded by repeating the order from its start |
    /// | with `drop_last` | `floor((N - consumed) / R')` |
    /// | [`Partition::Exact`](crate::Partition::Exact) | `ceil((N - consumed - r') / R')`: every remaining index exactly once |
    ///
    /// So `remaining(0)` is [`indices`](Self::indices), and when `R'` is the `R` that
    /// consumed `c` samples per rank, `remaining(c * R)` is [`iter_from(c)`](Self::iter_from).
    /// A rank may get no samples (the epoch is nearly done);
    /// [`Partition::Exact`](crate::Partition::Exact)'s shards differ by at most one sample,
    /// as in a whole epoch.
    ///
    /// ```
    /// use ddp_sampler::DistributedSampler;
    ///
    /// # fn main() -> Result<(), ddp_sampler::SamplerError> {
    /// // 2 ranks read 3 samples each of a 12-sample epoch; 3 ranks continue it.
    /// let before: Vec<DistributedSampler> =
    ///     (0..2).map(|r| DistributedSampler::new(12, 2, r)).collect::<Result<_, _>>()?;
    /// let after: Vec<DistributedSampler> =
    ///     (0..3).map(|r| DistributedSampler::new(12, 3, r)).collect::<Result<_, _>>()?;
    /// let mut seen: Vec<usize> = before.iter().flat_map(|s| s.indices()[..3].to_vec()).collect();
    /// for s in &after {
    ///     assert_eq!(s.remaining(6)?.len(), 2);
    ///     seen.extend(s.remaining(6)?);
    /// }
    /// seen.sort();
    /// assert_eq!(seen, (0..12).collect::<Vec<_>>()); // every sample once
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`SamplerError::ConsumedPastEnd`] when `consumed > N` under `drop_last` or
    /// [`Partition::Exact`](crate::Partition::Exact), which never read past `N`. A padded epoch
    /// may have read up to `R - 1` positions of padding beyond `N`: any `consumed >= N` leaves
    /// nothing.
    pub fn remaining(&self, consumed: usize) -> Result<Vec<usize>, SamplerError> {
        let layout = self.layout();
        let n = layout.dataset_len;
        let consumed = if layout.rule == Rule::Pad {
            consumed.min(n)
        } else {
            consumed
        };
        self.remaining_until(consumed, n)
    }

    /// As [`remaining`](Self::remaining), for an epoch that ends at position `end` of the
    /// order rather than at `N`: positions `consumed..end` dealt over this sampler's ranks
    /// under its rule. For a trainer whose epoch is a whole number of steps: with
    /// [`Partition::Padded`](crate::Partition::Padded), `end` may pass `N`, and position
    /// `p` holds the order's `p % N`-th index (the padding repeats the order from its start),
    /// so `end = consumed + m * R'` gives every rank exactly `m` samples.
    ///
    /// # Errors
    ///
    /// [`SamplerError::ConsumedPastEnd`] when `consumed > end`, and
    /// [`SamplerError::EndPastDataset`] when `end > N` under `drop_last` or
    /// [`Partition::Exact`](crate::Partition::Exact), which never repeat an index.
    pub fn remaining_until(&self, consumed: usize, end: usize) -> Result<Vec<usize>, SamplerError> {
        let whole = self.layout();
        if consumed > end {
            return Err(SamplerError::ConsumedPastEnd { consumed, end });
        }
        if end > whole.dataset_len && whole.rule != Rule::Pad {
            return Err(SamplerError::EndPastDataset {
                end,
                dataset_len: whole.dataset_len,
                partition: whole.rule.describe(),
            });
        }
        let rest = Layout {
            start: consumed,
            span: end - consumed,
            ..whole
        };
        Ok(self.indices_of(rest.shard(self.rank())))
    }
}

#[cfg(test)]
mod tests {
    use crate::{DistributedSampler, Partition, SamplerError};

    fn sampler(n: usize, replicas: usize, rank: usize) -> DistributedSampler {
        let mut s = DistributedSampler::builder(n, replicas, rank)
            .shuffle(false)
            .build()
            .expect("valid sampler");
        s.set_epoch(1);
        s
    }

    #[test]
    fn the_rest_is_dealt_from_the_consumed_prefix_on() {
        // 10 samples, 4 consumed; 3 ranks take 4, 7 | 5, 8 | 6, 9.
        let rest: Vec<Vec<usize>> = (0..3)
            .map(|r| sampler(10, 3, r).remaining(4).unwrap())
            .collect();
        assert_eq!(rest, [vec![4, 7], vec![5, 8], vec![6, 9]]);
        // 4 ranks: 6 left, padded to 8 by repeating the order's start.
        let rest: Vec<Vec<usize>> = (0..4)
            .map(|r| sampler(10, 4, r).remaining(4).unwrap())
            .collect();
        assert_eq!(rest, [vec![4, 8], vec![5, 9], vec![6, 0], vec![7, 1]]);
    }

    #[test]
    fn each_rule_applies_to_the_positions_left() {
        let build = |rank, drop_last, partition| {
            DistributedSampler::builder(10, 4, rank)
                .shuffle(false)
                .drop_last(drop_last)
                .partition(partition)
                .build()
                .expect("valid sampler")
        };
        let dropped: Vec<Vec<usize>> = (0..4)
            .map(|r| build(r, true, Partition::Padded).remaining(3).unwrap())
            .collect();
        assert_eq!(dropped, [vec![3], vec![4], vec![5], vec![6]]);
        let exact: Vec<Vec<usize>> = (0..4)
            .map(|r| build(r, false, Partition::Exact).remaining(3).unwrap())
            .collect();
        assert_eq!(exact, [vec![3, 7], vec![4, 8], vec![5, 9], vec![6]]);
        assert_eq!(
            build(0, true, Partition::Padded).remaining(11),
            Err(SamplerError::ConsumedPastEnd {
                consumed: 11,
                end: 10
            })
        );
        let err = build(0, false, Partition::Exact)
            .remaining_until(2, 12)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "an epoch of 10 samples under Partition::Exact ends at position 10 at the latest, \
             not 12: only Partition::Padded repeats samples"
        );
    }

    #[test]
    fn a_padded_epoch_may_end_past_the_order_and_wrap() {
        // Positions 8..14 of a 10-sample order over 2 ranks: 8, 0, 2 | 9, 1, 3.
        let rest: Vec<Vec<usize>> = (0..2)
            .map(|r| sampler(10, 2, r).remaining_until(8, 14).unwrap())
            .collect();
        assert_eq!(rest, [vec![8, 0, 2], vec![9, 1, 3]]);
        // Padding read by the old ranks counts as consumed.
        assert_eq!(sampler(10, 3, 0).remaining(12), Ok(vec![]));
        assert_eq!(
            sampler(10, 2, 0).remaining_until(5, 4),
            Err(SamplerError::ConsumedPastEnd {
                consumed: 5,
                end: 4
            })
        );
    }

    #[test]
    fn shuffled_rests_take_the_same_positions_of_the_permutation() {
        let mut s = DistributedSampler::builder(20, 3, 1)
            .seed(4)
            .build()
            .unwrap();
        s.set_epoch(2);
        let order = crate::permutation(20, 4, 2);
        let want: Vec<usize> = [7, 10, 13, 16, 19].iter().map(|p| order[p % 20]).collect();
        assert_eq!(s.remaining(6).unwrap(), want);
    }
}
