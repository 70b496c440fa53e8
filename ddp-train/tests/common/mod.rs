//! Helpers shared by the tests that run ranks as real processes.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A port that was free a moment ago on loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh, empty folder `<tmp>/<prefix>-<name>-<pid>`.
pub fn temp_dir(prefix: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{prefix}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `program` as rank `rank` of `world` on this machine, with torchrun's environment and the
/// rendezvous at 127.0.0.1:`port`.
pub fn rank_command(program: impl AsRef<Path>, rank: usize, world: usize, port: &str) -> Command {
    let mut cmd = Command::new(program.as_ref());
    cmd.env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port);
    cmd
}
