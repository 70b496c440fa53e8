//! The CPU backend: executes ring schedules (`schedule.rs`) over this rank's two links, each TCP
//! or shared memory (`link.rs`), with non-blocking I/O on one thread, so that sending,
//! receiving and reducing overlap.
//!
//! The ring visits the ranks in `order`, which puts the ranks of each host next to each
//! other (see the crate's README): schedules work on ring positions, and pieces that belong
//! to a rank (all-gather contributions) are mapped from rank to position.
//!
//! Small all-reduces take a latency path: an all-gather of the whole buffers along the ring
//! (`n - 1` hops instead of `2(n - 1)`), then a local reduction in rank order 0, 1, ..., n-1,
//! the same on every rank. Large ones take the bandwidth-optimal ring (reduce-scatter +
//! all-gather). Either way every rank ends with identical bytes. `Avg` divides the sum by
//! the world size: the latency path after its reduction, the ring at each piece's owner
//! after the piece's last reduce-scatter hop (while it is in cache), so that the all-gather
//! carries the quotients.
//!
//! Every collective starts with a 16-byte header (kind, dtype, argument, length) that each
//! rank checks against its predecessor's, so ranks that call different collectives or sizes
//! get [`CommError::Mismatch`] instead of corrupted data. A failure poisons the backend and
//! closes both links, so neighbours fail promptly too.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::element::{self, as_bytes_mut, DType, ReduceOp};
use crate::error::CommError;
use crate::ring::header::{
    describe, dtype_code, header, op_code, Kind, GATHER_BYTES, GATHER_EQUAL, GATHER_LENGTHS, HEADER,
};
use crate::ring::link::{EndError, Link, LinkKind, RecvEnd};
use crate::ring::schedule::{split_even, Recv, Schedule, Span};
use crate::store::heartbeat::Heartbeat;

/// Bytes per pipelined segment.
pub(crate) const SEGMENT: usize = 256 * 1024;
/// All-reduces of at most this many bytes (times `n - 1`) take the latency path.
pub(crate) const SMALL_BYTES: usize = 256 * 1024;
/// How long a rank with a shared-memory link polls its rings before it goes to sleep.
pub(crate) const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// The most bytes [`ProcessGroup::all_gather_bytes`](crate::ProcessGroup::all_gather_bytes)
/// allocates for all ranks' contributions together, unless
/// [`ProcessGroup::set_max_gather_bytes`](crate::ProcessGroup::set_max_gather_bytes) says
/// otherwise: the lengths come from the peers, so they must not size an allocation
/// unchecked.
pub const DEFAULT_MAX_GATHER_BYTES: u64 = 1 << 30;
/// Collectives on at least this many bytes write what they receive with stores that bypass
/// the cache: the result would not stay cached anyway.
const STREAMING_BYTES: usize = 16 << 20;

/// The ranks in ring order and this rank's place in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RingOrder {
    /// `order[p]` is the rank at ring position `p`.
    pub order: Vec<usize>,
    /// This rank's position.
    pub pos: usize,
}

/// The CPU process-group backend of one rank.
#[derive(Debug)]
pub(crate) struct CpuBackend {
    rank: usize,
    world: usize,
    ring: RingOrder,
    link: Option<Link>,
    timeout: Duration,
    segment: usize,
    small: usize,
    spin: Duration,
    schedule: Schedule,
    pieces: Vec<Span>,
    by_position: Vec<Span>,
    scratch: Vec<i64>,
    gather: Vec<i64>,
    /// Why the backend failed, once it has (the first reason): shared with the process
    /// group, whose CUDA collectives read it without this backend's lock.
    poisoned: Arc<OnceLock<String>>,
    heartbeat: Arc<Heartbeat>,
    max_gather: u64,
}

