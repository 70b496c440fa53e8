//! The run directory at start-up: whether a start continues the run already in `--out`
//! (a launcher's restart, a stopped run, the same job started again) or would write over it,
//! and the lock that keeps a second job out.

use std::path::{Path, PathBuf};

use ddp_comm::{EnvConfig, ProcessGroup};

use super::best_files;
use super::outputs::{open_regular, RankLog};
use crate::error::TrainError;
use crate::settings::{Monitor, Settings};
use crate::state::{self, Best};

/// The key of `config.json` that records the job's run id ([`EnvConfig::run_id`]).
pub(super) const RUN_ID_KEY: &str = "run_id";

/// Why a start continues the run in `out`.
enum Continuation {
    /// The run was stopped (by a signal or its time limit), and so goes on when started again.
    Stopped,
    /// A launcher restarted the rank (`TORCHELASTIC_RESTART_COUNT` above 0) of the job whose
    /// run it is: its run id is the one `config.json` records, or it has none (torchrun's
    /// `none`) to tell.
    Restarted,
    /// The same job started it: its run id, which a restart, a requeue and torchrun's
    /// membership changes keep, is the one `config.json` records (torchrun counts no restart
    /// for a node joining or leaving).
    SameJob,
}

/// Whether, and why, this start continues the run in `out`.
/// A restart of a job that names itself continues only that job's run: a launcher restarts
/// the ranks a refusal ended too, and another job's run, continued or started over under
/// this job's settings, would be written over.
fn continuation(out: &Path, env: &EnvConfig) -> Option<Continuation> {
    let same_job = || recorded_run_id(out).as_deref() == Some(env.run_id.as_str());
    if state::was_stopped(out) {
        Some(Continuation::Stopped)
    } else if env.restart_count > 0 && (!env.names_a_job() || same_job()) {
        Some(Continuation::Restarted)
    } else if env.names_a_job() && same_job() {
        Some(Continuation::SameJob)
    } else {
        None
    }
}

/// The run id `out/config.json` records, if any.
fn recorded_run_id(out: &Path) -> Option<String> {
    let text = std::fs::read_to_string(out.join("config.json")).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json.get(RUN_ID_KEY)?.as_str().map(str::to_string)
}

