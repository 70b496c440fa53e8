//! The `overlap` group: DDP steps of a communication-heavy MLP on 2 ranks, ours
//! (`ddp-train/benches/overlap.rs`: the all-reduce overlapped with backward, after it,
//! bf16-compressed) vs PyTorch DDP (`reference_overlap.py`), over shared memory, TCP, and
//! TCP capped at 1 Gbit/s (`netcap.rs`).

use std::path::Path;

use anyhow::{Context, Result};

use super::netcap::LoopbackCap;
use super::parse::overlap_value;
use super::report::{Group, Row, Unit};
use super::runner::{run_ranks, say, Ctx, MALLOC_KEEP};
use super::targets;

/// The communication-heavy step: 10 `Linear(2048, 2048)` layers (42 M parameters, 168 MB
/// of gradients) on a batch of 16 per rank.
const OVERLAP_MODEL: [&str; 6] = ["--layers", "10", "--width", "2048", "--batch", "16"];
/// The step under the bandwidth cap: 4 `Linear(1024, 1024)` layers (4.2 M parameters,
/// 16.8 MB of gradients: 0.27 s of all-reduce at 1 Gbit/s, since both ranks' traffic shares
/// loopback's one queue), with a batch large enough (1536) that backward takes about as
/// long, so that there is something to overlap with, and 4 MiB buckets on both sides (one
/// per layer): DDP's default 25 MiB would hold the whole model in one bucket, which nothing
/// can overlap.
const CAPPED_MODEL: [&str; 8] = [
    "--layers",
    "4",
    "--width",
    "1024",
    "--batch",
    "1536",
    "--bucket-cap-mb",
    "4",
];
/// Runs the group.
pub(super) fn overlap(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-train", "overlap")?;
    let reference = ctx.script("ddp-train", "reference_overlap.py")?;
    let mut rows = Vec::new();
    // PyTorch runs between our two transports, so that a change of load over the run does
    // not favour one side.
    let ours_shm = overlap_ours(ctx, &exe, &OVERLAP_MODEL, "auto", "overlap-ours-shm")?;
    say("overlap: PyTorch DDP (Gloo over loopback TCP), all-reduce and bf16_compress_hook");
    let theirs = overlap_pytorch(ctx, &reference, &OVERLAP_MODEL, "overlap-pytorch")?;
    let ours_tcp = overlap_ours(ctx, &exe, &OVERLAP_MODEL, "tcp", "overlap-ours-tcp")?;
    rows.extend(overlap_rows("shared memory", &ours_shm, &theirs, false));
    rows.extend(overlap_rows("TCP", &ours_tcp, &theirs, false));
    let capped = "TCP capped at 1 Gbit/s";
    match LoopbackCap::install() {
        Err(why) => rows.push(Row::skipped(
            Group::Overlap,
            &format!("{capped} (tc tbf on lo)"),
            Unit::StepsPerSec,
            why,
        )),
        Ok(cap) => {
            say(&format!(
                "overlap: ours and PyTorch DDP, {capped} (`tc qdisc show dev lo` while it runs)"
            ));
            let ours = overlap_ours(ctx, &exe, &CAPPED_MODEL, "tcp", "overlap-ours-capped");
            let theirs = ours
                .as_ref()
                .ok()
                .map(|_| overlap_pytorch(ctx, &reference, &CAPPED_MODEL, "overlap-pytorch-capped"));
            cap.remove()?;
            let (ours, theirs) = (ours?, theirs.context("not run")??);
            rows.extend(overlap_rows(capped, &ours, &theirs, true));
        }
    }
    Ok(rows)
}

/// Our 2 ranks over `transport` (`auto`: shared memory; `tcp`), every configuration; rank
/// 0's output.
fn overlap_ours(
    ctx: &Ctx,
    exe: &Path,
    model: &[&str],
    transport: &str,
    name: &str,
) -> Result<String> {
    say(&format!(
        "overlap: ours, 2 ranks, DDP_TRANSPORT={transport}, overlapped / not / bf16 taking \
         turns, {} + {} steps each",
        ctx.warmup, ctx.steps
    ));
    let mut args: Vec<String> = model.iter().map(|s| s.to_string()).collect();
    args.extend(overlap_steps(ctx));
    args.extend(["--configs".into(), "overlap,no-overlap,bf16".into()]);
    // Both sides keep freed memory (the ddp-train binary's setting): the comparison is DDP's.
    let mut env = vec![("DDP_TRANSPORT", transport)];
    env.extend(MALLOC_KEEP.iter().copied());
    let outs = run_ranks(ctx, name, exe, &args, 2, &env)?;
    Ok(outs.into_iter().next().unwrap_or_default())
}

