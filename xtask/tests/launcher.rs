//! `cargo xtask train` under failure: real launcher and `ddp-train` rank processes on the CPU.
//!
//! The launcher runs the debug `ddp-train` and `ddp-gen-data` (built here with `cargo build`,
//! a no-op after `cargo test --workspace`) through its hidden `--bin` and `--gen-data-bin`
//! options, on a small synthetic sample, with short collective timeouts. What holds for any
//! program (signals, orphans, environment, logs) is tested in `ddp-run/tests`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ddp_testkit::{kill, procs, temp_dir, text, wait_bounded, wait_for, wait_for_text};

const XTASK: &str = env!("CARGO_BIN_EXE_xtask");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `cargo build --quiet ARGS` (debug), once per test process; returns the binary `name`.
fn debug_binary(cell: &'static OnceLock<PathBuf>, name: &str, args: &[&str]) -> &'static Path {
    cell.get_or_init(|| {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .current_dir(root())
            .args(["build", "--quiet"])
            .args(args)
            .status()
            .unwrap();
        assert!(status.success(), "building {name} failed");
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map_or_else(|| root().join("target"), PathBuf::from);
        target.join("debug").join(name)
    })
}

/// The debug ddp-train binary (a no-op build after `cargo test --workspace`).
fn ddp_train() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    debug_binary(&BIN, "ddp-train", &["-p", "ddp-train"])
}

/// The debug ddp-gen-data binary (ddp-data's debug build is optimised: see Cargo.toml),
/// with ddp-data's features as ddp-train builds it, so that ddp-data is not compiled again.
fn ddp_gen_data() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    debug_binary(
        &BIN,
        "ddp-gen-data",
        &[
            "-p",
            "ddp-data",
            "--no-default-features",
            "--features",
            "tch,odir",
            "--bin",
            "ddp-gen-data",
        ],
    )
}

/// A small synthetic ODIR folder, written by `cargo xtask gen-data`.
fn sample(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    let out = Command::new(XTASK)
        .args([
            "gen-data", "--images", "48", "--size", "48", "--seed", "2", "--bin",
        ])
        .arg(ddp_gen_data())
        .arg("--out")
        .arg(&data)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("ddp-gen-data: 48 images of 24 patients"),
        "{}",
        text(&out)
    );
    data
}

