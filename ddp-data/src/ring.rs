//! The ring of batch slots: the memory the loader's workers write samples into and the
//! bookkeeping they, the consumer and the batches' leases share under one lock (which batch
//! each slot holds, the free slots, the window of positions the workers may claim).
//!
//! **Lock discipline.** The lock guards bookkeeping only. A slot's reuse hook (for CUDA
//! slots: the wait for the copy out of it) and the allocation of a new slot run with the lock
//! released, so a worker waiting for the GPU, or for a slot to be page-locked, never keeps
//! another worker from taking a different slot, finishing a sample, or the consumer from
//! taking a finished batch.
//!
//! **Free list.** First in, first out: a worker takes the slot given back longest ago, whose
//! copy was queued earliest and has most likely completed, not the one just given back
//! behind the step the GPU is running now. And a slot with a pending hook is reused only once
//! the ring has `Ring::warm_slots` slots (window + 2): a new slot is allocated instead
//! until then. A CUDA loader gives every slot back the moment its copy is queued, so without
//! that floor the ring would stay at the window's size and the only free one would always be
//! the one whose copy waits behind the running step: each new batch would wait for the GPU.
//! With it, the oldest free slot's copy was queued before the previous step, which the
//! consumer has waited for (its loss) before taking the current batch. When such an
//! allocation fails (page-locking refused, say), the hooked slot is taken after all and the
//! ring grows no further that way: a wait in a hook costs time, a failed epoch costs the run.

use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::{panic_message, DataError};
use crate::memory::{BatchMemory, SlotAllocator, SlotRequest};

/// Runs once a slot's memory may be written again (for example: waits for an asynchronous
/// copy out of it to finish). Called, without the ring's lock, by the worker that takes the
/// slot for a new batch, or by whoever drops the ring before the memory is freed.
pub type ReuseHook = Box<dyn FnOnce() -> Result<(), DataError> + Send>;

/// One slot of the ring.
pub(crate) struct Slot {
    pub(crate) memory: Arc<dyn BatchMemory>,
    /// The batch it holds (while filling or leased).
    pub(crate) batch: usize,
    /// Samples of that batch not finished yet.
    pub(crate) remaining: usize,
    /// The error of the lowest failed position in the batch.
    pub(crate) error: Option<(usize, DataError)>,
    pub(crate) before_reuse: Option<ReuseHook>,
    /// A hook of this slot failed: whether something still reads its memory is unknown, so
    /// the slot is never reused and its memory never freed.
    pub(crate) poisoned: bool,
}

impl Slot {
    fn new(memory: Arc<dyn BatchMemory>) -> Self {
        Self {
            memory,
            batch: 0,
            remaining: 0,
            error: None,
            before_reuse: None,
            poisoned: false,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // Freeing is a reuse too: wait for the memory's last reader first (for CUDA slots,
        // the copy out of it; page-locked memory is unregistered and freed right after).
        if let Some(hook) = self.before_reuse.take() {
            if run_hook(hook).is_err() {
                self.poisoned = true;
            }
        }
        if self.poisoned {
            // A copy may still read this memory: leak it rather than free it under the copy.
            std::mem::forget(Arc::clone(&self.memory));
        }
    }
}

/// Where the workers, the consumer and the leases stand; under [`Ring::lock`].
pub(crate) struct State {
    /// Next position (into the index list) to hand to a worker.
    pub(crate) next: usize,
    /// Positions below this may be claimed.
    pub(crate) limit: usize,
    pub(crate) stop: bool,
    /// Batches handed to the consumer so far.
    pub(crate) handed: usize,
    pub(crate) slots: Vec<Slot>,
    /// Slots no batch holds, oldest first.
    pub(crate) free: VecDeque<usize>,
    /// Slots being made ready (a hook or an allocation running without the lock); each comes
    /// to the front of `free` when done.
    pub(crate) preparing: usize,
    /// Of those, allocations.
    pub(crate) allocating: usize,
    /// An allocation made to spare a wait in a free slot's hook failed: the ring reuses
    /// hooked slots from then on, whatever its size.
    pub(crate) growth_failed: bool,
    /// Batch number -> slot, for batches being filled or finished but not handed out.
    pub(crate) filling: HashMap<usize, usize>,
    /// An error that ends the epoch wherever it happens (a slot that cannot be allocated or
    /// made reusable, a worker that died), with the first batch it keeps from finishing: the
    /// batches before that one still come out first ([`Ring::fail`]).
    pub(crate) fatal: Option<(usize, DataError)>,
    pub(crate) live_workers: usize,
}

impl State {
    /// Whether workers must leave batch `batch` alone: the consumer stopped, or a loader-wide
    /// error stopped that batch or an earlier one (the batches before it still finish, and
    /// come out first).
    pub(crate) fn stops(&self, batch: usize) -> bool {
        self.stop || self.fatal.as_ref().is_some_and(|&(from, _)| from <= batch)
    }

