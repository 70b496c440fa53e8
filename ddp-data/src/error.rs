//! The crate's one error type: every variant names the file, row, column or value at fault.

use std::path::{Path, PathBuf};

/// Everything that can go wrong while opening, splitting, decoding or loading ODIR data, or
/// loading any [`Dataset`](crate::Dataset).
///
/// Messages are lower case, name the input the user must change, and give the expected and
/// the actual value where there is one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// The data folder holds neither `full_df.csv` nor a challenge annotation workbook.
    #[error("no ODIR annotation file in '{}': {}", .root.display(), missing_annotations_advice(.tried, .suggestion.as_deref()))]
    MissingAnnotations {
        /// The folder that was searched.
        root: PathBuf,
        /// The file names that were looked for, in order.
        tried: Vec<String>,
        /// The folder's parent or one of its subfolders, where one holds annotations: the
        /// data folder that was probably meant.
        suggestion: Option<PathBuf>,
    },

    /// No image folder next to the annotation file.
    #[error(
        "no image folder in '{}': looked for {}; give the folder that holds the images with \
         --image-dir",
        .root.display(),
        .tried.join(", ")
    )]
    MissingImageDir {
        /// The data folder.
        root: PathBuf,
        /// The relative folder names that were looked for, in order.
        tried: Vec<String>,
    },

    /// An annotation file lacks a column that the chosen label mode or layout needs.
    #[error("annotation file '{}' has no column '{column}' (columns found: {})", .file.display(), .found.join(", "))]
    MissingColumn {
        /// The annotation file.
        file: PathBuf,
        /// The missing column's header.
        column: String,
        /// The headers that were found.
        found: Vec<String>,
    },

    /// A label cell holds something other than 0 or 1.
    #[error("annotation file '{}' row {row} column '{column}': expected 0 or 1, found '{value}'", .file.display())]
    InvalidLabel {
        /// The annotation file.
        file: PathBuf,
        /// The row, counted from 1 with the header as row 1 (as a spreadsheet shows it).
        row: usize,
        /// The column's header.
        column: String,
        /// The cell's text.
        value: String,
    },

    /// A `target` cell is not a list of eight 0/1 values such as `[1, 0, 0, 0, 0, 0, 0, 0]`.
    #[error("annotation file '{}' row {row} column 'target': expected a list of 8 values 0 or 1 like '[1, 0, 0, 0, 0, 0, 0, 0]', found '{value}'", .file.display())]
    InvalidTarget {
        /// The annotation file.
        file: PathBuf,
        /// The row, counted from 1 with the header as row 1.
        row: usize,
        /// The cell's text.
        value: String,
    },

    /// Any other cell that cannot be read as what its column holds (the patient `ID`, a file name).
    #[error("annotation file '{}' row {row} column '{column}': expected {expected}, found '{value}'", .file.display())]
    InvalidCell {
        /// The annotation file.
        file: PathBuf,
        /// The row, counted from 1 with the header as row 1.
        row: usize,
        /// The column's header.
        column: String,
        /// What the column must hold.
        expected: String,
        /// The cell's text.
        value: String,
    },

    /// The annotation file could not be read or parsed at all.
    #[error("cannot read annotation file '{}': {message}", .file.display())]
    Annotations {
        /// The annotation file.
        file: PathBuf,
        /// What the reader said.
        message: String,
    },

    /// The annotation file has a header but no sample rows.
    #[error("annotation file '{}' lists no images", .file.display())]
    NoSamples {
        /// The annotation file.
        file: PathBuf,
    },

    /// Rows whose image file does not exist; the message names the first ten, and
    /// [`DataError::MissingImages::files`] holds every one.
    #[error(
        "{} image(s) listed in '{}' are missing from '{}': {}{} (check that this is the \
         images' folder, or give theirs with --image-dir; else remove the rows of the missing \
         images from the annotation file)",
        .files.len(),
        .annotations.display(),
        .image_dir.display(),
        .files.iter().take(10).cloned().collect::<Vec<_>>().join(", "),
        if .files.len() > 10 { format!(" and {} more", .files.len() - 10) } else { String::new() }
    )]
    MissingImages {
        /// The annotation file that lists them.
        annotations: PathBuf,
        /// The folder they were looked for in.
        image_dir: PathBuf,
        /// Every missing file name.
        files: Vec<String>,
    },

    /// The same image file name is listed more than once.
    #[error("annotation file '{}' lists image file names more than once: {}", .file.display(), .duplicates.join(", "))]
    DuplicateFiles {
        /// The annotation file.
        file: PathBuf,
        /// Each duplicated name with the rows it appears on, e.g. `1_left.jpg (rows 2, 7)`.
        duplicates: Vec<String>,
    },

    /// Two rows of one patient give different patient labels (the `N`..`O` columns: the
    /// patient's diagnosis, which each of the patient's rows repeats).
    #[error(
        "annotation file '{}' gives patient {id} different labels on rows {} and {} (column(s) \
         {}): the N..O columns are the patient's, the same on each of the patient's rows; \
         correct one of them",
        .file.display(),
        .rows.0,
        .rows.1,
        .columns.join(", ")
    )]
    InconsistentPatient {
        /// The annotation file.
        file: PathBuf,
        /// The patient's `ID`.
        id: u64,
        /// The first row of the patient and the first row that differs from it.
        rows: (usize, usize),
        /// The columns whose values differ between them.
        columns: Vec<String>,
    },

    /// A patient `ID` on several rows of a file with one row per patient (the challenge's
    /// workbook).
    #[error(
        "annotation file '{}' lists patient {id} on rows {}: the workbook has one row per \
         patient (both eyes' images on it)",
        .file.display(),
        .rows.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
    )]
    DuplicatePatient {
        /// The annotation file.
        file: PathBuf,
        /// The patient's `ID`.
        id: u64,
        /// Every row it is on.
        rows: Vec<usize>,
    },

    /// A train/validation split left one side without samples.
    #[error("the {side} split is empty: {patients} patient(s) split with validation fraction {fraction}; use a fraction that leaves at least one patient on each side")]
    EmptySplit {
        /// `train` or `validation`.
        side: &'static str,
        /// How many distinct patients there were to split.
        patients: usize,
        /// The validation fraction asked for.
        fraction: f64,
    },

    /// A folder of unlabelled images holds files that are not named as the challenge's test
    /// images; every one is listed.
    #[error("'{}' holds {} file(s) not named <id>_left.jpg or <id>_right.jpg: {}; an unlabelled folder holds only the challenge's test images ({})", .dir.display(), .files.len(), .files.join(", "), unlabelled_advice(.test_images.as_deref(), "for a labelled ODIR folder, use `evaluate`"))]
    UnexpectedFiles {
        /// The folder.
        dir: PathBuf,
        /// Every file that does not fit.
        files: Vec<String>,
        /// A folder below `dir` whose path says "test" and that holds test images.
        test_images: Option<PathBuf>,
    },

    /// A synthetic sample was to be written into a folder that already holds files.
    #[error("'{}' is not empty: a synthetic sample is written into a new or empty folder (give another, or remove this one first)", .dir.display())]
    NotEmpty {
        /// The folder.
        dir: PathBuf,
    },

    /// A folder of unlabelled images holds none.
    #[error("'{}' holds no images named <id>_left.jpg or <id>_right.jpg ({})", .dir.display(), unlabelled_advice(.test_images.as_deref(), "give the folder of the challenge's test images"))]
    NoImages {
        /// The folder.
        dir: PathBuf,
        /// A folder below `dir` whose path says "test" and that holds test images.
        test_images: Option<PathBuf>,
    },

    /// A folder could not be listed.
    #[error("cannot list folder '{}'", .dir.display())]
    ListDir {
        /// The folder.
        dir: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },

    /// A data set with no usable image left (every image was skipped as corrupt).
    #[error(
        "data set '{}' has no usable images ({skipped} skipped as corrupt{})",
        .root.display(),
        .first.as_ref().map(|f| format!("; the first, {f}")).unwrap_or_default()
    )]
    EmptyDataset {
        /// The data folder.
        root: PathBuf,
        /// How many images were skipped.
        skipped: usize,
        /// The first skipped image and why (`<path>: <reason>`).
        first: Option<String>,
    },

    /// A parameter outside its valid range (fraction, batch size, crop scale ...).
    #[error("invalid {name}: expected {expected}, found {value}")]
    InvalidParameter {
        /// The parameter's name.
        name: &'static str,
        /// The valid range.
        expected: String,
        /// The value given.
        value: String,
    },

    /// A sample index past the end of the data set.
    #[error("sample index {index} is out of range for a data set of {len} samples")]
    IndexOutOfRange {
        /// The index given.
        index: usize,
        /// The data set's length.
        len: usize,
    },

    /// A sample's values do not fit the data set's layout (count or length).
    #[error("{sample}: its {what} has {found} values; the layout expects {expected}")]
    SampleShape {
        /// The sample, as the data set describes it.
        sample: String,
        /// `input` or `targets`.
        what: &'static str,
        /// What the layout allows.
        expected: String,
        /// How many values the sample has.
        found: usize,
    },

    /// A sample's values are of another kind than its layout declares.
    #[error("{sample}: its {what} are {found} values; the layout declares {expected} (change the layout's kind or convert the values)")]
    SampleKind {
        /// The sample, as the data set describes it.
        sample: String,
        /// `input` or `targets`.
        what: &'static str,
        /// The kind the batch holds.
        expected: String,
        /// The kind the sample gave.
        found: String,
    },

    /// An image is larger than the decoder's pixel budget (a decompression bomb, or a file
    /// far larger than any fundus photo).
    #[error("image '{}' is {width} x {height} pixels, over the limit of {limit} pixels; \
             shrink it, or raise the limit (Decoder::with_max_pixels) if it is genuine", .path.display())]
    ImageTooLarge {
        /// The image file.
        path: PathBuf,
        /// Its width, from the header.
        width: u32,
        /// Its height, from the header.
        height: u32,
        /// The budget in pixels.
        limit: u64,
    },

    /// An image file could not be read from disk.
    #[error("cannot read image '{}'", .path.display())]
    ReadImage {
        /// The image file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },

    /// An image file is corrupt, truncated or in a format that cannot be decoded.
    #[error("image '{}' cannot be decoded: {message}", .path.display())]
    DecodeImage {
        /// The image file.
        path: PathBuf,
        /// What the decoder said.
        message: String,
    },

    /// Writing the synthetic sample failed.
    #[error("cannot write '{}': {message}", .path.display())]
    Write {
        /// The file or folder being written.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },

    /// A loader worker thread died without reporting an error (a panic).
    #[error("loader worker thread {worker} panicked while loading {sample}")]
    WorkerPanicked {
        /// The worker's number.
        worker: usize,
        /// The sample it was loading, as the data set describes it (an image's quoted path).
        sample: String,
    },

    /// A ring slot's reuse hook, or the allocator of slots, panicked in a loader worker.
    #[error("the loader's {what} panicked: {message}")]
    SlotPanicked {
        /// `"slot reuse hook"` or `"slot allocator"`.
        what: &'static str,
        /// The panic's message.
        message: String,
    },

    /// A CUDA runtime call of the pinned-memory input path failed.
    #[error("CUDA call {call} failed: {message}")]
    Cuda {
        /// The runtime function.
        call: &'static str,
        /// The runtime's message, or why the runtime could not be loaded.
        message: String,
    },

    /// A data set's own failure (a read, a parse, a lookup): any error, made with
    /// [`DataError::other`]. Returned from [`Dataset::write`](crate::Dataset::write) (or
    /// [`MapDataset::get`](crate::MapDataset::get)), it reaches the consumer as
    /// [`DataError::Sample`], naming the sample.
    #[error(transparent)]
    Other(Box<dyn std::error::Error + Send + Sync>),

    /// A sample's data set failed with `source` (its own error, [`DataError::Other`], or an
    /// [`DataError::InvalidParameter`] such as a kind mismatch from
    /// [`Input::f32`](crate::Input::f32)), and the loader added which sample it was writing.
    #[error("{sample}")]
    Sample {
        /// The sample, as the data set describes it.
        sample: String,
        /// The data set's error.
        source: Box<DataError>,
    },

    /// The memory of a CPU loader's batch slot (an anonymous, sealed `memfd`) could not be
    /// made or mapped: out of memory, no `memfd` on this system, no `/proc` to map it
    /// through, or the process at `vm.max_map_count`.
    #[cfg(feature = "tch")]
    #[error("cannot allocate or map {bytes} bytes of memory for a batch slot")]
    SlotMemory {
        /// The bytes asked for.
        bytes: usize,
        /// The system's error.
        source: std::io::Error,
    },

    /// A libtorch operation failed: converting a batch to tensors, or one of a data set's
    /// own (named by its sample, when the loader was writing one).
    #[cfg(feature = "tch")]
    #[error("a libtorch operation failed")]
    Tensor(#[from] tch::TchError),
}

impl DataError {
    /// A data set's own error, as [`DataError::Other`]: anything that converts into a boxed
    /// error (an error value, a `String`, a `&str`).
    ///
    /// ```
    /// use ddp_data::DataError;
    ///
    /// let e = DataError::other(format!("row {} of the table is empty", 3));
    /// assert_eq!(e.to_string(), "row 3 of the table is empty");
    /// ```
    pub fn other(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Other(error.into())
    }

    /// This error of a data set's `write`, naming `sample` when it does not already:
    /// [`DataError::Other`], [`DataError::InvalidParameter`], [`DataError::IndexOutOfRange`]
    /// and a libtorch error (`?` on a tch call in the data set) become
    /// [`DataError::Sample`]; the others name their sample or file themselves and stay as
    /// they are.
    pub(crate) fn of_sample(self, sample: impl FnOnce() -> String) -> Self {
        match self {
            e @ (Self::Other(_) | Self::InvalidParameter { .. } | Self::IndexOutOfRange { .. }) => {
                e.in_sample(sample)
            }
            #[cfg(feature = "tch")]
            e @ Self::Tensor(_) => e.in_sample(sample),
            e => e,
        }
    }

    fn in_sample(self, sample: impl FnOnce() -> String) -> Self {
        Self::Sample {
            sample: sample(),
            source: Box::new(self),
        }
    }
}

/// What an unlabelled folder's error advises: the folder of test images below it, if any,
/// else `otherwise`.
fn unlabelled_advice(test_images: Option<&Path>, otherwise: &str) -> String {
    match test_images {
        Some(folder) => format!("did you mean --data '{}'?", folder.display()),
        None => otherwise.to_string(),
    }
}

/// What [`DataError::MissingAnnotations`] advises: the folder beside that has annotations, or
/// what was looked for and where the layouts are described.
fn missing_annotations_advice(tried: &[String], suggestion: Option<&Path>) -> String {
    match suggestion {
        Some(folder) => format!("did you mean --data '{}'?", folder.display()),
        None => format!(
            "looked for {}; --data takes Kaggle's download, the challenge's folder or an \
             OIA-ODIR set (docs/odir.md, \"The data\"), and a folder of images alone is for \
             `ddp-train predict`",
            tried.join(", ")
        ),
    }
}

/// The message of a caught panic (`"no message"` when its payload is not text).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
        .unwrap_or("no message")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error;

    /// `err` and its causes, as a program prints them (`ddp-gen-data`, anyhow's `{:#}`).
    fn chain(err: &(dyn Error + 'static)) -> String {
        let chain = std::iter::successors(Some(err), |&e| e.source());
        chain
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(": ")
    }

    /// Each error with a cause says its own level only and hands out the cause as its
    /// source, so that a chain of causes says it once.
    #[test]
    fn a_message_leaves_its_cause_to_source() {
        let io = || std::io::Error::from(std::io::ErrorKind::NotFound);
        let mut errors = vec![
            (
                DataError::ListDir {
                    dir: "data/odir".into(),
                    source: io(),
                },
                "cannot list folder 'data/odir'",
            ),
            (
                DataError::ReadImage {
                    path: "data/1_left.jpg".into(),
                    source: io(),
                },
                "cannot read image 'data/1_left.jpg'",
            ),
            (
                DataError::other("checksum mismatch").of_sample(|| "record #5".into()),
                "record #5",
            ),
        ];
        #[cfg(feature = "tch")]
        errors.push((
            DataError::from(tch::TchError::Torch("out of memory".into())),
            "a libtorch operation failed",
        ));
        for (err, expected) in &errors {
            let cause = err.source().expect("a source").to_string();
            assert!(!cause.is_empty());
            assert_eq!(err.to_string(), *expected);
            let text = chain(err);
            assert_eq!(text, format!("{expected}: {cause}"));
            assert_eq!(text.matches(&cause).count(), 1, "{text}");
        }
        // A data set's own tch call that failed, named by its sample.
        #[cfg(feature = "tch")]
        assert_eq!(
            chain(
                &DataError::from(tch::TchError::Torch("cannot read x.npy".into()))
                    .of_sample(|| "sample 7".into())
            ),
            "sample 7: a libtorch operation failed: Internal torch error: cannot read x.npy"
        );
    }
}
