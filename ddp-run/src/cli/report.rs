//! What the `ddp-run` binary tells its user about a job, in one place for every program that
//! starts ranks the way `ddp-run` does (a training program given `--nproc-per-node` starts
//! its own through `ddp_train::cli::run`): the launcher's events and the job's end on
//! stderr, and the exit status.

use std::process::ExitCode;
use std::time::Duration;

use crate::error::{LOG_DIR_FLAG, MASTER_PORT_FLAG};
use crate::{launch, Event, LaunchConfig, LaunchError, Outcome, RankFailure};

use crate::error::join_causes;

/// How a launcher built on [`launch_and_report_with`] names what its user can change.
#[derive(Debug, Clone)]
pub struct Wording {
    /// What gives the ranks more time to stop (`ddp-run`'s `--shutdown-timeout`), in the
    /// advice after ranks were killed at the end of the shutdown timeout.
    pub longer_shutdown: String,
    /// How the user continues a job whose ranks stopped at a checkpoint: the same run
    /// directory again, or the command that gives it (see [`shell_command`]).
    pub to_continue: String,
    /// What chooses the port where the ranks meet (`ddp-run`'s `--master-port`), after
    /// "give" when no free port is found.
    pub master_port: String,
    /// What chooses the folder of the rank logs (`ddp-run`'s `--log-dir`), after "give
    /// another" when it cannot be written.
    pub log_dir: String,
}

impl Default for Wording {
    /// `ddp-run`'s words.
    fn default() -> Self {
        Self {
            longer_shutdown: "--shutdown-timeout".into(),
            to_continue: "the program continues it when started again with the same run \
                          directory"
                .into(),
            master_port: MASTER_PORT_FLAG.into(),
            log_dir: LOG_DIR_FLAG.into(),
        }
    }
}

impl Wording {
    /// `error`, an error of [`launch`], whose advice names `ddp-run`'s flags, with that
    /// advice in these words.
    pub fn reword(&self, error: LaunchError) -> LaunchError {
        match error {
            LaunchError::NoFreePort { source, .. } => LaunchError::NoFreePort {
                port_flag: self.master_port.clone(),
                source,
            },
            LaunchError::LogDirIsFile { path, .. } => LaunchError::LogDirIsFile {
                path,
                log_dir_flag: self.log_dir.clone(),
            },
            LaunchError::Log { path, source, .. } => LaunchError::Log {
                path,
                log_dir_flag: self.log_dir.clone(),
                source,
            },
            other => other,
        }
    }
}

/// Runs the job as the `ddp-run` binary does and tells the user on stderr, in lines that
/// begin with `name: `, what happens: the `OMP_NUM_THREADS` the ranks get when the launcher
/// chose it, each attempt's start, a failed rank and the last lines it printed (indented),
/// each restart, and how the job ended. The ranks' own output is echoed as
/// [`LaunchConfig::echo`] says. [`launch`] itself prints nothing of its own; this function is
/// for binaries.
///
/// Returns the launcher's exit status: 0 when every rank succeeded, 1 when a rank failed
/// (after the restarts), 75 ([`crate::EXIT_STOPPED`]) when the ranks stopped at a checkpoint
/// on request ([`crate::Outcome::Stopped`]), 128+N after signal N (a launcher's `main` dies
/// of it first: [`die_of_interruption`]). An `Err` is the
/// launcher's own failure (bad settings, a program that cannot be started), for the caller to
/// print.
pub fn launch_and_report(config: &LaunchConfig, name: &str) -> Result<ExitCode, LaunchError> {
    launch_and_report_with(config, name, &Wording::default())
}

/// [`launch_and_report`], with advice in the launcher's own `wording`.
pub fn launch_and_report_with(
    config: &LaunchConfig,
    name: &str,
    wording: &Wording,
) -> Result<ExitCode, LaunchError> {
    let outcome = launch_and_report_outcome(config, name, wording)?;
    Ok(ExitCode::from(exit_status(&outcome)))
}

