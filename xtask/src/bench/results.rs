//! One run's results as data: the machine, the settings, the load averages and every
//! [`Row`], written as the JSON lines of `--json` (and `target/xtask-bench/results.jsonl`)
//! and read back from them, so that `BENCHMARKS.md` is rendered from a saved run
//! (`page.rs`).

use std::fmt;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::report::{Group, Row, Target, Unit};

/// The machine a run measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct Machine {
    /// The CPU's model name, as `/proc/cpuinfo` gives it.
    pub(super) cpu: String,
    /// Cores this process may use.
    pub(super) cores: usize,
    /// Memory in GiB, as `/proc/meminfo` gives it.
    pub(super) memory_gib: Option<f64>,
}

impl Machine {
    /// This machine.
    pub(super) fn this() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        Self {
            cpu: cpu_model(&read("/proc/cpuinfo")).unwrap_or_else(|| "unknown CPU".into()),
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            memory_gib: memory_gib(&read("/proc/meminfo")),
        }
    }
}

/// The first `model name` of a `/proc/cpuinfo` text, its runs of spaces made one.
fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "model name")
            .then(|| value.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|v| !v.is_empty())
    })
}

/// `MemTotal` of a `/proc/meminfo` text, in GiB.
fn memory_gib(meminfo: &str) -> Option<f64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / (1024.0 * 1024.0))
}

/// The first line `program args` prints in `dir`, when it runs and succeeds.
fn first_line(dir: &Path, program: &mut Command) -> Option<String> {
    let out = program
        .current_dir(dir)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().next()?.trim();
    (out.status.success() && !line.is_empty()).then(|| line.to_string())
}

/// What a run measured, besides the machine: the checkout's commit, the Rust compiler that
/// built our side, and the torch the references imported.
pub(super) struct Versions {
    pub(super) commit: String,
    pub(super) rustc: String,
    pub(super) torch: String,
}

impl Versions {
    /// Those of the checkout at `root`, with `python` (the references' Python, which
    /// `import torch` is asked).
    pub(super) fn of(root: &Path, mut python: Command) -> Self {
        let unknown = || UNKNOWN.to_string();
        Self {
            commit: first_line(
                root,
                Command::new("git").args(["describe", "--always", "--dirty", "--abbrev=12"]),
            )
            .unwrap_or_else(unknown),
            rustc: first_line(root, Command::new("rustc").arg("--version")).unwrap_or_else(unknown),
            torch: first_line(
                root,
                python.args(["-c", "import torch; print(torch.__version__)"]),
            )
            .unwrap_or_else(unknown),
        }
    }
}

/// What a version that could not be read, or that a saved run lacks, shows.
const UNKNOWN: &str = "unknown";

fn unknown() -> String {
    UNKNOWN.to_string()
}

/// The current time as `YYYY-MM-DD HH:MM UTC`.
pub(super) fn now_utc() -> String {
    let at = time::OffsetDateTime::now_utc();
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02} UTC",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute()
    )
}

/// What a run was asked to do, and on what: the first line of the JSON lines.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Start {
    pub(super) machine: Machine,
    /// When the run started, `YYYY-MM-DD HH:MM UTC`.
    pub(super) date: String,
    /// The version of PyTorch the references ran with, as `torch.__version__` gives it.
    pub(super) torch: String,
    /// The checkout, as `git describe --always --dirty` gives it (`-dirty`: with changes
    /// not committed).
    pub(super) commit: String,
    /// The Rust compiler, as `rustc --version` gives it in the checkout.
    pub(super) rustc: String,
    /// The 1, 5 and 15 minute load averages at the start.
    pub(super) load_average: String,
    pub(super) quick: bool,
    pub(super) warmup_steps: usize,
    pub(super) timed_steps: usize,
    /// The groups asked for, in the order they run.
    pub(super) groups: Vec<Group>,
}

