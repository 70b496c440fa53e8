//! Ending an attempt: a signal to every rank's process group, the time to end, SIGKILL to
//! what is left (at once on a second signal), and the wait for what SIGKILL ended to be gone.

use std::time::{Duration, Instant};

use super::group::{self, kill_group};
use super::{reap, Attempt, Event, Rank};
use crate::signals::{received_count, received_other_than};
use crate::LaunchError;

/// How long after the signal that began a stop a repeat of the same signal is taken for the
/// same request delivered again (SLURM may send SIGTERM twice within milliseconds, bash sends
/// SIGHUP to its jobs after the terminal's), not for a second signal that kills the ranks at
/// once.
const REPEAT_WINDOW: Duration = Duration::from_secs(1);

/// The longest a stop waits, after SIGKILL, for the processes it killed in the ranks' groups
/// to be gone: one in uninterruptible sleep (a GPU driver's call, a hung NFS mount) dies only
/// once the call returns.
const GONE_AFTER_KILL: Duration = Duration::from_secs(5);

/// Why an attempt is stopped.
#[derive(Debug, Clone, Copy)]
pub(super) enum Cause {
    /// The launcher received this signal, which the ranks get; its repeats within
    /// [`REPEAT_WINDOW`] are not a second signal.
    Signal(i32),
    /// A rank failed, or the launcher did: the ranks get SIGTERM, and any watched signal that
    /// arrives meanwhile is a second one.
    Launcher,
}

impl Cause {
    /// The signal the ranks get.
    fn signal(self) -> i32 {
        match self {
            Cause::Signal(signal) => signal,
            Cause::Launcher => libc::SIGTERM,
        }
    }
}

/// What [`stop`] killed: ranks whose own process still ran, and ranks whose process had
/// exited with processes left running in its group; whether a second signal, not the
/// timeout, had them killed.
pub(super) struct Stopped {
    pub(super) killed: Vec<usize>,
    pub(super) leftovers: Vec<usize>,
    pub(super) second_signal: bool,
    /// Ranks whose group still had processes running [`GONE_AFTER_KILL`] after SIGKILL: the
    /// rank, its group and how many.
    lingering: Vec<(usize, u32, usize)>,
}

impl Attempt<'_> {
    /// [`stop`], telling `on_event` of the processes that outlived SIGKILL.
    pub(super) fn stop(
        &self,
        ranks: &mut [Rank],
        cause: Cause,
        on_event: &mut dyn FnMut(&Event<'_>),
    ) -> Result<Stopped, LaunchError> {
        let stopped = stop(ranks, cause, self.config.shutdown_timeout)?;
        for &(rank, group, left) in &stopped.lingering {
            on_event(&Event::Warning(&lingering(rank, group, left)));
        }
        Ok(stopped)
    }
}

/// The warning for rank `rank`'s group `group`, where `left` processes outlived SIGKILL.
fn lingering(rank: usize, group: u32, left: usize) -> String {
    format!(
        "{left} process(es) of rank {rank}'s process group {group} still ran {} s after \
         SIGKILL, stuck in the kernel (a GPU driver's call, a hung NFS mount: see `ps -o \
         pid,stat,wchan,cmd -g {group}`); going on without waiting for them, though they may \
         still hold the rank's GPU memory or port",
        GONE_AFTER_KILL.as_secs()
    )
}

