//! The training loops: [`Trainer::run`] over the epochs (evaluation, the plateau scheduler
//! and early stopping after each), one epoch's optimizer steps (gradient accumulation, DDP,
//! fp16's scaler, clipping, per-step learning rate and seeds), and the data loaders.

use std::time::Instant;

use ddp_comm::ReduceOp;
use ddp_data::{Batch, Loader, LoaderConfig};
use serde_json::Map;
use tch::Tensor;

use super::faults::{fail_if_injected, hold_if_injected, Point};
use super::non_finite::{non_finite_check, poison};
use super::progress::Progress;
use super::reads::DeviceReads;
use super::{EpochReport, Trainer};
use crate::allocation::EpochRest;
use crate::error::{Context, TrainError};
use crate::lr_schedule::LrSchedule;
use crate::report::watched;
#[cfg(doc)]
use crate::settings::RuntimeSettings;
use crate::state::{Best, Position};
use crate::stop::SignalWatch;
use crate::task::{Stats, Task};

/// What an epoch's training loop returns (all ranks' totals).
struct EpochTraining {
    /// Mean training loss over every rank's samples, but those of micro-batches whose loss
    /// was not finite.
    loss: f64,
    /// Samples trained on, all ranks together.
    samples: usize,
    /// Optimizer steps.
    steps: usize,
    /// Seconds spent training.
    seconds: f64,
    /// Sum of the steps' finite gradient norms (with clipping).
    grad_norm_sum: f64,
    /// How many norms `grad_norm_sum` adds up.
    grad_norm_steps: u64,
    /// Steps the fp16 scaler skipped.
    skipped_steps: u64,
    /// The epoch's end: where a stop during its evaluation checkpoints (this rank's sums).
    end: Position,
}

impl<T: Task> Trainer<T> {
    /// Trains from the start (or resumed) epoch to the last, evaluating after each.
    ///
    /// When a stop is requested (SIGTERM or SIGUSR1 with [`RuntimeSettings::stop_on_signals`], or
    /// the time limit), every rank finishes its step (or its batch of an epoch's evaluation),
    /// rank 0 writes a checkpoint, and every rank returns
    /// [`TrainError::Stopped`]; exit with [`TrainError::exit_code`]. A stop in an epoch's
    /// evaluation checkpoints the epoch's end, from which a resumed run evaluates it.
    ///
    /// A second call continues after the epochs the first one finished: after the last, or
    /// after early stopping, it trains nothing and returns no reports. So does a run resumed
    /// for no more epochs than it finished. After [`TrainError::Stopped`] the Trainer trains
    /// no further: a second call returns [`TrainError::RunAfterStop`] on every rank, having
    /// trained and written nothing (the stop's checkpoint stays the run's `latest`); a new
    /// Trainer on the same run directory continues from the stop. Likewise after any other
    /// error once an epoch began (its model, optimizer and data position may hold part of
    /// it): a second call returns [`TrainError::RunAfterFailure`], and a new Trainer
    /// continues from the run's latest checkpoint. [`Trainer::evaluate`] still works.
    ///
    /// A run resumed after the epoch at which early stopping ended it (a launcher's restart,
    /// a requeued job) trains no further and returns no reports, unless its patience is now
    /// larger than the epochs without improvement.
    ///
    /// A validation split whose per-sample rows would gather past the process group's limit
    /// is refused before the first epoch ([`TrainError::RowsTooLarge`]).
    ///
    /// An error is noted as this process's failure for the launcher (see
    /// [`exit_with`](crate::exit_with)) before it is returned.
    pub fn run(&mut self) -> Result<Vec<EpochReport>, TrainError> {
        let run = self.run_epochs();
        crate::exit::note_failure(&run);
        run
    }

    /// [`Trainer::run`]'s epochs.
    fn run_epochs(&mut self) -> Result<Vec<EpochReport>, TrainError> {
        if let Some((reason, epoch, step, checkpoint)) = &self.stopped {
            return Err(TrainError::RunAfterStop {
                reason: *reason,
                epoch: *epoch,
                step: *step,
                checkpoint: checkpoint.clone(),
                run: self.out.clone(),
            });
        }
        if let Some(epoch) = self.failed_in {
            return Err(TrainError::RunAfterFailure {
                epoch,
                run: self.out.clone(),
            });
        }
        let ran = self.run_remaining_epochs();
        if ran.is_ok() {
            self.failed_in = None;
        }
        if let Err(TrainError::Stopped {
            reason,
            epoch,
            step,
            checkpoint,
            ..
        }) = &ran
        {
            self.stopped = Some((*reason, *epoch, *step, checkpoint.clone()));
        }
        ran
    }

