//! Errors for people: a user's mistake prints `error: <what and why>` and nothing else, even
//! with `RUST_BACKTRACE=1` (a backtrace belongs to bugs, which panic).

mod common;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Output};
use std::time::Duration;

use common::regression::{points, Regression};
use ddp_data::{Batch, TensorDataset};
use ddp_train::{RegressionStats, Settings, Task, TrainError, Trainer};
use tch::{nn, nn::Module, Device, Kind, Reduction, Tensor};

const EXE: &str = env!("CARGO_BIN_EXE_ddp-train");

/// `ddp-train ARGS` as a single process, with backtraces requested.
fn ddp_train(args: &[&str]) -> Output {
    let args: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
    ddp_train_os(&args)
}

/// [`ddp_train`] with arguments that need not be UTF-8.
fn ddp_train_os(args: &[&OsStr]) -> Output {
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

/// The synthetic sample of `images` images of 48 pixels in `data`.
fn sample(data: &Path, images: usize) {
    ddp_data::odir::synthetic::generate(
        data,
        &ddp_data::odir::synthetic::SyntheticConfig {
            images,
            size: 48,
            ..Default::default()
        },
    )
    .unwrap();
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
             full_df.csv, data.xlsx, ODIR-5K_Training_Annotations(Updated)_V2.xlsx, \
             Annotation/training annotation (English).xlsx, Annotation/off-site test \
             annotation (English).xlsx, Annotation/on-site test annotation (English).xlsx; \
             --data takes Kaggle's download, the challenge's folder or an OIA-ODIR set \
             (docs/odir.md, \"The data\"), and a folder of images alone is for `ddp-train \
             predict`",
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

/// ODIR's own flags are refused by the command that would start the ranks, before it starts
/// any or makes their run directory, as the generic ones are; for each command.
#[test]
fn an_odir_flag_every_rank_would_refuse_is_refused_before_the_ranks_start() {
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let data = dir.path().to_str().unwrap();
    let out = dir.path().join("run");
    let out = out.to_str().unwrap();
    let model = dir.path().join("model.safetensors");
    let model = model.to_str().unwrap();
    let launch = ["--nproc-per-node", "2", "--out", out];
    let small = ["--data", data, "--checkpoint", model, "--image-size", "8"];
    let refusals = [
        (
            vec!["--data", data, "--val-split", "1.5"],
            "--val-split 1.5",
        ),
        ([&["predict"][..], &small].concat(), "--image-size 8"),
        ([&["evaluate"][..], &small].concat(), "--image-size 8"),
    ];
    for (args, named) in refusals {
        let given: Vec<&str> = args.iter().copied().chain(launch).collect();
        let result = ddp_train(&given);
        let err = String::from_utf8_lossy(&result.stderr);
        assert_eq!(result.status.code(), Some(1), "{given:?}: {err}");
        let first = err.lines().next().unwrap_or_default();
        assert!(
            first.starts_with(&format!("error: {named}")),
            "{given:?}: {err}"
        );
        assert!(
            !err.contains("ddp-run"),
            "{given:?}: no rank started: {err}"
        );
        assert!(!Path::new(out).exists(), "{given:?}: {out} was made");
    }
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
        &format!(
            "error: no ODIR annotation file in '{folder}': looked for full_df.csv, data.xlsx, \
             ODIR-5K_Training_Annotations(Updated)_V2.xlsx, Annotation/training annotation \
             (English).xlsx, Annotation/off-site test annotation (English).xlsx, \
             Annotation/on-site test annotation (English).xlsx; --data takes Kaggle's \
             download, the challenge's folder or an OIA-ODIR set (docs/odir.md, \"The \
             data\"), and a folder of images alone is for `ddp-train predict`"
        ),
    );
}

#[test]
fn per_eye_labels_asked_of_annotations_without_them_name_the_other_choice() {
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let data = dir.path().join("odir");
    sample(&data, 8);
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

/// A path that is not UTF-8 is refused by its flag before anything is read or created
/// (files and folders of such names that exist included): the run records its paths as
/// text, and a lossy copy (`run_\u{FFFD}`) would name, and overwrite, another run's
/// directory.
#[test]
fn a_path_that_is_not_utf8_is_refused_by_its_flag() {
    use std::os::unix::ffi::OsStrExt;
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let bad = |name: &[u8]| dir.path().join(OsStr::from_bytes(name));
    let data = dir.path().join("odir");
    sample(&data, 8);
    // A model file and a data folder of those names exist: only the names are refused.
    let weights = bad(b"w\xff.safetensors");
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let _net = ddp_model::ConvNet::new(&vs.root(), ddp_model::ConvNetConfig::default());
    ddp_model::checkpoint::save(&vs, &weights, &Default::default()).unwrap();
    let model = dir.path().join("model.safetensors");
    std::fs::copy(&weights, &model).unwrap();
    let folder = bad(b"s\xff");
    sample(&folder, 8);
    let (out, run) = (bad(b"run_\xff"), dir.path().join("run"));
    let [data, folder, weights, model, out, run] =
        [&data, &folder, &weights, &model, &out, &run].map(|p| p.as_os_str());
    let [cpu, one] = ["cpu", "1"].map(OsStr::new);
    let flag = |f: &'static str| OsStr::new(f);
    let train = [
        flag("--device"),
        cpu,
        flag("--epochs"),
        one,
        flag("--batch-size"),
        one,
    ];
    let refused: [(&str, &str, Vec<&OsStr>); 6] = [
        (
            "--out",
            "run_\u{FFFD}",
            vec![flag("--data"), data, flag("--out"), out],
        ),
        (
            "--init-from",
            "w\u{FFFD}.safetensors",
            vec![
                flag("--data"),
                data,
                flag("--out"),
                run,
                flag("--init-from"),
                weights,
            ],
        ),
        (
            "--data",
            "s\u{FFFD}",
            vec![flag("--data"), folder, flag("--out"), run],
        ),
        (
            "--checkpoint",
            "w\u{FFFD}.safetensors",
            vec![
                flag("evaluate"),
                flag("--checkpoint"),
                weights,
                flag("--data"),
                data,
            ],
        ),
        (
            "--checkpoint",
            "w\u{FFFD}.safetensors",
            vec![
                flag("predict"),
                flag("--checkpoint"),
                weights,
                flag("--data"),
                data,
            ],
        ),
        (
            "--thresholds",
            "w\u{FFFD}.safetensors",
            vec![
                flag("predict"),
                flag("--checkpoint"),
                model,
                flag("--thresholds"),
                weights,
                flag("--data"),
                data,
            ],
        ),
    ];
    let why = "is not valid UTF-8 (U+FFFD marks the bytes that are not): paths are recorded as \
               text, so rename it or give another path";
    for (name, shown, mut args) in refused {
        // Training is given a run it would train; the commands a run directory.
        match args[0].to_str() {
            Some("evaluate" | "predict") => args.extend([flag("--out"), run]),
            _ => args.extend(train),
        }
        let shown = format!("{:?}", dir.path().join(shown).to_str().unwrap());
        assert_one_error(
            &ddp_train_os(&args),
            &format!("error: {name} {shown} {why}"),
        );
    }
    std::fs::remove_file(model).unwrap();
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["odir", "s\u{FFFD}", "w\u{FFFD}.safetensors"],
        "no run directory was created"
    );
}

/// A plan of 2^40 optimizer steps or more is refused naming --epochs: the run's checkpoints
/// could not be resumed from (they count fewer), and the product could overflow.
#[test]
fn a_plan_of_too_many_optimizer_steps_names_epochs() {
    let dir = ddp_testkit::temp_dir("ddp-train-errors");
    let data = dir.path().join("odir");
    sample(&data, 8);
    let run = dir.path().join("run");
    // 8 images, half for validation, batches of 1: 4 steps per epoch.
    let epochs = (1u64 << 38).to_string();
    let out = ddp_train(&[
        "--data",
        data.to_str().unwrap(),
        "--val-split",
        "0.5",
        "--batch-size",
        "1",
        "--epochs",
        &epochs,
        "--out",
        run.to_str().unwrap(),
        "--device",
        "cpu",
        "--time-limit",
        "1",
    ]);
    assert_one_error(
        &out,
        "error: --epochs 274877906944 times 4 optimizer steps per epoch must be below 2^40 \
         (1099511627776) optimizer steps, the most a checkpoint counts: give fewer, or set \
         --max-steps-per-epoch",
    );
}

/// What [`Faulty`] gets wrong.
#[derive(Clone, Copy)]
enum Fault {
    /// `train_loss` returns one loss per sample.
    PerSampleTrain,
    /// `train_loss` returns a detached loss.
    Detached,
    /// `eval_batch` returns one loss per sample.
    PerSampleEval,
    /// `train_loss` returns a loss whose backward fails after the model's gradients.
    FailingBackward,
}

/// The regression task with one [`Fault`].
struct Faulty(Regression, Fault);

/// In a child process of [`in_child`], where [`DROPPED`] names a file, the task (and so its
/// Trainer) writes there when it is dropped, in Unix nanoseconds, and copies the error file
/// as it then is next to it (`<file>.error`).
impl Drop for Faulty {
    fn drop(&mut self) {
        if let Some(file) = std::env::var_os(DROPPED) {
            let file = PathBuf::from(file);
            std::fs::write(&file, unix_nanos(std::time::SystemTime::now()).to_string()).unwrap();
            if let Some(error) = std::env::var_os("TORCHELASTIC_ERROR_FILE") {
                if let Ok(text) = std::fs::read_to_string(error) {
                    std::fs::write(file.with_extension("error"), text).unwrap();
                }
            }
        }
    }
}

impl Task for Faulty {
    type Model = nn::Sequential;
    type Data = TensorDataset;
    type Stats = RegressionStats;

    fn model(&self, root: &nn::Path) -> nn::Sequential {
        self.0.model(root)
    }

    fn train_data(&self) -> TensorDataset {
        self.0.train_data()
    }

    fn val_data(&self) -> Option<TensorDataset> {
        self.0.val_data()
    }

    fn train_loss(&self, model: &nn::Sequential, batch: &Batch) -> Tensor {
        match self.1 {
            Fault::PerSampleTrain => model
                .forward(batch.inputs())
                .mse_loss(batch.targets(), Reduction::None),
            Fault::Detached => self.0.train_loss(model, batch).detach(),
            Fault::PerSampleEval => self.0.train_loss(model, batch),
            Fault::FailingBackward => {
                // Made first, so that autograd runs the model's gradients and DDP's hooks
                // before this fails.
                let x = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                let failing = tch::no_grad(|| &x * 1.0);
                tch_ext::set_backward(&x, &failing, |_| Err("a peer died".into())).unwrap();
                failing.sum(Kind::Float) + self.0.train_loss(model, batch)
            }
        }
    }

    fn new_stats(&self) -> RegressionStats {
        self.0.new_stats()
    }

    fn eval_batch(&self, model: &Self::Model, batch: &Batch, stats: &mut Self::Stats) -> Tensor {
        let predictions = model.forward(batch.inputs());
        stats.add(&predictions, batch.targets());
        let reduction = match self.1 {
            Fault::PerSampleEval => Reduction::None,
            _ => Reduction::Sum,
        };
        predictions.mse_loss(batch.targets(), reduction)
    }
}

/// A Task's loss that backward or the loss's value cannot take is the Trainer's error naming
/// the method and what to return, not a panic inside libtorch's bindings (exit 101 on every
/// rank, with a backtrace). One rank, in this process: 64 training points and 8 validation
/// points, batches of 16.
#[test]
fn a_task_loss_that_is_no_scalar_is_an_error_naming_the_method() {
    let _generator = common::regression::hold_generator();
    let tmp = common::temp_dir("ddp-train-errors");
    let trainer = |fault: Fault, name: &str| {
        let mut s = Settings::default()
            .epochs(1)
            .batch_size(16)
            .seed(3)
            .out(Some(tmp.path().join(name)));
        s.runtime.threads = Some(1);
        s.runtime.workers = Some(1);
        s.runtime.progress = false;
        s.runtime.plot = false;
        s.runtime.stop_on_signals = false;
        let task = Faulty(Regression::new(points(64, 1), points(8, 2)), fault);
        let env = ddp_comm::EnvConfig::new(0, 1, "127.0.0.1", common::free_port());
        Trainer::with_env(task, s, &env).unwrap()
    };
    let invalid = |result: Result<_, TrainError>| match result {
        Err(TrainError::Invalid(message)) => message,
        Err(e) => panic!("another error: {e:?}"),
        Ok(_) => panic!("no error"),
    };
    let run = |fault, name| invalid(trainer(fault, name).run().map(|_| ()));
    assert_eq!(
        run(Fault::PerSampleTrain, "per-sample"),
        "Task::train_loss returned a loss of shape [16, 1]: return the batch's mean \
         (Reduction::Mean), a scalar"
    );
    assert_eq!(
        run(Fault::Detached, "detached"),
        "Task::train_loss returned a loss that needs no gradient (computed under no_grad, \
         detached, or from frozen parameters only): return one computed from the model's \
         trainable parameters"
    );
    assert_eq!(
        invalid(trainer(Fault::PerSampleEval, "eval").evaluate().map(|_| ())),
        "Task::eval_batch returned a loss of shape [8, 1]: return the sum of the per-sample \
         losses (Reduction::Sum), a scalar"
    );
}

/// A step whose backward fails after DDP's hooks ran ends there: `run` returns the backward's
/// error, evaluating after it works (it used to fail as a missed `sync_gradients`), and a
/// second `run` refuses, since the Trainer may hold part of the epoch. One rank, in this
/// process.
#[test]
fn evaluating_after_a_failed_backward_works() {
    let _generator = common::regression::hold_generator();
    let tmp = common::temp_dir("ddp-train-errors");
    let mut trainer = one_epoch(&tmp.path().join("run"), Fault::FailingBackward).unwrap();
    match trainer.run() {
        Err(TrainError::Context { context, source }) => {
            assert_eq!(context, "the backward pass of epoch 1 step 0");
            assert!(source.to_string().contains("a peer died"), "{source}");
        }
        other => panic!("expected the backward's error, got {other:?}"),
    }
    let report = trainer.evaluate().unwrap();
    assert_eq!(report.world_size, 1);
    assert!(report.val_loss.is_finite(), "{}", report.val_loss);
    let again = trainer.run().unwrap_err();
    assert!(
        matches!(again, TrainError::RunAfterFailure { epoch: 1, ref run } if run == &tmp.path().join("run")),
        "{again:?}"
    );
    assert_eq!(
        again.to_string(),
        format!(
            "this Trainer's run failed in epoch 1 and trains no further (its model and \
             optimizer may hold part of that epoch); start again with --out {} (a new \
             Trainer) to continue from the run's latest checkpoint",
            tmp.path().join("run").display()
        )
    );
}

/// A one-rank Trainer in this process for one epoch of [`Faulty`] regression (64 training
/// points, 8 for validation) with `fault`, batches of 16 from one loader, writing to `run`.
fn one_epoch(run: &Path, fault: Fault) -> Result<Trainer<Faulty>, TrainError> {
    let mut s = common::regression::quiet_settings(run)
        .epochs(1)
        .batch_size(16);
    s.runtime.workers = Some(1);
    let task = Faulty(Regression::new(points(64, 1), points(8, 2)), fault);
    let env = ddp_comm::EnvConfig::new(0, 1, "127.0.0.1", common::free_port());
    Trainer::with_env(task, s, &env)
}

/// Set in a child process of [`in_child`]: the test runs its program instead of its checks.
const CHILD: &str = "DDP_TRAIN_TEST_CHILD";
/// Where a child process's [`Faulty`] task notes when it was dropped.
const DROPPED: &str = "DDP_TRAIN_TEST_DROPPED";

fn unix_nanos(at: std::time::SystemTime) -> u128 {
    at.duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}

/// Runs this binary's test `name` alone in a child process, as a rank whose launcher gave it
/// the error file `dir/error.json` (and its task [`DROPPED`], `dir/dropped`); returns its
/// output and the error it recorded, as torchrun's JSON.
fn in_child(name: &str, dir: &Path) -> (Output, serde_json::Value) {
    let out = child(name, dir);
    let text = std::fs::read_to_string(dir.join("error.json"))
        .unwrap_or_else(|e| panic!("no error file ({e}): {}", ddp_testkit::text(&out)));
    (out, serde_json::from_str(&text).unwrap())
}

/// [`in_child`]'s child process, and its output.
fn child(name: &str, dir: &Path) -> Output {
    let file = dir.join("error.json");
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("TORCHELASTIC_ERROR_FILE", &file)
        .env(DROPPED, dir.join("dropped"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    ddp_testkit::wait_bounded(cmd.spawn().unwrap(), Duration::from_secs(120))
}

/// The time an error file's record gives, in Unix nanoseconds.
fn recorded_at(recorded: &serde_json::Value) -> u128 {
    recorded["message"]["extraInfo"]["timestamp_ns"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// A panic (tch's on CUDA's out of memory) is recorded for the launcher as it happens, before
/// it unwinds and closes the rank's links, and printed as ever.
#[test]
fn a_panic_is_recorded_for_the_launcher() {
    if std::env::var_os(CHILD).is_some() {
        let _ = ddp_train::exit_with(|| panic!("CUDA out of memory"));
        return;
    }
    let dir = common::temp_dir("ddp-train-errors");
    let (out, recorded) = in_child("a_panic_is_recorded_for_the_launcher", dir.path());
    assert!(!out.status.success(), "{}", ddp_testkit::text(&out));
    let message = recorded["message"]["message"].as_str().unwrap();
    let at = format!("panicked at {}:", file!());
    assert!(message.starts_with(&at), "{message}");
    assert!(message.ends_with(": CUDA out of memory"), "{message}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&at) && err.contains("CUDA out of memory"),
        "{err}"
    );
}

/// A Trainer's error is recorded as arisen when `run` returned it, before the Trainer, and
/// its links to the other ranks, is dropped: `Trainer::new(..)?.run()?`, as the examples
/// write it, drops the Trainer before `exit_with` (or `cli::run`) records the error.
#[test]
fn a_trainers_error_is_recorded_as_arisen_before_the_trainer_is_dropped() {
    if std::env::var_os(CHILD).is_some() {
        let _ = ddp_train::exit_with(|| {
            let tmp = common::temp_dir("ddp-train-errors");
            one_epoch(&tmp.path().join("run"), Fault::PerSampleTrain)?.run()?;
            Ok(())
        });
        return;
    }
    let dir = common::temp_dir("ddp-train-errors");
    let (out, recorded) = in_child(
        "a_trainers_error_is_recorded_as_arisen_before_the_trainer_is_dropped",
        dir.path(),
    );
    let message = recorded["message"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("Task::train_loss returned"),
        "{message}"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("error: {message}")), "{err}");
    let at = recorded_at(&recorded);
    // Recorded already when `run` returned: a SIGTERM during the drop leaves the record.
    let before: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("dropped.error")).unwrap())
            .unwrap();
    assert_eq!(before["message"]["message"], message);
    assert_eq!(recorded_at(&before), at);
    let dropped: u128 = std::fs::read_to_string(dir.path().join("dropped"))
        .unwrap()
        .parse()
        .unwrap();
    assert!(at < dropped, "recorded at {at}, dropped at {dropped}");
}

/// A panic caught inside the program (a data set's guard around a decoder) is no failure of
/// the program: a normal exit after it leaves no record for the launcher.
#[test]
fn a_caught_panic_followed_by_a_normal_exit_leaves_no_record() {
    if std::env::var_os(CHILD).is_some() {
        let code = ddp_train::exit_with(|| {
            let caught = std::panic::catch_unwind(|| panic!("a decoder's panic"));
            assert!(caught.is_err());
            Ok(())
        });
        assert_eq!(format!("{code:?}"), format!("{:?}", ExitCode::SUCCESS));
        return;
    }
    let dir = common::temp_dir("ddp-train-errors");
    let out = child(
        "a_caught_panic_followed_by_a_normal_exit_leaves_no_record",
        dir.path(),
    );
    assert!(out.status.success(), "{}", ddp_testkit::text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("a decoder's panic"),
        "{}",
        ddp_testkit::text(&out)
    );
    assert!(!dir.path().join("error.json").exists());
}

/// A Trainer's error that the program handled, followed by a success (`evaluate` after a
/// failed `run`), takes its record back; a later failure is recorded at its own time.
#[test]
fn a_handled_trainer_error_leaves_no_stale_record() {
    if std::env::var_os(CHILD).is_some() {
        let dir = PathBuf::from(std::env::var_os(DROPPED).unwrap());
        let dir = dir.parent().unwrap().to_path_buf();
        let error_file = PathBuf::from(std::env::var_os("TORCHELASTIC_ERROR_FILE").unwrap());
        let _ = ddp_train::exit_with(|| {
            let tmp = common::temp_dir("ddp-train-errors");
            let mut trainer = one_epoch(&tmp.path().join("run"), Fault::FailingBackward)?;
            assert!(trainer.run().is_err());
            assert!(error_file.exists(), "no record of the run's error");
            trainer.evaluate()?;
            assert!(!error_file.exists(), "the handled error's record stayed");
            let cleared = unix_nanos(std::time::SystemTime::now());
            std::fs::write(dir.join("cleared"), cleared.to_string()).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            trainer.run()?;
            Ok(())
        });
        return;
    }
    let dir = common::temp_dir("ddp-train-errors");
    let (out, recorded) = in_child("a_handled_trainer_error_leaves_no_stale_record", dir.path());
    let message = recorded["message"]["message"].as_str().unwrap();
    // The second `run` refuses: the failed one may have left part of its epoch behind.
    assert!(
        message.starts_with("this Trainer's run failed in epoch 1 and trains no further"),
        "{message}"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("error: {message}")), "{err}");
    let cleared: u128 = std::fs::read_to_string(dir.path().join("cleared"))
        .unwrap()
        .parse()
        .unwrap();
    let at = recorded_at(&recorded);
    assert!(at > cleared, "recorded at {at}, before {cleared}");
}
