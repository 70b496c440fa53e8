//! Checkpoint files from outside: arbitrary bytes, and real checkpoints with bytes changed or
//! cut off, give an error (or, where the damage misses everything checked, a load that fits
//! the model), never a panic or an allocation beyond the file's size.

use std::collections::HashMap;

use ddp_model::checkpoint;
use proptest::prelude::*;
use tch::{nn, Device, Kind};

/// A small model of two layers (a convolution with batch norm, and a linear layer).
fn model() -> nn::VarStore {
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let _ = nn::conv2d(&root / "conv", 3, 4, 3, Default::default());
    let _ = nn::batch_norm2d(&root / "bn", 4, Default::default());
    let _ = nn::linear(&root / "fc", 4, 2, Default::default());
    vs
}

/// The bytes of a checkpoint of [`model`], with metadata.
fn checkpoint_bytes() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| {
        let dir = ddp_testkit::temp_dir("ddp-model-fuzz-source");
        let path = dir.path().join("m.safetensors");
        let meta = HashMap::from([("epoch".to_string(), "3".to_string())]);
        checkpoint::save(&model(), &path, &meta).unwrap();
        std::fs::read(&path).unwrap()
    })
}

/// Reads and loads `bytes` as a checkpoint of [`model`]; when the load succeeds, every
/// tensor must still have the model's shape and kind.
fn read_and_load(bytes: &[u8]) {
    let dir = ddp_testkit::temp_dir("ddp-model-fuzz");
    let path = dir.path().join("m.safetensors");
    std::fs::write(&path, bytes).unwrap();
    let _ = checkpoint::read_tensors(&path);
    let vs = model();
    let before: Vec<(String, Vec<i64>, Kind)> = checkpoint::named_tensors(&vs)
        .into_iter()
        .map(|(n, t)| (n, t.size(), t.kind()))
        .collect();
    if checkpoint::load(&vs, &path).is_ok() {
        let after: Vec<(String, Vec<i64>, Kind)> = checkpoint::named_tensors(&vs)
            .into_iter()
            .map(|(n, t)| (n, t.size(), t.kind()))
            .collect();
        assert_eq!(before, after);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_are_an_error(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let dir = ddp_testkit::temp_dir("ddp-model-fuzz-any");
        let path = dir.path().join("m.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        prop_assert!(checkpoint::read_tensors(&path).is_err());
        prop_assert!(checkpoint::load(&model(), &path).is_err());
    }

    #[test]
    fn a_header_length_beyond_the_file_is_an_error(len in any::<u64>(), rest in proptest::collection::vec(any::<u8>(), 0..64)) {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend(&rest);
        prop_assume!(len as usize > rest.len());
        let dir = ddp_testkit::temp_dir("ddp-model-fuzz-len");
        let path = dir.path().join("m.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        prop_assert!(checkpoint::read_tensors(&path).is_err());
    }

    #[test]
    fn a_damaged_checkpoint_never_panics(
        changes in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in proptest::option::of(any::<prop::sample::Index>()),
    ) {
        let mut bytes = checkpoint_bytes().to_vec();
        for (at, value) in changes {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        read_and_load(&bytes);
    }

    #[test]
    fn a_damaged_header_never_panics(
        changes in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        // Changes inside the JSON header, where names, dtypes, shapes and offsets live.
        let mut bytes = checkpoint_bytes().to_vec();
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, value) in changes {
            bytes[8 + at.index(header)] = value;
        }
        read_and_load(&bytes);
    }
}

#[test]
fn the_undamaged_checkpoint_loads() {
    let dir = ddp_testkit::temp_dir("ddp-model-fuzz-clean");
    let path = dir.path().join("m.safetensors");
    std::fs::write(&path, checkpoint_bytes()).unwrap();
    let vs = model();
    assert_eq!(checkpoint::load(&vs, &path).unwrap()["epoch"], "3");
}
