//! torchvision's `resnet18`, `resnet34`, `resnet50` and `efficientnet_b0` against ours: the
//! same state-dict names, shapes and dtypes, and from torchvision's weights (loaded by
//! name) the same evaluation-mode logits within 1e-4. Runs the Python of `cargo xtask setup`
//! (`tests/vision_reference.py`) once for all four.

use std::path::Path;

use ddp_model::norm::BatchNormLayers;
use ddp_model::{checkpoint, weights, Model, ModelKind};
use tch::{nn, Device, Kind, Tensor};

const TOLERANCE: f64 = 1e-4;

const KINDS: [ModelKind; 4] = [
    ModelKind::Resnet18,
    ModelKind::Resnet34,
    ModelKind::Resnet50,
    ModelKind::EfficientNetB0,
];

fn torchvision_reference(dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vision_reference.py");
    let out = ddp_testkit::setup_python()
        .arg(script)
        .arg(dir)
        .args(KINDS.map(|k| k.name()))
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "vision_reference.py failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Sorted (name, shape, dtype) of every tensor.
fn layout<'a>(tensors: impl Iterator<Item = (&'a String, &'a Tensor)>) -> Vec<String> {
    let mut v: Vec<String> = tensors
        .map(|(n, t)| format!("{n} {:?} {:?}", t.size(), t.kind()))
        .collect();
    v.sort();
    v
}

#[test]
fn backbones_equal_torchvision_by_name_and_in_evaluation() {
    tch::set_num_threads(1);
    let tmp = ddp_testkit::temp_dir("ddp-model-vision");
    let dir = tmp.path();
    torchvision_reference(dir);
    for kind in KINDS {
        let vs = nn::VarStore::new(Device::Cpu);
        let (model, norms) = BatchNormLayers::collect(|| Model::new(&vs.root(), kind, 8, None));
        assert_eq!(model.kind(), kind);
        let weights = dir.join(format!("{kind}.safetensors"));
        let file = checkpoint::read_tensors(&weights).unwrap();
        let ours = vs.variables();
        assert_eq!(
            layout(ours.iter()),
            layout(file.tensors.iter()),
            "{kind}: names, shapes or dtypes differ from torchvision's state_dict"
        );
        // Every BatchNorm of torchvision's model is one of ours that SyncBatchNorm can switch.
        let bn_count = file
            .tensors
            .keys()
            .filter(|n| n.ends_with(".num_batches_tracked"))
            .count();
        assert_eq!(norms.len(), bn_count, "{kind}");
        checkpoint::load(&vs, &weights).unwrap();
        let io = checkpoint::read_tensors(dir.join(format!("{kind}.io.safetensors"))).unwrap();
        let logits = tch::no_grad(|| model.forward_t(&io.tensors["input"], false));
        let want = &io.tensors["logits"];
        assert_eq!(logits.size(), [2, 8]);
        let diff = (&logits - want).abs().max().double_value(&[]);
        let scale = want.abs().max().double_value(&[]);
        println!("{kind}: max |ours - torchvision| = {diff:.3e} (logits up to {scale:.3})");
        assert!(diff <= TOLERANCE, "{kind}: logits differ by {diff}");
        assert!(
            scale > 1e-2,
            "{kind}: logits too small to compare ({scale})"
        );
    }
}

/// In training, BatchNorm uses the batch's statistics and counts the batch, EfficientNet's
/// stochastic depth and dropout draw from libtorch's generator (so a seed repeats them), and
/// the running statistics move; evaluation stays deterministic.
#[test]
fn training_mode_is_seeded_and_updates_running_statistics() {
    tch::set_num_threads(1);
    for kind in [ModelKind::Resnet18, ModelKind::EfficientNetB0] {
        tch::manual_seed(1);
        let vs = nn::VarStore::new(Device::Cpu);
        let model = Model::new(&vs.root(), kind, 3, None);
        let x = Tensor::rand([4, 3, 32, 32], (Kind::Float, Device::Cpu));
        let stem_bn = match kind {
            ModelKind::Resnet18 => "bn1",
            _ => "features.0.1",
        };
        let count = vs.variables()[&format!("{stem_bn}.num_batches_tracked")].shallow_clone();
        let e1 = tch::no_grad(|| model.forward_t(&x, false));
        tch::manual_seed(7);
        let t1 = tch::no_grad(|| model.forward_t(&x, true));
        tch::manual_seed(7);
        let t2 = tch::no_grad(|| model.forward_t(&x, true));
        assert_eq!(count.int64_value(&[]), 2, "{kind}");
        // The same seed, the same draws, the same batch statistics.
        assert!(t1.equal(&t2), "{kind}: training forward is not repeatable");
        let e2 = tch::no_grad(|| model.forward_t(&x, false));
        assert!(!e1.equal(&e2), "{kind}: running statistics did not move");
        assert!(e2.equal(&tch::no_grad(|| model.forward_t(&x, false))));
    }
}