/// A run that continues resumes from the latest checkpoint of its `out` by itself (with
/// `resume_after_restart`, the default), even where `resume` names another file (where the
/// run began): a restarted, requeued or re-formed job goes on from where it got to. Before
/// the first checkpoint the run starts over. Returns a note for the log ("" when the run
/// does not continue by itself).
///
/// A start that does not continue the run in `out` (another job, or resuming by itself is
/// off) is refused when `out` holds checkpoints, unless it resumes one of them (`latest`, or
/// a rewind): starting over, or from another run's checkpoint, would write over the run's
/// metrics, best models and checkpoints. So is one in an `out` that holds a run's metrics or
/// best models without its checkpoints.
pub(super) fn resume_after_restart(
    settings: &mut Settings,
    env: &EnvConfig,
) -> Result<String, TrainError> {
    let Some(out) = &settings.out else {
        return Ok(String::new());
    };
    if settings.checkpoint.eval_only && settings.checkpoint.resume.is_some() {
        // Evaluates the file it names, whatever the run directory holds.
        return Ok(String::new());
    }
    let latest = state::checkpoint_dir(out).join("latest");
    match std::fs::metadata(&latest) {
        Ok(meta) if meta.is_file() => {}
        // Not a file: starting over would fail at the first checkpoint, an epoch later.
        Ok(_) => {
            return Err(TrainError::Invalid(format!(
                "{} is not a file: it should hold the name of the run's latest checkpoint; \
                 remove it, or give another --out",
                latest.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return without_checkpoints(settings, out, &latest, env)
        }
        Err(e) => {
            return Err(TrainError::io(
                format!("cannot read {}", latest.display()),
                e,
            ))
        }
    }
    let auto = settings.checkpoint.resume_after_restart;
    let continuing = auto.then(|| continuation(out, env)).flatten();
    let note = match (&settings.checkpoint.resume, continuing) {
        (Some(given), Some(_)) if given != "latest" => {
            format!(", continuing the run from its latest checkpoint (it began from {given})")
        }
        (Some(given), None) if !resumes_the_run(out, given) => {
            return Err(held_checkpoints(out, &latest, auto, env, Some(given)))
        }
        (Some(_), _) => return Ok(String::new()),
        (None, Some(Continuation::Stopped)) => ", continuing the stopped run".to_string(),
        (None, Some(Continuation::Restarted)) => ", after the launcher's restart".to_string(),
        (None, Some(Continuation::SameJob)) => format!(", continuing job {}", env.run_id),
        (None, None) => return Err(held_checkpoints(out, &latest, auto, env, None)),
    };
    settings.checkpoint.resume = Some("latest".to_string());
    Ok(note)
}

/// Whether `given` (a `--resume`) names one of the checkpoints of the run in `out`: `latest`,
/// the run directory, or a file of its `checkpoints/`. One that does not resolve is left to
/// the start's own resolving, which names what is wrong with it.
fn resumes_the_run(out: &Path, given: &str) -> bool {
    given == "latest" || state::resolve(given, Some(out)).map_or(true, |f| of_the_run(out, &f))
}

/// A start in `out` while `latest` is not there (before the run's first checkpoint, or its
/// checkpoints were deleted to save space): starts over, unless `out` holds a run's results
/// (its metrics, a best model) and the start neither continues that run nor resumes one of
/// its checkpoints, which would write over them.
fn without_checkpoints(
    settings: &Settings,
    out: &Path,
    latest: &Path,
    env: &EnvConfig,
) -> Result<String, TrainError> {
    let auto = settings.checkpoint.resume_after_restart;
    let resumed = settings.checkpoint.resume.as_deref();
    if settings.checkpoint.eval_only
        || resumed.is_some_and(|r| resumes_the_run(out, r))
        || (auto && continuation(out, env).is_some())
    {
        return Ok(String::new());
    }
    // A start's history is empty until its first epoch ends.
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl"))
        .is_ok_and(|text| !text.trim().is_empty());
    let models = settings.monitors.iter().map(|m| m.file.as_str());
    let results: Vec<&str> = (metrics.then_some("metrics.jsonl").into_iter())
        .chain(models.filter(|f| out.join(f).is_file()))
        .collect();
    if results.is_empty() {
        return Ok(String::new());
    }
    let holds = format!("its {}, without {}", results.join(", "), latest.display());
    Err(held_run(
        out,
        &holds,
        "",
        auto,
        env,
        resumed,
        "move those files away",
    ))
}

/// The refusal of a start that would write over the run in `out` (whose `latest` file is
/// `latest`): one that does not continue it, starting over or from `resumed`, a file of no
/// checkpoint of the run.
fn held_checkpoints(
    out: &Path,
    latest: &Path,
    auto: bool,
    env: &EnvConfig,
    resumed: Option<&str>,
) -> TrainError {
    let names = std::fs::read_to_string(latest).unwrap_or_default();
    let holds = format!(
        "its {} names {}",
        latest.display(),
        names.trim().escape_debug()
    );
    let continue_it = "continue it with --resume latest, or ";
    held_run(
        out,
        &holds,
        continue_it,
        auto,
        env,
        resumed,
        "remove that folder",
    )
}

/// The refusal of a start that does not continue the run in `out`, which `holds` what it
/// names, starting over or from `resumed`, a file of no checkpoint of the run.
fn held_run(
    out: &Path,
    holds: &str,
    continue_it: &str,
    auto: bool,
    env: &EnvConfig,
    resumed: Option<&str>,
    remove: &str,
) -> TrainError {
    let off = if auto {
        ""
    } else {
        " (resuming by itself after a restart is off)"
    };
    let other = resumed.map_or_else(String::new, |f| {
        format!(", and --resume {f} is not one of its checkpoints")
    });
    // A launcher that restarts ranks without telling them (a Kubeflow pod restarted
    // after a crash) leaves them no way to know their run but the job's id.
    let no_id = if env.names_a_job() {
        ""
    } else {
        "; ranks restarted without TORCHELASTIC_RESTART_COUNT (a Kubeflow pod) \
         continue it when every start has the same DDP_RUN_ID"
    };
    TrainError::Invalid(format!(
        "--out {} already holds a run{off} ({holds}){other}: {continue_it}give another --out \
         (or {remove}) to start a new run{no_id}",
        out.display(),
    ))
}

/// The file whose lock marks a run directory in use.
const RUN_LOCK: &str = ".lock";

/// The run directory's lock, as rank 0 found it.
#[derive(Debug)]
pub(super) enum RunLock {
    /// This process holds it: the file, whose lock the kernel lets go when the process
    /// ends, however it ends.
    Held(std::fs::File),
    /// Another process holds it, or the lock file cannot be opened: the refusal, naming
    /// that process or the error.
    Locked(String),
    /// The file system takes no locks (Lustre mounted `noflock`: `ENOSYS`; NFSv3 without
    /// `statd`: `ENOLCK`), or gave no answer within [`LOCK_ANSWER`]: nothing keeps a second
    /// job out. The warning for the log.
    Unsupported(String),
}

/// How long rank 0 waits for the file system's answer to its `flock` of the run directory,
/// at most (half the collective timeout when that is shorter, see [`lock_answer`]): on a
/// `hard` NFS mount whose lock manager (NLM) does not answer, `flock` blocks in the kernel,
/// `LOCK_NB` or not (cargo#2615), while the other ranks wait for rank 0's verdict until
/// their collective timeout, and would then blame it.
const LOCK_ANSWER: std::time::Duration = std::time::Duration::from_secs(10);

/// The wait for the lock manager's answer under a collective timeout of `op_timeout`:
/// [`LOCK_ANSWER`], or half the timeout when that is shorter, so that the other ranks get
/// rank 0's verdict before they give up on it.
fn lock_answer(op_timeout: std::time::Duration) -> std::time::Duration {
    LOCK_ANSWER.min(op_timeout / 2)
}

include!("../../../shared-src/answer_within.rs");

/// An exclusive `flock` of `file`, without waiting for a holder.
fn flock_exclusive(file: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if let Some(injected) = super::faults::flock_error() {
        return Err(injected);
    }
    super::faults::hang_if_flock_hangs();
    // SAFETY: flock on a descriptor `file` owns; no memory is involved.
    match unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// The name of this host, as the lock file records its holder's.
fn this_host() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    host.trim().to_string()
}

/// Takes the run directory's lock (an exclusive `flock` on `out/.lock`), waiting at most
/// `wait` for the file system's answer, and writes who holds it.
fn lock_run_dir(out: &Path, wait: std::time::Duration) -> RunLock {
    use std::fs::OpenOptions;
    use std::io::{Read, Seek, Write};
    let path = out.join(RUN_LOCK);
    // A regular file, never a link's target: the holder's line below empties it first.
    let mut read_write = OpenOptions::new();
    read_write
        .read(true)
        .write(true)
        .create(true)
        .truncate(false);
    let opened = open_regular(&path, &mut read_write)
        // flock takes a descriptor opened for reading too (a .lock another user made).
        .or_else(|_| open_regular(&path, OpenOptions::new().read(true)));
    let mut file = match opened {
        Ok(file) => file,
        // Unlocked, the start would tidy a folder another job may be writing: refused.
        Err(e) => {
            return RunLock::Locked(format!(
                "cannot open {} to lock the run directory --out {} ({e}): check the folder's \
                 permissions, or give another --out",
                path.display(),
                out.display()
            ))
        }
    };
    let Some(locked) = answer_within(&file, wait, flock_exclusive) else {
        return RunLock::Unsupported(format!(
            "no answer from the file system's lock manager within {} s for {}; the run \
             directory {} is not locked against a second job, so start only one on this --out",
            wait.as_secs_f64(),
            path.display(),
            out.display()
        ));
    };
    match locked {
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            RunLock::Locked(in_use(out, &path, holder.trim()))
        }
        Err(e) => RunLock::Unsupported(format!(
            "the run directory {} cannot be locked on this file system ({}: {e}): nothing \
             refuses a second job on the same --out, so start only one",
            out.display(),
            path.display()
        )),
        Ok(()) => {
            let holder = format!("pid {} on {}", std::process::id(), this_host());
            let _ = file.set_len(0);
            let _ = file.rewind();
            let _ = file.write_all(holder.as_bytes());
            RunLock::Held(file)
        }
    }
}

/// The refusal of a start whose run directory `out` another job holds (its lock file `lock`
/// records `holder`, `pid <n> on <host>`). A holder on another host may be gone: a crashed
/// node's lock on a network file system can outlive it (NFSv3's until that node restarts,
/// NFSv4's for its lease).
fn in_use(out: &Path, lock: &Path, holder: &str) -> String {
    let host = holder.split_once(" on ").map(|(_, host)| host.trim());
    let elsewhere = match host {
        Some(host) if !host.is_empty() && host != this_host() => format!(
            "; if that host is down, its lock can outlive it on a network file system: \
             remove {}",
            lock.display()
        ),
        _ => String::new(),
    };
    format!(
        "--out {} is in use by another job ({holder}, which holds {}): give another --out, \
         or wait for that job to end{elsewhere}",
        out.display(),
        lock.display()
    )
}

/// One job per run directory: rank 0 locks `out`, and every rank learns the verdict (the
/// refusal, on every rank alike, where another job holds it). Returns rank 0's lock, if it
/// holds one, and on rank 0 a warning for the log where the file system takes no lock, gives
/// no answer, or takes locks that only this node sees.
pub(super) fn claim_run_dir(
    pg: &ProcessGroup,
    out: &Path,
) -> Result<(Option<std::fs::File>, Option<String>), TrainError> {
    let lock = (pg.rank() == 0).then(|| lock_run_dir(out, lock_answer(pg.op_timeout())));
    let (lock, warning, refusal) = match lock {
        Some(RunLock::Held(file)) => {
            let local = super::mounts::node_local_locks(out).map(|mount| {
                format!(
                    "the run directory {} is on {mount}, whose locks only this node sees: a \
                     second job on the same --out whose rank 0 runs on another node is not \
                     refused, so start only one",
                    out.display()
                )
            });
            (Some(file), local, String::new())
        }
        Some(RunLock::Locked(refusal)) => (None, None, refusal),
        Some(RunLock::Unsupported(warning)) => (None, Some(warning), String::new()),
        None => (None, None, String::new()),
    };
    let verdicts = pg.all_gather_bytes(refusal.as_bytes())?;
    if !verdicts[0].is_empty() {
        return Err(TrainError::Invalid(
            String::from_utf8_lossy(&verdicts[0]).into_owned(),
        ));
    }
    Ok((lock, warning))
}

/// Rank 0's care of the run directory at a start, with the directory claimed (locked, or on
/// a file system without locks): where the run resumed one of its own older checkpoints
/// (`resumed`), the rewind ([`set_aside_later`]) and the best models of the history it
/// continues ([`align_best_models`]), setting aside into the start's `aside`; then the
/// temporaries of writes a crash cut short.
pub(super) fn prepare_run_dir(
    out: &Path,
    resumed: Option<&Path>,
    monitors: &[Monitor],
    bests: &std::collections::BTreeMap<String, Best>,
    aside: &AsideDir,
    log: &RankLog,
) -> Result<(), TrainError> {
    if let Some(file) = resumed {
        // An older checkpoint of this run resumed into it: the history after it is left.
        if let Some((to, stems)) = set_aside_later(out, file, aside)? {
            log.say(&format!(
                "resuming from {} rewinds the run: its {} later checkpoint(s) ({}) are moved \
                 to {}",
                file.display(),
                stems.len(),
                stems.join(", "),
                to.display()
            ));
        }
        for note in align_best_models(out, file, monitors, bests, aside)? {
            log.warn(&note);
        }
    }
    for file in remove_stale_temporaries(out) {
        log.say(&format!(
            "removed {}, left by a write a crash cut short",
            file.display()
        ));
    }
    Ok(())
}

/// Removes what writes cut short by a crash left in the run folder and its checkpoint
/// folder: the temporaries of `write_atomic` (`.<name>.tmp-<pid>-<start>`, or `-<pid>` as
/// older versions named them) of other processes, as large as a checkpoint each; a process
/// with this one's id is another when it started at another time. Only for rank 0, which
/// claimed the run directory ([`claim_run_dir`]). Returns the files removed.
fn remove_stale_temporaries(out: &Path) -> Vec<PathBuf> {
    let own = ddp_model::checkpoint::temporary_tag();
    let digits = |s: &str, hex: bool| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (hex && b.is_ascii_hexdigit()))
    };
    let stale = |name: &str| {
        name.starts_with('.')
            && name.rsplit_once(".tmp-").is_some_and(|(stem, tag)| {
                let (pid, start) = tag.split_once('-').unwrap_or((tag, "0"));
                stem.len() > 1 && tag != own && digits(pid, false) && digits(start, true)
            })
    };
    let mut removed = Vec::new();
    for dir in [out.to_path_buf(), state::checkpoint_dir(out)] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let is_file = entry.file_type().is_ok_and(|t| t.is_file());
            if is_file
                && entry.file_name().to_str().is_some_and(stale)
                && std::fs::remove_file(&path).is_ok()
            {
                removed.push(path);
            }
        }
    }
    removed.sort();
    removed
}

