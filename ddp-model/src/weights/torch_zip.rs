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
    let mut storages = Storages {
        archive,
        path,
        prefix,
        big_endian,
        loaded: HashMap::new(),
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

/// A dict's entries when every key is a str and every value a tensor: a state_dict.
fn state_dict_entries(entries: &[(Value, Value)]) -> Option<Entries<'_>> {
    entries
        .iter()
        .map(|(k, v)| match (k, v) {
            (Value::Str(name), Value::Tensor(t)) => Some((&**name, t)),
            _ => None,
        })
        .collect()
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
    let candidates: Vec<(&str, Entries<'u>)> = top
        .iter()
        .filter_map(|(k, v)| {
            let Value::Str(name) = k else { return None };
            let inner = unpickled.dict(v)?;
            let tensors = state_dict_entries(inner).filter(|t| !t.is_empty())?;
            Some((&**name, tensors))
        })
        .collect();
    match <[_; 1]>::try_from(candidates) {
        Ok([(name, tensors)]) => Ok((Some(name.to_string()), tensors)),
        Err(candidates) if candidates.is_empty() => Err(not_a_state_dict(format!(
            "{}: save the model's state_dict alone (torch.save(model.state_dict(), path))",
            first_non_tensor(top)
        ))),
        Err(candidates) => Err(WeightsError::SeveralStateDicts {
            path: path.to_owned(),
            entries: candidates
                .into_iter()
                .map(|(name, tensors)| (name.to_string(), tensors.len()))
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
}

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
        let storage = self.storage(name, &t.storage, kind, numel)?;
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

    fn storage(
        &mut self,
        name: &str,
        s: &StorageRef,
        kind: Kind,
        numel: i64,
    ) -> Result<Tensor, WeightsError> {
        let id = (s.key.clone(), kind);
        if let Some(t) = self.loaded.get(&id) {
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
