//! Where the NCCL and CUDA runtime libraries are looked for.
//!
//! In order, for NCCL (`libnccl.so.2`; CUDA runtime `libcudart.so.13` likewise):
//!
//! 1. `DDP_NCCL_LIBRARY` (`DDP_CUDART_LIBRARY`): a path to the library file. When set, it is
//!    the only candidate, so a wrong value is an error rather than a silent fallback.
//! 2. The PyTorch wheel that provides libtorch: for each libtorch `lib` folder (the folder of
//!    the `libtorch_cpu.so` already mapped into this process, then `$LIBTORCH/lib`, then
//!    `$DDP_DEPS_DIR/libtorch/lib`, then `.deps/libtorch/lib` in any ancestor folder of the
//!    running executable), the wheel's `site-packages/nvidia/nccl/lib` (`nvidia/cu13/lib`),
//!    reached from the symlink-resolved `torch/lib` folder as `../../nvidia/...`.
//! 3. The bare file name, resolved by the dynamic loader's usual search (`LD_LIBRARY_PATH`,
//!    the executable's run path, the system cache).

use std::path::{Path, PathBuf};

/// Environment variable naming the NCCL library file to load.
pub const NCCL_ENV: &str = "DDP_NCCL_LIBRARY";
/// Environment variable naming the CUDA runtime library file to load.
pub const CUDART_ENV: &str = "DDP_CUDART_LIBRARY";
/// NCCL's file name.
pub const NCCL_NAME: &str = "libnccl.so.2";
/// The CUDA runtime's file name (the torch 2.13 wheel's CUDA 13 runtime).
pub const CUDART_NAME: &str = "libcudart.so.13";

/// The libtorch `lib` folders this process can see, best first, symlinks resolved, without
/// duplicates (see the module documentation).
pub fn torch_lib_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = mapped_library_dir("libtorch_cpu.so") {
        dirs.push(dir);
    }
    if let Some(dir) = std::env::var_os("LIBTORCH") {
        dirs.push(Path::new(&dir).join("lib"));
    }
    if let Some(dir) = std::env::var_os("DDP_DEPS_DIR") {
        dirs.push(Path::new(&dir).join("libtorch").join("lib"));
    }
    if let Ok(exe) = std::env::current_exe() {
        for ancestor in exe.ancestors().skip(1) {
            let candidate = ancestor.join(".deps").join("libtorch").join("lib");
            if candidate.is_dir() {
                dirs.push(candidate);
                break;
            }
        }
    }
    let mut out: Vec<PathBuf> = Vec::new();
    for dir in dirs {
        let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
        if !out.contains(&dir) {
            out.push(dir);
        }
    }
    out
}

/// The folder of a shared library already mapped into this process whose file name is
/// `file_name`, read from `/proc/self/maps`.
pub fn mapped_library_dir(file_name: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(Path::new)
        .find(|path| path.file_name().is_some_and(|n| n == file_name))
        .and_then(|path| path.parent().map(Path::to_path_buf))
}

/// Candidate files for a library, best first: the override alone when `env_var` is set,
/// else `<torch lib>/../../nvidia/<subdir>/<name>` for each [`torch_lib_dirs`] entry, then
/// the bare `name`.
pub fn candidates(env_var: &str, subdir: &str, name: &str) -> Vec<PathBuf> {
    if let Some(path) = std::env::var_os(env_var) {
        return vec![PathBuf::from(path)];
    }
    let mut out: Vec<PathBuf> = torch_lib_dirs()
        .iter()
        .filter_map(|lib| lib.parent()?.parent().map(Path::to_path_buf))
        .map(|site_packages| site_packages.join("nvidia").join(subdir).join(name))
        .collect();
    out.dedup();
    out.push(PathBuf::from(name));
    out
}

/// Candidate files for NCCL (see [`candidates`]).
pub fn nccl_candidates() -> Vec<PathBuf> {
    candidates(NCCL_ENV, "nccl/lib", NCCL_NAME)
}

/// Candidate files for the CUDA runtime (see [`candidates`]).
pub fn cudart_candidates() -> Vec<PathBuf> {
    candidates(CUDART_ENV, "cu13/lib", CUDART_NAME)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_name_is_the_last_resort() {
        let list = candidates(
            "DDP_TEST_UNSET_VARIABLE_FOR_NCCL_SYS",
            "nccl/lib",
            NCCL_NAME,
        );
        assert_eq!(list.last().unwrap(), Path::new(NCCL_NAME));
        for path in &list[..list.len() - 1] {
            assert!(
                path.ends_with("nvidia/nccl/lib/libnccl.so.2"),
                "{}",
                path.display()
            );
        }
    }
}
