// The build scripts' one copy of how a crate that links libtorch finds it, `include!`d by
// the `build.rs` of ddp-comm, ddp-data, ddp-model, ddp-train and tch-ext.
//
// `cargo xtask setup` installs libtorch under `.deps/` and `.cargo/config.toml` points
// `LIBTORCH` there; a user's project may name its own, or set `LIBTORCH_USE_PYTORCH` for the
// active Python's torch: `libtorch()` takes the one torch-sys takes. rustc links with
// `--as-needed`, and cargo runs binaries, tests, examples and doctests with the caller's
// `LD_LIBRARY_PATH` (it only prepends its own folders), which may name another libtorch
// (tch's README has users export one). So everything linked gets a run path to the real
// (symlink-resolved) library folder, written as `DT_RPATH` (`--disable-new-dtags`): the
// dynamic loader searches it before `LD_LIBRARY_PATH`, where it would search a `DT_RUNPATH`
// after. The libraries' own `$ORIGIN`-relative run paths
// (CUDA, NCCL) then resolve inside the Python wheel they came from.

include!("../shared-src/torch_version.rs");

/// The libtorch torch-sys compiles and links tch against: the folders its headers are
/// included from, its library folder (symlinks resolved) and its `_GLIBCXX_USE_CXX11_ABI`.
/// tch-ext's C++ must use all three alike, and every crate's run path names `lib`.
#[allow(dead_code)] // Most build scripts need the folder only.
struct Libtorch {
    includes: Vec<std::path::PathBuf>,
    lib: std::path::PathBuf,
    cxx11_abi: String,
}

/// Finds libtorch with torch-sys 0.26's precedence: whenever `LIBTORCH_USE_PYTORCH` is set
/// (to anything), the active Python's torch ([`python_torch`]), and `LIBTORCH` and the
/// variables below are ignored; else `LIBTORCH`, whose `include/` and `lib/`
/// `LIBTORCH_INCLUDE` and `LIBTORCH_LIB` replace, with `LIBTORCH_CXX11_ABI` (default `1`).
/// `None` when neither `LIBTORCH` nor `LIBTORCH_LIB` is set (torch-sys then looks in `/usr`).
/// Ends the build script (see [`libtorch_missing`]) when the library folder holds no
/// `libtorch_cpu.so`: else torch-sys's C++ compile fails first, on a missing header, without
/// a word of the setup.
///
/// The variables keep their value when setup re-creates the venv (another Python, another
/// `site-packages`), so the script also reruns when the resolved folder's `libtorch_cpu.so`
/// or `build-version` (which setup writes last) changes: else binaries keep an rpath to a
/// folder that is gone. A file, not the folder: cargo would scan a folder such as `/usr/lib`
/// (`LIBTORCH_LIB=/usr`) on every build and rerun on any change in it. Another Python made
/// active (`VIRTUAL_ENV`, `PATH`) reruns neither torch-sys's script nor this one, so the
/// two keep agreeing.
#[allow(dead_code)] // xtask's test of `rpath_lines` includes this file too.
fn libtorch() -> Option<Libtorch> {
    for name in [
        "LIBTORCH_USE_PYTORCH",
        "LIBTORCH",
        "LIBTORCH_INCLUDE",
        "LIBTORCH_LIB",
        "LIBTORCH_CXX11_ABI",
    ] {
        println!("cargo:rerun-if-env-changed={name}");
    }
    let var = |name: &str| std::env::var_os(name).map(std::path::PathBuf::from);
    // `var`, not `var_os`: torch-sys takes a value that is not Unicode for unset.
    let (found, version) = if std::env::var("LIBTORCH_USE_PYTORCH").is_ok() {
        (python_torch(), None)
    } else {
        let libtorch = var("LIBTORCH");
        let root = var("LIBTORCH_LIB").or_else(|| libtorch.clone())?;
        // Without LIBTORCH, torch-sys builds only with the libtorch in `/usr`.
        let include = var("LIBTORCH_INCLUDE")
            .or_else(|| libtorch.clone())
            .unwrap_or_else(|| "/usr".into())
            .join("include");
        let found = Libtorch {
            includes: vec![include.clone(), include.join("torch/csrc/api/include")],
            lib: root.join("lib"),
            cxx11_abi: std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned()),
        };
        (found, libtorch.map(|l| l.join("build-version")))
    };
    let lib = std::fs::canonicalize(&found.lib).unwrap_or(found.lib);
    // A static libtorch (torch-sys's LIBTORCH_STATIC) has the archive instead.
    if !["libtorch_cpu.so", "libtorch_cpu.a"]
        .iter()
        .any(|name| lib.join(name).is_file())
    {
        libtorch_missing(&format!("'{}' holds no libtorch_cpu.so", lib.display()));
    }
    // A missing path would rerun the script on every build; once it exists, it is watched.
    for watched in std::iter::once(lib.join("libtorch_cpu.so")).chain(version) {
        if watched.exists() {
            println!("cargo:rerun-if-changed={}", watched.display());
        }
    }
    Some(Libtorch { lib, ..found })
}

