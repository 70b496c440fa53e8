//! Checkpoint round trips and every way a checkpoint can fail to fit.

use std::collections::HashMap;

use ddp_model::checkpoint::{self, CheckpointError, TensorProblem};
use ddp_model::{ConvNet, ConvNetConfig};
use tch::{nn, Device, Kind, Tensor};

fn model(config: ConvNetConfig, seed: i64) -> (nn::VarStore, ConvNet) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = ConvNet::new(&vs.root(), config);
    (vs, net)
}

fn snapshot(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    checkpoint::named_tensors(vs)
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect()
}

#[test]
fn round_trip_restores_every_tensor_and_metadata() {
    let tmp = ddp_testkit::temp_dir("ddp-model-roundtrip");
    let dir = tmp.path();
    let (vs, net) = model(ConvNetConfig::default(), 1);
    // Non-trivial running statistics and batch counters.
    let _ = net.forward_t(
        &(Tensor::rand([3, 3, 32, 32], (Kind::Float, Device::Cpu)) * 2.0),
        true,
    );
    let meta = HashMap::from([("epoch".to_owned(), "7".to_owned())]);
    let path = dir.join("m.safetensors");
    checkpoint::save(&vs, &path, &meta).unwrap();

    let (vs2, _) = model(ConvNetConfig::default(), 2);
    let got_meta = checkpoint::load(&vs2, &path).unwrap();
    assert_eq!(got_meta, meta);
    for ((n1, t1), (n2, t2)) in snapshot(&vs).iter().zip(snapshot(&vs2).iter()) {
        assert_eq!(n1, n2);
        assert!(t1.equal(t2), "{n1} differs after the round trip");
    }
    assert_eq!(
        vs2.variables()["features.5.num_batches_tracked"].int64_value(&[]),
        1
    );
    // The temporary file of the atomic write is gone.
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("m.safetensors")]);
}

#[test]
fn tensors_read_once_load_without_the_file_and_errors_name_where_they_came_from() {
    let tmp = ddp_testkit::temp_dir("ddp-model-read-once");
    let path = tmp.path().join("m.safetensors");
    let (vs, _) = model(ConvNetConfig::default(), 10);
    checkpoint::save(&vs, &path, &HashMap::new()).unwrap();
    let file = checkpoint::read_tensors(&path).unwrap();
    assert_eq!(file.path, path);
    // Loading takes what was read: the file can be gone by then.
    std::fs::remove_file(&path).unwrap();
    let (restored, _) = model(ConvNetConfig::default(), 11);
    checkpoint::load_tensors(&restored, &file).unwrap();
    for ((name, a), (_, b)) in snapshot(&vs).iter().zip(snapshot(&restored).iter()) {
        assert!(a.equal(b), "{name} differs after loading the tensors read");
    }
    let (other, _) = model(
        ConvNetConfig {
            num_classes: 2,
            dropout: 0.5,
        },
        12,
    );
    match checkpoint::load_tensors(&other, &file).unwrap_err() {
        CheckpointError::Mismatch { path: named, .. } => assert_eq!(named, path),
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn another_models_checkpoint_names_tensor_and_shapes_and_loads_nothing() {
    let tmp = ddp_testkit::temp_dir("ddp-model-mismatch");
    let dir = tmp.path();
    let (other, _) = model(
        ConvNetConfig {
            num_classes: 2,
            dropout: 0.5,
        },
        3,
    );
    let path = dir.join("two-classes.safetensors");
    checkpoint::save(&other, &path, &HashMap::new()).unwrap();

    let (vs, _) = model(ConvNetConfig::default(), 4);
    let before = snapshot(&vs);
    let err = checkpoint::load(&vs, &path).unwrap_err();
    match &err {
        CheckpointError::Mismatch { problems, .. } => assert_eq!(
            problems,
            &vec![
                TensorProblem::Shape {
                    name: "classifier.3.bias".into(),
                    expected: vec![8],
                    found: vec![2]
                },
                TensorProblem::Shape {
                    name: "classifier.3.weight".into(),
                    expected: vec![8, 256],
                    found: vec![2, 256]
                },
            ]
        ),
        other => panic!("expected a mismatch, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("'classifier.3.weight' has shape [2, 256] in the checkpoint but [8, 256]"),
        "{msg}"
    );
    // Nothing was half-loaded: even the tensors that did fit are unchanged.
    for ((name, a), (_, b)) in before.iter().zip(snapshot(&vs).iter()) {
        assert!(a.equal(b), "{name} changed although the load failed");
    }
}

#[test]
fn missing_unexpected_and_dtype_problems_are_all_reported() {
    let tmp = ddp_testkit::temp_dir("ddp-model-problems");
    let dir = tmp.path();
    let (vs, _) = model(ConvNetConfig::default(), 5);
    let mut tensors = checkpoint::named_tensors(&vs);
    tensors.retain(|(n, _)| n != "features.0.weight");
    for (n, t) in tensors.iter_mut() {
        if n == "features.1.num_batches_tracked" {
            *t = t.to_kind(Kind::Float);
        }
    }
    tensors.push((
        "module.extra".into(),
        Tensor::zeros([1], (Kind::Float, Device::Cpu)),
    ));
    let path = dir.join("bad.safetensors");
    checkpoint::write_tensors(tensors, &HashMap::new(), &path).unwrap();
    match checkpoint::load(&vs, &path).unwrap_err() {
        CheckpointError::Mismatch { problems, .. } => assert_eq!(
            problems,
            vec![
                TensorProblem::Missing("features.0.weight".into()),
                TensorProblem::Dtype {
                    name: "features.1.num_batches_tracked".into(),
                    expected: Kind::Int64,
                    found: Kind::Float
                },
                TensorProblem::Unexpected("module.extra".into()),
            ]
        ),
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn corrupt_and_absent_files_are_errors_naming_the_file() {
    let tmp = ddp_testkit::temp_dir("ddp-model-corrupt");
    let dir = tmp.path();
    let (vs, _) = model(ConvNetConfig::default(), 6);
    let path = dir.join("m.safetensors");
    checkpoint::save(&vs, &path, &HashMap::new()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let err = checkpoint::load(&vs, &truncated).unwrap_err();
    assert!(matches!(err, CheckpointError::Format { .. }), "{err:?}");
    assert!(err.to_string().contains("truncated.safetensors"), "{err}");

    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a checkpoint at all").unwrap();
    assert!(matches!(
        checkpoint::load(&vs, &garbage),
        Err(CheckpointError::Format { .. })
    ));

    let absent = dir.join("absent.safetensors");
    let err = checkpoint::load(&vs, &absent).unwrap_err();
    assert!(matches!(err, CheckpointError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("absent.safetensors"), "{err}");
}

#[test]
fn overwriting_keeps_a_complete_file() {
    let tmp = ddp_testkit::temp_dir("ddp-model-overwrite");
    let dir = tmp.path();
    let path = dir.join("m.safetensors");
    let (a, _) = model(ConvNetConfig::default(), 7);
    let (b, _) = model(ConvNetConfig::default(), 8);
    checkpoint::save(&a, &path, &HashMap::new()).unwrap();
    checkpoint::save(&b, &path, &HashMap::new()).unwrap();
    let (c, _) = model(ConvNetConfig::default(), 9);
    checkpoint::load(&c, &path).unwrap();
    let w = |vs: &nn::VarStore| vs.variables()["features.0.weight"].copy();
    assert!(w(&c).equal(&w(&b)));
    assert!(!w(&c).equal(&w(&a)));
}
