//! TCP sockets: listening on every interface of both IP families (rank 0's store, ring
//! listeners in a job of several hosts), connecting with retry (both store clients in
//! `store/`, and the ring's TCP links) and the settings of ring sockets (`TCP_NODELAY`,
//! kernel buffer sizes), and the limit of open descriptors a store's connections count
//! against. The links themselves are driven by `ring/`.

use std::io::{self, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::CommError;

/// Pending connections a listener queues (std's own backlog).
const BACKLOG: i32 = 128;

/// A listener on `addr`. An unspecified IP (every interface, of either family) listens on
/// `[::]` with `IPV6_V6ONLY` off, so that clients of both families reach it, as c10d's
/// TCPStore does; where the host has no IPv6, on `0.0.0.0`.
pub(crate) fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    if !addr.ip().is_unspecified() {
        return TcpListener::bind(addr);
    }
    match listen_dual_stack(addr.port()) {
        Err(e) if no_ipv6(&e) => TcpListener::bind((Ipv4Addr::UNSPECIFIED, addr.port())),
        listened => listened,
    }
}

fn listen_dual_stack(port: u16) -> io::Result<TcpListener> {
    use rustix::net::{sockopt, AddressFamily, SocketFlags, SocketType};
    let socket = rustix::net::socket_with(
        AddressFamily::INET6,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    sockopt::set_ipv6_v6only(&socket, false)?;
    // As std's `TcpListener::bind`: a port whose old connections linger is free again.
    sockopt::set_socket_reuseaddr(&socket, true)?;
    rustix::net::bind(
        &socket,
        &SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port),
    )?;
    rustix::net::listen(&socket, BACKLOG)?;
    Ok(TcpListener::from(socket))
}

/// Whether `e` says that this host cannot listen on IPv6 (no IPv6 in the kernel, or
/// turned off).
fn no_ipv6(e: &io::Error) -> bool {
    [
        libc::EAFNOSUPPORT,
        libc::EPROTONOSUPPORT,
        libc::EADDRNOTAVAIL,
    ]
    .contains(&e.raw_os_error().unwrap_or(0))
}

/// Connects to the first reachable address, retrying until `deadline` (the server may not
/// be up yet).
pub(crate) fn connect_retry(
    addrs: &[SocketAddr],
    deadline: Instant,
    what: &str,
) -> Result<TcpStream, CommError> {
    connect_until(addrs, deadline, what, || false)
}

/// [`connect_retry`], which also gives up (an `Interrupted` error) once `stopped` says so,
/// checked before each attempt.
pub(crate) fn connect_until(
    addrs: &[SocketAddr],
    deadline: Instant,
    what: &str,
    stopped: impl Fn() -> bool,
) -> Result<TcpStream, CommError> {
    let start = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        if stopped() {
            return Err(CommError::io(
                format!("connecting to the {what} at {}", addrs[0]),
                io::Error::new(io::ErrorKind::Interrupted, "stopped"),
            ));
        }
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
                addr: format!("the {what} at {}", addrs[0]),
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
    /// The socket, its reads buffered; requests are written whole through `get_ref()`
    /// (`&TcpStream` writes): one descriptor per connection, no clone.
    pub reader: BufReader<TcpStream>,
    /// The store's address, for messages.
    pub addr: String,
    /// The local interface that reaches the store.
    pub local_ip: IpAddr,
    /// The store's IP as this process reaches it.
    pub peer_ip: IpAddr,
}

impl Connection {
    /// Connects to the first reachable of `addrs`, retrying until `deadline`; `what` names
    /// the server in errors.
    pub(crate) fn open(
        addrs: &[SocketAddr],
        deadline: Instant,
        io_timeout: Duration,
        what: &str,
    ) -> Result<Self, CommError> {
        let stream = connect_retry(addrs, deadline, what)?;
        let peer = stream.peer_addr().unwrap_or(addrs[0]);
        let addr = peer.to_string();
        let io = |e| CommError::io(format!("{what} connection to {addr}"), e);
        let local_ip = stream.local_addr().map_err(io)?.ip();
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(Some(io_timeout)).map_err(io)?;
        stream.set_write_timeout(Some(io_timeout)).map_err(io)?;
        Ok(Connection {
            reader: BufReader::new(stream),
            addr,
            local_ip,
            peer_ip: peer.ip(),
        })
    }
}

/// Sets `TCP_NODELAY` and, when `bytes > 0`, the kernel send and receive buffer sizes.
pub(crate) fn tune_socket(stream: &TcpStream, bytes: usize) -> io::Result<()> {
    stream.set_nodelay(true)?;
    if bytes > 0 {
        set_buffer(stream.as_raw_fd(), bytes)?;
    }
    Ok(())
}

/// Sets `SO_SNDBUF` and `SO_RCVBUF` on a socket (a listener passes them to accepted ones).
pub(crate) fn set_buffer(fd: std::os::fd::RawFd, bytes: usize) -> io::Result<()> {
    let value = bytes.min(i32::MAX as usize) as libc::c_int;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: `value` is a valid c_int whose size is passed; `fd` is an open socket.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// This process's soft limit of open descriptors (`RLIMIT_NOFILE`), `None` for none.
pub(crate) fn open_file_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// Descriptors a store serving `world` ranks needs beyond its connections: the process's
/// own files, libraries and sockets.
const DESCRIPTORS_BESIDE_THE_STORE: u64 = 512;

/// Raises this process's soft limit of open descriptors (`RLIMIT_NOFILE`) where it is too
/// low for a store serving `world` ranks: rank 0's store holds a descriptor for each of two
/// connections per rank (rendezvous and heartbeat), and the common soft limit of 1024
/// would refuse ranks past a few hundred. The soft limit becomes
/// `2 x world + 512`, at most the hard limit, and is left alone where it is already that
/// high, so that the children a rank starts do not inherit a limit in the millions (code
/// that closes every descriptor up to the limit would crawl). Returns the soft limit in
/// force.
pub(crate) fn raise_open_file_limit(world: usize) -> io::Result<Option<u64>> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let needed = (world as u64)
        .saturating_mul(2)
        .saturating_add(DESCRIPTORS_BESIDE_THE_STORE);
    let wanted = match limit.maximum {
        Some(hard) => needed.min(hard),
        None => needed,
    };
    if limit.current.is_none_or(|soft| soft >= wanted) {
        return Ok(limit.current);
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(wanted),
            maximum: limit.maximum,
        },
    )?;
    Ok(Some(wanted))
}
