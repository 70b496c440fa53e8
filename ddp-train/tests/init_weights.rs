//! `--init-from` with real ranks: two CPU ranks start from a PyTorch-saved `.pth`, a file that
//! does not fit fails on both ranks naming it, `--init-partial` keeps a new head (EfficientNet's
//! with `nn.Linear`'s initialisation), and a resume takes precedence over the file; a training
//! checkpoint with two state_dicts needs `--init-key`.

mod common;

use common::{assert_all_ok, run_ddp_train, text, Limits};

use std::path::{Path, PathBuf};
use std::process::Output;

use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_model::{checkpoint, ConvNet, ConvNetConfig, Model, ModelKind};
use serde_json::Value;
use tch::{nn, Device};

/// The ConvNet with `classes` outputs, seeded by `seed`, saved by PyTorch's `torch.save` with
/// `prefix` before every name (`module.` for a DDP model's state_dict) to `dir/name`; returns
/// the path and the tensors as written.
fn pytorch_file(
    dir: &Path,
    name: &str,
    classes: i64,
    seed: i64,
    prefix: &str,
) -> (PathBuf, checkpoint::TensorFile) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let _ = ConvNet::new(
        &vs.root(),
        ConvNetConfig {
            num_classes: classes,
            dropout: 0.5,
        },
    );
    let st = dir.join(format!("{name}.safetensors"));
    checkpoint::save(&vs, &st, &Default::default()).unwrap();
    let pth = dir.join(name);
    let script = format!(
        "import sys, torch\nfrom collections import OrderedDict\n\
         from safetensors.torch import load_file\n\
         sd = load_file(sys.argv[1])\n\
         torch.save(OrderedDict(('{prefix}' + k, v) for k, v in sd.items()), sys.argv[2])\n"
    );
    let out = ddp_testkit::setup_python()
        .args(["-c", &script])
        .arg(&st)
        .arg(&pth)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "torch.save failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tensors = checkpoint::read_tensors(&st).unwrap();
    std::fs::remove_file(&st).unwrap();
    (pth, tensors)
}

fn data(dir: &Path) -> PathBuf {
    let root = dir.join("data");
    generate(
        &root,
        &SyntheticConfig {
            images: 40,
            size: 48,
            seed: 5,
            ..Default::default()
        },
    )
    .unwrap();
    root
}

fn run_ranks(world: usize, args: &[&str]) -> Vec<Output> {
    run_ddp_train(world, args, &[], Limits::SHORT)
}

/// One short epoch whose optimizer steps change no weight by more than [`UNMOVED`] (SGD at
/// 1e-30, no decay or momentum): what it saves is what it started from, except BatchNorm's
/// running statistics.
fn args<'a>(data: &'a str, out: &'a str, epochs: &'a str) -> Vec<&'a str> {
    vec![
        "--data",
        data,
        "--epochs",
        epochs,
        "--max-steps-per-epoch",
        "2",
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--optimizer",
        "sgd",
        "--lr",
        "1e-30",
        "--momentum",
        "0",
        "--weight-decay",
        "0",
        "--seed",
        "3",
        "--out",
        out,
    ]
}

/// How far SGD at 1e-30 may move a weight; seeds give weights that differ by far more.
const UNMOVED: f64 = 1e-12;

fn same_weights(a: &tch::Tensor, b: &tch::Tensor) -> bool {
    a.size() == b.size() && (a - b).abs().max().double_value(&[]) <= UNMOVED
}

fn is_statistic(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var") || name.ends_with("tracked")
}

