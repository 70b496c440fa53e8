//! The process group's NCCL side: the communicator made at the first CUDA collective, its
//! asynchronous collectives' [`Work`], and the watchdog that checks them. Once the
//! communicator was aborted, every call and every `Work` answers from its abort flag
//! without waiting for the communicator's lock (see `nccl::inflight::Aborted`). What
//! completed collectives kept goes back to the allocator after a call has let go of that
//! lock ([`CommGuard`]), never on the watchdog's thread.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tch::Tensor;

use super::rendezvous;
use super::tensor::cuda_buffer;
use super::work::{DeviceWork, Work};
use super::ProcessGroup;
use crate::config::options::Backend;
use crate::error::CommError;
use crate::nccl::{self, NcclComm, NcclOp, NcclWork};
use crate::sync::lock;

impl ProcessGroup {
    /// Fails with the abort's error once the communicator was aborted (or is being aborted:
    /// the flag is set before `ncclCommAbort`, which may hold the communicator's lock for as
    /// long as the queued kernels run). Never takes that lock.
    pub(super) fn nccl_usable(&self, op: &str) -> Result<(), CommError> {
        match self.nccl_aborted.get().and_then(|a| a.error(op)) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Fails once the group failed on either backend (one failure domain): the
    /// communicator's abort error, or the CPU ring's failure, naming `op`. Never takes a
    /// lock. New CUDA collectives and `barrier` check it; a wait on a collective already
    /// queued checks the abort only, as NCCL still completes or aborts that collective.
    ///
    /// A collective waited for on a stream ([`Work::wait_stream`]) reports nothing to the
    /// host: once the host has waited for that stream past it (a read of a result), this
    /// says whether the result is valid. An aborted collective's kernel ends early, and
    /// what it wrote is half-reduced; the abort flag is set before the kernels are stopped.
    pub fn usable(&self, op: &str) -> Result<(), CommError> {
        self.nccl_usable(op)?;
        match self.ring_failed.get() {
            Some(why) => Err(CommError::Poisoned(format!(
                "{op}: the process group failed ({why}); create a new process group"
            ))),
            None => Ok(()),
        }
    }

    /// The communicator for `op`, created at first use: a CPU barrier (all ranks alive),
    /// unique id from rank 0 through the store, `cudaSetDevice` of the group's CUDA device, a
    /// non-blocking `ncclCommInitRankConfig` bounded by the init timeout (the longer of the
    /// op and rendezvous timeouts). Refused once the group failed ([`ProcessGroup::usable`]).
    pub(super) fn nccl(&self, op: &str) -> Result<CommGuard<'_>, CommError> {
        self.usable(op)?;
        let mut guard = CommGuard::new(lock(&self.nccl));
        if guard.is_some() {
            return Ok(guard);
        }
        if self.backend != Backend::Nccl {
            return Err(CommError::Tensor {
                backend: "cpu",
                detail: "CUDA tensors need the NCCL backend".into(),
            });
        }
        if let Some(why) = self.nccl_failed.get() {
            return Err(CommError::Poisoned(format!(
                "NCCL's initialisation failed: {why}"
            )));
        }
        match self.init_nccl() {
            Ok(comm) => {
                let _ = self.nccl_aborted.set(comm.aborted());
                *guard = Some(comm);
                Ok(guard)
            }
            Err(e) => {
                let _ = self.nccl_failed.set(crate::error::with_causes(&e));
                Err(e)
            }
        }
    }

    /// The communicator's initialisation (with the caller holding the slot it goes in):
    /// a barrier, rank 0's unique id through the store, `ncclCommInitRankConfig`. Refused
    /// first, on this rank alone, when `NCCL_COMM_BLOCKING` would make the init blocking.
    fn init_nccl(&self) -> Result<NcclComm, CommError> {
        nccl::refuse_blocking_init(|name| std::env::var(name).ok())?;
        // The barrier keeps its place among the CPU collectives queued before it (which
        // the communication thread may still be running), as every blocking one does.
        self.drain();
        lock(&self.cpu).barrier()?;
        let id = if self.world_size == 1 {
            nccl::unique_id()?
        } else {
            let mut store = lock(&self.store);
            let store = store
                .as_mut()
                .ok_or_else(|| CommError::InvalidArgument("no store".into()))?;
            if self.rank == 0 {
                let id = nccl::unique_id()?;
                store.set("nccl/uid", &id.internal)?;
                id
            } else {
                let deadline = std::time::Instant::now() + self.nccl_init_timeout;
                rendezvous::wait_keys(
                    store.as_mut(),
                    &["nccl/uid".to_string()],
                    deadline,
                    self.nccl_init_timeout,
                    |_| Some(0),
                )?;
                let bytes = store.get("nccl/uid")?.unwrap_or_default();
                let internal = bytes.try_into().map_err(|b: Vec<u8>| CommError::Store {
                    addr: store.addr().to_string(),
                    detail: format!("NCCL unique id has {} bytes, expected 128", b.len()),
                })?;
                nccl_sys::ncclUniqueId { internal }
            }
        };
        let comm = NcclComm::init(
            self.rank,
            self.world_size,
            self.cuda_device,
            id,
            self.nccl_init_timeout,
            self.op_timeout,
            self.heartbeat.clone(),
        )?;
        if self.rank == 0 {
            tracing::info!(
                "ddp-comm: NCCL {} initialised, {} ranks",
                nccl::version()?,
                self.world_size
            );
        }
        Ok(comm)
    }

