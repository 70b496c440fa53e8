//! The PyTorch references that `cargo xtask bench` runs accept the command lines it gives
//! them: here `reference_ddp.py` on JPEGs with one `DataLoader` worker process per rank, as
//! the `train` group runs it (the dataset must survive being pickled into the worker).

mod common;

use common::{root, sample};
use ddp_testkit::{setup_python, temp_dir, text};

#[test]
fn the_training_reference_loads_jpegs_in_a_worker_process() {
    let dir = temp_dir("xtask-bench-reference");
    let data = sample(dir.path());
    let out = setup_python()
        .arg(root().join("ddp-train/benches/reference_ddp.py"))
        .args([
            "--ranks",
            "1",
            "--warmup",
            "0",
            "--steps",
            "2",
            "--batch-size",
            "2",
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
    for word in ["source=jpeg", "world=1", "rank=0", "workers=1", "steps=2"] {
        assert!(
            line.split_whitespace().any(|w| w == word),
            "{word} not in {line}"
        );
    }
}
