//! `OdirDataset`: an ODIR folder in either layout, checked at start-up (every image exists,
//! no duplicate names, optionally every image decodes).

use std::collections::HashMap;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use super::annotations::{read_csv, read_xlsx, LabelMode, LabelSource};
use super::decode::Decoder;
use crate::error::{panic_message, DataError};

/// The redistribution's annotation file name.
pub const CSV_NAME: &str = "full_df.csv";
/// The challenge workbook names, in the order they are looked for: Kaggle's (in its
/// `ODIR-5K/ODIR-5K/`) and the challenge's, then OIA-ODIR's (the dataset's current home):
/// its `Training Set/`, `Off-site Test Set/` and `On-site Test Set/` each hold `Annotation/`
/// beside `Images/`.
pub const XLSX_NAMES: [&str; 5] = [
    "data.xlsx",
    "ODIR-5K_Training_Annotations(Updated)_V2.xlsx",
    "Annotation/training annotation (English).xlsx",
    "Annotation/off-site test annotation (English).xlsx",
    "Annotation/on-site test annotation (English).xlsx",
];
/// Image folders of the redistribution layout, in the order they are looked for: Kaggle's
/// download holds `full_df.csv` and `preprocessed_images/` beside `ODIR-5K/ODIR-5K/`.
pub const CSV_IMAGE_DIRS: [&str; 3] = [
    "preprocessed_images",
    "ODIR-5K/ODIR-5K/Training Images",
    "ODIR-5K/Training Images",
];
/// Image folders of the challenge layout, in the order they are looked for: the workbook's
/// own folder (as Kaggle's `ODIR-5K/ODIR-5K/`), the challenge's training archive (as
/// extracted by `unzip`, then by tools that add the archive's name), and OIA-ODIR's.
pub const XLSX_IMAGE_DIRS: [&str; 5] = [
    "Training Images",
    "ODIR-5K_Training_Dataset",
    "ODIR-5K/Training Images",
    "ODIR-5K_Training_Images/ODIR-5K_Training_Dataset",
    "Images",
];

/// Which of the two on-disk layouts a folder uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `full_df.csv`, one row per eye image.
    Redistribution,
    /// The challenge `.xlsx` workbook, one row per patient.
    Challenge,
    /// No annotations: a folder of `<id>_left.jpg` / `<id>_right.jpg` images, as the
    /// challenge's test set ([`OdirDataset::open_unlabelled`]).
    Unlabelled,
}

/// How to open a folder.
#[derive(Debug, Clone, Default)]
pub struct OdirOptions {
    /// Per-eye or patient labels; see [`LabelMode`].
    pub labels: LabelMode,
    /// Decode every image at start-up and leave out those that fail, listing each in
    /// [`OdirDataset::skipped`]. Off by default: a corrupt image is then an error, naming the
    /// file, when the loader reaches it.
    pub skip_corrupt: bool,
    /// Use this image folder instead of looking for the layout's usual ones.
    pub image_dir: Option<PathBuf>,
    /// Threads [`Self::skip_corrupt`]'s scan decodes on (at least 1); `None`: one per core.
    /// Processes that scan at once on one machine (a job's ranks) share its cores:
    /// [`default_workers`](crate::default_workers)`(processes)` each.
    pub scan_threads: Option<usize>,
}

impl OdirOptions {
    /// The threads [`Self::skip_corrupt`]'s scan runs on.
    fn threads_for_scan(&self) -> usize {
        self.scan_threads
            .unwrap_or_else(|| crate::default_workers(1))
            .max(1)
    }
}

/// One image with its labels.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Full path of the image file.
    pub path: PathBuf,
    /// The patient's `ID`; both eyes of a patient share it.
    pub patient_id: u64,
    /// Multi-hot labels in N, D, G, C, A, H, M, O order.
    pub labels: [f32; 8],
    /// The patient's labels (the annotations' `N`..`O` columns) where the annotations have
    /// them: the challenge scores patients against these.
    pub patient_labels: Option<[f32; 8]>,
}

/// An image that [`OdirOptions::skip_corrupt`] left out, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct SkippedImage {
    /// The image file.
    pub path: PathBuf,
    /// The decoder's message.
    pub reason: String,
}

/// An ODIR-5K folder (real or synthetic), opened and checked.
///
/// ```no_run
/// use ddp_data::odir::{OdirDataset, OdirOptions};
/// let ds = OdirDataset::open("data/odir".as_ref(), &OdirOptions::default())?;
/// println!("{} images of {} patients", ds.len(), ds.patient_count());
/// # Ok::<(), ddp_data::DataError>(())
/// ```
#[derive(Debug, Clone)]
pub struct OdirDataset {
    root: PathBuf,
    annotation_file: PathBuf,
    image_dir: PathBuf,
    layout: Layout,
    label_source: LabelSource,
    samples: Vec<Sample>,
    skipped: Vec<SkippedImage>,
}

