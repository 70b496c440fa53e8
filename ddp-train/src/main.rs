//! `ddp-train`: one rank of a data-parallel training of the ConvNet on ODIR-5K, the ODIR
//! application of the generic Trainer.
//!
//! Start N of these with torchrun's environment (`ddp-run` and `cargo xtask train` do it, and
//! so do `torchrun --no-python` and `srun`), or let it start its own with
//! `--nproc-per-node N|gpu|cpu` (`ddp_train::cli::run`); see `ddp-train --help`. A launcher's
//! restart resumes from the run's latest checkpoint by itself (the Trainer's
//! `resume_after_restart`).

use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use ddp_train::odir::{OdirTask, TrainConfig};
use ddp_train::Trainer;

fn main() -> ExitCode {
    ddp_train::malloc::keep_freed_memory();
    ddp_train::logging::init();
    let config = TrainConfig::parse();
    ddp_train::cli::run(&config.train, || run(&config))
}

fn run(config: &TrainConfig) -> Result<()> {
    config.validate()?;
    let task = OdirTask::new(config)?;
    let settings = config.settings();
    let eval_only = settings.checkpoint.eval_only;
    let mut trainer = Trainer::new(task, settings)?;
    let rank0 = trainer.process_group().rank() == 0;
    if eval_only {
        let report = trainer.evaluate()?;
        if rank0 {
            println!("{}", serde_json::to_string(&report)?);
        }
        return Ok(());
    }
    let reports = trainer.run()?;
    if let (Some(last), true) = (reports.last(), rank0) {
        println!(
            "done: {} epochs, final validation macro-F1 {:.3}, micro-F1 {:.3}; run directory {}",
            last.epoch,
            last.metric("val_macro_f1").unwrap_or(f64::NAN),
            last.metric("val_micro_f1").unwrap_or(f64::NAN),
            trainer.out_dir().display()
        );
    }
    Ok(())
}
