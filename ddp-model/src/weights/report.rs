//! What a partial [`load_state_dict`](super::load_state_dict) copied and what it left.

use std::fmt;

use tch::Kind;

/// A model tensor and a file tensor of the same name with different shapes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeMismatch {
    /// The name (after stripping the wrappers' prefix).
    pub name: String,
    /// The model's shape.
    pub expected: Vec<i64>,
    /// The file's shape.
    pub found: Vec<i64>,
}

/// A model tensor and a file tensor of the same name and shape whose values cannot be
/// copied: a complex tensor in the file for a real one in the model (other dtypes are
/// converted, as `load_state_dict` does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindMismatch {
    /// The name (after stripping the wrappers' prefix).
    pub name: String,
    /// The model's dtype.
    pub expected: Kind,
    /// The file's dtype.
    pub found: Kind,
}

/// What [`load_state_dict`](super::load_state_dict) copied and what it left.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Model tensors copied from the file, in the model's order
    /// ([`natural_cmp`](crate::checkpoint::natural_cmp)).
    pub loaded: Vec<String>,
    /// Model tensors the file lacks (they keep their values), in the model's order.
    pub missing: Vec<String>,
    /// File tensors the model lacks, in file order.
    pub unexpected: Vec<String>,
    /// Names in both whose shapes differ (the model keeps its values), in the model's order.
    pub mismatched: Vec<ShapeMismatch>,
    /// Names in both, of one shape, whose file values are complex and the model's real (the
    /// model keeps its values), in the model's order.
    pub kind_mismatched: Vec<KindMismatch>,
    /// The wrappers' prefix that every name of the file began with, stripped (`module.`,
    /// `_orig_mod.`, or several of them, as `module._orig_mod.`).
    pub stripped_prefix: Option<String>,
    /// The entry of the file that held the state_dict
    /// ([`StateDict::entry`](super::StateDict::entry)).
    pub entry: Option<String>,
}

impl LoadReport {
    /// Whether every model tensor was loaded and every file tensor used.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty()
            && self.unexpected.is_empty()
            && self.mismatched.is_empty()
            && self.kind_mismatched.is_empty()
    }
}

impl fmt::Display for LoadReport {
    /// `loaded 24 tensors; kept the model's 2 (not in the file: ...; another shape in the
    /// file: 'fc.weight' [1000, 512] for [8, 512]; complex in the file: ...); ignored 1 of the
    /// file's (...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "loaded {} tensors", self.loaded.len())?;
        if let Some(entry) = &self.entry {
            write!(f, " of its entry '{entry}'")?;
        }
        if let Some(prefix) = &self.stripped_prefix {
            write!(f, " (names without their '{prefix}' prefix)")?;
        }
        let kept = self.missing.len() + self.mismatched.len() + self.kind_mismatched.len();
        if kept > 0 {
            write!(f, "; kept the model's own values of {kept} (")?;
            let mut parts = Vec::new();
            if !self.missing.is_empty() {
                parts.push(format!("not in the file: {}", self.missing.join(", ")));
            }
            let shapes = self.mismatched.iter();
            let shapes = differences(shapes.map(|m| (&m.name, &m.found, &m.expected)));
            let kinds = self.kind_mismatched.iter();
            let kinds = differences(kinds.map(|m| (&m.name, &m.found, &m.expected)));
            for (what, listed) in [("another shape", shapes), ("complex", kinds)] {
                if let Some(listed) = listed {
                    parts.push(format!("{what} in the file: {listed}"));
                }
            }
            write!(f, "{})", parts.join("; "))?;
        }
        if !self.unexpected.is_empty() {
            write!(
                f,
                "; ignored {} of the file's, not in the model: {}",
                self.unexpected.len(),
                self.unexpected.join(", ")
            )?;
        }
        Ok(())
    }
}

/// `name found for expected, ...` of each difference; `None` for none.
fn differences<'a, T: fmt::Debug + 'a>(
    items: impl Iterator<Item = (&'a String, T, T)>,
) -> Option<String> {
    let listed: Vec<String> = items
        .map(|(name, found, expected)| format!("{name} {found:?} for {expected:?}"))
        .collect();
    (!listed.is_empty()).then(|| listed.join(", "))
}
