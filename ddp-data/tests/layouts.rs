//! Both ODIR layouts load, with the right labels, and splits keep patients together.
#![cfg(feature = "odir")]

mod common;

use std::collections::HashSet;
use std::path::Path;

use ddp_data::odir::{
    all_indices, split_by_patient, LabelMode, LabelSource, Layout, OdirDataset, OdirOptions,
};
use ddp_data::DataError;

fn write_xlsx_images(dir: &Path, names: &[&str]) {
    std::fs::create_dir_all(dir).unwrap();
    for n in names {
        std::fs::write(dir.join(n), common::jpeg_bytes(20, 20, [200, 90, 40])).unwrap();
    }
}

#[test]
fn redistribution_layout_loads_per_eye_labels_by_default() {
    let dir = tempfile::tempdir().unwrap();
    common::valid_csv_layout(dir.path(), 3);
    let ds = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap();
    assert_eq!(ds.layout(), Layout::Redistribution);
    assert_eq!(ds.label_source(), LabelSource::PerEye);
    assert_eq!(ds.len(), 6);
    assert_eq!(ds.patient_count(), 3);
    let s = ds.sample(1).unwrap();
    assert_eq!(s.patient_id, 1);
    assert_eq!(s.path, dir.path().join("preprocessed_images/1_right.jpg"));
    assert_eq!(s.labels, [0., 1., 0., 0., 0., 0., 0., 0.]);
    assert_eq!(
        ds.sample(0).unwrap().labels,
        [1., 0., 0., 0., 0., 0., 0., 0.]
    );
    assert_eq!(ds.label_counts(), [3, 3, 0, 0, 0, 0, 0, 0]);
    assert!(matches!(
        ds.sample(6),
        Err(DataError::IndexOutOfRange { index: 6, len: 6 })
    ));
}

#[test]
fn redistribution_layout_patient_labels_on_request() {
    let dir = tempfile::tempdir().unwrap();
    common::valid_csv_layout(dir.path(), 2);
    let options = OdirOptions {
        labels: LabelMode::Patient,
        ..OdirOptions::default()
    };
    let ds = OdirDataset::open(dir.path(), &options).unwrap();
    assert_eq!(ds.label_source(), LabelSource::Patient);
    for s in ds.samples() {
        assert_eq!(s.labels, [0., 1., 0., 0., 0., 0., 0., 0.]);
    }
}

#[test]
fn original_images_folder_is_used_when_there_is_no_preprocessed_folder() {
    let dir = tempfile::tempdir().unwrap();
    common::valid_csv_layout(dir.path(), 1);
    let originals = dir.path().join("ODIR-5K/Training Images");
    std::fs::rename(dir.path().join("preprocessed_images"), &originals).unwrap_or_else(|_| {
        std::fs::create_dir_all(dir.path().join("ODIR-5K")).unwrap();
        std::fs::rename(dir.path().join("preprocessed_images"), &originals).unwrap();
    });
    let ds = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap();
    assert_eq!(ds.image_dir(), originals);
}

/// Kaggle's download: `full_df.csv` beside `ODIR-5K/ODIR-5K/Training Images/` (without
/// `preprocessed_images/`); any other folder through `image_dir` (`--image-dir`).
#[test]
fn kaggles_nested_folder_and_a_given_folder_are_found() {
    let dir = tempfile::tempdir().unwrap();
    common::valid_csv_layout(dir.path(), 1);
    let nested = dir.path().join("ODIR-5K/ODIR-5K/Training Images");
    std::fs::create_dir_all(nested.parent().unwrap()).unwrap();
    std::fs::rename(dir.path().join("preprocessed_images"), &nested).unwrap();
    let ds = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap();
    assert_eq!(ds.image_dir(), nested);
    let elsewhere = dir.path().join("my images");
    std::fs::rename(&nested, &elsewhere).unwrap();
    let e = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap_err();
    assert!(e.to_string().ends_with("with --image-dir"), "{e}");
    let options = OdirOptions {
        image_dir: Some(elsewhere.clone()),
        ..OdirOptions::default()
    };
    let ds = OdirDataset::open(dir.path(), &options).unwrap();
    assert_eq!((ds.image_dir(), ds.len()), (elsewhere.as_path(), 2));
}

