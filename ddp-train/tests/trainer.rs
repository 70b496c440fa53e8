//! The `ddp-train` binary as ranks: exact distributed evaluation, exact resume, determinism,
//! and bad input failing on every rank before training. Real processes on loopback, CPU.

mod common;

use common::{
    assert_all_ok, free_port, rank_command, run_ddp_train, text, wait_all, wait_bounded, Limits,
};
use ddp_testkit::wait_for;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_model::{checkpoint, ConvNet, ConvNetConfig};
use serde_json::Value;
use tch::{nn, Device};

const EXE: &str = env!("CARGO_BIN_EXE_ddp-train");

fn temp_dir(name: &str) -> common::TempDir {
    common::temp_dir(&format!("ddp-train-bin-{name}"))
}

/// The image files of the synthetic sample at `data`, sorted.
fn images_of(data: &Path) -> Vec<PathBuf> {
    let mut names: Vec<_> = std::fs::read_dir(data.join("preprocessed_images"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    names
}

/// A small synthetic ODIR folder of `images` images: two per patient, the last patient only a
/// left eye when `images` is odd.
fn data(dir: &Path, images: usize) -> PathBuf {
    let root = dir.join("data");
    generate(
        &root,
        &SyntheticConfig {
            images,
            size: 48,
            seed: 5,
            ..Default::default()
        },
    )
    .unwrap();
    root
}

fn run_ranks(world: usize, args: &[&str], env: &[(&str, &str)]) -> Vec<Output> {
    run_ddp_train(world, args, env, Limits::SHORT)
}

/// The JSON report an `--eval-only` run prints last.
fn report(rank0: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&rank0.stdout);
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// `metrics.jsonl` without its timing fields.
fn metrics_without_timing(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            o.remove("images_per_sec");
            o.remove("epoch_seconds");
            v
        })
        .collect()
}

/// The number of validation samples in the `data: ...` line of rank 0's output.
fn validation_samples(rank0: &Output) -> usize {
    let stdout = String::from_utf8_lossy(&rank0.stdout);
    let line = stdout.lines().find(|l| l.starts_with("data: ")).unwrap();
    let before = line.split(" validation samples").next().unwrap();
    before.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Batch sizes of one rank's exact evaluation shard (`rank` of `world`, batches of `batch`).
fn shard_batches(samples: usize, world: usize, rank: usize, batch: usize) -> Vec<usize> {
    let shard = samples.saturating_sub(rank).div_ceil(world);
    (0..shard)
        .step_by(batch)
        .map(|b| batch.min(shard - b))
        .collect()
}

/// 63 images and `--val-split 0.4`: 13 patients, 26 validation images. On 3 ranks the exact
/// shards are 9/9/8, in batches of 2: ranks 0 and 1 take five batches, the last of one image
/// (positions 24 and 25), rank 2 four full ones, while one process takes 13 full batches. So
/// the ranks differ in their number of batches, and a partial batch lost or padded on the
/// ranks changes what they evaluate but not what one process does.
#[test]
fn distributed_evaluation_equals_one_process_on_the_whole_split() {
    let tmp = temp_dir("eval");
    let dir = tmp.path();
    let data = data(dir, 63);
    tch::manual_seed(11);
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = ConvNet::new(&vs.root(), ConvNetConfig::default());
    let model = dir.join("model.safetensors");
    checkpoint::save(&vs, &model, &Default::default()).unwrap();

    let mut results = Vec::new();
    for world in [1, 3] {
        let out = dir.join(format!("run{world}"));
        let args = [
            "--data",
            data.to_str().unwrap(),
            "--val-split",
            "0.4",
            "--image-size",
            "32",
            "--batch-size",
            "2",
            "--eval-only",
            "--tune-thresholds",
            "--resume",
            model.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        let outputs = run_ranks(world, &args, &[]);
        assert_all_ok(&outputs);
        let v = report(&outputs[0]);
        assert_eq!(v["world_size"], world);
        results.push((validation_samples(&outputs[0]), v));
    }
    let ((n, one), (n3, three)) = (&results[0], &results[1]);
    assert_eq!(n, n3);
    // Unequal shards, or the test no longer covers them: the ranks take different numbers
    // of batches, and some end with a partial batch.
    let shards: Vec<Vec<usize>> = (0..3).map(|r| shard_batches(*n, 3, r, 2)).collect();
    assert_eq!(
        shards,
        [vec![2, 2, 2, 2, 1], vec![2, 2, 2, 2, 1], vec![2, 2, 2, 2]],
        "{n} validation samples"
    );
    assert_eq!(one["odir_patients"], 13, "{one}");
    // The counts are exactly those of one process: nothing counted twice, nothing missed.
    for key in [
        "tp",
        "fp",
        "fn",
        "val_f1_per_class",
        "val_macro_f1",
        "val_micro_f1",
    ] {
        assert_eq!(one[key], three[key], "{key} differs between 1 and 3 ranks");
    }
    // The challenge's figures, from every image's probabilities gathered by its place in the
    // validation subset and combined per patient: every patient once, with its own images,
    // whatever the number of ranks. An image's float32 probabilities may differ in their last
    // bits with the images beside it in a batch, so equal means equal to float32's precision.
    let challenge: Vec<&String> = one
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("odir_"))
        .collect();
    let mut expected = [
        "odir_auc",
        "odir_auc_per_class",
        "odir_f1",
        "odir_kappa",
        "odir_patients",
        "odir_score",
        "odir_thresholds",
    ];
    expected.sort();
    assert_eq!(challenge, expected, "{one}");
    for key in challenge {
        let values = |v: &Value| -> Vec<Option<f64>> {
            match &v[key] {
                Value::Array(list) => list.iter().map(Value::as_f64).collect(),
                single => vec![single.as_f64()],
            }
        };
        let (a, b) = (values(one), values(three));
        assert_eq!(a.len(), b.len(), "{key}");
        for (x, y) in a.iter().zip(&b) {
            let same = match (x, y) {
                (Some(x), Some(y)) => (x - y).abs() <= 1e-6,
                _ => x == y,
            };
            assert!(same, "{key} differs between 1 and 3 ranks: {a:?} and {b:?}");
        }
    }
    let total: i64 = ["tp", "fn"]
        .iter()
        .flat_map(|k| {
            one[*k]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
        })
        .sum();
    assert!(
        total > 0,
        "the validation split has no positive labels: the test proves nothing"
    );
    let (l1, l3) = (
        one["val_loss"].as_f64().unwrap(),
        three["val_loss"].as_f64().unwrap(),
    );
    assert!(
        (l1 - l3).abs() < 1e-6 * l1.abs().max(1.0),
        "val loss {l1} vs {l3}"
    );
}

/// Arguments of the short 2-rank training used by the resume and determinism tests.
fn train_args<'a>(data: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "--data",
        data,
        "--epochs",
        "3",
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--min-crop-scale",
        "0.5",
        "--seed",
        "3",
        "--out",
        out,
    ]
}

#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn an_interrupted_and_resumed_run_equals_an_uninterrupted_one() {
    check_resume("resume", 2, &[]);
}

/// On three ranks the ring sums each element in an order that depends on its place in its
/// bucket: the resumed run must reduce in the buckets the run had (the checkpoint's order).
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn an_interrupted_and_resumed_run_on_three_ranks_equals_an_uninterrupted_one() {
    let state = check_resume("resume-3", 3, &[]);
    let order = state["bucket_order"].as_array().unwrap();
    assert_eq!(order.len(), 14, "the ConvNet's parameters: {order:?}");
}

/// fp16 adds the gradient scaler's state (its scale and count of good steps) to what a
/// resumed run must continue from exactly.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn an_interrupted_and_resumed_fp16_run_equals_an_uninterrupted_one() {
    // With clipping, the epoch's mean gradient norm and skipped steps must resume exactly.
    let state = check_resume(
        "resume-fp16",
        2,
        &["--precision", "fp16", "--clip-grad-norm", "1.0"],
    );
    let scaler = &state["grad_scaler"];
    let (scale, good) = (
        scaler["scale"].as_f64().unwrap(),
        scaler["growth_tracker"].as_u64().unwrap(),
    );
    // Three epochs of 5 steps: some steps were taken since the last change of scale.
    assert!(scale > 0.0 && scale <= 65536.0 && good >= 1, "{scaler}");
}

