//! safetensors checkpoints with PyTorch state-dict names, written atomically, loaded strictly.
//!
//! A checkpoint written here is what `safetensors.torch.save_file(model.state_dict(), path)`
//! writes for the PyTorch definition of the model: the same names (no `module.` prefix), the
//! same shapes and dtypes (`num_batches_tracked` is int64). Loading checks every tensor first
//! and changes nothing unless all of them match.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use tch::{nn::VarStore, Device, Kind, Tensor};

/// Why a checkpoint could not be written or loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// Reading, writing, syncing or renaming the file failed.
    #[error("checkpoint '{path}'")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not a valid safetensors file (truncated, corrupt, or another format).
    #[error("checkpoint '{path}' is not a valid safetensors file: {reason}")]
    Format {
        /// The file involved.
        path: PathBuf,
        /// What the parser reported.
        reason: String,
    },
    /// A tensor has a dtype this crate cannot represent.
    #[error("checkpoint '{path}': tensor '{name}' has unsupported dtype {dtype}")]
    UnsupportedDtype {
        /// The file involved.
        path: PathBuf,
        /// The tensor's name.
        name: String,
        /// The dtype found (safetensors' or tch's spelling).
        dtype: String,
    },
    /// The checkpoint does not fit the model; nothing was loaded.
    #[error(
        "checkpoint '{path}' does not fit the model (nothing was loaded): {}",
        list(problems)
    )]
    Mismatch {
        /// The file involved.
        path: PathBuf,
        /// Every tensor that differs, sorted by name with [`natural_cmp`]; the message
        /// lists the first [`MISMATCH_SHOWN`] and counts the rest.
        problems: Vec<TensorProblem>,
    },
}

/// One way a checkpoint tensor differs from the model's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorProblem {
    /// The model has this tensor; the checkpoint does not.
    #[error("'{0}' is missing from the checkpoint")]
    Missing(String),
    /// The checkpoint has this tensor; the model does not.
    #[error("'{0}' is in the checkpoint but not in the model")]
    Unexpected(String),
    /// Shapes differ.
    #[error("'{name}' has shape {found:?} in the checkpoint but {expected:?} in the model")]
    Shape {
        /// The tensor's name.
        name: String,
        /// The model's shape.
        expected: Vec<i64>,
        /// The checkpoint's shape.
        found: Vec<i64>,
    },
    /// Dtypes differ.
    #[error("'{name}' has dtype {found:?} in the checkpoint but {expected:?} in the model")]
    Dtype {
        /// The tensor's name.
        name: String,
        /// The model's dtype.
        expected: Kind,
        /// The checkpoint's dtype.
        found: Kind,
    },
}

/// How many of a mismatch's differences its message lists.
pub const MISMATCH_SHOWN: usize = 8;

/// The first [`MISMATCH_SHOWN`] problems, and how many of each kind the others are.
pub(crate) fn list(problems: &[TensorProblem]) -> String {
    let mut text = problems
        .iter()
        .take(MISMATCH_SHOWN)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    let rest = &problems[problems.len().min(MISMATCH_SHOWN)..];
    if !rest.is_empty() {
        let count = |f: fn(&TensorProblem) -> bool| rest.iter().filter(|p| f(p)).count();
        let kinds = [
            (
                count(|p| matches!(p, TensorProblem::Missing(_))),
                "missing from the file",
            ),
            (
                count(|p| matches!(p, TensorProblem::Unexpected(_))),
                "not in the model",
            ),
            (
                count(|p| matches!(p, TensorProblem::Shape { .. } | TensorProblem::Dtype { .. })),
                "of another shape or dtype",
            ),
        ];
        let kinds: Vec<String> = kinds
            .iter()
            .filter(|(n, _)| *n > 0)
            .map(|(n, what)| format!("{n} {what}"))
            .collect();
        text.push_str(&format!("; and {} more ({})", rest.len(), kinds.join(", ")));
    }
    text
}

/// Named tensors plus the string metadata stored in a safetensors header, as
/// [`read_tensors`] read them from one file.
#[derive(Debug, Default)]
pub struct TensorFile {
    /// The file they were read from, named in errors about them.
    pub path: PathBuf,
    /// Tensors by name, on the CPU.
    pub tensors: BTreeMap<String, Tensor>,
    /// The header's `__metadata__` map.
    pub metadata: HashMap<String, String>,
}

