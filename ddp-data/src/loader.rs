//! The parallel batch loader without tch: worker threads decode and transform samples into
//! f32 buffers; the consumer assembles them into batches in index order.
//!
//! Workers claim sample positions from a window that reaches at most `prefetch` batches past
//! the last batch handed out, so memory stays bounded by a few batches. Each sample's random
//! draws come from `(seed, epoch, index)` alone, so the pixels do not depend on the number of
//! workers or on their timing. Dropping the loader stops the workers after the image each one
//! is working on.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crate::dataset::OdirDataset;
use crate::error::DataError;
use crate::rng::SampleRng;
use crate::transform::{Pipeline, Transform};

/// How a loader batches and parallelises one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Samples per batch.
    pub batch_size: usize,
    /// Leave out the last batch when it would be smaller than `batch_size`.
    pub drop_last: bool,
    /// The run's seed; with `epoch` and the sample index it fixes every random draw.
    pub seed: u64,
    /// The epoch number.
    pub epoch: u64,
    /// Worker threads (at least 1).
    pub workers: usize,
    /// How many batches the workers may run ahead of the consumer (at least 1).
    pub prefetch: usize,
}

impl LoaderConfig {
    /// `batch_size` with no drop_last, seed 0, epoch 0, [`default_workers`]`(1)` and a
    /// prefetch of 2 batches.
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

/// A sensible number of loader threads per rank: the machine's cores shared among the
/// `ranks_on_machine` processes that each run a loader, at least 1.
pub fn default_workers(ranks_on_machine: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / ranks_on_machine.max(1)).max(1)
}

/// One batch as plain buffers: `images` is `[len, 3, size, size]` and `labels` `[len, 8]`,
/// both row-major f32.
#[derive(Debug, Clone, PartialEq)]
pub struct HostBatch {
    /// Pixel values, `len * 3 * size * size` of them.
    pub images: Vec<f32>,
    /// Multi-hot labels, `len * 8` of them.
    pub labels: Vec<f32>,
    /// The data-set index of each sample, in batch order.
    pub indices: Vec<usize>,
    /// The side of every image.
    pub size: u32,
}

impl HostBatch {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether the batch holds no samples (never the case for a batch a loader yields).
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// The `[3, size, size]` values of sample `k` of the batch.
    pub fn image(&self, k: usize) -> &[f32] {
        let n = 3 * self.size as usize * self.size as usize;
        &self.images[k * n..(k + 1) * n]
    }
}

struct Window {
    /// Next position (into the index list) to hand to a worker.
    next: usize,
    /// Positions below this may be claimed.
    limit: usize,
    stop: bool,
}

struct Shared {
    dataset: Arc<OdirDataset>,
    indices: Vec<usize>,
    transform: Transform,
    seed: u64,
    epoch: u64,
    window: Mutex<Window>,
    wake: Condvar,
    pool: Mutex<Vec<Vec<f32>>>,
    finished: AtomicUsize,
}

impl Shared {
    fn window(&self) -> MutexGuard<'_, Window> {
        // A poisoned lock only means a thread panicked while holding it; the window's plain
        // integers are still meaningful.
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take_buffer(&self) -> Vec<f32> {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        pool.pop()
            .unwrap_or_else(|| vec![0.0; self.transform.sample_len()])
    }

    fn return_buffer(&self, buf: Vec<f32>) {
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(buf);
    }
}

struct Done {
    position: usize,
    result: Result<Vec<f32>, DataError>,
}

fn worker_loop(shared: Arc<Shared>, worker: usize, total: usize, results: Sender<Done>) {
    let mut pipeline = Pipeline::new();
    loop {
        let position = {
            let mut w = shared.window();
            loop {
                if w.stop || w.next >= total {
                    return;
                }
                if w.next < w.limit {
                    break;
                }
                w = shared.wake.wait(w).unwrap_or_else(|e| e.into_inner());
            }
            w.next += 1;
            w.next - 1
        };
        let index = shared.indices[position];
        let mut buf = shared.take_buffer();
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let sample = shared.dataset.sample(index)?;
            let mut rng = SampleRng::new(shared.seed, shared.epoch, index as u64);
            pipeline.run(&shared.transform, &sample.path, &mut rng, &mut buf)
        }));
        let result = match outcome {
            Ok(Ok(())) => Ok(buf),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                pipeline = Pipeline::new();
                Err(DataError::WorkerPanicked {
                    worker,
                    path: shared
                        .dataset
                        .get(index)
                        .map_or_else(PathBuf::new, |s| s.path.clone()),
                })
            }
        };
        shared.finished.fetch_add(1, Ordering::Relaxed);
        if results.send(Done { position, result }).is_err() {
            return; // The loader was dropped.
        }
    }
}

/// Iterates one epoch's batches of `indices` as [`HostBatch`]es, in index order.
///
/// After an error the iterator ends: the error is the last item.
pub struct HostLoader {
    shared: Arc<Shared>,
    results: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
    batch_size: usize,
    prefetch: usize,
    total: usize,
    next_batch: usize,
    early: HashMap<usize, Result<Vec<f32>, DataError>>,
    finished: bool,
}

impl std::fmt::Debug for HostLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostLoader")
            .field("samples", &self.total)
            .field("batch_size", &self.batch_size)
            .field("next_batch", &self.next_batch)
            .field("workers", &self.workers.len())
            .finish()
    }
}

