//! A run that is over stays over when started again on its checkpoint (a launcher's
//! restart, a requeued job, `--resume latest`) or run again: ended by early stopping (a
//! larger patience continues it), or past its last epoch; a Trainer whose run stopped
//! refuses to run again. Nothing is trained, appended or moved. One rank, in this process.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use common::free_port;
use common::regression::{points, Regression};
use ddp_train::{
    CheckpointSettings, EarlyStopping, EpochReport, RuntimeSettings, Settings, StopReason,
    TrainError, Trainer,
};

/// 6 epochs of 4 steps into `out`, stopping early on the training loss after `patience`
/// epochs without an improvement of 1000 (none ever is), resuming `latest` when `resume`.
fn run(out: &Path, patience: u32, resume: bool) -> Vec<EpochReport> {
    let mut early = EarlyStopping::min("train_loss").after(patience);
    early.min_delta = 1000.0;
    start(out, 6, early, resume).run().unwrap()
}

/// A Trainer of `epochs` epochs of 4 steps into `out` with `early` stopping, resuming
/// `latest` when `resume`.
fn start(out: &Path, epochs: u64, early: EarlyStopping, resume: bool) -> Trainer<Regression> {
    start_task(out, settings(out, epochs, early, resume), task())
}

/// Rank 0 of 1 training `task` with `s`.
fn start_task(out: &Path, s: Settings, task: Regression) -> Trainer<Regression> {
    assert_eq!(s.out.as_deref(), Some(out));
    let env = ddp_comm::EnvConfig::new(0, 1, "127.0.0.1", free_port());
    Trainer::with_env(task, s, &env).unwrap()
}

/// 64 training points (4 steps of 16 per epoch) and 8 validation points.
fn task() -> Regression {
    Regression::new(points(64, 1), points(8, 2))
}

/// [`start`]'s settings: stop signals left alone.
fn settings(out: &Path, epochs: u64, early: EarlyStopping, resume: bool) -> Settings {
    let quiet = RuntimeSettings::default()
        .threads(Some(1))
        .workers(Some(1))
        .progress(false)
        .plot(false)
        .stop_on_signals(false);
    let resume = resume.then(|| "latest".to_string());
    Settings::default()
        .epochs(epochs)
        .batch_size(16)
        .seed(3)
        .early_stopping(early)
        .checkpoint(CheckpointSettings::default().resume(resume))
        .runtime(quiet)
        .out(Some(out.to_path_buf()))
}

fn epochs(reports: &[EpochReport]) -> Vec<u64> {
    reports.iter().map(|r| r.epoch).collect()
}

/// The epochs of `out/metrics.jsonl`, and the checkpoint `latest` names.
fn recorded(out: &Path) -> (Vec<u64>, String) {
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let epochs = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["epoch"].as_u64())
        .map(Option::unwrap)
        .collect();
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    (epochs, latest.trim().to_string())
}

fn log_of(out: &Path) -> String {
    std::fs::read_to_string(out.join("logs/rank-0.log")).unwrap()
}

#[test]
fn a_run_ended_by_early_stopping_trains_no_further_when_resumed() {
    let tmp = common::temp_dir("ddp-train-early-stopping");
    let out = tmp.path().join("run");
    // Epoch 1 sets the best, epoch 2 is the one without improvement.
    assert_eq!(epochs(&run(&out, 1, false)), [1, 2]);
    assert_eq!(recorded(&out), (vec![1, 2], "epoch-0002".to_string()));
    let epoch_two = std::fs::read(out.join("checkpoints/epoch-0002.safetensors")).unwrap();

    assert_eq!(epochs(&run(&out, 1, true)), Vec::<u64>::new());
    assert_eq!(recorded(&out), (vec![1, 2], "epoch-0002".to_string()));
    assert!(!out.join("checkpoints/epoch-0003.safetensors").exists());
    assert_eq!(
        std::fs::read(out.join("checkpoints/epoch-0002.safetensors")).unwrap(),
        epoch_two
    );
    let log = log_of(&out);
    assert!(
        log.contains(
            "the run ended by early stopping at epoch 2: train_loss has not improved for 1 \
             epochs"
        ),
        "{log}"
    );

    // Patience 3 counts on from epoch 2's one bad epoch: epochs 3 and 4 make it 3.
    assert_eq!(epochs(&run(&out, 3, true)), [3, 4]);
    assert_eq!(recorded(&out), (vec![1, 2, 3, 4], "epoch-0004".to_string()));
}

