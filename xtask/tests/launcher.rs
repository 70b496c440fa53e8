//! `cargo xtask train` under failure: real launcher and `ddp-train` rank processes on the CPU.
//!
//! The launcher runs the debug `ddp-train` and `ddp-gen-data` (built here with `cargo build`,
//! a no-op after `cargo test --workspace`) through its hidden `--bin` and `--gen-data-bin`
//! options, on a small synthetic sample, with short collective timeouts. What holds for any
//! program (signals, orphans, environment, logs) is tested in `ddp-run/tests`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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
    launcher_with(&["--cpus", "2", "--grace", "2"], data, out, extra, env)
}

/// `cargo xtask train` with the launcher's flags `launch`, quick settings (batch 4 unless
/// `extra` sets it), and `extra`.
fn launcher_with(
    launch: &[&str],
    data: &Path,
    out: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Command {
    let mut cmd = Command::new(XTASK);
    cmd.arg("train")
        .args(launch)
        .arg("--bin")
        .arg(ddp_train())
        .arg("--out")
        .arg(out)
        .args(["--data"])
        .arg(data)
        .args([
            "--image-size",
            "32",
            "--workers",
            "1",
            "--collective-timeout",
            "10",
        ])
        .args(extra)
        .env("DDP_RDZV_TIMEOUT_S", "30")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if !extra.contains(&"--batch-size") {
        cmd.args(["--batch-size", "4"]);
    }
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

// Surviving the cluster: step checkpoints, preemption, time limits, hung ranks, two nodes.

/// The training of the reliability tests: 2 epochs of batch 2 (9 steps per rank per epoch
/// on the 48-image sample), a step checkpoint every 3 optimizer steps, each rank's loss
/// logged at every step.
const LONG_EPOCHS: [&str; 10] = [
    "--epochs",
    "2",
    "--batch-size",
    "2",
    "--checkpoint-every",
    "3",
    "--log-every",
    "1",
    "--threads",
    "1",
];

/// Makes every step at least this long, so that a test can act inside an epoch.
const SLOW_STEPS: (&str, &str) = ("DDP_TRAIN_STEP_SLEEP_MS", "300");

fn final_weights(run: &Path) -> Vec<u8> {
    std::fs::read(run.join("checkpoints/epoch-0002.safetensors")).unwrap()
}

/// The final weights of an uninterrupted run of `LONG_EPOCHS` (computed once per process).
fn uninterrupted_weights(data: &Path) -> &'static [u8] {
    static WEIGHTS: OnceLock<Vec<u8>> = OnceLock::new();
    WEIGHTS.get_or_init(|| {
        let dir = temp_dir("xtask-reference");
        let out = dir.path().join("run");
        let output = wait_bounded(
            launcher(data, &out, &LONG_EPOCHS, &[]).spawn().unwrap(),
            Duration::from_secs(300),
        );
        assert!(output.status.success(), "{}", text(&output));
        let steps: Vec<u64> = std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["steps"].as_u64().unwrap()
            })
            .collect();
        assert_eq!(steps, [9, 9], "the tests below assume 9 steps per epoch");
        final_weights(&out)
    })
}

/// The checkpoint `latest` names.
fn latest(run: &Path) -> String {
    std::fs::read_to_string(run.join("checkpoints/latest"))
        .unwrap()
        .trim()
        .to_string()
}

/// The model files in a run's checkpoint folder, sorted.
fn checkpoint_files(run: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors") && !n.ends_with(".state.safetensors"))
        .collect();
    names.sort();
    names
}

#[test]
fn killing_every_rank_mid_epoch_loses_only_the_steps_since_the_step_checkpoint() {
    let dir = temp_dir("xtask-kill-all");
    let data = sample(dir.path());
    let reference = uninterrupted_weights(&data);
    let out = dir.path().join("run");
    // kill -9 of every rank at epoch 2 step 5; the last step checkpoint is at step 3
    // (optimizer step 12 of the run).
    let killing = [
        ("DDP_TRAIN_FAIL_RANK", "all"),
        ("DDP_TRAIN_FAIL_AT", "2:5"),
        ("DDP_TRAIN_FAIL_SIGNAL", "KILL"),
    ];
    let output = wait_bounded(
        launcher(&data, &out, &LONG_EPOCHS, &killing)
            .spawn()
            .unwrap(),
        Duration::from_secs(300),
    );
    let t = text(&output);
    assert_eq!(output.status.code(), Some(1), "{t}");
    assert!(t.contains("was killed by signal 9"), "{t}");
    assert_eq!(latest(&out), "epoch-0002-step-000003");
    // Step checkpoints at epoch 1 steps 3 and 6 and epoch 2 step 3; the oldest was pruned
    // (--keep-checkpoints 2), the epoch's end is kept.
    assert_eq!(
        checkpoint_files(&out),
        [
            "epoch-0001-step-000006.safetensors",
            "epoch-0001.safetensors",
            "epoch-0002-step-000003.safetensors"
        ]
    );

    let mut resume = LONG_EPOCHS.to_vec();
    resume.extend(["--resume", "latest"]);
    let output = wait_bounded(
        launcher(&data, &out, &resume, &[]).spawn().unwrap(),
        Duration::from_secs(300),
    );
    let t = text(&output);
    assert!(output.status.success(), "{t}");
    assert!(
        t.contains("epoch-0002-step-000003.safetensors (epoch 2 at step 3)"),
        "{t}"
    );
    assert!(
        final_weights(&out) == reference,
        "the resumed run ended with other weights than the uninterrupted one"
    );
    // The resumed epoch's report counts the steps before the checkpoint too.
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(last["epoch"], 2);
    assert_eq!(last["steps"], 9);
}

