//! DDP on CUDA with forward and backward on a pool stream made current (not the default
//! stream), buckets reduced while backward runs behind a second of queued work: the
//! gradients equal those of the same step on the default stream, and `sync_gradients`
//! returns while that second of work still runs (the stream waits for the buckets, not the
//! host). One rank per GPU, up to four; one GPU (a world of one) runs the same path (hooks
//! on the autograd engine's device thread, buckets, NCCL, stream waits) but reduces
//! nothing, so only the host-side wait and errors show there, and a misordered bucket shows
//! with two. Also: SyncBatchNorm's all-reduces leave the host free. Without a GPU each test
//! prints `skipped: <reason>`. `cargo xtask gpu-check` runs them.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::wait_all;
use ddp_comm::{Backend, Options, ProcessGroup};
use ddp_model::norm::StatsReducer;
use ddp_model::{ConvNet, ConvNetConfig};
use ddp_train::functional::GroupReducer;
use ddp_train::{DdpOptions, DistributedDataParallel};
use tch::{nn, Device, Kind, Reduction, Tensor};
use tch_ext::{CudaEvent, CudaStream};

/// The GPUs to use (one rank each), or why the test is skipped.
fn gpus() -> Result<usize, String> {
    if let Some(reason) = ddp_comm::cuda::no_gpu_reason() {
        return Err(reason);
    }
    match ddp_comm::cuda::load_torch_cuda() {
        Ok(true) => {}
        Ok(false) => return Err("libtorch has no libtorch_cuda.so (CPU-only build)".into()),
        Err(e) => return Err(e.to_string()),
    }
    match tch::Cuda::device_count() as usize {
        0 => Err("libtorch sees no CUDA device".into()),
        n => Ok(n.min(4)),
    }
}

/// Queues about `seconds` of 4096x4096 matmuls on the current stream of `device` (measured
/// first) and returns at once: the host is then far ahead of the device.
fn keep_busy(device: Device, seconds: f64) {
    let Device::Cuda(index) = device else {
        unreachable!("a CUDA device")
    };
    let x = Tensor::randn([4096, 4096], (Kind::Float, device)) / 64.0;
    for _ in 0..2 {
        let _ = x.mm(&x);
    }
    let stream = CudaStream::current(index).unwrap();
    stream.synchronize().unwrap();
    let start = std::time::Instant::now();
    for _ in 0..8 {
        let _ = x.mm(&x);
    }
    stream.synchronize().unwrap();
    let each = start.elapsed().as_secs_f64() / 8.0;
    for _ in 0..(seconds / each).ceil() as usize {
        let _ = x.mm(&x);
    }
}

