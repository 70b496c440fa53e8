//! The tch edge: batches become `[B, 3, H, W]` and `[B, 8]` f32 tensors with exactly the
//! host values, as views of the ring (CPU) or through the byte path that CUDA uses.
#![cfg(all(feature = "tch", feature = "odir"))]

use std::sync::Arc;

use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_data::odir::transform::Transform;
use ddp_data::odir::{OdirDataset, OdirImages, OdirOptions};
use ddp_data::{HostLoader, Loader, LoaderConfig, Storage};
use tch::{Device, Kind};

fn dataset(dir: &std::path::Path) -> Arc<OdirDataset> {
    generate(
        dir,
        &SyntheticConfig {
            images: 7,
            size: 48,
            seed: 1,
            quality: 90,
            ..Default::default()
        },
    )
    .unwrap();
    Arc::new(OdirDataset::open(dir, &OdirOptions::default()).unwrap())
}

#[test]
fn loader_yields_tensors_equal_to_the_host_batches() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let config = LoaderConfig {
        workers: 2,
        seed: 4,
        ..LoaderConfig::new(3)
    };
    let indices = vec![6, 0, 5, 1, 4, 2, 3];
    let t = Transform::train(20).with_hflip(true);
    let host: Vec<_> = HostLoader::new(OdirImages::new(ds.clone(), t), indices.clone(), &config)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let tensors: Vec<_> = Loader::new(OdirImages::new(ds, t), indices, &config)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(tensors.len(), 3);
    for (h, b) in host.iter().zip(&tensors) {
        let n = h.len() as i64;
        assert_eq!(b.inputs().size(), [n, 3, 20, 20]);
        assert_eq!(b.targets().size(), [n, 8]);
        assert_eq!(b.inputs().kind(), Kind::Float);
        assert_eq!(b.inputs().device(), Device::Cpu);
        assert_eq!(b.indices(), h.indices());
        let images: Vec<f32> = Vec::try_from(b.inputs().flatten(0, -1)).unwrap();
        let labels: Vec<f32> = Vec::try_from(b.targets().flatten(0, -1)).unwrap();
        assert_eq!(images, h.input_f32().unwrap());
        assert_eq!(labels, h.targets_f32().unwrap());
    }
    assert_eq!(tensors[2].inputs().size()[0], 1);
}

/// A CPU batch is a view of its ring slot: no copy on the training thread. The slot is
/// refilled with a later batch once the batch is dropped.
#[test]
fn cpu_batches_are_views_of_the_ring() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let config = LoaderConfig {
        workers: 1,
        prefetch: 1,
        ..LoaderConfig::new(2)
    };
    let indices: Vec<usize> = (0..7).chain(0..7).collect();
    let mut loader =
        Loader::new(OdirImages::new(ds, Transform::train(16)), indices, &config).unwrap();
    let mut addresses = std::collections::HashSet::new();
    let mut batches = 0;
    for batch in &mut loader {
        let batch = batch.unwrap();
        addresses.insert(batch.inputs().data_ptr() as usize);
        batches += 1;
    }
    assert_eq!(batches, 7);
    assert_eq!(
        addresses.len(),
        loader.host().slots_allocated(),
        "every batch's tensor is one of the ring's slots"
    );
    assert!(addresses.len() <= 3, "{} distinct buffers", addresses.len());
}

