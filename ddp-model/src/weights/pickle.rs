//! A data-only pickle machine with `torch.load(weights_only=True)`'s allow list.
//!
//! It understands the opcodes of pickle protocols 2 to 5 that describe data (numbers,
//! strings, bytes, tuples, lists, dicts, sets, the memo) and, of the opcodes that name or call
//! Python objects, only what a `torch.save` of a state_dict uses: `GLOBAL`/`STACK_GLOBAL` of an
//! allowed name, `REDUCE` of those globals, `BUILD` on a dict (an `OrderedDict`'s `_metadata`,
//! which is dropped) and `BINPERSID` of a storage. A name outside the allow list is refused
//! when its `GLOBAL` is read, before anything else happens; nothing is ever called, because the
//! machine has nothing to call: a `REDUCE` of an allowed global builds one of the [`Value`]s
//! below.
//!
//! Every length and index in the stream is checked against what is there, so a truncated or
//! hostile stream ends in [`PickleError::Malformed`], never in a panic.

use std::collections::HashMap;
use std::rc::Rc;

use tch::Kind;

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

/// The element type of a storage or a `torch.<dtype>` global: a tch kind, or the name of a
/// torch dtype tch has no kind for (`uint16`, `float8_e8m0fnu`, `qint8`, ...).
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

/// A value on the machine's stack. Lists and dicts live in an arena (`Machine::objects`) so
/// that the memo and the stack share them, as Python's objects are shared; everything else is
/// immutable and cheap to clone.
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

/// The machine's arena objects.
#[derive(Debug)]
pub(super) enum Object {
    List(Vec<Value>),
    /// Insertion-ordered; a repeated key replaces the value in place, as in Python.
    Dict(Vec<(Value, Value)>),
}

/// What a stream unpickled to: its top value and the arena its lists and dicts live in.
#[derive(Debug)]
pub(super) struct Unpickled {
    pub value: Value,
    pub objects: Vec<Object>,
}

impl Unpickled {
    /// The entries of a dict value.
    pub fn dict(&self, value: &Value) -> Option<&[(Value, Value)]> {
        match value {
            Value::Dict(id) => match &self.objects[*id] {
                Object::Dict(entries) => Some(entries),
                Object::List(_) => None,
            },
            _ => None,
        }
    }
}

/// Runs the stream to its `STOP`.
pub(super) fn unpickle(bytes: &[u8]) -> Result<Unpickled> {
    let mut m = Machine {
        bytes,
        pos: 0,
        op_at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        objects: Vec::new(),
    };
    let value = m.run()?;
    Ok(Unpickled {
        value,
        objects: m.objects,
    })
}

struct Machine<'a> {
    bytes: &'a [u8],
    pos: usize,
    op_at: usize,
    stack: Vec<Value>,
    /// Stack lengths at each `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
    objects: Vec<Object>,
}

type Result<T> = std::result::Result<T, PickleError>;