impl CpuBackend {
    /// Wraps the ring links (none for a world of one). TCP sockets become non-blocking.
    pub(crate) fn new(
        rank: usize,
        world: usize,
        ring: RingOrder,
        link: Option<Link>,
        timeout: Duration,
        heartbeat: Arc<Heartbeat>,
    ) -> Result<Self, CommError> {
        if let Some(link) = &link {
            link.set_nonblocking()
                .map_err(|e| CommError::io("ring socket", e))?;
        }
        debug_assert_eq!(ring.order.get(ring.pos), Some(&rank));
        Ok(CpuBackend {
            rank,
            world,
            ring,
            link,
            timeout,
            segment: SEGMENT,
            small: SMALL_BYTES,
            spin: DEFAULT_SPIN,
            schedule: Schedule::default(),
            pieces: Vec::new(),
            by_position: Vec::new(),
            scratch: Vec::new(),
            gather: Vec::new(),
            poisoned: Arc::default(),
            heartbeat,
            max_gather: DEFAULT_MAX_GATHER_BYTES,
        })
    }

    /// The ranks in ring order.
    pub(crate) fn order(&self) -> &[usize] {
        &self.ring.order
    }

    /// What carries the link to the successor and from the predecessor (none for a world
    /// of one).
    pub(crate) fn link_kinds(&self) -> Option<(LinkKind, LinkKind)> {
        self.link.as_ref().map(|l| (l.send.kind(), l.recv.kind()))
    }

    /// Why the backend failed, once it has: the flag its owner reads without the lock.
    pub(crate) fn poisoned(&self) -> Arc<OnceLock<String>> {
        self.poisoned.clone()
    }

