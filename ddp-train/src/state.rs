//! Training checkpoints: everything needed to continue a run exactly where it stopped.
//!
//! An epoch's checkpoint is two files in `<run>/checkpoints/`, each written atomically:
//!
//! - `epoch-NNNN.safetensors`: the model alone, with PyTorch's state-dict names, loadable by
//!   `ddp_model::checkpoint::load` and by PyTorch's `load_state_dict(strict=True)`;
//! - `epoch-NNNN.state.safetensors`: the optimizer's tensors (Adam's `exp_avg.<param>` and
//!   `exp_avg_sq.<param>`, SGD's `momentum_buffer.<param>`) and, in the header's metadata
//!   under `train_state`, the JSON of [`TrainState`].
//!
//! Then `latest` (a one-line file naming `epoch-NNNN`) is replaced atomically. A crash at any
//! point leaves `latest` naming a complete checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use ddp_model::checkpoint;
use serde::{Deserialize, Serialize};
use tch::nn::VarStore;

use crate::error::TrainError;
use crate::optim::Optimizer;
use crate::scheduler::ReduceLrOnPlateau;

/// The metadata key that holds [`TrainState`]'s JSON.
const STATE_KEY: &str = "train_state";

/// A best score and the epoch it was reached in.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Best {
    /// The score.
    pub value: f64,
    /// The epoch.
    pub epoch: u64,
}

/// The scalar state of a run after a completed epoch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// The last completed epoch (the next run starts at `epoch + 1`).
    pub epoch: u64,
    /// Optimizer steps taken in total.
    #[serde(alias = "adam_steps")]
    pub optimizer_steps: i64,
    /// The learning rate for the next epoch.
    pub lr: f64,
    /// The scheduler's history, when the run has one.
    pub scheduler: Option<ReduceLrOnPlateau>,
    /// The best value of each monitor so far, by the monitor's file name.
    #[serde(default)]
    pub bests: BTreeMap<String, Best>,
    /// The run's seed (every random draw derives from it and the epoch and step).
    pub seed: u64,
    /// The settings the run was started with, as JSON.
    pub config: serde_json::Value,
}

/// The folder of a run's checkpoints.
pub fn checkpoint_dir(run: &Path) -> PathBuf {
    run.join("checkpoints")
}

fn stem(epoch: u64) -> String {
    format!("epoch-{epoch:04}")
}

/// The state file that belongs to a model checkpoint file.
pub fn state_path(model_path: &Path) -> PathBuf {
    let name = model_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let base = name.strip_suffix(".safetensors").unwrap_or(&name);
    model_path.with_file_name(format!("{base}.state.safetensors"))
}

/// Writes the checkpoint of `state.epoch` and then points `latest` at it. Returns the model
/// file's path.
pub fn save(
    run: &Path,
    vs: &VarStore,
    optimizer: &Optimizer,
    state: &TrainState,
) -> Result<PathBuf, TrainError> {
    let dir = checkpoint_dir(run);
    std::fs::create_dir_all(&dir)
        .map_err(|e| TrainError::io(format!("cannot create {}", dir.display()), e))?;
    let model_path = dir.join(format!("{}.safetensors", stem(state.epoch)));
    let meta = HashMap::from([("epoch".to_owned(), state.epoch.to_string())]);
    checkpoint::save(vs, &model_path, &meta)?;
    pause_if_injected(state.epoch);
    let json = serde_json::to_string(state)
        .map_err(|e| TrainError::context("encoding the training state", e))?;
    let meta = HashMap::from([(STATE_KEY.to_owned(), json)]);
    checkpoint::write_tensors(optimizer.state_tensors(), &meta, state_path(&model_path))?;
    let latest = dir.join("latest");
    checkpoint::write_atomic(&latest, format!("{}\n", stem(state.epoch)).as_bytes())
        .map_err(|e| TrainError::io(format!("cannot update {}", latest.display()), e))?;
    Ok(model_path)
}

/// For the launcher's fault tests: `DDP_TRAIN_PAUSE_IN_CHECKPOINT=<epoch>` makes rank 0
/// stop for a minute in the middle of writing that epoch's checkpoint (model file written,
/// state file and `latest` not yet), so a test can kill it there.
fn pause_if_injected(epoch: u64) {
    if std::env::var("DDP_TRAIN_PAUSE_IN_CHECKPOINT").is_ok_and(|e| e == epoch.to_string()) {
        tracing::warn!(
            "pausing inside the checkpoint of epoch {epoch} (DDP_TRAIN_PAUSE_IN_CHECKPOINT)"
        );
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
}

/// Finds the model file that `--resume` names: `latest` (in `run`) or a path.
pub fn resolve(resume: &str, run: Option<&Path>) -> Result<PathBuf, TrainError> {
    if resume == "latest" {
        let run = run.ok_or_else(|| {
            TrainError::Invalid("--resume latest needs --out <run directory>".into())
        })?;
        let pointer = checkpoint_dir(run).join("latest");
        let name = std::fs::read_to_string(&pointer).map_err(|_| {
            TrainError::Invalid(format!(
                "nothing to resume: {} does not exist (no epoch of this run has finished); \
                 start without --resume",
                pointer.display()
            ))
        })?;
        return Ok(checkpoint_dir(run).join(format!("{}.safetensors", name.trim())));
    }
    let path = PathBuf::from(resume);
    if !path.is_file() {
        return Err(TrainError::Invalid(format!(
            "--resume {resume}: no such checkpoint file"
        )));
    }
    Ok(path)
}

/// Loads the checkpoint whose model file is `model_path` into `vs` and `optimizer`, and
/// returns its state. Everything is checked before anything changes.
pub fn load(
    model_path: &Path,
    vs: &VarStore,
    optimizer: &mut Optimizer,
) -> Result<TrainState, TrainError> {
    let state_file = state_path(model_path);
    let file = checkpoint::read_tensors(&state_file)?;
    let json = file.metadata.get(STATE_KEY).ok_or_else(|| {
        TrainError::Invalid(format!(
            "{} is not a training-state file (no '{STATE_KEY}' metadata)",
            state_file.display()
        ))
    })?;
    let state: TrainState = serde_json::from_str(json).map_err(|e| {
        TrainError::Invalid(format!(
            "{}: unreadable training state: {e}",
            state_file.display()
        ))
    })?;
    // Check the optimizer state against the model before loading either.
    let mut problems = Vec::new();
    for (name, t) in optimizer.state_tensors() {
        match file.tensors.get(&name) {
            None => problems.push(format!("'{name}' is missing")),
            Some(f) if f.size() != t.size() => problems.push(format!(
                "'{name}' has shape {:?} but the model needs {:?}",
                f.size(),
                t.size()
            )),
            Some(_) => {}
        }
    }
    if !problems.is_empty() {
        return Err(TrainError::Invalid(format!(
            "{} does not fit this model: {}",
            state_file.display(),
            problems.join("; ")
        )));
    }
    checkpoint::load(vs, model_path)?;
    optimizer
        .load_state(&file.tensors, state.optimizer_steps)
        .map_err(|e| TrainError::Invalid(format!("{}: {e}", state_file.display())))?;
    Ok(state)
}
