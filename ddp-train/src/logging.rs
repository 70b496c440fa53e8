//! Showing the Trainer's log lines.
//!
//! The Trainer and the other crates report through [`tracing`] (the Trainer's lines also go
//! to `logs/rank-<r>.log` of the run directory); a program decides what to show by installing
//! a subscriber. [`init`] installs the one `ddp-train` uses.

use tracing::Level;
use tracing_subscriber::fmt::writer::MakeWriterExt;

/// Prints `tracing` events of level INFO and above as bare lines, the way `ddp-train` does:
/// rank 0's (torchrun's `RANK` or SLURM's `SLURM_PROCID` 0, or no launcher) on stdout,
/// except warnings and errors, which go to stderr like every other rank's lines (a launcher
/// prefixes those with the rank). Does nothing if the program already installed a
/// subscriber.
pub fn init() {
    // An unreadable environment fails the Trainer later, with the message; print as rank 0.
    let rank0 = ddp_comm::EnvConfig::from_env().map_or(true, |env| env.rank == 0);
    let builder = tracing_subscriber::fmt()
        .with_max_level(Level::INFO)
        .without_time()
        .with_target(false)
        .with_level(false)
        .with_ansi(false);
    let _ = if rank0 {
        let warnings = std::io::stderr.with_max_level(Level::WARN);
        builder
            .with_writer(warnings.or_else(std::io::stdout))
            .try_init()
    } else {
        builder.with_writer(std::io::stderr).try_init()
    };
}
