//! The parallel batch loader without tch: [`HostLoader`] and its [`LoaderConfig`].

use std::cell::Cell;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::dataset::Dataset;
use crate::error::{panic_message, DataError};
use crate::host_batch::HostBatch;
use crate::memory::{BatchMemory, HeapAllocator, SlotAllocator, SlotRequest};
use crate::ring::{Ring, State};
use crate::rng::SampleRng;
use crate::sample::{Input, SampleLayout, SampleOut, Storage, Targets, ValueKind};

/// How a loader batches and parallelises one epoch.
///
/// **Random draws** are keyed by `(seed, epoch, index)`, `index` being the index the loader
/// asks the data set for: an index that comes twice in one epoch (oversampling by repeating
/// indices, or the padding `DistributedSampler` adds to even out the ranks) gets the same
/// augmentation each time. To give each position its own draws, load a
/// [`Subset`](crate::Subset) of those indices instead: its samples are keyed by their
/// position in the subset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Samples per batch.
    pub batch_size: usize,
    /// Leave out the last batch when it would be smaller than `batch_size`.
    pub drop_last: bool,
    /// The run's seed; with `epoch` and the sample index it fixes every random draw.
    pub seed: u64,
    /// The epoch number. A loader built for each epoch must be given it (as the sampler's
    /// `set_epoch`), or every epoch repeats epoch 0's augmentation.
    pub epoch: u64,
    /// Worker threads (at least 1).
    pub workers: usize,
    /// How many batches the workers may run ahead of the consumer (at least 1). The loader's
    /// window is `max(prefetch, ceil(workers / batch_size))` batches, so that every worker
    /// has a sample to write even with small batches (as PyTorch's `prefetch_factor`, which
    /// counts per worker).
    pub prefetch: usize,
}

impl LoaderConfig {
    /// `batch_size` with no drop_last, seed 0, epoch 0, [`default_workers`]`(1)` and a
    /// prefetch of 2 batches. Set [`LoaderConfig::epoch`] for each epoch's loader.
    pub fn new(batch_size: usize) -> Self {
        Self {
            batch_size,
            drop_last: false,
            seed: 0,
            epoch: 0,
            workers: default_workers(1),
            prefetch: 2,
        }
    }
}

/// A sensible number of loader threads per rank: the cores this process may run on
/// (`std::thread::available_parallelism`: its affinity mask and a cgroup's CPU quota) shared
/// among the `ranks_on_machine` processes that each run a loader, at least 1.
pub fn default_workers(ranks_on_machine: usize) -> usize {
    cores_per_process(ranks_on_machine)
}

include!("../../shared-src/cores_per_process.rs");

struct Shared<D> {
    ring: Arc<Ring>,
    dataset: D,
    allocator: Arc<dyn SlotAllocator>,
    seed: u64,
    epoch: u64,
    batch_size: usize,
    total: usize,
    finished: AtomicUsize,
}

/// Claims the next position; `None` when the worker should exit.
fn claim<D>(shared: &Shared<D>) -> Option<(usize, Arc<dyn BatchMemory>)> {
    let ring = &shared.ring;
    let mut state = ring.lock();
    loop {
        if state.next >= shared.total || state.stops(state.next / shared.batch_size) {
            return None;
        }
        if state.next < state.limit {
            break;
        }
        state = ring.work.wait(state).unwrap_or_else(|e| e.into_inner());
    }
    let position = state.next;
    state.next += 1;
    let batch = position / shared.batch_size;
    let len = shared
        .batch_size
        .min(shared.total - batch * shared.batch_size);
    let (mut state, slot) = ring.slot_for(state, batch, len, &*shared.allocator);
    match slot {
        Ok(Some(s)) => Some((position, Arc::clone(&state.slots[s].memory))),
        Ok(None) => None,
        Err(e) => {
            ring.fail(&mut state, batch, e);
            None
        }
    }
}

