//! A rank's two ring links (to its successor, from its predecessor), each carried either by
//! a TCP connection or by a shared-memory ring, behind the one interface the collective
//! driver (`cpu.rs`) needs: non-blocking writes and reads, and a wait until either side can
//! move, the peer leaves, or a time limit passes.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::Duration;

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use crate::error::CommError;
use crate::ring::shm::{Bell, RingFault, ShmReceiver, ShmSender};

/// Which transports a rank may use for collectives on CPU data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Shared memory between ranks on one host, TCP between hosts (the default).
    #[default]
    Auto,
    /// TCP between every pair of ranks, also on one host (for comparison and debugging).
    Tcp,
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
        })
    }
}

impl std::str::FromStr for Transport {
    type Err = String;

    /// `auto` (or `shm`) and `tcp`, in any case.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" | "shm" => Ok(Transport::Auto),
            "tcp" => Ok(Transport::Tcp),
            _ => Err(format!("unknown transport {s:?}")),
        }
    }
}

/// What carries one link of the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkKind {
    /// A ring buffer in memory both processes map (both ranks on one host).
    SharedMemory,
    /// A TCP connection.
    Tcp,
}

impl std::fmt::Display for LinkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkKind::SharedMemory => "shared memory",
            LinkKind::Tcp => "tcp",
        })
    }
}

/// Why an end cannot go on.
#[derive(Debug)]
pub(crate) enum EndError {
    /// The peer closed its end (its process exited or failed).
    Closed,
    /// The operating system reported an error.
    Os(io::Error),
    /// A shared-memory peer wrote an impossible value into the ring.
    Corrupt(RingFault),
}

impl EndError {
    /// The error of collective `op` on the link to `peer`, reached `via`.
    pub(crate) fn into_comm(self, op: &'static str, peer: usize, via: String) -> CommError {
        match self {
            EndError::Corrupt(fault) => CommError::Protocol {
                op,
                peer,
                via,
                detail: fault.to_string(),
            },
            other => CommError::PeerLost {
                op,
                peer,
                via,
                detail: other.detail(),
            },
        }
    }

    pub(crate) fn detail(&self) -> String {
        match self {
            EndError::Closed => "closed the connection (process exited or failed)".into(),
            EndError::Os(e) => e.to_string(),
            EndError::Corrupt(fault) => fault.to_string(),
        }
    }
}

impl From<RingFault> for EndError {
    fn from(fault: RingFault) -> Self {
        EndError::Corrupt(fault)
    }
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

/// Padding after a 16-byte header that brings a shared-memory stream to a multiple of 64
/// bytes, so that every collective's data starts element-aligned in the ring.
fn pad_after_header(position: u32, header: usize) -> usize {
    let end = position as usize + header;
    end.next_multiple_of(64) - end
}

/// This rank's end of the link to its successor.
#[derive(Debug)]
pub(crate) enum SendEnd {
    /// A non-blocking TCP connection to the successor's address.
    Tcp {
        /// The connection.
        stream: TcpStream,
        /// The successor's listener address, for messages.
        addr: SocketAddr,
    },
    /// A ring the successor created and this rank writes into.
    Shm(ShmSender),
}

impl SendEnd {
    pub(crate) fn kind(&self) -> LinkKind {
        match self {
            SendEnd::Tcp { .. } => LinkKind::Tcp,
            SendEnd::Shm(_) => LinkKind::SharedMemory,
        }
    }

    /// How the peer is reached, for messages.
    pub(crate) fn describe(&self) -> String {
        match self {
            SendEnd::Tcp { addr, .. } => format!("tcp {addr}"),
            SendEnd::Shm(s) => format!("shared memory, pid {}", s.peer.pid),
        }
    }

    /// Bytes of padding this end puts after a header of `header` bytes.
    pub(crate) fn header_pad(&self, header: usize) -> usize {
        match self {
            SendEnd::Tcp { .. } => 0,
            SendEnd::Shm(s) => pad_after_header(s.position(), header),
        }
    }

    /// Writes a prefix of `data`; 0 when nothing fits right now.
    pub(crate) fn write(&mut self, data: &[u8]) -> Result<usize, EndError> {
        match self {
            SendEnd::Tcp { stream, .. } => match stream.write(data) {
                Ok(0) if !data.is_empty() => Err(EndError::Closed),
                Ok(k) => Ok(k),
                Err(e) if would_block(&e) => Ok(0),
                Err(e) => Err(EndError::Os(e)),
            },
            SendEnd::Shm(s) => Ok(s.write(data)?),
        }
    }

