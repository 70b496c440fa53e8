//! The loader: one table of function pointers per library, opened once per process.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::fmt;
use std::path::PathBuf;
use std::sync::OnceLock;

use libloading::Library;

use crate::search;
use crate::types::*;

/// A library could not be opened, or lacks a symbol.
#[derive(Debug, Clone)]
pub struct LoadError {
    /// The library's file name.
    pub library: &'static str,
    /// Every path tried, in order, each with the loader's message; where a symbol is missing,
    /// the last is the library that opened, with the message about the symbol.
    pub attempts: Vec<(PathBuf, String)>,
    /// The symbol that was missing, if the library opened but lacks one.
    pub missing_symbol: Option<&'static str>,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(symbol) = self.missing_symbol {
            let path = self.attempts.last().map(|(p, _)| p.display().to_string());
            return write!(
                f,
                "{} at '{}' has no symbol '{symbol}'",
                self.library,
                path.unwrap_or_default()
            );
        }
        write!(f, "could not load {}; looked at:", self.library)?;
        for (path, why) in &self.attempts {
            write!(f, " '{}' ({why});", path.display())?;
        }
        write!(
            f,
            " set {} to the library file",
            if self.library == search::NCCL_NAME {
                search::NCCL_ENV
            } else {
                search::CUDART_ENV
            }
        )
    }
}

impl std::error::Error for LoadError {}

/// A library that opened, and the paths tried before it, each with the loader's message.
struct Opened {
    library: Library,
    path: PathBuf,
    failed: Vec<(PathBuf, String)>,
}

fn open(library: &'static str, candidates: Vec<PathBuf>) -> Result<Opened, LoadError> {
    let mut attempts = Vec::new();
    for path in candidates {
        // A path with a folder that does not exist is reported without asking dlopen.
        if path.components().count() > 1 && !path.exists() {
            attempts.push((path, "no such file".to_string()));
            continue;
        }
        // SAFETY: opening NCCL or the CUDA runtime runs their ELF initialisers, which have no
        // preconditions on the caller.
        match unsafe { Library::new(&path) } {
            Ok(library) => {
                return Ok(Opened {
                    library,
                    path,
                    failed: attempts,
                })
            }
            Err(e) => attempts.push((path, e.to_string())),
        }
    }
    Err(LoadError {
        library,
        attempts,
        missing_symbol: None,
    })
}

