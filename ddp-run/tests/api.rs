//! The library: the events a caller hears, and the launcher's own errors as typed values.

use std::time::Duration;

use ddp_run::{launch, Event, Exit, LaunchConfig, LaunchError, Outcome, RankFailure};

/// What a caller can keep of an event.
#[derive(Debug, PartialEq)]
enum Seen {
    Starting { attempt: u32, world_size: usize },
    Failed(RankFailure),
    Restarting { restart: u32, max_restarts: u32 },
    Warning(String),
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
            Event::Warning(warning) => Seen::Warning(warning.to_string()),
            other => panic!("an event this test does not know: {other:?}"),
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
                error: None,
                stopped_by_launcher: false,
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
                error: None,
                stopped_by_launcher: false,
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
            hint: None,
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

#[test]
fn a_symlink_in_place_of_a_rank_log_is_refused_and_its_target_untouched() {
    let dir = ddp_testkit::temp_dir("ddp-run-log-symlink");
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "keep me\n").unwrap();
    std::os::unix::fs::symlink(&victim, logs.join("rank-0.out")).unwrap();
    let config = LaunchConfig {
        log_dir: Some(logs.clone()),
        ..quiet("sh", 1, &["-c", "echo written"])
    };
    match launch(&config, |_| {}) {
        Err(err @ LaunchError::Log { .. }) => {
            let LaunchError::Log { path, source, .. } = &err else {
                unreachable!()
            };
            assert_eq!(path, &logs.join("rank-0.out"));
            assert_eq!(source.raw_os_error(), Some(libc::ELOOP), "{source}");
            assert!(err.to_string().ends_with(": it is a symbolic link, which a rank's log may not be (so that a shared folder cannot send it elsewhere); remove it, or give another --log-dir"), "{err}");
        }
        other => panic!("expected a log error, got {other:?}"),
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me\n");
}

/// A rank's log holds its bytes as printed: bytes that are not UTF-8, a line of 300 KiB whole
/// (the terminal and the tail get it in 64 KiB pieces), a last line without a newline.
#[test]
fn a_ranks_log_holds_exactly_the_bytes_it_printed() {
    let dir = ddp_testkit::temp_dir("ddp-run-log-bytes");
    let logs = dir.path().join("logs");
    let config = LaunchConfig {
        log_dir: Some(logs.clone()),
        tail_lines: 8,
        ..quiet(
            "sh",
            1,
            &[
                "-c",
                "printf '\\377\\376\\n'; head -c 307200 /dev/zero | tr '\\0' x; echo; \
                 printf last; exit 3",
            ],
        )
    };
    let Outcome::Failed { failure, .. } = launch(&config, |_| {}).unwrap() else {
        panic!("the rank's exit 3 is a failure");
    };
    let mut printed = b"\xff\xfe\n".to_vec();
    printed.extend(std::iter::repeat_n(b'x', 307200));
    printed.extend(b"\nlast");
    let log = std::fs::read(logs.join("rank-0.out")).unwrap();
    let first_difference = log.iter().zip(&printed).position(|(a, b)| a != b);
    assert!(
        log == printed,
        "{} bytes logged, {} printed, first difference at {first_difference:?}",
        log.len(),
        printed.len()
    );
    let lengths: Vec<usize> = failure.tail.iter().map(String::len).collect();
    assert_eq!(lengths, [6, 65536, 65536, 65536, 65536, 45056, 4]);
    assert_eq!(failure.tail[0], "\u{fffd}\u{fffd}");
}

#[test]
fn a_log_dir_that_is_a_file_is_refused_naming_it() {
    let dir = ddp_testkit::temp_dir("ddp-run-log-file");
    let file = dir.path().join("logs");
    std::fs::write(&file, "not a folder\n").unwrap();
    let config = LaunchConfig {
        log_dir: Some(file.clone()),
        ..quiet("true", 1, &[])
    };
    match launch(&config, |_| {}) {
        Err(err @ LaunchError::LogDirIsFile { .. }) => assert_eq!(
            err.to_string(),
            format!(
                "the folder of the rank logs {} is a file: remove it, or give another --log-dir",
                file.display()
            )
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    // A launcher that names the folder otherwise says so in its own words.
    #[cfg(feature = "cli")]
    {
        let wording = ddp_run::cli::Wording {
            log_dir: "--out (its logs/ folder)".into(),
            ..Default::default()
        };
        let err = ddp_run::cli::launch_and_report_with(&config, "x", &wording).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "the folder of the rank logs {} is a file: remove it, or give another --out \
                 (its logs/ folder)",
                file.display()
            )
        );
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "not a folder\n");
}

/// A shell function that records `$1` in the rank's error file as `ddp_run::record_error`
/// writes it (torchrun's shape, with nanoseconds).
const RECORD: &str = r#"record() {
      printf '{"message": {"message": "%s", "extraInfo": {"timestamp": "%s", "timestamp_ns": "%s"}}}' \
        "$1" "$(date +%s)" "$(date +%s%N)" > "$TORCHELASTIC_ERROR_FILE"
    }"#;

