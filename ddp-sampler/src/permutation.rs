//! The shuffled order of one epoch: a ChaCha8 keystream, unbiased bounded draws and a
//! Fisher–Yates shuffle, exactly as the crate documentation specifies.

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

/// The uniform random permutation of `0..len` for `(seed, epoch)`.
///
/// This is the order a shuffling [`DistributedSampler`](crate::DistributedSampler) deals out
/// in epoch `epoch`; the crate documentation specifies the algorithm bit for bit. Distinct
/// `(seed, epoch)` pairs use distinct ChaCha keystreams, so seed 0 / epoch 1 and seed 1 /
/// epoch 0 give unrelated orders.
///
/// ```
/// assert_eq!(ddp_sampler::permutation(5, 42, 0).len(), 5);
/// assert_eq!(ddp_sampler::permutation(1, 42, 0), vec![0]);
/// ```
pub fn permutation(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    shuffled(len, seed, epoch)
}

/// An element of a permutation in memory: `u32` when every index fits (half the memory and
/// cache traffic of `usize`), `usize` otherwise.
pub(crate) trait Slot: Copy {
    /// The slot holding `index`; callers guarantee it fits.
    fn from_index(index: usize) -> Self;
    /// The index this slot holds.
    fn index(self) -> usize;
}

impl Slot for u32 {
    #[inline]
    fn from_index(index: usize) -> Self {
        debug_assert!(
            u32::try_from(index).is_ok(),
            "index {index} does not fit in u32"
        );
        index as u32
    }

    #[inline]
    fn index(self) -> usize {
        self as usize
    }
}

impl Slot for usize {
    #[inline]
    fn from_index(index: usize) -> Self {
        index
    }

    #[inline]
    fn index(self) -> usize {
        self
    }
}

/// Whether a permutation of `0..len` can be held in `u32` slots.
pub(crate) fn fits_u32(len: usize) -> bool {
    u32::try_from(len).is_ok()
}

/// The permutation of `0..len` for `(seed, epoch)`, in slots of type `T`.
pub(crate) fn shuffled<T: Slot>(len: usize, seed: u64, epoch: u64) -> Vec<T> {
    let mut order: Vec<T> = (0..len).map(T::from_index).collect();
    fisher_yates(&mut order, &mut keystream(seed, epoch));
    order
}

/// The ChaCha8 generator for `(seed, epoch)`: the seed's little-endian bytes as the first 8
/// bytes of the 32-byte key (the rest zero), the epoch as the 64-bit stream (nonce), block
/// counter 0.
pub(crate) fn keystream(seed: u64, epoch: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    let mut rng = ChaCha8Rng::from_seed(key);
    rng.set_stream(epoch);
    rng
}

/// A uniform integer in `0..bound` (`bound >= 1`) by Lemire's nearly divisionless method on
/// 64-bit draws: the high word of `draw * bound`, redrawing while the low word falls below
/// `2^64 mod bound`.
#[inline]
pub(crate) fn below(rng: &mut impl RngCore, bound: u64) -> u64 {
    debug_assert!(bound >= 1, "bound must be at least 1");
    let mut product = u128::from(rng.next_u64()) * u128::from(bound);
    let mut low = product as u64;
    if low < bound {
        let threshold = bound.wrapping_neg() % bound;
        while low < threshold {
            product = u128::from(rng.next_u64()) * u128::from(bound);
            low = product as u64;
        }
    }
    (product >> 64) as u64
}

/// Fisher–Yates from the end: for `i` from `len - 1` down to 1, swap `order[i]` with
/// `order[j]` where `j = below(i + 1)`.
fn fisher_yates<T: Slot>(order: &mut [T], rng: &mut impl RngCore) {
    for i in (1..order.len()).rev() {
        let j = below(rng, i as u64 + 1) as usize;
        order.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A generator that replays fixed draws, to drive `below` through its rejection branch.
    struct Replay(std::vec::IntoIter<u64>);

    impl RngCore for Replay {
        fn next_u32(&mut self) -> u32 {
            unreachable!("the sampler only draws 64-bit words")
        }

        fn next_u64(&mut self) -> u64 {
            self.0.next().expect("test supplied too few draws")
        }

        fn fill_bytes(&mut self, _dest: &mut [u8]) {
            unreachable!("the sampler only draws 64-bit words")
        }
    }

    fn replay<const N: usize>(draws: [u64; N]) -> Replay {
        Replay(Vec::from(draws).into_iter())
    }

    // For bound 10 the rejection threshold is 2^64 mod 10 = 6; products below are
    // (high word, low word) of draw * 10.

    #[test]
    fn below_takes_the_high_word_of_an_accepted_draw() {
        // u64::MAX * 10 = (9, 2^64 - 10): low word 2^64 - 10 >= 10, accepted without a division.
        let mut rng = replay([u64::MAX]);
        assert_eq!(below(&mut rng, 10), 9);
    }

    #[test]
    fn below_accepts_a_low_word_equal_to_the_threshold() {
        // 7378697629483820647 * 10 = (4, 6): 6 < 10 triggers the check, 6 < 6 is false.
        let mut rng = replay([7_378_697_629_483_820_647, 0]);
        assert_eq!(below(&mut rng, 10), 4);
        assert_eq!(
            rng.next_u64(),
            0,
            "an accepted draw must not consume another"
        );
    }

    #[test]
    fn below_rejects_low_words_under_the_threshold() {
        // 1844674407370955162 * 10 = (1, 4): 4 < 6, rejected. 2^63 * 10 = (5, 0): rejected.
        // u64::MAX * 10 = (9, 2^64 - 10): accepted.
        let mut rng = replay([1_844_674_407_370_955_162, 1 << 63, u64::MAX]);
        assert_eq!(below(&mut rng, 10), 9);
    }

    #[test]
    fn below_one_is_always_zero_without_rejection() {
        let mut rng = replay([0, 7]);
        assert_eq!(below(&mut rng, 1), 0);
        assert_eq!(rng.next_u64(), 7);
    }

    #[test]
    fn keystream_uses_epoch_as_stream_not_seed_offset() {
        let first = |seed, epoch| keystream(seed, epoch).next_u64();
        assert_ne!(first(0, 1), first(1, 0));
        assert_eq!(first(3, 9), first(3, 9));
    }

    #[test]
    fn u32_and_usize_slots_give_the_same_order() {
        for len in [0, 1, 2, 17, 1000] {
            let narrow: Vec<usize> = shuffled::<u32>(len, 5, 2)
                .into_iter()
                .map(Slot::index)
                .collect();
            assert_eq!(narrow, shuffled::<usize>(len, 5, 2), "len {len}");
        }
    }

    #[test]
    fn tiny_lengths_are_identity() {
        assert_eq!(permutation(0, 1, 1), Vec::<usize>::new());
        assert_eq!(permutation(1, 1, 1), vec![0]);
    }

    #[test]
    fn fits_u32_at_the_boundary() {
        assert!(fits_u32(u32::MAX as usize));
        assert_eq!(fits_u32(u32::MAX as usize + 1), usize::BITS <= 32);
    }
}
