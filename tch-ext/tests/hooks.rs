//! Post-accumulate-grad hooks and `set_grad`, on CPU.

use std::sync::{Arc, Mutex};

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_ext::{
    clear_post_accumulate_grad_hook, has_post_accumulate_grad_hook,
    set_fallible_post_accumulate_grad_hook, set_grad, set_post_accumulate_grad_hook, tensor_id,
    TchExtError,
};

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

/// `w` with requires_grad, `x` constant, and the loss `(w * x).sum()`.
fn leaf() -> (Tensor, Tensor) {
    let w = Tensor::from_slice(&[1.0f32, -2.0, 0.5]).set_requires_grad(true);
    let x = Tensor::from_slice(&[4.0f32, 5.0, -6.0]);
    (w, x)
}

fn loss(w: &Tensor, x: &Tensor) -> Tensor {
    (w * x).sum(Kind::Float)
}

#[test]
fn hook_sees_the_accumulated_gradient_once_per_backward() {
    let (w, x) = leaf();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    set_post_accumulate_grad_hook(&w, move |p| log.lock().unwrap().push(values(&p.grad())))
        .unwrap();
    assert!(has_post_accumulate_grad_hook(&w).unwrap());

    loss(&w, &x).backward();
    loss(&w, &x).backward();

    let seen = seen.lock().unwrap();
    assert_eq!(*seen, vec![vec![4.0, 5.0, -6.0], vec![8.0, 10.0, -12.0]]);
}

#[test]
fn hook_receives_the_parameter_itself() {
    let (w, x) = leaf();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    set_post_accumulate_grad_hook(&w, move |p| {
        log.lock()
            .unwrap()
            .push((values(p), p.requires_grad(), p.data_ptr() as usize));
    })
    .unwrap();
    loss(&w, &x).backward();
    let seen = seen.lock().unwrap();
    assert_eq!(
        *seen,
        vec![(vec![1.0, -2.0, 0.5], true, w.data_ptr() as usize)]
    );
}

#[test]
fn hooks_fire_last_layer_first() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let l1 = nn::linear(&root / "l1", 3, 4, Default::default());
    let l2 = nn::linear(&root / "l2", 4, 2, Default::default());
    let order = Arc::new(Mutex::new(Vec::new()));
    let params = [
        ("l1.weight", &l1.ws),
        ("l1.bias", l1.bs.as_ref().unwrap()),
        ("l2.weight", &l2.ws),
        ("l2.bias", l2.bs.as_ref().unwrap()),
    ];
    for (name, p) in params {
        let log = Arc::clone(&order);
        set_post_accumulate_grad_hook(p, move |_| log.lock().unwrap().push(name)).unwrap();
    }

    let x = Tensor::from_slice(&[0.5f32, -1.0, 2.0, 1.5, 0.25, -0.75]).view([2, 3]);
    l2.forward(&l1.forward(&x).relu())
        .sum(Kind::Float)
        .backward();

    let order = order.lock().unwrap();
    assert_eq!(
        order.len(),
        4,
        "each parameter's hook fires once: {order:?}"
    );
    let mut layers: Vec<&str> = order.iter().map(|n| &n[..2]).collect();
    layers.dedup();
    assert_eq!(layers, ["l2", "l1"], "order {order:?}");
}

#[test]
fn clearing_stops_the_calls_and_drops_the_closure() {
    let (w, x) = leaf();
    let calls = Arc::new(Mutex::new(0));
    let counter = Arc::clone(&calls);
    set_post_accumulate_grad_hook(&w, move |_| *counter.lock().unwrap() += 1).unwrap();
    assert_eq!(Arc::strong_count(&calls), 2);
    loss(&w, &x).backward();
    assert_eq!(*calls.lock().unwrap(), 1);

    clear_post_accumulate_grad_hook(&w).unwrap();
    assert_eq!(Arc::strong_count(&calls), 1);
    assert!(!has_post_accumulate_grad_hook(&w).unwrap());
    loss(&w, &x).backward();
    assert_eq!(*calls.lock().unwrap(), 1);
    // Clearing twice, or a tensor that never had a hook, is fine.
    clear_post_accumulate_grad_hook(&w).unwrap();
    clear_post_accumulate_grad_hook(&x).unwrap();
}

#[test]
fn replacing_a_hook_drops_the_old_closure() {
    let (w, x) = leaf();
    let first = Arc::new(Mutex::new(0));
    let second = Arc::new(Mutex::new(0));
    let counter = Arc::clone(&first);
    set_post_accumulate_grad_hook(&w, move |_| *counter.lock().unwrap() += 1).unwrap();
    let counter = Arc::clone(&second);
    set_post_accumulate_grad_hook(&w, move |_| *counter.lock().unwrap() += 1).unwrap();
    assert_eq!(Arc::strong_count(&first), 1);
    assert_eq!(Arc::strong_count(&second), 2);

    loss(&w, &x).backward();
    assert_eq!((*first.lock().unwrap(), *second.lock().unwrap()), (0, 1));
}

