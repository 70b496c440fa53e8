//! The ranks and batches a run trains on, as its checkpoints record them, and how an epoch
//! stopped inside continues on another allocation.
//!
//! Every rank reads positions `r, r + R, ...` of the epoch's padded order and each step takes
//! `batch × accumulate` of them per rank, so after `s` steps the job has read exactly the
//! first `s × R × batch × accumulate` positions, a prefix, whatever `R` was. A checkpoint
//! inside an epoch records that count (`consumed`) and where the epoch ends (`end`, a whole
//! number of the starting allocation's steps); the resumed run deals positions
//! `consumed..end` over its own ranks ([`ddp_sampler::DistributedSampler::remaining_until`]).
//!
//! - Same global batch (`R × batch × accumulate`): the rest takes the same steps, each of the
//!   same positions, so the epoch continues as if uninterrupted (later epochs have the new
//!   allocation's steps per epoch, which may differ: ranks' shares are padded per rank).
//! - Another global batch: the rest takes `ceil((end - consumed) / G')` steps of the new
//!   global batch `G'`; the last one is filled from the positions after `end` (the padded
//!   order repeats from its start, as `DistributedSampler` pads). The learning rate is not
//!   changed.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The ranks and batches of a run: what a checkpoint records and a resume compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// Ranks.
    pub world_size: usize,
    /// Samples per rank per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step (gradient accumulation).
    pub accumulate: usize,
}

impl Allocation {
    /// Samples of one optimizer step, all ranks together (`usize::MAX` when more).
    pub fn global_batch(&self) -> usize {
        self.world_size
            .saturating_mul(self.batch_size)
            .saturating_mul(self.accumulate)
    }

    /// Optimizer steps of an epoch of `dataset_len` samples on this allocation (every rank
    /// gets `ceil(dataset_len / world_size)` samples and trains whole steps of them), at
    /// most `max_steps`; none when a rank's step is empty or more than `usize::MAX`
    /// samples.
    pub fn steps_per_epoch(&self, dataset_len: usize, max_steps: Option<usize>) -> usize {
        let shard = dataset_len.div_ceil(self.world_size.max(1));
        let whole = self
            .batch_size
            .checked_mul(self.accumulate)
            .and_then(|step| shard.checked_div(step))
            .unwrap_or(0);
        max_steps.map_or(whole, |m| m.min(whole))
    }

    /// Whether `max_steps` cuts this allocation's epochs of `dataset_len` samples short:
    /// there an epoch is so many steps whatever the global batch, and per-step schedules
    /// count steps, not samples ([`Plan`]).
    pub fn cap_binds(&self, dataset_len: usize, max_steps: Option<usize>) -> bool {
        self.steps_per_epoch(dataset_len, max_steps) < self.steps_per_epoch(dataset_len, None)
    }
}

impl std::fmt::Display for Allocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} rank(s) x batch {} x accumulate {} (global batch {})",
            self.world_size,
            self.batch_size,
            self.accumulate,
            self.global_batch()
        )
    }
}

/// The run's planned length, recorded when it starts: per-step schedules run over
/// `optimizer_steps` steps of `global_batch` samples. A step of another global batch (after a
/// resume on another allocation) advances them by its share, `G' / global_batch`, so that the
/// curve follows the samples trained and ends where the planned samples do; but under a
/// `max_steps_per_epoch` that binds, by one step. A resume for another number of epochs
/// plans again ([`Plan::steps_from`]), in steps of its allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The epochs the run was started (or last resumed) for.
    pub epochs: u64,
    /// `epochs` × the starting allocation's steps per epoch; after a resume for other
    /// epochs, the steps taken then plus the rest on the resumed allocation.
    pub optimizer_steps: u64,
    /// The global batch of those steps; `None` in checkpoints written before it was
    /// recorded (the allocation resumed on is taken: such a plan counts whole steps, as its
    /// run did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_batch: Option<usize>,
}

impl Plan {
    /// The optimizer steps of a run of `epochs` epochs from where it stands: `taken` steps
    /// attempted (on whatever allocations) in its first `begun` epochs, the last of which has
    /// `left` steps still to take, then `steps_per_epoch` in each later epoch. A fresh run
    /// stands at `(0, 0, 0)`. Saturates.
    pub fn steps_from(
        epochs: u64,
        steps_per_epoch: usize,
        (taken, begun, left): (u64, u64, usize),
    ) -> u64 {
        let later = epochs.saturating_sub(begun);
        later
            .saturating_mul(steps_per_epoch as u64)
            .saturating_add(taken)
            .saturating_add(left as u64)
    }
}

