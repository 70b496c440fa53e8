//! What the trainer writes into the run directory: rank 0's end of an epoch
//! (`metrics.jsonl`, `curves.png`, best-model files and what the task saves beside them, the
//! epoch's checkpoint), the history an
//! earlier `metrics.jsonl` leaves, atomic file writes, and every rank's log.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use ddp_model::checkpoint;

use super::{EpochReport, Trainer};
use crate::error::{Context, TrainError};
use crate::report::watched;
use crate::state::{self, Best, TrainState};
use crate::task::Task;

impl<T: Task> Trainer<T> {
    /// Every rank's record of the bests after the epoch `m` (all ranks see the same
    /// all-reduced metrics): the model files of the monitors it improved, which rank 0 saves.
    pub(super) fn update_bests(&mut self, m: &EpochReport) -> Result<Vec<String>, TrainError> {
        let mut improved = Vec::new();
        for monitor in &self.settings.monitors {
            let value = watched(m, &monitor.metric, "a best-model monitor")?;
            let previous = self.bests.get(&monitor.file);
            if Best::replaced(previous, value, |new, old| monitor.goal.improves(new, old)) {
                let epoch = m.epoch;
                self.bests
                    .insert(monitor.file.clone(), Best { value, epoch });
                improved.push(monitor.file.clone());
            }
        }
        Ok(improved)
    }

