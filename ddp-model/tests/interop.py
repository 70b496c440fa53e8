"""PyTorch side of ddp-model's interoperability test.

Usage:
  interop.py check  CKPT IO   load CKPT (written by Rust) into the PyTorch ConvNet with
                              strict=True, run IO's `input` in eval mode and compare with IO's
                              `output` (Rust's); print the max abs difference; exit 1 if > 1e-4
  interop.py export CKPT IO   build the PyTorch ConvNet, update its BatchNorm statistics with a
                              few training-mode passes, save CKPT, and save a fixed `input` and
                              PyTorch's eval-mode `output` to IO for Rust to check
"""
import sys

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

TOLERANCE = 1e-4


class ConvNet(nn.Module):
    """The definition ddp-model must equal, tensor for tensor."""

    def __init__(self, num_classes=8, dropout_prob=0.5):
        super().__init__()

        def block(cin, cout):
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                    nn.ReLU(), nn.MaxPool2d(2)]

        self.features = nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128),
                                      *block(128, 256))
        self.classifier = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                        nn.Dropout(dropout_prob), nn.Linear(256, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def check(ckpt, io):
    model = ConvNet()
    model.load_state_dict(load_file(ckpt), strict=True)
    model.eval()
    tensors = load_file(io)
    with torch.no_grad():
        out = model(tensors["input"])
    diff = (out - tensors["output"]).abs().max().item()
    print(f"max_abs_diff {diff:.3e}")
    return 0 if diff <= TOLERANCE else 1


def export(ckpt, io):
    torch.manual_seed(1234)
    model = ConvNet()
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.rand(4, 3, 40, 40) * 2.0 + 0.5)
    model.eval()
    save_file(model.state_dict(), ckpt)
    x = torch.rand(3, 3, 48, 40)
    with torch.no_grad():
        out = model(x)
    save_file({"input": x.contiguous(), "output": out.contiguous()}, io)
    print(f"exported {len(model.state_dict())} tensors")
    return 0


if __name__ == "__main__":
    mode, ckpt, io = sys.argv[1:4]
    sys.exit({"check": check, "export": export}[mode](ckpt, io))
