//! ODIR-5K loading, transforms and the batch loader.
//!
//! Being built (the data issue); see `ARCHITECTURE.md`.
