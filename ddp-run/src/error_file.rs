//! torchrun's error files: how the launcher learns which rank's failure came first.
//!
//! A rank that fails tears down its links as it exits, so its peers fail too, and one of them
//! may exit before it: the first rank to exit is not always the cause. As torchrun's agent
//! does, the launcher gives each rank a file of its own in
//! [`TORCHELASTIC_ERROR_FILE`](crate::env::TORCHELASTIC_ERROR_FILE), a rank writes its error
//! there with the time the error arose ([`record_error`], what PyTorch's `@record` does), and
//! once the failed attempt has stopped the launcher names the failed rank whose error came
//! first; a rank without a file counts from its exit (torchrun's `ProcessFailure`).

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
    let since = match (number("timestamp_ns"), number("timestamp")) {
        (Some(ns), _) => Duration::from_nanos(u64::try_from(ns).ok()?),
        (None, Some(s)) => Duration::from_secs(u64::try_from(s).ok()?),
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

/// Of failed ranks, each with when it exited and the error it recorded, the one whose
/// failure came first: the earliest recorded error, or exit where it recorded none; in a tie,
/// the first given. Returns its index among them.
pub(crate) fn first_failure<'a>(
    failed: impl IntoIterator<Item = (SystemTime, Option<&'a RecordedError>)>,
) -> Option<usize> {
    let at = |(exited, recorded): (SystemTime, Option<&RecordedError>)| {
        recorded.map_or(exited, |r| r.at)
    };
    let (index, _) = failed
        .into_iter()
        .map(at)
        .enumerate()
        .min_by_key(|&(_, time)| time)?;
    Some(index)
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
        let secs = |s| UNIX_EPOCH + Duration::from_secs(s);
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

    /// The earliest error names the cause, though its rank exited last; a rank that recorded
    /// nothing counts from its exit; in a tie, the first given.
    #[test]
    fn the_earliest_error_is_the_first_failure() {
        let t = |ms: u64| UNIX_EPOCH + Duration::from_millis(1_700_000_000_000 + ms);
        let error = |ms| RecordedError {
            message: String::new(),
            at: t(ms),
        };
        let (cause, victim) = (error(100), error(130));
        // Rank 1 (the victim) exited first, at 140; rank 0 (the cause) at 190.
        let failed = [(t(140), Some(&victim)), (t(190), Some(&cause))];
        assert_eq!(first_failure(failed), Some(1));
        // A rank that recorded nothing counts from its exit: 120 is after the cause's 100, 90
        // before it.
        let failed = [
            (t(140), Some(&victim)),
            (t(120), None),
            (t(190), Some(&cause)),
        ];
        assert_eq!(first_failure(failed), Some(2));
        let failed = [
            (t(140), Some(&victim)),
            (t(90), None),
            (t(190), Some(&cause)),
        ];
        assert_eq!(first_failure(failed), Some(1));
        assert_eq!(first_failure([(t(5), None), (t(5), None)]), Some(0));
        assert_eq!(first_failure([]), None);
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
