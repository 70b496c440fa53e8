//! `ddp-train`: one rank of a data-parallel training of the ConvNet on ODIR-5K.
//!
//! Start N of these with torchrun's environment (`ddp-run` and `cargo xtask train` do it, and
//! so do `torchrun --no-python` and `srun`); see `ddp-train --help`.

use std::process::ExitCode;

use anyhow::Result;
use clap::Parser;
use ddp_train::{TrainConfig, Trainer};

fn main() -> ExitCode {
    ddp_train::malloc::keep_freed_memory();
    let mut config = TrainConfig::parse();
    resume_after_restart(&mut config);
    match run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // A missing folder or a bad setting is the user's to fix, not a bug: the message
            // and its causes, without a backtrace (bugs panic, and keep theirs).
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// A launcher's restart (`ddp-run --max-restarts`, torchrun's) runs the same command again
/// with `TORCHELASTIC_RESTART_COUNT` raised, and expects the program to continue by itself:
/// with `--out` and a checkpoint in it, a restarted rank resumes from the latest one. An
/// explicit `--resume` wins; before the first checkpoint the run starts over.
fn resume_after_restart(config: &mut TrainConfig) {
    let restarted = ddp_comm::EnvConfig::from_env().is_ok_and(|env| env.restart_count > 0);
    if let (true, None, Some(out)) = (restarted, &config.resume, &config.out) {
        if ddp_train::state::checkpoint_dir(out)
            .join("latest")
            .is_file()
        {
            config.resume = Some("latest".to_string());
        }
    }
}

fn run(config: TrainConfig) -> Result<()> {
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
