//! Reading ODIR annotation files: the redistribution's `full_df.csv` (one row per eye image)
//! and the challenge's `.xlsx` workbook (one row per patient, two images each).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use calamine::{open_workbook_auto, Cell, Data, DataRef, Reader, Sheets};

use crate::error::DataError;

/// The eight ODIR labels, in the order of every label vector this crate produces.
pub const LABELS: [&str; 8] = ["N", "D", "G", "C", "A", "H", "M", "O"];

/// The labels' long names, in [`LABELS`] order.
pub const LABEL_NAMES: [&str; 8] = [
    "normal",
    "diabetic retinopathy",
    "glaucoma",
    "cataract",
    "age-related macular degeneration",
    "hypertension",
    "pathological myopia",
    "other",
];

/// Which labels a sample gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LabelMode {
    /// Per-eye labels (`target`) where the annotation file has them, patient labels otherwise.
    /// The default: a patient's label may describe only one eye (a diabetic patient with one
    /// healthy eye), so per-eye labels are the truer target for a single-eye image.
    #[default]
    Auto,
    /// Per-eye labels from the `target` column; an error where the file has none.
    PerEye,
    /// Patient labels from the `N`..`O` columns, the same for both eyes.
    Patient,
}

/// Which labels the samples actually got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelSource {
    /// From the per-eye `target` column.
    PerEye,
    /// From the patient-level `N`..`O` columns.
    Patient,
}

/// One image as the annotation file lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// The image file name, relative to the image folder.
    pub file: String,
    /// The patient's `ID`.
    pub patient_id: u64,
    /// Multi-hot labels in [`LABELS`] order.
    pub labels: [f32; 8],
    /// The patient's labels (the `N`..`O` columns) when the file has them, whichever labels
    /// `labels` holds: what the challenge scores a patient against.
    pub patient_labels: Option<[f32; 8]>,
    /// The annotation row it came from (header = row 1).
    pub row: usize,
}

/// Everything read from one annotation file.
#[derive(Debug, Clone)]
pub struct Annotations {
    /// The file read.
    pub file: PathBuf,
    /// One record per image, in file order.
    pub records: Vec<Record>,
    /// Which labels the records carry.
    pub label_source: LabelSource,
}

/// Column lookup by header name (trimmed, case-sensitive as the files write them).
struct Columns {
    file: PathBuf,
    headers: Vec<String>,
    index: HashMap<String, usize>,
}

impl Columns {
    fn new(file: &Path, headers: Vec<String>) -> Self {
        let index = headers
            .iter()
            .enumerate()
            .map(|(i, h)| (h.trim().to_string(), i))
            .collect();
        Self {
            file: file.to_path_buf(),
            headers,
            index,
        }
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn get(&self, name: &str) -> Result<usize, DataError> {
        self.index
            .get(name)
            .copied()
            .ok_or_else(|| DataError::MissingColumn {
                file: self.file.clone(),
                column: name.to_string(),
                found: self.headers.clone(),
            })
    }
}

fn parse_binary(file: &Path, row: usize, column: &str, text: &str) -> Result<f32, DataError> {
    match text.trim() {
        "0" | "0.0" => Ok(0.0),
        "1" | "1.0" => Ok(1.0),
        _ => Err(DataError::InvalidLabel {
            file: file.to_path_buf(),
            row,
            column: column.to_string(),
            value: text.to_string(),
        }),
    }
}

/// Parses a `target` cell such as `[1, 0, 0, 0, 0, 0, 0, 0]`.
fn parse_target(file: &Path, row: usize, text: &str) -> Result<[f32; 8], DataError> {
    let bad = || DataError::InvalidTarget {
        file: file.to_path_buf(),
        row,
        value: text.to_string(),
    };
    let inner = text
        .trim()
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .ok_or_else(bad)?;
    let mut out = [0f32; 8];
    let mut n = 0;
    for part in inner.split(',') {
        let v = match part.trim() {
            "0" | "0.0" => 0.0,
            "1" | "1.0" => 1.0,
            _ => return Err(bad()),
        };
        *out.get_mut(n).ok_or_else(bad)? = v;
        n += 1;
    }
    if n != 8 {
        return Err(bad());
    }
    Ok(out)
}

fn parse_id(file: &Path, row: usize, column: &str, text: &str) -> Result<u64, DataError> {
    let t = text.trim();
    let parsed = t.parse::<u64>().ok().or_else(|| {
        // Spreadsheets store integers as floats ("12.0").
        t.parse::<f64>()
            .ok()
            .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1e15)
            .map(|f| f as u64)
    });
    parsed.ok_or_else(|| DataError::InvalidCell {
        file: file.to_path_buf(),
        row,
        column: column.to_string(),
        expected: "a non-negative integer patient ID".to_string(),
        value: text.to_string(),
    })
}

