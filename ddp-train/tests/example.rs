//! The `mlp` example (a user-defined model and data set on the generic Trainer) trains on 2
//! ranks started by ddp-run's launcher and ends with the weights of one process trained on
//! the combined batches.

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
            "--epochs",
            "3",
            "--seed",
            "42",
            "--optimizer",
            "sgd",
            "--lr",
            "0.05",
            "--momentum",
            "0.9",
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

#[test]
fn the_trainer_and_the_launcher_agree_on_the_stop_exit_code() {
    assert_eq!(i32::from(ddp_train::EXIT_STOPPED), ddp_run::EXIT_STOPPED);
    assert_eq!(ddp_run::EXIT_STOPPED, 75);
}
