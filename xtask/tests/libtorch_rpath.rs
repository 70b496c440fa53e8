//! `build-support/libtorch.rs`, the rpath every crate that links libtorch bakes in, follows
//! setup when it re-creates the venv: `LIBTORCH` keeps its value, the folder it leads to
//! does not.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ddp_testkit::TempDir;

// The build scripts' code, to call its parts directly.
include!("../../build-support/libtorch.rs");

/// A temporary folder `label` (symlinks resolved), kept while the first value lives, and in
/// it a crate `scratch` whose build script includes `build-support/libtorch.rs` and runs
/// `build_main`, and whose `src/main.rs` is `main_rs`.
fn scratch_crate(label: &str, build_main: &str, main_rs: &str) -> (TempDir, PathBuf, PathBuf) {
    let guard = ddp_testkit::temp_dir(label);
    let dir = fs::canonicalize(guard.path()).unwrap();
    let support = Path::new(env!("CARGO_MANIFEST_DIR")).join("../build-support/libtorch.rs");
    let krate = dir.join("scratch");
    fs::create_dir_all(krate.join("src")).unwrap();
    fs::write(
        krate.join("Cargo.toml"),
        "[package]\nname = \"scratch\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n[workspace]\n",
    )
    .unwrap();
    fs::write(krate.join("src/main.rs"), main_rs).unwrap();
    fs::write(
        krate.join("build.rs"),
        format!(
            "include!({:?});\nfn main() {{\n{build_main}\n}}\n",
            fs::canonicalize(support).unwrap()
        ),
    )
    .unwrap();
    (guard, dir, krate)
}

/// `cargo build -v` of the crate in `dir` with `LIBTORCH` = `libtorch`.
fn build(dir: &Path, libtorch: &Path) -> Output {
    build_with(dir, |cmd| {
        cmd.env("LIBTORCH", libtorch);
    })
}

/// `cargo build -v` of the crate in `dir` without torch-sys's other variables, in the
/// environment `env` makes.
fn build_with(dir: &Path, env: impl FnOnce(&mut Command)) -> Output {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(dir)
        .args(["build", "--offline", "-v"])
        .env("CARGO_TARGET_DIR", dir.join("target"));
    for name in ["LIBTORCH_LIB", "LIBTORCH_INCLUDE", "LIBTORCH_USE_PYTORCH"] {
        cmd.env_remove(name);
    }
    env(&mut cmd);
    cmd.output().unwrap()
}

/// Builds the crate in `dir` with `LIBTORCH` = `libtorch` and returns the run paths of its
/// binary, as `readelf -d` lists them, and whether its build script ran.
fn build_and_read_run_paths(dir: &Path, libtorch: &Path) -> (String, bool) {
    read_run_paths(dir, &build(dir, libtorch))
}