fn find_first(root: &Path, names: &[&str]) -> Option<PathBuf> {
    names.iter().map(|n| root.join(n)).find(|p| p.exists())
}

/// The annotation file names, in the order they are looked for: [`CSV_NAME`], then
/// [`XLSX_NAMES`].
fn annotation_names() -> impl Iterator<Item = &'static str> {
    std::iter::once(CSV_NAME).chain(XLSX_NAMES)
}

/// The layout detection: the first annotation file in `root` and its place among
/// [`annotation_names`] (0 is `full_df.csv`, the redistribution layout).
fn find_annotations(root: &Path) -> Option<(usize, PathBuf)> {
    annotation_names()
        .map(|n| root.join(n))
        .enumerate()
        .find(|(_, p)| p.exists())
}

/// A folder next to `root` that [`find_annotations`] accepts, for a `root` it does not: the
/// parent where `root` is named as a layout's image folders are, or a folder on their way
/// (an images folder given for its data folder; not the challenge's `Testing Images`, whose
/// parent's labels are the training set's), else the subfolder whose annotation file comes
/// first in the search order, then by name (OIA-ODIR's `Training Set` in its root).
fn nearby_data_folder(root: &Path) -> Option<PathBuf> {
    let (parent, name) = match root.components().next_back() {
        Some(std::path::Component::Normal(name)) => {
            let parent = root.parent().map(|p| {
                if p.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    p
                }
            });
            (parent.map(Path::to_path_buf), Some(name.to_os_string()))
        }
        // `.`, `..` or `/`: the parent only the file system knows.
        _ => {
            let real = root.canonicalize().ok()?;
            (
                real.parent().map(Path::to_path_buf),
                real.file_name().map(Into::into),
            )
        }
    };
    let image_folder = |name: &std::ffi::OsStr| {
        (CSV_IMAGE_DIRS.iter().chain(&XLSX_IMAGE_DIRS))
            .any(|d| Path::new(d).components().any(|c| c.as_os_str() == name))
    };
    let parent = parent.filter(|_| name.as_deref().is_some_and(image_folder));
    let mut children: Vec<PathBuf> = std::fs::read_dir(root)
        .ok()?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.is_dir())
        .collect();
    children.sort();
    // Of equals, `min_by_key` takes the first: the parent, then the first by name.
    parent
        .into_iter()
        .chain(children)
        .filter_map(|folder| Some((find_annotations(&folder)?.0, folder)))
        .min_by_key(|(place, _)| *place)
        .map(|(_, folder)| folder)
}

impl OdirDataset {
    /// Opens `root`, detecting the layout: `full_df.csv` first, then the challenge workbook.
    /// Without either, [`DataError::MissingAnnotations`] names the parent or a subfolder that
    /// has one, if any.
    pub fn open(root: &Path, options: &OdirOptions) -> Result<Self, DataError> {
        if let Err(source) = std::fs::read_dir(root) {
            // A mistyped --data: the folder itself, not a missing annotation file in it.
            return Err(DataError::ListDir {
                dir: root.to_path_buf(),
                source,
            });
        }
        let (layout, annotation_file, dirs): (_, _, &[&str]) = match find_annotations(root) {
            Some((0, csv)) => (Layout::Redistribution, csv, &CSV_IMAGE_DIRS),
            Some((_, xlsx)) => (Layout::Challenge, xlsx, &XLSX_IMAGE_DIRS),
            None => {
                return Err(DataError::MissingAnnotations {
                    root: root.to_path_buf(),
                    tried: annotation_names().map(str::to_string).collect(),
                    suggestion: nearby_data_folder(root),
                })
            }
        };
        let annotations = if layout == Layout::Redistribution {
            read_csv(&annotation_file, options.labels)?
        } else {
            read_xlsx(&annotation_file, options.labels)?
        };
        let image_dir = match &options.image_dir {
            Some(d) => d.clone(),
            None => find_first(root, dirs).ok_or_else(|| DataError::MissingImageDir {
                root: root.to_path_buf(),
                tried: dirs.iter().map(|d| d.to_string()).collect(),
            })?,
        };

        // Duplicate names: every one, with all the rows it appears on.
        let mut rows_of: HashMap<&str, Vec<usize>> = HashMap::new();
        for r in &annotations.records {
            rows_of.entry(r.file.as_str()).or_default().push(r.row);
        }
        let mut duplicates: Vec<(usize, String)> = rows_of
            .iter()
            .filter(|(_, rows)| rows.len() > 1)
            .map(|(name, rows)| {
                let rows: Vec<String> = rows.iter().map(usize::to_string).collect();
                (
                    rows_of[name][0],
                    format!("{name} (rows {})", rows.join(", ")),
                )
            })
            .collect();
        if !duplicates.is_empty() {
            duplicates.sort();
            return Err(DataError::DuplicateFiles {
                file: annotation_file,
                duplicates: duplicates.into_iter().map(|(_, d)| d).collect(),
            });
        }

        let samples: Vec<Sample> = annotations
            .records
            .iter()
            .map(|r| Sample {
                path: image_dir.join(&r.file),
                patient_id: r.patient_id,
                labels: r.labels,
                patient_labels: r.patient_labels,
            })
            .collect();
        let missing: Vec<String> = annotations
            .records
            .iter()
            .zip(&samples)
            .filter(|(_, s)| !s.path.is_file())
            .map(|(r, _)| r.file.clone())
            .collect();
        if !missing.is_empty() {
            return Err(DataError::MissingImages {
                annotations: annotation_file,
                image_dir,
                files: missing,
            });
        }

        let mut dataset = Self {
            root: root.to_path_buf(),
            annotation_file,
            image_dir,
            layout,
            label_source: annotations.label_source,
            samples,
            skipped: Vec::new(),
        };
        if options.skip_corrupt {
            dataset.drop_undecodable(options.threads_for_scan())?;
        }
        Ok(dataset)
    }

