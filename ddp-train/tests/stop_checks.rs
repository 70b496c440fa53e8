//! The checks for a stop that every rank takes part in, though each rank's runtime settings
//! are its own: a program whose ranks differ in watching stop signals and in a time limit
//! trains as one job, and a time limit on one rank stops every rank. Real processes on
//! loopback (CPU): this test binary re-invoked with `--ignored --exact rank_worker`.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::regression::{points, quiet_settings, Regression};
use common::{assert_all_ok, spawn_worker_ranks, text, wait_all};
use ddp_train::Trainer;

const OUT_ENV: &str = "STOP_CHECKS_OUT";
/// Set on rank 1: its time limit in seconds (rank 0 has none).
const LIMIT_ENV: &str = "STOP_CHECKS_LIMIT";

/// One rank of the regression task for 2 epochs into `STOP_CHECKS_OUT`: rank 1 watches stop
/// signals and has the time limit `STOP_CHECKS_LIMIT`, rank 0 neither (the Trainer's API
/// sets them per rank). Exits with the Trainer's code.
#[test]
#[ignore = "a rank of the tests in this file, started by them"]
fn rank_worker() {
    ddp_train::logging::init();
    let out = std::env::var(OUT_ENV).expect("the test sets the run directory");
    let mut settings = quiet_settings(Path::new(&out)).epochs(2);
    if let Ok(limit) = std::env::var(LIMIT_ENV) {
        settings.runtime.stop_on_signals = true;
        settings.runtime.time_limit_secs = Some(limit.parse().expect("seconds"));
    }
    let task = Regression::new(points(64, 1), points(8, 2));
    let ran = Trainer::new(task, settings).and_then(|mut trainer| trainer.run().map(drop));
    if let Err(e) = &ran {
        println!("rank error: {e}");
    }
    std::process::exit(ran.map_or_else(|e| i32::from(e.exit_code()), |()| 0));
}

/// Runs the two ranks, rank 1 with a time limit of `limit` seconds.
fn run(out: &Path, limit: u64) -> Vec<std::process::Output> {
    let children = spawn_worker_ranks("rank_worker", 2, |rank, cmd| {
        cmd.env(OUT_ENV, out)
            .env("DDP_OP_TIMEOUT_S", "30")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if rank == 1 {
            cmd.env(LIMIT_ENV, limit.to_string());
        }
    });
    wait_all(children, Duration::from_secs(120))
}

/// Rank 1 alone watches signals and has an hour: both ranks take part in its checks before
/// every step and evaluation (agreed once), and train to the end.
#[test]
fn ranks_that_differ_in_their_stop_settings_train_as_one_job() {
    let tmp = common::temp_dir("ddp-train-stop-checks");
    let out = tmp.path().join("run");
    let outputs = run(&out, 3600);
    assert_all_ok(&outputs);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{}", text(&outputs[0]));
}

/// Rank 1's time limit of one second has passed by its first step: it stops every rank at
/// the next check, rank 0 too (which has no limit), with one checkpoint, and both exit 75.
#[test]
fn a_time_limit_on_one_rank_stops_every_rank() {
    let tmp = common::temp_dir("ddp-train-stop-checks-limit");
    let out = tmp.path().join("run");
    let outputs = run(&out, 1);
    for (rank, o) in outputs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(75), "rank {rank}:\n{}", text(o));
        assert!(
            text(o).contains("rank error: "),
            "rank {rank}:\n{}",
            text(o)
        );
    }
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert!(latest.starts_with("epoch-0001-step-"), "{latest}");
}