#[test]
fn dropping_the_tensor_drops_the_closure() {
    let (w, x) = leaf();
    let token = Arc::new(());
    let held = Arc::clone(&token);
    set_post_accumulate_grad_hook(&w, move |_| drop(Arc::clone(&held))).unwrap();
    loss(&w, &x).backward();
    assert_eq!(Arc::strong_count(&token), 2);
    drop(w);
    assert_eq!(Arc::strong_count(&token), 1);
}

#[test]
fn a_hook_may_clear_itself() {
    let (w, x) = leaf();
    let token = Arc::new(Mutex::new(0));
    let held = Arc::clone(&token);
    // The hook holds a second handle to `w` only for the call: it clears itself on first use.
    let w2 = w.shallow_clone();
    let w2 = Mutex::new(Some(w2));
    set_post_accumulate_grad_hook(&w, move |p| {
        *held.lock().unwrap() += 1;
        clear_post_accumulate_grad_hook(p).unwrap();
        w2.lock().unwrap().take();
    })
    .unwrap();
    loss(&w, &x).backward();
    loss(&w, &x).backward();
    assert_eq!(*token.lock().unwrap(), 1);
    assert_eq!(Arc::strong_count(&token), 1);
}

#[test]
fn a_panicking_hook_fails_the_backward_pass() {
    let (w, x) = leaf();
    set_post_accumulate_grad_hook(&w, |_| panic!("hook failure on purpose")).unwrap();
    let err = loss(&w, &x).f_backward().unwrap_err().to_string();
    assert!(err.contains("post-accumulate-grad hook panicked"), "{err}");
    // The gradient was accumulated before the hook ran, and autograd still works.
    clear_post_accumulate_grad_hook(&w).unwrap();
    assert_eq!(values(&w.grad()), [4.0, 5.0, -6.0]);
    loss(&w, &x).backward();
    assert_eq!(values(&w.grad()), [8.0, 10.0, -12.0]);
}

