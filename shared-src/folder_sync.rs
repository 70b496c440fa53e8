// The one copy of how a folder's entries are flushed to the disk and how folders are made
// durable, `include!`d by ddp-model (`checkpoint.rs`), ddp-data (`odir/synthetic.rs`),
// ddp-run (`run_dir.rs`) and xtask (`folder_sync.rs`, which tests it): they share no crate
// that could hold it without a heavy dependency (xtask builds before libtorch and without
// ddp-data; ddp-data without tch links no ddp-model).

/// Flushes folder `dir`'s entries (a file renamed or created in it) to the disk. A file
/// system whose folders cannot be synced (VirtualBox shared folders, older CIFS, some FUSE
/// file systems) is no error: the entries are in place, as durable as that file system makes
/// anything.
pub(crate) fn sync_folder(dir: &std::path::Path) -> std::io::Result<()> {
    folder_synced(std::fs::File::open(dir)?.sync_all())
}

/// The result of syncing a folder, with the answers of file systems whose folders cannot be
/// synced (`EINVAL`, `ENOTSUP`, `EOPNOTSUPP`) taken as success; a failed write-back (`EIO`,
/// `ENOSPC`, ...) stays an error.
fn folder_synced(result: std::io::Result<()>) -> std::io::Result<()> {
    match result {
        Err(e)
            if e.raw_os_error().is_some_and(|code| {
                [libc::EINVAL, libc::ENOTSUP, libc::EOPNOTSUPP].contains(&code)
            }) =>
        {
            Ok(())
        }
        other => other,
    }
}

/// Creates folder `dir` and the folders above it that are missing, as `create_dir_all` does,
/// and flushes each new folder's entry in its parent: a file written into it and synced then
/// survives a crash with the folders it lies in.
pub(crate) fn create_folders_synced(dir: &std::path::Path) -> std::io::Result<()> {
    if dir.as_os_str().is_empty() || dir.is_dir() {
        return Ok(());
    }
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let made = match std::fs::create_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            create_folders_synced(parent)?;
            std::fs::create_dir(dir)
        }
        made => made,
    };
    match made {
        // Made meanwhile by another process: its maker syncs it.
        Err(_) if dir.is_dir() => Ok(()),
        Err(e) => Err(e),
        Ok(()) => sync_folder(parent),
    }
}
