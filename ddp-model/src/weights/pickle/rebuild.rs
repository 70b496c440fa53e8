//! What `REDUCE` and `BINPERSID` make of the allowed globals' arguments: dicts, tensor
//! descriptions and storage references, built as values, never by calling anything.

use std::rc::Rc;

use super::globals::global_name;
use super::{Arena, Element, Fault, Global, StorageRef, TensorRef, Value, Work};

fn malformed<T>(reason: impl Into<String>) -> Result<T, Fault> {
    Err(Fault::Malformed(reason.into()))
}

/// `('storage', storage_type, key, location, numel)`; the location (`cpu`, `cuda:0`) is not
/// used: every storage is read onto the CPU (`map_location="cpu"`).
pub(super) fn persistent_load(
    arena: &Arena,
    work: &mut Work,
    pid: &Value,
) -> Result<StorageRef, Fault> {
    let Value::Tuple(items) = pid else {
        return malformed(format!(
            "a persistent id is {}, not a tuple",
            pid.describe()
        ));
    };
    spend_on(arena, work, items)?;
    match &items[..] {
        [Value::Str(tag), Value::Global(g), Value::Str(key), Value::Str(_location), Value::Int(numel)]
            if &**tag == "storage" =>
        {
            let element = match g {
                Global::Storage(e) => Some(e.clone()),
                Global::UntypedStorage => None,
                _ => return malformed("a persistent id names no storage type"),
            };
            if *numel < 0 {
                return malformed("a storage has a negative size");
            }
            Ok(StorageRef {
                element,
                key: key.to_string(),
                numel: *numel,
            })
        }
        [Value::Str(tag), ..] if &**tag != "storage" => Err(Fault::Unsupported(format!(
            "a persistent id of kind '{tag}' (only storages are allowed)"
        ))),
        _ => malformed("a persistent id is not ('storage', type, key, location, numel)"),
    }
}

/// Spends what reading `args` whole may copy or walk: the memo may name the same long list,
/// dict, tuple or string in every call.
fn spend_on(arena: &Arena, work: &mut Work, args: &[Value]) -> Result<(), Fault> {
    work.spend(args.iter().map(|a| arena.weight(a)).sum())
}

