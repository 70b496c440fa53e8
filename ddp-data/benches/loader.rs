//! The loader as the training thread sees it, on 512x512 ODIR-like JPEGs, batch 64,
//! RandomResizedCrop(224):
//!
//! - **hand-off**: training-thread time from "the batch is ready" to "its tensors are on the
//!   device" (here the CPU), per batch: `Loader::next` on a finished batch. Next to it, the
//!   same batch through the copy-based hand-off the loader had before its ring (a fresh
//!   `Vec`, a copy into it, `Tensor::from_slice`), and the byte path converted on the CPU.
//! - **throughput**: images per second of the loader with 1 and 2 worker threads feeding a
//!   consumer that drops each batch at once, for `f32` batches (the CPU path) and byte
//!   batches (the GPU path).
//!
//! `cargo bench -p ddp-data --bench loader [-- --batches N]` prints `RESULT loader ...`
//! lines (what `cargo xtask bench` reads) and a summary.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ddp_data::memory::HeapAllocator;
use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_data::odir::transform::Transform;
use ddp_data::odir::{OdirDataset, OdirImages, OdirOptions};
use ddp_data::{HostLoader, Loader, LoaderConfig, Storage};
use tch::{Device, Tensor};

const BATCH: usize = 64;
const SIZE: u32 = 224;

fn dataset() -> Arc<OdirDataset> {
    let dir = common::bench_dir().join("odir512");
    if !dir.join("full_df.csv").exists() {
        let tmp = common::bench_dir().join(format!("odir512-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let config = SyntheticConfig {
            images: 128,
            size: 512,
            seed: 7,
            quality: 92,
            ..Default::default()
        };
        generate(&tmp, &config).expect("write the bench's ODIR sample");
        // Another bench run may have finished first; either copy is complete.
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    Arc::new(OdirDataset::open(&dir, &OdirOptions::default()).expect("open the bench sample"))
}

fn indices(ds: &OdirDataset, batches: usize) -> Vec<usize> {
    (0..batches * BATCH).map(|i| (i * 37) % ds.len()).collect()
}

fn config(workers: usize) -> LoaderConfig {
    LoaderConfig {
        drop_last: true,
        workers,
        prefetch: 2,
        ..LoaderConfig::new(BATCH)
    }
}

/// Waits (sleeping, not spinning) until the loader's next batch is finished.
fn wait_ready<D: ddp_data::Dataset>(host: &HostLoader<D>) {
    while !host.is_next_ready() {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Training-thread seconds per batch for `Loader::next` on finished batches.
fn handoff(ds: &Arc<OdirDataset>, storage: Storage, batches: usize) -> f64 {
    let images = OdirImages::new(ds.clone(), Transform::train(SIZE));
    let mut loader = Loader::with_storage(
        images,
        indices(ds, batches),
        &config(2),
        Device::Cpu,
        storage,
    )
    .expect("start the loader");
    let mut times = Vec::new();
    for _ in 0..loader.len() {
        wait_ready(loader.host());
        let t = Instant::now();
        let batch = loader.next().expect("a batch per loader.len()");
        let batch = batch.expect("bench batch loads");
        times.push(t.elapsed().as_secs_f64());
        assert_eq!(batch.inputs().size(), [BATCH as i64, 3, 224, 224]);
    }
    ddp_testkit::median(&times)
}

/// The previous loader's hand-off of a finished batch: a fresh `Vec` for the batch, a copy of
/// every sample into it, then `Tensor::from_slice` (a second copy) and a view.
fn copying_handoff(ds: &Arc<OdirDataset>, batches: usize) -> f64 {
    let images = OdirImages::new(ds.clone(), Transform::train(SIZE));
    let loader = HostLoader::new(images, indices(ds, batches), &config(2)).expect("loader");
    let mut times = Vec::new();
    for batch in loader {
        let batch = batch.expect("bench batch loads");
        let src = batch.input_f32().expect("f32 batch");
        let t = Instant::now();
        let sample = src.len() / batch.len();
        let mut owned = vec![0f32; src.len()];
        for (dst, s) in owned.chunks_mut(sample).zip(src.chunks(sample)) {
            dst.copy_from_slice(s);
        }
        let x = Tensor::from_slice(&owned).view([BATCH as i64, 3, 224, 224]);
        let y =
            Tensor::from_slice(batch.targets_f32().expect("f32 targets")).view([BATCH as i64, 8]);
        times.push(t.elapsed().as_secs_f64());
        drop((x, y));
    }
    ddp_testkit::median(&times)
}

/// Images per second of `workers` threads feeding a consumer that drops each batch.
fn throughput(ds: &Arc<OdirDataset>, workers: usize, storage: Storage, batches: usize) -> f64 {
    let mut rates = Vec::new();
    for _ in 0..3 {
        let images = OdirImages::new(ds.clone(), Transform::train(SIZE));
        let t = Instant::now();
        let loader = HostLoader::with_storage(
            images,
            indices(ds, batches),
            &config(workers),
            storage,
            Arc::new(HeapAllocator),
        )
        .expect("loader");
        let mut n = 0;
        for batch in loader {
            n += batch.expect("bench batch loads").len();
        }
        rates.push(n as f64 / t.elapsed().as_secs_f64());
    }
    ddp_testkit::median(&rates)
}

fn main() {
    let mut batches = 12;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--batches" {
            batches = args
                .next()
                .and_then(|v| v.parse().ok())
                .expect("--batches takes a number");
        }
    }
    tch::set_num_threads(1);
    let ds = dataset();
    let folder: PathBuf = ds.root().to_path_buf();
    println!(
        "loader bench: {} JPEGs of 512x512 in {}, batch {BATCH}, crops {SIZE}, {batches} batches per measurement",
        ds.len(),
        folder.display()
    );
    let report = |metric: &str, value: f64, unit: &str| {
        println!("RESULT loader metric={metric} value={value:.9} unit={unit}");
    };
    let zero_copy = handoff(&ds, Storage::F32, batches);
    report("handoff_f32_s", zero_copy, "s");
    let copying = copying_handoff(&ds, batches);
    report("handoff_copying_s", copying, "s");
    let bytes = handoff(&ds, Storage::U8, batches);
    report("handoff_u8_convert_on_cpu_s", bytes, "s");
    let mut rates = Vec::new();
    for storage in [Storage::F32, Storage::U8] {
        for workers in [1, 2] {
            let rate = throughput(&ds, workers, storage, batches);
            let name = format!("throughput_{:?}_{workers}_threads", storage).to_lowercase();
            report(&name, rate, "img/s");
            rates.push(rate);
        }
    }
    println!(
        "hand-off per batch: zero-copy {:.3} ms, copying (previous loader) {:.3} ms, bytes converted on the CPU {:.3} ms",
        zero_copy * 1e3,
        copying * 1e3,
        bytes * 1e3
    );
    println!(
        "throughput, no-op consumer: f32 {:.0} / {:.0} img/s with 1 / 2 threads (x{:.2}); bytes {:.0} / {:.0} (x{:.2})",
        rates[0],
        rates[1],
        rates[1] / rates[0],
        rates[2],
        rates[3],
        rates[3] / rates[2]
    );
}
