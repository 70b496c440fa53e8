//! Evaluation: [`Trainer::evaluate`], and each epoch's exact distributed evaluation (every
//! rank evaluates its exact shard, one all-reduce combines the task's sums, and one
//! all-gather the per-sample rows of tasks that have them); a stop signal ends either one at
//! the next batch, on every rank, and the time limit ends an epoch's evaluation alike.

use std::time::Instant;

use ddp_comm::ReduceOp;
use ddp_data::Dataset;
use tch::{Kind, Tensor};

use super::faults::{fail_if_injected, Point};
use super::loops::check_loss;
use super::{EvalReport, Trainer};
use crate::error::TrainError;
#[cfg(doc)]
use crate::settings::{CheckpointSettings, RuntimeSettings};
use crate::state::Position;
use crate::stop::SignalWatch;
use crate::task::{Stats, Task};

impl<T: Task> Trainer<T> {
    /// Evaluates the model on the validation split; every rank returns the metrics of the
    /// whole split.
    ///
    /// The stop signals that [`Trainer::new`] watches for a training run (SIGTERM and SIGUSR1,
    /// with [`RuntimeSettings::stop_on_signals`], unless
    /// [`CheckpointSettings::eval_only`]) stop an evaluation too: the ranks agree before each
    /// round of batches, and on a signal (one that came while the ranks started, too) every
    /// rank returns [`TrainError::EvaluationStopped`], with nothing saved; exit with
    /// [`TrainError::exit_code`]. A later [`Trainer::run`] still watches them, and takes
    /// such a signal at its first step. An error is noted for the launcher as
    /// [`Trainer::run`]'s is.
    pub fn evaluate(&mut self) -> Result<EvalReport, TrainError> {
        let report = self.evaluate_split();
        crate::exit::note_failure(&report);
        report
    }

    /// [`Trainer::evaluate`]'s evaluation.
    fn evaluate_split(&mut self) -> Result<EvalReport, TrainError> {
        self.check_rows_fit()?;
        let signals = self.signals.take();
        let evaluated = self.evaluate_epoch(0, None, signals.as_ref());
        self.signals = signals;
        let (val_loss, stats) = evaluated?.ok_or_else(|| {
            TrainError::Invalid("nothing to evaluate: the task has no validation data".into())
        })?;
        let mut metrics = stats.report();
        metrics.extend(stats.details());
        let metrics = metrics.into_map();
        Ok(EvalReport {
            val_loss,
            metrics,
            world_size: self.pg.world_size(),
        })
    }

    /// Refuses ([`TrainError::RowsTooLarge`]) a validation split whose rows, one per sample
    /// as a fresh [`Task::new_stats`] makes them, would gather to more bytes than the process
    /// group's limit: that gather comes only after an epoch. The same on every rank (the
    /// split, the width and the world are, and the limit must be).
    pub(super) fn check_rows_fit(&self) -> Result<(), TrainError> {
        let (Some(set), Some(rows)) = (&self.val_set, self.task.new_stats().rows()) else {
            return Ok(());
        };
        let (samples, width) = (set.len(), rows.width());
        let bytes = crate::gather::gathered_bytes(self.pg.world_size(), samples, width);
        let limit = self.pg.max_gather_bytes();
        if bytes <= limit {
            return Ok(());
        }
        Err(TrainError::RowsTooLarge {
            samples,
            width,
            bytes,
            limit,
        })
    }

