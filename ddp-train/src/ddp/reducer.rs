//! The gradient reducer: the state that the parameters' post-accumulate-grad hooks share with
//! [`DistributedDataParallel::sync_gradients`](super::DistributedDataParallel::sync_gradients).
//!
//! During a backward pass with gradient sync on, each parameter's hook marks it ready (and,
//! when overlapping, copies its gradient into its bucket); a bucket whose members are all
//! ready is handed to the communication hook, strictly in bucket order, so that every rank
//! issues the same collectives in the same order whatever order its gradients arrive in. At
//! the end ([`Reducer::finish`]), parameters that got no gradient in this backward contribute
//! the gradient they hold (accumulated in backward passes without sync) or zeros, the
//! remaining buckets are launched, and one more all-reduce counts on how many ranks each
//! parameter was used, in this backward or one without sync since the last synced one (and
//! which ranks saw a gradient twice). Each bucket is waited for in bucket order and its
//! averages copied at once into the gradients this rank used; once the counts arrive, into
//! those of the parameters only other ranks used. PyTorch's reducer does the same
//! (`local_used_map_`, `mark_variable_ready_dense`, `finalize_backward`).
//!
//! PyTorch's reducer finishes by itself at the end of backward; here `finish` waits for
//! `sync_gradients`, so a step that skips it (tch's `backward_step`) would leave each rank its
//! own gradient: the next step's call of DDP's fails ([`Reducer::check_finished`]), and so
//! does a second synced backward without `finish` between, at its first hook (PyTorch's
//! "Expected to have finished reduction in the prior iteration"), as does a backward with
//! gradient sync off (whose gradient its buckets in flight would lose); a `finish` after it
//! reports it on every rank. A backward that failed is no such step: [`Reducer::abandon`]
//! ends it.
//!
//! With `find_unused_parameters`, a bucket holding a parameter this rank does not use would
//! wait for `finish` while a rank that uses it launches it during backward: a collective of
//! the backward itself (SyncBatchNorm's) would then come before it on one rank and after it
//! on the other. So buckets are launched during backward only after
//! [`Reducer::prepare`] named the parameters the loss cannot reach; the first hook of the
//! backward marks those ready (PyTorch's `autograd_hook` after `prepare_for_backward`), and
//! without `prepare` every bucket waits for `finish`.

use std::sync::Arc;

use ddp_comm::{ProcessGroup, ReduceOp};
use tch::Tensor;

use super::bucket::{make_buckets, Bucket};
use super::comm_hook::{CommHook, GradBucket, HookWork};
use super::{DdpError, DdpOptions};

/// A rank's flag in [`Reducer::finish`]'s count: it saw a gradient twice.
const TWICE: i32 = 1;
/// Its store changed since DDP wrapped it.
const CHANGED: i32 = 2;

#[derive(Debug)]
pub(crate) struct Reducer {
    pg: Arc<ProcessGroup>,
    pub(crate) hook: Arc<dyn CommHook>,
    params: Vec<(String, Tensor)>,
    pub(crate) buckets: Vec<Bucket>,
    /// Parameter -> (bucket, offset, numel).
    locate: Vec<(usize, i64, i64)>,
    options: DdpOptions,
    pub(crate) require_sync: bool,
    /// Whether the buckets were rebuilt in the order gradients became ready.
    rebuilt: bool,
    // The step in progress.
    /// Parameters whose bucket slot is filled: used, or marked unused.
    ready: Vec<bool>,
    /// Parameters that got a gradient in this synced backward.
    used: Vec<bool>,
    /// Parameters the loss given to [`Reducer::prepare`] cannot reach, until the first hook
    /// of the synced backward marks them ready.
    unreachable: Option<Vec<usize>>,
    /// Whether this backward's first hook marked the unreachable parameters ready (PyTorch's
    /// `has_marked_unused_parameters_`): with `find_unused_parameters`, only then may buckets
    /// be launched during backward.
    unused_marked: bool,
    /// Parameters that got a gradient in a backward pass without sync since the last synced
    /// one.
    used_without_sync: Vec<bool>,
    pending: Vec<usize>,
    next: usize,
    works: Vec<HookWork>,
    order: Vec<usize>,
    twice: Option<usize>,
    /// A parameter that got a gradient in a second synced backward without `finish` between.
    missed: Option<usize>,
}