/// The model's tensors (parameters and buffers) sorted by name with [`natural_cmp`]: the order
/// every rank agrees on (`features.4.weight` before `features.12.weight`).
pub fn named_tensors(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    named
}

/// Orders dotted state-dict names with numeric components compared as numbers.
///
/// The names are split at `.`; components are compared pairwise, and where both are non-empty
/// runs of ASCII digits they compare by value (`layer.2` < `layer.10`), otherwise as strings. A
/// name that is a prefix of the other (`a` < `a.b`) comes first. Digit runs of any length are
/// compared without parsing, so no value overflows; names that differ only in leading zeros
/// (`a.01` and `a.1`) are told apart by their plain string order, so two different names never
/// compare equal and sorting gives the same sequence whatever order the names came in.
///
/// ```
/// use ddp_model::checkpoint::natural_cmp;
///
/// let mut names = vec!["a.10.w", "a.2.w", "b", "a.1.w"];
/// names.sort_by(|a, b| natural_cmp(a, b));
/// assert_eq!(names, ["a.1.w", "a.2.w", "a.10.w", "b"]);
/// ```
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let mut ai = a.split('.');
    let mut bi = b.split('.');
    loop {
        let ord = match (ai.next(), bi.next()) {
            (None, None) => return a.cmp(b),
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) => match (digits(x), digits(y)) {
                // Without leading zeros a longer run is a larger number; equal lengths compare
                // digit by digit.
                (Some(p), Some(q)) => p.len().cmp(&q.len()).then_with(|| p.cmp(q)),
                _ => x.cmp(y),
            },
        };
        if ord != Ordering::Equal {
            return ord;
        }
    }
}

/// `s` without its leading zeros if it is a non-empty run of ASCII digits.
fn digits(s: &str) -> Option<&str> {
    (!s.is_empty() && s.bytes().all(|c| c.is_ascii_digit())).then(|| s.trim_start_matches('0'))
}

/// Writes the model's tensors to `path` atomically (see [`write_tensors`]).
pub fn save(
    vs: &VarStore,
    path: impl AsRef<Path>,
    metadata: &HashMap<String, String>,
) -> Result<(), CheckpointError> {
    write_tensors(named_tensors(vs), metadata, path)
}

/// Loads a checkpoint written by [`save`] (or by PyTorch's `safetensors.torch.save_file` of
/// the same model) into `vs`: [`read_tensors`], then [`load_tensors`]. Returns the file's
/// metadata.
pub fn load(
    vs: &VarStore,
    path: impl AsRef<Path>,
) -> Result<HashMap<String, String>, CheckpointError> {
    let file = read_tensors(path)?;
    load_tensors(vs, &file)?;
    Ok(file.metadata)
}

/// Loads tensors already read from a checkpoint ([`read_tensors`]) into `vs`, reading nothing
/// more: every tensor is checked against the model (names, shapes, dtypes), and only when
/// all match are they copied to the model's device. Errors name `file.path`.
pub fn load_tensors(vs: &VarStore, file: &TensorFile) -> Result<(), CheckpointError> {
    let model = named_tensors(vs);
    let mut problems = Vec::new();
    for (name, var) in &model {
        match file.tensors.get(name) {
            None => problems.push(TensorProblem::Missing(name.clone())),
            Some(t) if t.size() != var.size() => problems.push(TensorProblem::Shape {
                name: name.clone(),
                expected: var.size(),
                found: t.size(),
            }),
            Some(t) if t.kind() != var.kind() => problems.push(TensorProblem::Dtype {
                name: name.clone(),
                expected: var.kind(),
                found: t.kind(),
            }),
            Some(_) => {}
        }
    }
    let model_names: std::collections::HashSet<&str> =
        model.iter().map(|(n, _)| n.as_str()).collect();
    for name in file.tensors.keys() {
        if !model_names.contains(name.as_str()) {
            problems.push(TensorProblem::Unexpected(name.clone()));
        }
    }
    if !problems.is_empty() {
        problems.sort_by(|a, b| natural_cmp(problem_name(a), problem_name(b)));
        return Err(CheckpointError::Mismatch {
            path: file.path.clone(),
            problems,
        });
    }
    tch::no_grad(|| {
        for (name, mut var) in model {
            let src = &file.tensors[&name];
            var.copy_(&src.to_device(var.device()));
        }
    });
    Ok(())
}

