//! The rendezvous key-value store: a small TCP server that rank 0 runs (set / get / add /
//! check, as c10d's TCPStore) and its client.
//!
//! Every connection starts with the mutual challenge–response of `security/auth.rs`: a client serves
//! nothing to, and trusts nothing from, a server that cannot prove the job's secret; the
//! server drops connections that cannot prove it (and keeps serving the others), and bounds
//! every length it reads before allocating.
//! Clients poll (`check`) to wait, so the server never blocks on behalf of a client and a
//! waiting rank can notice an abort or its own deadline.
//!
//! Beside it: `c10d.rs`, a client of torchrun's own store, and `signed.rs`, the tags with
//! which ranks authenticate the values they keep there; `wire.rs`, the framing both
//! protocols share; `heartbeat.rs`, the heartbeats every rank keeps in the store and the
//! diagnosis of a collective that timed out.

pub(crate) mod c10d;
pub(crate) mod heartbeat;
pub(crate) mod signed;
mod wire;

use std::collections::HashMap;
use std::io::{self, BufReader, Read};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::security::auth::{self, Timeouts};
use crate::security::secret::Secret;
use crate::tcp::Connection;

use crate::security::throttle::{closer, more, Handshakes, Room, Slot, Throttle};

/// Warnings about refused and dropped connections: a burst, then counts (a flood of
/// strangers must not become a flood of log lines).
static REFUSED: Throttle = Throttle::new(Duration::from_secs(10), 20);
static DROPPED: Throttle = Throttle::new(Duration::from_secs(10), 20);

const STORE_MAGIC: &[u8; 4] = b"DDPS";
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const STATUS_OK: u8 = 0;
const STATUS_MISSING: u8 = 1;
const STATUS_ERROR: u8 = 2;

/// Connections that may be in their handshake at once ([`Handshakes`]): one more closes the
/// oldest, so that strangers cannot pile up threads and descriptors before proving anything
/// (each has [`auth::HANDSHAKE_TIMEOUT`] to prove the secret), nor keep the job's ranks out
/// by holding every slot. A job's own ranks connect twice each (rendezvous, then heartbeat),
/// a client that is turned away connects again.
pub(crate) const MAX_PENDING_HANDSHAKES: usize = 64;

/// A pause after a failed accept (out of descriptors, say), so that the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Warnings about failed accepts and connections left without a thread: they last as long
/// as their cause (the limit of open files), and so would their warnings.
static NO_ROOM: Throttle = Throttle::new(Duration::from_secs(10), 5);

/// The operations rendezvous needs from a store (ours, or torchrun's agent store).
pub(crate) trait Store: Send {
    /// Sets `key` to `value`.
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CommError>;
    /// The value of `key`, if set.
    fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, CommError>;
    /// Adds `delta` to the integer at `key` (0 when unset) and returns the new value.
    fn add(&mut self, key: &str, delta: i64) -> Result<i64, CommError>;
    /// Whether every key is set.
    fn check(&mut self, keys: &[String]) -> Result<bool, CommError>;
    /// The store's address, for messages.
    fn addr(&self) -> &str;
    /// The local IP of the connection to the store: the interface peers can reach us on.
    fn local_ip(&self) -> IpAddr;
    /// The store's IP as this process reaches it: the store's host, for an address a peer
    /// on that host published without an IP of its own.
    fn peer_ip(&self) -> IpAddr;
}

/// `host:port` as the user gives it, in errors: torchrun's variables, a launcher's flags.
fn master_text(host: &str, port: u16) -> String {
    format!("{host}:{port} (MASTER_ADDR:MASTER_PORT, --master-addr/--master-port)")
}

/// One lookup of `host:port` by `lookup`: its addresses, IPv4 first, or why there are none.
fn lookup_once(
    host: &str,
    port: u16,
    lookup: &mut impl FnMut(&str, u16) -> io::Result<Vec<SocketAddr>>,
) -> io::Result<Vec<SocketAddr>> {
    let mut addrs = lookup(host, port)?;
    addrs.sort_by_key(|a| a.is_ipv6());
    if addrs.is_empty() {
        return Err(io::Error::new(io::ErrorKind::NotFound, "no address"));
    }
    Ok(addrs)
}

/// The system's resolver: `getaddrinfo`.
fn system_lookup(host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
    Ok((host, port).to_socket_addrs()?.collect())
}

/// Resolves `host:port` to socket addresses (IPv4 first), once.
pub(crate) fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, CommError> {
    lookup_once(host, port, &mut system_lookup).map_err(|source| CommError::Address {
        addr: master_text(host, port),
        source,
    })
}

/// Resolves `host:port` as [`resolve`] does, retrying a failed lookup (pausing 1 ms, then
/// twice as long each time, up to 50 ms) until `deadline`, as c10d's clients do: a name
/// may resolve only once its host is up (a Kubeflow master pod's headless Service has a
/// DNS record once the pod is ready). Past `deadline`, the last failure, naming
/// `MASTER_ADDR`, as [`CommError::Address`].
pub(crate) fn resolve_until(
    host: &str,
    port: u16,
    deadline: Instant,
) -> Result<Vec<SocketAddr>, CommError> {
    resolve_with(host, port, deadline, system_lookup)
}

