//! `torch.save`'s zip format: `<name>/data.pkl` (the pickle), `<name>/data/<key>` (one record
//! per storage, raw elements in the byte order of `<name>/byteorder`), under any top folder.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::Path;
use std::rc::Rc;

use tch::{Kind, Tensor};
use zip::{CompressionMethod, ZipArchive};

use super::pickle::{self, Element, StorageRef, TensorRef, Value};
use super::{StateDict, WeightsError};

/// Reads a `torch.save` zip file holding a state_dict, or a dict with one (see
/// [`super::read_state_dict_entry`]).
pub(super) fn read(path: &Path, key: Option<&str>) -> Result<StateDict, WeightsError> {
    let file = File::open(path).map_err(|source| WeightsError::io(path, source))?;
    let zip_error = |e: zip::result::ZipError| WeightsError::Archive {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    // zip 4.6.1 subtracts before it checks while parsing some extra fields (an extended
    // timestamp of length 0 underflows: zip-rs/zip2#696). This workspace builds zip without
    // overflow checks, so it refuses such a file; a build with them (another workspace's
    // debug profile) panics there, and a damaged file is still an error, not a crash.
    // Records are read without parsing extra fields again.
    let opened = std::panic::catch_unwind(|| ZipArchive::new(BufReader::new(file)));
    let mut archive = match opened {
        Ok(archive) => archive.map_err(zip_error)?,
        Err(panic) => {
            return Err(WeightsError::Archive {
                path: path.to_owned(),
                reason: format!("the zip reader failed on it ({})", panic_message(&*panic)),
            })
        }
    };
    let prefix = archive_prefix(&archive).ok_or_else(|| WeightsError::Archive {
        path: path.to_owned(),
        reason: "it has no '<name>/data.pkl' record, so it is not a torch.save file".into(),
    })?;
    let big_endian = match record(&mut archive, path, &format!("{prefix}byteorder")) {
        // Files written before the record existed are little-endian.
        Err(WeightsError::MissingRecord { .. }) => false,
        Err(e) => return Err(e),
        Ok(bytes) => match bytes.trim_ascii() {
            b"little" => false,
            b"big" => true,
            other => {
                return Err(WeightsError::Archive {
                    path: path.to_owned(),
                    reason: format!(
                        "its byteorder record says '{}', not 'little' or 'big'",
                        String::from_utf8_lossy(other)
                    ),
                })
            }
        },
    };
    let pkl = record(&mut archive, path, &format!("{prefix}data.pkl"))?;
    let unpickled = pickle::unpickle(&pkl).map_err(|source| WeightsError::Pickle {
        path: path.to_owned(),
        source,
    })?;
    let Some(top) = unpickled.dict(&unpickled.value) else {
        return Err(WeightsError::NotAStateDict {
            path: path.to_owned(),
            reason: format!(
                "it holds {}, not a dict of tensors",
                unpickled.value.describe()
            ),
        });
    };
    let (entry, entries) = choose_entry(path, &unpickled, top, key)?;
    let budget = archive
        .central_directory_start()
        .saturating_mul(LOAD_BUDGET_TIMES)
        .saturating_add(LOAD_BUDGET_FLOOR);
    let mut storages = Storages {
        archive,
        path,
        prefix,
        big_endian,
        loaded: HashMap::new(),
        budget,
        budget_total: budget,
    };
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, t) in entries {
        let tensor = storages.tensor(name, t)?;
        tensors.push((name.to_string(), tensor));
    }
    Ok(StateDict::new(path, tensors).with_entry(entry))
}

/// A state_dict's names and tensors, as the pickle describes them.
type Entries<'u> = Vec<(&'u str, &'u Rc<TensorRef>)>;

/// The name and tensor of a dict entry whose key is a str and whose value is a tensor.
fn named_tensor((k, v): &(Value, Value)) -> Option<(&str, &Rc<TensorRef>)> {
    match (k, v) {
        (Value::Str(name), Value::Tensor(t)) => Some((&**name, t)),
        _ => None,
    }
}

/// A dict's entries when every key is a str and every value a tensor: a state_dict.
fn state_dict_entries(entries: &[(Value, Value)]) -> Option<Entries<'_>> {
    entries.iter().map(named_tensor).collect()
}