macro_rules! function_table {
    (
        $(#[$meta:meta])*
        $table:ident, $name:expr, $candidates:path, $cell:ident {
            $( $(#[$fmeta:meta])* fn $fname:ident( $($arg:ident : $ty:ty),* ) -> $ret:ty; )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug)]
        pub struct $table {
            /// The file that was opened.
            pub path: PathBuf,
            $( $(#[$fmeta])* pub $fname: unsafe extern "C" fn($($ty),*) -> $ret, )*
            _library: Library,
        }

        static $cell: OnceLock<Result<$table, LoadError>> = OnceLock::new();

        impl $table {
            /// Opens the library (once per process; later calls return the same table) and
            /// resolves every symbol. See [`crate::search`] for where it looks.
            pub fn load() -> Result<&'static $table, LoadError> {
                $cell
                    .get_or_init(|| Self::open_first($candidates()))
                    .as_ref()
                    .map_err(Clone::clone)
            }

            /// The table of the first of `candidates` that opens.
            fn open_first(candidates: Vec<PathBuf>) -> Result<$table, LoadError> {
                let Opened { library, path, failed } = open($name, candidates)?;
                // The paths that failed, then the one that opened and its loader's message.
                let missing = |symbol: &'static str, e: libloading::Error| {
                    let mut attempts = failed.clone();
                    attempts.push((path.clone(), e.to_string()));
                    LoadError {
                        library: $name,
                        attempts,
                        missing_symbol: Some(symbol),
                    }
                };
                $(
                    // SAFETY: the symbol's C signature in the NCCL / CUDA headers is the
                    // function-pointer type declared in this table.
                    let $fname = unsafe {
                        *library
                            .get::<unsafe extern "C" fn($($ty),*) -> $ret>(
                                concat!(stringify!($fname), "\0").as_bytes(),
                            )
                            .map_err(|e| missing(stringify!($fname), e))?
                    };
                )*
                Ok($table { path, $($fname,)* _library: library })
            }
        }
    };
}

function_table! {
    /// NCCL's entry points that data-parallel training needs.
    Nccl, search::NCCL_NAME, search::nccl_candidates, NCCL {
        /// `ncclGetVersion(int* version)`.
        fn ncclGetVersion(version: *mut c_int) -> ncclResult_t;
        /// `ncclGetUniqueId(ncclUniqueId* uniqueId)`.
        fn ncclGetUniqueId(unique_id: *mut ncclUniqueId) -> ncclResult_t;
        /// `ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank)`.
        fn ncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int) -> ncclResult_t;
        /// `ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
        /// ncclConfig_t* config)` (NCCL >= 2.14): with `config.blocking = 0` it may return
        /// `ncclInProgress`; poll `ncclCommGetAsyncError` until it is done.
        fn ncclCommInitRankConfig(comm: *mut ncclComm_t, nranks: c_int, id: ncclUniqueId, rank: c_int, config: *mut ncclConfig_t) -> ncclResult_t;
        /// `ncclCommDestroy(ncclComm_t comm)`.
        fn ncclCommDestroy(comm: ncclComm_t) -> ncclResult_t;
        /// `ncclCommAbort(ncclComm_t comm)`.
        fn ncclCommAbort(comm: ncclComm_t) -> ncclResult_t;
        /// `ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError)`.
        fn ncclCommGetAsyncError(comm: ncclComm_t, async_error: *mut ncclResult_t) -> ncclResult_t;
        /// `ncclCommCount(const ncclComm_t comm, int* count)`.
        fn ncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t;
        /// `ncclCommCuDevice(const ncclComm_t comm, int* device)`.
        fn ncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t;
        /// `ncclCommUserRank(const ncclComm_t comm, int* rank)`.
        fn ncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t;
        /// `ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)`.
        fn ncclAllReduce(send: *const c_void, recv: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        /// `ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)`.
        fn ncclBroadcast(send: *const c_void, recv: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        /// `ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)`.
        fn ncclAllGather(send: *const c_void, recv: *mut c_void, send_count: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        /// `ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)`.
        fn ncclReduceScatter(send: *const c_void, recv: *mut c_void, recv_count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t;
        /// `ncclGroupStart()`.
        fn ncclGroupStart() -> ncclResult_t;
        /// `ncclGroupEnd()`.
        fn ncclGroupEnd() -> ncclResult_t;
        /// `ncclGetErrorString(ncclResult_t result)`: a static string.
        fn ncclGetErrorString(result: ncclResult_t) -> *const c_char;
        /// `ncclGetLastError(ncclComm_t comm)`: the last error's detail (may be empty).
        fn ncclGetLastError(comm: ncclComm_t) -> *const c_char;
    }
}

function_table! {
    /// The CUDA runtime calls around NCCL and the input pipeline: devices, streams, events,
    /// pinned host memory, errors.
    Cudart, search::CUDART_NAME, search::cudart_candidates, CUDART {
        /// `cudaGetDeviceCount(int* count)`.
        fn cudaGetDeviceCount(count: *mut c_int) -> cudaError_t;
        /// `cudaSetDevice(int device)`.
        fn cudaSetDevice(device: c_int) -> cudaError_t;
        /// `cudaGetDevice(int* device)`.
        fn cudaGetDevice(device: *mut c_int) -> cudaError_t;
        /// `cudaDeviceSynchronize()`.
        fn cudaDeviceSynchronize() -> cudaError_t;
        /// `cudaStreamSynchronize(cudaStream_t stream)`.
        fn cudaStreamSynchronize(stream: cudaStream_t) -> cudaError_t;
        /// `cudaStreamQuery(cudaStream_t stream)`: `cudaSuccess` when idle,
        /// `cudaErrorNotReady` while work is queued.
        fn cudaStreamQuery(stream: cudaStream_t) -> cudaError_t;
        /// `cudaGetLastError()`: the calling thread's last error, reset to `cudaSuccess`.
        /// libtorch, which shares this runtime, reads it after every kernel launch.
        fn cudaGetLastError() -> cudaError_t;
        /// `cudaPeekAtLastError()`: the calling thread's last error, left as it is.
        fn cudaPeekAtLastError() -> cudaError_t;
        /// `cudaGetErrorString(cudaError_t error)`: a static string.
        fn cudaGetErrorString(error: cudaError_t) -> *const c_char;
        /// `cudaRuntimeGetVersion(int* version)`.
        fn cudaRuntimeGetVersion(version: *mut c_int) -> cudaError_t;
        /// `cudaHostRegister(void* ptr, size_t size, unsigned int flags)`: page-locks host
        /// memory so that copies from it can run asynchronously.
        fn cudaHostRegister(ptr: *mut c_void, size: usize, flags: c_uint) -> cudaError_t;
        /// `cudaHostUnregister(void* ptr)`.
        fn cudaHostUnregister(ptr: *mut c_void) -> cudaError_t;
        /// `cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags)`.
        fn cudaEventCreateWithFlags(event: *mut cudaEvent_t, flags: c_uint) -> cudaError_t;
        /// `cudaEventRecord(cudaEvent_t event, cudaStream_t stream)`.
        fn cudaEventRecord(event: cudaEvent_t, stream: cudaStream_t) -> cudaError_t;
        /// `cudaEventQuery(cudaEvent_t event)`: `cudaSuccess` once the work before the
        /// recorded point is done, `cudaErrorNotReady` before.
        fn cudaEventQuery(event: cudaEvent_t) -> cudaError_t;
        /// `cudaEventSynchronize(cudaEvent_t event)`.
        fn cudaEventSynchronize(event: cudaEvent_t) -> cudaError_t;
        /// `cudaEventDestroy(cudaEvent_t event)`.
        fn cudaEventDestroy(event: cudaEvent_t) -> cudaError_t;
        /// `cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags)`.
        fn cudaStreamCreateWithFlags(stream: *mut cudaStream_t, flags: c_uint) -> cudaError_t;
        /// `cudaStreamDestroy(cudaStream_t stream)`.
        fn cudaStreamDestroy(stream: cudaStream_t) -> cudaError_t;
        /// `cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags)`:
        /// work queued on `stream` later waits for the event.
        fn cudaStreamWaitEvent(stream: cudaStream_t, event: cudaEvent_t, flags: c_uint) -> cudaError_t;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paths that failed before the one that opened stay in the error when a symbol is
    /// missing from it (libc opens, but has no NCCL).
    #[test]
    fn a_missing_symbol_keeps_the_paths_tried_before() {
        let absent = PathBuf::from("/nonexistent/ddp-nccl-sys/libnccl.so.2");
        let libc = PathBuf::from("libc.so.6");
        let err = Nccl::open_first(vec![absent.clone(), libc.clone()]).unwrap_err();
        assert_eq!(err.missing_symbol, Some("ncclGetVersion"));
        let paths: Vec<&PathBuf> = err.attempts.iter().map(|(p, _)| p).collect();
        assert_eq!(paths, [&absent, &libc]);
        assert_eq!(err.attempts[0].1, "no such file");
        assert!(
            err.attempts[1].1.contains("ncclGetVersion"),
            "{:?}",
            err.attempts[1]
        );
        assert_eq!(
            err.to_string(),
            "libnccl.so.2 at 'libc.so.6' has no symbol 'ncclGetVersion'"
        );
    }
}
