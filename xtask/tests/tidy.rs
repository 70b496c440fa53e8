//! Tidy checks (after rust-analyzer's `tidy`): rules about the source text that keep the house
//! as `ARCHITECTURE.md` describes it. Each rule is a function over file texts, tested below
//! on a text that breaks it, then applied to the workspace.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The workspace members, from the root `Cargo.toml`.
fn members() -> Vec<String> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let start = manifest.find("members = [").expect("a members list");
    let end = start + manifest[start..].find(']').unwrap();
    manifest[start..end]
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// `(path relative to the root, text)` of every file of each crate's `src/`.
fn sources() -> Vec<(String, String)> {
    let root = root();
    members()
        .iter()
        .flat_map(|m| rust_files(&root.join(m).join("src")))
        .map(|p| {
            let rel = p
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            (rel, std::fs::read_to_string(&p).unwrap())
        })
        .collect()
}

/// The text before a file's unit-test module (`#[cfg(test)]` followed by `mod`).
fn before_tests(text: &str) -> &str {
    let mut offset = 0;
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    for (i, line) in lines.iter().enumerate() {
        if line.trim() == "#[cfg(test)]"
            && lines
                .get(i + 1)
                .is_some_and(|next| next.trim_start().starts_with("mod "))
        {
            return &text[..offset];
        }
        offset += line.len();
    }
    text
}

/// The code of a line: what is left after a `//` comment (strings are not parsed: a `//`
/// inside a string cuts the line short, which only hides code from the checks).
fn code(line: &str) -> &str {
    line.find("//").map_or(line, |i| &line[..i])
}

/// The lines of `text`'s code (before its tests) that hold one of `calls`.
fn lines_calling(text: &str, calls: &[&str]) -> Vec<usize> {
    before_tests(text)
        .lines()
        .enumerate()
        .filter(|(_, line)| calls.iter().any(|call| code(line).contains(call)))
        .map(|(i, _)| i + 1)
        .collect()
}

/// `path:line` of each line that `lines` finds in a source whose path `keep` keeps.
fn places(keep: impl Fn(&str) -> bool, lines: impl Fn(&str) -> Vec<usize>) -> Vec<String> {
    let sources = sources();
    let kept = sources.iter().filter(|(path, _)| keep(path));
    kept.flat_map(|(path, text)| lines(text).into_iter().map(move |l| format!("{path}:{l}")))
        .collect()
}

// ---------------------------------------------------------------------------------------
// Rule: no import cycle between the top-level modules of a crate.

/// A crate's top-level module of file `path` (relative to the crate's `src/`): `a.rs`,
/// `a/mod.rs` and `a/b.rs` are all module `a`; the crate root is `None`.
fn top_module(path: &str) -> Option<String> {
    let first = path.split('/').next()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(name, "lib" | "main" | "bin")).then(|| name.to_string())
}

/// The top-level modules that `text` names through `crate::` paths (also inside
/// `use crate::{a, b::c}` groups).
fn crate_references(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let line = code(line);
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            let after = &rest[i + "crate::".len()..];
            if let Some(group) = after.strip_prefix('{') {
                // Top-level names of the group: split at commas outside nested braces.
                let mut depth = 0;
                let mut name = String::new();
                let mut names = Vec::new();
                for c in group.chars() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => names.push(std::mem::take(&mut name)),
                        _ if depth == 0 => name.push(c),
                        _ => {}
                    }
                }
                names.push(name);
                for n in names {
                    let head: String = n
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if !head.is_empty() {
                        out.insert(head);
                    }
                }
            } else {
                let head: String = after
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !head.is_empty() {
                    out.insert(head);
                }
            }
            rest = &rest[i + "crate::".len()..];
        }
    }
    out
}

