//! `DistributedDataParallel`: keeps the replicas of one model identical across ranks.
//!
//! What it does, and when:
//!
//! - [`DistributedDataParallel::new`]: every rank sends a description of its model (each
//!   tensor's name, shape and dtype, in name order); a rank whose model differs from rank 0's
//!   gets an error naming the first differing tensor. Then rank 0's parameters and buffers
//!   are broadcast, one message per dtype (coalesced), so all replicas start equal whatever
//!   each rank initialised.
//! - [`DistributedDataParallel::broadcast_buffers`]: before each training forward, rank 0's
//!   buffers (BatchNorm running statistics) overwrite the others', as PyTorch's default
//!   `broadcast_buffers=True` does.
//! - [`DistributedDataParallel::sync_gradients`]: after backward, gradients are averaged over
//!   ranks: copied into flat buckets of at most [`DdpOptions::bucket_cap_bytes`], filled in
//!   reverse parameter order (the order in which backward produces them), each bucket
//!   all-reduced with `Avg`, then copied back. Buckets are allocated once and reused.
//!
//! Gradient accumulation (PyTorch's `no_sync`): run backward on K micro-batches, each loss
//! scaled by 1/K, and call `sync_gradients` once, before the optimizer step; the result is
//! one step on a K-times larger batch.
//!
//! Order: parameters are ordered by name with numeric components compared as numbers
//! (`features.4` before `features.12`), never by `VarStore::variables()`, whose `HashMap`
//! order differs between processes. tch has no autograd hooks, so buckets are reduced after
//! backward has finished rather than while it runs; on CPU the contest is compute, not
//! communication (see the README's measurements).

use std::sync::Arc;

use ddp_comm::{CommError, ProcessGroup, ReduceOp};
use ddp_model::checkpoint::natural_cmp;
use tch::{nn::VarStore, Kind, Tensor};

/// Why a DDP operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    /// A collective failed (a peer died, a timeout, ...).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Rank `rank`'s model differs from rank 0's.
    #[error("rank {rank}'s model differs from rank 0's at tensor {detail}")]
    ModelMismatch {
        /// The rank whose model differs.
        rank: usize,
        /// The first differing tensor and both descriptions.
        detail: String,
    },
    /// Parameters received no gradient in this step.
    #[error(
        "parameters received no gradient in this step: {}; every parameter must take part \
         in the loss on every rank (or be frozen)",
        .0.join(", ")
    )]
    MissingGradients(Vec<String>),
}

/// Settings of [`DistributedDataParallel`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpOptions {
    /// Largest gradient bucket in bytes (PyTorch's `bucket_cap_mb`, default 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Broadcast rank 0's buffers before each training forward (PyTorch's default: true).
    pub broadcast_buffers: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self {
            bucket_cap_bytes: 25 * 1024 * 1024,
            broadcast_buffers: true,
        }
    }
}

/// Tensors with their names.
type Named = Vec<(String, Tensor)>;

/// One flat buffer and the tensors it carries: (index into the owner's list, offset, numel).
#[derive(Debug)]
struct Bucket {
    flat: Tensor,
    members: Vec<(usize, i64, i64)>,
}

/// Wraps a model's [`VarStore`] so that all ranks train one model. See the module docs.
#[derive(Debug)]
pub struct DistributedDataParallel {
    pg: Arc<ProcessGroup>,
    options: DdpOptions,
    params: Vec<(String, Tensor)>,
    buffers: Vec<(String, Tensor)>,
    grad_buckets: Vec<Bucket>,
    buffer_buckets: Vec<Bucket>,
}

