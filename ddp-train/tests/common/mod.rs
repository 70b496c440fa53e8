//! Helpers shared by the tests that run ranks as real processes: the workspace's one copy,
//! in ddp-testkit (free port below the ephemeral range, tempfile folders, bounded waits,
//! torchrun's environment from ddp-run).

#![allow(unused_imports, dead_code)] // Each test file uses its own subset.

pub use ddp_testkit::{free_port, rank_command, temp_dir, text, wait_all, wait_bounded, TempDir};

use std::process::{Child, Command};

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
