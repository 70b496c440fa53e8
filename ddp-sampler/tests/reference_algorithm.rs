//! The shuffled order, pinned: literal permutations for a few (seed, epoch), and an
//! independent implementation of the algorithm exactly as the crate documentation writes it
//! (ChaCha8 block function, little-endian 32- and 64-bit draws, Lemire's method, Fisher–Yates
//! from the end), which must agree with `ddp_sampler::permutation` bit for bit.

use ddp_sampler::permutation;

/// The ChaCha block function with 8 rounds, in Bernstein's layout: constants, key, 64-bit
/// block counter, 64-bit nonce.
fn chacha8_block(key: &[u32; 8], counter: u64, nonce: u64) -> [u32; 16] {
    let mut input = [0u32; 16];
    input[..4].copy_from_slice(&[0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574]);
    input[4..12].copy_from_slice(key);
    input[12] = counter as u32;
    input[13] = (counter >> 32) as u32;
    input[14] = nonce as u32;
    input[15] = (nonce >> 32) as u32;
    let mut x = input;
    let quarter = |x: &mut [u32; 16], a: usize, b: usize, c: usize, d: usize| {
        x[a] = x[a].wrapping_add(x[b]);
        x[d] = (x[d] ^ x[a]).rotate_left(16);
        x[c] = x[c].wrapping_add(x[d]);
        x[b] = (x[b] ^ x[c]).rotate_left(12);
        x[a] = x[a].wrapping_add(x[b]);
        x[d] = (x[d] ^ x[a]).rotate_left(8);
        x[c] = x[c].wrapping_add(x[d]);
        x[b] = (x[b] ^ x[c]).rotate_left(7);
    };
    for _ in 0..4 {
        quarter(&mut x, 0, 4, 8, 12);
        quarter(&mut x, 1, 5, 9, 13);
        quarter(&mut x, 2, 6, 10, 14);
        quarter(&mut x, 3, 7, 11, 15);
        quarter(&mut x, 0, 5, 10, 15);
        quarter(&mut x, 1, 6, 11, 12);
        quarter(&mut x, 2, 7, 8, 13);
        quarter(&mut x, 3, 4, 9, 14);
    }
    std::array::from_fn(|i| x[i].wrapping_add(input[i]))
}

/// The documented draws for (seed, epoch): keystream words, one per 32-bit draw, two (low
/// first) per 64-bit draw.
struct Draws {
    key: [u32; 8],
    nonce: u64,
    counter: u64,
    block: [u32; 16],
    used: usize,
}

impl Draws {
    fn new(seed: u64, epoch: u64) -> Self {
        let mut key = [0u32; 8];
        key[0] = seed as u32;
        key[1] = (seed >> 32) as u32;
        Draws {
            key,
            nonce: epoch,
            counter: 0,
            block: [0; 16],
            used: 16,
        }
    }

    fn word(&mut self) -> u32 {
        if self.used == 16 {
            self.block = chacha8_block(&self.key, self.counter, self.nonce);
            self.counter += 1;
            self.used = 0;
        }
        self.used += 1;
        self.block[self.used - 1]
    }

    /// A `bits`-bit draw (32 or 64).
    fn draw(&mut self, bits: u32) -> u128 {
        let low = u128::from(self.word());
        if bits == 32 {
            low
        } else {
            low | (u128::from(self.word()) << 32)
        }
    }

    /// Lemire's method, written with 128-bit arithmetic for both widths.
    fn below(&mut self, bound: u64) -> u64 {
        let bits = if bound < 1 << 32 { 32 } else { 64 };
        let (b, modulus) = (u128::from(bound), 1u128 << bits);
        let mut m = self.draw(bits) * b;
        if m % modulus < b {
            let t = (modulus - b) % b;
            while m % modulus < t {
                m = self.draw(bits) * b;
            }
        }
        (m >> bits) as u64
    }
}

fn reference_permutation(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut a: Vec<usize> = (0..len).collect();
    let mut draws = Draws::new(seed, epoch);
    for i in (1..len).rev() {
        let j = draws.below(i as u64 + 1) as usize;
        a.swap(i, j);
    }
    a
}

#[test]
fn chacha8_block_matches_the_published_zero_key_vector() {
    // ChaCha8, all-zero key and nonce, block 0: first keystream bytes
    // 3e 00 ef 2f 89 5f 40 d6 7f 5b b8 e8 1f 09 a5 a1 (Bernstein's / eSTREAM test vector).
    let block = chacha8_block(&[0; 8], 0, 0);
    let bytes: Vec<u8> = block[..4].iter().flat_map(|w| w.to_le_bytes()).collect();
    assert_eq!(
        bytes,
        [
            0x3e, 0x00, 0xef, 0x2f, 0x89, 0x5f, 0x40, 0xd6, 0x7f, 0x5b, 0xb8, 0xe8, 0x1f, 0x09,
            0xa5, 0xa1
        ]
    );
}

#[test]
fn pinned_permutations_of_twenty() {
    let p = |seed, epoch| permutation(20, seed, epoch);
    let e00 = [
        13, 17, 14, 6, 18, 9, 8, 11, 0, 4, 2, 5, 1, 7, 19, 12, 10, 16, 15, 3,
    ];
    let e01 = [
        5, 16, 17, 10, 0, 11, 18, 1, 2, 9, 6, 4, 7, 15, 3, 12, 13, 8, 19, 14,
    ];
    let e10 = [
        18, 0, 4, 15, 3, 8, 17, 10, 1, 2, 9, 13, 14, 19, 11, 6, 5, 16, 7, 12,
    ];
    let e42_3 = [
        7, 2, 10, 19, 18, 0, 16, 14, 3, 15, 1, 9, 12, 17, 13, 6, 11, 4, 8, 5,
    ];
    assert_eq!(p(0, 0), e00, "seed 0 epoch 0");
    assert_eq!(p(0, 1), e01, "seed 0 epoch 1");
    assert_eq!(p(1, 0), e10, "seed 1 epoch 0");
    assert_eq!(p(42, 3), e42_3, "seed 42 epoch 3");
}

#[test]
fn pinned_permutations_use_all_key_and_nonce_bits() {
    assert_eq!(
        permutation(12, 0xDEAD_BEEF_CAFE_F00D, (1 << 40) + 5),
        [4, 1, 6, 0, 10, 2, 9, 11, 8, 5, 3, 7]
    );
    assert_eq!(
        permutation(12, u64::MAX, u64::MAX),
        [11, 1, 8, 5, 3, 9, 0, 7, 2, 6, 10, 4]
    );
}

#[test]
fn pinned_permutation_of_a_thousand() {
    let p = permutation(1000, 7, 11);
    assert_eq!(p[..8], [128, 687, 277, 195, 261, 936, 942, 107]);
    assert_eq!(p[992..], [148, 992, 274, 255, 375, 405, 421, 285]);
    let weighted: usize = p.iter().enumerate().map(|(i, v)| i * v).sum();
    assert_eq!(weighted, 246_044_676);
}

#[test]
fn documented_algorithm_reproduces_the_crate_bit_for_bit() {
    let seeds = [0, 1, 42, 0x0123_4567_89ab_cdef, u64::MAX];
    let epochs = [0, 1, 2, 1 << 32, u64::MAX];
    for len in [0, 1, 2, 3, 31, 32, 33, 64, 65, 66, 1000, 4097] {
        for seed in seeds {
            for epoch in epochs {
                assert_eq!(
                    permutation(len, seed, epoch),
                    reference_permutation(len, seed, epoch),
                    "len {len} seed {seed} epoch {epoch}"
                );
            }
        }
    }
}
