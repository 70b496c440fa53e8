//! [`HostBatch`], one finished batch of a [`HostLoader`](crate::loader::HostLoader): a lease
//! on its slot of the ring, read in place and returned to the ring when dropped.

use std::fmt;
use std::sync::Arc;

use crate::memory::BatchMemory;
use crate::ring::{ReuseHook, Ring};
use crate::sample::{PadTo, SampleLayout, Storage, ValueKind};

/// A batch's data-set indices, in batch order: a window of the epoch's shared index list.
#[derive(Clone)]
pub struct BatchIndices {
    all: Arc<[usize]>,
    start: usize,
    len: usize,
}

impl std::ops::Deref for BatchIndices {
    type Target = [usize];

    fn deref(&self) -> &[usize] {
        &self.all[self.start..self.start + self.len]
    }
}

impl fmt::Debug for BatchIndices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A sample's input values, borrowed from a batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum InputRef<'a> {
    /// Bytes ([`Storage::U8`]).
    U8(&'a [u8]),
    /// Final values ([`Storage::F32`]).
    F32(&'a [f32]),
    /// Final values ([`Storage::I64`]).
    I64(&'a [i64]),
}

/// A batch's targets, borrowed from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TargetsRef<'a> {
    /// `f32` targets.
    F32(&'a [f32]),
    /// `i64` targets.
    I64(&'a [i64]),
}

/// One finished batch: a lease on its ring slot, returned to the ring on drop.
///
/// The input is `[len, ...layout.shape]` (at the maximum length for padded layouts) and the
/// targets `[len, ...layout.target_shape]`, both row-major, in the slot's memory.
pub struct HostBatch {
    ring: Arc<Ring>,
    slot: usize,
    memory: Arc<dyn BatchMemory>,
    start: usize,
    len: usize,
    hook: Option<ReuseHook>,
}

impl HostBatch {
    /// The lease on `slot` (whose memory is `memory`) for the `len` samples at positions
    /// `start..` of the ring's index list, all finished.
    pub(crate) fn new(
        ring: Arc<Ring>,
        slot: usize,
        memory: Arc<dyn BatchMemory>,
        start: usize,
        len: usize,
    ) -> Self {
        Self {
            ring,
            slot,
            memory,
            start,
            len,
            hook: None,
        }
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the batch holds no samples (never the case for a batch a loader yields).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The data-set index of each sample, in batch order.
    pub fn indices(&self) -> &[usize] {
        &self.ring.indices[self.start..self.start + self.len]
    }

    /// The same indices as a value that outlives the lease (shares the epoch's index list;
    /// allocates nothing).
    pub fn index_list(&self) -> BatchIndices {
        BatchIndices {
            all: Arc::clone(&self.ring.indices),
            start: self.start,
            len: self.len,
        }
    }

    /// One sample's shape.
    pub fn layout(&self) -> &SampleLayout {
        &self.ring.request.layout
    }

    /// The input's element type.
    pub fn storage(&self) -> Storage {
        self.ring.request.storage
    }

    /// The slot's number in the ring (slots are numbered in allocation order).
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The slot's memory, for allocators that hand it out in their own form (a tensor).
    pub fn memory(&self) -> &dyn BatchMemory {
        &*self.memory
    }

    /// Every sample's input.
    pub fn input(&self) -> InputRef<'_> {
        let n = self.len * self.ring.request.layout.input_len();
        // SAFETY: the slot's memory holds a whole batch (`BatchMemory`'s contract) and this
        // lease's first `len` samples are finished: their writes happened before the lock
        // that handed the batch out, and no worker writes into a leased slot.
        unsafe {
            let ptr = self.memory.input_ptr();
            match self.storage() {
                Storage::U8 => InputRef::U8(std::slice::from_raw_parts(ptr, n)),
                Storage::F32 => InputRef::F32(std::slice::from_raw_parts(ptr.cast::<f32>(), n)),
                Storage::I64 => InputRef::I64(std::slice::from_raw_parts(ptr.cast::<i64>(), n)),
            }
        }
    }

    /// The input as `f32` values, when stored so.
    pub fn input_f32(&self) -> Option<&[f32]> {
        match self.input() {
            InputRef::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The input as bytes, when stored so.
    pub fn input_u8(&self) -> Option<&[u8]> {
        match self.input() {
            InputRef::U8(v) => Some(v),
            _ => None,
        }
    }

    /// The input as `i64` values, when stored so.
    pub fn input_i64(&self) -> Option<&[i64]> {
        match self.input() {
            InputRef::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Sample `k`'s input.
    pub fn sample(&self, k: usize) -> InputRef<'_> {
        let n = self.ring.request.layout.input_len();
        match self.input() {
            InputRef::U8(v) => InputRef::U8(&v[k * n..(k + 1) * n]),
            InputRef::F32(v) => InputRef::F32(&v[k * n..(k + 1) * n]),
            InputRef::I64(v) => InputRef::I64(&v[k * n..(k + 1) * n]),
        }
    }

    /// Each sample's length along the input's first axis, for padded layouts
    /// ([`SampleLayout::padding`]); `None` otherwise.
    pub fn lengths(&self) -> Option<&[i64]> {
        self.ring.request.layout.padding?;
        // SAFETY: as in `input`, for the length region (`batch_size` values).
        Some(unsafe { std::slice::from_raw_parts(self.memory.lengths_ptr(), self.len) })
    }

    /// The length the batch's inputs are padded to along their first axis: the longest
    /// sample for [`PadTo::Longest`], the layout's maximum otherwise (also without padding).
    pub fn padded_len(&self) -> usize {
        let layout = &self.ring.request.layout;
        match (layout.padding, self.lengths()) {
            (Some(p), Some(lengths)) if p.to == PadTo::Longest => {
                lengths.iter().copied().max().unwrap_or(0) as usize
            }
            _ => layout.max_len(),
        }
    }

    /// Every sample's input as final `f32` values: bytes go through the layout's affine map
    /// and their padding positions hold the padding value (as the device would convert
    /// them), `i64` values are converted with `as`. Allocates; for checks and small batches.
    pub fn input_values(&self) -> Vec<f32> {
        match self.input() {
            InputRef::F32(v) => v.to_vec(),
            InputRef::I64(v) => v.iter().map(|&x| x as f32).collect(),
            InputRef::U8(bytes) => {
                let layout = &self.ring.request.layout;
                let n = layout.input_len();
                let mut out = vec![0f32; bytes.len()];
                if let Some(affine) = &layout.bytes {
                    for (src, dst) in bytes.chunks(n).zip(out.chunks_mut(n)) {
                        affine.apply(src, layout.step_len(), dst);
                    }
                }
                // The padding's byte is a placeholder: the value need not be a byte, and the
                // map would move it.
                if let (Some(padding), Some(lengths)) = (layout.padding, self.lengths()) {
                    for (dst, &len) in out.chunks_mut(n).zip(lengths) {
                        dst[len as usize * layout.step_len()..].fill(padding.value as f32);
                    }
                }
                out
            }
        }
    }

    /// Every sample's targets.
    pub fn targets(&self) -> TargetsRef<'_> {
        let layout = &self.ring.request.layout;
        let n = self.len * layout.targets_len();
        let ptr = self.memory.targets_ptr();
        // SAFETY: as in `input`, for the target region.
        unsafe {
            match layout.target_kind {
                ValueKind::F32 => TargetsRef::F32(std::slice::from_raw_parts(ptr.cast::<f32>(), n)),
                ValueKind::I64 => TargetsRef::I64(std::slice::from_raw_parts(ptr.cast::<i64>(), n)),
            }
        }
    }

    /// The targets as `f32` values, when they are.
    pub fn targets_f32(&self) -> Option<&[f32]> {
        match self.targets() {
            TargetsRef::F32(v) => Some(v),
            TargetsRef::I64(_) => None,
        }
    }

    /// The targets as `i64` values, when they are.
    pub fn targets_i64(&self) -> Option<&[i64]> {
        match self.targets() {
            TargetsRef::I64(v) => Some(v),
            TargetsRef::F32(_) => None,
        }
    }

    /// Returns the slot to the ring now, with `hook` to run before the slot is written again
    /// (e.g. to wait for an asynchronous copy out of it).
    pub fn release_after(mut self, hook: ReuseHook) {
        self.hook = Some(hook);
    }
}

impl Drop for HostBatch {
    fn drop(&mut self) {
        self.ring.give_back(self.slot, self.hook.take());
    }
}

impl fmt::Debug for HostBatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBatch")
            .field("indices", &self.indices())
            .field("storage", &self.storage())
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

/// Batches are equal when they hold the same samples with the same values.
impl PartialEq for HostBatch {
    fn eq(&self, other: &Self) -> bool {
        self.indices() == other.indices()
            && self.layout() == other.layout()
            && self.input() == other.input()
            && self.targets() == other.targets()
            && self.lengths() == other.lengths()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::loader::{HostLoader, LoaderConfig};
    use crate::memory::HeapAllocator;
    use crate::sample::{Padding, Storage};
    use crate::tensor_dataset::{Array, TensorDataset};

    use super::*;

    /// The values of a padded batch in byte slots hold the padding value at the padding
    /// positions, as a batch of `f32` slots does: the padding's byte (-1 as `u8` is 0) is
    /// not converted.
    #[test]
    fn input_values_of_padded_bytes_hold_the_padding_value() {
        let set = TensorDataset::sequences(
            vec![vec![1u8, 2, 3], vec![4]],
            Array::from(vec![0i64, 1]),
            Padding {
                value: -1.0,
                to: PadTo::Longest,
            },
        )
        .unwrap();
        let want = [4.0, -1.0, -1.0, 1.0, 2.0, 3.0];
        for storage in [Storage::F32, Storage::U8] {
            let config = LoaderConfig::new(2);
            let allocator = Arc::new(HeapAllocator);
            let mut loader =
                HostLoader::with_storage(set.clone(), vec![1, 0], &config, storage, allocator)
                    .unwrap();
            let batch = loader.next().unwrap().unwrap();
            assert_eq!(batch.storage(), storage);
            assert_eq!(batch.input_values(), want, "{storage:?}");
        }
    }
}
