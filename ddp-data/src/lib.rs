//! ODIR-5K data for the data-parallel trainer: annotations, decoding, torchvision-exact
//! augmentation, a parallel batch loader, and a synthetic sample to train on without the real
//! data.
//!
//! The central types:
//!
//! - [`OdirDataset`] opens a folder in either ODIR layout (`full_df.csv` or the challenge
//!   workbook), checks every image exists, and lists samples (path, patient, 8 labels).
//! - [`Transform`] is `RandomResizedCrop` (+ flip) or `Resize` + `CenterCrop`, then `ToTensor`
//!   and optional `Normalize`, with crop boxes drawn exactly as torchvision draws them.
//! - [`HostLoader`] (always) and [`Loader`] (feature `tch`) load one rank's indices of any
//!   [`Dataset`] in batches on worker threads, each writing its samples straight into a ring
//!   of reusable batch buffers; the random draws of sample `i` in epoch `e` come from
//!   `(seed, e, i)` only, so batches are identical whatever the number of workers. The tch
//!   loader hands CPU batches out as views of their buffer and sends CUDA batches as bytes
//!   from page-locked buffers, copied asynchronously and converted on the device.
//!   [`OdirImages`] is ODIR as a `Dataset`.
//!
//! [`synthetic::generate`] writes a learnable ODIR-like folder, and [`split_by_patient`]
//! makes a leak-free train/validation split.
//!
//! Features: `odir` (default) is everything ODIR-specific above (annotations, decoding,
//! transforms, the split, the synthetic sample) and the image and spreadsheet crates it needs;
//! `tch` (default) adds [`Loader`] and [`Batch`]. With neither, the crate is the generic
//! loader ([`Dataset`], [`HostLoader`], [`memory`], [`rng`]) for any data set.
//!
//! ```
//! # #[cfg(feature = "odir")]
//! # fn main() -> Result<(), ddp_data::DataError> {
//! use std::sync::Arc;
//! use ddp_data::synthetic::{generate, SyntheticConfig};
//! use ddp_data::{
//!     split_by_patient, HostLoader, LoaderConfig, OdirDataset, OdirImages, OdirOptions, Transform,
//! };
//!
//! let dir = std::env::temp_dir().join(format!("ddp-data-doctest-{}", std::process::id()));
//! generate(&dir, &SyntheticConfig { images: 12, size: 64, ..SyntheticConfig::default() })?;
//! let ds = Arc::new(OdirDataset::open(&dir, &OdirOptions::default())?);
//! let split = split_by_patient(&ds, 0.5, 7)?;
//! let config = LoaderConfig { drop_last: true, workers: 2, ..LoaderConfig::new(2) };
//! let images = OdirImages::new(ds.clone(), Transform::train(32));
//! let loader = HostLoader::new(images, split.train, &config)?;
//! for batch in loader {
//!     let batch = batch?;
//!     assert_eq!(batch.input_f32().unwrap().len(), 2 * 3 * 32 * 32);
//!     assert_eq!(batch.targets_f32().unwrap().len(), 2 * 8);
//! }
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "odir"))]
//! # fn main() {}
//! ```
#![warn(missing_docs)]

#[cfg(feature = "odir")]
pub mod annotations;
pub mod crop;
#[cfg(feature = "tch")]
mod cuda;
#[cfg(feature = "odir")]
pub mod dataset;
#[cfg(feature = "odir")]
pub mod decode;
mod error;
#[cfg(feature = "odir")]
pub mod images;
pub mod item;
pub mod loader;
pub mod memory;
pub mod rng;
pub mod sample;
#[cfg(feature = "odir")]
mod scaled_jpeg;
#[cfg(feature = "odir")]
pub mod split;
#[cfg(feature = "odir")]
pub mod synthetic;
#[cfg(feature = "tch")]
pub mod tensor;
pub mod tensor_dataset;
#[cfg(feature = "odir")]
pub mod transform;

#[cfg(feature = "odir")]
pub use annotations::{LabelMode, LabelSource, LABELS, LABEL_NAMES};
#[cfg(feature = "odir")]
pub use dataset::{Layout, OdirDataset, OdirOptions, Sample, SkippedImage};
pub use error::DataError;
#[cfg(feature = "odir")]
pub use images::OdirImages;
pub use item::{Item, MapDataset, Values, ValuesRef};
pub use loader::{
    default_workers, BatchIndices, HostBatch, HostLoader, InputRef, LoaderConfig, TargetsRef,
};
pub use sample::{Dataset, PadTo, Padding, SampleLayout, Storage, Subset, ValueKind};
#[cfg(feature = "odir")]
pub use split::{all_indices, split_by_patient, Split};
#[cfg(feature = "tch")]
pub use tensor::{Batch, Loader};
pub use tensor_dataset::{Array, TensorDataset};
#[cfg(feature = "odir")]
pub use transform::{Pipeline, Transform};
