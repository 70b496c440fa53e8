//! The `data` group: decode + crop + resize + to-tensor on one thread, ours vs torchvision
//! with and without PIL's `draft`, each with glibc's default and raised malloc thresholds, in
//! images per CPU-second of the working thread on both sides (the pipeline bench's `RESULT
//! pipeline` lines, `reference_pipeline.py`'s `time.thread_time`); then the loader's rows
//! (`loader.rs`).

use std::fs;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::loader::loader;
use super::parse::{pipeline_ours, pipeline_rate};
use super::report::{Group, Row, Unit};
use super::runner::{say, Ctx};
use super::targets;

/// Runs the group.
pub(super) fn data(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-data", "pipeline")?;
    say("data: ours (1 thread)");
    // The bench would also run torchvision when it finds a Python; here xtask runs it, once
    // per malloc setting, so the bench is pointed at none.
    let ours_out = ctx.criterion(
        "data",
        &exe,
        &[(
            "DDP_BENCH_PYTHON",
            "/nonexistent/xtask-runs-torchvision-itself",
        )],
    )?;
    let images_dir = ctx.root.join("target").join("ddp-data-bench");
    let mut images: Vec<PathBuf> = fs::read_dir(&images_dir)
        .with_context(|| format!("the data bench wrote no images in {}", images_dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("odir_like_") && n.ends_with(".jpg"))
        })
        .collect();
    images.sort();
    if images.is_empty() {
        bail!("no odir_like_*.jpg images in {}", images_dir.display());
    }
    let pipeline = ctx.script("ddp-data", "reference_pipeline.py")?;
    let mut runs = Vec::new();
    for (tuned, label) in [(false, "default"), (true, "malloc-tuned")] {
        say(&format!("data: torchvision, {label} malloc"));
        let mut cmd = ctx.python();
        cmd.arg(&pipeline).args(&images);
        if tuned {
            // Keeps glibc from returning the large decode buffers to the OS every image.
            cmd.env("MALLOC_MMAP_THRESHOLD_", "268435456")
                .env("MALLOC_TRIM_THRESHOLD_", "268435456");
        }
        let out = ctx.capture(&format!("data-torchvision-{label}"), cmd)?;
        runs.push(out);
    }
    let mut rows = Vec::new();
    for size in [512u32, 2048] {
        let ours_rate = |decode: &str| {
            pipeline_ours(&ours_out, decode, size).with_context(|| {
                format!(
                    "the pipeline bench printed no `RESULT pipeline` line for {size} px, \
                     {decode} decode"
                )
            })
        };
        let (ours, reduced) = (Some(ours_rate("full")?), Some(ours_rate("reduced")?));
        let (d0, d1) = (
            pipeline_rate(&runs[0], "default", size),
            pipeline_rate(&runs[1], "default", size),
        );
        let (f0, f1) = (
            pipeline_rate(&runs[0], "draft", size),
            pipeline_rate(&runs[1], "draft", size),
        );
        let best = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
        let show = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.0}"));
        rows.push(
            Row::new(
                Group::Data,
                format!(
                    "decode+crop+resize+to-tensor {size}px, 1 thread, per CPU-second, vs \
                     torchvision"
                ),
                Unit::ImagesPerSec,
            )
            .pair(ours, best(d0, d1))
            .target(targets::DECODE_VS_TORCHVISION)
            .note(format!(
                "images per CPU-second of the working thread on both sides; torchvision \
                 default {} img/s, with raised malloc thresholds {}",
                show(d0),
                show(d1)
            )),
        );
        rows.push(
            Row::new(
                Group::Data,
                format!(
                    "decode+crop+resize+to-tensor {size}px, 1 thread, per CPU-second, \
                     --dct-upsampling 2 vs PIL draft"
                ),
                Unit::ImagesPerSec,
            )
            .pair(reduced, best(f0, f1))
            .target(targets::DECODE_VS_PIL_DRAFT)
            .note(format!(
                "ours decoding at reduced JPEG scale; torchvision + PIL draft {} img/s, with \
                 raised malloc thresholds {}",
                show(f0),
                show(f1)
            )),
        );
    }
    rows.extend(loader(ctx)?);
    Ok(rows)
}
