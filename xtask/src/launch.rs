//! `cargo xtask train`: launches N `ddp-train` ranks and supervises them.
//!
//! What torchrun's elastic agent does, for our binary: torchrun's environment names for every
//! rank, a free port on a single node, per-rank thread counts so ranks do not oversubscribe
//! the cores, rank 0's output on the terminal and every rank's in its log file, other ranks'
//! stderr prefixed with `[rank i]`. The first rank to fail ends the job (terminate, then kill
//! after a grace period), with `rank i exited with code c` and the tail of its log; with
//! `--max-restarts K` the whole group restarts from the latest checkpoint up to K times.
//! Ranks die with the launcher (parent-death signal), and Ctrl-C / SIGTERM is forwarded.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

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
    /// Number of nodes (run the same command on each).
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index among --nnodes.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Host of rank 0 (node 0); loopback on a single node.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of rank 0's store (default: a free port on a single node; required with --nnodes > 1).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Restart the whole group from the latest checkpoint after a failure, up to K times.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// Run directory (default: runs/YYYYMMDD-HHMMSS-PID, UTC).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Seconds between asking failed jobs' ranks to terminate and killing them.
    #[arg(long, default_value_t = 10)]
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
    /// Arguments for ddp-train.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub rest: Vec<String>,
}

/// The launcher's own options that take a value; with [`launcher_flags_first`] they may
/// appear anywhere among ddp-train's.
const LAUNCHER_FLAGS: &[&str] = &[
    "--gpus",
    "--cpus",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--max-restarts",
    "--out",
    "--grace",
    "--cache",
    "--runs-root",
    "--bin",
];

