//! Reduced-size decoding of part of a JPEG through libjpeg-turbo (vendored by `mozjpeg-sys`):
//! the IDCT runs at 1/2, 1/4 or 1/8 scale, only the columns of the crop are reconstructed,
//! and the rows above and below it are skipped (entropy-decoded, so that damage anywhere in
//! a baseline file is found whatever the crop, but not transformed). This is where a
//! 2-3k pixel ODIR original becomes a 224-pixel crop several times faster than a full
//! decode. This file holds the crate's unsafe code for decoding (libjpeg's C interface).

use std::ffi::{c_int, CStr};
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use mozjpeg_sys::{
    boolean, jpeg_common_struct, jpeg_create_decompress, jpeg_crop_scanline,
    jpeg_decompress_struct, jpeg_destroy_decompress, jpeg_error_mgr, jpeg_finish_decompress,
    jpeg_mem_src, jpeg_read_header, jpeg_read_scanlines, jpeg_skip_scanlines,
    jpeg_start_decompress, jpeg_std_error, JDIMENSION, J_COLOR_SPACE,
};

use crate::crop::SourceRegion;

/// A libjpeg error or warning, carried out of the C code by unwinding.
struct Failure(String);

/// libjpeg's `format_message` as C declares it: it writes into `buffer` (mozjpeg-sys
/// declares the buffer `&[u8; 80]`, a shared reference that must not be written through).
type FormatMessage = unsafe extern "C-unwind" fn(cinfo: &mut jpeg_common_struct, buffer: *mut u8);

fn message(cinfo: &mut jpeg_common_struct) -> String {
    let mut buffer = [0u8; 80];
    // SAFETY: `err` was set to a live `jpeg_error_mgr` before any libjpeg call, and
    // `format_message` writes a NUL-terminated string of at most 80 bytes into `buffer`.
    // The transmute changes only the buffer's parameter type, from `&[u8; 80]` to
    // `*mut u8`: both are one non-null pointer in the C ABI, and libjpeg's C function
    // takes `char *buffer`.
    unsafe {
        if let Some(format) = (*cinfo.err).format_message {
            let format: FormatMessage = std::mem::transmute(format);
            format(cinfo, buffer.as_mut_ptr());
            buffer[79] = 0;
        }
    }
    CStr::from_bytes_until_nul(&buffer)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown libjpeg error".to_string())
}

unsafe extern "C-unwind" fn error_exit(cinfo: &mut jpeg_common_struct) {
    // `resume_unwind` skips the panic hook: a corrupt file is an error value, not a crash.
    resume_unwind(Box::new(Failure(message(cinfo))));
}

unsafe extern "C-unwind" fn emit_message(cinfo: &mut jpeg_common_struct, level: c_int) {
    // Level -1 is a warning about corrupt data; treat it as an error, like the strict
    // decoder used for full-size decodes.
    if level < 0 {
        resume_unwind(Box::new(Failure(message(cinfo))));
    }
}

/// The decoded part of an image and where the requested region lies inside it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DecodedPart {
    /// Columns decoded.
    pub width: u32,
    /// Rows decoded.
    pub height: u32,
    /// The requested region in the coordinates of the decoded part.
    pub region: SourceRegion,
}

/// Whether libjpeg can produce RGB from this JPEG colour space (CMYK/YCCK cannot).
pub(crate) fn supports(colour_space: zune_jpeg::zune_core::colorspace::ColorSpace) -> bool {
    use zune_jpeg::zune_core::colorspace::ColorSpace as C;
    matches!(colour_space, C::YCbCr | C::RGB | C::Luma)
}

/// Decodes the rows and columns of `jpeg` covering `region` (full-resolution pixel
/// coordinates) at scale `1 / denom` (`denom` in 1, 2, 4, 8) as RGB into `out`.
pub(crate) fn decode_part(
    jpeg: &[u8],
    denom: u32,
    region: SourceRegion,
    out: &mut Vec<u8>,
) -> Result<DecodedPart, String> {
    let mut err = MaybeUninit::<jpeg_error_mgr>::zeroed();
    let mut cinfo = MaybeUninit::<jpeg_decompress_struct>::zeroed();
    // SAFETY: both structs are zero-initialised plain C data; `jpeg_std_error` fills the
    // error manager, and `jpeg_create_decompress` initialises `cinfo` with `err` attached.
    // Both outlive every libjpeg call below, which all happen inside `catch_unwind` so that
    // an error unwinding out of libjpeg (see `error_exit`) is caught before
    // `jpeg_destroy_decompress` frees libjpeg's memory.
    let cinfo = unsafe {
        let err = jpeg_std_error(&mut *err.as_mut_ptr());
        err.error_exit = Some(error_exit);
        err.emit_message = Some(emit_message);
        let cinfo_ptr = cinfo.as_mut_ptr();
        (*cinfo_ptr).common.err = err;
        jpeg_create_decompress(cinfo_ptr);
        &mut *cinfo_ptr
    };
    let result = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `cinfo` is initialised (above) and `jpeg` outlives the decompression;
        // every scanline pointer handed to libjpeg points into `out`, sized for the rows
        // and columns libjpeg reports (`output_width` after cropping).
        unsafe { decode_into(cinfo, jpeg, denom, region, out) }
    }));
    // SAFETY: `cinfo` was created above; after an error libjpeg's state is abandoned, which
    // `jpeg_destroy_decompress` handles (it frees all pools).
    unsafe { jpeg_destroy_decompress(cinfo) };
    match result {
        Ok(part) => Ok(part),
        Err(payload) => match payload.downcast::<Failure>() {
            Ok(f) => Err(f.0),
            Err(other) => resume_unwind(other),
        },
    }
}

