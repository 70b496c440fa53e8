//! A run stopped inside an epoch continues on another number of ranks with exactly the
//! samples it had left: with the same global batch it ends as the uninterrupted run does,
//! and with another one every sample of the interrupted epoch is trained once; a per-step
//! schedule stays on its curve. A stop signal during an epoch's evaluation stops there too,
//! and one during `Trainer::evaluate` stops it, before a run trains; so does the time limit,
//! counted from the process's start. Ranks are real processes on
//! loopback: this test binary re-invoked with `--ignored --exact rank_worker`, a small MLP
//! (no BatchNorm, no dropout, so that 2 ranks x 16 and 1 rank x 32 compute the same steps),
//! started with torchrun's variables or SLURM's.

mod common;

use common::regression::{points, Regression};
use common::{spawn_worker_ranks, text, wait_all};

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ddp_model::checkpoint;
use ddp_train::lr_schedule::LrSchedule;
use ddp_train::{Monitor, Settings, Trainer};
use serde_json::Value;
use tch::Tensor;

const WORKER: &str = "rank_worker";
const OUT_ENV: &str = "ELASTIC_TEST_OUT";
const BATCH_ENV: &str = "ELASTIC_TEST_BATCH";
const EVERY_ENV: &str = "ELASTIC_TEST_CHECKPOINT_EVERY";
const EVALUATE_ENV: &str = "ELASTIC_TEST_EVALUATE";
const TERM_ENV: &str = "ELASTIC_TEST_TERM_BEFORE_RUN";
const TIME_LIMIT_ENV: &str = "ELASTIC_TEST_TIME_LIMIT";
const SLEEP_ENV: &str = "ELASTIC_TEST_SLEEP_BEFORE_TRAINER_MS";
const TRAIN_PAUSE_ENV: &str = "ELASTIC_TEST_TRAIN_PAUSE_MS";
const EVAL_PAUSE_ENV: &str = "ELASTIC_TEST_EVAL_PAUSE_MS";
const MAX_STEPS_ENV: &str = "ELASTIC_TEST_MAX_STEPS";
const NO_SIGNALS_ENV: &str = "ELASTIC_TEST_NO_SIGNALS";
const POINTS_ENV: &str = "ELASTIC_TEST_POINTS";
const ACCUMULATE_ENV: &str = "ELASTIC_TEST_ACCUMULATE";
const EPOCHS_ENV: &str = "ELASTIC_TEST_EPOCHS";
const RESUME_ENV: &str = "ELASTIC_TEST_RESUME";
const MONITOR_ENV: &str = "ELASTIC_TEST_MONITOR";
/// 256 training points (unless `ELASTIC_TEST_POINTS` says otherwise): 8 steps of 32 samples
/// per epoch.
const POINTS: i64 = 256;
const EPOCHS: u64 = 3;
const WARMUP: u64 = 3;

/// One rank: 3 epochs of Adam with a cosine schedule after 3 warmup steps, a batch of
/// `ELASTIC_TEST_BATCH` per rank, into `ELASTIC_TEST_OUT`, a checkpoint every
/// `ELASTIC_TEST_CHECKPOINT_EVERY` steps if set; exits with the Trainer's code (75 after a
/// requested stop). With `ELASTIC_TEST_EVALUATE=only` it evaluates the 60 validation points
/// instead, each batch taking 200 ms; with `ELASTIC_TEST_EVALUATE=first` it evaluates them
/// so, then trains (`evaluate()?` then `run()?`). With `ELASTIC_TEST_TERM_BEFORE_RUN` set it
/// sends itself SIGTERM once the ranks have met, before `run()` (a stop while they start).
/// `ELASTIC_TEST_TIME_LIMIT` is its time limit in seconds, `ELASTIC_TEST_MAX_STEPS` its steps
/// per epoch, `ELASTIC_TEST_TRAIN_PAUSE_MS` and `ELASTIC_TEST_EVAL_PAUSE_MS` how much longer
/// each trained and each evaluated batch takes, and
/// `ELASTIC_TEST_SLEEP_BEFORE_TRAINER_MS` how long it takes before `Trainer::new` (a task
/// opening its data); with `ELASTIC_TEST_NO_SIGNALS` set it leaves the stop signals alone.
/// `ELASTIC_TEST_POINTS`, `ELASTIC_TEST_ACCUMULATE` and `ELASTIC_TEST_EPOCHS` replace the
/// 256 training points, the one micro-batch per step and the 3 epochs;
/// `ELASTIC_TEST_RESUME` is `--resume`. With `ELASTIC_TEST_MONITOR` set it keeps the best
/// model by `val_mse` and, after a run, prints `bests: ` and its `Trainer::bests` as JSON. On
/// an error it says how long after it started it ended.
#[test]
#[ignore = "a rank of the tests in this file, started by them"]
fn rank_worker() {
    let started = Instant::now();
    ddp_train::logging::init();
    let number = |var: &str| {
        std::env::var(var)
            .ok()
            .map(|n| n.parse::<u64>().expect("a number"))
    };
    let out = std::env::var(OUT_ENV).expect("the test sets the run directory");
    let batch: usize = std::env::var(BATCH_ENV)
        .expect("the test sets the batch")
        .parse()
        .expect("a number");
    let mut settings = Settings::default()
        .epochs(number(EPOCHS_ENV).unwrap_or(EPOCHS))
        .batch_size(batch)
        .seed(7)
        .out(Some(out.into()))
        .lr_schedule(LrSchedule::Cosine { warmup: WARMUP });
    settings.runtime.threads = Some(1);
    settings.runtime.workers = Some(1);
    settings.runtime.progress = false;
    settings.runtime.collective_timeout_secs = Some(30);
    settings.checkpoint.every = number(EVERY_ENV);
    settings.runtime.time_limit_secs = number(TIME_LIMIT_ENV);
    settings.max_steps_per_epoch = number(MAX_STEPS_ENV).map(|n| n as usize);
    settings.runtime.stop_on_signals = std::env::var_os(NO_SIGNALS_ENV).is_none();
    settings.accumulate = number(ACCUMULATE_ENV).map_or(1, |n| n as usize);
    settings.checkpoint.resume = std::env::var(RESUME_ENV).ok();
    let monitor = std::env::var_os(MONITOR_ENV).is_some();
    if monitor {
        settings = settings.monitor(Monitor::min("val_mse", "best.safetensors"));
    }
    let train_points = number(POINTS_ENV).map_or(POINTS, |n| n as i64);
    let mut task = Regression::new(points(train_points, 1), points(60, 2));
    let evaluate = std::env::var(EVALUATE_ENV).ok();
    if evaluate.is_some() {
        task.eval_pause = Duration::from_millis(200);
    }
    task.train_pause = Duration::from_millis(number(TRAIN_PAUSE_ENV).unwrap_or(0));
    if let Some(ms) = number(EVAL_PAUSE_ENV) {
        task.eval_pause = Duration::from_millis(ms);
    }
    std::thread::sleep(Duration::from_millis(number(SLEEP_ENV).unwrap_or(0)));
    let term = std::env::var_os(TERM_ENV).is_some();
    let trainer = Trainer::new(task, settings).inspect(|_| {
        if term {
            // SAFETY: raise(3) takes a signal number; the Trainer watches SIGTERM.
            assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
        }
    });
    let code = match trainer.and_then(|mut t| match evaluate.as_deref() {
        Some("only") => t.evaluate().map(drop),
        Some("first") => t.evaluate().and_then(|_| t.run()).map(drop),
        None => t.run().map(|_| {
            if monitor {
                eprintln!("bests: {}", serde_json::to_string(t.bests()).unwrap());
            }
        }),
        Some(other) => panic!("{EVALUATE_ENV}={other}: only or first"),
    }) {
        Ok(_) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!(
                "worker ended {:.3} s after its start",
                started.elapsed().as_secs_f64()
            );
            e.exit_code()
        }
    };
    std::process::exit(i32::from(code));
}

