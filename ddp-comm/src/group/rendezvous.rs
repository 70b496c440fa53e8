//! Rendezvous: every rank meets at the store, agrees on the world, and connects its ring.
//!
//! 1. Rank 0 serves the store on `MASTER_ADDR:MASTER_PORT` (under torchrun's agent store,
//!    every rank is a client of the agent's c10d store instead); the others connect,
//!    retrying until the rendezvous deadline.
//! 2. Each rank claims `join/<rank>` with `add` (a second claim is a duplicated rank) and
//!    publishes its world size; a rank whose world size differs from rank 0's fails.
//!    A failing rank writes `abort`, which every waiting rank notices at its next poll.
//! 3. Each rank listens on an ephemeral TCP port of the interface that reaches the store
//!    and (unless told to use TCP only) on an abstract Unix socket, and publishes both with
//!    its host identity (`addr/<rank>`, `host/<rank>`); it waits for every rank's entries (a
//!    timeout names the ranks that never arrived).
//! 4. Every rank computes the same ring: hosts in order of their lowest rank, each host's
//!    ranks in a row. A link between two ranks of one host that both allow it is a
//!    shared-memory ring, any other link TCP (`ring/connect.rs`). Each rank connects to its
//!    successor and accepts its predecessor; both sides prove the job's secret to each other
//!    (`security/auth.rs`), as every connection to the store does.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::ring::connect::{self, Listeners, PeerInfo};
use crate::ring::cpu::RingOrder;
use crate::ring::link::{Link, LinkKind, Transport};
use crate::ring::schedule::host_order;
use crate::security::secret::Secret;
use crate::store::c10d::C10dStore;
use crate::store::heartbeat::Connector;
use crate::store::{resolve, Store, StoreClient, StoreServer};

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
}