    /// Rank 0's end of an epoch: metrics line, curves, the best models of the monitors
    /// `improved` ([`Self::update_bests`]), checkpoint.
    pub(super) fn finish_epoch(
        &mut self,
        m: &EpochReport,
        summary: &str,
        beside_best: Option<&serde_json::Value>,
        improved: &[String],
    ) -> Result<(), TrainError> {
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
            "epoch {}/{}: train loss {:.4}{val}{summary}  lr {:.2e}  {:.1} samples/s  {:.1} s",
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
            // The file's entry, where this line made it.
            .and_then(|()| checkpoint::sync_entries(&self.out))
            .map_err(|e| TrainError::io(format!("cannot write {}", metrics_path.display()), e))?;
        self.history.push(m.clone());
        self.draw_curves();
        // A best model records the settings it was made under: a resume with others rewrites
        // config.json, not the best models of the epochs before it.
        let meta = std::collections::HashMap::from([
            ("epoch".to_owned(), m.epoch.to_string()),
            state::model_record(&self.run_config()),
        ]);
        let mut best_notes = Vec::new();
        for monitor in &self.settings.monitors {
            if improved.contains(&monitor.file) {
                self.save_best(&monitor.file, m.epoch, &meta, beside_best)?;
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

    /// Replaces the best model `file` with this epoch's, and the document beside it
    /// (`<file>.json`) with `beside` and the epoch, or with none: an earlier document
    /// (thresholds tuned for the model replaced) is removed first, and the new one written
    /// last, so that a crash between the steps leaves no document beside a model it was not
    /// made for, and a run resumed without documents (ODIR's without `--tune-thresholds`)
    /// leaves none of the run's earlier models beside its own. The document goes first into
    /// the checkpoints, as this epoch's copy ([`super::best_files::document_copy`]), so that a crash
    /// before this epoch's checkpoint loses no document: the resumed run restores the
    /// earlier best's model and its document from the checkpoints.
    fn save_best(
        &self,
        file: &str,
        epoch: u64,
        meta: &std::collections::HashMap<String, String>,
        beside: Option<&serde_json::Value>,
    ) -> Result<(), TrainError> {
        let model = self.out.join(file);
        let doc_path = model.with_extension("json");
        let copy = super::best_files::document_copy(&self.out, epoch, file);
        let doc = beside
            .map(|doc| {
                let mut doc = doc.clone();
                if let Some(fields) = doc.as_object_mut() {
                    fields.insert("epoch".into(), epoch.into());
                }
                serde_json::to_string_pretty(&doc)
                    .context(|| format!("encoding {}", doc_path.display()))
            })
            .transpose()?;
        match &doc {
            Some(text) => {
                state::create_checkpoint_dir(&self.out)?;
                write_file(&copy, text.as_bytes())?;
            }
            // An abandoned history's copy of this epoch is not this one's.
            None => state::remove_if_present(&copy)?,
        }
        match std::fs::remove_file(&doc_path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(TrainError::io(
                    format!("cannot remove {}", doc_path.display()),
                    e,
                ))
            }
            _ => {}
        }
        checkpoint::save(&self.vs, &model, meta)?;
        if let Some(text) = doc {
            write_file(&doc_path, text.as_bytes())?;
        }
        Ok(())
    }

    fn plots_enabled(&self) -> bool {
        cfg!(feature = "plot") && self.settings.runtime.plot
    }

    /// Says, once, that `curves.png` is not drawn when the settings ask for it (the
    /// default) in a program built without the `plot` feature.
    pub(super) fn note_missing_curves(&self) {
        if let Some(note) = missing_curves(self.settings.runtime.plot, cfg!(feature = "plot")) {
            self.log.say(note);
        }
    }

    /// Redraws `curves.png` (a failure is a warning: the run goes on).
    pub(super) fn draw_curves(&self) {
        #[cfg(feature = "plot")]
        if self.settings.runtime.plot {
            let metrics: Vec<String> = self
                .settings
                .monitors
                .iter()
                .map(|m| m.metric.clone())
                .filter(|m| m != "train_loss" && m != "val_loss")
                .collect();
            let path = self.out.join("curves.png");
            if let Err(e) = crate::plot::draw_curves(&self.history, &metrics, &path) {
                self.log.warn(&crate::error::with_causes(&e));
            }
        }
    }
}

/// The epochs before `start` from an earlier `metrics.jsonl` (a resumed run keeps them and
/// sets any line of an epoch that will be trained again aside, in `metrics.jsonl` of the
/// start's folder `aside`, with `curves.png`, which drew it), and a warning when its last
/// line was cut short.
///
/// An epoch's line is appended before its checkpoint is written, so a write cut short (a full
/// disk, a lost machine) leaves an unfinished last line of an epoch the resumed run trains
/// again: it is dropped, with the warning. Any other line that does not read is an error.
pub(super) fn read_history(
    out: &Path,
    start: u64,
    aside: &super::run_dir::AsideDir,
) -> Result<(Vec<EpochReport>, Option<String>), TrainError> {
    let path = out.join("metrics.jsonl");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), None)),
        // Damaged (not UTF-8) or unreadable: taken as empty, the retrained epochs' lines
        // would follow those they replace, and the curves lose the earlier epochs.
        Err(e) => {
            return Err(TrainError::io(
                format!(
                    "cannot read {} to continue it (move it away to start the history \
                     afresh)",
                    path.display()
                ),
                e,
            ))
        }
    };
    let mut kept_lines = Vec::new();
    let mut dropped = String::new();
    let mut reports = Vec::new();
    let mut warning = None;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    for (i, line) in lines.iter().enumerate() {
        let m: EpochReport = match serde_json::from_str(line) {
            Ok(m) => m,
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {
                warning = Some(format!(
                    "{}: its last line was cut short (an epoch's metrics whose checkpoint was \
                     never written); it is dropped",
                    path.display()
                ));
                continue;
            }
            Err(e) => {
                return Err(TrainError::Invalid(format!(
                    "{} line {} is not an epoch's metrics ({e}); move the file away to start a \
                     new run there, or remove that line to continue this one",
                    path.display(),
                    i + 1
                )))
            }
        };
        if m.epoch < start {
            kept_lines.push(line.to_string());
            reports.push(m);
        } else {
            dropped.push_str(line);
            dropped.push('\n');
        }
    }
    if !dropped.is_empty() {
        let folder = aside.get()?;
        write_file(&folder.join("metrics.jsonl"), dropped.as_bytes())?;
        // The curves drew those epochs too: they go with them, and the start redraws the
        // epochs kept.
        let curves = out.join("curves.png");
        match std::fs::rename(&curves, folder.join("curves.png")) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(TrainError::io(
                    format!("cannot set {} aside", curves.display()),
                    e,
                ))
            }
            _ => {}
        }
    }
    let mut body = kept_lines.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    write_file(&path, body.as_bytes())?;
    Ok((reports, warning))
}

/// Why `curves.png` is not drawn though the settings ask for it (`plot`): the program was
/// built without the `plot` feature.
fn missing_curves(plot: bool, built_with_plot: bool) -> Option<&'static str> {
    (plot && !built_with_plot).then_some(
        "no curves.png: this program was built without ddp-train's `plot` feature, which \
         draws it",
    )
}