    /// Whether a shared-memory peer is known to be gone (TCP reports it through I/O).
    pub(crate) fn gone(&self) -> bool {
        match self {
            SendEnd::Tcp { .. } => false,
            SendEnd::Shm(s) => s.peer.hung_up || s.peer_closed(),
        }
    }

    fn shutdown(&self) {
        match self {
            SendEnd::Tcp { stream, .. } => {
                let _ = stream.shutdown(Shutdown::Both);
            }
            SendEnd::Shm(s) => s.close(),
        }
    }
}

/// This rank's end of the link from its predecessor.
#[derive(Debug)]
pub(crate) enum RecvEnd {
    /// A non-blocking TCP connection accepted from the predecessor.
    Tcp {
        /// The connection.
        stream: TcpStream,
        /// The predecessor's listener address, for messages.
        addr: SocketAddr,
    },
    /// A ring this rank created and the predecessor writes into.
    Shm(ShmReceiver),
}

impl RecvEnd {
    pub(crate) fn kind(&self) -> LinkKind {
        match self {
            RecvEnd::Tcp { .. } => LinkKind::Tcp,
            RecvEnd::Shm(_) => LinkKind::SharedMemory,
        }
    }

    /// How the peer is reached, for messages.
    pub(crate) fn describe(&self) -> String {
        match self {
            RecvEnd::Tcp { addr, .. } => format!("tcp {addr}"),
            RecvEnd::Shm(r) => format!("shared memory, pid {}", r.peer.pid),
        }
    }

    /// Bytes of padding the sender puts after a header of `header` bytes.
    pub(crate) fn header_pad(&self, header: usize) -> usize {
        match self {
            RecvEnd::Tcp { .. } => 0,
            RecvEnd::Shm(r) => pad_after_header(r.position(), header),
        }
    }

    /// Reads into a prefix of `dst`; 0 when nothing has arrived.
    pub(crate) fn read(&mut self, dst: &mut [u8]) -> Result<usize, EndError> {
        match self {
            RecvEnd::Tcp { stream, .. } => match stream.read(dst) {
                Ok(0) if !dst.is_empty() => Err(EndError::Closed),
                Ok(k) => Ok(k),
                Err(e) if would_block(&e) => Ok(0),
                Err(e) => Err(EndError::Os(e)),
            },
            RecvEnd::Shm(r) => Ok(r.read(dst)?),
        }
    }

    /// As [`RecvEnd::read`], for results too large to stay cached: a shared-memory end
    /// writes them with non-temporal stores (TCP's copy happens in the kernel).
    pub(crate) fn read_streaming(&mut self, dst: &mut [u8]) -> Result<usize, EndError> {
        match self {
            RecvEnd::Shm(r) => Ok(r.read_streaming(dst)?),
            tcp => tcp.read(dst),
        }
    }

    /// Whether a shared-memory peer is known to be gone with less than `need` bytes left to
    /// read, which the reader cannot use (TCP reports it through I/O, after the last byte).
    /// A ring the peer broke is not "gone": the next read reports it.
    pub(crate) fn gone(&self, need: usize) -> bool {
        match self {
            RecvEnd::Tcp { .. } => false,
            // The peer's last writes happen before it closes, so data published before the
            // close is seen here and read first.
            RecvEnd::Shm(r) => {
                (r.peer.hung_up || r.peer_closed()) && r.available().is_ok_and(|n| n < need.max(1))
            }
        }
    }

    fn shutdown(&self) {
        match self {
            RecvEnd::Tcp { stream, .. } => {
                let _ = stream.shutdown(Shutdown::Both);
            }
            RecvEnd::Shm(r) => r.close(),
        }
    }
}

/// This rank's two ring connections.
#[derive(Debug)]
pub(crate) struct Link {
    /// The successor's rank.
    pub next: usize,
    /// The predecessor's rank.
    pub prev: usize,
    pub send: SendEnd,
    pub recv: RecvEnd,
    /// This rank's bell, when either end is shared memory.
    pub bell: Option<Bell>,
}

impl Link {
    /// Whether either end is shared memory (the driver spins briefly before sleeping).
    pub(crate) fn uses_shm(&self) -> bool {
        self.bell.is_some()
    }

