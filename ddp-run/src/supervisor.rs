//! Starting the ranks of one node and watching them until the job ends.
//!
//! Each rank is a child process in a session (and process group) of its own, as torchrun's
//! are, with `PR_SET_PDEATHSIG` so that the kernel kills it when the launcher dies, however the
//! launcher dies. Ranks are watched with `waitid(WNOWAIT)`, which sees an exit without reaping
//! it, each by a thread of its own that notes when (the first rank to fail is named): until the launcher reaps a rank, its pid (and so its process group id) cannot be reused,
//! nor, once reaped, while a process is left in its group, so signalling the group can only
//! reach that rank and what it started.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::env::DEFAULT_MASTER_PORT;
use crate::error::{LOG_DIR_FLAG, MASTER_PORT_FLAG};
use crate::error_file::{ErrorFolder, Failed, RecordedError};
use crate::lifeline::Lifeline;
use crate::rank_env::RankEnv;
use crate::signals::{SignalWatch, FORWARDED};
use crate::{LaunchConfig, LaunchError};

mod group;
mod outcome;
mod pump;
mod stop;
mod wait;

use group::kill_group;
use pump::{Pump, Pumping, Stream};
use stop::{Cause, Stopped};
use wait::{peek_exit, wait_exit};

pub use outcome::{Event, Exit, Outcome, RankFailure, EXIT_STOPPED};

