//! The memory a batch is built in: one slot of the loader's ring, allocated the first time a
//! slot is needed and reused for every later batch that lands in it.
//!
//! The loader asks a [`SlotAllocator`] for each new slot. [`HeapAllocator`] gives plain,
//! page-aligned heap memory; the `tch` feature adds allocators whose slots are tensors (so a
//! CPU batch is handed out without a copy) or page-locked memory (so a copy to a GPU runs
//! asynchronously). The crate's unsafe code for batch memory is here (the [`BatchMemory`]
//! contract and the heap allocator), in `loader.rs` (samples written into a slot),
//! `host_batch.rs` (a batch read from it), and in `tensor.rs` and `cuda.rs` (the `tch`
//! allocators).

use std::alloc::Layout;
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::OnceLock;

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
    /// Checks that every region's size fits in a `usize` (the size methods below multiply
    /// without checking): a batch that does not is refused, never allocated short.
    pub fn check_sizes(&self) -> Result<(), DataError> {
        let b = self.batch_size;
        let product = |dims: &[usize]| dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let input = product(&self.layout.shape)
            .and_then(|n| n.checked_mul(b))
            .and_then(|n| n.checked_mul(self.storage.bytes()));
        let targets = product(&self.layout.target_shape)
            .and_then(|n| n.checked_mul(b))
            .and_then(|n| n.checked_mul(self.layout.target_kind.bytes()));
        let lengths = b.checked_mul(8);
        match (input, targets, lengths) {
            (Some(_), Some(_), Some(_)) => Ok(()),
            _ => Err(DataError::InvalidParameter {
                name: "batch size",
                expected: "a batch whose bytes can be addressed".to_string(),
                value: format!(
                    "{b} samples of input shape {:?} and target shape {:?}",
                    self.layout.shape, self.layout.target_shape
                ),
            }),
        }
    }

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

    /// Bytes of the input, target and length regions, as [`BatchMemory::capacities`]
    /// counts them.
    pub fn region_bytes(&self) -> [usize; 3] {
        [
            self.input_bytes(),
            self.targets_bytes(),
            self.batch_size * 8,
        ]
    }

    /// Refuses `memory` (from a [`SlotAllocator`]) if a region is smaller than this
    /// request's: workers write a whole batch into it.
    pub(crate) fn check_memory(&self, memory: &dyn BatchMemory) -> Result<(), DataError> {
        let (need, have) = (self.region_bytes(), memory.capacities());
        if need.iter().zip(&have).all(|(n, h)| h >= n) {
            return Ok(());
        }
        Err(DataError::InvalidParameter {
            name: "slot memory",
            expected: format!(
                "at least {} bytes of input, {} of targets and {} of lengths ({} samples of \
                 input shape {:?} and target shape {:?}): allocate for the request the \
                 allocator is given",
                need[0],
                need[1],
                need[2],
                self.batch_size,
                self.layout.shape,
                self.layout.target_shape
            ),
            value: format!(
                "{} bytes of input, {} of targets and {} of lengths from the slot allocator",
                have[0], have[1], have[2]
            ),
        })
    }
}

/// The memory of one ring slot: an input region of [`SlotRequest::input_bytes`] bytes, a
/// target region of [`SlotRequest::targets_bytes`] bytes and a length region of
/// `batch_size` `i64` values (each sample's length along its first axis). The loader checks
/// [`BatchMemory::capacities`] against its request before a worker writes there, so memory
/// made for another request (a [`HeapMemory`] of a smaller batch, say) is an error, not an
/// overflow.
///
/// # Safety
///
/// An implementation guarantees that the three pointers are non-null and valid for reads
/// and writes of the bytes [`BatchMemory::capacities`] reports, aligned for `i64`, stable
/// (never moved or freed) for the life of the value, and that nothing else reads or writes
/// that memory while the loader owns the value.
pub unsafe trait BatchMemory: Send + Sync + fmt::Debug {
    /// Start of the input region.
    fn input_ptr(&self) -> *mut u8;
    /// Start of the target region.
    fn targets_ptr(&self) -> *mut u8;
    /// Start of the length region.
    fn lengths_ptr(&self) -> *mut i64;
    /// Bytes of the input, target and length regions, in that order.
    fn capacities(&self) -> [usize; 3];
    /// For downcasting to the allocator's own type.
    fn as_any(&self) -> &dyn Any;
    /// Whether something outside the loader still holds this memory after its batch was
    /// given back (tensors made from a CPU batch and kept past it, such as the inputs an
    /// autograd graph saved): the ring then gives the slot new memory rather than write into
    /// memory still read. `false` by default.
    fn shared_elsewhere(&self) -> bool {
        false
    }
}

/// Makes the memory of new ring slots; called from the loader's worker threads.
pub trait SlotAllocator: Send + Sync + fmt::Debug {
    /// A slot for `request`.
    fn allocate(&self, request: &SlotRequest) -> Result<Box<dyn BatchMemory>, DataError>;
}

/// Zeroed heap memory on whole pages of its own, freed on drop.
#[derive(Debug)]
pub struct PageAligned {
    ptr: NonNull<u8>,
    layout: Layout,
}

/// The page size used where the operating system's cannot be read: the largest common one
/// (arm64 kernels with 64 KiB pages), which is also a whole number of every smaller page.
const FALLBACK_PAGE: usize = 64 << 10;

/// The operating system's page size (`sysconf(_SC_PAGESIZE)`): 4 KiB on most x86-64 and arm64
/// kernels, 16 or 64 KiB on some arm64 ones (Grace Hopper systems among them). Regions that
/// are page-locked one by one must not share a page, so slots are aligned and sized to it.
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: `sysconf` has no preconditions; it returns -1 for an unknown name.
        let raw = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(raw)
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(FALLBACK_PAGE)
    })
}

