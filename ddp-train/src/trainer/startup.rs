//! A rank's start-up: [`Trainer::new`] checks the settings and the data, shards the data,
//! builds the model, loads its initial weights or restores a checkpoint (by itself after a
//! launcher's restart or a stopped run), joins the process group, agrees on the run directory and describes the run in its
//! log and `config.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ddp_comm::{EnvConfig, ProcessGroup};
use ddp_data::Dataset;
use ddp_model::checkpoint;
use ddp_model::norm::BatchNormLayers;
use ddp_model::weights::{self, LoadReport, Strictness, WeightsError};
use ddp_sampler::{DistributedSampler, Partition};
use tch::{nn, Device, Tensor};

use super::freeze;
use super::outputs::{read_history, write_file, RankLog};
use super::run_dir::{self, resume_after_restart, RUN_ID_KEY};
use super::Trainer;
use crate::allocation::{self, Allocation, Plan};
use crate::amp::{GradScaler, Precision};
use crate::ddp::DistributedDataParallel;
use crate::error::{Context, SettingError, TrainError};
use crate::functional::GroupReducer;
use crate::lr_schedule::LrSchedule;
use crate::optim::Optimizer;
use crate::scheduler::ReduceLrOnPlateau;
use crate::settings::Settings;
use crate::state::{self, EarlyStopState};
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
        let continuing = resume_after_restart(&mut settings, env)?;
        // The intra-op threads: --threads, else OMP_NUM_THREADS, else the cores per rank.
        let (device, threads) = settings
            .runtime
            .place(env.local_rank, env.local_world_size)?;
        let train_set = task.train_data();
        let val_set = task.val_data();
        if !settings.checkpoint.eval_only {
            let stats = val_set
                .as_ref()
                .map(|_| task.new_stats().report().into_map());
            settings.check_watched(stats.as_ref())?;
        }
        let resume_from = match &settings.checkpoint.resume {
            Some(r) => Some(state::resolve(r, settings.out.as_deref())?),
            None => None,
        };
        if env.rank >= env.world_size {
            // The rendezvous refuses it, and tells the other ranks, which then fail at once.
            ProcessGroup::new(ddp_comm::Options::from_config(env))
                .context(|| "joining the process group".into())?;
        }
        let s = &settings;
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
        tch::manual_seed(s.seed as i64);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let (model, norms) = BatchNormLayers::collect(|| task.model(&vs.root()));
        if s.sync_batchnorm && norms.is_empty() {
            return Err(no_batchnorm_to_synchronise(&vs).into());
        }
        let (init_note, init_record) = init_weights(&vs, s, resume_from.as_deref(), |report| {
            task.init_unloaded(&model, report)
        })?;
        let parameters = freeze::declared_parameters(&vs);
        let mut frozen = freeze::freezable(&parameters, &s.freeze)?;
        if !s.freeze.frozen_in(1) || s.checkpoint.eval_only {
            frozen.clear();
        }
        freeze::set_frozen(&vs, &parameters, &frozen);
        // Frozen from the first epoch, every tensor (a tied weight once, by any name).
        if !frozen.is_empty() && trainable(&vs).is_empty() {
            return Err(s.freeze.nothing_to_train(parameters.len()).into());
        }
        let mut scheduler = match &s.lr_schedule {
            LrSchedule::Plateau(p) => Some(ReduceLrOnPlateau::new(p.config)),
            _ => None,
        };
        let now = Allocation {
            world_size: env.world_size,
            batch_size: s.batch_size,
            accumulate: s.accumulate,
        };
        let steps_now = now.steps_per_epoch(train_set.len(), s.max_steps_per_epoch);
        let mut plan = Plan {
            epochs: s.epochs,
            optimizer_steps: super::checkpoint::planned_steps(s, steps_now, (0, 0, 0))?,
        };
        let mut allocation_change = None;
        let (mut start_epoch, mut bests) = (1, BTreeMap::new());
        let mut start_position = None;
        let mut scaler = (s.precision == Precision::Fp16).then(GradScaler::default);
        let mut skipped_steps = 0;
        let mut early = s.early_stopping.patience.map(|_| EarlyStopState::default());
        let mut restored = None;
        let mut bucket_order = None;
        let mut resumed_note = None;
        let mut resume_key = String::from("none");
        let mut fallback_warnings = Vec::new();
        if let (Some(path), true) = (&resume_from, s.checkpoint.eval_only) {
            let recorded = super::checkpoint::load_evaluated(&vs, path)?;
            if let Some(recorded) = &recorded {
                let checked = super::checkpoint::check_evaluated(recorded, s, &task);
                fallback_warnings.extend(checked?);
            }
            resume_key = state::resume_key(path, None);
            resumed_note = Some(format!("evaluating {}", path.display()));
        } else if let Some(newest) = &resume_from {
            // `latest` that cannot be loaded (a damaged file) falls back to the run's previous
            // checkpoints, newest first; every rank must end on the same one (checked below).
            let mut candidates = vec![newest.clone()];
            if let (Some("latest"), Some(run)) = (s.checkpoint.resume.as_deref(), s.out.as_deref())
            {
                candidates.extend(state::fallbacks(run, newest));
            }
            let mut first_error = None;
            let candidates_tried = candidates.len();
            for path in candidates {
                // Loaded on the CPU first, then moved with the model to the rank's device;
                // the optimizer over the parameters that were not frozen then.
                let saved = state::read(&path);
                if let Ok(saved) = &saved {
                    // Not a damaged file: an older checkpoint of the run would not do either.
                    super::checkpoint::refuse_resume(&saved.state, s, train_set.len(), &path)?;
                }
                let attempt = saved.and_then(|mut saved| {
                    let was_frozen = freeze::recorded(&parameters, &saved.state.frozen, &path)?;
                    freeze::set_frozen(&vs, &parameters, &was_frozen);
                    let mut cpu_optimizer = Optimizer::new(trainable(&vs), s.optimizer);
                    let notes = std::mem::take(&mut saved.notes);
                    let st = saved.restore(&vs, &mut cpu_optimizer)?;
                    Ok((st, cpu_optimizer, was_frozen, notes))
                });
                match attempt {
                    Ok((st, cpu_optimizer, was_frozen, notes)) => {
                        fallback_warnings.extend(notes);
                        resume_key = state::resume_key(&path, Some(&st));
                        restored = Some((st, path, cpu_optimizer));
                        frozen = was_frozen;
                        break;
                    }
                    Err(e) => {
                        fallback_warnings.push(format!(
                            "cannot resume from {}: {}; trying the previous checkpoint",
                            path.display(),
                            crate::error::with_causes(&e)
                        ));
                        first_error.get_or_insert(e);
                    }
                }
            }
            if let (None, Some(e)) = (&restored, first_error) {
                if s.checkpoint.resume.as_deref() != Some("latest") {
                    return Err(e);
                }
                // Nothing of the run could be read: say what is left to do.
                let older = candidates_tried - 1;
                return Err(TrainError::Invalid(format!(
                    "{}; {} could be read either: to continue, give --resume with a \
                     checkpoint file that reads; to start a new run, another --out",
                    crate::error::with_causes(&e),
                    match older {
                        0 => "no older checkpoint of the run".to_string(),
                        n => format!("none of the {n} older checkpoint(s) of the run"),
                    }
                )));
            }
        }
        vs.set_device(device);
        let mut optimizer = Optimizer::new(trainable(&vs), s.optimizer);
        let resumed_file = restored.as_ref().map(|(_, path, _)| path.clone());
        if let Some((st, path, cpu_optimizer)) = restored {
            // load_state moves the CPU copies to the parameters' device.
            let tensors = cpu_optimizer.state_tensors().into_iter().collect();
            optimizer
                .load_state(&tensors, st.optimizer_steps)
                .map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display())))?;
            optimizer.set_lr(st.lr);
            fallback_warnings.extend(super::checkpoint::resume_warnings(
                &st,
                s,
                &task,
                train_set.len(),
            ));
            fallback_warnings.extend(super::checkpoint::threads_warning(
                &st.config,
                device,
                threads,
                env.world_size,
            ));
            bucket_order = st.bucket_order.clone();
            if st.scheduler.is_some() {
                scheduler = st.scheduler.clone();
            }
            bests = st.bests.clone();
            if let (Some(scaler), Some(saved)) = (scaler.as_mut(), st.grad_scaler) {
                scaler.set_state(saved);
            }
            skipped_steps = st.skipped_steps();
            if let (Some(early), Some(saved)) = (early.as_mut(), st.early_stopping) {
                *early = saved;
            }
            let rest = match st.position {
                Some(p) => Some(
                    super::checkpoint::continue_at(&st, &p, now, steps_now).map_err(|e| {
                        TrainError::Invalid(format!(
                            "cannot continue epoch {} of {} on {now}: {e}",
                            p.epoch,
                            path.display()
                        ))
                    })?,
                ),
                None => None,
            };
            let (resumed, warning) =
                super::checkpoint::resumed_plan(&st, rest.as_ref(), s, now, steps_now)?;
            plan = resumed;
            fallback_warnings.extend(warning);
            // An earlier start's change inside this epoch, unless this start changes again.
            allocation_change = st.allocation_change.clone();
            if let Some(before) = st.allocation.filter(|b| *b != now) {
                let epoch = st.position.map_or(st.epoch + 1, |p| p.epoch);
                let spe = (
                    before.steps_per_epoch(train_set.len(), s.max_steps_per_epoch),
                    steps_now,
                );
                fallback_warnings.push(super::checkpoint::describe_change(
                    before,
                    now,
                    (epoch, train_set.len()),
                    rest.as_ref(),
                    spe,
                    (plan, s.max_steps_per_epoch),
                ));
                allocation_change = Some(allocation::change_record(
                    epoch,
                    before,
                    now,
                    rest.as_ref(),
                    spe,
                ));
            }
            resume_key.push_str(&format!("; continuing on {now}"));
            let at = match (st.position, rest) {
                (Some(p), Some(rest)) => {
                    start_epoch = p.epoch;
                    start_position = Some((p, rest));
                    format!("epoch {} at step {}", p.epoch, p.step)
                }
                _ => {
                    start_epoch = st.epoch + 1;
                    format!("epoch {} done", st.epoch)
                }
            };
            resumed_note = Some(format!(
                "resumed from {} ({at}){continuing}",
                path.display()
            ));
        }
        let mut opts = ddp_comm::Options::from_config(env).device(device);
        if let Some(secs) = s.runtime.collective_timeout_secs {
            opts = opts.op_timeout(Duration::from_secs(secs));
        }
        let pg = Arc::new(ProcessGroup::new(opts).context(|| "joining the process group".into())?);
        let rank = pg.rank();
        // Each rank resolved its checkpoint on its own: all must continue from the same one,
        // or all stop with the same error.
        state::check_resume_agreement(&pg.all_gather_bytes(resume_key.as_bytes())?)?;
        // Each rank opened the data on its own: a folder that differs between ranks (another
        // copy, a file one rank could not read) would shard mismatched lists.
        let sizes = format!(
            "{} training and {} validation samples",
            train_set.len(),
            val_set.as_ref().map_or(0, Dataset::len)
        );
        state::check_data_agreement(&pg.all_gather_bytes(sizes.as_bytes())?)?;

        // Every rank agrees on the run directory: rank 0's choice.
        let proposed = s.out.clone().unwrap_or_else(default_run_dir);
        let gathered = pg.all_gather_bytes(proposed.to_string_lossy().as_bytes())?;
        let out = PathBuf::from(String::from_utf8_lossy(&gathered[0]).into_owned());
        std::fs::create_dir_all(out.join("logs")).map_err(|e| {
            TrainError::io(format!("cannot create run directory {}", out.display()), e)
        })?;
        let (run_lock, unlocked) = run_dir::claim_run_dir(&pg, &out)?;
        let (log, aside) = (RankLog::open(&out, rank)?, run_dir::AsideDir::new(&out));
        for warning in fallback_warnings.iter().chain(&unlocked) {
            log.warn(warning);
        }
        if rank == 0 {
            let resumed = resumed_file.as_deref();
            run_dir::prepare_run_dir(&out, resumed, &s.monitors, &bests, &aside, &log)?;
        }
        if rank == 0 && !frozen.is_empty() {
            let until = s.freeze.unfreeze_at.map_or_else(
                || "for the whole run".to_string(),
                |e| format!("until epoch {e}"),
            );
            log.say(&format!(
                "frozen: {} of the model's {} parameters ({}) {until}",
                frozen.len(),
                parameters.len(),
                s.freeze.prefixes.join(", ")
            ));
        }
        if let Some(note) = resumed_note {
            log.say(&note);
        }
        if let (Some(note), 0) = (init_note, rank) {
            log.say(&note);
        }
        let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), s.ddp)?;
        if let Some(order) = &bucket_order {
            // The buckets the run reduced in; another set of parameters keeps the default.
            ddp.restore_bucket_order(order);
        }
        let sync_bn = s.sync_batchnorm.then(|| {
            let reducer = Arc::new(GroupReducer::new(pg.clone()));
            norms.synchronise(Some(reducer.clone()));
            if rank == 0 {
                log.say(&format!(
                    "SyncBatchNorm: {} BatchNorm layers take their training statistics over \
                     {} ranks",
                    norms.len(),
                    pg.world_size()
                ));
            }
            reducer
        });
        // An evaluation trains no epoch: a run's `metrics.jsonl` in its `--out` stays whole.
        let history = if rank == 0 && !s.checkpoint.eval_only {
            let (history, cut) = read_history(&out, start_epoch, &aside)?;
            if let Some(warning) = cut {
                log.warn(&warning);
            }
            history
        } else {
            Vec::new()
        };
        let s_time_limit = settings.runtime.time_limit_secs.map(Duration::from_secs);
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
            _run_lock: run_lock,
            vs,
            model,
            ddp,
            sync_bn,
            optimizer,
            parameters,
            frozen,
            restarted: env.restart_count > 0,
            scaler,
            skipped_steps,
            early,
            scheduler,
            start_epoch,
            start_position,
            allocation: now,
            plan,
            allocation_change,
            budget: Budget::new(started, s_time_limit, val_batches, checkpoint_bytes),
            signals,
            last_checkpoint: Instant::now(),
            stopped: None,
            bests,
            history,
            log,
            train_set,
            val_set,
            train_sampler,
            val_sampler,
        };
        trainer.describe(init_record, &env.run_id, resumed_file.as_deref())?;
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
        // Settings::validate refused the paths that are not UTF-8, the one way this fails.
        let settings = serde_json::to_value(s).context(|| "encoding config.json".into())?;
        let mut json = serde_json::json!({
            "settings": settings,
            "task": self.task.describe(),
            "world_size": self.pg.world_size(),
            "backend": format!("{:?}", self.pg.backend()),
            "device": format!("{:?}", self.device),
            "intra_op_threads": self.threads,
            "train_samples": self.train_set.len(),
            "allocation": self.allocation,
            "planned_optimizer_steps": self.plan.optimizer_steps,
            "allocation_change": self.allocation_change,
            "val_samples": val_len,
            "init_weights": init_weights,
            "run_dir": self.out.to_string_lossy(),
        });
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
            super::checkpoint::keep_start_record(&mut json, &file, from, self.optimizer.lr());
        }
        json[RUN_ID_KEY] = run_id.into();
        let text = serde_json::to_string_pretty(&json).context(|| "encoding config.json".into())?;
        write_file(&file, text.as_bytes())
    }
}

