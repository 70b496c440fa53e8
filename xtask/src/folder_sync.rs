//! `sync_folder`: flushing a folder's entries to the disk, and `create_folders_synced`, as
//! ddp-model, ddp-data and ddp-run do.

include!("../../shared-src/folder_sync.rs");

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder that cannot be synced is no failure (its entries are in place); a failed
    /// write-back is.
    #[test]
    fn folders_that_cannot_be_synced_are_synced_enough() {
        use std::io::Error;
        for code in [libc::EINVAL, libc::ENOTSUP, libc::EOPNOTSUPP] {
            assert!(
                folder_synced(Err(Error::from_raw_os_error(code))).is_ok(),
                "{code}"
            );
        }
        for code in [libc::EIO, libc::ENOSPC] {
            let e = folder_synced(Err(Error::from_raw_os_error(code))).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(code));
        }
        assert!(folder_synced(Ok(())).is_ok());
        // A real folder syncs; a missing one is an error, not taken for a file system's answer.
        let dir = std::env::temp_dir();
        sync_folder(&dir).unwrap();
        let missing = dir.join(format!("folder-sync-missing-{}", std::process::id()));
        let e = sync_folder(&missing).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
    }
}
