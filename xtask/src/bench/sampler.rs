//! The `sampler` group: one epoch's indices of rank 0 of 8, ours (criterion) vs PyTorch's
//! `DistributedSampler`.

use anyhow::Result;

use super::parse::value_where;
use super::report::{Group, Row, Unit};
use super::runner::{say, Ctx};
use super::targets;

/// Runs the group.
pub(super) fn sampler(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-sampler", "sampler")?;
    say("sampler: ours (criterion)");
    ctx.criterion("sampler", &exe, &[])?;
    say("sampler: PyTorch DistributedSampler");
    let mut cmd = ctx.python();
    cmd.arg(ctx.script("ddp-sampler", "reference_sampler.py")?)
        .args(["--runs", if ctx.quick { "3" } else { "7" }]);
    let reference = ctx.capture("sampler-pytorch", cmd)?;
    let mut rows = Vec::new();
    for (n, label) in [(1_000_000usize, "10^6"), (10_000_000, "10^7")] {
        let ours = ctx.criterion_median(&format!("epoch_indices/shuffle_r8/{n}"))?;
        let theirs = value_where(reference.lines(), &[("n", &n.to_string())], "median_s");
        rows.push(
            Row::new(
                Group::Sampler,
                format!("one epoch's indices, N={label}, rank 0 of 8"),
                Unit::Seconds,
            )
            .pair(Some(ours), theirs)
            .target(targets::SAMPLER_VS_DISTRIBUTED_SAMPLER)
            .note("PyTorch: DistributedSampler(shuffle=True), list(iter(sampler))"),
        );
    }
    Ok(rows)
}
