//! Training checkpoints: everything needed to continue a run exactly where it stopped.
//!
//! An epoch's checkpoint is two files in `<run>/checkpoints/`, each written atomically:
//!
//! - `epoch-NNNN.safetensors`: the model alone, with PyTorch's state-dict names, loadable by
//!   `ddp_model::checkpoint::load` and by PyTorch's `load_state_dict(strict=True)`; its
//!   metadata holds its epoch and the settings it was trained under (as best models' does);
//! - `epoch-NNNN.state.safetensors`: the optimizer's tensors (Adam's `exp_avg.<param>` and
//!   `exp_avg_sq.<param>`, SGD's `momentum_buffer.<param>`) and, in the header's metadata
//!   under `train_state`, the JSON of [`TrainState`].
//!
//! Then `latest` (a one-line file naming `epoch-NNNN`) is replaced atomically. A crash at any
//! point leaves `latest` naming a complete checkpoint.
//!
//! A checkpoint taken inside an epoch (every N optimizer steps, every M minutes, or when the
//! run is stopped by a signal or its time limit) is named `epoch-NNNN-step-SSSSSS` (epoch NNNN
//! in progress, SSSSSS of its optimizer steps done) and its state records that
//! [`Position`]; resuming continues that epoch at that step. Rank 0 keeps the newest few of
//! these ([`prune_steps`]); epoch-end checkpoints and best-model files are never pruned. A run
//! that was stopped also leaves `stopped` (the stopped checkpoint's name and why), so that its
//! next start continues it by itself; the next checkpoint removes it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use ddp_model::checkpoint;
use serde::{Deserialize, Serialize};
use tch::nn::VarStore;

use crate::allocation::{Allocation, Plan};
use crate::error::TrainError;
use crate::optim::Optimizer;
use crate::scheduler::ReduceLrOnPlateau;

mod best;
mod legacy;
mod record;
mod resolve;
pub use best::{Best, EarlyStopState};
pub(crate) use record::{model_record, recorded, training_record};
pub use resolve::{model_file_of, resolve};

/// The metadata key that holds [`TrainState`]'s JSON.
const STATE_KEY: &str = "train_state";

/// Where inside an epoch a checkpoint was taken, and that epoch's training sums so far.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Position {
    /// The epoch in progress (from 1).
    pub epoch: u64,
    /// Its optimizer steps done: the resumed run continues with this step.
    pub step: usize,
    /// Sum over every rank's samples of the training loss in this epoch so far.
    pub loss_sum: f64,
    /// Training samples of this epoch so far, all ranks together.
    pub samples: usize,
    /// Seconds spent training in this epoch so far.
    pub train_seconds: f64,
    /// Sum of the finite gradient norms clipping measured in this epoch so far (the same on
    /// every rank). Some earlier checkpoints hold `null`, read as no norm so far.
    #[serde(default)]
    pub grad_norm_sum: f64,
    /// How many norms `grad_norm_sum` adds up: the steps clipping measured a finite norm in.
    /// `None` in checkpoints written before it was recorded (then every step not skipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm_steps: Option<u64>,
    /// Steps of this epoch so far that fp16's scaler skipped (the same on every rank).
    #[serde(default)]
    pub skipped_steps: u64,
    /// Positions of the epoch's order its steps so far consumed, all ranks together (the
    /// first `consumed`); `None` in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumed: Option<usize>,
    /// Where the epoch ends, in positions of its order: a whole number of steps of the
    /// allocation that started it. `None` in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch_end: Option<usize>,
}

/// The scalar state of a run at a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// The last completed epoch (the next run starts at `epoch + 1`, or inside it at
    /// `position`).
    pub epoch: u64,
    /// For a checkpoint inside an epoch: where (`None` at an epoch's end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<Position>,
    /// Optimizer steps taken in total.
    #[serde(alias = "adam_steps")]
    pub optimizer_steps: i64,
    /// The learning rate for the next epoch.
    pub lr: f64,
    /// The scheduler's history, when the run has one.
    pub scheduler: Option<ReduceLrOnPlateau>,
    /// The best value of each monitor so far, by the monitor's file name.
    #[serde(default, deserialize_with = "best::finite_bests")]
    pub bests: BTreeMap<String, Best>,
    /// Early stopping's count, when the run has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopState>,
    /// The fp16 gradient scaler's state, when the run has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_scaler: Option<crate::amp::ScalerState>,
    /// Optimizer steps fp16's scaler skipped since the run began, in whatever precision it
    /// continued: per-step schedules count them. `None` in checkpoints written before it was
    /// recorded: then the scaler's count ([`TrainState::skipped_steps`] reads either).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
    /// The run's seed (every random draw derives from it and the epoch and step).
    pub seed: u64,
    /// The training samples the epochs were dealt from (a mid-epoch position counts
    /// positions of their order); `None` in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_samples: Option<usize>,
    /// The ranks and batches the checkpoint was written on; `None` in checkpoints written
    /// before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation: Option<Allocation>,
    /// The run's planned length, recorded at its start (per-step schedules run over it);
    /// `None` in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<Plan>,
    /// Samples of the optimizer steps attempted since the run began (each step's global
    /// batch, taken or skipped; the plan's global batch for a step under a binding
    /// `max_steps_per_epoch`): per-step schedules stand at this over the plan's global
    /// batch. `None` in checkpoints written before it was recorded: the steps attempted
    /// times the plan's global batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduled_samples: Option<u64>,
    /// The parameters that were frozen ([`crate::FreezeSettings`]) when the checkpoint was
    /// written, which the optimizer's state leaves out; empty when none was.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frozen: Vec<String>,
    /// DDP's bucket order after its first step's rebuild
    /// ([`crate::DistributedDataParallel::bucket_order`]), which a resumed run takes on;
    /// `None` before the rebuild and in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_order: Option<Vec<String>>,
    /// For a checkpoint inside an epoch that a start on another allocation continued: the
    /// `allocation_change` that epoch's line of `metrics.jsonl` records, for the start that
    /// ends the epoch. `None` otherwise, and in checkpoints written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation_change: Option<serde_json::Value>,
    /// The settings the run was started with, as JSON.
    pub config: serde_json::Value,
}

