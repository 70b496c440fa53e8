//! NCCL with a peer that never arrives: needs two GPUs (one rank per GPU; NCCL refuses two
//! ranks of one communicator on one device), and says `skipped:` with fewer. `cargo xtask
//! gpu-check` runs it on a GPU machine; the one-GPU checks are in `nccl.rs`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{gpus, lines_with, rank_world, run_world, worker};
use ddp_comm::{Backend, ProcessGroup, ReduceOp};
use tch::{Device, Kind, Tensor};

/// How long rank 1 stays away: far less than the harness's limit on the test (120 s), far
/// more than rank 0's drop takes when it aborts (the drop's 5 s grace, the abort, the
/// store's 3 s linger after a failure and a moment more). An upper bound against a drop that
/// hangs on rank 1, not a speed requirement.
const AWAY: Duration = Duration::from_secs(20);

/// Rank 0 drops its group while an all-reduce waits in a kernel for rank 1, which never
/// joins it. `ncclCommDestroy` would wait for that kernel, which waits for rank 1 forever
/// (even after rank 1 has exited); once the collective has made no progress for the drop's
/// grace period (5 s) the communicator must be aborted instead, so the drop returns before
/// rank 1 leaves.
#[test]
fn nccl_a_group_dropped_with_a_collective_pending_is_aborted() {
    if worker() {
        assert!(ddp_comm::cuda::load_torch_cuda().unwrap());
        let group = Arc::new(ProcessGroup::from_env().unwrap());
        assert_eq!(group.backend(), Backend::Nccl);
        let device = Device::Cuda(group.local_rank());
        let (rank, _) = rank_world();
        // Both ranks connected and agreed once.
        let mut t = Tensor::ones([1 << 16], (Kind::Float, device));
        group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(t.min().double_value(&[]), 2.0);
        if rank == 1 {
            std::thread::sleep(AWAY);
            println!("rank 1: leaving without the second all-reduce");
            return;
        }
        let pending = Tensor::ones([1 << 16], (Kind::Float, device));
        let work = group.all_reduce_async(&pending, ReduceOp::Sum);
        // Time for the kernel to start and wait for rank 1.
        std::thread::sleep(Duration::from_millis(500));
        assert!(!work.is_completed(), "complete without rank 1");
        drop(work);
        let group = Arc::try_unwrap(group).unwrap_or_else(|_| panic!("the group is still shared"));
        let start = Instant::now();
        drop(group);
        println!(
            "rank 0: dropped in {:.3} s with a collective pending",
            start.elapsed().as_secs_f64()
        );
        return;
    }
    match gpus() {
        Ok(n) if n >= 2 => {}
        Ok(n) => {
            println!("skipped: needs two GPUs, {n} visible");
            return;
        }
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    }
    let outputs = run_world(
        "nccl_a_group_dropped_with_a_collective_pending_is_aborted",
        2,
        // The watchdog would abort at the timeout anyway; make that far later than the test.
        &[("DDP_OP_TIMEOUT_S", "600".to_string())],
    );
    let dropped = lines_with(&outputs[0], "rank 0: dropped in ");
    assert_eq!(dropped.len(), 1, "{dropped:?}");
    let seconds: f64 = dropped[0].split(' ').next().unwrap().parse().unwrap();
    assert!(
        seconds < AWAY.as_secs_f64(),
        "the drop took {seconds} s: it waited for rank 1 instead of aborting"
    );
}
