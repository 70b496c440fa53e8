//! `cargo xtask train`: the ODIR application's front door, a thin caller of `ddp-run`.
//!
//! What is ODIR's is here: building `ddp-train`, the built-in synthetic sample in `.cache/`
//! and its training settings, the run directory, `--device` and `--threads` for each rank,
//! and the run directory's checkpoint in the restart message. Starting and supervising the
//! ranks (torchrun's environment, logs, fail-fast, restarts, signals) is `ddp_run::launch`.
//! A restarted `ddp-train` resumes from the latest checkpoint by itself, as torchrun expects
//! of its programs.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::builder::TypedValueParser;
use clap::CommandFactory;
use ddp_run::cli::{eprint_line, print_line, NodeArgs, Wording};
use ddp_run::{Event, LaunchConfig, Outcome, RankFailure};

use crate::temporaries::{temporary, RemoveOnDrop};

/// Options of `cargo xtask train`; every argument after them goes to `ddp-train`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Every other argument is passed to each ddp-train rank \
    (see `cargo run -p ddp-train -- --help`): --data, --epochs, --batch-size, ...")]
pub struct TrainArgs {
    /// N ranks on GPUs cuda:0..N-1 of the visible devices (CUDA_VISIBLE_DEVICES is respected).
    #[arg(long, conflicts_with = "cpus")]
    pub gpus: Option<usize>,
    /// N ranks on the CPU.
    #[arg(long)]
    pub cpus: Option<usize>,
    #[command(flatten)]
    pub node: NodeArgs,
    /// Run directory (default: runs/YYYYMMDD-HHMMSS-PID, UTC; with --nnodes above 1, needed:
    /// the same path on storage every node shares).
    #[arg(long, value_parser = utf8_path())]
    pub out: Option<PathBuf>,
    /// Seconds the ranks get to end, after a rank's failure or a signal (SIGTERM, SIGUSR1:
    /// a stop at a checkpoint must fit in them), before they are killed.
    #[arg(
        long,
        default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(..=ddp_run::MAX_WAIT.as_secs())
    )]
    pub grace: u64,
    /// Folder of the generated synthetic sample (default: .cache/ in the project).
    #[arg(long, hide = true)]
    pub cache: Option<PathBuf>,
    /// Folder of default run directories (default: runs/ in the project).
    #[arg(long, hide = true)]
    pub runs_root: Option<PathBuf>,
    /// Use this ddp-train binary instead of building one in release mode.
    #[arg(long, hide = true)]
    pub bin: Option<PathBuf>,
    /// Use this ddp-gen-data binary instead of building one in release mode.
    #[arg(long, hide = true)]
    pub gen_data_bin: Option<PathBuf>,
    /// Arguments for ddp-train.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub rest: Vec<String>,
}

/// Why a path the ranks are given cannot be: ddp-train takes its paths as text (it records
/// them in `config.json`), and a lossy copy would name another file.
const NOT_UTF8: &str = "is not valid UTF-8, and ddp-train takes its paths as text: rename it \
                        or give another path";

/// A path flag's parser that refuses a path that is not valid UTF-8 ([`NOT_UTF8`]).
fn utf8_path() -> impl TypedValueParser<Value = PathBuf> {
    clap::builder::OsStringValueParser::new().try_map(|s: std::ffi::OsString| {
        s.into_string()
            .map(PathBuf::from)
            .map_err(|_| format!("the path {NOT_UTF8}"))
    })
}

/// `path` as the text a rank's flag takes, or an error naming `what` it is.
fn utf8<'a>(what: &str, path: &'a Path) -> Result<&'a str> {
    path.to_str()
        .with_context(|| format!("{what} {} {NOT_UTF8}", path.display()))
}

/// Moves the launcher's options (after `train`) in front of ddp-train's, so that
/// `cargo xtask train --epochs 3 --max-restarts 1` means what it says. The launcher's options
/// are read from its clap definition, with their aliases.
pub fn launcher_flags_first(args: Vec<OsString>) -> Vec<OsString> {
    let Some(pos) = args.iter().position(|a| a == "train") else {
        return args;
    };
    let cli = crate::Cli::command();
    let Some(train) = cli.find_subcommand("train") else {
        return args;
    };
    // (name, takes a value) for each of the launcher's long options.
    let ours: Vec<(String, bool)> = train
        .get_arguments()
        .filter(|a| a.get_long().is_some())
        .flat_map(|a| {
            let takes_value = a.get_action().takes_values();
            let names: Vec<String> = a
                .get_long_and_visible_aliases()
                .into_iter()
                .flatten()
                .chain(a.get_all_aliases().into_iter().flatten())
                .map(|n| format!("--{n}"))
                .collect();
            names.into_iter().map(move |n| (n, takes_value))
        })
        .collect();
    let (head, tail) = args.split_at(pos + 1);
    let (mut launcher, mut trainer) = (Vec::new(), Vec::new());
    let mut it = tail.iter().cloned();
    while let Some(a) = it.next() {
        // A word that is not UTF-8 is no flag name of ours (clap then names it).
        let text = a.to_string_lossy();
        let name = text.split('=').next().unwrap_or(&text).to_owned();
        match ours.iter().find(|(n, _)| *n == name) {
            Some(&(_, takes_value)) => {
                let inline = text.contains('=');
                launcher.push(a);
                if takes_value && !inline {
                    launcher.extend(it.next());
                }
            }
            None => trainer.push(a),
        }
    }
    head.iter()
        .cloned()
        .chain(launcher)
        .chain(trainer)
        .collect()
}

