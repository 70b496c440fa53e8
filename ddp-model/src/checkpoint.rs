//! safetensors checkpoints with PyTorch state-dict names, written atomically, loaded strictly.
//!
//! A checkpoint written here is what `safetensors.torch.save_file(model.state_dict(), path)`
//! writes for the PyTorch definition of the model: the same names (no `module.` prefix), the
//! same shapes and dtypes (`num_batches_tracked` is int64). Loading checks every tensor first
//! and changes nothing unless all of them match.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use tch::{nn::VarStore, Device, Kind, Tensor};

/// Why a checkpoint could not be written or loaded.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading, writing, syncing or renaming the file failed.
    #[error("checkpoint '{path}': {source}")]
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
        /// Every tensor that differs, sorted by name.
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

fn list(problems: &[TensorProblem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Named tensors plus the string metadata stored in a safetensors header.
#[derive(Debug, Default)]
pub struct TensorFile {
    /// Tensors by name, on the CPU.
    pub tensors: BTreeMap<String, Tensor>,
    /// The header's `__metadata__` map.
    pub metadata: HashMap<String, String>,
}

/// The model's tensors (parameters and buffers) sorted by name: the order every rank agrees on.
pub fn named_tensors(vs: &VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
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
/// the same model) into `vs`. The file is read on the CPU, every tensor is checked against
/// the model (names, shapes, dtypes), and only when all match are they copied to the model's
/// device. Returns the file's metadata.
pub fn load(
    vs: &VarStore,
    path: impl AsRef<Path>,
) -> Result<HashMap<String, String>, CheckpointError> {
    let path = path.as_ref();
    let file = read_tensors(path)?;
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
        problems.sort_by(|a, b| problem_name(a).cmp(problem_name(b)));
        return Err(CheckpointError::Mismatch {
            path: path.to_owned(),
            problems,
        });
    }
    tch::no_grad(|| {
        for (name, mut var) in model {
            let src = &file.tensors[&name];
            var.copy_(&src.to_device(var.device()));
        }
    });
    Ok(file.metadata)
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
    let bytes = safetensors::serialize(views, &meta).map_err(|e| CheckpointError::Format {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    write_atomically(path, &bytes)
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
    Ok(TensorFile { tensors, metadata })
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        // The rename is durable only once the folder's entry is on disk.
        File::open(&dir)?.sync_all()
    })();
    result.map_err(|source| {
        let _ = fs::remove_file(&tmp);
        io_error(path, source)
    })
}

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
        _ => return None,
    })
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
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
        _ => return None,
    })
}