fn problem_name(p: &TensorProblem) -> &str {
    match p {
        TensorProblem::Missing(n) | TensorProblem::Unexpected(n) => n,
        TensorProblem::Shape { name, .. } | TensorProblem::Dtype { name, .. } => name,
    }
}

/// Writes named tensors and metadata as one safetensors file, atomically: the bytes go to a
/// temporary file in the same folder, which is synced and then renamed over `path` (and the
/// folder synced), so a crash leaves either the old file or the new one, never a torn one.
pub fn write_tensors<I, S>(
    tensors: I,
    metadata: &HashMap<String, String>,
    path: impl AsRef<Path>,
) -> Result<(), CheckpointError>
where
    I: IntoIterator<Item = (S, Tensor)>,
    S: Into<String>,
{
    let path = path.as_ref();
    let mut owned = Vec::new();
    for (name, t) in tensors {
        let name = name.into();
        let t = t.detach().to_device(Device::Cpu).contiguous();
        let dtype = dtype_of(t.kind()).ok_or_else(|| CheckpointError::UnsupportedDtype {
            path: path.to_owned(),
            name: name.clone(),
            dtype: format!("{:?}", t.kind()),
        })?;
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * t.kind().elt_size_in_bytes()];
        t.copy_data_u8(&mut bytes, numel);
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        owned.push((name, dtype, shape, bytes));
    }
    let views = owned
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            let view = TensorView::new(*dtype, shape.clone(), bytes).map_err(|e| {
                CheckpointError::Format {
                    path: path.to_owned(),
                    reason: e.to_string(),
                }
            })?;
            Ok((name.as_str(), view))
        })
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    let meta = (!metadata.is_empty()).then(|| metadata.clone());
    let format = |reason: String| CheckpointError::Format {
        path: path.to_owned(),
        reason,
    };
    let mut bytes = safetensors::serialize(views, &meta).map_err(|e| format(e.to_string()))?;
    if metadata.len() > 1 {
        bytes = sorted_header(bytes).map_err(format)?;
    }
    write_atomic(path, &bytes).map_err(|source| io_error(path, source))
}

/// A safetensors file's `bytes` with its header's keys in sorted order (and padded to 8
/// bytes again). safetensors writes the metadata in its map's hash order, which differs from
/// one process to the next once there is more than one key: the same tensors and metadata
/// then gave other bytes in another process (a resumed run's checkpoint, byte-compared).
fn sorted_header(mut bytes: Vec<u8>) -> Result<Vec<u8>, String> {
    let length: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or("no header length")?;
    let end = usize::try_from(u64::from_le_bytes(length))
        .ok()
        .and_then(|n| n.checked_add(8))
        .filter(|&end| end <= bytes.len())
        .ok_or("a header past the file's end")?;
    // serde_json's maps are ordered by key.
    let header: serde_json::Value =
        serde_json::from_slice(&bytes[8..end]).map_err(|e| e.to_string())?;
    let mut text = serde_json::to_vec(&header).map_err(|e| e.to_string())?;
    text.resize(text.len().next_multiple_of(8), b' ');
    if text.len() == end - 8 {
        // The same keys in another order: as long, so sorted in place, without a copy of
        // the tensors' bytes.
        bytes[8..end].copy_from_slice(&text);
        return Ok(bytes);
    }
    let mut sorted = Vec::with_capacity(8 + text.len() + bytes.len() - end);
    sorted.extend_from_slice(&(text.len() as u64).to_le_bytes());
    sorted.extend_from_slice(&text);
    sorted.extend_from_slice(&bytes[end..]);
    Ok(sorted)
}

