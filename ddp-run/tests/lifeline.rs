//! `die_with_launcher` in real processes: a "rank" (this test binary, run again as a child)
//! under a real `ddp-run`, behind a wrapper (`sh -c '...; true'`) and in pid namespaces.

use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ddp_run::env::{DDP_LAUNCHER_LIFELINE, DDP_LAUNCHER_PID};
use ddp_testkit::{in_new_pid_namespace, procs, temp_dir, text, wait_bounded, wait_for};

const DDP_RUN: &str = env!("CARGO_BIN_EXE_ddp-run");
const LIMIT: Duration = Duration::from_secs(60);

/// Set in the child: run as the rank instead of as a test; `wait` (a minute) or `report`
/// (exit at once) after saying whether it watches; `close-first` closes the lifeline's
/// descriptor before (as a wrapper that closes what it inherits), `close-after` after, then
/// says `closed` and waits.
const AS_RANK: &str = "DDP_RUN_LIFELINE_TEST_RANK";

/// The arguments that run this test binary as the rank.
fn rank_args() -> Vec<String> {
    let exe = std::env::current_exe()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    [
        &exe,
        "--exact",
        "rank_body",
        "--include-ignored",
        "--nocapture",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The rank: watches its launcher, says so with its pid (as this test's `/proc` numbers
/// it, whatever its namespace), and waits or exits.
#[test]
#[ignore = "run by the tests below as a child process"]
fn rank_body() {
    let Some(mode) = std::env::var_os(AS_RANK) else {
        return;
    };
    let pid = std::fs::read_link("/proc/self").unwrap();
    if mode == "close-first" {
        close_lifeline();
    }
    match ddp_run::die_with_launcher() {
        Ok(watching) => println!("watching={watching} pid={}", pid.display()),
        Err(e) => return println!("error={e}"),
    }
    if mode == "close-after" {
        close_lifeline();
        // Time for a watch that took the closed descriptor for the launcher's end to act.
        std::thread::sleep(Duration::from_millis(200));
        println!("closed");
    }
    if mode != "report" {
        std::thread::sleep(LIMIT);
    }
}

/// Closes the descriptor that `DDP_LAUNCHER_LIFELINE` names.
fn close_lifeline() {
    let value = std::env::var(DDP_LAUNCHER_LIFELINE).unwrap();
    let fd: RawFd = value.split(':').next().unwrap().parse().unwrap();
    // SAFETY: close(2) on the inherited descriptor, which nothing in this process owns.
    assert_eq!(unsafe { libc::close(fd) }, 0);
}

/// `ddp-run` running one rank: `wrapper`, then the rank.
fn ddp_run(wrapper: &[&str], mode: &str) -> Command {
    let mut cmd = Command::new(DDP_RUN);
    cmd.args(["--nproc-per-node", "1", "--"])
        .args(wrapper)
        .env(AS_RANK, mode)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// The rank's pid, from its `watching=true` line in `child`'s output.
fn watching_rank(child: &mut Child) -> u32 {
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.starts_with("watching=") && !line.starts_with("error=") {
        line.clear();
        assert_ne!(out.read_line(&mut line).unwrap(), 0, "the rank ended early");
    }
    let pid = line.trim().strip_prefix("watching=true pid=");
    pid.unwrap_or_else(|| panic!("{line}")).parse().unwrap()
}

/// Kills the launcher running a rank (in `mode`) behind `sh -c '... ; true'` (under `prefix`),
/// and waits for the rank to die with it. The launcher's temporary folder is the test's, so
/// that the error folder it cannot remove goes with it.
fn a_wrapped_rank_dies_with_its_launcher(prefix: &[&str], mode: &str) {
    let script = format!("'{}'; true", rank_args().join("' '"));
    let mut wrapper = prefix.to_vec();
    wrapper.extend(["sh", "-c", &script]);
    let tmp = temp_dir("ddp-run-killed");
    let mut cmd = ddp_run(&wrapper, mode);
    let mut launcher = cmd.env("TMPDIR", tmp.path()).spawn().unwrap();
    let rank = watching_rank(&mut launcher);
    ddp_testkit::kill(launcher.id(), libc::SIGKILL);
    assert_eq!(launcher.wait().unwrap().signal(), Some(libc::SIGKILL));
    wait_for("the rank died with its launcher", LIMIT, || {
        !procs::alive(rank)
    });
}

#[test]
fn a_rank_behind_a_wrapper_dies_with_its_launcher() {
    a_wrapped_rank_dies_with_its_launcher(&[], "wait");
}

/// A wrapper that closes the descriptors it inherits (`sudo`, Python's `subprocess`): the
/// rank, in the launcher's pid namespace, watches its pid instead.
#[test]
fn a_rank_whose_wrapper_closed_the_lifeline_dies_with_its_launcher() {
    a_wrapped_rank_dies_with_its_launcher(&[], "close-first");
}

/// A rank in a pid namespace of its own (`apptainer exec --pid`), where the launcher's pid
/// names no process.
#[test]
fn a_rank_in_another_pid_namespace_dies_with_its_launcher() {
    match in_new_pid_namespace() {
        Ok(unshare) => a_wrapped_rank_dies_with_its_launcher(&unshare, "wait"),
        Err(why) => eprintln!("skipped: {why}"),
    }
}

/// A launcher that is its namespace's first process, pid 1 (`docker run image ddp-run ...`).
#[test]
fn a_launcher_with_pid_1_is_watched() {
    let unshare = match in_new_pid_namespace() {
        Ok(unshare) => unshare,
        Err(why) => return eprintln!("skipped: {why}"),
    };
    // `ddp-run` itself in the namespace: `unshare ... ddp-run --nproc-per-node 1 -- rank`.
    let mut cmd = Command::new(unshare[0]);
    cmd.args(&unshare[1..])
        .arg(DDP_RUN)
        .args(["--nproc-per-node", "1", "--"])
        .args(rank_args())
        .env(AS_RANK, "report")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = wait_bounded(cmd.spawn().unwrap(), LIMIT);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("watching=true pid="), "{}", text(&out));
}

/// The rank alone, with `DDP_LAUNCHER_LIFELINE=value` and, when given, the read end of a
/// pipe inherited as descriptor `fd`.
fn rank(value: &str, fd: Option<&OwnedFd>) -> Command {
    let args = rank_args();
    let mut cmd = Command::new(&args[0]);
    cmd.args(&args[1..])
        .env(AS_RANK, "wait")
        .env(DDP_LAUNCHER_LIFELINE, value)
        .env_remove(DDP_LAUNCHER_PID)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(fd) = fd.map(AsRawFd::as_raw_fd) {
        // SAFETY: fcntl(2) is async-signal-safe and allocates nothing.
        unsafe {
            cmd.pre_exec(move || match libc::fcntl(fd, libc::F_SETFD, 0) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            });
        }
    }
    cmd
}

/// The value of `DDP_LAUNCHER_LIFELINE` for the pipe whose read end is `read`.
fn lifeline(read: &OwnedFd) -> String {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstat fills the stat it is given, for a descriptor this test owns.
    let inode = unsafe {
        assert_eq!(libc::fstat(read.as_raw_fd(), stat.as_mut_ptr()), 0);
        stat.assume_init().st_ino
    };
    format!("{}:{inode}", read.as_raw_fd())
}

#[test]
fn a_rank_whose_launcher_has_already_exited_dies_at_once() {
    let (read, write) = std::io::pipe().unwrap();
    let read = OwnedFd::from(read);
    // The "launcher" is gone: no writer is left.
    drop(write);
    let rank = rank(&lifeline(&read), Some(&read)).spawn().unwrap();
    let output = wait_bounded(rank, LIMIT);
    assert_eq!(output.status.signal(), Some(libc::SIGKILL), "{output:?}");
    assert!(!String::from_utf8_lossy(&output.stdout).contains("watching="));
}

/// The program closes the inherited descriptor once watched: it lives on, and still dies
/// when the launcher's end closes.
#[test]
fn a_rank_that_closes_its_lifeline_lives_until_the_launcher_ends() {
    let (read, write) = std::io::pipe().unwrap();
    let read = OwnedFd::from(read);
    let mut cmd = rank(&lifeline(&read), Some(&read));
    let mut child = cmd.env(AS_RANK, "close-after").spawn().unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let mut lines = out.lines().map_while(Result::ok);
    assert!(lines.any(|l| l == "closed"), "the rank died of closing it");
    drop(write);
    let output = wait_bounded(child, LIMIT);
    assert_eq!(output.status.signal(), Some(libc::SIGKILL), "{output:?}");
}

/// A wrapper closed the descriptor (as `sudo` does) and the launcher's pid is not given:
/// nothing to watch, and no error.
#[test]
fn a_lifeline_that_did_not_reach_the_rank_is_not_watched() {
    let mut child = rank("1000:1", None).spawn().unwrap();
    let line = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("watching=") || l.starts_with("error="));
    ddp_testkit::kill(child.id(), libc::SIGKILL);
    child.wait().unwrap();
    assert!(
        line.as_ref()
            .is_some_and(|l| l.starts_with("watching=false ")),
        "{line:?}"
    );
}

#[test]
fn a_lifeline_that_is_not_fd_and_inode_is_an_error_naming_the_variable() {
    let output = wait_bounded(rank("12ab", None).spawn().unwrap(), LIMIT);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("error=DDP_LAUNCHER_LIFELINE is `12ab`, not a launcher's lifeline"),
        "{stdout}"
    );
}
