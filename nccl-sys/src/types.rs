//! C types, enums and result codes of `nccl.h` and `cuda_runtime_api.h`, as raw as they are.

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ncclResult_t`: every NCCL call's status.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ncclResult_t(pub c_int);

impl ncclResult_t {
    /// The call succeeded.
    pub const ncclSuccess: Self = Self(0);
    /// A CUDA call made by NCCL failed.
    pub const ncclUnhandledCudaError: Self = Self(1);
    /// A system call (socket, memory, ...) failed.
    pub const ncclSystemError: Self = Self(2);
    /// An NCCL bug or an inconsistent state.
    pub const ncclInternalError: Self = Self(3);
    /// A bad argument (null pointer, out-of-range value).
    pub const ncclInvalidArgument: Self = Self(4);
    /// A call sequence that NCCL does not allow.
    pub const ncclInvalidUsage: Self = Self(5);
    /// A remote peer failed or disconnected.
    pub const ncclRemoteError: Self = Self(6);
    /// A non-blocking operation is still in progress.
    pub const ncclInProgress: Self = Self(7);
}

/// `ncclDataType_t`: element type of a collective's buffers.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ncclDataType_t(pub c_int);

impl ncclDataType_t {
    /// `int8_t`.
    pub const ncclInt8: Self = Self(0);
    /// `uint8_t`.
    pub const ncclUint8: Self = Self(1);
    /// `int32_t`.
    pub const ncclInt32: Self = Self(2);
    /// `uint32_t`.
    pub const ncclUint32: Self = Self(3);
    /// `int64_t`.
    pub const ncclInt64: Self = Self(4);
    /// `uint64_t`.
    pub const ncclUint64: Self = Self(5);
    /// IEEE half precision.
    pub const ncclFloat16: Self = Self(6);
    /// `float`.
    pub const ncclFloat32: Self = Self(7);
    /// `double`.
    pub const ncclFloat64: Self = Self(8);
    /// bfloat16.
    pub const ncclBfloat16: Self = Self(9);
}

/// `ncclRedOp_t`: the reduction of a reducing collective.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ncclRedOp_t(pub c_int);

impl ncclRedOp_t {
    /// Sum.
    pub const ncclSum: Self = Self(0);
    /// Product.
    pub const ncclProd: Self = Self(1);
    /// Maximum.
    pub const ncclMax: Self = Self(2);
    /// Minimum.
    pub const ncclMin: Self = Self(3);
    /// Sum divided by the number of ranks (NCCL >= 2.10).
    pub const ncclAvg: Self = Self(4);
}

/// Size in bytes of [`ncclUniqueId`] (`NCCL_UNIQUE_ID_BYTES`).
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: the opaque token rank 0 creates and every rank passes to
/// `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclUniqueId {
    /// Opaque bytes.
    pub internal: [u8; NCCL_UNIQUE_ID_BYTES],
}

/// Opaque NCCL communicator.
#[repr(C)]
#[derive(Debug)]
pub struct ncclComm {
    _private: [u8; 0],
}

/// `ncclComm_t`: a communicator handle.
pub type ncclComm_t = *mut ncclComm;

/// `cudaStream_t`. The null pointer is the legacy default stream.
pub type cudaStream_t = *mut c_void;

/// `cudaEvent_t`: a marker recorded into a stream, to wait for the work before it.
pub type cudaEvent_t = *mut c_void;

/// `cudaEventDisableTiming`: the event records no timestamp (cheaper to record and query).
pub const cudaEventDisableTiming: std::ffi::c_uint = 0x02;
/// `cudaEventBlockingSync`: `cudaEventSynchronize` sleeps instead of spinning.
pub const cudaEventBlockingSync: std::ffi::c_uint = 0x01;
/// `cudaHostRegisterPortable`: registered memory counts as pinned in every CUDA context.
pub const cudaHostRegisterPortable: std::ffi::c_uint = 0x01;

/// `cudaError_t`: every CUDA runtime call's status.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct cudaError_t(pub c_int);

impl cudaError_t {
    /// The call succeeded.
    pub const cudaSuccess: Self = Self(0);
    /// Invalid device ordinal.
    pub const cudaErrorInvalidDevice: Self = Self(101);
    /// No CUDA-capable device is detected.
    pub const cudaErrorNoDevice: Self = Self(100);
    /// The driver is older than the runtime.
    pub const cudaErrorInsufficientDriver: Self = Self(35);
    /// Queued work is not finished yet (`cudaStreamQuery`).
    pub const cudaErrorNotReady: Self = Self(600);
}