/// Moves the launcher's options (after `train`) in front of ddp-train's, so that
/// `cargo xtask train --epochs 3 --max-restarts 1` means what it says.
pub fn launcher_flags_first(args: Vec<String>) -> Vec<String> {
    let Some(pos) = args.iter().position(|a| a == "train") else {
        return args;
    };
    let (head, tail) = args.split_at(pos + 1);
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    let mut it = tail.iter().cloned().peekable();
    while let Some(a) = it.next() {
        let name = a.split('=').next().unwrap_or(&a).to_owned();
        if LAUNCHER_FLAGS.contains(&name.as_str()) {
            let has_value = a.contains('=');
            ours.push(a);
            if !has_value {
                if let Some(v) = it.next() {
                    ours.push(v);
                }
            }
        } else {
            theirs.push(a);
        }
    }
    head.iter().cloned().chain(ours).chain(theirs).collect()
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

/// The signal that ended the launcher's wait (0: none yet).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNALLED.store(sig, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores into an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

/// Runs the job; returns the process exit code for `main`.
pub fn run(root: &Path, args: TrainArgs) -> Result<i32> {
    let (nproc, device) = ranks_and_device(&args)?;
    if args.nnodes == 0 || args.node_rank >= args.nnodes {
        bail!(
            "--node-rank {} must be below --nnodes {}",
            args.node_rank,
            args.nnodes
        );
    }
    if args.nnodes > 1 && args.master_port.is_none() {
        bail!(
            "--nnodes {} needs --master-port (the same on every node)",
            args.nnodes
        );
    }
    let bin = match &args.bin {
        Some(b) => b.clone(),
        None => build_release(root)?,
    };
    let mut rest = args.rest.clone();
    if !has_flag(&rest, "--data") {
        let cache = args.cache.clone().unwrap_or_else(|| root.join(".cache"));
        let data = synthetic_sample(&cache)?;
        println!(
            "xtask: no --data given: training on the built-in synthetic ODIR sample ({} images) \
             in {}",
            SAMPLE_IMAGES,
            data.display()
        );
        rest.extend(["--data".into(), data.to_string_lossy().into_owned()]);
        for (flag, value) in SAMPLE_DEFAULTS {
            if !has_flag(&rest, flag) {
                rest.extend([flag.to_string(), value.to_string()]);
            }
        }
    }
    if has_flag(&rest, "--out") {
        bail!("give the run directory to the launcher as `cargo xtask train --out DIR ...`");
    }
    let runs_root = args.runs_root.clone().unwrap_or_else(|| root.join("runs"));
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| default_run_dir(&runs_root));
    std::fs::create_dir_all(out.join("logs"))
        .with_context(|| format!("cannot create run directory {}", out.display()))?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / nproc).max(1);
    let world = nproc * args.nnodes;
    let run_id = format!("xtask-{}-{}", std::process::id(), unix_millis());
    install_signal_handlers();

    let mut attempt = 0u32;
    loop {
        let port = match args.master_port {
            Some(p) => p,
            None => free_port()?,
        };
        let mut rank_args = rest.clone();
        rank_args.extend(["--out".into(), out.to_string_lossy().into_owned()]);
        rank_args.extend(["--device".into(), device.into()]);
        if attempt > 0 && out.join("checkpoints/latest").exists() && !has_flag(&rest, "--resume") {
            rank_args.extend(["--resume".into(), "latest".into()]);
        }
        println!(
            "xtask: starting {nproc} {device} rank(s) on node {}/{} (world size {world}), \
             rendezvous at {}:{port}, {threads} thread(s) each, run directory {}",
            args.node_rank,
            args.nnodes,
            args.master_addr,
            out.display()
        );
        let job = Job {
            bin: &bin,
            args: &rank_args,
            out: &out,
            nproc,
            node_rank: args.node_rank,
            world,
            master_addr: &args.master_addr,
            port,
            threads,
            run_id: &run_id,
            attempt,
            grace: Duration::from_secs(args.grace),
        };
        match job.run()? {
            Outcome::Success => {
                println!(
                    "xtask: all {nproc} rank(s) finished; run directory {}",
                    out.display()
                );
                let curves = out.join("curves.png");
                if curves.exists() {
                    println!(
                        "xtask: curves in {}, metrics in {}",
                        curves.display(),
                        out.join("metrics.jsonl").display()
                    );
                }
                return Ok(0);
            }
            Outcome::Interrupted(sig) => {
                eprintln!("xtask: interrupted by signal {sig}; all ranks stopped");
                return Ok(128 + sig);
            }
            Outcome::Failed { rank, status, tail } => {
                eprintln!("xtask: rank {rank} {}", describe_exit(status));
                eprintln!("xtask: last lines of {}:", rank_log(&out, rank).display());
                for line in tail {
                    eprintln!("    {line}");
                }
                if attempt >= args.max_restarts {
                    if args.max_restarts > 0 {
                        eprintln!("xtask: giving up after {attempt} restart(s)");
                    }
                    return Ok(1);
                }
                attempt += 1;
                let from = std::fs::read_to_string(out.join("checkpoints/latest"))
                    .map(|s| format!("checkpoint {}", s.trim()))
                    .unwrap_or_else(|_| "the start (no checkpoint yet)".into());
                eprintln!(
                    "xtask: restart {attempt}/{} of the whole group from {from}",
                    args.max_restarts
                );
            }
        }
    }
}

/// How many ranks, on which device.
fn ranks_and_device(args: &TrainArgs) -> Result<(usize, &'static str)> {
    let visible = visible_gpus();
    match (args.gpus, args.cpus) {
        (Some(0), _) | (_, Some(0)) => bail!("the number of ranks must be at least 1"),
        (Some(n), _) if n > visible => bail!(
            "--gpus {n} asks for more GPUs than the {visible} visible here \
             (nvidia-smi and CUDA_VISIBLE_DEVICES); use --gpus {visible} or --cpus N"
        ),
        (Some(n), _) => Ok((n, "cuda")),
        (None, Some(n)) => Ok((n, "cpu")),
        (None, None) if visible > 0 => Ok((visible, "cuda")),
        (None, None) => Ok((2, "cpu")),
    }
}

/// GPUs this process may use: `nvidia-smi --list-gpus`, narrowed by `CUDA_VISIBLE_DEVICES`.
pub fn visible_gpus() -> usize {
    let listed = Command::new("nvidia-smi")
        .arg("--list-gpus")
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or(0, |o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        });
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) if v.trim().is_empty() => 0,
        Ok(v) => v
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .count()
            .min(listed),
        Err(_) => listed,
    }
}

fn has_flag(args: &[String], flag: &str) -> bool {
    args.iter()
        .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
}

