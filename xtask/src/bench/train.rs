//! The `train` and `ddp` groups: the ConvNet's training steps with 1 and 2 ranks on random
//! tensors and synthetic JPEGs, ours (`ddp-train/benches/ddp_steps.rs`) vs PyTorch DDP
//! (`reference_ddp.py`), and DDP's own cost per step, phase by phase, from our 2-rank run.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use super::parse::{run_of, runs_by_world, Run};
use super::report::{Group, Row, Target, Unit};
use super::runner::{say, train_data, Ctx, MALLOC_KEEP};
use super::targets;

/// Images of each synthetic ODIR folder the training benchmark reads: 32 is one step of
/// batch 16 on each of 2 ranks.
const TRAIN_IMAGES: [(u32, usize); 2] = [(512, 64), (2048, 32)];

/// The arguments of `ddp_steps` and `reference_ddp.py`: `ranks` (e.g. `1,2`), this run's
/// steps, batch 16 of 224 px, and the JPEG folder `data` (else random tensors).
fn steps_args(ctx: &Ctx, ranks: &str, data: Option<&Path>) -> Vec<String> {
    let mut args = vec![
        "--ranks".to_string(),
        ranks.to_string(),
        "--warmup".to_string(),
        ctx.warmup.to_string(),
        "--steps".to_string(),
        ctx.steps.to_string(),
        "--batch-size".to_string(),
        "16".to_string(),
        "--image-size".to_string(),
        "224".to_string(),
    ];
    if let Some(d) = data {
        args.push("--data".to_string());
        args.push(d.display().to_string());
    }
    args
}

/// The `ddp` group's rows from our 2-rank run: the overhead per step and its phases.
fn ddp_rows(run: &Run) -> Vec<Row> {
    let Some((total, bcast, sync)) = run.ddp_overhead() else {
        return vec![Row::new(Group::Ddp, "(no per-phase times)", Unit::Seconds)];
    };
    let step = run.rank0("step_median_s").unwrap_or(f64::NAN);
    let allreduce = run.rank0("allreduce_median_s");
    let bytes = run.rank0("grad_bytes").unwrap_or(f64::NAN);
    let mb = bytes / 1e6;
    let mut rows = vec![
        Row::new(
            Group::Ddp,
            "DDP overhead per step (buffer broadcast + gradient sync), 2 ranks",
            Unit::Seconds,
        )
        .pair(Some(total), None)
        .note(format!(
            "{:.2}% of a {} step; PyTorch overlaps its all-reduce with backward, so it has no \
             separate figure",
            100.0 * total / step,
            Unit::Seconds.show(step)
        )),
        Row::new(
            Group::Ddp,
            "  buffer broadcast (BatchNorm statistics)",
            Unit::Seconds,
        )
        .pair(Some(bcast), None),
        Row::new(
            Group::Ddp,
            format!("  gradient sync: bucket copy + all-reduce {mb:.2} MB + copy back"),
            Unit::Seconds,
        )
        .pair(Some(sync), None),
    ];
    if let Some(a) = allreduce {
        rows.push(
            Row::new(
                Group::Ddp,
                format!("  all-reduce of {mb:.2} MB alone (flat tensor)"),
                Unit::Seconds,
            )
            .pair(Some(a), None)
            .note(format!(
                "so bucket copies take about {}",
                Unit::Seconds.show((sync - a).max(0.0))
            )),
        );
    }
    rows
}

/// `ddp` without `train`: one 2-rank run on random tensors.
pub(super) fn ddp_only(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-train", "ddp_steps")?;
    say(&format!(
        "ddp: ours, 2 ranks, random tensors, {} + {} steps",
        ctx.warmup, ctx.steps
    ));
    let mut cmd = Command::new(&exe);
    cmd.arg("--bench").args(steps_args(ctx, "2", None));
    let out = ctx.capture("ddp-ours", cmd)?;
    let runs = runs_by_world(&out, "ddp_steps");
    let run = run_of(&runs, 2).context("ddp_steps printed no 2-rank result")?;
    Ok(ddp_rows(run))
}

/// What one pair of training runs (ours, PyTorch's) feeds the ConvNet, and how.
struct TrainSource {
    label: String,
    /// Names the log files.
    tag: String,
    data: Option<PathBuf>,
    /// Extra environment of both sides' processes.
    env: &'static [(&'static str, &'static str)],
    target: Option<Target>,
}

