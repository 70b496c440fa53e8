//! Stopping a run cleanly before it is killed: SIGTERM and SIGUSR1 (what SLURM's `--signal`,
//! Kubernetes and `ddp-run` send first), and the run's own time limit.
//!
//! A signal only sets a flag here; the Trainer reads it between optimizer steps, the ranks
//! agree on it with one small all-reduce per step (so that all stop after the same step and
//! none waits on a peer that has left), rank 0 writes a checkpoint, and every rank ends with
//! [`crate::TrainError::Stopped`], whose exit code is [`EXIT_STOPPED`].
//!
//! The handlers are installed once per process (signal-hook cannot remove them) and act only
//! while a Trainer runs; otherwise a signal whose disposition was the default still ends the
//! process as before, one that was ignored stays ignored, and an earlier handler of the
//! program still runs (signal-hook chains to it).

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The exit code of a rank that stopped at a checkpoint on request (a signal or the time
/// limit) and can continue from it: 75, `EX_TEMPFAIL` of `sysexits.h` ("try again later").
/// `ddp-run` does not count it as a failure and ends with it too; it is the launcher's own
/// constant, so the two cannot drift apart.
pub use ddp_run::EXIT_STOPPED;

/// The signals that stop a run at the next step.
pub const STOP_SIGNALS: [i32; 2] = [libc::SIGTERM, libc::SIGUSR1];

/// Trainers running in this process.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// The stop signal received while a Trainer ran (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);
static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

/// Why a run stopped early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop signal (its number) reached some rank.
    Signal(i32),
    /// The time limit would have been reached before the next chance to stop.
    TimeLimit,
}

impl StopReason {
    /// The number the ranks all-reduce (with max) to agree: 0 for none.
    pub(crate) fn code(reason: Option<Self>) -> i64 {
        match reason {
            None => 0,
            Some(Self::TimeLimit) => 1,
            Some(Self::Signal(s)) => 1 + i64::from(s),
        }
    }

    pub(crate) fn from_code(code: i64) -> Option<Self> {
        match code {
            c if c <= 0 => None,
            1 => Some(Self::TimeLimit),
            c => Some(Self::Signal((c - 1) as i32)),
        }
    }
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Signal(s) => write!(f, "{}", signal_name(*s)),
            Self::TimeLimit => f.write_str("time limit"),
        }
    }
}

fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGUSR1 => "SIGUSR1".into(),
        s => format!("signal {s}"),
    }
}

/// While it lives, stop signals are noticed instead of ending the process.
#[derive(Debug)]
pub(crate) struct SignalWatch(());

impl SignalWatch {
    pub(crate) fn start() -> Result<Self, String> {
        ACTIVE.fetch_add(1, Ordering::SeqCst);
        let watch = Self(());
        INSTALLED.get_or_init(install).clone().map(|()| watch)
    }

    /// The stop signal received since a Trainer started, if any.
    pub(crate) fn received(&self) -> Option<i32> {
        match RECEIVED.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

impl Drop for SignalWatch {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
    }
}

fn install() -> Result<(), String> {
    for signal in STOP_SIGNALS {
        // SAFETY: a zeroed sigaction is a valid out-parameter; a null `act` only queries.
        let previous = unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut old) != 0 {
                return Err(format!(
                    "cannot query the handler of {}: {}",
                    signal_name(signal),
                    std::io::Error::last_os_error()
                ));
            }
            old.sa_sigaction
        };
        if previous == libc::SIG_IGN {
            continue;
        }
        let default_when_idle = previous == libc::SIG_DFL;
        let action = move || {
            if ACTIVE.load(Ordering::SeqCst) > 0 {
                RECEIVED.store(signal, Ordering::SeqCst);
            } else if default_when_idle {
                let _ = signal_hook::low_level::emulate_default_handler(signal);
            }
        };
        // SAFETY: the action only touches atomics and calls `emulate_default_handler`, all
        // async-signal-safe; it allocates nothing and takes no lock.
        unsafe { signal_hook::low_level::register(signal, action) }
            .map_err(|e| format!("cannot handle {}: {e}", signal_name(signal)))?;
    }
    Ok(())
}

