//! NCCL backend on CUDA tensors, one rank per GPU (up to 4). Written to run everywhere:
//! without a GPU every test prints `skipped: <reason>` and returns. `cargo xtask gpu-check`
//! runs them on a GPU machine.

mod common;

use common::{gpus, lines_with, rank_world, run_world, run_world_each, worker};
use ddp_comm::{Backend, CommError, Options, ProcessGroup, ReduceOp};
use tch::{Device, Kind, Tensor};

macro_rules! skip_without_gpu {
    () => {
        match gpus() {
            Ok(n) => n,
            Err(reason) => {
                println!("skipped: {reason}");
                return;
            }
        }
    };
}

fn value(r: usize, i: usize) -> f64 {
    ((r * 31 + i * 7) % 11 + r) as f64 - 5.0
}

/// This rank's group, its communicator created at construction (not lazily at the first
/// CUDA collective) and its connections made by a first all-reduce: tests that queue a
/// fixed time of work (`keep_busy`) and then a collective would otherwise spend part of that
/// time in NCCL's set-up, and pass with the defect they look for once it outlasts the work.
fn group_on_gpu() -> (ProcessGroup, Device) {
    assert!(ddp_comm::cuda::load_torch_cuda().unwrap());
    let opts = Options::from_env().unwrap().backend(Backend::Nccl);
    let group = ProcessGroup::new(opts).unwrap();
    assert_eq!(group.backend(), Backend::Nccl);
    let device = Device::Cuda(group.local_rank());
    let mut warm = Tensor::ones([1], (Kind::Float, device));
    group.all_reduce(&mut warm, ReduceOp::Sum).unwrap();
    assert_eq!(warm.double_value(&[0]), group.world_size() as f64);
    (group, device)
}

fn check_kind(group: &ProcessGroup, device: Device, kind: Kind, sizes: &[usize], tol: f64) {
    let (rank, n) = rank_world();
    for &size in sizes {
        let mine: Vec<f64> = (0..size).map(|i| value(rank, i)).collect();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            if kind == Kind::Uint8 && op == ReduceOp::Avg {
                continue;
            }
            let base = if kind == Kind::Uint8 {
                mine.iter().map(|v| v + 5.0).collect()
            } else {
                mine.clone()
            };
            let mut t = Tensor::from_slice(&base).to_kind(kind).to_device(device);
            group.all_reduce(&mut t, op).unwrap();
            let got: Vec<f64> =
                Vec::try_from(&t.to_kind(Kind::Double).to_device(Device::Cpu)).unwrap();
            for (i, g) in got.iter().enumerate() {
                let shift = if kind == Kind::Uint8 { 5.0 } else { 0.0 };
                let vals: Vec<f64> = (0..n).map(|r| value(r, i) + shift).collect();
                let sum: f64 = vals.iter().sum();
                let want = match op {
                    ReduceOp::Sum => sum,
                    ReduceOp::Avg if matches!(kind, Kind::Int | Kind::Int64) => {
                        (sum / n as f64).trunc()
                    }
                    ReduceOp::Avg => sum / n as f64,
                    ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
                    ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min),
                };
                // Integer averages may round either way at .5 boundaries depending on NCCL.
                let slack = if op == ReduceOp::Avg && tol == 0.0 {
                    1.0
                } else {
                    0.0
                };
                assert!(
                    (g - want).abs() <= tol * want.abs().max(1.0) + slack,
                    "{kind:?} {op:?} size {size} rank {rank} element {i}: {g} != {want}"
                );
            }
        }
    }
}

#[test]
fn nccl_all_reduce_every_op_and_dtype() {
    if worker() {
        let (group, device) = group_on_gpu();
        let sizes = [0, 1, 7, 1_000_003];
        for (kind, tol) in [
            (Kind::Float, 1e-6),
            (Kind::Double, 1e-12),
            (Kind::Int, 0.0),
            (Kind::Int64, 0.0),
            (Kind::Uint8, 0.0),
            (Kind::Half, 1e-2),
            (Kind::BFloat16, 1e-2),
        ] {
            check_kind(&group, device, kind, &sizes, tol);
        }
        // 64 MiB of f32.
        let mut big = Tensor::ones([16 << 20], (Kind::Float, device));
        group.all_reduce(&mut big, ReduceOp::Sum).unwrap();
        let n = group.world_size() as f64;
        assert_eq!(big.min().double_value(&[]), n);
        assert_eq!(big.max().double_value(&[]), n);
        println!("rank {}: nccl all_reduce ok", group.rank());
        return;
    }
    let n = skip_without_gpu!();
    run_world("nccl_all_reduce_every_op_and_dtype", n, &[]);
}