    /// Makes both TCP sockets non-blocking (shared-memory ends never block).
    pub(crate) fn set_nonblocking(&self) -> io::Result<()> {
        if let SendEnd::Tcp { stream, .. } = &self.send {
            stream.set_nonblocking(true)?;
        }
        if let RecvEnd::Tcp { stream, .. } = &self.recv {
            stream.set_nonblocking(true)?;
        }
        Ok(())
    }

    /// Closes both ends so that the neighbours fail promptly too.
    pub(crate) fn shutdown(&self) {
        self.send.shutdown();
        self.recv.shutdown();
    }

    /// Sleeps until the send end can take data (`want_send`), the receive end has the bytes
    /// the reader needs to go on (`recv_need`: `Some(n)` for a shared-memory reduction's
    /// whole element, 1 otherwise; `None` when it waits for no data), a shared-memory peer
    /// hangs up, or `limit` passes (at most a second). Errors and hang-ups of TCP ends
    /// surface through the next read or write.
    pub(crate) fn wait(
        &mut self,
        want_send: bool,
        recv_need: Option<usize>,
        limit: Duration,
    ) -> io::Result<()> {
        let want_recv = recv_need.is_some();
        // Announce the sleep on shared-memory ends first; an end that can move already
        // makes the wait pointless.
        let send_armed = match &self.send {
            SendEnd::Shm(s) if want_send => {
                if !s.arm() {
                    return Ok(());
                }
                true
            }
            _ => false,
        };
        let recv_armed = match &self.recv {
            RecvEnd::Shm(r) if want_recv => {
                if !r.arm(recv_need.unwrap_or(1)) {
                    if let SendEnd::Shm(s) = &self.send {
                        s.disarm();
                    }
                    return Ok(());
                }
                true
            }
            _ => false,
        };
        let hangup = PollFlags::IN | PollFlags::RDHUP;
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(4);
        let (mut send_at, mut recv_at) = (None, None);
        match &self.send {
            SendEnd::Tcp { stream, .. } if want_send => {
                fds.push(PollFd::from_borrowed_fd(stream.as_fd(), PollFlags::OUT))
            }
            SendEnd::Shm(s) if send_armed => {
                send_at = Some(fds.len());
                fds.push(PollFd::from_borrowed_fd(s.peer.control.as_fd(), hangup));
            }
            _ => {}
        }
        match &self.recv {
            RecvEnd::Tcp { stream, .. } if want_recv => {
                fds.push(PollFd::from_borrowed_fd(stream.as_fd(), PollFlags::IN))
            }
            RecvEnd::Shm(r) if recv_armed => {
                recv_at = Some(fds.len());
                fds.push(PollFd::from_borrowed_fd(r.peer.control.as_fd(), hangup));
            }
            _ => {}
        }
        if let (Some(bell), true) = (&self.bell, send_armed || recv_armed) {
            fds.push(PollFd::from_borrowed_fd(bell.fd(), PollFlags::IN));
        }
        let limit = limit.clamp(Duration::from_micros(100), Duration::from_secs(1));
        let timeout = Timespec {
            tv_sec: limit.as_secs() as _,
            tv_nsec: limit.subsec_nanos() as _,
        };
        let polled = poll(&mut fds, Some(&timeout));
        let send_hup = send_at.is_some_and(|i| !fds[i].revents().is_empty());
        let recv_hup = recv_at.is_some_and(|i| !fds[i].revents().is_empty());
        drop(fds);
        if let SendEnd::Shm(s) = &mut self.send {
            s.disarm();
            s.peer.hung_up |= send_hup;
        }
        if let RecvEnd::Shm(r) = &mut self.recv {
            r.disarm();
            r.peer.hung_up |= recv_hup;
        }
        if let Some(bell) = &self.bell {
            bell.drain();
        }
        match polled {
            Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transports_parse_from_their_names() {
        assert_eq!("auto".parse(), Ok(Transport::Auto));
        assert_eq!("SHM".parse(), Ok(Transport::Auto));
        assert_eq!("Tcp".parse(), Ok(Transport::Tcp));
        assert!("rdma".parse::<Transport>().is_err());
        assert_eq!(Transport::Tcp.to_string().parse(), Ok(Transport::Tcp));
    }

    #[test]
    fn headers_pad_shared_memory_streams_to_64_bytes() {
        assert_eq!(pad_after_header(0, 16), 48);
        assert_eq!(pad_after_header(48, 16), 0);
        assert_eq!(pad_after_header(13, 16), 35);
        assert_eq!(pad_after_header(u32::MAX - 15, 16), 0);
    }
}
