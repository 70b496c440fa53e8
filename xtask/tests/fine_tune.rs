//! The fine-tuning run of docs/odir.md: torchvision's resnet18 from a file `torch.save`
//! wrote, its stem and first stages frozen until epoch 2, on 2 ranks through `cargo xtask
//! train`; stopped by SIGTERM inside the frozen epoch, continued by the same command, it ends
//! with the weights of an uninterrupted run, byte for byte.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{final_weights, latest, launcher_with, rank_pids, sample, LONG_EPOCHS, SLOW_STEPS};
use ddp_testkit::{kill, procs, temp_dir, text, wait_bounded, wait_for_text};

/// `torchvision.models.resnet18(num_classes=8)`, seeded, saved as a DDP model's state_dict
/// (`module.` names) to `path`.
fn torchvision_resnet18(path: &Path) {
    let script = "import sys, torch, torchvision\n\
                  from collections import OrderedDict\n\
                  torch.manual_seed(0)\n\
                  m = torchvision.models.resnet18(num_classes=8)\n\
                  sd = OrderedDict(('module.' + k, v) for k, v in m.state_dict().items())\n\
                  torch.save(sd, sys.argv[1])\n";
    let out = ddp_testkit::setup_python()
        .args(["-c", script])
        .arg(path)
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "torch.save failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The run's flags: 2 epochs of 9 steps per rank, a checkpoint every 3 steps, the stem and
/// layer1 frozen in epoch 1.
fn fine_tune(weights: &Path) -> Vec<String> {
    let mut v: Vec<String> = LONG_EPOCHS.map(String::from).to_vec();
    v.extend(
        [
            "--model",
            "resnet18",
            "--normalize",
            "imagenet",
            "--unfreeze-at",
            "2",
            "--init-from",
        ]
        .map(String::from),
    );
    v.push(weights.display().to_string());
    v.extend(["--freeze", "conv1", "bn1", "layer1"].map(String::from));
    v
}

#[test]
fn a_fine_tuned_resnet18_stopped_by_sigterm_continues_to_the_uninterrupted_weights() {
    let dir = temp_dir("xtask-fine-tune");
    let data = sample(dir.path());
    let weights = dir.path().join("resnet18.pth");
    torchvision_resnet18(&weights);
    let flags = fine_tune(&weights);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();

    // The uninterrupted run trains beside the interrupted one, whose steps mostly sleep.
    let reference = dir.path().join("reference");
    let uninterrupted = launcher_with(
        &["--cpus", "2", "--grace", "2"],
        &data,
        &reference,
        &flags,
        &[],
    )
    .spawn()
    .unwrap();
    let uninterrupted =
        std::thread::spawn(move || wait_bounded(uninterrupted, Duration::from_secs(600)));

    let out = dir.path().join("run");
    let start = |env: &[(&str, &str)]| {
        launcher_with(&["--cpus", "2", "--grace", "60"], &data, &out, &flags, env)
            .spawn()
            .unwrap()
    };
    let child = start(&[SLOW_STEPS]);
    let ranks = rank_pids(child.id());
    wait_for_text(
        &out.join("logs/rank-0.out"),
        "epoch 1 step 5/9",
        Duration::from_secs(300),
    );
    kill(child.id(), libc::SIGTERM);
    let output = wait_bounded(child, Duration::from_secs(120));
    let t = text(&output);
    assert_eq!(output.status.code(), Some(75), "{t}");
    for p in ranks {
        assert!(!procs::alive(p), "rank process {p} survived the job");
    }
    let stopped = latest(&out);
    assert!(
        stopped.starts_with("epoch-0001-step-"),
        "stopped at {stopped}, not inside the frozen epoch"
    );

    let output = uninterrupted.join().unwrap();
    let t = text(&output);
    assert!(output.status.success(), "{t}");
    assert!(t.contains("initial weights from"), "{t}");
    assert!(
        t.contains("epoch 2: 62 parameters train, 0 frozen (were 15)"),
        "epoch 2 unfroze not the 15 frozen parameters: {t}"
    );
    let expected = final_weights(&reference);

    // The same command continues from the stop, while the file is not read again.
    let output = wait_bounded(start(&[]), Duration::from_secs(600));
    let t = text(&output);
    assert!(output.status.success(), "{t}");
    assert!(t.contains("continuing the stopped run"), "{t}");
    assert!(t.contains("takes precedence"), "{t}");
    assert!(
        final_weights(&out) == expected,
        "the resumed fine-tuning ended with other weights than the uninterrupted one"
    );
}
