//! `--freeze` and `--unfreeze-at` with real ranks (2, CPU, tiny images, torchvision's
//! resnet18): frozen parameters keep their initial values and have no optimizer state while
//! the rest trains; a run stopped before, at or after its unfreeze epoch and resumed ends
//! byte for byte as the uninterrupted run.

mod common;

use common::{assert_all_ok, run_ddp_train, text, Limits};

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_model::{checkpoint, Model, ModelKind};
use serde_json::Value;
use tch::{nn, Device};

/// The prefixes the tests freeze: the stem and the first stage of resnet18.
const FROZEN: [&str; 3] = ["conv1", "bn1", "layer1"];

fn data(dir: &Path) -> PathBuf {
    let root = dir.join("data");
    generate(
        &root,
        &SyntheticConfig {
            images: 40,
            size: 40,
            seed: 5,
            ..Default::default()
        },
    )
    .unwrap();
    root
}

/// Two ranks of ddp-train; resnet18 takes longer than the ConvNet.
fn run_ranks(args: &[String], env: &[(&str, &str)]) -> Vec<Output> {
    let limits = Limits {
        collective_s: 60,
        run: Duration::from_secs(300),
    };
    run_ddp_train(2, args, env, limits)
}

/// `epochs` of resnet18 on 32-pixel crops, 4 steps each, with the stem and layer1 frozen.
fn args(data: &Path, out: &Path, epochs: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "--data",
        data.to_str().unwrap(),
        "--model",
        "resnet18",
        "--epochs",
        epochs,
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--seed",
        "3",
        "--out",
        out.to_str().unwrap(),
        "--freeze",
    ]
    .map(String::from)
    .to_vec();
    v.extend(FROZEN.map(String::from));
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn frozen(name: &str) -> bool {
    FROZEN
        .iter()
        .any(|p| name == *p || name.starts_with(&format!("{p}.")))
}

fn train_state(file: &checkpoint::TensorFile) -> Value {
    serde_json::from_str(&file.metadata["train_state"]).unwrap()
}

#[test]
fn frozen_parameters_keep_their_start_and_get_no_optimizer_state() {
    let tmp = common::temp_dir("ddp-train-freeze");
    let dir = tmp.path();
    let data = data(dir);
    let out = dir.join("run");
    assert_all_ok(&run_ranks(&args(&data, &out, "1", &[]), &[]));

    // The Trainer seeds libtorch with --seed and builds the model on the CPU, as here.
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let _start = Model::new(&vs.root(), ModelKind::Resnet18, 8, None);
    let start = vs.variables();
    let end = checkpoint::read_tensors(out.join("checkpoints/epoch-0001.safetensors")).unwrap();
    let (mut kept, mut trained) = (0, 0);
    for (name, t) in &end.tensors {
        let param = start[name].requires_grad();
        if param && frozen(name) {
            assert!(t.equal(&start[name]), "frozen {name} changed");
            kept += 1;
        } else if param {
            trained += usize::from(!t.equal(&start[name]));
        }
    }
    // conv1, bn1 (2) and layer1's two blocks of 2 convolutions and 2 BatchNorms (12).
    assert_eq!(kept, 15);
    assert!(trained > 40, "only {trained} parameters trained");
    // BatchNorm's running statistics still move in frozen layers, as in PyTorch.
    assert!(!end.tensors["bn1.running_mean"].equal(&start["bn1.running_mean"]));

    let state =
        checkpoint::read_tensors(out.join("checkpoints/epoch-0001.state.safetensors")).unwrap();
    let with_state: Vec<&String> = state.tensors.keys().collect();
    assert!(with_state
        .iter()
        .all(|k| !frozen(k.split_once('.').unwrap().1)));
    assert!(state.tensors.contains_key("exp_avg.fc.weight"));
    assert!(state
        .tensors
        .contains_key("exp_avg_sq.layer2.0.conv1.weight"));
    let recorded = train_state(&state)["frozen"].as_array().unwrap().len();
    assert_eq!(recorded, 15);
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    let config: Value = serde_json::from_str(&config).unwrap();
    assert_eq!(config["task"]["model"], "resnet18");
    assert_eq!(
        config["settings"]["freeze"]["prefixes"],
        serde_json::json!(FROZEN)
    );
    let log = std::fs::read_to_string(out.join("logs/rank-0.log")).unwrap();
    assert!(
        log.contains(
            "frozen: 15 of the model's 62 parameters (conv1, bn1, layer1) for the whole run"
        ),
        "{log}"
    );
}

#[test]
fn a_prefix_that_names_no_parameter_fails_naming_it() {
    let tmp = common::temp_dir("ddp-train-freeze-bad");
    let dir = tmp.path();
    let data = data(dir);
    let mut a = args(&data, &dir.join("run"), "1", &[]);
    a.push("layer9".into());
    let outputs = run_ranks(&a, &[]);
    for o in &outputs {
        assert!(!o.status.success());
        assert!(
            text(o).contains("--freeze: 'layer9' names no parameter of the model"),
            "{}",
            text(o)
        );
    }
    let mut a = args(&data, &dir.join("unfrozen"), "1", &[]);
    a.extend(["layer2", "layer3", "layer4", "fc", "--unfreeze-at", "1"].map(String::from));
    assert_all_ok(&run_ranks(&a, &[]));
}