impl Reducer {
    /// Buckets in reverse parameter order, the order in which backward usually produces
    /// gradients, until the first step has shown the real one.
    pub(crate) fn new(
        pg: Arc<ProcessGroup>,
        hook: Arc<dyn CommHook>,
        params: Vec<(String, Tensor)>,
        options: DdpOptions,
    ) -> Self {
        let reverse: Vec<usize> = (0..params.len()).rev().collect();
        let mut r = Reducer {
            pg,
            hook,
            buckets: Vec::new(),
            locate: Vec::new(),
            options,
            require_sync: true,
            rebuilt: false,
            ready: vec![false; params.len()],
            used: vec![false; params.len()],
            unreachable: None,
            unused_marked: false,
            used_without_sync: vec![false; params.len()],
            pending: Vec::new(),
            next: 0,
            works: Vec::new(),
            order: Vec::with_capacity(params.len()),
            twice: None,
            missed: None,
            params,
        };
        r.set_buckets(&reverse);
        r
    }

    fn set_buckets(&mut self, order: &[usize]) {
        self.buckets = make_buckets(
            &self.params,
            order,
            self.options.first_bucket_cap_bytes,
            self.options.bucket_cap_bytes,
        );
        self.locate = vec![(0, 0, 0); self.params.len()];
        for (b, bucket) in self.buckets.iter().enumerate() {
            for &(k, offset, numel) in &bucket.members {
                self.locate[k] = (b, offset, numel);
            }
        }
        self.reset();
    }

    fn reset(&mut self) {
        self.ready.iter_mut().for_each(|r| *r = false);
        self.used.iter_mut().for_each(|u| *u = false);
        self.unreachable = None;
        self.unused_marked = false;
        self.used_without_sync.iter_mut().for_each(|u| *u = false);
        self.pending.clear();
        self.pending
            .extend(self.buckets.iter().map(|b| b.members.len()));
        self.next = 0;
        self.works.clear();
        self.order.clear();
        self.twice = None;
        self.missed = None;
    }

    /// The parameters that the coming synced backward cannot reach (by index, true where
    /// reached): its first hook marks them ready. Only with `find_unused_parameters`,
    /// overlap and gradient sync on (the caller checks).
    pub(crate) fn prepare(&mut self, reached: &[bool]) {
        let unreachable = (0..self.params.len()).filter(|&k| !reached[k]).collect();
        self.unreachable = Some(unreachable);
    }

    /// Whether buckets are launched as they complete during backward.
    fn launching(&self) -> bool {
        self.options.overlap && (!self.options.find_unused_parameters || self.unused_marked)
    }

    /// Parameter `k`'s gradient has been accumulated (called by its hook during backward).
    /// [`DdpError::SyncMissed`] in a backward, with gradient sync on or off, after a synced
    /// one without `finish` between: the hook fails that backward with it.
    pub(crate) fn mark_ready(&mut self, k: usize) -> Result<(), DdpError> {
        if !self.require_sync {
            if let Some(reached) = self.reached() {
                // The synced backward's buckets may be communicating: this gradient would be
                // overwritten by their averages, or added to them, or race into them (bucket
                // views). PyTorch's reducer finishes at the end of backward, so it never meets
                // a backward without sync before `finish`.
                self.missed.get_or_insert(reached);
                return Err(self.sync_missed(reached));
            }
            self.used_without_sync[k] = true;
            // The prepared backward is a synced one: this is not it.
            self.unreachable = None;
            return Ok(());
        }
        if let Some(unreachable) = self.unreachable.take() {
            // At the first hook, not before backward: the buckets these complete are launched
            // after the collectives that backward ran before its first gradient, as on a rank
            // that uses them (PyTorch's `autograd_hook`).
            self.unused_marked = true;
            tch::no_grad(|| {
                for j in unreachable {
                    self.mark_unused(j);
                }
            });
        }
        if self.ready[k] {
            if self.used[k] {
                // A second synced backward without `finish` (tch's `backward_step`): a loop
                // that calls nothing of DDP's learns it only from this backward's error.
                self.missed.get_or_insert(k);
                return Err(self.sync_missed(k));
            }
            // A gradient for a parameter marked unused: PyTorch's "Expected to mark a
            // variable ready only once".
            self.twice.get_or_insert(k);
            return Ok(());
        }
        self.ready[k] = true;
        self.used[k] = true;
        self.order.push(k);
        let (b, _, _) = self.locate[k];
        if self.options.overlap {
            tch::no_grad(|| self.copy_in(k, self.share()));
        }
        self.pending[b] -= 1;
        if self.launching() {
            self.launch_ready(self.buckets.len());
        }
        Ok(())
    }

