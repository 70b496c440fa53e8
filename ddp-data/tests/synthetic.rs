//! The synthetic ODIR sample: deterministic, in the redistribution layout, loadable.
#![cfg(feature = "odir")]

use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_data::odir::{LabelMode, LabelSource, Layout, OdirDataset, OdirOptions};

fn files(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir.join("preprocessed_images"))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    out.sort();
    out.push((
        "full_df.csv".into(),
        std::fs::read(dir.join("full_df.csv")).unwrap(),
    ));
    out
}

#[test]
fn same_seed_gives_identical_files_and_another_seed_does_not() {
    let config = SyntheticConfig {
        images: 9,
        size: 48,
        seed: 21,
        quality: 85,
        ..Default::default()
    };
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let summary = generate(a.path(), &config).unwrap();
    generate(b.path(), &config).unwrap();
    generate(
        c.path(),
        &SyntheticConfig {
            seed: 22,
            ..config.clone()
        },
    )
    .unwrap();
    assert_eq!(summary.images, 9);
    assert_eq!(summary.patients, 5);
    let (fa, fb, fc) = (files(a.path()), files(b.path()), files(c.path()));
    assert_eq!(fa.len(), 10, "9 images + the csv");
    assert_eq!(fa, fb);
    assert_ne!(fa, fc);
}

#[test]
fn sample_loads_through_the_real_code_path_with_consistent_labels() {
    let dir = tempfile::tempdir().unwrap();
    let summary = generate(
        dir.path(),
        &SyntheticConfig {
            images: 40,
            size: 64,
            seed: 5,
            quality: 90,
            ..Default::default()
        },
    )
    .unwrap();
    let per_eye = OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap();
    assert_eq!(per_eye.layout(), Layout::Redistribution);
    assert_eq!(per_eye.label_source(), LabelSource::PerEye);
    assert_eq!(per_eye.len(), 40);
    assert_eq!(per_eye.patient_count(), 20);
    assert_eq!(per_eye.label_counts(), summary.label_counts);
    // Each eye is either normal alone or has at least one disease.
    for s in per_eye.samples() {
        let diseases = s.labels[1..].iter().filter(|&&l| l == 1.0).count();
        assert_eq!(s.labels[0] == 1.0, diseases == 0, "{:?}", s.labels);
    }
    let options = OdirOptions {
        labels: LabelMode::Patient,
        ..OdirOptions::default()
    };
    let patient = OdirDataset::open(dir.path(), &options).unwrap();
    for pair in per_eye.samples().chunks(2).zip(patient.samples().chunks(2)) {
        let (eyes, pat) = pair;
        assert_eq!(pat[0].labels, pat[1].labels);
        for k in 1..8 {
            let any = eyes.iter().any(|e| e.labels[k] == 1.0);
            assert_eq!(pat[0].labels[k] == 1.0, any, "label {k}");
        }
    }
    // Every label occurs in a sample of this size.
    assert!(
        summary.label_counts.iter().all(|&c| c > 0),
        "{:?}",
        summary.label_counts
    );
}

#[test]
fn invalid_configurations_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    for bad in [
        SyntheticConfig {
            images: 0,
            ..SyntheticConfig::default()
        },
        SyntheticConfig {
            size: 8,
            ..SyntheticConfig::default()
        },
        SyntheticConfig {
            quality: 0,
            ..SyntheticConfig::default()
        },
    ] {
        assert!(matches!(
            generate(dir.path(), &bad),
            Err(ddp_data::DataError::InvalidParameter { .. })
        ));
    }
}

#[test]
fn the_test_split_is_a_labelled_folder_whose_images_are_an_unlabelled_one() {
    let dir = tempfile::tempdir().unwrap();
    let summary = generate(
        dir.path(),
        &SyntheticConfig {
            images: 6,
            size: 32,
            seed: 4,
            test_images: 5,
            ..SyntheticConfig::default()
        },
    )
    .unwrap();
    let test = summary.test.expect("a test split");
    assert_eq!((test.images, test.patients), (5, 3));
    // Patients 0..3 are the sample's; the test split's continue from 3.
    let labelled = OdirDataset::open(&dir.path().join("test"), &OdirOptions::default()).unwrap();
    let ids: Vec<u64> = labelled.samples().iter().map(|s| s.patient_id).collect();
    assert_eq!(ids, [3, 3, 4, 4, 5]);
    assert!(labelled
        .samples()
        .iter()
        .all(|s| s.patient_labels.is_some()));
    let images = dir.path().join("test/preprocessed_images");
    let unlabelled = OdirDataset::open_unlabelled(&images).unwrap();
    let names: Vec<String> = unlabelled
        .samples()
        .iter()
        .map(|s| s.path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "3_left.jpg",
            "3_right.jpg",
            "4_left.jpg",
            "4_right.jpg",
            "5_left.jpg"
        ]
    );
    assert!(unlabelled
        .samples()
        .iter()
        .all(|s| s.patient_labels.is_none() && s.labels == [0.0; 8]));
    // Its images are the labelled folder's, byte for byte.
    for s in unlabelled.samples() {
        assert_eq!(
            std::fs::read(&s.path).unwrap(),
            std::fs::read(labelled.image_dir().join(s.path.file_name().unwrap())).unwrap()
        );
    }
}

