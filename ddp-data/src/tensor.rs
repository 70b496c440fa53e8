//! The tch edge: [`Loader`] and its [`Batch`]es of tensors on the training device.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};

use rustix::fs::{fallocate, fcntl_add_seals, memfd_create, FallocateFlags, MemfdFlags, SealFlags};
use tch::{Device, Kind, Tensor};

use crate::cuda::{CopyEvents, PinnedAllocator};
use crate::dataset::Dataset;
use crate::error::DataError;
use crate::host_batch::{BatchIndices, HostBatch};
use crate::loader::{HostLoader, LoaderConfig};
use crate::memory::{BatchMemory, SlotAllocator, SlotRequest};
use crate::ring::ReuseHook;
use crate::sample::{Storage, ValueKind};

/// One batch as tensors on the loader's device.
#[derive(Debug)]
pub struct Batch {
    inputs: Tensor,
    targets: Tensor,
    lengths: Option<Tensor>,
    indices: BatchIndices,
    /// CPU batches are views of their ring slot, held until the batch drops (declared last,
    /// so the views drop first).
    _lease: Option<HostBatch>,
}

impl Batch {
    /// `[B, ...shape]` inputs of the layout's kind (for images: `f32` `[B, 3, H, W]` in
    /// [0, 1], or normalised). For a padded layout the first sample axis is the batch's
    /// padded length ([`PadTo`](crate::PadTo)), padding positions hold the padding
    /// value, and the tensor may be a non-contiguous view.
    pub fn inputs(&self) -> &Tensor {
        &self.inputs
    }

    /// `[B, ...target_shape]` targets of the layout's kind (for ODIR: `f32` `[B, 8]`
    /// multi-hot labels in N, D, G, C, A, H, M, O order; `i64` `[B]` class indices for a
    /// layout with scalar `i64` targets).
    pub fn targets(&self) -> &Tensor {
        &self.targets
    }

    /// `[B]` `i64` lengths of the samples along the input's first axis, for padded layouts.
    pub fn lengths(&self) -> Option<&Tensor> {
        self.lengths.as_ref()
    }

    /// `[B, L]` boolean mask of the positions that are not padding (`true` for a sample's
    /// own positions), for padded layouts: `arange(L) < lengths[:, None]`.
    pub fn mask(&self) -> Option<Tensor> {
        let lengths = self.lengths.as_ref()?;
        let l = self.inputs.size().get(1).copied().unwrap_or(0);
        let positions = Tensor::arange(l, (Kind::Int64, lengths.device()));
        Some(positions.unsqueeze(0).lt_tensor(&lengths.unsqueeze(1)))
    }

    /// The data-set index of each sample, in batch order.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether the batch holds no samples (never the case for a batch a loader yields).
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }
}

/// A ring slot made of three CPU tensors (`[B, ...shape]` inputs, `[B, ...target_shape]`
/// targets and `[B]` lengths), so that a batch can be handed out as views of it.
#[derive(Debug)]
struct TensorMemory {
    // `Tensor` is `Send` but not `Sync`; the ring shares slots between threads, which only
    // use the raw pointers below. The consumer locks to make views.
    inputs: Mutex<Tensor>,
    targets: Mutex<Tensor>,
    lengths: Mutex<Tensor>,
    input_ptr: *mut u8,
    targets_ptr: *mut u8,
    lengths_ptr: *mut i64,
    capacities: [usize; 3],
}

// SAFETY: the tensors are behind mutexes; the raw pointers address their storage, which is
// owned by the tensors and never reallocated: libtorch refuses to resize it
// (`unresizable_zeros`).
unsafe impl Send for TensorMemory {}
// SAFETY: as above.
unsafe impl Sync for TensorMemory {}

// SAFETY: the pointers address the contiguous storages of the three tensors, of the bytes
// `capacities` reports (`[B, ...shape]` of the storage's kind, `[B, ...target_shape]` of the
// target kind and `[B]` i64), alive and unmoved as long as this value (mappings libtorch
// cannot resize, page-aligned); a tensor without elements has a null data pointer, and a
// dangling aligned pointer for its zero bytes instead (`region`).
unsafe impl BatchMemory for TensorMemory {
    fn input_ptr(&self) -> *mut u8 {
        self.input_ptr
    }

