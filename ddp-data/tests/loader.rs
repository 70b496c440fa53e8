//! The batch loader: index order, drop_last, determinism across worker counts, bounded
//! prefetch, prompt shutdown, and worker errors that name the file.
#![cfg(feature = "odir")]

mod common;

use std::path::Path;
use std::sync::Arc;

use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_data::odir::transform::{Pipeline, Transform};
use ddp_data::odir::{OdirDataset, OdirImages, OdirOptions};
use ddp_data::rng::SampleRng;
use ddp_data::{DataError, HostBatch, HostLoader, InputRef, LoaderConfig, Storage};

fn synthetic(dir: &Path, images: usize) -> Arc<OdirDataset> {
    let config = SyntheticConfig {
        images,
        size: 64,
        seed: 3,
        quality: 90,
        ..Default::default()
    };
    generate(dir, &config).unwrap();
    Arc::new(OdirDataset::open(dir, &OdirOptions::default()).unwrap())
}

fn collect(
    ds: &Arc<OdirDataset>,
    indices: Vec<usize>,
    transform: Transform,
    config: &LoaderConfig,
) -> Vec<HostBatch> {
    HostLoader::new(OdirImages::new(ds.clone(), transform), indices, config)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

#[test]
fn batches_follow_the_index_list_and_drop_last() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 10);
    let indices = vec![5, 3, 9, 1, 7];
    let config = LoaderConfig {
        workers: 3,
        ..LoaderConfig::new(2)
    };
    let batches = collect(&ds, indices.clone(), Transform::train(16), &config);
    let got: Vec<Vec<usize>> = batches.iter().map(|b| b.indices().to_vec()).collect();
    assert_eq!(got, vec![vec![5, 3], vec![9, 1], vec![7]]);
    for b in &batches {
        assert_eq!(b.input_f32().unwrap().len(), b.len() * 3 * 16 * 16);
        for (k, &i) in b.indices().iter().enumerate() {
            assert_eq!(
                &b.targets_f32().unwrap()[k * 8..(k + 1) * 8],
                &ds.sample(i).unwrap().labels
            );
        }
    }
    let dropping = LoaderConfig {
        drop_last: true,
        ..config
    };
    let images = OdirImages::new(ds.clone(), Transform::train(16));
    let loader = HostLoader::new(images, indices.clone(), &dropping).unwrap();
    assert_eq!(loader.len(), 2);
    let got: Vec<Vec<usize>> = loader.map(|b| b.unwrap().indices().to_vec()).collect();
    assert_eq!(got, vec![vec![5, 3], vec![9, 1]]);
}

/// The same epoch gives bit-identical tensors with 1 worker and with 4 workers (and any
/// prefetch depth), because each sample's draws depend only on (seed, epoch, index).
#[test]
fn one_worker_and_four_workers_give_identical_batches() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 24);
    let indices: Vec<usize> = (0..24).rev().chain([3, 3, 7]).collect();
    let transform = Transform::train(32).with_hflip(true);
    let base = LoaderConfig {
        seed: 1234,
        epoch: 5,
        ..LoaderConfig::new(4)
    };
    let one = collect(
        &ds,
        indices.clone(),
        transform,
        &LoaderConfig {
            workers: 1,
            prefetch: 1,
            ..base.clone()
        },
    );
    let four = collect(
        &ds,
        indices.clone(),
        transform,
        &LoaderConfig {
            workers: 4,
            prefetch: 3,
            ..base.clone()
        },
    );
    assert_eq!(one.len(), 7);
    assert_eq!(one, four, "pixels differ between 1 and 4 workers");
    // Repeated indices in one epoch get the same draws (the stream is per index).
    let last = &one[6];
    assert_eq!(last.indices(), [3, 3, 7]);
    assert_eq!(last.sample(0), last.sample(1));
    assert_eq!(one[5].indices()[0], 3);
    assert_eq!(
        last.sample(0),
        one[5].sample(0),
        "index 3 appears at positions 20, 24 and 25"
    );

    // Another epoch draws other crops.
    let other = collect(&ds, indices, transform, &LoaderConfig { epoch: 6, ..base });
    assert_ne!(one[0].input(), other[0].input());
}

