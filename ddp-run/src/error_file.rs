//! torchrun's error files: how the launcher learns which rank's failure came first.
//!
//! A rank that fails tears down its links as it exits, so its peers fail too, and one of them
//! may exit before it: the first rank to exit is not always the cause. As torchrun's agent
//! does, the launcher gives each rank a file of its own in
//! [`TORCHELASTIC_ERROR_FILE`](crate::env::TORCHELASTIC_ERROR_FILE), a rank writes its error
//! there with the time the error arose ([`record_error`], what PyTorch's `@record` does), and
//! once the failed attempt has stopped the launcher names the failed rank whose error came
//! first ([`first_failure`]); a rank without a file counts from its exit (torchrun's
//! `ProcessFailure`).

use std::ffi::CStr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustix::fs::{self, AtFlags, Dir, FileType, FlockOperation, Mode, OFlags};
use rustix::io::Errno;
use rustix::process::{self, Pid};
use serde_json::{json, Value};

use crate::env::TORCHELASTIC_ERROR_FILE;

/// A rank's error as it recorded it in its error file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RecordedError {
    /// What the rank said.
    pub(crate) message: String,
    /// When the error arose.
    pub(crate) at: SystemTime,
}

/// Writes `message`, an error that arose at `at`, to the file that
/// [`TORCHELASTIC_ERROR_FILE`](crate::env::TORCHELASTIC_ERROR_FILE) names, as PyTorch's
/// `@record` does, so that the launcher (`ddp-run`, or torchrun's agent) can tell the rank
/// whose error came first. Take `at` before the program tears down what its peers depend on
/// (its process group): they fail once it does. Returns the file written, `None` where no
/// launcher asked for one.
pub fn record_error(message: &str, at: SystemTime) -> std::io::Result<Option<PathBuf>> {
    let Some(path) = std::env::var_os(TORCHELASTIC_ERROR_FILE).filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    let path = PathBuf::from(path);
    std::fs::write(&path, error_json(message, at))?;
    Ok(Some(path))
}

/// torchrun's shape of an error file (`ErrorHandler.record_exception`): the message, and in
/// `extraInfo` the time in whole seconds, which torchrun's agent reads, and in nanoseconds,
/// which tells apart failures in the same second.
fn error_json(message: &str, at: SystemTime) -> String {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    json!({
        "message": {
            "message": message,
            "extraInfo": {
                "timestamp": since.as_secs().to_string(),
                "timestamp_ns": since.as_nanos().to_string(),
            },
        }
    })
    .to_string()
}

/// The error in an error file's text, in torchrun's shape (or its newer one, a string message
/// beside a `timestamp`); `None` for anything else.
fn parse(text: &str) -> Option<RecordedError> {
    let data: Value = serde_json::from_str(text).ok()?;
    let (message, time) = match &data["message"] {
        Value::String(message) => (message.clone(), &data),
        Value::Object(m) => (m.get("message")?.as_str()?.to_owned(), m.get("extraInfo")?),
        _ => return None,
    };
    let number = |key: &str| time[key].as_str()?.trim().parse::<u128>().ok();
    // Whole seconds (PyTorch's `@record`) read as the end of their second: the error may
    // have come at any time in it, so it wins against an exit or a record within that
    // second only when no other rank's failure could have come earlier.
    let since = match (number("timestamp_ns"), number("timestamp")) {
        (Some(ns), _) => Duration::from_nanos(u64::try_from(ns).ok()?),
        (None, Some(s)) => Duration::new(u64::try_from(s).ok()?, 999_999_999),
        (None, None) => return None,
    };
    Some(RecordedError {
        message,
        at: UNIX_EPOCH.checked_add(since)?,
    })
}

/// The error a rank recorded in `path`, if it wrote one that reads.
pub(crate) fn read(path: &Path) -> Option<RecordedError> {
    parse(&std::fs::read_to_string(path).ok()?)
}

/// A failed rank, as the launcher saw it end.
pub(crate) struct Failed {
    /// When it exited.
    pub(crate) exited: SystemTime,
    /// The error it recorded, if any.
    pub(crate) recorded: Option<RecordedError>,
    /// Whether a signal that the launcher did not send killed it: the OOM killer, a
    /// segfault, an abort.
    pub(crate) crashed: bool,
}

