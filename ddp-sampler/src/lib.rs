//! Which dataset indices each rank reads in each epoch of data-parallel training: the
//! counterpart of PyTorch's `torch.utils.data.distributed.DistributedSampler`, for programs
//! that run one process per device.
//!
//! [`DistributedSampler`] deals one rank its share of every epoch. It follows PyTorch's
//! rules exactly (padding, `drop_last`, strided shards) except for the random source, which
//! is specified below so that any implementation can reproduce it. Beyond PyTorch it offers
//! exact evaluation shards ([`Partition::Exact`]), mid-epoch resume
//! ([`DistributedSampler::iter_from`]), the rest of an epoch on another number of ranks
//! ([`DistributedSampler::remaining`]) and [`Batches`] that have the same count on every
//! rank. It has no I/O and no dependency on libtorch.
//!
//! ```
//! use ddp_sampler::{DistributedSampler, Partition, SamplerError};
//!
//! # fn main() -> Result<(), SamplerError> {
//! // Rank 1 of 4 over 10 samples, shuffled with seed 42.
//! let mut sampler = DistributedSampler::builder(10, 4, 1).seed(42).build()?;
//! sampler.set_epoch(3);
//! assert_eq!(sampler.len(), 3); // ceil(10 / 4), padded by repeating samples
//! assert_eq!(sampler.indices(), [3, 9, 2]);
//! assert_eq!(sampler.iter_from(1)?.collect::<Vec<_>>(), sampler.indices()[1..]);
//!
//! // Evaluation: no padding, every index on exactly one rank.
//! let eval = DistributedSampler::builder(10, 4, 3)
//!     .shuffle(false)
//!     .partition(Partition::Exact)
//!     .build()?;
//! assert_eq!(eval.indices(), [3, 7]);
//! assert_eq!(eval.len_of_rank(0), Some(3));
//!
//! // Invalid configurations are refused when the sampler is built.
//! let err = DistributedSampler::new(10, 4, 4).unwrap_err();
//! assert_eq!(err.to_string(), "rank 4 is out of range for 4 replicas (expected 0..4)");
//! # Ok(())
//! # }
//! ```
//!
//! # Which indices a rank gets
//!
//! For a dataset of `N` samples, `R` replicas and rank `r`, each epoch has an *order*: a
//! permutation of `0..N` (see below) or, with `shuffle(false)`, `0..N` itself. Position `p`
//! of the padded order holds `order[p % N]`, and rank `r` takes the positions
//! `r, r + R, r + 2R, ...` (strided, not blocks), as many as its shard length:
//!
//! | partition | shard length of rank `r` | PyTorch |
//! |---|---|---|
//! | [`Partition::Padded`] (default) | `ceil(N / R)`; the order is padded by repeating it from its start | `drop_last=False` |
//! | [`Partition::Padded`] with `drop_last(true)` | `floor(N / R)`; the tail of the order is dropped | `drop_last=True` |
//! | [`Partition::Exact`] | `ceil((N - r) / R)`: every index exactly once, lengths differ by at most one | — |
//!
//! With `shuffle(false)` the indices equal PyTorch's for every `(N, R, r, drop_last)`.
//! [`SamplerBuilder::build`] refuses any configuration in which a rank would get no samples,
//! unless [`SamplerBuilder::allow_empty_shards`] allows it for an exact evaluation.
//!
//! # The shuffled order, bit for bit
//!
//! The order of epoch `e` under seed `s` is the following permutation of `0..N`
//! ([`permutation`]`(N, s, e)`); it depends on nothing else, so it is identical across
//! processes, machines, thread counts and platforms (it uses only integer arithmetic).
//!
//! 1. **Generator.** ChaCha with 8 rounds (ChaCha8: four double rounds) in Bernstein's
//!    original layout, i.e. `rand_chacha::ChaCha8Rng` 0.9. Its 16-word input state is
//!    the constants `"expand 32-byte k"` (words 0–3), the 32-byte key as eight
//!    little-endian `u32` (words 4–11), a 64-bit block counter starting at 0 (words 12–13,
//!    low word first) and a 64-bit nonce (words 14–15, low word first). Each block's output
//!    is the 16 words of the state after the rounds plus the input state, serialised
//!    little-endian: 64 bytes of keystream per block, blocks in counter order.
//! 2. **Key and stream.** The key is `s` as 8 little-endian bytes followed by 24 zero bytes;
//!    the nonce ("stream", `set_stream`) is `e`. So `(s, e)` pairs never share a keystream,
//!    unlike PyTorch's `seed + epoch`, where seed 0 / epoch 1 equals seed 1 / epoch 0.
//! 3. **Words.** The keystream is read as consecutive little-endian `u32` words. A 32-bit
//!    draw takes the next word (`ChaCha8Rng::next_u32`); a 64-bit draw takes the next two,
//!    the first as the low half (`ChaCha8Rng::next_u64`).
//! 4. **Unbiased bounded integer** `below(b)` for `b >= 1`, Lemire's nearly divisionless
//!    method with `w = 32` bits if `b < 2^32`, else `w = 64`: take a `w`-bit draw `x`; let
//!    `m = x * b` (a `2w`-bit product) and `l = m mod 2^w`. If `l < b`, let
//!    `t = (2^w - b) mod b` and, while `l < t`, take a new `w`-bit draw and recompute `m` and
//!    `l`. The result is `floor(m / 2^w)`.
//! 5. **Shuffle.** Start from `a = [0, 1, ..., N - 1]`. For `i` from `N - 1` down to `1`:
//!    `j = below(i + 1)`, swap `a[i]` and `a[j]`. The result is `a`. (`N <= 1` draws nothing.)
//!
//! For example, `permutation(20, 0, 0)` is
//! `[13, 17, 14, 6, 18, 9, 8, 11, 0, 4, 2, 5, 1, 7, 19, 12, 10, 16, 15, 3]`; the
//! crate's tests pin this and other cases, and check the steps above against an independent
//! implementation of them.
//!
//! # Memory and speed
//!
//! A shuffled epoch materialises the permutation once, in `u32` slots while `N < 2^32`
//! (4 bytes per index, freed when this rank's `N / R` indices have been copied out) and in
//! `usize` slots otherwise (compacted in place): never more than one `usize` per index.
//! Nothing is shared between ranks and no rank needs another's indices. The shuffle draws
//! each swap partner 64 steps before using it and prefetches its slot, which changes the
//! speed, not the order. `benches/sampler.rs` times one epoch for `N = 10^6` and `10^7`;
//! `benches/reference_sampler.py` times PyTorch on the same sizes.
#![warn(missing_docs)]

mod batch;
mod error;
mod permutation;
mod resume;
mod sampler;
mod shard;

pub use batch::Batches;
pub use error::SamplerError;
pub use permutation::permutation;
pub use sampler::{DistributedSampler, Iter, SamplerBuilder};
pub use shard::Partition;
