//! Inputs and targets of other kinds than `f32`, owned samples and variable-length inputs
//! padded per batch, through the host loader and the tch loader.
#![cfg(feature = "tch")]

use ddp_data::rng::SampleRng;
use ddp_data::{
    Array, DataError, HostLoader, Item, Loader, LoaderConfig, MapDataset, PadTo, Padding,
    SampleLayout, TensorDataset, ValueKind,
};
use tch::{Device, Kind, Tensor};

/// Sample i: `i % 4 + 1` token ids `100 * i + k`, class `i % 3`; or, when `broken`, samples
/// that break the layout in the way `broken` names.
struct Tokens {
    len: usize,
    broken: Option<&'static str>,
}

impl MapDataset for Tokens {
    fn len(&self) -> usize {
        self.len
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([4], [])
            .input_kind(ValueKind::I64)
            .target_kind(ValueKind::I64)
            .padded(Padding {
                value: -7.0,
                to: PadTo::Longest,
            })
    }

    fn get(&self, i: usize, _: &mut SampleRng) -> Result<Item, DataError> {
        let tokens: Vec<i64> = (0..i % 4 + 1).map(|k| (100 * i + k) as i64).collect();
        Ok(match self.broken {
            Some("too long") => Item::new(vec![1i64; 5], 0i64),
            Some("float targets") => Item::new(tokens, 0.5f32),
            Some("two targets") => Item::new(tokens, vec![0i64, 1]),
            _ => Item::new(tokens, (i % 3) as i64),
        })
    }

    fn describe(&self, i: usize) -> String {
        format!("text #{i}")
    }
}

fn tokens(broken: Option<&'static str>) -> Tokens {
    Tokens { len: 9, broken }
}

#[test]
fn owned_samples_pad_to_the_longest_of_the_batch_with_lengths_and_mask() {
    let config = LoaderConfig {
        workers: 3,
        ..LoaderConfig::new(3)
    };
    let batches: Vec<_> = Loader::new(tokens(None), vec![4, 1, 8, 2], &config)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let first = &batches[0];
    // Lengths 1, 2, 1: padded to 2 (the longest), not to the maximum 4.
    assert_eq!(first.inputs().size(), [3, 2]);
    assert_eq!(first.inputs().kind(), Kind::Int64);
    let ids: Vec<i64> = Vec::try_from(first.inputs().contiguous().view([-1])).unwrap();
    assert_eq!(ids, [400, -7, 100, 101, 800, -7]);
    let lengths: Vec<i64> = Vec::try_from(first.lengths().unwrap()).unwrap();
    assert_eq!(lengths, [1, 2, 1]);
    let mask: Vec<bool> = Vec::try_from(first.mask().unwrap().view([-1])).unwrap();
    assert_eq!(mask, [true, false, true, true, true, false]);
    assert_eq!(first.targets().size(), [3]);
    assert_eq!(first.targets().kind(), Kind::Int64);
    let classes: Vec<i64> = Vec::try_from(first.targets()).unwrap();
    assert_eq!(classes, [1, 1, 2]);
    // The last batch: sample 2 alone, length 3.
    assert_eq!(batches[1].inputs().size(), [1, 3]);
}

#[test]
fn samples_that_break_the_layout_are_errors_naming_the_sample() {
    let config = LoaderConfig::new(2);
    let first_error = |broken| {
        HostLoader::new(tokens(Some(broken)), vec![3, 5], &config)
            .unwrap()
            .find_map(Result::err)
            .unwrap()
    };
    match first_error("too long") {
        DataError::SampleShape {
            sample, found: 5, ..
        } => assert_eq!(sample, "text #3"),
        other => panic!("expected a shape error, got {other}"),
    }
    match first_error("float targets") {
        DataError::SampleKind {
            sample,
            what: "targets",
            expected,
            found,
        } => assert_eq!(
            (sample.as_str(), expected.as_str(), found.as_str()),
            ("text #3", "i64", "f32")
        ),
        other => panic!("expected a kind error, got {other}"),
    }
    assert!(matches!(
        first_error("two targets"),
        DataError::SampleShape {
            what: "targets",
            found: 2,
            ..
        }
    ));
}

#[test]
fn tensors_in_memory_come_back_as_batches_of_their_kind_and_shape() {
    let x = Tensor::arange(24, (Kind::Float, Device::Cpu)).view([6, 2, 2]);
    let y = Tensor::from_slice(&[0i64, 1, 2, 0, 1, 2]);
    let set = TensorDataset::from_tensors(&x, &y).unwrap();
    let batch = Loader::new(set, vec![5, 0], &LoaderConfig::new(2))
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    assert_eq!(batch.inputs().size(), [2, 2, 2]);
    assert_eq!(
        batch.inputs().view([-1]),
        Tensor::from_slice(&[20f32, 21.0, 22.0, 23.0, 0.0, 1.0, 2.0, 3.0])
    );
    assert_eq!(batch.targets(), &Tensor::from_slice(&[2i64, 0]));
    assert!(batch.lengths().is_none() && batch.mask().is_none());
}

#[test]
fn fixed_padding_keeps_the_maximum_length() {
    let set = TensorDataset::sequences(
        vec![vec![1i64, 2], vec![3]],
        Array::from(vec![0i64, 1]),
        Padding {
            value: 0.0,
            to: PadTo::Fixed,
        },
    )
    .unwrap()
    .max_len(5)
    .unwrap();
    let batch = Loader::new(set, vec![0, 1], &LoaderConfig::new(2))
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    assert_eq!(batch.inputs().size(), [2, 5]);
    let lengths: Vec<i64> = Vec::try_from(batch.lengths().unwrap()).unwrap();
    assert_eq!(lengths, [2, 1]);
}
