//! [`DistributedDataParallel`]: keeps the replicas of one model identical across ranks.

mod broadcast;
mod bucket;
mod comm_hook;
mod error;
#[cfg(test)]
pub(crate) use comm_hook::gpu_tests;
mod params;
// For the ODIR application's scoring, which every rank must run on the same type of device.
#[cfg(feature = "odir")]
pub(crate) use params::device_type;
pub(crate) use params::trainable_parameters;
mod reducer;
mod watch;

use std::sync::{Arc, Mutex, MutexGuard};

use ddp_comm::ProcessGroup;
use tch::{nn::VarStore, Tensor};

use broadcast::{broadcast_tensors, sync_module_states, Wait, BROADCAST_BUCKET_BYTES};
use bucket::{make_buckets, Bucket};
pub use comm_hook::{BuiltinHook, CommHook, GradBucket, HookWork};
pub use error::DdpError;
use params::{split_named, verify_same_model, Split};
use reducer::Reducer;
use watch::StoreWatch;

/// Settings of [`DistributedDataParallel`], and the Trainer's DDP settings
/// ([`Settings::ddp`](crate::Settings::ddp); with feature `cli`, their flags).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(default)]
pub struct DdpOptions {
    /// The bytes at which a gradient bucket closes (PyTorch's `bucket_cap_mb`, default 25
    /// MiB); a bucket passes it by at most its last tensor.
    #[cfg_attr(feature = "cli", arg(skip = DdpOptions::default().bucket_cap_bytes))]
    pub bucket_cap_bytes: usize,
    /// The same for the first bucket in reduction order (PyTorch's 1 MiB), so that the
    /// gradients ready first start communicating early: from the first step on (the
    /// parameters last in name order, see [`DistributedDataParallel`]'s bucket order) and
    /// after the rebuild (the gradients that were ready first). PyTorch uses it for its
    /// rebuilt buckets; in its first step it has one bucket of everything, or, with
    /// `find_unused_parameters` (never rebuilt), a small bucket of the parameters defined
    /// first, reduced last. PyTorch keeps 1 MiB only while `bucket_cap_mb` is left at its
    /// default, and otherwise uses the cap for the first bucket too: to do as PyTorch does
    /// with another cap, set both.
    #[cfg_attr(feature = "cli", arg(skip = DdpOptions::default().first_bucket_cap_bytes))]
    pub first_bucket_cap_bytes: usize,
    /// Broadcast rank 0's buffers before each training step's first forward (PyTorch's
    /// default: true).
    /// Off (PyTorch's `broadcast_buffers=False`): each rank keeps its own buffers, not even
    /// broadcast by `new` or `rebuild` (their shapes are still checked against rank 0's).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "ddp.broadcast_buffers",
            long = "no-broadcast-buffers",
            action = clap::ArgAction::SetFalse,
            help = "Keep each rank's own buffers (BatchNorm statistics) instead of \
                    broadcasting rank 0's at the start and before each training step \
                    (PyTorch DDP's broadcast_buffers=False)"
        )
    )]
    pub broadcast_buffers: bool,
    /// Allow parameters that get no gradient on some or all ranks in a step (PyTorch's
    /// `find_unused_parameters`): they count as zeros in the average, and those used by no
    /// rank keep no gradient. Off: such a parameter is an error on every rank.
    ///
    /// With it, buckets are reduced while backward runs only in a backward whose loss was
    /// given to [`DistributedDataParallel::prepare_for_backward`] first (the Trainer does);
    /// otherwise every bucket waits for `sync_gradients`: the same results without the
    /// overlap. Otherwise a bucket holding a parameter that this rank skips would wait for
    /// `sync_gradients`, after the collectives that backward runs itself (SyncBatchNorm's,
    /// [`all_reduce_sum`](crate::functional::all_reduce_sum)), while a rank that uses the
    /// parameter launches it before them: the ranks' collectives would cross.
    ///
    /// "Used" means that the parameter's post-accumulate-grad hook ran in a backward.
    /// libtorch does not run it when the gradient reaching the parameter is undefined (a
    /// backward function returned none for that input), where PyTorch's DDP, hooked into the
    /// autograd engine, counts the parameter as used all the same: such a parameter is
    /// unused here, and its bucket waits for `sync_gradients`. Where another rank's
    /// gradient for it is defined and backward runs collectives itself, the ranks'
    /// collectives cross and fail at the timeout: return a zero gradient, not none.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "ddp.find_unused_parameters",
            long = "find-unused-parameters",
            // The notes below are the library's, not the command line's.
            long_help = None,
            help = "Allow parameters that get no gradient on some ranks in a step (PyTorch \
                    DDP's find_unused_parameters): they count as zeros in the average"
        )
    )]
    pub find_unused_parameters: bool,
    /// Reduce each bucket while backward still runs (default). Off: after backward, with
    /// the same buckets and bit-identical results.
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "ddp.overlap",
            long = "no-overlap",
            action = clap::ArgAction::SetFalse,
            help = "Reduce gradients after backward instead of while it runs (for comparison)"
        )
    )]
    pub overlap: bool,
    /// How buckets are averaged (replace with [`DistributedDataParallel::register_comm_hook`]
    /// for a hook of your own).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "ddp.comm_hook",
            long = "comm-hook",
            value_name = "HOOK",
            default_value_t = DdpOptions::default().comm_hook,
            help = "How gradient buckets are averaged: allreduce, bf16_compress or \
                    fp16_compress (half the bytes on the wire, half-precision averages)"
        )
    )]
    pub comm_hook: BuiltinHook,
    /// Make each gradient a view into its bucket (PyTorch's `gradient_as_bucket_view`): the
    /// averages land in the gradients without a copy back, and a gradient takes no memory of
    /// its own. The first copy into the bucket remains whenever autograd hands over a fresh
    /// gradient (after `zero_grad` to none, every step).
    #[cfg_attr(
        feature = "cli",
        arg(
            id = "ddp.gradient_as_bucket_view",
            long = "gradient-as-bucket-view",
            help = "Make each gradient a view into its DDP bucket (PyTorch DDP's \
                    gradient_as_bucket_view): no copy back after the average, no memory of \
                    its own"
        )
    )]
    pub gradient_as_bucket_view: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            bucket_cap_bytes: 25 * 1024 * 1024,
            first_bucket_cap_bytes: 1024 * 1024,
            broadcast_buffers: true,
            find_unused_parameters: false,
            overlap: true,
            comm_hook: BuiltinHook::Allreduce,
            gradient_as_bucket_view: false,
        }
    }
}

/// Tensors with their names.
type Named = Vec<(String, Tensor)>;

