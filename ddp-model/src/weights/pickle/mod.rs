//! A data-only pickle machine with `torch.load(weights_only=True)`'s allow list.
//!
//! It understands the opcodes of pickle protocols 2 to 5 that describe data (numbers,
//! strings, bytes, tuples, lists, dicts, sets, the memo) and, of the opcodes that name or call
//! Python objects, only what a `torch.save` of a state_dict uses: `GLOBAL`/`STACK_GLOBAL` of an
//! allowed name (`globals.rs`), `REDUCE` of those globals (`rebuild.rs`), `BUILD` on a dict (an
//! `OrderedDict`'s `_metadata`, which is dropped) and `BINPERSID` of a storage. A name outside
//! the allow list is refused when its `GLOBAL` is read, before anything else happens; nothing
//! is ever called, because the machine has nothing to call: a `REDUCE` of an allowed global
//! builds one of the [`Value`]s below. The plain values `weights_only` allows beside a
//! state_dict (`torch.device`, `Counter`, `complex`, `bytearray`, ints wider than 64 bits)
//! are read as inert values, so that a checkpoint's other entries do not stop its model.
//!
//! Every length and index in the stream is checked against what is there, so a truncated or
//! hostile stream ends in [`PickleError::Malformed`], never in a panic. Tuples, the one value
//! that nests (lists and dicts are held by index), nest at most [`MAX_DEPTH`] deep, so that
//! dropping, formatting or hashing one cannot overflow the stack, and a dict finds a repeated
//! key through a hash map. What a stream makes the machine do beyond reading it (copy the
//! items of a list or dict it names again by the memo, hash a dict key) is counted against
//! a [`Work`] budget proportional to its length, so that reading any stream costs time and
//! memory linear in its length: a crafted one ends in [`PickleError::TooMuchWork`].

use std::collections::hash_map::{Entry, HashMap};
use std::ops::Deref;
use std::rc::Rc;

use tch::Kind;

mod globals;
mod machine;
mod rebuild;

/// Why a pickle stream was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PickleError {
    /// The stream names a global that a state_dict never needs.
    #[error("names the global '{0}', which is not allowed")]
    Forbidden(String),
    /// The stream uses something `torch.load(weights_only=True)` accepts but a state_dict of
    /// dense tensors does not need.
    #[error("uses {0}, which this reader does not support")]
    Unsupported(String),
    /// Tuples nest deeper than `limit`, which no checkpoint does (a state_dict nests them 2
    /// deep): a crafted stream, refused before its depth can overflow the stack.
    #[error("nests tuples more than {limit} deep (at byte {at})")]
    TooDeep {
        /// Offset of the opcode that would nest one more.
        at: usize,
        /// The deepest nesting read: 1000.
        limit: usize,
    },
    /// The stream makes the machine copy or hash more than `limit` values and bytes, which
    /// no checkpoint does (torch's, a ResNet-50's among them, spend less than 1 per byte): a
    /// crafted stream that names a long list or key again and again by the memo, refused
    /// before its cost grows past linear in its length.
    #[error(
        "copies or hashes more than {limit} values and bytes (at byte {at}), {WORK_PER_BYTE} \
         per byte of the stream and {WORK_FLOOR} more"
    )]
    TooMuchWork {
        /// Offset of the opcode that would spend past the limit.
        at: usize,
        /// What the stream may spend.
        limit: u64,
    },
    /// The stream is not a valid pickle.
    #[error("is not a valid pickle at byte {at}: {reason}")]
    Malformed {
        /// Offset of the opcode in the stream.
        at: usize,
        /// What is wrong.
        reason: String,
    },
}

/// How deep tuples may nest: far above any checkpoint's 2 or 3, and within a 2 MiB thread's
/// stack for the recursive drop of a tuple (about 200 KiB at this depth in a debug build)
/// and its derived `Debug` (about 1 MiB; for tests). A dict key's hash walks 64 values.
const MAX_DEPTH: usize = 1000;

/// Values a stream may hold at once on its stack, marks and memo: a model of a million
/// tensors uses a few million; each costs tens of bytes, for one byte of the stream.
const MAX_HELD: usize = 1 << 24;

/// Values a stream may copy and bytes it may hash, per byte of its own.
const WORK_PER_BYTE: u64 = 4;

/// Values and bytes any stream may copy and hash, beyond [`WORK_PER_BYTE`].
const WORK_FLOOR: u64 = 1 << 20;