/// Prefixes that freeze every parameter leave nothing to train: refused on every rank, naming
/// the flag, before DDP would refuse the model; unless nothing is frozen in the first epoch
/// (`--unfreeze-at 1`).
#[test]
fn a_freeze_of_every_parameter_is_refused() {
    let tmp = common::temp_dir("ddp-train-freeze-all");
    let dir = tmp.path();
    let data = data(dir);
    let mut a = args(&data, &dir.join("run"), "1", &[]);
    a.extend(["layer2", "layer3", "layer4", "fc"].map(String::from));
    let outputs = run_ranks(&a, &[]);
    for o in &outputs {
        assert!(!o.status.success());
        assert!(
            text(o).contains(
                "--freeze (conv1, bn1, layer1, layer2, layer3, layer4, fc) freeze all 62 \
                 parameters of the model, which leaves nothing to train: leave some parameters \
                 out"
            ),
            "{}",
            text(o)
        );
    }
}

/// Trains with `--unfreeze-at 2` once through and once interrupted by `env` and resumed,
/// and checks that the final weights, optimizer state and scalar state are the same bytes.
fn check_resume(name: &str, extra: &[&str], env: &[(&str, &str)], resumes_from: &str) {
    let tmp = common::temp_dir(&format!("ddp-train-unfreeze-{name}"));
    let dir = tmp.path();
    let data = data(dir);
    let extra = [&["--unfreeze-at", "2"], extra].concat();
    let full = dir.join("full");
    assert_all_ok(&run_ranks(&args(&data, &full, "2", &extra), &[]));
    let cut = dir.join("cut");
    let outputs = run_ranks(&args(&data, &cut, "2", &extra), env);
    assert!(!outputs[1].status.success(), "{}", text(&outputs[1]));
    assert_eq!(
        std::fs::read_to_string(cut.join("checkpoints/latest")).unwrap(),
        format!("{resumes_from}\n")
    );
    let mut resume = args(&data, &cut, "2", &extra);
    resume.extend(["--resume".into(), "latest".into()]);
    let outputs = run_ranks(&resume, &[]);
    assert_all_ok(&outputs);
    let log = text(&outputs[0]);
    assert!(log.contains("resumed from"), "{log}");
    for file in ["epoch-0002.safetensors", "epoch-0002.state.safetensors"] {
        let (a, b) = (
            checkpoint::read_tensors(full.join("checkpoints").join(file)).unwrap(),
            checkpoint::read_tensors(cut.join("checkpoints").join(file)).unwrap(),
        );
        assert_eq!(
            a.tensors.keys().collect::<Vec<_>>(),
            b.tensors.keys().collect::<Vec<_>>(),
            "{file}"
        );
        for (n, t) in &a.tensors {
            assert!(t.equal(&b.tensors[n]), "{file}: {n} differs");
        }
    }
    let scalars = |run: &Path| {
        let f =
            checkpoint::read_tensors(run.join("checkpoints/epoch-0002.state.safetensors")).unwrap();
        let mut v = train_state(&f);
        v.as_object_mut().unwrap().remove("config");
        v
    };
    let state = scalars(&full);
    assert_eq!(state, scalars(&cut));
    assert!(
        state.get("frozen").is_none(),
        "nothing is frozen after epoch 2"
    );
    // The frozen stem trained in epoch 2: it has optimizer state, 4 steps of it.
    let f =
        checkpoint::read_tensors(full.join("checkpoints/epoch-0002.state.safetensors")).unwrap();
    assert_eq!(f.tensors["step.conv1.weight"].int64_value(&[]), 4);
    assert_eq!(f.tensors["step.fc.weight"].int64_value(&[]), 8);
    let log = std::fs::read_to_string(full.join("logs/rank-0.log")).unwrap();
    assert!(
        log.contains("epoch 2: 62 parameters train, 0 frozen (were 15)"),
        "{log}"
    );
}

/// Killed in epoch 2: resumed from the end of epoch 1, before the unfreeze. Rank 0, which
/// fails with it, keeps its store up for one diagnosis window (three heartbeat intervals):
/// with 100 ms heartbeats, 0.5 s rather than a 60 s timeout's 3 s.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_run_resumed_before_its_unfreeze_epoch_ends_as_the_uninterrupted_one() {
    let env = [
        ("DDP_TRAIN_FAIL_RANK", "1"),
        ("DDP_TRAIN_FAIL_AT", "2:1"),
        ("DDP_COMM_TEST_HEARTBEAT_MS", "100"),
    ];
    check_resume("before", &[], &env, "epoch-0001");
}

/// Stopped (SIGTERM to one rank after epoch 1's evaluation) at the first step of epoch 2,
/// after the unfreeze and before any step of the unfrozen parameters; with SGD, whose
/// momentum buffers those parameters do not have yet.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_run_resumed_at_its_unfreeze_epoch_ends_as_the_uninterrupted_one() {
    let env = [
        ("DDP_TRAIN_FAIL_RANK", "1"),
        ("DDP_TRAIN_FAIL_AT", "1:end"),
        ("DDP_TRAIN_FAIL_SIGNAL", "TERM"),
    ];
    let sgd = ["--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.01"];
    check_resume("at", &sgd, &env, "epoch-0002-step-000000");
}

/// Stopped in the middle of epoch 2, after the unfreeze.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_run_resumed_after_its_unfreeze_epoch_ends_as_the_uninterrupted_one() {
    let env = [
        ("DDP_TRAIN_FAIL_RANK", "1"),
        ("DDP_TRAIN_FAIL_AT", "2:1"),
        ("DDP_TRAIN_FAIL_SIGNAL", "TERM"),
    ];
    check_resume("after", &[], &env, "epoch-0002-step-000002");
}
