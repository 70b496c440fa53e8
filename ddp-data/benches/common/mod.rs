//! What the data benches share: the ODIR-like JPEGs they read.

use std::path::{Path, PathBuf};

use ddp_data::odir::synthetic::paint_fundus;
use image::codecs::jpeg::JpegEncoder;
use image::ExtendedColorType;

/// The folder the benches write their images to (inside the workspace's `target/`).
pub fn bench_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/ddp-data-bench")
}

/// Writes (once) `count` fundus JPEGs of `size` x `size` pixels with assorted lesions,
/// quality 92, and returns their paths.
#[allow(dead_code)] // Used by one of the two benches.
pub fn images(size: u32, count: usize) -> Vec<PathBuf> {
    let dir = bench_dir();
    std::fs::create_dir_all(&dir).expect("create bench image folder");
    (0..count)
        .map(|k| {
            let path = dir.join(format!("odir_like_{size}_{k}.jpg"));
            if !path.exists() {
                let mut labels = [false; 8];
                labels[[1, 2, 4, 5][k % 4]] = true;
                let px = paint_fundus(size, labels, k % 2 == 0, 17, k as u64);
                let mut out = Vec::new();
                JpegEncoder::new_with_quality(&mut out, 92)
                    .encode(&px, size, size, ExtendedColorType::Rgb8)
                    .expect("encode bench JPEG");
                let tmp = path.with_extension("tmp");
                std::fs::write(&tmp, out).expect("write bench JPEG");
                std::fs::rename(&tmp, &path).expect("rename bench JPEG");
            }
            path
        })
        .collect()
}

/// CPU seconds this thread has used: on a shared machine other processes' load inflates wall
/// time but not this, so comparisons count it on both sides.
#[allow(dead_code)] // Used by one of the two benches.
pub fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec; the clock id is a constant libc knows.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Writes (once) a photo-like JPEG of `size` x `size`: a fundus with camera-like grain and
/// fine texture added everywhere, so that it has the high-frequency detail the synthetic
/// fundus lacks (what reduced-scale decoding loses first).
#[allow(dead_code)] // Used by one of the two benches.
pub fn photo_like(size: u32) -> PathBuf {
    let dir = bench_dir();
    std::fs::create_dir_all(&dir).expect("create bench image folder");
    let path = dir.join(format!("photo_like_{size}.jpg"));
    if !path.exists() {
        let mut px = paint_fundus(
            size,
            [false, true, false, false, true, false, false, false],
            true,
            17,
            99,
        );
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for (i, p) in px.iter_mut().enumerate() {
            // xorshift grain of +-12 and a fine diagonal weave of period ~3 px.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let grain = (state % 25) as i32 - 12;
            let (x, y) = ((i / 3) as u32 % size, (i / 3) as u32 / size);
            let weave = if (x + 2 * y) % 3 == 0 { 10 } else { -5 };
            *p = (i32::from(*p) + grain + weave).clamp(0, 255) as u8;
        }
        let mut out = Vec::new();
        JpegEncoder::new_with_quality(&mut out, 92)
            .encode(&px, size, size, ExtendedColorType::Rgb8)
            .expect("encode bench JPEG");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, out).expect("write bench JPEG");
        std::fs::rename(&tmp, &path).expect("rename bench JPEG");
    }
    path
}
