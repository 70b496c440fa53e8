//! Ranks that die with their launcher even when it did not start them itself.
//!
//! The launcher sets `PR_SET_PDEATHSIG` on every process it starts, so a rank it started
//! directly dies with it, however it dies. A rank started through a wrapper (`sh -c 'prog
//! ...; true'`, a job script) is the wrapper's child: the kernel kills the wrapper, and the
//! rank lives on as an orphan holding its port, its GPU and its shared memory. The launcher
//! therefore gives every rank its own process id in [`DDP_LAUNCHER_PID`], and a rank that
//! calls [`die_with_launcher`] watches that process (a pidfd, readable once it has exited)
//! and kills itself when it goes. `ddp-train`'s Trainer calls it; any other rank program may.

use std::sync::OnceLock;

use crate::LaunchError;

/// The launcher's process id, set by the launcher for every rank it starts.
pub const DDP_LAUNCHER_PID: &str = "DDP_LAUNCHER_PID";

/// Kills this process (SIGKILL, as `PR_SET_PDEATHSIG` does for a directly started rank) as
/// soon as the launcher named in [`DDP_LAUNCHER_PID`] exits, from a thread that waits on a
/// pidfd. Returns whether a watch is in place: `false` without the variable (not started by
/// this launcher) or on a kernel without `pidfd_open` (before Linux 5.3). Calling it again
/// returns the first call's answer. If the launcher has already exited, the process is killed
/// at once.
///
/// Fails with [`LaunchError::Invalid`] when the variable is not a process id.
pub fn die_with_launcher() -> Result<bool, LaunchError> {
    static WATCH: OnceLock<Result<bool, String>> = OnceLock::new();
    WATCH
        .get_or_init(|| match std::env::var(DDP_LAUNCHER_PID) {
            Err(std::env::VarError::NotPresent) => Ok(false),
            Err(std::env::VarError::NotUnicode(v)) => Err(bad(&v.to_string_lossy())),
            Ok(v) => match v.parse::<i32>() {
                Ok(pid) if pid > 1 => watch(pid),
                _ => Err(bad(&v)),
            },
        })
        .clone()
        .map_err(LaunchError::Invalid)
}

fn bad(value: &str) -> String {
    format!(
        "{DDP_LAUNCHER_PID} is `{value}`, not a launcher's process id: it is set by ddp-run \
         for the ranks it starts; unset it when starting a rank by hand"
    )
}

/// Opens a pidfd on `pid` and, on a thread, kills this process once it is readable.
fn watch(pid: i32) -> Result<bool, String> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; no memory
    // is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            // The launcher has already gone: as the kernel would have done.
            Some(libc::ESRCH) => {
                kill_self();
                Ok(true)
            }
            Some(libc::ENOSYS) => Ok(false),
            _ => Err(format!(
                "cannot watch the launcher (pid {pid} in {DDP_LAUNCHER_PID}): {e}"
            )),
        };
    }
    let fd = fd as libc::c_int;
    std::thread::Builder::new()
        .name("ddp-launcher-watch".into())
        .spawn(move || loop {
            let mut poll = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, for a descriptor this thread owns and never closes.
            let ready = unsafe { libc::poll(&mut poll, 1, -1) };
            if ready > 0 {
                kill_self();
            }
            if ready < 0
                && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                // poll cannot fail on one valid descriptor but for EINTR; should it, keep the
                // rank alive rather than spin.
                return;
            }
        })
        .map(|_| true)
        .map_err(|e| format!("cannot start the thread that watches the launcher: {e}"))
}

fn kill_self() {
    // SAFETY: kill(2) on this process; no memory is involved.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
}
