//! The chaos test: a seeded series of rounds on 2 CPU ranks, each starting the job (resuming
//! from the run's latest checkpoint, the documented way: the same command with
//! `--resume latest`) and ending it with one fault at a random step of a random rank:
//!
//! - `kill -9` of the rank;
//! - SIGTERM to the rank alone (the ranks agree to stop, checkpoint and exit 75);
//! - SIGSTOP of the rank (a hung rank: the other one times out and the job fails);
//! - `kill -9` of the launcher, sent by the rank (its ranks must die with it).
//!
//! After each round no process of the job is left (shared-memory rings are memfds, freed
//! with the last process that maps them, so none is left either). When a run is past the
//! last step a fault can land before, or after the last round, one clean round finishes it,
//! and its final weights must equal an uninterrupted run's byte for byte; the next round
//! starts a new run.
//!
//! `cargo xtask test` runs the short variant: 4 rounds, each fault once in a seeded order.
//! `cargo xtask chaos --rounds N --seed S` runs a longer one (it sets `DDP_CHAOS_ROUNDS` and
//! `DDP_CHAOS_SEED`); faults are drawn four at a time, each once per four rounds.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use ddp_testkit::{temp_dir, text, wait_bounded, wait_for};
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

/// Optimizer steps per epoch and epochs of the reliability tests' training.
const STEPS: usize = 9;
const EPOCHS: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    KillRank,
    TermRank,
    StopRank,
    KillLauncher,
}

impl Fault {
    const ALL: [Fault; 4] = [
        Fault::KillRank,
        Fault::TermRank,
        Fault::StopRank,
        Fault::KillLauncher,
    ];

    /// Its `DDP_TRAIN_FAIL_SIGNAL` (the injected failures of the `fault-injection` feature).
    fn injected(self) -> &'static str {
        match self {
            Fault::KillRank => "KILL",
            Fault::TermRank => "TERM",
            Fault::StopRank => "STOP",
            Fault::KillLauncher => "KILL_LAUNCHER",
        }
    }
}

/// A number in `0..n` (n > 0).
fn below(rng: &mut ChaCha8Rng, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

/// Steps of the run done by its latest checkpoint: `epoch-000E` is E epochs,
/// `epoch-000E-step-00000S` is E - 1 epochs and S steps; 0 without a checkpoint.
fn progress(run: &Path) -> usize {
    if !run.join("checkpoints/latest").is_file() {
        return 0;
    }
    let name = latest(run);
    let number = |s: &str| -> usize { s.parse().unwrap_or_else(|_| panic!("latest: {name}")) };
    match name
        .strip_prefix("epoch-")
        .map(|rest| rest.split_once("-step-"))
    {
        Some(Some((epoch, step))) => (number(epoch) - 1) * STEPS + number(step),
        Some(None) => number(&name["epoch-".len()..]) * STEPS,
        None => panic!("latest names {name}, not a checkpoint of this run"),
    }
}

/// The processes whose command line mentions `run` (every rank's has `--out RUN`).
fn processes_of(run: &Path) -> Vec<u32> {
    let needle = run.as_os_str().as_encoded_bytes().to_vec();
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != me && ddp_testkit::procs::alive(p))
        .filter(|&p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle))
        })
        .collect()
}

/// The job's command: the reliability tests' training, resumed when there is a checkpoint.
fn job(data: &Path, run: &Path, env: &[(&str, &str)]) -> std::process::Command {
    let mut args = LONG_EPOCHS.to_vec();
    if run.join("checkpoints/latest").is_file() {
        args.extend(["--resume", "latest"]);
    }
    launcher(data, run, &args, env)
}

fn var(name: &str, default: u64) -> u64 {
    std::env::var(name).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name}={v} is not a number"))
    })
}

/// The clean round that finishes `run`, and the comparison with the uninterrupted run.
fn finish(data: &Path, run: &Path, reference: &Weights, seed: u64) {
    let output = wait_bounded(
        job(data, run, &[]).spawn().unwrap(),
        Duration::from_secs(300),
    );
    assert!(output.status.success(), "{}", text(&output));
    assert!(processes_of(run).is_empty());
    assert!(
        final_weights(run) == *reference,
        "{} (seed {seed}) ended with other weights than an uninterrupted run",
        run.display()
    );
}

#[test]
fn faults_at_random_steps_end_with_the_weights_of_an_uninterrupted_run() {
    let rounds = var("DDP_CHAOS_ROUNDS", 4);
    let seed = var("DDP_CHAOS_SEED", 20261201);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let dir = temp_dir("xtask-chaos");
    let data = sample(dir.path());
    let reference = uninterrupted_weights(&data);
    let started = Instant::now();
    let mut order: Vec<Fault> = Vec::new();
    // A fault before a step that has one more after it, so that a stop (which happens
    // before the next step) still lands inside the run.
    let last = EPOCHS * STEPS - 1;
    let mut runs = 1;
    let mut run = dir.path().join("run-1");
    for round in 1..=rounds {
        let mut done = progress(&run);
        if done >= last {
            // This run is as far as faults can take it: finish it, and start another.
            finish(&data, &run, reference, seed);
            runs += 1;
            run = dir.path().join(format!("run-{runs}"));
            done = 0;
        }
        if order.is_empty() {
            order = Fault::ALL.to_vec();
            for i in (1..order.len()).rev() {
                order.swap(i, below(&mut rng, i + 1));
            }
        }
        let fault = order.pop().unwrap();
        let rank = below(&mut rng, 2);
        let at = done + below(&mut rng, last - done);
        let (epoch, step) = (at / STEPS + 1, at % STEPS);
        eprintln!(
            "chaos: round {round}/{rounds} (seed {seed}, run {runs}): {fault:?} of rank {rank} \
             before epoch {epoch} step {step} (resuming after {done} steps)"
        );
        let at = format!("{epoch}:{step}");
        let rank_str = rank.to_string();
        let env = [
            ("DDP_TRAIN_FAIL_RANK", rank_str.as_str()),
            ("DDP_TRAIN_FAIL_AT", at.as_str()),
            ("DDP_TRAIN_FAIL_SIGNAL", fault.injected()),
            // The error folder of a launcher killed by its rank goes with the test's folder.
            ("TMPDIR", dir.path().to_str().unwrap()),
        ];
        let output = wait_bounded(
            job(&data, &run, &env).spawn().unwrap(),
            Duration::from_secs(300),
        );
        let t = text(&output);
        let status = output.status;
        match fault {
            Fault::KillRank => {
                assert_eq!(status.code(), Some(1), "{t}");
                assert!(
                    t.contains(&format!("rank {rank} was killed by signal 9")),
                    "{t}"
                );
            }
            Fault::TermRank => assert_eq!(status.code(), Some(75), "{t}"),
            Fault::StopRank => assert_eq!(status.code(), Some(1), "{t}"),
            Fault::KillLauncher => assert_eq!(status.signal(), Some(libc::SIGKILL), "{t}"),
        }
        wait_for(
            &format!("no process of the job left after {fault:?}"),
            Duration::from_secs(5),
            || processes_of(&run).is_empty(),
        );
    }
    finish(&data, &run, reference, seed);
    eprintln!(
        "chaos: {rounds} faults over {runs} runs (seed {seed}), every run's final weights \
         identical to the uninterrupted run's, {:.0} s",
        started.elapsed().as_secs_f64()
    );
}
