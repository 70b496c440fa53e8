//! `ddp-train --nproc-per-node N`: one command starts N ranks of itself (PyTorch's
//! `DataParallel` / `mp.spawn` use case) through ddp-run's library, with ddp-run's
//! supervision, log files, signal forwarding and exit codes. Real processes on loopback, CPU.

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{temp_dir, text, wait_bounded};
use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_run::{launch, LaunchConfig, Outcome};
use ddp_testkit::{kill, procs, wait_for, wait_for_text};
use serde_json::Value;

const EXE: &str = env!("CARGO_BIN_EXE_ddp-train");
const LIMIT: Duration = Duration::from_secs(180);

/// A small synthetic ODIR folder.
fn data(dir: &Path) -> PathBuf {
    let root = dir.join("data");
    let config = SyntheticConfig {
        images: 24,
        size: 48,
        seed: 5,
        ..Default::default()
    };
    generate(&root, &config).unwrap();
    root
}

/// `ddp-train ARGS` in `cwd`, quick settings first, as a process no launcher started (none
/// of torchrun's variables), with the forwarded signals at their defaults (a test runner
/// started in the background may ignore some, and the launcher keeps what it finds ignored).
fn ddp_train(cwd: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(EXE);
    cmd.current_dir(cwd)
        // CPU ranks whatever GPUs the machine has: more ranks than GPUs are refused.
        .args(["--image-size", "32", "--threads", "1", "--workers", "1"])
        .args(["--device", "cpu"])
        .args(args)
        .env("DDP_RDZV_TIMEOUT_S", "30")
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for name in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "SLURM_PROCID",
    ] {
        cmd.env_remove(name);
    }
    // SAFETY: signal(2) with SIG_DFL is async-signal-safe and allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            for sig in ddp_run::FORWARDED_SIGNALS {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    cmd
}

fn json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

#[test]
fn the_help_lists_the_flag() {
    let out = Command::new(EXE).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", text(&out));
    assert!(help.contains("--nproc-per-node <N>"), "{help}");
    assert!(help.contains("--nproc_per_node"), "{help}");
}

