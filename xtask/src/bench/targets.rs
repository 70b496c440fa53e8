//! Every pass/fail target of `cargo xtask bench`, in one table: its name, its value, what it
//! means and where it comes from. The groups name these constants; no group writes a target
//! as a number of its own. A target changes here, with its reason, or not at all.

use super::report::Target;

/// Defines each target as a `pub(super) const` [`Target`] documented with what it means and
/// where it comes from, and, for the tests, `ALL`: the table as data.
macro_rules! targets {
    ($($name:ident = $target:expr, $means:literal, $source:literal;)*) => {
        $(
            #[doc = $means]
            #[doc = ""]
            #[doc = concat!("From: ", $source, ".")]
            pub(super) const $name: Target = $target;
        )*
        /// `(name, target, what it means, where it comes from)` of every target.
        #[cfg(test)]
        const ALL: &[(&str, Target, &str, &str)] =
            &[$((stringify!($name), $name, $means, $source)),*];
    };
}

targets! {
    SAMPLER_VS_DISTRIBUTED_SAMPLER = Target::Ratio(5.0),
        "One epoch's indices of rank 0 of 8 (N = 10^6 and 10^7) at least 5x as fast as \
         PyTorch's `DistributedSampler`.",
        "the sampler's goal: shuffling a large data set must cost a trainer nothing";
    DECODE_VS_TORCHVISION = Target::Ratio(2.0),
        "Decode + RandomResizedCrop(224) + to-tensor on one thread, 512 and 2048 px, with \
         torchvision's pixels (full decode): at least 2x torchvision's images/s.",
        "ddp-data's goal for decoding (ddp-data/README.md, Speed)";
    DECODE_VS_PIL_DRAFT = Target::Ratio(1.3),
        "The same pipeline decoding JPEGs at a reduced size (`--dct-upsampling 2`: the crop's \
         region at a DCT scale chosen per crop): at least 1.3x torchvision's images/s with \
         PIL's `draft` (the whole image at a reduced scale).",
        "ddp-data's goal for decoding against PIL's reduced-size decode (ddp-data/README.md, Speed)";
    LOADER_HANDOFF = Target::OursAtMost(0.0005),
        "The training thread's hand-off of a ready 64x224 batch as tensors on the CPU \
         device: at most 0.5 ms.",
        "ddp-data's goal that the training thread never copies a batch (ddp-data/README.md, Speed)";
    LOADER_SCALING = Target::Ours(1.8),
        "The loader's throughput with 2 worker threads: at least 1.8x that with 1 thread \
         (on an idle 2-core machine).",
        "ddp-data's goal that loading scales with its threads (ddp-data/README.md, Speed)";
    ALLREDUCE_LATENCY = Target::Ratio(1.0),
        "All-reduce of 4 KiB between 2 ranks over shared memory: median latency no worse \
         than Gloo's.",
        "ddp-comm's goal for ranks on one host (ddp-comm/README.md, Benchmark)";
    ALLREDUCE_BANDWIDTH = Target::Ratio(2.0),
        "All-reduce between 2 ranks over shared memory, from 4 MiB up \
         ([`ALLREDUCE_BANDWIDTH_SIZES`]): at least 2x Gloo's bus bandwidth.",
        "ddp-comm's goal for ranks on one host (ddp-comm/README.md, Benchmark)";
    TRAIN_RANDOM_TENSORS = Target::Ratio(1.0),
        "ConvNet training on random tensors, 1 and 2 ranks: images/s at least PyTorch \
         DDP's.",
        "the trainer's goal: the same kernels as PyTorch, no slower around them";
    TRAIN_2048_JPEGS = Target::Ratio(1.15),
        "ConvNet training on 2048-px JPEGs, loading included, 1 and 2 ranks: images/s at \
         least 1.15x PyTorch DDP's with its DataLoader, one background loader per rank each.",
        "the trainer's goal: loading that never stalls the step";
    TRAIN_SCALING = Target::Ours(0.95),
        "Our training's scaling efficiency, 2 ranks / (2 x 1 rank), for every source: at \
         least 0.95.",
        "the trainer's goal: a second rank nearly doubles the images per second";
    TRAIN_RESNET50 = Target::Ratio(1.0),
        "torchvision's ResNet-50 (ddp-model's, the same function), batch 8 of 224 px per rank \
         on the CPU, 1 and 2 ranks: optimizer steps/s at least PyTorch DDP's.",
        "fine-tuning a pretrained backbone must cost no more than in PyTorch";
    OVERLAP_VS_DDP = Target::Ratio(1.3),
        "The communication-heavy MLP's step, overlapped, 2 ranks over shared memory and \
         over TCP: steps/s at least 1.3x PyTorch DDP's.",
        "the DDP engine's goal for communication-heavy steps (docs/engine.md, What overlap gains)";
    OVERLAP_CAPPED_VS_DDP = Target::Ratio(1.0),
        "The MLP's step, overlapped, over TCP with loopback capped at 1 Gbit/s: steps/s at \
         least PyTorch DDP's under the same cap.",
        "the DDP engine's goal under a slow network (docs/engine.md, What overlap gains)";
    OVERLAP_CAPPED_HIDDEN = Target::Ours(0.5),
        "Under the cap, overlapping hides at least half the communication: overlapped step \
         <= step not overlapped - 0.5 x communication.",
        "the DDP engine's goal under a slow network (docs/engine.md, What overlap gains)";
}

