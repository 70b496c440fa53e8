//! `cargo xtask train` under failure: real launcher and `ddp-train` rank processes on the CPU.
//!
//! The launcher runs the debug `ddp-train` and `ddp-gen-data` (built here with `cargo build`,
//! a no-op after `cargo test --workspace`) through its hidden `--bin` and `--gen-data-bin`
//! options, on a small synthetic sample, with short collective timeouts. What holds for any
//! program (signals, orphans, environment, logs) is tested in `ddp-run/tests`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use ddp_testkit::{kill, procs, temp_dir, text, wait_bounded, wait_for, wait_for_text};

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
    // It ends (by the configured collective timeout, 10 s, plus the grace period): past 60 s
    // `wait_bounded` kills it and fails.
    let output = wait_bounded(child, Duration::from_secs(60));
    assert!(!output.status.success());
    let t = text(&output);
    assert!(t.contains("rank 1 was killed by signal 9"), "{t}");
    assert!(t.contains("last lines of"), "{t}");
    for p in ranks {
        assert!(!procs::alive(p), "rank process {p} survived the job");
    }
}

/// An executable `rank.sh` in `dir` that runs `body` with `sh`, for `--bin`.
fn rank_script(dir: &Path, body: &str) -> PathBuf {
    let script = dir.join("rank.sh");
    std::fs::write(&script, format!("#!/bin/sh\n{body}\n")).unwrap();
    let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
    std::fs::set_permissions(&script, mode).unwrap();
    script
}

/// Runs the launcher `command`, whose job is expected to fail (exit status 1) within a
/// minute: its output.
fn failed_job(command: &mut Command) -> String {
    let output = wait_bounded(command.spawn().unwrap(), Duration::from_secs(60));
    let t = text(&output);
    assert_eq!(output.status.code(), Some(1), "{t}");
    t
}

/// A failed rank that printed nothing in its attempt is said to have, as ddp-run says it:
/// its log, which keeps every attempt's output, has no last lines of this one to show.
#[test]
fn a_rank_that_fails_silently_is_said_to_have_printed_nothing() {
    let dir = temp_dir("xtask-silent");
    let out = dir.path().join("run");
    let rank = rank_script(
        dir.path(),
        r#"if [ "$RANK" = 1 ]; then exit 3; fi
i=0; while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done"#,
    );
    let launch = ["--cpus", "2", "--grace", "2"];
    let t = failed_job(&mut launcher_of(&rank, &launch, dir.path(), &out, &[], &[]));
    assert!(
        t.contains("xtask: rank 1 exited with code 3\nxtask: rank 1 printed nothing\n"),
        "{t}"
    );
    assert!(!t.contains("last lines of"), "{t}");
}