/// Trains 3 epochs on `world` ranks with `extra` flags, once through and once killed at
/// epoch 2 and resumed; checks that weights, optimizer state, scalar state and metrics are
/// equal, and returns the final scalar state.
fn check_resume(name: &str, world: usize, extra: &[&str]) -> Value {
    let tmp = temp_dir(name);
    let dir = tmp.path();
    let data = data(dir, 40);
    let data_s = data.to_str().unwrap();
    let full = dir.join("full");
    let full_s = full.to_str().unwrap();
    let train_args = |data, out| [train_args(data, out), extra.to_vec()].concat();
    assert_all_ok(&run_ranks(world, &train_args(data_s, full_s), &[]));

    // The same run, killed at epoch 2 step 1 by rank 1, then resumed from the latest
    // checkpoint (the end of epoch 1).
    let cut = dir.join("cut");
    let cut_s = cut.to_str().unwrap();
    let failing = [("DDP_TRAIN_FAIL_RANK", "1"), ("DDP_TRAIN_FAIL_AT", "2:1")];
    let outputs = run_ranks(world, &train_args(data_s, cut_s), &failing);
    assert_eq!(outputs[1].status.code(), Some(17), "{}", text(&outputs[1]));
    assert!(
        !outputs[0].status.success(),
        "rank 0 should fail when rank 1 dies"
    );
    assert_eq!(
        std::fs::read_to_string(cut.join("checkpoints/latest")).unwrap(),
        "epoch-0001\n"
    );
    let mut resume = train_args(data_s, cut_s);
    resume.extend(["--resume", "latest"]);
    let outputs = run_ranks(world, &resume, &[("TORCHELASTIC_RESTART_COUNT", "1")]);
    assert_all_ok(&outputs);
    assert!(
        text(&outputs[0]).contains("resumed from"),
        "{}",
        text(&outputs[0])
    );

    let model = "checkpoints/epoch-0003.safetensors";
    let (a, b) = (
        std::fs::read(full.join(model)).unwrap(),
        std::fs::read(cut.join(model)).unwrap(),
    );
    assert!(
        a == b,
        "the final weights differ between the uninterrupted and the resumed run"
    );
    // The optimizer state too: every moment bit for bit, and the scalar state (the settings
    // differ, by --resume, and are left out).
    let state = "checkpoints/epoch-0003.state.safetensors";
    let (a, b) = (
        checkpoint::read_tensors(full.join(state)).unwrap(),
        checkpoint::read_tensors(cut.join(state)).unwrap(),
    );
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        b.tensors.keys().collect::<Vec<_>>()
    );
    for (name, t) in &a.tensors {
        assert!(t.equal(&b.tensors[name]), "{name} differs");
    }
    let scalars = |f: &checkpoint::TensorFile| {
        let mut v: Value = serde_json::from_str(&f.metadata["train_state"]).unwrap();
        v.as_object_mut().unwrap().remove("config");
        v
    };
    assert_eq!(scalars(&a), scalars(&b));
    assert_eq!(metrics_without_timing(&full), metrics_without_timing(&cut));
    assert_eq!(metrics_without_timing(&full).len(), 3);
    scalars(&a)
}

#[test]
fn two_runs_with_one_seed_write_the_same_metrics_and_learn() {
    let tmp = temp_dir("determinism");
    let dir = tmp.path();
    let data = data(dir, 40);
    let data_s = data.to_str().unwrap();
    let runs: Vec<PathBuf> = ["a", "b"].iter().map(|n| dir.join(n)).collect();
    for run in &runs {
        assert_all_ok(&run_ranks(
            2,
            &train_args(data_s, run.to_str().unwrap()),
            &[],
        ));
    }
    let a = metrics_without_timing(&runs[0]);
    assert_eq!(a, metrics_without_timing(&runs[1]));
    // Every file of the run directory is there.
    for f in [
        "config.json",
        "metrics.jsonl",
        "curves.png",
        "best-macro.safetensors",
        "best-micro.safetensors",
        "best-score.safetensors",
        "logs/rank-0.log",
        "logs/rank-1.log",
    ] {
        assert!(runs[0].join(f).is_file(), "{f} is missing");
    }
    let loss = |e: usize| a[e]["train_loss"].as_f64().unwrap();
    assert!(loss(2) < loss(0), "the training loss did not fall: {a:?}");
}

#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn timed_step_checkpoints_are_written_inside_epochs_and_pruned_to_the_newest() {
    let tmp = temp_dir("minutes");
    let dir = tmp.path();
    let data = data(dir, 40);
    let out = dir.join("run");
    let mut args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    // 4 steps per rank per epoch, each at least 0.2 s: at the latest before step 2 of every
    // epoch, 0.3 s have passed since the last checkpoint.
    args.extend(["--checkpoint-minutes", "0.005", "--keep-checkpoints", "1"]);
    let outputs = run_ranks(2, &args, &[("DDP_TRAIN_STEP_SLEEP_MS", "200")]);
    assert_all_ok(&outputs);
    let log = text(&outputs[0]);
    assert!(log.contains("(removed epoch-0001-step-"), "{log}");
    let mut models: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors") && !n.ends_with(".state.safetensors"))
        .collect();
    models.sort();
    // Every epoch's end, and the newest step checkpoint only (of epoch 3).
    assert_eq!(models.len(), 4, "{models:?}");
    assert_eq!(
        models[..2],
        ["epoch-0001.safetensors", "epoch-0002.safetensors"]
    );
    assert!(
        models[2].starts_with("epoch-0003-step-00000") && models[3] == "epoch-0003.safetensors",
        "{models:?}"
    );
    // A finished run's `latest` is its last epoch's end, and it is not marked stopped.
    assert_eq!(
        std::fs::read_to_string(out.join("checkpoints/latest")).unwrap(),
        "epoch-0003\n"
    );
    assert!(!out.join("checkpoints/stopped").exists());
}

/// Runs two ranks expected to fail before training; returns rank 0's and rank 1's output.
fn both_fail(args: &[&str]) -> (String, String) {
    both_fail_with(args, &[])
}

/// [`both_fail`] with `env` in the ranks' environment.
fn both_fail_with(args: &[&str], env: &[(&str, &str)]) -> (String, String) {
    let outputs = run_ranks(2, args, env);
    for (r, o) in outputs.iter().enumerate() {
        assert!(
            !o.status.success(),
            "rank {r} should have failed:\n{}",
            text(o)
        );
        assert!(
            !text(o).contains("epoch 1/"),
            "rank {r} started training:\n{}",
            text(o)
        );
    }
    (text(&outputs[0]), text(&outputs[1]))
}

