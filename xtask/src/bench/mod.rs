//! `cargo xtask bench`: every benchmark of the workspace, each next to PyTorch doing the same
//! work in the same run, in one table (or one JSON object per line with `--json`).
//!
//! | group     | ours                                         | PyTorch side                              |
//! |-----------|----------------------------------------------|-------------------------------------------|
//! | `sampler` | `ddp-sampler/benches/sampler.rs` (criterion) | `ddp-sampler/benches/reference_sampler.py` |
//! | `data`    | `ddp-data/benches/pipeline.rs` (criterion)   | `ddp-data/benches/reference_pipeline.py` (torchvision) |
//! | `data`    | `ddp-data/benches/loader.rs` (hand-off, threads) | (the previous, copying hand-off) |
//! | `comm`    | `ddp-comm/benches/collectives.rs` (2 ranks, shm and TCP) | `ddp-comm/benches/reference_gloo.py` |
//! | `ddp`     | `ddp-train/benches/ddp_steps.rs` (2 ranks): DDP's time outside backward | (PyTorch waits for it inside backward) |
//! | `train`   | `ddp-train/benches/ddp_steps.rs`             | `ddp-train/benches/reference_ddp.py`      |
//! | `resnet`  | `ddp_steps.rs --model resnet50` (batch 8, 224 px) | `reference_ddp.py --model resnet50` (torchvision) |
//! | `overlap` | `ddp-train/benches/overlap.rs` (2 ranks, shm, TCP, TCP capped by `tc`) | `ddp-train/benches/reference_overlap.py` |
//!
//! xtask does not link libtorch: it builds each bench with `cargo bench --no-run`, runs the
//! binaries and the Python scripts (the setup's `.deps/venv`), and reads their
//! machine-readable output: criterion's `estimates.json` (medians, kept under
//! `target/xtask-bench/criterion` so developers' own criterion baselines are untouched), and
//! `key=value` / `RESULT` lines from the others. Every command's output goes to a log file
//! under `target/xtask-bench/logs/`. torchvision comes with the setup. Ratios are "higher is better for us": speed-ups for times, ours/theirs
//! for rates and bandwidths.
//!
//! Like with like in `train` and `resnet`: both sides' processes run with glibc told to keep
//! freed memory (`MALLOC_MMAP_MAX_=0`, no trimming: `runner::MALLOC_KEEP`), the setting the
//! ddp-train binary applies to itself (`ddp_train::malloc`); PyTorch's random tensors also
//! run with glibc's defaults, shown in those rows' notes: what the allocator costs a CPU step
//! (the kernel re-zeroing 100 MB activations every step). With JPEGs both sides decode in
//! one background loader per rank (a thread for ours, a `DataLoader` worker process for
//! PyTorch). Medians are Python's on both sides (`ddp_testkit::median`).
//!
//! The `overlap` group caps loopback's bandwidth with `tc` (root only) for its last rows and
//! removes the cap afterwards, also on an error, a panic or Ctrl-C ([`netcap::LoopbackCap`]).
//!
//! Every run saves its results as JSON lines in `target/xtask-bench/results.jsonl`. A
//! complete run (every group, without `--quick`, none failed, no row skipped) also writes
//! `BENCHMARKS.md` at the workspace root: the machine, the commit, the toolchains, the date
//! and the load once at the top, then every row; `--render FILE` writes that page from a
//! saved run instead of running anything.
//!
//! One file per job: this one runs the groups and prints; `report.rs` is the row model and
//! its table and JSON; `results.rs` is a whole run (machine, settings, loads, rows) as JSON
//! lines and back; `page.rs` renders `BENCHMARKS.md`; `runner.rs` builds and runs benches,
//! Python and ranks; `parse.rs` reads what they print; `targets.rs` holds every pass/fail
//! target; the groups are `sampler.rs`, `data.rs` (+ `loader.rs`), `comm.rs`, `train.rs`
//! (`train` and `ddp`), `resnet.rs` and `overlap.rs` (+ `netcap.rs`, the loopback cap).

mod comm;
mod data;
mod loader;
mod netcap;
mod overlap;
mod page;
mod parse;
mod report;
mod resnet;
mod results;
mod runner;
mod sampler;
mod targets;
mod train;

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use page::PAGE;
pub use report::Group;
use report::{print_table, Row, Unit};
use results::{end_json, Machine, Results, Start, Versions};
use runner::{ensure_setup, say, Ctx};