/// [`resolve_until`] with the lookup given.
fn resolve_with(
    host: &str,
    port: u16,
    deadline: Instant,
    mut lookup: impl FnMut(&str, u16) -> io::Result<Vec<SocketAddr>>,
) -> Result<Vec<SocketAddr>, CommError> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        let source = match lookup_once(host, port, &mut lookup) {
            Ok(addrs) => return Ok(addrs),
            Err(source) => source,
        };
        let now = Instant::now();
        if now >= deadline {
            let tried = now.duration_since(start);
            return Err(CommError::Address {
                addr: master_text(host, port),
                source: io::Error::new(
                    source.kind(),
                    format!("still not resolved after {tried:.1?} of retries (is its host up?): {source}"),
                ),
            });
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Rank 0's store server; stops (and disconnects every client) when dropped.
#[derive(Debug)]
pub(crate) struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    clients: Clients,
    /// Connections refused in their handshake (see [`StoreServer::turned_away`]).
    turned_away: Arc<AtomicUsize>,
    accept_thread: Option<JoinHandle<()>>,
}

type Table = Arc<Mutex<HashMap<String, Vec<u8>>>>;

/// Open client connections by id, so that the server can disconnect them all when dropped;
/// the list and the connection's thread share its one descriptor.
type Clients = Arc<Mutex<HashMap<u64, Arc<TcpStream>>>>;

impl StoreServer {
    /// Listens on `addr` (an unspecified IP: every interface of both IP families, see
    /// [`tcp::listen`](crate::tcp::listen)); a busy port is [`CommError::PortInUse`].
    /// The caller raises the soft limit of open files for the ranks it expects
    /// ([`tcp::raise_open_file_limit`](crate::tcp::raise_open_file_limit)).
    pub(crate) fn bind(addr: SocketAddr, secret: Secret) -> Result<Self, CommError> {
        let listener = crate::tcp::listen(addr).map_err(|source| match source.kind() {
            io::ErrorKind::AddrInUse => CommError::PortInUse { addr },
            _ => CommError::Address {
                addr: addr.to_string(),
                source,
            },
        })?;
        // Bound to every interface, the server is reached here through loopback.
        let addr = reachable(
            listener
                .local_addr()
                .map_err(|e| CommError::io("store listener address", e))?,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Clients = Arc::default();
        let table: Table = Arc::default();
        let turned_away = Arc::new(AtomicUsize::new(0));
        let accept_thread = {
            let (stop, clients) = (stop.clone(), clients.clone());
            let server = Served {
                secret,
                table,
                turned_away: turned_away.clone(),
            };
            std::thread::Builder::new()
                .name("ddp-store".into())
                .spawn(move || accept_loop(listener, server, stop, clients))
                .map_err(|e| CommError::io("spawning the store thread", e))?
        };
        Ok(StoreServer {
            addr,
            stop,
            clients,
            turned_away,
            accept_thread: Some(accept_thread),
        })
    }

    /// How many connections the store has refused in their handshake so far: strangers,
    /// and ranks whose secret (`DDP_SECRET`, the key file) differs from this one's.
    pub(crate) fn turned_away(&self) -> usize {
        self.turned_away.load(Ordering::Relaxed)
    }

    /// The address this process reaches the server at: where it listens, or loopback
    /// where it listens on every interface.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// `addr`, with `127.0.0.1` in place of an unspecified IP (a socket bound to every
/// interface, by [`tcp::listen`](crate::tcp::listen): of both families, or of IPv4 alone):
/// an address this host can connect to, with or without IPv6 on its loopback.
pub(crate) fn reachable(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), addr.port())
    } else {
        addr
    }
}

/// The IP that stands for every interface in `ip`'s family.
pub(crate) fn unspecified_like(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Ok(clients) = self.clients.lock() {
            for client in clients.values() {
                let _ = client.shutdown(Shutdown::Both);
            }
        }
        if let Some(thread) = self.accept_thread.take() {
            let _ = thread.join();
        }
    }
}

/// What the server's connections share: the secret, the table, the count of refusals.
struct Served {
    secret: Secret,
    table: Table,
    turned_away: Arc<AtomicUsize>,
}

fn accept_loop(listener: TcpListener, server: Served, stop: Arc<AtomicBool>, clients: Clients) {
    let server = Arc::new(server);
    let handshakes = Handshakes::new(MAX_PENDING_HANDSHAKES);
    for (id, stream) in (0u64..).zip(listener.incoming()) {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let stream = match stream {
            Ok(stream) => Arc::new(stream),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // EMFILE, ENFILE, ENOMEM: the condition lasts; retrying at once would spin.
                // The client waits in the backlog meanwhile, or its handshake times out.
                if let Some(dropped) = NO_ROOM.admit() {
                    tracing::warn!("{}{}", accept_failure(&e), more(dropped));
                }
                std::thread::sleep(ACCEPT_BACKOFF);
                continue;
            }
        };
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let close = closer(stream.clone(), |s: &Arc<TcpStream>, how| s.shutdown(how));
        let admitted = handshakes.admit(close);
        if admitted
            .as_ref()
            .is_none_or(|(_, room)| *room == Room::ClosedOldest)
        {
            if let Some(dropped) = REFUSED.admit() {
                let did = match admitted {
                    None => "refused a connection from",
                    Some(_) => "closed the oldest handshake to judge a connection from",
                };
                tracing::warn!(
                    "ddp-comm: store {did} {peer}: {MAX_PENDING_HANDSHAKES} handshakes in \
                     progress{}",
                    more(dropped)
                );
            }
        }
        let Some((guard, _)) = admitted else { continue };
        #[cfg(test)]
        tests::pause_before_listing(&listener);
        // One descriptor per connection, shared by the server's list and its thread.
        if let Ok(mut map) = clients.lock() {
            // The drop sets `stop` before it shuts the listed connections under this lock: a
            // connection accepted meanwhile is closed here, not listed after that sweep and
            // served on by a thread of its own once the server is gone.
            if stop.load(Ordering::SeqCst) {
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
            map.insert(id, stream.clone());
        }
        let (server, clients_of_thread, from) = (server.clone(), clients.clone(), peer.clone());
        let spawned = std::thread::Builder::new()
            .name("ddp-store-conn".into())
            .spawn(move || {
                // The handshake's slot: given back at once by a proven client, otherwise
                // only once the connection's descriptor is closed, so that strangers whose
                // handshakes end together cannot hold more than the cap.
                let mut guard = Some(guard);
                if let Err(why) = serve(&stream, &server, &mut guard) {
                    if let Some(dropped) = DROPPED.admit() {
                        tracing::warn!(
                            "ddp-comm: store dropped connection from {from}: {why}{}",
                            more(dropped)
                        );
                    }
                }
                unlist(&clients_of_thread, id);
                drop(stream);
                drop(guard);
            });
        if let Err(e) = spawned {
            // No thread: the connection is dropped here (and its guard with the closure),
            // and the client hears nothing until its handshake times out.
            unlist(&clients, id);
            if let Some(dropped) = NO_ROOM.admit() {
                tracing::warn!(
                    "ddp-comm: store dropped connection from {peer}: no thread to serve it: \
                     {e}{}",
                    more(dropped)
                );
            }
        }
    }
}