fn worker_loop<D: Dataset>(shared: Arc<Shared<D>>, worker: usize) {
    let ring = Arc::clone(&shared.ring);
    // The sample in hand (its position and index), for a panic that escapes `work`'s own
    // catch (in a data set's `describe`, say).
    let current = Cell::new(None);
    let escaped = catch_unwind(AssertUnwindSafe(|| work(&shared, worker, &current)));
    let mut st = ring.lock();
    if let Err(panic) = escaped {
        // Its claimed sample will never be finished: stop the loader with the error, from
        // that sample's batch on, rather than leave the consumer waiting for it.
        let (sample, batch) = match current.get() {
            Some((position, index)) => (
                format!("sample index {index}"),
                position / shared.batch_size,
            ),
            None => (
                "no sample".to_string(),
                st.first_unclaimed_batch(shared.batch_size),
            ),
        };
        let sample = format!("{sample} ({})", panic_message(&*panic));
        ring.fail(&mut st, batch, DataError::WorkerPanicked { worker, sample });
    }
    st.live_workers -= 1;
    ring.ready.notify_all();
}

/// A worker's loop: claims positions and writes their samples until none is left or the
/// loader stops. Panics in the data set's `worker` and `write` are caught here.
fn work<D: Dataset>(shared: &Shared<D>, worker: usize, current: &Cell<Option<(usize, usize)>>) {
    let ring = &shared.ring;
    let request = &ring.request;
    let layout = &request.layout;
    // A data set whose `worker` panics cannot load with this thread: the loader stops with
    // `sample` (what it was about) and that panic's message, from `batch` on (without one,
    // from the first batch of which nothing is claimed), rather than leave the samples to
    // the other workers, or to nobody. The error's text is returned.
    let start = |batch: Option<usize>, sample: &dyn Fn(&str) -> String| {
        catch_unwind(AssertUnwindSafe(|| shared.dataset.worker())).map_err(|panic| {
            let sample = sample(panic_message(&*panic));
            let mut st = ring.lock();
            let batch = batch.unwrap_or(st.first_unclaimed_batch(shared.batch_size));
            let error = DataError::WorkerPanicked {
                worker,
                sample: sample.clone(),
            };
            ring.fail(&mut st, batch, error);
            sample
        })
    };
    let mut state = start(None, &|m| {
        format!("no sample: the data set's worker state panicked ({m})")
    })
    .ok();
    while let Some(worker_state) = state.as_mut() {
        current.set(None);
        let Some((position, memory)) = claim(shared) else {
            break;
        };
        let k = position % shared.batch_size;
        let index = ring.indices[position];
        current.set(Some((position, index)));
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: `memory` holds a whole batch (`BatchMemory`'s contract, sized by
            // `request`); sample `k` of it is written by this worker alone, because each
            // position is claimed exactly once and a slot serves one batch at a time; nothing
            // reads the slot until every sample of its batch is marked finished below, under
            // the ring's lock (which orders these writes before the consumer's reads).
            let (mut input, mut targets) = unsafe {
                (
                    input_of(&*memory, request, k),
                    targets_of(&*memory, request, k),
                )
            };
            // The slot may hold an earlier batch: `write` gets zeros (its contract), so a
            // data set that sets only some values (one-hot targets, counts) is right.
            input.fill_zero();
            targets.fill_zero();
            let mut len = layout.max_len();
            let out = SampleOut {
                input,
                targets,
                length: &mut len,
            };
            let mut rng = SampleRng::new(shared.seed, shared.epoch, index as u64);
            shared
                .dataset
                .write(worker_state, index, &mut rng, out)
                .map_err(|e| e.of_sample(|| shared.dataset.describe(index)))?;
            // SAFETY: as above; the borrows handed to `write` have ended.
            let input = unsafe { input_of(&*memory, request, k) };
            finish_sample(layout, input, len, || shared.dataset.describe(index))?;
            // SAFETY: as above, for sample `k`'s entry of the length region.
            unsafe { *memory.lengths_ptr().add(k) = len as i64 };
            Ok(())
        }));
        let result = match outcome {
            Ok(r) => r,
            Err(panic) => {
                let mut sample = format!(
                    "{} ({})",
                    shared.dataset.describe(index),
                    panic_message(&*panic)
                );
                // The per-thread state may be half-updated: start afresh. If that fails too,
                // the sample's error says so, as the loader-wide one does.
                let made = start(Some(position / shared.batch_size), &|m| {
                    format!("{sample}; its worker state, made again, panicked too ({m})")
                });
                state = made.map_err(|both| sample = both).ok();
                Err(DataError::WorkerPanicked { worker, sample })
            }
        };
        shared.finished.fetch_add(1, Ordering::Relaxed);
        let mut st = ring.lock();
        let batch = position / shared.batch_size;
        if let Some(&s) = st.filling.get(&batch) {
            let slot = &mut st.slots[s];
            if let Err(e) = result {
                if slot.error.as_ref().is_none_or(|(p, _)| position < *p) {
                    slot.error = Some((position, e));
                }
            }
            slot.remaining -= 1;
            if slot.remaining == 0 {
                ring.ready.notify_all();
            }
        }
    }
}

