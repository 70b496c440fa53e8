//! What can go wrong in the launcher itself (a rank that fails is an [`crate::Outcome`]).

use std::path::PathBuf;

/// `ddp-run`'s flag for the port where the ranks meet, which [`LaunchError::NoFreePort`]
/// names when [`crate::launch`] returns it.
pub(crate) const MASTER_PORT_FLAG: &str = "--master-port";
/// `ddp-run`'s flag for the folder of the rank logs, which the log errors name when
/// [`crate::launch`] returns them.
pub(crate) const LOG_DIR_FLAG: &str = "--log-dir";

/// An error of the launcher: bad settings, or a rank it could not start or watch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// `nproc_per_node` is 0.
    #[error("the number of ranks per node (--nproc-per-node) must be at least 1")]
    NoRanks,
    /// `nnodes` is 0.
    #[error("the number of nodes (--nnodes) must be at least 1")]
    NoNodes,
    /// `node_rank` is not below `nnodes`.
    #[error("--node-rank {node_rank} must be below --nnodes {nnodes} (nodes are numbered from 0)")]
    NodeRankOutOfRange {
        /// The node rank given.
        node_rank: usize,
        /// The number of nodes.
        nnodes: usize,
    },
    /// A setting the launcher rejects, with what to do instead.
    #[error("{0}")]
    Invalid(String),
    /// The program is empty.
    #[error(
        "no program to start: give the program and its arguments after the launcher's options"
    )]
    NoProgram,
    /// No free port could be found for a single-node rendezvous.
    #[error("cannot find a free port on 127.0.0.1 for the ranks to meet on (give {port_flag})")]
    NoFreePort {
        /// What chooses the port, in the launcher's words: `ddp-run`'s `--master-port` from
        /// [`crate::launch`], another launcher's through `cli::Wording::reword`.
        port_flag: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The log folder is a file.
    #[error(
        "the folder of the rank logs {} is a file: remove it, or give another {log_dir_flag}",
        path.display()
    )]
    LogDirIsFile {
        /// The file.
        path: PathBuf,
        /// What chooses the folder, in the launcher's words: `ddp-run`'s `--log-dir` from
        /// [`crate::launch`], another launcher's through `cli::Wording::reword`.
        log_dir_flag: String,
    },
    /// The log folder cannot be created, or a rank's log file opened.
    #[error(
        "cannot write the rank log {}{}",
        path.display(),
        if source.raw_os_error() == Some(libc::ELOOP) {
            // What O_NOFOLLOW answers for a symbolic link.
            format!(
                ": it is a symbolic link, which a rank's log may not be (so that a shared \
                 folder cannot send it elsewhere); remove it, or give another {log_dir_flag}"
            )
        } else {
            String::new()
        }
    )]
    Log {
        /// The folder or file.
        path: PathBuf,
        /// What chooses the folder, as in [`LaunchError::LogDirIsFile`].
        log_dir_flag: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A rank's process could not be started.
    #[error(
        "cannot start rank {rank}: {program}{}",
        hint.as_deref().map(|h| format!(", {h}")).unwrap_or_default()
    )]
    Spawn {
        /// The global rank.
        rank: usize,
        /// The program, as given.
        program: String,
        /// What the user probably meant, where the failure has a known cause: a script in
        /// the current folder given without `./`, or a Python script given as torchrun takes
        /// it (torchrun runs `python SCRIPT`; ddp-run runs the program itself).
        hint: Option<String>,
        /// Why (for instance, no such file).
        #[source]
        source: std::io::Error,
    },
    /// A rank's process could not be watched (waitid failed).
    #[error(
        "cannot watch rank {rank} (pid {pid}){}",
        if source.raw_os_error() == Some(libc::ECHILD) {
            ": it is no longer the launcher's child, something else in its process reaped \
             it (a wait for any child, or SIGCHLD ignored while the ranks run)"
        } else {
            ""
        }
    )]
    Wait {
        /// The global rank.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The signal handlers that forward SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGUSR1 to the ranks
    /// could not be installed, or an ignored SIGCHLD could not be set back to its default.
    #[error("cannot install the handler of signal {signal}")]
    Signals {
        /// The signal number.
        signal: i32,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Joins messages, outermost first, with `: `, leaving out each one that is empty or that
/// the text before it already contains.
pub fn join_causes(messages: impl IntoIterator<Item = String>) -> String {
    let mut text = String::new();
    for message in messages {
        if message.is_empty() || text.contains(&message) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&message);
    }
    text
}
