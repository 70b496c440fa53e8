//! Every kind of bad input gets its own error, naming the file, row, column or value.
#![cfg(feature = "odir")]

mod common;

use common::{csv_row, valid_csv_layout, write_csv_layout};
use ddp_data::odir::{read_xlsx, LabelMode, OdirDataset, OdirOptions};
use ddp_data::DataError;

fn open(root: &std::path::Path) -> Result<OdirDataset, DataError> {
    OdirDataset::open(root, &OdirOptions::default())
}

/// Without an ODIR folder beside it (see `layouts.rs` for one), the message says what was
/// looked for, where the layouts are described, and what takes a folder of images alone.
#[test]
fn missing_annotation_file_lists_what_was_looked_for() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(empty.join("images")).unwrap();
    let e = open(&empty).unwrap_err();
    match &e {
        DataError::MissingAnnotations {
            tried, suggestion, ..
        } => {
            assert_eq!(tried[0], "full_df.csv");
            assert!(tried.iter().any(|t| t == "data.xlsx"));
            assert_eq!(suggestion, &None);
        }
        other => panic!("expected MissingAnnotations, got {other}"),
    }
    assert_eq!(
        e.to_string(),
        format!(
            "no ODIR annotation file in '{}': looked for full_df.csv, data.xlsx, \
             ODIR-5K_Training_Annotations(Updated)_V2.xlsx, Annotation/training annotation \
             (English).xlsx, Annotation/off-site test annotation (English).xlsx, \
             Annotation/on-site test annotation (English).xlsx; --data takes Kaggle's \
             download, the challenge's folder or an OIA-ODIR set (docs/odir.md, \"The data\"), \
             and a folder of images alone is for `ddp-train predict`",
            empty.display()
        )
    );
}

#[test]
fn missing_column_is_named_with_the_columns_found() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("preprocessed_images")).unwrap();
    std::fs::write(
        dir.path().join("full_df.csv"),
        "ID,target\n1,\"[1, 0, 0, 0, 0, 0, 0, 0]\"\n",
    )
    .unwrap();
    let e = open(dir.path()).unwrap_err();
    match &e {
        DataError::MissingColumn { column, found, .. } => {
            assert_eq!(column, "filename");
            assert_eq!(found, &["ID", "target"]);
        }
        other => panic!("expected MissingColumn, got {other}"),
    }
    // Patient labels need N..O.
    std::fs::write(
        dir.path().join("full_df.csv"),
        "ID,filename,N,D\n1,a.jpg,1,0\n",
    )
    .unwrap();
    let options = OdirOptions {
        labels: LabelMode::Patient,
        ..OdirOptions::default()
    };
    let e = OdirDataset::open(dir.path(), &options).unwrap_err();
    assert!(
        matches!(&e, DataError::MissingColumn { column, .. } if column == "G"),
        "{e}"
    );
    // Per-eye labels beside some of N..O: the patient columns are all there or none.
    std::fs::write(
        dir.path().join("full_df.csv"),
        "ID,filename,target,N,D,G,C,H,M,O\n1,a.jpg,\"[1, 0, 0, 0, 0, 0, 0, 0]\",1,0,0,0,0,0,0\n",
    )
    .unwrap();
    let e = open(dir.path()).unwrap_err();
    assert!(
        matches!(&e, DataError::MissingColumn { column, .. } if column == "A"),
        "{e}"
    );
}

#[test]
fn label_other_than_zero_or_one_names_row_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let rows = [
        csv_row(
            1,
            "1_left.jpg",
            "[1, 0, 0, 0, 0, 0, 0, 0]",
            [1, 0, 0, 0, 0, 0, 0, 0],
        ),
        csv_row(
            2,
            "2_left.jpg",
            "[1, 0, 0, 0, 0, 0, 0, 0]",
            [1, 0, 0, 0, 0, 0, 0, 0],
        )
        .replace(",1,0,0,0,0,0,0,0,", ",1,0,0,0,0,yes,0,0,"),
    ];
    write_csv_layout(dir.path(), &rows, &["1_left.jpg", "2_left.jpg"]);
    let options = OdirOptions {
        labels: LabelMode::Patient,
        ..OdirOptions::default()
    };
    let e = OdirDataset::open(dir.path(), &options).unwrap_err();
    match &e {
        DataError::InvalidLabel {
            row, column, value, ..
        } => assert_eq!((*row, column.as_str(), value.as_str()), (3, "H", "yes")),
        other => panic!("expected InvalidLabel, got {other}"),
    }
    assert!(
        e.to_string().contains("expected 0 or 1, found 'yes'"),
        "{e}"
    );
}

