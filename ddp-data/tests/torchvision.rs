//! Every transform equals torchvision's (0.28, PIL path) with the same parameters, within
//! 1/255 per pixel: `Resize` + `CenterCrop` and `RandomResizedCrop`'s crop and resize on the
//! same image; both flips, `RandomRotation`, and `ColorJitter`'s brightness, contrast and
//! saturation on the same crop, alone and drawn together as training draws them. (The resize
//! itself may differ by one level from PIL's, which a jitter factor above 1 would magnify:
//! hence the augmentations start from the same crop.) JPEGs, decoded and through the default
//! pipeline, are within a few levels of torchvision on PIL's decode of the same file. Runs the
//! Python of `cargo xtask setup` (`tests/torchvision_reference.py`) once per image.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::path::Path;

use ddp_data::crop::CropBox;
use ddp_data::odir::decode::Decoder;
use ddp_data::odir::transform::{
    Augment, AugmentDraw, ColorOp, Interpolation, Pipeline, Placement, Transform, DEFAULT_RATIO,
    IMAGENET_MEAN, IMAGENET_STD,
};
use ddp_data::rng::SampleRng;

/// The test image: a smooth gradient under per-pixel noise, so that a resampling weight or a
/// nearest-neighbour index that differs shows.
fn write_image(path: &Path, width: u32, height: u32) {
    let mut rng = SampleRng::from_seed_and_tag(9, b"tv-image", 0);
    let mut px = Vec::with_capacity((width * height * 3) as usize);
    for y in 0..height {
        for x in 0..width {
            let base = [
                x * 200 / width,
                y * 200 / height,
                (x + y) * 100 / (width + height),
            ];
            for b in base {
                px.push((b + rng.below(56) as u32) as u8);
            }
        }
    }
    image::save_buffer(path, &px, width, height, image::ExtendedColorType::Rgb8).unwrap();
}

struct Case {
    name: String,
    ops: String,
    ours: Vec<u8>,
}

fn crop_op(p: &Placement, size: u32) -> String {
    let r = p.region;
    format!(
        "resized_crop {} {} {} {} {size}",
        r.top, r.left, r.height, r.width
    )
}

/// torchvision's calls for a training placement, in `Compose` order, after `start` (the
/// crop, or the file holding our crop).
fn train_ops(p: &Placement, start: String) -> String {
    let mut ops = start;
    if p.flip {
        ops.push_str(" | hflip");
    }
    if p.augment.vflip {
        ops.push_str(" | vflip");
    }
    if p.augment.angle != 0.0 {
        write!(ops, " | rotate {}", p.augment.angle).unwrap();
    }
    for (op, f) in p.augment.jitter.iter().flatten() {
        let name = match op {
            ColorOp::Brightness => "brightness",
            ColorOp::Contrast => "contrast",
            ColorOp::Saturation => "saturation",
        };
        write!(ops, " | {name} {f}").unwrap();
    }
    ops
}

