//! Making CUDA visible to a tch program, asking how many GPUs there are, and which one a
//! rank uses ([`rank_device`]).
//!
//! rustc links with `--as-needed`, so a tch binary that calls nothing from
//! `libtorch_cuda.so` does not load it, and `tch::Cuda::is_available()` is then false even on
//! a GPU machine. [`load_torch_cuda`] opens it explicitly, with `RTLD_GLOBAL`, so libtorch's
//! CUDA kernels and allocator register themselves; call it before any CUDA query.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::CommError;

/// The libtorch `lib` folders searched, best first (see [`nccl_sys::search::torch_lib_dirs`]:
/// the folder of the `libtorch_cpu.so` this process already uses, then `$LIBTORCH/lib`, then
/// `$DDP_DEPS_DIR/libtorch/lib`, then `.deps/libtorch/lib` above the executable).
pub fn torch_lib_dirs() -> Vec<PathBuf> {
    nccl_sys::search::torch_lib_dirs()
}

/// Loads `libtorch_cuda.so` from the libtorch folder with `RTLD_NOW | RTLD_GLOBAL` (once per
/// process). Returns `Ok(true)` when loaded, `Ok(false)` when no libtorch folder has one (a
/// CPU-only libtorch), and an error when the file exists but cannot be loaded.
pub fn load_torch_cuda() -> Result<bool, CommError> {
    static LOADED: OnceLock<Result<bool, String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let Some(path) = torch_lib_dirs()
                .into_iter()
                .map(|d| d.join("libtorch_cuda.so"))
                .find(|p| p.exists())
            else {
                return Ok(false);
            };
            let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
            // SAFETY: `c_path` is a valid NUL-terminated path; the handle is intentionally
            // never closed, so the library stays loaded for the life of the process.
            let handle =
                unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if handle.is_null() {
                // SAFETY: dlerror returns a thread-local NUL-terminated message or null.
                let why = unsafe {
                    let msg = libc::dlerror();
                    if msg.is_null() {
                        "unknown error".into()
                    } else {
                        std::ffi::CStr::from_ptr(msg).to_string_lossy().into_owned()
                    }
                };
                return Err(format!("cannot load '{}': {why}", path.display()));
            }
            Ok(true)
        })
        .clone()
        .map_err(|detail| CommError::Nccl {
            call: "dlopen(libtorch_cuda.so)",
            detail,
        })
}

/// Number of CUDA devices the CUDA runtime sees; 0 when the runtime cannot be loaded or
/// reports no device or no driver.
pub fn device_count() -> usize {
    let Ok(cudart) = nccl_sys::Cudart::load() else {
        return 0;
    };
    let mut count = 0;
    // SAFETY: `count` is a valid out-pointer for the duration of the call.
    let rc = unsafe { (cudart.cudaGetDeviceCount)(&mut count) };
    if rc == nccl_sys::cudaError_t::cudaSuccess {
        count.max(0) as usize
    } else {
        0
    }
}

/// The CUDA device of the rank with `local_rank` on its machine, among the `count` devices
/// this process sees: `cuda:local_rank`, or `cuda:0` for any local rank when
/// `CUDA_VISIBLE_DEVICES` is set (`visible_set`) and shows one device only (`srun
/// --gpus-per-task=1`, or a launcher that binds one GPU to each rank). Any other local rank
/// past the visible devices is [`CommError::InvalidArgument`], naming the fix: ranks must
/// not share a GPU silently. The default device of a group's NCCL collectives, and of
/// ddp-train's ranks.
pub fn rank_device(local_rank: usize, count: usize, visible_set: bool) -> Result<usize, CommError> {
    match (local_rank < count, count, visible_set) {
        (true, _, _) => Ok(local_rank),
        (false, 1, true) => Ok(0),
        (false, _, _) => Err(CommError::InvalidArgument(format!(
            "LOCAL_RANK {local_rank} needs cuda:{local_rank}, but only {count} CUDA devices are \
             visible (with one per rank, set CUDA_VISIBLE_DEVICES to each rank's own)"
        ))),
    }
}

/// Why there is no usable GPU, or `None` when there is one: the text GPU tests print when
/// they skip.
pub fn no_gpu_reason() -> Option<String> {
    let cudart = match nccl_sys::Cudart::load() {
        Ok(c) => c,
        Err(e) => return Some(format!("CUDA runtime not loadable: {e}")),
    };
    let mut count = 0;
    // SAFETY: `count` is a valid out-pointer for the duration of the call.
    let rc = unsafe { (cudart.cudaGetDeviceCount)(&mut count) };
    if rc != nccl_sys::cudaError_t::cudaSuccess {
        return Some(format!(
            "cudaGetDeviceCount failed: {}",
            cuda_error_string(rc)
        ));
    }
    (count == 0).then(|| "no CUDA device".to_string())
}

/// The CUDA runtime's text for an error code.
pub(crate) fn cuda_error_string(rc: nccl_sys::cudaError_t) -> String {
    match nccl_sys::Cudart::load() {
        // SAFETY: cudaGetErrorString returns a static NUL-terminated string for any code.
        Ok(c) => unsafe { std::ffi::CStr::from_ptr((c.cudaGetErrorString)(rc)) }
            .to_string_lossy()
            .into_owned(),
        Err(_) => format!("cudaError {}", rc.0),
    }
}

#[cfg(test)]
mod tests {
    use crate::error::CommError;

    #[test]
    fn a_rank_uses_its_local_device_or_the_one_bound_to_it() {
        assert_eq!(super::rank_device(1, 4, false).unwrap(), 1);
        assert_eq!(super::rank_device(1, 4, true).unwrap(), 1);
        // srun --gpus-per-task=1: each task sees its own GPU as cuda:0.
        assert_eq!(super::rank_device(3, 1, true).unwrap(), 0);
        // One GPU for all, nothing bound: two ranks must not share it silently.
        match super::rank_device(1, 1, false) {
            Err(CommError::InvalidArgument(why)) => assert!(
                why.starts_with("LOCAL_RANK 1 needs cuda:1, but only 1 CUDA devices"),
                "{why}"
            ),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        assert!(super::rank_device(2, 2, true).is_err());
    }

    #[test]
    fn torch_cuda_loads_from_the_setup_install() {
        // The setup installs the CUDA build of libtorch, which loads without a GPU.
        assert!(super::load_torch_cuda().unwrap());
        assert!(super::torch_lib_dirs()[0].join("libtorch_cuda.so").exists());
    }
}