/// `run` a second time on one Trainer continues where the first call ended: past the last
/// epoch, it trains nothing (no epoch is recorded twice, `latest` stays) and says so.
#[test]
fn a_trainer_run_again_after_its_last_epoch_trains_nothing() {
    let tmp = common::temp_dir("ddp-train-run-again");
    let out = tmp.path().join("run");
    let mut trainer = start(&out, 2, EarlyStopping::default(), false);
    assert_eq!(epochs(&trainer.run().unwrap()), [1, 2]);
    let epoch_two = std::fs::read(out.join("checkpoints/epoch-0002.safetensors")).unwrap();

    assert_eq!(epochs(&trainer.run().unwrap()), Vec::<u64>::new());
    assert_eq!(recorded(&out), (vec![1, 2], "epoch-0002".to_string()));
    assert_eq!(
        std::fs::read(out.join("checkpoints/epoch-0002.safetensors")).unwrap(),
        epoch_two
    );
    let log = log_of(&out);
    assert!(
        log.contains("the run already trained epoch 2, and is given 2 epoch(s)"),
        "{log}"
    );
}

/// A run resumed with no more epochs than it finished trains nothing and says why, with no
/// warning that it "continues" for fewer epochs than planned.
#[test]
fn a_run_resumed_for_no_more_epochs_than_it_finished_says_nothing_is_left() {
    let tmp = common::temp_dir("ddp-train-no-epochs-left");
    let out = tmp.path().join("run");
    assert_eq!(
        epochs(
            &start(&out, 2, EarlyStopping::default(), false)
                .run()
                .unwrap()
        ),
        [1, 2]
    );

    let mut resumed = start(&out, 1, EarlyStopping::default(), true);
    assert_eq!(epochs(&resumed.run().unwrap()), Vec::<u64>::new());
    assert_eq!(recorded(&out), (vec![1, 2], "epoch-0002".to_string()));
    let log = log_of(&out);
    assert!(
        log.contains(
            "the run already trained epoch 2, and is given 1 epoch(s): nothing left to train \
             (more than 2 epochs continue it)"
        ),
        "{log}"
    );
    assert!(!log.contains("continues for 1"), "{log}");
}

/// Every file of `out`'s checkpoints and its `metrics.jsonl`, by name, with its bytes.
fn written(out: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut files: BTreeMap<String, Vec<u8>> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        .map(|(name, p)| (name, std::fs::read(p).unwrap()))
        .collect();
    files.insert(
        "metrics.jsonl".into(),
        std::fs::read(out.join("metrics.jsonl")).unwrap(),
    );
    files
}

/// `run` again on a Trainer whose run stopped inside epoch 2 (SIGUSR1 in its step 1) is
/// refused on the spot: nothing is trained, written, overwritten or pruned (`latest` stays the
/// stop's), and the error says where the run stopped and how it continues; a new Trainer on
/// the run directory continues it from the stop.
#[test]
fn a_trainer_run_again_after_a_stop_inside_an_epoch_is_refused_and_writes_nothing() {
    let tmp = common::temp_dir("ddp-train-run-after-stop");
    let out = tmp.path().join("run");
    let mut s = settings(&out, 2, EarlyStopping::default(), false);
    s.runtime.stop_on_signals = true;
    let mut stopping = task();
    // Calls 0-3 are epoch 1's steps; call 5 is epoch 2's step 1.
    stopping.signal_at = Some(5);
    let mut trainer = start_task(&out, s, stopping);
    let stop = trainer.run().unwrap_err();
    let checkpoint = out.join("checkpoints/epoch-0002-step-000002.safetensors");
    match &stop {
        TrainError::Stopped {
            reason: StopReason::Signal(libc::SIGUSR1),
            epoch: 2,
            step: 2,
            checkpoint: c,
            run,
        } => assert_eq!((c, run), (&checkpoint, &out)),
        other => panic!("not the stop at epoch 2 step 2: {other}"),
    }
    let before = written(&out);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        [
            "epoch-0001.safetensors",
            "epoch-0001.state.safetensors",
            "epoch-0002-step-000002.safetensors",
            "epoch-0002-step-000002.state.safetensors",
            "latest",
            "metrics.jsonl",
            "stopped",
        ]
    );
    assert_eq!(recorded(&out), (vec![1], "epoch-0002-step-000002".into()));

    for _ in 0..2 {
        let again = trainer.run();
        let after = written(&out);
        let changed: BTreeSet<&String> = (before.keys().chain(after.keys()))
            .filter(|&name| before.get(name) != after.get(name))
            .collect();
        assert!(changed.is_empty(), "run again wrote {changed:?}");
        let again = again.unwrap_err();
        assert_eq!(
            again.to_string(),
            format!(
                "this Trainer's run stopped by SIGUSR1 at epoch 2 step 2 and trains no further; \
                 start again with --out {} (a new Trainer) to continue from checkpoint {}",
                out.display(),
                checkpoint.display()
            )
        );
        assert!(matches!(
            again,
            TrainError::RunAfterStop {
                epoch: 2,
                step: 2,
                ..
            }
        ));
    }

    drop(trainer);
    let mut continued = start(&out, 2, EarlyStopping::default(), false);
    let reports = continued.run().unwrap();
    assert_eq!(epochs(&reports), [2]);
    assert_eq!(reports[0].steps, 4);
    assert_eq!(recorded(&out), (vec![1, 2], "epoch-0002".into()));
}