#[test]
fn unparsable_target_names_the_row_and_value() {
    let dir = tempfile::tempdir().unwrap();
    let rows = [
        csv_row(
            1,
            "1_left.jpg",
            "[1, 0, 0, 0, 0, 0, 0, 0]",
            [1, 0, 0, 0, 0, 0, 0, 0],
        ),
        csv_row(1, "1_right.jpg", "[1, 0, 0]", [1, 0, 0, 0, 0, 0, 0, 0]),
    ];
    write_csv_layout(dir.path(), &rows, &["1_left.jpg", "1_right.jpg"]);
    let e = open(dir.path()).unwrap_err();
    assert!(
        matches!(&e, DataError::InvalidTarget { row: 3, value, .. } if value == "[1, 0, 0]"),
        "{e}"
    );
}

/// Rows are the lines a record starts on (header = 1) whatever ends the lines: the Kaggle
/// `full_df.csv` ends them with CRLF, whose `\n` the csv crate counts one record late.
#[test]
fn rows_are_the_lines_records_start_on_with_any_line_ending() {
    let t = "[1, 0, 0, 0, 0, 0, 0, 0]";
    let p = [1, 0, 0, 0, 0, 0, 0, 0];
    let bad_target = [
        csv_row(1, "1_left.jpg", t, p),
        csv_row(1, "1_right.jpg", "[1, 0, 0]", p),
    ];
    let disagreeing = [
        csv_row(7, "7_left.jpg", t, p),
        csv_row(7, "7_right.jpg", t, [0, 1, 0, 0, 0, 0, 0, 0]),
    ];
    // A quoted cell over lines 2 and 3, then a blank line: the bad record starts on line 5.
    let spread = [
        csv_row(1, "1_left.jpg", t, p).replacen("\"kw\"", "\"kw\nsecond line\"", 1),
        String::new(),
        csv_row(1, "1_right.jpg", "[1, 0, 0]", p),
    ];
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("full_df.csv");
    let images = ["1_left.jpg", "1_right.jpg", "7_left.jpg", "7_right.jpg"];
    for ending in ["\n", "\r\n", "\r"] {
        let write = |rows: &[String]| {
            write_csv_layout(dir.path(), rows, &images);
            let text = std::fs::read_to_string(&csv).unwrap();
            std::fs::write(&csv, text.replace('\n', ending)).unwrap();
        };
        write(&bad_target);
        let e = open(dir.path()).unwrap_err();
        assert!(
            matches!(&e, DataError::InvalidTarget { row: 3, .. }),
            "{ending:?}: {e}"
        );
        write(&disagreeing);
        match open(dir.path()).unwrap_err() {
            DataError::InconsistentPatient { id, rows, .. } => {
                assert_eq!((id, rows), (7, (2, 3)), "{ending:?}")
            }
            other => panic!("{ending:?}: expected InconsistentPatient, got {other}"),
        }
        write(&spread);
        let e = open(dir.path()).unwrap_err();
        assert!(
            matches!(&e, DataError::InvalidTarget { row: 5, .. }),
            "{ending:?}: {e}"
        );
        // A row cut short after its ID: the reader's own error, with the same numbering.
        write(&[csv_row(1, "1_left.jpg", t, p), "1".into()]);
        match open(dir.path()).unwrap_err() {
            DataError::Annotations { message, .. } => assert!(
                message.starts_with("row 3 has 1 field(s) where the header has "),
                "{ending:?}: {message}"
            ),
            other => panic!("{ending:?}: expected Annotations, got {other}"),
        }
        // A Latin-1 byte (0xe9) in the row's first keyword cell: the row, the column by name.
        write(&[
            csv_row(1, "1_left.jpg", t, p),
            csv_row(1, "1_right.jpg", t, p),
        ]);
        let mut text = std::fs::read(&csv).unwrap();
        let kw = text.windows(4).rposition(|w| w == b"\"kw\"").unwrap();
        let kw = text[..kw].windows(4).rposition(|w| w == b"\"kw\"").unwrap();
        text[kw + 2] = 0xe9;
        std::fs::write(&csv, text).unwrap();
        match open(dir.path()).unwrap_err() {
            DataError::Annotations { message, .. } => assert_eq!(
                message,
                "row 3: column 'Left-Diagnostic Keywords' is not UTF-8 (an invalid byte after \
                 1 valid bytes of the cell): save the file as UTF-8",
                "{ending:?}"
            ),
            other => panic!("{ending:?}: expected Annotations, got {other}"),
        }
    }
}

