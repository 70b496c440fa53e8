//! Unusual inputs decode to correct 8-bit RGB; broken ones are errors naming the file.
#![cfg(feature = "odir")]

mod common;

use std::path::Path;

use ddp_data::odir::decode::Decoder;
use ddp_data::DataError;
use image::codecs::jpeg::JpegEncoder;
use image::codecs::png::PngEncoder;
use image::{ExtendedColorType, ImageEncoder};

fn png(px: &[u8], w: u32, h: u32, colour: ExtendedColorType) -> Vec<u8> {
    let mut out = Vec::new();
    PngEncoder::new(&mut out)
        .write_image(px, w, h, colour)
        .unwrap();
    out
}

fn pixel(px: &[u8], w: u32, x: u32, y: u32) -> [u8; 3] {
    let i = ((y * w + x) * 3) as usize;
    [px[i], px[i + 1], px[i + 2]]
}

fn close(a: [u8; 3], b: [u8; 3], tol: u8) -> bool {
    a.iter().zip(b).all(|(&x, y)| x.abs_diff(y) <= tol)
}

#[test]
fn grayscale_jpeg_becomes_equal_rgb_channels() {
    let mut bytes = Vec::new();
    JpegEncoder::new_with_quality(&mut bytes, 100)
        .encode(&[90u8; 64], 8, 8, ExtendedColorType::L8)
        .unwrap();
    let mut d = Decoder::new();
    let img = d.decode_bytes(&bytes, Path::new("g.jpg")).unwrap();
    assert_eq!((img.width, img.height), (8, 8));
    for p in img.pixels.chunks_exact(3) {
        assert_eq!(p[0], p[1]);
        assert_eq!(p[1], p[2]);
        assert!(p[0].abs_diff(90) <= 1, "{p:?}");
    }
}

#[test]
fn grayscale_png_is_exact() {
    let px: Vec<u8> = (0..12).map(|v| v * 20).collect();
    let bytes = png(&px, 4, 3, ExtendedColorType::L8);
    let mut d = Decoder::new();
    let img = d.decode_bytes(&bytes, Path::new("g.png")).unwrap();
    assert_eq!((img.width, img.height), (4, 3));
    let want: Vec<u8> = px.iter().flat_map(|&v| [v, v, v]).collect();
    assert_eq!(img.pixels, &want[..]);
}

#[test]
fn sixteen_bit_png_is_scaled_to_eight_bits() {
    // Two RGB16 pixels: white and (0x8080, 0, 0x0101).
    let values: [u16; 6] = [0xFFFF, 0xFFFF, 0xFFFF, 0x8080, 0, 0x0101];
    let px: Vec<u8> = values.iter().flat_map(|v| v.to_be_bytes()).collect();
    let bytes = png(&px, 2, 1, ExtendedColorType::Rgb16);
    let mut d = Decoder::new();
    let img = d.decode_bytes(&bytes, Path::new("deep.png")).unwrap();
    assert_eq!(img.pixels, &[255, 255, 255, 128, 0, 1]);
}

/// Scaled as the `image` crate does, where PIL's `convert("RGB")` of its mode `I;16` clips
/// every value above 255 to white (docs/odir.md says so).
#[test]
fn sixteen_bit_grey_png_is_scaled_not_clipped() {
    let values: [u16; 4] = [0xFFFF, 0x8080, 0x0101, 0x00FF];
    let px: Vec<u8> = values.iter().flat_map(|v| v.to_ne_bytes()).collect();
    let bytes = png(&px, 4, 1, ExtendedColorType::L16);
    let mut d = Decoder::new();
    let img = d.decode_bytes(&bytes, Path::new("deep.png")).unwrap();
    assert_eq!(
        img.pixels,
        &[255, 255, 255, 128, 128, 128, 1, 1, 1, 1, 1, 1]
    );
}

