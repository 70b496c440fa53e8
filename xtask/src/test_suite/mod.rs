//! `cargo xtask test`, what CI runs: formatting and lints first (they fail in seconds, not
//! after the tests), then every test binary of the workspace, run in parallel over the
//! machine's cores, the doctests and the docs; it ends with the ten slowest tests.
//!
//! Each test binary runs as cargo would run it (its package folder as the working
//! directory, cargo's variables set), single-threaded, so that each `test NAME ... ok` line
//! marks when that test ended and gives its time. Binaries whose tests start several ranks
//! (see [`RANK_BINARIES`]) run one at a time next to the other binaries, so that two
//! trainings never compete for the cores; those whose ranks mostly wait
//! ([`WAITING_BINARIES`]) run one at a time beside them. The longest jobs start first, by
//! the times of the previous run (kept in `target/xtask/test-times.json`). A job that hangs
//! is killed at its deadline (see [`job::deadline`]), naming the test it was in.

mod job;
mod libtest;
mod schedule;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use libtest::{Outcome, TestResult};
use schedule::{Group, Job};

/// Cargo features the test build turns on: the fault injection the reliability tests use
/// (never in a user's build).
pub const TEST_FEATURES: &str = "ddp-train/fault-injection,ddp-comm/fault-injection";

/// Test binaries (package, target) whose tests start several training or collective ranks:
/// they run one binary at a time.
const RANK_BINARIES: &[(&str, &str)] = &[
    ("ddp-comm", "collectives"),
    ("ddp-comm", "corrupt_ring"),
    ("ddp-comm", "failures"),
    ("ddp-comm", "flood"),
    ("ddp-comm", "key_file"),
    ("ddp-comm", "nccl"),
    ("ddp-comm", "nccl_peers"),
    ("ddp-comm", "torchrun"),
    ("ddp-run", "launcher"),
    ("ddp-train", "challenge"),
    ("ddp-train", "cuda_streams"),
    ("ddp-train", "elastic"),
    ("ddp-train", "equivalence"),
    ("ddp-train", "errors"),
    ("ddp-train", "example"),
    ("ddp-train", "freeze"),
    ("ddp-train", "init_weights"),
    ("ddp-train", "non_finite"),
    ("ddp-train", "predict"),
    ("ddp-train", "pytorch"),
    ("ddp-train", "reducer"),
    ("ddp-train", "self_launch"),
    ("ddp-train", "stop_checks"),
    ("ddp-train", "sync_batchnorm"),
    ("ddp-train", "trainer"),
    ("xtask", "chaos"),
    ("xtask", "fine_tune"),
    ("xtask", "launcher"),
];

/// Of [`RANK_BINARIES`], those whose processes mostly wait (for timeouts, signals, peers that
/// never come, fixed drips), measured on 2 cores: `failures` 83 s of wall time for 23 s of
/// CPU, `flood` 26 s for 4.5 s, `key_file` 9.5 s for 1.7 s, ddp-run's `launcher` 12.7 s for
/// 1 s, `torchrun` 0.4 s. They run beside a training binary instead of after it.
const WAITING_BINARIES: &[(&str, &str)] = &[
    ("ddp-comm", "failures"),
    ("ddp-comm", "flood"),
    ("ddp-comm", "key_file"),
    ("ddp-comm", "torchrun"),
    ("ddp-run", "launcher"),
];

/// The crates' builds without their default features, each as `cargo` options: what a
/// program that depends on one crate alone builds (ddp-train's core for its own model,
/// ddp-data's generic loader, ddp-run's library). The workspace's lints and docs see every
/// crate with the union of its features, so code that is unused, or a link that is broken,
/// only here would pass them. Libraries and binaries only: the tests need the defaults.
/// With each, whether it links libtorch: those that do not are built with `LIBTORCH` naming an
/// empty folder, as on a machine without libtorch (`ddp-gen-data` builds before the setup).
const LEAN_BUILDS: [(&str, bool); 5] = [
    ("-p ddp-train --no-default-features", true),
    ("-p ddp-data --no-default-features", false),
    ("-p ddp-data --no-default-features --features tch", true),
    ("-p ddp-data --no-default-features --features odir", false),
    ("-p ddp-run --no-default-features", false),
];

