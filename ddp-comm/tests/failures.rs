//! What goes wrong must fail promptly with an error that names the culprit: missing, killed,
//! hung, duplicated or misconfigured ranks, busy ports, bad environment values, stray peers
//! and ranks of another job (on the store, and on the shared-memory handshake), mismatched collectives, unsupported
//! tensors; and a killed rank leaves no shared memory behind.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{
    dev_shm_entries, free_port, lines_with, rank_world, ring_mappings, show, spawn_rank, wait_all,
    worker, worker_command,
};
use ddp_comm::{Backend, CommError, LinkKind, Options, ProcessGroup, ReduceOp};
use tch::{Kind, Tensor};

const LIMIT: Duration = Duration::from_secs(60);

/// In a worker: joins the group and prints the error it expects instead of a group.
fn expect_join_error() -> CommError {
    match ProcessGroup::from_env() {
        Ok(g) => panic!("rank {} joined although it should not have", g.rank()),
        Err(e) => {
            println!("ERROR: {e}");
            e
        }
    }
}

fn env(pairs: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
    pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
}

#[test]
fn rendezvous_timeout_names_the_missing_rank_and_address() {
    if worker() {
        // The rank whose deadline passes first reports the timeout; the other may learn it
        // from that rank's abort instead. Both name rank 2 and the address.
        let start = Instant::now();
        let err = expect_join_error();
        let timed_out = match err {
            CommError::RendezvousTimeout { .. } => true,
            CommError::Rendezvous { .. } => false,
            _ => panic!("{err:?}"),
        };
        println!("WAITED: {} {timed_out}", start.elapsed().as_millis());
        return;
    }
    let port = free_port();
    let timeout = Duration::from_secs(6);
    let extra = env(&[("DDP_RDZV_TIMEOUT_S", &timeout.as_secs().to_string())]);
    let children = (0..2)
        .map(|r| {
            spawn_rank(
                "rendezvous_timeout_names_the_missing_rank_and_address",
                r,
                3,
                port,
                &extra,
            )
        })
        .collect();
    let outs = wait_all(children, LIMIT);
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
        let err = lines_with(out, "ERROR: ").join("\n");
        assert!(
            err.contains("ranks [2] never arrived"),
            "rank {rank}: {err}"
        );
        assert!(
            err.contains(&format!("127.0.0.1:{port}")),
            "rank {rank}: {err}"
        );
    }
    // Each rank timed its own join (the deadline starts inside it, after the process has
    // started): the one that reports the timeout waited it out, and neither waited much longer.
    let waited: Vec<(Duration, bool)> = outs
        .iter()
        .map(|out| {
            let line = lines_with(out, "WAITED: ").join("");
            let (ms, timed_out) = line.split_once(' ').expect("WAITED: <ms> <timed out>");
            (
                Duration::from_millis(ms.parse().unwrap()),
                timed_out == "true",
            )
        })
        .collect();
    assert!(
        waited.iter().any(|&(w, t)| t && w >= timeout),
        "no rank waited out its {timeout:?} deadline: {waited:?}"
    );
    assert!(
        waited
            .iter()
            .all(|&(w, _)| w < timeout + Duration::from_secs(20)),
        "a rank waited far past its {timeout:?} deadline: {waited:?}"
    );
}

#[test]
fn a_rank_that_exits_fails_the_others_and_poisons_the_group_over_tcp() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        assert_eq!(group.ring_layout().to_next, Some(LinkKind::Tcp));
        let (rank, _) = rank_world();
        let mut t = Tensor::ones([4 << 20], (Kind::Float, tch::Device::Cpu));
        group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(t.double_value(&[0]), 3.0);
        if rank == 2 {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                std::process::exit(17);
            });
        }
        let err = loop {
            if let Err(e) = group.all_reduce(&mut t, ReduceOp::Avg) {
                break e;
            }
        };
        println!("ERROR: {err}");
        assert!(
            matches!(err, CommError::PeerLost { .. } | CommError::Timeout { .. }),
            "{err:?}"
        );
        let next = group.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
        assert!(matches!(next, CommError::Poisoned(_)), "{next:?}");
        let next = group.barrier().unwrap_err();
        assert!(matches!(next, CommError::Poisoned(_)), "{next:?}");
        return;
    }
    let port = free_port();
    let extra = env(&[("DDP_OP_TIMEOUT_S", "20"), ("DDP_TRANSPORT", "tcp")]);
    let children = (0..3)
        .map(|r| {
            spawn_rank(
                "a_rank_that_exits_fails_the_others_and_poisons_the_group_over_tcp",
                r,
                3,
                port,
                &extra,
            )
        })
        .collect();
    let outs = wait_all(children, LIMIT);
    assert_eq!(
        outs[2].status.code(),
        Some(17),
        "rank 2:\n{}",
        show(&outs[2])
    );
    let mut named = false;
    for (rank, out) in outs[..2].iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
        let err = lines_with(out, "ERROR: ").join("\n");
        assert!(err.contains("peer rank"), "rank {rank}: {err}");
        named |= err.contains("peer rank 2 (tcp 127.0.0.1:");
    }
    assert!(
        named,
        "no survivor named rank 2:\n{}\n{}",
        show(&outs[0]),
        show(&outs[1])
    );
}

#[test]
fn a_busy_port_is_named() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let secret = ddp_comm::Secret::from_hex(&"ab".repeat(16)).unwrap();
    let opts = Options::new(0, 2, "127.0.0.1", port)
        .with_secret(secret)
        .rendezvous_timeout(Duration::from_secs(5));
    let err = ProcessGroup::new(opts).unwrap_err();
    match &err {
        CommError::PortInUse { addr } => assert_eq!(addr.port(), port),
        other => panic!("expected PortInUse, got {other:?}"),
    }
    assert!(
        err.to_string().contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
}