/// Options of `cargo xtask bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Print one JSON object per line (one per result) on stdout instead of the table; all
    /// else (progress, setup, builds) goes to stderr.
    #[arg(long)]
    pub json: bool,
    /// Fewer samples and training steps: checks that every benchmark runs, in a few minutes;
    /// its figures are rougher than a full run's.
    #[arg(long)]
    pub quick: bool,
    /// Run only these groups (comma separated).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub only: Vec<Group>,
    /// Timed training steps per run (default 12; 4 with --quick).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Untimed warm-up steps per training run (default 3; 1 with --quick).
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Run nothing: write BENCHMARKS.md from a saved complete run, the JSON lines of
    /// `--json` or `target/xtask-bench/results.jsonl`.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["json", "quick", "only", "steps", "warmup"])]
    pub render: Option<PathBuf>,
}

/// Runs `cargo xtask bench`.
pub fn run(root: &Path, args: BenchArgs) -> Result<()> {
    if let Some(saved) = &args.render {
        return render_saved(root, saved);
    }
    let started = Instant::now();
    let mut json = if args.json {
        Some(json_stdout()?)
    } else {
        None
    };
    let deps = ensure_setup(root)?;
    let dir = root.join("target").join("xtask-bench");
    fs::create_dir_all(dir.join("logs"))
        .with_context(|| format!("cannot create {}", dir.join("logs").display()))?;
    let ctx = Ctx {
        root: root.to_path_buf(),
        python: deps.python(),
        dir,
        quick: args.quick,
        warmup: args.warmup.unwrap_or(if args.quick { 1 } else { 3 }),
        steps: args.steps.unwrap_or(if args.quick { 4 } else { 12 }),
    };
    if ctx.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let groups: BTreeSet<Group> = if args.only.is_empty() {
        Group::ALL.into()
    } else {
        args.only.iter().copied().collect()
    };
    let versions = Versions::of(root, ctx.python());
    let start = Start {
        machine: Machine::this(),
        date: results::now_utc(),
        torch: versions.torch,
        commit: versions.commit,
        rustc: versions.rustc,
        load_average: load_average(),
        quick: ctx.quick,
        warmup_steps: ctx.warmup,
        timed_steps: ctx.steps,
        groups: groups.iter().copied().collect(),
    };
    let mut loads = vec![("start".to_string(), start.load_average.clone())];
    if let Some(out) = &mut json {
        json_line(out, &start.json()?)?;
    }
    let mut rows: Vec<Row> = Vec::new();
    let mut failures = Vec::new();
    for &group in &groups {
        // The training runs also measure the DDP overhead: one run serves both groups.
        if group == Group::Ddp && groups.contains(&Group::Train) {
            continue;
        }
        say(&format!(
            "{} (load average {})",
            group.name(),
            load_average()
        ));
        let result = match group {
            Group::Sampler => sampler::sampler(&ctx),
            Group::Data => data::data(&ctx),
            Group::Comm => comm::comm(&ctx),
            Group::Ddp => train::ddp_only(&ctx),
            Group::Train => train::train(&ctx, groups.contains(&Group::Ddp)),
            Group::Resnet => resnet::resnet(&ctx),
            Group::Overlap => overlap::overlap(&ctx),
        };
        let new_rows = match result {
            Ok(r) => r,
            Err(e) => {
                let msg = format!("{e:#}");
                say(&format!("{} failed: {msg}", group.name()));
                failures.push(group.name());
                let first = msg.lines().next().unwrap_or("").to_string();
                vec![Row::new(group, Row::DID_NOT_RUN, Unit::Fraction).note(first)]
            }
        };
        if let Some(out) = &mut json {
            for r in &new_rows {
                json_line(out, &r.json()?)?;
            }
        }
        rows.extend(new_rows);
        loads.push((format!("after {}", group.name()), load_average()));
    }
    let seconds = started.elapsed().as_secs_f64();
    if let Some(out) = &mut json {
        json_line(out, &end_json(seconds, &loads)?)?;
    } else {
        rows.sort_by_key(|r| r.group);
        print_table(&rows);
        println!(
            "\n{} cores of {}; load average (1, 5, 15 min): {}; {seconds:.0} s in all{}",
            start.machine.cores,
            start.machine.cpu,
            loads
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join("; "),
            if ctx.quick {
                " (--quick: rough figures)"
            } else {
                ""
            }
        );
        println!(
            "ratio: higher is better for us (speed-up for times, ours/PyTorch for rates); logs in {}",
            ctx.dir.join("logs").display()
        );
    }
    let results = Results {
        start,
        loads,
        seconds,
        rows,
    };
    let saved = ctx.dir.join("results.jsonl");
    fs::write(&saved, results.json_lines()?)
        .with_context(|| format!("cannot write {}", saved.display()))?;
    match page::incomplete(&results) {
        None => {
            page::write(root, &results)?;
            say(&format!(
                "wrote {PAGE} (this run's results are also in {})",
                saved.display()
            ));
        }
        Some(why) => say(&format!(
            "{PAGE} is left as it is, since it holds complete runs only and {why}; this \
             run's results are in {}",
            saved.display()
        )),
    }
    if !failures.is_empty() {
        bail!(
            "benchmark group(s) failed: {} (see the messages above)",
            failures.join(", ")
        );
    }
    Ok(())
}

