//! Run-time-loaded raw bindings to NCCL and the CUDA runtime calls it needs.
//!
//! Nothing here is linked at build time: [`Nccl::load`] and [`Cudart::load`] open
//! `libnccl.so.2` and `libcudart.so.N` (CUDA 13 or 12) with `dlopen` (through `libloading`) the first time
//! they are called, so this crate builds, and its loader tests run, on machines without CUDA.
//! The two central types are tables of raw `extern "C"` function pointers; there are no safe
//! wrappers here (`ddp-comm` holds the safe API).
//!
//! Where the libraries are looked for is described in [`search`]; in short: an explicit path
//! from `DDP_NCCL_LIBRARY` / `DDP_CUDART_LIBRARY`, else the `nvidia/nccl/lib` and CUDA
//! runtime folders of the PyTorch wheel that provides libtorch (libtorch's own CUDA major
//! first), else the system's library search path.
//!
//! ```no_run
//! let nccl = nccl_sys::Nccl::load()?;
//! let mut version = 0;
//! // SAFETY: `version` is a valid out-pointer for the duration of the call.
//! let rc = unsafe { (nccl.ncclGetVersion)(&mut version) };
//! assert_eq!(rc, nccl_sys::ncclResult_t::ncclSuccess);
//! println!("NCCL {}", nccl_sys::version_string(version));
//! # Ok::<(), nccl_sys::LoadError>(())
//! ```

#![warn(missing_docs)]
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

mod library;
pub mod search;
mod types;

pub use library::{Cudart, LoadError, Nccl};
pub use types::*;
