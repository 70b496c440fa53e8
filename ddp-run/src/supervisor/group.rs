//! What is left of a rank's process group once the rank's own process has exited: a
//! wrapper's program still writing its checkpoint, a helper it started, or only zombies.

use std::time::{Duration, Instant};

/// The signals that a non-interactive shell's background jobs ignore (POSIX: an
/// asynchronous list's SIGINT and SIGQUIT): what such a helper left in a rank's group did
/// not get, so that it needs SIGTERM to stop.
pub(super) const IGNORED_IN_BACKGROUND: [i32; 2] = [libc::SIGINT, libc::SIGQUIT];

/// Sends `signal` to the process group of the rank whose pid is `pid`.
pub(super) fn kill_group(pid: u32, signal: i32) {
    // SAFETY: kill(2) on a rank's group, which keeps its number while the rank is unreaped
    // or anything is left in it; ESRCH (nothing left) is fine.
    unsafe {
        libc::kill(-(pid as libc::pid_t), signal);
    }
}

/// How many processes of group `group`, whose leader has exited and been reaped, are left
/// running: zombies (dead, waiting for a parent that may never reap them, as a container's
/// entrypoint that is no init) do not count. Reaps first the group's processes that are
/// this process's own children (orphans adopted by a launcher that is its pid namespace's
/// first process). Where `/proc` is another pid namespace's and cannot tell zombies apart,
/// any process that `kill` finds in the group counts, as 1.
pub(super) fn running(group: u32) -> usize {
    // SAFETY: waitid with WNOHANG on this process's own children of the group (its leader is
    // reaped already), into a zeroed siginfo_t.
    while unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let flags = libc::WEXITED | libc::WNOHANG;
        libc::waitid(libc::P_PGID, group as libc::id_t, &mut info, flags) == 0 && info.si_pid() != 0
    } {}
    // SAFETY: kill(2) with signal 0 only checks for the group's processes.
    if unsafe { libc::kill(-(group as libc::pid_t), 0) } != 0
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return 0;
    }
    if !proc_is_this_namespaces() {
        return 1;
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 1;
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| state_and_group(pid).is_some_and(|(s, g)| g == group && s != 'Z'))
        .count()
}

/// Waits, at most `most`, until nothing is left running ([`running`]) in any of `groups`,
/// whose leaders have exited and been reaped; the groups where something still runs then,
/// each with how many.
pub(super) fn left_after(groups: &[u32], most: Duration) -> Vec<(u32, usize)> {
    let deadline = Instant::now().checked_add(most);
    let mut left: Vec<(u32, usize)> = groups.iter().map(|&g| (g, 0)).collect();
    loop {
        // A group found empty is done with: its number may be reused by another group.
        left = left
            .into_iter()
            .map(|(g, _)| (g, running(g)))
            .filter(|&(_, n)| n > 0)
            .collect();
        if left.is_empty() || deadline.is_some_and(|d| Instant::now() >= d) {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `/proc` numbers processes as this process does (it may be mounted for an outer
/// pid namespace, as under `unshare --pid` without `--mount-proc`).
fn proc_is_this_namespaces() -> bool {
    let own = std::fs::read_link("/proc/self").ok();
    own.is_some_and(|p| p.to_str() == Some(std::process::id().to_string().as_str()))
}

/// The state (`R`, `S`, `Z`, ...) and process group of process `pid`, from its
/// `/proc/<pid>/stat`: `pid (comm) state ppid pgrp ...`, where `comm` may hold anything,
/// bytes that are not UTF-8 included (a name cut at 15 bytes inside a character).
fn state_and_group(pid: u32) -> Option<(char, u32)> {
    stat_state_and_group(&std::fs::read(format!("/proc/{pid}/stat")).ok()?)
}

fn stat_state_and_group(stat: &[u8]) -> Option<(char, u32)> {
    let end = stat.windows(2).rposition(|w| w == b") ")?;
    let rest = std::str::from_utf8(&stat[end + 2..]).ok()?;
    let mut fields = rest.split(' ');
    let state = fields.next()?.chars().next()?;
    Some((state, fields.nth(1)?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddp_testkit::procs::group as members;
    use std::os::unix::process::CommandExt;
    use std::process::Command;
    use std::time::{Duration, Instant};

    /// A name that is not UTF-8 (cut inside a character) or holds `) ` is still read.
    #[test]
    fn a_stat_line_whose_name_is_not_utf8_is_read() {
        let mut stat = b"4242 (\xd0\xbe\xd0) x) S 1 4200 4200 0 -1".to_vec();
        assert!(std::str::from_utf8(&stat).is_err());
        assert_eq!(stat_state_and_group(&stat), Some(('S', 4200)));
        stat = b"7 (sh) Z 1 7 7".to_vec();
        assert_eq!(stat_state_and_group(&stat), Some(('Z', 7)));
        assert_eq!(stat_state_and_group(b"7 (sh"), None);
    }

    /// A group of a running leader and a zombie, its child, which it never waits for; then,
    /// once the leader is killed, nothing running, whether its new parent reaps the zombie
    /// or not.
    #[test]
    fn zombies_in_a_group_are_not_running() {
        // The child exits once its parent is `sleep` (or gone): one that exited at once
        // could be reaped by `sh` before its `exec`.
        let child = r#"(while c=$(cat /proc/$$/comm 2>/dev/null) && [ "$c" != sleep ];
            do sleep 0.01; done) &"#;
        let mut leader = Command::new("sh")
            .args(["-c", &format!("{child} exec sleep 60")])
            .process_group(0)
            .spawn()
            .unwrap();
        let group = leader.id();
        let deadline = Instant::now() + Duration::from_secs(30);
        // Two members, one a zombie: the child's own children (its `cat`, its `sleep`) are
        // zombies for a moment too, while it still runs.
        let zombie = |m: &[(u32, String)]| m.len() == 2 && m.iter().any(|(_, s)| s == "Z");
        while !zombie(&members(group)) {
            assert!(
                Instant::now() < deadline,
                "no zombie in {:?}",
                members(group)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(members(group).len(), 2);
        assert_eq!(running(group), 1);
        leader.kill().unwrap();
        leader.wait().unwrap();
        while running(group) != 0 {
            assert!(Instant::now() < deadline, "{:?}", members(group));
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A group whose process runs on is named after the wait; once its process is killed,
    /// the wait lasts until it is gone (dead: a zombie does not count).
    #[test]
    fn the_wait_for_a_group_ends_once_it_is_empty() {
        let mut sleep = Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .unwrap();
        let group = sleep.id();
        assert_eq!(
            left_after(&[group], Duration::from_millis(100)),
            [(group, 1)]
        );
        // SAFETY: kill(2) on this test's own child, unreaped: its pid is still its own.
        assert_eq!(
            unsafe { libc::kill(group as libc::pid_t, libc::SIGKILL) },
            0
        );
        assert_eq!(left_after(&[group], Duration::from_secs(60)), Vec::new());
        // Reaped by `running` (this test's child, in the group), or a zombie until here.
        let _ = sleep.wait();
    }

    #[test]
    fn a_process_state_and_group_are_read_from_proc() {
        let mut sleep = Command::new("sleep")
            .arg("60")
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = sleep.id();
        let deadline = Instant::now() + Duration::from_secs(30);
        while state_and_group(pid) != Some(('S', pid)) {
            assert!(Instant::now() < deadline, "{:?}", state_and_group(pid));
            std::thread::sleep(Duration::from_millis(10));
        }
        sleep.kill().unwrap();
        sleep.wait().unwrap();
        assert_eq!(state_and_group(pid), None);
        assert!(proc_is_this_namespaces());
    }
}
