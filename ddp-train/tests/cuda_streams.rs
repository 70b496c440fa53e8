//! DDP on CUDA with forward and backward on a pool stream made current (not the default
//! stream), buckets reduced while backward runs: the gradients equal those of the same step
//! on the default stream. Needs two GPUs (one rank each: a world of one communicates
//! nothing); elsewhere it prints `skipped: <reason>`. `cargo xtask gpu-check` runs it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::wait_all;
use ddp_comm::{Backend, Options, ProcessGroup};
use ddp_model::{ConvNet, ConvNetConfig};
use ddp_train::{DdpOptions, DistributedDataParallel};
use tch::{nn, Device, Kind, Reduction, Tensor};

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
        n if n >= 2 => Ok(n.min(4)),
        n => Err(format!("needs 2 CUDA devices, {n} visible")),
    }
}

/// The gradients of one step, on the current stream, as CPU tensors in name order.
fn step_gradients(
    ddp: &mut DistributedDataParallel,
    net: &ConvNet,
    params: &[(String, Tensor)],
    x: &Tensor,
    y: &Tensor,
) -> Vec<Tensor> {
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
    let on_default = step_gradients(&mut ddp, &net, &params, &x, &y);
    let stream = tch_ext::CudaStream::from_pool(local, false).unwrap();
    let on_pool = {
        let _guard = tch_ext::set_current_stream(stream).unwrap();
        step_gradients(&mut ddp, &net, &params, &x, &y)
    };
    for ((name, _), (a, b)) in params.iter().zip(on_default.iter().zip(&on_pool)) {
        let diff = (a - b).abs().max().double_value(&[]);
        let scale = a.abs().max().double_value(&[]).max(1e-3);
        assert!(
            diff <= 1e-5 * scale,
            "{name}: {diff} apart (largest {scale})"
        );
    }
    println!(
        "rank {rank}: {} gradients equal on both streams",
        params.len()
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
