//! The error type of every fallible call in this crate.

use std::net::SocketAddr;
use std::time::Duration;

/// What follows NCCL's words when it answers `ncclSystemError`: in a container, often its
/// shared-memory transport's segments (GPUs without peer-to-peer access) did not fit in
/// `/dev/shm`.
pub(crate) const NCCL_SYSTEM_ERROR_HINT: &str = "in a container, NCCL's shared memory may not \
     fit in /dev/shm (docker's default is 64 MiB): run it with --ipc=host or --shm-size=1g";

/// What went wrong in rendezvous, in the store, or in a collective.
///
/// Messages name what the user must look at: the rank, the address, the variable, the
/// timeout.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// An environment variable holds a value that cannot be used.
    #[error("environment variable {var}={value:?} is not valid: expected {expected}")]
    MalformedEnv {
        /// The variable's name.
        var: String,
        /// Its value.
        value: String,
        /// What it should hold.
        expected: String,
    },
    /// A required environment variable is missing.
    #[error("environment variable {var} is not set ({why})")]
    MissingEnv {
        /// The variable's name.
        var: String,
        /// Why it is needed.
        why: String,
    },
    /// A rank number is not below the world size.
    #[error("rank {rank} is out of range for world size {world_size}")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// An explicit argument is not valid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Rank 0 could not listen on the rendezvous address because something else holds it.
    #[error(
        "cannot listen on {addr}: port already in use (choose another MASTER_PORT, or a \
         launcher's --master-port)"
    )]
    PortInUse {
        /// The address that was busy.
        addr: SocketAddr,
    },
    /// An address could not be resolved or bound.
    #[error("address {addr}")]
    Address {
        /// The address as given.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Rendezvous did not complete in time.
    #[error(
        "rendezvous at {addr} timed out after {timeout:?}: ranks {missing:?} never arrived{}",
        turned_away_hint(*turned_away)
    )]
    RendezvousTimeout {
        /// The store's address.
        addr: String,
        /// The time waited.
        timeout: Duration,
        /// The ranks that did not show up.
        missing: Vec<usize>,
        /// Connections refused in their handshake meanwhile, by rank 0's store or by this
        /// rank's ring listener (the one `addr` names): a rank with another secret is one of
        /// them.
        turned_away: usize,
    },
    /// The store (rank 0's, or torchrun's agent store), or a ring neighbour, could not be
    /// reached.
    #[error("cannot reach {addr} within {timeout:?}")]
    StoreUnreachable {
        /// What was not reached and its address (`the rendezvous store at HOST:PORT`).
        addr: String,
        /// The time spent trying.
        timeout: Duration,
        /// The last connection error.
        source: std::io::Error,
    },
    /// The handshake with a peer (the store, or a ring neighbour) failed: it does not know
    /// this job's secret, or does not trust this rank's, or runs as another user. Nothing
    /// was exchanged with it.
    #[error("handshake with {addr} failed: {failure}")]
    Handshake {
        /// The peer: its address, and its rank when it is one.
        addr: String,
        /// What went wrong, and what to check.
        failure: AuthFailure,
    },
    /// The key file the job's secret comes from (`DDP_SECRET_FILE`, else
    /// `~/.config/ddp/secret`, when `DDP_SECRET` is not set) cannot be used.
    #[error("key file {}: {detail}", path.display())]
    SecretFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it, and what to do (never its contents).
        detail: String,
    },
    /// The store failed or answered something unexpected.
    #[error("store at {addr}: {detail}")]
    Store {
        /// The store's address.
        addr: String,
        /// What happened.
        detail: String,
    },
    /// Rank 0's store hung up: rank 0 exited or failed (as opposed to not answering in time).
    #[error("store at {addr}: the store closed the connection (rank 0 exited or failed)")]
    StoreClosed {
        /// The store's address.
        addr: String,
    },
    /// Ranks disagree about the world size, or one rank number was started twice, or another
    /// rank aborted the rendezvous.
    #[error("rendezvous at {addr} failed: {detail}")]
    Rendezvous {
        /// The store's address.
        addr: String,
        /// What happened.
        detail: String,
    },
    /// A peer closed its connection or failed.
    #[error("{op}: peer rank {peer} ({via}) failed: {detail}")]
    PeerLost {
        /// The collective.
        op: &'static str,
        /// The peer's rank.
        peer: usize,
        /// How the peer was reached: `tcp <address>` or `shared memory, pid <pid>`.
        via: String,
        /// What happened.
        detail: String,
    },
    /// A peer sent something no correct rank sends: an impossible ring index in shared
    /// memory, say. The link cannot be used any more.
    #[error("{op}: peer rank {peer} ({via}) broke the protocol: {detail}")]
    Protocol {
        /// The collective.
        op: &'static str,
        /// The peer's rank.
        peer: usize,
        /// How the peer was reached: `tcp <address>` or `shared memory, pid <pid>`.
        via: String,
        /// What it sent.
        detail: String,
    },
    /// Peers' contributions to a gather add up to more than this rank accepts to allocate.
    #[error(
        "{op}: rank {rank} contributes {bytes} bytes, which brings the total to {total} bytes, \
         over the limit of {limit} bytes for all ranks together \
         (ProcessGroup::set_max_gather_bytes)"
    )]
    TooLarge {
        /// The collective.
        op: &'static str,
        /// The rank whose contribution crossed the limit.
        rank: usize,
        /// Its contribution in bytes.
        bytes: u64,
        /// The total so far with it (saturating).
        total: u64,
        /// The limit.
        limit: u64,
    },
    /// A collective did not complete in time. `peers` are the ring neighbours this rank was
    /// waiting on; `diagnosis` names the rank that is hung, which may be another one.
    #[error("{op} timed out after {timeout:?}{}{diagnosis}", waiting_for(.peers))]
    Timeout {
        /// The collective.
        op: &'static str,
        /// The timeout.
        timeout: Duration,
        /// The ranks this rank was waiting on (none for NCCL, which does not say).
        peers: Vec<usize>,
        /// What the heartbeats said about every rank after the timeout.
        diagnosis: Box<Diagnosis>,
    },
    /// Ranks called different collectives or passed different sizes.
    #[error("{op}: rank {peer} called {theirs}, this rank (rank {rank}) called {ours}; every rank must call the same collectives with the same sizes")]
    Mismatch {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The peer's rank.
        peer: usize,
        /// What this rank called.
        ours: String,
        /// What the peer called.
        theirs: String,
    },
    /// An earlier collective failed; the group cannot be used any more.
    #[error("the process group is unusable after an earlier failure: {0}")]
    Poisoned(String),
    /// A tensor cannot take part in a collective.
    #[error("tensor not supported by {backend}: {detail}")]
    Tensor {
        /// The backend that refused it: `"cpu"`, `"nccl"`, or `"any"` for a device neither takes.
        backend: &'static str,
        /// What is wrong (dtype, device, layout).
        detail: String,
    },
    /// An NCCL communicator could not be created: NCCL failed, or not every rank joined
    /// within the longer of the collective and rendezvous timeouts (the communicator is
    /// aborted, nothing is left waiting).
    #[error("NCCL communicator init of rank {rank} on cuda:{device} {what}{diagnosis}")]
    NcclInit {
        /// This rank.
        rank: usize,
        /// Its CUDA device.
        device: usize,
        /// What happened: `timed out after ...` or `failed: ...`.
        what: String,
        /// On a timeout, what the heartbeats said about every rank.
        diagnosis: Box<Diagnosis>,
    },
    /// NCCL or the CUDA runtime failed.
    #[error("{call} failed: {detail}")]
    Nccl {
        /// The call.
        call: &'static str,
        /// The library's message.
        detail: String,
    },
    /// A library could not be loaded.
    #[error(transparent)]
    Load(#[from] nccl_sys::LoadError),
    /// Any other I/O error.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Why a connection's handshake failed ([`CommError::Handshake`]). Each says what to check.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthFailure {
    /// The peer hung up during the handshake: it refused this rank's proof of the secret
    /// (the secrets differ), or it speaks another version of the handshake.
    #[error(
        "the peer closed the connection: it refused this rank's proof of the job secret, so \
         the secrets differ ({hint}), or it runs another version of ddp-comm"
    )]
    Refused {
        /// What to check.
        hint: String,
    },
    /// The peer could not prove that it knows the secret: it is not a rank of this job (a
    /// stranger, or a job started with another secret), so this rank did not trust it.
    #[error(
        "the peer could not prove that it knows the job secret: it is not a rank of this \
         job, or the secrets differ ({hint})"
    )]
    Unproven {
        /// What to check.
        hint: String,
    },
    /// The peer hung up before sending its challenge, each time until the deadline: it was
    /// busy with other handshakes (a store or listener takes a bounded number at once, so
    /// strangers' connections or very many ranks at once turn some away), or it is not a
    /// ddp-comm peer of this version.
    #[error(
        "the peer closed the connection before its challenge, {times} time(s) until the \
         deadline: it was busy with other handshakes (strangers connecting to its port, or \
         very many ranks at once), or it is not a peer of this ddp-comm version"
    )]
    TurnedAway {
        /// How many connections it closed so.
        times: usize,
    },
    /// The peer did not finish the handshake in time.
    #[error("the peer did not finish the handshake within {waited:?}")]
    NoAnswer {
        /// How long it was given.
        waited: Duration,
    },
    /// A shared-memory peer runs as another user.
    #[error(
        "the peer runs as uid {peer_uid} and this rank as uid {uid}: ranks that share memory \
         must run as the same user"
    )]
    OtherUser {
        /// The peer's uid.
        peer_uid: u32,
        /// This process's effective uid.
        uid: u32,
    },
}

