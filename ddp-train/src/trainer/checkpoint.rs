//! Checkpoints inside an epoch and requested stops: before each step the ranks agree whether
//! to stop or checkpoint (and between the rounds of an epoch's evaluation whether to stop),
//! rank 0 writes the checkpoint, and on a stop every rank returns [`TrainError::Stopped`];
//! and the run's state that every checkpoint holds.

use std::path::Path;
use std::time::{Duration, Instant};

use ddp_comm::ReduceOp;
use ddp_data::Dataset;

use super::{changes, Trainer};
use crate::allocation::{self, Allocation, EpochRest, Plan, Saved};
use crate::amp::GradScaler;
use crate::error::{SettingError, TrainError};
use crate::lr_schedule::LrSchedule;
use crate::optim::OptimizerConfig;
use crate::scheduler::PlateauConfig;
use crate::settings::{Settings, MAX_COUNT};
use crate::state::{self, Position, TrainState};
use crate::stop::{SignalWatch, StopReason};
use crate::task::Task;

impl<T: Task> Trainer<T> {
    /// Before each step: the ranks agree whether to stop (a stop signal reached some rank,
    /// or some rank's time budget is spent) and whether to checkpoint (every N optimizer
    /// steps, or M minutes since the last checkpoint on some rank), with one all-reduce of
    /// two numbers; then rank 0 writes the checkpoint of `at`, and on a stop every rank waits
    /// for it and returns [`TrainError::Stopped`].
    pub(super) fn checkpoint_or_stop(
        &mut self,
        at: Position,
        first: usize,
        steps: usize,
        signals: Option<&SignalWatch>,
    ) -> Result<(), TrainError> {
        let s = &self.settings;
        let periodic = at.step > first
            && s.checkpoint
                .every
                .is_some_and(|n| self.attempted_steps().is_multiple_of(n));
        // Whether anything may differ between ranks, and so needs their agreement.
        let checks = self.stop_checks(signals)?;
        let agree = checks.signals || checks.time_limit || checks.timed;
        let s = &self.settings;
        let (stop, checkpoint) = if agree {
            let stop_wish = signals
                .and_then(SignalWatch::received)
                .map(StopReason::Signal)
                .or_else(|| {
                    let last = at.step + 1 == steps;
                    self.budget.must_stop(last).then_some(StopReason::TimeLimit)
                });
            let timed = at.step > first
                && s.checkpoint.minutes.is_some_and(|m| {
                    self.last_checkpoint.elapsed() >= Duration::from_secs_f64(m * 60.0)
                });
            let mut flags = [StopReason::code(stop_wish), i64::from(periodic || timed)];
            self.pg.all_reduce_slice(&mut flags, ReduceOp::Max)?;
            (StopReason::from_code(flags[0]), flags[1] == 1)
        } else {
            (None, periodic)
        };
        if stop.is_none() && !checkpoint {
            return Ok(());
        }
        self.write_position(at, stop)
    }

    /// In an evaluation, before each round of batches: the ranks agree whether to stop (a
    /// stop signal reached some rank, or, in an epoch's evaluation, some rank's time budget
    /// has no room for another round and a save) and whether any rank has a batch left
    /// (`more`: this one), with one all-reduce of two numbers, so that every rank takes as
    /// many rounds. On a stop in an epoch's evaluation (`at`: the epoch's end) rank 0 writes
    /// the checkpoint of `at`, from which a resumed run evaluates the epoch, and every rank
    /// returns [`TrainError::Stopped`]; in [`Trainer::evaluate`]'s (no `at`) every rank
    /// returns [`TrainError::EvaluationStopped`]. Else returns whether some rank has a batch
    /// left.
    pub(super) fn stop_in_evaluation(
        &mut self,
        at: Option<Position>,
        signals: Option<&SignalWatch>,
        more: bool,
    ) -> Result<bool, TrainError> {
        let wish = signals
            .and_then(SignalWatch::received)
            .map(StopReason::Signal)
            .or_else(|| {
                (at.is_some() && self.budget.must_stop_evaluating())
                    .then_some(StopReason::TimeLimit)
            });
        let mut flags = [StopReason::code(wish), i64::from(more)];
        self.pg.all_reduce_slice(&mut flags, ReduceOp::Max)?;
        match (StopReason::from_code(flags[0]), at) {
            (Some(reason), Some(at)) => self.write_position(at, Some(reason))?,
            (Some(reason), None) => {
                let rank = self.pg.rank();
                self.log
                    .say(&format!("rank {rank}: stopping the evaluation ({reason})"));
                return Err(TrainError::EvaluationStopped { reason });
            }
            (None, _) => {}
        }
        Ok(flags[1] == 1)
    }

