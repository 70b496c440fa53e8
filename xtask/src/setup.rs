//! `cargo xtask setup`: installs libtorch (from the `torch` Python wheel) into `.deps/`.
//!
//! Layout made here, all git-ignored:
//!
//! ```text
//! .deps/venv/                 a Python virtual environment holding torch==TORCH_VERSION
//! .deps/libtorch/include  ->  .deps/venv/.../site-packages/torch/include
//! .deps/libtorch/lib      ->  .deps/venv/.../site-packages/torch/lib
//! .deps/libtorch/build-version   "2.13.0", written last: the install's completion marker
//! .deps/tmp/                  pip's TMPDIR while it installs (unless TMPDIR is set)
//! .deps.lock                  locked while a setup runs, so that two at once take turns
//! ```
//!
//! `.cargo/config.toml` points `LIBTORCH` at `.deps/libtorch`, so torch-sys needs no Python
//! at build time, and it checks `build-version` against the version tch expects.

use std::ffi::OsString;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

include!("../../shared-src/venv_python.rs");

/// The libtorch version tch 0.26 binds.
pub const TORCH_VERSION: &str = "2.13.0";

/// Python packages installed next to torch, for the tests and benchmarks that compare with
/// the PyTorch ecosystem: `safetensors` lets Python read our checkpoints, `numpy` silences
/// torch's warning when tensors cross into Python, torchvision is the reference for models
/// and transforms, scikit-learn for the ODIR challenge's metrics.
const EXTRA_PACKAGES: &[&str] = &[
    "safetensors",
    "numpy",
    // The release built against torch TORCH_VERSION.
    "torchvision==0.28.0",
    "scikit-learn",
];

/// Where the setup step puts things, relative to the project root.
#[derive(Debug, Clone)]
pub struct Deps {
    /// `.deps/`
    pub root: PathBuf,
}

impl Deps {
    pub fn new(project_root: &Path) -> Self {
        Self {
            root: project_root.join(".deps"),
        }
    }

    pub fn venv(&self) -> PathBuf {
        self.root.join("venv")
    }

    /// The virtual environment's Python interpreter.
    pub fn python(&self) -> PathBuf {
        self.venv().join("bin").join("python")
    }

    pub fn libtorch(&self) -> PathBuf {
        self.root.join("libtorch")
    }

    /// `.deps.lock`, beside `.deps/` (which `--reinstall` removes) so that one file stays
    /// the lock across a reinstall.
    fn lock_file(&self) -> PathBuf {
        let mut name = self.root.file_name().unwrap_or_default().to_owned();
        name.push(".lock");
        self.root.with_file_name(name)
    }

    fn version_file(&self) -> PathBuf {
        self.libtorch().join("build-version")
    }

    /// Lists the extra packages the venv was given, one per line, written after pip
    /// installed them; a different list means they are installed again.
    fn extras_file(&self) -> PathBuf {
        self.venv().join("ddp-extras")
    }

    fn extras_installed(&self) -> bool {
        fs::read_to_string(self.extras_file()).is_ok_and(|s| s == extras_marker())
    }

    /// The installed libtorch version, if a complete install is present: `libtorch/lib` is
    /// the torch of the venv's own `site-packages` (not one a former Python left behind, as
    /// when the base interpreter of a Debian venv moves to another minor version).
    pub fn installed_version(&self) -> Option<String> {
        let version = fs::read_to_string(self.version_file()).ok()?;
        let lib = fs::canonicalize(self.libtorch().join("lib")).ok()?;
        let venv_lib = site_packages(self)
            .ok()
            .and_then(|site| fs::canonicalize(site.join("torch").join("lib")).ok());
        // An empty marker is one a power loss cut short after its rename.
        let complete = lib.join("libtorch_cpu.so").exists()
            && venv_lib.as_ref() == Some(&lib)
            && !version.trim().is_empty();
        complete.then(|| version.trim().to_owned())
    }

    /// Whether [`run`] has work to do: libtorch TORCH_VERSION or the extra packages missing.
    pub fn needs_setup(&self) -> bool {
        self.installed_version().as_deref() != Some(TORCH_VERSION) || !self.extras_installed()
    }
}

/// Options of `cargo xtask setup`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SetupArgs {
    /// Remove `.deps/` first and install from scratch (use after a failed or foreign install).
    #[arg(long)]
    pub reinstall: bool,
}