impl TrainState {
    /// Optimizer steps the scaler skipped since the run began.
    pub fn skipped_steps(&self) -> u64 {
        let scaler = self.grad_scaler.map_or(0, |s| s.skipped_steps);
        self.skipped_steps.unwrap_or(scaler)
    }

    /// The global batch of the plan's steps: recorded, else `now`'s, so that a plan written
    /// before it was recorded counts whole steps from here as its run did (whatever
    /// allocations it took them on).
    pub fn plan_global_batch(&self, now: usize) -> usize {
        self.plan.and_then(|p| p.global_batch).unwrap_or(now)
    }

    /// [`TrainState::scheduled_samples`] as recorded, else the optimizer steps attempted
    /// (taken and skipped) times `global_batch`, the plan's.
    pub fn scheduled_samples(&self, global_batch: usize) -> u64 {
        self.scheduled_samples.unwrap_or_else(|| {
            let attempted = u64::try_from(self.optimizer_steps).unwrap_or(0);
            attempted
                .saturating_add(self.skipped_steps())
                .saturating_mul(global_batch as u64)
        })
    }
}

/// The folder of a run's checkpoints.
pub fn checkpoint_dir(run: &Path) -> PathBuf {
    run.join("checkpoints")
}

/// The run directory `folder` stands for: its parent when it is a run's checkpoint folder
/// (named so, with a `latest`), else itself.
pub fn run_of(folder: &Path) -> &Path {
    match (folder.file_name(), folder.parent()) {
        (Some(name), Some(run)) if name == "checkpoints" && folder.join("latest").is_file() => run,
        _ => folder,
    }
}

/// The file stem of epoch `epoch`'s checkpoint (`epoch-0009`).
pub(crate) fn stem(epoch: u64) -> String {
    format!("epoch-{epoch:04}")
}

/// The file stem of the checkpoint of `state`: `epoch-NNNN` or `epoch-NNNN-step-SSSSSS`.
pub fn stem_of(state: &TrainState) -> String {
    match &state.position {
        None => stem(state.epoch),
        Some(p) => format!("{}-step-{:06}", stem(p.epoch), p.step),
    }
}

/// `(epoch, step)` of a step checkpoint's file stem.
fn step_of(stem: &str) -> Option<(u64, usize)> {
    let rest = stem.strip_prefix("epoch-")?;
    let (epoch, step) = rest.split_once("-step-")?;
    Some((epoch.parse().ok()?, step.parse().ok()?))
}

/// Where a checkpoint's file stem sits in the run: `(epoch, step)`, an epoch's end after
/// all of its steps; `None` for a name the Trainer does not write.
pub(crate) fn order_of(stem: &str) -> Option<(u64, usize)> {
    if let Some(at) = step_of(stem) {
        return Some(at);
    }
    let epoch = stem.strip_prefix("epoch-")?.parse().ok()?;
    Some((epoch, usize::MAX))
}

/// The run's other checkpoints to fall back to when `latest` cannot be loaded: every model
/// file of the folder but `latest`, newest first.
pub fn fallbacks(run: &Path, latest: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(checkpoint_dir(run)) else {
        return Vec::new();
    };
    let mut found: Vec<((u64, usize), PathBuf)> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p != latest)
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?;
            let stem = name.strip_suffix(".safetensors")?;
            (!stem.ends_with(".state")).then_some(())?;
            Some((order_of(stem)?, p.clone()))
        })
        .collect();
    found.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
    found.into_iter().map(|(_, p)| p).collect()
}

/// The file that marks a run as stopped (by a signal or its time limit) at its latest
/// checkpoint.
pub fn stopped_marker(run: &Path) -> PathBuf {
    checkpoint_dir(run).join("stopped")
}

/// Whether the run in `run` was stopped at its latest checkpoint (and so should continue
/// from it when started again).
pub fn was_stopped(run: &Path) -> bool {
    let dir = checkpoint_dir(run);
    match (
        std::fs::read_to_string(dir.join("latest")),
        std::fs::read_to_string(stopped_marker(run)),
    ) {
        (Ok(latest), Ok(marker)) => marker.split_whitespace().next() == Some(latest.trim()),
        _ => false,
    }
}

/// Records that the run stopped at its latest checkpoint, `stem`, and why.
pub fn mark_stopped(run: &Path, stem: &str, why: &str) -> Result<(), TrainError> {
    let path = stopped_marker(run);
    checkpoint::write_atomic(&path, format!("{stem} {why}\n").as_bytes())
        .map_err(|e| TrainError::io(format!("cannot write {}", path.display()), e))
}

/// Removes the step checkpoints of `run` but the newest `keep` (by epoch, then step), never
/// the one `latest` names. Epoch-end checkpoints are never removed. Returns the removed
/// stems.
pub fn prune_steps(run: &Path, keep: usize) -> Result<Vec<String>, TrainError> {
    let dir = checkpoint_dir(run);
    let latest = std::fs::read_to_string(dir.join("latest")).unwrap_or_default();
    let entries = std::fs::read_dir(&dir)
        .map_err(|e| TrainError::io(format!("cannot list {}", dir.display()), e))?;
    let mut steps: Vec<((u64, usize), String)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let stem = name.strip_suffix(".safetensors")?;
            if stem.ends_with(".state") {
                return None;
            }
            Some((step_of(stem)?, stem.to_owned()))
        })
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep);
    let mut removed = Vec::new();
    for (_, stem) in steps.into_iter().take(excess) {
        if stem == latest.trim() {
            continue;
        }
        for file in [
            format!("{stem}.safetensors"),
            format!("{stem}.state.safetensors"),
        ] {
            remove_if_present(&dir.join(file))?;
        }
        removed.push(stem);
    }
    Ok(removed)
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

pub(crate) fn remove_if_present(path: &Path) -> Result<(), TrainError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(TrainError::io(
            format!("cannot remove {}", path.display()),
            e,
        )),
        _ => Ok(()),
    }
}

/// `run`'s checkpoint folder, made (and its entry synced to the disk) where it is missing.
pub(crate) fn create_checkpoint_dir(run: &Path) -> Result<PathBuf, TrainError> {
    let dir = checkpoint_dir(run);
    if !dir.is_dir() {
        checkpoint::create_dir_all_synced(&dir)
            .map_err(|e| TrainError::io(format!("cannot create {}", dir.display()), e))?;
    }
    Ok(dir)
}

