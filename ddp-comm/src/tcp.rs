//! The TCP backend: executes ring schedules over two sockets per rank (one to the successor,
//! one from the predecessor) with non-blocking I/O, so that sending, receiving and reducing
//! overlap on one thread.
//!
//! Small all-reduces take a latency path: an all-gather of the whole buffers along the ring
//! (`n - 1` hops instead of `2(n - 1)`), then a local reduction in rank order 0, 1, ..., n-1,
//! the same on every rank. Large ones take the bandwidth-optimal ring (reduce-scatter +
//! all-gather). Either way every rank ends with identical bytes.
//!
//! Every collective starts with a 16-byte header (kind, dtype, argument, length) that each
//! rank checks against its predecessor's, so ranks that call different collectives or sizes
//! get [`CommError::Mismatch`] instead of corrupted data. A failure poisons the backend and
//! shuts its sockets down, so neighbours fail promptly too.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::element::{self, as_bytes_mut, DType, ReduceOp};
use crate::error::CommError;
use crate::ring::{split_even, Schedule, Span};

/// Bytes per pipelined segment.
pub(crate) const SEGMENT: usize = 256 * 1024;
/// All-reduces of at most this many bytes (times `n - 1`) take the latency path.
pub(crate) const SMALL_BYTES: usize = 256 * 1024;
const HEADER: usize = 16;

/// This rank's two ring connections.
#[derive(Debug)]
pub(crate) struct Link {
    pub send: TcpStream,
    pub recv: TcpStream,
    pub next: usize,
    pub prev: usize,
    pub next_addr: SocketAddr,
    pub prev_addr: SocketAddr,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
    Barrier = 4,
}

