//! `cargo xtask bench`: every benchmark of the workspace, each next to PyTorch doing the same
//! work in the same run, in one table (or one JSON object per line with `--json`).
//!
//! | group     | ours                                         | PyTorch side                              |
//! |-----------|----------------------------------------------|-------------------------------------------|
//! | `sampler` | `ddp-sampler/benches/sampler.rs` (criterion) | `ddp-sampler/benches/reference_sampler.py` |
//! | `data`    | `ddp-data/benches/pipeline.rs` (criterion)   | `ddp-data/benches/reference_pipeline.py` (torchvision) |
//! | `data`    | `ddp-data/benches/loader.rs` (hand-off, threads) | (the previous, copying hand-off) |
//! | `comm`    | `ddp-comm/benches/collectives.rs` (2 ranks, shm and TCP) | `ddp-comm/benches/reference_gloo.py` |
//! | `ddp`     | `ddp-train/benches/ddp_steps.rs` (2 ranks)   | (PyTorch overlaps it with backward)       |
//! | `train`   | `ddp-train/benches/ddp_steps.rs`             | `ddp-train/benches/reference_ddp.py`      |
//! | `overlap` | `ddp-train/benches/overlap.rs` (2 ranks, shm, TCP, TCP capped by `tc`) | `ddp-train/benches/reference_overlap.py` |
//!
//! xtask does not link libtorch: it builds each bench with `cargo bench --no-run`, runs the
//! binaries and the Python scripts (the setup's `.deps/venv`), and reads their
//! machine-readable output: criterion's `estimates.json` (medians, kept under
//! `target/xtask-bench/criterion` so developers' own criterion baselines are untouched), and
//! `key=value` / `RESULT` lines from the others. Every command's output goes to a log file
//! under `target/xtask-bench/logs/`. torchvision, needed only here, is installed into the
//! venv on first use. Ratios are "higher is better for us": speed-ups for times, ours/theirs
//! for rates and bandwidths.
//!
//! The `train` group also runs random tensors with glibc told never to return freed memory
//! to the OS (`MALLOC_MMAP_MAX_=0`), on both sides: not the default of either, it shows what
//! the allocator costs a CPU step (the kernel re-zeroing 100 MB activations every step).
//!
//! The `overlap` group caps loopback's bandwidth with `tc` (root only) for its last rows and
//! removes the cap afterwards, also on an error, a panic or Ctrl-C ([`LoopbackCap`]).

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::setup;

/// The torchvision that matches torch 2.13 (installed for benchmarks only).
const TORCHVISION_VERSION: &str = "0.28.0";
/// Images of each synthetic ODIR folder the training benchmark reads: 32 is one step of
/// batch 16 on each of 2 ranks.
const TRAIN_IMAGES: [(u32, usize); 2] = [(512, 64), (2048, 32)];

/// A group of benchmarks, selectable with `--only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Group {
    /// One epoch's indices, N = 10^6 and 10^7, 8 ranks, vs DistributedSampler.
    Sampler,
    /// Decode + RandomResizedCrop(224) + ToTensor on one thread, vs torchvision; the
    /// loader's hand-off per batch and its throughput with 1 and 2 threads.
    Data,
    /// All-reduce and all-gather bus bandwidth and parameter broadcast, 2 ranks, over shared
    /// memory and over TCP, vs Gloo.
    Comm,
    /// DDP overhead per training step (buffer broadcast, bucket copy, all-reduce), 2 ranks.
    Ddp,
    /// End-to-end training images/s, 1 and 2 ranks, random tensors and JPEGs, vs PyTorch DDP.
    Train,
    /// DDP steps of a communication-heavy MLP, 2 ranks: the all-reduce overlapped with
    /// backward, after it, bf16-compressed; shared memory, TCP, and TCP capped at 1 Gbit/s
    /// with `tc` (needs root); vs PyTorch DDP.
    Overlap,
}

impl Group {
    fn name(self) -> &'static str {
        match self {
            Group::Sampler => "sampler",
            Group::Data => "data",
            Group::Comm => "comm",
            Group::Ddp => "ddp",
            Group::Train => "train",
            Group::Overlap => "overlap",
        }
    }
}

/// Options of `cargo xtask bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Print one JSON object per line (one per result) on stdout instead of the table.
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
}

/// What a result is compared against.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// The ratio (ours vs PyTorch, higher is better) must reach this.
    Ratio(f64),
    /// Our own figure must reach this.
    Ours(f64),
    /// Our own figure must stay at or below this.
    OursAtMost(f64),
}

/// How a figure is shown.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Unit {
    Seconds,
    ImagesPerSec,
    StepsPerSec,
    GigabytesPerSec,
    Fraction,
}

impl Unit {
    fn label(self) -> &'static str {
        match self {
            Unit::Seconds => "s",
            Unit::ImagesPerSec => "img/s",
            Unit::StepsPerSec => "steps/s",
            Unit::GigabytesPerSec => "GB/s",
            Unit::Fraction => "",
        }
    }

    fn show(self, v: f64) -> String {
        match self {
            Unit::Seconds if v < 1e-3 => format!("{:.1} us", v * 1e6),
            Unit::Seconds if v < 1.0 => format!("{:.2} ms", v * 1e3),
            Unit::Seconds => format!("{v:.3} s"),
            Unit::ImagesPerSec => format!("{v:.1} img/s"),
            Unit::StepsPerSec => format!("{v:.2} steps/s"),
            Unit::GigabytesPerSec => format!("{v:.3} GB/s"),
            Unit::Fraction => format!("{v:.3}"),
        }
    }
}

/// One line of the table.
#[derive(Debug, Clone)]
struct Row {
    group: Group,
    name: String,
    unit: Unit,
    ours: Option<f64>,
    pytorch: Option<f64>,
    /// Higher is better for us.
    ratio: Option<f64>,
    target: Option<Target>,
    note: String,
}

impl Row {
    fn new(group: Group, name: impl Into<String>, unit: Unit) -> Self {
        Self {
            group,
            name: name.into(),
            unit,
            ours: None,
            pytorch: None,
            ratio: None,
            target: None,
            note: String::new(),
        }
    }

    /// Ours and PyTorch's figure; the ratio is a speed-up for times, ours/theirs otherwise.
    fn pair(mut self, ours: Option<f64>, pytorch: Option<f64>) -> Self {
        self.ours = ours;
        self.pytorch = pytorch;
        self.ratio = match (ours, pytorch) {
            (Some(o), Some(p)) if o > 0.0 && p > 0.0 => Some(if self.unit == Unit::Seconds {
                p / o
            } else {
                o / p
            }),
            _ => None,
        };
        self
    }

    fn target(mut self, target: Target) -> Self {
        self.target = Some(target);
        self
    }

    fn note(mut self, note: impl Into<String>) -> Self {
        self.note = note.into();
        self
    }

    fn meets_target(&self) -> Option<bool> {
        match self.target? {
            Target::Ratio(t) => self.ratio.map(|r| r >= t),
            Target::Ours(t) => self.ours.map(|o| o >= t),
            Target::OursAtMost(t) => self.ours.map(|o| o <= t),
        }
    }

    fn target_text(&self) -> String {
        match self.target {
            Some(Target::Ratio(t)) => format!(">= {t}x"),
            Some(Target::Ours(t)) => format!(">= {t}"),
            Some(Target::OursAtMost(t)) => format!("<= {}", self.unit.show(t)),
            None => String::new(),
        }
    }

