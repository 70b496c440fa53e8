//! DistributedDataParallel and the Trainer.

#![warn(missing_docs)]

pub mod ddp;
pub mod metrics;
pub mod optim;
pub mod scheduler;

pub use ddp::{DdpError, DdpOptions, DistributedDataParallel};