/// Each sample in a batch is exactly what the pipeline makes from (seed, epoch, index).
#[test]
fn batch_pixels_equal_the_single_sample_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 6);
    let transform = Transform::train(24).with_hflip(true);
    let config = LoaderConfig {
        seed: 9,
        epoch: 2,
        workers: 2,
        ..LoaderConfig::new(3)
    };
    let batches = collect(&ds, vec![4, 0, 2, 5, 1, 3], transform, &config);
    let mut pipeline = Pipeline::new();
    let mut out = vec![0f32; transform.sample_len()];
    for b in &batches {
        for (k, &i) in b.indices().iter().enumerate() {
            let mut rng = SampleRng::new(9, 2, i as u64);
            pipeline
                .run(&transform, &ds.sample(i).unwrap().path, &mut rng, &mut out)
                .unwrap();
            assert_eq!(b.sample(k), InputRef::F32(&out[..]));
            assert!(out.iter().all(|v| (0.0..=1.0).contains(v)));
        }
    }
}

#[test]
fn eval_transform_is_the_same_every_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 4);
    let t = Transform::eval(40, 32).unwrap();
    let a = collect(
        &ds,
        vec![0, 1, 2, 3],
        t,
        &LoaderConfig {
            epoch: 0,
            ..LoaderConfig::new(4)
        },
    );
    let b = collect(
        &ds,
        vec![0, 1, 2, 3],
        t,
        &LoaderConfig {
            epoch: 9,
            ..LoaderConfig::new(4)
        },
    );
    assert_eq!(a, b);
}

#[test]
fn a_corrupt_image_surfaces_as_an_error_naming_the_file_and_ends_the_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 8);
    let victim = ds.sample(5).unwrap().path.clone();
    let bytes = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &bytes[..bytes.len() / 2]).unwrap();
    let config = LoaderConfig {
        workers: 2,
        ..LoaderConfig::new(2)
    };
    let images = OdirImages::new(ds.clone(), Transform::train(16));
    let mut loader = HostLoader::new(images, (0..8).collect(), &config).unwrap();
    assert!(loader.next().unwrap().is_ok());
    assert!(loader.next().unwrap().is_ok());
    let e = loader.next().unwrap().unwrap_err();
    assert!(
        matches!(e, DataError::DecodeImage { ref path, .. } if *path == victim),
        "{e}"
    );
    assert!(e.to_string().contains("2_right.jpg"), "{e}");
    assert!(loader.next().is_none());
}

/// A later batch's error that a worker reports first must wait for the earlier batches:
/// sample 1 is a large image (slow), sample 2 (next batch) fails at once.
#[test]
fn errors_come_in_index_order_even_when_reported_early() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 4);
    std::fs::write(
        &ds.sample(1).unwrap().path,
        common::gradient_jpeg(2048, 2048),
    )
    .unwrap();
    std::fs::write(&ds.sample(2).unwrap().path, b"broken").unwrap();
    let config = LoaderConfig {
        workers: 2,
        prefetch: 2,
        ..LoaderConfig::new(2)
    };
    let images = OdirImages::new(ds.clone(), Transform::train(16));
    let mut loader = HostLoader::new(images, (0..4).collect(), &config).unwrap();
    assert_eq!(loader.next().unwrap().unwrap().indices(), [0, 1]);
    let e = loader.next().unwrap().unwrap_err();
    assert!(e.to_string().contains("1_left.jpg"), "{e}");
    assert!(loader.next().is_none());
}

#[test]
fn skip_corrupt_leaves_out_and_reports_every_bad_image() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 8);
    let bad: Vec<_> = [1, 6]
        .iter()
        .map(|&i| ds.sample(i).unwrap().path.clone())
        .collect();
    std::fs::write(&bad[0], b"not an image at all").unwrap();
    let bytes = std::fs::read(&bad[1]).unwrap();
    std::fs::write(&bad[1], &bytes[..bytes.len() - 100]).unwrap();
    let options = OdirOptions {
        skip_corrupt: true,
        ..OdirOptions::default()
    };
    let ds = OdirDataset::open(dir.path(), &options).unwrap();
    assert_eq!(ds.len(), 6);
    let skipped: Vec<_> = ds.skipped().iter().map(|s| s.path.clone()).collect();
    assert_eq!(skipped, bad);
    assert!(
        ds.skipped()[1].reason.contains("truncated"),
        "{}",
        ds.skipped()[1].reason
    );
    assert!(ds.samples().iter().all(|s| !bad.contains(&s.path)));
    // Without the option the same folder opens with all 8 (the error comes when loading).
    assert_eq!(
        OdirDataset::open(dir.path(), &OdirOptions::default())
            .unwrap()
            .len(),
        8
    );
}