/// PyTorch DDP's 2 ranks (Gloo), all-reduce and `bf16_compress_hook`; its output.
fn overlap_pytorch(ctx: &Ctx, reference: &Path, model: &[&str], name: &str) -> Result<String> {
    let mut cmd = ctx.python();
    cmd.arg(reference)
        .args(model)
        .args(overlap_steps(ctx))
        .args(["--ranks", "2", "--configs", "overlap,bf16"])
        .envs(MALLOC_KEEP.iter().copied());
    ctx.capture(name, cmd)
}

/// `--warmup` and `--steps` of this run.
fn overlap_steps(ctx: &Ctx) -> [String; 4] {
    [
        "--warmup".into(),
        ctx.warmup.to_string(),
        "--steps".into(),
        ctx.steps.to_string(),
    ]
}

/// The rows of one transport: ours overlapped, not overlapped and bf16-compressed next to
/// PyTorch DDP, and the share of the communication the overlap hides. `capped`: the
/// bandwidth-limited targets ([`targets::OVERLAP_CAPPED_VS_DDP`],
/// [`targets::OVERLAP_CAPPED_HIDDEN`]) instead of [`targets::OVERLAP_VS_DDP`].
fn overlap_rows(what: &str, ours: &str, theirs: &str, capped: bool) -> Vec<Row> {
    let o = |config: &str, key: &str| overlap_value(ours, "overlap", config, key);
    let t = |config: &str, key: &str| overlap_value(theirs, "reference_overlap", config, key);
    let s = |v: Option<f64>| v.map_or("-".to_string(), |x| Unit::Seconds.show(x));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}x", a / b),
        _ => "-".to_string(),
    };
    let model = match (o("overlap", "layers"), o("overlap", "width")) {
        (Some(l), Some(w)) => format!(
            "MLP {l}x Linear({w},{w}), {:.1}M params, batch {}/rank, {} MiB buckets",
            o("overlap", "parameters").unwrap_or(f64::NAN) / 1e6,
            o("overlap", "batch").unwrap_or(f64::NAN),
            o("overlap", "bucket_cap_mb").unwrap_or(f64::NAN)
        ),
        _ => "MLP".to_string(),
    };
    let (ov, noov) = (
        o("overlap", "step_median_s"),
        o("no-overlap", "step_median_s"),
    );
    let comm = o("no-overlap", "sync_cost_median_s");
    let hidden = match (ov, noov, comm) {
        (Some(a), Some(b), Some(c)) if c > 0.0 => Some((b - a) / c),
        _ => None,
    };
    let mut first = Row::new(
        Group::Overlap,
        format!("{model}, 2 ranks, {what}: ours overlapped vs PyTorch DDP"),
        Unit::StepsPerSec,
    )
    .pair(o("overlap", "steps_per_sec"), t("overlap", "steps_per_sec"))
    .target(if capped {
        targets::OVERLAP_CAPPED_VS_DDP
    } else {
        targets::OVERLAP_VS_DDP
    })
    .note(format!(
        "step: ours {} = fwd+bwd {} + wait in sync_gradients {} + SGD {}; PyTorch {} = \
         fwd+bwd with its all-reduce {} + SGD {}",
        s(ov),
        s(o("overlap", "compute_median_s")),
        s(o("overlap", "sync_median_s")),
        s(o("overlap", "optim_median_s")),
        s(t("overlap", "step_median_s")),
        s(t("overlap", "compute_median_s")),
        s(t("overlap", "optim_median_s")),
    ));
    if capped {
        first.note = format!("{}; target: ours >= PyTorch under the cap", first.note);
    }
    let mut share = Row::new(
        Group::Overlap,
        format!("  {what}: share of the communication that overlapping hides"),
        Unit::Fraction,
    )
    .pair(hidden, None)
    .note(format!(
        "(not overlapped {} - overlapped {}) / communication {} (sync_gradients after \
         backward, on the rank that waited least); the {:.1} MB all-reduce alone {}",
        s(noov),
        s(ov),
        s(comm),
        o("overlap", "grad_bytes").unwrap_or(f64::NAN) / 1e6,
        s(o("overlap", "allreduce_median_s")),
    ));
    if capped {
        share = share.target(targets::OVERLAP_CAPPED_HIDDEN);
    }
    vec![
        first,
        Row::new(
            Group::Overlap,
            format!("  {what}: ours not overlapped (overlap: false) vs PyTorch DDP"),
            Unit::StepsPerSec,
        )
        .pair(
            o("no-overlap", "steps_per_sec"),
            t("overlap", "steps_per_sec"),
        )
        .note(format!(
            "step {} = fwd+bwd {} + sync_gradients {} + SGD {}",
            s(noov),
            s(o("no-overlap", "compute_median_s")),
            s(o("no-overlap", "sync_median_s")),
            s(o("no-overlap", "optim_median_s")),
        )),
        share,
        Row::new(
            Group::Overlap,
            format!("  {what}: bf16_compress, ours overlapped vs PyTorch's bf16_compress_hook"),
            Unit::StepsPerSec,
        )
        .pair(o("bf16", "steps_per_sec"), t("bf16", "steps_per_sec"))
        .note(format!(
            "bf16 / plain all-reduce steps/s: ours {}, PyTorch {}; bf16 all-reduce alone {}",
            ratio(o("bf16", "steps_per_sec"), o("overlap", "steps_per_sec")),
            ratio(t("bf16", "steps_per_sec"), t("overlap", "steps_per_sec")),
            s(o("bf16", "allreduce_median_s")),
        )),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_rows_compare_configs_and_the_hidden_communication() {
        let ours = "RESULT overlap config=overlap transport=tcp world=2 rank=0 layers=4 \
            width=1024 batch=256 parameters=4198400 grad_bytes=16793600 bucket_cap_mb=4 \
            steps_per_sec=2.0 \
            step_median_s=0.5 compute_median_s=0.3 sync_median_s=0.15 optim_median_s=0.05 \
            allreduce_median_s=0.3\n\
            RESULT overlap config=overlap transport=tcp world=2 rank=1 steps_per_sec=9.0\n\
            RESULT overlap config=no-overlap transport=tcp world=2 rank=0 steps_per_sec=1.25 \
            step_median_s=0.8 compute_median_s=0.4 sync_median_s=0.35 \
            sync_cost_median_s=0.4 optim_median_s=0.05\n\
            RESULT overlap config=bf16 transport=tcp world=2 rank=0 steps_per_sec=3.0\n";
        let theirs = "RESULT reference_overlap config=overlap world=2 rank=0 \
            steps_per_sec=1.6 step_median_s=0.625\n\
            RESULT reference_overlap config=bf16 world=2 rank=0 steps_per_sec=2.4\n";
        let rows = overlap_rows("TCP capped", ours, theirs, true);
        assert_eq!(rows.len(), 4);
        assert!(rows[0]
            .name
            .starts_with("MLP 4x Linear(1024,1024), 4.2M params, batch 256/rank, 4 MiB buckets"));
        assert!((rows[0].ratio.unwrap() - 1.25).abs() < 1e-12);
        assert_eq!(rows[0].meets_target(), Some(true));
        assert!((rows[1].ratio.unwrap() - 1.25 / 1.6).abs() < 1e-12);
        // (0.8 - 0.5) / 0.4 of the communication hidden: more than half.
        assert!((rows[2].ours.unwrap() - 0.75).abs() < 1e-12);
        assert_eq!(rows[2].meets_target(), Some(true));
        assert!((rows[3].ratio.unwrap() - 1.25).abs() < 1e-12);
        assert!(rows[3].note.contains("ours 1.50x, PyTorch 1.50x"));
        // Uncapped: 1.3x PyTorch is the target, the hidden share is shown without one.
        let rows = overlap_rows("TCP", ours, theirs, false);
        assert_eq!(rows[0].meets_target(), Some(false));
        assert!(rows[2].target.is_none());
        // A side that printed nothing leaves its figures empty, not wrong.
        let rows = overlap_rows("TCP", ours, "", false);
        assert_eq!(rows[0].ratio, None);
    }
}
