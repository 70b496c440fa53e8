//! Which positions of an epoch's order each rank takes: the padding, dropping and exact
//! rules, and the strided gather of one rank's share.

use crate::permutation::Slot;

/// How an epoch's order of `0..N` is cut into `R` equal or nearly equal shards.
///
/// The default, [`Partition::Padded`], is PyTorch's rule: every rank gets the same number of
/// samples, by repeating a few samples or, with `drop_last`, by dropping the tail.
/// [`Partition::Exact`] is for evaluation: every sample exactly once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Partition {
    /// PyTorch's rule. Without `drop_last` the order is padded to `ceil(N / R) * R` by
    /// repeating it from its start; with `drop_last` it is cut to `floor(N / R) * R`. Every
    /// rank gets the same number of samples.
    #[default]
    Padded,
    /// No padding and no dropping: rank `r` takes the positions `r, r + R, ...` below `N`, so
    /// shard lengths differ by at most one (lower ranks get the extra samples) and together
    /// the shards hold every index exactly once. For distributed evaluation, where a repeated
    /// sample would be counted twice.
    Exact,
}

/// The cutting rule with `drop_last` folded in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Rule {
    /// `Partition::Padded` without `drop_last`.
    Pad,
    /// `Partition::Padded` with `drop_last`.
    Drop,
    /// `Partition::Exact`.
    Exact,
}

impl Rule {
    /// How the rule is named to the user, for error messages.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Rule::Pad => "Partition::Padded",
            Rule::Drop => "Partition::Padded with drop_last",
            Rule::Exact => "Partition::Exact",
        }
    }
}

/// The shape of every rank's shard: dataset length, replica count and rule, and which
/// positions of the epoch's order are dealt: `span` of them from `start` on (the whole order,
/// `0` and `dataset_len`, except for the rest of an epoch after a resume).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Layout {
    pub(crate) dataset_len: usize,
    pub(crate) num_replicas: usize,
    pub(crate) rule: Rule,
    pub(crate) start: usize,
    pub(crate) span: usize,
}

impl Layout {
    /// The layout of a whole epoch.
    pub(crate) fn epoch(dataset_len: usize, num_replicas: usize, rule: Rule) -> Layout {
        Layout {
            dataset_len,
            num_replicas,
            rule,
            start: 0,
            span: dataset_len,
        }
    }

    /// How many samples rank `rank` (below `num_replicas`) takes per epoch.
    pub(crate) fn len_of_rank(&self, rank: usize) -> usize {
        let (n, r) = (self.span, self.num_replicas);
        match self.rule {
            Rule::Pad => n.div_ceil(r),
            Rule::Drop => n / r,
            Rule::Exact => n.saturating_sub(rank).div_ceil(r),
        }
    }

    /// The shard of `rank`.
    pub(crate) fn shard(&self, rank: usize) -> Shard {
        Shard {
            dataset_len: self.dataset_len,
            num_replicas: self.num_replicas,
            rank,
            len: self.len_of_rank(rank),
            start: self.start,
        }
    }
}

/// One rank's share of an epoch: its `k`-th sample sits at position
/// `start + rank + k * num_replicas` of the padded order, which is position
/// `(start + rank + k * num_replicas) % dataset_len` of the order itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Shard {
    pub(crate) dataset_len: usize,
    pub(crate) num_replicas: usize,
    pub(crate) rank: usize,
    pub(crate) len: usize,
    /// The first position dealt (0 for a whole epoch).
    pub(crate) start: usize,
}

impl Shard {
    /// Where in the epoch's order this rank's `k`-th sample is.
    #[inline]
    pub(crate) fn position(&self, k: usize) -> usize {
        (self.start + self.rank + k * self.num_replicas) % self.dataset_len
    }

    /// How many of this rank's samples lie before the padding (need no wrap-around).
    fn unpadded(&self) -> usize {
        self.dataset_len
            .saturating_sub(self.start + self.rank)
            .div_ceil(self.num_replicas)
            .min(self.len)
    }

    /// This rank's indices when the order is `0..dataset_len`.
    pub(crate) fn sequential(&self) -> Vec<usize> {
        (0..self.len).map(|k| self.position(k)).collect()
    }

    /// This rank's indices taken from `order`, consuming it.
    pub(crate) fn gather<T: Gather>(&self, order: Vec<T>) -> Vec<usize> {
        T::gather(order, self)
    }
}

