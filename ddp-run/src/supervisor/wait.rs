//! Seeing a rank's exit without reaping it (`waitid` with `WNOWAIT`): until the launcher
//! reaps a rank, its pid, and so its process group's number, cannot be reused.

use super::Exit;

/// The exit of `pid`, if it has exited, without reaping it.
pub(super) fn peek_exit(pid: u32) -> std::io::Result<Option<Exit>> {
    wait_exit(pid, libc::WNOHANG)
}

/// The exit of `pid`, without reaping it: waiting for it, or with `flags` `WNOHANG`, `None`
/// while it runs.
pub(super) fn wait_exit(pid: u32, flags: libc::c_int) -> std::io::Result<Option<Exit>> {
    loop {
        // SAFETY: a zeroed siginfo_t is a valid out-parameter for waitid; WNOWAIT leaves
        // the child waitable, so std's `Child` still owns reaping it.
        let (result, info) = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let r = libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT | flags,
            );
            (r, info)
        };
        if result != 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        // SAFETY: waitid filled `info` for a child state change (or left si_pid 0).
        let (child, status) = unsafe { (info.si_pid(), info.si_status()) };
        if child == 0 {
            return Ok(None);
        }
        return Ok(Some(match info.si_code {
            libc::CLD_EXITED => Exit::Code(status),
            _ => Exit::Signal(status),
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::{Duration, Instant};

    #[test]
    fn an_exit_is_seen_without_reaping() {
        let mut child = Command::new("sh").args(["-c", "exit 5"]).spawn().unwrap();
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(30);
        let exit = loop {
            if let Some(e) = peek_exit(pid).unwrap() {
                break e;
            }
            assert!(Instant::now() < deadline, "sh did not exit");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(exit, Exit::Code(5));
        // Still unreaped: seen again, then reaped by std.
        assert_eq!(peek_exit(pid).unwrap(), Some(Exit::Code(5)));
        assert_eq!(child.wait().unwrap().code(), Some(5));
    }
}
