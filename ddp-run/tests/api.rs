//! The library: the events a caller hears, and the launcher's own errors as typed values.

use std::time::Duration;

use ddp_run::{launch, Event, Exit, LaunchConfig, LaunchError, Outcome, RankFailure};

/// What a caller can keep of an event.
#[derive(Debug, PartialEq)]
enum Seen {
    Starting { attempt: u32, world_size: usize },
    Failed(RankFailure),
    Restarting { restart: u32, max_restarts: u32 },
}

fn record(seen: &mut Vec<Seen>) -> impl FnMut(&Event<'_>) + '_ {
    |event| {
        seen.push(match event {
            Event::Starting {
                attempt,
                world_size,
                ..
            } => Seen::Starting {
                attempt: *attempt,
                world_size: *world_size,
            },
            Event::RankFailed(failure) => Seen::Failed((*failure).clone()),
            Event::Restarting {
                restart,
                max_restarts,
            } => Seen::Restarting {
                restart: *restart,
                max_restarts: *max_restarts,
            },
        })
    }
}

fn quiet(program: &str, nproc: usize, args: &[&str]) -> LaunchConfig {
    LaunchConfig {
        echo: false,
        shutdown_timeout: Duration::from_secs(5),
        ..LaunchConfig::new(program, nproc).args(args)
    }
}

#[test]
fn a_failure_then_a_restart_are_reported_in_order() {
    // Rank 1 (named in an extra variable) fails on the first attempt only.
    let config = LaunchConfig {
        max_restarts: 1,
        env: vec![("DDP_RUN_TEST_FAIL_RANK".into(), "1".into())],
        ..quiet(
            "sh",
            2,
            &[
                "-c",
                r#"echo "attempt $TORCHELASTIC_RESTART_COUNT"
                   if [ "$RANK" = "$DDP_RUN_TEST_FAIL_RANK" ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]
                   then exit 9; fi"#,
            ],
        )
    };
    let mut seen = Vec::new();
    let outcome = launch(&config, record(&mut seen)).unwrap();
    assert_eq!(outcome, Outcome::Succeeded { restarts: 1 });
    assert_eq!(
        seen,
        [
            Seen::Starting {
                attempt: 0,
                world_size: 2
            },
            Seen::Failed(RankFailure {
                rank: 1,
                exit: Exit::Code(9),
                tail: vec!["attempt 0".to_string()],
                log: None,
            }),
            Seen::Restarting {
                restart: 1,
                max_restarts: 1
            },
            Seen::Starting {
                attempt: 1,
                world_size: 2
            },
        ]
    );
}

#[test]
fn the_last_failure_is_the_outcome_when_no_restart_is_left() {
    let dir = ddp_testkit::temp_dir("ddp-run-api-fail");
    let config = LaunchConfig {
        log_dir: Some(dir.path().join("logs")),
        tail_lines: 2,
        ..quiet(
            "sh",
            1,
            &["-c", "echo one; echo two; echo three; kill -TERM $$"],
        )
    };
    let outcome = launch(&config, |_| {}).unwrap();
    assert_eq!(
        outcome,
        Outcome::Failed {
            failure: RankFailure {
                rank: 0,
                exit: Exit::Signal(libc::SIGTERM),
                tail: vec!["two".to_string(), "three".to_string()],
                log: Some(dir.path().join("logs/rank-0.out")),
            },
            restarts: 0,
        }
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("logs/rank-0.out")).unwrap(),
        "one\ntwo\nthree\n"
    );
}

#[test]
fn a_program_that_cannot_start_is_a_spawn_error() {
    let config = quiet("/nonexistent/ddp-run-api-program", 2, &[]);
    match launch(&config, |_| {}) {
        Err(LaunchError::Spawn {
            rank: 0,
            program,
            source,
        }) => {
            assert_eq!(program, "`/nonexistent/ddp-run-api-program`");
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected a spawn error, got {other:?}"),
    }
}

#[test]
fn bad_settings_fail_before_anything_starts() {
    let config = LaunchConfig {
        nnodes: 2,
        node_rank: 5,
        ..quiet("true", 1, &[])
    };
    let mut events = 0;
    match launch(&config, |_| events += 1) {
        Err(LaunchError::NodeRankOutOfRange {
            node_rank: 5,
            nnodes: 2,
        }) => {}
        other => panic!("expected NodeRankOutOfRange, got {other:?}"),
    }
    assert_eq!(events, 0);
}

#[test]
fn ranks_that_stop_with_exit_code_75_end_the_job_as_stopped_without_a_restart() {
    let dir = ddp_testkit::temp_dir("ddp-run-api-stopped");
    // Rank 0 stops at once; rank 1 takes longer (it is still writing its checkpoint) and
    // must not be stopped meanwhile: 75 is not a failure.
    let config = LaunchConfig {
        max_restarts: 2,
        log_dir: Some(dir.path().join("logs")),
        ..quiet(
            "sh",
            2,
            &[
                "-c",
                r#"if [ "$RANK" = 1 ]; then sleep 1; echo "rank 1 saved"; fi; exit 75"#,
            ],
        )
    };
    let mut seen = Vec::new();
    let outcome = launch(&config, record(&mut seen)).unwrap();
    assert_eq!(
        outcome,
        Outcome::Stopped {
            signal: None,
            restarts: 0
        }
    );
    assert_eq!(outcome.exit_code(), i32::from(ddp_run::EXIT_STOPPED));
    assert_eq!(
        seen,
        [Seen::Starting {
            attempt: 0,
            world_size: 2
        }]
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("logs/rank-1.out")).unwrap(),
        "rank 1 saved\n"
    );
}
