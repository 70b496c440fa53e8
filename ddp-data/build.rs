//! Lets this crate's binaries, tests, examples and doctests find libtorch at run time (an
//! rpath; why, in `build-support/libtorch.rs`, shared by every crate that links libtorch).
//! Without the `tch` feature nothing links libtorch (`ddp-gen-data`, the lean builds), so
//! nothing is looked for: those build before `cargo xtask setup`.

include!("../build-support/libtorch.rs");

fn main() {
    // Without it (and without the tch feature's lines) cargo reruns this on any change in
    // the package.
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_TCH").is_some() {
        libtorch_rpath();
    }
}
