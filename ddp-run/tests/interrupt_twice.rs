//! A second signal while the ranks are given time to end kills them at once, as a second
//! Ctrl-C does to torchrun. Alone in its test binary, because the signals reach the whole
//! process.

use std::time::{Duration, Instant};

use ddp_run::{launch, LaunchConfig, Outcome};

/// Whether `signal` is ignored in this process (inherited: a shell starts background jobs
/// with SIGINT ignored, and the launcher leaves an ignored signal alone, as torchrun does).
fn ignored(signal: i32) -> bool {
    // SAFETY: a zeroed sigaction is a valid out-parameter, and a null `act` only queries.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, std::ptr::null(), &mut old) == 0
            && old.sa_sigaction == libc::SIG_IGN
    }
}

#[test]
fn a_second_signal_during_the_shutdown_kills_the_ranks_at_once() {
    // A Ctrl-C after the SIGTERM, or where this test runs with SIGINT ignored, another signal
    // (a repeat of SIGTERM at once would be taken for the same request delivered twice).
    let second_signal = [libc::SIGINT, libc::SIGHUP, libc::SIGQUIT, libc::SIGUSR1]
        .into_iter()
        .find(|&s| !ignored(s))
        .expect("a forwarded signal other than SIGTERM that this test does not ignore");
    let dir = ddp_testkit::temp_dir("ddp-run-interrupt-twice");
    let ready = dir.path().join("ready");
    // The ranks outlive SIGTERM (they only note it in a file): without escalation the
    // launcher would wait the whole minute of the shutdown timeout before SIGKILL.
    let config = LaunchConfig {
        echo: false,
        shutdown_timeout: Duration::from_secs(60),
        ..LaunchConfig::new("sh", 2).args([
            "-c".to_string(),
            format!(
                r#"trap 'touch {ready}.term.$RANK' TERM
                   trap '' INT HUP QUIT USR1
                   touch {ready}.$RANK
                   i=0
                   while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done"#,
                ready = ready.display()
            ),
        ])
    };
    let sender = std::thread::spawn(move || {
        ddp_testkit::wait_for("both ranks are up", Duration::from_secs(60), || {
            (0..2).all(|r| ready.with_extension(r.to_string()).exists())
        });
        // SAFETY: raise(3) delivers the signals to this process, whose handlers (installed
        // before the ranks started) only record them while a job runs.
        unsafe { libc::raise(libc::SIGTERM) };
        // The second signal must come while the launcher stops the ranks, not before it has
        // noticed the first: wait until both ranks got the forwarded SIGTERM.
        ddp_testkit::wait_for("both ranks got SIGTERM", Duration::from_secs(60), || {
            (0..2).all(|r| ready.with_extension(format!("term.{r}")).exists())
        });
        let second = Instant::now();
        // SAFETY: as above.
        unsafe { libc::raise(second_signal) };
        second
    });
    let outcome = launch(&config, |_| {}).unwrap();
    let ended = Instant::now();
    let second = sender.join().unwrap();
    assert_eq!(
        outcome,
        Outcome::Interrupted {
            signal: libc::SIGTERM,
            killed: vec![0, 1],
            leftovers: vec![],
            second_signal: true,
            failed: vec![],
            after_failure: None,
        }
    );
    // Killed right after the second signal, not at the end of the 60 s shutdown timeout.
    let after = ended.saturating_duration_since(second);
    assert!(
        after < Duration::from_secs(30),
        "the ranks lived {after:?} after the second signal"
    );
}
