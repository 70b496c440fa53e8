//! Copying a rank's output, line by line, to its log (byte for byte), its last lines and the
//! terminal.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Stream {
    Stdout,
    Stderr,
}

/// How long the output threads may go without reading anything, once every rank has ended,
/// before the launcher stops waiting for them: a process that left the rank's group (a
/// helper started with `setsid`) can hold a pipe open for as long as it runs.
const IDLE_AFTER_EXIT: Duration = Duration::from_secs(2);
/// The longest the launcher passes on output that keeps arriving once every rank has ended
/// (a helper a rank left running that prints every second), unless a line is being written
/// to a terminal that does not take it yet.
const OUTPUT_AFTER_EXIT: Duration = Duration::from_secs(10);

/// Copies one output stream of a rank, line by line, to its log as it is, to the launcher's
/// own stream of the same kind (rank 0's bytes as they are, other ranks' lines prefixed) and,
/// as text (bytes that are not UTF-8 replaced, lines over [`crate::lines::MAX_LINE`] cut),
/// to its tail.
pub(super) struct Pump {
    pub(super) rank: usize,
    pub(super) stream: Stream,
    pub(super) echo: bool,
    pub(super) log: Arc<Mutex<Option<File>>>,
    pub(super) tail: Arc<Mutex<VecDeque<String>>>,
    pub(super) tail_lines: usize,
}

/// A running [`Pump`]: its thread, and a count raised before and after each line it passes
/// on (odd while it writes one, which a paused terminal can make last).
pub(super) struct Pumping {
    thread: JoinHandle<()>,
    lines: Arc<AtomicU64>,
}

impl Pump {
    pub(super) fn start(self, from: impl Read + Send + 'static) -> Pumping {
        let lines = Arc::new(AtomicU64::new(0));
        let count = Arc::clone(&lines);
        let thread = std::thread::spawn(move || {
            crate::lines::for_each_line(from, crate::lines::MAX_LINE, |line, newline| {
                count.fetch_add(1, Ordering::SeqCst);
                self.log(line, newline);
                self.show(line, newline);
                count.fetch_add(1, Ordering::SeqCst);
            });
        });
        Pumping { thread, lines }
    }

    /// Writes `line` to the log as the rank printed it: its bytes, its `\n` if it had one.
    fn log(&self, line: &[u8], newline: bool) {
        if let Ok(mut log) = self.log.lock() {
            if let Some(f) = log.as_mut() {
                let _ = f.write_all(line);
                if newline {
                    let _ = f.write_all(b"\n");
                }
            }
        }
    }

    /// Shows `line` on the terminal and keeps it in the tail.
    fn show(&self, line: &[u8], newline: bool) {
        if self.echo {
            // Errors (a closed terminal) must not stop the copying to the log.
            let _ = match self.stream {
                Stream::Stdout => echo(&mut std::io::stdout().lock(), self.rank, line, newline),
                Stream::Stderr => echo(&mut std::io::stderr().lock(), self.rank, line, newline),
            };
        }
        if let Ok(mut tail) = self.tail.lock() {
            if tail.len() == self.tail_lines {
                tail.pop_front();
            }
            if self.tail_lines > 0 {
                tail.push_back(String::from_utf8_lossy(line).into_owned());
            }
        }
    }
}

/// Writes one line (or piece of a line) of rank `rank` to `to`: rank 0's bytes as the rank
/// wrote them, with its `\n` where it had one; another rank's prefixed with `[rank i] `
/// (unless the line names its rank already) and always ended, so that every line on the
/// terminal starts with its rank.
fn echo(to: &mut impl Write, rank: usize, line: &[u8], newline: bool) -> std::io::Result<()> {
    if rank != 0 {
        let prefix = format!("[rank {rank}] ");
        if !line.starts_with(prefix.as_bytes()) {
            to.write_all(prefix.as_bytes())?;
        }
    }
    to.write_all(line)?;
    if newline || rank != 0 {
        to.write_all(b"\n")?;
    }
    to.flush()
}

/// Waits for the output threads of ranks that have all ended to pass on what the ranks
/// wrote: while one is writing a line (a terminal that reads slowly delays the launcher's
/// end, as it delays torchrun's), and while output arrives, until it has been quiet for
/// [`IDLE_AFTER_EXIT`] or has kept coming for [`OUTPUT_AFTER_EXIT`]; then leaves those
/// that still wait for a pipe that a process the ranks left running keeps open. A signal
/// the launcher receives meanwhile ends the wait.
pub(super) fn drain(pumps: Vec<Pumping>) {
    let signals = crate::signals::received_total();
    let signalled = || crate::signals::received_total() != signals;
    drain_within(pumps, IDLE_AFTER_EXIT, OUTPUT_AFTER_EXIT, &signalled);
}