#[test]
fn bad_input_fails_on_every_rank_before_training() {
    let tmp = temp_dir("bad");
    let dir = tmp.path();
    let data = data(dir, 20);
    let data_s = data.to_str().unwrap();
    let out = dir.join("run");
    let out_s = out.to_str().unwrap();

    let missing = dir.join("no-such-folder");
    let (a, b) = both_fail(&["--data", missing.to_str().unwrap()]);
    for t in [&a, &b] {
        assert!(t.contains("no-such-folder"), "{t}");
    }

    let (a, b) = both_fail(&["--data", data_s, "--image-size", "8"]);
    for t in [&a, &b] {
        assert!(t.contains("--image-size 8 is too small"), "{t}");
    }

    // Ranks a launcher restarts need --out: each start would make its own run directory, and
    // a restart would train from epoch 1 again. Refused at the first start.
    let args = ["--data", data_s, "--image-size", "32", "--batch-size", "4"];
    let (a, b) = both_fail_with(&args, &[("TORCHELASTIC_MAX_RESTARTS", "2")]);
    for t in [&a, &b] {
        assert!(
            t.contains(
                "--out is not set, and the launcher restarts failed ranks (--max-restarts 2): \
                 each start would make a run directory of its own, so a restarted rank would \
                 start over in a new one"
            ),
            "{t}"
        );
    }

    let (a, b) = both_fail(&["--data", data_s, "--batch-size", "64", "--out", out_s]);
    for t in [&a, &b] {
        assert!(t.contains("fewer than one step of --batch-size 64"), "{t}");
    }

    let (a, b) = both_fail(&[
        "--data",
        data_s,
        "--batch-size",
        "4",
        "--resume",
        "latest",
        "--out",
        out_s,
    ]);
    for t in [&a, &b] {
        assert!(t.contains("nothing to resume"), "{t}");
    }

    // A checkpoint of another model (2 classes), and a corrupt one.
    let vs = nn::VarStore::new(Device::Cpu);
    let _ = ConvNet::new(
        &vs.root(),
        ConvNetConfig {
            num_classes: 2,
            dropout: 0.5,
        },
    );
    let other = dir.join("other.safetensors");
    checkpoint::save(&vs, &other, &Default::default()).unwrap();
    let (a, b) = both_fail(&[
        "--data",
        data_s,
        "--eval-only",
        "--resume",
        other.to_str().unwrap(),
        "--out",
        out_s,
    ]);
    for t in [&a, &b] {
        assert!(
            t.contains("'classifier.3.weight' has shape [2, 256] in the checkpoint but [8, 256]"),
            "{t}"
        );
    }
    let corrupt = dir.join("corrupt.safetensors");
    std::fs::write(&corrupt, b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":").unwrap();
    let (a, b) = both_fail(&[
        "--data",
        data_s,
        "--eval-only",
        "--resume",
        corrupt.to_str().unwrap(),
        "--out",
        out_s,
    ]);
    for t in [&a, &b] {
        assert!(
            t.contains("corrupt.safetensors' is not a valid safetensors file"),
            "{t}"
        );
    }
}