#[test]
fn transforms_equal_torchvision_within_one_level() {
    let tmp = tempfile::tempdir().unwrap();
    let (w, h) = (300u32, 220u32);
    let image = tmp.path().join("image.png");
    write_image(&image, w, h);
    let mut pipeline = Pipeline::new();
    let mut cases = Vec::new();

    // The evaluation transform, Resize(S) + CenterCrop(S), and with a larger resize.
    for (resize, crop) in [(64, 64), (73, 64), (224, 224), (256, 224)] {
        let t = Transform::eval(resize, crop).unwrap();
        let mut ours = vec![0u8; t.sample_len()];
        let mut rng = SampleRng::new(0, 0, 0);
        pipeline.run_u8(&t, &image, &mut rng, &mut ours).unwrap();
        cases.push(Case {
            name: format!("eval_{resize}_{crop}"),
            ops: format!("resize_centre_crop {resize} {crop}"),
            ours,
        });
    }

    // Each augmentation alone on a fixed crop.
    let size = 48;
    let t = Transform::train(size);
    let crop = CropBox {
        top: 17,
        left: 41,
        height: 150,
        width: 170,
    };
    let none = AugmentDraw::default();
    let mut singles: Vec<(String, bool, AugmentDraw)> = vec![
        ("crop".into(), false, none),
        ("hflip".into(), true, none),
        (
            "vflip".into(),
            false,
            AugmentDraw {
                vflip: true,
                ..none
            },
        ),
    ];
    for (name, angle) in [
        ("rot_small", 3.7),
        ("rot_neg", -29.25),
        ("rot_wide", 135.5),
        ("rot_90", 90.0),
        ("rot_180", -180.0),
    ] {
        singles.push((name.into(), false, AugmentDraw { angle, ..none }));
    }
    for (name, op) in [
        ("bright", ColorOp::Brightness),
        ("contrast", ColorOp::Contrast),
        ("saturate", ColorOp::Saturation),
    ] {
        for factor in [0.55, 1.37] {
            let jitter = [Some((op, factor)), None, None];
            let name = format!("{name}_{factor}");
            singles.push((name, false, AugmentDraw { jitter, ..none }));
        }
    }
    singles.push((
        "rot_flips".into(),
        true,
        AugmentDraw {
            vflip: true,
            angle: 21.0,
            ..none
        },
    ));
    // Our crop, the input of torchvision's augmentations.
    let base = |region: CropBox, name: &str, pipeline: &mut Pipeline| {
        let p = Placement {
            region: region.into(),
            flip: false,
            augment: AugmentDraw::default(),
        };
        let mut crop = vec![0u8; t.sample_len()];
        pipeline.run_u8_placed(&t, &image, &p, &mut crop).unwrap();
        let file = tmp.path().join(format!("{name}.input"));
        std::fs::write(&file, crop).unwrap();
        format!("raw {} {size}", file.display())
    };
    let start = base(crop, "crop", &mut pipeline);
    for (name, flip, augment) in singles {
        let p = Placement {
            region: crop.into(),
            flip,
            augment,
        };
        let mut ours = vec![0u8; t.sample_len()];
        pipeline.run_u8_placed(&t, &image, &p, &mut ours).unwrap();
        let from = if name == "crop" {
            crop_op(&p, size)
        } else {
            start.clone()
        };
        cases.push(Case {
            name,
            ops: train_ops(&p, from),
            ours,
        });
    }

    // Training draws of everything together, through the loader's own path.
    let augment = Augment {
        vflip: true,
        rotation: 40.0,
        jitter: [0.4, 0.4, 0.4],
    };
    let t = Transform::random_resized_crop(size, (0.2, 1.0), DEFAULT_RATIO)
        .unwrap()
        .with_hflip(true)
        .with_augment(augment)
        .unwrap();
    for i in 0..16 {
        let placement = t.placement(h, w, &mut SampleRng::new(5, 2, i));
        let mut ours = vec![0u8; t.sample_len()];
        pipeline
            .run_u8(&t, &image, &mut SampleRng::new(5, 2, i), &mut ours)
            .unwrap();
        let r = placement.region;
        let region = CropBox {
            top: r.top as u32,
            left: r.left as u32,
            height: r.height as u32,
            width: r.width as u32,
        };
        cases.push(Case {
            name: format!("drawn_{i}_crop"),
            ops: crop_op(&placement, size),
            ours: {
                let mut crop = vec![0u8; t.sample_len()];
                let plain = Placement {
                    flip: false,
                    augment: AugmentDraw::default(),
                    ..placement
                };
                pipeline
                    .run_u8_placed(&t, &image, &plain, &mut crop)
                    .unwrap();
                crop
            },
        });
        let start = base(region, &format!("drawn_{i}"), &mut pipeline);
        cases.push(Case {
            name: format!("drawn_{i}"),
            ops: train_ops(&placement, start),
            ours,
        });
    }

    compare_with_torchvision(&image, &cases, tmp.path(), RESIZE);
}

