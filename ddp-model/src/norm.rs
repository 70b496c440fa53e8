//! [`BatchNorm2d`]: PyTorch's `nn.BatchNorm2d` with its state-dict names, running statistics
//! updated as PyTorch updates them, and batch statistics that can be taken over every rank
//! (`nn.SyncBatchNorm`) through a [`StatsReducer`] that the training side provides.
//!
//! This crate knows nothing of ranks: a reducer is any differentiable sum over the
//! replicas. [`BatchNormLayers::collect`] finds the layers a model builds, so that a trainer
//! can switch them all to synchronised statistics, as `convert_sync_batchnorm` does.

use std::cell::RefCell;
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};

use tch::nn::{self, Init};
use tch::{Kind, TchError, Tensor};

/// A differentiable sum over the ranks that train one model: the communication a
/// synchronised [`BatchNorm2d`] needs, without this crate knowing how ranks talk.
///
/// [`StatsReducer::all_reduce_sum`] must be differentiable: its backward pass is the same sum
/// of the incoming gradients over the ranks (PyTorch's
/// `torch.distributed.nn.functional.all_reduce`). Every rank calls it in the same order.
pub trait StatsReducer: Send + Sync + fmt::Debug {
    /// This rank's index in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// The element-wise sum of every rank's `t` (same shape everywhere), as a new tensor
    /// that autograd differentiates by summing the gradients over the ranks.
    ///
    /// A forward pass cannot return an error, so an implementation that fails to
    /// communicate returns `t` itself (this rank's statistics alone) and reports the failure
    /// through its own channel, for its caller to stop before the optimizer step.
    fn all_reduce_sum(&self, t: &Tensor) -> Tensor;
}

/// The reducer a layer uses in training, shared with the [`BatchNormLayers`] that found it.
type SyncCell = Arc<RwLock<Option<Arc<dyn StatsReducer>>>>;

/// Hyper-parameters of [`BatchNorm2d`]; the default is PyTorch's.
#[derive(Debug, Clone, Copy)]
pub struct BatchNormConfig {
    /// Added to the variance before its square root (PyTorch's `eps`, 1e-5).
    pub eps: f64,
    /// Weight of the newest batch in the running statistics (PyTorch's `momentum`, 0.1);
    /// `None` averages all batches so far (`1 / num_batches_tracked`).
    pub momentum: Option<f64>,
    /// Initial `weight` (PyTorch: ones). `bias` starts at zero.
    pub weight_init: Init,
}

impl Default for BatchNormConfig {
    fn default() -> Self {
        Self {
            eps: 1e-5,
            momentum: Some(0.1),
            weight_init: Init::Const(1.0),
        }
    }
}

/// `nn.BatchNorm2d(channels)` over inputs `[N, C, ...]`, with the variables `weight` and
/// `bias` (trainable) and the buffers `running_mean`, `running_var` and
/// `num_batches_tracked` (int64), so that a PyTorch state dict loads by name.
///
/// In training, the batch's mean and biased variance normalise the input and the running
/// statistics move towards the mean and the *unbiased* variance by `momentum`, and
/// `num_batches_tracked` counts the batch, as in PyTorch. With a [`StatsReducer`] of more
/// than one rank ([`BatchNorm2d::set_sync`], or [`BatchNormLayers::synchronise`]), the batch
/// is every rank's batch together (PyTorch's `SyncBatchNorm`): each rank's count, mean and
/// sum of squared deviations are summed over the ranks, combined exactly (Chan's parallel
/// variance), and the gradients flow back through that sum to every rank's input.
/// Evaluation uses the running statistics and never communicates.
///
/// ```
/// use ddp_model::norm::BatchNorm2d;
/// use tch::{nn, Device, Kind, Tensor};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let bn = BatchNorm2d::new(vs.root() / "bn", 4);
/// let x = Tensor::randn([8, 4, 5, 5], (Kind::Float, Device::Cpu)) * 3.0 + 1.0;
/// let y = bn.forward_t(&x, true);
/// // Normalised per channel: mean 0, biased variance 1 (up to eps).
/// let mean = y.mean_dim([0, 2, 3].as_slice(), false, Kind::Float);
/// assert!(mean.abs().max().double_value(&[]) < 1e-5);
/// assert_eq!(vs.variables()["bn.num_batches_tracked"].int64_value(&[]), 1);
/// ```
pub struct BatchNorm2d {
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    num_batches_tracked: Tensor,
    channels: i64,
    config: BatchNormConfig,
    sync: SyncCell,
    /// The variables' path (`features.1`), for errors.
    name: String,
}