fn non_empty(file: &Path, row: usize, column: &str, text: &str) -> Result<String, DataError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(DataError::InvalidCell {
            file: file.to_path_buf(),
            row,
            column: column.to_string(),
            expected: "an image file name".to_string(),
            value: text.to_string(),
        });
    }
    Ok(t.to_string())
}

fn resolve_source(
    mode: LabelMode,
    has_target: bool,
    cols: &Columns,
) -> Result<LabelSource, DataError> {
    match mode {
        LabelMode::Patient => Ok(LabelSource::Patient),
        LabelMode::Auto if has_target => Ok(LabelSource::PerEye),
        LabelMode::Auto => Ok(LabelSource::Patient),
        LabelMode::PerEye => {
            if has_target {
                Ok(LabelSource::PerEye)
            } else {
                // Name the column the mode needs.
                cols.get("target").map(|_| LabelSource::PerEye)
            }
        }
    }
}

/// The annotations of `file`, or an error if it listed no images.
fn finish(
    file: &Path,
    records: Vec<Record>,
    source: LabelSource,
) -> Result<Annotations, DataError> {
    if records.is_empty() {
        return Err(DataError::NoSamples {
            file: file.to_path_buf(),
        });
    }
    Ok(Annotations {
        file: file.to_path_buf(),
        records,
        label_source: source,
    })
}

/// Reads the redistribution's `full_df.csv`: needs `ID`, `filename`, and `target` (per-eye
/// labels) or `N`..`O` (patient labels).
pub fn read_csv(file: &Path, mode: LabelMode) -> Result<Annotations, DataError> {
    let open_error = |e: &dyn std::fmt::Display| DataError::Annotations {
        file: file.to_path_buf(),
        message: e.to_string(),
    };
    // Read whole (the redistribution's is a few megabytes) to number the rows from the bytes.
    let text = std::fs::read(file).map_err(|e| open_error(&e))?;
    let mut lines = LineCounter::new(&text);
    let mut reader = csv::ReaderBuilder::new()
        .flexible(false)
        .from_reader(text.as_slice());
    let headers: Vec<String> = reader
        .headers()
        .map_err(|e| open_error(&e))?
        .iter()
        .map(str::to_string)
        .collect();
    let cols = Columns::new(file, headers);
    let id_col = cols.get("ID")?;
    let file_col = cols.get("filename")?;
    let source = resolve_source(mode, cols.has("target"), &cols)?;
    let label_cols = match source {
        LabelSource::PerEye => vec![cols.get("target")?],
        LabelSource::Patient => LABELS
            .iter()
            .map(|l| cols.get(l))
            .collect::<Result<_, _>>()?,
    };
    // The patient columns, read for the challenge's patient-level scores when present: all
    // of them, or none (some of them is a damaged file, which would silently score patients
    // by their eyes' labels instead).
    let patient_cols: Option<Vec<usize>> = if LABELS.iter().any(|l| cols.has(l)) {
        Some(
            LABELS
                .iter()
                .map(|l| cols.get(l))
                .collect::<Result<_, _>>()?,
        )
    } else {
        None
    };
    let mut records = Vec::new();
    for (i, result) in reader.records().enumerate() {
        let record =
            result.map_err(|e| open_error(&record_error(&e, &cols.headers, &mut lines)))?;
        let row = record.position().map_or(i + 2, |p| lines.line_at(p.byte()));
        let cell = |c: usize| record.get(c).unwrap_or("");
        let patient_id = parse_id(file, row, "ID", cell(id_col))?;
        let name = non_empty(file, row, "filename", cell(file_col))?;
        let labels = match source {
            LabelSource::PerEye => parse_target(file, row, cell(label_cols[0]))?,
            LabelSource::Patient => {
                let mut l = [0f32; 8];
                for (k, &c) in label_cols.iter().enumerate() {
                    l[k] = parse_binary(file, row, LABELS[k], cell(c))?;
                }
                l
            }
        };
        let patient_labels = match &patient_cols {
            Some(pc) => {
                let mut l = [0f32; 8];
                for (k, &c) in pc.iter().enumerate() {
                    l[k] = parse_binary(file, row, LABELS[k], cell(c))?;
                }
                Some(l)
            }
            None => None,
        };
        records.push(Record {
            file: name,
            patient_id,
            labels,
            patient_labels,
            row,
        });
    }
    check_patients_agree(file, &records)?;
    finish(file, records, source)
}

