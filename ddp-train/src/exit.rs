//! A rank's program's exit status, for programs without the `cli` feature's flags, and the
//! record of its failure for the launcher.

use std::error::Error;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Mutex, MutexGuard, Once, PoisonError};
use std::time::SystemTime;

use crate::TrainError;

/// Runs `body`, the whole of one rank's program (the README's example), and gives the
/// process's exit status as launchers and schedulers read it: success; 75
/// ([`crate::EXIT_STOPPED`]) after a stop on request (SIGTERM, SIGUSR1, the time limit) and
/// its checkpoint, which `ddp-run` and SLURM scripts requeue; otherwise `error: ` and the
/// error's causes on stderr (each said once, no backtrace) and 1; the error is recorded for
/// the launcher too ([`ddp_run::record_error`]): a Trainer's error when its `run` or
/// `evaluate` returned it, before the Trainer, and its links to the other ranks, were
/// dropped (a later success, or a new Trainer, takes it back), and overwritten with the
/// error `body` returns, as arisen then if it is (or wraps) that Trainer's error, else now. A
/// panic that ends `body` is recorded as arisen when it happened, before it unwound, and
/// printed as ever (one caught inside `body` is not recorded). A `fn main() -> Result<..>`
/// would print the error's `Debug` form and exit 1 after a stop too. (`cli::run` does the
/// same for programs with [`TrainArgs`](crate::cli::TrainArgs), naming settings by their
/// flags.)
pub fn exit_with(body: impl FnOnce() -> Result<(), Box<dyn Error>>) -> ExitCode {
    match caught(body) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let (status, message) = failure(&*err);
            record_error(&*err, &crate::error::with_causes(&*err));
            eprintln!("{message}");
            ExitCode::from(status)
        }
    }
}

/// When a Trainer's `run` or `evaluate` returned an error (not a stop on request) that no
/// later success of theirs, nor a new Trainer, cleared; and the error file it was recorded
/// in. The launcher names the rank whose failure came first, and a program reports its error
/// after its Trainer is dropped, and with it the links whose closing makes the other ranks
/// fail.
static FAILED: Mutex<Option<(SystemTime, Option<PathBuf>)>> = Mutex::new(None);

/// The last panic's message and time, for [`caught`] to record where the panic ends the
/// program (one caught on the way is no failure of the program).
static PANICKED: Mutex<Option<(String, SystemTime)>> = Mutex::new(None);

/// `slot`'s value, even after a panic elsewhere while it was held.
fn lock<T>(slot: &Mutex<T>) -> MutexGuard<'_, T> {
    slot.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Notes the outcome of a Trainer's `run` or `evaluate`: an error (not a stop on request) is
/// recorded for the launcher now, as arisen now, unless one is already noted; a success
/// clears the noted failure and its record.
pub(crate) fn note_failure<T>(result: &Result<T, TrainError>) {
    match result {
        Err(e) if e.exit_code() == crate::EXIT_STOPPED => {}
        Err(e) => {
            let mut failed = lock(&FAILED);
            if failed.is_none() {
                let at = SystemTime::now();
                let file = ddp_run::record_error(&crate::error::with_causes(e), at);
                *failed = Some((at, file.ok().flatten()));
            }
        }
        Ok(_) => clear_failure(),
    }
}

/// Forgets the noted failure of a Trainer (another is built, or it succeeded after it), and
/// removes its record.
pub(crate) fn clear_failure() {
    if let Some((_, Some(file))) = lock(&FAILED).take() {
        let _ = std::fs::remove_file(file);
    }
}

