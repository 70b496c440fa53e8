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

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

/// One attempt's error files: a folder only this user can enter (mode 0700) in the temporary
/// folder, with one file per rank, removed with what is in it when dropped.
pub(crate) struct ErrorFolder {
    dir: PathBuf,
}

impl ErrorFolder {
    /// A new, empty folder.
    pub(crate) fn create() -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let mut bytes = [0u8; 8];
        getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let dir = std::env::temp_dir().join(format!("ddp-run-{}-{hex}", std::process::id()));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        Ok(ErrorFolder { dir })
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
        self.dir.join(format!("rank-{rank}.error.json"))
    }
}

impl Drop for ErrorFolder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let folder = ErrorFolder::create().unwrap();
        let dir = folder.dir.clone();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::write(folder.path(3), "{}").unwrap();
        assert!(dir.join("rank-3.error.json").is_file());
        drop(folder);
        assert!(!dir.exists());
    }
}