    fn json(&self) -> String {
        let num = |v: Option<f64>| match v {
            Some(x) if x.is_finite() => format!("{x}"),
            _ => "null".to_string(),
        };
        let (target, target_on) = match self.target {
            Some(Target::Ratio(t)) => (Some(t), "\"ratio\""),
            Some(Target::Ours(t)) => (Some(t), "\"ours\""),
            Some(Target::OursAtMost(t)) => (Some(t), "\"ours_at_most\""),
            None => (None, "null"),
        };
        format!(
            "{{\"group\":{},\"name\":{},\"unit\":{},\"ours\":{},\"pytorch\":{},\"ratio\":{},\
             \"target\":{},\"target_on\":{target_on},\"meets_target\":{},\"note\":{}}}",
            json_str(self.group.name()),
            json_str(&self.name),
            json_str(self.unit.label()),
            num(self.ours),
            num(self.pytorch),
            num(self.ratio),
            num(target),
            self.meets_target()
                .map_or("null".to_string(), |b| b.to_string()),
            json_str(&self.note)
        )
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Where and how this run works.
struct Ctx {
    root: PathBuf,
    python: PathBuf,
    /// `target/xtask-bench`
    dir: PathBuf,
    quick: bool,
    warmup: usize,
    steps: usize,
}

impl Ctx {
    fn log_path(&self, name: &str) -> PathBuf {
        self.dir.join("logs").join(format!("{name}.log"))
    }

    /// Runs `cmd` in the project root, stdout and stderr to `logs/<name>.log`; returns stdout.
    fn capture(&self, name: &str, mut cmd: Command) -> Result<String> {
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
    fn build_bench(&self, package: &str, name: &str) -> Result<PathBuf> {
        say(&format!("building {package} bench {name} (release)"));
        let mut cmd = crate::cargo();
        cmd.current_dir(&self.root)
            .args([
                "bench",
                "--no-run",
                "--message-format=json-render-diagnostics",
            ])
            .args(["-p", package, "--bench", name])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let line = format!("{cmd:?}");
        let out = cmd
            .output()
            .with_context(|| format!("cannot start {line}"))?;
        if !out.status.success() {
            bail!("{line} failed ({})", out.status);
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        stdout
            .lines()
            .find_map(|l| bench_executable(l, name))
            .with_context(|| format!("{line} reported no executable for bench {name}"))
    }

    fn python(&self) -> Command {
        let mut cmd = Command::new(&self.python);
        cmd.env("OMP_NUM_THREADS", "1");
        cmd
    }

    fn criterion_dir(&self) -> PathBuf {
        self.dir.join("criterion")
    }

    /// Runs a criterion bench binary with this run's settings.
    fn criterion(&self, name: &str, exe: &Path, extra_env: &[(&str, &str)]) -> Result<String> {
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
    fn criterion_median(&self, id: &str) -> Result<f64> {
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

/// Runs `cargo xtask bench`.
pub fn run(root: &Path, args: BenchArgs) -> Result<()> {
    let started = Instant::now();
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
        [
            Group::Sampler,
            Group::Data,
            Group::Comm,
            Group::Ddp,
            Group::Train,
            Group::Overlap,
        ]
        .into()
    } else {
        args.only.iter().copied().collect()
    };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut loads = vec![("start".to_string(), load_average())];
    if args.json {
        println!(
            "{{\"group\":\"meta\",\"name\":\"start\",\"cores\":{cores},\"load_average\":{},\
             \"quick\":{},\"warmup_steps\":{},\"timed_steps\":{}}}",
            json_str(&loads[0].1),
            ctx.quick,
            ctx.warmup,
            ctx.steps
        );
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
            Group::Sampler => sampler(&ctx),
            Group::Data => data(&ctx),
            Group::Comm => comm(&ctx),
            Group::Ddp => ddp_only(&ctx),
            Group::Train => train(&ctx, groups.contains(&Group::Ddp)),
            Group::Overlap => overlap(&ctx),
        };
        let new_rows = match result {
            Ok(r) => r,
            Err(e) => {
                let msg = format!("{e:#}");
                say(&format!("{} failed: {msg}", group.name()));
                failures.push(group.name());
                let first = msg.lines().next().unwrap_or("").to_string();
                vec![Row::new(group, "(did not run)", Unit::Fraction).note(first)]
            }
        };
        if args.json {
            for r in &new_rows {
                println!("{}", r.json());
            }
        }
        rows.extend(new_rows);
        loads.push((format!("after {}", group.name()), load_average()));
    }
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        let loads_json: Vec<String> = loads
            .iter()
            .map(|(k, v)| format!("{}:{}", json_str(k), json_str(v)))
            .collect();
        println!(
            "{{\"group\":\"meta\",\"name\":\"end\",\"seconds\":{seconds:.1},\"load_average\":{{{}}}}}",
            loads_json.join(",")
        );
    } else {
        rows.sort_by_key(|r| r.group);
        print_table(&rows);
        println!(
            "\n{cores} cores; load average (1, 5, 15 min): {}; {seconds:.0} s in all{}",
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
    if !failures.is_empty() {
        bail!(
            "benchmark group(s) failed: {} (see the messages above)",
            failures.join(", ")
        );
    }
    Ok(())
}

/// Makes sure libtorch is installed (the benches link it), quietly when it already is, so
/// that `--json` output holds nothing but JSON.
fn ensure_setup(root: &Path) -> Result<setup::Deps> {
    let deps = setup::Deps::new(root);
    if deps.installed_version().as_deref() == Some(setup::TORCH_VERSION) {
        return Ok(deps);
    }
    setup::run(root, &setup::SetupArgs::default())
}

fn say(msg: &str) {
    eprintln!("bench: {msg}");
}

fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_string())
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The executable of bench target `name` if `line` is cargo's `compiler-artifact` message
/// (`--message-format=json`) for it; `None` for any other line, JSON or not.
fn bench_executable(line: &str, name: &str) -> Option<PathBuf> {
    let msg: serde_json::Value = serde_json::from_str(line).ok()?;
    let target = &msg["target"];
    let is_bench = target["kind"]
        .as_array()
        .is_some_and(|kinds| kinds.iter().any(|k| k == "bench"));
    (msg["reason"] == "compiler-artifact" && is_bench && target["name"] == name)
        .then(|| msg["executable"].as_str().map(PathBuf::from))
        .flatten()
}

/// The median's point estimate in criterion's `estimates.json` (nanoseconds).
fn median_point_estimate(estimates: &str) -> Option<f64> {
    let v: serde_json::Value = serde_json::from_str(estimates).ok()?;
    v["median"]["point_estimate"].as_f64()
}

/// The value of `key=value` in a whitespace-separated line.
fn kv<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

fn kv_f64(line: &str, key: &str) -> Option<f64> {
    kv(line, key)?.parse().ok()
}

fn script(ctx: &Ctx, crate_dir: &str, name: &str) -> Result<PathBuf> {
    let path = ctx.root.join(crate_dir).join("benches").join(name);
    if !path.exists() {
        bail!("{} is missing", path.display());
    }
    Ok(path)
}

// ---------------------------------------------------------------------------------------
// sampler

fn sampler(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-sampler", "sampler")?;
    say("sampler: ours (criterion)");
    ctx.criterion("sampler", &exe, &[])?;
    say("sampler: PyTorch DistributedSampler");
    let mut cmd = ctx.python();
    cmd.arg(script(ctx, "ddp-sampler", "reference_sampler.py")?)
        .args(["--runs", if ctx.quick { "3" } else { "7" }]);
    let reference = ctx.capture("sampler-pytorch", cmd)?;
    let mut rows = Vec::new();
    for (n, label) in [(1_000_000usize, "10^6"), (10_000_000, "10^7")] {
        let ours = ctx.criterion_median(&format!("epoch_indices/shuffle_r8/{n}"))?;
        let theirs = reference
            .lines()
            .find(|l| kv(l, "n") == Some(&n.to_string()))
            .and_then(|l| kv_f64(l, "median_s"));
        rows.push(
            Row::new(
                Group::Sampler,
                format!("one epoch's indices, N={label}, rank 0 of 8"),
                Unit::Seconds,
            )
            .pair(Some(ours), theirs)
            .target(Target::Ratio(5.0))
            .note("PyTorch: DistributedSampler(shuffle=True), list(iter(sampler))"),
        );
    }
    Ok(rows)
}

// ---------------------------------------------------------------------------------------
// data

/// Installs torchvision into the setup's venv if it is not there (benchmarks only).
fn ensure_torchvision(ctx: &Ctx) -> Result<()> {
    let probe = Command::new(&ctx.python)
        .args(["-c", "import torchvision"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("cannot start {}", ctx.python.display()))?;
    if probe.success() {
        return Ok(());
    }
    say(&format!(
        "installing torchvision=={TORCHVISION_VERSION} into {} (for the PyTorch side of the \
         benchmarks only; `cargo xtask setup` does not install it)",
        ctx.python.display()
    ));
    let status = Command::new(&ctx.python)
        .args(["-m", "pip", "install", "--quiet"])
        .arg(format!("torchvision=={TORCHVISION_VERSION}"))
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .with_context(|| format!("cannot start {} -m pip", ctx.python.display()))?;
    if !status.success() {
        bail!("installing torchvision=={TORCHVISION_VERSION} failed ({status})");
    }
    Ok(())
}

fn data(ctx: &Ctx) -> Result<Vec<Row>> {
    ensure_torchvision(ctx)?;
    let exe = ctx.build_bench("ddp-data", "pipeline")?;
    say("data: ours (criterion, 1 thread)");
    // The bench would also run torchvision when it finds a Python; here xtask runs it, once
    // per malloc setting, so the bench is pointed at none.
    ctx.criterion(
        "data",
        &exe,
        &[(
            "DDP_BENCH_PYTHON",
            "/nonexistent/xtask-runs-torchvision-itself",
        )],
    )?;
    let images_dir = ctx.root.join("target").join("ddp-data-bench");
    let mut images: Vec<PathBuf> = fs::read_dir(&images_dir)
        .with_context(|| format!("the data bench wrote no images in {}", images_dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("odir_like_") && n.ends_with(".jpg"))
        })
        .collect();
    images.sort();
    if images.is_empty() {
        bail!("no odir_like_*.jpg images in {}", images_dir.display());
    }
    let pipeline = script(ctx, "ddp-data", "reference_pipeline.py")?;
    let mut runs = Vec::new();
    for (tuned, label) in [(false, "default"), (true, "malloc-tuned")] {
        say(&format!("data: torchvision, {label} malloc"));
        let mut cmd = ctx.python();
        cmd.arg(&pipeline).args(&images);
        if tuned {
            // Keeps glibc from returning the large decode buffers to the OS every image.
            cmd.env("MALLOC_MMAP_THRESHOLD_", "268435456")
                .env("MALLOC_TRIM_THRESHOLD_", "268435456");
        }
        let out = ctx.capture(&format!("data-torchvision-{label}"), cmd)?;
        runs.push(out);
    }
    // Lines: `mode width img_per_s`.
    let find = |run: &str, mode: &str, size: u32| -> Option<f64> {
        run.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 3 && f[0] == mode && f[1] == size.to_string())
                .then(|| f[2].parse().ok())
                .flatten()
        })
    };
    let mut rows = Vec::new();
    for size in [512u32, 2048] {
        let ours =
            1.0 / ctx.criterion_median(&format!("decode_crop_resize_to_tensor/{size}x{size}"))?;
        let (d0, d1) = (
            find(&runs[0], "default", size),
            find(&runs[1], "default", size),
        );
        let (f0, f1) = (find(&runs[0], "draft", size), find(&runs[1], "draft", size));
        let best = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
        let show = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.0}"));
        rows.push(
            Row::new(
                Group::Data,
                format!("decode+crop+resize+to-tensor {size}px, 1 thread, vs torchvision"),
                Unit::ImagesPerSec,
            )
            .pair(Some(ours), best(d0, d1))
            .target(Target::Ratio(2.0))
            .note(format!(
                "torchvision default {} img/s, with raised malloc thresholds {}",
                show(d0),
                show(d1)
            )),
        );
        rows.push(
            Row::new(
                Group::Data,
                format!("decode+crop+resize+to-tensor {size}px, 1 thread, vs PIL draft"),
                Unit::ImagesPerSec,
            )
            .pair(Some(ours), best(f0, f1))
            .target(Target::Ratio(1.3))
            .note(format!(
                "torchvision + PIL draft {} img/s, with raised malloc thresholds {}",
                show(f0),
                show(f1)
            )),
        );
    }
    rows.extend(loader(ctx)?);
    Ok(rows)
}

/// The loader bench: training-thread hand-off per batch and throughput with 1 and 2 threads.
fn loader(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-data", "loader")?;
    say("data: the loader (hand-off per batch, 1 and 2 threads)");
    let mut cmd = Command::new(&exe);
    cmd.args(["--batches", if ctx.quick { "6" } else { "16" }])
        .env("OMP_NUM_THREADS", "1");
    let out = ctx.capture("data-loader", cmd)?;
    let metric = |name: &str| -> Option<f64> {
        out.lines()
            .filter(|l| l.starts_with("RESULT loader "))
            .find(|l| kv(l, "metric") == Some(name))
            .and_then(|l| kv_f64(l, "value"))
    };
    let show = |v: Option<f64>, unit: Unit| v.map_or("-".to_string(), |x| unit.show(x));
    let mut rows = vec![Row::new(
        Group::Data,
        "loader hand-off per 64x224 batch, batch ready -> tensors on the CPU device",
        Unit::Seconds,
    )
    .pair(metric("handoff_f32_s"), None)
    .target(Target::OursAtMost(0.0005))
    .note(format!(
        "the previous copying hand-off {}; bytes converted on the training thread {}",
        show(metric("handoff_copying_s"), Unit::Seconds),
        show(metric("handoff_u8_convert_on_cpu_s"), Unit::Seconds)
    ))];
    for (storage, what) in [
        ("f32", "f32 batches (CPU path)"),
        ("u8", "byte batches (GPU path)"),
    ] {
        let one = metric(&format!("throughput_{storage}_1_threads"));
        let two = metric(&format!("throughput_{storage}_2_threads"));
        rows.push(
            Row::new(
                Group::Data,
                format!("loader throughput, 512-px JPEGs, {what}, 2 threads"),
                Unit::ImagesPerSec,
            )
            .pair(two, None)
            .note(format!("1 thread {}", show(one, Unit::ImagesPerSec))),
        );
        let mut scaling = Row::new(
            Group::Data,
            format!("loader scaling 2 threads / 1 thread, {what}"),
            Unit::Fraction,
        );
        if let (Some(a), Some(b)) = (one, two) {
            scaling = scaling.pair(Some(b / a), None);
        }
        rows.push(
            scaling
                .target(Target::Ours(1.8))
                .note("on an idle 2-core machine; other load lowers it"),
        );
    }
    Ok(rows)
}

// ---------------------------------------------------------------------------------------
// comm

/// `RESULT <label>|<seconds>|<value>` lines (the collectives bench's and Gloo's format).
fn result_lines(text: &str) -> Vec<(String, f64, f64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .filter_map(|l| {
            let mut parts = l.split('|');
            Some((
                parts.next()?.to_string(),
                parts.next()?.trim().parse().ok()?,
                parts.next()?.trim().parse().ok()?,
            ))
        })
        .collect()
}

fn comm(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-comm", "collectives")?;
    let world = 2;
    let mut ours = Vec::new();
    for (transport, what) in [("auto", "shared memory"), ("tcp", "TCP")] {
        say(&format!("comm: ours, 2 ranks on this machine over {what}"));
        let mut args = vec!["--bench".to_string()];
        if ctx.quick {
            args.push("--quick".to_string());
        }
        args.extend(["--transport".to_string(), transport.to_string()]);
        // The bench's own rank protocol: the ranks are this binary with DDP_BENCH_WORKER
        // set; rank 0 prints the RESULT lines.
        let name = format!("comm-{transport}");
        let outs = run_ranks(ctx, &name, &exe, &args, world, &[("DDP_BENCH_WORKER", "1")])?;
        let lines = result_lines(&outs[0]);
        if lines.is_empty() {
            bail!(
                "the collectives bench printed no RESULT line (see {})",
                ctx.dir.join(format!("logs/{name}/rank-0.out")).display()
            );
        }
        ours.push((what, lines));
    }
    say("comm: PyTorch Gloo, 2 ranks");
    let mut cmd = ctx.python();
    cmd.arg(script(ctx, "ddp-comm", "reference_gloo.py")?)
        .args([
            "--ranks",
            &world.to_string(),
            "--scale",
            if ctx.quick { "0.1" } else { "1.0" },
        ]);
    let gloo = result_lines(&ctx.capture("comm-gloo", cmd)?);
    let mut rows = Vec::new();
    for (what, lines) in &ours {
        rows.extend(comm_rows(what, lines, &gloo, *what == "shared memory"));
    }
    Ok(rows)
}

/// Table rows for one transport's RESULT lines next to Gloo's. `targets`: the issue's goals
/// (2x Gloo's bus bandwidth from 4 MiB up, 4 KiB latency at least Gloo's) apply to this
/// transport; the other one is shown for comparison.
fn comm_rows(
    what: &str,
    ours: &[(String, f64, f64)],
    gloo: &[(String, f64, f64)],
    targets: bool,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for (label, secs, value) in ours {
        let theirs = gloo.iter().find(|(l, _, _)| l == label);
        let median_note = || {
            format!(
                "median call {} ours, {} Gloo",
                Unit::Seconds.show(*secs),
                theirs.map_or("-".to_string(), |t| Unit::Seconds.show(t.1))
            )
        };
        if let Some(size) = label.strip_prefix("all_reduce ") {
            let big = ["4 MiB", "25 MiB", "64 MiB"].contains(&size);
            if size == "4 KiB" {
                let mut row = Row::new(
                    Group::Comm,
                    format!("all-reduce {size} f32, 2 ranks, {what}: median latency"),
                    Unit::Seconds,
                )
                .pair(Some(*secs), theirs.map(|t| t.1))
                .note("vs Gloo; ratio = Gloo time / ours");
                if targets {
                    row = row.target(Target::Ratio(1.0));
                }
                rows.push(row);
            } else {
                let mut row = Row::new(
                    Group::Comm,
                    format!("all-reduce {size} f32, 2 ranks, {what}: bus bandwidth"),
                    Unit::GigabytesPerSec,
                )
                .pair(Some(*value), theirs.map(|t| t.2))
                .note(median_note());
                if big && targets {
                    row = row.target(Target::Ratio(2.0));
                }
                rows.push(row);
            }
        } else if let Some(size) = label.strip_prefix("all_gather ") {
            rows.push(
                Row::new(
                    Group::Comm,
                    format!("all-gather {size} per rank, 2 ranks, {what}: bus bandwidth"),
                    Unit::GigabytesPerSec,
                )
                .pair(Some(*value), theirs.map(|t| t.2))
                .note(median_note()),
            );
        } else {
            rows.push(
                Row::new(
                    Group::Comm,
                    format!("{label}: ConvNet parameters (1.56 MB), 2 ranks, {what}"),
                    Unit::Seconds,
                )
                .pair(Some(*secs), theirs.map(|t| t.1))
                .note("median per broadcast, vs Gloo"),
            );
        }
    }
    rows
}

/// Starts `world` ranks of `exe` on loopback with `ddp-run` (quietly: each rank's output goes
/// to `logs/<name>/rank-<r>.out`) and returns each rank's output; the first rank to fail ends
/// the others.
fn run_ranks(
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
        ddp_run::Outcome::Interrupted { signal } => {
            bail!(
                "interrupted by signal {signal} while running {}",
                exe.display()
            )
        }
        ddp_run::Outcome::Stopped { .. } => bail!("{} stopped before the end", exe.display()),
    }
    (0..world)
        .map(|rank| {
            let log = logs.join(format!("rank-{rank}.out"));
            fs::read_to_string(&log).with_context(|| format!("cannot read {}", log.display()))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// ddp and train

/// One world size's result of `ddp_steps` or `reference_ddp.py`: the `RESULT` lines of all
/// its ranks.
struct Run {
    lines: Vec<String>,
}

impl Run {
    fn rank0(&self, key: &str) -> Option<f64> {
        self.lines
            .iter()
            .find(|l| kv(l, "rank") == Some("0"))
            .and_then(|l| kv_f64(l, key))
    }

    /// Medians of (buffer broadcast + gradient sync, broadcast, sync) per step, each step's
    /// time taken on the rank that reached the collective last: it waited least, so its
    /// time is the cost rather than the wait for a slower peer (the bench computes this).
    fn ddp_overhead(&self) -> Option<(f64, f64, f64)> {
        Some((
            self.rank0("ddp_overhead_median_s")?,
            self.rank0("bcast_cost_median_s")?,
            self.rank0("sync_cost_median_s")?,
        ))
    }
}

/// `RESULT <tag> ...` lines grouped by world size.
fn runs_by_world(text: &str, tag: &str) -> Vec<(usize, Run)> {
    let mut runs: Vec<(usize, Run)> = Vec::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with(&format!("RESULT {tag} ")))
    {
        let Some(world) = kv(line, "world").and_then(|w| w.parse().ok()) else {
            continue;
        };
        match runs.iter_mut().find(|(w, _)| *w == world) {
            Some((_, run)) => run.lines.push(line.to_string()),
            None => runs.push((
                world,
                Run {
                    lines: vec![line.to_string()],
                },
            )),
        }
    }
    runs
}

fn get(runs: &[(usize, Run)], world: usize) -> Option<&Run> {
    runs.iter().find(|(w, _)| *w == world).map(|(_, r)| r)
}

/// The synthetic ODIR folder of `count` images of `size` px, generated once.
fn train_data(ctx: &Ctx, size: u32, count: usize) -> Result<PathBuf> {
    let dir = ctx.dir.join(format!("odir-{size}px-{count}"));
    let done = dir.join(".complete");
    if done.exists() {
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
    fs::write(&done, b"").with_context(|| format!("cannot write {}", done.display()))?;
    Ok(dir)
}

fn steps_args(ctx: &Ctx, ranks: &str, data: Option<&Path>) -> Vec<String> {
    let mut args = vec![
        "--ranks".to_string(),
        ranks.to_string(),
        "--warmup".to_string(),
        ctx.warmup.to_string(),
        "--steps".to_string(),
        ctx.steps.to_string(),
        "--batch-size".to_string(),
        "16".to_string(),
        "--image-size".to_string(),
        "224".to_string(),
    ];
    if let Some(d) = data {
        args.push("--data".to_string());
        args.push(d.display().to_string());
    }
    args
}

fn ddp_rows(run: &Run) -> Vec<Row> {
    let Some((total, bcast, sync)) = run.ddp_overhead() else {
        return vec![Row::new(Group::Ddp, "(no per-phase times)", Unit::Seconds)];
    };
    let step = run.rank0("step_median_s").unwrap_or(f64::NAN);
    let allreduce = run.rank0("allreduce_median_s");
    let bytes = run.rank0("grad_bytes").unwrap_or(f64::NAN);
    let mb = bytes / 1e6;
    let mut rows = vec![
        Row::new(
            Group::Ddp,
            "DDP overhead per step (buffer broadcast + gradient sync), 2 ranks",
            Unit::Seconds,
        )
        .pair(Some(total), None)
        .note(format!(
            "{:.2}% of a {} step; PyTorch overlaps its all-reduce with backward, so it has no \
             separate figure",
            100.0 * total / step,
            Unit::Seconds.show(step)
        )),
        Row::new(
            Group::Ddp,
            "  buffer broadcast (BatchNorm statistics)",
            Unit::Seconds,
        )
        .pair(Some(bcast), None),
        Row::new(
            Group::Ddp,
            format!("  gradient sync: bucket copy + all-reduce {mb:.2} MB + copy back"),
            Unit::Seconds,
        )
        .pair(Some(sync), None),
    ];
    if let Some(a) = allreduce {
        rows.push(
            Row::new(
                Group::Ddp,
                format!("  all-reduce of {mb:.2} MB alone (flat tensor)"),
                Unit::Seconds,
            )
            .pair(Some(a), None)
            .note(format!(
                "so bucket copies take about {}",
                Unit::Seconds.show((sync - a).max(0.0))
            )),
        );
    }
    rows
}

/// `ddp` without `train`: one 2-rank run on random tensors.
fn ddp_only(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-train", "ddp_steps")?;
    say(&format!(
        "ddp: ours, 2 ranks, random tensors, {} + {} steps",
        ctx.warmup, ctx.steps
    ));
    let mut cmd = Command::new(&exe);
    cmd.arg("--bench").args(steps_args(ctx, "2", None));
    let out = ctx.capture("ddp-ours", cmd)?;
    let runs = runs_by_world(&out, "ddp_steps");
    let run = runs
        .iter()
        .find(|(w, _)| *w == 2)
        .map(|(_, r)| r)
        .context("ddp_steps printed no 2-rank result")?;
    Ok(ddp_rows(run))
}

/// What one pair of training runs (ours, PyTorch's) feeds the ConvNet, and how.
struct TrainSource {
    label: String,
    /// Names the log files.
    tag: String,
    data: Option<PathBuf>,
    /// Extra environment of both sides' processes.
    env: &'static [(&'static str, &'static str)],
    target: Option<f64>,
}

/// glibc settings that keep freed memory in the heap instead of returning it to the OS: the
/// ConvNet's activations (up to 100 MB each) are otherwise mmap'ed and unmapped on every
/// use, and the kernel zeroes their pages again on every step.
const MALLOC_KEEP: &[(&str, &str)] = &[
    ("MALLOC_MMAP_MAX_", "0"),
    ("MALLOC_TRIM_THRESHOLD_", "17179869184"),
];

fn train(ctx: &Ctx, with_ddp: bool) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-train", "ddp_steps")?;
    ensure_torchvision(ctx)?;
    let reference = script(ctx, "ddp-train", "reference_ddp.py")?;
    let mut sources = vec![TrainSource {
        label: "random tensors".to_string(),
        tag: "random".to_string(),
        data: None,
        env: &[],
        target: Some(1.0),
    }];
    for (size, count) in TRAIN_IMAGES {
        sources.push(TrainSource {
            label: format!("{size}-px JPEGs"),
            tag: format!("jpeg{size}"),
            data: Some(train_data(ctx, size, count)?),
            env: &[],
            target: (size == 2048).then_some(1.15),
        });
    }
    // Not the product's default: shows what the allocator costs both sides.
    sources.push(TrainSource {
        label: "random tensors, MALLOC_MMAP_MAX_=0".to_string(),
        tag: "random-malloc-kept".to_string(),
        data: None,
        env: MALLOC_KEEP,
        target: None,
    });
    let mut rows = Vec::new();
    for source in &sources {
        let (label, data) = (&source.label, source.data.as_deref());
        say(&format!(
            "train: ours, {label}, 1 and 2 ranks, {} + {} steps each",
            ctx.warmup, ctx.steps
        ));
        let mut cmd = Command::new(&exe);
        cmd.arg("--bench")
            .args(steps_args(ctx, "1,2", data))
            .envs(source.env.iter().copied());
        let ours_out = ctx.capture(&format!("train-ours-{}", source.tag), cmd)?;
        say(&format!(
            "train: PyTorch DDP (Gloo), {label}, 1 and 2 ranks"
        ));
        let mut cmd = ctx.python();
        cmd.arg(&reference)
            .args(steps_args(ctx, "1,2", data))
            .envs(source.env.iter().copied());
        let theirs_out = ctx.capture(&format!("train-pytorch-{}", source.tag), cmd)?;
        let ours = runs_by_world(&ours_out, "ddp_steps");
        let theirs = runs_by_world(&theirs_out, "reference_ddp");
        for world in [1usize, 2] {
            let (o, t) = (get(&ours, world), get(&theirs, world));
            let phases = |r: Option<&Run>| {
                r.map_or("-".to_string(), |r| {
                    format!(
                        "step {:.2} s = data {:.2} + compute {:.2}",
                        r.rank0("step_median_s").unwrap_or(f64::NAN),
                        r.rank0("data_median_s").unwrap_or(f64::NAN),
                        r.rank0("compute_median_s").unwrap_or(f64::NAN)
                    )
                })
            };
            let mut row = Row::new(
                Group::Train,
                format!(
                    "ConvNet 224px, batch 16/rank, 1 thread/rank, {label}, {world} rank{}",
                    if world > 1 { "s" } else { "" }
                ),
                Unit::ImagesPerSec,
            )
            .pair(
                o.and_then(|r| r.rank0("images_per_sec")),
                t.and_then(|r| r.rank0("images_per_sec")),
            )
            .note(format!("ours: {}; PyTorch: {}", phases(o), phases(t)));
            if let Some(target) = source.target {
                row = row.target(Target::Ratio(target));
            }
            rows.push(row);
        }
        let efficiency = |runs: &[(usize, Run)]| {
            let one = get(runs, 1)?.rank0("images_per_sec")?;
            let two = get(runs, 2)?.rank0("images_per_sec")?;
            Some(two / (2.0 * one))
        };
        let mut row = Row::new(
            Group::Train,
            format!("scaling efficiency 2 ranks / (2 x 1 rank), {label}"),
            Unit::Fraction,
        )
        .pair(efficiency(&ours), efficiency(&theirs));
        if source.env.is_empty() {
            row = row.target(Target::Ours(0.95));
        }
        rows.push(row);
        if data.is_none() && source.env.is_empty() && with_ddp {
            if let Some(run) = get(&ours, 2) {
                rows.extend(ddp_rows(run));
            }
        }
    }
    Ok(rows)
}

// ---------------------------------------------------------------------------------------
// overlap

/// The communication-heavy step: 10 `Linear(2048, 2048)` layers (42 M parameters, 168 MB
/// of gradients) on a batch of 16 per rank.
const OVERLAP_MODEL: [&str; 6] = ["--layers", "10", "--width", "2048", "--batch", "16"];
/// The step under the bandwidth cap: 4 `Linear(1024, 1024)` layers (4.2 M parameters,
/// 16.8 MB of gradients: 0.27 s of all-reduce at 1 Gbit/s, since both ranks' traffic shares
/// loopback's one queue), with a batch large enough (1536) that backward takes about as
/// long, so that there is something to overlap with, and 4 MiB buckets on both sides (one
/// per layer): DDP's default 25 MiB would hold the whole model in one bucket, which nothing
/// can overlap.
const CAPPED_MODEL: [&str; 8] = [
    "--layers",
    "4",
    "--width",
    "1024",
    "--batch",
    "1536",
    "--bucket-cap-mb",
    "4",
];
/// tc's token bucket filter that caps loopback: 1 Gbit/s.
const LOOPBACK_TBF: [&str; 7] = ["tbf", "rate", "1gbit", "burst", "256kb", "latency", "50ms"];
/// Removes the cap once the process whose id is `$1` has ended (xtask killed by a signal).
const CAP_WATCHER: &str = "trap '' INT HUP TERM; while kill -0 \"$1\" 2>/dev/null; do \
                           sleep 1; done; tc qdisc del dev lo root 2>/dev/null";

fn overlap(ctx: &Ctx) -> Result<Vec<Row>> {
    let exe = ctx.build_bench("ddp-train", "overlap")?;
    let reference = script(ctx, "ddp-train", "reference_overlap.py")?;
    let mut rows = Vec::new();
    // PyTorch runs between our two transports, so that a change of load over the run does
    // not favour one side.
    let ours_shm = overlap_ours(ctx, &exe, &OVERLAP_MODEL, "auto", "overlap-ours-shm")?;
    say("overlap: PyTorch DDP (Gloo over loopback TCP), all-reduce and bf16_compress_hook");
    let theirs = overlap_pytorch(ctx, &reference, &OVERLAP_MODEL, "overlap-pytorch")?;
    let ours_tcp = overlap_ours(ctx, &exe, &OVERLAP_MODEL, "tcp", "overlap-ours-tcp")?;
    rows.extend(overlap_rows("shared memory", &ours_shm, &theirs, false));
    rows.extend(overlap_rows("TCP", &ours_tcp, &theirs, false));
    let capped = "TCP capped at 1 Gbit/s";
    match LoopbackCap::install() {
        Err(why) => rows.push(
            Row::new(
                Group::Overlap,
                format!("{capped} (tc tbf on lo): skipped"),
                Unit::StepsPerSec,
            )
            .note(why),
        ),
        Ok(cap) => {
            say(&format!(
                "overlap: ours and PyTorch DDP, {capped} (`tc qdisc show dev lo` while it runs)"
            ));
            let ours = overlap_ours(ctx, &exe, &CAPPED_MODEL, "tcp", "overlap-ours-capped");
            let theirs = ours
                .as_ref()
                .ok()
                .map(|_| overlap_pytorch(ctx, &reference, &CAPPED_MODEL, "overlap-pytorch-capped"));
            cap.remove()?;
            let (ours, theirs) = (ours?, theirs.context("not run")??);
            rows.extend(overlap_rows(capped, &ours, &theirs, true));
        }
    }
    Ok(rows)
}

/// Our 2 ranks over `transport` (`auto`: shared memory; `tcp`), every configuration; rank
/// 0's output.
fn overlap_ours(
    ctx: &Ctx,
    exe: &Path,
    model: &[&str],
    transport: &str,
    name: &str,
) -> Result<String> {
    say(&format!(
        "overlap: ours, 2 ranks, DDP_TRANSPORT={transport}, overlapped / not / bf16 taking \
         turns, {} + {} steps each",
        ctx.warmup, ctx.steps
    ));
    let mut args: Vec<String> = model.iter().map(|s| s.to_string()).collect();
    args.extend(overlap_steps(ctx));
    args.extend(["--configs".into(), "overlap,no-overlap,bf16".into()]);
    // Both sides keep freed memory (the ddp-train binary's setting): the comparison is DDP's.
    let mut env = vec![("DDP_TRANSPORT", transport)];
    env.extend(MALLOC_KEEP.iter().copied());
    let outs = run_ranks(ctx, name, exe, &args, 2, &env)?;
    Ok(outs.into_iter().next().unwrap_or_default())
}

fn overlap_pytorch(ctx: &Ctx, reference: &Path, model: &[&str], name: &str) -> Result<String> {
    let mut cmd = ctx.python();
    cmd.arg(reference)
        .args(model)
        .args(overlap_steps(ctx))
        .args(["--ranks", "2", "--configs", "overlap,bf16"])
        .envs(MALLOC_KEEP.iter().copied());
    ctx.capture(name, cmd)
}

fn overlap_steps(ctx: &Ctx) -> [String; 4] {
    [
        "--warmup".into(),
        ctx.warmup.to_string(),
        "--steps".into(),
        ctx.steps.to_string(),
    ]
}

/// `key` of rank 0's `RESULT <tag> config=<config> ...` line.
fn overlap_value(text: &str, tag: &str, config: &str, key: &str) -> Option<f64> {
    let prefix = format!("RESULT {tag} ");
    text.lines()
        .filter(|l| l.starts_with(&prefix))
        .find(|l| kv(l, "config") == Some(config) && kv(l, "rank") == Some("0"))
        .and_then(|l| kv_f64(l, key))
}

/// The rows of one transport: ours overlapped, not overlapped and bf16-compressed next to
/// PyTorch DDP, and the share of the communication the overlap hides. `capped`: the
/// bandwidth-limited targets (ours >= PyTorch, half the communication hidden) instead of
/// 1.3x PyTorch.
fn overlap_rows(what: &str, ours: &str, theirs: &str, capped: bool) -> Vec<Row> {
    let o = |config: &str, key: &str| overlap_value(ours, "overlap", config, key);
    let t = |config: &str, key: &str| overlap_value(theirs, "reference_overlap", config, key);
    let s = |v: Option<f64>| v.map_or("-".to_string(), |x| Unit::Seconds.show(x));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}x", a / b),
        _ => "-".to_string(),
    };
    let model = match (o("overlap", "layers"), o("overlap", "width")) {
        (Some(l), Some(w)) => format!(
            "MLP {l}x Linear({w},{w}), {:.1}M params, batch {}/rank, {} MiB buckets",
            o("overlap", "parameters").unwrap_or(f64::NAN) / 1e6,
            o("overlap", "batch").unwrap_or(f64::NAN),
            o("overlap", "bucket_cap_mb").unwrap_or(f64::NAN)
        ),
        _ => "MLP".to_string(),
    };
    let (ov, noov) = (
        o("overlap", "step_median_s"),
        o("no-overlap", "step_median_s"),
    );
    let comm = o("no-overlap", "sync_cost_median_s");
    let hidden = match (ov, noov, comm) {
        (Some(a), Some(b), Some(c)) if c > 0.0 => Some((b - a) / c),
        _ => None,
    };
    let mut first = Row::new(
        Group::Overlap,
        format!("{model}, 2 ranks, {what}: ours overlapped vs PyTorch DDP"),
        Unit::StepsPerSec,
    )
    .pair(o("overlap", "steps_per_sec"), t("overlap", "steps_per_sec"))
    .target(Target::Ratio(if capped { 1.0 } else { 1.3 }))
    .note(format!(
        "step: ours {} = fwd+bwd {} + wait in sync_gradients {} + SGD {}; PyTorch {} = \
         fwd+bwd with its all-reduce {} + SGD {}",
        s(ov),
        s(o("overlap", "compute_median_s")),
        s(o("overlap", "sync_median_s")),
        s(o("overlap", "optim_median_s")),
        s(t("overlap", "step_median_s")),
        s(t("overlap", "compute_median_s")),
        s(t("overlap", "optim_median_s")),
    ));
    if capped {
        first.note = format!("{}; target: ours >= PyTorch under the cap", first.note);
    }
    let mut share = Row::new(
        Group::Overlap,
        format!("  {what}: share of the communication that overlapping hides"),
        Unit::Fraction,
    )
    .pair(hidden, None)
    .note(format!(
        "(not overlapped {} - overlapped {}) / communication {} (sync_gradients after \
         backward, on the rank that waited least); the {:.1} MB all-reduce alone {}",
        s(noov),
        s(ov),
        s(comm),
        o("overlap", "grad_bytes").unwrap_or(f64::NAN) / 1e6,
        s(o("overlap", "allreduce_median_s")),
    ));
    if capped {
        // overlapped <= not overlapped - 0.5 x communication
        share = share.target(Target::Ours(0.5));
    }
    vec![
        first,
        Row::new(
            Group::Overlap,
            format!("  {what}: ours not overlapped (overlap: false) vs PyTorch DDP"),
            Unit::StepsPerSec,
        )
        .pair(
            o("no-overlap", "steps_per_sec"),
            t("overlap", "steps_per_sec"),
        )
        .note(format!(
            "step {} = fwd+bwd {} + sync_gradients {} + SGD {}",
            s(noov),
            s(o("no-overlap", "compute_median_s")),
            s(o("no-overlap", "sync_median_s")),
            s(o("no-overlap", "optim_median_s")),
        )),
        share,
        Row::new(
            Group::Overlap,
            format!("  {what}: bf16_compress, ours overlapped vs PyTorch's bf16_compress_hook"),
            Unit::StepsPerSec,
        )
        .pair(o("bf16", "steps_per_sec"), t("bf16", "steps_per_sec"))
        .note(format!(
            "bf16 / plain all-reduce steps/s: ours {}, PyTorch {}; bf16 all-reduce alone {}",
            ratio(o("bf16", "steps_per_sec"), o("overlap", "steps_per_sec")),
            ratio(t("bf16", "steps_per_sec"), t("overlap", "steps_per_sec")),
            s(o("bf16", "allreduce_median_s")),
        )),
    ]
}

