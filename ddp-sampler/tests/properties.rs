//! Properties over many (N, R, seed, epoch, drop_last, shuffle): the shard formulas, exact
//! coverage, PyTorch's `shuffle=False` output, determinism and epoch-to-epoch variation.

use ddp_sampler::{permutation, DistributedSampler, Partition};
use proptest::prelude::*;

/// Every rank's sampler for one configuration, at `epoch`.
fn all_ranks(
    dataset_len: usize,
    num_replicas: usize,
    config: impl Fn(ddp_sampler::SamplerBuilder) -> ddp_sampler::SamplerBuilder,
    epoch: u64,
) -> Vec<DistributedSampler> {
    (0..num_replicas)
        .map(|rank| {
            let mut s = config(DistributedSampler::builder(dataset_len, num_replicas, rank))
                .build()
                .expect("valid configuration");
            s.set_epoch(epoch);
            s
        })
        .collect()
}

/// PyTorch's `DistributedSampler.__iter__` for `shuffle=False`, transcribed line by line.
fn pytorch_sequential(n: usize, replicas: usize, rank: usize, drop_last: bool) -> Vec<usize> {
    let num_samples = if drop_last {
        n / replicas
    } else {
        n.div_ceil(replicas)
    };
    let total_size = num_samples * replicas;
    let mut indices: Vec<usize> = (0..n).collect();
    if drop_last {
        indices.truncate(total_size);
    } else {
        let padding_size = total_size - n;
        if padding_size <= indices.len() {
            indices.extend_from_within(..padding_size);
        } else {
            let repeats = padding_size.div_ceil(indices.len());
            let repeated: Vec<usize> = indices.repeat(repeats);
            indices.extend_from_slice(&repeated[..padding_size]);
        }
    }
    assert_eq!(indices.len(), total_size);
    indices[rank..].iter().step_by(replicas).copied().collect()
}

