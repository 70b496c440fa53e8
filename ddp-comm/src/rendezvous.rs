//! Rendezvous: every rank meets at the store, agrees on the world, and connects its ring.
//!
//! 1. Rank 0 serves the store on `MASTER_ADDR:MASTER_PORT` (under torchrun's agent store,
//!    every rank is a client of the agent's c10d store instead); the others connect,
//!    retrying until the rendezvous deadline.
//! 2. Each rank claims `join/<rank>` with `add` (a second claim is a duplicated rank) and
//!    publishes its world size; a rank whose world size differs from rank 0's fails.
//!    A failing rank writes `abort`, which every waiting rank notices at its next poll.
//! 3. Each rank listens for its predecessor on an ephemeral port of the interface that
//!    reaches the store, publishes `addr/<rank>`, waits for all addresses (a timeout names
//!    the ranks that never arrived), connects to its successor and accepts its predecessor,
//!    both sides presenting the job's token.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::c10d::C10dStore;
use crate::error::CommError;
use crate::store::{connect_retry, resolve, Store, StoreClient, StoreServer};
use crate::tcp::{self, Link};
use crate::wire;

const PEER_MAGIC: &[u8; 4] = b"DDPR";
const ABORT_KEY: &str = "abort";
/// How long rank 0 keeps its store up after a failed rendezvous.
const ABORT_LINGER: Duration = Duration::from_millis(500);

/// What rendezvous needs to know.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub rank: usize,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub token: Vec<u8>,
    pub agent_store: bool,
    pub key_prefix: String,
    pub timeout: Duration,
    pub socket_buffer: usize,
}

/// The result: the store connection (kept for NCCL ids), rank 0's server, the ring.
pub(crate) struct Met {
    pub store: Option<Box<dyn Store>>,
    pub server: Option<StoreServer>,
    pub link: Option<Link>,
}

impl std::fmt::Debug for Met {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Met")
            .field("server", &self.server)
            .field("link", &self.link)
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
            return Err(CommError::RendezvousTimeout {
                addr: store.addr().to_string(),
                timeout,
                missing,
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
    if plan.agent_store {
        Ok(Box::new(C10dStore::connect(
            &addrs,
            plan.key_prefix.clone(),
            deadline,
            io_timeout,
        )?))
    } else {
        Ok(Box::new(StoreClient::connect(
            &addrs,
            &plan.token,
            deadline,
            io_timeout,
        )?))
    }
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
        });
    }
    let server = if rank == 0 && !plan.agent_store {
        let addr = resolve(&plan.master_addr, plan.master_port)?[0];
        Some(StoreServer::bind(addr, plan.token.clone())?)
    } else {
        None
    };
    let mut store = connect_store(plan, deadline, &server)?;
    match join(plan, store.as_mut(), deadline) {
        Ok(link) => Ok(Met {
            store: Some(store),
            server,
            link: Some(link),
        }),
        Err(err) => {
            // A timeout is news for the others too; other failures have already been
            // written (or came from another rank's abort).
            let err = match err {
                CommError::RendezvousTimeout { .. } => abort(store.as_mut(), err),
                other => other,
            };
            if server.is_some() {
                // Keep serving briefly, so that waiting ranks read `abort` (they poll at
                // least every 50 ms) instead of finding the store gone.
                std::thread::sleep(ABORT_LINGER);
            }
            Err(err)
        }
    }
}