    /// [`Trainer::run`]'s epochs, from where the Trainer stands.
    fn run_remaining_epochs(&mut self) -> Result<Vec<EpochReport>, TrainError> {
        if let Some(note) = self
            .ended_by_early_stopping()
            .or_else(|| self.past_the_last_epoch())
        {
            self.log.say(&note);
            return Ok(Vec::new());
        }
        self.check_rows_fit()?;
        let signals = match self.signals.take() {
            Some(watch) => Some(watch),
            None if self.settings.runtime.stop_on_signals => {
                Some(crate::stop::watch_stop_signals().map_err(TrainError::Invalid)?)
            }
            None => None,
        };
        let mut all = Vec::new();
        for epoch in self.start_epoch..=self.settings.epochs {
            self.failed_in = Some(epoch);
            self.freeze_for_epoch(epoch)?;
            let lr_at_start = self.optimizer.lr();
            let resumed = self.start_position.take().filter(|(p, _)| p.epoch == epoch);
            let trained = self.train_epoch(epoch, resumed, signals.as_ref())?;
            let lr = if self.settings.lr_schedule.per_step() {
                self.optimizer.lr()
            } else {
                lr_at_start
            };
            let evaluating = Instant::now();
            let evaluated = self.evaluate_epoch(epoch, Some(trained.end), signals.as_ref())?;
            self.budget.eval_took(evaluating.elapsed());
            fail_if_injected(self.pg.rank(), Point::End(epoch), self.restarted);
            let (val_loss, summary, metrics) = match &evaluated {
                Some((loss, stats)) => (Some(*loss), stats.summary(), stats.report().into_map()),
                None => (None, String::new(), Map::new()),
            };
            let beside_best = evaluated.as_ref().and_then(|(_, s)| s.beside_best_model());
            let report = EpochReport {
                epoch,
                train_loss: trained.loss,
                val_loss,
                metrics,
                lr,
                grad_norm: self
                    .settings
                    .clip_grad_norm
                    .map(|_| trained.grad_norm_sum / trained.grad_norm_steps.max(1) as f64),
                skipped_steps: self.scaler.as_ref().map(|_| trained.skipped_steps),
                images_per_sec: trained.samples as f64 / trained.seconds.max(1e-9),
                epoch_seconds: trained.seconds + evaluating.elapsed().as_secs_f64(),
                steps: trained.steps,
                world_size: self.pg.world_size(),
                // The first epoch this run trains records it.
                allocation_change: self.allocation_change.take(),
            };
            if let (LrSchedule::Plateau(p), Some(sched)) =
                (&self.settings.lr_schedule, &mut self.scheduler)
            {
                let value = watched(&report, &p.metric, "the plateau scheduler")?;
                self.optimizer.set_lr(sched.step(value, p.goal, lr));
            }
            // Every rank sees the same all-reduced metrics, so every rank decides alike.
            let stop = match (&self.settings.early_stopping, &mut self.early) {
                (rule, Some(early)) => {
                    let value = watched(&report, &rule.metric, "early stopping")?;
                    early.observe(rule, epoch, value).then(|| {
                        let best = early.best.unwrap_or(Best { value, epoch });
                        format!(
                            "early stopping after epoch {epoch}: {} has not improved for {} \
                             epochs (best {:.4} at epoch {})",
                            rule.metric, early.bad_epochs, best.value, best.epoch
                        )
                    })
                }
                _ => None,
            };
            let improved = self.update_bests(&report)?;
            if self.pg.rank() == 0 {
                let saving = Instant::now();
                self.finish_epoch(&report, &summary, beside_best.as_ref(), &improved)?;
                self.budget.save_took(saving.elapsed());
            }
            self.last_checkpoint = Instant::now();
            // A later call continues after this epoch.
            self.start_epoch = epoch + 1;
            all.push(report);
            if let Some(note) = stop {
                self.log.say(&note);
                break;
            }
        }
        Ok(all)
    }

