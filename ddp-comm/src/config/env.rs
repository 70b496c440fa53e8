//! Reading a rank's place in the job from the environment: torchrun's variables, SLURM's,
//! or a single process.

use std::path::PathBuf;
use std::time::Duration;

use crate::error::CommError;
use crate::ring::link::Transport;
use crate::security::key_file::SECRET_FILE_ENV;
use crate::security::secret::{Secret, SECRET_ENV};

/// Environment variable holding the job's run id (which keys in torchrun's agent store carry,
/// and which goes into the fallback secret with the key file when `DDP_SECRET` is not set).
pub const RUN_ID_ENV: &str = "DDP_RUN_ID";
/// Environment variable with the attempt of a launcher whose nodes restart their ranks each
/// on their own (`ddp-run` sets it; torchrun's agents meet in a rendezvous round first, and
/// in their shared store the ranks meet under a generation: `group/rendezvous/generation.rs`):
/// ranks then meet only rank 0 of their own attempt.
pub const LAUNCHER_ATTEMPT_ENV: &str = "DDP_LAUNCHER_ATTEMPT";
/// Environment variable overriding the rendezvous timeout, in seconds.
pub const RDZV_TIMEOUT_ENV: &str = "DDP_RDZV_TIMEOUT_S";
/// Environment variable overriding the per-collective timeout, in seconds.
pub const OP_TIMEOUT_ENV: &str = "DDP_OP_TIMEOUT_S";
/// Environment variable choosing the transport between ranks on one host: `auto` (shared
/// memory, the default) or `tcp`.
pub const TRANSPORT_ENV: &str = "DDP_TRANSPORT";
/// Environment variable replacing this rank's host identity (ranks with equal identities
/// use shared memory), as `NCCL_HOSTID` does for NCCL.
pub const HOST_ID_ENV: &str = "DDP_HOST_ID";
/// The longest timeout: what `DDP_RDZV_TIMEOUT_S` and `DDP_OP_TIMEOUT_S` accept (below 10^9 s,
/// about 31 years), and where `Options::rendezvous_timeout` and `Options::op_timeout` cap a
/// longer one, so that a deadline of now plus the timeout always exists.
pub(crate) const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);
/// Longest run id accepted (bytes).
pub const MAX_RUN_ID_LEN: usize = 256;
/// The run id when none is set.
const DEFAULT_RUN_ID: &str = "ddp-comm";

/// Where a configuration came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnvSource {
    /// torchrun's (or `cargo xtask train`'s) `RANK`, `WORLD_SIZE`, ... variables.
    Torchrun,
    /// SLURM's `SLURM_PROCID`, `SLURM_NTASKS`, ... variables.
    Slurm,
    /// Nothing set: rank 0 of 1.
    Single,
    /// Nothing read: given in code ([`EnvConfig::new`], `Options::new`).
    Code,
}

/// One rank's place in the job, how to reach the others, and the settings the environment
/// can give: read from it ([`EnvConfig::from_env`]) or given in code ([`EnvConfig::new`]).
/// [`Options`](crate::Options) holds one, and its builder methods set its fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvConfig {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank on this node (the CUDA device index).
    pub local_rank: usize,
    /// Number of ranks on this node.
    pub local_world_size: usize,
    /// Whether `local_world_size` is the world size for want of a count: a local rank came
    /// without `LOCAL_WORLD_SIZE` or SLURM's tasks per node. The group then binds its store
    /// and listeners as in a job of several hosts (on every interface, as c10d's TCPStore
    /// always does), since nothing says every rank is on this one.
    pub local_world_size_guessed: bool,
    /// Whether the launcher gave `local_rank` (`LOCAL_RANK`, or SLURM's `SLURM_LOCALID`), or
    /// it was worked out (from `LOCAL_WORLD_SIZE`, or 0 without one) or is a lone process's
    /// 0. Given in code ([`EnvConfig::new`], `Options::local`), it is given.
    pub local_rank_given: bool,
    /// Host of the rendezvous store (rank 0's address): `MASTER_ADDR` (an IPv6 address
    /// may come in brackets, `[::1]`, as torchrun writes it); under SLURM without it, the
    /// step's first node. Without `MASTER_ADDR`, a job whose ranks all run on this
    /// host (`LOCAL_WORLD_SIZE` equal to `WORLD_SIZE`, or a world of one) meets at
    /// `127.0.0.1`; one that may span hosts (fewer local ranks than the world, or no count
    /// of them) is refused with [`CommError::MissingEnv`], as torch's `env://` refuses any
    /// job without it: the other hosts cannot guess where rank 0 runs.
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// The job's run id: `DDP_RUN_ID`, else `TORCHELASTIC_RUN_ID`, else SLURM's step
    /// (`SLURM_JOB_ID.SLURM_STEP_ID`, or `SLURM_JOB_ID` outside a step), else `"ddp-comm"`.
    pub run_id: String,
    /// `DDP_SECRET`, the key of every connection's handshake, if set (`ddp-run` sets it).
    /// When it is not, ranks of a job of several derive one from the user's key file
    /// ([`secret_file`](Self::secret_file)) and the run id (see the crate's README,
    /// "Security").
    pub secret: Option<Secret>,
    /// `DDP_SECRET_FILE`, if set: the key file to use when there is no `secret` (`None`:
    /// `$XDG_CONFIG_HOME/ddp/secret`, else `~/.config/ddp/secret`). Created if missing.
    pub secret_file: Option<PathBuf>,
    /// `TORCHELASTIC_USE_AGENT_STORE=True`: torchrun's agent already serves a c10d TCPStore
    /// on `MASTER_PORT`; every rank is a client of it.
    pub agent_store: bool,
    /// `TORCHELASTIC_RESTART_COUNT` (0 when unset): keeps keys of restarted workers apart.
    pub restart_count: u64,
    /// `TORCHELASTIC_MAX_RESTARTS` (0 when unset): how often the launcher restarts the job.
    pub max_restarts: u64,
    /// `DDP_LAUNCHER_ATTEMPT`, if set: the rendezvous waits for rank 0 of this attempt.
    pub launcher_attempt: Option<u64>,
    /// How long rendezvous may take: `DDP_RDZV_TIMEOUT_S`, if set (`None`:
    /// [`DEFAULT_RENDEZVOUS_TIMEOUT`](crate::DEFAULT_RENDEZVOUS_TIMEOUT)).
    pub rendezvous_timeout: Option<Duration>,
    /// How long one collective may take: `DDP_OP_TIMEOUT_S`, if set (`None`: the
    /// backend's default, [`Backend::default_op_timeout`](crate::Backend::default_op_timeout)).
    pub op_timeout: Option<Duration>,
    /// `DDP_TRANSPORT`, if set (`None`: [`Transport::Auto`]). Links use shared memory only
    /// where both ranks allow it.
    pub transport: Option<Transport>,
    /// `DDP_HOST_ID`, if set: replaces this rank's detected host identity (host name, boot
    /// id, network namespace); ranks with equal identities use shared memory.
    pub host_id: Option<String>,
    /// Which variables were used.
    pub source: EnvSource,
}