/// Writes the checkpoint of `state` (its epoch's end, or its position inside an epoch) and
/// then points `latest` at it, and drops an earlier `stopped` mark. Returns the model file's
/// path.
pub fn save(
    run: &Path,
    vs: &VarStore,
    optimizer: &Optimizer,
    state: &TrainState,
) -> Result<PathBuf, TrainError> {
    let dir = create_checkpoint_dir(run)?;
    let name = stem_of(state);
    let model_path = dir.join(format!("{name}.safetensors"));
    let mut meta = HashMap::from([("epoch".to_owned(), state.epoch.to_string())]);
    if let Some(p) = &state.position {
        meta.insert("epoch_in_progress".to_owned(), p.epoch.to_string());
        meta.insert("step".to_owned(), p.step.to_string());
    }
    meta.extend([model_record(&state.config)]);
    checkpoint::save(vs, &model_path, &meta)?;
    if state.position.is_none() {
        pause_if_injected(state.epoch);
    }
    let json = serde_json::to_string(state)
        .map_err(|e| TrainError::context("encoding the training state", e))?;
    let meta = HashMap::from([(STATE_KEY.to_owned(), json)]);
    checkpoint::write_tensors(optimizer.state_tensors(), &meta, state_path(&model_path))?;
    let latest = dir.join("latest");
    checkpoint::write_atomic(&latest, format!("{name}\n").as_bytes())
        .map_err(|e| TrainError::io(format!("cannot update {}", latest.display()), e))?;
    remove_if_present(&stopped_marker(run))?;
    Ok(model_path)
}

