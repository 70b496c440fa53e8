//! The `ddp-run` binary with real rank processes: small `sh` programs, so that every test runs
//! in seconds and needs no libtorch.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime};

use ddp_testkit::{procs, temp_dir, text, wait_bounded, wait_for};

const DDP_RUN: &str = env!("CARGO_BIN_EXE_ddp-run");
/// Bound on any one launcher run, so that a broken launcher fails the test instead of hanging.
const LIMIT: Duration = Duration::from_secs(120);

/// `ddp-run ARGS`, with stdout and stderr captured and signals at their defaults (a test
/// runner started in the background may ignore SIGINT, and the launcher keeps what it finds
/// ignored).
fn ddp_run(args: &[&str]) -> Command {
    let mut cmd = Command::new(DDP_RUN);
    cmd.args(args)
        .env_remove("OMP_NUM_THREADS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: signal(2) with SIG_DFL is async-signal-safe and allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            for sig in ddp_run::FORWARDED_SIGNALS {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    cmd
}

fn run(args: &[&str]) -> Output {
    wait_bounded(ddp_run(args).spawn().unwrap(), LIMIT)
}

/// `ddp-run --nproc-per-node 2 --log-dir LOGS ARGS`, not started.
fn two_ranks_command(logs: &Path, args: &[&str]) -> Command {
    let mut all = vec!["--nproc-per-node", "2", "--log-dir", logs.to_str().unwrap()];
    all.extend_from_slice(args);
    ddp_run(&all)
}

/// `ddp-run --nproc-per-node 2 --log-dir LOGS ARGS`, run to its end.
fn two_ranks(logs: &Path, args: &[&str]) -> Output {
    two_ranks_with(logs, &[], args)
}

/// [`two_ranks`], with the variables `env` set for the launcher.
fn two_ranks_with(logs: &Path, env: &[(&str, &OsStr)], args: &[&str]) -> Output {
    let mut cmd = two_ranks_command(logs, args);
    cmd.envs(env.iter().copied());
    wait_bounded(cmd.spawn().unwrap(), LIMIT)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The `NAME=value` lines of a rank's log, as a map.
fn env_in_log(log: &Path) -> BTreeMap<String, String> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn s(v: &str) -> String {
    v.to_string()
}

#[test]
fn every_rank_gets_torchruns_environment() {
    let dir = temp_dir("ddp-run-env");
    let logs = dir.path().join("logs");
    let out = two_ranks(&logs, &["--max-restarts", "3", "env"]);
    assert!(out.status.success(), "{}", text(&out));
    let envs: Vec<_> = (0..2)
        .map(|r| env_in_log(&logs.join(format!("rank-{r}.out"))))
        .collect();
    for (rank, env) in envs.iter().enumerate() {
        let expected = [
            ("RANK", rank.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("WORLD_SIZE", s("2")),
            ("LOCAL_WORLD_SIZE", s("2")),
            ("ROLE_WORLD_SIZE", s("2")),
            ("GROUP_RANK", s("0")),
            ("GROUP_WORLD_SIZE", s("1")),
            ("ROLE_NAME", s("default")),
            ("MASTER_ADDR", s("127.0.0.1")),
            ("TORCHELASTIC_RESTART_COUNT", s("0")),
            ("TORCHELASTIC_MAX_RESTARTS", s("3")),
            ("TORCHELASTIC_USE_AGENT_STORE", s("False")),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", s("1")),
            // torchrun's rule: one thread per rank when there are several and none is set.
            ("OMP_NUM_THREADS", s("1")),
        ];
        for (name, value) in expected {
            assert_eq!(env.get(name), Some(&value), "{name} of rank {rank}");
        }
    }
    // One rendezvous for the job: the same port and run id on both ranks.
    let port: u16 = envs[0]["MASTER_PORT"].parse().unwrap();
    assert!(port > 0);
    assert_eq!(envs[1]["MASTER_PORT"], envs[0]["MASTER_PORT"]);
    assert!(envs[0]["TORCHELASTIC_RUN_ID"].starts_with("ddp-run-"));
    assert_eq!(
        envs[1]["TORCHELASTIC_RUN_ID"],
        envs[0]["TORCHELASTIC_RUN_ID"]
    );
}

#[test]
fn a_set_omp_num_threads_is_passed_on() {
    let dir = temp_dir("ddp-run-omp");
    let logs = dir.path().join("logs");
    let out = two_ranks_with(&logs, &[("OMP_NUM_THREADS", OsStr::new("3"))], &["env"]);
    assert!(out.status.success(), "{}", text(&out));
    for r in 0..2 {
        let env = env_in_log(&logs.join(format!("rank-{r}.out")));
        assert_eq!(env["OMP_NUM_THREADS"], "3");
    }
}

/// Without a folder for the error files (the temporary folder does not exist), the launcher
/// says so and gives the ranks no `TORCHELASTIC_ERROR_FILE`, not its own, in which they would
/// overwrite one another's errors (and its own launcher's).
#[test]
fn without_a_folder_for_error_files_the_ranks_get_none() {
    let dir = temp_dir("ddp-run-no-error-folder");
    let (logs, outer) = (dir.path().join("logs"), dir.path().join("outer.json"));
    let script = r#"echo "file=${TORCHELASTIC_ERROR_FILE-none}"
                    if [ -n "$TORCHELASTIC_ERROR_FILE" ]; then echo "$RANK" > "$TORCHELASTIC_ERROR_FILE"; fi"#;
    let env = [
        ("TMPDIR", OsStr::new("/nonexistent")),
        ("TORCHELASTIC_ERROR_FILE", outer.as_os_str()),
    ];
    let out = two_ranks_with(&logs, &env, &["sh", "-c", script]);
    assert!(out.status.success(), "{}", text(&out));
    for r in 0..2 {
        let env = env_in_log(&logs.join(format!("rank-{r}.out")));
        assert_eq!(env["file"], "none", "rank {r}");
    }
    assert!(!outer.exists(), "a rank wrote the launcher's error file");
    let err = stderr(&out);
    assert!(
        err.contains(
            "ddp-run: cannot create a folder for the ranks' error files in /nonexistent (No \
             such file or directory (os error 2)): the ranks get no TORCHELASTIC_ERROR_FILE, \
             and a failure names the first rank killed by a signal the launcher did not send, \
             else the first rank to exit\n"
        ),
        "{err}"
    );
}

#[test]
fn a_second_node_numbers_its_ranks_after_the_first() {
    let dir = temp_dir("ddp-run-node");
    let logs = dir.path().join("logs");
    let out = run(&[
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--nproc_per_node=2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "29411",
        "--log-dir",
        logs.to_str().unwrap(),
        "--",
        "env",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    for (local, rank) in [(0, 2), (1, 3)] {
        let env = env_in_log(&logs.join(format!("rank-{rank}.out")));
        assert_eq!(env["RANK"], rank.to_string());
        assert_eq!(env["LOCAL_RANK"], local.to_string());
        assert_eq!(env["WORLD_SIZE"], "4");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(env["GROUP_RANK"], "1");
        assert_eq!(env["GROUP_WORLD_SIZE"], "2");
        assert_eq!(env["MASTER_PORT"], "29411");
        // Every node must agree on the run id without talking: torchrun's default.
        assert_eq!(env["TORCHELASTIC_RUN_ID"], "none");
    }
    assert!(!logs.join("rank-0.out").exists());
}

#[test]
fn output_reaches_the_terminal_with_rank_prefixes_and_the_logs() {
    let dir = temp_dir("ddp-run-output");
    let logs = dir.path().join("logs");
    // The second line names its rank itself, as ddp-train's step lines do: not twice.
    let program = "echo out $RANK; echo \"[rank $RANK] mine\"; echo err $RANK >&2";
    let out = two_ranks(&logs, &["sh", "-c", program]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort_unstable();
    assert_eq!(
        lines,
        ["[rank 0] mine", "[rank 1] mine", "[rank 1] out 1", "out 0"]
    );
    let err = stderr(&out);
    assert!(err.lines().any(|l| l == "err 0"), "{err}");
    assert!(err.lines().any(|l| l == "[rank 1] err 1"), "{err}");
    let log1 = std::fs::read_to_string(logs.join("rank-1.out")).unwrap();
    let mut log_lines: Vec<&str> = log1.lines().collect();
    log_lines.sort_unstable();
    assert_eq!(log_lines, ["[rank 1] mine", "err 1", "out 1"]);
}

/// A reader of the launcher's stderr that goes away (`ddp-run ... 2>&1 | head -1`) does not
/// end the launcher: its lines are lost, the job is not.
#[test]
fn a_closed_stderr_does_not_stop_the_launcher() {
    let mut cmd = ddp_run(&[
        "--nproc-per-node",
        "2",
        "sh",
        "-c",
        "sleep 0.5; seq 1 50 >&2",
    ]);
    let mut child = cmd.spawn().unwrap();
    drop(child.stderr.take());
    let out = wait_bounded(child, LIMIT);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

/// A rank program: rank 0 writes its pid and waits (reporting SIGTERM), rank 1 waits for
/// rank 0 and then does `fail`.
fn failing_job(dir: &Path, fail: &str) -> String {
    let pid0 = dir.join("pid0");
    format!(
        r#"if [ "$RANK" = 0 ]; then
             trap 'echo rank 0 got SIGTERM; exit 0' TERM
             echo $$ > {pid0}
             i=0; while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done
           else
             while [ ! -s {pid0} ]; do sleep 0.05; done
             echo rank 1 about to fail
             {fail}
           fi"#,
        pid0 = pid0.display()
    )
}

fn pid_in(path: &Path) -> u32 {
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn the_first_failure_ends_the_job_naming_the_rank() {
    let dir = temp_dir("ddp-run-fail");
    let logs = dir.path().join("logs");
    let script = failing_job(dir.path(), "exit 17");
    let out = two_ranks(&logs, &["sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = stderr(&out);
    let log1 = logs.join("rank-1.out");
    assert!(
        err.contains("ddp-run: rank 1 exited with code 17\n"),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "ddp-run: last lines of {}:\n    rank 1 about to fail\n",
            log1.display()
        )),
        "{err}"
    );
    // Rank 0 was asked to stop, and stopped.
    let log0 = std::fs::read_to_string(logs.join("rank-0.out")).unwrap();
    assert!(log0.contains("rank 0 got SIGTERM"), "{log0}");
    assert!(!procs::alive(pid_in(&dir.path().join("pid0"))));
}

/// Ranks that fail within one check of the launcher are told apart by when they exited: the
/// first is named, not the lowest. Each exits when the test says: rank 2 first, then rank 1
/// once the launcher's thread that waits for rank 2 has noted its exit and ended, so that
/// no delay can reorder the two.
#[test]
fn of_failures_one_check_finds_the_first_is_named() {
    let dir = temp_dir("ddp-run-first");
    let go = |rank: usize| dir.path().join(format!("go{rank}"));
    let script = format!(
        r#"case $RANK in
             2) while [ ! -e {go2} ]; do sleep 0.05; done; exit 17 ;;
             1) while [ ! -e {go1} ]; do sleep 0.05; done; exit 1 ;;
             *) i=0; while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done ;;
           esac"#,
        go2 = go(2).display(),
        go1 = go(1).display()
    );
    let args = ["--nproc-per-node", "3", "--monitor-interval", "3"];
    let child = ddp_run(&[&args[..], &["sh", "-c", &script]].concat())
        .spawn()
        .unwrap();
    let waiting_for_rank_2 = |launcher: u32| {
        let tasks = std::fs::read_dir(format!("/proc/{launcher}/task")).unwrap();
        tasks.flatten().any(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            comm == "ddp-run r2\n"
        })
    };
    let launcher = child.id();
    wait_for("the launcher waits for rank 2", LIMIT, || {
        waiting_for_rank_2(launcher)
    });
    std::fs::write(go(2), "").unwrap();
    wait_for("the launcher noted rank 2's exit", LIMIT, || {
        !waiting_for_rank_2(launcher)
    });
    std::fs::write(go(1), "").unwrap();
    let out = wait_bounded(child, LIMIT);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = stderr(&out);
    assert!(
        err.contains("ddp-run: rank 2 exited with code 17\n"),
        "{err}"
    );
    assert!(!err.contains("rank 1 exited"), "{err}");
}

#[test]
fn a_rank_killed_by_a_signal_is_named() {
    let dir = temp_dir("ddp-run-killed");
    let script = failing_job(dir.path(), "kill -9 $$");
    let out = run(&["--nproc-per-node", "2", "sh", "-c", &script]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = stderr(&out);
    assert!(
        err.contains(
            "ddp-run: rank 1 was killed by signal 9 (SIGKILL): the kernel's OOM killer or a \
             kill -9 (see dmesg)\n"
        ),
        "{err}"
    );
    // Without a log folder the tail still comes from memory.
    assert!(
        err.contains("ddp-run: last lines of rank 1:\n    rank 1 about to fail\n"),
        "{err}"
    );
}

#[test]
fn a_rank_that_ignores_sigterm_is_killed_after_the_shutdown_timeout() {
    let dir = temp_dir("ddp-run-stubborn");
    let pid0 = dir.path().join("pid0");
    let script = format!(
        r#"if [ "$RANK" = 0 ]; then
             trap '' TERM
             echo $$ > {pid0}
             i=0; while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done
           else
             while [ ! -s {pid0} ]; do sleep 0.05; done
             exit 4
           fi"#,
        pid0 = pid0.display()
    );
    let out = run(&[
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "1",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(stderr(&out).contains("rank 1 exited with code 4"));
    assert!(!procs::alive(pid_in(&pid0)));
}

/// What a rank that succeeded left running is not killed with it: torchrun signals only
/// workers still running, so a background writer finishes its file.
#[test]
fn what_a_finished_rank_left_running_is_left_to_finish() {
    let dir = temp_dir("ddp-run-leftover");
    let script = format!(
        r#"( trap '' TERM; sleep 1; echo done > {dir}/flag$RANK ) >/dev/null 2>&1 &
           exit 0"#,
        dir = dir.path().display()
    );
    let out = run(&["--nproc-per-node", "2", "sh", "-c", &script]);
    assert!(out.status.success(), "{}", text(&out));
    let flags = [dir.path().join("flag0"), dir.path().join("flag1")];
    wait_for("both background writers finished", LIMIT, || {
        flags
            .iter()
            .all(|f| std::fs::read_to_string(f).is_ok_and(|s| s == "done\n"))
    });
}

/// A job of two ranks that write their pids (`pid0`, `pid1`) and wait, reporting SIGINT and
/// SIGTERM. (Every waiting rank gives up after a few minutes, so that even a broken launcher
/// leaves no process behind for long.)
fn waiting_job(dir: &Path) -> String {
    format!(
        r#"trap 'echo rank $RANK got SIGINT; exit 3' INT
           trap 'echo rank $RANK got SIGTERM; exit 3' TERM
           echo $$ > {dir}/pid$RANK
           i=0; while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done"#,
        dir = dir.display()
    )
}

fn wait_for_pids(dir: &Path) -> Vec<u32> {
    let files = [dir.join("pid0"), dir.join("pid1")];
    wait_for("both ranks wrote their pid", LIMIT, || {
        files
            .iter()
            .all(|f| std::fs::read_to_string(f).is_ok_and(|s| s.ends_with('\n')))
    });
    files.iter().map(|f| pid_in(f)).collect()
}

/// Asserts that every rank (whose pids are `ranks`) logged `rank R got SIGNAL` in `logs`
/// and is gone.
fn assert_each_rank_got(logs: &Path, ranks: &[u32], signal: &str) {
    for (r, &pid) in ranks.iter().enumerate() {
        let log = std::fs::read_to_string(logs.join(format!("rank-{r}.out"))).unwrap();
        assert!(log.contains(&format!("rank {r} got {signal}")), "{log}");
        assert!(!procs::alive(pid));
    }
}

#[test]
fn sigterm_and_sigint_are_forwarded_to_every_rank() {
    for (signal, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let dir = temp_dir("ddp-run-forward");
        let logs = dir.path().join("logs");
        let script = waiting_job(dir.path());
        let child = two_ranks_command(&logs, &["sh", "-c", &script])
            .spawn()
            .unwrap();
        let launcher = child.id();
        let ranks = wait_for_pids(dir.path());
        ddp_testkit::kill(launcher, signal);
        let out = wait_bounded(child, LIMIT);
        // Ended by the signal itself, as the user asked: a shell loop stops too.
        assert_eq!(out.status.signal(), Some(signal), "{}", text(&out));
        assert!(
            stderr(&out).contains(&format!("ddp-run: interrupted by signal {signal}")),
            "{}",
            text(&out)
        );
        assert_each_rank_got(&logs, &ranks, name);
    }
}

/// The launcher acts on a signal at once, not at its next check of the ranks: with checks
/// ten minutes apart, a Ctrl-C still stops the job (within the 60 s that bound this test).
#[test]
fn a_signal_is_acted_on_between_the_checks_of_the_ranks() {
    let dir = temp_dir("ddp-run-prompt");
    let logs = dir.path().join("logs");
    let script = waiting_job(dir.path());
    let args = ["--monitor-interval", "600", "sh", "-c", &script];
    let child = two_ranks_command(&logs, &args).spawn().unwrap();
    let launcher = child.id();
    let ranks = wait_for_pids(dir.path());
    ddp_testkit::kill(launcher, libc::SIGINT);
    let out = wait_bounded(child, Duration::from_secs(60));
    assert_eq!(out.status.signal(), Some(libc::SIGINT), "{}", text(&out));
    assert_each_rank_got(&logs, &ranks, "SIGINT");
}

#[test]
fn sigusr1_reaches_every_rank_even_a_stopped_one_and_exit_75_ends_the_job_as_stopped() {
    let dir = temp_dir("ddp-run-usr1");
    let logs = dir.path().join("logs");
    // Each rank "checkpoints" on SIGUSR1 and exits 75; rank 1 is stopped (SIGSTOP) when the
    // signal comes, and can act on it only because the launcher continues it.
    let script = format!(
        r#"trap 'echo rank $RANK got SIGUSR1; exit 75' USR1
           echo $$ > {dir}/pid$RANK
           if [ "$RANK" = 1 ]; then kill -STOP $$; fi
           i=0; while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done"#,
        dir = dir.path().display()
    );
    let child = two_ranks_command(&logs, &["sh", "-c", &script])
        .spawn()
        .unwrap();
    let launcher = child.id();
    let ranks = wait_for_pids(dir.path());
    wait_for("rank 1 is stopped", LIMIT, || procs::stopped(ranks[1]));
    ddp_testkit::kill(launcher, libc::SIGUSR1);
    let out = wait_bounded(child, LIMIT);
    assert_stopped_after(&out, libc::SIGUSR1);
    assert_each_rank_got(&logs, &ranks, "SIGUSR1");
}

/// A forwarded SIGTERM that rank 0 answers with a checkpoint (75) while rank 1, with
/// nothing left to do, ends with 0: the job stopped, to be continued (75), as without a
/// signal.
/// Asserts that the launcher ended the job as stopped (75) after forwarding `signal`.
fn assert_stopped_after(out: &Output, signal: i32) {
    assert_eq!(out.status.code(), Some(75), "{}", text(out));
    assert!(
        stderr(out).contains(&format!(
            "ddp-run: the job stopped after signal {signal} at a checkpoint (exit code 75)"
        )),
        "{}",
        text(out)
    );
}

/// Two ranks that run `traps`, write their pids and wait, under `ddp-run --nproc-per-node 2
/// LAUNCHER_ARGS`, which gets SIGTERM once both are up; its output.
fn after_sigterm(dir: &Path, traps: &str, launcher_args: &[&str]) -> Output {
    let script = format!(
        r#"D={dir}
           {traps}
           echo $$ > {dir}/pid$RANK
           i=0; while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done"#,
        dir = dir.display()
    );
    let mut args = launcher_args.to_vec();
    args.extend(["sh", "-c", &script]);
    let child = two_ranks_command(&dir.join("logs"), &args).spawn().unwrap();
    let launcher = child.id();
    wait_for_pids(dir);
    ddp_testkit::kill(launcher, libc::SIGTERM);
    wait_bounded(child, LIMIT)
}

/// What the launcher says after a SIGTERM to two ranks that run `traps`, given `seconds` to
/// stop, which ends it by SIGTERM.
fn said_after_a_short_stop(traps: &str, seconds: &str) -> String {
    let dir = temp_dir("ddp-run-term-short");
    let out = after_sigterm(dir.path(), traps, &["--shutdown-timeout", seconds]);
    assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{}", text(&out));
    text(&out)
}

/// Ranks that take longer than the shutdown timeout to stop at their checkpoint are killed,
/// and the launcher says so, with what to raise, instead of a plain interruption.
#[test]
fn ranks_killed_in_the_middle_of_their_stop_are_named_with_the_timeout() {
    let said = said_after_a_short_stop("trap 'sleep 3; exit 75' TERM", "1");
    assert!(
        said.contains(
            "ddp-run: interrupted by signal 15; ranks 0-1 had not stopped 1 s after it (the \
             shutdown timeout) and were killed; a stop at a checkpoint needs more time: raise \
             --shutdown-timeout\n"
        ),
        "{said}"
    );
}

/// Ranks that fail the stop (exit 3) and leave a helper that ignores SIGTERM: the helpers
/// are killed at the timeout, and the ranks' own exits are reported, not hidden by it.
#[test]
fn ranks_that_failed_are_named_apart_from_what_they_left_running() {
    // The helper says when it ignores SIGTERM, and the rank goes on only then; the ranks
    // have 3 s to take their trap (the helpers are always waited out).
    let traps = "trap 'exit 3' TERM; (trap '' TERM; : > $D/helper$RANK; exec sleep 1000) &
        while [ ! -e $D/helper$RANK ]; do sleep 0.01; done";
    let said = said_after_a_short_stop(traps, "3");
    assert!(
        said.contains(
            "ddp-run: interrupted by signal 15; ranks 0-1 have ended, but what each started in \
             its process group had not stopped 3 s after it (the shutdown timeout) and was \
             killed; a stop at a checkpoint needs more time: raise --shutdown-timeout\n\
             ddp-run: rank 0 exited with code 3\n"
        ),
        "{said}"
    );
    assert!(
        said.contains("\nddp-run: rank 1 exited with code 3\n"),
        "{said}"
    );
}

/// A rank behind a wrapper (`sh -c 'prog; true'`): the wrapper dies of the forwarded SIGTERM
/// at once, and its program still gets the time to stop (torchrun kills only the processes
/// it started that are still running).
#[test]
fn a_wrappers_program_gets_the_time_to_stop_after_the_wrapper_died() {
    let dir = temp_dir("ddp-run-term-wrapped");
    let d = dir.path().display();
    let program = format!(
        r#"trap "sleep 1; touch {d}/done$RANK; exit 75" TERM
           echo $$ > {d}/pid$RANK
           while :; do sleep 0.1; done"#
    );
    let script = format!("sh -c '{program}'; true");
    let child = two_ranks_command(&dir.path().join("logs"), &["sh", "-c", &script])
        .spawn()
        .unwrap();
    let launcher = child.id();
    let programs = wait_for_pids(dir.path());
    ddp_testkit::kill(launcher, libc::SIGTERM);
    let out = wait_bounded(child, LIMIT);
    assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{}", text(&out));
    assert!(!stderr(&out).contains("killed"), "{}", text(&out));
    for (rank, pid) in programs.into_iter().enumerate() {
        assert!(
            dir.path().join(format!("done{rank}")).exists(),
            "{}",
            text(&out)
        );
        assert!(!procs::alive(pid));
    }
}

/// The same with the launcher as its pid namespace's first process (`docker run image
/// ddp-run ...`), to which the wrapper's program is orphaned: it reaps it, instead of
/// waiting out the shutdown timeout for a zombie to leave the rank's group.
#[test]
fn a_launcher_with_pid_1_reaps_a_wrappers_orphaned_program() {
    let unshare = match ddp_testkit::in_new_pid_namespace() {
        Ok(unshare) => unshare,
        Err(why) => return eprintln!("skipped: {why}"),
    };
    let dir = temp_dir("ddp-run-term-pid1");
    let d = dir.path().display();
    let program = format!(r#"trap "exit 75" TERM; touch {d}/up; while :; do sleep 0.1; done"#);
    let script = format!("sh -c '{program}'; true");
    let child = Command::new(unshare[0])
        .args(&unshare[1..])
        .args([DDP_RUN, "--nproc-per-node", "1", "--shutdown-timeout", "60"])
        .args(["sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the program is up", LIMIT, || {
        dir.path().join("up").exists()
    });
    let launcher = procs::children_of(child.id());
    assert_eq!(launcher.len(), 1);
    ddp_testkit::kill(launcher[0], libc::SIGTERM);
    let out = wait_bounded(child, LIMIT);
    // The signal's default action spares a pid namespace's first process: 128 + SIGTERM.
    assert_eq!(out.status.code(), Some(143), "{}", text(&out));
    assert!(!stderr(&out).contains("killed"), "{}", text(&out));
}

/// A Ctrl-C reaches a helper that a rank's shell started in the background (`helper &`)
/// only as SIGINT, which a non-interactive shell's background jobs ignore: once the rank's
/// own process has ended, the helper gets SIGTERM, and the launcher does not wait out the
/// shutdown timeout for it.
#[test]
fn a_ctrl_c_ends_a_ranks_background_helper_too() {
    let dir = temp_dir("ddp-run-int-helper");
    let d = dir.path().display();
    let script = format!("sleep 1000 & echo $! > {d}/helper; echo $$ > {d}/pid; exec sleep 1000");
    let args = ["--nproc-per-node", "1", "--shutdown-timeout", "60"];
    let child = ddp_run(&[&args[..], &["sh", "-c", &script]].concat())
        .spawn()
        .unwrap();
    let launcher = child.id();
    let [rank, helper] = ["pid", "helper"].map(|f| pid_written_to(&dir.path().join(f)));
    assert_eq!(procs::group(rank).len(), 2);
    ddp_testkit::kill(launcher, libc::SIGINT);
    assert_all_stopped_after(&wait_bounded(child, LIMIT), libc::SIGINT);
    assert!(!procs::alive(helper));
}

/// The pid written to `file`, once written whole.
fn pid_written_to(file: &Path) -> u32 {
    wait_for("the rank wrote a pid", LIMIT, || {
        std::fs::read_to_string(file).is_ok_and(|s| s.ends_with('\n'))
    });
    pid_in(file)
}

/// A scheduler may deliver SIGTERM twice within milliseconds (SLURM does), and bash sends
/// SIGHUP to its jobs after the terminal's: a repeat of the signal that began the stop is no
/// second Ctrl-C, and the ranks keep their time to stop at a checkpoint.
#[test]
fn a_repeat_of_the_signal_at_once_leaves_the_ranks_their_time_to_stop() {
    let dir = temp_dir("ddp-run-term-repeat");
    let d = dir.path().display();
    // Each rank notes the signal, then takes a second to write its checkpoint: time for the
    // launcher, which looks for signals every 20 ms, to see the repeat.
    let script = format!(
        r#"trap 'touch {d}/term$RANK; sleep 1; exit 75' TERM
           echo $$ > {d}/pid$RANK
           i=0; while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done"#
    );
    let child = two_ranks_command(&dir.path().join("logs"), &["sh", "-c", &script])
        .spawn()
        .unwrap();
    let launcher = child.id();
    wait_for_pids(dir.path());
    ddp_testkit::kill(launcher, libc::SIGTERM);
    let first = Instant::now();
    // The repeat arrives while the launcher stops the ranks: once they got the first.
    wait_for("both ranks got SIGTERM", LIMIT, || {
        (0..2).all(|r| dir.path().join(format!("term{r}")).exists())
    });
    ddp_testkit::kill(launcher, libc::SIGTERM);
    let gap = first.elapsed();
    let out = wait_bounded(child, LIMIT);
    if gap >= Duration::from_millis(500) {
        return eprintln!(
            "skipped: the repeat came {gap:?} after the first signal, too late on this \
             machine now to be told from a second signal (1 s)"
        );
    }
    assert_stopped_after(&out, libc::SIGTERM);
}

/// The same signal again a second or more after the first is the user's: the ranks, which
/// would take the whole shutdown timeout, are killed at once.
#[test]
fn the_same_signal_again_later_kills_the_ranks_at_once() {
    let dir = temp_dir("ddp-run-term-again");
    let d = dir.path().display();
    let script = format!(
        r#"trap 'touch {d}/term$RANK' TERM
           echo $$ > {d}/pid$RANK
           i=0; while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done"#
    );
    let args = ["--shutdown-timeout", "100", "sh", "-c", &script];
    let child = two_ranks_command(&dir.path().join("logs"), &args)
        .spawn()
        .unwrap();
    let launcher = child.id();
    wait_for_pids(dir.path());
    ddp_testkit::kill(launcher, libc::SIGTERM);
    wait_for("both ranks got SIGTERM", LIMIT, || {
        (0..2).all(|r| dir.path().join(format!("term{r}")).exists())
    });
    // Past the second in which a repeat is taken for the same request.
    std::thread::sleep(Duration::from_millis(1500));
    ddp_testkit::kill(launcher, libc::SIGTERM);
    let out = wait_bounded(child, LIMIT);
    assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{}", text(&out));
    let said = "ddp-run: interrupted by signal 15; ranks 0-1 were killed at a second signal\n";
    assert!(stderr(&out).contains(said), "{}", text(&out));
}

/// A signal while the failed last attempt is being stopped ends the job as interrupted, not
/// as failed: the launcher's end tells that the user stopped it.
#[test]
fn a_signal_during_the_stop_of_the_last_attempt_interrupts_the_job() {
    let dir = temp_dir("ddp-run-term-last");
    let d = dir.path().display();
    // Rank 1 notes the stop's SIGTERM and goes on (the stop would last the shutdown
    // timeout); rank 0 fails once rank 1 is up.
    let script = format!(
        r#"if [ "$RANK" = 0 ]; then
             while [ ! -e {d}/ready ]; do sleep 0.05; done
             exit 1
           fi
           trap 'touch {d}/termed' TERM
           touch {d}/ready
           i=0; while [ $i -lt 2400 ]; do sleep 0.05; i=$((i+1)); done"#
    );
    let args = ["--shutdown-timeout", "100", "sh", "-c", &script];
    let child = two_ranks_command(&dir.path().join("logs"), &args)
        .spawn()
        .unwrap();
    wait_for("rank 1 got the stop's SIGTERM", LIMIT, || {
        dir.path().join("termed").exists()
    });
    ddp_testkit::kill(child.id(), libc::SIGTERM);
    let out = wait_bounded(child, LIMIT);
    assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{}", text(&out));
    let said = "ddp-run: interrupted by signal 15 after rank 0 failed; rank 1 was killed at the \
                signal\n";
    assert!(stderr(&out).contains(said), "{}", text(&out));
}

/// A launcher started with SIGCHLD ignored (a parent's `SIG_IGN` survives exec) would have
/// its ranks reaped by the kernel as they exit, and could see none of their exits: it sets
/// SIGCHLD back to its default before it starts them.
#[test]
fn a_launcher_started_with_sigchld_ignored_sees_how_its_ranks_end() {
    for (script, status, said) in [
        ("exit 0", 0, "ddp-run: all 2 rank(s) finished\n"),
        (
            "exit $((RANK * 3))",
            1,
            "ddp-run: rank 1 exited with code 3\n",
        ),
    ] {
        let dir = temp_dir("ddp-run-sigchld");
        let mut launcher = two_ranks_command(&dir.path().join("logs"), &["sh", "-c", script]);
        // SAFETY: signal(2) is async-signal-safe and allocates nothing.
        unsafe {
            launcher.pre_exec(|| {
                libc::signal(libc::SIGCHLD, libc::SIG_IGN);
                Ok(())
            });
        }
        let out = wait_bounded(launcher.spawn().unwrap(), LIMIT);
        assert_eq!(out.status.code(), Some(status), "{script}: {}", text(&out));
        assert!(stderr(&out).contains(said), "{script}: {}", text(&out));
    }
}

/// `--nproc-per-node gpu` asks nvidia-smi before any rank starts: with SIGCHLD ignored its
/// exit cannot be waited for, and its listing still counts (a fake nvidia-smi lists two).
#[test]
fn gpus_are_counted_with_sigchld_ignored() {
    let dir = temp_dir("ddp-run-sigchld-gpus");
    let tools = dir.path().join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    ddp_testkit::script(
        &tools.join("nvidia-smi"),
        "#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\necho 'GPU 1: Fake GPU (UUID: GPU-1)'\n",
    );
    let path = format!(
        "{}:{}",
        tools.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let logs = dir.path().join("logs");
    let mut launcher = ddp_run(&[
        "--nproc-per-node",
        "gpu",
        "--log-dir",
        logs.to_str().unwrap(),
        "sh",
        "-c",
        "exit 0",
    ]);
    launcher
        .env("PATH", path)
        .env_remove("CUDA_VISIBLE_DEVICES");
    // SAFETY: signal(2) is async-signal-safe and allocates nothing.
    unsafe {
        launcher.pre_exec(|| {
            libc::signal(libc::SIGCHLD, libc::SIG_IGN);
            Ok(())
        });
    }
    let out = wait_bounded(launcher.spawn().unwrap(), LIMIT);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        stderr(&out).contains("ddp-run: all 2 rank(s) finished\n"),
        "{}",
        text(&out)
    );
}

/// Asserts that the launcher got `signal`, and every rank and what it started then stopped.
fn assert_all_stopped_after(out: &Output, signal: i32) {
    assert_eq!(out.status.signal(), Some(signal), "{}", text(out));
    let said = format!("ddp-run: interrupted by signal {signal}; all ranks stopped\n");
    assert!(stderr(out).contains(&said), "{}", text(out));
}

/// Set in a child of this test binary: run `ddp-run` with these arguments (one a line) as a
/// subreaper that never reaps the orphans it adopts, as a container's entrypoint that is
/// no init.
const AS_SUBREAPER: &str = "DDP_RUN_TEST_SUBREAPER";

#[test]
#[ignore = "run by a_zombie_in_a_ranks_group_does_not_delay_the_stop as a child process"]
fn subreaper_body() {
    let Ok(args) = std::env::var(AS_SUBREAPER) else {
        return;
    };
    // SAFETY: prctl(2) with an integer argument; no memory is involved.
    assert_eq!(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) }, 0);
    let args: Vec<&str> = args.lines().collect();
    let mut launcher = ddp_run(&args);
    launcher.stdout(Stdio::inherit()).stderr(Stdio::inherit());
    // `wait` waits for this one child only.
    let status = launcher.status().unwrap();
    if let Some(signal) = status.signal() {
        // Ends as the launcher did, by its signal.
        // SAFETY: signal(2) with SIG_DFL and raise(3), on this process.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        }
    }
    std::process::exit(status.code().unwrap_or(1));
}

/// A rank whose program never waits for a child that has exited leaves a zombie in its
/// group, which its new parent may never reap: the stop does not wait for it.
#[test]
fn a_zombie_in_a_ranks_group_does_not_delay_the_stop() {
    let dir = temp_dir("ddp-run-term-zombie");
    let pid = dir.path().join("pid");
    // The child exits only once its parent is `sleep`, which never reaps it (or once the
    // parent is gone): a child that exited at once could be reaped by `sh` before its
    // `exec`, leaving no zombie.
    let script = format!(
        "(while c=$(cat /proc/$$/comm 2>/dev/null) && [ \"$c\" != sleep ]; \
         do sleep 0.01; done) & echo $$ > {}; exec sleep 1000",
        pid.display()
    );
    let args = ["--nproc-per-node", "1", "--shutdown-timeout", "60"];
    let subreaper = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "subreaper_body",
            "--include-ignored",
            "--nocapture",
        ])
        .env(
            AS_SUBREAPER,
            [&args[..], &["sh", "-c", &script]].concat().join("\n"),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let rank = pid_written_to(&pid);
    // The rank and its child, a zombie: the child's own children (its `cat`, its `sleep`)
    // are zombies for a moment too, while it still runs.
    wait_for("the rank's child is a zombie", LIMIT, || {
        let group = procs::group(rank);
        group.len() == 2 && group.iter().any(|(_, state)| state == "Z")
    });
    let launcher = procs::children_of(subreaper.id());
    assert_eq!(launcher.len(), 1);
    ddp_testkit::kill(launcher[0], libc::SIGTERM);
    assert_all_stopped_after(&wait_bounded(subreaper, LIMIT), libc::SIGTERM);
    assert!(!procs::alive(rank));
}

#[test]
fn a_signal_that_some_ranks_answer_with_75_and_the_others_with_0_ends_as_stopped() {
    let dir = temp_dir("ddp-run-term-mixed");
    let traps = r#"if [ "$RANK" = 0 ]; then trap 'exit 75' TERM; else trap 'exit 0' TERM; fi"#;
    let out = after_sigterm(dir.path(), traps, &[]);
    assert_stopped_after(&out, libc::SIGTERM);
}

/// The folders of error files in `tmp`.
fn error_folders(tmp: &Path) -> Vec<String> {
    let names = std::fs::read_dir(tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name());
    let names = names.map(|n| n.into_string().unwrap());
    names.filter(|n| n.starts_with("ddp-run-")).collect()
}

/// The launcher's error folder, which it cannot remove, goes with the next launch (in the
/// test's temporary folder, so that the suite leaves none behind).
#[test]
fn killing_the_launcher_with_sigkill_takes_the_ranks_with_it() {
    let dir = temp_dir("ddp-run-orphans");
    let script = waiting_job(dir.path());
    let mut child = ddp_run(&["--nproc-per-node", "2", "sh", "-c", &script])
        .env("TMPDIR", dir.path())
        .spawn()
        .unwrap();
    let ranks = wait_for_pids(dir.path());
    assert_eq!(procs::children_of(child.id()), {
        let mut r = ranks.clone();
        r.sort_unstable();
        r
    });
    ddp_testkit::kill(child.id(), libc::SIGKILL);
    assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
    wait_for(
        "no rank outlives the launcher",
        Duration::from_secs(30),
        || ranks.iter().all(|&p| !procs::alive(p)),
    );
    // `ddp-run-<host>-<pid>-<hex>`.
    let left = error_folders(dir.path());
    let pid = format!("-{}-", child.id());
    assert!(left.len() == 1 && left[0].contains(&pid), "{left:?}");
    let mut next = ddp_run(&["--nproc-per-node", "1", "true"]);
    let next = next.env("TMPDIR", dir.path()).spawn().unwrap();
    assert!(wait_bounded(next, LIMIT).status.success());
    assert_eq!(error_folders(dir.path()), Vec::<String>::new());
}

#[test]
fn restarts_rerun_the_whole_group_with_a_raised_restart_count() {
    let dir = temp_dir("ddp-run-restart");
    let logs = dir.path().join("logs");
    // Attempts 0 and 1 fail on rank 1 (rank 0 waits to be stopped); attempt 2 succeeds.
    let script = r#"echo attempt $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS
        echo job started $DDP_JOB_STARTED
        if [ "$TORCHELASTIC_RESTART_COUNT" != 2 ]; then
          if [ "$RANK" = 1 ]; then exit 3; fi
          sleep 30
        fi"#;
    let before = unix_seconds(SystemTime::now());
    let out = two_ranks(&logs, &["--max-restarts", "2", "sh", "-c", script]);
    let after = unix_seconds(SystemTime::now());
    assert!(out.status.success(), "{}", text(&out));
    let err = stderr(&out);
    let events: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("ddp-run: ") && !l.contains("last lines"))
        .map(|l| l.split(", rendezvous").next().unwrap())
        .collect();
    assert_eq!(
        events,
        [
            "ddp-run: OMP_NUM_THREADS=1 for each rank, so that 2 ranks do not overload the \
             cores; set OMP_NUM_THREADS to choose another number",
            "ddp-run: starting ranks 0-1 of 2",
            "ddp-run: rank 1 exited with code 3",
            "ddp-run: restart 1/2 of the whole group",
            "ddp-run: restarting ranks 0-1 of 2",
            "ddp-run: rank 1 exited with code 3",
            "ddp-run: restart 2/2 of the whole group",
            "ddp-run: restarting ranks 0-1 of 2",
            "ddp-run: all 2 rank(s) finished after 2 restart(s)",
        ]
    );
    // Each rank's log holds every attempt, in order.
    let log0 = std::fs::read_to_string(logs.join("rank-0.out")).unwrap();
    assert_eq!(
        log0.lines().step_by(2).collect::<Vec<_>>(),
        ["attempt 0 of 2", "attempt 1 of 2", "attempt 2 of 2"]
    );
    // Every rank of every attempt counts its time limit from the launcher's start.
    let log1 = std::fs::read_to_string(logs.join("rank-1.out")).unwrap();
    let started: Vec<&str> = [&log0, &log1]
        .into_iter()
        .flat_map(|log| log.lines().filter_map(|l| l.strip_prefix("job started ")))
        .collect();
    assert_eq!(started.len(), 6, "{started:?}");
    assert!(started.iter().all(|s| *s == started[0]), "{started:?}");
    let job: f64 = started[0].parse().unwrap();
    assert!(before <= job && job <= after, "{before} {job} {after}");
}

fn unix_seconds(at: SystemTime) -> f64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[test]
fn the_launcher_gives_up_after_its_restarts() {
    let out = run(&["--max-restarts", "1", "sh", "-c", "exit 5"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let err = stderr(&out);
    assert_eq!(
        err.matches("ddp-run: rank 0 exited with code 5").count(),
        2,
        "{err}"
    );
    assert!(
        err.ends_with("ddp-run: giving up after 1 restart(s)\n"),
        "{err}"
    );
}

#[test]
fn a_missing_program_is_one_line_without_a_backtrace() {
    let out = wait_bounded(
        ddp_run(&["--nproc-per-node", "2", "/nonexistent/ddp-run-test-program"])
            .env("RUST_BACKTRACE", "1")
            .spawn()
            .unwrap(),
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert_eq!(
        err.lines().last(),
        Some(
            "error: cannot start rank 0: `/nonexistent/ddp-run-test-program`: No such file or \
             directory (os error 2)"
        ),
        "{err}"
    );
    assert!(!err.contains("backtrace"), "{err}");
}

/// torchrun's habits: `torchrun train.py` runs `python train.py`; ddp-run runs the program
/// itself and says what to give instead.
#[test]
fn a_script_named_as_torchrun_takes_it_gets_what_to_give_instead() {
    let dir = temp_dir("ddp-run-script");
    std::fs::write(dir.path().join("train.py"), "print('hello')\n").unwrap();
    std::fs::write(dir.path().join("train.sh"), "#!/bin/sh\necho hello\n").unwrap();
    let python = "(ddp-run runs the program itself, where torchrun adds `python -u` unless \
                  --no-python)";
    let cases = [
        (
            "train.py",
            format!("a Python script of the current folder; give `python -u train.py` {python}"),
        ),
        (
            "./train.py",
            format!("a Python script that is not executable; give `python -u ./train.py` {python}"),
        ),
        (
            "train.sh",
            "a file of the current folder, which a name without `/` does not reach (it is \
             looked up in PATH); give `./train.sh`"
                .to_string(),
        ),
    ];
    for (program, hint) in cases {
        let mut cmd = ddp_run(&["--nproc-per-node", "2", program]);
        let out = wait_bounded(cmd.current_dir(dir.path()).spawn().unwrap(), LIMIT);
        assert_eq!(out.status.code(), Some(1), "{program}");
        let err = stderr(&out);
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.starts_with(&format!(
                "error: cannot start rank 0: `{program}`, {hint}: "
            )),
            "{program}: {err}"
        );
    }
}

#[test]
fn bad_command_lines_say_what_is_wrong() {
    let cases: [(&[&str], i32, &str); 15] = [
        (
            &["--nproc-per-node", "0", "true"],
            2,
            "error: the number of ranks per node (--nproc-per-node) must be at least 1",
        ),
        (
            &["--nnodes", "2", "--node-rank", "2", "true"],
            2,
            "error: --node-rank 2 must be below --nnodes 2 (nodes are numbered from 0)",
        ),
        (
            &["--standalone", "--nnodes", "2", "true"],
            2,
            "error: --standalone runs a single node; it cannot be combined with --nnodes 2",
        ),
        (
            &["--nnodes", "1:4", "true"],
            2,
            "a range of nodes needs elastic membership, which ddp-run does not have",
        ),
        (
            &["--nproc-per-node", "many", "true"],
            2,
            "'many' is not a number of ranks, nor one of `gpu`, `cpu`, `auto`",
        ),
        (
            &["--nproc-per-node", "2"],
            2,
            "required arguments were not provided",
        ),
        // Waits past 10^9 s would not fit in a deadline.
        (
            &["--shutdown-timeout", "1000000001", "true"],
            2,
            "error: invalid value '1000000001' for '--shutdown-timeout <SECONDS>': over the \
             limit of 1000000000 seconds (about 31 years)",
        ),
        (
            &["--monitor-interval", "1e20", "true"],
            2,
            "error: invalid value '1e20' for '--monitor-interval <SECONDS>': over the limit of \
             1000000000 seconds (about 31 years)",
        ),
        // Under 1 ns rounds to no wait: the launcher would spin a core checking the ranks.
        (
            &["--monitor-interval", "1e-10", "true"],
            2,
            "error: invalid value '1e-10' for '--monitor-interval <SECONDS>': '1e-10' is not a \
             positive number of seconds once rounded to nanoseconds",
        ),
        (
            &["--master-port", "0", "true"],
            2,
            "error: --master-port 0 is not a port the other ranks can reach",
        ),
        // torchrun's options that ddp-run does not have: refused with what to give instead,
        // not started as the program.
        (
            &["--nproc-per-node", "2", "-m", "pkg.train"],
            2,
            "error: ddp-run has no option '-m': ddp-run starts programs, not Python modules: \
             give the interpreter, `ddp-run [OPTIONS] python -m MODULE [ARGS]`",
        ),
        (
            &[
                "--rdzv_backend=c10d",
                "--rdzv-endpoint",
                "node0:29400",
                "train",
            ],
            2,
            "error: --rdzv-backend c10d: ddp-run has torchrun's static rendezvous only",
        ),
        (
            &["--rdzv-endpoint", "node0", "train"],
            2,
            "error: --rdzv-endpoint node0: expected HOST:PORT, rank 0's host and a port \
             1..=65535 (torchrun's static rendezvous needs the port too)",
        ),
        (
            &["--rdzv-conf", "timeout=60", "train"],
            2,
            "error: ddp-run has no option '--rdzv-conf': ddp-run has torchrun's static \
             rendezvous only",
        ),
        (
            &["--tee", "3", "train"],
            2,
            "--log-dir DIR keeps each rank's in DIR/rank-<RANK>.out",
        ),
    ];
    for (args, code, message) in cases {
        let out = wait_bounded(
            ddp_run(args)
                .env("RUST_BACKTRACE", "1")
                .env_remove("PET_RDZV_BACKEND")
                .spawn()
                .unwrap(),
            LIMIT,
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(!err.contains("backtrace"), "{args:?}: {err}");
    }
}

/// torchrun's options come from `PET_*` variables too (as Kubeflow's elastic jobs set them):
/// an elastic rendezvous is refused there as on the command line, unless the command line
/// gives the backend; `static` is ddp-run's own.
#[test]
fn an_elastic_rendezvous_from_pet_variables_is_refused() {
    let out = wait_bounded(
        ddp_run(&["--nproc-per-node", "1", "true"])
            .env("PET_RDZV_BACKEND", "c10d")
            .spawn()
            .unwrap(),
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with(
            "error: PET_RDZV_BACKEND=c10d asks for torchrun's --rdzv-backend: ddp-run has \
             torchrun's static rendezvous only: rank 0 of node 0 at --master-addr and \
             --master-port (or --rdzv-endpoint HOST:PORT), each node with its own \
             --node-rank (unset PET_RDZV_BACKEND)"
        ),
        "{}",
        stderr(&out)
    );
    let out = wait_bounded(
        ddp_run(&["--nproc-per-node", "1", "true"])
            .env("PET_RDZV_BACKEND", "static")
            .spawn()
            .unwrap(),
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // A typed backend wins over the variable, as a typed flag does in torchrun; the elastic
    // rendezvous's settings are then ignored, and said to be.
    let out = wait_bounded(
        ddp_run(&["--rdzv-backend", "static", "true"])
            .env("PET_RDZV_BACKEND", "c10d")
            .env("PET_RDZV_CONF", "join_timeout=900")
            .spawn()
            .unwrap(),
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).starts_with(
            "ddp-run: warning: PET_RDZV_CONF=join_timeout=900 ignored: --rdzv-backend static \
             takes no settings\n"
        ),
        "{}",
        stderr(&out)
    );
}

/// A run id refused names `PET_RDZV_ID` where it came from that variable, `--rdzv-id` where
/// it came from the flag.
#[test]
fn a_refused_run_id_names_where_it_came_from() {
    let long = "j".repeat(300);
    let refused = |args: &[&str], pet: Option<&str>| {
        let mut command = ddp_run(args);
        command.env_remove("PET_RDZV_ID");
        if let Some(value) = pet {
            command.env("PET_RDZV_ID", value);
        }
        let out = wait_bounded(command.spawn().unwrap(), LIMIT);
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        stderr(&out).lines().next().unwrap_or_default().to_string()
    };
    assert_eq!(
        refused(&["--nproc-per-node", "1", "true"], Some(&long)),
        "error: PET_RDZV_ID is 300 bytes long: give at most 256"
    );
    assert!(
        refused(&["--nproc-per-node", "1", "true"], Some(" ")).starts_with(
            "error: PET_RDZV_ID \" \" is blank (an unset variable?), which the ranks would take \
             for no run id"
        ),
    );
    assert_eq!(
        refused(&["--nproc-per-node", "1", "--rdzv-id", &long, "true"], None),
        "error: --rdzv-id is 300 bytes long: give at most 256"
    );
}

/// Without `--shutdown-timeout`, torchrun's `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` gives it: a
/// value that is no number, or too large, is refused naming the variable; the flag wins
/// over it.
#[test]
fn the_shutdown_timeout_falls_back_on_torchruns_variable() {
    let with = |value: &str, args: &[&str]| {
        wait_bounded(
            ddp_run(args)
                .env("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", value)
                .spawn()
                .unwrap(),
            LIMIT,
        )
    };
    let out = with("soon", &["true"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        stderr(&out).starts_with(
            "error: TORCH_ELASTIC_SHUTDOWN_TIMEOUT=soon is not a whole number of seconds"
        ),
        "{}",
        stderr(&out)
    );
    let out = with("18446744073709551615", &["true"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        stderr(&out).starts_with(
            "error: TORCH_ELASTIC_SHUTDOWN_TIMEOUT=18446744073709551615 is over the limit of \
             1000000000 seconds (about 31 years)"
        ),
        "{}",
        stderr(&out)
    );
    let out = with("soon", &["--shutdown-timeout", "3", "true"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = with(" 7 ", &["true"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// torchrun's IPv6 form of `--master-addr`, `[::1]`, reaches the ranks without its
/// brackets, as torchrun passes it: no resolver takes the bracketed form.
#[test]
fn an_ipv6_master_addr_in_brackets_reaches_the_ranks_without_them() {
    for (args, var) in [
        (&["--master-addr", "[::1]"][..], None),
        (&[][..], Some("[::1]")),
    ] {
        let script = r#"test "$MASTER_ADDR" = ::1 || { echo "MASTER_ADDR=$MASTER_ADDR"; exit 1; }"#;
        let mut cmd = ddp_run(&[args, &["--nproc-per-node", "2", "sh", "-c", script]].concat());
        if let Some(value) = var {
            cmd.env("PET_MASTER_ADDR", value);
        }
        let out = wait_bounded(cmd.spawn().unwrap(), LIMIT);
        assert!(out.status.success(), "{args:?} {var:?}: {}", text(&out));
    }
}

/// torchrun's static backend (its default) with an endpoint: rank 0's host and port, from
/// the flags or from `PET_*` variables.
#[test]
fn the_static_backends_endpoint_is_where_rank_0_listens() {
    let port = ddp_testkit::free_port().to_string();
    let endpoint = format!("127.0.0.1:{port}");
    let script = r#"echo "at $MASTER_ADDR:$MASTER_PORT rank $RANK""#;
    let flags = ["--rdzv-backend", "static", "--rdzv-endpoint", &endpoint];
    let out = run(&[&flags[..], &["--nproc-per-node", "2", "sh", "-c", script]].concat());
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.lines().any(|l| l == format!("at {endpoint} rank 0")),
        "{stdout}"
    );
    assert!(
        stdout
            .lines()
            .any(|l| l == format!("[rank 1] at {endpoint} rank 1")),
        "{stdout}"
    );
    let out = wait_bounded(
        ddp_run(&["--nproc-per-node", "1", "sh", "-c", script])
            .env("PET_RDZV_ENDPOINT", format!("[::1]:{port}"))
            .spawn()
            .unwrap(),
        LIMIT,
    );
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("at ::1:{port} rank 0")
    );
}

/// torchrun's `--standalone` replaces the rendezvous that `PET_*` variables give (Kubeflow
/// sets them in every pod), `PET_RDZV_CONF`'s settings of another rendezvous included,
/// where the same flags typed with it are a conflict; and a
/// variable's value that its flag refuses is named by the variable, not by the flag.
#[test]
fn standalone_replaces_the_rendezvous_of_pet_variables() {
    let script = r#"echo "at $MASTER_ADDR rank $RANK of node $GROUP_RANK""#;
    let standalone = || ddp_run(&["--standalone", "sh", "-c", script]);
    let mut kubeflow = standalone();
    kubeflow
        .env("PET_MASTER_PORT", "1")
        .env("PET_NODE_RANK", "3")
        .env("PET_RDZV_ENDPOINT", "node0:29400")
        .env("PET_RDZV_BACKEND", "c10d")
        .env("PET_RDZV_CONF", "join_timeout=900");
    for mut cmd in [standalone(), kubeflow] {
        let out = wait_bounded(cmd.env("PET_MASTER_ADDR", "x").spawn().unwrap(), LIMIT);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "at 127.0.0.1 rank 0 of node 0"
        );
    }
    let refused = |cmd: &mut Command, message: &str| {
        let out = wait_bounded(cmd.spawn().unwrap(), LIMIT);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(stderr(&out).starts_with(message), "{}", stderr(&out));
    };
    refused(
        &mut ddp_run(&["--standalone", "--master-addr", "x", "true"]),
        "error: --standalone cannot be used with --master-addr: a standalone node meets on a \
         free local port of its own\n",
    );
    refused(
        ddp_run(&["true"]).env("PET_RDZV_CONF", "join_timeout=900"),
        "error: PET_RDZV_CONF=join_timeout=900 asks for torchrun's --rdzv-conf: ddp-run has \
         torchrun's static rendezvous only",
    );
    refused(
        ddp_run(&["--standalone", "true"]).env("PET_NNODES", "2"),
        "error: --standalone runs a single node; it cannot be combined with PET_NNODES=2\n",
    );
    refused(
        ddp_run(&["true"]).env("PET_NNODES", "abc"),
        "error: invalid value 'abc' of the environment variable PET_NNODES (read as \
         --nnodes): 'abc' is not a number of nodes; unset PET_NNODES or give --nnodes\n",
    );
    refused(
        ddp_run(&["--nnodes", "abc", "true"]).env("PET_NNODES", "2"),
        "error: invalid value 'abc' for '--nnodes <NNODES>': 'abc' is not a number of nodes",
    );
}

/// A `PET_*` variable's value that the launcher refuses (beyond what its flag's parser
/// checks) is named by the variable, and `PET_STANDALONE` is `--standalone`, as in torchrun.
#[test]
fn settings_from_pet_variables_are_named_by_them() {
    let refused = |cmd: &mut Command| {
        let out = wait_bounded(cmd.spawn().unwrap(), LIMIT);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        stderr(&out).lines().next().unwrap_or_default().to_string()
    };
    assert_eq!(
        refused(
            ddp_run(&["true"])
                .env("PET_NNODES", "2")
                .env("PET_NODE_RANK", "2")
        ),
        "error: PET_NODE_RANK 2 must be below PET_NNODES 2 (nodes are numbered from 0)"
    );
    assert_eq!(
        refused(ddp_run(&["--nnodes", "2", "true"]).env("PET_NODE_RANK", "2")),
        "error: PET_NODE_RANK 2 must be below --nnodes 2 (nodes are numbered from 0)"
    );
    assert_eq!(
        refused(ddp_run(&["true"]).env("PET_NPROC_PER_NODE", "0")),
        "error: the number of ranks per node (PET_NPROC_PER_NODE) must be at least 1"
    );
    assert_eq!(
        refused(
            ddp_run(&["--nnodes", "2", "--master-addr", "h", "true"]).env("PET_MASTER_PORT", "0")
        ),
        "error: PET_MASTER_PORT 0 is not a port the other ranks can reach; give a port from 1 \
         to 65535, or none on a single node"
    );
    assert_eq!(
        refused(ddp_run(&["--master-addr", "x", "true"]).env("PET_STANDALONE", "1")),
        "error: PET_STANDALONE cannot be used with --master-addr: a standalone node meets on a \
         free local port of its own"
    );
    let script = r#"echo "at $MASTER_ADDR rank $RANK""#;
    let out = wait_bounded(
        ddp_run(&["sh", "-c", script])
            .env("PET_STANDALONE", "1")
            .env("PET_MASTER_ADDR", "x")
            .spawn()
            .unwrap(),
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "at 127.0.0.1 rank 0"
    );
}

#[test]
fn torchruns_single_node_flags_are_accepted() {
    let out = run(&[
        "--standalone",
        "--nproc_per_node=2",
        "--no-python",
        "--monitor-interval",
        "0.05",
        "sh",
        "-c",
        r#"test "$WORLD_SIZE" = 2 && test "$MASTER_ADDR" = 127.0.0.1 && echo ok $RANK"#,
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.lines().any(|l| l == "ok 0"), "{stdout}");
    assert!(stdout.lines().any(|l| l == "[rank 1] ok 1"), "{stdout}");
}

/// A rank reads the launcher's standard input, as under torchrun (a debugger in a rank reads
/// the terminal).
#[test]
fn ranks_read_the_launchers_standard_input() {
    use std::io::Write;
    let mut child = ddp_run(&[
        "--nproc-per-node",
        "1",
        "sh",
        "-c",
        "read line; echo \"rank read: $line\"",
    ])
    .stdin(Stdio::piped())
    .spawn()
    .unwrap();
    child.stdin.take().unwrap().write_all(b"hello\n").unwrap();
    let out = wait_bounded(child, LIMIT);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("rank read: hello"),
        "{}",
        text(&out)
    );
}