/// Runs the job: starts the ranks of this node with torchrun's environment, copies their
/// output to their log files (and the terminal), and ends the job as soon as one rank fails
/// (the others get SIGTERM, then SIGKILL after `shutdown_timeout`), restarting the whole
/// group up to `max_restarts` times. SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGUSR1 received
/// meanwhile are forwarded to every rank, which then get `shutdown_timeout` to end (a rank
/// that stops at a checkpoint exits with [`EXIT_STOPPED`], see [`Outcome::Stopped`]); no new
/// generation of ranks starts after one. A SIGCHLD that this process ignores (inherited
/// `SIG_IGN` or `SA_NOCLDWAIT`) is set back to its default first, so that the ranks' exits
/// can be seen.
///
/// `on_event` hears of each attempt, failure and restart, in order. Returns how the job
/// ended; an `Err` is a failure of the launcher itself (bad settings, a program that cannot
/// be started), after which no rank it started is left running.
pub fn launch(
    config: &LaunchConfig,
    mut on_event: impl FnMut(&Event<'_>),
) -> Result<Outcome, LaunchError> {
    config.validate()?;
    crate::signals::keep_children_waitable().map_err(|source| LaunchError::Signals {
        signal: libc::SIGCHLD,
        source,
    })?;
    // Every attempt's ranks count their time limit from here, as the scheduler's counts (or
    // from an earlier start this launcher inherited).
    let (job_started, stale) = crate::job_start::launcher_start(std::time::SystemTime::now());
    if let Some(warning) = stale {
        on_event(&Event::Warning(&warning));
    }
    if let Some(dir) = &config.log_dir {
        if dir.exists() && !dir.is_dir() {
            return Err(LaunchError::LogDirIsFile {
                path: dir.clone(),
                log_dir_flag: LOG_DIR_FLAG.into(),
            });
        }
        crate::run_dir::create_folders_synced(dir).map_err(|source| LaunchError::Log {
            path: dir.clone(),
            log_dir_flag: LOG_DIR_FLAG.into(),
            source,
        })?;
    }
    let run_id = match (&config.run_id, config.nnodes) {
        (Some(id), _) => id.clone(),
        (None, 1) => format!("ddp-run-{}-{}", std::process::id(), unix_millis()),
        (None, _) => "none".to_string(),
    };
    let secret = crate::secret::job_secret(config)?;
    let omp = config.omp_num_threads_for_ranks();
    let watch = SignalWatch::start(&FORWARDED)?;
    let mut restarts = 0;
    loop {
        // No new generation of ranks starts after the user asked to stop.
        if let Some(signal) = watch.received() {
            return Ok(Outcome::Interrupted {
                signal,
                killed: Vec::new(),
                leftovers: Vec::new(),
                second_signal: false,
                failed: Vec::new(),
                after_failure: None,
            });
        }
        let master_port = match (config.master_port, config.nnodes) {
            (Some(port), _) => port,
            (None, 1) => crate::free_port().map_err(|source| LaunchError::NoFreePort {
                port_flag: MASTER_PORT_FLAG.into(),
                source,
            })?,
            (None, _) => DEFAULT_MASTER_PORT,
        };
        // Without a folder for the error files, a crash, else the first rank to exit, is named.
        let errors = ErrorFolder::create()
            .inspect_err(|e| on_event(&Event::Warning(&ErrorFolder::unavailable(e))))
            .ok();
        on_event(&Event::Starting {
            attempt: restarts,
            ranks: config.ranks(),
            world_size: config.world_size(),
            master_addr: &config.master_addr,
            master_port,
            omp_num_threads: omp.as_deref(),
        });
        let attempt = Attempt {
            config,
            master_port,
            restart_count: restarts,
            run_id: &run_id,
            secret: secret.as_ref(),
            omp: omp.as_deref(),
            job_started,
            errors: errors.as_ref(),
        };
        match attempt.run(&watch, &mut on_event)? {
            End::Succeeded => return Ok(Outcome::Succeeded { restarts }),
            End::Interrupted(outcome) => return Ok(outcome),
            End::Stopped(signal) => return Ok(Outcome::Stopped { signal, restarts }),
            End::Failed(failure, stopped) => {
                on_event(&Event::RankFailed(&failure));
                // A signal that arrived while the failed attempt was being stopped ends the
                // job as interrupted, with restarts left or not: no new generation of ranks
                // starts after the user asked to stop.
                if let Some(signal) = watch.received() {
                    return Ok(Outcome::Interrupted {
                        signal,
                        killed: stopped.killed,
                        leftovers: stopped.leftovers,
                        second_signal: stopped.second_signal,
                        failed: Vec::new(),
                        after_failure: Some(failure),
                    });
                }
                if restarts >= config.max_restarts {
                    return Ok(Outcome::Failed { failure, restarts });
                }
                restarts += 1;
                on_event(&Event::Restarting {
                    restart: restarts,
                    max_restarts: config.max_restarts,
                });
            }
        }
    }
}

fn unix_millis() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// How one attempt ended.
enum End {
    Succeeded,
    /// An [`Outcome::Interrupted`].
    Interrupted(Outcome),
    Stopped(Option<i32>),
    /// The rank whose failure came first, and how the others were stopped.
    Failed(RankFailure, Stopped),
}

/// One attempt: every rank of this node, started together.
struct Attempt<'a> {
    config: &'a LaunchConfig,
    master_port: u16,
    restart_count: u32,
    run_id: &'a str,
    /// The job's secret, the same for every attempt.
    secret: Option<&'a crate::JobSecret>,
    omp: Option<&'a str>,
    /// When [`launch`] was called, before the first attempt.
    job_started: std::time::SystemTime,
    /// The ranks' error files, if there is a folder for them.
    errors: Option<&'a ErrorFolder>,
}

/// When a rank exited and how, as its waiter thread saw it.
type Noted = (Instant, std::io::Result<Exit>);

/// A running rank and the threads copying its output.
struct Rank {
    rank: usize,
    child: Child,
    exit: Option<Exit>,
    /// Why the rank's exit cannot be seen, once waitid failed (ECHILD: something else in
    /// this process reaped it).
    lost: Option<std::io::Error>,
    /// When and how the rank exited, as its waiter thread saw it, until `watch` takes it.
    exited: Arc<Mutex<Option<Noted>>>,
    /// When the rank exited, once `watch` took it from `exited`.
    exited_at: Option<Instant>,
    /// Where the rank records its error ([`crate::record_error`]), if the launcher has one.
    error_file: Option<PathBuf>,
    /// The thread blocked in `waitid` until the rank exits; joined before the rank is reaped.
    waiter: Option<JoinHandle<()>>,
    tail: Arc<Mutex<VecDeque<String>>>,
    pumps: Vec<Pumping>,
    log: Option<PathBuf>,
}