/// Sample `k`'s input region in `memory`.
///
/// # Safety
///
/// `memory` must hold a batch of `request` (`BatchMemory`'s contract), `k` must be below its
/// batch size, and the caller must be the only one to read or write sample `k`'s input while
/// the returned borrow lives.
unsafe fn input_of<'a>(memory: &'a dyn BatchMemory, request: &SlotRequest, k: usize) -> Input<'a> {
    let n = request.layout.input_len();
    // SAFETY: the caller's contract; the region is aligned for `i64` (`BatchMemory`) and sized
    // for the whole batch.
    unsafe {
        match request.storage {
            Storage::U8 => Input::U8(std::slice::from_raw_parts_mut(
                memory.input_ptr().add(k * n),
                n,
            )),
            Storage::F32 => Input::F32(std::slice::from_raw_parts_mut(
                memory.input_ptr().cast::<f32>().add(k * n),
                n,
            )),
            Storage::I64 => Input::I64(std::slice::from_raw_parts_mut(
                memory.input_ptr().cast::<i64>().add(k * n),
                n,
            )),
        }
    }
}

/// Sample `k`'s target region in `memory`.
///
/// # Safety
///
/// As [`input_of`], for the targets.
unsafe fn targets_of<'a>(
    memory: &'a dyn BatchMemory,
    request: &SlotRequest,
    k: usize,
) -> Targets<'a> {
    let t = request.layout.targets_len();
    // SAFETY: as in `input_of`, for the target region.
    unsafe {
        match request.layout.target_kind {
            ValueKind::F32 => Targets::F32(std::slice::from_raw_parts_mut(
                memory.targets_ptr().cast::<f32>().add(k * t),
                t,
            )),
            ValueKind::I64 => Targets::I64(std::slice::from_raw_parts_mut(
                memory.targets_ptr().cast::<i64>().add(k * t),
                t,
            )),
        }
    }
}

/// Checks the length a data set gave its sample and pads the positions after it: without
/// padding the length must be the maximum; with padding at most the maximum.
fn finish_sample(
    layout: &SampleLayout,
    input: Input<'_>,
    len: usize,
    sample: impl Fn() -> String,
) -> Result<(), DataError> {
    let max = layout.max_len();
    let Some(padding) = layout.padding else {
        if len != max {
            return Err(DataError::InvalidParameter {
                name: "sample length",
                expected: format!("{max} (the layout has no padding)"),
                value: format!("{len} for {}", sample()),
            });
        }
        return Ok(());
    };
    if len > max {
        return Err(DataError::SampleShape {
            sample: sample(),
            what: "input",
            expected: format!("at most {max} positions"),
            found: len,
        });
    }
    let from = len * layout.step_len();
    match input {
        // A placeholder: whoever converts the bytes writes the padding value itself
        // (`Loader`, `HostBatch::input_values`), since it need not be a byte and the affine
        // map would move it.
        Input::U8(v) => v[from..].fill(padding.value as u8),
        Input::F32(v) => v[from..].fill(padding.value as f32),
        Input::I64(v) => v[from..].fill(padding.value as i64),
    }
    Ok(())
}

