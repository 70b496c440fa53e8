//! A non-finite training loss on one rank: with fp16's gradient scaler every rank skips that
//! step and halves its scale, and training goes on; without a scaler every rank stops at
//! that step with the same error, naming the rank that saw it. Ranks are real processes on
//! loopback (CPU): this test binary re-invoked with `--ignored --exact rank_worker`, a small
//! MLP whose loss becomes `loss + inf` (finite gradients: only the Trainer can make the
//! other ranks see it) on rank 1 at one chosen call.

mod common;

use common::regression::{points, Regression};
use common::{assert_all_ok, spawn_worker_ranks, text, wait_all};

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use ddp_model::checkpoint;
use ddp_train::{Precision, Settings, Trainer};
use serde_json::Value;

const WORKER: &str = "rank_worker";
const OUT_ENV: &str = "NON_FINITE_TEST_OUT";
const PRECISION_ENV: &str = "NON_FINITE_TEST_PRECISION";
const ACCUMULATE_ENV: &str = "NON_FINITE_TEST_ACCUMULATE";
/// Set on the rank whose loss becomes infinite: at which call of `train_loss` (from 0).
const BAD_CALL_ENV: &str = "NON_FINITE_TEST_BAD_CALL";
/// Set: clip the gradients' norm to this, checkpoint after every step (keeping them all), and
/// decay the learning rate linearly to 0 over the run's steps (12 on 2 ranks).
const CLIP_ENV: &str = "NON_FINITE_TEST_CLIP";
/// Set: the checkpoint file to resume from.
const RESUME_ENV: &str = "NON_FINITE_TEST_RESUME";
/// 64 training points: 4 micro-batches of 8 per rank per epoch on 2 ranks, 8 on 1.
const POINTS: i64 = 64;
const BATCH: usize = 8;
const EPOCHS: u64 = 3;

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// One rank: 3 epochs of Adam in `NON_FINITE_TEST_PRECISION`, `NON_FINITE_TEST_ACCUMULATE`
/// micro-batches per step, logging every step, into `NON_FINITE_TEST_OUT` (with
/// `NON_FINITE_TEST_CLIP`: clipping, and a checkpoint every step; with
/// `NON_FINITE_TEST_RESUME`: resuming that checkpoint); prints the Trainer's error and exits
/// with its code.
#[test]
#[ignore = "a rank of the tests in this file, started by them"]
fn rank_worker() {
    ddp_train::logging::init();
    let out = var(OUT_ENV).expect("the test sets the run directory");
    let precision = match var(PRECISION_ENV).as_deref() {
        Some("fp16") => Precision::Fp16,
        _ => Precision::Fp32,
    };
    let accumulate = var(ACCUMULATE_ENV).map_or(1, |n| n.parse().expect("a number"));
    let mut settings = Settings::default()
        .epochs(EPOCHS)
        .batch_size(BATCH)
        .accumulate(accumulate)
        .precision(precision)
        .seed(7)
        .out(Some(out.into()));
    settings.runtime.threads = Some(1);
    settings.runtime.workers = Some(1);
    settings.runtime.progress = false;
    settings.runtime.log_every = 1;
    settings.runtime.collective_timeout_secs = Some(20);
    if let Some(max) = var(CLIP_ENV) {
        settings.clip_grad_norm = Some(max.parse().expect("a number"));
        settings.checkpoint.every = Some(1);
        settings.checkpoint.keep = 100;
        settings.lr_schedule = ddp_train::lr_schedule::LrSchedule::Linear { warmup: 0 };
    }
    settings.checkpoint.resume = var(RESUME_ENV);
    let mut task = Regression::new(points(POINTS, 1), points(16, 2));
    // Small, so that fp16's first scale (2^16) overflows no gradient by itself.
    task.loss_scale = 1e-3;
    task.inf_at = var(BAD_CALL_ENV).map(|n| n.parse().expect("a number"));
    let code = match Trainer::new(task, settings).and_then(|mut t| t.run()) {
        Ok(_) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    };
    std::process::exit(i32::from(code));
}

/// Two ranks in `precision` with `accumulate` (and `clip`, see [`CLIP_ENV`]), rank 1's loss
/// infinite at its `bad_call`-th micro-batch; their outputs.
fn train(
    out: &Path,
    precision: &str,
    accumulate: usize,
    bad_call: usize,
    clip: Option<f64>,
) -> Vec<Output> {
    let bad = Some(bad_call);
    train_ranks(2, out, (precision, accumulate), bad, clip, None)
}

