//! Connecting a rank's two ring links once rendezvous has decided what carries each.
//!
//! Each rank connects to its successor (on a thread of its own) while it accepts its
//! predecessor, and every connection runs the mutual challenge–response of `security/auth.rs` before
//! anything else crosses it: the connecting rank trusts only a successor that proves the job's
//! secret, the accepting rank keeps only a connection that proves it and claims the rank it
//! expects, and drops (and logs, and counts) the others. The accepting side gives each
//! connection [`auth::HANDSHAKE_TIMEOUT`] from the moment it accepts it; the connecting side
//! waits until the rendezvous deadline, since its successor may be busy with a stranger first.
//!
//! Neither half outwaits a failure: when one half fails, the other stops (its loops check a
//! shared flag, and its handshake's socket is shut down), and the accepting side polls the
//! store's `abort` meanwhile, so that another rank's failure stops this one too.
//!
//! - TCP: the successor's published address; the acknowledgement is one byte.
//! - Shared memory: the successor's abstract Unix socket (`@ddp-comm/<pid>/<rank>/<random>`,
//!   gone when the process exits, never a file). Both sides also check that the other runs
//!   as the same user (`SO_PEERCRED`). The sender's bell (`SCM_RIGHTS`) goes with its proof,
//!   after the receiver has proven the secret; only once the sender's proof checks out does
//!   the receiver create the ring segment and send it, with its own bell, in the
//!   acknowledgement. The connection stays open as the link's hang-up signal.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::ring::connect::cancel::{Cancel, Half};
use crate::ring::link::{Link, LinkKind, RecvEnd, SendEnd};
use crate::ring::shm::{self, Bell, Peer, PendingRing, ShmSender};
use crate::security::auth::{self, Failed, Timeouts};
use crate::security::secret::Secret;
use crate::security::throttle::{closer, more, Closer, Handshakes, Room, Throttle};
use crate::tcp;

mod cancel;

