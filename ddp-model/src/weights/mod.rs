//! Initial weights from other programs: PyTorch `torch.save` state_dicts and safetensors
//! files, loaded by name into a model's [`VarStore`], strictly or partially.
//!
//! - [`read_state_dict`]: a file's tensors in file order, on the CPU. The format is told by
//!   the content, not the extension (`.pth`, `.pt`, `.bin` and `.safetensors` all work): a
//!   zip archive is `torch.save`'s format (any top folder name, any dtype, stride and storage
//!   offset, views sharing a storage, the storage location such as `cuda:0` ignored as
//!   `map_location="cpu"` does, a big-endian `byteorder` swapped, a view's lazy `neg` or
//!   `conj` bit applied); a file that starts with a JSON header is safetensors; a bare pickle
//!   is `torch.save`'s legacy format, refused with how to re-save it. A training checkpoint
//!   saved by `torch.save` (`{"epoch": 3, "model": model.state_dict(), "optimizer": ...}`)
//!   is read from its one entry that is a state_dict; [`read_state_dict_entry`] names the
//!   entry where there are several.
//! - [`load_state_dict`]: copies a [`StateDict`] into the model's variables (parameters and
//!   buffers) with dtype conversion and no gradient, as PyTorch's `load_state_dict` does,
//!   after stripping a `module.` prefix from the names that have it (a file saved from a
//!   DDP model or an `AveragedModel`, as `consume_prefix_in_state_dict_if_present` does).
//!   [`Strictness::Strict`] copies nothing unless every name and shape matches and lists
//!   every difference in one error; [`Strictness::Partial`] copies what matches and reports
//!   the rest in its [`LoadReport`].
//! - [`load`]: reads a file, then loads it.
//!
//! ## The pickle is read by `torch.load(weights_only=True)`'s rule
//!
//! `data.pkl` is unpickled by a small data-only machine of this module, not by Python's
//! rules: only the globals that rebuild tensors are allowed (`collections.OrderedDict`,
//! `torch._utils._rebuild_tensor{,_v2,_v3}`, `torch._utils._rebuild_parameter{,_with_state}`,
//! the `torch.*Storage` types, `torch.storage.UntypedStorage`, torch's dtypes, `torch.Size`,
//! `_codecs.encode` and `builtins.set`), and a file that names any other (`os.system`,
//! `builtins.eval`, ...) is refused with [`WeightsError::Pickle`] holding
//! [`PickleError::Forbidden`] and that name, when its `GLOBAL` is read. Nothing is ever called:
//! the machine has no Python to call, and builds tensors from the allowed globals' arguments.
//!
//! Neither existing reader could serve. libtorch's own C++ unpickler (`torch::pickle_load`)
//! reads `collections.OrderedDict`, the type of every `state_dict()`, as `None`. The
//! `serde-pickle` crate has no persistent-load hook (`BINPERSID`, by which every tensor names
//! its storage, is an unsupported opcode there) and knows three globals only (`set`,
//! `frozenset`, `_codecs.encode`), so tensors cannot be rebuilt through it.
//!
//! ```
//! use ddp_model::weights::{self, LoadReport, StateDict, Strictness};
//! use tch::{nn, Device, Kind, Tensor};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let linear = nn::linear(vs.root() / "fc", 3, 2, Default::default());
//! // A state_dict with a new head: `fc.weight` of another shape, and a name the model lacks.
//! let file = StateDict::new(
//!     "example.pth",
//!     vec![
//!         ("module.fc.weight".into(), Tensor::ones([5, 3], (Kind::Double, Device::Cpu))),
//!         ("module.fc.bias".into(), Tensor::from_slice(&[1.5f32, -2.0])),
//!         ("module.extra".into(), Tensor::zeros([1], (Kind::Float, Device::Cpu))),
//!     ],
//! );
//! let err = weights::load_state_dict(&vs, &file, Strictness::Strict).unwrap_err();
//! assert!(err.to_string().contains("'fc.weight' has shape [5, 3] in the checkpoint but [2, 3] in the model"));
//!
//! let report = weights::load_state_dict(&vs, &file, Strictness::Partial)?;
//! assert_eq!(report.loaded, ["fc.bias"]);
//! assert_eq!(report.unexpected, ["extra"]);
//! assert_eq!(report.mismatched[0].name, "fc.weight");
//! assert_eq!(report.stripped_prefix.as_deref(), Some("module."));
//! assert_eq!(Vec::<f32>::try_from(&linear.bs.unwrap())?, [1.5, -2.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::tensor::SafeTensors;
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::checkpoint::{self, natural_cmp, TensorProblem};