impl fmt::Debug for BatchNorm2d {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchNorm2d")
            .field("channels", &self.channels)
            .field("config", &self.config)
            .field("synchronised", &self.is_synchronised())
            .finish_non_exhaustive()
    }
}

impl BatchNorm2d {
    /// `nn.BatchNorm2d(channels)` with PyTorch's defaults, its variables under `path`.
    pub fn new(path: nn::Path, channels: i64) -> Self {
        Self::with_config(path, channels, BatchNormConfig::default())
    }

    /// As [`BatchNorm2d::new`], with the given hyper-parameters.
    pub fn with_config(path: nn::Path, channels: i64, config: BatchNormConfig) -> Self {
        // The order tch's `nn::batch_norm2d` creates them in, so that models built on it
        // draw the same initial weights.
        let weight = path.var("weight", &[channels], config.weight_init);
        let bias = path.var("bias", &[channels], Init::Const(0.0));
        let running_mean = path.zeros_no_train("running_mean", &[channels]);
        let running_var = path.ones_no_train("running_var", &[channels]);
        let num_batches_tracked = path.add(
            "num_batches_tracked",
            Tensor::zeros([], (Kind::Int64, path.device())),
            false,
        );
        let sync: SyncCell = Arc::new(RwLock::new(None));
        let name = path.components().collect::<Vec<_>>().join(".");
        COLLECTORS.with(|c| {
            if let Some(top) = c.borrow_mut().last_mut() {
                top.push((name.clone(), sync.clone()));
            }
        });
        Self {
            weight,
            bias,
            running_mean,
            running_var,
            num_batches_tracked,
            channels,
            config,
            sync,
            name,
        }
    }

    /// Takes training statistics over every rank through `reducer` from now on (`None`:
    /// this rank's batch alone, the default).
    pub fn set_sync(&self, reducer: Option<Arc<dyn StatsReducer>>) {
        *self.sync.write().unwrap_or_else(PoisonError::into_inner) = reducer;
    }

