//! The rendezvous key-value store: a small TCP server that rank 0 runs (set / get / add /
//! check, as c10d's TCPStore) and its client.
//!
//! Every connection starts with a handshake carrying the job's token; the server drops
//! connections that do not present it, and bounds every length it reads before allocating.
//! Clients poll (`check`) to wait, so the server never blocks on behalf of a client and a
//! waiting rank can notice an abort or its own deadline.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::wire;

const STORE_MAGIC: &[u8; 4] = b"DDPS";
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_CHECK: u8 = 4;
const STATUS_OK: u8 = 0;
const STATUS_MISSING: u8 = 1;
const STATUS_ERROR: u8 = 2;
/// How long a new connection may take to present its token.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
}

/// Resolves `host:port` to socket addresses (IPv4 first).
pub(crate) fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, CommError> {
    let text = format!("{host}:{port}");
    let mut addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|source| CommError::Address {
            addr: text.clone(),
            source,
        })?
        .collect();
    addrs.sort_by_key(|a| a.is_ipv6());
    if addrs.is_empty() {
        return Err(CommError::Address {
            addr: text,
            source: io::Error::new(io::ErrorKind::NotFound, "no address"),
        });
    }
    Ok(addrs)
}

/// Connects to the first reachable address, retrying until `deadline` (the server may not
/// be up yet).
pub(crate) fn connect_retry(
    addrs: &[SocketAddr],
    deadline: Instant,
    what: &str,
) -> Result<TcpStream, CommError> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        let mut last = None;
        for addr in addrs {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(10));
            match TcpStream::connect_timeout(addr, left.min(Duration::from_secs(5))) {
                Ok(stream) => return Ok(stream),
                Err(e) => last = Some(e),
            }
        }
        if Instant::now() >= deadline {
            return Err(CommError::StoreUnreachable {
                addr: format!("{what} {}", addrs[0]),
                timeout: start.elapsed(),
                source: last.unwrap_or_else(|| io::Error::other("no attempt")),
            });
        }
        std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// A client connection to a store: connected (retrying until a deadline), `TCP_NODELAY`,
/// every read and write limited to an I/O timeout.
pub(crate) struct Connection {
    pub reader: BufReader<TcpStream>,
    pub writer: BufWriter<TcpStream>,
    /// The store's address, for messages.
    pub addr: String,
    /// The local interface that reaches the store.
    pub local_ip: IpAddr,
}

impl Connection {
    pub(crate) fn open(
        addrs: &[SocketAddr],
        deadline: Instant,
        io_timeout: Duration,
        what: &str,
    ) -> Result<Self, CommError> {
        let stream = connect_retry(addrs, deadline, what)?;
        let addr = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| addrs[0].to_string());
        let io = |e| CommError::io(format!("{what} connection to {addr}"), e);
        let local_ip = stream.local_addr().map_err(io)?.ip();
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(Some(io_timeout)).map_err(io)?;
        stream.set_write_timeout(Some(io_timeout)).map_err(io)?;
        let reader = BufReader::new(stream.try_clone().map_err(io)?);
        Ok(Connection {
            reader,
            writer: BufWriter::new(stream),
            addr,
            local_ip,
        })
    }
}

/// Rank 0's store server; stops (and disconnects every client) when dropped.
#[derive(Debug)]
pub(crate) struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    clients: Clients,
    accept_thread: Option<JoinHandle<()>>,
}

type Table = Arc<Mutex<HashMap<String, Vec<u8>>>>;

/// Open client connections by id, so that the server can disconnect them all when dropped.
type Clients = Arc<Mutex<HashMap<u64, TcpStream>>>;

