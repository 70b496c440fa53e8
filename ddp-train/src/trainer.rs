//! The Trainer: epochs of distributed training and exact distributed evaluation.
//!
//! Per epoch, on every rank, the collectives come in this fixed order: for each step,
//! a buffer broadcast before each forward and one gradient all-reduce per optimizer step;
//! then one all-reduce of the epoch's loss and sample counts; then one all-reduce of the
//! validation counts. Rank 0 alone writes files and prints progress, between epochs.

use std::fs::OpenOptions;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ddp_comm::{ProcessGroup, ReduceOp};
use ddp_data::{
    split_by_patient, Batch, LabelMode, Loader, LoaderConfig, OdirDataset, OdirImages, OdirOptions,
    Transform,
};
use ddp_model::{checkpoint, ConvNet, ConvNetConfig, ODIR_CLASSES};
use ddp_sampler::{DistributedSampler, Partition};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tch::{nn, Device, Kind, Reduction, Tensor};

use crate::config::{DeviceChoice, Labels, TrainConfig};
use crate::ddp::{DdpOptions, DistributedDataParallel};
use crate::metrics::Confusion;
use crate::optim::{Adam, AdamConfig};
use crate::plot::{draw_curves, EpochPoint};
use crate::scheduler::{PlateauConfig, ReduceLrOnPlateau};
use crate::state::{self, Best, TrainState};

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct EpochMetrics {
    /// Epoch number (from 1).
    pub epoch: u64,
    /// Mean training loss over every sample of every rank.
    pub train_loss: f64,
    /// Mean validation loss over the whole validation split.
    pub val_loss: f64,
    /// Validation macro-F1.
    pub val_macro_f1: f64,
    /// Validation micro-F1.
    pub val_micro_f1: f64,
    /// Validation F1 of each class, in N D G C A H M O order.
    pub val_f1_per_class: Vec<f64>,
    /// Learning rate used in this epoch.
    pub lr: f64,
    /// Training images per second, all ranks together.
    pub images_per_sec: f64,
    /// Wall time of the epoch (training and evaluation).
    pub epoch_seconds: f64,
    /// Optimizer steps taken in this epoch.
    pub steps: usize,
    /// Ranks that trained.
    pub world_size: usize,
}

/// The result of `--eval-only`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct EvalMetrics {
    /// Mean validation loss.
    pub val_loss: f64,
    /// Validation macro-F1.
    pub val_macro_f1: f64,
    /// Validation micro-F1.
    pub val_micro_f1: f64,
    /// Validation F1 of each class.
    pub val_f1_per_class: Vec<f64>,
    /// True positives per class over the whole split.
    pub tp: Vec<i64>,
    /// False positives per class.
    pub fp: Vec<i64>,
    /// False negatives per class.
    pub fn_: Vec<i64>,
    /// Ranks that evaluated.
    pub world_size: usize,
}

/// The data a run trains and evaluates on.
struct Data {
    train_set: Arc<OdirDataset>,
    train: Vec<usize>,
    val_set: Arc<OdirDataset>,
    val: Vec<usize>,
}

/// A rank's whole training run.
pub struct Trainer {
    config: TrainConfig,
    pg: Arc<ProcessGroup>,
    device: Device,
    out: PathBuf,
    data: Data,
    vs: nn::VarStore,
    net: ConvNet,
    ddp: DistributedDataParallel,
    adam: Adam,
    scheduler: ReduceLrOnPlateau,
    start_epoch: u64,
    best_macro: Option<Best>,
    best_micro: Option<Best>,
    history: Vec<EpochPoint>,
    log: RankLog,
    train_sampler: DistributedSampler,
    val_sampler: DistributedSampler,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("rank", &self.pg.rank())
            .field("device", &self.device)
            .field("out", &self.out)
            .finish_non_exhaustive()
    }
}

