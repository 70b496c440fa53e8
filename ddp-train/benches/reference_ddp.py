"""PyTorch DDP doing what benches/ddp_steps.rs measures, for a side-by-side table.

N training steps of the ConvNet (the definition in ddp-model/tests/interop.py; with --model
resnet50, torchvision's ResNet-50 with 8 outputs, random tensors only) on the CPU
(Gloo) or with --device cuda on cuda:RANK (NCCL), one process per rank
(torch.multiprocessing), `torch.set_num_threads(1)` per rank, Adam, BCEWithLogitsLoss,
warm-up steps excluded. Random tensors (one fixed batch per rank), or with --data an ODIR
folder (full_df.csv + preprocessed_images/) read through DistributedSampler + DataLoader with
RandomResizedCrop(224, scale=(0.2, 1.0)) + ToTensor. As ddp_steps.rs does, one DataLoader
iterator runs over the epochs' orders (set_epoch 0, 1, ...) back to back, cut to the indices
the steps take, so a batch can span an epoch boundary and the workers decode ahead across
it (a DataLoader prefetches only within one iterator). --workers 0 (the default) is the
seeds' loader (decoding in series with compute); --workers N is PyTorch's fast setting: N worker processes, pin_memory,
persistent_workers, prefetch_factor=4, batches copied with non_blocking. --draft SIZE opens
each JPEG with PIL's `draft("RGB", (SIZE, SIZE))` (reduced-scale DCT decoding).
--precision bf16|fp16 runs forward and loss under `torch.autocast(device_type, dtype)`;
fp16 adds `torch.amp.GradScaler` (scaled backward, then scaler.step + scaler.update, timed
as the optimizer phase), as ddp_steps.rs does with ddp-train's Precision and GradScaler.

Prints per world size one line per rank:

    RESULT reference_ddp source=random world=2 rank=0 ... images_per_sec=14.1 ...
        ... torch=2.13.0 precision=bf16 model=convnet loss_scale=1 skipped_steps=0 \
        loader_iterators=0

(loader_iterators: how many DataLoader iterators the run made; 1 with --data.)

Usage: python reference_ddp.py [--ranks 1,2] [--data DIR] [--warmup 3] [--steps 12]
       [--device cpu|cuda] [--workers N] [--draft SIZE] [--precision fp32|bf16|fp16]
       [--model convnet|resnet50]
"""

import argparse
import contextlib
import csv
import importlib.util
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]


