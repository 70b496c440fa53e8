//! What the trainer writes into the run directory: rank 0's end of an epoch
//! (`metrics.jsonl`, `curves.png`, best-model files and what the task saves beside them, the
//! epoch's checkpoint), the history an
//! earlier `metrics.jsonl` leaves, atomic file writes, and every rank's log.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use ddp_model::checkpoint;

use super::{EpochReport, Trainer};
use crate::error::{Context, TrainError};
use crate::report::watched;
use crate::state::{self, Best, TrainState};
use crate::task::Task;

impl<T: Task> Trainer<T> {
    /// Rank 0's end of an epoch: metrics line, curves, best models, checkpoint.
    pub(super) fn finish_epoch(
        &mut self,
        m: &EpochReport,
        summary: &str,
        beside_best: Option<&serde_json::Value>,
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
            let value = watched(m, &monitor.metric, "a best-model monitor")?;
            let previous = self.bests.get(&monitor.file);
            if Best::replaced(previous, value, |new, old| monitor.goal.improves(new, old)) {
                self.bests.insert(
                    monitor.file.clone(),
                    Best {
                        value,
                        epoch: m.epoch,
                    },
                );
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
    /// leaves none of the run's earlier models beside its own.
    fn save_best(
        &self,
        file: &str,
        epoch: u64,
        meta: &std::collections::HashMap<String, String>,
        beside: Option<&serde_json::Value>,
    ) -> Result<(), TrainError> {
        let model = self.out.join(file);
        let doc_path = model.with_extension("json");
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
        if let Some(doc) = beside {
            let mut doc = doc.clone();
            if let Some(fields) = doc.as_object_mut() {
                fields.insert("epoch".into(), epoch.into());
            }
            let text = serde_json::to_string_pretty(&doc)
                .context(|| format!("encoding {}", doc_path.display()))?;
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
    fn draw_curves(&self) {
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
/// start's folder `aside`), and a warning when its last line was cut short.
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
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok((Vec::new(), None));
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
        write_file(&aside.get()?.join("metrics.jsonl"), dropped.as_bytes())?;
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

/// Opens `path` with `options` where it must be a regular file (a rank's log, the run
/// directory's lock): a symbolic link in its place is refused (`O_NOFOLLOW`), and so is a
/// FIFO or a device (`O_NONBLOCK` keeps the open from waiting on a FIFO), so a run folder
/// that others can write to cannot redirect the trainer's writes into another file. The
/// refusal names what is there and says to remove it.
pub(super) fn open_regular(path: &Path, options: &mut OpenOptions) -> std::io::Result<File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let refuse = |what: &str| {
        let e = format!("it is {what}, not a regular file: remove it");
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e)
    };
    let flags = libc::O_NOFOLLOW | libc::O_NONBLOCK;
    let file = match options.custom_flags(flags).open(path) {
        // O_NOFOLLOW's answer where the path's last component is a link.
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(refuse("a symbolic link")),
        opened => opened?,
    };
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        Ok(file)
    } else if kind.is_dir() {
        Err(refuse("a folder"))
    } else if kind.is_fifo() {
        Err(refuse("a FIFO"))
    } else {
        Err(refuse("a device or a socket"))
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
        let file = open_regular(&path, OpenOptions::new().create(true).append(true))
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

    /// A link planted at a rank's log is refused, naming the log, and its target is kept.
    #[test]
    fn a_rank_log_that_is_a_link_is_refused_and_its_target_kept() {
        let dir = ddp_testkit::temp_dir("rank-log-link");
        let (log, victim) = (
            dir.path().join("logs/rank-1.log"),
            dir.path().join("victim"),
        );
        std::fs::create_dir(dir.path().join("logs")).unwrap();
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, &log).unwrap();
        let err = RankLog::open(dir.path(), 1).unwrap_err();
        assert_eq!(
            crate::error::with_causes(&err),
            format!(
                "cannot open {}: it is a symbolic link, not a regular file: remove it",
                log.display()
            )
        );
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        std::fs::remove_file(&log).unwrap();
        let opened = RankLog::open(dir.path(), 1).unwrap();
        opened.file.lock().unwrap().write_all(b"line\n").unwrap();
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "line\n");
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

    /// A rewind keeps the lines of the epochs before it and sets the others aside, with the
    /// checkpoints it sets aside, where they stay as they were (ODIR's tuned thresholds); a
    /// second start's rewind (a second `Trainer::new` of one process) sets its own aside.
    #[test]
    fn the_lines_a_rewind_drops_are_set_aside() {
        let dir = ddp_testkit::temp_dir("history-rewind");
        let path = dir.path().join("metrics.jsonl");
        let lines: Vec<String> = (1..=5).map(line).collect();
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let first = AsideDir::new(dir.path());
        let (kept, warning) = read_history(dir.path(), 3, &first).unwrap();
        assert_eq!(kept.iter().map(|m| m.epoch).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(warning, None);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{}\n{}\n", lines[0], lines[1])
        );
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