    /// Why the run is over when the resumed checkpoint is the end of an epoch at which early
    /// stopping, with this run's patience, stops (the same on every rank).
    fn ended_by_early_stopping(&self) -> Option<String> {
        let rule = &self.settings.early_stopping;
        let (early, patience) = (self.early.as_ref()?, rule.patience?);
        if self.start_position.is_some() || self.start_epoch < 2 || early.bad_epochs < patience {
            return None;
        }
        let best = early.best.map_or(String::new(), |b| {
            format!(" (best {:.4} at epoch {})", b.value, b.epoch)
        });
        Some(format!(
            "the run ended by early stopping at epoch {}: {} has not improved for {} epochs{best}; \
             nothing left to train (a larger early-stopping patience continues it)",
            self.start_epoch - 1,
            rule.metric,
            early.bad_epochs
        ))
    }

    /// Why the run is over when it continues past its last epoch: resumed for no more epochs
    /// than it finished, or run again.
    fn past_the_last_epoch(&self) -> Option<String> {
        let (done, epochs) = (self.start_epoch - 1, self.settings.epochs);
        (done >= epochs).then(|| {
            format!(
                "the run already trained epoch {done}, and is given {epochs} epoch(s): nothing \
                 left to train (more than {done} epochs continue it)"
            )
        })
    }

    /// Optimizer steps in each epoch (the same every epoch: the sampler gives every rank the
    /// same number of samples).
    fn steps_per_epoch(&self) -> usize {
        self.allocation.steps_per_epoch(
            self.train_sampler.dataset_len(),
            self.settings.max_steps_per_epoch,
        )
    }

    /// A loader over `indices` of the training or the validation set, whose batches arrive
    /// on this rank's device.
    pub(super) fn loader(
        &self,
        set: &T::Data,
        train: bool,
        epoch: u64,
        indices: Vec<usize>,
    ) -> Result<Loader<T::Data>, TrainError> {
        let ranks_here = self.pg.local_world_size();
        let config = LoaderConfig {
            drop_last: train,
            epoch,
            ..self.settings.loader_config(self.device, ranks_here)
        };
        Ok(Loader::on_device(
            set.clone(),
            indices,
            &config,
            self.device,
        )?)
    }