/// The evaluation transform's cases of `sizes` on `image`, bilinear and bicubic.
fn eval_cases(image: &Path, sizes: &[(u32, u32)]) -> Vec<Case> {
    let mut pipeline = Pipeline::new();
    let mut cases = Vec::new();
    for &(resize, crop) in sizes {
        for (interpolation, name) in [
            (Interpolation::Bilinear, ""),
            (Interpolation::Bicubic, " bicubic"),
        ] {
            let t = Transform::eval(resize, crop)
                .unwrap()
                .with_interpolation(interpolation);
            let mut ours = vec![0u8; t.sample_len()];
            let mut rng = SampleRng::new(0, 0, 0);
            pipeline.run_u8(&t, image, &mut rng, &mut ours).unwrap();
            cases.push(Case {
                name: format!("eval_{resize}_{crop}{}", name.replace(' ', "_")),
                ops: format!("resize_centre_crop {resize} {crop}{name}"),
                ours,
            });
        }
    }
    cases
}

/// The test image of `width x height` through [`eval_cases`] of `sizes`, against torchvision.
fn eval_against_torchvision((width, height): (u32, u32), sizes: &[(u32, u32)]) {
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("image.png");
    write_image(&image, width, height);
    let cases = eval_cases(&image, sizes);
    compare_with_torchvision(&image, &cases, tmp.path(), RESIZE);
}

/// On a portrait image the evaluation transform's resize fixes the width, and `CenterCrop`
/// rounds its top offset as torchvision does (`int(round(11.5))` is 12 in Python); bilinear
/// and bicubic (`Resize(r, BICUBIC)`, as EfficientNet's weights evaluate) alike.
#[test]
fn the_evaluation_transform_equals_torchvision_on_a_portrait_image() {
    // Resize(64): 64 x 87, a top offset of 11.5; Resize(73): 73 x 99, 17.5.
    eval_against_torchvision((221, 301), &[(64, 64), (73, 64), (64, 48)]);
}

/// Bicubic as torchvision's `Resize(r, BICUBIC)` on a landscape image, shrinking a lot and a
/// little.
#[test]
fn the_bicubic_evaluation_transform_equals_torchvisions() {
    eval_against_torchvision((300, 220), &[(64, 64), (200, 180), (256, 224)]);
}

/// The normalised floats of the pipeline (`Normalize` folded into one multiply-add per
/// byte) equal `Normalize(mean, std)(ToTensor()(img))` on the same bytes within 2e-6.
#[test]
fn normalised_floats_equal_torchvisions_to_tensor_and_normalize() {
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("image.png");
    write_image(&image, 300, 220);
    let t = Transform::eval(73, 64)
        .unwrap()
        .with_normalization(IMAGENET_MEAN, IMAGENET_STD)
        .unwrap();
    let mut pipeline = Pipeline::new();
    let mut bytes = vec![0u8; t.sample_len()];
    let mut floats = vec![0f32; t.sample_len()];
    pipeline
        .run_u8(&t, &image, &mut SampleRng::new(0, 0, 0), &mut bytes)
        .unwrap();
    pipeline
        .run(&t, &image, &mut SampleRng::new(0, 0, 0), &mut floats)
        .unwrap();
    let raw = tmp.path().join("crop.input");
    std::fs::write(&raw, &bytes).unwrap();
    let numbers = |v: [f32; 3]| v.map(|x| x.to_string()).join(" ");
    let ops = format!(
        "raw {} 64 | to_tensor_normalize {} {}",
        raw.display(),
        numbers(IMAGENET_MEAN),
        numbers(IMAGENET_STD)
    );
    let list = tmp.path().join("cases.txt");
    std::fs::write(&list, format!("normalized {ops}\n")).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/torchvision_reference.py");
    run_python(&[
        script.as_os_str(),
        image.as_os_str(),
        list.as_os_str(),
        tmp.path().as_os_str(),
    ]);
    let theirs: Vec<f32> = std::fs::read(tmp.path().join("normalized.bin"))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(theirs.len(), floats.len());
    let worst = floats
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= 2e-6, "largest difference {worst}");
    // Channel order and constants: the first value of each channel plane.
    let plane = 64 * 64;
    for c in 0..3 {
        let want = (f32::from(bytes[c * plane]) / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c];
        assert!((floats[c * plane] - want).abs() <= 2e-6, "channel {c}");
    }
}