/// How the ranks of a start find their place.
#[derive(Clone, Copy)]
enum Launcher {
    Torchrun,
    /// SLURM's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` (a requeued job).
    Slurm,
}

/// Starts `world` ranks of batch `batch` into `out` with `env`, and returns their outputs.
fn start(
    launcher: Launcher,
    world: usize,
    batch: usize,
    out: &Path,
    env: &[(&str, &str)],
) -> Vec<Output> {
    let configure = |rank: usize, cmd: &mut Command| {
        cmd.env(OUT_ENV, out)
            .env(BATCH_ENV, batch.to_string())
            .env("DDP_RDZV_TIMEOUT_S", "30")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Launcher::Slurm = launcher {
            for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"] {
                cmd.env_remove(var);
            }
            cmd.env("SLURM_PROCID", rank.to_string())
                .env("SLURM_NTASKS", world.to_string())
                .env("SLURM_LOCALID", rank.to_string())
                .env("SLURM_NTASKS_PER_NODE", world.to_string())
                .env("SLURM_JOB_ID", "4242")
                .env("SLURM_STEP_ID", "0");
        }
    };
    let children = spawn_worker_ranks(WORKER, world, configure);
    wait_all(children, Duration::from_secs(180))
}

fn assert_codes(outputs: &[Output], code: i32) {
    for (rank, o) in outputs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(code), "rank {rank}:\n{}", text(o));
    }
}