    /// Evaluates on this rank's exact shard of the validation split and combines the
    /// statistics of all ranks: the result equals one process evaluating the whole split.
    /// `None` without validation data.
    ///
    /// With `signals`, or with `end` (a training run's epoch end) and a time limit, the ranks
    /// agree before each round of batches whether to stop, and take as many rounds, whatever
    /// their shards: a stop signal, or the time limit, ends the evaluation with rank 0's
    /// checkpoint of the epoch's end and [`TrainError::Stopped`], or a stop signal without an
    /// epoch's end with [`TrainError::EvaluationStopped`] (`checkpoint.rs`).
    pub(super) fn evaluate_epoch(
        &mut self,
        epoch: u64,
        end: Option<Position>,
        signals: Option<&SignalWatch>,
    ) -> Result<Option<(f64, T::Stats)>, TrainError> {
        // The same on every rank: whether they agree before each round.
        let checks = self.stop_checks(signals)?;
        let agree = checks.signals || (end.is_some() && checks.time_limit);
        let (Some(set), Some(sampler)) = (&self.val_set, &self.val_sampler) else {
            return Ok(None);
        };
        let indices: Vec<usize> = sampler.iter().collect();
        // Every rank evaluates rank 0's model, the one the checkpoints hold: its buffers
        // (BatchNorm's running statistics, which each rank's last batch moved) go to all
        // ranks first, as PyTorch's DDP does in the first forward after a training step.
        // With broadcast_buffers off, each rank evaluates with its own buffers instead: the
        // metrics mix the ranks' models, and after a resume (rank 0's buffers everywhere)
        // differ from an uninterrupted run's.
        self.ddp.broadcast_buffers()?;
        let mut loader = self.loader(set, false, epoch, indices)?;
        let mut stats = self.task.new_stats();
        let (mut loss_sum, mut samples): (Option<Tensor>, usize) = (None, 0);
        tch::no_grad(|| -> Result<(), TrainError> {
            let mut upcoming = loader.next();
            let mut round_started: Option<Instant> = None;
            for round in 0.. {
                if round == 1 {
                    fail_if_injected(self.pg.rank(), Point::Eval(epoch), self.restarted);
                }
                if agree {
                    // A round: from one agreement to the next (what a stop must leave room for).
                    let now = Instant::now();
                    if let Some(started) = round_started.replace(now) {
                        self.budget.eval_round_took(now - started);
                    }
                    if !self.stop_in_evaluation(end, signals, upcoming.is_some())? {
                        break;
                    }
                }
                // Without agreeing a rank's batches end its evaluation; agreeing, a rank whose
                // shard is done still takes the rounds that others have batches for.
                let Some(batch) = upcoming.take() else {
                    if agree {
                        continue;
                    }
                    break;
                };
                let batch = batch?;
                // The next batch's copy is queued before this batch's statistics or loss
                // make the host wait for the device (on a GPU).
                upcoming = loader.next();
                // Evaluation runs in the training precision.
                let _autocast = self.settings.precision.autocast(self.device)?;
                let loss = self.task.eval_batch(&self.model, &batch, &mut stats);
                check_loss(
                    &loss,
                    "Task::eval_batch",
                    "the sum of the per-sample losses (Reduction::Sum)",
                )?;
                // Summed on the device in f64, as the host would, and read once at the end.
                let loss = loss.detach().f_reshape([])?.f_to_kind(Kind::Double)?;
                loss_sum = Some(match loss_sum.take() {
                    Some(sum) => sum.f_add(&loss)?,
                    None => loss,
                });
                samples += batch.len();
            }
            Ok(())
        })?;
        let loss_sum = match loss_sum {
            Some(sum) => sum.f_to_device(tch::Device::Cpu)?.f_double_value(&[])?,
            None => 0.0,
        };
        let mut sums = vec![loss_sum, samples as f64];
        sums.extend(stats.to_sums());
        let mut t = Tensor::from_slice(&sums).to_kind(Kind::Double);
        self.pg.all_reduce(&mut t, ReduceOp::Sum)?;
        let totals = Vec::<f64>::try_from(&t)?;
        stats.set_sums(&totals[2..]);
        if let Some(rows) = stats.rows() {
            let all = crate::gather::gather_rows(&self.pg, &rows)?;
            stats.set_rows(all);
        }
        Ok(Some((totals[0] / totals[1].max(1.0), stats)))
    }
}

/// Which checks for a stop or a timed checkpoint the ranks make together. Each rank's
/// runtime settings are its own (never compared at start), so whether some rank watches
/// signals, has a time limit or checkpoints every so many minutes is agreed once, as the
/// maximum over the ranks: every rank then takes part in the same collectives, and a rank
/// that asks for a stop stops every rank.
#[derive(Clone, Copy, Debug)]
pub(super) struct StopChecks {
    /// Some rank watches stop signals.
    pub(super) signals: bool,
    /// Some rank has a time limit.
    pub(super) time_limit: bool,
    /// Some rank checkpoints every so many minutes.
    pub(super) timed: bool,
}

impl<T: Task> Trainer<T> {
    /// [`StopChecks`]: agreed at the first call (one all-reduce, at the first step's or the
    /// first evaluation's check, where every rank is), then kept.
    pub(super) fn stop_checks(
        &mut self,
        signals: Option<&SignalWatch>,
    ) -> Result<StopChecks, TrainError> {
        if let Some(checks) = self.stop_checks {
            return Ok(checks);
        }
        let s = &self.settings;
        let mut flags = [
            signals.is_some(),
            s.runtime.time_limit_secs.is_some(),
            s.checkpoint.minutes.is_some(),
        ]
        .map(i64::from);
        self.pg.all_reduce_slice(&mut flags, ReduceOp::Max)?;
        let checks = StopChecks {
            signals: flags[0] == 1,
            time_limit: flags[1] == 1,
            timed: flags[2] == 1,
        };
        self.stop_checks = Some(checks);
        Ok(checks)
    }
}