    /// Fills parameter `k`'s slot for a backward that did not reach it: with the gradient it
    /// holds (accumulated in backward passes without sync), or zeros.
    fn mark_unused(&mut self, k: usize) {
        let (b, offset, numel) = self.locate[k];
        if self.params[k].1.grad().defined() {
            self.copy_in(k, self.share());
        } else {
            let _ = self.buckets[b].slot(offset, numel).zero_();
        }
        self.ready[k] = true;
        self.pending[b] -= 1;
    }

    /// What gradients are divided by on their way into a bucket: the world size where the
    /// hook asks for it ([`CommHook::scaled_on_copy`]), as PyTorch's reducer divides while
    /// it copies when no hook is registered.
    fn share(&self) -> Option<f64> {
        let world = self.pg.world_size() as f64;
        self.hook.scaled_on_copy().then_some(world)
    }

    /// Copies parameter `k`'s gradient into its bucket, its share of `divisor` if given (as
    /// PyTorch's reducer: times `1 / divisor` on the copy, divided in place when it already
    /// is a view of the bucket); with `gradient_as_bucket_view` the gradient then
    /// becomes that view. A sparse gradient (an embedding's with `sparse: true`) becomes
    /// dense first: ddp-comm has no sparse collectives, and the dense average holds the
    /// values of PyTorch's sparse one.
    fn copy_in(&self, k: usize, divisor: Option<f64>) {
        let (b, offset, numel) = self.locate[k];
        let p = &self.params[k].1;
        let mut slot = self.buckets[b].slot(offset, numel);
        let mut grad = p.grad();
        if grad.is_sparse() {
            if let Ok(dense) = grad.f_to_dense(None, false) {
                // The parameter's dtype, device and shape: set_grad cannot refuse it.
                let _ = tch_ext::set_grad(p, Some(&dense));
                grad = dense;
            }
        }
        if is_view_of(&grad, &slot) {
            if let Some(divisor) = divisor {
                let _ = slot.g_div_scalar_(divisor);
            }
            return;
        }
        match divisor {
            // One pass: read the gradient, write its share. The scale is a 0-dim tensor, as
            // PyTorch's reducer passes it: `mul.out`. tch's `mul_scalar_out` is ATen's
            // `mul.Scalar_out`, which computes into a new tensor and copies that, 8 times
            // slower for a large gradient.
            Some(divisor) => {
                let _ = grad
                    .reshape([-1])
                    .mul_out(&slot, &Tensor::from(1.0 / divisor));
            }
            None => slot.copy_(&grad.reshape([-1])),
        }
        if self.options.gradient_as_bucket_view {
            // Same dtype, device and shape as the parameter: set_grad cannot refuse it.
            let _ = tch_ext::set_grad(p, Some(&slot.view_as(p)));
        }
    }

    /// Launches the complete buckets at the head of the order, up to bucket `end` (excluded).
    fn launch_ready(&mut self, end: usize) {
        while self.next < end && self.pending[self.next] == 0 {
            let b = self.next;
            let bucket = &self.buckets[b];
            let grad_bucket = GradBucket {
                index: b,
                count: self.buckets.len(),
                scaled: self.hook.scaled_on_copy(),
                buffer: &bucket.flat,
                names: bucket
                    .members
                    .iter()
                    .map(|&(k, _, _)| self.params[k].0.as_str())
                    .collect(),
            };
            let work = self.hook.start(&self.pg, &grad_bucket);
            self.works.push(work);
            self.next += 1;
        }
    }

    /// [`DdpError::SyncMissed`] when a backward with gradient sync on has run since the last
    /// [`Reducer::finish`] (naming a parameter it reached): for the calls of DDP's that begin
    /// a step or change the model. Waits for the buckets it launched and starts afresh.
    pub(crate) fn check_finished(&mut self) -> Result<(), DdpError> {
        let Some(k) = self.reached() else {
            return Ok(());
        };
        let error = self.sync_missed(k);
        self.abandon();
        Err(error)
    }

    /// A parameter that a synced backward since the last `finish` reached (or, for want of
    /// one, marked ready): `None` when none ran.
    fn reached(&self) -> Option<usize> {
        let first = self.order.first().copied();
        first.or_else(|| self.ready.iter().position(|&r| r))
    }

    fn sync_missed(&self, k: usize) -> DdpError {
        DdpError::SyncMissed {
            rank: self.pg.rank(),
            parameter: self.params[k].0.clone(),
        }
    }