impl HostLoader {
    /// Starts `config.workers` threads loading `indices` of `dataset` with `transform`.
    pub fn new(
        dataset: Arc<OdirDataset>,
        indices: Vec<usize>,
        transform: Transform,
        config: &LoaderConfig,
    ) -> Result<Self, DataError> {
        if config.batch_size == 0 {
            return Err(DataError::InvalidParameter {
                name: "batch size",
                expected: "at least 1".to_string(),
                value: "0".to_string(),
            });
        }
        if let Some(&index) = indices.iter().find(|&&i| i >= dataset.len()) {
            return Err(DataError::IndexOutOfRange {
                index,
                len: dataset.len(),
            });
        }
        let b = config.batch_size;
        let total = if config.drop_last {
            indices.len() / b * b
        } else {
            indices.len()
        };
        let prefetch = config.prefetch.max(1);
        let shared = Arc::new(Shared {
            dataset,
            indices,
            transform,
            seed: config.seed,
            epoch: config.epoch,
            window: Mutex::new(Window {
                next: 0,
                limit: total.min(prefetch * b),
                stop: false,
            }),
            wake: Condvar::new(),
            pool: Mutex::new(Vec::new()),
            finished: AtomicUsize::new(0),
        });
        let (tx, rx) = channel();
        let workers = (0..config.workers.max(1).min(total.max(1)))
            .map(|w| {
                let shared = Arc::clone(&shared);
                let tx = tx.clone();
                std::thread::Builder::new()
                    .name(format!("ddp-data-{w}"))
                    .spawn(move || worker_loop(shared, w, total, tx))
                    .map_err(|e| DataError::InvalidParameter {
                        name: "loader workers",
                        expected: "a number of threads the system can start".to_string(),
                        value: format!("{} ({e})", config.workers),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            shared,
            results: rx,
            workers,
            batch_size: b,
            prefetch,
            total,
            next_batch: 0,
            early: HashMap::new(),
            finished: false,
        })
    }

    /// Number of batches this epoch yields.
    pub fn len(&self) -> usize {
        self.total.div_ceil(self.batch_size)
    }

    /// Whether the epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// The side of every image.
    pub fn image_size(&self) -> u32 {
        self.shared.transform.output_size()
    }

    /// How many samples the workers have finished so far (for progress and tests).
    pub fn samples_finished(&self) -> usize {
        self.shared.finished.load(Ordering::Relaxed)
    }

    fn stop(&mut self) {
        self.finished = true;
        self.shared.window().stop = true;
        self.shared.wake.notify_all();
    }

    fn next_batch(&mut self) -> Option<Result<HostBatch, DataError>> {
        if self.finished {
            return None;
        }
        let b = self.batch_size;
        let start = self.next_batch * b;
        if start >= self.total {
            self.finished = true;
            return None;
        }
        let end = (start + b).min(self.total);
        let len = self.shared.transform.sample_len();
        let mut images = vec![0f32; (end - start) * len];
        let mut filled = 0;
        for position in start..end {
            if let Some(result) = self.early.remove(&position) {
                match result {
                    Ok(buf) => {
                        images[(position - start) * len..][..len].copy_from_slice(&buf);
                        self.shared.return_buffer(buf);
                        filled += 1;
                    }
                    Err(e) => {
                        self.stop();
                        return Some(Err(e));
                    }
                }
            }
        }
        while filled < end - start {
            let done = match self.results.recv() {
                Ok(done) => done,
                Err(_) => {
                    // Every worker has exited without delivering this batch.
                    let missing = (start..end).find(|p| !self.early.contains_key(p));
                    let path = missing
                        .and_then(|p| self.shared.dataset.get(self.shared.indices[p]))
                        .map_or_else(PathBuf::new, |s| s.path.clone());
                    self.stop();
                    return Some(Err(DataError::WorkerPanicked { worker: 0, path }));
                }
            };
            if !(start..end).contains(&done.position) {
                // A later batch's sample (or error): keep it until that batch is due, so
                // batches and errors come in index order.
                self.early.insert(done.position, done.result);
                continue;
            }
            match done.result {
                Ok(buf) => {
                    images[(done.position - start) * len..][..len].copy_from_slice(&buf);
                    self.shared.return_buffer(buf);
                    filled += 1;
                }
                Err(e) => {
                    self.stop();
                    return Some(Err(e));
                }
            }
        }
        self.next_batch += 1;
        {
            let mut w = self.shared.window();
            w.limit = self.total.min((self.next_batch + self.prefetch) * b);
        }
        self.shared.wake.notify_all();

        let indices: Vec<usize> = self.shared.indices[start..end].to_vec();
        let mut labels = Vec::with_capacity(indices.len() * 8);
        for &i in &indices {
            // Indices were checked against the data set's length in `new`.
            let sample = match self.shared.dataset.sample(i) {
                Ok(s) => s,
                Err(e) => return Some(Err(e)),
            };
            labels.extend_from_slice(&sample.labels);
        }
        Some(Ok(HostBatch {
            images,
            labels,
            indices,
            size: self.shared.transform.output_size(),
        }))
    }
}

impl Iterator for HostLoader {
    type Item = Result<HostBatch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch()
    }
}

impl Drop for HostLoader {
    fn drop(&mut self) {
        self.stop();
        // Unblock workers waiting to send: drop the receiving end first.
        let (_, dead) = channel();
        drop(std::mem::replace(&mut self.results, dead));
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}