/// Makes sure libtorch TORCH_VERSION is installed under `.deps/`. Idempotent: a complete
/// install of the right version is left alone and reported in one line.
pub fn run(project_root: &Path, args: &SetupArgs) -> Result<Deps> {
    let deps = Deps::new(project_root);
    warn_of_another_libtorch(&deps);
    // Two commands of a fresh clone started together (`cargo xtask test` in one terminal,
    // `cargo xtask train` in another) would both create the venv and run pip into it.
    let _lock = lock_setup(&deps)?;
    if args.reinstall && deps.root.exists() {
        remove_install(&deps, &deps.root, clear_tree)?;
    }
    match deps.installed_version() {
        Some(v) if v == TORCH_VERSION => {
            if !deps.extras_installed() {
                install_extras(&deps)?;
            }
            println!(
                "setup: libtorch {v} already installed in {}",
                deps.libtorch().display()
            );
            return Ok(deps);
        }
        Some(v) => bail!(
            "{} holds libtorch {v}, but tch needs {TORCH_VERSION}; \
             run `cargo xtask setup --reinstall` to replace it",
            deps.libtorch().display()
        ),
        None => {}
    }

    let python = find_python()?;
    prepare_venv(&deps, &python, std::env::var_os("DDP_PYTHON").is_some())?;

    let site = site_packages(&deps)?;
    let torch = site.join("torch");
    let libtorch_cpu = torch.join("lib").join("libtorch_cpu.so");
    match installed_torch_version(&site)? {
        Some(found) if found != TORCH_VERSION => bail!(
            "{} holds torch {found}, but tch needs {TORCH_VERSION}; \
             run `cargo xtask setup --reinstall` to replace it",
            deps.venv().display()
        ),
        // Only `.deps/libtorch` is missing (a moved checkout's former links, say).
        Some(_) if libtorch_cpu.exists() => {
            if !deps.extras_installed() {
                install_extras(&deps)?;
            }
            println!(
                "setup: linking the torch=={TORCH_VERSION} of {}",
                deps.venv().display()
            );
        }
        _ => {
            println!(
                "setup: installing torch=={TORCH_VERSION} (CUDA build, about 2.6 GB) into {}",
                deps.venv().display()
            );
            let what = format!("torch=={TORCH_VERSION} and {}", EXTRA_PACKAGES.join(", "));
            pip_install(&deps, &what)?;
            if !libtorch_cpu.exists() {
                bail!(
                    "pip reported success but {} has no libtorch_cpu.so; \
                     run `cargo xtask setup --reinstall`",
                    torch.join("lib").display()
                );
            }
            write_extras_marker(&deps)?;
        }
    }
    link_libtorch(&deps, &torch)?;
    println!(
        "setup: libtorch {TORCH_VERSION} ready in {}",
        deps.libtorch().display()
    );
    Ok(deps)
}

/// Takes the exclusive `flock` of [`Deps::lock_file`], waiting while another setup holds it.
fn lock_setup(deps: &Deps) -> Result<Option<fs::File>> {
    let waiting = format!(
        "setup: another `cargo xtask` is setting up {}; waiting for it to finish",
        deps.root.display()
    );
    wait_for_lock(&deps.lock_file(), &waiting)
}

/// Takes an exclusive `flock` on `path` (created if missing), printing `waiting` first if
/// another process holds it, and waiting for it as cargo waits for its build folder. The
/// kernel lets it go when the returned file is dropped or the process ends, however it ends.
/// A file system without locks (some NFS mounts), or whose lock manager gives no answer
/// within [`LOCK_ANSWER`], gets no lock: `None`.
pub fn wait_for_lock(path: &Path, waiting: &str) -> Result<Option<fs::File>> {
    lock_answered_within(path, waiting, LOCK_ANSWER, flock)
}

/// How long [`wait_for_lock`] waits for the file system's first answer: on a `hard` NFS
/// mount whose lock manager (NLM) does not answer, `flock` blocks in the kernel, `LOCK_NB` or
/// not (cargo#2615). "Another process holds it" is an answer: waiting for that holder has no
/// deadline.
const LOCK_ANSWER: std::time::Duration = std::time::Duration::from_secs(10);

include!("../../shared-src/answer_within.rs");

/// `flock(file, how)`.
fn flock(file: &fs::File, how: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor `file` owns; no memory is involved.
    match unsafe { libc::flock(file.as_raw_fd(), how) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// [`wait_for_lock`] with `flock` for the system's, whose first answer is waited for at most
/// `deadline`: its thread is then left behind, holding only a second descriptor of the lock
/// file.
fn lock_answered_within(
    path: &Path,
    waiting: &str,
    deadline: std::time::Duration,
    flock: fn(&fs::File, libc::c_int) -> std::io::Result<()>,
) -> Result<Option<fs::File>> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("cannot open the lock file {}", path.display()))?;
    let try_lock = move |f: &fs::File| flock(f, libc::LOCK_EX | libc::LOCK_NB);
    match answer_within(&file, deadline, try_lock) {
        Some(Ok(())) => return Ok(Some(file)),
        Some(Err(e)) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => println!("{waiting}"),
        Some(Err(_)) => return Ok(None),
        None => {
            println!(
                "xtask: no answer from the file system's lock manager within {} s for {}; \
                 going on without the lock",
                deadline.as_secs_f64(),
                path.display()
            );
            return Ok(None);
        }
    }
    loop {
        match flock(&file, libc::LOCK_EX) {
            Ok(()) => return Ok(Some(file)),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot lock {}", path.display())),
        }
    }
}

fn extras_marker() -> String {
    EXTRA_PACKAGES.iter().map(|p| format!("{p}\n")).collect()
}

fn write_extras_marker(deps: &Deps) -> Result<()> {
    fs::write(deps.extras_file(), extras_marker())
        .with_context(|| format!("cannot write {}", deps.extras_file().display()))
}

/// Installs torch TORCH_VERSION (kept if present) and the extra packages into the venv; pip's
/// messages pass through, and the last few name its reason when it fails (`what` names
/// what was being installed).
fn pip_install(deps: &Deps, what: &str) -> Result<()> {
    pip_install_with_tmpdir(deps, what, std::env::var_os("TMPDIR"))
}

