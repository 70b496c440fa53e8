//! Compiles the C++ shim in `csrc/` against the libtorch that torch-sys links, and lets this
//! crate's tests and doctests find libtorch at run time.
//!
//! The shim must be compiled exactly like torch-sys's own wrapper (same headers, C++17, same
//! `_GLIBCXX_USE_CXX11_ABI`), or `std::string`-carrying types such as `c10::Error` would not
//! match between the two. It uses only device-generic c10 interfaces (`c10::Stream`,
//! `c10::Event`), so it needs no CUDA headers and links only `torch_cpu` and `c10`: the CUDA
//! backend is found at run time through the device-guard registry that `libc10_cuda` fills
//! when it is loaded.

include!("../build-support/libtorch.rs");

const SOURCES: [&str; 7] = [
    "csrc/hooks.cpp",
    "csrc/function.cpp",
    "csrc/autocast.cpp",
    "csrc/cuda.cpp",
    "csrc/ops.cpp",
    "csrc/graph.cpp",
    "csrc/version.cpp",
];

fn main() {
    println!("cargo:rerun-if-changed=csrc/tch_ext.h");
    for source in SOURCES {
        println!("cargo:rerun-if-changed={source}");
    }

    // The libtorch torch-sys took, found as torch-sys finds it (torch-sys does not pass its
    // headers on), save its last resort: a libtorch in /usr, with nothing set.
    let Some(libtorch) = libtorch() else {
        libtorch_missing("neither LIBTORCH nor LIBTORCH_USE_PYTORCH is set");
    };
    if !libtorch
        .includes
        .iter()
        .any(|dir| dir.join("torch").is_dir())
    {
        let dirs: Vec<_> = libtorch
            .includes
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        libtorch_missing(&format!("no torch/ headers in '{}'", dirs.join("', '")));
    }

    cc::Build::new()
        .cpp(true)
        .pic(true)
        .std("c++17")
        .includes(&libtorch.includes)
        .include("csrc")
        .define("_GLIBCXX_USE_CXX11_ABI", libtorch.cxx11_abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        // libtorch's headers are not warning-clean under -Wall (torch-sys turns warnings off
        // too); the shim's own files are (g++ -Wall -Wextra -fsyntax-only).
        .warnings(false)
        .files(SOURCES)
        .compile("tch_ext");

    println!("cargo:rustc-link-search=native={}", libtorch.lib.display());
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
    libtorch_rpath_to(&libtorch.lib);
}
