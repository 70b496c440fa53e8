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

/// The uniform index `j` in `0..=i` that Fisher–Yates step `i` swaps with: a 32-bit draw
/// while `i + 1 < 2^32`, a 64-bit draw above.
#[inline]
fn swap_partner(rng: &mut impl RngCore, i: usize) -> usize {
    match u32::try_from(i + 1) {
        Ok(bound) => below_u32(rng, bound) as usize,
        Err(_) => below_u64(rng, i as u64 + 1) as usize,
    }
}

/// A uniform integer in `0..bound` (`bound >= 1`) by Lemire's nearly divisionless method on
/// one 32-bit keystream word: the high half of `word * bound`, redrawing while the low half
/// falls below `2^32 mod bound`.
#[inline]
pub(crate) fn below_u32(rng: &mut impl RngCore, bound: u32) -> u32 {
    debug_assert!(bound >= 1, "bound must be at least 1");
    let mut product = u64::from(rng.next_u32()) * u64::from(bound);
    let mut low = product as u32;
    if low < bound {
        let threshold = bound.wrapping_neg() % bound;
        while low < threshold {
            product = u64::from(rng.next_u32()) * u64::from(bound);
            low = product as u32;
        }
    }
    (product >> 32) as u32
}

/// [`below_u32`] on 64-bit draws (two keystream words, low first), for bounds of `2^32` and
/// more.
#[inline]
pub(crate) fn below_u64(rng: &mut impl RngCore, bound: u64) -> u64 {
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

/// How many swap partners are drawn ahead of the swap that uses them, so that the random
/// element each swap touches is already on its way into cache. Measured on N = 10^7: 16
/// ahead is 25% slower than 64, without any it is 3 to 4 times slower.
const LOOKAHEAD: usize = 64;

/// Fisher–Yates from the end: for `i` from `len - 1` down to 1, swap `order[i]` with
/// `order[swap_partner(i)]`.
///
/// The partners depend only on the keystream, not on the array, so they are drawn
/// [`LOOKAHEAD`] steps early (in the same order) and their slots prefetched: on a large
/// permutation each swap would otherwise wait for a cache miss.
fn fisher_yates<T: Slot>(order: &mut [T], rng: &mut impl RngCore) {
    let steps = order.len().saturating_sub(1);
    // Step s swaps position i = len - 1 - s; `ahead[s % LOOKAHEAD]` holds its partner.
    let mut ahead = [0usize; LOOKAHEAD];
    for (s, partner) in ahead.iter_mut().enumerate().take(steps) {
        *partner = swap_partner(rng, steps - s);
        prefetch(&order[*partner]);
    }
    for s in 0..steps {
        let i = steps - s;
        let slot = s % LOOKAHEAD;
        let j = ahead[slot];
        if s + LOOKAHEAD < steps {
            let later = swap_partner(rng, i - LOOKAHEAD);
            ahead[slot] = later;
            prefetch(&order[later]);
        }
        order.swap(i, j);
    }
}

/// Asks the CPU to start loading `slot` into cache; changes nothing observable.
#[inline(always)]
fn prefetch<T>(slot: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of the x86_64 baseline, and a prefetch never faults or writes; the
    // pointer comes from a live reference anyway.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((slot as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = slot;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A generator that replays fixed draws, to drive the bounded draws through their
    /// rejection branches; a 32-bit draw must be given a value that fits.
    struct Replay(std::vec::IntoIter<u64>);

    impl RngCore for Replay {
        fn next_u32(&mut self) -> u32 {
            let draw = self.next_u64();
            u32::try_from(draw).expect("a 32-bit draw was expected here")
        }

        fn next_u64(&mut self) -> u64 {
            self.0.next().expect("test supplied too few draws")
        }

        fn fill_bytes(&mut self, _dest: &mut [u8]) {
            unreachable!("the sampler draws whole words")
        }
    }

    fn replay<const N: usize>(draws: [u64; N]) -> Replay {
        Replay(Vec::from(draws).into_iter())
    }

    // For bound 10 the rejection threshold is 2^32 mod 10 = 2^64 mod 10 = 6; products below
    // are (high half, low half) of draw * 10.

    #[test]
    fn below_u32_takes_the_high_half_and_rejects_under_the_threshold() {
        // (2^32 + 4) / 10 = 429496730: (1, 4), rejected. (4 * 2^32 + 6) / 10 = 1717986919:
        // (4, 6), accepted.
        let mut rng = replay([429_496_730, 1_717_986_919, 0]);
        assert_eq!(below_u32(&mut rng, 10), 4);
        assert_eq!(
            rng.next_u64(),
            0,
            "an accepted draw must not consume another"
        );
        let mut rng = replay([u64::from(u32::MAX)]);
        assert_eq!(below_u32(&mut rng, 10), 9);
    }

    #[test]
    fn swap_partner_switches_to_64_bit_draws_at_bound_2_pow_32() {
        // Bound 2^32 - 1 takes one 32-bit word: (2^31 * (2^32 - 1)) >> 32 = 2^31 - 1.
        let mut rng = replay([1 << 31]);
        assert_eq!(
            swap_partner(&mut rng, (u32::MAX - 1) as usize),
            (1 << 31) - 1
        );
        #[cfg(target_pointer_width = "64")]
        {
            // Bound 2^32 takes a 64-bit draw: (2^63 * 2^32) >> 64 = 2^31.
            let mut rng = replay([1 << 63]);
            assert_eq!(swap_partner(&mut rng, u32::MAX as usize), 1 << 31);
        }
    }

    #[test]
    fn below_takes_the_high_word_of_an_accepted_draw() {
        // u64::MAX * 10 = (9, 2^64 - 10): low word 2^64 - 10 >= 10, accepted without a division.
        let mut rng = replay([u64::MAX]);
        assert_eq!(below_u64(&mut rng, 10), 9);
    }

    #[test]
    fn below_accepts_a_low_word_equal_to_the_threshold() {
        // 7378697629483820647 * 10 = (4, 6): 6 < 10 triggers the check, 6 < 6 is false.
        let mut rng = replay([7_378_697_629_483_820_647, 0]);
        assert_eq!(below_u64(&mut rng, 10), 4);
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
        assert_eq!(below_u64(&mut rng, 10), 9);
    }

    #[test]
    fn below_one_is_always_zero_without_rejection() {
        let mut rng = replay([0, 7]);
        assert_eq!(below_u64(&mut rng, 1), 0);
        assert_eq!(rng.next_u64(), 7);
    }

    #[test]
    fn keystream_uses_epoch_as_stream_not_seed_offset() {
        let first = |seed, epoch| keystream(seed, epoch).next_u64();
        assert_eq!(
            first(0, 0),
            0xd640_5f89_2fef_003e,
            "ChaCha8 zero-key vector 3e 00 ef 2f 89 5f 40 d6"
        );
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
