//! Training throughput and DDP overhead: N data-parallel steps of the ConvNet (or, with
//! `--model resnet50`, torchvision's ResNet-50 as ddp-model builds it) on the CPU, one process per rank, with the real
//! `ProcessGroup` (CPU backend) and `DistributedDataParallel`, warm-up steps excluded.
//!
//! ```text
//! cargo bench -p ddp-train --bench ddp_steps                         # random tensors, 1 and 2 ranks
//! cargo bench -p ddp-train --bench ddp_steps -- --data DIR           # JPEGs through ddp-data's loader
//! cargo bench -p ddp-train --bench ddp_steps -- --ranks 2 --steps 20 --warmup 3
//! cargo bench -p ddp-train --bench ddp_steps -- --ranks 1 --precision bf16 --model resnet50 \
//!     --image-size 64 --batch-size 2                                 # a CPU smoke run
//! # on a GPU machine (a prebuilt binary and a Python with torch suffice, no cargo; torchvision
//! # too for --data or --model resnet50):
//! ddp_steps --device cuda --ranks 1 --batch-size 64 --data DIR --workers 16 --reference python3
//! # ours vs PyTorch, random tensors, batch 64, 224 px, 1 rank: ConvNet and ResNet-50, fp32 and bf16
//! ddp_steps --device cuda --ranks 1 --batch-size 64 --image-size 224 --warmup 10 --steps 50 \
//!     --model convnet --precision fp32 --reference python3      # or bf16; --model resnet50
//! # from a bundle (run from the checkout's root, which holds this script and the ConvNet's):
//! bash .gpu-bundle/run.sh -- 'for m in convnet resnet50; do for p in fp32 bf16; do
//!     "$GPU_BUNDLE_BIN"/ddp-train.bench.ddp_steps --device cuda --ranks 1 --batch-size 64
//!     --image-size 224 --warmup 10 --steps 50 --model $m --precision $p
//!     --reference "$GPU_BUNDLE_PYTHON" --reference-script ddp-train/benches/reference_ddp.py;
//!     done; done'
//! ```
//!
//! `--device cuda` puts rank r on `cuda:r` with the NCCL backend; batches come from the loader
//! as the trainer gets them (bytes from page-locked buffers, copied asynchronously, the next
//! batch taken before the current step's loss is read). `--reference PYTHON` then runs
//! `benches/reference_ddp.py` with that Python and the same settings in the same run (with
//! `--data`: PyTorch's DataLoader with `--workers` - 1 worker processes, `pin_memory`,
//! `persistent_workers`, `prefetch_factor=4`, once with PIL's default decode and once with
//! `draft`) and prints ours next to it.
//!
//! Each step does what the `Trainer` does: next batch, buffer broadcast, forward,
//! BCE-with-logits, backward, gradient sync, Adam, with `DdpOptions::default()` (each
//! bucket's all-reduce starts during backward). Every phase is timed on every rank, so
//! what DDP adds outside backward (buffer broadcast + `sync_gradients`: the wait for the
//! all-reduces backward started, and the copy back) shows separately from compute (which
//! holds the all-reduce's cost during backward) and from time spent waiting for data. After
//! the steps, one flat all-reduce of the gradients' size is timed alone: the communication
//! a step holds, overlapped or not.
//!
//! `--precision bf16|fp16` runs forward and loss under autocast (`Precision::autocast`), as
//! the Trainer does; fp16 adds its `GradScaler`: scaled loss, backward, sync, unscale (timed
//! with the optimizer), Adam unless a gradient is inf/NaN, scale update. PyTorch's side uses
//! `torch.autocast` and `torch.amp.GradScaler`. `--model resnet50` trains
//! `ddp_model::Model` of `ModelKind::Resnet50` with 8 outputs (PyTorch: `torchvision.models.resnet50`),
//! same BCE-with-logits loss, on random tensors only (`--data` feeds the ConvNet only).
//!
//! With `--data`, one loader runs over this rank's shards of as many epochs as the steps
//! need (one continuous stream, as in a long epoch), with `--workers` threads (default: the
//! trainer's, cores / ranks; `cargo xtask bench` gives both sides 1). `reference_ddp.py` does
//! the same with PyTorch's DDP (Gloo): one `DataLoader` iterator over that chain of epochs.
//!
//! Output: per world size, one `RESULT ddp_steps key=value ...` line per rank (what
//! `cargo xtask bench` reads; it ends with `precision=`, `model=`, `loss_scale=` and
//! `skipped_steps=`, counted over warm-up and timed steps), then a summary.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use ddp_comm::{Backend, Options, ProcessGroup, ReduceOp};
use ddp_data::odir::transform::Transform;
use ddp_data::odir::{OdirDataset, OdirImages, OdirOptions};
use ddp_data::{Batch, Loader, LoaderConfig};
use ddp_model::{ConvNet, ConvNetConfig};
use ddp_sampler::DistributedSampler;
use ddp_train::optim::{Adam, AdamConfig};
use ddp_train::{DdpOptions, DeviceChoice, DistributedDataParallel, GradScaler, Precision};
use tch::nn::ModuleT;
use tch::{nn, Device, Kind, Reduction, Tensor};

