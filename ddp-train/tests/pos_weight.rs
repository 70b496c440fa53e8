//! `--pos-weight auto` on the built-in synthetic sample: per class, the training split's
//! negatives over its positives, the same as counting them here, and recorded with the
//! task's settings (`config.json`); and the loss it weights, against BCE's definition.

use clap::Parser;
use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_data::odir::{split_by_patient, OdirDataset, OdirOptions};
use ddp_data::{Loader, LoaderConfig};
use ddp_train::odir::{OdirTask, TrainConfig};
use ddp_train::Task;
use tch::{nn, Device, Kind, Tensor};

#[test]
fn auto_pos_weight_is_negatives_over_positives_of_the_training_split() {
    let tmp = ddp_testkit::temp_dir("ddp-train-pos-weight");
    let data = tmp.path().join("data");
    generate(
        &data,
        &SyntheticConfig {
            images: 120,
            size: 32,
            seed: 4,
            ..Default::default()
        },
    )
    .unwrap();
    let dir = data.to_str().unwrap();
    let config =
        TrainConfig::try_parse_from(["ddp-train", "--data", dir, "--pos-weight", "auto"]).unwrap();
    let task = OdirTask::new(&config).unwrap();
    let got = task.pos_weight().unwrap().to_vec();

    let set = OdirDataset::open(&data, &OdirOptions::default()).unwrap();
    let split = split_by_patient(&set, config.val_split, config.settings().seed).unwrap();
    let mut want = Vec::new();
    for class in 0..8 {
        let positives = split
            .train
            .iter()
            .filter(|&&i| set.samples()[i].labels[class] > 0.5)
            .count();
        let negatives = split.train.len() - positives;
        assert!(positives > 0, "class {class} has no positive sample");
        want.push(negatives as f64 / positives as f64);
    }
    assert_eq!(got, want);
    assert!(
        want.iter().any(|&w| w != want[0]),
        "classes differ: {want:?}"
    );
    let described = task.describe();
    assert_eq!(described["pos_weight"], "auto");
    assert_eq!(described["pos_weight_values"], serde_json::json!(want));

    let given = TrainConfig::try_parse_from([
        "ddp-train",
        "--data",
        dir,
        "--pos-weight",
        "1,2,3,4,5,6,7,8",
    ])
    .unwrap();
    let task = OdirTask::new(&given).unwrap();
    assert_eq!(task.pos_weight().unwrap(), [1., 2., 3., 4., 5., 6., 7., 8.]);
    weighted_loss_is_bce_with_those_weights(&task);
    let bad = TrainConfig::try_parse_from(["ddp-train", "--data", dir, "--pos-weight", "1,2"]);
    let e = bad.unwrap_err().to_string();
    assert!(e.contains("has 2 weights"), "{e}");
}

/// The task's evaluation loss of one batch (each sample's mean over its classes, summed) is
/// `-(w·y·log σ(x) + (1-y)·log(1-σ(x)))` with the task's weights `w`, the same on every call
/// (the weights are copied to the device once and reused).
fn weighted_loss_is_bce_with_those_weights(task: &OdirTask) {
    let vs = nn::VarStore::new(Device::Cpu);
    let model = task.model(&vs.root());
    let config = LoaderConfig {
        drop_last: false,
        workers: 1,
        ..LoaderConfig::new(8)
    };
    let mut loader =
        Loader::on_device(task.train_data(), (0..8).collect(), &config, Device::Cpu).unwrap();
    let batch = loader.next().unwrap().unwrap();
    let x = tch::no_grad(|| model.forward_t(batch.inputs(), false)).to_kind(Kind::Double);
    let y = batch.targets().to_kind(Kind::Double);
    let w = Tensor::from_slice(task.pos_weight().unwrap()).view([1, 8]);
    let positive: Tensor = &w * &y * x.log_sigmoid();
    let negative: Tensor = (1.0 - &y) * (-&x).log_sigmoid();
    let want = -(positive + negative).sum(Kind::Double).double_value(&[]) / 8.0;
    assert!(
        y.sum(Kind::Double).double_value(&[]) > 0.0,
        "the batch has positives"
    );
    for call in 0..2 {
        let mut stats = task.new_stats();
        let got = tch::no_grad(|| task.eval_batch(&model, &batch, &mut stats)).double_value(&[]);
        assert!(
            (got - want).abs() < 1e-4 * want.abs(),
            "call {call}: {got} against {want}"
        );
    }
}
