//! Copying a rank's output, line by line, to its log (byte for byte), its last lines and the
//! terminal.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Stream {
    Stdout,
    Stderr,
}

/// Copies one output stream of a rank, line by line, to its log as it is, and, as text (bytes
/// that are not UTF-8 replaced, lines over [`crate::lines::MAX_LINE`] cut), to its tail and the
/// launcher's own stream of the same kind.
pub(super) struct Pump {
    pub(super) rank: usize,
    pub(super) stream: Stream,
    pub(super) echo: bool,
    pub(super) log: Arc<Mutex<Option<File>>>,
    pub(super) tail: Arc<Mutex<VecDeque<String>>>,
    pub(super) tail_lines: usize,
}

impl Pump {
    pub(super) fn start(self, from: impl Read + Send + 'static) -> JoinHandle<()> {
        std::thread::spawn(move || {
            crate::lines::for_each_line(from, crate::lines::MAX_LINE, |line, newline| {
                self.log(line, newline);
                self.show(&String::from_utf8_lossy(line));
            });
        })
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
    fn show(&self, line: &str) {
        if self.echo {
            // Rank 0 goes as it is, and so does a line that names its rank already.
            let mut prefix = String::new();
            if self.rank != 0 {
                prefix = format!("[rank {}] ", self.rank);
                if line.starts_with(&prefix) {
                    prefix.clear();
                }
            }
            // Errors (a closed terminal) must not stop the copying to the log.
            let _ = match self.stream {
                Stream::Stdout => writeln!(std::io::stdout().lock(), "{prefix}{line}"),
                Stream::Stderr => writeln!(std::io::stderr().lock(), "{prefix}{line}"),
            };
        }
        if let Ok(mut tail) = self.tail.lock() {
            if tail.len() == self.tail_lines {
                tail.pop_front();
            }
            if self.tail_lines > 0 {
                tail.push_back(line.to_string());
            }
        }
    }
}
