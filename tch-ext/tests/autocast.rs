//! Autocast with a dtype, on CPU.

use tch::{Device, Kind, Tensor};
use tch_ext::{autocast, autocast_dtype, is_autocast_enabled, AutocastDevice, TchExtError};

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
