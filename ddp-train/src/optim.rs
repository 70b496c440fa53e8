//! Adam and SGD with state that can be checkpointed.
//!
//! tch's optimizers live in C++ and do not expose their moments or momentum buffers, so a
//! resumed run could not continue exactly where it stopped; these two are written here for
//! that reason. [`Adam`] is `torch.optim.Adam` (not AdamW: weight decay is L2 added to the
//! gradient; no amsgrad), step for step:
//!
//! ```text
//! t += 1                                                   # per parameter, see below
//! g  = grad + weight_decay * param
//! m  = lerp(m, g, 1 - beta1)                               # m + (1 - beta1) * (g - m)
//! v  = beta2 * v + (1 - beta2) * g * g
//! param -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```
//!
//! As in PyTorch, `t` counts the steps in which *that parameter* had a gradient: a branch
//! first used at step 100 starts with `t = 1` (PyTorch keeps `state['step']` per parameter),
//! which matters once DDP lets parameters go unused (`find_unused_parameters`).
//!
//! [`Adam::decoupled`] is `torch.optim.AdamW`: `param *= 1 - lr * weight_decay` first, and
//! `g = grad`.
//!
//! [`Sgd`] is `torch.optim.SGD` without dampening or Nesterov:
//!
//! ```text
//! g = grad + weight_decay * param
//! b = g (first step), momentum * b + g (later steps)      # only when momentum != 0
//! param -= lr * b   (or lr * g without momentum)
//! ```
//!
//! Both step as PyTorch's foreach code paths do (`_multi_tensor_adam`, `_multi_tensor_sgd`:
//! one `_foreach_*` kernel per operation over all parameters, through `tch-ext`), whose
//! arithmetic per element is that of the single-tensor paths, so they round as PyTorch does.
//!
//! [`Optimizer`] is either, as the Trainer holds it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// A checkpointed optimizer state that does not fit the parameters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OptimStateError {
    /// A tensor of the state is not in the checkpoint.
    #[error("'{0}' is missing")]
    Missing(String),
    /// A tensor has another shape than its parameter.
    #[error("'{name}' has shape {found:?} but the parameter has {expected:?}")]
    Shape {
        /// The state tensor's name.
        name: String,
        /// Its shape in the checkpoint.
        found: Vec<i64>,
        /// The parameter's shape.
        expected: Vec<i64>,
    },
    /// A parameter's step count is negative or above the optimizer's.
    #[error("'{name}' is {found}, outside 0..={steps} (the optimizer's steps)")]
    StepCount {
        /// The step count's name (`step.<param>`).
        name: String,
        /// Its value in the checkpoint.
        found: i64,
        /// The optimizer's step count.
        steps: i64,
    },
}

/// Which optimizer the Trainer uses, and its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimizerConfig {
    /// [`Adam`].
    Adam(AdamConfig),
    /// [`Adam`] with decoupled weight decay (`torch.optim.AdamW`): `weight_decay` shrinks
    /// the weights by `lr * weight_decay` each step instead of entering the gradient.
    #[serde(rename = "adamw")]
    AdamW(AdamConfig),
    /// [`Sgd`].
    Sgd(SgdConfig),
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self::Adam(AdamConfig::default())
    }
}

impl OptimizerConfig {
    /// The initial learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Self::Adam(c) | Self::AdamW(c) => c.lr,
            Self::Sgd(c) => c.lr,
        }
    }

    /// The weight decay.
    pub fn weight_decay(&self) -> f64 {
        match self {
            Self::Adam(c) | Self::AdamW(c) => c.weight_decay,
            Self::Sgd(c) => c.weight_decay,
        }
    }
}

/// SGD's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: plain SGD).
    pub momentum: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
}

/// `torch.optim.SGD`'s defaults: learning rate 1e-3, no momentum, no weight decay.
impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            weight_decay: 0.0,
        }
    }
}

/// SGD (with optional momentum) over a named list of parameters.
#[derive(Debug)]
pub struct Sgd {
    config: SgdConfig,
    params: Vec<(String, Tensor)>,
    /// One buffer per parameter once the first step has made it (momentum only).
    momentum: Vec<Option<Tensor>>,
    step: i64,
    /// Steps in which each parameter had a gradient (a buffer exists once this is above 0).
    param_steps: Vec<i64>,
}

impl Sgd {
    /// An optimizer for `params` (name, trainable tensor).
    pub fn new(params: Vec<(String, Tensor)>, config: SgdConfig) -> Self {
        let momentum = params.iter().map(|_| None).collect();
        Self {
            config,
            param_steps: vec![0; params.len()],
            params,
            momentum,
            step: 0,
        }
    }

    /// Optimizes `params` from now on: a parameter already optimized keeps its momentum
    /// buffer and step count, a new one starts without, and the state of one left out is
    /// dropped.
    pub fn set_params(&mut self, params: Vec<(String, Tensor)>) {
        let mut old: BTreeMap<String, (Option<Tensor>, i64)> = self
            .params
            .drain(..)
            .zip(self.momentum.drain(..).zip(self.param_steps.drain(..)))
            .map(|((name, _), state)| (name, state))
            .collect();
        for (name, _) in &params {
            let (buffer, steps) = old.remove(name).unwrap_or((None, 0));
            self.momentum.push(buffer);
            self.param_steps.push(steps);
        }
        self.params = params;
    }