/// A rewind: moves the checkpoints of `run` that come after `resumed` (one of its own, by
/// epoch, then step) into the start's folder `aside`, and points `latest` at `resumed`,
/// so that pruning and the fallbacks follow the new history, not the one left. Returns the
/// folder and the stems moved (none when `resumed` is not in the run or is its newest).
fn set_aside_later(
    run: &Path,
    resumed: &Path,
    aside: &AsideDir,
) -> Result<Option<(PathBuf, Vec<String>)>, TrainError> {
    let dir = state::checkpoint_dir(run);
    let stem_at = resumed
        .file_name()
        .and_then(|n| n.to_str()?.strip_suffix(".safetensors"));
    let Some(stem) = stem_at else {
        return Ok(None);
    };
    let Some(at) = state::order_of(stem).filter(|_| of_the_run(run, resumed)) else {
        return Ok(None);
    };
    let later: Vec<String> = state::fallbacks(run, resumed)
        .iter()
        .filter_map(|p| {
            let s = p.file_name()?.to_str()?.strip_suffix(".safetensors")?;
            (state::order_of(s)? > at).then(|| s.to_owned())
        })
        .collect();
    if later.is_empty() {
        return Ok(None);
    }
    let aside = aside.get()?;
    move_aside(&dir, stem, &later, aside)?;
    Ok(Some((aside.to_path_buf(), later)))
}

/// Whether `resumed` is in `run`'s checkpoint folder (a checkpoint of the run itself, not of
/// another run resumed into it).
fn of_the_run(run: &Path, resumed: &Path) -> bool {
    let dir = state::checkpoint_dir(run).canonicalize().ok();
    resumed
        .parent()
        .and_then(|parent| parent.canonicalize().ok())
        .is_some_and(|parent| Some(parent) == dir)
}

/// The folder where one start sets aside what a rewind leaves (the later checkpoints, the
/// best models replaced, the metrics of epochs trained again), so that they go together:
/// `checkpoints/abandoned-<time>-<pid>/`, made on first use under a name no earlier start
/// took (`-2`, `-3`, ... added where one did), so that a second rewind in one process (a
/// library user's second `Trainer::new`) replaces nothing the first set aside.
#[derive(Debug)]
pub(super) struct AsideDir {
    checkpoints: PathBuf,
    /// `abandoned-<time>-<pid>`, before any suffix.
    name: String,
    made: std::cell::OnceCell<PathBuf>,
}

impl AsideDir {
    /// The folder of a start now in `run`, not made until something goes into it.
    pub(super) fn new(run: &Path) -> Self {
        let stamp = ddp_run::default_run_dir(Path::new(""));
        Self {
            checkpoints: state::checkpoint_dir(run),
            name: format!("abandoned-{}", stamp.display()),
            made: std::cell::OnceCell::new(),
        }
    }

    /// The folder, made by the first call.
    pub(super) fn get(&self) -> Result<&Path, TrainError> {
        if let Some(made) = self.made.get() {
            return Ok(made);
        }
        let io = |what: &Path, e| TrainError::io(format!("cannot create {}", what.display()), e);
        std::fs::create_dir_all(&self.checkpoints).map_err(|e| io(&self.checkpoints, e))?;
        let mut path = self.checkpoints.join(&self.name);
        for n in 2u64.. {
            match std::fs::create_dir(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(&path, e)),
                Ok(()) => break,
            }
            path = self.checkpoints.join(format!("{}-{n}", self.name));
        }
        ddp_model::checkpoint::sync_entries(&self.checkpoints).map_err(|e| io(&path, e))?;
        Ok(self.made.get_or_init(|| path))
    }
}

/// Points `dir/latest` at `stem`, then moves the checkpoints `later` of `dir` into the
/// folder `aside`, which is there. `latest` goes first, so that it names a checkpoint that
/// is there at every instant: a crash between the moves leaves it naming the resumed one,
/// and the next start, resuming it again, moves the rest (a checkpoint's state goes before its model, which is what the
/// next start looks for).
fn move_aside(dir: &Path, stem: &str, later: &[String], aside: &Path) -> Result<(), TrainError> {
    let io = |what: &Path, e| TrainError::io(format!("cannot set aside {}", what.display()), e);
    let latest = dir.join("latest");
    ddp_model::checkpoint::write_atomic(&latest, format!("{stem}\n").as_bytes())
        .map_err(|e| io(&latest, e))?;
    for s in later {
        // The state first: a model file left alone is still found (and moved) next time.
        for file in [format!("{s}.state.safetensors"), format!("{s}.safetensors")] {
            match std::fs::rename(dir.join(&file), aside.join(&file)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io(&dir.join(file), e))
                }
                _ => {}
            }
        }
    }
    // The moves are durable once both folders' entries are.
    ddp_model::checkpoint::sync_entries(dir)
        .and_then(|()| ddp_model::checkpoint::sync_entries(aside))
        .map_err(|e| io(aside, e))
}

