//! The collectives a communicator has queued on its side stream and not yet seen complete,
//! and whether the communicator was aborted: the state every wait consults before it touches
//! NCCL.
//!
//! Each entry holds the marker recorded after the collective (a CUDA event) and what must
//! outlive the device work (the tensors NCCL reads and writes). A [`Work`](crate::Work)
//! names its entry by id only, so dropping it changes nothing here: the tensors stay owned
//! until the marker has been seen complete, and only then go back to the caching allocator.
//! All entries are on one stream, so they complete in the order they were queued: seeing one
//! complete retires it and every entry before it.
//!
//! Retiring releases nothing: a retired entry (its marker and what it kept) moves to a shelf
//! that [`InFlight::take_released`] empties, so that its owner drops them after letting go of
//! the communicator's lock, on a thread of the program. Freeing a tensor takes the caching
//! allocator's mutex, which a thread in `cudaFree` (a device-wide synchronisation) holds for
//! as long as a hung collective's kernel spins; dropping it under the communicator's lock,
//! or on the watchdog's thread, would then stop the watchdog for good, and with it the abort
//! that ends that kernel (c10d moved its unstashing off the watchdog for this reason).
//!
//! After an abort, no entry is ever reported complete (its marker may well complete: the
//! aborted kernels exit early, leaving half-reduced tensors), and nothing asks NCCL about
//! the communicator again. Whether it was aborted is an [`Aborted`] flag that the group
//! reads without the communicator's lock: `ncclCommAbort` may block its caller, holding that
//! lock, until the queued kernels have exited, and the flag is set before it is called.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use nccl_sys::{cudaError_t, cudaEvent_t, Cudart};

use crate::error::CommError;

/// A point recorded on a stream.
pub(crate) trait Marker {
    /// Whether the stream has passed the point; `Err` carries the CUDA runtime's message.
    fn reached(&self) -> Result<bool, String>;
}

/// A CUDA event recorded on a stream (timing disabled), destroyed on drop.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) raw: cudaEvent_t,
    pub(crate) cudart: &'static Cudart,
}

// SAFETY: a CUDA event may be queried, waited on and destroyed from any thread.
unsafe impl Send for Event {}

impl Marker for Event {
    fn reached(&self) -> Result<bool, String> {
        query_cuda(
            // SAFETY: `raw` is a live event owned by this value.
            || unsafe { (self.cudart.cudaEventQuery)(self.raw) },
            // SAFETY: plain CUDA runtime call on the calling thread's own error slot.
            || unsafe { (self.cudart.cudaGetLastError)() },
        )
        .map_err(crate::nccl::cuda::cuda_error_string)
    }
}

/// Runs a CUDA query (`cudaEventQuery`, `cudaStreamQuery`): `Ok(true)` when the work is
/// done, `Ok(false)` while it runs, else the error. A "not ready" answer is also left in the
/// calling thread's last-error slot, which libtorch shares (the same libcudart) and checks
/// after every kernel launch (`C10_CUDA_KERNEL_LAUNCH_CHECK`): left there, the next kernel
/// this thread launches, e.g. autograd's after a DDP hook, fails with "device not ready".
/// So `clear` (`cudaGetLastError`) resets it then, as PyTorch's `queryEvent` does.
pub(crate) fn query_cuda(
    query: impl FnOnce() -> cudaError_t,
    clear: impl FnOnce() -> cudaError_t,
) -> Result<bool, cudaError_t> {
    match query() {
        cudaError_t::cudaSuccess => Ok(true),
        cudaError_t::cudaErrorNotReady => {
            let _ = clear();
            Ok(false)
        }
        rc => Err(rc),
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is ours; CUDA defers its release until it has completed.
        unsafe { (self.cudart.cudaEventDestroy)(self.raw) };
    }
}

/// Whether a communicator was aborted, and why (the first reason): shared between the
/// communicator, which sets it, and the group, which reads it without taking the
/// communicator's lock.
#[derive(Debug, Default)]
pub(crate) struct Aborted(OnceLock<String>);

impl Aborted {
    /// Marks the communicator aborted because of `why`, then runs `abort` (the call that
    /// frees it), the first time only. The mark comes first: a call that frees the
    /// communicator may block for as long as its queued kernels run, and whoever reads the
    /// flag meanwhile already has the answer.
    pub(crate) fn abort_with(&self, why: String, abort: impl FnOnce()) {
        if self.0.set(why).is_ok() {
            abort();
        }
    }

