//! Rendezvous: every rank meets at the store, agrees on the world, and connects its ring.
//!
//! 1. Rank 0 serves the store on `MASTER_ADDR:MASTER_PORT` (under torchrun's agent store,
//!    every rank is a client of the agent's c10d store instead, whose values carry the
//!    job's tag: `store/signed.rs`); the others look the name up and connect, retrying
//!    both until the rendezvous deadline.
//! 2. Each rank claims `join/<rank>` with `add` (a second claim is a duplicated rank) and
//!    publishes its world size; a rank whose world size differs from rank 0's fails.
//!    A rank that fails at any later step writes `abort`, naming itself and why, which every
//!    waiting rank notices at its next poll, including while it connects its ring; where
//!    another rank's `abort` is there already, that one stands and is this rank's error too
//!    (its own failure may only echo it: a peer that gave up closes its listeners, and only
//!    after writing `abort`).
//! 3. Each rank listens on an ephemeral TCP port of the interface that reaches the store
//!    and (unless told to use TCP only) on an abstract Unix socket, and publishes both with
//!    its host identity (`addr/<rank>`, `host/<rank>`); it waits for every rank's entries (a
//!    timeout names the ranks that never arrived).
//! 4. Every rank computes the same ring: hosts in order of their lowest rank, each host's
//!    ranks in a row. A link between two ranks of one host that both allow it is a
//!    shared-memory ring, any other link TCP (`ring/connect.rs`). Each rank connects to its
//!    successor and accepts its predecessor; both sides prove the job's secret to each other
//!    (`security/auth.rs`), as every connection to the store does.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use crate::config::env::MAX_TIMEOUT;
use crate::error::CommError;
use crate::ring::connect::{self, Listeners, PeerInfo};
use crate::ring::cpu::RingOrder;
use crate::ring::link::{Link, LinkKind, Transport};
use crate::ring::schedule::host_order;
use crate::security::secret::Secret;
use crate::store::c10d::C10dStore;
use crate::store::heartbeat::Connector;
use crate::store::signed::Signed;
use crate::store::{resolve, resolve_until, Store, StoreClient, StoreServer};

mod generation;

const ABORT_KEY: &str = "abort";
/// How long rank 0 keeps its store up after a failed rendezvous.
const ABORT_LINGER: Duration = Duration::from_millis(500);
/// The key prefix under which each rank writes its launcher's attempt in rank 0's own store
/// (`attempt/<rank>`), right after joining.
const ATTEMPT_PREFIX: &str = "attempt/";

/// What rendezvous needs to know.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub rank: usize,
    pub world_size: usize,
    /// Whether every rank runs on this host (`LOCAL_WORLD_SIZE` equals `WORLD_SIZE`, not
    /// for want of a count).
    pub single_node: bool,
    pub master_addr: String,
    pub master_port: u16,
    /// The key of every handshake.
    pub secret: Secret,
    pub agent_store: bool,
    pub key_prefix: String,
    pub timeout: Duration,
    pub socket_buffer: usize,
    /// Whether ranks on one host may use shared memory.
    pub transport: Transport,
    /// Replaces the detected host identity (`DDP_HOST_ID`).
    pub host_id: Option<String>,
    /// Data bytes of each shared-memory ring this rank creates.
    pub shm_capacity: usize,
    /// The launcher's attempt that started this rank, where its nodes restart their ranks
    /// each on their own (`DDP_LAUNCHER_ATTEMPT`).
    pub attempt: Option<u64>,
    /// Whether this rank meets again, in a newer generation of torchrun's agent store, after
    /// one it met in was superseded (`rendezvous/generation.rs`).
    pub retry: bool,
}

/// The result: the store connection (kept for NCCL ids) and the prefix of its keys (the
/// generation's, under torchrun's agent store), rank 0's server, the ring.
pub(crate) struct Met {
    pub store: Option<Box<dyn Store>>,
    pub key_prefix: String,
    pub server: Option<StoreServer>,
    pub link: Option<Link>,
    pub ring: RingOrder,
}

impl std::fmt::Debug for Met {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Met")
            .field("server", &self.server)
            .field("link", &self.link)
            .field("ring", &self.ring)
            .finish_non_exhaustive()
    }
}

/// Most keys of one poll's request (two per rank are waited for).
const MAX_BATCH: usize = 1024;

/// How far a wait has got through its keys. Keys are never deleted, so the leading keys
/// found set are not asked for again: each poll asks from the first key not yet found set,
/// in batches that double while they are wholly set and fall back to that one key once one
/// is not. A rank waiting for a late peer asks for one key a poll and catches up on many
/// arrivals in a few requests, instead of every waiting rank asking for every key (two per
/// rank: O(world²) into rank 0's store) every 50 ms.
#[derive(Debug)]
struct Progress {
    /// Leading keys found set.
    known: usize,
    /// Keys of the next request.
    batch: usize,
}

