//! The reduced-size JPEG path: same crop boxes as a full decode, nearly the same pixels, and
//! the same errors for broken files.
#![cfg(feature = "odir")]

mod common;

use ddp_data::odir::decode::MAX_PIXELS;
use ddp_data::odir::synthetic::paint_fundus;
use ddp_data::odir::transform::{Pipeline, Transform};
use ddp_data::rng::SampleRng;
use ddp_data::DataError;
use image::codecs::jpeg::JpegEncoder;
use image::ExtendedColorType;

fn write(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Over many crops of a 1200x900 fundus photo (most are shrunk 2x-8x, so decoded at
/// 1/2-1/8 scale), the output matches the full-decode pipeline closely everywhere.
#[test]
fn reduced_decode_matches_full_decode() {
    let dir = tempfile::tempdir().unwrap();
    let mut labels = [false; 8];
    labels[1] = true;
    let px = paint_fundus(1200, labels, true, 1, 0);
    // Crop it to 1200 x 900 (rectangular like the originals).
    let px: Vec<u8> = px[..1200 * 900 * 3].to_vec();
    let path = write(dir.path(), "big.jpg", &common::encode_jpeg(&px, 1200, 900));
    let full = Transform::train(96).with_hflip(true);
    let t = full.with_dct_upsampling(1.0).unwrap();
    let (mut fast, mut slow) = (Pipeline::new(), Pipeline::new());
    let (mut a, mut b) = (vec![0f32; t.sample_len()], vec![0f32; t.sample_len()]);
    let mut worst_mean = 0f32;
    for i in 0..30 {
        fast.run(&t, &path, &mut SampleRng::new(3, 0, i), &mut a)
            .unwrap();
        slow.run(&full, &path, &mut SampleRng::new(3, 0, i), &mut b)
            .unwrap();
        let diffs: Vec<f32> = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).collect();
        let mean = diffs.iter().sum::<f32>() / diffs.len() as f32;
        worst_mean = worst_mean.max(mean);
        // A misplaced crop would shift vessels and the disc by many pixels: mean errors of
        // above 0.02. Filtering differences stay below 0.003.
        assert!(mean < 0.008, "sample {i}: mean abs difference {mean}");
        // Against another sample's crop the difference is an order of magnitude larger.
        slow.run(&full, &path, &mut SampleRng::new(3, 0, i + 100), &mut b)
            .unwrap();
        let other = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32;
        assert!(
            other > 0.02,
            "sample {i}: crops {i} and {} differ by only {other}",
            i + 100
        );
    }
    assert!(worst_mean > 0.0, "the reduced path was never taken");
}

#[test]
fn reduced_path_reports_truncated_and_corrupt_files() {
    let dir = tempfile::tempdir().unwrap();
    let jpeg = common::gradient_jpeg(1024, 1024);
    let cut = write(dir.path(), "cut.jpg", &jpeg[..jpeg.len() * 3 / 4]);
    let t = Transform::train(64).with_dct_upsampling(1.0).unwrap();
    let mut p = Pipeline::new();
    let mut out = vec![0f32; t.sample_len()];
    let e = p
        .run(&t, &cut, &mut SampleRng::new(0, 0, 0), &mut out)
        .unwrap_err();
    assert!(
        matches!(e, DataError::DecodeImage { .. }) && e.to_string().contains("cut.jpg"),
        "{e}"
    );
    // Garbage in the middle of the entropy-coded data, but a valid end marker.
    let mut broken = jpeg.clone();
    let mid = broken.len() / 3;
    for (k, b) in broken[mid..mid + 600].iter_mut().enumerate() {
        *b = if k % 2 == 0 { 0xFF } else { 0xC4 };
    }
    let bad = write(dir.path(), "bad.jpg", &broken);
    // Whatever the crop drawn, the error is the full decode's, as evaluation meets it.
    let full = p
        .run(
            &Transform::train(64),
            &bad,
            &mut SampleRng::new(0, 0, 0),
            &mut out,
        )
        .unwrap_err()
        .to_string();
    assert!(
        full.contains("bad.jpg' cannot be decoded: corrupt JPEG data: "),
        "{full}"
    );
    for i in 0..4 {
        let e = p
            .run(&t, &bad, &mut SampleRng::new(0, 0, i), &mut out)
            .unwrap_err();
        assert_eq!(e.to_string(), full);
    }
}

/// Damage in the last rows of a baseline file fails every crop as a full decode does, also a
/// crop that ends far above it: the reduced decode reads the image to its end, whatever the
/// rows it keeps.
#[test]
fn damage_below_the_crop_fails_as_in_a_full_decode() {
    let dir = tempfile::tempdir().unwrap();
    let side = 1024;
    let mut jpeg = common::gradient_jpeg(side, side);
    let end = jpeg.len() - 2;
    assert_eq!(jpeg[end..], [0xFF, 0xD9]);
    // Markers in the last 1/100 of the entropy-coded data: its bottom row of MCUs, at most.
    for (k, b) in jpeg[end - end / 100..end].iter_mut().enumerate() {
        *b = if k % 2 == 0 { 0xFF } else { 0xC4 };
    }
    let bad = write(dir.path(), "bottom.jpg", &jpeg);
    let full = Transform::train(64);
    let mut p = Pipeline::new();
    let mut out = vec![0f32; full.sample_len()];
    let want = p
        .run(&full, &bad, &mut SampleRng::new(0, 0, 0), &mut out)
        .unwrap_err()
        .to_string();
    assert!(
        want.contains("bottom.jpg' cannot be decoded: corrupt JPEG data: "),
        "{want}"
    );
    let t = full.with_dct_upsampling(1.0).unwrap();
    // Crops that end above three quarters of the height (at least 400 pixels a side, so
    // decoded at 1/4 or 1/8 scale).
    let above: Vec<u64> = (0..1000)
        .filter(|&i| {
            let r = t.placement(side, side, &mut SampleRng::new(0, 0, i)).region;
            r.top + r.height < 0.75 * f64::from(side)
        })
        .take(4)
        .collect();
    assert_eq!(above.len(), 4);
    for i in above {
        let e = p
            .run(&t, &bad, &mut SampleRng::new(0, 0, i), &mut out)
            .map(|()| "decoded".to_string());
        assert_eq!(e.unwrap_or_else(|e| e.to_string()), want, "sample {i}");
    }
}

/// A JPEG that libjpeg warns about (JFIF major version 2) but the full decoder takes: the
/// reduced path falls back to the full decode, so the file trains whatever the crop, with
/// the full pipeline's values.
#[test]
fn a_file_libjpeg_only_warns_about_decodes_whatever_the_crop() {
    let dir = tempfile::tempdir().unwrap();
    let mut jpeg = common::gradient_jpeg(1024, 1024);
    assert_eq!(&jpeg[6..11], b"JFIF\0", "the encoder writes no JFIF header");
    jpeg[11] = 2;
    let path = write(dir.path(), "jfif2.jpg", &jpeg);
    let full = Transform::train(64);
    let t = full.with_dct_upsampling(1.0).unwrap();
    let mut p = Pipeline::new();
    let (mut a, mut b) = (vec![0f32; t.sample_len()], vec![0f32; t.sample_len()]);
    for i in 0..4 {
        p.run(&t, &path, &mut SampleRng::new(0, 0, i), &mut a)
            .unwrap();
        p.run(&full, &path, &mut SampleRng::new(0, 0, i), &mut b)
            .unwrap();
        assert_eq!(a, b, "sample {i}");
    }
}

/// An image over the pixel budget is refused on the reduced path as in a full decode: libjpeg
/// holds a progressive file's coefficients for the whole image whatever the scale, and a
/// file that trains must not be refused by evaluation's full decode an epoch later.
#[test]
fn reduced_path_refuses_images_over_the_pixel_budget() {
    // 13378 x 13378 = 178,970,884 pixels, just over 178,956,970; flat grey, a 2 MB file.
    let side = 13_378;
    let mut jpeg = Vec::new();
    JpegEncoder::new_with_quality(&mut jpeg, 50)
        .encode(
            &vec![128u8; side as usize * side as usize],
            side,
            side,
            ExtendedColorType::L8,
        )
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "bomb.jpg", &jpeg);
    let t = Transform::train(64).with_dct_upsampling(1.0).unwrap();
    let mut out = vec![0f32; t.sample_len()];
    let e = Pipeline::new()
        .run(&t, &path, &mut SampleRng::new(0, 0, 0), &mut out)
        .unwrap_err();
    match e {
        DataError::ImageTooLarge {
            path: named,
            width: 13_378,
            height: 13_378,
            limit: MAX_PIXELS,
        } => assert_eq!(named, path),
        other => panic!("expected ImageTooLarge, got {other}"),
    }
}