    /// Whether training statistics are taken over the ranks of a reducer.
    pub fn is_synchronised(&self) -> bool {
        self.sync
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// The number of channels.
    pub fn channels(&self) -> i64 {
        self.channels
    }

    /// The layer's hyper-parameters.
    pub fn config(&self) -> BatchNormConfig {
        self.config
    }

    /// Normalises `x` (`[N, C, ...]`): with the batch's statistics (updating the running
    /// ones) when `train` is set, as `model.train()` does, else with the running statistics.
    ///
    /// # Panics
    ///
    /// Where [`BatchNorm2d::f_forward_t`] fails, as tch's tensor operations do on a shape
    /// they cannot take: a training batch of one value per channel, a wrong channel count.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        self.f_forward_t(x, train).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`BatchNorm2d::forward_t`], failing instead of panicking. An input that is not
    /// `[N, C, ...]` with the layer's `C` fails, and so does training on one value per
    /// channel (`[1, C, 1, 1]`) without other ranks, with PyTorch's "Expected more than 1
    /// value per channel when training" (the unbiased variance of one value would put NaN
    /// into `running_var`). A call that fails changes nothing, `num_batches_tracked`
    /// included.
    pub fn f_forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor, TchError> {
        let size = x.size();
        if size.get(1) != Some(&self.channels) {
            return Err(TchError::Shape(format!(
                "BatchNorm2d '{}': expected an input [N, {}, ...] ({} channels), got input \
                 size {size:?}",
                self.name, self.channels, self.channels
            )));
        }
        if !train {
            return self.plain(x, false, 0.0);
        }
        let reducer = self
            .sync
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .filter(|r| r.world_size() > 1);
        let per_channel: i64 = size
            .iter()
            .enumerate()
            .filter(|(d, _)| *d != 1)
            .map(|(_, n)| n)
            .product();
        if reducer.is_none() && per_channel == 1 {
            return Err(TchError::Shape(format!(
                "BatchNorm2d '{}': Expected more than 1 value per channel when training, got \
                 input size {size:?}",
                self.name
            )));
        }
        // This batch counted: the cumulative average's weight is 1 / (batches so far + 1).
        let factor = match self.config.momentum {
            Some(m) => m,
            None => 1.0 / (self.num_batches_tracked.int64_value(&[]) + 1) as f64,
        };
        let y = match reducer {
            Some(r) => self.synchronised(x, r.as_ref(), factor),
            // One rank is its own batch: PyTorch's SyncBatchNorm falls back the same way.
            None => self.plain(x, true, factor),
        }?;
        tch::no_grad(|| {
            let _ = self.num_batches_tracked.shallow_clone().g_add_scalar_(1);
        });
        Ok(y)
    }

    /// libtorch's own batch norm (the one `nn::batch_norm2d` calls).
    fn plain(&self, x: &Tensor, train: bool, factor: f64) -> Result<Tensor, TchError> {
        Tensor::f_batch_norm(
            x,
            Some(&self.weight),
            Some(&self.bias),
            Some(&self.running_mean),
            Some(&self.running_var),
            train,
            factor,
            self.config.eps,
            true,
        )
    }

    /// Training statistics over every rank of `r`: per rank (count, mean, sum of squared
    /// deviations) in that rank's row of a `[world, 2C + 1]` table, summed over the ranks
    /// (which gathers the rows), then combined as Chan et al. combine partial variances.
    /// `x` is `[N, C, ...]` with the layer's `C` (checked by the caller); a reducer whose
    /// rank, world or sum does not fit the table is an error.
    fn synchronised(
        &self,
        x: &Tensor,
        r: &dyn StatsReducer,
        factor: f64,
    ) -> Result<Tensor, TchError> {
        let c = self.channels;
        // PyTorch's `batch_norm_stats` accumulate type: f64 for f64, else f32.
        let acc = if x.kind() == Kind::Double {
            Kind::Double
        } else {
            Kind::Float
        };
        let xf = x.to_kind(acc);
        let dims: Vec<i64> = (0..xf.dim() as i64).filter(|&d| d != 1).collect();
        let mut shape = vec![1i64; xf.dim()];
        shape[1] = c;
        let count = (xf.numel() as i64 / c.max(1)) as f64;
        let opts = (acc, xf.device());
        // An empty batch sends zeros with a count of 0, which drop out of the sums below (the
        // mean of nothing would be NaN for every rank), as PyTorch's SyncBatchNorm does. The
        // zeros are sums over the empty input, so that they stay in the graph and this rank
        // joins the backward all-reduce of the statistics with the others.
        let (mean, m2) = if count > 0.0 {
            let mean = xf.mean_dim(dims.as_slice(), false, acc);
            let m2 = (&xf - mean.view(shape.as_slice()))
                .square()
                .sum_dim_intlist(dims.as_slice(), false, acc);
            (mean, m2)
        } else {
            let nothing = xf.sum_dim_intlist(dims.as_slice(), false, acc);
            (nothing.shallow_clone(), nothing)
        };
        let width = 2 * c + 1;
        let (rank, world) = (r.rank() as i64, r.world_size() as i64);
        let row = Tensor::f_cat(
            &[
                Tensor::f_zeros([rank * width], opts)?,
                mean,
                m2,
                Tensor::full([1], count, opts),
                Tensor::f_zeros([(world - rank - 1) * width], opts)?,
            ],
            0,
        )?
        .f_view([world, width])?;
        let table = r.all_reduce_sum(&row);
        let means = table.f_narrow(1, 0, c)?;
        let m2s = table.f_narrow(1, c, c)?;
        let counts = table.f_narrow(1, 2 * c, 1)?;
        let total = counts.sum(acc);
        // Every rank empty: no statistics (0, not 0/0), and the running ones stay as they are.
        let samples = total.clamp_min(1.0);
        let mean = (&means * &counts).sum_dim_intlist(0, false, acc) / &samples;
        let m2 = m2s.sum_dim_intlist(0, false, acc)
            + (&counts * (&means - &mean).square()).sum_dim_intlist(0, false, acc);
        let var = &m2 / &samples;
        tch::no_grad(|| {
            let unbiased = &m2 / (&total - 1.0).clamp_min(1.0);
            let any = total.gt(0.0);
            for (running, batch) in [
                (&self.running_mean, mean.detach()),
                (&self.running_var, unbiased),
            ] {
                let mut running = running.shallow_clone();
                let moved = &running * (1.0 - factor) + batch.to_kind(running.kind()) * factor;
                running.copy_(&moved.where_self(&any, &running));
            }
        });
        let scale = (var + self.config.eps).rsqrt() * &self.weight;
        let y = (&xf - mean.view(shape.as_slice())) * scale.view(shape.as_slice())
            + self.bias.view(shape.as_slice());
        Ok(y.to_kind(x.kind()))
    }
}

impl nn::ModuleT for BatchNorm2d {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        BatchNorm2d::forward_t(self, xs, train)
    }
}

