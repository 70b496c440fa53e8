//! The test that defines `DistributedDataParallel`: R ranks with per-rank batch B end with
//! the same parameters as one process training on the concatenated R*B batches; with
//! BatchNorm in training mode all ranks stay bit-identical. Ranks are real processes: this
//! test binary re-invoked with `--ignored --exact <worker>` and torchrun's environment.

mod common;

use common::{free_port, wait_all};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ddp_comm::{Options, ProcessGroup};
use ddp_model::{checkpoint, ConvNet, ConvNetConfig};
use ddp_train::optim::{Adam, AdamConfig};
use ddp_train::{DdpError, DdpOptions, DistributedDataParallel};
use tch::{nn, Device, Kind, Reduction, Tensor};

const STEPS: usize = 3;
const BATCH: i64 = 4;
const SIDE: i64 = 32;
const OUT_ENV: &str = "DDP_TEST_OUT";

fn temp_dir(name: &str) -> common::TempDir {
    common::temp_dir(&format!("ddp-train-{name}"))
}

/// Runs `worker` as `world` rank processes and waits for all of them (bounded).
fn run_ranks(worker: &str, world: usize, out: &Path, env: &[(&str, String)]) -> Vec<bool> {
    let children = common::spawn_worker_ranks(worker, world, |rank, cmd| {
        cmd.env(OUT_ENV, out)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(std::fs::File::create(out.join(format!("{worker}-{rank}.log"))).unwrap())
            .stderr(std::process::Stdio::piped());
    });
    let outputs = wait_all(children, Duration::from_secs(180));
    for (rank, output) in outputs.iter().enumerate() {
        if !output.status.success() {
            let err = String::from_utf8_lossy(&output.stderr);
            eprintln!("rank {rank} of {worker} failed:\n{err}");
        }
    }
    outputs.iter().map(|o| o.status.success()).collect()
}

/// The deterministic batch of `rank` at `step`, micro-batch `micro`.
fn batch(step: usize, rank: usize, micro: usize) -> (Tensor, Tensor) {
    tch::manual_seed((1000 * step + 100 * micro + rank) as i64 + 7);
    let x = Tensor::rand([BATCH, 3, SIDE, SIDE], (Kind::Float, Device::Cpu)) * 2.0;
    let y = Tensor::rand([BATCH, 8], (Kind::Float, Device::Cpu)).round();
    (x, y)
}

fn model(seed: i64) -> (nn::VarStore, ConvNet) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = ConvNet::new(
        &vs.root(),
        ConvNetConfig {
            num_classes: 8,
            dropout: 0.0,
        },
    );
    (vs, net)
}

fn loss(net: &ConvNet, x: &Tensor, y: &Tensor, train: bool) -> Tensor {
    net.forward_t(x, train)
        .binary_cross_entropy_with_logits::<Tensor>(y, None, None, Reduction::Mean)
}