/// How long after the earliest recorded error a rank that failed without a record may exit
/// and still be its cause: its peers record the closed connection as it exits, within
/// milliseconds; one seen minutes later failed for want of the recorded rank (an NCCL
/// watchdog's abort while that rank hangs in its exit).
pub(crate) const UNRECORDED_WINDOW: Duration = Duration::from_secs(5);

/// Of failed ranks, the one whose failure came first; its index among them. A rank that
/// recorded no error tears down its links only as it exits, so its peers record theirs
/// (a closed connection) before it is seen to fail: the first rank that crashed without a
/// record is the cause; else the first to exit, where it recorded nothing; else the earliest
/// recorded error (its peers may have failed for want of it before it exited), a rank without
/// one counting from its exit. A rank without a record is named over one that recorded only
/// when it exited within [`UNRECORDED_WINDOW`] after the earliest record. In a tie, the first
/// to exit, then the first given.
pub(crate) fn first_failure(failed: &[Failed]) -> Option<usize> {
    let first = |key: &dyn Fn(&Failed) -> Option<SystemTime>| {
        let keyed = failed.iter().enumerate();
        let keyed = keyed.filter_map(|(i, f)| Some((key(f)?, f.exited, i)));
        keyed.min().map(|(_, _, i)| i)
    };
    // An error arose before its rank exited (a whole second's end may lie after it).
    let arose = |f: &Failed| f.recorded.as_ref().map(|r| r.at.min(f.exited));
    let earliest_record = failed.iter().filter_map(arose).min();
    let unrecorded = |f: &Failed| {
        f.recorded.is_none() && earliest_record.is_none_or(|at| f.exited <= at + UNRECORDED_WINDOW)
    };
    if let Some(crash) = first(&|f| (f.crashed && unrecorded(f)).then_some(f.exited)) {
        return Some(crash);
    }
    let exited = first(&|f| Some(f.exited))?;
    if unrecorded(&failed[exited]) {
        return Some(exited);
    }
    first(&|f| Some(arose(f).unwrap_or(f.exited)))
}

/// The start of an error folder's name: `ddp-run-<host>-<pid>-<16 hex digits>`, the host
/// as [`this_host`] gives it (older launchers wrote `ddp-run-<pid>-<16 hex digits>`).
const FOLDER_PREFIX: &str = "ddp-run-";

/// The most bytes of the host's name that a folder's name carries: a whole Linux host name
/// (at most 64), since cut ones can be alike (a node pool's names share a long prefix) and
/// the sweep would take another host's folder for this host's.
const HOST_MAX: usize = 64;

/// A rank's error file's name: `rank-<N>.error.json`.
const RECORD_NAME: (&str, &str) = ("rank-", ".error.json");

/// One attempt's error files: a folder only this user can enter (mode 0700) in the temporary
/// folder, with one file per rank, removed with what is in it when dropped. The launcher
/// holds a shared `flock` on it while it lives, which the kernel drops however it dies.
pub(crate) struct ErrorFolder {
    dir: PathBuf,
    /// The folder, open and locked.
    _lock: Option<std::fs::File>,
}

impl ErrorFolder {
    /// A new, empty folder in the temporary folder, made after removing the folders that
    /// launchers which died without unwinding left there ([`remove_stale`]).
    pub(crate) fn create() -> std::io::Result<Self> {
        Self::create_in(&std::env::temp_dir())
    }

    /// A new, empty folder in `parent`, after removing the stale ones there.
    fn create_in(parent: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        remove_stale(parent);
        let mut bytes = [0u8; 8];
        getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let (host, pid) = (this_host(), std::process::id());
        let dir = parent.join(format!("{FOLDER_PREFIX}{host}-{pid}-{hex}"));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let lock = std::fs::File::open(&dir).ok();
        // Where it cannot, or the file system has no locks, the launcher's pid alone tells
        // that it lives.
        if let Some(lock) = &lock {
            let _ = fs::flock(lock, FlockOperation::NonBlockingLockShared);
        }
        Ok(ErrorFolder { dir, _lock: lock })
    }