/// The rank whose error came first is the outcome, though another exits before it: rank 0
/// records its error and takes its time to end (the launcher's SIGTERM ends it before it
/// prints), while rank 1, failing for want of it, records its own and exits at once. The
/// SIGTERM that ended rank 0 is told as the launcher's; the error files are removed
/// afterwards.
#[test]
fn the_earliest_recorded_error_names_the_rank() {
    let dir = ddp_testkit::temp_dir("ddp-run-api-first");
    let (recorded, files) = (dir.path().join("recorded"), dir.path().join("files"));
    let script = format!(
        r#"{RECORD}
           echo "$TORCHELASTIC_ERROR_FILE" >> {files}
           if [ "$RANK" = 0 ]; then
             record "disk full"
             touch {recorded}
             sleep 30
             exit 2
           fi
           while [ ! -e {recorded} ]; do sleep 0.02; done
           record "peer rank 0 closed the connection"
           echo "error: peer rank 0 closed the connection"
           exit 1"#,
        files = files.display(),
        recorded = recorded.display(),
    );
    let config = quiet("sh", 2, &["-c", &script]);
    let outcome = launch(&config, |_| {}).unwrap();
    assert_eq!(
        outcome,
        Outcome::Failed {
            failure: RankFailure {
                rank: 0,
                exit: Exit::Signal(libc::SIGTERM),
                tail: vec![],
                log: None,
                error: Some("disk full".to_string()),
                stopped_by_launcher: true,
            },
            restarts: 0,
        }
    );
    let files = std::fs::read_to_string(files).unwrap();
    let files: Vec<&std::path::Path> = files.lines().map(std::path::Path::new).collect();
    let mut names: Vec<_> = files.iter().map(|f| f.file_name().unwrap()).collect();
    names.sort();
    assert_eq!(
        names,
        ["rank-0.error.json", "rank-1.error.json"],
        "{files:?}"
    );
    for file in files {
        let folder = file.parent().unwrap();
        assert!(!folder.exists(), "{} is left behind", folder.display());
    }
}

/// The failure named when rank 0 runs `rank0` and rank 1 `rank1` (`sh` scripts with
/// [`RECORD`]'s `record`, and `$MARK`, a file of the test's own), with the attempt's
/// monitor interval and shutdown timeout.
fn failure_of(rank0: &str, rank1: &str) -> RankFailure {
    let dir = ddp_testkit::temp_dir("ddp-run-api-crash");
    let script = format!(
        r#"{RECORD}
           MARK={mark}
           if [ "$RANK" = 0 ]; then {rank0}; fi
           {rank1}"#,
        mark = dir.path().join("mark").display(),
    );
    let config = quiet("sh", 2, &["-c", &script]);
    match launch(&config, |_| {}).unwrap() {
        Outcome::Failed { failure, .. } => failure,
        other => panic!("the job did not fail: {other:?}"),
    }
}

/// A rank that fails without recording its error (a panic without a hook, exit 101) closes
/// its links as it exits: rank 1 records the closed connection before rank 0 is seen to
/// exit, yet rank 0, the first to exit, is named (the launcher's SIGTERM ends rank 1).
#[test]
fn the_first_rank_to_exit_without_a_record_is_named() {
    let failure = failure_of(
        r#"while [ ! -e $MARK ]; do sleep 0.01; done
           echo "thread 'main' panicked at src/main.rs:9:5: CUDA out of memory"
           exit 101"#,
        r#"record "peer rank 0 closed the connection"
           touch $MARK
           exec sleep 30"#,
    );
    assert_eq!(
        failure,
        RankFailure {
            rank: 0,
            exit: Exit::Code(101),
            tail: vec!["thread 'main' panicked at src/main.rs:9:5: CUDA out of memory".into()],
            log: None,
            error: None,
            stopped_by_launcher: false,
        }
    );
}

/// A rank killed by a signal the launcher did not send (the OOM killer's SIGKILL) recorded
/// nothing and its teardown may take longer than its peer's: rank 1 records the closed
/// connection and exits first, rank 0 (which ignores the launcher's SIGTERM, as a rank
/// busy freeing its memory would not act on it) is killed after it; rank 0 is named.
#[test]
fn a_rank_killed_by_a_signal_not_the_launchers_is_named() {
    let failure = failure_of(
        r#"trap '' TERM
           echo "allocating"
           while [ ! -e $MARK ]; do sleep 0.01; done
           sleep 0.2
           kill -KILL $$"#,
        r#"record "peer rank 0 closed the connection"
           touch $MARK
           exit 1"#,
    );
    assert_eq!(
        failure,
        RankFailure {
            rank: 0,
            exit: Exit::Signal(libc::SIGKILL),
            tail: vec!["allocating".into()],
            log: None,
            error: None,
            stopped_by_launcher: false,
        }
    );
}
