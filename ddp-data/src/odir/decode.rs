//! Image decoding to 8-bit RGB: JPEG through zune-jpeg into reused buffers (the hot path),
//! everything else (PNG, 16-bit, grey, palette, alpha) through the `image` crate; EXIF
//! orientation is applied in both cases.

use std::io::Read;
use std::path::Path;

use image::metadata::Orientation;
use image::{DynamicImage, ImageDecoder, ImageReader};
use zune_jpeg::zune_core::bytestream::ZCursor;
use zune_jpeg::zune_core::colorspace::ColorSpace;
use zune_jpeg::zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use super::scaled_jpeg;
use crate::crop::SourceRegion;
use crate::error::DataError;

/// A decoded image: `height` rows of `width` RGB pixels, 3 bytes each, row-major.
#[derive(Debug, Clone, Copy)]
pub struct RgbView<'a> {
    /// Columns.
    pub width: u32,
    /// Rows.
    pub height: u32,
    /// `width * height * 3` bytes.
    pub pixels: &'a [u8],
}

/// The most pixels (width x height) a full-size decode accepts by default: PIL's limit for
/// `DecompressionBombError` (twice its `MAX_IMAGE_PIXELS` warning threshold), 537 MB of RGB.
/// Reduced-size JPEG decoding ([`Transform`](super::transform::Transform)'s DCT scaling) is
/// bounded by it too: libjpeg holds a progressive file's coefficients for the whole image
/// (2 bytes a pixel and component) whatever the scale.
pub const MAX_PIXELS: u64 = 178_956_970;

/// A reusable decoder: one per worker thread, so the file and pixel buffers are allocated once
/// and grow to the largest image seen, not once per image.
#[derive(Debug)]
pub struct Decoder {
    file: Vec<u8>,
    pixels: Vec<u8>,
    width: u32,
    height: u32,
    max_pixels: u64,
}

impl Default for Decoder {
    fn default() -> Self {
        Self {
            file: Vec::new(),
            pixels: Vec::new(),
            width: 0,
            height: 0,
            max_pixels: MAX_PIXELS,
        }
    }
}

const TRUNCATED: &str = "truncated JPEG: no end-of-image marker (0xFFD9) after its last scan";

fn jpeg_options() -> DecoderOptions {
    DecoderOptions::default()
        .set_strict_mode(true)
        .set_max_width(1 << 16)
        .set_max_height(1 << 16)
        .jpeg_set_out_colorspace(ColorSpace::RGB)
}

