//! Heartbeats through the rendezvous store, and the diagnosis a rank makes when a
//! collective times out: which rank is hung, and how.
//!
//! A collective that times out only tells a rank which ring neighbour it was waiting on,
//! and with three or more ranks that is often not the rank that stopped: if rank 1 of 3
//! stops, rank 0 waits on rank 2, which waits on rank 1. So every rank of a group larger
//! than one runs a thread that writes `hb/<rank>` to the store every *interval*
//! (`op_timeout / 20`, clamped to 100 ms ..= 1 s): a beat number, the number of
//! collectives this rank has entered, its interval, and its state (running, failed,
//! closed). The thread has its own store connection, so it never waits for the group's.
//!
//! When a collective times out, the rank marks itself failed, reads every rank's
//! heartbeat, and reads again each interval for up to three intervals (at least 500 ms),
//! stopping early once every rank has beaten. A rank whose beat did not advance is not
//! responding (stopped, frozen, or its host unreachable); a rank that beats but entered
//! fewer collectives than this rank is behind (alive, but stuck outside the collectives).
//! Ranks that failed too are left out: they are waiting like this one. A store that does
//! not answer within its I/O timeout (`5 * interval`, at least 1 s) is reported as such,
//! and when rank 0 serves it, rank 0 is named. So a timed-out collective returns after
//! `op_timeout` plus at most about `3 * interval` (or the store's I/O timeout).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{CommError, Diagnosis};
use crate::security::auth;
use crate::store::Store;
use crate::sync::lock;

/// Opens a new connection to the rendezvous store (the heartbeat's own).
pub(crate) type Connector = Box<dyn Fn() -> Result<Box<dyn Store>, CommError> + Send + Sync>;

/// Where the store is, for messages.
#[derive(Clone, Debug)]
pub(crate) struct StoreInfo {
    /// Its address.
    pub addr: String,
    /// Whether rank 0 serves it in-process (otherwise torchrun's agent does).
    pub served_by_rank0: bool,
}

const MIN_INTERVAL: Duration = Duration::from_millis(100);
const MAX_INTERVAL: Duration = Duration::from_secs(1);
/// The shortest time a diagnosis watches the heartbeats.
const MIN_WINDOW: Duration = Duration::from_millis(500);
/// The longest time dropping a group waits for its heartbeat thread's last write.
const DROP_WAIT: Duration = Duration::from_millis(200);

/// The heartbeat interval for a collective timeout: a twentieth of it, from 100 ms to 1 s;
/// but for tests that set it apart from their timeout, `DDP_COMM_TEST_HEARTBEAT_MS` (see
/// [`auth::injected`]): a short timeout with a busy machine's margin (a rank stuck outside the
/// collectives), or a short linger after a failure (`ddp-train/tests/freeze.rs`).
pub(crate) fn interval_for(op_timeout: Duration) -> Duration {
    auth::injected("DDP_COMM_TEST_HEARTBEAT_MS")
        .unwrap_or_else(|| (op_timeout / 20).clamp(MIN_INTERVAL, MAX_INTERVAL))
}

/// How long one store request of the heartbeat or the diagnosis may take.
pub(crate) fn store_timeout(interval: Duration) -> Duration {
    (interval * 5).max(Duration::from_secs(1))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Running,
    Failed,
    Closed,
}

/// One rank's heartbeat as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Beat {
    beat: u64,
    entered: u64,
    interval_ms: u64,
    state: State,
}

impl Beat {
    fn encode(&self) -> Vec<u8> {
        let state = match self.state {
            State::Running => "running",
            State::Failed => "failed",
            State::Closed => "closed",
        };
        format!(
            "{} {} {} {state}",
            self.beat, self.entered, self.interval_ms
        )
        .into_bytes()
    }

    fn decode(bytes: &[u8]) -> Option<Beat> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut words = text.split(' ');
        let mut number = || words.next()?.parse::<u64>().ok();
        let (beat, entered, interval_ms) = (number()?, number()?, number()?);
        let state = match words.next()? {
            "running" => State::Running,
            "failed" => State::Failed,
            "closed" => State::Closed,
            _ => return None,
        };
        Some(Beat {
            beat,
            entered,
            interval_ms,
            state,
        })
    }
}

fn key(rank: usize) -> String {
    format!("hb/{rank}")
}

/// What the group and its heartbeat thread share.
#[derive(Debug, Default)]
struct Shared {
    entered: AtomicU64,
    failed: AtomicBool,
    stop: Mutex<bool>,
    wake: Condvar,
}

/// A rank's collective counter, its heartbeat thread, and the diagnosis.
pub(crate) struct Heartbeat {
    rank: usize,
    world: usize,
    interval: Duration,
    shared: Arc<Shared>,
    connector: Option<Arc<Connector>>,
    probe: Mutex<Option<Box<dyn Store>>>,
    store: Option<StoreInfo>,
    /// Why there is no heartbeat thread (world of one, or it could not start).
    missing: Option<String>,
    finished: Option<Mutex<mpsc::Receiver<()>>>,
}

