//! The tensors collectives take: the [`Collective`] the group dispatches on, and what each
//! backend needs of a tensor (its bytes on the CPU, its [`DeviceBuffer`] for NCCL), with
//! the checks that refuse the others.

use tch::{Device, Kind, Tensor};

use crate::config::options::Backend;
use crate::element::{DType, ReduceOp};
use crate::error::CommError;
use crate::nccl::{self, DeviceBuffer};

/// One collective on tensors, which `ProcessGroup::run` hands to the backend of their
/// device, where it is written once per backend.
pub(crate) enum Collective<'a> {
    /// In place.
    AllReduce(&'a mut Tensor, ReduceOp),
    /// In place, from rank `root`.
    Broadcast(&'a mut Tensor, usize),
    /// Into `output`: same dtype and device, `world_size` times the input's elements;
    /// `in_place` when `input` is this rank's chunk of `output` ([`gather_source`]).
    AllGather {
        input: &'a Tensor,
        output: &'a mut Tensor,
        in_place: bool,
    },
}

impl Collective<'_> {
    /// The device of the tensors (an all-gather's two are on one, checked by the caller).
    pub(crate) fn device(&self) -> Result<Device, CommError> {
        match self {
            Collective::AllReduce(t, _) | Collective::Broadcast(t, _) => device_of(t),
            Collective::AllGather { input, .. } => device_of(input),
        }
    }
}

/// The device of `t`, refused if `t` is undefined (tch's `device` panics on it).
pub(crate) fn device_of(t: &Tensor) -> Result<Device, CommError> {
    if !t.defined() {
        return Err(CommError::Tensor {
            backend: "any",
            detail: "undefined tensor".into(),
        });
    }
    Ok(t.device())
}

/// The buffer of a CUDA tensor, checked for NCCL: the group's backend is NCCL (else `Tcp`
/// refuses it), the tensor is defined, contiguous, of a dtype NCCL has, and on this rank's
/// CUDA device `cuda:device`.
pub(crate) fn cuda_buffer(
    t: &Tensor,
    backend: Backend,
    device: usize,
) -> Result<DeviceBuffer, CommError> {
    let refuse = |detail: String| CommError::Tensor {
        backend: "nccl",
        detail,
    };
    if backend != Backend::Nccl {
        return Err(CommError::Tensor {
            backend: "cpu",
            detail: format!(
                "tensor on {:?}: the CPU backend (Backend::Cpu) only takes CPU tensors",
                t.device()
            ),
        });
    }
    check_layout(t, "nccl")?;
    let dtype = dtype_of(t.kind())
        .ok_or_else(|| refuse(format!("dtype {:?} is not supported", t.kind())))?;
    let nccl_dtype = nccl::nccl_dtype(dtype)
        .ok_or_else(|| refuse(format!("dtype {:?} has no NCCL type", t.kind())))?;
    if t.device() != Device::Cuda(device) {
        return Err(refuse(format!(
            "tensor on {:?}, but this rank's device is cuda:{device}",
            t.device(),
        )));
    }
    Ok(DeviceBuffer {
        ptr: t.data_ptr(),
        count: t.numel(),
        dtype: nccl_dtype,
    })
}

/// The error for a tensor on a device no backend takes.
pub(crate) fn unsupported_device(device: Device) -> CommError {
    CommError::Tensor {
        backend: "any",
        detail: format!("device {device:?} is not supported"),
    }
}

/// The element type of a tch kind, if collectives support it. A bool travels as its byte
/// (0 or 1), as in PyTorch's backends (an all-reduce's `Sum` of bools is their maximum).
pub fn dtype_of(kind: Kind) -> Option<DType> {
    Some(match kind {
        Kind::Uint8 | Kind::Bool => DType::U8,
        Kind::Int8 => DType::I8,
        Kind::Int16 => DType::I16,
        Kind::Int => DType::I32,
        Kind::Int64 => DType::I64,
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        _ => return None,
    })
}

/// The op an all-reduce of `t` runs on its bytes: `op` itself, but for a bool tensor, where
/// `Sum` (any rank true, as PyTorch maps it) and `Max` are the bytes' maximum, `Min` (every
/// rank true) their minimum, and `Avg` is refused, as PyTorch refuses it.
pub(crate) fn bool_op(t: &Tensor, op: ReduceOp) -> Result<ReduceOp, CommError> {
    if !t.defined() || t.kind() != Kind::Bool {
        return Ok(op);
    }
    match op {
        ReduceOp::Sum | ReduceOp::Max => Ok(ReduceOp::Max),
        ReduceOp::Min => Ok(ReduceOp::Min),
        ReduceOp::Avg => Err(CommError::InvalidArgument(
            "ReduceOp::Avg of a bool tensor has no meaning: use Sum or Max (true on any \
             rank) or Min (true on every rank)"
                .into(),
        )),
    }
}

/// Where an all-gather's `input` lies in its `output` (of one dtype and device, `output`
/// holding `world_size` times the input's elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GatherInput {
    /// Exactly rank `rank`'s chunk (PyTorch's in-place all-gather, `input =
    /// output.narrow(0, rank * n, n)`).
    InPlace,
    /// They share no byte (or a tensor is not dense and contiguous: the backends' checks
    /// refuse it).
    Apart,
    /// Any other overlap: the output would be written while the input is read.
    Overlapping,
}