/// Where the state_dict of a file whose pickle holds the dict `top` is: `top` itself when
/// it is one (and no `key` is given); else its entry `key`; else, without a key, its one
/// entry that is a non-empty state_dict (a training checkpoint such as `{"epoch": 3,
/// "model": state_dict, "optimizer": ...}`). Returns the entry's key (`None` for `top`) and
/// the tensors.
fn choose_entry<'u>(
    path: &Path,
    unpickled: &'u pickle::Unpickled,
    top: &'u [(Value, Value)],
    key: Option<&str>,
) -> Result<(Option<String>, Entries<'u>), WeightsError> {
    let not_a_state_dict = |reason: String| WeightsError::NotAStateDict {
        path: path.to_owned(),
        reason,
    };
    if let Some(key) = key {
        let found = top
            .iter()
            .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key));
        let Some((_, value)) = found else {
            // A state_dict's names are no entries: it is read without a key.
            let entries = match state_dict_entries(top) {
                Some(_) => Vec::new(),
                None => top
                    .iter()
                    .map(|(k, _)| match k {
                        Value::Str(s) => s.to_string(),
                        other => format!("<{}>", other.describe()),
                    })
                    .collect(),
            };
            return Err(WeightsError::NoEntry {
                path: path.to_owned(),
                key: key.to_string(),
                entries,
            });
        };
        let inner = unpickled
            .dict(value)
            .ok_or_else(|| not_a_state_dict(format!("entry '{key}' is {}", value.describe())))?;
        let tensors = state_dict_entries(inner).ok_or_else(|| {
            not_a_state_dict(format!(
                "entry '{key}' is a dict, but not of names to tensors: {}",
                first_non_tensor(inner)
            ))
        })?;
        return Ok((Some(key.to_string()), tensors));
    }
    if let Some(tensors) = state_dict_entries(top) {
        return Ok((None, tensors));
    }
    // Each dict is checked once, by its arena id, however many entries name it (through the
    // memo, every entry of a crafted pickle can name one dict of many tensors), and only the
    // chosen one's entries are built: the time and memory stay linear in the pickle.
    let mut checked: HashMap<usize, bool> = HashMap::new();
    let mut candidates: Vec<(&str, &'u [(Value, Value)])> = Vec::new();
    for (k, v) in top {
        let (Value::Str(name), Value::Dict(id)) = (k, v) else {
            continue;
        };
        let Some(inner) = unpickled.dict(v) else {
            continue;
        };
        let is_state_dict = *checked.entry(*id).or_insert_with(|| {
            !inner.is_empty() && inner.iter().all(|e| named_tensor(e).is_some())
        });
        if is_state_dict {
            candidates.push((&**name, inner));
        }
    }
    match candidates.as_slice() {
        [] => Err(not_a_state_dict(format!(
            "{}: save the model's state_dict alone (torch.save(model.state_dict(), path))",
            first_non_tensor(top)
        ))),
        // Every entry of `inner` was found a named tensor above.
        [(name, inner)] => Ok((
            Some(name.to_string()),
            state_dict_entries(inner).unwrap_or_default(),
        )),
        several => Err(WeightsError::SeveralStateDicts {
            path: path.to_owned(),
            entries: several
                .iter()
                .map(|(name, inner)| (name.to_string(), inner.len()))
                .collect(),
        }),
    }
}

/// `entry 'epoch' is an int, not a tensor`: the first entry of a dict that keeps it from
/// being a state_dict.
fn first_non_tensor(entries: &[(Value, Value)]) -> String {
    entries
        .iter()
        .find_map(|(k, v)| match (k, v) {
            (Value::Str(_), Value::Tensor(_)) => None,
            (Value::Str(name), v) => {
                Some(format!("entry '{name}' is {}, not a tensor", v.describe()))
            }
            (k, _) => Some(format!("a key is {}, not a str", k.describe())),
        })
        .unwrap_or_default()
}

/// The message of a caught panic (`"no message"` when its payload is not text).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("no message")
}

/// `"<name>/"` of the one `<name>/data.pkl` record.
fn archive_prefix<R: Read + Seek>(archive: &ZipArchive<R>) -> Option<String> {
    archive
        .file_names()
        .filter_map(|n| n.strip_suffix("data.pkl"))
        .find(|p| p.ends_with('/') && p.matches('/').count() == 1)
        .map(str::to_string)
}

/// The bytes of record `name`.
fn record<R: Read + Seek>(
    archive: &mut ZipArchive<R>,
    path: &Path,
    name: &str,
) -> Result<Vec<u8>, WeightsError> {
    let (index, size) = find_record(archive, path, name)?;
    read_record(archive, path, name, index, size)
}