/// Rank 1 asks to stop (SIGTERM) during epoch `epoch` step `step`: the ranks agree before the
/// next step, so the checkpoint is at step `step + 1`. `step` may also be `eval` (during the
/// epoch's evaluation) or `end` (after it), as `DDP_TRAIN_FAIL_AT` takes them.
fn stop_at(epoch: u64, step: impl std::fmt::Display) -> [(&'static str, String); 3] {
    [
        ("DDP_TRAIN_FAIL_RANK", "1".to_string()),
        ("DDP_TRAIN_FAIL_AT", format!("{epoch}:{step}")),
        ("DDP_TRAIN_FAIL_SIGNAL", "TERM".to_string()),
    ]
}

fn pairs<'a>(vars: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    vars.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

fn metrics(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn column(metrics: &[Value], key: &str) -> Vec<f64> {
    metrics.iter().map(|m| m[key].as_f64().unwrap()).collect()
}

/// The largest difference between two runs' final weights (every tensor, by name).
fn weight_difference(a: &Path, b: &Path) -> f64 {
    let file = format!("checkpoints/epoch-{EPOCHS:04}.safetensors");
    let (a, b) = (
        checkpoint::read_tensors(a.join(&file)).unwrap(),
        checkpoint::read_tensors(b.join(&file)).unwrap(),
    );
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        ["0.bias", "0.weight", "2.bias", "2.weight"]
    );
    a.tensors
        .iter()
        .map(|(name, t)| (t - &b.tensors[name]).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

/// Runs `before` ranks x `batch_before` uninterrupted, and again stopped by SIGTERM inside
/// epoch 2 then continued on `after` x `batch_after` (started as `launcher` starts ranks);
/// checks that both end with the same weights (1e-5) and learning rates.
fn check_same_global_batch(
    name: &str,
    (before, batch_before): (usize, usize),
    (after, batch_after): (usize, usize),
    launcher: Launcher,
) {
    let tmp = common::temp_dir(&format!("ddp-train-elastic-{name}"));
    let (full, cut) = (tmp.path().join("full"), tmp.path().join("cut"));
    assert_codes(
        &start(Launcher::Torchrun, before, batch_before, &full, &[]),
        0,
    );

    // With one rank, rank 1 does not exist: rank 0 asks to stop.
    let mut stop = stop_at(2, 3);
    stop[0].1 = (before - 1).to_string();
    let outputs = start(
        Launcher::Torchrun,
        before,
        batch_before,
        &cut,
        &pairs(&stop),
    );
    assert_codes(&outputs, 75);
    let latest = std::fs::read_to_string(cut.join("checkpoints/latest")).unwrap();
    assert_eq!(latest, "epoch-0002-step-000004\n");
    let outputs = start(launcher, after, batch_after, &cut, &[]);
    assert_codes(&outputs, 0);
    let log = text(&outputs[0]);
    assert!(
        log.contains("resumed from") && log.contains("the global batch is the same"),
        "{log}"
    );

    let difference = weight_difference(&full, &cut);
    assert!(difference < 1e-5, "final weights differ by {difference}");
    let (a, b) = (metrics(&full), metrics(&cut));
    assert_eq!(column(&a, "steps"), [8.0, 8.0, 8.0]);
    assert_eq!(column(&b, "steps"), [8.0, 8.0, 8.0]);
    for (x, y) in column(&a, "lr").iter().zip(column(&b, "lr")) {
        assert!((x - y).abs() < 1e-12, "learning rates {a:?} vs {b:?}");
    }
    for (x, y) in column(&a, "val_loss").iter().zip(column(&b, "val_loss")) {
        assert!((x - y).abs() < 1e-5 * x.max(1.0), "{x} vs {y}");
    }
    // What changed is recorded in epoch 2's line and in config.json.
    let change = &b[1]["allocation_change"];
    assert_eq!(change["epoch"], 2);
    assert_eq!(change["from"]["world_size"], before);
    assert_eq!(change["to"]["world_size"], after);
    assert_eq!(change["consumed"], 128);
    assert!(b[0].get("allocation_change").is_none() && b[2].get("allocation_change").is_none());
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(cut.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["allocation_change"], *change);
    assert_eq!(config["planned_optimizer_steps"], 24);
}

#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn two_ranks_of_16_stopped_inside_an_epoch_continue_on_one_rank_of_32_exactly() {
    // The second start is a requeued SLURM job with one task.
    check_same_global_batch("2x16-1x32", (2, 16), (1, 32), Launcher::Slurm);
}

#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn one_rank_of_32_stopped_inside_an_epoch_continues_on_two_ranks_of_16_exactly() {
    check_same_global_batch("1x32-2x16", (1, 32), (2, 16), Launcher::Torchrun);
}

/// A start that changed the allocation inside an epoch and was stopped again before its end
/// leaves the change to the start that ends it: 2 x 16 stopped at epoch 2's step 4, then
/// 1 x 32 stopped at its step 6, then 1 x 32 again (no change of its own) to the end: epoch
/// 2's line of `metrics.jsonl` records 2 -> 1 ranks from step 4.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_change_of_allocation_stopped_again_in_its_epoch_is_recorded_at_the_epochs_end() {
    let tmp = common::temp_dir("ddp-train-elastic-change-stopped-again");
    let cut = tmp.path().join("cut");
    let latest = || std::fs::read_to_string(cut.join("checkpoints/latest")).unwrap();
    let outputs = start(Launcher::Torchrun, 2, 16, &cut, &pairs(&stop_at(2, 3)));
    assert_codes(&outputs, 75);
    assert_eq!(latest(), "epoch-0002-step-000004\n");
    // One rank: rank 0 asks to stop.
    let mut stop = stop_at(2, 5);
    stop[0].1 = "0".to_string();
    assert_codes(&start(Launcher::Torchrun, 1, 32, &cut, &pairs(&stop)), 75);
    assert_eq!(latest(), "epoch-0002-step-000006\n");
    assert_codes(&start(Launcher::Torchrun, 1, 32, &cut, &[]), 0);

    let m = metrics(&cut);
    assert_eq!(column(&m, "epoch"), [1.0, 2.0, 3.0]);
    let change = &m[1]["allocation_change"];
    assert_eq!(change["epoch"], 2, "{m:?}");
    assert_eq!(change["from"]["world_size"], 2);
    assert_eq!(change["to"]["world_size"], 1);
    assert_eq!(change["step"], 4);
    assert!(m[0].get("allocation_change").is_none() && m[2].get("allocation_change").is_none());
}

/// A run stopped before its first step (a preemption while the ranks start) has no learning
/// rate curve yet: continued on 1 rank instead of 2, its per-step schedule runs over the new
/// allocation's 48 steps, as a run killed then and started again would, not the first start's
/// 24 (which would leave the last half of the run at a learning rate of 0).
#[test]
fn a_run_stopped_before_its_first_step_plans_its_schedule_on_the_next_allocation() {
    let tmp = common::temp_dir("ddp-train-elastic-stop-before-first-step");
    let cut = tmp.path().join("cut");
    let outputs = start(Launcher::Torchrun, 2, 16, &cut, &[(TERM_ENV, "1")]);
    assert_codes(&outputs, 75);
    let latest = std::fs::read_to_string(cut.join("checkpoints/latest")).unwrap();
    assert_eq!(latest, "epoch-0001-step-000000\n");
    let outputs = start(Launcher::Torchrun, 1, 16, &cut, &[]);
    assert_codes(&outputs, 0);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(cut.join("config.json")).unwrap()).unwrap();
    // 3 epochs of 256 points in batches of 16 on one rank.
    assert_eq!(config["planned_optimizer_steps"], 48);
    let lines = metrics(&cut);
    assert_eq!(column(&lines, "steps"), [16.0, 16.0, 16.0]);
    let lr = column(&lines, "lr");
    assert!(lr.iter().all(|&lr| lr > 0.0), "learning rates {lr:?}");
}

/// `metrics.jsonl` without its timing fields.
fn metrics_without_timing(run: &Path) -> Vec<Value> {
    let mut lines = metrics(run);
    for line in &mut lines {
        let o = line.as_object_mut().unwrap();
        o.remove("images_per_sec");
        o.remove("epoch_seconds");
    }
    lines
}