impl Progress {
    fn new() -> Self {
        Progress { known: 0, batch: 1 }
    }

    /// Whether every key of `keys` (the same on every call) is set.
    fn poll(&mut self, store: &mut dyn Store, keys: &[String]) -> Result<bool, CommError> {
        while self.known < keys.len() {
            let end = keys.len().min(self.known + self.batch);
            if !store.check(&keys[self.known..end])? {
                self.batch = 1;
                return Ok(false);
            }
            self.known = end;
            self.batch = (self.batch * 2).min(MAX_BATCH);
        }
        Ok(true)
    }
}

/// Polls until every key is set, an `abort` appears, or `deadline` passes.
pub(crate) fn wait_keys(
    store: &mut dyn Store,
    keys: &[String],
    deadline: Instant,
    timeout: Duration,
    rank_of: impl Fn(&str) -> Option<usize>,
) -> Result<(), CommError> {
    let mut pause = Duration::from_millis(1);
    let mut progress = Progress::new();
    loop {
        if progress.poll(store, keys)? {
            return Ok(());
        }
        aborted(store)?;
        if Instant::now() >= deadline {
            let mut missing = Vec::new();
            for key in &keys[progress.known..] {
                if !store.check(std::slice::from_ref(key))? {
                    missing.extend(rank_of(key));
                }
            }
            // A rank may own several keys.
            missing.sort_unstable();
            missing.dedup();
            return Err(CommError::RendezvousTimeout {
                addr: store.addr().to_string(),
                timeout,
                missing,
                turned_away: 0,
            });
        }
        std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Another rank's `abort`, as this rank's error, if one is in the store.
fn aborted(store: &mut dyn Store) -> Result<(), CommError> {
    if !store.check(&[ABORT_KEY.to_string()])? {
        return Ok(());
    }
    let why = store.get(ABORT_KEY)?.unwrap_or_default();
    Err(CommError::Rendezvous {
        addr: store.addr().to_string(),
        detail: format!("another rank aborted: {}", String::from_utf8_lossy(&why)),
    })
}

fn abort(store: &mut dyn Store, err: CommError) -> CommError {
    let _ = store.set(ABORT_KEY, crate::error::with_causes(&err).as_bytes());
    err
}

/// The error of `rank`, which failed with `err`: another rank's `abort`, if the store holds
/// one, since it came first and this failure may only echo it (a peer that gave up closes
/// its listeners); otherwise `err`, which is written to `abort` first, naming this rank, as
/// news for the others, who would wait for it until their deadlines (and then blame it for
/// not arriving).
fn tell_the_others(store: &mut dyn Store, rank: usize, err: CommError) -> CommError {
    match aborted(store) {
        Ok(()) => {
            let why = format!("rank {rank}: {}", crate::error::with_causes(&err));
            let _ = store.set(ABORT_KEY, why.as_bytes());
            err
        }
        Err(theirs @ CommError::Rendezvous { .. }) => theirs,
        // The store failed, or holds an `abort` that cannot be trusted: this rank's own.
        Err(_) => err,
    }
}

/// `timeout` from now, or as far as the clock reaches.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + MAX_TIMEOUT.min(timeout))
}

fn connect_store(
    plan: &Plan,
    deadline: Instant,
    server: &Option<StoreServer>,
) -> Result<Box<dyn Store>, CommError> {
    let addrs = match server {
        Some(server) => vec![server.local_addr()],
        None => resolve_until(&plan.master_addr, plan.master_port, deadline)?,
    };
    let io_timeout = plan.timeout.max(Duration::from_secs(1));
    open_store(plan, &addrs, deadline, io_timeout)
}

fn open_store(
    plan: &Plan,
    addrs: &[SocketAddr],
    deadline: Instant,
    io_timeout: Duration,
) -> Result<Box<dyn Store>, CommError> {
    if plan.agent_store {
        // Anyone can write there: values carry the job's tag.
        let store = C10dStore::connect(addrs, plan.key_prefix.clone(), deadline, io_timeout)?;
        Ok(Box::new(Signed::new(
            store,
            plan.secret.clone(),
            plan.key_prefix.clone(),
        )))
    } else {
        Ok(Box::new(StoreClient::connect(
            addrs,
            &plan.secret,
            deadline,
            io_timeout,
        )?))
    }
}

/// Opens further connections to the store this rank met at (rank 0's own server, or
/// torchrun's agent store), each within `timeout` and with every request limited to it:
/// the heartbeat's, which must never wait for the group's connection or for long.
pub(crate) fn connector(plan: &Plan, met: &Met, timeout: Duration) -> Result<Connector, CommError> {
    let addrs = match &met.server {
        Some(server) => vec![server.local_addr()],
        None => resolve_until(&plan.master_addr, plan.master_port, deadline_after(timeout))?,
    };
    let plan = Plan {
        key_prefix: met.key_prefix.clone(),
        ..plan.clone()
    };
    Ok(Box::new(move || {
        open_store(&plan, &addrs, deadline_after(timeout), timeout)
    }))
}

/// Runs the rendezvous of one rank.
pub(crate) fn meet(plan: &Plan) -> Result<Met, CommError> {
    let (rank, world) = (plan.rank, plan.world_size);
    let deadline = deadline_after(plan.timeout);
    if rank >= world {
        // Tell the others, so that they fail now rather than at their deadline.
        let quick = Plan {
            timeout: plan.timeout.min(Duration::from_secs(5)),
            ..plan.clone()
        };
        let quick_deadline = deadline_after(quick.timeout);
        let out_of_range = CommError::RankOutOfRange {
            rank,
            world_size: world,
        };
        if plan.agent_store {
            generation::abort_latest(&quick, quick_deadline, out_of_range);
        } else if let Ok(mut store) = connect_store(&quick, quick_deadline, &None) {
            let _ = abort(store.as_mut(), out_of_range);
        }
        return Err(CommError::RankOutOfRange {
            rank,
            world_size: world,
        });
    }
    if world == 1 {
        return Ok(Met {
            store: None,
            key_prefix: plan.key_prefix.clone(),
            server: None,
            link: None,
            ring: RingOrder {
                order: vec![0],
                pos: 0,
            },
        });
    }
    if plan.agent_store {
        return generation::meet(plan, deadline);
    }
    let server = if rank == 0 {
        // Where it cannot be raised, a failed accept names the limit.
        let _ = crate::tcp::raise_open_file_limit(world);
        Some(StoreServer::bind(
            store_bind_addr(plan)?,
            plan.secret.clone(),
        )?)
    } else {
        None
    };
    let store = store_of_this_attempt(plan, deadline, &server)?;
    meet_at(plan, store, server, deadline)
}

/// Steps 2 to 4 of the rendezvous over a connected store (and, on rank 0, its server); a
/// failure is written to `abort` for the others.
fn meet_at(
    plan: &Plan,
    mut store: Box<dyn Store>,
    server: Option<StoreServer>,
    deadline: Instant,
) -> Result<Met, CommError> {
    // The listeners outlive a failure until it is written: a peer whose handshake with
    // this rank fails when they close then reads why in the store.
    let mut listeners = None;
    match join(plan, store.as_mut(), deadline, &mut listeners) {
        Ok(joined) => Ok(Met {
            store: Some(store),
            key_prefix: plan.key_prefix.clone(),
            server,
            link: Some(joined.link),
            ring: joined.ring,
        }),
        Err(mut err) => {
            // A timeout counts what rank 0's store turned away too.
            if let CommError::RendezvousTimeout { turned_away, .. } = &mut err {
                *turned_away += server.as_ref().map_or(0, StoreServer::turned_away);
            }
            let err = tell_the_others(store.as_mut(), plan.rank, err);
            drop(listeners);
            if server.is_some() {
                // Keep serving briefly, so that waiting ranks read `abort` (they poll at
                // least every 50 ms) instead of finding the store gone.
                std::thread::sleep(ABORT_LINGER);
            }
            Err(err)
        }
    }
}

/// Connects to rank 0's store, not to one where this rank's predecessor met, when the
/// launcher gives its attempt. When several nodes restart their ranks each on their own
/// (`ddp-run --nnodes 2 --max-restarts 1`), a restarted rank may reach the store of the
/// previous attempt's rank 0, which has not yet noticed the failure and where the previous
/// rank of this number joined: it lets go and tries again until that rank 0 has been
/// replaced, or its deadline. Each rank records its own attempt beside its join
/// (`attempt/<rank>`): a rank always runs on the same node, so that attempt and this one come
/// from one launcher's count (two nodes count on their own). A store where this rank's number
/// has not joined is simply joined. torchrun's agents stop and restart every node's ranks
/// together: no attempt is given there.
fn store_of_this_attempt(
    plan: &Plan,
    deadline: Instant,
    server: &Option<StoreServer>,
) -> Result<Box<dyn Store>, CommError> {
    let mut store = connect_store(plan, deadline, server)?;
    let Some(mine) = plan
        .attempt
        .filter(|_| !plan.agent_store && server.is_none())
    else {
        return Ok(store);
    };
    loop {
        let earlier = match earlier_attempt(store.as_mut(), plan.rank, mine) {
            Ok(None) => return Ok(store),
            Ok(Some(theirs)) => theirs,
            // The old store closing: the restarted rank 0 is to come.
            Err(CommError::StoreClosed { .. }) => None,
            Err(e) => return Err(e),
        };
        if Instant::now() >= deadline {
            let which = earlier.map_or("an earlier".to_string(), |t| t.to_string());
            return Err(CommError::Rendezvous {
                addr: store.addr().to_string(),
                detail: format!(
                    "rank 0's store still holds rank {} of launcher attempt {which}, while \
                     this rank is of attempt {mine}: rank 0's node did not restart it",
                    plan.rank
                ),
            });
        }
        drop(store);
        store = loop {
            std::thread::sleep(
                Duration::from_millis(100).min(deadline.saturating_duration_since(Instant::now())),
            );
            match connect_store(plan, deadline, server) {
                Ok(store) => break store,
                // The old store closing under the handshake.
                Err(
                    CommError::StoreClosed { .. }
                    | CommError::Io { .. }
                    | CommError::Handshake { .. },
                ) if Instant::now() < deadline => {}
                Err(e) => return Err(e),
            }
        };
    }
}

/// When a rank numbered `rank` of an earlier attempt than `mine` already joined the store
/// (the rank this one replaces; one that recorded no attempt counts as earlier than any
/// restart): `Some` of its attempt, if it recorded one. `None` when the store is this
/// rank's to join (no such rank, or one of this attempt: a real duplicate, which `join`
/// names).
fn earlier_attempt(
    store: &mut dyn Store,
    rank: usize,
    mine: u64,
) -> Result<Option<Option<u64>>, CommError> {
    if !store.check(&[format!("join/{rank}")])? {
        return Ok(None);
    }
    let theirs = store
        .get(&format!("{ATTEMPT_PREFIX}{rank}"))?
        .and_then(|v| String::from_utf8_lossy(&v).parse::<u64>().ok());
    Ok(match theirs {
        Some(t) if t < mine => Some(Some(t)),
        None if mine > 0 => Some(None),
        _ => None,
    })
}

/// Steps 2 to 4 of the rendezvous, over a connected store; this rank's listeners go into
/// `listeners`, the caller's to close.
fn join(
    plan: &Plan,
    s: &mut dyn Store,
    deadline: Instant,
    listeners: &mut Option<Listeners>,
) -> Result<Joined, CommError> {
    let (rank, world) = (plan.rank, plan.world_size);
    let addr = s.addr().to_string();

    if s.add(&format!("join/{rank}"), 1)? > 1 {
        if plan.agent_store && generation::supersedes(s, plan)? {
            return Err(generation::claimed(s, rank));
        }
        let detail = format!("rank {rank} was started twice (two processes have RANK={rank})");
        return Err(CommError::Rendezvous { addr, detail });
    }
    if let Some(attempt) = plan.attempt.filter(|_| !plan.agent_store) {
        s.set(
            &format!("{ATTEMPT_PREFIX}{rank}"),
            attempt.to_string().as_bytes(),
        )?;
    }
    s.set(&format!("world/{rank}"), world.to_string().as_bytes())?;
    let zero = ["world/0".to_string()];
    wait_keys(s, &zero, deadline, plan.timeout, |_| Some(0))?;
    let theirs = s.get("world/0")?.unwrap_or_default();
    if theirs != world.to_string().as_bytes() {
        let detail = format!(
            "rank {rank} has WORLD_SIZE={world} but rank 0 has WORLD_SIZE={}",
            String::from_utf8_lossy(&theirs)
        );
        return Err(CommError::Rendezvous { addr, detail });
    }

    // Step 3: listen, publish how to be reached and which host this is, read everyone's.
    let listeners = &*listeners.insert(Listeners::bind(
        SocketAddr::new(listen_ip(s.local_ip(), plan.single_node), 0),
        plan.socket_buffer,
        plan.transport == Transport::Auto,
        rank,
    )?);
    s.set(
        &format!("addr/{rank}"),
        listeners.tcp_addr()?.to_string().as_bytes(),
    )?;
    let local_name = listeners.local_name().unwrap_or_default();
    let host = host_key(plan.host_id.as_deref());
    s.set(
        &format!("host/{rank}"),
        format!("{local_name}\n{host}").as_bytes(),
    )?;
    let keys: Vec<String> = (0..world)
        .flat_map(|r| [format!("addr/{r}"), format!("host/{r}")])
        .collect();
    wait_keys(s, &keys, deadline, plan.timeout, |k| {
        k.split_once('/')?.1.parse().ok()
    })?;
    let mut peers = Vec::with_capacity(world);
    for r in 0..world {
        peers.push(peer_info(s, r)?);
    }
    // This rank's own entries decide which of its listeners its predecessor uses: they must
    // read back as written, else someone else wrote them (torchrun's agent store, say,
    // which anyone who reaches it can write).
    let mine = PeerInfo {
        rank,
        addr: listeners.tcp_addr()?,
        local: listeners.local_name(),
        host,
    };
    check_own_record(&mine, &peers[rank]).map_err(|detail| CommError::Rendezvous {
        addr: addr.clone(),
        detail,
    })?;

    // A rank on the store's host that reaches it through loopback published no IP of its
    // own: the others reach that host at the store's IP, as each of them reaches it.
    for peer in &mut peers {
        if peer.addr.ip().is_unspecified() {
            peer.addr.set_ip(s.peer_ip());
        }
    }

    // Step 4: the ring visits each host's ranks in a row; connect its two links.
    let hosts: Vec<&str> = peers.iter().map(|p| p.host.as_str()).collect();
    let order = host_order(&hosts);
    let pos = order
        .iter()
        .position(|&r| r == rank)
        .expect("the ring order holds every rank");
    let next = order[(pos + 1) % world];
    let prev = order[(pos + world - 1) % world];
    let kind = |a: &PeerInfo, b: &PeerInfo| {
        if a.host == b.host && a.local.is_some() && b.local.is_some() {
            LinkKind::SharedMemory
        } else {
            LinkKind::Tcp
        }
    };
    let me = &peers[rank];
    let link = connect::ring(
        &connect::RingPlan {
            rank,
            secret: &plan.secret,
            socket_buffer: plan.socket_buffer,
            shm_capacity: plan.shm_capacity,
            timeout: plan.timeout,
            deadline,
        },
        listeners,
        (&peers[next], kind(me, &peers[next])),
        (&peers[prev], kind(&peers[prev], me)),
        &mut || aborted(s),
    )?;
    Ok(Joined {
        link,
        ring: RingOrder { order, pos },
    })
}

/// Where rank 0's store listens: `MASTER_ADDR`'s address when every rank runs on this host;
/// otherwise every interface at `MASTER_PORT`, of both IP families (`[::]` taking IPv4 too,
/// or `0.0.0.0` on a host without IPv6: `tcp::listen`), without looking the name up, as
/// c10d's TCPStore does: the name may not resolve yet (a Kubeflow master pod's Service has a
/// DNS record once the pod is ready), may resolve to loopback here (Debian's `127.0.1.1` for
/// the host's own name), to an address this host does not hold (a forwarded IP), or to
/// another family than the one the other nodes reach it by.
fn store_bind_addr(plan: &Plan) -> Result<SocketAddr, CommError> {
    if plan.single_node {
        Ok(resolve(&plan.master_addr, plan.master_port)?[0])
    } else {
        let any = IpAddr::V6(Ipv6Addr::UNSPECIFIED);
        Ok(SocketAddr::new(any, plan.master_port))
    }
}

/// The IP a rank's ring listener binds, given the local IP of its store connection: that
/// interface, unless it is loopback in a job of several nodes (a rank on the store's host
/// that reached it through loopback), which listens on every interface and publishes no IP
/// (the others use the store's).
fn listen_ip(store_local_ip: IpAddr, single_node: bool) -> IpAddr {
    if store_local_ip.is_loopback() && !single_node {
        crate::store::unspecified_like(store_local_ip)
    } else {
        store_local_ip
    }
}

/// The ring of a world above one.
struct Joined {
    link: Link,
    ring: RingOrder,
}

/// Whether this rank's entries, as read back from the store (`read`), are the ones it
/// published (`mine`).
fn check_own_record(mine: &PeerInfo, read: &PeerInfo) -> Result<(), String> {
    let same = mine.addr == read.addr && mine.local == read.local && mine.host == read.host;
    if same {
        return Ok(());
    }
    Err(format!(
        "the store holds other entries for this rank (rank {}) than it published: addr/{0} \
         {} and host/{0} {:?} instead of {} and {:?} (another process wrote them)",
        mine.rank,
        read.addr,
        read.local.as_deref().unwrap_or(""),
        mine.addr,
        mine.local.as_deref().unwrap_or(""),
    ))
}

fn peer_info(store: &mut dyn Store, rank: usize) -> Result<PeerInfo, CommError> {
    let invalid = |store: &dyn Store, what: &str, text: &str| CommError::Store {
        addr: store.addr().to_string(),
        detail: format!("rank {rank} published an invalid {what} {text:?}"),
    };
    let text = store.get(&format!("addr/{rank}"))?.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).into_owned();
    let addr = text
        .parse()
        .map_err(|_| invalid(&*store, "address", &text))?;
    let text = store.get(&format!("host/{rank}"))?.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).into_owned();
    let (local, host) = text
        .split_once('\n')
        .ok_or_else(|| invalid(&*store, "host entry", &text))?;
    Ok(PeerInfo {
        rank,
        addr,
        local: (!local.is_empty()).then(|| local.to_string()),
        host: host.to_string(),
    })
}