/// Without `--out` the launching process names the run directory (`runs/<date>` under its
/// working directory) and hands it to both ranks, whose output lands next to their logs. It
/// runs as in SLURM's batch script (`SLURM_PROCID` 0 of the job's 2 tasks, no step), which
/// is no launcher's rank, and its ranks take the job's id: requeued, the job continues its
/// run.
#[test]
fn one_command_starts_two_ranks_that_train_together() {
    let tmp = temp_dir("ddp-train-self-launch");
    let data = data(tmp.path());
    let batch_script = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_ID", "77"),
        ("SLURM_JOB_NODELIST", "localhost"),
    ];
    let args = [
        "--data",
        data.to_str().unwrap(),
        "--nproc-per-node",
        "2",
        "--batch-size",
        "4",
    ];
    // The job's start with `more` arguments, which succeeds: its output, and all of it.
    let start = |more: &[&str]| {
        let out = wait_bounded(
            ddp_train(tmp.path(), &args)
                .args(more)
                .envs(batch_script)
                .spawn()
                .unwrap(),
            LIMIT,
        );
        let t = text(&out);
        assert_eq!(out.status.code(), Some(0), "{t}");
        (out, t)
    };
    let (out, t) = start(&["--epochs", "1"]);
    let runs: Vec<PathBuf> = std::fs::read_dir(tmp.path().join("runs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let run = &runs[0];
    let name = run.file_name().unwrap().to_str().unwrap();
    let fields: Vec<&str> = name.split('-').collect();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    assert!(
        fields.len() == 3
            && (fields[0].len(), fields[1].len()) == (8, 6)
            && fields.iter().all(|f| digits(f)),
        "not runs/YYYYMMDD-HHMMSS-PID: {name}"
    );

    let config = json(&run.join("config.json"));
    assert_eq!(config["world_size"], 2, "{config}");
    assert_eq!(config["run_dir"], format!("runs/{name}"), "{config}");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let epochs: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(epochs.len(), 1, "{metrics}");
    assert_eq!(epochs[0]["world_size"], 2, "{metrics}");
    // Each rank's output (`.out`, written by the launcher) and log (`.log`, the Trainer's).
    for rank in 0..2 {
        let output = std::fs::read_to_string(run.join(format!("logs/rank-{rank}.out")))
            .unwrap_or_else(|e| panic!("rank {rank}'s output: {e}\n{t}"));
        assert!(
            output.contains(&format!("rank {rank} of 2 on Cpu")),
            "{output}"
        );
        assert!(run.join(format!("logs/rank-{rank}.log")).is_file());
    }
    // ddp-run's messages, named after the program; rank 1's lines prefixed on the terminal.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ddp-train: starting ranks 0-1 of 2, rendezvous at 127.0.0.1:"),
        "{err}"
    );
    assert!(
        err.ends_with("ddp-train: all 2 rank(s) finished\n"),
        "{err}"
    );
    assert!(t.contains("[rank 1] "), "{t}");
    assert_eq!(config["run_id"], "77", "{config}");

    // The job, requeued, starts again on the run it chose: its ranks continue it.
    let (_, t) = start(&["--epochs", "2", "--out", run.to_str().unwrap()]);
    assert!(t.contains(", continuing job 77"), "{t}");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let epochs: Vec<u64> = metrics
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["epoch"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(epochs, [1, 2], "{metrics}");
}

/// `ddp-run --nproc-per-node 2 ddp-train --nproc-per-node 2` would be 4 ranks in two jobs
/// that cannot meet: every rank refuses, naming the conflict.
#[test]
fn a_rank_that_a_launcher_started_refuses_to_start_ranks() {
    let tmp = temp_dir("ddp-train-self-launch-nested");
    let run = tmp.path().join("run");
    let out = wait_bounded(
        ddp_train(
            tmp.path(),
            &[
                "--data",
                "unused",
                "--out",
                run.to_str().unwrap(),
                "--nproc-per-node=2",
            ],
        )
        .envs([
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .spawn()
        .unwrap(),
        LIMIT,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        [
            "error: --nproc-per-node 2 starts this program's ranks, but this process already \
             is rank 1 of 2 started by a launcher (RANK and WORLD_SIZE are set): drop \
             --nproc-per-node when a launcher (ddp-run, torchrun, srun) starts the ranks, or \
             run the program without the launcher"
        ]
    );
    assert!(!run.exists(), "ranks were started in {}", run.display());

    // The same through the launcher itself: each of its ranks fails at once, no rank more.
    // The rank whose error came first is named, and may have been ended by the launcher's
    // SIGTERM after it recorded it (when the other one exited first).
    let logs = tmp.path().join("logs");
    let config = LaunchConfig {
        echo: false,
        log_dir: Some(logs.clone()),
        ..LaunchConfig::new(EXE, 2).args(["--data", "unused", "--nproc-per-node", "2"])
    };
    let outcome = launch(&config, |_| {}).unwrap();
    let Outcome::Failed { failure, .. } = outcome else {
        panic!("the job did not fail: {outcome:?}");
    };
    let ended = [ddp_run::Exit::Code(1), ddp_run::Exit::Signal(libc::SIGTERM)];
    assert!(ended.contains(&failure.exit), "{failure:?}");
    let error = failure.error.clone().unwrap_or_default();
    assert!(
        error.starts_with(&format!(
            "--nproc-per-node 2 starts this program's ranks, but this process already is rank \
             {} of 2 started by a launcher",
            failure.rank
        )),
        "{failure:?}"
    );
}

/// Settings every rank would refuse are refused before any starts: `--resume latest`
/// without `--out` names what it needs, and leaves no run directory behind.
#[test]
fn settings_the_ranks_would_refuse_start_none() {
    let tmp = temp_dir("ddp-train-self-launch-invalid");
    let out = wait_bounded(
        ddp_train(
            tmp.path(),
            &[
                "--data",
                "unused",
                "--nproc-per-node",
                "2",
                "--resume",
                "latest",
            ],
        )
        .spawn()
        .unwrap(),
        LIMIT,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        ["error: --resume latest needs --out (the run directory) to know which run"]
    );
    assert!(!tmp.path().join("runs").exists(), "{err}");
}

/// A rank that fails ends the job as with ddp-run: its error and last lines, exit code 1.
#[test]
fn a_failing_rank_ends_the_job_with_ddp_runs_report() {
    let tmp = temp_dir("ddp-train-self-launch-fail");
    let missing = tmp.path().join("no-such-odir");
    let run = tmp.path().join("run");
    let out = wait_bounded(
        ddp_train(
            tmp.path(),
            &[
                "--nproc-per-node",
                "2",
                "--data",
                missing.to_str().unwrap(),
                "--out",
                run.to_str().unwrap(),
            ],
        )
        .spawn()
        .unwrap(),
        LIMIT,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let failed: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("ddp-train: rank "))
        .collect();
    assert_eq!(failed.len(), 1, "{err}");
    // Both fail at once: the rank whose error came first is named, ended by the launcher's
    // SIGTERM if the other one exited first. Its error is in its last lines, or else
    // told from its error file.
    let rank = (0..2)
        .find(|r| {
            [" exited with code 1", " was killed by signal 15 (SIGTERM)"]
                .map(|how| format!("ddp-train: rank {r}{how}"))
                .contains(&failed[0].to_string())
        })
        .unwrap_or_else(|| panic!("{err}"));
    let log = run.join(format!("logs/rank-{rank}.out"));
    let error = format!("error: loading ODIR data from {}", missing.display());
    let in_tail = format!("ddp-train: last lines of {}:\n    {error}", log.display());
    let recorded = format!(
        "ddp-train: rank {rank}'s error: {}",
        &error["error: ".len()..]
    );
    assert!(err.contains(&in_tail) || err.contains(&recorded), "{err}");
    assert!(!err.contains("stack backtrace"), "{err}");
}

/// The rank whose error came first is named, though its peers, failing for want of it once
/// it ends, may exit before it: rank 0 cannot write its checkpoint (a folder stands in the
/// state file's place), a real error, not an injected exit. Which rank exits first varies
/// from run to run, so the job runs several times.
#[test]
fn the_rank_whose_error_came_first_is_named() {
    let tmp = temp_dir("ddp-train-self-launch-first");
    let data = data(tmp.path());
    for attempt in 0..8 {
        let run = tmp.path().join(format!("run{attempt}"));
        let blocker = run.join("checkpoints/epoch-0001.state.safetensors");
        std::fs::create_dir_all(blocker.join("x")).unwrap();
        let args = [
            "--epochs",
            "1",
            "--batch-size",
            "4",
            "--nproc-per-node",
            "2",
        ];
        let out = wait_bounded(
            ddp_train(tmp.path(), &args)
                .args(["--data", data.to_str().unwrap()])
                .args(["--out", run.to_str().unwrap()])
                .spawn()
                .unwrap(),
            LIMIT,
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        let summary: Vec<&str> = err
            .lines()
            .skip_while(|l| !l.starts_with("ddp-train: rank "))
            .collect();
        assert!(
            summary
                .first()
                .is_some_and(|l| l.starts_with("ddp-train: rank 0 ")),
            "run {attempt} names another rank:\n{err}"
        );
        let error = format!("checkpoint '{}': Is a directory", blocker.display());
        assert!(
            summary.iter().any(|l| l.contains(&error)),
            "run {attempt} does not show rank 0's error:\n{err}"
        );
    }
}

/// SIGTERM to the one command reaches both ranks, which stop at a checkpoint; the command
/// exits 75 as ddp-run does ("stopped, to be continued"), no rank outlives it, and, started
/// without `--out`, it ends with the command that continues the run in the directory it chose.
/// Its steps are slowed (`DDP_TRAIN_STEP_SLEEP_MS`) so that the signal comes mid-run.
#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn sigterm_stops_every_rank_at_a_checkpoint_with_exit_code_75() {
    let tmp = temp_dir("ddp-train-self-launch-stop");
    let data = data(tmp.path());
    let child = ddp_train(
        tmp.path(),
        &[
            "--nproc_per_node=2",
            "--data",
            data.to_str().unwrap(),
            "--epochs",
            "3",
            "--batch-size",
            "2",
            "--log-every",
            "1",
        ],
    )
    .env("DDP_TRAIN_STEP_SLEEP_MS", "300")
    .spawn()
    .unwrap();
    let mut ranks = Vec::new();
    wait_for("the command started 2 ranks", LIMIT, || {
        ranks = procs::children_of(child.id());
        ranks.len() == 2
    });
    let runs = tmp.path().join("runs");
    let mut chosen = Vec::new();
    wait_for("the command chose its run directory", LIMIT, || {
        chosen = std::fs::read_dir(&runs).map_or(vec![], |d| d.flatten().collect());
        chosen.len() == 1
    });
    let name = chosen[0].file_name().into_string().unwrap();
    let run = runs.join(&name);
    wait_for_text(&run.join("logs/rank-0.out"), "epoch 1 step 2/", LIMIT);
    kill(child.id(), libc::SIGTERM);
    let out = wait_bounded(child, LIMIT);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(75), "{t}");
    let err = String::from_utf8_lossy(&out.stderr);
    let last: Vec<&str> = err.lines().rev().take(2).collect();
    assert_eq!(
        last,
        [
            format!(
                "  {EXE} --image-size 32 --threads 1 --workers 1 --device cpu --out runs/{name} \
                 --nproc_per_node=2 --data {} --epochs 3 --batch-size 2 --log-every 1",
                data.display()
            ),
            format!(
                "ddp-train: the job stopped after signal 15 at a checkpoint (exit code 75); \
                 this command continues it in runs/{name}:"
            ),
        ],
        "{t}"
    );
    for pid in ranks {
        assert!(
            !procs::alive(pid),
            "rank process {pid} outlived the command"
        );
    }
    // Both ranks got the signal and stopped after the same step, where rank 0 checkpointed.
    let stops: Vec<&str> = t
        .lines()
        .filter_map(|l| l.split("stopping at ").nth(1))
        .map(|rest| rest.split(" (").next().unwrap())
        .collect();
    assert_eq!(stops.len(), 2, "{t}");
    assert_eq!(stops[0], stops[1], "{t}");
    assert!(t.contains("(SIGTERM)"), "{t}");
    assert!(run.join("checkpoints/latest").is_file(), "{t}");
}
