//! The loader against the setup's install (no GPU needed): NCCL opens from the torch wheel
//! with every symbol we use, reports a version at or above the minimum, and creates 128-byte
//! unique ids. Nothing here pins one release: the GPU machine's PyTorch brings another NCCL.

use nccl_sys::{
    ncclResult_t, ncclUniqueId, version_string, Nccl, MIN_VERSION_CODE, NCCL_UNIQUE_ID_BYTES,
};

#[test]
fn nccl_loads_from_the_torch_wheel() {
    let nccl = Nccl::load().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        nccl.path.ends_with("nvidia/nccl/lib/libnccl.so.2"),
        "loaded from {}",
        nccl.path.display()
    );
    assert!(nccl.path.is_absolute());
}

#[test]
fn nccl_version_is_at_least_the_minimum() {
    let nccl = Nccl::load().unwrap_or_else(|e| panic!("{e}"));
    let mut code = 0;
    // SAFETY: `code` is a valid out-pointer for the duration of the call.
    let rc = unsafe { (nccl.ncclGetVersion)(&mut code) };
    assert_eq!(rc, ncclResult_t::ncclSuccess);
    let version = version_string(code);
    assert!(
        code >= MIN_VERSION_CODE,
        "NCCL version {version} (code {code}) is older than {}",
        version_string(MIN_VERSION_CODE)
    );
    assert!(version.starts_with("2."), "NCCL version {version}");
}

#[test]
fn unique_id_has_128_bytes_and_differs_per_call() {
    let nccl = Nccl::load().unwrap_or_else(|e| panic!("{e}"));
    let mut a = ncclUniqueId {
        internal: [0; NCCL_UNIQUE_ID_BYTES],
    };
    let mut b = a;
    // SAFETY: `a` and `b` are valid, writable ncclUniqueId values.
    let (ra, rb) = unsafe {
        (
            (nccl.ncclGetUniqueId)(&mut a),
            (nccl.ncclGetUniqueId)(&mut b),
        )
    };
    assert_eq!(
        (ra, rb),
        (ncclResult_t::ncclSuccess, ncclResult_t::ncclSuccess)
    );
    assert_eq!(std::mem::size_of_val(&a.internal), 128);
    assert_ne!(a.internal, [0; 128], "unique id left all zero");
    assert_ne!(a, b, "two unique ids are equal");
}

#[test]
fn error_strings_are_readable() {
    let nccl = Nccl::load().unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let text = unsafe {
        std::ffi::CStr::from_ptr((nccl.ncclGetErrorString)(ncclResult_t::ncclInvalidArgument))
    };
    assert!(
        text.to_string_lossy().to_lowercase().contains("invalid"),
        "{text:?}"
    );
}

#[test]
fn cudart_loads_and_device_count_answers() {
    let cudart = nccl_sys::Cudart::load().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        cudart.path.ends_with("nvidia/cu13/lib/libcudart.so.13"),
        "{}",
        cudart.path.display()
    );
    let mut version = 0;
    // SAFETY: `version` is a valid out-pointer.
    let rc = unsafe { (cudart.cudaRuntimeGetVersion)(&mut version) };
    assert_eq!(rc, nccl_sys::cudaError_t::cudaSuccess);
    assert!(version >= 13000, "runtime version {version}");
    let mut count = -1;
    // SAFETY: `count` is a valid out-pointer. Without a GPU the call fails with an error
    // code (no device / no driver) rather than crashing.
    let rc = unsafe { (cudart.cudaGetDeviceCount)(&mut count) };
    // (The runtime answers success only with at least one device.)
    if rc != nccl_sys::cudaError_t::cudaSuccess {
        println!("skipped: no GPU: cudaGetDeviceCount returned {}", rc.0);
    } else {
        assert!(count >= 1, "{count} devices");
    }
}