impl Rank {
    /// Reaps the rank's process, which has exited or been killed.
    fn reap(&mut self) {
        // Its waitid has returned, or will now that the rank has exited: reaping before it
        // returned could let it wait on a new process given the same pid.
        if let Some(waiter) = self.waiter.take() {
            let _ = waiter.join();
        }
        if let Ok(status) = self.child.wait() {
            if self.exit.is_none() {
                use std::os::unix::process::ExitStatusExt;
                self.exit = status
                    .code()
                    .map(Exit::Code)
                    .or(status.signal().map(Exit::Signal));
            }
        }
    }

    /// Whether the rank's own process has exited; reaps it then (its group keeps its
    /// number from reuse while anything is left in the group). A rank whose exit cannot be
    /// seen (`lost`) has ended too, how is not known: it is not this process's child any
    /// more.
    fn exited(&mut self) -> bool {
        if self.exit.is_none() && self.lost.is_none() {
            match peek_exit(self.child.id()) {
                Ok(exit) => self.exit = exit,
                Err(e) => self.lost = Some(e),
            }
        }
        if self.exit.is_some() {
            self.reap();
        }
        self.exit.is_some() || self.lost.is_some()
    }

    /// How this rank, which has ended, failed: its exit and last lines (whether the signal
    /// that ended it was the launcher's is for the caller to say: [`Rank::signal_was_ours`]).
    fn failure(&self) -> RankFailure {
        let tail = self
            .tail
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default();
        RankFailure {
            rank: self.rank,
            exit: self.exit.unwrap_or(Exit::Code(1)),
            tail,
            log: self.log.clone(),
            error: self.recorded().map(|r| r.message),
            stopped_by_launcher: false,
        }
    }

    /// Whether a signal ended the rank and it was the launcher's: one that came after the
    /// launcher began to stop the attempt at `signalled`, a SIGKILL only where the launcher
    /// killed the rank (`killed`).
    fn signal_was_ours(&mut self, signalled: Instant, killed: &[usize]) -> bool {
        let at = self.exit_instant();
        match self.exit {
            Some(Exit::Signal(signal)) => {
                at.is_none_or(|at| at >= signalled)
                    && (signal != libc::SIGKILL || killed.contains(&self.rank))
            }
            _ => false,
        }
    }

    /// The error the rank recorded in its error file, if any.
    fn recorded(&self) -> Option<RecordedError> {
        crate::error_file::read(self.error_file.as_deref()?)
    }

    /// When the rank, which has ended, exited, as its waiter thread saw it.
    fn exit_instant(&mut self) -> Option<Instant> {
        if self.exited_at.is_none() {
            let noted = self.exited.lock().ok().and_then(|mut e| e.take());
            self.exited_at = noted.map(|(at, _)| at);
        }
        self.exited_at
    }

    /// How the rank, which has ended after the launcher signalled the ranks at `signalled`
    /// (SIGKILL to `killed`), failed: when it exited, as wall-clock time, what it recorded,
    /// and whether a signal the launcher did not send killed it.
    fn failed(&mut self, signalled: Instant, killed: &[usize]) -> Failed {
        let at = self.exit_instant();
        let ago = at.map_or(Duration::ZERO, |at| at.elapsed());
        let crashed =
            matches!(self.exit, Some(Exit::Signal(_))) && !self.signal_was_ours(signalled, killed);
        Failed {
            exited: SystemTime::now().checked_sub(ago).unwrap_or(UNIX_EPOCH),
            recorded: self.recorded(),
            crashed,
        }
    }
}

/// What hears of the launcher's events: [`launch`]'s `on_event`.
type OnEvent<'e> = dyn FnMut(&Event<'_>) + 'e;