    /// Opens a folder of unlabelled images named as the challenge's test set
    /// (`<id>_left.jpg`, `<id>_right.jpg`), in ID order, left eye first. The samples'
    /// labels are zeros and they have no patient labels; the annotation file is the folder
    /// itself. Any other file in the folder is an error naming it, and so is a sub-folder
    /// of more test images beside them (hidden files and other sub-folders are left alone);
    /// images are decoded when the loader reaches them, so an undecodable one stops the
    /// loader with its name.
    pub fn open_unlabelled(dir: &Path) -> Result<Self, DataError> {
        let samples = super::unlabelled::list_images(dir)?
            .into_iter()
            .map(|(name, patient_id, _)| Sample {
                path: dir.join(name),
                patient_id,
                labels: [0.0; 8],
                patient_labels: None,
            })
            .collect();
        Ok(Self {
            root: dir.to_path_buf(),
            annotation_file: dir.to_path_buf(),
            image_dir: dir.to_path_buf(),
            layout: Layout::Unlabelled,
            label_source: LabelSource::Patient,
            samples,
            skipped: Vec::new(),
        })
    }

    /// Decodes every image (on `threads` threads) and removes those that fail, recording
    /// each one.
    ///
    /// A file that cannot be read (an I/O error, not a decoding one) is an error: it says
    /// nothing about the image, and leaving it out on one rank only would give the ranks
    /// different data.
    fn drop_undecodable(&mut self, threads: usize) -> Result<(), DataError> {
        self.drop_failing(threads, |decoder, path| decoder.decode_file(path).map(drop))
    }

    /// [`Self::drop_undecodable`] with `decode` in the decoder's place.
    fn drop_failing<F>(&mut self, threads: usize, decode: F) -> Result<(), DataError>
    where
        F: Fn(&mut Decoder, &Path) -> Result<(), DataError> + Sync,
    {
        let failures = decode_failures(&self.samples, threads, decode);
        let mut kept = Vec::with_capacity(self.samples.len());
        for (sample, failure) in std::mem::take(&mut self.samples).into_iter().zip(failures) {
            match failure {
                None => kept.push(sample),
                Some(e @ DataError::ReadImage { .. }) => return Err(e),
                Some(e) => self.skipped.push(SkippedImage {
                    path: sample.path,
                    reason: e.to_string(),
                }),
            }
        }
        self.samples = kept;
        Ok(())
    }

    /// Number of samples (images).
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether there are no samples (only possible when every image was skipped as corrupt).
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Sample `index`, or `None` past the end.
    pub fn get(&self, index: usize) -> Option<&Sample> {
        self.samples.get(index)
    }

    /// Sample `index`, or an error naming the index and the length.
    pub fn sample(&self, index: usize) -> Result<&Sample, DataError> {
        self.samples.get(index).ok_or(DataError::IndexOutOfRange {
            index,
            len: self.samples.len(),
        })
    }

    /// All samples in annotation order.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// Number of distinct patients.
    pub fn patient_count(&self) -> usize {
        let mut ids: Vec<u64> = self.samples.iter().map(|s| s.patient_id).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }

