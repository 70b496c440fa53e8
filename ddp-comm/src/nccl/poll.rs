//! How a host thread waits for something NCCL or the device finishes on its own: it yields
//! its core, without sleeping, for the first [`SPIN`], then sleeps, doubling from
//! [`FIRST_SLEEP`] to [`LONGEST_SLEEP`]. A non-blocking communicator enqueues each collective
//! on a thread NCCL starts for it, which is done within tens of microseconds; a sleep that
//! short lasts about 50 µs more on Linux (the timer slack), so sleeping from the start would
//! add that to every bucket DDP launches. Waits that last longer (a collective behind a
//! step's compute) cost a poll per millisecond.

use std::time::{Duration, Instant};

/// How long a wait only yields.
pub(crate) const SPIN: Duration = Duration::from_micros(200);
/// The first sleep after it.
pub(crate) const FIRST_SLEEP: Duration = Duration::from_micros(20);
/// The longest sleep.
pub(crate) const LONGEST_SLEEP: Duration = Duration::from_millis(1);

/// What a waiting thread does before its next poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pause {
    /// Gives its core to another thread and polls again at once.
    Yield,
    /// Sleeps this long.
    Sleep(Duration),
}

/// One wait's schedule of pauses between polls.
#[derive(Debug)]
pub(crate) struct Poll {
    started: Instant,
    next_sleep: Duration,
}

impl Poll {
    /// A wait starting now.
    pub(crate) fn new() -> Self {
        Self {
            started: Instant::now(),
            next_sleep: FIRST_SLEEP,
        }
    }

    /// The pause before the next poll, `waited` into the wait.
    pub(crate) fn next(&mut self, waited: Duration) -> Pause {
        if waited < SPIN {
            return Pause::Yield;
        }
        let sleep = self.next_sleep;
        self.next_sleep = (sleep * 2).min(LONGEST_SLEEP);
        Pause::Sleep(sleep)
    }

    /// Pauses before the next poll.
    pub(crate) fn pause(&mut self) {
        match self.next(self.started.elapsed()) {
            Pause::Yield => std::thread::yield_now(),
            Pause::Sleep(d) => std::thread::sleep(d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_yields_first_then_sleeps_doubling_to_a_millisecond() {
        let mut poll = Poll::new();
        let us = Duration::from_micros;
        assert_eq!(poll.next(us(0)), Pause::Yield);
        assert_eq!(poll.next(us(199)), Pause::Yield);
        let sleeps: Vec<Pause> = (0..9).map(|_| poll.next(us(200))).collect();
        let want: Vec<Pause> = [20, 40, 80, 160, 320, 640, 1000, 1000, 1000]
            .into_iter()
            .map(|n| Pause::Sleep(us(n)))
            .collect();
        assert_eq!(sleeps, want);
    }
}