/// How long listing a binary's tests may take, and building and running every doctest: far
/// above what they take (under a second; a few minutes on 2 cores), to catch hangs.
const LIST_LIMIT: Duration = Duration::from_secs(120);
const DOCTEST_LIMIT: Duration = Duration::from_secs(30 * 60);

/// A test executable cargo built.
#[derive(Debug, Clone)]
struct Binary {
    package: String,
    target: String,
    exe: PathBuf,
    manifest_dir: PathBuf,
}

impl Binary {
    fn label(&self) -> String {
        format!("{}::{}", self.package, self.target)
    }
}

pub fn run(root: &Path) -> Result<()> {
    let started = Instant::now();
    // A second run in the same checkout would overwrite this one's logs, timing history and
    // the tests' shared fixture folders under target/ while they are read.
    let _lock = crate::target_lock(
        root,
        "test.lock",
        "xtask: another `cargo xtask test` runs in this checkout; waiting for it to finish",
    )?;
    crate::setup::run(root, &crate::setup::SetupArgs::default())?;
    let mut fmt = crate::cargo();
    fmt.args(["fmt", "--all", "--check"]);
    crate::run(root, fmt)?;
    let mut clippy = crate::cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--features",
        TEST_FEATURES,
    ]);
    clippy.args(["--", "-D", "warnings"]);
    crate::run(root, clippy)?;
    let no_libtorch = crate::target_dir(root).join("xtask/no-libtorch");
    std::fs::create_dir_all(&no_libtorch)
        .with_context(|| format!("cannot create '{}'", no_libtorch.display()))?;
    for (options, links_libtorch) in LEAN_BUILDS {
        let mut lean = crate::cargo();
        lean.arg("clippy")
            .args(options.split(' '))
            .args(["--", "-D", "warnings"]);
        if !links_libtorch {
            lean.env("LIBTORCH", &no_libtorch)
                .env_remove("LIBTORCH_LIB")
                .env_remove("LIBTORCH_USE_PYTORCH");
        }
        crate::run(root, lean)?;
    }

    // Where the time goes, phase by phase, shown with the total.
    let mut phases = vec![("setup and lints", started.elapsed())];
    let mark = |name, phases: &mut Vec<(&str, Duration)>| {
        let before: Duration = phases.iter().map(|(_, d)| *d).sum();
        phases.push((name, started.elapsed().saturating_sub(before)));
    };
    let (binaries, programs) = build(root)?;
    mark("build", &mut phases);
    let history_file = crate::target_dir(root).join("xtask/test-times.json");
    let history = load_history(&history_file);
    // The listings, the jobs and the doctests run in process groups of their own, out of
    // reach of the terminal's Ctrl-C: these signals are passed on to them instead.
    let watch = ddp_run::SignalWatch::start(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP])?;
    let interrupted = || watch.received();
    let mut jobs = Vec::new();
    let mut helpers = 0;
    for (index, bin) in binaries.iter().enumerate() {
        let (tests, ignored) = list(bin, &programs, &interrupted)?;
        helpers += ignored;
        if tests.is_empty() {
            continue;
        }
        let target = (bin.package.as_str(), bin.target.as_str());
        let group = if WAITING_BINARIES.contains(&target) {
            Group::Waits
        } else if RANK_BINARIES.contains(&target) {
            Group::Ranks
        } else {
            Group::Free
        };
        let estimate = tests
            .iter()
            .map(|t| history.get(&key(&bin.label(), t)).copied().unwrap_or(1.0))
            .sum();
        jobs.push(Job {
            binary: index,
            label: bin.label(),
            group,
            estimate,
            tests,
        });
    }
    let slots = std::thread::available_parallelism().map_or(2, |n| n.get());
    println!(
        "xtask: {} tests in {} binaries on {slots} cores ({helpers} #[ignore] tests left out: \
         helpers that other tests start)",
        jobs.iter().map(|j| j.tests.len()).sum::<usize>(),
        jobs.len()
    );
    let logs = crate::target_dir(root).join("xtask/test-logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
    let finished = schedule::run(jobs, slots, |job| {
        if let Some(signal) = interrupted() {
            bail!("not started: interrupted by signal {signal}");
        }
        let limit = job::deadline(job.estimate);
        job::run_job(
            &binaries[job.binary],
            &programs,
            job,
            &logs,
            limit,
            &interrupted,
        )
    });
    let signal = watch.received();
    mark("test binaries", &mut phases);

    let mut results: Vec<(String, TestResult)> = Vec::new();
    // Each binary that failed, with why and where its output is.
    let mut failed_jobs: Vec<(String, String)> = Vec::new();
    let mut broken = 0;
    for (job, outcome) in &finished {
        match outcome {
            Ok(run) => {
                if !run.success {
                    let why = run.problem.as_deref().unwrap_or("a test failed");
                    failed_jobs.push((
                        job.label.clone(),
                        format!("{why}; its output: {}", run.log.display()),
                    ));
                }
                broken += usize::from(run.problem.is_some());
                results.extend(run.results.iter().map(|r| (job.label.clone(), r.clone())));
            }
            Err(e) => {
                broken += 1;
                failed_jobs.push((job.label.clone(), format!("{e:#}")));
            }
        }
    }
    if let Some(signal) = signal {
        for (label, why) in &failed_jobs {
            println!("xtask: {label} failed ({why})");
        }
        bail!("interrupted by signal {signal}");
    }
    let mut history = history;
    for (label, r) in &results {
        if r.outcome == Outcome::Passed {
            history.insert(key(label, &r.name), r.time.as_secs_f64());
        }
    }
    save_history(&history_file, &history);

    let doctests = doctests(root, &interrupted);
    if let Some(signal) = watch.received() {
        bail!("interrupted by signal {signal}");
    }
    mark("doctests", &mut phases);
    let count = |o| results.iter().filter(|(_, r)| r.outcome == o).count();
    let (mut passed, failed, ignored) = (
        count(Outcome::Passed),
        count(Outcome::Failed),
        count(Outcome::Ignored),
    );
    let (mut doc_failed, mut doc_broken) = (0, false);
    match &doctests {
        Ok((p, f)) => {
            passed += p;
            doc_failed = *f;
        }
        Err(e) => {
            doc_broken = true;
            failed_jobs.push(("doctests".into(), format!("{e:#}")));
        }
    }

    let mut slowest: Vec<_> = results.iter().collect();
    slowest.sort_by_key(|(_, r)| std::cmp::Reverse(r.time));
    println!("\nxtask: the ten slowest tests");
    for (label, r) in slowest.iter().take(10) {
        println!("  {:>7.1}s  {label} {}", r.time.as_secs_f64(), r.name);
    }
    for (label, why) in &failed_jobs {
        println!("xtask: {label} failed ({why})");
    }
    let parts: Vec<String> = phases
        .iter()
        .map(|(name, d)| format!("{name} {:.0} s", d.as_secs_f64()))
        .collect();
    println!(
        "\nxtask: tests took {:.0} s in all ({})",
        started.elapsed().as_secs_f64(),
        parts.join(", ")
    );
    println!(
        "{passed} passed, {} failed, {ignored} skipped",
        failed + doc_failed
    );
    if let Some(summary) = failure_summary(failed, doc_failed, broken, doc_broken) {
        bail!("{summary}");
    }

    // ddp-run, the published crate, is also documented without its `cli` feature, which its
    // overview links into; the workspace's docs come last, to be the ones left in target/doc.
    for options in ["-p ddp-run --no-default-features", "--workspace"] {
        let mut doc = crate::cargo();
        doc.args(["doc", "--no-deps"])
            .args(options.split(' '))
            .env("RUSTDOCFLAGS", "-D warnings");
        crate::run(root, doc)?;
    }
    println!("xtask: all tests, formatting, lints and docs passed");
    Ok(())
}