/// Shuts connection `id` down and takes it off the server's list, which must not keep it
/// open once its thread is done with it (or never started).
fn unlist(clients: &Clients, id: u64) {
    if let Ok(mut map) = clients.lock() {
        if let Some(stream) = map.remove(&id) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// The warning of a failed accept; out of descriptors, it names the limit.
fn accept_failure(e: &io::Error) -> String {
    let limit = match e.raw_os_error() {
        Some(libc::EMFILE) => match crate::tcp::open_file_limit() {
            Some(n) => format!(
                " (EMFILE: this process has its soft limit of {n} open files, RLIMIT_NOFILE; \
                 each rank holds two connections: raise `ulimit -n`)"
            ),
            None => " (EMFILE)".to_string(),
        },
        _ => String::new(),
    };
    format!("ddp-comm: store could not accept a connection: {e}{limit}")
}

/// Serves one client until it disconnects; its handshake's slot in `pending` is given back
/// once the client has proven the secret, and a failed handshake is counted in
/// `server.turned_away`. Errors are reasons to drop the connection.
fn serve(stream: &TcpStream, server: &Served, pending: &mut Option<Slot>) -> Result<(), String> {
    let _ = stream.set_nodelay(true);
    let deadline = Instant::now() + auth::store_handshake_timeout();
    auth::tcp_server(stream, &server.secret, STORE_MAGIC, deadline).map_err(|why| {
        server.turned_away.fetch_add(1, Ordering::Relaxed);
        format!("rejected: {why}")
    })?;
    *pending = None;
    stream.set_timeouts(None).map_err(|e| e.to_string())?;
    // One descriptor: reads are buffered, replies written whole.
    let mut reader = BufReader::new(stream);
    let mut writer = stream;
    // From here on the client is one of the job's: its leaving, whenever it happens (a rank
    // that exits, or is killed, with a request unanswered), is no news for the store's log.
    let mut served = || -> io::Result<()> {
        wire::send_all(&mut writer, &[STATUS_OK])?;
        loop {
            let op = wire::read_u8(&mut reader)?;
            let mut reply = Vec::new();
            handle(op, &mut reader, &server.table, &mut reply)?;
            wire::send_all(&mut writer, &reply)?;
        }
    };
    match served() {
        Err(e) if !client_left(&e) => Err(e.to_string()),
        _ => Ok(()),
    }
}

/// Whether `e` says only that the peer closed or reset its end.
fn client_left(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

fn handle(op: u8, r: &mut impl Read, table: &Table, reply: &mut Vec<u8>) -> io::Result<()> {
    let lock = || {
        table
            .lock()
            .map_err(|_| io::Error::other("store table poisoned"))
    };
    match op {
        OP_SET => {
            let key = wire::read_key(r)?;
            let value = wire::read_blob(r, wire::MAX_VALUE_LEN, "value")?;
            lock()?.insert(key, value);
            reply.push(STATUS_OK);
        }
        OP_GET => {
            let key = wire::read_key(r)?;
            match lock()?.get(&key) {
                Some(value) => {
                    reply.push(STATUS_OK);
                    wire::put_blob(reply, value);
                }
                None => reply.push(STATUS_MISSING),
            }
        }
        OP_ADD => {
            let key = wire::read_key(r)?;
            let delta = wire::read_u64(r)? as i64;
            let mut table = lock()?;
            let old = match table.get(&key) {
                None => Some(0),
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok()),
            };
            match old {
                Some(old) => {
                    let new = old.wrapping_add(delta);
                    table.insert(key, new.to_string().into_bytes());
                    reply.push(STATUS_OK);
                    reply.extend_from_slice(&new.to_le_bytes());
                }
                None => {
                    reply.push(STATUS_ERROR);
                    wire::put_blob(
                        reply,
                        format!("key '{key}' does not hold an integer").as_bytes(),
                    );
                }
            }
        }
        OP_CHECK => {
            let count = wire::read_u32(r)? as usize;
            if count > wire::MAX_KEYS {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{count} keys in one check"),
                ));
            }
            let mut keys = Vec::with_capacity(count);
            for _ in 0..count {
                keys.push(wire::read_key(r)?);
            }
            let table = lock()?;
            reply.push(STATUS_OK);
            reply.push(keys.iter().all(|k| table.contains_key(k)) as u8);
        }
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unknown store op {other}"),
            ))
        }
    }
    Ok(())
}