mod pickle;
mod report;
mod torch_zip;

pub use pickle::PickleError;
pub use report::{KindMismatch, LoadReport, ShapeMismatch};

/// The prefix `DistributedDataParallel` puts in front of every name of the model it wraps.
pub const DDP_PREFIX: &str = "module.";
/// The prefix of every name of a model `torch.compile` wraps (its `OptimizedModule`).
pub const COMPILE_PREFIX: &str = "_orig_mod.";

/// Why weights could not be read or loaded. Every message names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// Opening or reading the file failed.
    #[error("weights file '{path}'")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is neither a `torch.save` zip nor safetensors.
    #[error(
        "weights file '{path}' is neither a torch.save file (a zip archive) nor a safetensors \
         file: {reason}"
    )]
    UnknownFormat {
        /// The file.
        path: PathBuf,
        /// What its first bytes are.
        reason: String,
    },
    /// The file is in `torch.save`'s legacy format (`_use_new_zipfile_serialization=False`,
    /// or PyTorch before 1.6).
    #[error(
        "weights file '{path}' is in torch.save's legacy (non-zip) format, which is not read: \
         re-save it with PyTorch 1.6 or later, `torch.save(torch.load(old, \
         weights_only=True), new)`"
    )]
    LegacyFormat {
        /// The file.
        path: PathBuf,
    },
    /// The zip archive is damaged, or not laid out as `torch.save` lays it out.
    #[error("weights file '{path}' is not a readable torch.save archive: {reason}")]
    Archive {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A record the pickle refers to is not in the archive.
    #[error("weights file '{path}' lacks its record '{record}' (a truncated or edited archive)")]
    MissingRecord {
        /// The file.
        path: PathBuf,
        /// The record's name in the archive.
        record: String,
    },
    /// The pickle was refused (a global outside the allow list, or something a state_dict
    /// does not use) or is damaged; nothing of it was run.
    #[error(
        "weights file '{path}': its pickle {source}; nothing was run or loaded{}",
        resave_advice(source)
    )]
    Pickle {
        /// The file.
        path: PathBuf,
        /// Why.
        source: PickleError,
    },
    /// The file holds something else than a state_dict (names to tensors).
    #[error("weights file '{path}' is not a state_dict: {reason}")]
    NotAStateDict {
        /// The file.
        path: PathBuf,
        /// What it holds.
        reason: String,
    },
    /// A key was given, and the file's top-level dict has no entry of that name.
    #[error(
        "weights file '{path}' has no entry '{key}' ({})",
        listed_entries(entries)
    )]
    NoEntry {
        /// The file.
        path: PathBuf,
        /// The key asked for.
        key: String,
        /// The keys the file has (none for a file that is one state_dict: safetensors, or
        /// a `torch.save` of a state_dict alone).
        entries: Vec<String>,
    },
    /// No key was given, and more than one entry of the file holds a state_dict. The
    /// message names the first [`checkpoint::MISMATCH_SHOWN`] and counts the rest.
    #[error(
        "weights file '{path}' holds several state_dicts, under {}: choose one by its key",
        first_shown(entries, |(k, n)| format!("'{k}' ({n} tensors)"))
    )]
    SeveralStateDicts {
        /// The file.
        path: PathBuf,
        /// Each entry holding a state_dict and its number of tensors, in file order.
        entries: Vec<(String, usize)>,
    },
    /// A tensor has a dtype that tch cannot represent.
    #[error("weights file '{path}': tensor '{name}' has dtype {dtype}, which is not supported")]
    UnsupportedDtype {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// The dtype, in the file's spelling.
        dtype: String,
    },
    /// A tensor's description does not fit its data (a view past its storage, a short
    /// record, a corrupt safetensors entry).
    #[error("weights file '{path}': tensor '{name}' is damaged: {reason}")]
    BadTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A strict load found differences between the file and the model; nothing was copied.
    /// The message lists the first [`checkpoint::MISMATCH_SHOWN`] differences and counts the
    /// rest.
    #[error(
        "weights file '{path}' does not fit the model (nothing was loaded; a partial load \
         copies what fits){}: {}",
        file_holds.map(|k| format!("; the file holds a {} model", k.name())).unwrap_or_default(),
        checkpoint::list(problems)
    )]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// Every difference, sorted by name with [`natural_cmp`].
        problems: Vec<TensorProblem>,
        /// The model the file's names belong to, when that is another model than the one
        /// loaded into ([`crate::ModelKind::holding`]).
        file_holds: Option<crate::ModelKind>,
    },
    /// libtorch failed to copy a tensor into the model.
    #[error("weights file '{path}': copying '{name}' into the model failed: {reason}")]
    Copy {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
        /// libtorch's message.
        reason: String,
    },
}