fn build_release(root: &Path) -> Result<PathBuf> {
    println!("xtask: building ddp-train (release)");
    let status = crate::cargo()
        .current_dir(root)
        .args(["build", "--release", "--quiet", "-p", "ddp-train"])
        .status()
        .context("cannot run cargo build")?;
    if !status.success() {
        bail!("building ddp-train failed ({status})");
    }
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    Ok(target.join("release").join("ddp-train"))
}

/// The built-in synthetic sample, generated once into `.cache/` and reused. Generation goes to
/// a private temporary folder renamed into place, so concurrent jobs never see half a sample.
fn synthetic_sample(cache: &Path) -> Result<PathBuf> {
    let dir = cache.join(format!(
        "synthetic-odir-{SAMPLE_IMAGES}x{SAMPLE_SIZE}-seed{SAMPLE_SEED}"
    ));
    if dir.join("full_df.csv").exists() {
        return Ok(dir);
    }
    std::fs::create_dir_all(cache).with_context(|| format!("cannot create {}", cache.display()))?;
    let tmp = cache.join(format!(".tmp-{}-{}", std::process::id(), unix_millis()));
    let config = ddp_data::synthetic::SyntheticConfig {
        images: SAMPLE_IMAGES,
        size: SAMPLE_SIZE,
        seed: SAMPLE_SEED,
        ..Default::default()
    };
    println!(
        "xtask: generating the synthetic ODIR sample (once) into {}",
        dir.display()
    );
    ddp_data::synthetic::generate(&tmp, &config)
        .with_context(|| format!("generating the synthetic sample in {}", tmp.display()))?;
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another job won the race: its sample is identical (same seed); use it.
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.join("full_df.csv").exists() {
            bail!("cannot move the synthetic sample into {}", dir.display());
        }
    }
    Ok(dir)
}

fn unix_millis() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

fn default_run_dir(runs_root: &Path) -> PathBuf {
    let secs = (unix_millis() / 1000) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    runs_root.join(format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}-{}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        std::process::id()
    ))
}

/// Days since 1970-01-01 to (year, month, day), Howard Hinnant's algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("cannot find a free port")?;
    Ok(listener.local_addr()?.port())
}

fn rank_log(out: &Path, rank: usize) -> PathBuf {
    out.join("logs").join(format!("rank-{rank}.out"))
}

fn describe_exit(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        _ => format!("ended ({status})"),
    }
}

enum Outcome {
    Success,
    Interrupted(i32),
    Failed {
        rank: usize,
        status: ExitStatus,
        tail: Vec<String>,
    },
}

/// One attempt: the ranks of this node.
struct Job<'a> {
    bin: &'a Path,
    args: &'a [String],
    out: &'a Path,
    nproc: usize,
    node_rank: usize,
    world: usize,
    master_addr: &'a str,
    port: u16,
    threads: usize,
    run_id: &'a str,
    attempt: u32,
    grace: Duration,
}

/// Lines kept per rank for the failure report.
const TAIL_LINES: usize = 20;

struct RankProcess {
    rank: usize,
    child: Child,
    tail: Arc<Mutex<VecDeque<String>>>,
    pumps: Vec<std::thread::JoinHandle<()>>,
}