/// [`launch_and_report_with`], returning how the job ended rather than the exit status
/// ([`exit_status`]), for a launcher that ends in its own way: `ddp-run` dies of the signal
/// that interrupted it, as a shell expects of a program the user stopped.
pub fn launch_and_report_outcome(
    config: &LaunchConfig,
    name: &str,
    wording: &Wording,
) -> Result<Outcome, LaunchError> {
    config.validate()?;
    let omp_chosen = config.omp_num_threads.is_none()
        && std::env::var_os(crate::env::OMP_NUM_THREADS).is_none()
        && config.nproc_per_node > 1;
    if omp_chosen {
        eprint_line(format!(
            "{name}: OMP_NUM_THREADS=1 for each rank, so that {} ranks do not overload the \
             cores; set OMP_NUM_THREADS to choose another number",
            config.nproc_per_node
        ));
    }
    if let Some(warning) = config.secret_warning() {
        eprint_line(format!("{name}: {warning}"));
    }
    let outcome = launch(config, |event| {
        for line in event_lines(name, event) {
            eprint_line(line);
        }
    })
    .map_err(|e| wording.reword(e))?;
    let lines = match &outcome {
        Outcome::Interrupted { .. } => interruption_lines(
            name,
            &outcome,
            config.shutdown_timeout,
            &wording.longer_shutdown,
        ),
        _ => outcome_line(&outcome, config.nproc_per_node, &wording.to_continue)
            .map(|line| format!("{name}: {line}"))
            .into_iter()
            .collect(),
    };
    for line in lines {
        eprint_line(line);
    }
    Ok(outcome)
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
        Event::RankFailed(failure) => failure_lines(name, failure),
        Event::Restarting {
            restart,
            max_restarts,
        } => vec![format!(
            "{name}: restart {restart}/{max_restarts} of the whole group"
        )],
        Event::Warning(warning) => vec![format!("{name}: {warning}")],
    }
}

/// The lines that tell of a failed rank, each prefixed with `name: `: how it ended, then the
/// last lines it printed in its attempt, indented so that they read as the rank's own, then
/// the error it recorded in its error file where those lines do not hold it (it was killed
/// before it printed it, or printed more since).
pub fn failure_lines(name: &str, failure: &RankFailure) -> Vec<String> {
    let mut lines = vec![format!("{name}: {failure}")];
    if failure.tail.is_empty() {
        lines.push(format!("{name}: rank {} printed nothing", failure.rank));
    } else {
        lines.push(match &failure.log {
            Some(log) => format!("{name}: last lines of {}:", log.display()),
            None => format!("{name}: last lines of rank {}:", failure.rank),
        });
        lines.extend(failure.tail.iter().map(|line| format!("    {line}")));
    }
    if let Some(error) = &failure.error {
        if !failure
            .tail
            .iter()
            .any(|line| line.contains(error.as_str()))
        {
            lines.push(format!("{name}: rank {}'s error: {error}", failure.rank));
        }
    }
    lines
}

/// The lines that tell how an [`Outcome::Interrupted`] ended (none for another outcome),
/// each prefixed with `name: `: the ranks killed after `timeout`, and those that had ended
/// but not what they started in their process group, with the advice to raise
/// `longer_shutdown`, and the ranks that failed on their own, the first with its last lines.
pub fn interruption_lines(
    name: &str,
    outcome: &Outcome,
    timeout: Duration,
    longer_shutdown: &str,
) -> Vec<String> {
    let Outcome::Interrupted {
        signal,
        killed,
        leftovers,
        second_signal,
        failed,
        after_failure,
    } = outcome
    else {
        return Vec::new();
    };
    let mut first = format!("{name}: interrupted by signal {signal}");
    // The ranks were being stopped for a failure (told already), and the signal cut it short.
    if let Some(failure) = after_failure {
        first.push_str(&format!(" after rank {} failed", failure.rank));
    }
    let were = if killed.len() == 1 { "was" } else { "were" };
    let when = match second_signal {
        true if after_failure.is_some() => "at the signal".to_string(),
        true => "at a second signal".to_string(),
        false => format!(
            "{} s after it (the shutdown timeout)",
            timeout.as_secs_f64()
        ),
    };
    if killed.is_empty() && leftovers.is_empty() && failed.is_empty() {
        first.push_str("; all ranks stopped");
    } else if *second_signal && !killed.is_empty() {
        let ranks = rank_list(killed);
        first.push_str(&format!("; {ranks} {were} killed {when}"));
    } else if !killed.is_empty() {
        let ranks = rank_list(killed);
        first.push_str(&format!(
            "; {ranks} had not stopped {when} and {were} killed"
        ));
    }
    if !leftovers.is_empty() {
        let ranks = rank_list(leftovers);
        first.push_str(&format!(
            "; {ranks} {} ended, but what {} started in its process group had not stopped \
             {when} and was killed",
            if leftovers.len() == 1 { "has" } else { "have" },
            if leftovers.len() == 1 { "it" } else { "each" },
        ));
    }
    let cut_short = !killed.is_empty() || !leftovers.is_empty();
    if cut_short && !*second_signal {
        first.push_str(&format!(
            "; a stop at a checkpoint needs more time: raise {longer_shutdown}"
        ));
    }
    let mut lines = vec![first];
    if let Some((failure, others)) = failed.split_first() {
        lines.extend(failure_lines(name, failure));
        lines.extend(others.iter().map(|f| format!("{name}: {f}")));
    }
    lines
}