/// The run paths of the binary that `out`, a build of the crate in `dir`, made, as
/// `readelf -d` lists them, and whether its build script ran.
fn read_run_paths(dir: &Path, out: &Output) -> (String, bool) {
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

/// Compiles C `source` into the shared library `so` with the system's C compiler.
fn shared_library(so: &Path, source: &str) {
    let c = so.with_extension("c");
    fs::write(&c, source).unwrap();
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(so)
        .arg(&c)
        .status()
        .expect("cc (a C compiler) runs");
    assert!(status.success(), "cc failed on {}", c.display());
}

#[test]
fn a_venv_made_again_elsewhere_is_the_binaries_new_run_path() {
    let (_guard, tmp, krate) =
        scratch_crate("libtorch-rpath", "    libtorch_rpath();", "fn main() {}\n");

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
    // DT_RPATH, which the loader searches before LD_LIBRARY_PATH; DT_RUNPATH comes after.
    assert!(first.contains("(RPATH)"), "{first}");
    assert!(!first.contains("(RUNPATH)"), "{first}");

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
fn libtorch_use_pytorch_takes_the_active_pythons_torch_as_torch_sys_does() {
    let (_guard, tmp, krate) = scratch_crate(
        "libtorch-rpath-python",
        "    let found = libtorch().unwrap();\n    \
         println!(\"cargo:warning=abi {} includes {:?}\", found.cxx11_abi, found.includes);\n    \
         libtorch_rpath_to(&found.lib);",
        "fn main() {}\n",
    );
    // setup's venv, active as its `bin/activate` makes it: VIRTUAL_ENV, and `bin` first on
    // PATH, where torch-sys finds `python`.
    let venv = Path::new(ddp_testkit::setup_python().get_program())
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .to_owned();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path =
        std::env::join_paths(std::iter::once(venv.join("bin")).chain(std::env::split_paths(&path)))
            .unwrap();
    let torch = ddp_testkit::setup_python()
        .args([
            "-c",
            "import os, torch; print(os.path.dirname(os.path.abspath(torch.__file__)))",
        ])
        .output()
        .unwrap();
    assert!(torch.status.success(), "{torch:?}");
    let torch = PathBuf::from(String::from_utf8(torch.stdout).unwrap().trim_end());
    let lib = fs::canonicalize(torch.join("lib")).unwrap();
    let includes = format!(
        "abi 1 includes [{:?}, {:?}]",
        torch.join("include"),
        torch.join("include/torch/csrc/api/include")
    );
    // Another libtorch, with the other ABI, named as well: torch-sys ignores both then.
    let other = tmp.join("libtorch");
    fs::create_dir_all(other.join("lib")).unwrap();
    fs::write(other.join("lib/libtorch_cpu.so"), "").unwrap();

    for libtorch in [None, Some(&other)] {
        let out = build_with(&krate, |cmd| {
            cmd.env("LIBTORCH_USE_PYTORCH", "1")
                .env("VIRTUAL_ENV", &venv)
                .env("PATH", &path)
                .env_remove("PYTHONPATH")
                .env_remove("PYTHONHOME");
            match libtorch {
                Some(other) => cmd.env("LIBTORCH", other).env("LIBTORCH_CXX11_ABI", "0"),
                None => cmd.env_remove("LIBTORCH"),
            };
        });
        let (paths, ran) = read_run_paths(&krate, &out);
        assert!(ran);
        assert!(paths.contains("(RPATH)"), "{paths}");
        assert!(paths.contains(&format!("[{}]", lib.display())), "{paths}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(&includes), "{includes:?} not in {stderr}");
    }
}

#[test]
fn the_run_path_is_passed_whole_and_a_colon_is_refused() {
    let lines = rpath_lines(Path::new("/home/u/exp,v2/my venv/torch/lib")).unwrap();
    assert_eq!(
        lines,
        [
            "cargo:rustc-link-arg=-Xlinker",
            "cargo:rustc-link-arg=--disable-new-dtags",
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

#[test]
fn another_libtorch_on_ld_library_path_is_not_the_one_loaded() {
    let (_guard, tmp, krate) = scratch_crate(
        "libtorch-rpath-ld",
        "    libtorch_rpath();\n    \
         println!(\"cargo:rustc-link-search=native={}\", libtorch().unwrap().lib.display());\n    \
         println!(\"cargo:rustc-link-lib=torch_cpu\");",
        "extern \"C\" {\n    fn scratch_which_torch() -> i32;\n}\n\n\
         fn main() {\n    \
         // SAFETY: a C function without arguments, defined by both libraries.\n    \
         println!(\"{}\", unsafe { scratch_which_torch() });\n}\n",
    );
    // Ours, and another (a user's `export LD_LIBRARY_PATH=/path/to/libtorch/lib`), each
    // saying which it is.
    let libtorch = tmp.join("libtorch");
    fs::create_dir_all(libtorch.join("lib")).unwrap();
    let which = |n: u8| format!("int scratch_which_torch(void) {{ return {n}; }}\n");
    shared_library(&libtorch.join("lib/libtorch_cpu.so"), &which(1));
    let other = tmp.join("other");
    fs::create_dir_all(&other).unwrap();
    shared_library(&other.join("libtorch_cpu.so"), &which(2));

    let (paths, _) = build_and_read_run_paths(&krate, &libtorch);
    assert!(paths.contains("(RPATH)"), "{paths}");
    let out = Command::new(krate.join("target/debug/scratch"))
        .env("LD_LIBRARY_PATH", &other)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "1\n");
}

#[test]
fn a_missing_libtorch_stops_the_build_naming_the_setup() {
    let (_guard, tmp, krate) = scratch_crate(
        "libtorch-rpath-missing",
        "    libtorch_rpath();",
        "fn main() {}\n",
    );
    // A fresh clone: `.cargo/config.toml`'s LIBTORCH names a folder setup has not made.
    let empty = tmp.join("libtorch");
    fs::create_dir_all(&empty).unwrap();
    let out = build(&krate, &empty);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lib = empty.join("lib");
    for expected in [
        format!(
            "error: libtorch not found: '{}' holds no libtorch_cpu.so",
            lib.display()
        ),
        format!("run `cargo xtask setup` (it installs torch {TORCH_VERSION} into .deps/"),
        format!("point LIBTORCH at a libtorch {TORCH_VERSION} folder"),
    ] {
        assert!(stderr.contains(&expected), "{expected:?} not in {stderr}");
    }
}
