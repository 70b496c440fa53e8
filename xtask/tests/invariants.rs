//! Checks the Architecture Invariants of `ARCHITECTURE.md` that can be checked mechanically.

use std::path::Path;
use std::process::Command;

/// The names of every package in `package`'s normal and build dependency tree.
fn dependency_names(package: &str) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root)
        .args([
            "tree",
            "--offline",
            "-p",
            package,
            "-e",
            "normal,build",
            "--prefix",
            "none",
        ])
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[test]
fn sampler_does_not_depend_on_tch() {
    let deps = dependency_names("ddp-sampler");
    // The tree really was listed: the sampler's own random source is in it.
    assert!(
        deps.iter().any(|d| d == "rand_chacha"),
        "unexpected tree: {deps:?}"
    );
    assert!(
        !deps.iter().any(|d| d == "tch" || d == "torch-sys"),
        "ddp-sampler pulls in tch: {deps:?}"
    );
}

#[test]
fn xtask_does_not_depend_on_tch() {
    let deps = dependency_names("xtask");
    assert!(
        deps.iter().any(|d| d == "clap"),
        "unexpected tree: {deps:?}"
    );
    assert!(
        !deps.iter().any(|d| d == "tch" || d == "torch-sys"),
        "xtask pulls in tch: {deps:?}"
    );
}

#[test]
fn the_launcher_does_not_depend_on_tch() {
    let deps = dependency_names("ddp-run");
    assert!(
        deps.iter().any(|d| d == "signal-hook"),
        "unexpected tree: {deps:?}"
    );
    assert!(
        !deps.iter().any(|d| d == "tch" || d == "torch-sys"),
        "ddp-run pulls in tch: {deps:?}"
    );
}

#[test]
fn xtask_builds_nothing_heavy() {
    let deps = dependency_names("xtask");
    assert!(
        deps.iter().any(|d| d == "ddp-run"),
        "unexpected tree: {deps:?}"
    );
    for heavy in [
        "ddp-data",
        "image",
        "zune-jpeg",
        "mozjpeg-sys",
        "calamine",
        "plotters",
    ] {
        assert!(
            !deps.iter().any(|d| d == heavy),
            "xtask pulls in {heavy}, which a fresh clone's first `cargo xtask` would compile: \
             {deps:?}"
        );
    }
}