    /// Rank 0 writes the checkpoint of `at` (every rank adds its sums); on a `stop` every
    /// rank waits for it and returns [`TrainError::Stopped`].
    fn write_position(&mut self, at: Position, stop: Option<StopReason>) -> Result<(), TrainError> {
        // The sums of every rank so far, for the epoch's report after a resume.
        let mut sums = [at.loss_sum, at.samples as f64];
        self.pg.all_reduce_slice(&mut sums, ReduceOp::Sum)?;
        let st = TrainState {
            epoch: at.epoch - 1,
            position: Some(Position {
                loss_sum: sums[0],
                samples: sums[1] as usize,
                ..at
            }),
            // Not yet in `metrics.jsonl`: the start that ends the epoch records it.
            allocation_change: self.allocation_change.clone(),
            ..self.train_state()
        };
        let name = state::stem_of(&st);
        let path = state::checkpoint_dir(&self.out).join(format!("{name}.safetensors"));
        if self.pg.rank() == 0 {
            let saving = Instant::now();
            state::save(&self.out, &self.vs, &self.optimizer, &st)?;
            if let Some(reason) = stop {
                state::mark_stopped(&self.out, &name, &reason.to_string())?;
            }
            self.budget.save_took(saving.elapsed());
            let removed = state::prune_steps(&self.out, self.settings.checkpoint.keep)?;
            let mut note = format!("checkpoint {}", path.display());
            if !removed.is_empty() {
                note.push_str(&format!(" (removed {})", removed.join(", ")));
            }
            self.log.say(&note);
        }
        self.last_checkpoint = Instant::now();
        let Some(reason) = stop else {
            return Ok(());
        };
        // Nobody leaves before rank 0's checkpoint is complete.
        self.pg.barrier()?;
        self.log.say(&format!(
            "rank {}: stopping at epoch {} step {} ({reason}) after {:.1} s",
            self.pg.rank(),
            at.epoch,
            at.step,
            self.budget.elapsed().as_secs_f64()
        ));
        Err(TrainError::Stopped {
            reason,
            epoch: at.epoch,
            step: at.step,
            checkpoint: path,
            run: self.out.clone(),
        })
    }

    /// Optimizer steps taken and skipped by the scaler since the run began (in whatever
    /// precision each part of it trained): what per-step schedules and `--checkpoint-every`
    /// count (a skipped step leaves the optimizer's count alone, and PyTorch's loop steps its
    /// scheduler after every `scaler.step`).
    pub(super) fn attempted_steps(&self) -> u64 {
        self.optimizer.steps() as u64 + self.skipped_steps
    }

    /// The run's scalar state after its last optimizer step (at an epoch's end).
    pub(super) fn train_state(&self) -> TrainState {
        TrainState {
            epoch: 0,
            position: None,
            optimizer_steps: self.optimizer.steps(),
            lr: self.optimizer.lr(),
            scheduler: self.scheduler.clone(),
            bests: self.bests.clone(),
            early_stopping: self.early,
            grad_scaler: self.scaler.as_ref().map(GradScaler::state),
            skipped_steps: Some(self.skipped_steps),
            seed: self.settings.seed,
            train_samples: Some(self.train_set.len()),
            allocation: Some(self.allocation),
            plan: Some(self.plan),
            scheduled_samples: Some(self.scheduled_samples),
            frozen: self.frozen.clone(),
            bucket_order: self.ddp.bucket_order(),
            allocation_change: None,
            config: self.state_config(),
        }
    }

