//! All-reduce latency and bus bandwidth, all-gather bandwidth, and the time to broadcast the
//! ConvNet's parameters, for ranks on this machine: ddp-comm over shared memory and over TCP,
//! side by side with PyTorch's Gloo doing the same (`benches/reference_gloo.py`, run with the
//! setup's Python).
//!
//! ```text
//! cargo bench -p ddp-comm --bench collectives                  # 2 ranks: shm, TCP, Gloo
//! cargo bench -p ddp-comm --bench collectives -- --transport tcp --ranks 4 --no-gloo
//! cargo bench -p ddp-comm --bench collectives -- --backend nccl    # one rank per GPU
//! cargo bench -p ddp-comm --bench collectives -- --quick           # a tenth of the calls
//! cargo bench -p ddp-comm --bench collectives -- --filter "25 MiB"  # rows whose label has it
//! ```
//!
//! All-reduce sums (`ReduceOp::Sum`, what DDP's default hook runs on gradients it scaled
//! while copying them into their bucket), and from 4 MiB up also averages (`ReduceOp::Avg`,
//! rows labelled `Avg`; Gloo has no average, so those rows have no reference).
//! All-reduce: `busbw = algbw * 2(n-1)/n` with `algbw = bytes / median time`; all-gather of
//! `bytes` per rank: `busbw = n * bytes / time * (n-1)/n` (nccl-tests' definitions).
//!
//! Tuning knobs for experiments (environment, bytes or microseconds):
//! `DDP_BENCH_SOCKET_BUFFER`, `DDP_BENCH_SEGMENT`, `DDP_BENCH_SMALL`, `DDP_BENCH_SHM_RING`,
//! `DDP_BENCH_SPIN_US`.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use ddp_comm::{Backend, ProcessGroup, ReduceOp, Transport};
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
/// The smallest all-reduce that is also timed with `ReduceOp::Avg`.
const AVG_FROM: usize = 4 << 20;
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
/// (label, bytes per rank, calls) of the all-gather.
const GATHER: (&str, usize, usize) = ("4 MiB", 4 << 20, 100);

struct Args {
    ranks: usize,
    backend: Backend,
    /// `None`: run both CPU transports (shared memory, then TCP).
    transport: Option<Transport>,
    gloo: bool,
    scale: f64,
    /// Only the rows whose label contains this.
    filter: String,
}

fn parse_args() -> Args {
    let mut args = Args {
        ranks: 2,
        backend: Backend::Cpu,
        transport: None,
        gloo: true,
        scale: 1.0,
        filter: String::new(),
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
                let b = it.next().unwrap_or_default();
                args.backend = b.parse().expect("--backend cpu|nccl");
            }
            "--transport" => {
                let t = it.next().unwrap_or_default();
                args.transport = Some(t.parse().expect("--transport auto|tcp"));
            }
            "--no-gloo" => args.gloo = false,
            "--quick" => args.scale = 0.1,
            "--filter" => args.filter = it.next().expect("--filter TEXT"),
            _ => {} // cargo bench passes --bench
        }
    }
    if args.backend == Backend::Nccl {
        args.gloo = false;
        args.transport.get_or_insert(Transport::Auto);
        if !ranks_given {
            // One rank per GPU: NCCL refuses two ranks on one device.
            args.ranks = ddp_comm::cuda::device_count().max(1);
        }
    }
    args
}

fn time_calls(calls: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..calls.div_ceil(20).max(2) {
        f();
    }
    let times: Vec<f64> = (0..calls)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    ddp_testkit::median(&times)
}

/// One rank: runs the sweep and, on rank 0, prints `RESULT` lines.
fn worker(args: &Args) {
    let mut opts = ddp_comm::Options::from_env()
        .expect("environment")
        .backend(args.backend)
        .transport(args.transport.unwrap_or_default())
        .op_timeout(Duration::from_secs(120));
    let knob = |name: &str| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    };
    if let Some(bytes) = knob("DDP_BENCH_SOCKET_BUFFER") {
        opts.socket_buffer = bytes;
    }
    if let Some(bytes) = knob("DDP_BENCH_SHM_RING") {
        opts.shm_ring_bytes = bytes;
    }
    if args.backend == Backend::Nccl {
        assert!(
            ddp_comm::cuda::load_torch_cuda().expect("libtorch_cuda"),
            "CPU-only libtorch"
        );
    }
    let group = ProcessGroup::new(opts).expect("rendezvous");
    if let Some(bytes) = knob("DDP_BENCH_SEGMENT") {
        group.set_ring_segment(bytes);
    }
    if let Some(bytes) = knob("DDP_BENCH_SMALL") {
        group.set_small_threshold(bytes);
    }
    if let Some(us) = knob("DDP_BENCH_SPIN_US") {
        group.set_shm_spin(Duration::from_micros(us as u64));
    }
    let device = match args.backend {
        Backend::Nccl => Device::Cuda(group.local_rank()),
        Backend::Cpu => Device::Cpu,
    };
    let sync = || {
        if device != Device::Cpu {
            tch::Cuda::synchronize(group.local_rank() as i64);
        }
    };
    let n = group.world_size() as f64;
    let calls = |c: usize| ((c as f64 * args.scale) as usize).max(5);
    let wanted = |label: &str| label.contains(&args.filter);
    for (size, bytes, count) in SIZES {
        let mut t = Tensor::zeros([(bytes / 4) as i64], (Kind::Float, device));
        for (op, suffix) in [(ReduceOp::Sum, ""), (ReduceOp::Avg, " Avg")] {
            let label = format!("all_reduce {size}{suffix}");
            if (op == ReduceOp::Avg && bytes < AVG_FROM) || !wanted(&label) {
                continue;
            }
            group.barrier().unwrap();
            let secs = time_calls(calls(count), || {
                group.all_reduce(&mut t, op).unwrap();
                sync();
            });
            let busbw = bytes as f64 / secs * 2.0 * (n - 1.0) / n / 1e9;
            if group.rank() == 0 {
                println!("RESULT {label}|{secs}|{busbw}");
            }
        }
    }
    let (label, bytes, count) = GATHER;
    if wanted(&format!("all_gather {label}")) {
        let t = Tensor::zeros([(bytes / 4) as i64], (Kind::Float, device));
        // A reused output, as Gloo's reference gathers into a preallocated list.
        let mut out = Tensor::zeros(
            [group.world_size() as i64, t.numel() as i64],
            (Kind::Float, device),
        );
        group.barrier().unwrap();
        let secs = time_calls(calls(count), || {
            group.all_gather_into(&t, &mut out).unwrap();
            sync();
        });
        if group.rank() == 0 {
            let busbw = n * bytes as f64 / secs * (n - 1.0) / n / 1e9;
            println!("RESULT all_gather {label}|{secs}|{busbw}");
        }
    }
    let mut params: Vec<Tensor> = CONVNET
        .iter()
        .map(|s| Tensor::zeros(*s, (Kind::Float, device)))
        .collect();
    let total: i64 = params.iter().map(|p| p.numel() as i64).sum();
    if wanted("broadcast 14 tensors") {
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
    }
    if wanted("broadcast flat") {
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
}

