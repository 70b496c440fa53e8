//! The fault tests' injected failures, holds and slow steps, read from the environment only
//! in builds with the `fault-injection` feature (which `cargo xtask test` turns on).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::TrainError;
use crate::stop::SignalWatch;

/// Where a fault can be injected: `epoch:step` names a step, `epoch:eval` an epoch's
/// evaluation (after its first round of batches), `epoch:end` the end of the epoch (after
/// its evaluation, before rank 0 saves it).
#[derive(Debug, Clone, Copy)]
pub(super) enum Point {
    /// Before this step of this epoch.
    Step(u64, usize),
    /// In this epoch's evaluation.
    Eval(u64),
    /// After this epoch's evaluation.
    End(u64),
}

impl std::fmt::Display for Point {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Step(epoch, step) => write!(f, "{epoch}:{step}"),
            Self::Eval(epoch) => write!(f, "{epoch}:eval"),
            Self::End(epoch) => write!(f, "{epoch}:end"),
        }
    }
}

/// For the fault tests, with the `fault-injection` feature only, at a [`Point`]:
///
/// - `DDP_TRAIN_FAIL_RANK=r` (or `all`) and `DDP_TRAIN_FAIL_AT=<point>` make rank r (or
///   every rank) fail there, in the first attempt only (a restarted attempt has
///   `TORCHELASTIC_RESTART_COUNT` > 0): exit with status 17, or with
///   `DDP_TRAIN_FAIL_SIGNAL=KILL` kill itself, with `STOP` stop itself (a hung rank), with
///   `TERM` send itself SIGTERM (a stop request to one rank), with `KILL_LAUNCHER` kill
///   its launcher (`DDP_LAUNCHER_PID`) with SIGKILL and carry on until it dies with it, or
///   with `KILL_PARENT` kill its parent process (torchrun's agent) and itself with SIGKILL
///   (a node lost with its agent);
/// - `DDP_TRAIN_STEP_SLEEP_MS=n` makes every step n ms longer (so that a test can act in
///   the middle of an epoch).
pub(super) fn fail_if_injected(rank: usize, point: Point, restarted: bool) {
    // Only with the feature (what the tests build): a user's program never reads these.
    if !cfg!(feature = "fault-injection") {
        return;
    }
    let var = |k: &str| std::env::var(k).ok();
    if let (Point::Step(..), Some(ms)) = (
        point,
        var("DDP_TRAIN_STEP_SLEEP_MS").and_then(|v| v.parse().ok()),
    ) {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let (Some(r), Some(at)) = (var("DDP_TRAIN_FAIL_RANK"), var("DDP_TRAIN_FAIL_AT")) else {
        return;
    };
    if restarted || (r != "all" && r.parse() != Ok(rank)) || at != point.to_string() {
        return;
    }
    let how = var("DDP_TRAIN_FAIL_SIGNAL").unwrap_or_default();
    tracing::warn!(
        "rank {rank}: injected failure ({}) at DDP_TRAIN_FAIL_AT={point}",
        if how.is_empty() { "exit 17" } else { &how }
    );
    let signal = match how.as_str() {
        "KILL" => libc::SIGKILL,
        "KILL_PARENT" => {
            // SAFETY: getppid(2) and kill(2) take and return plain integers.
            unsafe { libc::kill(libc::getppid(), libc::SIGKILL) };
            libc::SIGKILL
        }
        "STOP" => libc::SIGSTOP,
        "TERM" => libc::SIGTERM,
        "KILL_LAUNCHER" => {
            let launcher = var(ddp_run::env::DDP_LAUNCHER_PID).and_then(|v| v.parse().ok());
            if let Some(pid) = launcher {
                // SAFETY: kill(2) on the launcher's pid; no memory is involved.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            return;
        }
        _ => std::process::exit(17),
    };
    // SAFETY: raise(3) on this process; for SIGSTOP it returns once the process is continued,
    // for SIGTERM once the stop watch has noted it.
    unsafe {
        libc::raise(signal);
    }
}

/// For the tests that act while a rank trains, with the `fault-injection` feature only:
/// `DDP_TRAIN_HOLD_AT=<point>` (a step, `epoch:step`) and `DDP_TRAIN_HOLD_FILE=<file>` make
/// the first process to reach that step create `<file>` and hold there, before the ranks
/// agree whether to stop, until a stop signal arrives (a minute at most): a test waits for
/// `<file>`, acts (a torchrun agent sees a node waiting and stops its rank), and the rank
/// stops at exactly that step. A process that finds `<file>` there goes on: one hold per
/// file, so a continued run passes the step.
pub(super) fn hold_if_injected(point: Point, signals: Option<&SignalWatch>) {
    if !cfg!(feature = "fault-injection") {
        return;
    }
    let var = |k: &str| std::env::var_os(k);
    let (Some(at), Some(file)) = (var("DDP_TRAIN_HOLD_AT"), var("DDP_TRAIN_HOLD_FILE")) else {
        return;
    };
    let here = at.to_str() == Some(point.to_string().as_str());
    if !here || std::fs::File::create_new(&file).is_err() {
        return;
    }
    tracing::warn!("injected hold at DDP_TRAIN_HOLD_AT={point} until a stop signal");
    let start = Instant::now();
    while signals.and_then(SignalWatch::received).is_none()
        && start.elapsed() < Duration::from_secs(60)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// For the tests of a restart while rank 0 writes a checkpoint, with the `fault-injection`
/// feature only: with `DDP_TRAIN_PAUSE_FILE` set (`state::save`'s pause), every rank says which
/// checkpoint it resolved just before it meets the others, so that a test ends rank 0's pause
/// once a restarted rank has read `latest`, not before.
pub(super) fn note_resumed(rank: usize, resumed: Option<&Path>) {
    if cfg!(feature = "fault-injection") && std::env::var_os("DDP_TRAIN_PAUSE_FILE").is_some() {
        let file = resumed.map_or("no checkpoint".into(), |f| f.display().to_string());
        tracing::warn!(
            "rank {rank} resumes {file}; meeting the other ranks (DDP_TRAIN_PAUSE_FILE)"
        );
    }
}

/// For the tests of run directories on file systems without locks, with the
/// `fault-injection` feature only: `DDP_TRAIN_FLOCK_ERRNO=<n>` makes rank 0's `flock` of the
/// run directory fail with error number n (38, `ENOSYS`, is Lustre's answer when mounted
/// `noflock`).
pub(super) fn flock_error() -> Option<std::io::Error> {
    if !cfg!(feature = "fault-injection") {
        return None;
    }
    let errno = std::env::var("DDP_TRAIN_FLOCK_ERRNO").ok()?.parse().ok()?;
    Some(std::io::Error::from_raw_os_error(errno))
}

/// For the tests of run directories on file systems whose lock manager does not answer, with
/// the `fault-injection` feature only: `DDP_TRAIN_FLOCK_HANG=1` makes rank 0's `flock` of the
/// run directory block for good (as on a `hard` NFS mount whose lock manager is down).
pub(super) fn hang_if_flock_hangs() {
    if cfg!(feature = "fault-injection") && std::env::var_os("DDP_TRAIN_FLOCK_HANG").is_some() {
        tracing::warn!("rank 0's flock of the run directory hangs (DDP_TRAIN_FLOCK_HANG)");
        loop {
            std::thread::park();
        }
    }
}

/// For the tests of resumes on other allocations, with the `fault-injection` feature only:
/// `DDP_TRAIN_LOG_INDICES=<folder>` makes every rank append, after each optimizer step, a
/// line `epoch step index,index,...` of the samples that step trained to
/// `<folder>/rank-<rank>-<attempt>-pid-<pid>.txt`, where `<attempt>` is `first` or
/// `restarted` (after a launcher's restart): one file per process.
pub(super) fn index_log() -> Option<PathBuf> {
    if !cfg!(feature = "fault-injection") {
        return None;
    }
    std::env::var_os("DDP_TRAIN_LOG_INDICES").map(PathBuf::from)
}

/// Appends one step's line to this rank's index log in `dir` (see [`index_log`]).
pub(super) fn log_indices(
    dir: &Path,
    rank: usize,
    restarted: bool,
    epoch: u64,
    step: usize,
    indices: &[usize],
) -> Result<(), TrainError> {
    let attempt = if restarted { "restarted" } else { "first" };
    let path = dir.join(format!(
        "rank-{rank}-{attempt}-pid-{}.txt",
        std::process::id()
    ));
    let list: Vec<String> = indices.iter().map(usize::to_string).collect();
    let line = format!("{epoch} {step} {}\n", list.join(","));
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()))
        .map_err(|e| TrainError::io(format!("cannot append to {}", path.display()), e))
}
