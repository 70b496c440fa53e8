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

use anyhow::Result;
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, Parser};
use ddp_run::cli::{
    die_of_interruption, exit_status, launch_and_report_outcome, NodeArgs, Wording,
};
use ddp_run::{LaunchConfig, NprocPerNode, MAX_WAIT};

/// Start N ranks of PROGRAM on this node with torchrun's environment (RANK, WORLD_SIZE,
/// LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...) and supervise them: the first rank to fail ends
/// the job, signals are forwarded, ranks never outlive the launcher.
#[derive(Debug, Parser)]
#[command(name = "ddp-run", version, about, long_about = None)]
#[command(
    after_help = "Exit status: 0 when every rank succeeded; 1 when a rank failed after \
    the restarts, or the ranks could not be started; 75 when the ranks stopped at a \
    checkpoint on request (one or more exited 75, after a forwarded SIGTERM/SIGUSR1 or at a \
    time limit, the others 0: start the job again to continue); when signal N stopped the \
    launcher and its ranks without that, the launcher ends by signal N itself, as the user \
    asked (128+N where the signal cannot end it, as the first process of a container); 2 for \
    a bad command line."
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

    /// A single node whose ranks meet on a free local port (torchrun's --standalone): the
    /// rendezvous flags' `PET_*` variables are ignored. `PET_STANDALONE` other than 0 (or
    /// empty, `false`, `no`, `off`) sets it, as torchrun's non-zero number does.
    #[arg(long, env = "PET_STANDALONE", value_parser = clap::builder::FalseyValueParser::new())]
    standalone: bool,

    /// torchrun's rendezvous backend: only `static`, its default (every node is told where
    /// rank 0 is); the elastic ones (c10d, etcd) are refused.
    #[arg(
        long = "rdzv-backend",
        visible_alias = "rdzv_backend",
        value_name = "static",
        env = "PET_RDZV_BACKEND"
    )]
    rdzv_backend: Option<String>,

    /// HOST:PORT of rank 0, as the static backend reads it: in place of --master-addr and
    /// --master-port.
    #[arg(
        long = "rdzv-endpoint",
        visible_alias = "rdzv_endpoint",
        value_name = "HOST:PORT",
        env = "PET_RDZV_ENDPOINT"
    )]
    rdzv_endpoint: Option<String>,

    /// Folder for each rank's output, rank-<RANK>.out (stdout and stderr, every attempt).
    #[arg(long = "log-dir", visible_alias = "log_dir", env = "PET_LOG_DIR")]
    log_dir: Option<PathBuf>,

    /// Seconds between SIGTERM to the ranks (or the signal the launcher got) and SIGKILL
    /// [default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30].
    #[arg(
        long = "shutdown-timeout",
        visible_alias = "shutdown_timeout",
        value_name = "SECONDS",
        value_parser = parse_timeout,
        env = "PET_SHUTDOWN_TIMEOUT"
    )]
    shutdown_timeout: Option<u64>,

    /// Seconds between checks of the ranks.
    #[arg(
        long = "monitor-interval",
        visible_alias = "monitor_interval",
        value_name = "SECONDS",
        default_value = "0.1",
        value_parser = parse_interval,
        env = "PET_MONITOR_INTERVAL"
    )]
    monitor_interval: Duration,

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

/// `--shutdown-timeout` (and its variable): whole seconds, at most [`MAX_WAIT`]; or what
/// the value is instead, to follow "VALUE is".
fn parse_timeout(value: &str) -> Result<u64, String> {
    let secs = value.trim().parse::<u64>();
    let secs = secs.map_err(|_| "not a whole number of seconds".to_string())?;
    within_max_wait(secs as f64).map(|()| secs)
}

/// `--monitor-interval`: positive seconds, at most [`MAX_WAIT`], and at least 1 ns once
/// rounded (a zero interval would check the ranks without pause, a core spinning).
fn parse_interval(value: &str) -> Result<Duration, String> {
    let not_positive = format!("'{value}' is not a positive number of seconds");
    let secs = value
        .parse::<f64>()
        .ok()
        .filter(|s| *s > 0.0 && s.is_finite());
    let secs = secs.ok_or_else(|| not_positive.clone())?;
    within_max_wait(secs)?;
    let interval = Duration::from_secs_f64(secs);
    if interval.is_zero() {
        return Err(format!("{not_positive} once rounded to nanoseconds"));
    }
    Ok(interval)
}

fn within_max_wait(secs: f64) -> Result<(), String> {
    let max = MAX_WAIT.as_secs();
    if secs > max as f64 {
        return Err(format!("over the limit of {max} seconds (about 31 years)"));
    }
    Ok(())
}

fn main() -> ExitCode {
    let (mut cli, matches) =
        ddp_run::cli::try_parse_from::<Cli>(std::env::args_os()).unwrap_or_else(|e| e.exit());
    let config = standalone(&mut cli, &matches)
        .map_err(|message| by_variable(&message, &matches))
        .and_then(|()| launch_config(&cli, &matches));
    let config = config.unwrap_or_else(|message| {
        // Exit status 2 and the usage line, as for the command lines clap refuses.
        Cli::command()
            .error(clap::error::ErrorKind::ArgumentConflict, message)
            .exit()
    });
    match run(cli.nproc_per_node, config) {
        Ok(code) => code,
        Err(err) => {
            // A user's mistake or the environment's, never a bug: the message chain alone.
            eprintln!("error: {}", ddp_run::cli::error_message(&err));
            ExitCode::FAILURE
        }
    }
}