/// Iterates one epoch's batches of `indices` as [`HostBatch`]es, in index order.
///
/// After an error the iterator ends: the error is the last item.
///
/// ```
/// use ddp_data::Dataset;
/// use ddp_data::{SampleLayout, SampleOut};
/// use ddp_data::{DataError, HostLoader, LoaderConfig};
/// use ddp_data::rng::SampleRng;
///
/// /// Sample i is the vector [i, i, i] with target i * 10.
/// struct Ramp;
/// impl Dataset for Ramp {
///     type Worker = ();
///     fn len(&self) -> usize { 100 }
///     fn layout(&self) -> SampleLayout {
///         SampleLayout::new([3], [1])
///     }
///     fn worker(&self) {}
///     fn write(&self, _: &mut (), i: usize, _: &mut SampleRng, out: SampleOut<'_>)
///         -> Result<(), DataError> {
///         out.input.f32()?.fill(i as f32);
///         out.targets.f32()?[0] = i as f32 * 10.0;
///         Ok(())
///     }
/// }
///
/// let config = LoaderConfig { workers: 2, ..LoaderConfig::new(2) };
/// let mut loader = HostLoader::new(Ramp, vec![7, 3, 5], &config)?;
/// let first = loader.next().unwrap()?;
/// assert_eq!(first.indices(), [7, 3]);
/// assert_eq!(first.input_f32(), Some(&[7.0, 7.0, 7.0, 3.0, 3.0, 3.0][..]));
/// assert_eq!(first.targets_f32(), Some(&[70.0, 30.0][..]));
/// assert_eq!(loader.next().unwrap()?.indices(), [5]);
/// assert!(loader.next().is_none());
/// # Ok::<(), DataError>(())
/// ```
///
/// Worker threads write samples straight into their place in a ring of reusable batch
/// buffers; the consumer takes finished batches in index order, as leases on their slot.
///
/// **Window.** Workers claim sample positions in order from a window that reaches at most
/// `max(prefetch, ceil(workers / batch_size))` batches past the last batch handed out, so work
/// in progress stays bounded and every worker can have a sample.
///
/// **Ring.** The first sample claimed for a batch takes a free slot for the whole batch: the
/// one given back longest ago (the free list is first in, first out), or a new one when none
/// is free. Each worker writes its samples into that slot, at the sample's offset, so a
/// finished batch is already laid out as `[B, ...]` and nothing is copied to assemble it. The
/// consumer gets a [`HostBatch`], a lease on the slot; dropping it returns the slot to the
/// ring, with a reuse hook if [`HostBatch::release_after`] gave one. A hook runs before the
/// slot is written again, and before its memory is freed, without the ring's lock: one worker
/// waiting in a hook keeps no other from taking another slot. A consumer that drops each
/// batch before asking for the one after next keeps the ring at `window + 2` slots and the
/// loader allocates nothing after its first batches; one that keeps batches (say, collects
/// an epoch) makes the ring grow instead of stalling.
///
/// **Determinism.** Sample `i`'s random draws come from `(seed, epoch, i)` alone, so the values
/// do not depend on the number of workers or on their timing. Batches, and errors, come in
/// index order: a later batch's error waits until that batch is due, also one that stops the
/// whole loader (a slot that cannot be allocated, a worker that dies). Dropping the loader
/// stops the workers after the sample each one is writing.
pub struct HostLoader<D: Dataset> {
    shared: Arc<Shared<D>>,
    workers: Vec<JoinHandle<()>>,
    /// Batches the workers may run ahead of the consumer.
    window: usize,
    finished: bool,
}

impl<D: Dataset> fmt::Debug for HostLoader<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostLoader")
            .field("samples", &self.shared.total)
            .field("batch_size", &self.shared.batch_size)
            .field("storage", &self.shared.ring.request.storage)
            .field("workers", &self.workers.len())
            .finish_non_exhaustive()
    }
}

