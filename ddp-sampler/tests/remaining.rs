//! Properties of the rest of an epoch on a new number of ranks, over many (N, R before,
//! R after, rule, seed, epoch, samples consumed): what the old ranks read plus what the new
//! ones read is exactly one epoch, with no index twice beyond what padding adds; on the same
//! ranks the rest is `iter_from`; and a padded rest with a given end gives every rank the
//! same whole number of samples.

use ddp_sampler::{permutation, DistributedSampler, Partition};
use proptest::prelude::*;

/// The three cutting rules.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Rule {
    Pad,
    Drop,
    Exact,
}

fn rule() -> impl Strategy<Value = Rule> {
    prop_oneof![Just(Rule::Pad), Just(Rule::Drop), Just(Rule::Exact)]
}

/// Every rank's sampler of `n` samples over `replicas` ranks under `rule`, at `epoch`.
fn ranks(n: usize, replicas: usize, rule: Rule, seed: u64, epoch: u64) -> Vec<DistributedSampler> {
    (0..replicas)
        .map(|rank| {
            let builder = DistributedSampler::builder(n, replicas, rank).seed(seed);
            let builder = match rule {
                Rule::Pad => builder,
                Rule::Drop => builder.drop_last(true),
                Rule::Exact => builder.partition(Partition::Exact),
            };
            let mut s = builder.build().expect("valid configuration");
            s.set_epoch(epoch);
            s
        })
        .collect()
}

/// (N, R before, R after) with N >= both, so that every rule gives every rank a sample.
fn sizes() -> impl Strategy<Value = (usize, usize, usize)> {
    (1usize..=16, 1usize..=16).prop_flat_map(|(a, b)| (a.max(b)..=3_000usize, Just(a), Just(b)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The old ranks read `c` samples each (a prefix of `c * R` positions), the new ranks
    /// the rest: together one epoch of the new rule, position for position.
    #[test]
    fn consumed_plus_remaining_is_exactly_one_epoch(
        (n, before, after) in sizes(),
        rule in rule(),
        seed in any::<u64>(),
        epoch in 0u64..1_000,
        share in 0.0f64..=1.0,
    ) {
        let old = ranks(n, before, rule, seed, epoch);
        let new = ranks(n, after, rule, seed, epoch);
        let shortest = old.iter().map(DistributedSampler::len).min().unwrap();
        let c = (shortest as f64 * share) as usize;
        let consumed: Vec<usize> = old.iter().flat_map(|s| s.indices()[..c].to_vec()).collect();
        let k = c * before;
        let rests: Vec<Vec<usize>> = new.iter().map(|s| s.remaining(k).unwrap()).collect();

        // Lengths: equal under Pad and Drop, within one under Exact, by the rule's formula.
        let left = n.saturating_sub(k);
        for (r, rest) in rests.iter().enumerate() {
            let want = match rule {
                Rule::Pad => left.div_ceil(after),
                Rule::Drop => left / after,
                Rule::Exact => left.saturating_sub(r).div_ceil(after),
            };
            prop_assert_eq!(rest.len(), want, "rank {} of {}", r, after);
        }

        // Position for position: the new ranks interleave to positions k.. of the order.
        let order = permutation(n, seed, epoch);
        let longest = rests[0].len();
        let mut interleaved = Vec::new();
        for j in 0..longest {
            interleaved.extend(rests.iter().filter_map(|rest| rest.get(j).copied()));
        }
        let expected: Vec<usize> = (k.min(n)..k.min(n) + interleaved.len()).map(|p| order[p % n]).collect();
        prop_assert_eq!(&interleaved, &expected);

        // As multisets: every index at least once (Pad), at most once (Drop), exactly once
        // (Exact); what padding adds is fewer than the larger rank count.
        let mut counts = vec![0usize; n];
        for &i in consumed.iter().chain(rests.iter().flatten()) {
            counts[i] += 1;
        }
        let total: usize = counts.iter().sum();
        match rule {
            Rule::Exact => prop_assert!(counts.iter().all(|&c| c == 1)),
            Rule::Drop => {
                prop_assert!(counts.iter().all(|&c| c <= 1));
                prop_assert!(n - total < after, "{} of {} samples missing", n - total, n);
            }
            Rule::Pad => {
                prop_assert!(counts.iter().all(|&c| c >= 1));
                prop_assert!(total - n < before.max(after), "{} repeats", total - n);
            }
        }
    }

    /// On the ranks that consumed, the rest is each rank's own `iter_from`.
    #[test]
    fn on_the_same_ranks_the_rest_is_iter_from(
        (n, replicas, _) in sizes(),
        rule in rule(),
        seed in any::<u64>(),
        epoch in 0u64..1_000,
        share in 0.0f64..=1.0,
    ) {
        let all = ranks(n, replicas, rule, seed, epoch);
        let shortest = all.iter().map(DistributedSampler::len).min().unwrap();
        let c = (shortest as f64 * share) as usize;
        for s in &all {
            let rest = s.remaining(c * replicas).unwrap();
            prop_assert_eq!(rest, s.iter_from(c).unwrap().collect::<Vec<_>>());
        }
        prop_assert_eq!(all[0].remaining(0).unwrap(), all[0].indices());
    }

    /// A padded rest that ends at `k + m * R'` gives every new rank exactly `m` samples, the
    /// positions `k..k + m * R'` of the order repeated from its start past `N`.
    #[test]
    fn a_padded_rest_with_an_end_gives_every_rank_whole_steps(
        (n, _, after) in sizes(),
        seed in any::<u64>(),
        epoch in 0u64..1_000,
        k_share in 0.0f64..1.0,
        m in 0usize..200,
    ) {
        let k = (n as f64 * k_share) as usize;
        let new = ranks(n, after, Rule::Pad, seed, epoch);
        let order = permutation(n, seed, epoch);
        for (r, s) in new.iter().enumerate() {
            let rest = s.remaining_until(k, k + m * after).unwrap();
            let want: Vec<usize> = (0..m).map(|j| order[(k + r + j * after) % n]).collect();
            prop_assert_eq!(rest, want);
        }
    }
}