/// A whole run: its start, the load average after each group, its length and its rows.
#[derive(Debug, Clone)]
pub(super) struct Results {
    pub(super) start: Start,
    /// `(when, load average)`: `start`, then `after <group>` for each group run.
    pub(super) loads: Vec<(String, String)>,
    pub(super) seconds: f64,
    pub(super) rows: Vec<Row>,
}

/// The first line as JSON, fields in this order.
#[derive(Serialize, Deserialize)]
struct StartLine {
    group: String,
    name: String,
    cpu: String,
    cores: usize,
    memory_gib: Option<f64>,
    date: String,
    torch: String,
    /// Absent in the runs of an older bench.
    #[serde(default = "unknown")]
    commit: String,
    #[serde(default = "unknown")]
    rustc: String,
    load_average: String,
    quick: bool,
    warmup_steps: usize,
    timed_steps: usize,
    groups: Vec<String>,
}

impl Start {
    /// The first line of `--json`.
    pub(super) fn json(&self) -> serde_json::Result<String> {
        serde_json::to_string(&StartLine {
            group: "meta".into(),
            name: "start".into(),
            cpu: self.machine.cpu.clone(),
            cores: self.machine.cores,
            // Hundredths of a GiB are plenty.
            memory_gib: self.machine.memory_gib.map(|g| (g * 100.0).round() / 100.0),
            date: self.date.clone(),
            torch: self.torch.clone(),
            commit: self.commit.clone(),
            rustc: self.rustc.clone(),
            load_average: self.load_average.clone(),
            quick: self.quick,
            warmup_steps: self.warmup_steps,
            timed_steps: self.timed_steps,
            groups: self.groups.iter().map(|g| g.name().to_string()).collect(),
        })
    }
}

/// The last line as JSON.
#[derive(Serialize, Deserialize)]
struct EndLine {
    group: String,
    name: String,
    /// Rounded to tenths.
    seconds: f64,
    load_average: Loads,
}

/// `(when, load average)` pairs as one JSON object, in their order (also when read back).
struct Loads(Vec<(String, String)>);

impl Serialize for Loads {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (when, load) in &self.0 {
            map.serialize_entry(when, load)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Loads {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct InOrder;
        impl<'de> Visitor<'de> for InOrder {
            type Value = Loads;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object of load averages")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Loads, A::Error> {
                let mut pairs = Vec::new();
                while let Some(pair) = map.next_entry::<String, String>()? {
                    pairs.push(pair);
                }
                Ok(Loads(pairs))
            }
        }
        deserializer.deserialize_map(InOrder)
    }
}

/// The last line of `--json`: `seconds` in all (in tenths) and the load averages `loads`.
pub(super) fn end_json(seconds: f64, loads: &[(String, String)]) -> serde_json::Result<String> {
    serde_json::to_string(&EndLine {
        group: "meta".into(),
        name: "end".into(),
        // Tenths as `{:.1}` rounds them.
        seconds: format!("{seconds:.1}").parse().unwrap_or(seconds),
        load_average: Loads(loads.to_vec()),
    })
}

/// A row line as JSON, read back.
#[derive(Deserialize)]
struct RowLine {
    group: String,
    name: String,
    unit: String,
    ours: Option<f64>,
    pytorch: Option<f64>,
    ratio: Option<f64>,
    target: Option<f64>,
    target_on: Option<String>,
    note: String,
}

impl RowLine {
    fn into_row(self) -> Result<Row> {
        let group = Group::from_name(&self.group)
            .with_context(|| format!("unknown group `{}`", self.group))?;
        let unit = Unit::from_label(&self.unit)
            .with_context(|| format!("unknown unit `{}`", self.unit))?;
        let target = match (self.target_on.as_deref(), self.target) {
            (None, None) => None,
            (Some("ratio"), Some(t)) => Some(Target::Ratio(t)),
            (Some("ours"), Some(t)) => Some(Target::Ours(t)),
            (Some("ours_at_most"), Some(t)) => Some(Target::OursAtMost(t)),
            (on, t) => bail!("a target of {t:?} on {on:?} is not one this bench writes"),
        };
        let mut row = Row::new(group, self.name, unit).note(self.note);
        row.ours = self.ours;
        row.pytorch = self.pytorch;
        row.ratio = self.ratio;
        row.target = target;
        Ok(row)
    }
}