/// The built-in sample: the defaults that make the first run finish in minutes on 2 cores.
const SAMPLE_IMAGES: usize = 800;
const SAMPLE_SIZE: u32 = 128;
const SAMPLE_SEED: u64 = 0;
/// ddp-train settings for the built-in sample (each overridable by the user's own flags).
const SAMPLE_DEFAULTS: &[(&str, &str)] = &[
    ("--epochs", "8"),
    ("--image-size", "96"),
    ("--batch-size", "16"),
    ("--lr", "0.002"),
    ("--min-crop-scale", "0.5"),
    ("--dropout", "0.2"),
];

/// Adds to the ranks' flags `rest` the sample's [`SAMPLE_DEFAULTS`] they do not give, but
/// none that ddp-train would refuse: `--dropout` with torchvision's ResNets (which have
/// none), and the training flags (`--epochs`, `--lr`, `--min-crop-scale`) with `--eval-only`.
fn sample_flags(rest: &mut Vec<String>) {
    let resnet = flag_value(rest, "--model").is_some_and(|m| m.starts_with("resnet"));
    let evaluating = rest
        .iter()
        .rev()
        .find_map(|a| match a.as_str() {
            "--eval-only" => Some(true),
            _ => a.strip_prefix("--eval-only=").map(|v| v != "false"),
        })
        .unwrap_or(false);
    for (flag, value) in SAMPLE_DEFAULTS {
        let unused = (resnet && *flag == "--dropout")
            || (evaluating && ["--epochs", "--lr", "--min-crop-scale"].contains(flag));
        if !has_flag(rest, flag) && !unused {
            rest.extend([flag.to_string(), value.to_string()]);
        }
    }
}

/// Refuses, before anything is built, the ranks' flags that the launcher sets (the run
/// directory, the device, the number of ranks) and what needs the run directory the user
/// did not give.
fn refuse_what_the_launcher_sets(args: &TrainArgs) -> Result<()> {
    let rest = &args.rest;
    if has_flag(rest, "--out") {
        bail!("give the run directory to the launcher as `cargo xtask train --out DIR ...`");
    }
    if has_flag(rest, "--device") {
        bail!(
            "the launcher gives each rank its device: choose with `cargo xtask train --gpus N` \
             or `--cpus N` instead of --device"
        );
    }
    // torchrun's spellings, which ddp-train takes only to start ranks of its own.
    if let Some(flag) = ["--nproc-per-node", "--nproc_per_node"]
        .into_iter()
        .find(|flag| has_flag(rest, flag))
    {
        bail!(
            "the launcher starts the ranks: choose how many with `cargo xtask train --gpus N` \
             or `--cpus N` instead of {flag}"
        );
    }
    if args.out.is_none() && flag_value(rest, "--resume") == Some("latest") {
        bail!(
            "--resume latest needs the run, and without --out the launcher makes a new one: \
             cargo xtask train --out runs/<run> --resume latest"
        );
    }
    if args.node.nnodes > 1 && args.out.is_none() {
        bail!(
            "--nnodes {} needs --out DIR, the same path on storage every node shares \
             (e.g. --out /shared/runs/odir): without it each node names its own run \
             directory, and a restart or a stopped run cannot continue",
            args.node.nnodes
        );
    }
    Ok(())
}

/// The advice of `ddp-run`'s messages in the launcher's words: `--grace` for the shutdown
/// timeout, the run directory for the rank logs' folder (its `logs/`).
fn wording() -> Wording {
    Wording {
        longer_shutdown: "--grace".into(),
        log_dir: "--out (the rank logs go to its logs/ folder)".into(),
        ..Wording::default()
    }
}

/// What a rank given `--device cuda` says when CUDA cannot be used there (ddp-train's
/// `DeviceChoice::resolve`): a driver older than libtorch's CUDA, under GPUs that nvidia-smi
/// lists.
const NO_CUDA: &str = "CUDA is not available here";

/// The launcher's advice after a rank's `failure` on `device` when the rank found CUDA
/// unusable: the rank's own advice names `--device`, which the launcher sets.
fn cuda_advice(device: &str, failure: &RankFailure) -> Option<&'static str> {
    let no_cuda = device == "cuda" && failure.tail.iter().any(|line| line.contains(NO_CUDA));
    no_cuda.then_some(
        "the ranks cannot use CUDA here, though nvidia-smi lists GPUs: use `cargo xtask train \
         --cpus N` to train on CPU ranks (the launcher sets each rank's --device)",
    )
}