/// What went wrong in a step of the machine, before the machine adds the stream position.
#[derive(Debug)]
enum Fault {
    Malformed(String),
    Unsupported(String),
    TooDeep,
    TooMuchWork,
}

/// The work left to a stream: values copied out of the lists, dicts, tuples and strings
/// that a call reads (each may be one the memo names again and again), and bytes of dict
/// keys hashed.
#[derive(Debug)]
struct Work {
    left: u64,
    limit: u64,
}

impl Work {
    /// The budget of a stream of `len` bytes.
    fn for_stream(len: usize) -> Self {
        let limit = (len as u64)
            .saturating_mul(WORK_PER_BYTE)
            .saturating_add(WORK_FLOOR);
        Self { left: limit, limit }
    }

    /// Spends `n`, before the work is done.
    fn spend(&mut self, n: usize) -> Result<(), Fault> {
        self.left = self.left.checked_sub(n as u64).ok_or(Fault::TooMuchWork)?;
        Ok(())
    }
}

/// The element type of a storage or a `torch.<dtype>` global: a tch kind, or the name of a
/// torch dtype tch has no kind for (`uint16`, `qint8`, ...).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Element {
    Kind(Kind),
    Other(String),
}

/// A storage named by a persistent id: `('storage', type, key, location, numel)`.
#[derive(Debug, Clone)]
#[cfg_attr(test, derive(PartialEq))]
pub(super) struct StorageRef {
    /// `None` for an `UntypedStorage` (bytes; the tensor gives the dtype).
    pub element: Option<Element>,
    /// The record's name under `data/`.
    pub key: String,
    /// Elements (bytes for an untyped storage).
    pub numel: i64,
}

/// A tensor as `_rebuild_tensor*` describes it: a strided view of a storage.
#[derive(Debug, Clone)]
#[cfg_attr(test, derive(PartialEq))]
pub(super) struct TensorRef {
    pub storage: Rc<StorageRef>,
    /// The dtype of `_rebuild_tensor_v3` (the storage is then untyped).
    pub element: Option<Element>,
    pub offset: i64,
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
    /// The metadata's lazy `neg` and `conj` bits: the storage holds the values before
    /// negation or conjugation.
    pub neg: bool,
    pub conj: bool,
    /// The dtype `_rebuild_device_tensor_from_cpu_tensor` converts the values to, where it
    /// is not the stored one.
    pub cast: Option<Element>,
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
    /// `torch._utils._rebuild_device_tensor_from_cpu_tensor`: a tensor of an XLA, MTIA or
    /// MAIA device, saved as a CPU tensor and the device's name.
    DeviceTensorFromCpu,
    Device,
    Counter,
    ByteArray,
    Complex,
}

/// A value on the machine's stack. Lists and dicts live in an [`Arena`] so that the memo and
/// the stack share them, as Python's objects are shared; everything else is immutable and
/// cheap to clone. Equality is for the tests: it walks shared tuples as often as they occur.
#[derive(Debug, Clone)]
#[cfg_attr(test, derive(PartialEq))]
pub(super) enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tuple(Tuple),
    List(usize),
    Dict(usize),
    Global(Global),
    Storage(Rc<StorageRef>),
    Tensor(Rc<TensorRef>),
    /// A value that a state_dict never holds but a checkpoint's other entries may (a
    /// `torch.device`, a complex number, an int wider than 64 bits), kept only as what it is.
    Opaque(&'static str),
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
            Value::Opaque(what) => what,
        }
    }
}

/// A tuple's items (it derefs to them), and how deep tuples nest in it: 1 plus the deepest
/// tuple among its items, at most [`MAX_DEPTH`].
#[derive(Debug, Clone)]
#[cfg_attr(test, derive(PartialEq))]
pub(super) struct Tuple {
    items: Rc<[Value]>,
    depth: usize,
}

impl Tuple {
    fn new(items: Vec<Value>) -> Result<Self, Fault> {
        let inner = items.iter().map(|v| match v {
            Value::Tuple(t) => t.depth,
            _ => 0,
        });
        let depth = inner.max().unwrap_or(0) + 1;
        if depth > MAX_DEPTH {
            return Err(Fault::TooDeep);
        }
        Ok(Self {
            items: items.into(),
            depth,
        })
    }
}

impl Deref for Tuple {
    type Target = [Value];

    fn deref(&self) -> &[Value] {
        &self.items
    }
}