/// SIGTERM to rank 1 during epoch 1's evaluation (after the first of its two batches) stops
/// every rank there, before the epoch's end is saved: rank 0 checkpoints the epoch's last
/// step, from which the continued run evaluates epoch 1 and ends as the uninterrupted one,
/// metrics and weights alike.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_stop_during_an_epochs_evaluation_checkpoints_its_end_and_continues_exactly() {
    let tmp = common::temp_dir("ddp-train-elastic-eval-stop");
    let (full, cut) = (tmp.path().join("full"), tmp.path().join("cut"));
    assert_codes(&start(Launcher::Torchrun, 2, 16, &full, &[]), 0);

    let outputs = start(Launcher::Torchrun, 2, 16, &cut, &pairs(&stop_at(1, "eval")));
    assert_codes(&outputs, 75);
    for o in &outputs {
        assert!(
            text(o).contains("stopping at epoch 1 step 8 (SIGTERM)"),
            "{}",
            text(o)
        );
    }
    let latest = std::fs::read_to_string(cut.join("checkpoints/latest")).unwrap();
    assert_eq!(latest, "epoch-0001-step-000008\n");
    let reported = cut.join("metrics.jsonl");
    assert!(
        !reported.exists() || metrics(&cut).is_empty(),
        "epoch 1 was reported"
    );

    let outputs = start(Launcher::Torchrun, 2, 16, &cut, &[]);
    assert_codes(&outputs, 0);
    let log = text(&outputs[0]);
    assert!(log.contains("(epoch 1 at step 8)"), "{log}");
    assert_eq!(weight_difference(&full, &cut), 0.0);
    let (a, b) = (metrics_without_timing(&full), metrics_without_timing(&cut));
    assert_eq!(column(&a, "steps"), [8.0, 8.0, 8.0]);
    assert_eq!(a, b);
}

/// Every rank knows the bests (the metrics are all-reduced), not only rank 0, which saves
/// the best models.
#[test]
fn every_rank_knows_the_bests() {
    let tmp = common::temp_dir("ddp-train-elastic-bests");
    let out = tmp.path().join("run");
    let outputs = start(
        Launcher::Torchrun,
        2,
        16,
        &out,
        &[(MONITOR_ENV, "1"), (EPOCHS_ENV, "2")],
    );
    assert_codes(&outputs, 0);
    let bests: Vec<Value> = outputs
        .iter()
        .map(|o| {
            let t = text(o);
            let line = t.lines().find_map(|l| l.strip_prefix("bests: "));
            serde_json::from_str(line.unwrap_or_else(|| panic!("no bests: {t}"))).unwrap()
        })
        .collect();
    let best = &bests[0]["best.safetensors"];
    assert!(
        best["epoch"].as_u64().is_some_and(|e| (1..=2).contains(&e)),
        "{best}"
    );
    let mse = column(&metrics(&out), "val_mse");
    assert_eq!(
        best["value"].as_f64(),
        Some(mse.iter().copied().fold(f64::INFINITY, f64::min))
    );
    assert_eq!(bests[1], bests[0]);
}

/// The seconds after `marker` in `log`'s first line that has it.
fn seconds_after(log: &str, marker: &str) -> f64 {
    let line = log
        .lines()
        .find_map(|l| l.split_once(marker).map(|(_, rest)| rest));
    let number = line.and_then(|rest| rest.split(' ').next());
    number
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no '{marker}<seconds>' in:\n{log}"))
}

/// The time limit counts from the process's start (what a scheduler's limit counts from),
/// not from the Trainer's: a rank that takes 2 s before `Trainer::new` (a task decoding its
/// data) with a limit of 10 s, and 48 steps of over 250 ms, stops with a checkpoint before
/// 10 s have passed since it started, by its own clock and by the Trainer's. From the
/// Trainer's creation it would have stopped after them, or not at all. The reserve of twice
/// a step and a save before the limit is over half a second: room for a slow save (a loaded
/// disk's fsync), and seconds for a slow start.
#[test]
fn the_time_limit_counts_from_the_processs_start() {
    let tmp = common::temp_dir("ddp-train-elastic-time-limit-start");
    let run = tmp.path().join("run");
    let env = [
        (TIME_LIMIT_ENV, "10"),
        (SLEEP_ENV, "2000"),
        (TRAIN_PAUSE_ENV, "250"),
    ];
    let outputs = start(Launcher::Torchrun, 1, 16, &run, &env);
    assert_codes(&outputs, 75);
    let log = text(&outputs[0]);
    let ended = seconds_after(&log, "worker ended ");
    let stopped = seconds_after(&log, "(time limit) after ");
    assert!(ended < 10.0 && stopped < 10.0, "{log}");
    // The Trainer's clock counts the 2 s before it.
    assert!(stopped > 2.0, "{log}");
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    assert!(latest.contains("-step-"), "{latest}");
}

/// The time limit stops an epoch's evaluation too: 2 ranks with 2 fast steps per epoch and
/// 10 validation batches each of over 800 ms (8 s of evaluation) stop together during epoch
/// 1's evaluation, once the longest round and a save no longer fit twice before the limit of
/// 8 s on some rank, and before it: rank 0 checkpoints the epoch's last step, from which the
/// continued run (without the pauses) evaluates epoch 1 and trains on. The ranks watch no
/// signals: the time limit alone has them agree before each round. Step 2 needs twice the
/// guess of it, the evaluation (10 steps) and two saves before the limit: seconds of spare
/// for a slow start (a loaded machine), while the evaluation cannot fit however fast.
#[test]
fn the_time_limit_stops_an_epochs_evaluation_at_its_end() {
    let tmp = common::temp_dir("ddp-train-elastic-time-limit-eval");
    let run = tmp.path().join("run");
    // Batches of 3: 10 of each rank's 30 validation points.
    let env = [
        (TIME_LIMIT_ENV, "8"),
        (EVAL_PAUSE_ENV, "800"),
        (MAX_STEPS_ENV, "2"),
        (NO_SIGNALS_ENV, "1"),
    ];
    let outputs = start(Launcher::Torchrun, 2, 3, &run, &env);
    assert_codes(&outputs, 75);
    for o in &outputs {
        let log = text(o);
        assert!(
            log.contains("stopping at epoch 1 step 2 (time limit)"),
            "{log}"
        );
        assert!(seconds_after(&log, "worker ended ") < 8.0, "{log}");
    }
    let latest = std::fs::read_to_string(run.join("checkpoints/latest")).unwrap();
    assert_eq!(latest, "epoch-0001-step-000002\n");
    assert!(
        !run.join("metrics.jsonl").exists() || metrics(&run).is_empty(),
        "epoch 1 was reported"
    );

    let outputs = start(Launcher::Torchrun, 2, 3, &run, &env[2..]);
    assert_codes(&outputs, 0);
    let log = text(&outputs[0]);
    assert!(log.contains("(epoch 1 at step 2)"), "{log}");
    assert_eq!(column(&metrics(&run), "steps"), [2.0, 2.0, 2.0]);
}

