//! The shuffled order, pinned: literal permutations for a few (seed, epoch), and an
//! independent implementation of the algorithm exactly as the crate documentation writes it
//! (ChaCha8 block function, little-endian u64 draws, Lemire's method, Fisher–Yates from the
//! end), which must agree with `ddp_sampler::permutation` bit for bit.

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

/// The documented 64-bit draws for (seed, epoch).
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

    fn next(&mut self) -> u64 {
        if self.used == 16 {
            self.block = chacha8_block(&self.key, self.counter, self.nonce);
            self.counter += 1;
            self.used = 0;
        }
        let low = u64::from(self.block[self.used]);
        let high = u64::from(self.block[self.used + 1]);
        self.used += 2;
        low | (high << 32)
    }

    fn below(&mut self, bound: u64) -> u64 {
        let mut m = u128::from(self.next()) * u128::from(bound);
        if (m as u64) < bound {
            let t = (u64::MAX - bound + 1) % bound;
            while (m as u64) < t {
                m = u128::from(self.next()) * u128::from(bound);
            }
        }
        (m >> 64) as u64
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
    let cases: [(u64, u64, [usize; 20]); 4] = [
        (
            0,
            0,
            [
                13, 14, 5, 9, 8, 10, 2, 15, 18, 6, 7, 12, 3, 0, 19, 17, 1, 4, 11, 16,
            ],
        ),
        (
            0,
            1,
            [
                9, 3, 7, 12, 13, 5, 1, 18, 2, 14, 11, 8, 0, 6, 17, 16, 10, 4, 19, 15,
            ],
        ),
        (
            1,
            0,
            [
                19, 6, 0, 11, 3, 9, 12, 17, 1, 8, 18, 4, 16, 10, 2, 13, 15, 14, 5, 7,
            ],
        ),
        (
            42,
            3,
            [
                10, 11, 4, 17, 2, 18, 14, 0, 7, 19, 3, 5, 8, 13, 6, 1, 16, 15, 12, 9,
            ],
        ),
    ];
    for (seed, epoch, expected) in cases {
        assert_eq!(
            permutation(20, seed, epoch),
            expected,
            "seed {seed} epoch {epoch}"
        );
    }
}

#[test]
fn pinned_permutations_use_all_key_and_nonce_bits() {
    assert_eq!(
        permutation(12, 0xDEAD_BEEF_CAFE_F00D, (1 << 40) + 5),
        [3, 0, 1, 2, 10, 11, 7, 6, 5, 8, 9, 4]
    );
    assert_eq!(
        permutation(12, u64::MAX, u64::MAX),
        [10, 5, 3, 1, 8, 4, 9, 7, 6, 0, 2, 11]
    );
}

#[test]
fn pinned_permutation_of_a_thousand() {
    let p = permutation(1000, 7, 11);
    assert_eq!(p[..8], [140, 116, 537, 598, 642, 247, 965, 366]);
    assert_eq!(p[992..], [186, 514, 588, 218, 148, 275, 376, 421]);
    let weighted: usize = p.iter().enumerate().map(|(i, v)| i * v).sum();
    assert_eq!(weighted, 247_791_007);
}

#[test]
fn documented_algorithm_reproduces_the_crate_bit_for_bit() {
    let seeds = [0, 1, 42, 0x0123_4567_89ab_cdef, u64::MAX];
    let epochs = [0, 1, 2, 1 << 32, u64::MAX];
    for len in [0, 1, 2, 3, 31, 32, 33, 1000, 4097] {
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