    pub(super) fn cuda_async(self: &Arc<Self>, t: &Tensor, op: NcclOp) -> Work {
        self.heartbeat.enter();
        let queued = (|| {
            let buf = cuda_buffer(t, self.backend, self.cuda_device)?;
            let mut comm = self.nccl(op.name())?;
            let comm = comm
                .as_mut()
                .ok_or_else(|| CommError::Poisoned("no NCCL communicator".into()))?;
            // SAFETY: `cuda_buffer` checked the tensor; the communicator keeps a handle of it
            // until the collective has completed, and `Work` keeps the caller from reusing
            // it before then (the documented contract).
            unsafe { comm.enqueue(buf, op, vec![t.shallow_clone()]) }
        })();
        match queued {
            Ok(work) => {
                let comm = Arc::downgrade(&self.nccl);
                self.watchdog.call_once(|| start_watchdog(comm, self.rank));
                Work::device(CudaWork {
                    group: self.clone(),
                    work,
                })
            }
            Err(e) => Work::done(Err(e)),
        }
    }

    /// Runs `f` on the communicator (which exists once a CUDA collective was queued) for
    /// `op`; once the communicator was aborted, fails without waiting for its lock.
    pub(super) fn with_comm<R>(
        &self,
        op: &str,
        f: impl FnOnce(&mut NcclComm) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        self.nccl_usable(op)?;
        match CommGuard::new(lock(&self.nccl)).as_mut() {
            Some(c) => f(c),
            None => Err(CommError::Poisoned("no NCCL communicator".into())),
        }
    }
}

/// What a communicator hands out of the collectives it retired ([`NcclComm::take_released`]),
/// to be dropped without its lock.
pub(super) trait Shelf {
    /// The retired collectives' leftovers (events and tensors).
    type Released;
    /// Takes them out.
    fn take_released(&mut self) -> Self::Released;
}

impl Shelf for NcclComm {
    type Released = Vec<(nccl::inflight::Event, Vec<Tensor>)>;

    fn take_released(&mut self) -> Self::Released {
        NcclComm::take_released(self)
    }
}

/// The communicator's slot, locked by a call of the program. Dropping it lets go of the lock
/// first and then drops what the collectives retired meanwhile kept: freeing a tensor takes
/// the caching allocator's mutex, which a thread in `cudaFree` holds for as long as a hung
/// collective's kernel runs, and a call blocked there while holding the communicator would
/// keep the watchdog from the abort that ends that kernel (`nccl::inflight`). The watchdog
/// locks the slot without this guard and releases nothing: what it retires waits for the
/// next call.
pub(super) struct CommGuard<'a, C: Shelf = NcclComm> {
    /// The lock. Fields drop in declaration order: this one first.
    slot: MutexGuard<'a, Option<C>>,
    /// Filled by `drop`, dropped after `slot`, so without the lock.
    released: Option<C::Released>,
}

impl<'a, C: Shelf> CommGuard<'a, C> {
    pub(super) fn new(slot: MutexGuard<'a, Option<C>>) -> Self {
        CommGuard {
            slot,
            released: None,
        }
    }
}

impl<C: Shelf> Deref for CommGuard<'_, C> {
    type Target = Option<C>;

    fn deref(&self) -> &Option<C> {
        &self.slot
    }
}

impl<C: Shelf> DerefMut for CommGuard<'_, C> {
    fn deref_mut(&mut self) -> &mut Option<C> {
        &mut self.slot
    }
}