fn trainable(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<_> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn env_usize(name: &str) -> usize {
    std::env::var(name).unwrap().parse().unwrap()
}

/// Plain SGD: the update is linear in the gradient, so the comparison measures DDP's
/// averaging and nothing else (Adam divides by sqrt(v) and so magnifies float rounding in
/// near-zero gradients into differences that say nothing about DDP).
fn sgd_step(params: &[(String, Tensor)]) {
    tch::no_grad(|| {
        for (_, p) in params {
            let _ = p.shallow_clone().g_sub_(&(p.grad() * 0.5));
        }
    });
}

fn zero_grad(params: &[(String, Tensor)]) {
    for (_, p) in params {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
}

/// One rank: BatchNorm in eval mode, dropout 0, `ACCUM` micro-batches per step.
#[test]
#[ignore = "a rank of the equivalence tests; run by them"]
fn worker_eval_mode() {
    tch::set_num_threads(1);
    let out = PathBuf::from(std::env::var(OUT_ENV).unwrap());
    let accum = env_usize("ACCUM");
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    // Each rank initialises differently: DDP must make rank 0's weights everyone's.
    let (vs, net) = model(rank as i64);
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default()).unwrap();
    let params = trainable(&vs);
    for step in 0..STEPS {
        zero_grad(&params);
        for micro in 0..accum {
            let (x, y) = batch(step, rank, micro);
            ddp.set_require_gradient_sync(micro + 1 == accum);
            (loss(&net, &x, &y, false) / accum as f64).backward();
        }
        ddp.sync_gradients().unwrap();
        sgd_step(&params);
    }
    checkpoint::save(
        &vs,
        out.join(format!("rank{rank}.safetensors")),
        &HashMap::new(),
    )
    .unwrap();
}

/// One process on the concatenation of every rank's micro-batches.
fn reference(world: usize, accum: usize) -> nn::VarStore {
    let (vs, net) = model(0);
    let params = trainable(&vs);
    for step in 0..STEPS {
        let (xs, ys): (Vec<Tensor>, Vec<Tensor>) = (0..world)
            .flat_map(|r| (0..accum).map(move |m| batch(step, r, m)))
            .unzip();
        zero_grad(&params);
        loss(&net, &Tensor::cat(&xs, 0), &Tensor::cat(&ys, 0), false).backward();
        sgd_step(&params);
    }
    vs
}

fn check_equivalence(world: usize, accum: usize) {
    tch::set_num_threads(1);
    let tmp = temp_dir(&format!("eq-{world}-{accum}"));
    let out = tmp.path();
    let ok = run_ranks(
        "worker_eval_mode",
        world,
        out,
        &[("ACCUM", accum.to_string())],
    );
    assert_eq!(ok, vec![true; world], "a rank failed");
    // The reference draws its weights and batches from libtorch's global generator, which
    // the other tests of this binary (threads of one process) seed too: one at a time.
    static GLOBAL_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _rng = GLOBAL_RNG.lock().unwrap_or_else(|e| e.into_inner());
    let want = reference(world, accum);
    let want = checkpoint::named_tensors(&want);
    for rank in 0..world {
        let got = checkpoint::read_tensors(out.join(format!("rank{rank}.safetensors"))).unwrap();
        let mut moved = 0.0;
        for (name, w) in &want {
            let g = &got.tensors[name];
            if w.kind() != Kind::Float {
                continue;
            }
            let diff = (g - w).abs().max().double_value(&[]);
            let scale = w.abs().max().double_value(&[]).max(1e-3);
            assert!(
                diff <= 1e-5 * scale,
                "rank {rank}: {name} differs by {diff} (scale {scale})"
            );
            moved += (g - &model(0).0.variables()[name])
                .abs()
                .max()
                .double_value(&[]);
        }
        assert!(
            moved > 1e-3,
            "the parameters did not move: the test would prove nothing"
        );
    }
}

#[test]
fn two_ranks_equal_one_process_on_the_concatenated_batch() {
    check_equivalence(2, 1);
}

#[test]
fn three_ranks_equal_one_process_on_the_concatenated_batch() {
    check_equivalence(3, 1);
}

#[test]
fn accumulating_two_micro_batches_equals_one_larger_batch() {
    check_equivalence(2, 2);
}

/// FNV-1a over a tensor list's bytes: equal digests mean bit-identical tensors.
fn digest(named: &[(String, Tensor)]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, t) in named {
        let t = t.contiguous();
        let mut bytes = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
        t.copy_data_u8(&mut bytes, t.numel());
        for b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// One rank: BatchNorm in training mode; records digests of parameters after every step and
/// of buffers before and after every broadcast.
#[test]
#[ignore = "a rank of the equivalence tests; run by them"]
fn worker_train_mode() {
    tch::set_num_threads(1);
    let out = PathBuf::from(std::env::var(OUT_ENV).unwrap());
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    let (vs, net) = model(rank as i64);
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default()).unwrap();
    let mut opt = Adam::new(
        trainable(&vs),
        AdamConfig {
            lr: 1e-3,
            ..Default::default()
        },
    );
    let mut lines = Vec::new();
    for step in 0..STEPS {
        let before = digest(ddp.buffers());
        ddp.broadcast_buffers().unwrap();
        let after = digest(ddp.buffers());
        opt.zero_grad();
        let (x, y) = batch(step, rank, 0);
        loss(&net, &x, &y, true).backward();
        ddp.sync_gradients().unwrap();
        opt.step();
        lines.push(format!(
            "{step} {before} {after} {}",
            digest(ddp.parameters())
        ));
    }
    std::fs::write(out.join(format!("rank{rank}.txt")), lines.join("\n")).unwrap();
}

#[test]
fn train_mode_keeps_parameters_and_broadcast_buffers_bit_identical() {
    let tmp = temp_dir("train-mode");
    let out = tmp.path();
    assert_eq!(
        run_ranks("worker_train_mode", 2, out, &[]),
        vec![true, true]
    );
    let read = |r: usize| -> Vec<Vec<u64>> {
        std::fs::read_to_string(out.join(format!("rank{r}.txt")))
            .unwrap()
            .lines()
            .map(|l| l.split(' ').map(|x| x.parse().unwrap()).collect())
            .collect()
    };
    let (a, b) = (read(0), read(1));
    assert_eq!(a.len(), STEPS);
    for step in 0..STEPS {
        assert_eq!(
            a[step][2], b[step][2],
            "buffers differ after the broadcast at step {step}"
        );
        assert_eq!(
            a[step][3], b[step][3],
            "parameters differ after step {step}"
        );
    }
    // The broadcasts did real work: after a step on different data, rank 1's running
    // statistics differed from rank 0's until the next broadcast.
    assert!(
        (1..STEPS).all(|s| b[s][1] != b[s][2]),
        "rank 1's buffers never needed the broadcast"
    );
    assert!(
        (1..STEPS).all(|s| a[s][1] == a[s][2]),
        "the broadcast changed rank 0's buffers"
    );
}

/// One rank of a model of a parameter and a buffer, each filled with the rank's number:
/// writes the buffer's value after `new`, the parameter's, and the buffer's after a
/// `rebuild`, before which each rank fills it with 10 plus its rank.
#[test]
#[ignore = "a rank of the buffer test; run by it"]
fn worker_own_buffers() {
    let out = PathBuf::from(std::env::var(OUT_ENV).unwrap());
    let broadcast_buffers = std::env::var("BROADCAST_BUFFERS").unwrap() == "1";
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank() as f64;
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().var("w", &[2], nn::Init::Const(rank));
    let mut buffer = vs.root().zeros_no_train("running", &[3]);
    let _ = buffer.fill_(rank);
    let options = DdpOptions {
        broadcast_buffers,
        ..Default::default()
    };
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), options).unwrap();
    let (after_new, param) = (buffer.double_value(&[2]), w.double_value(&[1]));
    let _ = buffer.fill_(10.0 + rank);
    ddp.rebuild(&vs).unwrap();
    let after_rebuild = buffer.double_value(&[2]);
    let text = format!("{after_new} {param} {after_rebuild}");
    std::fs::write(out.join(format!("rank{}.txt", pg.rank())), text).unwrap();
}

