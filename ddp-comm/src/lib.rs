//! Rendezvous and a process group for data-parallel training of tch programs: the Rust
//! counterpart of `torch.distributed`'s `init_process_group("env://")`, `all_reduce`,
//! `broadcast`, `all_gather` and `barrier`.
//!
//! - [`ProcessGroup`] is the central type. [`ProcessGroup::from_env`] reads torchrun's
//!   `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` (else SLURM's, else
//!   rank 0 of 1) and meets the other ranks; [`ProcessGroup::new`] takes explicit
//!   [`Options`]: an [`EnvConfig`] (read from the environment or given in code) plus the
//!   backend and buffer sizes.
//! - Two backends: CUDA tensors travel through NCCL (loaded at run time through
//!   `nccl-sys`), CPU tensors around a ring ([`Backend`]) whose links are shared memory
//!   between ranks on one host and TCP between hosts ([`Transport`], [`LinkKind`]; set
//!   `DDP_TRANSPORT=tcp` to use TCP everywhere). Results are identical on every rank, and
//!   bit for bit the same over either transport.
//! - Failures are a [`CommError`] naming the rank, address or timeout: nothing waits forever.
//!   A collective that times out names the rank that is hung, which may not be a neighbour,
//!   from every rank's heartbeat in the store ([`Diagnosis`]).
//!
//! - Every connection between ranks starts with a mutual challenge–response over the job's
//!   [`Secret`] (`DDP_SECRET`, which `ddp-run` sets; else derived from the user's key file,
//!   `~/.config/ddp/secret`, and the run id): strangers get nothing, and a peer that cannot
//!   prove the secret is not trusted ([`CommError::Handshake`], [`AuthFailure`]). See the
//!   README's "Security".
//!
//! Rendezvous (`rendezvous.rs`) uses a small key-value store served by rank 0 (`store.rs`),
//! or torchrun's own agent store (`c10d.rs`), and connects the ring (`connect.rs`), each
//! connection authenticated by `auth.rs` with the key of `secret.rs`; ring
//! schedules (`ring.rs`) are executed by `cpu.rs` over each link's end (`link.rs`): a
//! non-blocking socket (`tcp.rs`) or a shared-memory ring (`shm.rs`); NCCL lives in
//! `nccl.rs` and CUDA loading in [`cuda`]; heartbeats and the diagnosis of a timeout in
//! `heartbeat.rs`; asynchronous collectives ([`Work`]) and the communication thread in
//! `work.rs`.
//!
//! ```
//! use ddp_comm::{Backend, Options, ProcessGroup, ReduceOp};
//! use tch::Tensor;
//!
//! // A group of one needs no environment and no network.
//! let group = ProcessGroup::new(Options::new(0, 1, "127.0.0.1", 0).backend(Backend::Tcp))?;
//! let mut grads = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
//! group.all_reduce(&mut grads, ReduceOp::Avg)?;
//! assert_eq!(Vec::<f32>::try_from(&grads).unwrap(), [1.0, 2.0, 3.0]);
//! let digests = group.all_gather_bytes(b"abc")?;
//! assert_eq!(digests, vec![b"abc".to_vec()]);
//! # Ok::<(), ddp_comm::CommError>(())
//! ```

#![warn(missing_docs)]

mod auth;
mod c10d;
mod connect;
mod cpu;
pub mod cuda;
mod element;
mod env;
mod error;
mod group;
mod heartbeat;
mod key_file;
mod link;
mod nccl;
mod options;
mod rendezvous;
mod ring;
mod secret;
mod shm;
mod store;
mod sync;
mod tcp;
mod tensor;
mod throttle;
mod wire;
mod work;

pub use cpu::DEFAULT_MAX_GATHER_BYTES;
pub use element::{DType, Element, ReduceOp};
pub use env::{
    first_slurm_host, EnvConfig, EnvSource, HOST_ID_ENV, MAX_RUN_ID_LEN, OP_TIMEOUT_ENV,
    RDZV_TIMEOUT_ENV, RUN_ID_ENV, TRANSPORT_ENV,
};
pub use error::{AuthFailure, CommError, Diagnosis};
pub use group::{ProcessGroup, RingLayout};
pub use key_file::SECRET_FILE_ENV;
pub use link::{LinkKind, Transport};
pub use nccl::version as nccl_version;
pub use options::{
    Backend, Options, DEFAULT_OP_TIMEOUT, DEFAULT_RENDEZVOUS_TIMEOUT, DEFAULT_SHM_RING_BYTES,
    DEFAULT_SOCKET_BUFFER,
};
pub use secret::{Secret, SecretOrigin, MAX_SECRET_BYTES, MIN_SECRET_BYTES, SECRET_ENV};
pub use tensor::dtype_of;
pub use work::Work;
