//! `ddp-train predict` and `evaluate` as real ranks on loopback: the submission file in the
//! challenge's format, byte-identical on 1 and 2 ranks; a patient with one eye predicted
//! from it with a warning; an undecodable image stopping every rank with its name; a model
//! read from a PyTorch training checkpoint by `--checkpoint-key`.

mod common;

use common::{run_ddp_train, text, Limits};

use std::path::{Path, PathBuf};
use std::process::Output;

use ddp_data::odir::synthetic::{generate, SyntheticConfig};
use ddp_model::{checkpoint, ConvNet, ConvNetConfig};
use serde_json::Value;
use tch::{nn, Device};

/// A synthetic sample with an 11-image test split (patients 12..18; 17 has a left eye only)
/// and a model file of a freshly initialised ConvNet.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let data = dir.join("data");
    generate(
        &data,
        &SyntheticConfig {
            images: 24,
            size: 48,
            seed: 9,
            test_images: 11,
            ..Default::default()
        },
    )
    .unwrap();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = ConvNet::new(&vs.root(), ConvNetConfig::default());
    let model = dir.join("model.safetensors");
    checkpoint::save(&vs, &model, &Default::default()).unwrap();
    (data, model)
}

/// `world` ranks of `ddp-train <args>`, each rank's output.
fn run_ranks(world: usize, args: &[&str]) -> Vec<Output> {
    run_ddp_train(world, args, &[], Limits::SHORT)
}

fn predict(world: usize, images: &Path, model: &Path, out: &Path) -> Vec<Output> {
    scoring("predict", world, images, model, out, &[])
}

fn evaluate(world: usize, data: &Path, model: &Path, out: &Path, extra: &[&str]) -> Vec<Output> {
    scoring("evaluate", world, data, model, out, extra)
}

