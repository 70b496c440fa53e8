//! SyncBatchNorm: 2 ranks with per-rank batch B and `--sync-batchnorm` end with the weights
//! and BatchNorm running statistics of 1 process with batch 2B and plain BatchNorm. Ranks are
//! real `ddp-train` processes on loopback; the model is the ConvNet, four BatchNorm layers.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use common::{free_port, run_ddp_train, text, Limits};
use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_model::checkpoint;
use ddp_train::{NoStats, Settings, Task, TrainError, Trainer};
use tch::{nn, Kind, Tensor};

fn run_ranks(world: usize, args: &[&str]) -> Vec<Output> {
    let limits = Limits {
        collective_s: 30,
        run: Duration::from_secs(180),
    };
    run_ddp_train(world, args, &[], limits)
}

/// Trains `world` ranks with per-rank `batch` for 2 epochs of 3 steps of plain SGD (linear in
/// the gradient, so the comparison measures the statistics, not Adam's magnification of
/// rounding), without dropout; returns the last epoch's model tensors.
fn train(
    data: &Path,
    out: &Path,
    world: usize,
    batch: usize,
    extra: &[&str],
) -> Vec<(String, Tensor)> {
    let (data, run) = (data.to_str().unwrap(), out.to_str().unwrap());
    let batch = batch.to_string();
    let mut args = vec![
        "--data",
        data,
        "--out",
        run,
        "--epochs",
        "2",
        "--max-steps-per-epoch",
        "3",
        "--batch-size",
        &batch,
        "--image-size",
        "32",
        "--dropout",
        "0",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--lr-schedule",
        "constant",
        "--seed",
        "11",
    ];
    args.extend_from_slice(extra);
    let outputs = run_ranks(world, &args);
    for (r, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "rank {r} failed:\n{}", text(o));
    }
    let file = out.join("checkpoints").join("epoch-0002.safetensors");
    let mut tensors: Vec<_> = checkpoint::read_tensors(&file)
        .unwrap()
        .tensors
        .into_iter()
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