/// Handshake magic of TCP ring links.
const PEER_MAGIC: &[u8; 4] = b"DDPR";
/// Handshake magic of shared-memory ring links.
const LOCAL_MAGIC: &[u8; 4] = b"DDPL";

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
    /// A TCP listener on `tcp_addr` (port 0: any; an unspecified IP: every interface of both
    /// IP families) and, with `local`, an abstract Unix one.
    pub(crate) fn bind(
        tcp_addr: SocketAddr,
        socket_buffer: usize,
        local: bool,
        rank: usize,
    ) -> Result<Self, CommError> {
        let tcp = tcp::listen(tcp_addr).map_err(|source| CommError::Address {
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
    pub secret: &'a Secret,
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

    /// The deadline of a handshake the accepting side starts now.
    fn handshake_deadline(&self) -> Instant {
        Instant::now() + self.left().min(auth::HANDSHAKE_TIMEOUT)
    }

    /// The deadline of the connecting side's handshake: the rendezvous deadline (the
    /// successor may first be busy judging a stranger), at least 10 ms from now.
    fn connect_deadline(&self) -> Instant {
        Instant::now() + self.left()
    }
}

/// How often the accepting side looks for an `abort` in the store.
const ABORT_POLL: Duration = Duration::from_millis(50);

/// Connects both links: to `next` carried by `next_kind`, from `prev` by `prev_kind`.
/// `poll` says whether the rendezvous goes on (an error: another rank aborted it); it is
/// called every [`ABORT_POLL`] until both links stand. The first failure, of either half
/// or `poll`, stops the other half and is the error.
pub(crate) fn ring(
    plan: &RingPlan<'_>,
    listeners: &Listeners,
    (next, next_kind): (&PeerInfo, LinkKind),
    (prev, prev_kind): (&PeerInfo, LinkKind),
    poll: &mut dyn FnMut() -> Result<(), CommError>,
) -> Result<Link, CommError> {
    let uses_shm = next_kind == LinkKind::SharedMemory || prev_kind == LinkKind::SharedMemory;
    let bell = if uses_shm {
        Some(Bell::new().map_err(|e| local_error("creating an eventfd", e))?)
    } else {
        None
    };
    let bell_ref = bell.as_ref();
    let cancel = Cancel::default();
    // Both handshakes wait for the other rank's, so they run at once: every rank's
    // connecting side only needs its successor's accepting side, which needs nothing.
    let (send, recv) = std::thread::scope(|scope| {
        let cancel = &cancel;
        let connecting = std::thread::Builder::new()
            .name("ddp-ring-connect".into())
            .spawn_scoped(scope, || {
                let sent = match next_kind {
                    LinkKind::Tcp => connect_tcp(plan, next, cancel),
                    LinkKind::SharedMemory => connect_local(
                        plan,
                        next,
                        bell_ref.expect("a shared-memory link has a bell"),
                        cancel,
                    )
                    .map(SendEnd::Shm),
                };
                if sent.is_err() {
                    cancel.stop(Half::Connecting);
                }
                sent
            });
        let mut recv = match prev_kind {
            LinkKind::Tcp => accept_tcp(plan, &listeners.tcp, prev, cancel, poll),
            // The kind comes from this rank's record in the store; without a listener of
            // its own (a forged record), there is nothing to accept on.
            LinkKind::SharedMemory => match (&listeners.local, bell_ref) {
                (Some((listener, name)), Some(bell)) => {
                    accept_local(plan, listener, name, prev, bell, cancel, poll)
                }
                _ => Err(CommError::InvalidArgument(format!(
                    "rank {} was asked for a shared-memory link from rank {} but does not \
                     listen for one (DDP_TRANSPORT=tcp?)",
                    plan.rank, prev.rank
                ))),
            },
        };
        if recv.is_err() {
            cancel.stop(Half::Accepting);
        }
        let send = match connecting {
            Ok(thread) => {
                // The successor may still be on its way: an abort meanwhile stops this rank.
                let mut next_poll = Instant::now() + ABORT_POLL;
                while recv.is_ok() && !thread.is_finished() && !cancel.is_set() {
                    std::thread::sleep(Duration::from_millis(2));
                    if Instant::now() < next_poll {
                        continue;
                    }
                    next_poll = Instant::now() + ABORT_POLL;
                    if let Err(e) = poll() {
                        cancel.stop(Half::Accepting);
                        recv = Err(e);
                    }
                }
                thread.join().unwrap_or_else(|_| {
                    Err(CommError::io(
                        format!("connecting to rank {}", next.rank),
                        io::Error::other("the connecting thread panicked"),
                    ))
                })
            }
            Err(e) => Err(CommError::io("spawning the ring's connecting thread", e)),
        };
        (send, recv)
    });
    match (send, recv) {
        (Ok(send), Ok(recv)) => Ok(Link {
            next: next.rank,
            prev: prev.rank,
            send,
            recv,
            bell,
        }),
        (Err(e), Ok(_)) | (Ok(_), Err(e)) => Err(e),
        // The half that failed first stopped the other: its error is the news.
        (Err(sent), Err(received)) => Err(match cancel.first() {
            Some(Half::Connecting) => sent,
            _ => received,
        }),
    }
}

/// Connects to the successor's TCP listener and proves the secret both ways, connecting
/// again while the listener turns connections away before its challenge.
fn connect_tcp(
    plan: &RingPlan<'_>,
    next: &PeerInfo,
    cancel: &Cancel,
) -> Result<SendEnd, CommError> {
    auth::handshake_retrying(plan.deadline, || {
        cancel.check(&format!("connecting to rank {}", next.rank))?;
        connect_tcp_once(plan, next, cancel)
    })
}

fn connect_tcp_once(
    plan: &RingPlan<'_>,
    next: &PeerInfo,
    cancel: &Cancel,
) -> Result<SendEnd, CommError> {
    let stream = tcp::connect_until(
        &[next.addr],
        plan.deadline,
        &format!("ring link to rank {}", next.rank),
        || cancel.is_set(),
    )?;
    tcp::tune_socket(&stream, plan.socket_buffer).map_err(|e| CommError::io("ring socket", e))?;
    let peer = || format!("rank {} at {}", next.rank, next.addr);
    let deadline = plan.connect_deadline();
    let watched = cancel.watch(stream.as_fd())?;
    let answered = auth::tcp_client(&stream, plan.secret, PEER_MAGIC, plan.rank as u32, deadline);
    drop(watched);
    cancel.check(&format!("connecting to {}", peer()))?;
    match answered {
        Ok(1) => {}
        Ok(ack) => {
            return Err(CommError::Rendezvous {
                addr: peer(),
                detail: format!("acknowledged the ring link with {ack}, expected 1"),
            })
        }
        Err(failed) => return Err(failed.into_error(peer())),
    }
    stream
        .set_timeouts(None)
        .map_err(|e| CommError::io("ring socket", e))?;
    Ok(SendEnd::Tcp {
        stream,
        addr: next.addr,
    })
}

/// Connects to the successor's abstract socket, proves the secret both ways (the bell goes
/// with this side's proof) and maps the ring it sends back.
/// A successor busy judging other connections turns this one away before its challenge:
/// connected again until the deadline, as over TCP.
fn connect_local(
    plan: &RingPlan<'_>,
    next: &PeerInfo,
    bell: &Bell,
    cancel: &Cancel,
) -> Result<ShmSender, CommError> {
    auth::handshake_retrying(plan.deadline, || {
        cancel.check(&format!("connecting to rank {}", next.rank))?;
        connect_local_once(plan, next, bell, cancel)
    })
}

fn connect_local_once(
    plan: &RingPlan<'_>,
    next: &PeerInfo,
    bell: &Bell,
    cancel: &Cancel,
) -> Result<ShmSender, CommError> {
    let name = next.local.as_deref().unwrap_or_default();
    let peer = || format!("rank {} at shared-memory socket @{name}", next.rank);
    let stream = abstract_addr(name)
        .and_then(|addr| UnixStream::connect_addr(&addr))
        .map_err(|e| local_error(&format!("connecting to {}", peer()), e))?;
    let watched = cancel.watch(stream.as_fd())?;
    let ring = connect_local_over(plan, next, bell, stream, &peer);
    drop(watched);
    cancel.check(&format!("connecting to {}", peer()))?;
    ring
}

/// The handshake of [`connect_local`] over its connection `stream` to `peer`.
fn connect_local_over(
    plan: &RingPlan<'_>,
    next: &PeerInfo,
    bell: &Bell,
    stream: UnixStream,
    peer: &dyn Fn() -> String,
) -> Result<ShmSender, CommError> {
    let name = next.local.as_deref().unwrap_or_default();
    auth::same_user(&stream).map_err(|failure| CommError::Handshake {
        addr: peer(),
        failure,
    })?;
    let deadline = plan.connect_deadline();
    let start = Instant::now();
    let fail = |e: io::Error| {
        Failed::from_io(
            auth::timed_out(e),
            plan.secret,
            deadline.saturating_duration_since(start),
        )
        .into_error(peer())
    };
    // A hang-up before the challenge: the successor turned the connection away (judging
    // too many handshakes at once).
    let turned_away = |e: io::Error| {
        let waited = deadline.saturating_duration_since(start);
        Failed::before_challenge(auth::timed_out(e), plan.secret, waited).into_error(peer())
    };
    let client = auth::Client::new(plan.secret, LOCAL_MAGIC, plan.rank as u32)
        .map_err(|e| CommError::io("starting a handshake", e))?;
    auth::write_by(&stream, &client.hello(), deadline).map_err(turned_away)?;
    let mut challenge = [0u8; auth::CHALLENGE_LEN];
    auth::read_by(&stream, &mut challenge, deadline).map_err(turned_away)?;
    let proof = client
        .answer(&challenge)
        .ok_or_else(|| Failed::unproven(plan.secret).into_error(peer()))?;
    stream
        .set_timeouts(Some(auth::left(deadline).map_err(fail)?))
        .map_err(fail)?;
    shm::send_with_fds(&stream, &proof, &[bell.fd()]).map_err(fail)?;
    let mut ack = [0u8; 1];
    let (n, fds) = shm::recv_with_fds(&stream, &mut ack).map_err(fail)?;
    if n == 0 {
        return Err(fail(io::ErrorKind::UnexpectedEof.into()));
    }
    let [segment, bell]: [OwnedFd; 2] = match fds.try_into() {
        Ok(fds) if ack[0] == 1 => fds,
        _ => {
            return Err(CommError::Rendezvous {
                addr: peer(),
                detail: "acknowledged the link without a ring and a bell".into(),
            })
        }
    };
    stream
        .set_timeouts(None)
        .map_err(|e| local_error("shared-memory socket", e))?;
    let pid = peer_pid(&stream);
    let opened =
        check_bell(&bell).and_then(|()| ShmSender::open(&segment, Peer::new(stream, pid, bell)));
    opened.map_err(|detail| CommError::Rendezvous {
        addr: format!("shared-memory socket @{name}"),
        detail: format!("rank {} sent an unusable ring: {detail}", next.rank),
    })
}

/// Handshakes judged at once on one ring listener ([`Handshakes`]): one more closes the
/// oldest (strangers cannot pile up threads, nor hold every slot; each has
/// [`auth::HANDSHAKE_TIMEOUT`]).
const MAX_JUDGED: usize = 32;

/// Warnings about connections turned away on the ring listeners: a burst, then counts.
static TURNED_AWAY: Throttle = Throttle::new(Duration::from_secs(10), 20);

/// Accepts connections until one proves the secret and claims `prev`'s rank (`check` runs
/// the accepting side of the handshake, with the job's secret and the handshake's deadline,
/// and judges it); drops, logs and counts the others. `accept` gives each connection with
/// what shuts it down, should its slot be needed. Each connection is judged on a
/// thread of its own, so a stranger that stalls its handshake does not hold the
/// predecessor back. Gives up when `cancel` is set (the connecting half failed), when
/// `poll` fails (every [`ABORT_POLL`]: another rank aborted), or at the deadline, with a
/// timeout that counts the connections turned away.
fn accept_from<S, T, C>(
    plan: &RingPlan<'_>,
    what: &str,
    prev: usize,
    mut accept: impl FnMut() -> io::Result<(S, String, Closer)>,
    check: C,
    cancel: &Cancel,
    poll: &mut dyn FnMut() -> Result<(), CommError>,
) -> Result<(S, T), CommError>
where
    S: Send + 'static,
    T: Send + 'static,
    C: Fn(&mut S, &Secret, Instant) -> io::Result<Result<(u32, T), String>>
        + Clone
        + Send
        + 'static,
{
    let (found, judged) = std::sync::mpsc::channel::<(S, T)>();
    let in_flight = Handshakes::new(MAX_JUDGED);
    let turned_away = Arc::new(AtomicUsize::new(0));
    let rank = plan.rank;
    let mut next_poll = Instant::now() + ABORT_POLL;
    loop {
        if let Ok(winner) = judged.try_recv() {
            return Ok(winner);
        }
        cancel.check(&format!("accepting rank {prev} on {what}"))?;
        if Instant::now() >= next_poll {
            poll()?;
            next_poll = Instant::now() + ABORT_POLL;
        }
        match accept() {
            Ok((mut stream, from, close)) => {
                let Some((slot, room)) = in_flight.admit(close) else {
                    turned_away.fetch_add(1, Ordering::Relaxed);
                    if let Some(n) = TURNED_AWAY.admit() {
                        tracing::warn!("ddp-comm: rank {rank} closed a connection from {from}: {MAX_JUDGED} handshakes already in progress, and as many closed ones not yet gone{}", more(n));
                    }
                    continue;
                };
                if room == Room::ClosedOldest {
                    if let Some(n) = TURNED_AWAY.admit() {
                        tracing::warn!("ddp-comm: rank {rank} closed the oldest of {MAX_JUDGED} handshakes in progress to judge a connection from {from}{}", more(n));
                    }
                }
                let (found, check, refused) = (found.clone(), check.clone(), turned_away.clone());
                let (secret, deadline) = (plan.secret.clone(), plan.handshake_deadline());
                let spawned = std::thread::Builder::new()
                    .name("ddp-ring-accept".into())
                    .spawn(move || {
                        let why = match check(&mut stream, &secret, deadline) {
                            Ok(Ok((r, extra))) if r as usize == prev => {
                                slot.proven();
                                let _ = found.send((stream, extra));
                                None
                            }
                            Ok(Ok((r, _))) => Some(format!("dropped a ring connection from {from} claiming rank {r} (expected {prev})")),
                            Ok(Err(why)) => Some(format!("rejected a connection from {from}: {why}")),
                            Err(e) => Some(format!("rejected a connection from {from}: incomplete handshake ({e})")),
                        };
                        if let Some(why) = why {
                            refused.fetch_add(1, Ordering::Relaxed);
                            if let Some(n) = TURNED_AWAY.admit() {
                                tracing::warn!("ddp-comm: rank {rank} {why}{}", more(n));
                            }
                        }
                        drop(slot);
                    });
                if let Err(e) = spawned {
                    return Err(CommError::io(format!("judging a connection on {what}"), e));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= plan.deadline {
                    if let Ok(winner) = judged.try_recv() {
                        return Ok(winner);
                    }
                    return Err(CommError::RendezvousTimeout {
                        addr: what.to_string(),
                        timeout: plan.timeout,
                        missing: vec![prev],
                        turned_away: turned_away.load(Ordering::Relaxed),
                    });
                }
                if let Ok(winner) = judged.recv_timeout(Duration::from_millis(2)) {
                    return Ok(winner);
                }
            }
            Err(e) => return Err(CommError::io(format!("accepting rank {prev} on {what}"), e)),
        }
    }
}

fn accept_tcp(
    plan: &RingPlan<'_>,
    listener: &TcpListener,
    prev: &PeerInfo,
    cancel: &Cancel,
    poll: &mut dyn FnMut() -> Result<(), CommError>,
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
        || {
            let (s, from) = listener.accept()?;
            let close = closer(s.try_clone()?, TcpStream::shutdown);
            Ok((s, from.to_string(), close))
        },
        |stream: &mut TcpStream, secret: &Secret, deadline: Instant| {
            stream.set_nonblocking(false)?;
            Ok(auth::tcp_server(stream, secret, PEER_MAGIC, deadline).map(|r| (r, ())))
        },
        cancel,
        poll,
    )?;
    let lost = |e: io::Error| CommError::PeerLost {
        op: "rendezvous",
        peer: prev.rank,
        via: format!("tcp {}", prev.addr),
        detail: e.to_string(),
    };
    stream.set_timeouts(None).map_err(lost)?;
    tcp::tune_socket(&stream, plan.socket_buffer).map_err(|e| CommError::io("ring socket", e))?;
    stream.write_all(&[1]).map_err(lost)?;
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

/// The accepting side of a shared-memory handshake: the same user, the secret proven, one
/// descriptor (the sender's bell) with the proof. Returns the claimed rank and the bell.
fn check_local(
    stream: &mut UnixStream,
    secret: &Secret,
    deadline: Instant,
) -> io::Result<Result<(u32, OwnedFd), String>> {
    stream.set_nonblocking(false)?;
    if let Err(failure) = auth::same_user(stream) {
        return Ok(Err(failure.to_string()));
    }
    let stream: &UnixStream = stream;
    let server = match auth::Server::read(secret, LOCAL_MAGIC, |buf| {
        auth::read_by(stream, buf, deadline)
    })? {
        Ok(server) => server,
        Err(why) => return Ok(Err(why)),
    };
    auth::write_by(stream, &server.challenge(), deadline)?;
    stream.set_timeouts(Some(auth::left(deadline)?))?;
    let mut proof = [0u8; auth::PROOF_LEN];
    let (n, mut fds) = shm::recv_with_fds(stream, &mut proof).map_err(auth::timed_out)?;
    if n == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    auth::read_by(stream, &mut proof[n..], deadline)?;
    if !server.check(&proof) {
        return Ok(Err(auth::WRONG_PROOF.to_string()));
    }
    if fds.len() != 1 {
        return Ok(Err(format!("expected 1 descriptor, got {}", fds.len())));
    }
    if let Err(why) = check_bell(&fds[0]) {
        return Ok(Err(why));
    }
    Ok(Ok((server.number(), fds.remove(0))))
}

/// Checks a descriptor the peer sent as its bell: ringing it is a write, which on a
/// descriptor in blocking mode (a full pipe) could hang every wake-up, a `Drop` included.
fn check_bell(fd: impl AsFd) -> Result<(), String> {
    let flags =
        rustix::fs::fcntl_getfl(fd).map_err(|e| format!("reading the bell's flags: {e}"))?;
    if !flags.contains(rustix::fs::OFlags::NONBLOCK) {
        return Err("its bell is a descriptor in blocking mode, not its eventfd".into());
    }
    Ok(())
}

fn accept_local(
    plan: &RingPlan<'_>,
    listener: &UnixListener,
    name: &str,
    prev: &PeerInfo,
    bell: &Bell,
    cancel: &Cancel,
    poll: &mut dyn FnMut() -> Result<(), CommError>,
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
            let (s, _) = listener.accept()?;
            let from = format!("pid {} (shared memory)", peer_pid(&s));
            let close = closer(s.try_clone()?, UnixStream::shutdown);
            Ok((s, from, close))
        },
        check_local,
        cancel,
        poll,
    )?;
    let lost = |e: io::Error| CommError::PeerLost {
        op: "rendezvous",
        peer: prev.rank,
        via: format!("shared memory, pid {}", peer_pid(&stream)),
        detail: e.to_string(),
    };
    // Only now, with the secret proven both ways, does the segment exist and leave this
    // process.
    let (segment, pending) = PendingRing::create(plan.shm_capacity)
        .map_err(|e| local_error("creating a shared-memory ring", e))?;
    shm::send_with_fds(&stream, &[1], &[segment.as_fd(), bell.fd()]).map_err(lost)?;
    drop(segment);
    stream.set_timeouts(None).map_err(lost)?;
    let pid = peer_pid(&stream);
    Ok(RecvEnd::Shm(
        pending.into_receiver(Peer::new(stream, pid, prev_bell)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::AuthFailure;
    use std::io::Read;
    use std::sync::{mpsc, Condvar, Mutex};

    #[test]
    fn a_bell_that_could_block_is_refused() {
        assert_eq!(check_bell(Bell::new().unwrap().fd()), Ok(()));
        let (reader, _writer) = std::io::pipe().unwrap();
        let blocking = OwnedFd::from(reader);
        assert_eq!(
            check_bell(&blocking),
            Err("its bell is a descriptor in blocking mode, not its eventfd".to_string())
        );
    }

    fn secret() -> Secret {
        Secret::from_hex(&"ab".repeat(16)).unwrap()
    }

    fn plan(secret: &Secret, timeout: Duration) -> RingPlan<'_> {
        RingPlan {
            rank: 1,
            secret,
            socket_buffer: 0,
            shm_capacity: 0,
            timeout,
            deadline: Instant::now() + timeout,
        }
    }

    fn going_on() -> Result<(), CommError> {
        Ok(())
    }

    #[test]
    fn a_stranger_that_stalls_its_handshake_does_not_hold_the_predecessor_back() {
        let secret = secret();
        let plan = plan(&secret, Duration::from_secs(30));
        // Connection 0 is a stranger whose handshake stalls until released (at most 20 s);
        // connection 1 is rank 0, the predecessor.
        let stalled = Arc::new((Mutex::new(false), Condvar::new()));
        let stranger_done = Arc::new(Mutex::new(false));
        let mut next = 0u32;
        let accept = || {
            let n = next;
            next += 1;
            match n {
                0 | 1 => Ok((n, format!("peer {n}"), Box::new(|| {}) as Closer)),
                _ => Err(io::ErrorKind::WouldBlock.into()),
            }
        };
        let check = {
            let (stalled, stranger_done) = (stalled.clone(), stranger_done.clone());
            move |stream: &mut u32, _: &Secret, _: Instant| {
                if *stream == 0 {
                    let (lock, released) = &*stalled;
                    let guard = lock.lock().unwrap();
                    let _ = released
                        .wait_timeout_while(guard, Duration::from_secs(20), |free| !*free)
                        .unwrap();
                    *stranger_done.lock().unwrap() = true;
                    return Ok(Err("no proof".to_string()));
                }
                Ok(Ok((0u32, "rank 0's end")))
            }
        };
        let cancel = Cancel::default();
        let (stream, extra) = accept_from(
            &plan,
            "test listener",
            0,
            accept,
            check,
            &cancel,
            &mut going_on,
        )
        .unwrap();
        assert_eq!((stream, extra), (1, "rank 0's end"));
        // The predecessor was taken while the stranger still stalled.
        assert!(!*stranger_done.lock().unwrap());
        *stalled.0.lock().unwrap() = true;
        stalled.1.notify_all();
    }

    #[test]
    fn connections_turned_away_are_counted_in_the_timeout() {
        let secret = secret();
        let plan = plan(&secret, Duration::from_millis(300));
        // A stranger, then nobody.
        let mut strangers = 1;
        let accept = || {
            if strangers == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            strangers -= 1;
            Ok(((), "a stranger".to_string(), Box::new(|| {}) as Closer))
        };
        let check = |_: &mut (), _: &Secret, _: Instant| Ok(Err::<(u32, ()), _>("no".into()));
        let got = accept_from(
            &plan,
            "test listener",
            0,
            accept,
            check,
            &Cancel::default(),
            &mut going_on,
        );
        match got {
            Err(CommError::RendezvousTimeout {
                addr,
                missing,
                turned_away,
                ..
            }) => assert_eq!(
                (addr.as_str(), missing, turned_away),
                ("test listener", vec![0], 1)
            ),
            other => panic!("expected a RendezvousTimeout, got {other:?}"),
        }
    }

    /// Rank 1's successor (rank 2) at `addr`, and a predecessor (rank 0) that never comes.
    fn peers(addr: SocketAddr) -> (PeerInfo, PeerInfo) {
        let peer = |rank, addr| PeerInfo {
            rank,
            addr,
            local: None,
            host: "host:test".into(),
        };
        (peer(2, addr), peer(0, "127.0.0.1:9".parse().unwrap()))
    }

    /// A successor that answers each hello with `answer` and then holds the connection
    /// open until the test ends.
    fn successor(answer: Vec<u8>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let answer = answer.clone();
                std::thread::spawn(move || {
                    let mut hello = [0u8; auth::HELLO_LEN];
                    if stream.read_exact(&mut hello).is_ok() {
                        let _ = stream.write_all(&answer);
                    }
                    let _ = std::io::copy(&mut stream, &mut std::io::sink());
                });
            }
        });
        addr
    }

    /// Runs [`ring`] for rank 1 with a 120 s deadline on a thread; its result, which must
    /// come long before the deadline.
    fn ring_of_rank_1(
        next: SocketAddr,
        mut poll: impl FnMut() -> Result<(), CommError> + Send + 'static,
    ) -> Result<Link, CommError> {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let secret = secret();
            let plan = plan(&secret, Duration::from_secs(120));
            let listeners =
                Listeners::bind("127.0.0.1:0".parse().unwrap(), 0, false, plan.rank).unwrap();
            let (next, prev) = peers(next);
            let _ = tx.send(ring(
                &plan,
                &listeners,
                (&next, LinkKind::Tcp),
                (&prev, LinkKind::Tcp),
                &mut poll,
            ));
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("the ring waited on after a failure")
    }

    #[test]
    fn a_failed_connection_to_the_successor_stops_the_wait_for_the_predecessor() {
        // A successor that cannot prove the secret.
        let next = successor(vec![0x5a; auth::CHALLENGE_LEN]);
        match ring_of_rank_1(next, going_on) {
            Err(CommError::Handshake {
                addr,
                failure: AuthFailure::Unproven { .. },
            }) => assert_eq!(addr, format!("rank 2 at {next}")),
            other => panic!("expected a Handshake error, got {other:?}"),
        }
    }

    #[test]
    fn an_abort_stops_both_halves_even_mid_handshake() {
        // A successor that takes the hello and never answers: the connecting half waits in
        // its handshake, the accepting half for a predecessor that never comes.
        let next = successor(Vec::new());
        let mut polls = 0;
        let poll = move || {
            polls += 1;
            if polls < 3 {
                return Ok(());
            }
            Err(CommError::Rendezvous {
                addr: "the store".into(),
                detail: "another rank aborted: rank 0: gone".into(),
            })
        };
        match ring_of_rank_1(next, poll) {
            Err(CommError::Rendezvous { addr, detail }) => assert_eq!(
                (addr.as_str(), detail.as_str()),
                ("the store", "another rank aborted: rank 0: gone")
            ),
            other => panic!("expected the abort, got {other:?}"),
        }
    }
}