pub(super) fn write_file(path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    checkpoint::write_atomic(path, bytes)
        .map_err(|e| TrainError::io(format!("cannot write {}", path.display()), e))
}

/// Opens `path` with `options` where it must be a regular file (the run directory's lock,
/// emptied for its holder's line): a symbolic link in its place is refused (`O_NOFOLLOW`),
/// and so is a FIFO or a device (`O_NONBLOCK` keeps the open from waiting on a FIFO; it is
/// cleared once the file is known, so that reads and writes wait as usual), so a run folder
/// that others can write to cannot redirect the trainer's writes into another file. The
/// refusal names what is there and says to remove it.
pub(super) fn open_regular(path: &Path, options: &mut OpenOptions) -> std::io::Result<File> {
    open_checked(path, options, false)
}

/// Opens a rank's log at `path` to append to it. As [`open_regular`], except that a symbolic
/// link, FIFO or device that this process's user owns is the user's choice, and taken: a link
/// is followed as it reads, to whatever it leads to but a folder (`rank-0.log -> /dev/null`
/// to keep no log, or a file elsewhere); a FIFO is a collector's, which must be reading
/// already (opening one without a reader fails). Another user's link, FIFO or device is
/// refused as at the lock: the log is only appended to, but a link planted in a folder that
/// others can write to would still append the trainer's lines where the planter chose.
pub(super) fn open_log(path: &Path) -> std::io::Result<File> {
    open_checked(path, OpenOptions::new().create(true).append(true), true).map_err(|e| {
        let what = match e.raw_os_error() {
            // A FIFO opened to write without waiting, while nothing reads it (a Unix socket
            // answers the same).
            Some(libc::ENXIO) if is_fifo(path) => {
                "it is a FIFO with no reader: start its reader first, or remove it"
            }
            Some(libc::ENXIO) => "it is a device or a socket, not a regular file: remove it",
            // The user's own link, to a folder.
            Some(libc::EISDIR) => "it is a folder, not a regular file: remove it",
            _ => return e,
        };
        std::io::Error::new(std::io::ErrorKind::InvalidInput, what)
    })
}

/// Whether `path` leads to a FIFO.
fn is_fifo(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo())
}

/// [`open_regular`]; with `users_own`, [`open_log`]'s exceptions.
fn open_checked(path: &Path, options: &mut OpenOptions, users_own: bool) -> std::io::Result<File> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
    let refuse = |what: &str| {
        let e = format!("it is {what}, not a regular file: remove it");
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
    };
    let (file, followed) = match options
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        // O_NOFOLLOW's answer where the path's last component is a link.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            if !users_own {
                return Err(refuse("a symbolic link"));
            }
            let target = own_link_target(path)?.map_err(|owner| {
                refuse(&format!("a symbolic link of another user (uid {owner})"))
            })?;
            (options.custom_flags(libc::O_NONBLOCK).open(target)?, true)
        }
        opened => (opened?, false),
    };
    let meta = file.metadata()?;
    let kind = meta.file_type();
    let taken = kind.is_file() || (users_own && (followed || meta.uid() == effective_uid()));
    if kind.is_dir() {
        return Err(refuse("a folder"));
    } else if !taken && kind.is_fifo() {
        return Err(refuse("a FIFO"));
    } else if !taken {
        return Err(refuse("a device or a socket"));
    }
    clear_nonblocking(&file)?;
    Ok(file)
}

/// Where the symbolic link at `path` leads (relative to its folder), read from the link
/// itself as opened (`O_PATH`), so that no other link can take its place between the check
/// of its owner and the read; `Err` with the owner's uid when that is not this process's
/// user.
fn own_link_target(path: &Path) -> std::io::Result<Result<PathBuf, u32>> {
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStringExt;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let link = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
        .open(path)?;
    let meta = link.metadata()?;
    if !meta.file_type().is_symlink() {
        return Err(std::io::Error::other(
            "it was replaced while being opened: try again",
        ));
    }
    if meta.uid() != effective_uid() {
        return Ok(Err(meta.uid()));
    }
    let mut target = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: readlinkat(2) writes at most `target.len()` bytes into `target`, which lives
    // across the call; the empty path names the link opened as `link` (Linux 2.6.39 on).
    let n = unsafe {
        libc::readlinkat(
            link.as_raw_fd(),
            c"".as_ptr(),
            target.as_mut_ptr().cast(),
            target.len(),
        )
    };
    let n = usize::try_from(n).map_err(|_| std::io::Error::last_os_error())?;
    target.truncate(n);
    let folder = path.parent().unwrap_or(Path::new("."));
    Ok(Ok(folder.join(std::ffi::OsString::from_vec(target))))
}

