//! The [`Trainer`]: epochs of distributed training and exact distributed evaluation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ddp_comm::ProcessGroup;
use ddp_sampler::DistributedSampler;
use tch::{nn, Device};

use crate::allocation::{Allocation, EpochRest, Plan};
use crate::amp::GradScaler;
use crate::ddp::DistributedDataParallel;
use crate::optim::Optimizer;
use crate::scheduler::ReduceLrOnPlateau;
use crate::settings::Settings;
use crate::state::{Best, EarlyStopState, Position};
use crate::stop::Budget;
use crate::task::Task;

// One file per job. This one: the `Trainer` and its accessors (the public reports are the
// crate's `report.rs`, below both the Trainer and the plots).
// - `startup.rs`: `Trainer::new`: settings, data and samplers, the process group,
//   `config.json`; `restore.rs`: the model, its initial weights or a restored checkpoint
//   (also by itself after a launcher's restart), the ranks' agreement on it;
//   `agreement.rs`: the ranks' agreement on their settings, build and data;
// - `run_dir.rs`: the run directory: whether a start continues its run, rank 0's lock, the
//   rewind, the best models and stale temporaries;
// - `loops.rs`: `Trainer::run`, the epoch loop, one epoch's training steps, the loaders;
// - `non_finite.rs`: a NaN or infinite loss on some rank, decided alike on every rank;
// - `checkpoint.rs`: the ranks' agreement before each step to stop or checkpoint, and the
//   run's state that a checkpoint holds; `changes.rs`: what a resume or evaluation changes;
// - `freeze.rs`: frozen parameters and the epoch they unfreeze at;
// - `eval.rs`: `Trainer::evaluate` and each epoch's exact distributed evaluation;
// - `outputs.rs`: what goes into the run directory: rank 0's end of an epoch
//   (`metrics.jsonl`, `curves.png`, best-model files, checkpoint) and every rank's log;
// - `progress.rs`: rank 0's progress bar or progress lines;
// - `faults.rs`: the fault tests' injected failures (feature `fault-injection` only).
mod agreement;
mod best_files;
mod changes;
mod checkpoint;
mod eval;
mod faults;
mod freeze;
mod loops;
mod mounts;
mod non_finite;
mod outputs;
mod progress;
mod reads;
mod restore;
mod run_dir;
mod startup;

use crate::report::{EpochReport, EvalReport};
use outputs::RankLog;
#[cfg(feature = "cli")]
pub(crate) use startup::default_run_dir;