#[test]
fn two_ranks_start_from_a_pytorch_pth_and_a_resume_takes_precedence() {
    let tmp = common::temp_dir("ddp-train-init-from");
    let dir = tmp.path();
    let data = data(dir);
    let data_s = data.to_str().unwrap();
    // Saved from a DDP model, with weights the run's seed would not give.
    let (pth, file) = pytorch_file(dir, "pretrained.pth", 8, 99, "module.");
    let out = dir.join("run");
    let out_s = out.to_str().unwrap();
    let mut first = args(data_s, out_s, "1");
    first.extend(["--init-from", pth.to_str().unwrap()]);
    let outputs = run_ranks(2, &first);
    assert_all_ok(&outputs);
    let log = text(&outputs[0]);
    assert!(
        log.contains(&format!(
            "initial weights from {}: loaded 26 tensors (names without their 'module.' prefix)",
            pth.display()
        )),
        "{log}"
    );

    // Every weight of the saved model is the file's; the statistics moved.
    let saved = checkpoint::read_tensors(out.join("checkpoints/epoch-0001.safetensors")).unwrap();
    assert_eq!(saved.tensors.len(), 26);
    let mut compared = 0;
    for (name, t) in &file.tensors {
        if is_statistic(name) {
            continue;
        }
        assert!(
            same_weights(t, &saved.tensors[name]),
            "{name} is not the file's"
        );
        compared += 1;
    }
    assert_eq!(compared, 14);
    let mean = "features.1.running_mean";
    assert!(
        !file.tensors[mean].equal(&saved.tensors[mean]),
        "no step ran"
    );

    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["init_weights"]["loaded"], true, "{config}");
    assert_eq!(config["init_weights"]["tensors_loaded"], 26);
    assert_eq!(config["init_weights"]["file"], pth.to_str().unwrap());
    assert_eq!(
        config["settings"]["checkpoint"]["init_from"],
        pth.to_str().unwrap()
    );

    // Continuing the run: the checkpoint wins, and the file (now unreadable) is not read.
    std::fs::write(&pth, b"no longer weights").unwrap();
    let mut resume = args(data_s, out_s, "2");
    resume.extend(["--resume", "latest", "--init-from", pth.to_str().unwrap()]);
    let outputs = run_ranks(2, &resume);
    assert_all_ok(&outputs);
    let log = text(&outputs[0]);
    assert!(
        log.contains(&format!(
            "initial weights {} not loaded: resuming from",
            pth.display()
        )) && log.contains("takes precedence"),
        "{log}"
    );
    assert!(!text(&outputs[1]).contains("initial weights"));
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    // The record of the weights the run started from stays, and says where it resumed.
    assert_eq!(config["init_weights"]["loaded"], true, "{config}");
    assert_eq!(config["init_weights"]["file"], pth.to_str().unwrap());
    let from = out.join("checkpoints/epoch-0001.safetensors");
    assert_eq!(config["resumed_from"], from.to_str().unwrap());
}

/// A file of another model (a ResNet-18's weights for the ConvNet) names that model and the
/// flag that builds it, not a partial load of the few tensors that would fit.
#[test]
fn a_file_of_another_model_names_the_model_to_build() {
    let tmp = common::temp_dir("ddp-train-init-other-model");
    let dir = tmp.path();
    let data = data(dir);
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = Model::new(&vs.root(), ModelKind::Resnet18, 8, None);
    let file = dir.join("resnet18.safetensors");
    checkpoint::save(&vs, &file, &Default::default()).unwrap();
    let out = dir.join("run");
    let mut a = args(data.to_str().unwrap(), out.to_str().unwrap(), "1");
    a.extend(["--init-from", file.to_str().unwrap()]);
    let outputs = run_ranks(1, &a);
    let t = text(&outputs[0]);
    assert!(!outputs[0].status.success(), "{t}");
    assert!(
        t.contains("; the file holds a resnet18 model: ")
            && t.contains(
                ": build that model to start from its weights (ddp-train's --model resnet18)"
            )
            && !t.contains("--init-partial"),
        "{t}"
    );
}