impl Trainer {
    /// Prepares a rank: checks settings and data (before meeting the other ranks, so bad
    /// input fails on every rank alike), joins the process group, builds the model, restores
    /// a checkpoint when asked, and wraps the model in DDP.
    pub fn new(config: TrainConfig) -> Result<Self> {
        config.validate().map_err(anyhow::Error::msg)?;
        let env = ddp_comm::EnvConfig::from_env().context("reading the rank's environment")?;
        let device = choose_device(config.device, env.local_rank)?;
        let threads = config
            .threads
            .unwrap_or_else(|| cores_per_rank(env.local_world_size));
        if device == Device::Cpu {
            tch::set_num_threads(threads as i32);
        }
        let data = load_data(&config)?;
        let resume_from = match &config.resume {
            Some(r) => Some(state::resolve(r, config.out.as_deref()).map_err(anyhow::Error::msg)?),
            None => None,
        };
        let batches = config.batch_size * config.accumulate;
        let train_sampler = DistributedSampler::builder(data.train.len(), env.world_size, env.rank)
            .seed(config.seed)
            .build()
            .with_context(|| format!("sharding {} training samples", data.train.len()))?;
        if train_sampler.len() < batches && !config.eval_only {
            bail!(
                "each of the {} ranks gets {} training samples, fewer than one step of \
                 --batch-size {} x --accumulate {}: lower them or use more data",
                env.world_size,
                train_sampler.len(),
                config.batch_size,
                config.accumulate
            );
        }
        let val_sampler = DistributedSampler::builder(data.val.len(), env.world_size, env.rank)
            .shuffle(false)
            .partition(Partition::Exact)
            .build()
            .with_context(|| format!("sharding {} validation samples", data.val.len()))?;

        // Model and checkpoint before meeting the other ranks: a bad checkpoint fails on
        // every rank alike instead of leaving some waiting in a collective.
        tch::manual_seed(config.seed as i64);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let net = ConvNet::new(
            &vs.root(),
            ConvNetConfig {
                num_classes: ODIR_CLASSES.len() as i64,
                dropout: config.dropout,
            },
        );
        let adam_config = AdamConfig {
            lr: config.lr,
            weight_decay: config.weight_decay,
            ..Default::default()
        };
        let plateau = PlateauConfig {
            factor: config.plateau_factor,
            patience: config.plateau_patience,
            min_lr: config.min_lr,
            ..Default::default()
        };
        let mut scheduler = ReduceLrOnPlateau::new(plateau);
        let (mut start_epoch, mut best_macro, mut best_micro) = (1, None, None);
        let mut restored: Option<(TrainState, PathBuf, Adam)> = None;
        let mut resumed_note = None;
        if let (Some(path), true) = (&resume_from, config.eval_only) {
            checkpoint::load(&vs, path)?;
            resumed_note = Some(format!("evaluating {}", path.display()));
        } else if let Some(path) = &resume_from {
            // Loaded on the CPU first, then moved with the model to the rank's device.
            let mut cpu_adam = Adam::new(trainable(&vs), adam_config);
            let st = state::load(path, &vs, &mut cpu_adam).map_err(anyhow::Error::msg)?;
            restored = Some((st, path.clone(), cpu_adam));
        }
        vs.set_device(device);
        let mut adam = Adam::new(trainable(&vs), adam_config);
        if let Some((st, path, cpu_adam)) = restored {
            // The moments were loaded on the CPU with the model; load_state moves them to
            // the parameters' device.
            let moments = cpu_adam.state_tensors().into_iter().collect();
            adam.load_state(&moments, st.adam_steps)
                .map_err(anyhow::Error::msg)?;
            adam.set_lr(st.lr);
            scheduler = st.scheduler.clone();
            start_epoch = st.epoch + 1;
            best_macro = st.best_macro;
            best_micro = st.best_micro;
            resumed_note = Some(format!(
                "resumed from {} (epoch {} done)",
                path.display(),
                st.epoch
            ));
        }
        let opts = ddp_comm::Options::from_config(&env)
            .op_timeout(std::time::Duration::from_secs(config.collective_timeout));
        let pg = Arc::new(ddp_comm::ProcessGroup::new(opts).context("joining the process group")?);
        let rank = pg.rank();

        // Every rank agrees on the run directory: rank 0's choice.
        let proposed = config.out.clone().unwrap_or_else(default_run_dir);
        let gathered = pg.all_gather_bytes(proposed.to_string_lossy().as_bytes())?;
        let out = PathBuf::from(String::from_utf8_lossy(&gathered[0]).into_owned());
        std::fs::create_dir_all(out.join("logs"))
            .with_context(|| format!("cannot create run directory {}", out.display()))?;
        let log = RankLog::open(&out, rank)?;

        if let Some(note) = resumed_note {
            log.say(&note);
        }
        let ddp = DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default())?;
        let history = if rank == 0 {
            read_history(&out, start_epoch)?
        } else {
            Vec::new()
        };
        let trainer = Self {
            config,
            pg,
            device,
            out,
            data,
            vs,
            net,
            ddp,
            adam,
            scheduler,
            start_epoch,
            best_macro,
            best_micro,
            history,
            log,
            train_sampler,
            val_sampler,
        };
        trainer.describe(threads)?;
        Ok(trainer)
    }

    /// The run directory.
    pub fn out_dir(&self) -> &Path {
        &self.out
    }

    fn describe(&self, threads: usize) -> Result<()> {
        let c = &self.config;
        let d = &self.data;
        self.log.say(&format!(
            "rank {} of {} on {:?} ({} intra-op threads, backend {:?})",
            self.pg.rank(),
            self.pg.world_size(),
            self.device,
            threads,
            self.pg.backend()
        ));
        if self.pg.rank() == 0 {
            self.log.say(&format!(
                "data: {} training images ({} per rank per epoch), {} validation images; \
                 batch {} per rank x {} ranks; run directory {}",
                d.train.len(),
                self.train_sampler.len(),
                d.val.len(),
                c.batch_size,
                self.pg.world_size(),
                self.out.display()
            ));
            let json = serde_json::to_string_pretty(&serde_json::json!({
                "config": c,
                "world_size": self.pg.world_size(),
                "backend": format!("{:?}", self.pg.backend()),
                "device": format!("{:?}", self.device),
                "intra_op_threads": threads,
                "train_images": d.train.len(),
                "val_images": d.val.len(),
                "run_dir": self.out,
            }))?;
            write_atomic(&self.out.join("config.json"), json.as_bytes())?;
        }
        Ok(())
    }

    /// Evaluates the loaded model on the validation split; every rank returns the metrics
    /// of the whole split.
    pub fn evaluate_only(&mut self) -> Result<EvalMetrics> {
        let (val_loss, confusion) = self.evaluate(0)?;
        Ok(EvalMetrics {
            val_loss,
            val_macro_f1: confusion.macro_f1(),
            val_micro_f1: confusion.micro_f1(),
            val_f1_per_class: confusion.f1_per_class(),
            tp: confusion.tp,
            fp: confusion.fp,
            fn_: confusion.fn_,
            world_size: self.pg.world_size(),
        })
    }

    /// Trains from the start (or resumed) epoch to `--epochs`, evaluating after each.
    pub fn run(&mut self) -> Result<Vec<EpochMetrics>> {
        let mut all = Vec::new();
        for epoch in self.start_epoch..=self.config.epochs {
            let started = Instant::now();
            let lr = self.adam.lr();
            let (train_loss, images, steps) = self.train_epoch(epoch)?;
            let train_seconds = started.elapsed().as_secs_f64();
            let (val_loss, confusion) = self.evaluate(epoch)?;
            let macro_f1 = confusion.macro_f1();
            let micro_f1 = confusion.micro_f1();
            let new_lr = self.scheduler.step(macro_f1, lr);
            self.adam.set_lr(new_lr);
            let m = EpochMetrics {
                epoch,
                train_loss,
                val_loss,
                val_macro_f1: macro_f1,
                val_micro_f1: micro_f1,
                val_f1_per_class: confusion.f1_per_class(),
                lr,
                images_per_sec: images as f64 / train_seconds.max(1e-9),
                epoch_seconds: started.elapsed().as_secs_f64(),
                steps,
                world_size: self.pg.world_size(),
            };
            if self.pg.rank() == 0 {
                self.finish_epoch(&m, new_lr)?;
            }
            all.push(m);
        }
        Ok(all)
    }

    /// A loader over `indices` of the training set (`train`) or the validation set, whose
    /// batches arrive on this rank's device.
    fn loader(
        &self,
        train: bool,
        epoch: u64,
        indices: Vec<usize>,
        transform: Transform,
    ) -> Result<Loader<OdirImages>> {
        let c = &self.config;
        let default_prefetch = if self.device.is_cuda() { 4 } else { 2 };
        let config = LoaderConfig {
            drop_last: train,
            seed: c.seed,
            epoch,
            workers: c
                .workers
                .unwrap_or_else(|| ddp_data::default_workers(self.pg.local_world_size())),
            prefetch: c.prefetch.unwrap_or(default_prefetch),
            ..LoaderConfig::new(c.batch_size)
        };
        let set = if train {
            &self.data.train_set
        } else {
            &self.data.val_set
        };
        let images = OdirImages::new(set.clone(), transform);
        Ok(Loader::on_device(images, indices, &config, self.device)?)
    }

    /// One epoch of training; returns (mean loss over all ranks' samples, images, steps).
    ///
    /// Each micro-step queues its forward and backward, then takes the next batch (which, on
    /// a GPU, queues that batch's copy behind this step), and only then reads the loss, the
    /// first point where the host waits for the device: the device always has the next
    /// batch's copy queued, and the host waits for the loader while the device computes.
    fn train_epoch(&mut self, epoch: u64) -> Result<(f64, usize, usize)> {
        let c = &self.config;
        let rank = self.pg.rank();
        // The trainer advances the sampler itself: no one can forget set_epoch.
        self.train_sampler.set_epoch(epoch);
        let indices: Vec<usize> = self
            .train_sampler
            .iter()
            .map(|i| self.data.train[i])
            .collect();
        let steps_in_epoch = indices.len() / (c.batch_size * c.accumulate);
        let steps = c
            .max_steps_per_epoch
            .map_or(steps_in_epoch, |m| m.min(steps_in_epoch));
        let transform = Transform::random_resized_crop(
            c.image_size,
            (c.min_crop_scale, 1.0),
            ddp_data::transform::DEFAULT_RATIO,
        )?
        .with_hflip(c.hflip)
        .with_dct_upsampling(c.dct_upsampling)?;
        let indices = indices[..steps * c.batch_size * c.accumulate].to_vec();
        let mut loader = self.loader(true, epoch, indices, transform)?;
        let progress = Progress::new(rank == 0, epoch, c.epochs, steps);
        let (mut loss_sum, mut samples) = (0.0f64, 0usize);
        let started = Instant::now();
        let mut upcoming = loader.next();
        for step in 0..steps {
            fail_if_injected(rank, epoch, step);
            // Dropout masks derive from (seed, epoch, step, rank): a resumed run draws the
            // same ones as an uninterrupted run.
            tch::manual_seed(mix(c.seed, epoch, step as u64, rank as u64));
            self.adam.zero_grad();
            let mut step_loss = 0.0;
            for _ in 0..c.accumulate {
                let batch = take_batch(upcoming)?;
                self.ddp.broadcast_buffers()?;
                let logits = self.net.forward_t(batch.inputs(), true);
                let loss = logits.binary_cross_entropy_with_logits::<Tensor>(
                    batch.targets(),
                    None,
                    None,
                    Reduction::Mean,
                );
                (&loss / c.accumulate as f64).backward();
                upcoming = loader.next();
                let l = loss.double_value(&[]);
                if !l.is_finite() {
                    bail!("rank {rank}: the training loss became {l} at epoch {epoch} step {step}; lower --lr");
                }
                step_loss += l;
                loss_sum += l * batch.len() as f64;
                samples += batch.len();
            }
            self.ddp.sync_gradients()?;
            self.adam.step();
            if c.log_every > 0 && (step + 1) % c.log_every == 0 {
                self.log.say(&format!(
                    "[rank {rank}] epoch {epoch} step {}/{steps} loss {:.4}",
                    step + 1,
                    step_loss / c.accumulate as f64
                ));
            }
            let rate =
                samples as f64 * self.pg.world_size() as f64 / started.elapsed().as_secs_f64();
            progress.step(step + 1, loss_sum / samples.max(1) as f64, rate, &self.log);
        }
        progress.finish();
        let mut totals = Tensor::from_slice(&[loss_sum, samples as f64]);
        self.pg.all_reduce(&mut totals, ReduceOp::Sum)?;
        let totals = Vec::<f64>::try_from(&totals)?;
        Ok((totals[0] / totals[1].max(1.0), totals[1] as usize, steps))
    }

    /// Evaluates on this rank's exact shard of the validation split and combines the counts
    /// of all ranks: the result equals one process evaluating the whole split.
    fn evaluate(&mut self, epoch: u64) -> Result<(f64, Confusion)> {
        let c = &self.config;
        let indices: Vec<usize> = self.val_sampler.iter().map(|i| self.data.val[i]).collect();
        let resize = c.image_size * 8 / 7;
        let transform = Transform::eval(resize, c.image_size)?;
        let mut loader = self.loader(false, epoch, indices, transform)?;
        let classes = ODIR_CLASSES.len();
        let mut confusion = Confusion::new(classes);
        let (mut loss_sum, mut samples) = (0.0f64, 0usize);
        tch::no_grad(|| -> Result<()> {
            for batch in &mut loader {
                let batch = batch?;
                let (x, y) = (batch.inputs(), batch.targets());
                let logits = self.net.forward_t(x, false);
                let loss = logits.binary_cross_entropy_with_logits::<Tensor>(
                    y,
                    None,
                    None,
                    Reduction::Sum,
                );
                loss_sum += loss.double_value(&[]) / classes as f64;
                samples += batch.len();
                confusion.add(&logits, y);
            }
            Ok(())
        })?;
        let mut counts: Vec<f64> = vec![loss_sum, samples as f64];
        counts.extend(confusion.to_vec().iter().map(|&v| v as f64));
        let mut t = Tensor::from_slice(&counts).to_kind(Kind::Double);
        self.pg.all_reduce(&mut t, ReduceOp::Sum)?;
        let totals = Vec::<f64>::try_from(&t)?;
        let merged: Vec<i64> = totals[2..].iter().map(|&v| v.round() as i64).collect();
        Ok((totals[0] / totals[1].max(1.0), Confusion::from_vec(&merged)))
    }

    /// Rank 0's end of an epoch: metrics line, curves, best models, checkpoint.
    fn finish_epoch(&mut self, m: &EpochMetrics, next_lr: f64) -> Result<()> {
        self.log.say(&format!(
            "epoch {}/{}: train loss {:.4}  val loss {:.4}  val macro-F1 {:.3}  micro-F1 {:.3}  \
             lr {:.2e}  {:.1} img/s  {:.1} s",
            m.epoch,
            self.config.epochs,
            m.train_loss,
            m.val_loss,
            m.val_macro_f1,
            m.val_micro_f1,
            m.lr,
            m.images_per_sec,
            m.epoch_seconds
        ));
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.out.join("metrics.jsonl"))
            .context("cannot open metrics.jsonl")?;
        writeln!(f, "{}", serde_json::to_string(m)?)?;
        f.sync_all()?;
        self.history.push(EpochPoint {
            epoch: m.epoch,
            train_loss: m.train_loss,
            val_loss: m.val_loss,
            macro_f1: m.val_macro_f1,
            micro_f1: m.val_micro_f1,
        });
        if let Err(e) = draw_curves(&self.history, &self.out.join("curves.png")) {
            self.log.warn(&e);
        }
        let meta = std::collections::HashMap::from([("epoch".to_owned(), m.epoch.to_string())]);
        if self.best_macro.is_none_or(|b| m.val_macro_f1 > b.value) {
            self.best_macro = Some(Best {
                value: m.val_macro_f1,
                epoch: m.epoch,
            });
            checkpoint::save(&self.vs, self.out.join("best-macro.safetensors"), &meta)?;
        }
        if self.best_micro.is_none_or(|b| m.val_micro_f1 > b.value) {
            self.best_micro = Some(Best {
                value: m.val_micro_f1,
                epoch: m.epoch,
            });
            checkpoint::save(&self.vs, self.out.join("best-micro.safetensors"), &meta)?;
        }
        let st = TrainState {
            epoch: m.epoch,
            adam_steps: self.adam.steps(),
            lr: next_lr,
            scheduler: self.scheduler.clone(),
            best_macro: self.best_macro,
            best_micro: self.best_micro,
            seed: self.config.seed,
            config: serde_json::to_value(&self.config)?,
        };
        let path = state::save(&self.out, &self.vs, &self.adam, &st).map_err(anyhow::Error::msg)?;
        self.log.say(&format!(
            "checkpoint {}; best macro-F1 {:.3} (epoch {}), best micro-F1 {:.3} (epoch {}); curves {}",
            path.display(),
            self.best_macro.map_or(0.0, |b| b.value),
            self.best_macro.map_or(0, |b| b.epoch),
            self.best_micro.map_or(0.0, |b| b.value),
            self.best_micro.map_or(0, |b| b.epoch),
            self.out.join("curves.png").display()
        ));
        Ok(())
    }
}

