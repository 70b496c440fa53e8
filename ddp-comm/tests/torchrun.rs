//! Started by the real `torchrun --no-python` from the setup's Python: the agent already
//! serves a c10d TCPStore on MASTER_PORT (`TORCHELASTIC_USE_AGENT_STORE=True`), and the
//! ranks must rendezvous through it. Without `DDP_SECRET`, as under a plain torchrun, the
//! ranks authenticate their ring links with the user's key file.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::{free_port, lines_with, show, wait_all, worker, WORKER_ENV};
use ddp_comm::{ProcessGroup, ReduceOp};

fn torchrun() -> Option<PathBuf> {
    let deps = std::env::var_os("DDP_DEPS_DIR")?;
    let path = PathBuf::from(deps).join("venv/bin/torchrun");
    path.exists().then_some(path)
}

#[test]
fn ranks_started_by_torchrun_meet_through_the_agent_store() {
    if worker() {
        assert_eq!(
            std::env::var("TORCHELASTIC_USE_AGENT_STORE").as_deref(),
            Ok("True")
        );
        let group = ProcessGroup::from_env().unwrap();
        let (rank, n) = (group.rank(), group.world_size());
        assert_eq!(n, 3);
        assert_eq!(group.local_rank(), rank);
        assert_eq!(group.local_world_size(), 3);
        let mut v: Vec<i64> = (0..100_000).map(|i| i * (rank as i64 + 1)).collect();
        group.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        assert!(v.iter().enumerate().all(|(i, x)| *x == 6 * i as i64));
        let names = group
            .all_gather_bytes(format!("rank-{rank}").as_bytes())
            .unwrap();
        assert_eq!(
            names,
            vec![b"rank-0".to_vec(), b"rank-1".to_vec(), b"rank-2".to_vec()]
        );
        // More groups through the same agent store: one while the first lives, and one
        // after both are gone (each with keys of its own, as c10d's groups).
        let second = ProcessGroup::from_env().unwrap();
        let mut v = [rank as i64 + 1];
        second.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [6]);
        drop((group, second));
        let third = ProcessGroup::from_env().unwrap();
        let mut v = [rank as i64];
        third.all_reduce_slice(&mut v, ReduceOp::Max).unwrap();
        assert_eq!(v, [2]);
        println!("TORCHRUN rank {rank} of {n} ok");
        return;
    }
    let Some(torchrun) = torchrun() else {
        println!("skipped: no torchrun under $DDP_DEPS_DIR/venv/bin (run cargo xtask setup)");
        return;
    };
    let port = free_port();
    let config = ddp_testkit::temp_dir("torchrun-config");
    let mut cmd = Command::new(torchrun);
    cmd.args([
        "--nnodes",
        "1",
        "--nproc-per-node",
        "3",
        "--master-port",
        &port.to_string(),
        "--no-python",
    ])
    .arg(std::env::current_exe().unwrap())
    .args([
        "--exact",
        "ranks_started_by_torchrun_meet_through_the_agent_store",
        "--nocapture",
        "--test-threads",
        "1",
    ])
    .env(WORKER_ENV, "1")
    .env("DDP_RDZV_TIMEOUT_S", "60")
    .env("XDG_CONFIG_HOME", config.path())
    .env_remove("DDP_SECRET")
    .env_remove("DDP_SECRET_FILE")
    .env_remove("DDP_RUN_ID")
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    let out = wait_all(vec![cmd.spawn().unwrap()], Duration::from_secs(120)).remove(0);
    assert!(out.status.success(), "torchrun failed:\n{}", show(&out));
    let mut ranks: Vec<String> = lines_with(&out, "TORCHRUN rank ");
    ranks.sort();
    assert_eq!(
        ranks,
        ["0 of 3 ok", "1 of 3 ok", "2 of 3 ok"],
        "{}",
        show(&out)
    );
    let key_file = config.path().join("ddp/secret");
    assert!(key_file.is_file(), "no key file was made:\n{}", show(&out));
}
