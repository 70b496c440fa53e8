//! Started by the real `torchrun --no-python` from the setup's Python: the agent already
//! serves a c10d TCPStore on MASTER_PORT (`TORCHELASTIC_USE_AGENT_STORE=True`), and the
//! ranks must rendezvous through it. Without `DDP_SECRET`, as under a plain torchrun, the
//! ranks authenticate their ring links with the user's key file; a rank with another secret
//! (which the unauthenticated agent store lets join) fails every rank at once.

mod common;

use std::path::Path;
use std::process::{Child, Command};
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

/// Set for the ranks of the two-node test: the file the failing rank writes.
const FAILED_ONCE_ENV: &str = "DDP_COMM_TEST_FAILED_ONCE";

/// Two torchrun agents (`--nnodes 2`, one rank each, c10d rendezvous, the store they share
/// with their ranks): node 1's rank fails once after the group formed. Its agent restarts
/// it (restart count 1); node 0's agent ends its healthy rank for the new round and starts
/// it again without counting a restart (count 0). The ranks of the second round meet in the
/// store that still holds the first round's keys, though their counts differ, and the job
/// ends with the one restart the failure cost.
#[test]
fn ranks_of_two_nodes_meet_again_after_one_nodes_restart() {
    const TEST: &str = "ranks_of_two_nodes_meet_again_after_one_nodes_restart";
    if worker() {
        let failed_once = std::path::PathBuf::from(std::env::var(FAILED_ONCE_ENV).unwrap());
        let second_round = failed_once.exists();
        let group = ProcessGroup::from_env().unwrap();
        let rank = group.rank();
        if !second_round {
            if rank == 1 {
                std::fs::write(&failed_once, "").unwrap();
                println!("NODES rank 1 fails");
                std::process::exit(1);
            }
            // Healthy: its agent ends it for the next round.
            std::thread::sleep(Duration::from_secs(100));
            panic!("rank 0 of the first round was not restarted");
        }
        let mut v = [rank as i64 + 1];
        group.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [3]);
        let count = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap();
        println!("NODES rank {rank} met again at restart count {count}");
        return;
    }
    let tmp = ddp_testkit::temp_dir("torchrun-nodes");
    let failed_once = tmp.path().join("failed-once");
    let port = free_port().to_string();
    let agent = |host: bool| {
        let endpoint = format!("127.0.0.1:{port}");
        let conf = format!("is_host={host}");
        let args = ["--nproc-per-node", "1", "--rdzv-backend", "c10d"];
        let rdzv = ["--rdzv-id", "two-nodes", "--rdzv-endpoint", &endpoint];
        node_agent(
            tmp.path(),
            TEST,
            &failed_once,
            &[&args[..], &rdzv, &["--rdzv-conf", &conf]],
        )
    };
    // Node 0 hosts the rendezvous; its rank is rank 0.
    let first = agent(true);
    std::thread::sleep(Duration::from_millis(500));
    let second = agent(false);
    let outs = wait_all(vec![first, second], Duration::from_secs(150));
    for out in &outs {
        assert!(out.status.success(), "an agent failed:\n{}", show(out));
    }
    let said: Vec<String> = outs
        .iter()
        .flat_map(|o| lines_with(o, "NODES rank "))
        .collect();
    assert!(said.contains(&"1 fails".to_string()), "{said:?}");
    // Which node's rank is rank 0 is the rendezvous's choice; the counts differ.
    let mut met: Vec<(&str, &str)> = said
        .iter()
        .filter_map(|l| l.split_once(" met again at restart count "))
        .collect();
    met.sort_unstable();
    let mut counts: Vec<&str> = met.iter().map(|(_, c)| *c).collect();
    counts.sort_unstable();
    let ranks: Vec<&str> = met.iter().map(|(r, _)| *r).collect();
    assert_eq!(
        (ranks, counts),
        (vec!["0", "1"], vec!["0", "1"]),
        "{said:?}"
    );
}

/// Waits (60 s at most) in torchrun's agent store for rank 2's claim of its place in the
/// first generation of the first group of run `two-nodes`: c10d's Python client puts `/`
/// before its keys, as ddp-comm's prefix begins.
const WAIT_FOR_RANK_2: &str = "import datetime, os\n\
import torch.distributed as d\n\
s = d.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False, \
timeout=datetime.timedelta(seconds=60))\n\
s.wait(['ddp-comm/two-nodes/0/g1/join/2'])\n";

