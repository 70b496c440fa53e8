//! Rendezvous and a process group (all-reduce, broadcast, all-gather, barrier).
//!
//! Being built (the communication issue); see `ARCHITECTURE.md`.
