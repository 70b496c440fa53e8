//! Where the NCCL and CUDA runtime libraries are looked for.
//!
//! In order, for NCCL (`libnccl.so.2`):
//!
//! 1. `DDP_NCCL_LIBRARY`: a path to the library file. When set, it is the only candidate, so
//!    a wrong value is an error rather than a silent fallback (an empty or blank value counts
//!    as unset).
//! 2. The PyTorch wheel that provides libtorch: for each libtorch `lib` folder (the folder of
//!    the `libtorch_cpu.so` already mapped into this process, then `$LIBTORCH/lib`, then
//!    `$DDP_DEPS_DIR/libtorch/lib`, then `.deps/libtorch/lib` in any ancestor folder of the
//!    running executable), the wheel's `site-packages/nvidia/nccl/lib`, reached from the
//!    symlink-resolved `torch/lib` folder as `../../nvidia/...`.
//! 3. The bare file name, resolved by the dynamic loader's usual search (`LD_LIBRARY_PATH`,
//!    the executable's run path, the system cache).
//!
//! The CUDA runtime comes in one file per major version (`libcudart.so.13`,
//! `libcudart.so.12`), and the one to use is the one libtorch was built with:
//!
//! 1. `DDP_CUDART_LIBRARY`, alone, as for NCCL.
//! 2. A `libcudart.so.N` already mapped into this process (libtorch's CUDA libraries loaded
//!    it), alone: a second runtime beside it would be another CUDA context's worth of state.
//! 3. The runtime libtorch's folder holds under the name `libc10_cuda.so` needs (a libtorch
//!    archive bundles `libcudart-<hash>.so.N`).
//! 4. For each major version, best first: the versions that libtorch's `libc10_cuda.so`
//!    names in its `DT_NEEDED` entries (read from the ELF file of the first libtorch folder
//!    that has one), then 13, then 12 ([`CUDA_MAJORS`]). For each version: the wheel's
//!    folder for it under each libtorch folder (`nvidia/cu13/lib` for CUDA 13,
//!    `nvidia/cuda_runtime/lib` for CUDA 12), then the bare file name.

use std::path::{Path, PathBuf};

/// Environment variable naming the NCCL library file to load.
pub const NCCL_ENV: &str = "DDP_NCCL_LIBRARY";
/// Environment variable naming the CUDA runtime library file to load.
pub const CUDART_ENV: &str = "DDP_CUDART_LIBRARY";
/// NCCL's file name.
pub const NCCL_NAME: &str = "libnccl.so.2";
/// The CUDA runtime, as load errors name it (the file is `libcudart.so.N`, see
/// [`cudart_candidates`]).
pub const CUDART_NAME: &str = "libcudart.so (CUDA 13 or 12)";
/// The CUDA major versions whose runtime is looked for when libtorch does not say which it
/// needs, best first.
pub const CUDA_MAJORS: [u32; 2] = [13, 12];

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
    mapped_files()
        .into_iter()
        .find(|path| path.file_name().is_some_and(|n| n == file_name))
        .and_then(|path| path.parent().map(Path::to_path_buf))
}

/// The files mapped into this process, in `/proc/self/maps`'s order; empty when it cannot be
/// read.
fn mapped_files() -> Vec<PathBuf> {
    maps_paths(&std::fs::read("/proc/self/maps").unwrap_or_default())
}

/// The paths the lines of a `/proc/self/maps` text name, as bytes: a path that is not UTF-8
/// (a Latin-1 folder, a mapped data file) is one path like the others, never a reason to
/// lose the rest.
fn maps_paths(maps: &[u8]) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    maps.split(|&b| b == b'\n')
        .filter_map(maps_line_path)
        .map(|path| PathBuf::from(std::ffi::OsStr::from_bytes(path)))
        .collect()
}

/// The path a line of `/proc/self/maps` names, if any: everything after the first five
/// fields (address, permissions, offset, device, inode) and the padding, as the kernel
/// prints it, spaces included, less a trailing ` (deleted)`.
fn maps_line_path(line: &[u8]) -> Option<&[u8]> {
    let skip_spaces = |s: &[u8]| -> usize { s.iter().take_while(|&&b| b == b' ').count() };
    let mut rest = line;
    for _ in 0..5 {
        rest = &rest[skip_spaces(rest)..];
        rest = &rest[rest.iter().position(|&b| b == b' ')?..];
    }
    let path = &rest[skip_spaces(rest)..];
    let path = path.strip_suffix(b" (deleted)").unwrap_or(path);
    (!path.is_empty()).then_some(path)
}