#[test]
fn a_file_that_does_not_fit_fails_on_every_rank_and_partial_keeps_the_head() {
    let tmp = common::temp_dir("ddp-train-init-partial");
    let dir = tmp.path();
    let data = data(dir);
    let data_s = data.to_str().unwrap();
    let (pth, file) = pytorch_file(dir, "imagenet-head.pth", 1000, 41, "");
    let pth_s = pth.to_str().unwrap();

    let out = dir.join("strict");
    let mut strict = args(data_s, out.to_str().unwrap(), "1");
    strict.extend(["--init-from", pth_s]);
    let outputs = run_ranks(2, &strict);
    for (r, o) in outputs.iter().enumerate() {
        let t = text(o);
        assert!(!o.status.success(), "rank {r} should have failed:\n{t}");
        assert!(
            t.contains(&format!("weights file '{pth_s}' does not fit the model"))
                && t.contains("'classifier.3.weight' has shape [1000, 256] in the checkpoint")
                && t.contains("; to load what fits, set --init-partial"),
            "rank {r}:\n{t}"
        );
        assert!(!t.contains("epoch 1/"), "rank {r} started training:\n{t}");
    }

    let out = dir.join("partial");
    let mut partial = args(data_s, out.to_str().unwrap(), "1");
    partial.extend(["--init-from", pth_s, "--init-partial"]);
    let outputs = run_ranks(2, &partial);
    assert_all_ok(&outputs);
    let log = text(&outputs[0]);
    assert!(
        log.contains(
            "loaded 24 tensors; kept the model's own values of 2 (another shape in the file: \
             classifier.3.bias [1000] for [8], classifier.3.weight [1000, 256] for [8, 256])"
        ),
        "{log}"
    );
    let saved = checkpoint::read_tensors(out.join("checkpoints/epoch-0001.safetensors")).unwrap();
    for (name, t) in &file.tensors {
        if name.starts_with("classifier") {
            assert_ne!(saved.tensors[name].size(), t.size(), "{name}");
        } else if !is_statistic(name) {
            assert!(
                same_weights(t, &saved.tensors[name]),
                "{name} is not the file's"
            );
        }
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        config["init_weights"]["mismatched"][1],
        serde_json::json!({"name": "classifier.3.weight", "model": [8, 256], "file": [1000, 256]})
    );
}

/// EfficientNet-B0 fine-tuned on ODIR's 8 classes from a 1000-class file: the partial load
/// leaves `classifier.1` out, and the Task gives it a new `nn.Linear(1280, 8)`'s
/// initialisation (uniform in ±1/√1280, bias too), torchvision's recipe, instead of B0's
/// from-scratch ±1/√8 with a zero bias.
#[test]
fn an_efficientnet_fine_tuned_from_a_1000_class_file_gets_a_new_linear_head() {
    let tmp = common::temp_dir("ddp-train-init-b0-head");
    let dir = tmp.path();
    let data = data(dir);
    tch::manual_seed(41);
    let vs = nn::VarStore::new(Device::Cpu);
    let _b0 = Model::new(&vs.root(), ModelKind::EfficientNetB0, 1000, None);
    let file = dir.join("imagenet.safetensors");
    checkpoint::save(&vs, &file, &Default::default()).unwrap();
    let out = dir.join("run");
    let mut partial = args(data.to_str().unwrap(), out.to_str().unwrap(), "1");
    partial.extend(["--model", "efficientnet_b0"]);
    partial.extend(["--init-from", file.to_str().unwrap(), "--init-partial"]);
    let outputs = run_ranks(1, &partial);
    assert_all_ok(&outputs);
    let log = text(&outputs[0]);
    assert!(
        log.contains("; initialised anew by the task: classifier.1.weight, classifier.1.bias"),
        "{log}"
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        config["init_weights"]["reinitialised"],
        serde_json::json!(["classifier.1.weight", "classifier.1.bias"])
    );
    let saved = checkpoint::read_tensors(out.join("checkpoints/epoch-0001.safetensors")).unwrap();
    let bound = 1.0 / 1280f64.sqrt();
    for name in ["classifier.1.weight", "classifier.1.bias"] {
        let max = saved.tensors[name].abs().max().double_value(&[]);
        assert!(
            max <= bound && max > 0.5 * bound,
            "{name}: {max} vs {bound}"
        );
    }
}

