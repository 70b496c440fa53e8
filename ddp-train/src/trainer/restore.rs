//! The model a rank starts from: built, given its initial weights or restored from the
//! checkpoint `--resume` resolves to (before the ranks meet: a bad file fails on every rank
//! alike), and built again when the ranks, once met, find they resolved the run's `latest`
//! to different checkpoints (one was being written while they started).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ddp_comm::{EnvConfig, ProcessGroup};
use ddp_model::checkpoint;
use ddp_model::norm::BatchNormLayers;
use ddp_model::weights::{self, LoadReport, Strictness, WeightsError};
use tch::{nn, Device};

use super::freeze;
use super::run_dir::resume_after_restart;
use super::startup::trainable;
use crate::allocation::{self, Allocation, EpochRest, Plan};
use crate::amp::{GradScaler, Precision};
use crate::error::{SettingError, TrainError};
use crate::lr_schedule::LrSchedule;
use crate::optim::Optimizer;
use crate::scheduler::ReduceLrOnPlateau;
use crate::settings::Settings;
use crate::state::{self, Best, EarlyStopState, Position};
use crate::task::Task;

/// What a rank's start needs to build its model, besides the settings.
pub(super) struct Start<'a, T: Task> {
    pub task: &'a T,
    pub env: &'a EnvConfig,
    pub device: Device,
    /// The intra-op threads.
    pub threads: usize,
    /// The training samples.
    pub train_len: usize,
    /// `checkpoint.resume` as given, before a continuation of the run set it to `latest`.
    pub given: Option<String>,
}

/// The model, on the rank's device, and where its run continues.
pub(super) struct Restored<M> {
    /// The `checkpoint.resume` it was built from (`latest` where the run continues).
    pub resume: Option<String>,
    pub vs: nn::VarStore,
    pub model: M,
    pub norms: BatchNormLayers,
    /// Rank 0's note on the initial weights, and `config.json`'s record of them.
    pub init: (Option<String>, serde_json::Value),
    pub parameters: Vec<String>,
    pub frozen: Vec<String>,
    pub optimizer: Optimizer,
    pub scheduler: Option<ReduceLrOnPlateau>,
    pub scaler: Option<GradScaler>,
    pub skipped_steps: u64,
    /// Samples of the steps attempted since the run began (see
    /// [`TrainState::scheduled_samples`]).
    pub scheduled_samples: u64,
    pub early: Option<EarlyStopState>,
    pub allocation: Allocation,
    pub plan: Plan,
    pub allocation_change: Option<serde_json::Value>,
    pub start_epoch: u64,
    pub start_position: Option<(Position, EpochRest)>,
    pub bests: BTreeMap<String, Best>,
    pub bucket_order: Option<Vec<String>>,
    /// The checkpoint file resumed, and the log's line about it.
    pub resumed_file: Option<PathBuf>,
    pub resumed_note: Option<String>,
    /// What every rank must agree on ([`state::resume_key`]).
    pub resume_key: String,
    /// Warnings for every rank's log.
    pub warnings: Vec<String>,
}

