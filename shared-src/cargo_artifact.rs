// The one copy of how an executable is found in cargo's `compiler-artifact` messages
// (`--message-format=json`), `include!`d by xtask's `artifact.rs` (which tests it) and by
// xtask's tests (`tests/common/mod.rs`), which cannot reach a binary crate's modules.

/// The executable of target `name` of kind `kind` if `line` is cargo's `compiler-artifact`
/// message for it; `None` for any other line, JSON or not.
fn executable(line: &str, kind: &str, name: &str) -> Option<std::path::PathBuf> {
    let msg: serde_json::Value = serde_json::from_str(line).ok()?;
    let target = &msg["target"];
    let of_kind = target["kind"]
        .as_array()
        .is_some_and(|kinds| kinds.iter().any(|k| k == kind));
    (msg["reason"] == "compiler-artifact" && of_kind && target["name"] == name)
        .then(|| msg["executable"].as_str().map(std::path::PathBuf::from))
        .flatten()
}