#[test]
fn sigterm_to_the_launcher_stops_every_rank_at_one_step_with_a_checkpoint() {
    let dir = temp_dir("xtask-sigterm");
    let data = sample(dir.path());
    let reference = uninterrupted_weights(&data);
    let out = dir.path().join("run");
    let start = || {
        launcher_with(
            &["--cpus", "2", "--grace", "60"],
            &data,
            &out,
            &LONG_EPOCHS,
            &[SLOW_STEPS],
        )
        .spawn()
        .unwrap()
    };
    let child = start();
    let ranks = rank_pids(child.id());
    wait_for_text(
        &out.join("logs/rank-0.out"),
        "epoch 2 step 2/9",
        Duration::from_secs(180),
    );
    kill(child.id(), libc::SIGTERM);
    let output = wait_bounded(child, Duration::from_secs(120));
    let t = text(&output);
    // Exit code 75 from the launcher: every rank exited with 75.
    assert_eq!(output.status.code(), Some(75), "{t}");
    for p in ranks {
        assert!(!procs::alive(p), "rank process {p} survived the job");
    }
    // Every rank stopped before the same step, in epoch 2, after the step it was in.
    let stops: Vec<usize> = t
        .lines()
        .filter_map(|l| l.split("stopping at epoch 2 step ").nth(1))
        .map(|rest| rest.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(stops.len(), 2, "{t}");
    assert_eq!(stops[0], stops[1], "{t}");
    let step = stops[0];
    assert!((2..9).contains(&step), "stopped at step {step}: {t}");
    assert!(t.contains("(SIGTERM)"), "{t}");
    assert_eq!(latest(&out), format!("epoch-0002-step-{step:06}"));
    assert!(t.contains("the same command continues the run"), "{t}");

    // The same command again continues by itself and ends as the uninterrupted run.
    let output = wait_bounded(start(), Duration::from_secs(300));
    let t = text(&output);
    assert!(output.status.success(), "{t}");
    assert!(t.contains("continuing the stopped run"), "{t}");
    assert!(
        final_weights(&out) == reference,
        "the resumed run ended with other weights than the uninterrupted one"
    );
}

#[test]
fn a_time_limit_stops_before_it_with_a_checkpoint_and_the_run_continues() {
    let dir = temp_dir("xtask-time-limit");
    let data = sample(dir.path());
    let reference = uninterrupted_weights(&data);
    let out = dir.path().join("run");
    let mut args = LONG_EPOCHS.to_vec();
    args.extend(["--time-limit", "6s"]);
    // The whole run needs about 2 x 9 x 0.3 s of steps plus evaluations, and each start
    // keeps twice a step and a save in reserve: each start stops before its limit and the
    // next continues, until it is done.
    let mut stops = 0;
    loop {
        let before = std::fs::read_to_string(out.join("checkpoints/latest")).ok();
        let output = wait_bounded(
            launcher(&data, &out, &args, &[SLOW_STEPS]).spawn().unwrap(),
            Duration::from_secs(300),
        );
        let t = text(&output);
        if output.status.success() {
            break;
        }
        assert_eq!(output.status.code(), Some(75), "{t}");
        assert!(
            std::fs::read_to_string(out.join("checkpoints/latest")).ok() != before,
            "a start stopped without progress: {t}"
        );
        // Each rank says when it stopped, by its own clock: before the limit.
        let seconds: Vec<f64> = t
            .lines()
            .filter(|l| l.contains("(time limit) after "))
            .map(|l| {
                let after = l.split("(time limit) after ").nth(1).unwrap();
                after.trim_end_matches(" s").parse().unwrap()
            })
            .collect();
        assert!(!seconds.is_empty(), "{t}");
        assert!(seconds.iter().all(|&s| s < 6.0), "{seconds:?}: {t}");
        stops += 1;
        assert!(stops < 8, "the run never finished: {t}");
    }
    assert!(stops >= 1, "the limit never stopped the run");
    assert!(
        final_weights(&out) == reference,
        "the run stopped {stops} time(s) ended with other weights than the uninterrupted one"
    );
}

#[test]
fn a_stopped_rank_fails_the_job_within_the_collective_timeout_naming_it() {
    let dir = temp_dir("xtask-sigstop");
    let data = sample(dir.path());
    let out = dir.path().join("run");
    let stopping = [
        ("DDP_TRAIN_FAIL_RANK", "1"),
        ("DDP_TRAIN_FAIL_AT", "1:2"),
        ("DDP_TRAIN_FAIL_SIGNAL", "STOP"),
    ];
    let child = launcher(&data, &out, &["--epochs", "2"], &stopping)
        .spawn()
        .unwrap();
    let ranks = rank_pids(child.id());
    wait_for_text(
        &out.join("logs/rank-1.out"),
        "injected failure (STOP)",
        Duration::from_secs(180),
    );
    let stopped_at = Instant::now();
    let output = wait_bounded(child, Duration::from_secs(120));
    let took = stopped_at.elapsed();
    let t = text(&output);
    assert_eq!(output.status.code(), Some(1), "{t}");
    // Rank 0 gave up after --collective-timeout 10 naming rank 1.
    assert!(t.contains("rank 0 exited with code 1"), "{t}");
    assert!(
        t.contains(
            "timed out after 10s waiting for peer ranks [1]; rank 1 is not responding \
             (stopped, frozen, or its host is unreachable)"
        ),
        "{t}"
    );
    for p in ranks {
        assert!(!procs::alive(p), "rank process {p} survived the job");
    }
    // The timeout, the diagnosis and the grace period, with a wide margin for a loaded
    // machine: the point is that it ends, not how fast.
    assert!(
        took < Duration::from_secs(90),
        "the job took {took:?} to end"
    );
}

/// The launcher flags of node `node` of two on this machine, meeting at `port`.
fn node_flags(node: usize, port: u16) -> Vec<String> {
    [
        "--cpus",
        "2",
        "--grace",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        &node.to_string(),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port.to_string(),
    ]
    .map(String::from)
    .to_vec()
}

/// Starts node `node` of two; its ranks see another host id than the other node's, so the
/// two nodes talk TCP as on two machines.
fn start_node(node: usize, port: u16, data: &Path, out: &Path, extra: &[&str]) -> Child {
    let flags = node_flags(node, port);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let host = format!("test-node-{node}");
    launcher_with(&flags, data, out, extra, &[("DDP_HOST_ID", &host)])
        .spawn()
        .unwrap()
}

#[test]
fn two_launchers_as_two_nodes_train_as_one_launcher_of_four_ranks() {
    let dir = temp_dir("xtask-two-nodes");
    let data = sample(dir.path());
    let args = ["--epochs", "2", "--threads", "1"];
    let single = dir.path().join("single");
    let output = wait_bounded(
        launcher_with(&["--cpus", "4", "--grace", "2"], &data, &single, &args, &[])
            .spawn()
            .unwrap(),
        Duration::from_secs(300),
    );
    assert!(output.status.success(), "{}", text(&output));

    let two = dir.path().join("two");
    let port = ddp_testkit::free_port();
    let node0 = start_node(0, port, &data, &two, &args);
    // Node 1 comes up later, as a second machine often does.
    std::thread::sleep(Duration::from_secs(4));
    let node1 = start_node(1, port, &data, &two, &args);
    let (out0, out1) = (
        wait_bounded(node0, Duration::from_secs(300)),
        wait_bounded(node1, Duration::from_secs(300)),
    );
    assert!(out0.status.success(), "{}", text(&out0));
    assert!(out1.status.success(), "{}", text(&out1));
    assert!(
        text(&out1).contains("on node 1/2 (world size 4)"),
        "{}",
        text(&out1)
    );
    assert!(
        final_weights(&single) == final_weights(&two),
        "two nodes of 2 ranks ended with other weights than one node of 4"
    );
}

#[test]
fn a_node_that_dies_takes_the_other_node_down() {
    let dir = temp_dir("xtask-node-dies");
    let data = sample(dir.path());
    let out = dir.path().join("run");
    let port = ddp_testkit::free_port();
    let args = ["--epochs", "50", "--log-every", "1"];
    let node0 = start_node(0, port, &data, &out, &args);
    let mut node1 = start_node(1, port, &data, &out, &args);
    let node0_ranks = rank_pids(node0.id());
    wait_for_text(
        &out.join("logs/rank-2.out"),
        "epoch 1 step 2/",
        Duration::from_secs(180),
    );
    // The whole of node 1 dies at once: its launcher by SIGKILL, its ranks with it.
    node1.kill().unwrap();
    let killed_at = Instant::now();
    node1.wait().unwrap();
    let output = wait_bounded(node0, Duration::from_secs(120));
    let took = killed_at.elapsed();
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    for p in node0_ranks {
        assert!(
            !procs::alive(p),
            "rank process {p} of node 0 survived the job"
        );
    }
    // Bound: the collective timeout (10 s) plus the grace period, with a wide margin.
    assert!(
        took < Duration::from_secs(60),
        "node 0 took {took:?} to end"
    );
}