/// The value of `callable(*args)` for an allowed global; the keys of a dict it builds are
/// hashed out of `work` too.
pub(super) fn reduce(
    arena: &mut Arena,
    work: &mut Work,
    callable: Value,
    args: &[Value],
) -> Result<Value, Fault> {
    let Value::Global(g) = callable else {
        return malformed(format!("REDUCE calls {}", callable.describe()));
    };
    spend_on(arena, work, args)?;
    match (g, args) {
        (Global::OrderedDict, []) => Ok(arena.new_dict()),
        (Global::OrderedDict, [Value::List(id)]) => {
            let mut items = Vec::new();
            for pair in arena.list(*id)? {
                match pair {
                    Value::Tuple(kv) if kv.len() == 2 => items.extend(kv.iter().cloned()),
                    _ => return malformed("OrderedDict needs (key, value) pairs"),
                }
            }
            dict_of(arena, work, items)
        }
        (Global::RebuildTensor, [storage, offset, size, stride]) => {
            tensor(storage, offset, size, stride, None, (false, false))
        }
        (Global::RebuildTensorV2, [storage, offset, size, stride, _, _, metadata @ ..])
            if metadata.len() <= 1 =>
        {
            let bits = neg_conj(arena, metadata.first())?;
            tensor(storage, offset, size, stride, None, bits)
        }
        (Global::RebuildTensorV3, [storage, offset, size, stride, _, _, dtype, metadata @ ..])
            if metadata.len() <= 1 =>
        {
            let Value::Global(Global::Dtype(element)) = dtype else {
                return malformed("_rebuild_tensor_v3 needs a dtype");
            };
            let bits = neg_conj(arena, metadata.first())?;
            tensor(storage, offset, size, stride, Some(element.clone()), bits)
        }
        (Global::RebuildParameter, [tensor @ Value::Tensor(_), _, _])
        | (Global::RebuildParameterWithState, [tensor @ Value::Tensor(_), _, _, _]) => {
            Ok(tensor.clone())
        }
        (Global::Size, [Value::Tuple(dims)]) => Ok(Value::Tuple(dims.clone())),
        (Global::Encode | Global::ByteArray, [Value::Str(s), Value::Str(encoding)])
            if &**encoding == "latin1" || &**encoding == "latin-1" =>
        {
            let bytes: Option<Vec<u8>> =
                s.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect();
            match bytes {
                Some(b) => Ok(Value::Bytes(b.into())),
                None => malformed("_codecs.encode of a non-latin1 string"),
            }
        }
        (Global::Set, []) => Ok(arena.new_list(Vec::new())),
        (Global::Set, [Value::List(id)]) => {
            let items = arena.list(*id)?.to_vec();
            Ok(arena.new_list(items))
        }
        // A tensor of an XLA, MTIA or MAIA device: its CPU copy, read onto the CPU as
        // `map_location="cpu"` does, in the dtype it had.
        (
            Global::DeviceTensorFromCpu,
            [Value::Tensor(t), Value::Global(Global::Dtype(dtype)), Value::Str(_device), _],
        ) => {
            let stored = t.element.as_ref().or(t.storage.element.as_ref());
            if stored == Some(dtype) {
                return Ok(Value::Tensor(t.clone()));
            }
            Ok(Value::Tensor(Rc::new(TensorRef {
                cast: Some(dtype.clone()),
                ..(**t).clone()
            })))
        }
        // The other values `weights_only` allows, which a checkpoint's other entries may
        // hold: kept as what they are, nothing is built from them.
        (Global::Device, [Value::Str(_)] | [Value::Str(_), Value::Int(_)]) => {
            Ok(Value::Opaque("a torch.device"))
        }
        (Global::Counter, []) => Ok(arena.new_dict()),
        (Global::Counter, [Value::Dict(id)]) => {
            let items = arena
                .dict(*id)?
                .iter()
                .flat_map(|(k, v)| [k.clone(), v.clone()]);
            let items = items.collect();
            dict_of(arena, work, items)
        }
        (Global::ByteArray, []) => Ok(Value::Bytes(Rc::from([]))),
        (Global::ByteArray, [bytes @ Value::Bytes(_)]) => Ok(bytes.clone()),
        (Global::Complex, parts)
            if parts.len() <= 2
                && parts
                    .iter()
                    .all(|p| matches!(p, Value::Int(_) | Value::Float(_) | Value::Bool(_))) =>
        {
            Ok(Value::Opaque("a complex"))
        }
        (g, args) => malformed(format!(
            "{} cannot be called with {} argument(s) of these types: {}",
            global_name(&g),
            args.len(),
            args.iter()
                .map(Value::describe)
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// A new dict of `items` (key, value, key, value, ...).
fn dict_of(arena: &mut Arena, work: &mut Work, items: Vec<Value>) -> Result<Value, Fault> {
    let dict = arena.new_dict();
    if let Value::Dict(id) = dict {
        arena.insert(id, items, work)?;
    }
    Ok(dict)
}

/// The lazy `neg` and `conj` bits of `_rebuild_tensor_v2`'s (or v3's) metadata argument, a
/// dict such as `{'neg': True}`: like torch's `setTensorMetadata`, a key sets its bit.
fn neg_conj(arena: &Arena, metadata: Option<&Value>) -> Result<(bool, bool), Fault> {
    let entries = match metadata {
        None | Some(Value::None) => return Ok((false, false)),
        Some(Value::Dict(id)) => arena.dict(*id)?,
        Some(other) => {
            return malformed(format!(
                "a tensor's metadata is {}, not a dict",
                other.describe()
            ))
        }
    };
    let has = |bit: &str| {
        entries
            .iter()
            .any(|(k, _)| matches!(k, Value::Str(s) if &**s == bit))
    };
    Ok((has("neg"), has("conj")))
}

fn tensor(
    storage: &Value,
    offset: &Value,
    size: &Value,
    stride: &Value,
    element: Option<Element>,
    (neg, conj): (bool, bool),
) -> Result<Value, Fault> {
    let Value::Storage(storage) = storage else {
        return malformed(format!(
            "a tensor is rebuilt from {}, not a storage",
            storage.describe()
        ));
    };
    let Value::Int(offset) = *offset else {
        return malformed(format!(
            "a tensor's storage offset is {}, not a 64-bit int",
            offset.describe()
        ));
    };
    let ints = |v: &Value, what: &str| -> Result<Vec<i64>, Fault> {
        match v {
            Value::Tuple(items) => items
                .iter()
                .map(|i| match i {
                    Value::Int(n) => Ok(*n),
                    Value::Opaque(wide) => malformed(format!("a tensor's {what} holds {wide}")),
                    _ => malformed(format!("a tensor's {what} holds a non-integer")),
                })
                .collect(),
            _ => malformed(format!("a tensor's {what} is not a tuple")),
        }
    };
    Ok(Value::Tensor(Rc::new(TensorRef {
        storage: storage.clone(),
        element,
        offset,
        size: ints(size, "size")?,
        stride: ints(stride, "stride")?,
        neg,
        conj,
        cast: None,
    })))
}
