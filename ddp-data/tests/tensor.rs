//! The tch edge: batches become `[B, 3, H, W]` and `[B, 8]` f32 tensors with exactly the
//! host values, as views of the ring (CPU) or through the byte path that CUDA uses.
#![cfg(all(feature = "tch", feature = "odir"))]

use std::sync::Arc;
use std::time::{Duration, Instant};

use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_data::odir::transform::Transform;
use ddp_data::odir::{OdirDataset, OdirImages, OdirOptions};
use ddp_data::rng::SampleRng;
use ddp_data::{
    Affine, Array, DataError, Dataset, HostLoader, Item, Loader, LoaderConfig, MapDataset, PadTo,
    Padding, SampleLayout, SampleOut, Storage, TensorDataset, ValueKind,
};
use tch::{Device, Kind, Tensor};

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

/// Tensors made from a CPU batch that outlive it (the inputs an autograd graph saved, a
/// kept view) keep their values: the ring gives that slot new memory rather than refill it,
/// so a loss summed over several batches and then differentiated once is right, as with
/// PyTorch's fresh tensors per batch.
#[test]
fn tensors_kept_past_their_cpu_batch_keep_their_values() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let config = LoaderConfig {
        workers: 1,
        prefetch: 1,
        ..LoaderConfig::new(1)
    };
    let loader = Loader::new(
        OdirImages::new(ds, Transform::train(8)),
        (0..7).collect(),
        &config,
    );
    let w = Tensor::ones([3, 8, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let (mut kept, mut copies, mut losses) = (Vec::new(), Vec::new(), Vec::new());
    for batch in loader.unwrap() {
        let batch = batch.unwrap();
        kept.push(batch.inputs().shallow_clone());
        copies.push(batch.inputs().copy());
        losses.push((batch.inputs() * &w).sum(Kind::Float));
    }
    for (k, (t, c)) in kept.iter().zip(&copies).enumerate() {
        assert!(t.equal(c), "batch {k}'s inputs were written over");
    }
    let total = losses
        .iter()
        .fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, l| a + l);
    total.backward();
    let want = Tensor::stack(&copies, 0).sum_dim_intlist([0, 1].as_slice(), false, Kind::Float);
    assert!(w.grad().allclose(&want, 1e-6, 1e-6, false));
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

/// Each CPU batch of `set` over `indices` in slots of `storage`: its input's shape and values.
fn cpu_inputs<D: Dataset + Clone>(
    set: &D,
    indices: &[usize],
    batch_size: usize,
    storage: Storage,
) -> Vec<(Vec<i64>, Vec<f32>)> {
    let config = LoaderConfig {
        workers: 2,
        ..LoaderConfig::new(batch_size)
    };
    Loader::with_storage(set.clone(), indices.to_vec(), &config, Device::Cpu, storage)
        .unwrap()
        .map(|b| {
            let b = b.unwrap();
            let x = b.inputs();
            (x.size(), Vec::try_from(x.flatten(0, -1)).unwrap())
        })
        .collect()
}

/// Scalar byte samples (shape `[]`, with the identity byte form `TensorDataset` gives bytes)
/// become `[B]` batches, the same through byte slots as through `f32` ones.
#[test]
fn scalar_byte_samples_give_the_f32_batches_through_bytes() {
    let set = TensorDataset::new(
        Array::new(vec![0u8, 1, 2], [3]).unwrap(),
        Array::from(vec![0i64, 1, 2]),
    )
    .unwrap();
    assert_eq!(set.layout().shape, Vec::<usize>::new());
    let want = vec![(vec![2], vec![2.0, 0.0]), (vec![1], vec![1.0])];
    assert_eq!(cpu_inputs(&set, &[2, 0, 1], 2, Storage::F32), want);
    assert_eq!(cpu_inputs(&set, &[2, 0, 1], 2, Storage::U8), want);
}

/// Byte sequences padded with -1: the padding positions of a batch from byte slots hold -1,
/// as those of the `f32` batch do, not the padding's byte (-1 as `u8` is 0) converted.
#[test]
fn padded_byte_sequences_hold_the_padding_value() {
    let sequences = vec![vec![1u8, 2, 3], vec![4], vec![5, 6]];
    for (to, want) in [
        (
            PadTo::Longest,
            vec![
                (vec![2, 2], vec![4.0, -1.0, 5.0, 6.0]),
                (vec![1, 3], vec![1.0, 2.0, 3.0]),
            ],
        ),
        (
            PadTo::Fixed,
            vec![
                (
                    vec![2, 4],
                    vec![4.0, -1.0, -1.0, -1.0, 5.0, 6.0, -1.0, -1.0],
                ),
                (vec![1, 4], vec![1.0, 2.0, 3.0, -1.0]),
            ],
        ),
    ] {
        let set = TensorDataset::sequences(
            sequences.clone(),
            Array::from(vec![0i64, 1, 2]),
            Padding { value: -1.0, to },
        )
        .unwrap()
        .max_len(4)
        .unwrap();
        assert_eq!(
            cpu_inputs(&set, &[1, 2, 0], 2, Storage::F32),
            want,
            "{to:?}"
        );
        assert_eq!(cpu_inputs(&set, &[1, 2, 0], 2, Storage::U8), want, "{to:?}");
    }
}

/// A per-position affine map (one scale and bias per position of the longest sequence)
/// converts batches padded to a shorter length: each position gets its own scale, and the
/// padding stays the padding value.
#[test]
fn per_position_affine_converts_sequences_padded_to_the_longest_of_the_batch() {
    let set = TensorDataset::sequences(
        vec![vec![1u8, 2, 3], vec![4], vec![5, 6]],
        Array::from(vec![0i64, 1, 2]),
        Padding {
            value: -1.0,
            to: PadTo::Longest,
        },
    )
    .unwrap()
    .with_affine(Affine {
        scale: vec![0.5, 2.0, 4.0],
        bias: vec![1.0, 0.0, -1.0],
    })
    .unwrap();
    let want = vec![
        (vec![2, 2], vec![3.0, -1.0, 3.5, 12.0]),
        (vec![1, 3], vec![1.5, 4.0, 11.0]),
    ];
    assert_eq!(cpu_inputs(&set, &[1, 2, 0], 2, Storage::F32), want);
    assert_eq!(cpu_inputs(&set, &[1, 2, 0], 2, Storage::U8), want);
}

/// Sample `i` has `i % 2 + 2` positions of two bytes each, `[10 * p + 1, 10 * p + 2]` at
/// position `p`, under a map with one scale and bias per position of the maximum 4.
#[derive(Clone)]
struct PairSequences;

impl MapDataset for PairSequences {
    fn len(&self) -> usize {
        4
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([4, 2], [])
            .target_kind(ValueKind::I64)
            .bytes(Affine {
                scale: vec![1.0, 10.0, 100.0, 1000.0],
                bias: vec![0.5, 0.25, -1.0, 2.0],
            })
            .padded(Padding {
                value: -1.0,
                to: PadTo::Longest,
            })
    }

    fn get(&self, i: usize, _: &mut SampleRng) -> Result<Item, DataError> {
        let bytes: Vec<u8> = (0..i % 2 + 2)
            .flat_map(|p| [10 * p as u8 + 1, 10 * p as u8 + 2])
            .collect();
        Ok(Item::new(bytes, i as i64))
    }
}

/// The same with two values per position: the workers' conversion of owned bytes into `f32`
/// slots gives each position its own scale, as the byte path's conversion by libtorch does,
/// for samples of 2 and 3 of the 4 positions.
#[test]
fn per_position_affine_converts_pairs_padded_to_the_longest_of_the_batch() {
    let want = vec![
        (
            vec![2, 3, 2],
            vec![
                1.5, 2.5, 110.25, 120.25, -1.0, -1.0, // sample 0: length 2
                1.5, 2.5, 110.25, 120.25, 2099.0, 2199.0, // sample 1: length 3
            ],
        ),
        (
            vec![2, 3, 2],
            vec![
                1.5, 2.5, 110.25, 120.25, 2099.0, 2199.0, // sample 3: length 3
                1.5, 2.5, 110.25, 120.25, -1.0, -1.0, // sample 2: length 2
            ],
        ),
    ];
    let set = PairSequences;
    assert_eq!(cpu_inputs(&set, &[0, 1, 3, 2], 2, Storage::U8), want);
    assert_eq!(cpu_inputs(&set, &[0, 1, 3, 2], 2, Storage::F32), want);
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

/// On a machine with a GPU: with a pool stream made current on the consumer thread, the
/// copies are queued on that stream and the slot's event must be recorded there too. Each
/// batch's copy waits behind a busy stream; an event on the (idle) default stream would let a
/// worker rewrite the slot before the copy ran, and the batch would hold another's values.
#[test]
fn cuda_batches_follow_the_current_stream() {
    if !ddp_data_cuda_available() {
        println!("skipped: no CUDA device ({})", no_gpu_reason());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ds = dataset(dir.path());
    let config = LoaderConfig {
        workers: 2,
        seed: 3,
        prefetch: 1,
        ..LoaderConfig::new(3)
    };
    let indices: Vec<usize> = (0..6).flat_map(|_| 0..7).collect();
    let t = Transform::train(20);
    let cpu: Vec<_> = Loader::new(OdirImages::new(ds.clone(), t), indices.clone(), &config)
        .unwrap()
        .map(|b| b.unwrap().inputs().copy())
        .collect();
    let stream = tch_ext::CudaStream::from_pool(0, false).unwrap();
    let guard = tch_ext::set_current_stream(stream).unwrap();
    let busy = Busy::new(Device::Cuda(0), 0.05);
    let mut gpu =
        Loader::on_device(OdirImages::new(ds, t), indices, &config, Device::Cuda(0)).unwrap();
    let mut inputs = Vec::new();
    loop {
        busy.queue();
        let Some(batch) = gpu.next() else { break };
        // The values are read once every batch was taken (and its slot given back).
        inputs.push(batch.unwrap().inputs().shallow_clone());
    }
    // Dropped with copies still queued behind the busy stream: its slots are freed only once
    // those copies are done, so the batches keep their values.
    drop(gpu);
    assert_eq!(inputs.len(), cpu.len());
    for (n, (g, c)) in inputs.iter().zip(&cpu).enumerate() {
        assert!(
            g.to_device(Device::Cpu).equal(c),
            "batch {n}: its slot was rewritten before its copy ran"
        );
    }
    drop(guard);
}

/// Sample `i` is 256 values `i`, written after `per_sample` of sleep (a decode's time).
struct Slow {
    len: usize,
    per_sample: Duration,
}

impl Dataset for Slow {
    type Worker = ();

    fn len(&self) -> usize {
        self.len
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([256], [1])
    }

    fn worker(&self) {}

    fn write(
        &self,
        _: &mut (),
        index: usize,
        _: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        std::thread::sleep(self.per_sample);
        out.input.f32()?.fill(index as f32);
        out.targets.f32()?[0] = index as f32;
        Ok(())
    }
}

/// On a machine with a GPU: while the consumer keeps the GPU busy with a long step, the
/// workers keep decoding the batches after the next, so taking a batch does not wait for
/// them. A ring that handed a worker the slot whose copy was queued behind the running step,
/// and let it wait for that copy under the ring's lock, stalled every worker for the whole
/// step: the data then arrived a batch's decoding time after each step.
#[test]
fn a_busy_gpu_keeps_no_worker_from_decoding() {
    if !ddp_data_cuda_available() {
        println!("skipped: no CUDA device ({})", no_gpu_reason());
        return;
    }
    const BATCH: usize = 8;
    const WORKERS: usize = 2;
    const STEPS: usize = 30;
    let per_sample = Duration::from_millis(5);
    // One batch's decoding on all the workers, and the GPU step (five times longer).
    let decode = per_sample.as_secs_f64() * (BATCH / WORKERS) as f64;
    let busy = Busy::new(Device::Cuda(0), 5.0 * decode);
    let config = LoaderConfig {
        workers: WORKERS,
        prefetch: 2,
        ..LoaderConfig::new(BATCH)
    };
    let slow = Slow {
        len: STEPS * BATCH,
        per_sample,
    };
    let mut loader =
        Loader::on_device(slow, (0..STEPS * BATCH).collect(), &config, Device::Cuda(0)).unwrap();
    let mut waits = Vec::new();
    let mut next = loader.next();
    while let Some(batch) = next {
        let batch = batch.unwrap();
        // The step: reads the batch, then holds the GPU; the next batch is taken before the
        // step's result is read, as the trainer does.
        let sum = batch.inputs().sum(Kind::Double);
        busy.queue();
        let start = Instant::now();
        next = loader.next();
        waits.push(start.elapsed().as_secs_f64());
        let want: f64 = batch.indices().iter().map(|&i| 256.0 * i as f64).sum();
        assert_eq!(sum.double_value(&[]), want, "batch {:?}", batch.indices());
    }
    assert_eq!(waits.len(), STEPS);
    // The first steps fill the ring.
    let mut steady = waits[4..].to_vec();
    steady.sort_by(f64::total_cmp);
    let median = steady[steady.len() / 2];
    println!(
        "data wait per step: median {:.2} ms (a batch takes {:.1} ms to decode on {WORKERS} \
         workers, a step {:.1} ms on the GPU)",
        median * 1e3,
        decode * 1e3,
        5.0 * decode * 1e3
    );
    assert!(
        median < decode / 4.0,
        "the loader waited {:.2} ms per step for data with the GPU busy (a batch decodes in \
         {:.1} ms): its workers stalled behind the step",
        median * 1e3,
        decode * 1e3
    );
}

/// Matmuls that keep a GPU's current stream busy for about a given time per [`Busy::queue`].
struct Busy {
    x: Tensor,
    count: usize,
}

impl Busy {
    fn new(device: Device, seconds: f64) -> Self {
        let Device::Cuda(index) = device else {
            unreachable!("a CUDA device")
        };
        let x = Tensor::randn([4096, 4096], (Kind::Float, device)) / 64.0;
        let time = |n: usize| {
            tch::Cuda::synchronize(index as i64);
            let start = Instant::now();
            for _ in 0..n {
                let _ = x.mm(&x);
            }
            tch::Cuda::synchronize(index as i64);
            start.elapsed().as_secs_f64() / n as f64
        };
        time(2);
        let count = (seconds / time(8)).ceil() as usize;
        Self { x, count }
    }

    /// Queues the matmuls and returns at once.
    fn queue(&self) {
        for _ in 0..self.count {
            let _ = self.x.mm(&self.x);
        }
    }
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

/// A layout whose targets have no values (`[0]`): libtorch gives a tensor without elements
/// no storage (a null data pointer), which the ring's slot must not hand on as the start of
/// a slice. Every batch loads, with `[B, 0]` targets and its inputs.
#[test]
fn samples_without_target_values_load() {
    let inputs = Array::new((0..8).map(|v| v as f32).collect::<Vec<_>>(), [4, 2]).unwrap();
    let targets = Array::new(Vec::<f32>::new(), [4, 0]).unwrap();
    let data = TensorDataset::new(inputs, targets).unwrap();
    assert_eq!(data.layout().target_shape, [0]);
    let config = LoaderConfig {
        workers: 2,
        ..LoaderConfig::new(2)
    };
    let mut seen = Vec::new();
    for batch in Loader::new(data, (0..4).collect(), &config).unwrap() {
        let batch = batch.unwrap();
        assert_eq!(batch.targets().size(), [2, 0]);
        seen.push(Vec::<f32>::try_from(batch.inputs().flatten(0, -1)).unwrap());
    }
    assert_eq!(seen, [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]);
}

/// A CPU batch's tensors cannot be resized in place past their ring slot: libtorch refuses
/// to move the slot's memory, which the loader's workers keep writing through, so the
/// batches after it hold their own values. (Were the slot's storage resizable, the resize
/// would free that memory and the slot's next batch would be written into freed memory,
/// its tensors showing the old batch.)
#[test]
fn a_cpu_batch_cannot_be_resized_past_its_slot() {
    const SAMPLES: usize = 12;
    let inputs = (0..SAMPLES * 4).map(|v| v as f32).collect::<Vec<_>>();
    let targets = (0..SAMPLES).map(|v| v as f32).collect::<Vec<_>>();
    let data = TensorDataset::new(
        Array::new(inputs.clone(), [SAMPLES, 4]).unwrap(),
        Array::new(targets.clone(), [SAMPLES, 1]).unwrap(),
    )
    .unwrap();
    let config = LoaderConfig {
        workers: 1,
        prefetch: 1,
        ..LoaderConfig::new(2)
    };
    let mut loader = Loader::new(data, (0..SAMPLES).collect(), &config).unwrap();
    let first = loader.next().unwrap().unwrap();
    // 4 MiB of f32, far past the slot's 32 bytes of inputs and 8 of targets.
    let resized = [first.inputs(), first.targets()].map(|t| {
        let mut alias = t.shallow_clone();
        alias.f_resize_([1 << 20]).map(drop)
    });
    drop(first);
    let rest: Vec<(Vec<f32>, Vec<f32>)> = loader
        .by_ref()
        .map(|b| {
            let b = b.unwrap();
            let values = |t: &Tensor| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap();
            (values(b.inputs()), values(b.targets()))
        })
        .collect();
    let want: Vec<(Vec<f32>, Vec<f32>)> = (1..SAMPLES / 2)
        .map(|k| {
            (
                inputs[8 * k..8 * k + 8].to_vec(),
                targets[2 * k..2 * k + 2].to_vec(),
            )
        })
        .collect();
    assert_eq!(rest, want, "a batch after the resize holds other values");
    assert!(
        loader.host().slots_allocated() <= 3,
        "slots were not reused"
    );
    for r in resized {
        let e = r.expect_err("a batch's tensor was resized past its slot");
        assert!(
            e.to_string()
                .contains("Trying to resize storage that is not resizable"),
            "{e}"
        );
    }
}
