//! What the ranks' reducers agree on, with real ranks (2 processes on loopback, this test
//! binary re-invoked with `--ignored --exact <worker>`): the order of collectives when a rank
//! skips parameters and backward runs a collective of its own, an error that one rank finds
//! returned by every rank, one DDP at a time over a set of parameters, a user's own loop, and
//! fp16 gradients averaged without overflow.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{spawn_worker_ranks, text, wait_all};
use ddp_comm::{ProcessGroup, ReduceOp};
use ddp_train::functional::all_reduce_sum;
use ddp_train::{DdpError, DdpOptions, DistributedDataParallel};
use tch::{nn, Device, Kind, Tensor};

const MODE_ENV: &str = "DDP_TEST_MODE";

/// Runs `worker` as 2 ranks (each collective bounded by 20 s, so that a rank left waiting
/// fails instead of hanging) and returns each rank's output; asserts that both succeeded.
fn run_ranks(worker: &str, mode: &str) -> Vec<String> {
    let children = spawn_worker_ranks(worker, 2, |_, cmd| {
        cmd.env(MODE_ENV, mode)
            .env("DDP_OP_TIMEOUT_S", "20")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
    });
    let outputs = wait_all(children, Duration::from_secs(120));
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank} of {worker} ({mode}):\n{}",
            text(out)
        );
    }
    outputs.iter().map(text).collect()
}

/// What a worker printed after `rank R reports: `.
fn reported(output: &str, rank: usize) -> String {
    let prefix = format!("rank {rank} reports: ");
    output
        .lines()
        .find_map(|l| Some(l.split_once(&prefix)?.1))
        .unwrap_or_else(|| panic!("rank {rank} reported nothing:\n{output}"))
        .to_string()
}

/// A tensor's bytes in hex: equal strings are bit-identical tensors.
fn hex(t: &Tensor) -> String {
    let t = t.contiguous();
    let mut bytes = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut bytes, t.numel());
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// No rank of 2 was left inside a collective: the group pairs the next one.
fn assert_no_rank_left_waiting(pg: &ProcessGroup) {
    let mut t = Tensor::from_slice(&[pg.rank() as f32]);
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(f32::try_from(&t).unwrap(), 1.0);
}

fn mode() -> String {
    std::env::var(MODE_ENV).unwrap()
}

/// A trunk whose activations are summed over the ranks (a collective in forward, and one in
/// backward, as SyncBatchNorm's), and two heads; rank 1 leaves `head_b` out of its loss on
/// even steps. `find_unused_parameters`, one bucket per parameter, `head_b`'s first. Mode
/// `prepared`: overlap, `prepare_for_backward` on each loss; `deferred`: overlap without it;
/// `no_overlap`. Prints the weights after 3 SGD steps.
#[test]
#[ignore = "a rank of a_skipped_head_keeps_the_collective_order_of_backward; run by it"]
fn worker_skipped_head() {
    tch::set_num_threads(1);
    let mode = mode();
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    let (vs, [backbone, head_a, head_b]) = skipped_head_model();
    let options = DdpOptions {
        find_unused_parameters: true,
        overlap: mode != "no_overlap",
        bucket_cap_bytes: 1,
        first_bucket_cap_bytes: 1,
        ..DdpOptions::default()
    };
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), options).unwrap();
    let one_each =
        ["head_b.weight", "head_a.weight", "backbone.weight"].map(|n| vec![n.to_string()]);
    assert_eq!(ddp.bucket_parameters(), one_each);
    for step in 0..3 {
        for (_, p) in ddp.parameters() {
            tch_ext::set_grad(p, None).unwrap();
        }
        tch::manual_seed(100 * step + rank as i64);
        let x = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
        let h = all_reduce_sum(&pg, &x.matmul(&backbone.tr()).tanh()).unwrap();
        let loss_a = h.matmul(&head_a.tr()).square().mean(Kind::Float);
        let loss = if rank == 0 || step % 2 == 1 {
            loss_a + h.matmul(&head_b.tr()).square().mean(Kind::Float)
        } else {
            loss_a
        };
        if mode == "prepared" {
            ddp.prepare_for_backward(&loss).unwrap();
        }
        loss.backward();
        ddp.sync_gradients().unwrap();
        tch::no_grad(|| {
            for (_, p) in ddp.parameters() {
                let _ = p.shallow_clone().g_sub_(&(p.grad() * 0.1));
            }
        });
    }
    let weights: Vec<String> = ddp
        .parameters()
        .iter()
        .map(|(name, p)| format!("{name}={}", hex(p)))
        .collect();
    println!("rank {rank} reports: {}", weights.join(" "));
}