/// The all-reduce sizes that [`ALLREDUCE_BANDWIDTH`] applies to (labels of the collectives
/// bench's `RESULT all_reduce <size>` lines).
pub(super) const ALLREDUCE_BANDWIDTH_SIZES: [&str; 3] = ["4 MiB", "25 MiB", "64 MiB"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_target_has_a_unique_name_a_positive_value_and_its_reasons() {
        let mut names: Vec<&str> = ALL.iter().map(|t| t.0).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ALL.len(), "a name used twice");
        for (name, target, means, source) in ALL {
            let (Target::Ratio(v) | Target::Ours(v) | Target::OursAtMost(v)) = *target;
            assert!(v.is_finite() && v > 0.0, "{name}: {v}");
            assert!(means.ends_with('.') && !source.is_empty(), "{name}");
        }
    }

    #[test]
    fn the_table_holds_the_values_the_groups_compared_against() {
        // The numbers the groups wrote inline before this table existed.
        let values: Vec<(&str, Target)> = ALL.iter().map(|t| (t.0, t.1)).collect();
        assert_eq!(
            values,
            [
                ("SAMPLER_VS_DISTRIBUTED_SAMPLER", Target::Ratio(5.0)),
                ("DECODE_VS_TORCHVISION", Target::Ratio(2.0)),
                ("DECODE_VS_PIL_DRAFT", Target::Ratio(1.3)),
                ("LOADER_HANDOFF", Target::OursAtMost(0.0005)),
                ("LOADER_SCALING", Target::Ours(1.8)),
                ("ALLREDUCE_LATENCY", Target::Ratio(1.0)),
                ("ALLREDUCE_BANDWIDTH", Target::Ratio(2.0)),
                ("TRAIN_RANDOM_TENSORS", Target::Ratio(1.0)),
                ("TRAIN_2048_JPEGS", Target::Ratio(1.15)),
                ("TRAIN_SCALING", Target::Ours(0.95)),
                ("TRAIN_RESNET50", Target::Ratio(1.0)),
                ("OVERLAP_VS_DDP", Target::Ratio(1.3)),
                ("OVERLAP_CAPPED_VS_DDP", Target::Ratio(1.0)),
                ("OVERLAP_CAPPED_HIDDEN", Target::Ours(0.5)),
            ]
        );
    }
}
