//! Decode + RandomResizedCrop(224, scale=(0.2, 1.0)) + ToTensor, one thread, on ODIR-like
//! JPEGs of 512x512 and 2048x2048, and the same work through torchvision for the ratio.
//!
//! `cargo bench -p ddp-data --bench pipeline` writes the images to
//! `target/ddp-data-bench/`, measures this crate with criterion, then runs
//! `benches/reference_pipeline.py` with the project's Python (`.deps/venv/bin/python`, or
//! `DDP_BENCH_PYTHON`) when torchvision is installed there, and prints img/s and ratios.
//! The comparison counts images per CPU-second of the working thread on both sides, so other
//! processes on a shared machine disturb it less than wall-clock rates.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use criterion::{criterion_group, Criterion, Throughput};
use ddp_data::rng::SampleRng;
use ddp_data::synthetic::paint_fundus;
use ddp_data::{Pipeline, Transform};
use image::codecs::jpeg::JpegEncoder;
use image::ExtendedColorType;

const SIZES: [u32; 2] = [512, 2048];
const IMAGES_PER_SIZE: usize = 4;

fn bench_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/ddp-data-bench")
}

/// Writes (once) `IMAGES_PER_SIZE` fundus JPEGs per size, with assorted lesions, quality 92.
fn images(size: u32) -> Vec<PathBuf> {
    let dir = bench_dir();
    std::fs::create_dir_all(&dir).expect("create bench image folder");
    (0..IMAGES_PER_SIZE)
        .map(|k| {
            let path = dir.join(format!("odir_like_{size}_{k}.jpg"));
            if !path.exists() {
                let mut labels = [false; 8];
                labels[[1, 2, 4, 5][k % 4]] = true;
                let px = paint_fundus(size, labels, k % 2 == 0, 17, k as u64);
                let mut out = Vec::new();
                JpegEncoder::new_with_quality(&mut out, 92)
                    .encode(&px, size, size, ExtendedColorType::Rgb8)
                    .expect("encode bench JPEG");
                std::fs::write(&path, out).expect("write bench JPEG");
            }
            path
        })
        .collect()
}

/// The measured work: one image through the pipeline per call, cycling through `paths`.
struct Runner {
    paths: Vec<PathBuf>,
    transform: Transform,
    pipeline: Pipeline,
    out: Vec<f32>,
    n: u64,
}

impl Runner {
    fn new(paths: Vec<PathBuf>) -> Self {
        let transform = Transform::train(224);
        Self {
            paths,
            transform,
            pipeline: Pipeline::new(),
            out: vec![0f32; transform.sample_len()],
            n: 0,
        }
    }

    fn step(&mut self) {
        let mut rng = SampleRng::new(0, 0, self.n);
        let path = &self.paths[self.n as usize % self.paths.len()];
        self.pipeline
            .run(&self.transform, path, &mut rng, &mut self.out)
            .expect("bench image decodes");
        self.n += 1;
    }
}

/// CPU seconds this thread has used: on a shared machine other processes' load inflates wall
/// time but not this, so both sides of the comparison are counted this way.
fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec; the clock id is a constant libc knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Images per CPU-second of the whole pipeline on one thread, over about `seconds` of CPU.
fn rate(paths: Vec<PathBuf>, seconds: f64) -> f64 {
    let mut runner = Runner::new(paths);
    runner.step(); // Grow the buffers before timing.
    runner.n = 0;
    let start = thread_cpu_seconds();
    while thread_cpu_seconds() - start < seconds {
        runner.step();
    }
    runner.n as f64 / (thread_cpu_seconds() - start)
}

fn pipeline(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_crop_resize_to_tensor");
    group.throughput(Throughput::Elements(1));
    group.sample_size(20);
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(3));
    for size in SIZES {
        let mut runner = Runner::new(images(size));
        group.bench_function(format!("{size}x{size}"), |b| b.iter(|| runner.step()));
    }
    group.finish();
}

fn python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("DDP_BENCH_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.deps/venv/bin/python");
    venv.exists().then_some(venv)
}

/// Runs the torchvision reference; returns `(mode, size, img/s)` rows.
fn torchvision(
    python: &Path,
    paths: &[PathBuf],
    malloc_tuned: bool,
) -> Option<Vec<(String, u32, f64)>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/reference_pipeline.py");
    let mut cmd = Command::new(python);
    cmd.arg(script).args(paths).env("OMP_NUM_THREADS", "1");
    if malloc_tuned {
        // Keeps glibc from returning the large decode buffers to the OS after every image.
        cmd.env("MALLOC_MMAP_THRESHOLD_", "268435456")
            .env("MALLOC_TRIM_THRESHOLD_", "268435456");
    }
    let out = cmd.output().ok()?;
    if !out.status.success() {
        eprintln!(
            "torchvision reference did not run: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
        return None;
    }
    let rows = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (mode, size, rate) = (f.next()?, f.next()?, f.next()?);
            Some((mode.to_string(), size.parse().ok()?, rate.parse().ok()?))
        })
        .collect();
    Some(rows)
}

fn compare() {
    let ours: Vec<(u32, f64)> = SIZES.iter().map(|&s| (s, rate(images(s), 3.0))).collect();
    println!("\nimages per CPU-second of one thread, decode + RandomResizedCrop(224) + ToTensor");
    println!("ddp-data:");
    for (s, r) in &ours {
        println!("  {s}x{s}: {r:.0} img/s");
    }
    let Some(python) = python() else {
        println!(
            "no Python found (.deps/venv/bin/python or DDP_BENCH_PYTHON): skipping torchvision"
        );
        return;
    };
    let all: Vec<PathBuf> = SIZES.iter().flat_map(|&s| images(s)).collect();
    let (Some(plain), Some(tuned)) = (
        torchvision(&python, &all, false),
        torchvision(&python, &all, true),
    ) else {
        return;
    };
    let find = |rows: &[(String, u32, f64)], mode: &str, size: u32| {
        rows.iter()
            .find(|r| r.0 == mode && r.1 == size)
            .map(|r| r.2)
    };
    println!("torchvision, same images (ratio = ddp-data / torchvision):");
    for (s, r) in &ours {
        let (Some(d0), Some(d1), Some(f0), Some(f1)) = (
            find(&plain, "default", *s),
            find(&tuned, "default", *s),
            find(&plain, "draft", *s),
            find(&tuned, "draft", *s),
        ) else {
            continue;
        };
        let (default, draft) = (d0.max(d1), f0.max(f1));
        println!(
            "  {s}x{s}: default {d0:.0} (malloc-tuned {d1:.0}) -> ratio {:.2}; draft {draft:.0} -> ratio {:.2}",
            r / default,
            r / draft
        );
    }
}

criterion_group!(benches, pipeline);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    compare();
}
