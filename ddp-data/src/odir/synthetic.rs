//! The synthetic ODIR sample: a folder in the redistribution layout (`full_df.csv` +
//! `preprocessed_images/*.jpg`) whose fundus-like images carry one visual cue per label, so a
//! small ConvNet can learn them and the real loading code path is exercised end to end.
//!
//! Cues: D red haemorrhages and yellow exudates; G an enlarged, bright optic cup; C a global
//! milky haze and blur; A a pale macula ringed by large drusen; H narrowed pale arteries,
//! dilated tortuous veins and white cotton-wool spots by the disc; M a pale, tessellated fundus
//! with a peripapillary crescent; O a ring of dark laser scars; N none of these. Eyes may carry
//! several labels at once.

mod fundus;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use image::codecs::jpeg::JpegEncoder;
use image::ExtendedColorType;

use super::annotations::{LABELS, LABEL_NAMES};
use crate::error::DataError;
use crate::rng::SampleRng;

/// What to generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticConfig {
    /// Number of images (eyes); patients get two each, the last one only a left eye when
    /// the number is odd.
    pub images: usize,
    /// Side of the square images in pixels.
    pub size: u32,
    /// Seed: the same seed gives byte-identical files.
    pub seed: u64,
    /// JPEG quality (1-100).
    pub quality: u8,
    /// Images of a held-out test split, written as `test/` beside the sample: a labelled
    /// folder of the same layout (`test/full_df.csv`) whose image folder,
    /// `test/preprocessed_images/`, is an unlabelled folder of `<id>_left.jpg` /
    /// `<id>_right.jpg` as the challenge's test set is. Its patients come after the sample's
    /// (their IDs continue the count); 0 writes none.
    pub test_images: usize,
}

impl Default for SyntheticConfig {
    /// 600 images of 256 pixels, seed 0, quality 90, no test split.
    fn default() -> Self {
        Self {
            images: 600,
            size: 256,
            seed: 0,
            quality: 90,
            test_images: 0,
        }
    }
}

impl SyntheticConfig {
    /// Checks the ranges [`generate`] needs: at least 1 image, a side of 32 to 4096 pixels
    /// and a quality of 1 to 100 ([`DataError::InvalidParameter`] names the one outside).
    pub fn validate(&self) -> Result<(), DataError> {
        if self.images == 0 {
            return Err(DataError::InvalidParameter {
                name: "synthetic image count",
                expected: "at least 1".to_string(),
                value: "0".to_string(),
            });
        }
        if !(32..=4096).contains(&self.size) {
            return Err(DataError::InvalidParameter {
                name: "synthetic image size",
                expected: "32 to 4096 pixels".to_string(),
                value: self.size.to_string(),
            });
        }
        if !(1..=100).contains(&self.quality) {
            return Err(DataError::InvalidParameter {
                name: "JPEG quality",
                expected: "1 to 100".to_string(),
                value: self.quality.to_string(),
            });
        }
        Ok(())
    }
}

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticSummary {
    /// The folder written.
    pub root: PathBuf,
    /// The annotation file.
    pub csv: PathBuf,
    /// Number of images written.
    pub images: usize,
    /// Number of patients.
    pub patients: usize,
    /// Images with each label, in N, D, G, C, A, H, M, O order.
    pub label_counts: [usize; 8],
    /// The test split written into `root/test/` ([`SyntheticConfig::test_images`]).
    pub test: Option<Box<SyntheticSummary>>,
}

/// The per-eye labels for one patient.
fn draw_patient(rng: &mut SampleRng) -> ([bool; 8], [bool; 8]) {
    fn draw_eye(rng: &mut SampleRng) -> [bool; 8] {
        let mut l = [false; 8];
        if rng.unit() < 0.3 {
            l[fundus::N] = true;
            return l;
        }
        // D is the most common disease in ODIR; the others are rarer.
        let p = [0.0, 0.4, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2];
        for k in 1..8 {
            l[k] = rng.unit() < p[k];
        }
        if !l.iter().any(|&b| b) {
            l[1 + rng.below(7) as usize] = true;
        }
        l
    }
    let left = draw_eye(rng);
    // Disease is often bilateral.
    let right = if rng.unit() < 0.5 {
        left
    } else {
        draw_eye(rng)
    };
    (left, right)
}