/// Timeouts set in code past what a deadline can hold (`Duration::MAX`) are capped at
/// 10^9 s, as the environment's are, and the group forms and reduces instead of panicking
/// at its rendezvous or collective deadline.
#[test]
fn timeouts_too_long_for_a_deadline_are_capped() {
    let port = free_port();
    let secret = ddp_comm::Secret::from_hex(&"cd".repeat(16)).unwrap();
    let cap = Some(Duration::from_secs(1_000_000_000));
    let ranks = (0..2).map(|rank| {
        let mut opts = Options::new(rank, 2, "127.0.0.1", port)
            .with_secret(secret.clone())
            .backend(Backend::Cpu)
            .rendezvous_timeout(Duration::MAX)
            .op_timeout(Duration::MAX);
        assert_eq!(
            (opts.env.rendezvous_timeout, opts.env.op_timeout),
            (cap, cap)
        );
        // The fields are public: rank 1 bypasses the setters, and the group caps them too.
        if rank == 1 {
            opts.env.rendezvous_timeout = Some(Duration::MAX);
            opts.env.op_timeout = Some(Duration::MAX);
        }
        opts
    });
    two_ranks_reduce(ranks);
}

/// Forms a group of two ranks in threads, with `ranks`' options (rank 0's first), and
/// asserts that they sum `[rank + 1, 10]` to `[3, 20]`.
fn two_ranks_reduce(ranks: impl IntoIterator<Item = Options>) {
    let threads: Vec<_> = ranks
        .into_iter()
        .enumerate()
        .map(|(rank, opts)| {
            std::thread::spawn(move || {
                let group = ProcessGroup::new(opts)?;
                let mut v = [rank as i64 + 1, 10];
                group.all_reduce_slice(&mut v, ReduceOp::Sum)?;
                Ok::<_, CommError>(v)
            })
        })
        .collect();
    assert_eq!(threads.len(), 2);
    for (rank, thread) in threads.into_iter().enumerate() {
        let got = thread.join().expect("a rank panicked");
        assert_eq!(got.unwrap(), [3, 20], "rank {rank}");
    }
}

/// Rank 0 of a job across hosts listens on every interface without looking `MASTER_ADDR`
/// up, as c10d's TCPStore does: a name that does not resolve on its host (a Kubeflow
/// master's Service before its pod is ready; here `.invalid`, which never does) still forms
/// the group with a rank that reaches it by IP.
#[test]
fn rank_0_across_hosts_serves_a_master_addr_that_does_not_resolve() {
    let port = free_port();
    let secret = ddp_comm::Secret::from_hex(&"e1".repeat(16)).unwrap();
    // One rank on each of two hosts.
    let ranks = [("ddp-test.invalid", "a"), ("127.0.0.1", "b")]
        .into_iter()
        .enumerate()
        .map(|(rank, (master, host))| {
            Options::new(rank, 2, master, port)
                .local(0, 1)
                .host_id(host)
                .with_secret(secret.clone())
                .backend(Backend::Cpu)
                .rendezvous_timeout(Duration::from_secs(2))
        });
    two_ranks_reduce(ranks);
}

/// A rank looks a `MASTER_ADDR` that does not resolve (yet) up again until its rendezvous
/// deadline, as c10d does, rather than failing at once; then the error names it.
#[test]
fn a_master_addr_that_never_resolves_is_retried_until_the_deadline() {
    let secret = ddp_comm::Secret::from_hex(&"e2".repeat(16)).unwrap();
    let timeout = Duration::from_secs(1);
    let opts = Options::new(1, 2, "late.invalid", free_port())
        .with_secret(secret)
        .backend(Backend::Cpu)
        .rendezvous_timeout(timeout);
    let start = Instant::now();
    let err = ProcessGroup::new(opts).unwrap_err();
    let waited = start.elapsed();
    assert!(
        matches!(&err, CommError::Address { addr, .. } if addr.starts_with("late.invalid:")),
        "{err:?}"
    );
    assert!(waited >= timeout, "gave up after {waited:?}: {err}");
    // The message names the address; its cause, why.
    let (text, why) = (err.to_string(), std::error::Error::source(&err).unwrap());
    assert!(
        text.contains("(MASTER_ADDR:MASTER_PORT")
            && why.to_string().starts_with("still not resolved after "),
        "{text}: {why}"
    );
}

#[test]
fn malformed_environment_values_are_named() {
    if worker() {
        let want = std::env::var("EXPECT_VAR").unwrap();
        match expect_join_error() {
            CommError::MalformedEnv { var, .. } | CommError::MissingEnv { var, .. } => {
                assert_eq!(var, want)
            }
            other => panic!("expected an environment error about {want}, got {other:?}"),
        }
        return;
    }
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[
                ("RANK", "zero"),
                ("WORLD_SIZE", "2"),
                ("MASTER_PORT", "1234"),
            ],
            "RANK",
        ),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "0"), ("MASTER_PORT", "1234")],
            "WORLD_SIZE",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "port"),
            ],
            "MASTER_PORT",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
            ],
            "MASTER_PORT",
        ),
        // Without LOCAL_WORLD_SIZE, each rank may be on a host of its own.
        (
            &[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1234")],
            "MASTER_ADDR",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "1234"),
                ("DDP_RDZV_TIMEOUT_S", "soon"),
            ],
            "DDP_RDZV_TIMEOUT_S",
        ),
        (
            &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "many")],
            "SLURM_NTASKS",
        ),
    ];
    let children = cases
        .iter()
        .map(|(vars, var)| {
            let mut cmd = worker_command("malformed_environment_values_are_named");
            for k in [
                "RANK",
                "WORLD_SIZE",
                "MASTER_PORT",
                "MASTER_ADDR",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "SLURM_PROCID",
                "DDP_RDZV_TIMEOUT_S",
            ] {
                cmd.env_remove(k);
            }
            cmd.envs(vars.iter().copied()).env("EXPECT_VAR", var);
            cmd.spawn().unwrap()
        })
        .collect();
    for (out, (_, var)) in wait_all(children, LIMIT).iter().zip(cases) {
        assert!(out.status.success(), "{var}:\n{}", show(out));
        assert!(
            lines_with(out, "ERROR: ").join("").contains(var),
            "{var}:\n{}",
            show(out)
        );
    }
}

