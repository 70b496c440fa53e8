//! `die_with_launcher` in real processes: a "rank" (this test binary, run again as a child)
//! watching a "launcher" it is not the child of, as under `sh -c '...; true'`.

use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use ddp_run::env::DDP_LAUNCHER_PID;

/// Set in the child: run as the rank instead of as a test.
const AS_RANK: &str = "DDP_RUN_LIFELINE_TEST_RANK";

/// This test binary running only `rank_body`, with `launcher` as its launcher's pid.
fn rank(launcher: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "rank_body", "--include-ignored", "--nocapture"])
        .env(AS_RANK, "1")
        .env(DDP_LAUNCHER_PID, launcher)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// The rank: watches its launcher, says so, and waits (a minute at most).
#[test]
#[ignore = "run by the tests below as a child process"]
fn rank_body() {
    if std::env::var_os(AS_RANK).is_none() {
        return;
    }
    match ddp_run::die_with_launcher() {
        Ok(watching) => println!("watching={watching}"),
        Err(e) => return println!("error={e}"),
    }
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_rank_dies_when_a_launcher_that_is_not_its_parent_is_killed() {
    // The "launcher": a process of its own, not the rank's parent.
    let mut launcher = Command::new("sleep").arg("120").spawn().unwrap();
    let mut child = rank(&launcher.id().to_string()).spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("watching=") && !line.starts_with("error=") {
        line.clear();
        assert_ne!(out.read_line(&mut line).unwrap(), 0, "the rank ended early");
    }
    assert_eq!(line.trim(), "watching=true");
    ddp_testkit::kill(launcher.id(), libc::SIGKILL);
    // Not reaped yet (a zombie, as a launcher whose parent has not waited): already gone.
    let status = ddp_testkit::wait_bounded(child, Duration::from_secs(10)).status;
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    launcher.wait().unwrap();
}

#[test]
fn a_rank_whose_launcher_has_already_exited_dies_at_once() {
    let mut launcher = Command::new("true").spawn().unwrap();
    let pid = launcher.id().to_string();
    launcher.wait().unwrap();
    // The pid is free now (or, rarely, someone else's: then the rank waits for that one,
    // and the test fails by running into its bound).
    let output = ddp_testkit::wait_bounded(rank(&pid).spawn().unwrap(), Duration::from_secs(30));
    assert_eq!(output.status.signal(), Some(libc::SIGKILL), "{output:?}");
    assert!(!String::from_utf8_lossy(&output.stdout).contains("watching="));
}

#[test]
fn a_launcher_pid_that_is_not_a_number_is_an_error_naming_the_variable() {
    let output = ddp_testkit::wait_bounded(rank("12ab").spawn().unwrap(), Duration::from_secs(30));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("error=DDP_LAUNCHER_PID is `12ab`, not a launcher's process id"),
        "{stdout}"
    );
}
