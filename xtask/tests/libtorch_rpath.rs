//! `build-support/libtorch.rs`, the rpath every crate that links libtorch bakes in, follows
//! setup when it re-creates the venv: `LIBTORCH` keeps its value, the folder it leads to
//! does not.

use std::fs;
use std::path::Path;
use std::process::Command;

// The build scripts' code, to call its parts directly.
include!("../../build-support/libtorch.rs");

/// Builds the crate in `dir` with `LIBTORCH` = `libtorch` and returns the run paths of its
/// binary, as `readelf -d` lists them, and whether its build script ran.
fn build_and_read_run_paths(dir: &Path, libtorch: &Path) -> (String, bool) {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(dir)
        .args(["build", "--offline", "-v"])
        .env("CARGO_TARGET_DIR", dir.join("target"))
        .env("LIBTORCH", libtorch)
        .env_remove("LIBTORCH_LIB")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo build failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let script_ran = String::from_utf8_lossy(&out.stderr)
        .lines()
        .any(|l| l.contains("Running") && l.contains("build-script-build"));
    let elf = dir.join("target/debug/scratch");
    let out = Command::new("readelf")
        .arg("-d")
        .arg(&elf)
        .output()
        .expect("readelf (binutils) runs");
    assert!(out.status.success(), "readelf -d {} failed", elf.display());
    let paths = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| l.contains("(RUNPATH)") || l.contains("(RPATH)"))
        .collect::<Vec<_>>()
        .join("\n");
    (paths, script_ran)
}

#[test]
fn a_venv_made_again_elsewhere_is_the_binaries_new_run_path() {
    let tmp = ddp_testkit::temp_dir("libtorch-rpath");
    let tmp = fs::canonicalize(tmp.path()).unwrap();
    let support = Path::new(env!("CARGO_MANIFEST_DIR")).join("../build-support/libtorch.rs");
    let krate = tmp.join("scratch");
    fs::create_dir_all(krate.join("src")).unwrap();
    fs::write(
        krate.join("Cargo.toml"),
        "[package]\nname = \"scratch\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[workspace]\n",
    )
    .unwrap();
    fs::write(krate.join("src/main.rs"), "fn main() {}\n").unwrap();
    fs::write(
        krate.join("build.rs"),
        format!(
            "include!({:?});\nfn main() {{\n    libtorch_rpath();\n}}\n",
            fs::canonicalize(support).unwrap()
        ),
    )
    .unwrap();

    // What setup makes: `.deps/libtorch/lib` links into the venv, `build-version` last.
    let libtorch = tmp.join("deps/libtorch");
    fs::create_dir_all(&libtorch).unwrap();
    let install = |venv: &str| {
        let lib = tmp.join(venv).join("lib");
        fs::create_dir_all(&lib).unwrap();
        fs::write(lib.join("libtorch_cpu.so"), "").unwrap();
        let link = libtorch.join("lib");
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link).unwrap();
        fs::write(libtorch.join("build-version"), "2.13.0\n").unwrap();
        lib
    };
    // A comma in the folder: `-Wl,-rpath,<folder>` would split it into two arguments.
    let a = install("a,v2");
    let (first, ran) = build_and_read_run_paths(&krate, &libtorch);
    assert!(ran);
    assert!(first.contains(&format!("[{}]", a.display())), "{first}");

    // Another file in the folder (a package manager's, in `/usr/lib`) reruns nothing.
    fs::write(a.join("libunrelated.so"), "").unwrap();
    let (same, ran) = build_and_read_run_paths(&krate, &libtorch);
    assert!(!ran, "the build script ran again");
    assert_eq!(same, first);

    // The venv made again with another Python: the old folder is gone.
    fs::remove_dir_all(tmp.join("a,v2")).unwrap();
    let b = install("b");
    let (second, ran) = build_and_read_run_paths(&krate, &libtorch);
    assert!(ran);
    assert!(second.contains(&format!("[{}]", b.display())), "{second}");
    assert!(!second.contains(&a.display().to_string()), "{second}");
}

#[test]
fn the_run_path_is_passed_whole_and_a_colon_is_refused() {
    let lines = rpath_lines(Path::new("/home/u/exp,v2/my venv/torch/lib")).unwrap();
    assert_eq!(
        lines,
        [
            "cargo:rustc-link-arg=-Xlinker",
            "cargo:rustc-link-arg=-rpath",
            "cargo:rustc-link-arg=-Xlinker",
            "cargo:rustc-link-arg=/home/u/exp,v2/my venv/torch/lib",
        ]
    );
    let error = rpath_lines(Path::new("/data/run:2/torch/lib")).unwrap_err();
    assert!(
        error.starts_with("libtorch's library folder '/data/run:2/torch/lib' contains ':'"),
        "{error}"
    );
}
