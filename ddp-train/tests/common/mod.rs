//! Helpers shared by the tests that run ranks as real processes: the workspace's one copy,
//! in ddp-testkit (free port below the ephemeral range, tempfile folders, bounded waits,
//! torchrun's environment from ddp-run).

#![allow(unused_imports)] // Each test file uses its own subset.

pub use ddp_testkit::{free_port, rank_command, temp_dir, text, wait_all, wait_bounded, TempDir};