impl<T: Task> Start<'_, T> {
    /// Builds the model of `s` and restores the checkpoint its `checkpoint.resume` resolves
    /// to; `continuing` ends the log's line about it (why the run continues by itself).
    pub fn build(&self, s: &Settings, continuing: &str) -> Result<Restored<T::Model>, TrainError> {
        let resume_from = match &s.checkpoint.resume {
            Some(r) => Some(state::resolve(r, s.out.as_deref())?),
            None => None,
        };
        tch::manual_seed(s.seed as i64);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let (model, norms) = BatchNormLayers::collect(|| self.task.model(&vs.root()));
        if s.sync_batchnorm && norms.is_empty() {
            return Err(no_batchnorm_to_synchronise(&vs).into());
        }
        let (init_note, init_record) = init_weights(&vs, s, resume_from.as_deref(), |report| {
            self.task.init_unloaded(&model, report)
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
            world_size: self.env.world_size,
            batch_size: s.batch_size,
            accumulate: s.accumulate,
        };
        let steps_now = now.steps_per_epoch(self.train_len, s.max_steps_per_epoch);
        let mut plan = Plan {
            epochs: s.epochs,
            optimizer_steps: super::checkpoint::planned_steps(s, steps_now, (0, 0, 0))?,
            global_batch: Some(now.global_batch()),
        };
        let mut allocation_change = None;
        let (mut start_epoch, mut bests) = (1, BTreeMap::new());
        let mut start_position = None;
        let mut scaler = (s.precision == Precision::Fp16).then(GradScaler::default);
        let mut skipped_steps = 0;
        let mut scheduled_samples = 0;
        let mut early = s.early_stopping.patience.map(|_| EarlyStopState::default());
        let mut restored = None;
        let mut bucket_order = None;
        let mut resumed_note = None;
        let mut resume_key = String::from("none");
        let mut fallback_warnings = Vec::new();
        if let (Some(path), true) = (&resume_from, s.checkpoint.eval_only) {
            let recorded = super::checkpoint::load_evaluated(&vs, path)?;
            if let Some(recorded) = &recorded {
                let checked = super::checkpoint::check_evaluated(recorded, s, self.task);
                fallback_warnings.extend(checked?);
            }
            resume_key = state::resume_key(path, None);
            resumed_note = Some(format!("evaluating {}", path.display()));
        } else if let Some(newest) = &resume_from {
            // `latest` that cannot be loaded (a damaged file) falls back to the run's previous
            // checkpoints, newest first; every rank must end on the same one (`agree`).
            let mut candidates = vec![newest.clone()];
            if let (Some("latest"), Some(run)) = (s.checkpoint.resume.as_deref(), s.out.as_deref())
            {
                candidates.extend(state::fallbacks(run, newest));
            }
            let mut first_error = None;
            let candidates_tried = candidates.len();
            for (tried, path) in candidates.into_iter().enumerate() {
                // Loaded on the CPU first, then moved with the model to the rank's device;
                // the optimizer over the parameters that were not frozen then.
                let saved = state::read(&path);
                if let Ok(saved) = &saved {
                    // Not a damaged file: an older checkpoint of the run would not do either.
                    super::checkpoint::refuse_resume(&saved.state, s, self.train_len, &path)?;
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
                    Err(e) if !is_damage(&e) => {
                        let older = match candidates_tried - 1 - tried {
                            0 => String::new(),
                            _ => ", so the run's older checkpoints were not tried (resuming \
                                  one would set this one aside)"
                                .into(),
                        };
                        let before = fallback_warnings
                            .iter()
                            .map(|w| format!(" (after: {w})"))
                            .collect::<String>();
                        return Err(TrainError::context(
                            format!(
                                "cannot resume from {}, for a reason that is no damage of the \
                                 file{older}: make it readable and start again{before}",
                                path.display()
                            ),
                            e,
                        ));
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
        vs.set_device(self.device);
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
                self.task,
                self.train_len,
            ));
            fallback_warnings.extend(super::checkpoint::threads_warning(
                &st.config,
                self.device,
                self.threads,
                self.env.world_size,
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
            let scheduled = st.scheduled_samples(st.plan_global_batch(now.global_batch()));
            // Where the cap binds (here, or where the checkpoint trained), the schedules
            // counted steps: those are restated, not the samples.
            let binds = |a: Allocation| a.cap_binds(self.train_len, s.max_steps_per_epoch);
            let capped = binds(now) || st.allocation.is_some_and(binds);
            let (resumed, warning, scheduled) = super::checkpoint::resumed_plan(
                &st,
                rest.as_ref(),
                s,
                now,
                (steps_now, scheduled, capped),
            )?;
            plan = resumed;
            scheduled_samples = scheduled;
            fallback_warnings.extend(warning);
            // An earlier start's change inside this epoch, unless this start changes again.
            allocation_change = st.allocation_change.clone();
            if let Some(before) = st.allocation.filter(|b| *b != now) {
                let epoch = st.position.map_or(st.epoch + 1, |p| p.epoch);
                let spe = (
                    before.steps_per_epoch(self.train_len, s.max_steps_per_epoch),
                    steps_now,
                );
                fallback_warnings.push(super::checkpoint::describe_change(
                    before,
                    now,
                    (epoch, self.train_len),
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
        Ok(Restored {
            resume: s.checkpoint.resume.clone(),
            vs,
            model,
            norms,
            init: (init_note, init_record),
            parameters,
            frozen,
            optimizer,
            scheduler,
            scaler,
            skipped_steps,
            scheduled_samples,
            early,
            allocation: now,
            plan,
            allocation_change,
            start_epoch,
            start_position,
            bests,
            bucket_order,
            resumed_file,
            resumed_note,
            resume_key,
            warnings: fallback_warnings,
        })
    }

    /// Once the ranks have met: checks that every rank continues from the checkpoint of
    /// `built` (built from `s`), or fails on every rank with the same error. Ranks that each
    /// took what the run's `latest` named (none a file the user named) and found different
    /// checkpoints started while it changed: a failed attempt's rank 0 was writing one as a
    /// restarted rank read it. A new rank 0 exists only once the old one has exited, so
    /// `latest` no longer changes: every rank resolves it again, builds its model again, and
    /// the ranks check once more. Every rank takes the same collectives.
    pub fn agree(
        &self,
        pg: &ProcessGroup,
        s: &Settings,
        built: Restored<T::Model>,
    ) -> Result<Restored<T::Model>, TrainError> {
        let mine = agreement_bytes(s, &built.resume_key);
        let Some(found) = resolve_again(&pg.all_gather_bytes(&mine)?)? else {
            return Ok(built);
        };
        // The first model's memory, on the device, before the second's.
        drop(built);
        let mut again = s.clone();
        again.checkpoint.resume = self.given.clone();
        let continuing = resume_after_restart(&mut again, self.env)?;
        let mut built = self.build(&again, &continuing)?;
        state::check_resume_agreement(&pg.all_gather_bytes(built.resume_key.as_bytes())?)?;
        built.warnings.push(format!(
            "{found}: a checkpoint was being written as the ranks started; every rank read \
             `latest` again once all had"
        ));
        Ok(built)
    }
}

/// This rank's part of the agreement on the checkpoint: `L` where it is whatever the run's
/// `latest` named (or none, the run having none yet), `F` where it is a file the user named,
/// then its [`state::resume_key`].
fn agreement_bytes(s: &Settings, key: &str) -> Vec<u8> {
    let follows_latest = match s.checkpoint.resume.as_deref() {
        // `latest` (also where a continuation of the run set it), or a run directory's.
        Some(r) => r == "latest" || Path::new(r).is_dir(),
        None => s.out.is_some(),
    };
    let mut bytes = vec![if follows_latest { b'L' } else { b'F' }];
    bytes.extend_from_slice(key.as_bytes());
    bytes
}

/// From every rank's [`agreement_bytes`], in rank order: `None` where the ranks agree; where
/// they differ and every one followed `latest`, the difference (they resolve it again); else
/// the error, the same on every rank.
fn resolve_again(gathered: &[Vec<u8>]) -> Result<Option<String>, TrainError> {
    let keys: Vec<Vec<u8>> = gathered
        .iter()
        .map(|g| g.get(1..).unwrap_or_default().to_vec())
        .collect();
    let Some((first, rank, other)) = state::first_disagreement(&keys) else {
        return Ok(None);
    };
    if gathered.iter().all(|g| g.first() == Some(&b'L')) {
        return Ok(Some(format!(
            "rank 0 found {first} as the run's latest checkpoint, rank {rank} {other}"
        )));
    }
    state::check_resume_agreement(&keys).map(|()| None)
}

/// Loads `checkpoint.init_from` into the freshly built model (on the CPU, before the process
/// group exists: a bad file fails on every rank alike), unless the run resumes from
/// `resume_from`, which takes precedence, then hands what was loaded to `init_unloaded`
/// ([`Task::init_unloaded`]). Returns rank 0's log line and `config.json`'s record of what
/// was loaded and what the task drew anew.
fn init_weights(
    vs: &nn::VarStore,
    s: &Settings,
    resume_from: Option<&Path>,
    init_unloaded: impl FnOnce(&LoadReport) -> Vec<String>,
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
        // Another model's file: the model to build, not a partial load of a few tensors.
        WeightsError::Mismatch {
            file_holds: Some(kind),
            ..
        } => TrainError::Invalid(format!(
            "{e}: build that model to start from its weights (ddp-train's --model {})",
            kind.name()
        )),
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
            _ => match (report.mismatched.first(), report.kind_mismatched.first()) {
                (Some(m), _) => format!(
                    "e.g. '{}' is {:?} in the file and {:?} in the model",
                    m.name, m.found, m.expected
                ),
                (None, Some(m)) => format!(
                    "e.g. '{}' is {:?} in the file and {:?} in the model",
                    m.name, m.found, m.expected
                ),
                (None, None) => "the file holds no tensor".to_string(),
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
    let reinitialised = init_unloaded(&report);
    let mut note = format!("initial weights from {}: {report}", file.display());
    if !reinitialised.is_empty() {
        note.push_str(&format!(
            "; initialised anew by the task: {}",
            reinitialised.join(", ")
        ));
    }
    let mismatched: Vec<_> = report
        .mismatched
        .iter()
        .map(|m| serde_json::json!({ "name": m.name, "model": m.expected, "file": m.found }))
        .collect();
    let kind_mismatched: Vec<_> = report
        .kind_mismatched
        .iter()
        .map(|m| {
            let (model, file) = (format!("{:?}", m.expected), format!("{:?}", m.found));
            serde_json::json!({ "name": m.name, "model": model, "file": file })
        })
        .collect();
    let record = serde_json::json!({
        "file": file.to_string_lossy(),
        "loaded": true,
        "partial": s.checkpoint.init_partial,
        "entry": report.entry,
        "tensors_loaded": report.loaded.len(),
        "stripped_prefix": report.stripped_prefix,
        "missing": report.missing,
        "unexpected": report.unexpected,
        "mismatched": mismatched,
        "kind_mismatched": kind_mismatched,
        "reinitialised": reinitialised,
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

/// Whether `e`, met reading a checkpoint to resume, shows the file damaged (cut short,
/// corrupt, half of it missing, unreadable from the disk), which the run's previous
/// checkpoint gets past. An I/O failure of another kind (no permission, a stale NFS handle,
/// too many open files) says nothing of the file: falling back would set an intact
/// checkpoint aside and retrain it.
fn is_damage(e: &TrainError) -> bool {
    use std::io::ErrorKind;
    let source = match e {
        TrainError::Checkpoint(checkpoint::CheckpointError::Io { source, .. })
        | TrainError::Io { source, .. } => source,
        _ => return true,
    };
    // EIO: a read failed on the medium; EUCLEAN and EBADMSG: ext4's and XFS's corruption.
    source.kind() == ErrorKind::NotFound
        || [libc::EIO, libc::EUCLEAN, libc::EBADMSG]
            .into_iter()
            .any(|code| source.raw_os_error() == Some(code))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(out: Option<&Path>, resume: Option<&str>) -> Settings {
        let mut s = Settings {
            out: out.map(Path::to_path_buf),
            ..Default::default()
        };
        s.checkpoint.resume = resume.map(str::to_string);
        s
    }

    const FIRST: &str = "epoch-0001.safetensors (epoch 1, step 0, 6 optimizer steps, lr 1e-3)";
    const SECOND: &str = "epoch-0002.safetensors (epoch 2, step 0, 12 optimizer steps, lr 1e-3)";

    #[test]
    fn a_checkpoint_follows_latest_unless_the_user_named_its_file() {
        let dir = ddp_testkit::temp_dir("restore-follows");
        let run = dir.path().join("run");
        std::fs::create_dir(&run).unwrap();
        let file = run.join("epoch-0001.safetensors");
        let cases = [
            (settings(Some(&run), Some("latest")), b'L'),
            // A run directory resumes what its `latest` names.
            (settings(None, run.to_str()), b'L'),
            // Starting over in a run directory without checkpoints (yet).
            (settings(Some(&run), None), b'L'),
            (settings(Some(&run), file.to_str()), b'F'),
            (settings(None, None), b'F'),
        ];
        for (s, expected) in cases {
            let bytes = agreement_bytes(&s, FIRST);
            assert_eq!(bytes[0], expected, "{:?}", s.checkpoint.resume);
            assert_eq!(&bytes[1..], FIRST.as_bytes());
        }
    }

    fn gathered(parts: &[(u8, &str)]) -> Vec<Vec<u8>> {
        parts
            .iter()
            .map(|(flag, key)| [&[*flag], key.as_bytes()].concat())
            .collect()
    }

    #[test]
    fn ranks_that_followed_latest_to_different_checkpoints_resolve_it_again() {
        // Agreement, whatever the ranks followed: nothing to do.
        let same = gathered(&[(b'L', FIRST), (b'F', FIRST), (b'L', FIRST)]);
        assert_eq!(resolve_again(&same).unwrap(), None);
        let found = resolve_again(&gathered(&[(b'L', SECOND), (b'L', FIRST), (b'L', SECOND)]));
        assert_eq!(
            found.unwrap().as_deref(),
            Some(format!(
                "rank 0 found {SECOND} as the run's latest checkpoint, rank 1 {FIRST}"
            ))
            .as_deref()
        );
        // Before the run's first checkpoint, on one rank.
        let found = resolve_again(&gathered(&[(b'L', FIRST), (b'L', "none")]));
        assert_eq!(
            found.unwrap().as_deref(),
            Some(format!(
                "rank 0 found {FIRST} as the run's latest checkpoint, rank 1 none"
            ))
            .as_deref()
        );
    }

    #[test]
    fn ranks_that_differ_where_one_named_a_file_are_refused_alike() {
        for flags in [[b'L', b'F'], [b'F', b'L'], [b'F', b'F']] {
            let keys = gathered(&[(flags[0], SECOND), (flags[1], FIRST)]);
            let e = resolve_again(&keys).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "the ranks would resume from different checkpoints: rank 0 from {SECOND}, \
                     rank 1 from {FIRST}; give every rank the same --resume (and --out), on a \
                     folder every rank sees the same"
                )
            );
        }
    }
}
