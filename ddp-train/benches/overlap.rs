//! Communication overlap: DDP training steps of an MLP whose gradients are large next to its
//! compute (square `Linear` layers, a small batch), on the CPU, one process per rank, with
//! the gradient all-reduce overlapped with backward (the default), after backward
//! (`DdpOptions::overlap = false`), and with the `bf16_compress` hook.
//!
//! ```text
//! cargo bench -p ddp-train --bench overlap                          # 2 ranks, shared memory
//! DDP_TRANSPORT=tcp cargo bench -p ddp-train --bench overlap -- --layers 4 --width 1024
//! cargo bench -p ddp-train --bench overlap -- --configs overlap,no-overlap --steps 20
//! ```
//!
//! Run by itself, the bench starts `--ranks` copies of itself on loopback. Run with
//! torchrun's environment already set (`RANK`, `WORLD_SIZE`, ..., as `cargo xtask bench`
//! starts it through `ddp-run`), it is one rank. Each configuration has its own model,
//! `DistributedDataParallel` and optimizer in the same processes, and they take one step in
//! turn, so that load that comes and goes on the machine affects them alike.
//!
//! A step is what a training loop does: `zero_grad` (gradients to none), forward, MSE loss,
//! backward, `sync_gradients`, SGD. Each phase is timed on every rank. The step's median
//! on rank 0 gives steps/s; the gradient sync's cost per step is the smallest of the ranks'
//! times (the rank that reached it last waited least for a peer). With `overlap: false`
//! that cost is the communication the overlap can hide: bucket copies, the all-reduces, the
//! copies back. After the steps one flat all-reduce of all the gradients' bytes is timed
//! alone.
//!
//! Output: one `RESULT overlap config=<name> world=<n> rank=<r> key=value ...` line per
//! configuration and rank (what `cargo xtask bench` reads). `benches/reference_overlap.py`
//! is the same step with PyTorch's DDP (Gloo).

use std::error::Error;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ddp_comm::{Backend, EnvConfig, Options, ProcessGroup, ReduceOp};
use ddp_train::optim::{Optimizer, OptimizerConfig, SgdConfig};
use ddp_train::{BuiltinHook, DdpOptions, DistributedDataParallel};
use tch::{nn, nn::Module, Device, Kind, Reduction, Tensor};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const USAGE: &str = "usage: overlap [--ranks N] [--layers N] [--width N] [--batch N] \
                     [--warmup N] [--steps N] [--configs overlap,no-overlap,bf16,bf16-no-overlap] \
                     [--bucket-cap-mb N] [--allreduce-calls N]";

/// The command line (hand-parsed: the bench uses only the crate's core, without clap).
#[derive(Debug, Clone)]
struct Args {
    ranks: usize,
    layers: usize,
    width: i64,
    batch: i64,
    warmup: usize,
    steps: usize,
    configs: Vec<Config>,
    /// DDP's bucket cap in MiB (PyTorch's `bucket_cap_mb`).
    bucket_cap_mb: usize,
    allreduce_calls: usize,
}

/// One way of running the step.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Config {
    overlap: bool,
    hook: BuiltinHook,
}

impl Config {
    fn parse(s: &str) -> Result<Self> {
        let (hook, rest) = match s.strip_prefix("bf16") {
            Some(rest) => (BuiltinHook::Bf16Compress, rest),
            None => match s.strip_prefix("fp16") {
                Some(rest) => (BuiltinHook::Fp16Compress, rest),
                None => (BuiltinHook::Allreduce, s),
            },
        };
        let overlap = match rest.trim_start_matches('-') {
            "" | "overlap" => true,
            "no-overlap" => false,
            _ => {
                return Err(format!(
                    "unknown configuration '{s}': expected overlap, no-overlap, bf16, \
                     bf16-no-overlap, fp16 or fp16-no-overlap"
                )
                .into())
            }
        };
        Ok(Config { overlap, hook })
    }

    /// `overlap`, `no-overlap`, `bf16`, `bf16-no-overlap`, `fp16`, `fp16-no-overlap`.
    fn name(self) -> String {
        let hook = match self.hook {
            BuiltinHook::Allreduce => None,
            BuiltinHook::Bf16Compress => Some("bf16"),
            BuiltinHook::Fp16Compress => Some("fp16"),
        };
        match (hook, self.overlap) {
            (None, true) => "overlap".to_string(),
            (None, false) => "no-overlap".to_string(),
            (Some(h), true) => h.to_string(),
            (Some(h), false) => format!("{h}-no-overlap"),
        }
    }
}