/// Runs the job; returns the process exit code for `main`.
pub fn run(root: &Path, args: TrainArgs) -> Result<i32> {
    let (nproc, device) = ranks_and_device(&args, ddp_run::visible_gpus())?;
    refuse_what_the_launcher_sets(&args)?;
    let mut rest = args.rest.clone();
    let mut config = LaunchConfig::new("ddp-train", nproc);
    args.node.apply(&mut config);
    // Bad node settings fail here, before anything is built.
    config.validate()?;
    // The paths the ranks are given, as text, before anything is built.
    let runs_root = args.runs_root.clone().unwrap_or_else(|| root.join("runs"));
    let out = match &args.out {
        Some(out) => out.clone(),
        None => ddp_run::default_run_dir(&runs_root),
    };
    let out_arg = utf8("the run directory", &out)?.to_owned();
    let cache = args.cache.clone().unwrap_or_else(|| root.join(".cache"));
    if !has_flag(&rest, "--data") {
        utf8("the synthetic sample's folder", &cache)?;
    }
    // Every flag is checked: now libtorch (2.6 GB on a first run), the build and the ranks.
    crate::setup::run(root, &crate::setup::SetupArgs::default())?;
    // The build's link, kept until the ranks (and their restarts) are done.
    let (_link, bin) = match &args.bin {
        Some(b) => (None, b.clone()),
        None => build_release(root, "ddp-train", &["-p", "ddp-train"])?,
    };
    if !has_flag(&rest, "--data") {
        let data = synthetic_sample(root, &cache, args.gen_data_bin.as_deref())?;
        print_line(format_args!(
            "xtask: no --data given: training on the built-in synthetic ODIR sample ({} images) \
             in {}",
            SAMPLE_IMAGES,
            data.display()
        ));
        let data = utf8("the synthetic sample's folder", &data)?.to_owned();
        rest.extend(["--data".into(), data]);
        sample_flags(&mut rest);
    }
    rest.extend(["--out".into(), out_arg]);
    rest.extend(["--device".into(), device.into()]);
    let threads = rank_threads(&mut rest, cores_per_process(nproc));
    config.program = bin.into_os_string();
    config.args = rest.into_iter().map(Into::into).collect();
    config.log_dir = Some(out.join("logs"));
    config.shutdown_timeout = Duration::from_secs(args.grace);
    config.omp_num_threads = Some(threads);

    if let Some(warning) = config.secret_warning() {
        eprint_line(format_args!("xtask: {warning}"));
    }
    let wording = wording();
    let outcome = ddp_run::launch(&config, |event| match event {
        Event::Starting {
            world_size,
            master_addr,
            master_port,
            ..
        } => print_line(format_args!(
            "xtask: starting {nproc} {device} rank(s) on node {}/{} (world size {world_size}), \
             rendezvous at {master_addr}:{master_port}, {threads} thread(s) each, run \
             directory {}",
            config.node_rank,
            config.nnodes,
            out.display()
        )),
        Event::RankFailed(failure) => {
            for line in ddp_run::cli::failure_lines("xtask", failure) {
                eprint_line(line);
            }
            if let Some(advice) = cuda_advice(device, failure) {
                eprint_line(format_args!("xtask: {advice}"));
            }
        }
        Event::Restarting {
            restart,
            max_restarts,
        } => {
            let from = std::fs::read_to_string(out.join("checkpoints/latest"))
                .map(|s| format!("checkpoint {}", s.trim()))
                .unwrap_or_else(|_| "the start (no checkpoint yet)".into());
            eprint_line(format_args!(
                "xtask: restart {restart}/{max_restarts} of the whole group from {from}"
            ));
        }
        Event::Warning(warning) => eprint_line(format_args!("xtask: {warning}")),
        _ => {}
    })
    .map_err(|e| wording.reword(e))?;
    match &outcome {
        Outcome::Succeeded { .. } => {
            print_line(format_args!(
                "xtask: all {nproc} rank(s) finished; run directory {}",
                out.display()
            ));
            let curves = out.join("curves.png");
            if curves.exists() {
                print_line(format_args!(
                    "xtask: curves in {}, metrics in {}",
                    curves.display(),
                    out.join("metrics.jsonl").display()
                ));
            }
        }
        Outcome::Failed { restarts, .. } if *restarts > 0 => {
            eprint_line(format_args!("xtask: giving up after {restarts} restart(s)"));
        }
        Outcome::Failed { .. } => {}
        Outcome::Interrupted { .. } => {
            let timeout = config.shutdown_timeout;
            let longer = &wording.longer_shutdown;
            for line in ddp_run::cli::interruption_lines("xtask", &outcome, timeout, longer) {
                eprint_line(line);
            }
        }
        Outcome::Stopped { .. } => {
            let at = std::fs::read_to_string(out.join("checkpoints/latest"))
                .map(|s| format!("checkpoint {}", s.trim()))
                .unwrap_or_else(|_| "its checkpoint".into());
            match &args.out {
                Some(_) => eprint_line(format_args!(
                    "xtask: every rank stopped at {at}; the same command continues the run in {}",
                    out.display()
                )),
                // A start without --out makes a new run directory: say the command that
                // goes back to this one.
                None => eprint_line(format_args!(
                    "xtask: every rank stopped at {at}; this command continues the run in {}:\n  \
                     {}",
                    out.display(),
                    continue_command(
                        &std::env::args_os()
                            .skip(1)
                            .map(|a| a.to_string_lossy().into_owned())
                            .collect::<Vec<_>>(),
                        &out
                    )
                )),
            }
        }
        _ => {}
    }
    Ok(outcome.exit_code())
}

