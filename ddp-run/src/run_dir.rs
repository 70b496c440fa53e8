//! The name of a job's run directory, the one format every tool of the workspace uses:
//! `YYYYMMDD-HHMMSS-PID`, the UTC time the job started and the starting process's id (two
//! jobs started in the same second on one machine get different folders), and folders made
//! durable ([`create_folders_synced`]).

use std::path::{Path, PathBuf};

/// `YYYYMMDD-HHMMSS-PID` for a job started at `at` by process `pid`.
pub fn run_dir_name(at: time::OffsetDateTime, pid: u32) -> String {
    let at = at.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}{:02}{:02}-{:02}{:02}{:02}-{pid}",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    )
}

/// `root/YYYYMMDD-HHMMSS-PID` for a job this process starts now.
pub fn default_run_dir(root: &Path) -> PathBuf {
    root.join(run_dir_name(
        time::OffsetDateTime::now_utc(),
        std::process::id(),
    ))
}

// `create_folders_synced`: the log folder (a run directory's `logs/` under `cargo xtask train`
// and `--nproc-per-node`) is made durable with the folders above it, as the ranks' checkpoints
// are.
include!("../../shared-src/folder_sync.rs");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_directories_are_named_by_utc_time_and_pid() {
        let at = |unix: i64| time::OffsetDateTime::from_unix_timestamp(unix).unwrap();
        assert_eq!(run_dir_name(at(0), 7), "19700101-000000-7");
        // The last second of a leap day.
        assert_eq!(run_dir_name(at(951_868_799), 42), "20000229-235959-42");
        assert_eq!(run_dir_name(at(1_796_083_200), 1), "20261201-000000-1");
        // Another offset names the same instant.
        let east = at(0).to_offset(time::UtcOffset::from_hms(2, 0, 0).unwrap());
        assert_eq!(run_dir_name(east, 7), "19700101-000000-7");
        let dir = default_run_dir(Path::new("/runs"));
        assert_eq!(dir.parent(), Some(Path::new("/runs")));
        assert!(dir
            .to_str()
            .unwrap()
            .ends_with(&format!("-{}", std::process::id())));
    }
}