/// What a rank found out, after a collective timed out, about the ranks that did not keep
/// up: from every rank's heartbeat in the rendezvous store (see the crate's README).
///
/// Its `Display` is empty when no diagnosis was made, else `"; "` followed by the findings,
/// so that it reads as the end of [`CommError::Timeout`]'s message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Diagnosis {
    /// The number of collectives this rank had entered (the one that timed out is the
    /// last); 0 when no diagnosis was made.
    pub this_collective: u64,
    /// Ranks whose heartbeat stopped: stopped (`SIGSTOP`), frozen, or on a host that cannot
    /// be reached. Includes rank 0 when the store it serves does not answer.
    pub not_responding: Vec<usize>,
    /// Ranks that are alive but have not entered this collective: `(rank, collectives it
    /// has entered)`. They are stuck outside the collectives (a data loader, a disk).
    pub behind: Vec<(usize, u64)>,
    /// Set when the rendezvous store did not answer: what happened.
    pub store_silent: Option<String>,
    /// Set when this rank has no heartbeat to read: why.
    pub unavailable: Option<String>,
}

impl Diagnosis {
    /// The ranks found hung, in order: not responding or behind.
    pub fn hung_ranks(&self) -> Vec<usize> {
        let mut ranks: Vec<usize> = self.not_responding.clone();
        ranks.extend(self.behind.iter().map(|&(r, _)| r));
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }
}