#[test]
fn challenge_workbook_gives_two_samples_per_patient() {
    let dir = tempfile::tempdir().unwrap();
    common::write_xlsx(
        &dir.path().join("data.xlsx"),
        &[
            (0, "0_left.jpg", "0_right.jpg", [0, 0, 0, 1, 0, 0, 0, 0]),
            (1, "1_left.jpg", "1_right.jpg", [1, 0, 0, 0, 0, 0, 0, 0]),
            (4, "4_left.jpg", "4_right.jpg", [0, 1, 0, 0, 0, 1, 0, 1]),
        ],
    );
    write_xlsx_images(
        &dir.path().join("Training Images"),
        &[
            "0_left.jpg",
            "0_right.jpg",
            "1_left.jpg",
            "1_right.jpg",
            "4_left.jpg",
            "4_right.jpg",
        ],
    );
    let ds = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap();
    assert_eq!(ds.layout(), Layout::Challenge);
    assert_eq!(ds.label_source(), LabelSource::Patient);
    assert_eq!(ds.len(), 6);
    let ids: Vec<u64> = ds.samples().iter().map(|s| s.patient_id).collect();
    assert_eq!(ids, [0, 0, 1, 1, 4, 4]);
    assert_eq!(
        ds.sample(4).unwrap().labels,
        [0., 1., 0., 0., 0., 1., 0., 1.]
    );
    assert_eq!(
        ds.sample(5).unwrap().labels,
        [0., 1., 0., 0., 0., 1., 0., 1.]
    );
    assert!(ds
        .sample(5)
        .unwrap()
        .path
        .ends_with("Training Images/4_right.jpg"));
    // The challenge's own workbook name under ODIR-5K/ works too.
    let dir2 = tempfile::tempdir().unwrap();
    common::write_xlsx(
        &dir2
            .path()
            .join("ODIR-5K_Training_Annotations(Updated)_V2.xlsx"),
        &[(9, "9_left.jpg", "9_right.jpg", [1, 0, 0, 0, 0, 0, 0, 0])],
    );
    write_xlsx_images(
        &dir2.path().join("ODIR-5K/Training Images"),
        &["9_left.jpg", "9_right.jpg"],
    );
    let ds2 = OdirDataset::open(dir2.path(), &OdirOptions::default()).unwrap();
    assert_eq!(ds2.len(), 2);
}

/// OIA-ODIR, the dataset's current home: each set's folder holds `Annotation/<set>
/// annotation (English).xlsx` beside `Images/`, and the labelled test sets open as the
/// training set does (as `--val-data` or `evaluate --data`, without `--image-dir`).
#[test]
fn oia_odir_sets_open_with_their_annotation_folder_and_images() {
    let dir = tempfile::tempdir().unwrap();
    for (set, workbook) in [
        ("Training Set", "training annotation (English).xlsx"),
        (
            "Off-site Test Set",
            "off-site test annotation (English).xlsx",
        ),
        ("On-site Test Set", "on-site test annotation (English).xlsx"),
    ] {
        let root = dir.path().join(set);
        std::fs::create_dir_all(root.join("Annotation")).unwrap();
        common::write_xlsx(
            &root.join("Annotation").join(workbook),
            &[
                (2, "2_left.jpg", "2_right.jpg", [0, 0, 1, 0, 0, 0, 0, 0]),
                (7, "7_left.jpg", "7_right.jpg", [1, 0, 0, 0, 0, 0, 0, 0]),
            ],
        );
        write_xlsx_images(
            &root.join("Images"),
            &["2_left.jpg", "2_right.jpg", "7_left.jpg", "7_right.jpg"],
        );
        let ds = OdirDataset::open(&root, &OdirOptions::default()).unwrap();
        assert_eq!(ds.layout(), Layout::Challenge, "{set}");
        assert_eq!((ds.len(), ds.patient_count()), (4, 2), "{set}");
        assert_eq!(ds.image_dir(), root.join("Images"));
        let paths: Vec<_> = ds.samples().iter().map(|s| s.path.clone()).collect();
        let expected: Vec<_> = ["2_left.jpg", "2_right.jpg", "7_left.jpg", "7_right.jpg"]
            .iter()
            .map(|f| root.join("Images").join(f))
            .collect();
        assert_eq!(paths, expected, "{set}");
        assert_eq!(
            ds.sample(1).unwrap().labels,
            [0., 0., 1., 0., 0., 0., 0., 0.]
        );
    }
}