    /// The run's settings and task as its checkpoints record them, and how its ranks ran:
    /// a resume on CPU ranks compares the threads ([`threads_warning`]). `config.json`
    /// starts from it.
    pub(super) fn state_config(&self) -> serde_json::Value {
        let mut config = self.run_config();
        config["world_size"] = self.pg.world_size().into();
        config["device"] = format!("{:?}", self.device).into();
        config["intra_op_threads"] = self.threads.into();
        config
    }

    /// The run's settings and task, as its checkpoints and `config.json` record them.
    pub(super) fn run_config(&self) -> serde_json::Value {
        serde_json::json!({
            "settings": self.settings,
            "task": self.task.describe(),
        })
    }
}

/// What a resume from `st` (read from `path`) cannot continue with: another seed (every
/// epoch's order, and a task's split, derive from it), another optimizer (its state is
/// another's), or, inside an epoch, another number of training samples (the position counts
/// places in the epoch's order of them). A setting error naming what to give.
pub(super) fn refuse_resume(
    st: &TrainState,
    s: &Settings,
    train_samples: usize,
    path: &Path,
) -> Result<(), TrainError> {
    let file = path.display();
    if st.seed != s.seed {
        let why = "every epoch's order (and a task's validation split) derives from it, so the \
                   run cannot continue with another; resume with";
        return Err(other_seed(s.seed, st.seed, &file.to_string(), why)
            .text(", or start a new run from its weights with ")
            .setting("checkpoint.init_from")
            .into());
    }
    let kind = |config: &serde_json::Value| config["kind"].as_str().map(str::to_string);
    let was = kind(&st.config["settings"]["optimizer"]);
    let now = kind(&serde_json::to_value(s.optimizer).unwrap_or_default());
    if let (Some(was), Some(now)) = (was, now) {
        if was != now {
            return Err(SettingError::new(
                "optimizer.kind",
                format!(
                    " {now} is not the optimizer of {file} ({was}), whose state cannot continue \
                     another's: resume with the same "
                ),
            )
            .setting("optimizer.kind")
            .text(", or start a new run from its weights with ")
            .setting("checkpoint.init_from")
            .into());
        }
    }
    // SGD without momentum saved no momentum buffers for the new momentum to continue.
    let saved_momentum = st.config["settings"]["optimizer"]["momentum"].as_f64();
    if let (OptimizerConfig::Sgd(c), Some(0.0)) = (s.optimizer, saved_momentum) {
        if c.momentum != 0.0 && st.optimizer_steps > 0 {
            return Err(SettingError::new(
                "optimizer.momentum",
                format!(
                    " {} cannot continue {file}, which trained without momentum and so holds \
                     no momentum buffers: resume with ",
                    c.momentum
                ),
            )
            .setting("optimizer.momentum")
            .text(" 0, or start a new run from its weights with ")
            .setting("checkpoint.init_from")
            .into());
        }
    }
    if let (Some(p), Some(was)) = (st.position, st.train_samples) {
        if was != train_samples {
            return Err(TrainError::Invalid(format!(
                "{file} stopped inside epoch {} of {was} training samples, and the training set \
                 now has {train_samples}: which samples the epoch has left depends on them; \
                 resume with the same data, or from the checkpoint at that epoch's start",
                p.epoch
            )));
        }
    }
    Ok(())
}

/// `seed` `given`, which differs from the `recorded` seed of `file`: `why` it must not, ending
/// in what to do with the same seed.
fn other_seed(given: u64, recorded: u64, file: &str, why: &str) -> SettingError {
    SettingError::new(
        "seed",
        format!(" {given} differs from the seed {recorded} of {file}: {why} the same "),
    )
    .setting("seed")
}

/// What the run that trained an evaluated model recorded, and where.
pub(super) struct Recorded {
    /// Its settings and task (`{"settings": ..., "task": ...}`).
    record: serde_json::Value,
    /// The file that holds them.
    file: String,
    /// Its seed, where known: a checkpoint's state holds it in every version.
    seed: Option<u64>,
}