    /// The first batch of which nothing is claimed yet, of batches of `batch_size`: the one
    /// a failure that concerns no sample in hand stops (those claimed still finish).
    pub(crate) fn first_unclaimed_batch(&self, batch_size: usize) -> usize {
        self.next.div_ceil(batch_size)
    }

    /// The state before the first claim: positions below `limit` may be claimed.
    pub(crate) fn new(limit: usize, workers: usize) -> Self {
        Self {
            next: 0,
            limit,
            stop: false,
            handed: 0,
            slots: Vec::new(),
            free: VecDeque::new(),
            preparing: 0,
            allocating: 0,
            growth_failed: false,
            filling: HashMap::new(),
            fatal: None,
            live_workers: workers,
        }
    }
}

/// The part of a loader a [`HostBatch`](crate::host_batch::HostBatch) keeps alive: slot memory
/// and its bookkeeping.
pub(crate) struct Ring {
    pub(crate) state: Mutex<State>,
    /// Workers wait here for the window to open or a slot to become ready.
    pub(crate) work: Condvar,
    /// The consumer waits here for a batch to finish.
    pub(crate) ready: Condvar,
    pub(crate) indices: Arc<[usize]>,
    pub(crate) request: SlotRequest,
    /// Slots the ring allocates before it reuses a slot whose hook has not run yet.
    pub(crate) warm_slots: usize,
}

impl Ring {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a thread panicked while holding it; every field stays
        // meaningful (no invariant spans an unlock inside a panic-prone section).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.work.wait(state).unwrap_or_else(|e| e.into_inner())
    }

    /// Stops the loader with `error`, a failure from batch `batch` on: the workers finish the
    /// batches before it and claim nothing of it or later ([`State::stops`]), and the consumer
    /// gets the error once that batch (or a later one) is due, or the batch it waits for can
    /// no longer finish. Of several, the earliest batch's is kept.
    pub(crate) fn fail(&self, state: &mut State, batch: usize, error: DataError) {
        if state.fatal.as_ref().is_none_or(|&(from, _)| batch < from) {
            state.fatal = Some((batch, error));
        }
        self.work.notify_all();
        self.ready.notify_all();
    }

    /// Returns `slot` to the back of the free list, with `hook` to run before it is written
    /// again.
    pub(crate) fn give_back(&self, slot: usize, hook: Option<ReuseHook>) {
        let mut state = self.lock();
        state.slots[slot].before_reuse = hook;
        state.free.push_back(slot);
        drop(state);
        self.work.notify_all();
    }

