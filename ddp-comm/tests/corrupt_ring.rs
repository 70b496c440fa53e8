//! A shared-memory peer that writes an impossible value into the ring: its neighbour must
//! fail with a protocol error naming it, not read or write out of bounds. Rank 1 publishes a
//! forged tail (`DDP_COMM_TEST_FORGE_TAIL`, read with the `fault-injection` feature only); rank 0, which sends into that
//! ring, checks every tail it reads.

mod common;

use common::{lines_with, rank_world, show, spawn_rank, wait_all, worker};
use ddp_comm::{LinkKind, ProcessGroup, ReduceOp};

#[test]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "injects faults: needs the fault-injection feature (cargo xtask test)"
)]
fn a_peer_that_writes_an_impossible_tail_is_a_protocol_error_naming_it() {
    if worker() {
        let group = ProcessGroup::from_env().unwrap();
        let (rank, _) = rank_world();
        assert_eq!(group.ring_layout().to_next, Some(LinkKind::SharedMemory));
        for _ in 0..20 {
            let mut v = vec![1.0f32; 1 << 16];
            if let Err(e) = group.all_reduce_slice(&mut v, ReduceOp::Sum) {
                println!("ERROR: {e}");
                return;
            }
        }
        println!("rank {rank}: no error");
        return;
    }
    let test = "a_peer_that_writes_an_impossible_tail_is_a_protocol_error_naming_it";
    let port = common::free_port();
    let extra = [
        ("DDP_OP_TIMEOUT_S", "10".to_string()),
        ("DDP_TRANSPORT", "auto".to_string()),
    ];
    let rank0 = spawn_rank(test, 0, 2, port, &extra);
    let mut forging = extra.to_vec();
    forging.push(("DDP_COMM_TEST_FORGE_TAIL", "1".to_string()));
    let rank1 = spawn_rank(test, 1, 2, port, &forging);
    let outs = wait_all(vec![rank0, rank1], std::time::Duration::from_secs(60));
    let errors = lines_with(&outs[0], "ERROR: ");
    assert_eq!(errors.len(), 1, "{}", show(&outs[0]));
    let e = &errors[0];
    assert!(e.contains("rank 1"), "{e}");
    assert!(e.contains("its tail"), "{e}");
    assert!(e.contains("is impossible"), "{e}");
    assert!(e.contains("shared memory"), "{e}");
}
