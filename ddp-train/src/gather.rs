//! [`Rows`]: per-sample values that do not add up across ranks (the scores a ranking metric
//! such as the ROC AUC needs), and [`gather_rows`], their exact all-gather: every rank gets
//! every rank's rows, ordered by sample, so the result does not depend on the number of
//! ranks or loader threads.

use ddp_comm::ProcessGroup;

use crate::error::TrainError;

/// Rows of `width` numbers, each keyed by its sample (its index in the evaluated split).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rows {
    width: usize,
    keys: Vec<u64>,
    values: Vec<f64>,
}

impl Rows {
    /// No rows yet, each to hold `width` numbers.
    pub fn new(width: usize) -> Self {
        Self {
            width,
            ..Self::default()
        }
    }

    /// Adds sample `key`'s row; `values` must hold `width` numbers (a shorter row is padded
    /// with NaN, a longer one cut, so that the rows stay aligned).
    pub fn push(&mut self, key: u64, values: &[f64]) {
        self.keys.push(key);
        let row = values.iter().copied().chain(std::iter::repeat(f64::NAN));
        self.values.extend(row.take(self.width));
    }

    /// Numbers per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The rows' keys, in order.
    pub fn keys(&self) -> &[u64] {
        &self.keys
    }

    /// Row `i`'s numbers.
    pub fn row(&self, i: usize) -> &[f64] {
        &self.values[i * self.width..(i + 1) * self.width]
    }

    /// `(key, numbers)` for every row, in order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &[f64])> + '_ {
        self.keys.iter().enumerate().map(|(i, &k)| (k, self.row(i)))
    }

    /// The rows as bytes: the width, then each row's key and numbers, little-endian.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.keys.len() * 8 * (1 + self.width));
        out.extend_from_slice(&(self.width as u64).to_le_bytes());
        for (key, row) in self.iter() {
            out.extend_from_slice(&key.to_le_bytes());
            for v in row {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    /// The inverse of [`Rows::encode`]; `None` for bytes it did not write.
    fn decode(bytes: &[u8]) -> Option<Self> {
        let word = |i: usize| -> Option<[u8; 8]> { bytes.get(i * 8..i * 8 + 8)?.try_into().ok() };
        let width = usize::try_from(u64::from_le_bytes(word(0)?)).ok()?;
        let stride = width.checked_add(1)?;
        let words = bytes.len() / 8;
        if !bytes.len().is_multiple_of(8) || !(words - 1).is_multiple_of(stride) {
            return None;
        }
        let mut rows = Rows::new(width);
        for r in 0..(words - 1) / stride {
            let at = 1 + r * stride;
            rows.keys.push(u64::from_le_bytes(word(at)?));
            for c in 0..width {
                rows.values.push(f64::from_le_bytes(word(at + 1 + c)?));
            }
        }
        Some(rows)
    }

    /// The rows ordered by key.
    fn sorted(self) -> Self {
        let mut order: Vec<usize> = (0..self.keys.len()).collect();
        order.sort_by_key(|&i| self.keys[i]);
        let mut out = Rows::new(self.width);
        for i in order {
            out.keys.push(self.keys[i]);
            out.values.extend_from_slice(self.row(i));
        }
        out
    }
}

/// The bytes [`gather_rows`] gathers onto every rank when `ranks` ranks send `rows` rows of
/// `width` numbers together: each rank's width, then each row's key and numbers, 8 bytes
/// each (saturating).
pub(crate) fn gathered_bytes(ranks: usize, rows: usize, width: usize) -> u64 {
    let row = (width as u64).saturating_add(1).saturating_mul(8);
    (ranks as u64)
        .saturating_mul(8)
        .saturating_add((rows as u64).saturating_mul(row))
}

/// Gathers every rank's `rows` onto every rank (one all-gather of variable length), ordered
/// by key: the same rows, bit for bit, whatever the number of ranks and however the samples
/// were dealt. A key that two ranks (or one rank twice) report, or rows of another width, is
/// an error naming the ranks: evaluation shards must not overlap.
pub fn gather_rows(pg: &ProcessGroup, rows: &Rows) -> Result<Rows, TrainError> {
    let gathered = pg.all_gather_bytes(&rows.encode())?;
    let mut all = Rows::new(rows.width);
    let mut owner = Vec::new();
    for (rank, bytes) in gathered.iter().enumerate() {
        let theirs = Rows::decode(bytes)
            .filter(|r| r.width == rows.width)
            .ok_or_else(|| {
                TrainError::Invalid(format!(
                    "rank {rank} sent evaluation rows that are not rows of {} numbers: \
                     every rank must run the same program",
                    rows.width
                ))
            })?;
        owner.extend(std::iter::repeat_n(rank, theirs.len()));
        all.keys.extend(theirs.keys);
        all.values.extend(theirs.values);
    }
    let mut order: Vec<usize> = (0..all.keys.len()).collect();
    order.sort_by_key(|&i| all.keys[i]);
    if let Some(pair) = order.windows(2).find(|p| all.keys[p[0]] == all.keys[p[1]]) {
        return Err(TrainError::Invalid(format!(
            "sample {} was evaluated by rank {} and again by rank {}: the evaluation shards \
             overlap",
            all.keys[pair[0]], owner[pair[0]], owner[pair[1]]
        )));
    }
    Ok(all.sorted())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_survive_their_encoding_and_sort_by_key() {
        let mut r = Rows::new(2);
        r.push(7, &[1.5, -0.0]);
        r.push(3, &[f64::INFINITY, 2.0]);
        r.push(5, &[0.25]);
        let back = Rows::decode(&r.encode()).unwrap();
        assert_eq!(back.keys(), [7, 3, 5]);
        assert_eq!(back.row(1), [f64::INFINITY, 2.0]);
        assert!(back.row(2)[1].is_nan());
        let sorted = back.sorted();
        assert_eq!(sorted.keys(), [3, 5, 7]);
        assert_eq!(sorted.row(2), [1.5, -0.0]);
        assert!(Rows::decode(&[1, 2, 3]).is_none());
        let mut bytes = r.encode();
        bytes.truncate(bytes.len() - 8);
        assert!(Rows::decode(&bytes).is_none());
        assert_eq!(Rows::decode(&Rows::new(4).encode()).unwrap().len(), 0);
    }

    #[test]
    fn gathered_bytes_are_what_the_ranks_encode() {
        // 5 rows of 3 numbers dealt to 3 ranks as 2, 0 and 3.
        let ranks: Vec<Rows> = [0..2, 2..2, 2..5]
            .into_iter()
            .map(|keys| {
                let mut r = Rows::new(3);
                keys.for_each(|k| r.push(k, &[1.0, 2.0, 3.0]));
                r
            })
            .collect();
        let encoded: usize = ranks.iter().map(|r| r.encode().len()).sum();
        assert_eq!(gathered_bytes(3, 5, 3), encoded as u64);
        assert_eq!(gathered_bytes(3, 5, 3), 3 * 8 + 5 * 4 * 8);
        assert_eq!(gathered_bytes(2, usize::MAX, usize::MAX), u64::MAX);
    }
}