/// A file that cannot be read (an I/O error: here a link to `/proc/self/mem`, whose first
/// page is unmapped) is not a corrupt image: `--skip-corrupt` stops naming it instead of
/// leaving it out, which on one rank only would give the ranks different data.
#[test]
fn skip_corrupt_does_not_leave_out_a_file_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 4);
    let unreadable = ds.samples()[2].path.clone();
    std::fs::remove_file(&unreadable).unwrap();
    std::os::unix::fs::symlink("/proc/self/mem", &unreadable).unwrap();
    let options = OdirOptions {
        skip_corrupt: true,
        ..OdirOptions::default()
    };
    let e = OdirDataset::open(dir.path(), &options).unwrap_err();
    assert!(
        matches!(&e, DataError::ReadImage { path, .. } if *path == unreadable),
        "{e}"
    );
}

/// Every image skipped as corrupt: the split says that the data set has nothing usable, and
/// names the first image and why, not that a split came out empty.
#[test]
fn a_data_set_whose_every_image_is_corrupt_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 4);
    for s in ds.samples() {
        std::fs::write(&s.path, b"not an image at all").unwrap();
    }
    let options = OdirOptions {
        skip_corrupt: true,
        ..OdirOptions::default()
    };
    let ds = OdirDataset::open(dir.path(), &options).unwrap();
    let first = ds.skipped()[0].path.display().to_string();
    let e = ddp_data::odir::split_by_patient(&ds, 0.25, 0).unwrap_err();
    assert!(
        matches!(e, DataError::EmptyDataset { skipped: 4, .. }),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains(&format!("(4 skipped as corrupt; the first, {first}: ")),
        "{e}"
    );
}

/// Workers never run more than `prefetch` batches ahead of the consumer, and dropping the
/// loader mid-epoch returns (joins every worker) instead of finishing the epoch.
#[test]
fn prefetch_is_bounded_and_drop_stops_the_workers() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 8);
    let indices: Vec<usize> = (0..2000).map(|i| i % 8).collect();
    let config = LoaderConfig {
        workers: 2,
        prefetch: 2,
        ..LoaderConfig::new(4)
    };
    let images = OdirImages::new(ds, Transform::train(16));
    let mut loader = HostLoader::new(images, indices, &config).unwrap();
    assert_eq!(loader.len(), 500);
    loader.next().unwrap().unwrap();
    // Give unbounded workers time to run ahead, then check they did not.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let finished = loader.samples_finished();
    assert!(
        finished <= (1 + 2) * 4,
        "{finished} samples decoded, window allows 12"
    );
    assert!(finished >= 4);
    drop(loader);
}

#[test]
fn invalid_loader_arguments_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 2);
    let images = OdirImages::new(ds.clone(), Transform::train(8));
    let e = HostLoader::new(images.clone(), vec![0, 2], &LoaderConfig::new(1)).unwrap_err();
    assert!(
        matches!(e, DataError::IndexOutOfRange { index: 2, len: 2 }),
        "{e}"
    );
    let e = HostLoader::new(images.clone(), vec![0], &LoaderConfig::new(0)).unwrap_err();
    assert!(
        matches!(
            e,
            DataError::InvalidParameter {
                name: "batch size",
                ..
            }
        ),
        "{e}"
    );
    let empty = HostLoader::new(images, vec![], &LoaderConfig::new(4)).unwrap();
    assert!(empty.is_empty());
    assert_eq!(empty.count(), 0);
}

/// Bytes through the transform's affine map give exactly the values the workers write as
/// `f32`, with and without normalisation: the GPU path's conversion loses nothing.
#[test]
fn byte_batches_convert_to_exactly_the_f32_batches() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 9);
    let indices: Vec<usize> = vec![8, 2, 5, 0, 7, 1, 3];
    let config = LoaderConfig {
        seed: 5,
        epoch: 1,
        workers: 3,
        ..LoaderConfig::new(3)
    };
    let plain = Transform::train(24).with_hflip(true);
    let normalised = plain
        .with_normalization(
            ddp_data::odir::transform::IMAGENET_MEAN,
            ddp_data::odir::transform::IMAGENET_STD,
        )
        .unwrap();
    for transform in [plain, normalised] {
        let load = |storage| -> Vec<HostBatch> {
            HostLoader::with_storage(
                OdirImages::new(ds.clone(), transform),
                indices.clone(),
                &config,
                storage,
                std::sync::Arc::new(ddp_data::memory::HeapAllocator),
            )
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
        };
        let (bytes, floats) = (load(Storage::U8), load(Storage::F32));
        assert_eq!(bytes.len(), 3);
        for (b, f) in bytes.iter().zip(&floats) {
            assert_eq!(b.indices(), f.indices());
            assert_eq!(b.targets(), f.targets());
            assert_eq!(b.input_u8().unwrap().len(), f.input_f32().unwrap().len());
            let converted = b.input_values();
            let exact = f.input_f32().unwrap();
            assert!(
                converted
                    .iter()
                    .zip(exact)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "byte path differs from the f32 path"
            );
        }
    }
}