impl EnvConfig {
    /// Whether [`EnvConfig::run_id`] names this job: set by the user, a launcher or SLURM,
    /// rather than the default `ddp-comm` or torchrun's `none` (its `--rdzv-id` unset). A
    /// restarted or requeued job keeps its id.
    pub fn names_a_job(&self) -> bool {
        !matches!(self.run_id.as_str(), DEFAULT_RUN_ID | "none" | "")
    }

    /// Rank `rank` of `world_size`, meeting at `master_addr:master_port`, given in code,
    /// with every rank on one host: what the environment gives with `RANK`, `WORLD_SIZE`,
    /// `MASTER_ADDR` and `MASTER_PORT`, and `LOCAL_RANK` and `LOCAL_WORLD_SIZE` equal to
    /// `RANK` and `WORLD_SIZE` (run id `ddp-comm`, no secret, no agent store, nothing else
    /// set), but with [`EnvSource::Code`]. (Without the local variables, the environment
    /// puts each rank alone on its host.) Ranks on several hosts set `local_rank` and
    /// `local_world_size`.
    pub fn new(
        rank: usize,
        world_size: usize,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> Self {
        EnvConfig {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            local_world_size_guessed: false,
            local_rank_given: true,
            master_addr: master_addr.into(),
            master_port,
            run_id: DEFAULT_RUN_ID.to_string(),
            secret: None,
            secret_file: None,
            agent_store: false,
            restart_count: 0,
            max_restarts: 0,
            launcher_attempt: None,
            rendezvous_timeout: None,
            op_timeout: None,
            transport: None,
            host_id: None,
            source: EnvSource::Code,
        }
    }

    /// The run id that the variables `lookup` reads give a rank whose place comes from
    /// `source` (see [`run_id`](Self::run_id); SLURM's only for [`EnvSource::Slurm`]), blank
    /// ones unset, as [`EnvConfig::from_lookup`] reads it: `None` when none is set (the run id
    /// is then `ddp-comm`). An id over [`MAX_RUN_ID_LEN`] bytes is an error naming the
    /// variable it came from. A program that starts its own ranks gives them this one, the id
    /// it would have as the one rank of its job.
    pub fn run_id_from_lookup(
        source: EnvSource,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<String>, CommError> {
        let get = |name: &'static str| non_blank(lookup(name)).map(|id| (name, id));
        let found = get(RUN_ID_ENV)
            .or_else(|| get("TORCHELASTIC_RUN_ID"))
            .or_else(|| {
                // SLURM's name of the step (`sacct`'s `4242.0`): steps of one job running at
                // once keep their keys and secrets apart; a requeue numbers its steps again.
                let (var, job) = get("SLURM_JOB_ID").filter(|_| source == EnvSource::Slurm)?;
                Some(match get("SLURM_STEP_ID") {
                    Some((_, step)) => (var, format!("{job}.{step}")),
                    None => (var, job),
                })
            });
        match found {
            Some((var, id)) if id.len() > MAX_RUN_ID_LEN => Err(malformed(
                var,
                &id,
                &format!("at most {MAX_RUN_ID_LEN} bytes"),
            )),
            found => Ok(found.map(|(_, id)| id)),
        }
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self, CommError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `lookup` (a map in tests, the process environment in
    /// [`EnvConfig::from_env`]).
    ///
    /// A variable set to an empty or blank value counts as unset, except `DDP_SECRET`: an
    /// empty one (a failed `export DDP_SECRET=$(...)`) is an error naming it, as `ddp-run`
    /// refuses it, rather than a silent fall-back to the key file.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, CommError> {
        let get = |name: &str| non_blank(lookup(name));
        let number = |name: &str| -> Result<Option<usize>, CommError> {
            get(name).map(|v| parse_usize(name, &v)).transpose()
        };
        let timeout = |name: &str| -> Result<Option<Duration>, CommError> {
            get(name).map(|v| parse_seconds(name, &v)).transpose()
        };
        let (source, rank, world_size, local_rank, local_world) =
            if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
                let rank = number("RANK")?.ok_or_else(|| missing("RANK", "WORLD_SIZE is set"))?;
                let world =
                    number("WORLD_SIZE")?.ok_or_else(|| missing("WORLD_SIZE", "RANK is set"))?;
                let (local_rank, local_world) = local_place(rank, world, number, &get)?;
                (EnvSource::Torchrun, rank, world, local_rank, local_world)
            } else if get("SLURM_PROCID").is_some() {
                let rank = number("SLURM_PROCID")?.unwrap_or(0);
                // The step's tasks: `srun --preserve-env` leaves SLURM_NTASKS the job's.
                let world_var = slurm_world_var(&get);
                // The batch script: no step, and no task count unless `--ntasks` was given.
                let batch_script = get("SLURM_STEP_ID").is_none();
                let world = match number(world_var)? {
                    Some(world) => world,
                    None if batch_script => 1,
                    None => return Err(missing("SLURM_NTASKS", "SLURM_PROCID is set")),
                };
                if world > 1 && batch_script {
                    return Err(missing(
                        "SLURM_STEP_ID",
                        &format!(
                            "so this process is SLURM's batch script, not a task that `srun` \
                             started, and {world_var}={world} counts the job's tasks: start \
                             the ranks with `srun`, or one process with `srun --ntasks 1`"
                        ),
                    ));
                }
                let local_rank = number("SLURM_LOCALID")?.unwrap_or(0);
                // In the batch script SLURM's tasks per node count CPUs (of
                // `--cpus-per-task`), not processes: the script is one process of one.
                let local_world = if batch_script {
                    Some(1)
                } else {
                    slurm_tasks_per_node(&get)?
                };
                (EnvSource::Slurm, rank, world, local_rank, local_world)
            } else {
                (EnvSource::Single, 0, 1, 0, Some(1))
            };
        let local_rank_given = match source {
            EnvSource::Torchrun => {
                get("LOCAL_RANK").is_some()
                    || (get("SLURM_LOCALID").is_some() && own_slurm_task(rank, world_size, &get))
            }
            EnvSource::Slurm => get("SLURM_LOCALID").is_some(),
            EnvSource::Single | EnvSource::Code => false,
        };
        // A local rank without a count of its host's ranks (DeepSpeed's launcher sets
        // `LOCAL_SIZE`, not `LOCAL_WORLD_SIZE`): the world, a guess.
        let local_world_size_guessed = local_world.is_none() && world_size > 1;
        let local_world_size = local_world.unwrap_or(world_size);
        if world_size == 0 {
            return Err(malformed("WORLD_SIZE", "0", "a positive integer"));
        }
        if local_world_size == 0 {
            return Err(malformed("LOCAL_WORLD_SIZE", "0", "a positive integer"));
        }
        check_places(source, rank, world_size, local_rank, local_world_size, &get)?;
        // Whether the job may have ranks on other hosts: the group's store and listeners
        // then bind every interface, and rank 0's address must be given.
        let spans_hosts =
            world_size > 1 && (local_world_size < world_size || local_world_size_guessed);
        // srun places task 0 on the step's first node, but for `-m arbitrary` (a host file).
        let arbitrary = get("SLURM_DISTRIBUTION").is_some_and(|d| d.starts_with("arbitrary"));
        let master_addr = match (get("MASTER_ADDR"), source) {
            (Some(addr), _) => unbracketed(&addr)?,
            (None, EnvSource::Slurm) if arbitrary && spans_hosts => {
                return Err(missing(
                    "MASTER_ADDR",
                    "srun's arbitrary distribution may start task 0 on any node of the step: \
                     export MASTER_ADDR, the host of task 0",
                ));
            }
            (None, EnvSource::Slurm) => {
                // The step's nodes: a step may run on some of the job's.
                let list = [
                    "SLURM_STEP_NODELIST",
                    "SLURM_JOB_NODELIST",
                    "SLURM_NODELIST",
                ]
                .into_iter()
                .find_map(|var| get(var).map(|list| (var, list)));
                match list {
                    Some((var, list)) => first_slurm_host(&list)
                        .ok_or_else(|| malformed(var, &list, "a SLURM host list"))?,
                    None => {
                        return Err(missing(
                            "MASTER_ADDR",
                            "neither it nor SLURM_STEP_NODELIST or SLURM_JOB_NODELIST is set",
                        ))
                    }
                }
            }
            // Every rank on this host, as far as the variables say: rank 0 is here too.
            (None, _) if !spans_hosts => "127.0.0.1".to_string(),
            // Ranks on other hosts cannot guess where rank 0 runs (torch's env:// refuses
            // too).
            (None, _) => {
                return Err(missing(
                    "MASTER_ADDR",
                    &format!(
                        "the job's {world_size} ranks do not all run on this host \
                         (LOCAL_WORLD_SIZE {}), so rank 0's host must be named",
                        get("LOCAL_WORLD_SIZE").unwrap_or_else(|| "not set".into())
                    ),
                ))
            }
        };
        let master_port = match get("MASTER_PORT") {
            Some(v) => parse_port("MASTER_PORT", &v)?,
            None => match source {
                // Steps of one job that run at once meet on ports of their own: step s is
                // 1009 s ports on (step 0's is the job's).
                // (Job ids pass 2^24 on busy clusters: SLURM counts to 67043328 by default,
                // and a federation's ids start above 2^26.)
                EnvSource::Slurm => match get("SLURM_JOB_ID")
                    .map(|v| {
                        v.parse::<u64>()
                            .map_err(|_| malformed("SLURM_JOB_ID", &v, "a job number"))
                    })
                    .transpose()?
                {
                    Some(job) => {
                        // (SLURM's own value; one that is no number counts as step 0.)
                        let step = get("SLURM_STEP_ID")
                            .and_then(|v| v.parse::<u64>().ok())
                            .map_or(0, |s| s % 10000);
                        20000 + ((job % 10000 + step * 1009) % 10000) as u16
                    }
                    None => 29500,
                },
                // (Nothing read from the environment is `Code`.)
                EnvSource::Single | EnvSource::Code => 0,
                EnvSource::Torchrun if world_size == 1 => 0,
                EnvSource::Torchrun => {
                    return Err(missing("MASTER_PORT", "WORLD_SIZE is above 1"));
                }
            },
        };
        let run_id = Self::run_id_from_lookup(source, &lookup)?
            .unwrap_or_else(|| DEFAULT_RUN_ID.to_string());
        if let Some(text) = lookup(SECRET_ENV).filter(|v| v.trim().is_empty()) {
            return Err(malformed(
                SECRET_ENV,
                &text,
                "32 to 128 hexadecimal digits, not an empty value (did the command that \
                 made it fail?): give the job's secret, e.g. from `openssl rand -hex 16`, or \
                 unset DDP_SECRET to use the key file",
            ));
        }
        let secret = get(SECRET_ENV)
            .map(|text| {
                Secret::from_env_value(&text).map_err(|hidden| {
                    malformed(
                        SECRET_ENV,
                        &hidden,
                        "32 to 128 hexadecimal digits (128 to 512 bits, e.g. from `openssl rand -hex 16`)",
                    )
                })
            })
            .transpose()?;
        let agent_store = match get("TORCHELASTIC_USE_AGENT_STORE").as_deref() {
            None => false,
            Some(v) if v.eq_ignore_ascii_case("true") || v == "1" => true,
            Some(v) if v.eq_ignore_ascii_case("false") || v == "0" => false,
            Some(v) => {
                return Err(malformed(
                    "TORCHELASTIC_USE_AGENT_STORE",
                    v,
                    "True or False",
                ))
            }
        };
        let restart_count = number("TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0) as u64;
        let max_restarts = number("TORCHELASTIC_MAX_RESTARTS")?.unwrap_or(0) as u64;
        let launcher_attempt = number(LAUNCHER_ATTEMPT_ENV)?.map(|n| n as u64);
        let transport = get(TRANSPORT_ENV)
            .map(|v| {
                v.parse::<Transport>()
                    .map_err(|_| malformed(TRANSPORT_ENV, &v, "auto or tcp"))
            })
            .transpose()?;
        let host_id = get(HOST_ID_ENV);
        if let Some(id) = host_id.as_deref().filter(|id| id.len() > MAX_RUN_ID_LEN) {
            let expected = format!("at most {MAX_RUN_ID_LEN} bytes");
            return Err(malformed(HOST_ID_ENV, id, &expected));
        }
        Ok(EnvConfig {
            rank,
            world_size,
            local_rank,
            local_world_size,
            local_world_size_guessed,
            local_rank_given,
            master_addr,
            master_port,
            run_id,
            secret,
            secret_file: get(SECRET_FILE_ENV).map(PathBuf::from),
            agent_store,
            restart_count,
            max_restarts,
            launcher_attempt,
            rendezvous_timeout: timeout(RDZV_TIMEOUT_ENV)?,
            op_timeout: timeout(OP_TIMEOUT_ENV)?,
            transport,
            host_id,
            source,
        })
    }
}

/// The local rank and local world size (`None`: no count, the caller takes the world's) of
/// rank `rank`, which has `RANK` and `WORLD_SIZE`, in this order of precedence:
///
/// 1. `LOCAL_RANK` (torchrun, `ddp-run`), with `LOCAL_WORLD_SIZE`, else `None`;
/// 2. `SLURM_LOCALID` (torchrun's variables set by hand inside an `srun` task that is this
///    rank: [`own_slurm_task`]), with `LOCAL_WORLD_SIZE`, else SLURM's tasks per node, else
///    `None`;
/// 3. `LOCAL_WORLD_SIZE` alone: ranks fill the hosts in order, `rank % LOCAL_WORLD_SIZE`;
/// 4. none of them (a Kubeflow `PyTorchJob` pod, which gets `RANK`, `WORLD_SIZE`,
///    `MASTER_ADDR` and `MASTER_PORT` only): one rank per host, local rank 0 of 1, so that a
///    single-GPU pod's rank uses `cuda:0` and all of the pod's cores.
fn local_place<G: Fn(&str) -> Option<String>>(
    rank: usize,
    world: usize,
    number: impl Fn(&str) -> Result<Option<usize>, CommError>,
    get: &G,
) -> Result<(usize, Option<usize>), CommError> {
    let local_world = number("LOCAL_WORLD_SIZE")?;
    if let Some(local_rank) = number("LOCAL_RANK")? {
        return Ok((local_rank, local_world));
    }
    let local_id = match own_slurm_task(rank, world, get) {
        true => number("SLURM_LOCALID")?,
        false => None,
    };
    if let Some(local_rank) = local_id {
        let per_node = match local_world {
            Some(n) => Some(n),
            None => slurm_tasks_per_node(get)?,
        };
        return Ok((local_rank, per_node));
    }
    match local_world {
        Some(0) => Err(malformed("LOCAL_WORLD_SIZE", "0", "a positive integer")),
        Some(n) => Ok((rank % n, Some(n))),
        None => Ok((0, Some(1))),
    }
}

/// Whether this process is `srun`'s task for rank `rank` of `world`: in a step, with the
/// rank as its `SLURM_PROCID` and the world as the step's tasks. Only then is
/// `SLURM_LOCALID` the rank's own: the processes of a batch script, or several that one task
/// starts, inherit one `SLURM_LOCALID` alike.
fn own_slurm_task<G: Fn(&str) -> Option<String>>(rank: usize, world: usize, get: &G) -> bool {
    let count = |name: &str| get(name).and_then(|v| v.trim().parse::<usize>().ok());
    get("SLURM_STEP_ID").is_some()
        && count("SLURM_PROCID") == Some(rank)
        && count("SLURM_STEP_NUM_TASKS").or_else(|| count("SLURM_NTASKS")) == Some(world)
}

/// A local rank inside its node, the node no larger than the world: each refusal names the
/// variable that says otherwise. (A rank outside its world is the rendezvous's to refuse:
/// it tells the other ranks, which then fail at once too.)
fn check_places<G: Fn(&str) -> Option<String>>(
    source: EnvSource,
    rank: usize,
    world: usize,
    local_rank: usize,
    local_world: usize,
    get: &G,
) -> Result<(), CommError> {
    if rank >= world {
        return Ok(());
    }
    let world_var = match source {
        EnvSource::Slurm => slurm_world_var(get),
        _ => "WORLD_SIZE",
    };
    let local_var = if source == EnvSource::Torchrun && get("LOCAL_RANK").is_some() {
        "LOCAL_RANK"
    } else {
        "SLURM_LOCALID"
    };
    let local_world_var = ["LOCAL_WORLD_SIZE"]
        .into_iter()
        .chain(SLURM_PER_NODE)
        .find(|var| get(var).is_some())
        .unwrap_or(world_var);
    if local_world > world {
        return Err(malformed(
            local_world_var,
            &local_world.to_string(),
            &format!("ranks on this node, at most {world_var} {world}"),
        ));
    }
    if local_rank >= local_world {
        return Err(malformed(
            local_var,
            &local_rank.to_string(),
            &format!("a local rank below the {local_world} ranks on this node ({local_world_var})"),
        ));
    }
    Ok(())
}

/// The variable holding SLURM's number of tasks: the step's, else the job's.
fn slurm_world_var<G: Fn(&str) -> Option<String>>(get: &G) -> &'static str {
    ["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"]
        .into_iter()
        .find(|var| get(var).is_some())
        .unwrap_or("SLURM_NTASKS")
}

/// The variables that say how many of SLURM's tasks run on each node, in order of
/// precedence: the step's layout (which `srun` always sets), the `--ntasks-per-node` asked
/// for, the job's layout.
const SLURM_PER_NODE: [&str; 3] = [
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
];

/// SLURM's tasks on this node: this node's (`SLURM_NODEID`, 0 when unset) count of
/// `SLURM_STEP_TASKS_PER_NODE`, else `SLURM_NTASKS_PER_NODE`, else this node's count of
/// `SLURM_TASKS_PER_NODE` (`"4(x2),2"`: 4 on nodes 0 and 1, 2 on 2).
fn slurm_tasks_per_node<G: Fn(&str) -> Option<String>>(
    get: &G,
) -> Result<Option<usize>, CommError> {
    let Some((var, list)) = SLURM_PER_NODE
        .into_iter()
        .find_map(|var| get(var).map(|v| (var, v)))
    else {
        return Ok(None);
    };
    if var == "SLURM_NTASKS_PER_NODE" {
        return leading_count(var, &list).map(Some);
    }
    let node = match get("SLURM_NODEID") {
        Some(v) => parse_usize("SLURM_NODEID", &v)?,
        None => 0,
    };
    let bad = || malformed(var, &list, "counts such as 4(x2),2");
    let mut first = 0;
    for group in list.split(',') {
        let (count, repeat) = match group.split_once("(x") {
            Some((count, rest)) => {
                let times = rest.strip_suffix(')').ok_or_else(bad)?;
                (count, parse_usize(var, times)?)
            }
            None => (group, 1),
        };
        if node < first + repeat {
            return leading_count(var, count).map(Some);
        }
        first += repeat;
    }
    Err(malformed(
        "SLURM_NODEID",
        &node.to_string(),
        &format!("a node of {var} {list} ({first} nodes)"),
    ))
}

/// `MASTER_ADDR` without the one pair of brackets around an IPv6 address (`[::1]`, as
/// torchrun's endpoints write it): the host to resolve, as torchrun's
/// `parse_rendezvous_endpoint` takes it.
fn unbracketed(addr: &str) -> Result<String, CommError> {
    match addr.strip_prefix('[').and_then(|a| a.strip_suffix(']')) {
        Some("") => Err(malformed("MASTER_ADDR", addr, "a host name or IP address")),
        Some(inner) => Ok(inner.to_string()),
        None => Ok(addr.to_string()),
    }
}

fn missing(var: &str, why: &str) -> CommError {
    CommError::MissingEnv {
        var: var.to_string(),
        why: why.to_string(),
    }
}

/// `value` without its surrounding white space; `None` for a blank one, which counts as unset.
fn non_blank(value: Option<String>) -> Option<String> {
    value
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

fn malformed(var: &str, value: &str, expected: &str) -> CommError {
    CommError::MalformedEnv {
        var: var.to_string(),
        value: value.to_string(),
        expected: expected.to_string(),
    }
}

fn parse_usize(var: &str, value: &str) -> Result<usize, CommError> {
    value
        .parse::<usize>()
        .ok()
        .filter(|n| *n < 1 << 24)
        .ok_or_else(|| malformed(var, value, "a non-negative integer below 16777216"))
}

fn parse_port(var: &str, value: &str) -> Result<u16, CommError> {
    value
        .parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| malformed(var, value, "a port number 1..=65535"))
}

/// Positive seconds below [`MAX_TIMEOUT`], and at least 1 ns once rounded: a zero timeout
/// would fail every collective, and the rendezvous, at once.
fn parse_seconds(var: &str, value: &str) -> Result<Duration, CommError> {
    let expected = "a positive number of seconds";
    let secs = value.parse::<f64>().ok();
    let secs = secs.filter(|s| s.is_finite() && *s > 0.0 && *s < MAX_TIMEOUT.as_secs_f64());
    match secs.map(Duration::from_secs_f64) {
        None => Err(malformed(var, value, expected)),
        Some(timeout) if timeout.is_zero() => Err(malformed(
            var,
            value,
            &format!("{expected} once rounded to nanoseconds"),
        )),
        Some(timeout) => Ok(timeout),
    }
}

/// `"4(x2),2"` -> 4: the count of tasks on the first node.
fn leading_count(var: &str, value: &str) -> Result<usize, CommError> {
    let digits: String = value.chars().take_while(char::is_ascii_digit).collect();
    parse_usize(var, &digits).and_then(|n| {
        if n == 0 {
            Err(malformed(var, value, "a positive task count"))
        } else {
            Ok(n)
        }
    })
}

/// The first host of a SLURM host list: `"gpu[03-05,09],cpu1"` -> `"gpu03"`,
/// `"rack[1-2]-n[01-02]"` -> `"rack1-n01"`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let mut depth = 0usize;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth = depth.saturating_sub(1),
                ',' if depth == 0 => return true,
                _ => {}
            }
            false
        })
        .map_or(list.len(), |(i, _)| i);
    // Each bracketed range of the first entry at its first value.
    let mut rest = &list[..end];
    let mut host = String::new();
    while let Some(open) = rest.find('[') {
        let close = open + rest[open..].find(']')?;
        host.push_str(&rest[..open]);
        let first = rest[open + 1..close].split([',', '-']).next()?;
        if first.is_empty() {
            return None;
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return None;
    }
    host.push_str(rest);
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(vars: &[(&str, &str)]) -> Result<EnvConfig, CommError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        EnvConfig::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn a_config_in_code_is_the_environment_of_one_host() {
        let code = EnvConfig::new(2, 3, "h", 1);
        let mut env = read(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "3"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap();
        assert_eq!(env.source, EnvSource::Torchrun);
        env.source = EnvSource::Code;
        assert_eq!(code, env);
        // Without the local variables, rank 2 would be alone on its host.
        let alone = read(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ])
        .unwrap();
        assert_eq!((alone.local_rank, alone.local_world_size), (0, 1));
    }

    #[test]
    fn nothing_set_is_rank_0_of_1() {
        let c = read(&[]).unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (0, 1, 0, 1)
        );
        assert_eq!(c.source, EnvSource::Single);
        assert_eq!(c.run_id, "ddp-comm");
        assert!(!c.names_a_job());
    }

    #[test]
    fn torchrun_variables_are_read() {
        let c = read(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.7"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_RUN_ID", "job9"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
            ("TORCHELASTIC_MAX_RESTARTS", "3"),
            ("DDP_OP_TIMEOUT_S", "1.5"),
            ("DDP_TRANSPORT", "TCP"),
            ("DDP_HOST_ID", "rack4-node2"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (3, 8, 1, 2)
        );
        assert_eq!((c.master_addr.as_str(), c.master_port), ("10.0.0.7", 29400));
        assert_eq!(c.run_id, "job9");
        assert!(c.names_a_job());
        assert!(c.agent_store);
        assert_eq!((c.restart_count, c.max_restarts), (2, 3));
        assert_eq!(c.op_timeout, Some(Duration::from_millis(1500)));
        assert_eq!(c.transport, Some(Transport::Tcp));
        assert_eq!(c.host_id.as_deref(), Some("rack4-node2"));
        assert_eq!(c.source, EnvSource::Torchrun);
    }

    /// torchrun writes an IPv6 endpoint in brackets; the host is what they enclose.
    #[test]
    fn an_ipv6_master_addr_in_brackets_is_the_address_inside() {
        let with = |addr: &str| {
            read(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", addr),
                ("MASTER_PORT", "29500"),
            ])
        };
        for (given, host) in [
            ("[::1]", "::1"),
            (" [fe80::1%eth0] ", "fe80::1%eth0"),
            ("::1", "::1"),
            ("[node1]", "node1"),
            ("node1", "node1"),
        ] {
            assert_eq!(with(given).unwrap().master_addr, host, "{given}");
        }
        match with("[]") {
            Err(CommError::MalformedEnv {
                var,
                value,
                expected,
            }) => assert_eq!(
                (var.as_str(), value.as_str(), expected.as_str()),
                ("MASTER_ADDR", "[]", "a host name or IP address")
            ),
            other => panic!("expected MalformedEnv MASTER_ADDR, got {other:?}"),
        }
    }

    #[test]
    fn slurm_variables_are_the_fallback() {
        let c = read(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08,11],cpu1"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!((c.master_addr.as_str(), c.master_port), ("gpu07", 23456));
        assert_eq!(c.run_id, "123456.0");
        // The step's own counts win over the job's (`srun --preserve-env` keeps those).
        let c = read(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NTASKS_PER_NODE", "8"),
            ("SLURM_TASKS_PER_NODE", "8(x2)"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("SLURM_STEP_ID", "3"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (3, 4, 1, 2)
        );
        // SLURM's batch script itself (no step): alone it is a run of one, named by the job;
        // with the job's tasks to wait for it is told to use srun.
        let batch = |tasks: &'static str| {
            read(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", tasks),
                ("SLURM_JOB_NODELIST", "gpu07"),
                ("SLURM_JOB_ID", "123456"),
            ])
        };
        let c = batch("1").unwrap();
        assert_eq!((c.world_size, c.run_id.as_str()), (1, "123456"));
        // `sbatch` without `--ntasks` exports no task count, and tasks per node that count
        // CPUs: still one process of one.
        let c = read(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_JOB_NODELIST", "gpu07"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_TASKS_PER_NODE", "32"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (0, 1, 0, 1)
        );
        assert_eq!((c.source, c.run_id.as_str()), (EnvSource::Slurm, "123456"));
        match batch("4") {
            Err(CommError::MissingEnv { var, why }) => {
                assert_eq!(var, "SLURM_STEP_ID");
                assert!(
                    why.contains("SLURM_NTASKS=4 counts the job's tasks"),
                    "{why}"
                );
            }
            other => panic!("{other:?}"),
        }
        // Steps of one job: run ids and ports of their own (step 0's port is the job's).
        let step = |id: &str| {
            let c = read(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_JOB_NODELIST", "gpu07"),
                ("SLURM_JOB_ID", "123456"),
                ("SLURM_STEP_ID", id),
            ])
            .unwrap();
            (c.run_id, c.master_port)
        };
        assert_eq!(step("0"), ("123456.0".to_string(), 23456));
        assert_eq!(step("1"), ("123456.1".to_string(), 24465));
        assert_eq!(step("7"), ("123456.7".to_string(), 20519));
        // Job ids above 2^24 (SLURM's default limit is 67043328; federated ids are larger).
        for (job, port) in [("67043327", 23327), ("134217729", 27729)] {
            let c = read(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_JOB_NODELIST", "gpu07"),
                ("SLURM_JOB_ID", job),
                ("SLURM_STEP_ID", "0"),
            ])
            .unwrap();
            assert_eq!((c.run_id, c.master_port), (format!("{job}.0"), port));
        }
        // A step on some of the job's nodes meets on its own first node.
        let c = read(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "gpu[07-08,11]"),
            ("SLURM_STEP_NODELIST", "gpu[08,11]"),
            ("SLURM_JOB_ID", "7"),
            ("SLURM_STEP_ID", "1"),
        ])
        .unwrap();
        assert_eq!(c.master_addr, "gpu08");
        assert_eq!(c.source, EnvSource::Slurm);
        // A host file's order (`-m arbitrary`) may put task 0 on any node: not guessed.
        let arbitrary = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_TASKS_PER_NODE", "1(x2)"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_NODELIST", "gpu[08,11]"),
            ("SLURM_DISTRIBUTION", "arbitrary"),
            ("SLURM_JOB_ID", "7"),
            ("SLURM_STEP_ID", "1"),
        ];
        assert_eq!(
            read(&arbitrary).unwrap_err().to_string(),
            "environment variable MASTER_ADDR is not set (srun's arbitrary distribution may \
             start task 0 on any node of the step: export MASTER_ADDR, the host of task 0)"
        );
        let given = read(&[&arbitrary[..], &[("MASTER_ADDR", "gpu11")]].concat()).unwrap();
        assert_eq!(given.master_addr, "gpu11");
    }

    #[test]
    fn a_local_rank_without_a_count_of_its_host_is_a_guess() {
        let place = |vars: &[(&str, &str)]| {
            let base = [
                ("RANK", "3"),
                ("WORLD_SIZE", "4"),
                ("MASTER_ADDR", "m"),
                ("MASTER_PORT", "23456"),
            ];
            let c = read(&[&base[..], vars].concat()).unwrap();
            (c.local_rank, c.local_world_size, c.local_world_size_guessed)
        };
        // DeepSpeed's launcher: `LOCAL_RANK` and its own `LOCAL_SIZE`.
        let deepspeed = [("LOCAL_RANK", "1"), ("LOCAL_SIZE", "2")];
        assert_eq!(place(&deepspeed), (1, 4, true));
        // srun's task for rank 3 of 4.
        let task = [
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
        ];
        let in_task = |vars: &[(&str, &str)]| place(&[&task[..], vars].concat());
        assert_eq!(in_task(&[("SLURM_LOCALID", "3")]), (3, 4, true));
        // A count, even of the whole world, is no guess.
        for (vars, want) in [
            (
                &[("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")][..],
                (1, 2),
            ),
            (&[("LOCAL_RANK", "3"), ("LOCAL_WORLD_SIZE", "4")], (3, 4)),
            (
                &[
                    ("SLURM_LOCALID", "1"),
                    ("SLURM_TASKS_PER_NODE", "2(x2)"),
                    ("SLURM_STEP_ID", "0"),
                    ("SLURM_PROCID", "3"),
                    ("SLURM_NTASKS", "4"),
                ],
                (1, 2),
            ),
            (&[("LOCAL_WORLD_SIZE", "2")], (1, 2)),
            (&[], (0, 1)),
        ] {
            assert_eq!(place(vars), (want.0, want.1, false), "{vars:?}");
        }
        // A world of one has nothing to guess; a SLURM task without tasks per node has.
        let one = read(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")]).unwrap();
        assert!(!one.local_world_size_guessed);
        let slurm = read(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_NODELIST", "gpu07"),
        ])
        .unwrap();
        assert_eq!(
            (slurm.local_world_size, slurm.local_world_size_guessed),
            (2, true)
        );
        // In code, every rank is on one host; `Options::local` sets a count.
        assert!(!EnvConfig::new(1, 2, "h", 1).local_world_size_guessed);
    }

    #[test]
    fn a_local_rank_is_given_only_by_the_launchers_variables() {
        let base = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "m"),
            ("MASTER_PORT", "23456"),
        ];
        let given = |vars: &[(&str, &str)]| {
            let c = read(&[&base[..], vars].concat()).unwrap();
            (c.local_rank, c.local_rank_given)
        };
        assert_eq!(given(&[("LOCAL_RANK", "1")]), (1, true));
        let task = [("SLURM_STEP_ID", "0"), ("SLURM_NTASKS", "2")];
        let own = [&task[..], &[("SLURM_PROCID", "1"), ("SLURM_LOCALID", "1")]].concat();
        assert_eq!(given(&own), (1, true));
        // Not this rank's own srun task: a batch script's processes (no step), or several
        // that task 0 started, inherit its SLURM_LOCALID, which is then not theirs.
        assert_eq!(
            given(&[("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0")]),
            (0, false)
        );
        let started = [&task[..], &[("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0")]].concat();
        assert_eq!(given(&started), (0, false));
        let batch = [("SLURM_LOCALID", "0"), ("LOCAL_WORLD_SIZE", "2")];
        assert_eq!(given(&batch), (1, false));
        assert_eq!(given(&[("LOCAL_WORLD_SIZE", "2")]), (1, false));
        assert_eq!(given(&[("LOCAL_RANK", " ")]), (0, false));
        assert_eq!(given(&[]), (0, false));
        let slurm = read(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_JOB_NODELIST", "gpu07"),
        ])
        .unwrap();
        assert!(!slurm.local_rank_given);
        assert!(!read(&[]).unwrap().local_rank_given);
        assert!(EnvConfig::new(1, 2, "h", 1).local_rank_given);
    }

    #[test]
    fn without_local_variables_a_rank_is_alone_on_its_host() {
        let place = |vars: &[(&str, &str)]| {
            let base = [
                ("RANK", "3"),
                ("WORLD_SIZE", "4"),
                ("MASTER_ADDR", "job-master-0"),
                ("MASTER_PORT", "23456"),
            ];
            let c = read(&[&base[..], vars].concat()).unwrap();
            (c.local_rank, c.local_world_size)
        };
        // A Kubeflow PyTorchJob pod: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT only.
        assert_eq!(place(&[]), (0, 1));
        // LOCAL_WORLD_SIZE alone: ranks fill the hosts in order.
        assert_eq!(place(&[("LOCAL_WORLD_SIZE", "2")]), (1, 2));
        // torchrun's own variables win.
        assert_eq!(place(&[("LOCAL_RANK", "2")]), (2, 4));
        assert_eq!(
            place(&[("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")]),
            (1, 2)
        );
        // Inside srun's task for this rank: SLURM's local id and tasks per node.
        let task = [
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
        ];
        let place = |vars: &[(&str, &str)]| place(&[&task[..], vars].concat());
        assert_eq!(
            place(&[("SLURM_LOCALID", "1"), ("SLURM_TASKS_PER_NODE", "2(x2)")]),
            (1, 2)
        );
        assert_eq!(place(&[("SLURM_LOCALID", "3")]), (3, 4));
        // Uneven nodes: this node's count.
        let uneven = [("SLURM_LOCALID", "1"), ("SLURM_TASKS_PER_NODE", "3(x2),2")];
        assert_eq!(
            place(&[&uneven[..], &[("SLURM_NODEID", "1")]].concat()),
            (1, 3)
        );
        assert_eq!(
            place(&[&uneven[..], &[("SLURM_NODEID", "2")]].concat()),
            (1, 2)
        );
        assert_eq!(place(&uneven), (1, 3));
        match read(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "8"),
            ("MASTER_PORT", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_TASKS_PER_NODE", "3(x2),2"),
            ("SLURM_NODEID", "3"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "8"),
        ]) {
            Err(CommError::MalformedEnv { var, .. }) => assert_eq!(var, "SLURM_NODEID"),
            other => panic!("{other:?}"),
        }
        match read(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("LOCAL_WORLD_SIZE", "0"),
        ]) {
            Err(CommError::MalformedEnv { var, .. }) => assert_eq!(var, "LOCAL_WORLD_SIZE"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn slurm_host_lists_give_their_first_host() {
        assert_eq!(first_slurm_host("node1").as_deref(), Some("node1"));
        assert_eq!(first_slurm_host("a,b").as_deref(), Some("a"));
        assert_eq!(first_slurm_host("n[003-010]").as_deref(), Some("n003"));
        assert_eq!(
            first_slurm_host("rack[2,4]-gpu").as_deref(),
            Some("rack2-gpu")
        );
        assert_eq!(
            first_slurm_host("rack[1-2]-n[01-02],x").as_deref(),
            Some("rack1-n01")
        );
        assert_eq!(first_slurm_host("bad[1"), None);
        assert_eq!(first_slurm_host("bad[]"), None);
        assert_eq!(first_slurm_host("bad[,1]"), None);
        assert_eq!(first_slurm_host("bad]1"), None);
    }

    #[test]
    fn malformed_values_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[("RANK", "one"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")],
                "RANK",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "-2"), ("MASTER_PORT", "1")],
                "WORLD_SIZE",
            ),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "m"),
                    ("MASTER_PORT", "70000"),
                ],
                "MASTER_PORT",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_PORT", "1"),
                    ("LOCAL_RANK", "x"),
                ],
                "LOCAL_RANK",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "1"),
                    ("DDP_OP_TIMEOUT_S", "-1"),
                ],
                "DDP_OP_TIMEOUT_S",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "1"),
                    ("TORCHELASTIC_USE_AGENT_STORE", "maybe"),
                ],
                "TORCHELASTIC_USE_AGENT_STORE",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "1"), ("DDP_TRANSPORT", "ib")],
                "DDP_TRANSPORT",
            ),
            (
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_PORT", "1"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                "LOCAL_RANK",
            ),
            (
                &[
                    ("RANK", "1"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_PORT", "1"),
                    ("LOCAL_RANK", "1"),
                    ("LOCAL_WORLD_SIZE", "4"),
                ],
                "LOCAL_WORLD_SIZE",
            ),
            (
                &[
                    ("SLURM_PROCID", "3"),
                    ("SLURM_NTASKS", "4"),
                    ("SLURM_LOCALID", "2"),
                    ("SLURM_TASKS_PER_NODE", "2(x2)"),
                    ("SLURM_JOB_NODELIST", "n[1-2]"),
                    ("SLURM_STEP_ID", "0"),
                ],
                "SLURM_LOCALID",
            ),
        ];
        for (vars, var) in cases {
            match read(vars) {
                Err(CommError::MalformedEnv { var: got, .. }) => assert_eq!(&got, var, "{vars:?}"),
                other => panic!("{vars:?}: expected MalformedEnv for {var}, got {other:?}"),
            }
        }
    }

    /// A positive timeout under 1 ns would round to none: every collective, and the
    /// rendezvous, would time out at once.
    #[test]
    fn a_timeout_that_rounds_to_zero_is_refused() {
        for var in [OP_TIMEOUT_ENV, RDZV_TIMEOUT_ENV] {
            assert_eq!(
                read(&[(var, "1e-10")]).unwrap_err().to_string(),
                format!(
                    "environment variable {var}=\"1e-10\" is not valid: expected a positive \
                     number of seconds once rounded to nanoseconds"
                )
            );
            assert_eq!(
                read(&[(var, "0")]).unwrap_err().to_string(),
                format!(
                    "environment variable {var}=\"0\" is not valid: expected a positive number \
                     of seconds"
                )
            );
        }
        let shortest = read(&[(OP_TIMEOUT_ENV, "1e-9"), (RDZV_TIMEOUT_ENV, "1e-9")]).unwrap();
        assert_eq!(shortest.op_timeout, Some(Duration::from_nanos(1)));
        assert_eq!(shortest.rendezvous_timeout, Some(Duration::from_nanos(1)));
    }

    #[test]
    fn the_secret_is_read_and_never_quoted() {
        let hex = "0123456789abcdef0123456789abcdef";
        let c = read(&[("DDP_SECRET", hex)]).unwrap();
        assert_eq!(c.secret, Some(Secret::from_env_value(hex).unwrap()));
        assert_eq!(c.secret.unwrap().origin(), crate::SecretOrigin::Env);
        assert_eq!(read(&[]).unwrap().secret, None);
        assert_eq!(read(&[]).unwrap().secret_file, None);
        assert_eq!(
            read(&[("DDP_SECRET_FILE", " /shared/key ")])
                .unwrap()
                .secret_file,
            Some(PathBuf::from("/shared/key"))
        );
        for bad in [&hex[..31], "0123456789abcdef0123456789abcdeg"] {
            match read(&[("DDP_SECRET", bad)]) {
                Err(CommError::MalformedEnv { var, value, .. }) => {
                    assert_eq!(var, "DDP_SECRET");
                    assert!(value.starts_with("<hidden: "), "{value}");
                }
                other => panic!("expected MalformedEnv, got {other:?}"),
            }
            let message = read(&[("DDP_SECRET", bad)]).unwrap_err().to_string();
            assert!(!message.contains(&bad[..16]), "{message}");
        }
    }

    /// An empty `DDP_SECRET` is not unset (the ranks would fall back to the key file while
    /// `ddp-run` refuses it): the error names the variable; other empty variables are unset.
    #[test]
    fn an_empty_secret_is_an_error_naming_it() {
        for empty in ["", "  "] {
            match read(&[("DDP_SECRET", empty)]) {
                Err(e @ CommError::MalformedEnv { .. }) => assert_eq!(
                    e.to_string(),
                    format!(
                        "environment variable DDP_SECRET={empty:?} is not valid: expected 32 \
                         to 128 hexadecimal digits, not an empty value (did the command that \
                         made it fail?): give the job's secret, e.g. from `openssl rand -hex \
                         16`, or unset DDP_SECRET to use the key file"
                    )
                ),
                other => panic!("expected MalformedEnv, got {other:?}"),
            }
        }
        let c = read(&[("DDP_SECRET_FILE", ""), ("DDP_RUN_ID", " ")]).unwrap();
        assert_eq!((c.secret_file, c.run_id.as_str()), (None, "ddp-comm"));
    }

    /// An id over the bound is refused naming the variable it came from, though a blank one
    /// (unset) stands before it; one at the bound is the run id.
    #[test]
    fn an_over_long_run_id_names_the_variable_it_came_from() {
        // One SLURM task alone in its step (SLURM's ids count only for SLURM's tasks).
        let task = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_JOB_NODELIST", "n1"),
            ("MASTER_PORT", "29500"),
        ];
        let long = "j".repeat(MAX_RUN_ID_LEN + 1);
        for (var, blank) in [
            (RUN_ID_ENV, None),
            ("TORCHELASTIC_RUN_ID", Some(RUN_ID_ENV)),
            ("SLURM_JOB_ID", Some("TORCHELASTIC_RUN_ID")),
        ] {
            let with = |id: &str| {
                let mut vars = task.to_vec();
                vars.extend(blank.map(|blank| (blank, " ")));
                vars.push((var, id));
                read(&vars)
            };
            assert_eq!(
                with(&long).unwrap_err().to_string(),
                format!(
                    "environment variable {var}={long:?} is not valid: expected at most 256 bytes"
                )
            );
            assert_eq!(with(&long[1..]).unwrap().run_id, long[1..]);
        }
        let job = |source| {
            EnvConfig::run_id_from_lookup(source, |var| {
                (var == "SLURM_JOB_ID").then(|| "42".into())
            })
        };
        assert_eq!(job(EnvSource::Slurm).unwrap().as_deref(), Some("42"));
        assert_eq!(job(EnvSource::Single).unwrap(), None);
    }

    #[test]
    fn missing_partners_are_named() {
        match read(&[("RANK", "1")]) {
            Err(CommError::MissingEnv { var, .. }) => assert_eq!(var, "WORLD_SIZE"),
            other => panic!("{other:?}"),
        }
        match read(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]) {
            Err(CommError::MissingEnv { var, .. }) => assert_eq!(var, "MASTER_PORT"),
            other => panic!("{other:?}"),
        }
    }

    /// Without `MASTER_ADDR`, only a job whose ranks all run on this host meets at
    /// 127.0.0.1; ranks on several hosts cannot guess rank 0's, as torch's `env://` refuses.
    #[test]
    fn master_addr_is_required_when_the_ranks_may_span_hosts() {
        let base = [("RANK", "2"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "29500")];
        let with = |vars: &[(&str, &str)]| read(&[&base[..], vars].concat());
        let missing_addr = |vars: &[(&str, &str)], local: &str| match with(vars) {
            Err(CommError::MissingEnv { var, why }) => {
                assert_eq!(var, "MASTER_ADDR", "{vars:?}");
                assert_eq!(
                    why,
                    format!(
                        "the job's 4 ranks do not all run on this host (LOCAL_WORLD_SIZE \
                         {local}), so rank 0's host must be named"
                    ),
                    "{vars:?}"
                );
            }
            other => panic!("{vars:?}: expected MissingEnv MASTER_ADDR, got {other:?}"),
        };
        // Two hosts of two ranks.
        missing_addr(&[("LOCAL_WORLD_SIZE", "2")], "2");
        missing_addr(&[("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")], "2");
        // No count of this host's ranks (one per host, or a guess).
        missing_addr(&[], "not set");
        missing_addr(&[("LOCAL_RANK", "2")], "not set");
        // Every rank on this host: the default stands.
        let one_host = with(&[("LOCAL_WORLD_SIZE", "4")]).unwrap();
        assert_eq!(one_host.master_addr, "127.0.0.1");
        let named = with(&[("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "node1")]).unwrap();
        assert_eq!(named.master_addr, "node1");
    }
}
