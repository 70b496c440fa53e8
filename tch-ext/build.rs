//! Compiles the C++ shim in `csrc/` against the libtorch that torch-sys links, and lets this
//! crate's tests and doctests find libtorch at run time.
//!
//! The shim must be compiled exactly like torch-sys's own wrapper (same headers, C++17, same
//! `_GLIBCXX_USE_CXX11_ABI`), or `std::string`-carrying types such as `c10::Error` would not
//! match between the two. It uses only device-generic c10 interfaces (`c10::Stream`,
//! `c10::Event`), so it needs no CUDA headers and links only `torch_cpu` and `c10`: the CUDA
//! backend is found at run time through the device-guard registry that `libc10_cuda` fills
//! when it is loaded.

use std::path::PathBuf;

include!("../build-support/libtorch.rs");

const SOURCES: [&str; 6] = [
    "csrc/hooks.cpp",
    "csrc/function.cpp",
    "csrc/autocast.cpp",
    "csrc/cuda.cpp",
    "csrc/ops.cpp",
    "csrc/graph.cpp",
];

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_INCLUDE");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-changed=csrc/tch_ext.h");
    for source in SOURCES {
        println!("cargo:rerun-if-changed={source}");
    }

    // The same variables, with the same precedence, as torch-sys's build script; but the
    // headers are not among what torch-sys passes on, so LIBTORCH must name them.
    let Some(libtorch) = std::env::var_os("LIBTORCH").map(PathBuf::from) else {
        libtorch_missing("LIBTORCH is not set");
    };
    let include =
        std::env::var_os("LIBTORCH_INCLUDE").map_or_else(|| libtorch.clone(), PathBuf::from);
    let lib = libtorch_lib().unwrap_or_else(|| libtorch.join("lib"));
    if !include.join("include/torch").is_dir() {
        libtorch_missing(&format!("'{}' holds no include/torch", include.display()));
    }
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());

    cc::Build::new()
        .cpp(true)
        .pic(true)
        .std("c++17")
        .include(include.join("include"))
        .include(include.join("include/torch/csrc/api/include"))
        .include("csrc")
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        // libtorch's headers are not warning-clean under -Wall (torch-sys turns warnings off
        // too); the shim's own files are (g++ -Wall -Wextra -fsyntax-only).
        .warnings(false)
        .files(SOURCES)
        .compile("tch_ext");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
    libtorch_rpath();
}
