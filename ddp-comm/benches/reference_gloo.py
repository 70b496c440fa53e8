"""PyTorch Gloo doing what benches/collectives.rs measures, for a side-by-side table.

Run by the Rust bench with the setup's Python (`.deps/venv/bin/python`); prints
`RESULT <label>|<median seconds>|<busbw GB/s or bytes>` lines from rank 0.
Each rank is one process with one intra-op thread, on loopback.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [("4 KiB", 4 << 10, 1000), ("256 KiB", 256 << 10, 400), ("4 MiB", 4 << 20, 200),
         ("25 MiB", 25 << 20, 60), ("64 MiB", 64 << 20, 30)]
CONVNET = [(32, 3, 3, 3), (32,), (32,), (64, 32, 3, 3), (64,), (64,), (128, 64, 3, 3), (128,), (128,),
           (256, 128, 3, 3), (256,), (256,), (8, 256), (8,)]
BROADCAST_CALLS = 200
GATHER = ("4 MiB", 4 << 20, 100)


def time_calls(calls, f):
    for _ in range(max(2, (calls + 19) // 20)):
        f()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)  # ddp_testkit::median, the Rust side's


def worker(rank, world, port, scale):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    calls = lambda c: max(5, int(c * scale))
    for label, nbytes, count in SIZES:
        t = torch.zeros(nbytes // 4, dtype=torch.float32)
        dist.barrier()
        secs = time_calls(calls(count), lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM))
        busbw = nbytes / secs * 2 * (world - 1) / world / 1e9
        if rank == 0:
            print(f"RESULT all_reduce {label}|{secs}|{busbw}", flush=True)
    label, nbytes, count = GATHER
    t = torch.zeros(nbytes // 4, dtype=torch.float32)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.barrier()
    secs = time_calls(calls(count), lambda: dist.all_gather(out, t))
    busbw = world * nbytes / secs * (world - 1) / world / 1e9
    if rank == 0:
        print(f"RESULT all_gather {label}|{secs}|{busbw}", flush=True)
    params = [torch.zeros(s) for s in CONVNET]
    total = sum(p.numel() for p in params)
    dist.barrier()

    def bcast_all():
        for p in params:
            dist.broadcast(p, 0)

    secs = time_calls(calls(BROADCAST_CALLS), bcast_all)
    if rank == 0:
        print(f"RESULT broadcast 14 tensors|{secs}|{total * 4}", flush=True)
    flat = torch.zeros(total)
    dist.barrier()
    secs = time_calls(calls(BROADCAST_CALLS), lambda: dist.broadcast(flat, 0))
    if rank == 0:
        print(f"RESULT broadcast flat|{secs}|{total * 4}", flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args.scale), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