/// A partial load that matches no name (another prefix) would train from scratch: refused.
#[test]
fn a_partial_load_that_matches_nothing_fails_naming_both_sides() {
    let tmp = common::temp_dir("ddp-train-init-nothing");
    let dir = tmp.path();
    let data = data(dir);
    let (pth, _) = pytorch_file(dir, "backbone.pth", 8, 41, "backbone.");
    let pth_s = pth.to_str().unwrap();
    let out = dir.join("run");
    let mut partial = args(data.to_str().unwrap(), out.to_str().unwrap(), "1");
    partial.extend(["--init-from", pth_s, "--init-partial"]);
    for (r, o) in run_ranks(2, &partial).iter().enumerate() {
        let t = text(o);
        assert!(!o.status.success(), "rank {r} should have failed:\n{t}");
        assert!(
            t.contains(&format!(
                "--init-from {pth_s}: no tensor of the file has a name and shape of the model \
                 (the file has e.g. 'backbone.features."
            )) && t.contains(
                "', the model e.g. 'classifier.3.bias'): save the model's own state_dict, or \
                 pick its entry with --init-key"
            ),
            "rank {r}:\n{t}"
        );
        assert!(!t.contains("epoch 1/"), "rank {r} started training:\n{t}");
    }
}

#[test]
fn a_training_checkpoint_with_two_models_needs_init_key() {
    let tmp = common::temp_dir("ddp-train-init-key");
    let dir = tmp.path();
    let data = data(dir);
    let data_s = data.to_str().unwrap();
    let (model, _) = pytorch_file(dir, "model.pth", 8, 99, "");
    let (ema, ema_file) = pytorch_file(dir, "ema.pth", 8, 41, "");
    // {"epoch": 3, "model": ..., "ema": ...}, as a training script saves its checkpoint.
    let pth = dir.join("checkpoint.pth");
    let script = "import sys, torch\n\
                  torch.save({'epoch': 3, 'model': torch.load(sys.argv[1]), \
                  'ema': torch.load(sys.argv[2])}, sys.argv[3])\n";
    let out = ddp_testkit::setup_python()
        .args(["-c", script])
        .args([&model, &ema, &pth])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pth_s = pth.to_str().unwrap();

    let run = dir.join("no-key");
    let mut no_key = args(data_s, run.to_str().unwrap(), "1");
    no_key.extend(["--init-from", pth_s]);
    let outputs = run_ranks(2, &no_key);
    for (r, o) in outputs.iter().enumerate() {
        let t = text(o);
        assert!(!o.status.success(), "rank {r} should have failed:\n{t}");
        assert!(
            t.contains(&format!(
                "weights file '{pth_s}' holds several state_dicts, under 'model' (26 tensors), \
                 'ema' (26 tensors): choose one by its key (--init-key)"
            )),
            "rank {r}:\n{t}"
        );
    }

    let run = dir.join("ema");
    let mut keyed = args(data_s, run.to_str().unwrap(), "1");
    keyed.extend(["--init-from", pth_s, "--init-key", "ema"]);
    let outputs = run_ranks(2, &keyed);
    assert_all_ok(&outputs);
    let log = text(&outputs[0]);
    assert!(
        log.contains(&format!(
            "initial weights from {pth_s}: loaded 26 tensors of its entry 'ema'"
        )),
        "{log}"
    );
    let saved = checkpoint::read_tensors(run.join("checkpoints/epoch-0001.safetensors")).unwrap();
    for (name, t) in ema_file.tensors.iter().filter(|(n, _)| !is_statistic(n)) {
        assert!(
            same_weights(t, &saved.tensors[name]),
            "{name} is not the ema's"
        );
    }
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["init_weights"]["entry"], "ema", "{config}");
    assert_eq!(config["settings"]["checkpoint"]["init_key"], "ema");
}