/// Taking one rank's strided share out of a full order, with as little memory as the slot
/// type allows.
pub(crate) trait Gather: Slot {
    /// The indices of `shard`, taken from `order` (which has `shard.dataset_len` slots).
    fn gather(order: Vec<Self>, shard: &Shard) -> Vec<usize>;
}

impl Gather for u32 {
    /// Copies the share into a new `Vec<usize>`; the `u32` order is freed on return, so the peak
    /// is `4 N + 8 N / R` bytes.
    fn gather(order: Vec<u32>, shard: &Shard) -> Vec<usize> {
        let unpadded = shard.unpadded();
        let mut out = Vec::with_capacity(shard.len);
        if unpadded > 0 {
            let first = shard.start + shard.rank;
            let strided = order[first..].iter().step_by(shard.num_replicas);
            out.extend(strided.take(unpadded).map(|slot| slot.index()));
        }
        out.extend((unpadded..shard.len).map(|k| order[shard.position(k)].index()));
        out
    }
}

impl Gather for usize {
    /// Compacts the share to the front of `order` in place: the `k`-th sample comes from
    /// position `start + rank + k * R >= k`, so no source is overwritten before it is read.
    /// Padding positions (past the order's end: at most one per rank in a whole epoch, since
    /// padding is shorter than `R`) wrap to the start of the order and are read first.
    fn gather(mut order: Vec<usize>, shard: &Shard) -> Vec<usize> {
        let unpadded = shard.unpadded();
        let padding: Vec<usize> = (unpadded..shard.len)
            .map(|k| order[shard.position(k)])
            .collect();
        for k in 0..unpadded {
            order[k] = order[shard.start + shard.rank + k * shard.num_replicas];
        }
        order.truncate(unpadded);
        order.extend(padding);
        order.shrink_to_fit();
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dataset_len: usize, num_replicas: usize, rule: Rule) -> Layout {
        Layout::epoch(dataset_len, num_replicas, rule)
    }

    fn lens(layout: Layout) -> Vec<usize> {
        (0..layout.num_replicas)
            .map(|r| layout.len_of_rank(r))
            .collect()
    }

    #[test]
    fn shard_lengths_follow_each_rule() {
        assert_eq!(lens(layout(10, 4, Rule::Pad)), [3, 3, 3, 3]);
        assert_eq!(lens(layout(10, 4, Rule::Drop)), [2, 2, 2, 2]);
        assert_eq!(lens(layout(10, 4, Rule::Exact)), [3, 3, 2, 2]);
        assert_eq!(lens(layout(3, 5, Rule::Exact)), [1, 1, 1, 0, 0]);
        assert_eq!(lens(layout(2, 5, Rule::Pad)), [1, 1, 1, 1, 1]);
    }

    #[test]
    fn sequential_wraps_padding_to_the_start() {
        let shard = layout(10, 4, Rule::Pad).shard(3);
        assert_eq!(shard.sequential(), [3, 7, 1]);
        let shard = layout(2, 5, Rule::Pad).shard(4);
        assert_eq!(shard.sequential(), [0]);
    }

    #[test]
    fn both_gathers_take_the_same_strided_share() {
        let order = [9usize, 4, 7, 0, 2, 8, 1, 6, 3, 5, 10];
        let cases = [
            (
                Rule::Pad,
                4,
                [vec![9, 2, 3], vec![4, 8, 5], vec![7, 1, 10], vec![0, 6, 9]],
            ),
            (
                Rule::Drop,
                4,
                [vec![9, 2], vec![4, 8], vec![7, 1], vec![0, 6]],
            ),
            (
                Rule::Exact,
                4,
                [vec![9, 2, 3], vec![4, 8, 5], vec![7, 1, 10], vec![0, 6]],
            ),
        ];
        for (rule, replicas, expected) in cases {
            let layout = layout(order.len(), replicas, rule);
            for (rank, want) in expected.iter().enumerate() {
                let shard = layout.shard(rank);
                let narrow: Vec<u32> = order.iter().map(|&i| i as u32).collect();
                assert_eq!(&shard.gather(narrow), want, "u32 {rule:?} rank {rank}");
                assert_eq!(
                    &shard.gather(order.to_vec()),
                    want,
                    "usize {rule:?} rank {rank}"
                );
            }
        }
    }

    #[test]
    fn gather_pads_repeatedly_when_replicas_exceed_the_dataset() {
        let layout = layout(2, 5, Rule::Pad);
        let shares: Vec<Vec<usize>> = (0..5)
            .map(|rank| layout.shard(rank).gather(vec![1usize, 0]))
            .collect();
        assert_eq!(shares, [[1], [0], [1], [0], [1]]);
    }
}
