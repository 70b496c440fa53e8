// The one copy of how a call that a file system may never answer (`flock` on a `hard` NFS
// mount whose lock manager is down blocks in the kernel, `LOCK_NB` or not: cargo#2615) is
// given a deadline, `include!`d by ddp-train (`trainer/run_dir.rs`) and xtask (`setup.rs`),
// which share no crate that could hold it (xtask builds before libtorch).

/// `call` on a second descriptor of `file`, on a thread of its own, waited for at most
/// `deadline`: `None` when no answer came. That thread is then left behind, blocked, holding
/// only that descriptor (closed, with any lock it got, when the call returns or the process
/// ends). Where no thread or descriptor can be had, `call(file)` is asked here, without a
/// deadline.
pub(crate) fn answer_within<T, F>(
    file: &std::fs::File,
    deadline: std::time::Duration,
    call: F,
) -> Option<T>
where
    T: Send + 'static,
    F: Fn(&std::fs::File) -> T + Copy + Send + 'static,
{
    let asked = file.try_clone().and_then(|clone| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("answer-within".into())
            .spawn(move || {
                // The receiver is gone when the answer came too late: nothing to do with it.
                let _ = tx.send(call(&clone));
            })?;
        Ok(rx.recv_timeout(deadline).ok())
    });
    asked.unwrap_or_else(|_| Some(call(file)))
}
