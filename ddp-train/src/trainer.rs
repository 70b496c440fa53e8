//! The Trainer: epochs of distributed training and exact distributed evaluation of any
//! [`Task`].
//!
//! Per epoch, on every rank, the collectives come in this fixed order: for each step,
//! a buffer broadcast before each forward and one gradient all-reduce per optimizer step;
//! then one all-reduce of the epoch's loss and sample counts; then one all-reduce of the
//! validation statistics. Rank 0 alone writes files and prints progress, between epochs.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ddp_comm::{EnvConfig, ProcessGroup, ReduceOp};
use ddp_data::{Batch, Dataset, Loader, LoaderConfig};
use ddp_model::checkpoint;
use ddp_sampler::{DistributedSampler, Partition};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tch::{nn, Device, Kind, Tensor};

use crate::amp::{GradScaler, Precision};
use crate::ddp::{DdpOptions, DistributedDataParallel};
use crate::error::{Context, TrainError};
use crate::optim::Optimizer;
use crate::scheduler::ReduceLrOnPlateau;
use crate::settings::{Goal, Settings};
use crate::state::{self, Best, EarlyStopState, Position, TrainState};
use crate::stop::{Budget, SignalWatch, StopReason};
use crate::task::{Stats, Task};

/// One epoch's results: a line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpochReport {
    /// Epoch number (from 1).
    pub epoch: u64,
    /// Mean training loss over every sample of every rank.
    pub train_loss: f64,
    /// Mean validation loss over the whole validation split (none without validation data).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// The task's validation metrics ([`Stats::report`]).
    #[serde(flatten)]
    pub metrics: Map<String, Value>,
    /// Learning rate used in this epoch (with a per-step schedule: at its last step).
    pub lr: f64,
    /// Mean over the epoch's steps of the gradients' global norm before clipping (with
    /// [`Settings::clip_grad_norm`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Steps the fp16 gradient scaler skipped (inf/NaN gradients) in this epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
    /// Training samples per second, all ranks together.
    pub images_per_sec: f64,
    /// Wall time of the epoch (training and evaluation).
    pub epoch_seconds: f64,
    /// Optimizer steps taken in this epoch.
    pub steps: usize,
    /// Ranks that trained.
    pub world_size: usize,
}

impl EpochReport {
    /// A number of the report by name: `train_loss`, `val_loss`, `lr` or a task metric.
    pub fn metric(&self, name: &str) -> Option<f64> {
        match name {
            "train_loss" => Some(self.train_loss),
            "val_loss" => self.val_loss,
            "lr" => Some(self.lr),
            "grad_norm" => self.grad_norm,
            _ => self.metrics.get(name)?.as_f64(),
        }
    }
}

/// The result of [`Trainer::evaluate`]: the whole validation split's loss and metrics.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvalReport {
    /// Mean validation loss.
    pub val_loss: f64,
    /// The task's metrics ([`Stats::report`] and [`Stats::details`]).
    #[serde(flatten)]
    pub metrics: Map<String, Value>,
    /// Ranks that evaluated.
    pub world_size: usize,
}

/// What an epoch's training loop returns (all ranks' totals).
struct EpochTraining {
    /// Mean training loss over every rank's samples.
    loss: f64,
    /// Samples, all ranks together.
    samples: usize,
    /// Optimizer steps.
    steps: usize,
    /// Seconds spent training.
    seconds: f64,
    /// Sum of the steps' gradient norms (with clipping).
    grad_norm_sum: f64,
    /// Steps the fp16 scaler skipped.
    skipped_steps: u64,
}

/// A rank's whole training run of a [`Task`].
pub struct Trainer<T: Task> {
    task: T,
    settings: Settings,
    pg: Arc<ProcessGroup>,
    device: Device,
    threads: usize,
    out: PathBuf,
    vs: nn::VarStore,
    model: T::Model,
    ddp: DistributedDataParallel,
    optimizer: Optimizer,
    /// Whether a launcher restarted this job (torchrun's restart count above 0).
    restarted: bool,
    /// fp16's loss scaler (`None` in other precisions).
    scaler: Option<GradScaler>,
    /// Early stopping's count (`None` without early stopping).
    early: Option<EarlyStopState>,
    scheduler: Option<ReduceLrOnPlateau>,
    start_epoch: u64,
    /// Where a checkpoint taken inside an epoch left off.
    start_position: Option<Position>,
    budget: Budget,
    last_checkpoint: Instant,
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
    /// Prepares this process as one rank, from torchrun's environment (`RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, ...; SLURM's; or none, for one process):
    /// checks settings and data (before meeting the other ranks, so bad input fails on every
    /// rank alike), builds the model, restores a checkpoint when asked, joins the process
    /// group and wraps the model in DDP.
    pub fn new(task: T, settings: Settings) -> Result<Self, TrainError> {
        let env = EnvConfig::from_env().context(|| "reading the rank's environment".into())?;
        Self::with_env(task, settings, &env)
    }