def convnet_class():
    """The PyTorch ConvNet that ddp-model equals, tensor for tensor."""
    path = ROOT / "ddp-model" / "tests" / "interop.py"
    spec = importlib.util.spec_from_file_location("ddp_model_interop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ConvNet


def build_model(name):
    """The network `ddp_steps --model NAME` trains, with 8 outputs."""
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(num_classes=8)
    return convnet_class()()


# torch.amp.GradScaler's default initial scale (ddp-train's GradScaler uses the same).
INITIAL_SCALE = 65536.0
# Its default growth interval: fewer steps than this never grow the scale.
GROWTH_INTERVAL = 2000


class OdirFolder(torch.utils.data.Dataset):
    """The redistribution layout: full_df.csv rows, images in preprocessed_images/."""

    def __init__(self, root, transform, draft=None):
        self.draft = draft
        self.root = Path(root)
        with open(self.root / "full_df.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        self.items = [(r["filename"], json.loads(r["target"])) for r in rows]
        self.transform = transform

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        # Imported here, not kept on self: a DataLoader worker gets the dataset pickled, and
        # a module cannot be.
        from PIL import Image

        name, target = self.items[i]
        img = Image.open(self.root / "preprocessed_images" / name)
        if self.draft:
            img.draft("RGB", (self.draft, self.draft))
        return self.transform(img), torch.tensor(target, dtype=torch.float32)


class CountedLoader(torch.utils.data.DataLoader):
    """A DataLoader that counts the iterators made over it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.iterators = 0

    def __iter__(self):
        self.iterators += 1
        return super().__iter__()


class ChainedEpochs(torch.utils.data.Sampler):
    """`sampler`'s orders of epochs 0, 1, ... back to back, cut to `count` indices: the
    stream ddp_steps.rs gives its one loader."""

    def __init__(self, sampler, count):
        self.sampler = sampler
        self.count = count

    def __len__(self):
        return self.count

    def __iter__(self):
        left, epoch = self.count, 0
        while left > 0:
            self.sampler.set_epoch(epoch)
            order = list(self.sampler)[:left]
            yield from order
            left -= len(order)
            epoch += 1


def batches(args, rank, world, device, loaders):
    """(images, labels) batches for this rank, on `device`: endless for random tensors,
    warm-up + timed steps' worth with --data. Appends the loader it makes to `loaders`."""
    if args.data is None:
        x = torch.rand(args.batch_size, 3, args.image_size, args.image_size, device=device)
        y = (torch.rand(args.batch_size, 8, device=device) < 0.5).float()
        while True:
            yield x, y
    import torchvision.transforms as T

    transform = T.Compose([T.RandomResizedCrop(args.image_size, scale=(0.2, 1.0)), T.ToTensor()])
    dataset = OdirFolder(args.data, transform, args.draft)
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    if len(sampler) == 0:
        raise ValueError(f"{args.data} holds no image for rank {rank}")
    chained = ChainedEpochs(sampler, (args.warmup + args.steps) * args.batch_size)
    fast = {}
    if args.workers > 0:
        fast = dict(num_workers=args.workers, pin_memory=device.type == "cuda",
                    persistent_workers=True, prefetch_factor=4)
    loader = CountedLoader(
        dataset, batch_size=args.batch_size, sampler=chained, drop_last=True, **fast)
    loaders.append(loader)
    for x, y in loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def worker(rank, world, port, args):
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(rank)
    model = build_model(args.model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = nn.BCEWithLogitsLoss()
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None

    def autocast():
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    loaders = []
    data = batches(args, rank, world, device, loaders)
    phases = {"data": [], "compute": [], "optim": [], "step": []}
    started = time.perf_counter()
    loss = float("nan")
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            started = time.perf_counter()
        t0 = time.perf_counter()
        x, y = next(data)
        t1 = time.perf_counter()
        optimizer.zero_grad()
        with autocast():
            out = model(x)
            l = criterion(out, y)
        # DDP's gradient all-reduce runs inside backward
        if scaler is None:
            l.backward()
        else:
            scaler.scale(l).backward()
        loss = l.item()
        t2 = time.perf_counter()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)  # unscale_, then step unless a gradient is inf/NaN
            scaler.update()
        t3 = time.perf_counter()
        if step >= args.warmup:
            phases["data"].append(t1 - t0)
            phases["compute"].append(t2 - t1)
            phases["optim"].append(t3 - t2)
            phases["step"].append(t3 - t0)
    elapsed = time.perf_counter() - started
    images = world * args.batch_size * args.steps
    dist.barrier()
    med = {k: statistics.median(v) for k, v in phases.items()}
    scale = 1.0 if scaler is None else scaler.get_scale()
    # Without growth (fewer steps than the growth interval) every skipped step halved the
    # scale; counting them in the loop would need a device sync per step.
    skipped = 0
    if scaler is not None and args.warmup + args.steps < GROWTH_INTERVAL:
        skipped = round(math.log2(INITIAL_SCALE / scale))
    elif scaler is not None:
        skipped = -1  # unknown
    line = (
        f"RESULT reference_ddp source={'random' if args.data is None else 'jpeg'} "
        f"device={args.device} world={world} rank={rank} threads={args.threads} "
        f"workers={args.workers} draft={args.draft or 0} batch={args.batch_size} "
        f"size={args.image_size} warmup={args.warmup} steps={args.steps} "
        f"images_per_sec={images / elapsed:.4f} elapsed_s={elapsed:.4f} "
        f"step_median_s={med['step']:.5f} data_median_s={med['data']:.5f} "
        f"compute_median_s={med['compute']:.5f} optim_median_s={med['optim']:.6f} "
        f"loss={loss:.5f} torch={torch.__version__} precision={args.precision} "
        f"model={args.model} loss_scale={scale:g} skipped_steps={skipped} "
        f"loader_iterators={sum(l.iterators for l in loaders)}\n"
    )
    # One write per line: ranks share stdout, and print() writes the text and the newline
    # separately, so two ranks' lines could interleave.
    sys.stdout.write(line)
    sys.stdout.flush()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--data", default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--draft", type=int, default=None)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--model", choices=["convnet", "resnet50"], default="convnet")
    args = parser.parse_args()
    if args.model != "convnet" and args.data is not None:
        parser.error(f"--model {args.model}: --data feeds ODIR's JPEGs to the ConvNet only; "
                     "drop --data (random tensors) or use --model convnet")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    for world in (int(r) for r in args.ranks.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(world, port, args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
