//! Lets xtask's binary run when a workspace-wide build (`cargo test --workspace`) unifies
//! ddp-data's `tch` feature into it. Built alone (`cargo xtask`), xtask links no libtorch.
//!
//! `cargo xtask setup` installs libtorch under `.deps/` and `.cargo/config.toml` points
//! `LIBTORCH` there. rustc links with `--as-needed` and cargo overwrites `LD_LIBRARY_PATH`,
//! so the only robust way to find `libtorch_cpu.so` at run time is an rpath to the real
//! (symlink-resolved) library folder: the libraries' own `$ORIGIN`-relative run paths
//! (CUDA, NCCL) then resolve inside the Python wheel they came from.

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Some(dir) = std::env::var_os("LIBTORCH") {
        let lib = std::path::Path::new(&dir).join("lib");
        let lib = std::fs::canonicalize(&lib).unwrap_or(lib);
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}
