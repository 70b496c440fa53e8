//! CUDA streams and events. On a machine without a GPU each test prints
//! `skipped: no CUDA device` and returns; `cuda_calls_report_no_cuda` checks that case.

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use tch_ext::{
    cuda_device_count, cuda_is_available, record_current_stream, record_stream, set_current_stream,
    CudaEvent, CudaStream, TchExtError,
};

/// rustc's `--as-needed` drops libtorch_cuda from test binaries that call nothing in it: load
/// it (and so libc10_cuda, which registers the CUDA backend) from the libtorch folder.
fn load_torch_cuda() -> bool {
    let Some(root) = std::env::var_os("LIBTORCH").or(option_env!("LIBTORCH").map(Into::into))
    else {
        return false;
    };
    let lib = std::path::Path::new(&root).join("lib/libtorch_cuda.so");
    if !lib.exists() {
        return false;
    }
    let path = std::ffi::CString::new(lib.to_string_lossy().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; the handle is never closed.
    !unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null()
}

fn gpu() -> bool {
    let available = load_torch_cuda() && tch::Cuda::is_available() && cuda_is_available();
    if !available {
        println!("skipped: no CUDA device");
    }
    available
}

#[test]
fn cuda_calls_report_no_cuda() {
    load_torch_cuda();
    if cuda_is_available() {
        let count = cuda_device_count();
        assert!(matches!(
            CudaStream::current(count),
            Err(TchExtError::NoSuchDevice { device, count: c }) if device == count && c == count
        ));
        return;
    }
    assert_eq!(cuda_device_count(), 0);
    assert!(matches!(CudaStream::current(0), Err(TchExtError::NoCuda)));
    assert!(matches!(
        CudaStream::from_pool(0, false),
        Err(TchExtError::NoCuda)
    ));
    assert!(matches!(CudaEvent::new(0), Err(TchExtError::NoCuda)));
}

#[test]
fn current_and_pool_streams_differ() {
    if !gpu() {
        return;
    }
    let current = CudaStream::current(0).unwrap();
    let side = CudaStream::from_pool(0, false).unwrap();
    assert_eq!((current.device(), side.device()), (0, 0));
    assert_ne!(current, side);
    assert!(!side.as_raw().is_null());
    side.synchronize().unwrap();
    assert!(side.query().unwrap());
}

#[test]
fn stream_guard_sets_and_restores_the_current_stream() {
    if !gpu() {
        return;
    }
    let before = CudaStream::current(0).unwrap();
    let side = CudaStream::from_pool(0, true).unwrap();
    {
        let _guard = set_current_stream(side).unwrap();
        assert_eq!(CudaStream::current(0).unwrap(), side);
        // libtorch queues kernels on the current stream: tens of milliseconds of matmuls
        // keep the side stream busy (had they gone to another stream, it would be idle).
        let a = Tensor::randn([4096, 4096], (Kind::Float, Device::Cuda(0))) / 64.0;
        side.synchronize().unwrap();
        let mut b = a.shallow_clone();
        for _ in 0..10 {
            b = b.mm(&a);
        }
        assert!(
            !side.query().unwrap(),
            "the kernels were not queued on the side stream"
        );
        let x = Tensor::ones([1024], (Kind::Float, Device::Cuda(0))) * 2.0;
        side.synchronize().unwrap();
        assert!(side.query().unwrap());
        assert_eq!(x.sum(Kind::Float).double_value(&[]), 2048.0);
    }
    assert_eq!(CudaStream::current(0).unwrap(), before);
}

#[test]
fn events_order_work_between_streams() {
    if !gpu() {
        return;
    }
    let main = CudaStream::current(0).unwrap();
    let side = CudaStream::from_pool(0, false).unwrap();
    let event = CudaEvent::new(0).unwrap();
    assert!(
        event.query().unwrap(),
        "an event never recorded is complete"
    );

    // Long work on the main stream, then the side stream waits for it and reads the result.
    let a = Tensor::rand([2048, 2048], (Kind::Float, Device::Cuda(0)));
    let mut b = a.shallow_clone();
    for _ in 0..20 {
        b = b.matmul(&a) / 2048.0;
    }
    event.record(&main).unwrap();
    side.wait_event(&event).unwrap();
    let total = {
        let _guard = set_current_stream(side).unwrap();
        b.sum(Kind::Float)
    };
    let side_done = CudaEvent::new(0).unwrap();
    side_done.record(&side).unwrap();
    side_done.synchronize().unwrap();
    assert!(side_done.query().unwrap() && event.query().unwrap());
    let expected = b.sum(Kind::Float);
    main.synchronize().unwrap();
    assert_eq!(total.double_value(&[]), expected.double_value(&[]));

    // An event completes once the recorded work has; poll with a generous bound.
    let later = CudaEvent::new(0).unwrap();
    let _more = a.matmul(&a);
    later.record(&main).unwrap();
    let start = Instant::now();
    while !later.query().unwrap() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "event never completed"
        );
        std::thread::yield_now();
    }
}