/// Standard output kept for `--json`'s lines alone: from here on, what else this process and
/// the commands it starts print there (setup's and cargo's progress, the sample generator's
/// lines) goes to standard error, so that every line of stdout is one JSON object.
fn json_stdout() -> Result<File> {
    io::stdout()
        .flush()
        .context("cannot flush standard output")?;
    // SAFETY: fcntl duplicates descriptor 1 (close-on-exec, so commands started later do not
    // inherit it) and touches no memory.
    let saved = unsafe { libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3) };
    if saved < 0 {
        return Err(io::Error::last_os_error()).context("cannot duplicate standard output");
    }
    // SAFETY: `saved` was just opened by this process, and nothing else owns it.
    let saved = unsafe { OwnedFd::from_raw_fd(saved) };
    // SAFETY: dup2 makes descriptor 1 a copy of descriptor 2 and touches no memory; Rust's
    // stdout writes to descriptor 1 by number, so its later lines follow.
    if unsafe { libc::dup2(2, 1) } < 0 {
        return Err(io::Error::last_os_error()).context("cannot send stdout to stderr");
    }
    Ok(File::from(saved))
}

/// One line of `--json`'s output, written at once.
fn json_line(out: &mut File, line: &str) -> Result<()> {
    out.write_all(format!("{line}\n").as_bytes())
        .context("cannot write a JSON line to standard output")
}

/// `--render FILE`: the page from a saved run.
fn render_saved(root: &Path, saved: &Path) -> Result<()> {
    let text =
        fs::read_to_string(saved).with_context(|| format!("cannot read {}", saved.display()))?;
    let results = Results::from_json_lines(&text).with_context(|| {
        format!(
            "{} is not a saved run of cargo xtask bench",
            saved.display()
        )
    })?;
    page::write(root, &results)?;
    say(&format!(
        "wrote {PAGE} from {} (the run of {} on {})",
        saved.display(),
        results.start.date,
        results.start.machine.cpu
    ));
    Ok(())
}

/// The load average over 1, 5 and 15 minutes, as `/proc/loadavg` shows it.
fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_string())
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    use super::*;

    const CHILD: &str = "XTASK_JSON_STDOUT_CHILD";

    /// Run again as a child of itself: there, [`json_stdout`] is taken, then this process and
    /// a command it starts print to stdout, and one JSON line goes to the kept stdout.
    #[test]
    fn only_json_lines_reach_stdout() {
        if std::env::var_os(CHILD).is_some() {
            let mut out = json_stdout().unwrap();
            println!("progress of this process");
            let status = Command::new("sh")
                .args(["-c", "echo progress of a command"])
                .status()
                .unwrap();
            assert!(status.success());
            json_line(&mut out, r#"{"row":1}"#).unwrap();
            return;
        }
        let output = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "bench::tests::only_json_lines_reach_stdout",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
        assert!(output.status.success(), "{stdout}\n{stderr}");
        // libtest's own "running 1 test" and "test <name> ... " come before the switch, its
        // verdict after it (on stderr): stdout ends with the JSON line and holds nothing else
        // of the test's.
        assert!(stdout.ends_with("... {\"row\":1}\n"), "stdout: {stdout}");
        assert!(!stdout.contains("progress"), "stdout: {stdout}");
        for line in ["progress of this process", "progress of a command"] {
            assert!(stderr.contains(line), "{line} not in stderr: {stderr}");
        }
    }
}