impl std::fmt::Debug for Heartbeat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heartbeat")
            .field("rank", &self.rank)
            .field("interval", &self.interval)
            .field("store", &self.store)
            .field("missing", &self.missing)
            .finish_non_exhaustive()
    }
}

impl Heartbeat {
    /// A counter without a heartbeat thread (world of one, or no store); `why` says why.
    pub(crate) fn without_thread(rank: usize, world: usize, why: impl Into<String>) -> Self {
        Heartbeat {
            rank,
            world,
            interval: MIN_INTERVAL,
            shared: Arc::default(),
            connector: None,
            probe: Mutex::new(None),
            store: None,
            missing: Some(why.into()),
            finished: None,
        }
    }

    /// Starts the heartbeat thread of `rank`, which connects through `connect`.
    pub(crate) fn start(
        rank: usize,
        world: usize,
        op_timeout: Duration,
        store: StoreInfo,
        connect: Connector,
    ) -> Self {
        let interval = interval_for(op_timeout);
        let shared = Arc::<Shared>::default();
        let connector = Arc::new(connect);
        let (done, finished) = mpsc::channel();
        let spawned = {
            let (shared, connector) = (shared.clone(), connector.clone());
            std::thread::Builder::new()
                .name("ddp-heartbeat".into())
                .spawn(move || {
                    beat_loop(rank, interval, &shared, &connector);
                    let _ = done.send(());
                })
        };
        let missing = spawned
            .err()
            .map(|e| format!("the heartbeat thread could not start: {e}"));
        Heartbeat {
            rank,
            world,
            interval,
            shared,
            connector: Some(connector),
            probe: Mutex::new(None),
            store: Some(store),
            finished: missing.is_none().then(|| Mutex::new(finished)),
            missing,
        }
    }

    /// Counts one collective entered (once per public call).
    pub(crate) fn enter(&self) {
        self.shared.entered.fetch_add(1, Ordering::Relaxed);
    }

    /// Collectives entered so far.
    pub(crate) fn entered(&self) -> u64 {
        self.shared.entered.load(Ordering::Relaxed)
    }

    /// Marks this rank failed: its next beats say so, and the others' diagnoses do not
    /// take it for hung.
    pub(crate) fn mark_failed(&self) {
        self.shared.failed.store(true, Ordering::SeqCst);
    }

    /// How long rank 0 keeps its store up after this rank failed, so that ranks still
    /// diagnosing their own timeouts can read the heartbeats: one diagnosis window.
    pub(crate) fn linger(&self) -> Option<Duration> {
        let failed = self.shared.failed.load(Ordering::SeqCst);
        (failed && self.finished.is_some()).then(|| (self.interval * 3).max(MIN_WINDOW))
    }

    /// Adds the diagnosis to a timeout; other errors pass unchanged.
    pub(crate) fn explain(&self, err: CommError) -> CommError {
        match err {
            CommError::Timeout {
                op, timeout, peers, ..
            } => CommError::Timeout {
                op,
                timeout,
                peers,
                diagnosis: Box::new(self.diagnose()),
            },
            other => other,
        }
    }

    /// Watches the heartbeats of every other rank (see the module's documentation). Marks
    /// this rank failed first, so that the others do not take it for hung.
    pub(crate) fn diagnose(&self) -> Diagnosis {
        self.mark_failed();
        let me = self.entered();
        let mut found = Diagnosis {
            this_collective: me,
            ..Diagnosis::default()
        };
        if self.world == 1 {
            return found;
        }
        let (Some(connector), Some(store)) = (&self.connector, &self.store) else {
            found.unavailable = self.missing.clone();
            return found;
        };
        let mut probe = lock(&self.probe);
        let silent = |found: &mut Diagnosis, e: CommError| {
            let rank0 = if store.served_by_rank0 {
                " (rank 0 serves it)"
            } else {
                ""
            };
            // A store that hung up means rank 0 exited (it may have failed too); one that
            // does not answer in time means rank 0 is frozen.
            if store.served_by_rank0
                && self.rank != 0
                && !matches!(e, CommError::StoreClosed { .. })
            {
                found.not_responding.push(0);
            }
            found.store_silent = Some(format!(
                "the rendezvous store at {}{rank0} did not answer: {}",
                store.addr,
                crate::error::with_causes(&e)
            ));
        };
        if probe.is_none() {
            match connector() {
                Ok(s) => *probe = Some(s),
                Err(e) => {
                    silent(&mut found, e);
                    return found;
                }
            }
        }
        let Some(conn) = probe.as_mut() else {
            return found;
        };
        let own = Beat {
            beat: u64::MAX,
            entered: me,
            interval_ms: self.interval.as_millis() as u64,
            state: State::Failed,
        };
        let first = conn
            .set(&key(self.rank), &own.encode())
            .and_then(|()| self.read_all(conn.as_mut()));
        let first = match first {
            Ok(beats) => beats,
            Err(e) => {
                *probe = None;
                silent(&mut found, e);
                return found;
            }
        };
        let longest = first
            .iter()
            .flatten()
            .map(|b| Duration::from_millis(b.interval_ms))
            .fold(self.interval, Duration::max)
            .min(MAX_INTERVAL);
        let window = (longest * 3).max(MIN_WINDOW);
        let start = Instant::now();
        let mut last = first.clone();
        let settled = |first: &[Option<Beat>], last: &[Option<Beat>]| {
            let moved = |(a, b): (&Option<Beat>, &Option<Beat>)| match b {
                Some(b) => b.state != State::Running || a.map(|a| a.beat) != Some(b.beat),
                None => false,
            };
            first
                .iter()
                .zip(last)
                .enumerate()
                .all(|(r, pair)| r == self.rank || moved(pair))
        };
        while !settled(&first, &last) && start.elapsed() < window {
            std::thread::sleep(self.interval.min(window.saturating_sub(start.elapsed())));
            match self.read_all(conn.as_mut()) {
                Ok(beats) => last = beats,
                Err(e) => {
                    *probe = None;
                    silent(&mut found, e);
                    return found;
                }
            }
        }
        for (r, (a, b)) in first.iter().zip(&last).enumerate() {
            if r == self.rank {
                continue;
            }
            // No beat at all: never started, or stopped before its first beat.
            let Some(b) = b else {
                found.not_responding.push(r);
                continue;
            };
            // Failed too (waiting like this rank) or gone: not the one to blame.
            if b.state != State::Running {
                continue;
            }
            if a.map(|a| a.beat) == Some(b.beat) {
                found.not_responding.push(r);
            } else if b.entered < me {
                found.behind.push((r, b.entered));
            }
        }
        found
    }