impl Args {
    fn parse() -> Result<Self> {
        let mut args = Args {
            ranks: 2,
            layers: 10,
            width: 2048,
            batch: 16,
            warmup: 3,
            steps: 12,
            configs: ["overlap", "no-overlap", "bf16"]
                .iter()
                .map(|s| Config::parse(s))
                .collect::<Result<_>>()?,
            bucket_cap_mb: 25,
            allreduce_calls: 5,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            if flag == "--bench" {
                continue; // passed by `cargo bench`
            }
            let value = it
                .next()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
            let number = || -> Result<usize> {
                value
                    .parse()
                    .map_err(|_| format!("{flag}: '{value}' is not a number\n{USAGE}").into())
            };
            match flag.as_str() {
                "--ranks" => args.ranks = number()?,
                "--layers" => args.layers = number()?,
                "--width" => args.width = number()? as i64,
                "--batch" => args.batch = number()? as i64,
                "--warmup" => args.warmup = number()?,
                "--steps" => args.steps = number()?,
                "--allreduce-calls" => args.allreduce_calls = number()?,
                "--bucket-cap-mb" => args.bucket_cap_mb = number()?,
                "--configs" => {
                    args.configs = value.split(',').map(Config::parse).collect::<Result<_>>()?
                }
                _ => return Err(format!("unknown option {flag}\n{USAGE}").into()),
            }
        }
        if [
            args.ranks,
            args.layers,
            args.width as usize,
            args.batch as usize,
        ]
        .contains(&0)
            || args.bucket_cap_mb == 0
        {
            return Err(
                "--ranks, --layers, --width, --batch and --bucket-cap-mb must be at least 1".into(),
            );
        }
        if args.steps == 0 {
            return Err("--steps must be at least 1".into());
        }
        Ok(args)
    }
}

fn main() -> Result<()> {
    let args = Args::parse()?;
    if std::env::var_os("RANK").is_some() {
        // The ddp-train binary's allocator settings (unless the environment sets its own).
        ddp_train::malloc::keep_freed_memory();
        return worker(&args);
    }
    for line in launch(args.ranks)? {
        println!("{line}");
    }
    Ok(())
}

/// Starts `world` copies of this binary as ranks on loopback; returns their `RESULT` lines.
fn launch(world: usize) -> Result<Vec<String>> {
    let port = ddp_testkit::free_port();
    let exe = std::env::current_exe()?;
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..world {
        let child = ddp_testkit::rank_command(&exe, rank, world, port)
            .args(std::env::args_os().skip(1))
            .env("DDP_RUN_ID", format!("ddp-overlap-{port}"))
            .env("OMP_NUM_THREADS", "1")
            .stdout(Stdio::piped())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("starting rank {rank} ({}): {e}", exe.display()).into());
            }
        }
    }
    let outputs = ddp_testkit::wait_all(children, Duration::from_secs(1800));
    let mut lines = Vec::new();
    for (rank, out) in outputs.iter().enumerate() {
        if !out.status.success() {
            return Err(format!("rank {rank} of {world} failed ({})", out.status).into());
        }
        lines.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.starts_with("RESULT "))
                .map(str::to_owned),
        );
    }
    Ok(lines)
}

/// The MLP: `layers` square `Linear` layers with ReLU between them.
struct Mlp {
    layers: Vec<nn::Linear>,
}

impl Mlp {
    fn new(vs: &nn::Path, layers: usize, width: i64) -> Self {
        let layers = (0..layers)
            .map(|i| nn::linear(vs / "layers" / i, width, width, Default::default()))
            .collect();
        Mlp { layers }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let mut h = x.shallow_clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h);
            if i + 1 < self.layers.len() {
                h = h.relu();
            }
        }
        h
    }
}

/// Per step, the smallest of all ranks' values (every rank gets the same list).
fn min_over_ranks(pg: &ProcessGroup, mine: &[f64]) -> Result<Vec<f64>> {
    let bytes: Vec<u8> = mine.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut min = mine.to_vec();
    for theirs in pg.all_gather_bytes(&bytes)? {
        for (m, chunk) in min.iter_mut().zip(theirs.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            *m = m.min(f64::from_le_bytes(b));
        }
    }
    Ok(min)
}

/// Per-step times of each phase, in seconds.
#[derive(Default)]
struct Phases {
    /// zero_grad + forward + loss + backward.
    compute: Vec<f64>,
    sync: Vec<f64>,
    optim: Vec<f64>,
    step: Vec<f64>,
}

/// One configuration's replica: its own model, DDP and optimizer, so that configurations
/// can take turns step by step.
struct Replica {
    config: Config,
    mlp: Mlp,
    ddp: DistributedDataParallel,
    sgd: Optimizer,
    phases: Phases,
    loss: f64,
    _vs: nn::VarStore,
}

