//! What a data set can count on from the loader: zeroed buffers in reused slots, its errors
//! reported with the sample they concern, and as many samples in flight as there are workers,
//! whatever the batch size.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ddp_data::rng::SampleRng;
use ddp_data::{
    DataError, Dataset, HostLoader, Item, LoaderConfig, MapDataset, SampleLayout, SampleOut,
};

/// Sample `i`: input `[i]` and a one-hot target of class `i % 4`, written by setting that one
/// value (`+=`, as a count would be), trusting the rest to be zero.
struct OneHot;

impl Dataset for OneHot {
    type Worker = ();

    fn len(&self) -> usize {
        64
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([1], [4])
    }

    fn worker(&self) {}

    fn write(
        &self,
        _: &mut (),
        index: usize,
        _: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        out.input.f32()?[0] += index as f32;
        out.targets.f32()?[index % 4] += 1.0;
        Ok(())
    }
}

/// Slots are reused from the fourth batch on (prefetch 1: three slots); a data set that sets
/// only some values still gets exactly its own sample there, not an earlier batch's values.
#[test]
fn a_sample_is_written_into_zeros_also_in_a_reused_slot() {
    let config = LoaderConfig {
        workers: 1,
        prefetch: 1,
        ..LoaderConfig::new(2)
    };
    let indices: Vec<usize> = (0..24).collect();
    let mut loader = HostLoader::new(OneHot, indices, &config).unwrap();
    let mut batches = 0;
    for batch in loader.by_ref() {
        let batch = batch.unwrap();
        let targets = batch.targets_f32().unwrap();
        for (k, &index) in batch.indices().iter().enumerate() {
            let mut want = [0.0; 4];
            want[index % 4] = 1.0;
            assert_eq!(
                &targets[4 * k..4 * k + 4],
                want,
                "sample {index} (batch {batches}, slot {})",
                batch.slot()
            );
            assert_eq!(batch.input_f32().unwrap()[k], index as f32);
        }
        batches += 1;
    }
    assert_eq!(batches, 12);
    assert!(loader.slots_allocated() <= 3, "slots were reused");
}

/// Sample `i` is `[i]` with target `i`; getting sample `failing` fails with the data set's own
/// error.
struct Records {
    failing: usize,
}

impl MapDataset for Records {
    fn len(&self) -> usize {
        10
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([1], [])
    }

    fn get(&self, i: usize, _: &mut SampleRng) -> Result<Item, DataError> {
        if i == self.failing {
            let io = std::io::Error::new(std::io::ErrorKind::InvalidData, "checksum mismatch");
            return Err(DataError::other(io));
        }
        Ok(Item::new(vec![i as f32], i as f32))
    }

    fn describe(&self, i: usize) -> String {
        format!("record #{i} of 'table.db'")
    }
}

fn first_error<D: Dataset>(loader: HostLoader<D>) -> DataError {
    loader
        .filter_map(Result::err)
        .next()
        .expect("the epoch ends with an error")
}

/// 64 samples whose layout counts how often it is asked for.
struct Counted(Arc<AtomicUsize>);

impl MapDataset for Counted {
    fn len(&self) -> usize {
        64
    }

    fn layout(&self) -> SampleLayout {
        self.0.fetch_add(1, Ordering::Relaxed);
        SampleLayout::new([1], [])
    }

    fn get(&self, i: usize, _: &mut SampleRng) -> Result<Item, DataError> {
        Ok(Item::new(vec![i as f32], i as f32))
    }
}

/// A map-style data set's layout is asked for when the loader is made and by each worker,
/// not for every sample (a layout may take work: the longest of a corpus's texts).
#[test]
fn a_map_data_sets_layout_is_asked_once_per_worker() {
    let config = LoaderConfig {
        workers: 2,
        ..LoaderConfig::new(4)
    };
    let asked = Arc::new(AtomicUsize::new(0));
    let data = Counted(asked.clone());
    let loader = HostLoader::new(data, (0..64).collect(), &config).unwrap();
    assert_eq!(loader.map(Result::unwrap).count(), 16);
    // Twice by the loader (the storage it needs, the slots' layout), once by each worker.
    assert_eq!(asked.load(Ordering::Relaxed), 2 + 2);
}