fn decode_error(path: &Path, message: impl std::fmt::Display) -> DataError {
    DataError::DecodeImage {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

/// Whether `bytes` start like a JPEG file (SOI marker followed by another marker).
fn is_jpeg(bytes: &[u8]) -> bool {
    bytes.len() >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF
}

/// Whether a JPEG is complete: walking its marker segments from the start-of-image marker by
/// their lengths, and the entropy-coded data after each scan (SOS, 0xFFDA) to the marker that
/// ends it, reaches the end-of-image marker (EOI, 0xFFD9) after a scan. Nothing after that EOI
/// is read: cameras and editors pad files or append trailers (a motion photo's video, which
/// may hold any bytes), and PIL reads such files. Entropy-coded data stuffs every 0xFF byte
/// with 0x00 and may hold restart markers (0xFFD0-0xFFD7) and fill bytes (0xFF), which are
/// read over; a progressive file has tables between its scans, and an EXIF thumbnail's own
/// markers lie inside a segment that is skipped whole.
///
/// After a scan, a marker whose segment cannot be one (it runs past the end of the file or
/// is not followed by a marker; a scan header of the wrong size) is damage in the
/// entropy-coded data, read over: such a file is left to the decoder to call corrupt.
fn has_end_marker(bytes: &[u8]) -> bool {
    const EOI: u8 = 0xD9;
    const SOS: u8 = 0xDA;
    if !bytes.starts_with(&[0xFF, 0xD8]) {
        return false;
    }
    let mut scanned = false;
    let mut from = 2;
    while let Some((at, code)) = next_marker(bytes, from) {
        from = at + 2;
        match code {
            EOI => return scanned,
            // Markers without a segment: TEM, restarts, SOI.
            0x01 | 0xD0..=0xD8 => {}
            _ => match segment_end(bytes, at) {
                Some(end) if !scanned || plausible_after_scan(bytes, at, end) => {
                    scanned |= code == SOS;
                    from = end;
                }
                // The file ends inside a header segment (or its length is broken).
                None if !scanned => return false,
                _ => {}
            },
        }
    }
    false
}

/// The first marker at or after `from`: its offset and code, past stuffed bytes (0xFF00),
/// restart markers and fill bytes.
fn next_marker(bytes: &[u8], mut from: usize) -> Option<(usize, u8)> {
    loop {
        let at = from + bytes.get(from..)?.iter().position(|&b| b == 0xFF)?;
        match *bytes.get(at + 1)? {
            0x00 | 0xD0..=0xD7 => from = at + 2,
            0xFF => from = at + 1,
            code => return Some((at, code)),
        }
    }
}

/// Where the segment of the marker at `at` ends, by its length field; `None` past the end of
/// the file.
fn segment_end(bytes: &[u8], at: usize) -> Option<usize> {
    let len = bytes.get(at + 2..at + 4)?;
    let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
    let end = at + 2 + len;
    (len >= 2 && end <= bytes.len()).then_some(end)
}

/// Whether the segment of the marker at `at`, ending at `end`, can be one after a scan: a scan
/// header's length matches its component count (1-4), any other segment is followed by a
/// marker.
fn plausible_after_scan(bytes: &[u8], at: usize, end: usize) -> bool {
    if bytes[at + 1] == 0xDA {
        let components = bytes.get(at + 4).map_or(0, |&n| usize::from(n));
        (1..=4).contains(&components) && end - at - 2 == 6 + 2 * components
    } else {
        bytes.get(end) == Some(&0xFF)
    }
}

impl Decoder {
    /// A decoder with empty buffers and the default pixel budget ([`MAX_PIXELS`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// The same decoder with a full-size decode refused above `max_pixels` (width x
    /// height, read from the file's header before anything is allocated for it).
    pub fn with_max_pixels(mut self, max_pixels: u64) -> Self {
        self.max_pixels = max_pixels;
        self
    }

    /// Refuses an image of `width` x `height` above the pixel budget, before its pixels are
    /// allocated.
    fn check_budget(&self, path: &Path, width: u32, height: u32) -> Result<(), DataError> {
        let pixels = u64::from(width) * u64::from(height);
        if pixels <= self.max_pixels {
            return Ok(());
        }
        Err(DataError::ImageTooLarge {
            path: path.to_path_buf(),
            width,
            height,
            limit: self.max_pixels,
        })
    }

    /// Reads and decodes the image at `path` to 8-bit RGB, upright according to its EXIF
    /// orientation. The returned view borrows this decoder's buffer until the next call.
    pub fn decode_file(&mut self, path: &Path) -> Result<RgbView<'_>, DataError> {
        self.read_file(path)?;
        self.decode_loaded(path)?;
        Ok(self.view())
    }

    /// Decodes an in-memory encoded image; `path` only names it in errors.
    pub fn decode_bytes(&mut self, bytes: &[u8], path: &Path) -> Result<RgbView<'_>, DataError> {
        self.file.clear();
        self.file.extend_from_slice(bytes);
        self.decode_loaded(path)?;
        Ok(self.view())
    }

    /// Reads `path` into this decoder's file buffer, for [`Self::jpeg_header`] and the
    /// decode calls that follow.
    pub(crate) fn load(&mut self, path: &Path) -> Result<(), DataError> {
        self.read_file(path)
    }

    /// Size of the loaded file if it is a JPEG that the reduced-size decoder can take
    /// (upright, YCbCr/RGB/grey), else `None`; [`DataError::ImageTooLarge`] for one over the
    /// pixel budget, as a full decode would refuse it.
    pub(crate) fn scalable_jpeg_size(&self, path: &Path) -> Result<Option<(u32, u32)>, DataError> {
        let Some(size) = self.scalable_jpeg_header() else {
            return Ok(None);
        };
        self.check_budget(path, size.0, size.1)?;
        Ok(Some(size))
    }

    fn scalable_jpeg_header(&self) -> Option<(u32, u32)> {
        if !is_jpeg(&self.file) {
            return None;
        }
        let mut decoder =
            JpegDecoder::new_with_options(ZCursor::new(&self.file[..]), jpeg_options());
        decoder.decode_headers().ok()?;
        let info = decoder.info()?;
        let upright = decoder
            .exif()
            .and_then(|exif| Orientation::from_exif_chunk(exif))
            .is_none_or(|o| o == Orientation::NoTransforms);
        let colour = decoder.input_colorspace()?;
        (upright && scaled_jpeg::supports(colour))
            .then_some((u32::from(info.width), u32::from(info.height)))
    }

    /// The image the last successful decode wrote.
    pub(crate) fn decoded(&self) -> RgbView<'_> {
        self.view()
    }

    /// Decodes the loaded file in full (see [`Self::decode_file`]).
    pub(crate) fn decode_loaded_file(&mut self, path: &Path) -> Result<RgbView<'_>, DataError> {
        self.decode_loaded(path)?;
        Ok(self.view())
    }

    /// Decodes the part of the loaded JPEG that covers `region` at scale `1 / denom`; returns
    /// it and the region in its coordinates. Only for files [`Self::scalable_jpeg_size`]
    /// accepts.
    pub(crate) fn decode_jpeg_part(
        &mut self,
        path: &Path,
        denom: u32,
        region: SourceRegion,
    ) -> Result<(RgbView<'_>, SourceRegion), DataError> {
        if !has_end_marker(&self.file) {
            return Err(decode_error(path, TRUNCATED));
        }
        let part =
            scaled_jpeg::decode_part(&self.file, denom, region, &mut self.pixels).map_err(|m| {
                // Several of libjpeg's own messages already begin so.
                let m = m.strip_prefix("Corrupt JPEG data: ").unwrap_or(&m);
                decode_error(path, format!("corrupt JPEG data: {m}"))
            })?;
        self.width = part.width;
        self.height = part.height;
        Ok((self.view(), part.region))
    }

    fn view(&self) -> RgbView<'_> {
        RgbView {
            width: self.width,
            height: self.height,
            pixels: &self.pixels[..self.width as usize * self.height as usize * 3],
        }
    }

    fn read_file(&mut self, path: &Path) -> Result<(), DataError> {
        let read_error = |source| DataError::ReadImage {
            path: path.to_path_buf(),
            source,
        };
        // A FIFO would block the open or the read forever, a device (/dev/zero) fill memory.
        if !std::fs::metadata(path).map_err(read_error)?.is_file() {
            let why = "not a regular file (a device, FIFO or socket): give an image file";
            return Err(read_error(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                why,
            )));
        }
        let mut f = std::fs::File::open(path).map_err(read_error)?;
        self.file.clear();
        f.read_to_end(&mut self.file).map_err(read_error)?;
        Ok(())
    }

    fn decode_loaded(&mut self, path: &Path) -> Result<(), DataError> {
        if self.file.is_empty() {
            return Err(decode_error(path, "the file is empty"));
        }
        if is_jpeg(&self.file) {
            self.decode_jpeg(path)
        } else {
            self.decode_other(path)
        }
    }

    fn decode_jpeg(&mut self, path: &Path) -> Result<(), DataError> {
        if !has_end_marker(&self.file) {
            return Err(decode_error(path, TRUNCATED));
        }
        let mut decoder =
            JpegDecoder::new_with_options(ZCursor::new(&self.file[..]), jpeg_options());
        decoder
            .decode_headers()
            .map_err(|e| decode_error(path, format!("not a valid JPEG: {e:?}")))?;
        let info = decoder
            .info()
            .ok_or_else(|| decode_error(path, "JPEG headers carry no image size"))?;
        let size = decoder
            .output_buffer_size()
            .ok_or_else(|| decode_error(path, "JPEG headers carry no image size"))?;
        let (width, height) = (u32::from(info.width), u32::from(info.height));
        self.check_budget(path, width, height)?;
        if size != width as usize * height as usize * 3 {
            return Err(decode_error(
                path,
                format!(
                    "decoder output is {size} bytes, expected {width} x {height} x 3 RGB bytes"
                ),
            ));
        }
        if self.pixels.len() < size {
            self.pixels.resize(size, 0);
        }
        decoder
            .decode_into(&mut self.pixels[..size])
            .map_err(|e| decode_error(path, format!("corrupt JPEG data: {e:?}")))?;
        self.width = width;
        self.height = height;
        let orientation = decoder
            .exif()
            .and_then(|exif| Orientation::from_exif_chunk(exif))
            .unwrap_or(Orientation::NoTransforms);
        if orientation != Orientation::NoTransforms {
            let pixels = std::mem::take(&mut self.pixels);
            let mut buf = pixels;
            buf.truncate(size);
            let img = image::RgbImage::from_raw(width, height, buf)
                .ok_or_else(|| decode_error(path, "decoded buffer has the wrong size"))?;
            let mut dynamic = DynamicImage::ImageRgb8(img);
            dynamic.apply_orientation(orientation);
            self.set_from_dynamic(dynamic);
        }
        Ok(())
    }

    fn decode_other(&mut self, path: &Path) -> Result<(), DataError> {
        let reader = ImageReader::new(std::io::Cursor::new(&self.file[..]))
            .with_guessed_format()
            .map_err(|e| decode_error(path, e))?;
        if reader.format().is_none() {
            return Err(decode_error(
                path,
                "unknown image format (expected JPEG or PNG)",
            ));
        }
        let mut decoder = reader.into_decoder().map_err(|e| decode_error(path, e))?;
        let (width, height) = decoder.dimensions();
        self.check_budget(path, width, height)?;
        let orientation = decoder.orientation().unwrap_or(Orientation::NoTransforms);
        let mut dynamic = DynamicImage::from_decoder(decoder).map_err(|e| decode_error(path, e))?;
        dynamic.apply_orientation(orientation);
        self.set_from_dynamic(dynamic);
        Ok(())
    }

    fn set_from_dynamic(&mut self, dynamic: DynamicImage) {
        let rgb = match dynamic {
            DynamicImage::ImageRgb8(img) => img,
            other => other.to_rgb8(),
        };
        self.width = rgb.width();
        self.height = rgb.height();
        self.pixels = rgb.into_raw();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A marker segment: the marker, its length (counting itself) and `payload`.
    fn segment(code: u8, payload: &[u8]) -> Vec<u8> {
        let len = u16::try_from(payload.len() + 2).unwrap().to_be_bytes();
        [&[0xFF, code, len[0], len[1]][..], payload].concat()
    }

    /// A scan header for `components` components, then entropy-coded data holding a stuffed
    /// 0xFF, a restart marker and fill bytes.
    fn scan(components: u8) -> Vec<u8> {
        let mut header = vec![components];
        for c in 0..components {
            header.extend([c + 1, 0x00]);
        }
        header.extend([0, 63, 0]);
        let data = [
            0x12, 0xFF, 0x00, 0x34, 0xFF, 0xD0, 0x56, 0xFF, 0xFF, 0xFF, 0xD1, 0x78,
        ];
        [segment(0xDA, &header), data.to_vec()].concat()
    }

    const SOI: [u8; 2] = [0xFF, 0xD8];
    const EOI: [u8; 2] = [0xFF, 0xD9];

    /// SOI, an EXIF segment holding a complete thumbnail (whose EOI comes before the image's
    /// scan), the tables and the frame header.
    fn headers() -> Vec<u8> {
        let thumbnail = [&SOI[..], &scan(3), &EOI].concat();
        let exif = [&b"Exif\0\0"[..], &thumbnail].concat();
        [
            SOI.to_vec(),
            segment(0xE1, &exif),
            segment(0xDB, &[0; 65]),
            segment(0xC0, &[8, 0, 16, 0, 16, 1, 1, 0x11, 0]),
            segment(0xC4, &[0; 17]),
        ]
        .concat()
    }

    #[test]
    fn a_baseline_file_is_complete_at_its_end_marker_and_truncated_before() {
        let file = [headers(), scan(1), EOI.to_vec()].concat();
        assert!(has_end_marker(&file));
        // Cut anywhere, in the headers, the thumbnail or the scan: truncated.
        for cut in 0..file.len() {
            assert!(
                !has_end_marker(&file[..cut]),
                "cut at {cut} of {}",
                file.len()
            );
        }
        // No scan, or no start-of-image marker: not a complete image.
        assert!(!has_end_marker(&[SOI, EOI].concat()));
        assert!(!has_end_marker(&file[2..]));
    }

    /// Whatever follows the end marker is not read: a trailer with a scan marker after an end
    /// marker (as a motion photo's video may hold) leaves the file complete.
    #[test]
    fn bytes_after_the_end_marker_are_not_read() {
        let file = [headers(), scan(1), EOI.to_vec()].concat();
        let trailer = [
            &[0, 0, 0, 0x18][..],
            b"ftypmp42",
            &EOI,
            b"mdat",
            &[0xFF, 0xDA, 7],
        ];
        let with_trailer = [&file[..], &trailer.concat()].concat();
        assert!(has_end_marker(&with_trailer));
        let padded = [&file[..], &[0; 300]].concat();
        assert!(has_end_marker(&padded));
    }

    /// A progressive file has several scans with tables between them: complete only at the
    /// end marker after the last one.
    #[test]
    fn a_progressive_file_is_complete_after_its_last_scan() {
        let first = [headers(), scan(3)].concat();
        let file = [
            first.clone(),
            segment(0xC4, &[0x10; 17]),
            scan(1),
            segment(0xFE, b"a comment"),
            scan(1),
            EOI.to_vec(),
        ]
        .concat();
        assert!(has_end_marker(&file));
        for cut in first.len()..file.len() {
            assert!(
                !has_end_marker(&file[..cut]),
                "cut at {cut} of {}",
                file.len()
            );
        }
    }

    /// Markers that damage put in the entropy-coded data (segments that cannot be segments)
    /// are read over: the file's end marker is found, and the decoder reports the damage.
    #[test]
    fn damage_in_the_scan_is_left_to_the_decoder() {
        let damage = [
            0xFF, 0xC4, 0xFF, 0xC4, 0x00, 0x05, 0x11, 0xFF, 0xDA, 0x00, 0x08, 0x01,
        ];
        let file = [
            headers(),
            scan(1),
            damage.to_vec(),
            vec![0x22; 40],
            EOI.to_vec(),
        ]
        .concat();
        assert!(has_end_marker(&file));
        assert!(!has_end_marker(&file[..file.len() - 2]));
    }

    /// A link to a device that never ends is refused before it is read, naming the file.
    #[test]
    fn a_file_that_is_not_regular_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("1_left.jpg");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        match Decoder::new().decode_file(&link) {
            Err(e @ DataError::ReadImage { .. }) => {
                let chain = format!("{e}: {}", std::error::Error::source(&e).unwrap());
                assert!(
                    chain.ends_with(
                        "1_left.jpg': not a regular file (a device, FIFO or socket): give an \
                         image file"
                    ),
                    "{chain}"
                );
            }
            other => panic!("expected ReadImage, got {:?}", other.map(|_| ())),
        }
    }

    #[test]
    fn empty_and_unknown_files_are_errors_naming_the_file() {
        let mut d = Decoder::new();
        let p = Path::new("dir/a.jpg");
        let e = d.decode_bytes(&[], p).unwrap_err();
        assert!(matches!(e, DataError::DecodeImage { .. }), "{e}");
        assert!(e.to_string().contains("dir/a.jpg"), "{e}");
        let e = d.decode_bytes(b"hello world, not an image", p).unwrap_err();
        assert!(e.to_string().contains("unknown image format"), "{e}");
    }
}