/// `world` ranks in `precision` with `accumulate` (and `clip`, see [`CLIP_ENV`]), the last
/// rank's loss infinite at its `bad_call`-th micro-batch (when given), resuming `resume`
/// (when given); their outputs.
fn train_ranks(
    world: usize,
    out: &Path,
    (precision, accumulate): (&str, usize),
    bad_call: Option<usize>,
    clip: Option<f64>,
    resume: Option<&Path>,
) -> Vec<Output> {
    let children = spawn_worker_ranks(WORKER, world, |rank, cmd| {
        if let Some(max) = clip {
            cmd.env(CLIP_ENV, max.to_string());
        }
        if let Some(path) = resume {
            cmd.env(RESUME_ENV, path);
        }
        cmd.env(OUT_ENV, out)
            .env(PRECISION_ENV, precision)
            .env(ACCUMULATE_ENV, accumulate.to_string())
            .env("DDP_RDZV_TIMEOUT_S", "30")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let (Some(call), true) = (bad_call, rank + 1 == world) {
            cmd.env(BAD_CALL_ENV, call.to_string());
        }
    });
    wait_all(children, Duration::from_secs(180))
}

/// The training state of checkpoint `stem` of `run`, as JSON.
fn train_state(run: &Path, stem: &str) -> Value {
    let file = run.join(format!("checkpoints/{stem}.state.safetensors"));
    let state = checkpoint::read_tensors(file).unwrap();
    serde_json::from_str(&state.metadata["train_state"]).unwrap()
}

/// Each step's log line of `rank`, from epoch 1 step 1 on.
fn step_lines(out: &Path, rank: usize) -> Vec<String> {
    std::fs::read_to_string(out.join(format!("logs/rank-{rank}.log")))
        .unwrap()
        .lines()
        .filter(|l| l.starts_with(&format!("[rank {rank}] epoch ")))
        .map(str::to_owned)
        .collect()
}

fn metrics(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// fp16 (a GradScaler, usable on CPU): rank 1's loss is infinite at epoch 2 step 1 (its 6th
/// micro-batch). Both ranks skip exactly that step and halve their scale, as PyTorch's scaler
/// does for the inf gradients it would find, train to the end, and report a finite epoch
/// loss that leaves the infinite one out. With clipping, the skipped step's norm (inf) is
/// neither measured nor summed: the epoch's mean norm is finite, and so is every checkpoint's
/// sum, which a resume must read back.
#[test]
fn an_fp16_loss_overflow_on_one_rank_skips_that_step_on_every_rank() {
    let tmp = common::temp_dir("ddp-train-non-finite-fp16");
    let out = tmp.path().join("run");
    // Far above any norm here: clipping measures but never scales.
    let outputs = train(&out, "fp16", 1, 5, Some(1e9));
    for (rank, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "rank {rank} failed:\n{}", text(o));
    }
    for rank in 0..2 {
        let lines = step_lines(&out, rank);
        assert_eq!(
            lines.len(),
            12,
            "3 epochs of 4 steps, rank {rank}: {lines:#?}"
        );
        for (i, line) in lines.iter().enumerate() {
            let (scale, skipped) = match i {
                0..=4 => ("65536", false),
                5 => ("32768", true),
                _ => ("32768", false),
            };
            assert!(
                line.contains(&format!(" loss scale {scale}")),
                "rank {rank} step {i}: {line}"
            );
            assert_eq!(
                line.contains("(step skipped: inf/NaN gradients)"),
                skipped,
                "rank {rank} step {i}: {line}"
            );
        }
        // The rank that saw it says so; its loss is left out of the step's mean.
        assert_eq!(
            lines[5].contains("non-finite loss inf left out"),
            rank == 1,
            "rank {rank}: {}",
            lines[5]
        );
    }
    let m = metrics(&out);
    let skipped: Vec<u64> = m
        .iter()
        .map(|e| e["skipped_steps"].as_u64().unwrap())
        .collect();
    assert_eq!(skipped, [0, 1, 0]);
    for e in &m {
        let loss = e["train_loss"].as_f64().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{e}");
    }
    let log = std::fs::read_to_string(out.join("logs/rank-0.log")).unwrap();
    assert!(
        log.contains(
            "epoch 2: 1 micro-batch (8 samples) with a non-finite loss left out of the \
             training loss"
        ),
        "{log}"
    );
    let st = train_state(&out, "epoch-0003");
    assert_eq!(st["grad_scaler"]["scale"], 32768.0, "{st}");
    assert_eq!(st["grad_scaler"]["skipped_steps"], 1, "{st}");
    // The skipped step counts for the schedule, as PyTorch's scheduler.step() after
    // scaler.step(): the last step (the 12th, t = 11) runs at 1/12 of the base rate, not
    // at 2/12 as 10 taken steps before it would give.
    let base = Settings::default().optimizer.lr();
    let lr = st["lr"].as_f64().unwrap();
    assert!((lr - base / 12.0).abs() < 1e-12 * base, "{lr} for {base}");
    for e in &m {
        let norm = e["grad_norm"].as_f64();
        assert!(norm.is_some_and(|n| n.is_finite() && n > 0.0), "{e}");
    }
    // Taken before epoch 2's step 3: step 1 measured, step 2 skipped, step 3 measured.
    let st = train_state(&out, "epoch-0002-step-000003");
    let position = &st["position"];
    assert!(
        position["grad_norm_sum"]
            .as_f64()
            .is_some_and(f64::is_finite),
        "{position}"
    );
    assert_eq!(position["grad_norm_steps"], 2, "{position}");
    assert_eq!(position["skipped_steps"], 1, "{position}");
}