/// What rank `rank`'s all-gather of `input` into `output` reads: `input` itself (`None`),
/// or a copy of its values where it overlaps `output` elsewhere than at this rank's chunk
/// (every rank then gathers alike); and whether it gathers in place.
pub(crate) fn gather_source(
    input: &Tensor,
    output: &Tensor,
    rank: usize,
) -> Result<(Option<Tensor>, bool), CommError> {
    Ok(match gather_input(input, output, rank) {
        GatherInput::InPlace => (None, true),
        GatherInput::Apart => (None, false),
        GatherInput::Overlapping => {
            let copy = input.f_detach_copy().map_err(|e| CommError::Tensor {
                backend: "any",
                detail: format!("copying the input, which overlaps the output: {e}"),
            })?;
            (Some(copy), false)
        }
    })
}

/// Where `input` lies in `output` for rank `rank` ([`GatherInput`]).
fn gather_input(input: &Tensor, output: &Tensor, rank: usize) -> GatherInput {
    if check_layout(input, "any").is_err() || check_layout(output, "any").is_err() {
        return GatherInput::Apart;
    }
    let element = output.kind().elt_size_in_bytes();
    let (len, out_len) = (input.numel() * element, output.numel() * element);
    let (start, out) = (input.data_ptr() as usize, output.data_ptr() as usize);
    if len == 0 || start >= out + out_len || out >= start + len {
        GatherInput::Apart
    } else if start == out + rank * len {
        GatherInput::InPlace
    } else {
        GatherInput::Overlapping
    }
}

/// Fails unless `t` is defined, dense (strided) and contiguous (`backend` names the refusing
/// backend). The layout is asked first: tch's `is_contiguous` and `data_ptr` panic on a
/// sparse CSR or an MKLDNN tensor (libtorch throws), so neither runs on those.
fn check_layout(t: &Tensor, backend: &'static str) -> Result<(), CommError> {
    if !t.defined() {
        return Err(CommError::Tensor {
            backend,
            detail: "undefined tensor".into(),
        });
    }
    if let Some(layout) = not_dense(t) {
        // Sparse and MKLDNN tensors cannot be made contiguous, only dense.
        let hint = match layout {
            NOT_DENSE => ".dequantize() for a quantized one",
            _ => ".to_dense()",
        };
        return Err(CommError::Tensor {
            backend,
            detail: format!(
                "a {layout} tensor is not supported: collectives take dense strided tensors \
                 (call {hint})"
            ),
        });
    }
    if !t.is_contiguous() {
        return Err(CommError::Tensor {
            backend,
            detail: format!(
                "tensor of shape {:?} is not contiguous (call .contiguous())",
                t.size()
            ),
        });
    }
    Ok(())
}

/// What [`not_dense`] calls a tensor it cannot name (quantized, nested, ...).
const NOT_DENSE: &str = "non-dense";

/// The layout of a defined tensor that is not dense, by name; `None` for a dense one. tch has
/// no layout query: a dense tensor is one whose dispatch keys say dense (c10's
/// `has_compatible_shallow_copy_type` with a dense tensor, which no other layout passes).
/// Only the names of refused layouts cost a (caught) libtorch exception.
fn not_dense(t: &Tensor) -> Option<&'static str> {
    if t.is_sparse() {
        return Some("sparse COO");
    }
    if t.is_mkldnn() {
        return Some("MKLDNN");
    }
    thread_local! {
        // A dense tensor to compare layouts with, made once per thread: this check runs on
        // every collective (each DDP bucket of each step).
        static DENSE: Tensor = Tensor::empty([0], (Kind::Uint8, Device::Cpu));
    }
    let dense = DENSE.with(|d| t.f_internal_has_compatible_shallow_copy_type(d));
    if dense.unwrap_or(false) {
        return None;
    }
    // Compressed layouts: CSR and BSR have row pointers, CSC and BSC column pointers; the
    // blocked ones' values have two block dimensions.
    let blocked = || match (t.f_values(), t.f_dense_dim()) {
        (Ok(values), Ok(dense_dims)) => values.dim() as i64 - dense_dims == 3,
        _ => false,
    };
    Some(
        match (t.f_crow_indices().is_ok(), t.f_ccol_indices().is_ok()) {
            (true, _) if blocked() => "sparse BSR",
            (true, _) => "sparse CSR",
            (_, true) if blocked() => "sparse BSC",
            (_, true) => "sparse CSC",
            _ => NOT_DENSE,
        },
    )
}

/// The element type of a CPU tensor the CPU backend takes: defined, dense, contiguous, of a
/// supported dtype (the checks of [`cpu_bytes`], which asynchronous collectives run at the
/// call).
pub(crate) fn cpu_dtype(t: &Tensor) -> Result<DType, CommError> {
    check_layout(t, "cpu")?;
    dtype_of(t.kind()).ok_or_else(|| CommError::Tensor {
        backend: "cpu",
        detail: format!("dtype {:?} is not supported on CPU", t.kind()),
    })
}

/// The bytes of a contiguous CPU tensor and their element type.
pub(crate) fn cpu_bytes(t: &mut Tensor) -> Result<(&mut [u8], DType), CommError> {
    let dtype = cpu_dtype(t)?;
    let len = t.numel() * dtype.size();
    if len == 0 {
        return Ok((&mut [], dtype));
    }
    let ptr = t.data_ptr().cast::<u8>();
    // SAFETY: `t` is a defined, dense, contiguous CPU tensor, so its data is `numel * element
    // size` initialised bytes at `data_ptr`, aligned for its element type; the mutable borrow
    // of `t` keeps this handle from being used while the slice lives (other tensors sharing
    // the storage are the caller's responsibility, as in PyTorch).
    Ok((unsafe { std::slice::from_raw_parts_mut(ptr, len) }, dtype))
}
