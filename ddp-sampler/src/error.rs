//! The one error type of this crate.

use thiserror::Error;

/// Why a sampler or a batch adapter could not be built.
///
/// Every message names the values at fault, so that the caller can tell which argument to change.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SamplerError {
    /// `num_replicas` was 0: there must be at least one rank.
    #[error("num_replicas must be at least 1, got 0")]
    ZeroReplicas,

    /// `rank` does not name one of the `num_replicas` ranks.
    #[error(
        "rank {rank} is out of range for {num_replicas} replicas (expected 0..{num_replicas})"
    )]
    RankOutOfRange {
        /// The rank that was asked for.
        rank: usize,
        /// The number of replicas, so valid ranks are `0..num_replicas`.
        num_replicas: usize,
    },

    /// The configuration would give at least one rank no samples in an epoch; that rank would
    /// leave the others waiting in their collectives, so it is refused up front.
    #[error(
        "dataset_len {dataset_len} leaves some of the {num_replicas} replicas without samples \
         under {partition}, which needs dataset_len >= {min_dataset_len}"
    )]
    EmptyShard {
        /// The dataset length given to the builder.
        dataset_len: usize,
        /// The number of replicas given to the builder.
        num_replicas: usize,
        /// The partition rule in force, in words (for example `Partition::Exact`).
        partition: &'static str,
        /// The smallest dataset length that rule accepts for this many replicas.
        min_dataset_len: usize,
    },

    /// `drop_last(true)` was combined with [`Partition::Exact`](crate::Partition::Exact), which
    /// neither pads nor drops.
    #[error(
        "drop_last cannot be combined with Partition::Exact, which neither pads nor drops samples"
    )]
    DropLastWithExact,

    /// A batch adapter was asked for batches of zero samples.
    #[error("batch_size must be at least 1, got 0")]
    ZeroBatchSize,

    /// With batch `drop_last`, the smallest shard does not fill one batch, so every rank would
    /// yield zero batches and the epoch would do nothing.
    #[error(
        "batch_size {batch_size} is larger than the smallest shard ({shard_len} samples), so \
         drop_last would leave no batches; {}",
        fit_advice(*shard_len)
    )]
    BatchLargerThanShard {
        /// The batch size that was asked for.
        batch_size: usize,
        /// The number of samples of the smallest shard.
        shard_len: usize,
    },

    /// A mid-epoch resume position lies past the end of this rank's epoch.
    #[error("cannot resume at sample {start}: this rank has only {len} samples per epoch")]
    ResumePastEnd {
        /// The position asked for.
        start: usize,
        /// The number of samples this rank yields per epoch.
        len: usize,
    },

    /// The rest of an epoch was asked for after more positions than the epoch has.
    #[error(
        "cannot continue an epoch after {consumed} consumed positions: it ends at position {end}"
    )]
    ConsumedPastEnd {
        /// The positions of the epoch's order already consumed.
        consumed: usize,
        /// Where the epoch ends.
        end: usize,
    },

    /// An epoch's end past the dataset was given to a rule that never repeats a sample.
    #[error(
        "an epoch of {dataset_len} samples under {partition} ends at position {dataset_len} at \
         the latest, not {end}: only Partition::Padded repeats samples"
    )]
    EndPastDataset {
        /// The end asked for.
        end: usize,
        /// The number of samples in the dataset.
        dataset_len: usize,
        /// The partition rule in force, in words.
        partition: &'static str,
    },
}

/// What fits a batch into a shard of `shard_len` samples.
fn fit_advice(shard_len: usize) -> String {
    match shard_len {
        // Exact shards of more ranks than samples: no batch size fits the empty ones.
        0 => {
            "some ranks have no sample (more ranks than samples): use drop_last = false".to_string()
        }
        n => format!("use a batch_size of at most {n}"),
    }
}