/// This process's host identity: ranks with equal keys can share memory. `id` (the
/// `DDP_HOST_ID` variable or option) replaces it, as `NCCL_HOSTID` does for NCCL; otherwise
/// it is the host name, the kernel's boot id and the network namespace (the shared-memory
/// handshake uses abstract Unix sockets, which belong to a network namespace).
pub(crate) fn host_key(id: Option<&str>) -> String {
    if let Some(id) = id {
        return format!("id:{id}");
    }
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!(
        "host:{}/{}/{netns}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::AuthFailure;
    use crate::store::StoreClient;

    fn secret(digit: &str) -> Secret {
        Secret::from_hex(&digit.repeat(32)).unwrap()
    }

    /// Rank `rank` of three meeting at rank 0's store on `port`, rendezvous timeout 120 s,
    /// its ring proving `ring_secret`.
    fn plan(rank: usize, port: u16, ring_secret: Secret, transport: Transport) -> Plan {
        Plan {
            rank,
            world_size: 3,
            single_node: true,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            secret: ring_secret,
            agent_store: false,
            key_prefix: String::new(),
            timeout: Duration::from_secs(120),
            socket_buffer: 0,
            transport,
            host_id: Some("test".into()),
            shm_capacity: crate::ring::shm::DEFAULT_CAPACITY,
            attempt: None,
            retry: false,
        }
    }

    /// Three ranks join through rank 0's store (all with its secret), rank 1's ring proving
    /// another secret: the ring fails after every rank has arrived. Each rank's error,
    /// which must come long before the 120 s rendezvous deadline.
    fn meet_with_rank_1_of_another_ring_secret(transport: Transport) -> Vec<CommError> {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret("a")).unwrap();
        let addr = server.local_addr();
        let mut server = Some(server);
        let (tx, rx) = std::sync::mpsc::channel();
        for rank in 0..3 {
            let ring_secret = secret(if rank == 1 { "b" } else { "a" });
            let plan = plan(rank, addr.port(), ring_secret, transport);
            let server = if rank == 0 { server.take() } else { None };
            let tx = tx.clone();
            std::thread::spawn(move || {
                let deadline = deadline_after(plan.timeout);
                let store =
                    StoreClient::connect(&[addr], &secret("a"), deadline, plan.timeout).unwrap();
                let met = meet_at(&plan, Box::new(store), server, deadline);
                let _ = tx.send((rank, met.map(drop)));
            });
        }
        let mut errors: Vec<Option<CommError>> = (0..3).map(|_| None).collect();
        for _ in 0..3 {
            let (rank, met) = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("a rank waited on after the ring failed");
            errors[rank] = Some(met.expect_err("a rank met a ring that failed"));
        }
        errors.into_iter().map(Option::unwrap).collect()
    }

    /// Rank 0's store in a job of several hosts listens on every interface of both IP
    /// families, as c10d's TCPStore does, without looking `MASTER_ADDR` up (it may not
    /// resolve yet, or resolve to another family here).
    #[test]
    fn the_store_of_several_hosts_takes_clients_of_both_families() {
        let several = Plan {
            single_node: false,
            master_addr: "ddp-test.invalid".into(),
            ..plan(0, 0, secret("a"), Transport::Tcp)
        };
        let server = StoreServer::bind(store_bind_addr(&several).unwrap(), secret("a")).unwrap();
        let port = server.local_addr().port();
        assert_eq!(
            server.local_addr(),
            SocketAddr::from(([127, 0, 0, 1], port))
        );
        let connect = |addr: SocketAddr| {
            let deadline = deadline_after(Duration::from_secs(3));
            StoreClient::connect(&[addr], &secret("a"), deadline, Duration::from_secs(3))
        };
        let mut v4 = connect(SocketAddr::from(([127, 0, 0, 1], port))).unwrap();
        v4.set("k", b"v").unwrap();
        if std::net::TcpListener::bind("[::1]:0").is_err() {
            println!("skipped the IPv6 client: this host has no IPv6 loopback");
            return;
        }
        let mut v6 = connect(SocketAddr::from((Ipv6Addr::LOCALHOST, port))).unwrap();
        assert_eq!(v6.get("k").unwrap().as_deref(), Some(&b"v"[..]));
        // Where every rank runs on this host, the store listens on MASTER_ADDR alone, which
        // must resolve.
        let one_host = plan(0, 0, secret("a"), Transport::Tcp);
        let master = SocketAddr::from(([127, 0, 0, 1], 0));
        assert_eq!(store_bind_addr(&one_host).unwrap(), master);
        let unknown = Plan {
            master_addr: "ddp-test.invalid".into(),
            ..one_host
        };
        match store_bind_addr(&unknown) {
            Err(CommError::Address { addr, .. }) => assert!(
                addr.starts_with("ddp-test.invalid:0 (MASTER_ADDR:MASTER_PORT"),
                "{addr}"
            ),
            other => panic!("expected an address error, got {other:?}"),
        }
    }

    /// Connections to `server`, with secret `a`, for 10 s.
    fn client_of(server: &StoreServer) -> impl Fn() -> StoreClient + '_ {
        let deadline = deadline_after(Duration::from_secs(10));
        move || {
            StoreClient::connect(
                &[server.local_addr()],
                &secret("a"),
                deadline,
                Duration::from_secs(5),
            )
            .unwrap()
        }
    }

    /// torchrun's agent store takes anyone's writes: an `addr/1` that does not carry the
    /// job's tag for that very key and group (none, another secret's, another key's, another
    /// group's) is refused naming the key, and a tagged one is read.
    #[test]
    fn a_forged_address_in_the_agent_store_is_refused() {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret("a")).unwrap();
        let client = client_of(&server);
        let prefix = "/ddp-comm/job/0/0/";
        let signed = |secret: Secret, prefix: &str| Signed::new(client(), secret, prefix.into());
        let mut rank = signed(secret("c"), prefix);
        // What other ranks, strangers and earlier groups wrote, as the store holds it.
        let mut raw = client();
        let mut tagged = |secret: Secret, prefix: &str, key: &str, value: &[u8]| {
            signed(secret, prefix).set(key, value).unwrap();
            raw.get(key).unwrap().unwrap()
        };
        let good = tagged(secret("c"), prefix, "addr/1", b"127.0.0.1:4000");
        let other_secret = tagged(secret("d"), prefix, "addr/1", b"127.0.0.1:4000");
        let other_key = tagged(secret("c"), prefix, "addr/2", b"127.0.0.1:4000");
        let other_group = tagged(
            secret("c"),
            "/ddp-comm/job/0/1/",
            "addr/1",
            b"127.0.0.1:4000",
        );
        rank.set("host/1", b"\nhost:h").unwrap();
        for (forged, what) in [
            (b"127.0.0.1:4000".to_vec(), "no tag"),
            (b"short".to_vec(), "shorter than a tag"),
            (other_secret, "another secret's tag"),
            (other_key, "addr/2's tag"),
            (other_group, "another group's tag"),
        ] {
            raw.set("addr/1", &forged).unwrap();
            match peer_info(&mut rank, 1) {
                Err(CommError::Store { addr, detail }) => {
                    assert_eq!(addr, server.local_addr().to_string(), "{what}");
                    assert!(
                        detail.starts_with(
                            "the value of 'addr/1' is forged: it does not carry this job's tag"
                        ),
                        "{what}: {detail}"
                    );
                    assert!(detail.contains("Options::with_secret"), "{what}: {detail}");
                }
                other => panic!("{what}: expected a forged value, got {other:?}"),
            }
        }
        raw.set("addr/1", &good).unwrap();
        let peer = peer_info(&mut rank, 1).unwrap();
        assert_eq!(
            (peer.addr, peer.local, peer.host.as_str()),
            ("127.0.0.1:4000".parse().unwrap(), None, "host:h")
        );
    }

    /// A failure while the ring connects is written to `abort` naming the failed rank, and
    /// stops every rank: no one waits for its deadline, nor blames a rank that arrived.
    #[test]
    fn a_failed_ring_handshake_stops_every_rank_at_once() {
        for transport in [Transport::Tcp, Transport::Auto] {
            let errors = meet_with_rank_1_of_another_ring_secret(transport);
            // Ranks 0 and 1 each find that their successor does not prove their secret (or,
            // rank 0, that rank 1 hung up on its proof: it had failed already).
            for (rank, next) in [(0, 1), (1, 2)] {
                match &errors[rank] {
                    CommError::Handshake {
                        addr,
                        failure: AuthFailure::Unproven { .. } | AuthFailure::Refused { .. },
                    } => assert!(addr.starts_with(&format!("rank {next} at ")), "{addr}"),
                    // Or the other one's abort came first.
                    CommError::Rendezvous { detail, .. } => assert!(
                        detail.starts_with("another rank aborted: rank ")
                            && detail.contains("the secrets differ"),
                        "{transport:?} rank {rank}: {detail}"
                    ),
                    other => panic!("{transport:?} rank {rank}: {other:?}"),
                }
            }
            // Rank 2, whose predecessor (rank 1) hung up, learns why from the abort.
            match &errors[2] {
                CommError::Rendezvous { detail, .. } => {
                    let which = detail
                        .strip_prefix("another rank aborted: rank ")
                        .unwrap_or_else(|| panic!("{transport:?}: {detail}"));
                    let (failed, why) = which.split_once(": ").unwrap();
                    assert!(["0", "1"].contains(&failed), "{transport:?}: {detail}");
                    assert!(
                        why.starts_with("handshake with rank ")
                            && why.contains("the secrets differ"),
                        "{transport:?}: {detail}"
                    );
                }
                other => panic!("{transport:?} rank 2: {other:?}"),
            }
        }
    }

    #[test]
    fn a_forged_own_record_is_an_error() {
        let mine = PeerInfo {
            rank: 3,
            addr: "127.0.0.1:4000".parse().unwrap(),
            local: None,
            host: "host:a".into(),
        };
        assert_eq!(check_own_record(&mine, &mine.clone()), Ok(()));
        // A shared-memory name this rank never listened on (it runs with TCP only).
        let forged = PeerInfo {
            local: Some("ddp-comm/1/3/feed".into()),
            ..mine.clone()
        };
        let err = check_own_record(&mine, &forged).unwrap_err();
        assert_eq!(
            err,
            "the store holds other entries for this rank (rank 3) than it published: addr/3 \
             127.0.0.1:4000 and host/3 \"ddp-comm/1/3/feed\" instead of 127.0.0.1:4000 and \"\" \
             (another process wrote them)"
        );
        for forged in [
            PeerInfo {
                host: "host:b".into(),
                ..mine.clone()
            },
            PeerInfo {
                addr: "10.0.0.1:4000".parse().unwrap(),
                ..mine.clone()
            },
        ] {
            assert!(check_own_record(&mine, &forged).is_err(), "{forged:?}");
        }
    }

    /// A store of keys `k/0`, `k/1`, ... of which the first `set` are set, one more after
    /// each check (ranks arriving in order while others wait), counting what is asked.
    struct Arriving {
        set: usize,
        requests: usize,
        keys_checked: usize,
    }

    impl Store for Arriving {
        fn set(&mut self, _: &str, _: &[u8]) -> Result<(), CommError> {
            unreachable!("a wait only checks")
        }
        fn get(&mut self, _: &str) -> Result<Option<Vec<u8>>, CommError> {
            unreachable!("a wait only checks")
        }
        fn add(&mut self, _: &str, _: i64) -> Result<i64, CommError> {
            unreachable!("a wait only checks")
        }
        fn check(&mut self, keys: &[String]) -> Result<bool, CommError> {
            self.requests += 1;
            self.keys_checked += keys.len();
            let index = |k: &String| k.strip_prefix("k/").unwrap().parse::<usize>().unwrap();
            let all = keys.iter().all(|k| index(k) < self.set);
            self.set += 1;
            Ok(all)
        }
        fn addr(&self) -> &str {
            "arriving"
        }
        fn local_ip(&self) -> IpAddr {
            IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
        }
        fn peer_ip(&self) -> IpAddr {
            self.local_ip()
        }
    }

    /// Polls until every key is set: the store's requests and keys asked for.
    fn wait_on(store: &mut Arriving, keys: &[String]) -> (usize, usize) {
        let mut progress = Progress::new();
        while !progress.poll(store, keys).unwrap() {}
        (store.requests, store.keys_checked)
    }

    /// A waiting rank asks for each key a bounded number of times, not for every key on
    /// every poll (two keys per rank, from every rank: O(world²) into rank 0's store).
    #[test]
    fn a_wait_asks_for_keys_in_linear_total() {
        const KEYS: usize = 1000;
        let keys: Vec<String> = (0..KEYS).map(|i| format!("k/{i}")).collect();
        let mut arriving = Arriving {
            set: 0,
            requests: 0,
            keys_checked: 0,
        };
        let (requests, checked) = wait_on(&mut arriving, &keys);
        assert!(
            checked < 3 * KEYS,
            "{checked} keys asked for in {requests} requests"
        );
        // Every key set already: doubling batches of 1, 2, 4 ... 256, then the 489 left.
        let mut all_set = Arriving {
            set: KEYS,
            requests: 0,
            keys_checked: 0,
        };
        assert_eq!(wait_on(&mut all_set, &keys), (10, KEYS));
    }

    #[test]
    fn host_keys_are_stable_and_overridable() {
        let key = host_key(None);
        assert!(key.starts_with("host:") && key.contains("net:["), "{key}");
        assert_eq!(key, host_key(None));
        assert_eq!(host_key(Some("node-7")), "id:node-7");
    }

    /// A rank's failure reaches the others through the store with its cause, which its
    /// message leaves to `source()`.
    #[test]
    fn the_others_read_a_failure_with_its_cause() {
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret("a")).unwrap();
        let client = client_of(&server);
        let cause = std::io::Error::other("too many open files");
        let failed = CommError::io("ring listener", cause);
        assert!(matches!(
            tell_the_others(&mut client(), 1, failed),
            CommError::Io { .. }
        ));
        match aborted(&mut client()) {
            Err(CommError::Rendezvous { detail, .. }) => assert_eq!(
                detail,
                "another rank aborted: rank 1: ring listener: too many open files"
            ),
            other => panic!("expected the abort of rank 1, got {other:?}"),
        }
    }
}
