//! Which start of a group a rank meets in torchrun's agent store.
//!
//! The agent's store outlives the rounds of a job (torch 2.13's c10d rendezvous creates it
//! once per agent): the ranks of a new round find the keys of the previous round's ranks
//! there (their joins, addresses, `abort`). The restart count does not tell the rounds
//! apart across nodes: each agent counts only its own node's failures, and a node whose
//! ranks were restarted for another node's failure keeps its count, so the ranks of one
//! round may hold different counts (pytorch/pytorch#135712).
//!
//! So rank 0 of every start opens a generation: `add("generation", 1)` gives it a number no
//! earlier start had, and until its rendezvous ends a thread of it counts `alive/<g>` up
//! every [`TICK`]. Every other rank joins the latest generation it sees counting. An earlier
//! round's never counts again (its rank 0 is gone: an agent starts a round's ranks only once
//! every rank of the previous round has ended), and a generation that its rank 0 has not
//! opened yet is waited for. The group's keys then go under `<prefix>g<g>/`. Counters carry
//! no tag (`store/signed.rs`): a stranger who adds to them can delay a start, not join it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Plan;
use crate::error::CommError;
use crate::store::Store;

/// The counter of generations opened under a group's prefix.
const GENERATION_KEY: &str = "generation";
/// How often rank 0 counts its generation up, and how often the others look.
pub(super) const TICK: Duration = Duration::from_millis(50);

fn alive_key(generation: i64) -> String {
    format!("alive/{generation}")
}

/// `plan` with the key prefix of this rank's generation, and on rank 0 the thread that
/// shows the generation alive (to be kept until the rendezvous ends). `connect` opens a
/// connection to the store under `plan`'s own prefix: it is called once here, and on rank
/// 0 once more, by the thread.
pub(super) fn join(
    plan: &Plan,
    deadline: Instant,
    connect: impl Fn() -> Result<Box<dyn Store>, CommError> + Send + 'static,
) -> Result<(Plan, Option<Ticker>), CommError> {
    let mut store = connect()?;
    let (generation, ticker) = if plan.rank == 0 {
        let generation = store.add(GENERATION_KEY, 1)?;
        (generation, Some(Ticker::start(generation, connect)))
    } else {
        (latest_alive(store.as_mut(), deadline, plan.timeout)?, None)
    };
    let plan = Plan {
        key_prefix: format!("{}g{generation}/", plan.key_prefix),
        ..plan.clone()
    };
    Ok((plan, ticker))
}

/// The latest generation whose `alive/<g>` is seen to change, waiting for one until
/// `deadline`: a timeout names rank 0, which never opened one.
fn latest_alive(
    store: &mut dyn Store,
    deadline: Instant,
    timeout: Duration,
) -> Result<i64, CommError> {
    // The latest generation, and its count when first seen.
    let mut seen: Option<(i64, i64)> = None;
    loop {
        let generation = store.add(GENERATION_KEY, 0)?;
        if generation > 0 {
            let count = store.add(&alive_key(generation), 0)?;
            match seen {
                Some((g, first)) if g == generation && first != count => return Ok(generation),
                Some((g, _)) if g == generation => {}
                _ => seen = Some((generation, count)),
            }
        }
        if Instant::now() >= deadline {
            return Err(CommError::RendezvousTimeout {
                addr: store.addr().to_string(),
                timeout,
                missing: vec![0],
                turned_away: 0,
            });
        }
        std::thread::sleep(TICK.min(deadline.saturating_duration_since(Instant::now())));
    }
}

/// Rank 0's thread that counts its generation's `alive/<g>` up, until dropped.
pub(super) struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    fn start(
        generation: i64,
        connect: impl Fn() -> Result<Box<dyn Store>, CommError> + Send + 'static,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ddp-comm-generation".into())
            .spawn(move || {
                // A failure ends the counting: the rendezvous's own connection meets it
                // too, or the others wait for this generation until their deadline.
                let Ok(mut store) = connect() else { return };
                let key = alive_key(generation);
                while !stopped.load(Ordering::Relaxed) && store.add(&key, 1).is_ok() {
                    std::thread::sleep(TICK);
                }
            });
        Ticker {
            stop,
            // Without a thread the generation never shows alive: the others' timeout names
            // rank 0.
            thread: thread.ok(),
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{StoreClient, StoreServer};
    use crate::Secret;

    fn server() -> (StoreServer, Secret) {
        let secret = Secret::from_hex(&"3".repeat(32)).unwrap();
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone()).unwrap();
        (server, secret)
    }

    fn client(server: &StoreServer, secret: &Secret) -> Box<dyn Store> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let addr = [server.local_addr()];
        Box::new(StoreClient::connect(&addr, secret, deadline, Duration::from_secs(10)).unwrap())
    }

    /// An earlier start's generation, whose count no longer changes, is passed over; the
    /// one a live rank 0 counts up is joined, and a rank that waits for none names rank 0.
    #[test]
    fn only_a_generation_whose_rank_0_counts_is_joined() {
        let (server, secret) = server();
        let mut store = client(&server, &secret);
        // Two earlier starts: their rank 0s opened generations 1 and 2 and are gone.
        assert_eq!(store.add(GENERATION_KEY, 2).unwrap(), 2);
        assert_eq!(store.add(&alive_key(2), 7).unwrap(), 7);
        let soon = Instant::now() + Duration::from_millis(300);
        match latest_alive(store.as_mut(), soon, Duration::from_millis(300)) {
            Err(CommError::RendezvousTimeout { missing, .. }) => assert_eq!(missing, [0]),
            other => panic!("{other:?}"),
        }
        // This start's rank 0 opens generation 3 a moment after the rank began to look.
        let (s, c) = (server.local_addr(), secret.clone());
        let opener = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let mut store = {
                let deadline = Instant::now() + Duration::from_secs(10);
                StoreClient::connect(&[s], &c, deadline, Duration::from_secs(10)).unwrap()
            };
            let generation = store.add(GENERATION_KEY, 1).unwrap();
            let connect = move || -> Result<Box<dyn Store>, CommError> {
                let deadline = Instant::now() + Duration::from_secs(10);
                let store = StoreClient::connect(&[s], &c, deadline, Duration::from_secs(10))?;
                Ok(Box::new(store))
            };
            let ticker = Ticker::start(generation, connect);
            std::thread::sleep(Duration::from_millis(500));
            drop(ticker);
            generation
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        let found = latest_alive(store.as_mut(), deadline, Duration::from_secs(10)).unwrap();
        assert_eq!(found, 3);
        assert_eq!(opener.join().unwrap(), 3);
        // Once its rank 0 stopped counting, the generation is an earlier start's.
        let counted = store.add(&alive_key(3), 0).unwrap();
        std::thread::sleep(TICK * 4);
        assert_eq!(store.add(&alive_key(3), 0).unwrap(), counted);
    }
}
