//! `ddp-run`: starts N ranks of a program with torchrun's environment and supervises them.
//!
//! ```text
//! ddp-run --nproc-per-node 2 target/release/my-trainer --epochs 3
//! ddp-run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 \
//!         --nproc-per-node gpu --max-restarts 3 --log-dir logs -- my-trainer --data /data
//! ```

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Parser;
use ddp_run::cli::NodeArgs;
use ddp_run::{launch, Event, LaunchConfig, NprocPerNode, Outcome};

/// Start N ranks of PROGRAM on this node with torchrun's environment (RANK, WORLD_SIZE,
/// LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...) and supervise them: the first rank to fail ends
/// the job, signals are forwarded, ranks never outlive the launcher.
#[derive(Debug, Parser)]
#[command(name = "ddp-run", version, about, long_about = None)]
#[command(
    after_help = "Exit status: 0 when every rank succeeded, 1 when a rank failed (after \
    the restarts), 75 when every rank stopped at a checkpoint on request (exit code 75: a \
    forwarded SIGTERM/SIGUSR1, a time limit; start the job again to continue), 128+N after \
    signal N, 2 for a bad command line."
)]
struct Cli {
    /// Ranks on this node: a number, `gpu` (one per visible GPU), `cpu` (one per core) or
    /// `auto` (one per GPU, else one per core).
    #[arg(
        long = "nproc-per-node",
        visible_alias = "nproc_per_node",
        value_name = "N",
        default_value = "1",
        env = "PET_NPROC_PER_NODE"
    )]
    nproc_per_node: NprocPerNode,

    #[command(flatten)]
    node: NodeArgs,

    /// A single node whose ranks meet on a free local port (torchrun's --standalone).
    #[arg(long, conflicts_with_all = ["master_addr", "master_port", "node_rank"])]
    standalone: bool,

    /// Folder for each rank's output, rank-<RANK>.out (stdout and stderr, every attempt).
    #[arg(long = "log-dir", visible_alias = "log_dir", env = "PET_LOG_DIR")]
    log_dir: Option<PathBuf>,

    /// Seconds between SIGTERM to the ranks (or the signal the launcher got) and SIGKILL.
    #[arg(
        long = "shutdown-timeout",
        visible_alias = "shutdown_timeout",
        value_name = "SECONDS",
        default_value_t = 30,
        env = "PET_SHUTDOWN_TIMEOUT"
    )]
    shutdown_timeout: u64,

    /// Seconds between checks of the ranks.
    #[arg(
        long = "monitor-interval",
        visible_alias = "monitor_interval",
        value_name = "SECONDS",
        default_value_t = 0.1,
        value_parser = parse_interval,
        env = "PET_MONITOR_INTERVAL"
    )]
    monitor_interval: f64,

    /// The workers' role, written to ROLE_NAME.
    #[arg(long, default_value = "default", env = "PET_ROLE")]
    role: String,

    /// The job's id, written to TORCHELASTIC_RUN_ID [default: a fresh id on a single node,
    /// `none` on several].
    #[arg(
        long = "rdzv-id",
        visible_alias = "rdzv_id",
        value_name = "ID",
        env = "PET_RDZV_ID"
    )]
    rdzv_id: Option<String>,

    /// Accepted for torchrun compatibility: ddp-run always runs PROGRAM itself, never
    /// through `python`.
    #[arg(long = "no-python", visible_alias = "no_python")]
    #[allow(dead_code)] // Nothing to do: it is what ddp-run always does.
    no_python: bool,

    /// The program each rank runs, and its arguments.
    #[arg(
        value_name = "PROGRAM [ARGS]",
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    command: Vec<OsString>,
}

