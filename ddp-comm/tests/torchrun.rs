//! Started by the real `torchrun --no-python` from the setup's Python: the agent already
//! serves a c10d TCPStore on MASTER_PORT (`TORCHELASTIC_USE_AGENT_STORE=True`), and the
//! ranks must rendezvous through it. Without `DDP_SECRET`, as under a plain torchrun, the
//! ranks authenticate their ring links with the user's key file; a rank with another secret
//! (which the unauthenticated agent store lets join) fails every rank at once.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{free_port, lines_with, show, wait_all, worker, WORKER_ENV};
use ddp_comm::{CommError, Options, ProcessGroup, ReduceOp, Secret};

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
    let config = ddp_testkit::temp_dir("torchrun-config");
    let tmp = ddp_testkit::temp_dir("torchrun-tmp");
    let mut cmd = torchrun_of(
        tmp.path(),
        "ranks_started_by_torchrun_meet_through_the_agent_store",
    );
    cmd.env("DDP_RDZV_TIMEOUT_S", "60")
        .env("XDG_CONFIG_HOME", config.path())
        .env_remove("DDP_SECRET")
        .env_remove("DDP_SECRET_FILE")
        .env_remove("DDP_RUN_ID");
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

/// The setup's torchrun (`cargo xtask setup` installs it, so its absence fails the test
/// rather than skipping the only tests of the agent store) starting three ranks of `test` of
/// this binary on a free port, with piped output and temporary files in `tmp`.
fn torchrun_of(tmp: &Path, test: &str) -> Command {
    let mut cmd = ddp_testkit::torchrun(tmp);
    cmd.args([
        "--nnodes",
        "1",
        "--nproc-per-node",
        "3",
        "--master-port",
        &free_port().to_string(),
        "--no-python",
    ])
    .arg(std::env::current_exe().unwrap())
    .args(["--exact", test, "--nocapture", "--test-threads", "1"])
    .env(WORKER_ENV, "1")
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    cmd
}

/// The agent store lets a rank with another secret in, but the values it reads there carry
/// another secret's tags and it writes its own: it fails at rank 0's first value, and
/// every rank stops within seconds (the rendezvous timeout is 120 s), each naming the value
/// it could not trust; none blames a rank for not arriving.
#[test]
fn a_rank_with_another_secret_stops_every_rank_under_the_agent_store() {
    const TEST: &str = "a_rank_with_another_secret_stops_every_rank_under_the_agent_store";
    if worker() {
        let start = Instant::now();
        let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
        let mut opts = Options::from_env().unwrap();
        if rank == 1 {
            opts = opts.with_secret(Secret::from_hex(&"b".repeat(32)).unwrap());
        }
        let err = match ProcessGroup::new(opts) {
            Ok(_) => panic!("rank {rank} joined a group whose rank 1 has another secret"),
            Err(e) => e,
        };
        let waited = start.elapsed();
        println!("AGENT rank {rank}: {err}");
        assert!(
            !matches!(err, CommError::RendezvousTimeout { .. }),
            "rank {rank}: {err}"
        );
        assert!(waited < Duration::from_secs(30), "rank {rank}: {waited:?}");
        return;
    }
    let tmp = ddp_testkit::temp_dir("torchrun-tmp");
    let mut cmd = torchrun_of(tmp.path(), TEST);
    cmd.env("DDP_SECRET", "a".repeat(32))
        .env("DDP_RDZV_TIMEOUT_S", "120")
        .env("DDP_TRANSPORT", "tcp");
    let out = wait_all(vec![cmd.spawn().unwrap()], Duration::from_secs(100)).remove(0);
    assert!(out.status.success(), "torchrun failed:\n{}", show(&out));
    let mut errors = lines_with(&out, "AGENT rank ");
    errors.sort();
    assert_eq!(errors.len(), 3, "{}", show(&out));
    let forged = |key: &str| {
        format!(
            "the value of '{key}' is forged: it does not carry this job's tag, so a process \
             without this rank's secret wrote it (a stranger that reached the unauthenticated \
             agent store, or a rank whose secret differs: check that every rank was given the \
             same "
        )
    };
    // Rank 1 cannot trust rank 0's world size; the others, rank 1's abort or entries.
    assert!(errors[1].contains(&forged("world/0")), "{}", errors[1]);
    for rank in [0, 2] {
        assert!(
            ["abort", "addr/1", "host/1"]
                .iter()
                .any(|key| errors[rank].contains(&forged(key))),
            "{}",
            errors[rank]
        );
    }
    assert!(
        errors.iter().all(|e| !e.contains("never arrived")),
        "{errors:?}"
    );
}