/// `world` ranks of `ddp-train <command>` (`predict` or `evaluate`) of `model` on the folder
/// `data`, with `extra` flags.
fn scoring(
    command: &str,
    world: usize,
    data: &Path,
    model: &Path,
    out: &Path,
    extra: &[&str],
) -> Vec<Output> {
    let mut args = vec![
        command,
        "--checkpoint",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--image-size",
        "32",
        // 11 images in batches of 4: rank 0 gets batches 0 and 2, rank 1 batch 1.
        "--batch-size",
        "4",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend(extra);
    run_ranks(world, &args)
}

fn floats(fields: &[&str]) -> Vec<f64> {
    fields.iter().map(|f| f.parse::<f64>().unwrap()).collect()
}

#[test]
fn predict_writes_the_same_submission_on_1_and_2_ranks_in_the_challenges_format() {
    let tmp = common::temp_dir("ddp-train-predict");
    let dir = tmp.path();
    let (data, model) = setup(dir);
    let images = data.join("test/preprocessed_images");
    let mut runs = Vec::new();
    for world in [1, 2] {
        let out = dir.join(format!("run{world}"));
        let outputs = predict(world, &images, &model, &out);
        for (r, o) in outputs.iter().enumerate() {
            assert!(o.status.success(), "rank {r} of {world}:\n{}", text(o));
        }
        let all = text(&outputs[0]);
        assert!(
            all.contains("patient 17 has one image only (17_left.jpg)"),
            "no warning for the one-eyed patient:\n{all}"
        );
        assert!(
            all.contains("predict: 11 images of 6 patients (1 from one eye)"),
            "{all}"
        );
        // Every rank knows it; rank 0 alone says it.
        for o in &outputs[1..] {
            assert!(!text(o).contains("has one image only"), "{}", text(o));
        }
        runs.push(out);
    }
    for file in ["submission.csv", "predictions.csv", "decisions.csv"] {
        let one = std::fs::read(runs[0].join(file)).unwrap();
        let two = std::fs::read(runs[1].join(file)).unwrap();
        assert!(one == two, "{file} differs between 1 and 2 ranks");
    }
    let submission = std::fs::read_to_string(runs[0].join("submission.csv")).unwrap();
    let lines: Vec<&str> = submission.lines().collect();
    assert_eq!(lines[0], "ID,N,D,G,C,A,H,M,O");
    let ids: Vec<&str> = lines[1..]
        .iter()
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(ids, ["12", "13", "14", "15", "16", "17"]);
    let predictions = std::fs::read_to_string(runs[0].join("predictions.csv")).unwrap();
    let eyes: Vec<Vec<&str>> = predictions
        .lines()
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(eyes[0].join(","), "image,eye,N,D,G,C,A,H,M,O");
    assert_eq!(eyes.len(), 12);
    assert_eq!(eyes[1][..2], ["12_left.jpg", "left"]);
    assert_eq!(eyes[11][..2], ["17_left.jpg", "left"]);
    for (p, line) in lines[1..].iter().enumerate() {
        let fields: Vec<&str> = line.split(',').collect();
        assert_eq!(fields.len(), 9, "{line}");
        let patient = floats(&fields[1..]);
        assert!(patient.iter().all(|v| (0.0..=1.0).contains(v)), "{line}");
        // Eyes combine by each disease's maximum and N's minimum (the default); the one-eyed
        // patient is its left eye.
        let left = floats(&eyes[1 + 2 * p][2..]);
        let expected: Vec<f64> = match eyes.get(2 + 2 * p) {
            Some(right) if p < 5 => {
                let right = floats(&right[2..]);
                let n = left[0].min(right[0]);
                let diseases = left[1..].iter().zip(&right[1..]).map(|(a, b)| a.max(*b));
                std::iter::once(n).chain(diseases).collect()
            }
            _ => left,
        };
        assert_eq!(patient, expected, "patient row {line}");
    }
    // No tuned thresholds beside the model: decisions at 0.5.
    let decisions = std::fs::read_to_string(runs[0].join("decisions.csv")).unwrap();
    assert_eq!(decisions.lines().next(), Some("ID,N,D,G,C,A,H,M,O"));
    assert_eq!(decisions.lines().count(), 7, "{decisions}");
    for (d, s) in decisions.lines().zip(submission.lines()).skip(1) {
        let want: Vec<String> = s
            .split(',')
            .skip(1)
            .map(|v| u8::from(v.parse::<f64>().unwrap() > 0.5).to_string())
            .collect();
        assert_eq!(d.split(',').skip(1).collect::<Vec<_>>(), want);
    }
}

/// Every rank scores rank 0's model, whatever file it read: here `--checkpoint` is a relative
/// path from each rank's own working folder, as a run directory still training resolves to
/// another checkpoint on each rank. The files are those of 1 rank with rank 0's model.
#[test]
fn every_rank_scores_rank_0s_model_whatever_file_it_read() {
    let tmp = common::temp_dir("ddp-train-predict-rank-0s-model");
    let dir = tmp.path();
    let (data, model) = setup(dir);
    let images = data.join("test/preprocessed_images");
    let folders = [dir.join("rank-0"), dir.join("rank-1")];
    for folder in &folders {
        std::fs::create_dir(folder).unwrap();
    }
    std::fs::copy(&model, folders[0].join("model.safetensors")).unwrap();
    tch::manual_seed(6);
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = ConvNet::new(&vs.root(), ConvNetConfig::default());
    checkpoint::save(
        &vs,
        folders[1].join("model.safetensors"),
        &Default::default(),
    )
    .unwrap();

    let alone = dir.join("alone");
    common::assert_all_ok(&predict(1, &images, &model, &alone));
    let both = dir.join("both");
    let port = common::free_port();
    let children = folders
        .iter()
        .enumerate()
        .map(|(rank, folder)| {
            let mut cmd = common::rank_command(env!("CARGO_BIN_EXE_ddp-train"), rank, 2, port);
            cmd.current_dir(folder)
                .args(["predict", "--checkpoint", "model.safetensors", "--data"])
                .arg(&images)
                .args(["--image-size", "32", "--batch-size", "4", "--out"])
                .arg(&both)
                .args([
                    "--threads",
                    "1",
                    "--workers",
                    "1",
                    "--collective-timeout",
                    "30",
                ])
                .env("DDP_RDZV_TIMEOUT_S", "30")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            cmd.spawn().expect("a ddp-train rank starts")
        })
        .collect();
    common::assert_all_ok(&common::wait_all(children, Limits::SHORT.run));
    for file in ["submission.csv", "predictions.csv", "decisions.csv"] {
        let one = std::fs::read(alone.join(file)).unwrap();
        let two = std::fs::read(both.join(file)).unwrap();
        assert!(one == two, "{file} is not that of rank 0's model");
    }
}

#[test]
fn an_undecodable_image_stops_every_rank_naming_it() {
    let tmp = common::temp_dir("ddp-train-predict-corrupt");
    let dir = tmp.path();
    let (data, model) = setup(dir);
    let images = data.join("test/preprocessed_images");
    // Batch 1 (images 4..8) is rank 1's: 14_left, 14_right, 15_left, 15_right.
    std::fs::write(images.join("15_left.jpg"), b"\xff\xd8 not a jpeg").unwrap();
    let out = dir.join("run");
    let outputs = predict(2, &images, &model, &out);
    for (r, o) in outputs.iter().enumerate() {
        assert!(!o.status.success(), "rank {r} succeeded");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("rank 1 could not score its images") && err.contains("15_left.jpg"),
            "rank {r}:\n{err}"
        );
    }
    assert!(!out.join("submission.csv").exists());
}

