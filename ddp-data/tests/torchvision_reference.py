"""torchvision reference for tests/torchvision.rs: applies torchvision's transforms (PIL path)
with given parameters to an image and writes each result as raw CHW bytes.

    python torchvision_reference.py IMAGE CASES OUT_DIR

CASES has one case per line: `name op args... | op args... | ...`, with the ops
  raw FILE SIZE                         start from FILE's SIZE x SIZE CHW bytes instead
  decoded                               the image as PIL decodes it, untransformed
  resize_centre_crop RESIZE CROP [bicubic]  Resize(RESIZE) + CenterCrop(CROP), bilinear unless
                                        `bicubic` follows
  resized_crop TOP LEFT H W SIZE        F.resized_crop (bilinear, antialias)
  hflip | vflip                         F.hflip, F.vflip
  rotate DEGREES                        F.rotate (nearest, no expand, fill 0), RandomRotation's
  brightness F | contrast F | saturation F   F.adjust_*
  to_tensor_normalize M0 M1 M2 S0 S1 S2 ToTensor + Normalize(mean, std): written as float32
"""

import sys

import numpy as np
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F
from PIL import Image


def apply(img, op, args):
    if op == "raw":
        size = int(args[1])
        chw = np.fromfile(args[0], dtype=np.uint8).reshape(3, size, size)
        return Image.fromarray(np.ascontiguousarray(chw.transpose(1, 2, 0)), "RGB")
    if op == "decoded":
        return img
    if op == "resize_centre_crop":
        resize, crop = int(args[0]), int(args[1])
        mode = T.InterpolationMode.BICUBIC if args[2:] == ["bicubic"] else T.InterpolationMode.BILINEAR
        return T.Compose([T.Resize(resize, interpolation=mode), T.CenterCrop(crop)])(img)
    if op == "resized_crop":
        top, left, h, w, size = map(int, args)
        return F.resized_crop(img, top, left, h, w, [size, size],
                              T.InterpolationMode.BILINEAR, antialias=True)
    if op == "hflip":
        return F.hflip(img)
    if op == "vflip":
        return F.vflip(img)
    if op == "rotate":
        return F.rotate(img, float(args[0]), T.InterpolationMode.NEAREST, False, None, 0)
    if op == "brightness":
        return F.adjust_brightness(img, float(args[0]))
    if op == "contrast":
        return F.adjust_contrast(img, float(args[0]))
    if op == "saturation":
        return F.adjust_saturation(img, float(args[0]))
    if op == "to_tensor_normalize":
        mean, std = [float(a) for a in args[:3]], [float(a) for a in args[3:6]]
        return T.Normalize(mean, std)(T.ToTensor()(img))
    raise ValueError(f"unknown op {op}")


def main():
    image, cases, out = sys.argv[1:4]
    source = Image.open(image).convert("RGB")
    for line in open(cases):
        name, _, rest = line.strip().partition(" ")
        img = source
        for step in rest.split("|"):
            words = step.split()
            img = apply(img, words[0], words[1:])
        if isinstance(img, torch.Tensor):
            data = img.numpy().astype("<f4").tobytes()
        else:
            chw = np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)
            data = np.ascontiguousarray(chw).tobytes()
        with open(f"{out}/{name}.bin", "wb") as f:
            f.write(data)
    print("ok")


if __name__ == "__main__":
    main()
