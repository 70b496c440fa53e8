//! Fixture folders for the integration tests, built in temporary directories.
#![allow(dead_code)]

use std::path::Path;

use image::codecs::jpeg::JpegEncoder;
use image::ExtendedColorType;

pub const HEADER: &str = "ID,Patient Age,Patient Sex,Left-Fundus,Right-Fundus,\
Left-Diagnostic Keywords,Right-Diagnostic Keywords,N,D,G,C,A,H,M,O,filepath,labels,target,filename";

/// A solid-colour RGB JPEG of `w x h`.
pub fn jpeg_bytes(w: u32, h: u32, rgb: [u8; 3]) -> Vec<u8> {
    let px: Vec<u8> = (0..w * h).flat_map(|_| rgb).collect();
    encode_jpeg(&px, w, h)
}

/// An RGB JPEG whose pixel (x, y) is (x * 255 / w, y * 255 / h, 128): a gradient that shows
/// where every pixel went.
pub fn gradient_jpeg(w: u32, h: u32) -> Vec<u8> {
    let mut px = Vec::with_capacity((w * h * 3) as usize);
    for y in 0..h {
        for x in 0..w {
            px.extend([(x * 255 / w) as u8, (y * 255 / h) as u8, 128]);
        }
    }
    encode_jpeg(&px, w, h)
}

pub fn encode_jpeg(px: &[u8], w: u32, h: u32) -> Vec<u8> {
    let mut out = Vec::new();
    JpegEncoder::new_with_quality(&mut out, 95)
        .encode(px, w, h, ExtendedColorType::Rgb8)
        .expect("encode fixture JPEG");
    out
}

/// One redistribution row: patient `id`, eye image `file`, per-eye `target` and patient labels.
pub fn csv_row(id: u64, file: &str, target: &str, patient: [u8; 8]) -> String {
    let p: Vec<String> = patient.iter().map(u8::to_string).collect();
    format!(
        "{id},60,Female,{id}_left.jpg,{id}_right.jpg,\"kw\",\"kw\",{},../{file},\"['N']\",\"{target}\",{file}",
        p.join(",")
    )
}

/// Writes `full_df.csv` with `rows` and a 24x16 JPEG in `preprocessed_images/` for each name
/// in `images`.
pub fn write_csv_layout(root: &Path, rows: &[String], images: &[&str]) {
    let dir = root.join("preprocessed_images");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let mut text = String::from(HEADER);
    text.push('\n');
    for r in rows {
        text.push_str(r);
        text.push('\n');
    }
    std::fs::write(root.join("full_df.csv"), text).expect("write csv");
    for (k, name) in images.iter().enumerate() {
        let shade = (40 * k % 250) as u8;
        std::fs::write(dir.join(name), jpeg_bytes(24, 16, [shade, 100, 200])).expect("write jpg");
    }
}

/// A valid redistribution folder: patients 1..=n with both eyes, per-eye targets differing
/// between the eyes.
pub fn valid_csv_layout(root: &Path, patients: u64) -> Vec<String> {
    let mut rows = Vec::new();
    let mut names = Vec::new();
    for id in 1..=patients {
        let left = format!("{id}_left.jpg");
        let right = format!("{id}_right.jpg");
        rows.push(csv_row(
            id,
            &left,
            "[1, 0, 0, 0, 0, 0, 0, 0]",
            [0, 1, 0, 0, 0, 0, 0, 0],
        ));
        rows.push(csv_row(
            id,
            &right,
            "[0, 1, 0, 0, 0, 0, 0, 0]",
            [0, 1, 0, 0, 0, 0, 0, 0],
        ));
        names.push(left);
        names.push(right);
    }
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    write_csv_layout(root, &rows, &refs);
    names
}

/// A challenge workbook with one row per patient: (id, left, right, labels N..O).
pub fn xlsx_bytes(rows: &[(u64, &str, &str, [u8; 8])]) -> Vec<u8> {
    xlsx_workbook(rows).save_to_buffer().unwrap()
}

/// The workbook of [`xlsx_bytes`], to add to before saving.
pub fn xlsx_workbook(rows: &[(u64, &str, &str, [u8; 8])]) -> rust_xlsxwriter::Workbook {
    let mut wb = rust_xlsxwriter::Workbook::new();
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
    for (r, (id, left, right, labels)) in rows.iter().enumerate() {
        let r = r as u32 + 1;
        ws.write_number(r, 0, *id as f64).unwrap();
        ws.write_number(r, 1, 57).unwrap();
        ws.write_string(r, 2, "Male").unwrap();
        ws.write_string(r, 3, *left).unwrap();
        ws.write_string(r, 4, *right).unwrap();
        ws.write_string(r, 5, "normal fundus").unwrap();
        ws.write_string(r, 6, "normal fundus").unwrap();
        for (k, &l) in labels.iter().enumerate() {
            ws.write_number(r, 7 + k as u16, l).unwrap();
        }
    }
    wb
}

/// Writes [`xlsx_bytes`] of `rows` to `path`.
pub fn write_xlsx(path: &Path, rows: &[(u64, &str, &str, [u8; 8])]) {
    std::fs::write(path, xlsx_bytes(rows)).unwrap();
}