    /// One step from the parameters' current gradients; parameters without one are skipped.
    /// The parameters whose momentum buffers exist (all of them without momentum) step
    /// together with libtorch's `_foreach_*` kernels, as PyTorch's `SGD` does on CUDA by
    /// default (`foreach`); a parameter's first step with momentum, which makes its buffer
    /// from its gradient, is taken on its own.
    pub fn step(&mut self) {
        self.step += 1;
        let SgdConfig {
            lr,
            momentum,
            weight_decay,
        } = self.config;
        tch::no_grad(|| {
            let (mut params, mut grads, mut buffers) = (Vec::new(), Vec::new(), Vec::new());
            for (k, (_, p)) in self.params.iter().enumerate() {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                self.param_steps[k] += 1;
                if momentum != 0.0 {
                    match &self.momentum[k] {
                        Some(buffer) => buffers.push(buffer.shallow_clone()),
                        None => {
                            let buffer = with_weight_decay(grad, p, weight_decay).detach().copy();
                            fused(tch_ext::add_(&mut p.shallow_clone(), &buffer, -lr));
                            self.momentum[k] = Some(buffer);
                            continue;
                        }
                    }
                }
                params.push(p.shallow_clone());
                grads.push(grad);
            }
            // libtorch's foreach kernels refuse empty lists.
            if !params.is_empty() {
                fused(tch_ext::foreach_sgd_(
                    &mut params,
                    &grads,
                    &mut buffers,
                    lr,
                    momentum,
                    weight_decay,
                ));
            }
        });
    }

    /// The momentum buffers by name (`momentum_buffer.<param>`) and each parameter's step
    /// count (`step.<param>`, an int64 scalar), for a checkpoint.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.params.len());
        for (k, (name, _)) in self.params.iter().enumerate() {
            if let Some(b) = &self.momentum[k] {
                out.push((format!("momentum_buffer.{name}"), b.shallow_clone()));
            }
            out.push((format!("step.{name}"), Tensor::from(self.param_steps[k])));
        }
        out
    }

    /// Restores buffers saved by [`Sgd::state_tensors`]; with momentum, the buffer of every
    /// parameter that took a step must be there (checkpoints without per-parameter step
    /// counts: every parameter took every step). On any mismatch nothing is changed.
    pub fn load_state(
        &mut self,
        tensors: &BTreeMap<String, Tensor>,
        step: i64,
    ) -> Result<(), OptimStateError> {
        let param_steps = saved_param_steps(&self.params, tensors, step)?;
        let mut found = Vec::with_capacity(self.params.len());
        for ((name, p), &steps) in self.params.iter().zip(&param_steps) {
            if self.config.momentum == 0.0 || steps == 0 {
                found.push(None);
                continue;
            }
            let key = format!("momentum_buffer.{name}");
            found.push(Some(fitting(tensors, key, p)?));
        }
        self.momentum = found;
        self.step = step;
        self.param_steps = param_steps;
        Ok(())
    }
}

/// Each parameter's step count saved as `step.<param>`; `step` (the optimizer's) for
/// checkpoints written without them. A parameter takes at most the optimizer's steps: a
/// count outside `0..=step` is an error (Adam's bias correction divides by `1 - beta^t`).
fn saved_param_steps(
    params: &[(String, Tensor)],
    tensors: &BTreeMap<String, Tensor>,
    step: i64,
) -> Result<Vec<i64>, OptimStateError> {
    params
        .iter()
        .map(|(name, _)| {
            let key = format!("step.{name}");
            let Some(t) = tensors.get(&key) else {
                return Ok(step);
            };
            let found = i64::try_from(t)
                .map_err(|_| OptimStateError::Missing(format!("{key} (not an integer scalar)")))?;
            if !(0..=step).contains(&found) {
                return Err(OptimStateError::StepCount {
                    name: key,
                    found,
                    steps: step,
                });
            }
            Ok(found)
        })
        .collect()
}

/// The state tensor `key`, checked against its parameter and moved to its device and kind.
fn fitting(
    tensors: &BTreeMap<String, Tensor>,
    key: String,
    p: &Tensor,
) -> Result<Tensor, OptimStateError> {
    let t = tensors
        .get(&key)
        .ok_or_else(|| OptimStateError::Missing(key.clone()))?;
    if t.size() != p.size() {
        return Err(OptimStateError::Shape {
            name: key,
            found: t.size(),
            expected: p.size(),
        });
    }
    Ok(t.to_device(p.device()).to_kind(p.kind()))
}

/// The Trainer's optimizer: Adam or SGD.
#[derive(Debug)]
pub enum Optimizer {
    /// Adam.
    Adam(Adam),
    /// SGD.
    Sgd(Sgd),
}

impl Optimizer {
    /// The optimizer `config` names, over `params`.
    pub fn new(params: Vec<(String, Tensor)>, config: OptimizerConfig) -> Self {
        match config {
            OptimizerConfig::Adam(c) => Self::Adam(Adam::new(params, c)),
            OptimizerConfig::AdamW(c) => Self::Adam(Adam::decoupled(params, c)),
            OptimizerConfig::Sgd(c) => Self::Sgd(Sgd::new(params, c)),
        }
    }

