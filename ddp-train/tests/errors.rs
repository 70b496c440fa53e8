//! Errors for people: a user's mistake prints `error: <what and why>` and nothing else, even
//! with `RUST_BACKTRACE=1` (a backtrace belongs to bugs, which panic).

use std::process::{Command, Output};
use std::time::Duration;

const EXE: &str = env!("CARGO_BIN_EXE_ddp-train");

/// `ddp-train ARGS` as a single process, with backtraces requested.
fn ddp_train(args: &[&str]) -> Output {
    let mut cmd = Command::new(EXE);
    cmd.args(args)
        .env("RUST_BACKTRACE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for name in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
    ] {
        cmd.env_remove(name);
    }
    ddp_testkit::wait_bounded(cmd.spawn().unwrap(), Duration::from_secs(120))
}

fn assert_one_error(out: &Output, first_line: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().next(), Some(first_line), "{err}");
    assert!(!err.contains("stack backtrace"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_missing_data_folder_is_named_without_a_backtrace() {
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let missing = dir.path().join("no-such-odir");
    let run = dir.path().join("run");
    let train = || {
        ddp_train(&[
            "--data",
            missing.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
            "--device",
            "cpu",
        ])
    };
    assert_one_error(
        &train(),
        &format!(
            "error: loading ODIR data from {m}: cannot list folder '{m}': No such file or \
             directory (os error 2)",
            m = missing.display()
        ),
    );
    // A folder that exists but holds no annotations says what was looked for.
    std::fs::create_dir(&missing).unwrap();
    assert_one_error(
        &train(),
        &format!(
            "error: loading ODIR data from {m}: no ODIR annotation file in '{m}': looked for \
             full_df.csv, data.xlsx, ODIR-5K_Training_Annotations(Updated)_V2.xlsx",
            m = missing.display()
        ),
    );
}

#[test]
fn a_zero_batch_size_is_named_without_a_backtrace() {
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let out = ddp_train(&["--data", dir.path().to_str().unwrap(), "--batch-size", "0"]);
    assert_one_error(&out, "error: --batch-size must be at least 1");
}

#[test]
fn a_validation_fraction_out_of_range_names_its_flag() {
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let out = ddp_train(&["--data", dir.path().to_str().unwrap(), "--val-split", "1.5"]);
    assert_one_error(
        &out,
        "error: --val-split 1.5 must be a fraction strictly between 0 and 1 (of the patients \
         held out for validation)",
    );
}

/// `python -m torch.distributed.launch` passes `--local_rank`; one that disagrees with the
/// launcher's `LOCAL_RANK` names both before anything starts.
#[test]
fn a_local_rank_flag_that_disagrees_with_the_launcher_is_named() {
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let mut cmd = Command::new(EXE);
    cmd.args(["--data", dir.path().to_str().unwrap(), "--local_rank", "1"])
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "1"),
            ("RUST_BACKTRACE", "1"),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let out = ddp_testkit::wait_bounded(cmd.spawn().unwrap(), Duration::from_secs(120));
    assert_one_error(
        &out,
        "error: --local-rank 1 disagrees with the launcher's local rank 0 (LOCAL_RANK or \
         SLURM_LOCALID): both must name the same device",
    );
}

/// `predict` and `evaluate` read the training flags of the model, the transform and the
/// runtime; the others are not in their help and are refused, not silently dropped.
#[test]
fn an_odir_augmentation_with_eval_only_is_refused() {
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let folder = dir.path().to_str().unwrap();
    for (flag, value) in [
        ("--hflip", None),
        ("--rotation", Some("10")),
        ("--dct-upsampling", Some("2")),
    ] {
        let mut args = vec!["--data", folder, "--resume", folder, "--eval-only", flag];
        args.extend(value);
        let out = ddp_train(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert_eq!(
            err.lines().next(),
            Some(
                format!("error: {flag} is a training flag, which --eval-only does not read")
                    .as_str()
            ),
            "{err}"
        );
    }
}

#[test]
fn a_training_flag_that_predict_does_not_read_is_refused() {
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let folder = dir.path().to_str().unwrap();
    for (command, flag, value) in [
        ("predict", "--lr", "0.1"),
        ("predict", "--labels", "eye"),
        ("evaluate", "--init-from", "model.pth"),
        ("evaluate", "--epochs", "3"),
    ] {
        let args = [
            command,
            "--checkpoint",
            folder,
            "--data",
            folder,
            flag,
            value,
        ];
        let out = ddp_train(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{command} {flag}: {err}");
        assert_eq!(
            err.lines().next(),
            Some(
                format!("error: {flag} is a training flag, which `{command}` does not read")
                    .as_str()
            ),
            "{err}"
        );
    }
    let help = |command: &str| {
        String::from_utf8_lossy(&ddp_train(&[command, "--help"]).stdout).into_owned()
    };
    let (predict, evaluate) = (help("predict"), help("evaluate"));
    for read in [
        "--image-size",
        "--normalize",
        "--model",
        "--batch-size",
        "--device",
    ] {
        assert!(predict.contains(read) && evaluate.contains(read), "{read}");
    }
    for unread in ["--lr", "--epochs", "--init-from", "--resume", "--hflip"] {
        assert!(
            !predict.contains(unread) && !evaluate.contains(unread),
            "{unread}"
        );
    }
    assert!(evaluate.contains("--labels") && !predict.contains("--labels"));
    // A flag evaluate reads gets past the command line: the folder is what fails.
    let out = ddp_train(&[
        "evaluate",
        "--checkpoint",
        folder,
        "--data",
        folder,
        "--labels",
        "eye",
    ]);
    assert_one_error(
        &out,
        &format!("error: no ODIR annotation file in '{folder}': looked for full_df.csv, data.xlsx, ODIR-5K_Training_Annotations(Updated)_V2.xlsx"),
    );
}

#[test]
fn per_eye_labels_asked_of_annotations_without_them_name_the_other_choice() {
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let data = dir.path().join("odir");
    ddp_data::odir::synthetic::generate(
        &data,
        &ddp_data::odir::synthetic::SyntheticConfig {
            images: 8,
            size: 48,
            ..Default::default()
        },
    )
    .unwrap();
    // The same annotations without their per-eye column.
    let csv = data.join("full_df.csv");
    let text = std::fs::read_to_string(&csv).unwrap();
    std::fs::write(&csv, text.replacen(",target,", ",unused,", 1)).unwrap();
    let out = dir.path().join("run");
    // `per-eye`, as the help's words say, is `eye`.
    let args = ["--data", data.to_str().unwrap(), "--labels", "per-eye"];
    let out = ddp_train(&[&args[..], &["--out", out.to_str().unwrap()]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: loading ODIR data from "), "{err}");
    assert!(
        err.contains("'target'")
            && err.contains(
                ": --labels eye needs per-eye labels; --labels patient (or auto) takes the \
                 patient columns N..O"
            ),
        "{err}"
    );
}