/// Asynchronous all-reduces on the side stream: queued while the default stream is still
/// busy producing their inputs, they see those inputs, and after `wait` the results are
/// there for the default stream's next kernels.
#[test]
fn nccl_async_all_reduce_is_ordered_after_its_producer() {
    if worker() {
        let (group, device) = group_on_gpu();
        let group = std::sync::Arc::new(group);
        let (rank, n) = rank_world();
        let mut works = Vec::new();
        let mut tensors = Vec::new();
        // Half a second of work ahead of the producers: an all-reduce that did not wait for
        // its input would reduce unfinished ones (with two ranks or more; one rank's sum is
        // its input).
        keep_busy(device, 0.5);
        for i in 0..8 {
            // A chain of kernels on the default stream produces the input.
            let mut t = Tensor::zeros([4 << 20], (Kind::Float, device));
            for _ in 0..20 {
                t += 1.0;
            }
            t += (rank * 100 + i) as f64 - 20.0;
            works.push(group.all_reduce_async(&t, ReduceOp::Sum));
            tensors.push(t);
        }
        for w in works {
            w.wait().unwrap();
        }
        for (i, t) in tensors.iter().enumerate() {
            let want: f64 = (0..n).map(|r| (r * 100 + i) as f64).sum();
            assert_eq!(t.min().double_value(&[]), want, "tensor {i}");
            assert_eq!(t.max().double_value(&[]), want, "tensor {i}");
        }
        println!("rank {rank}: nccl async ok");
        return;
    }
    let n = skip_without_gpu!();
    run_world(
        "nccl_async_all_reduce_is_ordered_after_its_producer",
        n,
        &[],
    );
}

#[test]
fn nccl_broadcast_all_gather_and_barrier() {
    if worker() {
        let (group, device) = group_on_gpu();
        let (rank, n) = rank_world();
        for root in 0..n {
            let mut t = Tensor::full([1000], rank as f64, (Kind::Float, device));
            group.broadcast(&mut t, root).unwrap();
            assert_eq!(t.min().double_value(&[]), root as f64);
            assert_eq!(t.max().double_value(&[]), root as f64);
        }
        let t = Tensor::full([2, 3], rank as f64 * 10.0, (Kind::BFloat16, device));
        let parts = group.all_gather(&t).unwrap();
        assert_eq!(parts.len(), n);
        for (r, p) in parts.iter().enumerate() {
            assert_eq!(p.size(), [2, 3]);
            assert_eq!(p.device(), device);
            assert_eq!(
                p.to_kind(Kind::Float).mean(Kind::Float).double_value(&[]),
                r as f64 * 10.0
            );
        }
        group.barrier().unwrap();
        // CPU tensors keep working beside CUDA ones (TCP).
        let mut cpu = Tensor::from_slice(&[rank as f32]);
        group.all_reduce(&mut cpu, ReduceOp::Max).unwrap();
        assert_eq!(cpu.double_value(&[0]), (n - 1) as f64);
        // A tensor on another rank's GPU is refused.
        if tch::Cuda::device_count() as usize > 1 {
            let other = Device::Cuda((group.local_rank() + 1) % tch::Cuda::device_count() as usize);
            let mut wrong = Tensor::zeros([4], (Kind::Float, other));
            let err = group.all_reduce(&mut wrong, ReduceOp::Sum).unwrap_err();
            assert!(matches!(err, CommError::Tensor { .. }), "{err:?}");
        }
        println!("rank {rank}: nccl broadcast/all_gather ok");
        return;
    }
    let n = skip_without_gpu!();
    run_world("nccl_broadcast_all_gather_and_barrier", n, &[]);
}

#[test]
fn cuda_tensors_are_refused_by_the_cpu_backend() {
    skip_without_gpu!();
    let group =
        ProcessGroup::new(Options::new(0, 1, "127.0.0.1", 0).backend(Backend::Cpu)).unwrap();
    let mut t = Tensor::zeros([4], (Kind::Float, Device::Cuda(0)));
    let err = group.all_reduce(&mut t, ReduceOp::Sum).unwrap_err();
    assert!(
        matches!(err, CommError::Tensor { backend: "cpu", .. }),
        "{err:?}"
    );
}