/// `world` ranks in `ELASTIC_TEST_EVALUATE` mode `mode` (a batch of 2: 30 or 15 rounds of
/// 200 ms), the last sent SIGTERM once the Trainer started: their outputs.
fn sigterm_during_evaluate(
    name: &str,
    mode: &str,
    world: usize,
) -> (Vec<Output>, ddp_testkit::TempDir) {
    let tmp = common::temp_dir(name);
    let run = tmp.path().join("run");
    let children = spawn_worker_ranks(WORKER, world, |_, cmd| {
        cmd.env(OUT_ENV, &run)
            .env(BATCH_ENV, "2")
            .env(EVALUATE_ENV, mode)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
    });
    // config.json is the last thing Trainer::new writes.
    ddp_testkit::wait_for("the Trainer", Duration::from_secs(120), || {
        run.join("config.json").is_file()
    });
    let last = children.last().expect("a rank").id() as i32;
    // SAFETY: kill(2) on a child this test started and has not waited for.
    assert_eq!(unsafe { libc::kill(last, libc::SIGTERM) }, 0);
    (wait_all(children, Duration::from_secs(120)), tmp)
}

/// SIGTERM to a Trainer that only evaluates stops it at its next batch instead of going
/// unheard until the evaluation is done: exit 75 (a stop, with nothing to continue from).
#[test]
fn sigterm_stops_a_trainer_that_only_evaluates() {
    let (outputs, _tmp) = sigterm_during_evaluate("ddp-train-elastic-eval-only-signal", "only", 1);
    assert_codes(&outputs, 75);
    assert!(
        text(&outputs[0]).contains("evaluation stopped by SIGTERM before its end"),
        "{}",
        text(&outputs[0])
    );
}

/// A program that evaluates before it trains (a baseline): SIGTERM to one rank during the
/// evaluation stops every rank there with exit 75, and none trains or saves a checkpoint.
#[test]
fn sigterm_during_an_evaluation_before_training_stops_every_rank() {
    let (outputs, tmp) = sigterm_during_evaluate("ddp-train-elastic-eval-first-signal", "first", 2);
    assert_codes(&outputs, 75);
    for o in &outputs {
        let log = text(o);
        assert!(log.contains("stopping the evaluation (SIGTERM)"), "{log}");
        assert!(!log.contains("epoch 1"), "{log}");
    }
    let run = tmp.path().join("run");
    assert!(!run.join("checkpoints").exists());
    assert!(!run.join("metrics.jsonl").exists() || metrics(&run).is_empty());
}

/// What one process trained: `(epoch, step) -> indices`.
type StepIndices = BTreeMap<(u64, usize), Vec<usize>>;

/// Every file of an index log by name, one per process.
fn index_logs(dir: &Path) -> Vec<(String, StepIndices)> {
    let mut logs: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            let steps = std::fs::read_to_string(&path)
                .unwrap()
                .lines()
                .map(|line| {
                    let mut parts = line.split(' ');
                    let epoch = parts.next().unwrap().parse().unwrap();
                    let step = parts.next().unwrap().parse().unwrap();
                    let indices = parts
                        .next()
                        .unwrap()
                        .split(',')
                        .map(|i| i.parse().unwrap())
                        .collect();
                    ((epoch, step), indices)
                })
                .collect();
            (
                path.file_name().unwrap().to_string_lossy().into_owned(),
                steps,
            )
        })
        .collect();
    logs.sort_by(|a, b| a.0.cmp(&b.0));
    logs
}

/// 2 ranks x 16 stopped after 2 of epoch 1's 8 steps continue on 3 ranks x 16: the 192
/// samples left take 4 steps of 48, and the samples trained in epoch 1 by both starts are
/// every sample once. The cosine schedule keeps its planned 24 steps of 32 samples and
/// follows the samples trained, although the run now takes 6 + 5 + 5 steps.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn two_ranks_stopped_inside_an_epoch_continue_on_three_with_every_sample_once() {
    let tmp = common::temp_dir("ddp-train-elastic-2-3");
    let run = tmp.path().join("run");
    let (first_log, second_log) = (tmp.path().join("first"), tmp.path().join("second"));
    std::fs::create_dir_all(&first_log).unwrap();
    std::fs::create_dir_all(&second_log).unwrap();
    let mut env = stop_at(1, 1).to_vec();
    env.push(("DDP_TRAIN_LOG_INDICES", first_log.to_string_lossy().into()));
    assert_codes(&start(Launcher::Torchrun, 2, 16, &run, &pairs(&env)), 75);
    let log = second_log.to_string_lossy().into_owned();
    let outputs = start(
        Launcher::Torchrun,
        3,
        16,
        &run,
        &[("DDP_TRAIN_LOG_INDICES", &log)],
    );
    assert_codes(&outputs, 0);
    let text0 = text(&outputs[0]);
    assert!(
        text0.contains(
            "the global batch changes from 32 to 48, so epochs take 5 optimizer steps instead \
             of 8; the rest of epoch 1 (192 samples) takes 4 step(s); the learning rate is not \
             changed, and per-step schedules keep their planned 24 optimizer steps of 32 \
             samples, which a step of 48 advances by 48/32 (they follow the samples trained)"
        ),
        "{text0}"
    );

    let mut trained = Vec::new();
    let first = index_logs(&first_log);
    assert_eq!(first.len(), 2, "one log per rank of the first start");
    assert!(first.iter().all(|(name, _)| name.contains("-first-")));
    for (_, steps) in &first {
        // Steps 0 and 1 of epoch 1, then the stop.
        assert_eq!(steps.keys().copied().collect::<Vec<_>>(), [(1, 0), (1, 1)]);
        trained.extend(steps.values().flatten().copied());
    }
    let second = index_logs(&second_log);
    assert_eq!(second.len(), 3, "one log per rank of the second start");
    for (_, steps) in &second {
        let epoch1: Vec<usize> = steps.keys().filter(|k| k.0 == 1).map(|k| k.1).collect();
        assert_eq!(epoch1, [2, 3, 4, 5]);
        for ((epoch, _), indices) in steps {
            assert_eq!(indices.len(), 16);
            if *epoch == 1 {
                trained.extend(indices.iter().copied());
            }
        }
    }
    trained.sort_unstable();
    assert_eq!(trained, (0..POINTS as usize).collect::<Vec<_>>());

    let m = metrics(&run);
    assert_eq!(column(&m, "steps"), [6.0, 5.0, 5.0]);
    assert_eq!(column(&m, "world_size"), [3.0, 3.0, 3.0]);
    assert_eq!(m[0]["allocation_change"]["global_batch"]["to"], 48);
    // Each epoch reports the rate of its last step, on the curve of the planned 24 steps of
    // 32 samples, which each step of 48 advances by 1.5: before epoch 1's last step 64 + 3 x
    // 48 samples were stepped, 6.5 planned steps; epoch 2's, 14; epoch 3's, 21.5 (the run
    // ends at 23, where 24 x 32 would have been 768 samples and the epochs of 48 hold 240).
    let schedule = LrSchedule::Cosine { warmup: WARMUP };
    let want: Vec<f64> = [6.5, 14.0, 21.5]
        .iter()
        .map(|&t| schedule.lr(1e-3, t, 24))
        .collect();
    for (got, want) in column(&m, "lr").iter().zip(&want) {
        assert!((got - want).abs() < 1e-12, "{m:?} vs {want:?}");
    }
}

