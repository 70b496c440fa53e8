//! A text classifier in the style of the second PyTorch DDP tutorial this project starts
//! from: variable-length token sequences padded per batch (its `collate_fn`), an embedding
//! and a 1-D convolution with max-pooling over the real positions, cross-entropy over `i64`
//! class indices, macro/micro F1 from the built-in statistics, `ReduceLROnPlateau('max')`
//! on macro-F1, and the best macro-F1 and best micro-F1 models in their own files.
//!
//! ```sh
//! cargo run --example text -- --nproc-per-node 2 --out runs/text
//! ```
//!
//! The corpus is generated: each text is 6 to 35 filler tokens with a keyword of its class
//! somewhere in it (so the model must find it wherever it is), and one text in four also
//! has another class's keyword, or its own overwritten by it.

use std::process::ExitCode;

use clap::Parser;
use ddp_data::rng::SampleRng;
use ddp_data::{Array, Batch, DataError, PadTo, Padding, TensorDataset};
use ddp_train::cli::{Defaults, TrainArgs};
use ddp_train::lr_schedule::{LrSchedule, Plateau};
use ddp_train::{Monitor, MultiClassStats, Settings, Task, Trainer};
use tch::nn::{self, Module};
use tch::{Reduction, Tensor};

/// Token 0 pads; tokens `1 + 4c .. 5 + 4c` are class `c`'s keywords; the rest are filler.
const VOCAB: u64 = 64;
const CLASSES: u64 = 4;
const FILLER: u64 = 1 + 4 * CLASSES;

/// `count` texts and their classes, each a pure function of `(seed, index)`.
fn corpus(count: usize, seed: u64) -> Result<TensorDataset, DataError> {
    let (mut texts, mut classes) = (Vec::new(), Vec::new());
    for i in 0..count {
        let mut rng = SampleRng::new(seed, 0, i as u64);
        let class = rng.below(CLASSES);
        let len = 6 + rng.below(30) as usize;
        let mut ids: Vec<i64> = (0..len)
            .map(|_| (FILLER + rng.below(VOCAB - FILLER)) as i64)
            .collect();
        ids[rng.below(len as u64) as usize] = (1 + 4 * class + rng.below(4)) as i64;
        if rng.below(4) == 0 {
            // A distractor: another class's keyword (the text is then ambiguous).
            let other = (class + 1 + rng.below(CLASSES - 1)) % CLASSES;
            ids[rng.below(len as u64) as usize] = (1 + 4 * other + rng.below(4)) as i64;
        }
        texts.push(ids);
        classes.push(class as i64);
    }
    let padding = Padding {
        value: 0.0,
        to: PadTo::Longest,
    };
    TensorDataset::sequences(texts, Array::from(classes), padding)
}

/// Embedding, convolution over time, max over the real positions, linear head.
#[derive(Debug)]
struct TextCnn {
    embed: nn::Embedding,
    conv: nn::Conv1D,
    head: nn::Linear,
}

impl TextCnn {
    /// `[B, classes]` logits of a padded batch of token ids.
    fn logits(&self, batch: &Batch) -> Tensor {
        let mask = batch.mask().expect("the corpus is padded");
        // Padding positions embed to zeros, as the convolution's own zero padding: a text's
        // logits do not depend on how far its batch is padded.
        let x = self.embed.forward(batch.inputs()) * mask.unsqueeze(-1);
        let h = self.conv.forward(&x.transpose(1, 2)).relu();
        let h = h.masked_fill(&mask.logical_not().unsqueeze(1), f64::NEG_INFINITY);
        self.head.forward(&h.amax([2], false))
    }
}

struct TextTask {
    train: TensorDataset,
    val: TensorDataset,
}

impl Task for TextTask {
    type Model = TextCnn;
    type Data = TensorDataset;
    type Stats = MultiClassStats;

    fn model(&self, root: &nn::Path) -> TextCnn {
        let conv = nn::ConvConfig {
            padding: 1,
            ..Default::default()
        };
        TextCnn {
            embed: nn::embedding(root / "embed", VOCAB as i64, 32, Default::default()),
            conv: nn::conv1d(root / "conv", 32, 64, 3, conv),
            head: nn::linear(root / "head", 64, CLASSES as i64, Default::default()),
        }
    }

    fn train_data(&self) -> TensorDataset {
        self.train.clone()
    }

    fn val_data(&self) -> Option<TensorDataset> {
        Some(self.val.clone())
    }

    fn train_loss(&self, model: &TextCnn, batch: &Batch) -> Tensor {
        let logits = model.logits(batch);
        logits.cross_entropy_loss::<Tensor>(batch.targets(), None, Reduction::Mean, -100, 0.0)
    }

    fn new_stats(&self) -> MultiClassStats {
        MultiClassStats::new(CLASSES as usize)
    }

    fn eval_batch(&self, model: &TextCnn, batch: &Batch, stats: &mut MultiClassStats) -> Tensor {
        let logits = model.logits(batch);
        stats.add(&logits, batch.targets());
        logits.cross_entropy_loss::<Tensor>(batch.targets(), None, Reduction::Sum, -100, 0.0)
    }
}

/// This program's defaults for the training flags, one line each: `--help` shows them, and a
/// flag given on the command line overrides its own.
struct TextDefaults;

impl Defaults for TextDefaults {
    fn settings() -> Settings {
        Settings::default()
            .epochs(5)
            .batch_size(16)
            // ReduceLROnPlateau('max') on macro-F1, unless --lr-schedule picks another.
            .lr_schedule(LrSchedule::Plateau(Plateau::max("val_macro_f1")))
            .monitor(Monitor::max("val_macro_f1", "best_macro.safetensors"))
            .monitor(Monitor::max("val_micro_f1", "best_micro.safetensors"))
    }
}

/// A text classifier on generated token sequences: every training flag, and
/// `--nproc-per-node N` to start N ranks.
#[derive(Parser)]
struct Cli {
    /// Training texts.
    #[arg(long, default_value_t = 512)]
    texts: usize,
    #[command(flatten)]
    train: TrainArgs<TextDefaults>,
}

fn main() -> ExitCode {
    ddp_train::logging::init();
    let cli = Cli::parse();
    ddp_train::cli::run(&cli.train, || {
        let task = TextTask {
            train: corpus(cli.texts, 1)?,
            val: corpus(cli.texts / 4, 2)?,
        };
        Trainer::new(task, cli.train.settings())?.run()?;
        Ok(())
    })
}