/// (N, R) with N >= R, so that every rule gives every rank a sample.
fn sizes() -> impl Strategy<Value = (usize, usize)> {
    (1usize..=64).prop_flat_map(|r| (r..=10_000usize, Just(r)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn padded_ranks_interleave_to_the_padded_or_cut_order(
        (n, replicas) in sizes(),
        seed in any::<u64>(),
        epoch in any::<u64>(),
        drop_last in any::<bool>(),
        shuffle in any::<bool>(),
    ) {
        let ranks = all_ranks(n, replicas, |b| b.seed(seed).drop_last(drop_last).shuffle(shuffle), epoch);
        let len = if drop_last { n / replicas } else { n.div_ceil(replicas) };
        let order: Vec<usize> = if shuffle { permutation(n, seed, epoch) } else { (0..n).collect() };
        let mut interleaved = vec![usize::MAX; len * replicas];
        for (rank, s) in ranks.iter().enumerate() {
            prop_assert_eq!(s.len(), len);
            prop_assert_eq!(s.len_of_rank(rank), Some(len));
            let indices = s.indices();
            prop_assert_eq!(indices.len(), len);
            for (k, index) in indices.into_iter().enumerate() {
                interleaved[rank + k * replicas] = index;
            }
        }
        let expected: Vec<usize> = (0..len * replicas).map(|p| order[p % n]).collect();
        prop_assert_eq!(interleaved, expected);
    }

    #[test]
    fn padded_multiplicities_follow_the_formulas(
        n in 1usize..=10_000,
        replicas in 1usize..=64,
        seed in any::<u64>(),
        epoch in 0u64..1_000,
    ) {
        // Padding: every index at least once, the total ceil(N / R) * R, and no index more
        // often than the padding forces.
        let ranks = all_ranks(n, replicas, |b| b.seed(seed), epoch);
        let mut counts = vec![0usize; n];
        for s in &ranks {
            for i in s.iter() {
                counts[i] += 1;
            }
        }
        let total = n.div_ceil(replicas) * replicas;
        prop_assert_eq!(counts.iter().sum::<usize>(), total);
        prop_assert!(counts.iter().all(|&c| c >= 1 && c <= total.div_ceil(n)));
        if n >= replicas {
            let ranks = all_ranks(n, replicas, |b| b.seed(seed).drop_last(true), epoch);
            let mut seen = vec![false; n];
            for i in ranks.iter().flat_map(|s| s.indices()) {
                prop_assert!(!seen[i], "index {} dealt twice under drop_last", i);
                seen[i] = true;
            }
            prop_assert_eq!(seen.iter().filter(|&&s| s).count(), n / replicas * replicas);
        }
    }

    #[test]
    fn exact_shards_cover_every_index_once(
        (n, replicas) in sizes(),
        seed in any::<u64>(),
        epoch in any::<u64>(),
        shuffle in any::<bool>(),
    ) {
        let ranks = all_ranks(n, replicas, |b| b.seed(seed).shuffle(shuffle).partition(Partition::Exact), epoch);
        let lens: Vec<usize> = ranks.iter().map(DistributedSampler::len).collect();
        prop_assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
        prop_assert_eq!(lens.iter().sum::<usize>(), n);
        let mut all = Vec::with_capacity(n);
        for (rank, s) in ranks.iter().enumerate() {
            let indices = s.indices();
            prop_assert_eq!(indices.len(), lens[rank]);
            prop_assert_eq!(ranks[0].len_of_rank(rank), Some(lens[rank]));
            all.extend(indices);
        }
        all.sort_unstable();
        prop_assert_eq!(all, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn unshuffled_matches_pytorch(
        n in 1usize..=10_000,
        replicas in 1usize..=64,
        drop_last in any::<bool>(),
    ) {
        prop_assume!(!drop_last || n >= replicas);
        for (rank, s) in all_ranks(n, replicas, |b| b.shuffle(false).drop_last(drop_last), 0).iter().enumerate() {
            prop_assert_eq!(s.indices(), pytorch_sequential(n, replicas, rank, drop_last));
        }
    }

    #[test]
    fn different_epochs_give_different_orders(
        (n, replicas) in (1usize..=64).prop_flat_map(|r| (r * 16..=10_000usize, Just(r))),
        rank_pick in any::<prop::sample::Index>(),
        seed in any::<u64>(),
        epoch in 0u64..u64::MAX,
    ) {
        // At least 16 samples per rank: two epochs agreeing by chance has probability below
        // 1 / (N - 16)^16.
        let rank = rank_pick.index(replicas);
        let at = |epoch| {
            let mut s = DistributedSampler::builder(n, replicas, rank).seed(seed).build().expect("valid");
            s.set_epoch(epoch);
            s.indices()
        };
        prop_assert_ne!(at(epoch), at(epoch + 1));
        prop_assert_ne!(permutation(n, seed, epoch), permutation(n, seed.wrapping_add(1), epoch));
    }

    #[test]
    fn same_arguments_give_the_same_indices_every_way(
        (n, replicas) in sizes(),
        rank_pick in any::<prop::sample::Index>(),
        seed in any::<u64>(),
        epoch in any::<u64>(),
        start_pick in any::<prop::sample::Index>(),
    ) {
        let rank = rank_pick.index(replicas);
        let build = || {
            let mut s = DistributedSampler::builder(n, replicas, rank).seed(seed).build().expect("valid");
            s.set_epoch(epoch);
            s
        };
        let (a, b) = (build(), build());
        let indices = a.indices();
        prop_assert_eq!(&indices, &b.indices());
        prop_assert_eq!(&indices, &a.iter().collect::<Vec<_>>());
        let start = start_pick.index(indices.len() + 1);
        prop_assert_eq!(&indices[start..], &a.iter_from(start).expect("in range").collect::<Vec<_>>()[..]);
    }

    #[test]
    fn batches_have_equal_counts_and_keep_the_order(
        (n, replicas) in sizes(),
        batch_size in 1usize..=300,
        seed in any::<u64>(),
        exact in any::<bool>(),
        drop_last in any::<bool>(),
    ) {
        let partition = if exact { Partition::Exact } else { Partition::Padded };
        let ranks = all_ranks(n, replicas, |b| b.seed(seed).partition(partition), 1);
        let smallest = ranks.iter().map(DistributedSampler::len).min().unwrap();
        prop_assume!(!drop_last || batch_size <= smallest);
        let mut counts = Vec::new();
        for s in &ranks {
            let batches: Vec<Vec<usize>> = s.batches(batch_size, drop_last).expect("valid batches").collect();
            counts.push(batches.len());
            prop_assert!(batches.iter().all(|b| b.len() <= batch_size));
            let flat: Vec<usize> = batches.concat();
            let indices = s.indices();
            if drop_last {
                prop_assert!(batches.iter().all(|b| b.len() == batch_size));
                prop_assert_eq!(&flat[..], &indices[..flat.len()]);
            } else {
                prop_assert_eq!(flat, indices);
            }
        }
        prop_assert!(counts.iter().all(|&c| c == counts[0]), "batch counts {:?}", counts);
    }
}