/// `its entries: 'epoch', 'model'`, for [`WeightsError::NoEntry`].
fn listed_entries(entries: &[String]) -> String {
    if entries.is_empty() {
        return "it has none: the file is one state_dict, read without a key".into();
    }
    let quoted = first_shown(entries, |k| format!("'{k}'"));
    format!("its entries: {quoted}")
}

/// `'a', 'b', and 12 more`: the first [`checkpoint::MISMATCH_SHOWN`] items, and how many more.
fn first_shown<T>(items: &[T], show: impl Fn(&T) -> String) -> String {
    let shown = checkpoint::MISMATCH_SHOWN;
    let listed: Vec<String> = items.iter().take(shown).map(show).collect();
    let more = match items.len().saturating_sub(shown) {
        0 => String::new(),
        n => format!(", and {n} more"),
    };
    format!("{}{more}", listed.join(", "))
}

/// How to get past a global outside the allow list (an `argparse.Namespace` of a training
/// script's arguments), for [`WeightsError::Pickle`].
fn resave_advice(source: &PickleError) -> &'static str {
    match source {
        PickleError::Forbidden(_) => {
            ". If you trust the file, re-save its state_dict alone in Python: \
             torch.save(torch.load(path, weights_only=False)['state_dict'], new_path) (or the \
             entry holding it, such as 'model'), or torch.save(model.state_dict(), new_path)"
        }
        _ => "",
    }
}

impl WeightsError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_owned(),
            source,
        }
    }
}

/// Named tensors on the CPU, in the order of the file they came from.
#[derive(Debug)]
pub struct StateDict {
    path: PathBuf,
    entry: Option<String>,
    tensors: Vec<(String, Tensor)>,
    metadata: HashMap<String, String>,
}

impl StateDict {
    /// Tensors under their names; `path` names them in errors.
    pub fn new(path: impl Into<PathBuf>, tensors: Vec<(String, Tensor)>) -> Self {
        Self {
            path: path.into(),
            entry: None,
            tensors,
            metadata: HashMap::new(),
        }
    }

    /// The same tensors, with the file's metadata (a safetensors header's `__metadata__`).
    #[must_use]
    pub fn with_metadata(mut self, metadata: HashMap<String, String>) -> Self {
        self.metadata = metadata;
        self
    }

    /// The metadata read with the tensors, from the same read of the file: a safetensors
    /// header's `__metadata__` (the training's `"epoch"`, say); empty for a `torch.save` file.
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// The same tensors, recorded as read from the file's entry `entry` (`None`: the
    /// file's top level).
    #[must_use]
    pub fn with_entry(mut self, entry: Option<String>) -> Self {
        self.entry = entry;
        self
    }

    /// The file the tensors came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The entry of the file's top-level dict that held the tensors (`"model"` of
    /// `{"epoch": 3, "model": state_dict}`), or `None` when the file is the state_dict.
    pub fn entry(&self) -> Option<&str> {
        self.entry.as_deref()
    }