/// Spawns ranks with individual settings and returns each one's error line (or "OK").
fn run_bad_world(test: &str, ranks: &[(usize, usize)]) -> Vec<String> {
    let port = free_port();
    let children = ranks
        .iter()
        .map(|&(rank, world)| {
            spawn_rank(
                test,
                rank,
                world,
                port,
                &env(&[("DDP_RDZV_TIMEOUT_S", "30")]),
            )
        })
        .collect();
    let start = Instant::now();
    let outs = wait_all(children, LIMIT);
    // Everyone fails fast: an abort, not the 30 s rendezvous timeout.
    assert!(
        start.elapsed() < Duration::from_secs(25),
        "took {:?}",
        start.elapsed()
    );
    outs.iter()
        .map(|out| {
            assert!(out.status.success(), "{}", show(out));
            lines_with(out, "ERROR: ").join("\n")
        })
        .collect()
}

#[test]
fn a_rank_out_of_range_aborts_the_rendezvous() {
    if worker() {
        expect_join_error();
        return;
    }
    let errors = run_bad_world(
        "a_rank_out_of_range_aborts_the_rendezvous",
        &[(0, 2), (2, 2)],
    );
    assert!(
        errors[1].contains("rank 2 is out of range for world size 2"),
        "{errors:?}"
    );
    assert!(
        errors[0].contains("aborted") && errors[0].contains("rank 2 is out of range"),
        "{errors:?}"
    );
}

#[test]
fn a_duplicated_rank_aborts_the_rendezvous() {
    if worker() {
        expect_join_error();
        return;
    }
    let errors = run_bad_world(
        "a_duplicated_rank_aborts_the_rendezvous",
        &[(0, 3), (1, 3), (1, 3)],
    );
    assert!(
        errors
            .iter()
            .any(|e| e.contains("rank 1 was started twice")),
        "{errors:?}"
    );
    assert!(
        errors[0].contains("rank 1 was started twice"),
        "rank 0 did not learn why: {errors:?}"
    );
}

#[test]
fn a_world_size_mismatch_aborts_the_rendezvous() {
    if worker() {
        expect_join_error();
        return;
    }
    let errors = run_bad_world(
        "a_world_size_mismatch_aborts_the_rendezvous",
        &[(0, 2), (1, 3)],
    );
    assert!(
        errors[1].contains("rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"),
        "{errors:?}"
    );
    assert!(errors[0].contains("aborted"), "{errors:?}");
}

/// A node restarts its rank 1 (attempt 1) while the previous rank 0 still runs, as
/// `ddp-run --nnodes 2 --max-restarts 1` does on each node (`DDP_LAUNCHER_ATTEMPT`): the new rank 1 waits for rank 0
/// of its own attempt instead of joining the old store (where it was "started twice").
#[test]
fn a_restarted_rank_waits_for_rank_0_of_its_own_attempt() {
    const TEST: &str = "a_restarted_rank_waits_for_rank_0_of_its_own_attempt";
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        match std::env::var("DDP_TEST_ROLE").unwrap().as_str() {
            // Rank 0 of attempt 0 outlives its rank 1 by a few seconds.
            "old" if group.rank() == 0 => std::thread::sleep(Duration::from_secs(4)),
            "old" => {}
            _ => two_rank_sum(&group),
        }
        println!("done");
        return;
    }
    let port = free_port();
    let spawn = |rank: usize, attempt: &str, role: &str| {
        let extra = env(&[("DDP_LAUNCHER_ATTEMPT", attempt), ("DDP_TEST_ROLE", role)]);
        spawn_rank(TEST, rank, 2, port, &extra)
    };
    // Two nodes count their attempts on their own: rank 0's node has restarted once more.
    let old0 = spawn(0, "1", "old");
    let old1 = spawn(1, "0", "old");
    let out = wait_all(vec![old1], LIMIT).remove(0);
    assert!(out.status.success(), "old rank 1:\n{}", show(&out));
    let new1 = spawn(1, "1", "new");
    let out = wait_all(vec![old0], LIMIT).remove(0);
    assert!(out.status.success(), "old rank 0:\n{}", show(&out));
    let new0 = spawn(0, "2", "new");
    for (rank, out) in wait_all(vec![new0, new1], LIMIT).iter().enumerate() {
        assert!(out.status.success(), "new rank {rank}:\n{}", show(out));
        assert_eq!(
            lines_with(out, "rank "),
            [format!("{rank}: ok")],
            "{}",
            show(out)
        );
    }
}

/// Ranks of different launcher attempts that never met (rank 0's node restarted before the
/// other node's rank got to the rendezvous) form the group.
#[test]
fn ranks_of_different_attempts_that_never_met_form_the_group() {
    const TEST: &str = "ranks_of_different_attempts_that_never_met_form_the_group";
    if worker() {
        two_rank_sum(&ProcessGroup::from_env().unwrap());
        return;
    }
    let port = free_port();
    let children = [(0, "2"), (1, "1")]
        .into_iter()
        .map(|(rank, attempt)| {
            spawn_rank(
                TEST,
                rank,
                2,
                port,
                &env(&[("DDP_LAUNCHER_ATTEMPT", attempt)]),
            )
        })
        .collect();
    for (rank, out) in wait_all(children, LIMIT).iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
        assert_eq!(
            lines_with(out, "rank "),
            [format!("{rank}: ok")],
            "{}",
            show(out)
        );
    }
}

/// In a worker of a two-rank job: one all-reduce whose result shows both ranks took part.
fn two_rank_sum(group: &ProcessGroup) {
    let (rank, _) = rank_world();
    let mut v = vec![rank as f64 + 1.0; 3];
    group.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v, vec![3.0; 3]);
    println!("rank {rank}: ok");
}

/// Version 1's hello: magic, version, the run id in cleartext, rank.
fn cleartext_hello(magic: &[u8; 4], run_id: &str, rank: u32) -> Vec<u8> {
    let mut hello = magic.to_vec();
    hello.push(1);
    hello.extend_from_slice(&(run_id.len() as u16).to_le_bytes());
    hello.extend_from_slice(run_id.as_bytes());
    hello.extend_from_slice(&rank.to_le_bytes());
    hello
}

