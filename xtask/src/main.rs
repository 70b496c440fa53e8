//! Operator commands for the workspace: `cargo xtask <command>`.
//!
//! xtask must build before libtorch exists (it is what installs libtorch), so it never
//! depends on tch; and it must build in seconds on a fresh clone, so it depends on nothing
//! heavy either (not ddp-data's image stack): it drives the other crates through `cargo` and
//! their binaries, and starts ranks with the `ddp-run` library.

mod artifact;
mod bench;
mod folder_sync;
mod gpu_check;
mod launch;
mod setup;
mod temporaries;
mod test_suite;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    about = "Operator commands for the ddp workspace"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Install libtorch (the torch==2.13.0 Python wheel) into `.deps/` (idempotent).
    Setup(setup::SetupArgs),
    /// Run setup, `cargo fmt --check` and clippy, every test of the workspace (in parallel,
    /// the ten slowest named at the end), the doctests and the docs build.
    Test,
    /// Train the ConvNet with N ranks (default: every GPU, else 2 CPU ranks) on --data, or on
    /// the built-in synthetic ODIR sample.
    Train(launch::TrainArgs),
    /// Write a synthetic ODIR sample (full_df.csv + preprocessed_images/) to a folder.
    GenData(GenDataArgs),
    /// Run every benchmark and print ours next to PyTorch's, in one table (or JSON lines).
    Bench(bench::BenchArgs),
    /// The chaos test, longer than `test` runs it: faults (kill -9 or SIGTERM or SIGSTOP of
    /// a rank, kill -9 of the launcher) at random steps, then the weights of an uninterrupted
    /// run.
    Chaos(ChaosArgs),
    /// On a GPU machine: the NCCL tests, the NCCL bandwidth sweep, and trainings on one GPU
    /// and on every GPU.
    GpuCheck,
}

#[derive(Debug, clap::Args)]
struct GenDataArgs {
    /// Folder to write (created; a new or empty one).
    #[arg(long)]
    out: PathBuf,
    /// Number of images (two per patient).
    #[arg(long, default_value_t = 600)]
    images: usize,
    /// Side of the square images in pixels.
    #[arg(long, default_value_t = 256)]
    size: u32,
    /// Seed: the same seed writes the same files.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Use this ddp-gen-data binary instead of building one in release mode.
    #[arg(long, hide = true)]
    bin: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct ChaosArgs {
    /// Rounds of one fault each.
    #[arg(long, default_value_t = 24)]
    rounds: u64,
    /// Seed of the faults, their ranks and their steps: the same seed, the same faults.
    #[arg(long, default_value_t = 20261201)]
    seed: u64,
}

fn main() -> ExitCode {
    // `args_os`: `std::env::args` panics on a word that is not UTF-8; clap names it instead.
    let cli = Cli::parse_from(launch::launcher_flags_first(std::env::args_os().collect()));
    let root = project_root();
    let result = match cli.command {
        Cmd::Setup(args) => setup::run(&root, &args).map(drop),
        Cmd::Test => test_suite::run(&root),
        Cmd::Train(args) => train(&root, args),
        Cmd::GenData(args) => launch::generate_sample(
            &root,
            args.bin.as_deref(),
            &args.out,
            args.images,
            args.size,
            args.seed,
        ),
        Cmd::Bench(args) => bench::run(&root, args),
        Cmd::Chaos(args) => chaos(&root, &args),
        Cmd::GpuCheck => gpu_check::run(&root),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // What went wrong and why, without a backtrace: these are the user's or the
            // machine's problems, not xtask's bugs (those panic, with their backtrace).
            eprintln!("error: {}", ddp_run::cli::error_message(&err));
            ExitCode::FAILURE
        }
    }
}

/// Cargo's target folder: `CARGO_TARGET_DIR` (relative to the workspace, where cargo runs),
/// else `target/` in the workspace.
fn target_dir(root: &Path) -> PathBuf {
    root.join(std::env::var_os("CARGO_TARGET_DIR").unwrap_or_else(|| "target".into()))
}

/// Takes xtask's lock `name` in the target folder's `xtask/` (made if missing), printing
/// `waiting` first if another process holds it ([`setup::wait_for_lock`]).
fn target_lock(root: &Path, name: &str, waiting: &str) -> Result<Option<std::fs::File>> {
    let own = target_dir(root).join("xtask");
    std::fs::create_dir_all(&own).with_context(|| format!("cannot create {}", own.display()))?;
    setup::wait_for_lock(&own.join(name), waiting)
}

/// The workspace root: xtask lives one folder below it.
fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask is one folder below the workspace root")
        .to_path_buf()
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Runs `cmd` in `root`, failing with the command line when it does not succeed.
fn run(root: &Path, mut cmd: Command) -> Result<()> {
    cmd.current_dir(root);
    let line = format!("{cmd:?}");
    println!("xtask: {line}");
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {line}"))?;
    if !status.success() {
        bail!("{line} failed ({status})");
    }
    Ok(())
}

/// The chaos test (`xtask/tests/chaos.rs`) with `args`' rounds and seed, its progress shown.
fn chaos(root: &Path, args: &ChaosArgs) -> Result<()> {
    setup::run(root, &setup::SetupArgs::default())?;
    let mut test = cargo();
    test.args([
        "test",
        "-p",
        "xtask",
        "--test",
        "chaos",
        "--",
        "--nocapture",
    ])
    .env("DDP_CHAOS_ROUNDS", args.rounds.to_string())
    .env("DDP_CHAOS_SEED", args.seed.to_string());
    run(root, test)
}

fn train(root: &Path, args: launch::TrainArgs) -> Result<()> {
    let code = launch::run(root, args)?;
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    // The build scripts' copy, which they name when libtorch is missing.
    include!("../../shared-src/torch_version.rs");

    #[test]
    fn the_build_scripts_name_the_torch_setup_installs() {
        assert_eq!(TORCH_VERSION, crate::setup::TORCH_VERSION);
    }
}
