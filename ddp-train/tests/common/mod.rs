//! Helpers shared by the tests that run ranks as real processes: the workspace's one copy,
//! in ddp-testkit (free port below the ephemeral range, tempfile folders, bounded waits,
//! torchrun's environment from ddp-run).

#![allow(unused_imports, dead_code)] // Each test file uses its own subset.

pub mod regression;

pub use ddp_testkit::{free_port, rank_command, temp_dir, text, wait_all, wait_bounded, TempDir};

use std::ffi::OsStr;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// How long the ranks of [`run_ddp_train`] may take: each rank's collective and rendezvous
/// timeout, and the bound on the whole run.
#[derive(Clone, Copy)]
pub struct Limits {
    pub collective_s: u64,
    pub run: Duration,
}

impl Limits {
    /// 30 s per collective, two minutes for the run: short runs on a synthetic sample.
    pub const SHORT: Limits = Limits {
        collective_s: 30,
        run: Duration::from_secs(120),
    };
}

/// Runs `world` ranks of the `ddp-train` binary on loopback with `args` (one intra-op thread
/// and one loader worker each) and `env`, and returns each rank's output in rank order.
/// Panics if they do not all finish within `limits.run`.
pub fn run_ddp_train(
    world: usize,
    args: &[impl AsRef<OsStr>],
    env: &[(&str, &str)],
    limits: Limits,
) -> Vec<Output> {
    let port = free_port();
    let timeout = limits.collective_s.to_string();
    let children = (0..world)
        .map(|rank| {
            let mut cmd = rank_command(env!("CARGO_BIN_EXE_ddp-train"), rank, world, port);
            cmd.args(args)
                .args(["--threads", "1", "--workers", "1"])
                .args(["--collective-timeout", &timeout])
                .env("DDP_RDZV_TIMEOUT_S", &timeout)
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().expect("a ddp-train rank starts")
        })
        .collect();
    wait_all(children, limits.run)
}

/// Asserts that every rank exited with 0, printing the output of the first that did not.
pub fn assert_all_ok(outputs: &[Output]) {
    for (r, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "rank {r} failed:\n{}", text(o));
    }
}

/// Starts `world` ranks of this test binary on loopback, each running only the ignored test
/// `worker` (`--ignored --exact worker`) with torchrun's environment; `configure` adds what
/// rank `r` needs (variables, where its output goes).
pub fn spawn_worker_ranks(
    worker: &str,
    world: usize,
    mut configure: impl FnMut(usize, &mut Command),
) -> Vec<Child> {
    let port = free_port();
    let exe = std::env::current_exe().expect("the test binary's path");
    (0..world)
        .map(|rank| {
            let mut cmd = rank_command(&exe, rank, world, port);
            cmd.args([
                "--ignored",
                "--exact",
                worker,
                "--nocapture",
                "--test-threads=1",
            ]);
            configure(rank, &mut cmd);
            cmd.spawn().expect("a rank process starts")
        })
        .collect()
}