/// A rank's whole training run of a [`Task`].
///
/// The Trainer: epochs of distributed training and exact distributed evaluation of any
/// [`Task`].
///
/// Per epoch, on every rank, the collectives come in this fixed order. For each optimizer
/// step: one all-reduce of two flags that agree on a stop or a checkpoint (when some rank
/// watches stop signals, has a time limit or timed checkpoints, as by default: agreed by one
/// all-reduce at the run's first such check, as each rank's runtime settings are its own); rank 0's buffer
/// broadcast before the step's first micro-batch (with `broadcast_buffers`); during and
/// after the last micro-batch's backward, one all-reduce per gradient bucket, then one of
/// the parameters' use counts (at the end of the first step, also one broadcast of the
/// rebuilt bucket order); without fp16's scaler, a step whose averaged gradients are not
/// finite adds one all-reduce of which ranks saw a non-finite loss. Then one all-reduce of the epoch's
/// loss and sample counts; then the evaluation's (an agreement per round of batches), one
/// all-reduce of the validation statistics and one all-gather of their per-sample rows, for
/// statistics that have them ([`crate::Stats::rows`]). Rank 0 alone writes the run's files
/// (checkpoints, within an epoch too, and metrics) and prints progress; each rank writes
/// its own log.
///
/// A process runs one Trainer at a time (a rank is a process). Its randomness comes from
/// libtorch's generator, one per process, which it seeds ([`tch::manual_seed`]) before the
/// model's initial weights and before each step's dropout, and it sets libtorch's CPU thread
/// count: Trainers in parallel threads of one process would draw from each other's seeds, and
/// neither run would be reproducible or resume exactly. Trainers one after another are.
pub struct Trainer<T: Task> {
    task: T,
    settings: Settings,
    pg: Arc<ProcessGroup>,
    device: Device,
    threads: usize,
    out: PathBuf,
    /// Rank 0's lock on the run directory, held while the Trainer lives.
    _run_lock: Option<std::fs::File>,
    vs: nn::VarStore,
    model: T::Model,
    ddp: DistributedDataParallel,
    /// The statistics of SyncBatchNorm (`Settings::sync_batchnorm`), whose failures end the
    /// step.
    sync_bn: Option<Arc<crate::functional::GroupReducer>>,
    optimizer: Optimizer,
    /// The model's parameters (what requires a gradient when built), in DDP order.
    parameters: Vec<String>,
    /// Those of them frozen now (`Settings::freeze`), in the same order.
    frozen: Vec<String>,
    /// Whether a launcher restarted this job (torchrun's restart count above 0).
    restarted: bool,
    /// fp16's loss scaler (`None` in other precisions).
    scaler: Option<GradScaler>,
    /// Optimizer steps the scaler skipped since the run began, kept apart from it: a run
    /// resumed in another precision keeps counting them.
    skipped_steps: u64,
    /// Samples of the optimizer steps attempted since the run began (the plan's global batch
    /// per step under a binding cap): where per-step schedules stand, over the plan's global
    /// batch.
    scheduled_samples: u64,
    /// Early stopping's count (`None` without early stopping).
    early: Option<EarlyStopState>,
    scheduler: Option<ReduceLrOnPlateau>,
    start_epoch: u64,
    /// Where a checkpoint taken inside an epoch left off, and where that epoch continues.
    start_position: Option<(Position, EpochRest)>,
    /// The ranks and batches this run trains on.
    allocation: Allocation,
    /// The run's planned length (per-step schedules run over it).
    plan: Plan,
    /// What changed when this run resumed a checkpoint of another allocation (for
    /// `config.json` and the first epoch's line of `metrics.jsonl`).
    allocation_change: Option<serde_json::Value>,
    budget: Budget,
    /// The stop signals, watched from the start of a training run (with
    /// `RuntimeSettings::stop_on_signals`): a stop asked for while the rank starts is taken
    /// at the first step, as one asked for later. `run` takes it; `evaluate` uses it, and
    /// leaves it to a later `run`.
    signals: Option<crate::stop::SignalWatch>,
    /// Which stop checks every rank takes part in, agreed at the first one.
    stop_checks: Option<eval::StopChecks>,
    last_checkpoint: Instant,
    /// Why, where (epoch and its steps done) and with which checkpoint the run stopped, once
    /// `run` returned `TrainError::Stopped`: a later `run` refuses.
    stopped: Option<(crate::stop::StopReason, u64, usize, PathBuf)>,
    /// The epoch `run` is in, from its start until the call returns `Ok`: set when a call
    /// failed in an epoch, whose model, optimizer and position may hold part of it; a later
    /// `run` refuses.
    failed_in: Option<u64>,
    bests: BTreeMap<String, Best>,
    history: Vec<EpochReport>,
    log: RankLog,
    train_set: T::Data,
    val_set: Option<T::Data>,
    train_sampler: DistributedSampler,
    val_sampler: Option<DistributedSampler>,
}

impl<T: Task> std::fmt::Debug for Trainer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("rank", &self.pg.rank())
            .field("device", &self.device)
            .field("out", &self.out)
            .finish_non_exhaustive()
    }
}

impl<T: Task> Trainer<T> {
    /// The run directory.
    pub fn out_dir(&self) -> &Path {
        &self.out
    }

    /// The process group the ranks train in.
    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    /// The model.
    pub fn model(&self) -> &T::Model {
        &self.model
    }

    /// The model's variables (on the rank's device).
    pub fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }

    /// The task.
    pub fn task(&self) -> &T {
        &self.task
    }

    /// The device this rank trains on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The best value so far of each best-model monitor (`Settings::monitors`), by its
    /// model file's name, the same on every rank; a monitor whose metric was never finite has
    /// none.
    pub fn bests(&self) -> &BTreeMap<String, Best> {
        &self.bests
    }
}