#[test]
fn evaluate_with_skip_corrupt_names_each_image_it_leaves_out() {
    let tmp = common::temp_dir("ddp-train-evaluate-skip");
    let dir = tmp.path();
    let (data, model) = setup(dir);
    let bad = data.join("test/preprocessed_images/15_left.jpg");
    std::fs::write(&bad, b"\xff\xd8 not a jpeg").unwrap();
    let out = dir.join("eval");
    let outputs = evaluate(2, &data.join("test"), &model, &out, &["--skip-corrupt"]);
    for (r, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}:\n{}", text(o));
    }
    let warning = format!("warning: left out {} (--skip-corrupt): ", bad.display());
    let rank0 = String::from_utf8_lossy(&outputs[0].stderr).into_owned();
    assert_eq!(rank0.matches(&warning).count(), 1, "{rank0}");
    assert!(
        !text(&outputs[1]).contains(&warning),
        "{}",
        text(&outputs[1])
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("evaluation.json")).unwrap())
            .unwrap();
    assert_eq!(report["images"], 10);
    let skipped = report["skipped_images"].as_array().unwrap();
    assert_eq!(skipped.len(), 1, "{report}");
    assert_eq!(skipped[0]["path"], bad.to_str().unwrap());
    assert!(!skipped[0]["reason"].as_str().unwrap().is_empty());
}

/// Every image left out: nothing to score. Refused (as training refuses it), naming the
/// folder, instead of a report of zero images and NaN scores.
#[test]
fn evaluate_with_every_image_skipped_as_corrupt_is_refused() {
    let tmp = common::temp_dir("ddp-train-evaluate-all-corrupt");
    let dir = tmp.path();
    let (data, model) = setup(dir);
    let test = data.join("test");
    let images = test.join("preprocessed_images");
    for entry in std::fs::read_dir(&images).unwrap() {
        std::fs::write(entry.unwrap().path(), b"\xff\xd8 not a jpeg").unwrap();
    }
    let out = dir.join("eval");
    let outputs = evaluate(2, &test, &model, &out, &["--skip-corrupt"]);
    let message = format!(
        "data set '{}' has no usable images (11 skipped as corrupt; the first, {}",
        test.display(),
        images.join("12_left.jpg").display()
    );
    for (r, o) in outputs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "rank {r} succeeded:\n{}", text(o));
        assert!(err.contains(&message), "rank {r}:\n{err}");
    }
    assert!(!out.join("evaluation.json").exists());
}

