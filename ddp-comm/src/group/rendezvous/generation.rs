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
//! every [`TICK`]. Every other rank joins the latest generation it sees counting, and the
//! group's keys go under `<prefix>g<g>/`. Under a dynamic rendezvous (c10d, etcd) an earlier
//! round's generation never counts again: an agent starts a round's ranks only once every
//! rank of the previous round has ended. Under torchrun's static rendezvous each agent
//! restarts its own node's ranks alone, while the other nodes' ranks may still be meeting:
//! a restarted rank then finds its number claimed in the generation it sees counting. It
//! supersedes that generation, and every rank of it meets again in a newer one: rank 0
//! opens it, and on its first try tells the previous generation it is superseded too (a
//! rank still waiting there from an earlier start comes over). A failure that the restarted
//! ranks caused can come before the claim (a link to a rank of the earlier start that has
//! ended): a rank whose rendezvous failed looks for `superseded` for [`GRACE`], and each
//! generation has one verdict, `superseded` or `stood`, decided by the first rank to ask
//! (`add("verdict", 1)`), so that no rank gives up while the others meet again. No rank
//! leaves its generation until every rank connected its ring (`met/<rank>`). A claimed
//! number on a retry is a duplicated rank, and so is a second rank 0: both fail naming it.
//! A generation that its rank 0 has not opened yet is waited for. Counters carry no tag
//! (`store/signed.rs`): a stranger who adds to them can delay or fail a start, not join it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Met, Plan};
use crate::error::CommError;
use crate::store::Store;

/// The counter of generations opened under a group's prefix.
const GENERATION_KEY: &str = "generation";
/// How often rank 0 counts its generation up, and how often the others look.
const TICK: Duration = Duration::from_millis(50);
/// What every error of a superseded generation says, and how it is told from others.
const SUPERSEDED: &str = "superseded by a newer start of the ranks";
/// The key that says a generation is superseded, and why.
const SUPERSEDED_KEY: &str = "superseded";
/// The key that says a generation's failure stands: no newer start supersedes it.
const STOOD_KEY: &str = "stood";
/// The counter whose first `add` decides between the two, once for every rank.
const VERDICT_KEY: &str = "verdict";
/// How long a rank whose rendezvous failed looks for its generation's `superseded`.
const GRACE: Duration = Duration::from_secs(2);

fn alive_key(generation: i64) -> String {
    format!("alive/{generation}")
}

/// `plan` in generation `generation`.
fn in_generation(plan: &Plan, generation: i64) -> Plan {
    Plan {
        key_prefix: format!("{}g{generation}/", plan.key_prefix),
        ..plan.clone()
    }
}

/// The rendezvous of `plan`'s rank under torchrun's agent store (`plan`'s prefix is the
/// group's): in this start's generation, and again in a newer one each time a generation
/// is superseded, until `deadline`.
pub(super) fn meet(plan: &Plan, deadline: Instant) -> Result<Met, CommError> {
    let mut base = super::connect_store(plan, deadline, &None)?;
    // Generations up to this one are over.
    let mut over = 0;
    loop {
        let (generation, _ticker) = if plan.rank == 0 {
            let latest = base.add(GENERATION_KEY, 0)?;
            if over > 0 && latest != over {
                // Another rank 0 opened a generation since: the ranks waiting in it learn why.
                let err = CommError::Rendezvous {
                    addr: base.addr().to_string(),
                    detail: format!(
                        "generation {latest} was opened by another rank 0 while this one met \
                         in generation {over} (two processes have RANK=0)"
                    ),
                };
                let theirs = in_generation(plan, latest);
                return Err(match super::connect_store(&theirs, deadline, &None) {
                    Ok(mut store) => super::abort(store.as_mut(), err),
                    Err(_) => err,
                });
            }
            let generation = base.add(GENERATION_KEY, 1)?;
            if generation > 1 && over == 0 {
                // Ranks of an earlier start still meeting there (a static rendezvous's
                // other nodes) come over; one that cannot be told waits until its deadline.
                let earlier = in_generation(plan, generation - 1);
                let soon = deadline.min(Instant::now() + GRACE);
                if let Ok(mut store) = super::connect_store(&earlier, soon, &None) {
                    let why = format!("generation {} {SUPERSEDED}", generation - 1);
                    if let Ok(Some(true)) = verdict(store.as_mut(), true, &why, soon) {
                        let _ = store.set(super::ABORT_KEY, why.as_bytes());
                    }
                }
            }
            let group = plan.clone();
            let connect = move || super::connect_store(&group, deadline, &None);
            (generation, Some(Ticker::start(generation, connect)))
        } else {
            let generation = latest_alive(base.as_mut(), over, deadline, plan.timeout)?;
            (generation, None)
        };
        let plan = Plan {
            retry: over > 0,
            ..in_generation(plan, generation)
        };
        let met = super::connect_store(&plan, deadline, &None)
            .and_then(|store| super::meet_at(&plan, store, None, deadline))
            .and_then(|met| all_met(&plan, met, deadline));
        match met {
            Err(e) if Instant::now() < deadline && superseded(&e, &plan, deadline) => {
                tracing::warn!(
                    "ddp-comm: rank {}: generation {generation} of the ranks' meeting in \
                     torchrun's agent store was {SUPERSEDED} (a rank restarted while the \
                     others met); meeting again",
                    plan.rank
                );
                over = generation;
            }
            met => return met,
        }
    }
}

