//! `cargo xtask setup`: installs libtorch (from the `torch` Python wheel) into `.deps/`.
//!
//! Layout made here, all git-ignored:
//!
//! ```text
//! .deps/venv/                 a Python virtual environment holding torch==TORCH_VERSION
//! .deps/libtorch/include  ->  .deps/venv/.../site-packages/torch/include
//! .deps/libtorch/lib      ->  .deps/venv/.../site-packages/torch/lib
//! .deps/libtorch/build-version   "2.13.0", written last: the install's completion marker
//! ```
//!
//! `.cargo/config.toml` points `LIBTORCH` at `.deps/libtorch`, so torch-sys needs no Python
//! at build time, and it checks `build-version` against the version tch expects.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

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

    /// The installed libtorch version, if a complete install is present.
    pub fn installed_version(&self) -> Option<String> {
        let version = fs::read_to_string(self.version_file()).ok()?;
        let complete =
            self.libtorch().join("lib").join("libtorch_cpu.so").exists() && self.python().exists();
        complete.then(|| version.trim().to_owned())
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
    if args.reinstall && deps.root.exists() {
        fs::remove_dir_all(&deps.root)
            .with_context(|| format!("cannot remove {}", deps.root.display()))?;
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
    if !deps.python().exists() {
        println!(
            "setup: creating a Python virtual environment in {}",
            deps.venv().display()
        );
        fs::create_dir_all(&deps.root)
            .with_context(|| format!("cannot create {}", deps.root.display()))?;
        let status = Command::new(&python)
            .args(["-m", "venv"])
            .arg(deps.venv())
            .status()
            .with_context(|| format!("cannot run `{python} -m venv`"))?;
        if !status.success() {
            bail!(
                "`{python} -m venv {}` failed ({status}); install the venv module \
                 (Debian/Ubuntu: `apt-get install python3-venv`) and run `cargo xtask setup` again",
                deps.venv().display()
            );
        }
    }

    let site = site_packages(&deps)?;
    if let Some(found) = installed_torch_version(&site)? {
        if found != TORCH_VERSION {
            bail!(
                "{} holds torch {found}, but tch needs {TORCH_VERSION}; \
                 run `cargo xtask setup --reinstall` to replace it",
                deps.venv().display()
            );
        }
    }

    println!(
        "setup: installing torch=={TORCH_VERSION} (CUDA build, about 2.6 GB) into {}",
        deps.venv().display()
    );
    let status = pip_install(&deps)?;
    if !status.success() {
        bail!(
            "pip could not install torch=={TORCH_VERSION} ({status}); check access to the \
             Python package index and free disk space (about 6 GB), then run \
             `cargo xtask setup` again"
        );
    }

    let torch = site.join("torch");
    if !torch.join("lib").join("libtorch_cpu.so").exists() {
        bail!(
            "pip reported success but {} has no libtorch_cpu.so; \
             run `cargo xtask setup --reinstall`",
            torch.join("lib").display()
        );
    }
    write_extras_marker(&deps)?;
    link_libtorch(&deps, &torch)?;
    println!(
        "setup: libtorch {TORCH_VERSION} ready in {}",
        deps.libtorch().display()
    );
    Ok(deps)
}

fn extras_marker() -> String {
    EXTRA_PACKAGES.iter().map(|p| format!("{p}\n")).collect()
}

fn write_extras_marker(deps: &Deps) -> Result<()> {
    fs::write(deps.extras_file(), extras_marker())
        .with_context(|| format!("cannot write {}", deps.extras_file().display()))
}

/// Installs torch TORCH_VERSION (kept if present) and the extra packages into the venv.
fn pip_install(deps: &Deps) -> Result<std::process::ExitStatus> {
    Command::new(deps.python())
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--quiet",
        ])
        .arg(format!("torch=={TORCH_VERSION}"))
        .args(EXTRA_PACKAGES)
        .status()
        .context("cannot run pip in the virtual environment")
}

/// Adds the extra packages to an install that predates them (torch itself stays).
fn install_extras(deps: &Deps) -> Result<()> {
    println!(
        "setup: installing {} into {}",
        EXTRA_PACKAGES.join(", "),
        deps.venv().display()
    );
    let status = pip_install(deps)?;
    if !status.success() {
        bail!(
            "pip could not install {} ({status}); check access to the Python package \
             index, then run `cargo xtask setup` again",
            EXTRA_PACKAGES.join(", ")
        );
    }
    write_extras_marker(deps)
}

/// The Python used to create the virtual environment: `DDP_PYTHON`, else `python3`.
fn find_python() -> Result<String> {
    let python = std::env::var("DDP_PYTHON").unwrap_or_else(|_| "python3".to_owned());
    match Command::new(&python).arg("--version").output() {
        Ok(out) if out.status.success() => Ok(python),
        Ok(out) => bail!(
            "`{python} --version` failed ({}); install Python 3.10 or newer or point \
             DDP_PYTHON at a working interpreter",
            out.status
        ),
        Err(e) => bail!(
            "cannot run `{python}` ({e}): Python 3 is needed to install libtorch; install it \
             (Debian/Ubuntu: `apt-get install python3 python3-venv`) or set DDP_PYTHON"
        ),
    }
}

fn site_packages(deps: &Deps) -> Result<PathBuf> {
    let out = Command::new(deps.python())
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

/// Builds `.deps/libtorch` from symlinks into the wheel; `build-version` is written last.
fn link_libtorch(deps: &Deps, torch: &Path) -> Result<()> {
    let dir = deps.libtorch();
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("cannot remove {}", dir.display()))?;
    }
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for sub in ["include", "lib"] {
        std::os::unix::fs::symlink(torch.join(sub), dir.join(sub))
            .with_context(|| format!("cannot link {}", dir.join(sub).display()))?;
    }
    let tmp = dir.join("build-version.tmp");
    fs::write(&tmp, format!("{TORCH_VERSION}\n"))
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, deps.version_file())
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
