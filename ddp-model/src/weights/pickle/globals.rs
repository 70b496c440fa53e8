//! The allow list: the globals a `torch.save` of a state_dict names, and those of the plain
//! values `weights_only` allows beside it in a checkpoint, by their full names.

use tch::Kind;

use super::{Element, Global, PickleError};

/// The storage classes and dtypes by name, with the tch kind where there is one: every
/// dtype of torch 2.13, so that a tensor of one tch lacks is refused as unsupported, not as
/// a forbidden global (which re-saving the file would not mend).
const ELEMENTS: [(&str, &str, Option<Kind>); 46] = [
    ("FloatStorage", "float32", Some(Kind::Float)),
    ("DoubleStorage", "float64", Some(Kind::Double)),
    ("HalfStorage", "float16", Some(Kind::Half)),
    ("BFloat16Storage", "bfloat16", Some(Kind::BFloat16)),
    ("LongStorage", "int64", Some(Kind::Int64)),
    ("IntStorage", "int32", Some(Kind::Int)),
    ("ShortStorage", "int16", Some(Kind::Int16)),
    ("CharStorage", "int8", Some(Kind::Int8)),
    ("ByteStorage", "uint8", Some(Kind::Uint8)),
    ("BoolStorage", "bool", Some(Kind::Bool)),
    ("ComplexFloatStorage", "complex64", Some(Kind::ComplexFloat)),
    (
        "ComplexDoubleStorage",
        "complex128",
        Some(Kind::ComplexDouble),
    ),
    ("ComplexHalfStorage", "complex32", Some(Kind::ComplexHalf)),
    ("", "float8_e5m2", Some(Kind::Float8e5m2)),
    ("", "float8_e4m3fn", Some(Kind::Float8e4m3fn)),
    ("", "float8_e5m2fnuz", Some(Kind::Float8e5m2fnuz)),
    ("", "float8_e4m3fnuz", Some(Kind::Float8e4m3fnuz)),
    ("QInt8Storage", "qint8", None),
    ("QUInt8Storage", "quint8", None),
    ("QInt32Storage", "qint32", None),
    ("QUInt4x2Storage", "quint4x2", None),
    ("QUInt2x4Storage", "quint2x4", None),
    ("", "uint16", None),
    ("", "uint32", None),
    ("", "uint64", None),
    ("", "float8_e8m0fnu", None),
    ("", "float4_e2m1fn_x2", None),
    ("", "int1", None),
    ("", "int2", None),
    ("", "int3", None),
    ("", "int4", None),
    ("", "int5", None),
    ("", "int6", None),
    ("", "int7", None),
    ("", "uint1", None),
    ("", "uint2", None),
    ("", "uint3", None),
    ("", "uint4", None),
    ("", "uint5", None),
    ("", "uint6", None),
    ("", "uint7", None),
    ("", "bits1x8", None),
    ("", "bits2x4", None),
    ("", "bits4x2", None),
    ("", "bits8", None),
    ("", "bits16", None),
];

/// Other spellings of torch's dtypes (`torch.float` is `torch.float32`).
const DTYPE_ALIASES: [(&str, &str); 10] = [
    ("float", "float32"),
    ("double", "float64"),
    ("half", "float16"),
    ("long", "int64"),
    ("int", "int32"),
    ("short", "int16"),
    ("cfloat", "complex64"),
    ("cdouble", "complex128"),
    ("chalf", "complex32"),
    ("bit", "uint1"),
];

/// Globals that `torch.load(weights_only=True)` allows but a state_dict of dense tensors
/// never names; refused as unsupported rather than forbidden.
const TORCH_ALLOWED_UNSUPPORTED: [&str; 10] = [
    "torch._utils._rebuild_qtensor",
    "torch._utils._rebuild_sparse_tensor",
    "torch._utils._rebuild_meta_tensor_no_storage",
    "torch._utils._rebuild_nested_tensor",
    "torch._utils._rebuild_wrapper_subclass",
    "torch._utils._rebuild_device_tensor_from_numpy",
    "torch._tensor._rebuild_from_type_v2",
    "torch.nn.parameter.Parameter",
    "torch.Tensor",
    "torch.serialization._get_layout",
];