/// The time budget of a run: whether one more step (and what may follow it) still fits.
#[derive(Debug)]
pub(crate) struct Budget {
    started: Instant,
    deadline: Option<Instant>,
    eval_batches: usize,
    steps: usize,
    longest_step: Duration,
    longest_save: Option<Duration>,
    save_guess: Duration,
    longest_eval: Option<Duration>,
}

impl Budget {
    /// A budget of `limit` from `started`. Until timed, evaluation is guessed to take
    /// `eval_batches` of the longest step, and a save to write `checkpoint_bytes` at
    /// 100 MB/s plus 0.2 s.
    pub(crate) fn new(
        started: Instant,
        limit: Option<Duration>,
        eval_batches: usize,
        checkpoint_bytes: u64,
    ) -> Self {
        Self {
            started,
            deadline: limit.map(|l| started + l),
            eval_batches,
            steps: 0,
            longest_step: Duration::ZERO,
            longest_save: None,
            save_guess: Duration::from_millis(200)
                + Duration::from_secs_f64(checkpoint_bytes as f64 / 100e6),
            longest_eval: None,
        }
    }

    /// Time since the budget's start.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub(crate) fn step_took(&mut self, d: Duration) {
        self.steps += 1;
        self.longest_step = self.longest_step.max(d);
    }

    pub(crate) fn save_took(&mut self, d: Duration) {
        self.longest_save = Some(self.longest_save.unwrap_or_default().max(d));
    }

    pub(crate) fn eval_took(&mut self, d: Duration) {
        self.longest_eval = Some(self.longest_eval.unwrap_or_default().max(d));
    }

    /// Whether the run must stop now, before a step, to save within the limit: it stops when
    /// the longest step so far, then (before the epoch's end) evaluation and its checkpoint,
    /// then a stop checkpoint, would not fit twice in the time left (a loaded machine's steps
    /// vary; the limit is a hard one). It never stops before this process has taken a step: a start that stopped
    /// without progress would be started again forever.
    pub(crate) fn must_stop(&self, last_step_of_epoch: bool) -> bool {
        let Some(deadline) = self.deadline else {
            return false;
        };
        if self.steps == 0 {
            return false;
        }
        let save = self.longest_save.unwrap_or(self.save_guess);
        let mut needed = self.longest_step + save;
        if last_step_of_epoch {
            let eval_guess = self.longest_step * self.eval_batches as u32;
            needed += self.longest_eval.unwrap_or(eval_guess) + save;
        }
        Instant::now() + needed * 2 >= deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_survive_the_all_reduce_code() {
        for reason in [
            None,
            Some(StopReason::TimeLimit),
            Some(StopReason::Signal(libc::SIGTERM)),
            Some(StopReason::Signal(libc::SIGUSR1)),
        ] {
            assert_eq!(StopReason::from_code(StopReason::code(reason)), reason);
        }
        assert_eq!(StopReason::Signal(libc::SIGTERM).to_string(), "SIGTERM");
        assert_eq!(StopReason::TimeLimit.to_string(), "time limit");
    }

    #[test]
    fn the_budget_keeps_room_for_a_step_and_a_save() {
        let now = Instant::now();
        let mut b = Budget::new(now, Some(Duration::from_secs(10)), 6, 0);
        // Not before a first step, however little time is left.
        assert!(!Budget::new(now, Some(Duration::from_millis(1)), 6, 0).must_stop(true));
        b.step_took(Duration::from_secs(1));
        b.save_took(Duration::from_secs(1));
        // 2 * (1 + 1) s fits in 10 s.
        assert!(!b.must_stop(false));
        // With evaluation (guessed: 6 batches of 1 s) and the epoch's checkpoint: 2 * 9 s.
        assert!(b.must_stop(true));
        // Once timed, evaluation counts as it took: 2 * (1 + 1 + 1 + 1) s fits.
        b.eval_took(Duration::from_secs(1));
        assert!(!b.must_stop(true));
        b.step_took(Duration::from_secs(7));
        assert!(b.must_stop(false));
        assert!(!Budget::new(now, None, 99, 0).must_stop(true));
        // Before a save has been timed, one is guessed from the checkpoint's size:
        // 0.2 s + 500 MB at 100 MB/s = 5.2 s, which with a 1 s step does not fit twice in 7 s.
        let mut b = Budget::new(now, Some(Duration::from_secs(7)), 0, 500_000_000);
        b.step_took(Duration::from_secs(1));
        assert!(b.must_stop(false));
    }
}