/// `(label, median seconds, bandwidth or bytes)` lines of one run.
type Results = Vec<(String, f64, f64)>;

fn results(stdout: &[u8]) -> Results {
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

fn run_ours(args: &Args, transport: Transport) -> Results {
    let port = ddp_testkit::free_port();
    let exe = std::env::current_exe().expect("the bench's own executable");
    let children: Vec<_> = (0..args.ranks)
        .map(|r| {
            ddp_testkit::rank_command(&exe, r, args.ranks, port)
                .args(std::env::args().skip(1))
                .args(["--transport", &transport.to_string()])
                .env(WORKER_ENV, "1")
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

fn run_gloo(args: &Args) -> Result<Results, String> {
    let deps = std::env::var_os("DDP_DEPS_DIR")
        .map(PathBuf::from)
        .ok_or("DDP_DEPS_DIR is not set")?;
    let python = deps.join("venv/bin/python");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/reference_gloo.py");
    let out = ddp_testkit::venv_python(&python)
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
    let transports = match args.transport {
        Some(t) => vec![t],
        None => vec![Transport::Auto, Transport::Tcp],
    };
    let ours: Vec<(String, Results)> = transports
        .iter()
        .map(|&t| {
            let name = match (args.backend, t) {
                (Backend::Nccl, _) => "nccl",
                (_, Transport::Auto) => "shm",
                (_, Transport::Tcp) => "tcp",
            };
            (name.to_string(), run_ours(&args, t))
        })
        .collect();
    let gloo = if args.gloo {
        run_gloo(&args).unwrap_or_else(|e| {
            println!("gloo reference skipped: {e}");
            Vec::new()
        })
    } else {
        Vec::new()
    };
    println!(
        "\n{} ranks on this machine; median of each call; ddp-comm over {}",
        args.ranks,
        ours.iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(" and ")
    );
    let mut head = format!("{:<22}", "operation");
    for (name, _) in &ours {
        head += &format!(" {:>10} {:>9}", name, "GB/s");
    }
    head += &format!(" {:>10} {:>9}", "gloo", "GB/s");
    for (name, _) in &ours {
        head += &format!(" {:>9}", format!("{name}/gloo"));
    }
    println!("{head}");
    let labels: Vec<&String> = ours[0].1.iter().map(|(l, _, _)| l).collect();
    for label in labels {
        let is_bw = label.starts_with("all_reduce") || label.starts_with("all_gather");
        let bw = |v: f64| {
            if is_bw {
                format!("{v:.3}")
            } else {
                "-".into()
            }
        };
        let find = |rows: &[(String, f64, f64)]| {
            rows.iter().find(|(l, _, _)| l == label).map(|r| (r.1, r.2))
        };
        let mut line = format!("{label:<22}");
        for (_, rows) in &ours {
            match find(rows) {
                Some((s, v)) => line += &format!(" {:>10} {:>9}", fmt_time(s), bw(v)),
                None => line += &format!(" {:>10} {:>9}", "-", "-"),
            }
        }
        let g = find(&gloo);
        match g {
            Some((s, v)) => line += &format!(" {:>10} {:>9}", fmt_time(s), bw(v)),
            None => line += &format!(" {:>10} {:>9}", "-", "-"),
        }
        for (_, rows) in &ours {
            let ratio = match (find(rows), g) {
                (Some((s, v)), Some((gs, gv))) => {
                    if is_bw && gv > 0.0 && label != "all_reduce 4 KiB" {
                        format!("{:.2}x", v / gv)
                    } else {
                        format!("{:.2}x", gs / s)
                    }
                }
                _ => "-".into(),
            };
            line += &format!(" {ratio:>9}");
        }
        println!("{line}");
    }
    println!("ratio: bus bandwidth ours/gloo for all-reduce >= 256 KiB and all-gather, else time gloo/ours (higher is better)");
}