/// `cargo xtask ARGS` with `--out OUT` after `train`, quoted for a POSIX shell: the command
/// that continues a run started by `cargo xtask ARGS` without `--out`.
fn continue_command(args: &[String], out: &Path) -> String {
    let out = out.to_string_lossy().into_owned();
    let mut words = vec!["cargo".to_owned(), "xtask".to_owned()];
    let at = args.iter().position(|a| a == "train").map_or(0, |i| i + 1);
    words.extend(args[..at].iter().cloned());
    words.extend(["--out".to_owned(), out]);
    words.extend(args[at..].iter().cloned());
    ddp_run::cli::shell_command(&words)
}

/// How many ranks, on which device, where `visible` GPUs are.
fn ranks_and_device(args: &TrainArgs, visible: usize) -> Result<(usize, &'static str)> {
    match (args.gpus, args.cpus) {
        (Some(0), _) | (_, Some(0)) => bail!("the number of ranks must be at least 1"),
        (Some(n), _) if visible == 0 => bail!(
            "--gpus {n}: no GPU is visible here (nvidia-smi and CUDA_VISIBLE_DEVICES); \
             use --cpus N"
        ),
        (Some(n), _) => {
            let instead = format!("--gpus {visible} or --cpus N");
            ddp_run::refuse_more_ranks_than_gpus(&format!("--gpus {n}"), n, visible, &instead)?;
            Ok((n, "cuda"))
        }
        (None, Some(n)) => Ok((n, "cpu")),
        (None, None) if visible > 0 => Ok((visible, "cuda")),
        (None, None) => Ok((2, "cpu")),
    }
}

include!("../../shared-src/cores_per_process.rs");

/// The intra-op threads each rank runs with, for the banner and `OMP_NUM_THREADS`: the
/// trainer's `--threads` where given, else `per_rank`, added to `args` as `--threads`.
fn rank_threads(args: &mut Vec<String>, per_rank: usize) -> usize {
    match flag_value(args, "--threads").map(str::parse) {
        Some(Ok(given)) => given,
        // The ranks refuse it, naming it.
        Some(Err(_)) => per_rank,
        None => {
            args.extend(["--threads".into(), per_rank.to_string()]);
            per_rank
        }
    }
}

fn has_flag(args: &[String], flag: &str) -> bool {
    args.iter()
        .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
}

/// The value of the last `flag V` or `flag=V` in `args`.
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let prefix = format!("{flag}=");
    args.iter()
        .enumerate()
        .filter_map(|(i, a)| match a.strip_prefix(&prefix) {
            Some(v) => Some(v),
            None => (a == flag)
                .then(|| args.get(i + 1).map(String::as_str))
                .flatten(),
        })
        .next_back()
}

/// Builds binary `name` with `cargo build --release ARGS` and returns a hard link (a
/// copy where there can be none) of this process's own to it, in a folder of the target
/// folder's `xtask/bin/` that the guard removes. Nodes that share a checkout build in one
/// target folder, which cargo does not lock on NFS: xtask's own lock takes their builds in
/// turn, and the link keeps this build for its runs when another replaces cargo's.
pub fn build_release(root: &Path, name: &str, args: &[&str]) -> Result<Built> {
    let _lock = crate::target_lock(
        root,
        "build.lock",
        "xtask: another build in this target folder (another node's?) runs; waiting for it",
    )?;
    print_line(format_args!("xtask: building {name} (release)"));
    let mut all = vec!["build", "--release"];
    all.extend(args);
    let built = crate::artifact::build(root, &all, "bin", name)?;
    let links = crate::target_dir(root).join("xtask/bin");
    crate::temporaries::remove_stale(&links);
    let dir = RemoveOnDrop(temporary(&links));
    std::fs::create_dir_all(&dir.0)
        .with_context(|| format!("cannot create {}", dir.0.display()))?;
    let bin = dir.0.join(name);
    std::fs::hard_link(&built, &bin)
        .or_else(|_| std::fs::copy(&built, &bin).map(drop))
        .with_context(|| format!("cannot link {} to {}", built.display(), bin.display()))?;
    Ok((Some(dir), bin))
}

/// A binary to run, and the guard of the folder that holds it where it was built.
pub type Built = (Option<RemoveOnDrop>, PathBuf);

/// The `ddp-gen-data` binary: `given`, or ddp-data's built in release mode without libtorch.
pub fn gen_data_bin(root: &Path, given: Option<&Path>) -> Result<Built> {
    match given {
        Some(bin) => Ok((None, bin.to_path_buf())),
        None => build_release(
            root,
            "ddp-gen-data",
            &[
                "-p",
                "ddp-data",
                "--no-default-features",
                "--features",
                "odir",
                "--bin",
                "ddp-gen-data",
            ],
        ),
    }
}

/// Runs `ddp-gen-data` (see [`gen_data_bin`]) to write a sample of `images` images of `size`
/// px from `seed` into `out`.
pub fn generate_sample(
    root: &Path,
    bin: Option<&Path>,
    out: &Path,
    images: usize,
    size: u32,
    seed: u64,
) -> Result<()> {
    let (_link, bin) = gen_data_bin(root, bin)?;
    let status = std::process::Command::new(&bin)
        .arg("--out")
        .arg(out)
        .args(["--images", &images.to_string()])
        .args(["--size", &size.to_string()])
        .args(["--seed", &seed.to_string()])
        .status()
        .with_context(|| format!("cannot start {}", bin.display()))?;
    if !status.success() {
        bail!(
            "{} could not write the synthetic sample in {} ({status})",
            bin.display(),
            out.display()
        );
    }
    Ok(())
}