/// How far a case that resizes may be from torchvision's, per byte at most and on average
/// over its bytes; what follows a resize is exact.
#[derive(Clone, Copy)]
struct Tolerance {
    max: u8,
    mean: f64,
}

/// Resizes round one level apart from PIL's at most.
const RESIZE: Tolerance = Tolerance { max: 1, mean: 0.5 };

/// Runs the Python of `cargo xtask setup` with `args`; its errors fail the test.
fn run_python(args: &[&OsStr]) {
    let out = ddp_testkit::setup_python()
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "python {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs torchvision's side of `cases` on `image` (scratch files in `dir`) and checks every
/// case against ours within `tolerance`.
fn compare_with_torchvision(image: &Path, cases: &[Case], dir: &Path, tolerance: Tolerance) {
    let list = dir.join("cases.txt");
    let lines: String = cases
        .iter()
        .map(|c| format!("{} {}\n", c.name, c.ops))
        .collect();
    std::fs::write(&list, lines).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/torchvision_reference.py");
    run_python(&[
        script.as_os_str(),
        image.as_os_str(),
        list.as_os_str(),
        dir.as_os_str(),
    ]);
    let mut failures = Vec::new();
    for case in cases {
        let theirs = std::fs::read(dir.join(format!("{}.bin", case.name))).unwrap();
        assert_eq!(theirs.len(), case.ours.len(), "{}: size", case.name);
        let diffs = || case.ours.iter().zip(&theirs).map(|(a, b)| a.abs_diff(*b));
        let worst = diffs().max().unwrap_or(0);
        let mean = diffs().map(f64::from).sum::<f64>() / theirs.len() as f64;
        let differing = diffs().filter(|&d| d != 0).count();
        eprintln!(
            "{}: max diff {worst}, mean {mean:.3}, {differing} of {} bytes differ ({})",
            case.name,
            theirs.len(),
            case.ops
        );
        let allowed = if case.ops.starts_with("raw ") {
            Tolerance { max: 0, mean: 0.0 }
        } else {
            tolerance
        };
        if worst > allowed.max || mean > allowed.mean {
            failures.push(format!(
                "{} (max diff {worst}, mean {mean:.3}: {})",
                case.name, case.ops
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "differ from torchvision (by more than {}/255 or {}/255 on average, augmentations \
         at all): {failures:#?}",
        tolerance.max,
        tolerance.mean
    );
}

/// The image as our decoder gives it, in the reference's CHW order.
fn decoded_case(image: &Path) -> Case {
    let mut decoder = Decoder::new();
    let hwc = decoder.decode_file(image).unwrap().pixels;
    Case {
        name: "decoded".into(),
        ops: "decoded".into(),
        ours: (0..3)
            .flat_map(|c| hwc.iter().skip(c).step_by(3).copied())
            .collect(),
    }
}

/// Our side of a JPEG's cases, as the loader decodes it: the evaluation transforms `evals`
/// and eight training crops of `size` drawn by the default transform.
fn jpeg_cases(image: &Path, (w, h): (u32, u32), evals: &[(u32, u32)], size: u32) -> Vec<Case> {
    let mut cases = Vec::new();
    let mut pipeline = Pipeline::new();
    for &(resize, crop) in evals {
        let t = Transform::eval(resize, crop).unwrap();
        let mut ours = vec![0u8; t.sample_len()];
        pipeline
            .run_u8(&t, image, &mut SampleRng::new(0, 0, 0), &mut ours)
            .unwrap();
        cases.push(Case {
            name: format!("eval_{resize}_{crop}"),
            ops: format!("resize_centre_crop {resize} {crop}"),
            ours,
        });
    }
    let t = Transform::random_resized_crop(size, (0.2, 1.0), DEFAULT_RATIO).unwrap();
    for i in 0..8 {
        let placement = t.placement(h, w, &mut SampleRng::new(7, 1, i));
        let mut ours = vec![0u8; t.sample_len()];
        pipeline
            .run_u8(&t, image, &mut SampleRng::new(7, 1, i), &mut ours)
            .unwrap();
        cases.push(Case {
            name: format!("drawn_{i}"),
            ops: crop_op(&placement, size),
            ours,
        });
    }
    cases
}

/// A JPEG of 1000 x 760 through the default pipeline, as the loader decodes it: the
/// evaluation transform and drawn training crops (most shrink 2x or more) equal torchvision's
/// on the file PIL decodes, within a level (the `image` crate writes 4:4:4 chroma).
#[test]
fn a_large_jpeg_transforms_as_torchvision_by_default() {
    let tmp = tempfile::tempdir().unwrap();
    let (w, h) = (1000u32, 760u32);
    let png = tmp.path().join("source.png");
    write_image(&png, w, h);
    let px = image::open(&png).unwrap().to_rgb8();
    let image = tmp.path().join("image.jpg");
    let mut bytes = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, 90)
        .encode(&px, w, h, image::ExtendedColorType::Rgb8)
        .unwrap();
    std::fs::write(&image, bytes).unwrap();
    let cases = jpeg_cases(&image, (w, h), &[(256, 224), (96, 64)], 96);
    compare_with_torchvision(&image, &cases, tmp.path(), RESIZE);
}

/// A 640 x 512 JPEG that PIL writes at quality 90 with `subsampling` (PIL's: 0 is 4:4:4, 1
/// 4:2:2, 2 4:2:0, its default) is, decoded, through the evaluation transform and in 224-px
/// training crops, within `tolerance` of torchvision's on the file PIL decodes. (Both sides
/// are multiples of 16: zune-jpeg reads the padding of the last chroma block otherwise.)
fn pil_jpeg_within(subsampling: u8, tolerance: Tolerance) {
    let tmp = tempfile::tempdir().unwrap();
    let (w, h) = (640u32, 512u32);
    let png = tmp.path().join("source.png");
    write_image(&png, w, h);
    let image = tmp.path().join("image.jpg");
    let write = "import sys; from PIL import Image, JpegImagePlugin as J; \
        s = int(sys.argv[3]); \
        Image.open(sys.argv[1]).save(sys.argv[2], quality=90, subsampling=s); \
        assert J.get_sampling(Image.open(sys.argv[2])) == s";
    let subsampling = subsampling.to_string();
    run_python(&[
        "-c".as_ref(),
        write.as_ref(),
        png.as_os_str(),
        image.as_os_str(),
        subsampling.as_ref(),
    ]);
    let mut cases = vec![decoded_case(&image)];
    cases.extend(jpeg_cases(&image, (w, h), &[(256, 224)], 224));
    compare_with_torchvision(&image, &cases, tmp.path(), tolerance);
}

/// zune-jpeg's inverse DCT rounds apart from libjpeg's on a few bytes of fine texture.
#[test]
fn a_444_jpeg_is_within_3_levels_of_torchvision() {
    pil_jpeg_within(0, Tolerance { max: 3, mean: 0.3 });
}

/// Chroma subsampled, as PIL, OpenCV and cameras write JPEGs by default: zune-jpeg's
/// upsampling of the chroma also rounds apart from libjpeg's, on every colour edge.
#[test]
fn subsampled_jpegs_are_within_5_levels_of_torchvision() {
    for subsampling in [2, 1] {
        pil_jpeg_within(subsampling, Tolerance { max: 5, mean: 0.5 });
    }
}