#[test]
fn the_nccl_version_is_reported() {
    // Runs everywhere: the version comes from the library, no GPU needed.
    let version = ddp_comm::nccl_version().unwrap();
    let parts: Vec<u32> = version.split('.').map(|p| p.parse().unwrap()).collect();
    assert_eq!(parts.len(), 3, "{version}");
    let code = (parts[0] * 10000 + parts[1] * 100 + parts[2]) as i32;
    assert!(
        code >= nccl_sys::MIN_VERSION_CODE,
        "NCCL {version} is older than nccl-sys's minimum {}",
        nccl_sys::version_string(nccl_sys::MIN_VERSION_CODE)
    );
}

#[test]
fn nccl_init_times_out_when_a_rank_never_joins_it() {
    // Rank 1 passes the CPU barrier that precedes NCCL init but never calls init itself (it
    // uses the CPU backend): the blocking init would wait forever; the non-blocking one
    // gives up after the op timeout and aborts the communicator. Needs one GPU, for rank 0.
    if worker() {
        let (rank, _) = rank_world();
        let opts = Options::from_env().unwrap();
        if rank == 0 {
            assert!(ddp_comm::cuda::load_torch_cuda().unwrap());
            let err = ProcessGroup::new(opts.backend(Backend::Nccl)).unwrap_err();
            assert!(matches!(err, CommError::NcclInit { .. }), "{err:?}");
            println!("ERROR: {err}");
        } else {
            let group = ProcessGroup::new(opts.backend(Backend::Cpu)).unwrap();
            group.barrier().unwrap();
            // Alive (its heartbeat goes on) until rank 0 has given up.
            std::thread::sleep(std::time::Duration::from_secs(8));
        }
        return;
    }
    skip_without_gpu!();
    // Init is bounded by the longer of the two timeouts.
    let outputs = run_world_each("nccl_init_times_out_when_a_rank_never_joins_it", 2, |_| {
        vec![
            ("DDP_OP_TIMEOUT_S", "3".to_string()),
            ("DDP_RDZV_TIMEOUT_S", "3".to_string()),
        ]
    });
    let errors = lines_with(&outputs[0], "ERROR: ");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with("NCCL communicator init of rank 0 on cuda:0 timed out after 3s"),
        "{errors:?}"
    );
}

/// Seconds one 4096x4096 f32 matmul takes on `device`, measured after a warm-up.
fn seconds_per_matmul(x: &Tensor) -> f64 {
    let Device::Cuda(index) = x.device() else {
        unreachable!("a CUDA tensor")
    };
    for _ in 0..2 {
        let _ = x.mm(x);
    }
    tch::Cuda::synchronize(index as i64);
    let start = std::time::Instant::now();
    for _ in 0..8 {
        let _ = x.mm(x);
    }
    tch::Cuda::synchronize(index as i64);
    start.elapsed().as_secs_f64() / 8.0
}

/// Queues about `seconds` of matmuls on the current stream of `device` and returns at once
/// (the host is far ahead of the device afterwards).
fn keep_busy(device: Device, seconds: f64) {
    let x = Tensor::randn([4096, 4096], (Kind::Float, device)) / 64.0;
    let count = (seconds / seconds_per_matmul(&x)).ceil() as usize;
    for _ in 0..count {
        let _ = x.mm(&x);
    }
}