/// fp16 on one rank, its loss infinite at epoch 1 step 2: the scaler skips that step, and the
/// linear schedule counts it. Resumed from epoch 1's checkpoint in fp32 (no scaler), every
/// later step runs at the uninterrupted fp16 run's rate, the skipped step still counted (as a
/// PyTorch scheduler's `last_epoch` is, whatever the precision), and the resumed run's
/// checkpoints carry the count on.
#[test]
fn a_resume_in_another_precision_keeps_the_skipped_steps_in_the_schedule() {
    let tmp = common::temp_dir("ddp-train-non-finite-precision");
    let (fp16, fp32) = (tmp.path().join("fp16"), tmp.path().join("fp32"));
    assert_all_ok(&train_ranks(
        1,
        &fp16,
        ("fp16", 1),
        Some(2),
        Some(1e9),
        None,
    ));
    let epoch_1 = fp16.join("checkpoints/epoch-0001.safetensors");
    assert_all_ok(&train_ranks(
        1,
        &fp32,
        ("fp32", 1),
        None,
        Some(1e9),
        Some(&epoch_1),
    ));
    let st = train_state(&fp16, "epoch-0001");
    assert_eq!(
        (&st["optimizer_steps"], &st["skipped_steps"]),
        (&7.into(), &1.into())
    );
    // 3 epochs of 8 steps: step t (from 0) runs at base x (24 - t) / 24. A checkpoint holds
    // the rate of the step before it.
    let base = Settings::default().optimizer.lr();
    let at = |t: u64| base * (24 - t) as f64 / 24.0;
    let mut stems: Vec<(String, u64)> = (1..8)
        .map(|step| (format!("epoch-0002-step-{step:06}"), 7 + step))
        .collect();
    stems.push(("epoch-0003".into(), 23));
    for (stem, t) in stems {
        for run in [&fp16, &fp32] {
            let st = train_state(run, &stem);
            let lr = st["lr"].as_f64().unwrap();
            assert!((lr - at(t)).abs() < 1e-12 * base, "{stem} of {run:?}: {st}");
            // t + 1 steps attempted, one of them skipped.
            assert_eq!(st["optimizer_steps"], t, "{stem} of {run:?}: {st}");
            assert_eq!(st["skipped_steps"], 1, "{stem} of {run:?}: {st}");
        }
        let resumed = train_state(&fp32, &stem);
        assert!(resumed.get("grad_scaler").is_none(), "{resumed}");
    }
}

/// fp32, two micro-batches per step: rank 1's loss is infinite in the first (not yet
/// communicating) micro-batch of epoch 2 step 0. Both ranks fail with the same error at that
/// step, naming rank 1; neither takes that step's checkpoint.
#[test]
fn an_fp32_non_finite_loss_on_one_rank_stops_every_rank_at_that_step() {
    let tmp = common::temp_dir("ddp-train-non-finite-fp32");
    let out = tmp.path().join("run");
    let outputs = train(&out, "fp32", 2, 4, None);
    let message = "error: the training loss became inf on rank 1 at epoch 2 step 0; lower the \
                   learning rate (--lr)";
    for (rank, o) in outputs.iter().enumerate() {
        let t = text(o);
        assert_eq!(o.status.code(), Some(1), "rank {rank}:\n{t}");
        assert!(t.contains(message), "rank {rank}:\n{t}");
    }
    assert_eq!(metrics(&out).len(), 1, "epoch 2 did not end");
    for rank in 0..2 {
        let lines = step_lines(&out, rank);
        assert_eq!(
            lines.len(),
            2,
            "epoch 1's 2 steps only, rank {rank}: {lines:#?}"
        );
    }
}