#[test]
fn evaluate_scores_a_labelled_folder_on_2_ranks_as_on_1() {
    let tmp = common::temp_dir("ddp-train-evaluate");
    let dir = tmp.path();
    let (data, model) = setup(dir);
    let mut reports = Vec::new();
    for world in [1, 2] {
        let out = dir.join(format!("eval{world}"));
        let outputs = evaluate(world, &data.join("test"), &model, &out, &[]);
        for (r, o) in outputs.iter().enumerate() {
            assert!(o.status.success(), "rank {r} of {world}:\n{}", text(o));
        }
        let stdout = String::from_utf8_lossy(&outputs[0].stdout).into_owned();
        assert!(
            stdout.contains(&format!(
                "evaluate: 11 images of 6 patients with {}: challenge score",
                model.display()
            )),
            "{stdout}"
        );
        let written: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("evaluation.json")).unwrap())
                .unwrap();
        let mut printed: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(printed, written);
        let score = written["odir_score"].as_f64().unwrap();
        let mean = ["odir_kappa", "odir_f1", "odir_auc"]
            .iter()
            .map(|k| written[*k].as_f64().unwrap())
            .sum::<f64>()
            / 3.0;
        assert!((score - mean).abs() < 1e-12, "{written}");
        assert_eq!(written["world_size"], world);
        // The file the weights came from; it records no epoch.
        assert_eq!(written["model_file"], model.to_string_lossy().as_ref());
        assert_eq!(written["model_epoch"], Value::Null);
        printed.as_object_mut().unwrap().remove("world_size");
        reports.push(printed);
    }
    assert_eq!(reports[0], reports[1]);

    // The same model inside PyTorch training checkpoints: one with two state_dicts, scored
    // from the entry `--checkpoint-key` names and refused without it, and one with one.
    let (two, one) = (dir.join("two.pth"), dir.join("one.pth"));
    let script = "import sys, torch\n\
                  from safetensors.torch import load_file\n\
                  sd = load_file(sys.argv[1])\n\
                  ema = {k: v * 2 if v.is_floating_point() else v for k, v in sd.items()}\n\
                  torch.save({'model': sd, 'ema': ema, 'epoch': 3}, sys.argv[2])\n\
                  torch.save({'epoch': 3, 'model': sd}, sys.argv[3])\n";
    let made = ddp_testkit::setup_python()
        .args(["-c", script])
        .args([&model, &two, &one])
        .output()
        .expect("python runs");
    let err = String::from_utf8_lossy(&made.stderr);
    assert!(made.status.success(), "{err}");
    let evaluate_pth = |pth: &Path, key: &[&str]| {
        let name = pth.file_stem().unwrap().to_string_lossy();
        let out = dir.join(format!("eval-{name}-{}", key.len()));
        evaluate(1, &data.join("test"), pth, &out, key).remove(0)
    };
    let refused = evaluate_pth(&two, &[]);
    assert!(!refused.status.success(), "{}", text(&refused));
    assert!(
        text(&refused).contains(
            "holds several state_dicts, under 'model' (26 tensors), 'ema' (26 tensors): choose \
             one by its key (--checkpoint-key)"
        ),
        "{}",
        text(&refused)
    );
    for field in ["checkpoint", "model_file"] {
        reports[0].as_object_mut().unwrap().remove(field);
    }
    for scored in [
        evaluate_pth(&two, &["--checkpoint-key", "model"]),
        evaluate_pth(&one, &[]),
    ] {
        assert!(scored.status.success(), "{}", text(&scored));
        let stdout = String::from_utf8_lossy(&scored.stdout).into_owned();
        let mut printed: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(printed["checkpoint_entry"], "model");
        let report = printed.as_object_mut().unwrap();
        for field in ["world_size", "checkpoint_entry", "checkpoint", "model_file"] {
            report.remove(field);
        }
        assert_eq!(printed, reports[0]);
    }
}

/// A model file of another architecture than `--model` says: the error names the one the
/// file holds and the flag to give, and lists only the first differences.
#[test]
fn a_checkpoint_of_another_model_names_it_and_the_flag() {
    let tmp = common::temp_dir("ddp-train-predict-other-model");
    let dir = tmp.path();
    let (data, _) = setup(dir);
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = ddp_model::Model::new(&vs.root(), ddp_model::ModelKind::Resnet18, 8, None);
    let model = dir.join("resnet18.safetensors");
    checkpoint::save(&vs, &model, &Default::default()).unwrap();
    let out = dir.join("run");
    let outputs = predict(1, &data.join("test/preprocessed_images"), &model, &out);
    let err = String::from_utf8_lossy(&outputs[0].stderr).into_owned();
    assert!(!outputs[0].status.success(), "{err}");
    assert!(
        err.contains("; the file holds a resnet18 model: ")
            && err.contains("(give --model resnet18 to score it)"),
        "{err}"
    );
    // The first differences and a count, not all 148 of them.
    assert!(err.len() < 2000, "{} bytes:\n{err}", err.len());
}

