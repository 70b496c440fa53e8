//! The ODIR-5K application of the loader (feature `odir`): the data set on disk, its images
//! through torchvision-exact transforms, the split by patient, and a synthetic sample to train
//! on without the real data.
//!
//! - [`OdirDataset`] opens a folder in either ODIR layout (`full_df.csv` or the challenge
//!   workbook), checks every image exists, and lists samples (path, patient, 8 labels).
//! - [`transform::Transform`] is `RandomResizedCrop` (+ flips, rotation and colour jitter:
//!   [`transform::Augment`]) or `Resize` + `CenterCrop`, then
//!   `ToTensor` and optional `Normalize`, with crop boxes drawn exactly as torchvision draws
//!   them; [`decode`] turns files into upright 8-bit RGB.
//! - [`OdirDataset::open_unlabelled`] opens a folder of test images (`<id>_left.jpg`,
//!   `<id>_right.jpg`) without annotations, for predictions.
//! - [`OdirImages`] is ODIR as a [`Dataset`](crate::Dataset), for the loaders.
//! - [`split_by_patient`] makes a leak-free train/validation split, and
//!   [`synthetic::generate`] writes a learnable ODIR-like folder.
//!
//! This is everything that needs the image and spreadsheet crates; the rest of the crate is
//! the generic loader.

mod annotations;
mod augment;
mod dataset;
pub mod decode;
mod images;
mod scaled_jpeg;
mod split;
pub mod synthetic;
pub mod transform;
mod unlabelled;

pub use annotations::{
    read_csv, read_xlsx, Annotations, LabelMode, LabelSource, Record, LABELS, LABEL_NAMES,
};
pub use dataset::{
    Layout, OdirDataset, OdirOptions, Sample, SkippedImage, CSV_IMAGE_DIRS, CSV_NAME,
    XLSX_IMAGE_DIRS, XLSX_NAMES,
};
pub use images::OdirImages;
pub use split::{all_indices, split_by_patient, Split};
pub use unlabelled::{parse_image_name, Eye};