/// A reader that has gone (`cargo xtask train ... | head -1`) is no reason to stop
/// supervising: once its stdout is closed, the launcher still restarts the group after a
/// failure (where it says so on stdout again), and ends as the job did, without a panic.
#[test]
fn a_launcher_whose_stdout_closed_still_restarts_and_succeeds() {
    let dir = temp_dir("xtask-closed-stdout");
    let out = dir.path().join("run");
    let go = dir.path().join("go");
    // Every rank fails in the first attempt, once `go` exists, and succeeds in the second.
    let rank = rank_script(
        dir.path(),
        &format!(
            r#"if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
  i=0; while [ ! -e '{}' ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; exit 3
fi"#,
            go.display()
        ),
    );
    let launch = ["--cpus", "2", "--grace", "2", "--max-restarts", "1"];
    let mut child = launcher_of(&rank, &launch, dir.path(), &out, &[], &[])
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("xtask: starting") {
        line.clear();
        let read = std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
        assert_ne!(
            read, 0,
            "the launcher's stdout ended before it started the ranks"
        );
    }
    drop(stdout);
    std::fs::write(&go, "").unwrap();
    let output = wait_bounded(child, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("xtask: restart 1/1 of the whole group from the start"),
        "{err}"
    );
}

/// Where nvidia-smi lists GPUs that CUDA cannot use (a driver older than libtorch's CUDA),
/// the launcher chose cuda ranks by itself, and each rank's advice names ddp-train's
/// `--device`, which the launcher refuses: it says its own way to CPU ranks.
#[test]
fn ranks_that_find_cuda_unusable_are_told_the_launchers_way_to_cpu_ranks() {
    let dir = temp_dir("xtask-no-cuda");
    let tools = dir.path().join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    ddp_testkit::script(
        &tools.join("nvidia-smi"),
        "#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\n",
    );
    let path = format!(
        "{}:{}",
        tools.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // ddp-train's words (`DeviceChoice::resolve`).
    let rank = rank_script(
        dir.path(),
        "echo 'error: --device cuda: CUDA is not available here (no CUDA device); set --device \
         to cpu' >&2; exit 1",
    );
    let out = dir.path().join("run");
    let t = failed_job(
        launcher_of(&rank, &[], dir.path(), &out, &[], &[("PATH", &path)])
            .env_remove("CUDA_VISIBLE_DEVICES"),
    );
    assert!(t.contains("xtask: starting 1 cuda rank(s)"), "{t}");
    assert!(
        t.contains(
            "set --device to cpu\nxtask: the ranks cannot use CUDA here, though nvidia-smi lists \
             GPUs: use `cargo xtask train --cpus N` to train on CPU ranks (the launcher sets \
             each rank's --device)\n"
        ),
        "{t}"
    );
}

/// The rank logs' folder is the run directory's `logs/`: when it cannot be, the launcher
/// names --out, its flag that chooses it (ddp-run's own is --log-dir).
#[test]
fn a_run_directory_whose_logs_is_a_file_is_refused_naming_out() {
    let dir = temp_dir("xtask-logs-file");
    let out = dir.path().join("run");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("logs"), "").unwrap();
    let rank = rank_script(dir.path(), "exit 0");
    let t = failed_job(&mut launcher_of(
        &rank,
        &["--cpus", "1"],
        dir.path(),
        &out,
        &[],
        &[],
    ));
    assert!(
        t.contains(&format!(
            "error: the folder of the rank logs {} is a file: remove it, or give another --out \
             (the rank logs go to its logs/ folder)\n",
            out.join("logs").display()
        )),
        "{t}"
    );
}

#[test]
fn a_launcher_killed_by_sigkill_takes_ranks_behind_a_wrapper_script_with_it() {
    let dir = temp_dir("xtask-wrapper");
    let data = sample(dir.path());
    let out = dir.path().join("run");
    // Each rank is `sh -c 'ddp-train ... >> log; true'`: ddp-train is the launcher's
    // grandchild, out of reach of the PR_SET_PDEATHSIG the launcher sets on its own children,
    // and writes to a file of its own, so a closed pipe does not end it either.
    let logs = dir.path().join("wrapped");
    let wrapper = rank_script(
        dir.path(),
        &format!(
            "'{}' \"$@\" >>'{}'-\"$RANK\".log 2>&1\ntrue",
            ddp_train().display(),
            logs.display()
        ),
    );
    let launch = ["--cpus", "2", "--grace", "2"];
    // The error folder that the killed launcher leaves goes with the test's folder.
    let tmp = [("TMPDIR", dir.path().to_str().unwrap())];
    let mut child = launcher_of(&wrapper, &launch, &data, &out, &["--epochs", "50"], &tmp)
        .spawn()
        .unwrap();
    let shells = rank_pids(child.id());
    wait_for_text(
        &dir.path().join("wrapped-0.log"),
        "step",
        Duration::from_secs(90),
    );
    let ranks: Vec<u32> = shells
        .iter()
        .flat_map(|&sh| procs::children_of(sh))
        .collect();
    assert_eq!(ranks.len(), 2, "one ddp-train under each shell: {ranks:?}");
    kill(child.id(), libc::SIGKILL);
    child.wait().unwrap();
    wait_for(
        "every ddp-train rank to die with the launcher",
        Duration::from_secs(2),
        || ranks.iter().all(|&p| !procs::alive(p)),
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
    // A second job on that --out is refused, and so is the launcher's restart of it: the
    // run stays as it was, and the job fails.
    let before = latest(&restarted);
    let output = wait_bounded(
        launcher(
            &data,
            &restarted,
            &["--epochs", "4", "--max-restarts", "1"],
            &[],
        )
        .spawn()
        .unwrap(),
        Duration::from_secs(180),
    );
    let again = text(&output);
    assert!(!output.status.success(), "{again}");
    let refused = "[rank 1] error: --out ";
    assert!(
        again.contains("giving up after 1 restart(s)") && again.matches(refused).count() == 2,
        "{again}"
    );
    assert!(again.contains("already holds a run (its "), "{again}");
    assert_eq!(latest(&restarted), before);
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
        final_weights(&out) == *reference,
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
        final_weights(&out) == *reference,
        "the resumed run ended with other weights than the uninterrupted one"
    );
}

#[test]
fn a_run_stopped_without_out_names_the_command_that_continues_it() {
    let dir = temp_dir("xtask-stopped");
    // Ranks that stop at once as resumable (exit code 75), as ddp-train does at a time limit.
    let rank = dir.path().join("stop.sh");
    std::fs::write(&rank, "#!/bin/sh\nexit 75\n").unwrap();
    std::fs::set_permissions(&rank, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let runs = dir.path().join("runs");
    let output = wait_bounded(
        Command::new(XTASK)
            .args(["train", "--cpus", "2", "--grace", "2", "--bin"])
            .arg(&rank)
            .arg("--runs-root")
            .arg(&runs)
            .arg("--data")
            .arg(dir.path())
            .args(["--epochs", "3"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
        Duration::from_secs(120),
    );
    let t = text(&output);
    assert_eq!(output.status.code(), Some(75), "{t}");
    let run: Vec<PathBuf> = std::fs::read_dir(&runs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(run.len(), 1, "{run:?}");
    // The same command would start a new run directory: the message adds this one's.
    let again = format!(
        "cargo xtask train --out {} --cpus 2 --grace 2 --bin {} --runs-root {} --data {} \
         --epochs 3",
        run[0].display(),
        rank.display(),
        runs.display(),
        dir.path().display()
    );
    assert!(t.contains(&again), "{t}");
    assert!(!t.contains("the same command"), "{t}");
}

/// Where a run's `latest` checkpoint is, in the order a run reaches them: (epoch, step), an
/// epoch's own checkpoint after its steps'; `None` before the first.
fn reached(run: &Path) -> Option<(u64, u64)> {
    let name = std::fs::read_to_string(run.join("checkpoints/latest")).ok()?;
    let rest = name.trim().strip_prefix("epoch-")?;
    let (epoch, step) = match rest.split_once("-step-") {
        Some((epoch, step)) => (epoch, step.parse().ok()?),
        None => (rest, u64::MAX),
    };
    Some((epoch.parse().ok()?, step))
}

#[test]
fn a_time_limit_stops_before_it_with_a_checkpoint_and_the_run_continues() {
    let dir = temp_dir("xtask-time-limit");
    let data = sample(dir.path());
    let reference = uninterrupted_weights(&data);
    let out = dir.path().join("run");
    let mut args = LONG_EPOCHS.to_vec();
    args.extend(["--time-limit", "12s"]);
    // The whole run needs 2 x 9 steps of over 0.7 s (12.6 s) plus start-up and evaluations,
    // more than one start's 12 s; each start keeps twice a step and a save (over 1.4 s) in
    // reserve, so it stops before its limit however slowly it started, with a later
    // checkpoint than the last start's, and the next continues until the run is done. As
    // each start gets further, there are at most as many starts as steps.
    let slow_steps = ("DDP_TRAIN_STEP_SLEEP_MS", "700");
    let mut stops = 0;
    let mut last = None;
    loop {
        let output = wait_bounded(
            launcher(&data, &out, &args, &[slow_steps]).spawn().unwrap(),
            Duration::from_secs(300),
        );
        let t = text(&output);
        if output.status.success() {
            break;
        }
        assert_eq!(output.status.code(), Some(75), "{t}");
        let now = reached(&out);
        assert!(
            now > last,
            "a start stopped without progress ({now:?}): {t}"
        );
        last = now;
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
        assert!(seconds.iter().all(|&s| s < 12.0), "{seconds:?}: {t}");
        stops += 1;
    }
    assert!(stops >= 1, "the limit never stopped the run");
    assert!(
        final_weights(&out) == *reference,
        "the run stopped {stops} time(s) ended with other weights than the uninterrupted one"
    );
}

/// The time limit counts from the job's start across the launcher's restarts, as the
/// scheduler's does: attempt 0 fails after 15 s (its ranks never reach the Trainer), so the
/// limit of 15 s is past when attempt 1's ranks start, and they stop at their first step with
/// a checkpoint, over 15 s after the job's start by their own account. Counted from their own
/// start they would have trained on.
#[test]
fn a_restarted_job_counts_its_time_limit_from_the_launchers_start() {
    let dir = temp_dir("xtask-time-limit-restart");
    let data = sample(dir.path());
    let out = dir.path().join("run");
    let rank = rank_script(
        dir.path(),
        &format!(
            r#"if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then sleep 15; exit 3; fi
exec '{}' "$@""#,
            ddp_train().display()
        ),
    );
    let launch = ["--cpus", "2", "--grace", "2", "--max-restarts", "1"];
    let args = ["--epochs", "3", "--time-limit", "15s"];
    let output = wait_bounded(
        launcher_of(&rank, &launch, &data, &out, &args, &[])
            .spawn()
            .unwrap(),
        Duration::from_secs(300),
    );
    let t = text(&output);
    assert_eq!(output.status.code(), Some(75), "{t}");
    assert!(t.contains(" exited with code 3"), "{t}");
    let stops: Vec<&str> = t
        .lines()
        .filter_map(|l| l.split_once("stopping at ").map(|(_, rest)| rest))
        .collect();
    assert!(!stops.is_empty(), "{t}");
    for stop in stops {
        let after = stop
            .strip_prefix("epoch 1 step 1 (time limit) after ")
            .unwrap_or_else(|| panic!("not at the first step: {stop}"));
        let seconds: f64 = after.trim_end_matches(" s").parse().unwrap();
        assert!(seconds >= 15.0, "{stop}: {t}");
    }
    assert_eq!(reached(&out), Some((1, 1)), "{t}");
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
    // It ends (the timeout, the diagnosis and the grace period): past 120 s `wait_bounded`
    // kills it and fails.
    let output = wait_bounded(child, Duration::from_secs(120));
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
}

/// The launcher flags of node `node` of two on this machine, with `cpus` ranks, meeting at
/// `port`.
fn node_flags(node: usize, port: u16, cpus: usize) -> Vec<String> {
    [
        "--cpus",
        &cpus.to_string(),
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

/// Starts node `node` of two, with 2 ranks; its ranks see another host id than the other
/// node's, so the two nodes talk TCP as on two machines. Without `DDP_SECRET` (the launchers
/// of several nodes draw none), the ranks take the secret from the key file in the
/// configuration folder beside `out`, which both nodes share, as machines with a shared home
/// do.
fn start_node(node: usize, port: u16, data: &Path, out: &Path, extra: &[&str]) -> Child {
    start_node_with(node, port, 2, (data, out), extra, &[])
}

/// As [`start_node`], with `cpus` ranks, and the variables `env` besides.
fn start_node_with(
    node: usize,
    port: u16,
    cpus: usize,
    (data, out): (&Path, &Path),
    extra: &[&str],
    env: &[(&str, &str)],
) -> Child {
    let flags = node_flags(node, port, cpus);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let host = format!("test-node-{node}");
    let config = shared_config(out);
    let mut vars = vec![
        ("DDP_HOST_ID", host.as_str()),
        ("XDG_CONFIG_HOME", config.to_str().unwrap()),
    ];
    vars.extend_from_slice(env);
    launcher_with(&flags, data, out, extra, &vars)
        .spawn()
        .unwrap()
}

/// The configuration folder both nodes of [`start_node`] share.
fn shared_config(out: &Path) -> PathBuf {
    out.with_extension("config")
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
    if std::env::var_os("DDP_SECRET").is_none() {
        assert!(
            text(&out0).contains("DDP_SECRET is not set, so the ranks of these 2 nodes"),
            "{}",
            text(&out0)
        );
        assert!(shared_config(&two).join("ddp/secret").is_file());
    }
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
    // The error folder that the killed launcher leaves goes with the test's folder.
    let tmp = [("TMPDIR", dir.path().to_str().unwrap())];
    let mut node1 = start_node_with(1, port, 2, (&data, &out), &args, &tmp);
    let node0_ranks = rank_pids(node0.id());
    wait_for_text(
        &out.join("logs/rank-2.out"),
        "epoch 1 step 2/",
        Duration::from_secs(180),
    );
    // The whole of node 1 dies at once: its launcher by SIGKILL, its ranks with it.
    node1.kill().unwrap();
    node1.wait().unwrap();
    // Node 0 ends (the collective timeout, 10 s, plus the grace period): past 120 s
    // `wait_bounded` kills it and fails.
    let output = wait_bounded(node0, Duration::from_secs(120));
    assert_eq!(output.status.code(), Some(1), "{}", text(&output));
    for p in node0_ranks {
        assert!(
            !procs::alive(p),
            "rank process {p} of node 0 survived the job"
        );
    }
}

/// Two nodes of one rank each. Rank 1 dies while rank 0 writes epoch 2's checkpoint; node
/// 1 restarts it, and it reads `latest` (epoch 1) and waits for the others. Only then does
/// rank 0 point `latest` at epoch 2; it fails (its peer is gone), and node 0 restarts it: it
/// reads epoch 2. Once met, the ranks find they differ; neither named a file, and the writer
/// is gone, so both read `latest` again and the job goes on from epoch 2.
#[test]
fn a_rank_restarted_while_rank_0_writes_a_checkpoint_continues_from_it() {
    let dir = temp_dir("xtask-nodes-restart-in-checkpoint");
    let data = sample(dir.path());
    let out = dir.path().join("run");
    let port = ddp_testkit::free_port();
    let args = ["--epochs", "3", "--threads", "1", "--max-restarts", "1"];
    // Rank 0's pause lasts until `resume` exists; restarted rank 1 waits at the rendezvous
    // for rank 0's failure and restart, which a loaded machine can make slow.
    let resume = dir.path().join("resume");
    let env = [
        ("DDP_TRAIN_PAUSE_IN_CHECKPOINT", "2"),
        ("DDP_TRAIN_PAUSE_FILE", resume.to_str().unwrap()),
        ("DDP_RDZV_TIMEOUT_S", "300"),
    ];
    let node0 = start_node_with(0, port, 1, (&data, &out), &args, &env);
    let node1 = start_node_with(1, port, 1, (&data, &out), &args, &env);
    let mut rank1 = Vec::new();
    wait_for("node 1 started its rank", Duration::from_secs(60), || {
        rank1 = procs::children_of(node1.id());
        rank1.len() == 1
    });
    wait_for_text(
        &out.join("logs/rank-0.out"),
        "pausing inside the checkpoint of epoch 2",
        Duration::from_secs(180),
    );
    kill(rank1[0], libc::SIGKILL);
    // The restarted rank 1 (its log's second such line) read `latest`: rank 0 goes on.
    let mut log1 = String::new();
    wait_for("rank 1 restarted", Duration::from_secs(120), || {
        log1 = std::fs::read_to_string(out.join("logs/rank-1.out")).unwrap_or_default();
        log1.matches("rank 1 resumes ").count() == 2
    });
    let restarted = &log1[log1.rfind("rank 1 resumes ").unwrap()..];
    assert!(
        restarted.contains("epoch-0001.safetensors; meeting the other ranks"),
        "{log1}"
    );
    std::fs::write(&resume, "").unwrap();
    let (out0, out1) = (
        wait_bounded(node0, Duration::from_secs(400)),
        wait_bounded(node1, Duration::from_secs(400)),
    );
    assert!(out0.status.success(), "{}", text(&out0));
    assert!(out1.status.success(), "{}", text(&out1));
    assert!(
        text(&out0).contains("restart 1/1") && text(&out1).contains("restart 1/1"),
        "{}\n{}",
        text(&out0),
        text(&out1)
    );
    let log1 = std::fs::read_to_string(out.join("logs/rank-1.out")).unwrap();
    assert!(
        log1.contains("rank 0 found epoch-0002.safetensors (epoch 2,")
            && log1.contains(", rank 1 epoch-0001.safetensors (epoch 1,")
            && log1.contains("every rank read `latest` again once all had"),
        "{log1}"
    );
    assert!(
        log1.contains("epoch-0002.safetensors (epoch 2 done), after the launcher's restart"),
        "{log1}"
    );
    let ckpt = out.join("checkpoints");
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        "epoch-0003\n"
    );
    // Each epoch trained once: epoch 3 after the two of the first attempt.
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let epochs: Vec<u64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["epoch"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(epochs, [1, 2, 3], "{metrics}");
}

/// Runs `xtask`, which is expected to refuse at once: its exit code, stdout and stderr.
fn xtask_refusal(command: &mut Command) -> (Option<i32>, String, String) {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = wait_bounded(child, Duration::from_secs(60));
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (
        output.status.code(),
        text(&output.stdout),
        text(&output.stderr),
    )
}

/// A word that is not UTF-8 is named by clap, before setup, not a panic of `env::args`.
#[test]
fn a_word_that_is_not_utf8_is_refused_not_a_panic() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let bad = OsStr::from_bytes(b"/tmp/run_\xff");
    for (args, code, says) in [
        (&[OsStr::new("--out"), bad][..], 2, "is not valid UTF-8"),
        (&[OsStr::new("--"), bad][..], 2, "invalid UTF-8"),
    ] {
        let (status, stdout, stderr) = xtask_refusal(
            Command::new(XTASK)
                .args(["train", "--cpus", "1"])
                .args(args),
        );
        assert_eq!(status, Some(code), "{args:?}: {stdout}{stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(!stdout.contains("setup:"), "{args:?}: {stdout}");
    }
}

/// Without a visible GPU, `train --gpus N` and `gpu-check` are refused before setup, which
/// would install 2.6 GB on a first run.
#[test]
fn gpu_commands_without_a_gpu_are_refused_before_setup() {
    for args in [&["train", "--gpus", "2"][..], &["gpu-check"]] {
        let (status, stdout, stderr) = xtask_refusal(
            Command::new(XTASK)
                .args(args)
                .env("CUDA_VISIBLE_DEVICES", ""),
        );
        assert_eq!(status, Some(1), "{args:?}: {stdout}{stderr}");
        // setup says a line whenever it runs, "already installed" at least.
        assert!(!stdout.contains("setup:"), "{args:?}: {stdout}");
        assert!(
            stderr.contains("no GPU is visible") || stderr.contains("none is visible here"),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("--gpus 0"), "{args:?}: {stderr}");
    }
}

/// Each node's launcher would name its own run directory: the ranks write into rank 0's,
/// while a restart resumes from each rank's own and a stop names another node's. Several
/// nodes without `--out` are refused before setup, the build or a rank.
#[test]
fn several_nodes_without_out_are_refused_before_anything_starts() {
    let dir = temp_dir("xtask-nodes-no-out");
    let runs = dir.path().join("runs");
    let (status, stdout, stderr) = xtask_refusal(
        Command::new(XTASK)
            .args(["train", "--cpus", "1", "--nnodes", "2", "--node-rank", "1"])
            .args(["--master-addr", "127.0.0.1", "--master-port", "29500"])
            .arg("--bin")
            .arg(dir.path().join("no-such-ddp-train"))
            .arg("--runs-root")
            .arg(&runs)
            .arg("--data")
            .arg(dir.path()),
    );
    assert_eq!(status, Some(1), "{stdout}{stderr}");
    assert_eq!(
        stderr,
        "error: --nnodes 2 needs --out DIR, the same path on storage every node shares \
         (e.g. --out /shared/runs/odir): without it each node names its own run directory, \
         and a restart or a stopped run cannot continue\n"
    );
    // setup says a line whenever it runs; no run directory was made.
    assert_eq!(stdout, "");
    assert!(!runs.exists());
}

#[test]
fn a_binary_is_found_under_a_relative_target_dir() {
    // Relative to the workspace, where cargo runs, not to this test's folder (xtask/).
    let mut cargo = cargo();
    cargo.env("CARGO_TARGET_DIR", "target/relative-target-dir");
    let name = "ddp-sampler-indices";
    let exe = build_bin(cargo, name, &["-p", "ddp-sampler", "--bin", name]);
    assert_eq!(
        exe,
        root().join("target/relative-target-dir/debug/ddp-sampler-indices")
    );
    assert!(exe.is_file(), "{}", exe.display());
}

/// Nodes that share a checkout build in one target folder, which cargo does not lock on NFS:
/// two launches' builds (here `gen-data`'s, by a stub cargo that notes its start and end) run
/// in turn, the second saying that it waits. Each runs a hard link of its own to the build,
/// which another build cannot replace, removed once it is done.
#[test]
fn builds_in_one_target_folder_run_in_turn() {
    const LIMIT: Duration = Duration::from_secs(60);
    let dir = temp_dir("xtask-build-lock");
    let (log, ran) = (dir.path().join("cargo.log"), dir.path().join("ran.log"));
    let built = dir.path().join("ddp-gen-data");
    ddp_testkit::script(
        &built,
        &format!(
            "#!/bin/sh\necho \"$0 $(stat -c %i \"$0\")\" >> '{}'\n",
            ran.display()
        ),
    );
    let cargo = dir.path().join("cargo");
    // The first build holds the lock until the second launch says it waits for it.
    let release = dir.path().join("release");
    let artifact = format!(
        r#"{{"reason":"compiler-artifact","target":{{"kind":["bin"],"name":"ddp-gen-data"}},"executable":"{}"}}"#,
        built.display()
    );
    ddp_testkit::script(
        &cargo,
        &format!(
            "#!/bin/sh\necho start $PPID >> '{0}'\n\
             while [ ! -e '{1}' ]; do sleep 0.02; done\n\
             echo end $PPID >> '{0}'\necho '{artifact}'\n",
            log.display(),
            release.display()
        ),
    );
    let target = dir.path().join("target");
    // Each launch's output goes to `<out>.log`, read while it runs.
    let gen_data = |out: &str| {
        let output = std::fs::File::create(dir.path().join(format!("{out}.log"))).unwrap();
        Command::new(XTASK)
            .args(["gen-data", "--images", "2", "--out"])
            .arg(dir.path().join(out))
            .env("CARGO", &cargo)
            .env("CARGO_TARGET_DIR", &target)
            .stdout(output.try_clone().unwrap())
            .stderr(output)
            .spawn()
            .unwrap()
    };
    let said = |out: &str| std::fs::read_to_string(dir.path().join(format!("{out}.log"))).unwrap();
    let first = gen_data("a");
    wait_for_text(&log, "start", LIMIT);
    let second = gen_data("b");
    let waiting =
        "xtask: another build in this target folder (another node's?) runs; waiting for it";
    wait_for_text(&dir.path().join("b.log"), waiting, LIMIT);
    std::fs::write(&release, "").unwrap();
    let (first_id, second_id) = (first.id(), second.id());
    let (first, second) = (wait_bounded(first, LIMIT), wait_bounded(second, LIMIT));
    assert!(first.status.success(), "{}", said("a"));
    assert!(second.status.success(), "{}", said("b"));
    assert_eq!(
        std::fs::read_to_string(&log).unwrap(),
        format!("start {first_id}\nend {first_id}\nstart {second_id}\nend {second_id}\n")
    );
    // Each ran its own link to the build (its inode), in target/xtask/bin/, now empty.
    let links = target.join("xtask/bin");
    let inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&built).unwrap());
    let ran = std::fs::read_to_string(&ran).unwrap();
    let ran: Vec<_> = ran.lines().collect();
    assert_eq!(ran.len(), 2, "{ran:?}");
    for line in &ran {
        let (path, its_inode) = line.rsplit_once(' ').unwrap();
        assert!(path.starts_with(links.to_str().unwrap()), "{line}");
        assert!(path.ends_with("/ddp-gen-data"), "{line}");
        assert_eq!(its_inode, inode.to_string(), "{line}");
    }
    assert_ne!(ran[0], ran[1]);
    assert_eq!(std::fs::read_dir(&links).unwrap().count(), 0);
}