/// Bucket 0's wait times out and aborts the communicator. Bucket 1's wait must then fail
/// too, even once its end event has completed (the aborted kernel exited early, the tensor
/// half-reduced), and without asking NCCL about the freed communicator.
#[test]
fn nccl_a_wait_after_an_abort_is_an_error() {
    if worker() {
        assert!(ddp_comm::cuda::load_torch_cuda().unwrap());
        let opts = Options::from_env().unwrap();
        let group = std::sync::Arc::new(ProcessGroup::new(opts.backend(Backend::Nccl)).unwrap());
        let device = Device::Cuda(group.local_rank());
        // The collectives wait on the current stream, busy for three times the timeout.
        keep_busy(device, 3.0);
        let a = Tensor::ones([1 << 20], (Kind::Float, device));
        let b = Tensor::ones([1 << 20], (Kind::Float, device));
        let first = group.all_reduce_async(&a, ReduceOp::Sum);
        let second = group.all_reduce_async(&b, ReduceOp::Sum);
        assert!(!second.is_completed(), "reported complete while queued");
        // The wait times out, or the watchdog did a moment before it.
        let err = first.wait().unwrap_err();
        let timed_out = match &err {
            CommError::Timeout { .. } => true,
            CommError::Poisoned(why) => why.contains("all_reduce timed out after 1s"),
            _ => false,
        };
        assert!(timed_out, "{err:?}");
        // Let the device run everything out, the aborted collectives included.
        tch::Cuda::synchronize(group.local_rank() as i64);
        assert!(second.is_completed());
        match second.wait() {
            Err(CommError::Poisoned(why)) => assert!(why.contains("aborted"), "{why}"),
            other => panic!("the wait after the abort returned {other:?}"),
        }
        let mut c = Tensor::ones([4], (Kind::Float, device));
        let err = group.all_reduce(&mut c, ReduceOp::Sum).unwrap_err();
        assert!(matches!(err, CommError::Poisoned(_)), "{err:?}");
        println!("rank 0: the wait after the abort failed");
        return;
    }
    skip_without_gpu!();
    // The 1 s op timeout bounds the collectives only: init, whose first run in a process
    // can take about a second, has the harness's rendezvous timeout.
    run_world_each("nccl_a_wait_after_an_abort_is_an_error", 1, |_| {
        vec![("DDP_OP_TIMEOUT_S", "1".to_string())]
    });
}

/// A temporary all-reduced with its `Work` dropped at once: the caching allocator must not
/// hand its memory to the next tensor while NCCL still has to write it, and the result
/// of a kept tensor is right. `is_completed` says false while the device is busy.
#[test]
fn nccl_a_dropped_work_keeps_its_temporary() {
    if worker() {
        let (group, device) = group_on_gpu();
        let group = std::sync::Arc::new(group);
        let (rank, n) = rank_world();
        // An odd size, so that no other free block fits it exactly.
        let len = 1_000_003;
        keep_busy(device, 0.5);
        let temporary_at = {
            let temporary = Tensor::full([len], (rank + 1) as f64, (Kind::Float, device));
            let _ = group.all_reduce_async(&temporary, ReduceOp::Sum);
            temporary.data_ptr() as usize
        };
        let next = Tensor::full([len], 7.0, (Kind::Float, device));
        assert_ne!(
            next.data_ptr() as usize,
            temporary_at,
            "the allocator reused the memory of a collective still in flight"
        );
        let kept = Tensor::full([len], (rank + 1) as f64, (Kind::Float, device));
        let work = group.all_reduce_async(&kept, ReduceOp::Sum);
        assert!(
            !work.is_completed(),
            "complete while the device is still busy"
        );
        group.barrier().unwrap();
        assert!(work.is_completed(), "not complete after the barrier");
        work.wait().unwrap();
        assert_eq!(next.min().double_value(&[]), 7.0);
        assert_eq!(next.max().double_value(&[]), 7.0);
        let want = (n * (n + 1) / 2) as f64;
        assert_eq!(kept.min().double_value(&[]), want);
        assert_eq!(kept.max().double_value(&[]), want);
        println!("rank {rank}: the dropped work kept its temporary");
        return;
    }
    let n = skip_without_gpu!();
    run_world("nccl_a_dropped_work_keeps_its_temporary", n, &[]);
}