/// Loads `checkpoint.init_from` into the freshly built model (on the CPU, before the process
/// group exists: a bad file fails on every rank alike), unless the run resumes from
/// `resume_from`, which takes precedence, then hands what was loaded to `init_unloaded`
/// ([`Task::init_unloaded`]). Returns rank 0's log line and `config.json`'s record of what
/// was loaded.
fn init_weights(
    vs: &nn::VarStore,
    s: &Settings,
    resume_from: Option<&Path>,
    init_unloaded: impl FnOnce(&LoadReport),
) -> Result<(Option<String>, serde_json::Value), TrainError> {
    let Some(file) = &s.checkpoint.init_from else {
        return Ok((None, serde_json::Value::Null));
    };
    if let Some(from) = resume_from {
        let note = format!(
            "initial weights {} not loaded: resuming from {} takes precedence",
            file.display(),
            from.display()
        );
        let record = serde_json::json!({
            "file": file.to_string_lossy(),
            "loaded": false,
            "resumed_from": from.to_string_lossy(),
        });
        return Ok((Some(note), record));
    }
    let strictness = if s.checkpoint.init_partial {
        Strictness::Partial
    } else {
        Strictness::Strict
    };
    let key = s.checkpoint.init_key.as_deref();
    let report = weights::load(vs, file, key, strictness).map_err(|e| match e {
        // The key is what the user must set, or change.
        WeightsError::SeveralStateDicts { .. } => TrainError::from(
            SettingError::starting(format!("{e} ("))
                .setting("checkpoint.init_key")
                .text(")"),
        ),
        WeightsError::NoEntry { .. } => {
            TrainError::from(SettingError::new("checkpoint.init_key", format!(": {e}")))
        }
        // Say how to load what fits.
        WeightsError::Mismatch { .. } => TrainError::from(
            SettingError::starting(format!("{e}; to load what fits, set "))
                .setting("checkpoint.init_partial"),
        ),
        e => TrainError::from(e),
    })?;
    if report.loaded.is_empty() {
        // A partial load that matched nothing would train from scratch under a note.
        let example = match (report.unexpected.first(), report.missing.first()) {
            (Some(theirs), Some(ours)) => {
                format!("the file has e.g. '{theirs}', the model e.g. '{ours}'")
            }
            _ => match report.mismatched.first() {
                Some(m) => format!(
                    "e.g. '{}' is {:?} in the file and {:?} in the model",
                    m.name, m.found, m.expected
                ),
                None => "the file holds no tensor".to_string(),
            },
        };
        return Err(SettingError::new(
            "checkpoint.init_from",
            format!(
                " {}: no tensor of the file has a name and shape of the model ({example}): \
                 save the model's own state_dict, or pick its entry with ",
                file.display(),
            ),
        )
        .setting("checkpoint.init_key")
        .into());
    }
    init_unloaded(&report);
    let note = format!("initial weights from {}: {report}", file.display());
    let mismatched: Vec<_> = report
        .mismatched
        .iter()
        .map(|m| serde_json::json!({ "name": m.name, "model": m.expected, "file": m.found }))
        .collect();
    let record = serde_json::json!({
        "file": file.to_string_lossy(),
        "loaded": true,
        "partial": s.checkpoint.init_partial,
        "entry": report.entry,
        "tensors_loaded": report.loaded.len(),
        "stripped_module_prefix": report.stripped_module_prefix,
        "missing": report.missing,
        "unexpected": report.unexpected,
        "mismatched": mismatched,
    });
    Ok((Some(note), record))
}