/// `worker_skipped_head`'s model, drawn from seed 5: the store and its backbone and two
/// heads.
fn skipped_head_model() -> (nn::VarStore, [Tensor; 3]) {
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let init = nn::Init::Randn {
        mean: 0.0,
        stdev: 0.5,
    };
    let backbone = (vs.root() / "backbone").var("weight", &[8, 4], init);
    let head_a = (vs.root() / "head_a").var("weight", &[3, 8], init);
    let head_b = (vs.root() / "head_b").var("weight", &[5, 8], init);
    (vs, [backbone, head_a, head_b])
}

/// A parameter's name and values.
type Named = (String, Vec<f32>);

/// `name=hex` pairs of a report, as names and `f32` values.
fn parse_weights(report: &str) -> Vec<Named> {
    report
        .split(' ')
        .map(|pair| {
            let (name, hex) = pair.split_once('=').unwrap();
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            let values = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name.to_string(), values)
        })
        .collect()
}

/// `worker_skipped_head`'s 3 steps in one process, and its initial weights: both ranks'
/// losses over the shared `h` summed (the all-reduce in backward sums what the ranks send
/// back through it), gradients halved (DDP's average over 2 ranks).
fn skipped_head_reference() -> (Vec<Named>, Vec<Named>) {
    let (vs, [backbone, head_a, head_b]) = skipped_head_model();
    let values = |vs: &nn::VarStore| -> Vec<Named> {
        let mut named: Vec<Named> = vs
            .variables()
            .into_iter()
            .map(|(n, t)| (n, Vec::<f32>::try_from(t.reshape([-1])).unwrap()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        named
    };
    let initial = values(&vs);
    for step in 0..3 {
        for p in [&backbone, &head_a, &head_b] {
            tch_ext::set_grad(p, None).unwrap();
        }
        let h = (0..2i64)
            .map(|rank| {
                tch::manual_seed(100 * step + rank);
                let x = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
                x.matmul(&backbone.tr()).tanh()
            })
            .reduce(|a, b| a + b)
            .unwrap();
        let loss_a = || h.matmul(&head_a.tr()).square().mean(Kind::Float);
        let loss_b = || h.matmul(&head_b.tr()).square().mean(Kind::Float);
        // Rank 0 always uses head_b, rank 1 on odd steps only.
        let rank_1 = if step % 2 == 1 {
            loss_a() + loss_b()
        } else {
            loss_a()
        };
        (loss_a() + loss_b() + rank_1).backward();
        tch::no_grad(|| {
            for p in [&backbone, &head_a, &head_b] {
                let _ = p.shallow_clone().g_sub_(&(p.grad() * 0.05));
            }
        });
    }
    (initial, values(&vs))
}

/// With `find_unused_parameters`, a rank that skips a head marks it ready at the first hook
/// of its backward (PyTorch's order): its bucket is launched before the all-reduce that
/// backward runs through the trunk, as on the rank that uses the head. Launched only after
/// backward, the ranks' collectives would cross (a mismatch on the CPU ring; a hang or
/// mixed tensors with NCCL). Overlapped, deferred and after-backward reductions end with the
/// same weights on both ranks.
#[test]
fn a_skipped_head_keeps_the_collective_order_of_backward() {
    let mut weights = Vec::new();
    for mode in ["prepared", "deferred", "no_overlap"] {
        let outputs = run_ranks("worker_skipped_head", mode);
        let ranks = [reported(&outputs[0], 0), reported(&outputs[1], 1)];
        assert_eq!(ranks[0], ranks[1], "{mode}: the ranks' weights differ");
        weights.push((mode, ranks[0].clone()));
    }
    for (mode, w) in &weights[1..] {
        assert_eq!(w, &weights[0].1, "{mode} differs from prepared");
    }
    // The averaged gradients are the right ones: one process's over both ranks' data, and
    // every weight moved (zero gradients would leave the ranks equal too).
    let (initial, expected) = skipped_head_reference();
    let mut got = parse_weights(&weights[0].1);
    got.sort_by(|a, b| a.0.cmp(&b.0));
    let names = |w: &[Named]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&got), names(&expected));
    for (((name, got), (_, want)), (_, start)) in got.iter().zip(&expected).zip(&initial) {
        let moved = want
            .iter()
            .zip(start)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(moved > 1e-3, "{name} moved only {moved} in the reference");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5,
                "{name}[{i}]: {g} from the ranks, {w} in one process"
            );
        }
    }
}