/// The byte path (what a CUDA loader sends) converted by libtorch gives the f32 path's values
/// bit for bit, normalised or not: training on the GPU sees the same numbers as on the CPU.
#[test]
fn byte_batches_converted_by_libtorch_equal_the_f32_batches() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let config = LoaderConfig {
        workers: 2,
        seed: 11,
        epoch: 3,
        ..LoaderConfig::new(3)
    };
    let indices = vec![3, 1, 4, 0, 5, 2, 6];
    let plain = Transform::train(20).with_hflip(true);
    let normalised = plain
        .with_normalization(
            ddp_data::odir::transform::IMAGENET_MEAN,
            ddp_data::odir::transform::IMAGENET_STD,
        )
        .unwrap();
    for t in [plain, normalised] {
        let load = |storage| {
            Loader::with_storage(
                OdirImages::new(ds.clone(), t),
                indices.clone(),
                &config,
                Device::Cpu,
                storage,
            )
            .unwrap()
            .map(|b| {
                let b = b.unwrap();
                let x: Vec<f32> = Vec::try_from(b.inputs().flatten(0, -1)).unwrap();
                let y: Vec<f32> = Vec::try_from(b.targets().flatten(0, -1)).unwrap();
                (b.indices().to_vec(), x, y)
            })
            .collect::<Vec<_>>()
        };
        let (bytes, floats) = (load(Storage::U8), load(Storage::F32));
        assert_eq!(bytes.len(), 3);
        for ((bi, bx, by), (fi, fx, fy)) in bytes.iter().zip(&floats) {
            assert_eq!(bi, fi);
            assert_eq!(by, fy);
            assert_eq!(bx.len(), fx.len());
            let same = bx.iter().zip(fx).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "libtorch's conversion differs from the workers' values"
            );
        }
    }
}

/// On a machine with a GPU: batches arrive on `cuda:0` with the CPU path's values; without
/// one the test says why it skipped.
#[test]
fn cuda_batches_equal_the_cpu_batches() {
    if !ddp_data_cuda_available() {
        println!("skipped: no CUDA device ({})", no_gpu_reason());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let config = LoaderConfig {
        workers: 2,
        seed: 2,
        ..LoaderConfig::new(3)
    };
    let indices: Vec<usize> = (0..7).rev().chain(0..7).collect();
    let t = Transform::train(20).with_hflip(true);
    let cpu: Vec<_> = Loader::new(OdirImages::new(ds.clone(), t), indices.clone(), &config)
        .unwrap()
        .map(|b| {
            let b = b.unwrap();
            (b.inputs().copy(), b.targets().copy(), b.indices().to_vec())
        })
        .collect();
    let mut gpu =
        Loader::on_device(OdirImages::new(ds, t), indices, &config, Device::Cuda(0)).unwrap();
    let mut n = 0;
    // Keep two batches in flight, as the trainer does, while later slots are refilled.
    let mut pending = gpu.next();
    while let Some(batch) = pending {
        pending = gpu.next();
        let batch = batch.unwrap();
        let (x, y, i) = &cpu[n];
        assert_eq!(batch.inputs().device(), Device::Cuda(0));
        assert_eq!(batch.indices(), &i[..]);
        let gx = batch.inputs().to_device(Device::Cpu);
        let gy = batch.targets().to_device(Device::Cpu);
        assert!(gx.equal(x), "batch {n}: inputs differ from the CPU path");
        assert!(gy.equal(y), "batch {n}: targets differ from the CPU path");
        n += 1;
    }
    assert_eq!(n, cpu.len());
}

fn ddp_data_cuda_available() -> bool {
    load_torch_cuda() && tch::Cuda::is_available()
}

/// rustc's `--as-needed` drops libtorch_cuda from test binaries that call nothing in it:
/// load it from the libtorch folder the CPU library came from.
fn load_torch_cuda() -> bool {
    let Some(lib) = nccl_sys::search::torch_lib_dirs()
        .into_iter()
        .map(|d| d.join("libtorch_cuda.so"))
        .find(|p| p.exists())
    else {
        return false;
    };
    let path = std::ffi::CString::new(lib.to_string_lossy().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; the handle is never closed.
    !unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null()
}

fn no_gpu_reason() -> String {
    match nccl_sys::Cudart::load() {
        Err(e) => format!("CUDA runtime not loadable: {e}"),
        Ok(rt) => {
            let mut count = 0;
            // SAFETY: `count` is a valid out-pointer.
            let rc = unsafe { (rt.cudaGetDeviceCount)(&mut count) };
            format!("cudaGetDeviceCount returned {} with {count} devices", rc.0)
        }
    }
}