/// Version 2's hello with a zero nonce: magic, version, number, nonce.
fn hello(magic: &[u8; 4], number: u32) -> Vec<u8> {
    let mut hello = magic.to_vec();
    hello.push(2);
    hello.extend_from_slice(&number.to_le_bytes());
    hello.extend_from_slice(&[0u8; 16]);
    hello
}

#[test]
fn stray_connections_without_the_secret_are_rejected() {
    if worker() {
        two_rank_sum(&ProcessGroup::from_env().unwrap());
        return;
    }
    let test = "stray_connections_without_the_secret_are_rejected";
    let port = free_port();
    let rank0 = spawn_rank(test, 0, 2, port, &[]);
    let connect = || {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => return s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => panic!("rank 0's store never listened: {e}"),
            }
        }
    };
    // What a connection got before rank 0 closed it (an end, or a reset where it left
    // bytes unread); a read that timed out is no closing.
    let until_closed = |mut stream: &TcpStream| {
        let mut got = Vec::new();
        match stream.read_to_end(&mut got) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("rank 0 never closed the connection: {e}"),
        }
        got
    };
    // Not our protocol at all, then the old cleartext token (the right run id, even).
    let run_id = format!("test-{port}");
    for probe in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &cleartext_hello(b"DDPS", &run_id, 0),
    ] {
        let mut stray = connect();
        stray
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stray.write_all(probe).unwrap();
        assert_eq!(
            until_closed(&stray),
            b"",
            "a stray connection got an answer"
        );
    }
    // Our protocol without the secret: the challenge, then nothing but the end.
    let mut guesser = connect();
    guesser
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    guesser.write_all(&hello(b"DDPS", 0)).unwrap();
    let mut challenge = [0u8; 48];
    guesser.read_exact(&mut challenge).unwrap();
    guesser.write_all(&[0u8; 32]).unwrap();
    assert_eq!(until_closed(&guesser), b"", "a wrong proof got an answer");
    // A silent connection must not hold up the rendezvous either.
    let _silent = connect();
    let rank1 = spawn_rank(test, 1, 2, port, &[]);
    let outs = wait_all(vec![rank0, rank1], LIMIT);
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
    }
    let log = String::from_utf8_lossy(&outs[0].stderr);
    for why in [
        "rejected: bad magic",
        "rejected: protocol version 1, expected 2",
        "rejected: wrong proof of the job secret",
    ] {
        assert!(log.contains(why), "{why}: rank 0's log:\n{log}");
    }
    assert!(
        !log.contains(&run_id),
        "rank 0's log shows the run id:\n{log}"
    );
}

#[test]
fn groups_with_different_secrets_cannot_rendezvous() {
    if worker() {
        let (rank, _) = rank_world();
        let start = Instant::now();
        let err = expect_join_error();
        println!("WAITED: {}", start.elapsed().as_millis());
        match (rank, &err) {
            (
                1,
                CommError::Handshake {
                    failure: ddp_comm::AuthFailure::Unproven { .. },
                    ..
                },
            ) => {}
            (0, _) => common::assert_rank_1_was_turned_away(&err),
            _ => panic!("rank {rank}: unexpected {err:?}"),
        }
        return;
    }
    let test = "groups_with_different_secrets_cannot_rendezvous";
    let port = free_port();
    let secret = |digit: &str| digit.repeat(32);
    let timeout = Duration::from_secs(8);
    let timeout_s = timeout.as_secs().to_string();
    let rank0 = spawn_rank(
        test,
        0,
        2,
        port,
        &env(&[
            ("DDP_SECRET", &secret("a")),
            ("DDP_RDZV_TIMEOUT_S", &timeout_s),
        ]),
    );
    let rank1 = spawn_rank(
        test,
        1,
        2,
        port,
        &env(&[
            ("DDP_SECRET", &secret("b")),
            ("DDP_RDZV_TIMEOUT_S", &timeout_s),
        ]),
    );
    let outs = wait_all(vec![rank0, rank1], LIMIT);
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
    }
    let err = lines_with(&outs[1], "ERROR: ").join("\n");
    assert!(
        err.contains(&format!(
            "handshake with the rendezvous store at 127.0.0.1:{port}"
        )) && err.contains("could not prove that it knows the job secret")
            && err.contains("the same DDP_SECRET"),
        "rank 1: {err}"
    );
    for out in &outs {
        let all = format!("{}{}", show(out), err);
        assert!(!all.contains(&secret("a")) && !all.contains(&secret("b")));
    }
    // Each rank timed its own join: rank 0 waited out its 8 s deadline for rank 1, and rank
    // 1, refused at the handshake, failed at once instead of trying again until its own.
    let waited: Vec<Duration> = outs
        .iter()
        .map(|out| Duration::from_millis(lines_with(out, "WAITED: ").join("").parse().unwrap()))
        .collect();
    assert!(
        waited[0] >= timeout && waited[0] < timeout + Duration::from_secs(20),
        "rank 0 waited {:?} for a {timeout:?} deadline",
        waited[0]
    );
    assert!(
        waited[1] < timeout,
        "rank 1 waited {:?}, as long as its {timeout:?} deadline, after a refused handshake",
        waited[1]
    );
}