thread_local! {
    /// The open [`BatchNormLayers::collect`] calls of this thread, innermost last.
    static COLLECTORS: RefCell<Vec<Vec<(String, SyncCell)>>> = const { RefCell::new(Vec::new()) };
}

/// The [`BatchNorm2d`] layers a model built, found without walking the model: what
/// `convert_sync_batchnorm` converts.
///
/// ```
/// use std::sync::Arc;
/// use ddp_model::norm::BatchNormLayers;
/// use ddp_model::{ConvNet, ConvNetConfig};
/// use tch::{nn, Device};
///
/// let vs = nn::VarStore::new(Device::Cpu);
/// let (net, layers) = BatchNormLayers::collect(|| ConvNet::new(&vs.root(), ConvNetConfig::default()));
/// assert_eq!(layers.names(), ["features.1", "features.5", "features.9", "features.13"]);
/// # let _ = net;
/// ```
#[derive(Clone, Default)]
pub struct BatchNormLayers {
    layers: Vec<(String, SyncCell)>,
}

impl fmt::Debug for BatchNormLayers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl BatchNormLayers {
    /// Runs `build` (which creates a model) on this thread and returns what it returns with
    /// every [`BatchNorm2d`] created meanwhile, in creation order. Calls may nest: a layer
    /// belongs to the innermost.
    pub fn collect<R>(build: impl FnOnce() -> R) -> (R, Self) {
        struct Pop;
        impl Drop for Pop {
            fn drop(&mut self) {
                COLLECTORS.with(|c| {
                    c.borrow_mut().pop();
                });
            }
        }
        COLLECTORS.with(|c| c.borrow_mut().push(Vec::new()));
        let pop = Pop;
        let built = build();
        let layers = COLLECTORS.with(|c| c.borrow_mut().last_mut().map(std::mem::take));
        drop(pop);
        (
            built,
            Self {
                layers: layers.unwrap_or_default(),
            },
        )
    }

