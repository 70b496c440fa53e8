//! One job: a test binary run over some of its tests, in a process group of its own. Its
//! output goes into a log file as it comes, unfinished lines too (libtest writes `test NAME
//! ... ` when a test starts, its result when it ends), and each result onto the terminal. A
//! job that passes its deadline, or is interrupted, is killed with every process of its group,
//! and the test it was running is named.

use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::libtest::{Outcome, RunParser, TestResult};
use super::schedule::Job;
use super::{command, Binary, Programs};

/// How long a job may run: 4 times what its tests took in the last run, and at least 15
/// minutes. The limit is there to catch hangs, not slow tests. The slowest binary takes
/// under 2 minutes on 2 cores, and a job may share the machine with one job per core. A
/// first run has no times (1 s per test is assumed), so the floor applies.
pub fn deadline(estimate_secs: f64) -> Duration {
    Duration::from_secs_f64((4.0 * estimate_secs).clamp(15.0 * 60.0, 24.0 * 3600.0))
}

/// How often the job's output, its deadline and the signals are looked at.
const POLL: Duration = Duration::from_millis(100);
/// After the binary has exited, or been told to, how long its output may take to end (a
/// process it left behind may hold the pipe), and after an interruption, how long it has
/// before it is killed.
const GRACE: Duration = Duration::from_secs(5);

/// What one job's run gave.
#[derive(Debug)]
pub struct JobRun {
    pub success: bool,
    pub results: Vec<TestResult>,
    pub log: PathBuf,
    /// Why the job ended other than by finishing its tests: `TIMEOUT after 900 s`, `signal
    /// 11`, `exit code 3`, `interrupted by signal 2`. The test it was running, if any, is in
    /// `results` as failed.
    pub problem: Option<String>,
}

