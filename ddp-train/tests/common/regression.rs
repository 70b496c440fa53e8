//! A small regression `Task` for the tests that train real ranks: an MLP from 4 inputs to 1
//! output, mean squared error, on synthetic points.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use ddp_data::{Batch, TensorDataset};
use ddp_train::{RegressionStats, Settings, Task};
use tch::{nn, nn::Module, Device, Kind, Reduction, Tensor};

/// libtorch's random generator, one per process: [`points`] seeds it and draws from it, and
/// a Trainer seeds it at its start (the model's initial weights) and before each step. The
/// tests of one binary run in parallel threads: two doing this at once draw each other's
/// numbers (other points, another model, a resume that does not continue its run). A test
/// that runs a Trainer in this process, next to others that do, holds it to its end.
static GENERATOR: Mutex<()> = Mutex::new(());

thread_local! {
    /// Whether this thread holds [`GENERATOR`].
    static HOLDS: Cell<bool> = const { Cell::new(false) };
}

/// libtorch's generator, this thread's until dropped ([`hold_generator`]).
pub struct Generator {
    _lock: MutexGuard<'static, ()>,
}

impl Drop for Generator {
    fn drop(&mut self) {
        HOLDS.with(|h| h.set(false));
    }
}

/// Waits until no other test of this process holds libtorch's generator, and keeps them
/// waiting while the result lives.
pub fn hold_generator() -> Generator {
    // A test that failed holding it left nothing half-done: the generator is reseeded.
    let lock = GENERATOR.lock().unwrap_or_else(PoisonError::into_inner);
    HOLDS.with(|h| h.set(true));
    Generator { _lock: lock }
}

/// y = 2 x0 - x1 + 0.5 x2 + 0.1 sin(7 x3) on `count` points of [-1, 1)^4, drawn from
/// libtorch's generator seeded with `seed` (held for the draw if this thread does not hold it).
pub fn points(count: i64, seed: i64) -> TensorDataset {
    let _held = (!HOLDS.with(Cell::get)).then(hold_generator);
    tch::manual_seed(seed);
    let x = Tensor::rand([count, 4], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
    let w = Tensor::from_slice(&[2f32, -1.0, 0.5, 0.0]);
    let y = x.matmul(&w) + (x.select(1, 3) * 7.0).sin() * 0.1;
    TensorDataset::from_tensors(&x, &y.unsqueeze(1)).expect("a valid data set")
}

/// 2 epochs of 16-sample batches with seed 3 into `out`, one thread and one loader worker,
/// nothing drawn, signals left alone: a run in the test's own process.
pub fn quiet_settings(out: &std::path::Path) -> Settings {
    let mut s = Settings::default()
        .epochs(2)
        .batch_size(16)
        .seed(3)
        .out(Some(out.to_path_buf()));
    s.runtime.threads = Some(1);
    s.runtime.workers = Some(1);
    s.runtime.progress = false;
    s.runtime.plot = false;
    s.runtime.stop_on_signals = false;
    s
}

/// The MLP (4 -> 16 -> relu -> 1) on `train`, evaluated on `val` (`None`: not evaluated).
/// Its training loss is the mean squared error times `loss_scale`, plus infinity at the
/// `inf_at`-th call (from 0); its `signal_at`-th call sends this process SIGUSR1 (a stop
/// asked for while it trains); each trained batch takes `train_pause` longer, and each
/// evaluated batch `eval_pause`. `description` is what `config.json` records of it
/// (`Task::describe`).
pub struct Regression {
    pub train: TensorDataset,
    pub val: Option<TensorDataset>,
    pub loss_scale: f64,
    pub inf_at: Option<usize>,
    pub signal_at: Option<usize>,
    pub train_pause: Duration,
    pub eval_pause: Duration,
    pub description: serde_json::Value,
    calls: AtomicUsize,
}

impl Regression {
    /// The plain task: loss scale 1, never infinite, no signal, no pauses.
    pub fn new(train: TensorDataset, val: TensorDataset) -> Self {
        Regression {
            train,
            val: Some(val),
            loss_scale: 1.0,
            inf_at: None,
            signal_at: None,
            train_pause: Duration::ZERO,
            eval_pause: Duration::ZERO,
            description: serde_json::Value::Null,
            calls: AtomicUsize::new(0),
        }
    }
}

impl Task for Regression {
    type Model = nn::Sequential;
    type Data = TensorDataset;
    type Stats = RegressionStats;

    fn model(&self, root: &nn::Path) -> nn::Sequential {
        nn::seq()
            .add(nn::linear(root / "0", 4, 16, Default::default()))
            .add_fn(|x| x.relu())
            .add(nn::linear(root / "2", 16, 1, Default::default()))
    }

    fn train_data(&self) -> TensorDataset {
        self.train.clone()
    }

    fn val_data(&self) -> Option<TensorDataset> {
        self.val.clone()
    }

    fn train_loss(&self, model: &nn::Sequential, batch: &Batch) -> Tensor {
        std::thread::sleep(self.train_pause);
        let loss = model
            .forward(batch.inputs())
            .mse_loss(batch.targets(), Reduction::Mean)
            * self.loss_scale;
        let call = self.calls.fetch_add(1, Ordering::Relaxed);
        if self.signal_at == Some(call) {
            // SAFETY: raise(3) takes a signal number and touches no memory of ours.
            assert_eq!(unsafe { libc::raise(libc::SIGUSR1) }, 0);
        }
        if self.inf_at == Some(call) {
            loss + f64::INFINITY
        } else {
            loss
        }
    }

    fn describe(&self) -> serde_json::Value {
        self.description.clone()
    }

    fn new_stats(&self) -> RegressionStats {
        RegressionStats::default()
    }

    fn eval_batch(&self, model: &Self::Model, batch: &Batch, stats: &mut Self::Stats) -> Tensor {
        std::thread::sleep(self.eval_pause);
        let predictions = model.forward(batch.inputs());
        stats.add(&predictions, batch.targets());
        predictions.mse_loss(batch.targets(), Reduction::Sum)
    }
}
