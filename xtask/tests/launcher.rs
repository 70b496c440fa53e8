//! `cargo xtask train` under failure: real launcher and rank processes on the CPU.
//!
//! The launcher runs the debug `ddp-train` (built here with `cargo build -p ddp-train`, a
//! no-op after `cargo test --workspace`) through its hidden `--bin` option, on a small
//! synthetic sample, with short collective timeouts.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const XTASK: &str = env!("CARGO_BIN_EXE_xtask");

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The debug ddp-train binary, built once per test process.
fn ddp_train() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .current_dir(root())
            .args(["build", "--quiet", "-p", "ddp-train"])
            .status()
            .unwrap();
        assert!(status.success(), "building ddp-train failed");
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map_or_else(|| root().join("target"), PathBuf::from);
        target.join("debug").join("ddp-train")
    })
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("xtask-launch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small synthetic ODIR folder, written by `cargo xtask gen-data`.
fn sample(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    let out = Command::new(XTASK)
        .args([
            "gen-data", "--images", "48", "--size", "48", "--seed", "2", "--out",
        ])
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
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

/// Waits for `child` at most `limit`; kills it and panics when it takes longer.
fn wait_bounded(child: Child, limit: Duration) -> Output {
    let pid = child.id();
    let waiter = std::thread::spawn(move || child.wait_with_output().unwrap());
    let deadline = Instant::now() + limit;
    while !waiter.is_finished() {
        if Instant::now() > deadline {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("the launcher did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    waiter.join().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Processes whose parent is `pid` (from /proc), excluding zombies.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // Fields after the parenthesised command name: state, ppid, ...
        let Some(rest) = stat.rsplit_once(") ").map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split(' ').collect();
        if fields.len() > 1 && fields[0] != "Z" && fields[1] == pid.to_string() {
            out.push(p);
        }
    }
    out.sort_unstable();
    out
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, r)| !r.starts_with('Z'))
    })
}

/// Waits until `path` contains `needle` (bounded).
fn wait_for_text(path: &Path, needle: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        if std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{} never contained {needle:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The rank processes of a running launcher, once both are up.
fn rank_pids(launcher: u32) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let kids = children_of(launcher);
        if kids.len() == 2 {
            return kids;
        }
        assert!(
            Instant::now() < deadline,
            "the launcher did not start 2 ranks: {kids:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Which rank a process is, from its environment.
fn rank_of(pid: u32) -> usize {
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"RANK="))
        .map(|v| String::from_utf8_lossy(v).parse().unwrap())
        .unwrap()
}

fn kill9(pid: u32) {
    // SAFETY: kill(2) with a pid read from /proc; at worst it names a process already gone.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

#[test]
fn killing_a_rank_ends_the_job_naming_it_and_leaves_no_process() {
    let dir = temp_dir("kill-rank");
    let data = sample(&dir);
    let out = dir.join("run");
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
    kill9(victim);
    let killed_at = Instant::now();
    // Bound: the configured collective timeout (10 s) plus the grace period, with margin.
    let output = wait_bounded(child, Duration::from_secs(60));
    let took = killed_at.elapsed();
    assert!(!output.status.success());
    let t = text(&output);
    assert!(t.contains("rank 1 was killed by signal 9"), "{t}");
    assert!(t.contains("last lines of"), "{t}");
    for p in ranks {
        assert!(!alive(p), "rank process {p} survived the job");
    }
    assert!(
        took < Duration::from_secs(40),
        "the job took {took:?} to end"
    );
}

#[test]
fn killing_the_launcher_takes_the_ranks_with_it() {
    let dir = temp_dir("kill-launcher");
    let data = sample(&dir);
    let out = dir.join("run");
    let mut child = launcher(&data, &out, &["--epochs", "50"], &[])
        .spawn()
        .unwrap();
    let ranks = rank_pids(child.id());
    kill9(child.id());
    let _ = child.wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    while ranks.iter().any(|&p| alive(p)) {
        assert!(
            Instant::now() < deadline,
            "ranks outlived the launcher by 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_restart_after_an_injected_failure_ends_with_the_same_weights() {
    let dir = temp_dir("restart");
    let data = sample(&dir);
    let clean = dir.join("clean");
    let output = wait_bounded(
        launcher(&data, &clean, &["--epochs", "3"], &[])
            .spawn()
            .unwrap(),
        Duration::from_secs(180),
    );
    assert!(output.status.success(), "{}", text(&output));

    let restarted = dir.join("restarted");
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
    let dir = temp_dir("kill-in-checkpoint");
    let data = sample(&dir);
    let out = dir.join("run");
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
    kill9(rank0);
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
    let dir = temp_dir("two-jobs");
    let cache = dir.join("cache");
    let runs = dir.join("runs");
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
