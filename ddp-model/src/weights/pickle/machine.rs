//! The machine: the opcodes, the stack, the marks and the memo.

use std::collections::HashMap;
use std::rc::Rc;

use super::globals::resolve_global;
use super::rebuild::{persistent_load, reduce};
use super::{Arena, Fault, PickleError, Tuple, Value, Work, MAX_DEPTH, MAX_HELD};

/// Runs `bytes` to its `STOP`: the top value, and the arena its lists and dicts live in.
pub(super) fn run(bytes: &[u8]) -> Result<(Value, Arena)> {
    run_holding(bytes, MAX_HELD)
}

/// [`run`], holding at most `max_held` values at once.
pub(super) fn run_holding(bytes: &[u8], max_held: usize) -> Result<(Value, Arena)> {
    let mut m = Machine {
        max_held,
        bytes,
        pos: 0,
        op_at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        arena: Arena::default(),
        work: Work::for_stream(bytes.len()),
    };
    let value = m.run()?;
    Ok((value, m.arena))
}

struct Machine<'a> {
    /// Values the stack, marks and memo may hold together.
    max_held: usize,
    bytes: &'a [u8],
    pos: usize,
    op_at: usize,
    stack: Vec<Value>,
    /// Stack lengths at each `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
    arena: Arena,
    work: Work,
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

    /// The stack's length at the last `MARK`: what is below belongs to an enclosing
    /// container still being built.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<Value> {
        match self.stack.pop() {
            Some(v) if self.stack.len() >= self.floor() => Ok(v),
            _ => self.malformed("the stack is empty"),
        }
    }

    fn top(&self) -> Result<&Value> {
        match self.stack.get(self.floor()..).and_then(<[Value]>::last) {
            Some(v) => Ok(v),
            None => self.malformed("the stack is empty"),
        }
    }

    /// The items pushed since the last `MARK`, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<Value>> {
        let Some(at) = self.marks.pop() else {
            return self.malformed("no MARK to pop to");
        };
        Ok(self.stack.split_off(at))
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

    /// A `LONG1` or `LONG4` integer: two's complement, little-endian. One wider than an
    /// i64 is valid Python, kept as an opaque value: no size, stride or offset is one.
    fn int_from_le(bytes: &[u8]) -> Value {
        let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
        let sign = if negative { 0xff } else { 0 };
        let mut a = [sign; 8];
        let n = bytes.len().min(8);
        a[..n].copy_from_slice(&bytes[..n]);
        let v = i64::from_le_bytes(a);
        // Wider when a byte past the eighth is more than sign, or the sign flips there.
        if bytes[n..].iter().any(|&b| b != sign) || (v < 0) != negative {
            return Value::Opaque("an int wider than 64 bits");
        }
        Value::Int(v)
    }

    fn run(&mut self) -> Result<Value> {
        loop {
            self.op_at = self.pos;
            // Each entry costs tens of bytes for the one byte of its opcode.
            let held = self.stack.len() + self.marks.len() + self.memo.len();
            if held > self.max_held {
                return self.malformed(format!(
                    "holds more than {} values on its stack, marks and memo",
                    self.max_held
                ));
            }
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
                    let bytes = self.take(n)?;
                    let v = Self::int_from_le(bytes);
                    self.stack.push(v);
                }
                0x8b => {
                    let n = i32::from_le_bytes(self.array()?);
                    let Ok(n) = usize::try_from(n) else {
                        return self.malformed("LONG4 has a negative length");
                    };
                    let bytes = self.take(n)?;
                    let v = Self::int_from_le(bytes);
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
                b')' => self.push_tuple(Vec::new())?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push_tuple(items)?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    if self.stack.len() < self.floor() + n {
                        return self.malformed("the stack is empty");
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.push_tuple(items)?;
                }
                // Lists and sets (a set is read as a list: only its items matter here).
                b']' | 0x8f => {
                    let list = self.arena.new_list(Vec::new());
                    self.stack.push(list);
                }
                b'l' | 0x91 => {
                    let items = self.pop_mark()?;
                    let list = self.arena.new_list(items);
                    self.stack.push(list);
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
                    let dict = self.arena.new_dict();
                    self.stack.push(dict);
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let dict = self.arena.new_dict();
                    self.stack.push(dict);
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
                    let v = reduce(&mut self.arena, &mut self.work, callable, &args)
                        .map_err(|f| self.fault(f))?;
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
                    let storage = persistent_load(&self.arena, &mut self.work, &pid)
                        .map_err(|f| self.fault(f))?;
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

    fn fault(&self, fault: Fault) -> PickleError {
        match fault {
            Fault::Malformed(reason) => PickleError::Malformed {
                at: self.op_at,
                reason,
            },
            Fault::Unsupported(what) => PickleError::Unsupported(what),
            Fault::TooDeep => PickleError::TooDeep {
                at: self.op_at,
                limit: MAX_DEPTH,
            },
            Fault::TooMuchWork => PickleError::TooMuchWork {
                at: self.op_at,
                limit: self.work.limit,
            },
        }
    }

    fn push_tuple(&mut self, items: Vec<Value>) -> Result<()> {
        let tuple = Tuple::new(items).map_err(|f| self.fault(f))?;
        self.stack.push(Value::Tuple(tuple));
        Ok(())
    }

    fn extend_list(&mut self, items: Vec<Value>) -> Result<()> {
        let Value::List(id) = *self.top()? else {
            return self.malformed("APPEND or APPENDS to something that is not a list");
        };
        match self.arena.list_mut(id) {
            Ok(list) => {
                list.extend(items);
                Ok(())
            }
            Err(f) => Err(self.fault(f)),
        }
    }

    fn set_items(&mut self, items: Vec<Value>) -> Result<()> {
        let Value::Dict(id) = *self.top()? else {
            return self.malformed("SETITEM or SETITEMS to something that is not a dict");
        };
        self.arena
            .insert(id, items, &mut self.work)
            .map_err(|f| self.fault(f))
    }
}
