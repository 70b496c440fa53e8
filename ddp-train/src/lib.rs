//! DistributedDataParallel and the Trainer.
//!
//! Being built (the trainer issue); see `ARCHITECTURE.md`.