/// 200 samples, 2 ranks x 16 x accumulate 2 (3 steps of 64 per epoch: positions 0..192 of
/// the epoch's order, the last 8 left out), stopped after epoch 1's first step, continue on
/// 3 x 16 x 2: the 128 positions left take 2 steps of 96, filled past the epoch's end with
/// positions 192..256, which wrap to the order's start (position p is sample
/// `order[p % 200]`, the sampler's padding). So epoch 1 trains exactly positions 0..256 of
/// its order, its left-out tail included, and no sample else.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_change_with_accumulation_and_a_partial_epoch_trains_the_positions_it_had_left() {
    let tmp = common::temp_dir("ddp-train-elastic-uneven");
    let run = tmp.path().join("run");
    let (first_log, second_log) = (tmp.path().join("first"), tmp.path().join("second"));
    std::fs::create_dir_all(&first_log).unwrap();
    std::fs::create_dir_all(&second_log).unwrap();
    let shape = [(POINTS_ENV, "200"), (ACCUMULATE_ENV, "2")];
    let mut env = stop_at(1, 0).to_vec();
    env.push(("DDP_TRAIN_LOG_INDICES", first_log.to_string_lossy().into()));
    env.extend(shape.map(|(k, v)| (k, v.to_string())));
    assert_codes(&start(Launcher::Torchrun, 2, 16, &run, &pairs(&env)), 75);
    let log = second_log.to_string_lossy().into_owned();
    let second_env = [&shape[..], &[("DDP_TRAIN_LOG_INDICES", log.as_str())]].concat();
    let outputs = start(Launcher::Torchrun, 3, 16, &run, &second_env);
    assert_codes(&outputs, 0);

    let mut trained = Vec::new();
    for (_, steps) in index_logs(&first_log) {
        assert_eq!(steps.keys().copied().collect::<Vec<_>>(), [(1, 0)]);
        trained.extend(steps.values().flatten().copied());
    }
    let second = index_logs(&second_log);
    assert_eq!(second.len(), 3, "one log per rank of the second start");
    for (_, steps) in &second {
        let epoch1: Vec<usize> = steps.keys().filter(|k| k.0 == 1).map(|k| k.1).collect();
        assert_eq!(epoch1, [1, 2]);
        for ((epoch, _), indices) in steps {
            assert_eq!(indices.len(), 32, "two micro-batches of 16");
            if *epoch == 1 {
                trained.extend(indices.iter().copied());
            }
        }
    }
    let order = ddp_sampler::permutation(200, 7, 1);
    let mut want: Vec<usize> = (0..256).map(|p| order[p % 200]).collect();
    want.sort_unstable();
    trained.sort_unstable();
    assert_eq!(trained, want);
    // Later epochs: 200 samples over 3 ranks, 67 each, 2 steps of 32.
    assert_eq!(column(&metrics(&run), "steps"), [3.0, 2.0, 2.0]);
}

/// Under a binding `--max-steps-per-epoch` (3 steps of epochs of 8 on 2 x 16, of 4 on
/// 4 x 16) an epoch is 3 steps on either allocation, and the schedule counts steps, not
/// samples: stopped after epoch 1's first step (32 of its 96 positions) and continued on
/// 4 x 16, the rest of epoch 1 takes one step of 64, and the epochs' last steps stand at
/// steps 1, 4 and 7 of the planned 9 (counting samples, 64 would advance it by 2: 1, 7, 13).
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_capped_epoch_counts_steps_on_another_global_batch() {
    let tmp = common::temp_dir("ddp-train-elastic-capped");
    let run = tmp.path().join("run");
    let mut env = stop_at(1, 0).to_vec();
    env.push((MAX_STEPS_ENV, "3".to_string()));
    assert_codes(&start(Launcher::Torchrun, 2, 16, &run, &pairs(&env)), 75);
    let outputs = start(Launcher::Torchrun, 4, 16, &run, &[(MAX_STEPS_ENV, "3")]);
    assert_codes(&outputs, 0);
    let m = metrics(&run);
    assert_eq!(column(&m, "steps"), [2.0, 3.0, 3.0]);
    let schedule = LrSchedule::Cosine { warmup: WARMUP };
    let want: Vec<f64> = [1.0, 4.0, 7.0]
        .iter()
        .map(|&t| schedule.lr(1e-3, t, 9))
        .collect();
    for (got, want) in column(&m, "lr").iter().zip(&want) {
        assert!((got - want).abs() < 1e-12, "{m:?} vs {want:?}");
    }
    // Continued for 4 epochs on 8 x 16, where an epoch is 2 steps and the cap binds no
    // more: planned again from the 8 steps taken under the cap (not their 256 counted
    // samples, 2 steps of 128), 8 + 2 = 10 steps, and epoch 4's last step stands at step 9.
    let outputs = start(
        Launcher::Torchrun,
        8,
        16,
        &run,
        &[
            (MAX_STEPS_ENV, "3"),
            (EPOCHS_ENV, "4"),
            (RESUME_ENV, "latest"),
        ],
    );
    assert_codes(&outputs, 0);
    assert!(
        text(&outputs[0]).contains(
            "the run was planned for 3 epochs and continues for 4: per-step schedules now run \
             over 10 optimizer steps instead of 9"
        ),
        "{}",
        text(&outputs[0])
    );
    let m = metrics(&run);
    assert_eq!(column(&m, "epoch"), [1.0, 2.0, 3.0, 4.0]);
    let last = column(&m, "lr")[3];
    let want = schedule.lr(1e-3, 9.0, 10);
    assert!((last - want).abs() < 1e-12, "{last} vs {want}");
}