/// Wraps a model's [`VarStore`] so that all ranks train one model. See the module docs.
///
/// `DistributedDataParallel`: keeps the replicas of one model identical across ranks.
///
/// What it does, and when:
///
/// - [`DistributedDataParallel::new`]: every rank sends a digest of a description of its
///   model (its devices' type, each tensor's name, shape and dtype, in name order); where one
///   differs from rank 0's, every rank gets an error naming that rank's devices or first
///   differing tensor. Then rank 0's parameters and buffers
///   (buffers only with [`DdpOptions::broadcast_buffers`]) are broadcast, coalesced by dtype
///   into messages of at most 250 MiB (PyTorch's `broadcast_bucket_size`; a larger tensor
///   alone), so all replicas start equal whatever each rank initialised. Finally a
///   post-accumulate-grad hook (through `tch-ext`, a small C++ shim: tch has no autograd
///   hooks) is set on every parameter. Each tensor object is one parameter: a weight tied
///   under several names, under the first (PyTorch takes each parameter object once). A
///   model without a parameter that trains is [`DdpError::NothingToTrain`].
/// - [`DistributedDataParallel::broadcast_buffers`]: before each training step and before
///   evaluating, rank 0's buffers (BatchNorm running statistics) overwrite the others', as
///   PyTorch's default `broadcast_buffers=True` does.
/// - During backward, as PyTorch's `Reducer` does: each parameter's hook copies its gradient
///   into its flat bucket (at most [`DdpOptions::bucket_cap_bytes`], the first at most
///   [`DdpOptions::first_bucket_cap_bytes`]); a complete bucket is handed to the
///   communication hook ([`CommHook`], by default scaled by `1/world size` and summed), which starts an
///   asynchronous collective and returns at once, so communication runs while backward
///   computes the remaining gradients. Buckets are launched strictly in bucket order, so
///   every rank issues the same collectives in the same order. With
///   `find_unused_parameters`, only after [`DistributedDataParallel::prepare_for_backward`].
/// - [`DistributedDataParallel::sync_gradients`], after backward: parameters that got no
///   gradient on this rank contribute zeros, the remaining buckets are launched, the ranks
///   count who used each parameter (one small all-reduce), and each bucket's averages are
///   written into the gradients once it is waited for. Parameters used by no rank keep none
///   (optimizers skip them). A sparse gradient becomes dense first (ddp-comm has no sparse
///   collectives; the averages are PyTorch's). With [`DdpOptions::find_unused_parameters`] off, a parameter
///   missing on any rank is an error on every rank ([`DdpError::UnusedParameters`], naming it,
///   or [`DdpError::NoSyncedBackward`] on a rank whose backward passes all ran without sync,
///   [`DdpError::SyncWithoutBackward`] on one where none reached a parameter since the last
///   call); no rank is left waiting. Another step's call of DDP's, or a backward without
///   sync, after a synced backward is [`DdpError::SyncMissed`]: tch's `backward_step` cannot
///   be used, but [`DistributedDataParallel::backward`] can (backward, then
///   `sync_gradients`).
///
/// Bucket order: at first, reverse parameter order (by name), grouped from the last name
/// on, so that the first bucket ([`DdpOptions::first_bucket_cap_bytes`]) holds the last
/// layers, whose gradients backward usually produces first; within a bucket too the
/// parameters lie in reverse order. After the first step the buckets are rebuilt once in
/// the order gradients became ready on rank 0 (every rank takes rank 0's), the first one
/// again small, unless `find_unused_parameters` is on. PyTorch rebuilds alike, but its first
/// step differs: without `find_unused_parameters` it reduces one bucket of everything; with
/// it, it groups the parameters in definition order (the small bucket holding the first
/// ones), keeps each bucket's members in that order and reduces the buckets in reverse, the
/// small one last. tch's `VarStore` keeps no definition order (names order it here), and a
/// first step in several buckets overlaps too. The averages are the same; with three ranks
/// or more the ring's order of summation, so the last bits, follows the layout.
///
/// Gradient accumulation (PyTorch's `no_sync`): run the backward of every micro-batch but the
/// last with [`DistributedDataParallel::set_require_gradient_sync`] off (or inside
/// [`DistributedDataParallel::no_sync`]), each loss scaled by 1/K, then the last one with it
/// on, and `sync_gradients` once: one step on a K-times larger batch, communicating once.
///
/// With [`DdpOptions::overlap`] off, the hooks only note which parameters got a gradient and
/// every bucket is copied and reduced in `sync_gradients`, after backward: the same buckets,
/// the same collectives, bit for bit the same results, without the overlap.
///
/// Order: parameters are ordered by name with numeric components compared as numbers
/// (`features.4` before `features.12`), never by `VarStore::variables()`, whose `HashMap`
/// order differs between processes.
#[derive(Debug)]
pub struct DistributedDataParallel {
    pg: Arc<ProcessGroup>,
    options: DdpOptions,
    params: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
    reducer: Arc<Mutex<Reducer>>,
    buffer_buckets: Vec<Bucket>,
    store: StoreWatch,
    /// Whether this value's hooks are set on its parameters (dropping it clears them).
    hooked: bool,
}

impl DistributedDataParallel {
    /// Checks that every rank holds the same model, broadcasts rank 0's parameters and
    /// buffers (buffers only with [`DdpOptions::broadcast_buffers`]), and hooks every
    /// parameter. Every rank must call this at the same point.
    ///
    /// A parameter can carry one DDP's hook at a time: while another
    /// `DistributedDataParallel` over the same parameters is alive, this is
    /// [`DdpError::AlreadyHooked`] (drop the old one first, or call its
    /// [`rebuild`](DistributedDataParallel::rebuild)); dropping a DDP clears its hooks.
    pub fn new(
        vs: &VarStore,
        pg: Arc<ProcessGroup>,
        options: DdpOptions,
    ) -> Result<Self, DdpError> {
        let mut ddp = Self::unhooked(vs, pg, options, &[], BROADCAST_BUCKET_BYTES)?;
        ddp.hook()?;
        Ok(ddp)
    }

    /// What [`DistributedDataParallel::new`] does but for setting the hooks: the collectives
    /// and checks. Parameters that share a tensor with `ours` may carry a hook already (that
    /// of the DDP being rebuilt). The first broadcast goes in buckets of `cap` bytes.
    fn unhooked(
        vs: &VarStore,
        pg: Arc<ProcessGroup>,
        options: DdpOptions,
        ours: &[(String, Tensor)],
        cap: usize,
    ) -> Result<Self, DdpError> {
        let split = split_named(vs);
        // By name and storage: a parameter without elements has no storage of its own.
        let ours: std::collections::HashMap<&str, usize> = ours
            .iter()
            .map(|(n, t)| (n.as_str(), t.data_ptr() as usize))
            .collect();
        let is_ours = |name: &str, p: &Tensor| {
            ours.get(name)
                .is_some_and(|&ptr| p.numel() == 0 || ptr == p.data_ptr() as usize)
        };
        let mut hooked = None;
        for (name, p) in &split.params {
            if !is_ours(name, p) && tch_ext::has_post_accumulate_grad_hook(p)? {
                hooked = Some(name.clone());
                break;
            }
        }
        // A hook on some ranks only is a difference between the models: no rank is left
        // waiting in the broadcast below.
        verify_same_model(&pg, &split, hooked.as_deref())?;
        if let Some(name) = hooked {
            return Err(DdpError::AlreadyHooked(name));
        }
        let Split {
            params,
            frozen,
            buffers,
            ..
        } = split;
        if params.is_empty() {
            // After the comparison: every rank holds this model, and fails alike.
            return Err(DdpError::NothingToTrain {
                frozen: frozen.len(),
            });
        }

        // Initial broadcast of everything, in buckets of at most `cap` bytes; the buffers
        // only with `broadcast_buffers` (PyTorch's `False` leaves them out here too).
        let everything: Vec<(String, Tensor)> = params
            .iter()
            .chain(frozen.iter())
            .chain(buffers.iter().filter(|_| options.broadcast_buffers))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        tch::no_grad(|| sync_module_states(&pg, &everything, cap))?;

        let buffer_order: Vec<usize> = (0..buffers.len()).collect();
        let buffer_buckets = make_buckets(&buffers, &buffer_order, usize::MAX, usize::MAX);
        let for_reducer: Named = params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let reducer = Arc::new(Mutex::new(Reducer::new(
            pg.clone(),
            Arc::new(options.comm_hook),
            for_reducer,
            options,
        )));
        Ok(Self {
            pg,
            options,
            params,
            buffers,
            reducer,
            buffer_buckets,
            store: StoreWatch::new(vs, frozen),
            hooked: false,
        })
    }