    fn targets_ptr(&self) -> *mut u8 {
        self.targets_ptr
    }

    fn lengths_ptr(&self) -> *mut i64 {
        self.lengths_ptr
    }

    fn capacities(&self) -> [usize; 3] {
        self.capacities
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// A batch's views of the slot are gone once it is given back: a count above this
    /// value's own handle is a tensor made from them that outlives the batch.
    fn shared_elsewhere(&self) -> bool {
        [&self.inputs, &self.targets, &self.lengths]
            .iter()
            .any(|t| tch_ext::storage_use_count(&lock(t)).map_or(true, |n| n > 1))
    }
}

fn lock(t: &Mutex<Tensor>) -> MutexGuard<'_, Tensor> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

fn kind_of(storage: Storage) -> Kind {
    match storage {
        Storage::U8 => Kind::Uint8,
        Storage::F32 => Kind::Float,
        Storage::I64 => Kind::Int64,
    }
}

fn target_kind(kind: ValueKind) -> Kind {
    match kind {
        ValueKind::F32 => Kind::Float,
        ValueKind::I64 => Kind::Int64,
    }
}

fn dims(len: usize, shape: &[usize]) -> Vec<i64> {
    std::iter::once(len)
        .chain(shape.iter().copied())
        .map(|d| d as i64)
        .collect()
}

/// The length a padded batch's inputs are cut to along the first sample axis; `None` for a
/// layout without padding.
fn padded_len(host: &HostBatch) -> Option<usize> {
    host.layout().padding.map(|_| host.padded_len())
}

/// Sets the positions of `inputs` (`[B, L, ...]`) at or past each sample's length
/// (`lengths`, `[B]`, on the same device) to `value`, in place, on their device.
fn fill_padding(inputs: &mut Tensor, lengths: &Tensor, value: f64) -> Result<(), DataError> {
    let size = inputs.size();
    let positions = Tensor::f_arange(size[1], (Kind::Int64, inputs.device()))?;
    // `[B, L]`, then `[B, L, 1, ...]` to broadcast over each position's values.
    let mut mask_shape = vec![1i64; size.len()];
    mask_shape[..2].copy_from_slice(&size[..2]);
    let padding = positions
        .f_unsqueeze(0)?
        .f_ge_tensor(&lengths.f_unsqueeze(1)?)?
        .f_reshape(mask_shape.as_slice())?;
    // The returned tensor is `inputs` itself.
    let _ = inputs.f_masked_fill_(&padding, value)?;
    Ok(())
}

/// The start and bytes of a new contiguous tensor's data. A tensor without elements has a
/// null data pointer, which no slice may start at: a dangling pointer aligned for `i64`
/// takes its place, valid for its zero bytes.
fn region(t: &Tensor) -> (*mut u8, usize) {
    let bytes = t.numel() * t.kind().elt_size_in_bytes();
    let ptr = t.data_ptr().cast::<u8>();
    if bytes == 0 || ptr.is_null() {
        (std::ptr::NonNull::<i64>::dangling().as_ptr().cast(), 0)
    } else {
        (ptr, bytes)
    }
}

/// A zeroed CPU tensor of `dims` whose storage libtorch cannot resize, so that the memory
/// the workers write through never moves: a `resize_` (or an `out=` operation) of any view
/// of it past its bytes fails with "Trying to resize storage that is not resizable", where a
/// resizable storage would get a new buffer and free the old one under the workers.
///
/// The memory is an anonymous `memfd` sized and allocated here (so that running out of
/// memory is this error, not a `SIGBUS` at a worker's first write), sealed against resizing,
/// and mapped shared by `Tensor::from_file` through `/proc/self/fd`: libtorch's storage owns
/// the mapping (unmapped when its last tensor goes, so tensors kept past their batch stay
/// valid) and marks it not resizable. At least one element is mapped, as no empty file can be.
fn unresizable_zeros(dims: &[i64], kind: Kind) -> Result<Tensor, DataError> {
    let numel: i64 = dims.iter().product();
    let elements = numel.max(1);
    let bytes = elements as usize * kind.elt_size_in_bytes();
    let slot_memory = |source: rustix::io::Errno| DataError::SlotMemory {
        bytes,
        source: source.into(),
    };
    let fd = memfd_create(
        "ddp-data-slot",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(slot_memory)?;
    fallocate(&fd, FallocateFlags::empty(), 0, bytes as u64).map_err(slot_memory)?;
    fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
        .map_err(slot_memory)?;
    // libtorch opens the file again and maps it; `fd` is closed when it drops.
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let mut mapped = map_shared(&path, elements, kind)?;
    // Shaped in place, not as a view: a view keeps its base, a second user of the storage
    // that `shared_elsewhere` would count against every slot.
    let _ = mapped.f_resize_(dims)?;
    Ok(mapped)
}

/// Maps `elements` of `kind` from the file at `path`, shared, as a CPU tensor. A failure is
/// the slot's memory that could not be had (no `/proc`, the process's map count at
/// `vm.max_map_count`, an address space limit), with libtorch's reason as its source.
fn map_shared(path: &str, elements: i64, kind: Kind) -> Result<Tensor, DataError> {
    Tensor::f_from_file(path, true, elements, (kind, Device::Cpu)).map_err(|e| {
        DataError::SlotMemory {
            bytes: elements as usize * kind.elt_size_in_bytes(),
            source: std::io::Error::other(e),
        }
    })
}

/// Allocates slots as CPU tensors that cannot be resized ([`unresizable_zeros`]).
#[derive(Debug, Clone, Copy, Default)]
struct TensorAllocator;

impl SlotAllocator for TensorAllocator {
    fn allocate(&self, request: &SlotRequest) -> Result<Box<dyn BatchMemory>, DataError> {
        let b = request.batch_size;
        let inputs = unresizable_zeros(&dims(b, &request.layout.shape), kind_of(request.storage))?;
        let targets = unresizable_zeros(
            &dims(b, &request.layout.target_shape),
            target_kind(request.layout.target_kind),
        )?;
        let lengths = unresizable_zeros(&[b as i64], Kind::Int64)?;
        let (input_ptr, input_bytes) = region(&inputs);
        let (targets_ptr, targets_bytes) = region(&targets);
        let (lengths_ptr, lengths_bytes) = region(&lengths);
        Ok(Box::new(TensorMemory {
            input_ptr,
            targets_ptr,
            lengths_ptr: lengths_ptr.cast(),
            capacities: [input_bytes, targets_bytes, lengths_bytes],
            inputs: Mutex::new(inputs),
            targets: Mutex::new(targets),
            lengths: Mutex::new(lengths),
        }))
    }
}

/// The device side of `byte * scale + bias`.
#[derive(Debug)]
struct DeviceAffine {
    scale: Tensor,
    bias: Option<Tensor>,
}

impl DeviceAffine {
    /// `inputs` (`[B, ...shape]` bytes) as `f32`, on their device.
    fn apply(&self, inputs: &Tensor) -> Result<Tensor, DataError> {
        // Multiplication, then addition: two roundings, as `Affine::apply` does on the host.
        let scaled = inputs.f_to_kind(Kind::Float)?.f_mul(&self.scale)?;
        Ok(match &self.bias {
            Some(bias) => scaled.f_add(bias)?,
            None => scaled,
        })
    }
}

/// The batch loader: one epoch of `indices` of a [`Dataset`] as [`Batch`]es of tensors on a
/// device, in index order.
///
/// ```no_run
/// # #[cfg(feature = "odir")]
/// # fn main() -> Result<(), ddp_data::DataError> {
/// use std::sync::Arc;
/// use ddp_data::{Loader, LoaderConfig};
/// use ddp_data::odir::{OdirDataset, OdirImages, OdirOptions};
/// use ddp_data::odir::transform::Transform;
/// let set = Arc::new(OdirDataset::open("data/odir".as_ref(), &OdirOptions::default())?);
/// let indices: Vec<usize> = (0..set.len()).collect();
/// let images = OdirImages::new(set, Transform::train(224));
/// let config = LoaderConfig { epoch: 3, ..LoaderConfig::new(32) };
/// for batch in Loader::on_device(images, indices, &config, tch::Device::Cuda(0))? {
///     let batch = batch?;
///     assert_eq!(batch.inputs().size()[1..], [3, 224, 224]);
/// }
/// # Ok(())
/// # }
/// # #[cfg(not(feature = "odir"))]
/// # fn main() {}
/// ```
///
/// Each batch is handed out as tensors on the training device without copying or allocating
/// anything on the host for it.
///
/// **CPU.** The ring's slots are CPU tensors; workers write final `f32` values into them, and
/// a [`Batch`]'s inputs and targets are views of its slot. The batch holds the slot until it
/// is dropped, and is then refilled with a later batch, unless tensors made from the batch
/// still hold its memory (views kept, inputs an autograd graph saved): that slot then gets
/// new memory, and the kept tensors keep their values. The slots' storage cannot be resized:
/// growing a batch's tensor in place (`resize_`, an `out=` operation) fails, after libtorch
/// has changed that tensor's shape: drop it, never use it again. Copy it before resizing.
///
/// **CUDA.** The slots are page-locked once, when first allocated, and hold bytes (a quarter
/// of the `f32` size) when the data set can write bytes. Taking a batch issues its
/// host-to-device copies with `non_blocking`, records an event behind them and returns the
/// slot to the ring at once (with a hook that waits for the event, even when a copy failed);
/// the worker that next takes the slot waits for that event before writing, and dropping the
/// loader waits for it before the slot is freed. The ring hands out the slot given back
/// longest ago, whose copy has usually completed, and the wait holds no lock, so while one
/// worker waits for the GPU the others keep decoding into other slots. Conversion to `f32`
/// (`byte * scale + bias`, per channel, as the data set's [`Affine`](crate::Affine) says), and
/// for a padded layout the padding value at the padding positions, is queued on the device
/// behind the copy. Nothing waits for the GPU on the training thread.
///
/// **Ordering relied on.** libtorch queues every copy and kernel of a device on the calling
/// thread's current stream of that device: the legacy default stream (`cudaStream_t` null)
/// unless the program made another current (tch-ext's `set_current_stream`). The copies and
/// the conversion are queued on the current stream of the thread that calls
/// [`Iterator::next`], and the slot's event is recorded on that same stream right after the
/// copies, so it completes exactly when they have, whichever stream it is. The training step
/// that reads the batch must run on that stream too: the current stream of the thread that
/// calls [`Iterator::next`]. Making another stream wait for it is not enough: the batch's
/// tensors are allocated by libtorch's caching allocator on that stream, and when they are
/// freed the allocator may hand their memory to the next batch's copies on that stream at
/// once, while the other stream still reads them (PyTorch's `record_stream` exists for that
/// pattern; this loader offers none). Taking the next batch before the current step ends
/// (the `ddp-train` trainer takes it right after the backward pass, while the gradients are
/// averaged) puts its copy in the queue ahead of the rest of the step, so the GPU does not
/// wait for the host to start it.
#[derive(Debug)]
pub struct Loader<D: Dataset> {
    // Declared first so that it drops (joining the workers, the only threads that wait on
    // copy events) before `events`.
    host: HostLoader<D>,
    device: Device,
    events: Option<CopyEvents>,
    affine: Option<DeviceAffine>,
}

impl<D: Dataset> Loader<D> {
    /// Batches as CPU tensors: final values (`f32` or `i64`, as the layout says) written by
    /// the workers, handed out as views.
    pub fn new(dataset: D, indices: Vec<usize>, config: &LoaderConfig) -> Result<Self, DataError> {
        let storage = Storage::of(dataset.layout().input_kind);
        Self::with_storage(dataset, indices, config, Device::Cpu, storage)
    }

    /// Batches on `device`: on the CPU as [`Loader::new`]; on a CUDA device through
    /// page-locked byte slots (`f32` slots for data sets that write no bytes), copied
    /// asynchronously and converted on the device.
    pub fn on_device(
        dataset: D,
        indices: Vec<usize>,
        config: &LoaderConfig,
        device: Device,
    ) -> Result<Self, DataError> {
        let layout = dataset.layout();
        let storage = match device {
            Device::Cuda(_) if layout.bytes.is_some() => Storage::U8,
            _ => Storage::of(layout.input_kind),
        };
        Self::with_storage(dataset, indices, config, device, storage)
    }

    /// Batches on `device` with the slots' element type chosen by the caller
    /// ([`Storage::U8`] on the CPU converts on the training thread; useful to check that the
    /// conversion gives exactly the workers' values).
    pub fn with_storage(
        dataset: D,
        indices: Vec<usize>,
        config: &LoaderConfig,
        device: Device,
        storage: Storage,
    ) -> Result<Self, DataError> {
        let layout = dataset.layout();
        // Before the affine map becomes tensors: a map of the wrong size is this error.
        layout.check(storage)?;
        let (allocator, events): (Arc<dyn SlotAllocator>, _) = match device {
            Device::Cuda(d) => {
                let events = CopyEvents::new(d as i32)?;
                events.make_current()?;
                (Arc::new(PinnedAllocator { device: d as i32 }), Some(events))
            }
            _ => (Arc::new(TensorAllocator), None),
        };
        let affine = match (&layout.bytes, storage) {
            (Some(a), Storage::U8) => {
                // `[1, channels, 1, ...]` against `[B, ...shape]` inputs; `[1]` for scalar
                // samples (`[B]` inputs, one channel).
                let mut shape = vec![1i64; layout.shape.len() + 1];
                if let Some(channels) = shape.get_mut(1) {
                    *channels = a.scale.len() as i64;
                }
                let scale = Tensor::f_from_slice(&a.scale)?
                    .f_view(shape.as_slice())?
                    .f_to_device(device)?;
                let bias = if a.has_bias() {
                    Some(
                        Tensor::f_from_slice(&a.bias)?
                            .f_view(shape.as_slice())?
                            .f_to_device(device)?,
                    )
                } else {
                    None
                };
                Some(DeviceAffine { scale, bias })
            }
            _ => None,
        };
        let host = HostLoader::with_storage(dataset, indices, config, storage, allocator)?;
        Ok(Self {
            host,
            device,
            events,
            affine,
        })
    }

    /// The device batches are on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Number of batches this epoch yields.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether the epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The tch-free loader underneath.
    pub fn host(&self) -> &HostLoader<D> {
        &self.host
    }

    /// A batch's final inputs from its slot's `[B, ...shape]` inputs (at the maximum length
    /// for a padded layout), on the batch's device. Bytes are converted over the full width,
    /// since a map per position of the first axis spans the maximum length; their padding
    /// positions are then set to the padding value, since the byte the workers put there is
    /// only a placeholder (the value need not be a byte, and the map would move it). Last,
    /// a padded batch is cut to its `padded_len` (a view).
    fn finish_inputs(
        &self,
        inputs: Tensor,
        lengths: Option<&Tensor>,
        padded_len: Option<usize>,
    ) -> Result<Tensor, DataError> {
        let mut inputs = inputs;
        if let Some(affine) = &self.affine {
            inputs = affine.apply(&inputs)?;
            if let (Some(padding), Some(lengths)) = (self.host.layout().padding, lengths) {
                fill_padding(&mut inputs, lengths, padding.value)?;
            }
        }
        Ok(match padded_len {
            Some(l) => inputs.f_narrow(1, 0, l as i64)?,
            None => inputs,
        })
    }

    fn cpu_batch(&self, host: HostBatch) -> Result<Batch, DataError> {
        let len = host.len() as i64;
        let memory = host
            .memory()
            .as_any()
            .downcast_ref::<TensorMemory>()
            .ok_or(DataError::InvalidParameter {
                name: "batch memory",
                expected: "a slot made by the tch loader".to_string(),
                value: "another allocator's slot".to_string(),
            })?;
        let inputs = lock(&memory.inputs).f_narrow(0, 0, len)?;
        let mut targets = lock(&memory.targets).f_narrow(0, 0, len)?;
        let mut lengths = match host.layout().padding {
            Some(_) => Some(lock(&memory.lengths).f_narrow(0, 0, len)?),
            None => None,
        };
        let mut inputs = self.finish_inputs(inputs, lengths.as_ref(), padded_len(&host))?;
        if self.device != Device::Cpu {
            // A device with neither zero-copy nor pinned staging (MPS, Vulkan): copy.
            inputs = inputs.f_to_device(self.device)?;
            targets = targets.f_to_device(self.device)?;
            lengths = lengths.map(|l| l.f_to_device(self.device)).transpose()?;
        }
        Ok(Batch {
            inputs,
            targets,
            lengths,
            indices: host.index_list(),
            _lease: Some(host),
        })
    }

    fn cuda_batch(&mut self, host: HostBatch) -> Result<Batch, DataError> {
        let events = self.events.as_mut().ok_or(DataError::InvalidParameter {
            name: "loader device",
            expected: "copy events for a CUDA loader".to_string(),
            value: format!("{:?}", self.device),
        })?;
        events.make_current()?;
        let copies = copy_to(&host, self.device);
        let padded_len = padded_len(&host);
        let ((inputs, targets, lengths), indices) =
            hand_back(host, copies, |slot| match events.record(slot) {
                Ok(hook) => (hook, None),
                Err(e) => (events.device_wait(), Some(e)),
            })?;
        Ok(Batch {
            inputs: self.finish_inputs(inputs, lengths.as_ref(), padded_len)?,
            targets,
            lengths,
            indices,
            _lease: None,
        })
    }
}

/// Gives a slot whose device copies were queued (all, or the first few before one failed)
/// back to the ring with the hook `hook` makes for it, and returns the copies and the
/// batch's indices. The slot never goes back without a hook, even when a copy failed: the
/// copies queued before it may still be reading the slot. `hook` returns the hook and the
/// error of making it (its hook then waits for more than the copies). The first error
/// wins: the copy's, then the hook's.
fn hand_back<T>(
    host: HostBatch,
    copies: Result<T, DataError>,
    hook: impl FnOnce(usize) -> (ReuseHook, Option<DataError>),
) -> Result<(T, BatchIndices), DataError> {
    let (hook, unrecorded) = hook(host.slot());
    let indices = host.index_list();
    host.release_after(hook);
    let copies = copies?;
    match unrecorded {
        Some(e) => Err(e),
        None => Ok((copies, indices)),
    }
}

/// Queues the copies of `host`'s inputs, targets and (for padded layouts) lengths from its
/// page-locked slot to `device`, asynchronously; the inputs at the layout's maximum length.
fn copy_to(
    host: &HostBatch,
    device: Device,
) -> Result<(Tensor, Tensor, Option<Tensor>), DataError> {
    let layout = host.layout();
    let shape = dims(host.len(), &layout.shape);
    let target_shape = dims(host.len(), &layout.target_shape);
    let t_kind = target_kind(layout.target_kind);
    let kind = kind_of(host.storage());
    // SAFETY: the views cover the first `len` samples of the slot's page-locked regions
    // (sized for a whole batch), which hold finished samples and stay untouched until the
    // event recorded after this call has completed (the reuse hook waits for it). The views
    // are dropped at the end of this block; only the device copies outlive it.
    let (inputs, targets, lengths) = unsafe {
        let src_in =
            Tensor::f_from_blob(host.memory().input_ptr(), &shape, &[], kind, Device::Cpu)?;
        let src_t = Tensor::f_from_blob(
            host.memory().targets_ptr(),
            &target_shape,
            &[],
            t_kind,
            Device::Cpu,
        )?;
        let inputs = src_in.f_to_device_(device, kind, true, false)?;
        let targets = src_t.f_to_device_(device, t_kind, true, false)?;
        let lengths = if layout.padding.is_some() {
            let src_l = Tensor::f_from_blob(
                host.memory().lengths_ptr().cast::<u8>(),
                &[host.len() as i64],
                &[],
                Kind::Int64,
                Device::Cpu,
            )?;
            Some(src_l.f_to_device_(device, Kind::Int64, true, false)?)
        } else {
            None
        };
        (inputs, targets, lengths)
    };
    Ok((inputs, targets, lengths))
}

impl<D: Dataset> Iterator for Loader<D> {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        let host = match self.host.next()? {
            Ok(h) => h,
            Err(e) => return Some(Err(e)),
        };
        Some(match self.device {
            Device::Cuda(_) => self.cuda_batch(host),
            _ => self.cpu_batch(host),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::tensor_dataset::{Array, TensorDataset};

    const SAMPLES: usize = 8;

    /// One sample per batch, one worker and one batch of prefetch: the ring grows to three
    /// slots, then refills the slot given back longest ago.
    fn loader() -> HostLoader<TensorDataset> {
        let inputs = Array::new(
            (0..SAMPLES).map(|i| i as f32).collect::<Vec<_>>(),
            [SAMPLES, 1],
        )
        .unwrap();
        let targets = Array::new(vec![0f32; SAMPLES], [SAMPLES, 1]).unwrap();
        let config = LoaderConfig {
            workers: 1,
            prefetch: 1,
            ..LoaderConfig::new(1)
        };
        HostLoader::new(
            TensorDataset::new(inputs, targets).unwrap(),
            (0..SAMPLES).collect(),
            &config,
        )
        .unwrap()
    }

    #[test]
    fn a_slot_that_cannot_be_mapped_is_a_slot_memory_error() {
        let err = map_shared("/proc/self/fd/not-a-descriptor", 16, Kind::Float).unwrap_err();
        match err {
            DataError::SlotMemory { bytes, source } => {
                assert_eq!(bytes, 64);
                assert!(
                    source.to_string().contains("not-a-descriptor"),
                    "libtorch's reason names the file: {source}"
                );
            }
            other => panic!("expected SlotMemory, got {other:?}"),
        }
    }

    fn failure(name: &'static str) -> DataError {
        DataError::InvalidParameter {
            name,
            expected: "a test's success".into(),
            value: "its failure".into(),
        }
    }

    /// A hook that counts its runs in `runs`.
    fn counting(runs: &Arc<AtomicUsize>) -> ReuseHook {
        let runs = Arc::clone(runs);
        Box::new(move || {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
    }

    /// Takes the rest of the epoch's batches (so every slot is refilled at least once) and
    /// returns their first values.
    fn drain(loader: &mut HostLoader<TensorDataset>) -> Vec<usize> {
        loader
            .by_ref()
            .map(|b| b.unwrap().index_list()[0])
            .collect()
    }

    /// A copy fails after earlier copies of the slot were queued: the batch fails with the
    /// copy's error, and the slot still goes back with its hook, which runs before a worker
    /// writes into the slot again.
    #[test]
    fn a_failed_copy_gives_the_slot_back_with_its_hook() {
        let mut loader = loader();
        let runs = Arc::new(AtomicUsize::new(0));
        let first = loader.next().unwrap().unwrap();
        let err =
            hand_back::<()>(first, Err(failure("copy")), |_| (counting(&runs), None)).unwrap_err();
        assert!(
            matches!(err, DataError::InvalidParameter { name: "copy", .. }),
            "{err:?}"
        );
        assert_eq!(drain(&mut loader), (1..SAMPLES).collect::<Vec<_>>());
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "the slot was refilled without waiting for the copies queued before the failure"
        );
    }

    /// The copies were queued but their event could not be recorded: the batch fails with
    /// the recording's error, and the slot goes back with the fallback hook.
    #[test]
    fn an_unrecorded_event_fails_the_batch_and_keeps_the_fallback_hook() {
        let mut loader = loader();
        let runs = Arc::new(AtomicUsize::new(0));
        let first = loader.next().unwrap().unwrap();
        let slot = first.slot();
        let mut asked = None;
        let err = hand_back(first, Ok(7), |s| {
            asked = Some(s);
            (counting(&runs), Some(failure("event")))
        })
        .unwrap_err();
        assert_eq!(asked, Some(slot));
        assert!(
            matches!(err, DataError::InvalidParameter { name: "event", .. }),
            "{err:?}"
        );
        assert_eq!(drain(&mut loader), (1..SAMPLES).collect::<Vec<_>>());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    /// Both failed: the copy's error is the one reported.
    #[test]
    fn the_copy_error_is_reported_before_the_event_error() {
        let mut loader = loader();
        let runs = Arc::new(AtomicUsize::new(0));
        let first = loader.next().unwrap().unwrap();
        let err = hand_back::<()>(first, Err(failure("copy")), |_| {
            (counting(&runs), Some(failure("event")))
        })
        .unwrap_err();
        assert!(
            matches!(err, DataError::InvalidParameter { name: "copy", .. }),
            "{err:?}"
        );
        drain(&mut loader);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    /// On success the copies and the batch's indices come back, and the hook is attached.
    #[test]
    fn a_queued_copy_returns_its_tensors_and_indices() {
        let mut loader = loader();
        let runs = Arc::new(AtomicUsize::new(0));
        let first = loader.next().unwrap().unwrap();
        let (copies, indices) =
            hand_back(first, Ok("copies"), |_| (counting(&runs), None)).unwrap();
        assert_eq!(copies, "copies");
        assert_eq!(&indices[..], &[0]);
        drain(&mut loader);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
