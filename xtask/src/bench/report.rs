//! The result model and its output: a [`Row`] per figure (ours, PyTorch's, their ratio and
//! the [`Target`] it must meet), printed as one table or as JSON lines.

use serde::Serialize;

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
    /// What DDP adds to a training step outside backward (buffer broadcast, the wait in
    /// `sync_gradients` for the overlapped all-reduce), 2 ranks.
    Ddp,
    /// End-to-end training images/s, 1 and 2 ranks, random tensors and JPEGs, vs PyTorch DDP.
    Train,
    /// Training steps/s of torchvision's ResNet-50, batch 8 of 224 px, 1 and 2 ranks, vs
    /// PyTorch DDP.
    Resnet,
    /// DDP steps of a communication-heavy MLP, 2 ranks: the all-reduce overlapped with
    /// backward, after it, bf16-compressed; shared memory, TCP, and TCP capped at 1 Gbit/s
    /// with `tc` (needs root); vs PyTorch DDP.
    Overlap,
}

impl Group {
    /// Every group, in the order a full run runs them.
    pub(super) const ALL: [Group; 7] = [
        Group::Sampler,
        Group::Data,
        Group::Comm,
        Group::Ddp,
        Group::Train,
        Group::Resnet,
        Group::Overlap,
    ];

    /// The group named `name` (as [`Group::name`] gives it).
    pub(super) fn from_name(name: &str) -> Option<Group> {
        Group::ALL.into_iter().find(|g| g.name() == name)
    }

    /// The group's name in the table, the JSON lines and `--only`.
    pub(super) fn name(self) -> &'static str {
        match self {
            Group::Sampler => "sampler",
            Group::Data => "data",
            Group::Comm => "comm",
            Group::Ddp => "ddp",
            Group::Train => "train",
            Group::Resnet => "resnet",
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
    const ALL: [Unit; 5] = [
        Unit::Seconds,
        Unit::ImagesPerSec,
        Unit::StepsPerSec,
        Unit::GigabytesPerSec,
        Unit::Fraction,
    ];

    /// The unit whose [`Unit::label`] is `label`.
    pub(super) fn from_label(label: &str) -> Option<Unit> {
        Unit::ALL.into_iter().find(|u| u.label() == label)
    }

    /// The unit's name in the JSON lines.
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
    /// The name of the one row a group that failed leaves (its note says why).
    pub(super) const DID_NOT_RUN: &'static str = "(did not run)";

    /// How the name of a row that a group could not measure ends (its note says why).
    const SKIPPED: &'static str = ": skipped";

    /// The row of `what`, which this run could not measure, and `why`.
    pub(super) fn skipped(group: Group, what: &str, unit: Unit, why: impl Into<String>) -> Self {
        Self::new(group, format!("{what}{}", Self::SKIPPED), unit).note(why)
    }

    /// Whether this is a [`Row::skipped`] row (also read back from a saved run).
    pub(super) fn is_skipped(&self) -> bool {
        self.name.ends_with(Self::SKIPPED)
    }

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

    /// The target as the table and the page show it: `>= 5x`, `>= 0.95`, `<= 500.0 us`.
    pub(super) fn target_text(&self) -> String {
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
    fn groups_and_units_read_back_from_their_names() {
        for g in Group::ALL {
            assert_eq!(Group::from_name(g.name()), Some(g));
        }
        for u in Unit::ALL {
            assert_eq!(Unit::from_label(u.label()), Some(u));
        }
        assert_eq!(Group::from_name("gpu"), None);
        assert_eq!(Unit::from_label("parsecs"), None);
    }
}