/// A client of [`StoreServer`].
#[derive(Debug)]
pub(crate) struct StoreClient {
    /// Requests are written whole through `reader.get_ref()`.
    reader: BufReader<TcpStream>,
    addr: String,
    local_ip: IpAddr,
    peer_ip: IpAddr,
    request: Vec<u8>,
    /// Set by the first failed request: the connection's answers are then out of step (a
    /// late answer would be read as the next request's), so it is not used again.
    broken: std::cell::Cell<bool>,
}

/// The error of a request on a store connection that an earlier request's failure left out
/// of step (a late answer would be read as this request's): the connection is not used again.
pub(crate) fn out_of_step(addr: &str) -> CommError {
    CommError::Store {
        addr: addr.to_string(),
        detail: "an earlier request on this connection failed; it is not used again".into(),
    }
}

impl StoreClient {
    /// Connects (retrying until `deadline`) and runs the handshake with `secret` (within
    /// `io_timeout`, at most [`auth::HANDSHAKE_TIMEOUT`]), connecting again while the store
    /// turns connections away before its challenge (busy with other handshakes). Each later
    /// request may take at most `io_timeout`.
    pub(crate) fn connect(
        addrs: &[SocketAddr],
        secret: &Secret,
        deadline: Instant,
        io_timeout: Duration,
    ) -> Result<Self, CommError> {
        auth::handshake_retrying(deadline, || {
            Self::connect_once(addrs, secret, deadline, io_timeout)
        })
    }

    fn connect_once(
        addrs: &[SocketAddr],
        secret: &Secret,
        deadline: Instant,
        io_timeout: Duration,
    ) -> Result<Self, CommError> {
        let c = Connection::open(addrs, deadline, io_timeout, "rendezvous store")?;
        let stream = c.reader.get_ref();
        let handshake = Instant::now() + io_timeout.min(auth::HANDSHAKE_TIMEOUT);
        let peer = || format!("the rendezvous store at {}", c.addr);
        match auth::tcp_client(stream, secret, STORE_MAGIC, 0, handshake) {
            Ok(STATUS_OK) => {}
            Ok(status) => {
                return Err(CommError::Store {
                    addr: c.addr.clone(),
                    detail: format!("handshake answered status {status}"),
                })
            }
            Err(failed) => return Err(failed.into_error(peer())),
        }
        stream
            .set_timeouts(Some(io_timeout))
            .map_err(|e| CommError::io(format!("connection to {}", peer()), e))?;
        Ok(StoreClient {
            reader: c.reader,
            addr: c.addr,
            local_ip: c.local_ip,
            peer_ip: c.peer_ip,
            request: Vec::new(),
            broken: std::cell::Cell::new(false),
        })
    }

    fn fail(&self, e: io::Error) -> CommError {
        self.broken.set(true);
        let addr = self.addr.clone();
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe => CommError::StoreClosed { addr },
            _ => CommError::Store {
                addr,
                detail: e.to_string(),
            },
        }
    }

    fn call(&mut self) -> Result<u8, CommError> {
        if self.broken.get() {
            return Err(out_of_step(&self.addr));
        }
        let request = std::mem::take(&mut self.request);
        let sent = wire::send_all(&mut self.reader.get_ref(), &request);
        self.request = request;
        sent.map_err(|e| self.fail(e))?;
        wire::read_u8(&mut self.reader).map_err(|e| self.fail(e))
    }

    fn start(&mut self, op: u8, key: &str) {
        self.request.clear();
        self.request.push(op);
        wire::put_blob(&mut self.request, key.as_bytes());
    }
}

impl Store for StoreClient {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CommError> {
        self.start(OP_SET, key);
        wire::put_blob(&mut self.request, value);
        match self.call()? {
            STATUS_OK => Ok(()),
            s => Err(CommError::Store {
                addr: self.addr.clone(),
                detail: format!("set '{key}': status {s}"),
            }),
        }
    }

    fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, CommError> {
        self.start(OP_GET, key);
        match self.call()? {
            STATUS_OK => wire::read_blob(&mut self.reader, wire::MAX_VALUE_LEN, "value")
                .map(Some)
                .map_err(|e| self.fail(e)),
            STATUS_MISSING => Ok(None),
            s => Err(CommError::Store {
                addr: self.addr.clone(),
                detail: format!("get '{key}': status {s}"),
            }),
        }
    }

    fn add(&mut self, key: &str, delta: i64) -> Result<i64, CommError> {
        self.start(OP_ADD, key);
        self.request.extend_from_slice(&delta.to_le_bytes());
        match self.call()? {
            STATUS_OK => wire::read_u64(&mut self.reader)
                .map(|v| v as i64)
                .map_err(|e| self.fail(e)),
            _ => {
                let detail =
                    wire::read_blob(&mut self.reader, 4096, "error").map_err(|e| self.fail(e))?;
                Err(CommError::Store {
                    addr: self.addr.clone(),
                    detail: String::from_utf8_lossy(&detail).into_owned(),
                })
            }
        }
    }

    fn check(&mut self, keys: &[String]) -> Result<bool, CommError> {
        if keys.len() > wire::MAX_KEYS {
            // A request holds at most MAX_KEYS (the rendezvous checks two per rank).
            for part in keys.chunks(wire::MAX_KEYS) {
                if !self.check(part)? {
                    return Ok(false);
                }
            }
            return Ok(true);
        }
        self.request.clear();
        self.request.push(OP_CHECK);
        self.request
            .extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for key in keys {
            wire::put_blob(&mut self.request, key.as_bytes());
        }
        match self.call()? {
            STATUS_OK => wire::read_u8(&mut self.reader)
                .map(|b| b == 1)
                .map_err(|e| self.fail(e)),
            s => Err(CommError::Store {
                addr: self.addr.clone(),
                detail: format!("check: status {s}"),
            }),
        }
    }