    /// Per-label count of positive samples, in N, D, G, C, A, H, M, O order.
    pub fn label_counts(&self) -> [usize; 8] {
        let mut counts = [0; 8];
        for s in &self.samples {
            for (c, &l) in counts.iter_mut().zip(&s.labels) {
                *c += usize::from(l > 0.5);
            }
        }
        counts
    }

    /// The folder that was opened.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The annotation file that was read.
    pub fn annotation_file(&self) -> &Path {
        &self.annotation_file
    }

    /// The folder the images are read from.
    pub fn image_dir(&self) -> &Path {
        &self.image_dir
    }

    /// The layout that was detected.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Whether the labels are per eye or per patient.
    pub fn label_source(&self) -> LabelSource {
        self.label_source
    }

    /// Images left out because they did not decode ([`OdirOptions::skip_corrupt`]).
    pub fn skipped(&self) -> &[SkippedImage] {
        &self.skipped
    }
}

/// `decode`'s error for each of `samples`' images, in their order, decoded on `threads`
/// threads. A panic in `decode` (a decoder bug on a crafted file) is that image's error
/// alone: its thread goes on with a new decoder, as the old one's state is unknown.
fn decode_failures<F>(samples: &[Sample], threads: usize, decode: F) -> Vec<Option<DataError>>
where
    F: Fn(&mut Decoder, &Path) -> Result<(), DataError> + Sync,
{
    let chunk = samples.len().div_ceil(threads.max(1)).max(1);
    let decode = &decode;
    std::thread::scope(|scope| {
        let handles: Vec<_> = samples
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    let mut decoder = Decoder::new();
                    let mut failures = Vec::with_capacity(part.len());
                    for s in part {
                        let outcome =
                            catch_unwind(AssertUnwindSafe(|| decode(&mut decoder, &s.path)));
                        failures.push(match outcome {
                            Ok(result) => result.err(),
                            Err(panic) => {
                                decoder = Decoder::new();
                                Some(DataError::DecodeImage {
                                    path: s.path.clone(),
                                    message: format!(
                                        "the decoder panicked ({})",
                                        panic_message(&*panic)
                                    ),
                                })
                            }
                        });
                    }
                    failures
                })
            })
            .collect();
        // Every decode's panic is caught above: one here is the thread's own, and is the
        // caller's as `thread::scope` would make it.
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|panic| resume_unwind(panic)))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Eight samples of `images/` (`<i>_left.jpg`), in a redistribution folder.
    fn eight_images() -> OdirDataset {
        let dir = PathBuf::from("images");
        OdirDataset {
            root: dir.clone(),
            annotation_file: dir.join(CSV_NAME),
            image_dir: dir.clone(),
            layout: Layout::Redistribution,
            label_source: LabelSource::PerEye,
            samples: (0..8)
                .map(|i| Sample {
                    path: dir.join(format!("{i}_left.jpg")),
                    patient_id: i,
                    labels: [0.0; 8],
                    patient_labels: None,
                })
                .collect(),
            skipped: Vec::new(),
        }
    }

    #[test]
    fn the_scan_decodes_on_the_threads_it_is_given() {
        let options = |scan_threads| OdirOptions {
            skip_corrupt: true,
            scan_threads,
            ..OdirOptions::default()
        };
        assert_eq!(options(Some(2)).threads_for_scan(), 2);
        assert_eq!(options(Some(0)).threads_for_scan(), 1);
        assert_eq!(options(None).threads_for_scan(), crate::default_workers(1));
        let mut dataset = eight_images();
        let threads = std::sync::Mutex::new(std::collections::HashSet::new());
        dataset
            .drop_failing(options(Some(2)).threads_for_scan(), |_, _| {
                threads.lock().unwrap().insert(std::thread::current().id());
                Ok(())
            })
            .unwrap();
        assert_eq!(threads.into_inner().unwrap().len(), 2);
        assert_eq!(dataset.len(), 8);
    }

    #[test]
    fn a_decoder_panic_skips_only_its_own_image() {
        let dir = PathBuf::from("images");
        let mut dataset = eight_images();
        let samples = dataset.samples().to_vec();
        let crafted = dir.join("5_left.jpg");
        dataset
            .drop_failing(2, |_, path| {
                if path == crafted {
                    panic!("crafted file");
                }
                Ok(())
            })
            .unwrap();
        let mut kept = samples;
        kept.remove(5);
        assert_eq!(dataset.samples(), kept);
        assert_eq!(
            dataset.skipped(),
            [SkippedImage {
                path: crafted,
                reason: "image 'images/5_left.jpg' cannot be decoded: the decoder panicked \
                         (crafted file)"
                    .to_string(),
            }]
        );
    }
}
