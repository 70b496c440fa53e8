//! Annotation files from outside: arbitrary bytes, and real annotation files with bytes
//! changed or cut off, give a result or a typed error from `read_csv` / `read_xlsx`, never a
//! panic.
#![cfg(feature = "odir")]

mod common;

use std::path::Path;

use ddp_data::odir::{read_csv, read_xlsx, LabelMode};
use proptest::prelude::*;
use rust_xlsxwriter::Workbook;

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
        let mut wb = Workbook::new();
        let ws = wb.add_worksheet();
        let headers = [
            "ID",
            "Patient Age",
            "Patient Sex",
            "Left-Fundus",
            "Right-Fundus",
            "Left-Diagnostic Keywords",
            "Right-Diagnostic Keywords",
            "N",
            "D",
            "G",
            "C",
            "A",
            "H",
            "M",
            "O",
        ];
        for (c, h) in headers.iter().enumerate() {
            ws.write_string(0, c as u16, *h).unwrap();
        }
        for r in 1..=2u32 {
            ws.write_number(r, 0, f64::from(r)).unwrap();
            ws.write_number(r, 1, 57).unwrap();
            ws.write_string(r, 2, "Male").unwrap();
            ws.write_string(r, 3, format!("{r}_left.jpg")).unwrap();
            ws.write_string(r, 4, format!("{r}_right.jpg")).unwrap();
            ws.write_string(r, 5, "normal fundus").unwrap();
            ws.write_string(r, 6, "normal fundus").unwrap();
            for c in 7..15u16 {
                ws.write_number(r, c, if c == 7 { 1 } else { 0 }).unwrap();
            }
        }
        wb.save_to_buffer().unwrap()
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