/// `cargo xtask train --cpus 2` with quick settings plus `extra`.
fn launcher(data: &Path, out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(XTASK);
    cmd.args(["train", "--cpus", "2", "--grace", "2", "--bin"])
        .arg(ddp_train())
        .arg("--out")
        .arg(out)
        .args(["--data"])
        .arg(data)
        .args([
            "--image-size",
            "32",
            "--batch-size",
            "4",
            "--workers",
            "1",
            "--collective-timeout",
            "10",
        ])
        .args(extra)
        .env("DDP_RDZV_TIMEOUT_S", "30")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// The rank processes of a running launcher, once both are up.
fn rank_pids(launcher: u32) -> Vec<u32> {
    let mut kids = Vec::new();
    wait_for(
        "the launcher started 2 ranks",
        Duration::from_secs(60),
        || {
            kids = procs::children_of(launcher);
            kids.len() == 2
        },
    );
    kids
}

/// Which rank a process is, from its environment.
fn rank_of(pid: u32) -> usize {
    procs::env_var(pid, "RANK").unwrap().parse().unwrap()
}

#[test]
fn killing_a_rank_ends_the_job_naming_it_and_leaves_no_process() {
    let dir = temp_dir("xtask-kill-rank");
    let data = sample(dir.path());
    let out = dir.path().join("run");
    let child = launcher(&data, &out, &["--epochs", "50"], &[])
        .spawn()
        .unwrap();
    let pid = child.id();
    let ranks = rank_pids(pid);
    wait_for_text(
        &out.join("logs/rank-0.out"),
        "step",
        Duration::from_secs(90),
    );
    let victim = ranks.iter().copied().find(|&p| rank_of(p) == 1).unwrap();
    kill(victim, libc::SIGKILL);
    let killed_at = Instant::now();
    // Bound: the configured collective timeout (10 s) plus the grace period, with margin.
    let output = wait_bounded(child, Duration::from_secs(60));
    let took = killed_at.elapsed();
    assert!(!output.status.success());
    let t = text(&output);
    assert!(t.contains("rank 1 was killed by signal 9"), "{t}");
    assert!(t.contains("last lines of"), "{t}");
    for p in ranks {
        assert!(!procs::alive(p), "rank process {p} survived the job");
    }
    assert!(
        took < Duration::from_secs(40),
        "the job took {took:?} to end"
    );
}

#[test]
fn a_restart_after_an_injected_failure_ends_with_the_same_weights() {
    let dir = temp_dir("xtask-restart");
    let data = sample(dir.path());
    let clean = dir.path().join("clean");
    let output = wait_bounded(
        launcher(&data, &clean, &["--epochs", "3"], &[])
            .spawn()
            .unwrap(),
        Duration::from_secs(180),
    );
    assert!(output.status.success(), "{}", text(&output));

    let restarted = dir.path().join("restarted");
    let failing = [("DDP_TRAIN_FAIL_RANK", "1"), ("DDP_TRAIN_FAIL_AT", "2:1")];
    let output = wait_bounded(
        launcher(
            &data,
            &restarted,
            &["--epochs", "3", "--max-restarts", "1"],
            &failing,
        )
        .spawn()
        .unwrap(),
        Duration::from_secs(180),
    );
    let t = text(&output);
    assert!(output.status.success(), "{t}");
    assert!(t.contains("rank 1 exited with code 17"), "{t}");
    assert!(
        t.contains("restart 1/1 of the whole group from checkpoint epoch-0001"),
        "{t}"
    );
    let weights =
        |run: &Path| std::fs::read(run.join("checkpoints/epoch-0003.safetensors")).unwrap();
    assert!(
        weights(&clean) == weights(&restarted),
        "the restarted run ended with other weights"
    );
}

#[test]
fn a_rank_killed_while_rank_0_writes_a_checkpoint_leaves_the_previous_one_usable() {
    let dir = temp_dir("xtask-kill-in-checkpoint");
    let data = sample(dir.path());
    let out = dir.path().join("run");
    let pause = [("DDP_TRAIN_PAUSE_IN_CHECKPOINT", "2")];
    let child = launcher(&data, &out, &["--epochs", "3"], &pause)
        .spawn()
        .unwrap();
    let ranks = rank_pids(child.id());
    wait_for_text(
        &out.join("logs/rank-0.out"),
        "pausing inside the checkpoint of epoch 2",
        Duration::from_secs(120),
    );
    let rank0 = ranks.iter().copied().find(|&p| rank_of(p) == 0).unwrap();
    kill(rank0, libc::SIGKILL);
    let output = wait_bounded(child, Duration::from_secs(60));
    assert!(!output.status.success());
    assert!(
        text(&output).contains("rank 0 was killed by signal 9"),
        "{}",
        text(&output)
    );
    // The previous checkpoint is intact and still the latest.
    let ckpt = out.join("checkpoints");
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        "epoch-0001\n"
    );
    assert!(ckpt.join("epoch-0001.state.safetensors").is_file());
    assert!(!ckpt.join("epoch-0002.state.safetensors").exists());
    // And the run continues from it.
    let output = wait_bounded(
        launcher(&data, &out, &["--epochs", "3", "--resume", "latest"], &[])
            .spawn()
            .unwrap(),
        Duration::from_secs(180),
    );
    let t = text(&output);
    assert!(output.status.success(), "{t}");
    assert!(
        t.contains("resumed from") && t.contains("epoch-0001.safetensors (epoch 1 done)"),
        "{t}"
    );
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        "epoch-0003\n"
    );
}

#[test]
fn two_jobs_at_once_do_not_collide() {
    let dir = temp_dir("xtask-two-jobs");
    let cache = dir.path().join("cache");
    let runs = dir.path().join("runs");
    // No --data: both generate the built-in sample into one cache at the same time, choose
    // their own ports and their own run directories.
    let start = || {
        Command::new(XTASK)
            .args(["train", "--cpus", "2", "--grace", "2", "--bin"])
            .arg(ddp_train())
            .arg("--cache")
            .arg(&cache)
            .arg("--runs-root")
            .arg(&runs)
            .arg("--gen-data-bin")
            .arg(ddp_gen_data())
            .args([
                "--epochs",
                "1",
                "--max-steps-per-epoch",
                "2",
                "--image-size",
                "32",
                "--workers",
                "1",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (start(), start());
    let (a, b) = (
        wait_bounded(a, Duration::from_secs(300)),
        wait_bounded(b, Duration::from_secs(300)),
    );
    assert!(a.status.success(), "{}", text(&a));
    assert!(b.status.success(), "{}", text(&b));
    let mut run_dirs: Vec<_> = std::fs::read_dir(&runs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    run_dirs.sort();
    assert_eq!(run_dirs.len(), 2, "{run_dirs:?}");
    for run in &run_dirs {
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 1, "{}", run.display());
    }
    // One complete sample in the cache, no temporary folders left.
    let entries: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let sample = cache.join(&entries[0]);
    let rows = std::fs::read_to_string(sample.join("full_df.csv"))
        .unwrap()
        .lines()
        .count();
    assert_eq!(rows, 801, "the cached sample is incomplete");
}