    /// The names and tensors, in file order.
    pub fn tensors(&self) -> &[(String, Tensor)] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// The names, in file order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|(n, _)| n.as_str())
    }

    /// How many tensors there are.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Takes the tensors.
    pub fn into_tensors(self) -> Vec<(String, Tensor)> {
        self.tensors
    }
}

/// How [`load_state_dict`] treats names and shapes that differ.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Strictness {
    /// Every model tensor must be in the file with its shape, and nothing else may be:
    /// otherwise nothing is copied and [`WeightsError::Mismatch`] lists every difference
    /// (PyTorch's `load_state_dict(strict=True)`).
    #[default]
    Strict,
    /// Copy the tensors whose name and shape match (but a complex one into a real one); the
    /// [`LoadReport`] lists the rest (a new classification head, a backbone without its head).
    Partial,
}

/// Reads a state_dict from a `torch.save` file or a safetensors file, told apart by content.
///
/// A `torch.save` file may also hold a training checkpoint, a dict such as `{"epoch": 3,
/// "model": model.state_dict(), "optimizer": optimizer.state_dict()}`: its one entry that is
/// a state_dict is read ([`StateDict::entry`] names it). With several such entries
/// (`"model"` and `"ema"`) it fails with [`WeightsError::SeveralStateDicts`]; choose one with
/// [`read_state_dict_entry`].
pub fn read_state_dict(path: impl AsRef<Path>) -> Result<StateDict, WeightsError> {
    read_state_dict_at(path.as_ref(), None)
}

/// Reads the state_dict under `key` of a `torch.save` file whose top level is a dict
/// (`checkpoint[key]` in PyTorch): [`WeightsError::NoEntry`] when there is no such entry,
/// which is always the case in a safetensors file.
pub fn read_state_dict_entry(path: impl AsRef<Path>, key: &str) -> Result<StateDict, WeightsError> {
    read_state_dict_at(path.as_ref(), Some(key))
}

fn read_state_dict_at(path: &Path, key: Option<&str>) -> Result<StateDict, WeightsError> {
    let mut head = [0u8; 9];
    let (n, file_len) = read_head(path, &mut head)?;
    let head = &head[..n];
    if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        return torch_zip::read(path, key);
    }
    // safetensors: an 8-byte little-endian header length that fits the file, then the JSON
    // header. Told before the legacy format: a length of 640 starts with `80 02` as well.
    let header_fits = |h: &[u8]| {
        let len = u64::from_le_bytes(h[..8].try_into().unwrap_or_default());
        len <= file_len.saturating_sub(8)
    };
    if head.len() == 9 && head[8] == b'{' && header_fits(head) {
        if let Some(key) = key {
            return Err(WeightsError::NoEntry {
                path: path.to_owned(),
                key: key.to_string(),
                entries: Vec::new(),
            });
        }
        return read_safetensors(path);
    }
    // The legacy format starts with a pickled magic number: after a PROTO opcode (protocols
    // 2 to 5), or as protocols 0 and 1 write it, a LONG in text (`L119547037146038801333356L`).
    let proto = head.len() >= 2 && head[0] == 0x80 && (2..=5).contains(&head[1]);
    if proto || head.starts_with(b"L11954703") {
        return Err(WeightsError::LegacyFormat {
            path: path.to_owned(),
        });
    }
    let reason = if head.is_empty() {
        "it is empty".to_string()
    } else {
        format!("it starts with the bytes {head:02x?}")
    };
    Err(WeightsError::UnknownFormat {
        path: path.to_owned(),
        reason,
    })
}

/// Reads the first bytes of the file into `head`: how many, and the file's length.
fn read_head(path: &Path, head: &mut [u8]) -> Result<(usize, u64), WeightsError> {
    let mut file = File::open(path).map_err(|e| WeightsError::io(path, e))?;
    let file_len = file
        .metadata()
        .map_err(|e| WeightsError::io(path, e))?
        .len();
    let mut n = 0;
    while n < head.len() {
        match file.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(WeightsError::io(path, e)),
        }
    }
    Ok((n, file_len))
}

