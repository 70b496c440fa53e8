//! All-reduce latency and bus bandwidth, and the time to broadcast the ConvNet's parameters,
//! for ranks on this machine, side by side with PyTorch's Gloo doing the same
//! (`benches/reference_gloo.py`, run with the setup's Python).
//!
//! ```text
//! cargo bench -p ddp-comm --bench collectives                      # 2 ranks, TCP vs Gloo
//! cargo bench -p ddp-comm --bench collectives -- --ranks 4 --no-gloo
//! cargo bench -p ddp-comm --bench collectives -- --backend nccl    # one rank per GPU
//! cargo bench -p ddp-comm --bench collectives -- --quick           # a tenth of the calls
//! ```
//!
//! `busbw = algbw * 2(n-1)/n` with `algbw = bytes / median time` (nccl-tests' definition).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ddp_comm::{Backend, ProcessGroup, ReduceOp};
use tch::{Device, Kind, Tensor};

const WORKER_ENV: &str = "DDP_BENCH_WORKER";
/// (label, bytes, calls) of the all-reduce sweep.
const SIZES: [(&str, usize, usize); 5] = [
    ("4 KiB", 4 << 10, 1000),
    ("256 KiB", 256 << 10, 400),
    ("4 MiB", 4 << 20, 200),
    ("25 MiB", 25 << 20, 60),
    ("64 MiB", 64 << 20, 30),
];
/// The ConvNet's 14 trainable tensors (ddp-model): 4 conv weights, 4 BatchNorm weight and
/// bias pairs, the classifier's weight and bias: 390,952 f32 = 1.56 MB.
const CONVNET: [&[i64]; 14] = [
    &[32, 3, 3, 3],
    &[32],
    &[32],
    &[64, 32, 3, 3],
    &[64],
    &[64],
    &[128, 64, 3, 3],
    &[128],
    &[128],
    &[256, 128, 3, 3],
    &[256],
    &[256],
    &[8, 256],
    &[8],
];
const BROADCAST_CALLS: usize = 200;

struct Args {
    ranks: usize,
    backend: Backend,
    gloo: bool,
    scale: f64,
}

fn parse_args() -> Args {
    let mut args = Args {
        ranks: 2,
        backend: Backend::Tcp,
        gloo: true,
        scale: 1.0,
    };
    let mut ranks_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--ranks" => {
                args.ranks = it.next().and_then(|v| v.parse().ok()).expect("--ranks N");
                ranks_given = true;
            }
            "--backend" => {
                args.backend = match it.next().as_deref() {
                    Some("nccl") => Backend::Nccl,
                    Some("tcp") => Backend::Tcp,
                    other => panic!("--backend tcp|nccl, got {other:?}"),
                }
            }
            "--no-gloo" => args.gloo = false,
            "--quick" => args.scale = 0.1,
            _ => {} // cargo bench passes --bench
        }
    }
    if args.backend == Backend::Nccl {
        args.gloo = false;
        if !ranks_given {
            // One rank per GPU: NCCL refuses two ranks on one device.
            args.ranks = ddp_comm::cuda::device_count().max(1);
        }
    }
    args
}

fn median(times: &mut [f64]) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn time_calls(calls: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..calls.div_ceil(20).max(2) {
        f();
    }
    let mut times: Vec<f64> = (0..calls)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    median(&mut times)
}

/// One rank: runs the sweep and, on rank 0, prints `RESULT` lines.
fn worker(args: &Args) {
    let mut opts = ddp_comm::Options::from_env()
        .expect("environment")
        .backend(args.backend);
    opts.op_timeout = Duration::from_secs(120);
    // Tuning knobs for experiments: kernel socket buffer and pipeline segment, in bytes.
    let knob = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    };
    if let Some(bytes) = knob("DDP_BENCH_SOCKET_BUFFER") {
        opts.socket_buffer = bytes;
    }
    if args.backend == Backend::Nccl {
        assert!(
            ddp_comm::cuda::load_torch_cuda().expect("libtorch_cuda"),
            "CPU-only libtorch"
        );
    }
    let group = ProcessGroup::new(opts).expect("rendezvous");
    if let Some(bytes) = knob("DDP_BENCH_SEGMENT") {
        group.set_tcp_segment(bytes);
    }
    if let Some(bytes) = knob("DDP_BENCH_SMALL") {
        group.set_tcp_small_threshold(bytes);
    }
    let device = match args.backend {
        Backend::Nccl => Device::Cuda(group.local_rank()),
        Backend::Tcp => Device::Cpu,
    };
    let sync = || {
        if device != Device::Cpu {
            tch::Cuda::synchronize(group.local_rank() as i64);
        }
    };
    let n = group.world_size() as f64;
    let calls = |c: usize| ((c as f64 * args.scale) as usize).max(5);
    for (label, bytes, count) in SIZES {
        let mut t = Tensor::zeros([(bytes / 4) as i64], (Kind::Float, device));
        group.barrier().unwrap();
        let secs = time_calls(calls(count), || {
            group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
            sync();
        });
        let busbw = bytes as f64 / secs * 2.0 * (n - 1.0) / n / 1e9;
        if group.rank() == 0 {
            println!("RESULT all_reduce {label}|{secs}|{busbw}");
        }
    }
    let mut params: Vec<Tensor> = CONVNET
        .iter()
        .map(|s| Tensor::zeros(*s, (Kind::Float, device)))
        .collect();
    let total: i64 = params.iter().map(|p| p.numel() as i64).sum();
    group.barrier().unwrap();
    let secs = time_calls(calls(BROADCAST_CALLS), || {
        for p in params.iter_mut() {
            group.broadcast(p, 0).unwrap();
        }
        sync();
    });
    if group.rank() == 0 {
        println!("RESULT broadcast 14 tensors|{secs}|{}", total * 4);
    }
    let mut flat = Tensor::zeros([total], (Kind::Float, device));
    group.barrier().unwrap();
    let secs = time_calls(calls(BROADCAST_CALLS), || {
        group.broadcast(&mut flat, 0).unwrap();
        sync();
    });
    if group.rank() == 0 {
        println!("RESULT broadcast flat|{secs}|{}", total * 4);
    }
}