    /// One epoch of training, from `resumed`'s step when a checkpoint inside it is resumed
    /// (on this allocation or another); what it returns counts the part before `resumed` too.
    ///
    /// Each micro-step queues its forward and backward, then takes the next batch (which, on
    /// a GPU, queues that batch's copy behind this step), and only then reads the loss, the
    /// first point where the host waits for the device: the device always has the next
    /// batch's copy queued, and the host waits for the loader while the device computes.
    ///
    /// A NaN or infinite loss on any rank is decided alike on every rank, from the averaged
    /// gradients it poisons (`non_finite.rs`): with fp16's scaler every rank skips the step;
    /// without one every rank returns [`TrainError::NonFiniteLoss`] before the optimizer step
    /// (checking the averaged gradients each step: the clipped norm, or one fused pass and
    /// one read). Such a micro-batch's loss and samples are left out of the epoch's loss mean
    /// (and of a checkpoint's sums), and counted in rank 0's log at the epoch's end (the
    /// count starts again at a resume inside the epoch).
    fn train_epoch(
        &mut self,
        epoch: u64,
        resumed: Option<(Position, EpochRest)>,
        signals: Option<&SignalWatch>,
    ) -> Result<EpochTraining, TrainError> {
        let s = self.settings.clone();
        let rank = self.pg.rank();
        // The trainer advances the sampler itself: no one can forget set_epoch.
        self.train_sampler.set_epoch(epoch);
        let global = self.allocation.global_batch();
        // Per-step schedules count samples, in steps of the plan's global batch; but under a
        // binding --max-steps-per-epoch an epoch is so many steps whatever its batch, and
        // they count steps.
        let unit = self.plan.global_batch.unwrap_or(global).max(1);
        let capped = self
            .allocation
            .cap_binds(self.train_sampler.dataset_len(), s.max_steps_per_epoch);
        let advance = if capped { unit } else { global } as u64;
        let rest = resumed.map_or_else(
            || EpochRest::fresh(self.steps_per_epoch(), self.allocation),
            |(_, rest)| rest,
        );
        // Each step takes the next `global` positions of the epoch's order, whatever the
        // ranks; a resumed epoch deals the positions its checkpoint had not consumed over
        // this run's ranks. Every sample's random draws depend only on (seed, epoch, index),
        // so the rest is what it would have been.
        let left = rest.steps_left(self.allocation, s.max_steps_per_epoch);
        let first = rest.first_step;
        let steps = first + left;
        let indices = self
            .train_sampler
            .remaining_until(rest.consumed, rest.consumed + left * global)
            .context(|| format!("dealing the rest of epoch {epoch}"))?;
        let resumed = resumed.map(|(p, _)| p);
        let index_log = super::faults::index_log();
        let mut loader = self.loader(&self.train_set, true, epoch, indices)?;
        let progress = Progress::new(
            rank == 0 && s.runtime.progress,
            epoch,
            s.epochs,
            steps,
            &self.log,
        );
        // Rank 0 carries the sums of all ranks before the checkpoint.
        let (mut loss_sum, mut samples, earlier_seconds) = match (resumed, rank) {
            (Some(p), 0) => (p.loss_sum, p.samples, p.train_seconds),
            (Some(p), _) => (0.0, 0, p.train_seconds),
            (None, _) => (0.0f64, 0usize, 0.0),
        };
        // The same on every rank (they come from the averaged gradients).
        let (mut grad_norm_sum, mut skipped_steps) =
            resumed.map_or((0.0, 0), |p| (p.grad_norm_sum, p.skipped_steps));
        let mut grad_norm_steps = resumed.map_or(0, |p| {
            p.grad_norm_steps
                .unwrap_or((p.step as u64).saturating_sub(p.skipped_steps))
        });
        let mut fresh_samples = 0usize;
        // Micro-batches whose loss was not finite, and their samples, on this rank.
        let (mut left_out, mut left_out_samples) = (0usize, 0usize);
        let started = Instant::now();
        // Where the epoch stands before `step` (its end: `steps`) with this rank's sums so
        // far. The last step of an epoch continued on another allocation is filled past the
        // epoch's end: its end consumes the order up to the epoch's end.
        let position_at =
            |step: usize,
             (loss_sum, samples): (f64, usize),
             (grad_norm_sum, grad_norm_steps, skipped_steps): (f64, u64, u64)| {
                Position {
                    epoch,
                    step,
                    loss_sum,
                    samples,
                    train_seconds: earlier_seconds + started.elapsed().as_secs_f64(),
                    grad_norm_sum,
                    grad_norm_steps: Some(grad_norm_steps),
                    skipped_steps,
                    consumed: Some((rest.consumed + (step - first) * global).min(rest.end)),
                    epoch_end: Some(rest.end),
                }
            };
        let mut upcoming = loader.next();
        for step in first..steps {
            let position = position_at(
                step,
                (loss_sum, samples),
                (grad_norm_sum, grad_norm_steps, skipped_steps),
            );
            hold_if_injected(Point::Step(epoch, step), signals);
            self.checkpoint_or_stop(position, first, steps, signals)?;
            // An injected step sleep is part of the step, for the time limit's budget too.
            let step_started = Instant::now();
            fail_if_injected(rank, Point::Step(epoch, step), self.restarted);
            // Dropout masks derive from (seed, epoch, step, rank): a resumed run draws the
            // same ones as an uninterrupted run.
            tch::manual_seed(mix(s.seed, epoch, step as u64, rank as u64));
            if s.lr_schedule.per_step() {
                let schedule = &s.lr_schedule;
                // Over the run's planned total, recorded at its start, in steps of its
                // global batch: a step of another counts by its samples (see `advance`).
                let total = self.plan.optimizer_steps;
                let t = self.scheduled_samples as f64 / unit as f64;
                self.optimizer
                    .set_lr(schedule.lr(s.optimizer.lr(), t, total));
            }
            self.optimizer.zero_grad();
            let (mut step_loss, mut finite_micro) = (0.0, 0usize);
            // This rank's first non-finite loss in this step.
            let mut non_finite: Option<f64> = None;
            let mut step_indices = Vec::new();
            // Each micro-batch's loss and samples, read after the step's gradients are
            // checked: reading one makes the host wait for the device, and between
            // micro-batches that would leave the GPU idle.
            let mut micro_losses = Vec::with_capacity(s.accumulate);
            for micro in 0..s.accumulate {
                let batch = take_batch(upcoming)?;
                if index_log.is_some() {
                    step_indices.extend_from_slice(batch.indices());
                }
                // Only the last micro-batch's backward communicates (PyTorch's `no_sync`).
                self.ddp
                    .set_require_gradient_sync(micro + 1 == s.accumulate);
                // Rank 0's buffers, once per step, before its first micro-batch: PyTorch's
                // DDP syncs them in the first forward after a step that synchronised.
                if micro == 0 {
                    self.ddp.broadcast_buffers()?;
                }
                let loss = {
                    let _autocast = s.precision.autocast(self.device)?;
                    self.task.train_loss(&self.model, &batch)
                };
                check_loss(
                    &loss,
                    "Task::train_loss",
                    "the batch's mean (Reduction::Mean)",
                )?;
                if !loss.requires_grad() {
                    return Err(TrainError::Invalid(
                        "Task::train_loss returned a loss that needs no gradient (computed \
                         under no_grad, detached, or from frozen parameters only): return one \
                         computed from the model's trainable parameters"
                            .into(),
                    ));
                }
                // Times 1, or NaN for a non-finite loss: it reaches every rank's gradients.
                let scaled = &loss * poison(&loss) / s.accumulate as f64;
                let root = match &self.scaler {
                    Some(scaler) => scaler.scale_loss(&scaled),
                    None => scaled,
                };
                // With find_unused_parameters, what backward cannot reach is marked at its
                // first hook, so that buckets are still reduced while it runs.
                self.ddp.prepare_for_backward(&root)?;
                // A backward function can fail (a user's differentiable all-reduce whose
                // peer died); SyncBatchNorm's failure, kept aside, is the better message.
                let backward = root.f_backward();
                let sync_bn_error = self.sync_bn.as_ref().and_then(|r| r.take_error());
                if sync_bn_error.is_some() || backward.is_err() {
                    // Hooks may have run: the step ends here, not at the next DDP call.
                    self.ddp.abandon_step();
                }
                if let Some(e) = sync_bn_error {
                    return Err(e.into());
                }
                backward.context(|| format!("the backward pass of epoch {epoch} step {step}"))?;
                upcoming = loader.next();
                micro_losses.push((loss.detach(), batch.len()));
                fresh_samples += batch.len();
            }
            self.ddp.sync_gradients()?;
            // The averaged gradients are the same bytes on every rank, so every rank finds
            // the same inf/NaN, the same norm, and skips the same steps (or stops at the
            // same step). Their checks, the norm and the losses stay on the device until
            // one read.
            let mut reads = DeviceReads::default();
            let params = self.ddp.parameters();
            // The scaler's flags, or without one and without clipping, the same check at
            // scale 1 (the clipped norm is that check otherwise).
            let check = match &mut self.scaler {
                Some(scaler) => Some(scaler.unscale(params)?),
                None if s.clip_grad_norm.is_none() => Some(non_finite_check(params)?),
                None => None,
            };
            // No flag where no parameter has a gradient: nothing is inf or NaN.
            let flags_at = match &check {
                Some(found) if !found.flags().is_empty() => {
                    Some(reads.add(&Tensor::f_cat(found.flags(), 0)?)?)
                }
                _ => None,
            };
            // Clipped even on a step the scaler then skips, as PyTorch's loop does: that
            // norm is inf or NaN, and those gradients are thrown away.
            let norm_at = match s.clip_grad_norm {
                Some(max) => Some(reads.add_one(&crate::optim::clip_grad_norm(params, max))?),
                None => None,
            };
            let losses_at = micro_losses
                .iter()
                .map(|(loss, _)| reads.add_one(loss))
                .collect::<Result<Vec<_>, _>>()?;
            // The one wait for the device in a step.
            let values = reads.read()?;
            // NCCL's buckets were waited for on the stream: a communicator aborted meanwhile
            // (a hung peer) left these gradients half-reduced, which no step may take.
            self.pg.usable("the step's gradient all-reduce")?;
            let found = flags_at.is_some_and(|at| values[at].iter().any(|&f| f != 0.0));
            let found_inf = self.scaler.is_some() && found;
            let grad_norm = norm_at.map(|at| values[at]).filter(|_| !found_inf);
            let finite = match (&self.scaler, grad_norm) {
                (Some(_), _) => true,
                (None, Some(norm)) => norm.is_finite(),
                (None, None) => !found,
            };
            let losses = losses_at.into_iter().map(|at| values[at]);
            for ((_, len), value) in micro_losses.iter().zip(losses) {
                if value.is_finite() {
                    step_loss += value;
                    finite_micro += 1;
                    loss_sum += value * *len as f64;
                    samples += len;
                } else {
                    // No rank leaves here: its peers would wait for it in the all-reduce.
                    non_finite.get_or_insert(value);
                    left_out += 1;
                    left_out_samples += len;
                }
            }
            if !finite {
                self.stop_on_non_finite_loss(non_finite, epoch, step)?;
            }
            if let (Some(value), false) = (non_finite, found_inf) {
                // Only a loss whose gradients do not depend on its value gets here.
                self.log.warn(&format!(
                    "rank {rank}: the training loss was {value} at epoch {epoch} step {step} \
                     but the averaged gradients are finite: the step is taken"
                ));
            }
            // Only finite norms: the sum goes into checkpoints, whose JSON has no inf or NaN.
            if let Some(norm) = grad_norm.filter(|n| n.is_finite()) {
                grad_norm_sum += norm;
                grad_norm_steps += 1;
            }
            if found_inf {
                skipped_steps += 1;
                self.skipped_steps += 1;
            } else {
                self.optimizer.step();
            }
            self.scheduled_samples = self.scheduled_samples.saturating_add(advance);
            if let Some(scaler) = &mut self.scaler {
                scaler.update(found_inf);
            }
            if let Some(dir) = &index_log {
                super::faults::log_indices(dir, rank, self.restarted, epoch, step, &step_indices)?;
            }
            self.budget.step_took(step_started.elapsed());
            let log_every = s.runtime.log_every;
            if log_every > 0 && (step + 1) % log_every == 0 {
                let shown = match non_finite {
                    Some(value) if finite_micro == 0 => value,
                    _ => step_loss / finite_micro as f64,
                };
                let mut line = format!(
                    "[rank {rank}] epoch {epoch} step {}/{steps} loss {shown:.4}",
                    step + 1,
                );
                if let Some(norm) = grad_norm {
                    line.push_str(&format!(" grad norm {norm:.4}"));
                }
                if let Some(scaler) = &self.scaler {
                    line.push_str(&format!(" loss scale {}", scaler.scale()));
                    if found_inf {
                        line.push_str(" (step skipped: inf/NaN gradients)");
                    }
                }
                if let Some(value) = non_finite {
                    line.push_str(&format!(" (non-finite loss {value} left out)"));
                }
                self.log.say(&line);
            }
            let rate = fresh_samples as f64 * self.pg.world_size() as f64
                / started.elapsed().as_secs_f64();
            progress.step(step + 1, loss_sum / samples.max(1) as f64, rate, &self.log);
        }
        progress.finish(&self.log);
        let end = position_at(
            steps,
            (loss_sum, samples),
            (grad_norm_sum, grad_norm_steps, skipped_steps),
        );
        let mut totals = Tensor::from_slice(&[
            loss_sum,
            samples as f64,
            left_out as f64,
            left_out_samples as f64,
        ]);
        self.pg.all_reduce(&mut totals, ReduceOp::Sum)?;
        let totals = Vec::<f64>::try_from(&totals)?;
        if rank == 0 && totals[2] > 0.0 {
            let n = totals[2] as usize;
            self.log.say(&format!(
                "epoch {epoch}: {n} micro-batch{} ({} samples) with a non-finite loss left out \
                 of the training loss",
                if n == 1 { "" } else { "es" },
                totals[3] as usize
            ));
        }
        Ok(EpochTraining {
            loss: totals[0] / totals[1].max(1.0),
            samples: (totals[1] + totals[3]) as usize,
            steps,
            seconds: earlier_seconds + started.elapsed().as_secs_f64(),
            grad_norm_sum,
            grad_norm_steps,
            skipped_steps,
            end,
        })
    }
}

