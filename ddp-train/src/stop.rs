//! Stopping a run cleanly before it is killed: signals and the time limit ([`StopReason`]).

use std::time::{Duration, Instant, SystemTime};

/// The exit code of a rank that stopped at a checkpoint on request (a signal or the time
/// limit) and can continue from it: 75, `EX_TEMPFAIL` of `sysexits.h` ("try again later").
/// `ddp-run` does not count it as a failure and ends with it too; it is the launcher's own
/// constant, so the two cannot drift apart.
pub use ddp_run::EXIT_STOPPED;

/// The signals that stop a run at the next step.
pub const STOP_SIGNALS: [i32; 2] = [libc::SIGTERM, libc::SIGUSR1];

/// Why a run stopped early.
///
/// Stopping a run cleanly before it is killed: SIGTERM and SIGUSR1 (what SLURM's `--signal`,
/// Kubernetes and `ddp-run` send first), and the run's own time limit.
///
/// A signal only sets a flag here; the Trainer reads it between optimizer steps (and between
/// an epoch's evaluation batches), the ranks agree on it with one small all-reduce each (so
/// that all stop at the same place and none waits on a peer that has left), rank 0 writes a
/// checkpoint, and every rank ends with [`crate::TrainError::Stopped`], whose exit code is
/// [`EXIT_STOPPED`].
///
/// The handlers are ddp-run's ([`ddp_run::SignalWatch`]): installed once per process and
/// acting only while a Trainer runs; otherwise a signal whose disposition was the default
/// still ends the process as before, one that was ignored stays ignored, and an earlier
/// handler of the program still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop signal (its number) reached some rank.
    Signal(i32),
    /// The time limit would have been reached before the next chance to stop.
    TimeLimit,
}

impl StopReason {
    /// The number the ranks all-reduce (with max) to agree: 0 for none.
    pub(crate) fn code(reason: Option<Self>) -> i64 {
        match reason {
            None => 0,
            Some(Self::TimeLimit) => 1,
            Some(Self::Signal(s)) => 1 + i64::from(s),
        }
    }

    pub(crate) fn from_code(code: i64) -> Option<Self> {
        match code {
            c if c <= 0 => None,
            1 => Some(Self::TimeLimit),
            c => Some(Self::Signal((c - 1) as i32)),
        }
    }
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Signal(s) => write!(f, "{}", signal_name(*s)),
            Self::TimeLimit => f.write_str("time limit"),
        }
    }
}

fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGUSR1 => "SIGUSR1".into(),
        s => format!("signal {s}"),
    }
}

/// While it lives, stop signals are noticed instead of ending the process: ddp-run's watch
/// (the workspace's one signal registration) over [`STOP_SIGNALS`].
pub(crate) use ddp_run::SignalWatch;

/// Watches [`STOP_SIGNALS`] while a Trainer runs.
pub(crate) fn watch_stop_signals() -> Result<SignalWatch, String> {
    SignalWatch::start(&STOP_SIGNALS).map_err(|e| {
        let why = std::error::Error::source(&e).map_or_else(String::new, |s| format!(": {s}"));
        format!("{e}{why}")
    })
}

/// The stop-signal watch that [`crate::cli::run`] starts before a training program's body
/// runs (its task may take minutes to open the data), until a Trainer adopts it.
static BEFORE_TRAINER: std::sync::Mutex<Option<SignalWatch>> = std::sync::Mutex::new(None);

fn before_trainer() -> std::sync::MutexGuard<'static, Option<SignalWatch>> {
    BEFORE_TRAINER.lock().unwrap_or_else(|e| e.into_inner())
}

/// Watches [`STOP_SIGNALS`] from now until the process's next Trainer adopts the watch
/// ([`trainer_watch`]), so that a stop asked for meanwhile is taken at that Trainer's first
/// step. The guard ends the watch if no Trainer adopted it.
#[cfg(feature = "cli")]
pub(crate) fn watch_until_trainer() -> Result<UntilTrainer, String> {
    let watch = watch_stop_signals()?;
    if let Some(earlier) = before_trainer().replace(watch) {
        end_unadopted(earlier);
    }
    Ok(UntilTrainer(()))
}

/// Ends the watch of [`watch_until_trainer`] when dropped, unless a Trainer adopted it.
#[cfg(feature = "cli")]
pub(crate) struct UntilTrainer(());

#[cfg(feature = "cli")]
impl Drop for UntilTrainer {
    fn drop(&mut self) {
        let unadopted = before_trainer().take();
        if let Some(watch) = unadopted {
            end_unadopted(watch);
        }
    }
}