/// Inputs produced on a pool stream made current (not the default stream): the collectives
/// wait for them, and after `wait_stream` that stream's next kernels see the results.
#[test]
fn nccl_collectives_follow_the_current_stream() {
    if worker() {
        let (group, device) = group_on_gpu();
        let group = std::sync::Arc::new(group);
        let (rank, n) = rank_world();
        let stream = tch_ext::CudaStream::from_pool(group.local_rank(), false).unwrap();
        let guard = tch_ext::set_current_stream(stream).unwrap();
        let len = 1 << 20;
        let mut input = Tensor::zeros([len], (Kind::Float, device));
        keep_busy(device, 0.5);
        input += (rank + 1) as f64;
        // Blocking and out of place, so even one rank shows whether it read the input early.
        let mut gathered = Tensor::empty([n as i64 * len], (Kind::Float, device));
        group.all_gather_into(&input, &mut gathered).unwrap();
        for r in 0..n {
            let part = gathered.narrow(0, r as i64 * len, len);
            assert_eq!(
                part.min().double_value(&[]),
                (r + 1) as f64,
                "rank {r}'s part"
            );
            assert_eq!(
                part.max().double_value(&[]),
                (r + 1) as f64,
                "rank {r}'s part"
            );
        }
        // Asynchronous, waited for by the stream: the sum lands before the next kernel.
        let mut t = Tensor::zeros([len], (Kind::Float, device));
        keep_busy(device, 0.5);
        t += (rank + 1) as f64;
        group
            .all_reduce_async(&t, ReduceOp::Sum)
            .wait_stream()
            .unwrap();
        let doubled = &t * 2.0;
        let want = (n * (n + 1)) as f64;
        assert_eq!(doubled.min().double_value(&[]), want);
        assert_eq!(doubled.max().double_value(&[]), want);
        drop(guard);
        group.barrier().unwrap();
        println!("rank {rank}: collectives followed the current stream");
        return;
    }
    let n = skip_without_gpu!();
    run_world("nccl_collectives_follow_the_current_stream", n, &[]);
}

/// A blocking collective waits on the host for its own end only: with a pool stream current,
/// work queued earlier on the default stream, which the input does not depend on, is still
/// running when the all-reduce returns (a wait for the whole default stream would have let it
/// finish first, and idled the GPU before every step's next kernel).
#[test]
fn nccl_a_blocking_collective_waits_for_its_input_only() {
    if worker() {
        let (group, device) = group_on_gpu();
        let (rank, n) = rank_world();
        let index = group.local_rank();
        // Long enough to outlast the first collective's connection set-up.
        keep_busy(device, 3.0);
        let unrelated = tch_ext::CudaEvent::new(index).unwrap();
        unrelated
            .record(&tch_ext::CudaStream::current(index).unwrap())
            .unwrap();
        let stream = tch_ext::CudaStream::from_pool(index, false).unwrap();
        let guard = tch_ext::set_current_stream(stream).unwrap();
        let mut t = Tensor::full([1 << 20], (rank + 1) as f64, (Kind::Float, device));
        group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        let waited = unrelated.query().unwrap();
        let want = (n * (n + 1) / 2) as f64;
        assert_eq!(t.min().double_value(&[]), want);
        assert_eq!(t.max().double_value(&[]), want);
        assert!(
            !waited,
            "the blocking all-reduce waited for the default stream's unrelated work"
        );
        drop(guard);
        tch::Cuda::synchronize(index as i64);
        println!("rank {rank}: the blocking all-reduce waited for its input only");
        return;
    }
    let n = skip_without_gpu!();
    run_world(
        "nccl_a_blocking_collective_waits_for_its_input_only",
        n,
        &[],
    );
}

/// A collective that only a stream waits for (`wait_stream`) and that exceeds the timeout:
/// the watchdog aborts the communicator without any further call from the program, so the
/// stream cannot hang forever, and the other work then reports the abort.
#[test]
fn nccl_the_watchdog_aborts_a_collective_only_a_stream_waits_for() {
    if worker() {
        assert!(ddp_comm::cuda::load_torch_cuda().unwrap());
        let opts = Options::from_env().unwrap();
        let group = std::sync::Arc::new(ProcessGroup::new(opts.backend(Backend::Nccl)).unwrap());
        let device = Device::Cuda(group.local_rank());
        keep_busy(device, 4.0);
        let a = Tensor::ones([1 << 20], (Kind::Float, device));
        let b = Tensor::ones([1 << 20], (Kind::Float, device));
        group
            .all_reduce_async(&a, ReduceOp::Sum)
            .wait_stream()
            .unwrap();
        let other = group.all_reduce_async(&b, ReduceOp::Sum);
        // Past the timeout, with no call into the group meanwhile.
        std::thread::sleep(std::time::Duration::from_millis(2000));
        assert!(other.is_completed(), "the watchdog did not abort");
        match other.wait() {
            Err(CommError::Poisoned(why)) => {
                assert!(why.contains("all_reduce timed out after 1s"), "{why}")
            }
            other => panic!("expected the watchdog's abort, got {other:?}"),
        }
        tch::Cuda::synchronize(group.local_rank() as i64);
        println!("rank 0: the watchdog aborted the communicator");
        return;
    }
    skip_without_gpu!();
    // As above: the 1 s bounds the collectives, not init.
    run_world_each(
        "nccl_the_watchdog_aborts_a_collective_only_a_stream_waits_for",
        1,
        |_| vec![("DDP_OP_TIMEOUT_S", "1".to_string())],
    );
}

