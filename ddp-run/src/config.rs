//! What to start, where, and how to supervise it: torchrun's command line as a struct.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use crate::env::{
    DDP_RUN_ID, DDP_SECRET, OMP_NUM_THREADS, TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
    TORCH_NCCL_ASYNC_ERROR_HANDLING,
};
use crate::LaunchError;

/// The longest [`LaunchConfig::shutdown_timeout`] and [`LaunchConfig::monitor_interval`]
/// (10^9 s, some 31 years, the bound of ddp-comm's timeouts): past it a deadline would not
/// fit in an [`Instant`](std::time::Instant).
pub const MAX_WAIT: Duration = Duration::from_secs(1_000_000_000);
/// The longest [`LaunchConfig::run_id`] (bytes, without the white space around it): the
/// longest that the ranks accept (ddp-comm's bound).
pub const MAX_RUN_ID_LEN: usize = 256;
/// The most ranks a job may have, [`LaunchConfig::world_size`] (ddp-comm's bound, `2^24 - 1`).
pub const MAX_WORLD_SIZE: usize = (1 << 24) - 1;

/// A job on this node: `nproc_per_node` ranks of `program` with `args`.
///
/// [`LaunchConfig::new`] fills in torchrun's defaults; change the public fields to taste.
/// Its `Debug` shows `DDP_SECRET`'s value in [`env`](Self::env) as `<redacted>`.
#[derive(Clone, PartialEq)]
pub struct LaunchConfig {
    /// The program each rank runs (a path, or a name looked up in `PATH`).
    pub program: OsString,
    /// Its arguments, the same for every rank and attempt.
    pub args: Vec<OsString>,
    /// Variables set for every rank on top of the launcher's own environment (torchrun's
    /// variables are set last and win).
    pub env: Vec<(OsString, OsString)>,
    /// Ranks on this node (torchrun's `--nproc-per-node`).
    pub nproc_per_node: usize,
    /// Number of nodes (`--nnodes`); every node runs the same command with its own
    /// `node_rank`.
    pub nnodes: usize,
    /// This node's index, `0..nnodes` (`--node-rank`).
    pub node_rank: usize,
    /// Host of rank 0 (`--master-addr`); an IPv6 address as is (`::1`) or in torchrun's
    /// brackets (`[::1]`), which the ranks get without ([`LaunchConfig::master_host`]).
    pub master_addr: String,
    /// Port where the ranks meet (`--master-port`). `None`: on one node, a free port
    /// chosen for each attempt; on several, torchrun's 29500.
    pub master_port: Option<u16>,
    /// Restarts of the whole group after a failure (`--max-restarts`).
    pub max_restarts: u32,
    /// The workers' role, written to `ROLE_NAME` (`--role`).
    pub role: String,
    /// The job's id, written to `TORCHELASTIC_RUN_ID` (`--rdzv-id`). `None`: on one node a
    /// fresh id per launch; on several nodes `none`, torchrun's default, which every node
    /// computes alike. Not blank (the ranks would take it for none), and at most
    /// [`MAX_RUN_ID_LEN`] bytes.
    pub run_id: Option<String>,
    /// Folder of the per-rank logs `rank-<rank>.out` (`--log-dir`): everything each rank
    /// printed, stdout and stderr, byte for byte (the two streams' lines interleaved as they
    /// arrive), appended over the attempts. `None`: no log files.
    pub log_dir: Option<PathBuf>,
    /// How long ranks get to end after SIGTERM (or the forwarded signal) before SIGKILL
    /// (`--shutdown-timeout`).
    pub shutdown_timeout: Duration,
    /// How often the ranks are checked (`--monitor-interval`); not zero.
    pub monitor_interval: Duration,
    /// `OMP_NUM_THREADS` for every rank. `None`: torchrun's rule, see
    /// [`LaunchConfig::omp_num_threads_for_ranks`].
    pub omp_num_threads: Option<usize>,
    /// Copy the ranks' output to this process's stdout and stderr (rank 0's as is, the
    /// others' prefixed with `[rank i] `). When false, output goes only to the log files.
    pub echo: bool,
    /// Lines of a failed rank's output kept for [`crate::RankFailure::tail`].
    pub tail_lines: usize,
}