/// Records `err`, the program's error, with `message`, in the file that the launcher gave
/// this rank (`TORCHELASTIC_ERROR_FILE`), if any: as arisen when a Trainer's failure was
/// noted, where `err` is (or wraps) a Trainer's error, else now. Where it cannot be written,
/// the launcher counts the failure from the rank's exit.
pub(crate) fn record_error(err: &(dyn Error + 'static), message: &str) {
    let trainers = std::iter::successors(Some(err), |&e| e.source()).any(|e| e.is::<TrainError>());
    let noted = lock(&FAILED).as_ref().map(|&(at, _)| at);
    let at = noted.filter(|_| trainers).unwrap_or_else(SystemTime::now);
    let _ = ddp_run::record_error(message, at);
}

/// Runs `body`, the program, and records a panic that ends it (one that unwinds out of
/// `body`) as the panic hook of [`record_panics`] saw it, as arisen before its unwinding
/// closed the rank's links, then goes on unwinding: the program still exits as a panic does.
pub(crate) fn caught<R>(body: impl FnOnce() -> R) -> R {
    record_panics();
    match std::panic::catch_unwind(AssertUnwindSafe(body)) {
        Ok(result) => result,
        Err(payload) => {
            if let Some((message, at)) = lock(&PANICKED).take() {
                let _ = ddp_run::record_error(&message, at);
            }
            std::panic::resume_unwind(payload)
        }
    }
}

/// Installs (once) a panic hook that notes the panic (a tch call that panics on CUDA's out of
/// memory) for [`caught`], before it unwinds and closes the rank's links, then prints it as
/// the hook before did.
fn record_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let at = SystemTime::now();
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("Box<dyn Any>");
            let message = match info.location() {
                Some(place) => format!("panicked at {place}: {message}"),
                None => format!("panicked: {message}"),
            };
            *lock(&PANICKED) = Some((message, at));
            previous(info);
        }));
    });
}

/// The exit status of a failed program and the line it prints: 75 and the stop's own
/// message when the Trainer stopped on request (wrapped or not), else 1 and `error: ` with
/// the causes.
fn failure(err: &(dyn Error + 'static)) -> (u8, String) {
    let causes = crate::error::with_causes(err);
    match exit_status(err) {
        1 => (1, format!("error: {causes}")),
        code => (code, causes),
    }
}

/// The exit status of a failed program: 75 ([`crate::EXIT_STOPPED`]) when the Trainer
/// stopped on request, wherever in the error's causes that stop is, else 1.
pub(crate) fn exit_status(err: &(dyn Error + 'static)) -> u8 {
    std::iter::successors(Some(err), |&e| e.source())
        .filter_map(|e| e.downcast_ref::<TrainError>())
        .map(TrainError::exit_code)
        .find(|&code| code == crate::EXIT_STOPPED)
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stop::StopReason;

    /// An error that wraps another, as a program's own error types do.
    #[derive(Debug)]
    struct Wrapped(TrainError);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("training the points")
        }
    }

    impl Error for Wrapped {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    fn stopped() -> TrainError {
        TrainError::EvaluationStopped {
            reason: StopReason::TimeLimit,
        }
    }

    /// A stop on request exits 75 (a requeue) with its own message, wrapped or not; any
    /// other failure 1 with `error: ` and each cause once.
    #[test]
    fn a_stop_exits_75_and_a_failure_1_with_its_causes() {
        let said = stopped().to_string();
        assert_eq!(failure(&stopped()), (75, said.clone()));
        let wrapped = Wrapped(stopped());
        assert_eq!(
            failure(&wrapped),
            (75, format!("training the points: {said}"))
        );
        let bad = Wrapped(TrainError::Invalid("bad input".into()));
        assert_eq!(
            failure(&bad),
            (1, "error: training the points: bad input".to_string())
        );
        let io = std::io::Error::other("disk full");
        assert_eq!(failure(&io), (1, "error: disk full".to_string()));
        let code = |r: Result<(), Box<dyn Error>>| format!("{:?}", exit_with(|| r));
        assert_eq!(
            code(Err(stopped().into())),
            format!("{:?}", ExitCode::from(75))
        );
        assert_eq!(code(Ok(())), format!("{:?}", ExitCode::SUCCESS));
    }
}