impl Attempt<'_> {
    /// Starts the ranks and watches them; every rank it started has been stopped when it
    /// returns.
    fn run(&self, watch: &SignalWatch, on_event: &mut OnEvent<'_>) -> Result<End, LaunchError> {
        let mut ranks: Vec<Rank> = Vec::with_capacity(self.config.nproc_per_node);
        for (local_rank, rank) in self.config.ranks().enumerate() {
            // After a signal, no more ranks start: `watch` stops those started.
            if watch.received().is_some() {
                break;
            }
            let error_file = self.errors.map(|e| e.path(rank));
            match self.spawn(rank, local_rank, error_file) {
                Ok(r) => ranks.push(r),
                Err(e) => {
                    let _ = self.stop(&mut ranks, Cause::Launcher, on_event);
                    return Err(e);
                }
            }
        }
        self.watch(&mut ranks, watch, on_event)
    }

    /// Watches the ranks until the attempt ends: each has ended, or been stopped, when it
    /// returns.
    fn watch(
        &self,
        ranks: &mut [Rank],
        watch: &SignalWatch,
        on_event: &mut OnEvent<'_>,
    ) -> Result<End, LaunchError> {
        loop {
            if let Some(signal) = watch.received() {
                let Stopped {
                    killed,
                    leftovers,
                    second_signal,
                    ..
                } = self.stop(ranks, Cause::Signal(signal), on_event)?;
                // Stopped at a checkpoint: some ranks stopped so and the others succeeded
                // (ranks that had nothing left to do), as without a signal.
                let stopped = |r: &Rank| r.exit == Some(Exit::Code(i32::from(EXIT_STOPPED)));
                if ranks.iter().any(stopped)
                    && ranks
                        .iter()
                        .all(|r| stopped(r) || r.exit == Some(Exit::Code(0)))
                {
                    return Ok(End::Stopped(Some(signal)));
                }
                // Killed by the signal, or exited as a shell does then (128 + it): as asked.
                let as_asked = [
                    Exit::Code(0),
                    Exit::Code(i32::from(EXIT_STOPPED)),
                    Exit::Signal(signal),
                    Exit::Code(128 + signal),
                ];
                let failed = ranks
                    .iter()
                    .filter(|r| !killed.contains(&r.rank))
                    .filter(|r| r.exit.is_some_and(|e| !as_asked.contains(&e)))
                    .map(Rank::failure)
                    .collect();
                return Ok(End::Interrupted(Outcome::Interrupted {
                    signal,
                    killed,
                    leftovers,
                    second_signal,
                    failed,
                    after_failure: None,
                }));
            }
            let mut failed = Vec::new();
            for (k, r) in ranks.iter_mut().enumerate() {
                let noted = r.exited.lock().ok().and_then(|mut e| e.take());
                let Some((at, exit)) = noted else {
                    continue;
                };
                let exit = match exit {
                    Ok(exit) => exit,
                    Err(source) => {
                        let (rank, pid) = (r.rank, r.child.id());
                        let _ = self.stop(ranks, Cause::Launcher, on_event);
                        return Err(LaunchError::Wait { rank, pid, source });
                    }
                };
                (r.exit, r.exited_at) = (Some(exit), Some(at));
                if !exit.success() && exit != Exit::Code(i32::from(EXIT_STOPPED)) {
                    failed.push((at, !matches!(exit, Exit::Signal(_)), k));
                }
            }
            // The first rank to exit ends the attempt, however many exits one check finds; in
            // a tie, one killed by a signal, then the lowest. The cause is `first_failed`'s.
            failed.sort();
            if let Some(&(_, _, k)) = failed.first() {
                let signalled = Instant::now();
                let stopped = self.stop(ranks, Cause::Launcher, on_event)?;
                let k = first_failed(ranks, k, signalled, &stopped.killed);
                let mut failure = ranks[k].failure();
                failure.stopped_by_launcher = ranks[k].signal_was_ours(signalled, &stopped.killed);
                return Ok(End::Failed(failure, stopped));
            }
            if ranks.iter().all(|r| r.exit.is_some()) {
                // What a finished rank left running (an upload, a writer) is left to finish,
                // as torchrun leaves it; its output reaches the terminal for a while
                // (`pump::drain`), then the launcher ends (its later writes find the pipe
                // closed).
                reap(ranks);
                if ranks
                    .iter()
                    .any(|r| r.exit == Some(Exit::Code(i32::from(EXIT_STOPPED))))
                {
                    return Ok(End::Stopped(None));
                }
                return Ok(End::Succeeded);
            }
            watch.sleep(self.config.monitor_interval);
        }
    }

    fn spawn(
        &self,
        rank: usize,
        local_rank: usize,
        error_file: Option<PathBuf>,
    ) -> Result<Rank, LaunchError> {
        let config = self.config;
        let env = RankEnv {
            rank,
            world_size: config.world_size(),
            local_rank,
            local_world_size: config.nproc_per_node,
            group_rank: config.node_rank,
            group_world_size: config.nnodes,
            role: config.role.clone(),
            master_addr: config.master_host().to_string(),
            master_port: self.master_port,
            restart_count: self.restart_count,
            max_restarts: config.max_restarts,
            run_id: self.run_id.to_string(),
            omp_num_threads: None,
            nccl_async_error_handling: config.nccl_async_error_handling(),
            secret: self.secret.cloned(),
            job_started: Some(self.job_started),
        };
        let mut cmd = Command::new(&config.program);
        // Standard input passes through, as torchrun's (a debugger in a rank reads the
        // terminal); the outputs go through the launcher (prefixes, logs, last lines).
        cmd.args(&config.args)
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::inherit())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        env.apply(&mut cmd);
        if let Some(omp) = self.omp {
            cmd.env(crate::env::OMP_NUM_THREADS, omp);
        }
        let launcher = std::process::id();
        let spawn_failed = |source| LaunchError::Spawn {
            rank,
            program: program_name(&config.program),
            hint: spawn_hint(&config.program, &source),
            source,
        };
        let lifeline = Lifeline::get().map_err(spawn_failed)?;
        lifeline.name_in(&mut cmd);
        let lifeline = lifeline.read_end();
        // Each node's launcher restarts its ranks on its own: a restarted rank must meet
        // rank 0 of its own attempt, not the previous one still running on another node.
        cmd.env(
            crate::env::DDP_LAUNCHER_ATTEMPT,
            env.restart_count.to_string(),
        );
        // Without a file of its own, a rank must not write to the launcher's.
        match &error_file {
            Some(path) => cmd.env(crate::env::TORCHELASTIC_ERROR_FILE, path),
            None => cmd.env_remove(crate::env::TORCHELASTIC_ERROR_FILE),
        };
        // SAFETY: between fork and exec the closure calls only async-signal-safe functions
        // (setsid, prctl, getppid, _exit, fcntl) and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                // A session of its own, as torchrun's workers: the launcher signals the rank
                // and everything it started as one group, and the terminal's Ctrl-C reaches
                // the ranks only through the launcher.
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The kernel kills the rank when the launcher dies, even by SIGKILL.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have died before prctl took effect.
                if libc::getppid() as u32 != launcher {
                    libc::_exit(1);
                }
                // The rank, and what it starts, inherit the lifeline's read end.
                if libc::fcntl(lifeline, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(spawn_failed)?;
        let log_path = config
            .log_dir
            .as_ref()
            .map(|dir| dir.join(format!("rank-{rank}.out")));
        let log = match &log_path {
            Some(path) => match open_log(path) {
                Ok(f) => Some(f),
                Err(source) => {
                    kill_group(child.id(), libc::SIGKILL);
                    let _ = child.wait();
                    return Err(LaunchError::Log {
                        path: path.clone(),
                        log_dir_flag: LOG_DIR_FLAG.into(),
                        source,
                    });
                }
            },
            None => None,
        };
        let log = Arc::new(Mutex::new(log));
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(config.tail_lines)));
        let mut pumps = Vec::with_capacity(2);
        let sink = |stream: Stream| Pump {
            rank,
            stream,
            echo: config.echo,
            log: Arc::clone(&log),
            tail: Arc::clone(&tail),
            tail_lines: config.tail_lines,
        };
        if let Some(out) = child.stdout.take() {
            pumps.push(sink(Stream::Stdout).start(out));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(sink(Stream::Stderr).start(err));
        }
        let exited = Arc::new(Mutex::new(None));
        let pid = child.id();
        // Named (`top -H`, a debugger), one per rank: it ends once it noted the exit.
        let waiter = {
            let exited = Arc::clone(&exited);
            std::thread::Builder::new()
                .name(waiter_name(rank))
                .spawn(move || {
                    let exit = wait_exit(pid, 0).map(|e| e.unwrap_or(Exit::Code(1)));
                    if let Ok(mut e) = exited.lock() {
                        *e = Some((Instant::now(), exit));
                    }
                })
        };
        let waiter = match waiter {
            Ok(w) => w,
            Err(source) => {
                kill_group(pid, libc::SIGKILL);
                let _ = child.wait();
                return Err(LaunchError::Wait { rank, pid, source });
            }
        };
        Ok(Rank {
            rank,
            child,
            exit: None,
            lost: None,
            exited,
            exited_at: None,
            error_file,
            waiter: Some(waiter),
            tail,
            pumps,
            log: log_path,
        })
    }
}

