// The one copy of how a call that a file system may never answer (`flock` on a `hard` NFS
// mount whose lock manager is down blocks in the kernel, `LOCK_NB` or not: cargo#2615) is
// given a deadline, `include!`d by ddp-train (`trainer/run_dir.rs`) and xtask (`setup.rs`),
// which share no crate that could hold it (xtask builds before libtorch).

/// Runs `call` on a thread of its own and waits at most `deadline` for its answer: `Ok(None)`
/// when none came. That thread is then left behind, blocked, with whatever `call` owns (give
/// it only what may stay held until the call returns or the process ends). An error when no
/// thread can be started: `call` was not run.
pub(crate) fn answer_within<T: Send + 'static>(
    deadline: std::time::Duration,
    call: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<Option<T>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("answer-within".into())
        .spawn(move || {
            // The receiver is gone when the answer came too late: nothing to do with it.
            let _ = tx.send(call());
        })?;
    Ok(rx.recv_timeout(deadline).ok())
}