#[test]
fn an_unlabelled_folder_names_every_file_that_is_not_a_test_image() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "1_left.jpg",
        "1_right.jpg",
        "notes.txt",
        "2_middle.jpg",
        ".hidden",
    ] {
        std::fs::write(dir.path().join(name), b"x").unwrap();
    }
    std::fs::write(dir.path().join("1_LEFT.jpeg"), b"x").unwrap();
    // Beside the test images, a folder of more: their patients would be left out.
    std::fs::create_dir(dir.path().join("batch2")).unwrap();
    std::fs::write(dir.path().join("batch2/5_left.jpg"), b"x").unwrap();
    std::fs::create_dir(dir.path().join("other")).unwrap();
    std::fs::write(dir.path().join("other/readme.txt"), b"x").unwrap();
    let err = OdirDataset::open_unlabelled(dir.path()).unwrap_err();
    match &err {
        ddp_data::DataError::UnexpectedFiles { files, .. } => assert_eq!(
            files,
            &[
                "1_left.jpg (a second left eye of patient 1, besides 1_LEFT.jpeg)",
                "2_middle.jpg",
                "batch2/ (a folder of more test images, which are not read: move them up, or \
                 give that folder on its own)",
                "notes.txt"
            ]
        ),
        other => panic!("unexpected error {other}"),
    }
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        OdirDataset::open_unlabelled(empty.path()),
        Err(ddp_data::DataError::NoImages {
            test_images: None,
            ..
        })
    ));
}

/// A dataset's top folder given where test images are expected names the folder of test
/// images below it: the challenge's `Testing Images` beside its workbook (not `Training
/// Images`, whose names look the same), and Kaggle's, two levels down beside no file.
#[test]
fn a_datasets_top_folder_names_its_test_images() {
    let top = tempfile::tempdir().unwrap();
    let challenge = top.path().join("ODIR-5K");
    for folder in ["Training Images", "Testing Images"] {
        std::fs::create_dir_all(challenge.join(folder)).unwrap();
        std::fs::write(challenge.join(folder).join("1_left.jpg"), b"x").unwrap();
    }
    std::fs::write(challenge.join("data.xlsx"), b"x").unwrap();
    let err = OdirDataset::open_unlabelled(&challenge).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "'{}' holds 1 file(s) not named <id>_left.jpg or <id>_right.jpg: data.xlsx; an \
             unlabelled folder holds only the challenge's test images (did you mean --data \
             '{}'?)",
            challenge.display(),
            challenge.join("Testing Images").display()
        )
    );
    let kaggle = top.path().join("kaggle");
    let nested = kaggle.join("ODIR-5K/ODIR-5K/Testing Images");
    std::fs::create_dir_all(&nested).unwrap();
    std::fs::write(nested.join("7_right.jpg"), b"x").unwrap();
    let err = OdirDataset::open_unlabelled(&kaggle).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "'{}' holds no images named <id>_left.jpg or <id>_right.jpg (did you mean --data \
             '{}'?)",
            kaggle.display(),
            nested.display()
        )
    );
}

/// A second sample is not written over a first: the folder must be new or empty, and the
/// first sample stays as it was.
#[test]
fn a_folder_that_holds_files_is_refused_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let config = |images| SyntheticConfig {
        images,
        size: 48,
        ..Default::default()
    };
    generate(dir.path(), &config(6)).unwrap();
    let before = files(dir.path());
    match generate(dir.path(), &config(2)) {
        Err(err @ ddp_data::DataError::NotEmpty { .. }) => assert_eq!(
            err.to_string(),
            format!(
                "'{}' is not empty: a synthetic sample is written into a new or empty folder \
                 (give another, or remove this one first)",
                dir.path().display()
            )
        ),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(files(dir.path()), before);
}
