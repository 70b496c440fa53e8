//! The examples (user-defined models and data sets on the generic Trainer) train on 2 ranks
//! started by ddp-run's launcher and end with the weights of one process trained on the
//! combined batches; started with `--nproc-per-node 2`, the mlp starts those 2 ranks itself.

use std::path::{Path, PathBuf};

use ddp_model::checkpoint;
use ddp_run::{launch, LaunchConfig, Outcome};

/// `target/<profile>/examples/<name>`, built by `cargo test` with the tests.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .expect("tests run from target/<profile>/deps");
    let path = profile.join("examples").join(name);
    assert!(
        path.is_file(),
        "{} is not built: `cargo test` builds the examples, a filtered run does not \
         (`cargo build -p ddp-train --examples` first)",
        path.display()
    );
    path
}

/// SGD with momentum, 3 epochs: the settings under which 2 ranks and 1 process agree (with
/// `--lr`).
const SGD: [&str; 8] = [
    "--epochs",
    "3",
    "--seed",
    "42",
    "--optimizer",
    "sgd",
    "--momentum",
    "0.9",
];

/// Runs example `name` on `ranks` ranks of `batch` samples each, with `args` after the
/// output folder and batch size.
fn train(name: &str, ranks: usize, batch: usize, out: &Path, args: &[&str]) {
    let batch = batch.to_string();
    let all = ["--out", out.to_str().unwrap(), "--batch-size", &batch]
        .into_iter()
        .chain(args.iter().copied());
    let config = LaunchConfig {
        echo: false,
        log_dir: Some(out.join("launcher-logs")),
        ..LaunchConfig::new(example(name), ranks).args(all)
    };
    let outcome = launch(&config, |_| {}).expect("the launcher starts");
    let logs: String = (0..ranks)
        .map(|r| {
            std::fs::read_to_string(out.join(format!("launcher-logs/rank-{r}.out")))
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(outcome, Outcome::Succeeded { restarts: 0 }, "{logs}");
}

#[test]
fn two_ranks_of_the_example_equal_one_process_with_twice_the_batch() {
    let tmp = ddp_testkit::temp_dir("ddp-train-example");
    let (two, one) = (tmp.path().join("two"), tmp.path().join("one"));
    let args = [&SGD[..], &["--lr", "0.05"]].concat();
    train("mlp", 2, 8, &two, &args);
    train("mlp", 1, 16, &one, &args);
    let a = same_weights(&two, &one, 3, "0.weight");
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        ["0.bias", "0.weight", "2.bias", "2.weight"]
    );
    // Both runs wrote the same validation loss, and it fell.
    let (l2, l1) = (metric(&two, "val_loss"), metric(&one, "val_loss"));
    assert_eq!(l2.len(), 3);
    for (x, y) in l2.iter().zip(&l1) {
        assert!((x - y).abs() < 1e-5 * y.max(1.0), "{l2:?} vs {l1:?}");
    }
    assert!(l2[2] < l2[0], "the validation loss did not fall: {l2:?}");
    assert!(two.join("best.safetensors").is_file());
}

/// The final weights of the example's run in `run`.
fn final_weights(run: &Path) -> std::collections::BTreeMap<String, tch::Tensor> {
    checkpoint::read_tensors(run.join("checkpoints/epoch-0003.safetensors"))
        .unwrap()
        .tensors
}

#[test]
fn the_example_given_nproc_per_node_starts_its_ranks_as_ddp_run_would() {
    let tmp = ddp_testkit::temp_dir("ddp-train-example-self-launch");
    let (itself, launched) = (tmp.path().join("itself"), tmp.path().join("launched"));
    // CPU ranks whatever GPUs the machine has (more ranks than GPUs are refused), both ways.
    let args = [&SGD[..], &["--lr", "0.05", "--device", "cpu"]].concat();
    let mut cmd = std::process::Command::new(example("mlp"));
    cmd.args(["--batch-size", "8", "--nproc-per-node", "2"])
        .args(&args)
        .arg("--out")
        .arg(&itself)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for name in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"] {
        cmd.env_remove(name);
    }
    let out = ddp_testkit::wait_bounded(cmd.spawn().unwrap(), std::time::Duration::from_secs(180));
    let t = ddp_testkit::text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    train("mlp", 2, 8, &launched, &args);

    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(itself.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["world_size"], 2, "{config}");
    for rank in 0..2 {
        let output = std::fs::read_to_string(itself.join(format!("logs/rank-{rank}.out")))
            .unwrap_or_else(|e| panic!("rank {rank}'s output: {e}\n{t}"));
        assert!(output.contains(&format!("rank {rank} of 2")), "{output}");
    }
    assert!(t.contains("mlp: all 2 rank(s) finished"), "{t}");
    // The same two ranks as under ddp-run's launcher: the same weights, bit for bit.
    let (a, b) = (final_weights(&itself), final_weights(&launched));
    assert_eq!(a.len(), 4);
    for (name, t) in &a {
        assert!(t.equal(&b[name]), "{name} differs");
    }
}

#[test]
fn the_text_classifier_pads_per_batch_and_two_ranks_equal_one_process() {
    let tmp = ddp_testkit::temp_dir("ddp-train-text");
    let (two, one) = (tmp.path().join("two"), tmp.path().join("one"));
    let args = [&SGD[..], &["--texts", "256", "--lr", "0.1"]].concat();
    train("text", 2, 8, &two, &args);
    train("text", 1, 16, &one, &args);
    // Each rank pads its 8 texts to their own longest, the single process its 16: the
    // padding embeds to zeros and is masked out of the pooling, so the steps are the same.
    same_weights(&two, &one, 3, "conv.weight");
    let (f2, f1) = (metric(&two, "val_macro_f1"), metric(&one, "val_macro_f1"));
    assert_eq!(f2, f1, "macro-F1 is computed from counts: exactly equal");
    assert!(
        f2[2] > 0.4,
        "the classifier learned nothing: macro-F1 {f2:?}"
    );
    assert_eq!(metric(&two, "val_micro_f1").len(), 3);
    assert!(two.join("best_macro.safetensors").is_file());
    assert!(two.join("best_micro.safetensors").is_file());
}

