//! Framing helpers of the store's protocol: little-endian integers and length-prefixed byte
//! strings whose lengths are bounded before anything is allocated.

use std::io::{self, Read, Write};

/// Longest key accepted by the store.
pub(crate) const MAX_KEY_LEN: usize = 1024;
/// Longest value accepted by the store.
pub(crate) const MAX_VALUE_LEN: usize = 1 << 20;
/// Most keys in one request.
pub(crate) const MAX_KEYS: usize = 4096;

pub(crate) fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

pub(crate) fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

pub(crate) fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Reads `len` bytes after checking `len <= max`.
pub(crate) fn read_bounded(
    r: &mut impl Read,
    len: u64,
    max: usize,
    what: &str,
) -> io::Result<Vec<u8>> {
    if len > max as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{what} of {len} bytes exceeds the limit of {max} bytes"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Reads a `u32`-length-prefixed byte string of at most `max` bytes.
pub(crate) fn read_blob(r: &mut impl Read, max: usize, what: &str) -> io::Result<Vec<u8>> {
    let len = read_u32(r)?;
    read_bounded(r, len.into(), max, what)
}

/// Reads a `u32`-length-prefixed UTF-8 key.
pub(crate) fn read_key(r: &mut impl Read) -> io::Result<String> {
    String::from_utf8(read_blob(r, MAX_KEY_LEN, "key")?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "key is not UTF-8"))
}

/// Appends a `u32`-length-prefixed byte string.
pub(crate) fn put_blob(out: &mut Vec<u8>, data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(data);
}

/// Writes all of `data` and flushes.
pub(crate) fn send_all(w: &mut impl Write, data: &[u8]) -> io::Result<()> {
    w.write_all(data)?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_bounded_before_allocation() {
        let mut msg = Vec::new();
        msg.extend_from_slice(&u32::MAX.to_le_bytes());
        let err = read_blob(&mut msg.as_slice(), MAX_VALUE_LEN, "value").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("exceeds the limit"), "{err}");
    }
}