/// The rendezvous flags that `--standalone` replaces, by clap id.
const RENDEZVOUS: [(&str, &str); 4] = [
    ("master_addr", "--master-addr"),
    ("master_port", "--master-port"),
    ("node_rank", "--node-rank"),
    ("rdzv_endpoint", "--rdzv-endpoint"),
];

/// torchrun's `--standalone`: this node alone, its ranks meeting on a free local port. A
/// rendezvous flag typed with it is a conflict; the same values from `PET_*` variables
/// (Kubeflow sets them in every pod) are dropped, and so are `PET_RDZV_BACKEND` and
/// `PET_RDZV_ID`, as torchrun replaces them all, and `PET_RDZV_CONF` (settings of torchrun's
/// c10d rendezvous, which a standalone node of ddp-run does not use).
fn standalone(cli: &mut Cli, matches: &ArgMatches) -> Result<(), String> {
    if !cli.standalone {
        return Ok(());
    }
    let source = |id: &str| matches.value_source(id);
    if let Some((_, flag)) = RENDEZVOUS
        .iter()
        .find(|(id, _)| source(id) == Some(ValueSource::CommandLine))
    {
        return Err(format!(
            "--standalone cannot be used with {flag}: a standalone node meets on a free \
             local port of its own"
        ));
    }
    if cli.node.nnodes != 1 {
        let given = match source("nnodes") {
            Some(ValueSource::EnvVariable) => format!(
                "PET_NNODES={}",
                std::env::var_os("PET_NNODES")
                    .unwrap_or_default()
                    .to_string_lossy()
            ),
            _ => format!("--nnodes {}", cli.node.nnodes),
        };
        return Err(format!(
            "--standalone runs a single node; it cannot be combined with {given}"
        ));
    }
    let single = NodeArgs::default();
    cli.node.master_addr = single.master_addr;
    cli.node.master_port = single.master_port;
    cli.node.node_rank = single.node_rank;
    cli.rdzv_endpoint = None;
    for (id, value) in [
        ("rdzv_backend", &mut cli.rdzv_backend),
        ("rdzv_id", &mut cli.rdzv_id),
    ] {
        if source(id) == Some(ValueSource::EnvVariable) {
            *value = None;
        }
    }
    Ok(())
}

/// The launch the command line asks for, its ranks per node still to count where they are
/// `gpu`, `cpu` or `auto`; or what is wrong with it beyond what clap checks: a torchrun
/// option ddp-run does not have (taken for the program, since the program may begin with
/// `-`), and settings the launcher refuses.
fn launch_config(cli: &Cli, matches: &ArgMatches) -> Result<LaunchConfig, String> {
    let (program, args) = cli.command.split_first().ok_or("no program to start")?;
    if let Some(flag) = program.to_str().filter(|p| p.starts_with('-')) {
        return Err(unknown_option(flag));
    }
    // torchrun reads each of its options from `PET_<OPTION>` too (Kubeflow's elastic jobs set
    // these), each only where its flag is not typed: a rendezvous other than the static one
    // is refused as its flag would be. (`--standalone` dropped the backend's variable.)
    if let Some(backend) = cli.rdzv_backend.as_deref().filter(|b| *b != "static") {
        return Err(match matches.value_source("rdzv_backend") {
            Some(ValueSource::EnvVariable) => format!(
                "PET_RDZV_BACKEND={backend} asks for torchrun's --rdzv-backend: {} (unset \
                 PET_RDZV_BACKEND)",
                instead_of("--rdzv-backend")
            ),
            _ => format!("--rdzv-backend {backend}: {}", instead_of("--rdzv-backend")),
        });
    }
    // The settings of torchrun's elastic rendezvous; a standalone node, or a typed static
    // backend, replaces that rendezvous.
    let conf = std::env::var_os("PET_RDZV_CONF").unwrap_or_default();
    let typed_backend = matches.value_source("rdzv_backend") == Some(ValueSource::CommandLine);
    if !conf.is_empty() && !cli.standalone {
        let conf = conf.to_string_lossy();
        if !typed_backend {
            return Err(format!(
                "PET_RDZV_CONF={conf} asks for torchrun's --rdzv-conf: {} (unset PET_RDZV_CONF)",
                instead_of("--rdzv-conf")
            ));
        }
        eprintln!(
            "ddp-run: warning: PET_RDZV_CONF={conf} ignored: --rdzv-backend static takes no \
             settings"
        );
    }
    // A stand-in for the ranks per node until `run` counts the devices.
    let nproc = match cli.nproc_per_node {
        NprocPerNode::Count(n) => n,
        _ => 1,
    };
    let mut config = LaunchConfig::new(program.clone(), nproc).args(args.to_vec());
    cli.node.apply(&mut config);
    if let Some(endpoint) = &cli.rdzv_endpoint {
        // torchrun's static backend takes rank 0's address from the endpoint, port included.
        let (host, port) = static_endpoint(endpoint).ok_or_else(|| {
            format!(
                "--rdzv-endpoint {endpoint}: expected HOST:PORT, rank 0's host and a port \
                 1..=65535 (torchrun's static rendezvous needs the port too)"
            )
        })?;
        config.master_addr = host;
        config.master_port = Some(port);
    }
    config.role = cli.role.clone();
    config.run_id = cli.rdzv_id.clone();
    config.log_dir = cli.log_dir.clone();
    // torchrun's launcher falls back on TORCH_ELASTIC_SHUTDOWN_TIMEOUT, then 30 s.
    config = match cli.shutdown_timeout {
        Some(secs) => LaunchConfig {
            shutdown_timeout: Duration::from_secs(secs),
            ..config
        },
        None => config
            .torchrun_shutdown_timeout()
            .map_err(|e| e.to_string())?,
    };
    config.monitor_interval = cli.monitor_interval;
    config
        .validate()
        .map_err(|e| by_variable(&e.to_string(), matches))?;
    Ok(config)
}