#[test]
fn torchrun_starts_ddp_train_ranks_that_train_together() {
    let tmp = temp_dir("torchrun");
    let dir = tmp.path();
    let data = data(dir, 24);
    let out = dir.join("run");
    let port = free_port().to_string();
    let child = ddp_testkit::torchrun(dir)
        .args([
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-port",
            &port,
            "--no-python",
            EXE,
        ])
        .args([
            "--data",
            data.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .args([
            "--epochs",
            "1",
            "--image-size",
            "32",
            "--batch-size",
            "4",
            "--threads",
            "1",
            "--workers",
            "1",
        ])
        .env("OMP_NUM_THREADS", "1")
        // As under a plain torchrun: no DDP_SECRET, so the ranks use the user's key file.
        .env("XDG_CONFIG_HOME", dir.join("config"))
        .env_remove("DDP_SECRET")
        .env_remove("DDP_SECRET_FILE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = wait_bounded(child, Duration::from_secs(120));
    let t = text(&output);
    assert!(output.status.success(), "{t}");
    assert!(dir.join("config/ddp/secret").is_file(), "no key file:\n{t}");
    // Both ranks took part: rank 1 announced itself, and the epoch's metrics count two ranks.
    assert!(t.contains("rank 1 of 2"), "{t}");
    let metrics = metrics_without_timing(&out);
    assert_eq!(metrics.len(), 1);
    assert_eq!(metrics[0]["world_size"], 2);
}

/// `--clip-grad-norm` clips after the average: every rank logs the same norms, each step's
/// line names it, and AdamW (`--optimizer adamw --weight-decay`) trains through the loop.
#[test]
fn clipping_logs_the_same_gradient_norm_on_every_rank() {
    let tmp = temp_dir("clip");
    let dir = tmp.path();
    let data = data(dir, 40);
    let out = dir.join("run");
    let mut args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    args.extend([
        "--clip-grad-norm",
        "0.05",
        "--log-every",
        "1",
        "--optimizer",
        "adamw",
        "--weight-decay",
        "0.01",
    ]);
    assert_all_ok(&run_ranks(2, &args, &[]));
    let norms = |rank: usize| -> Vec<String> {
        std::fs::read_to_string(out.join(format!("logs/rank-{rank}.log")))
            .unwrap()
            .lines()
            .filter_map(|l| l.split(" grad norm ").nth(1).map(str::to_owned))
            .collect()
    };
    let (a, b) = (norms(0), norms(1));
    assert_eq!(
        a.len(),
        12,
        "one norm per step: 3 epochs of 4 (32 training images, 4 x 2)"
    );
    assert_eq!(a, b, "the ranks clipped different gradients");
    // The synthetic task's gradients are larger than 0.05 at the start: clipping acted.
    let first: f64 = a[0].parse().unwrap();
    assert!(first > 0.05, "first norm {first}");
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(config.contains("\"kind\": \"adamw\""), "{config}");
    // metrics.jsonl has each epoch's mean of the logged norms (4 steps an epoch).
    let metrics = metrics_without_timing(&out);
    for (e, m) in metrics.iter().enumerate() {
        let logged: Vec<f64> = a[4 * e..4 * e + 4]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect();
        let mean = logged.iter().sum::<f64>() / 4.0;
        let reported = m["grad_norm"].as_f64().unwrap();
        assert!(
            (reported - mean).abs() < 1e-4,
            "epoch {}: {reported} vs {mean}",
            e + 1
        );
        assert!(m.get("skipped_steps").is_none(), "fp32 has no scaler: {m}");
    }
}

/// A per-step schedule (cosine after 3 warmup steps) is a function of the optimizer's step
/// count: a resumed run continues it exactly, and each epoch reports its last step's rate.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_resumed_run_continues_a_per_step_schedule_exactly() {
    check_resume(
        "resume-cosine",
        2,
        &["--lr-schedule", "cosine", "--warmup-steps", "3"],
    );
    let tmp = temp_dir("cosine-lrs");
    let dir = tmp.path();
    let data = data(dir, 40);
    let out = dir.join("run");
    let mut args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    args.extend(["--lr-schedule", "cosine", "--warmup-steps", "3"]);
    assert_all_ok(&run_ranks(2, &args, &[]));
    // 3 epochs of 4 steps; the last step of epoch e has t = 4e - 1 steps before it.
    let schedule = ddp_train::lr_schedule::LrSchedule::Cosine { warmup: 3 };
    let lrs: Vec<f64> = metrics_without_timing(&out)
        .iter()
        .map(|m| m["lr"].as_f64().unwrap())
        .collect();
    let want: Vec<f64> = (1..=3u64)
        .map(|e| schedule.lr(1e-3, (4 * e - 1) as f64, 12))
        .collect();
    assert_eq!(lrs.len(), 3);
    for (got, want) in lrs.iter().zip(&want) {
        assert!((got - want).abs() < 1e-12, "{lrs:?} vs {want:?}");
    }
    assert!(lrs[0] > lrs[1] && lrs[1] > lrs[2], "{lrs:?}");
}

/// Early stopping ends every rank after the same epoch: with an improvement threshold no
/// F1 can pass, the first epoch sets the best and the second is the one without improvement.
#[test]
fn early_stopping_ends_every_rank_after_the_same_epoch() {
    let tmp = temp_dir("early");
    let dir = tmp.path();
    let data = data(dir, 40);
    let out = dir.join("run");
    let mut args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    args.extend([
        "--early-stopping-patience",
        "1",
        "--early-stopping-min-delta",
        "1.0",
    ]);
    let outputs = run_ranks(2, &args, &[]);
    assert_all_ok(&outputs);
    assert_eq!(
        metrics_without_timing(&out).len(),
        2,
        "3 epochs asked, 2 run"
    );
    for rank in 0..2 {
        let log = std::fs::read_to_string(out.join(format!("logs/rank-{rank}.log"))).unwrap();
        assert!(
            log.contains(
                "early stopping after epoch 2: val_macro_f1 has not improved for 1 epochs"
            ),
            "rank {rank}:\n{log}"
        );
    }
    let state =
        checkpoint::read_tensors(out.join("checkpoints/epoch-0002.state.safetensors")).unwrap();
    let st: Value = serde_json::from_str(&state.metadata["train_state"]).unwrap();
    assert_eq!(st["early_stopping"]["bad_epochs"], 1, "{st}");
    assert_eq!(st["early_stopping"]["best"]["epoch"], 1, "{st}");
}

#[test]
fn ranks_given_different_checkpoints_all_stop_naming_both() {
    let tmp = temp_dir("resume-disagree");
    let data = data(tmp.path(), 24);
    let (data, out) = (data.to_str().unwrap(), tmp.path().join("run"));
    let out = out.to_str().unwrap();
    let mut args = train_args(data, out);
    args[3] = "2"; // two epochs: two checkpoints to disagree on
    assert_all_ok(&run_ranks(1, &args, &[]));
    let checkpoints = Path::new(out).join("checkpoints");
    let (second, first) = (
        checkpoints.join("epoch-0002.safetensors"),
        checkpoints.join("epoch-0001.safetensors"),
    );
    // Rank 0 continues from epoch 2, rank 1 from epoch 1: neither may train.
    let port = free_port();
    let children: Vec<_> = [&second, &first]
        .iter()
        .enumerate()
        .map(|(rank, resume)| {
            let mut cmd = rank_command(EXE, rank, 2, port);
            cmd.args(train_args(data, out))
                .args(["--threads", "1", "--workers", "1"])
                .arg("--resume")
                .arg(resume)
                .env("DDP_RDZV_TIMEOUT_S", "30")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    for (rank, o) in wait_all(children, Duration::from_secs(120))
        .iter()
        .enumerate()
    {
        let t = text(o);
        assert!(!o.status.success(), "rank {rank} trained:\n{t}");
        assert!(
            t.contains("rank 0 from epoch-0002.safetensors (epoch 2")
                && t.contains("rank 1 from epoch-0001.safetensors (epoch 1"),
            "rank {rank}:\n{t}"
        );
    }
}

#[test]
fn a_damaged_latest_checkpoint_falls_back_to_the_previous_one_with_a_warning() {
    let tmp = temp_dir("resume-fallback");
    let data = data(tmp.path(), 24);
    let (data, out) = (data.to_str().unwrap(), tmp.path().join("run"));
    let out = out.to_str().unwrap();
    let mut args = train_args(data, out);
    args[3] = "2";
    assert_all_ok(&run_ranks(1, &args, &[]));
    // A crash of the disk, not of the Trainer (which writes atomically): epoch 2's state is
    // cut short.
    let state = Path::new(out).join("checkpoints/epoch-0002.state.safetensors");
    let bytes = std::fs::read(&state).unwrap();
    std::fs::write(&state, &bytes[..bytes.len() / 2]).unwrap();

    let mut again = train_args(data, out);
    again.extend(["--resume", "latest"]);
    let outputs = run_ranks(2, &again, &[]);
    assert_all_ok(&outputs);
    let log = std::fs::read_to_string(Path::new(out).join("logs/rank-1.log")).unwrap();
    assert!(
        log.contains("warning: cannot resume from") && log.contains("epoch-0002.safetensors"),
        "{log}"
    );
    let t = text(&outputs[0]);
    assert!(
        t.contains("resumed from") && t.contains("epoch-0001.safetensors"),
        "{t}"
    );
    // Epochs 2 and 3 were trained again after epoch 1.
    let epochs: Vec<u64> = metrics_without_timing(Path::new(out))
        .iter()
        .map(|m| m["epoch"].as_u64().unwrap())
        .collect();
    assert_eq!(epochs, [1, 2, 3], "{epochs:?}");
    // The damaged checkpoint was set aside, not mixed with the new ones.
    assert!(
        t.contains("rewinds the run: its 1 later checkpoint(s) (epoch-0002) are moved to"),
        "{t}"
    );
    let aside: Vec<PathBuf> = std::fs::read_dir(Path::new(out).join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    let set_aside = std::fs::read(aside[0].join("epoch-0002.state.safetensors")).unwrap();
    assert_eq!(set_aside, bytes[..bytes.len() / 2]);

    // A file that cannot be read for a reason that is no damage (a folder in the latest
    // state file's place here; no permission, a stale NFS handle) is refused as it is,
    // naming the OS error once: a fallback would set the intact checkpoint aside.
    let dir = Path::new(out).join("checkpoints");
    let latest = dir.join("epoch-0003.state.safetensors");
    let intact = std::fs::read(&latest).unwrap();
    std::fs::remove_file(&latest).unwrap();
    std::fs::create_dir(&latest).unwrap();
    let (a, b) = both_fail(&again);
    for t in [&a, &b] {
        assert_eq!(t.matches("Is a directory").count(), 1, "{t}");
        assert!(
            t.contains(&format!(
                "cannot resume from {}, for a reason that is no damage of the file, so the \
                 run's older checkpoints were not tried",
                dir.join("epoch-0003.safetensors").display()
            )),
            "{t}"
        );
    }
    // Nothing was set aside or rewound.
    assert!(dir.join("epoch-0003.safetensors").is_file());
    assert_eq!(
        std::fs::read_to_string(dir.join("latest")).unwrap(),
        "epoch-0003\n"
    );
    std::fs::remove_dir(&latest).unwrap();
    std::fs::write(&latest, intact).unwrap();

    // With every checkpoint damaged, the error says what is left to do, and why the latest
    // cannot be read.
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.to_string_lossy().ends_with(".state.safetensors") {
            std::fs::write(&path, b"damaged").unwrap();
        }
    }
    let (a, b) = both_fail(&again);
    for t in [&a, &b] {
        assert!(
            t.contains(
                "; none of the 2 older checkpoint(s) of the run could be read either: to \
                 continue, give --resume with a checkpoint file that reads; to start a new \
                 run, another --out"
            ),
            "{t}"
        );
    }
}

/// Each epoch's validation scores rank 0's model, the one its checkpoint holds: evaluating
/// that checkpoint again on one rank gives the same figures. Without rank 0's BatchNorm
/// statistics sent first, rank 1 would score with the statistics its own last batch left.
#[test]
fn an_epochs_validation_equals_evaluating_its_checkpoint() {
    let tmp = temp_dir("val-is-checkpoint");
    let dir = tmp.path();
    let data = data(dir, 40);
    let out = dir.join("run");
    let data_s = data.to_str().unwrap();
    let mut args = train_args(data_s, out.to_str().unwrap());
    args[3] = "1";
    assert_all_ok(&run_ranks(2, &args, &[]));
    let trained = &metrics_without_timing(&out)[0];

    let checkpoint = out.join("checkpoints/epoch-0001.safetensors");
    let evaluate_into = |run: &std::path::Path| {
        run_ranks(
            1,
            &[
                "--data",
                data_s,
                "--image-size",
                "32",
                "--batch-size",
                "4",
                "--seed",
                "3",
                "--eval-only",
                "--resume",
                checkpoint.to_str().unwrap(),
                "--out",
                run.to_str().unwrap(),
            ],
            &[],
        )
    };
    let outputs = evaluate_into(&dir.join("again"));
    assert_all_ok(&outputs);
    let evaluated = report(&outputs[0]);

    // Evaluating into the training's own run directory leaves its config.json (and the job
    // id a requeue is recognised by) as training wrote it.
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    let outputs = evaluate_into(&out);
    assert_all_ok(&outputs);
    assert_eq!(report(&outputs[0]), evaluated);
    assert_eq!(
        std::fs::read_to_string(out.join("config.json")).unwrap(),
        config
    );

    for key in ["val_loss", "odir_auc", "odir_kappa", "val_macro_f1"] {
        let (a, b) = (
            trained[key].as_f64().unwrap(),
            evaluated[key].as_f64().unwrap(),
        );
        assert!(
            (a - b).abs() <= 1e-6 * a.abs().max(1.0),
            "{key}: {a} in training, {b} from the checkpoint"
        );
    }
}

/// Without `--skip-corrupt`, an image that does not decode, or one over the decoder's pixel
/// limit, stops training naming it, and the message says that the flag exists.
#[test]
fn an_undecodable_image_stops_training_and_points_to_skip_corrupt() {
    let bomb = ddp_testkit::png_header_only(20_000, 20_000);
    for (bytes, why) in [
        (&b"\xff\xd8 not a jpeg"[..], "cannot be decoded"),
        (&bomb[..], "is 20000 x 20000 pixels, over the limit"),
    ] {
        let tmp = temp_dir("undecodable");
        let dir = tmp.path();
        let data = data(dir, 16);
        let names = images_of(&data);
        std::fs::write(&names[5], bytes).unwrap();
        let out = dir.join("run");
        let mut args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
        args[3] = "1";
        let outputs = run_ranks(1, &args, &[]);
        let err = String::from_utf8_lossy(&outputs[0].stderr).into_owned();
        assert!(!outputs[0].status.success(), "{err}");
        assert!(
            err.contains(
                "error: training stopped at an image that does not decode (--skip-corrupt \
                 decodes every image at the start and leaves out, naming each, those that fail)"
            ) && err.contains(&format!("image '{}' {why}", names[5].display())),
            "{err}"
        );
    }
}

/// Runs two ranks of `ddp-train`, rank `r` with `args[r]` (and one intra-op thread and one
/// loader worker), and returns each rank's output in rank order.
fn run_each(args: [Vec<String>; 2]) -> Vec<Output> {
    let port = ddp_testkit::free_port();
    let children = args
        .iter()
        .enumerate()
        .map(|(rank, args)| {
            let mut cmd = ddp_testkit::rank_command(EXE, rank, 2, port);
            cmd.args(args)
                .args(["--threads", "1", "--workers", "1"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    ddp_testkit::wait_all(children, Duration::from_secs(120))
}

/// Asserts that every rank of `outputs` failed, before training, with an error containing
/// each of `expected`.
fn all_fail_saying(outputs: &[Output], expected: &[&str]) {
    for (rank, o) in outputs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "rank {rank}: {err}");
        assert!(!text(o).contains("epoch 1/"), "rank {rank} trained: {err}");
        for e in expected {
            assert!(err.contains(e), "rank {rank} does not say {e:?}: {err}");
        }
    }
}

/// `train_args` on `data` into `out`, and `extra`, as owned strings.
fn args_with(data: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    args.extend(extra);
    args.into_iter().map(String::from).collect()
}

/// Runs two ranks on two synthetic folders of `images[r]` images (the same sample where the
/// numbers are equal), rank 1's changed by `edit` first, and returns their outputs.
fn on_two_folders(name: &str, images: [usize; 2], edit: impl FnOnce(&Path)) -> Vec<Output> {
    let tmp = temp_dir(name);
    let out = tmp.path().join("run");
    let [a, b] = [("a", images[0]), ("b", images[1])].map(|(d, n)| data(&tmp.path().join(d), n));
    edit(&b);
    run_each([args_with(&a, &out, &[]), args_with(&b, &out, &[])])
}

/// Ranks that open different data (another copy of the folder, say) stop before training,
/// every one naming both sizes, instead of sharding mismatched lists.
#[test]
fn ranks_that_open_different_data_stop_naming_both() {
    let outputs = on_two_folders("different-data", [16, 20], |_| {});
    all_fail_saying(
        &outputs,
        &[
            "the ranks opened different data: rank 0 has 12 training and 4 validation samples, \
           rank 1 16 training and 4 validation samples",
        ],
    );
}

/// A copy of the data with the same images and other labels on one rank stops every rank
/// before training, naming the labels, instead of training on mixed labels.
#[test]
fn ranks_that_open_data_with_other_labels_stop_naming_them() {
    // Every image of the copy relabelled "N" (its per-eye target), as a hand-edited copy.
    let outputs = on_two_folders("relabelled-data", [16, 16], |copy| {
        let csv = copy.join("full_df.csv");
        let table = std::fs::read_to_string(&csv).unwrap();
        let target = |line: &str| {
            line.rfind("\"[")
                .map(|i| (i, line[i..].find("]\"").unwrap() + i + 2))
        };
        let relabelled: Vec<String> = table
            .lines()
            .map(|line| match target(line) {
                Some((from, to)) => {
                    format!(
                        "{}\"[1, 0, 0, 0, 0, 0, 0, 0]\"{}",
                        &line[..from],
                        &line[to..]
                    )
                }
                None => line.to_string(),
            })
            .collect();
        assert_ne!(
            relabelled.join("\n"),
            table.trim_end(),
            "no target was relabelled"
        );
        std::fs::write(&csv, relabelled.join("\n") + "\n").unwrap();
    });
    all_fail_saying(
        &outputs,
        &[
            "the ranks opened different data: rank 0 and rank 1 have 12 training and 4 \
           validation samples each, but different labels",
        ],
    );
}

/// Ranks started with different settings stop before training, every one naming each
/// setting with both values and the ranks; what a rank sets its own way (how often it logs
/// its loss, here) may differ.
#[test]
fn ranks_started_with_different_settings_stop_naming_them() {
    let tmp = temp_dir("different-settings");
    let (data, out) = (data(tmp.path(), 16), tmp.path().join("run"));
    let rank0 = args_with(&data, &out, &["--lr", "1e-3"]);
    let hook = ["--comm-hook", "bf16_compress", "--log-every", "1"];
    let rank1 = args_with(&data, &out, &[&["--lr", "1e-1"], &hook[..]].concat());
    let outputs = run_each([rank0, rank1]);
    all_fail_saying(
        &outputs,
        &[
            "the ranks were started with different settings: rank 1 has --comm-hook \
           bf16_compress, rank 0 allreduce; rank 1 has --lr 0.1, rank 0 0.001: give every rank \
           the same command",
        ],
    );
}

/// A resume on ranks given different batch sizes names `--batch-size`: the settings are
/// compared before the resume points, which include the batch layout.
#[test]
fn ranks_resumed_with_different_batch_sizes_stop_naming_the_setting() {
    let tmp = temp_dir("different-batch-resume");
    let (data, out) = (data(tmp.path(), 40), tmp.path().join("run"));
    let first = args_with(&data, &out, &["--max-steps-per-epoch", "1"]);
    let outputs = run_each([first.clone(), first]);
    assert_all_ok(&outputs);
    let resumed = args_with(
        &data,
        &out,
        &["--max-steps-per-epoch", "1", "--resume", "latest"],
    );
    let mut larger = resumed.clone();
    let at = larger.iter().position(|a| a == "--batch-size").unwrap() + 1;
    larger[at] = "8".to_string();
    let outputs = run_each([resumed, larger]);
    all_fail_saying(
        &outputs,
        &["the ranks were started with different settings: rank 1 has --batch-size 8, rank 0 4"],
    );
}

/// A `--val-data` that holds patients of `--data` (here the same folder) is warned of.
#[test]
fn validation_data_sharing_patients_with_the_training_data_is_warned_of() {
    let tmp = temp_dir("val-data-shared");
    let dir = tmp.path();
    let data = data(dir, 16);
    let out = dir.join("run");
    let data_s = data.to_str().unwrap();
    let mut args = train_args(data_s, out.to_str().unwrap());
    args[3] = "1";
    args.extend(["--max-steps-per-epoch", "1", "--val-data", data_s]);
    let outputs = run_ranks(1, &args, &[]);
    assert_all_ok(&outputs);
    let rank0 = String::from_utf8_lossy(&outputs[0].stderr).into_owned();
    assert!(
        rank0.contains(&format!(
            "warning: --val-data {data_s} shares 8 patient ID(s) with --data (the first: "
        )),
        "{rank0}"
    );
}

/// `--skip-corrupt` trains on the images that decode and names each one it leaves out:
/// once, on rank 0's stderr, and in `config.json`.
#[test]
fn skip_corrupt_names_each_image_it_leaves_out_once() {
    let tmp = temp_dir("skip-corrupt");
    let dir = tmp.path();
    let data = data(dir, 40);
    let names = images_of(&data);
    let (truncated, garbage) = (names[3].clone(), names[20].clone());
    let bytes = std::fs::read(&truncated).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 3]).unwrap();
    std::fs::write(&garbage, b"\xff\xd8 not a jpeg").unwrap();
    let out = dir.join("run");
    let mut args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    args[3] = "1";
    args.push("--skip-corrupt");
    let outputs = run_ranks(2, &args, &[]);
    assert_all_ok(&outputs);
    let rank0 = String::from_utf8_lossy(&outputs[0].stderr).into_owned();
    for path in [&truncated, &garbage] {
        let warning = format!("warning: left out {} (--skip-corrupt): ", path.display());
        assert_eq!(rank0.matches(&warning).count(), 1, "{rank0}");
        assert!(
            !text(&outputs[1]).contains(&warning),
            "{}",
            text(&outputs[1])
        );
    }
    let stdout = String::from_utf8_lossy(&outputs[0].stdout);
    let data_line = stdout.lines().find(|l| l.starts_with("data: ")).unwrap();
    let count = |what: &str| -> usize {
        let before = data_line.split(what).next().unwrap();
        before.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(
        count(" training samples") + count(" validation samples"),
        38,
        "{data_line}"
    );
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    let mut listed: Vec<&str> = config["task"]["skipped_images"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["path"].as_str().unwrap())
        .collect();
    listed.sort_unstable();
    assert_eq!(
        listed,
        [truncated.to_str().unwrap(), garbage.to_str().unwrap()]
    );
}

/// A new start in the run directory of a finished run is refused on every rank, naming
/// what to do, and leaves the run's files as they were; so is the launcher's restart of that
/// start (another job's). The run's own job, restarted, continues it; `--resume latest` too.
#[test]
fn a_new_start_over_a_finished_run_is_refused_and_writes_nothing() {
    let tmp = temp_dir("over-finished");
    let dir = tmp.path();
    let data = data(dir, 40);
    let out = dir.join("run");
    let out_s = out.to_str().unwrap();
    let mut args = train_args(data.to_str().unwrap(), out_s);
    args[3] = "1";
    let job = |id| {
        [
            ("TORCHELASTIC_RUN_ID", id),
            ("TORCHELASTIC_RESTART_COUNT", "1"),
        ]
    };
    assert_all_ok(&run_ranks(2, &args, &job("job-a")[..1]));
    let metrics = std::fs::read(out.join("metrics.jsonl")).unwrap();
    let model = std::fs::read(out.join("checkpoints/epoch-0001.safetensors")).unwrap();

    let refusal = format!(
        "--out {out_s} already holds a run (its {out_s}/checkpoints/latest names epoch-0001): \
         continue it with --resume latest, or give another --out"
    );
    for env in [&[][..], &job("job-b")] {
        let (a, b) = both_fail_with(&args, env);
        for t in [&a, &b] {
            assert!(t.contains(&refusal), "{env:?}: {t}");
        }
    }
    assert_eq!(std::fs::read(out.join("metrics.jsonl")).unwrap(), metrics);
    assert_eq!(
        std::fs::read(out.join("checkpoints/epoch-0001.safetensors")).unwrap(),
        model
    );
    assert_eq!(
        std::fs::read_to_string(out.join("checkpoints/latest")).unwrap(),
        "epoch-0001\n"
    );

    // Two epochs in all: the run's own restart continues it.
    let mut more = args.clone();
    more[3] = "2";
    let outputs = run_ranks(2, &more, &job("job-a"));
    assert_all_ok(&outputs);
    let t = text(&outputs[0]);
    assert!(
        t.contains("after the launcher's restart") && !t.contains("epoch 1/2"),
        "{t}"
    );
    assert_eq!(metrics_without_timing(&out).len(), 2);
    // Three: a new job continues it with --resume latest.
    more[3] = "3";
    more.extend(["--resume", "latest"]);
    let outputs = run_ranks(2, &more, &[]);
    assert_all_ok(&outputs);
    let t = text(&outputs[0]);
    assert!(t.contains("epoch 3/3") && !t.contains("epoch 2/3"), "{t}");
    assert_eq!(metrics_without_timing(&out).len(), 3);
}

/// On a file system without `flock` (Lustre mounted `noflock` answers `ENOSYS`, injected
/// here), rank 0 warns once that nothing keeps a second job out, and still rewinds a run
/// that resumes an older checkpoint of its own: `latest` names it, the later checkpoints are
/// set aside, `metrics.jsonl` is cut back and the curves redrawn (the resumed start fails at
/// its first step).
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_rewind_on_a_file_system_without_locks_sets_the_later_history_aside() {
    let tmp = temp_dir("no-flock");
    let data = data(tmp.path(), 24);
    let out = tmp.path().join("run");
    let mut args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    args[3] = "4";
    assert_all_ok(&run_ranks(1, &args, &[]));
    let checkpoints = out.join("checkpoints");
    let epoch = |e: u64| std::fs::read(checkpoints.join(format!("epoch-000{e}.safetensors")));
    let (third, fourth) = (epoch(3).unwrap(), epoch(4).unwrap());
    let curves = std::fs::read(out.join("curves.png")).unwrap();

    let resumed = checkpoints.join("epoch-0002.safetensors");
    args.extend(["--resume", resumed.to_str().unwrap()]);
    let enosys = libc::ENOSYS.to_string();
    let env = [
        ("DDP_TRAIN_FLOCK_ERRNO", enosys.as_str()),
        ("DDP_TRAIN_FAIL_RANK", "0"),
        ("DDP_TRAIN_FAIL_AT", "3:0"),
    ];
    let outputs = run_ranks(1, &args, &env);
    assert_eq!(outputs[0].status.code(), Some(17), "{}", text(&outputs[0]));
    let log = std::fs::read_to_string(out.join("logs/rank-0.log")).unwrap();
    let warning = format!(
        "warning: the run directory {0} cannot be locked on this file system ({0}/.lock: \
         Function not implemented (os error 38)): nothing refuses a second job on the same \
         --out, so start only one",
        out.display()
    );
    assert_eq!(log.matches(&warning).count(), 1, "{log}");
    assert_eq!(
        std::fs::read_to_string(checkpoints.join("latest")).unwrap(),
        "epoch-0002\n"
    );
    assert!(epoch(3).is_err() && epoch(4).is_err());
    let aside: Vec<PathBuf> = std::fs::read_dir(&checkpoints)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    for (e, model) in [(3, third), (4, fourth)] {
        let set_aside = aside[0].join(format!("epoch-000{e}.safetensors"));
        assert_eq!(std::fs::read(set_aside).unwrap(), model, "epoch {e}");
    }
    assert_eq!(metrics_without_timing(&out).len(), 2);
    // The curves of four epochs went with the later ones; the start drew the two kept.
    assert_eq!(std::fs::read(aside[0].join("curves.png")).unwrap(), curves);
    let redrawn = std::fs::read(out.join("curves.png")).unwrap();
    assert!(redrawn.starts_with(b"\x89PNG") && redrawn != curves);
}

/// On a `hard` NFS mount whose lock manager does not answer, `flock` blocks in the kernel
/// (injected here): rank 0 gives up on the lock after 10 s, warns, and trains, and rank 1,
/// waiting for its verdict, does not reach its 30 s collective timeout.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_lock_manager_that_never_answers_is_warned_of_and_the_run_trains() {
    let tmp = temp_dir("flock-hang");
    let data = data(tmp.path(), 24);
    let out = tmp.path().join("run");
    let mut args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    args[3] = "1";
    let outputs = run_ranks(2, &args, &[("DDP_TRAIN_FLOCK_HANG", "1")]);
    assert_all_ok(&outputs);
    let log = std::fs::read_to_string(out.join("logs/rank-0.log")).unwrap();
    let warning = format!(
        "warning: no answer from the file system's lock manager within 10 s for {0}/.lock; \
         the run directory {0} is not locked against a second job, so start only one on this \
         --out",
        out.display()
    );
    assert_eq!(log.matches(&warning).count(), 1, "{log}");
    assert_eq!(metrics_without_timing(&out).len(), 1);
}

/// A second job on the `--out` of a job that is still running is refused on all its ranks,
/// naming the holder, before it writes anything; the first job ends as it would have.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "needs --features fault-injection (slow steps)"
)]
fn a_second_job_on_a_run_directory_in_use_is_refused() {
    let tmp = temp_dir("out-in-use");
    let dir = tmp.path();
    let data = data(dir, 40);
    let out = dir.join("run");
    let (data_s, out_s) = (data.to_str().unwrap(), out.to_str().unwrap());
    let mut args = train_args(data_s, out_s);
    args[3] = "1";
    // The first job: 4 steps of a second each, so that the second job starts (and passes
    // the check for a finished run's checkpoints) before the first writes its checkpoint.
    let port = free_port();
    let first: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = rank_command(EXE, rank, 2, port);
            cmd.args(&args)
                .args(["--threads", "1", "--workers", "1"])
                .env("DDP_TRAIN_STEP_SLEEP_MS", "1000")
                .env("DDP_RDZV_TIMEOUT_S", "30")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let lock = out.join(".lock");
    wait_for("the first job's lock", Duration::from_secs(60), || {
        std::fs::read_to_string(&lock).is_ok_and(|t| t.starts_with("pid "))
    });
    let holder = std::fs::read_to_string(&lock).unwrap();

    let (a, b) = both_fail(&args);
    let refusal = format!(
        "--out {out_s} is in use by another job ({holder}, which holds {}): give another \
         --out, or wait for that job to end",
        lock.display()
    );
    for t in [&a, &b] {
        assert!(t.contains(&refusal), "{t}");
    }
    let outputs = wait_all(first, Duration::from_secs(120));
    assert_all_ok(&outputs);
    assert_eq!(metrics_without_timing(&out).len(), 1);
}

/// SIGTERM to a rank still waiting for the others at the rendezvous (a preemption while the
/// job starts) is a stop like one during training: every rank stops at the first step with
/// a checkpoint and exit code 75, from which the run continues.
#[test]
fn a_stop_asked_for_while_the_ranks_start_is_taken_at_the_first_step() {
    let tmp = temp_dir("stop-at-start");
    let dir = tmp.path();
    let data = data(dir, 24);
    let out = dir.join("run");
    let args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    let port = free_port();
    let rank = |r: usize| {
        let mut cmd = rank_command(EXE, r, 2, port);
        cmd.args(&args)
            .env("DDP_RDZV_TIMEOUT_S", "60")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd.spawn().unwrap()
    };
    let first = rank(0);
    // Rank 0 serves the store once it is waiting for rank 1.
    wait_for("rank 0's store", Duration::from_secs(60), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    // SAFETY: kill(2) on a child this test started and has not waited for.
    assert_eq!(unsafe { libc::kill(first.id() as i32, libc::SIGTERM) }, 0);
    let outputs = wait_all(vec![first, rank(1)], Duration::from_secs(120));
    assert_stopped_at_the_first_step(&outputs, &out, "");
}

/// So is SIGTERM to a rank still opening its data, before its Trainer exists (a task's data
/// can take minutes: `--skip-corrupt` decodes every image): `cli::run` watches the signals
/// from before the program's body runs, for the Trainer to take at its first step. Rank 0 is
/// held before it opens the data (the `fault-injection` build's `DDP_TRAIN_OPEN_DATA_AFTER`)
/// until the signal has been sent.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_stop_asked_for_while_a_rank_opens_its_data_is_taken_at_the_first_step() {
    let tmp = temp_dir("stop-while-opening");
    let dir = tmp.path();
    let data = data(dir, 24);
    let out = dir.join("run");
    let (go, log) = (dir.join("go"), dir.join("rank-0.err"));
    let args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    let port = free_port();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let mut cmd = rank_command(EXE, r, 2, port);
            cmd.args(&args)
                .env("DDP_RDZV_TIMEOUT_S", "60")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if r == 0 {
                cmd.env("DDP_TRAIN_OPEN_DATA_AFTER", &go)
                    .stderr(std::fs::File::create(&log).unwrap());
            }
            cmd.spawn().unwrap()
        })
        .collect();
    let held = |t: &str| t.contains("before opening the data");
    wait_for(
        "rank 0 held before its data",
        Duration::from_secs(60),
        || std::fs::read_to_string(&log).is_ok_and(|t| held(&t)),
    );
    // SAFETY: kill(2) on a child this test started and has not waited for.
    assert_eq!(
        unsafe { libc::kill(ranks[0].id() as i32, libc::SIGTERM) },
        0
    );
    std::fs::write(&go, "").unwrap();
    let outputs = wait_all(ranks, Duration::from_secs(120));
    let rank0_err = std::fs::read_to_string(&log).unwrap();
    let rank0 = text(&outputs[0]);
    assert!(
        rank0.contains("stopping at epoch 1 step 0 (SIGTERM)"),
        "{rank0}{rank0_err}"
    );
    assert_stopped_at_the_first_step(&outputs, &out, &rank0_err);
}