#[test]
fn rgba_png_drops_alpha() {
    let bytes = png(
        &[10, 20, 30, 0, 40, 50, 60, 255],
        2,
        1,
        ExtendedColorType::Rgba8,
    );
    let mut d = Decoder::new();
    let img = d.decode_bytes(&bytes, Path::new("a.png")).unwrap();
    assert_eq!(img.pixels, &[10, 20, 30, 40, 50, 60]);
}

/// A 16x8 CMYK JPEG (Adobe, as Pillow writes it): left half red, right half blue.
#[test]
fn cmyk_jpeg_converts_to_rgb() {
    let bytes = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/cmyk.jpg"
    ))
    .unwrap();
    let mut d = Decoder::new();
    let img = d.decode_bytes(&bytes, Path::new("cmyk.jpg")).unwrap();
    assert_eq!((img.width, img.height), (16, 8));
    // Pillow decodes these pixels to (255, 0, 0) and (0, 0, 255).
    assert!(
        close(pixel(img.pixels, 16, 2, 4), [255, 0, 0], 12),
        "{:?}",
        pixel(img.pixels, 16, 2, 4)
    );
    assert!(
        close(pixel(img.pixels, 16, 13, 4), [0, 0, 255], 12),
        "{:?}",
        pixel(img.pixels, 16, 13, 4)
    );
}

/// An EXIF block (TIFF, little-endian) holding only the given orientation.
fn exif_orientation(orientation: u8) -> Vec<u8> {
    [
        &b"II\x2a\x00\x08\x00\x00\x00"[..],
        &[1, 0],                                               // one IFD entry
        &[0x12, 0x01, 3, 0, 1, 0, 0, 0, orientation, 0, 0, 0], // Orientation, SHORT, 1
        &[0, 0, 0, 0],                                         // no next IFD
    ]
    .concat()
}

/// Inserts an EXIF APP1 segment with the given orientation right after the SOI marker.
fn with_exif_orientation(jpeg: &[u8], orientation: u8) -> Vec<u8> {
    let payload = [&b"Exif\0\0"[..], &exif_orientation(orientation)].concat();
    let len = (payload.len() + 2) as u16;
    [
        &jpeg[..2],
        &[0xFF, 0xE1],
        &len.to_be_bytes(),
        &payload,
        &jpeg[2..],
    ]
    .concat()
}

/// 32 x 16: left half red, right half blue.
fn red_and_blue_halves(red: [u8; 3], blue: [u8; 3]) -> Vec<u8> {
    (0..16 * 32)
        .flat_map(|i| if i % 32 < 16 { red } else { blue })
        .collect()
}

#[test]
fn exif_rotated_jpeg_is_turned_upright() {
    // Orientation 6 = rotate 90 degrees clockwise to display, so the upright image is 16 x 32
    // with red on top and blue below.
    let px = red_and_blue_halves([230, 20, 20], [20, 20, 230]);
    let bytes = with_exif_orientation(&common::encode_jpeg(&px, 32, 16), 6);
    let mut d = Decoder::new();
    let img = d.decode_bytes(&bytes, Path::new("rot.jpg")).unwrap();
    assert_eq!((img.width, img.height), (16, 32));
    assert!(close(pixel(img.pixels, 16, 8, 6), [230, 20, 20], 20));
    assert!(close(pixel(img.pixels, 16, 8, 26), [20, 20, 230], 20));
    // Orientation 3 (180 degrees) keeps the size and swaps the halves.
    let bytes = with_exif_orientation(&common::encode_jpeg(&px, 32, 16), 3);
    let img = d.decode_bytes(&bytes, Path::new("rot.jpg")).unwrap();
    assert_eq!((img.width, img.height), (32, 16));
    assert!(close(pixel(img.pixels, 32, 4, 8), [20, 20, 230], 20));
}