impl<'a> Machine<'a> {
    fn malformed<T>(&self, reason: impl Into<String>) -> Result<T> {
        Err(PickleError::Malformed {
            at: self.op_at,
            reason: reason.into(),
        })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s: &'a [u8] = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => self.malformed(format!(
                "needs {n} bytes, {} are left",
                self.bytes.len() - self.pos
            )),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn len_u64(&mut self) -> Result<usize> {
        let n = u64::from_le_bytes(self.array()?);
        usize::try_from(n).or_else(|_| self.malformed(format!("length {n} is too large")))
    }

    /// A `\n`-terminated line, without the newline.
    fn line(&mut self) -> Result<String> {
        let rest = &self.bytes[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return self.malformed("a line does not end");
        };
        let line = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.pos += n + 1;
        Ok(line)
    }

    fn utf8(&self, bytes: &[u8]) -> Result<Value> {
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Value::Str(s.into())),
            Err(_) => self.malformed("a string is not UTF-8"),
        }
    }

    fn pop(&mut self) -> Result<Value> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return self.malformed("the stack is empty");
        }
        Ok(self.stack.pop().expect("checked above"))
    }

    fn top(&self) -> Result<&Value> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return self.malformed("the stack is empty");
        }
        Ok(self.stack.last().expect("checked above"))
    }

    /// The items pushed since the last `MARK`, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Value>> {
        let Some(at) = self.marks.pop() else {
            return self.malformed("no MARK to pop to");
        };
        Ok(self.stack.split_off(at))
    }

    fn new_object(&mut self, object: Object) -> usize {
        self.objects.push(object);
        self.objects.len() - 1
    }

    fn memo_get(&mut self, id: u32) -> Result<()> {
        match self.memo.get(&id) {
            Some(v) => {
                let v = v.clone();
                self.stack.push(v);
                Ok(())
            }
            None => self.malformed(format!("memo entry {id} was never stored")),
        }
    }

    fn memo_put(&mut self, id: u32) -> Result<()> {
        let v = self.top()?.clone();
        self.memo.insert(id, v);
        Ok(())
    }

    fn parse_line<T: std::str::FromStr>(&self, line: &str) -> Result<T> {
        line.trim()
            .parse()
            .or_else(|_| self.malformed(format!("'{line}' is not a number")))
    }

    fn int_from_le(&self, bytes: &[u8]) -> Result<Value> {
        // Two's complement, little-endian, at most 8 bytes for an i64.
        if bytes.len() > 8 {
            let sign = if bytes.last().is_some_and(|b| b & 0x80 != 0) {
                0xff
            } else {
                0
            };
            if bytes[8..].iter().any(|&b| b != sign) {
                return self.malformed("an integer does not fit in 64 bits");
            }
        }
        let mut a = [0u8; 8];
        let n = bytes.len().min(8);
        a[..n].copy_from_slice(&bytes[..n]);
        if n < 8 && bytes.last().is_some_and(|b| b & 0x80 != 0) {
            a[n..].fill(0xff);
        }
        Ok(Value::Int(i64::from_le_bytes(a)))
    }

    fn run(&mut self) -> Result<Value> {
        loop {
            self.op_at = self.pos;
            let op = self.u8()?;
            match op {
                // PROTO, FRAME: nothing to do beyond their arguments.
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return self.malformed(format!("pickle protocol {proto} is unknown"));
                    }
                }
                0x95 => {
                    self.take(8)?;
                }
                b'.' => {
                    let v = self.pop()?;
                    return Ok(v);
                }
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.stack.push(v);
                }
                // Memo.
                b'p' => {
                    let line = self.line()?;
                    let id = self.parse_line(&line)?;
                    self.memo_put(id)?;
                }
                b'q' => {
                    let id = self.u8()?.into();
                    self.memo_put(id)?;
                }
                b'r' => {
                    let id = self.u32()?;
                    self.memo_put(id)?;
                }
                0x94 => {
                    let id = u32::try_from(self.memo.len()).unwrap_or(u32::MAX);
                    self.memo_put(id)?;
                }
                b'g' => {
                    let line = self.line()?;
                    let id = self.parse_line(&line)?;
                    self.memo_get(id)?;
                }
                b'h' => {
                    let id = self.u8()?.into();
                    self.memo_get(id)?;
                }
                b'j' => {
                    let id = self.u32()?;
                    self.memo_get(id)?;
                }
                // Constants and numbers.
                b'N' => self.stack.push(Value::None),
                0x88 => self.stack.push(Value::Bool(true)),
                0x89 => self.stack.push(Value::Bool(false)),
                b'I' => {
                    let line = self.line()?;
                    let v = match line.as_str() {
                        "01" => Value::Bool(true),
                        "00" => Value::Bool(false),
                        l => Value::Int(self.parse_line(l)?),
                    };
                    self.stack.push(v);
                }
                b'L' => {
                    let line = self.line()?;
                    let v = self.parse_line(line.trim_end_matches('L'))?;
                    self.stack.push(Value::Int(v));
                }
                b'J' => {
                    let v = i32::from_le_bytes(self.array()?);
                    self.stack.push(Value::Int(v.into()));
                }
                b'K' => {
                    let v = self.u8()?;
                    self.stack.push(Value::Int(v.into()));
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.array()?);
                    self.stack.push(Value::Int(v.into()));
                }
                0x8a => {
                    let n = self.u8()?.into();
                    let bytes = self.take(n)?.to_vec();
                    let v = self.int_from_le(&bytes)?;
                    self.stack.push(v);
                }
                0x8b => {
                    let n = i32::from_le_bytes(self.array()?);
                    let Ok(n) = usize::try_from(n) else {
                        return self.malformed("LONG4 has a negative length");
                    };
                    let bytes = self.take(n)?.to_vec();
                    let v = self.int_from_le(&bytes)?;
                    self.stack.push(v);
                }
                b'F' => {
                    let line = self.line()?;
                    let v = self.parse_line(&line)?;
                    self.stack.push(Value::Float(v));
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.array()?);
                    self.stack.push(Value::Float(v));
                }
                // Strings and bytes.
                b'X' => {
                    let n = self.u32()? as usize;
                    let bytes = self.take(n)?;
                    let v = self.utf8(bytes)?;
                    self.stack.push(v);
                }
                0x8c => {
                    let n = self.u8()?.into();
                    let bytes = self.take(n)?;
                    let v = self.utf8(bytes)?;
                    self.stack.push(v);
                }
                0x8d => {
                    let n = self.len_u64()?;
                    let bytes = self.take(n)?;
                    let v = self.utf8(bytes)?;
                    self.stack.push(v);
                }
                // BINSTRING, SHORT_BINSTRING (Python 2 str), BINBYTES, SHORT_BINBYTES,
                // BINBYTES8, BYTEARRAY8: all read as bytes.
                b'T' | b'B' => {
                    let n = self.u32()? as usize;
                    let bytes = self.take(n)?;
                    self.stack.push(Value::Bytes(bytes.into()));
                }
                b'U' | b'C' => {
                    let n = self.u8()?.into();
                    let bytes = self.take(n)?;
                    self.stack.push(Value::Bytes(bytes.into()));
                }
                0x8e | 0x96 => {
                    let n = self.len_u64()?;
                    let bytes = self.take(n)?;
                    self.stack.push(Value::Bytes(bytes.into()));
                }
                // Tuples.
                b')' => self.stack.push(Value::Tuple(Rc::from(Vec::new()))),
                b't' => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::Tuple(items.into()));
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let floor = self.marks.last().copied().unwrap_or(0);
                    if self.stack.len() < floor + n {
                        return self.malformed("the stack is empty");
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.stack.push(Value::Tuple(items.into()));
                }
                // Lists and sets (a set is read as a list: only its items matter here).
                b']' | 0x8f => {
                    let id = self.new_object(Object::List(Vec::new()));
                    self.stack.push(Value::List(id));
                }
                b'l' | 0x91 => {
                    let items = self.pop_mark()?;
                    let id = self.new_object(Object::List(items));
                    self.stack.push(Value::List(id));
                }
                b'a' => {
                    let item = self.pop()?;
                    self.extend_list(vec![item])?;
                }
                b'e' | 0x90 => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?;
                }
                // Dicts.
                b'}' => {
                    let id = self.new_object(Object::Dict(Vec::new()));
                    self.stack.push(Value::Dict(id));
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let id = self.new_object(Object::Dict(Vec::new()));
                    self.stack.push(Value::Dict(id));
                    self.set_items(items)?;
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    self.set_items(vec![key, value])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?;
                }
                // Globals: checked against the allow list as they are read.
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let g = resolve_global(&module, &name)?;
                    self.stack.push(Value::Global(g));
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Value::Str(module), Value::Str(name)) = (module, name) else {
                        return self.malformed("STACK_GLOBAL needs two strings");
                    };
                    let g = resolve_global(&module, &name)?;
                    self.stack.push(Value::Global(g));
                }
                b'R' => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let Value::Tuple(args) = args else {
                        return self.malformed("REDUCE needs an argument tuple");
                    };
                    let v = self.reduce(callable, &args)?;
                    self.stack.push(v);
                }
                b'b' => {
                    let _state = self.pop()?;
                    match self.top()? {
                        // An OrderedDict's attributes (a state_dict's `_metadata`): not
                        // needed to load the tensors.
                        Value::Dict(_) => {}
                        other => {
                            return Err(PickleError::Unsupported(format!(
                                "BUILD on {}",
                                other.describe()
                            )))
                        }
                    }
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let storage = self.persistent_load(&pid)?;
                    self.stack.push(Value::Storage(Rc::new(storage)));
                }
                b'P' => {
                    return Err(PickleError::Unsupported(
                        "a text persistent id (PERSID)".into(),
                    ))
                }
                0x81 | 0x92 | b'i' | b'o' => {
                    return Err(PickleError::Unsupported(
                        "an object instantiation (NEWOBJ, INST or OBJ)".into(),
                    ))
                }
                0x82..=0x84 => {
                    return Err(PickleError::Unsupported(
                        "the extension registry (EXT1, EXT2, EXT4)".into(),
                    ))
                }
                0x97 | 0x98 => {
                    return Err(PickleError::Unsupported(
                        "out-of-band buffers (NEXT_BUFFER, READONLY_BUFFER)".into(),
                    ))
                }
                b'S' | b'V' => {
                    return Err(PickleError::Unsupported(
                        "protocol 0 text strings (STRING, UNICODE)".into(),
                    ))
                }
                other => return self.malformed(format!("unknown opcode 0x{other:02x}")),
            }
        }
    }

    fn extend_list(&mut self, items: Vec<Value>) -> Result<()> {
        let Value::List(id) = *self.top()? else {
            return self.malformed("APPEND or APPENDS to something that is not a list");
        };
        match &mut self.objects[id] {
            Object::List(list) => list.extend(items),
            Object::Dict(_) => unreachable!("a List value names a list"),
        }
        Ok(())
    }

    fn set_items(&mut self, items: Vec<Value>) -> Result<()> {
        if items.len() % 2 != 0 {
            return self.malformed("SETITEMS needs key-value pairs");
        }
        let Value::Dict(id) = *self.top()? else {
            return self.malformed("SETITEM or SETITEMS to something that is not a dict");
        };
        let Object::Dict(dict) = &mut self.objects[id] else {
            unreachable!("a Dict value names a dict")
        };
        let mut items = items.into_iter();
        while let (Some(k), Some(v)) = (items.next(), items.next()) {
            match dict.iter_mut().find(|(key, _)| *key == k) {
                Some(entry) => entry.1 = v,
                None => dict.push((k, v)),
            }
        }
        Ok(())
    }

    /// `('storage', storage_type, key, location, numel)`; the location (`cpu`, `cuda:0`) is
    /// not used: every storage is read onto the CPU (`map_location="cpu"`).
    fn persistent_load(&self, pid: &Value) -> Result<StorageRef> {
        let Value::Tuple(items) = pid else {
            return self.malformed(format!(
                "a persistent id is {}, not a tuple",
                pid.describe()
            ));
        };
        match &items[..] {
            [Value::Str(tag), Value::Global(g), Value::Str(key), Value::Str(_location), Value::Int(numel)]
                if &**tag == "storage" =>
            {
                let element = match g {
                    Global::Storage(e) => Some(e.clone()),
                    Global::UntypedStorage => None,
                    _ => return self.malformed("a persistent id names no storage type"),
                };
                if *numel < 0 {
                    return self.malformed("a storage has a negative size");
                }
                Ok(StorageRef {
                    element,
                    key: key.to_string(),
                    numel: *numel,
                })
            }
            [Value::Str(tag), ..] if &**tag != "storage" => Err(PickleError::Unsupported(format!(
                "a persistent id of kind '{tag}' (only storages are allowed)"
            ))),
            _ => self.malformed(
                "a persistent id is not ('storage', type, key, location, numel)".to_string(),
            ),
        }
    }

    fn reduce(&mut self, callable: Value, args: &[Value]) -> Result<Value> {
        let Value::Global(g) = callable else {
            return self.malformed(format!("REDUCE calls {}", callable.describe()));
        };
        match (g, args) {
            (Global::OrderedDict, []) => Ok(Value::Dict(self.new_object(Object::Dict(Vec::new())))),
            (Global::OrderedDict, [Value::List(id)]) => {
                let Object::List(pairs) = &self.objects[*id] else {
                    unreachable!("a List value names a list")
                };
                let mut items = Vec::with_capacity(pairs.len() * 2);
                for pair in pairs {
                    match pair {
                        Value::Tuple(kv) if kv.len() == 2 => items.extend(kv.iter().cloned()),
                        _ => return self.malformed("OrderedDict needs (key, value) pairs"),
                    }
                }
                let id = self.new_object(Object::Dict(Vec::new()));
                self.stack.push(Value::Dict(id));
                self.set_items(items)?;
                Ok(self.stack.pop().expect("pushed above"))
            }
            (Global::RebuildTensor, [storage, offset, size, stride])
            | (Global::RebuildTensorV2, [storage, offset, size, stride, _, _])
            | (Global::RebuildTensorV2, [storage, offset, size, stride, _, _, _]) => {
                self.tensor(storage, offset, size, stride, None)
            }
            (Global::RebuildTensorV3, [storage, offset, size, stride, _, _, dtype])
            | (Global::RebuildTensorV3, [storage, offset, size, stride, _, _, dtype, _]) => {
                let Value::Global(Global::Dtype(element)) = dtype else {
                    return self.malformed("_rebuild_tensor_v3 needs a dtype");
                };
                self.tensor(storage, offset, size, stride, Some(element.clone()))
            }
            (Global::RebuildParameter, [tensor @ Value::Tensor(_), _, _])
            | (Global::RebuildParameterWithState, [tensor @ Value::Tensor(_), _, _, _]) => {
                Ok(tensor.clone())
            }
            (Global::Size, [Value::Tuple(dims)]) => Ok(Value::Tuple(dims.clone())),
            (Global::Encode, [Value::Str(s), Value::Str(encoding)])
                if &**encoding == "latin1" || &**encoding == "latin-1" =>
            {
                let bytes: Option<Vec<u8>> =
                    s.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect();
                match bytes {
                    Some(b) => Ok(Value::Bytes(b.into())),
                    None => self.malformed("_codecs.encode of a non-latin1 string"),
                }
            }
            (Global::Set, []) => Ok(Value::List(self.new_object(Object::List(Vec::new())))),
            (Global::Set, [Value::List(id)]) => {
                let Object::List(items) = &self.objects[*id] else {
                    unreachable!("a List value names a list")
                };
                let items = items.clone();
                Ok(Value::List(self.new_object(Object::List(items))))
            }
            (g, args) => self.malformed(format!(
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

    fn tensor(
        &self,
        storage: &Value,
        offset: &Value,
        size: &Value,
        stride: &Value,
        element: Option<Element>,
    ) -> Result<Value> {
        let Value::Storage(storage) = storage else {
            return self.malformed(format!(
                "a tensor is rebuilt from {}, not a storage",
                storage.describe()
            ));
        };
        let Value::Int(offset) = *offset else {
            return self.malformed("a tensor's storage offset is not an int");
        };
        let ints = |v: &Value, what: &str| -> Result<Vec<i64>> {
            match v {
                Value::Tuple(items) => items
                    .iter()
                    .map(|i| match i {
                        Value::Int(n) => Ok(*n),
                        _ => self.malformed(format!("a tensor's {what} holds a non-integer")),
                    })
                    .collect(),
                _ => self.malformed(format!("a tensor's {what} is not a tuple")),
            }
        };
        Ok(Value::Tensor(Rc::new(TensorRef {
            storage: storage.clone(),
            element,
            offset,
            size: ints(size, "size")?,
            stride: ints(stride, "stride")?,
        })))
    }
}

/// The storage classes and dtypes by name, with the tch kind where there is one.
const ELEMENTS: [(&str, &str, Option<Kind>); 25] = [
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
];

/// Other spellings of torch's dtypes (`torch.float` is `torch.float32`).
const DTYPE_ALIASES: [(&str, &str); 9] = [
    ("float", "float32"),
    ("double", "float64"),
    ("half", "float16"),
    ("long", "int64"),
    ("int", "int32"),
    ("short", "int16"),
    ("cfloat", "complex64"),
    ("cdouble", "complex128"),
    ("chalf", "complex32"),
];

/// Globals that `torch.load(weights_only=True)` allows but a state_dict of dense tensors
/// never names; refused as unsupported rather than forbidden.
const TORCH_ALLOWED_UNSUPPORTED: [&str; 15] = [
    "torch._utils._rebuild_qtensor",
    "torch._utils._rebuild_sparse_tensor",
    "torch._utils._rebuild_meta_tensor_no_storage",
    "torch._utils._rebuild_nested_tensor",
    "torch._utils._rebuild_wrapper_subclass",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor",
    "torch._utils._rebuild_device_tensor_from_numpy",
    "torch._tensor._rebuild_from_type_v2",
    "torch.nn.parameter.Parameter",
    "torch.Tensor",
    "torch.device",
    "torch.serialization._get_layout",
    "collections.Counter",
    "builtins.bytearray",
    "builtins.complex",
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
fn resolve_global(module: &str, name: &str) -> Result<Global> {
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

fn global_name(g: &Global) -> String {
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
    }
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
        let Value::List(id) = dict[1].1 else {
            panic!("{:?}", dict[1])
        };
        let Object::List(items) = &u.objects[id] else {
            panic!()
        };
        assert_eq!(
            items,
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