/// Decodes `jpeg` into `out` at `1/denom` scale, only `region`'s rows and columns.
///
/// # Safety
///
/// `cinfo` must be a decompressor created with `jpeg_create_decompress` whose error manager
/// unwinds (panics) instead of returning, and not yet given a source.
unsafe fn decode_into(
    cinfo: &mut jpeg_decompress_struct,
    jpeg: &[u8],
    denom: u32,
    region: SourceRegion,
    out: &mut Vec<u8>,
) -> DecodedPart {
    // SAFETY: (whole function) the caller guarantees `cinfo` is a created decompressor.
    unsafe {
        jpeg_mem_src(cinfo, jpeg.as_ptr(), jpeg.len() as _);
        jpeg_read_header(cinfo, true as boolean);
        cinfo.scale_num = 1;
        cinfo.scale_denom = denom;
        cinfo.out_color_space = J_COLOR_SPACE::JCS_RGB;
        // Merged chroma upsampling and colour conversion, as PIL's `draft` mode: at reduced
        // scale, followed by an antialiased shrink, the difference is invisible.
        cinfo.do_fancy_upsampling = false as boolean;
        jpeg_start_decompress(cinfo);
        let (out_w, out_h) = (cinfo.output_width, cinfo.output_height);
        let d = f64::from(denom);
        let x0 = ((region.left / d).floor() as JDIMENSION).min(out_w.saturating_sub(1));
        let x1 = (((region.left + region.width) / d).ceil() as JDIMENSION).clamp(x0 + 1, out_w);
        let y0 = ((region.top / d).floor() as JDIMENSION).min(out_h.saturating_sub(1));
        let y1 = (((region.top + region.height) / d).ceil() as JDIMENSION).clamp(y0 + 1, out_h);
        let (mut xoff, mut width) = (x0, x1 - x0);
        if width < out_w {
            // Widens the window to whole iMCUs: `xoff` may move left, `width` grow.
            jpeg_crop_scanline(cinfo, &mut xoff, &mut width);
        }
        let width = cinfo.output_width;
        if y0 > 0 {
            jpeg_skip_scanlines(cinfo, y0);
        }
        let rows = y1 - y0;
        let stride = width as usize * 3;
        out.resize(stride * rows as usize, 0);
        let mut done = 0;
        while done < rows {
            let mut row = out[done as usize * stride..].as_mut_ptr();
            let got = jpeg_read_scanlines(cinfo, &mut row, 1);
            if got == 0 {
                resume_unwind(Box::new(Failure(
                    "libjpeg returned no scanline".to_string(),
                )));
            }
            done += got;
        }
        // The rows below are not needed, but their entropy-coded data must still be read:
        // otherwise damage there would fail only the epochs whose crop reaches it. Skipping
        // whole iMCU rows Huffman-decodes them (no IDCT, no colour conversion), but a skip to
        // the end of the image returns without decoding anything: skip to the last row, and
        // read that one. (A progressive file was read whole by `jpeg_start_decompress`.)
        let last = out_h - 1;
        if y1 <= last {
            if y1 < last {
                jpeg_skip_scanlines(cinfo, last - y1);
            }
            let len = out.len();
            out.resize(len + stride, 0);
            let mut row = out[len..].as_mut_ptr();
            if jpeg_read_scanlines(cinfo, &mut row, 1) == 0 {
                resume_unwind(Box::new(Failure(
                    "libjpeg returned no scanline".to_string(),
                )));
            }
            out.truncate(len);
        }
        // Reads on to the end-of-image marker, reporting what it finds on the way.
        jpeg_finish_decompress(cinfo);
        DecodedPart {
            width,
            height: rows,
            region: SourceRegion {
                top: region.top / d - f64::from(y0),
                left: region.left / d - f64::from(xoff),
                height: region.height / d,
                width: region.width / d,
            },
        }
    }
}
