//! Folders of unlabelled fundus photos named as the challenge's test set: `<id>_left.jpg`
//! and `<id>_right.jpg`, a patient's `ID` and the eye, with no annotation file.

use std::path::{Path, PathBuf};

use crate::error::DataError;

/// Which eye an image shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Eye {
    /// The left eye (`<id>_left.jpg`).
    Left,
    /// The right eye (`<id>_right.jpg`).
    Right,
}

impl Eye {
    /// `left` or `right`, as file names spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Eye::Left => "left",
            Eye::Right => "right",
        }
    }
}

/// The patient `ID` and eye of an image named as the challenge names them
/// (`<id>_left.jpg`, `<id>_right.jpg`; `.jpeg` and `.png` too, in any case); `None` for any
/// other name.
///
/// ```
/// use ddp_data::odir::{parse_image_name, Eye};
/// assert_eq!(parse_image_name("937_left.jpg"), Some((937, Eye::Left)));
/// assert_eq!(parse_image_name("12_RIGHT.JPG"), Some((12, Eye::Right)));
/// assert_eq!(parse_image_name("12_right_2.jpg"), None);
/// ```
pub fn parse_image_name(name: &str) -> Option<(u64, Eye)> {
    let (stem, ext) = name.rsplit_once('.')?;
    if !["jpg", "jpeg", "png"]
        .iter()
        .any(|e| ext.eq_ignore_ascii_case(e))
    {
        return None;
    }
    let (id, eye) = stem.split_once('_')?;
    let eye = if eye.eq_ignore_ascii_case("left") {
        Eye::Left
    } else if eye.eq_ignore_ascii_case("right") {
        Eye::Right
    } else {
        return None;
    };
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((id.parse().ok()?, eye))
}

/// The images of `dir` as `(file name, ID, eye)`, ordered by ID, left eye first. Hidden files
/// (`.name`) and sub-folders are not images; any other file that is not named as a test
/// image is an error that lists every such file, and so are a patient with two files for one
/// eye and, beside test images, a sub-folder that holds more (whose patients would be left
/// out).
pub(super) fn list_images(dir: &Path) -> Result<Vec<(String, u64, Eye)>, DataError> {
    let list_error = |source| DataError::ListDir {
        dir: dir.to_path_buf(),
        source,
    };
    let mut images = Vec::new();
    let mut unexpected = Vec::new();
    let mut image_folders = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(list_error)? {
        let entry = entry.map_err(list_error)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        if entry.path().is_dir() {
            if holds_test_image(&entry.path()) {
                image_folders.push(name);
            }
            continue;
        }
        match parse_image_name(&name) {
            Some((id, eye)) => images.push((name, id, eye)),
            None => unexpected.push(name),
        }
    }
    if !images.is_empty() {
        unexpected.extend(image_folders.into_iter().map(|name| {
            format!(
                "{name}/ (a folder of more test images, which are not read: move them up, or \
                 give that folder on its own)"
            )
        }));
    }
    images.sort_by(|a, b| (a.1, a.2, &a.0).cmp(&(b.1, b.2, &b.0)));
    for pair in images.windows(2) {
        if (pair[0].1, pair[0].2) == (pair[1].1, pair[1].2) {
            unexpected.push(format!(
                "{} (a second {} eye of patient {}, besides {})",
                pair[1].0,
                pair[1].2.as_str(),
                pair[1].1,
                pair[0].0
            ));
        }
    }
    if !unexpected.is_empty() {
        unexpected.sort();
        return Err(DataError::UnexpectedFiles {
            dir: dir.to_path_buf(),
            files: unexpected,
            test_images: test_images_below(dir),
        });
    }
    if images.is_empty() {
        return Err(DataError::NoImages {
            dir: dir.to_path_buf(),
            test_images: test_images_below(dir),
        });
    }
    Ok(images)
}

/// Whether `folder` holds a file named as a test image.
fn holds_test_image(folder: &Path) -> bool {
    std::fs::read_dir(folder).is_ok_and(|mut entries| {
        entries.any(|e| {
            e.is_ok_and(|e| {
                let name = e.file_name();
                parse_image_name(&name.to_string_lossy()).is_some()
                    && e.file_type().is_ok_and(|t| !t.is_dir())
            })
        })
    })
}

/// A folder below `dir` (at most three levels down, by level, then by name) whose path
/// below `dir` says "test" (any case) and that holds an image named as a test image: what
/// was meant when a dataset's top folder was given (the challenge's `Testing Images`,
/// Kaggle's `ODIR-5K/ODIR-5K/Testing Images`).
fn test_images_below(dir: &Path) -> Option<PathBuf> {
    let subfolders = |folder: &Path| -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(folder) else {
            return Vec::new();
        };
        let mut found: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .collect();
        found.sort();
        found
    };
    let mut level = vec![dir.to_path_buf()];
    for _ in 0..3 {
        level = level.iter().flat_map(|f| subfolders(f)).collect();
        let says_test = |f: &&PathBuf| {
            let below = f.strip_prefix(dir).unwrap_or(f);
            below.to_string_lossy().to_lowercase().contains("test")
        };
        if let Some(found) = level.iter().filter(says_test).find(|f| holds_test_image(f)) {
            return Some(found.clone());
        }
    }
    None
}
