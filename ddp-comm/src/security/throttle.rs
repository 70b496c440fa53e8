//! Bounds on what strangers can cost: warnings at a bounded rate, so that a flood of connections
//! does not become a flood of log lines (a full disk, or a rank blocked on a full stderr pipe),
//! and slots for the handshakes in progress on a listener, the oldest closed to make room.

use std::collections::VecDeque;
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

/// What ends a connection's handshake early: shuts its socket down, so that the thread
/// judging it fails at once.
pub(crate) type Closer = Box<dyn FnOnce() + Send>;

/// The [`Closer`] of a handle to a connection's socket (a clone of the stream, or an `Arc`
/// of it) and its `shutdown`.
pub(crate) fn closer<S: Send + 'static>(
    handle: S,
    shutdown: fn(&S, std::net::Shutdown) -> std::io::Result<()>,
) -> Closer {
    Box::new(move || {
        let _ = shutdown(&handle, std::net::Shutdown::Both);
    })
}

/// The handshakes in progress on one listener, at most `max`. A connection beyond them
/// closes the oldest one, whose deadline would otherwise hold its slot for seconds: strangers
/// who connect and stay silent cannot keep the job's own ranks out, since a rank proves the
/// secret within a round trip, and a stranger would have to connect `max` times within it
/// to close it. A closed handshake keeps its slot until its thread lets go; with `max` such
/// as well, a newcomer is refused (and connects again).
pub(crate) struct Handshakes {
    max: usize,
    state: Mutex<InProgress>,
}

#[derive(Default)]
struct InProgress {
    /// The next slot's number.
    next: u64,
    /// The handshakes that may still be closed, oldest first.
    open: VecDeque<(u64, Closer)>,
    /// Slots held: those in `open`, and closed or finished ones whose thread has not let go.
    held: usize,
}

/// What [`Handshakes::admit`] did to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Room {
    /// A slot was free.
    Free,
    /// The oldest handshake was closed.
    ClosedOldest,
}

impl Handshakes {
    /// At most `max` handshakes in progress.
    pub(crate) fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max,
            state: Mutex::new(InProgress::default()),
        })
    }

    /// A slot for a new connection, which `close` ends early if the slot is needed before
    /// the handshake is done; `None` when even closing the oldest would leave more than
    /// `2 * max` slots held.
    pub(crate) fn admit(self: &Arc<Self>, close: Closer) -> Option<(Slot, Room)> {
        let mut state = lock(&self.state);
        if state.held >= 2 * self.max {
            return None;
        }
        let mut room = Room::Free;
        if state.open.len() >= self.max {
            if let Some((_, oldest)) = state.open.pop_front() {
                oldest();
                room = Room::ClosedOldest;
            }
        }
        let id = state.next;
        state.next += 1;
        state.open.push_back((id, close));
        state.held += 1;
        Some((
            Slot {
                pool: self.clone(),
                id,
            },
            room,
        ))
    }
}

impl Handshakes {
    /// Takes slot `id` off the handshakes that may be closed.
    fn forget(&self, state: &mut InProgress, id: u64) {
        if let Some(at) = state.open.iter().position(|(open, _)| *open == id) {
            state.open.remove(at);
        }
    }
}

/// A connection's place among the handshakes in progress, held until it is dropped however
/// its handshake ends (a panic included).
pub(crate) struct Slot {
    pool: Arc<Handshakes>,
    id: u64,
}

impl Slot {
    /// The handshake succeeded: the connection can no longer be closed to make room.
    pub(crate) fn proven(&self) {
        self.pool.forget(&mut lock(&self.pool.state), self.id);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut state = lock(&self.pool.state);
        self.pool.forget(&mut state, self.id);
        state.held -= 1;
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

    /// Connection `n`'s closer, which records `n` in `closed`.
    fn closer(closed: &Arc<Mutex<Vec<u32>>>, n: u32) -> Closer {
        let closed = closed.clone();
        Box::new(move || closed.lock().unwrap().push(n))
    }

    #[test]
    fn a_handshake_beyond_the_limit_closes_the_oldest_still_unproven() {
        let closed = Arc::new(Mutex::new(Vec::new()));
        let pool = Handshakes::new(2);
        let (a, room) = pool.admit(closer(&closed, 0)).unwrap();
        assert_eq!(room, Room::Free);
        let (b, _) = pool.admit(closer(&closed, 1)).unwrap();
        // Connection 0 has proven the secret: 1 is the oldest that can be closed.
        a.proven();
        let (c, room) = pool.admit(closer(&closed, 2)).unwrap();
        assert_eq!((room, closed.lock().unwrap().clone()), (Room::Free, vec![]));
        let (d, room) = pool.admit(closer(&closed, 3)).unwrap();
        assert_eq!(
            (room, closed.lock().unwrap().clone()),
            (Room::ClosedOldest, vec![1])
        );
        // Four slots are held (0 proven, 1 closed, 2 and 3 in progress): the most, twice
        // the limit, until a thread lets go of its slot.
        assert!(pool.admit(closer(&closed, 4)).is_none());
        drop(b);
        let (_e, room) = pool.admit(closer(&closed, 5)).unwrap();
        assert_eq!(
            (room, closed.lock().unwrap().clone()),
            (Room::ClosedOldest, vec![1, 2])
        );
        // A slot dropped in its handshake is no longer closed for room.
        drop(d);
        drop((a, c));
        let (_f, room) = pool.admit(closer(&closed, 6)).unwrap();
        assert_eq!(
            (room, closed.lock().unwrap().clone()),
            (Room::Free, vec![1, 2])
        );
    }
}