/// Runs `job`'s tests of `bin` one after another, its output into a log file in `logs` and
/// each result onto the terminal as it comes. After `limit`, or once `interrupted` names a
/// signal (which is passed on), the job's process group is killed.
pub fn run_job(
    bin: &Binary,
    programs: &Programs,
    job: &Job,
    logs: &Path,
    limit: Duration,
    interrupted: &dyn Fn() -> Option<i32>,
) -> Result<JobRun> {
    let log_path = logs.join(format!("{}.log", job.label.replace("::", "-")));
    let mut log = std::fs::File::create(&log_path)
        .with_context(|| format!("cannot create {}", log_path.display()))?;
    let mut cmd = command(bin, programs);
    // `--show-output`: what passing tests wrote comes after the results, where a test that
    // skipped itself at run time says so (`skipped: REASON`).
    cmd.args(["--test-threads", "1", "--exact", "--show-output"])
        .args(&job.tests)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log.try_clone()?)
        // A group of its own, so that killing it reaches every process the tests started
        // (the ranks a launcher starts in sessions of their own die with their launcher).
        .process_group(0);
    let start = Instant::now();
    let mut group =
        Group::spawn(&mut cmd).with_context(|| format!("cannot start {}", bin.exe.display()))?;
    let stdout = group.child.stdout.take().context("no stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || forward(stdout, &tx));

    let mut parser = RunParser::default();
    let mut pending: Vec<u8> = Vec::new();
    let (mut kill_at, mut killed) = (start + limit, None::<String>);
    let (mut status, mut eof, mut read_until) = (None::<ExitStatus>, false, None::<Instant>);
    loop {
        if eof {
            std::thread::sleep(POLL);
        } else {
            match rx.recv_timeout(POLL) {
                Ok(chunk) => {
                    let _ = log.write_all(&chunk);
                    pending.extend_from_slice(&chunk);
                    while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                        let line: Vec<u8> = pending.drain(..=end).collect();
                        let line = String::from_utf8_lossy(&line);
                        let line = line.trim_end_matches(['\n', '\r']);
                        let before = parser.results.len();
                        parser.line(line, start.elapsed());
                        for r in &parser.results[before..] {
                            report(&job.label, r, None);
                        }
                    }
                }
                Err(RecvTimeoutError::Disconnected) => eof = true,
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
        let now = Instant::now();
        if status.is_none() {
            if killed.is_none() {
                if let Some(signal) = interrupted() {
                    signal_group(&group.child, signal);
                    killed = Some(format!("interrupted by signal {signal}"));
                    kill_at = kill_at.min(now + GRACE);
                }
            }
            if now >= kill_at {
                signal_group(&group.child, libc::SIGKILL);
                let timeout = format!("TIMEOUT after {:.0} s", limit.as_secs_f64());
                killed.get_or_insert(timeout);
            }
            status = group.try_wait()?;
            if status.is_some() {
                read_until = Some(now + GRACE);
            }
        }
        if status.is_some() && (eof || read_until.is_some_and(|t| now >= t)) {
            break;
        }
    }
    let status = status.context("the loop ends after the binary")?;
    let problem = killed.or_else(|| {
        let failed = parser.results.iter().any(|r| r.outcome == Outcome::Failed);
        let running = parser.running(&String::from_utf8_lossy(&pending)).is_some();
        (!status.success() && (running || !failed)).then(|| exit_status(status))
    });
    if let Some(problem) = &problem {
        let partial = String::from_utf8_lossy(&pending).into_owned();
        if parser.fail_running(&partial, start.elapsed()) {
            let r = parser
                .results
                .last()
                .context("a failed test was just added")?;
            report(&job.label, r, Some(problem));
        }
    }
    for (r, reason) in parser.skipped_at_run_time() {
        report(&job.label, &r, Some(&reason));
    }
    let ran = parser.results.len();
    if status.success() && problem.is_none() && ran != job.tests.len() {
        bail!(
            "{} reported {ran} of its {} tests (see {})",
            job.label,
            job.tests.len(),
            log_path.display()
        );
    }
    Ok(JobRun {
        success: status.success() && problem.is_none(),
        results: parser.results,
        log: log_path,
        problem,
    })
}

/// Runs `cmd` in a process group of its own and returns its output, or kills the group once
/// `limit` has passed and says so, naming the command: for the runner's own steps (listing a
/// binary's tests, the doctests), so that one of them that hangs cannot hang the whole run;
/// killed too, and an error, once `interrupted` names a signal the runner received (the
/// group is out of the terminal's reach). Its stderr goes where `cmd` says.
pub fn output_within(
    cmd: &mut Command,
    limit: Duration,
    interrupted: &dyn Fn() -> Option<i32>,
) -> Result<Output> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped());
    let mut group = Group::spawn(cmd).with_context(|| format!("cannot start {cmd:?}"))?;
    let stdout = group.child.stdout.take().context("no stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || forward(stdout, &tx));
    let kill_at = Instant::now() + limit;
    let (mut out, mut status, mut read_until) = (Vec::new(), None::<ExitStatus>, None);
    loop {
        match rx.recv_timeout(POLL) {
            Ok(chunk) => out.extend_from_slice(&chunk),
            Err(RecvTimeoutError::Disconnected) if status.is_some() => break,
            Err(RecvTimeoutError::Disconnected) => std::thread::sleep(POLL),
            Err(RecvTimeoutError::Timeout) => {}
        }
        let now = Instant::now();
        if status.is_none() {
            if now >= kill_at {
                // Dropping the group kills it.
                bail!(
                    "{cmd:?} did not end within {:.0} s; it was killed with every process it \
                     started",
                    limit.as_secs_f64()
                );
            }
            if let Some(signal) = interrupted() {
                // Its group is out of the terminal's reach: dropped, it is killed.
                bail!("{cmd:?} was stopped: interrupted by signal {signal}");
            }
            status = group.try_wait()?;
            if status.is_some() {
                // A process that left the group may hold the pipe.
                read_until = Some(now + GRACE);
            }
        } else if read_until.is_some_and(|t| now >= t) {
            break;
        }
    }
    let status = status.context("the loop ends after the command")?;
    Ok(Output {
        status,
        stdout: out,
        stderr: Vec::new(),
    })
}