    /// Whether the communicator was aborted (or is being aborted).
    pub(crate) fn is_set(&self) -> bool {
        self.0.get().is_some()
    }

    /// The error every call gets once the communicator was aborted, naming `op`.
    pub(crate) fn error(&self, op: &str) -> Option<CommError> {
        self.0.get().map(|why| {
            CommError::Poisoned(format!(
                "{op}: the NCCL communicator was aborted ({why}); the results of its \
                 unfinished collectives are invalid; create a new process group"
            ))
        })
    }
}

/// Where an entry stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    /// Still queued or running on the device.
    Pending,
    /// Completed (retired, its tensors released).
    Done,
}

struct Entry<M, K> {
    id: u64,
    marker: M,
    keep: K,
    start: Instant,
    op: &'static str,
}

/// The in-flight collectives of one communicator (see the module documentation).
pub(crate) struct InFlight<M, K> {
    next: u64,
    entries: VecDeque<Entry<M, K>>,
    /// The markers and kept values of retired entries, not yet handed out.
    released: Vec<(M, K)>,
    aborted: Arc<Aborted>,
}

impl<M, K> std::fmt::Debug for InFlight<M, K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight")
            .field("pending", &self.entries.len())
            .field("released", &self.released.len())
            .field("aborted", &self.aborted)
            .finish()
    }
}

impl<M: Marker, K> InFlight<M, K> {
    pub(crate) fn new() -> Self {
        InFlight {
            next: 0,
            entries: VecDeque::new(),
            released: Vec::new(),
            aborted: Arc::default(),
        }
    }

    /// The error every call gets once the communicator was aborted, naming `op`.
    pub(crate) fn aborted_error(&self, op: &str) -> Option<CommError> {
        self.aborted.error(op)
    }