fn take_batch(next: Option<Result<Batch, ddp_data::DataError>>) -> Result<Batch> {
    match next {
        Some(b) => Ok(b?),
        None => bail!("the loader ended before the epoch's last step"),
    }
}

fn trainable(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .collect();
    v.sort_by(|a, b| crate::ddp::natural_cmp(&a.0, &b.0));
    v
}

/// A well-mixed 63-bit seed from the run seed, epoch, step and rank (SplitMix64 finaliser).
fn mix(seed: u64, epoch: u64, step: u64, rank: u64) -> i64 {
    let mut z = seed;
    for v in [epoch, step, rank] {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15).wrapping_add(v);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
    }
    (z >> 1) as i64
}

fn cores_per_rank(ranks_on_machine: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / ranks_on_machine.max(1)).max(1)
}

fn choose_device(choice: DeviceChoice, local_rank: usize) -> Result<Device> {
    if choice == DeviceChoice::Cpu {
        return Ok(Device::Cpu);
    }
    // rustc links with --as-needed, so libtorch_cuda must be loaded before asking tch.
    let loaded = ddp_comm::cuda::load_torch_cuda().unwrap_or(false);
    let available = loaded && tch::Cuda::is_available();
    match (choice, available) {
        (DeviceChoice::Cuda, false) => bail!(
            "--device cuda: CUDA is not available here ({}); use --device cpu",
            ddp_comm::cuda::no_gpu_reason().unwrap_or_else(|| "no device".into())
        ),
        (_, true) => {
            let count = tch::Cuda::device_count() as usize;
            if local_rank >= count {
                bail!("LOCAL_RANK {local_rank} needs cuda:{local_rank}, but only {count} CUDA devices are visible");
            }
            Ok(Device::Cuda(local_rank))
        }
        (_, false) => Ok(Device::Cpu),
    }
}

