//! The loader's rows of the `data` group: the training thread's hand-off per batch, and
//! throughput with 1 and 2 worker threads (`ddp-data/benches/loader.rs`, no PyTorch side).

use std::process::Command;

use anyhow::Result;

use super::parse::{tagged, value_where};
use super::report::{Group, Row, Unit};
use super::runner::{say, Ctx};
use super::targets;

/// Runs the loader bench: training-thread hand-off per batch and throughput with 1 and 2
/// threads.
pub(super) fn loader(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-data", "loader")?;
    say("data: the loader (hand-off per batch, 1 and 2 threads)");
    let mut cmd = Command::new(&exe);
    cmd.args(["--batches", if ctx.quick { "6" } else { "16" }])
        .env("OMP_NUM_THREADS", "1");
    let out = ctx.capture("data-loader", cmd)?;
    let metric = |name: &str| value_where(tagged(&out, "loader"), &[("metric", name)], "value");
    let show = |v: Option<f64>, unit: Unit| v.map_or("-".to_string(), |x| unit.show(x));
    let mut rows = vec![Row::new(
        Group::Data,
        "loader hand-off per 64x224 batch, batch ready -> tensors on the CPU device",
        Unit::Seconds,
    )
    .pair(metric("handoff_f32_s"), None)
    .target(targets::LOADER_HANDOFF)
    .note(format!(
        "the previous copying hand-off {}; bytes converted on the training thread {}",
        show(metric("handoff_copying_s"), Unit::Seconds),
        show(metric("handoff_u8_convert_on_cpu_s"), Unit::Seconds)
    ))];
    for (storage, what) in [
        ("f32", "f32 batches (CPU path)"),
        ("u8", "byte batches (GPU path)"),
    ] {
        let one = metric(&format!("throughput_{storage}_1_threads"));
        let two = metric(&format!("throughput_{storage}_2_threads"));
        rows.push(
            Row::new(
                Group::Data,
                format!("loader throughput, 512-px JPEGs, {what}, 2 threads"),
                Unit::ImagesPerSec,
            )
            .pair(two, None)
            .note(format!("1 thread {}", show(one, Unit::ImagesPerSec))),
        );
        let mut scaling = Row::new(
            Group::Data,
            format!("loader scaling 2 threads / 1 thread, {what}"),
            Unit::Fraction,
        );
        if let (Some(a), Some(b)) = (one, two) {
            scaling = scaling.pair(Some(b / a), None);
        }
        rows.push(
            scaling
                .target(targets::LOADER_SCALING)
                .note("on an idle 2-core machine; other load lowers it"),
        );
    }
    Ok(rows)
}