/// What `tc qdisc show dev lo` says is loopback's root queueing discipline.
#[derive(Debug, PartialEq)]
enum RootQdisc {
    /// Loopback's default (`noqueue`), or none shown.
    Default,
    /// A `tbf` at 1 Gbit/s: our cap, left by a run that could not remove it.
    OurCap,
    /// Something else, someone's own: the line.
    Other(String),
}

fn root_qdisc(shown: &str) -> RootQdisc {
    let Some(line) = shown
        .lines()
        .find(|l| l.split_whitespace().any(|w| w == "root"))
    else {
        return RootQdisc::Default;
    };
    match line.split_whitespace().nth(1) {
        Some("noqueue") => RootQdisc::Default,
        Some("tbf") if line.contains("rate 1Gbit ") => RootQdisc::OurCap,
        _ => RootQdisc::Other(line.trim().to_string()),
    }
}

/// Runs `tc args`; the error says why tc is not usable here.
fn tc(args: &[&str]) -> std::result::Result<String, String> {
    let out = Command::new("tc")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run tc ({e}); it is in iproute2"))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let hint = if err.contains("Operation not permitted") {
        " (changing qdiscs needs root)"
    } else if err.contains("unknown") || err.contains("No such file") {
        " (the kernel lacks the sch_tbf module)"
    } else {
        ""
    };
    Err(format!("`tc {}` failed: {err}{hint}", args.join(" ")))
}

