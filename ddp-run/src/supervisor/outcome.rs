//! How ranks and jobs end, and what the launcher tells its caller meanwhile.

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;

/// How a rank's process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this status.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl Exit {
    /// Whether it exited with status 0.
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exited with code {c}"),
            Exit::Signal(s) => match signal_name(*s) {
                Some(name) => write!(f, "was killed by signal {s} ({name})"),
                None => write!(f, "was killed by signal {s}"),
            },
        }
    }
}

/// The name of a common signal, as torchrun shows it (`SIGKILL`).
fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        _ => return None,
    })
}

/// The rank whose failure ended an attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// Its global rank.
    pub rank: usize,
    /// How it ended.
    pub exit: Exit,
    /// The last lines it printed in this attempt (stdout and stderr, in order of arrival), as
    /// text: bytes that are not UTF-8 replaced by U+FFFD, lines over 64 KiB in pieces.
    pub tail: Vec<String>,
    /// Its log file, when the job has a log folder.
    pub log: Option<PathBuf>,
    /// The error it recorded in its error file (`TORCHELASTIC_ERROR_FILE`), if any.
    pub error: Option<String>,
    /// Whether the signal that ended it was the launcher's, sent to stop the attempt (SIGKILL
    /// once the shutdown timeout had passed): it recorded its error before, and an error file
    /// named it the first to fail.
    pub stopped_by_launcher: bool,
}

impl fmt::Display for RankFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} {}", self.rank, self.exit)?;
        match self.exit {
            Exit::Signal(libc::SIGKILL) if self.stopped_by_launcher => write!(
                f,
                ": the launcher's, sent when the rank had not ended by the end of the \
                 attempt's stop (the shutdown timeout, or a second signal)"
            ),
            Exit::Signal(_) if self.stopped_by_launcher => {
                write!(f, ": the launcher's, sent to stop the attempt")
            }
            Exit::Signal(libc::SIGKILL) => {
                write!(f, ": the kernel's OOM killer or a kill -9 (see dmesg)")
            }
            _ => Ok(()),
        }
    }
}

/// The exit code of a rank that stopped on request at a checkpoint it can continue from
/// (75, `EX_TEMPFAIL`: "try again later"), as `ddp-train` does on SIGTERM, SIGUSR1 or its
/// time limit. The launcher does not count it as a failure (no restart, no stopping of the
/// other ranks, which are stopping too); when at least one rank ends so and every other with
/// status 0, the job is [`Outcome::Stopped`] and the launcher exits with this code as well.
/// Defined once here: `ddp-train` re-exports it for the ranks' side.
pub const EXIT_STOPPED: u8 = 75;

/// How a job ended (more kinds may come: match with a wildcard arm).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Every rank exited with status 0, after `restarts` restarts.
    Succeeded {
        /// Restarts it took.
        restarts: u32,
    },
    /// A rank failed and no restart was left.
    Failed {
        /// The rank whose failure came first in the last attempt: the first to exit, unless
        /// the ranks' error files or a crash show that another failed before it.
        failure: RankFailure,
        /// Restarts made before giving up.
        restarts: u32,
    },
    /// The launcher received this signal; the ranks got it too and were stopped.
    Interrupted {
        /// The signal number.
        signal: i32,
        /// Ranks still running when the launcher killed them, the shutdown timeout after the
        /// signal (or at once on a second signal): a stop at a checkpoint cut short.
        killed: Vec<usize>,
        /// Ranks whose own process had ended, as asked or not, while processes it started
        /// in its process group (a wrapper's program, a helper) were still running then, and
        /// were killed.
        leftovers: Vec<usize>,
        /// Whether a second signal, not the shutdown timeout, had them killed.
        second_signal: bool,
        /// Ranks that failed on their own meanwhile: an exit other than 0,
        /// [`EXIT_STOPPED`], or the signal's (killed by it, or exited 128 + it).
        failed: Vec<RankFailure>,
        /// The failure (told as [`Event::RankFailed`]) for which the launcher was stopping the
        /// ranks when the signal came, so that no restart followed; `killed`, `leftovers` and
        /// `second_signal` then tell that stop, which the signal cut short.
        after_failure: Option<RankFailure>,
    },
    /// The ranks stopped on request: at least one exited with [`EXIT_STOPPED`] and every
    /// other with status 0 (a rank with nothing left to do), after the launcher forwarded
    /// `signal` to them or by themselves (at a time limit, say). The job can continue from
    /// its checkpoint when started again.
    Stopped {
        /// The signal the launcher received and forwarded, if any.
        signal: Option<i32>,
        /// Restarts made before.
        restarts: u32,
    },
}