impl LaunchConfig {
    /// `nproc_per_node` ranks of `program` on one node, with torchrun's defaults: no
    /// restarts, master at 127.0.0.1, a 30 s shutdown timeout, checks every 0.1 s.
    pub fn new(program: impl Into<OsString>, nproc_per_node: usize) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".to_string(),
            master_port: None,
            max_restarts: 0,
            role: "default".to_string(),
            run_id: None,
            log_dir: None,
            shutdown_timeout: Duration::from_secs(30),
            monitor_interval: Duration::from_millis(100),
            omp_num_threads: None,
            echo: true,
            tail_lines: 20,
        }
    }

    /// Sets the program's arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args = args.into_iter().map(Into::into).collect();
        self
    }

    /// Checks the settings that need no process: at least one rank and one node, the node
    /// rank among the nodes, a program, a master host, waits up to [`MAX_WAIT`], a
    /// positive monitor interval, a run id the ranks accept.
    pub fn validate(&self) -> Result<(), LaunchError> {
        if self.program.is_empty() {
            return Err(LaunchError::NoProgram);
        }
        if self.nproc_per_node == 0 {
            return Err(LaunchError::NoRanks);
        }
        if self.nnodes == 0 {
            return Err(LaunchError::NoNodes);
        }
        let world = self.nproc_per_node.checked_mul(self.nnodes);
        if world.is_none_or(|w| w > MAX_WORLD_SIZE) {
            return Err(LaunchError::Invalid(format!(
                "--nnodes {} times --nproc-per-node {} is more than {MAX_WORLD_SIZE} ranks, \
                 the most a job can have: give fewer nodes or ranks per node",
                self.nnodes, self.nproc_per_node
            )));
        }
        if self.node_rank >= self.nnodes {
            return Err(LaunchError::NodeRankOutOfRange {
                node_rank: self.node_rank,
                nnodes: self.nnodes,
            });
        }
        let host = self.master_host();
        if host.trim().is_empty() {
            return Err(LaunchError::Invalid(
                "--master-addr is empty: give the host of node 0".to_string(),
            ));
        }
        if host.contains(['[', ']']) {
            return Err(LaunchError::Invalid(format!(
                "--master-addr {}: brackets go around a whole IPv6 address, as [::1] (or \
                 give it without, as ::1)",
                self.master_addr
            )));
        }
        for (wait, flag) in [
            (self.shutdown_timeout, "--shutdown-timeout"),
            (self.monitor_interval, "--monitor-interval"),
        ] {
            if wait > MAX_WAIT {
                return Err(LaunchError::Invalid(format!(
                    "{flag} {} s is too long: give at most {} seconds",
                    wait.as_secs_f64(),
                    MAX_WAIT.as_secs()
                )));
            }
        }
        if self.monitor_interval.is_zero() {
            return Err(LaunchError::Invalid(
                "--monitor-interval 0 s would check the ranks without pause: give a positive \
                 interval, as 0.1 seconds"
                    .to_string(),
            ));
        }
        if let Some(id) = &self.run_id {
            if blank(id) {
                return Err(LaunchError::Invalid(format!(
                    "--rdzv-id {id:?} is blank (an unset variable?), which the ranks would \
                     take for no run id: give the job's id, the same on every node, or leave \
                     the flag out"
                )));
            }
            if id.trim().len() > MAX_RUN_ID_LEN {
                return Err(LaunchError::Invalid(format!(
                    "--rdzv-id is {} bytes long: give at most {MAX_RUN_ID_LEN}",
                    id.trim().len()
                )));
            }
        }
        if self.master_port == Some(0) {
            return Err(LaunchError::Invalid(
                "--master-port 0 is not a port the other ranks can reach; give a port from \
                 1 to 65535, or none on a single node"
                    .to_string(),
            ));
        }
        Ok(())
    }

    /// The same job with torchrun's shutdown timeout for a launcher given none:
    /// `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (whole seconds) where it is set, else
    /// [`shutdown_timeout`](Self::shutdown_timeout) as it was.
    ///
    /// # Errors
    ///
    /// [`LaunchError::Invalid`] naming the variable when its value is not a whole number of
    /// seconds up to [`MAX_WAIT`].
    pub fn torchrun_shutdown_timeout(mut self) -> Result<Self, LaunchError> {
        let var = TORCH_ELASTIC_SHUTDOWN_TIMEOUT;
        let Some(value) = std::env::var_os(var) else {
            return Ok(self);
        };
        let value = value.to_string_lossy();
        let secs = value.trim().parse::<u64>().map_err(|_| {
            LaunchError::Invalid(format!("{var}={value} is not a whole number of seconds"))
        })?;
        if secs > MAX_WAIT.as_secs() {
            return Err(LaunchError::Invalid(format!(
                "{var}={value} is over the limit of {} seconds (about 31 years)",
                MAX_WAIT.as_secs()
            )));
        }
        self.shutdown_timeout = Duration::from_secs(secs);
        Ok(self)
    }

    /// The host the ranks get as `MASTER_ADDR`: [`master_addr`](Self::master_addr) without
    /// the brackets of torchrun's IPv6 form (`[::1]` is `::1`), which no resolver takes.
    pub fn master_host(&self) -> &str {
        let addr = self.master_addr.trim();
        addr.strip_prefix('[')
            .and_then(|a| a.strip_suffix(']'))
            .unwrap_or(addr)
    }

    /// The `DDP_SECRET` given for the job: the last one in [`env`](Self::env), else the
    /// launcher's own.
    pub(crate) fn given_secret(&self) -> Option<OsString> {
        self.given(DDP_SECRET)
    }

    /// The variable `name` the ranks get: the last one in [`env`](Self::env), else the
    /// launcher's own.
    fn given(&self, name: &str) -> Option<OsString> {
        self.env
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, value)| value.clone())
            .or_else(|| std::env::var_os(name))
    }

    /// Whether the ranks take a run id of their own, `DDP_RUN_ID`, before the launcher's
    /// (a blank one counts as none, as the ranks count it).
    fn ranks_have_run_id(&self) -> bool {
        self.given(DDP_RUN_ID)
            .is_some_and(|v| !blank(&v.to_string_lossy()))
    }

    /// What a launcher should tell its user before a job of several nodes without a given
    /// `DDP_SECRET` (the launcher of one node cannot draw a secret that the others share):
    /// the ranks then use the user's key file, which only works where all nodes read the
    /// same one, and whose key differs between jobs only by their run id, so a job without
    /// one (no `--rdzv-id`, and no `DDP_RUN_ID` for the ranks) shares its key with every
    /// other such job. `None` when there is nothing to say.
    pub fn secret_warning(&self) -> Option<String> {
        (self.nnodes > 1 && self.given_secret().is_none()).then(|| {
            let shared = match self.run_id.as_deref() {
                Some(id) if !blank(id) => "",
                _ if self.ranks_have_run_id() => "",
                _ => {
                    "; and without a run id (--rdzv-id) the ranks use torchrun's default \
                     `none`, as every job without one does, so all these jobs share one key \
                     and each accepts what another signs in its store: give this job its own \
                     --rdzv-id, or a DDP_SECRET"
                }
            };
            format!(
                "DDP_SECRET is not set, so the ranks of these {} nodes authenticate each other \
                 with your key file (DDP_SECRET_FILE, else ~/.config/ddp/secret), which works \
                 only if every node reads the same file (a shared home folder); otherwise give \
                 every node the same DDP_SECRET (e.g. `export DDP_SECRET=$(openssl rand -hex \
                 16)` where the job is submitted){shared}",
                self.nnodes
            )
        })
    }

    /// Ranks in the whole job.
    pub fn world_size(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }

    /// The global ranks on this node.
    pub fn ranks(&self) -> std::ops::Range<usize> {
        let first = self.node_rank * self.nproc_per_node;
        first..first + self.nproc_per_node
    }

    /// The `OMP_NUM_THREADS` each rank gets: the configured number; else torchrun's rule, the
    /// launcher's own `OMP_NUM_THREADS` if set, else 1 when there are several ranks per node
    /// (so that they do not oversubscribe the cores); else none.
    pub fn omp_num_threads_for_ranks(&self) -> Option<String> {
        match self.omp_num_threads {
            Some(n) => Some(n.to_string()),
            None => match std::env::var(OMP_NUM_THREADS) {
                Ok(v) => Some(v),
                Err(_) if self.nproc_per_node > 1 => Some("1".to_string()),
                Err(_) => None,
            },
        }
    }

    /// `TORCH_NCCL_ASYNC_ERROR_HANDLING` for the ranks: the launcher's own, else `1`.
    pub(crate) fn nccl_async_error_handling(&self) -> String {
        std::env::var(TORCH_NCCL_ASYNC_ERROR_HANDLING).unwrap_or_else(|_| "1".to_string())
    }
}