    /// Whether the communicator was aborted.
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.is_set()
    }

    /// The abort flag, for readers that do not hold the communicator.
    pub(crate) fn aborted(&self) -> &Arc<Aborted> {
        &self.aborted
    }

    /// Adds a collective queued at `start`, whose end is `marker`, keeping `keep` until it
    /// completes; returns its id.
    pub(crate) fn push(&mut self, op: &'static str, start: Instant, marker: M, keep: K) -> u64 {
        let id = self.next;
        self.next += 1;
        self.entries.push_back(Entry {
            id,
            marker,
            keep,
            start,
            op,
        });
        id
    }

    /// Where collective `id` stands. An error once the communicator was aborted (whatever
    /// the marker says), or when the marker cannot be queried.
    pub(crate) fn status(&mut self, id: u64, op: &str) -> Result<Status, CommError> {
        if let Some(e) = self.aborted_error(op) {
            return Err(e);
        }
        let Some(pos) = self.entries.iter().position(|e| e.id == id) else {
            return Ok(if id < self.next {
                Status::Done
            } else {
                Status::Pending
            });
        };
        let reached = self.entries[pos]
            .marker
            .reached()
            .map_err(|detail| CommError::Nccl {
                call: "cudaEventQuery",
                detail,
            })?;
        if !reached {
            return Ok(Status::Pending);
        }
        // One stream: everything queued before it has completed too.
        let done = self.entries.drain(..=pos).map(|e| (e.marker, e.keep));
        self.released.extend(done);
        Ok(Status::Done)
    }

    /// The marker of collective `id`, while it is pending and the communicator usable.
    pub(crate) fn marker(&self, id: u64) -> Option<&M> {
        if self.is_aborted() {
            return None;
        }
        self.entries.iter().find(|e| e.id == id).map(|e| &e.marker)
    }

    /// Retires the collectives seen complete, oldest first, stopping at the first pending
    /// one; what they kept goes to the shelf ([`Self::take_released`]), not back to the
    /// allocator. Safe after an abort: it only asks the markers (CUDA), never NCCL.
    pub(crate) fn retire_completed(&mut self) {
        while let Some(front) = self.entries.front() {
            if front.marker.reached() != Ok(true) {
                break;
            }
            if let Some(e) = self.entries.pop_front() {
                self.released.push((e.marker, e.keep));
            }
        }
    }

    /// Hands out the markers and kept values of the collectives retired since the last
    /// call, for the caller to drop once it holds no lock (see the module documentation).
    pub(crate) fn take_released(&mut self) -> Vec<(M, K)> {
        std::mem::take(&mut self.released)
    }

    /// The oldest pending collective (its op) if it has been pending longer than `timeout`.
    pub(crate) fn overdue(&self, timeout: Duration) -> Option<&'static str> {
        self.entries
            .front()
            .filter(|e| e.start.elapsed() > timeout)
            .map(|e| e.op)
    }

    /// How many collectives are pending (after the last retirement).
    pub(crate) fn pending(&self) -> usize {
        self.entries.len()
    }

    /// Takes what the pending collectives keep, retiring them: for a communicator that goes
    /// away with work the device may still run.
    pub(crate) fn take_pending(&mut self) -> Vec<K> {
        self.entries.drain(..).map(|e| e.keep).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// A marker the test completes by hand.
    #[derive(Clone, Default)]
    struct Flag(Arc<AtomicBool>);

    impl Flag {
        fn set(&self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    impl Marker for Flag {
        fn reached(&self) -> Result<bool, String> {
            Ok(self.0.load(Ordering::SeqCst))
        }
    }

    type Table = InFlight<Flag, Arc<Vec<f32>>>;

    #[test]
    fn a_dropped_handle_leaves_the_tensor_owned_until_the_device_is_done() {
        let mut table = Table::new();
        let done = Flag::default();
        let tensor = Arc::new(vec![1.0f32; 4]);
        let id = table.push("all_reduce", Instant::now(), done.clone(), tensor.clone());
        // The caller drops its tensor and its work handle (the id): the table still owns
        // the tensor.
        let watch = Arc::downgrade(&tensor);
        drop(tensor);
        let _ = id;
        assert_eq!(watch.strong_count(), 1);
        table.retire_completed();
        assert_eq!(
            watch.strong_count(),
            1,
            "released before the device finished"
        );
        assert_eq!(table.status(id, "all_reduce").unwrap(), Status::Pending);
        done.set();
        table.retire_completed();
        assert_eq!(table.status(id, "all_reduce").unwrap(), Status::Done);
        assert_eq!(table.pending(), 0);
        drop(table.take_released());
        assert_eq!(watch.strong_count(), 0, "kept after the device finished");
    }

    /// Retiring, by `retire_completed` (the watchdog's look, every call's entry) or by
    /// `status` (a wait), drops nothing: freeing a tensor may block on the caching
    /// allocator's mutex, so what retired collectives kept waits on the shelf until the
    /// owner takes it, to drop it without the communicator's lock.
    #[test]
    fn retiring_releases_nothing_until_the_owner_takes_it() {
        let mut table = Table::new();
        let flags: Vec<Flag> = (0..3).map(|_| Flag::default()).collect();
        let tensors: Vec<Arc<Vec<f32>>> = (0..3).map(|i| Arc::new(vec![i as f32])).collect();
        for (f, t) in flags.iter().zip(&tensors) {
            table.push("all_reduce", Instant::now(), f.clone(), t.clone());
        }
        let watches: Vec<_> = tensors.iter().map(Arc::downgrade).collect();
        drop(tensors);
        let alive = || watches.iter().map(|w| w.strong_count()).collect::<Vec<_>>();
        flags[0].set();
        table.retire_completed();
        assert_eq!(table.pending(), 2);
        assert_eq!(alive(), [1, 1, 1], "retire_completed released a tensor");
        flags[1].set();
        assert_eq!(table.status(1, "all_reduce").unwrap(), Status::Done);
        assert_eq!(alive(), [1, 1, 1], "status released a tensor");
        let released = table.take_released();
        assert_eq!(released.len(), 2);
        assert_eq!(alive(), [1, 1, 1]);
        drop(released);
        assert_eq!(alive(), [0, 0, 1], "the owner's drop released them");
        assert!(table.take_released().is_empty(), "handed out twice");
    }

    #[test]
    fn completion_is_reported_only_when_the_marker_is_reached_and_retires_in_order() {
        let mut table = Table::new();
        let flags: Vec<Flag> = (0..3).map(|_| Flag::default()).collect();
        let ids: Vec<u64> = flags
            .iter()
            .map(|f| table.push("all_reduce", Instant::now(), f.clone(), Arc::new(vec![])))
            .collect();
        assert_eq!(ids, [0, 1, 2]);
        for &id in &ids {
            assert_eq!(table.status(id, "x").unwrap(), Status::Pending);
        }
        // The stream passed the second collective: the first is done too.
        flags[0].set();
        flags[1].set();
        assert_eq!(table.status(1, "x").unwrap(), Status::Done);
        assert_eq!(table.pending(), 1);
        assert_eq!(table.status(0, "x").unwrap(), Status::Done);
        assert_eq!(table.status(2, "x").unwrap(), Status::Pending);
        // An id never issued is not done.
        assert_eq!(table.status(7, "x").unwrap(), Status::Pending);
    }

    #[test]
    fn after_an_abort_every_wait_fails_even_when_the_marker_completes() {
        let mut table = Table::new();
        let first = Flag::default();
        let second = Flag::default();
        let a = table.push(
            "all_reduce",
            Instant::now(),
            first.clone(),
            Arc::new(vec![]),
        );
        let b = table.push(
            "all_reduce",
            Instant::now(),
            second.clone(),
            Arc::new(vec![]),
        );
        table
            .aborted()
            .abort_with("all_reduce timed out after 1s".into(), || {});
        // The aborted kernels exit: both markers complete, on half-reduced tensors.
        first.set();
        second.set();
        for id in [a, b] {
            match table.status(id, "all_reduce") {
                Err(CommError::Poisoned(why)) => {
                    assert!(
                        why.contains("aborted (all_reduce timed out after 1s)"),
                        "{why}"
                    )
                }
                other => panic!("expected Poisoned, got {other:?}"),
            }
        }
        assert!(
            table.marker(b).is_none(),
            "no stream may wait on aborted work"
        );
        // A later abort keeps the first reason.
        table.aborted().abort_with("other".into(), || {});
        assert!(format!("{:?}", table.aborted_error("x")).contains("timed out"));
        // The tensors are released once the markers say the device is done.
        table.retire_completed();
        assert_eq!(table.pending(), 0);
    }

    #[test]
    fn the_flag_is_set_before_the_abort_runs_and_the_abort_runs_once() {
        let flag = Aborted::default();
        assert!(!flag.is_set() && flag.error("x").is_none());
        let mut calls = 0;
        flag.abort_with("all_reduce timed out after 1s".into(), || {
            // A reader that does not hold the communicator already sees the abort while
            // `ncclCommAbort` blocks.
            assert!(flag.is_set(), "the flag was not set before the abort call");
            assert!(matches!(flag.error("wait"), Some(CommError::Poisoned(_))));
            calls += 1;
        });
        flag.abort_with("later".into(), || calls += 1);
        assert_eq!(calls, 1, "the communicator was aborted twice");
        let why = flag.error("wait").unwrap().to_string();
        assert!(
            why.contains("wait: the NCCL communicator was aborted (all_reduce timed out"),
            "{why}"
        );
    }

    /// A "not ready" answer is cleared from CUDA's last-error slot at once (libtorch's next
    /// kernel launch would fail on it); a done or failed query leaves the slot alone.
    #[test]
    fn a_not_ready_query_clears_cudas_last_error_and_nothing_else_does() {
        let answers = [
            (cudaError_t::cudaSuccess, Ok(true), vec!["query"]),
            (
                cudaError_t::cudaErrorNotReady,
                Ok(false),
                vec!["query", "clear"],
            ),
            (
                cudaError_t::cudaErrorInvalidDevice,
                Err(cudaError_t::cudaErrorInvalidDevice),
                vec!["query"],
            ),
        ];
        for (rc, want, calls) in answers {
            let log = std::cell::RefCell::new(Vec::new());
            let got = query_cuda(
                || {
                    log.borrow_mut().push("query");
                    rc
                },
                || {
                    log.borrow_mut().push("clear");
                    cudaError_t::cudaErrorNotReady
                },
            );
            assert_eq!(got, want, "{rc:?}");
            assert_eq!(log.into_inner(), calls, "{rc:?}");
        }
    }

    #[test]
    fn the_oldest_pending_collective_is_overdue_after_the_timeout() {
        let mut table = Table::new();
        let old = Instant::now() - Duration::from_secs(5);
        table.push("broadcast", old, Flag::default(), Arc::new(vec![]));
        table.push(
            "all_reduce",
            Instant::now(),
            Flag::default(),
            Arc::new(vec![]),
        );
        assert_eq!(table.overdue(Duration::from_secs(10)), None);
        assert_eq!(table.overdue(Duration::from_secs(1)), Some("broadcast"));
        let kept = table.take_pending();
        assert_eq!(kept.len(), 2);
        assert_eq!(table.pending(), 0);
    }
}