impl<D: Dataset> HostLoader<D> {
    /// Starts `config.workers` threads loading `indices` of `dataset` into batches of final
    /// values (`f32` or `i64`, as the layout says) in heap memory.
    pub fn new(dataset: D, indices: Vec<usize>, config: &LoaderConfig) -> Result<Self, DataError> {
        let storage = Storage::of(dataset.layout().input_kind);
        Self::with_storage(dataset, indices, config, storage, Arc::new(HeapAllocator))
    }

    /// Like [`HostLoader::new`], with the input's element type and the allocator of the
    /// ring's slots chosen by the caller. [`Storage::U8`] needs a data set that can write
    /// bytes ([`SampleLayout::bytes`]).
    pub fn with_storage(
        dataset: D,
        indices: Vec<usize>,
        config: &LoaderConfig,
        storage: Storage,
        allocator: Arc<dyn SlotAllocator>,
    ) -> Result<Self, DataError> {
        if config.batch_size == 0 {
            return Err(DataError::InvalidParameter {
                name: "batch size",
                expected: "at least 1".to_string(),
                value: "0".to_string(),
            });
        }
        let len = dataset.len();
        if let Some(&index) = indices.iter().find(|&&i| i >= len) {
            return Err(DataError::IndexOutOfRange { index, len });
        }
        let layout = dataset.layout();
        layout.check(storage)?;
        let b = config.batch_size;
        let total = if config.drop_last {
            indices.len() / b * b
        } else {
            indices.len()
        };
        // A slot holds the largest batch this loader makes: an epoch of fewer samples than
        // `batch_size` (an evaluation shard, a large batch for prediction) does not reserve
        // (or pin) memory for samples that never come.
        let request = SlotRequest {
            batch_size: b.min(total.max(1)),
            layout,
            storage,
        };
        request.check_sizes()?;
        let workers = config.workers.max(1).min(total.max(1));
        // Batches past the last one handed out: at least one sample per worker.
        let window = config.prefetch.max(1).max(workers.div_ceil(b));
        let ring = Arc::new(Ring {
            state: Mutex::new(State::new(total.min(window.saturating_mul(b)), workers)),
            work: Condvar::new(),
            ready: Condvar::new(),
            indices: indices.into(),
            request,
            warm_slots: window.saturating_add(2),
        });
        let shared = Arc::new(Shared {
            ring,
            dataset,
            allocator,
            seed: config.seed,
            epoch: config.epoch,
            batch_size: b,
            total,
            finished: AtomicUsize::new(0),
        });
        let mut loader = Self {
            shared,
            workers: Vec::with_capacity(workers),
            window,
            finished: false,
        };
        for w in 0..workers {
            let shared = Arc::clone(&loader.shared);
            let spawned = std::thread::Builder::new()
                .name(format!("ddp-data-{w}"))
                .spawn(move || worker_loop(shared, w));
            match spawned {
                Ok(handle) => loader.workers.push(handle),
                Err(e) => {
                    // Dropping `loader` stops and joins the threads started so far.
                    loader.shared.ring.lock().live_workers -= workers - w;
                    return Err(DataError::InvalidParameter {
                        name: "loader workers",
                        expected: "a number of threads the system can start".to_string(),
                        value: format!("{} ({e})", config.workers),
                    });
                }
            }
        }
        Ok(loader)
    }

    /// Number of batches this epoch yields.
    pub fn len(&self) -> usize {
        self.shared.total.div_ceil(self.shared.batch_size)
    }