fn drain_within(
    mut pumps: Vec<Pumping>,
    idle: Duration,
    most: Duration,
    signalled: &dyn Fn() -> bool,
) {
    let count =
        |p: &[Pumping]| -> Vec<u64> { p.iter().map(|p| p.lines.load(Ordering::SeqCst)).collect() };
    let mut seen = count(&pumps);
    let started = Instant::now();
    let mut quiet_since = started;
    loop {
        pumps.retain(|p| !p.thread.is_finished());
        if pumps.is_empty() || signalled() {
            return;
        }
        let now = count(&pumps);
        let busy = now.iter().any(|n| n % 2 == 1);
        if busy {
            quiet_since = Instant::now();
        } else if now.len() != seen.len() || now != seen {
            quiet_since = Instant::now();
            if started.elapsed() >= most {
                return;
            }
        } else if quiet_since.elapsed() >= idle {
            return;
        }
        seen = now;
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echoed(rank: usize, pieces: &[(&[u8], bool)]) -> Vec<u8> {
        let mut out = Vec::new();
        for &(line, newline) in pieces {
            echo(&mut out, rank, line, newline).unwrap();
        }
        out
    }

    #[test]
    fn rank_0s_bytes_reach_the_terminal_as_they_are() {
        let pieces: [(&[u8], bool); 3] = [(b"caf\xe9", true), (b"abcd", false), (b"done", false)];
        assert_eq!(echoed(0, &pieces), b"caf\xe9\nabcddone");
    }

    #[test]
    fn other_ranks_lines_are_prefixed_and_ended() {
        let pieces: [(&[u8], bool); 3] = [
            (b"caf\xe9", true),
            (b"[rank 3] named", true),
            (b"cut", false),
        ];
        assert_eq!(
            echoed(3, &pieces),
            b"[rank 3] caf\xe9\n[rank 3] named\n[rank 3] cut\n"
        );
    }

    /// A pump whose source is a pipe written by `feed`; the pipe stays open while `feed`
    /// runs.
    fn pumping(feed: impl FnOnce(std::io::PipeWriter) + Send + 'static) -> Pumping {
        let (reader, writer) = std::io::pipe().unwrap();
        std::thread::spawn(move || feed(writer));
        Pump {
            rank: 1,
            stream: Stream::Stderr,
            echo: false,
            log: Arc::new(Mutex::new(None)),
            tail: Arc::new(Mutex::new(VecDeque::new())),
            tail_lines: 0,
        }
        .start(reader)
    }

    #[test]
    fn drain_waits_for_a_pipe_that_keeps_delivering() {
        // Lines every 20 ms for 1.2 s: longer than the idle limit in all, never idle that
        // long.
        let started = Instant::now();
        let p = pumping(|mut w| {
            for _ in 0..60 {
                let _ = w.write_all(b"x\n");
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let lines = Arc::clone(&p.lines);
        drain_within(
            vec![p],
            Duration::from_secs(1),
            Duration::from_secs(60),
            &|| false,
        );
        assert!(started.elapsed() >= Duration::from_millis(1100));
        assert_eq!(lines.load(Ordering::SeqCst), 120);
    }

    #[test]
    fn drain_leaves_a_pipe_held_open_without_output() {
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let p = pumping(move |mut w| {
            let _ = w.write_all(b"one\n");
            let _ = stop_rx.recv();
        });
        let started = Instant::now();
        drain_within(
            vec![p],
            Duration::from_millis(100),
            Duration::from_secs(60),
            &|| false,
        );
        let waited = started.elapsed();
        drop(stop_tx);
        assert!(waited >= Duration::from_millis(100), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }

    /// Output that keeps coming (a helper a rank left running, printing every 20 ms) is
    /// passed on for at most the limit; a signal ends the wait at once.
    #[test]
    fn drain_ends_output_that_never_stops_and_at_a_signal() {
        let chatty = || {
            pumping(|mut w| {
                while w.write_all(b"tick\n").is_ok() {
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        let started = Instant::now();
        let most = Duration::from_millis(300);
        drain_within(vec![chatty()], Duration::from_secs(1), most, &|| false);
        let waited = started.elapsed();
        assert!(waited >= most, "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        let started = Instant::now();
        let signal_at = started + Duration::from_millis(100);
        let signalled = || Instant::now() >= signal_at;
        let most = Duration::from_secs(60);
        drain_within(vec![chatty()], Duration::from_secs(1), most, &signalled);
        let waited = started.elapsed();
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }
}
