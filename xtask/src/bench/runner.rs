//! How the benches are run: the run's [`Ctx`] (logs, builds, Python, criterion), the setup
//! they need (libtorch, torchvision, synthetic images) and ranks started through `ddp-run`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

use super::parse::median_point_estimate;
use crate::setup;

/// glibc settings that keep freed memory in the heap instead of returning it to the OS: the
/// ConvNet's activations (up to 100 MB each) are otherwise mmap'ed and unmapped on every
/// use, and the kernel zeroes their pages again on every step.
pub(super) const MALLOC_KEEP: &[(&str, &str)] = &[
    ("MALLOC_MMAP_MAX_", "0"),
    ("MALLOC_TRIM_THRESHOLD_", "17179869184"),
];

/// Where and how this run works.
#[derive(Debug)]
pub(super) struct Ctx {
    pub(super) root: PathBuf,
    pub(super) python: PathBuf,
    /// `target/xtask-bench`
    pub(super) dir: PathBuf,
    pub(super) quick: bool,
    pub(super) warmup: usize,
    pub(super) steps: usize,
}

impl Ctx {
    fn log_path(&self, name: &str) -> PathBuf {
        self.dir.join("logs").join(format!("{name}.log"))
    }

    /// Runs `cmd` in the project root, stdout and stderr to `logs/<name>.log`; returns stdout.
    pub(super) fn capture(&self, name: &str, mut cmd: Command) -> Result<String> {
        cmd.current_dir(&self.root)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let line = format!("{cmd:?}");
        let out = cmd
            .output()
            .with_context(|| format!("cannot start {line}"))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let log = self.log_path(name);
        fs::write(
            &log,
            format!("$ {line}\n--- stdout\n{stdout}\n--- stderr\n{stderr}"),
        )
        .with_context(|| format!("cannot write {}", log.display()))?;
        if !out.status.success() {
            bail!(
                "{line} failed ({}); last lines:\n{}\nfull output in {}",
                out.status,
                tail(&stderr, 12),
                log.display()
            );
        }
        Ok(stdout)
    }

    /// Builds bench `name` of `package` (release) and returns its executable.
    pub(super) fn build_bench(&self, package: &str, name: &str) -> Result<PathBuf> {
        say(&format!("building {package} bench {name} (release)"));
        let args = ["bench", "--no-run", "-p", package, "--bench", name];
        crate::artifact::build(&self.root, &args, "bench", name)
    }

    /// The setup's Python, one OpenMP thread.
    pub(super) fn python(&self) -> Command {
        let mut cmd = crate::setup::venv_python(&self.python);
        cmd.env("OMP_NUM_THREADS", "1");
        cmd
    }

    /// Our bench `exe` (`--bench` first) and the Python `reference`, each with `args` and
    /// both with [`MALLOC_KEEP`]: the same work in the same allocator.
    pub(super) fn ours_and_reference(
        &self,
        exe: &Path,
        reference: &Path,
        args: &[String],
    ) -> [Command; 2] {
        let mut ours = Command::new(exe);
        ours.arg("--bench").args(args);
        let mut theirs = self.python();
        theirs.arg(reference).args(args);
        [ours, theirs].map(|mut cmd| {
            cmd.envs(MALLOC_KEEP.iter().copied());
            cmd
        })
    }

    /// The Python reference `<crate_dir>/benches/<name>`, which must exist.
    pub(super) fn script(&self, crate_dir: &str, name: &str) -> Result<PathBuf> {
        let path = self.root.join(crate_dir).join("benches").join(name);
        if !path.exists() {
            bail!("{} is missing", path.display());
        }
        Ok(path)
    }

    fn criterion_dir(&self) -> PathBuf {
        self.dir.join("criterion")
    }

    /// Runs a criterion bench binary with this run's settings.
    pub(super) fn criterion(
        &self,
        name: &str,
        exe: &Path,
        extra_env: &[(&str, &str)],
    ) -> Result<String> {
        let mut cmd = Command::new(exe);
        cmd.args(["--bench", "--noplot"])
            .env("CRITERION_HOME", self.criterion_dir());
        if self.quick {
            cmd.arg("--quick");
        }
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        self.capture(name, cmd)
    }

    /// The median time in seconds of criterion benchmark `id` (`group/function/param`).
    pub(super) fn criterion_median(&self, id: &str) -> Result<f64> {
        let path = self
            .criterion_dir()
            .join(id)
            .join("new")
            .join("estimates.json");
        let text =
            fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let median = median_point_estimate(&text)
            .with_context(|| format!("{} has no median point estimate", path.display()))?;
        Ok(median * 1e-9)
    }
}

