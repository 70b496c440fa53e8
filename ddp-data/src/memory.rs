//! The memory a batch is built in: one slot of the loader's ring, allocated the first time a
//! slot is needed and reused for every later batch that lands in it.
//!
//! The loader asks a [`SlotAllocator`] for each new slot. [`HeapAllocator`] gives plain,
//! page-aligned heap memory; the `tch` feature adds allocators whose slots are tensors (so a
//! CPU batch is handed out without a copy) or page-locked memory (so a copy to a GPU runs
//! asynchronously). This file and `loader.rs` hold the crate's unsafe code for batch memory.

use std::alloc::Layout;
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;

use crate::error::DataError;
use crate::sample::{SampleLayout, Storage};

/// What a new slot must hold: `batch_size` samples of `layout` in `storage`.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotRequest {
    /// Samples per batch.
    pub batch_size: usize,
    /// One sample's shape.
    pub layout: SampleLayout,
    /// The input's element type.
    pub storage: Storage,
}

impl SlotRequest {
    /// Bytes of the input region.
    pub fn input_bytes(&self) -> usize {
        self.batch_size * self.layout.input_len() * self.storage.bytes()
    }

    /// Target values of the target region (of the layout's target kind).
    pub fn targets_len(&self) -> usize {
        self.batch_size * self.layout.targets_len()
    }

    /// Bytes of the target region.
    pub fn targets_bytes(&self) -> usize {
        self.targets_len() * self.layout.target_kind.bytes()
    }
}

/// The memory of one ring slot: an input region of [`SlotRequest::input_bytes`] bytes, a
/// target region of [`SlotRequest::targets_bytes`] bytes and a length region of
/// `batch_size` `i64` values (each sample's length along its first axis).
///
/// # Safety
///
/// An implementation guarantees that the three pointers are valid for reads and writes of
/// their whole region, aligned for `i64`, stable (never moved or freed) for the life of the
/// value, and that nothing else reads or writes that memory while the loader owns the value.
pub unsafe trait BatchMemory: Send + Sync + fmt::Debug {
    /// Start of the input region.
    fn input_ptr(&self) -> *mut u8;
    /// Start of the target region.
    fn targets_ptr(&self) -> *mut u8;
    /// Start of the length region.
    fn lengths_ptr(&self) -> *mut i64;
    /// For downcasting to the allocator's own type.
    fn as_any(&self) -> &dyn Any;
}

/// Makes the memory of new ring slots; called from the loader's worker threads.
pub trait SlotAllocator: Send + Sync + fmt::Debug {
    /// A slot for `request`.
    fn allocate(&self, request: &SlotRequest) -> Result<Box<dyn BatchMemory>, DataError>;
}

/// Zeroed heap memory aligned to a page, freed on drop.
#[derive(Debug)]
pub struct PageAligned {
    ptr: NonNull<u8>,
    layout: Layout,
}

/// Page size assumed for alignment (the smallest x86-64 and arm64 page).
const PAGE: usize = 4096;

impl PageAligned {
    /// `len` zeroed bytes (at least one page is reserved for `len == 0`).
    pub fn zeroed(len: usize) -> Result<Self, DataError> {
        let layout =
            Layout::from_size_align(len.max(1).next_multiple_of(PAGE), PAGE).map_err(|e| {
                DataError::InvalidParameter {
                    name: "batch buffer size",
                    expected: "a size the allocator can serve".to_string(),
                    value: format!("{len} bytes ({e})"),
                }
            })?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| DataError::InvalidParameter {
            name: "batch buffer size",
            expected: "memory the system can allocate".to_string(),
            value: format!("{len} bytes"),
        })?;
        Ok(Self { ptr, layout })
    }

    /// Start of the memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes reserved (a whole number of pages).
    pub fn capacity(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for PageAligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

// SAFETY: the memory is owned exclusively by this value; moving it to or sharing it between
// threads is as safe as for a `Box<[u8]>` (access goes through raw pointers whose users
// uphold `BatchMemory`'s contract).
unsafe impl Send for PageAligned {}
// SAFETY: see `Send`; `&PageAligned` exposes only the pointer and the capacity.
unsafe impl Sync for PageAligned {}

/// A slot in plain heap memory: the input, target and length regions, each page-aligned.
#[derive(Debug)]
pub struct HeapMemory {
    /// The input region.
    pub input: PageAligned,
    /// The target region.
    pub targets: PageAligned,
    /// The length region.
    pub lengths: PageAligned,
}

impl HeapMemory {
    /// Zeroed regions sized for `request`.
    pub fn new(request: &SlotRequest) -> Result<Self, DataError> {
        Ok(Self {
            input: PageAligned::zeroed(request.input_bytes())?,
            targets: PageAligned::zeroed(request.targets_bytes())?,
            lengths: PageAligned::zeroed(request.batch_size * 8)?,
        })
    }
}

// SAFETY: both regions are owned page-aligned allocations of at least the requested sizes,
// freed only when this value drops.
unsafe impl BatchMemory for HeapMemory {
    fn input_ptr(&self) -> *mut u8 {
        self.input.as_ptr()
    }

    fn targets_ptr(&self) -> *mut u8 {
        self.targets.as_ptr()
    }

    fn lengths_ptr(&self) -> *mut i64 {
        self.lengths.as_ptr().cast()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Allocates slots as [`HeapMemory`].
#[derive(Debug, Clone, Copy, Default)]
pub struct HeapAllocator;

impl SlotAllocator for HeapAllocator {
    fn allocate(&self, request: &SlotRequest) -> Result<Box<dyn BatchMemory>, DataError> {
        Ok(Box::new(HeapMemory::new(request)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_slots_are_page_aligned_zeroed_and_sized() {
        let request = SlotRequest {
            batch_size: 3,
            layout: SampleLayout::new([3, 5, 5], [8]),
            storage: Storage::F32,
        };
        assert_eq!(request.input_bytes(), 3 * 75 * 4);
        assert_eq!(request.targets_len(), 24);
        assert_eq!(request.targets_bytes(), 96);
        let m = HeapMemory::new(&request).unwrap();
        assert_eq!(m.input_ptr() as usize % PAGE, 0);
        assert_eq!(m.targets_ptr() as usize % PAGE, 0);
        assert_eq!(m.lengths_ptr() as usize % PAGE, 0);
        assert!(m.input.capacity() >= request.input_bytes());
        // SAFETY: the region holds `input_bytes` initialised (zeroed) bytes.
        let bytes = unsafe { std::slice::from_raw_parts(m.input_ptr(), request.input_bytes()) };
        assert!(bytes.iter().all(|&b| b == 0));
    }
}
