//! Ranks that die with their launcher even when it did not start them itself.
//!
//! The launcher sets `PR_SET_PDEATHSIG` on every process it starts, so a rank it started
//! directly dies with it, however it dies. A rank started through a wrapper (`sh -c 'prog
//! ...; true'`, a job script, `unshare --pid`) is the wrapper's child: the kernel kills the
//! wrapper, and the rank lives on as an orphan holding its port, its GPU and its shared
//! memory. The launcher therefore holds the write end of a pipe, its lifeline, for as long as
//! it lives, and every rank inherits the read end, named in [`DDP_LAUNCHER_LIFELINE`]. A rank
//! that calls [`die_with_launcher`] waits for the end of that pipe, which comes when the
//! launcher's process has gone, and kills itself then. The pipe does not depend on process
//! ids, which a rank in another pid namespace (a container, `unshare --pid`) cannot resolve.
//! Where a wrapper closed the descriptor (`sudo`, Python's `subprocess`), a rank in the
//! launcher's pid namespace watches [`DDP_LAUNCHER_PID`] with a pidfd instead.
//! `ddp-train`'s Trainer calls it; any other rank program may.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;

use crate::LaunchError;

/// The launcher's process id as the launcher sees it, set for every rank it starts
/// ([`die_with_launcher`] watches it where the lifeline did not arrive, if the rank is in
/// the launcher's pid namespace, [`DDP_LAUNCHER_PID_NS`]).
pub const DDP_LAUNCHER_PID: &str = "DDP_LAUNCHER_PID";

/// The launcher's pid namespace, the inode of its `/proc/self/ns/pid`, set for every rank it
/// starts: a rank whose own is the same can resolve [`DDP_LAUNCHER_PID`].
pub const DDP_LAUNCHER_PID_NS: &str = "DDP_LAUNCHER_PID_NS";

/// The launcher's lifeline, set by the launcher for every rank it starts: `FD:INODE`, the
/// descriptor number of the read end of a pipe that the rank inherits, and the pipe's inode
/// (so that a descriptor number reused for another file is not mistaken for it).
pub const DDP_LAUNCHER_LIFELINE: &str = "DDP_LAUNCHER_LIFELINE";

/// The launcher's side of the lifeline: both ends of the pipe, close-on-exec, open until the
/// process exits.
pub(crate) struct Lifeline {
    read: OwnedFd,
    _write: OwnedFd,
    inode: u64,
}

impl Lifeline {
    /// This process's lifeline, created the first time.
    pub(crate) fn get() -> std::io::Result<&'static Lifeline> {
        static LIFELINE: OnceLock<Result<Lifeline, i32>> = OnceLock::new();
        LIFELINE
            .get_or_init(|| Lifeline::open().map_err(|e| e.raw_os_error().unwrap_or(0)))
            .as_ref()
            .map_err(|&errno| std::io::Error::from_raw_os_error(errno))
    }

    fn open() -> std::io::Result<Lifeline> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into the array it is given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded: both descriptors are new and owned by nothing else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let inode = fifo_inode(read.as_raw_fd()).ok_or_else(std::io::Error::last_os_error)?;
        Ok(Lifeline {
            read,
            _write: write,
            inode,
        })
    }

    /// The read end, which a rank must inherit (its close-on-exec flag cleared in the child).
    pub(crate) fn read_end(&self) -> RawFd {
        self.read.as_raw_fd()
    }

    /// Gives `rank` [`DDP_LAUNCHER_LIFELINE`], [`DDP_LAUNCHER_PID`] and, where `/proc` tells
    /// it, [`DDP_LAUNCHER_PID_NS`].
    pub(crate) fn name_in(&self, rank: &mut std::process::Command) {
        let lifeline = format!("{}:{}", self.read.as_raw_fd(), self.inode);
        rank.env(DDP_LAUNCHER_LIFELINE, lifeline)
            .env(DDP_LAUNCHER_PID, std::process::id().to_string());
        if let Some(ns) = pid_namespace() {
            rank.env(DDP_LAUNCHER_PID_NS, ns.to_string());
        }
    }
}

/// This process's pid namespace: the inode of `/proc/self/ns/pid`.
fn pid_namespace() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