fn load_data(c: &TrainConfig) -> Result<Data> {
    let options = OdirOptions {
        labels: match c.labels {
            Labels::Auto => LabelMode::Auto,
            Labels::Eye => LabelMode::PerEye,
            Labels::Patient => LabelMode::Patient,
        },
        skip_corrupt: c.skip_corrupt,
        ..Default::default()
    };
    let open = |dir: &Path| {
        OdirDataset::open(dir, &options)
            .with_context(|| format!("loading ODIR data from {}", dir.display()))
    };
    let train_set = Arc::new(open(&c.data)?);
    if let Some(val_dir) = &c.val_data {
        let val_set = Arc::new(open(val_dir)?);
        let train = ddp_data::all_indices(&train_set)?;
        let val = ddp_data::all_indices(&val_set)?;
        return Ok(Data {
            train_set,
            train,
            val_set,
            val,
        });
    }
    let split = split_by_patient(&train_set, c.val_split, c.seed)?;
    Ok(Data {
        val_set: train_set.clone(),
        train_set,
        train: split.train,
        val: split.val,
    })
}

/// The default run directory: `runs/<UTC date-time>`.
fn default_run_dir() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, mo, d) = civil_from_days(days as i64);
    PathBuf::from("runs").join(format!(
        "{y:04}{mo:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    ))
}

/// Days since 1970-01-01 to (year, month, day), Howard Hinnant's algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// The epochs before `start` from an earlier `metrics.jsonl` (a resumed run keeps them and
/// drops any line of an epoch that will be trained again).
fn read_history(out: &Path, start: u64) -> Result<Vec<EpochPoint>> {
    let path = out.join("metrics.jsonl");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(Vec::new());
    };
    let mut kept_lines = Vec::new();
    let mut points = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let m: EpochMetrics = serde_json::from_str(line).with_context(|| {
            format!(
                "{} holds a line that is not an epoch's metrics",
                path.display()
            )
        })?;
        if m.epoch < start {
            kept_lines.push(line.to_owned());
            points.push(EpochPoint {
                epoch: m.epoch,
                train_loss: m.train_loss,
                val_loss: m.val_loss,
                macro_f1: m.val_macro_f1,
                micro_f1: m.val_micro_f1,
            });
        }
    }
    let mut body = kept_lines.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    write_atomic(&path, body.as_bytes())?;
    Ok(points)
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