/// The csv reader's error `e` about a record, with the record's row as [`LineCounter`]
/// numbers it (the reader's own line is one short in CRLF files) and the column by its
/// name in `headers`.
fn record_error(e: &csv::Error, headers: &[String], lines: &mut LineCounter<'_>) -> String {
    let mut row = |p: &csv::Position| lines.line_at(p.byte());
    match e.kind() {
        csv::ErrorKind::UnequalLengths {
            pos: Some(p),
            expected_len,
            len,
        } => format!(
            "row {} has {len} field(s) where the header has {expected_len}",
            row(p)
        ),
        csv::ErrorKind::Utf8 { pos: Some(p), err } => {
            let column = headers.get(err.field()).map_or("?", String::as_str);
            format!(
                "row {}: column '{column}' is not UTF-8 (an invalid byte after {} valid \
                 bytes of the cell): save the file as UTF-8",
                row(p),
                err.valid_up_to()
            )
        }
        _ => e.to_string(),
    }
}

/// Row numbers as a spreadsheet shows them: the line each record of a CSV file starts on
/// (header = line 1), quoted cells over several lines counted. The csv crate's own
/// `Position::line` counts a CRLF's `\n` only when the next record starts, one line short
/// in every CRLF file such as the Kaggle `full_df.csv` (BurntSushi/rust-csv#395); this
/// counts from the record's byte offset instead.
#[derive(Debug)]
struct LineCounter<'a> {
    text: &'a [u8],
    /// Bytes before this offset are counted.
    counted: usize,
    /// Line breaks before `counted`.
    breaks: usize,
}

impl<'a> LineCounter<'a> {
    fn new(text: &'a [u8]) -> Self {
        Self {
            text,
            counted: 0,
            breaks: 0,
        }
    }

    /// The line of the record that the reader positions at byte `at`: past the line
    /// breaks and blank lines it skips there (the rest of a CRLF among them). CRLF, LF and a
    /// lone CR each end a line, as the reader takes them. Offsets must not decrease (each
    /// byte is counted once).
    fn line_at(&mut self, at: u64) -> usize {
        let text = self.text;
        let at = usize::try_from(at).map_or(text.len(), |a| a.min(text.len()));
        let start = text
            .get(at..)
            .and_then(|rest| rest.iter().position(|b| !matches!(b, b'\r' | b'\n')))
            .map_or(text.len(), |k| at + k);
        let from = self.counted;
        for (k, b) in text.get(from..start).unwrap_or_default().iter().enumerate() {
            let lone_cr = *b == b'\r' && text.get(from + k + 1) != Some(&b'\n');
            self.breaks += usize::from(*b == b'\n' || lone_cr);
        }
        self.counted = self.counted.max(start);
        1 + self.breaks
    }
}

/// An error for the first patient whose rows give different patient labels: one row per image,
/// each repeating its patient's `N`..`O` (the Kaggle redistribution's 6392 rows of 3358
/// patients all agree), so rows that differ are a damaged or hand-edited file, which would
/// otherwise score the patient by whichever row came last.
fn check_patients_agree(file: &Path, records: &[Record]) -> Result<(), DataError> {
    let mut first: HashMap<u64, (usize, [f32; 8])> = HashMap::new();
    for r in records {
        let Some(labels) = r.patient_labels else {
            continue;
        };
        let (row, seen) = *first.entry(r.patient_id).or_insert((r.row, labels));
        if seen != labels {
            return Err(DataError::InconsistentPatient {
                file: file.to_path_buf(),
                id: r.patient_id,
                rows: (row, r.row),
                columns: LABELS
                    .iter()
                    .zip(seen.iter().zip(&labels))
                    .filter(|(_, (a, b))| a != b)
                    .map(|(l, _)| l.to_string())
                    .collect(),
            });
        }
    }
    Ok(())
}