    /// Ends a step without averaging (its backward failed, or no `finish` followed it):
    /// waits for the buckets its hooks launched, ignoring their errors (the caller's is the
    /// cause), and starts afresh. PyTorch's reducer only resets its buckets at the next
    /// backward; here their collectives still use them, so they are waited for first.
    pub(crate) fn abandon(&mut self) {
        for work in self.works.drain(..) {
            let _ = work.wait();
        }
        self.reset();
    }

    /// Ends the step: see the module docs. Every rank must call it once per synced backward,
    /// with the change of its store since DDP wrapped it, if any
    /// ([`DdpError::ModelChanged`] on every rank then).
    pub(crate) fn finish(
        &mut self,
        change: Option<(String, &'static str)>,
    ) -> Result<(), DdpError> {
        let result = self.finish_step(change);
        self.reset();
        result
    }

    fn finish_step(&mut self, change: Option<(String, &'static str)>) -> Result<(), DdpError> {
        // A world of one takes the same path, as in PyTorch's DDP: the comm hook sees every
        // bucket (a compressing hook rounds the gradients), gradients become bucket views
        // when asked, and one GPU runs the whole CUDA path.
        let world = self.pg.world_size();
        // Use in a backward without sync counts only where unused parameters are expected
        // (as PyTorch's `local_used_map_`): otherwise the rebuild below would bucket only
        // what the synced backward reached, and such a parameter is an error, as in PyTorch.
        let find_unused = self.options.find_unused_parameters;
        let n = self.params.len();
        // One count per parameter, then one slot per rank, of flags: TWICE where it saw a
        // gradient twice (or a second synced backward), CHANGED where its store changed, so
        // that every rank fails alike.
        let mut used: Vec<i32> = (0..n)
            .map(|k| i32::from(self.used[k] || (find_unused && self.used_without_sync[k])))
            .collect();
        let twice = self.twice.is_some() || self.missed.is_some();
        let flags = i32::from(twice) * TWICE + i32::from(change.is_some()) * CHANGED;
        used.extend((0..world).map(|r| if r == self.pg.rank() { flags } else { 0 }));
        // Bucket by bucket: each is filled (the slots backward left, and without overlap
        // every gradient) and launched before the next is filled.
        tch::no_grad(|| {
            for b in 0..self.buckets.len() {
                for i in 0..self.buckets[b].members.len() {
                    let k = self.buckets[b].members[i].0;
                    if !self.ready[k] {
                        self.mark_unused(k);
                    } else if self.used[k] && !self.options.overlap {
                        self.copy_in(k, self.share());
                    }
                }
                self.launch_ready(b + 1);
            }
        });
        let counts = Tensor::from_slice(&used);
        let counting = self.pg.all_reduce_async(&counts, ReduceOp::Sum);
        // `works[b]` is bucket `b`'s (launched in bucket order). Its averages go into the
        // gradients this rank used (each counted on this rank, so by some rank) as soon as it
        // is waited for, while later buckets still communicate (PyTorch's
        // `finalize_backward`). So after a `ModelChanged`, `GradientTwice` or `UnusedParameters` error below
        // those gradients may hold averages already: the step is abandoned anyway.
        let mut first_error: Option<DdpError> = None;
        for (b, work) in std::mem::take(&mut self.works).into_iter().enumerate() {
            if let Err(e) = work.wait() {
                first_error.get_or_insert(e.into());
            } else if first_error.is_none() {
                first_error = tch::no_grad(|| self.copy_back_used(b)).err();
            }
        }
        if let Err(e) = counting.wait() {
            first_error.get_or_insert(e.into());
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        let counts: Vec<i32> = Vec::<i32>::try_from(&counts).map_err(DdpError::Tch)?;
        let (counts, flags) = counts.split_at(n);
        let with =
            |flag: i32| -> Vec<usize> { (0..world).filter(|&r| flags[r] & flag != 0).collect() };
        let changed = with(CHANGED);
        if !changed.is_empty() {
            return Err(DdpError::ModelChanged {
                rank: self.pg.rank(),
                change,
                ranks: changed,
            });
        }
        let ranks = with(TWICE);
        if let Some(k) = self.missed {
            return Err(self.sync_missed(k));
        }
        if !ranks.is_empty() {
            return Err(DdpError::GradientTwice {
                rank: self.pg.rank(),
                parameter: self.twice.map(|k| self.params[k].0.clone()),
                ranks,
            });
        }
        let unused: Vec<usize> = (0..n).filter(|&k| counts[k] < world as i32).collect();
        if !self.options.find_unused_parameters && !unused.is_empty() {
            return Err(self.unused_error(&unused, counts));
        }
        tch::no_grad(|| -> Result<(), DdpError> {
            for (k, &count) in counts.iter().enumerate() {
                // Used by no rank: the gradient stays as it was (none, after a zero_grad), so
                // that optimizers skip the parameter, as PyTorch's DDP leaves it.
                if !self.used[k] && count > 0 {
                    self.copy_back(k)?;
                }
            }
            Ok(())
        })?;
        if !self.rebuilt && !self.options.find_unused_parameters {
            self.rebuild()?;
        }
        Ok(())
    }

    /// Copies bucket `b`'s averages into the gradients of its members that this rank used.
    fn copy_back_used(&self, b: usize) -> Result<(), DdpError> {
        for &(k, _, _) in &self.buckets[b].members {
            if self.used[k] {
                self.copy_back(k)?;
            }
        }
        Ok(())
    }

    /// Makes parameter `k`'s gradient its average in the bucket: as it is when it views its
    /// slot, by becoming that view with `gradient_as_bucket_view`, otherwise by a copy (into
    /// zeros where it had none).
    fn copy_back(&self, k: usize) -> Result<(), DdpError> {
        let (b, offset, numel) = self.locate[k];
        let p = &self.params[k].1;
        let slot = self.buckets[b].slot(offset, numel);
        let mut grad = p.grad();
        if is_view_of(&grad, &slot) {
            return Ok(());
        }
        if self.options.gradient_as_bucket_view {
            tch_ext::set_grad(p, Some(&slot.view_as(p)))?;
            return Ok(());
        }
        if !grad.defined() {
            grad = p.zeros_like();
            tch_ext::set_grad(p, Some(&grad))?;
        }
        grad.copy_(&slot.view_as(&grad));
        Ok(())
    }

    /// The parameters (by index) in the order the buckets were rebuilt in, once they were.
    pub(crate) fn rebuilt_order(&self) -> Option<Vec<usize>> {
        self.rebuilt.then(|| {
            self.buckets
                .iter()
                .flat_map(|b| b.members.iter().map(|&(k, _, _)| k))
                .collect()
        })
    }

    /// Buckets in `order` (every parameter once), as a rebuild after the first step would
    /// have left them: a resumed run continues with the buckets it was checkpointed with.
    pub(crate) fn restore_order(&mut self, order: &[usize]) {
        self.set_buckets(order);
        self.rebuilt = true;
    }

    /// After the first step: buckets in the order in which gradients became ready on rank 0
    /// (PyTorch rebuilds its buckets once, the same way, unless unused parameters are
    /// expected). Every rank takes rank 0's order, so that the buckets agree.
    fn rebuild(&mut self) -> Result<(), DdpError> {
        let mut order: Vec<i64> = self.order.iter().map(|&k| k as i64).collect();
        self.pg.broadcast_slice(&mut order, 0)?;
        let order: Vec<usize> = order.into_iter().map(|k| k as usize).collect();
        self.set_buckets(&order);
        self.rebuilt = true;
        if self.options.gradient_as_bucket_view {
            // The gradients viewed the old buckets: move them into the new ones.
            tch::no_grad(|| {
                for k in 0..self.params.len() {
                    if self.params[k].1.grad().defined() {
                        // Averaged already: moved as they are.
                        self.copy_in(k, None);
                    }
                }
            });
        }
        Ok(())
    }

    /// The error for parameters some rank did not use. Every rank returns one (the counts are
    /// the same everywhere); which one depends on this rank's own backward passes only.
    fn unused_error(&self, unused: &[usize], counts: &[i32]) -> DdpError {
        let synced = self.used.iter().any(|&u| u);
        let unsynced = self.used_without_sync.iter().position(|&u| u);
        if !synced {
            let rank = self.pg.rank();
            return match unsynced {
                // Not a parameter this rank skips: the backward that should have synced ran
                // without.
                Some(k) => DdpError::NoSyncedBackward {
                    rank,
                    parameter: self.params[k].0.clone(),
                },
                // No backward at all: a second call for one (`backward` calls it already).
                None => DdpError::SyncWithoutBackward { rank },
            };
        }
        let world = self.pg.world_size();
        DdpError::UnusedParameters {
            rank: self.pg.rank(),
            world_size: world,
            parameters: unused
                .iter()
                .map(|&k| (self.params[k].0.clone(), counts[k] as usize))
                .collect(),
        }
    }
}

/// Whether `grad` is `slot` itself (a view of the same bucket elements).
fn is_view_of(grad: &Tensor, slot: &Tensor) -> bool {
    grad.defined() && grad.data_ptr() == slot.data_ptr() && grad.numel() == slot.numel()
}
