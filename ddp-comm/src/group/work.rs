//! Asynchronous collectives: [`Work`], the handle of a collective in flight (c10d's `Work`),
//! and the communication thread that runs CPU collectives in the order they were issued.
//! This module knows nothing of the group: the group hands the thread a function that runs
//! one job, and a CUDA collective's `Work` a function that waits for it.
//!
//! CPU collectives issued with [`ProcessGroup::all_reduce_async`] and
//! [`ProcessGroup::broadcast_async`] go to one thread per group, which runs them one after
//! the other in the order they were issued, so the order of collectives is the program's
//! order on every rank, as for the blocking calls. A blocking collective first waits for the
//! queued ones to finish, so that it keeps its place in that order too. CUDA collectives are
//! queued on NCCL's side stream instead (see `nccl/`), in the order they were issued; no
//! thread is involved, and their `Work` asks the communicator's in-flight table.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use tch::Tensor;

use crate::element::ReduceOp;
use crate::error::CommError;
use crate::sync::lock;

/// A collective in flight. [`Work::wait`] returns once it has completed on this rank (for a
/// CUDA tensor: once the device has finished it), with its result; until then the tensor
/// must not be read or written. Dropping a `Work` without waiting lets the collective
/// finish in the background: the group keeps the tensor (a handle to its storage) until the
/// collective has completed, on the device for a CUDA tensor, so a temporary may be dropped
/// with its `Work`. Its error, if any (a peer lost, the timeout, a panic), then poisons the
/// group, and the next collective reports it. A collective refused at the call, as PyTorch
/// raises there (a tensor its backend does not take, a root out of range), never starts:
/// its `Work` is complete at once with the error, and the group stays usable, as after a
/// refused blocking call.
#[must_use = "a collective's result is only valid after `wait`"]
pub struct Work {
    state: State,
}

/// A collective queued on the device, as the group that queued it waits for it.
pub(crate) trait DeviceWork: Send {
    /// Blocks until the device has completed it; its result.
    fn wait(self: Box<Self>) -> Result<(), CommError>;
    /// Makes the calling thread's current stream wait for it, without blocking.
    fn wait_stream(self: Box<Self>) -> Result<(), CommError>;
    /// Whether the device has completed it (or it has failed).
    fn is_completed(&self) -> bool;
}

enum State {
    /// Completed when it was issued (a world of one, or a refusal).
    Done(Result<(), CommError>),
    /// Queued on the group's communication thread.
    Queued(Arc<Slot>),
    /// Queued on the device (NCCL's side stream).
    Device(Box<dyn DeviceWork>),
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match &self.state {
            State::Done(_) => "Work(done)",
            State::Queued(_) => "Work(queued)",
            State::Device(_) => "Work(on the device)",
        })
    }
}

impl Work {
    pub(crate) fn done(result: Result<(), CommError>) -> Self {
        Work {
            state: State::Done(result),
        }
    }

    /// Work queued on the device.
    pub(crate) fn device(work: impl DeviceWork + 'static) -> Self {
        Work {
            state: State::Device(Box::new(work)),
        }
    }

    /// Blocks until the collective has completed and returns its result (for a CUDA
    /// tensor: until the device has finished it, so any stream may then use the result).
    pub fn wait(self) -> Result<(), CommError> {
        match self.state {
            State::Done(result) => result,
            State::Queued(slot) => slot.wait(),
            State::Device(work) => work.wait(),
        }
    }

    /// c10d's `Work.wait()` for NCCL: for a CUDA collective, makes the calling thread's
    /// current CUDA stream wait for it (`cudaStreamWaitEvent`) and returns without blocking
    /// the host; kernels queued on that stream afterwards see the result. An error of the
    /// collective itself (a peer lost, the timeout) is then reported by the group's next
    /// call; the group's watchdog thread aborts a collective pending past the timeout, so
    /// the waiting stream cannot hang forever. For a CPU collective it is [`Work::wait`].
    pub fn wait_stream(self) -> Result<(), CommError> {
        match self.state {
            State::Device(work) => work.wait_stream(),
            _ => self.wait(),
        }
    }