fn cell_text(d: &Data) -> String {
    match d {
        Data::Empty => String::new(),
        Data::String(s) => s.clone(),
        Data::Float(f) if f.fract() == 0.0 => format!("{}", *f as i64),
        Data::Float(f) => f.to_string(),
        Data::Int(i) => i.to_string(),
        Data::Bool(b) => if *b { "1" } else { "0" }.to_string(),
        other => other.to_string(),
    }
}

/// A sheet's non-empty cells: `((row, column), value)`, 0-based.
type SheetCells = Vec<((u32, u32), Data)>;

/// The first sheet's non-empty cells. xlsx and xlsb sheets are read cell by cell: calamine's
/// `worksheet_range` makes a dense rows x columns range, and one value at XFD1048576 would
/// ask it for 17 G cells (550 GB), an allocation failure that aborts the process. (An xls or
/// ods sheet is dense already once calamine has opened the workbook.)
fn first_sheet_cells(file: &Path) -> Result<SheetCells, String> {
    fn drain<'a, E: std::fmt::Display>(
        mut next: impl FnMut() -> Result<Option<Cell<DataRef<'a>>>, E>,
    ) -> Result<SheetCells, String> {
        let mut cells = Vec::new();
        while let Some(cell) = next().map_err(|e| e.to_string())? {
            if !matches!(cell.get_value(), DataRef::Empty) {
                cells.push((cell.get_position(), cell.get_value().clone().into()));
            }
        }
        Ok(cells)
    }
    let mut workbook = open_workbook_auto(file).map_err(|e| e.to_string())?;
    let sheet = workbook
        .sheet_names()
        .first()
        .cloned()
        .ok_or("the workbook has no sheets")?;
    match &mut workbook {
        Sheets::Xlsx(book) => {
            let mut reader = book
                .worksheet_cells_reader(&sheet)
                .map_err(|e| e.to_string())?;
            drain(|| reader.next_cell())
        }
        Sheets::Xlsb(book) => {
            let mut reader = book
                .worksheet_cells_reader(&sheet)
                .map_err(|e| e.to_string())?;
            drain(|| reader.next_cell())
        }
        Sheets::Xls(_) | Sheets::Ods(_) => {
            let range = workbook
                .worksheet_range(&sheet)
                .map_err(|e| e.to_string())?;
            let (top, left) = range.start().unwrap_or_default();
            let at = |r: usize, c: usize| (top + r as u32, left + c as u32);
            Ok(range
                .used_cells()
                .map(|(r, c, d)| (at(r, c), d.clone()))
                .collect())
        }
    }
}

