//! DistributedDataParallel and the Trainer: data-parallel training of tch models.
//!
//! - [`DistributedDataParallel`] keeps the replicas of a model identical across ranks:
//!   verifies the ranks hold the same model, broadcasts rank 0's weights, broadcasts
//!   BatchNorm buffers before each step's first forward, and averages gradients with bucketed
//!   all-reduces after backward (PyTorch's `DistributedDataParallel`).
//! - [`Trainer`] trains any [`Task`] (a tch model, a [`ddp_data::Dataset`], a loss and
//!   evaluation [`Stats`] that add up across ranks): rank-sharded sampling with the epoch
//!   advanced by the trainer, gradient accumulation, Adam, AdamW or SGD with checkpointable state,
//!   exact distributed evaluation, `ReduceLROnPlateau`, best-model files, atomic checkpoints
//!   and exact resume (also after a launcher's restart), and a run directory with
//!   `metrics.jsonl`, `curves.png` (`plot` feature; a build without it says at start-up that
//!   it draws none) and per-rank logs. [`Settings`] has defaults and a builder.
//! - With the `odir` feature (default), [`odir::OdirTask`] is `--model` on ODIR-5K, and the
//!   `ddp-train` binary (one rank) is its command line. Without default features the crate
//!   compiles neither the image stack, nor clap, nor plotting (`plot` feature).
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

pub mod allocation;
mod amp;
#[cfg(feature = "cli")]
pub mod cli;
mod ddp;
mod error;
mod exit;
pub mod functional;
mod gather;
pub mod logging;
pub mod lr_schedule;
pub mod malloc;
mod metrics;
#[cfg(feature = "odir")]
pub mod odir;
pub mod optim;
#[cfg(feature = "plot")]
pub mod plot;
mod report;
pub mod scheduler;
mod settings;
pub mod state;
mod stop;
mod task;
mod trainer;

pub use amp::{FoundInf, GradScaler, Precision, ScalerState};
pub use ddp::{
    BuiltinHook, CommHook, DdpError, DdpOptions, DistributedDataParallel, GradBucket, HookWork,
};
pub use error::{Disagreement, SettingError, TrainError};
pub use exit::exit_with;
pub use gather::{gather_rows, Rows};
pub use metrics::{Confusion, Goal, MultiClassStats, MultiLabelStats, RegressionStats, StatsError};
pub use report::{EpochReport, EvalReport};
pub use settings::{
    CheckpointSettings, DeviceChoice, EarlyStopping, FreezeSettings, Monitor, RuntimeSettings,
    Settings,
};
pub use stop::{StopReason, EXIT_STOPPED, STOP_SIGNALS};
pub use task::{Metrics, NoStats, Stats, Task};
pub use trainer::Trainer;

/// The README's Rust blocks ("Your own model"), compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
