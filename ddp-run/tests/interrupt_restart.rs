//! A signal that arrives between a failed attempt and the next ends the job before the next
//! generation of ranks starts, wherever it lands: before the new attempt is announced, or
//! after. Alone in its test binary, because the signal reaches the whole process.

use std::time::Duration;

use ddp_run::{launch, Event, LaunchConfig, Outcome};

/// Whether `event` is the one at which the test raises SIGTERM.
type At = fn(&Event<'_>) -> bool;

#[test]
fn a_signal_before_a_restart_starts_no_new_generation() {
    let at_restart: At = |e| matches!(e, Event::Restarting { .. });
    let at_start: At = |e| matches!(e, Event::Starting { attempt: 1, .. });
    for (when, at, starts) in [("restarting", at_restart, 1), ("starting", at_start, 2)] {
        let dir = ddp_testkit::temp_dir("ddp-run-interrupt-restart");
        // The rank fails; once the signal is raised, its program is gone, so that a rank
        // started after it would make `launch` fail instead (however soon it is stopped).
        let program = dir.path().join("rank.sh");
        ddp_testkit::script(&program, "#!/bin/sh\nexit 1\n");
        let config = LaunchConfig {
            echo: false,
            max_restarts: 1,
            shutdown_timeout: Duration::from_secs(10),
            ..LaunchConfig::new(&program, 1)
        };
        let mut seen = 0;
        let outcome = launch(&config, |e| {
            seen += usize::from(matches!(e, Event::Starting { .. }));
            if at(e) {
                std::fs::remove_file(&program).unwrap();
                // SAFETY: raise(3) delivers SIGTERM to this process, whose handler
                // (installed before the ranks started) only records it while a job runs.
                unsafe { libc::raise(libc::SIGTERM) };
            }
        });
        assert_eq!(
            outcome.unwrap(),
            Outcome::Interrupted {
                signal: libc::SIGTERM,
                killed: vec![],
                leftovers: vec![],
                second_signal: false,
                failed: vec![],
                after_failure: None,
            },
            "signal at {when}"
        );
        assert_eq!(seen, starts, "signal at {when}");
    }
}