/// A model file of a run directory is scored with the transform its run recorded, or with
/// a warning naming each setting that differs and the value to give.
#[test]
fn scoring_with_another_transform_or_eye_combination_than_the_training_warns_on_rank_0() {
    let tmp = common::temp_dir("ddp-train-predict-transform");
    let dir = tmp.path();
    let (data, model) = setup(dir);
    let run = dir.join("trained");
    std::fs::create_dir_all(&run).unwrap();
    let config = r#"{"task": {"image_size": 48, "normalize": "imagenet", "eval_resize": null}}"#;
    std::fs::write(run.join("config.json"), config).unwrap();
    let best = run.join("best-score.safetensors");
    std::fs::copy(&model, &best).unwrap();
    // Thresholds tuned with the eyes' mean, applied to patients combined by max.
    let tuned = run.join("best-score.json");
    let thresholds =
        r#"{"thresholds": [0.5, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.3], "eye_combine": "mean"}"#;
    std::fs::write(&tuned, thresholds).unwrap();
    let outputs = predict(
        2,
        &data.join("test/preprocessed_images"),
        &best,
        &dir.join("out"),
    );
    for (r, o) in outputs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}:\n{}", text(o));
    }
    let rank0 = String::from_utf8_lossy(&outputs[0].stderr).into_owned();
    let config = run.join("config.json");
    for (flag, then, now) in [
        ("--image-size", "48", "32"),
        ("--normalize", "imagenet", "none"),
    ] {
        let warning = format!(
            "warning: the model was trained with {flag} {then} ({}) and is scored with {now}: \
             give {flag} {then} to score it on what it learnt from",
            config.display()
        );
        assert_eq!(rank0.matches(&warning).count(), 1, "{rank0}");
        assert!(
            !text(&outputs[1]).contains(&warning),
            "{}",
            text(&outputs[1])
        );
    }
    assert!(!rank0.contains("--eval-resize"), "{rank0}");

    // Trained with the default resize (8/7 of 32: 36), scored with another; trained with
    // the eyes' mean, which its thresholds were tuned with: one warning names it.
    let run36 = dir.join("trained-36");
    std::fs::create_dir_all(&run36).unwrap();
    let config36 = run36.join("config.json");
    std::fs::write(
        &config36,
        r#"{"task": {"image_size": 32, "normalize": "none", "eval_resize": null,
            "eye_combine": "mean"}}"#,
    )
    .unwrap();
    let best36 = run36.join("best-score.safetensors");
    std::fs::copy(&model, &best36).unwrap();
    std::fs::write(run36.join("best-score.json"), thresholds).unwrap();
    let images = data.join("test/preprocessed_images");
    let resized = scoring(
        "predict",
        1,
        &images,
        &best36,
        &dir.join("out36"),
        &["--eval-resize", "40"],
    );
    assert!(resized[0].status.success(), "{}", text(&resized[0]));
    let warning = format!(
        "warning: the model was trained with --eval-resize 36 ({}) and is scored with 40",
        config36.display()
    );
    assert!(
        text(&resized[0]).contains(&warning),
        "{}",
        text(&resized[0])
    );
    let warning = format!(
        "warning: the model was trained with --eye-combine mean ({}) and is scored with max: \
         give --eye-combine mean",
        config36.display()
    );
    assert_eq!(
        text(&resized[0]).matches(&warning).count(),
        1,
        "{}",
        text(&resized[0])
    );
    assert!(
        !text(&resized[0]).contains("were tuned with"),
        "{}",
        text(&resized[0])
    );

    let warning = format!(
        "warning: the thresholds of {} were tuned with --eye-combine mean, and the eyes are \
         combined with max: give --eye-combine mean",
        tuned.display()
    );
    assert_eq!(rank0.matches(&warning).count(), 1, "{rank0}");
    assert!(!text(&outputs[1]).contains("were tuned with"));
}

