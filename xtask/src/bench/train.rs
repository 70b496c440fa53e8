//! The `train` and `ddp` groups: the ConvNet's training steps with 1 and 2 ranks on random
//! tensors and synthetic JPEGs, ours (`ddp-train/benches/ddp_steps.rs`) vs PyTorch DDP
//! (`reference_ddp.py`), and what DDP adds to our step outside backward, from our 2-rank run.
//!
//! Like with like: both sides' processes keep freed memory ([`MALLOC_KEEP`], the ddp-train
//! binary's setting; PyTorch with glibc's defaults is shown in the random tensors' notes),
//! and with JPEGs both decode in [`LOADERS`] background loader per rank (a thread for ours,
//! a `DataLoader` worker process for PyTorch's), each over one stream of the epochs' orders
//! back to back, so both decode ahead across an epoch's end.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use super::parse::{run_of, runs_by_world, Run};
use super::report::{Group, Row, Target, Unit};
use super::runner::{say, train_data, Ctx, MALLOC_KEEP};
use super::targets;

/// Images of each synthetic ODIR folder the training benchmark reads: 32 is one step of
/// batch 16 on each of 2 ranks. Both sides chain the epochs into one loader stream, so a
/// folder smaller than the run's steps still keeps the loaders decoding ahead.
const TRAIN_IMAGES: [(u32, usize); 2] = [(512, 64), (2048, 32)];

/// Background loaders per rank on both sides with JPEGs (`--workers`): our loader's threads,
/// PyTorch's `DataLoader` worker processes. Not our default (cores / ranks): PyTorch's
/// would be 0, decoding in series with the step, so the same number on both is the fair one.
const LOADERS: usize = 1;

/// The arguments of `ddp_steps` and `reference_ddp.py`: `ranks` (e.g. `1,2`), this run's
/// steps, batch 16 of 224 px, and the JPEG folder `data` with [`LOADERS`] background loaders
/// per rank (else random tensors).
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
        args.push("--workers".to_string());
        args.push(LOADERS.to_string());
    }
    args
}