/// A checkpoint of a Trainer that did not record its allocation resumes on its own world
/// size and is refused on another, naming both.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn an_old_checkpoint_inside_an_epoch_is_refused_on_another_world_size() {
    let tmp = common::temp_dir("ddp-train-elastic-old");
    let run = tmp.path().join("run");
    assert_codes(
        &start(Launcher::Torchrun, 2, 16, &run, &pairs(&stop_at(1, 1))),
        75,
    );
    // Strip what an old Trainer did not write: the allocation, the plan, the position's
    // consumed samples and end.
    let dir = run.join("checkpoints");
    let state_file = dir.join("epoch-0001-step-000002.state.safetensors");
    let saved = checkpoint::read_tensors(&state_file).unwrap();
    let mut st: Value = serde_json::from_str(&saved.metadata["train_state"]).unwrap();
    let o = st.as_object_mut().unwrap();
    o.remove("allocation");
    o.remove("plan");
    let p = o["position"].as_object_mut().unwrap();
    p.remove("consumed");
    p.remove("epoch_end");
    let meta: std::collections::HashMap<String, String> =
        [("train_state".to_string(), st.to_string())].into();
    let tensors: Vec<(String, Tensor)> = saved.tensors.into_iter().collect();
    checkpoint::write_tensors(tensors, &meta, &state_file).unwrap();

    let outputs = start(Launcher::Torchrun, 3, 16, &run, &[]);
    assert_codes(&outputs, 1);
    for o in &outputs {
        let t = text(o);
        assert!(
            t.contains("cannot continue epoch 1 of")
                && t.contains("written before checkpoints recorded their ranks and batch, on 2 rank(s) x batch 16 x accumulate 1")
                && t.contains("not on 3 rank(s) x batch 16 x accumulate 1 (global batch 48)"),
            "{t}"
        );
    }
    // On its own world size it continues.
    assert_codes(&start(Launcher::Torchrun, 2, 16, &run, &[]), 0);
    assert_eq!(column(&metrics(&run), "steps"), [8.0, 8.0, 8.0]);
}

