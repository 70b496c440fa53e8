//! Your own model and data with the generic Trainer: a small MLP learns a noisy linear map
//! from generated points, on as many ranks as the launcher starts.
//!
//! ```sh
//! cargo build --example mlp -p ddp-train --no-default-features --features cli
//! ddp-run --nproc-per-node 2 -- target/debug/examples/mlp --out runs/mlp --batch-size 8
//! target/debug/examples/mlp --out runs/mlp-1 --batch-size 16   # one process, same steps
//! target/debug/examples/mlp --help                               # every training flag
//! ```
//!
//! With SGD, 2 ranks of batch B take exactly the steps of one process with batch 2B: the
//! sampler deals the same shuffled order to both, DDP averages the two ranks' gradients, and
//! the mean of two means of B samples is the mean over 2B (`tests/example.rs` checks it).

use std::process::ExitCode;

use clap::Parser;
use ddp_data::{Batch, TensorDataset};
use ddp_train::cli::TrainArgs;
use ddp_train::{Monitor, RegressionStats, Task, Trainer};
use tch::{nn, nn::Module, Device, Kind, Reduction, Tensor};

/// `count` points x in [-1, 1)^4 with y = 2 x0 - x1 + 0.5 x2 + 0.1 sin(7 x3); the same on
/// every rank (libtorch's generator seeded with `seed`).
fn points(count: i64, seed: i64) -> Result<TensorDataset, ddp_data::DataError> {
    tch::manual_seed(seed);
    let x = Tensor::rand([count, 4], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
    let w = Tensor::from_slice(&[2f32, -1.0, 0.5, 0.0]);
    let y = x.matmul(&w) + (x.select(1, 3) * 7.0).sin() * 0.1;
    TensorDataset::from_tensors(&x, &y.unsqueeze(1))
}

/// The regression task: an MLP, mean squared error, and the validation MSE and MAE.
struct Regression {
    train: TensorDataset,
    val: TensorDataset,
}

impl Task for Regression {
    type Model = nn::Sequential;
    type Data = TensorDataset;
    type Stats = RegressionStats;

    fn model(&self, root: &nn::Path) -> nn::Sequential {
        nn::seq()
            .add(nn::linear(root / "0", 4, 16, Default::default()))
            .add_fn(|x| x.relu())
            .add(nn::linear(root / "2", 16, 1, Default::default()))
    }

    fn train_data(&self) -> TensorDataset {
        self.train.clone()
    }

    fn val_data(&self) -> Option<TensorDataset> {
        Some(self.val.clone())
    }

    fn train_loss(&self, model: &nn::Sequential, batch: &Batch) -> Tensor {
        let predictions = model.forward(batch.inputs());
        predictions.mse_loss(batch.targets(), Reduction::Mean)
    }

    fn new_stats(&self) -> RegressionStats {
        RegressionStats::default()
    }

    fn eval_batch(&self, model: &Self::Model, batch: &Batch, stats: &mut Self::Stats) -> Tensor {
        let predictions = model.forward(batch.inputs());
        stats.add(&predictions, batch.targets());
        predictions.mse_loss(batch.targets(), Reduction::Sum)
    }
}

/// An MLP on generated points: every training flag, and `--nproc-per-node N` to start N ranks.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() -> ExitCode {
    ddp_train::logging::init();
    let cli = Cli::parse();
    // Errors without backtraces; 75 after a requested stop (SIGTERM, --time-limit).
    ddp_train::cli::run(&cli.train, || {
        let task = Regression {
            train: points(256, 1)?,
            val: points(60, 2)?,
        };
        let best = Monitor::min("val_loss", "best.safetensors");
        Trainer::new(task, cli.train.settings().monitor(best))?.run()?;
        Ok(())
    })
}