/// A consumer that drops each batch before asking for the one after next keeps the ring at
/// `prefetch + 2` slots for a whole epoch; one that keeps every batch makes it grow instead
/// of stalling.
#[test]
fn the_ring_reuses_its_slots_and_grows_only_for_kept_batches() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 8);
    let indices: Vec<usize> = (0..96).map(|i| i % 8).collect();
    let config = LoaderConfig {
        workers: 2,
        prefetch: 2,
        ..LoaderConfig::new(4)
    };
    let images = OdirImages::new(ds, Transform::train(16));
    let mut loader = HostLoader::new(images.clone(), indices.clone(), &config).unwrap();
    let mut previous = None;
    let mut batches = 0;
    for batch in loader.by_ref() {
        // Hold one batch while the next is taken, as a pipelined consumer does.
        previous = Some(batch.unwrap());
        batches += 1;
    }
    drop(previous);
    assert_eq!(batches, 24);
    let slots = loader.slots_allocated();
    assert!(
        (2..=4).contains(&slots),
        "{slots} slots for 24 batches with prefetch 2"
    );

    let kept: Vec<HostBatch> = HostLoader::new(images, indices, &config)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(kept.len(), 24);
    let distinct: std::collections::HashSet<usize> = kept.iter().map(|b| b.slot()).collect();
    assert_eq!(distinct.len(), 24, "every kept batch has its own slot");
}

/// A slot given back with a hook is not written again before the hook has run.
#[test]
fn a_reuse_hook_runs_before_the_slot_is_refilled() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 4);
    let config = LoaderConfig {
        workers: 1,
        prefetch: 1,
        ..LoaderConfig::new(2)
    };
    let images = OdirImages::new(ds, Transform::train(8));
    let mut loader = HostLoader::new(images, (0..4).chain(0..4).collect(), &config).unwrap();
    let ran = std::sync::Arc::new(AtomicUsize::new(0));
    let first = loader.next().unwrap().unwrap();
    let slot = first.slot();
    let counter = ran.clone();
    first.release_after(Box::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }));
    // Each batch is held until the next one is taken, as a pipelined consumer does: when
    // batch 1 is handed out, batch 2 is claimed while the only free slot is the released
    // one, so that slot must be refilled.
    let mut reused = false;
    let mut previous = None;
    for batch in loader {
        let batch = batch.unwrap();
        if batch.slot() == slot {
            reused = true;
            assert_eq!(
                ran.load(Ordering::SeqCst),
                1,
                "slot refilled before its hook ran"
            );
        }
        previous = Some(batch);
    }
    drop(previous);
    assert!(reused, "the released slot was never reused");
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

/// A hook that fails (a copy that cannot be waited for) ends the epoch with its error.
#[test]
fn a_failing_reuse_hook_ends_the_epoch_with_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let ds = synthetic(dir.path(), 4);
    let config = LoaderConfig {
        workers: 1,
        prefetch: 1,
        ..LoaderConfig::new(2)
    };
    let images = OdirImages::new(ds, Transform::train(8));
    let mut loader = HostLoader::new(images, (0..4).chain(0..4).collect(), &config).unwrap();
    let first = loader.next().unwrap().unwrap();
    first.release_after(Box::new(|| {
        Err(DataError::Cuda {
            call: "cudaEventSynchronize",
            message: "an illegal memory access was encountered".to_string(),
        })
    }));
    let rest: Vec<_> = loader.collect();
    let e = rest
        .iter()
        .find_map(|r| r.as_ref().err())
        .expect("the hook's error surfaces");
    assert!(
        matches!(
            e,
            DataError::Cuda {
                call: "cudaEventSynchronize",
                ..
            }
        ),
        "{e}"
    );
    assert!(rest.last().unwrap().is_err(), "the error ends the epoch");
}