    /// The current learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Self::Adam(o) => o.lr(),
            Self::Sgd(o) => o.config.lr,
        }
    }

    /// Sets the learning rate (used by the scheduler).
    pub fn set_lr(&mut self, lr: f64) {
        match self {
            Self::Adam(o) => o.set_lr(lr),
            Self::Sgd(o) => o.config.lr = lr,
        }
    }

    /// Steps taken so far.
    pub fn steps(&self) -> i64 {
        match self {
            Self::Adam(o) => o.steps(),
            Self::Sgd(o) => o.step,
        }
    }

    /// Sets every parameter's gradient to none (PyTorch's default `set_to_none=True`).
    pub fn zero_grad(&mut self) {
        let params = match self {
            Self::Adam(o) => &o.params,
            Self::Sgd(o) => &o.params,
        };
        zero_grads(params);
    }

    /// One step from the current gradients.
    pub fn step(&mut self) {
        match self {
            Self::Adam(o) => o.step(),
            Self::Sgd(o) => o.step(),
        }
    }

    /// The state tensors, for a checkpoint.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        match self {
            Self::Adam(o) => o.state_tensors(),
            Self::Sgd(o) => o.state_tensors(),
        }
    }

    /// Optimizes `params` from now on (PyTorch's `add_param_group` after unfreezing, or a
    /// new optimizer over fewer): parameters already optimized keep their state, new ones
    /// start with none (zero moments, no momentum buffer, no steps), and the state of those
    /// left out is dropped. The learning rate and the step count stay.
    pub fn set_params(&mut self, params: Vec<(String, Tensor)>) {
        match self {
            Self::Adam(o) => o.set_params(params),
            Self::Sgd(o) => o.set_params(params),
        }
    }

    /// The names of the parameters it optimizes, in its order.
    pub fn param_names(&self) -> Vec<&str> {
        let params = match self {
            Self::Adam(o) => &o.params,
            Self::Sgd(o) => &o.params,
        };
        params.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Restores the state tensors and step count of a checkpoint.
    pub fn load_state(
        &mut self,
        tensors: &BTreeMap<String, Tensor>,
        step: i64,
    ) -> Result<(), OptimStateError> {
        match self {
            Self::Adam(o) => o.load_state(tensors, step),
            Self::Sgd(o) => o.load_state(tensors, step),
        }
    }
}

/// Scales the gradients of `params` so that their global 2-norm is at most `max_norm`, and
/// returns the norm before scaling, unread: a 0-dim tensor on the first gradient's device
/// (0 on the CPU without gradients). As `torch.nn.utils.clip_grad_norm_`: every gradient
/// times `min(1, max_norm / (norm + 1e-6))`, parameters without one left out; grouped by
/// device and dtype (in order of first appearance), each group's norms one `_foreach_norm`,
/// the total the norm of them all stacked, each group scaled by one `_foreach_mul_`: on
/// CUDA a few kernels, not two per parameter, and PyTorch's sums. After DDP's average the
/// gradients, the norm and the scaling are the same on every rank. A non-finite norm leaves
/// non-finite gradients (the fp16 scaler skips that step).
pub fn clip_grad_norm(params: &[(String, Tensor)], max_norm: f64) -> Tensor {
    tch::no_grad(|| {
        let mut groups: Vec<((Device, Kind), Vec<Tensor>)> = Vec::new();
        for g in params.iter().map(|(_, p)| p.grad()).filter(Tensor::defined) {
            let key = (g.device(), g.kind());
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, group)) => group.push(g),
                None => groups.push((key, vec![g])),
            }
        }
        let Some(((first_device, _), _)) = groups.first() else {
            return Tensor::from(0.0f32);
        };
        let first_device = *first_device;
        let norms: Vec<Tensor> = groups
            .iter()
            .map(|(_, group)| {
                let mut norms = Tensor::new();
                fused(tch_ext::foreach_norm_stacked(group, 2.0).map(|n| norms = n));
                norms.to_device(first_device)
            })
            .collect();
        let total = Tensor::cat(&norms, 0).norm();
        // PyTorch's `max_norm / (total + 1e-6)` is `reciprocal(total + 1e-6) * max_norm`
        // (`Tensor.__rtruediv__`); tch's `f64 / Tensor` rounds differently.
        let coef = ((&total + 1e-6).reciprocal() * max_norm).clamp_max(1.0);
        for ((device, _), group) in &mut groups {
            fused(tch_ext::foreach_mul_tensor_(
                group,
                &coef.to_device(*device),
            ));
        }
        total
    })
}

/// `grad + weight_decay * param` as PyTorch computes it (`grad.add(param, alpha=wd)`, one
/// rounding), or `grad` itself without weight decay.
fn with_weight_decay(grad: Tensor, param: &Tensor, weight_decay: f64) -> Tensor {
    if weight_decay == 0.0 {
        return grad;
    }
    let mut decayed = grad.copy();
    fused(tch_ext::add_(&mut decayed, param, weight_decay));
    decayed
}

/// The fused operations of the steps and of clipping act on parameters and tensors made from
/// them (same shape, dtype and device; clipping's grouped by device and dtype), which
/// libtorch cannot refuse; a failure would be a bug.
fn fused(result: Result<(), tch_ext::TchExtError>) {
    if let Err(e) = result {
        panic!("optimizer step: {e}");
    }
}