impl std::fmt::Debug for LaunchConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Every field by name: a new one fails to compile here until it is shown.
        let LaunchConfig {
            program,
            args,
            env,
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            max_restarts,
            role,
            run_id,
            log_dir,
            shutdown_timeout,
            monitor_interval,
            omp_num_threads,
            echo,
            tail_lines,
        } = self;
        let redacted = OsString::from("<redacted>");
        let env: Vec<(&OsString, &OsString)> = env
            .iter()
            .map(|(k, v)| (k, if k == DDP_SECRET { &redacted } else { v }))
            .collect();
        f.debug_struct("LaunchConfig")
            .field("program", program)
            .field("args", args)
            .field("env", &env)
            .field("nproc_per_node", nproc_per_node)
            .field("nnodes", nnodes)
            .field("node_rank", node_rank)
            .field("master_addr", master_addr)
            .field("master_port", master_port)
            .field("max_restarts", max_restarts)
            .field("role", role)
            .field("run_id", run_id)
            .field("log_dir", log_dir)
            .field("shutdown_timeout", shutdown_timeout)
            .field("monitor_interval", monitor_interval)
            .field("omp_num_threads", omp_num_threads)
            .field("echo", echo)
            .field("tail_lines", tail_lines)
            .finish()
    }
}

/// Whether a run id is blank, which the ranks count as none.
fn blank(id: &str) -> bool {
    id.trim().is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_secret_and_shows_the_rest() {
        let mut c = LaunchConfig::new("prog", 2);
        c.env.push(("DDP_SECRET".into(), "00ff00ff00ff00ff".into()));
        c.env.push(("OTHER".into(), "visible".into()));
        let shown = format!("{c:?}");
        assert!(!shown.contains("00ff00ff00ff00ff"), "{shown}");
        assert!(
            shown.contains(r#"("DDP_SECRET", "<redacted>"), ("OTHER", "visible")"#),
            "{shown}"
        );
        assert!(shown.contains("nproc_per_node: 2"), "{shown}");
    }

    #[test]
    fn several_nodes_without_a_secret_are_warned_about_the_key_file() {
        let one = LaunchConfig::new("prog", 2);
        assert_eq!(one.secret_warning(), None);
        let mut two = LaunchConfig { nnodes: 2, ..one };
        if std::env::var_os(DDP_SECRET).is_none() && std::env::var_os(DDP_RUN_ID).is_none() {
            let warning = two.secret_warning().unwrap();
            assert!(
                warning.starts_with(
                    "DDP_SECRET is not set, so the ranks of these 2 nodes authenticate each \
                     other with your key file"
                ),
                "{warning}"
            );
            // Without a run id, every such job derives the same key from the key file.
            let (plain, shared) = warning.split_once("; and without a run id").unwrap();
            assert!(plain.ends_with("where the job is submitted)"), "{warning}");
            assert_eq!(
                shared,
                " (--rdzv-id) the ranks use torchrun's default `none`, as every job without \
                 one does, so all these jobs share one key and each accepts what another signs \
                 in its store: give this job its own --rdzv-id, or a DDP_SECRET"
            );
            let named = LaunchConfig {
                run_id: Some("job7".into()),
                ..two.clone()
            };
            assert_eq!(Some(plain.to_string()), named.secret_warning());
            // A blank run id is none to the ranks (`--rdzv-id "$SLURM_JOB_ID"` outside a job).
            let blank = LaunchConfig {
                run_id: Some(" ".into()),
                ..two.clone()
            };
            assert_eq!(Some(warning.clone()), blank.secret_warning());
            // The ranks take DDP_RUN_ID before the launcher's run id; a blank one is none.
            let mut own_id = two.clone();
            own_id.env.push((DDP_RUN_ID.into(), "job8".into()));
            assert_eq!(Some(plain.to_string()), own_id.secret_warning());
            own_id.env.push((DDP_RUN_ID.into(), " ".into()));
            assert_eq!(Some(warning), own_id.secret_warning());
        }
        two.env
            .push((DDP_SECRET.into(), "00112233445566778899aabbccddeeff".into()));
        assert_eq!(two.secret_warning(), None);
    }

    #[test]
    fn bad_settings_are_named() {
        let ok = LaunchConfig::new("prog", 2);
        assert!(ok.validate().is_ok());
        let mut cases: Vec<(LaunchConfig, &str)> = vec![
            (
                LaunchConfig::new("prog", 0),
                "the number of ranks per node (--nproc-per-node) must be at least 1",
            ),
            (
                LaunchConfig::new("", 1),
                "no program to start: give the program and its arguments after the launcher's \
                 options",
            ),
            (
                LaunchConfig {
                    nnodes: 0,
                    ..ok.clone()
                },
                "the number of nodes (--nnodes) must be at least 1",
            ),
            (
                LaunchConfig {
                    nnodes: 2,
                    node_rank: 2,
                    ..ok.clone()
                },
                "--node-rank 2 must be below --nnodes 2 (nodes are numbered from 0)",
            ),
            (
                LaunchConfig {
                    nnodes: 4096,
                    nproc_per_node: 4096,
                    ..ok.clone()
                },
                "--nnodes 4096 times --nproc-per-node 4096 is more than 16777215 ranks, the \
                 most a job can have: give fewer nodes or ranks per node",
            ),
            (
                LaunchConfig {
                    nnodes: usize::MAX,
                    ..ok.clone()
                },
                "--nnodes 18446744073709551615 times --nproc-per-node 2 is more than 16777215 \
                 ranks, the most a job can have: give fewer nodes or ranks per node",
            ),
            (
                LaunchConfig {
                    master_port: Some(0),
                    ..ok.clone()
                },
                "--master-port 0 is not a port the other ranks can reach; give a port from 1 to \
                 65535, or none on a single node",
            ),
        ];
        let too_long = MAX_WAIT + Duration::from_millis(500);
        cases.extend([
            (
                LaunchConfig {
                    shutdown_timeout: too_long,
                    ..ok.clone()
                },
                "--shutdown-timeout 1000000000.5 s is too long: give at most 1000000000 seconds",
            ),
            (
                LaunchConfig {
                    monitor_interval: too_long,
                    ..ok.clone()
                },
                "--monitor-interval 1000000000.5 s is too long: give at most 1000000000 seconds",
            ),
            (
                LaunchConfig {
                    monitor_interval: Duration::ZERO,
                    ..ok.clone()
                },
                "--monitor-interval 0 s would check the ranks without pause: give a positive \
                 interval, as 0.1 seconds",
            ),
            (
                LaunchConfig {
                    master_addr: "[]".to_string(),
                    ..ok.clone()
                },
                "--master-addr is empty: give the host of node 0",
            ),
            (
                LaunchConfig {
                    master_addr: "[::1".to_string(),
                    ..ok.clone()
                },
                "--master-addr [::1: brackets go around a whole IPv6 address, as [::1] (or \
                 give it without, as ::1)",
            ),
        ]);
        for (config, message) in cases {
            assert_eq!(config.validate().unwrap_err().to_string(), message);
        }
        let longest = LaunchConfig {
            shutdown_timeout: MAX_WAIT,
            monitor_interval: MAX_WAIT,
            ..ok.clone()
        };
        assert!(longest.validate().is_ok());
        // A run id the ranks would take for none, or refuse (white space around it aside).
        let run_id = |id: String| {
            LaunchConfig {
                run_id: Some(id),
                ..ok.clone()
            }
            .validate()
            .map_err(|e| e.to_string())
        };
        for blank in ["", " \t"] {
            assert_eq!(
                run_id(blank.into()),
                Err(format!(
                    "--rdzv-id {blank:?} is blank (an unset variable?), which the ranks would \
                     take for no run id: give the job's id, the same on every node, or leave \
                     the flag out"
                ))
            );
        }
        let id = "j".repeat(MAX_RUN_ID_LEN);
        assert_eq!(run_id(format!(" {id} ")), Ok(()));
        assert_eq!(
            run_id(format!("{id}j")),
            Err("--rdzv-id is 257 bytes long: give at most 256".into())
        );
    }

    #[test]
    fn the_ranks_get_an_ipv6_master_without_torchruns_brackets() {
        let host = |addr: &str| {
            let config = LaunchConfig {
                master_addr: addr.to_string(),
                ..LaunchConfig::new("prog", 1)
            };
            config.master_host().to_string()
        };
        assert_eq!(host("[::1]"), "::1");
        assert_eq!(host("[fe80::1%eth0]"), "fe80::1%eth0");
        assert_eq!(host("::1"), "::1");
        assert_eq!(host(" node0 "), "node0");
    }

    #[test]
    fn ranks_of_a_node_follow_the_nodes_before_it() {
        let config = LaunchConfig {
            nnodes: 3,
            node_rank: 2,
            ..LaunchConfig::new("prog", 4)
        };
        assert_eq!(config.world_size(), 12);
        assert_eq!(config.ranks(), 8..12);
    }

    #[test]
    fn a_configured_thread_count_wins() {
        let config = LaunchConfig {
            omp_num_threads: Some(3),
            ..LaunchConfig::new("prog", 2)
        };
        assert_eq!(config.omp_num_threads_for_ranks().as_deref(), Some("3"));
    }
}