/// One torchrun agent of the elastic tests: `--nnodes 1:2`, one rank of this binary's
/// worker, c10d rendezvous on loopback that forgets a dead node after 5 s without
/// heartbeats, one restart. A round closes when both nodes joined, or `last_call` seconds
/// after the first.
fn agent(
    port: u16,
    host: bool,
    last_call: u32,
    dir: &Path,
    env: &[(&str, &str)],
) -> std::process::Child {
    let conf = format!(
        "is_host={host},join_timeout=120,last_call_timeout={last_call},keep_alive_interval=1,\
         keep_alive_max_attempt=5"
    );
    ddp_testkit::torchrun(dir)
        .args([
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "1",
        ])
        .args(["--rdzv-backend", "c10d", "--rdzv-id", "elastic-test"])
        .arg("--rdzv-endpoint")
        .arg(format!("127.0.0.1:{port}"))
        .args(["--rdzv-conf", &conf, "--no-python"])
        .arg(std::env::current_exe().expect("the test binary's path"))
        .args([
            "--ignored",
            "--exact",
            WORKER,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(OUT_ENV, dir.join("run"))
        .env(BATCH_ENV, "16")
        .env(EVERY_ENV, "2")
        .env("DDP_TRAIN_LOG_INDICES", dir.join("indices"))
        .env("DDP_RDZV_TIMEOUT_S", "60")
        .env("OMP_NUM_THREADS", "1")
        // As under a plain torchrun: no DDP_SECRET, so the ranks share the user's key file.
        .env("XDG_CONFIG_HOME", dir.join("config"))
        .env_remove("DDP_SECRET")
        .env_remove("DDP_SECRET_FILE")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("torchrun starts")
}

/// Two torchrun agents (`--nnodes 1:2`, c10d rendezvous) train together at 2 x 16; in
/// epoch 1 step 5 the second node is lost, agent and rank (its rank kills both). The
/// survivor's agent restarts its rank with world size 1; the rank resumes from the run's
/// latest checkpoint (step 4, written every 2 steps) and trains exactly the 128 samples
/// epoch 1 had left, in 8 steps of 16, then two epochs of 16 steps.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_torchrun_elastic_job_that_loses_a_node_continues_with_the_samples_left() {
    let tmp = common::temp_dir("ddp-train-elastic-torchrun");
    let dir = tmp.path();
    std::fs::create_dir_all(dir.join("indices")).unwrap();
    let port = common::free_port();
    // The node to lose is a client of the rendezvous store, which the survivor hosts.
    let lost = [
        ("DDP_TRAIN_FAIL_RANK", "all"),
        ("DDP_TRAIN_FAIL_AT", "1:5"),
        ("DDP_TRAIN_FAIL_SIGNAL", "KILL_PARENT"),
    ];
    // The second node of the first round has 15 s to join; the survivor's round waits 15 s.
    let second = agent(port, false, 15, dir, &lost);
    let first = agent(port, true, 15, dir, &[]);
    let outputs = wait_all(vec![first, second], Duration::from_secs(300));
    let (survivor, lost) = (&outputs[0], &outputs[1]);
    let t = text(survivor);
    assert!(
        survivor.status.success(),
        "the surviving agent failed:\n{t}\n{}",
        text(lost)
    );
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(lost.status.signal(), Some(libc::SIGKILL), "{}", text(lost));
    assert!(
        t.contains("rank 1 of 2") || text(lost).contains("rank 1 of 2"),
        "{t}"
    );
    assert!(
        t.contains(
            "epoch-0001-step-000004.safetensors (epoch 1 at step 4), after the launcher's restart"
        ) && t.contains("the global batch changes from 32 to 16"),
        "{t}"
    );

    let m = metrics(&dir.join("run"));
    assert_eq!(column(&m, "world_size"), [1.0, 1.0, 1.0]);
    assert_eq!(column(&m, "steps"), [12.0, 16.0, 16.0]);
    assert_eq!(m[0]["allocation_change"]["from"]["world_size"], 2);
    assert_eq!(m[0]["allocation_change"]["consumed"], 128);

    // Epoch 1: steps 0-3 of both first ranks (what the checkpoint holds), then steps 4-11 of
    // the restarted rank: every sample once.
    let logs = index_logs(&dir.join("indices"));
    let names: Vec<&str> = logs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(logs.len(), 3, "{names:?}");
    let mut trained = Vec::new();
    for (name, steps) in &logs {
        for ((epoch, step), indices) in steps {
            let restarted = name.contains("-restarted-");
            if *epoch == 1 && (restarted || *step < 4) {
                trained.extend(indices.iter().copied());
            }
        }
    }
    trained.sort_unstable();
    assert_eq!(trained, (0..POINTS as usize).collect::<Vec<_>>());
}

/// A torchrun elastic job (`--nnodes 1:2`) that starts on one node and gains a second: the
/// first agent sees the node waiting, stops its rank (SIGTERM: an agreed stop with a
/// checkpoint, exit code 75) and meets the new node in the next round; both ranks then
/// continue the stopped run from its checkpoint at 2 x 16 with exactly the samples the
/// interrupted epoch had left, its last step filled from the order's start when they do not
/// fill 2 x 16. The first node's rank holds before epoch 1's step 3 until that stop
/// (`DDP_TRAIN_HOLD_AT`), and the second agent starts only once it holds, so the stop comes
/// there however long an epoch or a Python start takes: 48 samples trained, 208 left, 6.5
/// steps of 2 x 16. Every later epoch trains every sample once.
///
/// torchrun shares its rendezvous store with the workers by default and publishes that
/// store's address only in a node's first round, so a node that joins later never learns it
/// (torch 2.13's `DynamicRendezvousHandler.next_rendezvous`); the agents here opt out with
/// `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, and rank 0 hosts our store each round.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_torchrun_elastic_job_that_gains_a_node_continues_on_both_with_the_samples_left() {
    let tmp = common::temp_dir("ddp-train-elastic-gain");
    let dir = tmp.path();
    let indices = dir.join("indices");
    std::fs::create_dir_all(&indices).unwrap();
    let port = common::free_port();
    let held = dir.join("held");
    let env = [
        ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
        ("DDP_TRAIN_HOLD_AT", "1:3"),
        ("DDP_TRAIN_HOLD_FILE", held.to_str().unwrap()),
    ];
    // The first round closes a second after the first node joined: the job starts alone.
    let first = agent(port, true, 1, dir, &env);
    ddp_testkit::wait_for(
        "the first node's rank to hold before epoch 1's step 3",
        Duration::from_secs(120),
        || held.exists(),
    );
    let second = agent(port, false, 1, dir, &env);
    let outputs = wait_all(vec![first, second], Duration::from_secs(300));
    for (name, out) in ["first", "second"].iter().zip(&outputs) {
        assert!(
            out.status.success(),
            "the {name} agent failed:\n{}\n--- the other:\n{}",
            text(out),
            text(&outputs[usize::from(*name == "first")])
        );
    }
    let t = text(&outputs[0]);
    assert!(t.contains("continuing the stopped run"), "{t}");

    let m = metrics(&dir.join("run"));
    assert_eq!(column(&m, "world_size"), [2.0, 2.0, 2.0]);
    // Epoch 1: 3 steps of 16, then 7 of 2 x 16.
    assert_eq!(column(&m, "steps"), [10.0, 8.0, 8.0]);
    let change = &m[0]["allocation_change"];
    assert_eq!(change["from"]["world_size"], 1, "{m:?}");
    assert_eq!(change["consumed"], 48);
    assert!(m[1..].iter().all(|l| l.get("allocation_change").is_none()));

    // Three processes (the first start, then both ranks of the second round). Epoch 1: the
    // steps the first rank took (16 samples each, the first positions of the epoch's order)
    // and the rest of the epoch on two ranks: each sample left once, and, when they do not
    // fill the last step of 2 x 16, as many positions from the order's start as it lacks
    // (as PyTorch's DistributedSampler pads; the resume warning says how many).
    let logs = index_logs(&indices);
    let names: Vec<&str> = logs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(logs.len(), 3, "{names:?}");
    let in_order = |epoch: u64, steps: std::ops::Range<usize>| -> Vec<usize> {
        logs.iter()
            .flat_map(|(_, s)| s.range((epoch, steps.start)..(epoch, steps.end)))
            .flat_map(|(_, i)| i.iter().copied())
            .collect()
    };
    let sorted = |mut v: Vec<usize>| {
        v.sort_unstable();
        v
    };
    // One rank: its steps read the order's positions 0, 1, 2, ...
    let order = in_order(1, 0..3);
    assert_eq!(order.len(), 48);
    // The 208 samples left fill 6.5 steps of 2 x 16: the last takes the order's first 16.
    assert!(t.contains("filled with 16 repeated sample(s)"), "{t}");
    let trained_before = sorted(order.clone());
    let mut expected: Vec<usize> = (0..POINTS as usize)
        .filter(|i| trained_before.binary_search(i).is_err())
        .collect();
    expected.extend(&order[..16]);
    assert_eq!(
        sorted(in_order(1, 3..usize::MAX)),
        sorted(expected),
        "the rest of epoch 1"
    );
    // The later epochs, all on two ranks: every sample once.
    for epoch in 2..=EPOCHS {
        assert_eq!(
            sorted(in_order(epoch, 0..usize::MAX)),
            (0..POINTS as usize).collect::<Vec<_>>(),
            "epoch {epoch}"
        );
    }
}
