//! The ring of batch slots under the loader: which free slot a new batch takes, that a
//! worker waiting in a slot's reuse hook (for CUDA slots: the wait for a copy) keeps no other
//! worker from taking another slot, and that a slot's pending hook runs before its memory is
//! freed. Hooks here are closures that stand for the CUDA event waits of the tch loader.

use std::any::Any;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ddp_data::memory::{BatchMemory, HeapMemory, SlotAllocator, SlotRequest};
use ddp_data::rng::SampleRng;
use ddp_data::{
    DataError, Dataset, HostBatch, HostLoader, LoaderConfig, SampleLayout, SampleOut, Storage,
};
use ddp_testkit::wait_for;

/// What happened, in order, across the test's threads.
type Log = Arc<Mutex<Vec<String>>>;

fn entries(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

/// Gives `batch` back with a reuse hook that logs `hook <slot>`; returns the slot.
fn release_logged(batch: HostBatch, log: &Log) -> usize {
    let slot = batch.slot();
    let log = log.clone();
    batch.release_after(Box::new(move || {
        log.lock().unwrap().push(format!("hook {slot}"));
        Ok(())
    }));
    slot
}

fn position(log: &Log, entry: &str) -> Option<usize> {
    entries(log).iter().position(|e| e == entry)
}

/// Sample `i` is the value `i`; each write is logged as `write i`. Writing sample `broken`,
/// and describing it, panic.
#[derive(Default)]
struct Ramp {
    len: usize,
    log: Log,
    broken: Option<usize>,
}

impl Dataset for Ramp {
    type Worker = ();

    fn len(&self) -> usize {
        self.len
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([1], [1])
    }

    fn worker(&self) {}

    fn describe(&self, index: usize) -> String {
        assert!(Some(index) != self.broken, "cannot describe sample {index}");
        format!("sample {index}")
    }

    fn write(
        &self,
        _: &mut (),
        index: usize,
        _: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        assert!(Some(index) != self.broken, "sample {index} is broken");
        out.input.f32()?[0] = index as f32;
        out.targets.f32()?[0] = index as f32;
        self.log.lock().unwrap().push(format!("write {index}"));
        Ok(())
    }
}

fn one_per_batch(workers: usize, prefetch: usize) -> LoaderConfig {
    LoaderConfig {
        workers,
        prefetch,
        ..LoaderConfig::new(1)
    }
}

const LIMIT: Duration = Duration::from_secs(60);

/// The free list is first in, first out: a new batch takes the slot given back longest ago
/// (for CUDA: the one whose copy was queued earliest), not the one just given back.
#[test]
fn a_new_batch_takes_the_slot_given_back_longest_ago() {
    let ramp = Ramp {
        len: 8,
        log: Log::default(),
        broken: None,
    };
    let mut loader = HostLoader::new(ramp, (0..8).collect(), &one_per_batch(1, 1)).unwrap();
    let b0 = loader.next().unwrap().unwrap();
    let b1 = loader.next().unwrap().unwrap();
    // Batch 2 is written while both are held: a third slot.
    wait_for("batch 2 finished", LIMIT, || loader.is_next_ready());
    assert_eq!((b0.slot(), b1.slot()), (0, 1));
    drop(b1);
    drop(b0);
    // Free: slot 1, then slot 0. Handing batch 2 out lets batch 3 start: it takes slot 1.
    let b2 = loader.next().unwrap().unwrap();
    let b2_slot = b2.slot();
    wait_for("batch 3 finished", LIMIT, || loader.is_next_ready());
    drop(b2);
    // Free: slot 0, then slot 2. Batch 4 takes slot 0.
    let b3 = loader.next().unwrap().unwrap();
    wait_for("batch 4 finished", LIMIT, || loader.is_next_ready());
    let b4 = loader.next().unwrap().unwrap();
    assert_eq!(
        [b2_slot, b3.slot(), b4.slot()],
        [2, 1, 0],
        "slots of batches 2, 3 and 4"
    );
    assert_eq!(
        (b3.input_f32(), b4.input_f32()),
        (Some(&[3.0][..]), Some(&[4.0][..]))
    );
    assert_eq!(loader.slots_allocated(), 3);
}

/// A slot whose hook has yet to run (for CUDA: whose copy may wait behind the running step)
/// is reused only once the ring holds `prefetch + 2` slots: a CUDA consumer gives every slot
/// back as soon as it takes the batch, and a ring of `prefetch` slots would make each new
/// batch wait for the step behind which the previous copy was queued.
#[test]
fn hooked_slots_wait_until_the_ring_holds_prefetch_plus_two() {
    let log = Log::default();
    let ramp = Ramp {
        len: 8,
        log: log.clone(),
        broken: None,
    };
    let mut slots = Vec::new();
    for batch in HostLoader::new(ramp, (0..8).collect(), &one_per_batch(1, 1)).unwrap() {
        slots.push(release_logged(batch.unwrap(), &log));
    }
    assert_eq!(slots, [0, 1, 2, 0, 1, 2, 0, 1]);
    let seen = entries(&log);
    let at = |e: &str| seen.iter().position(|x| x == e).unwrap();
    assert!(at("hook 0") < at("write 3"), "{seen:?}");
}

/// A worker blocked in a slot's reuse hook holds no lock that another needs: while it waits,
/// another worker takes a different free slot and writes its sample, and the consumer takes
/// a finished batch. Once the hook returns, the blocked slot is refilled and every batch
/// comes out in order with its own values.
#[test]
fn a_worker_waiting_in_a_hook_keeps_no_other_from_a_different_slot() {
    let log = Log::default();
    let ramp = Ramp {
        len: 8,
        log: log.clone(),
        broken: None,
    };
    let mut loader = HostLoader::new(ramp, (0..8).collect(), &one_per_batch(2, 2)).unwrap();
    let b0 = loader.next().unwrap().unwrap();
    let b1 = loader.next().unwrap().unwrap();
    // Batches 0 to 3 were given slots while none was free: four slots.
    wait_for("batches 2 and 3 written", LIMIT, || {
        position(&log, "write 2").is_some() && position(&log, "write 3").is_some()
    });
    let (blocked_slot, free_slot) = (b0.slot(), b1.slot());
    let (release, released) = mpsc::channel::<()>();
    let hook_log = log.clone();
    b0.release_after(Box::new(move || {
        hook_log.lock().unwrap().push("hook waits".into());
        // Bounded, so that a loader which ran hooks under its lock fails this test (below)
        // instead of hanging it.
        let _ = released.recv_timeout(Duration::from_secs(20));
        hook_log.lock().unwrap().push("hook returns".into());
        Ok(())
    }));
    drop(b1);
    // Free: the hooked slot, then a clean one. Batch 4 takes the hooked slot and waits in
    // its hook; batch 5 (after batch 3 is handed out) takes the clean slot.
    let b2 = loader.next().unwrap().unwrap();
    wait_for("batch 4 waiting in the hook", LIMIT, || {
        position(&log, "hook waits").is_some()
    });
    let b3 = loader.next().unwrap().unwrap();
    wait_for("batch 5 written", LIMIT, || {
        position(&log, "write 5").is_some()
    });
    release.send(()).unwrap();
    let seen = entries(&log);
    let at = |e: &str| seen.iter().position(|x| x == e);
    assert!(
        at("write 5").unwrap() < at("hook returns").unwrap_or(usize::MAX),
        "batch 5 waited for another slot's hook: {seen:?}"
    );
    let mut slots = vec![b2.slot(), b3.slot()];
    let mut values = vec![b2.input_f32().unwrap()[0], b3.input_f32().unwrap()[0]];
    drop((b2, b3));
    for batch in loader {
        let batch = batch.unwrap();
        slots.push(batch.slot());
        values.push(batch.input_f32().unwrap()[0]);
    }
    assert_eq!(values, [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    assert_eq!(slots[2], blocked_slot, "batch 4 is in the hooked slot");
    assert_eq!(slots[3], free_slot, "batch 5 is in the other free slot");
    let seen = entries(&log);
    let at = |e: &str| seen.iter().position(|x| x == e).unwrap();
    assert!(
        at("hook returns") < at("write 4"),
        "the hooked slot was written before its hook returned: {seen:?}"
    );
}

/// Slots in heap memory whose freeing is logged as `free SLOT`.
#[derive(Debug)]
struct LoggedMemory {
    heap: HeapMemory,
    id: usize,
    log: Log,
}

impl Drop for LoggedMemory {
    fn drop(&mut self) {
        self.log.lock().unwrap().push(format!("free {}", self.id));
    }
}

// SAFETY: the regions are `HeapMemory`'s, owned by this value and freed only when it drops.
unsafe impl BatchMemory for LoggedMemory {
    fn input_ptr(&self) -> *mut u8 {
        self.heap.input.as_ptr()
    }

    fn targets_ptr(&self) -> *mut u8 {
        self.heap.targets.as_ptr()
    }

    fn lengths_ptr(&self) -> *mut i64 {
        self.heap.lengths.as_ptr().cast()
    }

    fn capacities(&self) -> [usize; 3] {
        self.heap.capacities()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[derive(Debug)]
struct LoggedAllocator {
    made: Mutex<usize>,
    log: Log,
}

impl SlotAllocator for LoggedAllocator {
    fn allocate(&self, request: &SlotRequest) -> Result<Box<dyn BatchMemory>, DataError> {
        let mut made = self.made.lock().unwrap();
        *made += 1;
        Ok(Box::new(LoggedMemory {
            heap: HeapMemory::new(request)?,
            id: *made - 1,
            log: self.log.clone(),
        }))
    }
}

fn logged_loader(log: &Log) -> HostLoader<Ramp> {
    let ramp = Ramp {
        len: 4,
        log: log.clone(),
        broken: None,
    };
    let allocator = Arc::new(LoggedAllocator {
        made: Mutex::new(0),
        log: log.clone(),
    });
    HostLoader::with_storage(
        ramp,
        (0..4).collect(),
        &one_per_batch(1, 1),
        Storage::F32,
        allocator,
    )
    .unwrap()
}

/// A slot given back with a hook and never reused is not freed before the hook has run: for
/// CUDA slots, page-locked memory is not unregistered and freed under a copy in flight.
#[test]
fn dropping_the_loader_runs_a_pending_hook_before_freeing_the_slot() {
    let log = Log::default();
    let mut loader = logged_loader(&log);
    let first = loader.next().unwrap().unwrap();
    assert_eq!(release_logged(first, &log), 0);
    drop(loader);
    let seen = entries(&log);
    let hook = seen.iter().position(|e| e == "hook 0");
    let free = seen.iter().position(|e| e == "free 0");
    assert!(
        hook.is_some() && hook < free,
        "slot 0 freed without waiting for its hook: {seen:?}"
    );
    assert_eq!(seen.iter().filter(|e| *e == "hook 0").count(), 1);
}

/// When a slot's hook fails, nothing says its copy is done: the slot is never freed (its
/// memory is leaked), while the slots without a failed hook are.
#[test]
fn a_slot_whose_hook_failed_at_drop_is_never_freed() {
    let log = Log::default();
    let mut loader = logged_loader(&log);
    let first = loader.next().unwrap().unwrap();
    let second = loader.next().unwrap().unwrap();
    assert_eq!((first.slot(), second.slot()), (0, 1));
    first.release_after(Box::new(|| {
        Err(DataError::Cuda {
            call: "cudaEventSynchronize",
            message: "an illegal memory access was encountered".to_string(),
        })
    }));
    drop(second);
    drop(loader);
    let seen = entries(&log);
    assert!(seen.iter().any(|e| e == "free 1"), "{seen:?}");
    assert!(!seen.iter().any(|e| e == "free 0"), "{seen:?}");
}

/// Heap slots, except that the allocator's `fail_on`-th call fails as a refused
/// `cudaHostRegister` would (or, with `panics`, panics); every call is logged as
/// `allocate N`.
#[derive(Debug)]
struct FailingAllocator {
    calls: Mutex<usize>,
    fail_on: usize,
    panics: bool,
    log: Log,
}

impl SlotAllocator for FailingAllocator {
    fn allocate(&self, request: &SlotRequest) -> Result<Box<dyn BatchMemory>, DataError> {
        let mut calls = self.calls.lock().unwrap();
        *calls += 1;
        self.log.lock().unwrap().push(format!("allocate {calls}"));
        if *calls == self.fail_on {
            assert!(!self.panics, "no memory for slot {}", *calls - 1);
            return Err(DataError::Cuda {
                call: "cudaHostRegister",
                message: "out of memory".to_string(),
            });
        }
        Ok(Box::new(HeapMemory::new(request)?))
    }
}

/// While the ring is below `prefetch + 2` slots it allocates a new slot rather than reuse
/// a free one whose hook has yet to run. When that allocation fails, the hooked slot is
/// used instead (its hook run first), and the ring grows no further: the epoch finishes with
/// every batch, in order, in the two slots it has.
#[test]
fn a_failed_allocation_falls_back_to_a_hooked_free_slot() {
    let log = Log::default();
    let ramp = Ramp {
        len: 8,
        log: log.clone(),
        broken: None,
    };
    let allocator = Arc::new(FailingAllocator {
        calls: Mutex::new(0),
        fail_on: 3,
        panics: false,
        log: log.clone(),
    });
    let loader = HostLoader::with_storage(
        ramp,
        (0..8).collect(),
        &one_per_batch(1, 1),
        Storage::F32,
        allocator,
    )
    .unwrap();
    let (mut values, mut slots) = (Vec::new(), Vec::new());
    for batch in loader {
        let batch = batch.unwrap();
        values.push(batch.input_f32().unwrap()[0]);
        slots.push(release_logged(batch, &log));
    }
    assert_eq!(values, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    assert_eq!(slots, [0, 1, 0, 1, 0, 1, 0, 1]);
    let seen = entries(&log);
    let allocations: Vec<_> = seen.iter().filter(|e| e.starts_with("allocate")).collect();
    assert_eq!(
        allocations,
        ["allocate 1", "allocate 2", "allocate 3"],
        "{seen:?}"
    );
    let at = |e: &str| seen.iter().position(|x| x == e).unwrap();
    assert!(at("hook 0") < at("write 2"), "{seen:?}");
}

/// A worker's state that says when its thread is done with it (the thread has stopped).
struct Farewell(mpsc::Sender<()>);

impl Drop for Farewell {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// Sample `i` is the value `i`; each worker's state says when its thread stops.
struct Waving {
    len: usize,
    stopped: Mutex<mpsc::Sender<()>>,
}

impl Dataset for Waving {
    type Worker = Farewell;

    fn len(&self) -> usize {
        self.len
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([1], [1])
    }

    fn worker(&self) -> Farewell {
        Farewell(self.stopped.lock().unwrap().clone())
    }

    fn write(
        &self,
        _: &mut Farewell,
        index: usize,
        _: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        out.input.f32()?[0] = index as f32;
        out.targets.f32()?[0] = index as f32;
        Ok(())
    }
}

/// A slot that cannot be allocated stops the whole loader, but the batches finished before
/// the one it was for still come out first, in index order: the error waits until that
/// batch is due.
#[test]
fn a_failed_allocation_waits_for_the_batches_finished_before_it() {
    let (stopped, worker_stopped) = mpsc::channel();
    let data = Waving {
        len: 8,
        stopped: Mutex::new(stopped),
    };
    let allocator = Arc::new(FailingAllocator {
        calls: Mutex::new(0),
        fail_on: 3,
        panics: false,
        log: Log::default(),
    });
    // One worker, three batches ahead: it finishes batches 0 and 1, fails to get a slot for
    // batch 2 and stops, all before the consumer asks for a batch.
    let loader = HostLoader::with_storage(
        data,
        (0..8).collect(),
        &one_per_batch(1, 3),
        Storage::F32,
        allocator,
    )
    .unwrap();
    worker_stopped
        .recv_timeout(LIMIT)
        .expect("the worker stops after the failed allocation");
    assert!(loader.is_next_ready());
    let seen = bounded("the epoch", move || {
        loader
            .map(|b| match b {
                Ok(b) => b.input_f32().unwrap()[0].to_string(),
                Err(e) => e.to_string(),
            })
            .collect::<Vec<_>>()
    });
    assert_eq!(
        seen,
        ["0", "1", "CUDA call cudaHostRegister failed: out of memory"]
    );
}

/// Runs `f` on a thread of its own and returns what it returned; fails the test, instead of
/// hanging it, when `f` panics or takes longer than [`LIMIT`].
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(LIMIT)
        .unwrap_or_else(|e| panic!("{what}: no answer within {LIMIT:?} (it panicked or hung): {e}"))
}

/// Each batch's first value, or its error's message, for the whole epoch of `loader`,
/// giving batch 0 back with `hook` and the others plainly.
fn epoch_with_hook(loader: HostLoader<Ramp>, hook: ddp_data::ReuseHook) -> Vec<String> {
    let mut hook = Some(hook);
    let mut seen = Vec::new();
    for next in loader {
        match next {
            Ok(batch) => {
                seen.push(batch.input_f32().unwrap()[0].to_string());
                match hook.take() {
                    Some(h) => batch.release_after(h),
                    None => drop(batch),
                }
            }
            Err(e) => seen.push(e.to_string()),
        }
    }
    seen
}

/// A reuse hook that panics is that slot's failure, as an error would be: the batch that
/// would reuse the slot ends the epoch with the panic's message (it does not wait forever
/// for a worker that died), and the slot is never freed, since nothing says its copy is done.
#[test]
fn a_panicking_reuse_hook_ends_the_epoch_with_its_error() {
    let log = Log::default();
    let loader = logged_loader(&log);
    let seen = bounded("the epoch", move || {
        epoch_with_hook(
            loader,
            Box::new(|| panic!("the copy's event could not be read")),
        )
    });
    assert_eq!(
        seen,
        [
            "0",
            "1",
            "2",
            "the loader's slot reuse hook panicked: the copy's event could not be read"
        ]
    );
    let freed = entries(&log);
    assert!(freed.iter().any(|e| e == "free 1"), "{freed:?}");
    assert!(!freed.iter().any(|e| e == "free 0"), "{freed:?}");
}

/// An allocator that panics while no free slot is left ends the epoch with the panic's
/// message.
#[test]
fn a_panicking_allocator_ends_the_epoch_with_its_error() {
    let ramp = Ramp {
        len: 4,
        log: Log::default(),
        broken: None,
    };
    let allocator = Arc::new(FailingAllocator {
        calls: Mutex::new(0),
        fail_on: 2,
        panics: true,
        log: Log::default(),
    });
    let mut loader = HostLoader::with_storage(
        ramp,
        (0..4).collect(),
        &one_per_batch(1, 1),
        Storage::F32,
        allocator,
    )
    .unwrap();
    let (first, second) = bounded("two batches", move || {
        // The first batch is held: the second needs a new slot.
        let first = loader.next().unwrap().unwrap();
        let second = loader.next().unwrap().map(|_| ()).unwrap_err().to_string();
        (first.input_f32().unwrap()[0], second)
    });
    assert_eq!(first, 0.0);
    assert_eq!(
        second,
        "the loader's slot allocator panicked: no memory for slot 1"
    );
}

/// A panic the worker's own catch cannot report (here: describing the sample whose write
/// panicked panics too) stops the loader with an error naming the sample index; the
/// consumer does not wait for the sample the dead worker had claimed, although other workers
/// are still alive.
#[test]
fn a_panic_outside_the_workers_catch_stops_the_loader_with_an_error() {
    let data = Ramp {
        len: 8,
        broken: Some(2),
        ..Ramp::default()
    };
    let loader = HostLoader::new(data, (0..8).collect(), &one_per_batch(2, 2)).unwrap();
    let seen = bounded("the epoch", move || {
        loader
            .map(|b| match b {
                Ok(b) => b.input_f32().unwrap()[0].to_string(),
                // Either worker may have taken sample 2.
                Err(e) => e.to_string().replace("thread 1 ", "thread 0 "),
            })
            .collect::<Vec<_>>()
    });
    assert_eq!(
        seen,
        [
            "0",
            "1",
            "loader worker thread 0 panicked while loading sample index 2 (cannot describe \
             sample 2)"
        ]
    );
}

/// One sample of `shape`, never written.
struct Wide {
    shape: Vec<usize>,
}

impl Dataset for Wide {
    type Worker = ();

    fn len(&self) -> usize {
        1
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new(self.shape.clone(), [1])
    }

    fn worker(&self) {}

    fn write(
        &self,
        _: &mut (),
        _: usize,
        _: &mut SampleRng,
        _: SampleOut<'_>,
    ) -> Result<(), DataError> {
        unreachable!("the loader is refused before any sample is written")
    }
}

/// A batch whose bytes overflow `usize` is refused when the loader is made, before any
/// slot exists, rather than allocated short.
#[test]
fn a_batch_too_large_to_address_is_refused_up_front() {
    let wide = Wide {
        shape: vec![1 << 31, 1 << 31],
    };
    let e = HostLoader::new(wide, vec![0], &LoaderConfig::new(1 << 20))
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(
            e,
            DataError::InvalidParameter {
                name: "batch size",
                ..
            }
        ),
        "{e}"
    );
}

/// Sample `i` is the value `i`. Writing sample `broken` panics, and `worker` panics from its
/// call number `worker_panics_from` (counting from 0) on.
struct Moody {
    broken: Option<usize>,
    worker_panics_from: usize,
    workers_made: std::sync::atomic::AtomicUsize,
}

impl Dataset for Moody {
    type Worker = ();

    fn len(&self) -> usize {
        8
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([1], [1])
    }

    fn worker(&self) {
        let made = self
            .workers_made
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        assert!(made < self.worker_panics_from, "no state for call {made}");
    }

    fn write(
        &self,
        _: &mut (),
        index: usize,
        _: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        assert!(Some(index) != self.broken, "sample {index} is broken");
        out.input.f32()?[0] = index as f32;
        out.targets.f32()?[0] = index as f32;
        Ok(())
    }
}

/// The epoch of `data` on one worker, one sample per batch: each batch's value, until the
/// first error, and the error's text.
fn moody_epoch(data: Moody) -> (Vec<f32>, String) {
    let loader = HostLoader::new(data, (0..8).collect(), &one_per_batch(1, 2)).unwrap();
    bounded("the epoch", move || {
        let mut values = Vec::new();
        for batch in loader {
            match batch {
                Ok(b) => values.push(b.input_f32().unwrap()[0]),
                Err(e) => return (values, e.to_string()),
            }
        }
        (values, "no error".to_string())
    })
}

/// A panicking data set is reported with its own message and the sample it was about, as
/// PyTorch re-raises a worker's exception: a `worker` that panics at once names no sample; a
/// `write` that panics names its sample, also when making the worker's state again panics.
#[test]
fn a_panicking_data_set_is_reported_with_its_message_and_its_sample() {
    let moody = |broken, worker_panics_from| Moody {
        broken,
        worker_panics_from,
        workers_made: Default::default(),
    };
    let (values, error) = moody_epoch(moody(None, 0));
    assert_eq!(values, [] as [f32; 0]);
    assert_eq!(
        error,
        "loader worker thread 0 panicked while loading no sample: the data set's worker state \
         panicked (no state for call 0)"
    );
    let (values, error) = moody_epoch(moody(Some(5), usize::MAX));
    assert_eq!(values, [0.0, 1.0, 2.0, 3.0, 4.0]);
    assert_eq!(
        error,
        "loader worker thread 0 panicked while loading sample 5 (sample 5 is broken)"
    );
    // The loader stops at sample 5, but the batches before it are finished first.
    let (values, error) = moody_epoch(moody(Some(5), 1));
    assert_eq!(values, [0.0, 1.0, 2.0, 3.0, 4.0]);
    assert_eq!(
        error,
        "loader worker thread 0 panicked while loading sample 5 (sample 5 is broken); \
         its worker state, made again, panicked too (no state for call 1)"
    );
}

/// Heap slots made for one sample, whatever the batch: `HeapMemory::new` is safe to call for
/// any request, so only the loader's own check keeps its workers inside the memory.
#[derive(Debug)]
struct OneSampleAllocator;

impl SlotAllocator for OneSampleAllocator {
    fn allocate(&self, request: &SlotRequest) -> Result<Box<dyn BatchMemory>, DataError> {
        let one = SlotRequest {
            batch_size: 1,
            ..request.clone()
        };
        Ok(Box::new(HeapMemory::new(&one)?))
    }
}

/// Memory smaller than the loader's request is refused before a worker writes into it (a
/// batch of 64 `[3, 64, 64]` images would run 63 images past the end), naming both sizes.
#[test]
fn slot_memory_smaller_than_the_request_is_refused() {
    let len = 64;
    let inputs = ddp_data::Array::new(vec![1f32; len * 3 * 64 * 64], [len, 3, 64, 64]).unwrap();
    let targets = ddp_data::Array::new(vec![0f32; len], [len, 1]).unwrap();
    let data = ddp_data::TensorDataset::new(inputs, targets).unwrap();
    let config = LoaderConfig {
        workers: 2,
        ..LoaderConfig::new(64)
    };
    let mut loader = HostLoader::with_storage(
        data,
        (0..len).collect(),
        &config,
        Storage::F32,
        Arc::new(OneSampleAllocator),
    )
    .unwrap();
    let page = ddp_data::memory::page_size();
    let one_image = (3 * 64 * 64 * 4usize).next_multiple_of(page);
    match loader.next() {
        Some(Err(
            e @ DataError::InvalidParameter {
                name: "slot memory",
                ..
            },
        )) => assert_eq!(
            e.to_string(),
            format!(
                "invalid slot memory: expected at least 3145728 bytes of input, 256 of \
                 targets and 512 of lengths (64 samples of input shape [3, 64, 64] and target \
                 shape [1]): allocate for the request the allocator is given, found \
                 {one_image} bytes of input, {page} of targets and {page} of lengths from \
                 the slot allocator"
            )
        ),
        other => panic!("expected the short slot to be refused, got {other:?}"),
    }
    assert!(loader.next().is_none());
}

/// Heap slots, each request's batch size recorded.
#[derive(Debug, Default)]
struct SizeLoggingAllocator {
    batch_sizes: Mutex<Vec<usize>>,
}

impl SlotAllocator for SizeLoggingAllocator {
    fn allocate(&self, request: &SlotRequest) -> Result<Box<dyn BatchMemory>, DataError> {
        self.batch_sizes.lock().unwrap().push(request.batch_size);
        Ok(Box::new(HeapMemory::new(request)?))
    }
}

/// An epoch of fewer samples than `batch_size` (an evaluation shard under a large training
/// batch) gets slots for the samples it has, not for a batch that never fills: 3 samples of
/// `[3, 64, 64]` bytes under a batch of 65536 ask for 3 samples' memory (36 KiB, not 768 MiB).
#[test]
fn slots_hold_the_largest_batch_the_epoch_makes() {
    let run = |indices: Vec<usize>, batch: usize, drop_last: bool| {
        let len = 8;
        let inputs = ddp_data::Array::new(vec![7u8; len * 3 * 64 * 64], [len, 3, 64, 64]).unwrap();
        let targets = ddp_data::Array::new(vec![0f32; len], [len, 1]).unwrap();
        let data = ddp_data::TensorDataset::new(inputs, targets).unwrap();
        let allocator = Arc::new(SizeLoggingAllocator::default());
        let config = LoaderConfig {
            workers: 2,
            drop_last,
            ..LoaderConfig::new(batch)
        };
        let loader =
            HostLoader::with_storage(data, indices, &config, Storage::U8, allocator.clone())
                .unwrap();
        let sizes: Vec<usize> = loader.map(|b| b.unwrap().len()).collect();
        let requested = allocator.batch_sizes.lock().unwrap().clone();
        (sizes, requested)
    };
    let (sizes, requested) = run(vec![0, 5, 7], 1 << 16, false);
    assert_eq!(sizes, [3]);
    assert!(
        !requested.is_empty() && requested.iter().all(|&b| b == 3),
        "{requested:?}"
    );
    // Batches of 2 from 5 samples: full slots, the last batch short inside one.
    let (sizes, requested) = run(vec![0, 1, 2, 3, 4], 2, false);
    assert_eq!(sizes, [2, 2, 1]);
    assert!(requested.iter().all(|&b| b == 2), "{requested:?}");
    // Nothing to load: a slot of one sample is all a request may ask (none is made).
    let (sizes, requested) = run(vec![0], 2, true);
    assert!(sizes.is_empty());
    assert!(requested.iter().all(|&b| b == 1), "{requested:?}");
}