/// The layout of a region of `len` bytes on pages of `page` bytes (a power of two): whole
/// pages, at least one, starting on a page boundary.
fn region_layout(len: usize, page: usize) -> Result<Layout, DataError> {
    len.max(1)
        .checked_next_multiple_of(page)
        .and_then(|size| Layout::from_size_align(size, page).ok())
        .ok_or_else(|| DataError::InvalidParameter {
            name: "batch buffer size",
            expected: "a size the allocator can serve".to_string(),
            value: format!("{len} bytes in pages of {page} bytes"),
        })
}

impl PageAligned {
    /// `len` zeroed bytes on whole pages of the operating system's [`page_size`] (at least
    /// one page is reserved for `len == 0`).
    pub fn zeroed(len: usize) -> Result<Self, DataError> {
        Self::zeroed_on_pages(len, page_size())
    }

    /// `len` zeroed bytes on whole pages of `page` bytes (a power of two).
    pub(crate) fn zeroed_on_pages(len: usize, page: usize) -> Result<Self, DataError> {
        let layout = region_layout(len, page)?;
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
    /// Zeroed regions sized for `request`, each on pages of its own ([`page_size`]).
    pub fn new(request: &SlotRequest) -> Result<Self, DataError> {
        Self::on_pages(request, page_size())
    }

    /// As [`HeapMemory::new`], on pages of `page` bytes.
    pub(crate) fn on_pages(request: &SlotRequest, page: usize) -> Result<Self, DataError> {
        request.check_sizes()?;
        Ok(Self {
            input: PageAligned::zeroed_on_pages(request.input_bytes(), page)?,
            targets: PageAligned::zeroed_on_pages(request.targets_bytes(), page)?,
            lengths: PageAligned::zeroed_on_pages(request.batch_size * 8, page)?,
        })
    }
}

// SAFETY: the three regions are owned page-aligned allocations of the capacities reported,
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

    fn capacities(&self) -> [usize; 3] {
        [&self.input, &self.targets, &self.lengths].map(PageAligned::capacity)
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

    fn request() -> SlotRequest {
        SlotRequest {
            batch_size: 3,
            layout: SampleLayout::new([3, 5, 5], [8]),
            storage: Storage::F32,
        }
    }

    /// The page size is the system's, as `getconf` reports it (a constant 4096 would pass
    /// every other test on a 4 KiB machine and break on a 64 KiB one).
    #[test]
    fn the_page_size_is_the_systems() {
        let Ok(out) = std::process::Command::new("getconf")
            .arg("PAGESIZE")
            .output()
        else {
            eprintln!("skipped: no getconf");
            return;
        };
        let reported: usize = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        assert_eq!(page_size(), reported);
    }

    /// A batch whose bytes overflow `usize` is refused, not allocated short.
    #[test]
    fn a_batch_too_large_to_address_is_refused() {
        let huge = SlotRequest {
            batch_size: 1 << 29,
            layout: SampleLayout::new([1 << 33], [8]),
            storage: Storage::F32,
        };
        let e = HeapMemory::new(&huge).map(|_| ()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid batch size: expected a batch whose bytes can be addressed, found \
             536870912 samples of input shape [8589934592] and target shape [8]"
        );
        assert!(request().check_sizes().is_ok());
    }

    #[test]
    fn heap_slots_are_page_aligned_zeroed_and_sized() {
        let request = request();
        assert_eq!(request.input_bytes(), 3 * 75 * 4);
        assert_eq!(request.targets_len(), 24);
        assert_eq!(request.targets_bytes(), 96);
        let page = page_size();
        assert!(page.is_power_of_two() && page >= 4096, "page size {page}");
        let m = HeapMemory::new(&request).unwrap();
        assert_eq!(m.input_ptr() as usize % page, 0);
        assert_eq!(m.targets_ptr() as usize % page, 0);
        assert_eq!(m.lengths_ptr() as usize % page, 0);
        assert_eq!(m.input.capacity(), page);
        // SAFETY: the region holds `input_bytes` initialised (zeroed) bytes.
        let bytes = unsafe { std::slice::from_raw_parts(m.input_ptr(), request.input_bytes()) };
        assert!(bytes.iter().all(|&b| b == 0));
    }

    /// On a kernel with 64 KiB pages every region still starts on a page of its own and
    /// covers whole pages, so no two regions share a page (`cudaHostRegister` of the second
    /// would fail) and none ends inside a page another allocation may use.
    #[test]
    fn regions_take_whole_pages_of_64_kib() {
        const PAGE: usize = 64 << 10;
        for (len, size) in [
            (0, PAGE),
            (1, PAGE),
            (4096, PAGE),
            (PAGE, PAGE),
            (PAGE + 1, 2 * PAGE),
            (3 * 224 * 224 * 64, 147 * PAGE),
        ] {
            let layout = region_layout(len, PAGE).unwrap();
            assert_eq!((layout.size(), layout.align()), (size, PAGE), "{len} bytes");
        }
        assert!(matches!(
            region_layout(usize::MAX - 5, PAGE),
            Err(DataError::InvalidParameter {
                name: "batch buffer size",
                ..
            })
        ));
        let m = HeapMemory::on_pages(&request(), PAGE).unwrap();
        let mut pages: Vec<(usize, usize)> = [&m.input, &m.targets, &m.lengths]
            .iter()
            .map(|r| {
                let start = r.as_ptr() as usize;
                assert_eq!(start % PAGE, 0);
                assert_eq!(r.capacity(), PAGE);
                (start / PAGE, (start + r.capacity()) / PAGE)
            })
            .collect();
        pages.sort();
        assert!(
            pages.windows(2).all(|w| w[0].1 <= w[1].0),
            "regions share a page: {pages:?}"
        );
    }
}
