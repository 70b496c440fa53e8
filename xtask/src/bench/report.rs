//! The result model and its output: a [`Row`] per figure (ours, PyTorch's, their ratio and
//! the [`Target`] it must meet), printed as one table or as JSON lines.

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

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
    /// The group's name in the table, the JSON lines and `--only`.
    pub(super) fn name(self) -> &'static str {
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

/// What a result is compared against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Target {
    /// The ratio (ours vs PyTorch, higher is better) must reach this.
    Ratio(f64),
    /// Our own figure must reach this.
    Ours(f64),
    /// Our own figure must stay at or below this.
    OursAtMost(f64),
}

/// How a figure is shown.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Unit {
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

    /// `v` with its unit, as the table and the notes show it.
    pub(super) fn show(self, v: f64) -> String {
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
pub(super) struct Row {
    pub(super) group: Group,
    pub(super) name: String,
    pub(super) unit: Unit,
    pub(super) ours: Option<f64>,
    pub(super) pytorch: Option<f64>,
    /// Higher is better for us.
    pub(super) ratio: Option<f64>,
    pub(super) target: Option<Target>,
    pub(super) note: String,
}

impl Row {
    pub(super) fn new(group: Group, name: impl Into<String>, unit: Unit) -> Self {
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
    pub(super) fn pair(mut self, ours: Option<f64>, pytorch: Option<f64>) -> Self {
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

    pub(super) fn target(mut self, target: Target) -> Self {
        self.target = Some(target);
        self
    }

    pub(super) fn note(mut self, note: impl Into<String>) -> Self {
        self.note = note.into();
        self
    }

    pub(super) fn meets_target(&self) -> Option<bool> {
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

    /// The row as one JSON object (a line of `--json`).
    pub(super) fn json(&self) -> serde_json::Result<String> {
        let finite = |v: Option<f64>| v.filter(|x| x.is_finite());
        let (target, target_on) = match self.target {
            Some(Target::Ratio(t)) => (Some(t), Some("ratio")),
            Some(Target::Ours(t)) => (Some(t), Some("ours")),
            Some(Target::OursAtMost(t)) => (Some(t), Some("ours_at_most")),
            None => (None, None),
        };
        serde_json::to_string(&RowJson {
            group: self.group.name(),
            name: &self.name,
            unit: self.unit.label(),
            ours: finite(self.ours),
            pytorch: finite(self.pytorch),
            ratio: finite(self.ratio),
            target: finite(target),
            target_on,
            meets_target: self.meets_target(),
            note: &self.note,
        })
    }
}

/// A [`Row`] as a line of `--json`, fields in this order; a number that is missing or not
/// finite is `null`.
#[derive(Serialize)]
struct RowJson<'a> {
    group: &'static str,
    name: &'a str,
    unit: &'static str,
    ours: Option<f64>,
    pytorch: Option<f64>,
    ratio: Option<f64>,
    target: Option<f64>,
    /// `ratio`, `ours` or `ours_at_most`: what the target is compared with.
    target_on: Option<&'static str>,
    meets_target: Option<bool>,
    note: &'a str,
}

/// The first line of `--json`: the machine and the run's settings.
#[derive(Serialize)]
struct Start<'a> {
    group: &'static str,
    name: &'static str,
    cores: usize,
    load_average: &'a str,
    quick: bool,
    warmup_steps: usize,
    timed_steps: usize,
}

/// The first line of `--json`: `cores`, the load average at the start, and the run's
/// settings.
pub(super) fn start_json(
    cores: usize,
    load_average: &str,
    quick: bool,
    warmup_steps: usize,
    timed_steps: usize,
) -> serde_json::Result<String> {
    serde_json::to_string(&Start {
        group: "meta",
        name: "start",
        cores,
        load_average,
        quick,
        warmup_steps,
        timed_steps,
    })
}

/// The last line of `--json`: the run's seconds and the load average after each group.
#[derive(Serialize)]
struct End<'a> {
    group: &'static str,
    name: &'static str,
    /// Rounded to tenths.
    seconds: f64,
    load_average: Loads<'a>,
}

/// `(when, load average)` pairs as one JSON object, in their order.
struct Loads<'a>(&'a [(String, String)]);

impl Serialize for Loads<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (when, load) in self.0 {
            map.serialize_entry(when, load)?;
        }
        map.end()
    }
}