/// Two torchrun agents of a static rendezvous (`--node-rank`, two ranks each): each agent
/// restarts its own node's ranks alone. Node 1's rank 3 fails before it meets, once rank 2
/// claimed its place; node 1's agent restarts both, while node 0's ranks still wait in that
/// first start's rendezvous. The restarted rank 2 finds its number claimed there and
/// supersedes it, and all four ranks meet in a newer generation: node 0's ranks without a
/// restart, node 1's with the one the failure cost.
#[test]
fn a_static_rendezvous_meets_again_when_one_node_restarts_while_the_other_waits() {
    const TEST: &str =
        "a_static_rendezvous_meets_again_when_one_node_restarts_while_the_other_waits";
    if worker() {
        let failed_once = std::path::PathBuf::from(std::env::var(FAILED_ONCE_ENV).unwrap());
        let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
        if rank == 3 && !failed_once.exists() {
            // Once rank 2 claimed its place in the first start's generation.
            let claimed = ddp_testkit::setup_python()
                .args(["-c", WAIT_FOR_RANK_2])
                .status()
                .unwrap();
            assert!(claimed.success(), "rank 2 never claimed its place");
            std::fs::write(&failed_once, "").unwrap();
            println!("STATIC rank 3 fails");
            std::process::exit(1);
        }
        let group = ProcessGroup::from_env().unwrap();
        let mut v = [rank as i64 + 1];
        group.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [10]);
        let count = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap();
        println!("STATIC rank {rank} met at restart count {count}");
        return;
    }
    let tmp = ddp_testkit::temp_dir("torchrun-static");
    let failed_once = tmp.path().join("failed-once");
    let port = free_port().to_string();
    let agent = |node: &str| {
        let args = [
            "--node-rank",
            node,
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "static",
        ];
        let master = ["--master-addr", "127.0.0.1", "--master-port", &port];
        node_agent(tmp.path(), TEST, &failed_once, &[&args[..], &master])
    };
    let outs = wait_all(vec![agent("0"), agent("1")], Duration::from_secs(150));
    for out in &outs {
        assert!(out.status.success(), "an agent failed:\n{}", show(out));
    }
    // Node 0's ranks met again, in a newer generation than the first.
    let again = "was superseded by a newer start of the ranks (a rank restarted while the \
                 others met); meeting again";
    let node0 = String::from_utf8_lossy(&outs[0].stderr);
    for rank in [0, 1] {
        let said = format!("ddp-comm: rank {rank}: generation 1 of the ranks' meeting");
        assert!(
            node0.contains(&said) && node0.contains(again),
            "{}",
            show(&outs[0])
        );
    }
    let mut said: Vec<String> = outs
        .iter()
        .flat_map(|o| lines_with(o, "STATIC rank "))
        .collect();
    said.sort();
    assert_eq!(
        said,
        [
            "0 met at restart count 0",
            "1 met at restart count 0",
            "2 met at restart count 1",
            "3 fails",
            "3 met at restart count 1"
        ],
        "{}\n{}",
        show(&outs[0]),
        show(&outs[1])
    );
}

/// One torchrun agent of the two-node tests (`--nnodes 2 --max-restarts 1`, then `args`)
/// running `test` of this binary as run `two-nodes`, in the store the agents share with
/// their ranks; the rank that fails once marks it in `failed_once`.
fn node_agent(tmp: &Path, test: &str, failed_once: &Path, args: &[&[&str]]) -> Child {
    let mut cmd = ddp_testkit::torchrun(tmp);
    cmd.args(["--nnodes", "2", "--max-restarts", "1"])
        .args(args.concat())
        .arg("--no-python")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(WORKER_ENV, "1")
        .env(FAILED_ONCE_ENV, failed_once)
        .env("DDP_SECRET", "c".repeat(32))
        .env("DDP_RUN_ID", "two-nodes")
        .env("DDP_RDZV_TIMEOUT_S", "60")
        .env_remove("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd.spawn().unwrap()
}