/// PyTorch's `zero_grad()` (`set_to_none=True`): every gradient becomes undefined, so the
/// next backward writes it afresh, and a parameter that gets none is skipped by `step`.
fn zero_grads(params: &[(String, Tensor)]) {
    for (_, p) in params {
        // A parameter the caller handed us is a defined tensor; nothing else can fail.
        let _ = tch_ext::set_grad(p, None);
    }
}

/// Adam's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator for stability.
    pub eps: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
}

impl AdamConfig {
    /// `torch.optim.AdamW`'s defaults: Adam's, with weight decay 0.01.
    pub fn adamw() -> Self {
        Self {
            weight_decay: 0.01,
            ..Self::default()
        }
    }
}

/// `torch.optim.Adam`'s defaults (no weight decay).
impl Default for AdamConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// Adam over a named list of parameters.
#[derive(Debug)]
pub struct Adam {
    config: AdamConfig,
    params: Vec<(String, Tensor)>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    /// Optimizer steps taken.
    step: i64,
    /// Steps in which each parameter had a gradient (the `t` of its bias corrections).
    param_steps: Vec<i64>,
    /// AdamW: weight decay shrinks the weights instead of entering the gradient.
    decoupled: bool,
}

impl Adam {
    /// An optimizer for `params` (name, trainable tensor), with zeroed moments.
    pub fn new(params: Vec<(String, Tensor)>, config: AdamConfig) -> Self {
        let exp_avg = params
            .iter()
            .map(|(_, p)| p.zeros_like().detach())
            .collect();
        let exp_avg_sq = params
            .iter()
            .map(|(_, p)| p.zeros_like().detach())
            .collect();
        Self {
            config,
            param_steps: vec![0; params.len()],
            params,
            exp_avg,
            exp_avg_sq,
            step: 0,
            decoupled: false,
        }
    }

    /// AdamW (`torch.optim.AdamW`): as [`Adam::new`], but each step first multiplies the
    /// weights by `1 - lr * weight_decay` and leaves the gradient alone.
    pub fn decoupled(params: Vec<(String, Tensor)>, config: AdamConfig) -> Self {
        Self {
            decoupled: true,
            ..Self::new(params, config)
        }
    }

    /// Optimizes `params` from now on: a parameter already optimized keeps its moments and
    /// step count, a new one starts from zero moments and no steps, and the state of one
    /// left out is dropped.
    pub fn set_params(&mut self, params: Vec<(String, Tensor)>) {
        let mut old: BTreeMap<String, (Tensor, Tensor, i64)> = BTreeMap::new();
        let moments = self.exp_avg.drain(..).zip(self.exp_avg_sq.drain(..));
        for (((name, _), (m, v)), t) in self.params.drain(..).zip(moments).zip(&self.param_steps) {
            old.insert(name, (m, v, *t));
        }
        self.param_steps.clear();
        for (name, p) in &params {
            let (m, v, t) = old
                .remove(name)
                .unwrap_or_else(|| (p.zeros_like().detach(), p.zeros_like().detach(), 0));
            self.exp_avg.push(m);
            self.exp_avg_sq.push(v);
            self.param_steps.push(t);
        }
        self.params = params;
    }

    /// The current learning rate.
    pub fn lr(&self) -> f64 {
        self.config.lr
    }

    /// Sets the learning rate (used by the scheduler).
    pub fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    /// Steps taken so far.
    pub fn steps(&self) -> i64 {
        self.step
    }

    /// Sets every parameter's gradient to none (PyTorch's default `set_to_none=True`).
    pub fn zero_grad(&mut self) {
        zero_grads(&self.params);
    }

    /// One Adam step from the parameters' current gradients. A parameter without a gradient
    /// is skipped, as PyTorch does (the DDP layer reports those before this is reached).
    /// The step runs over all the parameters at once with libtorch's `_foreach_*` kernels, as
    /// PyTorch's `Adam` does on CUDA by default (`foreach`): a few kernel launches per step
    /// rather than several per parameter, and on the CPU the same per-tensor operations.
    pub fn step(&mut self) {
        self.step += 1;
        let AdamConfig {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.config;
        let hyper = tch_ext::AdamHyper {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled: self.decoupled,
        };
        let (mut params, mut grads) = (Vec::new(), Vec::new());
        let (mut exp_avg, mut exp_avg_sq, mut steps) = (Vec::new(), Vec::new(), Vec::new());
        for (k, (_, p)) in self.params.iter().enumerate() {
            let grad = p.grad();
            if grad.defined() {
                self.param_steps[k] += 1;
                params.push(p.shallow_clone());
                grads.push(grad);
                exp_avg.push(self.exp_avg[k].shallow_clone());
                exp_avg_sq.push(self.exp_avg_sq[k].shallow_clone());
                steps.push(self.param_steps[k]);
            }
        }
        if params.is_empty() {
            // libtorch's foreach kernels refuse empty lists.
            return;
        }
        tch::no_grad(|| {
            fused(tch_ext::foreach_adam_(
                &mut params,
                &grads,
                &mut exp_avg,
                &mut exp_avg_sq,
                &steps,
                &hyper,
            ));
        });
    }

    /// The optimizer's tensors by name (`exp_avg.<param>`, `exp_avg_sq.<param>`, and
    /// `step.<param>`, an int64 scalar: the parameter's own step count), for a checkpoint;
    /// the optimizer's step count is [`Adam::steps`].
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(3 * self.params.len());
        for (k, (name, _)) in self.params.iter().enumerate() {
            out.push((format!("exp_avg.{name}"), self.exp_avg[k].shallow_clone()));
            out.push((
                format!("exp_avg_sq.{name}"),
                self.exp_avg_sq[k].shallow_clone(),
            ));
            out.push((format!("step.{name}"), Tensor::from(self.param_steps[k])));
        }
        out
    }