/// The stop-signal watch of a Trainer that watches the signals (`wanted`): the one
/// [`watch_until_trainer`] started, with what it noticed, else a new one. A Trainer that
/// does not watch them ends that watch.
pub(crate) fn trainer_watch(wanted: bool) -> Result<Option<SignalWatch>, String> {
    let earlier = before_trainer().take();
    match (wanted, earlier) {
        (true, Some(watch)) => Ok(Some(watch)),
        (true, None) => watch_stop_signals().map(Some),
        (false, earlier) => {
            if let Some(watch) = earlier {
                end_unadopted(watch);
            }
            Ok(None)
        }
    }
}

/// Ends `watch`, which no Trainer took: a stop signal it noticed takes, now, the action it
/// would have taken unwatched (by default, ending the process).
fn end_unadopted(watch: SignalWatch) {
    let received = watch.received();
    drop(watch);
    if let Some(signal) = received {
        // SAFETY: raise(3) takes a signal number and touches no memory of ours.
        unsafe { libc::raise(signal) };
    }
}

/// The time budget of a run: whether one more step or evaluation round (and what may follow
/// it) still fits.
#[derive(Debug)]
pub(crate) struct Budget {
    started: Instant,
    deadline: Option<Instant>,
    eval_batches: usize,
    steps: usize,
    longest_step: Duration,
    longest_save: Option<Duration>,
    save_guess: Duration,
    longest_eval: Option<Duration>,
    longest_eval_round: Duration,
}

impl Budget {
    /// A budget of `limit` from `started`. Until timed, evaluation is guessed to take
    /// `eval_batches` of the longest step, and a save to write `checkpoint_bytes` at
    /// 100 MB/s plus 0.2 s.
    pub(crate) fn new(
        started: Instant,
        limit: Option<Duration>,
        eval_batches: usize,
        checkpoint_bytes: u64,
    ) -> Self {
        Self {
            started,
            // A limit past the clock's range (Settings allows 10^9 s) is no deadline.
            deadline: limit.and_then(|l| started.checked_add(l)),
            eval_batches,
            steps: 0,
            longest_step: Duration::ZERO,
            longest_save: None,
            save_guess: Duration::from_millis(200)
                + Duration::from_secs_f64(checkpoint_bytes as f64 / 100e6),
            longest_eval: None,
            longest_eval_round: Duration::ZERO,
        }
    }

    /// Time since the budget's start.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub(crate) fn step_took(&mut self, d: Duration) {
        self.steps += 1;
        self.longest_step = self.longest_step.max(d);
    }

    pub(crate) fn save_took(&mut self, d: Duration) {
        self.longest_save = Some(self.longest_save.unwrap_or_default().max(d));
    }

    pub(crate) fn eval_took(&mut self, d: Duration) {
        self.longest_eval = Some(self.longest_eval.unwrap_or_default().max(d));
    }

    /// One round of an epoch's evaluation (the ranks' agreement and a batch) took `d`.
    pub(crate) fn eval_round_took(&mut self, d: Duration) {
        self.longest_eval_round = self.longest_eval_round.max(d);
    }

    /// Whether the run must stop now, before a step, to save within the limit: it stops when
    /// the longest step so far, then (before the epoch's end) evaluation and its checkpoint,
    /// then a stop checkpoint, would not fit twice in the time left (a loaded machine's steps
    /// vary; the limit is a hard one). It never stops before this process has taken a step: a start that stopped
    /// without progress would be started again forever.
    pub(crate) fn must_stop(&self, last_step_of_epoch: bool) -> bool {
        let save = self.save();
        let mut needed = self.longest_step + save;
        if last_step_of_epoch {
            let eval_guess = self.longest_step * self.eval_batches as u32;
            needed += self.longest_eval.unwrap_or(eval_guess) + save;
        }
        self.short_of(needed)
    }

    /// Whether an epoch's evaluation must stop now, before a round of batches, to save the
    /// epoch's end within the limit: when the longest round so far and a stop checkpoint
    /// would not fit twice in the time left. As [`Budget::must_stop`], never before this
    /// process has taken a step (a resumed run evaluating the epoch it stopped in).
    pub(crate) fn must_stop_evaluating(&self) -> bool {
        self.short_of(self.longest_eval_round + self.save())
    }

    /// The longest save so far, or the guess from the checkpoint's size.
    fn save(&self) -> Duration {
        self.longest_save.unwrap_or(self.save_guess)
    }

    /// Whether twice `needed` from now passes the deadline, once this process took a step.
    fn short_of(&self, needed: Duration) -> bool {
        let Some(deadline) = self.deadline else {
            return false;
        };
        self.steps > 0 && Instant::now() + needed * 2 >= deadline
    }
}

