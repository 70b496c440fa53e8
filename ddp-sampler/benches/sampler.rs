//! One epoch's indices for one rank of 8, shuffled, for N = 10^6 and 10^7: the work a rank
//! does at every `set_epoch`. Compare with `benches/reference_sampler.py`, which times
//! PyTorch's `DistributedSampler` on the same sizes.
//!
//! `cargo bench -p ddp-sampler --bench sampler`

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ddp_sampler::DistributedSampler;

const REPLICAS: usize = 8;

fn epoch_indices(c: &mut Criterion) {
    let mut group = c.benchmark_group("epoch_indices");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for dataset_len in [1_000_000usize, 10_000_000] {
        let mut sampler = DistributedSampler::builder(dataset_len, REPLICAS, 0)
            .seed(0)
            .build()
            .expect("valid sampler");
        group.throughput(Throughput::Elements(dataset_len as u64));
        group.bench_with_input(
            BenchmarkId::new("shuffle_r8", dataset_len),
            &dataset_len,
            |b, _| {
                let mut epoch = 0;
                b.iter(|| {
                    epoch += 1;
                    sampler.set_epoch(epoch);
                    black_box(sampler.indices())
                });
            },
        );
    }
    group.finish();
}

criterion_group!(benches, epoch_indices);
criterion_main!(benches);