/// `rank 3`, `ranks 0-3` or `ranks 0, 2, 5`, for ranks in ascending order.
fn rank_list(ranks: &[usize]) -> String {
    match ranks {
        [one] => format!("rank {one}"),
        [first, .., last] if last - first + 1 == ranks.len() => format!("ranks {first}-{last}"),
        _ => {
            let all: Vec<String> = ranks.iter().map(ToString::to_string).collect();
            format!("ranks {}", all.join(", "))
        }
    }
}

/// The line that tells how the job of `nproc` ranks ended, if any (a failure without
/// restarts was told by its event already), with `to_continue` after a stop.
fn outcome_line(outcome: &Outcome, nproc: usize, to_continue: &str) -> Option<String> {
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
        // Told by `interruption_lines`.
        Outcome::Interrupted { .. } => None,
        Outcome::Stopped { signal, .. } => {
            // Some ranks may have finished while others stopped.
            let who = signal.map_or("the job stopped".to_string(), |s| {
                format!("the job stopped after signal {s}")
            });
            Some(format!(
                "{who} at a checkpoint (exit code {}); {to_continue}",
                crate::EXIT_STOPPED
            ))
        }
    }
}

/// `words` as one command line a POSIX shell reads back word for word: a plain word as it
/// is, any other in single quotes.
pub fn shell_command<S: AsRef<str>>(words: &[S]) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c);
    let quoted = words.iter().map(|w| {
        let word = w.as_ref();
        if !word.is_empty() && word.chars().all(plain) {
            word.to_owned()
        } else {
            format!("'{}'", word.replace('\'', r"'\''"))
        }
    });
    quoted.collect::<Vec<_>>().join(" ")
}

/// [`Outcome::exit_code`] as a process's exit status (1 for anything out of range).
pub fn exit_status(outcome: &Outcome) -> u8 {
    u8::try_from(outcome.exit_code()).unwrap_or(1)
}