impl<C: Shelf> Drop for CommGuard<'_, C> {
    fn drop(&mut self) {
        // Taken under the lock; dropped with the `released` field, after `slot` unlocks.
        self.released = self.slot.as_mut().map(Shelf::take_released);
    }
}

/// How often the watchdog looks at the communicator's pending collectives.
const WATCH_INTERVAL: Duration = Duration::from_millis(100);

/// Starts the watchdog of a communicator (c10d's NCCL watchdog): every [`WATCH_INTERVAL`],
/// unless a call into the group holds the communicator (that call checks it itself), it
/// retires completed collectives and aborts the communicator when one pending has exceeded
/// the timeout or NCCL reports an error, so that a collective only a stream waits for
/// ([`Work::wait_stream`]) cannot hang that stream forever. It frees no tensor (see
/// [`CommGuard`]): the next call into the group does. It ends with the group.
fn start_watchdog(comm: std::sync::Weak<Mutex<Option<NcclComm>>>, rank: usize) {
    let watch = move || {
        while let Some(shared) = comm.upgrade() {
            {
                let guard = match shared.try_lock() {
                    Ok(guard) => Some(guard),
                    Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                    Err(std::sync::TryLockError::WouldBlock) => None,
                };
                if let Some(mut guard) = guard {
                    if let Some(c) = guard.as_mut() {
                        c.watch();
                    }
                }
            }
            drop(shared);
            std::thread::sleep(WATCH_INTERVAL);
        }
    };
    let started = std::thread::Builder::new()
        .name(format!("ddp-comm-watch-{rank}"))
        .spawn(watch);
    if let Err(e) = started {
        tracing::warn!(
            "ddp-comm: rank {rank} runs without an NCCL watchdog ({e}): collectives that \
             only a stream waits for are checked at the group's next call"
        );
    }
}

/// The [`Work`] of a CUDA collective: its entry in the communicator's in-flight table.
struct CudaWork {
    group: Arc<ProcessGroup>,
    work: NcclWork,
}

impl DeviceWork for CudaWork {
    fn wait(self: Box<Self>) -> Result<(), CommError> {
        let CudaWork { group, work } = *self;
        group.with_comm(work.op(), |c| c.wait_work(work))
    }

    fn wait_stream(self: Box<Self>) -> Result<(), CommError> {
        let CudaWork { group, work } = *self;
        group.with_comm(work.op(), |c| c.wait_work_on_stream(work))
    }

    fn is_completed(&self) -> bool {
        // An aborted communicator's collectives are complete (with an error), even while
        // the thread that aborts it still holds it in `ncclCommAbort`.
        if self.group.nccl_usable(self.work.op()).is_err() {
            return true;
        }
        // Never blocks: while another thread's call holds the communicator (a blocking
        // collective may hold it up to the timeout), the answer is "not yet".
        let mut guard = CommGuard::new(match self.group.nccl.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        });
        guard.as_mut().is_none_or(|c| c.work_completed(&self.work))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::options::Options;
    use crate::element::ReduceOp;
    use crate::nccl::inflight::Aborted;

    /// A communicator whose retired leftovers, when dropped, note whether its lock was free.
    struct Fake {
        me: std::sync::Weak<Mutex<Option<Fake>>>,
        seen: Arc<Mutex<Vec<bool>>>,
    }

    struct Leftovers {
        me: std::sync::Weak<Mutex<Option<Fake>>>,
        seen: Arc<Mutex<Vec<bool>>>,
    }

    impl Drop for Leftovers {
        fn drop(&mut self) {
            let unlocked = self.me.upgrade().is_some_and(|m| m.try_lock().is_ok());
            self.seen.lock().unwrap().push(unlocked);
        }
    }

    impl Shelf for Fake {
        type Released = Leftovers;

        fn take_released(&mut self) -> Leftovers {
            Leftovers {
                me: self.me.clone(),
                seen: self.seen.clone(),
            }
        }
    }