/// `--data` one level off: an images folder names its data folder, an OIA-ODIR root its
/// `Training Set` (its annotations come first of the three sets'), and a Kaggle download's
/// `ODIR-5K/` the download (its `full_df.csv` before the workbook in `ODIR-5K/ODIR-5K/`);
/// the challenge's `Testing Images` names no labelled folder.
#[test]
fn a_data_folder_one_level_off_names_the_one_meant() {
    let message = |root: &Path| {
        let e = OdirDataset::open(root, &OdirOptions::default()).unwrap_err();
        assert!(matches!(e, DataError::MissingAnnotations { .. }), "{e}");
        e.to_string()
    };
    let dir = tempfile::tempdir().unwrap();
    let kaggle = dir.path().join("kaggle");
    common::valid_csv_layout(&kaggle, 1);
    let images = kaggle.join("preprocessed_images");
    assert_eq!(
        message(&images),
        format!(
            "no ODIR annotation file in '{}': did you mean --data '{}'?",
            images.display(),
            kaggle.display()
        )
    );
    let nested = kaggle.join("ODIR-5K");
    std::fs::create_dir_all(nested.join("ODIR-5K")).unwrap();
    common::write_xlsx(
        &nested.join("ODIR-5K/data.xlsx"),
        &[(1, "1_left.jpg", "1_right.jpg", [1, 0, 0, 0, 0, 0, 0, 0])],
    );
    assert_eq!(
        message(&nested),
        format!(
            "no ODIR annotation file in '{}': did you mean --data '{}'?",
            nested.display(),
            kaggle.display()
        )
    );

    // The challenge's test images beside its workbook: the workbook labels the training
    // images, so it is not suggested; the folder is for `predict`.
    let challenge = dir.path().join("ODIR-5K");
    let testing = challenge.join("Testing Images");
    std::fs::create_dir_all(&testing).unwrap();
    common::write_xlsx(
        &challenge.join("data.xlsx"),
        &[(1, "1_left.jpg", "1_right.jpg", [1, 0, 0, 0, 0, 0, 0, 0])],
    );
    let refused = message(&testing);
    assert!(!refused.contains("did you mean"), "{refused}");
    assert!(refused.contains("`ddp-train predict`"), "{refused}");

    let oia = dir.path().join("OIA-ODIR");
    for (set, workbook) in [
        ("Training Set", "training annotation (English).xlsx"),
        (
            "Off-site Test Set",
            "off-site test annotation (English).xlsx",
        ),
        ("On-site Test Set", "on-site test annotation (English).xlsx"),
    ] {
        std::fs::create_dir_all(oia.join(set).join("Annotation")).unwrap();
        common::write_xlsx(
            &oia.join(set).join("Annotation").join(workbook),
            &[(2, "2_left.jpg", "2_right.jpg", [0, 0, 1, 0, 0, 0, 0, 0])],
        );
    }
    assert_eq!(
        message(&oia),
        format!(
            "no ODIR annotation file in '{}': did you mean --data '{}'?",
            oia.display(),
            oia.join("Training Set").display()
        )
    );
}

/// The challenge's training archive extracted by a tool that adds the archive's name:
/// `ODIR-5K_Training_Images/ODIR-5K_Training_Dataset/` beside the V2 workbook.
#[test]
fn challenge_archive_extracted_into_its_own_folder_is_found() {
    let dir = tempfile::tempdir().unwrap();
    common::write_xlsx(
        &dir.path()
            .join("ODIR-5K_Training_Annotations(Updated)_V2.xlsx"),
        &[(3, "3_left.jpg", "3_right.jpg", [0, 1, 0, 0, 0, 0, 0, 0])],
    );
    let images = dir
        .path()
        .join("ODIR-5K_Training_Images/ODIR-5K_Training_Dataset");
    write_xlsx_images(&images, &["3_left.jpg", "3_right.jpg"]);
    let ds = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap();
    assert_eq!((ds.layout(), ds.len()), (Layout::Challenge, 2));
    assert_eq!(ds.image_dir(), images);
    assert_eq!(ds.sample(1).unwrap().path, images.join("3_right.jpg"));
}

#[test]
fn challenge_workbook_has_no_per_eye_labels() {
    let dir = tempfile::tempdir().unwrap();
    common::write_xlsx(
        &dir.path().join("data.xlsx"),
        &[(0, "0_left.jpg", "0_right.jpg", [1, 0, 0, 0, 0, 0, 0, 0])],
    );
    write_xlsx_images(
        &dir.path().join("Training Images"),
        &["0_left.jpg", "0_right.jpg"],
    );
    let options = OdirOptions {
        labels: LabelMode::PerEye,
        ..OdirOptions::default()
    };
    let e = OdirDataset::open(dir.path(), &options).unwrap_err();
    assert!(
        matches!(&e, DataError::MissingColumn { column, .. } if column == "target"),
        "{e}"
    );
}

