//! The ring of batch slots: the memory the loader's workers write samples into and the
//! bookkeeping they, the consumer and the batches' leases share under one lock (which batch
//! each slot holds, the free slots, the window of positions the workers may claim).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::DataError;
use crate::memory::{BatchMemory, SlotRequest};

/// Runs once a slot's memory may be written again (for example: waits for an asynchronous
/// copy out of it to finish). Called by the worker that takes the slot for a new batch.
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
    pub(crate) free: Vec<usize>,
    /// Batch number -> slot, for batches being filled or finished but not handed out.
    pub(crate) filling: HashMap<usize, usize>,
    /// An error that ends the epoch wherever it happens (a slot that cannot be allocated or
    /// made reusable).
    pub(crate) fatal: Option<DataError>,
    pub(crate) live_workers: usize,
}

/// The part of a loader a [`HostBatch`](crate::host_batch::HostBatch) keeps alive: slot memory
/// and its bookkeeping.
pub(crate) struct Ring {
    pub(crate) state: Mutex<State>,
    /// Workers wait here for the window to open.
    pub(crate) work: Condvar,
    /// The consumer waits here for a batch to finish.
    pub(crate) ready: Condvar,
    pub(crate) indices: Arc<[usize]>,
    pub(crate) request: SlotRequest,
}

impl Ring {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a thread panicked while holding it; every field stays
        // meaningful (no invariant spans an unlock inside a panic-prone section).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Returns `slot` to the free list, with `hook` to run before it is written again.
    pub(crate) fn give_back(&self, slot: usize, hook: Option<ReuseHook>) {
        let mut state = self.lock();
        state.slots[slot].before_reuse = hook;
        state.free.push(slot);
    }
}
