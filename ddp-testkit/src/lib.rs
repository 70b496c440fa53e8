//! Helpers for the workspace's tests that run real processes (a dev-dependency only).
//!
//! - [`free_port`]: a loopback port below the ephemeral range ([`ddp_run::free_port`]).
//! - [`temp_dir`]: a fresh folder, removed when the test ends.
//! - [`rank_command`]: a command with torchrun's environment for one rank on loopback, and
//!   [`job_secret`], the `DDP_SECRET` it gives every rank this process starts.
//! - [`wait_all`], [`wait_bounded`], [`wait_for`]: waits that cannot hang a test; processes
//!   still running at the limit are killed, with whatever holds their outputs, and the test
//!   fails, showing what each wrote.
//! - [`script`]: an executable shell script, safe to run at once.
//! - [`ignored_test`], [`assert_passed`]: one ignored test of this binary, in a process of its
//!   own.
//! - [`procs`]: what `/proc` says of processes (children, liveness, environment);
//!   [`in_new_pid_namespace`], a program as the first process of a pid namespace.
//! - [`setup_python`]: the Python of `cargo xtask setup` (with torch), for tests that run
//!   PyTorch next to our code; [`venv_python`], any Python that sees its own packages only.
//! - [`median`]: the benches' one median, Python's `statistics.median` (the mean of the
//!   middle pair for an even count), so that ours and the references' figures agree.
//!
//! ```
//! let dir = ddp_testkit::temp_dir("doc");
//! let child = std::process::Command::new("sh")
//!     .args(["-c", "echo $RANK/$WORLD_SIZE"])
//!     .stdout(std::process::Stdio::piped())
//!     .spawn()
//!     .unwrap();
//! let out = ddp_testkit::wait_bounded(child, std::time::Duration::from_secs(60));
//! assert!(out.status.success());
//! assert!(dir.path().is_dir());
//! ```

#![warn(missing_docs)]

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

pub use ddp_run::{JobSecret, RankEnv};
pub use tempfile::TempDir;

include!("../../shared-src/venv_python.rs");

/// A command running the Python of `cargo xtask setup` (`.deps/venv/bin/python`, found
/// through `DDP_DEPS_DIR`, which `.cargo/config.toml` sets) as [`venv_python`] does, so that
/// it imports the venv's torch, not one on the caller's `PYTHONPATH`; panics with what to run
/// when it is missing.
pub fn setup_python() -> Command {
    let deps = std::env::var_os("DDP_DEPS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.deps"));
    let python = deps.join("venv/bin/python");
    assert!(
        python.exists(),
        "{} not found: run `cargo xtask setup` first",
        python.display()
    );
    venv_python(&python)
}

/// The setup's torchrun: `python -m torch.distributed.run` of `.deps/venv` (its `torchrun`
/// script's first line names the venv's path when it was made, which a moved checkout no
/// longer has), with torchrun's own temporary folders (`torchelastic_*`, never removed) in
/// `tmp`, which the ranks it starts get as their `TMPDIR` too.
pub fn torchrun(tmp: &Path) -> Command {
    let mut cmd = setup_python();
    cmd.args(["-m", "torch.distributed.run"]).env("TMPDIR", tmp);
    cmd
}

/// A port on 127.0.0.1 that was free a moment ago, below the ephemeral range, so that the
/// outgoing connections of tests running meanwhile cannot take it.
pub fn free_port() -> u16 {
    ddp_run::free_port().expect("no free port on 127.0.0.1")
}

/// The median of `values` as Python's `statistics.median` takes it, which the benches'
/// PyTorch references use: the middle value, or the mean of the middle two for an even
/// count; NaN when `values` is empty.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A fresh, empty folder named after `name` under the system's temporary folder; it is
/// removed when the returned guard drops.
pub fn temp_dir(name: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("{name}-"))
        .tempdir()
        .expect("cannot create a temporary folder")
}

/// The secret of the jobs this process starts by hand, drawn at the first call: every rank
/// of a job must have the same, as `ddp_run::launch` gives them (jobs of one test process
/// are kept apart by their ports and run ids).
pub fn job_secret() -> &'static JobSecret {
    static SECRET: OnceLock<JobSecret> = OnceLock::new();
    SECRET.get_or_init(|| JobSecret::generate().expect("no random bytes from the OS"))
}

