//! DistributedDataParallel and the Trainer: data-parallel training of tch models.
//!
//! - [`DistributedDataParallel`] keeps the replicas of a model identical across ranks:
//!   verifies the ranks hold the same model, broadcasts rank 0's weights, broadcasts
//!   BatchNorm buffers before each training forward, and averages gradients with bucketed
//!   all-reduces after backward (PyTorch's `DistributedDataParallel`).
//! - [`Trainer`] runs epochs of the ConvNet on ODIR-5K: rank-sharded sampling with the epoch
//!   advanced by the trainer, Adam, BCE-with-logits, exact distributed evaluation (per-class,
//!   macro and micro F1), `ReduceLROnPlateau`, best-model tracking, atomic checkpoints and
//!   exact resume. The `ddp-train` binary is one rank.
//!
//! A one-rank DDP on the CPU (more ranks are more processes with torchrun's environment):
//!
//! ```
//! use std::sync::Arc;
//! use ddp_comm::{Options, ProcessGroup};
//! use ddp_train::{DdpOptions, DistributedDataParallel};
//! use tch::{nn, Device, Kind, Tensor};
//!
//! let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
//! let pg = Arc::new(ProcessGroup::new(Options::new(0, 1, "127.0.0.1", port))?);
//! let vs = nn::VarStore::new(Device::Cpu);
//! let w = vs.root().var("w", &[3], nn::Init::Const(1.0));
//! let mut ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default())?;
//! ddp.broadcast_buffers()?;
//! (&w * 2.0).sum(Kind::Float).backward();
//! ddp.sync_gradients()?; // averages over ranks (here: one)
//! assert_eq!(Vec::<f32>::try_from(&w.grad())?, [2.0, 2.0, 2.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

pub mod config;
pub mod ddp;
pub mod malloc;
pub mod metrics;
pub mod optim;
pub mod plot;
pub mod scheduler;
pub mod state;
pub mod trainer;

pub use config::TrainConfig;
pub use ddp::{DdpError, DdpOptions, DistributedDataParallel};
pub use trainer::{EpochMetrics, EvalMetrics, Trainer};
