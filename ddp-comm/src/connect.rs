//! Connecting a rank's two ring links once rendezvous has decided what carries each.
//!
//! Each rank connects to its successor and presents the job's token (`wire::hello`), then
//! accepts its predecessor, checks its token and rank and acknowledges it, then waits for
//! its successor's acknowledgement; the writes go to kernel buffers, so no rank waits on a
//! cycle. Connections that do not present the token, or claim another rank, are dropped.
//!
//! - TCP: the successor's published address; the acknowledgement is one byte.
//! - Shared memory: the successor's abstract Unix socket (`@ddp-comm/<pid>/<rank>/<random>`,
//!   gone when the process exits, never a file). The hello carries the sender's bell
//!   (`SCM_RIGHTS`); only after the token check does the receiver create the ring segment
//!   and send it, with its own bell, in the acknowledgement. The connection stays open as
//!   the link's hang-up signal.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::link::{Link, LinkKind, RecvEnd, SendEnd};
use crate::shm::{self, Bell, Peer, PendingRing, ShmSender};
use crate::store::connect_retry;
use crate::tcp;
use crate::wire;

/// Handshake magic of TCP ring links.
const PEER_MAGIC: &[u8; 4] = b"DDPR";
/// Handshake magic of shared-memory ring links.
const LOCAL_MAGIC: &[u8; 4] = b"DDPL";
/// Longest hello: magic, version, token length, token, rank.
const MAX_HELLO: usize = 4 + 1 + 2 + crate::env::MAX_RUN_ID_LEN + 4;

/// What rank `rank` published.
#[derive(Clone, Debug)]
pub(crate) struct PeerInfo {
    pub rank: usize,
    /// Its TCP listener.
    pub addr: SocketAddr,
    /// Its abstract Unix socket name, when it allows shared memory.
    pub local: Option<String>,
    /// Its host identity.
    pub host: String,
}

/// This rank's listeners for its predecessor.
#[derive(Debug)]
pub(crate) struct Listeners {
    tcp: TcpListener,
    local: Option<(UnixListener, String)>,
}

impl Listeners {
    /// A TCP listener on `tcp_addr` (port 0: any) and, with `local`, an abstract Unix one.
    pub(crate) fn bind(
        tcp_addr: SocketAddr,
        socket_buffer: usize,
        local: bool,
        rank: usize,
    ) -> Result<Self, CommError> {
        let tcp = TcpListener::bind(tcp_addr).map_err(|source| CommError::Address {
            addr: tcp_addr.to_string(),
            source,
        })?;
        if socket_buffer > 0 {
            use std::os::fd::AsRawFd;
            tcp::set_buffer(tcp.as_raw_fd(), socket_buffer)
                .map_err(|e| CommError::io("ring listener buffers", e))?;
        }
        let local = if local { Some(bind_local(rank)?) } else { None };
        Ok(Listeners { tcp, local })
    }

    pub(crate) fn tcp_addr(&self) -> Result<SocketAddr, CommError> {
        self.tcp
            .local_addr()
            .map_err(|e| CommError::io("ring listener", e))
    }

    /// The abstract socket's name, if this rank allows shared memory.
    pub(crate) fn local_name(&self) -> Option<String> {
        self.local.as_ref().map(|(_, name)| name.clone())
    }
}

fn bind_local(rank: usize) -> Result<(UnixListener, String), CommError> {
    use std::hash::{BuildHasher, Hasher};
    let mut last = None;
    for _ in 0..8 {
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let name = format!("ddp-comm/{}/{rank}/{random:016x}", std::process::id());
        let bound = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .and_then(|addr| UnixListener::bind_addr(&addr));
        match bound {
            Ok(listener) => return Ok((listener, name)),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => last = Some(e),
            Err(e) => return Err(local_error("listening on an abstract Unix socket", e)),
        }
    }
    Err(local_error(
        "listening on an abstract Unix socket",
        last.unwrap_or_else(|| io::Error::other("no name")),
    ))
}

fn local_error(what: &str, e: io::Error) -> CommError {
    CommError::io(
        format!("{what} for shared memory (DDP_TRANSPORT=tcp uses TCP instead)"),
        e,
    )
}

fn abstract_addr(name: &str) -> io::Result<std::os::unix::net::SocketAddr> {
    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
}

/// What [`ring`] needs besides the listeners and peers.
#[derive(Debug)]
pub(crate) struct RingPlan<'a> {
    pub rank: usize,
    pub token: &'a [u8],
    pub socket_buffer: usize,
    pub shm_capacity: usize,
    pub timeout: Duration,
    pub deadline: Instant,
}

impl RingPlan<'_> {
    fn left(&self) -> Duration {
        self.deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(10))
    }
}

/// A connection to the successor whose acknowledgement is still due.
enum Pending {
    Tcp(TcpStream),
    Shm(UnixStream),
}

