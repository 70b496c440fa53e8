//! `xtask/gpu-extra.sh` runs on a GPU machine that has no cargo, from binaries built
//! elsewhere: a syntax error or a test binary missing from the bundle shows only there, as a
//! failed or skipped check in a scarce GPU session. These checks catch both here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The test binaries every bundle holds without a `gpu-bundle.list` line (make-bundle.sh's
/// defaults, see the GPU bundle's README): run.sh's own steps run them.
const ALWAYS_BUNDLED: [&str; 1] = ["ddp-comm.test.nccl"];

/// The bundle names (`PACKAGE.test.TARGET`) of the `test PACKAGE TARGET` lines of a
/// `gpu-bundle.list` text, and the test binaries every bundle holds.
fn listed_tests(list: &str) -> BTreeSet<String> {
    list.lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            ["test", package, target] => Some(format!("{package}.test.{target}")),
            _ => None,
        })
        .chain(ALWAYS_BUNDLED.map(str::to_owned))
        .collect()
}

/// The test binaries a gpu-extra script runs (`run_test NAME BINARY ...` lines) that are not
/// in `listed`, or that name no test target of the workspace at `root`.
fn unbundled(script: &str, listed: &BTreeSet<String>, root: &Path) -> Vec<String> {
    script
        .lines()
        .filter_map(|l| l.trim().strip_prefix("run_test "))
        .filter_map(|rest| rest.split_whitespace().nth(1))
        .filter(|binary| {
            let target = binary.split_once(".test.").map(|(package, target)| {
                root.join(package)
                    .join("tests")
                    .join(format!("{target}.rs"))
            });
            !listed.contains(*binary) || !target.is_some_and(|t| t.is_file())
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_test_binary_missing_from_the_list_or_the_workspace_is_found() {
    let list = "# comment\ntest ddp-data tensor\ntest ddp-comm nccl_peers # two GPUs\nbench x y\n";
    let listed = listed_tests(list);
    assert_eq!(
        listed.iter().map(String::as_str).collect::<Vec<_>>(),
        [
            "ddp-comm.test.nccl",
            "ddp-comm.test.nccl_peers",
            "ddp-data.test.tensor"
        ]
    );
    let script = "run_test loader ddp-data.test.tensor 1\n\
                  run_test shim tch-ext.test.cuda 1\n\
                  run_test gone ddp-comm.test.nccl 2\n";
    // tch-ext's test is not listed; ddp-comm's is always bundled but has no file under this
    // root.
    let dir = ddp_testkit::temp_dir("xtask-gpu-extra");
    let tests = dir.path().join("ddp-data/tests");
    std::fs::create_dir_all(&tests).unwrap();
    std::fs::write(tests.join("tensor.rs"), "").unwrap();
    assert_eq!(
        unbundled(script, &listed, dir.path()),
        ["tch-ext.test.cuda", "ddp-comm.test.nccl"]
    );
}

#[test]
fn every_test_binary_gpu_extra_runs_is_in_the_bundle_list() {
    let root = root();
    let script = std::fs::read_to_string(root.join("xtask/gpu-extra.sh")).unwrap();
    let list = std::fs::read_to_string(root.join("gpu-bundle.list")).unwrap();
    assert!(
        script.contains("run_test "),
        "gpu-extra.sh runs no test binary"
    );
    let missing = unbundled(&script, &listed_tests(&list), &root);
    assert!(
        missing.is_empty(),
        "gpu-extra.sh runs {missing:?}, which gpu-bundle.list does not name as `test PACKAGE \
         TARGET` (or whose tests/TARGET.rs does not exist): the GPU machine would skip them"
    );
}

#[test]
fn gpu_extra_is_valid_bash() {
    let script = root().join("xtask/gpu-extra.sh");
    let out = Command::new("bash")
        .arg("-n")
        .arg(&script)
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "bash -n {}: {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}