/// Reads the challenge workbook (first sheet): one row per patient with `ID`, `Left-Fundus`,
/// `Right-Fundus` and `N`..`O`; each row gives two samples with the patient's labels (the
/// workbook has no per-eye labels, so [`LabelMode::PerEye`] is an error here).
pub fn read_xlsx(file: &Path, mode: LabelMode) -> Result<Annotations, DataError> {
    // calamine indexes some tables of a damaged workbook without checking (0.30: a shared
    // string index past the table panics); a damaged file is an error, not a crash.
    let read = std::panic::catch_unwind(|| first_sheet_cells(file));
    let mut cells = read
        .unwrap_or_else(|panic| {
            let why = crate::error::panic_message(&*panic);
            Err(format!(
                "the workbook is damaged: the spreadsheet reader failed on it ({why})"
            ))
        })
        .map_err(|message| DataError::Annotations {
            file: file.to_path_buf(),
            message,
        })?;
    // Rows of cells, top to bottom (a sheet need not list its cells in order); the first is
    // the header, and columns count from its first cell.
    cells.sort_by_key(|(at, _)| *at);
    let mut rows = cells.chunk_by(|a, b| a.0 .0 == b.0 .0);
    let header = rows.next().unwrap_or_default();
    let first_col = header.first().map_or(0, |((_, c), _)| *c);
    let mut headers = Vec::new();
    for ((_, c), d) in header {
        // A damaged sheet may repeat a cell: the last one counts, as in calamine's ranges.
        let i = (c - first_col) as usize;
        headers.resize(headers.len().max(i + 1), String::new());
        headers[i] = cell_text(d);
    }
    let cols = Columns::new(file, headers);
    let source = resolve_source(mode, false, &cols)?;
    debug_assert_eq!(source, LabelSource::Patient);
    let id_col = cols.get("ID")?;
    let left_col = cols.get("Left-Fundus")?;
    let right_col = cols.get("Right-Fundus")?;
    let label_cols: Vec<usize> = LABELS
        .iter()
        .map(|l| cols.get(l))
        .collect::<Result<_, _>>()?;
    let mut records = Vec::new();
    let mut rows_of: HashMap<u64, Vec<usize>> = HashMap::new();
    for r in rows {
        let row = r.first().map_or(0, |((row, _), _)| *row as usize + 1);
        let cell = |c: usize| {
            r.iter()
                .rfind(|((_, col), _)| *col as usize == first_col as usize + c)
                .map(|(_, d)| cell_text(d))
                .unwrap_or_default()
        };
        let patient_id = parse_id(file, row, "ID", &cell(id_col))?;
        rows_of.entry(patient_id).or_default().push(row);
        let mut labels = [0f32; 8];
        for (k, &c) in label_cols.iter().enumerate() {
            labels[k] = parse_binary(file, row, LABELS[k], &cell(c))?;
        }
        for (col, name) in [(left_col, "Left-Fundus"), (right_col, "Right-Fundus")] {
            records.push(Record {
                file: non_empty(file, row, name, &cell(col))?,
                patient_id,
                labels,
                patient_labels: Some(labels),
                row,
            });
        }
    }
    // One row per patient: a repeated ID is the first that repeats, with all its rows.
    let repeated = records
        .iter()
        .map(|r| r.patient_id)
        .find(|id| rows_of.get(id).is_some_and(|rows| rows.len() > 1));
    if let Some(id) = repeated {
        return Err(DataError::DuplicatePatient {
            file: file.to_path_buf(),
            id,
            rows: rows_of.remove(&id).unwrap_or_default(),
        });
    }
    finish(file, records, source)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_parses_eight_binary_values() {
        let p = Path::new("full_df.csv");
        assert_eq!(
            parse_target(p, 2, "[0, 1, 0, 0, 0, 0, 0, 1]").unwrap(),
            [0., 1., 0., 0., 0., 0., 0., 1.]
        );
        for bad in [
            "[0, 1, 0]",
            "0, 1, 0, 0, 0, 0, 0, 0",
            "[0, 2, 0, 0, 0, 0, 0, 0]",
            "[0, 1, 0, 0, 0, 0, 0, 0, 0]",
            "['N']",
            "",
        ] {
            let e = parse_target(p, 5, bad).unwrap_err();
            assert!(
                matches!(&e, DataError::InvalidTarget { row: 5, value, .. } if value == bad),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn ids_accept_integers_and_integral_floats_only() {
        let p = Path::new("a.xlsx");
        assert_eq!(parse_id(p, 2, "ID", "17").unwrap(), 17);
        assert_eq!(parse_id(p, 2, "ID", "17.0").unwrap(), 17);
        assert!(matches!(
            parse_id(p, 2, "ID", "17.5"),
            Err(DataError::InvalidCell { .. })
        ));
        assert!(parse_id(p, 2, "ID", "-3").is_err());
        assert!(parse_id(p, 2, "ID", "abc").is_err());
    }

    #[test]
    fn binary_labels_reject_other_values() {
        let p = Path::new("f.csv");
        assert_eq!(parse_binary(p, 2, "N", " 1 ").unwrap(), 1.0);
        assert_eq!(parse_binary(p, 2, "N", "0").unwrap(), 0.0);
        let e = parse_binary(p, 9, "G", "2").unwrap_err();
        assert_eq!(
            e.to_string(),
            "annotation file 'f.csv' row 9 column 'G': expected 0 or 1, found '2'"
        );
    }
}