/// The last line of `--json`: `seconds` in all (in tenths) and the load averages `loads`.
pub(super) fn end_json(seconds: f64, loads: &[(String, String)]) -> serde_json::Result<String> {
    serde_json::to_string(&End {
        group: "meta",
        name: "end",
        // Tenths as `{:.1}` rounds them, so the line reads as it always has.
        seconds: format!("{seconds:.1}").parse().unwrap_or(seconds),
        load_average: Loads(loads),
    })
}

/// Prints `rows` as the table of `cargo xtask bench`.
pub(super) fn print_table(rows: &[Row]) {
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
    fn json_lines_escape_and_use_null() {
        let r = Row::new(Group::Comm, "a \"b\"", Unit::GigabytesPerSec).pair(Some(1.5), None);
        let j = r.json().unwrap();
        assert!(j.starts_with("{\"group\":\"comm\",\"name\":\"a \\\"b\\\"\""));
        assert!(j.contains("\"pytorch\":null") && j.contains("\"ratio\":null"));
        assert!(j.contains("\"meets_target\":null"));
    }

    /// Lines the hand-written JSON of earlier versions printed for these rows, byte for
    /// byte. serde writes the same but for two spellings of the same JSON values: a
    /// whole-number `f64` keeps its `.0` (`5.0`, was `5`), and a tab is `\t` (was `\u0009`).
    #[test]
    fn json_lines_are_the_hand_written_ones() {
        let rows = [
            (
                Row::new(Group::Comm, "a \"b\"\n\tc\\", Unit::GigabytesPerSec)
                    .pair(Some(1.5), None),
                r#"{"group":"comm","name":"a \"b\"\n\u0009c\\","unit":"GB/s","ours":1.5,"pytorch":null,"ratio":null,"target":null,"target_on":null,"meets_target":null,"note":""}"#,
            ),
            (
                Row::new(
                    Group::Sampler,
                    "one epoch's indices, N=10^6, rank 0 of 8",
                    Unit::Seconds,
                )
                .pair(Some(0.00605), Some(0.0932))
                .target(Target::Ratio(5.0))
                .note("PyTorch: x"),
                r#"{"group":"sampler","name":"one epoch's indices, N=10^6, rank 0 of 8","unit":"s","ours":0.00605,"pytorch":0.0932,"ratio":15.404958677685952,"target":5,"target_on":"ratio","meets_target":true,"note":"PyTorch: x"}"#,
            ),
            (
                Row::new(Group::Data, "hand-off", Unit::Seconds)
                    .pair(Some(0.000125), None)
                    .target(Target::OursAtMost(0.0005)),
                r#"{"group":"data","name":"hand-off","unit":"s","ours":0.000125,"pytorch":null,"ratio":null,"target":0.0005,"target_on":"ours_at_most","meets_target":true,"note":""}"#,
            ),
            (
                Row::new(Group::Train, "eff", Unit::Fraction)
                    .pair(Some(0.9), Some(f64::NAN))
                    .target(Target::Ours(0.95)),
                r#"{"group":"train","name":"eff","unit":"","ours":0.9,"pytorch":null,"ratio":null,"target":0.95,"target_on":"ours","meets_target":false,"note":""}"#,
            ),
        ];
        for (row, old) in rows {
            let old = old
                .replace("\"target\":5,", "\"target\":5.0,")
                .replace("\\u0009", "\\t");
            assert_eq!(row.json().unwrap(), old);
        }
    }

    #[test]
    fn meta_lines_are_the_hand_written_ones() {
        assert_eq!(
            start_json(2, "0.52 0.61 0.70", true, 1, 4).unwrap(),
            r#"{"group":"meta","name":"start","cores":2,"load_average":"0.52 0.61 0.70","quick":true,"warmup_steps":1,"timed_steps":4}"#
        );
        let loads = [
            ("start".to_string(), "0.52 0.61 0.70".to_string()),
            ("after sampler".to_string(), "1.00 0.80 0.71".to_string()),
        ];
        assert_eq!(
            end_json(123.44, &loads).unwrap(),
            r#"{"group":"meta","name":"end","seconds":123.4,"load_average":{"start":"0.52 0.61 0.70","after sampler":"1.00 0.80 0.71"}}"#
        );
        assert!(end_json(120.0, &loads)
            .unwrap()
            .contains(r#""seconds":120.0,"#));
    }
}