/// Prints `r` of the job `label`: `PASS [  1.2s] label test`, with `problem` for a test
/// the job's end cut short (`TIMEOUT` when it was the deadline).
fn report(label: &str, r: &TestResult, problem: Option<&str>) {
    let tag = match (r.outcome, problem) {
        (_, Some(p)) if p.starts_with("TIMEOUT") => "TIMEOUT",
        (Outcome::Passed, _) => "PASS",
        (Outcome::Failed, _) => "FAIL",
        (Outcome::Ignored, _) => "SKIP",
    };
    let why = problem.map(|p| format!(" ({p})")).unwrap_or_default();
    println!(
        "  {tag} [{:>6.1}s] {label} {}{why}",
        r.time.as_secs_f64(),
        r.name
    );
}

/// `exit code N` or `signal N`.
pub fn exit_status(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("signal {signal}"),
        (None, None) => status.to_string(),
    }
}

/// A command's process group, which its `child` leads: what the command leaves running is
/// killed once the leader has exited, and all of it when this is dropped before (a panic or
/// an error return while the command runs), so that nothing outlives the step that ran it.
struct Group {
    child: Child,
    status: Option<ExitStatus>,
}

impl Group {
    /// Starts `cmd` in a process group of its own.
    fn spawn(cmd: &mut Command) -> std::io::Result<Self> {
        let child = cmd.process_group(0).spawn()?;
        Ok(Self {
            child,
            status: None,
        })
    }