/// Loads the model file `path` into `vs` for an evaluation, and returns what the run that
/// trained it recorded: a checkpoint's state file, else the file's own record of the
/// settings it was written under (a best model's), else the `config.json` of the run
/// directory it lies in (an earlier version's best model; the run's last start's settings).
/// `None` for a file of no run (another program's): nothing can be checked against it.
pub(super) fn load_evaluated(
    vs: &tch::nn::VarStore,
    path: &Path,
) -> Result<Option<Recorded>, TrainError> {
    if state::state_path(path).is_file() {
        if let Ok(saved) = state::read(path) {
            ddp_model::checkpoint::load_tensors(vs, &saved.model)?;
            return Ok(Some(Recorded {
                record: saved.state.config,
                file: path.display().to_string(),
                seed: Some(saved.state.seed),
            }));
        }
    }
    let metadata = ddp_model::checkpoint::load(vs, path)?;
    let recorded = path
        .parent()
        .and_then(|dir| state::training_record(path, dir, state::recorded(&metadata)));
    Ok(recorded.map(|(record, file)| {
        // The first version recorded its command line under `config`.
        let seed = [&record["settings"], &record["config"]]
            .iter()
            .find_map(|r| r["seed"].as_u64());
        Recorded { record, file, seed }
    }))
}

/// An evaluation of a model whose run recorded `recorded` with the settings `s` and the task
/// `task`: refuses another seed where the task's validation samples depend on it, and warns
/// of each task key given now whose value differs from the run's.
pub(super) fn check_evaluated<T: Task>(
    recorded: &Recorded,
    s: &Settings,
    task: &T,
) -> Result<Vec<String>, TrainError> {
    let file = &recorded.file;
    if let (Some(seed), true) = (recorded.seed, task.validation_depends_on_seed()) {
        if seed != s.seed {
            let why = "a task's validation split derives from it, so another seed evaluates \
                       other samples, some of which the model may have trained on; evaluate \
                       with";
            return Err(other_seed(s.seed, seed, file, why).into());
        }
    }
    let now = task.describe();
    let locations = (task.location_keys(), task.presence_keys());
    let mut changes = changes::task_changes(&recorded.record, &now, locations);
    // A key the task leaves out now (a training-only one) is not read by the evaluation.
    changes.retain(|(path, _, _)| {
        let key = path.strip_prefix("task.").unwrap_or(path);
        now.get(key.split('.').next().unwrap_or(key)).is_some()
    });
    // Of the settings, the evaluation reads the precision (autocast), as training evaluated.
    let precision = serde_json::to_value(s.precision).unwrap_or_default();
    let was = &recorded.record["settings"]["precision"];
    if !was.is_null() && *was != precision {
        changes.insert(0, ("precision".into(), was.clone(), precision));
    }
    Ok(changes
        .into_iter()
        .map(|(path, was, now)| {
            format!(
                "{path} was {was} in the run that trained the model ({file}) and is {now} in \
                 this evaluation: give {was} to evaluate it as it was trained"
            )
        })
        .collect())
}

/// `config.json`'s record `json` of a run resumed from `from`, which replaces `previous`:
/// keeps what the run's start recorded of its initial weights (`init_weights` and
/// `settings.checkpoint.init_*`; a resume loads none, so needs none given), adds `resumed_from`,
/// and with a plateau scheduler records the learning rate in effect, `lr`, and the
/// scheduler's settings in effect, `plateau` (the checkpoint's, which win over those given).
pub(super) fn keep_start_record(
    json: &mut serde_json::Value,
    previous: &Path,
    from: &Path,
    lr: f64,
    plateau: Option<PlateauConfig>,
) {
    let before = std::fs::read_to_string(previous)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    if let Some(mut before) = before {
        if !before["init_weights"].is_null() {
            json["init_weights"] = before["init_weights"].take();
            for key in ["init_from", "init_partial", "init_key"] {
                let kept = before["settings"]["checkpoint"][key].take();
                json["settings"]["checkpoint"][key] = kept;
            }
        }
    }
    json["resumed_from"] = from.to_string_lossy().into();
    if json["settings"]["lr_schedule"]["kind"] == "plateau" {
        json["settings"]["optimizer"]["lr"] = lr.into();
        if let Some(config) = plateau.and_then(|c| serde_json::to_value(c).ok()) {
            json["settings"]["lr_schedule"]["config"] = config;
        }
    }
}