/// A dict key as Python compares it, for the keys a checkpoint uses: `None`, numbers (`True
/// == 1 == 1.0`), strings, bytes, and small tuples of these. Other keys are not looked up:
/// each stays an entry of its own.
#[derive(Debug, PartialEq, Eq, Hash)]
enum Key {
    None,
    Int(i64),
    Float(u64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tuple(Vec<Key>),
}

impl Key {
    /// The key of `v`, if it is one; a tuple key may hold at most 64 values in all.
    fn of(v: &Value) -> Option<Key> {
        Self::within(v, &mut 64)
    }

    /// What hashing or comparing the key walks: its values and the bytes of its strings.
    fn weight(&self) -> usize {
        1 + match self {
            Key::Str(s) => s.len(),
            Key::Bytes(b) => b.len(),
            Key::Tuple(keys) => keys.iter().map(Key::weight).sum(),
            Key::None | Key::Int(_) | Key::Float(_) => 0,
        }
    }

    fn within(v: &Value, budget: &mut usize) -> Option<Key> {
        *budget = budget.checked_sub(1)?;
        Some(match v {
            Value::None => Key::None,
            Value::Bool(b) => Key::Int(i64::from(*b)),
            Value::Int(i) => Key::Int(*i),
            // An integral float is the int (`-0.0` too); NaN equals nothing.
            Value::Float(f) if f.fract() == 0.0 && (-I64_END..I64_END).contains(f) => {
                Key::Int(*f as i64)
            }
            Value::Float(f) if !f.is_nan() => Key::Float(f.to_bits()),
            Value::Str(s) => Key::Str(s.clone()),
            Value::Bytes(b) => Key::Bytes(b.clone()),
            Value::Tuple(t) => Key::Tuple(
                t.iter()
                    .map(|i| Self::within(i, budget))
                    .collect::<Option<_>>()?,
            ),
            _ => return None,
        })
    }
}

/// 2^63: the floats below it and at or above its negation are i64s.
const I64_END: f64 = 9_223_372_036_854_775_808.0;

/// A dict's entries in insertion order, and where each key's entry is.
#[derive(Debug, Default)]
struct Dict {
    entries: Vec<(Value, Value)>,
    index: HashMap<Key, usize>,
}

/// The lists (sets too) and dicts of one stream, by the index their [`Value`] holds. Dicts
/// keep insertion order, and a repeated key replaces the value in place, as in Python.
#[derive(Debug, Default)]
pub(super) struct Arena {
    lists: Vec<Vec<Value>>,
    dicts: Vec<Dict>,
}

impl Arena {
    fn new_list(&mut self, items: Vec<Value>) -> Value {
        self.lists.push(items);
        Value::List(self.lists.len() - 1)
    }

    fn new_dict(&mut self) -> Value {
        self.dicts.push(Dict::default());
        Value::Dict(self.dicts.len() - 1)
    }

    fn list(&self, id: usize) -> Result<&[Value], Fault> {
        self.lists
            .get(id)
            .map(Vec::as_slice)
            .ok_or_else(|| Fault::Malformed(format!("list {id} does not exist")))
    }

    fn dict(&self, id: usize) -> Result<&[(Value, Value)], Fault> {
        self.dicts
            .get(id)
            .map(|d| d.entries.as_slice())
            .ok_or_else(|| Fault::Malformed(format!("dict {id} does not exist")))
    }

    fn list_mut(&mut self, id: usize) -> Result<&mut Vec<Value>, Fault> {
        self.lists
            .get_mut(id)
            .ok_or_else(|| Fault::Malformed(format!("list {id} does not exist")))
    }

    /// What a call that reads `v` whole may copy or walk: 1, and the items of a list, dict or
    /// tuple, the bytes of a str or bytes, the dimensions of a tensor, the key of a storage.
    fn weight(&self, v: &Value) -> usize {
        1 + match v {
            Value::List(id) => self.lists.get(*id).map_or(0, Vec::len),
            Value::Dict(id) => self.dicts.get(*id).map_or(0, |d| d.entries.len()),
            Value::Tuple(t) => t.len(),
            Value::Str(s) => s.len(),
            Value::Bytes(b) => b.len(),
            Value::Tensor(t) => t.size.len() + t.stride.len(),
            Value::Storage(s) => s.key.len(),
            _ => 0,
        }
    }