fn element(name: &str, storage: bool) -> Option<Element> {
    let name = if storage {
        name
    } else {
        DTYPE_ALIASES
            .iter()
            .find(|(alias, _)| *alias == name)
            .map_or(name, |(_, canonical)| canonical)
    };
    ELEMENTS
        .iter()
        .find(|(s, d, _)| if storage { *s == name } else { *d == name })
        .map(|(_, dtype, kind)| match kind {
            Some(k) => Element::Kind(*k),
            None => Element::Other((*dtype).to_string()),
        })
}

/// The allowed global of that name, or why it is refused.
pub(super) fn resolve_global(module: &str, name: &str) -> Result<Global, PickleError> {
    let full = format!("{module}.{name}");
    let g = match full.as_str() {
        "collections.OrderedDict" => Global::OrderedDict,
        "torch._utils._rebuild_tensor" => Global::RebuildTensor,
        "torch._utils._rebuild_tensor_v2" => Global::RebuildTensorV2,
        "torch._utils._rebuild_tensor_v3" => Global::RebuildTensorV3,
        "torch._utils._rebuild_parameter" => Global::RebuildParameter,
        "torch._utils._rebuild_parameter_with_state" => Global::RebuildParameterWithState,
        "torch.storage.UntypedStorage" | "torch.UntypedStorage" => Global::UntypedStorage,
        "torch.Size" => Global::Size,
        "_codecs.encode" => Global::Encode,
        "builtins.set" | "__builtin__.set" => Global::Set,
        "torch._utils._rebuild_device_tensor_from_cpu_tensor" => Global::DeviceTensorFromCpu,
        "torch.device" => Global::Device,
        "collections.Counter" => Global::Counter,
        "builtins.bytearray" | "__builtin__.bytearray" => Global::ByteArray,
        "builtins.complex" | "__builtin__.complex" => Global::Complex,
        _ if TORCH_ALLOWED_UNSUPPORTED.contains(&full.as_str()) => {
            return Err(PickleError::Unsupported(format!(
                "the global '{full}' (a state_dict of dense tensors does not need it)"
            )))
        }
        _ if module == "torch" => {
            if let Some(e) = element(name, true) {
                Global::Storage(e)
            } else if let Some(e) = element(name, false) {
                Global::Dtype(e)
            } else {
                return Err(PickleError::Forbidden(full));
            }
        }
        _ => return Err(PickleError::Forbidden(full)),
    };
    Ok(g)
}

pub(super) fn global_name(g: &Global) -> String {
    match g {
        Global::OrderedDict => "collections.OrderedDict".into(),
        Global::RebuildTensor => "torch._utils._rebuild_tensor".into(),
        Global::RebuildTensorV2 => "torch._utils._rebuild_tensor_v2".into(),
        Global::RebuildTensorV3 => "torch._utils._rebuild_tensor_v3".into(),
        Global::RebuildParameter => "torch._utils._rebuild_parameter".into(),
        Global::RebuildParameterWithState => "torch._utils._rebuild_parameter_with_state".into(),
        Global::Storage(e) => format!("a {e:?} storage type"),
        Global::UntypedStorage => "torch.storage.UntypedStorage".into(),
        Global::Dtype(e) => format!("the dtype {e:?}"),
        Global::Size => "torch.Size".into(),
        Global::Encode => "_codecs.encode".into(),
        Global::Set => "builtins.set".into(),
        Global::DeviceTensorFromCpu => "torch._utils._rebuild_device_tensor_from_cpu_tensor".into(),
        Global::Device => "torch.device".into(),
        Global::Counter => "collections.Counter".into(),
        Global::ByteArray => "builtins.bytearray".into(),
        Global::Complex => "builtins.complex".into(),
    }
}