/// `program` as rank `rank` of `world` on this machine, with torchrun's environment
/// ([`ddp_run::RankEnv::single_node`]), the rendezvous at 127.0.0.1:`port`, and this
/// process's [`job_secret`] in `DDP_SECRET`.
pub fn rank_command(program: impl AsRef<Path>, rank: usize, world: usize, port: u16) -> Command {
    let mut cmd = Command::new(program.as_ref());
    RankEnv {
        secret: Some(job_secret().clone()),
        ..RankEnv::single_node(rank, world, port)
    }
    .apply(&mut cmd);
    cmd
}

/// Waits for every child and returns their outputs in order; if `limit` passes first, kills
/// those still running, and any other process that holds their piped outputs (one a child
/// started), and panics with the tail of what each child wrote until then.
pub fn wait_all(children: Vec<Child>, limit: Duration) -> Vec<Output> {
    wait_or_kill(children, limit).unwrap_or_else(|late| {
        panic!(
            "processes {:?} did not finish within {limit:?}: killed {:?}; output still open \
             (held by a process one of them started) {:?}; killed the processes holding \
             their outputs {:?}; what they wrote until then:{}",
            late.pids,
            late.killed,
            late.open,
            late.holders,
            late.written()
        )
    })
}

/// The most bytes of a late child's stdout, and as many of its stderr, that [`wait_all`]'s
/// panic message shows: the last ones, where a hang shows.
const LATE_TAIL_BYTES: usize = 8192;

/// The children [`wait_or_kill`] found running at the limit.
#[derive(Debug)]
struct Late {
    /// Every child's pid.
    pids: Vec<u32>,
    /// The pids it killed, with how they ended.
    killed: Vec<(u32, ExitStatus)>,
    /// The pids that had exited but whose stdout or stderr was still open at the limit.
    open: Vec<u32>,
    /// The other processes that held a child's piped stdout or stderr at the limit (started
    /// by a child, and outliving it), killed with SIGKILL.
    holders: Vec<u32>,
    /// What was read of each child's stdout and stderr until the kills, in the children's
    /// order: the messages of a rank that hung.
    read: Vec<[Vec<u8>; 2]>,
}

impl Late {
    /// Each child's pid and the tail of what it wrote, for the panic message.
    fn written(&self) -> String {
        let tail = |bytes: &[u8]| {
            let cut = bytes.len().saturating_sub(LATE_TAIL_BYTES);
            let skipped = if cut > 0 {
                format!("[{cut} bytes before]\n")
            } else {
                String::new()
            };
            format!("{skipped}{}", String::from_utf8_lossy(&bytes[cut..]))
        };
        self.pids
            .iter()
            .zip(&self.read)
            .map(|(pid, [out, err])| {
                format!(
                    "\n--- pid {pid} stdout\n{}\n--- pid {pid} stderr\n{}",
                    tail(out),
                    tail(err)
                )
            })
            .collect()
    }
}

/// What a reader thread has read of one pipe so far.
type Shared = std::sync::Arc<std::sync::Mutex<Vec<u8>>>;