impl std::fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.this_collective == 0 {
            return Ok(());
        }
        let mut parts = Vec::new();
        if let Some(why) = &self.unavailable {
            parts.push(format!("no heartbeats to tell which rank is hung ({why})"));
        }
        if let Some(what) = &self.store_silent {
            parts.push(what.clone());
        }
        match self.not_responding.as_slice() {
            [] => {}
            [one] => parts.push(format!(
                "rank {one} is not responding (stopped, frozen, or its host is unreachable)"
            )),
            many => parts.push(format!(
                "ranks {many:?} are not responding (stopped, frozen, or their hosts are \
                 unreachable)"
            )),
        }
        for (rank, at) in &self.behind {
            parts.push(format!(
                "rank {rank} is behind: still at collective #{at}, this rank is at #{} \
                 (stuck outside the collectives, e.g. in data loading)",
                self.this_collective
            ));
        }
        if parts.is_empty() {
            parts.push(format!(
                "every rank is alive and has entered collective #{} (a slow or congested \
                 link?)",
                self.this_collective
            ));
        }
        write!(f, "; {}", parts.join("; "))
    }
}

fn waiting_for(peers: &[usize]) -> String {
    if peers.is_empty() {
        String::new()
    } else {
        format!(" waiting for peer ranks {peers:?}")
    }
}

impl CommError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        CommError::Io {
            context: context.into(),
            source,
        }
    }
}

/// `err` and its causes, `message: cause: cause`, for where an error is kept as text (a
/// poisoned group's reason, another rank's abort, a log line): a message says its own level
/// only, and its cause is its `source()`.
pub(crate) fn with_causes(err: &(dyn std::error::Error + 'static)) -> String {
    let chain = std::iter::successors(Some(err), |&e| e.source());
    chain
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

/// What a rendezvous timeout adds when rank 0's store refused connections meanwhile.
fn turned_away_hint(turned_away: usize) -> String {
    if turned_away == 0 {
        return String::new();
    }
    format!(
        "; meanwhile {turned_away} connection(s) were refused because they failed the handshake, \
         as a rank whose job secret differs does: every node must have the same DDP_SECRET \
         (or, without it, the same key file, DDP_SECRET_FILE or ~/.config/ddp/secret)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;
    use std::io;

    /// Each error with an OS cause says its own level only and hands out the cause as its
    /// source, so that a chain of causes (`with_causes`, anyhow's `{:#}`) says it once.
    #[test]
    fn a_message_leaves_its_cause_to_source() {
        let cause = || io::Error::other("connection refused by the test");
        let errors = [
            CommError::Address {
                addr: "master-0:29500".into(),
                source: cause(),
            },
            CommError::StoreUnreachable {
                addr: "the rendezvous store at 10.0.0.1:29500".into(),
                timeout: Duration::from_secs(3),
                source: cause(),
            },
            CommError::io("ring socket", cause()),
        ];
        let expected = [
            "address master-0:29500",
            "cannot reach the rendezvous store at 10.0.0.1:29500 within 3s",
            "ring socket",
        ];
        for (err, expected) in errors.iter().zip(expected) {
            let source = err.source().expect("a source").to_string();
            assert_eq!(source, "connection refused by the test");
            assert_eq!(err.to_string(), expected);
            let text = with_causes(err);
            assert_eq!(text, format!("{expected}: {source}"));
            assert_eq!(text.matches(&source).count(), 1, "{text}");
        }
    }
}