/// Where an epoch continues: what its steps so far consumed, where it ends, and on which
/// allocation it was trained so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochRest {
    /// The epoch's optimizer steps done.
    pub first_step: usize,
    /// Positions of the epoch's order consumed (the first `consumed`).
    pub consumed: usize,
    /// Where the epoch ends, in positions of its order.
    pub end: usize,
    /// The allocation that trained it so far, when it differs from the current one.
    pub changed_from: Option<Allocation>,
}

impl EpochRest {
    /// A fresh epoch of `steps` steps on `now`.
    pub fn fresh(steps: usize, now: Allocation) -> EpochRest {
        EpochRest {
            first_step: 0,
            consumed: 0,
            end: steps * now.global_batch(),
            changed_from: None,
        }
    }

    /// The steps left on `now`, at most `max_steps` in the whole epoch: exact when the global
    /// batch is unchanged, else rounded up (the last step is filled by padding).
    pub fn steps_left(&self, now: Allocation, max_steps: Option<usize>) -> usize {
        let left = self
            .end
            .saturating_sub(self.consumed)
            .div_ceil(now.global_batch());
        max_steps.map_or(left, |m| left.min(m.saturating_sub(self.first_step)))
    }
}

/// What a checkpoint inside an epoch says about where it is (its `Position`'s fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Saved {
    /// The allocation the checkpoint was written on (`None` before checkpoints recorded it).
    pub allocation: Option<Allocation>,
    /// The epoch's optimizer steps done.
    pub step: usize,
    /// Samples trained in the epoch, all ranks together.
    pub samples: usize,
    /// Positions consumed (`None` in old checkpoints).
    pub consumed: Option<usize>,
    /// Where the epoch ends (`None` in old checkpoints).
    pub end: Option<usize>,
    /// The per-rank batch and accumulation in the checkpoint's settings, for old checkpoints
    /// (both positive).
    pub old_batch: Option<(usize, usize)>,
}

/// How the epoch of a checkpoint taken inside it continues on `now`, whose epochs have
/// `steps_now` steps; an error (a sentence) when the checkpoint cannot tell.
///
/// A checkpoint without the allocation fields continues only on the allocation it was
/// written on: its global batch is `samples / step`, and its per-rank batch and accumulation
/// are in its settings.
pub fn continue_epoch(
    saved: Saved,
    now: Allocation,
    steps_now: usize,
) -> Result<EpochRest, String> {
    // Nothing trained yet (a stop taken before the epoch's first step): the epoch starts
    // afresh on any allocation, with its own length.
    if saved.step == 0 {
        return Ok(EpochRest::fresh(steps_now, now));
    }
    if let (Some(before), Some(consumed), Some(end)) = (saved.allocation, saved.consumed, saved.end)
    {
        // (After an earlier change of allocation inside this epoch, `consumed` is not
        // `step` times one global batch.) At `end`, a stop in the epoch's evaluation: no step
        // is left, the epoch is evaluated.
        if consumed > end {
            return Err(format!(
                "its position is inconsistent ({consumed} samples consumed of an epoch of \
                 {end}, after {} steps on {before})",
                saved.step
            ));
        }
        return Ok(EpochRest {
            first_step: saved.step,
            consumed,
            end,
            changed_from: (before != now).then_some(before),
        });
    }
    // Written before checkpoints recorded their allocation.
    let same_batch = saved
        .old_batch
        .is_none_or(|b| b == (now.batch_size, now.accumulate));
    if same_batch && saved.step.checked_mul(now.global_batch()) == Some(saved.samples) {
        return Ok(EpochRest {
            first_step: saved.step,
            consumed: saved.samples,
            end: steps_now * now.global_batch(),
            changed_from: None,
        });
    }
    let before = match (saved.samples % saved.step, saved.old_batch) {
        (0, Some((b, a)))
            if b.checked_mul(a)
                .is_some_and(|g| g > 0 && (saved.samples / saved.step).is_multiple_of(g)) =>
        {
            let ranks = saved.samples / saved.step / (b * a);
            format!("{ranks} rank(s) x batch {b} x accumulate {a}")
        }
        (0, _) => format!("global batch {}", saved.samples / saved.step),
        _ => "another allocation".to_string(),
    };
    Err(format!(
        "it was written before checkpoints recorded their ranks and batch, on {before}, and \
         continues only on that allocation, not on {now}: start the same number of ranks with \
         the same --batch-size and --accumulate, or resume from an epoch-end checkpoint"
    ))
}

