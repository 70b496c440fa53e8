//! The tch edge: [`Loader`] wraps [`HostLoader`] and turns each [`HostBatch`] into CPU
//! tensors, pinned when the consumer will copy them to a GPU.

use std::sync::Arc;

use tch::{Device, Tensor};

use crate::dataset::OdirDataset;
use crate::error::DataError;
use crate::loader::{HostBatch, HostLoader, LoaderConfig};
use crate::transform::Transform;

/// One batch as tensors on the CPU.
#[derive(Debug)]
pub struct Batch {
    /// `[B, 3, H, W]` f32 in [0, 1] (or normalised).
    pub images: Tensor,
    /// `[B, 8]` f32 multi-hot labels in N, D, G, C, A, H, M, O order.
    pub labels: Tensor,
    /// The data-set index of each sample, in batch order.
    pub indices: Vec<usize>,
}

impl Batch {
    /// Converts host buffers to tensors; `pin_for` pins them for fast copies to that CUDA
    /// device (ignored for the CPU).
    pub fn from_host(batch: &HostBatch, pin_for: Option<Device>) -> Result<Self, DataError> {
        let b = batch.len() as i64;
        let s = i64::from(batch.size);
        let mut images = Tensor::f_from_slice(&batch.images)?.f_view([b, 3, s, s])?;
        let mut labels = Tensor::f_from_slice(&batch.labels)?.f_view([b, 8])?;
        if let Some(device @ Device::Cuda(_)) = pin_for {
            images = images.f_pin_memory(device)?;
            labels = labels.f_pin_memory(device)?;
        }
        Ok(Self {
            images,
            labels,
            indices: batch.indices.clone(),
        })
    }
}

/// The batch loader: one epoch of `indices` as [`Batch`]es of tensors, in index order.
///
/// ```no_run
/// use std::sync::Arc;
/// use ddp_data::{Loader, LoaderConfig, OdirDataset, OdirOptions, Transform};
/// let ds = Arc::new(OdirDataset::open("data/odir".as_ref(), &OdirOptions::default())?);
/// let indices: Vec<usize> = (0..ds.len()).collect();
/// let config = LoaderConfig { epoch: 3, ..LoaderConfig::new(32) };
/// for batch in Loader::new(ds, indices, Transform::train(224), &config)? {
///     let batch = batch?;
///     assert_eq!(batch.images.size()[1..], [3, 224, 224]);
/// }
/// # Ok::<(), ddp_data::DataError>(())
/// ```
#[derive(Debug)]
pub struct Loader {
    host: HostLoader,
    pin_for: Option<Device>,
}

impl Loader {
    /// Starts the workers; see [`HostLoader::new`].
    pub fn new(
        dataset: Arc<OdirDataset>,
        indices: Vec<usize>,
        transform: Transform,
        config: &LoaderConfig,
    ) -> Result<Self, DataError> {
        Ok(Self {
            host: HostLoader::new(dataset, indices, transform, config)?,
            pin_for: None,
        })
    }

    /// Pins every batch's memory for copies to `device` when it is a CUDA device.
    pub fn pin_memory_for(mut self, device: Device) -> Self {
        self.pin_for = match device {
            Device::Cuda(_) => Some(device),
            _ => None,
        };
        self
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
    pub fn host(&self) -> &HostLoader {
        &self.host
    }
}

impl Iterator for Loader {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        let host = self.host.next()?;
        Some(host.and_then(|b| Batch::from_host(&b, self.pin_for)))
    }
}