/// Connects both links: to `next` carried by `next_kind`, from `prev` by `prev_kind`.
pub(crate) fn ring(
    plan: &RingPlan<'_>,
    listeners: &Listeners,
    (next, next_kind): (&PeerInfo, LinkKind),
    (prev, prev_kind): (&PeerInfo, LinkKind),
) -> Result<Link, CommError> {
    let uses_shm = next_kind == LinkKind::SharedMemory || prev_kind == LinkKind::SharedMemory;
    let bell = if uses_shm {
        Some(Bell::new().map_err(|e| local_error("creating an eventfd", e))?)
    } else {
        None
    };
    let pending = match next_kind {
        LinkKind::Tcp => Pending::Tcp(connect_tcp(plan, next)?),
        LinkKind::SharedMemory => {
            Pending::Shm(connect_local(plan, next, bell.as_ref().expect("bell"))?)
        }
    };
    let recv = match prev_kind {
        LinkKind::Tcp => accept_tcp(plan, &listeners.tcp, prev)?,
        LinkKind::SharedMemory => {
            let (listener, name) = listeners
                .local
                .as_ref()
                .expect("a shared-memory link implies a local listener");
            accept_local(plan, listener, name, prev, bell.as_ref().expect("bell"))?
        }
    };
    let send = match pending {
        Pending::Tcp(mut stream) => {
            let mut ack = [0u8; 1];
            tcp::read_exact_timeout(&mut stream, &mut ack, plan.left()).map_err(|_| {
                CommError::Rejected {
                    addr: format!("rank {} at {}", next.rank, next.addr),
                }
            })?;
            SendEnd::Tcp {
                stream,
                addr: next.addr,
            }
        }
        Pending::Shm(stream) => SendEnd::Shm(finish_local(plan, stream, next)?),
    };
    Ok(Link {
        next: next.rank,
        prev: prev.rank,
        send,
        recv,
        bell,
    })
}

fn connect_tcp(plan: &RingPlan<'_>, next: &PeerInfo) -> Result<TcpStream, CommError> {
    let mut send = connect_retry(&[next.addr], plan.deadline, &format!("rank {}", next.rank))?;
    tcp::tune_socket(&send, plan.socket_buffer).map_err(|e| CommError::io("ring socket", e))?;
    send.write_all(&wire::hello(PEER_MAGIC, plan.token, plan.rank as u32))
        .map_err(|e| CommError::PeerLost {
            op: "rendezvous",
            peer: next.rank,
            via: format!("tcp {}", next.addr),
            detail: e.to_string(),
        })?;
    Ok(send)
}

fn connect_local(
    plan: &RingPlan<'_>,
    next: &PeerInfo,
    bell: &Bell,
) -> Result<UnixStream, CommError> {
    let name = next.local.as_deref().unwrap_or_default();
    let what = || {
        format!(
            "connecting to rank {}'s shared-memory socket @{name}",
            next.rank
        )
    };
    let stream = abstract_addr(name)
        .and_then(|addr| UnixStream::connect_addr(&addr))
        .map_err(|e| local_error(&what(), e))?;
    let hello = wire::hello(LOCAL_MAGIC, plan.token, plan.rank as u32);
    shm::send_with_fds(&stream, &hello, &[bell.fd()]).map_err(|e| local_error(&what(), e))?;
    Ok(stream)
}

