//! Deterministic rank-sharded sampling.
//!
//! Being built (the sampler issue); see `ARCHITECTURE.md`.