/// The initial weights follow torchvision's schemes: He-normal (fan-out) convolutions, unit
/// BatchNorm weights, and each family's linear layer.
#[test]
fn initialisation_follows_torchvision() {
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let _resnet = Model::new(&vs.root(), ModelKind::Resnet50, 10, None);
    let v = vs.variables();
    let std = |t: &Tensor| t.std(true).double_value(&[]);
    // layer3.0.conv2: 256 outputs of 3x3, fan-out 2304, std sqrt(2 / 2304).
    let want = (2.0f64 / 2304.0).sqrt();
    let got = std(&v["layer3.0.conv2.weight"]);
    assert!((got / want - 1.0).abs() < 0.02, "conv std {got} vs {want}");
    assert!(v["layer1.0.bn3.weight"].eq(1.0).all().int64_value(&[]) == 1);
    assert_eq!(
        v["layer1.0.bn3.bias"]
            .abs()
            .sum(Kind::Float)
            .double_value(&[]),
        0.0
    );
    // fc: nn.Linear's uniform in ±1/sqrt(2048), bias too.
    let bound = 1.0 / 2048f64.sqrt();
    for name in ["fc.weight", "fc.bias"] {
        let max = v[name].abs().max().double_value(&[]);
        assert!(
            max <= bound && max > 0.9 * bound,
            "{name}: {max} vs {bound}"
        );
    }
    let vs = nn::VarStore::new(Device::Cpu);
    let _b0 = Model::new(&vs.root(), ModelKind::EfficientNetB0, 10, None);
    let v = vs.variables();
    // classifier.1: uniform in ±1/sqrt(num_classes), zero bias; SE biases zero.
    let max = v["classifier.1.weight"].abs().max().double_value(&[]);
    let bound = 1.0 / 10f64.sqrt();
    assert!(
        max <= bound && max > 0.9 * bound,
        "classifier: {max} vs {bound}"
    );
    for name in ["classifier.1.bias", "features.2.0.block.2.fc1.bias"] {
        assert_eq!(
            v[name].abs().sum(Kind::Float).double_value(&[]),
            0.0,
            "{name}"
        );
    }
    // The depthwise 5x5 of features.3.0 (144 channels): fan-out 144 * 25.
    let want = (2.0f64 / (144.0 * 25.0)).sqrt();
    let got = std(&v["features.3.0.block.1.0.weight"]);
    assert!(
        (got / want - 1.0).abs() < 0.05,
        "depthwise std {got} vs {want}"
    );
}

/// Fine-tuning B0 on 8 classes from a 1000-class state_dict: the partial load leaves out
/// `classifier.1`, which then gets a new `nn.Linear(1280, 8)`'s initialisation, uniform in
/// ±1/√1280 with a bias drawn alike (torchvision's recipe replaces the head), not B0's
/// from-scratch ±1/√8 with a zero bias. What was loaded stays the file's.
#[test]
fn a_partially_loaded_efficientnet_gets_a_fine_tuning_head() {
    tch::manual_seed(5);
    let pretrained = nn::VarStore::new(Device::Cpu);
    let b0_1000 = Model::new(&pretrained.root(), ModelKind::EfficientNetB0, 1000, None);
    let file = weights::StateDict::new("imagenet.pth", checkpoint::named_tensors(&pretrained));
    let vs = nn::VarStore::new(Device::Cpu);
    let model = Model::new(&vs.root(), ModelKind::EfficientNetB0, 8, None);
    let report = weights::load_state_dict(&vs, &file, weights::Strictness::Partial).unwrap();
    assert_eq!(report.mismatched.len(), 2);

    let drawn = model.init_unloaded(&report);
    assert_eq!(drawn, ["classifier.1.weight", "classifier.1.bias"]);
    let v = vs.variables();
    let bound = 1.0 / 1280f64.sqrt();
    for name in drawn {
        let max = v[&name].abs().max().double_value(&[]);
        assert!(
            max <= bound && max > 0.5 * bound,
            "{name}: {max} vs {bound}"
        );
    }
    assert_eq!(v["classifier.1.weight"].size(), [8, 1280]);
    for name in &report.loaded {
        assert!(v[name].equal(file.get(name).unwrap()), "{name}");
    }

    // A load that holds the head leaves it as loaded; the other models' heads are nn.Linear's.
    let strict = weights::load_state_dict(&pretrained, &file, weights::Strictness::Strict);
    assert!(b0_1000.init_unloaded(&strict.unwrap()).is_empty());
    let resnet = nn::VarStore::new(Device::Cpu);
    let r18 = Model::new(&resnet.root(), ModelKind::Resnet18, 8, None);
    assert!(r18.init_unloaded(&report).is_empty());
}

/// torchvision's ImageNet files have no BatchNorm counters: which model they hold is named
/// all the same.
#[test]
fn a_file_without_batch_norm_counters_is_named_by_its_model() {
    for kind in [ModelKind::Resnet18, ModelKind::Resnet50] {
        let vs = nn::VarStore::new(Device::Cpu);
        let _model = Model::new(&vs.root(), kind, 8, None);
        let names: Vec<String> = checkpoint::named_tensors(&vs)
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| !n.ends_with("num_batches_tracked"))
            .collect();
        assert_eq!(
            ModelKind::holding(names.iter().map(String::as_str)),
            Some(kind)
        );
    }
}
