//! Shared-memory rings: one direction of a ring link between two ranks on one host.
//!
//! The receiving rank creates each ring: an anonymous `memfd` segment, sized, sealed against
//! shrinking and growing, mapped, and handed to the sending rank over the link's Unix-socket
//! handshake (`SCM_RIGHTS`, after the token check). Both sides close the descriptor once
//! mapped, so the memory lives exactly as long as the two mappings: a crash frees it, and
//! nothing is ever named in `/dev/shm`.
//!
//! A segment is a control page followed by `capacity` data bytes (a power of two). The sender
//! owns `head` (bytes written), the receiver `tail` (bytes consumed); both are wrapping `u32`
//! byte counts, so `head - tail` is the number of unread bytes and byte `i` of the stream sits
//! at `i % capacity`. The sender writes only the free part, publishes `head` with release
//! ordering, and the receiver reads (or reduces straight out of the ring, without a staging
//! copy) only the published part before publishing `tail`: at every moment each data byte is
//! owned by exactly one side.
//!
//! Wake-ups cost nothing while both sides are busy. A side that finds nothing to do spins
//! briefly, then sets its `*_waiting` flag, checks the ring once more, and sleeps in `poll`
//! on its own eventfd (its "bell"), passed to both neighbours at the handshake. A side that
//! publishes looks at the other's flag (a sequentially consistent fence orders the two) and
//! rings the bell only if it is set. `closed` tells the other side that this one failed or
//! left the group; the link's Unix socket stays open as a second signal that the kernel
//! raises even when the process is killed.
//!
//! The peer can write anything into the segment, so nothing read from it is trusted: every
//! `head` or `tail` is checked ([`check_head`], [`check_tail`]) against this side's own
//! position and the last value it accepted before it is used to index the ring, and an
//! impossible one is a [`RingFault`], which the collective reports as
//! [`CommError::Protocol`](crate::CommError::Protocol) naming the peer rank. The segment's
//! memory is reserved (`fallocate`) when it is created, so a host short of memory fails the
//! creation instead of raising `SIGBUS` in a later access.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, Ordering};

use rustix::event::{eventfd, EventfdFlags};
use rustix::fs::SealFlags;
use rustix::fs::{
    fallocate, fcntl_add_seals, fcntl_get_seals, fstat, ftruncate, memfd_create, FallocateFlags,
    MemfdFlags,
};
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::element::{self, DType, ReduceOp};

mod fault;
use fault::published_tail;
pub(crate) use fault::RingFault;
use fault::{check_head, check_tail};

/// Bytes in front of the data: the control block, rounded up to a page.
const CONTROL_BYTES: usize = 4096;
const MAGIC: u32 = u32::from_le_bytes(*b"DDPM");
const LAYOUT_VERSION: u32 = 1;
/// Default data bytes of one ring.
pub(crate) const DEFAULT_CAPACITY: usize = 1 << 20;
/// Smallest and largest ring the options accept.
pub(crate) const MIN_CAPACITY: usize = 4096;
pub(crate) const MAX_CAPACITY: usize = 1 << 30;
/// Name shown for the segment in `/proc/<pid>/maps` (`/memfd:ddp-comm-ring (deleted)`).
pub(crate) const SEGMENT_NAME: &str = "ddp-comm-ring";
/// Most bytes the sender copies before publishing them, so that the receiver can start on
/// the first part while the rest is being copied.
const PUBLISH_CHUNK: usize = 64 * 1024;

/// One atomic word on its own pair of cache lines (the adjacent-line prefetcher fetches
/// lines in pairs), so that the two sides never write to the same line.
#[repr(C, align(128))]
struct Padded(AtomicU32);

impl std::ops::Deref for Padded {
    type Target = AtomicU32;

    fn deref(&self) -> &AtomicU32 {
        &self.0
    }
}

/// The control block at the start of a segment. Only atomics: both processes access it
/// concurrently, and every bit pattern (a fresh segment is zeros) is valid.
#[repr(C)]
struct Control {
    /// Bytes written by the sender (wrapping).
    head: Padded,
    /// Bytes consumed by the receiver (wrapping).
    tail: Padded,
    /// The receiver sleeps until `head` moves.
    reader_waiting: Padded,
    /// The sender sleeps until `tail` moves.
    writer_waiting: Padded,
    /// Set by a side that failed or left; never cleared.
    closed: Padded,
    magic: AtomicU32,
    version: AtomicU32,
    capacity: AtomicU32,
}