    /// Whether the collective has completed, with success or an error (for a CUDA
    /// collective: on the device). Does not wait for the collective (a CUDA one asks the
    /// communicator, which another thread's blocking call into the group may hold).
    ///
    /// "With an error" includes a CUDA collective of an aborted communicator, whose kernel
    /// may still be queued behind other work and write the buffer when it runs: its
    /// contents are undefined, and only an `Ok` from [`Work::wait`] makes it safe to use.
    pub fn is_completed(&self) -> bool {
        match &self.state {
            State::Done(_) => true,
            State::Device(work) => work.is_completed(),
            State::Queued(slot) => lock(&slot.result).is_some(),
        }
    }
}

/// Where the communication thread leaves a job's result.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    result: Mutex<Option<Result<(), CommError>>>,
    ready: Condvar,
}

impl Slot {
    fn finish(&self, result: Result<(), CommError>) {
        *lock(&self.result) = Some(result);
        self.ready.notify_all();
    }

    fn wait(&self) -> Result<(), CommError> {
        let mut guard = lock(&self.result);
        loop {
            if let Some(result) = guard.take() {
                return result;
            }
            guard = self
                .ready
                .wait(guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }
}

/// What the communication thread does with a tensor.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    AllReduce(ReduceOp),
    Broadcast(usize),
}

struct Job {
    tensor: Tensor,
    op: Op,
    slot: Arc<Slot>,
}

/// The communication thread of a group and the count of its unfinished jobs.
#[derive(Debug)]
pub(crate) struct Queue {
    sender: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    pending: Arc<Pending>,
}

/// Unfinished jobs, so that a blocking collective can wait until the queue is empty.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    count: AtomicUsize,
    lock: Mutex<()>,
    empty: Condvar,
}

impl Pending {
    /// Waits until every job queued so far has finished.
    pub(crate) fn drain(&self) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut guard = lock(&self.lock);
        while self.count.load(Ordering::Acquire) != 0 {
            guard = self
                .empty
                .wait(guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    fn done(&self) {
        let _guard = lock(&self.lock);
        if self.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.empty.notify_all();
        }
    }
}

/// What the communication thread does with each job.
pub(crate) trait Runner:
    Fn(&mut Tensor, Op) -> Result<(), CommError> + Send + 'static
{
}
impl<F: Fn(&mut Tensor, Op) -> Result<(), CommError> + Send + 'static> Runner for F {}

impl Queue {
    /// Starts the communication thread of rank `rank`, which hands each job to `run`.
    pub(crate) fn start(run: impl Runner, rank: usize) -> Result<Queue, CommError> {
        let (sender, receiver) = mpsc::channel();
        let pending = Arc::new(Pending::default());
        let thread = std::thread::Builder::new()
            .name(format!("ddp-comm-{rank}"))
            .spawn({
                let pending = pending.clone();
                move || serve(run, receiver, &pending)
            })
            .map_err(|e| CommError::io("starting the communication thread", e))?;
        Ok(Queue {
            sender: Some(sender),
            thread: Some(thread),
            pending,
        })
    }

    /// Queues `op` on `tensor` (a shallow copy sharing its storage).
    pub(crate) fn submit(&self, tensor: Tensor, op: Op) -> Work {
        let slot = Arc::new(Slot::default());
        self.pending.count.fetch_add(1, Ordering::AcqRel);
        let job = Job {
            tensor,
            op,
            slot: slot.clone(),
        };
        let sent = self.sender.as_ref().map(|s| s.send(job));
        if !matches!(sent, Some(Ok(()))) {
            self.pending.done();
            return Work::done(Err(CommError::Poisoned(
                "the communication thread has stopped".into(),
            )));
        }
        Work {
            state: State::Queued(slot),
        }
    }