/// The thresholds `--tune-thresholds` saves beside each best model are that model's: they
/// record its epoch, a best model saved later without them removes them (a run resumed
/// without the flag left epoch 1's beside a later model, and `predict` used them), and
/// `predict` refuses thresholds of another epoch than the model's.
#[test]
fn thresholds_beside_a_best_model_are_that_models() {
    let tmp = common::temp_dir("ddp-train-predict-tuned");
    let dir = tmp.path();
    let (data, _) = setup(dir);
    let run = dir.join("run");
    let train = |epochs: &str, more: &[&str]| {
        let mut args = vec![
            "--data",
            data.to_str().unwrap(),
            "--image-size",
            "32",
            "--batch-size",
            "4",
            "--seed",
            "1",
            // A rate at which a later epoch's score beats epoch 1's (at the default, none
            // does here: the models of epochs 2 and 3 only tie epoch 1's macro- and micro-F1).
            "--lr",
            "0.003",
            "--epochs",
            epochs,
            "--out",
            run.to_str().unwrap(),
        ];
        args.extend(more);
        let outputs = run_ranks(1, &args);
        assert!(outputs[0].status.success(), "{}", text(&outputs[0]));
    };
    let epoch_of = |model: &Path| -> u64 {
        checkpoint::read_tensors(model).unwrap().metadata["epoch"]
            .parse()
            .unwrap()
    };
    let read_json = |path: &Path| -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let bests = ["best-macro", "best-micro", "best-score"];
    train("1", &["--tune-thresholds"]);
    for best in bests {
        let tuned = read_json(&run.join(format!("{best}.json")));
        assert_eq!(tuned["epoch"], 1, "{best}: {tuned}");
        assert_eq!(tuned["thresholds"].as_array().unwrap().len(), 8);
    }
    // The model without its thresholds (a copy, or a save cut short between the two files):
    // decided at 0.5, with a warning that names where the tuned ones are kept.
    let copied = dir.join("copied.safetensors");
    std::fs::copy(run.join("best-macro.safetensors"), &copied).unwrap();
    let outputs = predict(
        1,
        &data.join("test/preprocessed_images"),
        &copied,
        &dir.join("p"),
    );
    let t = text(&outputs[0]);
    assert!(outputs[0].status.success(), "{t}");
    assert!(
        t.contains(&format!(
            "warning: the model's run tuned thresholds (--tune-thresholds), and none are \
             beside {} ({} is not there), so the patients are decided at 0.5",
            copied.display(),
            dir.join("copied.json").display()
        )) && t.contains("checkpoints/epoch-NNNN.<model>.json"),
        "{t}"
    );
    train("3", &["--resume", "latest"]);
    let mut replaced = 0;
    for best in bests {
        let model = run.join(format!("{best}.safetensors"));
        let beside = model.with_extension("json");
        match epoch_of(&model) {
            1 => assert_eq!(read_json(&beside)["epoch"], 1, "{best}"),
            later => {
                replaced += 1;
                assert!(
                    !beside.exists(),
                    "{best}.json of epoch 1 is left beside the model of epoch {later}"
                );
            }
        }
    }
    assert!(
        replaced > 0,
        "no best model after epoch 1: the test proves nothing"
    );

    // A model beside thresholds of another epoch (an older run's, or copied): refused, naming
    // both epochs and what to do.
    let model = run.join("best-score.safetensors");
    let epoch = epoch_of(&model);
    let beside = model.with_extension("json");
    let stale = format!(
        r#"{{"thresholds": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], "epoch": {}}}"#,
        epoch + 1
    );
    std::fs::write(&beside, stale).unwrap();
    let images = data.join("test/preprocessed_images");
    let out = dir.join("predicted");
    let outputs = predict(2, &images, &model, &out);
    let refusal = format!(
        "the thresholds beside the model, {}, were tuned for the model of epoch {}, and {} is \
         the model of epoch {epoch}",
        beside.display(),
        epoch + 1,
        model.display()
    );
    for (r, o) in outputs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "rank {r} succeeded:\n{}", text(o));
        assert!(
            err.contains(&refusal) && err.contains("give --thresholds FILE"),
            "rank {r}:\n{err}"
        );
    }
    assert!(!out.join("decisions.csv").exists());
    // Of its epoch, they decide.
    let tuned =
        format!(r#"{{"thresholds": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], "epoch": {epoch}}}"#);
    std::fs::write(&beside, tuned).unwrap();
    let outputs = predict(1, &images, &model, &out);
    assert!(outputs[0].status.success(), "{}", text(&outputs[0]));
    assert!(
        text(&outputs[0]).contains(&format!(
            "decisions at the thresholds of {}",
            beside.display()
        )),
        "{}",
        text(&outputs[0])
    );
}