fn parse_interval(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(s) if s > 0.0 && s.is_finite() => Ok(s),
        _ => Err(format!("'{value}' is not a positive number of seconds")),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            // A user's mistake or the environment's, never a bug: the message chain alone.
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<u8> {
    if cli.standalone && cli.node.nnodes != 1 {
        bail!(
            "--standalone runs a single node; it cannot be combined with --nnodes {}",
            cli.node.nnodes
        );
    }
    let nproc = cli.nproc_per_node.resolve()?;
    let (program, args) = cli
        .command
        .split_first()
        .map(|(p, a)| (p.clone(), a.to_vec()))
        .unwrap_or_default();
    let mut config = LaunchConfig::new(program, nproc).args(args);
    cli.node.apply(&mut config);
    config.role = cli.role;
    config.run_id = cli.rdzv_id;
    config.log_dir = cli.log_dir;
    config.shutdown_timeout = Duration::from_secs(cli.shutdown_timeout);
    config.monitor_interval = Duration::from_secs_f64(cli.monitor_interval);
    config.validate()?;
    if config.omp_num_threads.is_none()
        && std::env::var_os(ddp_run::env::OMP_NUM_THREADS).is_none()
        && nproc > 1
    {
        eprintln!(
            "ddp-run: OMP_NUM_THREADS=1 for each rank, so that {nproc} ranks do not overload \
             the cores; set OMP_NUM_THREADS to choose another number"
        );
    }
    if config.nnodes > 1 && std::env::var_os(ddp_run::env::DDP_SECRET).is_none() {
        eprintln!(
            "ddp-run: DDP_SECRET is not set, so the ranks of these {} nodes authenticate each \
             other with a secret derived from the run id, which anyone who knows it can \
             compute; give every node the same DDP_SECRET (e.g. `export DDP_SECRET=$(openssl \
             rand -hex 16)` where the job is submitted)",
            config.nnodes
        );
    }
    let outcome = launch(&config, report)?;
    match &outcome {
        Outcome::Succeeded { restarts } => {
            let after = match restarts {
                0 => String::new(),
                n => format!(" after {n} restart(s)"),
            };
            eprintln!("ddp-run: all {nproc} rank(s) finished{after}");
        }
        Outcome::Failed { restarts, .. } if *restarts > 0 => {
            eprintln!("ddp-run: giving up after {restarts} restart(s)");
        }
        Outcome::Failed { .. } => {}
        Outcome::Interrupted { signal } => {
            eprintln!("ddp-run: interrupted by signal {signal}; all ranks stopped");
        }
        Outcome::Stopped { signal, .. } => {
            let by = signal.map_or(String::new(), |s| format!(" after signal {s}"));
            eprintln!(
                "ddp-run: every rank stopped at a checkpoint{by} (exit code {}); starting \
                 the job again continues it",
                ddp_run::EXIT_STOPPED
            );
        }
    }
    Ok(u8::try_from(outcome.exit_code()).unwrap_or(1))
}

/// Shows the launcher's events on stderr, apart from the ranks' own output.
fn report(event: &Event<'_>) {
    match event {
        Event::Starting {
            attempt,
            ranks,
            world_size,
            master_addr,
            master_port,
            omp_num_threads,
        } => {
            let threads = omp_num_threads
                .map(|n| format!(", OMP_NUM_THREADS={n}"))
                .unwrap_or_default();
            let again = if *attempt > 0 { "re" } else { "" };
            let which = match ranks.len() {
                1 => format!("rank {}", ranks.start),
                _ => format!("ranks {}-{}", ranks.start, ranks.end - 1),
            };
            eprintln!(
                "ddp-run: {again}starting {which} of {world_size}, rendezvous at \
                 {master_addr}:{master_port}{threads}"
            );
        }
        Event::RankFailed(failure) => {
            eprintln!("ddp-run: {failure}");
            match &failure.log {
                Some(log) => eprintln!("ddp-run: last lines of {}:", log.display()),
                None => eprintln!("ddp-run: last lines of rank {}:", failure.rank),
            }
            for line in &failure.tail {
                eprintln!("    {line}");
            }
        }
        Event::Restarting {
            restart,
            max_restarts,
        } => eprintln!("ddp-run: restart {restart}/{max_restarts} of the whole group"),
    }
}