    /// The layers' variable paths (`features.1`, ...).
    pub fn names(&self) -> Vec<&str> {
        self.layers.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// The number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether the model has no [`BatchNorm2d`].
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Switches every layer to statistics over the ranks of `reducer` (`None`: back to each
    /// rank's own batch).
    pub fn synchronise(&self, reducer: Option<Arc<dyn StatsReducer>>) {
        for (_, cell) in &self.layers {
            *cell.write().unwrap_or_else(PoisonError::into_inner) = reducer.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) {
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= tol, "{what} differs by {d}");
    }

    /// A world of one rank through the synchronised formula: the sum over ranks is the
    /// identity, so the formula itself is checked against libtorch's batch norm (outputs,
    /// gradients of input, weight and bias, running statistics).
    #[derive(Debug)]
    struct Alone;

    impl StatsReducer for Alone {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            1
        }
        fn all_reduce_sum(&self, t: &Tensor) -> Tensor {
            t.shallow_clone()
        }
    }

    #[test]
    fn synchronised_formula_equals_libtorch_on_one_rank() {
        tch::manual_seed(3);
        let make = || {
            let vs = nn::VarStore::new(Device::Cpu);
            let bn = BatchNorm2d::new(vs.root() / "bn", 3);
            tch::no_grad(|| {
                bn.weight
                    .shallow_clone()
                    .copy_(&Tensor::from_slice(&[0.5f32, 2.0, -1.0]));
                bn.bias
                    .shallow_clone()
                    .copy_(&Tensor::from_slice(&[0.1f32, 0.0, 3.0]));
            });
            (vs, bn)
        };
        let (vs_a, a) = make();
        let (vs_b, b) = make();
        let x = (Tensor::randn([4, 3, 5, 6], (Kind::Float, Device::Cpu)) * 2.0 + 0.7)
            .set_requires_grad(true);
        let w = Tensor::randn([4, 3, 5, 6], (Kind::Float, Device::Cpu));
        let ya = a.forward_t(&x, true);
        (&ya * &w).sum(Kind::Float).backward();
        let gxa = x.grad().copy();
        let _ = x.grad().zero_();
        let yb = b.synchronised(&x, &Alone, 0.1).unwrap();
        let _ = b.num_batches_tracked.shallow_clone().g_add_scalar_(1);
        (&yb * &w).sum(Kind::Float).backward();
        assert_close(&ya, &yb, 1e-5, "output");
        assert_close(&gxa, &x.grad(), 1e-5, "input gradient");
        let (va, vb) = (vs_a.variables(), vs_b.variables());
        for name in ["bn.running_mean", "bn.running_var"] {
            assert_close(&va[name], &vb[name], 1e-6, name);
        }
        for name in ["bn.weight", "bn.bias"] {
            assert_close(&va[name].grad(), &vb[name].grad(), 1e-4, name);
        }
        assert_eq!(vb["bn.num_batches_tracked"].int64_value(&[]), 1);
    }

    /// A double-precision layer keeps its statistics in double, as PyTorch's does: on one
    /// rank they equal libtorch's batch norm in f64 to 1e-12.
    #[test]
    fn double_statistics_stay_double() {
        let make = || {
            let mut vs = nn::VarStore::new(Device::Cpu);
            let bn = BatchNorm2d::new(vs.root() / "bn", 3);
            vs.double();
            (vs, bn)
        };
        let (vs_a, a) = make();
        let (vs_b, b) = make();
        let x = Tensor::randn([4, 3, 5, 6], (Kind::Double, Device::Cpu)) * 1e3 + 1e4;
        let ya = a.forward_t(&x, true);
        let yb = b.synchronised(&x, &Alone, 0.1).unwrap();
        assert_eq!(yb.kind(), Kind::Double);
        assert_close(&ya, &yb, 1e-9, "output");
        let (va, vb) = (vs_a.variables(), vs_b.variables());
        for name in ["bn.running_mean", "bn.running_var"] {
            assert_eq!(vb[name].kind(), Kind::Double);
            let scale = va[name].abs().max().double_value(&[]);
            assert_close(&va[name], &vb[name], 1e-12 * scale, name);
        }
    }

    /// Rank `rank` of two whose peer's row of the table is `peer`; keeps what it sent.
    #[derive(Debug)]
    struct Pair {
        rank: usize,
        peer: Vec<f32>,
        sent: std::sync::Mutex<Vec<f32>>,
    }

    impl StatsReducer for Pair {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            2
        }
        fn all_reduce_sum(&self, t: &Tensor) -> Tensor {
            *self.sent.lock().unwrap() = Vec::try_from(&t.flatten(0, -1)).unwrap();
            t + Tensor::from_slice(&self.peer).view(t.size().as_slice())
        }
    }

    /// Rank 0's batch is empty, rank 1's is not: both ranks normalise with rank 1's
    /// statistics alone, exactly as one process would, and nothing becomes NaN.
    #[test]
    fn an_empty_batch_on_one_rank_drops_out_of_the_statistics() {
        tch::manual_seed(4);
        let x = Tensor::randn([4, 3, 5, 6], (Kind::Float, Device::Cpu)) * 2.0 + 0.7;
        let empty = Tensor::zeros([0, 3, 5, 6], (Kind::Float, Device::Cpu));
        let vs_ref = nn::VarStore::new(Device::Cpu);
        let alone = BatchNorm2d::new(vs_ref.root(), 3);
        let want = alone.forward_t(&x, true);
        // One rank's forward with the peer's row given; returns what it sent.
        let run = |rank: usize, input: &Tensor, peer: Vec<f32>| {
            let vs = nn::VarStore::new(Device::Cpu);
            let bn = BatchNorm2d::new(vs.root(), 3);
            let pair = Arc::new(Pair {
                rank,
                peer,
                sent: Default::default(),
            });
            bn.set_sync(Some(pair.clone()));
            let y = bn.forward_t(input, true);
            let sent = std::mem::take(&mut *pair.sent.lock().unwrap());
            (vs, y, sent)
        };
        let (_, _, row1) = run(1, &x, vec![0.0; 14]);
        let (vs0, y0, row0) = run(0, &empty, row1);
        assert_eq!(y0.size(), [0, 3, 5, 6]);
        assert_eq!(row0, [0.0; 14], "an empty rank sends zeros");
        // Every rank empty: nothing to learn, the running statistics stay as they were.
        let (vs_none, y_none, _) = run(1, &empty, vec![0.0; 14]);
        assert_eq!(y_none.size(), [0, 3, 5, 6]);
        assert_eq!(
            Vec::<f32>::try_from(&vs_none.variables()["running_mean"]).unwrap(),
            [0.0; 3]
        );
        assert_eq!(
            Vec::<f32>::try_from(&vs_none.variables()["running_var"]).unwrap(),
            [1.0; 3]
        );
        let (vs1, y1, _) = run(1, &x, row0);
        assert_close(&y1, &want, 1e-5, "output");
        for name in ["running_mean", "running_var"] {
            let r = &vs_ref.variables()[name];
            assert_close(&vs0.variables()[name], r, 1e-6, name);
            assert_close(&vs1.variables()[name], r, 1e-6, name);
        }
    }