/// One step on the current stream, up to the synced gradients (nothing here waits for the
/// device).
fn step(
    ddp: &mut DistributedDataParallel,
    net: &ConvNet,
    params: &[(String, Tensor)],
    x: &Tensor,
    y: &Tensor,
) {
    for (_, p) in params {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    net.forward_t(x, true)
        .binary_cross_entropy_with_logits::<Tensor>(y, None, None, Reduction::Mean)
        .backward();
    ddp.sync_gradients().unwrap();
}

/// The gradients, as CPU tensors in name order (waits for the device).
fn gradients(params: &[(String, Tensor)]) -> Vec<Tensor> {
    params
        .iter()
        .map(|(_, p)| p.grad().to_device(Device::Cpu))
        .collect()
}

#[test]
#[ignore = "a rank of the CUDA stream test; run by it"]
fn worker_pool_stream() {
    assert!(ddp_comm::cuda::load_torch_cuda().unwrap());
    let opts = Options::from_env().unwrap().backend(Backend::Nccl);
    let pg = Arc::new(ProcessGroup::new(opts).unwrap());
    let (rank, local) = (pg.rank(), pg.local_rank());
    let device = Device::Cuda(local);
    tch::manual_seed(3);
    let vs = nn::VarStore::new(device);
    let net = ConvNet::new(
        &vs.root(),
        ConvNetConfig {
            num_classes: 8,
            dropout: 0.0,
        },
    );
    // Small buckets: several all-reduces overlap with backward.
    let options = DdpOptions {
        bucket_cap_bytes: 64 << 10,
        first_bucket_cap_bytes: 16 << 10,
        broadcast_buffers: false,
        ..DdpOptions::default()
    };
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), options).unwrap();
    let mut params: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    tch::manual_seed(100 + rank as i64);
    let x = Tensor::rand([16, 3, 64, 64], (Kind::Float, device));
    let y = Tensor::rand([16, 8], (Kind::Float, device)).round();
    step(&mut ddp, &net, &params, &x, &y);
    let on_default = gradients(&params);
    let stream = CudaStream::from_pool(local, false).unwrap();
    let (on_pool, host_free) = {
        let _guard = tch_ext::set_current_stream(stream).unwrap();
        // The step's kernels wait behind a second of work while the host queues them and
        // backward's hooks launch the buckets: a bucket reduced before its gradients landed
        // would hold stale values.
        keep_busy(device, 1.0);
        let busy = CudaEvent::new(local).unwrap();
        busy.record(&stream).unwrap();
        step(&mut ddp, &net, &params, &x, &y);
        // Each bucket's collective comes after that work on the stream, so a host-side wait
        // for any bucket (rather than the stream's `cudaStreamWaitEvent`) would have let it
        // finish. This shows with one rank too, where NCCL may do no device work at all.
        let host_free = !busy.query().unwrap();
        (gradients(&params), host_free)
    };
    assert!(
        host_free,
        "sync_gradients waited on the host for the buckets: the second of work queued \
         before the step had finished when it returned"
    );
    for ((name, _), (a, b)) in params.iter().zip(on_default.iter().zip(&on_pool)) {
        let diff = (a - b).abs().max().double_value(&[]);
        let scale = a.abs().max().double_value(&[]).max(1e-3);
        assert!(
            diff <= 1e-5 * scale,
            "{name}: {diff} apart (largest {scale})"
        );
    }
    println!(
        "rank {rank}: {} gradients equal on both streams ({} bucket(s), world {})",
        params.len(),
        ddp.bucket_sizes().len(),
        pg.world_size()
    );
}

#[test]
fn gradients_on_a_pool_stream_equal_those_on_the_default_stream() {
    let world = match gpus() {
        Ok(n) => n,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    let children = common::spawn_worker_ranks("worker_pool_stream", world, |_, cmd| {
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
    });
    let outputs = wait_all(children, Duration::from_secs(180));
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank} failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// SyncBatchNorm's statistics (`GroupReducer`, through NCCL, here a world of one) are summed
/// without the host waiting for the work queued before them: the all-reduce returns while a
/// second of matmuls still runs ahead of it, and its forward and backward values are right.
#[test]
fn sync_batchnorm_statistics_leave_the_host_free() {
    if let Err(reason) = gpus() {
        println!("skipped: {reason}");
        return;
    }
    let device = Device::Cuda(0);
    let opts = Options::new(0, 1, "127.0.0.1", 0).backend(Backend::Nccl);
    let reducer = GroupReducer::new(Arc::new(ProcessGroup::new(opts).unwrap()));
    // The communicator is created at the first CUDA collective, outside the measurement.
    let _ = reducer.all_reduce_sum(&Tensor::ones([1], (Kind::Float, device)));
    let row = Tensor::arange(18, (Kind::Float, device))
        .view([2, 9])
        .set_requires_grad(true);
    let current = CudaStream::current(0).unwrap();
    current.synchronize().unwrap();
    keep_busy(device, 1.0);
    let busy = CudaEvent::new(0).unwrap();
    busy.record(&current).unwrap();
    let summed = reducer.all_reduce_sum(&row);
    assert!(
        !busy.query().unwrap(),
        "the statistics' all-reduce waited on the host for the work queued before it"
    );
    let expected: Vec<f32> = (0..18).map(|v| v as f32).collect();
    let values = Vec::<f32>::try_from(summed.to_device(Device::Cpu).view([-1])).unwrap();
    assert_eq!(values, expected);
    (&summed * 3.0).sum(Kind::Float).backward();
    let grad = Vec::<f32>::try_from(row.grad().to_device(Device::Cpu).view([-1])).unwrap();
    assert_eq!(grad, vec![3.0f32; 18]);
    assert!(reducer.take_error().is_none());
}