/// Waits until every rank of the generation connected its ring (`met/<rank>`), so that no
/// rank leaves with a group that another rank's failure broke (a neighbour's link to a rank
/// of an earlier start that has ended): that rank's `abort` reaches it here.
fn all_met(plan: &Plan, mut met: Met, deadline: Instant) -> Result<Met, CommError> {
    let Some(store) = met.store.as_mut() else {
        return Ok(met);
    };
    let waited = store
        .set(&format!("met/{}", plan.rank), b"")
        .and_then(|()| {
            let keys: Vec<String> = (0..plan.world_size).map(|r| format!("met/{r}")).collect();
            super::wait_keys(store.as_mut(), &keys, deadline, plan.timeout, |k| {
                k.strip_prefix("met/")?.parse().ok()
            })
        });
    match waited {
        Ok(()) => Ok(met),
        Err(e) => Err(super::tell_the_others(store.as_mut(), plan.rank, e)),
    }
}

/// Whether this rank's failure `err` in the generation of `plan` is that generation's
/// being superseded: its own claim's, or another rank's `abort` that says so, or the
/// generation's verdict. A failure that a restarted rank's arrival caused may come before
/// its claim: the verdict waits [`GRACE`] for it, and the first rank to decide decides for
/// all (no rank stands while the others meet again).
fn superseded(err: &CommError, plan: &Plan, deadline: Instant) -> bool {
    if matches!(err, CommError::Rendezvous { detail, .. } if detail.contains(SUPERSEDED)) {
        return true;
    }
    let until = deadline.min(Instant::now() + GRACE);
    let Ok(mut store) = super::connect_store(plan, until, &None) else {
        return false;
    };
    loop {
        match store.check(&[SUPERSEDED_KEY.to_string()]) {
            Ok(true) => return true,
            Ok(false) if Instant::now() < until => std::thread::sleep(TICK),
            Ok(false) => {
                let why = "the rendezvous failed, and no newer start of the ranks came";
                return matches!(
                    verdict(store.as_mut(), false, why, deadline),
                    Ok(Some(true))
                );
            }
            Err(_) => return false,
        }
    }
}