/// Reads every tensor of a safetensors file onto the CPU.
pub fn read_tensors(path: impl AsRef<Path>) -> Result<TensorFile, CheckpointError> {
    let path = path.as_ref();
    let bytes = fs::read(path).map_err(|source| io_error(path, source))?;
    let format = |e: safetensors::SafeTensorError| CheckpointError::Format {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(format)?;
    let st = SafeTensors::deserialize(&bytes).map_err(format)?;
    let mut tensors = BTreeMap::new();
    for (name, view) in st.tensors() {
        let kind = kind_of(view.dtype()).ok_or_else(|| CheckpointError::UnsupportedDtype {
            path: path.to_owned(),
            name: name.clone(),
            dtype: format!("{:?}", view.dtype()),
        })?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let t = Tensor::f_from_data_size(view.data(), &shape, kind).map_err(|e| {
            CheckpointError::Format {
                path: path.to_owned(),
                reason: format!("'{name}': {e}"),
            }
        })?;
        tensors.insert(name, t);
    }
    let metadata = header.metadata().clone().unwrap_or_default();
    Ok(TensorFile {
        path: path.to_owned(),
        tensors,
        metadata,
    })
}

/// Replaces the file at `path` with `bytes` so that a crash or power loss leaves either the old
/// content or the new one, never a mix or a truncated file.
///
/// The bytes go to a hidden temporary file in the same folder (`.<name>.tmp-<tag>`, the
/// [`temporary_tag`] of the process writing it, in the same folder so that the
/// rename never crosses file systems), which is flushed to disk with `fsync` before it is
/// renamed over `path`; the folder is then synced too, because the rename itself is durable only
/// once the folder's entry is on disk. When this returns `Ok` the new content survives a crash.
/// On error the temporary file is removed and `path` is untouched or already fully replaced
/// (if only the final folder sync failed). The folder must exist. A file system whose folders
/// cannot be synced (VirtualBox shared folders, older CIFS, some FUSE file systems) is no
/// error: the file is in place, as durable as that file system makes anything.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{file_name}.tmp-{}", temporary_tag()));
    let result = (|| {
        let mut f = create_temporary(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        // The rename is durable only once the folder's entry is on disk.
        sync_folder(&dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Flushes folder `dir`'s entries to the disk: a file or folder made, renamed or removed in
/// it survives a crash once this returns `Ok` ([`write_atomic`] does it after its rename). A
/// file system whose folders cannot be synced is no error, as there.
pub fn sync_entries(dir: &Path) -> std::io::Result<()> {
    sync_folder(dir)
}

/// Creates folder `dir` and the folders above it that are missing, as
/// [`fs::create_dir_all`] does, and flushes each new folder's entry in its parent: a file
/// written into it with [`write_atomic`] then survives a crash with the folders it lies in.
pub fn create_dir_all_synced(dir: &Path) -> std::io::Result<()> {
    create_folders_synced(dir)
}

/// Creates [`write_atomic`]'s temporary `tmp`, which must be new: never a file or a link
/// that was there before (its name is known for the process's life, so another user could
/// plant a link there for the write to follow). An entry in the way is removed (a link, not
/// its target) and the creation tried once more.
fn create_temporary(tmp: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let create = || {
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(tmp)
    };
    match create() {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            fs::remove_file(tmp)?;
            create().map_err(|e| {
                let again = format!(
                    "{} was in the way, and is there again after its removal ({e}): another \
                     process writes there; remove it and stop that process",
                    tmp.display()
                );
                std::io::Error::new(e.kind(), again)
            })
        }
        created => created,
    }
}

/// The tag of this process's temporaries of [`write_atomic`]: `<pid>-<start>`, the process id
/// and, in hexadecimal nanoseconds, when the process first wrote one. A process that has an
/// earlier one's id (a container's PID 1 at every start) so tells that one's temporaries,
/// which a crash left, from its own.
pub fn temporary_tag() -> String {
    static START: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
    let start = START.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    });
    format!("{}-{start:x}", std::process::id())
}

// `sync_folder`, shared with ddp-data and xtask.
include!("../../shared-src/folder_sync.rs");

fn io_error(path: &Path, source: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        path: path.to_owned(),
        source,
    }
}

fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        Kind::Float8e4m3fn => Dtype::F8_E4M3,
        Kind::Float8e5m2 => Dtype::F8_E5M2,
        _ => return None,
    })
}