#[test]
fn events_and_streams_of_different_devices_are_refused() {
    if !gpu() {
        return;
    }
    if cuda_device_count() < 2 {
        println!("skipped: needs 2 CUDA devices");
        return;
    }
    let event = CudaEvent::new(0).unwrap();
    let other = CudaStream::current(1).unwrap();
    assert!(matches!(
        event.record(&other),
        Err(TchExtError::DeviceMismatch {
            event: 0,
            stream: 1
        })
    ));
    assert!(matches!(
        other.wait_event(&event),
        Err(TchExtError::DeviceMismatch {
            event: 0,
            stream: 1
        })
    ));
}

#[test]
fn hooks_on_cuda_parameters_run_on_autograd_device_thread() {
    if !gpu() {
        return;
    }
    let w = Tensor::from_slice(&[1.0f32, 2.0])
        .to_device(Device::Cuda(0))
        .set_requires_grad(true);
    let x = Tensor::from_slice(&[3.0f32, -4.0]).to_device(Device::Cuda(0));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = std::sync::Arc::clone(&seen);
    tch_ext::set_post_accumulate_grad_hook(&w, move |p| {
        let grad = Vec::<f32>::try_from(p.grad().to_device(Device::Cpu)).unwrap();
        log.lock()
            .unwrap()
            .push((grad, std::thread::current().id()));
    })
    .unwrap();
    (&w * &x).sum(Kind::Float).backward();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].0, [3.0, -4.0]);
    assert_ne!(
        seen[0].1,
        std::thread::current().id(),
        "CUDA hooks run on autograd's thread"
    );
}

/// The autograd engine runs a parameter's hook, and a custom backward, on its device thread
/// with the stream current that was current when the forward used the parameter (the
/// node's stream): DDP's buckets are ordered after the gradients because of this.
#[test]
fn hooks_and_custom_backwards_run_on_the_forward_stream() {
    if !gpu() {
        return;
    }
    let side = CudaStream::from_pool(0, false).unwrap();
    let default = CudaStream::current(0).unwrap();
    assert_ne!(default, side);
    let w = Tensor::from_slice(&[1.0f32, 2.0])
        .to_device(Device::Cuda(0))
        .set_requires_grad(true);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (in_hook, in_backward) = (seen.clone(), seen.clone());
    tch_ext::set_post_accumulate_grad_hook(&w, move |_| {
        in_hook
            .lock()
            .unwrap()
            .push(("hook", CudaStream::current(0).unwrap()));
    })
    .unwrap();
    let guard = set_current_stream(side).unwrap();
    let x = Tensor::from_slice(&[3.0f32, -4.0]).to_device(Device::Cuda(0));
    let y = &w * &x;
    let out = y.detach() * 2.0;
    tch_ext::set_backward(&y, &out, move |grad| {
        in_backward
            .lock()
            .unwrap()
            .push(("backward", CudaStream::current(0).unwrap()));
        Ok(grad * 2.0)
    })
    .unwrap();
    drop(guard);
    // backward() is called with the default stream current.
    out.sum(Kind::Float).backward();
    let seen = seen.lock().unwrap();
    assert_eq!(
        *seen,
        [("backward", side), ("hook", side)],
        "the default stream is {default:?}"
    );
    let grad = Vec::<f32>::try_from(w.grad().to_device(Device::Cpu)).unwrap();
    assert_eq!(grad, [6.0, -8.0]);
}