/// Where a signal interrupted the job ([`Outcome::Interrupted`]), ends this process by it, as
/// the signal's default action would have: a shell then sees a program the user stopped
/// (`while :; do ddp-run ...; done` ends at a Ctrl-C, as it would with the program run
/// alone). Returns otherwise, and where the signal does not end the process (the first
/// process of a pid namespace, which the kernel's default actions spare), for the caller to
/// exit with [`exit_status`] (128 + the signal) instead. For a launcher's `main`: the
/// process ends here.
pub fn die_of_interruption(outcome: &Outcome) {
    let Outcome::Interrupted { signal, .. } = *outcome else {
        return;
    };
    // SAFETY: prctl(2), signal(2) with SIG_DFL and raise(3), on this process; no memory is
    // involved. Not dumpable: SIGQUIT's default action (Ctrl-\\) would leave a core of the
    // launcher, which no user asked for.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong);
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

/// `println!` for a program's messages (ddp-run's, xtask's, the `ddp-train` binary's): a
/// reader that has gone (`ddp-train ... | head -1`) is no reason to fail, nor to stop what
/// the program was doing, as `println!`'s panic on the closed stdout would; the line is
/// dropped.
pub fn print_line(line: impl std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// [`print_line`] for stderr, `eprintln!` without its panic: a closed stderr (`ddp-run ...
/// 2>&1 | head`) is no reason to stop supervising the ranks.
pub fn eprint_line(line: impl std::fmt::Display) {
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
            error: Some("giving up".into()),
            stopped_by_launcher: false,
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
                "ddp-run: rank 1 printed nothing",
                "ddp-run: rank 1's error: giving up"
            ]
        );
        // The error it recorded, where its last lines do not hold it.
        let recorded = RankFailure {
            error: Some("checkpoint 'c': Is a directory (os error 21)".into()),
            ..failure.clone()
        };
        assert_eq!(
            event_lines("ddp-run", &Event::RankFailed(&recorded))[4],
            "ddp-run: rank 1's error: checkpoint 'c': Is a directory (os error 21)"
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
    fn an_interruption_names_the_ranks_killed_and_those_that_failed() {
        let interrupted = |killed: Vec<usize>, second_signal, failed| Outcome::Interrupted {
            signal: 15,
            killed,
            leftovers: vec![],
            second_signal,
            failed,
            after_failure: None,
        };
        let lines = |outcome: &Outcome| {
            interruption_lines("x", outcome, Duration::from_secs(10), "--grace")
        };
        assert_eq!(
            lines(&interrupted(vec![], false, vec![])),
            ["x: interrupted by signal 15; all ranks stopped"]
        );
        assert_eq!(
            lines(&interrupted(vec![0, 1, 2], false, vec![])),
            [
                "x: interrupted by signal 15; ranks 0-2 had not stopped 10 s after it (the \
                 shutdown timeout) and were killed; a stop at a checkpoint needs more time: \
                 raise --grace"
            ]
        );
        assert_eq!(
            lines(&interrupted(vec![0, 2], true, vec![])),
            ["x: interrupted by signal 15; ranks 0, 2 were killed at a second signal"]
        );
        let failure = |rank, tail: &[&str]| RankFailure {
            rank,
            exit: Exit::Code(1),
            tail: tail.iter().map(|l| l.to_string()).collect(),
            log: None,
            error: None,
            stopped_by_launcher: false,
        };
        let failed = vec![
            failure(0, &["cannot write the checkpoint"]),
            failure(3, &[]),
        ];
        assert_eq!(
            lines(&interrupted(vec![1], false, failed)),
            [
                "x: interrupted by signal 15; rank 1 had not stopped 10 s after it (the \
                 shutdown timeout) and was killed; a stop at a checkpoint needs more time: \
                 raise --grace",
                "x: rank 0 exited with code 1",
                "x: last lines of rank 0:",
                "    cannot write the checkpoint",
                "x: rank 3 exited with code 1",
            ]
        );
        // Rank 2's process exited as asked, but not what it started (a wrapper's program).
        let left = |leftovers, second_signal| Outcome::Interrupted {
            signal: 15,
            killed: vec![0],
            leftovers,
            second_signal,
            failed: vec![failure(2, &[])],
            after_failure: None,
        };
        assert_eq!(
            lines(&left(vec![2], false)),
            [
                "x: interrupted by signal 15; rank 0 had not stopped 10 s after it (the \
                 shutdown timeout) and was killed; rank 2 has ended, but what it started in its \
                 process group had not stopped 10 s after it (the shutdown timeout) and was \
                 killed; a stop at a checkpoint needs more time: raise --grace",
                "x: rank 2 exited with code 1",
                "x: rank 2 printed nothing"
            ]
        );
        assert_eq!(
            lines(&left(vec![1, 2], true))[0],
            "x: interrupted by signal 15; rank 0 was killed at a second signal; ranks 1-2 have \
             ended, but what each started in its process group had not stopped at a second \
             signal and was killed"
        );
        // A second signal that came when every rank had ended killed nothing.
        assert_eq!(
            lines(&interrupted(vec![], true, vec![failure(2, &[])])),
            [
                "x: interrupted by signal 15",
                "x: rank 2 exited with code 1",
                "x: rank 2 printed nothing"
            ]
        );
        // The signal came while the ranks were being stopped for rank 1's failure (told by its
        // event): it cut that stop short.
        let during_stop = |killed, second_signal| Outcome::Interrupted {
            signal: 15,
            killed,
            leftovers: vec![],
            second_signal,
            failed: vec![],
            after_failure: Some(failure(1, &["crashing"])),
        };
        assert_eq!(
            lines(&during_stop(vec![0], true)),
            ["x: interrupted by signal 15 after rank 1 failed; rank 0 was killed at the signal"]
        );
        assert_eq!(
            lines(&during_stop(vec![], false)),
            ["x: interrupted by signal 15 after rank 1 failed; all ranks stopped"]
        );
        assert!(lines(&Outcome::Succeeded { restarts: 0 }).is_empty());
    }

    /// The launcher's errors advise in `ddp-run`'s flags, and in another launcher's words
    /// once reworded.
    #[test]
    fn launch_errors_name_the_flags_of_the_launcher() {
        let said = |wording: &Wording| {
            let looped = || std::io::Error::from_raw_os_error(libc::ELOOP);
            [
                LaunchError::NoFreePort {
                    port_flag: MASTER_PORT_FLAG.into(),
                    source: looped(),
                },
                LaunchError::LogDirIsFile {
                    path: "run/logs".into(),
                    log_dir_flag: LOG_DIR_FLAG.into(),
                },
                LaunchError::Log {
                    path: "run/logs/rank-0.out".into(),
                    log_dir_flag: LOG_DIR_FLAG.into(),
                    source: looped(),
                },
                LaunchError::NoRanks,
            ]
            .map(|e| wording.reword(e).to_string())
        };
        let symlink = "cannot write the rank log run/logs/rank-0.out: it is a symbolic link, \
                       which a rank's log may not be (so that a shared folder cannot send it \
                       elsewhere); remove it, or give another";
        let no_ranks = "the number of ranks per node (--nproc-per-node) must be at least 1";
        assert_eq!(
            said(&Wording::default()),
            [
                "cannot find a free port on 127.0.0.1 for the ranks to meet on (give \
                 --master-port)"
                    .to_string(),
                "the folder of the rank logs run/logs is a file: remove it, or give another \
                 --log-dir"
                    .to_string(),
                format!("{symlink} --log-dir"),
                no_ranks.to_string(),
            ]
        );
        let other = Wording {
            master_port: "PORT".into(),
            log_dir: "DIR".into(),
            ..Wording::default()
        };
        assert_eq!(
            said(&other),
            [
                "cannot find a free port on 127.0.0.1 for the ranks to meet on (give PORT)"
                    .to_string(),
                "the folder of the rank logs run/logs is a file: remove it, or give another DIR"
                    .to_string(),
                format!("{symlink} DIR"),
                no_ranks.to_string(),
            ]
        );
    }

    #[test]
    fn a_command_reads_back_word_for_word() {
        assert_eq!(
            shell_command(&["prog", "--out", "runs/a b", "", "it's", "--lr=0.1"]),
            r"prog --out 'runs/a b' '' 'it'\''s' --lr=0.1"
        );
    }

    #[test]
    fn every_end_has_its_line_and_exit_status() {
        let failure = RankFailure {
            rank: 0,
            exit: Exit::Signal(9),
            tail: vec![],
            log: None,
            error: None,
            stopped_by_launcher: false,
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
                Outcome::Interrupted {
                    signal: 2,
                    killed: vec![],
                    leftovers: vec![],
                    second_signal: false,
                    failed: vec![],
                    after_failure: None,
                },
                None,
                130,
            ),
            (
                Outcome::Stopped {
                    signal: Some(15),
                    restarts: 0,
                },
                Some(
                    "the job stopped after signal 15 at a checkpoint (exit code 75); the \
                     program continues it when started again with the same run directory",
                ),
                75,
            ),
        ];
        for (outcome, line, status) in cases {
            let to_continue = Wording::default().to_continue;
            assert_eq!(
                outcome_line(&outcome, 2, &to_continue).as_deref(),
                line,
                "{outcome:?}"
            );
            assert_eq!(exit_status(&outcome), status, "{outcome:?}");
        }
    }
}