/// What a resume from `st` takes from the checkpoint rather than from `s`, another number of
/// training samples at an epoch's end, and each setting of `s` or of `task` that differs from
/// the run's: warnings for the log.
pub(super) fn resume_warnings<T: Task>(
    st: &TrainState,
    s: &Settings,
    task: &T,
    train_samples: usize,
) -> Vec<String> {
    let task = (
        &task.describe(),
        (task.location_keys(), task.presence_keys()),
    );
    let mut warnings = changes::changed_settings(st, s, task);
    if let (None, Some(was)) = (st.position, st.train_samples) {
        if was != train_samples {
            warnings.push(format!(
                "the run trained on {was} samples and continues on {train_samples} (a task's \
                 validation split may have changed with them)"
            ));
        }
    }
    let saved = &st.config["settings"];
    if let LrSchedule::Plateau(plateau) = &s.lr_schedule {
        let given = s.optimizer.lr();
        if saved["optimizer"]["lr"]
            .as_f64()
            .is_some_and(|was| was != given)
        {
            warnings.push(format!(
                "learning rate {given:e} is not applied: the run continues at its own {:e}, \
                 which its plateau scheduler keeps (as PyTorch's load_state_dict)",
                st.lr
            ));
        }
        if let Some(kept) = st.scheduler.as_ref().map(|r| r.config) {
            if kept != plateau.config {
                warnings.push(format!(
                    "the plateau scheduler continues with the run's own settings (factor {}, \
                     patience {}, min_lr {:e}), not the ones given",
                    kept.factor, kept.patience, kept.min_lr
                ));
            }
        }
    }
    warnings
}

/// A warning when a run recorded on CPU ranks continues on CPU ranks with another number of
/// intra-op threads each (on as many ranks): libtorch's CPU kernels sum in another order with
/// another thread count, so the weights leave an uninterrupted run's in the last bits.
pub(super) fn threads_warning(
    config: &serde_json::Value,
    device: tch::Device,
    threads: usize,
    world_size: usize,
) -> Option<String> {
    let was = config["intra_op_threads"].as_u64()?;
    let same_ranks = config["world_size"].as_u64() == Some(world_size as u64);
    let on_cpu = config["device"] == "Cpu" && device == tch::Device::Cpu;
    (on_cpu && same_ranks && was != threads as u64).then(|| {
        format!(
            "the run trained with {was} intra-op thread(s) per rank and continues with \
             {threads}: libtorch's CPU results differ in the last bits with the thread count, \
             so the weights will not equal an uninterrupted run's to the byte (give --threads \
             {was} for that)"
        )
    })
}

/// Where the epoch of `st`'s position `p` continues on `now` (whose epochs have `steps_now`
/// steps); an error sentence when it cannot.
pub(super) fn continue_at(
    st: &state::TrainState,
    p: &state::Position,
    now: Allocation,
    steps_now: usize,
) -> Result<EpochRest, String> {
    let setting = |name: &str| st.config["settings"][name].as_u64().map(|v| v as usize);
    let old_batch = setting("batch_size")
        .map(|b| (b, setting("accumulate").unwrap_or(1)))
        .filter(|&(b, a)| b > 0 && a > 0);
    allocation::continue_epoch(
        Saved {
            allocation: st.allocation,
            step: p.step,
            samples: p.samples,
            consumed: p.consumed,
            end: p.epoch_end,
            old_batch,
        },
        now,
        steps_now,
    )
}

