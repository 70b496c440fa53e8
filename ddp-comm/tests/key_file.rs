//! Ranks started without `DDP_SECRET` (plain torchrun, SLURM's `srun`) take the job's
//! secret from the user's key file and the run id, never from the run id alone: real
//! processes on loopback, each with its own `XDG_CONFIG_HOME`.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Child;
use std::time::Duration;

use common::{free_port, lines_with, show, wait_all, worker, worker_command};
use ddp_comm::{AuthFailure, CommError, Options, ProcessGroup, ReduceOp};
use ddp_testkit::temp_dir;

const LIMIT: Duration = Duration::from_secs(60);

/// Rank `rank` of 2 started without `DDP_SECRET` (removed from the environment that
/// `spawn_rank` gives it), whose configuration folder is `config`, with a rendezvous timeout
/// of `rdzv_timeout_s`.
fn spawn_without_secret(
    test: &str,
    rank: usize,
    port: u16,
    config: &Path,
    rdzv_timeout_s: &str,
) -> Child {
    let mut cmd = worker_command(test);
    ddp_testkit::RankEnv {
        secret: None,
        ..ddp_testkit::RankEnv::single_node(rank, 2, port)
    }
    .apply(&mut cmd);
    cmd.env_remove("DDP_SECRET")
        .env_remove("DDP_SECRET_FILE")
        .env("DDP_RUN_ID", format!("test-{port}"))
        .env("XDG_CONFIG_HOME", config)
        .env("DDP_RDZV_TIMEOUT_S", rdzv_timeout_s)
        .env("DDP_OP_TIMEOUT_S", "60");
    cmd.spawn().unwrap()
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn ranks_without_ddp_secret_meet_through_the_users_key_file() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        let mut v = vec![group.rank() as f32 + 1.0; 1000];
        group.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        assert!(v.iter().all(|x| *x == 3.0));
        println!("MET rank {}", group.rank());
        return;
    }
    let test = "ranks_without_ddp_secret_meet_through_the_users_key_file";
    let tmp = temp_dir("key-file-shared");
    let config = tmp.path().join("config");
    let port = free_port();
    // The ranks meet whenever both have started, however loaded the machine.
    let ranks = (0..2)
        .map(|r| spawn_without_secret(test, r, port, &config, "50"))
        .collect();
    let outs = wait_all(ranks, LIMIT);
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
        assert_eq!(lines_with(out, "MET rank "), [rank.to_string()]);
    }
    // The first rank to need it made the file, private to this user, in a private folder.
    let file = config.join("ddp/secret");
    assert_eq!(mode(&file), 0o600);
    assert_eq!(mode(file.parent().unwrap()), 0o700);
    let digits = std::fs::read_to_string(&file).unwrap();
    assert_eq!(digits.trim().len(), 64, "256 bits in hexadecimal");
    let made: usize = outs
        .iter()
        .map(|out| {
            String::from_utf8_lossy(&out.stderr)
                .matches(&format!("created the key file {}", file.display()))
                .count()
        })
        .sum();
    assert_eq!(made, 1, "exactly one rank creates it");
    for out in &outs {
        assert!(
            !show(out).contains(digits.trim()),
            "the secret is never shown"
        );
    }
}

#[test]
fn ranks_that_do_not_share_the_key_file_fail_naming_it() {
    if worker() {
        let rank = common::rank_world().0;
        let err = match ProcessGroup::from_env() {
            Ok(_) => panic!("rank {rank} joined with another key file"),
            Err(e) => e,
        };
        println!("ERROR: {err}");
        match (rank, &err) {
            (
                1,
                CommError::Handshake {
                    failure: AuthFailure::Unproven { .. },
                    ..
                },
            ) => {}
            (0, _) => common::assert_rank_1_was_turned_away(&err),
            _ => panic!("rank {rank}: unexpected {err:?}"),
        }
        return;
    }
    // Two hosts without a shared home: the same run id (which is all the old fallback
    // used), but each its own key file.
    let test = "ranks_that_do_not_share_the_key_file_fail_naming_it";
    let tmp = temp_dir("key-file-apart");
    let port = free_port();
    let config = |r: usize| tmp.path().join(format!("host{r}"));
    // Rank 0 waits out its rendezvous for the rank it turned away.
    let ranks = (0..2)
        .map(|r| spawn_without_secret(test, r, port, &config(r), "8"))
        .collect();
    let outs = wait_all(ranks, LIMIT);
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
    }
    let err = lines_with(&outs[1], "ERROR: ").join("\n");
    let file = config(1).join("ddp/secret");
    assert!(
        err.contains(&format!(
            "the secret comes from the key file {}",
            file.display()
        )) && err.contains("give every rank the same DDP_SECRET"),
        "rank 1: {err}"
    );
}

#[test]
fn a_key_file_other_users_can_read_stops_the_rank_before_it_listens() {
    let tmp = temp_dir("key-file-mode");
    let file = tmp.path().join("secret");
    std::fs::write(&file, "00112233445566778899aabbccddeeff\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
    let port = free_port();
    let mut opts = Options::new(0, 2, "127.0.0.1", port);
    opts.env.secret_file = Some(file.clone());
    match ProcessGroup::new(opts) {
        Err(CommError::SecretFile { path, detail }) => {
            assert_eq!(path, file);
            assert_eq!(
                detail,
                format!(
                    "can be read or written by other users (mode 0640): run `chmod 600 {}`",
                    file.display()
                )
            );
        }
        other => panic!("expected SecretFile, got {other:?}"),
    }
    // Nothing listens on the port: the rank stopped before it served the store.
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
    // With the mode fixed, the same file is accepted (a group of two then waits for rank 1,
    // so only the secret is checked here).
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let secret = ddp_comm::Secret::from_key_file(&file, "ddp-comm").unwrap();
    assert_eq!(secret.file(), Some(file.as_path()));
}