#[test]
fn unparsable_patient_id_is_an_invalid_cell() {
    let dir = tempfile::tempdir().unwrap();
    let rows = [csv_row(
        1,
        "1_left.jpg",
        "[1, 0, 0, 0, 0, 0, 0, 0]",
        [1, 0, 0, 0, 0, 0, 0, 0],
    )
    .replacen('1', "x1", 1)];
    write_csv_layout(dir.path(), &rows, &["1_left.jpg"]);
    let e = open(dir.path()).unwrap_err();
    assert!(
        matches!(&e, DataError::InvalidCell { row: 2, column, value, .. } if column == "ID" && value == "x1"),
        "{e}"
    );
}

/// What a missing-images error advises, after the names.
const ADVICE: &str = " (check that this is the images' folder, or give theirs with \
                      --image-dir; else remove the rows of the missing images from the \
                      annotation file)";

#[test]
fn every_missing_image_is_listed() {
    let dir = tempfile::tempdir().unwrap();
    let names = valid_csv_layout(dir.path(), 4);
    for gone in [&names[1], &names[4], &names[7]] {
        std::fs::remove_file(dir.path().join("preprocessed_images").join(gone)).unwrap();
    }
    let e = open(dir.path()).unwrap_err();
    match &e {
        DataError::MissingImages { files, .. } => {
            assert_eq!(files, &["1_right.jpg", "3_left.jpg", "4_right.jpg"]);
        }
        other => panic!("expected MissingImages, got {other}"),
    }
    let msg = e.to_string();
    assert!(msg.starts_with("3 image(s) listed in"), "{msg}");
    assert!(
        msg.ends_with(&format!("1_right.jpg, 3_left.jpg, 4_right.jpg{ADVICE}")),
        "{msg}"
    );
    // Thousands of missing images (a wrong folder) make a message of ten names and a count;
    // the error still holds every one.
    std::fs::remove_dir_all(dir.path().join("preprocessed_images")).unwrap();
    std::fs::create_dir(dir.path().join("preprocessed_images")).unwrap();
    let e = open(dir.path()).unwrap_err();
    let DataError::MissingImages { files, .. } = &e else {
        panic!("expected MissingImages, got {e}");
    };
    assert_eq!(files.len(), 8);
    let msg = e.to_string();
    assert!(
        msg.starts_with("8 image(s) listed in")
            && msg.ends_with(&format!("4_left.jpg, 4_right.jpg{ADVICE}")),
        "{msg}"
    );
    let names = valid_csv_layout(dir.path(), 6);
    std::fs::remove_dir_all(dir.path().join("preprocessed_images")).unwrap();
    std::fs::create_dir(dir.path().join("preprocessed_images")).unwrap();
    let e = open(dir.path()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("12 image(s)")
            && msg.ends_with(&format!("{}, {} and 2 more{ADVICE}", names[8], names[9])),
        "{msg}"
    );
}

#[test]
fn a_data_folder_that_does_not_exist_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let gone = dir.path().join("odir-5k");
    let e = open(&gone).unwrap_err();
    assert!(
        matches!(&e, DataError::ListDir { dir, .. } if *dir == gone),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        format!("cannot list folder '{}'", gone.display())
    );
    let cause = std::error::Error::source(&e).expect("the OS error");
    assert!(cause.to_string().starts_with("No such file"), "{cause}");
}

#[test]
fn missing_image_folder_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    valid_csv_layout(dir.path(), 1);
    std::fs::remove_dir_all(dir.path().join("preprocessed_images")).unwrap();
    let e = open(dir.path()).unwrap_err();
    assert!(matches!(e, DataError::MissingImageDir { .. }), "{e}");
}

#[test]
fn duplicate_file_names_are_listed_with_their_rows() {
    let dir = tempfile::tempdir().unwrap();
    let t = "[1, 0, 0, 0, 0, 0, 0, 0]";
    let p = [1, 0, 0, 0, 0, 0, 0, 0];
    let rows = [
        csv_row(1, "1_left.jpg", t, p),
        csv_row(1, "1_right.jpg", t, p),
        csv_row(2, "1_left.jpg", t, p),
        csv_row(3, "3_left.jpg", t, p),
        csv_row(3, "3_left.jpg", t, p),
    ];
    write_csv_layout(
        dir.path(),
        &rows,
        &["1_left.jpg", "1_right.jpg", "3_left.jpg"],
    );
    let e = open(dir.path()).unwrap_err();
    match &e {
        DataError::DuplicateFiles { duplicates, .. } => assert_eq!(
            duplicates,
            &["1_left.jpg (rows 2, 4)", "3_left.jpg (rows 5, 6)"]
        ),
        other => panic!("expected DuplicateFiles, got {other}"),
    }
}

