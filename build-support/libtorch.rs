// The build scripts' one copy of how a crate that links libtorch finds it, `include!`d by
// the `build.rs` of ddp-comm, ddp-data, ddp-model, ddp-train and tch-ext.
//
// `cargo xtask setup` installs libtorch under `.deps/` and `.cargo/config.toml` points
// `LIBTORCH` there. rustc links with `--as-needed`, and cargo runs binaries, tests, examples
// and doctests with the caller's `LD_LIBRARY_PATH` (it only prepends its own folders), which
// may name another libtorch (tch's README has users export one). So everything linked gets
// a run path to the real (symlink-resolved) library folder, written as `DT_RPATH`
// (`--disable-new-dtags`): the dynamic loader searches it before `LD_LIBRARY_PATH`, where
// it would search a `DT_RUNPATH` after. The libraries' own `$ORIGIN`-relative run paths
// (CUDA, NCCL) then resolve inside the Python wheel they came from.

include!("../shared-src/torch_version.rs");

/// libtorch's library folder, with torch-sys's precedence: `$LIBTORCH_LIB/lib`, else
/// `$LIBTORCH/lib`, symlinks resolved; `None` when neither variable is set. Ends the build
/// script (see [`libtorch_missing`]) when the folder holds no `libtorch_cpu.so`: else
/// torch-sys's C++ compile fails first, on a missing header, without a word of the setup.
///
/// The variables keep their value when setup re-creates the venv (another Python, another
/// `site-packages`), so the script also reruns when the resolved folder's `libtorch_cpu.so`
/// or `build-version` (which setup writes last) changes: else binaries keep an rpath to a
/// folder that is gone. A file, not the folder: cargo would scan a folder such as `/usr/lib`
/// (`LIBTORCH_LIB=/usr`) on every build and rerun on any change in it.
#[allow(dead_code)] // Not every build script needs the folder itself.
fn libtorch_lib() -> Option<std::path::PathBuf> {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_LIB");
    let libtorch = std::env::var_os("LIBTORCH").map(std::path::PathBuf::from);
    let root = std::env::var_os("LIBTORCH_LIB").map(std::path::PathBuf::from);
    let lib = root.or_else(|| libtorch.clone())?.join("lib");
    let lib = std::fs::canonicalize(&lib).unwrap_or(lib);
    if !lib.join("libtorch_cpu.so").is_file() {
        libtorch_missing(&format!("'{}' holds no libtorch_cpu.so", lib.display()));
    }
    let version = libtorch.map(|l| l.join("build-version"));
    // A missing path would rerun the script on every build; once it exists, it is watched.
    for watched in std::iter::once(lib.join("libtorch_cpu.so")).chain(version) {
        if watched.exists() {
            println!("cargo:rerun-if-changed={}", watched.display());
        }
    }
    Some(lib)
}

/// Ends the build script: `error: libtorch not found: <what>`, and what to set, in this
/// workspace and in a user's own project.
#[allow(dead_code)] // xtask's test of `rpath_lines` includes this file too.
fn libtorch_missing(what: &str) -> ! {
    eprintln!(
        "error: libtorch not found: {what}\n\
         - in this workspace: run `cargo xtask setup` (it installs torch {TORCH_VERSION} into \
         .deps/, where .cargo/config.toml points LIBTORCH)\n\
         - in your own project: point LIBTORCH at a libtorch {TORCH_VERSION} folder (holding \
         include/ and lib/), such as a torch wheel's: export LIBTORCH=$(python3 -c 'import \
         torch, os; print(os.path.dirname(torch.__file__))'); LIBTORCH_USE_PYTORCH or a \
         libtorch in /usr serves tch alone, not tch-ext's C++, which needs LIBTORCH"
    );
    std::process::exit(1)
}

/// Adds the run-time path to libtorch's library folder to everything this crate links; warns
/// and adds none when the folder cannot be one (see [`rpath_lines`]).
#[allow(dead_code)] // xtask's test of `rpath_lines` includes this file too.
fn libtorch_rpath() {
    if let Some(lib) = libtorch_lib() {
        match rpath_lines(&lib) {
            Ok(lines) => lines.iter().for_each(|line| println!("{line}")),
            // Built without the run path, the binaries still find libtorch through
            // LD_LIBRARY_PATH or a system-wide install.
            Err(message) => println!(
                "cargo:warning={message}; building without a run path: set LD_LIBRARY_PATH to \
                 the folder to run what is built"
            ),
        }
    }
}

/// The build-script lines that give the linker the run path `lib`, as `DT_RPATH`
/// (`--disable-new-dtags`, see the top of this file): each word its own argument, through
/// `-Xlinker`, since the compiler driver splits `-Wl,` at commas (a clone under
/// `/home/u/exp,v2`). An error when `lib` holds a `:`, which the dynamic loader reads as
/// a separator between run paths.
fn rpath_lines(lib: &std::path::Path) -> Result<Vec<String>, String> {
    let lib = lib.display().to_string();
    if lib.contains(':') {
        return Err(format!(
            "libtorch's library folder '{lib}' contains ':', which the dynamic loader reads as \
             a separator between run paths: move it (or the checkout, for `.deps`) to a path \
             without ':' and point LIBTORCH there"
        ));
    }
    Ok([
        "-Xlinker",
        "--disable-new-dtags",
        "-Xlinker",
        "-rpath",
        "-Xlinker",
        &lib,
    ]
        .iter()
        .map(|arg| format!("cargo:rustc-link-arg={arg}"))
        .collect())
}