/// The result: the store connection (kept for NCCL ids), rank 0's server, the ring.
pub(crate) struct Met {
    pub store: Option<Box<dyn Store>>,
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

/// Polls until every key is set, an `abort` appears, or `deadline` passes.
pub(crate) fn wait_keys(
    store: &mut dyn Store,
    keys: &[String],
    deadline: Instant,
    timeout: Duration,
    rank_of: impl Fn(&str) -> Option<usize>,
) -> Result<(), CommError> {
    let mut pause = Duration::from_millis(1);
    let abort = [ABORT_KEY.to_string()];
    loop {
        if store.check(keys)? {
            return Ok(());
        }
        if store.check(&abort)? {
            let why = store.get(ABORT_KEY)?.unwrap_or_default();
            return Err(CommError::Rendezvous {
                addr: store.addr().to_string(),
                detail: format!("another rank aborted: {}", String::from_utf8_lossy(&why)),
            });
        }
        if Instant::now() >= deadline {
            let mut missing = Vec::new();
            for key in keys {
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

fn abort(store: &mut dyn Store, err: CommError) -> CommError {
    let _ = store.set(ABORT_KEY, err.to_string().as_bytes());
    err
}

fn connect_store(
    plan: &Plan,
    deadline: Instant,
    server: &Option<StoreServer>,
) -> Result<Box<dyn Store>, CommError> {
    let addrs = match server {
        Some(server) => vec![server.local_addr()],
        None => resolve(&plan.master_addr, plan.master_port)?,
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
        Ok(Box::new(C10dStore::connect(
            addrs,
            plan.key_prefix.clone(),
            deadline,
            io_timeout,
        )?))
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
pub(crate) fn connector(
    plan: &Plan,
    server: Option<&StoreServer>,
    timeout: Duration,
) -> Result<Connector, CommError> {
    let addrs = match server {
        Some(server) => vec![server.local_addr()],
        None => resolve(&plan.master_addr, plan.master_port)?,
    };
    let plan = plan.clone();
    Ok(Box::new(move || {
        open_store(&plan, &addrs, Instant::now() + timeout, timeout)
    }))
}

/// Runs the rendezvous of one rank.
pub(crate) fn meet(plan: &Plan) -> Result<Met, CommError> {
    let (rank, world) = (plan.rank, plan.world_size);
    let deadline = Instant::now() + plan.timeout;
    if rank >= world {
        // Tell the others, so that they fail now rather than at their deadline.
        let quick = Plan {
            timeout: plan.timeout.min(Duration::from_secs(5)),
            ..plan.clone()
        };
        if let Ok(mut store) = connect_store(&quick, Instant::now() + quick.timeout, &None) {
            let _ = abort(
                store.as_mut(),
                CommError::RankOutOfRange {
                    rank,
                    world_size: world,
                },
            );
        }
        return Err(CommError::RankOutOfRange {
            rank,
            world_size: world,
        });
    }
    if world == 1 {
        return Ok(Met {
            store: None,
            server: None,
            link: None,
            ring: RingOrder {
                order: vec![0],
                pos: 0,
            },
        });
    }
    let server = if rank == 0 && !plan.agent_store {
        let addr = resolve(&plan.master_addr, plan.master_port)?[0];
        Some(StoreServer::bind(
            store_bind_addr(addr, plan.single_node),
            plan.secret.clone(),
        )?)
    } else {
        None
    };
    let mut store = store_of_this_attempt(plan, deadline, &server)?;
    match join(plan, store.as_mut(), deadline) {
        Ok(joined) => Ok(Met {
            store: Some(store),
            server,
            link: Some(joined.link),
            ring: joined.ring,
        }),
        Err(mut err) => {
            // A timeout is news for the others too, with what rank 0's store turned away;
            // other failures have already been written (or came from another rank's abort).
            if let CommError::RendezvousTimeout { turned_away, .. } = &mut err {
                *turned_away = server.as_ref().map_or(0, StoreServer::turned_away);
                err = abort(store.as_mut(), err);
            }
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

/// Steps 2 to 4 of the rendezvous, over a connected store.
fn join(plan: &Plan, s: &mut dyn Store, deadline: Instant) -> Result<Joined, CommError> {
    let (rank, world) = (plan.rank, plan.world_size);
    let addr = s.addr().to_string();

    if s.add(&format!("join/{rank}"), 1)? > 1 {
        let detail = format!("rank {rank} was started twice (two processes have RANK={rank})");
        return Err(abort(s, CommError::Rendezvous { addr, detail }));
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
        return Err(abort(s, CommError::Rendezvous { addr, detail }));
    }

    // Step 3: listen, publish how to be reached and which host this is, read everyone's.
    let listeners = Listeners::bind(
        SocketAddr::new(listen_ip(s.local_ip(), plan.single_node), 0),
        plan.socket_buffer,
        plan.transport == Transport::Auto,
        rank,
    )?;
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
    check_own_record(&mine, &peers[rank]).map_err(|detail| {
        abort(
            s,
            CommError::Rendezvous {
                addr: addr.clone(),
                detail,
            },
        )
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
        &listeners,
        (&peers[next], kind(me, &peers[next])),
        (&peers[prev], kind(&peers[prev], me)),
    )?;
    Ok(Joined {
        link,
        ring: RingOrder { order, pos },
    })
}

/// Where rank 0's store listens, given `MASTER_ADDR`'s address: there when every rank runs
/// on this host; otherwise on every interface at its port, as c10d's TCPStore does, since
/// the name may resolve to loopback here (Debian's `127.0.1.1` for the host's own name) or
/// to an address this host does not hold (a forwarded IP) while the other nodes reach it.
fn store_bind_addr(master: SocketAddr, single_node: bool) -> SocketAddr {
    if single_node {
        master
    } else {
        SocketAddr::new(crate::store::unspecified_like(master.ip()), master.port())
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

    #[test]
    fn host_keys_are_stable_and_overridable() {
        let key = host_key(None);
        assert!(key.starts_with("host:") && key.contains("net:["), "{key}");
        assert_eq!(key, host_key(None));
        assert_eq!(host_key(Some("node-7")), "id:node-7");
    }
}