/// The torch of the Python torch-sys runs: `python` in a virtual environment (`VIRTUAL_ENV`
/// set), else `python3`, found on `PATH`. Its headers, library folder and ABI are what
/// `torch.utils.cpp_extension` and `torch._C._GLIBCXX_USE_CXX11_ABI` say, read from the lines
/// of the snippet torch-sys runs (the last library folder, as torch-sys takes).
fn python_torch() -> Libtorch {
    const SNIPPET: &str = "import torch\n\
        from torch.utils import cpp_extension\n\
        print('LIBTORCH_CXX11:', torch._C._GLIBCXX_USE_CXX11_ABI)\n\
        for p in cpp_extension.include_paths(): print('LIBTORCH_INCLUDE:', p)\n\
        for p in cpp_extension.library_paths(): print('LIBTORCH_LIB:', p)\n";
    let python = match std::env::var_os("VIRTUAL_ENV") {
        Some(_) => "python",
        None => "python3",
    };
    let out = match std::process::Command::new(python)
        .args(["-c", SNIPPET])
        .output()
    {
        Ok(out) => out,
        Err(e) => libtorch_missing(&format!(
            "LIBTORCH_USE_PYTORCH is set, and `{python}` does not run: {e}"
        )),
    };
    let (mut includes, mut lib, mut cxx11_abi) = (Vec::new(), None, None);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        match line.split_once(": ") {
            Some(("LIBTORCH_CXX11", "True")) => cxx11_abi = Some("1"),
            Some(("LIBTORCH_CXX11", "False")) => cxx11_abi = Some("0"),
            Some(("LIBTORCH_INCLUDE", path)) => includes.push(path.into()),
            Some(("LIBTORCH_LIB", path)) => lib = Some(std::path::PathBuf::from(path)),
            _ => {}
        }
    }
    match (lib, cxx11_abi) {
        (Some(lib), Some(abi)) => Libtorch {
            includes,
            lib,
            cxx11_abi: abi.to_owned(),
        },
        _ => libtorch_missing(&format!(
            "LIBTORCH_USE_PYTORCH is set, and `{python}` (the active Python) names no torch: \
             {}",
            String::from_utf8_lossy(&out.stderr)
                .trim_end()
                .lines()
                .last()
                .unwrap_or("")
        )),
    }
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
         torch, os; print(os.path.dirname(torch.__file__))'); or set LIBTORCH_USE_PYTORCH=1 to \
         take the torch {TORCH_VERSION} of the active Python (`python` in a virtual \
         environment, else `python3`), as tch does. A libtorch in /usr serves tch alone, not \
         tch-ext's C++"
    );
    std::process::exit(1)
}

/// Adds the run-time path to libtorch's library folder to everything this crate links (see
/// [`libtorch_rpath_to`]).
#[allow(dead_code)] // xtask's test of `rpath_lines` includes this file too.
fn libtorch_rpath() {
    if let Some(found) = libtorch() {
        libtorch_rpath_to(&found.lib);
    }
}

/// Adds the run-time path `lib` to everything this crate links; warns and adds none when the
/// folder cannot be one (see [`rpath_lines`]).
#[allow(dead_code)] // xtask's test of `rpath_lines` includes this file too.
fn libtorch_rpath_to(lib: &std::path::Path) {
    match rpath_lines(lib) {
        Ok(lines) => lines.iter().for_each(|line| println!("{line}")),
        // Built without the run path, the binaries still find libtorch through
        // LD_LIBRARY_PATH or a system-wide install.
        Err(message) => println!(
            "cargo:warning={message}; building without a run path: set LD_LIBRARY_PATH to \
             the folder to run what is built"
        ),
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