/// Makes sure libtorch (the benches link it) and the Python references' packages are
/// installed, quietly when they already are (but for a warning on stderr of another libtorch
/// in the environment), so that `--json` output holds nothing but JSON.
pub(super) fn ensure_setup(root: &Path) -> Result<setup::Deps> {
    let deps = setup::Deps::new(root);
    if !deps.needs_setup() {
        setup::warn_of_another_libtorch(&deps);
        return Ok(deps);
    }
    setup::run(root, &setup::SetupArgs::default())
}

/// The synthetic ODIR folder of `count` images of `size` px, generated once (and again where
/// a power loss left it without a whole marker: [`crate::launch::is_complete`]).
pub(super) fn train_data(ctx: &Ctx, size: u32, count: usize) -> Result<PathBuf> {
    let dir = ctx.dir.join(format!("odir-{size}px-{count}"));
    if crate::launch::is_complete(&dir) {
        return Ok(dir);
    }
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    say(&format!(
        "generating {count} synthetic ODIR JPEGs of {size}x{size} px in {} (once{})",
        dir.display(),
        if size > 1024 { "; about a minute" } else { "" }
    ));
    crate::launch::generate_sample(&ctx.root, None, &dir, count, size, 0)?;
    crate::launch::mark_complete(&dir)?;
    Ok(dir)
}

/// Starts `world` ranks of `exe` on loopback with `ddp-run` (quietly: each rank's output goes
/// to `logs/<name>/rank-<r>.out`) and returns each rank's output; the first rank to fail ends
/// the others.
pub(super) fn run_ranks(
    ctx: &Ctx,
    name: &str,
    exe: &Path,
    args: &[String],
    world: usize,
    env: &[(&str, &str)],
) -> Result<Vec<String>> {
    let logs = ctx.dir.join("logs").join(name);
    if logs.exists() {
        fs::remove_dir_all(&logs).with_context(|| format!("cannot remove {}", logs.display()))?;
    }
    let config = ddp_run::LaunchConfig {
        env: env.iter().map(|(k, v)| (k.into(), v.into())).collect(),
        log_dir: Some(logs.clone()),
        omp_num_threads: Some(1),
        shutdown_timeout: Duration::from_secs(5),
        echo: false,
        ..ddp_run::LaunchConfig::new(exe, world).args(args)
    };
    match ddp_run::launch(&config, |_| {})? {
        ddp_run::Outcome::Succeeded { .. } => {}
        ddp_run::Outcome::Failed { failure, .. } => bail!(
            "{failure} ({}); see {}",
            exe.display(),
            logs.join(format!("rank-{}.out", failure.rank)).display()
        ),
        ddp_run::Outcome::Interrupted { signal, .. } => {
            bail!(
                "interrupted by signal {signal} while running {}",
                exe.display()
            )
        }
        ddp_run::Outcome::Stopped { .. } => bail!("{} stopped before the end", exe.display()),
        other => bail!("{} ended as {other:?}", exe.display()),
    }
    (0..world)
        .map(|rank| {
            let log = logs.join(format!("rank-{rank}.out"));
            fs::read_to_string(&log).with_context(|| format!("cannot read {}", log.display()))
        })
        .collect()
}

/// A progress message on stderr (stdout holds only the table or the JSON lines).
pub(super) fn say(msg: &str) {
    eprintln!("bench: {msg}");
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A run's settings for tests that build commands (nothing is run).
    pub(in super::super) fn ctx() -> Ctx {
        Ctx {
            root: PathBuf::from("/repo"),
            python: PathBuf::from("/repo/.deps/venv/bin/python"),
            dir: PathBuf::from("/repo/target/xtask-bench"),
            quick: false,
            warmup: 3,
            steps: 12,
        }
    }

    /// The arguments of `cmd`.
    pub(in super::super) fn args(cmd: &Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    /// What `cmd` sets or removes of glibc's `MALLOC_*` variables, by name.
    pub(in super::super) fn malloc_env(cmd: &Command) -> Vec<(String, Option<String>)> {
        let mut env: Vec<(String, Option<String>)> = cmd
            .get_envs()
            .filter(|(k, _)| k.to_string_lossy().starts_with("MALLOC_"))
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.map(|v| v.to_string_lossy().into_owned()),
                )
            })
            .collect();
        env.sort();
        env
    }

    /// [`MALLOC_KEEP`] as [`malloc_env`] shows it.
    pub(in super::super) fn kept() -> Vec<(String, Option<String>)> {
        let mut env: Vec<(String, Option<String>)> = MALLOC_KEEP
            .iter()
            .map(|(k, v)| (k.to_string(), Some(v.to_string())))
            .collect();
        env.sort();
        env
    }

    #[test]
    fn keeps_the_last_lines() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail("a", 12), "a");
    }
}