impl StoreServer {
    /// Listens on `addr`; a busy port is [`CommError::PortInUse`].
    pub(crate) fn bind(addr: SocketAddr, token: Vec<u8>) -> Result<Self, CommError> {
        let listener = TcpListener::bind(addr).map_err(|source| match source.kind() {
            io::ErrorKind::AddrInUse => CommError::PortInUse { addr },
            _ => CommError::Address {
                addr: addr.to_string(),
                source,
            },
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| CommError::io("store listener address", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let clients: Clients = Arc::default();
        let table: Table = Arc::default();
        let accept_thread = {
            let (stop, clients) = (stop.clone(), clients.clone());
            std::thread::Builder::new()
                .name("ddp-store".into())
                .spawn(move || accept_loop(listener, token, table, stop, clients))
                .map_err(|e| CommError::io("spawning the store thread", e))?
        };
        Ok(StoreServer {
            addr,
            stop,
            clients,
            accept_thread: Some(accept_thread),
        })
    }

    /// The address the server listens on.
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
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

fn accept_loop(
    listener: TcpListener,
    token: Vec<u8>,
    table: Table,
    stop: Arc<AtomicBool>,
    clients: Clients,
) {
    let token = Arc::new(token);
    for (id, stream) in (0u64..).zip(listener.incoming()) {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let Ok(closer) = stream.try_clone() else {
            continue;
        };
        if let (Ok(clone), Ok(mut map)) = (stream.try_clone(), clients.lock()) {
            map.insert(id, clone);
        }
        let (token, table, clients) = (token.clone(), table.clone(), clients.clone());
        let _ = std::thread::Builder::new()
            .name("ddp-store-conn".into())
            .spawn(move || {
                let peer = stream
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_default();
                if let Err(why) = serve(stream, &token, &table) {
                    tracing::warn!("ddp-comm: store dropped connection from {peer}: {why}");
                }
                // Other handles (the server's list) must not keep the connection open.
                let _ = closer.shutdown(Shutdown::Both);
                if let Ok(mut map) = clients.lock() {
                    map.remove(&id);
                }
            });
    }
}

/// Serves one client until it disconnects. Errors are reasons to drop the connection.
fn serve(stream: TcpStream, token: &[u8], table: &Table) -> Result<(), String> {
    let _ = stream.set_nodelay(true);
    stream
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let mut writer = BufWriter::new(stream);
    match wire::read_hello(&mut reader, STORE_MAGIC, token) {
        Ok(Ok(_)) => {}
        Ok(Err(why)) => return Err(format!("rejected: {why}")),
        Err(e) => return Err(format!("rejected: incomplete handshake ({e})")),
    }
    wire::send_all(&mut writer, &[STATUS_OK]).map_err(|e| e.to_string())?;
    writer
        .get_ref()
        .set_read_timeout(None)
        .map_err(|e| e.to_string())?;
    loop {
        let op = match wire::read_u8(&mut reader) {
            Ok(op) => op,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        let mut reply = Vec::new();
        handle(op, &mut reader, table, &mut reply).map_err(|e| e.to_string())?;
        wire::send_all(&mut writer, &reply).map_err(|e| e.to_string())?;
    }
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
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
    addr: String,
    local_ip: IpAddr,
    request: Vec<u8>,
}

impl StoreClient {
    /// Connects (retrying until `deadline`) and presents `token`. Each later request may
    /// take at most `io_timeout`.
    pub(crate) fn connect(
        addrs: &[SocketAddr],
        token: &[u8],
        deadline: Instant,
        io_timeout: Duration,
    ) -> Result<Self, CommError> {
        let c = Connection::open(addrs, deadline, io_timeout, "rendezvous store")?;
        let mut client = StoreClient {
            reader: c.reader,
            writer: c.writer,
            addr: c.addr,
            local_ip: c.local_ip,
            request: Vec::new(),
        };
        let hello = wire::hello(STORE_MAGIC, token, 0);
        wire::send_all(&mut client.writer, &hello).map_err(|e| client.fail(e))?;
        match wire::read_u8(&mut client.reader) {
            Ok(STATUS_OK) => Ok(client),
            Ok(_) | Err(_) => Err(CommError::Rejected {
                addr: client.addr.clone(),
            }),
        }
    }

    fn fail(&self, e: io::Error) -> CommError {
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
        let request = std::mem::take(&mut self.request);
        let sent = wire::send_all(&mut self.writer, &request);
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn server() -> StoreServer {
        StoreServer::bind("127.0.0.1:0".parse().unwrap(), b"tok".to_vec()).unwrap()
    }

    fn client(server: &StoreServer, token: &[u8]) -> Result<StoreClient, CommError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        StoreClient::connect(
            &[server.local_addr()],
            token,
            deadline,
            Duration::from_secs(5),
        )
    }

    #[test]
    fn set_get_add_check_round_trip() {
        let server = server();
        let mut a = client(&server, b"tok").unwrap();
        let mut b = client(&server, b"tok").unwrap();
        assert_eq!(a.get("k").unwrap(), None);
        a.set("k", b"value").unwrap();
        assert_eq!(b.get("k").unwrap().as_deref(), Some(&b"value"[..]));
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 5).unwrap(), 7);
        assert!(b.check(&["k".into(), "n".into()]).unwrap());
        assert!(!b.check(&["k".into(), "x".into()]).unwrap());
        assert!(matches!(a.add("k", 1), Err(CommError::Store { .. })));
    }

    #[test]
    fn wrong_token_is_rejected_and_the_store_keeps_serving() {
        let server = server();
        match client(&server, b"other") {
            Err(CommError::Rejected { addr }) => assert_eq!(addr, server.local_addr().to_string()),
            other => panic!("expected Rejected, got {other:?}"),
        }
        let mut stray = TcpStream::connect(server.local_addr()).unwrap();
        stray.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(
            stray.read(&mut buf).unwrap_or(0),
            0,
            "stray connection got an answer"
        );
        let mut good = client(&server, b"tok").unwrap();
        good.set("still", b"ok").unwrap();
        assert_eq!(good.get("still").unwrap().as_deref(), Some(&b"ok"[..]));
    }

    #[test]
    fn busy_port_names_the_address() {
        let server = server();
        match StoreServer::bind(server.local_addr(), b"tok".to_vec()) {
            Err(CommError::PortInUse { addr }) => assert_eq!(addr, server.local_addr()),
            other => panic!("expected PortInUse, got {other:?}"),
        }
    }

    #[test]
    fn oversized_lengths_drop_the_connection() {
        let server = server();
        let mut raw = TcpStream::connect(server.local_addr()).unwrap();
        raw.write_all(&wire::hello(STORE_MAGIC, b"tok", 0)).unwrap();
        let mut ok = [0u8; 1];
        raw.read_exact(&mut ok).unwrap();
        assert_eq!(ok[0], STATUS_OK);
        let mut msg = vec![OP_SET];
        msg.extend_from_slice(&3u32.to_le_bytes());
        msg.extend_from_slice(b"key");
        msg.extend_from_slice(&u32::MAX.to_le_bytes());
        raw.write_all(&msg).unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(raw.read(&mut buf).unwrap_or(0), 0);
    }
}