    /// The warning that there is no folder for the error files, `error` said why.
    pub(crate) fn unavailable(error: &std::io::Error) -> String {
        format!(
            "cannot create a folder for the ranks' error files in {} ({error}): the ranks get \
             no TORCHELASTIC_ERROR_FILE, and a failure names the first rank killed by a signal \
             the launcher did not send, else the first rank to exit",
            std::env::temp_dir().display()
        )
    }

    /// Rank `rank`'s error file.
    pub(crate) fn path(&self, rank: usize) -> PathBuf {
        let (start, end) = RECORD_NAME;
        self.dir.join(format!("{start}{rank}{end}"))
    }
}

impl Drop for ErrorFolder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Removes from `parent` the error folders that launchers left there when they died without
/// unwinding (SIGKILL, the OOM killer): this user's folders (never a link, which is not
/// followed) named as an [`ErrorFolder`] is, this host's (or of no host, as older launchers
/// named them), whose pid no process has, that no one holds locked, and that hold only rank
/// error files. Anything else in a folder keeps it. Another host's folder stays: on a
/// temporary folder that hosts share (NFS), its pid is another machine's, and a lock on a
/// folder there is only this host's. Failures keep what they meet: a launch never fails for
/// this. Of two launchers that start at once, one locks a stale folder and removes it; the
/// other's calls fail (the lock, or ENOENT where the file system has no locks), which it
/// ignores.
fn remove_stale(parent: &Path) {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let Ok(parent) = fs::open(parent, flags, Mode::empty()) else {
        return;
    };
    let Ok(entries) = Dir::read_from(&parent) else {
        return;
    };
    let (uid, host) = (process::geteuid().as_raw(), this_host());
    for entry in entries.flatten() {
        let name = entry.file_name();
        let ours = |(its, _): &(Option<&[u8]>, Pid)| its.is_none_or(|its| its == host.as_bytes());
        if launcher(name.to_bytes())
            .filter(ours)
            .is_some_and(|(_, pid)| gone(pid))
        {
            let _ = remove_records(&parent, name, uid);
        }
    }
}

/// Removes the folder `name` in `parent` where it is one of `uid`'s, unlocked, that holds
/// only regular files named as rank error files.
fn remove_records(parent: &OwnedFd, name: &CStr, uid: u32) -> rustix::io::Result<()> {
    // O_NOFOLLOW: a link that anyone planted under such a name is left as it is.
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let dir = fs::openat(parent, name, flags, Mode::empty())?;
    // A live launcher holds its folder locked, one in another pid namespace too (a container
    // sharing this temporary folder), where its pid says nothing.
    if fs::fstat(&dir)?.st_uid != uid
        || fs::flock(&dir, FlockOperation::NonBlockingLockExclusive).is_err()
    {
        return Ok(());
    }
    let mut records = Vec::new();
    for entry in Dir::read_from(&dir)? {
        let file = entry?.file_name().to_owned();
        if matches!(file.to_bytes(), b"." | b"..") {
            continue;
        }
        let kind =
            FileType::from_raw_mode(fs::statat(&dir, &file, AtFlags::SYMLINK_NOFOLLOW)?.st_mode);
        if kind != FileType::RegularFile || !is_record(file.to_bytes()) {
            return Ok(());
        }
        records.push(file);
    }
    for file in records {
        fs::unlinkat(&dir, &file, AtFlags::empty())?;
    }
    fs::unlinkat(parent, name, AtFlags::REMOVEDIR)
}

/// The launcher's host (`None` in an older launcher's name, which has none) and pid in an
/// error folder's name, where `name` is one.
fn launcher(name: &[u8]) -> Option<(Option<&[u8]>, Pid)> {
    let rest = name.strip_prefix(FOLDER_PREFIX.as_bytes())?;
    let dash = rest.iter().rposition(|&b| b == b'-')?;
    let (head, hex) = (&rest[..dash], &rest[dash + 1..]);
    let hex_digits = hex.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    // The host's name may hold dashes; the pid holds none.
    let (host, pid) = match head.iter().rposition(|&b| b == b'-') {
        Some(dash) => (Some(&head[..dash]), &head[dash + 1..]),
        None => (None, head),
    };
    let pid = Pid::from_raw(i32::try_from(decimal(pid)?).ok()?)?;
    (hex.len() == 16 && hex_digits).then_some((host, pid))
}