/// What `config.json` and the epoch's line of `metrics.jsonl` record of a resume on another
/// allocation.
pub fn change_record(
    epoch: u64,
    from: Allocation,
    to: Allocation,
    rest: Option<&EpochRest>,
    steps_per_epoch: (usize, usize),
) -> Value {
    let mut v = json!({
        "epoch": epoch,
        "from": from,
        "to": to,
        "global_batch": { "from": from.global_batch(), "to": to.global_batch() },
        "steps_per_epoch": { "from": steps_per_epoch.0, "to": steps_per_epoch.1 },
    });
    if let Some(rest) = rest {
        v["consumed"] = json!(rest.consumed);
        v["epoch_end"] = json!(rest.end);
        v["step"] = json!(rest.first_step);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(world_size: usize, batch_size: usize, accumulate: usize) -> Allocation {
        Allocation {
            world_size,
            batch_size,
            accumulate,
        }
    }

    fn saved(allocation: Allocation, step: usize, end: usize) -> Saved {
        Saved {
            allocation: Some(allocation),
            step,
            samples: step * allocation.global_batch(),
            consumed: Some(step * allocation.global_batch()),
            end: Some(end),
            old_batch: None,
        }
    }

    #[test]
    fn the_same_global_batch_takes_the_same_steps() {
        // 2 x 16 stopped at step 13 of 32 continues on 1 x 32 with 19 steps.
        let rest = continue_epoch(saved(alloc(2, 16, 1), 13, 1024), alloc(1, 32, 1), 32).unwrap();
        assert_eq!(
            rest,
            EpochRest {
                first_step: 13,
                consumed: 416,
                end: 1024,
                changed_from: Some(alloc(2, 16, 1)),
            }
        );
        assert_eq!(rest.steps_left(alloc(1, 32, 1), None), 19);
        assert_eq!(rest.steps_left(alloc(1, 16, 2), None), 19);
    }

    #[test]
    fn another_global_batch_takes_the_rest_in_its_own_steps() {
        // The case: 2 x 16 at step 13 of 32, then 4 x 16: 608 samples in 10 steps of
        // 64 (the last filled by 32 padded positions), not the 3 steps of "step 13 of 16".
        let rest = continue_epoch(saved(alloc(2, 16, 1), 13, 1024), alloc(4, 16, 1), 16).unwrap();
        assert_eq!(rest.steps_left(alloc(4, 16, 1), None), 10);
        // A per-epoch cap counts the steps already done.
        assert_eq!(rest.steps_left(alloc(4, 16, 1), Some(20)), 7);
        // 2 -> 3 ranks at batch 16: 6 steps of 32 left are 4 steps of 48.
        let rest = continue_epoch(saved(alloc(2, 16, 1), 2, 256), alloc(3, 16, 1), 5).unwrap();
        assert_eq!(rest.steps_left(alloc(3, 16, 1), None), 4);
    }

    #[test]
    fn an_epoch_not_yet_begun_starts_afresh_on_any_allocation() {
        // A stop during the last evaluation is taken at step 0 of the next epoch: on 1 x 16
        // that epoch has its own 62 steps (992 positions of 1000), not 4 x 16's 960.
        for now in [alloc(1, 16, 1), alloc(8, 16, 1), alloc(4, 16, 1)] {
            let steps_now = now.steps_per_epoch(1000, None);
            assert_eq!(
                continue_epoch(saved(alloc(4, 16, 1), 0, 960), now, steps_now).unwrap(),
                EpochRest::fresh(steps_now, now)
            );
        }
        assert_eq!(alloc(1, 16, 1).steps_per_epoch(1000, None), 62);
    }

    #[test]
    fn an_unchanged_allocation_is_no_change() {
        let rest = continue_epoch(saved(alloc(2, 8, 2), 3, 320), alloc(2, 8, 2), 10).unwrap();
        assert_eq!((rest.changed_from, rest.consumed), (None, 96));
        assert_eq!(rest.steps_left(alloc(2, 8, 2), Some(10)), 7);
        // A lower cap on the resume counts too, and a step past it leaves nothing.
        assert_eq!(rest.steps_left(alloc(2, 8, 2), Some(5)), 2);
        assert_eq!(rest.steps_left(alloc(2, 8, 2), Some(2)), 0);
    }

    /// A stop in an epoch's evaluation saves the epoch's end: it continues with no step left,
    /// on its own allocation or another.
    #[test]
    fn a_position_at_the_epochs_end_continues_with_no_step_left() {
        for now in [alloc(2, 16, 1), alloc(3, 16, 1)] {
            let rest = continue_epoch(saved(alloc(2, 16, 1), 32, 1024), now, 32).unwrap();
            assert_eq!((rest.first_step, rest.consumed, rest.end), (32, 1024, 1024));
            assert_eq!(rest.steps_left(now, None), 0);
        }
    }

    #[test]
    fn an_inconsistent_position_is_refused() {
        let mut bad = saved(alloc(2, 16, 1), 13, 1024);
        bad.consumed = Some(1100);
        let err = continue_epoch(bad, alloc(2, 16, 1), 32).unwrap_err();
        assert!(
            err.contains("1100 samples consumed of an epoch of 1024, after 13 steps"),
            "{err}"
        );
    }

    /// A checkpoint written before they recorded their allocation: 13 steps of 32 samples.
    fn old_checkpoint(old_batch: Option<(usize, usize)>) -> Saved {
        Saved {
            allocation: None,
            step: 13,
            samples: 416,
            consumed: None,
            end: None,
            old_batch,
        }
    }

    #[test]
    fn old_checkpoints_continue_only_on_their_own_allocation() {
        let old = old_checkpoint(Some((16, 1)));
        let rest = continue_epoch(old, alloc(2, 16, 1), 32).unwrap();
        assert_eq!(
            rest,
            EpochRest {
                first_step: 13,
                consumed: 416,
                end: 1024,
                changed_from: None
            }
        );
        let err = continue_epoch(old, alloc(4, 16, 1), 16).unwrap_err();
        assert!(
            err.contains("on 2 rank(s) x batch 16 x accumulate 1, and continues only")
                && err.contains("not on 4 rank(s) x batch 16 x accumulate 1 (global batch 64)"),
            "{err}"
        );
        // The same global batch with another per-rank batch is another allocation too.
        assert!(continue_epoch(old, alloc(1, 32, 1), 32).is_err());
        // Nothing done yet: any allocation starts the epoch afresh.
        let at_start = Saved {
            step: 0,
            samples: 0,
            ..old
        };
        assert_eq!(
            continue_epoch(at_start, alloc(4, 16, 1), 16).unwrap(),
            EpochRest::fresh(16, alloc(4, 16, 1))
        );
    }

    /// A step of more than `usize::MAX` samples never fits: no steps, not an overflow (which
    /// wrapped to a step of 0 samples in release builds and divided by it).
    #[test]
    fn a_step_too_large_to_count_takes_no_steps() {
        let huge = alloc(2, 1 << 32, 1 << 32);
        assert_eq!(huge.steps_per_epoch(1000, None), 0);
        assert_eq!(huge.global_batch(), usize::MAX);
        assert_eq!(alloc(2, 0, 1).steps_per_epoch(1000, None), 0);
        let old = old_checkpoint(None);
        let err = continue_epoch(old, huge, 0).unwrap_err();
        assert!(
            err.contains("on global batch 32, and continues only"),
            "{err}"
        );
    }

    /// 100 epochs planned at 200 steps each, resumed after epoch 50 (10 000 steps) on an
    /// allocation of 100 steps per epoch for 150 epochs: 100 more epochs of 100 steps.
    #[test]
    fn a_plan_counts_the_steps_taken_on_earlier_allocations() {
        assert_eq!(Plan::steps_from(100, 200, (0, 0, 0)), 20_000);
        assert_eq!(Plan::steps_from(150, 100, (10_000, 50, 0)), 20_000);
        // Inside epoch 51 after 40 of its 200 steps: its 160 left take 80 of 100 samples x 2.
        assert_eq!(
            Plan::steps_from(150, 100, (10_040, 51, 80)),
            10_040 + 80 + 99 * 100
        );
        // Fewer epochs than begun: the steps taken and the rest of the epoch in progress.
        assert_eq!(Plan::steps_from(40, 100, (10_040, 51, 80)), 10_120);
        assert_eq!(Plan::steps_from(u64::MAX, 100, (1, 0, 0)), u64::MAX);
    }

    #[test]
    fn steps_per_epoch_follow_the_padded_shard() {
        assert_eq!(alloc(2, 16, 1).steps_per_epoch(1024, None), 32);
        assert_eq!(alloc(2, 16, 1).steps_per_epoch(1023, None), 32);
        assert_eq!(alloc(1, 32, 1).steps_per_epoch(1023, None), 31);
        assert_eq!(alloc(3, 4, 2).steps_per_epoch(100, Some(2)), 2);
    }
}