/// Runs the `train` group, and the `ddp` group's rows too when `with_ddp`.
pub(super) fn train(ctx: &Ctx, with_ddp: bool) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-train", "ddp_steps")?;
    let reference = ctx.script("ddp-train", "reference_ddp.py")?;
    let mut sources = vec![TrainSource {
        label: "random tensors".to_string(),
        tag: "random".to_string(),
        data: None,
        env: &[],
        target: Some(targets::TRAIN_RANDOM_TENSORS),
    }];
    for (size, count) in TRAIN_IMAGES {
        sources.push(TrainSource {
            label: format!("{size}-px JPEGs"),
            tag: format!("jpeg{size}"),
            data: Some(train_data(ctx, size, count)?),
            env: &[],
            target: (size == 2048).then_some(targets::TRAIN_2048_JPEGS),
        });
    }
    // Not the product's default: shows what the allocator costs both sides.
    sources.push(TrainSource {
        label: "random tensors, MALLOC_MMAP_MAX_=0".to_string(),
        tag: "random-malloc-kept".to_string(),
        data: None,
        env: MALLOC_KEEP,
        target: None,
    });
    let mut rows = Vec::new();
    for source in &sources {
        let (label, data) = (&source.label, source.data.as_deref());
        say(&format!(
            "train: ours, {label}, 1 and 2 ranks, {} + {} steps each",
            ctx.warmup, ctx.steps
        ));
        let mut cmd = Command::new(&exe);
        cmd.arg("--bench")
            .args(steps_args(ctx, "1,2", data))
            .envs(source.env.iter().copied());
        let ours_out = ctx.capture(&format!("train-ours-{}", source.tag), cmd)?;
        say(&format!(
            "train: PyTorch DDP (Gloo), {label}, 1 and 2 ranks"
        ));
        let mut cmd = ctx.python();
        cmd.arg(&reference)
            .args(steps_args(ctx, "1,2", data))
            .envs(source.env.iter().copied());
        let theirs_out = ctx.capture(&format!("train-pytorch-{}", source.tag), cmd)?;
        let ours = runs_by_world(&ours_out, "ddp_steps");
        let theirs = runs_by_world(&theirs_out, "reference_ddp");
        for world in [1usize, 2] {
            let (o, t) = (run_of(&ours, world), run_of(&theirs, world));
            let phases = |r: Option<&Run>| {
                r.map_or("-".to_string(), |r| {
                    format!(
                        "step {:.2} s = data {:.2} + compute {:.2}",
                        r.rank0("step_median_s").unwrap_or(f64::NAN),
                        r.rank0("data_median_s").unwrap_or(f64::NAN),
                        r.rank0("compute_median_s").unwrap_or(f64::NAN)
                    )
                })
            };
            let mut row = Row::new(
                Group::Train,
                format!(
                    "ConvNet 224px, batch 16/rank, 1 thread/rank, {label}, {world} rank{}",
                    if world > 1 { "s" } else { "" }
                ),
                Unit::ImagesPerSec,
            )
            .pair(
                o.and_then(|r| r.rank0("images_per_sec")),
                t.and_then(|r| r.rank0("images_per_sec")),
            )
            .note(format!("ours: {}; PyTorch: {}", phases(o), phases(t)));
            if let Some(target) = source.target {
                row = row.target(target);
            }
            rows.push(row);
        }
        let efficiency = |runs: &[(usize, Run)]| {
            let one = run_of(runs, 1)?.rank0("images_per_sec")?;
            let two = run_of(runs, 2)?.rank0("images_per_sec")?;
            Some(two / (2.0 * one))
        };
        let mut row = Row::new(
            Group::Train,
            format!("scaling efficiency 2 ranks / (2 x 1 rank), {label}"),
            Unit::Fraction,
        )
        .pair(efficiency(&ours), efficiency(&theirs));
        if source.env.is_empty() {
            row = row.target(targets::TRAIN_SCALING);
        }
        rows.push(row);
        if data.is_none() && source.env.is_empty() && with_ddp {
            if let Some(run) = run_of(&ours, 2) {
                rows.extend(ddp_rows(run));
            }
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::super::parse::runs_by_world;
    use super::*;

    #[test]
    fn ddp_rows_show_the_overhead_and_its_phases() {
        let text = "RESULT ddp_steps source=random world=2 rank=0 step_median_s=2.0 \
            ddp_overhead_median_s=0.006 bcast_cost_median_s=0.004 sync_cost_median_s=0.002 \
            allreduce_median_s=0.0015 grad_bytes=1560000\n";
        let runs = runs_by_world(text, "ddp_steps");
        let rows = ddp_rows(run_of(&runs, 2).unwrap());
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[0].ours, Some(0.006));
        assert!(rows[0].note.starts_with("0.30% of a 2.000 s step"));
        assert_eq!(rows[3].name, "  all-reduce of 1.56 MB alone (flat tensor)");
        assert_eq!(rows[3].note, "so bucket copies take about 500.0 us");
        let bare = runs_by_world(
            "RESULT ddp_steps world=2 rank=0 step_median_s=2\n",
            "ddp_steps",
        );
        assert_eq!(
            ddp_rows(run_of(&bare, 2).unwrap())[0].name,
            "(no per-phase times)"
        );
    }
}