/// PyTorch's `broadcast_buffers=False` leaves the buffers out of the construction's
/// broadcast: each rank keeps its own through `new` and `rebuild`, parameters are rank 0's.
#[test]
fn without_broadcast_buffers_new_and_rebuild_keep_each_ranks_buffers() {
    for (flag, rank1) in [("1", "0 0 10"), ("0", "1 0 11")] {
        let tmp = temp_dir(&format!("own-buffers-{flag}"));
        let out = tmp.path();
        let env = [("BROADCAST_BUFFERS", flag.to_string())];
        assert_eq!(
            run_ranks("worker_own_buffers", 2, out, &env),
            vec![true, true]
        );
        let read = |r: usize| std::fs::read_to_string(out.join(format!("rank{r}.txt"))).unwrap();
        assert_eq!(read(0), "0 0 10", "broadcast_buffers {flag}");
        assert_eq!(read(1), rank1, "broadcast_buffers {flag}");
    }
}

#[test]
#[ignore = "a rank of the mismatch test; run by it"]
fn worker_mismatched_model() {
    let out = PathBuf::from(std::env::var(OUT_ENV).unwrap());
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let classes = if pg.rank() == 1 { 7 } else { 8 };
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = ConvNet::new(
        &vs.root(),
        ConvNetConfig {
            num_classes: classes,
            dropout: 0.0,
        },
    );
    let err = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default()).unwrap_err();
    std::fs::write(out.join(format!("rank{}.txt", pg.rank())), err.to_string()).unwrap();
}