/// The plan a run resumed from `st` continues with on `now` (whose epochs have `steps_now`
/// steps), the epoch in progress continuing as `rest`, and the warning when it changes.
///
/// With the epochs it was started for, the run keeps its plan (but for one recorded before
/// its first step: that has no curve to keep, and the plan is this allocation's, as after a
/// kill then). With other epochs, or without a recorded plan, it plans from where it
/// stands: the steps it took (on whatever allocations), the rest of the epoch in progress,
/// then whole epochs on `now`, all in steps of `now`'s global batch (those taken counted by
/// the `scheduled` samples they trained, or, under a cap that binds on `now` or bound where
/// the checkpoint trained (`capped`), as the steps they were). Past its last epoch it
/// continues with nothing, so it warns of no change (`run` says nothing is left). Returns
/// the plan, the warning, and `scheduled` in the plan's unit.
pub(super) fn resumed_plan(
    st: &TrainState,
    rest: Option<&EpochRest>,
    s: &Settings,
    now: Allocation,
    (steps_now, scheduled, capped): (usize, u64, bool),
) -> Result<(Plan, Option<String>, u64), SettingError> {
    let stepped = st.optimizer_steps > 0 || st.skipped_steps() > 0;
    let old_unit = st.plan_global_batch(now.global_batch()).max(1) as u64;
    if let Some(saved) = st.plan.filter(|p| p.epochs == s.epochs && stepped) {
        let global_batch = Some(old_unit as usize);
        return Ok((
            Plan {
                global_batch,
                ..saved
            },
            None,
            scheduled,
        ));
    }
    let unit = now.global_batch().max(1) as u64;
    // Under a binding cap the schedules count steps: those taken, in the old unit.
    let (taken, scheduled) = if capped {
        let steps = scheduled.saturating_add(old_unit / 2) / old_unit;
        (steps, steps.saturating_mul(unit))
    } else {
        (scheduled.saturating_add(unit / 2) / unit, scheduled)
    };
    let left = rest.map(|r| r.steps_left(now, s.max_steps_per_epoch));
    // The epoch the run continues with, and the epochs begun before (that one if inside it).
    let next = st.position.map_or(st.epoch + 1, |p| p.epoch);
    let begun = next - u64::from(left.is_none());
    let so_far = (taken, begun, left.unwrap_or(0));
    let plan = Plan {
        epochs: s.epochs,
        optimizer_steps: planned_steps(s, steps_now, so_far)?,
        global_batch: Some(now.global_batch()),
    };
    let changed = st.plan.filter(|p| p.epochs != s.epochs && next <= s.epochs);
    let warning = changed.map(|saved| {
        format!(
            "the run was planned for {} epochs and continues for {}: per-step schedules now \
             run over {} optimizer steps instead of {}",
            saved.epochs, s.epochs, plan.optimizer_steps, saved.optimizer_steps
        )
    });
    Ok((plan, warning, scheduled))
}

/// The optimizer steps of `s.epochs` epochs of `steps_per_epoch` from where the run stands,
/// `so_far` ([`Plan::steps_from`]): fewer than 2^40, the most a checkpoint counts (so that
/// the run resumes from its own checkpoints), else an error naming `epochs`. An evaluation
/// takes no step: its plan is only saturated.
pub(super) fn planned_steps(
    s: &Settings,
    steps_per_epoch: usize,
    so_far: (u64, u64, usize),
) -> Result<u64, SettingError> {
    let steps = steps_per_epoch as u64;
    let total = Plan::steps_from(s.epochs, steps_per_epoch, so_far);
    if total < MAX_COUNT || s.checkpoint.eval_only {
        return Ok(total);
    }
    Err(SettingError::new(
        "epochs",
        format!(
            " {} times {steps} optimizer steps per epoch must be below 2^40 ({MAX_COUNT}) \
             optimizer steps, the most a checkpoint counts: give fewer, or set ",
            s.epochs
        ),
    )
    .setting("max_steps_per_epoch"))
}

