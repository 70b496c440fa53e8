//! Checks the Architecture Invariants of `ARCHITECTURE.md` that can be checked mechanically.

use std::path::Path;
use std::process::Command;

/// The standard output of `cargo` with `args`, run in the workspace root, which must succeed.
fn cargo_stdout(args: &[&str]) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root)
        .args(args)
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The names of every package in `package`'s normal and build dependency tree, with the
/// package's features chosen by `features` (e.g. `["--no-default-features"]`; empty for the
/// defaults).
fn dependency_names(package: &str, features: &[&str]) -> Vec<String> {
    let mut args = vec![
        "tree",
        "--offline",
        "-p",
        package,
        "-e",
        "normal,build",
        "--prefix",
        "none",
    ];
    args.extend(features);
    cargo_stdout(&args)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

/// Asserts that `package`'s tree holds `witness` (so it really was listed) and none of
/// `forbidden`, saying `why` otherwise.
fn assert_tree_excludes(package: &str, witness: &str, forbidden: &[&str], why: &str) {
    assert_tree_with_features_excludes(package, &[], witness, forbidden, why);
}

/// [`assert_tree_excludes`] for `package` built with the feature options `features`.
fn assert_tree_with_features_excludes(
    package: &str,
    features: &[&str],
    witness: &str,
    forbidden: &[&str],
    why: &str,
) {
    let deps = dependency_names(package, features);
    assert!(
        deps.iter().any(|d| d == witness),
        "unexpected tree of {package} {features:?}: {deps:?}"
    );
    for name in forbidden {
        assert!(
            !deps.iter().any(|d| d == name),
            "{package} {features:?} pulls in {name}, but {why}: {deps:?}"
        );
    }
}

const TCH: &[&str] = &["tch", "torch-sys"];

#[test]
fn sampler_does_not_depend_on_tch() {
    assert_tree_excludes(
        "ddp-sampler",
        "rand_chacha",
        TCH,
        "the sampler must work without libtorch",
    );
}

#[test]
fn xtask_does_not_depend_on_tch() {
    assert_tree_excludes(
        "xtask",
        "clap",
        TCH,
        "xtask installs libtorch, so it must build before libtorch exists",
    );
}

#[test]
fn the_launcher_does_not_depend_on_tch() {
    assert_tree_excludes(
        "ddp-run",
        "signal-hook",
        TCH,
        "a launcher starts any program and must build anywhere",
    );
}

#[test]
fn xtask_builds_nothing_heavy() {
    assert_tree_excludes(
        "xtask",
        "ddp-run",
        &[
            "ddp-data",
            "image",
            "zune-jpeg",
            "mozjpeg-sys",
            "calamine",
            "plotters",
        ],
        "a fresh clone's first `cargo xtask` would compile it",
    );
}

/// The crates of ODIR's data stack, spelled as cargo tree prints them.
const ODIR_STACK: [&str; 6] = [
    "image",
    "zune-jpeg",
    "mozjpeg-sys",
    "calamine",
    "csv",
    "fast_image_resize",
];

/// Asserts that `package` with default features lists every one of `optional` (so the names
/// are right and the test can fail), and with `lean` (feature options) none of them, but
/// `witness`.
fn assert_features_drop(package: &str, lean: &[&str], witness: &str, optional: &[&str], why: &str) {
    let full = dependency_names(package, &[]);
    for name in optional {
        assert!(full.iter().any(|d| d == name), "{name} not in {full:?}");
    }
    assert_tree_with_features_excludes(package, lean, witness, optional, why);
}

#[test]
fn the_generic_data_loader_needs_no_image_or_spreadsheet_crate() {
    // `tch` is the witness that the feature options really reached ddp-data.
    assert_features_drop(
        "ddp-data",
        &["--no-default-features", "--features", "tch"],
        "tch",
        &ODIR_STACK,
        "ddp-data without its `odir` feature is the generic loader",
    );
}

#[test]
fn the_training_core_builds_no_odir_stack() {
    let mut heavy = ODIR_STACK.to_vec();
    heavy.extend(["clap", "plotters"]);
    assert_features_drop(
        "ddp-train",
        &["--no-default-features"],
        "ddp-comm",
        &heavy,
        "a project that trains its own model depends on the core without default features",
    );
}

/// A link in a published crate's page on crates.io leads somewhere: ddp-run, the one crate
/// published, names no address on a reserved placeholder domain (RFC 2606) in its metadata,
/// and every other crate is kept from publication.
#[test]
fn the_published_crate_names_no_placeholder_address() {
    let text = cargo_stdout(&[
        "metadata",
        "--offline",
        "--no-deps",
        "--format-version",
        "1",
    ]);
    let metadata: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut published = Vec::new();
    for package in metadata["packages"].as_array().unwrap() {
        let name = package["name"].as_str().unwrap();
        // `publish`: null for any registry, [] for none.
        if package["publish"].as_array().is_some_and(Vec::is_empty) {
            continue;
        }
        published.push(name);
        for field in ["repository", "homepage", "documentation"] {
            let Some(url) = package[field].as_str() else {
                continue;
            };
            let host = url
                .split("://")
                .nth(1)
                .unwrap_or(url)
                .split('/')
                .next()
                .unwrap();
            let placeholder = [".invalid", ".example", ".test", ".localhost"]
                .iter()
                .any(|tld| host.ends_with(tld))
                || ["example.com", "example.org", "example.net"]
                    .iter()
                    .any(|d| host == *d || host.ends_with(&format!(".{d}")));
            assert!(!placeholder, "{name}'s {field} is a placeholder: {url}");
        }
    }
    assert_eq!(published, ["ddp-run"]);
}