/// Two ranks that call different collectives fail, naming both: all-reduces of 10 and 11
/// floats; and `all_gather_bytes` beside a gather of one `i64` from each rank, whose first
/// exchange (the lengths, 8 bytes from each rank) must not pass for that gather.
#[test]
fn mismatched_collectives_are_reported_not_corrupted() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        let (rank, _) = rank_world();
        let err = if std::env::var("DDP_TEST_CASE").unwrap() == "gather" {
            match rank {
                0 => group.all_gather_bytes(b"abc").map(drop).unwrap_err(),
                _ => group.all_gather(&Tensor::from(7i64)).map(drop).unwrap_err(),
            }
        } else {
            let mut t = Tensor::zeros([10 + rank as i64], (Kind::Float, tch::Device::Cpu));
            group.all_reduce(&mut t, ReduceOp::Sum).unwrap_err()
        };
        println!("ERROR: {err}");
        return;
    }
    let cases = [
        (
            "reduce",
            "all_reduce Sum of 10 x f32",
            "all_reduce Sum of 11 x f32",
        ),
        (
            "gather",
            "all_gather_bytes's exchange of lengths",
            "all_gather of 8 bytes from each rank",
        ),
    ];
    for (case, one, other) in cases {
        for transport in ["auto", "tcp"] {
            let port = free_port();
            let test = "mismatched_collectives_are_reported_not_corrupted";
            let extra = env(&[("DDP_TRANSPORT", transport), ("DDP_TEST_CASE", case)]);
            let outs = wait_all(
                (0..2)
                    .map(|r| spawn_rank(test, r, 2, port, &extra))
                    .collect(),
                LIMIT,
            );
            let errors: Vec<String> = outs
                .iter()
                .map(|o| {
                    assert!(o.status.success(), "{case}, {transport}: {}", show(o));
                    lines_with(o, "ERROR: ").join("")
                })
                .collect();
            assert!(
                errors.iter().any(|e| e.contains(one) && e.contains(other)),
                "{case}, {transport}: {errors:?}"
            );
        }
    }
}

/// The shared-memory rings this worker maps, with a sanity check that they are the two of
/// its links.
fn two_ring_mappings() -> Vec<String> {
    let maps = ring_mappings();
    assert_eq!(
        maps.len(),
        2,
        "expected two ring mappings:\n{}",
        maps.join("\n")
    );
    maps
}

#[test]
fn a_rank_killed_mid_collective_fails_the_others_and_leaves_no_shared_memory() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        let (rank, _) = rank_world();
        let layout = group.ring_layout();
        assert_eq!(
            (layout.to_next, layout.from_prev),
            (Some(LinkKind::SharedMemory), Some(LinkKind::SharedMemory))
        );
        two_ring_mappings();
        let mut t = Tensor::ones([4 << 20], (Kind::Float, tch::Device::Cpu));
        group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(t.double_value(&[0]), 3.0);
        if rank == 2 {
            // SIGKILL: no destructor, no `closed` flag; only the kernel knows.
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: sending SIGKILL to this very process.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            });
        }
        let start = Instant::now();
        let err = loop {
            if let Err(e) = group.all_reduce(&mut t, ReduceOp::Avg) {
                break e;
            }
        };
        println!("ERROR: {err}");
        println!("FAILED AFTER: {:?}", start.elapsed());
        assert!(
            matches!(err, CommError::PeerLost { .. }),
            "a dead peer must be noticed, not waited out: {err:?}"
        );
        let next = group.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
        assert!(matches!(next, CommError::Poisoned(_)), "{next:?}");
        // While the group lives, its rings stay mapped; once it is dropped nothing is left.
        two_ring_mappings();
        drop(group);
        let left = ring_mappings();
        assert!(left.is_empty(), "rings still mapped:\n{}", left.join("\n"));
        let fds: Vec<String> = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .map(|p| p.display().to_string())
            .filter(|p| p.contains("memfd:"))
            .collect();
        assert!(fds.is_empty(), "memfd descriptors left open: {fds:?}");
        println!("CLEAN");
        return;
    }
    let before = dev_shm_entries();
    let port = free_port();
    // The op timeout is far longer than the test's limit: the survivors must notice the
    // death itself, not wait out the timeout.
    let extra = env(&[("DDP_OP_TIMEOUT_S", "600")]);
    let test = "a_rank_killed_mid_collective_fails_the_others_and_leaves_no_shared_memory";
    let children: Vec<_> = (0..3)
        .map(|r| spawn_rank(test, r, 3, port, &extra))
        .collect();
    let killed_pid = children[2].id();
    let outs = wait_all(children, LIMIT);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        outs[2].status.signal(),
        Some(libc::SIGKILL),
        "rank 2:\n{}",
        show(&outs[2])
    );
    let mut named = false;
    for (rank, out) in outs[..2].iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
        assert_eq!(
            lines_with(out, "CLEAN"),
            [""],
            "rank {rank}:\n{}",
            show(out)
        );
        let err = lines_with(out, "ERROR: ").join("\n");
        assert!(err.contains("peer rank"), "rank {rank}: {err}");
        named |= err.contains(&format!("peer rank 2 (shared memory, pid {killed_pid})"));
        eprintln!(
            "rank {rank}: {err} (after {})",
            lines_with(out, "FAILED AFTER: ").join("")
        );
    }
    assert!(
        named,
        "no survivor named rank 2:\n{}\n{}",
        show(&outs[0]),
        show(&outs[1])
    );
    let after = dev_shm_entries();
    let new: Vec<&String> = after.iter().filter(|e| !before.contains(e)).collect();
    assert!(
        new.iter().all(|e| !e.contains("ddp")),
        "ddp-comm left files in /dev/shm: {new:?}"
    );
}

