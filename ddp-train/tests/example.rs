//! The `mlp` example (a user-defined model and data set on the generic Trainer) trains on 2
//! ranks started by ddp-run's launcher and ends with the weights of one process trained on
//! the combined batches; started with `--nproc-per-node 2`, it starts those 2 ranks itself.

use std::path::{Path, PathBuf};

use ddp_model::checkpoint;
use ddp_run::{launch, LaunchConfig, Outcome};

/// `target/<profile>/examples/mlp`, built by `cargo test` with the tests.
fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let profile = exe
        .parent()
        .and_then(Path::parent)
        .expect("tests run from target/<profile>/deps");
    let path = profile.join("examples").join("mlp");
    assert!(
        path.is_file(),
        "{} is not built: `cargo test` builds the examples, a filtered run does not \
         (`cargo build -p ddp-train --example mlp` first)",
        path.display()
    );
    path
}

fn train(ranks: usize, batch: usize, out: &Path) {
    let config = LaunchConfig {
        echo: false,
        log_dir: Some(out.join("launcher-logs")),
        ..LaunchConfig::new(example(), ranks).args([
            "--out",
            out.to_str().unwrap(),
            "--batch-size",
            &batch.to_string(),
        ])
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
    train(2, 8, &two);
    train(1, 16, &one);

    let weights = |run: &Path, epoch: u32| {
        checkpoint::read_tensors(run.join(format!("checkpoints/epoch-{epoch:04}.safetensors")))
            .unwrap()
            .tensors
    };
    let (a, b) = (weights(&two, 3), weights(&one, 3));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        ["0.bias", "0.weight", "2.bias", "2.weight"]
    );
    for (name, t) in &a {
        let diff = (t - &b[name]).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "{name} differs by {diff}");
    }
    // The weights did move: the equality is not that of two untrained models.
    let first = weights(&two, 1);
    let moved = (&a["0.weight"] - &first["0.weight"])
        .abs()
        .max()
        .double_value(&[]);
    assert!(moved > 1e-3, "the weights moved by only {moved}");

    // Both runs wrote the same validation loss, and it fell.
    let val_losses = |run: &Path| -> Vec<f64> {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect()
    };
    let (l2, l1) = (val_losses(&two), val_losses(&one));
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
    let mut cmd = std::process::Command::new(example());
    cmd.args(["--batch-size", "8", "--nproc-per-node", "2", "--out"])
        .arg(&itself)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for name in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"] {
        cmd.env_remove(name);
    }
    let out = ddp_testkit::wait_bounded(cmd.spawn().unwrap(), std::time::Duration::from_secs(180));
    let t = ddp_testkit::text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    train(2, 8, &launched);

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
fn the_trainer_and_the_launcher_agree_on_the_stop_exit_code() {
    assert_eq!(i32::from(ddp_train::EXIT_STOPPED), ddp_run::EXIT_STOPPED);
    assert_eq!(ddp_run::EXIT_STOPPED, 75);
}
