//! Building a binary or bench with cargo and finding its executable in cargo's own
//! `compiler-artifact` messages (`--message-format=json`), instead of guessing
//! `target/<profile>/<name>` (which `CARGO_TARGET_DIR`, `--target` or a build-dir setting
//! would make wrong).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{bail, Context, Result};

/// Runs cargo with `args` (a `build` or `bench --no-run`), JSON messages on stdout and
/// rendered diagnostics on stderr, and returns the executable of the target of kind `kind`
/// (`bin`, `bench`) named `name`.
pub fn build(root: &Path, args: &[&str], kind: &str, name: &str) -> Result<PathBuf> {
    let mut cmd = crate::cargo();
    cmd.current_dir(root)
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let line = format!("{cmd:?}");
    let out = cmd
        .output()
        .with_context(|| format!("cannot start {line}"))?;
    if !out.status.success() {
        bail!("{line} failed ({})", out.status);
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| executable(l, kind, name))
        .with_context(|| format!("{line} reported no executable for {kind} {name}"))
}

include!("../../shared-src/cargo_artifact.rs");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_executable_in_cargos_messages() {
        let art = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/ddp-sampler#0.1.0","manifest_path":"/w/ddp-sampler/Cargo.toml","target":{"kind":["bench"],"crate_types":["bin"],"name":"sampler","src_path":"/w/ddp-sampler/benches/sampler.rs","edition":"2021","doc":false,"doctest":false,"test":false},"profile":{"opt_level":"3","debuginfo":1,"debug_assertions":false,"overflow_checks":false,"test":false},"features":[],"filenames":["/t/release/deps/sampler-1a"],"executable":"/t/release/deps/sampler-1a","fresh":true}"#;
        assert_eq!(
            executable(art, "bench", "sampler"),
            Some(PathBuf::from("/t/release/deps/sampler-1a"))
        );
        assert_eq!(executable(art, "bench", "loader"), None);
        assert_eq!(executable(art, "bin", "sampler"), None);
        let bin = r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"ddp-train"},"executable":"/t/release/ddp-train","fresh":false}"#;
        assert_eq!(
            executable(bin, "bin", "ddp-train"),
            Some(PathBuf::from("/t/release/ddp-train"))
        );
        // The library of the same package: an artifact, no executable.
        let lib = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"sampler"},"executable":null,"fresh":true}"#;
        assert_eq!(executable(lib, "bench", "sampler"), None);
        let done = r#"{"reason":"build-finished","success":true}"#;
        assert_eq!(executable(done, "bench", "sampler"), None);
        assert_eq!(
            executable("   Compiling sampler v0.1.0", "bench", "sampler"),
            None
        );
    }
}
