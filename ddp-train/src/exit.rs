//! A rank's program's exit status, for programs without the `cli` feature's flags, and the
//! record of its failure for the launcher.

use std::error::Error;
use std::process::ExitCode;
use std::sync::{Once, OnceLock};
use std::time::SystemTime;

use crate::TrainError;

/// Runs `body`, the whole of one rank's program (the README's example), and gives the
/// process's exit status as launchers and schedulers read it: success; 75
/// ([`crate::EXIT_STOPPED`]) after a stop on request (SIGTERM, SIGUSR1, the time limit) and
/// its checkpoint, which `ddp-run` and SLURM scripts requeue; otherwise `error: ` and the
/// error's causes on stderr (each said once, no backtrace) and 1; the error is recorded for
/// the launcher too ([`ddp_run::record_error`]), as arisen when a Trainer's `run` or
/// `evaluate` first returned an error, before the Trainer, and its links to the other ranks,
/// were dropped (else when `body` returned). A panic is recorded as it happens, before it
/// unwinds, and printed as ever. A `fn main() -> Result<..>`
/// would print the error's `Debug` form and exit 1 after a stop too. (`cli::run` does the
/// same for programs with [`TrainArgs`](crate::cli::TrainArgs), naming settings by their
/// flags.)
pub fn exit_with(body: impl FnOnce() -> Result<(), Box<dyn Error>>) -> ExitCode {
    record_panics();
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let (status, message) = failure(&*err);
            record_error(&crate::error::with_causes(&*err));
            eprintln!("{message}");
            ExitCode::from(status)
        }
    }
}

/// When this process first failed: a Trainer's `run` or `evaluate` returned an error (not a
/// stop on request), or a thread panicked. The launcher names the rank whose failure came
/// first, and a program reports its error after its Trainer is dropped, and with it the
/// links whose closing makes the other ranks fail.
static FAILED_AT: OnceLock<SystemTime> = OnceLock::new();

/// Notes when `result`, a Trainer's, failed, unless it is a stop on request or the process
/// failed before.
pub(crate) fn note_failure<T>(result: &Result<T, TrainError>) {
    if let Err(e) = result {
        if e.exit_code() != crate::EXIT_STOPPED {
            FAILED_AT.get_or_init(SystemTime::now);
        }
    }
}

/// Records `message`, the program's error, in the file that the launcher gave this rank
/// (`TORCHELASTIC_ERROR_FILE`), if any, as arisen when the process first failed, else now.
/// Where it cannot be written, the launcher counts the failure from the rank's exit.
pub(crate) fn record_error(message: &str) {
    let _ = ddp_run::record_error(message, *FAILED_AT.get_or_init(SystemTime::now));
}

/// Installs (once) a panic hook that records the panic ([`record_error`]) before it unwinds
/// and closes the rank's links (a tch call that panics on CUDA's out of memory), then
/// prints it as the hook before did.
pub(crate) fn record_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("Box<dyn Any>");
            match info.location() {
                Some(at) => record_error(&format!("panicked at {at}: {message}")),
                None => record_error(&format!("panicked: {message}")),
            }
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
