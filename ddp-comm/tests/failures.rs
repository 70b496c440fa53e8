//! What goes wrong must fail promptly with an error that names the culprit: missing, killed,
//! duplicated or misconfigured ranks, busy ports, bad environment values, stray peers,
//! mismatched collectives, unsupported tensors.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{
    free_port, lines_with, rank_world, show, spawn_rank, wait_all, worker, worker_command,
};
use ddp_comm::{Backend, CommError, Options, ProcessGroup, ReduceOp};
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
        let err = expect_join_error();
        assert!(
            matches!(
                err,
                CommError::RendezvousTimeout { .. } | CommError::Rendezvous { .. }
            ),
            "{err:?}"
        );
        return;
    }
    let port = free_port();
    let extra = env(&[("DDP_RDZV_TIMEOUT_S", "6")]);
    let start = Instant::now();
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
    assert!(start.elapsed() < LIMIT);
}

#[test]
fn a_killed_rank_fails_the_others_and_poisons_the_group() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
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
    let extra = env(&[("DDP_OP_TIMEOUT_S", "20")]);
    let children = (0..3)
        .map(|r| {
            spawn_rank(
                "a_killed_rank_fails_the_others_and_poisons_the_group",
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
        named |= err.contains("peer rank 2 at 127.0.0.1:");
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
    let opts = Options::new(0, 2, "127.0.0.1", port).rendezvous_timeout(Duration::from_secs(5));
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
            &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "port")],
            "MASTER_PORT",
        ),
        (&[("RANK", "0"), ("WORLD_SIZE", "2")], "MASTER_PORT"),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
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

#[test]
fn stray_connections_without_the_token_are_rejected() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        let (rank, _) = rank_world();
        let mut v = vec![rank as f64 + 1.0; 3];
        group.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, vec![3.0; 3]);
        println!("rank {rank}: ok");
        return;
    }
    let test = "stray_connections_without_the_token_are_rejected";
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
    // Not our protocol at all, then our protocol with another run's token.
    let mut wrong_token = b"DDPS\x01".to_vec();
    wrong_token.extend_from_slice(&5u16.to_le_bytes());
    wrong_token.extend_from_slice(b"other\0\0\0\0");
    for probe in [&b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..], &wrong_token] {
        let mut stray = connect();
        stray
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stray.write_all(probe).unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(
            stray.read(&mut buf).unwrap_or(0),
            0,
            "a stray connection got an answer"
        );
    }
    // A silent connection must not hold up the rendezvous either.
    let _silent = connect();
    let rank1 = spawn_rank(test, 1, 2, port, &[]);
    let outs = wait_all(vec![rank0, rank1], LIMIT);
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
    }
    let log = String::from_utf8_lossy(&outs[0].stderr);
    assert!(
        log.contains("rejected: bad magic") && log.contains("rejected: wrong token"),
        "rank 0's log:\n{log}"
    );
}

#[test]
fn mismatched_collectives_are_reported_not_corrupted() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        let (rank, _) = rank_world();
        let mut t = Tensor::zeros([10 + rank as i64], (Kind::Float, tch::Device::Cpu));
        let err = group.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
        println!("ERROR: {err}");
        return;
    }
    let port = free_port();
    let test = "mismatched_collectives_are_reported_not_corrupted";
    let outs = wait_all(
        (0..2).map(|r| spawn_rank(test, r, 2, port, &[])).collect(),
        LIMIT,
    );
    let errors: Vec<String> = outs
        .iter()
        .map(|o| {
            assert!(o.status.success(), "{}", show(o));
            lines_with(o, "ERROR: ").join("")
        })
        .collect();
    assert!(
        errors.iter().any(
            |e| e.contains("all_reduce (dtype 6, argument 0) of 40 bytes")
                && e.contains("of 44 bytes")
        ),
        "{errors:?}"
    );
}

#[test]
fn unsupported_tensors_are_typed_errors() {
    let group =
        ProcessGroup::new(Options::new(0, 1, "127.0.0.1", 0).backend(Backend::Tcp)).unwrap();
    let base = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).reshape([2, 3]);
    let cases = [
        (base.transpose(0, 1), "not contiguous"),
        (base.to_kind(Kind::Half), "Half"),
        (base.to_kind(Kind::Bool), "Bool"),
    ];
    for (mut t, why) in cases {
        let err = group.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
        assert!(matches!(err, CommError::Tensor { .. }), "{err:?}");
        assert!(err.to_string().contains(why), "{err}");
    }
    // The same group still works afterwards.
    let mut ok = base.shallow_clone();
    group.all_reduce(&mut ok, ReduceOp::Max).unwrap();
    assert_eq!(
        Vec::<f32>::try_from(&ok.flatten(0, -1)).unwrap(),
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    );
}