    fn addr(&self) -> &str {
        &self.addr
    }

    fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    fn peer_ip(&self) -> IpAddr {
        self.peer_ip
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::AuthFailure;
    use std::io::Write;
    use std::sync::mpsc;

    fn secret(digit: &str) -> Secret {
        Secret::from_hex(&digit.repeat(32)).unwrap()
    }

    /// A pause of one accept: the port of the server's listener, then where the loop says
    /// that it paused and where it waits to go on.
    type Pause = (u16, mpsc::Sender<()>, mpsc::Receiver<()>);

    /// The accept loops to pause, by port, before they list their next connection.
    static PAUSES: Mutex<Vec<Pause>> = Mutex::new(Vec::new());

    /// Called by the accept loop between its stop check and listing a connection.
    pub(super) fn pause_before_listing(listener: &TcpListener) {
        let Ok(port) = listener.local_addr().map(|a| a.port()) else {
            return;
        };
        let pause = {
            let mut pauses = PAUSES.lock().unwrap();
            let at = pauses.iter().position(|p| p.0 == port);
            at.map(|i| pauses.swap_remove(i))
        };
        if let Some((_, paused, resume)) = pause {
            let _ = paused.send(());
            let _ = resume.recv();
        }
    }

    /// A connection accepted while the server is dropped, after the drop's sweep of the
    /// listed connections, is closed: no thread serves it after the drop.
    #[test]
    fn a_connection_accepted_while_the_server_drops_is_not_served() {
        let server = server();
        let (addr, key) = (server.local_addr(), secret("a"));
        // A client already served, waiting for the store to speak (which it never does).
        let mut served = TcpStream::connect(addr).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = auth::tcp_client(&served, &key, STORE_MAGIC, 0, deadline);
        assert_eq!(status.ok(), Some(STATUS_OK));
        let (paused_tx, paused) = mpsc::channel();
        let (resume, resume_rx) = mpsc::channel();
        PAUSES
            .lock()
            .unwrap()
            .push((addr.port(), paused_tx, resume_rx));
        let late = TcpStream::connect(addr).unwrap();
        paused.recv_timeout(Duration::from_secs(20)).unwrap();
        let dropper = std::thread::spawn(move || drop(server));
        // The drop's sweep, under the list's lock, shuts the served connection down.
        served
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        assert_eq!(served.read(&mut [0u8; 1]).unwrap(), 0, "no hang-up");
        resume.send(()).unwrap();
        dropper.join().unwrap();
        let deadline = Instant::now() + Duration::from_secs(1);
        match auth::tcp_client(&late, &key, STORE_MAGIC, 0, deadline)
            .map_err(|f| f.into_error("the store".into()))
        {
            Err(CommError::Handshake {
                failure: AuthFailure::TurnedAway { times: 1 },
                ..
            }) => {}
            other => panic!("the late connection was served after the drop: {other:?}"),
        }
    }

    fn server() -> StoreServer {
        StoreServer::bind("127.0.0.1:0".parse().unwrap(), secret("a")).unwrap()
    }

    fn client_of(addr: SocketAddr, secret: &Secret) -> Result<StoreClient, CommError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        StoreClient::connect(&[addr], secret, deadline, Duration::from_secs(2))
    }

    fn client(server: &StoreServer, secret: &Secret) -> Result<StoreClient, CommError> {
        client_of(server.local_addr(), secret)
    }

    /// Reads until the server hangs up; what it sent before.
    fn read_to_hangup(stream: &mut TcpStream) -> Vec<u8> {
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut got = Vec::new();
        let _ = stream.read_to_end(&mut got);
        got
    }

    fn assert_serves(server: &StoreServer) {
        let mut good = client(server, &secret("a")).unwrap();
        good.set("still", b"ok").unwrap();
        assert_eq!(good.get("still").unwrap().as_deref(), Some(&b"ok"[..]));
    }