    /// Restores moments and step count saved by [`Adam::state_tensors`]. Every tensor must be
    /// present with the parameter's shape; on any mismatch nothing is changed.
    pub fn load_state(
        &mut self,
        tensors: &BTreeMap<String, Tensor>,
        step: i64,
    ) -> Result<(), OptimStateError> {
        let mut found = Vec::with_capacity(2 * self.params.len());
        for (name, p) in &self.params {
            for prefix in ["exp_avg", "exp_avg_sq"] {
                found.push(fitting(tensors, format!("{prefix}.{name}"), p)?);
            }
        }
        // Checkpoints written before per-parameter counts: every parameter took every step.
        let param_steps = saved_param_steps(&self.params, tensors, step)?;
        let mut it = found.into_iter();
        for k in 0..self.params.len() {
            self.exp_avg[k] = it.next().unwrap_or_default();
            self.exp_avg_sq[k] = it.next().unwrap_or_default();
        }
        self.step = step;
        self.param_steps = param_steps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn;
    use tch::nn::OptimizerConfig as _;

    #[test]
    fn clipping_scales_the_global_norm_down_to_the_limit_only() {
        let vs = nn::VarStore::new(Device::Cpu);
        let a = vs.root().var_copy("a", &Tensor::from_slice(&[1.0f32, 1.0]));
        let b = vs.root().var_copy("b", &Tensor::from_slice(&[1.0f32]));
        let unused = vs.root().var_copy("u", &Tensor::from_slice(&[1.0f32]));
        let params = vec![
            ("a".to_string(), a.shallow_clone()),
            ("b".to_string(), b.shallow_clone()),
            ("u".to_string(), unused),
        ];
        // Gradients (3, 4) and (12): global norm 13.
        ((&a * Tensor::from_slice(&[3.0f32, 4.0])).sum(Kind::Float) + (&b * 12.0).sum(Kind::Float))
            .backward();
        let norm = clip_grad_norm(&params, 6.5).double_value(&[]);
        assert!((norm - 13.0).abs() < 1e-5, "{norm}");
        let scaled: Vec<f32> = Vec::try_from(&a.grad()).unwrap();
        let coef = 6.5 / (13.0 + 1e-6);
        assert!((scaled[0] - 3.0 * coef as f32).abs() < 1e-6, "{scaled:?}");
        assert!((f32::try_from(&b.grad()).unwrap() - 12.0 * coef as f32).abs() < 1e-5);
        // Below the limit nothing changes.
        let again = clip_grad_norm(&params, 100.0).double_value(&[]);
        assert!((again - 6.5).abs() < 1e-4, "{again}");
        assert!((f32::try_from(&b.grad()).unwrap() - 12.0 * coef as f32).abs() < 1e-5);
    }

    /// Gradients of two dtypes are two groups, whose norms are taken together, and each keeps
    /// its dtype.
    #[test]
    fn clipping_takes_the_norm_over_gradients_of_every_dtype() {
        let vs = nn::VarStore::new(Device::Cpu);
        let a = vs.root().zeros("a", &[2]);
        let b = Tensor::zeros([1], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        ((&a * Tensor::from_slice(&[3.0f32, 4.0])).sum(Kind::Float)
            + (&b * 12.0).sum(Kind::Double).to_kind(Kind::Float))
        .backward();
        let params = vec![
            ("a".to_string(), a.shallow_clone()),
            ("b".to_string(), b.shallow_clone()),
        ];
        let norm = clip_grad_norm(&params, 1.3).double_value(&[]);
        assert!((norm - 13.0).abs() < 1e-5, "{norm}");
        assert_eq!(b.grad().kind(), Kind::Double);
        let (ga, gb) = (
            Vec::<f32>::try_from(&a.grad()).unwrap(),
            f64::try_from(&b.grad()).unwrap(),
        );
        assert!(
            (ga[0] - 0.3).abs() < 1e-6 && (ga[1] - 0.4).abs() < 1e-6,
            "{ga:?}"
        );
        assert!((gb - 1.2).abs() < 1e-6, "{gb}");
    }

    /// On cuda:0, where `_foreach_norm` and `_foreach_mul_` run CUDA's kernels: gradients
    /// of two dtypes (two groups, scaled by the f64 total's coefficient, as PyTorch's are),
    /// clipped as on the CPU, each keeping its dtype and device. `cargo xtask gpu-check`
    /// runs it; without a GPU it says `skipped:`.
    #[test]
    fn clipping_on_cuda_equals_clipping_on_the_cpu() {
        if !crate::ddp::gpu_tests::gpu() {
            return;
        }
        let clip = |device: Device| {
            let a = Tensor::zeros([3], (Kind::Float, device)).set_requires_grad(true);
            let b = Tensor::zeros([2], (Kind::Double, device)).set_requires_grad(true);
            let ga = Tensor::from_slice(&[-4.1957865f32, 1.2100406, 2.514079]).to_device(device);
            let gb = Tensor::from_slice(&[-2.1577728f64, -1.2100306]).to_device(device);
            ((&a * ga).sum(Kind::Double) + (&b * gb).sum(Kind::Double)).backward();
            let params = vec![
                ("a".to_string(), a.shallow_clone()),
                ("b".to_string(), b.shallow_clone()),
            ];
            let norm = clip_grad_norm(&params, 5.0);
            assert_eq!(norm.device(), device);
            assert_eq!(
                (a.grad().kind(), b.grad().kind(), b.grad().device()),
                (Kind::Float, Kind::Double, device)
            );
            let grads: Vec<f64> = Vec::try_from(
                Tensor::cat(&[a.grad().to_kind(Kind::Double), b.grad()], 0).to_device(Device::Cpu),
            )
            .unwrap();
            (norm.double_value(&[]), grads)
        };
        let (cpu_norm, cpu) = clip(Device::Cpu);
        let (cuda_norm, cuda) = clip(Device::Cuda(0));
        assert!(
            (cuda_norm - cpu_norm).abs() < 1e-6,
            "{cuda_norm} {cpu_norm}"
        );
        for (g, want) in cuda.iter().zip(&cpu) {
            assert!((g - want).abs() < 1e-6, "{cuda:?} against {cpu:?}");
        }
        // Clipped: the norm is now 5.
        let clipped = cpu.iter().map(|g| g * g).sum::<f64>().sqrt();
        assert!((clipped - 5.0).abs() < 1e-5, "{clipped}");
    }

    /// `torch.nn.utils.clip_grad_norm_([a, b], 5.0)` in torch 2.13 gives exactly these
    /// gradients (a coefficient of `5 / (norm + 1e-6)` rounded another way is 1 ulp off).
    #[test]
    fn clipping_rounds_as_pytorch_does() {
        let vs = nn::VarStore::new(Device::Cpu);
        let a = vs.root().zeros("a", &[3]);
        let b = vs.root().zeros("b", &[2]);
        let ga = [-4.1957865f32, 1.2100406, 2.514079];
        let gb = [-2.1577728f32, -1.2100306];
        ((&a * Tensor::from_slice(&ga)).sum(Kind::Float)
            + (&b * Tensor::from_slice(&gb)).sum(Kind::Float))
        .backward();
        let params = vec![
            ("a".to_string(), a.shallow_clone()),
            ("b".to_string(), b.shallow_clone()),
        ];
        let _norm = clip_grad_norm(&params, 5.0);
        let (ca, cb): (Vec<f32>, Vec<f32>) = (
            Vec::try_from(&a.grad()).unwrap(),
            Vec::try_from(&b.grad()).unwrap(),
        );
        assert_eq!(ca, [-3.7373352, 1.0778259, 2.2393792]);
        assert_eq!(cb, [-1.9220045, -1.077817]);
    }

    /// Our AdamW and libtorch's `torch::optim::AdamW` take the same steps, and differ from
    /// Adam with the same weight decay.
    #[test]
    fn adamw_matches_libtorch_adamw() {
        let vs = [
            nn::VarStore::new(Device::Cpu),
            nn::VarStore::new(Device::Cpu),
        ];
        tch::manual_seed(5);
        let w0 = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
        let w: Vec<Tensor> = vs.iter().map(|v| v.root().var_copy("w", &w0)).collect();
        let config = AdamConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..Default::default()
        };
        let mut ours = Optimizer::new(
            vec![("w".into(), w[0].shallow_clone())],
            OptimizerConfig::AdamW(config),
        );
        let mut theirs = nn::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            wd: 0.1,
            eps: 1e-8,
            amsgrad: false,
        }
        .build(&vs[1], 0.01)
        .unwrap();
        let x = Tensor::randn([8, 5], (Kind::Float, Device::Cpu));
        let loss = |w: &Tensor| x.matmul(w).pow_tensor_scalar(2).sum(Kind::Float);
        for _ in 0..5 {
            ours.zero_grad();
            loss(&w[0]).backward();
            ours.step();
            theirs.zero_grad();
            loss(&w[1]).backward();
            theirs.step();
        }
        let diff = (&w[0] - &w[1]).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "max difference {diff}");
        // Plain Adam with the same L2 weight decay ends elsewhere.
        let adam_w = adam_weights_after_five_steps(&w0, config, &x);
        assert!((&adam_w - &w[0]).abs().max().double_value(&[]) > 1e-5);
    }

    fn adam_weights_after_five_steps(w0: &Tensor, config: AdamConfig, x: &Tensor) -> Tensor {
        let vs = nn::VarStore::new(Device::Cpu);
        let w = vs.root().var_copy("w", w0);
        let mut adam = Adam::new(vec![("w".into(), w.shallow_clone())], config);
        for _ in 0..5 {
            adam.zero_grad();
            x.matmul(&w)
                .pow_tensor_scalar(2)
                .sum(Kind::Float)
                .backward();
            adam.step();
        }
        w
    }

    /// Our Adam and libtorch's `torch::optim::Adam` take the same steps.
    #[test]
    fn matches_libtorch_adam_with_weight_decay() {
        let ours_vs = nn::VarStore::new(Device::Cpu);
        let theirs_vs = nn::VarStore::new(Device::Cpu);
        tch::manual_seed(3);
        let w0 = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
        let w = ours_vs.root().var_copy("w", &w0);
        let w_ref = theirs_vs.root().var_copy("w", &w0);
        let config = AdamConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..Default::default()
        };
        let mut ours = Adam::new(vec![("w".into(), w.shallow_clone())], config);
        let mut theirs = nn::Adam {
            beta1: 0.9,
            beta2: 0.999,
            wd: 0.1,
            eps: 1e-8,
            amsgrad: false,
        }
        .build(&theirs_vs, 0.01)
        .unwrap();
        let x = Tensor::randn([8, 5], (Kind::Float, Device::Cpu));
        for _ in 0..5 {
            ours.zero_grad();
            x.matmul(&w)
                .pow_tensor_scalar(2)
                .sum(Kind::Float)
                .backward();
            ours.step();
            theirs.zero_grad();
            x.matmul(&w_ref)
                .pow_tensor_scalar(2)
                .sum(Kind::Float)
                .backward();
            theirs.step();
        }
        let diff = (&w - &w_ref).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "max difference {diff}");
        assert!(
            (&w - &w0).abs().max().double_value(&[]) > 1e-3,
            "the weights moved"
        );
        assert_eq!(ours.steps(), 5);
    }

    #[test]
    fn state_round_trip_continues_identically() {
        let make = || {
            let vs = nn::VarStore::new(Device::Cpu);
            let w = vs
                .root()
                .var_copy("w", &Tensor::from_slice(&[1.0f32, -2.0, 3.0]));
            (vs, w)
        };
        let loss = |w: &Tensor| (w * w * Tensor::from_slice(&[1.0f32, 2.0, 3.0])).sum(Kind::Float);
        let (_vs_a, wa) = make();
        let mut a = Adam::new(
            vec![("w".into(), wa.shallow_clone())],
            AdamConfig::default(),
        );
        for _ in 0..3 {
            a.zero_grad();
            loss(&wa).backward();
            a.step();
        }
        let saved: BTreeMap<String, Tensor> = a
            .state_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.copy()))
            .collect();
        let (_vs_b, wb) = make();
        tch::no_grad(|| wb.shallow_clone().copy_(&wa));
        let mut b = Adam::new(
            vec![("w".into(), wb.shallow_clone())],
            AdamConfig::default(),
        );
        b.load_state(&saved, a.steps()).unwrap();
        for (opt, w) in [(&mut a, &wa), (&mut b, &wb)] {
            opt.zero_grad();
            loss(w).backward();
            opt.step();
        }
        assert!(wa.equal(&wb));
        let copy = |s: &BTreeMap<String, Tensor>| -> BTreeMap<String, Tensor> {
            s.iter().map(|(n, t)| (n.clone(), t.copy())).collect()
        };
        let mut missing = copy(&saved);
        missing.remove("exp_avg_sq.w");
        assert_eq!(
            b.load_state(&missing, 1).unwrap_err(),
            OptimStateError::Missing("exp_avg_sq.w".into())
        );
        // A step count below 0 or above the optimizer's is refused, and nothing changes.
        for found in [-1, 4, i64::MAX] {
            let mut bad = copy(&saved);
            bad.insert("step.w".into(), Tensor::from(found));
            assert_eq!(
                b.load_state(&bad, 3).unwrap_err(),
                OptimStateError::StepCount {
                    name: "step.w".into(),
                    found,
                    steps: 3
                }
            );
            assert_eq!((b.steps(), b.param_steps.as_slice()), (4, &[4][..]));
        }
    }

    /// Our SGD and libtorch's `torch::optim::SGD` take the same steps, with momentum and
    /// weight decay; a saved and restored state continues identically.
    #[test]
    fn sgd_matches_libtorch_and_resumes_exactly() {
        let ours_vs = nn::VarStore::new(Device::Cpu);
        let theirs_vs = nn::VarStore::new(Device::Cpu);
        tch::manual_seed(5);
        let w0 = Tensor::randn([4, 3], (Kind::Float, Device::Cpu));
        let w = ours_vs.root().var_copy("w", &w0);
        let w_ref = theirs_vs.root().var_copy("w", &w0);
        let config = SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
        };
        let mut ours = Optimizer::new(
            vec![("w".into(), w.shallow_clone())],
            OptimizerConfig::Sgd(config),
        );
        let mut theirs = nn::Sgd {
            momentum: 0.9,
            dampening: 0.0,
            wd: 0.01,
            nesterov: false,
        }
        .build(&theirs_vs, 0.05)
        .unwrap();
        let x = Tensor::randn([6, 4], (Kind::Float, Device::Cpu));
        let loss = |w: &Tensor| x.matmul(w).pow_tensor_scalar(2).sum(Kind::Float);
        for _ in 0..4 {
            ours.zero_grad();
            loss(&w).backward();
            ours.step();
            theirs.zero_grad();
            loss(&w_ref).backward();
            theirs.step();
        }
        let diff = (&w - &w_ref).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "max difference {diff}");
        assert!((&w - &w0).abs().max().double_value(&[]) > 1e-3);

        let saved: BTreeMap<String, Tensor> = ours
            .state_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.copy()))
            .collect();
        assert_eq!(
            saved.keys().collect::<Vec<_>>(),
            ["momentum_buffer.w", "step.w"],
            "one buffer and one step count per parameter"
        );
        let copy_vs = nn::VarStore::new(Device::Cpu);
        let w2 = copy_vs.root().var_copy("w", &w);
        let mut restored = Optimizer::new(
            vec![("w".into(), w2.shallow_clone())],
            OptimizerConfig::Sgd(config),
        );
        restored.load_state(&saved, ours.steps()).unwrap();
        for (opt, w) in [(&mut ours, &w), (&mut restored, &w2)] {
            opt.zero_grad();
            loss(w).backward();
            opt.step();
        }
        assert!(w.equal(&w2));
        assert_eq!(
            restored.load_state(&BTreeMap::new(), 3).unwrap_err(),
            OptimStateError::Missing("momentum_buffer.w".into())
        );
    }

    /// A step in which no parameter has a gradient changes nothing but the step count (the
    /// foreach kernels are not given empty lists).
    #[test]
    fn a_step_without_gradients_leaves_every_parameter_as_it_was() {
        for config in [
            OptimizerConfig::Adam(AdamConfig::default()),
            OptimizerConfig::Sgd(SgdConfig::default()),
        ] {
            let vs = nn::VarStore::new(Device::Cpu);
            let a = vs.root().var_copy("a", &Tensor::from_slice(&[1.0f32, 2.0]));
            let mut opt = Optimizer::new(vec![("a".into(), a.shallow_clone())], config);
            opt.zero_grad();
            opt.step();
            assert_eq!(Vec::<f32>::try_from(&a).unwrap(), [1.0, 2.0]);
            assert_eq!(opt.steps(), 1);
        }
    }

    /// A parameter added later starts with no state and is stepped from then on; one kept
    /// keeps its state; one dropped loses it. With SGD's momentum, a parameter that never
    /// stepped needs no buffer to resume.
    #[test]
    fn set_params_keeps_old_state_and_starts_new_parameters_fresh() {
        for config in [
            OptimizerConfig::Adam(AdamConfig::default()),
            OptimizerConfig::Sgd(SgdConfig {
                momentum: 0.9,
                ..Default::default()
            }),
        ] {
            let vs = nn::VarStore::new(Device::Cpu);
            let a = vs.root().var_copy("a", &Tensor::from_slice(&[1.0f32, 2.0]));
            let b = vs.root().var_copy("b", &Tensor::from_slice(&[3.0f32]));
            let mut opt = Optimizer::new(vec![("a".into(), a.shallow_clone())], config);
            let step = |opt: &mut Optimizer| {
                opt.zero_grad();
                (a.sum(Kind::Float) + b.sum(Kind::Float) * 2.0).backward();
                opt.step();
            };
            step(&mut opt);
            let b0 = b.copy();
            assert!(b.equal(&b0), "b is not optimized yet");
            let state_a: BTreeMap<String, Tensor> = opt.state_tensors().into_iter().collect();
            assert!(
                !state_a.keys().any(|k| k.ends_with(".b")),
                "{:?}",
                state_a.keys()
            );
            // Restoring a state without b's buffer works while b took no step.
            let mut resumed = Optimizer::new(
                vec![
                    ("a".into(), a.shallow_clone()),
                    ("b".into(), b.shallow_clone()),
                ],
                config,
            );
            let mut with_b: BTreeMap<String, Tensor> =
                state_a.iter().map(|(n, t)| (n.clone(), t.copy())).collect();
            if matches!(config, OptimizerConfig::Adam(_)) {
                with_b.insert(
                    "exp_avg.b".into(),
                    Tensor::zeros([1], (Kind::Float, Device::Cpu)),
                );
                with_b.insert(
                    "exp_avg_sq.b".into(),
                    Tensor::zeros([1], (Kind::Float, Device::Cpu)),
                );
            }
            with_b.insert("step.b".into(), Tensor::from(0i64));
            resumed.load_state(&with_b, 1).unwrap();
            opt.set_params(vec![
                ("a".into(), a.shallow_clone()),
                ("b".into(), b.shallow_clone()),
            ]);
            assert_eq!(opt.param_names(), ["a", "b"]);
            let saved: BTreeMap<String, Tensor> = opt.state_tensors().into_iter().collect();
            assert_eq!(saved["step.a"].int64_value(&[]), 1);
            assert_eq!(saved["step.b"].int64_value(&[]), 0);
            step(&mut opt);
            assert!(!b.equal(&b0), "b is optimized once added");
            let saved: BTreeMap<String, Tensor> = opt.state_tensors().into_iter().collect();
            assert_eq!(saved["step.a"].int64_value(&[]), 2);
            assert_eq!(saved["step.b"].int64_value(&[]), 1);
            assert_eq!(opt.steps(), 2);
            opt.set_params(vec![("b".into(), b.shallow_clone())]);
            assert!(opt.state_tensors().iter().all(|(n, _)| n.ends_with(".b")));
        }
    }
}
