//! torchrun's worker environment: the variable names, and the values one rank gets.
//!
//! torchrun's elastic agent (`LocalElasticAgent._start_workers` in PyTorch) gives every worker
//! the variables named here; ddp-run adds [`DDP_SECRET`], [`DDP_JOB_STARTED`],
//! [`DDP_LAUNCHER_PID`], [`DDP_LAUNCHER_PID_NS`], [`DDP_LAUNCHER_LIFELINE`] and
//! [`DDP_LAUNCHER_ATTEMPT`].
//! [`crate::RankEnv`] is the one place in this workspace that writes them;
//! `ddp_comm::EnvConfig` is the one place that reads the rendezvous's (the ranks, the local
//! ranks, the master's address, the restart count and run id); the others are set for
//! programs that read them, as torchrun sets them. [`TORCHELASTIC_ERROR_FILE`] is the
//! exception: the launcher sets it for each rank of each attempt (a file of its own, or none),
//! and [`crate::record_error`] is the one place that reads it.

/// Global rank of the process, `0..WORLD_SIZE`.
pub const RANK: &str = "RANK";
/// Number of ranks in the job, on every node.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank on this node, `0..LOCAL_WORLD_SIZE` (the usual CUDA device index).
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of ranks on this node.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// This node's index among the nodes (torchrun's `--node-rank`).
pub const GROUP_RANK: &str = "GROUP_RANK";
/// Number of nodes.
pub const GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";
/// Rank among the workers of the same role; with one role, the global rank.
pub const ROLE_RANK: &str = "ROLE_RANK";
/// Number of workers of the same role; with one role, the world size.
pub const ROLE_WORLD_SIZE: &str = "ROLE_WORLD_SIZE";
/// The workers' role (torchrun's `--role`, `default` unless given).
pub const ROLE_NAME: &str = "ROLE_NAME";
/// Host of rank 0, where the ranks meet.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Port on `MASTER_ADDR` where the ranks meet.
pub const MASTER_PORT: &str = "MASTER_PORT";
/// How many times the group was restarted before this attempt (0 on the first).
pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// The most restarts the launcher will make (`--max-restarts`).
pub const TORCHELASTIC_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
/// The job's id, the same on every rank and node (torchrun's `--rdzv-id`).
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// A file of this rank's own where it writes its error when it fails, in torchrun's JSON shape
/// ([`crate::record_error`]): the launcher names the rank whose error came first.
pub const TORCHELASTIC_ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";
/// `True` when the launcher itself serves the rendezvous store on `MASTER_PORT`. ddp-run
/// serves none, so it always writes `False`: rank 0 serves the store.
pub const TORCHELASTIC_USE_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// Passed on from the launcher's environment, else `1`, as torchrun does.
pub const TORCH_NCCL_ASYNC_ERROR_HANDLING: &str = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
/// Read by launchers, not written for the ranks: torchrun's shutdown timeout (seconds) when
/// no flag gives one ([`crate::LaunchConfig::torchrun_shutdown_timeout`]).
pub const TORCH_ELASTIC_SHUTDOWN_TIMEOUT: &str = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT";
/// Threads of OpenMP (and of libtorch's intra-op pool) in each rank.
pub const OMP_NUM_THREADS: &str = "OMP_NUM_THREADS";
pub use crate::job_start::DDP_JOB_STARTED;
pub use crate::lifeline::{DDP_LAUNCHER_LIFELINE, DDP_LAUNCHER_PID, DDP_LAUNCHER_PID_NS};
/// The launcher's attempt (its restarts so far), which `ddp_comm`'s rendezvous matches with
/// rank 0's, since each node's launcher restarts its ranks on its own.
pub const DDP_LAUNCHER_ATTEMPT: &str = "DDP_LAUNCHER_ATTEMPT";
pub use crate::secret::DDP_SECRET;
/// The ranks' own run id (ddp-comm's), which they take before [`TORCHELASTIC_RUN_ID`]:
/// ddp-run writes none, but passes on one that is set, and reads it to know which the ranks
/// will use.
pub const DDP_RUN_ID: &str = "DDP_RUN_ID";

/// The port torchrun uses when several nodes meet and none is given.
pub const DEFAULT_MASTER_PORT: u16 = 29500;