/// A stop asked for while the data opens, with no Trainer ever made (the data is gone), keeps
/// its action, and the error is printed first: the user learns why the rank ended.
#[test]
fn a_stop_before_a_failed_start_ends_the_rank_after_its_error_is_printed() {
    use std::os::unix::process::ExitStatusExt;
    let tmp = temp_dir("stop-then-fail");
    let dir = tmp.path();
    let data = data(dir, 24);
    let (go, log, out) = (dir.join("go"), dir.join("rank.err"), dir.join("run"));
    let args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    let child = Command::new(EXE)
        .args(&args)
        .env("DDP_TRAIN_OPEN_DATA_AFTER", &go)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    wait_for(
        "the rank held before its data",
        Duration::from_secs(60),
        || std::fs::read_to_string(&log).is_ok_and(|t| t.contains("before opening the data")),
    );
    // SAFETY: kill(2) on a child this test started and has not waited for.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    std::fs::remove_dir_all(&data).unwrap();
    std::fs::write(&go, "").unwrap();
    let output = wait_all(vec![child], Duration::from_secs(60)).remove(0);
    let err = std::fs::read_to_string(&log).unwrap();
    assert_eq!(output.status.signal(), Some(libc::SIGTERM), "{err}");
    assert!(
        err.contains("error: ") && err.contains(data.to_str().unwrap()),
        "{err}"
    );
}