/// A test's name in the history: its binary's label, a space, the test.
fn key(label: &str, test: &str) -> String {
    format!("{label} {test}")
}

fn load_history(file: &Path) -> BTreeMap<String, f64> {
    std::fs::read(file)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn save_history(file: &Path, history: &BTreeMap<String, f64>) {
    // Only a hint for the next run's order: a failure to write it costs nothing else.
    if let Ok(text) = serde_json::to_vec_pretty(history) {
        let _ = std::fs::write(file, text);
    }
}

/// Builds every test target of the workspace and returns their executables, and the
/// workspace's programs (`ddp-train`, ...) by name.
fn build(root: &Path) -> Result<(Vec<Binary>, Programs)> {
    let mut cmd = crate::cargo();
    cmd.current_dir(root)
        .args([
            "test",
            "--workspace",
            "--no-run",
            "--features",
            TEST_FEATURES,
        ])
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let line = format!("{cmd:?}");
    println!("xtask: {line}");
    let out = cmd
        .output()
        .with_context(|| format!("cannot start {line}"))?;
    if !out.status.success() {
        bail!("{line} failed ({})", out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut binaries: Vec<Binary> = stdout.lines().filter_map(test_binary).collect();
    binaries.sort_by_key(Binary::label);
    binaries.dedup_by(|a, b| a.exe == b.exe);
    Ok((binaries, stdout.lines().filter_map(program).collect()))
}

/// The programs of the test build, by name: each test gets their paths as
/// `DDP_TEST_BIN_<NAME>`, so that tests driving them need not build them again (with
/// other features).
type Programs = Vec<(String, PathBuf)>;

/// A `bin` target's executable (not its unit tests) from a `compiler-artifact` message.
fn program(line: &str) -> Option<(String, PathBuf)> {
    let msg: serde_json::Value = serde_json::from_str(line).ok()?;
    let is_bin = msg["target"]["kind"]
        .as_array()
        .is_some_and(|k| k.iter().any(|k| k == "bin"));
    if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != false || !is_bin {
        return None;
    }
    let name = msg["target"]["name"].as_str()?;
    Some((name.to_owned(), PathBuf::from(msg["executable"].as_str()?)))
}

/// The test executable of a `compiler-artifact` message, if it is one.
fn test_binary(line: &str) -> Option<Binary> {
    let msg: serde_json::Value = serde_json::from_str(line).ok()?;
    if msg["reason"] != "compiler-artifact" || msg["profile"]["test"] != true {
        return None;
    }
    let exe = PathBuf::from(msg["executable"].as_str()?);
    let manifest = Path::new(msg["manifest_path"].as_str()?);
    let package = manifest
        .parent()?
        .file_name()?
        .to_string_lossy()
        .into_owned();
    let kinds = msg["target"]["kind"].as_array()?;
    let name = msg["target"]["name"].as_str()?;
    // A library's unit tests are named after the package; other targets by their own name.
    let target = if kinds.iter().any(|k| k == "lib" || k == "rlib") {
        "lib".to_owned()
    } else {
        name.to_owned()
    };
    Some(Binary {
        package,
        target,
        exe,
        manifest_dir: manifest.parent()?.to_path_buf(),
    })
}

/// A command for `bin` as `cargo test` starts it, with the programs' paths.
fn command(bin: &Binary, programs: &Programs) -> Command {
    let mut cmd = Command::new(&bin.exe);
    cmd.current_dir(&bin.manifest_dir)
        .env(
            "CARGO",
            std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()),
        )
        .env("CARGO_MANIFEST_DIR", &bin.manifest_dir)
        .env("CARGO_PKG_NAME", &bin.package);
    // libtest's own settings from the user's shell would change what the suite parses
    // (uncaptured output hides a run-time `skipped:`) or how it runs.
    for var in [
        "RUST_TEST_NOCAPTURE",
        "RUST_TEST_SHUFFLE",
        "RUST_TEST_SHUFFLE_SEED",
        "RUST_TEST_THREADS",
        "RUST_TEST_TIME_UNIT",
        "RUST_TEST_TIME_INTEGRATION",
        "RUST_TEST_TIME_DOCTEST",
    ] {
        cmd.env_remove(var);
    }
    for (name, path) in programs {
        let var = format!("DDP_TEST_BIN_{}", name.replace('-', "_").to_uppercase());
        cmd.env(var, path);
    }
    cmd
}

/// The tests of `bin` to run, and how many it marks `#[ignore]`: those are left out (in
/// this workspace, each is a helper that another test starts as a process of its own).
fn list(
    bin: &Binary,
    programs: &Programs,
    interrupted: &dyn Fn() -> Option<i32>,
) -> Result<(Vec<String>, usize)> {
    let listing = |only_ignored: bool| -> Result<Vec<String>> {
        let mut cmd = command(bin, programs);
        cmd.args(["--list", "--format", "terse"])
            .stderr(Stdio::inherit());
        if only_ignored {
            cmd.arg("--ignored");
        }
        let out = job::output_within(&mut cmd, LIST_LIMIT, interrupted)?;
        if !out.status.success() {
            bail!("{} --list failed ({})", bin.exe.display(), out.status);
        }
        Ok(libtest::listed_tests(&String::from_utf8_lossy(&out.stdout)))
    };
    let ignored = listing(true)?;
    let tests: Vec<String> = listing(false)?
        .into_iter()
        .filter(|t| !ignored.contains(t))
        .collect();
    Ok((tests, ignored.len()))
}

/// What failed, in words, or `None` when nothing did: `failed` tests of the binaries and
/// `doc_failed` doctests, `broken` binaries that crashed, timed out or did not start, and
/// whether `cargo test --doc` failed without a count.
fn failure_summary(
    failed: usize,
    doc_failed: usize,
    broken: usize,
    doc_broken: bool,
) -> Option<String> {
    let plural =
        |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    let mut parts = Vec::new();
    if failed > 0 {
        parts.push(format!("{} failed", plural(failed, "test", "tests")));
    }
    if doc_failed > 0 {
        parts.push(format!(
            "{} failed",
            plural(doc_failed, "doctest", "doctests")
        ));
    }
    if broken > 0 {
        parts.push(format!(
            "{} crashed, timed out or did not start",
            plural(broken, "test binary", "test binaries")
        ));
    }
    if doc_broken {
        parts.push("`cargo test --doc` failed".to_owned());
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// `cargo test --doc` for the workspace: (passed, failed) from its `test result:` lines.
fn doctests(root: &Path, interrupted: &dyn Fn() -> Option<i32>) -> Result<(usize, usize)> {
    let mut cmd = crate::cargo();
    cmd.current_dir(root)
        .args([
            "test",
            "--workspace",
            "--doc",
            "--no-fail-fast",
            "--features",
        ])
        .arg(TEST_FEATURES)
        .stderr(Stdio::inherit());
    println!("xtask: {cmd:?}");
    let out = job::output_within(&mut cmd, DOCTEST_LIMIT, interrupted)?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    let _ = std::io::stdout().flush();
    let (mut passed, mut failed) = (0, 0);
    for line in text.lines().filter(|l| l.starts_with("test result:")) {
        let number = |word: &str| -> usize {
            line.split(';')
                .find_map(|part| part.trim().strip_suffix(word))
                .and_then(|n| n.trim().rsplit(' ').next()?.parse().ok())
                .unwrap_or(0)
        };
        passed += number(" passed");
        failed += number(" failed");
    }
    if !out.status.success() && failed == 0 {
        bail!("cargo test --doc failed ({})", out.status);
    }
    Ok((passed, failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_executables_come_from_cargos_messages() {
        let unit = r#"{"reason":"compiler-artifact","manifest_path":"/w/ddp-comm/Cargo.toml","target":{"kind":["lib"],"name":"ddp_comm"},"profile":{"test":true},"executable":"/t/debug/deps/ddp_comm-1"}"#;
        let b = test_binary(unit).unwrap();
        assert_eq!(
            (b.package.as_str(), b.target.as_str(), b.exe.to_str()),
            ("ddp-comm", "lib", Some("/t/debug/deps/ddp_comm-1"))
        );
        assert_eq!(b.manifest_dir, Path::new("/w/ddp-comm"));
        let it = r#"{"reason":"compiler-artifact","manifest_path":"/w/xtask/Cargo.toml","target":{"kind":["test"],"name":"tidy"},"profile":{"test":true},"executable":"/t/debug/deps/tidy-2"}"#;
        assert_eq!(test_binary(it).unwrap().label(), "xtask::tidy");
        // The library itself (no test harness), and other messages, are not test binaries.
        let lib = r#"{"reason":"compiler-artifact","manifest_path":"/w/xtask/Cargo.toml","target":{"kind":["lib"],"name":"x"},"profile":{"test":false},"executable":null}"#;
        assert!(test_binary(lib).is_none());
        assert!(test_binary(r#"{"reason":"build-finished","success":true}"#).is_none());
        assert!(test_binary("   Compiling x v0.1.0").is_none());
    }

    #[test]
    fn the_failure_message_counts_what_failed() {
        assert_eq!(failure_summary(0, 0, 0, false), None);
        // Doctests alone: not "0 test binaries failed".
        assert_eq!(
            failure_summary(0, 2, 0, false).as_deref(),
            Some("2 doctests failed")
        );
        assert_eq!(
            failure_summary(1, 0, 1, true).as_deref(),
            Some(
                "1 test failed, 1 test binary crashed, timed out or did not start, \
                 `cargo test --doc` failed"
            )
        );
    }

    #[test]
    fn binaries_that_start_ranks_run_one_at_a_time() {
        // The test helpers that start ranks (ddp-comm's worker harness, ddp-train's
        // ddp_testkit calls); a test file that calls one must be in RANK_BINARIES.
        const MARKERS: [&str; 5] = [
            "run_world",
            "spawn_rank(",
            "spawn_worker_ranks(",
            "run_ddp_train(",
            "rank_command(",
        ];
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut starting = Vec::new();
        for package in std::fs::read_dir(&root).unwrap() {
            let tests = package.unwrap().path().join("tests");
            let Ok(files) = std::fs::read_dir(&tests) else {
                continue;
            };
            for file in files {
                let path = file.unwrap().path();
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                if MARKERS.iter().any(|m| text.contains(m)) {
                    let package = tests.parent().unwrap().file_name().unwrap();
                    let stem = path.file_stem().unwrap();
                    starting.push((
                        package.to_string_lossy().into_owned(),
                        stem.to_string_lossy().into_owned(),
                    ));
                }
            }
        }
        for expected in [("ddp-comm", "nccl"), ("ddp-train", "trainer")] {
            assert!(
                starting
                    .iter()
                    .any(|(p, s)| (p.as_str(), s.as_str()) == expected),
                "{starting:?}"
            );
        }
        let missing: Vec<String> = starting
            .iter()
            .filter(|(p, s)| !RANK_BINARIES.contains(&(p.as_str(), s.as_str())))
            .map(|(p, s)| format!("{p}/tests/{s}.rs"))
            .collect();
        assert!(
            missing.is_empty(),
            "these start ranks but are not in RANK_BINARIES: {missing:?}"
        );
        for waiting in WAITING_BINARIES {
            assert!(RANK_BINARIES.contains(waiting), "{waiting:?}");
        }
    }

    #[test]
    fn every_crate_with_default_features_is_linted_without_them() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut with_defaults = Vec::new();
        for entry in std::fs::read_dir(&root).unwrap() {
            let dir = entry.unwrap().path();
            let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap_or_default();
            if manifest.lines().any(|l| l.starts_with("default = [")) {
                with_defaults.push(dir.file_name().unwrap().to_string_lossy().into_owned());
            }
        }
        with_defaults.sort();
        assert_eq!(with_defaults, ["ddp-data", "ddp-run", "ddp-train"]);
        for package in &with_defaults {
            let lean = format!("-p {package} --no-default-features");
            assert!(
                LEAN_BUILDS.iter().any(|(options, _)| *options == lean),
                "{package} without its default features is not in LEAN_BUILDS"
            );
        }
    }

    #[test]
    fn programs_are_bin_targets_outside_the_test_profile() {
        let bin = r#"{"reason":"compiler-artifact","manifest_path":"/w/ddp-train/Cargo.toml","target":{"kind":["bin"],"name":"ddp-train"},"profile":{"test":false},"executable":"/t/debug/ddp-train"}"#;
        assert_eq!(
            program(bin),
            Some(("ddp-train".into(), PathBuf::from("/t/debug/ddp-train")))
        );
        let unit = bin.replace(r#""test":false"#, r#""test":true"#);
        assert_eq!(program(&unit), None);
        let lib = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"x"},"profile":{"test":false},"executable":null}"#;
        assert_eq!(program(lib), None);
    }
}