impl DistributedDataParallel {
    /// Checks that every rank holds the same model, then broadcasts rank 0's parameters and
    /// buffers. Every rank must call this at the same point.
    pub fn new(
        vs: &VarStore,
        pg: Arc<ProcessGroup>,
        options: DdpOptions,
    ) -> Result<Self, DdpError> {
        let (params, buffers) = split_named(vs);
        verify_same_model(&pg, &params, &buffers)?;

        // Initial broadcast of everything, one bucket per dtype, no size cap.
        let everything: Vec<(String, Tensor)> = params
            .iter()
            .chain(buffers.iter())
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let order: Vec<usize> = (0..everything.len()).collect();
        let all_buckets = make_buckets(&everything, &order, usize::MAX);
        tch::no_grad(|| broadcast_tensors(&pg, &everything, &all_buckets))?;

        let reverse: Vec<usize> = (0..params.len()).rev().collect();
        let grad_buckets = make_buckets(&params, &reverse, options.bucket_cap_bytes);
        let buffer_order: Vec<usize> = (0..buffers.len()).collect();
        let buffer_buckets = make_buckets(&buffers, &buffer_order, usize::MAX);
        Ok(Self {
            pg,
            options,
            params,
            buffers,
            grad_buckets,
            buffer_buckets,
        })
    }

    /// The process group.
    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    /// Trainable parameters in DDP order (by name, numbers compared as numbers).
    pub fn parameters(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// Buffers (non-trainable tensors) in DDP order.
    pub fn buffers(&self) -> &[(String, Tensor)] {
        &self.buffers
    }

    /// The sizes in bytes of the gradient buckets, in reduction order.
    pub fn bucket_sizes(&self) -> Vec<usize> {
        self.grad_buckets
            .iter()
            .map(|b| b.flat.numel() * b.flat.kind().elt_size_in_bytes())
            .collect()
    }

    /// Broadcasts rank 0's buffers to every rank (a no-op when disabled in the options or
    /// with one rank). Call before each training forward.
    pub fn broadcast_buffers(&mut self) -> Result<(), DdpError> {
        if !self.options.broadcast_buffers || self.pg.world_size() == 1 {
            return Ok(());
        }
        tch::no_grad(|| broadcast_tensors(&self.pg, &self.buffers, &self.buffer_buckets))
    }

    /// Averages every parameter's gradient over all ranks. Call after backward (after the
    /// last micro-batch's backward when accumulating), before the optimizer step.
    pub fn sync_gradients(&mut self) -> Result<(), DdpError> {
        let grads: Vec<Tensor> = self.params.iter().map(|(_, p)| p.grad()).collect();
        let missing: Vec<String> = self
            .params
            .iter()
            .zip(&grads)
            .filter(|(_, g)| !g.defined())
            .map(|((n, _), _)| n.clone())
            .collect();
        if !missing.is_empty() {
            return Err(DdpError::MissingGradients(missing));
        }
        if self.pg.world_size() == 1 {
            return Ok(());
        }
        tch::no_grad(|| {
            for bucket in &mut self.grad_buckets {
                for &(k, offset, numel) in &bucket.members {
                    bucket
                        .flat
                        .narrow(0, offset, numel)
                        .copy_(&grads[k].reshape([-1]));
                }
                self.pg.all_reduce(&mut bucket.flat, ReduceOp::Avg)?;
                for &(k, offset, numel) in &bucket.members {
                    let mut g = grads[k].shallow_clone();
                    g.copy_(&bucket.flat.narrow(0, offset, numel).view_as(&g));
                }
            }
            Ok(())
        })
    }
}

/// Splits the store into (trainable parameters, buffers), each in DDP order.
fn split_named(vs: &VarStore) -> (Named, Named) {
    let mut all: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    all.sort_by(|a, b| natural_cmp(&a.0, &b.0));
    all.into_iter().partition(|(_, t)| t.requires_grad())
}

fn describe(kind: &str, named: &[(String, Tensor)]) -> Vec<String> {
    named
        .iter()
        .map(|(n, t)| format!("{kind} '{n}' shape {:?} dtype {:?}", t.size(), t.kind()))
        .collect()
}

fn verify_same_model(
    pg: &ProcessGroup,
    params: &[(String, Tensor)],
    buffers: &[(String, Tensor)],
) -> Result<(), DdpError> {
    let mut mine = describe("parameter", params);
    mine.extend(describe("buffer", buffers));
    let gathered = pg.all_gather_bytes(mine.join("\n").as_bytes())?;
    let reference: Vec<&str> = std::str::from_utf8(&gathered[0])
        .unwrap_or("")
        .lines()
        .collect();
    for (rank, bytes) in gathered.iter().enumerate().skip(1) {
        let theirs: Vec<&str> = std::str::from_utf8(bytes).unwrap_or("").lines().collect();
        if theirs == reference {
            continue;
        }
        let detail = match reference.iter().zip(&theirs).find(|(a, b)| a != b) {
            Some((a, b)) => format!("{b} (rank 0 has {a})"),
            None if theirs.len() > reference.len() => {
                format!("{} (absent on rank 0)", theirs[reference.len()])
            }
            None => format!("{} (absent on rank {rank})", reference[theirs.len()]),
        };
        return Err(DdpError::ModelMismatch { rank, detail });
    }
    Ok(())
}

/// Groups `named[order[..]]` into flat buckets by dtype and device, each at most `cap` bytes
/// (a single larger tensor gets a bucket of its own).
fn make_buckets(named: &[(String, Tensor)], order: &[usize], cap: usize) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut open: Vec<(Kind, tch::Device, Vec<usize>, usize)> = Vec::new();
    let mut closed: Vec<(Kind, tch::Device, Vec<usize>)> = Vec::new();
    for &k in order {
        let t = &named[k].1;
        let (kind, device) = (t.kind(), t.device());
        let bytes = t.numel() * kind.elt_size_in_bytes();
        let slot = match open
            .iter()
            .position(|(k2, d2, _, _)| *k2 == kind && *d2 == device)
        {
            Some(i) => i,
            None => {
                open.push((kind, device, Vec::new(), 0));
                open.len() - 1
            }
        };
        if !open[slot].2.is_empty() && open[slot].3 + bytes > cap {
            let (kd, dv, members, _) =
                std::mem::replace(&mut open[slot], (kind, device, Vec::new(), 0));
            closed.push((kd, dv, members));
        }
        open[slot].2.push(k);
        open[slot].3 += bytes;
    }
    closed.extend(
        open.into_iter()
            .filter(|o| !o.2.is_empty())
            .map(|(k, d, m, _)| (k, d, m)),
    );
    for (kind, device, members) in closed {
        let mut offset = 0i64;
        let mut placed = Vec::with_capacity(members.len());
        for k in members {
            let numel = named[k].1.numel() as i64;
            placed.push((k, offset, numel));
            offset += numel;
        }
        let flat = Tensor::zeros([offset], (kind, device));
        buckets.push(Bucket {
            flat,
            members: placed,
        });
    }
    buckets
}