/// Every rank of `outputs` exited 75, and the run `out` has a checkpoint of its first step
/// only. `more` is what rank 0 wrote elsewhere.
fn assert_stopped_at_the_first_step(outputs: &[Output], out: &Path, more: &str) {
    for o in outputs {
        assert_eq!(o.status.code(), Some(75), "{}{more}", text(o));
    }
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert_eq!(
        latest.trim(),
        "epoch-0001-step-000000",
        "{}{more}",
        text(&outputs[0])
    );
}

/// A reader that has gone (`ddp-train ... | head -1`) costs the lines it would have read, not
/// the run: the last line on the closed stdout (`done: ...`) is dropped, where `println!`
/// would panic with exit code 101.
#[test]
fn a_run_whose_stdout_is_closed_ends_as_it_would_without_panicking() {
    let tmp = temp_dir("closed-stdout");
    let dir = tmp.path();
    let data = data(dir, 24);
    let out = dir.join("run");
    let mut args = train_args(data.to_str().unwrap(), out.to_str().unwrap());
    args[3] = "1";
    let (reader, closed) = std::io::pipe().unwrap();
    drop(reader);
    let child = Command::new(EXE)
        .args(&args)
        .args(["--threads", "1", "--workers", "1"])
        .stdout(closed)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = wait_bounded(child, Duration::from_secs(120));
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(metrics_without_timing(&out).len(), 1, "{err}");
}

