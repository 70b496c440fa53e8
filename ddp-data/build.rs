//! Lets this crate's binaries, tests, examples and doctests find libtorch at run time (an
//! rpath; why, in `build-support/libtorch.rs`, shared by every crate that links libtorch).

include!("../build-support/libtorch.rs");

fn main() {
    libtorch_rpath();
}