    /// A call's guard hands back what the collectives retired meanwhile kept only after
    /// letting go of the communicator's lock: freeing a tensor may wait for the caching
    /// allocator's mutex, and the watchdog must be able to take the lock meanwhile.
    #[test]
    fn a_call_releases_retired_tensors_after_letting_go_of_the_lock() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let slot = Arc::new_cyclic(|me| {
            Mutex::new(Some(Fake {
                me: me.clone(),
                seen: seen.clone(),
            }))
        });
        {
            let mut guard = CommGuard::new(lock(&slot));
            assert!(guard.as_mut().is_some());
            assert!(seen.lock().unwrap().is_empty(), "released during the call");
        }
        assert_eq!(
            *seen.lock().unwrap(),
            [true],
            "released under the communicator's lock"
        );
        // No communicator (yet): nothing to release.
        let empty: Mutex<Option<Fake>> = Mutex::new(None);
        drop(CommGuard::new(lock(&empty)));
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    /// The watchdog aborts a communicator and sits in `ncclCommAbort` (blocked until the
    /// queued kernels exit, with more than one rank) holding the communicator's lock: a
    /// `Work` of that communicator is complete, and its wait fails, without that lock.
    #[test]
    fn work_is_answered_from_the_abort_flag_while_the_communicator_is_held() {
        let opts = Options::new(0, 1, "127.0.0.1", 0).backend(Backend::Cpu);
        let group = Arc::new(ProcessGroup::new(opts).unwrap());
        let flag = Arc::new(Aborted::default());
        group.nccl_aborted.set(flag.clone()).unwrap();
        let pending = || CudaWork {
            group: group.clone(),
            work: NcclWork::for_test(0, "all_reduce"),
        };
        // Held, not aborted: no answer yet, and none that blocks.
        let held = lock(&group.nccl);
        assert!(!pending().is_completed());
        flag.abort_with("all_reduce timed out after 1s".into(), || {
            assert!(pending().is_completed(), "not complete during the abort");
        });
        assert!(pending().is_completed(), "not complete after the abort");
        let (tx, rx) = std::sync::mpsc::channel();
        let work = pending();
        std::thread::spawn(move || {
            let waited = Box::new(work).wait();
            let _ = tx.send(waited);
        });
        // A hang guard only: the wait must not need the lock this thread holds.
        let waited = rx.recv_timeout(Duration::from_secs(30));
        drop(held);
        match waited {
            Ok(Err(CommError::Poisoned(why))) => {
                assert!(why.contains("all_reduce timed out after 1s"), "{why}")
            }
            other => panic!("the wait after the abort returned {other:?}"),
        }
        assert!(matches!(
            group.barrier(),
            Err(CommError::Poisoned(why)) if why.starts_with("barrier: ")
        ));
        // One failure domain: the CPU ring refuses too, with the abort's reason, and stays
        // failed with it.
        let mut cpu_tensor = Tensor::from_slice(&[1f32]);
        let calls = [
            (
                "all_reduce_slice",
                group.all_reduce_slice(&mut [1f32], ReduceOp::Sum),
            ),
            ("broadcast_slice", group.broadcast_slice(&mut [1f32], 0)),
            ("all_gather_bytes", group.all_gather_bytes(b"x").map(drop)),
            (
                "all_reduce",
                group.all_reduce(&mut cpu_tensor, ReduceOp::Sum),
            ),
        ];
        for (op, result) in calls {
            assert_poisoned(result, &format!("{op}: "), "all_reduce timed out after 1s");
        }
        let ring = group.ring_failed.get().map(String::as_str);
        assert!(
            ring.is_some_and(|why| why.contains("all_reduce timed out after 1s")),
            "{ring:?}"
        );
    }

    /// The other way round: once the CPU ring failed, CUDA collectives (here NCCL's
    /// initialisation at the first one) and `barrier` refuse with the ring's reason.
    #[test]
    fn a_failed_cpu_ring_refuses_cuda_collectives() {
        let opts = Options::new(0, 1, "127.0.0.1", 0).backend(Backend::Cpu);
        let mut group = ProcessGroup::new(opts).unwrap();
        group.backend = Backend::Nccl;
        lock(&group.cpu).fail("all_reduce: rank 1 hung up".into());
        for op in ["all_reduce", "barrier"] {
            let result = match op {
                "barrier" => group.barrier(),
                _ => group.nccl(op).map(drop),
            };
            let start = format!("{op}: the process group failed");
            assert_poisoned(result, &start, "rank 1 hung up");
        }
        assert!(group.nccl_failed.get().is_none(), "NCCL's init was tried");
    }

    /// `result` is `Poisoned`, its text starting with `start` and naming `reason`.
    fn assert_poisoned(result: Result<(), CommError>, start: &str, reason: &str) {
        match result {
            Err(CommError::Poisoned(why)) => {
                assert!(why.starts_with(start) && why.contains(reason), "{why}")
            }
            other => panic!("expected Poisoned({start}...), got {other:?}"),
        }
    }
}