/// `wait_stream` makes the *calling thread's current* stream wait for the collective, on
/// one GPU too. Pool stream A is current while a second of matmuls and the all-reduce are
/// queued (the collective waits, on NCCL's side stream, behind that work on A); then pool
/// stream B is made current and waits. An event recorded on B right after must still be
/// pending: B is empty apart from that wait, so the event completes at once if
/// `wait_work_on_stream` waited on another stream (A, the default stream) or not at all.
/// One rank does no device work for an in-place sum, so the results alone (as in
/// `nccl_collectives_follow_the_current_stream`) cannot show this.
#[test]
fn nccl_wait_stream_makes_the_current_stream_wait() {
    if worker() {
        let (group, device) = group_on_gpu();
        let group = std::sync::Arc::new(group);
        let (rank, n) = rank_world();
        let index = group.local_rank();
        let a = tch_ext::CudaStream::from_pool(index, false).unwrap();
        // The pool is round-robin over several streams: take the next one that is not A.
        let b = std::iter::repeat_with(|| tch_ext::CudaStream::from_pool(index, false).unwrap())
            .find(|s| *s != a)
            .unwrap();
        let on_a = tch_ext::set_current_stream(a).unwrap();
        keep_busy(device, 1.0);
        let t = Tensor::ones([1 << 20], (Kind::Float, device));
        let work = group.all_reduce_async(&t, ReduceOp::Sum);
        drop(on_a);
        let on_b = tch_ext::set_current_stream(b).unwrap();
        work.wait_stream().unwrap();
        let after_wait = tch_ext::CudaEvent::new(index).unwrap();
        after_wait.record(&b).unwrap();
        let done_at_once = after_wait.query().unwrap();
        // B's next kernels see the result.
        let doubled = &t * 2.0;
        drop(on_b);
        assert!(
            !done_at_once,
            "stream B did not wait for the collective queued behind A's work"
        );
        after_wait.synchronize().unwrap();
        assert_eq!(doubled.min().double_value(&[]), 2.0 * n as f64);
        assert_eq!(doubled.max().double_value(&[]), 2.0 * n as f64);
        tch::Cuda::synchronize(index as i64);
        println!("rank {rank}: wait_stream made the current stream wait");
        return;
    }
    let n = skip_without_gpu!();
    run_world("nccl_wait_stream_makes_the_current_stream_wait", n, &[]);
}

/// Polling a collective still queued behind ~1 s of matmuls gets "not ready" from CUDA,
/// which CUDA also leaves in the thread's last-error slot; libtorch reads that slot after
/// every kernel launch, so it must be cleared: afterwards the slot reads `cudaSuccess` and a
/// kernel launched on the same thread runs. Once through `wait` (which polls), once through
/// a second collective's enqueue and `wait_stream` (which query the first one's event).
#[test]
fn nccl_polling_a_busy_collective_leaves_no_cuda_error_behind() {
    if worker() {
        let (group, device) = group_on_gpu();
        let group = std::sync::Arc::new(group);
        let cudart = nccl_sys::Cudart::load().unwrap();
        for how in ["wait", "wait_stream"] {
            keep_busy(device, 1.0);
            let t = Tensor::ones([1 << 20], (Kind::Float, device));
            let first = group.all_reduce_async(&t, ReduceOp::Sum);
            if how == "wait" {
                first.wait().unwrap();
            } else {
                let u = Tensor::ones([1 << 10], (Kind::Float, device));
                let second = group.all_reduce_async(&u, ReduceOp::Sum);
                assert!(
                    !first.is_completed(),
                    "the matmuls did not outlast the polls"
                );
                second.wait_stream().unwrap();
                first.wait_stream().unwrap();
            }
            // SAFETY: plain CUDA runtime call on this thread's error slot.
            let last = unsafe { (cudart.cudaPeekAtLastError)() };
            assert_eq!(last, nccl_sys::cudaError_t::cudaSuccess, "after {how}");
            let doubled = t.f_mul_scalar(2.0).unwrap();
            assert_eq!(doubled.min().double_value(&[]), 2.0, "after {how}");
        }
        println!("polls of a busy collective left no CUDA error behind");
        return;
    }
    skip_without_gpu!();
    run_world(
        "nccl_polling_a_busy_collective_leaves_no_cuda_error_behind",
        1,
        &[],
    );
}