/// The import cycles between the top-level modules of one crate, given `(path relative to
/// src/, text)` of its files: each cycle as its modules in order, smallest first.
fn module_cycles(files: &[(String, String)]) -> Vec<Vec<String>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let modules: BTreeSet<String> = files.iter().filter_map(|(p, _)| top_module(p)).collect();
    for (path, text) in files {
        let Some(from) = top_module(path) else {
            continue;
        };
        let targets = edges.entry(from.clone()).or_default();
        for to in crate_references(before_tests(text)) {
            if to != from && modules.contains(&to) {
                targets.insert(to);
            }
        }
    }
    // Every elementary cycle through its smallest module (the graphs are small).
    let mut cycles = BTreeSet::new();
    for start in edges.keys() {
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        while let Some((node, path)) = stack.pop() {
            for next in edges.get(&node).into_iter().flatten() {
                if next == start {
                    cycles.insert(path.clone());
                } else if next > start && !path.contains(next) {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    cycles.into_iter().collect()
}

#[test]
fn module_cycles_are_found_and_only_cycles() {
    let file = |p: &str, t: &str| (p.to_string(), t.to_string());
    let cyclic = [
        file("a.rs", "use crate::b::X;"),
        file("b/mod.rs", "use crate::{c, d::Y};"),
        file("c.rs", "fn f() { crate::a::g() }"),
        file("d.rs", "use crate::a; // crate::c in a comment"),
        file("lib.rs", "pub use crate::a::*;"),
    ];
    assert_eq!(
        module_cycles(&cyclic),
        [vec!["a", "b", "c"], vec!["a", "b", "d"]]
    );
    let layered = [
        file("a.rs", "use crate::b::X;"),
        file("b.rs", "use crate::c::Y;"),
        file(
            "c.rs",
            "#[cfg(test)]\nmod tests {\n    use crate::a::Z;\n}\n",
        ),
    ];
    assert!(module_cycles(&layered).is_empty());
}

#[test]
fn no_crate_has_an_import_cycle_between_its_modules() {
    let root = root();
    let mut found = Vec::new();
    for member in members() {
        let src = root.join(&member).join("src");
        let files: Vec<(String, String)> = rust_files(&src)
            .into_iter()
            .map(|p| {
                let rel = p.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
                (rel, std::fs::read_to_string(&p).unwrap())
            })
            .collect();
        for cycle in module_cycles(&files) {
            found.push(format!("{member}: {}", cycle.join(" -> ")));
        }
    }
    assert!(
        found.is_empty(),
        "module import cycles (move what both sides need into a module below them):\n{}",
        found.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// Rule: every `unsafe` block and `unsafe impl` says why it is sound (`// SAFETY:` on the
// lines just above it, or on its line); every `unsafe fn` documents `# Safety`.

/// `(line number, what)` of each unsafe item of `text` that does not say why it is sound.
fn unexplained_unsafe(text: &str) -> Vec<(usize, &'static str)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    // The comment and attribute lines just above line `i`, and above the start of its
    // statement when rustfmt broke it after `=` or `(`.
    let above = |i: usize| {
        lines[..i]
            .iter()
            .rev()
            .take_while(|l| {
                let t = l.trim();
                t.starts_with("//") || t.starts_with("#[") || t.ends_with('=') || t.ends_with('(')
            })
            .copied()
            .collect::<Vec<_>>()
    };
    for (i, line) in lines.iter().enumerate() {
        let c = code(line);
        let trimmed = line.trim_start();
        if trimmed.starts_with("//") {
            continue;
        }
        let is_fn = c.contains("unsafe fn ") || c.contains("unsafe extern \"C\" fn ");
        let is_fn_definition = is_fn && {
            // `unsafe fn name(`: a definition; `unsafe fn(` (no name) is a pointer type.
            let at = c.find(" fn ").unwrap() + " fn ".len();
            c[at..].starts_with(|ch: char| ch.is_alphabetic() || ch == '_')
        };
        if is_fn_definition {
            if !above(i).iter().any(|l| l.contains("# Safety")) {
                out.push((i + 1, "unsafe fn without a `# Safety` doc section"));
            }
            continue;
        }
        let is_block = c.contains("unsafe {") || c.trim_end().ends_with("unsafe");
        let is_impl = c.contains("unsafe impl");
        if (is_block || is_impl)
            && !line.contains("SAFETY:")
            && !above(i).iter().any(|l| l.contains("SAFETY:"))
        {
            out.push((
                i + 1,
                if is_impl {
                    "unsafe impl without a `// SAFETY:` comment"
                } else {
                    "unsafe block without a `// SAFETY:` comment"
                },
            ));
        }
    }
    out
}

#[test]
fn unexplained_unsafe_is_found() {
    let text = "\
// SAFETY: the pointer is valid.
let a = unsafe { *p };
let b = unsafe { *p };
unsafe impl Send for X {}
/// Reads.
///
/// # Safety
///
/// `p` is valid.
pub unsafe fn read(p: *const u8) -> u8 { 0 }
/// Writes.
unsafe fn write() {}
struct Table { f: unsafe extern \"C\" fn(i32) -> i32 }
#[allow(dead_code)]
// SAFETY: only raw pointers inside.
unsafe impl Sync for X {}
// SAFETY: a valid pointer.
let long_name =
    unsafe { *p };
let unexplained =
    unsafe { *p };
";
    assert_eq!(
        unexplained_unsafe(text),
        [
            (3, "unsafe block without a `// SAFETY:` comment"),
            (4, "unsafe impl without a `// SAFETY:` comment"),
            (12, "unsafe fn without a `# Safety` doc section"),
            (21, "unsafe block without a `// SAFETY:` comment"),
        ]
    );
}

#[test]
fn every_unsafe_says_why_it_is_sound() {
    let found: Vec<String> = sources()
        .iter()
        .flat_map(|(path, text)| {
            unexplained_unsafe(text)
                .into_iter()
                .map(move |(line, what)| format!("{path}:{line}: {what}"))
        })
        .collect();
    assert!(found.is_empty(), "{}", found.join("\n"));
}

// ---------------------------------------------------------------------------------------
// Rule: no source file over 700 lines before its unit tests, but for the named exceptions.

const MAX_LINES: usize = 700;

/// Files allowed to be longer, each with the reason (none at present).
const LONG_FILES: [(&str, &str); 0] = [];

fn long_files(files: &[(String, String)]) -> Vec<(String, usize)> {
    files
        .iter()
        .map(|(path, text)| (path.clone(), before_tests(text).lines().count()))
        .filter(|&(_, n)| n > MAX_LINES)
        .collect()
}

#[test]
fn long_files_are_found_before_their_tests() {
    let long = "x\n".repeat(701);
    let tested = format!(
        "{}#[cfg(test)]\nmod tests {{\n{}}}\n",
        "x\n".repeat(700),
        long
    );
    let files = [
        ("long.rs".to_string(), long),
        ("tested.rs".to_string(), tested),
    ];
    assert_eq!(long_files(&files), [("long.rs".to_string(), 701)]);
}

#[test]
fn no_source_file_is_over_700_lines_but_the_named_exceptions() {
    let found: Vec<String> = long_files(&sources())
        .into_iter()
        .filter(|(path, _)| !LONG_FILES.iter().any(|(p, _)| p == path))
        .map(|(path, n)| format!("{path}: {n} lines before its tests (at most {MAX_LINES})"))
        .collect();
    assert!(found.is_empty(), "{}", found.join("\n"));
    // The exceptions still need to be: one that shrank is taken off the list.
    let all = sources();
    for (path, why) in LONG_FILES {
        let text = &all.iter().find(|(p, _)| p == path).expect(path).1;
        let n = before_tests(text).lines().count();
        assert!(
            n > MAX_LINES,
            "{path} is {n} lines now: drop its exception ({why})"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Rule: torchrun's variables are read only by ddp-comm's `EnvConfig` and written only by
// ddp-run's `RankEnv`. `TORCHELASTIC_ERROR_FILE` is the exception, through its constant: the
// launcher's supervisor sets it per attempt and `ddp_run::record_error` reads it.

const TORCHRUN_VARIABLES: [&str; 9] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
];

const TORCHRUN_HOMES: [&str; 2] = ["ddp-comm/src/config/env.rs", "ddp-run/src/env.rs"];

/// `(line, variable)` of each torchrun variable named as a string in the code of `text`.
fn torchrun_names(text: &str) -> Vec<(usize, &'static str)> {
    let mut out = Vec::new();
    for (i, line) in before_tests(text).lines().enumerate() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        for var in TORCHRUN_VARIABLES {
            if line.contains(&format!("\"{var}\"")) {
                out.push((i + 1, var));
            }
        }
    }
    out
}

#[test]
fn torchrun_names_are_found_in_code_only() {
    let text = "/// Reads \"RANK\".\nlet r = std::env::var(\"RANK\");\nlet s = \"RANKS\";\n";
    assert_eq!(torchrun_names(text), [(2, "RANK")]);
}

#[test]
fn torchrun_variables_live_in_their_two_homes() {
    let found: Vec<String> = sources()
        .iter()
        .filter(|(path, _)| !TORCHRUN_HOMES.contains(&path.as_str()))
        .flat_map(|(path, text)| {
            torchrun_names(text)
                .into_iter()
                .map(move |(line, var)| format!("{path}:{line}: {var}"))
        })
        .collect();
    assert!(
        found.is_empty(),
        "torchrun's variables outside EnvConfig and RankEnv (use them instead):\n{}",
        found.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// Rule: the cores a machine's ranks share are counted as the ranks count them, by
// `shared-src/cores_per_process.rs` (`available_parallelism`: a cgroup's CPU quota too).
// `ddp_run::available_cores`, the affinity mask alone, is torchrun's `--nproc-per-node cpu`:
// ddp-run's own.

/// The lines of `text`'s code that call `available_cores`.
fn affinity_core_counts(text: &str) -> Vec<usize> {
    lines_calling(text, &["available_cores("])
}

#[test]
fn affinity_core_counts_are_found_in_code_only() {
    let text = "/// Not `available_cores()`.\nlet n = ddp_run::available_cores() / 2;\n";
    assert_eq!(affinity_core_counts(text), [2]);
}

#[test]
fn only_the_launcher_counts_the_cores_of_the_affinity_mask() {
    let found = places(
        |path| !path.starts_with("ddp-run/src/"),
        affinity_core_counts,
    );
    assert!(
        found.is_empty(),
        "ddp_run::available_cores outside ddp-run: the ranks share the cores as \
         available_parallelism counts them (cores_per_process in shared-src/):\n{}",
        found.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// Rule: libraries return values and errors; binaries decide what users see.

/// Library files whose job is a program's command-line front end, allowed to print.
const FRONT_ENDS: [(&str, &str); 3] = [
    (
        "ddp-train/src/cli.rs",
        "`cli::run` is the runner a user's `main` ends with: it prints the error without a \
         backtrace and maps it to the exit code",
    ),
    (
        "ddp-train/src/exit.rs",
        "`exit_with` is `cli::run` for a `main` without the `cli` feature's flags: it prints \
         the error without a backtrace and maps it to the exit code",
    ),
    (
        "ddp-run/src/cli/report.rs",
        "`launch_and_report` is the `ddp-run` binary's messages, shared with self-launching \
         programs",
    ),
];

/// Whether `path` is a library's source (not a binary's, not xtask, not a front end).
fn is_library(path: &str) -> bool {
    !(path.starts_with("xtask/")
        || path.ends_with("/main.rs")
        || path.contains("/src/bin/")
        || path.ends_with("build.rs")
        || FRONT_ENDS.iter().any(|(p, _)| *p == path))
}

/// Lines of `text` (before its tests) that print with `println!`/`eprintln!`.
fn prints(text: &str) -> Vec<usize> {
    lines_calling(text, &["println!(", "eprintln!("])
}

#[test]
fn prints_are_found_in_code_only() {
    let text = "/// println!(\"doc\");\nfn f() { eprintln!(\"x\"); }\n#[cfg(test)]\nmod tests {\n    fn t() { println!(\"ok\"); }\n}\n";
    assert_eq!(prints(text), [2]);
    assert!(is_library("ddp-data/src/loader.rs"));
    assert!(!is_library("ddp-data/src/bin/ddp-gen-data.rs"));
    assert!(!is_library("ddp-run/src/main.rs"));
}

#[test]
fn libraries_do_not_print() {
    let found = places(is_library, prints);
    assert!(
        found.is_empty(),
        "println!/eprintln! in library code (return the text, or let the binary print it):\n{}",
        found.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// Rule: a library's public error enums are `#[non_exhaustive]`, so that a new way to fail
// does not break the crates that match on them.

/// Lines of `text` (before its tests) that open a `pub enum ...Error` without
/// `#[non_exhaustive]` among the attributes and doc lines above it.
fn exhaustive_errors(text: &str) -> Vec<usize> {
    let lines: Vec<&str> = before_tests(text).lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = code(line).trim_start().strip_prefix("pub enum ") else {
            continue;
        };
        let name = rest
            .split(|c: char| !c.is_alphanumeric() && c != '_')
            .next();
        if !name.is_some_and(|n| n.ends_with("Error")) {
            continue;
        }
        // What is above the enum up to the item before it or a blank line.
        let marked = lines[..i]
            .iter()
            .rev()
            .map(|l| l.trim())
            .take_while(|l| {
                let above = code(l).trim_end();
                !l.is_empty() && !above.ends_with('}') && !above.ends_with(';')
            })
            .any(|l| l == "#[non_exhaustive]");
        if !marked {
            out.push(i + 1);
        }
    }
    out
}

#[test]
fn exhaustive_errors_are_found() {
    let text = "/// A.\n#[derive(Debug)]\n#[non_exhaustive]\npub enum AError {}\n\n\
                #[non_exhaustive]\nstruct S;\n/// B.\npub enum BError { X }\n\
                #[non_exhaustive]\npub struct CError;\npub enum Kind { X }\n\
                #[cfg(test)]\nmod tests {\n    pub enum TError {}\n}\n";
    assert_eq!(exhaustive_errors(text), [9]);
}

#[test]
fn public_error_enums_are_non_exhaustive() {
    let found: Vec<String> = sources()
        .iter()
        .filter(|(path, _)| is_library(path))
        .flat_map(|(path, text)| {
            exhaustive_errors(text)
                .into_iter()
                .map(move |l| format!("{path}:{l}"))
        })
        .collect();
    assert!(
        found.is_empty(),
        "public error enums without #[non_exhaustive] (a new variant would break the crates \
         that match on them):\n{}",
        found.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// Rule: library code panics only where a bug would, never on outside data; each place that
// can is listed here with the reason it cannot be reached from files, the wire, the store
// or the environment.

/// `(file, code on the line, why it holds)` of every `expect`/`unwrap`/`panic!`/
/// `unreachable!`, and tch's panicking `backward`/`double_value`, left in library code
/// before its tests.
const PANICS: [(&str, &str, &str); 11] = [
    (
        "ddp-comm/src/security/auth.rs",
        "number.try_into().expect(\"4 bytes\")",
        "a slice of a fixed-size array taken with constant bounds",
    ),
    (
        "ddp-comm/src/security/auth.rs",
        "client_nonce.try_into().expect(\"nonce bytes\")",
        "a slice of a fixed-size array taken with constant bounds",
    ),
    (
        "ddp-comm/src/security/auth.rs",
        ".expect(\"HMAC takes keys of any length\")",
        "HMAC-SHA256 accepts any key length (RFC 2104); the key is never the peer's",
    ),
    (
        "ddp-comm/src/ring/connect.rs",
        "bell_ref.expect(\"a shared-memory link has a bell\")",
        "the bell is created in the same function for every shared-memory link",
    ),
    (
        "ddp-comm/src/group/rendezvous.rs",
        ".expect(\"the ring order holds every rank\")",
        "host_order returns a permutation of 0..world, built from a list of world entries",
    ),
    (
        "ddp-comm/src/ring/cpu.rs",
        ".expect(\"run needs a ring\")",
        "a group of more than one rank always has its ring; one rank never runs a collective",
    ),
    (
        "ddp-comm/src/ring/cpu.rs",
        ".expect(\"the ring order holds every rank\")",
        "the ring order is a permutation of 0..world and the root was checked against world",
    ),
    (
        "ddp-model/src/norm.rs",
        "unwrap_or_else(|e| panic!(\"{e}\"))",
        "nn::ModuleT's forward cannot return an error (tch's own layers panic on a bad shape \
         alike): an input that is not [N, C, ...] with the layer's C, or a training batch of \
         one value per channel (PyTorch's ValueError), named with the layer; f_forward_t \
         returns it",
    ),
    (
        "ddp-train/src/metrics.rs",
        "unwrap_or_else(|e| panic!(\"{e}\"))",
        "Task::eval_batch returns a Tensor, not a Result: outputs of a shape the statistic \
         cannot count are the caller's bug, named with both shapes (try_add returns it)",
    ),
    (
        "ddp-train/src/odir/stats.rs",
        "unwrap_or_else(|e| panic!(\"{e}\"))",
        "Task::eval_batch returns a Tensor, not a Result: logits that are not [B, 8] are a \
         model's bug, named with the shape (try_add returns it)",
    ),
    (
        "ddp-train/src/optim.rs",
        "panic!(\"optimizer step: {e}\")",
        "fused in-place updates of a parameter with tensors of its own shape, dtype and device",
    ),
];

/// `(line, code)` of each line of `text` (before its tests) that can panic.
fn panics(text: &str) -> Vec<(usize, String)> {
    before_tests(text)
        .lines()
        .enumerate()
        .filter(|(_, l)| {
            let c = code(l);
            [
                ".expect(",
                ".unwrap()",
                "panic!(",
                "unreachable!(",
                "todo!(",
                "unimplemented!(",
                // tch's `f_backward().unwrap()` and `f_double_value(..).unwrap()`.
                ".backward()",
                ".double_value(",
            ]
            .iter()
            .any(|p| c.contains(p))
        })
        .map(|(i, l)| (i + 1, code(l).trim().to_string()))
        .collect()
}

#[test]
fn panics_are_found_in_code_only() {
    let text = "/// x.unwrap();\nfn f() { x.expect(\"y\"); }\nfn g() { h().unwrap() } // z.unwrap()\nfn l() { l.backward(); l.f_backward()?; }\nfn v() { l.f_double_value(&[])?; }\nfn w() { l.double_value(&[]) }\n#[cfg(test)]\nmod tests {\n    fn t() { panic!(); }\n}\n";
    let found: Vec<usize> = panics(text).into_iter().map(|(l, _)| l).collect();
    assert_eq!(found, [2, 3, 4, 6]);
}

#[test]
fn every_panic_in_library_code_is_listed_with_its_reason() {
    let found: Vec<(String, usize, String)> = sources()
        .iter()
        .filter(|(path, _)| is_library(path) && !path.starts_with("ddp-testkit/"))
        .flat_map(|(path, text)| {
            panics(text)
                .into_iter()
                .map(move |(line, code)| (path.clone(), line, code))
        })
        .collect();
    let listed = |path: &str, code: &str| {
        PANICS
            .iter()
            .any(|(p, snippet, _)| *p == path && code.contains(snippet))
    };
    let unlisted: Vec<String> = found
        .iter()
        .filter(|(path, _, code)| !listed(path, code))
        .map(|(path, line, code)| format!("{path}:{line}: {code}"))
        .collect();
    assert!(
        unlisted.is_empty(),
        "library code that can panic: return a typed error, or list it in PANICS with why \
         no outside data can reach it:\n{}",
        unlisted.join("\n")
    );
    let stale: Vec<&str> = PANICS
        .iter()
        .filter(|(path, snippet, _)| {
            !found
                .iter()
                .any(|(p, _, c)| p == path && c.contains(snippet))
        })
        .map(|(_, snippet, _)| *snippet)
        .collect();
    assert!(stale.is_empty(), "PANICS lists what is gone: {stale:?}");
}

// ---------------------------------------------------------------------------------------
// Rule: one path to each public name: a crate root re-exports nothing from its own public
// modules (their names are reached through the module).

/// `pub use` lines of a crate root (`lib.rs`) that re-export from one of its `pub mod`s.
fn second_paths(lib: &str) -> Vec<String> {
    let code: Vec<&str> = before_tests(lib).lines().map(code).collect();
    let public: Vec<&str> = code
        .iter()
        .filter_map(|l| l.trim().strip_prefix("pub mod ")?.strip_suffix(';'))
        .collect();
    code.iter()
        .filter_map(|l| {
            let path = l.trim().strip_prefix("pub use ")?;
            let path = path.strip_prefix("self::").unwrap_or(path);
            public
                .iter()
                .any(|m| path.starts_with(&format!("{m}::")))
                .then(|| l.trim().to_string())
        })
        .collect()
}

#[test]
fn second_paths_are_found() {
    let lib = "pub mod a;\nmod b;\npub use a::X;\npub use b::Y;\npub use self::a::{Z, W};\n// pub use a::V;\n";
    assert_eq!(
        second_paths(lib),
        ["pub use a::X;", "pub use self::a::{Z, W};"]
    );
}

#[test]
fn crate_roots_do_not_re_export_their_public_modules() {
    let root = root();
    let found: Vec<String> = members()
        .iter()
        .filter_map(|m| {
            let lib = std::fs::read_to_string(root.join(m).join("src/lib.rs")).ok()?;
            Some(
                second_paths(&lib)
                    .into_iter()
                    .map(move |l| format!("{m}: {l}")),
            )
        })
        .flatten()
        .collect();
    assert!(
        found.is_empty(),
        "a name reachable both at the crate root and through its public module (make the \
         module private, or drop the re-export):\n{}",
        found.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// Rule: every crate has a README, and ARCHITECTURE.md names every crate.

#[test]
fn every_crate_has_a_readme_and_a_place_in_the_architecture() {
    let root = root();
    let architecture = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let mut problems = Vec::new();
    for member in members() {
        if !root.join(&member).join("README.md").is_file() {
            problems.push(format!("{member} has no README.md"));
        }
        if !architecture.contains(&format!("`{member}`")) {
            problems.push(format!("ARCHITECTURE.md does not name `{member}`"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_cpp_source_of_the_shim_is_compiled_and_described() {
    let tch_ext = root().join("tch-ext");
    let build = std::fs::read_to_string(tch_ext.join("build.rs")).unwrap();
    let readme = std::fs::read_to_string(tch_ext.join("README.md")).unwrap();
    let mut sources: Vec<String> = std::fs::read_dir(tch_ext.join("csrc"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".cpp"))
        .collect();
    sources.sort();
    assert!(sources.contains(&"hooks.cpp".to_string()), "{sources:?}");
    let mut problems = Vec::new();
    for name in &sources {
        if !build.contains(&format!("\"csrc/{name}\"")) {
            problems.push(format!("tch-ext/build.rs does not compile csrc/{name}"));
        }
        if !readme.contains(&format!("`{name}`")) {
            problems.push(format!("tch-ext/README.md does not name `{name}`"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ---------------------------------------------------------------------------------------
// Rule: the documentation's links lead somewhere: every relative link in README.md,
// ARCHITECTURE.md, docs/*.md and the crates' READMEs names a file or folder that exists, and
// every `#anchor` a heading of the file it points at.

/// The Markdown files a reader follows links through, relative to the root.
fn documentation() -> Vec<String> {
    let root = root();
    let mut files = vec!["README.md".to_string(), "ARCHITECTURE.md".to_string()];
    if root.join("BENCHMARKS.md").is_file() {
        files.push("BENCHMARKS.md".to_string());
    }
    let mut docs: Vec<String> = std::fs::read_dir(root.join("docs"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.ends_with(".md").then(|| format!("docs/{name}"))
        })
        .collect();
    docs.sort();
    files.extend(docs);
    files.extend(
        members()
            .into_iter()
            .map(|m| format!("{m}/README.md"))
            .filter(|f| root.join(f).is_file()),
    );
    files
}

/// The lines of `text` outside fenced code blocks, with their numbers, inline code spans
/// blanked out (a link or heading inside code is an example, not a link).
fn prose_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fence: Option<&str> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        match fence {
            Some(f) if trimmed.starts_with(f) => fence = None,
            Some(_) => {}
            None if trimmed.starts_with("```") => fence = Some("```"),
            None if trimmed.starts_with("~~~") => fence = Some("~~~"),
            None => {
                let mut prose = String::new();
                for (k, part) in line.split('`').enumerate() {
                    if k % 2 == 0 {
                        prose.push_str(part);
                    } else {
                        prose.push_str(&" ".repeat(part.len() + 2));
                    }
                }
                out.push((i + 1, prose));
            }
        }
    }
    out
}

/// `(line, target)` of every inline link `[text](target)` and reference definition
/// `[label]: target` of `text`, outside code.
fn markdown_links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (no, line) in prose_lines(text) {
        let mut rest = line.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            let target = target.trim_start_matches('<').trim_end_matches('>');
            out.push((no, target.to_string()));
            rest = &after[end..];
        }
        let t = line.trim_start();
        if let Some(close) = t.strip_prefix('[').and_then(|r| r.find("]: ")) {
            let target = t[close + 4..].split_whitespace().next().unwrap_or("");
            out.push((no, target.to_string()));
        }
    }
    out
}

/// GitHub's anchor for a heading's text: lower case, punctuation dropped (but `-` and `_`),
/// spaces as `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of every heading of `text` (a repeated heading's later ones get `-1`, `-2`,
/// ..., as on GitHub).
fn heading_anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    let mut fence = false;
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("```") || t.starts_with("~~~") {
            fence = !fence;
            continue;
        }
        let level = t.chars().take_while(|&c| c == '#').count();
        if fence || !(1..=6).contains(&level) || !t[level..].starts_with(' ') {
            continue;
        }
        let base = anchor(&t[level..].replace('`', ""));
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// What is wrong with each relative link of `file` (relative to the root), given a reader of
/// files by root-relative path (`None`: no such file) and whether a path is a folder.
fn broken_links(
    file: &str,
    text: &str,
    read: &dyn Fn(&str) -> Option<String>,
    is_dir: &dyn Fn(&str) -> bool,
) -> Vec<String> {
    let folder = Path::new(file).parent().unwrap_or(Path::new(""));
    let mut out = Vec::new();
    for (line, target) in markdown_links(text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, fragment) = match target.split_once('#') {
            Some((p, f)) => (p, Some(f)),
            None => (target.as_str(), None),
        };
        // The target relative to the root, `..` resolved.
        let mut parts: Vec<String> = Vec::new();
        let joined = if path.is_empty() {
            PathBuf::from(file)
        } else {
            folder.join(path)
        };
        let mut escapes = false;
        for c in joined.components() {
            match c {
                std::path::Component::ParentDir => escapes |= parts.pop().is_none(),
                std::path::Component::CurDir => {}
                c => parts.push(c.as_os_str().to_string_lossy().into_owned()),
            }
        }
        let resolved = parts.join("/");
        let at = format!("{file}:{line}: ({target})");
        if escapes {
            out.push(format!("{at} leaves the repository"));
            continue;
        }
        let body = if path.is_empty() {
            Some(text.to_string())
        } else {
            read(&resolved)
        };
        let Some(body) = body else {
            if !is_dir(&resolved) {
                out.push(format!("{at} {resolved} does not exist"));
            } else if fragment.is_some() {
                out.push(format!("{at} an anchor into a folder"));
            }
            continue;
        };
        if let Some(f) = fragment {
            if resolved.ends_with(".md") && !heading_anchors(&body).contains(f) {
                out.push(format!("{at} {resolved} has no heading #{f}"));
            }
        }
    }
    out
}

#[test]
fn broken_links_are_found_outside_code() {
    let files = BTreeMap::from([
        (
            "docs/guide.md",
            "# Guide\n\n## Two nodes (`--nnodes`)\n\n## Two nodes (`--nnodes`)\n",
        ),
        ("ddp-run/README.md", "# ddp-run\n\n## Security\n"),
    ]);
    let read = |p: &str| files.get(p).map(|t| t.to_string());
    let is_dir = |p: &str| p == "docs" || p == "ddp-run";
    let text = "\
# Front

See [the guide](docs/guide.md#two-nodes---nnodes), [again](docs/guide.md#two-nodes---nnodes-1),
[security](ddp-run/README.md#security) and [docs](docs/), [up](../outside.md).
[gone](docs/gone.md), [no heading](ddp-run/README.md#secrets), [here](#front), [not](#back).
`[code](docs/none.md)` and [web](https://example.com/x#y) are not checked.
```
[fenced](docs/none.md)
```
[ref]: docs/missing.md
";
    assert_eq!(
        broken_links("README.md", text, &read, &is_dir),
        [
            "README.md:4: (../outside.md) leaves the repository",
            "README.md:5: (docs/gone.md) docs/gone.md does not exist",
            "README.md:5: (ddp-run/README.md#secrets) ddp-run/README.md has no heading #secrets",
            "README.md:5: (#back) README.md has no heading #back",
            "README.md:10: (docs/missing.md) docs/missing.md does not exist",
        ]
    );
    // From a file in a folder, links are relative to that folder.
    assert!(broken_links(
        "docs/x.md",
        "[g](guide.md) [r](../ddp-run/README.md)",
        &read,
        &is_dir
    )
    .is_empty());
}

#[test]
fn every_link_of_the_documentation_leads_somewhere() {
    let root = root();
    let read = |p: &str| std::fs::read_to_string(root.join(p)).ok();
    let is_dir = |p: &str| root.join(p).is_dir();
    let found: Vec<String> = documentation()
        .iter()
        .flat_map(|f| broken_links(f, &read(f).unwrap(), &read, &is_dir))
        .collect();
    assert!(found.is_empty(), "broken links:\n{}", found.join("\n"));
}

// ---------------------------------------------------------------------------------------
// Rule: the front page stays a front page (README.md at most 150 lines), the architecture
// short (ARCHITECTURE.md at most 15 kB), and the documentation says what is: no dates and no
// notes about the session that built something. Figures carry their machine and date once,
// in the generated BENCHMARKS.md, which is not checked for dates.

const README_LINES: usize = 150;
const ARCHITECTURE_BYTES: usize = 15 * 1024;

/// `(line, what)` of each dated note in `text`: a date (`2026-12-01`), words about the
/// session a text was written in or what it could not measure there, or the project's own
/// history that a user cannot see (`issue 29`, `the second seed`).
fn dated_notes(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let b = line.as_bytes();
        let date = (0..b.len().saturating_sub(9)).find(|&k| {
            let digits = |r: std::ops::Range<usize>| r.clone().all(|j| b[j].is_ascii_digit());
            (b[k..].starts_with(b"19") || b[k..].starts_with(b"20"))
                && digits(k..k + 4)
                && b[k + 4] == b'-'
                && digits(k + 5..k + 7)
                && b[k + 7] == b'-'
                && digits(k + 8..k + 10)
                && (k == 0 || !b[k - 1].is_ascii_digit())
        });
        if let Some(k) = date {
            out.push((i + 1, format!("a date, {}", &line[k..k + 10])));
        }
        let lower = line.to_lowercase();
        for phrase in [
            "this session",
            "the session that",
            "not measured",
            "unmeasured",
            "could not be measured",
        ] {
            if lower.contains(phrase) {
                out.push((i + 1, format!("\"{phrase}\"")));
            }
        }
        let numbered_issue = lower
            .match_indices("issue ")
            .any(|(k, _)| lower[k + "issue ".len()..].starts_with(|c: char| c.is_ascii_digit()));
        if numbered_issue {
            out.push((i + 1, "the project's history (\"issue\")".to_string()));
        }
        if ["first seed", "second seed"]
            .iter()
            .any(|p| lower.contains(p))
        {
            out.push((i + 1, "the project's history (\"seed\")".to_string()));
        }
    }
    out
}

#[test]
fn dated_notes_are_found() {
    let text = "Measured 2026-12-01 on this machine.\nThe rank runs in a session of its own.\n\
                No GPU was lent to this session.\nport 20261201-000000 is a run directory\n\
                Unmeasured on a GPU so far; the best model so far.\n\
                As issue 29 asks, seed 1's defaults.\nThe second seed's classifier.\n\
                --seed 1 or seed 0's permutation for issues; the seeds' spread.\n";
    assert_eq!(
        dated_notes(text),
        [
            (1, "a date, 2026-12-01".to_string()),
            (3, "\"this session\"".to_string()),
            (5, "\"unmeasured\"".to_string()),
            (6, "the project's history (\"issue\")".to_string()),
            (7, "the project's history (\"seed\")".to_string()),
        ]
    );
}

#[test]
fn the_front_page_is_short_and_the_documentation_undated() {
    let root = root();
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap();
    let mut problems = Vec::new();
    let readme = read("README.md").lines().count();
    if readme > README_LINES {
        problems.push(format!(
            "README.md is {readme} lines (at most {README_LINES}): move guides to docs/"
        ));
    }
    let architecture = read("ARCHITECTURE.md").len();
    if architecture > ARCHITECTURE_BYTES {
        problems.push(format!(
            "ARCHITECTURE.md is {architecture} bytes (at most {ARCHITECTURE_BYTES}): say each \
             fact once"
        ));
    }
    for file in documentation() {
        if file == "BENCHMARKS.md" {
            continue;
        }
        for (line, what) in dated_notes(&read(&file)) {
            problems.push(format!(
                "{file}:{line}: {what} (say what is; figures go to BENCHMARKS.md)"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The flags `cargo xtask train` adds for its built-in sample (`SAMPLE_DEFAULTS` in
/// `xtask/src/launch.rs`), as `--flag value` pairs.
fn sample_defaults(launch: &str) -> Vec<String> {
    let start = launch
        .find("const SAMPLE_DEFAULTS")
        .expect("xtask/src/launch.rs defines SAMPLE_DEFAULTS");
    let body = &launch[start..];
    let body = &body[..body.find("];").expect("SAMPLE_DEFAULTS ends with `];`")];
    body.lines()
        .filter_map(|line| {
            let pair = line.trim().strip_prefix("(\"")?.strip_suffix("\"),")?;
            let (flag, value) = pair.split_once("\", \"")?;
            Some(format!("{flag} {value}"))
        })
        .collect()
}

/// A user comparing the quick run with seed 1 or `ddp-train --help` sees every setting the
/// sample changes named in its guide.
#[test]
fn the_samples_settings_are_all_in_its_guide() {
    let root = root();
    let launch = std::fs::read_to_string(root.join("xtask/src/launch.rs")).unwrap();
    let flags = sample_defaults(&launch);
    assert!(flags.len() >= 6, "{flags:?}");
    assert!(flags.contains(&"--lr 0.002".to_owned()), "{flags:?}");
    let guide = std::fs::read_to_string(root.join("docs/odir.md")).unwrap();
    // The guide wraps lines: compare with its words joined by single spaces.
    let guide = guide.split_whitespace().collect::<Vec<_>>().join(" ");
    let missing: Vec<&String> = flags
        .iter()
        .filter(|f| !guide.contains(f.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/odir.md does not name the built-in sample's {missing:?}"
    );
}

/// `major.minor` of a `rust-version` value (`1.88`, `1.88.0`).
fn minor_version(text: &str) -> (u32, u32) {
    let mut parts = text.trim().split('.').map(|p| p.parse::<u32>().unwrap());
    (parts.next().unwrap(), parts.next().unwrap_or(0))
}

/// The Rust the README asks for builds the committed lock: every package in it declares a
/// `rust-version` at most the workspace's, which is the one the README names. (cargo refuses
/// to build a dependency that needs a newer compiler, so a newcomer on an older one would fail
/// at the first command.)
#[test]
fn the_readmes_rust_builds_every_locked_package() {
    let root = root();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let ours = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .expect("the workspace declares rust-version")
        .trim_matches('"');
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let named = readme
        .split("Rust >= ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("README.md names the Rust it needs as `Rust >= X.Y`");
    assert_eq!(named, ours, "README.md and Cargo.toml name different Rusts");
    // Offline first: what the build downloaded is usually all it needs (a machine without
    // the network after its build); else cargo fetches the other platforms' manifests.
    let metadata = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO"))
            .args(["metadata", "--format-version", "1", "--locked"])
            .args(extra)
            .current_dir(&root)
            .output()
            .unwrap()
    };
    let out = Some(metadata(&["--offline"]))
        .filter(|o| o.status.success())
        .unwrap_or_else(|| metadata(&[]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let newer: Vec<String> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| {
            let needs = p["rust_version"].as_str()?;
            let (name, version) = (p["name"].as_str()?, p["version"].as_str()?);
            (minor_version(needs) > minor_version(ours))
                .then(|| format!("{name} {version} needs {needs}"))
        })
        .collect();
    assert!(
        newer.is_empty(),
        "Cargo.lock holds packages newer than rust-version {ours}: {newer:?}; raise it \
         (Cargo.toml and README.md) or `cargo update -p` them to older versions"
    );
}