#[test]
fn a_hung_rank_times_out_the_others_naming_it() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        let (rank, _) = rank_world();
        assert_eq!(group.ring_layout().to_next, Some(LinkKind::SharedMemory));
        let mut t = Tensor::ones([1000], (Kind::Float, tch::Device::Cpu));
        group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        let gave_up = std::path::PathBuf::from(std::env::var_os("GAVE_UP").unwrap());
        if rank == 1 {
            // Alive but stuck: its links stay open, it just never calls, until rank 0 has
            // given up on it.
            ddp_testkit::wait_for("rank 0 gave up", LIMIT, || gave_up.exists());
        }
        // Rank 0 wrote its whole contribution before giving up, so the late rank may
        // finish that call; the next one cannot.
        let err = (0..2)
            .find_map(|_| group.all_reduce(&mut t, ReduceOp::Sum).err())
            .expect("the late rank never noticed that rank 0 gave up");
        println!("ERROR: {err}");
        if rank == 0 {
            std::fs::write(&gave_up, "").unwrap();
        }
        return;
    }
    let port = free_port();
    // 10 s, as for the other ranks stuck outside the collectives: with 2 s the diagnosis
    // watches 500 ms, and rank 1's heartbeat held up 400 ms more on a busy machine reads as
    // "not responding".
    let dir = ddp_testkit::temp_dir("ddp-comm-hung");
    let gave_up = dir.path().join("gave-up");
    let extra = env(&[
        ("DDP_OP_TIMEOUT_S", "10"),
        ("GAVE_UP", gave_up.to_str().unwrap()),
    ]);
    let test = "a_hung_rank_times_out_the_others_naming_it";
    let outs = wait_all(
        (0..2)
            .map(|r| spawn_rank(test, r, 2, port, &extra))
            .collect(),
        LIMIT,
    );
    for out in &outs {
        assert!(out.status.success(), "{}", show(out));
    }
    assert_eq!(
        lines_with(&outs[0], "ERROR: "),
        [
            "all_reduce timed out after 10s waiting for peer ranks [1]; rank 1 is behind: still at \
          collective #1, this rank is at #2 (stuck outside the collectives, e.g. in data loading)"
        ]
    );
    // The stuck rank, once it calls, finds that rank 0 has given up on it.
    let late = lines_with(&outs[1], "ERROR: ").join("");
    assert!(
        late.starts_with("all_reduce: peer rank 0 (shared memory, pid "),
        "{late}"
    );
}

/// How rank 1 stops making progress in [`a_stalled_rank_is_named_by_every_other_rank`].
#[derive(Clone, Copy, Debug)]
enum Stall {
    /// `SIGSTOP`: the whole process freezes, heartbeat included.
    Stopped,
    /// Alive (its heartbeat goes on) but never calls the next collective.
    Outside,
}

/// Kills and reaps a child when dropped, so that a stopped rank never outlives its test.
struct Reaped(Option<std::process::Child>);