    /// The leader's exit status once it has exited. The rest of the group is killed before
    /// the leader is reaped, while the group's id is still the leader's and cannot be reused.
    fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        if self.status.is_none() && leader_exited(&self.child)? {
            signal_group(&self.child, libc::SIGKILL);
            self.status = Some(self.child.wait()?);
        }
        Ok(self.status)
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.status.is_none() {
            signal_group(&self.child, libc::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// Whether `child` has exited, without reaping it (`waitid` with `WNOWAIT`).
fn leader_exited(child: &Child) -> std::io::Result<bool> {
    // SAFETY: siginfo_t is plain data, all zeroes is a valid value of it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let options = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
    // SAFETY: `info` is a valid out-pointer; the child is ours and not yet reaped.
    if unsafe { libc::waitid(libc::P_PID, child.id(), &mut info, options) } == -1 {
        let e = std::io::Error::last_os_error();
        return match e.kind() {
            std::io::ErrorKind::Interrupted => Ok(false),
            _ => Err(e),
        };
    }
    // SAFETY: waitid filled `info` (with WNOHANG and no exit, si_pid stays 0).
    Ok(unsafe { info.si_pid() } != 0)
}

/// Sends `signal` to `child`'s process group, which it leads (see [`run_job`]).
fn signal_group(child: &Child, signal: i32) {
    let Ok(pgid) = libc::pid_t::try_from(child.id()) else {
        return;
    };
    // SAFETY: kill(2) takes plain integers and touches no memory of ours. The child has not
    // been waited for yet, so its id (the group's) cannot belong to another process.
    unsafe { libc::kill(-pgid, signal) };
}

/// Sends what `out` gives, as it comes, until its end.
fn forward(mut out: impl Read, tx: &mpsc::Sender<Vec<u8>>) {
    let mut buf = vec![0; 8192];
    loop {
        match out.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                if tx.send(buf[..n].to_vec()).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_suite::schedule::Group;

    /// A step that starts a 300 s sleeper, writes its pid to `pid_file`, and waits for it.
    fn sleeper(pid_file: &Path) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 300 & echo $! > \"$0\"; wait"])
            .arg(pid_file);
        cmd
    }

    #[test]
    fn a_step_that_hangs_is_killed_with_its_processes_naming_it() {
        let dir = tempdir("hang");
        let pid_file = dir.join("sleeper");
        let mut cmd = sleeper(&pid_file);
        let start = Instant::now();
        let err = output_within(&mut cmd, Duration::from_secs(1), &|| None).unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        let text = err.to_string();
        assert!(
            text.contains("did not end within 1 s") && text.contains("sleep 300"),
            "{text}"
        );
        // The sleeper it started is gone too.
        assert_gone(&pid_file);
        std::fs::remove_dir_all(&dir).unwrap();

        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo listed; exit 3"]);
        let out = output_within(&mut cmd, Duration::from_secs(30), &|| None).unwrap();
        assert_eq!(
            (out.stdout.as_slice(), out.status.code()),
            (&b"listed\n"[..], Some(3))
        );
    }

    /// A step in a process group of its own, which the terminal's Ctrl-C does not reach, is
    /// stopped when the runner is interrupted, with the processes it started.
    #[test]
    fn an_interrupted_step_is_stopped_with_its_processes() {
        let dir = tempdir("interrupted-step");
        let pid_file = dir.join("sleeper");
        let mut cmd = sleeper(&pid_file);
        let start = Instant::now();
        let asked = || (start.elapsed() > Duration::from_millis(300)).then_some(libc::SIGINT);
        let err = output_within(&mut cmd, Duration::from_secs(300), &asked).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("was stopped: interrupted by signal 2"),
            "{err}"
        );
        assert_gone(&pid_file);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Asserts that the process whose pid `pid_file` holds is gone within 5 s (or a zombie
    /// until init reaps it).
    fn assert_gone(pid_file: &Path) {
        let pid = std::fs::read_to_string(pid_file).unwrap();
        let stat = format!("/proc/{}/stat", pid.trim());
        let gone = || std::fs::read_to_string(&stat).map_or(true, |s| s.contains(") Z"));
        let until = Instant::now() + Duration::from_secs(5);
        while !gone() && Instant::now() < until {
            std::thread::sleep(POLL);
        }
        assert!(gone(), "the sleeper {} outlived its step", pid.trim());
    }

    /// A temporary folder of this test's own.
    fn tempdir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-job-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A test binary that is the shell script `text`, written from another process, so that
    /// no descriptor of it open here can reach a child forked meanwhile (ETXTBSY).
    fn binary(dir: &Path, text: &str) -> Binary {
        let exe = dir.join("bin.sh");
        ddp_testkit::script(&exe, text);
        Binary {
            package: "p".into(),
            target: "t".into(),
            exe,
            manifest_dir: dir.to_path_buf(),
        }
    }

    fn job(tests: &[&str]) -> Job {
        Job {
            binary: 0,
            label: "p::t".into(),
            group: Group::Free,
            estimate: 1.0,
            tests: tests.iter().map(|t| t.to_string()).collect(),
        }
    }

    fn outcomes(run: &JobRun) -> Vec<(&str, Outcome)> {
        run.results
            .iter()
            .map(|r| (r.name.as_str(), r.outcome))
            .collect()
    }

    #[test]
    fn what_a_binary_leaves_running_is_killed_when_it_exits() {
        let dir = tempdir("leftover");
        // libtest's output of one passing test, and a process left behind on the pipe.
        let bin = binary(
            &dir,
            "#!/bin/sh\nsleep 300 &\necho $! > \"$0.pid\"\n\
             printf 'running 1 test\\ntest t ... ok\\n\\ntest result: ok. 1 passed\\n'\n",
        );
        let started = Instant::now();
        let run = run_job(
            &bin,
            &vec![],
            &job(&["t"]),
            &dir,
            Duration::from_secs(60),
            &|| None,
        )
        .unwrap();
        assert!(run.success, "{:?}", run.problem);
        // Not held up by the sleep on the pipe for the grace period.
        assert!(started.elapsed() < GRACE, "{:?}", started.elapsed());
        let pid = std::fs::read_to_string(dir.join("bin.sh.pid")).unwrap();
        let stat = Path::new("/proc").join(pid.trim()).join("stat");
        // SIGKILL is sent when the binary exits, and acted on when the sleep next runs: on a
        // busy machine it may still show as running for a moment. A sleep never killed
        // would still be there after the 5 s (it sleeps 300).
        let dead = || {
            let state = std::fs::read_to_string(&stat).unwrap_or_default();
            (state.is_empty() || state.contains(") Z "), state)
        };
        let waited = Instant::now();
        while !dead().0 && waited.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let (gone, state) = dead();
        assert!(
            gone,
            "the sleep {} outlived its binary: {state}",
            pid.trim()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_hung_job_is_killed_at_its_deadline_naming_its_test() {
        let dir = tempdir("hung");
        // libtest's start of test `t`, then a hang in a process of the binary's own.
        let bin = binary(
            &dir,
            "#!/bin/sh\nprintf 'running 1 test\\ntest t ... '\nsleep 600 &\n\
             echo $! > \"$0.pid\"\nwait\n",
        );
        let started = Instant::now();
        let run = run_job(
            &bin,
            &vec![],
            &job(&["t"]),
            &dir,
            Duration::from_secs(1),
            &|| None,
        )
        .unwrap();
        assert!(started.elapsed() < Duration::from_secs(60));
        assert!(!run.success);
        assert_eq!(run.problem.as_deref(), Some("TIMEOUT after 1 s"));
        assert_eq!(outcomes(&run), [("t", Outcome::Failed)]);
        // The log names the test while it runs, and the sleep died with the binary's group.
        let log = std::fs::read_to_string(&run.log).unwrap();
        assert!(log.ends_with("test t ... "), "{log:?}");
        let pid = std::fs::read_to_string(dir.join("bin.sh.pid")).unwrap();
        let stat = Path::new("/proc").join(pid.trim()).join("stat");
        let gone = (0..100).any(|_| {
            let state = std::fs::read_to_string(&stat).unwrap_or_default();
            let dead = state.is_empty() || state.contains(") Z ");
            if !dead {
                std::thread::sleep(Duration::from_millis(50));
            }
            dead
        });
        assert!(gone, "the job's sleep {} survived it", pid.trim());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_binary_that_dies_in_a_test_fails_that_test_with_its_signal() {
        let dir = tempdir("crash");
        let bin = binary(
            &dir,
            "#!/bin/sh\nulimit -c 0\nprintf 'running 3 tests\\ntest a ... ok\\ntest b ... ok\\n\
             test c ... '\nkill -SEGV $$\n",
        );
        let run = run_job(
            &bin,
            &vec![],
            &job(&["a", "b", "c"]),
            &dir,
            Duration::from_secs(60),
            &|| None,
        )
        .unwrap();
        assert!(!run.success);
        assert_eq!(run.problem.as_deref(), Some("signal 11"));
        assert_eq!(
            outcomes(&run),
            [
                ("a", Outcome::Passed),
                ("b", Outcome::Passed),
                ("c", Outcome::Failed)
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_interrupted_job_is_stopped_naming_its_test() {
        let dir = tempdir("interrupted");
        let bin = binary(
            &dir,
            "#!/bin/sh\nprintf 'running 1 test\\ntest t ... '\nsleep 600\n",
        );
        let run = run_job(
            &bin,
            &vec![],
            &job(&["t"]),
            &dir,
            Duration::from_secs(600),
            &|| Some(libc::SIGTERM),
        )
        .unwrap();
        assert_eq!(run.problem.as_deref(), Some("interrupted by signal 15"));
        assert_eq!(outcomes(&run), [("t", Outcome::Failed)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_deadline_is_far_above_the_recorded_time() {
        assert_eq!(deadline(1.0), Duration::from_secs(15 * 60));
        assert_eq!(deadline(600.0), Duration::from_secs(40 * 60));
        assert_eq!(deadline(1e30), Duration::from_secs(24 * 3600));
    }
}