    /// Whether the epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.shared.total == 0
    }

    /// Samples per (full) batch.
    pub fn batch_size(&self) -> usize {
        self.shared.batch_size
    }

    /// The data set being read.
    pub fn dataset(&self) -> &D {
        &self.shared.dataset
    }

    /// One sample's shape.
    pub fn layout(&self) -> &SampleLayout {
        &self.shared.ring.request.layout
    }

    /// The input's element type in every batch.
    pub fn storage(&self) -> Storage {
        self.shared.ring.request.storage
    }

    /// How many samples the workers have finished so far (for progress and tests).
    pub fn samples_finished(&self) -> usize {
        self.shared.finished.load(Ordering::Relaxed)
    }

    /// Slots the ring has allocated so far.
    pub fn slots_allocated(&self) -> usize {
        self.shared.ring.lock().slots.len()
    }

    /// Whether the next batch is finished, so that [`Iterator::next`] will not wait.
    pub fn is_next_ready(&self) -> bool {
        let state = self.shared.ring.lock();
        state
            .filling
            .get(&state.handed)
            .is_some_and(|&s| state.slots[s].remaining == 0)
    }

    fn stop(&mut self) {
        self.finished = true;
        self.shared.ring.lock().stop = true;
        self.shared.ring.work.notify_all();
    }

    fn next_batch(&mut self) -> Option<Result<HostBatch, DataError>> {
        if self.finished {
            return None;
        }
        let shared = Arc::clone(&self.shared);
        let (b, ring) = (shared.batch_size, &shared.ring);
        let mut state = ring.lock();
        let batch = state.handed;
        let start = batch * b;
        if start >= shared.total {
            // Every batch came out: an error that kept none from finishing (a worker that
            // died with nothing left to claim) is the last item.
            let fatal = state.fatal.take();
            drop(state);
            self.finished = true;
            return fatal.map(|(_, e)| Err(e));
        }
        // A finished batch comes out before any loader-wide error: that error waits until the
        // batch it stopped is due, or until every worker has gone with this one unfinished.
        let waited = loop {
            if let Some(&s) = state.filling.get(&batch) {
                if state.slots[s].remaining == 0 {
                    break Ok(s);
                }
            }
            if state.fatal.as_ref().is_some_and(|&(from, _)| from <= batch) {
                break Err(state.fatal.take().map(|(_, e)| e));
            }
            if state.live_workers == 0 {
                // This batch will never finish: its own error if one of its samples failed,
                // else the loader-wide error that stopped the workers.
                let own = state.filling.get(&batch).copied();
                let own = own.and_then(|s| state.slots[s].error.take());
                let fatal = || state.fatal.take().map(|(_, e)| e);
                break Err(own.map(|(_, e)| e).or_else(fatal));
            }
            state = ring.ready.wait(state).unwrap_or_else(|e| e.into_inner());
        };
        let slot = match waited {
            Ok(slot) => slot,
            Err(e) => {
                drop(state);
                self.stop();
                // Without either error, the workers went without one: the batch's first sample.
                let e = e.unwrap_or_else(|| DataError::WorkerPanicked {
                    worker: 0,
                    sample: shared.dataset.describe(ring.indices[start]),
                });
                return Some(Err(e));
            }
        };
        state.filling.remove(&batch);
        if let Some((_, e)) = state.slots[slot].error.take() {
            state.free.push_back(slot);
            drop(state);
            self.stop();
            return Some(Err(e));
        }
        state.handed += 1;
        state.limit = shared
            .total
            .min(state.handed.saturating_add(self.window).saturating_mul(b));
        let memory = Arc::clone(&state.slots[slot].memory);
        drop(state);
        ring.work.notify_all();
        let len = b.min(shared.total - start);
        Some(Ok(HostBatch::new(
            Arc::clone(ring),
            slot,
            memory,
            start,
            len,
        )))
    }
}

impl<D: Dataset> Iterator for HostLoader<D> {
    type Item = Result<HostBatch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch()
    }
}

impl<D: Dataset> Drop for HostLoader<D> {
    fn drop(&mut self) {
        self.stop();
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::share_cores;

    #[test]
    fn the_cores_are_shared_among_the_processes_at_least_one_each() {
        assert_eq!(share_cores(16, 8), 2);
        assert_eq!(share_cores(64, 8), 8);
        assert_eq!(share_cores(15, 8), 1);
        assert_eq!(share_cores(4, 8), 1);
        assert_eq!(share_cores(16, 1), 16);
        assert_eq!(share_cores(16, 0), 16);
    }
}