fn header(kind: Kind, dtype: u8, arg: u32, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = kind as u8;
    h[1] = dtype;
    h[4..8].copy_from_slice(&arg.to_le_bytes());
    h[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

fn describe(h: &[u8; HEADER]) -> String {
    let kind = match h[0] {
        1 => "all_reduce",
        2 => "broadcast",
        3 => "all_gather",
        4 => "barrier",
        _ => "an unknown collective",
    };
    let arg = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    let len = u64::from_le_bytes(h[8..16].try_into().unwrap_or([0; 8]));
    format!("{kind} (dtype {}, argument {arg}) of {len} bytes", h[1])
}

fn dtype_code(d: DType) -> u8 {
    d as u8 + 1
}

fn op_code(op: ReduceOp) -> u32 {
    op as u32
}

/// The TCP process-group backend of one rank.
#[derive(Debug)]
pub(crate) struct TcpBackend {
    rank: usize,
    world: usize,
    link: Option<Link>,
    timeout: Duration,
    segment: usize,
    small: usize,
    schedule: Schedule,
    pieces: Vec<Span>,
    scratch: Vec<i64>,
    gather: Vec<i64>,
    poisoned: Option<String>,
}

impl TcpBackend {
    /// Wraps the ring connections (none for a world of one). Sockets become non-blocking.
    pub(crate) fn new(
        rank: usize,
        world: usize,
        link: Option<Link>,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        if let Some(link) = &link {
            for s in [&link.send, &link.recv] {
                s.set_nonblocking(true)
                    .map_err(|e| CommError::io("ring socket", e))?;
            }
        }
        Ok(TcpBackend {
            rank,
            world,
            link,
            timeout,
            segment: SEGMENT,
            small: SMALL_BYTES,
            schedule: Schedule::default(),
            pieces: Vec::new(),
            scratch: Vec::new(),
            gather: Vec::new(),
            poisoned: None,
        })
    }

    fn check(&self) -> Result<(), CommError> {
        match &self.poisoned {
            Some(why) => Err(CommError::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    fn poison(&mut self, err: CommError) -> CommError {
        self.poisoned = Some(err.to_string());
        if let Some(link) = &self.link {
            let _ = link.send.shutdown(Shutdown::Both);
            let _ = link.recv.shutdown(Shutdown::Both);
        }
        err
    }

    fn scratch_bytes(&mut self, bytes: usize) -> &mut [u8] {
        let words = bytes.div_ceil(8);
        if self.scratch.len() < words {
            self.scratch.resize(words, 0);
        }
        &mut as_bytes_mut(&mut self.scratch[..words])[..bytes]
    }

    /// Runs the schedule in `self.schedule` over `work`, after exchanging `head`.
    fn run(
        &mut self,
        op: &'static str,
        head: [u8; HEADER],
        work: &mut [u8],
        reduce: Option<(DType, ReduceOp)>,
        use_gather_as_work: bool,
    ) -> Result<(), CommError> {
        let segment = self.segment;
        if self.scratch.len() * 8 < segment {
            self.scratch.resize(segment / 8, 0);
        }
        let mut tmp = std::mem::take(&mut self.scratch);
        let mut gather = std::mem::take(&mut self.gather);
        let link = self.link.as_mut().expect("run needs a ring");
        let work: &mut [u8] = if use_gather_as_work {
            as_bytes_mut(&mut gather)
        } else {
            work
        };
        let result = drive(
            link,
            self.rank,
            op,
            head,
            &self.schedule,
            work,
            as_bytes_mut(&mut tmp),
            reduce,
            self.timeout,
        );
        self.scratch = tmp;
        self.gather = gather;
        result.map_err(|e| self.poison(e))
    }

    /// In-place all-reduce of `buf`, holding elements of type `dtype`.
    pub(crate) fn all_reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.check()?;
        if !dtype.cpu_reducible() {
            return Err(CommError::Tensor {
                backend: "tcp",
                detail: format!("{dtype:?} cannot be reduced on the CPU"),
            });
        }
        let n = self.world;
        if n == 1 {
            return Ok(());
        }
        let head = header(Kind::AllReduce, dtype_code(dtype), op_code(op), buf.len());
        let elem = dtype.size();
        if buf.len() * (n - 1) <= self.small {
            // Latency path: gather every rank's buffer, then reduce in rank order.
            let len = buf.len();
            let words = (len * n).div_ceil(8);
            if self.gather.len() < words {
                self.gather.resize(words, 0);
            }
            equal_pieces(&mut self.pieces, n, len);
            as_bytes_mut(&mut self.gather)[self.rank * len..][..len].copy_from_slice(buf);
            self.schedule
                .all_gather(&self.pieces, self.rank, self.segment);
            self.run("all_reduce", head, &mut [], None, true)?;
            let all = &as_bytes_mut(&mut self.gather)[..len * n];
            buf.copy_from_slice(&all[..len]);
            for r in 1..n {
                element::reduce(dtype, op, buf, &all[r * len..][..len]);
            }
        } else {
            let mut pieces = std::mem::take(&mut self.pieces);
            split_even(buf.len(), elem, n, &mut pieces);
            self.schedule.all_reduce(&pieces, self.rank, self.segment);
            self.pieces = pieces;
            self.run("all_reduce", head, buf, Some((dtype, op)), false)?;
        }
        if op == ReduceOp::Avg {
            element::finish_avg(dtype, buf, n);
        }
        Ok(())
    }

    /// Broadcast of `buf` from `root` to every rank.
    pub(crate) fn broadcast(&mut self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.check()?;
        if root >= self.world {
            return Err(CommError::RankOutOfRange {
                rank: root,
                world_size: self.world,
            });
        }
        if self.world == 1 {
            return Ok(());
        }
        let head = header(Kind::Broadcast, 0, root as u32, buf.len());
        self.schedule
            .broadcast(buf.len(), self.world, self.rank, root, self.segment);
        self.run("broadcast", head, buf, None, false)
    }

    /// All-gather of equal-sized contributions: `out` (`world * input.len()` bytes) receives
    /// rank `r`'s `input` at offset `r * input.len()`.
    pub(crate) fn all_gather(&mut self, input: &[u8], out: &mut [u8]) -> Result<(), CommError> {
        self.check()?;
        let len = input.len();
        assert_eq!(out.len(), len * self.world, "all_gather output size");
        out[self.rank * len..][..len].copy_from_slice(input);
        if self.world == 1 {
            return Ok(());
        }
        equal_pieces(&mut self.pieces, self.world, len);
        self.schedule
            .all_gather(&self.pieces, self.rank, self.segment);
        let head = header(Kind::AllGather, 0, 0, len);
        self.run("all_gather", head, out, None, false)
    }

    /// All-gather of contributions of any length.
    pub(crate) fn all_gather_bytes(&mut self, input: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let n = self.world;
        let mut lens = vec![0u8; 8 * n];
        self.all_gather(&(input.len() as u64).to_le_bytes(), &mut lens)?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as usize)
            .collect();
        let mut pieces = Vec::with_capacity(n);
        let mut off = 0;
        for len in &lens {
            pieces.push(Span { off, len: *len });
            off += len;
        }
        let mut out = vec![0u8; off];
        out[pieces[self.rank].off..][..input.len()].copy_from_slice(input);
        if n > 1 {
            self.schedule.all_gather(&pieces, self.rank, self.segment);
            let head = header(Kind::AllGather, 1, 0, off);
            self.run("all_gather_bytes", head, &mut out, None, false)?;
        }
        Ok(pieces
            .iter()
            .map(|p| out[p.off..][..p.len].to_vec())
            .collect())
    }

    /// Returns once every rank has called `barrier`.
    pub(crate) fn barrier(&mut self) -> Result<(), CommError> {
        self.check()?;
        if self.world == 1 {
            return Ok(());
        }
        let n = self.world;
        let words = n.div_ceil(8);
        if self.gather.len() < words {
            self.gather.resize(words, 0);
        }
        as_bytes_mut(&mut self.gather)[self.rank] = 1;
        equal_pieces(&mut self.pieces, n, 1);
        self.schedule
            .all_gather(&self.pieces, self.rank, self.segment);
        self.run(
            "barrier",
            header(Kind::Barrier, 0, 0, 1),
            &mut [],
            None,
            true,
        )
    }

    /// Overrides the latency-path threshold (benchmarks).
    pub(crate) fn set_small(&mut self, bytes: usize) {
        self.small = bytes;
    }

    /// Overrides the segment size (benchmarks).
    pub(crate) fn set_segment(&mut self, bytes: usize) {
        self.segment = bytes.max(8) / 8 * 8;
        let _ = self.scratch_bytes(self.segment);
    }
}

/// `n` consecutive pieces of `len` bytes, into a reused vector.
fn equal_pieces(out: &mut Vec<Span>, n: usize, len: usize) {
    out.clear();
    out.extend((0..n).map(|r| Span { off: r * len, len }));
}

fn peer_error(
    op: &'static str,
    peer: usize,
    addr: SocketAddr,
    detail: impl Into<String>,
) -> CommError {
    CommError::PeerLost {
        op,
        peer,
        addr,
        detail: detail.into(),
    }
}

/// Executes one schedule. Sends go to `link.send`, receives come from `link.recv`; segments
/// that reduce are received into `tmp` and combined into `work`.
#[allow(clippy::too_many_arguments)]
fn drive(
    link: &mut Link,
    rank: usize,
    op: &'static str,
    head: [u8; HEADER],
    schedule: &Schedule,
    work: &mut [u8],
    tmp: &mut [u8],
    reduce: Option<(DType, ReduceOp)>,
    timeout: Duration,
) -> Result<(), CommError> {
    let deadline = Instant::now() + timeout;
    let (sends, recvs) = (&schedule.sends, &schedule.recvs);
    // Positions count the header first: send_pos < HEADER means the header is in flight.
    let (mut send_i, mut send_pos) = (0usize, 0usize);
    let (mut recv_i, mut recv_pos) = (0usize, 0usize);
    let mut head_in = [0u8; HEADER];
    let (mut head_sent, mut head_received) = (0usize, 0usize);
    let closed = |peer, addr| {
        peer_error(
            op,
            peer,
            addr,
            "closed the connection (process exited or failed)",
        )
    };
    loop {
        let mut progressed = false;

        // Send side: the header, then segments whose dependencies are met.
        let send_ready =
            head_sent < HEADER || (send_i < sends.len() && sends[send_i].after <= recv_i);
        if send_ready {
            let chunk: &[u8] = if head_sent < HEADER {
                &head[head_sent..]
            } else {
                let s = sends[send_i].span;
                &work[s.off + send_pos..s.off + s.len]
            };
            match link.send.write(chunk) {
                Ok(0) => return Err(closed(link.next, link.next_addr)),
                Ok(k) => {
                    progressed = true;
                    if head_sent < HEADER {
                        head_sent += k;
                    } else {
                        send_pos += k;
                        if send_pos == sends[send_i].span.len {
                            send_i += 1;
                            send_pos = 0;
                        }
                    }
                }
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(peer_error(op, link.next, link.next_addr, e.to_string())),
            }
        }
        // Zero-length segments complete without I/O.
        while head_sent == HEADER
            && send_i < sends.len()
            && sends[send_i].span.len == 0
            && sends[send_i].after <= recv_i
        {
            send_i += 1;
        }

        // Receive side: the header, then segments in order.
        if head_received < HEADER || recv_i < recvs.len() {
            let reducing = head_received == HEADER && recvs[recv_i].reduce;
            let target: &mut [u8] = if head_received < HEADER {
                &mut head_in[head_received..]
            } else {
                let s = recvs[recv_i].span;
                if reducing {
                    &mut tmp[recv_pos..s.len]
                } else {
                    &mut work[s.off + recv_pos..s.off + s.len]
                }
            };
            if !target.is_empty() {
                match link.recv.read(target) {
                    Ok(0) => return Err(closed(link.prev, link.prev_addr)),
                    Ok(k) => {
                        progressed = true;
                        if head_received < HEADER {
                            head_received += k;
                            if head_received == HEADER && head_in != head {
                                return Err(CommError::Mismatch {
                                    op,
                                    rank,
                                    peer: link.prev,
                                    ours: describe(&head),
                                    theirs: describe(&head_in),
                                });
                            }
                        } else {
                            recv_pos += k;
                        }
                    }
                    Err(e)
                        if e.kind() == io::ErrorKind::WouldBlock
                            || e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(peer_error(op, link.prev, link.prev_addr, e.to_string())),
                }
            }
            if head_received == HEADER && recv_i < recvs.len() && recv_pos == recvs[recv_i].span.len
            {
                let s = recvs[recv_i].span;
                if let (true, Some((dtype, rop))) = (recvs[recv_i].reduce, reduce) {
                    element::reduce(dtype, rop, &mut work[s.off..s.off + s.len], &tmp[..s.len]);
                }
                recv_i += 1;
                recv_pos = 0;
                progressed = true;
            }
        }

        let send_done = head_sent == HEADER && send_i == sends.len();
        let recv_done = head_received == HEADER && recv_i == recvs.len();
        if send_done && recv_done {
            return Ok(());
        }
        if progressed {
            continue;
        }
        let now = Instant::now();
        if now >= deadline {
            let mut peers = Vec::new();
            if !recv_done {
                peers.push(link.prev);
            }
            if !send_done && !peers.contains(&link.next) {
                peers.push(link.next);
            }
            return Err(CommError::Timeout { op, timeout, peers });
        }
        let want_send = !send_done && (head_sent < HEADER || sends[send_i].after <= recv_i);
        wait(link, want_send, !recv_done, deadline - now).map_err(|e| CommError::io("poll", e))?;
    }
}

/// Sleeps until a socket is ready (or failed), at most `limit`.
fn wait(link: &Link, want_send: bool, want_recv: bool, limit: Duration) -> io::Result<()> {
    let mut fds = [
        libc::pollfd {
            fd: link.send.as_raw_fd(),
            events: if want_send { libc::POLLOUT } else { 0 },
            revents: 0,
        },
        libc::pollfd {
            fd: link.recv.as_raw_fd(),
            events: if want_recv { libc::POLLIN } else { 0 },
            revents: 0,
        },
    ];
    let ms = limit.as_millis().clamp(1, 1000) as libc::c_int;
    // SAFETY: `fds` is a valid array of two pollfd structs for the duration of the call.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    // Errors and hang-ups surface through the next read or write.
    Ok(())
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

/// Reads exactly `buf.len()` bytes from a blocking stream (ring setup).
pub(crate) fn read_exact_timeout(
    stream: &mut TcpStream,
    buf: &mut [u8],
    timeout: Duration,
) -> io::Result<()> {
    stream.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
    let result = stream.read_exact(buf);
    stream.set_read_timeout(None)?;
    result
}