/// Makes each monitor's best-model file (`<run>/<file>`) the model of the best that the
/// resumed state records for it, where the run resumed one of its own checkpoints
/// (`resumed`): another run's checkpoint records that run's bests, and leaves the files be. A rewind, or a crash between a best model's save and its
/// epoch's checkpoint, leaves a file of an epoch the run no longer has (the file records its
/// epoch in its metadata, as the epoch's checkpoint does): it is restored from the checkpoint
/// of the recorded best's epoch (epoch-end checkpoints are never pruned), or moved into the
/// start's folder `aside` where there is none. Either way the file and the document beside
/// it (`<file>.json`, thresholds tuned for it; first) go into that folder before anything
/// replaces them. The file of the recorded best without its document gets it back from that
/// epoch's copy. Only for rank 0, which claimed the run directory. Returns a line for the log
/// per file changed.
fn align_best_models(
    run: &Path,
    resumed: &Path,
    monitors: &[Monitor],
    bests: &std::collections::BTreeMap<String, Best>,
    aside: &AsideDir,
) -> Result<Vec<String>, TrainError> {
    if !of_the_run(run, resumed) {
        return Ok(Vec::new());
    }
    let dir = state::checkpoint_dir(run);
    let io = |what: &Path, e| TrainError::io(format!("cannot replace {}", what.display()), e);
    let mut notes = Vec::new();
    for file in monitors.iter().map(|m| &m.file) {
        let model = run.join(file);
        let best = bests.get(file).map(|b| b.epoch);
        let source = best
            .map(|epoch| dir.join(format!("{}.safetensors", state::stem(epoch))))
            .filter(|p| p.is_file());
        let doc = model.with_extension("json");
        if !model.is_file() {
            // A start cut short between setting the file aside and restoring it.
            if let (Some(epoch), Some(source)) = (best, &source) {
                let with = best_files::restore(run, file, epoch, source, &doc)?;
                notes.push(format!(
                    "{} is missing, and the run's best for it is epoch {epoch}'s: restored \
                     from {} ({with})",
                    model.display(),
                    source.display()
                ));
            }
            continue;
        }
        let recorded = ddp_model::checkpoint::read_tensors(&model)
            .ok()
            .and_then(|f| f.metadata.get("epoch")?.parse::<u64>().ok());
        if let (Some(epoch), true) = (best, recorded == best) {
            // A crash in the save of a best model (after its old document went, before the
            // new one came) leaves the model of the run's best without the thresholds tuned
            // for it: they come back from that epoch's copy.
            let restored = if doc.exists() {
                None
            } else {
                best_files::restore_document(run, file, epoch, &doc)?
            };
            if let Some(copy) = restored {
                notes.push(format!(
                    "{} had no thresholds beside it: restored epoch {epoch}'s from {}",
                    model.display(),
                    copy.display()
                ));
            }
            continue;
        }
        let was = recorded.map_or_else(
            || format!("{} records no epoch", model.display()),
            |e| format!("{} is the model of epoch {e}", model.display()),
        );
        // The file and its document (thresholds tuned for it) go aside first, whatever
        // replaces them.
        let aside = aside.get()?;
        for f in [&doc, &model] {
            match f
                .file_name()
                .map(|name| std::fs::rename(f, aside.join(name)))
            {
                Some(Err(e)) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(f, e)),
                _ => {}
            }
        }
        ddp_model::checkpoint::sync_entries(run)
            .and_then(|()| ddp_model::checkpoint::sync_entries(aside))
            .map_err(|e| io(aside, e))?;
        if let (Some(epoch), Some(source)) = (best, source) {
            let with = best_files::restore(run, file, epoch, &source, &doc)?;
            notes.push(format!(
                "{was}, and the run's best for it is epoch {epoch}'s: restored from {} \
                 ({with}); the file and its thresholds are moved to {}",
                source.display(),
                aside.display()
            ));
        } else {
            let recorded_best = best.map_or_else(
                || "records no best for it".to_string(),
                |epoch| format!("records epoch {epoch}, whose checkpoint is gone"),
            );
            notes.push(format!(
                "{was}, and the run's state {recorded_best}: moved to {}",
                aside.display()
            ));
        }
    }
    Ok(notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(dir: &Path, name: &str) {
        std::fs::write(dir.join(name), b"x").unwrap();
    }

    /// Rank 0 gives up on the lock manager in time for the others' collective timeout.
    #[test]
    fn the_wait_for_the_lock_manager_is_within_half_the_collective_timeout() {
        use std::time::Duration;
        assert_eq!(lock_answer(Duration::from_secs(1800)), LOCK_ANSWER);
        assert_eq!(lock_answer(Duration::from_secs(20)), LOCK_ANSWER);
        assert_eq!(lock_answer(Duration::from_secs(4)), Duration::from_secs(2));
        assert_eq!(
            lock_answer(Duration::from_secs(1)),
            Duration::from_millis(500)
        );
        assert_eq!(
            format!("{}", lock_answer(Duration::from_secs(1)).as_secs_f64()),
            "0.5"
        );
        assert_eq!(format!("{}", LOCK_ANSWER.as_secs_f64()), "10");
    }

    /// A lock file that cannot be opened refuses the start (unlocked, it would tidy a folder
    /// another job may be writing); a folder that can be locked is held, and locked again
    /// by another open, refused naming its holder.
    #[test]
    fn a_lock_file_that_cannot_be_opened_refuses_the_start() {
        let tmp = ddp_testkit::temp_dir("ddp-train-lock-open");
        let out = tmp.path();
        let missing = out.join("gone");
        match lock_run_dir(&missing, LOCK_ANSWER) {
            RunLock::Locked(refusal) => assert!(
                refusal.starts_with(&format!(
                    "cannot open {} to lock the run directory --out {} (",
                    missing.join(RUN_LOCK).display(),
                    missing.display()
                )) && refusal.ends_with("): check the folder's permissions, or give another --out"),
                "{refusal}"
            ),
            other => panic!("{other:?}"),
        }
        let held = lock_run_dir(out, LOCK_ANSWER);
        assert!(matches!(held, RunLock::Held(_)), "{held:?}");
        match lock_run_dir(out, LOCK_ANSWER) {
            RunLock::Locked(refusal) => {
                assert!(refusal.contains("in use by another job (pid "), "{refusal}")
            }
            other => panic!("{other:?}"),
        }
    }

    /// A holder on another host may have crashed with its lock still held by the file
    /// server: the refusal says how to let it go; a holder on this host gets no such hint.
    #[test]
    fn a_refusal_naming_a_holder_on_another_host_says_how_to_let_its_lock_go() {
        let tmp = ddp_testkit::temp_dir("ddp-train-lock-host");
        let out = tmp.path();
        let lock = out.join(RUN_LOCK);
        let _held = match lock_run_dir(out, LOCK_ANSWER) {
            RunLock::Held(file) => file,
            other => panic!("{other:?}"),
        };
        let refusal = || match lock_run_dir(out, LOCK_ANSWER) {
            RunLock::Locked(refusal) => refusal,
            other => panic!("{other:?}"),
        };
        let here = format!("pid {} on {}", std::process::id(), this_host());
        assert_eq!(
            refusal(),
            format!(
                "--out {} is in use by another job ({here}, which holds {}): give another \
                 --out, or wait for that job to end",
                out.display(),
                lock.display()
            )
        );
        // The holder's line, as a job on node-b wrote it (the lock stays this test's).
        std::fs::write(&lock, "pid 4242 on node-b").unwrap();
        assert_eq!(
            refusal(),
            format!(
                "--out {0} is in use by another job (pid 4242 on node-b, which holds {1}): give \
                 another --out, or wait for that job to end; if that host is down, its lock \
                 can outlive it on a network file system: remove {1}",
                out.display(),
                lock.display()
            )
        );
    }

    /// A `.lock` that is a link (to a file, or to nothing) or a FIFO is refused, naming it:
    /// the holder's line would otherwise empty the link's target.
    #[test]
    fn a_lock_file_that_is_not_a_regular_file_is_refused_and_its_target_kept() {
        let tmp = ddp_testkit::temp_dir("ddp-train-lock-link");
        let out = tmp.path();
        let lock = out.join(RUN_LOCK);
        let refused = |what: &str| match lock_run_dir(out, LOCK_ANSWER) {
            RunLock::Locked(refusal) => assert_eq!(
                refusal,
                format!(
                    "cannot open {} to lock the run directory --out {} (it is {what}, not a \
                     regular file: remove it): check the folder's permissions, or give another \
                     --out",
                    lock.display(),
                    out.display()
                )
            ),
            other => panic!("{other:?}"),
        };
        let victim = out.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, &lock).unwrap();
        refused("a symbolic link");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        std::fs::remove_file(&lock).unwrap();
        std::os::unix::fs::symlink(out.join("gone/.lock"), &lock).unwrap();
        refused("a symbolic link");
        std::fs::remove_file(&lock).unwrap();
        let fifo = std::ffi::CString::new(lock.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) reads a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        refused("a FIFO");
    }

    /// A model file of one variable `w` = `epoch`, recording `epoch` in its metadata.
    fn save(path: &Path, epoch: u64) {
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let _ = vs.root().var("w", &[1], tch::nn::Init::Const(epoch as f64));
        let meta = std::collections::HashMap::from([("epoch".into(), epoch.to_string())]);
        ddp_model::checkpoint::save(&vs, path, &meta).unwrap();
    }

    /// The epoch a model file of [`save`] records, and its `w`.
    fn epoch_of(path: &Path) -> (String, f64) {
        let file = ddp_model::checkpoint::read_tensors(path).unwrap();
        let w = f64::try_from(&file.tensors["w"]).unwrap();
        (file.metadata["epoch"].clone(), w)
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
    fn a_rewind_sets_the_later_checkpoints_aside() {
        let run = ddp_testkit::temp_dir("ddp-train-rewind");
        let dir = state::checkpoint_dir(run.path());
        std::fs::create_dir_all(&dir).unwrap();
        for stem in [
            "epoch-0001",
            "epoch-0002-step-000060",
            "epoch-0002",
            "epoch-0003-step-000020",
        ] {
            touch(&dir, &format!("{stem}.safetensors"));
            touch(&dir, &format!("{stem}.state.safetensors"));
        }
        std::fs::write(dir.join("latest"), "epoch-0003-step-000020\n").unwrap();
        let resumed = dir.join("epoch-0002-step-000060.safetensors");
        let start = AsideDir::new(run.path());
        let (aside, moved) = set_aside_later(run.path(), &resumed, &start)
            .unwrap()
            .unwrap();
        assert_eq!(moved, ["epoch-0003-step-000020", "epoch-0002"]);
        assert_eq!(names(&aside).len(), 4);
        let kept = names(&dir);
        assert_eq!(kept.len(), 6, "{kept:?}");
        assert!(
            kept[0].starts_with("abandoned-") && kept[5] == "latest",
            "{kept:?}"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("latest")).unwrap(),
            "epoch-0002-step-000060\n"
        );
        assert_eq!(
            state::fallbacks(run.path(), &resumed),
            [dir.join("epoch-0001.safetensors")]
        );
        // The newest, or a file outside the run: nothing to set aside.
        assert!(set_aside_later(run.path(), &resumed, &start)
            .unwrap()
            .is_none());
        let elsewhere = run.path().join("epoch-0001.safetensors");
        touch(run.path(), "epoch-0001.safetensors");
        assert!(set_aside_later(run.path(), &elsewhere, &start)
            .unwrap()
            .is_none());
    }

    /// Two starts of one process that rewind the same run (a library user's second
    /// `Trainer::new`) set their histories aside in two folders: the second replaces none of
    /// the first's files.
    #[test]
    fn a_second_rewind_in_one_process_keeps_the_first_ones_set_aside() {
        let run = ddp_testkit::temp_dir("ddp-train-rewind-twice");
        let dir = state::checkpoint_dir(run.path());
        std::fs::create_dir_all(&dir).unwrap();
        let write = |epoch: u64, history: &str| {
            let stem = state::stem(epoch);
            for file in [
                format!("{stem}.safetensors"),
                format!("{stem}.state.safetensors"),
            ] {
                std::fs::write(dir.join(file), format!("{history} {epoch}")).unwrap();
            }
            std::fs::write(dir.join("latest"), format!("{stem}\n")).unwrap();
        };
        // A start that resumes epoch `at`: a folder of its own, and the stems it moves.
        let rewind = |at: u64| {
            let resumed = dir.join(format!("{}.safetensors", state::stem(at)));
            let start = AsideDir::new(run.path());
            set_aside_later(run.path(), &resumed, &start)
                .unwrap()
                .unwrap()
        };
        for epoch in 1..=6 {
            write(epoch, "first");
        }
        let (first, moved) = rewind(3);
        assert_eq!(moved, ["epoch-0006", "epoch-0005", "epoch-0004"]);
        // The second history trains epochs 4 and 5 again, then a second start rewinds it.
        for epoch in 4..=5 {
            write(epoch, "second");
        }
        let (second, moved) = rewind(2);
        assert_eq!(moved, ["epoch-0005", "epoch-0004", "epoch-0003"]);
        assert_ne!(first, second);
        let asides: Vec<String> = names(&dir)
            .into_iter()
            .filter(|n| n.starts_with("abandoned-"))
            .collect();
        assert_eq!(asides.len(), 2, "{asides:?}");
        for (folder, epochs, history) in [(&first, 4..=6, "first"), (&second, 4..=5, "second")] {
            for epoch in epochs {
                let file = folder.join(format!("{}.safetensors", state::stem(epoch)));
                assert_eq!(
                    std::fs::read_to_string(&file).unwrap(),
                    format!("{history} {epoch}"),
                    "{}",
                    file.display()
                );
            }
        }
        assert_eq!(
            std::fs::read_to_string(second.join("epoch-0003.safetensors")).unwrap(),
            "first 3"
        );
    }

    /// A rewind cut short (here a move that fails) leaves `latest` naming the resumed
    /// checkpoint, which is there, not one already moved; the next start moves the rest.
    #[test]
    fn a_rewind_cut_short_leaves_latest_naming_a_checkpoint_that_is_there() {
        let run = ddp_testkit::temp_dir("ddp-train-rewind-cut-short");
        let dir = state::checkpoint_dir(run.path());
        std::fs::create_dir_all(&dir).unwrap();
        for stem in ["epoch-0001", "epoch-0002", "epoch-0003"] {
            touch(&dir, &format!("{stem}.safetensors"));
            touch(&dir, &format!("{stem}.state.safetensors"));
        }
        std::fs::write(dir.join("latest"), "epoch-0003\n").unwrap();
        let later = ["epoch-0003".to_string(), "epoch-0002".to_string()];
        // The second move finds a folder that is not empty where it goes.
        let aside = dir.join("abandoned-x");
        let blocked = aside.join("epoch-0003.safetensors");
        std::fs::create_dir_all(&blocked).unwrap();
        touch(&blocked, "inside");
        let e = move_aside(&dir, "epoch-0001", &later, &aside).unwrap_err();
        assert!(
            matches!(&e, TrainError::Io { what, .. } if what.ends_with("epoch-0003.safetensors")),
            "{e:?}"
        );
        let latest = std::fs::read_to_string(dir.join("latest")).unwrap();
        assert_eq!(latest, "epoch-0001\n");
        assert!(dir.join("epoch-0001.safetensors").is_file());
        assert!(!dir.join("epoch-0003.state.safetensors").exists());
        std::fs::remove_dir_all(&blocked).unwrap();
        let resumed = dir.join("epoch-0001.safetensors");
        let (_, moved) = set_aside_later(run.path(), &resumed, &AsideDir::new(run.path()))
            .unwrap()
            .unwrap();
        assert_eq!(moved, ["epoch-0003", "epoch-0002"]);
        assert_eq!(
            names(&dir)
                .iter()
                .filter(|n| !n.starts_with("abandoned-"))
                .collect::<Vec<_>>(),
            [
                "epoch-0001.safetensors",
                "epoch-0001.state.safetensors",
                "latest"
            ]
        );
    }

    /// After a rewind each best-model file is the model of the best that the resumed state
    /// records: restored from that epoch's checkpoint, its thresholds dropped, or set aside
    /// where there is no such checkpoint; a file that is the recorded best's is kept.
    #[test]
    fn best_models_are_those_of_the_resumed_states_bests() {
        let run = ddp_testkit::temp_dir("ddp-train-best-models");
        let out = run.path();
        let dir = state::checkpoint_dir(out);
        std::fs::create_dir_all(&dir).unwrap();
        let resumed = dir.join("epoch-0008.safetensors");
        save(&resumed, 8);
        // The abandoned epoch 10 improved the score and the loss; epoch 8 had the best
        // macro-F1 in both histories.
        for (file, epoch) in [("best-score", 10), ("best-loss", 10), ("best-macro", 8)] {
            save(&out.join(format!("{file}.safetensors")), epoch);
            let doc = format!("{{\"thresholds\": [0.3], \"epoch\": {epoch}}}");
            std::fs::write(out.join(format!("{file}.json")), doc).unwrap();
        }
        let monitors = [
            Monitor::max("score", "best-score.safetensors"),
            Monitor::min("loss", "best-loss.safetensors"),
            Monitor::max("macro", "best-macro.safetensors"),
        ];
        let best = |epoch| Best { value: 0.8, epoch };
        let bests = std::collections::BTreeMap::from([
            ("best-score.safetensors".to_string(), best(8)),
            ("best-loss.safetensors".to_string(), best(9)),
            ("best-macro.safetensors".to_string(), best(8)),
        ]);
        let notes =
            align_best_models(out, &resumed, &monitors, &bests, &AsideDir::new(out)).unwrap();
        assert_eq!(notes.len(), 2, "{notes:?}");
        let aside: Vec<String> = names(&dir)
            .into_iter()
            .filter(|n| n.starts_with("abandoned-"))
            .collect();
        assert_eq!(aside.len(), 1);
        let aside = dir.join(&aside[0]);
        assert!(
            notes[0].ends_with(&format!(
                "best-score.safetensors is the model of epoch 10, and the run's best for it is \
                 epoch 8's: restored from {} (without thresholds); the file and its thresholds \
                 are moved to {}",
                dir.join("epoch-0008.safetensors").display(),
                aside.display()
            )),
            "{}",
            notes[0]
        );
        assert_eq!(
            epoch_of(&out.join("best-score.safetensors")),
            ("8".into(), 8.0)
        );
        assert!(!out.join("best-score.json").exists());
        // No epoch-9 checkpoint: set aside with its document.
        assert!(
            notes[1].contains("records epoch 9, whose checkpoint is gone: moved to"),
            "{}",
            notes[1]
        );
        // Epoch 10's models and the thresholds tuned for them, as they were.
        assert_eq!(
            names(&aside),
            [
                "best-loss.json",
                "best-loss.safetensors",
                "best-score.json",
                "best-score.safetensors"
            ]
        );
        for file in ["best-score", "best-loss"] {
            assert_eq!(
                std::fs::read_to_string(aside.join(format!("{file}.json"))).unwrap(),
                "{\"thresholds\": [0.3], \"epoch\": 10}"
            );
            let model = aside.join(format!("{file}.safetensors"));
            assert_eq!(epoch_of(&model), ("10".into(), 10.0));
        }
        assert_eq!(
            names(out),
            [
                "best-macro.json",
                "best-macro.safetensors",
                "best-score.safetensors",
                "checkpoints"
            ]
        );
        assert_eq!(
            epoch_of(&out.join("best-macro.safetensors")),
            ("8".into(), 8.0)
        );
        // Consistent now: nothing more to do.
        assert!(
            align_best_models(out, &resumed, &monitors, &bests, &AsideDir::new(out))
                .unwrap()
                .is_empty()
        );
    }

    /// A start cut short between setting a best model aside and restoring it leaves none: the
    /// next start restores it, and the thresholds epoch 8 tuned for it from that epoch's copy.
    #[test]
    fn a_missing_best_model_is_restored_with_the_thresholds_of_its_epoch() {
        let run = ddp_testkit::temp_dir("ddp-train-best-missing");
        let out = run.path();
        let dir = state::checkpoint_dir(out);
        std::fs::create_dir_all(&dir).unwrap();
        let resumed = dir.join("epoch-0009.safetensors");
        save(&resumed, 9);
        save(&dir.join("epoch-0008.safetensors"), 8);
        let tuned = "{\"thresholds\": [0.3], \"epoch\": 8}";
        let copy = best_files::document_copy(out, 8, "best-score.safetensors");
        assert_eq!(copy, dir.join("epoch-0008.best-score.json"));
        std::fs::write(&copy, tuned).unwrap();
        let monitors = [Monitor::max("score", "best-score.safetensors")];
        let bests = std::collections::BTreeMap::from([(
            "best-score.safetensors".to_string(),
            Best {
                value: 0.8,
                epoch: 8,
            },
        )]);
        let notes =
            align_best_models(out, &resumed, &monitors, &bests, &AsideDir::new(out)).unwrap();
        assert_eq!(
            notes,
            [format!(
                "{} is missing, and the run's best for it is epoch 8's: restored from {} (with \
                 its thresholds)",
                out.join("best-score.safetensors").display(),
                dir.join("epoch-0008.safetensors").display()
            )]
        );
        assert_eq!(
            epoch_of(&out.join("best-score.safetensors")),
            ("8".into(), 8.0)
        );
        assert_eq!(
            std::fs::read_to_string(out.join("best-score.json")).unwrap(),
            tuned
        );
        assert!(
            align_best_models(out, &resumed, &monitors, &bests, &AsideDir::new(out))
                .unwrap()
                .is_empty()
        );
        // A crash in a later best's save, after the document went and before the new model
        // came, leaves epoch 8's model alone: its thresholds come back too.
        std::fs::remove_file(out.join("best-score.json")).unwrap();
        let notes =
            align_best_models(out, &resumed, &monitors, &bests, &AsideDir::new(out)).unwrap();
        assert_eq!(
            notes,
            [format!(
                "{} had no thresholds beside it: restored epoch 8's from {}",
                out.join("best-score.safetensors").display(),
                copy.display()
            )]
        );
        assert_eq!(
            std::fs::read_to_string(out.join("best-score.json")).unwrap(),
            tuned
        );
        // Without a copy (a run that tuned none), nothing to restore.
        std::fs::remove_file(out.join("best-score.json")).unwrap();
        std::fs::remove_file(&copy).unwrap();
        assert!(
            align_best_models(out, &resumed, &monitors, &bests, &AsideDir::new(out))
                .unwrap()
                .is_empty()
        );
        assert!(!out.join("best-score.json").exists());
    }

    /// Another run's checkpoint resumed into a run directory records the other run's bests:
    /// the directory's best-model file and its thresholds stay as they are, though its own
    /// checkpoint of the epoch those bests name is there.
    #[test]
    fn another_runs_checkpoint_leaves_the_best_models_be() {
        let (a, b) = (
            ddp_testkit::temp_dir("ddp-train-best-a"),
            ddp_testkit::temp_dir("ddp-train-best-b"),
        );
        let (a_dir, b_dir) = (
            state::checkpoint_dir(a.path()),
            state::checkpoint_dir(b.path()),
        );
        std::fs::create_dir_all(&a_dir).unwrap();
        std::fs::create_dir_all(&b_dir).unwrap();
        let resumed = a_dir.join("epoch-0005.safetensors");
        save(&resumed, 5);
        save(&b_dir.join("epoch-0007.safetensors"), 7);
        let best = b.path().join("best-score.safetensors");
        save(&best, 10);
        std::fs::write(b.path().join("best-score.json"), b"{\"thresholds\": [0.3]}").unwrap();
        let monitors = [Monitor::max("score", "best-score.safetensors")];
        // Run A's state: its best score was its epoch 7.
        let bests = std::collections::BTreeMap::from([(
            "best-score.safetensors".to_string(),
            Best {
                value: 0.8,
                epoch: 7,
            },
        )]);
        let notes = align_best_models(
            b.path(),
            &resumed,
            &monitors,
            &bests,
            &AsideDir::new(b.path()),
        )
        .unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(epoch_of(&best), ("10".into(), 10.0));
        assert_eq!(
            std::fs::read_to_string(b.path().join("best-score.json")).unwrap(),
            "{\"thresholds\": [0.3]}"
        );
        assert_eq!(
            names(&b_dir),
            ["epoch-0007.safetensors"],
            "nothing set aside"
        );
    }

    /// Another process's temporaries go, though it had this one's id (a container's PID 1 at
    /// every start): in the older form (`.tmp-<pid>`), or of another start; this process's
    /// own stay.
    #[test]
    fn only_other_processes_write_temporaries_are_removed() {
        let dir = ddp_testkit::temp_dir("temporaries");
        let out = dir.path();
        let checkpoints = state::checkpoint_dir(out);
        std::fs::create_dir_all(&checkpoints).unwrap();
        let tag = ddp_model::checkpoint::temporary_tag();
        let pid = std::process::id();
        let keep = [
            out.join("metrics.jsonl"),
            out.join(".hidden"),
            out.join(".x.tmp-12ab"),
            out.join(".x.tmp-12-xyz"),
            checkpoints.join("epoch-0001.safetensors"),
            checkpoints.join(format!(".latest.tmp-{tag}")),
        ];
        let gone = [
            out.join(".metrics.jsonl.tmp-1"),
            checkpoints.join(format!(".epoch-0004-step-000007.safetensors.tmp-{pid}")),
            checkpoints.join(".epoch-0004.safetensors.tmp-4242"),
            checkpoints.join(format!(".latest.tmp-{pid}-1")),
        ];
        for f in keep.iter().chain(&gone) {
            std::fs::write(f, b"x").unwrap();
        }
        assert_eq!(remove_stale_temporaries(out), gone.to_vec());
        assert!(keep.iter().all(|f| f.exists()) && gone.iter().all(|f| !f.exists()));
    }

    /// A run directory whose `latest` names `epoch-0001`, written by job `job`.
    fn run_of_job(job: &str) -> ddp_testkit::TempDir {
        let dir = ddp_testkit::temp_dir("run-dir");
        std::fs::create_dir_all(state::checkpoint_dir(dir.path())).unwrap();
        std::fs::write(
            state::checkpoint_dir(dir.path()).join("latest"),
            "epoch-0001\n",
        )
        .unwrap();
        let config = serde_json::json!({ RUN_ID_KEY: job, "world_size": 2 });
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        dir
    }

    fn settings(out: &Path, resume: Option<&str>) -> Settings {
        let mut s = Settings {
            out: Some(out.to_path_buf()),
            ..Default::default()
        };
        s.checkpoint.resume = resume.map(str::to_string);
        s
    }

    fn env(run_id: &str, restart_count: u64) -> EnvConfig {
        let mut e = EnvConfig::new(0, 2, "127.0.0.1", 1);
        e.run_id = run_id.to_string();
        e.restart_count = restart_count;
        e
    }

    #[test]
    fn the_same_job_continues_its_run_and_another_is_refused() {
        let run = run_of_job("slurm-42");
        let out = run.path();
        // A requeued job, or a torchrun node joining (no restart counted): same id.
        let mut s = settings(out, None);
        let note = resume_after_restart(&mut s, &env("slurm-42", 0)).unwrap();
        assert_eq!(note, ", continuing job slurm-42");
        assert_eq!(s.checkpoint.resume.as_deref(), Some("latest"));
        // Another job, or no id at all (torchrun's `none`, the default): refused.
        for other in ["slurm-43", "none", "ddp-comm"] {
            let mut s = settings(out, None);
            let e = resume_after_restart(&mut s, &env(other, 0)).unwrap_err();
            assert!(
                e.to_string().contains("already holds a run (its "),
                "{other}: {e}"
            );
            assert_eq!(s.checkpoint.resume, None);
        }
        // A launcher's restart continues the run of its own job, or of any without an id.
        for own in ["slurm-42", "none"] {
            let mut s = settings(out, None);
            let note = resume_after_restart(&mut s, &env(own, 1)).unwrap();
            assert_eq!(note, ", after the launcher's restart", "{own}");
        }
        // Another job's restart (of ranks a refusal ended) is refused as its first start was.
        let mut s = settings(out, None);
        let e = resume_after_restart(&mut s, &env("slurm-43", 1)).unwrap_err();
        assert!(
            matches!(&e, TrainError::Invalid(why) if why == &format!(
                "--out {0} already holds a run (its {0}/checkpoints/latest names epoch-0001): \
                 continue it with --resume latest, or give another --out (or remove that \
                 folder) to start a new run",
                out.display()
            )),
            "{e:?}"
        );
        assert_eq!(s.checkpoint.resume, None);
    }

    /// A Kubeflow pod restarted after a crash gets torchrun's four variables only: no
    /// restart count, and no run id unless its template sets `DDP_RUN_ID`, which continues
    /// the run; without it, the refusal names `DDP_RUN_ID`.
    #[test]
    fn a_restarted_pod_continues_its_run_by_its_ddp_run_id() {
        let run = run_of_job("job");
        let pod = |run_id: Option<&str>| {
            EnvConfig::from_lookup(|k| {
                let v = match k {
                    "RANK" => "1",
                    "WORLD_SIZE" => "2",
                    "MASTER_ADDR" => "job-master-0",
                    "MASTER_PORT" => "23456",
                    "DDP_RUN_ID" => run_id?,
                    _ => return None,
                };
                Some(v.to_string())
            })
            .unwrap()
        };
        let mut s = settings(run.path(), None);
        let note = resume_after_restart(&mut s, &pod(Some("job"))).unwrap();
        assert_eq!(note, ", continuing job job");
        assert_eq!(s.checkpoint.resume.as_deref(), Some("latest"));
        let mut s = settings(run.path(), None);
        let e = resume_after_restart(&mut s, &pod(None)).unwrap_err();
        let out = run.path().display();
        assert!(
            matches!(&e, TrainError::Invalid(why) if why == &format!(
                "--out {out} already holds a run (its {out}/checkpoints/latest names \
                 epoch-0001): continue it with --resume latest, or give another --out (or \
                 remove that folder) to start a new run; ranks restarted without \
                 TORCHELASTIC_RESTART_COUNT (a Kubeflow pod) continue it when every start has \
                 the same DDP_RUN_ID"
            )),
            "{e:?}"
        );
        assert_eq!(s.checkpoint.resume, None);
        // A job that names itself, but another one: no such hint.
        let e = resume_after_restart(&mut s, &pod(Some("other"))).unwrap_err();
        assert!(!e.to_string().contains("DDP_RUN_ID"), "{e}");
    }

    #[test]
    fn a_continuing_run_prefers_its_latest_checkpoint_to_where_it_began() {
        let run = run_of_job("job-7");
        let out = run.path();
        let mut s = settings(out, Some("/elsewhere/epoch-0003.safetensors"));
        let note = resume_after_restart(&mut s, &env("job-7", 1)).unwrap();
        assert_eq!(
            note,
            ", continuing the run from its latest checkpoint (it began from \
             /elsewhere/epoch-0003.safetensors)"
        );
        assert_eq!(s.checkpoint.resume.as_deref(), Some("latest"));
        // A stopped run, started again by a new job (a requeue with a new id), too.
        state::mark_stopped(out, "epoch-0001", "time limit").unwrap();
        let mut s = settings(out, Some("/elsewhere/epoch-0003.safetensors"));
        assert!(resume_after_restart(&mut s, &env("job-8", 0))
            .unwrap()
            .starts_with(", continuing the run from its latest checkpoint"));
    }

    /// A new job resuming another run's checkpoint into a run directory would write over the
    /// run's metrics, checkpoints and best models: refused, as starting over is. Resuming one
    /// of the run's own checkpoints (a rewind, which sets the later ones aside) is not.
    #[test]
    fn a_new_job_resuming_another_runs_checkpoint_into_a_run_is_refused() {
        let run = run_of_job("job-7");
        let out = run.path();
        let dir = state::checkpoint_dir(out);
        let other = ddp_testkit::temp_dir("run-dir-other");
        let elsewhere = other.path().join("epoch-0002.safetensors");
        for f in [&elsewhere, &dir.join("epoch-0001.safetensors")] {
            std::fs::write(f, b"x").unwrap();
        }
        let mut s = settings(out, Some(elsewhere.to_str().unwrap()));
        let e = resume_after_restart(&mut s, &env("job-8", 0)).unwrap_err();
        assert!(
            matches!(&e, TrainError::Invalid(why) if why == &format!(
                "--out {0} already holds a run (its {0}/checkpoints/latest names epoch-0001), \
                 and --resume {1} is not one of its checkpoints: continue it with --resume \
                 latest, or give another --out (or remove that folder) to start a new run",
                out.display(),
                elsewhere.display()
            )),
            "{e:?}"
        );
        assert_eq!(s.checkpoint.resume.as_deref(), elsewhere.to_str());
        // The run's own checkpoint, its folder, or the run directory: the run goes on.
        let own = dir.join("epoch-0001.safetensors");
        for given in [own.to_str().unwrap(), out.to_str().unwrap(), "latest"] {
            let mut s = settings(out, Some(given));
            assert_eq!(resume_after_restart(&mut s, &env("job-8", 0)).unwrap(), "");
            assert_eq!(s.checkpoint.resume.as_deref(), Some(given));
        }
        // One that does not resolve is left to the start, which names what is wrong.
        let mut s = settings(out, Some("/no/such/file.safetensors"));
        assert_eq!(resume_after_restart(&mut s, &env("job-8", 0)).unwrap(), "");
    }

    #[test]
    fn a_restart_without_resuming_by_itself_is_refused_not_started_over() {
        let run = run_of_job("job-7");
        let mut s = settings(run.path(), None);
        s.checkpoint.resume_after_restart = false;
        let e = resume_after_restart(&mut s, &env("job-7", 2)).unwrap_err();
        assert!(
            e.to_string()
                .contains("already holds a run (resuming by itself after a restart is off)"),
            "{e}"
        );
    }

    #[test]
    fn evaluating_a_file_keeps_it_whatever_the_run_directory_holds() {
        let run = run_of_job("job-7");
        state::mark_stopped(run.path(), "epoch-0001", "time limit").unwrap();
        let mut s = settings(run.path(), Some("/elsewhere/best.safetensors"));
        s.checkpoint.eval_only = true;
        assert_eq!(resume_after_restart(&mut s, &env("job-7", 1)).unwrap(), "");
        assert_eq!(
            s.checkpoint.resume.as_deref(),
            Some("/elsewhere/best.safetensors")
        );
    }

    #[test]
    fn a_latest_that_is_not_a_file_is_refused_not_started_over() {
        let dir = ddp_testkit::temp_dir("run-dir");
        let latest = state::checkpoint_dir(dir.path()).join("latest");
        std::fs::create_dir_all(&latest).unwrap();
        // Evaluating a named file writes no checkpoint: whatever `latest` is, it goes on.
        let mut s = settings(dir.path(), Some("/elsewhere/best.safetensors"));
        s.checkpoint.eval_only = true;
        assert_eq!(resume_after_restart(&mut s, &env("job-7", 0)).unwrap(), "");
        assert_eq!(
            s.checkpoint.resume.as_deref(),
            Some("/elsewhere/best.safetensors")
        );
        let mut s = settings(dir.path(), None);
        let e = resume_after_restart(&mut s, &env("job-7", 0)).unwrap_err();
        assert!(
            matches!(&e, TrainError::Invalid(why) if why == &format!(
                "{} is not a file: it should hold the name of the run's latest checkpoint; \
                 remove it, or give another --out",
                latest.display()
            )),
            "{e:?}"
        );
    }

    #[test]
    fn a_run_without_checkpoints_starts_over() {
        let dir = ddp_testkit::temp_dir("run-dir");
        let mut s = settings(dir.path(), None);
        assert_eq!(resume_after_restart(&mut s, &env("job-7", 3)).unwrap(), "");
        assert_eq!(s.checkpoint.resume, None);
        // The empty history of a start that ended before its first epoch did.
        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        assert_eq!(resume_after_restart(&mut s, &env("job-8", 0)).unwrap(), "");
    }

    /// A run whose checkpoints were deleted to save space keeps its metrics and best models:
    /// a new start there would write over them, and is refused; the run's own restart
    /// (before its first checkpoint) starts over.
    #[test]
    fn a_new_start_in_a_run_without_checkpoints_keeping_results_is_refused() {
        let run = ddp_testkit::temp_dir("run-dir-results");
        let out = run.path();
        let metrics = format!("{}\n{}\n", r#"{"epoch":1}"#, r#"{"epoch":2}"#);
        std::fs::write(out.join("metrics.jsonl"), &metrics).unwrap();
        std::fs::write(out.join("best-score.safetensors"), b"model").unwrap();
        std::fs::write(out.join("best-score.json"), b"{}").unwrap();
        let mut s = settings(out, None);
        s.monitors = vec![
            Monitor::max("score", "best-score.safetensors"),
            Monitor::min("val_loss", "best-loss.safetensors"),
        ];
        let e = resume_after_restart(&mut s, &env("job-8", 0)).unwrap_err();
        assert!(
            matches!(&e, TrainError::Invalid(why) if why == &format!(
                "--out {0} already holds a run (its metrics.jsonl, best-score.safetensors, \
                 without {0}/checkpoints/latest): give another --out (or move those files \
                 away) to start a new run",
                out.display()
            )),
            "{e:?}"
        );
        // Only the best model: refused too, and from another run's checkpoint.
        std::fs::remove_file(out.join("metrics.jsonl")).unwrap();
        let other = out.join("other.safetensors");
        std::fs::write(&other, b"x").unwrap();
        s.checkpoint.resume = Some(other.to_str().unwrap().to_string());
        let e = resume_after_restart(&mut s, &env("job-8", 0)).unwrap_err();
        assert!(
            e.to_string().contains(&format!(
                "(its best-score.safetensors, without {}/checkpoints/latest), and --resume {} \
                 is not one of its checkpoints: give another --out",
                out.display(),
                other.display()
            )),
            "{e}"
        );
        // Another job's restart would start over on them: refused.
        s.checkpoint.resume = None;
        let config = serde_json::json!({ RUN_ID_KEY: "job-8" });
        std::fs::write(out.join("config.json"), config.to_string()).unwrap();
        let e = resume_after_restart(&mut s, &env("job-9", 1)).unwrap_err();
        assert!(
            e.to_string()
                .contains("(its best-score.safetensors, without "),
            "{e}"
        );
        // The run's own restart, or an evaluation, goes on.
        assert_eq!(resume_after_restart(&mut s, &env("job-8", 1)).unwrap(), "");
        s.checkpoint.eval_only = true;
        assert_eq!(resume_after_restart(&mut s, &env("job-8", 0)).unwrap(), "");
        assert_eq!(
            std::fs::read(out.join("best-score.safetensors")).unwrap(),
            b"model"
        );
    }
}
