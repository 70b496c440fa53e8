// The one copy of how the project's Python is started, `include!`d by xtask (`setup.rs`, whose
// tests cover it, and the benchmarks' references) and ddp-testkit (`setup_python`, for the tests
// and the criterion benchmarks): xtask cannot depend on a test helper, nor ddp-testkit on xtask.

/// A command that runs `python` (`.deps/venv`'s interpreter, or the one that makes it) with
/// its own packages only: the variables that point Python or pip at other folders are removed
/// from its environment. A torch on `PYTHONPATH` would be the one imported, and would make
/// pip find torch installed and install nothing; a `PYTHONHOME` of another Python stops the
/// interpreter from starting; `PIP_TARGET` and `PIP_PREFIX` install elsewhere. `PIP_USER` is
/// set to 0, which also overrides a `user = true` in pip's configuration files (pip refuses a
/// user install into a venv).
pub fn venv_python(python: &std::path::Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(python);
    for name in ["PYTHONPATH", "PYTHONHOME", "PIP_TARGET", "PIP_PREFIX"] {
        cmd.env_remove(name);
    }
    cmd.env("PIP_USER", "0");
    cmd
}