/// The index of record `name` and the size its header declares. torch writes every record
/// stored: a compressed one is refused before any of it is read, since it could inflate
/// far past the file's own size.
fn find_record<R: Read + Seek>(
    archive: &mut ZipArchive<R>,
    path: &Path,
    name: &str,
) -> Result<(usize, u64), WeightsError> {
    let Some(index) = archive.index_for_name(name) else {
        return Err(WeightsError::MissingRecord {
            path: path.to_owned(),
            record: name.to_string(),
        });
    };
    let raw = archive
        .by_index_raw(index)
        .map_err(|e| record_error(path, name, &e))?;
    if raw.compression() != CompressionMethod::Stored {
        return Err(WeightsError::Archive {
            path: path.to_owned(),
            reason: format!(
                "record '{name}' is compressed, but torch.save writes every record stored: \
                 save the file again with torch.save"
            ),
        });
    }
    Ok((index, raw.size()))
}

/// The `size` bytes of stored record `name`, at `index`. torch writes, with
/// `torch.serialization.set_crc32_options(False)`, a CRC of 0, which its reader does not
/// check: such a record is read as it is, any other checked against its CRC. A record that
/// holds more or fewer bytes than its header declares is refused, read no further than one
/// byte past the declared size.
fn read_record<R: Read + Seek>(
    archive: &mut ZipArchive<R>,
    path: &Path,
    name: &str,
    index: usize,
    size: u64,
) -> Result<Vec<u8>, WeightsError> {
    // A record lies before the central directory: a lying header reserves no more.
    let capacity = size.min(archive.central_directory_start());
    let raw = archive
        .by_index_raw(index)
        .map_err(|e| record_error(path, name, &e))?;
    let entry = if raw.crc32() == 0 && !raw.encrypted() {
        raw
    } else {
        drop(raw);
        archive
            .by_index(index)
            .map_err(|e| record_error(path, name, &e))?
    };
    let mut bytes = Vec::with_capacity(usize::try_from(capacity).unwrap_or(0));
    entry
        .take(size.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| record_error(path, name, &e))?;
    if bytes.len() as u64 != size {
        let more = if bytes.len() as u64 > size {
            "more"
        } else {
            "fewer"
        };
        return Err(WeightsError::Archive {
            path: path.to_owned(),
            reason: format!(
                "record '{name}' holds {more} bytes than the {size} its header declares"
            ),
        });
    }
    Ok(bytes)
}

/// The archive error of record `name`: `record 'archive/data/0': <what>`.
fn record_error(path: &Path, name: &str, what: &dyn std::fmt::Display) -> WeightsError {
    WeightsError::Archive {
        path: path.to_owned(),
        reason: format!("record '{name}': {what}"),
    }
}

/// The storages read so far, each once, as 1-D tensors by (key, kind).
struct Storages<'a, R: Read + Seek> {
    archive: ZipArchive<R>,
    path: &'a Path,
    prefix: String,
    big_endian: bool,
    loaded: HashMap<(String, Kind), Tensor>,
    /// Bytes the records read and the copies made may still take ([`Storages::spend`]).
    budget: u64,
    /// What the budget was at the start.
    budget_total: u64,
}

/// A file's load may take this many times the bytes of its records ...
const LOAD_BUDGET_TIMES: u64 = 4;
/// ... and this many bytes more.
const LOAD_BUDGET_FLOOR: u64 = 64 << 20;

