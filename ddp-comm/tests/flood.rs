//! A flood of strangers on rank 0's store while the job trains: 2,000 connections that each
//! send a byte now and then (a "slow drip", which defeats timeouts per read) and are opened
//! again whenever rank 0 closes them. Rank 0 must stay below 200 descriptors (handshakes
//! are capped, each newcomer beyond the cap closes the oldest, and each has one deadline)
//! and the job must finish.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{rank_world, show, spawn_rank, wait_all, worker};
use ddp_comm::{ProcessGroup, ReduceOp};

const STRANGERS: usize = 2000;
/// Rank 0's deadline for a stranger's handshake, in seconds: the store's own, or a shorter
/// one where the `fault-injection` feature lets the test set it.
const DEADLINE_S: u64 = if cfg!(feature = "fault-injection") {
    2
} else {
    10
};
/// How long the strangers drip at least: past two deadlines, so that rank 0 cuts them off,
/// and they connect again, more than once. On a loaded machine it goes on until all of them
/// have connected once, for at most [`FLOOD_LIMIT`].
const FLOOD: Duration = Duration::from_secs(2 * DEADLINE_S + 2);
/// The longest the flood waits for its strangers to connect.
const FLOOD_LIMIT: Duration = Duration::from_secs(120);
/// How long the ranks go on training after the flood.
const AFTER_FLOOD: Duration = Duration::from_secs(3);
/// The longest rank 0 trains without being told that the flood is over (a test that failed
/// before telling it leaves no ranks behind).
const TRAINING_LIMIT: Duration = Duration::from_secs(200);

/// Descriptors open in process `pid`, or `None` once it has exited. A process that is
/// running but whose descriptors cannot be listed fails the test: counting 0 would pass the
/// bound whatever rank 0 holds.
fn descriptors(pid: u32) -> Option<usize> {
    match std::fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(dir) => Some(dir.count()),
        Err(_) if exited(pid) => None,
        Err(e) => panic!("cannot list /proc/{pid}/fd of rank 0: {e}"),
    }
}

/// Whether process `pid` has exited (reaped, or a zombie).
fn exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        stat.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

#[test]
fn a_slow_drip_flood_on_the_store_neither_exhausts_rank_0_nor_stops_the_job() {
    let ready =
        |rank: usize| PathBuf::from(std::env::var("FLOOD_READY").unwrap()).join(rank.to_string());
    let over = || PathBuf::from(std::env::var("FLOOD_READY").unwrap()).join("over");
    if worker() {
        let (rank, _) = rank_world();
        let group = ProcessGroup::from_env().unwrap();
        std::fs::write(ready(rank), b"").unwrap();
        let start = Instant::now();
        let mut rounds = 0u64;
        loop {
            // The last element says whether rank 0 was told that the flood is over: both
            // ranks stop after the same round.
            let mut v = vec![rank as f64 + 1.0; 1025];
            let stop = over().exists() || start.elapsed() >= TRAINING_LIMIT;
            v[1024] = f64::from(rank == 0 && stop);
            group.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v[1023], 3.0);
            rounds += 1;
            if v[1024] > 0.0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        group.barrier().unwrap();
        println!("rank {rank}: done after {rounds} rounds");
        return;
    }
    let test = "a_slow_drip_flood_on_the_store_neither_exhausts_rank_0_nor_stops_the_job";
    let dir = ddp_testkit::temp_dir("ddp-comm-flood");
    let port = common::free_port();
    let env = [
        ("FLOOD_READY", dir.path().display().to_string()),
        (
            "DDP_COMM_TEST_STORE_HANDSHAKE_MS",
            (DEADLINE_S * 1000).to_string(),
        ),
    ];
    let rank0 = spawn_rank(test, 0, 2, port, &env);
    let rank1 = spawn_rank(test, 1, 2, port, &env);
    let pid0 = rank0.id();
    // Their output is read all along: a rank blocked on a full pipe would prove nothing.
    let ranks = std::thread::spawn(move || wait_all(vec![rank0, rank1], Duration::from_secs(300)));
    let flood_ready = dir.path().to_path_buf();
    ddp_testkit::wait_for("both ranks joined", Duration::from_secs(60), || {
        (0..2).all(|r| flood_ready.join(r.to_string()).exists())
    });
    let baseline = descriptors(pid0).expect("rank 0 runs while the flood starts");
    assert!(baseline >= 3, "rank 0 lists only {baseline} descriptors");
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let flood = std::thread::spawn(move || {
        // Each with the count of bytes it sent.
        let mut strangers: Vec<Option<(TcpStream, usize)>> = (0..STRANGERS).map(|_| None).collect();
        let (mut opened, mut most) = (0usize, 0usize);
        let start = Instant::now();
        let flooding = |opened: usize| {
            start.elapsed() < FLOOD || (opened < STRANGERS && start.elapsed() < FLOOD_LIMIT)
        };
        while flooding(opened) {
            for s in &mut strangers {
                if !flooding(opened) {
                    break;
                }
                if s.is_none() {
                    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1));
                    *s = stream.ok().map(|stream| (stream, 0));
                    opened += usize::from(s.is_some());
                }
                // One byte of a hello that never completes: the store's magic and version,
                // then zeros, so that only the handshake's deadline cuts it off.
                if let Some((stream, sent)) = s {
                    let byte = b"DDPS\x02".get(*sent).copied().unwrap_or(0);
                    *sent += 1;
                    if stream.write_all(&[byte]).is_err() {
                        *s = None;
                    }
                }
            }
            most = most.max(descriptors(pid0).unwrap_or(0));
            std::thread::sleep(Duration::from_millis(500));
        }
        (opened, most)
    });
    // Rank 0's descriptors, sampled while the flood lasts.
    let mut most = baseline;
    while !flood.is_finished() {
        most = most.max(descriptors(pid0).unwrap_or(0));
        std::thread::sleep(Duration::from_millis(50));
    }
    let (opened, flood_most) = flood.join().unwrap();
    std::thread::sleep(AFTER_FLOOD);
    std::fs::write(dir.path().join("over"), b"").unwrap();
    let outs = ranks.join().unwrap();
    for (rank, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "rank {rank}:\n{}", show(out));
    }
    // Rank 0 closed the oldest strangers for newcomers while the flood lasted: the bound
    // below held across that turnover.
    let cut = "store closed the oldest handshake to judge a connection from 127.0.0.1:";
    assert!(
        String::from_utf8_lossy(&outs[0].stderr).contains(cut),
        "{}",
        show(&outs[0])
    );
    let most = most.max(flood_most);
    assert!(opened >= STRANGERS, "only {opened} connections were opened");
    assert!(
        most < 200,
        "rank 0 held {most} descriptors under the flood (from {baseline})"
    );
    eprintln!("flood: {opened} connections opened; rank 0 held at most {most} descriptors (from {baseline})");
}
