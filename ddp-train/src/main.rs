//! `ddp-train`: one rank of a data-parallel training of the ConvNet on ODIR-5K.
//!
//! Start N of these with torchrun's environment (`cargo xtask train` does it, and so do
//! `torchrun --no-python` and `srun`); see `ddp-train --help`.

use anyhow::Result;
use clap::Parser;
use ddp_train::{TrainConfig, Trainer};

fn main() -> Result<()> {
    ddp_train::malloc::keep_freed_memory();
    let config = TrainConfig::parse();
    let eval_only = config.eval_only;
    let mut trainer = Trainer::new(config)?;
    if eval_only {
        let m = trainer.evaluate_only()?;
        if std::env::var("RANK").map_or(true, |r| r == "0") {
            println!("{}", serde_json::to_string(&m)?);
        }
        return Ok(());
    }
    let metrics = trainer.run()?;
    if let Some(last) = metrics.last() {
        if std::env::var("RANK").map_or(true, |r| r == "0") {
            println!(
                "done: {} epochs, final validation macro-F1 {:.3}, micro-F1 {:.3}; run directory {}",
                last.epoch,
                last.val_macro_f1,
                last.val_micro_f1,
                trainer.out_dir().display()
            );
        }
    }
    Ok(())
}