/// The name of rank `rank`'s waiter thread, unique within the 15 bytes the kernel keeps.
fn waiter_name(rank: usize) -> String {
    format!("ddp-run r{rank}")
}

fn program_name(program: &std::ffi::OsStr) -> String {
    let name: OsString = program.to_owned();
    format!("`{}`", name.to_string_lossy())
}

/// What to do about `program` failing to start with `err`, where the cause is a habit of
/// torchrun's users: a file of the current folder named without `./` (exec looks it up in
/// `PATH` only), or a Python script, which torchrun runs with `python` unless `--no-python`
/// while ddp-run always runs the program itself.
fn spawn_hint(program: &std::ffi::OsStr, err: &std::io::Error) -> Option<String> {
    let path = Path::new(program);
    let name = path.to_string_lossy();
    let python = path.extension().is_some_and(|e| e == "py");
    let with_python = || {
        format!(
            "give `python -u {name}` (ddp-run runs the program itself, where torchrun adds \
             `python -u` unless --no-python)"
        )
    };
    let bare = !name.contains('/');
    match err.kind() {
        std::io::ErrorKind::NotFound if bare && path.is_file() && python => Some(format!(
            "a Python script of the current folder; {}",
            with_python()
        )),
        std::io::ErrorKind::NotFound if bare && path.is_file() => Some(format!(
            "a file of the current folder, which a name without `/` does not reach (it is \
             looked up in PATH); give `./{name}`"
        )),
        std::io::ErrorKind::PermissionDenied if python => Some(format!(
            "a Python script that is not executable; {}",
            with_python()
        )),
        _ => None,
    }
}