fn label_list(l: &[bool; 8]) -> String {
    let names: Vec<String> = (0..8)
        .filter(|&k| l[k])
        .map(|k| format!("'{}'", LABELS[k]))
        .collect();
    format!("[{}]", names.join(", "))
}

fn target(l: &[bool; 8]) -> String {
    let v: Vec<&str> = l.iter().map(|&b| if b { "1" } else { "0" }).collect();
    format!("[{}]", v.join(", "))
}

fn keywords(l: &[bool; 8]) -> String {
    let names: Vec<&str> = (0..8).filter(|&k| l[k]).map(|k| LABEL_NAMES[k]).collect();
    names.join("，")
}

fn write_error(path: &Path, e: impl std::fmt::Display) -> DataError {
    DataError::Write {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

struct Patient {
    id: usize,
    age: u64,
    sex: &'static str,
    eyes: Vec<(bool, [bool; 8])>,
}

/// Writes the synthetic sample into `out_dir` (created if needed): `full_df.csv` and
/// `preprocessed_images/<id>_left.jpg` / `<id>_right.jpg`, and with
/// [`SyntheticConfig::test_images`] its test split in `out_dir/test/`. A folder that holds
/// anything already is refused ([`DataError::NotEmpty`]): a smaller sample written over a
/// larger one would leave the other's images beside the new annotations, and so is a
/// configuration [`SyntheticConfig::validate`] refuses, before anything is written.
///
/// Deterministic: the files depend only on `config`, not on the number of threads used.
/// Durable: every file and folder written is flushed to the disk before it returns.
pub fn generate(out_dir: &Path, config: &SyntheticConfig) -> Result<SyntheticSummary, DataError> {
    config.validate()?;
    if let Ok(mut entries) = std::fs::read_dir(out_dir) {
        if entries.next().is_some() {
            return Err(DataError::NotEmpty {
                dir: out_dir.to_path_buf(),
            });
        }
    }
    let mut summary = write_folder(out_dir, config, 0, config.images)?;
    if config.test_images > 0 {
        let first = config.images.div_ceil(2);
        let test = write_folder(&out_dir.join("test"), config, first, config.test_images)?;
        summary.test = Some(Box::new(test));
        // `test/`'s own entry.
        sync_dir(out_dir)?;
    }
    Ok(summary)
}

/// Writes `images` images of patients from ID `first_id` on into `out_dir`.
fn write_folder(
    out_dir: &Path,
    config: &SyntheticConfig,
    first_id: usize,
    images: usize,
) -> Result<SyntheticSummary, DataError> {
    let image_dir = out_dir.join("preprocessed_images");
    create_folders_synced(&image_dir).map_err(|e| write_error(&image_dir, e))?;

    let n_patients = images.div_ceil(2);
    let patients: Vec<Patient> = (first_id..first_id + n_patients)
        .map(|id| {
            let mut rng = SampleRng::from_seed_and_tag(config.seed, b"patient\0", id as u64);
            let (left, right) = draw_patient(&mut rng);
            let mut eyes = vec![(true, left)];
            if 2 * (id - first_id) + 1 < images {
                eyes.push((false, right));
            }
            Patient {
                id,
                age: 40 + rng.below(45),
                sex: if rng.below(2) == 0 { "Male" } else { "Female" },
                eyes,
            }
        })
        .collect();

    // Paint and encode on all cores; each image's stream depends only on (seed, id, eye).
    let jobs: Vec<(usize, bool, [bool; 8])> = patients
        .iter()
        .flat_map(|p| p.eyes.iter().map(move |&(left, l)| (p.id, left, l)))
        .collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = jobs.len().div_ceil(threads).max(1);
    let results: Vec<Result<(), DataError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .chunks(chunk)
            .map(|part| {
                let image_dir = &image_dir;
                scope.spawn(move || -> Result<(), DataError> {
                    let mut encoded = Vec::new();
                    for &(id, left, labels) in part {
                        let stream = 2 * id as u64 + u64::from(!left);
                        let mut rng =
                            SampleRng::from_seed_and_tag(config.seed, b"fundus\0\0", stream);
                        let px = fundus::paint(config.size, &labels, left, &mut rng);
                        encoded.clear();
                        JpegEncoder::new_with_quality(&mut encoded, config.quality)
                            .encode(&px, config.size, config.size, ExtendedColorType::Rgb8)
                            .map_err(|e| write_error(image_dir, e))?;
                        let path = image_dir.join(file_name(id, left));
                        write_synced(&path, &encoded)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(write_error(&image_dir, "an image-writing thread panicked"))
                })
            })
            .collect()
    });
    results.into_iter().collect::<Result<Vec<()>, _>>()?;

    let csv_path = out_dir.join("full_df.csv");
    let mut csv = String::from(
        "ID,Patient Age,Patient Sex,Left-Fundus,Right-Fundus,Left-Diagnostic Keywords,\
         Right-Diagnostic Keywords,N,D,G,C,A,H,M,O,filepath,labels,target,filename\n",
    );
    let mut label_counts = [0usize; 8];
    for p in &patients {
        let left = p.eyes[0].1;
        let right = p.eyes.get(1).map_or(left, |e| e.1);
        let mut patient = [false; 8];
        for k in 1..8 {
            patient[k] = left[k] || right[k];
        }
        patient[fundus::N] = !patient[1..].iter().any(|&b| b);
        let patient_cols: Vec<&str> = patient.iter().map(|&b| if b { "1" } else { "0" }).collect();
        for &(is_left, l) in &p.eyes {
            for k in 0..8 {
                label_counts[k] += usize::from(l[k]);
            }
            let name = file_name(p.id, is_left);
            // Infallible: writing to a String.
            let _ = writeln!(
                csv,
                "{id},{age},{sex},{lf},{rf},\"{lk}\",\"{rk}\",{pc},preprocessed_images/{name},\"{labels}\",\"{target}\",{name}",
                id = p.id,
                age = p.age,
                sex = p.sex,
                lf = file_name(p.id, true),
                rf = file_name(p.id, false),
                lk = keywords(&left),
                rk = keywords(&right),
                pc = patient_cols.join(","),
                labels = label_list(&l),
                target = target(&l),
            );
        }
    }
    write_synced(&csv_path, csv.as_bytes())?;
    sync_dir(&image_dir)?;
    sync_dir(out_dir)?;
    Ok(SyntheticSummary {
        root: out_dir.to_path_buf(),
        csv: csv_path,
        images: jobs.len(),
        patients: n_patients,
        label_counts,
        test: None,
    })
}

/// Writes `bytes` to a new file at `path` and flushes it to the disk: a folder renamed into
/// place after [`generate`] holds whole files, even after a power loss.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let mut file = std::fs::File::create(path).map_err(|e| write_error(path, e))?;
    file.write_all(bytes).map_err(|e| write_error(path, e))?;
    file.sync_all().map_err(|e| write_error(path, e))
}

/// Flushes folder `dir`'s entries to the disk (see [`sync_folder`]).
fn sync_dir(dir: &Path) -> Result<(), DataError> {
    sync_folder(dir).map_err(|e| write_error(dir, e))
}

// `sync_folder`, shared with ddp-model and xtask.
include!("../../../shared-src/folder_sync.rs");

fn file_name(id: usize, left: bool) -> String {
    format!("{id}_{}.jpg", if left { "left" } else { "right" })
}

/// Paints one synthetic fundus image without writing anything: `size x size` RGB bytes for
/// `labels` (N, D, G, C, A, H, M, O), drawn from `seed` and `stream`. Benchmarks use it to
/// make ODIR-like JPEGs of any size.
pub fn paint_fundus(
    size: u32,
    labels: [bool; 8],
    left_eye: bool,
    seed: u64,
    stream: u64,
) -> Vec<u8> {
    let mut rng = SampleRng::from_seed_and_tag(seed, b"fundus\0\0", stream);
    fundus::paint(size.max(8), &labels, left_eye, &mut rng)
}