    /// Sets `items` (key, value, key, value, ...) in dict `id`, spending each key's weight.
    fn insert(&mut self, id: usize, items: Vec<Value>, work: &mut Work) -> Result<(), Fault> {
        if !items.len().is_multiple_of(2) {
            return Err(Fault::Malformed("a dict needs key-value pairs".into()));
        }
        let dict = self
            .dicts
            .get_mut(id)
            .ok_or_else(|| Fault::Malformed(format!("dict {id} does not exist")))?;
        let mut items = items.into_iter();
        while let (Some(k), Some(v)) = (items.next(), items.next()) {
            let at = dict.entries.len();
            let key = Key::of(&k);
            if let Some(key) = &key {
                work.spend(key.weight())?;
            }
            match key.map(|key| dict.index.entry(key)) {
                Some(Entry::Occupied(e)) => dict.entries[*e.get()].1 = v,
                Some(Entry::Vacant(e)) => {
                    e.insert(at);
                    dict.entries.push((k, v));
                }
                None => dict.entries.push((k, v)),
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
            Value::Dict(id) => self.arena.dict(*id).ok(),
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

    /// One byte of the stream per value held (`N`, `(`, `MEMOIZE`), each costing tens of
    /// bytes: a stream that holds more than the limit is refused at the value past it.
    #[test]
    fn a_stream_holding_too_many_values_is_refused() {
        for op in [b'N', b'(', 0x94] {
            let mut p = b"\x80\x02N".to_vec();
            p.extend(std::iter::repeat_n(op, 20));
            p.push(b'.');
            match machine::run_holding(&p, 10) {
                Err(PickleError::Malformed { at, reason }) => assert_eq!(
                    (at, reason.as_str()),
                    (13, "holds more than 10 values on its stack, marks and memo"),
                    "{op}"
                ),
                other => panic!("{op}: expected Malformed, got {other:?}"),
            }
        }
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

    /// `()` nested `depth` deep by TUPLE1.
    fn nested_tuple(depth: usize) -> Vec<u8> {
        let mut p = b"\x80\x02)".to_vec();
        p.resize(p.len() + depth - 1, 0x85);
        p.push(b'.');
        p
    }

    #[test]
    fn tuples_nested_past_the_limit_are_refused_not_overflowing_the_stack() {
        // A million deep: read whole, dropping it would overflow any thread's stack.
        let err = unpickle(&nested_tuple(1_000_000)).unwrap_err();
        assert_eq!(
            err,
            PickleError::TooDeep {
                at: 1002,
                limit: 1000
            }
        );
        assert_eq!(
            err.to_string(),
            "nests tuples more than 1000 deep (at byte 1002)"
        );
        // The same by MARK ... TUPLE.
        let mut p = b"\x80\x02".to_vec();
        p.extend(std::iter::repeat_n(b'(', 2000));
        p.extend(std::iter::repeat_n(b't', 2000));
        p.push(b'.');
        let err = unpickle(&p).unwrap_err();
        assert!(
            matches!(err, PickleError::TooDeep { at: 3002, .. }),
            "{err:?}"
        );
        // At the limit, on a 2 MiB stack: read, formatted, compared and dropped.
        let at_limit = || {
            let u = unpickle(&nested_tuple(MAX_DEPTH)).unwrap();
            let Value::Tuple(t) = &u.value else {
                panic!("{}", u.value.describe())
            };
            assert_eq!(t.depth, MAX_DEPTH);
            assert!(format!("{u:?}").len() > MAX_DEPTH);
            assert_eq!(u.value, u.value.clone());
        };
        let thread = std::thread::Builder::new().stack_size(2 << 20);
        thread.spawn(at_limit).unwrap().join().unwrap();
    }

    #[test]
    fn dict_keys_are_python_s_last_wins_in_insertion_order() {
        // `{1: 'a', 'x': 2, True: 'b', 1.0: 'c', (1, 'x'): 3, b'x': 5, (True, 'x'): 4,
        // nan: 6, nan: 7, 2.5: 8, 2.5: 9}` by one SETITEMS, which Python's pickle reads as
        // `{1: 'c', 'x': 2, (1, 'x'): 4, b'x': 5, nan: 6, nan: 7, 2.5: 9}`.
        let s = |t: &str| [b"X\x01\x00\x00\x00", t.as_bytes()].concat();
        let f = |x: f64| [&b"G"[..], &x.to_be_bytes()].concat();
        let mut p = b"\x80\x02}(K\x01".to_vec();
        for part in [
            s("a"),
            s("x"),
            b"K\x02\x88".to_vec(),
            s("b"),
            f(1.0),
            s("c"),
            b"K\x01".to_vec(),
            s("x"),
            b"\x86K\x03C\x01xK\x05\x88".to_vec(),
            s("x"),
            b"\x86K\x04".to_vec(),
            f(f64::NAN),
            b"K\x06".to_vec(),
            f(f64::NAN),
            b"K\x07".to_vec(),
            f(2.5),
            b"K\x08".to_vec(),
            f(2.5),
            b"K\x09u.".to_vec(),
        ] {
            p.extend(part);
        }
        let u = unpickle(&p).unwrap();
        let dict = u.dict(&u.value).unwrap();
        let values: Vec<String> = dict
            .iter()
            .map(|(k, v)| match v {
                Value::Str(s) => format!("{} {s}", k.describe()),
                Value::Int(i) => format!("{} {i}", k.describe()),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(dict[0].0, Value::Int(1), "the first key stays");
        assert_eq!(
            values,
            [
                "an int c",
                "a str 2",
                "a tuple 4",
                "bytes 5",
                "a float 6",
                "a float 7",
                "a float 9"
            ]
        );
        // Many keys, each set twice: one entry each, the last value, the first order.
        let n = 20_000u32;
        let mut p = b"\x80\x02}".to_vec();
        for round in [0u8, 1] {
            p.push(b'(');
            for i in 0..n {
                p.push(b'J');
                p.extend((i * 7919 % n).to_le_bytes());
                p.extend([b'K', round]);
            }
            p.push(b'u');
        }
        p.push(b'.');
        let u = unpickle(&p).unwrap();
        let dict = u.dict(&u.value).unwrap();
        assert_eq!(dict.len(), n as usize);
        assert!(dict
            .iter()
            .enumerate()
            .all(|(i, kv)| *kv == (Value::Int(i64::from(i as u32 * 7919 % n)), Value::Int(1))));
    }

    /// What a stream of `len` bytes may spend.
    fn limit_of(len: usize) -> u64 {
        WORK_PER_BYTE * len as u64 + WORK_FLOOR
    }

    /// `p` (which memoises a global as 0 and its argument as 1), then 1000 calls of the global
    /// on the argument by 7-byte memo references, each result popped; and where they start.
    fn called_1000_times(mut p: Vec<u8>) -> (Vec<u8>, usize) {
        let calls = p.len();
        for _ in 0..1000 {
            p.extend(b"h\x00h\x01\x85R0");
        }
        p.extend(b"N.");
        (p, calls)
    }

    #[test]
    fn calls_that_copy_a_memoised_list_or_dict_again_and_again_are_refused() {
        // `set(L)`, L a list of 500 000 zeros made of 500 kB: each call copies L (500 001
        // values spent), unchecked 5e8 values in all.
        let n = 500_000;
        let mut p = b"\x80\x02cbuiltins\nset\nq\x00]q\x01(K\x00".to_vec();
        p.resize(p.len() + n - 1, b'2');
        p.extend(b"e0");
        let (p, calls) = called_1000_times(p);
        let limit = limit_of(p.len());
        assert_eq!(limit, 3_076_684);
        // Six copies fit in the limit; the seventh call's REDUCE is refused.
        let err = unpickle(&p).map(drop).unwrap_err();
        assert_eq!(
            err,
            PickleError::TooMuchWork {
                at: calls + 6 * 7 + 5,
                limit
            }
        );
        assert_eq!(
            err.to_string(),
            format!(
                "copies or hashes more than 3076684 values and bytes (at byte {}), 4 per byte \
                 of the stream and 1048576 more",
                calls + 47
            )
        );
        // `Counter(D)` and `OrderedDict(P)`, D a dict of 100 000 int keys and P a list of
        // 100 000 pairs: each call copies them and hashes every key again (200 001 spent).
        let mut dict = b"\x80\x02ccollections\nCounter\nq\x00}q\x01(".to_vec();
        for i in 0..100_000u32 {
            dict.push(b'J');
            dict.extend(i.to_le_bytes());
            dict.extend(b"K\x00");
        }
        dict.extend(b"u0");
        let mut pairs = b"\x80\x02ccollections\nOrderedDict\nq\x00]q\x01(K\x00K\x00\x86".to_vec();
        pairs.resize(pairs.len() + 100_000 - 1, b'2');
        pairs.extend(b"e0");
        // 18 calls fit in the first stream's 3 876 708 (its dict spent 100 000), 7 in the
        // second's 1 476 740.
        for (p, fit) in [(dict, 18), (pairs, 7)] {
            let (p, calls) = called_1000_times(p);
            assert_eq!(
                unpickle(&p).map(drop).unwrap_err(),
                PickleError::TooMuchWork {
                    at: calls + fit * 7 + 5,
                    limit: limit_of(p.len())
                }
            );
        }
    }

    #[test]
    fn a_memoised_long_key_set_again_and_again_is_refused() {
        // `d[K] = 1` 1 000 000 times by 5-byte memo references, K a string of 1 MiB: each
        // SETITEM hashes K (1 MiB + 1 spent), unchecked 1 TB hashed.
        let mut p = b"\x80\x02}X\x00\x00\x10\x00".to_vec();
        p.resize(p.len() + (1 << 20), b'k');
        p.extend(b"q\x00K\x01s");
        let first = p.len() - 1;
        for _ in 0..1_000_000 {
            p.extend(b"h\x00K\x01s");
        }
        p.push(b'.');
        let limit = limit_of(p.len());
        assert_eq!(limit, 25_242_936);
        // 24 SETITEMs fit in the limit (the first and 23 by the memo); the 25th is refused.
        assert_eq!(
            unpickle(&p).map(drop).unwrap_err(),
            PickleError::TooMuchWork {
                at: first + 24 * 5,
                limit
            }
        );
    }

    #[test]
    fn long_integers_sign_extend() {
        let u = unpickle(b"\x80\x02\x8a\x02\xff\x7f.").unwrap();
        assert_eq!(u.value, Value::Int(0x7fff));
        let u = unpickle(b"\x80\x02\x8a\x01\xff.").unwrap();
        assert_eq!(u.value, Value::Int(-1));
        let u = unpickle(b"\x80\x02\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\xff.").unwrap();
        assert_eq!(u.value, Value::Int(-1));
        let u = unpickle(b"\x80\x02\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80.").unwrap();
        assert_eq!(u.value, Value::Int(i64::MIN));
    }

    /// `_rebuild_tensor(<4 float storage>, 0, (SIZE,), (1,))`.
    fn tensor_of_size(size: &[u8]) -> Vec<u8> {
        let mut p = b"\x80\x02ctorch._utils\n_rebuild_tensor\n((X\x07\x00\x00\x00storage".to_vec();
        p.extend(b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQK\x00");
        p.extend(size);
        p.extend(b"\x85K\x01\x85tR.");
        p
    }

    #[test]
    fn ints_wider_than_64_bits_are_values_but_no_size() {
        // 2**70, -2**70 (LONG1) and 2**63 (nine bytes, LONG4): valid, and no i64.
        for bytes in [
            &b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x40."[..],
            b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xc0.",
            b"\x80\x02\x8b\x09\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x80\x00.",
        ] {
            let u = unpickle(bytes).unwrap();
            assert_eq!(
                u.value,
                Value::Opaque("an int wider than 64 bits"),
                "{bytes:?}"
            );
        }
        let u = unpickle(&tensor_of_size(b"K\x04")).unwrap();
        assert!(
            matches!(&u.value, Value::Tensor(t) if t.size == [4]),
            "{u:?}"
        );
        let err = unpickle(&tensor_of_size(
            b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x40",
        ))
        .unwrap_err();
        assert_eq!(
            err,
            PickleError::Malformed {
                at: 102,
                reason: "a tensor's size holds an int wider than 64 bits".into()
            }
        );
    }

    #[test]
    fn a_device_tensor_from_a_cpu_tensor_is_the_cpu_tensor_cast_to_its_dtype() {
        // _rebuild_device_tensor_from_cpu_tensor(<float tensor>, DTYPE, 'xla:0', False).
        let rebuild = |dtype: &str| {
            let mut p =
                b"\x80\x02ctorch._utils\n_rebuild_device_tensor_from_cpu_tensor\n(".to_vec();
            let tensor = tensor_of_size(b"K\x04");
            p.extend(&tensor[2..tensor.len() - 1]);
            p.extend(format!("ctorch\n{dtype}\nX\x05\x00\x00\x00xla:0").as_bytes());
            p.extend(b"\x89tR.");
            unpickle(&p).unwrap()
        };
        let Value::Tensor(t) = rebuild("float32").value else {
            panic!()
        };
        assert_eq!((t.size.as_slice(), &t.cast), (&[4][..], &None));
        let Value::Tensor(t) = rebuild("float64").value else {
            panic!()
        };
        assert_eq!(t.cast, Some(Element::Kind(Kind::Double)));
    }
}