/// [`wait_all`]'s work: the outputs, or the children killed at the limit. Only this thread
/// reaps the children (the waiters only watch with `WNOWAIT`), so a pid it kills is still
/// its child's, never a stranger's that reused the number of one already reaped.
fn wait_or_kill(mut children: Vec<Child>, limit: Duration) -> Result<Vec<Output>, Late> {
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let (tx, rx) = mpsc::channel();
    let (pipe_tx, pipes) = mpsc::channel();
    let mut outputs = Vec::new();
    let mut read = Vec::new();
    for (i, child) in children.iter_mut().enumerate() {
        drop(child.stdin.take());
        let fds = [
            child.stdout.as_ref().map(AsRawFd::as_raw_fd),
            child.stderr.as_ref().map(AsRawFd::as_raw_fd),
        ];
        outputs.extend(fds.into_iter().flatten().filter_map(pipe_name));
        read.push([
            read_all(i, child.stdout.take(), pipe_tx.clone()),
            read_all(i, child.stderr.take(), pipe_tx.clone()),
        ]);
        let (tx, pid) = (tx.clone(), child.id());
        std::thread::spawn(move || {
            wait_exited(pid);
            let _ = tx.send(i);
        });
    }
    drop((tx, pipe_tx));
    // What the readers hold, once the pipes have ended or `grace` has passed.
    let taken = |grace: Duration, ends: &mpsc::Receiver<usize>| {
        let until = Instant::now() + grace;
        for _ in 0..2 * read.len() {
            if ends
                .recv_timeout(until.saturating_duration_since(Instant::now()))
                .is_err()
            {
                break;
            }
        }
        read.iter()
            .map(|pair| pair.each_ref().map(|r| std::mem::take(&mut *lock(r))))
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + limit;
    let mut exited = vec![false; children.len()];
    for _ in 0..children.len() {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(i) => exited[i] = true,
            Err(_) => {
                let mut killed = Vec::new();
                for (child, _) in children.iter_mut().zip(&exited).filter(|(_, &e)| !e) {
                    let _ = child.kill();
                    killed.push((child.id(), child.wait().expect("reaping a killed child")));
                }
                let (open, holders) = (Vec::new(), kill_holders(&outputs));
                // The kills closed the pipes: what is still in them arrives at once.
                let read = taken(Duration::from_secs(1), &pipes);
                return Err(Late {
                    pids,
                    killed,
                    open,
                    holders,
                    read,
                });
            }
        }
    }
    // A process a child started may hold its pipes after the child has exited: the same
    // limit bounds the wait for their ends.
    let mut ended = vec![0; children.len()];
    for _ in 0..2 * children.len() {
        match pipes.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(i) => ended[i] += 1,
            Err(_) => break,
        }
    }
    let open: Vec<u32> = ended
        .iter()
        .zip(&pids)
        .filter(|(&n, _)| n < 2)
        .map(|(_, &pid)| pid)
        .collect();
    let statuses = children
        .into_iter()
        .map(|mut c| c.wait().expect("reaping a child"));
    let statuses: Vec<ExitStatus> = statuses.collect();
    if !open.is_empty() {
        let holders = kill_holders(&outputs);
        return Err(Late {
            pids,
            killed: Vec::new(),
            open,
            holders,
            read: taken(Duration::from_secs(1), &pipes),
        });
    }
    Ok(statuses
        .into_iter()
        .zip(taken(Duration::ZERO, &pipes))
        .map(|(status, [stdout, stderr])| Output {
            status,
            stdout,
            stderr,
        })
        .collect())
}

/// `m`'s bytes, also after a reader panicked holding the lock.
fn lock(m: &Shared) -> std::sync::MutexGuard<'_, Vec<u8>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What `/proc` names this process's descriptor `fd` (`pipe:[<inode>]` for a pipe), the name
/// it has in every process that holds it.
fn pipe_name(fd: i32) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()
}

/// Kills with SIGKILL every process other than this one that holds one of `pipes` (named
/// as [`pipe_name`] names them), and returns their pids in order. The children are reaped
/// by then: what still holds their outputs is a process one of them started (this process
/// holds only the reading ends). Processes whose descriptors this user cannot read are left
/// alone.
fn kill_holders(pipes: &[PathBuf]) -> Vec<u32> {
    if pipes.is_empty() {
        return Vec::new();
    }
    let me = std::process::id();
    let holds = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| pipes.contains(&l)))
    };
    let holders: Vec<u32> = procs::pids().filter(|&p| p != me && holds(p)).collect();
    for &pid in &holders {
        kill(pid, libc::SIGKILL);
    }
    holders
}