/// Loopback capped at 1 Gbit/s while this lives: removed by [`LoopbackCap::remove`] or on
/// drop (an error, a panic, Ctrl-C while ranks run: `ddp_run::launch` turns it into an
/// error). A watcher process, in a process group of its own so that Ctrl-C at the terminal
/// does not reach it, removes the cap if xtask dies without dropping this (Ctrl-C while
/// PyTorch runs, SIGKILL). A cap left over from an earlier run is removed first.
struct LoopbackCap {
    watcher: Option<std::process::Child>,
    removed: bool,
}

impl LoopbackCap {
    fn install() -> std::result::Result<Self, String> {
        match root_qdisc(&tc(&["qdisc", "show", "dev", "lo"])?) {
            RootQdisc::Default => {}
            RootQdisc::OurCap => {
                say("overlap: removing a loopback cap left by an earlier run");
                tc(&["qdisc", "del", "dev", "lo", "root"])?;
            }
            RootQdisc::Other(line) => {
                return Err(format!(
                    "lo already has a root qdisc ({line}); not replacing it"
                ))
            }
        }
        let mut add = vec!["qdisc", "add", "dev", "lo", "root"];
        add.extend(LOOPBACK_TBF);
        tc(&add)?;
        let watcher = {
            use std::os::unix::process::CommandExt;
            Command::new("sh")
                .args(["-c", CAP_WATCHER, "xtask-loopback-cap"])
                .arg(std::process::id().to_string())
                .process_group(0)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()
        };
        Ok(LoopbackCap {
            watcher,
            removed: false,
        })
    }

