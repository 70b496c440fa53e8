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

use clap::{CommandFactory, FromArgMatches, Parser};
use ddp_data::rng::SampleRng;
use ddp_data::sample::{Input, SampleLayout, SampleOut};
use ddp_data::{Batch, DataError, Dataset};
use ddp_train::cli::TrainArgs;
use ddp_train::{Monitor, RegressionStats, Task, Trainer};
use tch::{nn, nn::Module, Reduction, Tensor};

/// Inputs per point.
const FEATURES: usize = 4;

/// `count` points `x` in [-1, 1)^4 with target `y = 2 x0 - x1 + 0.5 x2 + 0.1 sin(7 x3)`,
/// each a pure function of its index (so every rank sees the same point `i`).
#[derive(Debug, Clone)]
struct Points {
    count: usize,
    offset: u64,
}

impl Points {
    fn x(&self, index: usize) -> [f32; FEATURES] {
        let mut state = (index as u64 + self.offset).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        std::array::from_fn(|_| {
            state ^= state >> 29;
            state = state.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            state ^= state >> 32;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
    }
}

impl Dataset for Points {
    type Worker = ();

    fn len(&self) -> usize {
        self.count
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout {
            shape: vec![FEATURES],
            targets: 1,
            bytes: None,
        }
    }

    fn worker(&self) {}

    fn write(
        &self,
        _worker: &mut (),
        index: usize,
        _rng: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        let x = self.x(index);
        if let Input::F32(input) = out.input {
            input.copy_from_slice(&x);
        }
        out.targets[0] = 2.0 * x[0] - x[1] + 0.5 * x[2] + 0.1 * (7.0 * x[3]).sin();
        Ok(())
    }
}

/// The regression task: an MLP, mean squared error, and the validation MSE and MAE.
struct Regression;

impl Task for Regression {
    type Model = nn::Sequential;
    type Data = Points;
    type Stats = RegressionStats;

    fn model(&self, root: &nn::Path) -> nn::Sequential {
        nn::seq()
            .add(nn::linear(
                root / "0",
                FEATURES as i64,
                16,
                Default::default(),
            ))
            .add_fn(|x| x.relu())
            .add(nn::linear(root / "2", 16, 1, Default::default()))
    }

    fn train_data(&self) -> Points {
        Points {
            count: 256,
            offset: 0,
        }
    }

    fn val_data(&self) -> Option<Points> {
        Some(Points {
            count: 60,
            offset: 1 << 20,
        })
    }

    fn train_loss(&self, model: &nn::Sequential, batch: &Batch) -> Tensor {
        model
            .forward(batch.inputs())
            .mse_loss(batch.targets(), Reduction::Mean)
    }

    fn new_stats(&self) -> RegressionStats {
        RegressionStats::default()
    }

    fn eval_batch(
        &self,
        model: &nn::Sequential,
        batch: &Batch,
        stats: &mut RegressionStats,
    ) -> Tensor {
        let predictions = model.forward(batch.inputs());
        stats.add(&predictions, batch.targets());
        predictions.mse_loss(batch.targets(), Reduction::Sum)
    }
}

/// The example's command line: every training flag, with the example's own defaults.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() -> ExitCode {
    // The Trainer's lines: rank 0's on stdout, the others' on stderr.
    ddp_train::logging::init();
    let defaults = [
        ("epochs", "3"),
        ("batch_size", "8"),
        ("seed", "42"),
        ("optimizer", "sgd"),
        ("lr", "0.05"),
        ("momentum", "0.9"),
    ];
    let command = defaults.iter().fold(Cli::command(), |c, &(arg, value)| {
        c.mut_arg(arg, |a| a.default_value(value))
    });
    let cli = Cli::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit());
    // 75 after a requested stop (SIGTERM, SIGUSR1, --time-limit): "to be continued".
    ddp_train::cli::run(&cli.train, || {
        let settings = cli.train.settings();
        let settings = settings.monitor(Monitor::min("val_loss", "best.safetensors"));
        let mut trainer = Trainer::new(Regression, settings)?;
        let reports = trainer.run()?;
        if let (Some(last), 0) = (reports.last(), trainer.process_group().rank()) {
            println!(
                "done: validation MSE {:.4} after {} epochs",
                last.val_loss.unwrap_or(f64::NAN),
                last.epoch
            );
        }
        Ok(())
    })
}