    /// The slot batch `batch` (of `len` samples) is written into: the one it already has, or
    /// else the oldest free slot (unless its hook has yet to run, the ring is below
    /// `warm_slots` and no allocation in its place has failed), or else a new one from
    /// `allocator` (the hooked free slot after all if that fails). A free slot's hook, and an
    /// allocation, run with the lock released (the returned guard is a fresh one); while
    /// another worker does either and no slot is free, this one waits for it. `Ok(None)`
    /// when the loader stops meanwhile; an error leaves the slot it concerns out of the ring.
    pub(crate) fn slot_for<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
        batch: usize,
        len: usize,
        allocator: &dyn SlotAllocator,
    ) -> (MutexGuard<'a, State>, Result<Option<usize>, DataError>) {
        loop {
            if state.stops(batch) {
                return (state, Ok(None));
            }
            if let Some(&s) = state.filling.get(&batch) {
                return (state, Ok(Some(s)));
            }
            let front = state.free.front().copied();
            let cold =
                !state.growth_failed && state.slots.len() + state.allocating < self.warm_slots;
            // Below the warm size, a new slot rather than a wait in a hook.
            let taken = front.filter(|&s| !(cold && state.slots[s].before_reuse.is_some()));
            let Some(s) = taken else {
                if front.is_none() && !cold && state.preparing > 0 {
                    state = self.wait(state);
                    continue;
                }
                // A free slot was passed over (its hook pending) for this allocation.
                let optional = front.is_some();
                state.preparing += 1;
                state.allocating += 1;
                drop(state);
                let made = allocate(allocator, &self.request);
                state = self.lock();
                state.preparing -= 1;
                state.allocating -= 1;
                self.work.notify_all();
                match made {
                    Ok(memory) => {
                        state.slots.push(Slot::new(Arc::from(memory)));
                        let s = state.slots.len() - 1;
                        state.free.push_front(s);
                    }
                    // The new slot was only to spare a wait in the free slot's hook: waiting
                    // there is slower but correct, so the epoch goes on in the slots the ring
                    // has (page-locking may fail for good, e.g. at the locked-memory limit),
                    // and the ring stops growing rather than fail the same way each batch.
                    Err(_) if optional => state.growth_failed = true,
                    Err(e) => return (state, Err(e)),
                }
                continue;
            };
            state.free.pop_front();
            if state.slots[s].before_reuse.is_none() && state.slots[s].memory.shared_elsewhere() {
                // Tensors made from the slot's last batch outlive it (inputs an autograd
                // graph saved, say): writing there would change them. The slot gets new
                // memory; the old stays with those tensors until they go.
                state.preparing += 1;
                drop(state);
                let made = allocate(allocator, &self.request);
                state = self.lock();
                state.preparing -= 1;
                self.work.notify_all();
                match made {
                    Ok(memory) => {
                        state.slots[s].memory = Arc::from(memory);
                        state.free.push_front(s);
                    }
                    // Left out of the free list, the old memory is never written again.
                    Err(e) => return (state, Err(e)),
                }
                continue;
            }
            let Some(hook) = state.slots[s].before_reuse.take() else {
                let slot = &mut state.slots[s];
                slot.batch = batch;
                slot.remaining = len;
                slot.error = None;
                state.filling.insert(batch, s);
                return (state, Ok(Some(s)));
            };
            // Out of the free list and of `filling`, the slot is this worker's alone until it
            // goes back to the front of the free list, ready.
            state.preparing += 1;
            drop(state);
            let ran = run_hook(hook);
            state = self.lock();
            state.preparing -= 1;
            self.work.notify_all();
            match ran {
                Ok(()) => state.free.push_front(s),
                Err(e) => {
                    state.slots[s].poisoned = true;
                    return (state, Err(e));
                }
            }
        }
    }
}

/// A new slot's memory from `allocator`, refused if a region is smaller than `request`'s
/// (the workers write a whole batch into it); a panic in it is its error.
fn allocate(
    allocator: &dyn SlotAllocator,
    request: &SlotRequest,
) -> Result<Box<dyn BatchMemory>, DataError> {
    let memory =
        catch_unwind(AssertUnwindSafe(|| allocator.allocate(request))).unwrap_or_else(|panic| {
            Err(DataError::SlotPanicked {
                what: "slot allocator",
                message: panic_message(&*panic).to_string(),
            })
        })?;
    request.check_memory(&*memory)?;
    Ok(memory)
}

/// Runs a reuse hook; a panic in it is its error (the slot is then never reused nor freed,
/// as after any failed hook).
fn run_hook(hook: ReuseHook) -> Result<(), DataError> {
    catch_unwind(AssertUnwindSafe(hook)).unwrap_or_else(|panic| {
        Err(DataError::SlotPanicked {
            what: "slot reuse hook",
            message: panic_message(&*panic).to_string(),
        })
    })
}
