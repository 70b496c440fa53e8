//! `shuffle(false)` against literal index lists printed by PyTorch 2.13's
//! `torch.utils.data.distributed.DistributedSampler(range(N), R, r, shuffle=False, drop_last=..)`.

use ddp_sampler::DistributedSampler;

/// Every rank's indices, in rank order.
fn all_ranks(dataset_len: usize, num_replicas: usize, drop_last: bool) -> Vec<Vec<usize>> {
    (0..num_replicas)
        .map(|rank| {
            DistributedSampler::builder(dataset_len, num_replicas, rank)
                .shuffle(false)
                .drop_last(drop_last)
                .build()
                .expect("valid sampler")
                .indices()
        })
        .collect()
}

#[test]
fn ten_samples_three_replicas_padded() {
    assert_eq!(
        all_ranks(10, 3, false),
        [vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]
    );
}

#[test]
fn ten_samples_three_replicas_drop_last() {
    assert_eq!(
        all_ranks(10, 3, true),
        [vec![0, 3, 6], vec![1, 4, 7], vec![2, 5, 8]]
    );
}

#[test]
fn ten_samples_four_replicas_padded() {
    assert_eq!(
        all_ranks(10, 4, false),
        [vec![0, 4, 8], vec![1, 5, 9], vec![2, 6, 0], vec![3, 7, 1]]
    );
}

#[test]
fn eleven_samples_four_replicas_drop_last() {
    assert_eq!(
        all_ranks(11, 4, true),
        [vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
}

#[test]
fn fewer_samples_than_replicas_pad_from_the_start() {
    assert_eq!(all_ranks(3, 4, false), [vec![0], vec![1], vec![2], vec![0]]);
}

#[test]
fn padding_longer_than_the_dataset_repeats_it_again() {
    assert_eq!(
        all_ranks(2, 5, false),
        [vec![0], vec![1], vec![0], vec![1], vec![0]]
    );
}
