//! The model file a checkpoint path names: `--resume`'s, and `--checkpoint`'s.

use std::path::{Path, PathBuf};

use super::{checkpoint_dir, checkpoint_stem, run_of};
use crate::error::TrainError;

/// Finds the model file that `--resume` names: `latest` (in `run`) or a path.
pub fn resolve(resume: &str, run: Option<&Path>) -> Result<PathBuf, TrainError> {
    if resume == "latest" {
        let run = run.ok_or_else(|| {
            TrainError::Invalid("--resume latest needs --out <run directory>".into())
        })?;
        let pointer = checkpoint_dir(run).join("latest");
        let name = match std::fs::read(&pointer) {
            // Not UTF-8: a name the check below refuses, with its advice.
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(TrainError::Invalid(format!(
                    "nothing to resume: {} does not exist (no checkpoint of this run has been \
                     written yet); start without --resume",
                    pointer.display()
                )))
            }
            Err(e) => {
                return Err(TrainError::io(
                    format!("cannot read {}", pointer.display()),
                    e,
                ))
            }
        };
        let stem = checkpoint_stem(name.trim()).ok_or_else(|| {
            TrainError::Invalid(format!(
                "{} names '{}', not a checkpoint of this folder (a plain name of letters, \
                 digits, '-' and '_'): the file was not written by the Trainer; write the name of \
                 one of the folder's checkpoints into it (e.g. epoch-0003), or start without \
                 --resume",
                pointer.display(),
                name.trim().escape_debug()
            ))
        })?;
        return Ok(checkpoint_dir(run).join(format!("{stem}.safetensors")));
    }
    model_file_of(
        "--resume",
        Path::new(resume),
        "a checkpoint file (a run's checkpoints/epoch-NNNN.safetensors) or a run directory",
        "no such checkpoint file",
    )
}

/// The model file that `given`, a path given for `flag`, names: a run directory or its
/// `checkpoints/`, its latest checkpoint (where it has none, the refusal says to give
/// `instead`); a checkpoint's state file, its model file; else itself, where it is a file
/// (else the refusal says `missing`).
pub fn model_file_of(
    flag: &str,
    given: &Path,
    instead: &str,
    missing: &str,
) -> Result<PathBuf, TrainError> {
    if given.is_dir() {
        let run = run_of(given);
        let latest = checkpoint_dir(run).join("latest");
        if !latest.is_file() {
            return Err(TrainError::Invalid(format!(
                "{flag} {}: a folder without checkpoints (no {}); give {instead}",
                given.display(),
                latest.display()
            )));
        }
        return resolve("latest", Some(run));
    }
    // The state file names the same checkpoint as its model file.
    let path = match given
        .to_str()
        .and_then(|p| p.strip_suffix(".state.safetensors"))
    {
        Some(base) if given.is_file() => PathBuf::from(format!("{base}.safetensors")),
        _ => given.to_path_buf(),
    };
    if !path.is_file() {
        return Err(TrainError::Invalid(format!(
            "{flag} {}: {missing}",
            given.display()
        )));
    }
    Ok(path)
}