/// `message` with each flag it names whose value came from its `PET_*` variable named by
/// that variable instead, as clap's refusals of those variables' values name them.
fn by_variable(message: &str, matches: &ArgMatches) -> String {
    let mut message = message.to_string();
    for arg in Cli::command().get_arguments() {
        let (Some(long), Some(var)) = (arg.get_long(), arg.get_env()) else {
            continue;
        };
        if matches.value_source(arg.get_id().as_str()) != Some(ValueSource::EnvVariable) {
            continue;
        }
        let flag = format!("--{long}");
        let var = var.to_string_lossy();
        // Whole flags only: `--node-rank`, not the start of a longer one.
        let mut out = String::with_capacity(message.len());
        let mut rest = message.as_str();
        while let Some(at) = rest.find(&flag) {
            let after = &rest[at + flag.len()..];
            out.push_str(&rest[..at]);
            if after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
                out.push_str(&flag);
            } else {
                out.push_str(&var);
            }
            rest = after;
        }
        out.push_str(rest);
        message = out;
    }
    message
}

/// `HOST:PORT` (or `[IPv6]:PORT`) as host and port; `None` without a port.
fn static_endpoint(endpoint: &str) -> Option<(String, u16)> {
    let (host, port) = endpoint.trim().rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port = port.parse::<u16>().ok().filter(|p| *p > 0)?;
    (!host.is_empty() && !host.contains(['[', ']'])).then(|| (host.to_string(), port))
}

/// The message for an option ddp-run does not have, given where PROGRAM goes: what to do
/// instead for torchrun's options.
fn unknown_option(arg: &str) -> String {
    let given = arg.split('=').next().unwrap_or(arg);
    format!(
        "ddp-run has no option '{given}': {}",
        instead_of(&given.replace('_', "-"))
    )
}

/// What to do instead of torchrun's option `flag` (spelt with `-`), which ddp-run lacks.
fn instead_of(flag: &str) -> &'static str {
    match flag {
        "-m" | "--module" => {
            "ddp-run starts programs, not Python modules: give the interpreter, \
             `ddp-run [OPTIONS] python -m MODULE [ARGS]`"
        }
        "--run-path" => {
            "ddp-run starts programs, not Python scripts: give the interpreter, \
             `ddp-run [OPTIONS] python SCRIPT [ARGS]`"
        }
        "--rdzv-backend" | "--rdzv-conf" => {
            "ddp-run has torchrun's static rendezvous only: rank 0 of node 0 at \
             --master-addr and --master-port (or --rdzv-endpoint HOST:PORT), each node \
             with its own --node-rank"
        }
        "--redirects" | "--tee" | "--local-ranks-filter" | "--log-line-prefix-template" => {
            "ddp-run shows every rank's output, prefixed with its rank, and --log-dir DIR \
             keeps each rank's in DIR/rank-<RANK>.out"
        }
        "--start-method" => "ddp-run starts every rank as a new process of PROGRAM",
        "--local-rank" => {
            "that is a flag of the program (torch.distributed.launch passes it); ddp-run \
             sets LOCAL_RANK in each rank's environment: give it after PROGRAM if the \
             program reads it"
        }
        _ => "the launcher's options come first, then PROGRAM and its arguments (see --help)",
    }
}

fn run(nproc: NprocPerNode, mut config: LaunchConfig) -> Result<ExitCode> {
    config.nproc_per_node = nproc.resolve()?;
    if config.nnodes > 1 && !matches!(nproc, NprocPerNode::Count(_)) {
        // Ranks are numbered as if every node started as many as this one.
        eprintln!(
            "ddp-run: {} rank(s) on this node; every one of the {} nodes must start as many",
            config.nproc_per_node, config.nnodes
        );
    }
    let outcome = launch_and_report_outcome(&config, "ddp-run", &Wording::default())?;
    die_of_interruption(&outcome);
    Ok(ExitCode::from(exit_status(&outcome)))
}
