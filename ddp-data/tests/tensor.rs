//! The tch edge: batches become `[B, 3, H, W]` and `[B, 8]` f32 tensors with the host values.
#![cfg(feature = "tch")]

use std::sync::Arc;

use ddp_data::synthetic::{generate, SyntheticConfig};
use ddp_data::{HostLoader, Loader, LoaderConfig, OdirDataset, OdirOptions, Transform};
use tch::Kind;

#[test]
fn loader_yields_tensors_equal_to_the_host_batches() {
    let dir = tempfile::tempdir().unwrap();
    generate(
        dir.path(),
        &SyntheticConfig {
            images: 7,
            size: 48,
            seed: 1,
            quality: 90,
        },
    )
    .unwrap();
    let ds = Arc::new(OdirDataset::open(dir.path(), &OdirOptions::default()).unwrap());
    let config = LoaderConfig {
        workers: 2,
        seed: 4,
        ..LoaderConfig::new(3)
    };
    let indices = vec![6, 0, 5, 1, 4, 2, 3];
    let t = Transform::train(20).with_hflip(true);
    let host: Vec<_> = HostLoader::new(ds.clone(), indices.clone(), t, &config)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let tensors: Vec<_> = Loader::new(ds, indices, t, &config)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(tensors.len(), 3);
    for (h, b) in host.iter().zip(&tensors) {
        let n = h.len() as i64;
        assert_eq!(b.images.size(), [n, 3, 20, 20]);
        assert_eq!(b.labels.size(), [n, 8]);
        assert_eq!(b.images.kind(), Kind::Float);
        assert_eq!(b.indices, h.indices);
        let images: Vec<f32> = Vec::try_from(b.images.flatten(0, -1)).unwrap();
        let labels: Vec<f32> = Vec::try_from(b.labels.flatten(0, -1)).unwrap();
        assert_eq!(images, h.images);
        assert_eq!(labels, h.labels);
    }
    assert_eq!(tensors[2].images.size()[0], 1);
}