/// The largest difference between float tensors of the same name, absolute for tensors of
/// magnitude up to 1 and relative to the largest magnitude above, and the tensor it occurs in.
fn largest_difference(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> (f64, String) {
    assert_eq!(
        a.iter().map(|t| &t.0).collect::<Vec<_>>(),
        b.iter().map(|t| &t.0).collect::<Vec<_>>()
    );
    let mut worst = (0.0, String::new());
    for ((name, x), (_, y)) in a.iter().zip(b) {
        if x.kind() != Kind::Float {
            assert!(x.equal(y), "{name} differs: {x:?} vs {y:?}");
            continue;
        }
        let scale = x.abs().max().double_value(&[]).max(1.0);
        let d = (x - y).abs().max().double_value(&[]) / scale;
        if d > worst.0 {
            worst = (d, name.clone());
        }
    }
    worst
}

#[test]
fn two_synchronised_ranks_equal_one_process_with_twice_the_batch() {
    tch::set_num_threads(1);
    let tmp = common::temp_dir("ddp-train-sync-bn");
    let data = tmp.path().join("data");
    generate(
        &data,
        &SyntheticConfig {
            images: 60,
            size: 48,
            seed: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let one = train(&data, &tmp.path().join("one"), 1, 8, &[]);
    let synced = train(
        &data,
        &tmp.path().join("synced"),
        2,
        4,
        &["--sync-batchnorm"],
    );
    let (diff, name) = largest_difference(&one, &synced);
    eprintln!("synchronised vs one process: {diff:e} ({name})");
    assert!(diff <= 1e-5, "{name} differs by {diff}");
    // num_batches_tracked counted 6 batches on both sides (compared exactly above).
    let nbt = &one
        .iter()
        .find(|(n, _)| n == "features.1.num_batches_tracked")
        .unwrap()
        .1;
    assert_eq!(nbt.int64_value(&[]), 6);

    // Without synchronisation each rank normalises its own 4 samples: the test can fail.
    let local = train(&data, &tmp.path().join("local"), 2, 4, &[]);
    let (diff, name) = largest_difference(&one, &local);
    eprintln!("per-rank vs one process: {diff:e} ({name})");
    assert!(
        diff > 1e-3,
        "per-rank BatchNorm came within {diff} of the global one ({name}): the comparison \
         above would prove nothing"
    );
}

/// A task whose model has no synchronisable BatchNorm: a linear layer, and with `tch_bn`
/// tch's own `nn::batch_norm2d` too.
#[derive(Debug, Clone)]
struct NoNorm {
    tch_bn: bool,
}

impl Task for NoNorm {
    type Model = nn::Linear;
    type Data = ddp_data::TensorDataset;
    type Stats = NoStats;

    fn model(&self, root: &nn::Path) -> nn::Linear {
        if self.tch_bn {
            let _ = nn::batch_norm2d(root / "bn", 2, Default::default());
        }
        nn::linear(root / "fc", 2, 1, Default::default())
    }

    fn train_data(&self) -> Self::Data {
        let x = Tensor::zeros([8, 2], (Kind::Float, tch::Device::Cpu));
        let y = Tensor::zeros([8, 1], (Kind::Float, tch::Device::Cpu));
        ddp_data::TensorDataset::from_tensors(&x, &y).unwrap()
    }

    fn train_loss(&self, model: &nn::Linear, batch: &ddp_data::Batch) -> Tensor {
        batch
            .inputs()
            .apply(model)
            .mse_loss(batch.targets(), tch::Reduction::Mean)
    }

    fn new_stats(&self) -> NoStats {
        NoStats
    }

    fn eval_batch(&self, _: &nn::Linear, _: &ddp_data::Batch, _: &mut NoStats) -> Tensor {
        Tensor::from(0.0f32)
    }
}

/// `sync_batchnorm` with nothing to synchronise is refused before the ranks meet, naming the
/// setting, and tch's BatchNorm by its path.
#[test]
fn sync_batchnorm_without_batchnorm_is_refused_naming_the_setting() {
    let tmp = common::temp_dir("ddp-train-sync-bn-none");
    let refuse = |tch_bn| {
        let settings = Settings::default()
            .batch_size(2)
            .sync_batchnorm(true)
            .out(Some(PathBuf::from(tmp.path())));
        let env = ddp_comm::EnvConfig::new(0, 1, "127.0.0.1", free_port());
        let e = Trainer::with_env(NoNorm { tch_bn }, settings, &env).unwrap_err();
        let TrainError::Setting(s) = &e else {
            panic!("not a setting error: {e}");
        };
        assert_eq!(s.field(), "sync_batchnorm");
        e.to_string()
    };
    assert_eq!(
        refuse(false),
        "sync_batchnorm is set, but the model has no BatchNorm layer to synchronise"
    );
    assert_eq!(
        refuse(true),
        "sync_batchnorm is set, but the model's BatchNorm layers (bn) are not \
         ddp_model::norm::BatchNorm2d, which alone can synchronise: build them with \
         BatchNorm2d::new"
    );
}

/// The empty-batch test's rank: rank 0 has no samples, rank 1 has 4. Both run forward and
/// backward through a synchronised BatchNorm, then one more all-reduce that shows the
/// collectives stayed paired; rank 1's input gradient must be plain BatchNorm's on its batch.
#[test]
#[ignore = "a rank of an_empty_batch_on_one_rank_takes_part_in_forward_and_backward"]
fn empty_batch_worker() {
    use ddp_comm::{ProcessGroup, ReduceOp};
    use ddp_model::norm::BatchNorm2d;
    use ddp_train::functional::GroupReducer;
    use std::sync::Arc;

    tch::set_num_threads(1);
    let pg = Arc::new(ProcessGroup::from_env().unwrap());
    let rank = pg.rank();
    tch::manual_seed(7);
    let opts = (Kind::Float, tch::Device::Cpu);
    let full = Tensor::randn([4, 3, 5, 5], opts) * 1.5 + 0.3;
    let w = Tensor::randn([4, 3, 5, 5], opts);
    let (x, w) = if rank == 0 {
        (Tensor::zeros([0, 3, 5, 5], opts), w.narrow(0, 0, 0))
    } else {
        (full.copy(), w)
    };
    let x = x.set_requires_grad(true);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let bn = BatchNorm2d::new(vs.root() / "bn", 3);
    let reducer = Arc::new(GroupReducer::new(pg.clone()));
    bn.set_sync(Some(reducer.clone()));
    let y = bn.forward_t(&x, true);
    (&y * &w).sum(Kind::Float).backward();
    assert!(reducer.take_error().is_none());
    let mut after = vec![rank as f64 + 1.0];
    pg.all_reduce_slice(&mut after, ReduceOp::Sum).unwrap();
    assert_eq!(
        after,
        [3.0],
        "the collectives after the backward are still paired"
    );
    let running = vs.variables()["bn.running_mean"].copy();
    if rank == 1 {
        let alone = nn::VarStore::new(tch::Device::Cpu);
        let plain = BatchNorm2d::new(alone.root() / "bn", 3);
        let x1 = full.copy().set_requires_grad(true);
        (plain.forward_t(&x1, true) * &w)
            .sum(Kind::Float)
            .backward();
        let d = (x.grad() - x1.grad()).abs().max().double_value(&[]);
        assert!(d < 1e-5, "input gradient differs by {d}");
        let r = (&running - &alone.variables()["bn.running_mean"])
            .abs()
            .max()
            .double_value(&[]);
        assert!(r < 1e-6, "running mean differs by {r}");
    }
    assert!(bool::try_from(running.isfinite().all()).unwrap());
    println!("rank {rank}: ok");
}

/// A rank with an empty batch takes part in SyncBatchNorm's forward and backward all-reduces
/// (as PyTorch's does), so the other rank normalises with its own statistics alone and no
/// collective is left unpaired.
#[test]
fn an_empty_batch_on_one_rank_takes_part_in_forward_and_backward() {
    let children = common::spawn_worker_ranks("empty_batch_worker", 2, |_, cmd| {
        cmd.env("DDP_OP_TIMEOUT_S", "20")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
    });
    for (rank, out) in common::wait_all(children, Duration::from_secs(120))
        .iter()
        .enumerate()
    {
        assert!(out.status.success(), "rank {rank}:\n{}", text(out));
        assert!(
            text(out).contains(&format!("rank {rank}: ok")),
            "{}",
            text(out)
        );
    }
}