/// A model with NaN weights: `predict` and `evaluate` (with either eye combination, whose
/// AUC grouped tied scores by `==` and so never got past a NaN) stop every rank naming the
/// images, and write no submission.
#[test]
fn a_model_with_nan_outputs_is_refused_on_every_rank() {
    let tmp = common::temp_dir("ddp-train-predict-nan");
    let dir = tmp.path();
    let (data, _) = setup(dir);
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = ConvNet::new(&vs.root(), ConvNetConfig::default());
    tch::no_grad(|| {
        for (_, mut t) in vs.variables() {
            if t.is_floating_point() {
                let _ = t.fill_(f64::NAN);
            }
        }
    });
    let model = dir.join("nan.safetensors");
    checkpoint::save(&vs, &model, &Default::default()).unwrap();
    let refused = |outputs: &[Output], what: &str, images: &str| {
        for (r, o) in outputs.iter().enumerate() {
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!o.status.success(), "{what}: rank {r} succeeded\n{err}");
            assert!(
                err.contains(&format!(
                    "the model's outputs are NaN or infinite for {images} of the {images} images"
                )) && err.contains("nan.safetensors"),
                "{what}: rank {r}:\n{err}"
            );
        }
    };
    let out = dir.join("run");
    refused(
        &predict(2, &data.join("test/preprocessed_images"), &model, &out),
        "predict",
        "11",
    );
    assert!(!out.join("submission.csv").exists());
    for combine in ["max", "mean"] {
        let outputs = evaluate(1, &data, &model, &out, &["--eye-combine", combine]);
        refused(&outputs, combine, "24");
    }
    assert!(!out.join("evaluation.json").exists());
}

/// `--image-dir` names --data's image folder when it has none of the usual names; without
/// it the error says to give it.
#[test]
fn evaluate_reads_the_images_of_image_dir() {
    let tmp = common::temp_dir("ddp-train-image-dir");
    let dir = tmp.path();
    let (data, model) = setup(dir);
    let images = dir.join("fundus photos");
    std::fs::rename(data.join("preprocessed_images"), &images).unwrap();
    let out = dir.join("run");
    let outputs = evaluate(1, &data, &model, &out, &[]);
    let err = String::from_utf8_lossy(&outputs[0].stderr).into_owned();
    assert!(!outputs[0].status.success(), "{err}");
    assert!(
        err.contains("give the folder that holds the images with --image-dir"),
        "{err}"
    );
    let outputs = evaluate(
        1,
        &data,
        &model,
        &out,
        &["--image-dir", images.to_str().unwrap()],
    );
    assert!(outputs[0].status.success(), "{}", text(&outputs[0]));
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("evaluation.json")).unwrap())
            .unwrap();
    assert_eq!(report["images"], 24, "{report}");
}

/// An `--out` that cannot be a run directory (a file is there) fails every rank before any
/// image is scored, naming rank 0's reason.
#[test]
fn an_out_that_cannot_be_made_fails_every_rank_before_scoring() {
    let tmp = common::temp_dir("ddp-train-predict-bad-out");
    let dir = tmp.path();
    let (data, model) = setup(dir);
    let out = dir.join("taken");
    std::fs::write(&out, b"a file").unwrap();
    let outputs = predict(2, &data.join("test/preprocessed_images"), &model, &out);
    for (r, o) in outputs.iter().enumerate() {
        assert!(!o.status.success(), "rank {r} succeeded:\n{}", text(o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains(&format!(
                "rank 0 cannot create run directory {}:",
                out.display()
            )),
            "rank {r}:\n{err}"
        );
        assert!(!err.contains("images"), "rank {r} scored:\n{err}");
    }
    assert_eq!(std::fs::read(&out).unwrap(), b"a file");
}