    /// Every rank's heartbeat (`None`: not written yet, or unreadable).
    fn read_all(&self, store: &mut dyn Store) -> Result<Vec<Option<Beat>>, CommError> {
        let mut beats = Vec::with_capacity(self.world);
        for r in 0..self.world {
            if r == self.rank {
                beats.push(None);
                continue;
            }
            beats.push(store.get(&key(r))?.as_deref().and_then(Beat::decode));
        }
        Ok(beats)
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        *lock(&self.shared.stop) = true;
        self.shared.wake.notify_all();
        // The thread writes a last `closed` beat; a frozen store must not hold up the drop,
        // so wait briefly and let the thread finish on its own otherwise.
        if let Some(finished) = &self.finished {
            let _ = lock(finished).recv_timeout(DROP_WAIT);
        }
    }
}

/// The heartbeat thread: a beat every `interval` until stopped, then a `closed` beat.
/// Store errors drop the connection; the next beat reconnects.
fn beat_loop(rank: usize, interval: Duration, shared: &Shared, connector: &Connector) {
    let mut conn: Option<Box<dyn Store>> = None;
    let mut warned = false;
    let key = key(rank);
    for beat in 0u64.. {
        let stopping = *lock(&shared.stop);
        let state = if stopping {
            State::Closed
        } else if shared.failed.load(Ordering::SeqCst) {
            State::Failed
        } else {
            State::Running
        };
        let value = Beat {
            beat,
            entered: shared.entered.load(Ordering::Relaxed),
            interval_ms: interval.as_millis() as u64,
            state,
        }
        .encode();
        let written = match conn.as_mut() {
            Some(c) => c.set(&key, &value),
            None => connector().and_then(|mut c| {
                let r = c.set(&key, &value);
                conn = Some(c);
                r
            }),
        };
        if let Err(e) = written {
            conn = None;
            if !warned && !stopping {
                let e = crate::error::with_causes(&e);
                tracing::warn!("ddp-comm: rank {rank}'s heartbeat could not be written: {e}");
                warned = true;
            }
        }
        if stopping {
            return;
        }
        let stop = lock(&shared.stop);
        let (stop, _) = shared
            .wake
            .wait_timeout_while(stop, interval, |stop| !*stop)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        drop(stop);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_interval_is_a_twentieth_of_the_timeout_within_bounds() {
        let cases = [
            (Duration::from_secs(1), Duration::from_millis(100)),
            (Duration::from_secs(2), Duration::from_millis(100)),
            (Duration::from_secs(10), Duration::from_millis(500)),
            (Duration::from_secs(300), Duration::from_secs(1)),
        ];
        for (timeout, interval) in cases {
            assert_eq!(interval_for(timeout), interval, "{timeout:?}");
        }
        assert_eq!(
            store_timeout(Duration::from_millis(100)),
            Duration::from_secs(1)
        );
        assert_eq!(
            store_timeout(Duration::from_secs(1)),
            Duration::from_secs(5)
        );
    }

    #[test]
    fn beats_round_trip_and_garbage_is_refused() {
        let b = Beat {
            beat: 7,
            entered: 42,
            interval_ms: 100,
            state: State::Failed,
        };
        assert_eq!(b.encode(), b"7 42 100 failed");
        assert_eq!(Beat::decode(&b.encode()), Some(b));
        for bad in [
            &b""[..],
            b"7 42 100",
            b"7 x 100 running",
            b"7 42 100 asleep",
        ] {
            assert_eq!(Beat::decode(bad), None, "{bad:?}");
        }
    }
}