/// A data set's own error (`DataError::other`) ends the epoch naming the sample, as the data
/// set describes it, and keeps the original error as its source.
#[test]
fn a_data_set_error_names_its_sample() {
    let config = LoaderConfig {
        workers: 2,
        ..LoaderConfig::new(3)
    };
    let loader = HostLoader::new(Records { failing: 5 }, (0..10).collect(), &config).unwrap();
    let e = first_error(loader);
    assert_eq!(e.to_string(), "record #5 of 'table.db'");
    let DataError::Sample { sample, source } = &e else {
        panic!("not a Sample error: {e:?}");
    };
    assert_eq!(sample, "record #5 of 'table.db'");
    assert!(matches!(**source, DataError::Other(_)), "{source:?}");
    let inner = std::error::Error::source(&e).expect("a source");
    assert!(inner.to_string().contains("checksum mismatch"), "{inner}");
}

/// Sample `i` asks for `i64` targets although its layout declares `f32` ones.
struct WrongKind;

impl Dataset for WrongKind {
    type Worker = ();

    fn len(&self) -> usize {
        4
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([1], [])
    }

    fn worker(&self) {}

    fn write(
        &self,
        _: &mut (),
        _: usize,
        _: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        out.targets.i64()?[0] = 1;
        Ok(())
    }

    fn describe(&self, i: usize) -> String {
        format!("row {i}")
    }
}

/// A kind mismatch from `Targets::i64` names no sample itself: the loader adds it.
#[test]
fn a_kind_mismatch_in_write_names_its_sample() {
    let loader = HostLoader::new(WrongKind, vec![2, 3], &LoaderConfig::new(2)).unwrap();
    let e = first_error(loader);
    assert!(
        matches!(&e, DataError::Sample { sample, .. } if sample == "row 2"),
        "{e:?}"
    );
    let cause = std::error::Error::source(&e).expect("the kind mismatch");
    assert!(cause.to_string().contains("expected i64 values"), "{cause}");
}

/// Counts the writes in progress; the first `group` writes each wait (up to `patience`) for
/// `group` writes to be in progress at once, and record whether they were.
struct Gathering {
    group: usize,
    patience: Duration,
    in_progress: Mutex<usize>,
    changed: Condvar,
    all_met: AtomicBool,
    failed: AtomicBool,
}

impl Dataset for Gathering {
    type Worker = ();

    fn len(&self) -> usize {
        2 * self.group
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([1], [])
    }

    fn worker(&self) {}

    fn write(
        &self,
        _: &mut (),
        index: usize,
        _: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        out.input.f32()?[0] = index as f32;
        if index >= self.group {
            return Ok(());
        }
        let mut n = self.in_progress.lock().unwrap();
        *n += 1;
        self.changed.notify_all();
        let deadline = Instant::now() + self.patience;
        // Once one write has given up, the others do not wait their turn to.
        while *n < self.group
            && !self.all_met.load(Ordering::SeqCst)
            && !self.failed.load(Ordering::SeqCst)
        {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.failed.store(true, Ordering::SeqCst);
                break;
            }
            n = self.changed.wait_timeout(n, left).unwrap().0;
        }
        if *n >= self.group {
            self.all_met.store(true, Ordering::SeqCst);
        }
        *n -= 1;
        Ok(())
    }
}

/// With batches of one sample and a prefetch of one batch, four workers still write four
/// samples at once: the window holds at least one sample per worker.
#[test]
fn every_worker_has_a_sample_in_flight_with_batches_of_one() {
    let data = Gathering {
        group: 4,
        patience: Duration::from_secs(5),
        in_progress: Mutex::new(0),
        changed: Condvar::new(),
        all_met: AtomicBool::new(false),
        failed: AtomicBool::new(false),
    };
    let config = LoaderConfig {
        workers: 4,
        prefetch: 1,
        ..LoaderConfig::new(1)
    };
    let mut loader = HostLoader::new(data, (0..8).collect(), &config).unwrap();
    let mut seen = Vec::new();
    for batch in loader.by_ref() {
        seen.push(batch.unwrap().input_f32().unwrap()[0]);
    }
    assert_eq!(seen, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    let data = loader.dataset();
    assert!(
        data.all_met.load(Ordering::SeqCst) && !data.failed.load(Ordering::SeqCst),
        "fewer than 4 writes ran at once with 4 workers"
    );
}
