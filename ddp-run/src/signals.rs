//! Noticing signals while a job runs instead of dying of them: the launcher's watch over
//! SIGINT, SIGTERM, SIGHUP, SIGQUIT (torchrun's default `--signals-to-handle`) and SIGUSR1
//! (what SLURM's `--signal` sends before a time limit), forwarded to the ranks; and, through
//! the same [`SignalWatch`], the stop signals a training rank (`ddp-train`'s Trainer) acts on.
//! The workspace's one place that registers signal handlers.
//!
//! A handler is installed once per process and signal with signal-hook and stays installed
//! (signal-hook cannot uninstall it). While no watch for its signal is alive it behaves as
//! before it was installed: a signal whose disposition was the default gets the default
//! action (the process ends), one that was ignored (for instance SIGHUP under `nohup`) is
//! left alone entirely, and a handler installed earlier by the program still runs
//! (signal-hook chains to it).

use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::LaunchError;

/// The signals forwarded to the ranks.
pub const FORWARDED: [i32; 5] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
];

/// One more than the largest signal number a watch may name (Linux's real-time signals end
/// at 64).
const SIGNALS: usize = 65;

/// The longest a [`SignalWatch::sleep`] goes without looking for a signal.
const SLICE: Duration = Duration::from_millis(100);

/// Per signal: the watches alive for it, and how often it arrived while one was.
static ACTIVE: [AtomicUsize; SIGNALS] = [const { AtomicUsize::new(0) }; SIGNALS];
static RECEIVED: [AtomicU64; SIGNALS] = [const { AtomicU64::new(0) }; SIGNALS];
/// The last signal that arrived while watched.
static LAST: AtomicI32 = AtomicI32::new(0);
/// Per signal: whether its handler is installed (`Some(Ok)`), or why it could not be.
static INSTALLED: Mutex<[Option<Result<(), std::io::ErrorKind>>; SIGNALS]> =
    Mutex::new([None; SIGNALS]);

/// While it lives, the signals it was started for are noticed ([`SignalWatch::received`])
/// instead of taking their default action.
///
/// ```
/// let watch = ddp_run::SignalWatch::start(&[libc::SIGUSR2])?;
/// assert_eq!(watch.received(), None);
/// // SAFETY: raise(3) on this process; SIGUSR2 is watched, so it only records the signal.
/// unsafe { libc::raise(libc::SIGUSR2) };
/// assert_eq!(watch.received(), Some(libc::SIGUSR2));
/// # Ok::<(), ddp_run::LaunchError>(())
/// ```
#[derive(Debug)]
pub struct SignalWatch {
    /// The watched signals and how often each had arrived when the watch started.
    seen: Vec<(i32, u64)>,
}

impl SignalWatch {
    /// Watches `signals` (installing their handlers the first time); fails with
    /// [`LaunchError::Signals`] for a signal that cannot be handled (kind `InvalidInput` for
    /// a number that is no signal, or one no program may handle: SIGKILL, SIGSTOP, SIGILL,
    /// SIGFPE, SIGSEGV), and then watches none of them.
    pub fn start(signals: &[i32]) -> Result<Self, LaunchError> {
        let watch_failed =
            |signal: i32, source: std::io::Error| LaunchError::Signals { signal, source };
        if let Some(&signal) = signals.iter().find(|&&s| !handleable(s)) {
            let why = "not a signal number a program may handle";
            let source = std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
            return Err(watch_failed(signal, source));
        }
        // Built as it goes, so that an early return drops it and undoes the counts so far.
        let mut watch = Self {
            seen: Vec::with_capacity(signals.len()),
        };
        for &signal in signals {
            install(signal).map_err(|kind| watch_failed(signal, kind.into()))?;
            let slot = signal as usize;
            // The count before the watch counts: a signal arriving between the two is
            // reported (it would otherwise be neither reported nor acted on).
            let before = RECEIVED[slot].load(Ordering::SeqCst);
            #[cfg(test)]
            tests::between_count_and_watch(signal);
            ACTIVE[slot].fetch_add(1, Ordering::SeqCst);
            watch.seen.push((signal, before));
        }
        Ok(watch)
    }

