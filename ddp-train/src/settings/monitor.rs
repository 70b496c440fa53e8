//! The best-model files ([`Monitor`]) and the names they may take in the run directory.

use serde::{Deserialize, Serialize};

use crate::error::SettingError;
use crate::metrics::Goal;

/// The names the Trainer writes in the run directory (`.lock` and temporaries begin with a
/// dot), which no best-model file, nor the document beside it, may take.
const RUN_DIR_NAMES: [&str; 5] = [
    "config.json",
    "metrics.jsonl",
    "curves.png",
    "checkpoints",
    "logs",
];

/// The longest file name Linux's file systems take (`NAME_MAX`), in bytes.
const NAME_MAX: usize = 255;

/// How much longer than a file's name is the name of the temporary that writes it
/// (`ddp_model::checkpoint::write_atomic`'s `.<name>.tmp-<pid>-<start>`), at most: the dot,
/// `.tmp-`, a pid of up to 7 digits (Linux's largest, 4194304), `-`, and the process's start
/// in nanoseconds in hexadecimal, 16 digits until the year 2554.
const TEMPORARY_EXTRA: usize = ".".len() + ".tmp-".len() + 7 + "-".len() + 16;

/// A metric whose best epoch's model rank 0 keeps in the run directory (PyTorch Lightning's
/// `ModelCheckpoint(monitor=...)`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Monitor {
    /// The metric's name in an epoch's report (`val_loss`, `train_loss` or one the task's
    /// evaluation reports).
    pub metric: String,
    /// Which direction is better.
    pub goal: Goal,
    /// The model file's name in the run directory.
    pub file: String,
}

impl Monitor {
    /// Keeps the model of the epoch with the largest `metric` in `file`.
    pub fn max(metric: impl Into<String>, file: impl Into<String>) -> Self {
        Self {
            metric: metric.into(),
            goal: Goal::Max,
            file: file.into(),
        }
    }

    /// Keeps the model of the epoch with the smallest `metric` in `file`.
    pub fn min(metric: impl Into<String>, file: impl Into<String>) -> Self {
        Self {
            goal: Goal::Min,
            ..Self::max(metric, file)
        }
    }
}

/// Each best-model file, and the document `<file>.json` written beside it, is a plain file
/// name in the run directory that is none of the run's own and no other monitor's, short
/// enough that the temporary writing it is a file name too (else the first save would fail,
/// an epoch into the run).
pub(super) fn check_monitors(monitors: &[Monitor]) -> Result<(), SettingError> {
    let mut written: Vec<(String, &str)> = Vec::new();
    for m in monitors {
        let file = m.file.as_str();
        let plain = std::path::Path::new(file).file_name() == Some(file.as_ref());
        if !plain || file.starts_with('.') {
            return Err(SettingError::new(
                "monitors",
                format!(
                    ": {file:?} is not a plain file name (best models are written in the run \
                     directory itself; hidden names are the run's own)"
                ),
            ));
        }
        let doc = std::path::Path::new(file).with_extension("json");
        let doc = doc.to_string_lossy().into_owned();
        if doc == file {
            return Err(SettingError::new(
                "monitors",
                format!(
                    ": {file} would be its own document {doc} (give the model file another \
                     extension, e.g. .safetensors)"
                ),
            ));
        }
        check_length(file, &doc)?;
        if let Some(own) = [file, doc.as_str()]
            .into_iter()
            .find(|name| RUN_DIR_NAMES.contains(name))
        {
            return Err(SettingError::new(
                "monitors",
                format!(": {file} would write {own}, a name the run directory keeps for its own"),
            ));
        }
        for name in [file.to_string(), doc] {
            if let Some((_, other)) = written.iter().find(|(n, _)| *n == name) {
                let text = if *other == file {
                    format!(": two write the same file {name}")
                } else {
                    format!(": {other} and {file} both write {name}")
                };
                return Err(SettingError::new("monitors", text));
            }
            written.push((name, file));
        }
    }
    Ok(())
}

/// Refuses a best-model file `file`, or its document `doc`, whose temporary would pass the
/// longest file name.
fn check_length(file: &str, doc: &str) -> Result<(), SettingError> {
    let max = NAME_MAX - TEMPORARY_EXTRA;
    if file.len().max(doc.len()) <= max {
        return Ok(());
    }
    let doc_too = if doc.len() > file.len() {
        format!(" (its document {doc}: {})", doc.len())
    } else {
        String::new()
    };
    Err(SettingError::new(
        "monitors",
        format!(
            ": {file} is {} bytes long{doc_too}: best models and their documents are written \
             through temporaries up to {TEMPORARY_EXTRA} bytes longer \
             (.<name>.tmp-<pid>-<start>), so their names take at most {max} bytes, of the \
             {NAME_MAX} a file name takes",
            file.len()
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(monitors: &[Monitor]) -> String {
        check_monitors(monitors).unwrap_err().to_string()
    }

    /// A name whose temporary would pass 255 bytes is refused before the run, not at its
    /// first save; the longest that fits passes.
    #[test]
    fn names_whose_temporaries_pass_the_longest_file_name_are_refused() {
        let long = format!("{}.safetensors", "b".repeat(228));
        assert_eq!(long.len(), 240);
        assert_eq!(
            error(&[Monitor::max("score", &long)]),
            format!(
                "monitors: {long} is 240 bytes long: best models and their documents are \
                 written through temporaries up to 30 bytes longer (.<name>.tmp-<pid>-<start>), \
                 so their names take at most 225 bytes, of the 255 a file name takes"
            )
        );
        // The document's name can be the longer one.
        let short_ext = format!("{}.a", "c".repeat(222));
        let e = error(&[Monitor::max("score", &short_ext)]);
        assert!(
            e.contains(&format!(
                "{short_ext} is 224 bytes long (its document {}.json: 227): ",
                "c".repeat(222)
            )),
            "{e}"
        );
        let fits = format!("{}.safetensors", "d".repeat(213));
        assert_eq!(fits.len(), 225);
        assert!(check_monitors(&[Monitor::max("score", fits)]).is_ok());
        // The bound holds for the tag of this process, whichever it is.
        let tag = ddp_model::checkpoint::temporary_tag();
        assert!(
            tag.len() <= TEMPORARY_EXTRA - ".".len() - ".tmp-".len(),
            "{tag}"
        );
    }

    /// A name of 225 bytes does get its temporary written, and renamed into place.
    #[test]
    fn the_longest_name_allowed_is_written() {
        let dir = ddp_testkit::temp_dir("monitor-names");
        let name = format!("{}.safetensors", "e".repeat(213));
        let path = dir.path().join(&name);
        ddp_model::checkpoint::write_atomic(&path, b"model").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"model");
    }
}
