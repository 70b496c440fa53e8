//! `--pos-weight auto` on the built-in synthetic sample: per class, the training split's
//! negatives over its positives, the same as counting them here, and recorded with the
//! task's settings (`config.json`).

use clap::Parser;
use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_data::odir::{split_by_patient, OdirDataset, OdirOptions};
use ddp_train::odir::{OdirTask, TrainConfig};
use ddp_train::Task;

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
    let bad = TrainConfig::try_parse_from(["ddp-train", "--data", dir, "--pos-weight", "1,2"]);
    let e = bad.unwrap_err().to_string();
    assert!(e.contains("has 2 weights"), "{e}");
}