/// The warning of a resume on another allocation: what changes and what does not.
pub(super) fn describe_change(
    before: Allocation,
    now: Allocation,
    (epoch, train_len): (u64, usize),
    rest: Option<&EpochRest>,
    (spe_before, spe_now): (usize, usize),
    (plan, max_steps): (Plan, Option<usize>),
) -> String {
    let unit = plan.global_batch.unwrap_or(before.global_batch());
    // Under a binding cap schedules count steps (see the training loop).
    let capped = now.cap_binds(train_len, max_steps);
    let finish = |mut line: String| {
        line.push_str(&format!(
            "; the learning rate is not changed, and per-step schedules keep their planned {} \
             optimizer steps",
            plan.optimizer_steps
        ));
        if now.global_batch() != unit && !capped {
            line.push_str(&format!(
                " of {unit} samples, which a step of {} advances by {}/{unit} (they follow \
                 the samples trained)",
                now.global_batch(),
                now.global_batch()
            ));
        }
        line
    };
    let mut line = format!("resuming on {now}; the checkpoint was written on {before}: ");
    if before.global_batch() == now.global_batch() {
        if spe_now == spe_before {
            line.push_str(
                "the global batch is the same, so the run continues with the same samples in \
                 the same order and the same optimizer steps",
            );
            return line;
        }
        // Each rank's share is padded to ceil(N / R) and trains whole steps only: with
        // another R the epoch's length can change though the global batch does not.
        line.push_str("the global batch is the same");
        if rest.is_some() {
            line.push_str(&format!(
                ", so the rest of epoch {epoch} takes the same samples in the same order and \
                 the same optimizer steps"
            ));
        }
        line.push_str(&format!(
            ", but epochs take {spe_now} optimizer steps instead of {spe_before} (each \
             rank's share of the {train_len} samples is padded to another length and trains \
             whole steps only)"
        ));
        return finish(line);
    }
    line.push_str(&format!(
        "the global batch changes from {} to {}",
        before.global_batch(),
        now.global_batch()
    ));
    // With --max-steps-per-epoch both can be the cap.
    if spe_now != spe_before {
        line.push_str(&format!(
            ", so epochs take {spe_now} optimizer steps instead of {spe_before}"
        ));
    }
    if let Some(rest) = rest {
        let left = rest.end.saturating_sub(rest.consumed);
        let steps = rest.steps_left(now, None);
        let capped = rest.steps_left(now, max_steps);
        if capped < steps {
            // The cap counts optimizer steps, so smaller steps train less of the epoch.
            let trained = (capped * now.global_batch()).min(left);
            line.push_str(&format!(
                "; the rest of epoch {epoch} ({left} samples) would take {steps} step(s), but \
                 --max-steps-per-epoch {} ends it after {capped} more, so {} of its samples \
                 are not trained",
                max_steps.unwrap_or(0),
                left - trained
            ));
            return finish(line);
        }
        line.push_str(&format!(
            "; the rest of epoch {epoch} ({left} samples) takes {steps} step(s)"
        ));
        let padding = (steps * now.global_batch()).saturating_sub(left);
        // Positions past the epoch's end: below the data set's size, samples the epoch
        // would have left out; from it on, the order again from its start.
        let unseen = padding.min(train_len.saturating_sub(rest.end));
        if padding > unseen && unseen > 0 {
            line.push_str(&format!(
                ", the last one filled with {padding} sample(s) past the epoch's end ({unseen} \
                 it would have left out, {} repeated)",
                padding - unseen
            ));
        } else if padding > 0 {
            let what = if unseen > 0 {
                "sample(s) the epoch would have left out"
            } else {
                "repeated sample(s)"
            };
            line.push_str(&format!(", the last one filled with {padding} {what}"));
        }
    }
    finish(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A resume on CPU ranks with another thread count is warned of; on as many threads,
    /// another number of ranks (no byte-equal promise) or a GPU, it is not.
    #[test]
    fn another_thread_count_on_cpu_is_warned_of() {
        let config = serde_json::json!({"intra_op_threads": 1, "world_size": 2, "device": "Cpu"});
        let cpu = tch::Device::Cpu;
        assert_eq!(
            threads_warning(&config, cpu, 2, 2).as_deref(),
            Some(
                "the run trained with 1 intra-op thread(s) per rank and continues with 2: \
                 libtorch's CPU results differ in the last bits with the thread count, so the \
                 weights will not equal an uninterrupted run's to the byte (give --threads 1 \
                 for that)"
            )
        );
        assert_eq!(threads_warning(&config, cpu, 1, 2), None);
        assert_eq!(threads_warning(&config, cpu, 2, 3), None);
        assert_eq!(threads_warning(&config, tch::Device::Cuda(0), 2, 2), None);
        assert_eq!(threads_warning(&serde_json::json!({}), cpu, 2, 2), None);
    }

    /// 1000 samples on 2 ranks x 16 end their epoch at 992; stopped after 960 and continued
    /// on 4 x 16, the last step is filled with 32 positions: 8 samples the epoch would have
    /// left out (992..1000), then 24 of the order's start again.
    #[test]
    fn the_fill_of_a_changed_epoch_tells_left_out_samples_from_repeats() {
        let on = |world_size, batch_size| Allocation {
            world_size,
            batch_size,
            accumulate: 1,
        };
        let plan = Plan {
            epochs: 1,
            optimizer_steps: 31,
            global_batch: Some(32),
        };
        let rest = |end| EpochRest {
            first_step: 30,
            consumed: 960,
            end,
            changed_from: Some(on(2, 16)),
        };
        let change = |len, end| {
            describe_change(
                on(2, 16),
                on(4, 16),
                (1, len),
                Some(&rest(end)),
                (31, 15),
                (plan, None),
            )
        };
        assert!(
            change(1000, 992).contains(
                "the rest of epoch 1 (32 samples) takes 1 step(s), the last one filled with 32 \
                 sample(s) past the epoch's end (8 it would have left out, 24 repeated)"
            ),
            "{}",
            change(1000, 992)
        );
        assert!(
            change(992, 992).contains("the last one filled with 32 repeated sample(s)"),
            "{}",
            change(992, 992)
        );
        assert!(
            change(2000, 992)
                .contains("the last one filled with 32 sample(s) the epoch would have left out"),
            "{}",
            change(2000, 992)
        );
    }

    /// The reviewer's case: 1024 samples on 4 x 16 capped at 10 steps (640 positions),
    /// stopped after 5 steps, resumed on 2 x 16: the cap leaves 5 steps of 32 for the 320
    /// samples left, so 160 of them are not trained, and the warning says so.
    #[test]
    fn a_capped_epoch_on_a_smaller_global_batch_says_what_it_leaves_untrained() {
        let on = |world_size| Allocation {
            world_size,
            batch_size: 16,
            accumulate: 1,
        };
        let rest = EpochRest {
            first_step: 5,
            consumed: 320,
            end: 640,
            changed_from: Some(on(4)),
        };
        let plan = Plan {
            epochs: 1,
            optimizer_steps: 10,
            global_batch: Some(64),
        };
        let line = describe_change(
            on(4),
            on(2),
            (1, 1024),
            Some(&rest),
            (10, 10),
            (plan, Some(10)),
        );
        assert!(
            line.contains(
                "the rest of epoch 1 (320 samples) would take 10 step(s), but \
                 --max-steps-per-epoch 10 ends it after 5 more, so 160 of its samples are not \
                 trained; the learning rate is not changed"
            ),
            "{line}"
        );
        // The same global batch on ranks whose shares are padded to other lengths: 10
        // samples on 3 ranks x 2 take 2 steps, on 2 ranks x 3 one.
        let alloc = |world_size, batch_size| Allocation {
            world_size,
            batch_size,
            accumulate: 1,
        };
        let (three, two) = (alloc(3, 2), alloc(2, 3));
        let spe = (
            three.steps_per_epoch(10, None),
            two.steps_per_epoch(10, None),
        );
        assert_eq!(spe, (2, 1));
        let same = Plan {
            global_batch: Some(6),
            ..plan
        };
        assert_eq!(
            describe_change(three, two, (2, 10), None, spe, (same, None)),
            format!(
                "resuming on {two}; the checkpoint was written on {three}: the global batch is \
                 the same, but epochs take 1 optimizer steps instead of 2 (each rank's share of \
                 the 10 samples is padded to another length and trains whole steps only); the \
                 learning rate is not changed, and per-step schedules keep their planned 10 \
                 optimizer steps"
            )
        );
        // Without the cap the rest takes its 10 steps, each half a planned one.
        let line = describe_change(on(4), on(2), (1, 1024), Some(&rest), (32, 64), (plan, None));
        assert!(
            line.ends_with(
                "the rest of epoch 1 (320 samples) takes 10 step(s); the learning rate is not \
                 changed, and per-step schedules keep their planned 10 optimizer steps of 64 \
                 samples, which a step of 32 advances by 32/64 (they follow the samples \
                 trained)"
            ),
            "{line}"
        );
    }
}