/// [`pip_install`] where the environment's `TMPDIR` is `tmpdir`. pip unpacks the wheels
/// (3 to 4 GB) in `TMPDIR`, by default a `/tmp` that is often a small tmpfs: unless the user
/// chose one, it gets `.deps/tmp`, next to the venv, removed afterwards.
fn pip_install_with_tmpdir(deps: &Deps, what: &str, tmpdir: Option<OsString>) -> Result<()> {
    let (tmp, own) = match tmpdir {
        Some(theirs) if !theirs.is_empty() => (PathBuf::from(theirs), false),
        _ => (deps.root.join("tmp"), true),
    };
    let mut pip = venv_python(&deps.python());
    pip.args(["-m", "pip", "install", "--disable-pip-version-check"])
        .arg(format!("torch=={TORCH_VERSION}"))
        .args(EXTRA_PACKAGES)
        .env("TMPDIR", &tmp)
        .stderr(Stdio::piped());
    if own {
        // What an earlier pip left there when its terminal was lost (no cleanup on SIGHUP).
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    }
    let ran = run_pip(pip);
    if own {
        // Whatever pip left there (it is killed by a full disk, too).
        let _ = fs::remove_dir_all(&tmp);
    }
    let (status, last) = ran?;
    if !status.success() {
        let said: Vec<String> = last.into_iter().map(|l| format!("    {l}")).collect();
        let tmp = if own {
            tmp.display().to_string()
        } else {
            format!("$TMPDIR ({})", tmp.display())
        };
        bail!(
            "pip could not install {what} into {} ({status}); its last words:\n{}\nfix what \
             it names (the torch wheel needs the Python package index and about 8 GB of disk: \
             5 GB installed, and 2.6 GB of downloads in {tmp}, where TMPDIR can point to a \
             folder with room; pip also keeps them in ~/.cache/pip unless \
             PIP_NO_CACHE_DIR=1), then run `cargo xtask setup` again, or `cargo xtask setup \
             --reinstall` to start from a new virtual environment",
            deps.venv().display(),
            said.join("\n")
        );
    }
    Ok(())
}

/// Runs `pip`, its stderr piped, passing its messages through; returns its status and its
/// last five non-empty lines.
fn run_pip(mut pip: Command) -> Result<(std::process::ExitStatus, Vec<String>)> {
    let mut child = pip
        .spawn()
        .context("cannot run pip in the virtual environment")?;
    let mut last = std::collections::VecDeque::new();
    if let Some(stderr) = child.stderr.take() {
        // Read to the end (whatever the bytes), so that pip never blocks on a full pipe.
        for line in BufReader::new(stderr).split(b'\n').map_while(Result::ok) {
            let line = String::from_utf8_lossy(&line).trim_end().to_owned();
            eprintln!("{line}");
            if !line.trim().is_empty() {
                if last.len() == 5 {
                    last.pop_front();
                }
                last.push_back(line);
            }
        }
    }
    let status = child.wait().context("cannot wait for pip")?;
    Ok((status, last.into()))
}

/// Adds the extra packages to an install that predates them (torch itself stays).
fn install_extras(deps: &Deps) -> Result<()> {
    println!(
        "setup: installing {} into {}",
        EXTRA_PACKAGES.join(", "),
        deps.venv().display()
    );
    pip_install(deps, &EXTRA_PACKAGES.join(", "))?;
    write_extras_marker(deps)
}