/// A PNG's `eXIf` chunk turns it upright too (PIL's `Image.open` turns neither).
#[test]
fn exif_rotated_png_is_turned_upright() {
    let (red, blue) = ([230, 20, 20], [20, 20, 230]);
    let mut bytes = Vec::new();
    let mut encoder = PngEncoder::new(&mut bytes);
    encoder.set_exif_metadata(exif_orientation(6)).unwrap();
    encoder
        .write_image(
            &red_and_blue_halves(red, blue),
            32,
            16,
            ExtendedColorType::Rgb8,
        )
        .unwrap();
    let mut d = Decoder::new();
    let img = d.decode_bytes(&bytes, Path::new("rot.png")).unwrap();
    assert_eq!((img.width, img.height), (16, 32));
    let upright: Vec<u8> = (0..16 * 32)
        .flat_map(|i| if i < 16 * 16 { red } else { blue })
        .collect();
    assert_eq!(img.pixels, &upright[..]);
}

#[test]
fn truncated_jpeg_is_an_error_naming_the_file() {
    let bytes = common::gradient_jpeg(64, 64);
    let cut = &bytes[..bytes.len() * 2 / 3];
    let mut d = Decoder::new();
    let e = d.decode_bytes(cut, Path::new("imgs/cut.jpg")).unwrap_err();
    assert!(matches!(e, DataError::DecodeImage { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.starts_with("image 'imgs/cut.jpg' cannot be decoded: truncated JPEG"),
        "{msg}"
    );
}

/// Bytes after the end-of-image marker (padding, a trailer) are left alone, as PIL does.
#[test]
fn a_jpeg_padded_after_its_end_decodes_as_without() {
    let bytes = common::gradient_jpeg(64, 64);
    let padded = [&bytes[..], &[0u8; 200], b"camera trailer"].concat();
    let mut d = Decoder::new();
    let plain = d
        .decode_bytes(&bytes, Path::new("a.jpg"))
        .unwrap()
        .pixels
        .to_vec();
    let img = d.decode_bytes(&padded, Path::new("padded.jpg")).unwrap();
    assert_eq!((img.width, img.height), (64, 64));
    assert_eq!(img.pixels, &plain[..]);
}

/// A trailer that holds an end marker and then a scan marker (a motion photo's video holds
/// any bytes) does not make the file look truncated: what follows the image's end marker is
/// not read.
#[test]
fn a_jpeg_with_a_binary_trailer_decodes_as_without() {
    let bytes = common::gradient_jpeg(64, 64);
    let video = [
        &[0, 0, 0, 0x18][..],
        b"ftypmp42",
        &[0x12, 0xFF, 0xD9, 0x34, 0x56],
        b"mdat",
        &[0xFF, 0xDA, 0x00, 0x0C, 0x9A],
    ]
    .concat();
    let with_video = [&bytes[..], &video].concat();
    let mut d = Decoder::new();
    let plain = d
        .decode_bytes(&bytes, Path::new("a.jpg"))
        .unwrap()
        .pixels
        .to_vec();
    let img = d
        .decode_bytes(&with_video, Path::new("motion.jpg"))
        .unwrap();
    assert_eq!((img.width, img.height), (64, 64));
    assert_eq!(img.pixels, &plain[..]);
}

/// A progressive JPEG (PIL's: ten scans, Huffman tables between them) is complete at its
/// end marker and decodes; cut after any of its scans it is truncated.
#[test]
fn a_progressive_jpeg_decodes_and_is_truncated_when_cut() {
    let bytes = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/progressive.jpg"
    ))
    .unwrap();
    assert_eq!(bytes[..2], [0xFF, 0xD8]);
    let markers = |code: u8| bytes.windows(2).filter(|w| *w == [0xFF, code]).count();
    assert_eq!(
        (markers(0xC2), markers(0xDA)),
        (1, 10),
        "SOF2 and ten scans"
    );
    let mut d = Decoder::new();
    let img = d.decode_bytes(&bytes, Path::new("p.jpg")).unwrap();
    assert_eq!((img.width, img.height), (64, 48));
    // Red, green, blue and white quadrants.
    let want = [
        ((8, 8), [255, 0, 0]),
        ((56, 8), [0, 255, 0]),
        ((8, 40), [0, 0, 255]),
        ((56, 40), [255, 255, 255]),
    ];
    for ((x, y), colour) in want {
        let got = pixel(img.pixels, 64, x, y);
        assert!(close(got, colour, 12), "({x}, {y}): {got:?}");
    }
    let last_scan = bytes.windows(2).rposition(|w| w == [0xFF, 0xDA]).unwrap();
    for cut in [bytes.len() - 2, last_scan, last_scan - 1, bytes.len() / 2] {
        let e = d
            .decode_bytes(&bytes[..cut], Path::new("p.jpg"))
            .map(|_| ())
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("image 'p.jpg' cannot be decoded: truncated JPEG"),
            "cut at {cut}: {e}"
        );
    }
}

