//! The result model and its output: a [`Row`] per figure (ours, PyTorch's, their ratio and
//! the [`Target`] it must meet), printed as one table or as JSON lines.

use std::fmt::Write as _;

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
    pub(super) fn json(&self) -> String {
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

pub(super) fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
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
        let j = r.json();
        assert!(j.starts_with("{\"group\":\"comm\",\"name\":\"a \\\"b\\\"\""));
        assert!(j.contains("\"pytorch\":null") && j.contains("\"ratio\":null"));
        assert!(j.contains("\"meets_target\":null"));
    }
}