impl Job<'_> {
    fn spawn(&self, local: usize) -> Result<RankProcess> {
        let rank = self.node_rank * self.nproc + local;
        let mut cmd = Command::new(self.bin);
        cmd.args(self.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", self.world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", self.nproc.to_string())
            .env("MASTER_ADDR", self.master_addr)
            .env("MASTER_PORT", self.port.to_string())
            .env("DDP_RUN_ID", self.run_id)
            .env("TORCHELASTIC_RESTART_COUNT", self.attempt.to_string())
            .env("OMP_NUM_THREADS", self.threads.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if !has_flag(self.args, "--threads") {
            cmd.args(["--threads", &self.threads.to_string()]);
        }
        // SAFETY: prctl is async-signal-safe; it asks the kernel to kill this rank when the
        // launcher dies, so no rank outlives it, whatever kills the launcher.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have died between fork and prctl.
                if libc::getppid() == 1 {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", self.bin.display()))?;
        let log_path = rank_log(self.out, rank);
        let log = Arc::new(Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .with_context(|| format!("cannot open {}", log_path.display()))?,
        ));
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let stdout = child.stdout.take().context("rank stdout")?;
        let stderr = child.stderr.take().context("rank stderr")?;
        let pumps = vec![
            pump(stdout, rank, false, log.clone(), tail.clone()),
            pump(stderr, rank, true, log, tail.clone()),
        ];
        Ok(RankProcess {
            rank,
            child,
            tail,
            pumps,
        })
    }

    fn run(&self) -> Result<Outcome> {
        let mut ranks = Vec::with_capacity(self.nproc);
        for local in 0..self.nproc {
            match self.spawn(local) {
                Ok(r) => ranks.push(r),
                Err(e) => {
                    stop_all(&mut ranks, self.grace);
                    return Err(e);
                }
            }
        }
        let mut done = vec![false; ranks.len()];
        loop {
            let sig = SIGNALLED.load(Ordering::SeqCst);
            if sig != 0 {
                stop_all(&mut ranks, self.grace);
                return Ok(Outcome::Interrupted(sig));
            }
            // Every rank that ended since the last look; among failures seen together, one
            // killed by a signal is the likelier cause (its peers then fail on its absence).
            let mut failures = Vec::new();
            for (k, r) in ranks.iter_mut().enumerate() {
                if done[k] {
                    continue;
                }
                if let Some(status) = r.child.try_wait()? {
                    done[k] = true;
                    if !status.success() {
                        failures.push((status.signal().is_none(), k, status));
                    }
                }
            }
            failures.sort_by_key(|&(by_code, k, _)| (by_code, k));
            if let Some(&(_, k, status)) = failures.first() {
                stop_all(&mut ranks, self.grace);
                let r = &mut ranks[k];
                for p in r.pumps.drain(..) {
                    let _ = p.join();
                }
                let tail = r
                    .tail
                    .lock()
                    .map(|t| t.iter().cloned().collect())
                    .unwrap_or_default();
                return Ok(Outcome::Failed {
                    rank: r.rank,
                    status,
                    tail,
                });
            }
            if done.iter().all(|d| *d) {
                for r in &mut ranks {
                    for p in r.pumps.drain(..) {
                        let _ = p.join();
                    }
                }
                return Ok(Outcome::Success);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Copies one stream of a rank to its log file; rank 0's also to the terminal, and other
/// ranks' stderr to the terminal prefixed with `[rank i]`.
fn pump(
    stream: impl std::io::Read + Send + 'static,
    rank: usize,
    is_stderr: bool,
    log: Arc<Mutex<std::fs::File>>,
    tail: Arc<Mutex<VecDeque<String>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let reader = BufReader::new(stream);
        for line in reader.split(b'\n') {
            let Ok(line) = line else { break };
            let line = String::from_utf8_lossy(&line).into_owned();
            if let Ok(mut f) = log.lock() {
                let _ = writeln!(f, "{line}");
            }
            match (rank, is_stderr) {
                (0, false) => println!("{line}"),
                (0, true) => eprintln!("{line}"),
                (_, true) => eprintln!("[rank {rank}] {line}"),
                (_, false) => {}
            }
            if let Ok(mut t) = tail.lock() {
                if t.len() == TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(line);
            }
        }
    })
}

/// SIGTERM to every rank still running, SIGKILL after `grace`, and wait for all.
fn stop_all(ranks: &mut [RankProcess], grace: Duration) {
    for r in ranks.iter_mut() {
        if matches!(r.child.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on our own child's pid, which is not yet reaped.
            unsafe {
                libc::kill(r.child.id() as libc::pid_t, libc::SIGTERM);
            }
        }
    }
    let deadline = Instant::now() + grace;
    for r in ranks.iter_mut() {
        loop {
            match r.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = r.child.kill();
                    let _ = r.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn launcher_flags_move_before_the_trainers() {
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let got = launcher_flags_first(args(&[
            "xtask",
            "train",
            "--epochs",
            "3",
            "--max-restarts",
            "1",
            "--lr=0.1",
            "--out=/r",
            "--hflip",
        ]));
        assert_eq!(
            got,
            args(&[
                "xtask",
                "train",
                "--max-restarts",
                "1",
                "--out=/r",
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

    #[test]
    fn dates_of_run_directories() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_788), (2026, 12, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }
}