/// Without `--collective-timeout`, a rank's collectives time out after ddp-comm's
/// `DDP_OP_TIMEOUT_S`: here 1 s, while rank 1 takes 4 s for its first step.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn the_collective_timeout_defaults_to_ddp_op_timeout_s() {
    let tmp = temp_dir("op-timeout-env");
    let dir = tmp.path();
    let data = data(dir, 24);
    let out = dir.join("run");
    let port = free_port();
    let children = (0..2)
        .map(|rank| {
            let mut cmd = rank_command(EXE, rank, 2, port);
            cmd.args(["--data", data.to_str().unwrap(), "--out"])
                .arg(&out)
                .args(["--image-size", "32", "--batch-size", "4", "--epochs", "1"])
                .args(["--threads", "1", "--workers", "1", "--device", "cpu"])
                .env("DDP_OP_TIMEOUT_S", "1")
                .env(
                    "DDP_TRAIN_STEP_SLEEP_MS",
                    if rank == 1 { "4000" } else { "0" },
                )
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let outputs = wait_all(children, Duration::from_secs(60));
    let rank0 = text(&outputs[0]);
    assert_eq!(outputs[0].status.code(), Some(1), "{rank0}");
    assert!(rank0.contains("timed out after 1s"), "{rank0}");
}

/// A rank outside its world (RANK=2 of WORLD_SIZE=2) is refused by the rendezvous before any
/// data is sharded, and rank 0 learns it at once rather than at its rendezvous timeout.
#[test]
fn a_rank_outside_its_world_fails_every_rank_at_once() {
    let tmp = temp_dir("rank-out-of-range");
    let dir = tmp.path();
    let data = data(dir, 24);
    let out = dir.join("run");
    let port = free_port();
    let children = [0, 2]
        .into_iter()
        .map(|rank| {
            let mut cmd = rank_command(EXE, rank, 2, port);
            cmd.args(["--data", data.to_str().unwrap(), "--out"])
                .arg(&out)
                .args(["--image-size", "32", "--batch-size", "4", "--device", "cpu"])
                .env("DDP_RDZV_TIMEOUT_S", "100")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let outputs = wait_all(children, Duration::from_secs(60));
    for o in &outputs {
        assert_eq!(o.status.code(), Some(1), "{}", text(o));
        assert!(
            text(o).contains("rank 2 is out of range for world size 2"),
            "{}",
            text(o)
        );
    }
}

/// A resume that cannot continue the run as it was is refused before anything is loaded:
/// another seed, another optimizer, a momentum without buffers, or another number of training
/// samples inside an epoch;
/// what the checkpoint's state overrides (the plateau scheduler's learning rate and
/// settings) is a warning.
#[test]
fn a_resume_refuses_what_cannot_continue_the_run_and_warns_of_what_it_keeps() {
    let tmp = temp_dir("resume-refusals");
    let dir = tmp.path();
    let data = data(dir, 24);
    let data_s = data.to_str().unwrap();
    let run = dir.join("run");
    let common = ["--data", data_s, "--image-size", "32", "--batch-size", "4"];
    let with = |more: &[&str]| -> Vec<String> {
        common.iter().chain(more).map(|s| s.to_string()).collect()
    };
    let args = with(&["--epochs", "1", "--checkpoint-every", "2", "--out"]);
    let mut first: Vec<&str> = args.iter().map(String::as_str).collect();
    first.push(run.to_str().unwrap());
    assert_all_ok(&run_ranks(1, &first, &[]));

    let epoch = run.join("checkpoints/epoch-0001.safetensors");
    let step = run.join("checkpoints/epoch-0001-step-000002.safetensors");
    let resume = |file: &Path, out: &str, more: &[&str]| {
        let out = dir.join(out);
        let mut all = with(&["--epochs", "2", "--resume", file.to_str().unwrap()]);
        all.extend(["--out".to_string(), out.to_str().unwrap().to_string()]);
        all.extend(more.iter().map(|s| s.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        run_ranks(1, &all, &[]).remove(0)
    };
    let refusal = |o: &Output| {
        assert_eq!(o.status.code(), Some(1), "{}", text(o));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = refusal(&resume(&epoch, "seed", &["--seed", "7"]));
    assert!(
        e.contains(&format!(
            "error: --seed 7 differs from the seed 0 of {}: every epoch's order",
            epoch.display()
        )) && e.contains("resume with the same --seed"),
        "{e}"
    );
    let e = refusal(&resume(&epoch, "sgd", &["--optimizer", "sgd"]));
    assert!(
        e.contains(&format!(
            "error: --optimizer sgd is not the optimizer of {} (adam)",
            epoch.display()
        )),
        "{e}"
    );
    // SGD without momentum left no buffers for a momentum to continue from.
    let sgd_run = dir.join("sgd-run");
    let mut plain: Vec<&str> = common.to_vec();
    plain.extend(["--epochs", "1", "--optimizer", "sgd", "--out"]);
    plain.push(sgd_run.to_str().unwrap());
    assert_all_ok(&run_ranks(1, &plain, &[]));
    let sgd_epoch = sgd_run.join("checkpoints/epoch-0001.safetensors");
    let e = refusal(&resume(
        &sgd_epoch,
        "momentum",
        &["--optimizer", "sgd", "--momentum", "0.9"],
    ));
    assert!(
        e.contains(&format!(
            "error: --momentum 0.9 cannot continue {}, which trained without momentum",
            sgd_epoch.display()
        )) && e.contains("resume with --momentum 0, or start a new run from its weights"),
        "{e}"
    );
    // A checkpoint of another model says so in a bounded list, before its optimizer state.
    let e = refusal(&resume(&epoch, "resnet", &["--model", "resnet18"]));
    assert!(
        e.contains("does not fit the model (nothing was loaded): 'bn1.bias' is missing")
            && e.contains("and 140 more (116 missing from the file, 24 not in the model)"),
        "{e}"
    );
    let e = refusal(&resume(&step, "split", &["--val-split", "0.3"]));
    assert!(
        e.contains(&format!(
            "error: {} stopped inside epoch 1 of 20 training samples, and the training set now \
             has 16",
            step.display()
        )),
        "{e}"
    );

    let kept = resume(&epoch, "lr", &["--lr", "0.5", "--plateau-factor", "0.9"]);
    assert!(kept.status.success(), "{}", text(&kept));
    let log = text(&kept);
    assert!(
        log.contains(
            "warning: learning rate 5e-1 is not applied: the run continues at its own 1e-3"
        ),
        "{log}"
    );
    assert!(
        log.contains(
            "warning: the plateau scheduler continues with the run's own settings (factor 0.5, \
             patience 2, min_lr 1e-6)"
        ),
        "{log}"
    );
}

/// Fewer validation samples than ranks (2 on 3 ranks): the rank without any still takes part
/// in combining the sums, and the epoch's figures equal one process evaluating its
/// checkpoint, in the run's own folder, whose record the evaluation leaves as it is.
#[test]
fn fewer_validation_samples_than_ranks_still_evaluate_exactly() {
    let tmp = temp_dir("tiny-val");
    let dir = tmp.path();
    let data = data(dir, 24);
    let data_s = data.to_str().unwrap();
    let out = dir.join("run");
    let common = [
        "--data",
        data_s,
        "--image-size",
        "32",
        "--batch-size",
        "2",
        "--val-split",
        "0.1",
    ];
    let mut train: Vec<&str> = common.to_vec();
    train.extend(["--epochs", "1", "--out", out.to_str().unwrap()]);
    let outputs = run_ranks(3, &train, &[]);
    assert_all_ok(&outputs);
    assert!(
        text(&outputs[0]).contains("2 validation samples"),
        "{}",
        text(&outputs[0])
    );
    let trained = &metrics_without_timing(&out)[0];
    let checkpoint = out.join("checkpoints/epoch-0001.safetensors");
    let record = |f: &str| std::fs::read(out.join(f)).unwrap();
    let before = (record("metrics.jsonl"), record("config.json"));
    let mut eval: Vec<&str> = common.to_vec();
    eval.extend([
        "--eval-only",
        "--resume",
        checkpoint.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let outputs = run_ranks(1, &eval, &[]);
    assert_all_ok(&outputs);
    assert!(before == (record("metrics.jsonl"), record("config.json")));
    let evaluated = report(&outputs[0]);
    for key in ["val_loss", "odir_auc", "val_macro_f1", "val_micro_f1"] {
        let (a, b) = (
            trained[key].as_f64().unwrap(),
            evaluated[key].as_f64().unwrap(),
        );
        assert!(
            (a - b).abs() <= 1e-6 * a.abs().max(1.0),
            "{key}: {a} vs {b}"
        );
    }
}