    fn check(&self) -> Result<(), CommError> {
        match self.poisoned.get() {
            Some(why) => Err(CommError::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    fn poison(&mut self, err: CommError) -> CommError {
        self.fail(crate::error::with_causes(&err));
        err
    }

    /// Makes every later call fail with `why` (unless it failed already: the first reason
    /// stays), and the neighbours' at once (links shut).
    pub(crate) fn fail(&mut self, why: String) {
        self.heartbeat.mark_failed();
        let _ = self.poisoned.set(why);
        if let Some(link) = &self.link {
            link.shutdown();
        }
    }

    fn scratch_bytes(&mut self, bytes: usize) -> &mut [u8] {
        let words = bytes.div_ceil(8);
        if self.scratch.len() < words {
            self.scratch.resize(words, 0);
        }
        &mut as_bytes_mut(&mut self.scratch[..words])[..bytes]
    }

    /// `self.by_position[p] = pieces[order[p]]`: rank-indexed pieces in ring order.
    fn position_pieces(&mut self, pieces: &[Span]) {
        self.by_position.clear();
        self.by_position
            .extend(self.ring.order.iter().map(|&r| pieces[r]));
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
            Job {
                rank: self.rank,
                world: self.world,
                op,
                head,
                schedule: &self.schedule,
                reduce,
                timeout: self.timeout,
                spin: self.spin,
            },
            work,
            as_bytes_mut(&mut tmp),
        );
        self.scratch = tmp;
        self.gather = gather;
        // A timeout is diagnosed before the links close, so that the neighbours reach
        // their own timeouts (and diagnoses) instead of seeing this rank hang up.
        result.map_err(|e| {
            let e = self.heartbeat.explain(e);
            self.poison(e)
        })
    }

    /// In-place all-reduce of `buf`, holding elements of type `dtype`.
    pub(crate) fn all_reduce(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.check()?;
        let n = self.world;
        if n == 1 {
            return Ok(());
        }
        let head = header(Kind::AllReduce, dtype_code(dtype), op_code(op), buf.len());
        // A half-precision average divides first, as NCCL's ncclAvg does for those types: a
        // sum rounded to half at each step would overflow where the average does not.
        let op = match (op, dtype) {
            (ReduceOp::Avg, DType::F16 | DType::BF16) => {
                element::finish_avg(dtype, buf, n);
                ReduceOp::Sum
            }
            _ => op,
        };
        let elem = dtype.size();
        if buf.len() * (n - 1) <= self.small {
            // Latency path: gather every rank's buffer, then reduce in rank order.
            let len = buf.len();
            let words = (len * n).div_ceil(8);
            if self.gather.len() < words {
                self.gather.resize(words, 0);
            }
            equal_pieces(&mut self.pieces, n, len);
            let pieces = std::mem::take(&mut self.pieces);
            self.position_pieces(&pieces);
            self.pieces = pieces;
            as_bytes_mut(&mut self.gather)[self.rank * len..][..len].copy_from_slice(buf);
            self.schedule
                .all_gather(&self.by_position, self.ring.pos, self.segment);
            self.run("all_reduce", head, &mut [], None, true)?;
            let all = &as_bytes_mut(&mut self.gather)[..len * n];
            buf.copy_from_slice(&all[..len]);
            for r in 1..n {
                element::reduce(dtype, op, buf, &all[r * len..][..len]);
            }
            if op == ReduceOp::Avg {
                element::finish_avg(dtype, buf, n);
            }
        } else {
            // Any assignment of pieces to positions works: each piece is reduced along
            // one path and then copied, so every rank ends with the same bytes.
            let mut pieces = std::mem::take(&mut self.pieces);
            split_even(buf.len(), elem, n, &mut pieces);
            self.schedule
                .all_reduce(&pieces, self.ring.pos, self.segment);
            self.pieces = pieces;
            // `drive` divides an average as each piece's reduction completes.
            self.run("all_reduce", head, buf, Some((dtype, op)), false)?;
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
        let root_pos = self
            .ring
            .order
            .iter()
            .position(|&r| r == root)
            .expect("the ring order holds every rank");
        self.schedule
            .broadcast(buf.len(), self.world, self.ring.pos, root_pos, self.segment);
        self.run("broadcast", head, buf, None, false)
    }

    /// All-gather of equal-sized contributions: `out` (`world * input.len()` bytes) receives
    /// rank `r`'s `input` at offset `r * input.len()`.
    pub(crate) fn all_gather(&mut self, input: &[u8], out: &mut [u8]) -> Result<(), CommError> {
        self.check()?;
        let len = input.len();
        assert_eq!(out.len(), len * self.world, "all_gather output size");
        out[self.rank * len..][..len].copy_from_slice(input);
        self.all_gather_in_place(out)
    }

    /// All-gather whose contribution is already in place: this rank's `out.len() / world`
    /// bytes at `rank * out.len() / world` of `out`.
    pub(crate) fn all_gather_in_place(&mut self, out: &mut [u8]) -> Result<(), CommError> {
        self.gather_equal(out, GATHER_EQUAL)
    }

    /// [`Self::all_gather_in_place`] under header tag `tag` (the header's dtype byte): a
    /// gather of lengths for [`Self::all_gather_bytes`] must not pair with a user's gather
    /// of 8 bytes per rank on another rank.
    fn gather_equal(&mut self, out: &mut [u8], tag: u8) -> Result<(), CommError> {
        self.check()?;
        let len = out.len() / self.world;
        assert_eq!(out.len(), len * self.world, "all_gather output size");
        if self.world == 1 {
            return Ok(());
        }
        equal_pieces(&mut self.pieces, self.world, len);
        let pieces = std::mem::take(&mut self.pieces);
        self.position_pieces(&pieces);
        self.pieces = pieces;
        self.schedule
            .all_gather(&self.by_position, self.ring.pos, self.segment);
        let head = header(Kind::AllGather, tag, 0, len);
        self.run("all_gather", head, out, None, false)
    }

    /// All-gather of contributions of any length.
    ///
    /// The lengths the peers announce are checked before anything is allocated: their sum
    /// must stay within [`CpuBackend::set_max_gather`]'s limit ([`CommError::TooLarge`]).
    pub(crate) fn all_gather_bytes(&mut self, input: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        const OP: &str = "all_gather_bytes";
        self.check()?;
        let n = self.world;
        let mut lens = vec![0u8; 8 * n];
        lens[self.rank * 8..][..8].copy_from_slice(&(input.len() as u64).to_le_bytes());
        self.gather_equal(&mut lens, GATHER_LENGTHS)?;
        // Every rank holds the same lengths, so a total over the limit fails every rank
        // here alike, and the group stays usable.
        let (pieces, off) = gather_layout(OP, &lens, self.max_gather)?;
        let mut out = vec![0u8; off];
        out[pieces[self.rank].off..][..input.len()].copy_from_slice(input);
        if n > 1 {
            self.position_pieces(&pieces);
            self.schedule
                .all_gather(&self.by_position, self.ring.pos, self.segment);
            let head = header(Kind::AllGather, GATHER_BYTES, 0, off);
            self.run(OP, head, &mut out, None, false)?;
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
        let pieces = std::mem::take(&mut self.pieces);
        self.position_pieces(&pieces);
        self.pieces = pieces;
        self.schedule
            .all_gather(&self.by_position, self.ring.pos, self.segment);
        self.run(
            "barrier",
            header(Kind::Barrier, 0, 0, 1),
            &mut [],
            None,
            true,
        )
    }

    /// The most bytes [`CpuBackend::all_gather_bytes`] allocates for all contributions.
    pub(crate) fn set_max_gather(&mut self, bytes: u64) {
        self.max_gather = bytes;
    }

    /// [`CpuBackend::set_max_gather`]'s limit.
    pub(crate) fn max_gather(&self) -> u64 {
        self.max_gather
    }

    /// Overrides the latency-path threshold (benchmarks).
    pub(crate) fn set_small(&mut self, bytes: usize) {
        self.small = bytes;
    }

    /// Overrides the segment size (benchmarks).
    pub(crate) fn set_segment(&mut self, bytes: usize) {
        self.segment = bytes.max(64) / 64 * 64;
        let _ = self.scratch_bytes(self.segment);
    }

    /// Overrides how long shared-memory waits spin before sleeping (benchmarks).
    pub(crate) fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }
}

fn gather_too_large(
    op: &'static str,
    rank: usize,
    bytes: u64,
    total: u64,
    limit: u64,
) -> CommError {
    CommError::TooLarge {
        op,
        rank,
        bytes,
        total,
        limit,
    }
}

/// Where each rank's contribution goes in [`CpuBackend::all_gather_bytes`]'s output, and the
/// total, from the lengths the ranks announced (`lens`: 8 little-endian bytes per rank).
/// The running sum is checked against `limit` at every rank, so no announced length can
/// overflow it or make this rank allocate more than `limit` bytes.
fn gather_layout(
    op: &'static str,
    lens: &[u8],
    limit: u64,
) -> Result<(Vec<Span>, usize), CommError> {
    let mut pieces = Vec::with_capacity(lens.len() / 8);
    let mut total: u64 = 0;
    for (rank, chunk) in lens.chunks_exact(8).enumerate() {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let len = u64::from_le_bytes(word);
        let end = total.saturating_add(len);
        // `limit` also keeps every offset within `usize` on 32-bit targets.
        let (Ok(off), Ok(len_usize), true) =
            (usize::try_from(total), usize::try_from(len), end <= limit)
        else {
            return Err(gather_too_large(op, rank, len, end, limit));
        };
        pieces.push(Span {
            off,
            len: len_usize,
        });
        total = end;
    }
    let total = usize::try_from(total).map_err(|_| gather_too_large(op, 0, total, total, limit))?;
    Ok((pieces, total))
}

/// `n` consecutive pieces of `len` bytes, into a reused vector.
fn equal_pieces(out: &mut Vec<Span>, n: usize, len: usize) {
    out.clear();
    out.extend((0..n).map(|r| Span { off: r * len, len }));
}

/// What one call of [`drive`] does.
struct Job<'a> {
    rank: usize,
    /// What an average divides by.
    world: usize,
    op: &'static str,
    head: [u8; HEADER],
    schedule: &'a Schedule,
    reduce: Option<(DType, ReduceOp)>,
    timeout: Duration,
    spin: Duration,
}

/// Executes one schedule. Sends go to `link.send`, receives come from `link.recv`; segments
/// that reduce are combined into `work` straight from a shared-memory ring, or received into
/// `tmp` first from TCP. An average's [`Recv::ReduceLast`] segments are divided as soon as
/// they are complete, before they are forwarded.
fn drive(link: &mut Link, job: Job<'_>, work: &mut [u8], tmp: &mut [u8]) -> Result<(), CommError> {
    let Job {
        rank,
        world,
        op,
        head,
        schedule,
        reduce,
        timeout,
        spin,
    } = job;
    let deadline = Instant::now() + timeout;
    let (sends, recvs) = (&schedule.sends, &schedule.recvs);
    // Headers: 16 bytes, then (shared memory) zeros up to a multiple of 64 in the stream.
    let mut head_out = [0u8; HEADER + 64];
    head_out[..HEADER].copy_from_slice(&head);
    let head_out_len = HEADER + link.send.header_pad(HEADER);
    let mut head_in = [0u8; HEADER + 64];
    let head_in_len = HEADER + link.recv.header_pad(HEADER);
    // Positions count the header first: head_sent < head_out_len means it is in flight.
    let (mut send_i, mut send_pos) = (0usize, 0usize);
    let (mut recv_i, mut recv_pos) = (0usize, 0usize);
    let (mut head_sent, mut head_received) = (0usize, 0usize);
    let send_error = |link: &Link, e: EndError| e.into_comm(op, link.next, link.send.describe());
    let recv_error = |link: &Link, e: EndError| e.into_comm(op, link.prev, link.recv.describe());
    let spins = link.uses_shm() && !spin.is_zero();
    let streaming = work.len() >= STREAMING_BYTES;
    let mut idle_since: Option<Instant> = None;
    loop {
        let mut progressed = false;

        // Send side: the header, then segments whose dependencies are met.
        let send_ready =
            head_sent < head_out_len || (send_i < sends.len() && sends[send_i].after <= recv_i);
        if send_ready {
            let chunk: &[u8] = if head_sent < head_out_len {
                &head_out[head_sent..head_out_len]
            } else {
                let s = sends[send_i].span;
                &work[s.off + send_pos..s.off + s.len]
            };
            let k = link.send.write(chunk).map_err(|e| send_error(link, e))?;
            if k > 0 {
                progressed = true;
                if head_sent < head_out_len {
                    head_sent += k;
                } else {
                    send_pos += k;
                    if send_pos == sends[send_i].span.len {
                        send_i += 1;
                        send_pos = 0;
                    }
                }
            }
        }
        // Zero-length segments complete without I/O.
        while head_sent == head_out_len
            && send_i < sends.len()
            && sends[send_i].span.len == 0
            && sends[send_i].after <= recv_i
        {
            send_i += 1;
        }

        // Receive side: the header, then segments in order.
        if head_received < head_in_len {
            let k = link
                .recv
                .read(&mut head_in[head_received..head_in_len])
                .map_err(|e| recv_error(link, e))?;
            if k > 0 {
                progressed = true;
                let before = head_received;
                head_received += k;
                if before < HEADER && head_received >= HEADER && head_in[..HEADER] != head {
                    return Err(CommError::Mismatch {
                        op,
                        rank,
                        peer: link.prev,
                        ours: describe(&head),
                        theirs: describe(&head_in),
                    });
                }
            }
        } else if recv_i < recvs.len() {
            let s = recvs[recv_i].span;
            let how = recvs[recv_i].recv;
            let reducing = reduce.filter(|_| how != Recv::Copy);
            if recv_pos < s.len {
                let k = match (&mut link.recv, reducing) {
                    (RecvEnd::Shm(ring), Some((dtype, rop))) => ring
                        .reduce_into(&mut work[s.off + recv_pos..s.off + s.len], dtype, rop)
                        .map_err(EndError::from),
                    (end, Some(_)) => end.read(&mut tmp[recv_pos..s.len]),
                    (end, None) if streaming => {
                        end.read_streaming(&mut work[s.off + recv_pos..s.off + s.len])
                    }
                    (end, None) => end.read(&mut work[s.off + recv_pos..s.off + s.len]),
                }
                .map_err(|e| recv_error(link, e))?;
                if k > 0 {
                    progressed = true;
                    recv_pos += k;
                }
            }
            if recv_pos == s.len {
                if let Some((dtype, rop)) = reducing {
                    let done = &mut work[s.off..s.off + s.len];
                    if let RecvEnd::Tcp { .. } = &link.recv {
                        element::reduce(dtype, rop, done, &tmp[..s.len]);
                    }
                    if rop == ReduceOp::Avg && how == Recv::ReduceLast {
                        element::finish_avg(dtype, done, world);
                    }
                }
                recv_i += 1;
                recv_pos = 0;
                progressed = true;
            }
        }

        let send_done = head_sent == head_out_len && send_i == sends.len();
        let recv_done = head_received == head_in_len && recv_i == recvs.len();
        if send_done && recv_done {
            return Ok(());
        }
        if progressed {
            idle_since = None;
            continue;
        }
        let now = Instant::now();
        let want_send = !send_done && (head_sent < head_out_len || sends[send_i].after <= recv_i);
        let want_recv = !recv_done;
        // What the receive end must hold to go on: a shared-memory reduction takes whole
        // elements, and its sender may have published part of one.
        let recv_need = match (&link.recv, reduce) {
            (RecvEnd::Shm(_), Some((dtype, _)))
                if head_received == head_in_len
                    && recvs.get(recv_i).is_some_and(|r| r.recv != Recv::Copy) =>
            {
                dtype.size()
            }
            _ => 1,
        };
        if now >= deadline {
            // The successor counts only when it holds up a send that is ready (no room);
            // sends that wait for a receive wait for the predecessor.
            let mut peers = Vec::new();
            if want_recv {
                peers.push(link.prev);
            }
            if want_send && !peers.contains(&link.next) {
                peers.push(link.next);
            }
            return Err(CommError::Timeout {
                op,
                timeout,
                peers,
                diagnosis: Box::default(),
            });
        }
        // A shared-memory peer that left can make no more room or data.
        if want_send && link.send.gone() {
            return Err(send_error(link, EndError::Closed));
        }
        if want_recv && link.recv.gone(recv_need) {
            return Err(recv_error(link, EndError::Closed));
        }
        if spins && now.duration_since(*idle_since.get_or_insert(now)) < spin {
            // Yielding lets a peer (or anything else) that waits for this core run first,
            // which matters when ranks outnumber cores; on an idle core it returns at once.
            std::thread::yield_now();
            continue;
        }
        link.wait(want_send, want_recv.then_some(recv_need), deadline - now)
            .map_err(|e| CommError::io("poll", e))?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lens(values: &[u64]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn gather_layouts_place_pieces_back_to_back() {
        let (pieces, total) = gather_layout("t", &lens(&[3, 0, 5]), 8).unwrap();
        assert_eq!(total, 8);
        assert_eq!(
            pieces,
            [
                Span { off: 0, len: 3 },
                Span { off: 3, len: 0 },
                Span { off: 3, len: 5 }
            ]
        );
    }

    #[test]
    fn announced_lengths_over_the_limit_are_refused_naming_the_rank() {
        for (values, rank, bytes, total) in [
            (vec![3, 0, 6], 2, 6, 9),
            (vec![9, 0, 0], 0, 9, 9),
            // A length that would overflow the sum saturates instead of wrapping.
            (vec![1, u64::MAX, 1], 1, u64::MAX, u64::MAX),
            (vec![u64::MAX - 2, 5], 0, u64::MAX - 2, u64::MAX - 2),
        ] {
            match gather_layout("all_gather_bytes", &lens(&values), 8) {
                Err(CommError::TooLarge {
                    op: "all_gather_bytes",
                    rank: r,
                    bytes: b,
                    total: t,
                    limit: 8,
                }) => assert_eq!((r, b, t), (rank, bytes, total), "{values:?}"),
                other => panic!("{values:?}: {other:?}"),
            }
        }
        let err = gather_layout("all_gather_bytes", &lens(&[1, 20]), 8).unwrap_err();
        assert_eq!(
            err.to_string(),
            "all_gather_bytes: rank 1 contributes 20 bytes, which brings the total to 21 \
             bytes, over the limit of 8 bytes for all ranks together \
             (ProcessGroup::set_max_gather_bytes)"
        );
    }

    /// What a peer sends on a TCP ring link, fuzzed: rank 1 of 2 runs a collective over
    /// real loopback sockets whose other ends the test holds. The predecessor's bytes are
    /// the fuzz input, then it hangs up; the successor's are drained.
    mod framing {
        use super::*;
        use crate::ring::link::{RecvEnd, SendEnd};
        use proptest::prelude::*;
        use std::io::{Read, Write};
        use std::net::{TcpListener, TcpStream};

        const MAX_GATHER: u64 = 1 << 20;

        /// A pair of connected loopback sockets.
        fn pair() -> (TcpStream, TcpStream) {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (b, _) = listener.accept().unwrap();
            (a, b)
        }

        /// Runs `op` on rank 1 of 2 while its predecessor sends `bytes` and hangs up.
        fn with_peer_sending<T>(
            bytes: &[u8],
            op: impl FnOnce(&mut CpuBackend) -> Result<T, CommError>,
        ) -> Result<T, CommError> {
            let (mut from_prev, recv) = pair();
            let (send, mut to_next) = pair();
            let addr = recv.local_addr().unwrap();
            let link = Link {
                next: 0,
                prev: 0,
                send: SendEnd::Tcp { stream: send, addr },
                recv: RecvEnd::Tcp { stream: recv, addr },
                bell: None,
            };
            let ring = RingOrder {
                order: vec![0, 1],
                pos: 1,
            };
            let heartbeat = Arc::new(Heartbeat::without_thread(1, 2, "fuzz"));
            let mut backend =
                CpuBackend::new(1, 2, ring, Some(link), Duration::from_secs(20), heartbeat)
                    .unwrap();
            backend.set_max_gather(MAX_GATHER);
            let drain = std::thread::spawn(move || {
                let mut sink = [0u8; 4096];
                while matches!(to_next.read(&mut sink), Ok(k) if k > 0) {}
            });
            let feed = {
                let bytes = bytes.to_vec();
                std::thread::spawn(move || {
                    let _ = from_prev.write_all(&bytes);
                    let _ = from_prev.shutdown(std::net::Shutdown::Write);
                    // Keep the socket open until rank 1 is done reading, so that what it
                    // sees is the end of the data, not a reset.
                    let mut rest = [0u8; 64];
                    while matches!(from_prev.read(&mut rest), Ok(k) if k > 0) {}
                })
            };
            let result = op(&mut backend);
            // A failure on the peer's bytes leaves the stream out of step: the backend must
            // refuse any further collective. Only `TooLarge` (refused before anything was
            // read) leaves it usable.
            if let Err(e) = &result {
                if !matches!(e, CommError::TooLarge { .. }) {
                    let again = backend.barrier();
                    assert!(
                        matches!(again, Err(CommError::Poisoned(_))),
                        "after {e:?} the backend is not poisoned: {again:?}"
                    );
                }
            }
            drop(backend);
            feed.join().unwrap();
            drain.join().unwrap();
            result
        }

        /// The only ways a collective may fail on a peer's bytes: they are not the same
        /// collective, they announce too much, or the peer hung up before the end. Never a
        /// timeout: the peer's hang-up is seen at once.
        fn expected_failure(err: &CommError) -> bool {
            matches!(
                err,
                CommError::Mismatch { peer: 0, .. }
                    | CommError::TooLarge { .. }
                    | CommError::PeerLost { peer: 0, .. }
            )
        }

        fn lengths_header(len: u64) -> Vec<u8> {
            let mut bytes = header(Kind::AllGather, GATHER_LENGTHS, 0, 8).to_vec();
            bytes.extend_from_slice(&len.to_le_bytes());
            bytes
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

            /// Any bytes at all: every collective fails with a protocol error or the
            /// hang-up, and the backend refuses further use (it is poisoned;
            /// `with_peer_sending` checks it).
            #[test]
            fn any_bytes_end_every_collective_with_an_error(
                bytes in proptest::collection::vec(any::<u8>(), 0..256),
                which in 0u8..4,
            ) {
                let result = with_peer_sending(&bytes, |b| match which {
                    0 => b.all_reduce(&mut [0u8; 64], DType::F32, ReduceOp::Sum).map(|_| ()),
                    1 => b.broadcast(&mut [0u8; 32], 0),
                    2 => b.barrier(),
                    _ => b.all_gather_bytes(b"mine").map(|_| ()),
                });
                // Random bytes can only pass as a header of the same collective by chance
                // (16 exact bytes); then too few data bytes follow.
                let err = result.expect_err("a collective succeeded on random bytes");
                prop_assert!(expected_failure(&err), "{err:?}");
            }

            /// A peer that speaks the protocol but announces any length in
            /// `all_gather_bytes`: over the limit is `TooLarge` before any allocation;
            /// within it, the bytes that follow are the peer's piece, or the hang-up.
            #[test]
            fn announced_gather_lengths_are_bounded_and_honoured(
                len in prop_oneof![0u64..64, any::<u64>()],
                tail in proptest::collection::vec(any::<u8>(), 0..80),
            ) {
                let mine = b"mine";
                let total = len.saturating_add(mine.len() as u64);
                let mut bytes = lengths_header(len);
                bytes.extend_from_slice(&header(Kind::AllGather, GATHER_BYTES, 0, total as usize));
                bytes.extend_from_slice(&tail);
                match with_peer_sending(&bytes, |b| b.all_gather_bytes(mine)) {
                    Ok(pieces) => {
                        prop_assert!(len as usize <= tail.len());
                        prop_assert_eq!(&pieces[0][..], &tail[..len as usize]);
                        prop_assert_eq!(&pieces[1][..], &mine[..]);
                    }
                    Err(CommError::TooLarge { rank: 0, bytes: b, .. }) => {
                        prop_assert!(total > MAX_GATHER);
                        prop_assert_eq!(b, len);
                    }
                    Err(err) => {
                        prop_assert!(total <= MAX_GATHER && (len as usize) > tail.len(), "{err:?}");
                        prop_assert!(matches!(err, CommError::PeerLost { peer: 0, .. }), "{err:?}");
                    }
                }
            }

            /// A header of another collective, dtype, argument or length (one byte
            /// changed) is a mismatch naming both, whatever follows.
            #[test]
            fn a_header_that_differs_in_any_byte_is_a_mismatch(
                at in 0usize..HEADER,
                flip in 1u8..=255,
                tail in proptest::collection::vec(any::<u8>(), 0..64),
            ) {
                let mut bytes = header(Kind::AllReduce, dtype_code(DType::F32), op_code(ReduceOp::Sum), 64).to_vec();
                bytes[at] ^= flip;
                bytes.extend_from_slice(&tail);
                let err = with_peer_sending(&bytes, |b| {
                    b.all_reduce(&mut [0u8; 64], DType::F32, ReduceOp::Sum)
                })
                .expect_err("a changed header passed");
                match err {
                    CommError::Mismatch { peer: 0, ours, theirs, .. } => {
                        prop_assert_eq!(ours.as_str(), "all_reduce Sum of 16 x f32");
                        prop_assert_ne!(theirs, ours);
                    }
                    other => prop_assert!(false, "{other:?}"),
                }
            }
        }

        /// A mismatch says both collectives in words: an i64 maximum against an f64 sum.
        #[test]
        fn a_mismatch_names_the_collectives_in_words() {
            let bytes = header(
                Kind::AllReduce,
                dtype_code(DType::I64),
                op_code(ReduceOp::Max),
                16,
            );
            let err = with_peer_sending(&bytes, |b| {
                b.all_reduce(&mut [0u8; 8], DType::F64, ReduceOp::Sum)
            })
            .expect_err("another collective passed");
            assert_eq!(
                err.to_string(),
                "all_reduce: rank 0 called all_reduce Max of 2 x i64, this rank (rank 1) called \
                 all_reduce Sum of 1 x f64; every rank must call the same collectives with the \
                 same sizes"
            );
        }
    }
}
