//! A data-only pickle machine with `torch.load(weights_only=True)`'s allow list.
//!
//! It understands the opcodes of pickle protocols 2 to 5 that describe data (numbers,
//! strings, bytes, tuples, lists, dicts, sets, the memo) and, of the opcodes that name or call
//! Python objects, only what a `torch.save` of a state_dict uses: `GLOBAL`/`STACK_GLOBAL` of an
//! allowed name (`globals.rs`), `REDUCE` of those globals (`rebuild.rs`), `BUILD` on a dict (an
//! `OrderedDict`'s `_metadata`, which is dropped) and `BINPERSID` of a storage. A name outside
//! the allow list is refused when its `GLOBAL` is read, before anything else happens; nothing
//! is ever called, because the machine has nothing to call: a `REDUCE` of an allowed global
//! builds one of the [`Value`]s below.
//!
//! Every length and index in the stream is checked against what is there, so a truncated or
//! hostile stream ends in [`PickleError::Malformed`], never in a panic.

use std::rc::Rc;

use tch::Kind;

mod globals;
mod machine;
mod rebuild;

/// Why a pickle stream was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickleError {
    /// The stream names a global that a state_dict never needs.
    #[error("names the global '{0}', which is not allowed")]
    Forbidden(String),
    /// The stream uses something `torch.load(weights_only=True)` accepts but a state_dict of
    /// dense tensors does not need.
    #[error("uses {0}, which this reader does not support")]
    Unsupported(String),
    /// The stream is not a valid pickle.
    #[error("is not a valid pickle at byte {at}: {reason}")]
    Malformed {
        /// Offset of the opcode in the stream.
        at: usize,
        /// What is wrong.
        reason: String,
    },
}

/// What went wrong in a step of the machine, before the machine adds the stream position.
#[derive(Debug)]
enum Fault {
    Malformed(String),
    Unsupported(String),
}

/// The element type of a storage or a `torch.<dtype>` global: a tch kind, or the name of a
/// torch dtype tch has no kind for (`uint16`, `qint8`, ...).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Element {
    Kind(Kind),
    Other(String),
}

/// A storage named by a persistent id: `('storage', type, key, location, numel)`.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct StorageRef {
    /// `None` for an `UntypedStorage` (bytes; the tensor gives the dtype).
    pub element: Option<Element>,
    /// The record's name under `data/`.
    pub key: String,
    /// Elements (bytes for an untyped storage).
    pub numel: i64,
}

/// A tensor as `_rebuild_tensor*` describes it: a strided view of a storage.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct TensorRef {
    pub storage: Rc<StorageRef>,
    /// The dtype of `_rebuild_tensor_v3` (the storage is then untyped).
    pub element: Option<Element>,
    pub offset: i64,
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
}

/// The allowed globals.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Global {
    OrderedDict,
    RebuildTensor,
    RebuildTensorV2,
    RebuildTensorV3,
    RebuildParameter,
    RebuildParameterWithState,
    Storage(Element),
    UntypedStorage,
    Dtype(Element),
    Size,
    Encode,
    Set,
}

/// A value on the machine's stack. Lists and dicts live in an [`Arena`] so that the memo and
/// the stack share them, as Python's objects are shared; everything else is immutable and
/// cheap to clone.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tuple(Rc<[Value]>),
    List(usize),
    Dict(usize),
    Global(Global),
    Storage(Rc<StorageRef>),
    Tensor(Rc<TensorRef>),
}

impl Value {
    /// What the value is, for error messages.
    pub fn describe(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "a bool",
            Value::Int(_) => "an int",
            Value::Float(_) => "a float",
            Value::Str(_) => "a str",
            Value::Bytes(_) => "bytes",
            Value::Tuple(_) => "a tuple",
            Value::List(_) => "a list",
            Value::Dict(_) => "a dict",
            Value::Global(_) => "a class or function",
            Value::Storage(_) => "a storage",
            Value::Tensor(_) => "a tensor",
        }
    }
}

/// The lists (sets too) and dicts of one stream, by the index their [`Value`] holds. Dicts
/// keep insertion order, and a repeated key replaces the value in place, as in Python.
#[derive(Debug, Default)]
pub(super) struct Arena {
    lists: Vec<Vec<Value>>,
    dicts: Vec<Vec<(Value, Value)>>,
}

impl Arena {
    fn new_list(&mut self, items: Vec<Value>) -> Value {
        self.lists.push(items);
        Value::List(self.lists.len() - 1)
    }

    fn new_dict(&mut self) -> Value {
        self.dicts.push(Vec::new());
        Value::Dict(self.dicts.len() - 1)
    }

    fn list(&self, id: usize) -> Result<&[Value], Fault> {
        self.lists
            .get(id)
            .map(Vec::as_slice)
            .ok_or_else(|| Fault::Malformed(format!("list {id} does not exist")))
    }

    fn list_mut(&mut self, id: usize) -> Result<&mut Vec<Value>, Fault> {
        self.lists
            .get_mut(id)
            .ok_or_else(|| Fault::Malformed(format!("list {id} does not exist")))
    }

