//! What the launcher tests share: the debug binaries, a small synthetic sample, the
//! launcher with quick settings, and the reliability tests' training and its reference.

// Each test binary uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use ddp_testkit::{procs, temp_dir, text, wait_bounded, wait_for};

pub const XTASK: &str = env!("CARGO_BIN_EXE_xtask");

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The debug binary `name`: the one `cargo xtask test` built (it passes each binary's path
/// as `DDP_TEST_BIN_<NAME>`), else [`build_bin`]'s, once per test process.
pub fn debug_binary(cell: &'static OnceLock<PathBuf>, name: &str, args: &[&str]) -> &'static Path {
    cell.get_or_init(|| {
        let var = format!("DDP_TEST_BIN_{}", name.replace('-', "_").to_uppercase());
        match std::env::var_os(&var) {
            Some(path) => PathBuf::from(path),
            None => build_bin(cargo(), name, args),
        }
    })
}

/// The cargo that runs the tests.
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// Runs `cargo build --quiet ARGS` in the workspace and returns the executable of its binary
/// `name`, as cargo's messages name it: a guess at `target/debug/<name>` would miss a
/// relative `CARGO_TARGET_DIR` (relative to the workspace, not to a test's folder), a
/// `[build] target-dir` or a `[build] target`.
pub fn build_bin(mut cargo: Command, name: &str, args: &[&str]) -> PathBuf {
    let out = cargo
        .current_dir(root())
        .args([
            "build",
            "--quiet",
            "--message-format=json-render-diagnostics",
        ])
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "building {name} failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|line| executable(line, "bin", name))
        .unwrap_or_else(|| panic!("cargo reported no executable for {name}"))
}

include!("../../../shared-src/cargo_artifact.rs");

/// The debug ddp-train binary, with the injected faults the reliability tests use.
pub fn ddp_train() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    debug_binary(
        &BIN,
        "ddp-train",
        &["-p", "ddp-train", "--features", "fault-injection"],
    )
}

/// The debug ddp-gen-data binary (ddp-data's debug build is optimised: see Cargo.toml).
pub fn ddp_gen_data() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    debug_binary(
        &BIN,
        "ddp-gen-data",
        &["-p", "ddp-data", "--bin", "ddp-gen-data"],
    )
}

/// A small synthetic ODIR folder, written by `cargo xtask gen-data`.
pub fn sample(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    let out = Command::new(XTASK)
        .args([
            "gen-data", "--images", "48", "--size", "48", "--seed", "2", "--bin",
        ])
        .arg(ddp_gen_data())
        .arg("--out")
        .arg(&data)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("ddp-gen-data: 48 images of 24 patients"),
        "{}",
        text(&out)
    );
    data
}

/// `cargo xtask train --cpus 2` with quick settings plus `extra`.
pub fn launcher(data: &Path, out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Command {
    launcher_with(&["--cpus", "2", "--grace", "2"], data, out, extra, env)
}

/// `cargo xtask train` with the launcher's flags `launch`, quick settings (batch 4 unless
/// `extra` sets it), and `extra`.
pub fn launcher_with(
    launch: &[&str],
    data: &Path,
    out: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Command {
    launcher_of(ddp_train(), launch, data, out, extra, env)
}

/// As [`launcher_with`], with `bin` as the rank program instead of ddp-train itself.
pub fn launcher_of(
    bin: &Path,
    launch: &[&str],
    data: &Path,
    out: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Command {
    let mut cmd = Command::new(XTASK);
    cmd.arg("train")
        .args(launch)
        .arg("--bin")
        .arg(bin)
        .arg("--out")
        .arg(out)
        .args(["--data"])
        .arg(data)
        .args([
            "--image-size",
            "32",
            "--workers",
            "1",
            "--collective-timeout",
            "10",
        ])
        .args(extra)
        .env("DDP_RDZV_TIMEOUT_S", "30")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if !extra.contains(&"--batch-size") {
        cmd.args(["--batch-size", "4"]);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// The rank processes of a running launcher, once both are up.
pub fn rank_pids(launcher: u32) -> Vec<u32> {
    let mut kids = Vec::new();
    wait_for(
        "the launcher started 2 ranks",
        Duration::from_secs(60),
        || {
            kids = procs::children_of(launcher);
            kids.len() == 2
        },
    );
    kids
}

/// Which rank a process is, from its environment.
pub fn rank_of(pid: u32) -> usize {
    procs::env_var(pid, "RANK").unwrap().parse().unwrap()
}

/// The training of the reliability tests: 2 epochs of batch 2 (9 steps per rank per epoch
/// on the 48-image sample), a step checkpoint every 3 optimizer steps, each rank's loss
/// logged at every step.
pub const LONG_EPOCHS: [&str; 10] = [
    "--epochs",
    "2",
    "--batch-size",
    "2",
    "--checkpoint-every",
    "3",
    "--log-every",
    "1",
    "--threads",
    "1",
];

/// Makes every step at least this long, so that a test can act inside an epoch.
pub const SLOW_STEPS: (&str, &str) = ("DDP_TRAIN_STEP_SLEEP_MS", "300");

/// A safetensors file's tensors: its header's entries (names, dtypes, shapes, offsets) and
/// its data, byte for byte; its metadata aside (the model's record names the run's data
/// folder, another one per test).
pub type Weights = (serde_json::Value, Vec<u8>);

/// The last checkpoint's tensors (`epoch-0002`).
pub fn final_weights(run: &Path) -> Weights {
    let bytes = std::fs::read(run.join("checkpoints/epoch-0002.safetensors")).unwrap();
    let end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..end]).unwrap();
    header.as_object_mut().unwrap().remove("__metadata__");
    (header, bytes[end..].to_vec())
}

/// The final weights of an uninterrupted run of `LONG_EPOCHS` (computed once per process).
pub fn uninterrupted_weights(data: &Path) -> &'static Weights {
    static WEIGHTS: OnceLock<Weights> = OnceLock::new();
    WEIGHTS.get_or_init(|| {
        let dir = temp_dir("xtask-reference");
        let out = dir.path().join("run");
        let output = wait_bounded(
            launcher(data, &out, &LONG_EPOCHS, &[]).spawn().unwrap(),
            Duration::from_secs(300),
        );
        assert!(output.status.success(), "{}", text(&output));
        let steps: Vec<u64> = std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["steps"].as_u64().unwrap()
            })
            .collect();
        assert_eq!(steps, [9, 9], "the tests below assume 9 steps per epoch");
        final_weights(&out)
    })
}

/// The checkpoint `latest` names.
pub fn latest(run: &Path) -> String {
    std::fs::read_to_string(run.join("checkpoints/latest"))
        .unwrap()
        .trim()
        .to_string()
}

/// The model files in a run's checkpoint folder, sorted.
pub fn checkpoint_files(run: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors") && !n.ends_with(".state.safetensors"))
        .collect();
    names.sort();
    names
}
