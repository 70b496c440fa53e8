//! Bounds on what strangers can cost: warnings at a bounded rate, so that a flood of connections
//! does not become a flood of log lines (a full disk, or a rank blocked on a full stderr pipe),
//! and counted slots for the handshakes in progress on a listener.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::sync::lock;

/// At most `burst` warnings per period for one kind of event; the count of those dropped
/// goes with the next one logged.
#[derive(Debug)]
pub(crate) struct Throttle {
    period: Duration,
    burst: u32,
    state: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    /// When the current period began (`None` before the first event).
    start: Option<Instant>,
    /// Warnings logged in it.
    logged: u32,
    /// Events dropped since the last warning logged.
    dropped: u64,
}

impl Throttle {
    /// At most `burst` warnings per `period`.
    pub(crate) const fn new(period: Duration, burst: u32) -> Self {
        Self {
            period,
            burst,
            state: Mutex::new(Window {
                start: None,
                logged: 0,
                dropped: 0,
            }),
        }
    }

    /// Counts one event: `Some(n)` when it is to be logged (`n` events were dropped since
    /// the last one logged), `None` when it is to be dropped.
    pub(crate) fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut w = lock(&self.state);
        if w.start
            .is_none_or(|start| now.duration_since(start) >= self.period)
        {
            w.start = Some(now);
            w.logged = 0;
        }
        if w.logged < self.burst {
            w.logged += 1;
            Some(std::mem::take(&mut w.dropped))
        } else {
            w.dropped += 1;
            None
        }
    }
}

/// `" (and N more like it not logged)"`, or nothing for N = 0: the tail of a throttled
/// warning.
pub(crate) fn more(dropped: u64) -> String {
    match dropped {
        0 => String::new(),
        n => format!(" ({n} more like it were not logged)"),
    }
}

/// One of at most `max` handshakes in progress on a listener, counted in `count` until it
/// is dropped, however its handshake ends (a panic included).
pub(crate) struct Pending(Arc<AtomicUsize>);

impl Pending {
    /// A slot, or `None` when `max` are taken.
    pub(crate) fn take(count: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        if count.fetch_add(1, Ordering::SeqCst) >= max {
            count.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Pending(count.clone()))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_per_period_then_the_count_of_the_dropped_ones() {
        let t = Throttle::new(Duration::from_secs(10), 2);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(t.admit_at(at(0)), Some(0));
        assert_eq!(t.admit_at(at(1)), Some(0));
        assert_eq!(t.admit_at(at(2)), None);
        assert_eq!(t.admit_at(at(9)), None);
        assert_eq!(t.admit_at(at(10)), Some(2));
        assert_eq!(t.admit_at(at(11)), Some(0));
        assert_eq!(t.admit_at(at(12)), None);
        assert_eq!(t.admit_at(at(25)), Some(1));
        assert_eq!(more(0), "");
        assert_eq!(more(3), " (3 more like it were not logged)");
    }
}
