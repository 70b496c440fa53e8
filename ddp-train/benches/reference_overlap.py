"""PyTorch DDP doing what benches/overlap.rs measures, for a side-by-side table.

DDP training steps of an MLP of square Linear layers with ReLU between them, on the CPU,
one process per rank (torch.multiprocessing), Gloo over loopback TCP
(GLOO_SOCKET_IFNAME=lo unless set), `torch.set_num_threads(1)` per rank, MSE loss, SGD
(lr 1e-4), `zero_grad()` setting gradients to none, DDP's defaults otherwise (buckets of
--bucket-cap-mb, the first one too since the cap is given; the all-reduce overlaps backward).
Configurations, each with its own model and DDP in the same processes, take one step in
turn:

    overlap   the default communication hook (all-reduce)
    bf16      default_hooks.bf16_compress_hook

Prints one line per configuration and rank:

    RESULT reference_overlap config=overlap world=2 rank=0 ... steps_per_sec=4.1 ...

Usage: python reference_overlap.py [--ranks 2] [--layers 10] [--width 2048] [--batch 16]
       [--warmup 3] [--steps 12] [--configs overlap,bf16] [--bucket-cap-mb 25]
"""

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def mlp(layers, width):
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def worker(rank, world, port, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(rank)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    replicas = []
    for config in args.configs.split(","):
        model = nn.parallel.DistributedDataParallel(
            mlp(args.layers, args.width), bucket_cap_mb=args.bucket_cap_mb)
        if config == "bf16":
            model.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
        elif config != "overlap":
            raise SystemExit(f"unknown configuration {config!r}: expected overlap or bf16")
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        phases = {"compute": [], "optim": [], "step": []}
        replicas.append({"config": config, "model": model, "optimizer": optimizer,
                         "phases": phases, "loss": float("nan")})
    criterion = nn.MSELoss()
    # The configurations take one step in turn, so that load that comes and goes on the
    # machine affects them alike.
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
        for r in replicas:
            t0 = time.perf_counter()
            r["optimizer"].zero_grad()
            l = criterion(r["model"](x), y)
            l.backward()  # DDP's all-reduce runs inside backward and is waited for at its end
            t1 = time.perf_counter()
            r["optimizer"].step()
            t2 = time.perf_counter()
            r["loss"] = l.item()
            if step >= args.warmup:
                r["phases"]["compute"].append(t1 - t0)
                r["phases"]["optim"].append(t2 - t1)
                r["phases"]["step"].append(t2 - t0)
    dist.barrier()
    for r in replicas:
        med = {k: statistics.median(v) for k, v in r["phases"].items()}
        parameters = sum(p.numel() for p in r["model"].parameters())
        line = (
            f"RESULT reference_overlap config={r['config']} world={world} rank={rank} "
            f"layers={args.layers} width={args.width} batch={args.batch} "
            f"parameters={parameters} bucket_cap_mb={args.bucket_cap_mb} "
            f"warmup={args.warmup} steps={args.steps} "
            f"steps_per_sec={1.0 / med['step']:.4f} step_median_s={med['step']:.5f} "
            f"compute_median_s={med['compute']:.5f} optim_median_s={med['optim']:.5f} "
            f"loss={r['loss']:.6f} torch={torch.__version__}\n"
        )
        # One write per line: the ranks share stdout.
        sys.stdout.write(line)
        sys.stdout.flush()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--configs", default="overlap,bf16")
    parser.add_argument("--bucket-cap-mb", type=int, default=25)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