impl Reaped {
    fn finish(mut self) -> std::process::Output {
        let mut child = self.0.take().unwrap();
        let _ = child.kill();
        child.wait_with_output().unwrap()
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// In a worker: one all-reduce, then rank 1 stalls as `STALL` says while the others call a
/// second one, which must time out naming rank 1.
fn stalled_rank_worker() {
    let group = ProcessGroup::from_env().unwrap();
    let (rank, _) = rank_world();
    let link = match std::env::var("DDP_TRANSPORT").as_deref() {
        Ok("tcp") => LinkKind::Tcp,
        _ => LinkKind::SharedMemory,
    };
    assert_eq!(group.ring_layout().to_next, Some(link));
    let mut t = Tensor::ones([1000], (Kind::Float, tch::Device::Cpu));
    group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    if rank == 1 {
        println!("STALLING");
        match std::env::var("STALL").as_deref() {
            // SAFETY: raising a signal on this very process; the parent kills it later.
            Ok("stopped") => unsafe {
                libc::raise(libc::SIGSTOP);
            },
            _ => std::thread::sleep(Duration::from_secs(120)),
        }
        return;
    }
    let start = Instant::now();
    let err = group.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
    println!("ERROR: {err}");
    println!("AFTER: {:.3}", start.elapsed().as_secs_f64());
    match &err {
        CommError::Timeout { diagnosis, .. } => println!("HUNG: {:?}", diagnosis.hung_ranks()),
        other => panic!("expected a timeout, got {other:?}"),
    }
}

/// Three ranks, rank 1 stalls: ranks 0 and 2 fail within the op timeout plus the diagnosis,
/// naming rank 1 (rank 0 waits on rank 2, rank 2 on rank 1). The op timeout is 5 s for a
/// stopped rank, whose window (750 ms) is what rank 2 has to beat or mark itself failed in
/// rank 0's diagnosis. For one stuck outside, a heartbeat interval of 500 ms and a window of
/// 1.5 s leave a busy machine a second to run rank 1's heartbeat before the diagnosis takes
/// it for not responding (with 100 ms: 400 ms): a 10 s op timeout's, or with the
/// `fault-injection` feature that interval set (`DDP_COMM_TEST_HEARTBEAT_MS`) and a 2 s one.
fn a_stalled_rank_is_named(test: &str, transport: &str, stall: Stall) {
    let port = free_port();
    let injected = cfg!(feature = "fault-injection");
    let (stall_name, op_timeout) = match stall {
        Stall::Stopped => ("stopped", 5),
        Stall::Outside if injected => ("outside", 2),
        Stall::Outside => ("outside", 10),
    };
    let op_timeout_s = op_timeout.to_string();
    let mut extra = env(&[
        ("DDP_OP_TIMEOUT_S", &op_timeout_s),
        ("DDP_TRANSPORT", transport),
    ]);
    extra.push(("STALL", stall_name.to_string()));
    if stall_name == "outside" {
        extra.push(("DDP_COMM_TEST_HEARTBEAT_MS", "500".to_string()));
    }
    let mut children: Vec<_> = (0..3)
        .map(|r| spawn_rank(test, r, 3, port, &extra))
        .collect();
    let stalled = Reaped(Some(children.remove(1)));
    let outs = wait_all(children, LIMIT);
    let stalled = stalled.finish();
    assert_eq!(lines_with(&stalled, "STALLING"), [""], "{}", show(&stalled));
    let finding = match stall {
        Stall::Stopped => "rank 1 is not responding (stopped, frozen, or its host is unreachable)",
        Stall::Outside => {
            "rank 1 is behind: still at collective #1, this rank is at #2 (stuck outside the \
             collectives, e.g. in data loading)"
        }
    };
    for (out, (rank, waits_on)) in outs.iter().zip([(0, 2), (2, 1)]) {
        let what = format!("{transport}, {stall:?}, rank {rank}");
        assert!(out.status.success(), "{what}:\n{}", show(out));
        assert_eq!(
            lines_with(out, "ERROR: "),
            [format!(
                "all_reduce timed out after {op_timeout}s waiting for peer ranks [{waits_on}]; \
                 {finding}"
            )],
            "{what}"
        );
        assert_eq!(lines_with(out, "HUNG: "), ["[1]"], "{what}");
        let after: f64 = lines_with(out, "AFTER: ")[0].parse().unwrap();
        eprintln!("{what}: failed after {after:.3} s");
        // The timeout, then a diagnosis of at most a few heartbeat intervals; the upper
        // bound is generous (a loaded machine), not a speed claim.
        let bound = f64::from(op_timeout);
        assert!(
            (bound..bound + 18.0).contains(&after),
            "{what}: after {after} s"
        );
    }
}

#[test]
fn a_stopped_rank_is_named_over_shared_memory() {
    if worker() {
        return stalled_rank_worker();
    }
    let test = "a_stopped_rank_is_named_over_shared_memory";
    a_stalled_rank_is_named(test, "auto", Stall::Stopped);
}

#[test]
fn a_stopped_rank_is_named_over_tcp() {
    if worker() {
        return stalled_rank_worker();
    }
    a_stalled_rank_is_named("a_stopped_rank_is_named_over_tcp", "tcp", Stall::Stopped);
}

#[test]
fn a_rank_stuck_outside_the_collectives_is_named_over_shared_memory() {
    if worker() {
        return stalled_rank_worker();
    }
    let test = "a_rank_stuck_outside_the_collectives_is_named_over_shared_memory";
    a_stalled_rank_is_named(test, "auto", Stall::Outside);
}

#[test]
fn a_rank_stuck_outside_the_collectives_is_named_over_tcp() {
    if worker() {
        return stalled_rank_worker();
    }
    let test = "a_rank_stuck_outside_the_collectives_is_named_over_tcp";
    a_stalled_rank_is_named(test, "tcp", Stall::Outside);
}

#[test]
fn a_stranger_without_the_secret_cannot_attach_to_shared_memory() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        assert_eq!(group.ring_layout().from_prev, Some(LinkKind::SharedMemory));
        two_rank_sum(&group);
        return;
    }
    use std::os::unix::net::UnixStream;
    let test = "a_stranger_without_the_secret_cannot_attach_to_shared_memory";
    let port = free_port();
    let rank0 = spawn_rank(test, 0, 2, port, &[]);
    let addr = ring_socket_of_rank_0(&rank0);
    // Queued before rank 1 exists, so rank 0 judges it first: the right protocol without
    // the secret, offering a descriptor with its (wrong) proof as a real sender does.
    let stranger = UnixStream::connect_addr(&addr).unwrap();
    stranger
        .set_read_timeout(Some(Duration::from_secs(50)))
        .unwrap();
    (&stranger).write_all(&hello(b"DDPL", 1)).unwrap();
    let rank1 = spawn_rank(test, 1, 2, port, &[]);
    // Receives a challenge it cannot check, and no descriptor.
    let recv = |buf: &mut [u8]| {
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            &stranger,
            &mut [std::io::IoSliceMut::new(buf)],
            &mut control,
            rustix::net::RecvFlags::WAITALL,
        );
        (got.map(|r| r.bytes).unwrap_or(0), control.drain().count())
    };
    assert_eq!(recv(&mut [0u8; 48]), (48, 0), "the challenge");
    let offered = std::fs::File::open("/dev/null").unwrap();
    {
        use std::os::fd::AsFd;
        let fds = [offered.as_fd()];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
        assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
        rustix::net::sendmsg(
            &stranger,
            &[std::io::IoSlice::new(&[0u8; 32])],
            &mut control,
            rustix::net::SendFlags::empty(),
        )
        .unwrap();
    }
    // Then nothing: no byte, no descriptor, just the end of the stream.
    assert_eq!(recv(&mut [0u8; 16]), (0, 0), "the stranger got an answer");
    let outs = wait_all(vec![rank0, rank1], LIMIT);
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
        assert_eq!(lines_with(out, &format!("rank {rank}: ")), ["ok"]);
    }
    let log = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        log.contains(&format!(
            "rejected a connection from pid {} (shared memory): wrong proof of the job secret",
            std::process::id()
        )),
        "rank 0's log:\n{log}"
    );
}

/// The abstract Unix socket on which rank 0 (process `rank0`, of a world whose links are
/// shared memory) accepts its ring link: abstract sockets are visible to everyone in
/// /proc/net/unix.
fn ring_socket_of_rank_0(rank0: &std::process::Child) -> std::os::unix::net::SocketAddr {
    use std::os::linux::net::SocketAddrExt;
    let prefix = format!("@ddp-comm/{}/0/", rank0.id());
    let deadline = Instant::now() + Duration::from_secs(30);
    let name = loop {
        let table = std::fs::read_to_string("/proc/net/unix").unwrap();
        if let Some(name) = table.split_whitespace().find(|w| w.starts_with(&prefix)) {
            break name[1..].to_string();
        }
        assert!(
            Instant::now() < deadline,
            "rank 0 never listened on {prefix}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap()
}

/// Rank 0's shared-memory listener is busy judging as many handshakes as it takes at once
/// (strangers that connect and say nothing, which its 10 s handshake limit would end): rank
/// 1's connection closes the oldest of them and gets through at once.
#[test]
fn strangers_holding_a_shared_memory_listener_do_not_keep_a_rank_out() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        assert_eq!(group.ring_layout().to_next, Some(LinkKind::SharedMemory));
        two_rank_sum(&group);
        return;
    }
    let test = "strangers_holding_a_shared_memory_listener_do_not_keep_a_rank_out";
    let port = free_port();
    let rank0 = spawn_rank(test, 0, 2, port, &[]);
    let addr = ring_socket_of_rank_0(&rank0);
    // As many as rank 0 judges at once (MAX_JUDGED in ring/connect.rs).
    let mut strangers: Vec<_> = (0..32)
        .map(|_| std::os::unix::net::UnixStream::connect_addr(&addr).unwrap())
        .collect();
    let rank1 = spawn_rank(test, 1, 2, port, &[]);
    let outs = wait_all(vec![rank0, rank1], LIMIT);
    // The oldest stranger was closed (end of file), not left to its deadline.
    let mut byte = [0u8; 1];
    strangers[0].set_read_timeout(Some(LIMIT)).unwrap();
    assert!(matches!(strangers[0].read(&mut byte), Ok(0)));
    drop(strangers);
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
        assert_eq!(lines_with(out, &format!("rank {rank}: ")), ["ok"]);
    }
    let log = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        log.contains("closed the oldest of 32 handshakes in progress to judge a connection"),
        "rank 0 never closed a stranger for rank 1:\n{log}"
    );
}