fn broadcast_tensors(
    pg: &ProcessGroup,
    named: &[(String, Tensor)],
    buckets: &[Bucket],
) -> Result<(), DdpError> {
    for bucket in buckets {
        let mut flat = bucket.flat.shallow_clone();
        if pg.rank() == 0 {
            for &(k, offset, numel) in &bucket.members {
                flat.narrow(0, offset, numel)
                    .copy_(&named[k].1.reshape([-1]));
            }
        }
        pg.broadcast(&mut flat, 0)?;
        if pg.rank() != 0 {
            for &(k, offset, numel) in &bucket.members {
                let mut t = named[k].1.shallow_clone();
                t.copy_(&flat.narrow(0, offset, numel).view_as(&t));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn buckets_respect_the_cap_and_the_order() {
        let named: Vec<(String, Tensor)> = [10i64, 20, 30, 5]
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                (
                    format!("p{i}"),
                    Tensor::zeros([n], (Kind::Float, tch::Device::Cpu)),
                )
            })
            .collect();
        let order = [3, 2, 1, 0];
        // Cap of 40 floats: [p3, p2] = 35, then [p1] (+30 would be 50 > 40? 20 fits: 20), ...
        let buckets = make_buckets(&named, &order, 40 * 4);
        let layout: Vec<Vec<(usize, i64, i64)>> =
            buckets.iter().map(|b| b.members.clone()).collect();
        assert_eq!(
            layout,
            vec![vec![(3, 0, 5), (2, 5, 30)], vec![(1, 0, 20), (0, 20, 10)]]
        );
        assert_eq!(buckets[0].flat.numel(), 35);
        // A tensor larger than the cap gets a bucket of its own.
        let big = make_buckets(&named, &order, 8);
        assert_eq!(big.len(), 4);
    }
}