    pub(crate) fn pending(&self) -> &Pending {
        &self.pending
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.sender.take();
        if let Some(thread) = self.thread.take() {
            // The queue's owner may be dropped by the thread itself (a runner may hold the
            // owner while it runs a job); it must not wait for itself.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

/// Runs each job and finishes its slot. A job that panics finishes with
/// [`CommError::Poisoned`], and so does every later one (the ring may be half-way through a
/// collective): a waiter never hangs on a slot nobody finishes.
fn serve(run: impl Runner, jobs: Receiver<Job>, pending: &Pending) {
    let mut poisoned: Option<String> = None;
    while let Ok(mut job) = jobs.recv() {
        let result = match &poisoned {
            Some(why) => Err(CommError::Poisoned(why.clone())),
            None => {
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(&mut job.tensor, job.op)
                }));
                ran.unwrap_or_else(|payload| {
                    let why = format!(
                        "the communication thread panicked: {}",
                        panic_text(payload.as_ref())
                    );
                    poisoned = Some(why.clone());
                    Err(CommError::Poisoned(why))
                })
            }
        };
        job.slot.finish(result);
        pending.done();
    }
}

/// A panic's message, where it has one.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// Device work that records which wait it got.
    struct Probe {
        done: Arc<AtomicBool>,
        waited: Arc<Mutex<&'static str>>,
    }

    impl DeviceWork for Probe {
        fn wait(self: Box<Self>) -> Result<(), CommError> {
            *lock(&self.waited) = "host";
            Ok(())
        }
        fn wait_stream(self: Box<Self>) -> Result<(), CommError> {
            *lock(&self.waited) = "stream";
            Err(CommError::Poisoned("aborted".into()))
        }
        fn is_completed(&self) -> bool {
            self.done.load(Ordering::SeqCst)
        }
    }

    #[test]
    fn a_job_that_panics_fails_it_and_every_later_one_and_never_hangs() {
        let queue = Queue::start(
            |t: &mut Tensor, _op| {
                if t.int64_value(&[]) == 1 {
                    panic!("ring out of step");
                }
                Ok(())
            },
            0,
        )
        .unwrap();
        let op = Op::AllReduce(crate::ReduceOp::Sum);
        let ok = queue.submit(Tensor::from(0i64), op);
        let bad = queue.submit(Tensor::from(1i64), op);
        let after = queue.submit(Tensor::from(0i64), op);
        assert!(ok.wait().is_ok());
        let why = "the communication thread panicked: ring out of step";
        for work in [bad, after] {
            match work.wait() {
                Err(CommError::Poisoned(m)) => assert_eq!(m, why),
                other => panic!("expected Poisoned, got {other:?}"),
            }
        }
        // Nothing is left pending: a blocking collective's drain returns.
        queue.pending().drain();
    }

    #[test]
    fn device_work_reports_the_device_and_waits_as_asked() {
        let done = Arc::new(AtomicBool::new(false));
        let waited = Arc::new(Mutex::new(""));
        let probe = || Probe {
            done: done.clone(),
            waited: waited.clone(),
        };
        let work = Work::device(probe());
        assert!(!work.is_completed(), "complete before the device is");
        done.store(true, Ordering::SeqCst);
        assert!(work.is_completed());
        work.wait().unwrap();
        assert_eq!(*lock(&waited), "host");
        let err = Work::device(probe()).wait_stream().unwrap_err();
        assert!(matches!(err, CommError::Poisoned(_)), "{err:?}");
        assert_eq!(*lock(&waited), "stream");
        // Work done at issue: `wait_stream` is `wait`.
        assert!(Work::done(Ok(())).wait_stream().is_ok());
        let refused = Work::done(Err(CommError::InvalidArgument("x".into())));
        assert!(refused.is_completed());
        assert!(matches!(
            refused.wait_stream(),
            Err(CommError::InvalidArgument(_))
        ));
    }
}
