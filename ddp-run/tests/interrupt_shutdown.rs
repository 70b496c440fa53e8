//! A signal that arrives while a failed attempt is being shut down ends the job: no new
//! generation of ranks starts. Alone in its test binary, because the signal reaches the whole
//! process.

use std::time::Duration;

use ddp_run::{launch, Event, LaunchConfig, Outcome};

#[test]
fn a_signal_during_a_failures_shutdown_prevents_the_restart() {
    let dir = ddp_testkit::temp_dir("ddp-run-interrupt-shutdown");
    let failing = dir.path().join("failing");
    // Rank 0 fails at once; rank 1 ignores SIGTERM, so the shutdown of the failed attempt
    // lasts the whole shutdown timeout (then SIGKILL).
    let config = LaunchConfig {
        echo: false,
        max_restarts: 2,
        shutdown_timeout: Duration::from_secs(4),
        ..LaunchConfig::new("sh", 2).args([
            "-c".to_string(),
            format!(
                r#"if [ "$RANK" = 0 ]; then sleep 0.5; touch {}; exit 1; fi
                   trap '' TERM
                   i=0
                   while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done"#,
                failing.display()
            ),
        ])
    };
    let sender = std::thread::spawn(move || {
        ddp_testkit::wait_for("rank 0 fails", Duration::from_secs(60), || failing.exists());
        // Well inside the 4 s shutdown of the failed attempt.
        std::thread::sleep(Duration::from_millis(1500));
        // SAFETY: raise(3) delivers SIGTERM to this process, whose handler (installed before
        // the ranks started) only records it while a job runs.
        unsafe { libc::raise(libc::SIGTERM) };
    });
    let mut starts = 0;
    let outcome = launch(&config, |e| {
        if matches!(e, Event::Starting { .. }) {
            starts += 1;
        }
    })
    .unwrap();
    sender.join().unwrap();
    assert_eq!(
        outcome,
        Outcome::Interrupted {
            signal: libc::SIGTERM,
            killed: vec![],
            second_signal: false,
            failed: vec![],
        }
    );
    assert_eq!(starts, 1, "a new generation started after the signal");
}
