//! Rank 0's progress through an epoch: an indicatif bar on a terminal, log lines otherwise.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

use super::RankLog;

/// Rank 0's progress: a bar when stderr (where indicatif draws) is a terminal, a log line
/// every tenth of the epoch otherwise. While the bar is up, the rank's log lines suspend it.
pub(super) struct Progress {
    bar: Option<ProgressBar>,
    plain: bool,
    epoch: u64,
    epochs: u64,
    steps: usize,
}

impl Progress {
    pub(super) fn new(show: bool, epoch: u64, epochs: u64, steps: usize, log: &RankLog) -> Self {
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
            log.set_bar(Some(bar.clone()));
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

    pub(super) fn step(&self, step: usize, loss: f64, rate: f64, log: &RankLog) {
        if let Some(bar) = &self.bar {
            bar.set_position(step as u64);
            bar.set_message(format!("loss {loss:.4}  {rate:.1} samples/s"));
        } else if self.plain
            && (step * 10 / self.steps.max(1) != (step - 1) * 10 / self.steps.max(1))
        {
            log.say(&format!(
                "epoch {}/{} step {step}/{}  loss {loss:.4}  {rate:.1} samples/s",
                self.epoch, self.epochs, self.steps
            ));
        }
    }

    pub(super) fn finish(&self, log: &RankLog) {
        if let Some(bar) = &self.bar {
            log.set_bar(None);
            bar.finish_and_clear();
        }
    }
}