/// For the launcher's fault tests: `DDP_TRAIN_FAIL_RANK=r` and `DDP_TRAIN_FAIL_AT=epoch:step`
/// make rank r exit with status 17 at that step, in the first attempt only (a restarted
/// attempt has `TORCHELASTIC_RESTART_COUNT` > 0).
fn fail_if_injected(rank: usize, epoch: u64, step: usize) {
    let var = |k: &str| std::env::var(k).ok();
    let (Some(r), Some(at)) = (var("DDP_TRAIN_FAIL_RANK"), var("DDP_TRAIN_FAIL_AT")) else {
        return;
    };
    let restarted = var("TORCHELASTIC_RESTART_COUNT").is_some_and(|c| c != "0");
    if restarted || r.parse() != Ok(rank) {
        return;
    }
    if at == format!("{epoch}:{step}") {
        eprintln!("rank {rank}: injected failure at epoch {epoch} step {step} (DDP_TRAIN_FAIL_AT)");
        std::process::exit(17);
    }
}

/// A rank's log: printed (rank 0 on stdout, others on stderr prefixed by the launcher) and
/// appended to `<run>/logs/rank-<r>.log`.
#[derive(Debug)]
struct RankLog {
    rank: usize,
    file: std::sync::Mutex<std::fs::File>,
}