    /// Sleeps for `duration`, or less when a watched signal arrives (or has arrived): it is
    /// noticed within [`SLICE`].
    pub(crate) fn sleep(&self, duration: Duration) {
        let end = Instant::now().checked_add(duration);
        while self.received().is_none() {
            let left = end.map_or(SLICE, |end| end.saturating_duration_since(Instant::now()));
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(SLICE));
        }
    }

    /// The watched signal received since the watch started, if any: the last one to arrive
    /// when it is watched here, else the first of this watch's signals that arrived.
    pub fn received(&self) -> Option<i32> {
        let arrived = |&(signal, count): &(i32, u64)| {
            RECEIVED[signal as usize].load(Ordering::SeqCst) != count
        };
        let last = LAST.load(Ordering::SeqCst);
        if self.seen.iter().any(|s| s.0 == last && arrived(s)) {
            return Some(last);
        }
        self.seen.iter().find(|s| arrived(s)).map(|s| s.0)
    }
}

impl Drop for SignalWatch {
    fn drop(&mut self) {
        for &(signal, _) in &self.seen {
            ACTIVE[signal as usize].fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// How many watched signals this process has received in all (for noticing one while the
/// ranks' output is passed on after they ended).
pub(crate) fn received_total() -> u64 {
    received_other_than(0)
}

/// How many watched signals other than `signal` this process has received in all (for
/// noticing a second signal while ranks are being stopped).
pub(crate) fn received_other_than(signal: i32) -> u64 {
    let others = RECEIVED
        .iter()
        .enumerate()
        .filter(|&(s, _)| s != signal as usize);
    others.map(|(_, r)| r.load(Ordering::SeqCst)).sum()
}

/// How often `signal`, a number a watch may name, has arrived while watched.
pub(crate) fn received_count(signal: i32) -> u64 {
    RECEIVED
        .get(signal as usize)
        .map_or(0, |r| r.load(Ordering::SeqCst))
}

/// Makes this process's children waitable again where SIGCHLD was ignored (`SIG_IGN`, or
/// `SA_NOCLDWAIT`: both survive `exec`, so a parent can pass them on): the kernel would reap
/// each rank as it exits, and the launcher could not see how it ended (waitid fails with
/// ECHILD). `SIG_IGN` becomes the default (which ignores SIGCHLD too, but keeps children
/// waitable); a handler the program installed stays, without `SA_NOCLDWAIT`.
pub(crate) fn keep_children_waitable() -> std::io::Result<()> {
    // SAFETY: sigaction(2) on SIGCHLD, reading into a zeroed sigaction (a valid
    // out-parameter), then setting it back with only its handler or flags changed.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGCHLD, std::ptr::null(), &mut action) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let ignored = action.sa_sigaction == libc::SIG_IGN;
        if !ignored && action.sa_flags & libc::SA_NOCLDWAIT == 0 {
            return Ok(());
        }
        if ignored {
            action.sa_sigaction = libc::SIG_DFL;
        }
        action.sa_flags &= !libc::SA_NOCLDWAIT;
        if libc::sigaction(libc::SIGCHLD, &action, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether `signal` is a number a watch may name and signal-hook would register (it
/// panics on the [`FORBIDDEN`](signal_hook::consts::FORBIDDEN) ones).
fn handleable(signal: i32) -> bool {
    usize::try_from(signal).is_ok_and(|s| s > 0 && s < SIGNALS)
        && !signal_hook::consts::FORBIDDEN.contains(&signal)
}

/// What the signal's disposition was before we installed ours.
fn previous_disposition(signal: i32) -> std::io::Result<libc::sighandler_t> {
    // SAFETY: a zeroed sigaction is a valid out-parameter, and a null `act` only queries.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(signal, std::ptr::null(), &mut old) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(old.sa_sigaction)
    }
}

/// Installs `signal`'s handler once per process.
fn install(signal: i32) -> Result<(), std::io::ErrorKind> {
    let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
    let slot = signal as usize;
    if let Some(done) = installed[slot] {
        return done;
    }
    let result = register(signal);
    installed[slot] = Some(result);
    result
}

fn register(signal: i32) -> Result<(), std::io::ErrorKind> {
    let previous = previous_disposition(signal).map_err(|e| e.kind())?;
    if previous == libc::SIG_IGN {
        // Left ignored (`nohup`): the watch never hears it, as the process never did.
        return Ok(());
    }
    let default_when_idle = previous == libc::SIG_DFL;
    let slot = signal as usize;
    let action = move || {
        if ACTIVE[slot].load(Ordering::SeqCst) > 0 {
            LAST.store(signal, Ordering::SeqCst);
            RECEIVED[slot].fetch_add(1, Ordering::SeqCst);
        } else if default_when_idle {
            let _ = signal_hook::low_level::emulate_default_handler(signal);
        }
    };
    // SAFETY: the action only touches atomics and calls `emulate_default_handler`, all
    // async-signal-safe; it allocates nothing and takes no lock.
    unsafe { signal_hook::low_level::register(signal, action) }
        .map(drop)
        .map_err(|e| e.kind())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The watches alive for `signal`.
    fn active(signal: i32) -> usize {
        ACTIVE[signal as usize].load(Ordering::SeqCst)
    }

    /// The signal that [`between_count_and_watch`] raises once, if any.
    static RAISE_WHILE_STARTING: AtomicI32 = AtomicI32::new(0);

    /// Called by [`SignalWatch::start`] for each `signal` between reading its count and
    /// watching it: raises `signal` if a test asked for it.
    pub(super) fn between_count_and_watch(signal: i32) {
        let asked =
            RAISE_WHILE_STARTING.compare_exchange(signal, 0, Ordering::SeqCst, Ordering::SeqCst);
        if asked.is_ok() {
            // SAFETY: raise(3) on this process; the test watches the signal already.
            unsafe { libc::raise(signal) };
        }
    }

    #[test]
    fn a_signal_arriving_while_a_watch_starts_is_reported() {
        // SIGURG is watched by no other test of this binary. A watch already running records
        // the signal, wherever it lands in the second watch's start.
        let running = SignalWatch::start(&[libc::SIGURG]).unwrap();
        RAISE_WHILE_STARTING.store(libc::SIGURG, Ordering::SeqCst);
        let starting = SignalWatch::start(&[libc::SIGURG]).unwrap();
        assert_eq!(RAISE_WHILE_STARTING.load(Ordering::SeqCst), 0, "not raised");
        assert_eq!(running.received(), Some(libc::SIGURG));
        assert_eq!(starting.received(), Some(libc::SIGURG));
    }

    #[test]
    fn a_refused_start_leaves_no_signal_watched() {
        // SIGUSR2 is watched by no other test of this binary.
        for (bad, kind) in [
            (0, std::io::ErrorKind::InvalidInput),
            (65, std::io::ErrorKind::InvalidInput),
            (libc::SIGKILL, std::io::ErrorKind::InvalidInput),
            (libc::SIGSEGV, std::io::ErrorKind::InvalidInput),
            // glibc keeps 32 for its threads: sigaction(2) refuses it, after SIGUSR2's install.
            (32, std::io::ErrorKind::InvalidInput),
        ] {
            match SignalWatch::start(&[libc::SIGUSR2, bad]) {
                Err(LaunchError::Signals { signal, source }) => {
                    assert_eq!((signal, source.kind()), (bad, kind));
                }
                other => panic!("signal {bad}: expected a Signals error, got {other:?}"),
            }
            assert_eq!(active(libc::SIGUSR2), 0, "after refusing signal {bad}");
        }
        let watch = SignalWatch::start(&[libc::SIGUSR2]).unwrap();
        assert_eq!(active(libc::SIGUSR2), 1);
        drop(watch);
        assert_eq!(active(libc::SIGUSR2), 0);
    }

    #[test]
    fn a_signal_after_a_refused_start_takes_its_default_action() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "signals::tests::refuse_then_raise"])
            .args(["--ignored", "--nocapture", "--test-threads=1"])
            .output()
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGUSR2),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The child of `a_signal_after_a_refused_start_takes_its_default_action`.
    #[test]
    #[ignore = "run by a_signal_after_a_refused_start_takes_its_default_action"]
    fn refuse_then_raise() {
        assert!(SignalWatch::start(&[libc::SIGUSR2, 0]).is_err());
        // SAFETY: raise(3) on this process; SIGUSR2 is unwatched, so it ends the process.
        unsafe { libc::raise(libc::SIGUSR2) };
        unreachable!("SIGUSR2 should have ended the process");
    }
}
