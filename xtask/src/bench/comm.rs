//! The `comm` group: all-reduce, all-gather and broadcast between 2 ranks over shared memory
//! and over TCP (`ddp-comm/benches/collectives.rs`), vs Gloo (`reference_gloo.py`).

use anyhow::{bail, Result};

use super::parse::result_lines;
use super::report::{Group, Row, Unit};
use super::runner::{run_ranks, say, Ctx};
use super::targets;

/// Runs the group.
pub(super) fn comm(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-comm", "collectives")?;
    let world = 2;
    let mut ours = Vec::new();
    for (transport, what) in [("auto", "shared memory"), ("tcp", "TCP")] {
        say(&format!("comm: ours, 2 ranks on this machine over {what}"));
        let mut args = vec!["--bench".to_string()];
        if ctx.quick {
            args.push("--quick".to_string());
        }
        args.extend(["--transport".to_string(), transport.to_string()]);
        // The bench's own rank protocol: the ranks are this binary with DDP_BENCH_WORKER
        // set; rank 0 prints the RESULT lines.
        let name = format!("comm-{transport}");
        let outs = run_ranks(ctx, &name, &exe, &args, world, &[("DDP_BENCH_WORKER", "1")])?;
        let lines = result_lines(&outs[0]);
        if lines.is_empty() {
            bail!(
                "the collectives bench printed no RESULT line (see {})",
                ctx.dir.join(format!("logs/{name}/rank-0.out")).display()
            );
        }
        ours.push((what, lines));
    }
    say("comm: PyTorch Gloo, 2 ranks");
    let mut cmd = ctx.python();
    cmd.arg(ctx.script("ddp-comm", "reference_gloo.py")?).args([
        "--ranks",
        &world.to_string(),
        "--scale",
        if ctx.quick { "0.1" } else { "1.0" },
    ]);
    let gloo = result_lines(&ctx.capture("comm-gloo", cmd)?);
    let mut rows = Vec::new();
    for (what, lines) in &ours {
        rows.extend(comm_rows(what, lines, &gloo, *what == "shared memory"));
    }
    Ok(rows)
}

/// Table rows for one transport's RESULT lines next to Gloo's. `targets`: the goals
/// ([`targets::ALLREDUCE_BANDWIDTH`] from 4 MiB up, [`targets::ALLREDUCE_LATENCY`] at 4 KiB)
/// apply to this transport; the other one is shown for comparison.
fn comm_rows(
    what: &str,
    ours: &[(String, f64, f64)],
    gloo: &[(String, f64, f64)],
    targets: bool,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for (label, secs, value) in ours {
        let theirs = gloo.iter().find(|(l, _, _)| l == label);
        let median_note = || {
            format!(
                "median call {} ours, {} Gloo (loopback TCP: Gloo has no shared memory)",
                Unit::Seconds.show(*secs),
                theirs.map_or("-".to_string(), |t| Unit::Seconds.show(t.1))
            )
        };
        if let Some(size) = label.strip_prefix("all_reduce ") {
            // `ReduceOp::Avg` rows ("<size> Avg") have no Gloo line and no target.
            let (size, op) = size
                .strip_suffix(" Avg")
                .map_or((size, ""), |s| (s, " Avg"));
            let big = op.is_empty() && targets::ALLREDUCE_BANDWIDTH_SIZES.contains(&size);
            if size == "4 KiB" {
                let mut row = Row::new(
                    Group::Comm,
                    format!("all-reduce {size} f32, 2 ranks, {what}: median latency"),
                    Unit::Seconds,
                )
                .pair(Some(*secs), theirs.map(|t| t.1))
                .note("vs Gloo over loopback TCP; ratio = Gloo time / ours");
                if targets {
                    row = row.target(targets::ALLREDUCE_LATENCY);
                }
                rows.push(row);
            } else {
                let mut row = Row::new(
                    Group::Comm,
                    format!("all-reduce {size} f32{op}, 2 ranks, {what}: bus bandwidth"),
                    Unit::GigabytesPerSec,
                )
                .pair(Some(*value), theirs.map(|t| t.2))
                .note(median_note());
                if big && targets {
                    row = row.target(targets::ALLREDUCE_BANDWIDTH);
                }
                rows.push(row);
            }
        } else if let Some(size) = label.strip_prefix("all_gather ") {
            rows.push(
                Row::new(
                    Group::Comm,
                    format!("all-gather {size} per rank, 2 ranks, {what}: bus bandwidth"),
                    Unit::GigabytesPerSec,
                )
                .pair(Some(*value), theirs.map(|t| t.2))
                .note(median_note()),
            );
        } else {
            rows.push(
                Row::new(
                    Group::Comm,
                    format!("{label}: ConvNet parameters (1.56 MB), 2 ranks, {what}"),
                    Unit::Seconds,
                )
                .pair(Some(*secs), theirs.map(|t| t.1))
                .note("median per broadcast, vs Gloo over loopback TCP"),
            );
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comm_rows_put_targets_on_the_chosen_transport_only() {
        let ours = vec![
            ("all_reduce 4 KiB".to_string(), 10e-6, 0.5),
            ("all_reduce 64 MiB".to_string(), 0.02, 3.3),
            ("all_reduce 64 MiB Avg".to_string(), 0.021, 3.2),
            ("all_gather 4 MiB".to_string(), 0.003, 1.4),
            ("broadcast flat".to_string(), 0.0004, 1.56e6),
        ];
        let gloo = vec![
            ("all_reduce 4 KiB".to_string(), 600e-6, 0.01),
            ("all_reduce 64 MiB".to_string(), 0.05, 1.1),
        ];
        let shm = comm_rows("shared memory", &ours, &gloo, true);
        assert_eq!(shm.len(), 5);
        assert_eq!(
            shm[1].name,
            "all-reduce 64 MiB f32, 2 ranks, shared memory: bus bandwidth"
        );
        assert!((shm[1].ratio.unwrap() - 3.0).abs() < 1e-9);
        assert_eq!(shm[1].meets_target(), Some(true));
        assert!((shm[0].ratio.unwrap() - 60.0).abs() < 1e-9);
        assert_eq!(
            shm[2].name,
            "all-reduce 64 MiB f32 Avg, 2 ranks, shared memory: bus bandwidth"
        );
        assert_eq!((shm[2].ratio, shm[2].target.is_none()), (None, true));
        assert_eq!(shm[3].ratio, None, "no Gloo all-gather line, no ratio");
        let tcp = comm_rows("TCP", &ours, &gloo, false);
        assert!(tcp.iter().all(|r| r.target.is_none()));
        assert!(tcp[4].name.ends_with("2 ranks, TCP"));
    }
}