fn results(stdout: &[u8]) -> Vec<(String, f64, f64)> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("RESULT "))
        .filter_map(|l| {
            let mut parts = l.split('|');
            Some((
                parts.next()?.to_string(),
                parts.next()?.parse().ok()?,
                parts.next()?.parse().ok()?,
            ))
        })
        .collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn run_ours(args: &Args) -> Vec<(String, f64, f64)> {
    let port = free_port();
    let children: Vec<_> = (0..args.ranks)
        .map(|r| {
            Command::new(std::env::current_exe().unwrap())
                .args(std::env::args().skip(1))
                .env(WORKER_ENV, "1")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", args.ranks.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", args.ranks.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("DDP_RUN_ID", format!("bench-{port}"))
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn rank")
        })
        .collect();
    let mut outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("rank"))
        .collect();
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r} failed");
    }
    results(&outs.remove(0).stdout)
}

fn run_gloo(args: &Args) -> Result<Vec<(String, f64, f64)>, String> {
    let deps = std::env::var_os("DDP_DEPS_DIR")
        .map(PathBuf::from)
        .ok_or("DDP_DEPS_DIR is not set")?;
    let python = deps.join("venv/bin/python");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/reference_gloo.py");
    let out = Command::new(&python)
        .arg(&script)
        .args([
            "--ranks",
            &args.ranks.to_string(),
            "--scale",
            &args.scale.to_string(),
        ])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{}: {e}", python.display()))?;
    if !out.status.success() {
        return Err(format!("{} failed", script.display()));
    }
    Ok(results(&out.stdout))
}

fn fmt_time(secs: f64) -> String {
    if secs < 1e-3 {
        format!("{:.1} us", secs * 1e6)
    } else {
        format!("{:.2} ms", secs * 1e3)
    }
}

fn main() {
    let args = parse_args();
    if std::env::var_os(WORKER_ENV).is_some() {
        worker(&args);
        return;
    }
    let ours = run_ours(&args);
    let gloo = if args.gloo {
        run_gloo(&args).unwrap_or_else(|e| {
            println!("gloo reference skipped: {e}");
            Vec::new()
        })
    } else {
        Vec::new()
    };
    let name = format!("ddp-comm {}", args.backend);
    println!(
        "\n{} ranks on this machine; median of each call",
        args.ranks
    );
    println!(
        "{:<22} {:>12} {:>14} {:>12} {:>14} {:>8}",
        "operation", name, "busbw GB/s", "gloo", "busbw GB/s", "ratio"
    );
    for (label, secs, value) in &ours {
        let g = gloo.iter().find(|(l, _, _)| l == label);
        let is_reduce = label.starts_with("all_reduce");
        let bw = |v: f64| {
            if is_reduce {
                format!("{v:.3}")
            } else {
                "-".into()
            }
        };
        let (gt, gb, ratio) = match g {
            Some((_, gs, gv)) => {
                let ratio = if is_reduce && *gv > 0.0 && *label != "all_reduce 4 KiB" {
                    value / gv
                } else {
                    gs / secs
                };
                (fmt_time(*gs), bw(*gv), format!("{ratio:.2}x"))
            }
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "{label:<22} {:>12} {:>14} {gt:>12} {gb:>14} {ratio:>8}",
            fmt_time(*secs),
            bw(*value)
        );
    }
    println!("ratio: bus bandwidth ours/gloo for all-reduce >= 256 KiB, else time gloo/ours (higher is better)");
}