pub(crate) fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        // safetensors' names of PyTorch's float8_e4m3fn and float8_e5m2.
        Dtype::F8_E4M3 => Kind::Float8e4m3fn,
        Dtype::F8_E5M2 => Kind::Float8e5m2,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Missing folders are made, the innermost last; one there is left be; a file in the way
    /// is an error.
    #[test]
    fn folders_are_made_as_create_dir_all_makes_them() {
        let tmp = ddp_testkit::temp_dir("ddp-model-dirs");
        let deep = tmp.path().join("a/b/c");
        create_dir_all_synced(&deep).unwrap();
        assert!(deep.is_dir());
        create_dir_all_synced(&deep).unwrap();
        fs::write(tmp.path().join("file"), b"x").unwrap();
        let e = create_dir_all_synced(&tmp.path().join("file/d")).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotADirectory);
        assert!(create_dir_all_synced(&tmp.path().join("file")).is_err());
    }

    /// float8 tensors (safetensors' `F8_E4M3` and `F8_E5M2`, as PyTorch's `save_file`
    /// writes them) are written and read back with their kind and values.
    #[test]
    fn float8_tensors_round_trip() {
        let tmp = ddp_testkit::temp_dir("ddp-model-float8");
        let file = tmp.path().join("f8.safetensors");
        let values = Tensor::from_slice(&[1.0f32, -2.0, 0.5]);
        let kinds = [Kind::Float8e4m3fn, Kind::Float8e5m2];
        let tensors = kinds.map(|k| (format!("{k:?}"), values.to_kind(k)));
        write_tensors(tensors, &HashMap::new(), &file).unwrap();
        let back = read_tensors(&file).unwrap();
        for kind in kinds {
            let t = &back.tensors[&format!("{kind:?}")];
            assert_eq!(t.kind(), kind);
            assert!(t.to_kind(Kind::Float).equal(&values), "{kind:?}");
        }
    }

    /// Metadata of several keys is written in key order, so that the same tensors and
    /// metadata give the same bytes in every process; the file reads back whole.
    #[test]
    fn metadata_is_written_in_key_order() {
        let tmp = ddp_testkit::temp_dir("ddp-model-metadata-order");
        let file = tmp.path().join("m.safetensors");
        let keys = ["h", "c", "f", "a", "g", "b", "e", "d"];
        let metadata: HashMap<String, String> = keys
            .iter()
            .map(|k| (k.to_string(), format!("value of {k}")))
            .collect();
        let tensors = [("w", Tensor::from_slice(&[1.0f32, 2.0, 3.0]))];
        write_tensors(tensors, &metadata, &file).unwrap();
        let bytes = fs::read(&file).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(header_len % 8, 0);
        let header = std::str::from_utf8(&bytes[8..8 + header_len]).unwrap();
        let at = |k: &str| header.find(&format!("\"value of {k}\"")).unwrap();
        let mut sorted = keys;
        sorted.sort();
        assert!(sorted.windows(2).all(|p| at(p[0]) < at(p[1])), "{header}");
        let read = read_tensors(&file).unwrap();
        assert_eq!(read.metadata, metadata);
        assert_eq!(read.tensors["w"], Tensor::from_slice(&[1.0f32, 2.0, 3.0]));
    }

    fn sorted(names: &[&str]) -> Vec<String> {
        let mut v: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        v.sort_by(|a, b| natural_cmp(a, b));
        v
    }

    #[test]
    fn natural_order_compares_digit_components_as_numbers() {
        assert_eq!(
            sorted(&["a.10.w", "a.2.w", "b", "a.1.w"]),
            ["a.1.w", "a.2.w", "a.10.w", "b"]
        );
        assert_eq!(
            sorted(&[
                "features.12.weight",
                "features.4.weight",
                "classifier.3.bias",
                "features.1.bias",
            ]),
            [
                "classifier.3.bias",
                "features.1.bias",
                "features.4.weight",
                "features.12.weight"
            ]
        );
    }

    #[test]
    fn natural_order_edge_cases() {
        // A prefix comes first; text compares as text, also against digits.
        assert_eq!(natural_cmp("a", "a.b"), Ordering::Less);
        assert_eq!(natural_cmp("a.b", "a"), Ordering::Greater);
        assert_eq!(natural_cmp("a.10", "a.x"), Ordering::Less);
        assert_eq!(natural_cmp("layer10", "layer9"), Ordering::Less);
        // Runs longer than any integer type still compare by value.
        assert_eq!(
            natural_cmp("a.100000000000000000000000", "a.99999999999999999999999"),
            Ordering::Greater
        );
        // Only identical names are equal; leading zeros are told apart, the order is total.
        assert_eq!(natural_cmp("a.2.w", "a.2.w"), Ordering::Equal);
        assert_eq!(natural_cmp("a.01", "a.1"), Ordering::Less);
        assert_eq!(natural_cmp("a.1", "a.01"), Ordering::Greater);
        assert_eq!(natural_cmp("a.01", "a.2"), Ordering::Less);
        assert_eq!(sorted(&["a.1", "a.01", "a.001"]), ["a.001", "a.01", "a.1"]);
    }

    #[test]
    fn named_tensors_are_in_natural_order() {
        let vs = VarStore::new(Device::Cpu);
        let root = vs.root();
        // tch builds dotted names from path segments.
        for path in [
            vec!["b"],
            vec!["a", "10", "w"],
            vec!["a", "2", "w"],
            vec!["a", "1", "w"],
        ] {
            let (last, parents) = path.split_last().unwrap();
            let p = parents.iter().fold(root.clone(), |p, s| p / *s);
            let _ = p.zeros(last, &[1]);
        }
        let names: Vec<String> = named_tensors(&vs).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a.1.w", "a.2.w", "a.10.w", "b"]);
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn write_atomic_creates_then_replaces_and_leaves_no_temporary_file() {
        let tmp = ddp_testkit::temp_dir("ddp-model-atomic");
        let dir = tmp.path();
        let path = dir.join("state.json");
        write_atomic(&path, b"first, longer content").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"first, longer content");
        write_atomic(&path, b"second").unwrap();
        // Replaced whole, not overwritten in place (which would leave the old tail).
        assert_eq!(fs::read(&path).unwrap(), b"second");
        assert_eq!(entries(dir), ["state.json"]);
    }

    #[test]
    fn write_atomic_failure_keeps_the_old_file_and_cleans_up() {
        let tmp = ddp_testkit::temp_dir("ddp-model-atomic-fail");
        let dir = tmp.path();
        // Renaming a file over a non-empty folder fails after the temporary file was written.
        let target = dir.join("occupied");
        fs::create_dir(&target).unwrap();
        fs::write(target.join("inside"), b"kept").unwrap();
        let err = write_atomic(&target, b"new").unwrap_err();
        assert_ne!(err.kind(), std::io::ErrorKind::NotFound, "{err}");
        assert_eq!(entries(dir), ["occupied"]);
        assert_eq!(fs::read(target.join("inside")).unwrap(), b"kept");
        // A missing folder is reported, not created.
        let err = write_atomic(&dir.join("no-such-dir").join("f"), b"x").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    }

    /// A link planted at the temporary's name is removed, not followed: its target keeps its
    /// content, and the write goes through.
    #[test]
    fn write_atomic_never_writes_through_a_link_at_its_temporary_name() {
        let tmp = ddp_testkit::temp_dir("ddp-model-atomic-link");
        let dir = tmp.path();
        let (path, victim) = (dir.join("state.json"), dir.join("victim"));
        fs::write(&victim, b"keep").unwrap();
        let planted = dir.join(format!(".state.json.tmp-{}", temporary_tag()));
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        write_atomic(&path, b"new").unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"keep");
        assert_eq!(fs::read(&path).unwrap(), b"new");
        assert_eq!(entries(dir), ["state.json", "victim"]);
    }

    /// A file that cannot be opened is named by the error, whose cause is its source and
    /// not repeated in its message, so that a chain of causes says it once.
    #[test]
    fn a_missing_file_leaves_its_cause_to_source() {
        use std::error::Error;
        let tmp = ddp_testkit::temp_dir("ddp-model-missing-file");
        let missing = tmp.path().join("absent.safetensors");
        let checkpoint = read_tensors(&missing).unwrap_err();
        assert!(
            matches!(checkpoint, CheckpointError::Io { .. }),
            "{checkpoint:?}"
        );
        let weights = crate::weights::read_state_dict(&missing).unwrap_err();
        assert!(
            matches!(weights, crate::weights::WeightsError::Io { .. }),
            "{weights:?}"
        );
        let errors: [(&(dyn Error + 'static), _); 2] = [
            (&checkpoint, format!("checkpoint '{}'", missing.display())),
            (&weights, format!("weights file '{}'", missing.display())),
        ];
        for (err, expected) in errors {
            let cause = err.source().expect("the OS error").to_string();
            assert!(cause.starts_with("No such file"), "{cause}");
            assert_eq!(err.to_string(), expected);
            let chain = std::iter::successors(Some(err), |&e| e.source());
            let text = chain
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(": ");
            assert_eq!(text, format!("{expected}: {cause}"));
            assert_eq!(text.matches(&cause).count(), 1, "{text}");
        }
    }
}