/// Opens (creating) a rank's log for appending; a symbolic link in its place is refused
/// (`ELOOP`), so a log folder others can write to cannot redirect a rank's output into
/// another file.
fn open_log(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Of the ranks of an attempt now stopped, which the launcher signalled at `at` (SIGKILL to
/// `killed`), the one whose failure came first
/// ([`crate::error_file::first_failure`]); `detected`, the first seen to exit, in a tie.
fn first_failed(ranks: &mut [Rank], detected: usize, at: Instant, killed: &[usize]) -> usize {
    let failed = |r: &Rank| {
        r.exit
            .is_some_and(|e| !e.success() && e != Exit::Code(i32::from(EXIT_STOPPED)))
    };
    let mut order: Vec<usize> = (0..ranks.len()).filter(|&k| failed(&ranks[k])).collect();
    order.sort_by_key(|&k| k != detected);
    let failed: Vec<_> = order.iter().map(|&k| ranks[k].failed(at, killed)).collect();
    crate::error_file::first_failure(&failed).map_or(detected, |i| order[i])
}

/// Reaps the ranks, which have exited or been killed, and lets their output threads pass on
/// the last lines ([`pump::drain`]).
fn reap(ranks: &mut [Rank]) {
    for r in ranks.iter_mut() {
        r.reap();
    }
    pump::drain(ranks.iter_mut().flat_map(|r| r.pumps.drain(..)).collect());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiter_threads_have_names_the_kernel_keeps_whole() {
        let ranks = [0, 1, 10, 100, 999_999];
        let names: Vec<String> = ranks.into_iter().map(waiter_name).collect();
        assert!(names.iter().all(|n| n.len() <= 15), "{names:?}");
        assert_eq!(names[3], "ddp-run r100");
    }
}
