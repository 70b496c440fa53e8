//! Differentiable collectives (PyTorch's `torch.distributed.nn.functional`), and the
//! reducer through which [`ddp_model::norm::BatchNorm2d`] takes its statistics over every
//! rank (`SyncBatchNorm`).

use std::sync::{Arc, Mutex, PoisonError};

use ddp_comm::{ProcessGroup, ReduceOp};
use ddp_model::norm::StatsReducer;
use tch::Tensor;

use crate::ddp::DdpError;

/// The sum of every rank's `t` (same shape and dtype everywhere), differentiable: its
/// backward pass sums the incoming gradients over the ranks, so each rank's `t` receives
/// the gradient of every rank's loss (`torch.distributed.nn.functional.all_reduce` with
/// `ReduceOp.SUM`). Every rank must call it, and so run the backward pass through it, in the
/// same order; a failed collective in the backward pass fails that backward pass.
///
/// # Errors
///
/// [`DdpError::Comm`] when the collective fails, [`DdpError::Shim`] when autograd cannot
/// record the operation.
pub fn all_reduce_sum(pg: &Arc<ProcessGroup>, t: &Tensor) -> Result<Tensor, DdpError> {
    let mut out = t.detach().contiguous().copy();
    sum_in_place(pg, &mut out)?;
    let group = pg.clone();
    tch_ext::set_backward(t, &out, move |grad| {
        let mut grad = grad.contiguous().copy();
        sum_in_place(&group, &mut grad).map_err(|e| {
            let e = crate::error::with_causes(&e);
            format!("all-reduce of a gradient failed: {e}")
        })?;
        Ok(grad)
    })?;
    Ok(out)
}

/// Sums `t` over the ranks, in place. A CUDA tensor's all-reduce is queued on NCCL's stream
/// and the current stream waits for it, not the host (c10d's `work.wait()` for NCCL), so
/// the kernels after it are queued at once; a failure of the collective itself (a lost
/// peer, the timeout) fails the group's next call. A CPU tensor's is a blocking all-reduce.
fn sum_in_place(pg: &Arc<ProcessGroup>, t: &mut Tensor) -> Result<(), ddp_comm::CommError> {
    if t.device().is_cuda() {
        pg.all_reduce_async(t, ReduceOp::Sum).wait_stream()
    } else {
        pg.all_reduce(t, ReduceOp::Sum)
    }
}

/// A [`StatsReducer`] over a process group: what `Settings::sync_batchnorm` gives every
/// [`BatchNorm2d`](ddp_model::norm::BatchNorm2d) of the model.
///
/// A forward or backward pass cannot return an error, so a failed collective here is kept
/// (the first one) and the layer goes on with its own rank's statistics or gradient;
/// [`GroupReducer::take_error`] returns it, and the Trainer fails the step with it before
/// the optimizer step. On CUDA no layer waits on the host for its statistics (see
/// [`all_reduce_sum`]); a collective that fails on the device fails the group's next call
/// (DDP's gradient sync, or a later one), and the group's watchdog aborts one pending past
/// the timeout, so the waiting stream cannot hang.
#[derive(Debug)]
pub struct GroupReducer {
    pg: Arc<ProcessGroup>,
    error: Arc<Mutex<Option<DdpError>>>,
}

impl GroupReducer {
    /// Statistics over the ranks of `pg`.
    pub fn new(pg: Arc<ProcessGroup>) -> Self {
        Self {
            pg,
            error: Arc::new(Mutex::new(None)),
        }
    }

    /// The first collective that failed since the last call, if any.
    pub fn take_error(&self) -> Option<DdpError> {
        self.error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

fn keep(slot: &Mutex<Option<DdpError>>, e: impl Into<DdpError>) {
    slot.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert(e.into());
}

impl StatsReducer for GroupReducer {
    fn rank(&self) -> usize {
        self.pg.rank()
    }

    fn world_size(&self) -> usize {
        self.pg.world_size()
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Tensor {
        let mut out = t.detach().contiguous().copy();
        if let Err(e) = sum_in_place(&self.pg, &mut out) {
            keep(&self.error, e);
            return t.shallow_clone();
        }
        let (group, error) = (self.pg.clone(), self.error.clone());
        let recorded = tch_ext::set_backward(t, &out, move |grad| {
            let mut summed = grad.contiguous().copy();
            match sum_in_place(&group, &mut summed) {
                Ok(()) => Ok(summed),
                Err(e) => {
                    keep(&error, e);
                    Ok(grad.shallow_clone())
                }
            }
        });
        match recorded {
            Ok(()) => out,
            Err(e) => {
                keep(&self.error, e);
                t.shallow_clone()
            }
        }
    }
}