/// Set in the environment of the rank processes this bench starts.
const WORKER_ENV: &str = "DDP_STEPS_WORKER";

/// The network trained: ODIR's ConvNet, or torchvision's ResNet-50 (8 outputs) as a compute-bound
/// model whose convolutions use the tensor cores in bf16/fp16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Model {
    /// `ddp_model::ConvNet` with its default configuration.
    Convnet,
    /// ddp-model's torchvision ResNet-50 with 8 classes (random tensors only).
    Resnet50,
}

impl std::fmt::Display for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Model::Convnet => "convnet",
            Model::Resnet50 => "resnet50",
        })
    }
}

#[derive(Debug, Clone, Parser)]
#[command(
    about = "DDP training steps of the ConvNet (or ResNet-50): images/s and DDP overhead per step"
)]
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
    /// `cpu`, or `cuda` (rank r on `cuda:r`, NCCL between ranks).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Batches the loader may prepare ahead (default: the trainer's, 2 on the CPU, 4 on a GPU).
    #[arg(long)]
    prefetch: Option<usize>,
    /// A Python with torch (and torchvision, for --data): run `reference_ddp.py` with the same
    /// settings after ours and print both.
    #[arg(long)]
    reference: Option<PathBuf>,
    /// The reference script (default: `benches/reference_ddp.py` of this crate, else
    /// `ddp-train/benches/reference_ddp.py` below the working folder).
    #[arg(long)]
    reference_script: Option<PathBuf>,
    /// Precision of the forward pass and the loss: autocast to bf16, or to fp16 with a
    /// gradient scaler (the Trainer's `--precision`).
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    precision: Precision,
    /// The network: the ConvNet, or ResNet-50 with 8 outputs (random tensors only).
    #[arg(long, value_enum, default_value_t = Model::Convnet)]
    model: Model,
    /// Calls of the standalone all-reduce timed after the steps.
    #[arg(long, default_value_t = 100)]
    allreduce_calls: usize,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.model != Model::Convnet && args.data.is_some() {
        bail!(
            "--model {}: --data feeds ODIR's JPEGs to the ConvNet only; drop --data (random \
             tensors) or use --model convnet",
            args.model
        );
    }
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
            "ddp_steps: {world} rank(s), {} {}, {} : {rate:.2} img/s; per step: compute {:.3} s, \
             waiting for data {:.3} s, DDP overhead (buffer broadcast + gradient sync) {:.2} ms",
            args.model,
            args.precision,
            args.data
                .as_ref()
                .map_or("random tensors".to_string(), |d| d.display().to_string()),
            field("compute_median_s", "0").unwrap_or(f64::NAN),
            field("data_median_s", "0").unwrap_or(f64::NAN),
            overhead * 1e3
        );
        rates.push((world, rate));
    }
    if let Some(python) = &args.reference {
        reference(&args, python, &rates)?;
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

/// The reference script's path: given, next to this bench's source, or below the working
/// folder (a checkout on a machine where the bench was built elsewhere).
fn reference_script(args: &Args) -> Result<PathBuf> {
    if let Some(p) = &args.reference_script {
        return Ok(p.clone());
    }
    let beside = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/reference_ddp.py");
    let below = PathBuf::from("ddp-train/benches/reference_ddp.py");
    [beside, below]
        .into_iter()
        .find(|p| p.exists())
        .context("reference_ddp.py not found next to the bench's source nor in ./ddp-train/benches; pass --reference-script")
}

/// Runs PyTorch doing the same work with `python`; prints its lines and the ratios.
fn reference(args: &Args, python: &std::path::Path, ours: &[(usize, f64)]) -> Result<()> {
    let script = reference_script(args)?;
    let ranks: Vec<String> = args.ranks.iter().map(usize::to_string).collect();
    let mut common = vec![
        "--ranks".to_string(),
        ranks.join(","),
        "--warmup".into(),
        args.warmup.to_string(),
        "--steps".into(),
        args.steps.to_string(),
        "--batch-size".into(),
        args.batch_size.to_string(),
        "--image-size".into(),
        args.image_size.to_string(),
        "--threads".into(),
        args.threads.to_string(),
        "--device".into(),
        args.device.clone(),
        "--precision".into(),
        args.precision.to_string(),
        "--model".into(),
        args.model.to_string(),
    ];
    let mut modes: Vec<(&str, Vec<String>)> = vec![("random tensors", vec![])];
    if let Some(dir) = &args.data {
        common.extend(["--data".into(), dir.display().to_string()]);
        // PyTorch's best DataLoader settings: a worker process per core but the training one.
        let workers = args
            .workers
            .unwrap_or_else(|| ddp_data::default_workers(1))
            .saturating_sub(1)
            .max(1);
        common.extend(["--workers".into(), workers.to_string()]);
        modes = vec![
            ("DataLoader, PIL default decode", vec![]),
            (
                "DataLoader, PIL draft",
                vec!["--draft".into(), args.image_size.to_string()],
            ),
        ];
    }
    for (label, extra) in modes {
        let out = Command::new(python)
            .arg(&script)
            .args(&common)
            .args(&extra)
            .stderr(Stdio::inherit())
            .output()
            .with_context(|| format!("running {} {}", python.display(), script.display()))?;
        if !out.status.success() {
            bail!(
                "{} {} failed ({})",
                python.display(),
                script.display(),
                out.status
            );
        }
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines().filter(|l| l.starts_with("RESULT ")) {
            println!("{line}");
            if value(line, "rank") != Some("0") {
                continue;
            }
            let world: usize = value(line, "world")
                .and_then(|w| w.parse().ok())
                .unwrap_or(0);
            let theirs: f64 = value(line, "images_per_sec")
                .and_then(|v| v.parse().ok())
                .unwrap_or(f64::NAN);
            if let Some(&(_, mine)) = ours.iter().find(|r| r.0 == world) {
                println!(
                    "ddp_steps vs PyTorch ({label}), {world} rank(s), {}, {} {}: ours \
                     {mine:.1} img/s, PyTorch {theirs:.1} img/s, ratio {:.2}",
                    args.device,
                    args.model,
                    args.precision,
                    mine / theirs
                );
            }
        }
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
    /// ddp-data's loader over this rank's shards, its number of worker threads, the batch
    /// taken ahead (as the trainer takes it), and the hand-off times: from "batch ready" to
    /// "tensors on the device" on the training thread, for batches that were ready.
    Jpeg {
        loader: Box<Loader<OdirImages>>,
        workers: usize,
        upcoming: Option<Batch>,
        handoff: Vec<f64>,
    },
}

impl Source {
    fn new(args: &Args, pg: &ProcessGroup, device: Device) -> Result<Self> {
        let b = args.batch_size as i64;
        let s = i64::from(args.image_size);
        let Some(dir) = &args.data else {
            let images = Tensor::rand([b, 3, s, s], (Kind::Float, device));
            let labels = Tensor::rand([b, 8], (Kind::Float, device))
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
            prefetch: args
                .prefetch
                .unwrap_or(if device.is_cuda() { 4 } else { 2 }),
            ..LoaderConfig::new(args.batch_size)
        };
        let images = OdirImages::new(dataset, Transform::train(args.image_size));
        let loader =
            Loader::on_device(images, indices, &config, device).context("starting the loader")?;
        Ok(Self::Jpeg {
            loader: Box::new(loader),
            workers,
            upcoming: None,
            handoff: Vec::new(),
        })
    }

    /// This step's inputs and targets.
    fn current(&mut self) -> Result<(Tensor, Tensor)> {
        if matches!(self, Self::Jpeg { upcoming: None, .. }) {
            self.advance()?;
        }
        match self {
            Self::Random { images, labels } => Ok((images.shallow_clone(), labels.shallow_clone())),
            Self::Jpeg { upcoming, .. } => {
                let batch = upcoming
                    .as_ref()
                    .context("the loader ended before the last step")?;
                Ok((
                    batch.inputs().shallow_clone(),
                    batch.targets().shallow_clone(),
                ))
            }
        }
    }

    /// Takes the next batch from the loader (the trainer does this after queuing a step's
    /// backward, before reading its loss).
    fn advance(&mut self) -> Result<()> {
        let Self::Jpeg {
            loader,
            upcoming,
            handoff,
            ..
        } = self
        else {
            return Ok(());
        };
        *upcoming = None;
        if loader.host().is_empty() {
            return Ok(());
        }
        let ready = loader.host().is_next_ready();
        let t = Instant::now();
        match loader.next() {
            None => Ok(()),
            Some(batch) => {
                let batch = batch.context("loading a batch")?;
                if ready {
                    handoff.push(t.elapsed().as_secs_f64());
                }
                *upcoming = Some(batch);
                Ok(())
            }
        }
    }
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
    let env = ddp_comm::EnvConfig::from_env().context("reading the rank's environment")?;
    let choice = if args.device == "cuda" {
        DeviceChoice::Cuda
    } else {
        DeviceChoice::Cpu
    };
    let device = choice.resolve(env.local_rank)?;
    let backend = if device.is_cuda() {
        Backend::Nccl
    } else {
        Backend::Cpu
    };
    let opts = Options::from_config(&env)
        .backend(backend)
        .op_timeout(Duration::from_secs(120))
        .device(device);
    let pg = Arc::new(ProcessGroup::new(opts).context("joining the process group")?);
    let (rank, world) = (pg.rank(), pg.world_size());

    tch::manual_seed(rank as i64);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net: Box<dyn ModuleT> = match args.model {
        Model::Convnet => Box::new(ConvNet::new(&vs.root(), ConvNetConfig::default())),
        Model::Resnet50 => Box::new(ddp_model::Model::new(
            &vs.root(),
            ddp_model::ModelKind::Resnet50,
            8,
            None,
        )),
    };
    vs.set_device(device);
    let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default())?;
    let params: Vec<(String, Tensor)> = ddp
        .parameters()
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let mut adam = Adam::new(params, AdamConfig::default());
    let mut source = Source::new(args, &pg, device)?;
    // fp16 only, as in the Trainer; counts the steps skipped for an inf/NaN gradient.
    let mut scaler = (args.precision == Precision::Fp16).then(GradScaler::default);
    let mut skipped = 0usize;

    let mut phases = Phases::default();
    let mut started = Instant::now();
    let mut loss = f64::NAN;
    for step in 0..args.warmup + args.steps {
        if step == args.warmup {
            pg.barrier()?;
            started = Instant::now();
        }
        let t0 = Instant::now();
        let (x, y) = source.current()?;
        let t1 = Instant::now();
        adam.zero_grad();
        ddp.broadcast_buffers()?;
        let t2 = Instant::now();
        // The Trainer's step: forward and loss under autocast, backward outside it.
        let l = {
            let _autocast = args.precision.autocast(device)?;
            let logits = net.forward_t(&x, true);
            logits.binary_cross_entropy_with_logits::<Tensor>(&y, None, None, Reduction::Mean)
        };
        match &scaler {
            Some(scaler) => scaler.scale_loss(&l).backward(),
            None => l.backward(),
        }
        drop((x, y));
        let ta = Instant::now();
        source.advance()?;
        let tb = Instant::now();
        loss = l.double_value(&[]);
        let t3 = Instant::now();
        ddp.sync_gradients()?;
        let t4 = Instant::now();
        match &mut scaler {
            // The Trainer's order: unscale, step unless inf/NaN, update the scale.
            Some(scaler) => {
                let found_inf = scaler.unscale(ddp.parameters())?.found()?;
                if found_inf {
                    skipped += 1;
                } else {
                    adam.step();
                }
                scaler.update(found_inf);
            }
            None => adam.step(),
        }
        let t5 = Instant::now();
        if step >= args.warmup {
            phases.data.push((t1 - t0 + (tb - ta)).as_secs_f64());
            phases.bcast.push((t2 - t1).as_secs_f64());
            phases.compute.push((t3 - t2 - (tb - ta)).as_secs_f64());
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
    let overhead: Vec<f64> = bcast_cost
        .iter()
        .zip(&sync_cost)
        .map(|(b, s)| b + s)
        .collect();

    // The gradient all-reduce alone: one flat tensor of all gradients' bytes.
    let grad_bytes: usize = ddp.bucket_sizes().iter().sum();
    let mut flat = Tensor::zeros([(grad_bytes / 4) as i64], (Kind::Float, device));
    let mut allreduce = Vec::new();
    if world > 1 {
        pg.barrier()?;
        for call in 0..args.allreduce_calls + 5 {
            let t = Instant::now();
            // DDP's default: gradients scaled as they are copied in, then summed.
            pg.all_reduce(&mut flat, ReduceOp::Sum)?;
            if call >= 5 {
                allreduce.push(t.elapsed().as_secs_f64());
            }
        }
    }
    pg.barrier()?;

    let (workers, handoff) = match &source {
        Source::Random { .. } => (0, Vec::new()),
        Source::Jpeg {
            workers, handoff, ..
        } => (*workers, handoff.clone()),
    };
    let handoff_ready = handoff.len();
    println!(
        "RESULT ddp_steps source={} device={device:?} world={world} rank={rank} threads={} workers={workers} \
         batch={} size={} warmup={} steps={} images_per_sec={:.4} elapsed_s={elapsed:.4} \
         step_median_s={:.5} data_median_s={:.5} bcast_median_s={:.6} compute_median_s={:.5} \
         sync_median_s={:.6} sync_min_s={:.6} optim_median_s={:.6} allreduce_median_s={:.6} \
         bcast_cost_median_s={:.6} sync_cost_median_s={:.6} ddp_overhead_median_s={:.6} \
         grad_bytes={grad_bytes} handoff_median_s={:.7} handoff_ready={handoff_ready} loss={loss:.5} \
         precision={} model={} loss_scale={} skipped_steps={skipped}",
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
        ddp_testkit::median(&phases.step),
        ddp_testkit::median(&phases.data),
        ddp_testkit::median(&phases.bcast),
        ddp_testkit::median(&phases.compute),
        ddp_testkit::median(&phases.sync),
        phases.sync.iter().copied().fold(f64::INFINITY, f64::min),
        ddp_testkit::median(&phases.optim),
        ddp_testkit::median(&allreduce),
        ddp_testkit::median(&bcast_cost),
        ddp_testkit::median(&sync_cost),
        ddp_testkit::median(&overhead),
        ddp_testkit::median(&handoff),
        args.precision,
        args.model,
        scaler.as_ref().map_or(1.0, GradScaler::scale),
    );
    Ok(())
}