/// Refuses a loss of more than one element, which `what` (a [`Task`] method) returned:
/// backward and the reads of its value need a scalar, `wanted`.
pub(super) fn check_loss(loss: &Tensor, what: &str, wanted: &str) -> Result<(), TrainError> {
    if loss.numel() == 1 {
        return Ok(());
    }
    Err(TrainError::Invalid(format!(
        "{what} returned a loss of shape {:?}: return {wanted}, a scalar",
        loss.size()
    )))
}

fn take_batch(next: Option<Result<Batch, ddp_data::DataError>>) -> Result<Batch, TrainError> {
    match next {
        Some(b) => Ok(b?),
        None => Err(TrainError::LoaderEnded),
    }
}

/// A well-mixed 63-bit seed from the run seed, epoch, step and rank (SplitMix64 finaliser).
fn mix(seed: u64, epoch: u64, step: u64, rank: u64) -> i64 {
    let mut z = seed;
    for v in [epoch, step, rank] {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15).wrapping_add(v);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
    }
    (z >> 1) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_seeds_differ_by_every_component() {
        let base = mix(1, 2, 3, 4);
        assert_ne!(base, mix(0, 2, 3, 4));
        assert_ne!(base, mix(1, 3, 3, 4));
        assert_ne!(base, mix(1, 2, 4, 4));
        assert_ne!(base, mix(1, 2, 3, 5));
        assert_eq!(base, mix(1, 2, 3, 4));
        assert!(base >= 0);
    }
}