/// This process's effective user id, the owner of what it creates.
fn effective_uid() -> u32 {
    // SAFETY: geteuid(2) has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Clears `O_NONBLOCK`, which [`open_checked`] opens with, from `file`'s status flags.
fn clear_nonblocking(file: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl(2) with F_GETFL and F_SETFL on a descriptor `file` owns for the call;
    // no memory is involved.
    let set = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if set {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A rank's log: appended to `<run>/logs/rank-<r>.log` and emitted as `tracing` events
/// (target `ddp_train`; the program's subscriber decides what is shown where).
/// While rank 0's progress bar is drawn, lines are printed with the bar suspended (cleared,
/// then redrawn below them) so that they do not tear it.
#[derive(Debug)]
pub(super) struct RankLog {
    file: std::sync::Mutex<std::fs::File>,
    bar: std::sync::Mutex<Option<indicatif::ProgressBar>>,
}

impl RankLog {
    pub(super) fn open(out: &Path, rank: usize) -> Result<Self, TrainError> {
        let path = out.join("logs").join(format!("rank-{rank}.log"));
        let file = open_log(&path)
            .map_err(|e| TrainError::io(format!("cannot open {}", path.display()), e))?;
        Ok(Self {
            file: std::sync::Mutex::new(file),
            bar: std::sync::Mutex::new(None),
        })
    }

    /// The progress bar now drawn (`None` once it is gone).
    pub(super) fn set_bar(&self, bar: Option<indicatif::ProgressBar>) {
        *self.bar.lock().unwrap_or_else(|e| e.into_inner()) = bar;
    }

    /// Runs `show` with the progress bar, if any, out of the way.
    fn around_bar(&self, show: impl FnOnce()) {
        let bar = self.bar.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match bar {
            Some(bar) => bar.suspend(show),
            None => show(),
        }
    }

    pub(super) fn say(&self, line: &str) {
        self.around_bar(|| tracing::info!("{line}"));
        self.append(line);
    }

    pub(super) fn warn(&self, line: &str) {
        let line = format!("warning: {line}");
        self.around_bar(|| tracing::warn!("{line}"));
        self.append(&line);
    }

    fn append(&self, line: &str) {
        if let Ok(mut f) = self.file.lock() {
            let _ = writeln!(f, "{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::run_dir::AsideDir;
    use super::*;

    fn line(epoch: u64) -> String {
        format!(
            "{{\"epoch\":{epoch},\"train_loss\":0.5,\"lr\":0.001,\"images_per_sec\":10.0,\
             \"epoch_seconds\":1.0,\"steps\":3,\"world_size\":2}}"
        )
    }

    /// Whether `file`'s descriptor is non-blocking.
    fn nonblocking(file: &File) -> bool {
        use std::os::fd::AsRawFd;
        // SAFETY: fcntl(2) F_GETFL on a descriptor `file` owns; no memory is involved.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        assert!(flags >= 0);
        flags & libc::O_NONBLOCK != 0
    }

    /// A link planted at a rank's log by another user is refused, naming the log, and its
    /// target is kept; the user's own link is followed (to a file, or `/dev/null`).
    #[test]
    fn a_rank_log_that_is_another_users_link_is_refused_and_its_target_kept() {
        let dir = ddp_testkit::temp_dir("rank-log-link");
        let (log, victim) = (
            dir.path().join("logs/rank-1.log"),
            dir.path().join("victim"),
        );
        std::fs::create_dir(dir.path().join("logs")).unwrap();
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink("../victim", &log).unwrap();
        // Only root can give a link away; elsewhere this half is not checkable.
        if effective_uid() == 0 {
            std::os::unix::fs::lchown(&log, Some(65534), None).unwrap();
            let err = RankLog::open(dir.path(), 1).unwrap_err();
            assert_eq!(
                crate::error::with_causes(&err),
                format!(
                    "cannot open {}: it is a symbolic link of another user (uid 65534), not a \
                     regular file: remove it",
                    log.display()
                )
            );
            assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
            std::os::unix::fs::lchown(&log, Some(0), None).unwrap();
        } else {
            eprintln!("not root: another user's link at a rank log is not checked");
        }
        // The user's own link, relative to the log's folder, leads to where the lines go.
        let opened = RankLog::open(dir.path(), 1).unwrap();
        assert!(!nonblocking(&opened.file.lock().unwrap()));
        opened.append("line");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keepline\n");
        std::fs::remove_file(&log).unwrap();
        std::os::unix::fs::symlink("/dev/null", &log).unwrap();
        RankLog::open(dir.path(), 1).unwrap().append("gone");
        std::fs::remove_file(&log).unwrap();
        let opened = RankLog::open(dir.path(), 1).unwrap();
        opened.append("line");
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "line\n");
    }

    /// A Unix socket in a rank log's place is not called a FIFO.
    #[test]
    fn a_rank_log_that_is_a_socket_says_so() {
        let dir = ddp_testkit::temp_dir("rank-log-socket");
        std::fs::create_dir(dir.path().join("logs")).unwrap();
        let log = dir.path().join("logs/rank-0.log");
        drop(std::os::unix::net::UnixListener::bind(&log).unwrap());
        let err = RankLog::open(dir.path(), 0).unwrap_err();
        assert_eq!(
            crate::error::with_causes(&err),
            format!(
                "cannot open {}: it is a device or a socket, not a regular file: remove it",
                log.display()
            )
        );
    }

    /// The user's own link to a folder is refused as the folder it leads to.
    #[test]
    fn a_rank_log_linked_to_a_folder_says_so() {
        let dir = ddp_testkit::temp_dir("rank-log-folder");
        std::fs::create_dir(dir.path().join("logs")).unwrap();
        let log = dir.path().join("logs/rank-0.log");
        std::os::unix::fs::symlink(dir.path(), &log).unwrap();
        let err = RankLog::open(dir.path(), 0).unwrap_err();
        assert_eq!(
            crate::error::with_causes(&err),
            format!(
                "cannot open {}: it is a folder, not a regular file: remove it",
                log.display()
            )
        );
    }

    /// A rank log may be the user's FIFO, whose reader gets the lines, never another user's;
    /// the lock is a regular file only; either is left blocking once opened.
    #[test]
    fn a_rank_log_may_be_the_users_own_fifo() {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = ddp_testkit::temp_dir("rank-log-fifo");
        std::fs::create_dir(dir.path().join("logs")).unwrap();
        let log = dir.path().join("logs/rank-0.log");
        let fifo = std::ffi::CString::new(log.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) reads a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        // The lock's rule takes no FIFO, the user's own neither.
        let refused = open_regular(&log, OpenOptions::new().read(true).write(true));
        assert_eq!(
            refused.unwrap_err().to_string(),
            "it is a FIFO, not a regular file: remove it"
        );
        // With no reader, the open fails rather than waits.
        let err = RankLog::open(dir.path(), 0).unwrap_err();
        assert_eq!(
            crate::error::with_causes(&err),
            format!(
                "cannot open {}: it is a FIFO with no reader: start its reader first, or \
                 remove it",
                log.display()
            )
        );
        let reader = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&log)
            .unwrap();
        let opened = RankLog::open(dir.path(), 0).unwrap();
        assert!(!nonblocking(&opened.file.lock().unwrap()));
        opened.append("to the collector");
        drop(opened);
        let mut got = String::new();
        std::io::Read::read_to_string(&mut &reader, &mut got).unwrap();
        assert_eq!(got, "to the collector\n");
        if effective_uid() == 0 {
            std::os::unix::fs::chown(&log, Some(65534), None).unwrap();
            let err = RankLog::open(dir.path(), 0).unwrap_err();
            assert_eq!(
                crate::error::with_causes(&err),
                format!(
                    "cannot open {}: it is a FIFO, not a regular file: remove it",
                    log.display()
                )
            );
        } else {
            eprintln!("not root: another user's FIFO at a rank log is not checked");
        }
        let lock = dir.path().join(".lock");
        let file = open_regular(&lock, OpenOptions::new().write(true).create(true));
        assert!(!nonblocking(&file.unwrap()));
    }

    #[test]
    fn curves_asked_for_in_a_build_without_plot_are_said_to_be_missing() {
        assert_eq!(
            missing_curves(true, false),
            Some(
                "no curves.png: this program was built without ddp-train's `plot` feature, \
                 which draws it"
            )
        );
        assert_eq!(missing_curves(true, true), None);
        assert_eq!(missing_curves(false, false), None);
    }

    #[test]
    fn a_last_line_cut_short_is_dropped_with_a_warning_and_others_are_errors() {
        let dir = ddp_testkit::temp_dir("history");
        let path = dir.path().join("metrics.jsonl");
        let torn = format!("{}\n{}\n{{\"epoch\":3,\"train_lo", line(1), line(2));
        std::fs::write(&path, &torn).unwrap();
        let aside = AsideDir::new(dir.path());
        let (kept, warning) = read_history(dir.path(), 3, &aside).unwrap();
        assert_eq!(kept.iter().map(|m| m.epoch).collect::<Vec<_>>(), [1, 2]);
        assert!(warning.unwrap().contains("its last line was cut short"));
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{}\n{}\n", line(1), line(2))
        );
        assert!(
            !state::checkpoint_dir(dir.path()).exists(),
            "nothing set aside"
        );
        // A damaged line inside the file, or a whole last line, is not a cut-short append.
        for text in [
            format!("{}\nnot json\n{}\n", line(1), line(2)),
            format!("{}\nnot json\n", line(1)),
        ] {
            std::fs::write(&path, &text).unwrap();
            match read_history(dir.path(), 3, &aside) {
                Err(TrainError::Invalid(m)) => {
                    assert!(m.contains("metrics.jsonl line 2 is not"), "{m}")
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        }
    }

    /// A history that cannot be read is refused, and left as it is; none is an empty one.
    #[test]
    fn an_unreadable_history_is_refused_and_a_missing_one_is_empty() {
        let dir = ddp_testkit::temp_dir("history-unreadable");
        let aside = AsideDir::new(dir.path());
        assert_eq!(
            read_history(dir.path(), 3, &aside).unwrap(),
            (Vec::new(), None)
        );
        let path = dir.path().join("metrics.jsonl");
        let mut bytes = format!("{}\n", line(1)).into_bytes();
        bytes.extend_from_slice(b"\xff\n");
        std::fs::write(&path, &bytes).unwrap();
        match read_history(dir.path(), 3, &aside) {
            Err(TrainError::Io { what, source }) => {
                assert!(what.starts_with("cannot read "), "{what}");
                assert_eq!(source.kind(), std::io::ErrorKind::InvalidData);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }

    /// A rewind keeps the lines of the epochs before it and sets the others aside, with the
    /// curves and the checkpoints it sets aside, where they stay as they were (ODIR's tuned
    /// thresholds); a
    /// second start's rewind (a second `Trainer::new` of one process) sets its own aside.
    #[test]
    fn the_lines_a_rewind_drops_are_set_aside() {
        let dir = ddp_testkit::temp_dir("history-rewind");
        let path = dir.path().join("metrics.jsonl");
        let lines: Vec<String> = (1..=5).map(line).collect();
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let curves = dir.path().join("curves.png");
        std::fs::write(&curves, "epochs 1 to 5").unwrap();
        let first = AsideDir::new(dir.path());
        let (kept, warning) = read_history(dir.path(), 3, &first).unwrap();
        assert_eq!(kept.iter().map(|m| m.epoch).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(warning, None);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{}\n{}\n", lines[0], lines[1])
        );
        // The curves that drew the epochs set aside go with them (the start redraws).
        assert!(!curves.exists());
        let moved = first.get().unwrap().join("curves.png");
        assert_eq!(std::fs::read_to_string(moved).unwrap(), "epochs 1 to 5");
        let first = first.get().unwrap().join("metrics.jsonl");
        let expected = format!("{}\n{}\n{}\n", lines[2], lines[3], lines[4]);
        assert_eq!(std::fs::read_to_string(&first).unwrap(), expected);
        let second = AsideDir::new(dir.path());
        let (kept, _) = read_history(dir.path(), 2, &second).unwrap();
        assert_eq!(kept.len(), 1);
        let second = second.get().unwrap().join("metrics.jsonl");
        assert_ne!(first, second);
        assert_eq!(std::fs::read_to_string(&first).unwrap(), expected);
        assert_eq!(
            std::fs::read_to_string(&second).unwrap(),
            lines[1].clone() + "\n"
        );
    }
}
