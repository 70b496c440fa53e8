//! A parallel batch loader for data-parallel training, and the ODIR-5K fundus data set it was
//! built for.
//!
//! The generic loader, for any data set:
//!
//! - [`Dataset`] is what the loader reads: a length, the layout of one sample, and a way to
//!   write sample `i` straight into its place in a batch. [`MapDataset`] (owned samples, as
//!   PyTorch's `__getitem__`) and [`TensorDataset`] (samples in memory) are simpler ways in.
//! - [`HostLoader`] (always) and [`Loader`] (feature `tch`) load one rank's indices of any
//!   [`Dataset`] in batches on worker threads, each writing its samples straight into a ring
//!   of reusable batch buffers; the random draws of sample `i` in epoch `e` come from
//!   `(seed, e, i)` only, so batches are identical whatever the number of workers. The tch
//!   loader hands CPU batches out as views of their buffer and sends CUDA batches as bytes
//!   from page-locked buffers, copied asynchronously and converted on the device.
//!
//! The ODIR-5K application, in [`odir`] (feature `odir`): `OdirDataset` opens a folder in
//! either ODIR layout and checks every image, `Transform` is torchvision's
//! `RandomResizedCrop` or `Resize` + `CenterCrop` drawn exactly as torchvision draws them,
//! `OdirImages` is ODIR as a [`Dataset`], `split_by_patient` makes a leak-free split, and
//! `synthetic::generate` writes a learnable ODIR-like folder.
//!
//! Features: `odir` (default) is the [`odir`] module and the image and spreadsheet crates it
//! needs; `tch` (default) adds [`Loader`] and [`Batch`]. With neither, the crate is the generic
//! loader ([`Dataset`], [`HostLoader`], [`memory`], [`rng`]) for any data set.
//!
//! ```
//! # #[cfg(feature = "odir")]
//! # fn main() -> Result<(), ddp_data::DataError> {
//! use std::sync::Arc;
//! use ddp_data::odir::synthetic::{generate, SyntheticConfig};
//! use ddp_data::odir::transform::Transform;
//! use ddp_data::odir::{split_by_patient, OdirDataset, OdirImages, OdirOptions};
//! use ddp_data::{HostLoader, LoaderConfig};
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

pub mod crop;
#[cfg(feature = "tch")]
mod cuda;
mod dataset;
mod error;
mod host_batch;
mod item;
mod loader;
pub mod memory;
#[cfg(feature = "odir")]
pub mod odir;
mod ring;
pub mod rng;
mod sample;
#[cfg(feature = "tch")]
mod tensor;
mod tensor_dataset;

pub use dataset::{Dataset, Subset};
pub use error::DataError;
pub use host_batch::{BatchIndices, HostBatch, InputRef, TargetsRef};
pub use item::{Item, MapDataset, Values, ValuesRef};
pub use loader::{default_workers, HostLoader, LoaderConfig};
pub use ring::ReuseHook;
pub use sample::{
    Affine, Input, PadTo, Padding, SampleLayout, SampleOut, Storage, Targets, ValueKind,
};
#[cfg(feature = "tch")]
pub use tensor::{Batch, Loader};
pub use tensor_dataset::{Array, TensorDataset};
