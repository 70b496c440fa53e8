//! Training throughput and DDP overhead: N data-parallel steps of the ConvNet on the CPU,
//! one process per rank, with the real `ProcessGroup` (TCP backend) and
//! `DistributedDataParallel`, warm-up steps excluded.
//!
//! ```text
//! cargo bench -p ddp-train --bench ddp_steps                         # random tensors, 1 and 2 ranks
//! cargo bench -p ddp-train --bench ddp_steps -- --data DIR           # JPEGs through ddp-data's loader
//! cargo bench -p ddp-train --bench ddp_steps -- --ranks 2 --steps 20 --warmup 3
//! ```
//!
//! Each step does what the `Trainer` does: next batch, buffer broadcast, forward,
//! BCE-with-logits, backward, gradient sync, Adam. Every phase is timed on every rank, so
//! the DDP overhead (buffer broadcast + bucket copy + all-reduce) shows separately from
//! compute and from time spent waiting for data. After the steps, one flat all-reduce of
//! the gradients' size is timed alone, to split the sync into communication and copying.
//!
//! With `--data`, one loader runs over this rank's shards of as many epochs as the steps
//! need (one continuous stream, as in a long epoch), with the trainer's default number of
//! worker threads. `benches/reference_ddp.py` does the same work with PyTorch's DDP (Gloo).
//!
//! Output: per world size, one `RESULT ddp_steps key=value ...` line per rank (what
//! `cargo xtask bench` reads), then a summary.

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use ddp_comm::{Backend, Options, ProcessGroup, ReduceOp};
use ddp_data::{Loader, LoaderConfig, OdirDataset, OdirOptions, Transform};
use ddp_model::{ConvNet, ConvNetConfig};
use ddp_sampler::DistributedSampler;
use ddp_train::optim::{Adam, AdamConfig};
use ddp_train::{DdpOptions, DistributedDataParallel};
use tch::{nn, Device, Kind, Reduction, Tensor};

/// Set in the environment of the rank processes this bench starts.
const WORKER_ENV: &str = "DDP_STEPS_WORKER";

#[derive(Debug, Clone, Parser)]
#[command(about = "DDP training steps of the ConvNet: images/s and DDP overhead per step")]
struct Args {
    /// World sizes to run, one after the other (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    ranks: Vec<usize>,
    /// ODIR folder whose JPEGs feed the steps through ddp-data's loader (default: one fixed
    /// batch of random tensors per rank).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Steps run before timing starts.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Batch size per rank.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Side of the square input images.
    #[arg(long, default_value_t = 224)]
    image_size: u32,
    /// Intra-op threads per rank.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Loader threads per rank (default: the trainer's default, cores / ranks).
    #[arg(long)]
    workers: Option<usize>,
    /// Calls of the standalone all-reduce timed after the steps.
    #[arg(long, default_value_t = 100)]
    allreduce_calls: usize,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if std::env::var_os(WORKER_ENV).is_some() {
        // The same allocator settings as the ddp-train binary: measure the product.
        ddp_train::malloc::keep_freed_memory();
        return worker(&args);
    }
    let mut rates = Vec::new();
    for &world in &args.ranks {
        if world == 0 {
            bail!("--ranks: a world size must be at least 1");
        }
        let lines = launch(world)?;
        for line in &lines {
            println!("{line}");
        }
        let field = |key: &str, rank: &str| -> Option<f64> {
            lines
                .iter()
                .find(|l| value(l, "rank") == Some(rank))
                .and_then(|l| value(l, key)?.parse().ok())
        };
        let rate = field("images_per_sec", "0").context("rank 0 printed no result")?;
        let overhead = field("ddp_overhead_median_s", "0").unwrap_or(f64::NAN);
        println!(
            "ddp_steps: {world} rank(s), {} : {rate:.2} img/s; per step: compute {:.3} s, \
             waiting for data {:.3} s, DDP overhead (buffer broadcast + gradient sync) {:.2} ms",
            args.data
                .as_ref()
                .map_or("random tensors".to_string(), |d| d.display().to_string()),
            field("compute_median_s", "0").unwrap_or(f64::NAN),
            field("data_median_s", "0").unwrap_or(f64::NAN),
            overhead * 1e3
        );
        rates.push((world, rate));
    }
    if let (Some(&(1, one)), Some(&(two_world, two))) = (
        rates.iter().find(|r| r.0 == 1),
        rates.iter().find(|r| r.0 > 1),
    ) {
        println!(
            "ddp_steps: scaling efficiency {two_world} ranks: {:.3}",
            two / (two_world as f64 * one)
        );
    }
    Ok(())
}