impl Results {
    /// The run as JSON lines: the start, every row, the end; each line ends with `\n`.
    pub(super) fn json_lines(&self) -> serde_json::Result<String> {
        let mut out = self.start.json()? + "\n";
        for row in &self.rows {
            out += &(row.json()? + "\n");
        }
        out += &(end_json(self.seconds, &self.loads)? + "\n");
        Ok(out)
    }

    /// A run read back from its JSON lines (blank lines are skipped); it must have its start
    /// line first and its end line last.
    pub(super) fn from_json_lines(text: &str) -> Result<Self> {
        let lines: Vec<(usize, &str)> = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim()))
            .filter(|(_, l)| !l.is_empty())
            .collect();
        let (Some(&(first_no, first)), Some(&(last_no, last))) = (lines.first(), lines.last())
        else {
            bail!("no JSON lines");
        };
        let start: StartLine = serde_json::from_str(first).with_context(|| {
            format!(
                "line {first_no} is not the start line of a run of this `cargo xtask bench` \
                 (with cpu, date, torch and groups)"
            )
        })?;
        if (start.group.as_str(), start.name.as_str()) != ("meta", "start") {
            bail!("line {first_no} is not the start line (group meta, name start)");
        }
        let end: EndLine = serde_json::from_str(last)
            .with_context(|| format!("line {last_no} is not the end line of a run"))?;
        if lines.len() < 2 || (end.group.as_str(), end.name.as_str()) != ("meta", "end") {
            bail!("the last line ({last_no}) is not the end line (group meta, name end)");
        }
        let groups = start
            .groups
            .iter()
            .map(|g| Group::from_name(g).with_context(|| format!("unknown group `{g}`")))
            .collect::<Result<Vec<_>>>()?;
        let rows = lines[1..lines.len() - 1]
            .iter()
            .map(|&(no, line)| {
                serde_json::from_str::<RowLine>(line)
                    .map_err(anyhow::Error::from)
                    .and_then(RowLine::into_row)
                    .with_context(|| format!("line {no} is not a result row"))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            start: Start {
                machine: Machine {
                    cpu: start.cpu,
                    cores: start.cores,
                    memory_gib: start.memory_gib,
                },
                date: start.date,
                torch: start.torch,
                commit: start.commit,
                rustc: start.rustc,
                load_average: start.load_average,
                quick: start.quick,
                warmup_steps: start.warmup_steps,
                timed_steps: start.timed_steps,
                groups,
            },
            loads: end.load_average.0,
            seconds: end.seconds,
            rows,
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A small run of two groups, as the page's tests use it too.
    pub(in super::super) fn sample() -> Results {
        Results {
            start: Start {
                machine: Machine {
                    cpu: "Intel(R) Xeon(R) Processor".into(),
                    cores: 2,
                    memory_gib: Some(23.54),
                },
                date: "2026-12-02 09:14 UTC".into(),
                torch: "2.13.0+cpu".into(),
                commit: "b531284d1e0f-dirty".into(),
                rustc: "rustc 1.88.0 (6b00bc388 2025-06-23)".into(),
                load_average: "0.52 0.61 0.70".into(),
                quick: false,
                warmup_steps: 3,
                timed_steps: 12,
                groups: vec![Group::Sampler, Group::Ddp],
            },
            loads: vec![
                ("start".into(), "0.52 0.61 0.70".into()),
                ("after sampler".into(), "1.00 0.80 0.71".into()),
                ("after ddp".into(), "1.90 1.10 0.80".into()),
            ],
            seconds: 123.4,
            rows: vec![
                Row::new(
                    Group::Sampler,
                    "one epoch's indices, N=10^6, rank 0 of 8",
                    Unit::Seconds,
                )
                .pair(Some(0.00605), Some(0.0932))
                .target(Target::Ratio(5.0))
                .note("PyTorch: DistributedSampler | list"),
                Row::new(Group::Ddp, "  buffer broadcast", Unit::Seconds).pair(Some(0.004), None),
                Row::new(Group::Ddp, "eff", Unit::Fraction)
                    .pair(Some(0.9), Some(0.8))
                    .target(Target::Ours(0.95)),
            ],
        }
    }

    #[test]
    fn the_machine_is_read_from_proc() {
        let cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC  7B13 \
                       64-Core Processor\nprocessor\t: 1\nmodel name\t: other\n";
        assert_eq!(
            cpu_model(cpuinfo).as_deref(),
            Some("AMD EPYC 7B13 64-Core Processor")
        );
        assert_eq!(cpu_model("processor\t: 0\nmodel name\t:\n"), None);
        let meminfo = "MemTotal:       24683584 kB\nMemFree:         1000 kB\n";
        assert!((memory_gib(meminfo).unwrap() - 23.54).abs() < 0.01);
        assert_eq!(memory_gib("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn the_start_line_holds_the_machine_and_the_settings() {
        assert_eq!(
            sample().start.json().unwrap(),
            r#"{"group":"meta","name":"start","cpu":"Intel(R) Xeon(R) Processor","cores":2,"memory_gib":23.54,"date":"2026-12-02 09:14 UTC","torch":"2.13.0+cpu","commit":"b531284d1e0f-dirty","rustc":"rustc 1.88.0 (6b00bc388 2025-06-23)","load_average":"0.52 0.61 0.70","quick":false,"warmup_steps":3,"timed_steps":12,"groups":["sampler","ddp"]}"#
        );
        let loads = &sample().loads[..2];
        assert_eq!(
            end_json(123.44, loads).unwrap(),
            r#"{"group":"meta","name":"end","seconds":123.4,"load_average":{"start":"0.52 0.61 0.70","after sampler":"1.00 0.80 0.71"}}"#
        );
        assert!(end_json(120.0, loads)
            .unwrap()
            .contains(r#""seconds":120.0,"#));
    }

    #[test]
    fn a_run_reads_back_from_its_json_lines() {
        let run = sample();
        let text = run.json_lines().unwrap();
        assert_eq!(text.lines().count(), 5);
        let back = Results::from_json_lines(&format!("\n{text}\n")).unwrap();
        assert_eq!(back.start, run.start);
        // In their order, not sorted: "start" comes first.
        assert_eq!(back.loads, run.loads);
        assert_eq!(back.seconds, 123.4);
        assert_eq!(back.rows.len(), 3);
        for (a, b) in back.rows.iter().zip(&run.rows) {
            assert_eq!(
                (a.group, &a.name, a.unit, a.ours, a.pytorch, a.ratio, a.target, &a.note),
                (b.group, &b.name, b.unit, b.ours, b.pytorch, b.ratio, b.target, &b.note)
            );
        }
        assert_eq!(back.rows[0].meets_target(), Some(true));
        assert_eq!(back.rows[2].meets_target(), Some(false));
    }

    /// The full hash of the commit checked out at `root`.
    fn head(root: &Path) -> String {
        first_line(root, Command::new("git").args(["rev-parse", "HEAD"])).unwrap()
    }

    /// Whether `described`, what `git describe --always --dirty` said in `root` (a hash, a
    /// tag, or `tag-N-g<hash>`, maybe with `-dirty`), names the commit `head`: git resolves
    /// each of these back to its commit.
    fn names(root: &Path, described: &str, head: &str) -> bool {
        let name = described.strip_suffix("-dirty").unwrap_or(described);
        let commit = first_line(
            root,
            Command::new("git")
                .args(["rev-parse", "--verify", "--quiet"])
                .arg(format!("{name}^{{commit}}")),
        );
        commit.as_deref() == Some(head)
    }

    #[test]
    fn the_versions_are_read_in_the_checkout() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        if !root.join(".git").exists() {
            eprintln!(
                "skipped: {} is not a git checkout, so it has no commit to read",
                root.display()
            );
            return;
        }
        let v = Versions::of(&root, Command::new("false"));
        assert!(names(&root, &v.commit, &head(&root)), "{}", v.commit);
        assert!(v.rustc.starts_with("rustc 1."), "{}", v.rustc);
        // A Python that cannot say its torch's version.
        assert_eq!(v.torch, "unknown");
    }

    #[test]
    fn the_commit_of_a_tagged_checkout_is_the_tag_or_a_name_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let git = |args: &[&str]| {
            let status = Command::new("git")
                .current_dir(root)
                .args([
                    "-c",
                    "user.name=bench",
                    "-c",
                    "user.email=bench@example.invalid",
                ])
                .args(["-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false"])
                .args(args)
                .stdout(Stdio::null())
                .status()
                .unwrap();
            assert!(status.success(), "git {args:?}");
        };
        git(&["init", "-q"]);
        git(&["commit", "-q", "--allow-empty", "-m", "one"]);
        git(&["tag", "-a", "v1", "-m", "v1"]);
        let tagged = Versions::of(root, Command::new("false")).commit;
        assert_eq!(tagged, "v1");
        assert!(names(root, &tagged, &head(root)));
        git(&["commit", "-q", "--allow-empty", "-m", "two"]);
        let past = Versions::of(root, Command::new("false")).commit;
        let hash = head(root);
        assert_eq!(past, format!("v1-1-g{}", &hash[..12]));
        assert!(names(root, &past, &hash));
        assert!(names(root, &format!("{past}-dirty"), &hash));
        // The tag names the commit before.
        assert!(!names(root, &tagged, &hash));
    }

    #[test]
    fn an_older_runs_start_line_lacks_the_commit_and_the_compiler() {
        let text = sample().json_lines().unwrap();
        let old = text
            .replace(r#""commit":"b531284d1e0f-dirty","#, "")
            .replace(r#""rustc":"rustc 1.88.0 (6b00bc388 2025-06-23)","#, "");
        assert!(!old.contains("commit"));
        let back = Results::from_json_lines(&old).unwrap();
        assert_eq!(
            (back.start.commit.as_str(), back.start.rustc.as_str()),
            ("unknown", "unknown")
        );
    }

    #[test]
    fn what_is_not_a_run_is_refused_naming_the_line() {
        let text = sample().json_lines().unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let err = |t: &str| format!("{:#}", Results::from_json_lines(t).unwrap_err());
        assert!(err("").contains("no JSON lines"));
        // A start line without the machine: written by an older bench.
        let old = r#"{"group":"meta","name":"start","cores":2,"load_average":"1","quick":false,"warmup_steps":3,"timed_steps":12}"#;
        assert!(err(&format!("{old}\n{}", lines[4])).contains("line 1 is not the start line"));
        assert!(err(&lines[..4].join("\n")).contains("line 4 is not the end line"));
        let bad_unit = lines[2].replace(r#""unit":"s""#, r#""unit":"parsecs""#);
        let broken = [lines[0], lines[1], &bad_unit, lines[4]].join("\n");
        assert!(err(&broken).contains("line 3 is not a result row: unknown unit `parsecs`"));
        let bad_group = lines[1].replace(r#""group":"sampler""#, r#""group":"gpu""#);
        let broken = [lines[0], &bad_group, lines[4]].join("\n");
        assert!(err(&broken).contains("unknown group `gpu`"));
    }
}