/// Asserts that runs `a` and `b` end epoch `epoch` with the same weights (within 1e-5) and
/// that `moving` changed since epoch 1; returns `a`'s weights.
fn same_weights(
    a: &Path,
    b: &Path,
    epoch: u32,
    moving: &str,
) -> std::collections::BTreeMap<String, tch::Tensor> {
    let weights = |run: &Path, epoch: u32| {
        checkpoint::read_tensors(run.join(format!("checkpoints/epoch-{epoch:04}.safetensors")))
            .unwrap()
            .tensors
    };
    let (x, y) = (weights(a, epoch), weights(b, epoch));
    assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
    for (name, t) in &x {
        let diff = (t - &y[name]).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "{name} differs by {diff}");
    }
    // The weights did move: the equality is not that of two untrained models.
    let first = weights(a, 1);
    let moved = (&x[moving] - &first[moving]).abs().max().double_value(&[]);
    assert!(moved > 1e-3, "{moving} moved by only {moved}");
    x
}

/// Every epoch's `name` from a run's `metrics.jsonl`.
fn metric(run: &Path, name: &str) -> Vec<f64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()[name]
                .as_f64()
                .unwrap_or_else(|| panic!("{name} in {l}"))
        })
        .collect()
}

#[test]
fn the_trainer_and_the_launcher_agree_on_the_stop_exit_code() {
    assert_eq!(ddp_train::EXIT_STOPPED, ddp_run::EXIT_STOPPED);
    assert_eq!(ddp_run::EXIT_STOPPED, 75);
}

#[test]
fn the_resnet_trains_with_adamw_warmup_cosine_and_clipping_on_two_ranks() {
    let tmp = ddp_testkit::temp_dir("ddp-train-resnet");
    let (two, one) = (tmp.path().join("two"), tmp.path().join("one"));
    // The example's defaults: AdamW, 10 warmup steps into a cosine, clipping at 1.0.
    let args = ["--images", "64", "--epochs", "3", "--seed", "5"];
    train("resnet", 2, 8, &two, &args);
    train("resnet", 1, 16, &one, &args);
    // 4 optimizer steps per epoch in both: the schedule is per step, so the learning rates
    // are the same, rising through the warmup (4/10, 8/10 of the peak), then decaying.
    let lr = metric(&two, "lr");
    assert_eq!(lr, metric(&one, "lr"));
    assert!(
        lr[0] < lr[1] && lr[2] < lr[1],
        "not warmup then cosine: {lr:?}"
    );
    let norms = metric(&two, "grad_norm");
    assert!(norms.iter().all(|n| n.is_finite() && *n > 0.0), "{norms:?}");
    let loss = metric(&two, "train_loss");
    assert!(
        loss[2] < loss[0] / 2.0,
        "the ResNet did not learn: {loss:?}"
    );
    // BatchNorm normalises by each rank's own batch (as PyTorch's DDP without
    // SyncBatchNorm): the runs differ in their weights, so only the schedule is compared.
    assert!(two.join("best.safetensors").is_file());
}

/// A generic program checks `--local-rank` (torch.distributed.launch's flag) against the
/// launcher's `LOCAL_RANK` before it trains, as `ddp-train` does.
#[test]
fn a_local_rank_flag_that_disagrees_with_the_launcher_is_refused() {
    let tmp = ddp_testkit::temp_dir("local-rank");
    let out = tmp.path().join("run");
    let output = std::process::Command::new(example("mlp"))
        .args(["--local-rank", "3", "--epochs", "1", "--out"])
        .arg(&out)
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "error: --local-rank 3 disagrees with the launcher's local rank 0 (LOCAL_RANK or \
             SLURM_LOCALID)"
        ),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing was started");
}

/// `python -m torch.distributed.launch` before PyTorch 1.9 (or without `--use-env`) sets
/// `RANK` and `WORLD_SIZE` but no `LOCAL_RANK`, and passes each rank's as `--local-rank`:
/// that flag is the rank's local rank then, so both ranks train.
#[test]
fn a_local_rank_flag_is_the_local_rank_where_the_launcher_sets_none() {
    let tmp = ddp_testkit::temp_dir("local-rank-flag");
    let out = tmp.path().join("run");
    let port = ddp_testkit::free_port();
    let children = (0..2)
        .map(|rank| {
            let mut cmd = ddp_testkit::rank_command(example("mlp"), rank, 2, port);
            cmd.env_remove("LOCAL_RANK")
                .env_remove("LOCAL_WORLD_SIZE")
                .args(["--local-rank", &rank.to_string()])
                .args(["--epochs", "1", "--device", "cpu", "--out"])
                .arg(&out)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let outputs = ddp_testkit::wait_all(children, std::time::Duration::from_secs(240));
    for (rank, output) in outputs.iter().enumerate() {
        let text = ddp_testkit::text(output);
        assert_eq!(output.status.code(), Some(0), "rank {rank}: {text}");
        assert!(text.contains(&format!("rank {rank} of 2")), "{text}");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["world_size"], 2, "{config}");
}
