//! What the `ddp-run` binary tells its user about a job, in one place for every program that
//! starts ranks the way `ddp-run` does (a training program given `--nproc-per-node` starts
//! its own through `ddp_train::cli::run`): the launcher's events and the job's end on
//! stderr, and the exit status.

use std::process::ExitCode;

use crate::{launch, Event, LaunchConfig, LaunchError, Outcome};

/// Runs the job as the `ddp-run` binary does and tells the user on stderr, in lines that
/// begin with `name: `, what happens: the `OMP_NUM_THREADS` the ranks get when the launcher
/// chose it, each attempt's start, a failed rank and the last lines it printed (indented),
/// each restart, and how the job ended. The ranks' own output is echoed as
/// [`LaunchConfig::echo`] says. [`launch`] itself prints nothing of its own; this function is
/// for binaries.
///
/// Returns the launcher's exit status: 0 when every rank succeeded, 1 when a rank failed
/// (after the restarts), 75 ([`crate::EXIT_STOPPED`]) when every rank stopped at a
/// checkpoint on request, 128+N after signal N. An `Err` is the launcher's own failure (bad
/// settings, a program that cannot be started), for the caller to print.
pub fn launch_and_report(config: &LaunchConfig, name: &str) -> Result<ExitCode, LaunchError> {
    config.validate()?;
    let omp_chosen = config.omp_num_threads.is_none()
        && std::env::var_os(crate::env::OMP_NUM_THREADS).is_none()
        && config.nproc_per_node > 1;
    if omp_chosen {
        say(&format!(
            "{name}: OMP_NUM_THREADS=1 for each rank, so that {} ranks do not overload the \
             cores; set OMP_NUM_THREADS to choose another number",
            config.nproc_per_node
        ));
    }
    if let Some(warning) = config.secret_warning() {
        say(&format!("{name}: {warning}"));
    }
    let outcome = launch(config, |event| {
        for line in event_lines(name, event) {
            say(&line);
        }
    })?;
    if let Some(line) = outcome_line(&outcome, config.nproc_per_node) {
        say(&format!("{name}: {line}"));
    }
    Ok(ExitCode::from(exit_status(&outcome)))
}

/// The lines that tell of `event`, each prefixed with `name: `, but for a failed rank's
/// last lines, which are indented instead so that they read as the rank's own.
fn event_lines(name: &str, event: &Event<'_>) -> Vec<String> {
    match event {
        Event::Starting {
            attempt,
            ranks,
            world_size,
            master_addr,
            master_port,
            omp_num_threads,
        } => {
            let threads = omp_num_threads
                .map(|n| format!(", OMP_NUM_THREADS={n}"))
                .unwrap_or_default();
            let again = if *attempt > 0 { "re" } else { "" };
            let which = match ranks.len() {
                1 => format!("rank {}", ranks.start),
                _ => format!("ranks {}-{}", ranks.start, ranks.end - 1),
            };
            vec![format!(
                "{name}: {again}starting {which} of {world_size}, rendezvous at \
                 {master_addr}:{master_port}{threads}"
            )]
        }
        Event::RankFailed(failure) => {
            let mut lines = vec![format!("{name}: {failure}")];
            if failure.tail.is_empty() {
                lines.push(format!("{name}: rank {} printed nothing", failure.rank));
                return lines;
            }
            lines.push(match &failure.log {
                Some(log) => format!("{name}: last lines of {}:", log.display()),
                None => format!("{name}: last lines of rank {}:", failure.rank),
            });
            lines.extend(failure.tail.iter().map(|line| format!("    {line}")));
            lines
        }
        Event::Restarting {
            restart,
            max_restarts,
        } => vec![format!(
            "{name}: restart {restart}/{max_restarts} of the whole group"
        )],
    }
}

/// The line that tells how the job of `nproc` ranks ended, if any (a failure without
/// restarts was told by its event already).
fn outcome_line(outcome: &Outcome, nproc: usize) -> Option<String> {
    match outcome {
        Outcome::Succeeded { restarts } => {
            let after = match restarts {
                0 => String::new(),
                n => format!(" after {n} restart(s)"),
            };
            Some(format!("all {nproc} rank(s) finished{after}"))
        }
        Outcome::Failed { restarts, .. } if *restarts > 0 => {
            Some(format!("giving up after {restarts} restart(s)"))
        }
        Outcome::Failed { .. } => None,
        Outcome::Interrupted { signal } => {
            Some(format!("interrupted by signal {signal}; all ranks stopped"))
        }
        Outcome::Stopped { signal, .. } => {
            // Some ranks may have finished while others stopped.
            let who = signal.map_or("the job stopped".to_string(), |s| {
                format!("the job stopped after signal {s}")
            });
            Some(format!(
                "{who} at a checkpoint (exit code {}); starting the job again continues it",
                crate::EXIT_STOPPED
            ))
        }
    }
}

/// [`Outcome::exit_code`] as a process's exit status (1 for anything out of range).
fn exit_status(outcome: &Outcome) -> u8 {
    u8::try_from(outcome.exit_code()).unwrap_or(1)
}

