//! Every transform equals torchvision's (0.28, PIL path) with the same parameters, within
//! 1/255 per pixel: `Resize` + `CenterCrop` and `RandomResizedCrop`'s crop and resize on the
//! same image; both flips, `RandomRotation`, and `ColorJitter`'s brightness, contrast and
//! saturation on the same crop, alone and drawn together as training draws them. (The resize
//! itself may differ by one level from PIL's, which a jitter factor above 1 would magnify:
//! hence the augmentations start from the same crop.) A large JPEG through the default
//! pipeline equals torchvision on PIL's decode of the same file. Runs the Python of `cargo xtask setup`
//! (`tests/torchvision_reference.py`) once for all cases.

use std::fmt::Write as _;
use std::path::Path;

use ddp_data::crop::CropBox;
use ddp_data::odir::transform::{
    Augment, AugmentDraw, ColorOp, Pipeline, Placement, Transform, DEFAULT_RATIO,
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

    compare_with_torchvision(&image, &cases, tmp.path(), 1);
}

/// Runs torchvision's side of `cases` on `image` (scratch files in `dir`) and checks every
/// case against ours: resizes within `resize_levels` per byte, what follows them exactly.
fn compare_with_torchvision(image: &Path, cases: &[Case], dir: &Path, resize_levels: u8) {
    let list = dir.join("cases.txt");
    let lines: String = cases
        .iter()
        .map(|c| format!("{} {}\n", c.name, c.ops))
        .collect();
    std::fs::write(&list, lines).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/torchvision_reference.py");
    let out = ddp_testkit::setup_python()
        .arg(script)
        .arg(image)
        .arg(&list)
        .arg(dir)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "torchvision_reference.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut failures = Vec::new();
    for case in cases {
        let theirs = std::fs::read(dir.join(format!("{}.bin", case.name))).unwrap();
        assert_eq!(theirs.len(), case.ours.len(), "{}: size", case.name);
        let worst = case
            .ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap_or(0);
        let differing = case
            .ours
            .iter()
            .zip(&theirs)
            .filter(|(a, b)| a != b)
            .count();
        eprintln!(
            "{}: max diff {worst}, {differing} of {} bytes differ ({})",
            case.name,
            theirs.len(),
            case.ops
        );
        // The resize may round differently from PIL's; what follows it is exact.
        let allowed = if case.ops.starts_with("raw ") {
            0
        } else {
            resize_levels
        };
        if worst > allowed {
            failures.push(format!("{} (max diff {worst}: {})", case.name, case.ops));
        }
    }
    assert!(
        failures.is_empty(),
        "differ from torchvision (resizes by more than 1/255, augmentations at all): \
         {failures:#?}"
    );
}

/// A JPEG of 1000 x 760 through the default pipeline, as the loader decodes it: the
/// evaluation transform and drawn training crops (most shrink 2x or more) equal torchvision's
/// on the file PIL decodes.
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
    let mut pipeline = Pipeline::new();
    let mut cases = Vec::new();
    for (resize, crop) in [(256, 224), (96, 64)] {
        let t = Transform::eval(resize, crop).unwrap();
        let mut ours = vec![0u8; t.sample_len()];
        pipeline
            .run_u8(&t, &image, &mut SampleRng::new(0, 0, 0), &mut ours)
            .unwrap();
        cases.push(Case {
            name: format!("eval_{resize}_{crop}"),
            ops: format!("resize_centre_crop {resize} {crop}"),
            ours,
        });
    }
    let t = Transform::random_resized_crop(96, (0.2, 1.0), DEFAULT_RATIO).unwrap();
    for i in 0..8 {
        let placement = t.placement(h, w, &mut SampleRng::new(7, 1, i));
        let mut ours = vec![0u8; t.sample_len()];
        pipeline
            .run_u8(&t, &image, &mut SampleRng::new(7, 1, i), &mut ours)
            .unwrap();
        cases.push(Case {
            name: format!("drawn_{i}"),
            ops: crop_op(&placement, 96),
            ours,
        });
    }
    compare_with_torchvision(&image, &cases, tmp.path(), 1);
}