/// The value of `key=value` in a result line.
fn value<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// Starts `world` rank processes of this binary and returns their `RESULT` lines.
fn launch(world: usize) -> Result<Vec<String>> {
    let port = ddp_testkit::free_port();
    let exe = std::env::current_exe().context("locating this bench binary")?;
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..world {
        let child = ddp_testkit::rank_command(&exe, rank, world, port)
            .args(std::env::args_os().skip(1))
            .env(WORKER_ENV, "1")
            .env("DDP_RUN_ID", format!("ddp-steps-{port}"))
            .env("OMP_NUM_THREADS", "1")
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting rank {rank} ({})", exe.display()));
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                stop(&mut children);
                return Err(e);
            }
        }
    }
    // The first rank to fail ends the others, so nothing waits for a dead peer.
    let mut done = vec![false; world];
    while done.iter().any(|d| !d) {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Some(status) = child.try_wait().context("waiting for a rank")? {
                done[rank] = true;
                if !status.success() {
                    stop(&mut children);
                    bail!("rank {rank} of {world} failed ({status})");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut lines = Vec::new();
    for child in children {
        let out = child
            .wait_with_output()
            .context("reading a rank's output")?;
        lines.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.starts_with("RESULT "))
                .map(str::to_owned),
        );
    }
    lines.sort_by_key(|l| value(l, "rank").and_then(|r| r.parse::<usize>().ok()));
    Ok(lines)
}