impl<R: Read + Seek> Storages<'_, R> {
    fn tensor(&mut self, name: &str, t: &Rc<TensorRef>) -> Result<Tensor, WeightsError> {
        let bad = |reason: String| WeightsError::BadTensor {
            path: self.path.to_owned(),
            name: name.to_string(),
            reason,
        };
        let unsupported = |dtype: &String| WeightsError::UnsupportedDtype {
            path: self.path.to_owned(),
            name: name.to_string(),
            dtype: dtype.clone(),
        };
        let element = t.element.as_ref().or(t.storage.element.as_ref());
        let kind = match element {
            Some(Element::Kind(k)) => *k,
            Some(Element::Other(dtype)) => return Err(unsupported(dtype)),
            None => return Err(bad("its storage is untyped and no dtype is given".into())),
        };
        let elt = kind.elt_size_in_bytes() as i64;
        // An untyped storage counts bytes.
        let numel = match t.storage.element {
            Some(_) => t.storage.numel,
            None if t.storage.numel % elt == 0 => t.storage.numel / elt,
            None => {
                return Err(bad(format!(
                    "its storage of {} bytes does not hold whole {kind:?} elements",
                    t.storage.numel
                )))
            }
        };
        check_view(t, numel).map_err(bad)?;
        // Negation, conjugation and a cast make a copy of the view: one larger than its
        // storage (an expanded tensor, stride 0) would take memory the file does not hold.
        let copied = t.neg || (t.conj && super::is_complex(kind)) || t.cast.is_some();
        let elements = t.size.iter().try_fold(1i64, |n, &d| n.checked_mul(d));
        if copied && elements.is_none_or(|n| n > numel) {
            return Err(bad(format!(
                "its view of {:?} elements over {numel} stored ones is negated, conjugated or \
                 cast, which would copy it whole",
                t.size
            )));
        }
        let storage = self.storage(name, &t.storage, kind, numel)?;
        if copied {
            let to = match &t.cast {
                Some(Element::Kind(to)) => *to,
                _ => kind,
            };
            let n = elements.unwrap_or(0).max(0) as u64;
            self.spend(name, n.saturating_mul(to.elt_size_in_bytes() as u64))?;
        }
        let view = storage.f_as_strided(&t.size, &t.stride, Some(t.offset));
        // The storage holds the values before the lazy conjugation (a no-op on real numbers)
        // and negation that the metadata records: applied here, into a copy.
        let view = match view {
            Ok(v) if t.conj && super::is_complex(kind) => v.f_conj_physical(),
            view => view,
        };
        let view = match view {
            Ok(v) if t.neg => v.f_neg(),
            view => view,
        };
        let view = match (view, &t.cast) {
            (Ok(v), Some(Element::Kind(to))) => v.f_to_kind(*to),
            (_, Some(Element::Other(dtype))) => return Err(unsupported(dtype)),
            (view, _) => view,
        };
        view.map_err(|e| bad(e.to_string()))
    }

    /// Takes `bytes` from the budget for `name`'s record or copy, or refuses the tensor: a
    /// hostile file could name one record under many keys or dtypes, or negate a view of a
    /// large storage once per name, and make a small file take terabytes.
    fn spend(&mut self, name: &str, bytes: u64) -> Result<(), WeightsError> {
        match self.budget.checked_sub(bytes) {
            Some(left) => {
                self.budget = left;
                Ok(())
            }
            None => Err(WeightsError::BadTensor {
                path: self.path.to_owned(),
                name: name.to_string(),
                reason: format!(
                    "loading it would take more than {} bytes in all ({LOAD_BUDGET_TIMES} times \
                     the file's records, and {} MiB more): records read more than once, or \
                     copies of negated, conjugated or cast views",
                    self.budget_total,
                    LOAD_BUDGET_FLOOR >> 20
                ),
            }),
        }
    }

    fn storage(
        &mut self,
        name: &str,
        s: &StorageRef,
        kind: Kind,
        numel: i64,
    ) -> Result<Tensor, WeightsError> {
        let id = (s.key.clone(), kind);
        if let Some(t) = self.loaded.get(&id) {
            // Another tensor named this storage with another size: the checks of this one's
            // view and copy went by the size it names.
            if t.numel() as i64 != numel {
                return Err(WeightsError::BadTensor {
                    path: self.path.to_owned(),
                    name: name.to_string(),
                    reason: format!(
                        "its storage '{}' has {numel} {kind:?} elements here and {} where \
                         another tensor names it",
                        s.key,
                        t.numel()
                    ),
                });
            }
            return Ok(t.shallow_clone());
        }
        let record_name = format!("{}data/{}", self.prefix, s.key);
        let (index, size) = find_record(&mut self.archive, self.path, &record_name)?;
        let elt = kind.elt_size_in_bytes();
        // Checked before the record is read: the header's size decides what is read.
        let expected = numel as u128 * elt as u128;
        if u128::from(size) != expected {
            return Err(WeightsError::BadTensor {
                path: self.path.to_owned(),
                name: name.to_string(),
                reason: format!(
                    "record '{record_name}' has {size} bytes, but its storage of {numel} \
                     {kind:?} elements needs {expected}"
                ),
            });
        }
        self.spend(name, size)?;
        let mut bytes = read_record(&mut self.archive, self.path, &record_name, index, size)?;
        if self.big_endian {
            // Complex numbers are two floats, each swapped on its own.
            let unit = match kind {
                Kind::ComplexHalf | Kind::ComplexFloat | Kind::ComplexDouble => elt / 2,
                _ => elt,
            };
            if unit > 1 {
                bytes.chunks_exact_mut(unit).for_each(<[u8]>::reverse);
            }
        }
        let t = Tensor::f_from_data_size(&bytes, &[numel], kind).map_err(|e| {
            WeightsError::BadTensor {
                path: self.path.to_owned(),
                name: name.to_string(),
                reason: e.to_string(),
            }
        })?;
        self.loaded.insert(id, t.shallow_clone());
        Ok(t)
    }
}