    /// Sets `items` (key, value, key, value, ...) in dict `id`.
    fn insert(&mut self, id: usize, items: Vec<Value>) -> Result<(), Fault> {
        if items.len() % 2 != 0 {
            return Err(Fault::Malformed("a dict needs key-value pairs".into()));
        }
        let dict = self
            .dicts
            .get_mut(id)
            .ok_or_else(|| Fault::Malformed(format!("dict {id} does not exist")))?;
        let mut items = items.into_iter();
        while let (Some(k), Some(v)) = (items.next(), items.next()) {
            match dict.iter_mut().find(|(key, _)| *key == k) {
                Some(entry) => entry.1 = v,
                None => dict.push((k, v)),
            }
        }
        Ok(())
    }
}

/// What a stream unpickled to: its top value and the arena its lists and dicts live in.
#[derive(Debug)]
pub(super) struct Unpickled {
    pub value: Value,
    arena: Arena,
}

impl Unpickled {
    /// The entries of a dict value.
    pub fn dict(&self, value: &Value) -> Option<&[(Value, Value)]> {
        match value {
            Value::Dict(id) => self.arena.dicts.get(*id).map(Vec::as_slice),
            _ => None,
        }
    }

    /// The items of a list value.
    #[cfg(test)]
    fn list(&self, value: &Value) -> Option<&[Value]> {
        match value {
            Value::List(id) => self.arena.list(*id).ok(),
            _ => None,
        }
    }
}

/// Runs the stream to its `STOP`.
pub(super) fn unpickle(bytes: &[u8]) -> Result<Unpickled, PickleError> {
    let (value, arena) = machine::run(bytes)?;
    Ok(Unpickled { value, arena })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forbidden_globals_are_named_and_refused_when_read() {
        // GLOBAL 'os system', then garbage that would be malformed if it were reached.
        let err = unpickle(b"\x80\x02cos\nsystem\n\xff").unwrap_err();
        assert_eq!(err, PickleError::Forbidden("os.system".into()));
        // STACK_GLOBAL of builtins.eval.
        let err = unpickle(b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93.").unwrap_err();
        assert_eq!(err, PickleError::Forbidden("builtins.eval".into()));
        // A torch name that is neither a storage nor a dtype.
        let err = unpickle(b"\x80\x02ctorch\nload\n.").unwrap_err();
        assert_eq!(err, PickleError::Forbidden("torch.load".into()));
        let err = unpickle(b"\x80\x02ctorch._utils\n_rebuild_qtensor\n.").unwrap_err();
        assert!(matches!(err, PickleError::Unsupported(s) if s.contains("_rebuild_qtensor")));
    }

    #[test]
    fn data_opcodes_build_shared_containers() {
        // {'a': [1, -2, 3.5], 'b': <same list>} with the list memoized and appended after
        // it was stored in the memo; a repeated key replaces in place.
        let mut p = b"\x80\x02}q\x00(X\x01\x00\x00\x00a]q\x01X\x01\x00\x00\x00bh\x01u".to_vec();
        p.extend_from_slice(b"h\x01(K\x01J\xfe\xff\xff\xffG\x40\x0c\x00\x00\x00\x00\x00\x00e0");
        p.extend_from_slice(b"X\x01\x00\x00\x00a\x8a\x01\x07s.");
        let u = unpickle(&p).unwrap();
        let dict = u.dict(&u.value).unwrap();
        assert_eq!(dict.len(), 2);
        assert_eq!(dict[0], (Value::Str("a".into()), Value::Int(7)));
        assert_eq!(
            u.list(&dict[1].1).unwrap(),
            &[Value::Int(1), Value::Int(-2), Value::Float(3.5)],
            "the list appended after memoization is the dict's"
        );
    }

    #[test]
    fn malformed_streams_are_errors_not_panics() {
        for bytes in [
            &b""[..],
            b"\x80\x02",
            b"\x80\x02h\x05.",
            b"\x80\x02X\xff\xff\xff\xff",
            b"\x80\x02e.",
            b"\x80\x02K\x01K\x02s.",
            b"\x80\x02\x8b\xff\xff\xff\xff.",
            b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.",
            b"\x80\x02)R.",
            // A tensor rebuilt from an int instead of a storage.
            b"\x80\x02ctorch._utils\n_rebuild_tensor\n(K\x00K\x00))tR.",
        ] {
            assert!(
                matches!(unpickle(bytes), Err(PickleError::Malformed { .. })),
                "{bytes:?}: {:?}",
                unpickle(bytes)
            );
        }
    }

    #[test]
    fn long_integers_sign_extend() {
        let u = unpickle(b"\x80\x02\x8a\x02\xff\x7f.").unwrap();
        assert_eq!(u.value, Value::Int(0x7fff));
        let u = unpickle(b"\x80\x02\x8a\x01\xff.").unwrap();
        assert_eq!(u.value, Value::Int(-1));
        let u = unpickle(b"\x80\x02\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\xff.").unwrap();
        assert_eq!(u.value, Value::Int(-1));
    }
}