/// Rank 1 runs a second backward through `a` with gradient sync on, which fails; both ranks
/// call `sync_gradients` and print its error, then all-reduce once more.
#[test]
#[ignore = "a rank of a_second_synced_backward_on_one_rank_fails_every_rank; run by it"]
fn worker_gradient_twice() {
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    let vs = nn::VarStore::new(Device::Cpu);
    let a = vs.root().var("a", &[3], nn::Init::Const(1.0));
    let b = vs.root().var("b", &[2], nn::Init::Const(1.0));
    let options = DdpOptions {
        find_unused_parameters: mode() == "find_unused",
        ..DdpOptions::default()
    };
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), options).unwrap();
    (a.sum(Kind::Float) + b.sum(Kind::Float)).backward();
    if rank == 1 {
        let e = a.sum(Kind::Float).f_backward().unwrap_err().to_string();
        assert!(e.contains("no sync_gradients followed it"), "{e}");
    }
    let text = match ddp.sync_gradients() {
        Err(e @ (DdpError::GradientTwice { .. } | DdpError::SyncMissed { .. })) => e.to_string(),
        other => format!("unexpected: {other:?}"),
    };
    assert_no_rank_left_waiting(&pg);
    println!("rank {rank} reports: {text}");
}

/// A second synced backward on one rank is an error on every rank, in the first step
/// (where the buckets would be rebuilt next) as with `find_unused_parameters` (never
/// rebuilt): the rank that ran it names the parameter, the other names that rank.
#[test]
fn a_second_synced_backward_on_one_rank_fails_every_rank() {
    for mode in ["first_step", "find_unused"] {
        let outputs = run_ranks("worker_gradient_twice", mode);
        let hint = "before sync_gradients, or once after prepare_for_backward found it \
                    unreachable from the loss: when accumulating gradients";
        assert_eq!(
            reported(&outputs[1], 1)
                .split(": each rank trains")
                .next()
                .unwrap(),
            "rank 1: a backward pass with gradient sync on reached parameter 'a' and no \
             sync_gradients followed it",
            "{mode}"
        );
        assert_eq!(
            reported(&outputs[0], 0).split(hint).next().unwrap(),
            "rank 0: a parameter received a gradient twice on rank 1 (its error names it) ",
            "{mode}"
        );
    }
}

/// A second DDP over the same store is refused on every rank, naming a parameter, while the
/// first is alive; once it is dropped, the second averages the gradients.
#[test]
#[ignore = "a rank of a_second_ddp_on_the_same_parameters_waits_for_the_first; run by it"]
fn worker_second_ddp() {
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    let vs = nn::VarStore::new(Device::Cpu);
    let a = vs.root().var("a", &[2], nn::Init::Const(1.0));
    let first = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default()).unwrap();
    let refused = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default())
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(refused, DdpError::AlreadyHooked(ref n) if n == "a"));
    drop(first);
    let mut second = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default()).unwrap();
    (a.sum(Kind::Float) * (rank as f64 + 1.0)).backward();
    second.sync_gradients().unwrap();
    let grad = Vec::<f32>::try_from(&a.grad()).unwrap();
    println!("rank {rank} reports: {refused} / {grad:?}");
}

#[test]
fn a_second_ddp_on_the_same_parameters_waits_for_the_first() {
    let outputs = run_ranks("worker_second_ddp", "");
    for (rank, output) in outputs.iter().enumerate() {
        assert_eq!(
            reported(output, rank),
            "parameter 'a' already has a post-accumulate-grad hook: another \
             DistributedDataParallel over these parameters is still alive (drop it before \
             building a new one, or wrap the store again with its rebuild), or the hook is \
             your own (DDP needs each parameter's only hook) / [1.5, 1.5]"
        );
    }
}