const _: () = assert!(std::mem::size_of::<Control>() <= CONTROL_BYTES);

/// A shared mapping of a whole segment; unmapped when dropped.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; shared state in it is only
// touched through atomics (`Control`) or under the ring protocol, which hands each data
// byte to one side at a time, so moving the owner to another thread is sound.
unsafe impl Send for Mapping {}

impl Mapping {
    fn new(fd: BorrowedFd<'_>, len: usize) -> io::Result<Self> {
        // SAFETY: a new shared mapping at an address the kernel chooses (null hint), so no
        // existing memory is affected; the file is at least `len` bytes long and sealed
        // against shrinking (checked by both callers), so every mapped page stays backed.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::POPULATE,
                fd,
                0,
            )
        }?;
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Mapping { ptr, len })
    }

    fn control(&self) -> &Control {
        // SAFETY: the mapping is page-aligned and at least CONTROL_BYTES long, more than
        // `Control` needs; `Control` holds only atomics, valid for any bit pattern and meant
        // for concurrent access; the reference cannot outlive `self`, which owns the mapping.
        unsafe { &*self.ptr.as_ptr().cast::<Control>() }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: CONTROL_BYTES is within the mapping (its length is CONTROL_BYTES plus the
        // capacity, checked at creation and at opening).
        unsafe { self.ptr.as_ptr().add(CONTROL_BYTES) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; no reference into the mapping
        // outlives `self` (all accessors borrow it).
        let _ = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Allocates every page of the segment now: without it a page is allocated at its first
/// touch, and a host (or cgroup) out of memory answers that touch with `SIGBUS` instead of
/// an error at creation.
fn reserve(fd: &OwnedFd, len: usize) -> io::Result<()> {
    fallocate(fd, FallocateFlags::empty(), 0, len as u64).map_err(|e| {
        io::Error::new(
            io::ErrorKind::OutOfMemory,
            format!("reserving {len} bytes of shared memory: {e}"),
        )
    })
}

/// One ring (either side's view of it).
#[derive(Debug)]
struct Ring {
    map: Mapping,
    capacity: usize,
}

impl Ring {
    /// Creates a sealed segment with `capacity` data bytes; returns the descriptor to hand
    /// to the sender and this side's mapping.
    fn create(capacity: usize) -> io::Result<(OwnedFd, Ring)> {
        debug_assert!(
            capacity.is_power_of_two() && (MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity)
        );
        let fd = memfd_create(
            SEGMENT_NAME,
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )?;
        let len = CONTROL_BYTES + capacity;
        ftruncate(&fd, len as u64)?;
        reserve(&fd, len)?;
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        let map = Mapping::new(fd.as_fd(), len)?;
        let control = map.control();
        control.capacity.store(capacity as u32, Ordering::Relaxed);
        control.version.store(LAYOUT_VERSION, Ordering::Relaxed);
        control.magic.store(MAGIC, Ordering::Release);
        Ok((fd, Ring { map, capacity }))
    }

    /// Maps a segment received from the peer, after checking that it is one.
    fn open(fd: &OwnedFd) -> Result<Ring, String> {
        // The seals first: the size read after them cannot change any more.
        let seals = fcntl_get_seals(fd).map_err(|e| format!("reading seals: {e}"))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err("segment is not sealed against resizing".into());
        }
        let len = fstat(fd).map_err(|e| format!("fstat: {e}"))?.st_size;
        let len = usize::try_from(len).map_err(|_| format!("segment size {len}"))?;
        let capacity = len.saturating_sub(CONTROL_BYTES);
        if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
            return Err(format!("segment of {len} bytes is not a ring"));
        }
        let map = Mapping::new(fd.as_fd(), len).map_err(|e| format!("mmap: {e}"))?;
        let control = map.control();
        let (magic, version) = (
            control.magic.load(Ordering::Acquire),
            control.version.load(Ordering::Relaxed),
        );
        if magic != MAGIC || version != LAYOUT_VERSION {
            return Err(format!("segment has magic {magic:#x} version {version}"));
        }
        if control.capacity.load(Ordering::Relaxed) as usize != capacity {
            return Err("segment capacity disagrees with its size".into());
        }
        let (head, tail) = (
            control.head.load(Ordering::Acquire),
            control.tail.load(Ordering::Acquire),
        );
        if (head, tail) != (0, 0) {
            return Err(format!(
                "segment is not fresh: head {head}, tail {tail} (both must start at 0)"
            ));
        }
        Ok(Ring { map, capacity })
    }

    fn control(&self) -> &Control {
        self.map.control()
    }

    fn mask(&self) -> u32 {
        (self.capacity - 1) as u32
    }

    /// Whether either side set `closed`.
    fn closed(&self) -> bool {
        self.control().closed.load(Ordering::Acquire) != 0
    }
}

/// An eventfd that wakes this rank: its neighbours write to it, it sleeps in `poll` on it.
#[derive(Debug)]
pub(crate) struct Bell(OwnedFd);

impl Bell {
    pub(crate) fn new() -> io::Result<Bell> {
        Ok(Bell(eventfd(
            0,
            EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK,
        )?))
    }

    /// Clears pending rings (after waking up).
    pub(crate) fn drain(&self) {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.0, &mut buf);
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

fn ring_bell(fd: &OwnedFd) {
    // An eventfd adds the written value to its counter; a full counter (2^64 - 2) only means
    // the peer is already due to wake, so the error is ignored.
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

/// What a shared-memory end knows about its peer, and the socket that tells it the peer
/// went away.
#[derive(Debug)]
pub(crate) struct Peer {
    /// The handshake connection, kept open: the kernel hangs it up when the peer exits.
    pub control: UnixStream,
    /// The peer's process id (`SO_PEERCRED`), for messages.
    pub pid: u32,
    /// The peer's bell.
    bell: OwnedFd,
    /// Whether the control socket reported a hang-up.
    pub hung_up: bool,
}

impl Peer {
    pub(crate) fn new(control: UnixStream, pid: u32, bell: OwnedFd) -> Self {
        Peer {
            control,
            pid,
            bell,
            hung_up: false,
        }
    }
}

/// The sending side of a ring.
#[derive(Debug)]
pub(crate) struct ShmSender {
    ring: Ring,
    head: u32,
    /// The last `tail` accepted from the receiver.
    seen_tail: u32,
    pub peer: Peer,
}

impl ShmSender {
    /// Maps the segment the receiver sent.
    pub(crate) fn open(fd: &OwnedFd, peer: Peer) -> Result<Self, String> {
        let ring = Ring::open(fd)?;
        Ok(ShmSender {
            ring,
            head: 0,
            seen_tail: 0,
            peer,
        })
    }

    /// Bytes written so far (wrapping): the stream position.
    pub(crate) fn position(&self) -> u32 {
        self.head
    }

    /// Free bytes, from the receiver's `tail` (checked, at most the capacity).
    fn free(&self) -> Result<usize, RingFault> {
        let tail = self.ring.control().tail.load(Ordering::Acquire);
        check_tail(self.head, self.seen_tail, tail, self.ring.capacity)
    }

    /// Copies as much of `src` as fits (at most one publish chunk) and publishes it; 0 when
    /// the ring is full. An impossible `tail` from the receiver is an error.
    pub(crate) fn write(&mut self, src: &[u8]) -> Result<usize, RingFault> {
        let tail = self.ring.control().tail.load(Ordering::Acquire);
        let free = check_tail(self.head, self.seen_tail, tail, self.ring.capacity)?;
        self.seen_tail = tail;
        let n = src.len().min(free).min(PUBLISH_CHUNK);
        if n == 0 {
            return Ok(0);
        }
        let off = (self.head & self.ring.mask()) as usize;
        let first = n.min(self.ring.capacity - off);
        let data = self.ring.map.data();
        // SAFETY: `[head, head + n)` is free: the receiver published a tail at least
        // `n + used` bytes behind capacity, so it no longer reads these bytes and will not
        // until we publish `head`; `n <= free <= capacity` (checked by `check_tail`, not
        // taken from the peer), so the two parts lie inside the data area (`off + first <=
        // capacity`, `n - first <= capacity`); `src` is our own memory, disjoint from it.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), data.add(off), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), data, n - first);
        }
        self.head = self.head.wrapping_add(n as u32);
        let control = self.ring.control();
        control.head.store(self.head, Ordering::Release);
        wake_if_waiting(&control.reader_waiting, &self.peer.bell);
        Ok(n)
    }

    /// Announces that this side is about to sleep until the ring has room; false if it has
    /// room already (or the peer left, or broke the protocol, which the next write
    /// reports), in which case nothing was armed.
    pub(crate) fn arm(&self) -> bool {
        arm(&self.ring.control().writer_waiting, || {
            self.free().map_or(true, |free| free > 0) || self.peer_closed()
        })
    }

    pub(crate) fn disarm(&self) {
        self.ring
            .control()
            .writer_waiting
            .store(0, Ordering::Relaxed);
    }

    /// Whether the receiver set `closed`.
    pub(crate) fn peer_closed(&self) -> bool {
        self.ring.closed()
    }

    /// Marks the ring closed and wakes the receiver.
    pub(crate) fn close(&self) {
        close(&self.ring, &self.peer);
    }
}

impl Drop for ShmSender {
    fn drop(&mut self) {
        self.close();
    }
}

/// The receiving side of a ring.
#[derive(Debug)]
pub(crate) struct ShmReceiver {
    ring: Ring,
    tail: u32,
    /// The last `head` accepted from the sender.
    seen_head: u32,
    pub peer: Peer,
}

impl ShmReceiver {
    /// Wraps a created ring once the sender is known.
    fn from_ring(ring: Ring, peer: Peer) -> Self {
        // A created segment starts at zero; what the sender may have written since is
        // checked when it is read.
        ShmReceiver {
            ring,
            tail: 0,
            seen_head: 0,
            peer,
        }
    }

    /// Bytes consumed so far (wrapping): the stream position.
    pub(crate) fn position(&self) -> u32 {
        self.tail
    }

    /// Published bytes not yet consumed (checked, at most the capacity).
    pub(crate) fn available(&self) -> Result<usize, RingFault> {
        let head = self.ring.control().head.load(Ordering::Acquire);
        check_head(self.tail, self.seen_head, head, self.ring.capacity)
    }

    /// As [`ShmReceiver::available`], remembering the head it accepted.
    fn accept_head(&mut self) -> Result<usize, RingFault> {
        let head = self.ring.control().head.load(Ordering::Acquire);
        let unread = check_head(self.tail, self.seen_head, head, self.ring.capacity)?;
        self.seen_head = head;
        Ok(unread)
    }

    /// The published bytes `[tail, tail + n)` as at most two slices (the ring wraps); `n`
    /// comes from [`ShmReceiver::accept_head`].
    fn published(&self, n: usize) -> [&[u8]; 2] {
        debug_assert!(n <= self.ring.capacity);
        let off = (self.tail & self.ring.mask()) as usize;
        let first = n.min(self.ring.capacity - off);
        let data = self.ring.map.data();
        // SAFETY: the sender published `head >= tail + n` (acquire load in `accept_head`),
        // so these bytes are written and will not be written again before we publish a tail
        // past them, which needs `&mut self`; `n <= capacity` (`check_head` bounds it, the
        // peer's value is never used unchecked), so both parts lie inside the data area.
        unsafe {
            [
                std::slice::from_raw_parts(data.add(off), first),
                std::slice::from_raw_parts(data, n - first),
            ]
        }
    }

    fn consume(&mut self, n: usize) {
        self.tail = self.tail.wrapping_add(n as u32);
        let control = self.ring.control();
        control
            .tail
            .store(published_tail(self.tail), Ordering::Release);
        wake_if_waiting(&control.writer_waiting, &self.peer.bell);
    }

    /// Copies up to `dst.len()` published bytes into `dst`; 0 when none are there.
    pub(crate) fn read(&mut self, dst: &mut [u8]) -> Result<usize, RingFault> {
        self.read_with(dst, <[u8]>::copy_from_slice)
    }

    /// As [`ShmReceiver::read`], with stores that bypass the cache: for results too large
    /// to stay cached, which then cost one write to memory instead of a read and a write.
    pub(crate) fn read_streaming(&mut self, dst: &mut [u8]) -> Result<usize, RingFault> {
        self.read_with(dst, copy_streaming)
    }

    fn read_with(
        &mut self,
        dst: &mut [u8],
        copy: impl Fn(&mut [u8], &[u8]),
    ) -> Result<usize, RingFault> {
        let n = dst.len().min(self.accept_head()?);
        if n == 0 {
            return Ok(0);
        }
        let [a, b] = self.published(n);
        copy(&mut dst[..a.len()], a);
        copy(&mut dst[a.len()..n], b);
        self.consume(n);
        Ok(n)
    }

    /// Combines up to `dst.len()` published bytes into `dst` element by element, straight
    /// from the ring; returns the bytes consumed (whole elements only).
    ///
    /// The stream position must be element-aligned, which the collectives guarantee by
    /// starting each one at a multiple of 64 bytes and cutting at element boundaries.
    pub(crate) fn reduce_into(
        &mut self,
        dst: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<usize, RingFault> {
        let elem = dtype.size();
        debug_assert_eq!(
            self.tail as usize % elem,
            0,
            "ring position not element-aligned"
        );
        let n = dst.len().min(self.accept_head()?) / elem * elem;
        if n == 0 {
            return Ok(0);
        }
        let [a, b] = self.published(n);
        element::reduce(dtype, op, &mut dst[..a.len()], a);
        element::reduce(dtype, op, &mut dst[a.len()..n], b);
        self.consume(n);
        Ok(n)
    }

    /// Announces that this side is about to sleep until at least `need` bytes are there (a
    /// reduction takes whole elements; the sender may have published part of one); false
    /// if they are there already (or the peer left, or broke the protocol, which the next
    /// read reports), in which case nothing was armed.
    pub(crate) fn arm(&self, need: usize) -> bool {
        arm(&self.ring.control().reader_waiting, || {
            self.available().map_or(true, |n| n >= need.max(1)) || self.peer_closed()
        })
    }

    pub(crate) fn disarm(&self) {
        self.ring
            .control()
            .reader_waiting
            .store(0, Ordering::Relaxed);
    }

    /// Whether the sender set `closed`.
    pub(crate) fn peer_closed(&self) -> bool {
        self.ring.closed()
    }

    /// Marks the ring closed and wakes the sender.
    pub(crate) fn close(&self) {
        close(&self.ring, &self.peer);
    }
}

impl Drop for ShmReceiver {
    fn drop(&mut self) {
        self.close();
    }
}

/// Sets `flag` (this side is about to sleep), then checks once more whether it can
/// `proceed`; if it can, clears the flag again and returns false. The fence pairs with the
/// one in [`wake_if_waiting`].
fn arm(flag: &Padded, proceed: impl FnOnce() -> bool) -> bool {
    flag.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    if proceed() {
        flag.store(0, Ordering::Relaxed);
        return false;
    }
    true
}

fn close(ring: &Ring, peer: &Peer) {
    ring.control().closed.store(1, Ordering::Release);
    ring_bell(&peer.bell);
    let _ = peer.control.shutdown(std::net::Shutdown::Both);
}

/// After publishing: rings the peer's bell if it announced that it sleeps. The fence pairs
/// with the one in `arm`: either the sleeper sees the new counter, or this side sees its flag.
fn wake_if_waiting(flag: &Padded, bell: &OwnedFd) {
    fence(Ordering::SeqCst);
    if flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0 {
        ring_bell(bell);
    }
}

/// Copies `src` into `dst` (equal lengths) with non-temporal stores where the CPU has them
/// (SSE2, on every x86-64): the destination lines are written to memory without being read
/// first and without evicting what is cached. Elsewhere a plain copy.
fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let len = dst.len().min(src.len());
        let head = dst.as_ptr().align_offset(16).min(len);
        let lines = (len - head) / 64;
        let body = lines * 64;
        dst[..head].copy_from_slice(&src[..head]);
        // SAFETY: SSE2 is part of x86-64. `dst[head..head + body]` is 16-byte aligned
        // (`align_offset`) and, like `src[head..head + body]` (read unaligned), lies within
        // its slice; the fence orders the non-temporal stores before anything this thread
        // does next (they are otherwise weakly ordered), so later readers of `dst`, in this
        // thread or after synchronising with it, see the copied bytes.
        unsafe {
            let d = dst.as_mut_ptr().add(head).cast::<__m128i>();
            let s = src.as_ptr().add(head).cast::<__m128i>();
            for i in 0..lines * 4 {
                _mm_stream_si128(d.add(i), _mm_loadu_si128(s.add(i)));
            }
            _mm_sfence();
        }
        dst[head + body..len].copy_from_slice(&src[head + body..len]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// The receiver's half of setting up a ring: a created segment waiting for its sender.
#[derive(Debug)]
pub(crate) struct PendingRing {
    ring: Ring,
}

impl PendingRing {
    /// Creates the segment; returns it and the descriptor to send.
    pub(crate) fn create(capacity: usize) -> io::Result<(OwnedFd, PendingRing)> {
        let (fd, ring) = Ring::create(capacity)?;
        Ok((fd, PendingRing { ring }))
    }

    /// The receiving end, once the sender has been accepted.
    pub(crate) fn into_receiver(self, peer: Peer) -> ShmReceiver {
        ShmReceiver::from_ring(self.ring, peer)
    }
}

/// Most descriptors one handshake message carries.
const MAX_FDS: usize = 2;

/// Sends `bytes` with `fds` attached (`SCM_RIGHTS`), all in one message.
pub(crate) fn send_with_fds(
    stream: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("too many descriptors for one message"));
    }
    let sent = sendmsg(
        stream,
        &[IoSlice::new(bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if sent < bytes.len() {
        // The message is small; a stream socket takes it whole unless the peer is gone.
        return Err(io::Error::new(io::ErrorKind::WriteZero, "short send"));
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes and the descriptors attached to them (at most
/// [`MAX_FDS`]; extra ones are closed by the kernel). Returns the byte count (0 at the end
/// of the stream) and the descriptors, which close when dropped.
pub(crate) fn recv_with_fds(
    stream: &UnixStream,
    buf: &mut [u8],
) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = recvmsg(
        stream,
        &mut [IoSliceMut::new(buf)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut fds = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = msg {
            fds.extend(received);
        }
    }
    Ok((got.bytes, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::as_bytes_mut;

    /// A connected sender and receiver in this process, each with its own bell (returned
    /// too: the sender's, then the receiver's), wired as the handshake wires them.
    fn wired(capacity: usize) -> (ShmSender, ShmReceiver, Bell, Bell) {
        let (fd, pending) = PendingRing::create(capacity).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let (tx_bell, rx_bell) = (Bell::new().unwrap(), Bell::new().unwrap());
        let dup = |bell: &Bell| bell.0.try_clone().unwrap();
        let sender = ShmSender::open(&fd, Peer::new(a, 1, dup(&rx_bell))).unwrap();
        drop(fd);
        let receiver = pending.into_receiver(Peer::new(b, 2, dup(&tx_bell)));
        (sender, receiver, tx_bell, rx_bell)
    }

    fn pair(capacity: usize) -> (ShmSender, ShmReceiver) {
        let (tx, rx, _, _) = wired(capacity);
        (tx, rx)
    }

    #[test]
    fn bytes_cross_the_wrap_in_order() {
        let (mut tx, mut rx) = pair(MIN_CAPACITY);
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut got = vec![0u8; data.len()];
        let (mut sent, mut received) = (0, 0);
        // Uneven pieces on both sides, so that copies straddle the end of the ring.
        while received < data.len() {
            sent += tx
                .write(&data[sent..(sent + 1000).min(data.len())])
                .unwrap();
            received += rx
                .read(&mut got[received..(received + 777).min(data.len())])
                .unwrap();
        }
        assert_eq!(got, data);
        assert_eq!(tx.position(), rx.position());
        assert_eq!(rx.available().unwrap(), 0);
    }

    #[test]
    fn streaming_copies_match_plain_ones_at_every_alignment() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i * 13 % 256) as u8).collect();
        for dst_off in 0..17 {
            for (start, len) in [(0, 0), (3, 5), (1, 63), (5, 200), (0, 1000 - 17)] {
                let mut dst = vec![0xAAu8; 1000];
                copy_streaming(&mut dst[dst_off..dst_off + len], &src[start..start + len]);
                assert_eq!(&dst[dst_off..dst_off + len], &src[start..start + len]);
                assert!(dst[..dst_off].iter().all(|&b| b == 0xAA), "wrote before");
                assert!(
                    dst[dst_off + len..].iter().all(|&b| b == 0xAA),
                    "wrote after"
                );
            }
        }
    }

    #[test]
    fn a_full_ring_takes_nothing_until_the_reader_consumes() {
        let (mut tx, mut rx) = pair(MIN_CAPACITY);
        let block = vec![1u8; 3 * MIN_CAPACITY];
        assert_eq!(tx.write(&block).unwrap(), MIN_CAPACITY);
        assert_eq!(tx.write(&block).unwrap(), 0);
        assert!(tx.arm(), "a full ring must let the writer sleep");
        tx.disarm();
        let mut sink = vec![0u8; 100];
        assert_eq!(rx.read(&mut sink).unwrap(), 100);
        assert_eq!(tx.write(&block).unwrap(), 100);
    }

    #[test]
    fn reduction_reads_straight_from_the_ring() {
        let (mut tx, mut rx) = pair(MIN_CAPACITY);
        // Start near the end of the ring so that the reduction wraps.
        let mut skip = vec![0u8; MIN_CAPACITY - 64];
        tx.write(&skip).unwrap();
        rx.read(&mut skip).unwrap();
        let mut theirs: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let mut mine: Vec<f32> = vec![0.5; 1000];
        let mut sent = 0;
        let mut done = 0;
        let theirs = as_bytes_mut(&mut theirs);
        let mine_bytes = as_bytes_mut(&mut mine);
        while done < mine_bytes.len() {
            sent += tx.write(&theirs[sent..]).unwrap();
            done += rx
                .reduce_into(&mut mine_bytes[done..], DType::F32, ReduceOp::Sum)
                .unwrap();
        }
        assert!(mine.iter().enumerate().all(|(i, v)| *v == i as f32 + 0.5));
    }

    #[test]
    fn the_bell_rings_only_for_a_sleeping_side() {
        let (mut tx, mut rx, tx_bell, rx_bell) = wired(MIN_CAPACITY);
        let mut count = [0u8; 8];
        // Nobody sleeps: publishing does not touch the bell.
        tx.write(&[1, 2, 3]).unwrap();
        assert!(
            rustix::io::read(rx_bell.fd(), &mut count).is_err(),
            "bell rang for nobody"
        );
        // With data present the reader does not arm; once it has read everything it does,
        // and the next write rings its bell once.
        assert!(!rx.arm(1));
        rx.read(&mut [0u8; 3]).unwrap();
        assert!(rx.arm(1));
        tx.write(&[4]).unwrap();
        tx.write(&[5]).unwrap();
        assert_eq!(rustix::io::read(rx_bell.fd(), &mut count).unwrap(), 8);
        assert_eq!(u64::from_ne_bytes(count), 1);
        // A writer facing a full ring sleeps on its own bell, which the reader rings.
        tx.write(&vec![0u8; MIN_CAPACITY]).unwrap();
        assert!(tx.arm());
        rx.read(&mut [0u8; 10]).unwrap();
        assert_eq!(rustix::io::read(tx_bell.fd(), &mut count).unwrap(), 8);
        assert_eq!(u64::from_ne_bytes(count), 1);
    }

    /// Part of an element published (a sender whose room ended mid-element): a reduction,
    /// which needs a whole one, may sleep until the rest comes; a copy may not.
    #[test]
    fn a_reader_that_needs_a_whole_element_sleeps_on_part_of_one() {
        let (mut tx, mut rx) = pair(MIN_CAPACITY);
        tx.write(&[1, 2, 3]).unwrap();
        let mut sum = [0u8; 4];
        assert_eq!(rx.reduce_into(&mut sum, DType::F32, ReduceOp::Sum), Ok(0));
        assert!(
            rx.arm(4),
            "3 bytes of a 4-byte element kept the reader awake"
        );
        rx.disarm();
        assert!(!rx.arm(1));
        tx.write(&[4]).unwrap();
        assert!(!rx.arm(4));
        assert_eq!(rx.reduce_into(&mut sum, DType::F32, ReduceOp::Sum), Ok(4));
        // A sender that leaves with part of an element published is gone for a reduction,
        // which can never use it, and not yet for a copy.
        tx.write(&[5, 6]).unwrap();
        drop(tx);
        let end = crate::ring::link::RecvEnd::Shm(rx);
        assert!(end.gone(4));
        assert!(!end.gone(1));
    }

    #[test]
    fn closing_is_seen_by_the_other_side() {
        let (tx, rx) = pair(MIN_CAPACITY);
        assert!(!rx.peer_closed());
        drop(tx);
        assert!(rx.peer_closed());
        assert!(!rx.arm(1), "a closed ring must not put the reader to sleep");
    }

    #[test]
    fn a_segment_that_is_not_a_ring_is_refused() {
        let fd = memfd_create(
            "not-a-ring",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .unwrap();
        ftruncate(&fd, (CONTROL_BYTES + MIN_CAPACITY) as u64).unwrap();
        let err = Ring::open(&fd).unwrap_err();
        assert!(err.contains("not sealed"), "{err}");
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        let err = Ring::open(&fd).unwrap_err();
        assert!(err.contains("magic 0x0"), "{err}");
        // Sealed, and the size read only then: too small for a ring.
        let small = memfd_create("small", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        ftruncate(&small, 100).unwrap();
        assert!(Ring::open(&small).unwrap_err().contains("not sealed"));
        fcntl_add_seals(&small, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        assert!(Ring::open(&small).unwrap_err().contains("not a ring"));
    }

    /// A peer that writes an impossible index into the shared control block gets an error
    /// from the next operation, never an access outside the ring.
    #[test]
    fn corrupt_indices_in_the_segment_are_errors() {
        let (mut tx, mut rx) = pair(MIN_CAPACITY);
        tx.write(&[7u8; 100]).unwrap();
        // The "sender" claims a head far beyond the ring.
        tx.ring.control().head.store(1 << 30, Ordering::Release);
        let mut sink = vec![0u8; 2 * MIN_CAPACITY];
        assert!(matches!(
            rx.read(&mut sink),
            Err(RingFault::Head {
                head: 0x4000_0000,
                tail: 0,
                ..
            })
        ));
        assert!(matches!(
            rx.reduce_into(&mut sink, DType::F32, ReduceOp::Sum),
            Err(RingFault::Head { .. })
        ));
        assert!(!rx.arm(1), "a broken ring must not put the reader to sleep");
        // The "receiver" moves its tail past the head: the sender must not see free room.
        tx.ring
            .control()
            .tail
            .store(u32::MAX - 5, Ordering::Release);
        assert_eq!(
            tx.write(&[1u8; 10]),
            Err(RingFault::Tail {
                tail: u32::MAX - 5,
                head: 100,
                seen: 0,
                capacity: MIN_CAPACITY
            })
        );
        assert!(!tx.arm(), "a broken ring must not put the writer to sleep");
    }

    #[test]
    fn a_segment_with_moved_indices_is_refused() {
        let (fd, pending) = PendingRing::create(MIN_CAPACITY).unwrap();
        pending.ring.control().head.store(13, Ordering::Release);
        let err = Ring::open(&fd).unwrap_err();
        assert!(err.contains("not fresh: head 13, tail 0"), "{err}");
    }

    #[test]
    fn segments_are_reserved_before_use() {
        let len = CONTROL_BYTES + MIN_CAPACITY;
        let fd = memfd_create("reserve", MemfdFlags::CLOEXEC).unwrap();
        ftruncate(&fd, len as u64).unwrap();
        // st_blocks counts 512-byte units: nothing is allocated by sizing alone.
        assert_eq!(fstat(&fd).unwrap().st_blocks, 0);
        reserve(&fd, len).unwrap();
        assert!(fstat(&fd).unwrap().st_blocks as usize * 512 >= len);
    }

    #[test]
    fn descriptors_travel_with_the_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let bell = Bell::new().unwrap();
        send_with_fds(&a, b"hello", &[bell.fd()]).unwrap();
        let mut buf = [0u8; 16];
        let (n, fds) = recv_with_fds(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 1);
        // The received descriptor is the same eventfd: writing to it wakes the original.
        ring_bell(&fds[0]);
        let mut count = [0u8; 8];
        assert_eq!(rustix::io::read(bell.fd(), &mut count).unwrap(), 8);
    }
}