/// How far after the rank's clock a job's start may lie (a clock stepped back a little since
/// the launcher read it) before [`limit_started`] warns that it counts it as now.
const FUTURE_SLACK: Duration = Duration::from_secs(60);

/// Whether [`limit_started`] warned of a job's start in the future: once a process.
static WARNED_AHEAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// When a time limit (`limited`) counts from, by the monotonic clock: the earlier of this
/// process's start ([`process_started`], else now) and the job's, which ddp-run gives the
/// ranks of every attempt ([`ddp_run::job_started`]), so that a rank the launcher restarted
/// counts from the job's start, as the scheduler's limit does. Without a limit the job's
/// start is not read: the process's is only the start that a stop's message counts from.
///
/// An unreadable job start is an error naming `DDP_JOB_STARTED`; one in the future (the
/// wall clock stepped back since the launcher's start) counts as now, with a warning (once
/// a process) where it lies over a minute ahead.
pub(crate) fn limit_started(limited: bool) -> Result<Instant, String> {
    let own = process_started().unwrap_or_else(Instant::now);
    let job = || ddp_run::job_started().map_err(|e| format!("{e} (the time limit counts from it)"));
    let (at, ahead) = limit_start(limited, own, job, Instant::now(), SystemTime::now())?;
    if let Some(ahead) = ahead {
        if !WARNED_AHEAD.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                "{} lies {} s after this machine's clock (the clock was set back since the \
                 launcher started?): the time limit counts from this rank's start instead",
                ddp_run::env::DDP_JOB_STARTED,
                ahead.as_secs()
            );
        }
    }
    Ok(at)
}

/// [`limit_started`] with the job's start read by `job` (only when `limited`), at `now` on
/// the monotonic clock and `wall_now` on the wall clock; with how far over
/// [`FUTURE_SLACK`] a job's start after `wall_now` lay.
fn limit_start(
    limited: bool,
    own: Instant,
    job: impl FnOnce() -> Result<Option<SystemTime>, String>,
    now: Instant,
    wall_now: SystemTime,
) -> Result<(Instant, Option<Duration>), String> {
    if !limited {
        return Ok((own, None));
    }
    let job = job()?;
    let ahead = job
        .and_then(|job| job.duration_since(wall_now).ok())
        .filter(|&ahead| ahead > FUTURE_SLACK);
    Ok((earlier_start(own, job, now, wall_now)?, ahead))
}

/// The earlier of `own` and `job` (by the wall clock, which processes share) on the
/// monotonic clock that times the limit, whose `now` is the wall clock's `wall_now`; a `job`
/// after `wall_now` is `now`.
fn earlier_start(
    own: Instant,
    job: Option<SystemTime>,
    now: Instant,
    wall_now: SystemTime,
) -> Result<Instant, String> {
    let Some(job) = job else {
        return Ok(own);
    };
    let age = wall_now.duration_since(job).unwrap_or_default();
    let at = now.checked_sub(age).ok_or_else(|| {
        format!(
            "{} is {} s ago, before this machine's clock can count",
            ddp_run::env::DDP_JOB_STARTED,
            age.as_secs()
        )
    })?;
    Ok(at.min(own))
}

/// When this process started, by the monotonic clock: now less the process's age, which
/// Linux gives as the time since boot (`/proc/uptime`) less the process's start after boot
/// (`starttime`, the 22nd field of `/proc/self/stat`, in clock ticks). `None` where either
/// file cannot be read.
pub(crate) fn process_started() -> Option<Instant> {
    // Bytes: the kernel cuts the command name at 15 bytes, maybe inside a UTF-8 character.
    let stat = std::fs::read("/proc/self/stat").ok()?;
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks_per_sec = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    Instant::now().checked_sub(process_age(&stat, &uptime, ticks_per_sec)?)
}

