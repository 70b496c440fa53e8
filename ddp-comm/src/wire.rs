//! Framing helpers shared by the store and the peer handshake: little-endian integers and
//! length-prefixed byte strings whose lengths are bounded before anything is allocated.

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

pub(crate) fn read_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_le_bytes(b))
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

/// The handshake a ddp-comm peer sends first: magic, version, token, and a number (the
/// sender's rank, or 0 for store clients).
pub(crate) fn hello(magic: &[u8; 4], token: &[u8], number: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(11 + token.len());
    out.extend_from_slice(magic);
    out.push(PROTOCOL_VERSION);
    out.extend_from_slice(&(token.len() as u16).to_le_bytes());
    out.extend_from_slice(token);
    out.extend_from_slice(&number.to_le_bytes());
    out
}

/// Protocol version of the store and peer handshakes.
pub(crate) const PROTOCOL_VERSION: u8 = 1;

/// Reads and checks a [`hello`]; returns its number, or why it was refused.
pub(crate) fn read_hello(
    r: &mut impl Read,
    magic: &[u8; 4],
    token: &[u8],
) -> io::Result<Result<u32, String>> {
    let mut got = [0u8; 4];
    r.read_exact(&mut got)?;
    if &got != magic {
        return Ok(Err(format!("bad magic {got:02x?}")));
    }
    let version = read_u8(r)?;
    if version != PROTOCOL_VERSION {
        return Ok(Err(format!(
            "protocol version {version}, expected {PROTOCOL_VERSION}"
        )));
    }
    let len = read_u16(r)?;
    let theirs = read_bounded(r, len.into(), crate::env::MAX_RUN_ID_LEN, "token")?;
    let number = read_u32(r)?;
    if !constant_time_eq(&theirs, token) {
        return Ok(Err("wrong token (another run id)".to_string()));
    }
    Ok(Ok(number))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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
    fn hello_round_trips_and_refuses_wrong_tokens() {
        let msg = hello(b"TEST", b"run-1", 7);
        assert_eq!(
            read_hello(&mut msg.as_slice(), b"TEST", b"run-1").unwrap(),
            Ok(7)
        );
        assert!(read_hello(&mut msg.as_slice(), b"TEST", b"run-2")
            .unwrap()
            .is_err());
        assert!(read_hello(&mut msg.as_slice(), b"XXXX", b"run-1")
            .unwrap()
            .is_err());
    }

    #[test]
    fn lengths_are_bounded_before_allocation() {
        let mut msg = Vec::new();
        msg.extend_from_slice(&u32::MAX.to_le_bytes());
        let err = read_blob(&mut msg.as_slice(), MAX_VALUE_LEN, "value").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("exceeds the limit"), "{err}");
    }
}