#[test]
fn a_hook_that_returns_an_error_fails_the_backward_pass_with_its_message() {
    let (w, x) = leaf();
    set_fallible_post_accumulate_grad_hook(&w, |_| Err("refused on purpose".into())).unwrap();
    let err = loss(&w, &x).f_backward().unwrap_err().to_string();
    assert!(err.contains("refused on purpose"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // As after a panic: the gradient was accumulated, and autograd still works.
    clear_post_accumulate_grad_hook(&w).unwrap();
    assert_eq!(values(&w.grad()), [4.0, 5.0, -6.0]);
    loss(&w, &x).backward();
    assert_eq!(values(&w.grad()), [8.0, 10.0, -12.0]);
}

/// An error without words is not taken for a panic.
#[test]
fn a_hook_error_without_a_message_is_not_reported_as_a_panic() {
    let (w, x) = leaf();
    set_fallible_post_accumulate_grad_hook(&w, |_| Err(String::new())).unwrap();
    let err = loss(&w, &x).f_backward().unwrap_err().to_string();
    assert!(err.contains("(an error without a message)"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A panic payload whose destructor panics as well.
struct PanicsOnDrop;

impl Drop for PanicsOnDrop {
    fn drop(&mut self) {
        panic!("the panic payload's destructor panics on purpose");
    }
}

/// Were the payload dropped outside `catch_unwind`, its destructor's panic would unwind out of
/// the `extern "C"` call-back, which aborts the process: this test binary.
#[test]
fn a_panic_whose_payload_panics_on_drop_still_only_fails_the_backward_pass() {
    let (w, x) = leaf();
    set_post_accumulate_grad_hook(&w, |_| std::panic::panic_any(PanicsOnDrop)).unwrap();
    let err = loss(&w, &x).f_backward().unwrap_err().to_string();
    assert!(err.contains("post-accumulate-grad hook panicked"), "{err}");
    clear_post_accumulate_grad_hook(&w).unwrap();
    loss(&w, &x).backward();
    assert_eq!(values(&w.grad()), [8.0, 10.0, -12.0]);
}

#[test]
fn hooks_need_a_leaf_that_requires_grad() {
    let (w, x) = leaf();
    let token = Arc::new(());
    for bad in [&x, &(&w * 2.0)] {
        let held = Arc::clone(&token);
        let err = set_post_accumulate_grad_hook(bad, move |_| drop(held.clone())).unwrap_err();
        match err {
            TchExtError::Torch(msg) => {
                assert!(msg.contains("leaf tensors that require grad"), "{msg}")
            }
            other => panic!("unexpected error {other:?}"),
        }
    }
    // The rejected closures were dropped.
    assert_eq!(Arc::strong_count(&token), 1);
    assert!(set_post_accumulate_grad_hook(&Tensor::new(), |_| ()).is_err());
}

#[test]
fn set_grad_to_none_and_back() {
    let (w, x) = leaf();
    loss(&w, &x).backward();
    assert!(w.grad().defined());

    set_grad(&w, None).unwrap();
    assert!(!w.grad().defined());
    // Zeroed "to none": the next backward writes instead of adding.
    loss(&w, &x).backward();
    assert_eq!(values(&w.grad()), [4.0, 5.0, -6.0]);

    let g = Tensor::from_slice(&[0.25f32, 0.5, 0.75]);
    set_grad(&w, Some(&g)).unwrap();
    assert_eq!(values(&w.grad()), [0.25, 0.5, 0.75]);
    assert_eq!(
        w.grad().data_ptr(),
        g.data_ptr(),
        "the gradient aliases g, as in PyTorch"
    );
}

#[test]
fn set_grad_checks_dtype_and_shape() {
    let (w, _) = leaf();
    let cases = [
        (Tensor::from_slice(&[1.0f64, 2.0, 3.0]), "different type"),
        (Tensor::from_slice(&[1.0f32, 2.0]), "different size"),
    ];
    for (g, why) in cases {
        match set_grad(&w, Some(&g)).unwrap_err() {
            TchExtError::Torch(msg) => assert!(msg.contains(why), "{msg}"),
            other => panic!("unexpected error {other:?}"),
        }
    }
    assert!(!w.grad().defined());
}

#[test]
fn set_grad_refuses_the_parameter_as_its_own_gradient() {
    let (w, _) = leaf();
    match set_grad(&w, Some(&w.shallow_clone())).unwrap_err() {
        TchExtError::Torch(msg) => assert!(msg.contains("as its own grad"), "{msg}"),
        other => panic!("unexpected error {other:?}"),
    }
    assert!(!w.grad().defined());
    // Another tensor on the same data is a gradient, as `w.grad = w.detach()` is.
    set_grad(&w, Some(&w.detach())).unwrap();
    assert_eq!(values(&w.grad()), [1.0, -2.0, 0.5]);
}

#[test]
fn set_grad_checks_layout_and_backend_but_takes_a_sparse_gradient() {
    let dense = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    let w = dense.copy().set_requires_grad(true);
    // A sparse gradient of a dense parameter (an embedding's) is allowed.
    set_grad(&w, Some(&dense.to_sparse_sparse_dim(2))).unwrap();
    assert!(w.grad().is_sparse());
    // A dense gradient of a sparse parameter, or an MKL-DNN one of a dense parameter, is not.
    let sparse = dense.to_sparse_sparse_dim(2).set_requires_grad(true);
    for (param, grad) in [(&sparse, dense.copy()), (&w, dense.to_mkldnn())] {
        match set_grad(param, Some(&grad)).unwrap_err() {
            TchExtError::Torch(msg) => {
                assert!(msg.contains("different layout or backend"), "{msg}")
            }
            other => panic!("unexpected error {other:?}"),
        }
    }
    assert!(!sparse.grad().defined());
}

/// One tensor object, one id: shared by its handles (`shallow_clone`, a `VarStore`'s), not by
/// views, detached tensors or tensors without elements, whose data pointers agree.
#[test]
fn tensor_ids_tell_tensor_objects_apart() {
    let vs = nn::VarStore::new(Device::Cpu);
    let w = vs.root().var("w", &[2, 3], nn::Init::Const(1.0));
    let _tied = vs.root().sub("head").add("w", w.shallow_clone(), true);
    let variables = vs.variables();
    assert_eq!(tensor_id(&variables["w"]), tensor_id(&w));
    assert_eq!(tensor_id(&variables["head.w"]), tensor_id(&w));
    assert_ne!(tensor_id(&w.view([6])), tensor_id(&w));
    assert_ne!(tensor_id(&w.detach()), tensor_id(&w));
    let (a, b) = (
        Tensor::zeros([0], (Kind::Float, Device::Cpu)),
        Tensor::ones([0], (Kind::Float, Device::Cpu)),
    );
    assert_ne!(tensor_id(&a), tensor_id(&b));
    assert_eq!(tensor_id(&Tensor::new()), 0);
    assert_ne!(tensor_id(&a), 0);
}