    /// Sets every parameter's hook; on failure, clears them again.
    fn hook(&mut self) -> Result<(), DdpError> {
        self.hooked = true;
        for (k, (_, p)) in self.params.iter().enumerate() {
            // The hook holds the reducer weakly: dropping the DDP ends it.
            let weak = Arc::downgrade(&self.reducer);
            let set = tch_ext::set_fallible_post_accumulate_grad_hook(p, move |_| {
                let Some(reducer) = weak.upgrade() else {
                    return Ok(());
                };
                let marked = lock(&reducer).mark_ready(k);
                marked.map_err(|e| e.to_string())
            });
            if let Err(e) = set {
                self.unhook();
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Clears the hooks this value set, if it set them.
    fn unhook(&mut self) {
        if std::mem::take(&mut self.hooked) {
            for (_, p) in &self.params {
                let _ = tch_ext::clear_post_accumulate_grad_hook(p);
            }
        }
    }

    /// The process group.
    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    /// The options this DDP was built with.
    pub fn options(&self) -> &DdpOptions {
        &self.options
    }

    /// Trainable parameters in DDP order (by name, numbers compared as numbers).
    pub fn parameters(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// Buffers (the store's tensors that are not parameters, such as BatchNorm statistics)
    /// in DDP order. Frozen parameters (variables created trainable whose `requires_grad` is
    /// off) are neither parameters nor buffers here: broadcast once by
    /// [`DistributedDataParallel::new`], never bucketed, never broadcast again (PyTorch's
    /// DDP skips parameters without `requires_grad`).
    pub fn buffers(&self) -> &[(String, Tensor)] {
        &self.buffers
    }

    /// Wraps the store again after parameters were added, frozen or unfrozen (as a PyTorch user
    /// wraps the model in a new `DistributedDataParallel`): does what
    /// [`DistributedDataParallel::new`] does with the same options and communication hook,
    /// then moves the hooks from the current parameters to the new ones. Every rank must
    /// call this at the same point. On error this DDP stays as it was, hooks included.
    pub fn rebuild(&mut self, vs: &VarStore) -> Result<(), DdpError> {
        lock(&self.reducer).check_finished()?;
        let mut fresh = Self::unhooked(
            vs,
            self.pg.clone(),
            self.options,
            &self.params,
            BROADCAST_BUCKET_BYTES,
        )?;
        lock(&fresh.reducer).hook = lock(&self.reducer).hook.clone();
        self.unhook();
        if let Err(e) = fresh.hook() {
            // libtorch refuses a hook only on a tensor that is not a leaf requiring grad,
            // which these parameters were when this DDP hooked them.
            let _ = self.hook();
            return Err(e);
        }
        // The old value, unhooked, clears nothing when dropped.
        *self = fresh;
        Ok(())
    }

    /// The sizes in bytes of the gradient buckets, in reduction order.
    pub fn bucket_sizes(&self) -> Vec<usize> {
        lock(&self.reducer)
            .buckets
            .iter()
            .map(Bucket::bytes)
            .collect()
    }

    /// The parameter names in the order the buckets were rebuilt in after the first step
    /// (`None` before it, or when buckets are not rebuilt, with `find_unused_parameters`):
    /// what a checkpoint keeps so that a resumed run reduces in the same buckets
    /// ([`DistributedDataParallel::restore_bucket_order`]). With three ranks or more the
    /// ring sums each element in an order that depends on where it lies in its bucket.
    pub fn bucket_order(&self) -> Option<Vec<String>> {
        let order = lock(&self.reducer).rebuilt_order()?;
        Some(
            order
                .into_iter()
                .map(|k| self.params[k].0.clone())
                .collect(),
        )
    }

    /// Lays the buckets out in `names`' order as the first step's rebuild would, when
    /// `names` is exactly this model's trainable parameters (each once) and buckets are
    /// rebuilt at all; returns whether it did. Every rank must give the same order (a
    /// checkpoint's).
    ///
    /// # Errors
    ///
    /// [`DdpError::SyncMissed`] after a synced backward that no `sync_gradients` followed:
    /// its buckets may still be in flight, and laying them out anew would lose them.
    pub fn restore_bucket_order(&mut self, names: &[String]) -> Result<bool, DdpError> {
        lock(&self.reducer).check_finished()?;
        if self.options.find_unused_parameters || names.len() != self.params.len() {
            return Ok(false);
        }
        let index: std::collections::HashMap<&str, usize> = self
            .params
            .iter()
            .enumerate()
            .map(|(k, (n, _))| (n.as_str(), k))
            .collect();
        let order: Option<Vec<usize>> = names
            .iter()
            .map(|n| index.get(n.as_str()).copied())
            .collect();
        let Some(order) = order else {
            return Ok(false);
        };
        let mut seen = vec![false; order.len()];
        if order.iter().any(|&k| std::mem::replace(&mut seen[k], true)) {
            return Ok(false);
        }
        lock(&self.reducer).restore_order(&order);
        Ok(true)
    }

    /// The parameter names of each gradient bucket, in reduction order.
    pub fn bucket_parameters(&self) -> Vec<Vec<String>> {
        let reducer = lock(&self.reducer);
        reducer
            .buckets
            .iter()
            .map(|b| {
                b.members
                    .iter()
                    .map(|&(k, _, _)| self.params[k].0.clone())
                    .collect()
            })
            .collect()
    }

    /// Replaces the communication hook (PyTorch's `register_comm_hook`). Call on every rank,
    /// before the first backward.
    pub fn register_comm_hook(&mut self, hook: Arc<dyn CommHook>) {
        lock(&self.reducer).hook = hook;
    }

    /// Turns gradient synchronisation of the following backward passes on or off (PyTorch's
    /// `require_backward_grad_sync`, set by `no_sync`). Off, gradients accumulate locally and
    /// nothing is communicated; the backward that completes an accumulated step must run
    /// with it on.
    pub fn set_require_gradient_sync(&mut self, on: bool) {
        lock(&self.reducer).require_sync = on;
    }

    /// Runs `f` (micro-batches' backward passes) with gradient sync off, as PyTorch's
    /// `with ddp.no_sync():`, then turns it back to what it was, also when `f` panics.
    pub fn no_sync<R>(&mut self, f: impl FnOnce() -> R) -> R {
        /// Puts the flag back when dropped.
        struct Restore<'a>(&'a Mutex<Reducer>, bool);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                lock(self.0).require_sync = self.1;
            }
        }
        let before = std::mem::replace(&mut lock(&self.reducer).require_sync, false);
        let _restore = Restore(&self.reducer, before);
        f()
    }

    /// Broadcasts rank 0's buffers to every rank (a no-op when disabled in the options).
    /// Call before the first forward of each training step (not before the other
    /// micro-batches of an accumulated step) and before evaluating: where PyTorch's DDP
    /// syncs them, in the first forward after a forward whose backward synchronised.
    pub fn broadcast_buffers(&mut self) -> Result<(), DdpError> {
        lock(&self.reducer).check_finished()?;
        if !self.options.broadcast_buffers {
            return Ok(());
        }
        tch::no_grad(|| {
            broadcast_tensors(&self.pg, &self.buffers, &self.buffer_buckets, Wait::Stream)
        })
    }

    /// Finds the parameters that the backward from `loss` cannot reach, before it runs
    /// (PyTorch's `prepare_for_backward`, which its DDP calls in `forward` on the outputs):
    /// the first gradient hook of that backward marks them ready, so that buckets are reduced
    /// while backward runs, in the same order as the collectives of backward itself on every
    /// rank (as PyTorch orders them). Call it after the forward and loss, on the tensor
    /// backward runs from (the scaled loss, with a `GradScaler`), when
    /// [`DdpOptions::find_unused_parameters`] is on; it does nothing otherwise, nor when
    /// overlap or gradient sync is off. Without it, such a backward reduces nothing until
    /// [`DistributedDataParallel::sync_gradients`] (see that option). It holds for the next
    /// synced backward only.
    ///
    /// A parameter it finds unreachable that still gets a gradient in that backward (backward
    /// ran from another tensor) is [`DdpError::GradientTwice`] in `sync_gradients`. One that
    /// it finds reachable but that gets no gradient (an undefined one reached it) keeps its
    /// bucket waiting until `sync_gradients`, as without this call.
    ///
    /// # Errors
    ///
    /// [`DdpError::Shim`] when `loss` is undefined.
    pub fn prepare_for_backward(&mut self, loss: &Tensor) -> Result<(), DdpError> {
        lock(&self.reducer).check_finished()?;
        let wanted = self.options.find_unused_parameters
            && self.options.overlap
            && lock(&self.reducer).require_sync;
        if !wanted {
            return Ok(());
        }
        let params: Vec<&Tensor> = self.params.iter().map(|(_, t)| t).collect();
        let reached = tch_ext::reachable_leaves(loss, &params)?;
        lock(&self.reducer).prepare(&reached);
        Ok(())
    }

    /// Completes the averaging of every parameter's gradient over all ranks. Call after the
    /// backward that ran with gradient sync on, before the optimizer step.
    ///
    /// With NCCL the gradients' stream waits for the all-reduces; the host does not. A
    /// communicator aborted meanwhile (a hung peer) leaves them half-reduced: after reading
    /// something that follows them (a loss, a norm), call the process group's `usable`
    /// before the optimizer step, as the Trainer does.
    ///
    /// # Errors
    ///
    /// [`DdpError::ModelChanged`] on every rank when the store changed on one since this DDP
    /// wrapped it (a buffer added counts with [`DdpOptions::broadcast_buffers`]); see
    /// [`DdpError`] for the others.
    pub fn sync_gradients(&mut self) -> Result<(), DdpError> {
        let with_buffers = self.options.broadcast_buffers;
        let change = self.store.check(&self.params, &self.buffers, with_buffers);
        lock(&self.reducer).finish(change)
    }

    /// The backward pass of a step, for a loop of your own: `prepare_for_backward(loss)`,
    /// `loss.backward()`, then, with gradient sync on, `sync_gradients` (what PyTorch's DDP
    /// does by itself at the end of backward). Use it where tch's `backward_step` would be:
    /// `opt.zero_grad(); ddp.backward(&loss)?; opt.step();`.
    pub fn backward(&mut self, loss: &Tensor) -> Result<(), DdpError> {
        self.prepare_for_backward(loss)?;
        if let Err(e) = loss.f_backward() {
            self.abandon_step();
            return Err(e.into());
        }
        if lock(&self.reducer).require_sync {
            self.sync_gradients()?;
        }
        Ok(())
    }

    /// Ends a step whose backward pass failed after some gradients' hooks ran (an error of
    /// `loss.f_backward()` in a loop of your own): forgets the step and waits for the buckets
    /// it launched, ignoring their errors, so that the next call is not
    /// [`DdpError::SyncMissed`]. Start the next step with `zero_grad`.
    /// [`DistributedDataParallel::backward`] and the Trainer call it themselves. A peer that
    /// launched fewer buckets leaves the wait to the collective timeout.
    pub fn abandon_step(&mut self) {
        lock(&self.reducer).abandon();
    }
}

impl Drop for DistributedDataParallel {
    fn drop(&mut self) {
        self.unhook();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddp_model::checkpoint::natural_cmp;

    /// A group of one rank.
    fn alone() -> Arc<ProcessGroup> {
        let port = ddp_testkit::free_port();
        Arc::new(ProcessGroup::new(ddp_comm::Options::new(0, 1, "127.0.0.1", port)).unwrap())
    }

    /// `f(rank, group)` on each of `world` ranks, threads of this process meeting on
    /// loopback with a secret of their own; the results in rank order.
    pub(super) fn on_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(usize, Arc<ProcessGroup>) -> T + Send + Clone + 'static,
    ) -> Vec<T> {
        let port = ddp_testkit::free_port();
        let secret = ddp_comm::Secret::from_hex(&"5e".repeat(16)).unwrap();
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let (f, secret) = (f.clone(), secret.clone());
                std::thread::spawn(move || {
                    let options =
                        ddp_comm::Options::new(rank, world, "127.0.0.1", port).with_secret(secret);
                    f(rank, Arc::new(ProcessGroup::new(options).unwrap()))
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap()).collect()
    }

    /// A frozen parameter is neither bucketed nor broadcast with the buffers.
    #[test]
    fn frozen_parameters_are_neither_parameters_nor_buffers() {
        let vs = VarStore::new(tch::Device::Cpu);
        let root = vs.root();
        let _a = root.var("a", &[2], tch::nn::Init::Const(1.0));
        let b = root.var("b", &[3], tch::nn::Init::Const(1.0));
        let _ = b.set_requires_grad(false);
        let _c = root.zeros_no_train("c", &[4]);
        let names = |v: &Named| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        let Split {
            params,
            frozen,
            buffers,
            ..
        } = split_named(&vs);
        assert_eq!(
            (names(&params), names(&frozen), names(&buffers)),
            (vec!["a".into()], vec!["b".into()], vec!["c".to_string()])
        );
    }

    /// After a parameter is unfrozen, `rebuild` buckets and hooks it, once: a step's
    /// backward reduces every gradient without a second hook firing.
    #[test]
    fn rebuild_takes_an_unfrozen_parameter_in() {
        let pg = alone();
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let b = vs.root().var("b", &[3], tch::nn::Init::Const(1.0));
        let _ = b.set_requires_grad(false);
        let mut ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default()).unwrap();
        assert_eq!(ddp.bucket_parameters(), [vec!["a".to_string()]]);
        let _ = b.set_requires_grad(true);
        ddp.rebuild(&vs).unwrap();
        assert_eq!(ddp.parameters().len(), 2);
        assert_eq!(
            ddp.bucket_parameters(),
            [vec!["b".to_string(), "a".to_string()]]
        );
        for _ in 0..2 {
            for (_, p) in ddp.parameters() {
                tch_ext::set_grad(p, None).unwrap();
            }
            (a.sum(tch::Kind::Float) * 2.0 + b.sum(tch::Kind::Float) * 3.0).backward();
            ddp.sync_gradients().unwrap();
            assert_eq!(Vec::<f32>::try_from(&b.grad()).unwrap(), [3.0; 3]);
            assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2]);
        }
    }

    /// The first step rebuilds the buckets in the order gradients became ready; a new DDP
    /// given that order (a resumed run's) starts with the same buckets.
    #[test]
    fn a_restored_bucket_order_is_the_rebuilt_one() {
        let pg = alone();
        // 300 floats are 1200 bytes: each parameter fills a bucket.
        let options = DdpOptions {
            bucket_cap_bytes: 1200,
            first_bucket_cap_bytes: 1200,
            ..DdpOptions::default()
        };
        let model = || {
            let vs = VarStore::new(tch::Device::Cpu);
            for name in ["a", "b", "c"] {
                let _ = vs.root().var(name, &[300], tch::nn::Init::Const(1.0));
            }
            vs
        };
        let one_each = |names: [&str; 3]| names.map(|n| vec![n.to_string()]).to_vec();
        let vs = model();
        let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), options).unwrap();
        assert_eq!(ddp.bucket_parameters(), one_each(["c", "b", "a"]));
        assert_eq!(ddp.bucket_order(), None);
        // c is used first, a last: backward makes a's gradient first.
        let v = vs.variables();
        (Tensor::ones([300], (tch::Kind::Float, tch::Device::Cpu)) * &v["c"] * &v["b"] * &v["a"])
            .sum(tch::Kind::Float)
            .backward();
        ddp.sync_gradients().unwrap();
        assert_eq!(ddp.bucket_parameters(), one_each(["a", "b", "c"]));
        let order = ddp.bucket_order().unwrap();
        assert_eq!(order, ["a", "b", "c"]);

        let vs = model();
        let mut resumed = DistributedDataParallel::new(&vs, pg, options).unwrap();
        let wrong = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        for bad in [&["a", "b"][..], &["a", "a", "c"], &["a", "b", "x"]] {
            assert!(
                !resumed.restore_bucket_order(&wrong(bad)).unwrap(),
                "{bad:?}"
            );
        }
        assert_eq!(resumed.bucket_parameters(), one_each(["c", "b", "a"]));
        assert!(resumed.restore_bucket_order(&order).unwrap());
        assert_eq!(resumed.bucket_parameters(), one_each(["a", "b", "c"]));
        assert_eq!(resumed.bucket_order().unwrap(), order);
    }

    /// Without `find_unused_parameters`, a parameter that only a micro-batch without sync
    /// used is unused in the synced step: an error naming it, as in PyTorch, not a rebuild
    /// of the buckets without it.
    #[test]
    fn a_parameter_used_only_without_sync_needs_find_unused_parameters() {
        let pg = alone();
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let b = vs.root().var("b", &[3], tch::nn::Init::Const(1.0));
        let mut ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default()).unwrap();
        ddp.set_require_gradient_sync(false);
        b.sum(tch::Kind::Float).backward();
        ddp.set_require_gradient_sync(true);
        a.sum(tch::Kind::Float).backward();
        match ddp.sync_gradients() {
            Err(DdpError::UnusedParameters { parameters, .. }) => {
                assert_eq!(parameters, [("b".to_string(), 0)]);
            }
            other => panic!("expected UnusedParameters, got {other:?}"),
        }
    }

    /// `sync_gradients` after backward passes without sync only is the mistake it names, not
    /// parameters to allow with `find_unused_parameters`.
    #[test]
    fn sync_gradients_after_backward_without_sync_only_says_so() {
        let pg = alone();
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let b = vs.root().var("b", &[3], tch::nn::Init::Const(1.0));
        let mut ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default()).unwrap();
        ddp.no_sync(|| b.sum(tch::Kind::Float).backward());
        ddp.no_sync(|| a.sum(tch::Kind::Float).backward());
        match ddp.sync_gradients() {
            Err(e @ DdpError::NoSyncedBackward { .. }) => assert!(
                e.to_string().starts_with(
                    "rank 0: sync_gradients followed backward passes with gradient sync off \
                     only (parameter 'a' got a gradient in one, none with sync on): run the \
                     last micro-batch's backward with gradient sync on"
                ),
                "{e}"
            ),
            other => panic!("expected NoSyncedBackward, got {other:?}"),
        }
    }

    /// tch's `backward_step` (zero_grad, backward, step) never averages: the DDP call after
    /// it is `SyncMissed`, naming a parameter, whichever call that is, and the step after
    /// the error is whole again; `DistributedDataParallel::backward` is the step's backward.
    #[test]
    fn a_synced_backward_without_sync_gradients_fails_the_next_call() {
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let mut ddp = DistributedDataParallel::new(&vs, alone(), DdpOptions::default()).unwrap();
        let mut opt = tch::nn::OptimizerConfig::build(tch::nn::Sgd::default(), &vs, 0.5).unwrap();
        let loss = || a.sum(tch::Kind::Float) * 2.0;
        type Call = fn(&mut DistributedDataParallel, &VarStore, &Tensor) -> Result<(), DdpError>;
        let calls: [(&str, Call); 5] = [
            ("broadcast_buffers", |d, _, _| d.broadcast_buffers()),
            ("restore_bucket_order", |d, _, _| {
                d.restore_bucket_order(&["a".to_string()]).map(|_| ())
            }),
            ("prepare_for_backward", |d, _, l| d.prepare_for_backward(l)),
            ("rebuild", |d, vs, _| d.rebuild(vs)),
            ("backward", |d, _, l| d.backward(l)),
        ];
        for (name, call) in calls {
            opt.backward_step(&loss());
            match call(&mut ddp, &vs, &loss()) {
                Err(e @ DdpError::SyncMissed { .. }) => assert!(
                    e.to_string().starts_with(
                        "rank 0: a backward pass with gradient sync on reached parameter 'a' \
                         and no sync_gradients followed it: each rank trains a replica of its \
                         own;"
                    ),
                    "{name}: {e}"
                ),
                other => panic!("{name}: expected SyncMissed, got {other:?}"),
            }
            opt.zero_grad();
            ddp.backward(&loss()).unwrap();
            assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2], "{name}");
        }
    }

    /// This rank's change in a `ModelChanged`, and the ranks it names.
    type Changed = (Option<(String, &'static str)>, Vec<usize>);
    fn changed(r: Result<(), DdpError>) -> Changed {
        match r {
            Err(DdpError::ModelChanged { change, ranks, .. }) => (change, ranks),
            other => panic!("expected ModelChanged, got {other:?}"),
        }
    }

    /// A parameter added after `new` (a new head) has no hook and no bucket: `sync_gradients`
    /// fails naming it, and after `rebuild` averages it.
    #[test]
    fn a_parameter_added_after_new_needs_rebuild() {
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let mut ddp = DistributedDataParallel::new(&vs, alone(), DdpOptions::default()).unwrap();
        let b = vs
            .root()
            .sub("head")
            .var("b", &[3], tch::nn::Init::Const(1.0));
        let _buffer = vs.root().zeros_no_train("running", &[1]);
        let loss = || a.sum(tch::Kind::Float) + b.sum(tch::Kind::Float) * 2.0;
        loss().backward();
        match ddp.sync_gradients() {
            Err(e @ DdpError::ModelChanged { .. }) => assert!(
                e.to_string().starts_with(
                    "rank 0: variable 'head.b' was added to the store after \
                     DistributedDataParallel wrapped the store:"
                ),
                "{e}"
            ),
            other => panic!("expected ModelChanged, got {other:?}"),
        }
        // The step ended: the next call is not SyncMissed.
        ddp.broadcast_buffers().unwrap();
        ddp.rebuild(&vs).unwrap();
        for (_, p) in ddp.parameters() {
            tch_ext::set_grad(p, None).unwrap();
        }
        ddp.backward(&loss()).unwrap();
        let names: Vec<&str> = ddp.parameters().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "head.b"]);
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [1.0; 2]);
        assert_eq!(Vec::<f32>::try_from(&b.grad()).unwrap(), [2.0; 3]);
    }

    /// A buffer added after `new` is one that `broadcast_buffers` would never broadcast, and
    /// a parameter unfrozen without `rebuild` one DDP never averages: `sync_gradients` names
    /// them. A new buffer without broadcasting, or a tie, is no change.
    #[test]
    fn a_new_buffer_or_an_unfrozen_parameter_needs_rebuild() {
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let b = vs.root().var("b", &[2], tch::nn::Init::Const(1.0));
        let _ = b.set_requires_grad(false);
        let mut ddp = DistributedDataParallel::new(&vs, alone(), DdpOptions::default()).unwrap();
        let step = |ddp: &mut DistributedDataParallel| {
            a.sum(tch::Kind::Float).backward();
            ddp.sync_gradients()
        };
        let _ = b.set_requires_grad(true);
        let unfrozen = (Some(("b".to_string(), "unfrozen")), vec![0]);
        assert_eq!(changed(step(&mut ddp)), unfrozen);
        let _ = b.set_requires_grad(false);
        let _ = vs.root().zeros_no_train("running", &[1]);
        let added = (Some(("running".to_string(), "added to the store")), vec![0]);
        assert_eq!(changed(step(&mut ddp)), added);
        drop(ddp);
        let options = DdpOptions {
            broadcast_buffers: false,
            ..DdpOptions::default()
        };
        let mut ddp = DistributedDataParallel::new(&vs, alone(), options).unwrap();
        let _ = vs.root().zeros_no_train("running_2", &[1]);
        ddp.broadcast_buffers().unwrap();
        step(&mut ddp).unwrap();
        // A second name of a wrapped parameter adds nothing DDP misses.
        let _ = vs.root().add("a_tied", a.shallow_clone(), true);
        step(&mut ddp).unwrap();
        assert_eq!(ddp.store.trainable, 3);
    }

    /// A wrapped parameter frozen between steps (a GAN's discriminator during the
    /// generator's step) gets no gradient: with `find_unused_parameters` the step goes on and
    /// it keeps none, as in PyTorch; unfrozen again it is averaged again. Without that
    /// option it is an unused parameter.
    #[test]
    fn a_wrapped_parameter_frozen_between_steps_is_unused() {
        let grads = on_ranks(2, |rank, pg| {
            let vs = VarStore::new(tch::Device::Cpu);
            let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
            let d = vs.root().var("d", &[2], tch::nn::Init::Const(1.0));
            let options = DdpOptions {
                find_unused_parameters: true,
                ..DdpOptions::default()
            };
            let mut ddp = DistributedDataParallel::new(&vs, pg.clone(), options).unwrap();
            let scale = (rank + 1) as f64;
            let step = |ddp: &mut DistributedDataParallel| {
                for (_, p) in ddp.parameters() {
                    tch_ext::set_grad(p, None).unwrap();
                }
                let loss = (a.sum(tch::Kind::Float) + d.sum(tch::Kind::Float) * 2.0) * scale;
                ddp.backward(&loss).map(|()| (a.grad(), d.grad()))
            };
            let _ = d.set_requires_grad(false);
            let (ga, gd) = step(&mut ddp).unwrap();
            let frozen = (Vec::<f32>::try_from(&ga).unwrap(), gd.defined());
            let _ = d.set_requires_grad(true);
            let (_, gd) = step(&mut ddp).unwrap();
            let unfrozen = Vec::<f32>::try_from(&gd).unwrap();
            drop(ddp);
            let mut ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default()).unwrap();
            let _ = d.set_requires_grad(false);
            let unused = match step(&mut ddp) {
                Err(DdpError::UnusedParameters { parameters, .. }) => parameters,
                other => panic!("expected UnusedParameters, got {other:?}"),
            };
            (frozen, unfrozen, unused)
        });
        for (frozen, unfrozen, unused) in grads {
            assert_eq!(frozen, (vec![1.5; 2], false));
            assert_eq!(unfrozen, [3.0; 2]);
            assert_eq!(unused, [("d".to_string(), 0)]);
        }
    }

    /// A store changed on one rank only fails every rank's `sync_gradients`, after the same
    /// collectives: none waits for the other.
    #[test]
    fn a_store_changed_on_one_rank_fails_every_rank() {
        let results = on_ranks(2, |rank, pg| {
            let vs = VarStore::new(tch::Device::Cpu);
            let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
            let mut ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default()).unwrap();
            if rank == 1 {
                let _ = vs.root().var("head", &[1], tch::nn::Init::Const(1.0));
            }
            a.sum(tch::Kind::Float).backward();
            changed(ddp.sync_gradients())
        });
        let head = Some(("head".to_string(), "added to the store"));
        assert_eq!(results, [(None, vec![1]), (head, vec![1])]);
    }

    /// A loop of `backward_step`s that calls nothing of DDP's: its second backward fails,
    /// saying what to do (PyTorch's "Expected to have finished reduction in the prior
    /// iteration"), with gradient sync on, or off (in `no_sync`, whose gradient the buckets
    /// in flight would overwrite, or without overlap add to the averages);
    /// `sync_gradients` then reports it too, and the next step is whole again.
    #[test]
    fn a_second_backward_before_sync_gradients_fails() {
        for (synced, overlap) in [(true, true), (false, true), (false, false)] {
            let vs = VarStore::new(tch::Device::Cpu);
            let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
            let options = DdpOptions {
                overlap,
                ..DdpOptions::default()
            };
            let mut ddp = DistributedDataParallel::new(&vs, alone(), options).unwrap();
            let mut opt =
                tch::nn::OptimizerConfig::build(tch::nn::Sgd::default(), &vs, 0.5).unwrap();
            let loss = || a.sum(tch::Kind::Float) * 2.0;
            let said = "rank 0: a backward pass with gradient sync on reached parameter 'a' and \
                        no sync_gradients followed it: each rank trains a replica of its own; \
                        call sync_gradients after every backward";
            let case = format!("sync {synced}, overlap {overlap}");
            opt.backward_step(&loss());
            let second = match synced {
                true => loss().f_backward(),
                false => ddp.no_sync(|| loss().f_backward()),
            };
            let e = second.unwrap_err().to_string();
            assert!(e.contains(said), "{case}: {e}");
            match ddp.sync_gradients() {
                Err(DdpError::SyncMissed { parameter, .. }) => assert_eq!(parameter, "a"),
                other => panic!("{case}: expected SyncMissed, got {other:?}"),
            }
            opt.zero_grad();
            ddp.backward(&loss()).unwrap();
            assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2], "{case}");
        }
    }

    /// `sync_gradients` with no backward since the last one (after `backward`, which called
    /// it) is that mistake, not every parameter unused; the averages stay. On two ranks,
    /// where only one ran a backward, each rank says what it saw, and neither is left
    /// waiting. With `find_unused_parameters` (a rank without a batch) it goes on.
    #[test]
    fn sync_gradients_without_a_backward_says_so() {
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        for find_unused_parameters in [false, true] {
            let options = DdpOptions {
                find_unused_parameters,
                ..DdpOptions::default()
            };
            let mut ddp = DistributedDataParallel::new(&vs, alone(), options).unwrap();
            tch_ext::set_grad(&a, None).unwrap();
            ddp.backward(&(a.sum(tch::Kind::Float) * 2.0)).unwrap();
            match (ddp.sync_gradients(), find_unused_parameters) {
                (Err(e @ DdpError::SyncWithoutBackward { .. }), false) => assert_eq!(
                    e.to_string(),
                    "rank 0: sync_gradients found no gradient of a backward pass since the last \
                     sync_gradients: call it once after each backward with gradient sync on \
                     (DistributedDataParallel::backward calls it itself), of a loss computed \
                     from the model's parameters; a rank with no batch to train on calls it \
                     without a backward only with find_unused_parameters"
                ),
                (Ok(()), true) => {}
                (other, _) => panic!("find_unused {find_unused_parameters}: got {other:?}"),
            }
            assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2]);
        }
        let reports = on_ranks(2, |rank, pg| {
            let vs = VarStore::new(tch::Device::Cpu);
            let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
            let mut ddp =
                DistributedDataParallel::new(&vs, pg.clone(), DdpOptions::default()).unwrap();
            if rank == 0 {
                a.sum(tch::Kind::Float).backward();
            }
            let report = match ddp.sync_gradients() {
                Err(DdpError::UnusedParameters { parameters, .. }) => format!("{parameters:?}"),
                Err(DdpError::SyncWithoutBackward { rank }) => format!("none on {rank}"),
                other => format!("unexpected: {other:?}"),
            };
            let mut t = Tensor::from_slice(&[1f32]);
            pg.all_reduce(&mut t, ddp_comm::ReduceOp::Sum).unwrap();
            (report, f32::try_from(&t).unwrap())
        });
        assert_eq!(
            reports,
            [
                (r#"[("a", 1)]"#.to_string(), 2.0),
                ("none on 1".to_string(), 2.0)
            ]
        );
    }

    /// A comm hook that logs the buckets it starts, then averages them as the default does.
    #[derive(Debug)]
    struct Logged(Arc<Mutex<Vec<String>>>);

    impl CommHook for Logged {
        fn start(&self, pg: &Arc<ProcessGroup>, bucket: &GradBucket<'_>) -> HookWork {
            lock(&self.0).push(format!("bucket {}", bucket.parameter_names().join(",")));
            BuiltinHook::Allreduce.start(pg, bucket)
        }
    }

    /// Parameters `a` and `b`, one bucket each (`b`'s first), with `find_unused_parameters`
    /// as given and a comm hook logging into the returned list.
    fn two_buckets(
        pg: Arc<ProcessGroup>,
        find_unused_parameters: bool,
    ) -> (VarStore, DistributedDataParallel, Logged) {
        let vs = VarStore::new(tch::Device::Cpu);
        let _a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let _b = vs.root().var("b", &[3], tch::nn::Init::Const(1.0));
        let options = DdpOptions {
            find_unused_parameters,
            bucket_cap_bytes: 1,
            first_bucket_cap_bytes: 1,
            ..DdpOptions::default()
        };
        let mut ddp = DistributedDataParallel::new(&vs, pg, options).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        ddp.register_comm_hook(Arc::new(Logged(log.clone())));
        assert_eq!(
            ddp.bucket_parameters(),
            [vec!["b".to_string()], vec!["a".to_string()]]
        );
        (vs, ddp, Logged(log))
    }

    /// A backward inside `no_sync` launches no bucket and leaves the flag as it found it;
    /// the synced backward after it launches both buckets, which average the gradients of
    /// both backward passes.
    #[test]
    fn no_sync_accumulates_without_communicating() {
        let (vs, mut ddp, Logged(log)) = two_buckets(alone(), false);
        let (a, b) = (&vs.variables()["a"], &vs.variables()["b"]);
        ddp.no_sync(|| (a.sum(tch::Kind::Float) * 2.0 + b.sum(tch::Kind::Float) * 3.0).backward());
        assert!(lock(&log).is_empty(), "no_sync launched {:?}", lock(&log));
        assert!(lock(&ddp.reducer).require_sync);
        (a.sum(tch::Kind::Float) + b.sum(tch::Kind::Float)).backward();
        ddp.sync_gradients().unwrap();
        assert_eq!(*lock(&log), ["bucket b", "bucket a"]);
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [3.0; 2]);
        assert_eq!(Vec::<f32>::try_from(&b.grad()).unwrap(), [4.0; 3]);
        ddp.set_require_gradient_sync(false);
        ddp.no_sync(|| ());
        assert!(!lock(&ddp.reducer).require_sync);
    }

    /// A panic in `no_sync`'s closure leaves gradient sync on, as it found it.
    #[test]
    fn no_sync_turns_sync_back_on_when_its_closure_panics() {
        let (_vs, mut ddp, _) = two_buckets(alone(), false);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ddp.no_sync(|| panic!("a micro-batch's panic"))
        }));
        assert!(unwound.is_err());
        assert!(lock(&ddp.reducer).require_sync);
    }

    /// A backward that fails after a hook launched a bucket (a backward function's error)
    /// ends its step: `backward` returns that error, the next call is not `SyncMissed`, and
    /// the step after it averages as usual.
    #[test]
    fn a_failed_backward_ends_its_step() {
        let (vs, mut ddp, Logged(log)) = two_buckets(alone(), false);
        let (a, b) = (&vs.variables()["a"], &vs.variables()["b"]);
        // Made first, so that autograd runs `b`'s gradient and hook before this fails.
        let failing = tch::no_grad(|| a * 1.0);
        tch_ext::set_backward(a, &failing, |_| Err("a peer died".into())).unwrap();
        let loss = failing.sum(tch::Kind::Float) + b.sum(tch::Kind::Float);
        match ddp.backward(&loss) {
            Err(DdpError::Tch(e)) => assert!(e.to_string().contains("a peer died"), "{e}"),
            other => panic!("expected the backward's error, got {other:?}"),
        }
        assert_eq!(*lock(&log), ["bucket b"]);
        assert!(!a.grad().defined());
        ddp.broadcast_buffers().unwrap();
        let _ = tch::no_grad(|| b.grad().zero_());
        ddp.backward(&(a.sum(tch::Kind::Float) * 2.0 + b.sum(tch::Kind::Float)))
            .unwrap();
        assert_eq!(*lock(&log), ["bucket b", "bucket b", "bucket a"]);
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2]);
        assert_eq!(Vec::<f32>::try_from(&b.grad()).unwrap(), [1.0; 3]);
    }

    /// What a [`Probe`] does when a bucket starts: returns the follow-up of its averaging
    /// all-reduce.
    type Start = dyn Fn(&GradBucket<'_>) -> Box<dyn FnOnce() + Send> + Send + Sync;

    /// A comm hook that averages as the default does, with a test's follow-up.
    struct Probe(Box<Start>);

    impl std::fmt::Debug for Probe {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Probe")
        }
    }

    impl CommHook for Probe {
        fn start(&self, pg: &Arc<ProcessGroup>, bucket: &GradBucket<'_>) -> HookWork {
            let then = (self.0)(bucket);
            BuiltinHook::Allreduce.start(pg, bucket).then(then)
        }
    }

    /// Parameters `a` ([2]) and `b` ([3]) of ones, one bucket each (`b`'s first), averaged
    /// by the [`Probe`] that `probe` makes of them, after the backward of `sum(2a) + sum(b)`.
    /// Returns `a` and `b`.
    fn probed_step(
        options: DdpOptions,
        probe: impl FnOnce(&Tensor, &Tensor) -> Box<Start>,
    ) -> (Tensor, Tensor) {
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let b = vs.root().var("b", &[3], tch::nn::Init::Const(1.0));
        let options = DdpOptions {
            bucket_cap_bytes: 1,
            first_bucket_cap_bytes: 1,
            ..options
        };
        let mut ddp = DistributedDataParallel::new(&vs, alone(), options).unwrap();
        assert_eq!(
            ddp.bucket_parameters(),
            [vec!["b".to_string()], vec!["a".to_string()]]
        );
        ddp.register_comm_hook(Arc::new(Probe(probe(&a, &b))));
        ((&a * 2.0).sum(tch::Kind::Float) + b.sum(tch::Kind::Float)).backward();
        ddp.sync_gradients().unwrap();
        (a, b)
    }

    /// Each bucket's averages reach the gradients as soon as its collective is waited for,
    /// before the next bucket's (PyTorch's `finalize_backward`), with and without overlap:
    /// when bucket 1 completes, bucket 0's parameter already holds its average, which the
    /// hook doubled.
    #[test]
    fn each_bucket_is_copied_back_once_it_is_waited_for() {
        for overlap in [true, false] {
            let seen = Arc::new(Mutex::new(Vec::new()));
            let record = seen.clone();
            let options = DdpOptions {
                overlap,
                ..DdpOptions::default()
            };
            let (a, b) = probed_step(options, |_, b| {
                let first = Arc::new(Mutex::new(b.shallow_clone()));
                Box::new(move |bucket| {
                    if bucket.index() == 0 {
                        let mut buffer = bucket.buffer().shallow_clone();
                        return Box::new(move || {
                            let _ = buffer.g_mul_scalar_(2.0);
                        });
                    }
                    let first = lock(&first).shallow_clone();
                    let record = record.clone();
                    Box::new(move || *lock(&record) = Vec::<f32>::try_from(&first.grad()).unwrap())
                })
            });
            assert_eq!(*lock(&seen), [2.0; 3], "overlap {overlap}");
            assert_eq!(Vec::<f32>::try_from(&b.grad()).unwrap(), [2.0; 3]);
            assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2]);
        }
    }

    /// Without overlap, each bucket is launched before the next is filled: with
    /// `gradient_as_bucket_view`, bucket 1's parameter `a` becomes a view of its bucket only
    /// after bucket 0 has started, and is one when bucket 1 starts.
    #[test]
    fn without_overlap_each_bucket_starts_before_the_next_is_filled() {
        let starts = Arc::new(Mutex::new(Vec::new()));
        let record = starts.clone();
        let options = DdpOptions {
            overlap: false,
            gradient_as_bucket_view: true,
            ..DdpOptions::default()
        };
        let (a, b) = probed_step(options, |a, _| {
            let other = Arc::new(Mutex::new(a.shallow_clone()));
            Box::new(move |bucket| {
                let grad = lock(&other).grad().data_ptr() as usize;
                lock(&record).push((grad, bucket.buffer().data_ptr() as usize));
                Box::new(|| ())
            })
        });
        let starts = lock(&starts).clone();
        let [(grad_at_0, _), (grad_at_1, bucket_1)] = starts[..] else {
            panic!("expected 2 bucket starts, got {starts:?}");
        };
        assert_eq!(
            grad_at_1, bucket_1,
            "a's gradient is not its bucket's view at its start"
        );
        assert_ne!(
            grad_at_0, bucket_1,
            "a's bucket was filled before bucket 0 started"
        );
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2]);
        assert_eq!(Vec::<f32>::try_from(&b.grad()).unwrap(), [1.0; 3]);
    }

    /// `2 * a`, through a backward function that logs when it runs: before `a`'s gradient
    /// is accumulated, so after the backward has started.
    fn logged_double(a: &Tensor, log: &Arc<Mutex<Vec<String>>>) -> Tensor {
        let input = a * 2.0;
        let out = input.detach().copy();
        let log = log.clone();
        tch_ext::set_backward(&input, &out, move |g| {
            lock(&log).push("backward".to_string());
            Ok(g.shallow_clone())
        })
        .unwrap();
        out
    }

    /// With `find_unused_parameters`, the parameters `prepare_for_backward` finds unreachable
    /// are marked ready at the first hook of the backward (PyTorch's `autograd_hook`): their
    /// bucket starts after what backward ran before its first gradient, not before backward,
    /// and not only in `sync_gradients`. Without `prepare_for_backward`, no bucket starts
    /// before `sync_gradients`.
    #[test]
    fn unreachable_parameters_are_marked_ready_at_the_first_hook() {
        let (vs, mut ddp, Logged(log)) = two_buckets(alone(), true);
        let (a, b) = (&vs.variables()["a"], &vs.variables()["b"]);
        let loss = logged_double(a, &log).sum(tch::Kind::Float);
        ddp.prepare_for_backward(&loss).unwrap();
        assert!(lock(&log).is_empty(), "a bucket started before backward");
        loss.backward();
        assert_eq!(*lock(&log), ["backward", "bucket b", "bucket a"]);
        ddp.sync_gradients().unwrap();
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2]);
        assert!(!b.grad().defined(), "b, used by no rank, got a gradient");

        // The next step, without prepare_for_backward: everything waits for the sync.
        tch_ext::set_grad(a, None).unwrap();
        lock(&log).clear();
        logged_double(a, &log).sum(tch::Kind::Float).backward();
        assert_eq!(*lock(&log), ["backward"]);
        ddp.sync_gradients().unwrap();
        assert_eq!(*lock(&log), ["backward", "bucket b", "bucket a"]);
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2]);
    }

    /// A parameter `prepare_for_backward` found unreachable that gets a gradient all the
    /// same (backward ran from another tensor) is an error naming it, as a second gradient.
    #[test]
    fn a_gradient_for_a_parameter_marked_unused_is_an_error() {
        let (vs, mut ddp, _) = two_buckets(alone(), true);
        let (a, b) = (&vs.variables()["a"], &vs.variables()["b"]);
        ddp.prepare_for_backward(&a.sum(tch::Kind::Float)).unwrap();
        (a.sum(tch::Kind::Float) + b.sum(tch::Kind::Float)).backward();
        match ddp.sync_gradients() {
            Err(e @ DdpError::GradientTwice { .. }) => assert!(
                e.to_string().starts_with(
                    "rank 0: parameter 'b' received a gradient twice before sync_gradients, \
                     or once after prepare_for_backward found it unreachable"
                ),
                "{e}"
            ),
            other => panic!("expected GradientTwice, got {other:?}"),
        }
        // The step after it is whole again.
        tch_ext::set_grad(a, None).unwrap();
        tch_ext::set_grad(b, None).unwrap();
        let loss = a.sum(tch::Kind::Float);
        ddp.prepare_for_backward(&loss).unwrap();
        loss.backward();
        ddp.sync_gradients().unwrap();
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [1.0; 2]);
    }

    /// A rebuild refused (here: a hook of the user's on the unfrozen parameter) leaves the
    /// DDP as it was, hooks included: its step still averages every gradient.
    #[test]
    fn a_failed_rebuild_leaves_the_ddp_as_it_was() {
        let pg = alone();
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let b = vs.root().var("b", &[3], tch::nn::Init::Const(1.0));
        let _ = b.set_requires_grad(false);
        let mut ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default()).unwrap();
        let _ = b.set_requires_grad(true);
        tch_ext::set_post_accumulate_grad_hook(&b, |_| {}).unwrap();
        match ddp.rebuild(&vs) {
            Err(e @ DdpError::AlreadyHooked(_)) => assert!(
                e.to_string()
                    .starts_with("parameter 'b' already has a post-accumulate-grad hook"),
                "{e}"
            ),
            other => panic!("expected AlreadyHooked, got {other:?}"),
        }
        assert_eq!(ddp.bucket_parameters(), [vec!["a".to_string()]]);
        assert!(tch_ext::has_post_accumulate_grad_hook(&a).unwrap());
        let _ = b.set_requires_grad(false);
        (a.sum(tch::Kind::Float) * 2.0).backward();
        ddp.sync_gradients().unwrap();
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2]);
    }

    /// A parameter without elements has no storage of its own (its data pointer is shared
    /// with every other empty tensor): a rebuild still knows its hook as this DDP's.
    #[test]
    fn a_rebuild_keeps_a_parameter_without_elements() {
        let pg = alone();
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let empty = vs.root().var("empty", &[0], tch::nn::Init::Const(1.0));
        let mut ddp = DistributedDataParallel::new(&vs, pg, DdpOptions::default()).unwrap();
        assert!(tch_ext::has_post_accumulate_grad_hook(&empty).unwrap());
        ddp.rebuild(&vs).unwrap();
        assert!(tch_ext::has_post_accumulate_grad_hook(&empty).unwrap());
        (a.sum(tch::Kind::Float) * 2.0 + empty.sum(tch::Kind::Float)).backward();
        ddp.sync_gradients().unwrap();
        assert_eq!(Vec::<f32>::try_from(&a.grad()).unwrap(), [2.0; 2]);
    }

    /// A weight tied under two names (an LM head tied to its embedding) is one parameter:
    /// hooked, bucketed and averaged once, and given to the optimizer once, under the name
    /// first in DDP order.
    #[test]
    fn a_tied_weight_is_one_parameter() {
        let vs = VarStore::new(tch::Device::Cpu);
        let w = vs.root().var("embed", &[2], tch::nn::Init::Const(5.0));
        let _tied = vs.root().sub("head").add("weight", w.shallow_clone(), true);
        let mut ddp = DistributedDataParallel::new(&vs, alone(), DdpOptions::default()).unwrap();
        let names: Vec<&str> = ddp.parameters().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["embed"]);
        (w.sum(tch::Kind::Float) * 2.0).backward();
        ddp.sync_gradients().unwrap();
        assert_eq!(Vec::<f32>::try_from(&w.grad()).unwrap(), [2.0; 2]);

        let params = trainable_parameters(&vs);
        assert_eq!(params.len(), 1);
        let sgd = crate::optim::SgdConfig {
            lr: 1.0,
            ..Default::default()
        };
        let mut optimizer =
            crate::optim::Optimizer::new(params, crate::optim::OptimizerConfig::Sgd(sgd));
        optimizer.step();
        assert_eq!(Vec::<f32>::try_from(&w).unwrap(), [3.0; 2]);
    }

    /// A model without a parameter that trains is refused (PyTorch's "DistributedDataParallel
    /// is not needed ..."), not a backward that fails later.
    #[test]
    fn a_model_without_trainable_parameters_is_refused() {
        let vs = VarStore::new(tch::Device::Cpu);
        let a = vs.root().var("a", &[2], tch::nn::Init::Const(1.0));
        let _ = a.set_requires_grad(false);
        let _b = vs.root().zeros_no_train("b", &[3]);
        match DistributedDataParallel::new(&vs, alone(), DdpOptions::default()) {
            Err(e @ DdpError::NothingToTrain { frozen: 1 }) => assert!(
                e.to_string()
                    .starts_with("the model has no parameter that requires a gradient (1 frozen)"),
                "{e}"
            ),
            other => panic!("expected NothingToTrain, got {other:?}"),
        }
    }

    /// A sparse gradient (an embedding's with `sparse: true`) is averaged as a dense one,
    /// with and without overlap: the dense embedding's gradient.
    #[test]
    fn a_sparse_gradient_is_averaged_as_a_dense_one() {
        for overlap in [true, false] {
            let vs = VarStore::new(tch::Device::Cpu);
            let config = tch::nn::EmbeddingConfig {
                sparse: true,
                ..Default::default()
            };
            let embedding = tch::nn::embedding(vs.root() / "emb", 10, 3, config);
            let options = DdpOptions {
                overlap,
                ..DdpOptions::default()
            };
            let mut ddp = DistributedDataParallel::new(&vs, alone(), options).unwrap();
            let input = Tensor::from_slice(&[1i64, 2, 1]);
            let out = tch::nn::Module::forward(&embedding, &input);
            out.sum(tch::Kind::Float).f_backward().unwrap();
            ddp.sync_gradients().unwrap();
            let grad = embedding.ws.grad();
            assert!(!grad.is_sparse(), "overlap {overlap}");
            let mut expected = vec![0.0f32; 30];
            expected[3..6].fill(2.0);
            expected[6..9].fill(1.0);
            let grad = Vec::<f32>::try_from(grad.flatten(0, -1)).unwrap();
            assert_eq!(grad, expected, "overlap {overlap}");
        }
    }

    #[test]
    fn natural_order_compares_numbers_as_numbers() {
        let mut names = vec![
            "features.12.weight",
            "features.4.weight",
            "classifier.3.bias",
            "features.1.bias",
        ];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            names,
            [
                "classifier.3.bias",
                "features.1.bias",
                "features.4.weight",
                "features.12.weight"
            ]
        );
    }
}