/// `sync_batchnorm` with a model that has no [`ddp_model::norm::BatchNorm2d`]: names the
/// BatchNorm-like buffers it has instead (tch's `nn::batch_norm2d`), if any.
fn no_batchnorm_to_synchronise(vs: &nn::VarStore) -> SettingError {
    let mut others: Vec<String> = vs
        .variables()
        .into_keys()
        .filter_map(|n| n.strip_suffix(".running_mean").map(str::to_string))
        .collect();
    others.sort_by(|a, b| checkpoint::natural_cmp(a, b));
    let found = if others.is_empty() {
        "the model has no BatchNorm layer to synchronise".to_string()
    } else {
        format!(
            "the model's BatchNorm layers ({}) are not ddp_model::norm::BatchNorm2d, which \
             alone can synchronise: build them with BatchNorm2d::new",
            others.join(", ")
        )
    };
    SettingError::new("sync_batchnorm", format!(" is set, but {found}"))
}

/// The tensors that train (require a gradient), in the order every rank agrees on, a tied
/// weight once (as DDP takes it): the optimizer steps it once.
pub(super) fn trainable(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    crate::ddp::trainable_parameters(vs)
}

/// The default run directory: `runs/YYYYMMDD-HHMMSS-PID` (UTC), as every tool names it.
pub(crate) fn default_run_dir() -> PathBuf {
    ddp_run::default_run_dir(Path::new("runs"))
}
