//! Annotation files from outside: arbitrary bytes, and real annotation files with bytes
//! changed or cut off, give a result or a typed error from `read_csv` / `read_xlsx`, never a
//! panic.
#![cfg(feature = "odir")]

mod common;

use std::path::Path;

use ddp_data::odir::{read_csv, read_xlsx, LabelMode};
use proptest::prelude::*;

/// A valid `full_df.csv` of three patients.
fn csv_bytes() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        common::valid_csv_layout(dir.path(), 3);
        std::fs::read(dir.path().join("full_df.csv")).unwrap()
    })
}

/// A valid challenge workbook of two patients.
fn xlsx_bytes() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| {
        let normal = [1, 0, 0, 0, 0, 0, 0, 0];
        common::xlsx_bytes(&[
            (1, "1_left.jpg", "1_right.jpg", normal),
            (2, "2_left.jpg", "2_right.jpg", normal),
        ])
    })
}

/// Writes `bytes` as `name` in a fresh folder and reads it with `read`, in every label mode;
/// whether any read succeeded.
fn read_as(
    name: &str,
    bytes: &[u8],
    read: fn(&Path, LabelMode) -> Result<ddp_data::odir::Annotations, ddp_data::DataError>,
) -> bool {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).unwrap();
    // Every mode is read (no short cut), so that each one's path meets the bytes.
    let read: Vec<bool> = [LabelMode::Auto, LabelMode::PerEye, LabelMode::Patient]
        .into_iter()
        .map(|mode| read(&path, mode).is_ok())
        .collect();
    read.contains(&true)
}

fn damage(
    mut bytes: Vec<u8>,
    changes: Vec<(prop::sample::Index, u8)>,
    cut: Option<prop::sample::Index>,
) -> Vec<u8> {
    for (at, value) in changes {
        let i = at.index(bytes.len());
        bytes[i] = value;
    }
    if let Some(cut) = cut {
        bytes.truncate(cut.index(bytes.len()));
    }
    bytes
}

#[test]
fn the_undamaged_files_read() {
    assert!(read_as("full_df.csv", csv_bytes(), read_csv));
    assert!(read_as("data.xlsx", xlsx_bytes(), read_xlsx));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        read_as("full_df.csv", &bytes, read_csv);
        prop_assert!(!read_as("data.xlsx", &bytes, read_xlsx));
    }

    #[test]
    fn a_damaged_csv_never_panics(
        changes in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        read_as("full_df.csv", &damage(csv_bytes().to_vec(), changes, cut), read_csv);
    }

    #[test]
    fn a_damaged_workbook_never_panics(
        changes in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        read_as("data.xlsx", &damage(xlsx_bytes().to_vec(), changes, cut), read_xlsx);
    }
}
