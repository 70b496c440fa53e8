//! Your own model and data with the generic Trainer: a small MLP learns a noisy linear map
//! from generated points, on as many ranks as the launcher starts.
//!
//! ```sh
//! cargo build --example mlp -p ddp-train --no-default-features
//! ddp-run --nproc-per-node 2 -- target/debug/examples/mlp --out runs/mlp --batch-size 8
//! target/debug/examples/mlp --out runs/mlp-1 --batch-size 16   # one process, same steps
//! ```
//!
//! With SGD, 2 ranks of batch B take exactly the steps of one process with batch 2B: the
//! sampler deals the same shuffled order to both, DDP averages the two ranks' gradients, and
//! the mean of two means of B samples is the mean over 2B (`tests/example.rs` checks it).

use std::path::PathBuf;

use ddp_data::rng::SampleRng;
use ddp_data::sample::{Input, SampleLayout, SampleOut};
use ddp_data::{Batch, DataError, Dataset};
use ddp_train::optim::{OptimizerConfig, SgdConfig};
use ddp_train::{Monitor, Settings, Stats, Task, TrainError, Trainer};
use serde_json::{Map, Value};
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

/// The regression task: an MLP, mean squared error, and the validation MSE as its metric.
struct Regression;

/// Squared errors and samples, summed over ranks.
struct Errors {
    squared: f64,
}

impl Stats for Errors {
    fn to_sums(&self) -> Vec<f64> {
        vec![self.squared]
    }

    fn set_sums(&mut self, sums: &[f64]) {
        self.squared = sums[0];
    }

    fn report(&self) -> Map<String, Value> {
        Map::from_iter([("val_sse".to_string(), self.squared.into())])
    }
}

impl Task for Regression {
    type Model = nn::Sequential;
    type Data = Points;
    type Stats = Errors;

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

    fn new_stats(&self) -> Errors {
        Errors { squared: 0.0 }
    }

    fn eval_batch(&self, model: &nn::Sequential, batch: &Batch, stats: &mut Errors) -> Tensor {
        let sse = model
            .forward(batch.inputs())
            .mse_loss(batch.targets(), Reduction::Sum);
        stats.squared += sse.double_value(&[]);
        sse
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The Trainer's lines: rank 0's on stdout, the others' on stderr.
    ddp_train::logging::init();
    let mut settings = Settings::default()
        .epochs(3)
        .batch_size(8)
        .seed(42)
        .optimizer(OptimizerConfig::Sgd(SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.0,
        }))
        .monitor(Monitor::min("val_loss", "best.safetensors"));
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--out" => settings = settings.out(Some(PathBuf::from(value()?))),
            "--batch-size" => settings = settings.batch_size(value()?.parse()?),
            "--epochs" => settings = settings.epochs(value()?.parse()?),
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    let mut trainer = Trainer::new(Regression, settings)?;
    let reports = match trainer.run() {
        // SIGTERM, SIGUSR1 or the time limit: a checkpoint was written; the launcher
        // reads exit code 75 as "stopped, to be continued", not as a failure.
        Err(stopped @ TrainError::Stopped { .. }) => {
            eprintln!("{stopped}");
            std::process::exit(stopped.exit_code().into());
        }
        other => other?,
    };
    if let Some(last) = reports.last() {
        if trainer.process_group().rank() == 0 {
            println!(
                "done: validation MSE {:.4} after {} epochs",
                last.val_loss.unwrap_or(f64::NAN),
                last.epoch
            );
        }
    }
    Ok(())
}