/// Accepts connections until one presents the token and `prev`'s rank (`check` reads and
/// judges the hello); drops and logs the others.
fn accept_from<S, T>(
    plan: &RingPlan<'_>,
    what: &str,
    prev: usize,
    mut accept: impl FnMut() -> io::Result<(S, String)>,
    mut check: impl FnMut(&mut S) -> io::Result<Result<(u32, T), String>>,
) -> Result<(S, T), CommError> {
    loop {
        match accept() {
            Ok((mut stream, from)) => match check(&mut stream) {
                Ok(Ok((r, extra))) if r as usize == prev => return Ok((stream, extra)),
                Ok(Ok((r, _))) => tracing::warn!("ddp-comm: rank {} dropped a ring connection from {from} claiming rank {r} (expected {prev})", plan.rank),
                Ok(Err(why)) => tracing::warn!("ddp-comm: rank {} rejected a connection from {from}: {why}", plan.rank),
                Err(e) => tracing::warn!("ddp-comm: rank {} rejected a connection from {from}: incomplete handshake ({e})", plan.rank),
            },
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= plan.deadline {
                    return Err(CommError::RendezvousTimeout {
                        addr: what.to_string(),
                        timeout: plan.timeout,
                        missing: vec![prev],
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(CommError::io(format!("accepting rank {prev} on {what}"), e)),
        }
    }
}

fn accept_tcp(
    plan: &RingPlan<'_>,
    listener: &TcpListener,
    prev: &PeerInfo,
) -> Result<RecvEnd, CommError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io("ring listener", e))?;
    let what = format!(
        "ring listener {}",
        listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default()
    );
    let (mut stream, ()) = accept_from(
        plan,
        &what,
        prev.rank,
        || listener.accept().map(|(s, from)| (s, from.to_string())),
        |stream: &mut TcpStream| {
            stream.set_nonblocking(false)?;
            stream.set_read_timeout(Some(plan.left().min(Duration::from_secs(10))))?;
            Ok(wire::read_hello(stream, PEER_MAGIC, plan.token)?.map(|r| (r, ())))
        },
    )?;
    let _ = stream.set_read_timeout(None);
    tcp::tune_socket(&stream, plan.socket_buffer).map_err(|e| CommError::io("ring socket", e))?;
    stream.write_all(&[1]).map_err(|e| CommError::PeerLost {
        op: "rendezvous",
        peer: prev.rank,
        via: format!("tcp {}", prev.addr),
        detail: e.to_string(),
    })?;
    Ok(RecvEnd::Tcp {
        stream,
        addr: prev.addr,
    })
}

fn peer_pid(stream: &UnixStream) -> u32 {
    rustix::net::sockopt::socket_peercred(stream)
        .map(|cred| cred.pid.as_raw_pid() as u32)
        .unwrap_or(0)
}

fn accept_local(
    plan: &RingPlan<'_>,
    listener: &UnixListener,
    name: &str,
    prev: &PeerInfo,
    bell: &Bell,
) -> Result<RecvEnd, CommError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| local_error("shared-memory listener", e))?;
    let what = format!("shared-memory socket @{name}");
    let (stream, prev_bell) = accept_from(
        plan,
        &what,
        prev.rank,
        || {
            listener.accept().map(|(s, _)| {
                let from = format!("pid {} (shared memory)", peer_pid(&s));
                (s, from)
            })
        },
        |stream: &mut UnixStream| {
            stream.set_nonblocking(false)?;
            stream.set_read_timeout(Some(plan.left().min(Duration::from_secs(10))))?;
            let mut first = [0u8; MAX_HELLO];
            let (n, mut fds) = shm::recv_with_fds(stream, &mut first)?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let mut rest: &UnixStream = stream;
            let mut hello = (&first[..n]).chain(&mut rest);
            Ok(
                match wire::read_hello(&mut hello, LOCAL_MAGIC, plan.token)? {
                    Ok(r) if fds.len() == 1 => Ok((r, fds.remove(0))),
                    Ok(_) => Err(format!("expected 1 descriptor, got {}", fds.len())),
                    Err(why) => Err(why),
                },
            )
        },
    )?;
    let lost = |e: io::Error| CommError::PeerLost {
        op: "rendezvous",
        peer: prev.rank,
        via: format!("shared memory, pid {}", peer_pid(&stream)),
        detail: e.to_string(),
    };
    // Only now, with the token checked, does the segment exist and leave this process.
    let (segment, pending) = PendingRing::create(plan.shm_capacity)
        .map_err(|e| local_error("creating a shared-memory ring", e))?;
    shm::send_with_fds(&stream, &[1], &[segment.as_fd(), bell.fd()]).map_err(lost)?;
    drop(segment);
    stream.set_read_timeout(None).map_err(lost)?;
    let pid = peer_pid(&stream);
    Ok(RecvEnd::Shm(
        pending.into_receiver(Peer::new(stream, pid, prev_bell)),
    ))
}

/// Reads the successor's acknowledgement (its ring segment and bell) and maps the ring.
fn finish_local(
    plan: &RingPlan<'_>,
    stream: UnixStream,
    next: &PeerInfo,
) -> Result<ShmSender, CommError> {
    let name = next.local.as_deref().unwrap_or_default();
    let rejected = || CommError::Rejected {
        addr: format!("rank {} at shared-memory socket @{name}", next.rank),
    };
    stream
        .set_read_timeout(Some(plan.left()))
        .map_err(|e| local_error("shared-memory socket", e))?;
    let mut ack = [0u8; 1];
    let (n, fds) = shm::recv_with_fds(&stream, &mut ack).map_err(|_| rejected())?;
    let [segment, bell]: [OwnedFd; 2] = match fds.try_into() {
        Ok(fds) if n == 1 && ack[0] == 1 => fds,
        _ => return Err(rejected()),
    };
    stream
        .set_read_timeout(None)
        .map_err(|e| local_error("shared-memory socket", e))?;
    let pid = peer_pid(&stream);
    let sender = ShmSender::open(&segment, Peer::new(stream, pid, bell)).map_err(|detail| {
        CommError::Rendezvous {
            addr: format!("shared-memory socket @{name}"),
            detail: format!("rank {} sent an unusable ring: {detail}", next.rank),
        }
    })?;
    Ok(sender)
}