/// `NCCL_COMM_BLOCKING=1` would turn the communicator's init blocking again (NCCL applies
/// it over the config), with no timeout for a rank that never joins: creating an NCCL group
/// refuses it, naming the variable, before anything of NCCL runs. Runs everywhere (no GPU
/// needed); the variable is set only in the spawned rank's environment.
#[test]
fn nccl_comm_blocking_is_refused_at_group_creation() {
    if worker() {
        let err = refusal(Options::from_env().unwrap().backend(Backend::Nccl));
        assert!(
            matches!(&err, CommError::MalformedEnv { var, .. } if var == "NCCL_COMM_BLOCKING"),
            "{err:?}"
        );
        return;
    }
    let error = alone_error(
        "nccl_comm_blocking_is_refused_at_group_creation",
        ("NCCL_COMM_BLOCKING", "1"),
    );
    assert!(error.contains("without a timeout"), "{error}");
}

/// In a rank: the error creating a group with `opts` fails with, printed for the test.
fn refusal(opts: Options) -> CommError {
    let err = ProcessGroup::new(opts).unwrap_err();
    println!("ERROR: {err}");
    err
}

/// The one error the rank of `test` printed, run alone with the variable `var` set.
fn alone_error(test: &str, (var, value): (&str, &str)) -> String {
    let outputs = run_world(test, 1, &[(var, value.to_string())]);
    let errors = lines_with(&outputs[0], "ERROR: ");
    assert_eq!(errors.len(), 1, "{errors:?}");
    errors[0].clone()
}

/// A group that trains on a CUDA device and names no backend, where NCCL cannot be loaded
/// (here `DDP_NCCL_LIBRARY` names no file), fails at creation with the load error, which
/// names the file tried and the variable, instead of taking the CPU backend and failing at
/// the first CUDA collective. Runs everywhere (the device is named, not used).
#[test]
fn a_cuda_group_without_nccl_fails_at_creation_naming_the_library() {
    if worker() {
        let err = refusal(Options::from_env().unwrap().device(Device::Cuda(0)));
        assert!(matches!(&err, CommError::Load(_)), "{err:?}");
        return;
    }
    let error = alone_error(
        "a_cuda_group_without_nccl_fails_at_creation_naming_the_library",
        ("DDP_NCCL_LIBRARY", "/nowhere/libnccl.so.2"),
    );
    assert_eq!(
        error,
        "could not load libnccl.so.2; looked at: '/nowhere/libnccl.so.2' (no such file); \
         set DDP_NCCL_LIBRARY to the library file"
    );
}

/// A figure, not a check: the host's time to queue a one-element `all_reduce_async` on the
/// non-blocking communicator (where NCCL may hand the launch to a thread of its own and the
/// call polls it), median and 90th percentile of 200 calls after 20 warm-up ones.
#[test]
fn nccl_enqueue_time_of_a_small_all_reduce_async() {
    if worker() {
        let (group, device) = group_on_gpu();
        let group = std::sync::Arc::new(group);
        let t = Tensor::ones([1], (Kind::Float, device));
        let mut times: Vec<f64> = (0..220)
            .map(|_| {
                let start = std::time::Instant::now();
                let work = group.all_reduce_async(&t, ReduceOp::Sum);
                let took = start.elapsed().as_secs_f64() * 1e6;
                work.wait_stream().unwrap();
                took
            })
            .skip(20)
            .collect();
        group.barrier().unwrap();
        times.sort_by(f64::total_cmp);
        println!(
            "FIGURE all_reduce_async enqueue: median {:.1} us, p90 {:.1} us over {} calls",
            times[times.len() / 2],
            times[times.len() * 9 / 10],
            times.len()
        );
        return;
    }
    let n = skip_without_gpu!();
    let outputs = run_world("nccl_enqueue_time_of_a_small_all_reduce_async", n, &[]);
    let figures = lines_with(&outputs[0], "FIGURE ");
    assert_eq!(figures.len(), 1, "rank 0 printed no figure");
    for line in figures {
        println!("{line} (rank 0 of {n})");
    }
}