/// The generation's one verdict, in `store`: whether it is superseded. The first rank to
/// ask decides it (`supersede`, with `why`); the others follow it, until `deadline`: `None`
/// where the first one never wrote it (it died between its `add` and its `set`).
fn verdict(
    store: &mut dyn Store,
    supersede: bool,
    why: &str,
    deadline: Instant,
) -> Result<Option<bool>, CommError> {
    if store.add(VERDICT_KEY, 1)? == 1 {
        let key = if supersede { SUPERSEDED_KEY } else { STOOD_KEY };
        store.set(key, why.as_bytes())?;
        return Ok(Some(supersede));
    }
    loop {
        if store.check(&[SUPERSEDED_KEY.to_string()])? {
            return Ok(Some(true));
        }
        if store.check(&[STOOD_KEY.to_string()])? {
            return Ok(Some(false));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(TICK.min(deadline.saturating_duration_since(Instant::now())));
    }
}

/// Whether a rank whose number another process claimed in its generation (in `store`)
/// supersedes that generation: on its first (a rank of an earlier start that still meets
/// there, from an agent that restarted only its own node's ranks), unless the generation's
/// verdict stood already (a verdict never written counts as this one). On a retry, or where
/// the verdict stood, it is a duplicated rank.
pub(super) fn supersedes(store: &mut dyn Store, plan: &Plan) -> Result<bool, CommError> {
    if plan.retry {
        return Ok(false);
    }
    let why = claim_detail(plan.rank);
    let deadline = Instant::now() + plan.timeout.min(GRACE);
    Ok(verdict(store, true, &why, deadline)? != Some(false))
}

fn claim_detail(rank: usize) -> String {
    format!(
        "rank {rank} of this generation is claimed by a rank {rank} of an earlier start that \
         still meets: {SUPERSEDED}"
    )
}

/// Writes `why` as the `abort` of the latest generation seen alive before `deadline`, if
/// one is (`plan`'s prefix is the group's).
pub(super) fn abort_latest(plan: &Plan, deadline: Instant, why: CommError) {
    let Ok(mut base) = super::connect_store(plan, deadline, &None) else {
        return;
    };
    if let Ok(generation) = latest_alive(base.as_mut(), 0, deadline, plan.timeout) {
        let plan = in_generation(plan, generation);
        if let Ok(mut store) = super::connect_store(&plan, deadline, &None) {
            let _ = super::abort(store.as_mut(), why);
        }
    }
}

/// The error of rank `rank`, whose claim superseded its generation ([`supersedes`]).
pub(super) fn claimed(store: &dyn Store, rank: usize) -> CommError {
    CommError::Rendezvous {
        addr: store.addr().to_string(),
        detail: claim_detail(rank),
    }
}

/// The latest generation after `over` whose `alive/<g>` is seen to change, waiting for one
/// until `deadline`: a timeout names rank 0, which never opened one.
fn latest_alive(
    store: &mut dyn Store,
    over: i64,
    deadline: Instant,
    timeout: Duration,
) -> Result<i64, CommError> {
    // The latest generation, and its count when first seen.
    let mut seen: Option<(i64, i64)> = None;
    loop {
        let generation = store.add(GENERATION_KEY, 0)?;
        if generation > over {
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
struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    /// Counts `generation` up through the connection `connect` opens (under the group's
    /// prefix).
    fn start(
        generation: i64,
        connect: impl FnOnce() -> Result<Box<dyn Store>, CommError> + Send + 'static,
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

    /// A generation's verdict is its first asker's, and every later one follows it.
    #[test]
    fn the_first_verdict_stands_for_every_rank() {
        let soon = || Instant::now() + Duration::from_secs(5);
        for first in [true, false] {
            let (server, secret) = server();
            let mut a = client(&server, &secret);
            let mut b = client(&server, &secret);
            assert_eq!(
                verdict(a.as_mut(), first, "first", soon()).unwrap(),
                Some(first)
            );
            for later in [true, false] {
                let followed = verdict(b.as_mut(), later, "later", soon()).unwrap();
                assert_eq!(followed, Some(first));
            }
            let key = if first { SUPERSEDED_KEY } else { STOOD_KEY };
            assert_eq!(b.get(key).unwrap().as_deref(), Some(&b"first"[..]));
        }
        // A first asker that died before it wrote its verdict leaves none, until the deadline.
        let (server, secret) = server();
        let mut a = client(&server, &secret);
        assert_eq!(a.add(VERDICT_KEY, 1).unwrap(), 1);
        let shortly = Instant::now() + Duration::from_millis(200);
        assert_eq!(verdict(a.as_mut(), true, "late", shortly).unwrap(), None);
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
        match latest_alive(store.as_mut(), 0, soon, Duration::from_millis(300)) {
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
        let found = latest_alive(store.as_mut(), 0, deadline, Duration::from_secs(10)).unwrap();
        assert_eq!(found, 3);
        assert_eq!(opener.join().unwrap(), 3);
        // Once its rank 0 stopped counting, the generation is an earlier start's.
        let counted = store.add(&alive_key(3), 0).unwrap();
        std::thread::sleep(TICK * 4);
        assert_eq!(store.add(&alive_key(3), 0).unwrap(), counted);
    }
}