/// The `ddp` group's rows from our 2-rank run, which overlaps the all-reduce with backward
/// (`DdpOptions::default()`, as the Trainer runs): what DDP adds to the step outside
/// backward, per phase. The all-reduce's cost during backward, and the copies of gradients
/// into the buckets made there, are in the compute time, not in these rows.
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
            "DDP time outside backward per step (buffer broadcast + sync_gradients), 2 ranks, \
             all-reduce overlapped with backward",
            Unit::Seconds,
        )
        .pair(Some(total), None)
        .note(format!(
            "{:.2}% of a {} step; PyTorch's DDP waits for its all-reduce inside backward, so \
             it has no separate figure",
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
            format!(
                "  sync_gradients after backward: wait for the {mb:.2} MB all-reduce left + \
                 copy back"
            ),
            Unit::Seconds,
        )
        .pair(Some(sync), None)
        .note("what overlapping with backward did not hide"),
    ];
    if let Some(a) = allreduce {
        rows.push(
            Row::new(
                Group::Ddp,
                format!("  all-reduce of {mb:.2} MB alone (flat tensor, after the steps)"),
                Unit::Seconds,
            )
            .pair(Some(a), None)
            .note("the communication a step's gradient sync holds, overlapped or not"),
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
    let [cmd, _] = commands(ctx, &exe, Path::new("-"), "2", None);
    let out = ctx.capture("ddp-ours", cmd)?;
    let runs = runs_by_world(&out, "ddp_steps");
    let run = run_of(&runs, 2).context("ddp_steps printed no 2-rank result")?;
    Ok(ddp_rows(run))
}

/// What one pair of training runs (ours, PyTorch's) feeds the ConvNet.
struct TrainSource {
    label: String,
    /// Names the log files.
    tag: String,
    data: Option<PathBuf>,
    target: Option<Target>,
}

/// Our and PyTorch's commands for `data` (random tensors when `None`) on `ranks` (e.g.
/// `1,2`): the same arguments and the same allocator settings ([`MALLOC_KEEP`]).
fn commands(
    ctx: &Ctx,
    exe: &Path,
    reference: &Path,
    ranks: &str,
    data: Option<&Path>,
) -> [Command; 2] {
    ctx.ours_and_reference(exe, reference, &steps_args(ctx, ranks, data))
}

/// `cmd` with glibc's default allocator settings, whatever the caller's environment holds.
fn with_glibc_defaults(mut cmd: Command) -> Command {
    for (name, _) in MALLOC_KEEP {
        cmd.env_remove(name);
    }
    cmd
}

/// Runs the `train` group, and the `ddp` group's rows too when `with_ddp`.
pub(super) fn train(ctx: &Ctx, with_ddp: bool) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-train", "ddp_steps")?;
    let reference = ctx.script("ddp-train", "reference_ddp.py")?;
    let mut sources = vec![TrainSource {
        label: "random tensors".to_string(),
        tag: "random".to_string(),
        data: None,
        target: Some(targets::TRAIN_RANDOM_TENSORS),
    }];
    for (size, count) in TRAIN_IMAGES {
        sources.push(TrainSource {
            label: format!(
                "{size}-px JPEGs, {LOADERS} loader/rank (ours a thread, PyTorch a DataLoader \
                 worker)"
            ),
            tag: format!("jpeg{size}"),
            data: Some(train_data(ctx, size, count)?),
            target: (size == 2048).then_some(targets::TRAIN_2048_JPEGS),
        });
    }
    let mut rows = Vec::new();
    for source in &sources {
        let (label, data) = (&source.label, source.data.as_deref());
        let [ours_cmd, theirs_cmd] = commands(ctx, &exe, &reference, "1,2", data);
        say(&format!(
            "train: ours, {label}, 1 and 2 ranks, {} + {} steps each",
            ctx.warmup, ctx.steps
        ));
        let ours_out = ctx.capture(&format!("train-ours-{}", source.tag), ours_cmd)?;
        say(&format!(
            "train: PyTorch DDP (Gloo), {label}, 1 and 2 ranks"
        ));
        let theirs_out = ctx.capture(&format!("train-pytorch-{}", source.tag), theirs_cmd)?;
        let ours = runs_by_world(&ours_out, "ddp_steps");
        let theirs = runs_by_world(&theirs_out, "reference_ddp");
        // What the allocator setting is worth to PyTorch: its random tensors with glibc's
        // defaults, shown in the notes.
        let glibc = match data {
            Some(_) => Vec::new(),
            None => {
                say("train: PyTorch DDP (Gloo), random tensors, glibc's default malloc");
                let [_, cmd] = commands(ctx, &exe, &reference, "1,2", None);
                let out = ctx.capture(
                    "train-pytorch-random-glibc-defaults",
                    with_glibc_defaults(cmd),
                )?;
                runs_by_world(&out, "reference_ddp")
            }
        };
        for world in [1usize, 2] {
            let (o, t) = (run_of(&ours, world), run_of(&theirs, world));
            let phases = |r: Option<&Run>| {
                r.map_or("-".to_string(), |r| {
                    format!(
                        "median step {:.2} s, of which data {:.2}, compute {:.2}",
                        r.rank0("step_median_s").unwrap_or(f64::NAN),
                        r.rank0("data_median_s").unwrap_or(f64::NAN),
                        r.rank0("compute_median_s").unwrap_or(f64::NAN)
                    )
                })
            };
            let mut note = format!(
                "both keep freed memory (MALLOC_MMAP_MAX_=0); ours: {}; PyTorch: {}",
                phases(o),
                phases(t)
            );
            if let Some(rate) = run_of(&glibc, world).and_then(|r| r.rank0("images_per_sec")) {
                note += &format!(
                    "; PyTorch with glibc's default malloc {}",
                    Unit::ImagesPerSec.show(rate)
                );
            }
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
            .note(note);
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
        rows.push(
            Row::new(
                Group::Train,
                format!("scaling efficiency 2 ranks / (2 x 1 rank), {label}"),
                Unit::Fraction,
            )
            .pair(efficiency(&ours), efficiency(&theirs))
            .target(targets::TRAIN_SCALING),
        );
        if data.is_none() && with_ddp {
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
    use super::super::runner::tests::{args, ctx, kept, malloc_env};
    use super::*;

    #[test]
    fn both_sides_train_alike_on_every_source() {
        let (exe, script) = (Path::new("/b/ddp_steps"), Path::new("/r/reference_ddp.py"));
        let jpegs = Path::new("/t/odir-2048px-32");
        for data in [None, Some(jpegs)] {
            let [ours, theirs] = commands(&ctx(), exe, script, "1,2", data);
            // The same arguments after the program's own (`--bench`; the script's path).
            assert_eq!(args(&ours)[1..], args(&theirs)[1..]);
            // The same allocator settings: the ddp-train binary's, on both sides.
            assert_eq!(malloc_env(&ours), kept());
            assert_eq!(malloc_env(&theirs), kept());
            let workers = args(&ours)
                .windows(2)
                .find(|w| w[0] == "--workers")
                .map(|w| w[1].clone());
            assert_eq!(workers, data.map(|_| "1".to_string()));
        }
        let [_, theirs] = commands(&ctx(), exe, script, "1,2", None);
        let glibc = malloc_env(&with_glibc_defaults(theirs));
        assert_eq!(
            glibc,
            [
                ("MALLOC_MMAP_MAX_".to_string(), None),
                ("MALLOC_TRIM_THRESHOLD_".to_string(), None)
            ]
        );
    }

    #[test]
    fn ddp_rows_show_what_ddp_adds_outside_backward() {
        let text = "RESULT ddp_steps source=random world=2 rank=0 step_median_s=2.0 \
            ddp_overhead_median_s=0.006 bcast_cost_median_s=0.004 sync_cost_median_s=0.002 \
            allreduce_median_s=0.0015 grad_bytes=1560000\n";
        let runs = runs_by_world(text, "ddp_steps");
        let rows = ddp_rows(run_of(&runs, 2).unwrap());
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[0].ours, Some(0.006));
        assert!(rows[0]
            .name
            .ends_with("all-reduce overlapped with backward"));
        assert!(rows[0].note.starts_with("0.30% of a 2.000 s step"));
        assert_eq!(
            rows[2].name,
            "  sync_gradients after backward: wait for the 1.56 MB all-reduce left + copy back"
        );
        assert_eq!(rows[2].ours, Some(0.002));
        assert_eq!(
            rows[3].name,
            "  all-reduce of 1.56 MB alone (flat tensor, after the steps)"
        );
        // The all-reduce overlaps backward: the sync's wait is no bucket-copy figure.
        assert!(rows.iter().all(|r| !r.note.contains("bucket cop")));
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
