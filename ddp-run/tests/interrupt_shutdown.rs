//! A signal that arrives while a failed attempt is being shut down ends the job: no new
//! generation of ranks starts. Alone in its test binary, because the signal reaches the whole
//! process.

use std::time::Duration;

use ddp_run::{launch, Event, Exit, LaunchConfig, Outcome, RankFailure};

#[test]
fn a_signal_during_a_failures_shutdown_prevents_the_restart() {
    let dir = ddp_testkit::temp_dir("ddp-run-interrupt-shutdown");
    let ready = dir.path().join("ready");
    let termed = dir.path().join("termed");
    // Rank 1 handles SIGTERM (it notes it, and goes on), so the shutdown of the failed attempt
    // lasts the whole shutdown timeout (then SIGKILL); rank 0 fails once rank 1 handles it.
    // The signal is raised once rank 1 got the shutdown's SIGTERM, far inside the timeout:
    // however late each step runs, it arrives during the shutdown.
    let shutdown_timeout = Duration::from_secs(60);
    let config = LaunchConfig {
        echo: false,
        max_restarts: 2,
        shutdown_timeout,
        ..LaunchConfig::new("sh", 2).args([
            "-c".to_string(),
            format!(
                r#"if [ "$RANK" = 0 ]; then
                     while [ ! -e {ready} ]; do sleep 0.05; done
                     exit 1
                   fi
                   trap 'touch {termed}' TERM
                   touch {ready}
                   while :; do sleep 0.05; done"#,
                ready = ready.display(),
                termed = termed.display()
            ),
        ])
    };
    let sender = std::thread::spawn(move || {
        ddp_testkit::wait_for("rank 1's SIGTERM", shutdown_timeout, || termed.exists());
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
    // Rank 1, which had not ended when the signal came, was killed at once, and the outcome
    // says for which failure the ranks were being stopped.
    assert_eq!(
        outcome,
        Outcome::Interrupted {
            signal: libc::SIGTERM,
            killed: vec![1],
            leftovers: vec![],
            second_signal: true,
            failed: vec![],
            after_failure: Some(RankFailure {
                rank: 0,
                exit: Exit::Code(1),
                tail: vec![],
                log: None,
                error: None,
                stopped_by_launcher: false,
            }),
        }
    );
    assert_eq!(starts, 1, "a new generation started after the signal");
    assert_eq!(
        ddp_run::cli::interruption_lines("ddp-run", &outcome, shutdown_timeout, "--grace"),
        ["ddp-run: interrupted by signal 15 after rank 0 failed; rank 1 was killed at the signal"]
    );
}
