//! How a communicator goes away: it waits while its pending collectives keep completing,
//! then is destroyed when none is left, or aborted when some made no progress for a grace
//! period (`ncclCommDestroy` would wait for them, forever if a peer is gone).

use std::time::{Duration, Instant};

use super::poll::Poll;
use super::NcclComm;
use crate::error::CommError;

/// How long a communicator being dropped waits for its pending collectives to make
/// progress before it aborts them.
const DROP_GRACE: Duration = Duration::from_secs(5);

impl NcclComm {
    /// Waits while the pending collectives keep completing: it returns once none is pending,
    /// when none has completed for [`DROP_GRACE`] (or the op timeout, if shorter), or when
    /// NCCL reports an error (the communicator is then aborted). A program that drops its
    /// group right after a step whose buckets only a stream waited for has collectives
    /// still running that its peers are in too; aborting them would leave the peers to
    /// their timeout.
    fn let_pending_finish(&mut self) {
        let grace = DROP_GRACE.min(self.timeout);
        let mut pending = self.inflight.pending();
        let mut progress = Instant::now();
        let mut poll = Poll::new();
        while pending > 0 && progress.elapsed() < grace {
            if self.check_async("drop").is_err() {
                return;
            }
            poll.pause();
            self.inflight.retire_completed();
            if self.inflight.pending() < pending {
                pending = self.inflight.pending();
                progress = Instant::now();
            }
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.select_device();
        self.inflight.retire_completed();
        if !self.inflight.is_aborted() {
            self.let_pending_finish();
        }
        if self.inflight.is_aborted() {
            // Already gone.
        } else if self.inflight.pending() > 0 {
            // `ncclCommDestroy` would wait for the pending collectives, forever if a peer
            // is gone: abort, as PyTorch does with a communicator that may have work (they
            // made no progress for the grace period).
            self.abort(CommError::Poisoned(
                "the process group was dropped with collectives in flight".into(),
            ));
        } else {
            // SAFETY: `self.comm` is live, idle, and not used after this point.
            unsafe { (self.nccl.ncclCommDestroy)(self.comm) };
        }
        // The aborted kernels exit early; tensors of those still running are leaked rather
        // than handed back to the allocator under them. The completed ones go back only
        // now, after the abort: freeing one may wait for the allocator's mutex, which a
        // thread in `cudaFree` holds until the aborted kernels have exited.
        self.inflight.retire_completed();
        for keep in self.inflight.take_pending() {
            std::mem::forget(keep);
        }
        drop(self.inflight.take_released());
    }
}