/// Checks that the view stays inside its storage of `numel` elements: as many strides as
/// dimensions, no negative size, stride or offset, and the last element reached in bounds.
fn check_view(t: &TensorRef, numel: i64) -> Result<(), String> {
    if t.size.len() != t.stride.len() {
        return Err(format!(
            "its size {:?} and stride {:?} have different lengths",
            t.size, t.stride
        ));
    }
    if t.offset < 0 || t.size.iter().chain(&t.stride).any(|&d| d < 0) {
        return Err(format!(
            "a negative size, stride or offset (size {:?}, stride {:?}, offset {})",
            t.size, t.stride, t.offset
        ));
    }
    if t.size.contains(&0) {
        return Ok(());
    }
    // i128 holds any one product of two i64; the sum is checked.
    let last = t
        .size
        .iter()
        .zip(&t.stride)
        .try_fold(i128::from(t.offset), |acc, (&n, &s)| {
            acc.checked_add(i128::from(n - 1) * i128::from(s))
        });
    if last.is_none_or(|l| l >= i128::from(numel)) {
        return Err(format!(
            "its view (size {:?}, stride {:?}, offset {}) reaches past the end of its storage \
             of {numel} elements",
            t.size, t.stride, t.offset
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `X`: a str of 4-byte length.
    fn str_op(p: &mut Vec<u8>, s: &str) {
        p.push(b'X');
        p.extend((s.len() as u32).to_le_bytes());
        p.extend(s.as_bytes());
    }

    #[test]
    fn entries_naming_one_memoised_state_dict_are_checked_once() {
        // {"0": D, "1": D, ..., "99999": D}, D one dict of 100 000 names of one tensor, named
        // again by the memo (h\x00): 2.5 MB whose 100 000 entry lists would take 240 GB.
        let n = 100_000;
        let mut p = b"\x80\x02}(X\x01\x00\x00\x000}q\x00(".to_vec();
        for i in 0..n {
            str_op(&mut p, &format!("t{i}"));
            if i == 0 {
                p.extend(b"ctorch._utils\n_rebuild_tensor\n((X\x07\x00\x00\x00storage");
                p.extend(b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x01t");
                p.extend(b"QK\x00K\x01\x85K\x01\x85tRq\x01");
            } else {
                p.extend(b"h\x01");
            }
        }
        p.push(b'u');
        for i in 1..n {
            str_op(&mut p, &i.to_string());
            p.extend(b"h\x00");
        }
        p.extend(b"u.");
        let u = pickle::unpickle(&p).unwrap();
        let top = u.dict(&u.value).unwrap();
        assert_eq!(top.len(), n);
        let path = Path::new("memo.pth");
        let err = choose_entry(path, &u, top, None).map(drop).unwrap_err();
        let WeightsError::SeveralStateDicts { entries, .. } = &err else {
            panic!("expected SeveralStateDicts, got {err:?}");
        };
        let expected: Vec<(String, usize)> = (0..n).map(|i| (i.to_string(), n)).collect();
        assert_eq!(entries, &expected);
        assert_eq!(
            err.to_string(),
            "weights file 'memo.pth' holds several state_dicts, under '0' (100000 tensors), \
             '1' (100000 tensors), '2' (100000 tensors), '3' (100000 tensors), '4' (100000 \
             tensors), '5' (100000 tensors), '6' (100000 tensors), '7' (100000 tensors), and \
             99992 more: choose one by its key"
        );
        // Named by one entry, D is chosen and its entries built.
        let one = &top[..1];
        let (entry, tensors) = choose_entry(path, &u, one, None).unwrap();
        assert_eq!(entry.as_deref(), Some("0"));
        assert_eq!(tensors.len(), n);
        assert_eq!((tensors[0].0, tensors[n - 1].0), ("t0", "t99999"));
        assert!(tensors.iter().all(|(_, t)| t.size == [1]));
    }
}
