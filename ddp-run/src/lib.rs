//! `ddp-run`: the torchrun counterpart, as a library and a binary.
//!
//! It starts N processes ("ranks") of any program on this node with torchrun's environment
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `ROLE_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RESTART_COUNT`, ...) and supervises them as
//! torchrun's elastic agent does: the first rank to fail ends the job (the others get SIGTERM,
//! then SIGKILL after a grace period), `max_restarts` restarts the whole group, and signals the
//! launcher receives are forwarded to every rank; ranks that stop at a checkpoint on request
//! (exit code [`EXIT_STOPPED`]) end the job as [`Outcome::Stopped`], not as a failure. Ranks
//! die with the launcher even when it is killed with SIGKILL (`PR_SET_PDEATHSIG`); a rank
//! started through a wrapper (`sh -c`) dies with it too when it calls [`die_with_launcher`]
//! (ddp-train's Trainer does). Each rank's output goes to its log file and to the terminal,
//! other ranks' lines prefixed with `[rank i]`.
//!
//! - [`LaunchConfig`] is what torchrun's command line says: program, ranks per node, nodes,
//!   master address and port, restarts, log folder.
//! - [`launch`] runs the job and returns its [`Outcome`]; the [`Event`]s it reports
//!   (attempt starting, rank failed, restarting, a warning) are for the caller to show.
//! - [`RankEnv`] and the names in [`mod@env`] are the torchrun environment, for anything else
//!   that starts ranks by hand (tests, benchmarks); [`JobSecret`] is the job's secret, drawn
//!   by [`launch`] once per job and given to the ranks only in `DDP_SECRET`.
//!
//! The library prints nothing of its own (only the ranks' output, when
//! [`LaunchConfig::echo`] is set) and needs neither tch nor clap; the `cli` feature (on by
//! default) adds the `ddp-run` binary and
#![cfg_attr(
    feature = "cli",
    doc = "[`cli`]: its reusable flag groups, and [`cli::launch_and_report`],"
)]
#![cfg_attr(
    not(feature = "cli"),
    doc = "`cli`: its reusable flag groups, and `cli::launch_and_report`,"
)]
//! a job run with the binary's messages and exit status for programs that start ranks
//! themselves.
//!
//! ```
//! use ddp_run::{launch, Event, LaunchConfig, Outcome};
//!
//! // Two ranks of a shell command that checks its own environment.
//! let config = LaunchConfig {
//!     echo: false,
//!     ..LaunchConfig::new("sh", 2).args(["-c", r#"test "$WORLD_SIZE" = 2 && test "$RANK" -lt 2"#])
//! };
//! let mut attempts = 0;
//! let outcome = launch(&config, |event| {
//!     if let Event::Starting { .. } = event {
//!         attempts += 1;
//!     }
//! })?;
//! assert_eq!(outcome, Outcome::Succeeded { restarts: 0 });
//! assert_eq!(attempts, 1);
//! # Ok::<(), ddp_run::LaunchError>(())
//! ```

#![warn(missing_docs)]

#[cfg(not(target_os = "linux"))]
compile_error!("ddp-run runs on Linux only: it uses PR_SET_PDEATHSIG, waitid, /proc");

#[cfg(feature = "cli")]
pub mod cli;
mod config;
mod devices;
pub mod env;
mod error;
mod error_file;
mod job_start;
mod lifeline;
mod lines;
mod port;
mod rank_env;
mod run_dir;
mod secret;
mod signals;
mod supervisor;

pub use config::{LaunchConfig, MAX_RUN_ID_LEN, MAX_WAIT, MAX_WORLD_SIZE};
pub use devices::{available_cores, refuse_more_ranks_than_gpus, visible_gpus, NprocPerNode};
pub use error::{join_causes, LaunchError};
pub use error_file::record_error;
pub use job_start::job_started;
pub use lifeline::die_with_launcher;
pub use port::free_port;
pub use rank_env::RankEnv;
pub use run_dir::{default_run_dir, run_dir_name};
pub use secret::{JobSecret, SECRET_BYTES};
pub use signals::{SignalWatch, FORWARDED as FORWARDED_SIGNALS};
pub use supervisor::{launch, Event, Exit, Outcome, RankFailure, EXIT_STOPPED};