fn read_safetensors(path: &Path) -> Result<StateDict, WeightsError> {
    let bytes = std::fs::read(path).map_err(|e| WeightsError::io(path, e))?;
    let invalid = |e: safetensors::SafeTensorError| WeightsError::UnknownFormat {
        path: path.to_owned(),
        reason: format!("its safetensors header is invalid: {e}"),
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(invalid)?;
    let st = SafeTensors::deserialize(&bytes).map_err(invalid)?;
    let mut views = st.tensors();
    // File order is data order.
    views.sort_by_key(|(_, v)| v.data().as_ptr() as usize);
    let mut tensors = Vec::with_capacity(views.len());
    for (name, view) in views {
        let kind =
            checkpoint::kind_of(view.dtype()).ok_or_else(|| WeightsError::UnsupportedDtype {
                path: path.to_owned(),
                name: name.clone(),
                dtype: format!("{:?}", view.dtype()),
            })?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_data_size(view.data(), &shape, kind).map_err(|e| {
            WeightsError::BadTensor {
                path: path.to_owned(),
                name: name.clone(),
                reason: e.to_string(),
            }
        })?;
        tensors.push((name, t));
    }
    let metadata = header.metadata().clone().unwrap_or_default();
    Ok(StateDict::new(path, tensors).with_metadata(metadata))
}

/// `name` without the leading wrapper prefixes of `stripped` (their concatenation, in
/// order) that it has: all of them where the file's every name has them.
fn strip_wrappers<'a>(mut name: &'a str, stripped: &str) -> &'a str {
    let mut rest = stripped;
    while let Some(wrapper) = [DDP_PREFIX, COMPILE_PREFIX]
        .into_iter()
        .find(|w| rest.starts_with(w))
    {
        rest = &rest[wrapper.len()..];
        name = name.strip_prefix(wrapper).unwrap_or(name);
    }
    name
}

