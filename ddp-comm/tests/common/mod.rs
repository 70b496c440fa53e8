//! Multi-process test harness: a test re-runs its own test binary once per rank, filtered
//! to itself (`--exact <name>`), with torchrun's environment set; inside such a child,
//! [`worker`] is true and the test runs the rank's body instead of spawning.

#![allow(dead_code)]

use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

pub use ddp_testkit::{free_port, wait_all};

/// Set in worker processes.
pub const WORKER_ENV: &str = "DDP_COMM_TEST_WORKER";

/// Whether this process is a rank spawned by a test; a rank shows ddp-comm's `tracing`
/// events on stderr, as a program with a subscriber would.
pub fn worker() -> bool {
    let worker = std::env::var_os(WORKER_ENV).is_some();
    if worker {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .without_time()
            .with_ansi(false)
            .try_init();
    }
    worker
}

/// This worker's rank and world size, from the environment the parent set.
pub fn rank_world() -> (usize, usize) {
    let get = |k: &str| std::env::var(k).unwrap().parse::<usize>().unwrap();
    (get("RANK"), get("WORLD_SIZE"))
}

/// The command that runs test `test` of this binary as a worker.
pub fn worker_command(test: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(WORKER_ENV, "1")
        .env_remove("RUST_TEST_THREADS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Spawns rank `rank` of `world` for `test`, meeting on `port`, with this test process's
/// `DDP_SECRET` (`extra` may replace it).
pub fn spawn_rank(
    test: &str,
    rank: usize,
    world: usize,
    port: u16,
    extra: &[(&str, String)],
) -> Child {
    let mut cmd = worker_command(test);
    ddp_testkit::RankEnv {
        secret: Some(ddp_testkit::job_secret().clone()),
        ..ddp_testkit::RankEnv::single_node(rank, world, port)
    }
    .apply(&mut cmd);
    cmd.env("DDP_RUN_ID", format!("test-{port}"))
        .env("DDP_RDZV_TIMEOUT_S", "60")
        .env("DDP_OP_TIMEOUT_S", "60");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Text of a worker's output, for assertion messages.
pub fn show(out: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `test` with `world` ranks and asserts every rank succeeded.
pub fn run_world(test: &str, world: usize, extra: &[(&str, String)]) -> Vec<Output> {
    run_world_each(test, world, |_| extra.to_vec())
}

/// The rest of each stdout line of a worker after `prefix` (libtest's `--nocapture` puts
/// `test name ... ` in front of the first line a test prints).
pub fn lines_with(out: &Output, prefix: &str) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.find(prefix).map(|at| l[at + prefix.len()..].to_string()))
        .collect()
}

/// Runs `test` with `world` ranks, rank `r` with the extra variables `extra(r)`, and asserts
/// every rank succeeded.
pub fn run_world_each<'a>(
    test: &str,
    world: usize,
    extra: impl Fn(usize) -> Vec<(&'a str, String)>,
) -> Vec<Output> {
    let port = free_port();
    let children = (0..world)
        .map(|r| spawn_rank(test, r, world, port, &extra(r)))
        .collect();
    let outputs = wait_all(children, Duration::from_secs(120));
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank} of {world} failed:\n{}",
            show(out)
        );
    }
    outputs
}

/// Lines of `/proc/self/maps` that map a ddp-comm shared-memory ring.
pub fn ring_mappings() -> Vec<String> {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:ddp-comm-ring"))
        .map(str::to_string)
        .collect()
}

/// Names in `/dev/shm` (empty if it does not exist).
pub fn dev_shm_entries() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The number of GPUs to use, or why the test is skipped.
pub fn gpus() -> Result<usize, String> {
    if let Some(reason) = ddp_comm::cuda::no_gpu_reason() {
        return Err(reason);
    }
    match ddp_comm::cuda::load_torch_cuda() {
        Ok(true) => {}
        Ok(false) => return Err("libtorch has no libtorch_cuda.so (CPU-only build)".into()),
        Err(e) => return Err(e.to_string()),
    }
    let n = tch::Cuda::device_count() as usize;
    if n == 0 {
        return Err("tch sees no CUDA device".into());
    }
    Ok(n.min(4))
}

/// Rank 0's error when rank 1 has another secret: a rendezvous timeout, rank 1 missing, and
/// the store's count of the connections it refused, with what to check.
pub fn assert_rank_1_was_turned_away(err: &ddp_comm::CommError) {
    match err {
        ddp_comm::CommError::RendezvousTimeout {
            missing,
            turned_away,
            ..
        } => {
            assert_eq!(missing, &[1]);
            assert!(*turned_away >= 1, "{err}");
            assert!(
                err.to_string()
                    .contains("every node must have the same DDP_SECRET"),
                "{err}"
            );
        }
        _ => panic!("rank 0: unexpected {err:?}"),
    }
}