impl RankLog {
    fn open(out: &Path, rank: usize) -> Result<Self> {
        let path = out.join("logs").join(format!("rank-{rank}.log"));
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(Self {
            rank,
            file: std::sync::Mutex::new(file),
        })
    }

    fn say(&self, line: &str) {
        if self.rank == 0 {
            println!("{line}");
        } else {
            eprintln!("{line}");
        }
        self.append(line);
    }

    fn warn(&self, line: &str) {
        eprintln!("warning: {line}");
        self.append(&format!("warning: {line}"));
    }

    fn append(&self, line: &str) {
        if let Ok(mut f) = self.file.lock() {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// Rank 0's progress: a bar on a terminal, a plain line every tenth of the epoch otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    plain: bool,
    epoch: u64,
    epochs: u64,
    steps: usize,
}

impl Progress {
    fn new(show: bool, epoch: u64, epochs: u64, steps: usize) -> Self {
        let terminal = show && std::io::stdout().is_terminal();
        let bar = terminal.then(|| {
            let bar = ProgressBar::new(steps as u64);
            bar.set_style(
                ProgressStyle::with_template(
                    "epoch {prefix} [{bar:30}] {pos}/{len} steps  {msg}  eta {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_prefix(format!("{epoch}/{epochs}"));
            bar
        });
        Self {
            bar,
            plain: show && !terminal,
            epoch,
            epochs,
            steps,
        }
    }

    fn step(&self, step: usize, loss: f64, rate: f64, log: &RankLog) {
        if let Some(bar) = &self.bar {
            bar.set_position(step as u64);
            bar.set_message(format!("loss {loss:.4}  {rate:.1} img/s"));
        } else if self.plain
            && (step * 10 / self.steps.max(1) != (step - 1) * 10 / self.steps.max(1))
        {
            log.say(&format!(
                "epoch {}/{} step {step}/{}  loss {loss:.4}  {rate:.1} img/s",
                self.epoch, self.epochs, self.steps
            ));
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_788), (2026, 12, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(11_017), (2000, 3, 1));
    }

    #[test]
    fn step_seeds_differ_by_every_component() {
        let base = mix(1, 2, 3, 4);
        assert_ne!(base, mix(0, 2, 3, 4));
        assert_ne!(base, mix(1, 3, 3, 4));
        assert_ne!(base, mix(1, 2, 4, 4));
        assert_ne!(base, mix(1, 2, 3, 5));
        assert_eq!(base, mix(1, 2, 3, 4));
        assert!(base >= 0);
    }
}
