//! A ResNet-18 (tch's `vision::resnet`) on an in-memory image set, trained with AdamW, a
//! linear warmup into a cosine decay (stepped per optimizer step) and gradient clipping by
//! global norm: the recipe of most image models today, with every setting a flag.
//!
//! ```sh
//! cargo run --release --example resnet -- --nproc-per-node 2 --out runs/resnet
//! ```
//!
//! The images are generated (class `c` is a bright square in quadrant `c` over noise) and
//! held as bytes; batches convert them to `[0, 1]` floats, on the GPU when training on one.

use std::process::ExitCode;

use clap::Parser;
use ddp_data::rng::SampleRng;
use ddp_data::Affine;
use ddp_data::{Array, Batch, DataError, TensorDataset};
use ddp_train::cli::{Defaults, TrainArgs};
use ddp_train::lr_schedule::LrSchedule;
use ddp_train::optim::{AdamConfig, OptimizerConfig};
use ddp_train::{Monitor, MultiClassStats, Settings, Task, Trainer};
use tch::nn::{self, FuncT, ModuleT};
use tch::vision::resnet;
use tch::{Reduction, Tensor};

const CLASSES: usize = 4;
const SIZE: usize = 32;

/// `count` RGB images of `SIZE` pixels: class `c` is a bright square in quadrant `c`.
fn images(count: usize, seed: u64) -> Result<TensorDataset, DataError> {
    let (mut pixels, mut classes) = (Vec::with_capacity(count * 3 * SIZE * SIZE), Vec::new());
    for i in 0..count {
        let mut rng = SampleRng::new(seed, 0, i as u64);
        let class = rng.below(CLASSES as u64) as usize;
        let (top, left) = (class / 2 * SIZE / 2, class % 2 * SIZE / 2);
        for _channel in 0..3 {
            for y in 0..SIZE {
                for x in 0..SIZE {
                    let inside =
                        (top..top + SIZE / 2).contains(&y) && (left..left + SIZE / 2).contains(&x);
                    let noise = rng.below(128) as u8;
                    pixels.push(if inside { 96 + noise } else { noise });
                }
            }
        }
        classes.push(class as i64);
    }
    let to_unit = Affine {
        scale: vec![1.0 / 255.0; 3],
        bias: vec![0.0; 3],
    };
    TensorDataset::new(
        Array::new(pixels, [count, 3, SIZE, SIZE])?,
        Array::from(classes),
    )?
    .with_affine(to_unit)
}

struct Images {
    train: TensorDataset,
    val: TensorDataset,
}

impl Task for Images {
    type Model = FuncT<'static>;
    type Data = TensorDataset;
    type Stats = MultiClassStats;

    fn model(&self, root: &nn::Path) -> FuncT<'static> {
        resnet::resnet18(root, CLASSES as i64)
    }

    fn train_data(&self) -> TensorDataset {
        self.train.clone()
    }

    fn val_data(&self) -> Option<TensorDataset> {
        Some(self.val.clone())
    }

    fn train_loss(&self, model: &FuncT<'static>, batch: &Batch) -> Tensor {
        // BatchNorm in training mode: batch statistics, running averages updated.
        let logits = model.forward_t(batch.inputs(), true);
        logits.cross_entropy_loss::<Tensor>(batch.targets(), None, Reduction::Mean, -100, 0.0)
    }

    fn new_stats(&self) -> MultiClassStats {
        MultiClassStats::new(CLASSES)
    }

    fn eval_batch(&self, model: &Self::Model, batch: &Batch, stats: &mut Self::Stats) -> Tensor {
        let logits = model.forward_t(batch.inputs(), false);
        stats.add(&logits, batch.targets());
        logits.cross_entropy_loss::<Tensor>(batch.targets(), None, Reduction::Sum, -100, 0.0)
    }
}

/// The recipe, as the flags' defaults: AdamW, 10 warmup steps into a cosine, clipping at 1.0,
/// 5 epochs, the best accuracy's model kept.
struct Recipe;

impl Defaults for Recipe {
    fn settings() -> Settings {
        let adamw = AdamConfig {
            weight_decay: 0.05,
            ..AdamConfig::default()
        };
        Settings::default()
            .optimizer(OptimizerConfig::AdamW(adamw))
            .lr_schedule(LrSchedule::Cosine { warmup: 10 })
            .clip_grad_norm(Some(1.0))
            .epochs(5)
            .monitor(Monitor::max("val_accuracy", "best.safetensors"))
    }
}

/// ResNet-18 on generated images: every training flag (defaults: AdamW, warmup + cosine,
/// clipping at 1.0), and `--nproc-per-node N` to start N ranks.
#[derive(Parser)]
struct Cli {
    /// Training images.
    #[arg(long, default_value_t = 256)]
    images: usize,
    #[command(flatten)]
    train: TrainArgs<Recipe>,
}

fn main() -> ExitCode {
    ddp_train::logging::init();
    let cli = Cli::parse();
    ddp_train::cli::run(&cli.train, || {
        let task = Images {
            train: images(cli.images, 1)?,
            val: images(cli.images / 4, 2)?,
        };
        Trainer::new(task, cli.train.settings())?.run()?;
        Ok(())
    })
}
