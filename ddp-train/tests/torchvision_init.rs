//! A torchvision `resnet18(num_classes=8)` saved by `torch.save`, from a plain model and from
//! a DDP-wrapped one (`module.` names), becomes the Trainer's model through the `init_from`
//! setting (`--init-from`): in evaluation mode its logits equal torchvision's on the same
//! input.

mod common;

use std::path::{Path, PathBuf};

use common::free_port;
use ddp_model::{Model, ModelKind};
use ddp_train::{CheckpointSettings, NoStats, Settings, Trainer};
use tch::{nn, Kind, Tensor};

/// How far our logits may be from torchvision's.
const TOLERANCE: f64 = 1e-4;

/// Writes `plain.pth`, `ddp.pth` and `reference.safetensors` (an input `x` and torchvision's
/// evaluation logits for it) into `dir`. The BatchNorm running statistics are drawn away
/// from their initial 0 and 1, so that evaluation mode depends on them.
fn torchvision_files(dir: &Path) {
    let script = r#"
import sys, torch, torchvision
from collections import OrderedDict
from safetensors.torch import save_file
out = sys.argv[1]
torch.manual_seed(0)
m = torchvision.models.resnet18(num_classes=8)
with torch.no_grad():
    for mod in m.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.2, 0.2)
            mod.running_var.uniform_(0.5, 1.5)
            mod.weight.uniform_(0.5, 1.5)
            mod.bias.uniform_(-0.2, 0.2)
m.eval()
torch.save(m.state_dict(), out + "/plain.pth")
torch.save(OrderedDict(("module." + k, v) for k, v in m.state_dict().items()), out + "/ddp.pth")
x = torch.rand(2, 3, 64, 64)
with torch.no_grad():
    logits = m(x)
save_file({"x": x, "logits": logits.contiguous()}, out + "/reference.safetensors")
"#;
    let out = ddp_testkit::setup_python()
        .args(["-c", script])
        .arg(dir)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "the torchvision script failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// torchvision's ResNet-18 with 8 classes, trained on nothing: only its start matters here.
#[derive(Debug, Clone)]
struct Backbone;

impl ddp_train::Task for Backbone {
    type Model = Model;
    type Data = ddp_data::TensorDataset;
    type Stats = NoStats;

    fn model(&self, root: &nn::Path) -> Model {
        Model::new(root, ModelKind::Resnet18, 8, None)
    }

    fn train_data(&self) -> Self::Data {
        let x = Tensor::zeros([4, 3, 32, 32], (Kind::Float, tch::Device::Cpu));
        let y = Tensor::zeros([4, 8], (Kind::Float, tch::Device::Cpu));
        ddp_data::TensorDataset::from_tensors(&x, &y).unwrap()
    }

    fn train_loss(&self, model: &Model, batch: &ddp_data::Batch) -> Tensor {
        model
            .forward_t(batch.inputs(), true)
            .mse_loss(batch.targets(), tch::Reduction::Mean)
    }

    fn new_stats(&self) -> NoStats {
        NoStats
    }

    fn eval_batch(&self, _: &Model, _: &ddp_data::Batch, _: &mut NoStats) -> Tensor {
        Tensor::from(0.0f32)
    }
}

/// The Trainer's model started from `file`, run in evaluation mode on `x`.
fn logits_after_init(file: PathBuf, out: &Path, x: &Tensor) -> Tensor {
    let settings = Settings::default()
        .batch_size(2)
        .out(Some(out.to_path_buf()))
        .checkpoint(CheckpointSettings::default().init_from(Some(file)));
    let env = ddp_comm::EnvConfig::new(0, 1, "127.0.0.1", free_port());
    let trainer = Trainer::with_env(Backbone, settings, &env).unwrap();
    tch::no_grad(|| trainer.model().forward_t(x, false))
}

#[test]
fn a_torchvision_resnet18_saved_by_torch_save_gives_torchvision_logits_through_init_from() {
    let tmp = common::temp_dir("ddp-train-torchvision-init");
    torchvision_files(tmp.path());
    let reference =
        ddp_model::checkpoint::read_tensors(tmp.path().join("reference.safetensors")).unwrap();
    let get = |name: &str| reference.tensors[name].shallow_clone();
    let (x, expected) = (get("x"), get("logits"));
    assert_eq!(expected.size(), [2, 8]);
    for name in ["plain.pth", "ddp.pth"] {
        let out = tmp.path().join(format!("run-{name}"));
        let logits = logits_after_init(tmp.path().join(name), &out, &x);
        let diff = (&logits - &expected).abs().max().double_value(&[]);
        assert!(
            diff <= TOLERANCE,
            "{name}: logits differ from torchvision's by {diff}"
        );
        // The file's weights, not the seed's: a freshly built model is far away.
        tch::manual_seed(7);
        let fresh = nn::VarStore::new(tch::Device::Cpu);
        let model = Model::new(&fresh.root(), ModelKind::Resnet18, 8, None);
        let far = (tch::no_grad(|| model.forward_t(&x, false)) - &expected)
            .abs()
            .max()
            .double_value(&[]);
        assert!(
            far > 100.0 * TOLERANCE,
            "{name}: a fresh model is as close ({far})"
        );
    }
}
