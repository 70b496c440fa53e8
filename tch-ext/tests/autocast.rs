//! Autocast with a dtype, on CPU.

use tch::{Device, Kind, Tensor};
use tch_ext::{
    autocast, autocast_dtype, is_autocast_cache_enabled, is_autocast_enabled,
    set_autocast_cache_enabled, with_autocast, AutocastDevice, TchExtError,
};

const CPU: AutocastDevice = AutocastDevice::Cpu;

fn sample(shape: [i64; 2], seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn(shape, (Kind::Float, Device::Cpu))
}

#[test]
fn matmul_runs_in_bf16_inside_and_f32_outside() {
    let (a, b) = (sample([4, 8], 1), sample([8, 3], 2));
    assert!(!is_autocast_enabled(CPU));
    {
        let _guard = autocast(CPU, Kind::BFloat16).unwrap();
        assert!(is_autocast_enabled(CPU));
        assert_eq!(autocast_dtype(CPU), Kind::BFloat16);
        assert_eq!(a.matmul(&b).kind(), Kind::BFloat16);
        // Not eligible for lower precision: stays f32.
        assert_eq!(a.exp().kind(), Kind::Float);
    }
    assert!(!is_autocast_enabled(CPU));
    assert_eq!(a.matmul(&b).kind(), Kind::Float);
}

#[test]
fn autocast_linear_equals_bf16_inputs_multiplied() {
    let (x, w, bias) = (
        sample([5, 16], 3),
        sample([7, 16], 4),
        sample([1, 7], 5).view([7]),
    );
    let expected = x.to_kind(Kind::BFloat16).linear(
        &w.to_kind(Kind::BFloat16),
        Some(&bias.to_kind(Kind::BFloat16)),
    );
    let got = {
        let _guard = autocast(CPU, Kind::BFloat16).unwrap();
        x.linear(&w, Some(&bias))
    };
    assert_eq!(got.kind(), Kind::BFloat16);
    assert_eq!(got.size(), [5, 7]);
    assert!(
        got.equal(&expected),
        "autocast linear differs from bf16 linear"
    );
    // And it is the f32 result up to bf16 rounding.
    let exact = x.linear(&w, Some(&bias));
    let err = (got.to_kind(Kind::Float) - &exact)
        .abs()
        .max()
        .double_value(&[]);
    let scale = exact.abs().max().double_value(&[]);
    assert!(err <= 0.02 * scale, "error {err} for magnitude {scale}");
}

#[test]
fn nested_guards_restore_the_outer_state() {
    let default_dtype = autocast_dtype(CPU);
    let (a, b) = (sample([2, 2], 6), sample([2, 2], 7));
    {
        let _outer = autocast(CPU, Kind::BFloat16).unwrap();
        {
            let _inner = autocast(CPU, Kind::Half).unwrap();
            assert!(is_autocast_enabled(CPU));
            assert_eq!(autocast_dtype(CPU), Kind::Half);
            assert_eq!(a.matmul(&b).kind(), Kind::Half);
        }
        assert!(is_autocast_enabled(CPU));
        assert_eq!(autocast_dtype(CPU), Kind::BFloat16);
        assert_eq!(a.matmul(&b).kind(), Kind::BFloat16);
    }
    assert!(!is_autocast_enabled(CPU));
    assert_eq!(autocast_dtype(CPU), default_dtype);
    assert_eq!(a.matmul(&b).kind(), Kind::Float);
}

#[test]
fn state_is_per_device_type_and_per_thread() {
    let _guard = autocast(CPU, Kind::BFloat16).unwrap();
    assert!(!is_autocast_enabled(AutocastDevice::Cuda));
    let other_thread = std::thread::spawn(|| is_autocast_enabled(CPU))
        .join()
        .unwrap();
    assert!(!other_thread);
}

#[test]
fn cuda_autocast_state_can_be_set_without_a_gpu() {
    {
        let _guard = autocast(AutocastDevice::Cuda, Kind::BFloat16).unwrap();
        assert!(is_autocast_enabled(AutocastDevice::Cuda));
        assert_eq!(autocast_dtype(AutocastDevice::Cuda), Kind::BFloat16);
        assert!(!is_autocast_enabled(CPU));
    }
    assert!(!is_autocast_enabled(AutocastDevice::Cuda));
    assert_eq!(autocast_dtype(AutocastDevice::Cuda), Kind::Half);
}

