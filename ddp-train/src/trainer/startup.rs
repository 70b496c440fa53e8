//! A rank's start-up: [`Trainer::new`] checks the settings and the data, shards the data,
//! has the model built and its weights loaded or restored (`restore.rs`), joins the
//! process group, agrees with the other ranks on the settings, the checkpoint, the data and
//! the run directory, and describes the run in its log and `config.json`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ddp_comm::{EnvConfig, ProcessGroup};
use ddp_data::Dataset;
use ddp_sampler::{DistributedSampler, Partition};
use tch::{nn, Tensor};

use super::outputs::{read_history, write_file, RankLog};
use super::restore::Start;
use super::run_dir::{self, resume_after_restart, RUN_ID_KEY};
use super::Trainer;
use crate::ddp::DistributedDataParallel;
use crate::error::{Context, SettingError, TrainError};
use crate::functional::GroupReducer;
use crate::settings::Settings;
use crate::stop::Budget;
use crate::task::{Stats, Task};

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
        // A failure of an earlier Trainer is not this one's (nor the program's, if handled).
        crate::exit::clear_failure();
        // The time limit counts from the job's start, as a scheduler's limit does: the
        // launcher's (a restarted rank's job began before it) or the process's. Without a
        // limit, the launcher's start is not read.
        let limited = settings.runtime.time_limit_secs.is_some();
        let started = crate::stop::limit_started(limited).map_err(TrainError::Invalid)?;
        // A rank started through a wrapper script dies with its launcher all the same.
        ddp_run::die_with_launcher().map_err(|e| TrainError::Invalid(e.to_string()))?;
        settings.validate()?;
        // From here on SIGTERM or SIGUSR1 (a scheduler's preemption, say) asks for a stop,
        // taken at the first step with a checkpoint, rather than ending the rank: the data
        // and the rendezvous can take minutes (`evaluate` takes it before a round of batches).
        // Under `cli::run` the watch began before the program opened its data, and is adopted.
        // `eval_only` has nothing to continue from: the signals end it as before.
        let wanted = settings.runtime.stop_on_signals && !settings.checkpoint.eval_only;
        let signals = crate::stop::trainer_watch(wanted).map_err(TrainError::Invalid)?;
        let given = settings.checkpoint.resume.clone();
        let continuing = resume_after_restart(&mut settings, env)?;
        // The intra-op threads: --threads, else OMP_NUM_THREADS, else the cores per rank.
        let (device, threads) = settings
            .runtime
            .place(env.local_rank, env.local_world_size)?;
        let train_set = task.train_data();
        let val_set = task.val_data();
        let fresh = val_set.as_ref().map(|_| task.new_stats());
        let stats = fresh.as_ref().map(|f| f.report().into_map());
        if let (Some(fresh), Some(report)) = (&fresh, &stats) {
            let details = fresh.details().into_map();
            crate::report::check_metric_names(report, &details, settings.checkpoint.eval_only)?;
        }
        if !settings.checkpoint.eval_only {
            settings.check_watched(stats.as_ref())?;
        }
        if env.rank >= env.world_size {
            // The rendezvous refuses it, and tells the other ranks, which then fail at once.
            ProcessGroup::new(ddp_comm::Options::from_config(env))
                .context(|| "joining the process group".into())?;
        }
        let s = &settings;
        let continues = s.checkpoint.resume_after_restart && !s.checkpoint.eval_only;
        if let (None, true, Some(restarts)) = (&s.out, continues, restarts(env)) {
            // Each start would name its own run directory: a restart would start over.
            return Err(SettingError::new(
                "out",
                format!(
                    " is not set, and {restarts}: each start would make a run directory of \
                     its own, so a restarted rank would start over in a new one; set it, the \
                     same on every start, and a restart continues from the run's latest \
                     checkpoint"
                ),
            )
            .into());
        }
        let batches = s.batch_size * s.accumulate;
        let train_sampler = DistributedSampler::builder(train_set.len(), env.world_size, env.rank)
            .seed(s.seed)
            .build()
            .context(|| format!("sharding {} training samples", train_set.len()))?;
        if train_sampler.len() < batches && !s.checkpoint.eval_only {
            return Err(SettingError::starting(format!(
                "each of the {} ranks gets {} training samples, fewer than one step of ",
                env.world_size,
                train_sampler.len(),
            ))
            .setting("batch_size")
            .text(format!(" {} x ", s.batch_size))
            .setting("accumulate")
            .text(format!(" {}: lower them or use more data", s.accumulate))
            .into());
        }
        let val_sampler = match &val_set {
            Some(v) => Some(
                DistributedSampler::builder(v.len(), env.world_size, env.rank)
                    .shuffle(false)
                    .partition(Partition::Exact)
                    // Fewer samples than ranks: the ranks without any still combine the sums.
                    .allow_empty_shards(true)
                    .build()
                    .context(|| format!("sharding {} validation samples", v.len()))?,
            ),
            None => None,
        };

        // Model and checkpoint before meeting the other ranks: a bad checkpoint fails on
        // every rank alike instead of leaving some waiting in a collective.
        let start = Start {
            task: &task,
            env,
            device,
            threads,
            train_len: train_set.len(),
            given,
        };
        let built = start.build(s, &continuing)?;
        super::faults::note_resumed(env.rank, built.resumed_file.as_deref());
        let mut opts = ddp_comm::Options::from_config(env).device(device);
        if let Some(secs) = s.runtime.collective_timeout_secs {
            opts = opts.op_timeout(Duration::from_secs(secs));
        }
        let pg = Arc::new(ProcessGroup::new(opts).context(|| "joining the process group".into())?);
        let rank = pg.rank();
        // Each rank was started on its own: with other settings (but those a rank sets its
        // own way), task options or build, the replicas would drift apart or fail later.
        // First, since a resume point includes settings (the batch layout): a rank given
        // another --batch-size is named as such, not as one resuming from elsewhere.
        super::agreement::check_settings(&pg, s, &task)?;
        // Each rank resolved its checkpoint on its own: all must continue from the same one,
        // or all stop with the same error.
        let m = start.agree(&pg, s, built)?;
        // Each rank opened the data on its own: a folder that differs between ranks (another
        // copy, a file one rank could not read, other labels) would shard mismatched lists.
        let sizes = (train_set.len(), val_set.as_ref().map_or(0, Dataset::len));
        super::agreement::check_data(&pg, &task, sizes)?;

        // Every rank agrees on the run directory: rank 0's choice.
        let proposed = s.out.clone().unwrap_or_else(default_run_dir);
        let gathered = pg.all_gather_bytes(proposed.to_string_lossy().as_bytes())?;
        let out = PathBuf::from(String::from_utf8_lossy(&gathered[0]).into_owned());
        ddp_model::checkpoint::create_dir_all_synced(&out.join("logs")).map_err(|e| {
            TrainError::io(format!("cannot create run directory {}", out.display()), e)
        })?;
        let (run_lock, unlocked) = run_dir::claim_run_dir(&pg, &out)?;
        let (log, aside) = (RankLog::open(&out, rank)?, run_dir::AsideDir::new(&out));
        for warning in m.warnings.iter().chain(&unlocked) {
            log.warn(warning);
        }
        if rank == 0 {
            let resumed = m.resumed_file.as_deref();
            run_dir::prepare_run_dir(&out, resumed, &s.monitors, &m.bests, &aside, &log)?;
        }
        if rank == 0 && !m.frozen.is_empty() {
            let until = s.freeze.unfreeze_at.map_or_else(
                || "for the whole run".to_string(),
                |e| format!("until epoch {e}"),
            );
            log.say(&format!(
                "frozen: {} of the model's {} parameters ({}) {until}",
                m.frozen.len(),
                m.parameters.len(),
                s.freeze.prefixes.join(", ")
            ));
        }
        if let Some(note) = &m.resumed_note {
            log.say(note);
        }
        if let (Some(note), 0) = (&m.init.0, rank) {
            log.say(note);
        }
        let mut ddp = DistributedDataParallel::new(&m.vs, pg.clone(), s.ddp)?;
        if let Some(order) = &m.bucket_order {
            // The buckets the run reduced in; another set of parameters keeps the default.
            ddp.restore_bucket_order(order)?;
        }
        let sync_bn = s.sync_batchnorm.then(|| {
            let reducer = Arc::new(GroupReducer::new(pg.clone()));
            m.norms.synchronise(Some(reducer.clone()));
            if rank == 0 {
                log.say(&format!(
                    "SyncBatchNorm: {} BatchNorm layers take their training statistics over \
                     {} ranks",
                    m.norms.len(),
                    pg.world_size()
                ));
            }
            reducer
        });
        // An evaluation trains no epoch: a run's `metrics.jsonl` in its `--out` stays whole.
        let history = if rank == 0 && !s.checkpoint.eval_only {
            let (history, cut) = read_history(&out, m.start_epoch, &aside)?;
            if let Some(warning) = cut {
                log.warn(&warning);
            }
            history
        } else {
            Vec::new()
        };
        settings.checkpoint.resume = m.resume;
        let s_time_limit = settings.runtime.time_limit_secs.map(Duration::from_secs);
        // The model and the optimizer's state (at most two tensors per parameter).
        let checkpoint_bytes =
            m.vs.variables()
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
            _run_lock: run_lock,
            vs: m.vs,
            model: m.model,
            ddp,
            sync_bn,
            optimizer: m.optimizer,
            parameters: m.parameters,
            frozen: m.frozen,
            restarted: env.restart_count > 0,
            scaler: m.scaler,
            skipped_steps: m.skipped_steps,
            scheduled_samples: m.scheduled_samples,
            early: m.early,
            scheduler: m.scheduler,
            start_epoch: m.start_epoch,
            start_position: m.start_position,
            allocation: m.allocation,
            plan: m.plan,
            allocation_change: m.allocation_change,
            budget: Budget::new(started, s_time_limit, val_batches, checkpoint_bytes),
            signals,
            stop_checks: None,
            last_checkpoint: Instant::now(),
            stopped: None,
            failed_in: None,
            bests: m.bests,
            history,
            log,
            train_set,
            val_set,
            train_sampler,
            val_sampler,
        };
        trainer.describe(m.init.1, &env.run_id, m.resumed_file.as_deref())?;
        // Curves set aside with the epochs they drew show those kept.
        if !trainer.history.is_empty() && !trainer.out.join("curves.png").exists() {
            trainer.draw_curves();
        }
        Ok(trainer)
    }

    fn describe(
        &self,
        init_weights: serde_json::Value,
        run_id: &str,
        resumed: Option<&Path>,
    ) -> Result<(), TrainError> {
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
        for line in self.task.warnings() {
            self.log.warn(&line);
        }
        self.note_missing_curves();
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
        // The tutorials print the model; its size tells that the intended one was built.
        let vars = self.vs.variables();
        let numel = |names: &[String]| -> usize {
            names
                .iter()
                .filter_map(|n| vars.get(n))
                .map(Tensor::numel)
                .sum()
        };
        let frozen = match numel(&self.frozen) {
            0 => String::new(),
            n => format!(" ({n} frozen)"),
        };
        self.log.say(&format!(
            "model: {} parameters in {} tensors{frozen}",
            numel(&self.parameters),
            self.parameters.len()
        ));
        // What the checkpoints record of the run (settings, task, world size, device,
        // threads), and the rest.
        let mut json = self.state_config();
        let rest = serde_json::json!({
            "backend": format!("{:?}", self.pg.backend()),
            "train_samples": self.train_set.len(),
            "allocation": self.allocation,
            "planned_optimizer_steps": self.plan.optimizer_steps,
            "planned_global_batch": self.plan.global_batch,
            "allocation_change": self.allocation_change,
            "val_samples": val_len,
            "init_weights": init_weights,
            "run_dir": self.out.to_string_lossy(),
        });
        if let (Some(all), serde_json::Value::Object(rest)) = (json.as_object_mut(), rest) {
            all.extend(rest);
        }
        let file = self.out.join("config.json");
        if s.checkpoint.eval_only && file.exists() {
            // An evaluation in a run's directory leaves that run's record, and the job id a
            // requeue of it is recognised by, as they are.
            self.log.say(&format!(
                "evaluating only: {} stays as the run wrote it",
                file.display()
            ));
            return Ok(());
        }
        if let Some(from) = resumed {
            let plateau = self.scheduler.as_ref().map(|r| r.config);
            let lr = self.optimizer.lr();
            super::checkpoint::keep_start_record(&mut json, &file, from, lr, plateau);
        }
        json[RUN_ID_KEY] = run_id.into();
        let text = serde_json::to_string_pretty(&json).context(|| "encoding config.json".into())?;
        write_file(&file, text.as_bytes())
    }
}

/// The tensors that train (require a gradient), in the order every rank agrees on, a tied
/// weight once (as DDP takes it): the optimizer steps it once.
pub(super) fn trainable(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    crate::ddp::trainable_parameters(vs)
}

/// What says that the launcher restarts the ranks, if anything does.
fn restarts(env: &EnvConfig) -> Option<String> {
    if env.restart_count > 0 {
        Some(format!(
            "this rank was restarted (TORCHELASTIC_RESTART_COUNT={})",
            env.restart_count
        ))
    } else if env.max_restarts > 0 {
        Some(format!(
            "the launcher restarts failed ranks (--max-restarts {})",
            env.max_restarts
        ))
    } else {
        None
    }
}

/// The default run directory: `runs/YYYYMMDD-HHMMSS-PID` (UTC), as every tool names it.
pub(crate) fn default_run_dir() -> PathBuf {
    ddp_run::default_run_dir(Path::new("runs"))
}