/// Ends an attempt: the signal of `cause` to every rank's process group, then SIGCONT (a
/// stopped rank, SIGSTOP or a debugger's, acts on the signal only once continued, as a
/// shell's `kill` does for stopped jobs), SIGKILL to what is left after `timeout` (or at once
/// when every rank's process has exited and nothing but zombies is left in its group, a
/// wrapper's program included, or when a second signal arrives meanwhile: a second Ctrl-C
/// escalates, a repeat of the first within [`REPEAT_WINDOW`] does not), then reaps the ranks,
/// lets their output threads finish and waits (at most [`GONE_AFTER_KILL`]) for what SIGKILL
/// ended to be gone. A group whose rank exited on a signal that background jobs ignore gets
/// SIGTERM, as torchrun's stop sends, for the helpers left in it.
///
/// A rank that is no longer this process's child (something else reaped it) ends the stop
/// with [`LaunchError::Wait`], once every rank is stopped.
pub(super) fn stop(
    ranks: &mut [Rank],
    cause: Cause,
    timeout: Duration,
) -> Result<Stopped, LaunchError> {
    let signal = cause.signal();
    let mut second = SecondSignal::new(cause);
    for r in ranks.iter() {
        kill_group(r.child.id(), signal);
        kill_group(r.child.id(), libc::SIGCONT);
    }
    // (No deadline where it would not fit in an `Instant`: `validate` bounds the timeout.)
    let deadline = Instant::now().checked_add(timeout);
    // Each rank's processes left running in its group, once its own process has exited.
    let mut left: Vec<Option<usize>> = vec![None; ranks.len()];
    let escalated = loop {
        for (r, left) in ranks.iter_mut().zip(left.iter_mut()) {
            if *left == Some(0) || !r.exited() {
                continue;
            }
            let running = group::running(r.child.id());
            if running > 0 && left.is_none() && group::IGNORED_IN_BACKGROUND.contains(&signal) {
                kill_group(r.child.id(), libc::SIGTERM);
            }
            *left = Some(running);
        }
        let again = second.arrived();
        let late = deadline.is_some_and(|d| Instant::now() >= d);
        let all_ended = left.iter().all(|&l| l == Some(0));
        if all_ended || late || again {
            // A second signal in the poll in which the last rank ended killed nothing.
            break again && !late && !all_ended;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let with = |f: fn(Option<usize>) -> bool| {
        let ranks = ranks.iter().zip(&left).filter(move |(_, &l)| f(l));
        ranks.map(|(r, _)| r.rank).collect::<Vec<_>>()
    };
    let killed = with(|l| l.is_none());
    let leftovers = with(|l| l.is_some_and(|n| n > 0));
    // Rank processes still running, and whatever the ranks started in their groups (a group
    // once empty is not signalled: its number may be another's now).
    let groups: Vec<(usize, u32)> = ranks
        .iter()
        .zip(&left)
        .filter(|(_, &l)| l != Some(0))
        .map(|(r, _)| (r.rank, r.child.id()))
        .collect();
    for &(_, group) in &groups {
        kill_group(group, libc::SIGKILL);
    }
    reap(ranks);
    // A restart must not find the port or the GPU memory still held by what was killed.
    let pgids: Vec<u32> = groups.iter().map(|&(_, g)| g).collect();
    let lingering = group::left_after(&pgids, GONE_AFTER_KILL)
        .into_iter()
        .filter_map(|(g, n)| Some((groups.iter().find(|&&(_, p)| p == g)?.0, g, n)))
        .collect();
    if let Some(r) = ranks.iter_mut().find(|r| r.lost.is_some()) {
        if let Some(source) = r.lost.take() {
            return Err(LaunchError::Wait {
                rank: r.rank,
                pid: r.child.id(),
                source,
            });
        }
    }
    Ok(Stopped {
        killed,
        leftovers,
        second_signal: escalated,
        lingering,
    })
}

/// Whether a signal that asks to kill the ranks at once has arrived during a stop: any
/// watched signal, but for repeats of the one that began the stop within [`REPEAT_WINDOW`].
struct SecondSignal {
    /// The signal that began the stop and how often it had arrived at the last look.
    first: Option<(i32, u64)>,
    /// How often the other watched signals had arrived when the stop began.
    others: u64,
    began: Instant,
    /// When [`SecondSignal::arrived`] last looked.
    polled: Instant,
}

impl SecondSignal {
    fn new(cause: Cause) -> Self {
        let first = match cause {
            Cause::Signal(signal) => Some((signal, received_count(signal))),
            Cause::Launcher => None,
        };
        let began = Instant::now();
        Self {
            first,
            others: received_other_than(first.map_or(0, |(s, _)| s)),
            began,
            polled: began,
        }
    }

    fn arrived(&mut self) -> bool {
        let first = self.first.map_or(0, |(s, _)| s);
        if received_other_than(first) != self.others {
            return true;
        }
        let Some((signal, seen)) = &mut self.first else {
            return false;
        };
        // The repeat arrived after the previous poll: within the window if that poll was (a
        // loaded machine's polls may lag the signal).
        let previous = std::mem::replace(&mut self.polled, Instant::now());
        let now = received_count(*signal);
        if now != *seen {
            if previous.duration_since(self.began) >= REPEAT_WINDOW {
                return true;
            }
            // The same request delivered again: from now on, only a later repeat counts.
            *seen = now;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::os::unix::process::CommandExt;
    use std::process::Command;
    use std::sync::{Arc, Mutex};

    /// A rank that something else in the launcher's process reaped (a `waitpid(-1)`, a
    /// SIGCHLD ignored): the stop ends with the error, instead of waiting out the shutdown
    /// timeout for an exit that waitid can no longer see.
    #[test]
    fn a_rank_reaped_behind_the_launchers_back_ends_the_stop_with_an_error() {
        let child = Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = child.id();
        // SAFETY: kill(2) and waitpid(2) on this test's own child, into a local status.
        unsafe {
            assert_eq!(libc::kill(pid as libc::pid_t, libc::SIGKILL), 0);
            let mut status = 0;
            assert_eq!(
                libc::waitpid(pid as libc::pid_t, &mut status, 0),
                pid as i32
            );
        }
        let mut ranks = [Rank {
            rank: 3,
            child,
            exit: None,
            lost: None,
            exited: Arc::new(Mutex::new(None)),
            exited_at: None,
            error_file: None,
            waiter: None,
            tail: Arc::new(Mutex::new(VecDeque::new())),
            pumps: Vec::new(),
            log: None,
        }];
        match stop(&mut ranks, Cause::Launcher, Duration::from_secs(60)) {
            Err(LaunchError::Wait {
                rank: 3,
                pid: p,
                source,
            }) => {
                assert_eq!((p, source.raw_os_error()), (pid, Some(libc::ECHILD)));
            }
            Err(other) => panic!("expected the rank's wait error, got {other}"),
            Ok(s) => panic!("expected the rank's wait error, got killed {:?}", s.killed),
        }
    }
}