/// Tensors no collective takes, each with what its error must say: strided but not
/// contiguous, a dtype the ring does not carry, and layouts that are not strided (tch's
/// `is_contiguous` and `data_ptr` panic on some of these; sparse ones cannot be made
/// contiguous, so their hint is `.to_dense()`).
fn refused_tensors() -> Vec<(Tensor, &'static str)> {
    let base = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).reshape([2, 3]);
    let mut cases = vec![
        (Tensor::new(), "undefined tensor"),
        (base.transpose(0, 1), "not contiguous (call .contiguous())"),
        (base.to_kind(Kind::ComplexFloat), "ComplexFloat"),
        (base.to_kind(Kind::ComplexDouble), "ComplexDouble"),
        (
            base.to_sparse_sparse_dim(2),
            "sparse COO tensor is not supported",
        ),
        (
            base.to_sparse_csr(None),
            "sparse CSR tensor is not supported",
        ),
        (
            base.to_sparse_csc(None),
            "sparse CSC tensor is not supported",
        ),
        (
            base.to_sparse_bsr([1, 3], None),
            "sparse BSR tensor is not supported",
        ),
        (
            base.to_sparse_bsc([2, 1], None),
            "sparse BSC tensor is not supported",
        ),
        (
            base.quantize_per_tensor(0.5, 0, Kind::QInt8),
            "non-dense tensor is not supported: collectives take dense strided tensors \
             (call .dequantize() for a quantized one)",
        ),
    ];
    // (A libtorch built without oneDNN has no MKLDNN tensors.)
    if let Ok(t) = base.f_to_mkldnn(None) {
        cases.push((t, "MKLDNN tensor is not supported"));
    }
    cases
}

fn assert_refused(err: CommError, why: &str, what: &str) {
    assert!(matches!(err, CommError::Tensor { .. }), "{what}: {err:?}");
    let text = err.to_string();
    assert!(text.contains(why), "{what}: {text}");
    if why.contains("sparse") {
        assert!(text.contains("(call .to_dense())"), "{what}: {text}");
    }
}

#[test]
fn unsupported_tensors_are_typed_errors() {
    let group = std::sync::Arc::new(
        ProcessGroup::new(Options::new(0, 1, "127.0.0.1", 0).backend(Backend::Cpu)).unwrap(),
    );
    for (mut t, why) in refused_tensors() {
        let err = group.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
        assert_refused(err, why, "all_reduce");
        assert_refused(group.broadcast(&mut t, 0).unwrap_err(), why, "broadcast");
        assert_refused(group.all_gather(&t).unwrap_err(), why, "all_gather");
        // A world of one refuses what a larger one would, at the call.
        for work in [
            group.all_reduce_async(&t, ReduceOp::Sum),
            group.broadcast_async(&t, 0),
        ] {
            assert!(work.is_completed(), "{why}: {work:?}");
            assert_refused(work.wait().unwrap_err(), why, "async");
        }
    }
    // The same group still works afterwards.
    let base = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).reshape([2, 3]);
    let mut ok = base.shallow_clone();
    group.all_reduce(&mut ok, ReduceOp::Max).unwrap();
    assert_eq!(
        Vec::<f32>::try_from(&ok.flatten(0, -1)).unwrap(),
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    );
    group.all_reduce_async(&ok, ReduceOp::Sum).wait().unwrap();
}

/// An asynchronous collective refused for its tensor fails at the call, as PyTorch raises
/// there: its `Work` is complete at once, although a collective issued before it is still
/// running, and the refusal neither reaches the communication thread (whose panic on a
/// sparse or MKLDNN tensor would poison every later asynchronous collective) nor poisons
/// the group.
#[test]
fn asynchronous_collectives_refuse_tensors_at_the_call() {
    if worker() {
        let group = std::sync::Arc::new(ProcessGroup::from_env().unwrap());
        let (rank, n) = rank_world();
        let big = Tensor::full([4 << 20], rank as f64, (Kind::Float, tch::Device::Cpu));
        let running = group.all_reduce_async(&big, ReduceOp::Sum);
        for (t, why) in refused_tensors() {
            for work in [
                group.all_reduce_async(&t, ReduceOp::Sum),
                group.broadcast_async(&t, 1),
            ] {
                assert!(
                    work.is_completed(),
                    "{why}: {work:?} not complete at the call"
                );
                assert_refused(work.wait().unwrap_err(), why, "async");
            }
        }
        running.wait().unwrap();
        let want = (n * (n - 1) / 2) as f64;
        assert_eq!(big.double_value(&[0]), want);
        let after = Tensor::from_slice(&[rank as i64 + 1]);
        group
            .all_reduce_async(&after, ReduceOp::Sum)
            .wait()
            .unwrap();
        let mut blocking = Tensor::from_slice(&[rank as i64]);
        group.all_reduce(&mut blocking, ReduceOp::Max).unwrap();
        println!(
            "rank {rank}: {} {}",
            i64::try_from(&after).unwrap(),
            i64::try_from(&blocking).unwrap()
        );
        return;
    }
    let outputs = common::run_world(
        "asynchronous_collectives_refuse_tensors_at_the_call",
        2,
        &[],
    );
    for (rank, out) in outputs.iter().enumerate() {
        assert_eq!(
            lines_with(out, &format!("rank {rank}: ")),
            ["3 1"],
            "{}",
            show(out)
        );
    }
}