/// Copies `state` into the model's variables, by name, as PyTorch's `load_state_dict` does:
/// the prefixes of wrappers are stripped first (DDP's `module.`, `torch.compile`'s
/// `_orig_mod.`, in any order and number), from every file name that has them, as
/// `consume_prefix_in_state_dict_if_present` does; a prefix the model's names have too is
/// the model's own, and stays. Values are converted to the variable's dtype and moved to
/// its device, and no gradient is recorded. See [`Strictness`] for what happens to names
/// and shapes that differ.
/// A BatchNorm's `num_batches_tracked` that the file lacks while it holds the layer's
/// `running_mean` keeps the model's value and is not missing, as in PyTorch.
pub fn load_state_dict(
    vs: &VarStore,
    state: &StateDict,
    strictness: Strictness,
) -> Result<LoadReport, WeightsError> {
    let model = checkpoint::named_tensors(vs);
    let mut stripped = String::new();
    let names: std::collections::HashSet<&str> = model.iter().map(|(n, _)| n.as_str()).collect();
    // File names that are model names once the wrappers of `prefix` are stripped.
    let hits = |prefix: &str| {
        state
            .names()
            .filter(|n| names.contains(strip_wrappers(n, prefix)))
            .count()
    };
    // The file's names, once stripped, are compared with the model's. A wrapper's prefix
    // that every file name has is stripped unless every model name has it too (a submodule
    // named `module`); one that only some file names have (`AveragedModel`'s, beside its
    // `n_averaged`), from those names, where no model name starts with it or more of them
    // are model names without it.
    while let Some(wrapper) = [DDP_PREFIX, COMPILE_PREFIX].into_iter().find(|wrapper| {
        let prefix = format!("{stripped}{wrapper}");
        let model_all = !model.is_empty() && model.iter().all(|(n, _)| n.starts_with(wrapper));
        let file_all = !state.is_empty() && state.names().all(|n| n.starts_with(&prefix));
        let file_any = state.names().any(|n| n.starts_with(&prefix));
        let model_any = model.iter().any(|(n, _)| n.starts_with(wrapper));
        (file_all && !model_all) || (file_any && (!model_any || hits(&prefix) > hits(&stripped)))
    }) {
        stripped.push_str(wrapper);
    }
    let file: Vec<(&str, &Tensor)> = state
        .tensors
        .iter()
        .map(|(n, t)| (strip_wrappers(n, &stripped), t))
        .collect();
    let find = |name: &str| file.iter().rev().find(|(n, _)| *n == name).map(|(_, t)| *t);

    let mut report = LoadReport {
        stripped_prefix: (!stripped.is_empty()).then_some(stripped),
        entry: state.entry.clone(),
        ..Default::default()
    };
    let mut problems = Vec::new();
    let mut copies = Vec::new();
    for (name, var) in &model {
        match find(name) {
            // PyTorch's BatchNorm fills a counter that files written before it existed lack
            // (torchvision's ImageNet ResNet weights) with the module's own: so does this.
            None if is_batch_norm_counter(name, &find) => {}
            None => {
                report.missing.push(name.clone());
                problems.push(TensorProblem::Missing(name.clone()));
            }
            Some(t) if t.size() != var.size() => {
                report.mismatched.push(ShapeMismatch {
                    name: name.clone(),
                    expected: var.size(),
                    found: t.size(),
                });
                problems.push(TensorProblem::Shape {
                    name: name.clone(),
                    expected: var.size(),
                    found: t.size(),
                });
            }
            // libtorch cannot copy a complex value into a real variable.
            Some(t) if is_complex(t.kind()) && !is_complex(var.kind()) => {
                problems.push(TensorProblem::Dtype {
                    name: name.clone(),
                    expected: var.kind(),
                    found: t.kind(),
                });
                report.kind_mismatched.push(KindMismatch {
                    name: name.clone(),
                    expected: var.kind(),
                    found: t.kind(),
                });
            }
            Some(t) => copies.push((name, var, t)),
        }
    }
    let model_names: HashSet<&str> = model.iter().map(|(n, _)| n.as_str()).collect();
    let mut seen = HashSet::new();
    for (name, _) in &file {
        if !model_names.contains(name) && seen.insert(*name) {
            report.unexpected.push(name.to_string());
            problems.push(TensorProblem::Unexpected(name.to_string()));
        }
    }
    if strictness == Strictness::Strict && !problems.is_empty() {
        problems.sort_by(|a, b| natural_cmp(problem_name(a), problem_name(b)));
        // Another model than this one only when the names differ (`file`'s are stripped).
        let names_differ = problems
            .iter()
            .any(|p| matches!(p, TensorProblem::Missing(_) | TensorProblem::Unexpected(_)));
        let file_holds = names_differ
            .then(|| crate::ModelKind::holding(file.iter().map(|(n, _)| *n)))
            .flatten();
        return Err(WeightsError::Mismatch {
            path: state.path.clone(),
            problems,
            file_holds,
        });
    }
    tch::no_grad(|| {
        for (name, var, src) in copies {
            let mut var = var.shallow_clone();
            var.f_copy_(src).map_err(|e| WeightsError::Copy {
                path: state.path.clone(),
                name: name.clone(),
                reason: e.to_string(),
            })?;
            report.loaded.push(name.clone());
        }
        Ok::<(), WeightsError>(())
    })?;
    Ok(report)
}

/// [`read_state_dict`] (or [`read_state_dict_entry`] with a `key`), then
/// [`load_state_dict`].
pub fn load(
    vs: &VarStore,
    path: impl AsRef<Path>,
    key: Option<&str>,
    strictness: Strictness,
) -> Result<LoadReport, WeightsError> {
    let state = read_state_dict_at(path.as_ref(), key)?;
    load_state_dict(vs, &state, strictness)
}

/// Whether `name` is a BatchNorm layer's `num_batches_tracked` whose layer the file holds
/// (its `running_mean`).
fn is_batch_norm_counter<'a>(name: &str, find: &impl Fn(&str) -> Option<&'a Tensor>) -> bool {
    name.strip_suffix("num_batches_tracked")
        .filter(|layer| layer.is_empty() || layer.ends_with('.'))
        .is_some_and(|layer| find(&format!("{layer}running_mean")).is_some())
}

fn is_complex(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::ComplexHalf | Kind::ComplexFloat | Kind::ComplexDouble
    )
}

fn problem_name(p: &TensorProblem) -> &str {
    match p {
        TensorProblem::Missing(n) | TensorProblem::Unexpected(n) => n,
        TensorProblem::Shape { name, .. } | TensorProblem::Dtype { name, .. } => name,
    }
}
