//! The 16 bytes every collective of the CPU ring starts with (kind, dtype, argument, length),
//! which each rank checks against its predecessor's, and their description in words for
//! [`CommError::Mismatch`](crate::CommError::Mismatch).

use crate::element::{DType, ReduceOp};

/// A header's length in bytes.
pub(crate) const HEADER: usize = 16;

/// The collective a header announces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
    Barrier = 4,
}

/// An all-gather header's tag (its dtype byte): the same number of bytes from each rank.
pub(crate) const GATHER_EQUAL: u8 = 0;
/// The tag of an all-gather of contributions of any length (its length, the total).
pub(crate) const GATHER_BYTES: u8 = 1;
/// The tag of the exchange of lengths before a [`GATHER_BYTES`] gather: 8 bytes from each
/// rank, as a gather of one `i64` is, but never paired with one.
pub(crate) const GATHER_LENGTHS: u8 = 2;

/// The header of a collective of `kind` on `len` bytes.
pub(crate) fn header(kind: Kind, dtype: u8, arg: u32, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = kind as u8;
    h[1] = dtype;
    h[4..8].copy_from_slice(&arg.to_le_bytes());
    h[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// A header in words, `all_reduce Max of 2 x i64`; one this version never writes (a peer's
/// stray bytes) as its kind and raw fields.
pub(crate) fn describe(h: &[u8]) -> String {
    let arg = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    let len = u64::from_le_bytes(h[8..16].try_into().unwrap_or([0; 8]));
    let known = (h[2], h[3]) == (0, 0);
    let words = match (h[0], h[1], arg) {
        _ if !known => None,
        (1, code, op) => all_reduce_words(code, op, len),
        (2, 0, root) => Some(format!("broadcast from rank {root} of {len} bytes")),
        (3, GATHER_EQUAL, 0) => Some(format!("all_gather of {len} bytes from each rank")),
        (3, GATHER_BYTES, 0) => Some(format!("all_gather of {len} bytes in all")),
        (3, GATHER_LENGTHS, 0) if len == 8 => {
            Some("all_gather_bytes's exchange of lengths".to_string())
        }
        (4, 0, 0) if len == 1 => Some("barrier".to_string()),
        _ => None,
    };
    words.unwrap_or_else(|| {
        let kind = match h[0] {
            1 => "all_reduce",
            2 => "broadcast",
            3 => "all_gather",
            4 => "barrier",
            _ => "an unknown collective",
        };
        format!(
            "{kind} with a header this version does not write (bytes {:02x?})",
            &h[..HEADER]
        )
    })
}

/// `all_reduce Sum of 16 x f32`, from an all-reduce header's dtype code, op code and length.
fn all_reduce_words(code: u8, op: u32, len: u64) -> Option<String> {
    let dtype = DTYPES.into_iter().find(|&d| dtype_code(d) == code)?;
    let op = OPS.into_iter().find(|&o| op_code(o) == op)?;
    let size = dtype.size() as u64;
    let name = format!("{dtype:?}").to_lowercase();
    len.is_multiple_of(size)
        .then(|| format!("all_reduce {op:?} of {} x {name}", len / size))
}

/// Every dtype and reduction a header can name, to read one back.
const DTYPES: [DType; 9] = [
    DType::U8,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

/// A dtype as a header writes it (0 is none).
pub(crate) fn dtype_code(d: DType) -> u8 {
    d as u8 + 1
}

/// A reduction as an all-reduce header's argument.
pub(crate) fn op_code(op: ReduceOp) -> u32 {
    op as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_read_as_words_and_stray_bytes_as_bytes() {
        let words = |h: [u8; HEADER]| describe(&h);
        let sum = header(
            Kind::AllReduce,
            dtype_code(DType::BF16),
            op_code(ReduceOp::Avg),
            6,
        );
        assert_eq!(words(sum), "all_reduce Avg of 3 x bf16");
        assert_eq!(
            words(header(Kind::Broadcast, 0, 2, 32)),
            "broadcast from rank 2 of 32 bytes"
        );
        assert_eq!(
            words(header(Kind::AllGather, 0, 0, 8)),
            "all_gather of 8 bytes from each rank"
        );
        assert_eq!(
            words(header(Kind::AllGather, 1, 0, 40)),
            "all_gather of 40 bytes in all"
        );
        assert_eq!(
            words(header(Kind::AllGather, GATHER_LENGTHS, 0, 8)),
            "all_gather_bytes's exchange of lengths"
        );
        assert_eq!(words(header(Kind::Barrier, 0, 0, 1)), "barrier");
        let mut stray = header(Kind::Barrier, 0, 0, 1);
        stray[2] = 7;
        assert_eq!(
            words(stray),
            "barrier with a header this version does not write (bytes [04, 00, 07, 00, 00, 00, \
             00, 00, 01, 00, 00, 00, 00, 00, 00, 00])"
        );
        // An odd length for the dtype, an unknown op: no all-reduce this version writes.
        let odd = header(
            Kind::AllReduce,
            dtype_code(DType::F32),
            op_code(ReduceOp::Sum),
            6,
        );
        assert!(
            words(odd).starts_with("all_reduce with a header"),
            "{}",
            words(odd)
        );
        let op = header(Kind::AllReduce, dtype_code(DType::F32), 9, 8);
        assert!(
            words(op).starts_with("all_reduce with a header"),
            "{}",
            words(op)
        );
    }
}