/// The built-in synthetic sample, generated once into `.cache/` and reused. Generation goes to
/// a private temporary folder, flushed to the disk with its [`mark_complete`] marker and
/// renamed into place, so concurrent jobs never see half a sample, nor a later one the empty
/// files a power loss can leave; a folder without the marker is generated again. A failed
/// generation removes its temporary, and one cut short (Ctrl-C, a kill) is swept by the next.
fn synthetic_sample(root: &Path, cache: &Path, bin: Option<&Path>) -> Result<PathBuf> {
    let dir = cache.join(format!(
        "synthetic-odir-{SAMPLE_IMAGES}x{SAMPLE_SIZE}-seed{SAMPLE_SEED}"
    ));
    crate::temporaries::remove_stale(cache);
    if is_complete(&dir) {
        return Ok(dir);
    }
    crate::folder_sync::create_folders_synced(cache)
        .with_context(|| format!("cannot create {}", cache.display()))?;
    let tmp = RemoveOnDrop(temporary(cache));
    print_line(format_args!(
        "xtask: generating the synthetic ODIR sample (once) into {}",
        dir.display()
    ));
    generate_sample(root, bin, &tmp.0, SAMPLE_IMAGES, SAMPLE_SIZE, SAMPLE_SEED)?;
    mark_complete(&tmp.0)?;
    if dir.exists() && !is_complete(&dir) {
        // An incomplete sample (or one from before the marker) trades places with the new
        // one in one step, so that a job reading the folder never finds it missing; the
        // guard of `tmp` then removes the old one. Where the file system cannot exchange, it
        // is set aside (if another job has not already) and removed.
        if exchange(&tmp.0, &dir).is_ok() {
            sync_dir(cache)?;
            return Ok(dir);
        }
        let old = RemoveOnDrop(temporary(cache));
        let _ = std::fs::rename(&dir, &old.0);
    }
    // On success `tmp` is gone and its guard finds nothing to remove.
    if std::fs::rename(&tmp.0, &dir).is_err() && !is_complete(&dir) {
        bail!("cannot move the synthetic sample into {}", dir.display());
    }
    // Else another job won the race: its sample is identical (same seed); use it.
    sync_dir(cache)?;
    Ok(dir)
}