impl Replica {
    fn new(args: &Args, pg: &Arc<ProcessGroup>, config: Config) -> Result<Self> {
        let vs = nn::VarStore::new(Device::Cpu);
        let mlp = Mlp::new(&vs.root(), args.layers, args.width);
        let options = DdpOptions {
            overlap: config.overlap,
            comm_hook: config.hook,
            // PyTorch's first bucket takes an explicit bucket_cap_mb too.
            bucket_cap_bytes: args.bucket_cap_mb << 20,
            first_bucket_cap_bytes: args.bucket_cap_mb << 20,
            ..DdpOptions::default()
        };
        let ddp = DistributedDataParallel::new(&vs, pg.clone(), options)?;
        let params: Vec<(String, Tensor)> = ddp
            .parameters()
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let sgd = Optimizer::new(
            params,
            OptimizerConfig::Sgd(SgdConfig {
                lr: 1e-4,
                ..SgdConfig::default()
            }),
        );
        Ok(Replica {
            config,
            mlp,
            ddp,
            sgd,
            phases: Phases::default(),
            loss: f64::NAN,
            _vs: vs,
        })
    }

    /// One training step; its phases are recorded when `timed`.
    fn step(&mut self, x: &Tensor, y: &Tensor, timed: bool) -> Result<()> {
        let t0 = Instant::now();
        self.sgd.zero_grad();
        let l = self.mlp.forward(x).mse_loss(y, Reduction::Mean);
        l.backward();
        let t1 = Instant::now();
        self.ddp.sync_gradients()?;
        let t2 = Instant::now();
        self.sgd.step();
        let t3 = Instant::now();
        self.loss = l.double_value(&[]);
        if timed {
            self.phases.compute.push((t1 - t0).as_secs_f64());
            self.phases.sync.push((t2 - t1).as_secs_f64());
            self.phases.optim.push((t3 - t2).as_secs_f64());
            self.phases.step.push((t3 - t0).as_secs_f64());
        }
        Ok(())
    }
}

/// One rank: every configuration's replica takes one step in turn, so that load on the
/// machine that comes and goes affects them alike; then a `RESULT` line for each.
fn worker(args: &Args) -> Result<()> {
    tch::set_num_threads(1);
    let env = EnvConfig::from_env()?;
    let transport = std::env::var("DDP_TRANSPORT").unwrap_or_else(|_| "auto".to_string());
    let opts = Options::from_config(&env)
        .backend(Backend::Cpu)
        .op_timeout(Duration::from_secs(300));
    let pg = Arc::new(ProcessGroup::new(opts)?);
    let (rank, world) = (pg.rank(), pg.world_size());

    tch::manual_seed(rank as i64);
    let x = Tensor::randn([args.batch, args.width], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([args.batch, args.width], (Kind::Float, Device::Cpu));
    let mut replicas = args
        .configs
        .iter()
        .map(|&c| Replica::new(args, &pg, c))
        .collect::<Result<Vec<_>>>()?;
    for step in 0..args.warmup + args.steps {
        if step == args.warmup {
            pg.barrier()?;
        }
        for replica in &mut replicas {
            replica.step(&x, &y, step >= args.warmup)?;
        }
    }

    for replica in &replicas {
        let Replica {
            config,
            ddp,
            phases,
            loss,
            ..
        } = replica;
        let sync_cost = min_over_ranks(&pg, &phases.sync)?;
        let parameters: i64 = ddp.parameters().iter().map(|(_, t)| t.numel() as i64).sum();
        let grad_bytes: usize = ddp.bucket_sizes().iter().sum();
        let buckets = ddp.bucket_sizes().len();
        // The all-reduce alone: one flat tensor of all the gradients' elements, in the
        // dtype the configuration sends.
        let kind = match config.hook {
            BuiltinHook::Allreduce => Kind::Float,
            BuiltinHook::Bf16Compress => Kind::BFloat16,
            BuiltinHook::Fp16Compress => Kind::Half,
        };
        let mut flat = Tensor::zeros([(grad_bytes / 4) as i64], (kind, Device::Cpu));
        let mut allreduce = Vec::new();
        if world > 1 {
            pg.barrier()?;
            for _ in 0..args.allreduce_calls {
                let t = Instant::now();
                pg.all_reduce(&mut flat, ReduceOp::Sum)?;
                allreduce.push(t.elapsed().as_secs_f64());
            }
        }
        pg.barrier()?;
        let step = ddp_testkit::median(&phases.step);
        println!(
            "RESULT overlap config={} transport={transport} world={world} rank={rank} \
             layers={} width={} batch={} parameters={parameters} grad_bytes={grad_bytes} \
             buckets={buckets} bucket_cap_mb={} warmup={} steps={} steps_per_sec={:.4} \
             step_median_s={step:.5} compute_median_s={:.5} sync_median_s={:.5} \
             sync_cost_median_s={:.5} optim_median_s={:.5} allreduce_median_s={:.5} \
             loss={loss:.6}",
            config.name(),
            args.layers,
            args.width,
            args.batch,
            args.bucket_cap_mb,
            args.warmup,
            args.steps,
            1.0 / step,
            ddp_testkit::median(&phases.compute),
            ddp_testkit::median(&phases.sync),
            ddp_testkit::median(&sync_cost),
            ddp_testkit::median(&phases.optim),
            ddp_testkit::median(&allreduce),
        );
    }
    Ok(())
}
