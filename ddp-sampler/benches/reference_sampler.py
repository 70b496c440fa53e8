"""Times PyTorch's DistributedSampler for comparison with `cargo bench -p ddp-sampler`.

Measures what `benches/sampler.rs` measures: one epoch's indices for rank 0 of 8,
shuffle=True, as a Python list (`list(iter(sampler))` after `set_epoch`), for N = 10^6 and
10^7. Prints one machine-readable line per N:

    reference_sampler n=1000000 replicas=8 runs=7 median_s=0.045123 min_s=0.044000

Usage: python reference_sampler.py [--runs 7] [--sizes 1000000,10000000]
"""

import argparse
import statistics
import time

import torch
from torch.utils.data.distributed import DistributedSampler

REPLICAS = 8


def time_epoch(n: int, runs: int) -> list[float]:
    sampler = DistributedSampler(range(n), num_replicas=REPLICAS, rank=0, shuffle=True)
    times = []
    for epoch in range(runs + 1):  # the first run warms up and is not counted
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        indices = list(iter(sampler))
        elapsed = time.perf_counter() - start
        assert len(indices) == -(-n // REPLICAS)
        if epoch > 0:
            times.append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--sizes", default="1000000,10000000")
    args = parser.parse_args()
    for n in (int(s) for s in args.sizes.split(",")):
        times = time_epoch(n, args.runs)
        print(
            f"reference_sampler n={n} replicas={REPLICAS} runs={len(times)} "
            f"median_s={statistics.median(times):.6f} min_s={min(times):.6f} "
            f"torch={torch.__version__}",
            flush=True,
        )


if __name__ == "__main__":
    main()