    #[test]
    fn running_statistics_follow_pytorch() {
        let vs = nn::VarStore::new(Device::Cpu);
        let bn = BatchNorm2d::new(vs.root(), 1);
        // One channel, values 1..=4: mean 2.5, unbiased variance 5/3.
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([4, 1, 1, 1]);
        let _ = bn.forward_t(&x, true);
        let v = vs.variables();
        assert!((v["running_mean"].double_value(&[0]) - 0.25).abs() < 1e-6);
        let want = 0.9 + 0.1 * 5.0 / 3.0;
        assert!((v["running_var"].double_value(&[0]) - want).abs() < 1e-6);
        assert_eq!(v["num_batches_tracked"].kind(), Kind::Int64);
        assert!(!v["num_batches_tracked"].requires_grad());
        let y = bn.forward_t(&x, false);
        let expect = (x - 0.25) / (want + 1e-5).sqrt();
        assert_close(&y, &expect, 1e-6, "evaluation output");
    }

    #[test]
    fn cumulative_average_without_momentum() {
        let vs = nn::VarStore::new(Device::Cpu);
        let config = BatchNormConfig {
            momentum: None,
            ..Default::default()
        };
        let bn = BatchNorm2d::with_config(vs.root(), 1, config);
        for v in [2.0f32, 4.0] {
            let _ = bn.forward_t(&Tensor::from_slice(&[v, v]).view([2, 1, 1, 1]), true);
        }
        // Averages of the batch means 2 and 4: 1/1 then 1/2.
        assert!((vs.variables()["running_mean"].double_value(&[0]) - 3.0).abs() < 1e-6);
    }