/// A thread reading `pipe` (if any) to its end into the buffer it returns, as it comes (a
/// child killed at the limit leaves what it wrote until then), then sending `key`.
fn read_all(
    key: usize,
    pipe: Option<impl Read + Send + 'static>,
    done: mpsc::Sender<usize>,
) -> Shared {
    let bytes = Shared::default();
    let sink = bytes.clone();
    std::thread::spawn(move || {
        let mut chunk = [0u8; 8192];
        if let Some(mut pipe) = pipe {
            loop {
                match pipe.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => lock(&sink).extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        let _ = done.send(key);
    });
    bytes
}

/// Blocks until child `pid` has exited, leaving it to be reaped (`WNOWAIT`).
fn wait_exited(pid: u32) {
    loop {
        // SAFETY: a zeroed siginfo_t is a valid out-parameter; WNOWAIT changes no state.
        let rc = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            let flags = libc::WEXITED | libc::WNOWAIT;
            libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, flags)
        };
        if rc == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// Waits for `child`; if `limit` passes first, kills it and panics.
pub fn wait_bounded(child: Child, limit: Duration) -> Output {
    wait_all(vec![child], limit).remove(0)
}

/// Polls `done` until it is true; panics with `what` if `limit` passes first.
pub fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not so after {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until the file at `path` contains `needle`; panics if `limit` passes first.
pub fn wait_for_text(path: &Path, needle: &str, limit: Duration) {
    wait_for(
        &format!("{} contains {needle:?}", path.display()),
        limit,
        || std::fs::read_to_string(path).is_ok_and(|t| t.contains(needle)),
    );
}

/// This test binary, to run only its ignored test `name` (`module::tests::name`) in a process
/// of its own (with another environment, say); [`assert_passed`] reads what it says.
pub fn ignored_test(name: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary's path"));
    cmd.args([
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd
}

/// Panics, showing what it wrote, unless `out` is that of an [`ignored_test`] that passed.
pub fn assert_passed(out: &Output) {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes the executable script `text` at `path` from another process, so that no descriptor
/// of it open here can reach a child forked meanwhile (running it would then fail with
/// ETXTBSY).
pub fn script(path: &Path, text: &str) {
    use std::io::Write;
    let mut sh = Command::new("sh")
        .args(["-c", "cat > \"$0\" && chmod +x \"$0\""])
        .arg(path)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("cannot start sh");
    let mut stdin = sh.stdin.take().expect("sh's stdin");
    stdin.write_all(text.as_bytes()).expect("writing to sh");
    drop(stdin);
    assert!(
        sh.wait().expect("waiting for sh").success(),
        "cannot write {}",
        path.display()
    );
}

/// stdout then stderr of `output`, as text.
pub fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Sends `signal` to process `pid` (nothing happens if it is gone).
pub fn kill(pid: u32, signal: i32) {
    // SAFETY: kill(2) has no memory effects; at worst the pid names no process.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

/// `unshare --user --map-root-user --pid --fork`, the start of a command line that runs the
/// program after it as the first process of a new pid namespace (`/proc` stays this one's);
/// or why this machine does not allow it, for the test to print as it skips.
pub fn in_new_pid_namespace() -> Result<[&'static str; 5], String> {
    let prefix = ["unshare", "--user", "--map-root-user", "--pid", "--fork"];
    let allowed = Command::new(prefix[0])
        .args(&prefix[1..])
        .arg("true")
        .output();
    match allowed {
        Ok(o) if o.status.success() => Ok(prefix),
        other => Err(format!(
            "`{}` is not allowed here: {other:?}",
            prefix.join(" ")
        )),
    }
}

/// A PNG that is a signature, a header claiming `w` x `h` 8-bit RGB pixels and an empty data
/// chunk: what a decompression bomb shows the decoder before any pixel data.
pub fn png_header_only(w: u32, h: u32) -> Vec<u8> {
    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }
    let mut chunk = b"IHDR".to_vec();
    chunk.extend(w.to_be_bytes());
    chunk.extend(h.to_be_bytes());
    chunk.extend([8, 2, 0, 0, 0]); // 8 bits, RGB, deflate, no filter, no interlace
    let mut out = vec![0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
    out.extend(13u32.to_be_bytes());
    out.extend(&chunk);
    out.extend(crc32(&chunk).to_be_bytes());
    out.extend(0u32.to_be_bytes());
    out.extend(b"IDAT");
    out.extend(crc32(b"IDAT").to_be_bytes());
    out
}

/// What `/proc` says of processes.
pub mod procs {
    /// The fields of `/proc/<pid>/stat` after the parenthesised command name: state, ppid, ...
    fn stat_fields(pid: u32) -> Option<Vec<String>> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (_, rest) = stat.rsplit_once(") ")?;
        Some(rest.split(' ').map(str::to_owned).collect())
    }

    /// Whether process `pid` exists and is not a zombie.
    pub fn alive(pid: u32) -> bool {
        stat_fields(pid).is_some_and(|f| f.first().is_some_and(|s| s != "Z"))
    }

    /// Whether process `pid` is stopped (by SIGSTOP or a debugger).
    pub fn stopped(pid: u32) -> bool {
        stat_fields(pid).is_some_and(|f| f.first().is_some_and(|s| s == "T"))
    }

    /// Every process's pid, in order.
    pub(crate) fn pids() -> impl Iterator<Item = u32> {
        let mut pids: Vec<u32> = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .collect();
        pids.sort_unstable();
        pids.into_iter()
    }

    /// The living (not zombie) processes whose parent is `pid`, in pid order.
    pub fn children_of(pid: u32) -> Vec<u32> {
        pids()
            .filter(|&p| {
                stat_fields(p)
                    .is_some_and(|f| f.len() > 1 && f[0] != "Z" && f[1] == pid.to_string())
            })
            .collect()
    }

    /// The processes of process group `pgid`, each with its state (`S`, `Z` for a zombie).
    pub fn group(pgid: u32) -> Vec<(u32, String)> {
        let stats = pids().filter_map(|p| Some((p, stat_fields(p)?)));
        stats
            .filter(|(_, f)| f.get(2).is_some_and(|g| *g == pgid.to_string()))
            .map(|(p, f)| (p, f[0].clone()))
            .collect()
    }

    /// The value of `name` in the environment process `pid` started with.
    pub fn env_var(pid: u32, name: &str) -> Option<String> {
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let prefix = format!("{name}=");
        env.split(|b| *b == 0)
            .find_map(|kv| kv.strip_prefix(prefix.as_bytes()))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_child_is_seen_alive_with_its_environment_then_gone() {
            let mut child = std::process::Command::new("sleep")
                .arg("30")
                .env("DDP_TESTKIT_PROBE", "42")
                .spawn()
                .unwrap();
            let pid = child.id();
            assert!(alive(pid));
            assert!(children_of(std::process::id()).contains(&pid));
            // Until the child has exec'd, /proc shows the environment it forked with (ours).
            crate::wait_for(
                "the child's exec",
                std::time::Duration::from_secs(10),
                || env_var(pid, "DDP_TESTKIT_PROBE").is_some(),
            );
            assert_eq!(env_var(pid, "DDP_TESTKIT_PROBE").as_deref(), Some("42"));
            assert_eq!(env_var(pid, "DDP_TESTKIT_ABSENT"), None);
            child.kill().unwrap();
            child.wait().unwrap();
            assert!(!alive(pid));
            assert!(!children_of(std::process::id()).contains(&pid));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_pythons() {
        // statistics.median([1, 2, 3, 4]) == 2.5; the input's order does not matter.
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[7.0]), 7.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn a_rank_command_carries_torchruns_environment() {
        let child = rank_command("sh", 1, 2, 20123)
            .args([
                "-c",
                "echo $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR:$MASTER_PORT ${#DDP_SECRET}",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = wait_bounded(child, Duration::from_secs(60));
        assert_eq!(text(&out), "1 2 1 127.0.0.1:20123 32\n");
    }

    #[test]
    #[should_panic(expected = "did not finish within")]
    fn a_child_past_the_limit_is_killed_and_fails_the_test() {
        let child = Command::new("sleep").arg("30").spawn().unwrap();
        wait_bounded(child, Duration::from_millis(200));
    }

    #[test]
    fn a_child_past_the_limit_fails_showing_what_it_wrote() {
        let child = Command::new("sh")
            .args([
                "-c",
                "echo rank-said-this; echo rank-warned-that >&2; exec sleep 30",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        // Let the lines reach the pipes before the limit can pass.
        std::thread::sleep(Duration::from_millis(300));
        let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_all(vec![child], Duration::from_secs(1))
        }))
        .unwrap_err();
        let message = panic.downcast_ref::<String>().expect("a formatted panic");
        let wrote = message.split_once("what they wrote until then:").unwrap().1;
        assert_eq!(
            wrote,
            format!(
                "\n--- pid {pid} stdout\nrank-said-this\n\n--- pid {pid} stderr\nrank-warned-that\n"
            )
        );
    }

    #[test]
    fn only_the_children_still_running_at_the_limit_are_killed() {
        use std::os::unix::process::ExitStatusExt;
        let done = Command::new("true").spawn().unwrap();
        let sleeper = Command::new("sleep").arg("30").spawn().unwrap();
        let (done_pid, sleeper_pid) = (done.id(), sleeper.id());
        wait_for("`true` to exit", Duration::from_secs(60), || {
            !procs::alive(done_pid)
        });
        let late = wait_or_kill(vec![done, sleeper], Duration::from_secs(1)).unwrap_err();
        assert_eq!(late.pids, [done_pid, sleeper_pid]);
        let killed: Vec<_> = late
            .killed
            .iter()
            .map(|(pid, s)| (*pid, s.signal()))
            .collect();
        assert_eq!(killed, [(sleeper_pid, Some(libc::SIGKILL))]);
    }

    /// Runs `sh -c script` with its stdout piped, after a `sleep 30` it starts in the
    /// background (holding that stdout), under a 1 s limit: sh's pid, what `wait_or_kill`
    /// reports, and the sleep's pid, once the sleep has died.
    fn late_with_a_sleeper(script: &str) -> (u32, Late, u32) {
        let dir = temp_dir("testkit-holder");
        let pid_file = dir.path().join("pid");
        let child = Command::new("sh")
            .args(["-c", &format!("sleep 30 & echo $! > \"$0\"; {script}")])
            .arg(&pid_file)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        // The limit starts once sh has started its sleep: on a loaded machine sh may not
        // have run that far within the limit.
        let written = || std::fs::read_to_string(&pid_file).is_ok_and(|t| t.ends_with('\n'));
        wait_for("sh to start its sleep", Duration::from_secs(30), written);
        let late = wait_or_kill(vec![child], Duration::from_secs(1)).unwrap_err();
        let text = std::fs::read_to_string(&pid_file).unwrap();
        let sleeper: u32 = text.trim().parse().unwrap();
        wait_for(
            "the sleep holding the output to die",
            Duration::from_secs(10),
            || !procs::alive(sleeper),
        );
        (pid, late, sleeper)
    }

    #[test]
    fn an_output_held_open_past_the_limit_fails_naming_its_child_and_kills_its_holder() {
        let (pid, late, sleeper) = late_with_a_sleeper("echo x");
        assert_eq!(
            (late.killed.len(), late.open, late.holders),
            (0, vec![pid], vec![sleeper])
        );
    }

    #[test]
    fn a_child_killed_at_the_limit_takes_the_holder_of_its_output_with_it() {
        use std::os::unix::process::ExitStatusExt;
        let (pid, late, sleeper) = late_with_a_sleeper("exec sleep 30");
        let killed: Vec<_> = late.killed.iter().map(|(p, s)| (*p, s.signal())).collect();
        assert_eq!(killed, [(pid, Some(libc::SIGKILL))]);
        assert_eq!(late.holders, [sleeper]);
    }

    #[test]
    fn outputs_come_back_in_order_with_their_status() {
        let sh = |script: &str| {
            Command::new("sh")
                .args(["-c", script])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        };
        let children = vec![sh("sleep 0.2; echo a; exit 3"), sh("echo b >&2")];
        let outs = wait_all(children, Duration::from_secs(60));
        let seen: Vec<_> = outs.iter().map(|o| (o.status.code(), text(o))).collect();
        assert_eq!(
            seen,
            [(Some(3), "a\n".into()), (Some(0), "b\n".to_string())]
        );
    }

    #[test]
    fn temporary_folders_are_fresh_and_removed() {
        let a = temp_dir("kit");
        let b = temp_dir("kit");
        assert_ne!(a.path(), b.path());
        assert!(a
            .path()
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("kit-"));
        let path = a.path().to_path_buf();
        drop(a);
        assert!(!path.exists());
    }
}