/// Swaps the folders `a` and `b` in one step (`renameat2` with `RENAME_EXCHANGE`).
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: two NUL-terminated paths that outlive the call; no other memory is involved.
    let done = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    match done {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// The marker of a whole generated sample: it names `full_df.csv`'s length.
const COMPLETE: &str = ".complete";

/// Marks the sample in `dir`, whose files `ddp-gen-data` flushed to the disk, as whole: writes
/// [`COMPLETE`] and flushes it and the folder.
pub fn mark_complete(dir: &Path) -> Result<()> {
    use std::io::Write as _;
    let csv = dir.join("full_df.csv");
    let len = std::fs::metadata(&csv)
        .with_context(|| format!("cannot read {}", csv.display()))?
        .len();
    let marker = dir.join(COMPLETE);
    let mut file = std::fs::File::create(&marker)
        .with_context(|| format!("cannot create {}", marker.display()))?;
    file.write_all(format!("full_df.csv {len}\n").as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", marker.display()))?;
    sync_dir(dir)
}

/// Whether `dir` holds a sample [`mark_complete`] marked whose `full_df.csv` still has the
/// length it had then (not, say, emptied by a power loss before it reached the disk).
pub fn is_complete(dir: &Path) -> bool {
    let Ok(marker) = std::fs::read_to_string(dir.join(COMPLETE)) else {
        return false;
    };
    let len = std::fs::metadata(dir.join("full_df.csv")).map(|m| m.len());
    matches!(len, Ok(len) if len > 0 && marker == format!("full_df.csv {len}\n"))
}

/// Flushes folder `dir`'s entries to the disk.
fn sync_dir(dir: &Path) -> Result<()> {
    crate::folder_sync::sync_folder(dir)
        .with_context(|| format!("cannot flush {} to the disk", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_samples_flags_are_those_ddp_train_reads() {
        let with = |args: &[&str]| {
            let mut rest: Vec<String> = args.iter().map(|a| a.to_string()).collect();
            sample_flags(&mut rest);
            rest
        };
        let flags = |rest: &[String]| {
            let mut f: Vec<String> = rest
                .iter()
                .filter(|a| a.starts_with("--"))
                .cloned()
                .collect();
            f.sort();
            f
        };
        let all = [
            "--batch-size",
            "--dropout",
            "--epochs",
            "--image-size",
            "--lr",
            "--min-crop-scale",
        ];
        assert_eq!(flags(&with(&[])), all);
        assert_eq!(
            flags(&with(&["--eval-only", "--resume", "f"])),
            [
                "--batch-size",
                "--dropout",
                "--eval-only",
                "--image-size",
                "--resume"
            ]
        );
        assert_eq!(
            flags(&with(&["--model", "resnet18", "--eval-only=true"])),
            [
                "--batch-size",
                "--eval-only=true",
                "--image-size",
                "--model"
            ]
        );
        let mut trained = all.to_vec();
        trained.push("--eval-only=false");
        trained.sort();
        assert_eq!(flags(&with(&["--eval-only=false"])), trained);
        // A flag given is not given twice.
        assert_eq!(
            with(&["--epochs", "2"])
                .iter()
                .filter(|a| *a == "--epochs")
                .count(),
            1
        );
    }

    /// Nothing is left beside the sample in `cache`: no temporary, no sample set aside.
    fn alone_in_cache(cache: &Path, sample: &Path) {
        let name = sample.file_name().unwrap().to_str().unwrap();
        assert_eq!(names(cache), [name]);
    }

    /// The names in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_failed_generation_leaves_no_temporary_in_the_cache() {
        let dir = ddp_testkit::temp_dir("xtask-failed-sample");
        // A generator that writes part of a sample into its --out ($2), then fails.
        let generator = dir.path().join("gen.sh");
        ddp_testkit::script(
            &generator,
            "#!/bin/sh\nmkdir -p \"$2\" && echo x > \"$2/half\"\nexit 1\n",
        );
        let cache = dir.path().join("cache");
        let err = synthetic_sample(dir.path(), &cache, Some(&generator)).unwrap_err();
        let err = format!("{err:#}");
        assert!(
            err.contains("could not write the synthetic sample"),
            "{err}"
        );
        assert!(err.contains("exit status: 1"), "{err}");
        assert_eq!(names(&cache), Vec::<String>::new());
    }

    /// A sample whose marker or `full_df.csv` a power loss emptied, or that has no marker (a
    /// cache from before it), is generated again; a whole one is reused.
    #[test]
    fn a_sample_emptied_by_a_power_loss_is_generated_again() {
        let dir = ddp_testkit::temp_dir("xtask-emptied-sample");
        // A generator that counts its runs and writes a CSV of two rows into its --out ($2).
        let generator = dir.path().join("gen.sh");
        let runs = dir.path().join("runs");
        ddp_testkit::script(
            &generator,
            &format!(
                "#!/bin/sh\necho run >> '{}'\nmkdir -p \"$2/preprocessed_images\" && \
                 printf 'ID\\n0\\n1\\n' > \"$2/full_df.csv\"\n",
                runs.display()
            ),
        );
        let cache = dir.path().join("cache");
        let sample = || synthetic_sample(dir.path(), &cache, Some(&generator)).unwrap();
        let generated = || std::fs::read_to_string(&runs).unwrap().lines().count();
        let first = sample();
        let csv = first.join("full_df.csv");
        assert_eq!(std::fs::read_to_string(&csv).unwrap(), "ID\n0\n1\n");
        assert_eq!(
            std::fs::read_to_string(first.join(COMPLETE)).unwrap(),
            "full_df.csv 7\n"
        );
        assert_eq!((sample(), generated()), (first.clone(), 1));
        let mut expected = 1;
        for emptied in [COMPLETE, "full_df.csv"] {
            std::fs::write(first.join(emptied), "").unwrap();
            expected += 1;
            assert_eq!(
                (sample(), generated()),
                (first.clone(), expected),
                "{emptied}"
            );
            assert_eq!(std::fs::read_to_string(&csv).unwrap(), "ID\n0\n1\n");
        }
        std::fs::remove_file(first.join(COMPLETE)).unwrap();
        assert_eq!((sample(), generated()), (first.clone(), expected + 1));
        assert!(is_complete(&first));
        alone_in_cache(&cache, &first);
    }

    /// A job reading the sample while another replaces an incomplete one never finds the
    /// folder missing: the new sample trades places with the old in one step.
    #[test]
    fn a_sample_replaced_under_a_reader_is_never_missing() {
        let dir = ddp_testkit::temp_dir("xtask-replaced-sample");
        let generator = dir.path().join("gen.sh");
        ddp_testkit::script(
            &generator,
            "#!/bin/sh\nmkdir -p \"$2/preprocessed_images\" && printf 'ID\\n0\\n' > \"$2/full_df.csv\"\n",
        );
        let cache = dir.path().join("cache");
        let first = synthetic_sample(dir.path(), &cache, Some(&generator)).unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let missing = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut missing = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if !first.join("full_df.csv").exists() {
                        missing += 1;
                    }
                }
                missing
            });
            for _ in 0..5 {
                // A sample from before the marker, of many images (a removal that takes
                // a while), replaced while the reader looks.
                std::fs::remove_file(first.join(COMPLETE)).unwrap();
                for i in 0..2000 {
                    std::fs::write(first.join(format!("preprocessed_images/{i}.jpg")), "").unwrap();
                }
                assert_eq!(
                    synthetic_sample(dir.path(), &cache, Some(&generator)).unwrap(),
                    first
                );
                assert!(is_complete(&first));
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            reader.join().unwrap()
        });
        assert_eq!(missing, 0, "the sample was missing {missing} times");
        alone_in_cache(&cache, &first);
    }

    #[test]
    fn the_ranks_threads_are_the_users_else_the_cores_per_rank() {
        let words = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mut given = words(&["--epochs", "2", "--threads", "4"]);
        assert_eq!(rank_threads(&mut given, 1), 4);
        assert_eq!(given, words(&["--epochs", "2", "--threads", "4"]));
        let mut joined = words(&["--threads=3"]);
        assert_eq!(rank_threads(&mut joined, 1), 3);
        let mut none = words(&["--epochs", "2"]);
        assert_eq!(rank_threads(&mut none, 6), 6);
        assert_eq!(none, words(&["--epochs", "2", "--threads", "6"]));
    }

    #[test]
    fn flags_are_found_with_or_without_equals() {
        let args: Vec<String> = ["--epochs", "3", "--data=/x"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert!(has_flag(&args, "--epochs"));
        assert!(has_flag(&args, "--data"));
        assert!(!has_flag(&args, "--out"));
        assert!(!has_flag(&args, "--dat"));
        assert_eq!(flag_value(&args, "--epochs"), Some("3"));
        assert_eq!(flag_value(&args, "--data"), Some("/x"));
        assert_eq!(flag_value(&args, "--out"), None);
        let last: Vec<String> = ["--model", "convnet", "--model=resnet18", "--model"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(flag_value(&last, "--model"), Some("resnet18"));
    }

    #[test]
    fn what_the_launcher_sets_is_refused_among_the_trainers_flags() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            train: TrainArgs,
        }
        // A project folder that is not UTF-8: were a flag not refused, `run` would stop at
        // the run directory's name, before setup.
        let root = <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b"/none_\xff");
        let refusal = |args: &[&str]| {
            let cli = Cli::try_parse_from(["train"].iter().chain(args)).unwrap();
            run(Path::new(root), cli.train).unwrap_err().to_string()
        };
        assert_eq!(
            refusal(&["--cpus", "1", "--epochs", "1", "--device", "cpu"]),
            "the launcher gives each rank its device: choose with `cargo xtask train --gpus N` \
             or `--cpus N` instead of --device"
        );
        assert!(refusal(&["--cpus", "1", "--device=cuda"]).starts_with("the launcher gives"));
        assert_eq!(
            refusal(&["--cpus", "1", "--lr", "0.1", "--out", "/r"]),
            "give the run directory to the launcher as `cargo xtask train --out DIR ...`"
        );
        // torchrun's habit: ddp-train would take it, after setup, the build and the sample,
        // to start ranks of its own on each rank.
        for (args, flag) in [
            (&["--nproc-per-node", "2"][..], "--nproc-per-node"),
            (&["--epochs", "1", "--nproc_per_node=2"], "--nproc_per_node"),
        ] {
            assert_eq!(
                refusal(args),
                format!(
                    "the launcher starts the ranks: choose how many with `cargo xtask train \
                     --gpus N` or `--cpus N` instead of {flag}"
                ),
                "{args:?}"
            );
        }
        // Without --out the run directory is a new one, with nothing to resume.
        let resume = "--resume latest needs the run, and without --out the launcher makes a \
                      new one: cargo xtask train --out runs/<run> --resume latest";
        assert_eq!(refusal(&["--cpus", "1", "--resume", "latest"]), resume);
        assert_eq!(refusal(&["--resume=latest", "--epochs", "2"]), resume);
        let given = |args: &[&str]| {
            let cli = Cli::try_parse_from(["train"].iter().chain(args)).unwrap();
            refuse_what_the_launcher_sets(&cli.train).map_err(|e| e.to_string())
        };
        assert_eq!(given(&["--out", "/r", "--resume", "latest"]), Ok(()));
        assert_eq!(
            given(&["--resume", "/r/checkpoints/epoch-0002.safetensors"]),
            Ok(())
        );
    }

    /// `ddp-run`'s advice names the launcher's flags: the rank logs are in the run
    /// directory, which --out gives.
    #[test]
    fn the_launchers_errors_name_its_own_flags() {
        let file = ddp_run::LaunchError::LogDirIsFile {
            path: "runs/a/logs".into(),
            log_dir_flag: "--log-dir".into(),
        };
        assert_eq!(
            wording().reword(file).to_string(),
            "the folder of the rank logs runs/a/logs is a file: remove it, or give another --out \
             (the rank logs go to its logs/ folder)"
        );
        let port = ddp_run::LaunchError::NoFreePort {
            port_flag: "--master-port".into(),
            source: std::io::ErrorKind::AddrInUse.into(),
        };
        assert_eq!(
            wording().reword(port).to_string(),
            "cannot find a free port on 127.0.0.1 for the ranks to meet on (give --master-port)"
        );
        assert_eq!(wording().longer_shutdown, "--grace");
    }

    /// A rank that found CUDA unusable names ddp-train's --device, which the launcher
    /// refuses: the launcher says its own way to CPU ranks.
    #[test]
    fn ranks_without_cuda_are_told_the_launchers_way_to_cpu_ranks() {
        let failure = |tail: &[&str]| RankFailure {
            rank: 0,
            exit: ddp_run::Exit::Code(1),
            tail: tail.iter().map(|l| l.to_string()).collect(),
            log: None,
            error: None,
            stopped_by_launcher: false,
        };
        let no_cuda = failure(&[
            "error: --device cuda: CUDA is not available here (cudaGetDeviceCount failed: \
             CUDA driver version is insufficient for CUDA runtime version); set --device to cpu",
        ]);
        assert_eq!(
            cuda_advice("cuda", &no_cuda),
            Some(
                "the ranks cannot use CUDA here, though nvidia-smi lists GPUs: use `cargo xtask \
                 train --cpus N` to train on CPU ranks (the launcher sets each rank's --device)"
            )
        );
        assert_eq!(cuda_advice("cpu", &no_cuda), None);
        assert_eq!(cuda_advice("cuda", &failure(&["error: loss is NaN"])), None);
    }

    #[test]
    fn gpus_are_refused_naming_how_many_are_visible() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            train: TrainArgs,
        }
        let ranks = |args: &[&str], visible| {
            let cli = Cli::try_parse_from(["train"].iter().chain(args)).unwrap();
            ranks_and_device(&cli.train, visible).map_err(|e| e.to_string())
        };
        // None visible: --gpus 0 is no way out.
        assert_eq!(
            ranks(&["--gpus", "2"], 0).unwrap_err(),
            "--gpus 2: no GPU is visible here (nvidia-smi and CUDA_VISIBLE_DEVICES); use --cpus N"
        );
        assert_eq!(
            ranks(&["--gpus", "3"], 2).unwrap_err(),
            "--gpus 3 asks for more GPUs than the 2 visible here (nvidia-smi and \
             CUDA_VISIBLE_DEVICES); use --gpus 2 or --cpus N"
        );
        assert_eq!(ranks(&["--gpus", "2"], 2), Ok((2, "cuda")));
        assert_eq!(ranks(&["--cpus", "3"], 0), Ok((3, "cpu")));
        assert_eq!(ranks(&[], 0), Ok((2, "cpu")));
        assert_eq!(ranks(&[], 4), Ok((4, "cuda")));
    }

    /// ddp-train takes its paths as text: a run directory that is not UTF-8 is refused by
    /// the flag, and one derived from the project's folder before anything is built, rather
    /// than given to the ranks as a lossy copy that names another folder.
    #[test]
    fn a_run_directory_that_is_not_utf8_is_refused() {
        use clap::Parser;
        use std::ffi::OsStr;
        use std::os::unix::ffi::OsStrExt;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            train: TrainArgs,
        }
        let bad = OsStr::from_bytes(b"/tmp/run_\xff");
        let argv = [OsStr::new("train"), OsStr::new("--out"), bad].map(OsString::from);
        let err = Cli::try_parse_from(argv).err().unwrap();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        assert!(
            err.to_string().starts_with(
                "error: invalid value '/tmp/run_\u{FFFD}' for '--out <OUT>': the path is not \
                 valid UTF-8, and ddp-train takes its paths as text: rename it or give another \
                 path"
            ),
            "{err}"
        );
        let cli = Cli::try_parse_from(["train", "--cpus", "1", "--data", "/d"]).unwrap();
        let root = Path::new(OsStr::from_bytes(b"/nonexistent/project_\xff"));
        let err = run(root, cli.train).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "the run directory /nonexistent/project_\u{FFFD}/runs/"
            ) && err.ends_with(
                " is not valid UTF-8, and ddp-train takes its paths as text: rename it or give \
                 another path"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_grace_beyond_the_launchers_limit_is_refused_by_the_flag() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            train: TrainArgs,
        }
        let grace = |secs: &str| Cli::try_parse_from(["train", "--grace", secs]);
        assert_eq!(grace("1000000000").unwrap().train.grace, 1_000_000_000);
        let err = grace("1000000001").err().unwrap();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        assert!(
            err.to_string().starts_with(
                "error: invalid value '1000000001' for '--grace <GRACE>': 1000000001 is not in \
                 0..=1000000000"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_stopped_run_without_out_is_continued_with_its_run_directory() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            continue_command(
                &args(&[
                    "train",
                    "--cpus",
                    "2",
                    "--epochs",
                    "3",
                    "--data",
                    "/my data/it's"
                ]),
                Path::new("/w/runs/20261206-101500-42"),
            ),
            "cargo xtask train --out /w/runs/20261206-101500-42 --cpus 2 --epochs 3 \
             --data '/my data/it'\\''s'"
        );
        assert_eq!(
            continue_command(&args(&["train"]), Path::new("runs/a b")),
            "cargo xtask train --out 'runs/a b'"
        );
    }

    #[test]
    fn launcher_flags_move_before_the_trainers() {
        let args = |v: &[&str]| v.iter().map(OsString::from).collect::<Vec<_>>();
        let got = launcher_flags_first(args(&[
            "xtask",
            "train",
            "--epochs",
            "3",
            "--max-restarts",
            "1",
            "--lr=0.1",
            "--out=/r",
            "--node_rank",
            "0",
            "--hflip",
            "--grace",
            "2",
        ]));
        assert_eq!(
            got,
            args(&[
                "xtask",
                "train",
                "--max-restarts",
                "1",
                "--out=/r",
                "--node_rank",
                "0",
                "--grace",
                "2",
                "--epochs",
                "3",
                "--lr=0.1",
                "--hflip"
            ])
        );
        // Other subcommands are left alone.
        assert_eq!(
            launcher_flags_first(args(&["xtask", "test"])),
            args(&["xtask", "test"])
        );
    }
}