/// Each row of `full_df.csv` is one image, and its `N`..`O` are the patient's: a patient
/// whose rows disagree is refused, naming both rows and the columns (the last row used to win
/// silently in the patient-level score).
#[test]
fn a_patient_whose_rows_give_different_patient_labels_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let t = "[0, 1, 0, 0, 0, 0, 0, 0]";
    let rows = [
        csv_row(1, "1_left.jpg", t, [0, 1, 0, 0, 0, 0, 0, 0]),
        csv_row(1, "1_right.jpg", t, [0, 1, 0, 0, 0, 0, 0, 0]),
        csv_row(2, "2_left.jpg", t, [0, 1, 0, 0, 0, 0, 0, 1]),
        csv_row(2, "2_right.jpg", t, [0, 0, 0, 0, 0, 0, 0, 1]),
    ];
    let images = ["1_left.jpg", "1_right.jpg", "2_left.jpg", "2_right.jpg"];
    write_csv_layout(dir.path(), &rows, &images);
    let file = dir.path().join("full_df.csv");
    // Whichever labels train (per eye or the patient's), the patient's are read and checked.
    for labels in [LabelMode::Auto, LabelMode::Patient] {
        let options = OdirOptions {
            labels,
            ..OdirOptions::default()
        };
        let e = OdirDataset::open(dir.path(), &options).unwrap_err();
        match &e {
            DataError::InconsistentPatient {
                id, rows, columns, ..
            } => assert_eq!(
                (*id, *rows, &columns[..]),
                (2, (4, 5), &["D".to_string()][..])
            ),
            other => panic!("expected InconsistentPatient, got {other}"),
        }
        assert_eq!(
            e.to_string(),
            format!(
                "annotation file '{}' gives patient 2 different labels on rows 4 and 5 \
                 (column(s) D): the N..O columns are the patient's, the same on each of the \
                 patient's rows; correct one of them",
                file.display()
            )
        );
    }
    // Agreeing rows open.
    let agreeing = [rows[0].clone(), rows[1].clone(), rows[2].clone()];
    write_csv_layout(dir.path(), &agreeing, &images);
    assert_eq!(open(dir.path()).unwrap().len(), 3);
}

#[test]
fn header_without_rows_has_no_samples() {
    let dir = tempfile::tempdir().unwrap();
    write_csv_layout(dir.path(), &[], &[]);
    let e = open(dir.path()).unwrap_err();
    assert!(matches!(e, DataError::NoSamples { .. }), "{e}");
}

#[test]
fn ragged_csv_is_an_annotation_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    valid_csv_layout(dir.path(), 1);
    let path = dir.path().join("full_df.csv");
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("5,only,three\n");
    std::fs::write(&path, text).unwrap();
    let e = open(dir.path()).unwrap_err();
    assert!(matches!(e, DataError::Annotations { .. }), "{e}");
    assert!(e.to_string().contains("full_df.csv"), "{e}");
}

/// A value at a sheet's last cell (XFD1048576) costs nothing: a dense range to it would be
/// 17 G cells (550 GB, an allocation failure that aborts the process); the sheet is read
/// cell by cell. Its row has no patient ID, which is named; beside a patient it is ignored.
#[test]
fn a_value_at_the_sheets_last_cell_is_read_cell_by_cell() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data.xlsx");
    let with_value_at = |row: u32, col: u16| {
        let mut wb =
            common::xlsx_workbook(&[(7, "7_left.jpg", "7_right.jpg", [0, 1, 0, 0, 0, 0, 0, 0])]);
        let sheet = wb.worksheet_from_index(0).unwrap();
        sheet.write_string(row, col, "stray").unwrap();
        std::fs::write(&file, wb.save_to_buffer().unwrap()).unwrap();
        read_xlsx(&file, LabelMode::Auto)
    };
    let e = with_value_at(1_048_575, 16_383).unwrap_err();
    match &e {
        DataError::InvalidCell {
            file: named,
            row: 1_048_576,
            column,
            value,
            ..
        } => assert_eq!((named, column.as_str(), value.as_str()), (&file, "ID", "")),
        other => panic!("expected InvalidCell, got {other}"),
    }
    assert!(e.to_string().contains("data.xlsx"), "{e}");
    let read = with_value_at(1, 16_383).unwrap();
    let records: Vec<(&str, u64, usize)> = read
        .records
        .iter()
        .map(|r| (r.file.as_str(), r.patient_id, r.row))
        .collect();
    assert_eq!(records, [("7_left.jpg", 7, 2), ("7_right.jpg", 7, 2)]);
    assert_eq!(read.records[1].labels, [0., 1., 0., 0., 0., 0., 0., 0.]);
}