#[test]
fn corrupt_jpeg_and_png_are_errors_naming_the_file() {
    let mut d = Decoder::new();
    let garbage = [
        &[0xFF, 0xD8, 0xFF, 0xDB, 0x00, 0x03][..],
        &[0x55; 200],
        &[0xFF, 0xD9],
    ]
    .concat();
    let e = d.decode_bytes(&garbage, Path::new("bad.jpg")).unwrap_err();
    assert!(
        matches!(e, DataError::DecodeImage { .. }) && e.to_string().contains("bad.jpg"),
        "{e}"
    );
    let good = png(&[1, 2, 3, 4, 5, 6], 2, 1, ExtendedColorType::Rgb8);
    let e = d
        .decode_bytes(&good[..good.len() - 20], Path::new("bad.png"))
        .unwrap_err();
    assert!(
        matches!(e, DataError::DecodeImage { .. }) && e.to_string().contains("bad.png"),
        "{e}"
    );
}

#[test]
fn unreadable_file_is_a_read_error() {
    let mut d = Decoder::new();
    let e = d.decode_file(Path::new("/nonexistent/x.jpg")).unwrap_err();
    assert!(matches!(e, DataError::ReadImage { .. }), "{e}");
    assert!(e.to_string().contains("/nonexistent/x.jpg"));
}

#[test]
fn images_over_the_pixel_budget_are_refused_from_their_header() {
    // 20000 x 20000 = 400 M pixels, over PIL's 178,956,970: refused before 1.2 GB is
    // allocated for it, naming the file and both sizes.
    let bomb = ddp_testkit::png_header_only(20_000, 20_000);
    let err = Decoder::new()
        .decode_bytes(&bomb, Path::new("bomb.png"))
        .unwrap_err();
    match &err {
        DataError::ImageTooLarge {
            path,
            width: 20_000,
            height: 20_000,
            limit: 178_956_970,
        } => assert_eq!(path, Path::new("bomb.png")),
        other => panic!("expected ImageTooLarge, got {other}"),
    }
    assert!(err.to_string().contains("bomb.png"), "{err}");

    // A JPEG against a budget of 63 pixels: its 8 x 8 are one too many.
    let mut jpeg = Vec::new();
    JpegEncoder::new_with_quality(&mut jpeg, 90)
        .encode(&[90u8; 64], 8, 8, ExtendedColorType::L8)
        .unwrap();
    let mut small = Decoder::new().with_max_pixels(63);
    assert!(matches!(
        small.decode_bytes(&jpeg, Path::new("a.jpg")),
        Err(DataError::ImageTooLarge {
            width: 8,
            height: 8,
            limit: 63,
            ..
        })
    ));
    let mut enough = Decoder::new().with_max_pixels(64);
    assert_eq!(
        enough
            .decode_bytes(&jpeg, Path::new("a.jpg"))
            .unwrap()
            .width,
        8
    );
}
