"""torchvision reference for benches/pipeline.rs: one thread, RandomResizedCrop(224,
scale=(0.2, 1.0)) + ToTensor on the given JPEGs, with PIL's default decode and with
`draft` (reduced-size DCT decode). Prints `mode size img_per_s` lines.

Usage: python reference_pipeline.py IMAGE.jpg [IMAGE.jpg ...]
Images are grouped by width; each group is timed for about 3 CPU-seconds per mode.
"""

import sys
import time

import torch
from PIL import Image
import torchvision.transforms as T


def rate(paths, draft, seconds=3.0):
    """Images per CPU-second of this thread (time.thread_time), like the Rust side."""
    transform = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0)), T.ToTensor()])
    transform(Image.open(paths[0]))  # warm up
    n = 0
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        img = Image.open(paths[n % len(paths)])
        if draft:
            img.draft("RGB", (224, 224))
        transform(img)
        n += 1
    return n / (time.thread_time() - start)


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    groups = {}
    for path in sys.argv[1:]:
        with Image.open(path) as img:
            width = img.size[0]
        groups.setdefault(width, []).append(path)
    for width, paths in sorted(groups.items()):
        for mode, draft in (("default", False), ("draft", True)):
            print(f"{mode} {width} {rate(paths, draft):.1f}", flush=True)


if __name__ == "__main__":
    main()