#[test]
fn a_rank_with_another_model_is_named_on_every_rank() {
    let tmp = temp_dir("mismatch");
    let out = tmp.path();
    assert_eq!(
        run_ranks("worker_mismatched_model", 2, out, &[]),
        vec![true, true]
    );
    let want = "rank 1's model differs from rank 0's at tensor parameter 'classifier.3.bias' \
                shape [7] dtype Float (rank 0 has parameter 'classifier.3.bias' shape [8] dtype Float)";
    for r in 0..2 {
        assert_eq!(
            std::fs::read_to_string(out.join(format!("rank{r}.txt"))).unwrap(),
            want
        );
    }
}

#[test]
fn a_parameter_without_gradient_is_named() {
    let pg = Arc::new(ProcessGroup::new(Options::new(0, 1, "127.0.0.1", free_port())).unwrap());
    let vs = nn::VarStore::new(Device::Cpu);
    let used = vs.root().var("used", &[3], nn::Init::Const(1.0));
    let _unused = vs.root().var("unused", &[2], nn::Init::Const(1.0));
    let mut ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default()).unwrap();
    used.sum(Kind::Float).backward();
    match ddp.sync_gradients() {
        Err(DdpError::UnusedParameters {
            rank: 0,
            world_size: 1,
            parameters,
        }) => assert_eq!(parameters, vec![("unused".to_owned(), 0)]),
        other => panic!("expected UnusedParameters, got {other:?}"),
    }
}

/// A model of two parameters; rank 1 leaves `b` out of its loss.
#[test]
#[ignore = "a rank of the unused-parameter test; run by it"]
fn worker_skips_a_parameter() {
    let out = PathBuf::from(std::env::var(OUT_ENV).unwrap());
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    let vs = nn::VarStore::new(Device::Cpu);
    let a = vs.root().var("a", &[3], nn::Init::Const(1.0));
    let b = vs.root().var("b", &[2], nn::Init::Const(1.0));
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default()).unwrap();
    let loss = if rank == 1 {
        a.sum(Kind::Float)
    } else {
        a.sum(Kind::Float) + b.sum(Kind::Float)
    };
    loss.backward();
    let text = match ddp.sync_gradients() {
        Err(e @ DdpError::UnusedParameters { .. }) => e.to_string(),
        other => format!("unexpected: {other:?}"),
    };
    // The group is still usable afterwards: no rank was left inside a collective.
    let mut t = Tensor::from_slice(&[rank as f32]);
    pg.all_reduce(&mut t, ddp_comm::ReduceOp::Sum).unwrap();
    assert_eq!(f32::try_from(&t).unwrap(), 1.0);
    std::fs::write(out.join(format!("rank{rank}.txt")), text).unwrap();
}

#[test]
fn a_parameter_one_rank_skips_fails_every_rank_naming_it() {
    let tmp = temp_dir("unused");
    let out = tmp.path();
    assert_eq!(
        run_ranks("worker_skips_a_parameter", 2, out, &[]),
        vec![true, true]
    );
    for r in 0..2 {
        let text = std::fs::read_to_string(out.join(format!("rank{r}.txt"))).unwrap();
        assert!(
            text.starts_with(&format!(
                "rank {r}: parameters received no gradient on some of the 2 ranks in this \
                 step: b (used by 1); if parts of the model are skipped on purpose"
            )),
            "rank {r}: {text}"
        );
        assert!(text.contains("find_unused_parameters"), "{text}");
    }
}