/// Whether `python` (a venv's interpreter) runs and has a working pip: a venv whose
/// `ensurepip` step failed or was interrupted, or whose base interpreter is gone, has not.
fn venv_usable(python: &Path) -> bool {
    venv_python(python)
        .args(["-m", "pip", "--version"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Makes `.deps/venv` a virtual environment with a working pip, from `python`: one without
/// (see [`venv_usable`]) is removed and created again, and so is one of another Python
/// version than `python` where the user `chose` it (DDP_PYTHON: a failed setup's venv of a
/// Python that torch has no wheel for).
fn prepare_venv(deps: &Deps, python: &str, chose: bool) -> Result<()> {
    let venv = deps.venv();
    // The whole `Python X.Y.Z`: torch's and torchvision's wheels may leave out a patch.
    let version = |p: &Path| {
        let out = Command::new(p).arg("--version").output().ok()?;
        Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let made = venv.symlink_metadata().is_ok();
    let other = chose && made && version(&deps.python()) != version(Path::new(python));
    if venv_usable(&deps.python()) && !other {
        return Ok(());
    }
    if other {
        println!(
            "setup: {} runs another Python than DDP_PYTHON's {python}; creating it again",
            venv.display()
        );
        remove_install(deps, &venv, clear_tree)?;
    } else if made {
        println!(
            "setup: {} has no working pip (an interrupted or failed setup?); creating it again",
            venv.display()
        );
        remove_install(deps, &venv, clear_tree)?;
    } else {
        println!(
            "setup: creating a Python virtual environment in {}",
            venv.display()
        );
    }
    fs::create_dir_all(&deps.root)
        .with_context(|| format!("cannot create {}", deps.root.display()))?;
    let status = venv_python(Path::new(python))
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .with_context(|| format!("cannot run `{python} -m venv`"))?;
    if !status.success() || !venv_usable(&deps.python()) {
        bail!(
            "`{python} -m venv {}` did not make a virtual environment with pip ({status}); \
             install the venv module (Debian/Ubuntu: `apt-get install python3-venv`), then run \
             `cargo xtask setup --reinstall`",
            venv.display()
        );
    }
    Ok(())
}

/// Warns (on stderr) of each variable of the environment that makes torch-sys build against
/// another libtorch than the one setup installs (see [`another_libtorch`]).
pub fn warn_of_another_libtorch(deps: &Deps) {
    for warning in another_libtorch(|name| std::env::var_os(name), &deps.libtorch()) {
        eprintln!("xtask: warning: {warning}");
    }
}

/// What is wrong with the environment's torch-sys variables (`var` reads one) for builds
/// meant to use `ours` (`.deps/libtorch`): `.cargo/config.toml` sets `LIBTORCH` only where
/// the environment has not (a GPU bundle's build exports its own), torch-sys takes the
/// headers from `LIBTORCH_INCLUDE` and the libraries from `LIBTORCH_LIB` over `LIBTORCH`'s,
/// and the active Python's torch whenever `LIBTORCH_USE_PYTORCH` is set. An exported
/// `LIBTORCH_CXX11_ABI` other than `1` builds for the C++ ABI the wheel was not built with.
/// Another libtorch on `LD_LIBRARY_PATH` is no matter: the rpath is a `DT_RPATH`, searched
/// first (`build-support/libtorch.rs`).
fn another_libtorch(var: impl Fn(&str) -> Option<OsString>, ours: &Path) -> Vec<String> {
    let same = |theirs: &Path, ours: &Path| {
        theirs == ours
            || fs::canonicalize(theirs)
                .ok()
                .is_some_and(|t| fs::canonicalize(ours).is_ok_and(|o| o == t))
    };
    let is_ours = |theirs: &Path| same(theirs, ours);
    let mut out = Vec::new();
    for (name, what) in [
        ("LIBTORCH", "that libtorch"),
        ("LIBTORCH_INCLUDE", "that libtorch's headers"),
        ("LIBTORCH_LIB", "that libtorch's libraries"),
    ] {
        let Some(value) = var(name) else { continue };
        let theirs = Path::new(&value);
        if !is_ours(theirs) {
            out.push(format!(
                "{name} is set to `{}` in the environment: builds will use {what} instead of \
                 {} (the one setup installs, {TORCH_VERSION}); unset {name} to use it",
                theirs.display(),
                ours.display()
            ));
        }
    }
    if let Some(value) = var("LIBTORCH_USE_PYTORCH") {
        out.push(format!(
            "LIBTORCH_USE_PYTORCH is set to `{}` in the environment: builds will use the torch \
             of whichever Python is active instead of {} (the one setup installs); unset \
             LIBTORCH_USE_PYTORCH to use it",
            value.to_string_lossy(),
            ours.display()
        ));
    }
    // `.cargo/config.toml`'s `1` does not override an exported value.
    if let Some(value) = var("LIBTORCH_CXX11_ABI").filter(|v| v != "1") {
        out.push(format!(
            "LIBTORCH_CXX11_ABI is set to `{}` in the environment: builds will use the old C++ \
             ABI, and linking with {} (built with the new one) fails with undefined \
             references; unset LIBTORCH_CXX11_ABI or set it to 1",
            value.to_string_lossy(),
            ours.display()
        ));
    }
    out
}

/// The Python used to create the virtual environment: `DDP_PYTHON`, else `python3`.
fn find_python() -> Result<String> {
    check_python(std::env::var("DDP_PYTHON").unwrap_or_else(|_| "python3".to_owned()))
}

/// `python` if it runs and is Python 3.10 or newer (torch TORCH_VERSION's `Requires-Python`).
fn check_python(python: String) -> Result<String> {
    let out = match Command::new(&python).arg("--version").output() {
        Ok(out) if out.status.success() => out,
        Ok(out) => bail!(
            "`{python} --version` failed ({}); install Python 3.10 or newer or point \
             DDP_PYTHON at a working interpreter",
            out.status
        ),
        Err(e) => bail!(
            "cannot run `{python}` ({e}): Python 3.10 or newer is needed to install libtorch; \
             install it (Debian/Ubuntu: `apt-get install python3 python3-venv`) or set \
             DDP_PYTHON"
        ),
    };
    // Python 3.4 and later print `Python X.Y.Z` on stdout, earlier ones on stderr.
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    match python_version(&said) {
        // torchvision's Requires-Python leaves this one out.
        Some(_) if said.trim() == "Python 3.14.1" => bail!(
            "`{python}` is Python 3.14.1, which torchvision (installed beside torch) does not \
             support; install another Python 3.10 or newer and point DDP_PYTHON at it"
        ),
        Some(version) if version >= (3, 10) => Ok(python),
        _ => bail!(
            "`{python}` is {}, but torch {TORCH_VERSION} needs Python 3.10 or newer; install \
             one and point DDP_PYTHON at it",
            said.trim()
        ),
    }
}

/// `(major, minor)` of `python --version`'s answer (`Python 3.11.7`).
fn python_version(said: &str) -> Option<(u32, u32)> {
    let version = said.trim().strip_prefix("Python ")?;
    let mut parts = version.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts
        .next()?
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .ok()?;
    Some((major, minor))
}

fn site_packages(deps: &Deps) -> Result<PathBuf> {
    let out = venv_python(&deps.python())
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()
        .with_context(|| format!("cannot run {}", deps.python().display()))?;
    if !out.status.success() {
        bail!(
            "{} cannot report its site-packages folder; run `cargo xtask setup --reinstall`",
            deps.python().display()
        );
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// The version of the torch distribution installed in `site`, read from its dist-info folder
/// (importing torch would take seconds).
fn installed_torch_version(site: &Path) -> Result<Option<String>> {
    let Ok(entries) = fs::read_dir(site) else {
        return Ok(None);
    };
    for entry in entries {
        let name = entry?.file_name();
        let name = name.to_string_lossy();
        if let Some(rest) = name.strip_prefix("torch-") {
            if let Some(version) = rest.strip_suffix(".dist-info") {
                return Ok(Some(
                    version.split('+').next().unwrap_or(version).to_owned(),
                ));
            }
        }
    }
    Ok(None)
}

/// Removes `tree` (`.deps/` or its venv) with `remove`, the completion marker first: an
/// interrupted removal (Ctrl-C, a full disk, a kill) leaves no marker claiming that what
/// remains of torch is an install.
fn remove_install(
    deps: &Deps,
    tree: &Path,
    remove: impl FnOnce(&Path) -> std::io::Result<()>,
) -> Result<()> {
    let marker = deps.version_file();
    match fs::remove_file(&marker) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("cannot remove {}", marker.display()));
        }
        _ => {}
    }
    remove(tree).with_context(|| format!("cannot remove {}", tree.display()))
}

/// Removes the folder `tree`; where `tree` is a symlink (`.deps` on a bigger disk), empties the
/// folder it points to instead, keeping the link, so that the next install goes there too.
fn clear_tree(tree: &Path) -> std::io::Result<()> {
    if !tree.symlink_metadata()?.file_type().is_symlink() {
        return fs::remove_dir_all(tree);
    }
    for entry in fs::read_dir(tree)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            fs::remove_dir_all(entry.path())?;
        } else {
            fs::remove_file(entry.path())?;
        }
    }
    Ok(())
}

/// Flushes every file system write of this machine to disk (`sync(2)`): pip's files before
/// the marker that says they are complete, so that a power loss cannot leave the marker
/// over empty libraries.
fn sync_disks() {
    // SAFETY: sync takes no arguments and cannot fail.
    unsafe { libc::sync() }
}

/// Builds `.deps/libtorch` from symlinks into the wheel; `build-version` is written last.
/// The links are relative (`../venv/lib/pythonX.Y/site-packages/torch/lib`), so that a
/// checkout moved or copied elsewhere links its own venv.
fn link_libtorch(deps: &Deps, torch: &Path) -> Result<()> {
    let dir = deps.libtorch();
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Relative to where the links physically are (`.deps` may be a link to another disk).
    let real = |path: &Path| fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let torch = match real(torch).strip_prefix(real(&deps.root)) {
        Ok(inside) => Path::new("..").join(inside),
        Err(_) => torch.to_path_buf(),
    };
    for sub in ["include", "lib"] {
        std::os::unix::fs::symlink(torch.join(sub), dir.join(sub))
            .with_context(|| format!("cannot link {}", dir.join(sub).display()))?;
    }
    sync_disks();
    let tmp = dir.join("build-version.tmp");
    let written = fs::File::create(&tmp).and_then(|mut file| {
        std::io::Write::write_all(&mut file, format!("{TORCH_VERSION}\n").as_bytes())?;
        file.sync_all()
    });
    written.with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, deps.version_file())
        .and_then(|()| crate::folder_sync::sync_folder(&dir))
        .with_context(|| format!("cannot write {}", deps.version_file().display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_torch_version_from_dist_info() {
        let dir = tempdir();
        assert_eq!(installed_torch_version(&dir).unwrap(), None);
        fs::create_dir(dir.join("torch-2.12.1+cu130.dist-info")).unwrap();
        assert_eq!(
            installed_torch_version(&dir).unwrap().as_deref(),
            Some("2.12.1")
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A file system that never answers a lock (a `hard` NFS mount whose lock manager is
    /// down) gets no lock after the deadline, rather than a wait for good; one that answers
    /// "held" is waited for, and the lock taken once its holder lets it go.
    #[test]
    fn a_lock_without_an_answer_is_given_up_and_a_held_one_waited_for() {
        let dir = tempdir();
        let path = dir.join("test.lock");
        let hangs = |_: &fs::File, _| loop {
            std::thread::park();
        };
        let deadline = std::time::Duration::from_millis(200);
        assert!(lock_answered_within(&path, "waiting", deadline, hangs)
            .unwrap()
            .is_none());
        let holder = wait_for_lock(&path, "waiting").unwrap().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (path2, tx2) = (path.clone(), tx.clone());
        let waiter = std::thread::spawn(move || {
            let got = lock_answered_within(&path2, "waiting", deadline, flock).unwrap();
            tx2.send(got.is_some()).unwrap();
        });
        // Still held after several deadlines: the waiter waits.
        assert!(rx.recv_timeout(deadline * 5).is_err());
        drop((holder, tx));
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(30)),
            Ok(true)
        );
        waiter.join().unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn incomplete_install_is_not_reported_as_installed() {
        let dir = tempdir();
        let deps = Deps { root: dir.clone() };
        fs::create_dir_all(deps.libtorch()).unwrap();
        fs::write(deps.version_file(), "2.13.0\n").unwrap();
        // The version marker alone (no libraries, no venv) is not an install.
        assert_eq!(deps.installed_version(), None);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The Python setup makes its venv with (`DDP_PYTHON`, else `python3`).
    fn base_python() -> String {
        find_python().expect("setup's Python (DDP_PYTHON, else python3)")
    }

    /// A venv (without pip) in `deps`.
    fn make_venv(deps: &Deps) {
        let made = venv_python(Path::new(&base_python()))
            .args(["-m", "venv", "--without-pip"])
            .arg(deps.venv())
            .status()
            .unwrap();
        assert!(made.success());
    }

    /// A stand-in torch (its `lib/libtorch_cpu.so`, empty) in `site`, linked as setup links.
    fn fake_torch(deps: &Deps, site: &Path) {
        let lib = site.join("torch").join("lib");
        fs::create_dir_all(&lib).unwrap();
        fs::write(lib.join("libtorch_cpu.so"), b"").unwrap();
        link_libtorch(deps, &site.join("torch")).unwrap();
    }

    /// A dist-info folder of torch TORCH_VERSION in `site`, as pip and `importlib.metadata`
    /// read it.
    fn fake_dist_info(site: &Path) {
        let info = site.join(format!("torch-{TORCH_VERSION}.dist-info"));
        fs::create_dir_all(&info).unwrap();
        let metadata = format!("Metadata-Version: 2.1\nName: torch\nVersion: {TORCH_VERSION}\n");
        fs::write(info.join("METADATA"), metadata).unwrap();
    }

    /// A pip in `site` that succeeds, writing to `record` a line per run: its first argument,
    /// the version of the torch its Python finds, and the variables it sees that would send
    /// an install elsewhere.
    fn fake_pip(site: &Path, record: &Path) {
        fs::create_dir_all(site.join("pip")).unwrap();
        fs::write(site.join("pip/__init__.py"), "").unwrap();
        let main = format!(
            "import importlib.metadata, os, sys\n\
             try:\n    found = importlib.metadata.version('torch')\n\
             except importlib.metadata.PackageNotFoundError:\n    found = None\n\
             elsewhere = [v for v in ('PIP_TARGET', 'PIP_PREFIX') if v in os.environ]\n\
             elsewhere += [] if os.environ.get('PIP_USER', '0') == '0' else ['PIP_USER']\n\
             open({record:?}, 'a').write(f'{{sys.argv[1]}} {{found}} {{elsewhere}}\\n')\n"
        );
        fs::write(site.join("pip/__main__.py"), main).unwrap();
    }

    /// Runs [`foreign_python_variables_child`] with another torch on `PYTHONPATH`, another
    /// Python's `PYTHONHOME`, and pip told to install elsewhere.
    #[test]
    fn python_and_pip_variables_of_the_environment_do_not_reach_the_venv() {
        let dir = tempdir();
        let stub = dir.join("stub-site");
        fake_dist_info(&stub);
        let out = ddp_testkit::ignored_test("setup::tests::foreign_python_variables_child")
            .env("PYTHONPATH", &stub)
            .env("PYTHONHOME", dir.join("another-python"))
            .env("PIP_TARGET", dir.join("target"))
            .env("PIP_PREFIX", dir.join("prefix"))
            .env("PIP_USER", "1")
            .output()
            .unwrap();
        ddp_testkit::assert_passed(&out);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    #[ignore = "started by python_and_pip_variables_of_the_environment_do_not_reach_the_venv"]
    fn foreign_python_variables_child() {
        assert!(
            std::env::var_os("PYTHONPATH").is_some(),
            "run by its parent test"
        );
        let dir = tempdir();
        let deps = Deps { root: dir.clone() };
        make_venv(&deps);
        // The venv's Python starts, and names its own site-packages.
        let site = site_packages(&deps).unwrap();
        assert!(site.starts_with(deps.venv()), "{}", site.display());
        let record = dir.join("record");
        fake_pip(&site, &record);
        assert!(venv_usable(&deps.python()));
        pip_install(&deps, "torch").unwrap();
        // pip does not find the torch on PYTHONPATH (which would make it install nothing).
        assert_eq!(
            fs::read_to_string(&record).unwrap(),
            "--version None []\ninstall None []\n"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_moved_checkout_keeps_its_install_and_a_relink_runs_no_pip() {
        let dir = tempdir();
        let deps = Deps::new(&dir.join("a"));
        make_venv(&deps);
        let site = site_packages(&deps).unwrap();
        fake_torch(&deps, &site);
        let inside = site.strip_prefix(&deps.root).unwrap();
        assert_eq!(
            fs::read_link(deps.libtorch().join("lib")).unwrap(),
            Path::new("..").join(inside).join("torch/lib")
        );
        fs::rename(dir.join("a"), dir.join("b")).unwrap();
        let deps = Deps::new(&dir.join("b"));
        assert_eq!(deps.installed_version().as_deref(), Some(TORCH_VERSION));
        // Links gone (an older setup's, dangling after the move): setup links the torch
        // the venv has, asking pip only whether it works.
        fs::remove_dir_all(deps.libtorch()).unwrap();
        assert_eq!(deps.installed_version(), None);
        let site = deps.root.join(inside);
        fake_dist_info(&site);
        let record = dir.join("record");
        fake_pip(&site, &record);
        write_extras_marker(&deps).unwrap();
        run(&dir.join("b"), &SetupArgs::default()).unwrap();
        assert_eq!(deps.installed_version().as_deref(), Some(TORCH_VERSION));
        assert_eq!(
            fs::read_to_string(&record).unwrap(),
            format!("--version {TORCH_VERSION} []\n")
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_reinstall_empties_the_folder_a_deps_link_points_to() {
        let dir = tempdir();
        // `.deps` a link to a folder on a bigger disk, holding an install.
        let big = dir.join("big");
        fs::create_dir_all(big.join("venv/bin")).unwrap();
        fs::write(big.join("venv/bin/python"), b"").unwrap();
        std::os::unix::fs::symlink(big.join("venv"), big.join("venv-link")).unwrap();
        let deps = Deps::new(&dir);
        std::os::unix::fs::symlink(&big, &deps.root).unwrap();
        fs::create_dir_all(deps.libtorch()).unwrap();
        fs::write(deps.version_file(), "2.13.0\n").unwrap();
        remove_install(&deps, &deps.root, clear_tree).unwrap();
        assert!(deps.root.symlink_metadata().unwrap().is_symlink());
        assert_eq!(fs::read_dir(&big).unwrap().count(), 0);
        // A folder goes, whole.
        fs::create_dir_all(deps.venv().join("bin")).unwrap();
        remove_install(&deps, &deps.venv(), clear_tree).unwrap();
        assert!(!deps.venv().exists() && big.exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_interrupted_removal_or_an_empty_marker_is_not_an_install() {
        let dir = tempdir();
        let deps = Deps { root: dir.clone() };
        make_venv(&deps);
        fake_torch(&deps, &site_packages(&deps).unwrap());
        assert_eq!(deps.installed_version().as_deref(), Some(TORCH_VERSION));
        // A removal of the venv stopped before it deleted anything of torch.
        let err = remove_install(&deps, &deps.venv(), |_| {
            Err(std::io::Error::other("interrupted"))
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("interrupted"), "{err:#}");
        assert!(site_packages(&deps).unwrap().join("torch/lib").exists());
        assert_eq!(deps.installed_version(), None);
        assert!(deps.needs_setup());
        // A marker a power loss emptied after its rename.
        fake_torch(&deps, &site_packages(&deps).unwrap());
        fs::write(deps.version_file(), "").unwrap();
        assert_eq!(deps.installed_version(), None);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_torch_the_venvs_python_does_not_see_is_not_an_install() {
        let dir = tempdir();
        let deps = Deps { root: dir.clone() };
        make_venv(&deps);
        // The torch of a former Python (the venv's base moved from 3.0 to today's python3).
        fake_torch(&deps, &deps.venv().join("lib/python3.0/site-packages"));
        assert_eq!(deps.installed_version(), None);
        // The same files in the site-packages the venv's Python reads: installed.
        fake_torch(&deps, &site_packages(&deps).unwrap());
        assert_eq!(deps.installed_version().as_deref(), Some(TORCH_VERSION));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_second_setup_waits_for_the_first_to_let_go() {
        let dir = tempdir();
        let deps = Deps {
            root: dir.join(".deps"),
        };
        assert_eq!(deps.lock_file(), dir.join(".deps.lock"));
        let first = lock_setup(&deps).unwrap().expect("tmp has locks");
        let (tx, rx) = std::sync::mpsc::channel();
        let second = {
            let deps = deps.clone();
            std::thread::spawn(move || {
                let lock = lock_setup(&deps).unwrap();
                tx.send(()).unwrap();
                lock
            })
        };
        let waited = rx.recv_timeout(std::time::Duration::from_millis(300));
        assert_eq!(waited, Err(std::sync::mpsc::RecvTimeoutError::Timeout));
        drop(first);
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .expect("the second setup takes the lock once the first lets go");
        assert!(second.join().unwrap().is_some());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn setup_is_needed_until_torch_and_the_extras_are_installed() {
        let dir = tempdir();
        let deps = Deps { root: dir.clone() };
        assert!(deps.needs_setup());
        make_venv(&deps);
        fake_torch(&deps, &site_packages(&deps).unwrap());
        // torch alone: the benches' torchvision and scikit-learn are missing.
        assert!(deps.needs_setup());
        write_extras_marker(&deps).unwrap();
        assert!(!deps.needs_setup());
        fs::write(deps.version_file(), "2.12.0\n").unwrap();
        assert!(deps.needs_setup());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_venv_without_pip_is_made_again_or_the_error_says_reinstall() {
        let dir = tempdir();
        let deps = Deps { root: dir.clone() };
        // What Debian's `python3 -m venv` leaves without python3-venv: bin/python, no pip.
        make_venv(&deps);
        assert!(deps.python().exists());
        assert!(!venv_usable(&deps.python()));
        // pip's own reason comes through, with the way out.
        let err = format!("{:#}", pip_install(&deps, "x").unwrap_err());
        assert!(err.contains("No module named pip"), "{err}");
        assert!(err.contains("cargo xtask setup --reinstall"), "{err}");
        // A venv whose interpreter has gone: links to nothing.
        let bin = deps.venv().join("bin");
        for name in ["python", "python3"] {
            let _ = fs::remove_file(bin.join(name));
            std::os::unix::fs::symlink("/nonexistent/python3", bin.join(name)).unwrap();
        }
        assert!(!venv_usable(&deps.python()));
        match prepare_venv(&deps, &base_python(), false) {
            Ok(()) => assert!(venv_usable(&deps.python())),
            // No ensurepip on this machine: the error names the way out.
            Err(e) => assert!(format!("{e:#}").contains("--reinstall"), "{e:#}"),
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A venv that a failed setup made with a Python torch has no wheel for stays unless the
    /// user chose another Python with DDP_PYTHON, which replaces it.
    #[test]
    fn a_venv_of_another_python_than_ddp_pythons_is_made_again() {
        let dir = tempdir();
        let deps = Deps { root: dir.clone() };
        // None yet: DDP_PYTHON's makes it.
        match prepare_venv(&deps, &base_python(), true) {
            Ok(()) => assert!(venv_usable(&deps.python())),
            Err(e) => assert!(format!("{e:#}").contains("--reinstall"), "{e:#}"),
        }
        let _ = fs::remove_dir_all(deps.venv());
        // A working venv (pip answers) of Python 3.14.1.
        fs::create_dir_all(deps.venv().join("bin")).unwrap();
        let fake = "#!/bin/sh\n[ \"$1\" = --version ] && echo 'Python 3.14.1'\nexit 0\n";
        ddp_testkit::script(&deps.python(), fake);
        assert!(venv_usable(&deps.python()));
        prepare_venv(&deps, &base_python(), false).unwrap();
        assert_eq!(fs::read_to_string(deps.python()).unwrap(), fake);
        match prepare_venv(&deps, &base_python(), true) {
            Ok(()) => assert!(venv_usable(&deps.python())),
            // No ensurepip on this machine: the error names the way out.
            Err(e) => assert!(format!("{e:#}").contains("--reinstall"), "{e:#}"),
        }
        assert_ne!(
            fs::read_to_string(deps.python()).ok().as_deref(),
            Some(fake)
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn pip_unpacks_in_deps_tmp_unless_tmpdir_is_set() {
        let dir = tempdir();
        let deps = Deps { root: dir.clone() };
        let record = dir.join("tmpdir");
        // A pip that records its TMPDIR (whether it exists, and holds an earlier pip's
        // leftovers), then fails as on a full disk.
        let script = format!(
            "#!/bin/sh\nprintf '%s %s%s' \"$TMPDIR\" \"$(test -d \"$TMPDIR\" && echo made)\" \
             \"$(test -e \"$TMPDIR/pip-unpack-1\" && echo ' stale')\" > '{}'\n\
             echo 'ERROR: [Errno 28] No space left on device' >&2\nexit 1\n",
            record.display()
        );
        fs::create_dir_all(deps.venv().join("bin")).unwrap();
        ddp_testkit::script(&deps.python(), &script);
        let own = dir.join("tmp");
        for unset in [None, Some(OsString::new())] {
            // An earlier pip killed with its terminal left its downloads.
            fs::create_dir_all(own.join("pip-unpack-1")).unwrap();
            let err = format!(
                "{:#}",
                pip_install_with_tmpdir(&deps, "x", unset).unwrap_err()
            );
            assert_eq!(
                fs::read_to_string(&record).unwrap(),
                format!("{} made", own.display())
            );
            assert!(!own.exists(), "{} is left behind", own.display());
            assert!(err.contains("No space left on device"), "{err}");
            assert!(
                err.contains(&format!(
                    "2.6 GB of downloads in {}, where TMPDIR can point",
                    own.display()
                )),
                "{err}"
            );
        }
        // The user's TMPDIR is theirs.
        let theirs = dir.join("theirs");
        fs::create_dir_all(&theirs).unwrap();
        let err = format!(
            "{:#}",
            pip_install_with_tmpdir(&deps, "x", Some(theirs.clone().into())).unwrap_err()
        );
        assert_eq!(
            fs::read_to_string(&record).unwrap(),
            format!("{} made", theirs.display())
        );
        assert!(theirs.exists() && !own.exists());
        assert!(
            err.contains(&format!(
                "2.6 GB of downloads in $TMPDIR ({})",
                theirs.display()
            )),
            "{err}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn python_before_3_10_is_refused_naming_ddp_python() {
        let dir = tempdir();
        let old = dir.join("python3.9");
        ddp_testkit::script(&old, "#!/bin/sh\necho 'Python 3.9.18'\n");
        let err = check_python(old.to_string_lossy().into_owned())
            .unwrap_err()
            .to_string();
        assert!(err.contains("3.10") && err.contains("DDP_PYTHON"), "{err}");
        assert!(err.contains("Python 3.9.18"), "{err}");
        let new = dir.join("python3.10");
        ddp_testkit::script(&new, "#!/bin/sh\necho 'Python 3.10.0rc1'\n");
        assert!(check_python(new.to_string_lossy().into_owned()).is_ok());
        // torchvision leaves 3.14.1 out.
        let excluded = dir.join("python3.14");
        ddp_testkit::script(&excluded, "#!/bin/sh\necho 'Python 3.14.1'\n");
        let err = check_python(excluded.to_string_lossy().into_owned())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("is Python 3.14.1, which torchvision") && err.contains("DDP_PYTHON"),
            "{err}"
        );
        assert_eq!(python_version("Python 3.13.1\n"), Some((3, 13)));
        assert_eq!(python_version("Python 2.7.18"), Some((2, 7)));
        assert_eq!(python_version("python"), None);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn another_libtorch_in_the_environment_is_named() {
        let dir = tempdir();
        let ours = dir.join(".deps/libtorch");
        fs::create_dir_all(&ours).unwrap();
        let warn = |vars: &[(&str, &Path)]| {
            let vars: Vec<(String, OsString)> = vars
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.as_os_str().to_owned()))
                .collect();
            another_libtorch(
                |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()),
                &ours,
            )
        };
        // Unset, or cargo's own value (the same folder, by another path): nothing to say.
        assert!(warn(&[]).is_empty());
        let other_path = dir.join(".deps/../.deps/libtorch");
        for name in ["LIBTORCH", "LIBTORCH_INCLUDE", "LIBTORCH_LIB"] {
            assert!(warn(&[(name, &ours)]).is_empty(), "{name}");
            assert!(warn(&[(name, &other_path)]).is_empty(), "{name}");
        }
        let opt = Path::new("/opt/libtorch");
        let ours_text = ours.display().to_string();
        for (name, what) in [
            ("LIBTORCH", "use that libtorch instead"),
            ("LIBTORCH_INCLUDE", "use that libtorch's headers instead"),
            ("LIBTORCH_LIB", "use that libtorch's libraries instead"),
        ] {
            let elsewhere = warn(&[(name, opt)]);
            assert_eq!(elsewhere.len(), 1, "{elsewhere:?}");
            assert!(
                elsewhere[0].starts_with(&format!("{name} is set to `/opt/libtorch`"))
                    && elsewhere[0].contains(what)
                    && elsewhere[0].contains(&ours_text)
                    && elsewhere[0].ends_with(&format!("unset {name} to use it")),
                "{elsewhere:?}"
            );
        }
        assert_eq!(
            warn(&[("LIBTORCH_INCLUDE", opt), ("LIBTORCH_LIB", opt)]).len(),
            2
        );
        let python = warn(&[
            ("LIBTORCH", &ours),
            ("LIBTORCH_USE_PYTORCH", Path::new("1")),
        ]);
        assert_eq!(python.len(), 1);
        assert!(
            python[0].starts_with("LIBTORCH_USE_PYTORCH is set to `1`")
                && python[0].contains("unset LIBTORCH_USE_PYTORCH"),
            "{python:?}"
        );
        // An exported C++ ABI other than the wheel's (cargo's `[env]` does not override it).
        assert!(warn(&[("LIBTORCH_CXX11_ABI", Path::new("1"))]).is_empty());
        let abi = warn(&[("LIBTORCH_CXX11_ABI", Path::new("0"))]);
        assert_eq!(abi.len(), 1, "{abi:?}");
        assert!(
            abi[0].starts_with("LIBTORCH_CXX11_ABI is set to `0`")
                && abi[0].contains("undefined references")
                && abi[0].ends_with("unset LIBTORCH_CXX11_ABI or set it to 1"),
            "{abi:?}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    fn tempdir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "xtask-setup-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }
}
