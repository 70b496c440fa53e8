"""PyTorch's own DistributedDataParallel on the scenarios of ddp-train/tests/pytorch.rs.

    python reference_ddp.py --out DIR [--scenario NAME ...]

One Python process (torch is imported once) runs every scenario named (all of them when none
is): for each, WORLD forked ranks (gloo, CPU, one thread each) meet through a file store in
DIR/NAME and write to DIR/NAME:

- init.safetensors: the model's initial state_dict (seeded), which the Rust ranks load;
- data.safetensors: every rank's batches, x.{rank}.{step}.{micro} and y.{rank}.{step}.{micro};
- torch.{rank}.safetensors: each rank's final state_dict, and torch.safetensors (rank 0's);
- with a GradScaler (fp16_grad_scaler), torch.{rank}.scales.safetensors: `scales`, the scale
  after each step's `scaler.update()` (float64, one per step; the last is `get_scale()`).

The ranks' parameters must agree bit for bit (checked here); their BatchNorm buffers differ
after the last step, since each rank's last forward updates its own running statistics after
the broadcast, so the Rust test compares rank with rank.
"""

import argparse
import contextlib
import ctypes
import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD = 2
STEPS = 5
BATCH = 8
IN, HIDDEN, OUT = 12, 24, 4
# Small buckets so that the MLP's gradients travel in several (pytorch.rs uses the same).
BUCKET_CAP_BYTES = 1024
PR_SET_PDEATHSIG = 1
SCENARIOS = (
    "plain",
    "accumulate",
    "batch_norm",
    "unused",
    "unused_accumulate",
    "bf16_compress",
    "bf16_autocast",
    "fp16_grad_scaler",
)
# The scenarios of `Branches`, with find_unused_parameters and Adam.
UNUSED = ("unused", "unused_accumulate")
# Forward and loss under CPU autocast to this dtype (backward outside, as recommended).
AUTOCAST = {"bf16_autocast": torch.bfloat16, "fp16_grad_scaler": torch.float16}
# fp16_grad_scaler's GradScaler: PyTorch's default initial scale, and a growth interval short
# enough that the scale grows within STEPS (pytorch.rs uses the same). With these, the scale
# grows after steps 0 and 1, step 2's fp16 gradients overflow (a skipped step, with momentum
# buffers already made, and a backoff), and it grows again after steps 3 and 4.
INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2