    #[test]
    fn training_on_one_value_per_channel_is_refused_as_in_pytorch() {
        let vs = nn::VarStore::new(Device::Cpu);
        let bn = BatchNorm2d::new(vs.root() / "layer4" / 1 / "bn2", 3);
        let one = Tensor::randn([1, 3, 1, 1], (Kind::Float, Device::Cpu));
        let expected = "BatchNorm2d 'layer4.1.bn2': Expected more than 1 value per channel when \
                        training, got input size [1, 3, 1, 1]";
        let panicked =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bn.forward_t(&one, true)))
                .expect_err("one value per channel was normalised");
        let message = panicked
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(message.ends_with(expected), "{message}");
        // A world of one rank is its own batch: refused the same way.
        bn.set_sync(Some(Arc::new(Alone)));
        let err = bn.f_forward_t(&one, true).unwrap_err();
        assert!(err.to_string().ends_with(expected), "{err}");
        // Nothing changed: no NaN in running_var, no batch counted.
        let vars = vs.variables();
        assert_eq!(
            Vec::<f32>::try_from(&vars["layer4.1.bn2.running_var"]).unwrap(),
            [1.0; 3]
        );
        assert_eq!(vars["layer4.1.bn2.num_batches_tracked"].int64_value(&[]), 0);
        // Evaluation, two samples, or two pixels are fine.
        bn.set_sync(None);
        assert!(bn.f_forward_t(&one, false).is_ok());
        for shape in [[2, 3, 1, 1], [1, 3, 2, 1]] {
            let y = bn.f_forward_t(&Tensor::randn(shape, (Kind::Float, Device::Cpu)), true);
            assert_eq!(y.unwrap().size(), shape);
        }
        assert_eq!(vars["layer4.1.bn2.num_batches_tracked"].int64_value(&[]), 2);
        assert_eq!(
            vars["layer4.1.bn2.running_var"]
                .isnan()
                .any()
                .int64_value(&[]),
            0
        );
    }

    /// A batch that is not `[N, C, ...]` with the layer's `C` is an error, synchronised or
    /// not, in training or evaluation, and leaves the layer as it was.
    #[test]
    fn an_input_of_the_wrong_shape_is_an_error_that_changes_nothing() {
        let vs = nn::VarStore::new(Device::Cpu);
        let bn = BatchNorm2d::new(vs.root() / "features" / 1, 4);
        let vars = vs.variables();
        let tracked = || vars["features.1.num_batches_tracked"].int64_value(&[]);
        let running_mean = || Vec::<f32>::try_from(&vars["features.1.running_mean"]).unwrap();
        let randn = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, Device::Cpu));
        // Rank 0 of two, its peer sending zeros: the sum is this rank's row.
        let pair = || -> Arc<dyn StatsReducer> {
            Arc::new(Pair {
                rank: 0,
                peer: vec![0.0; 18],
                sent: Default::default(),
            })
        };
        bn.set_sync(Some(pair()));
        for sync in [true, false] {
            if !sync {
                bn.set_sync(None);
            }
            for (shape, got) in [
                (&[2, 3, 4, 4][..], "[2, 3, 4, 4]"),
                (&[8][..], "[8]"),
                (&[][..], "[]"),
            ] {
                let expected = format!(
                    "BatchNorm2d 'features.1': expected an input [N, 4, ...] (4 channels), got \
                     input size {got}"
                );
                for train in [true, false] {
                    let err = bn.f_forward_t(&randn(shape), train).unwrap_err();
                    assert!(
                        matches!(&err, TchError::Shape(m) if *m == expected),
                        "sync {sync}, train {train}: {err:?}"
                    );
                }
            }
            assert_eq!(tracked(), 0, "sync {sync}");
            assert_eq!(running_mean(), [0.0; 4], "sync {sync}");
        }
        // The right shape is counted, synchronised or not.
        let x = randn(&[2, 4, 3, 3]) + 1.0;
        assert_eq!(bn.f_forward_t(&x, true).unwrap().size(), [2, 4, 3, 3]);
        bn.set_sync(Some(pair()));
        assert_eq!(bn.f_forward_t(&x, true).unwrap().size(), [2, 4, 3, 3]);
        assert_eq!(tracked(), 2);
        assert!(running_mean().iter().all(|&m| m != 0.0));
    }

    /// A reducer whose sum is not the table it was given is an error, not a panic, and
    /// counts no batch.
    #[test]
    fn a_reducer_returning_the_wrong_shape_is_an_error() {
        #[derive(Debug)]
        struct Flat;
        impl StatsReducer for Flat {
            fn rank(&self) -> usize {
                0
            }
            fn world_size(&self) -> usize {
                2
            }
            fn all_reduce_sum(&self, t: &Tensor) -> Tensor {
                t.flatten(0, -1)
            }
        }
        let vs = nn::VarStore::new(Device::Cpu);
        let bn = BatchNorm2d::new(vs.root(), 4);
        bn.set_sync(Some(Arc::new(Flat)));
        let x = Tensor::randn([2, 4, 3, 3], (Kind::Float, Device::Cpu));
        let err = bn.f_forward_t(&x, true).unwrap_err();
        assert!(matches!(err, TchError::Torch(_)), "{err:?}");
        assert_eq!(vs.variables()["num_batches_tracked"].int64_value(&[]), 0);
    }

    #[test]
    fn collect_finds_nested_layers_in_the_innermost_call() {
        let vs = nn::VarStore::new(Device::Cpu);
        let root = vs.root();
        let ((inner, a), outer) = BatchNormLayers::collect(|| {
            let _first = BatchNorm2d::new(&root / "a", 2);
            BatchNormLayers::collect(|| BatchNorm2d::new(&root / "b" / 0, 2))
        });
        let _ = inner;
        assert_eq!(a.names(), ["b.0"]);
        assert_eq!(outer.names(), ["a"]);
        let _outside = BatchNorm2d::new(&root / "c", 2);
        assert!(COLLECTORS.with(|c| c.borrow().is_empty()));
        a.synchronise(Some(Arc::new(Alone)));
        assert!(inner.is_synchronised());
        a.synchronise(None);
        assert!(!inner.is_synchronised());
    }
}