/// A user's own loop over tch's SGD, each rank's loss `(rank + 1) * w.sum()`. Mode
/// `backward_step`: tch's `Optimizer::backward_step`, which never calls `sync_gradients`;
/// `ddp_backward`: `zero_grad`, `DistributedDataParallel::backward`, `step`. Each step starts
/// with `broadcast_buffers`, as the docs ask; prints the first error, the last gradient and
/// the weights.
#[test]
#[ignore = "a rank of a_loop_of_ones_own_averages_only_through_ddp_backward; run by it"]
fn worker_own_loop() {
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().var("w", &[3], nn::Init::Const(1.0));
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default()).unwrap();
    let mut opt = nn::OptimizerConfig::build(nn::Sgd::default(), &vs, 0.1).unwrap();
    let mut error = String::from("none");
    for _ in 0..2 {
        if let Err(e) = ddp.broadcast_buffers() {
            assert!(matches!(e, DdpError::SyncMissed { .. }), "{e:?}");
            error = e.to_string();
            break;
        }
        let loss = w.sum(Kind::Float) * (rank as f64 + 1.0);
        if mode() == "backward_step" {
            opt.backward_step(&loss);
        } else {
            opt.zero_grad();
            ddp.backward(&loss).unwrap();
            opt.step();
        }
    }
    assert_no_rank_left_waiting(&pg);
    let grad = Vec::<f32>::try_from(&w.grad()).unwrap();
    let w = Vec::<f32>::try_from(&w).unwrap();
    println!("rank {rank} reports: {error} / {grad:?} / {w:.4?}");
}

/// tch's `backward_step` leaves each rank its own gradient: the next step's first DDP call
/// fails on every rank instead of training the replicas apart; `DistributedDataParallel::
/// backward` averages, and the replicas stay equal.
#[test]
fn a_loop_of_ones_own_averages_only_through_ddp_backward() {
    let outputs = run_ranks("worker_own_loop", "backward_step");
    for (rank, output) in outputs.iter().enumerate() {
        let own = 1.0 - 0.1 * (rank as f32 + 1.0);
        assert_eq!(
            reported(output, rank),
            format!(
                "rank {rank}: a backward pass with gradient sync on reached parameter 'w' and \
                 no sync_gradients followed it: each rank trains a replica of its own; call \
                 sync_gradients after every backward with gradient sync on, before the \
                 optimizer step, or DistributedDataParallel::backward(&loss), which runs both \
                 (tch's Optimizer::backward_step cannot be used with DDP: zero_grad, \
                 DistributedDataParallel::backward, then step); accumulate micro-batches with \
                 gradient sync off (DistributedDataParallel::no_sync); a reentrant backward, \
                 which gives a parameter a second gradient within one backward, is refused so \
                 too, as PyTorch's DDP refuses it without static_graph / {:?} / {:.4?}",
                [rank as f32 + 1.0; 3],
                [own; 3]
            )
        );
    }
    let outputs = run_ranks("worker_own_loop", "ddp_backward");
    for (rank, output) in outputs.iter().enumerate() {
        // Two steps of 0.1 times the average, 1.5: equal on both ranks.
        assert_eq!(
            reported(output, rank),
            format!("none / {:?} / {:.4?}", [1.5f32; 3], [0.7f32; 3])
        );
    }
}

/// Each rank's gradient of an fp16 parameter is 40000: the default hook scales each by
/// 1/world before the sum, as PyTorch's reducer does, so the average is 40000, though the
/// ranks' plain sum (80000) is past fp16's largest value (65504) and would be inf.
#[test]
#[ignore = "a rank of fp16_gradients_are_averaged_without_overflowing_in_their_sum; run by it"]
fn worker_fp16_average() {
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    let mut vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().var("w", &[3], nn::Init::Const(1.0));
    vs.half();
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default()).unwrap();
    ddp.backward(&(w.sum(Kind::Half) * 40000.0)).unwrap();
    let grad = w.grad();
    assert_eq!(grad.kind(), Kind::Half);
    let grad = Vec::<f32>::try_from(&grad.to_kind(Kind::Float)).unwrap();
    println!("rank {rank} reports: {grad:?}");
}

#[test]
fn fp16_gradients_are_averaged_without_overflowing_in_their_sum() {
    let outputs = run_ranks("worker_fp16_average", "");
    for (rank, output) in outputs.iter().enumerate() {
        assert_eq!(reported(output, rank), format!("{:?}", [40000f32; 3]));
    }
}