    /// Removes the cap and checks that loopback is back to its default.
    fn remove(mut self) -> Result<()> {
        self.removed = true;
        let deleted = tc(&["qdisc", "del", "dev", "lo", "root"]);
        let shown = tc(&["qdisc", "show", "dev", "lo"]).map_err(anyhow::Error::msg)?;
        if root_qdisc(&shown) != RootQdisc::Default {
            bail!(
                "loopback is still capped ({}; {}); remove it with `tc qdisc del dev lo root`",
                shown.trim(),
                deleted.err().unwrap_or_default()
            );
        }
        Ok(())
    }
}

impl Drop for LoopbackCap {
    fn drop(&mut self) {
        if !self.removed {
            let _ = tc(&["qdisc", "del", "dev", "lo", "root"]);
        }
        if let Some(mut watcher) = self.watcher.take() {
            let _ = watcher.kill();
            let _ = watcher.wait();
        }
    }
}

fn print_table(rows: &[Row]) {
    let w_name = rows.iter().map(|r| r.name.len()).max().unwrap_or(10).max(9);
    println!(
        "\n{:<8} {:<w_name$} {:>14} {:>14} {:>8} {:>9} {:>6}  note",
        "group", "benchmark", "ours", "PyTorch", "ratio", "target", "met"
    );
    println!("{}", "-".repeat(8 + w_name + 14 + 14 + 8 + 9 + 6 + 12));
    for r in rows {
        let show = |v: Option<f64>| v.map_or("-".to_string(), |x| r.unit.show(x));
        println!(
            "{:<8} {:<w_name$} {:>14} {:>14} {:>8} {:>9} {:>6}  {}",
            r.group.name(),
            r.name,
            show(r.ours),
            show(r.pytorch),
            r.ratio.map_or("-".to_string(), |x| format!("{x:.2}x")),
            r.target_text(),
            match r.meets_target() {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "",
            },
            r.note
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_key_values_and_json_numbers() {
        let line = "RESULT ddp_steps world=2 rank=1 images_per_sec=17.25 loss=0.5";
        assert_eq!(kv(line, "rank"), Some("1"));
        assert_eq!(kv_f64(line, "images_per_sec"), Some(17.25));
        assert_eq!(kv(line, "images"), None);
    }

    #[test]
    fn reads_the_median_of_criterions_estimates() {
        // A real target/criterion/<id>/new/estimates.json (ddp-data's pipeline bench).
        let est = r#"{"mean":{"confidence_interval":{"confidence_level":0.95,"lower_bound":2088834.874524359,"upper_bound":2288911.6957277},"point_estimate":2193771.5949371606,"standard_error":51360.55027308042},"median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":2121140.476388889,"upper_bound":2363594.354166667},"point_estimate":2311712.284722222,"standard_error":79535.25508928086},"median_abs_dev":{"confidence_interval":{"confidence_level":0.95,"lower_bound":42280.83752853179,"upper_bound":353724.12491487834},"point_estimate":160025.01221353372,"standard_error":88667.10887949423},"slope":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1956673.8867580288,"upper_bound":2226308.3223324213},"point_estimate":2094645.6584785134,"standard_error":69091.05081165876},"std_dev":{"confidence_interval":{"confidence_level":0.95,"lower_bound":148913.72526702748,"upper_bound":286715.9272199052},"point_estimate":235334.55434624478,"standard_error":35137.58363691713}}"#;
        assert_eq!(median_point_estimate(est), Some(2311712.284722222));
        // Whitespace and key order do not matter; an integer is a number too.
        assert_eq!(
            median_point_estimate("{ \"median\" : { \"point_estimate\" : 12 },\n \"mean\": {} }"),
            Some(12.0)
        );
        assert_eq!(
            median_point_estimate(r#"{"mean":{"point_estimate":2.0}}"#),
            None
        );
        assert_eq!(median_point_estimate("not json"), None);
    }

    #[test]
    fn finds_the_bench_executable_in_cargos_messages() {
        let art = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/ddp-sampler#0.1.0","manifest_path":"/w/ddp-sampler/Cargo.toml","target":{"kind":["bench"],"crate_types":["bin"],"name":"sampler","src_path":"/w/ddp-sampler/benches/sampler.rs","edition":"2021","doc":false,"doctest":false,"test":false},"profile":{"opt_level":"3","debuginfo":1,"debug_assertions":false,"overflow_checks":false,"test":false},"features":[],"filenames":["/t/release/deps/sampler-1a"],"executable":"/t/release/deps/sampler-1a","fresh":true}"#;
        assert_eq!(
            bench_executable(art, "sampler"),
            Some(PathBuf::from("/t/release/deps/sampler-1a"))
        );
        assert_eq!(bench_executable(art, "loader"), None);
        // The library of the same package: an artifact, not a bench, no executable.
        let lib = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"sampler"},"executable":null,"fresh":true}"#;
        assert_eq!(bench_executable(lib, "sampler"), None);
        let done = r#"{"reason":"build-finished","success":true}"#;
        assert_eq!(bench_executable(done, "sampler"), None);
        assert_eq!(
            bench_executable("   Compiling sampler v0.1.0", "sampler"),
            None
        );
    }

    #[test]
    fn ratios_favour_us_when_higher() {
        let t = Row::new(Group::Sampler, "t", Unit::Seconds).pair(Some(0.01), Some(0.05));
        assert!((t.ratio.unwrap() - 5.0).abs() < 1e-12);
        let r = Row::new(Group::Train, "r", Unit::ImagesPerSec)
            .pair(Some(18.0), Some(12.0))
            .target(Target::Ratio(1.15));
        assert!((r.ratio.unwrap() - 1.5).abs() < 1e-12);
        assert_eq!(r.meets_target(), Some(true));
        let e = Row::new(Group::Train, "e", Unit::Fraction)
            .pair(Some(0.9), Some(0.8))
            .target(Target::Ours(0.95));
        assert_eq!(e.meets_target(), Some(false));
    }

    #[test]
    fn groups_results_by_world_and_finds_the_ddp_cost() {
        let text = "noise\n\
            RESULT ddp_steps world=1 rank=0 images_per_sec=9.0\n\
            RESULT ddp_steps world=2 rank=0 images_per_sec=17.0 ddp_overhead_median_s=0.006 \
            bcast_cost_median_s=0.004 sync_cost_median_s=0.002\n\
            RESULT ddp_steps world=2 rank=1 images_per_sec=17.1\n";
        let runs = runs_by_world(text, "ddp_steps");
        assert_eq!(runs.len(), 2);
        let (_, two) = runs.iter().find(|(w, _)| *w == 2).unwrap();
        assert_eq!(two.rank0("images_per_sec"), Some(17.0));
        let (total, bcast, sync) = two.ddp_overhead().unwrap();
        assert!((total - 0.006).abs() < 1e-12 && bcast == 0.004 && sync == 0.002);
    }

    #[test]
    fn comm_rows_put_targets_on_the_chosen_transport_only() {
        let ours = vec![
            ("all_reduce 4 KiB".to_string(), 10e-6, 0.5),
            ("all_reduce 64 MiB".to_string(), 0.02, 3.3),
            ("all_gather 4 MiB".to_string(), 0.003, 1.4),
            ("broadcast flat".to_string(), 0.0004, 1.56e6),
        ];
        let gloo = vec![
            ("all_reduce 4 KiB".to_string(), 600e-6, 0.01),
            ("all_reduce 64 MiB".to_string(), 0.05, 1.1),
        ];
        let shm = comm_rows("shared memory", &ours, &gloo, true);
        assert_eq!(shm.len(), 4);
        assert_eq!(
            shm[1].name,
            "all-reduce 64 MiB f32, 2 ranks, shared memory: bus bandwidth"
        );
        assert!((shm[1].ratio.unwrap() - 3.0).abs() < 1e-9);
        assert_eq!(shm[1].meets_target(), Some(true));
        assert!((shm[0].ratio.unwrap() - 60.0).abs() < 1e-9);
        assert_eq!(shm[2].ratio, None, "no Gloo all-gather line, no ratio");
        let tcp = comm_rows("TCP", &ours, &gloo, false);
        assert!(tcp.iter().all(|r| r.target.is_none()));
        assert!(tcp[3].name.ends_with("2 ranks, TCP"));
    }

    #[test]
    fn reads_loopbacks_root_qdisc() {
        assert_eq!(
            root_qdisc("qdisc noqueue 0: root refcnt 2 \n"),
            RootQdisc::Default
        );
        assert_eq!(root_qdisc(""), RootQdisc::Default);
        assert_eq!(
            root_qdisc("qdisc tbf 8001: root refcnt 2 rate 1Gbit burst 262125b lat 50ms \n"),
            RootQdisc::OurCap
        );
        assert_eq!(
            root_qdisc("qdisc netem 8002: root refcnt 2 limit 1000 delay 10ms\n"),
            RootQdisc::Other("qdisc netem 8002: root refcnt 2 limit 1000 delay 10ms".into())
        );
        // Someone's own tbf at another rate is theirs.
        assert!(matches!(
            root_qdisc("qdisc tbf 8001: root refcnt 2 rate 10Gbit burst 1Mb lat 50ms"),
            RootQdisc::Other(_)
        ));
    }

    #[test]
    fn overlap_rows_compare_configs_and_the_hidden_communication() {
        let ours = "RESULT overlap config=overlap transport=tcp world=2 rank=0 layers=4 \
            width=1024 batch=256 parameters=4198400 grad_bytes=16793600 bucket_cap_mb=4 \
            steps_per_sec=2.0 \
            step_median_s=0.5 compute_median_s=0.3 sync_median_s=0.15 optim_median_s=0.05 \
            allreduce_median_s=0.3\n\
            RESULT overlap config=overlap transport=tcp world=2 rank=1 steps_per_sec=9.0\n\
            RESULT overlap config=no-overlap transport=tcp world=2 rank=0 steps_per_sec=1.25 \
            step_median_s=0.8 compute_median_s=0.4 sync_median_s=0.35 \
            sync_cost_median_s=0.4 optim_median_s=0.05\n\
            RESULT overlap config=bf16 transport=tcp world=2 rank=0 steps_per_sec=3.0\n";
        let theirs = "RESULT reference_overlap config=overlap world=2 rank=0 \
            steps_per_sec=1.6 step_median_s=0.625\n\
            RESULT reference_overlap config=bf16 world=2 rank=0 steps_per_sec=2.4\n";
        let rows = overlap_rows("TCP capped", ours, theirs, true);
        assert_eq!(rows.len(), 4);
        assert!(rows[0]
            .name
            .starts_with("MLP 4x Linear(1024,1024), 4.2M params, batch 256/rank, 4 MiB buckets"));
        assert!((rows[0].ratio.unwrap() - 1.25).abs() < 1e-12);
        assert_eq!(rows[0].meets_target(), Some(true));
        assert!((rows[1].ratio.unwrap() - 1.25 / 1.6).abs() < 1e-12);
        // (0.8 - 0.5) / 0.4 of the communication hidden: more than half.
        assert!((rows[2].ours.unwrap() - 0.75).abs() < 1e-12);
        assert_eq!(rows[2].meets_target(), Some(true));
        assert!((rows[3].ratio.unwrap() - 1.25).abs() < 1e-12);
        assert!(rows[3].note.contains("ours 1.50x, PyTorch 1.50x"));
        // Uncapped: 1.3x PyTorch is the target, the hidden share is shown without one.
        let rows = overlap_rows("TCP", ours, theirs, false);
        assert_eq!(rows[0].meets_target(), Some(false));
        assert!(rows[2].target.is_none());
        // A side that printed nothing leaves its figures empty, not wrong.
        let rows = overlap_rows("TCP", ours, "", false);
        assert_eq!(rows[0].ratio, None);
    }

    #[test]
    fn json_lines_escape_and_use_null() {
        let r = Row::new(Group::Comm, "a \"b\"", Unit::GigabytesPerSec).pair(Some(1.5), None);
        let j = r.json();
        assert!(j.starts_with("{\"group\":\"comm\",\"name\":\"a \\\"b\\\"\""));
        assert!(j.contains("\"pytorch\":null") && j.contains("\"ratio\":null"));
        assert!(j.contains("\"meets_target\":null"));
    }
}