/// Writes `line` to stderr; a closed stderr (`ddp-run ... 2>&1 | head`) is no reason to
/// stop supervising the ranks, as `eprintln!`'s panic would.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// `error` and its causes, `outer: cause: cause`, as anyhow's `{:#}` writes them, but
/// without a cause the text before it already holds: a typed error that writes its source
/// into its own message (`checkpoint 'x': No such file or directory`) also hands it out as
/// its cause, and it would otherwise be said twice.
pub fn error_message(error: &anyhow::Error) -> String {
    join_causes(error.chain().map(ToString::to_string))
}

/// Joins messages, outermost first, with `: `, leaving out each one that is empty or that
/// the text before it already contains.
pub fn join_causes(messages: impl IntoIterator<Item = String>) -> String {
    let mut text = String::new();
    for message in messages {
        if message.is_empty() || text.contains(&message) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&message);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Exit, RankFailure};

    #[test]
    fn a_cause_the_message_already_says_is_said_once() {
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        let io = missing.to_string();
        // As thiserror writes `#[error("checkpoint '{path}': {source}")]`: the source in the
        // message, and handed out as the cause too.
        #[derive(Debug)]
        struct Checkpoint(std::io::Error);
        impl std::fmt::Display for Checkpoint {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "checkpoint 'a.safetensors': {}", self.0)
            }
        }
        impl std::error::Error for Checkpoint {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let err = anyhow::Error::new(Checkpoint(missing)).context("resuming run/a");
        assert_eq!(
            format!("{err:#}"),
            format!("resuming run/a: checkpoint 'a.safetensors': {io}: {io}")
        );
        assert_eq!(
            error_message(&err),
            format!("resuming run/a: checkpoint 'a.safetensors': {io}")
        );
        // Causes the message does not hold are all kept, and empty ones dropped.
        let parts = ["outer", "", "middle", "inner"].map(String::from);
        assert_eq!(join_causes(parts), "outer: middle: inner");
    }

    #[test]
    fn events_read_as_the_launcher_tells_them() {
        let starting = Event::Starting {
            attempt: 1,
            ranks: 2..4,
            world_size: 4,
            master_addr: "node0",
            master_port: 29500,
            omp_num_threads: Some("1"),
        };
        assert_eq!(
            event_lines("my-trainer", &starting),
            ["my-trainer: restarting ranks 2-3 of 4, rendezvous at node0:29500, OMP_NUM_THREADS=1"]
        );
        let failure = RankFailure {
            rank: 1,
            exit: Exit::Code(17),
            tail: vec!["loss nan".into(), "giving up".into()],
            log: Some("logs/rank-1.out".into()),
        };
        assert_eq!(
            event_lines("ddp-run", &Event::RankFailed(&failure)),
            [
                "ddp-run: rank 1 exited with code 17",
                "ddp-run: last lines of logs/rank-1.out:",
                "    loss nan",
                "    giving up"
            ]
        );
        let silent = RankFailure {
            tail: Vec::new(),
            ..failure.clone()
        };
        assert_eq!(
            event_lines("ddp-run", &Event::RankFailed(&silent)),
            [
                "ddp-run: rank 1 exited with code 17",
                "ddp-run: rank 1 printed nothing"
            ]
        );
        let restarting = Event::Restarting {
            restart: 1,
            max_restarts: 3,
        };
        assert_eq!(
            event_lines("ddp-run", &restarting),
            ["ddp-run: restart 1/3 of the whole group"]
        );
    }

    #[test]
    fn every_end_has_its_line_and_exit_status() {
        let failure = RankFailure {
            rank: 0,
            exit: Exit::Signal(9),
            tail: vec![],
            log: None,
        };
        let cases = [
            (
                Outcome::Succeeded { restarts: 0 },
                Some("all 2 rank(s) finished"),
                0,
            ),
            (
                Outcome::Succeeded { restarts: 2 },
                Some("all 2 rank(s) finished after 2 restart(s)"),
                0,
            ),
            (
                Outcome::Failed {
                    failure: failure.clone(),
                    restarts: 0,
                },
                None,
                1,
            ),
            (
                Outcome::Failed {
                    failure,
                    restarts: 3,
                },
                Some("giving up after 3 restart(s)"),
                1,
            ),
            (
                Outcome::Interrupted { signal: 2 },
                Some("interrupted by signal 2; all ranks stopped"),
                130,
            ),
            (
                Outcome::Stopped {
                    signal: Some(15),
                    restarts: 0,
                },
                Some(
                    "the job stopped after signal 15 at a checkpoint (exit code 75); \
                     starting the job again continues it",
                ),
                75,
            ),
        ];
        for (outcome, line, status) in cases {
            assert_eq!(outcome_line(&outcome, 2).as_deref(), line, "{outcome:?}");
            assert_eq!(exit_status(&outcome), status, "{outcome:?}");
        }
    }
}
