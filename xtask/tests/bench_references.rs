//! The PyTorch references that `cargo xtask bench` runs accept the command lines it gives
//! them: here `reference_ddp.py` on JPEGs with one `DataLoader` worker process per rank, as
//! the `train` group runs it (the dataset must survive being pickled into the worker), over
//! one iterator for all epochs, as `ddp_steps` runs its loader (a `DataLoader` prefetches
//! only within one iterator, so one per epoch would wait for a decode at every epoch start).

mod common;

use common::{root, sample};
use ddp_testkit::{setup_python, temp_dir, text};

/// `reference_ddp.py`'s path.
fn script() -> std::path::PathBuf {
    root().join("ddp-train/benches/reference_ddp.py")
}

#[test]
fn the_training_reference_loads_jpegs_in_a_worker_process_over_one_iterator() {
    let dir = temp_dir("xtask-bench-reference");
    let data = sample(dir.path());
    let out = setup_python()
        .arg(script())
        // 3 steps of 20 of the 48 images: the last batch takes 8 of epoch 0 and 12 of epoch 1.
        .args([
            "--ranks",
            "1",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--batch-size",
            "20",
        ])
        .args(["--image-size", "32", "--workers", "1", "--data"])
        .arg(&data)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("RESULT reference_ddp "))
        .unwrap_or_else(|| panic!("no RESULT line: {}", text(&out)));
    for word in [
        "source=jpeg",
        "world=1",
        "rank=0",
        "workers=1",
        "steps=2",
        "loader_iterators=1",
    ] {
        assert!(
            line.split_whitespace().any(|w| w == word),
            "{word} not in {line}"
        );
    }
}

#[test]
fn the_training_reference_chains_the_epochs_orders_as_ddp_steps_does() {
    // ddp_steps: the rank's order of epoch 0, then of epoch 1, ..., cut to the steps' indices.
    let check = r#"
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("reference_ddp", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sampler = torch.utils.data.distributed.DistributedSampler(
    range(5), num_replicas=2, rank=1, shuffle=True, seed=0)
orders = []
for epoch in range(3):
    sampler.set_epoch(epoch)
    orders.append(list(sampler))
chained = module.ChainedEpochs(sampler, 7)
print(len(chained), list(chained) == orders[0] + orders[1] + orders[2][:1], orders[0] != orders[1])
"#;
    let out = setup_python()
        .args(["-c", check])
        .arg(script())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "7 True True");
}