/// This host's name as error folders carry it: only `[A-Za-z0-9.-]`, at most [`HOST_MAX`]
/// bytes; `localhost` where none is left.
fn this_host() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let kept = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-'));
    let host: String = kept.take(HOST_MAX).collect();
    if host.is_empty() {
        "localhost".into()
    } else {
        host
    }
}

/// Whether `name` is a rank's error file's, as [`ErrorFolder::path`] names them.
fn is_record(name: &[u8]) -> bool {
    let (start, end) = RECORD_NAME;
    let rank = name
        .strip_prefix(start.as_bytes())
        .and_then(|r| r.strip_suffix(end.as_bytes()));
    rank.and_then(decimal).is_some()
}

/// The number that `digits` spell, only decimal digits (no sign), at least one.
fn decimal(digits: &[u8]) -> Option<u64> {
    let all = !digits.is_empty() && digits.iter().all(u8::is_ascii_digit);
    all.then(|| std::str::from_utf8(digits).ok()?.parse().ok())?
}

/// Whether no process runs as `pid`. A live process keeps the folder, even one that reused a
/// dead launcher's pid (kill cannot tell them apart): that folder waits for a later launch.
fn gone(pid: Pid) -> bool {
    process::test_kill_process(pid) == Err(Errno::SRCH)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// What a rank writes reads as torchrun's agent reads it (`ProcessFailure`: the
    /// message's `message`, and `int(extraInfo.timestamp)`), and back here to the nanosecond.
    #[test]
    fn an_error_file_has_torchruns_shape() {
        let at = UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
        let text = error_json("checkpoint 'a': Is a directory (os error 21)", at);
        let data: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            data,
            json!({"message": {
                "message": "checkpoint 'a': Is a directory (os error 21)",
                "extraInfo": {
                    "timestamp": "1700000000",
                    "timestamp_ns": "1700000000123456789",
                },
            }})
        );
        let read = parse(&text).unwrap();
        assert_eq!(read.message, "checkpoint 'a': Is a directory (os error 21)");
        assert_eq!(read.at, at);
        // As PyTorch's `@record` writes it, whole seconds only; and its newer shape.
        let python = r#"{"message": {"message": "ValueError: bad", "extraInfo":
            {"py_callstack": "Traceback ...", "timestamp": "1700000001"}}}"#;
        let newer = r#"{"message": "RuntimeError: nccl", "timestamp": "1700000002"}"#;
        // Read as the end of their second.
        let secs = |s| UNIX_EPOCH + Duration::new(s, 999_999_999);
        assert_eq!(
            parse(python),
            Some(RecordedError {
                message: "ValueError: bad".into(),
                at: secs(1_700_000_001)
            })
        );
        assert_eq!(parse(newer).map(|r| r.at), Some(secs(1_700_000_002)));
        for broken in [
            "",
            "{",
            r#"{"message": {"message": "x"}}"#,
            r#"{"message": 3}"#,
        ] {
            assert_eq!(parse(broken), None, "{broken}");
        }
    }

    /// A failed rank that exited at `exited` ms, recorded `recorded` and crashed or not.
    fn failed(exited: u64, recorded: Option<&RecordedError>, crashed: bool) -> Failed {
        let recorded = recorded.cloned();
        Failed {
            exited: t(exited),
            recorded,
            crashed,
        }
    }

    fn t(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(1_700_000_000_000 + ms)
    }

    fn error(ms: u64) -> RecordedError {
        RecordedError {
            message: String::new(),
            at: t(ms),
        }
    }

    /// The earliest error names the cause, though its rank exited last, when the first rank
    /// to exit recorded one; a rank that recorded nothing counts from its exit; in a tie, the
    /// first to exit, then the first given.
    #[test]
    fn the_earliest_error_is_the_first_failure() {
        let (cause, victim) = (error(100), error(130));
        // Rank 1 (the victim) exited first, at 140; rank 0 (the cause) at 190.
        let failed_ = [
            failed(140, Some(&victim), false),
            failed(190, Some(&cause), false),
        ];
        assert_eq!(first_failure(&failed_), Some(1));
        // Another that recorded nothing and exited after the first counts from its exit: 150
        // is after the cause's 100.
        let later = [
            failed(140, Some(&victim), false),
            failed(150, None, false),
            failed(190, Some(&cause), false),
        ];
        assert_eq!(first_failure(&later), Some(2));
        // An error recorded after its rank's exit (a whole second's end) counts from the exit.
        let (end_of_second, early) = (error(900), error(160));
        let capped = [
            failed(150, Some(&early), false),
            failed(120, Some(&end_of_second), false),
        ];
        assert_eq!(first_failure(&capped), Some(1));
        // Equal times: the first to exit, then the first given.
        let same = error(100);
        let tied = [
            failed(150, Some(&same), false),
            failed(140, Some(&same), false),
        ];
        assert_eq!(first_failure(&tied), Some(1));
        assert_eq!(
            first_failure(&[failed(5, None, false), failed(5, None, false)]),
            Some(0)
        );
        assert_eq!(first_failure(&[]), None);
    }

    /// A rank that fails without recording (a panic without a hook, exit 101) is seen only
    /// at its exit, after its peers recorded the closed connection: the first rank to exit
    /// is the cause when it recorded nothing. A crash (a signal the launcher did not send)
    /// without a record is the cause even when a rank that recorded exited before it.
    #[test]
    fn a_rank_that_failed_without_a_record_is_the_cause() {
        let closed = error(110);
        // Rank 0 panicked and exited at 300; rank 1 recorded at 110 and exited at 400.
        let panicked = [failed(300, None, false), failed(400, Some(&closed), false)];
        assert_eq!(first_failure(&panicked), Some(0));
        // Rank 0 was killed by the OOM killer, seen at 300; rank 1 recorded at 110 and
        // exited at 200, before it.
        let killed = [failed(300, None, true), failed(200, Some(&closed), false)];
        assert_eq!(first_failure(&killed), Some(0));
        // A crash that recorded its error is timed by its record, as any.
        let crash_record = error(150);
        let recorded = [
            failed(300, Some(&crash_record), true),
            failed(200, Some(&closed), false),
        ];
        assert_eq!(first_failure(&recorded), Some(1));
        // Of two crashes, the first to exit.
        let crashes = [
            failed(250, None, true),
            failed(200, Some(&closed), false),
            failed(240, None, true),
        ];
        assert_eq!(first_failure(&crashes), Some(2));
    }

    /// A rank without a record is named over a recorded error only when it exited within
    /// the window after it: a Python rank recorded at 100 and hangs in its exit; its peers'
    /// NCCL watchdogs abort them (SIGABRT, no record) minutes later.
    #[test]
    fn an_unrecorded_failure_long_after_a_record_is_not_the_cause() {
        let window = UNRECORDED_WINDOW.as_millis() as u64;
        let cause = error(100);
        let within = [
            failed(100 + window, None, true),
            failed(100 + window + 50, Some(&cause), false),
        ];
        assert_eq!(first_failure(&within), Some(0));
        let aborted = [
            failed(100 + window + 1, None, true),
            failed(100 + window + 50, Some(&cause), false),
        ];
        assert_eq!(first_failure(&aborted), Some(1));
        // The same for a first rank to exit that recorded nothing without a crash.
        let exited = [
            failed(180_000, None, false),
            failed(180_050, Some(&cause), false),
        ];
        assert_eq!(first_failure(&exited), Some(1));
    }

    /// PyTorch's `@record` writes whole seconds: read as the end of the second, such a
    /// record loses to an exit earlier in that second; two tie, and the first to exit wins.
    #[test]
    fn a_whole_second_record_is_read_as_the_end_of_its_second() {
        let python = |s: u64| {
            let text = format!(
                r#"{{"message": {{"message": "RuntimeError: x", "extraInfo":
                    {{"py_callstack": "", "timestamp": "{s}"}}}}}}"#
            );
            parse(&text).unwrap()
        };
        let (a, b) = (python(1_700_000_000), python(1_700_000_000));
        assert_eq!(a.at, t(999) + Duration::from_nanos(999_999));
        // A Rust rank's error at .500 (nanoseconds) beats a Python one's of the same second,
        // though that one may have come at .900; both ranks exited later.
        let rust = error(500);
        let mixed = [
            failed(1950, Some(&a), false),
            failed(1990, Some(&rust), false),
        ];
        assert_eq!(first_failure(&mixed), Some(1));
        // Two whole-second records of one second tie: the first to exit.
        let both = [failed(1990, Some(&a), false), failed(1950, Some(&b), false)];
        assert_eq!(first_failure(&both), Some(1));
    }

    #[test]
    fn the_folder_is_private_and_removed() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = ddp_testkit::temp_dir("error-folder");
        let folder = ErrorFolder::create_in(tmp.path()).unwrap();
        let dir = folder.dir.clone();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::write(folder.path(3), "{}").unwrap();
        assert!(dir.join("rank-3.error.json").is_file());
        drop(folder);
        assert!(!dir.exists());
    }

    /// A pid that no process has: above any `pid_max` (at most 2^22).
    const DEAD: i32 = i32::MAX;

    /// Makes the folder `name` in `parent` holding `files` (empty) and `folders`.
    fn folder(parent: &Path, name: &str, files: &[&str], folders: &[&str]) -> PathBuf {
        let dir = parent.join(name);
        std::fs::create_dir(&dir).unwrap();
        for file in files {
            std::fs::write(dir.join(file), "{}").unwrap();
        }
        for sub in folders {
            std::fs::create_dir(dir.join(sub)).unwrap();
        }
        dir
    }

    /// The names in `dir`.
    fn names(dir: &Path) -> BTreeSet<String> {
        let entries = std::fs::read_dir(dir).unwrap();
        entries
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect()
    }

    /// A launcher's new folder replaces those of dead launchers that hold only rank records
    /// (or nothing); a folder's records are named as [`ErrorFolder::path`] names them.
    #[test]
    fn a_dead_launchers_folder_is_removed() {
        let tmp = ddp_testkit::temp_dir("stale-error-folders");
        let records = ["rank-0.error.json", "rank-12.error.json"];
        folder(
            tmp.path(),
            &format!("ddp-run-{DEAD}-0123456789abcdef"),
            &records,
            &[],
        );
        folder(tmp.path(), "ddp-run-4194305-fedcba9876543210", &[], &[]);
        let new = ErrorFolder::create_in(tmp.path()).unwrap();
        let own = new.dir.file_name().unwrap().to_str().unwrap().to_owned();
        assert_eq!(names(tmp.path()), [own.clone()].into());
        let host = this_host();
        let pid = Pid::from_raw(std::process::id() as i32);
        let parsed = launcher(own.as_bytes());
        assert_eq!(parsed, Some((Some(host.as_bytes()), pid.unwrap())), "{own}");
        let record = new.path(7);
        assert!(is_record(record.file_name().unwrap().as_encoded_bytes()));
        // Two launchers starting at once: each folder is removed once, the other's calls
        // fail quietly.
        for i in 0..20 {
            folder(
                tmp.path(),
                &format!("ddp-run-{DEAD}-{i:016x}"),
                &records,
                &[],
            );
        }
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| remove_stale(tmp.path()));
            }
        });
        assert_eq!(names(tmp.path()), [own].into());
    }

    /// On a temporary folder that hosts share (NFS), another host's folder stays though no
    /// process here has its pid: its launcher may live there. This host's goes, as does one
    /// of an older launcher, whose name has no host; a host's name may hold dashes.
    #[test]
    fn another_hosts_folder_stays() {
        let tmp = ddp_testkit::temp_dir("hosts-error-folders");
        let record = ["rank-0.error.json"];
        let host = this_host();
        let elsewhere = format!("ddp-run-{host}x-{DEAD}-0123456789abcdef");
        let other = format!("ddp-run-gpu-node-7.cluster-{DEAD}-0123456789abcdef");
        for name in [
            &elsewhere,
            &other,
            &format!("ddp-run-{host}-{DEAD}-0123456789abcdef"),
            &format!("ddp-run-{DEAD}-0123456789abcdef"),
        ] {
            folder(tmp.path(), name, &record, &[]);
        }
        remove_stale(tmp.path());
        assert_eq!(names(tmp.path()), [elsewhere, other].into());
        let dashed = launcher(b"ddp-run-gpu-node-7-42-0123456789abcdef");
        let pid = Pid::from_raw(42).unwrap();
        assert_eq!(dashed, Some((Some(&b"gpu-node-7"[..]), pid)));
        assert_eq!(launcher(b"ddp-run-42-0123456789abcdef"), Some((None, pid)));
        assert!(!host.is_empty() && host.len() <= HOST_MAX, "{host}");
        let allowed = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-');
        assert!(host.bytes().all(allowed), "{host}");
    }

    /// A folder whose pid runs (this process, or any that reused a dead launcher's pid)
    /// stays, as one that a live launcher holds locked (in another pid namespace, where its
    /// pid says nothing), and one of another user's.
    #[test]
    fn a_live_launchers_folder_stays() {
        let tmp = ddp_testkit::temp_dir("live-error-folders");
        let record = ["rank-0.error.json"];
        let live = format!("ddp-run-{}-0123456789abcdef", std::process::id());
        folder(tmp.path(), &live, &record, &[]);
        let locked = format!("ddp-run-{DEAD}-0123456789abcdef");
        // A launcher's folder, under a dead pid's name.
        let launcher = ErrorFolder::create_in(tmp.path()).unwrap();
        std::fs::write(launcher.path(0), "{}").unwrap();
        std::fs::rename(&launcher.dir, tmp.path().join(&locked)).unwrap();
        remove_stale(tmp.path());
        assert_eq!(names(tmp.path()), [locked.clone(), live.clone()].into());
        let parent = fs::open(tmp.path(), OFlags::RDONLY, Mode::empty()).unwrap();
        let name = std::ffi::CString::new(locked.clone()).unwrap();
        drop(launcher);
        let stranger = process::geteuid().as_raw() + 1;
        remove_records(&parent, &name, stranger).unwrap();
        assert_eq!(names(tmp.path()), [locked, live.clone()].into());
        remove_stale(tmp.path());
        assert_eq!(names(tmp.path()), [live].into());
    }

    /// A folder is removed only where it is named as an error folder is and holds nothing
    /// but regular files named as rank records: a link is never followed, even inside one.
    #[test]
    fn anything_else_stays() {
        let tmp = ddp_testkit::temp_dir("other-error-folders");
        let record = ["rank-0.error.json"];
        let dead = |hex: &str| format!("ddp-run-{DEAD}-{hex}");
        let target = folder(tmp.path(), "target", &record, &[]);
        let link = dead("00000000000000aa");
        std::os::unix::fs::symlink(&target, tmp.path().join(&link)).unwrap();
        let link_inside = dead("00000000000000bb");
        let linked = folder(tmp.path(), &link_inside, &[], &[]).join("rank-1.error.json");
        std::os::unix::fs::symlink(target.join(record[0]), linked).unwrap();
        let mut kept = BTreeSet::from([link, link_inside.clone(), "target".to_owned()]);
        for (name, files, folders) in [
            (
                dead("00000000000000cc"),
                &["rank-0.error.json", "notes"][..],
                &[][..],
            ),
            (dead("00000000000000dd"), &record, &["rank-1.error.json"]),
            (dead("00000000000000ee"), &["rank-x.error.json"], &[]),
            (dead("00000000000000ff"), &["rank-0.error.json.tmp"], &[]),
            (dead("0123456789ABCDEF"), &record, &[]),
            (dead("0123456789abcde"), &record, &[]),
            ("ddp-run--0123456789abcdef".into(), &record, &[]),
            (format!("ddp-run-+{DEAD}-0123456789abcdef"), &record, &[]),
            ("ddp-run-0-0123456789abcdef".into(), &record, &[]),
        ] {
            folder(tmp.path(), &name, files, folders);
            kept.insert(name);
        }
        remove_stale(tmp.path());
        assert_eq!(names(tmp.path()), kept);
        assert_eq!(names(&target), record.map(String::from).into());
        let inside = names(&tmp.path().join(link_inside));
        assert_eq!(inside, ["rank-1.error.json".into()].into());
    }
}