/// The `ncclGetVersion` code of the oldest NCCL this crate works with: 2.14.0, the first release
/// with every symbol [`crate::Nccl`] loads (`ncclCommInitRankConfig` and non-blocking
/// communicators arrived in 2.14; `ncclGetLastError` and the `ncclRemoteError` result in 2.13;
/// `ncclAvg` and bfloat16 in 2.10). Newer releases keep these symbols, so any version at or
/// above this one works; the tests check the capability, not one release.
pub const MIN_VERSION_CODE: c_int = 21400;

/// `NCCL_API_MAGIC`: the `magic` of every config made by `NCCL_CONFIG_INITIALIZER`; NCCL
/// refuses a config without it.
pub const NCCL_API_MAGIC: c_uint = 0xcafe_beef;

/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`): an integer config field left to NCCL's default.
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// `NCCL_CONFIG_UNDEF_PTR` (`NULL`): a pointer config field left to NCCL's default.
pub const NCCL_CONFIG_UNDEF_PTR: *const c_char = std::ptr::null();

/// `ncclConfig_t` as NCCL 2.14 defined it (`ncclConfig_v21400`): the prefix that every later
/// release keeps, since fields are only ever appended.
///
/// NCCL copies `size` bytes of the caller's config over its own defaults and then resets
/// every field newer than `version` to its default, so this prefix, with `version` 2.14.0,
/// is a valid config for 2.14 and every later release: they read `blocking` and keep their
/// defaults for the rest. `size` is the C `sizeof` of the 2.14 struct, 24 bytes with the
/// trailing padding, which [`ncclConfig_t::reserved`] fills (where 2.17 put
/// `cgaClusterSize`, which NCCL resets for a 2.14 config; it holds `NCCL_CONFIG_UNDEF_INT`
/// anyway).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclConfig_t {
    /// `sizeof` of the struct the caller passes.
    pub size: usize,
    /// [`NCCL_API_MAGIC`].
    pub magic: c_uint,
    /// The `NCCL_VERSION_CODE` whose layout the caller uses: [`NCCL_CONFIG_VERSION`].
    pub version: c_uint,
    /// 1: calls block until done (NCCL's default); 0: calls may return `ncclInProgress`
    /// and the caller polls `ncclCommGetAsyncError`.
    pub blocking: c_int,
    /// The C struct's trailing padding, made explicit so that no byte is uninitialised.
    pub reserved: c_int,
}

/// The `version` of [`ncclConfig_t`]: 2.14.0, the release whose layout it mirrors.
pub const NCCL_CONFIG_VERSION: c_uint = 21400;

impl ncclConfig_t {
    /// `NCCL_CONFIG_INITIALIZER` for this layout: every option left to NCCL's default.
    pub const fn initializer() -> Self {
        ncclConfig_t {
            size: std::mem::size_of::<ncclConfig_t>(),
            magic: NCCL_API_MAGIC,
            version: NCCL_CONFIG_VERSION,
            blocking: NCCL_CONFIG_UNDEF_INT,
            reserved: NCCL_CONFIG_UNDEF_INT,
        }
    }
}

/// Formats an `ncclGetVersion` code (`major*10000 + minor*100 + patch` since 2.9) as
/// `"major.minor.patch"`.
pub fn version_string(code: c_int) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_format_in_both_encodings() {
        assert_eq!(version_string(22903), "2.29.3");
        assert_eq!(version_string(2804), "2.8.4");
    }

    #[test]
    fn the_config_is_the_2_14_layout_with_nccl_h_initial_values() {
        // nccl.h: size_t size; unsigned int magic; unsigned int version; int blocking;
        // NCCL_CONFIG_INITIALIZER = { sizeof, NCCL_API_MAGIC (0xcafebeef),
        // NCCL_VERSION_CODE, NCCL_CONFIG_UNDEF_INT (INT_MIN), ... }.
        assert_eq!(std::mem::size_of::<ncclConfig_t>(), 24);
        assert_eq!(std::mem::align_of::<ncclConfig_t>(), 8);
        assert_eq!(std::mem::offset_of!(ncclConfig_t, size), 0);
        assert_eq!(std::mem::offset_of!(ncclConfig_t, magic), 8);
        assert_eq!(std::mem::offset_of!(ncclConfig_t, version), 12);
        assert_eq!(std::mem::offset_of!(ncclConfig_t, blocking), 16);
        let c = ncclConfig_t::initializer();
        assert_eq!((c.size, c.magic, c.version), (24, 0xcafe_beef, 21400));
        assert_eq!((c.blocking, c.reserved), (-2147483648, -2147483648));
        assert!(NCCL_CONFIG_UNDEF_PTR.is_null());
        assert!(c.version as c_int >= MIN_VERSION_CODE);
    }

    #[test]
    fn unique_id_is_128_bytes() {
        assert_eq!(std::mem::size_of::<ncclUniqueId>(), 128);
    }
}