#[test]
fn only_bf16_and_f16_are_accepted() {
    for kind in [Kind::Float, Kind::Double, Kind::Int64] {
        match autocast(CPU, kind) {
            Err(TchExtError::AutocastDtype(k)) => assert_eq!(k, kind),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(!is_autocast_enabled(CPU));
}

/// `x @ w.T` under autocast for a weight `w` (a leaf that requires grad, whose casts autocast
/// caches), then `w *= 2` in place, as an optimizer step updates it.
fn weight_and_input() -> (Tensor, Tensor) {
    let w = sample([3, 8], 8).set_requires_grad(true);
    (w, sample([4, 8], 9))
}

fn double_in_place(w: &Tensor) {
    tch::no_grad(|| {
        let mut w = w.shallow_clone();
        w *= 2.0;
    });
}

fn assert_doubled(second: &Tensor, first: &Tensor) {
    let (second, first) = (second.to_kind(Kind::Float), first.to_kind(Kind::Float));
    assert!(
        second.allclose(&(&first * 2.0), 1e-6, 1e-6, false),
        "the second region used a stale cast of the weight: {first} then {second}"
    );
}

#[test]
fn a_forgotten_guard_is_closed_with_the_region_around_it_and_the_cache_cleared() {
    let (w, x) = weight_and_input();
    let first = {
        let _outer = autocast(CPU, Kind::BFloat16).unwrap();
        std::mem::forget(autocast(CPU, Kind::Half).unwrap());
        assert_eq!(autocast_dtype(CPU), Kind::Half);
        x.linear::<&Tensor>(&w, None)
    };
    assert!(!is_autocast_enabled(CPU));
    double_in_place(&w);
    let second = {
        let _guard = autocast(CPU, Kind::Half).unwrap();
        x.linear::<&Tensor>(&w, None)
    };
    assert_doubled(&second, &first);
    assert!(!is_autocast_enabled(CPU));
}

#[test]
fn the_cache_is_cleared_between_regions_and_a_disabled_cache_sees_in_place_updates() {
    let (w, x) = weight_and_input();
    let run = || with_autocast(CPU, Kind::BFloat16, || x.linear::<&Tensor>(&w, None)).unwrap();
    let first = run();
    double_in_place(&w);
    assert_doubled(&run(), &first);

    // Within one region the cached cast of `w` is reused, unless the cache is off.
    let _guard = autocast(CPU, Kind::BFloat16).unwrap();
    let before = x.linear::<&Tensor>(&w, None);
    double_in_place(&w);
    assert!(
        x.linear::<&Tensor>(&w, None).equal(&before),
        "the cast was not cached"
    );
    set_autocast_cache_enabled(false);
    assert_doubled(&x.linear::<&Tensor>(&w, None), &before);
}

#[test]
fn guards_dropped_out_of_order_leave_autocast_disabled() {
    let default_dtype = autocast_dtype(CPU);
    let outer = autocast(CPU, Kind::BFloat16).unwrap();
    let inner = autocast(CPU, Kind::Half).unwrap();
    let cuda = autocast(AutocastDevice::Cuda, Kind::BFloat16).unwrap();
    drop(outer);
    assert!(!is_autocast_enabled(CPU));
    assert!(!is_autocast_enabled(AutocastDevice::Cuda));
    drop(inner);
    drop(cuda);
    assert!(!is_autocast_enabled(CPU));
    assert_eq!(autocast_dtype(CPU), default_dtype);
    assert!(!is_autocast_enabled(AutocastDevice::Cuda));
    assert_eq!(autocast_dtype(AutocastDevice::Cuda), Kind::Half);
    // And a new region works as usual.
    let (a, b) = (sample([2, 2], 10), sample([2, 2], 11));
    let product = with_autocast(CPU, Kind::BFloat16, || a.matmul(&b)).unwrap();
    assert_eq!(product.kind(), Kind::BFloat16);
    assert_eq!(a.matmul(&b).kind(), Kind::Float);
}

#[test]
fn a_guard_restores_the_cache_setting_it_found() {
    assert!(is_autocast_cache_enabled());
    {
        let _guard = autocast(CPU, Kind::BFloat16).unwrap();
        set_autocast_cache_enabled(false);
        assert!(!is_autocast_cache_enabled());
    }
    assert!(is_autocast_cache_enabled());
    set_autocast_cache_enabled(false);
    {
        let _guard = autocast(CPU, Kind::BFloat16).unwrap();
        set_autocast_cache_enabled(true);
    }
    assert!(!is_autocast_cache_enabled());
    set_autocast_cache_enabled(true);
}

#[test]
fn with_autocast_closes_its_region_on_return_and_on_panic() {
    let (a, b) = (sample([2, 2], 12), sample([2, 2], 13));
    let kind = with_autocast(CPU, Kind::Half, || a.matmul(&b).kind()).unwrap();
    assert_eq!(kind, Kind::Half);
    assert!(!is_autocast_enabled(CPU));
    let panicked = std::panic::catch_unwind(|| {
        let _ = with_autocast(CPU, Kind::Half, || panic!("inside the region on purpose"));
    });
    assert!(panicked.is_err());
    assert!(!is_autocast_enabled(CPU));
    assert!(matches!(
        with_autocast(CPU, Kind::Float, || unreachable!("not run")),
        Err(TchExtError::AutocastDtype(Kind::Float))
    ));
}