impl Outcome {
    /// The exit status for the launcher's process: 0, 1 after a failure, 128 + the signal
    /// after an interruption (the shell's convention), [`EXIT_STOPPED`] after a stop.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::Succeeded { .. } => 0,
            Outcome::Failed { .. } => 1,
            Outcome::Interrupted { signal, .. } => 128 + signal,
            Outcome::Stopped { .. } => i32::from(EXIT_STOPPED),
        }
    }
}

/// What the launcher is doing, for the caller to show (more kinds may come: match with a
/// wildcard arm).
#[derive(Debug)]
#[non_exhaustive]
pub enum Event<'a> {
    /// An attempt is about to start its ranks.
    Starting {
        /// 0 for the first attempt, then the number of restarts so far.
        attempt: u32,
        /// The global ranks started on this node.
        ranks: Range<usize>,
        /// Ranks in the job.
        world_size: usize,
        /// Where the ranks meet.
        master_addr: &'a str,
        /// The port where they meet in this attempt.
        master_port: u16,
        /// `OMP_NUM_THREADS` of each rank, if the launcher sets it.
        omp_num_threads: Option<&'a str>,
    },
    /// A rank failed; the others of its attempt have been stopped.
    RankFailed(&'a RankFailure),
    /// The whole group is restarting.
    Restarting {
        /// This restart's number, from 1.
        restart: u32,
        /// The most restarts.
        max_restarts: u32,
    },
    /// Something the launcher could not do, and what it does instead.
    Warning(&'a str),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_read_as_torchrun_reports_them() {
        assert_eq!(Exit::Code(17).to_string(), "exited with code 17");
        assert_eq!(
            Exit::Signal(15).to_string(),
            "was killed by signal 15 (SIGTERM)"
        );
        assert_eq!(Exit::Signal(64).to_string(), "was killed by signal 64");
        let killed = RankFailure {
            rank: 5,
            exit: Exit::Signal(9),
            tail: vec![],
            log: None,
            error: None,
            stopped_by_launcher: false,
        };
        assert_eq!(
            killed.to_string(),
            "rank 5 was killed by signal 9 (SIGKILL): the kernel's OOM killer or a kill -9 \
             (see dmesg)"
        );
        let late = RankFailure {
            stopped_by_launcher: true,
            ..killed.clone()
        };
        assert_eq!(
            late.to_string(),
            "rank 5 was killed by signal 9 (SIGKILL): the launcher's, sent when the rank had \
             not ended by the end of the attempt's stop (the shutdown timeout, or a second \
             signal)"
        );
        let stopped = RankFailure {
            exit: Exit::Signal(15),
            ..late
        };
        assert_eq!(
            stopped.to_string(),
            "rank 5 was killed by signal 15 (SIGTERM): the launcher's, sent to stop the attempt"
        );
        assert!(Exit::Code(0).success());
        assert!(!Exit::Signal(15).success());
        let failure = RankFailure {
            rank: 3,
            exit: Exit::Code(2),
            tail: vec![],
            log: None,
            error: None,
            stopped_by_launcher: false,
        };
        assert_eq!(failure.to_string(), "rank 3 exited with code 2");
    }

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(Outcome::Succeeded { restarts: 2 }.exit_code(), 0);
        let interrupted = Outcome::Interrupted {
            signal: 15,
            killed: vec![0, 1],
            leftovers: vec![],
            second_signal: false,
            failed: vec![],
            after_failure: None,
        };
        assert_eq!(interrupted.exit_code(), 143);
        let stopped = Outcome::Stopped {
            signal: Some(15),
            restarts: 0,
        };
        assert_eq!(stopped.exit_code(), 75);
        let failure = RankFailure {
            rank: 0,
            exit: Exit::Signal(9),
            tail: vec![],
            log: None,
            error: None,
            stopped_by_launcher: false,
        };
        assert_eq!(
            Outcome::Failed {
                failure,
                restarts: 0
            }
            .exit_code(),
            1
        );
    }
}
