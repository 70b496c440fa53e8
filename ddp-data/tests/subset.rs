//! `Subset`: sample `i` is sample `indices[i]` of the wrapped data set, through the loader.

use ddp_data::rng::SampleRng;
use ddp_data::{DataError, Dataset, HostLoader, LoaderConfig, SampleLayout, Subset};
use ddp_data::{Input, SampleOut};

/// Sample `i` is the input `[i, i + 0.5]` with targets `[i * 10, the sample's first draw]`.
#[derive(Debug, Clone)]
struct Numbered {
    len: usize,
}

impl Dataset for Numbered {
    type Worker = ();

    fn len(&self) -> usize {
        self.len
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout::new([2], [2])
    }

    fn worker(&self) {}

    fn write(
        &self,
        _: &mut (),
        index: usize,
        rng: &mut SampleRng,
        out: SampleOut<'_>,
    ) -> Result<(), DataError> {
        let Input::F32(input) = out.input else {
            panic!("the loader asked for bytes, but the layout has none");
        };
        input.copy_from_slice(&[index as f32, index as f32 + 0.5]);
        let targets = out.targets.f32()?;
        targets[0] = index as f32 * 10.0;
        targets[1] = rng.below(1000) as f32;
        Ok(())
    }

    fn describe(&self, index: usize) -> String {
        format!("numbered item {index}")
    }
}

fn config(batch_size: usize) -> LoaderConfig {
    LoaderConfig {
        workers: 2,
        seed: 11,
        epoch: 3,
        ..LoaderConfig::new(batch_size)
    }
}

#[test]
fn loader_reads_the_chosen_samples_in_the_subset_order() {
    let subset = Subset::new(Numbered { len: 10 }, vec![7, 2, 9, 2, 0]).unwrap();
    assert_eq!(subset.len(), 5);
    assert_eq!(subset.layout(), Numbered { len: 10 }.layout());
    // Positions 4, 1, 3 of the subset are samples 0, 2 and 2 of the data set.
    let batches: Vec<_> = HostLoader::new(subset, vec![4, 1, 3, 0], &config(3))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(batches.len(), 2);
    assert_eq!(batches[0].indices(), [4, 1, 3]);
    assert_eq!(
        batches[0].input_f32().unwrap(),
        [0.0, 0.5, 2.0, 2.5, 2.0, 2.5]
    );
    let tens: Vec<f32> = batches[0]
        .targets_f32()
        .unwrap()
        .iter()
        .step_by(2)
        .copied()
        .collect();
    assert_eq!(tens, [0.0, 20.0, 20.0]);
    assert_eq!(batches[1].indices(), [0]);
    assert_eq!(batches[1].input_f32().unwrap(), [7.0, 7.5]);
    assert_eq!(batches[1].targets_f32().unwrap()[0], 70.0);
}

#[test]
fn random_draws_follow_the_position_in_the_subset() {
    let draw = |seed_index: u64| SampleRng::new(11, 3, seed_index).below(1000) as f32;
    let subset = Subset::new(Numbered { len: 10 }, vec![5, 5]).unwrap();
    let batch = HostLoader::new(subset, vec![0, 1], &config(2))
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    // Both are sample 5, drawn as positions 0 and 1.
    assert_eq!(batch.input_f32().unwrap(), [5.0, 5.5, 5.0, 5.5]);
    assert_eq!(batch.targets_f32().unwrap(), [50.0, draw(0), 50.0, draw(1)]);
}

#[test]
fn an_index_past_the_end_is_named_with_the_length() {
    let err = Subset::new(Numbered { len: 4 }, vec![0, 3, 4, 9]).unwrap_err();
    assert!(
        matches!(err, DataError::IndexOutOfRange { index: 4, len: 4 }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "sample index 4 is out of range for a data set of 4 samples"
    );
    let empty = Subset::new(Numbered { len: 0 }, vec![]).unwrap();
    assert!(empty.is_empty());
}

#[test]
fn names_clones_and_parts_are_the_data_sets() {
    let subset = Subset::new(Numbered { len: 6 }, vec![5, 1]).unwrap();
    assert_eq!(subset.describe(0), "numbered item 5");
    assert_eq!(subset.describe(1), "numbered item 1");
    assert_eq!(subset.describe(2), "sample 2");
    let copy = subset.clone();
    assert_eq!(copy.indices(), [5, 1]);
    assert_eq!(copy.dataset().len, 6);
    let (dataset, indices) = subset.into_parts();
    assert_eq!((dataset.len, indices), (6, vec![5, 1]));
    assert!(format!("{copy:?}").contains("indices: [5, 1]"));
}
