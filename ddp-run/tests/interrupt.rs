//! A signal to a process that runs a job through the library: the ranks get it and the job
//! ends as interrupted (a rank that never gets it fails the job after a minute instead).
//! Alone in its test binary, because the signal reaches the whole process and every job
//! running in it.

use std::time::Duration;

use ddp_run::{launch, Event, LaunchConfig, Outcome};

#[test]
fn a_signal_to_the_launching_process_interrupts_the_job() {
    let dir = ddp_testkit::temp_dir("ddp-run-interrupt");
    let logs = dir.path().join("logs");
    let ready = dir.path().join("ready");
    let config = LaunchConfig {
        echo: false,
        log_dir: Some(logs.clone()),
        shutdown_timeout: Duration::from_secs(10),
        ..LaunchConfig::new("sh", 2).args([
            "-c".to_string(),
            format!(
                r#"trap 'echo rank $RANK got SIGTERM; exit 0' TERM
                   touch {}.$RANK
                   i=0
                   while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done
                   exit 1"#,
                ready.display()
            ),
        ])
    };
    let sender = {
        let ready = ready.clone();
        std::thread::spawn(move || {
            ddp_testkit::wait_for("both ranks are up", Duration::from_secs(60), || {
                (0..2).all(|r| ready.with_extension(r.to_string()).exists())
            });
            // SAFETY: raise(3) delivers SIGTERM to this process, whose handler (installed
            // before the ranks started) only records it while a job runs.
            unsafe { libc::raise(libc::SIGTERM) };
        })
    };
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
            leftovers: vec![],
            second_signal: false,
            failed: vec![],
            after_failure: None,
        }
    );
    assert_eq!(outcome.exit_code(), 143);
    assert_eq!(starts, 1);
    for r in 0..2 {
        let log = std::fs::read_to_string(logs.join(format!("rank-{r}.out"))).unwrap();
        // (sh may also report its `sleep`, which got the signal too, as "Terminated".)
        assert!(
            log.lines().any(|l| l == format!("rank {r} got SIGTERM")),
            "{log}"
        );
    }
}