class Branches(nn.Module):
    """A trunk, a branch `a` always used, `b` used only by rank 1 on odd steps, `c` never."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(IN, HIDDEN)
        self.a = nn.Linear(HIDDEN, OUT)
        self.b = nn.Linear(HIDDEN, OUT)
        self.c = nn.Linear(HIDDEN, OUT)

    def forward(self, x, use_b):
        h = F.relu(self.trunk(x))
        out = self.a(h)
        if use_b:
            out = out + self.b(h)
        return out


def uses_b(scenario, rank, step, micro):
    if scenario == "unused_accumulate":
        # Rank 1 in the no_sync micro-batch of odd steps, rank 0 in the synced one of step 3:
        # on step 1 only a micro-batch without sync used `b`.
        return (rank == 1 and micro == 0 and step % 2 == 1) or (
            rank == 0 and micro == 1 and step % 4 == 3
        )
    return rank == 1 and step % 2 == 1


def build(scenario):
    if scenario == "batch_norm":
        return nn.Sequential(
            nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)
        )
    if scenario in UNUSED:
        return Branches()
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, OUT),
    )


def micro_batches(scenario):
    return 2 if scenario in ("accumulate", "unused_accumulate") else 1


def prepare(scenario, out):
    """Writes init.safetensors and data.safetensors."""
    torch.manual_seed(20240607)
    model = build(scenario)
    init = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if scenario == "batch_norm":
        # BatchNorm's affine parameters start at 1 and 0: move them so that a mistake in
        # either shows.
        init["1.weight"] = 1.0 + 0.2 * torch.randn(HIDDEN)
        init["1.bias"] = 0.1 * torch.randn(HIDDEN)
    save_file(init, os.path.join(out, "init.safetensors"))
    data = {}
    for rank in range(WORLD):
        for step in range(STEPS):
            for micro in range(micro_batches(scenario)):
                key = f"{rank}.{step}.{micro}"
                # Ranks see different data, with different scales, so that averaging matters.
                data[f"x.{key}"] = torch.randn(BATCH, IN) * (1.0 + rank) + 0.5 * rank
                data[f"y.{key}"] = torch.randn(BATCH, OUT)
    save_file(data, os.path.join(out, "data.safetensors"))


def die_with_parent():
    """Ends this rank when the parent dies (e.g. killed by the Rust test's time limit)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def worker(rank, scenario, out):
    die_with_parent()
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method="file://" + os.path.join(out, "store"),
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    model = build(scenario)
    model.load_state_dict(load_file(os.path.join(out, "init.safetensors")))
    model.train()
    ddp = DDP(
        model,
        bucket_cap_mb=BUCKET_CAP_BYTES / 2**20,
        find_unused_parameters=scenario in UNUSED,
    )
    if scenario == "bf16_compress":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    if scenario in UNUSED:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = None
    if scenario == "fp16_grad_scaler":
        scaler = torch.amp.GradScaler(
            "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL
        )
    scales = []
    data = load_file(os.path.join(out, "data.safetensors"))
    micros = micro_batches(scenario)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(micros):
            x = data[f"x.{rank}.{step}.{micro}"]
            y = data[f"y.{rank}.{step}.{micro}"]

            def backward():
                if scenario in AUTOCAST:
                    autocast = torch.autocast("cpu", dtype=AUTOCAST[scenario])
                else:
                    autocast = contextlib.nullcontext()
                with autocast:
                    if scenario in UNUSED:
                        pred = ddp(x, uses_b(scenario, rank, step, micro))
                    else:
                        pred = ddp(x)
                    assert pred.dtype == AUTOCAST.get(scenario, torch.float32), pred.dtype
                    loss = F.mse_loss(pred, y)
                loss = loss / micros
                if scaler is not None:
                    loss = scaler.scale(loss)
                loss.backward()

            if micro + 1 < micros:
                with ddp.no_sync():
                    backward()
            else:
                backward()
        if scaler is not None:
            # Unscales (skipping the step on inf/NaN), then backs off or counts a good step.
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
    if rank == 0:
        logged = ddp._get_ddp_logging_data()
        sizes = logged.get("rebuilt_bucket_sizes", logged.get("bucket_sizes"))
        print(f"pytorch bucket sizes: {sizes}", flush=True)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out, f"torch.{rank}.safetensors"))
    if scaler is not None:
        print(f"pytorch rank {rank} scales: {scales}", flush=True)
        save_file(
            {"scales": torch.tensor(scales, dtype=torch.float64)},
            os.path.join(out, f"torch.{rank}.scales.safetensors"),
        )
    dist.barrier()
    dist.destroy_process_group()


def run(scenario, out):
    """One scenario: its inputs, its forked ranks, and the check that they agree."""
    os.makedirs(out, exist_ok=True)
    prepare(scenario, out)
    # fork, not spawn: the ranks need not import torch again (seconds on a small machine).
    mp.start_processes(
        worker,
        args=(scenario, out),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    states = [load_file(os.path.join(out, f"torch.{r}.safetensors")) for r in range(WORLD)]
    params = {name for name, _ in build(scenario).named_parameters()}
    for name in sorted(params):
        for rank in range(1, WORLD):
            if not torch.equal(states[0][name], states[rank][name]):
                sys.exit(f"{scenario}: pytorch's ranks 0 and {rank} disagree on {name}")
    save_file(states[0], os.path.join(out, "torch.safetensors"))
    print(f"{scenario}: pytorch ranks agree on {len(params)} parameters", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for scenario in args.scenario:
        run(scenario, os.path.join(args.out, scenario))


if __name__ == "__main__":
    main()
