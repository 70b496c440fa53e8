//! The one error type of the crate.

use tch::Kind;

/// What went wrong in a call into the shim.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TchExtError {
    /// libtorch raised an error (a `c10::Error` or another C++ exception), caught at the
    /// shim's boundary; the message says which operation failed and why.
    #[error("{0}")]
    Torch(String),
    /// The process sees no CUDA device, or libtorch's CUDA backend is not loaded (rustc links
    /// with `--as-needed`, so a program must load `libtorch_cuda.so` itself, see
    /// [`cuda_is_available`](crate::cuda_is_available)).
    #[error("no CUDA device (none visible, or libtorch_cuda is not loaded)")]
    NoCuda,
    /// A CUDA device index past the devices this process sees.
    #[error("CUDA device {device} does not exist: this process sees {count}")]
    NoSuchDevice {
        /// The index asked for.
        device: usize,
        /// How many devices there are.
        count: usize,
    },
    /// An event recorded on, or waited for by, a stream of another device.
    #[error("event of CUDA device {event} used with a stream of CUDA device {stream}")]
    DeviceMismatch {
        /// The event's device.
        event: usize,
        /// The stream's device.
        stream: usize,
    },
    /// Autocast asked for a dtype other than `BFloat16` or `Half`.
    #[error("autocast dtype must be BFloat16 or Half, not {0:?}")]
    AutocastDtype(Kind),
}