    /// As [`Trainer::new`], with the rank's place given instead of read.
    pub fn with_env(task: T, mut settings: Settings, env: &EnvConfig) -> Result<Self, TrainError> {
        let created = Instant::now();
        settings.validate()?;
        let continuing = resume_after_restart(&mut settings, env);
        let device = settings.device.resolve(env.local_rank)?;
        // As many intra-op threads as the machine has cores per rank.
        let threads = settings
            .threads
            .unwrap_or_else(|| ddp_data::default_workers(env.local_world_size));
        if device == Device::Cpu {
            tch::set_num_threads(threads as i32);
        }
        let train_set = task.train_data();
        let val_set = task.val_data();
        let resume_from = match &settings.resume {
            Some(r) => Some(state::resolve(r, settings.out.as_deref())?),
            None => None,
        };
        let s = &settings;
        let batches = s.batch_size * s.accumulate;
        let train_sampler = DistributedSampler::builder(train_set.len(), env.world_size, env.rank)
            .seed(s.seed)
            .build()
            .context(|| format!("sharding {} training samples", train_set.len()))?;
        if train_sampler.len() < batches && !s.eval_only {
            return Err(TrainError::Invalid(format!(
                "each of the {} ranks gets {} training samples, fewer than one step of \
                 --batch-size {} x --accumulate {}: lower them or use more data",
                env.world_size,
                train_sampler.len(),
                s.batch_size,
                s.accumulate
            )));
        }
        let val_sampler = match &val_set {
            Some(v) => Some(
                DistributedSampler::builder(v.len(), env.world_size, env.rank)
                    .shuffle(false)
                    .partition(Partition::Exact)
                    .build()
                    .context(|| format!("sharding {} validation samples", v.len()))?,
            ),
            None => None,
        };

        // Model and checkpoint before meeting the other ranks: a bad checkpoint fails on
        // every rank alike instead of leaving some waiting in a collective.
        tch::manual_seed(s.seed as i64);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let model = task.model(&vs.root());
        let mut scheduler = s.plateau.as_ref().map(|p| ReduceLrOnPlateau::new(p.config));
        let (mut start_epoch, mut bests) = (1, BTreeMap::new());
        let mut start_position = None;
        let mut scaler = (s.precision == Precision::Fp16).then(GradScaler::default);
        let mut early = s.early_stopping.as_ref().map(|_| EarlyStopState::default());
        let mut restored = None;
        let mut resumed_note = None;
        if let (Some(path), true) = (&resume_from, s.eval_only) {
            checkpoint::load(&vs, path)?;
            resumed_note = Some(format!("evaluating {}", path.display()));
        } else if let Some(path) = &resume_from {
            // Loaded on the CPU first, then moved with the model to the rank's device.
            let mut cpu_optimizer = Optimizer::new(trainable(&vs), s.optimizer);
            let st = state::load(path, &vs, &mut cpu_optimizer)?;
            restored = Some((st, path.clone(), cpu_optimizer));
        }
        vs.set_device(device);
        let mut optimizer = Optimizer::new(trainable(&vs), s.optimizer);
        if let Some((st, path, cpu_optimizer)) = restored {
            // load_state moves the CPU copies to the parameters' device.
            let tensors = cpu_optimizer.state_tensors().into_iter().collect();
            optimizer
                .load_state(&tensors, st.optimizer_steps)
                .map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display())))?;
            optimizer.set_lr(st.lr);
            if st.scheduler.is_some() {
                scheduler = st.scheduler.clone();
            }
            bests = st.bests;
            if let (Some(scaler), Some(saved)) = (scaler.as_mut(), st.grad_scaler) {
                scaler.set_state(saved);
            }
            if let (Some(early), Some(saved)) = (early.as_mut(), st.early_stopping) {
                *early = saved;
            }
            let at = match st.position {
                Some(p) => {
                    start_epoch = p.epoch;
                    start_position = Some(p);
                    format!("epoch {} at step {}", p.epoch, p.step)
                }
                None => {
                    start_epoch = st.epoch + 1;
                    format!("epoch {} done", st.epoch)
                }
            };
            resumed_note = Some(format!(
                "resumed from {} ({at}){continuing}",
                path.display()
            ));
        }
        let opts = ddp_comm::Options::from_config(env)
            .op_timeout(Duration::from_secs(s.collective_timeout_secs));
        let pg = Arc::new(ProcessGroup::new(opts).context(|| "joining the process group".into())?);
        let rank = pg.rank();

        // Every rank agrees on the run directory: rank 0's choice.
        let proposed = s.out.clone().unwrap_or_else(default_run_dir);
        let gathered = pg.all_gather_bytes(proposed.to_string_lossy().as_bytes())?;
        let out = PathBuf::from(String::from_utf8_lossy(&gathered[0]).into_owned());
        std::fs::create_dir_all(out.join("logs")).map_err(|e| {
            TrainError::io(format!("cannot create run directory {}", out.display()), e)
        })?;
        let log = RankLog::open(&out, rank)?;
        if let Some(note) = resumed_note {
            log.say(&note);
        }
        let ddp_options = DdpOptions {
            find_unused_parameters: s.find_unused_parameters,
            comm_hook: s.comm_hook,
            overlap: s.overlap,
            ..DdpOptions::default()
        };
        let ddp = DistributedDataParallel::new(&vs, pg.clone(), ddp_options)?;
        let history = if rank == 0 {
            read_history(&out, start_epoch)?
        } else {
            Vec::new()
        };
        let s_time_limit = settings.time_limit_secs.map(Duration::from_secs);
        // The model and the optimizer's state (at most two tensors per parameter).
        let checkpoint_bytes = vs
            .variables()
            .values()
            .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64 * 3)
            .sum();
        let val_batches = val_sampler
            .as_ref()
            .map_or(0, |v| v.len().div_ceil(settings.batch_size));
        let trainer = Self {
            task,
            settings,
            pg,
            device,
            threads,
            out,
            vs,
            model,
            ddp,
            optimizer,
            restarted: env.restart_count > 0,
            scaler,
            early,
            scheduler,
            start_epoch,
            start_position,
            budget: Budget::new(created, s_time_limit, val_batches, checkpoint_bytes),
            last_checkpoint: Instant::now(),
            bests,
            history,
            log,
            train_set,
            val_set,
            train_sampler,
            val_sampler,
        };
        trainer.describe()?;
        Ok(trainer)
    }

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

    fn describe(&self) -> Result<(), TrainError> {
        let s = &self.settings;
        self.log.say(&format!(
            "rank {} of {} on {:?} ({} intra-op threads, backend {:?})",
            self.pg.rank(),
            self.pg.world_size(),
            self.device,
            self.threads,
            self.pg.backend()
        ));
        if self.pg.rank() != 0 {
            return Ok(());
        }
        let val_len = self.val_set.as_ref().map_or(0, |v| v.len());
        self.log.say(&format!(
            "data: {} training samples ({} per rank per epoch), {} validation samples; \
             batch {} per rank x {} ranks; run directory {}",
            self.train_set.len(),
            self.train_sampler.len(),
            val_len,
            s.batch_size,
            self.pg.world_size(),
            self.out.display()
        ));
        let json = serde_json::json!({
            "settings": s,
            "task": self.task.describe(),
            "world_size": self.pg.world_size(),
            "backend": format!("{:?}", self.pg.backend()),
            "device": format!("{:?}", self.device),
            "intra_op_threads": self.threads,
            "train_samples": self.train_set.len(),
            "val_samples": val_len,
            "run_dir": self.out,
        });
        let text = serde_json::to_string_pretty(&json).context(|| "encoding config.json".into())?;
        write_file(&self.out.join("config.json"), text.as_bytes())
    }

    /// Evaluates the model on the validation split; every rank returns the metrics of the
    /// whole split.
    pub fn evaluate(&mut self) -> Result<EvalReport, TrainError> {
        let (val_loss, stats) = self.evaluate_epoch(0)?.ok_or_else(|| {
            TrainError::Invalid("nothing to evaluate: the task has no validation data".into())
        })?;
        let mut metrics = stats.report();
        metrics.extend(stats.details());
        Ok(EvalReport {
            val_loss,
            metrics,
            world_size: self.pg.world_size(),
        })
    }

    /// Trains from the start (or resumed) epoch to the last, evaluating after each.
    ///
    /// When a stop is requested (SIGTERM or SIGUSR1 with [`Settings::stop_on_signals`], or
    /// the time limit), every rank finishes its step, rank 0 writes a checkpoint, and every
    /// rank returns [`TrainError::Stopped`]; exit with [`TrainError::exit_code`].
    pub fn run(&mut self) -> Result<Vec<EpochReport>, TrainError> {
        let signals = if self.settings.stop_on_signals {
            Some(SignalWatch::start().map_err(TrainError::Invalid)?)
        } else {
            None
        };
        let mut all = Vec::new();
        for epoch in self.start_epoch..=self.settings.epochs {
            let lr_at_start = self.optimizer.lr();
            let resumed = self.start_position.take().filter(|p| p.epoch == epoch);
            let trained = self.train_epoch(epoch, resumed, signals.as_ref())?;
            let lr = match self.settings.lr_schedule {
                Some(_) => self.optimizer.lr(),
                None => lr_at_start,
            };
            let evaluating = Instant::now();
            let evaluated = self.evaluate_epoch(epoch)?;
            self.budget.eval_took(evaluating.elapsed());
            let (val_loss, summary, metrics) = match &evaluated {
                Some((loss, stats)) => (Some(*loss), stats.summary(), stats.report()),
                None => (None, String::new(), Map::new()),
            };
            let report = EpochReport {
                epoch,
                train_loss: trained.loss,
                val_loss,
                metrics,
                lr,
                grad_norm: self
                    .settings
                    .clip_grad_norm
                    .map(|_| trained.grad_norm_sum / trained.steps.max(1) as f64),
                skipped_steps: self.scaler.as_ref().map(|_| trained.skipped_steps),
                images_per_sec: trained.samples as f64 / trained.seconds.max(1e-9),
                epoch_seconds: trained.seconds + evaluating.elapsed().as_secs_f64(),
                steps: trained.steps,
                world_size: self.pg.world_size(),
            };
            if let (Some(p), Some(sched)) = (&self.settings.plateau, &mut self.scheduler) {
                let value = watched(&report, &p.metric, "the plateau scheduler")?;
                let signed = if p.goal == Goal::Max { value } else { -value };
                self.optimizer.set_lr(sched.step(signed, lr));
            }
            // Every rank sees the same all-reduced metrics, so every rank decides alike.
            let stop = match (&self.settings.early_stopping, &mut self.early) {
                (Some(rule), Some(early)) => {
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
            if self.pg.rank() == 0 {
                let saving = Instant::now();
                self.finish_epoch(&report, &summary)?;
                self.budget.save_took(saving.elapsed());
            }
            self.last_checkpoint = Instant::now();
            all.push(report);
            if let Some(note) = stop {
                self.log.say(&note);
                break;
            }
        }
        Ok(all)
    }

    /// Optimizer steps in each epoch (the same every epoch: the sampler gives every rank the
    /// same number of samples).
    fn steps_per_epoch(&self) -> usize {
        let s = &self.settings;
        let whole = self.train_sampler.len() / (s.batch_size * s.accumulate);
        s.max_steps_per_epoch.map_or(whole, |m| m.min(whole))
    }

    /// A loader over `indices` of the training or the validation set, whose batches arrive
    /// on this rank's device.
    fn loader(
        &self,
        set: &T::Data,
        train: bool,
        epoch: u64,
        indices: Vec<usize>,
    ) -> Result<Loader<T::Data>, TrainError> {
        let s = &self.settings;
        let default_prefetch = if self.device.is_cuda() { 4 } else { 2 };
        let config = LoaderConfig {
            drop_last: train,
            seed: s.seed,
            epoch,
            workers: s
                .workers
                .unwrap_or_else(|| ddp_data::default_workers(self.pg.local_world_size())),
            prefetch: s.prefetch.unwrap_or(default_prefetch),
            ..LoaderConfig::new(s.batch_size)
        };
        Ok(Loader::on_device(
            set.clone(),
            indices,
            &config,
            self.device,
        )?)
    }

    /// One epoch of training, from `resumed`'s step when a checkpoint inside it is resumed;
    /// what it returns counts the part before `resumed` too.
    ///
    /// Each micro-step queues its forward and backward, then takes the next batch (which, on
    /// a GPU, queues that batch's copy behind this step), and only then reads the loss, the
    /// first point where the host waits for the device: the device always has the next
    /// batch's copy queued, and the host waits for the loader while the device computes.
    fn train_epoch(
        &mut self,
        epoch: u64,
        resumed: Option<Position>,
        signals: Option<&SignalWatch>,
    ) -> Result<EpochTraining, TrainError> {
        let s = self.settings.clone();
        let rank = self.pg.rank();
        // The trainer advances the sampler itself: no one can forget set_epoch.
        self.train_sampler.set_epoch(epoch);
        let mut indices: Vec<usize> = self.train_sampler.iter().collect();
        let per_step = s.batch_size * s.accumulate;
        let steps = self.steps_per_epoch();
        indices.truncate(steps * per_step);
        // A resumed epoch skips the steps its checkpoint had done; every sample's random
        // draws depend only on (seed, epoch, index), so the rest is what it would have been.
        let first = resumed.map_or(0, |p| p.step.min(steps));
        indices.drain(..first * per_step);
        let mut loader = self.loader(&self.train_set, true, epoch, indices)?;
        let progress = Progress::new(rank == 0 && s.progress, epoch, s.epochs, steps);
        // Rank 0 carries the sums of all ranks before the checkpoint.
        let (mut loss_sum, mut samples, earlier_seconds) = match (resumed, rank) {
            (Some(p), 0) => (p.loss_sum, p.samples, p.train_seconds),
            (Some(p), _) => (0.0, 0, p.train_seconds),
            (None, _) => (0.0f64, 0usize, 0.0),
        };
        // The same on every rank (they come from the averaged gradients).
        let (mut grad_norm_sum, mut skipped_steps) =
            resumed.map_or((0.0, 0), |p| (p.grad_norm_sum, p.skipped_steps));
        let mut fresh_samples = 0usize;
        let started = Instant::now();
        let mut upcoming = loader.next();
        for step in first..steps {
            let position = Position {
                epoch,
                step,
                loss_sum,
                samples,
                train_seconds: earlier_seconds + started.elapsed().as_secs_f64(),
                grad_norm_sum,
                skipped_steps,
            };
            self.checkpoint_or_stop(position, first, steps, signals)?;
            fail_if_injected(rank, epoch, step, self.restarted);
            let step_started = Instant::now();
            // Dropout masks derive from (seed, epoch, step, rank): a resumed run draws the
            // same ones as an uninterrupted run.
            tch::manual_seed(mix(s.seed, epoch, step as u64, rank as u64));
            if let Some(schedule) = &s.lr_schedule {
                let total = s.epochs * self.steps_per_epoch() as u64;
                let t = self.optimizer.steps() as u64;
                self.optimizer
                    .set_lr(s.optimizer.lr() * schedule.factor(t, total));
            }
            self.optimizer.zero_grad();
            let mut step_loss = 0.0;
            for micro in 0..s.accumulate {
                let batch = take_batch(upcoming)?;
                // Only the last micro-batch's backward communicates (PyTorch's `no_sync`).
                self.ddp
                    .set_require_gradient_sync(micro + 1 == s.accumulate);
                self.ddp.broadcast_buffers()?;
                let loss = {
                    let _autocast = s.precision.autocast(self.device)?;
                    self.task.train_loss(&self.model, &batch)
                };
                let scaled = &loss / s.accumulate as f64;
                match &self.scaler {
                    Some(scaler) => scaler.scale_loss(&scaled).backward(),
                    None => scaled.backward(),
                }
                upcoming = loader.next();
                let value = loss.double_value(&[]);
                if !value.is_finite() {
                    return Err(TrainError::NonFiniteLoss {
                        rank,
                        value,
                        epoch,
                        step,
                    });
                }
                step_loss += value;
                loss_sum += value * batch.len() as f64;
                samples += batch.len();
                fresh_samples += batch.len();
            }
            self.ddp.sync_gradients()?;
            // The averaged gradients are the same bytes on every rank, so every rank finds
            // the same inf/NaN, the same norm, and skips the same steps.
            let found_inf = self
                .scaler
                .as_ref()
                .is_some_and(|scaler| scaler.unscale(self.ddp.parameters()));
            let grad_norm = s
                .clip_grad_norm
                .map(|max| crate::optim::clip_grad_norm(self.ddp.parameters(), max));
            grad_norm_sum += grad_norm.unwrap_or(0.0);
            if found_inf {
                skipped_steps += 1;
            } else {
                self.optimizer.step();
            }
            if let Some(scaler) = &mut self.scaler {
                scaler.update(found_inf);
            }
            self.budget.step_took(step_started.elapsed());
            if s.log_every > 0 && (step + 1) % s.log_every == 0 {
                let mut line = format!(
                    "[rank {rank}] epoch {epoch} step {}/{steps} loss {:.4}",
                    step + 1,
                    step_loss / s.accumulate as f64
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
                self.log.say(&line);
            }
            let rate = fresh_samples as f64 * self.pg.world_size() as f64
                / started.elapsed().as_secs_f64();
            progress.step(step + 1, loss_sum / samples.max(1) as f64, rate, &self.log);
        }
        progress.finish();
        let mut totals = Tensor::from_slice(&[loss_sum, samples as f64]);
        self.pg.all_reduce(&mut totals, ReduceOp::Sum)?;
        let totals = Vec::<f64>::try_from(&totals)?;
        Ok(EpochTraining {
            loss: totals[0] / totals[1].max(1.0),
            samples: totals[1] as usize,
            steps,
            seconds: earlier_seconds + started.elapsed().as_secs_f64(),
            grad_norm_sum,
            skipped_steps,
        })
    }

    /// Before each step: the ranks agree whether to stop (a stop signal reached some rank,
    /// or some rank's time budget is spent) and whether to checkpoint (every N optimizer
    /// steps, or M minutes since the last checkpoint on some rank), with one all-reduce of
    /// two numbers; then rank 0 writes the checkpoint of `at`, and on a stop every rank waits
    /// for it and returns [`TrainError::Stopped`].
    fn checkpoint_or_stop(
        &mut self,
        at: Position,
        first: usize,
        steps: usize,
        signals: Option<&SignalWatch>,
    ) -> Result<(), TrainError> {
        let s = &self.settings;
        let periodic = at.step > first
            && s.checkpoint_every
                .is_some_and(|n| self.optimizer.steps() as u64 % n == 0);
        // Whether anything may differ between ranks, and so needs their agreement.
        let agree =
            signals.is_some() || s.time_limit_secs.is_some() || s.checkpoint_minutes.is_some();
        let (stop, checkpoint) = if agree {
            let stop_wish = signals
                .and_then(SignalWatch::received)
                .map(StopReason::Signal)
                .or_else(|| {
                    let last = at.step + 1 == steps;
                    self.budget.must_stop(last).then_some(StopReason::TimeLimit)
                });
            let timed = at.step > first
                && s.checkpoint_minutes.is_some_and(|m| {
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
            let removed = state::prune_steps(&self.out, self.settings.keep_checkpoints)?;
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

    /// The run's scalar state after its last optimizer step (at an epoch's end).
    fn train_state(&self) -> TrainState {
        TrainState {
            epoch: 0,
            position: None,
            optimizer_steps: self.optimizer.steps(),
            lr: self.optimizer.lr(),
            scheduler: self.scheduler.clone(),
            bests: self.bests.clone(),
            early_stopping: self.early,
            grad_scaler: self.scaler.as_ref().map(GradScaler::state),
            seed: self.settings.seed,
            config: serde_json::json!({
                "settings": self.settings,
                "task": self.task.describe(),
            }),
        }
    }

    /// Evaluates on this rank's exact shard of the validation split and combines the
    /// statistics of all ranks: the result equals one process evaluating the whole split.
    /// `None` without validation data.
    fn evaluate_epoch(&mut self, epoch: u64) -> Result<Option<(f64, T::Stats)>, TrainError> {
        let (Some(set), Some(sampler)) = (&self.val_set, &self.val_sampler) else {
            return Ok(None);
        };
        let indices: Vec<usize> = sampler.iter().collect();
        let mut loader = self.loader(set, false, epoch, indices)?;
        let mut stats = self.task.new_stats();
        let (mut loss_sum, mut samples) = (0.0f64, 0usize);
        tch::no_grad(|| -> Result<(), TrainError> {
            for batch in &mut loader {
                let batch = batch?;
                // Evaluation runs in the training precision.
                let _autocast = self.settings.precision.autocast(self.device)?;
                let loss = self.task.eval_batch(&self.model, &batch, &mut stats);
                loss_sum += loss.double_value(&[]);
                samples += batch.len();
            }
            Ok(())
        })?;
        let mut sums = vec![loss_sum, samples as f64];
        sums.extend(stats.to_sums());
        let mut t = Tensor::from_slice(&sums).to_kind(Kind::Double);
        self.pg.all_reduce(&mut t, ReduceOp::Sum)?;
        let totals = Vec::<f64>::try_from(&t)?;
        stats.set_sums(&totals[2..]);
        Ok(Some((totals[0] / totals[1].max(1.0), stats)))
    }

    /// Rank 0's end of an epoch: metrics line, curves, best models, checkpoint.
    fn finish_epoch(&mut self, m: &EpochReport, summary: &str) -> Result<(), TrainError> {
        let val = match m.val_loss {
            Some(v) => format!("  val loss {v:.4}"),
            None => String::new(),
        };
        let summary = if summary.is_empty() {
            String::new()
        } else {
            format!("  {summary}")
        };
        self.log.say(&format!(
            "epoch {}/{}: train loss {:.4}{val}{summary}  lr {:.2e}  {:.1} img/s  {:.1} s",
            m.epoch, self.settings.epochs, m.train_loss, m.lr, m.images_per_sec, m.epoch_seconds
        ));
        let metrics_path = self.out.join("metrics.jsonl");
        let line = serde_json::to_string(m).context(|| "encoding an epoch's metrics".into())?;
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&metrics_path)
            .and_then(|mut f| {
                writeln!(f, "{line}")?;
                f.sync_all()
            })
            .map_err(|e| TrainError::io(format!("cannot write {}", metrics_path.display()), e))?;
        self.history.push(m.clone());
        self.draw_curves();
        let meta = std::collections::HashMap::from([("epoch".to_owned(), m.epoch.to_string())]);
        let mut best_notes = Vec::new();
        for monitor in &self.settings.monitors {
            let value = watched(m, &monitor.metric, "a best-model monitor")?;
            let previous = self.bests.get(&monitor.file);
            if previous.is_none_or(|b| monitor.goal.improves(value, b.value)) {
                self.bests.insert(
                    monitor.file.clone(),
                    Best {
                        value,
                        epoch: m.epoch,
                    },
                );
                checkpoint::save(&self.vs, self.out.join(&monitor.file), &meta)?;
            }
            if let Some(b) = self.bests.get(&monitor.file) {
                best_notes.push(format!(
                    "best {} {:.3} (epoch {})",
                    monitor.metric, b.value, b.epoch
                ));
            }
        }
        let st = TrainState {
            epoch: m.epoch,
            ..self.train_state()
        };
        let path = state::save(&self.out, &self.vs, &self.optimizer, &st)?;
        let mut note = format!("checkpoint {}", path.display());
        if !best_notes.is_empty() {
            note.push_str("; ");
            note.push_str(&best_notes.join(", "));
        }
        if self.plots_enabled() {
            note.push_str(&format!(
                "; curves {}",
                self.out.join("curves.png").display()
            ));
        }
        self.log.say(&note);
        Ok(())
    }

    fn plots_enabled(&self) -> bool {
        cfg!(feature = "plot") && self.settings.plot
    }

    /// Redraws `curves.png` (a failure is a warning: the run goes on).
    fn draw_curves(&self) {
        #[cfg(feature = "plot")]
        if self.settings.plot {
            let metrics: Vec<String> = self
                .settings
                .monitors
                .iter()
                .map(|m| m.metric.clone())
                .filter(|m| m != "train_loss" && m != "val_loss")
                .collect();
            let path = self.out.join("curves.png");
            if let Err(e) = crate::plot::draw_curves(&self.history, &metrics, &path) {
                self.log.warn(&e.to_string());
            }
        }
    }
}

/// The number `metric` of an epoch's report, or an error naming what watches it.
fn watched(report: &EpochReport, metric: &str, watcher: &str) -> Result<f64, TrainError> {
    report.metric(metric).ok_or_else(|| {
        let mut names: Vec<&str> = vec!["train_loss", "lr"];
        if report.val_loss.is_some() {
            names.push("val_loss");
        }
        names.extend(report.metrics.keys().map(String::as_str));
        TrainError::Invalid(format!(
            "{watcher} watches '{metric}', which is not a number of the epoch's report \
             (it has: {})",
            names.join(", ")
        ))
    })
}

/// A launcher's restart (`ddp-run --max-restarts`, torchrun's) runs the same command again
/// with `TORCHELASTIC_RESTART_COUNT` raised, and expects the program to continue by itself:
/// with `out` set and a checkpoint in it, a restarted rank resumes from the latest one. So
/// does any new start of a run that was stopped (by a signal or its time limit: a requeued
/// job). An explicit `resume` wins; before the first checkpoint the run starts over. Returns
/// a note for the log ("" when the run does not continue by itself).
fn resume_after_restart(settings: &mut Settings, env: &EnvConfig) -> &'static str {
    if !settings.resume_after_restart || settings.resume.is_some() {
        return "";
    }
    let Some(out) = &settings.out else {
        return "";
    };
    let note = if state::was_stopped(out) {
        ", continuing the stopped run"
    } else if env.restart_count > 0 && state::checkpoint_dir(out).join("latest").is_file() {
        ", after the launcher's restart"
    } else {
        return "";
    };
    settings.resume = Some("latest".to_string());
    note
}

fn take_batch(next: Option<Result<Batch, ddp_data::DataError>>) -> Result<Batch, TrainError> {
    match next {
        Some(b) => Ok(b?),
        None => Err(TrainError::LoaderEnded),
    }
}

/// The trainable tensors in the order every rank agrees on.
fn trainable(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .collect();
    v.sort_by(|a, b| checkpoint::natural_cmp(&a.0, &b.0));
    v
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

/// The default run directory: `runs/<UTC date-time>`.
pub(crate) fn default_run_dir() -> PathBuf {
    let now = time::OffsetDateTime::now_utc();
    PathBuf::from("runs").join(format!(
        "{:04}{:02}{:02}-{:02}{:02}{:02}",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second()
    ))
}

/// The epochs before `start` from an earlier `metrics.jsonl` (a resumed run keeps them and
/// drops any line of an epoch that will be trained again).
fn read_history(out: &Path, start: u64) -> Result<Vec<EpochReport>, TrainError> {
    let path = out.join("metrics.jsonl");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(Vec::new());
    };
    let mut kept_lines = Vec::new();
    let mut reports = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let m: EpochReport = serde_json::from_str(line).map_err(|e| {
            TrainError::Invalid(format!(
                "{} holds a line that is not an epoch's metrics ({e}); move it away to start \
                 a new run there",
                path.display()
            ))
        })?;
        if m.epoch < start {
            kept_lines.push(line.to_owned());
            reports.push(m);
        }
    }
    let mut body = kept_lines.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    write_file(&path, body.as_bytes())?;
    Ok(reports)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    checkpoint::write_atomic(path, bytes)
        .map_err(|e| TrainError::io(format!("cannot write {}", path.display()), e))
}

/// For the fault tests, in debug builds only, before a step:
///
/// - `DDP_TRAIN_FAIL_RANK=r` (or `all`) and `DDP_TRAIN_FAIL_AT=epoch:step` make rank r (or
///   every rank) fail at that step, in the first attempt only (a restarted attempt has
///   `TORCHELASTIC_RESTART_COUNT` > 0): exit with status 17, or with
///   `DDP_TRAIN_FAIL_SIGNAL=KILL` kill itself, or with `STOP` stop itself (a hung rank);
/// - `DDP_TRAIN_STEP_SLEEP_MS=n` makes every step n ms longer (so that a test can act in
///   the middle of an epoch).
fn fail_if_injected(rank: usize, epoch: u64, step: usize, restarted: bool) {
    // Only in debug builds (what the tests run): a release binary never reads these.
    if !cfg!(debug_assertions) {
        return;
    }
    let var = |k: &str| std::env::var(k).ok();
    if let Some(ms) = var("DDP_TRAIN_STEP_SLEEP_MS").and_then(|v| v.parse().ok()) {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let (Some(r), Some(at)) = (var("DDP_TRAIN_FAIL_RANK"), var("DDP_TRAIN_FAIL_AT")) else {
        return;
    };
    if restarted || (r != "all" && r.parse() != Ok(rank)) || at != format!("{epoch}:{step}") {
        return;
    }
    let how = var("DDP_TRAIN_FAIL_SIGNAL").unwrap_or_default();
    tracing::warn!(
        "rank {rank}: injected failure ({}) at epoch {epoch} step {step} (DDP_TRAIN_FAIL_AT)",
        if how.is_empty() { "exit 17" } else { &how }
    );
    let signal = match how.as_str() {
        "KILL" => libc::SIGKILL,
        "STOP" => libc::SIGSTOP,
        _ => std::process::exit(17),
    };
    // SAFETY: raise(3) on this process; for SIGSTOP it returns once the process is continued.
    unsafe {
        libc::raise(signal);
    }
}

/// A rank's log: appended to `<run>/logs/rank-<r>.log` and emitted as `tracing` events
/// (target `ddp_train`; the program's subscriber decides what is shown where).
#[derive(Debug)]
struct RankLog {
    file: std::sync::Mutex<std::fs::File>,
}

impl RankLog {
    fn open(out: &Path, rank: usize) -> Result<Self, TrainError> {
        let path = out.join("logs").join(format!("rank-{rank}.log"));
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| TrainError::io(format!("cannot open {}", path.display()), e))?;
        Ok(Self {
            file: std::sync::Mutex::new(file),
        })
    }

    fn say(&self, line: &str) {
        tracing::info!("{line}");
        self.append(line);
    }

    #[cfg(feature = "plot")]
    fn warn(&self, line: &str) {
        let line = format!("warning: {line}");
        tracing::warn!("{line}");
        self.append(&line);
    }

    fn append(&self, line: &str) {
        if let Ok(mut f) = self.file.lock() {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// Rank 0's progress: a bar when stdout is a terminal, a log line every tenth of the epoch
/// otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    plain: bool,
    epoch: u64,
    epochs: u64,
    steps: usize,
}

impl Progress {
    fn new(show: bool, epoch: u64, epochs: u64, steps: usize) -> Self {
        // indicatif draws on stderr.
        let terminal = show && std::io::stderr().is_terminal();
        let bar = terminal.then(|| {
            let bar = ProgressBar::new(steps as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "epoch {prefix} [{bar:30}] {pos}/{len} steps  {msg}  eta {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_prefix(format!("{epoch}/{epochs}"));
            bar
        });
        Self {
            bar,
            plain: show && !terminal,
            epoch,
            epochs,
            steps,
        }
    }

    fn step(&self, step: usize, loss: f64, rate: f64, log: &RankLog) {
        if let Some(bar) = &self.bar {
            bar.set_position(step as u64);
            bar.set_message(format!("loss {loss:.4}  {rate:.1} img/s"));
        } else if self.plain
            && (step * 10 / self.steps.max(1) != (step - 1) * 10 / self.steps.max(1))
        {
            log.say(&format!(
                "epoch {}/{} step {step}/{}  loss {loss:.4}  {rate:.1} img/s",
                self.epoch, self.epochs, self.steps
            ));
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
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

    #[test]
    fn reports_round_trip_and_name_their_numbers() {
        let line = r#"{"epoch":2,"train_loss":0.5,"val_loss":0.6,"val_f1":0.7,"val_f1_per_class":[0.1,0.2],"lr":0.001,"images_per_sec":10.0,"epoch_seconds":1.5,"steps":4,"world_size":2}"#;
        let r: EpochReport = serde_json::from_str(line).unwrap();
        assert_eq!(r.metric("val_f1"), Some(0.7));
        assert_eq!(r.metric("val_loss"), Some(0.6));
        assert_eq!(r.metric("val_f1_per_class"), None);
        assert_eq!(r.metrics.len(), 2);
        let back: EpochReport = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
        let err = watched(&r, "accuracy", "a monitor")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("'accuracy'") && err.contains("val_f1"),
            "{err}"
        );
    }
}