/// A process's age from its `/proc/<pid>/stat` line and `/proc/uptime`, with
/// `ticks_per_sec` clock ticks a second.
fn process_age(stat: &[u8], uptime: &str, ticks_per_sec: libc::c_long) -> Option<Duration> {
    // The command name, in parentheses, may hold spaces, ')' and bytes that are not UTF-8:
    // the fields that follow are those after the last ')', from the 3rd (the state) on.
    let close = stat.iter().rposition(|&b| b == b')')?;
    let fields = std::str::from_utf8(&stat[close + 1..]).ok()?;
    let start_ticks: u64 = fields.split_whitespace().nth(22 - 3)?.parse().ok()?;
    let up: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    if ticks_per_sec <= 0 {
        return None;
    }
    let age = up - start_ticks as f64 / ticks_per_sec as f64;
    // Both count whole ticks: a process younger than one tick may come out below zero.
    Duration::try_from_secs_f64(age.max(0.0)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_survive_the_all_reduce_code() {
        for reason in [
            None,
            Some(StopReason::TimeLimit),
            Some(StopReason::Signal(libc::SIGTERM)),
            Some(StopReason::Signal(libc::SIGUSR1)),
        ] {
            assert_eq!(StopReason::from_code(StopReason::code(reason)), reason);
        }
        assert_eq!(StopReason::Signal(libc::SIGTERM).to_string(), "SIGTERM");
        assert_eq!(StopReason::TimeLimit.to_string(), "time limit");
    }

    /// A rank the launcher restarted 2 h into the job, with a limit of 1 h: counted from the
    /// job's start, the limit is past before it starts, so it stops at its first step.
    #[test]
    fn the_limit_counts_from_the_earlier_of_the_jobs_start_and_the_processs() {
        let (now, wall) = (Instant::now(), SystemTime::now());
        let own = now - Duration::from_secs(5);
        assert_eq!(earlier_start(own, None, now, wall), Ok(own));
        let job = wall - Duration::from_secs(7200);
        let from_job = earlier_start(own, Some(job), now, wall).unwrap();
        assert_eq!(now - from_job, Duration::from_secs(7200));
        // A job started after the process (a launcher that a rank's wrapper started).
        let later = wall - Duration::from_secs(1);
        assert_eq!(earlier_start(own, Some(later), now, wall), Ok(own));
        let mut budget = Budget::new(from_job, Some(Duration::from_secs(3600)), 0, 0);
        assert!(!budget.must_stop(false));
        budget.step_took(Duration::from_millis(1));
        assert!(budget.must_stop(false));
    }

    /// Without a time limit the job's start is not read, so an unreadable one fails only a
    /// run with a limit; one in the future (a clock set back since the launcher's start)
    /// counts as now, said when over a minute ahead.
    #[test]
    fn the_jobs_start_is_read_only_for_a_limit_and_a_future_one_is_now() {
        let (now, wall) = (Instant::now(), SystemTime::now());
        let own = now - Duration::from_secs(5);
        let unreadable = || Err("DDP_JOB_STARTED is `yesterday`".to_string());
        assert_eq!(
            limit_start(false, own, unreadable, now, wall),
            Ok((own, None))
        );
        assert_eq!(
            limit_start(true, own, unreadable, now, wall),
            Err("DDP_JOB_STARTED is `yesterday`".to_string())
        );
        let hours_ahead = || Ok(Some(wall + Duration::from_secs(3 * 3600)));
        assert_eq!(
            limit_start(true, own, hours_ahead, now, wall),
            Ok((own, Some(Duration::from_secs(3 * 3600))))
        );
        let a_little_ahead = || Ok(Some(wall + Duration::from_secs(30)));
        assert_eq!(
            limit_start(true, own, a_little_ahead, now, wall),
            Ok((own, None))
        );
        let before = || Ok(Some(wall - Duration::from_secs(600)));
        assert_eq!(
            limit_start(true, own, before, now, wall),
            Ok((now - Duration::from_secs(600), None))
        );
    }

    #[test]
    fn the_budget_keeps_room_for_a_step_and_a_save() {
        let now = Instant::now();
        let mut b = Budget::new(now, Some(Duration::from_secs(10)), 6, 0);
        // Not before a first step, however little time is left.
        assert!(!Budget::new(now, Some(Duration::from_millis(1)), 6, 0).must_stop(true));
        b.step_took(Duration::from_secs(1));
        b.save_took(Duration::from_secs(1));
        // 2 * (1 + 1) s fits in 10 s.
        assert!(!b.must_stop(false));
        // With evaluation (guessed: 6 batches of 1 s) and the epoch's checkpoint: 2 * 9 s.
        assert!(b.must_stop(true));
        // Once timed, evaluation counts as it took: 2 * (1 + 1 + 1 + 1) s fits.
        b.eval_took(Duration::from_secs(1));
        assert!(!b.must_stop(true));
        b.step_took(Duration::from_secs(7));
        assert!(b.must_stop(false));
        assert!(!Budget::new(now, None, 99, 0).must_stop(true));
        // Before a save has been timed, one is guessed from the checkpoint's size:
        // 0.2 s + 500 MB at 100 MB/s = 5.2 s, which with a 1 s step does not fit twice in 7 s.
        let mut b = Budget::new(now, Some(Duration::from_secs(7)), 0, 500_000_000);
        b.step_took(Duration::from_secs(1));
        assert!(b.must_stop(false));
    }

    #[test]
    fn an_evaluation_keeps_room_for_its_longest_round_and_a_save() {
        let now = Instant::now();
        let mut b = Budget::new(now, Some(Duration::from_secs(10)), 6, 0);
        b.eval_round_took(Duration::from_secs(4));
        // Not before this process has taken a step: a resumed run evaluates first.
        assert!(!b.must_stop_evaluating());
        b.step_took(Duration::from_millis(1));
        // 2 * (4 s + 0.2 s, the guessed save) fits in 10 s; 2 * (4 + 1.5) s does not.
        assert!(!b.must_stop_evaluating());
        b.save_took(Duration::from_millis(1500));
        assert!(b.must_stop_evaluating());
        // The longest round counts, not the last.
        let mut b = Budget::new(now, Some(Duration::from_secs(10)), 6, 0);
        b.step_took(Duration::from_millis(1));
        b.eval_round_took(Duration::from_secs(5));
        b.eval_round_took(Duration::from_secs(1));
        assert!(b.must_stop_evaluating());
        let mut b = Budget::new(now, None, 6, 0);
        b.step_took(Duration::from_secs(1));
        b.eval_round_took(Duration::from_secs(999));
        assert!(!b.must_stop_evaluating());
    }

    #[test]
    fn a_process_age_counts_its_stat_fields_after_the_last_parenthesis() {
        // starttime (field 22) is 1500 ticks, 15 s at 100 a second, after boot.
        let rest = "S 1 1234 1234 0 -1 4194560 1 0 0 0 2 3 0 0 20 0 1 0 1500 4096 200";
        let uptime = "40.25 70.00\n";
        for comm in ["sleep", "a b) c", "x) 7 8 (y", ")", "()"] {
            let stat = format!("1234 ({comm}) {rest} 18446744073709551615 1 1 0 0 0\n");
            assert_eq!(
                process_age(stat.as_bytes(), uptime, 100),
                Some(Duration::from_secs_f64(25.25)),
                "{stat}"
            );
        }
        // 250 ticks a second: 1500 ticks are 6 s.
        let stat = format!("9 (sh) {rest}\n");
        assert_eq!(
            process_age(stat.as_bytes(), uptime, 250),
            Some(Duration::from_secs_f64(34.25))
        );
        // A name the kernel cut at 15 bytes inside a UTF-8 character ("ddp-train-训练").
        let mut cut = b"77 (ddp-train-\xe8\xae\xad\xe7\xbb) ".to_vec();
        cut.extend_from_slice(rest.as_bytes());
        assert_eq!(
            process_age(&cut, uptime, 100),
            Some(Duration::from_secs_f64(25.25))
        );
        // Rounded to ticks, a process may look started after now: age 0.
        assert_eq!(
            process_age(stat.as_bytes(), "14.99 1.0", 100),
            Some(Duration::ZERO)
        );
        for (stat, uptime, ticks) in [
            ("9 sh S 1", uptime, 100),
            ("9 (sh) S 1 2", uptime, 100),
            (
                "9 (sh) S 1 1234 1234 0 -1 4194560 1 0 0 0 2 3 0 0 20 0 1 0 -5 1",
                uptime,
                100,
            ),
            (stat.as_str(), "", 100),
            (stat.as_str(), "up", 100),
            (stat.as_str(), uptime, 0),
        ] {
            assert_eq!(
                process_age(stat.as_bytes(), uptime, ticks),
                None,
                "{stat} / {uptime} / {ticks}"
            );
        }
    }

    /// The budget's start is this process's: before anything this test saw, by at least the
    /// time this test has been running.
    #[test]
    fn this_process_started_before_this_test() {
        let test_started = Instant::now();
        std::thread::sleep(Duration::from_millis(300));
        let started = process_started().expect("Linux has /proc/self/stat and /proc/uptime");
        // /proc counts in ticks of 10 ms: give 20 ms for their rounding.
        assert!(
            started <= test_started + Duration::from_millis(20),
            "started {:?} before the test",
            test_started.saturating_duration_since(started)
        );
        assert!(started.elapsed() >= Duration::from_millis(280));
    }

    /// A limit past the clock's range is no deadline, not a panic.
    #[test]
    fn a_limit_past_the_clocks_range_never_stops() {
        let mut b = Budget::new(Instant::now(), Some(Duration::from_secs(u64::MAX)), 6, 0);
        assert_eq!(b.deadline, None);
        b.step_took(Duration::from_secs(1));
        assert!(!b.must_stop(true));
    }
}
