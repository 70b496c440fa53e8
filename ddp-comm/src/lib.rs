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
//! The source is one folder per seam, each `mod.rs` naming its job: `config/` (what a group
//! is told: [`EnvConfig`], [`Options`]), `security/` (the [`Secret`] and the handshake every
//! connection starts with), `store/` (the key-value store ranks meet at, and the heartbeats in
//! it), `ring/` (the CPU backend and its links), `nccl/` (the NCCL backend, and [`cuda`]) and
//! `group/` ([`ProcessGroup`]: rendezvous, tensors, [`Work`]). Below them all sit `error.rs`,
//! `element.rs` (what collectives compute on), `sync.rs` and `tcp.rs`.
//!
//! ```
//! use ddp_comm::{Backend, Options, ProcessGroup, ReduceOp};
//! use tch::Tensor;
//!
//! // A group of one needs no environment and no network.
//! let group = ProcessGroup::new(Options::new(0, 1, "127.0.0.1", 0).backend(Backend::Cpu))?;
//! let mut grads = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
//! group.all_reduce(&mut grads, ReduceOp::Avg)?;
//! assert_eq!(Vec::<f32>::try_from(&grads).unwrap(), [1.0, 2.0, 3.0]);
//! let digests = group.all_gather_bytes(b"abc")?;
//! assert_eq!(digests, vec![b"abc".to_vec()]);
//! # Ok::<(), ddp_comm::CommError>(())
//! ```

#![warn(missing_docs)]

#[cfg(not(target_os = "linux"))]
compile_error!("ddp-comm runs on Linux only: it uses memfd rings, /proc, Linux sockets");

mod config;
mod element;
mod error;
mod group;
mod nccl;
mod ring;
mod security;
mod store;
mod sync;
mod tcp;

pub use nccl::cuda;

pub use config::env::{
    first_slurm_host, EnvConfig, EnvSource, HOST_ID_ENV, LAUNCHER_ATTEMPT_ENV, MAX_RUN_ID_LEN,
    OP_TIMEOUT_ENV, RDZV_TIMEOUT_ENV, RUN_ID_ENV, TRANSPORT_ENV,
};
pub use config::options::{
    Backend, Options, DEFAULT_NCCL_OP_TIMEOUT, DEFAULT_OP_TIMEOUT, DEFAULT_RENDEZVOUS_TIMEOUT,
    DEFAULT_SHM_RING_BYTES, DEFAULT_SOCKET_BUFFER,
};
pub use element::{DType, Element, ReduceOp};
pub use error::{AuthFailure, CommError, Diagnosis};
pub use group::tensor::dtype_of;
pub use group::work::Work;
pub use group::{ProcessGroup, RingLayout};
pub use nccl::version as nccl_version;
pub use ring::cpu::DEFAULT_MAX_GATHER_BYTES;
pub use ring::link::{LinkKind, Transport};
pub use security::key_file::SECRET_FILE_ENV;
pub use security::secret::{Secret, SecretOrigin, MAX_SECRET_BYTES, MIN_SECRET_BYTES, SECRET_ENV};