/// Kills this process (SIGKILL, as `PR_SET_PDEATHSIG` does for a directly started rank) as
/// soon as the launcher that started it, directly or through wrappers, has exited, from a
/// thread that waits for the end of the launcher's pipe named in [`DDP_LAUNCHER_LIFELINE`].
/// Where the descriptor it names did not reach this process (a wrapper that closes inherited
/// descriptors, as `sudo` does), it watches [`DDP_LAUNCHER_PID`] with a pidfd instead, when
/// this process is in the launcher's pid namespace. The watch keeps a descriptor of its own:
/// the program may close the inherited one. Returns whether a watch is in place: `false`
/// without the variable (not started by this launcher), or when neither way is open (another
/// pid namespace, a kernel without `pidfd_open`). Calling it again returns the first call's
/// answer. If the launcher has already exited, the process is killed at once.
///
/// Fails with [`LaunchError::Invalid`] when the variable is not `FD:INODE`.
pub fn die_with_launcher() -> Result<bool, LaunchError> {
    static WATCH: OnceLock<Result<bool, String>> = OnceLock::new();
    WATCH
        .get_or_init(|| match std::env::var(DDP_LAUNCHER_LIFELINE) {
            Err(std::env::VarError::NotPresent) => Ok(false),
            Err(std::env::VarError::NotUnicode(v)) => Err(bad(&v.to_string_lossy())),
            Ok(v) => match parse(&v) {
                Some((fd, inode)) if fifo_inode(fd) == Some(inode) => watch_pipe(fd),
                Some(_) => watch_launcher_pid(),
                None => Err(bad(&v)),
            },
        })
        .clone()
        .map_err(LaunchError::Invalid)
}

fn parse(value: &str) -> Option<(RawFd, u64)> {
    let (fd, inode) = value.split_once(':')?;
    Some((fd.parse().ok().filter(|&fd| fd >= 0)?, inode.parse().ok()?))
}

fn bad(value: &str) -> String {
    format!(
        "{DDP_LAUNCHER_LIFELINE} is `{value}`, not a launcher's lifeline (FD:INODE): it is set \
         by ddp-run for the ranks it starts; unset it when starting a rank by hand"
    )
}

/// The inode of `fd` when it is an open pipe.
fn fifo_inode(fd: RawFd) -> Option<u64> {
    // SAFETY: fstat fills the zeroed stat it is given; a closed descriptor is EBADF.
    let stat = unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        (libc::fstat(fd, &mut stat) == 0).then_some(stat)
    }?;
    (stat.st_mode & libc::S_IFMT == libc::S_IFIFO).then_some(stat.st_ino)
}

/// Watches the pipe `fd` through a descriptor of its own.
fn watch_pipe(fd: RawFd) -> Result<bool, String> {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an open descriptor returns a new one or -1.
    let own = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if own < 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!(
            "cannot watch the launcher's lifeline (descriptor {fd}): {e}"
        ));
    }
    // SAFETY: fcntl just returned this descriptor, owned by nothing else.
    watch(unsafe { OwnedFd::from_raw_fd(own) })
}

/// Watches [`DDP_LAUNCHER_PID`] with a pidfd, where this process is in the launcher's pid
/// namespace ([`DDP_LAUNCHER_PID_NS`]) and the kernel has `pidfd_open` (Linux 5.3).
fn watch_launcher_pid() -> Result<bool, String> {
    let var = |name| std::env::var(name).unwrap_or_default();
    let pid = var(DDP_LAUNCHER_PID).parse::<libc::pid_t>().ok();
    let ns = var(DDP_LAUNCHER_PID_NS).parse::<u64>().ok();
    let pid = match pid {
        Some(pid) if pid > 0 && ns.is_some() && ns == pid_namespace() => pid,
        _ => return Ok(false),
    };
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
            // No pidfd_open (ENOSYS; EPERM under older seccomp profiles) or no descriptor
            // left: unwatched, as without the variables; the start does not fail on it.
            _ => Ok(false),
        };
    }
    // SAFETY: pidfd_open just returned this descriptor (close-on-exec), owned by nothing else.
    watch(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Kills this process once `fd`, a pipe with no writer left or a pidfd of an exited
/// process, is ready: at once if so already, else from a thread that owns `fd`.
fn watch(fd: OwnedFd) -> Result<bool, String> {
    if launcher_gone(fd.as_raw_fd(), 0) == Some(true) {
        kill_self();
    }
    std::thread::Builder::new()
        .name("ddp-launcher-watch".into())
        .spawn(move || {
            // poll cannot fail on one valid descriptor but for EINTR; should it, the rank
            // stays alive rather than spin.
            if launcher_gone(fd.as_raw_fd(), -1) == Some(true) {
                kill_self();
            }
        })
        .map(|_| true)
        .map_err(|e| format!("cannot start the thread that watches the launcher: {e}"))
}

/// Whether `fd` is ready within `timeout_ms` (-1: no limit); `None` if poll fails or the
/// descriptor is no longer open (`POLLNVAL`: no watch, rather than a launcher gone).
fn launcher_gone(fd: RawFd, timeout_ms: libc::c_int) -> Option<bool> {
    loop {
        let mut poll = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, for a descriptor the caller owns.
        let ready = unsafe { libc::poll(&mut poll, 1, timeout_ms) };
        if ready >= 0 {
            return (poll.revents & libc::POLLNVAL == 0).then_some(ready > 0);
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return None;
        }
    }
}

fn kill_self() {
    // SAFETY: kill(2) on this process, then _exit(2): no memory is involved.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
        // The first process of a pid namespace (a rank under `unshare --pid --fork`) ignores
        // its own SIGKILL: it ends as a shell reports a process killed so.
        libc::_exit(128 + libc::SIGKILL);
    }
}
