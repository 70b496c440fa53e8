//! Architecture invariant: ddp-sampler does not depend on tch (or anything else heavy), so
//! it builds and tests on machines without libtorch.

use std::process::Command;

#[test]
fn ddp_sampler_does_not_depend_on_tch() {
    let output = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--offline",
            "--package",
            "ddp-sampler",
            "--edges",
            "normal,build",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo starts");
    assert!(
        output.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let tree = String::from_utf8(output.stdout).expect("cargo tree prints UTF-8");
    let packages: Vec<&str> = tree
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .collect();
    assert_eq!(packages.first(), Some(&"ddp-sampler"), "tree was:\n{tree}");
    assert!(packages.contains(&"rand_chacha"), "tree was:\n{tree}");
    for forbidden in ["tch", "torch-sys"] {
        assert!(
            !packages.contains(&forbidden),
            "ddp-sampler depends on {forbidden}:\n{tree}"
        );
    }
}