/// Steps 2 and 3 of the rendezvous, over a connected store.
fn join(plan: &Plan, s: &mut dyn Store, deadline: Instant) -> Result<Link, CommError> {
    let (rank, world) = (plan.rank, plan.world_size);
    let addr = s.addr().to_string();

    if s.add(&format!("join/{rank}"), 1)? > 1 {
        let detail = format!("rank {rank} was started twice (two processes have RANK={rank})");
        return Err(abort(s, CommError::Rendezvous { addr, detail }));
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

    let listen_ip = s.local_ip();
    let listener = bind_listener(SocketAddr::new(listen_ip, 0), plan.socket_buffer)?;
    let my_addr = listener
        .local_addr()
        .map_err(|e| CommError::io("ring listener", e))?;
    s.set(&format!("addr/{rank}"), my_addr.to_string().as_bytes())?;
    let keys: Vec<String> = (0..world).map(|r| format!("addr/{r}")).collect();
    wait_keys(s, &keys, deadline, plan.timeout, |k| {
        k.strip_prefix("addr/")?.parse().ok()
    })?;

    let next = (rank + 1) % world;
    let prev = (rank + world - 1) % world;
    let next_addr = peer_addr(s, next)?;
    let prev_addr = peer_addr(s, prev)?;
    connect_ring(plan, &listener, next, next_addr, prev, prev_addr, deadline)
}

fn peer_addr(store: &mut dyn Store, rank: usize) -> Result<SocketAddr, CommError> {
    let text = store.get(&format!("addr/{rank}"))?.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).into_owned();
    text.parse().map_err(|_| CommError::Store {
        addr: store.addr().to_string(),
        detail: format!("rank {rank} published an invalid address {text:?}"),
    })
}

fn bind_listener(addr: SocketAddr, buffer: usize) -> Result<TcpListener, CommError> {
    let listener = TcpListener::bind(addr).map_err(|source| CommError::Address {
        addr: addr.to_string(),
        source,
    })?;
    if buffer > 0 {
        use std::os::fd::AsRawFd;
        tcp::set_buffer(listener.as_raw_fd(), buffer)
            .map_err(|e| CommError::io("ring listener buffers", e))?;
    }
    Ok(listener)
}

fn connect_ring(
    plan: &Plan,
    listener: &TcpListener,
    next: usize,
    next_addr: SocketAddr,
    prev: usize,
    prev_addr: SocketAddr,
    deadline: Instant,
) -> Result<Link, CommError> {
    let left = |d: Instant| {
        d.saturating_duration_since(Instant::now())
            .max(Duration::from_millis(10))
    };
    let mut send = connect_retry(&[next_addr], deadline, &format!("rank {next}"))?;
    tcp::tune_socket(&send, plan.socket_buffer).map_err(|e| CommError::io("ring socket", e))?;
    send.write_all(&wire::hello(PEER_MAGIC, &plan.token, plan.rank as u32))
        .map_err(|e| CommError::PeerLost {
            op: "rendezvous",
            peer: next,
            addr: next_addr,
            detail: e.to_string(),
        })?;

    // Accept until the predecessor shows up with the right token; drop anything else.
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io("ring listener", e))?;
    let mut recv = loop {
        match listener.accept() {
            Ok((mut stream, from)) => {
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_read_timeout(Some(left(deadline).min(Duration::from_secs(10))));
                match wire::read_hello(&mut stream, PEER_MAGIC, &plan.token) {
                    Ok(Ok(r)) if r as usize == prev => {
                        let _ = stream.set_read_timeout(None);
                        break stream;
                    }
                    Ok(Ok(r)) => eprintln!("ddp-comm: rank {} dropped a ring connection from {from} claiming rank {r} (expected {prev})", plan.rank),
                    Ok(Err(why)) => eprintln!("ddp-comm: rank {} rejected a connection from {from}: {why}", plan.rank),
                    Err(e) => eprintln!("ddp-comm: rank {} rejected a connection from {from}: incomplete handshake ({e})", plan.rank),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(CommError::RendezvousTimeout {
                        addr: format!(
                            "ring listener {}",
                            listener
                                .local_addr()
                                .map(|a| a.to_string())
                                .unwrap_or_default()
                        ),
                        timeout: plan.timeout,
                        missing: vec![prev],
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(CommError::io("accepting the ring predecessor", e)),
        }
    };
    tcp::tune_socket(&recv, plan.socket_buffer).map_err(|e| CommError::io("ring socket", e))?;
    recv.write_all(&[1]).map_err(|e| CommError::PeerLost {
        op: "rendezvous",
        peer: prev,
        addr: prev_addr,
        detail: e.to_string(),
    })?;
    let mut ack = [0u8; 1];
    tcp::read_exact_timeout(&mut send, &mut ack, left(deadline)).map_err(|_| {
        CommError::Rejected {
            addr: format!("rank {next} at {next_addr}"),
        }
    })?;
    let _ = TcpStream::set_nonblocking(&recv, false);
    Ok(Link {
        send,
        recv,
        next,
        prev,
        next_addr,
        prev_addr,
    })
}