#[test]
fn challenge_workbook_rejects_a_label_that_is_not_binary() {
    let dir = tempfile::tempdir().unwrap();
    common::write_xlsx(
        &dir.path().join("data.xlsx"),
        &[
            (0, "0_left.jpg", "0_right.jpg", [1, 0, 0, 0, 0, 0, 0, 0]),
            (1, "1_left.jpg", "1_right.jpg", [0, 0, 3, 0, 0, 0, 0, 0]),
        ],
    );
    write_xlsx_images(&dir.path().join("Training Images"), &["0_left.jpg"]);
    let e = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap_err();
    match e {
        DataError::InvalidLabel {
            row, column, value, ..
        } => {
            assert_eq!((row, column.as_str(), value.as_str()), (3, "G", "3"));
        }
        other => panic!("expected InvalidLabel, got {other}"),
    }
}

/// One row per patient: an ID on two rows (which used to leave the patient the labels of
/// the last) is refused, naming the rows.
#[test]
fn challenge_workbook_refuses_a_patient_on_two_rows() {
    let dir = tempfile::tempdir().unwrap();
    common::write_xlsx(
        &dir.path().join("data.xlsx"),
        &[
            (0, "0_left.jpg", "0_right.jpg", [1, 0, 0, 0, 0, 0, 0, 0]),
            (1, "1_left.jpg", "1_right.jpg", [0, 1, 0, 0, 0, 0, 0, 0]),
            (2, "2_left.jpg", "2_right.jpg", [1, 0, 0, 0, 0, 0, 0, 0]),
            (1, "1b_left.jpg", "1b_right.jpg", [0, 0, 1, 0, 0, 0, 0, 0]),
        ],
    );
    write_xlsx_images(&dir.path().join("Training Images"), &["0_left.jpg"]);
    let e = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap_err();
    match &e {
        DataError::DuplicatePatient { id, rows, .. } => {
            assert_eq!((*id, &rows[..]), (1, &[3, 5][..]))
        }
        other => panic!("expected DuplicatePatient, got {other}"),
    }
    assert_eq!(
        e.to_string(),
        format!(
            "annotation file '{}' lists patient 1 on rows 3, 5: the workbook has one row per \
             patient (both eyes' images on it)",
            dir.path().join("data.xlsx").display()
        )
    );
}

#[test]
fn split_keeps_both_eyes_of_a_patient_together_and_is_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    common::valid_csv_layout(dir.path(), 40);
    let ds = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap();
    let split = split_by_patient(&ds, 0.25, 11).unwrap();
    assert_eq!(split, split_by_patient(&ds, 0.25, 11).unwrap());
    assert_ne!(split, split_by_patient(&ds, 0.25, 12).unwrap());
    assert_eq!(split.val.len(), 20, "10 of 40 patients, 2 eyes each");
    assert_eq!(split.train.len() + split.val.len(), 80);
    let patients = |idx: &[usize]| -> HashSet<u64> {
        idx.iter()
            .map(|&i| ds.sample(i).unwrap().patient_id)
            .collect()
    };
    let (pt, pv) = (patients(&split.train), patients(&split.val));
    assert!(pt.is_disjoint(&pv));
    assert_eq!(pt.len() + pv.len(), 40);
    assert!(split.train.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(all_indices(&ds).unwrap(), (0..80).collect::<Vec<_>>());
}

#[test]
fn empty_split_is_an_error_naming_the_side() {
    let dir = tempfile::tempdir().unwrap();
    common::valid_csv_layout(dir.path(), 3);
    let ds = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap();
    // round(0.1 * 3) = 0 validation patients.
    let e = split_by_patient(&ds, 0.1, 0).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::EmptySplit {
                side: "validation",
                patients: 3,
                ..
            }
        ),
        "{e}"
    );
    // round(0.9 * 3) = 3: nothing left to train on.
    let e = split_by_patient(&ds, 0.9, 0).unwrap_err();
    assert!(
        matches!(e, DataError::EmptySplit { side: "train", .. }),
        "{e}"
    );
    for bad in [0.0, 1.0, -0.5, f64::NAN] {
        assert!(matches!(
            split_by_patient(&ds, bad, 0),
            Err(DataError::InvalidParameter { .. })
        ));
    }
}
