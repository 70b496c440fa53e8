//! The best-model files' documents (their tuned thresholds) kept with the checkpoints, and a
//! best model restored with its document from there.

use std::path::{Path, PathBuf};

use crate::error::TrainError;
use crate::state;

/// `epoch-NNNN.<model>.json` in `run`'s checkpoints: epoch `epoch`'s copy of the document
/// beside best-model file `model` (`<model>.json`), which a resume restoring that model
/// restores too.
pub(super) fn document_copy(run: &Path, epoch: u64, model: &str) -> PathBuf {
    let doc = Path::new(model).with_extension("json");
    state::checkpoint_dir(run).join(format!("{}.{}", state::stem(epoch), doc.display()))
}

/// Writes best-model file `file` of `run` from `source`, epoch `epoch`'s checkpoint, and its
/// document `doc` from that epoch's copy where there is one; says which.
pub(super) fn restore(
    run: &Path,
    file: &str,
    epoch: u64,
    source: &Path,
    doc: &Path,
) -> Result<&'static str, TrainError> {
    let io = |what: &Path, e| TrainError::io(format!("cannot replace {}", what.display()), e);
    let model = run.join(file);
    let bytes = std::fs::read(source).map_err(|e| io(source, e))?;
    ddp_model::checkpoint::write_atomic(&model, &bytes).map_err(|e| io(&model, e))?;
    Ok(match restore_document(run, file, epoch, doc)? {
        Some(_) => "with its thresholds",
        None => "without thresholds",
    })
}

/// Writes `doc`, the document beside best-model file `file` of `run`, from epoch `epoch`'s
/// copy, and returns the copy's path; `None` where there is no copy (the run tuned no
/// thresholds then).
pub(super) fn restore_document(
    run: &Path,
    file: &str,
    epoch: u64,
    doc: &Path,
) -> Result<Option<PathBuf>, TrainError> {
    let io = |what: &Path, e| TrainError::io(format!("cannot replace {}", what.display()), e);
    let copy = document_copy(run, epoch, file);
    match std::fs::read(&copy) {
        Ok(text) => {
            ddp_model::checkpoint::write_atomic(doc, &text).map_err(|e| io(doc, e))?;
            Ok(Some(copy))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(&copy, e)),
    }
}
