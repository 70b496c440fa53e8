//! The ODIR-5K application of the generic Trainer (feature `odir`): [`OdirTask`], the ConvNet
//! on ODIR-5K fundus photos (8-label BCE-with-logits, exact per-class, macro and micro F1), and
//! [`TrainConfig`], the `ddp-train` command line that becomes the Trainer's settings and the
//! task's options. The `ddp-train` binary (`src/main.rs`) is one rank of it.

mod cli;
mod options;
mod task;

pub use cli::{Labels, OdirDefaults, TrainConfig};
pub use options::{auto_pos_weight, Normalize, PosWeight};
pub use task::OdirTask;