    #[test]
    fn set_get_add_check_round_trip() {
        let server = server();
        let mut a = client(&server, &secret("a")).unwrap();
        let mut b = client(&server, &secret("a")).unwrap();
        assert_eq!(a.get("k").unwrap(), None);
        a.set("k", b"value").unwrap();
        assert_eq!(b.get("k").unwrap().as_deref(), Some(&b"value"[..]));
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 5).unwrap(), 7);
        assert!(b.check(&["k".into(), "n".into()]).unwrap());
        assert!(!b.check(&["k".into(), "x".into()]).unwrap());
        assert!(matches!(a.add("k", 1), Err(CommError::Store { .. })));
    }

    /// After a failed request the connection may hold a late answer, which the next request
    /// would read as its own: it is not used again.
    #[test]
    fn a_client_is_not_used_after_a_failed_request() {
        let server = server();
        let mut a = client(&server, &secret("a")).unwrap();
        a.set("k", b"v").unwrap();
        drop(server);
        let first = a.get("k");
        assert!(
            matches!(
                first,
                Err(CommError::StoreClosed { .. } | CommError::Store { .. })
            ),
            "{first:?}"
        );
        match a.set("k", b"w") {
            Err(CommError::Store { detail, .. }) => assert_eq!(
                detail,
                "an earlier request on this connection failed; it is not used again"
            ),
            other => panic!("expected the broken connection's error, got {other:?}"),
        }
    }

    #[test]
    fn a_client_with_another_secret_does_not_trust_the_store_and_it_keeps_serving() {
        let server = server();
        let other = Secret::from_hex(&"b".repeat(32)).unwrap();
        match client(&server, &other) {
            Err(CommError::Handshake {
                addr,
                failure: AuthFailure::Unproven { hint },
            }) => {
                assert_eq!(
                    addr,
                    format!("the rendezvous store at {}", server.local_addr())
                );
                assert!(hint.contains("Options::with_secret"), "{hint}");
            }
            other => panic!("expected Handshake Unproven, got {other:?}"),
        }
        assert_serves(&server);
    }

    #[test]
    fn garbage_and_the_old_cleartext_token_get_no_answer_and_the_store_keeps_serving() {
        let server = server();
        // Version 1's hello: magic, version, the run id in cleartext, rank.
        let mut cleartext = b"DDPS\x01".to_vec();
        cleartext.extend_from_slice(&8u16.to_le_bytes());
        cleartext.extend_from_slice(b"ddp-comm");
        cleartext.extend_from_slice(&0u32.to_le_bytes());
        for probe in [
            &b"GET / HTTP/1.1\r\n\r\n"[..],
            &cleartext,
            &[0xff; 4096][..],
        ] {
            let mut stray = TcpStream::connect(server.local_addr()).unwrap();
            stray.write_all(probe).unwrap();
            assert_eq!(
                read_to_hangup(&mut stray),
                b"",
                "a stray connection got an answer"
            );
        }
        assert_serves(&server);
    }

    #[test]
    fn a_client_with_a_wrong_proof_gets_the_challenge_only() {
        let server = server();
        let other = secret("c");
        let mut raw = TcpStream::connect(server.local_addr()).unwrap();
        let client = auth::Client::new(&other, STORE_MAGIC, 0).unwrap();
        raw.write_all(&client.hello()).unwrap();
        let mut challenge = [0u8; auth::CHALLENGE_LEN];
        raw.read_exact(&mut challenge).unwrap();
        // The server proved nothing this client can check: it answers with garbage.
        assert_eq!(client.answer(&challenge), None);
        raw.write_all(&[7u8; auth::PROOF_LEN]).unwrap();
        assert_eq!(read_to_hangup(&mut raw), b"", "no status, no service");
        assert_serves(&server);
    }

    /// A listener that answers every hello with `answer` and records what it receives.
    fn impostor(answer: Vec<u8>) -> (SocketAddr, std::thread::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let thread = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut hello = [0u8; auth::HELLO_LEN];
            stream.read_exact(&mut hello).unwrap();
            stream.write_all(&answer).unwrap();
            let mut rest = hello.to_vec();
            let _ = stream.read_to_end(&mut rest);
            rest
        });
        (addr, thread)
    }

    #[test]
    fn a_store_that_does_not_know_the_secret_is_not_trusted() {
        let (addr, thread) = impostor(vec![0x5a; auth::CHALLENGE_LEN]);
        match client_of(addr, &secret("a")) {
            Err(CommError::Handshake {
                failure: AuthFailure::Unproven { .. },
                addr: named,
            }) => assert_eq!(named, format!("the rendezvous store at {addr}")),
            other => panic!("expected Handshake Unproven, got {other:?}"),
        }
        // The client hung up after its hello: no proof, no request.
        let received = thread.join().unwrap();
        assert_eq!(received.len(), auth::HELLO_LEN);
    }

    #[test]
    fn a_store_that_answers_anything_at_once_is_not_trusted() {
        // Version 1's servers answered a hello with one status byte.
        let (addr, thread) = impostor(vec![STATUS_OK]);
        match client_of(addr, &secret("a")) {
            Err(CommError::Handshake {
                failure: AuthFailure::NoAnswer { .. },
                ..
            }) => {}
            other => panic!("expected Handshake NoAnswer, got {other:?}"),
        }
        assert_eq!(thread.join().unwrap().len(), auth::HELLO_LEN);
    }

    /// The rendezvous checks two keys per rank: above 2048 ranks a check takes more keys
    /// than one request holds, and is sent in parts.
    #[test]
    fn a_check_of_more_keys_than_a_request_holds_is_answered() {
        let server = server();
        let mut c = client(&server, &secret("a")).unwrap();
        let keys: Vec<String> = (0..wire::MAX_KEYS * 2 + 3)
            .map(|i| format!("k/{i}"))
            .collect();
        for key in &keys[..keys.len() - 1] {
            c.set(key, b"1").unwrap();
        }
        assert!(!c.check(&keys).unwrap());
        c.set(keys.last().unwrap(), b"1").unwrap();
        assert!(c.check(&keys).unwrap());
        assert_serves(&server);
    }

    /// This process's descriptors of the TCP sockets with `port` at either end: the
    /// listener and both ends of each connection to a server on `port` (other tests' sockets
    /// are not counted).
    fn descriptors_of_port(port: u16) -> usize {
        let port = format!(":{port:04X}");
        let inodes: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
            .iter()
            .filter_map(|table| std::fs::read_to_string(table).ok())
            .flat_map(|table| {
                let rows: Vec<Vec<String>> = table
                    .lines()
                    .skip(1)
                    .map(|row| row.split_whitespace().map(String::from).collect())
                    .collect();
                rows
            })
            .filter(|row| row.len() > 9 && (row[1].ends_with(&port) || row[2].ends_with(&port)))
            .map(|row| format!("socket:[{}]", row[9]))
            .collect();
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
            .filter(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
            .count()
    }

    /// Each connection to the store holds one descriptor at each end (a rank keeps two, and
    /// rank 0's soft limit of descriptors is often 1024): no clones of the socket.
    #[test]
    fn a_connection_holds_one_descriptor_at_each_end() {
        let server = server();
        let port = server.local_addr().port();
        assert_eq!(descriptors_of_port(port), 1, "the listener");
        const CLIENTS: usize = 20;
        let mut clients: Vec<StoreClient> = (0..CLIENTS)
            .map(|_| client(&server, &secret("a")).unwrap())
            .collect();
        for (i, c) in clients.iter_mut().enumerate() {
            c.set(&format!("k/{i}"), b"v").unwrap();
        }
        assert_eq!(descriptors_of_port(port), 1 + 2 * CLIENTS);
    }

    /// The store's soft limit of open files is raised to what its ranks need, no further,
    /// and an accept that fails for want of descriptors is a warning naming that limit.
    #[test]
    fn the_open_file_limit_is_raised_as_far_as_the_ranks_need_and_named_when_reached() {
        use crate::tcp::raise_open_file_limit;
        use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
        let Some(hard) = getrlimit(Resource::Nofile).maximum else {
            println!("skipped: this process has no hard limit of open files");
            return;
        };
        if hard < 4096 {
            println!("skipped: the hard limit of open files is {hard}, below 4096");
            return;
        }
        let set_soft = |soft: u64| {
            let limit = Rlimit {
                current: Some(soft),
                maximum: Some(hard),
            };
            setrlimit(Resource::Nofile, limit).unwrap();
        };
        set_soft(1024);
        // Two ranks fit in 1024 descriptors: the limit stays.
        assert_eq!(raise_open_file_limit(2).unwrap(), Some(1024));
        assert_eq!(getrlimit(Resource::Nofile).current, Some(1024));
        // 1000 ranks need 2 x 1000 + 512.
        assert_eq!(raise_open_file_limit(1000).unwrap(), Some(2512));
        assert_eq!(getrlimit(Resource::Nofile).current, Some(2512));
        // Never past the hard limit.
        assert_eq!(raise_open_file_limit(usize::MAX).unwrap(), Some(hard));
        assert_eq!(getrlimit(Resource::Nofile).current, Some(hard));
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        assert_eq!(
            accept_failure(&emfile),
            format!(
                "ddp-comm: store could not accept a connection: {emfile} (EMFILE: this process \
                 has its soft limit of {hard} open files, RLIMIT_NOFILE; each rank holds two \
                 connections: raise `ulimit -n`)"
            )
        );
    }

    #[test]
    fn busy_port_names_the_address() {
        let server = server();
        match StoreServer::bind(server.local_addr(), secret("a")) {
            Err(CommError::PortInUse { addr }) => assert_eq!(addr, server.local_addr()),
            other => panic!("expected PortInUse, got {other:?}"),
        }
    }

    #[test]
    fn oversized_lengths_drop_the_connection() {
        let server = server();
        let mut raw = TcpStream::connect(server.local_addr()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = auth::tcp_client(&raw, &secret("a"), STORE_MAGIC, 0, deadline).unwrap();
        assert_eq!(status, STATUS_OK);
        raw.set_timeouts(None).unwrap();
        let mut msg = vec![OP_SET];
        msg.extend_from_slice(&3u32.to_le_bytes());
        msg.extend_from_slice(b"key");
        msg.extend_from_slice(&u32::MAX.to_le_bytes());
        raw.write_all(&msg).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(raw.read(&mut buf).unwrap_or(0), 0);
    }

    #[test]
    fn strangers_holding_handshakes_open_cannot_pile_up_nor_keep_a_rank_out() {
        let server = server();
        let key = secret("a");
        // Three times as many silent connections as may be in their handshake at once.
        let mut idle: Vec<TcpStream> = (0..3 * MAX_PENDING_HANDSHAKES)
            .map(|_| TcpStream::connect(server.local_addr()).unwrap())
            .collect();
        // A rank with the secret still gets in at once, closing the oldest stranger (its
        // deadline is long before the strangers' 10 s handshake limit).
        let soon = Instant::now() + Duration::from_secs(5);
        let rank = StoreClient::connect(&[server.local_addr()], &key, soon, Duration::from_secs(2));
        assert!(rank.is_ok(), "{rank:?}");
        assert_serves(&server);
        // The server holds at most MAX_PENDING_HANDSHAKES of them: the others were closed
        // (oldest first) or refused, and read as closed here.
        // (Each was accepted before the rank was, and closed then or never.)
        std::thread::sleep(Duration::from_millis(100));
        let open: Vec<bool> = idle
            .iter_mut()
            .map(|s| {
                s.set_nonblocking(true).unwrap();
                let read = s.read(&mut [0u8; 1]);
                matches!(read, Err(ref e) if e.kind() == io::ErrorKind::WouldBlock)
            })
            .collect();
        let still = open.iter().filter(|&&o| o).count();
        // The oldest went first; the rank's own connection closed one more of the newest.
        assert!(!open[0], "the oldest stranger is still open");
        assert!(
            (1..MAX_PENDING_HANDSHAKES).contains(&still),
            "{still} strangers still open"
        );
    }

    /// Requests as the table handler reads them: arbitrary bytes, and well-formed requests
    /// with their fields damaged. Every one is answered or refused with an error; none
    /// panics or allocates past the wire's bounds.
    #[test]
    fn any_request_bytes_are_answered_or_refused() {
        use proptest::prelude::*;
        let well_formed = |op: u8| {
            let mut m = Vec::new();
            wire::put_blob(&mut m, b"key");
            match op {
                OP_SET => wire::put_blob(&mut m, b"value"),
                OP_ADD => m.extend_from_slice(&5u64.to_le_bytes()),
                OP_CHECK => {
                    let mut c = 1u32.to_le_bytes().to_vec();
                    c.extend(&m);
                    m = c;
                }
                _ => {}
            }
            m
        };
        let requests = prop_oneof![
            (any::<u8>(), proptest::collection::vec(any::<u8>(), 0..64)),
            (
                prop_oneof![Just(OP_SET), Just(OP_GET), Just(OP_ADD), Just(OP_CHECK)],
                proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
            )
                .prop_map(move |(op, changes)| {
                    let mut body = well_formed(op);
                    for (at, v) in changes {
                        let i = at.index(body.len());
                        body[i] = v;
                    }
                    (op, body)
                }),
        ];
        let table = Table::default();
        let mut runner =
            proptest::test_runner::TestRunner::new(proptest::test_runner::Config::with_cases(4096));
        runner
            .run(&requests, |(op, body)| {
                let mut reply = Vec::new();
                let _ = handle(op, &mut io::Cursor::new(&body), &table, &mut reply);
                prop_assert!(reply.len() <= 1 + 4 + wire::MAX_VALUE_LEN);
                Ok(())
            })
            .unwrap();
    }

    /// A client of the job that leaves, mid-request or with a reset (a rank that exits or
    /// is killed), ends its connection without an error to warn about; one that sends what
    /// the store cannot read is still one.
    #[test]
    fn a_proven_client_that_leaves_is_no_error_and_a_bad_request_is_one() {
        let verdict = |client: fn(TcpStream)| -> Result<(), String> {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let peer = std::thread::spawn(move || {
                let raw = TcpStream::connect(addr).unwrap();
                let deadline = Instant::now() + Duration::from_secs(5);
                let status = auth::tcp_client(&raw, &secret("a"), STORE_MAGIC, 0, deadline);
                assert_eq!(status.ok(), Some(STATUS_OK));
                client(raw);
            });
            let (stream, _) = listener.accept().unwrap();
            let server = Served {
                secret: secret("a"),
                table: Table::default(),
                turned_away: Arc::default(),
            };
            let served = serve(&stream, &server, &mut None);
            // Hung up, as the store does once `serve` returns: the peer reads to its end.
            drop(stream);
            peer.join().unwrap();
            served
        };
        // The op of a request, then the end of the stream.
        let half_request = |mut raw: TcpStream| {
            raw.write_all(&[OP_SET]).unwrap();
            raw.shutdown(Shutdown::Write).unwrap();
            let _ = read_to_hangup(&mut raw);
        };
        assert_eq!(verdict(half_request), Ok(()));
        // Closed with SO_LINGER 0: the server's read fails with ECONNRESET.
        let reset = |raw: TcpStream| {
            rustix::net::sockopt::set_socket_linger(&raw, Some(Duration::ZERO)).unwrap();
            drop(raw);
        };
        assert_eq!(verdict(reset), Ok(()));
        let unknown_op = |mut raw: TcpStream| {
            raw.write_all(&[0xee]).unwrap();
            let _ = read_to_hangup(&mut raw);
        };
        assert_eq!(verdict(unknown_op), Err("unknown store op 238".to_string()));
    }

    /// After the handshake, a client that sends anything at all is served or dropped, and the
    /// store keeps serving others.
    #[test]
    fn an_authenticated_client_sending_anything_leaves_the_store_serving() {
        use proptest::prelude::*;
        let server = server();
        let mut runner =
            proptest::test_runner::TestRunner::new(proptest::test_runner::Config::with_cases(48));
        runner
            .run(&proptest::collection::vec(any::<u8>(), 0..256), |bytes| {
                let raw = TcpStream::connect(server.local_addr()).unwrap();
                let deadline = Instant::now() + Duration::from_secs(5);
                let status = auth::tcp_client(&raw, &secret("a"), STORE_MAGIC, 0, deadline);
                prop_assert_eq!(status.ok(), Some(STATUS_OK));
                raw.set_timeouts(None).unwrap();
                let mut raw = raw;
                let _ = raw.write_all(&bytes);
                let _ = raw.shutdown(Shutdown::Write);
                // The server reads to the end of what was sent, then hangs up.
                let _ = read_to_hangup(&mut raw);
                Ok(())
            })
            .unwrap();
        assert_serves(&server);
    }

    /// A name that does not resolve yet is looked up again until it does (a Kubeflow
    /// master's Service before its pod is ready), and past the deadline is an error naming
    /// `MASTER_ADDR` and the last failure.
    #[test]
    fn a_name_is_looked_up_until_it_resolves_or_the_deadline() {
        let not_yet = || io::Error::other("no such host yet");
        let mut calls = 0;
        let late = |host: &str, port: u16| {
            assert_eq!((host, port), ("master-0", 29500));
            calls += 1;
            match calls {
                1 | 2 => Err(not_yet()),
                _ => Ok(vec![SocketAddr::from(([127, 0, 0, 1], port))]),
            }
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        let addrs = resolve_with("master-0", 29500, deadline, late).unwrap();
        assert_eq!(addrs, [SocketAddr::from(([127, 0, 0, 1], 29500))]);
        assert_eq!(calls, 3);

        let mut calls = 0;
        let never = |_: &str, _: u16| {
            calls += 1;
            Err(not_yet())
        };
        let start = Instant::now();
        let deadline = start + Duration::from_millis(200);
        match resolve_with("master-0", 29500, deadline, never) {
            Err(CommError::Address { addr, source }) => {
                assert_eq!(
                    addr,
                    "master-0:29500 (MASTER_ADDR:MASTER_PORT, --master-addr/--master-port)"
                );
                assert_eq!(source.kind(), io::ErrorKind::Other);
                let why = source.to_string();
                assert!(
                    why.starts_with("still not resolved after ")
                        && why.ends_with(" of retries (is its host up?): no such host yet"),
                    "{why}"
                );
            }
            other => panic!("expected an address error, got {other:?}"),
        }
        assert!(start.elapsed() >= Duration::from_millis(200));
        // Pauses of 1, 2, 4 ... 50 ms: several lookups, not one a millisecond.
        assert!((3..=20).contains(&calls), "{calls} lookups");
    }
}
