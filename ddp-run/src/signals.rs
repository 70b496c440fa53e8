//! Noticing SIGINT, SIGTERM, SIGHUP, SIGQUIT (torchrun's default `--signals-to-handle`) and
//! SIGUSR1 (what SLURM's `--signal` sends before a time limit) while a job runs, to forward
//! them to the ranks.
//!
//! The handlers are installed once per process with signal-hook and stay installed (signal-hook
//! cannot uninstall them). While no job runs they behave as before they were installed: a
//! signal whose disposition was the default gets the default action (the process ends), one
//! that was ignored (for instance SIGHUP under `nohup`) is left alone entirely, and a handler
//! installed earlier by the program still runs (signal-hook chains to it).

use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::LaunchError;

/// The signals forwarded to the ranks.
pub const FORWARDED: [i32; 5] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
];

/// Jobs running in this process.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Signals received while a job ran, and the last one.
static RECEIVED: AtomicU64 = AtomicU64::new(0);
static LAST: AtomicI32 = AtomicI32::new(0);
/// Whether the handlers are installed (or why they could not be).
static INSTALLED: OnceLock<Result<(), (i32, std::io::ErrorKind)>> = OnceLock::new();

/// Marks a job as running while it lives; [`Watch::received`] says whether a forwarded
/// signal arrived since it was made.
#[derive(Debug)]
pub(crate) struct Watch {
    seen: u64,
}

impl Watch {
    pub(crate) fn start() -> Result<Self, LaunchError> {
        ACTIVE.fetch_add(1, Ordering::SeqCst);
        let watch = Self {
            seen: RECEIVED.load(Ordering::SeqCst),
        };
        match INSTALLED.get_or_init(install) {
            Ok(()) => Ok(watch),
            Err((signal, kind)) => Err(LaunchError::Signals {
                signal: *signal,
                source: std::io::Error::from(*kind),
            }),
        }
    }

    /// The last forwarded signal received since this job started, if any.
    pub(crate) fn received(&self) -> Option<i32> {
        (RECEIVED.load(Ordering::SeqCst) != self.seen).then(|| LAST.load(Ordering::SeqCst))
    }
}

/// How many forwarded signals this process has received while jobs ran (for noticing a
/// second one while ranks are being stopped).
pub(crate) fn received_total() -> u64 {
    RECEIVED.load(Ordering::SeqCst)
}

impl Drop for Watch {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::SeqCst);
    }
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

fn install() -> Result<(), (i32, std::io::ErrorKind)> {
    for signal in FORWARDED {
        let previous = previous_disposition(signal).map_err(|e| (signal, e.kind()))?;
        if previous == libc::SIG_IGN {
            continue;
        }
        let default_when_idle = previous == libc::SIG_DFL;
        let action = move || {
            if ACTIVE.load(Ordering::SeqCst) > 0 {
                LAST.store(signal, Ordering::SeqCst);
                RECEIVED.fetch_add(1, Ordering::SeqCst);
            } else if default_when_idle {
                let _ = signal_hook::low_level::emulate_default_handler(signal);
            }
        };
        // SAFETY: the action only touches atomics and calls `emulate_default_handler`, all
        // async-signal-safe; it allocates nothing and takes no lock.
        unsafe { signal_hook::low_level::register(signal, action) }
            .map_err(|e| (signal, e.kind()))?;
    }
    Ok(())
}
