//! The `resnet` group: training steps/s of torchvision's ResNet-50 (ddp-model's, the
//! `--model resnet50` of `ddp-train`) on the CPU, batch 8 of 224 px per rank, 1 and 2 ranks,
//! ours (`ddp-train/benches/ddp_steps.rs --model resnet50`) vs PyTorch DDP
//! (`reference_ddp.py --model resnet50`, `torchvision.models.resnet50`), random tensors;
//! both sides keep freed memory ([`MALLOC_KEEP`](super::runner::MALLOC_KEEP), the ddp-train
//! binary's setting).

use std::path::Path;
use std::process::Command;

use anyhow::Result;

use super::parse::{run_of, runs_by_world, Run};
use super::report::{Group, Row, Unit};
use super::runner::{say, Ctx};
use super::targets;

/// Samples per rank per step.
const BATCH: usize = 8;

fn args(ctx: &Ctx) -> Vec<String> {
    [
        "--ranks",
        "1,2",
        "--model",
        "resnet50",
        "--warmup",
        &ctx.warmup.to_string(),
        "--steps",
        &ctx.steps.to_string(),
        "--batch-size",
        &BATCH.to_string(),
        "--image-size",
        "224",
    ]
    .map(String::from)
    .to_vec()
}

/// Our and PyTorch's commands: the same arguments and allocator settings.
fn commands(ctx: &Ctx, exe: &Path, reference: &Path) -> [Command; 2] {
    ctx.ours_and_reference(exe, reference, &args(ctx))
}

/// Optimizer steps per second of a run on `world` ranks (every rank steps together).
fn steps_per_sec(run: &Run, world: usize) -> Option<f64> {
    Some(run.rank0("images_per_sec")? / (BATCH * world) as f64)
}

/// Runs the group.
pub(super) fn resnet(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-train", "ddp_steps")?;
    let reference = ctx.script("ddp-train", "reference_ddp.py")?;
    say(&format!(
        "resnet: ours, ResNet-50, 1 and 2 ranks, {} + {} steps each",
        ctx.warmup, ctx.steps
    ));
    let [ours_cmd, theirs_cmd] = commands(ctx, &exe, &reference);
    let ours = runs_by_world(&ctx.capture("resnet-ours", ours_cmd)?, "ddp_steps");
    say("resnet: PyTorch DDP (Gloo), torchvision's ResNet-50, 1 and 2 ranks");
    let theirs = runs_by_world(&ctx.capture("resnet-pytorch", theirs_cmd)?, "reference_ddp");
    let rows = [1usize, 2]
        .into_iter()
        .map(|world| {
            let (o, t) = (run_of(&ours, world), run_of(&theirs, world));
            let step = |r: Option<&Run>| {
                r.and_then(|r| r.rank0("step_median_s"))
                    .map_or("-".to_string(), |s| Unit::Seconds.show(s))
            };
            Row::new(
                Group::Resnet,
                format!(
                    "ResNet-50 224px, batch {BATCH}/rank, 1 thread/rank, random tensors, {world} \
                     rank{}",
                    if world > 1 { "s" } else { "" }
                ),
                Unit::StepsPerSec,
            )
            .pair(
                o.and_then(|r| steps_per_sec(r, world)),
                t.and_then(|r| steps_per_sec(r, world)),
            )
            .target(targets::TRAIN_RESNET50)
            .note(format!(
                "both keep freed memory (MALLOC_MMAP_MAX_=0); median step: ours {}, PyTorch {}",
                step(o),
                step(t)
            ))
        })
        .collect();
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::super::runner::tests::{args as args_of, ctx, kept, malloc_env};
    use super::*;

    #[test]
    fn both_sides_run_with_the_same_arguments_and_allocator() {
        let [ours, theirs] = commands(&ctx(), Path::new("/b/ddp_steps"), Path::new("/r/ref.py"));
        assert_eq!(args_of(&ours)[1..], args_of(&theirs)[1..]);
        assert_eq!(malloc_env(&ours), kept());
        assert_eq!(malloc_env(&theirs), kept());
    }

    #[test]
    fn steps_per_second_divide_the_images_by_every_ranks_batch() {
        let text = "RESULT ddp_steps world=2 rank=0 images_per_sec=32\n";
        let runs = runs_by_world(text, "ddp_steps");
        assert_eq!(steps_per_sec(run_of(&runs, 2).unwrap(), 2), Some(2.0));
    }
}