/// The file an override variable's `value` names; an empty or blank value counts as unset,
/// as for every variable ddp-comm reads (a blank path would load the program itself).
fn override_file(value: Option<std::ffi::OsString>) -> Option<PathBuf> {
    value
        .filter(|v| !v.to_string_lossy().trim().is_empty())
        .map(PathBuf::from)
}

/// Candidate files for a library, best first: the override alone when `env_var` is set
/// (not blank), else `<torch lib>/../../nvidia/<subdir>/<name>` for each [`torch_lib_dirs`]
/// entry, then the bare `name`.
pub fn candidates(env_var: &str, subdir: &str, name: &str) -> Vec<PathBuf> {
    candidates_for(std::env::var_os(env_var), subdir, name)
}

/// [`candidates`] with the override variable's `value`.
fn candidates_for(value: Option<std::ffi::OsString>, subdir: &str, name: &str) -> Vec<PathBuf> {
    if let Some(path) = override_file(value) {
        return vec![path];
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

/// The folder inside `site-packages/nvidia` where the PyTorch wheels keep the CUDA runtime
/// of major version `major`.
pub fn cudart_wheel_dir(major: u32) -> String {
    if major >= 13 {
        format!("cu{major}/lib")
    } else {
        "cuda_runtime/lib".to_string()
    }
}

/// Candidate files for the CUDA runtime (see the module documentation).
pub fn cudart_candidates() -> Vec<PathBuf> {
    cudart_candidates_for(std::env::var_os(CUDART_ENV))
}

/// [`cudart_candidates`] with `DDP_CUDART_LIBRARY`'s `value`.
fn cudart_candidates_for(value: Option<std::ffi::OsString>) -> Vec<PathBuf> {
    if let Some(path) = override_file(value) {
        return vec![path];
    }
    if let Some(path) = mapped_cudart() {
        return vec![path];
    }
    let dirs = torch_lib_dirs();
    let c10_cuda = dirs
        .iter()
        .map(|d| d.join("libc10_cuda.so"))
        .find(|p| p.is_file());
    let Some(c10_cuda) = c10_cuda else {
        return cudart_candidates_in(&dirs, &[]);
    };
    let needed = needed_libraries(&c10_cuda).unwrap_or_default();
    let majors: Vec<u32> = needed.iter().filter_map(|n| cudart_major(n)).collect();
    let mut out = match c10_cuda.parent() {
        Some(dir) => bundled_cudart(dir, &needed),
        None => Vec::new(),
    };
    for path in cudart_candidates_in(&dirs, &majors) {
        if !out.contains(&path) {
            out.push(path);
        }
    }
    out
}

/// The CUDA runtimes that libtorch's folder `dir` holds itself under the names its libraries
/// `needed`, the files its own run path (`$ORIGIN`) loads: a libtorch archive bundles
/// `libcudart-<hash>.so.N`, which no search by the plain name finds.
pub fn bundled_cudart(dir: &Path, needed: &[String]) -> Vec<PathBuf> {
    needed
        .iter()
        .filter(|name| cudart_major(name).is_some())
        .map(|name| dir.join(name))
        .filter(|path| path.is_file())
        .collect()
}

/// The CUDA runtime candidates for the libtorch folders `torch_dirs` when libtorch needs the
/// major versions `needed` (maybe none): for each version in [`cuda_major_order`], the
/// wheel's file under each folder, then the bare name.
pub fn cudart_candidates_in(torch_dirs: &[PathBuf], needed: &[u32]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for major in cuda_major_order(needed) {
        let name = format!("libcudart.so.{major}");
        for site_packages in torch_dirs.iter().filter_map(|lib| lib.parent()?.parent()) {
            let path = site_packages
                .join("nvidia")
                .join(cudart_wheel_dir(major))
                .join(&name);
            if !out.contains(&path) {
                out.push(path);
            }
        }
        out.push(PathBuf::from(name));
    }
    out
}

/// The major versions to try: `needed` first (in its order), then the rest of
/// [`CUDA_MAJORS`], without duplicates.
pub fn cuda_major_order(needed: &[u32]) -> Vec<u32> {
    let mut order: Vec<u32> = Vec::new();
    for &major in needed.iter().chain(CUDA_MAJORS.iter()) {
        if !order.contains(&major) {
            order.push(major);
        }
    }
    order
}

/// A `libcudart.so.N` already mapped into this process, from `/proc/self/maps`.
pub fn mapped_cudart() -> Option<PathBuf> {
    mapped_files().into_iter().find(|path| {
        path.file_name()
            .and_then(|n| n.to_str())
            .and_then(cudart_major)
            .is_some()
    })
}

/// `N` for a file named `libcudart.so.N`, or `libcudart-<hash>.so.N` as libtorch's archives
/// (and auditwheel) name the copy they bundle (`N` a number; `libcudart.so.13.0.96` is not a
/// soname and does not count).
pub fn cudart_major(file_name: &str) -> Option<u32> {
    let rest = file_name.strip_prefix("libcudart")?;
    let version = match rest.strip_prefix('-') {
        Some(hashed) => {
            let (hash, tail) = hashed.split_once('.')?;
            if hash.is_empty() || !hash.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return None;
            }
            tail.strip_prefix("so.")?
        }
        None => rest.strip_prefix(".so.")?,
    };
    version.parse().ok()
}

/// The CUDA runtime major versions an ELF shared library names in its `DT_NEEDED` entries
/// (`libcudart.so.N`), in the file's order; empty when the file cannot be read or is not a
/// 64-bit little-endian ELF file.
pub fn needed_cuda_majors(elf: &Path) -> Vec<u32> {
    needed_libraries(elf)
        .unwrap_or_default()
        .iter()
        .filter_map(|name| cudart_major(name))
        .collect()
}

/// The `DT_NEEDED` entries of a 64-bit little-endian ELF file, read from its `.dynamic`
/// section and the string table that section links to (only those parts are read).
pub fn needed_libraries(elf: &Path) -> std::io::Result<Vec<String>> {
    use std::io::{Error, ErrorKind, Read, Seek, SeekFrom};
    let bad = |what: &str| Error::new(ErrorKind::InvalidData, what.to_string());
    let mut file = std::fs::File::open(elf)?;
    let mut header = [0u8; 64];
    file.read_exact(&mut header)?;
    // Magic, ELFCLASS64, ELFDATA2LSB.
    if header[..4] != *b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return Err(bad("not a 64-bit little-endian ELF file"));
    }
    // Little-endian integers; every offset used below is inside a header or an entry of a
    // size checked beforehand, and a short slice reads as 0 rather than panicking.
    let int_at = |b: &[u8], at: usize, len: usize| {
        b.get(at..at + len).map_or(0, |bytes| {
            bytes
                .iter()
                .rev()
                .fold(0u64, |acc, &byte| (acc << 8) | u64::from(byte))
        })
    };
    let u16_at = |b: &[u8], at: usize| int_at(b, at, 2) as u16;
    let u32_at = |b: &[u8], at: usize| int_at(b, at, 4) as u32;
    let u64_at = |b: &[u8], at: usize| int_at(b, at, 8);
    let (shoff, shentsize, shnum) = (
        u64_at(&header, 0x28),
        usize::from(u16_at(&header, 0x3a)),
        usize::from(u16_at(&header, 0x3c)),
    );
    if shentsize < 64 || shnum == 0 || shnum > 1 << 16 {
        return Err(bad("no usable section header table"));
    }
    let mut table = vec![0u8; shentsize * shnum];
    file.seek(SeekFrom::Start(shoff))?;
    file.read_exact(&mut table)?;
    let section = |i: usize| &table[i * shentsize..(i + 1) * shentsize];
    // (type, link, offset, size) of each section header.
    let fields = |s: &[u8]| (u32_at(s, 4), u32_at(s, 40), u64_at(s, 24), u64_at(s, 32));
    const SHT_DYNAMIC: u32 = 6;
    let Some(dynamic) = (0..shnum)
        .map(section)
        .find(|s| u32_at(s, 4) == SHT_DYNAMIC)
    else {
        return Ok(Vec::new());
    };
    let (_, link, offset, size) = fields(dynamic);
    let link = link as usize;
    if link >= shnum {
        return Err(bad("the .dynamic section links to no string table"));
    }
    let (_, _, str_offset, str_size) = fields(section(link));
    let read = |file: &mut std::fs::File, offset: u64, size: u64| -> std::io::Result<Vec<u8>> {
        if size > 64 << 20 {
            return Err(bad("section larger than 64 MiB"));
        }
        let mut buf = vec![0u8; size as usize];
        file.seek(SeekFrom::Start(offset))?;
        file.read_exact(&mut buf)?;
        Ok(buf)
    };
    let entries = read(&mut file, offset, size)?;
    let strings = read(&mut file, str_offset, str_size)?;
    const DT_NULL: u64 = 0;
    const DT_NEEDED: u64 = 1;
    let mut out = Vec::new();
    for entry in entries.chunks_exact(16) {
        let (tag, value) = (u64_at(entry, 0), u64_at(entry, 8));
        if tag == DT_NULL {
            break;
        }
        if tag != DT_NEEDED {
            continue;
        }
        let start = usize::try_from(value).map_err(|_| bad("string offset out of range"))?;
        let rest = strings
            .get(start..)
            .ok_or_else(|| bad("string offset out of range"))?;
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        out.push(String::from_utf8_lossy(&rest[..end]).into_owned());
    }
    Ok(out)
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

    /// A blank override is no override (`dlopen("")` would return the program itself): the
    /// search goes on as without it; a path is the only candidate.
    #[test]
    fn a_blank_override_counts_as_unset() {
        let file = "/opt/nccl/lib/libnccl.so.2";
        for (value, unset) in [("", true), (" \t", true), (file, false)] {
            let nccl = candidates_for(Some(value.into()), "nccl/lib", NCCL_NAME);
            let cudart = cudart_candidates_for(Some(value.into()));
            if unset {
                assert_eq!(
                    nccl,
                    candidates_for(None, "nccl/lib", NCCL_NAME),
                    "{value:?}"
                );
                assert_eq!(cudart, cudart_candidates_for(None), "{value:?}");
                assert_eq!(nccl.last().unwrap(), Path::new(NCCL_NAME));
            } else {
                assert_eq!(nccl, [PathBuf::from(file)]);
                assert_eq!(cudart, [PathBuf::from(file)]);
            }
        }
    }

    /// A fake tree of two PyTorch installs: a CUDA 12 wheel (`nvidia/cuda_runtime/lib`) and a
    /// CUDA 13 wheel (`nvidia/cu13/lib`), each with its `torch/lib`.
    fn fake_installs() -> (PathBuf, PathBuf, PathBuf) {
        let root = std::env::temp_dir().join(format!("nccl-sys-search-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let make = |name: &str, wheel_dir: &str, file: &str| {
            let site = root.join(name).join("site-packages");
            std::fs::create_dir_all(site.join("torch/lib")).unwrap();
            std::fs::create_dir_all(site.join("nvidia").join(wheel_dir)).unwrap();
            std::fs::write(site.join("nvidia").join(wheel_dir).join(file), b"").unwrap();
            site.join("torch/lib")
        };
        let cu12 = make("cu12", "cuda_runtime/lib", "libcudart.so.12");
        let cu13 = make("cu13", "cu13/lib", "libcudart.so.13");
        (root, cu12, cu13)
    }

    #[test]
    fn the_cuda_runtime_libtorch_needs_comes_first() {
        let (root, cu12, cu13) = fake_installs();
        let dirs = vec![cu12.clone(), cu13.clone()];
        let site = |lib: &Path| lib.parent().unwrap().parent().unwrap().to_path_buf();
        // A CUDA 12 libtorch: every CUDA 12 candidate before any CUDA 13 one.
        let list = cudart_candidates_in(&dirs, &[12]);
        let want: Vec<PathBuf> = vec![
            site(&cu12).join("nvidia/cuda_runtime/lib/libcudart.so.12"),
            site(&cu13).join("nvidia/cuda_runtime/lib/libcudart.so.12"),
            PathBuf::from("libcudart.so.12"),
            site(&cu12).join("nvidia/cu13/lib/libcudart.so.13"),
            site(&cu13).join("nvidia/cu13/lib/libcudart.so.13"),
            PathBuf::from("libcudart.so.13"),
        ];
        assert_eq!(list, want);
        // The first candidate that exists is the CUDA 12 wheel's runtime.
        let first = list.iter().find(|p| p.is_file()).unwrap();
        assert_eq!(
            first,
            &site(&cu12).join("nvidia/cuda_runtime/lib/libcudart.so.12")
        );
        // Nothing known about libtorch: 13, then 12.
        let list = cudart_candidates_in(std::slice::from_ref(&cu12), &[]);
        let want: Vec<PathBuf> = vec![
            site(&cu12).join("nvidia/cu13/lib/libcudart.so.13"),
            PathBuf::from("libcudart.so.13"),
            site(&cu12).join("nvidia/cuda_runtime/lib/libcudart.so.12"),
            PathBuf::from("libcudart.so.12"),
        ];
        assert_eq!(list, want);
        // So a CUDA 12 wheel alone is still found.
        let first = list.iter().find(|p| p.is_file()).unwrap();
        assert_eq!(
            first,
            &site(&cu12).join("nvidia/cuda_runtime/lib/libcudart.so.12")
        );
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_maps_line_names_its_whole_path() {
        let cases: [(&str, Option<&str>); 6] = [
            (
                "7f00-7f10 r-xp 00000000 fe:00 42      /x/a b/torch/lib/libtorch_cpu.so",
                Some("/x/a b/torch/lib/libtorch_cpu.so"),
            ),
            (
                "7f00-7f10 r--p 00001000 fe:00 42      /x/lib/libcudart.so.13 (deleted)",
                Some("/x/lib/libcudart.so.13"),
            ),
            (
                "7f00-7f10 r--p 00000000 00:00 0          [heap]",
                Some("[heap]"),
            ),
            ("7f00-7f10 rw-p 00000000 00:00 0 ", None),
            ("7f00-7f10 rw-p 00000000 00:00 0", None),
            ("", None),
        ];
        for (line, want) in cases {
            assert_eq!(
                maps_line_path(line.as_bytes()),
                want.map(str::as_bytes),
                "{line:?}"
            );
        }
        // A path that is not UTF-8 is read like the others, and the lines around it too.
        let maps = b"7f00-7f10 r--p 00000000 fe:00 7      /tmp/\xff/x.so\n\
                     7f10-7f20 r-xp 00000000 fe:00 8      /opt/cuda/libcudart.so.12\n";
        use std::os::unix::ffi::OsStrExt;
        assert_eq!(
            maps_paths(maps),
            [
                PathBuf::from(std::ffi::OsStr::from_bytes(b"/tmp/\xff/x.so")),
                PathBuf::from("/opt/cuda/libcudart.so.12"),
            ]
        );
        // This test binary's own maps name its executable, whole.
        let exe = std::env::current_exe().unwrap();
        assert!(mapped_files().contains(&exe), "{}", exe.display());
    }

    #[test]
    fn major_versions_are_ordered_needed_first_without_duplicates() {
        assert_eq!(cuda_major_order(&[]), vec![13, 12]);
        assert_eq!(cuda_major_order(&[12]), vec![12, 13]);
        assert_eq!(cuda_major_order(&[13]), vec![13, 12]);
        assert_eq!(cuda_major_order(&[11, 12]), vec![11, 12, 13]);
        assert_eq!(cudart_major("libcudart.so.12"), Some(12));
        assert_eq!(cudart_major("libcudart.so.13.0.96"), None);
        assert_eq!(cudart_major("libcudart.so"), None);
        assert_eq!(cudart_major("libcudart-9335f6a2.so.12"), Some(12));
        assert_eq!(cudart_major("libcudart-.so.12"), None);
        assert_eq!(cudart_major("libcudart-9335f6a2.so"), None);
        assert_eq!(cudart_major("libcudart_static.a"), None);
    }

    /// A libtorch archive's folder that bundles its runtime under a hashed name: that file
    /// comes first; names it does not hold, and other libraries, are no candidates.
    #[test]
    fn a_runtime_bundled_under_a_hashed_name_is_found() {
        let dir = std::env::temp_dir().join(format!("nccl-sys-bundled-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libcudart-abcd1234.so.12"), b"").unwrap();
        let needed = ["libc10.so", "libcudart-abcd1234.so.12", "libcudart.so.13"].map(String::from);
        assert_eq!(
            bundled_cudart(&dir, &needed),
            vec![dir.join("libcudart-abcd1234.so.12")]
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_setup_libtorch_needs_cuda_13() {
        // The setup installs torch 2.13's CUDA 13 wheel; its libc10_cuda.so says so.
        let lib = torch_lib_dirs()
            .into_iter()
            .map(|d| d.join("libc10_cuda.so"))
            .find(|p| p.is_file())
            .expect("the setup's libtorch has libc10_cuda.so");
        let needed = needed_libraries(&lib).unwrap();
        assert!(needed.iter().any(|n| n == "libc10.so"), "{needed:?}");
        assert_eq!(needed_cuda_majors(&lib), vec![13]);
        // Not an ELF file: nothing needed, no panic.
        let text = std::env::temp_dir().join(format!("nccl-sys-not-elf-{}", std::process::id()));
        std::fs::write(
            &text,
            b"not an ELF file at all, but long enough for a header ........",
        )
        .unwrap();
        assert_eq!(needed_cuda_majors(&text), Vec::<u32>::new());
        std::fs::remove_file(text).unwrap();
    }
}
