//! Decode + RandomResizedCrop(224, scale=(0.2, 1.0)) + ToTensor, one thread, on ODIR-like
//! JPEGs of 512x512 and 2048x2048, and the same work through torchvision for the ratio: by
//! default (full decode, torchvision's pixels) against torchvision's, and with reduced-scale
//! decoding (`with_dct_upsampling(2.0)`, `-reduced`) against torchvision with PIL's `draft`.
//!
//! `cargo bench -p ddp-data --bench pipeline` writes the images to
//! `target/ddp-data-bench/`, measures this crate with criterion, then runs
//! `benches/reference_pipeline.py` with the project's Python (`.deps/venv/bin/python`, or
//! `DDP_BENCH_PYTHON`) when torchvision is installed there, and prints img/s and ratios.
//! The comparison counts images per CPU-second of the working thread on both sides, so other
//! processes on a shared machine disturb it less than wall-clock rates; ours are printed as
//! `RESULT pipeline size=512 decode=full img_per_cpu_s=...` lines (`decode=reduced` too),
//! which `cargo xtask bench` reads (criterion's figures are wall-clock, for baselines).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use criterion::{criterion_group, Criterion, Throughput};
use ddp_data::odir::transform::{Pipeline, Transform};
use ddp_data::rng::SampleRng;

mod common;

use common::{images as write_images, thread_cpu_seconds};

const SIZES: [u32; 2] = [512, 2048];
const IMAGES_PER_SIZE: usize = 4;

fn images(size: u32) -> Vec<PathBuf> {
    write_images(size, IMAGES_PER_SIZE)
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
        Self::with(paths, Transform::train(224))
    }

    fn with(paths: Vec<PathBuf>, transform: Transform) -> Self {
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

/// Images per CPU-second of the whole pipeline on one thread, over about `seconds` of CPU.
fn rate(paths: Vec<PathBuf>, seconds: f64) -> f64 {
    rate_with(paths, Transform::train(224), seconds)
}

fn rate_with(paths: Vec<PathBuf>, transform: Transform, seconds: f64) -> f64 {
    let mut runner = Runner::with(paths, transform);
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
        let mut runner = Runner::with(images(size), reduced());
        group.bench_function(format!("{size}x{size}-reduced"), |b| {
            b.iter(|| runner.step())
        });
    }
    group.finish();
}

/// The benched transform with reduced-scale JPEG decoding as PIL's `draft` does it.
fn reduced() -> Transform {
    Transform::train(224)
        .with_dct_upsampling(2.0)
        .expect("a valid factor")
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
    let ours: Vec<(u32, f64, f64)> = SIZES
        .iter()
        .map(|&s| {
            (
                s,
                rate(images(s), 3.0),
                rate_with(images(s), reduced(), 3.0),
            )
        })
        .collect();
    println!("\nimages per CPU-second of one thread, decode + RandomResizedCrop(224) + ToTensor");
    println!("ddp-data (full decode; reduced-scale decoding):");
    for (s, r, q) in &ours {
        println!("  {s}x{s}: {r:.0} img/s; reduced {q:.0} img/s");
    }
    for (s, r, q) in &ours {
        println!("RESULT pipeline size={s} decode=full img_per_cpu_s={r:.2}");
        println!("RESULT pipeline size={s} decode=reduced img_per_cpu_s={q:.2}");
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
    for (s, r, q) in &ours {
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
            "  {s}x{s}: default {d0:.0} (malloc-tuned {d1:.0}) -> ratio {:.2}; draft {draft:.0} -> reduced's ratio {:.2}",
            r / default,
            q / draft
        );
    }
}

/// Mean and 99th-percentile absolute difference (in 0-255 steps) between `transform`'s output
/// and the same crops from a full-size decode (`full`), over `crops` draws per image.
fn difference(
    paths: &[PathBuf],
    transform: Transform,
    full_t: Transform,
    crops: u64,
) -> (f64, f64) {
    let mut reduced = Pipeline::new();
    let mut full = Pipeline::new();
    let (mut a, mut b) = (
        vec![0u8; transform.sample_len()],
        vec![0u8; transform.sample_len()],
    );
    let mut diffs: Vec<u8> = Vec::new();
    for path in paths {
        for n in 0..crops {
            let mut rng = SampleRng::new(3, 0, n);
            reduced
                .run_u8(&transform, path, &mut rng, &mut a)
                .expect("decode");
            let mut rng = SampleRng::new(3, 0, n);
            full.run_u8(&full_t, path, &mut rng, &mut b)
                .expect("decode");
            diffs.extend(a.iter().zip(&b).map(|(x, y)| x.abs_diff(*y)));
        }
    }
    let mean = diffs.iter().map(|&d| f64::from(d)).sum::<f64>() / diffs.len() as f64;
    diffs.sort_unstable();
    (mean, f64::from(diffs[diffs.len() * 99 / 100]))
}

/// The reduced-scale decoding rule: speed and pixel difference from a full decode for each
/// allowed enlargement after a 1/2, 1/4 or 1/8 decode.
fn upsampling_study() {
    println!("\nreduced-scale JPEG decoding: enlargement allowed after the DCT scale-down");
    println!(
        "(img/s per CPU-second of one thread; |difference| from a full decode in 0-255 steps)"
    );
    let sets: [(&str, Vec<PathBuf>); 3] = [
        ("fundus 512", images(512)),
        ("fundus 2048", images(2048)),
        ("photo-like 2048", vec![common::photo_like(2048)]),
    ];
    for (name, paths) in &sets {
        for factor in [1.0, 1.25, 1.5, 2.0] {
            let t = Transform::train(224)
                .with_dct_upsampling(factor)
                .expect("valid factor");
            let speed = rate_with(paths.clone(), t, 1.5);
            let (mean, p99) = difference(paths, t, Transform::train(224), 24);
            println!(
                "RESULT dct kind={} factor={factor} img_per_s={speed:.1} mean_abs={mean:.3} p99_abs={p99}",
                name.replace(' ', "_")
            );
        }
    }
}

criterion_group!(benches, pipeline);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    compare();
    upsampling_study();
}