/// For the launcher's fault tests, with the `fault-injection` feature only (users' builds never
/// read it): `DDP_TRAIN_PAUSE_IN_CHECKPOINT=<epoch>` makes rank 0 pause in the middle of
/// writing that epoch's checkpoint (model file written, state file and `latest` not yet), so
/// a test can kill it there, or act and end the pause by creating `DDP_TRAIN_PAUSE_FILE`; a
/// minute at most.
fn pause_if_injected(epoch: u64) {
    if cfg!(feature = "fault-injection")
        && std::env::var("DDP_TRAIN_PAUSE_IN_CHECKPOINT").is_ok_and(|e| e == epoch.to_string())
    {
        tracing::warn!(
            "pausing inside the checkpoint of epoch {epoch} (DDP_TRAIN_PAUSE_IN_CHECKPOINT)"
        );
        let file = std::env::var_os("DDP_TRAIN_PAUSE_FILE").map(PathBuf::from);
        let start = std::time::Instant::now();
        while !file.as_deref().is_some_and(Path::exists)
            && start.elapsed() < std::time::Duration::from_secs(60)
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// `name` when it can only name a file inside the checkpoint folder: not empty, at most 64
/// characters of ASCII letters, digits, `-` and `_` (so no `/`, no `..`, no absolute path).
fn checkpoint_stem(name: &str) -> Option<&str> {
    let plain = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    plain.then_some(name)
}

/// Checks that a checkpoint's state can be continued from: counts that later arithmetic
/// (`epoch + 1`, the step inside an epoch, skipped steps, the scaler's, the plateau
/// scheduler's and early stopping's counts) cannot overflow, a finite non-negative learning
/// rate and a finite positive gradient scale.
pub fn check_state(state: &TrainState, file: &Path) -> Result<(), TrainError> {
    const MAX: u64 = crate::settings::MAX_COUNT;
    let mut problems = Vec::new();
    if state.epoch >= MAX {
        problems.push(format!("epoch {}", state.epoch));
    }
    if let Some(p) = &state.position {
        if p.epoch == 0 || p.epoch >= MAX || p.step as u64 >= MAX || p.samples as u64 >= MAX {
            problems.push(format!("position epoch {} step {}", p.epoch, p.step));
        }
        let norms = p.grad_norm_steps.unwrap_or(0);
        if p.skipped_steps >= MAX || norms >= MAX {
            problems.push(format!(
                "{} skipped and {norms} measured steps in the epoch",
                p.skipped_steps
            ));
        }
        let (consumed, end) = (p.consumed.unwrap_or(0), p.epoch_end.unwrap_or(0));
        if consumed as u64 >= MAX || end as u64 >= MAX || (p.epoch_end.is_some() && consumed > end)
        {
            problems.push(format!("{consumed} samples consumed of an epoch of {end}"));
        }
        // An epoch ends within one step of its data set's end: `steps x R x batch` is at
        // most `ceil(N / R) x R`, below `N + R`, and ranks are fewer than 2^20.
        if let Some(n) = state.train_samples {
            if end as u64 > n as u64 + (1 << 20) {
                problems.push(format!("an epoch of {end} samples on a data set of {n}"));
            }
        }
    }
    if let Some(a) = &state.allocation {
        let each = [a.world_size, a.batch_size, a.accumulate];
        if each.iter().any(|&n| n == 0 || n >= 1 << 20) || (a.global_batch() as u64) >= MAX {
            problems.push(format!("allocation {a}"));
        }
    }
    if !(0..1 << 40).contains(&state.optimizer_steps) {
        problems.push(format!("optimizer steps {}", state.optimizer_steps));
    }
    if !state.lr.is_finite() || state.lr < 0.0 {
        problems.push(format!("learning rate {}", state.lr));
    }
    if let Some(s) = &state.grad_scaler {
        if !(s.scale.is_finite() && s.scale > 0.0)
            || s.growth_tracker >= MAX
            || s.skipped_steps >= MAX
        {
            problems.push(format!(
                "gradient scale {} after {} good steps, {} skipped",
                s.scale, s.growth_tracker, s.skipped_steps
            ));
        }
    }
    if state.skipped_steps.is_some_and(|n| n >= MAX) {
        problems.push(format!("{} skipped steps", state.skipped_steps()));
    }
    if let Some(g) = state.plan.and_then(|p| p.global_batch) {
        if g == 0 || g as u64 >= MAX {
            problems.push(format!("a plan in steps of {g} samples"));
        }
    }
    // Exact as the f64 that schedules divide.
    if state.scheduled_samples.is_some_and(|n| n >= 1 << 53) {
        problems.push(format!("{} samples stepped", state.scheduled_samples(0)));
    }
    if let Some(r) = &state.scheduler {
        // The cooldown only counts down from the configured one, which may be any u32.
        if r.num_bad_epochs >= 1 << 30 || r.cooldown_counter > r.config.cooldown {
            problems.push(format!(
                "plateau scheduler at {} bad epochs, {} of its {} epochs of cooldown",
                r.num_bad_epochs, r.cooldown_counter, r.config.cooldown
            ));
        }
    }
    if let Some(e) = &state.early_stopping {
        if e.bad_epochs >= 1 << 30 {
            problems.push(format!("{} epochs without improvement", e.bad_epochs));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(TrainError::Invalid(format!(
        "{} holds values no run can continue from ({}): the file is damaged or was not \
         written by the Trainer; resume from another checkpoint",
        file.display(),
        problems.join(", ")
    )))
}

/// What every rank must agree on when it resumes: the checkpoint's file name and where it
/// continues (epoch, step, optimizer steps, learning rate); "none" for a fresh start.
pub fn resume_key(model_path: &Path, state: Option<&TrainState>) -> String {
    let name = model_path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    match state {
        Some(s) => {
            let mut key = format!(
                "{name} (epoch {}, step {}, {} optimizer steps, lr {:e}",
                s.epoch,
                s.position.as_ref().map_or(0, |p| p.step),
                s.optimizer_steps,
                s.lr
            );
            if let Some(a) = &s.allocation {
                key.push_str(&format!(", written on {a}"));
            }
            if let Some(consumed) = s.position.as_ref().and_then(|p| p.consumed) {
                key.push_str(&format!(", {consumed} samples consumed"));
            }
            key.push(')');
            key
        }
        None => name,
    }
}

/// Fails, with the same error on every rank, when the ranks' resume keys (gathered in rank
/// order) differ: naming rank 0's and the first other one.
pub fn check_resume_agreement(keys: &[Vec<u8>]) -> Result<(), TrainError> {
    match first_disagreement(keys) {
        None => Ok(()),
        Some((first, rank, other)) => Err(TrainError::Invalid(format!(
            "the ranks would resume from different checkpoints: rank 0 from {first}, rank \
             {rank} from {other}; give every rank the same --resume (and --out), on a folder \
             every rank sees the same"
        ))),
    }
}

/// Rank 0's key, and the first other rank whose key differs with its key.
pub(crate) fn first_disagreement(keys: &[Vec<u8>]) -> Option<(String, usize, String)> {
    let first = keys.first()?;
    let (rank, other) = keys.iter().enumerate().find(|(_, k)| *k != first)?;
    Some((
        String::from_utf8_lossy(first).into_owned(),
        rank,
        String::from_utf8_lossy(other).into_owned(),
    ))
}

/// Checks that every rank opened data of the same sizes (`keys`: each rank's description
/// of them, gathered).
pub fn check_data_agreement(keys: &[Vec<u8>]) -> Result<(), TrainError> {
    match first_disagreement(keys) {
        None => Ok(()),
        Some((first, rank, other)) => Err(TrainError::Invalid(format!(
            "the ranks opened different data: rank 0 has {first}, rank {rank} {other}; give \
             every rank the same data, on a folder every rank sees the same"
        ))),
    }
}

/// A checkpoint as read from its two files, each read once: the model's tensors, the
/// optimizer's, and the training state (already checked with [`check_state`]).
#[derive(Debug)]
pub struct SavedCheckpoint {
    /// The model file's tensors.
    pub model: checkpoint::TensorFile,
    /// The state file's tensors: the optimizer's.
    pub optimizer: checkpoint::TensorFile,
    /// The training state the state file holds.
    pub state: TrainState,
    /// What an earlier version's state file did not record usably, for the log.
    pub notes: Vec<String>,
}

/// Reads the checkpoint whose model file is `model_path`: its state file, whose training
/// state is checked before the model file is read, then the model file; each once.
pub fn read(model_path: &Path) -> Result<SavedCheckpoint, TrainError> {
    let state_file = state_path(model_path);
    if model_path.is_file() && !state_file.exists() {
        return Err(TrainError::Invalid(format!(
            "{} holds weights only: a checkpoint to resume from has its training state \
             beside it ({} does not exist), as a run's checkpoints/epoch-NNNN.safetensors \
             have; to start a new run from these weights, give them to --init-from",
            model_path.display(),
            state_file.display()
        )));
    }
    let optimizer = checkpoint::read_tensors(&state_file)?;
    let json = optimizer.metadata.get(STATE_KEY).ok_or_else(|| {
        TrainError::Invalid(format!(
            "{} is not a training-state file (no '{STATE_KEY}' metadata)",
            state_file.display()
        ))
    })?;
    let (state, notes) = legacy::parse(json).map_err(|e| {
        TrainError::Invalid(format!(
            "{}: unreadable training state: {e}",
            state_file.display()
        ))
    })?;
    check_state(&state, &state_file)?;
    let model = checkpoint::read_tensors(model_path)?;
    let notes = notes
        .into_iter()
        .map(|note| format!("{}: {note}", state_file.display()))
        .collect();
    Ok(SavedCheckpoint {
        model,
        optimizer,
        state,
        notes,
    })
}

impl SavedCheckpoint {
    /// Loads the checkpoint into `vs` and `optimizer`, reading no file, and returns its
    /// state: checks the optimizer's tensors against `optimizer` (names, shapes), then loads
    /// the model's (all checked before any is copied), then the optimizer's.
    pub fn restore(
        self,
        vs: &VarStore,
        optimizer: &mut Optimizer,
    ) -> Result<TrainState, TrainError> {
        // The model first: a checkpoint of another model says so, before its optimizer state
        // (which then misses every tensor) would.
        checkpoint::load_tensors(vs, &self.model)?;
        let state_file = &self.optimizer.path;
        let mut problems = Vec::new();
        for (name, t) in optimizer.state_tensors() {
            match self.optimizer.tensors.get(&name) {
                // Adam's per-parameter step counts are newer than some checkpoints; without
                // them every parameter took every step.
                None if name.starts_with("step.") => {}
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
            let shown = checkpoint::MISMATCH_SHOWN;
            let more = match problems.len().saturating_sub(shown) {
                0 => String::new(),
                n => format!("; and {n} more"),
            };
            problems.truncate(shown);
            return Err(TrainError::Invalid(format!(
                "{} does not fit this model's optimizer: {}{more}",
                state_file.display(),
                problems.join("; ")
            )));
        }
        optimizer
            .load_state(&self.optimizer.tensors, self.state.optimizer_steps)
            .map_err(|e| TrainError::Invalid(format!("{}: {e}", state_file.display())))?;
        Ok(self.state)
    }
}

/// Loads the checkpoint whose model file is `model_path` into `vs` and `optimizer`, and
/// returns its state: [`read`], then [`SavedCheckpoint::restore`].
pub fn load(
    model_path: &Path,
    vs: &VarStore,
    optimizer: &mut Optimizer,
) -> Result<TrainState, TrainError> {
    read(model_path)?.restore(vs, optimizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(dir: &Path, name: &str) {
        std::fs::write(dir.join(name), b"x").unwrap();
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn pruning_keeps_the_newest_step_checkpoints_and_every_epoch_end() {
        let run = ddp_testkit::temp_dir("ddp-train-prune");
        let dir = checkpoint_dir(run.path());
        std::fs::create_dir_all(&dir).unwrap();
        for stem in [
            "epoch-0001-step-000003",
            "epoch-0001-step-000006",
            "epoch-0001",
            "epoch-0002-step-000010",
            "epoch-0002-step-000009",
        ] {
            touch(&dir, &format!("{stem}.safetensors"));
            touch(&dir, &format!("{stem}.state.safetensors"));
        }
        touch(&dir, "best.safetensors");
        std::fs::write(dir.join("latest"), "epoch-0002-step-000010\n").unwrap();
        let removed = prune_steps(run.path(), 2).unwrap();
        // Ordered by step number, not by name: step 9 is older than step 10.
        assert_eq!(
            removed,
            ["epoch-0001-step-000003", "epoch-0001-step-000006"]
        );
        assert_eq!(
            names(&dir),
            [
                "best.safetensors",
                "epoch-0001.safetensors",
                "epoch-0001.state.safetensors",
                "epoch-0002-step-000009.safetensors",
                "epoch-0002-step-000009.state.safetensors",
                "epoch-0002-step-000010.safetensors",
                "epoch-0002-step-000010.state.safetensors",
                "latest",
            ]
        );
        // The checkpoint `latest` names survives even when older than the kept ones.
        std::fs::write(dir.join("latest"), "epoch-0002-step-000009\n").unwrap();
        assert_eq!(prune_steps(run.path(), 1).unwrap(), Vec::<String>::new());
    }

    #[test]
    fn a_stop_mark_counts_only_for_the_checkpoint_it_names() {
        let run = ddp_testkit::temp_dir("ddp-train-stopped");
        let dir = checkpoint_dir(run.path());
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!was_stopped(run.path()));
        std::fs::write(dir.join("latest"), "epoch-0001-step-000004\n").unwrap();
        mark_stopped(run.path(), "epoch-0001-step-000004", "SIGTERM").unwrap();
        assert!(was_stopped(run.path()));
        assert_eq!(
            std::fs::read_to_string(stopped_marker(run.path())).unwrap(),
            "epoch-0001-step-000004 SIGTERM\n"
        );
        std::fs::write(dir.join("latest"), "epoch-0001\n").unwrap();
        assert!(!was_stopped(run.path()));
    }

    #[test]
    fn step_checkpoints_are_named_by_epoch_and_step() {
        let mut st = TrainState {
            epoch: 1,
            position: None,
            optimizer_steps: 0,
            lr: 0.1,
            scheduler: None,
            bests: BTreeMap::new(),
            early_stopping: None,
            grad_scaler: None,
            skipped_steps: None,
            seed: 0,
            train_samples: None,
            allocation: None,
            plan: None,
            scheduled_samples: None,
            frozen: Vec::new(),
            bucket_order: None,
            allocation_change: None,
            config: serde_json::Value::Null,
        };
        assert_eq!(stem_of(&st), "epoch-0001");
        st.position = Some(Position {
            epoch: 2,
            step: 17,
            loss_sum: 1.0,
            samples: 4,
            train_seconds: 0.5,
            grad_norm_sum: 0.0,
            grad_norm_steps: None,
            skipped_steps: 0,
            consumed: None,
            epoch_end: None,
        });
        assert_eq!(stem_of(&st), "epoch-0002-step-000017");
        assert_eq!(step_of("epoch-0002-step-000017"), Some((2, 17)));
        assert_eq!(step_of("epoch-0002"), None);
        // Old state files (no position) still read.
        let old = r#"{"epoch":3,"adam_steps":30,"lr":0.001,"scheduler":null,"seed":1,"config":{}}"#;
        let st: TrainState = serde_json::from_str(old).unwrap();
        assert_eq!((st.epoch, st.position, st.optimizer_steps), (3, None, 30));
    }

    fn state(epoch: u64, lr: f64) -> TrainState {
        TrainState {
            epoch,
            position: None,
            optimizer_steps: 8,
            lr,
            scheduler: None,
            bests: BTreeMap::new(),
            early_stopping: None,
            grad_scaler: None,
            skipped_steps: None,
            seed: 0,
            train_samples: None,
            allocation: None,
            plan: None,
            scheduled_samples: None,
            frozen: Vec::new(),
            bucket_order: None,
            allocation_change: None,
            config: serde_json::Value::Null,
        }
    }

    /// Two parameters and an Adam that took one step from them, so that its moments are
    /// not a fresh optimizer's; different seeds give different values throughout.
    fn trained(seed: i64) -> (VarStore, Optimizer) {
        tch::manual_seed(seed);
        let vs = VarStore::new(tch::Device::Cpu);
        let f32_cpu = (tch::Kind::Float, tch::Device::Cpu);
        let w = vs
            .root()
            .var_copy("w", &tch::Tensor::randn([3, 2], f32_cpu));
        let b = vs.root().var_copy("b", &tch::Tensor::randn([2], f32_cpu));
        let config = crate::optim::OptimizerConfig::default();
        let mut optimizer = Optimizer::new(checkpoint::named_tensors(&vs), config);
        (w.square().sum(tch::Kind::Float) + b.sum(tch::Kind::Float)).backward();
        optimizer.step();
        (vs, optimizer)
    }

    #[test]
    fn a_checkpoint_is_read_once_and_restored_without_reading_its_files_again() {
        let run = ddp_testkit::temp_dir("ddp-train-read-once");
        let (vs, optimizer) = trained(1);
        let st = state(3, 0.01);
        let model_path = save(run.path(), &vs, &optimizer, &st).unwrap();
        let saved = read(&model_path).unwrap();
        assert_eq!(saved.state, st);
        assert_eq!(saved.model.path, model_path);
        assert_eq!(saved.optimizer.path, state_path(&model_path));
        // Restoring takes what was read: the files can be gone by then.
        std::fs::remove_dir_all(checkpoint_dir(run.path())).unwrap();
        let (vs2, mut optimizer2) = trained(2);
        assert_eq!(saved.restore(&vs2, &mut optimizer2).unwrap(), st);
        let model = |vs: &VarStore| checkpoint::named_tensors(vs);
        for ((name, a), (_, b)) in model(&vs).iter().zip(&model(&vs2)) {
            assert!(a.equal(b), "{name} differs after the restore");
        }
        let moments = |o: &Optimizer| o.state_tensors();
        for ((name, a), (_, b)) in moments(&optimizer).iter().zip(&moments(&optimizer2)) {
            assert!(a.equal(b), "{name} differs after the restore");
        }
        assert_eq!(optimizer2.steps(), st.optimizer_steps);
    }

    #[test]
    fn latest_must_name_a_file_of_the_checkpoint_folder() {
        let run = ddp_testkit::temp_dir("ddp-train-latest");
        let dir = checkpoint_dir(run.path());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("latest"), "epoch-0003\n").unwrap();
        assert_eq!(
            resolve("latest", Some(run.path())).unwrap(),
            dir.join("epoch-0003.safetensors")
        );
        for bad in ["../../etc/passwd", "/tmp/x", "..", "a b", ""] {
            std::fs::write(dir.join("latest"), bad).unwrap();
            match resolve("latest", Some(run.path())) {
                Err(TrainError::Invalid(m)) => assert!(m.contains("not a checkpoint"), "{m}"),
                other => panic!("{bad:?} was accepted: {other:?}"),
            }
        }
    }

    /// A `latest` that is there but unreadable, or not text, is named as such: "does not
    /// exist" would contradict a restart, which refuses to start over beside it.
    #[test]
    fn an_unreadable_latest_is_not_called_missing() {
        let run = ddp_testkit::temp_dir("ddp-train-latest-unreadable");
        let latest = checkpoint_dir(run.path()).join("latest");
        std::fs::create_dir_all(checkpoint_dir(run.path())).unwrap();
        std::fs::write(&latest, b"epoch-0001\xff\n").unwrap();
        match resolve("latest", Some(run.path())) {
            Err(TrainError::Invalid(m)) => assert!(
                m.contains("names 'epoch-0001\u{fffd}', not a checkpoint of this folder")
                    && m.contains("write the name of one of the folder's checkpoints into it"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
        std::fs::remove_file(&latest).unwrap();
        std::fs::create_dir(&latest).unwrap();
        match resolve("latest", Some(run.path())) {
            Err(TrainError::Io { what, source }) => {
                assert_eq!(what, format!("cannot read {}", latest.display()));
                assert_eq!(source.kind(), std::io::ErrorKind::IsADirectory);
            }
            other => panic!("{other:?}"),
        }
    }

    /// A best that is not finite (as checkpoints written before only finite ones could be
    /// the best may hold, as `null`) reads as no best, and the checkpoint as the rest.
    #[test]
    fn a_checkpoint_with_an_infinite_best_is_read_without_it() {
        let run = ddp_testkit::temp_dir("ddp-train-infinite-best");
        let (vs, optimizer) = trained(1);
        let (inf, finite) = (
            f64::INFINITY,
            Best {
                value: 0.5,
                epoch: 2,
            },
        );
        let mut st = state(2, 0.01);
        st.bests = BTreeMap::from([
            (
                "best-loss.safetensors".into(),
                Best {
                    value: inf,
                    epoch: 1,
                },
            ),
            ("best-macro.safetensors".into(), finite),
        ]);
        let early = |best| {
            Some(EarlyStopState {
                best,
                bad_epochs: 1,
            })
        };
        st.early_stopping = early(Some(Best {
            value: -inf,
            epoch: 1,
        }));
        let back = read(&save(run.path(), &vs, &optimizer, &st).unwrap()).unwrap();
        let expected = BTreeMap::from([("best-macro.safetensors".to_owned(), finite)]);
        assert_eq!(back.state.bests, expected);
        assert_eq!(back.state.early_stopping, early(None));
    }

    #[test]
    fn resume_takes_a_run_its_checkpoint_folder_or_either_file_of_a_checkpoint() {
        let run = ddp_testkit::temp_dir("ddp-train-resume-forms");
        let dir = checkpoint_dir(run.path());
        std::fs::create_dir_all(&dir).unwrap();
        let text = |p: &Path| p.to_str().unwrap().to_owned();
        // A folder without checkpoints is refused, naming what it lacks.
        match resolve(&text(run.path()), None) {
            Err(TrainError::Invalid(m)) => {
                assert!(m.contains("a folder without checkpoints (no "), "{m}");
                assert!(m.contains("checkpoints/latest"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        std::fs::write(dir.join("latest"), "epoch-0002").unwrap();
        for f in ["epoch-0002.safetensors", "epoch-0002.state.safetensors"] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let model = dir.join("epoch-0002.safetensors");
        for given in [
            text(run.path()),
            text(&dir),
            text(&model),
            text(&dir.join("epoch-0002.state.safetensors")),
        ] {
            assert_eq!(resolve(&given, None).unwrap(), model, "{given}");
        }
        // Weights without a training state beside them: pointed to --init-from.
        let best = run.path().join("best-macro.safetensors");
        std::fs::write(&best, b"").unwrap();
        match read(&best) {
            Err(TrainError::Invalid(m)) => {
                assert!(m.contains("holds weights only"), "{m}");
                assert!(
                    m.contains("best-macro.state.safetensors does not exist"),
                    "{m}"
                );
                assert!(m.contains("--init-from"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn states_no_run_can_continue_from_are_refused() {
        let file = Path::new("c/epoch-0001.state.safetensors");
        assert!(check_state(&state(3, 0.1), file).is_ok());
        for (bad, what) in [
            (state(u64::MAX, 0.1), "epoch 18446744073709551615"),
            (state(3, f64::NAN), "learning rate NaN"),
            (state(3, -1.0), "learning rate -1"),
        ] {
            match check_state(&bad, file) {
                Err(TrainError::Invalid(m)) => assert!(m.contains(what), "{m}"),
                other => panic!("{what}: {other:?}"),
            }
        }
        let mut negative = state(3, 0.1);
        negative.optimizer_steps = -5;
        assert!(check_state(&negative, file).is_err());
        let mut skipped = state(3, 0.1);
        skipped.skipped_steps = Some(u64::MAX);
        let mut plateau = state(3, 0.1);
        plateau.scheduler = Some(ReduceLrOnPlateau {
            cooldown_counter: u32::MAX,
            ..ReduceLrOnPlateau::new(crate::scheduler::PlateauConfig::default())
        });
        for (bad, what) in [
            (skipped, "(18446744073709551615 skipped steps)"),
            (
                plateau,
                "(plateau scheduler at 0 bad epochs, 4294967295 of its 0 epochs of cooldown)",
            ),
        ] {
            match check_state(&bad, file) {
                Err(TrainError::Invalid(m)) => assert!(m.contains(what), "{m}"),
                other => panic!("{what}: {other:?}"),
            }
        }
        // A cooldown as long as a u32 holds ("reduce once, then never") is a run's own.
        let config = crate::scheduler::PlateauConfig {
            cooldown: u32::MAX,
            patience: 0,
            ..Default::default()
        };
        let mut plateau = ReduceLrOnPlateau::new(config);
        plateau.step(1.0, crate::Goal::Max, 0.1);
        plateau.step(0.5, crate::Goal::Max, 0.1);
        assert_eq!(plateau.cooldown_counter, u32::MAX);
        let mut long = state(3, 0.1);
        long.scheduler = Some(plateau);
        check_state(&long, file).unwrap();
    }

    /// The run's skipped steps: recorded apart from the scaler, or in older checkpoints
    /// only in its state.
    #[test]
    fn skipped_steps_are_read_apart_from_the_scaler_or_from_it() {
        let old = r#"{"epoch":3,"optimizer_steps":30,"lr":0.001,"scheduler":null,"seed":1,
            "config":{},"grad_scaler":{"scale":1024.0,"growth_tracker":5,"skipped_steps":4}}"#;
        let st: TrainState = serde_json::from_str(old).unwrap();
        assert_eq!((st.skipped_steps, st.skipped_steps()), (None, 4));
        let fp32 = TrainState {
            grad_scaler: None,
            skipped_steps: Some(6),
            ..st.clone()
        };
        let text = serde_json::to_string(&fp32).unwrap();
        assert!(text.contains(r#""skipped_steps":6"#), "{text}");
        let read: TrainState = serde_json::from_str(&text).unwrap();
        assert_eq!(read.skipped_steps(), 6);
        assert_eq!(state(1, 0.1).skipped_steps(), 0);
    }

    #[test]
    fn ranks_that_would_resume_differently_all_get_one_error_naming_both() {
        let path = Path::new("run/checkpoints/epoch-0002.safetensors");
        let a = resume_key(path, Some(&state(2, 0.1)));
        assert_eq!(
            a,
            "epoch-0002.safetensors (epoch 2, step 0, 8 optimizer steps, lr 1e-1)"
        );
        let b = resume_key(Path::new("epoch-0001.safetensors"), Some(&state(1, 0.1)));
        let same = vec![a.clone().into_bytes(); 3];
        assert!(check_resume_agreement(&same).is_ok());
        let mixed = vec![a.clone().into_bytes(), a.into_bytes(), b.into_bytes()];
        match check_resume_agreement(&mixed) {
            Err(TrainError::Invalid(m)) => {
                assert!(
                    m.contains("rank 0 from epoch-0002") && m.contains("rank 2 from epoch-0001"),
                    "{m}"
                )
            }
            other => panic!("{other:?}"),
        }
        let fresh = vec![b"none".to_vec(), b"epoch-0001.safetensors".to_vec()];
        assert!(check_resume_agreement(&fresh).is_err());
    }

    #[test]
    fn the_resume_key_and_the_check_cover_the_allocation() {
        let mut st = state(1, 0.1);
        st.allocation = Some(Allocation {
            world_size: 2,
            batch_size: 16,
            accumulate: 1,
        });
        st.position = Some(Position {
            epoch: 2,
            step: 4,
            loss_sum: 1.0,
            samples: 128,
            train_seconds: 1.0,
            grad_norm_sum: 0.0,
            grad_norm_steps: None,
            skipped_steps: 0,
            consumed: Some(128),
            epoch_end: Some(256),
        });
        assert_eq!(
            resume_key(Path::new("epoch-0002-step-000004.safetensors"), Some(&st)),
            "epoch-0002-step-000004.safetensors (epoch 1, step 4, 8 optimizer steps, lr 1e-1, \
             written on 2 rank(s) x batch 16 x accumulate 1 (global batch 32), 128 samples \
             consumed)"
        );
        let file = Path::new("s");
        assert!(check_state(&st, file).is_ok());
        let mut past = st.clone();
        past.position.as_mut().unwrap().consumed = Some(300);
        match check_state(&past, file) {
            Err(TrainError::Invalid(m)) => {
                assert!(m.contains("300 samples consumed of an epoch of 256"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        let mut huge = st.clone();
        huge.train_samples = Some(1000);
        huge.position.as_mut().unwrap().epoch_end = Some(1 << 39);
        match check_state(&huge, file) {
            Err(TrainError::Invalid(m)) => assert!(
                m.contains("an epoch of 549755813888 samples on a data set of 1000"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
        huge.position.as_mut().unwrap().epoch_end = Some(1000 + (1 << 20));
        assert!(check_state(&huge, file).is_ok());
        let mut empty = st;
        empty.allocation.as_mut().unwrap().batch_size = 0;
        match check_state(&empty, file) {
            Err(TrainError::Invalid(m)) => {
                assert!(m.contains("allocation 2 rank(s) x batch 0"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// Mostly a plausible count, often an edge where arithmetic overflows, sometimes
        /// anything.
        fn edgy() -> impl Strategy<Value = u64> {
            prop_oneof![
                3 => 0..1000u64,
                1 => prop_oneof![
                    Just((1 << 40) - 1),
                    Just(1 << 40),
                    Just(u64::from(u32::MAX)),
                    Just(u64::MAX - 1),
                    Just(u64::MAX),
                ],
                1 => any::<u64>(),
            ]
        }

        /// Mostly a plausible rate or scale, sometimes any float (NaN, infinities, negative).
        fn real() -> impl Strategy<Value = f64> {
            prop_oneof![3 => 0.0..70000.0f64, 1 => proptest::num::f64::ANY]
        }

        fn any_position() -> impl Strategy<Value = Option<Position>> {
            let counts = (edgy(), edgy(), edgy(), proptest::option::of(edgy()), edgy());
            proptest::option::of(counts.prop_map(
                |(epoch, step, samples, grad_norm_steps, skipped_steps)| Position {
                    epoch,
                    step: step as usize,
                    loss_sum: 0.0,
                    samples: samples as usize,
                    train_seconds: 0.0,
                    grad_norm_sum: 0.0,
                    grad_norm_steps,
                    skipped_steps,
                    consumed: None,
                    epoch_end: None,
                },
            ))
        }

        /// A plateau scheduler with any counts.
        fn any_scheduler() -> impl Strategy<Value = Option<ReduceLrOnPlateau>> {
            proptest::option::of(
                (edgy(), edgy()).prop_map(|(bad, cooldown)| ReduceLrOnPlateau {
                    num_bad_epochs: bad as u32,
                    cooldown_counter: cooldown as u32,
                    ..ReduceLrOnPlateau::new(crate::scheduler::PlateauConfig::default())
                }),
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

            /// Whatever numbers a state file holds, a state that passes the check can be
            /// continued from without overflow.
            #[test]
            fn a_state_that_passes_the_check_cannot_overflow(
                epoch in edgy(),
                position in any_position(),
                optimizer_steps in edgy(),
                lr in real(),
                scaler in proptest::option::of((real(), edgy(), edgy())),
                skipped_steps in proptest::option::of(edgy()),
                scheduler in any_scheduler(),
                bad_epochs in proptest::option::of(edgy()),
            ) {
                // What a continued run may still add to each count.
                const MORE: u64 = 1 << 20;
                let (optimizer_steps, bad_epochs) =
                    (optimizer_steps as i64, bad_epochs.map(|b| b as u32));
                let st = TrainState {
                    position,
                    optimizer_steps,
                    grad_scaler: scaler.map(|(scale, growth_tracker, skipped_steps)| {
                        crate::amp::ScalerState {
                            scale,
                            growth_tracker,
                            skipped_steps,
                        }
                    }),
                    skipped_steps,
                    scheduler,
                    early_stopping: bad_epochs.map(|bad_epochs| EarlyStopState {
                        best: None,
                        bad_epochs,
                    }),
                    ..state(epoch, lr)
                };
                if check_state(&st, Path::new("s")).is_ok() {
                    prop_assert!(st.epoch.checked_add(MORE).is_some());
                    if let Some(p) = st.position {
                        prop_assert!(p.epoch >= 1 && p.epoch.checked_add(MORE).is_some());
                        prop_assert!(p.step.checked_add(MORE as usize).is_some());
                        prop_assert!(p.samples.checked_add(MORE as usize).is_some());
                        prop_assert!(p.skipped_steps.checked_add(MORE).is_some());
                        let norms = p.grad_norm_steps.unwrap_or(0);
                        prop_assert!(norms.checked_add(MORE).is_some());
                    }
                    prop_assert!(st.optimizer_steps >= 0);
                    prop_assert!(st.optimizer_steps.checked_add(MORE as i64).is_some());
                    prop_assert!(st.lr.is_finite() && st.lr >= 0.0);
                    if let Some(s) = st.grad_scaler {
                        prop_assert!(s.scale.is_finite() && s.scale > 0.0);
                        prop_assert!(s.growth_tracker.checked_add(MORE).is_some());
                        prop_assert!(s.skipped_steps.checked_add(MORE).is_some());
                    }
                    // The schedules' clock: optimizer steps taken and skipped, and more.
                    let attempted = (st.optimizer_steps as u64)
                        .checked_add(st.skipped_steps())
                        .and_then(|t| t.checked_add(2 * MORE));
                    prop_assert!(attempted.is_some());
                    if let Some(r) = st.scheduler {
                        prop_assert!(r.num_bad_epochs.checked_add(MORE as u32).is_some());
                        // Only counts down.
                        prop_assert!(r.cooldown_counter <= r.config.cooldown);
                    }
                    if let Some(e) = st.early_stopping {
                        prop_assert!(e.bad_epochs.checked_add(MORE as u32).is_some());
                    }
                }
            }

            /// A damaged state text is an error or a state, never a panic.
            #[test]
            fn a_damaged_state_text_never_panics(
                changes in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            ) {
                let mut st = state(4, 0.01);
                st.position = Some(Position {
                    epoch: 5,
                    step: 3,
                    loss_sum: 1.5,
                    samples: 12,
                    train_seconds: 2.0,
                    grad_norm_sum: 0.0,
                    grad_norm_steps: None,
                    skipped_steps: 0,
                    consumed: None,
                    epoch_end: None,
                });
                let mut text = serde_json::to_vec(&st).unwrap();
                for (at, value) in changes {
                    let i = at.index(text.len());
                    text[i] = value;
                }
                if let Ok(read) = serde_json::from_slice::<TrainState>(&text) {
                    let _ = check_state(&read, Path::new("s"));
                }
            }

            /// Whatever `latest` holds, it resolves to a model file inside the run's
            /// checkpoint folder, or to an error.
            #[test]
            fn any_latest_resolves_inside_the_folder_or_fails(
                name in proptest::collection::vec(any::<u8>(), 0..40),
            ) {
                let dir = ddp_testkit::temp_dir("ddp-train-fuzz-latest");
                let run = dir.path();
                std::fs::create_dir_all(checkpoint_dir(run)).unwrap();
                std::fs::write(checkpoint_dir(run).join("latest"), &name).unwrap();
                if let Ok(path) = resolve("latest", Some(run)) {
                    let folder = checkpoint_dir(run);
                    prop_assert_eq!(path.parent(), Some(folder.as_path()));
                    let file = path.file_name().unwrap().to_string_lossy().into_owned();
                    prop_assert!(file.ends_with(".safetensors"), "{}", file);
                    prop_assert!(!file.starts_with('.'), "{}", file);
                }
            }
        }
    }
}