/// Host memory has no streams: recording a CPU (or undefined) tensor is a no-op that
/// succeeds, with or without CUDA, so callers holding tensors of either device need no branch.
#[test]
fn recording_a_cpu_tensor_is_a_no_op() {
    load_torch_cuda();
    let t = Tensor::ones([4], (Kind::Float, Device::Cpu));
    record_current_stream(&t).unwrap();
    record_current_stream(&Tensor::new()).unwrap();
    if cuda_is_available() {
        record_stream(&t, &CudaStream::current(0).unwrap()).unwrap();
    }
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), [1.0; 4]);
}

/// Queues about `seconds` of 4096x4096 matmuls on the current stream of cuda:0 (measured
/// first) and returns at once.
fn keep_busy(seconds: f64) {
    let x = Tensor::randn([4096, 4096], (Kind::Float, Device::Cuda(0))) / 64.0;
    let stream = CudaStream::current(0).unwrap();
    let _ = x.mm(&x);
    stream.synchronize().unwrap();
    let start = Instant::now();
    for _ in 0..4 {
        let _ = x.mm(&x);
    }
    stream.synchronize().unwrap();
    let each = start.elapsed().as_secs_f64() / 4.0;
    for _ in 0..(seconds / each).ceil() as usize {
        let _ = x.mm(&x);
    }
}

/// A tensor allocated on stream A and read on stream B, queued behind half a second of work
/// there, then dropped: libtorch's caching allocator would hand its block to the next
/// allocation of that size on A at once (a control run shows it does), and A's kernels would
/// overwrite it under B's pending read. Recorded on B, the block is held back until B's work
/// so far has finished: the next allocation gets other memory, and the read sees its data.
#[test]
fn a_block_recorded_on_another_stream_is_not_reused_while_that_stream_works() {
    if !gpu() {
        return;
    }
    let a = CudaStream::from_pool(0, false).unwrap();
    let b = std::iter::repeat_with(|| CudaStream::from_pool(0, false).unwrap())
        .find(|s| *s != a)
        .unwrap();
    // An odd size, so that no other free block fits it exactly.
    let len = 1_000_003;
    let run = |record: bool| {
        let on_a = set_current_stream(a).unwrap();
        let t = Tensor::full([len], 3.0, (Kind::Float, Device::Cuda(0)));
        let at = t.data_ptr() as usize;
        drop(on_a);
        let on_b = set_current_stream(b).unwrap();
        keep_busy(0.5);
        let read = t.sum(Kind::Float);
        let b_done = CudaEvent::new(0).unwrap();
        b_done.record(&b).unwrap();
        if record {
            record_stream(&t, &b).unwrap();
        }
        drop(on_b);
        let on_a = set_current_stream(a).unwrap();
        drop(t);
        let next = Tensor::full([len], 7.0, (Kind::Float, Device::Cuda(0)));
        let reused = next.data_ptr() as usize == at;
        let pending = !b_done.query().unwrap();
        drop(on_a);
        b.synchronize().unwrap();
        a.synchronize().unwrap();
        assert!(pending, "stream B finished its work too early for the test");
        (reused, read.double_value(&[]))
    };
    let (reused, _) = run(false);
    assert!(
        reused,
        "control: without record_stream the allocator did not hand the block back on A"
    );
    let (reused, sum) = run(true);
    assert!(
        !reused,
        "the allocator reused a block recorded on a stream that still works"
    );
    assert_eq!(sum, 3.0 * len as f64);
}
