//! Private temporary folders beside what jobs share (the synthetic sample in `.cache/`, a
//! build's binary link in the target folder's `xtask/bin/`), and the sweep of those that a
//! process cut short left behind.

use std::path::{Path, PathBuf};

/// A new temporary folder's path in `dir`: `.tmp-<pid>-<nanoseconds>-<pid namespace>-<host>`.
pub fn temporary(dir: &Path) -> PathBuf {
    dir.join(format!(
        ".tmp-{}-{}-{}-{}",
        std::process::id(),
        time::OffsetDateTime::now_utc().unix_timestamp_nanos(),
        pid_namespace().unwrap_or_default(),
        hostname()
    ))
}

/// A folder removed, with what it holds, when the guard drops.
pub struct RemoveOnDrop(pub PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The number of this process's pid namespace (`/proc/self/ns/pid` is `pid:[<number>]`), in
/// which the pids of [`temporary`] folders are read: containers that share a host name and a
/// folder but not their pids must not judge each other's.
fn pid_namespace() -> Option<String> {
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let number = link.to_str()?.strip_prefix("pid:[")?.strip_suffix(']')?;
    is_number(number).then(|| number.to_owned())
}

fn is_number(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// Whether `/proc` shows this process's pid namespace: not so without `/proc`, or where a
/// process entered a new pid namespace and kept the old namespace's `/proc`.
fn proc_is_own() -> bool {
    let own = std::fs::read_link("/proc/self").ok();
    own.and_then(|p| p.to_str()?.parse::<u32>().ok()) == Some(std::process::id())
}

/// This machine's name, which [`temporary`] folders carry: on a folder shared between
/// hosts, only this host can tell whether a temporary's process is gone.
fn hostname() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    name.trim().to_owned()
}

/// Removes the [`temporary`] folders in `dir` that a process cut short left (a generation of
/// the synthetic sample, a build's binary link): this host's, whose process is gone from this
/// pid namespace, named with it (or in the older form without one,
/// `.tmp-<pid>-<nanoseconds>-<host>`). Returns them. Where `/proc` does not show this pid
/// namespace, none.
pub fn remove_stale(dir: &Path) -> Vec<PathBuf> {
    let host = hostname();
    let Some(namespace) = pid_namespace().filter(|_| proc_is_own()) else {
        return Vec::new();
    };
    let stale = |name: &str| {
        let mut parts = name
            .strip_prefix(".tmp-")
            .unwrap_or_default()
            .splitn(3, '-');
        let (Some(pid), Some(_), Some(rest)) = (parts.next(), parts.next(), parts.next()) else {
            return false;
        };
        let ours = match rest.split_once('-') {
            Some((its_namespace, its_host)) if is_number(its_namespace) => {
                its_namespace == namespace && its_host == host
            }
            _ => rest == host,
        };
        ours && pid
            .parse::<u32>()
            .is_ok_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
    };
    let mut removed = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if entry.file_name().to_str().is_some_and(stale) && std::fs::remove_dir_all(&path).is_ok() {
            removed.push(path);
        }
    }
    removed.sort();
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temporaries_of_gone_processes_of_this_host_and_pid_namespace_are_swept() {
        let dir = ddp_testkit::temp_dir("xtask-sweep");
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        gone.wait().unwrap();
        let (host, ns) = (hostname(), pid_namespace().unwrap());
        let (own, dead) = (std::process::id(), gone.id());
        let kept = [
            format!(".tmp-{own}-1-{ns}-{host}"),
            format!(".tmp-{own}-1-{host}"),
            format!(".tmp-{dead}-1-{ns}-elsewhere"),
            format!(".tmp-{dead}-1-elsewhere"),
            format!(".tmp-{dead}-1-{ns}"),
            format!(".tmp-{dead}-1-1{ns}-{host}"),
            format!("synthetic-{dead}-1-{ns}-{host}"),
        ];
        // This namespace's, and one named before namespaces were.
        let swept = [
            format!(".tmp-{dead}-1-{host}"),
            format!(".tmp-{dead}-1-{ns}-{host}"),
        ];
        for name in kept.iter().chain(&swept) {
            std::fs::create_dir_all(dir.path().join(name).join("images")).unwrap();
        }
        let mut expected: Vec<PathBuf> = swept.iter().map(|n| dir.path().join(n)).collect();
        expected.sort();
        assert_eq!(remove_stale(dir.path()), expected);
        let mut kept = kept.to_vec();
        kept.sort();
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, kept);
    }

    #[test]
    fn this_process_sees_its_own_proc() {
        assert!(proc_is_own());
    }
}