fn stop(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Where a rank's batches come from.
enum Source {
    /// One fixed batch, reused every step.
    Random { images: Tensor, labels: Tensor },
    /// ddp-data's loader over this rank's shards, and its number of worker threads.
    Jpeg(Loader, usize),
}

impl Source {
    fn new(args: &Args, pg: &ProcessGroup) -> Result<Self> {
        let b = args.batch_size as i64;
        let s = i64::from(args.image_size);
        let Some(dir) = &args.data else {
            let images = Tensor::rand([b, 3, s, s], (Kind::Float, Device::Cpu));
            let labels = Tensor::rand([b, 8], (Kind::Float, Device::Cpu))
                .lt(0.5)
                .to_kind(Kind::Float);
            return Ok(Self::Random { images, labels });
        };
        let dataset = Arc::new(
            OdirDataset::open(dir, &OdirOptions::default())
                .with_context(|| format!("opening ODIR data in {}", dir.display()))?,
        );
        let mut sampler = DistributedSampler::builder(dataset.len(), pg.world_size(), pg.rank())
            .seed(0)
            .build()
            .with_context(|| {
                format!("sharding the {} images of {}", dataset.len(), dir.display())
            })?;
        if sampler.is_empty() {
            bail!("{} holds no image for rank {}", dir.display(), pg.rank());
        }
        let needed = (args.warmup + args.steps) * args.batch_size;
        let mut indices = Vec::with_capacity(needed + sampler.len());
        let mut epoch = 0;
        while indices.len() < needed {
            sampler.set_epoch(epoch);
            indices.extend(sampler.iter());
            epoch += 1;
        }
        indices.truncate(needed);
        let workers = args
            .workers
            .unwrap_or_else(|| ddp_data::default_workers(pg.local_world_size()));
        let config = LoaderConfig {
            drop_last: true,
            workers,
            ..LoaderConfig::new(args.batch_size)
        };
        let loader = Loader::new(dataset, indices, Transform::train(args.image_size), &config)
            .context("starting the loader")?;
        Ok(Self::Jpeg(loader, workers))
    }

    fn next(&mut self) -> Result<(Tensor, Tensor)> {
        match self {
            Self::Random { images, labels } => Ok((images.shallow_clone(), labels.shallow_clone())),
            Self::Jpeg(loader, _) => {
                let batch = loader
                    .next()
                    .context("the loader ended before the last step")?
                    .context("loading a batch")?;
                Ok((batch.images, batch.labels))
            }
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Per-step times of each phase, in seconds.
#[derive(Default)]
struct Phases {
    data: Vec<f64>,
    bcast: Vec<f64>,
    compute: Vec<f64>,
    sync: Vec<f64>,
    optim: Vec<f64>,
    step: Vec<f64>,
}

/// Per step, the smallest of all ranks' values (every rank gets the same list).
fn min_over_ranks(pg: &ProcessGroup, mine: &[f64]) -> Result<Vec<f64>> {
    let bytes: Vec<u8> = mine.iter().flat_map(|x| x.to_le_bytes()).collect();
    let all = pg.all_gather_bytes(&bytes)?;
    let mut min = mine.to_vec();
    for theirs in &all {
        for (m, chunk) in min.iter_mut().zip(theirs.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            *m = m.min(f64::from_le_bytes(b));
        }
    }
    Ok(min)
}

/// One rank: builds the model and DDP, runs the steps, prints its `RESULT` line.
fn worker(args: &Args) -> Result<()> {
    tch::set_num_threads(args.threads as i32);
    let opts = Options::from_env()
        .context("reading the rank's environment")?
        .backend(Backend::Tcp)
        .op_timeout(Duration::from_secs(120));
    let pg = Arc::new(ProcessGroup::new(opts).context("joining the process group")?);
    let (rank, world) = (pg.rank(), pg.world_size());

    tch::manual_seed(rank as i64);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = ConvNet::new(&vs.root(), ConvNetConfig::default());
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default())?;
    let params: Vec<(String, Tensor)> = ddp
        .parameters()
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let mut adam = Adam::new(params, AdamConfig::default());
    let mut source = Source::new(args, &pg)?;

    let mut phases = Phases::default();
    let mut started = Instant::now();
    let mut loss = f64::NAN;
    for step in 0..args.warmup + args.steps {
        if step == args.warmup {
            pg.barrier()?;
            started = Instant::now();
        }
        let t0 = Instant::now();
        let (x, y) = source.next()?;
        let t1 = Instant::now();
        adam.zero_grad();
        ddp.broadcast_buffers()?;
        let t2 = Instant::now();
        let logits = net.forward_t(&x, true);
        let l = logits.binary_cross_entropy_with_logits::<Tensor>(&y, None, None, Reduction::Mean);
        l.backward();
        loss = l.double_value(&[]);
        let t3 = Instant::now();
        ddp.sync_gradients()?;
        let t4 = Instant::now();
        adam.step();
        let t5 = Instant::now();
        if step >= args.warmup {
            phases.data.push((t1 - t0).as_secs_f64());
            phases.bcast.push((t2 - t1).as_secs_f64());
            phases.compute.push((t3 - t2).as_secs_f64());
            phases.sync.push((t4 - t3).as_secs_f64());
            phases.optim.push((t5 - t4).as_secs_f64());
            phases.step.push((t5 - t0).as_secs_f64());
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let images = (world * args.batch_size * args.steps) as f64;

    // A rank that reaches a collective early waits there for the others; in each step the
    // rank that arrived last waited least, so the minimum over ranks is the collective's cost.
    let bcast_cost = min_over_ranks(&pg, &phases.bcast)?;
    let sync_cost = min_over_ranks(&pg, &phases.sync)?;
    let mut overhead: Vec<f64> = bcast_cost
        .iter()
        .zip(&sync_cost)
        .map(|(b, s)| b + s)
        .collect();

    // The gradient all-reduce alone: one flat tensor of all gradients' bytes.
    let grad_bytes: usize = ddp.bucket_sizes().iter().sum();
    let mut flat = Tensor::zeros([(grad_bytes / 4) as i64], (Kind::Float, Device::Cpu));
    let mut allreduce = Vec::new();
    if world > 1 {
        pg.barrier()?;
        for call in 0..args.allreduce_calls + 5 {
            let t = Instant::now();
            pg.all_reduce(&mut flat, ReduceOp::Avg)?;
            if call >= 5 {
                allreduce.push(t.elapsed().as_secs_f64());
            }
        }
    }
    pg.barrier()?;

    let workers = match &source {
        Source::Random { .. } => 0,
        Source::Jpeg(_, workers) => *workers,
    };
    println!(
        "RESULT ddp_steps source={} world={world} rank={rank} threads={} workers={workers} \
         batch={} size={} warmup={} steps={} images_per_sec={:.4} elapsed_s={elapsed:.4} \
         step_median_s={:.5} data_median_s={:.5} bcast_median_s={:.6} compute_median_s={:.5} \
         sync_median_s={:.6} sync_min_s={:.6} optim_median_s={:.6} allreduce_median_s={:.6} \
         bcast_cost_median_s={:.6} sync_cost_median_s={:.6} ddp_overhead_median_s={:.6} \
         grad_bytes={grad_bytes} loss={loss:.5}",
        if args.data.is_some() {
            "jpeg"
        } else {
            "random"
        },
        args.threads,
        args.batch_size,
        args.image_size,
        args.warmup,
        args.steps,
        images / elapsed,
        median(&mut phases.step),
        median(&mut phases.data),
        median(&mut phases.bcast),
        median(&mut phases.compute),
        median(&mut phases.sync.clone()),
        phases.sync.iter().copied().fold(f64::INFINITY, f64::min),
        median(&mut phases.optim),
        median(&mut allreduce),
        median(&mut bcast_cost.clone()),
        median(&mut sync_cost.clone()),
        median(&mut overhead),
    );
    Ok(())
}
