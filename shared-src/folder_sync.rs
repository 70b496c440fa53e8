// The one copy of how a folder's entries are flushed to the disk, `include!`d by ddp-model
// (`checkpoint.rs`), ddp-data (`odir/synthetic.rs`) and xtask (`folder_sync.rs`, which tests
// it): they share no crate that could hold it without a heavy dependency (xtask builds before
// libtorch and without ddp-data; ddp-data without tch links no ddp-model).

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
