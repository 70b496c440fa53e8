// The libtorch version the workspace binds (tch 0.26's), `include!`d by the build scripts
// (`build-support/libtorch.rs`), which name it when libtorch is missing. xtask's setup, which
// installs it, holds the same constant (`setup::TORCH_VERSION`); a test of xtask's
// (`main.rs`) checks that the two agree.

/// The libtorch version tch 0.26 binds.
#[allow(dead_code)] // Not every file that includes it names the version.
const TORCH_VERSION: &str = "2.13.0";
