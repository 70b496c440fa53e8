"""torchvision's reference for tests/vision.rs: for each model named on the command line,
builds it with 8 classes, moves its BatchNorm statistics and weights away from their initial
values, and writes `<dir>/<name>.safetensors` (its state_dict) and `<dir>/<name>.io.safetensors`
(an input and the model's eval-mode logits)."""

import sys

import torch
import torchvision
from safetensors.torch import save_file

torch.set_num_threads(1)
out = sys.argv[1]
for k, name in enumerate(sys.argv[2:]):
    torch.manual_seed(100 + k)
    model = getattr(torchvision.models, name)(num_classes=8)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                c = m.num_features
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.num_batches_tracked.fill_(7 + k)
    model.eval()
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    save_file(state, f"{out}/{name}.safetensors")
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        y = model(x)
    save_file({"input": x, "logits": y}, f"{out}/{name}.io.safetensors")
