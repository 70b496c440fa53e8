// The one copy of how a binary writes its messages (the rule of ddp-run's `report.rs`, whose
// messages are its own), `include!`d by the `ddp-train` binary (`main.rs`) and xtask
// (`launch.rs`): xtask shares no crate with ddp-train's binary (it builds without tch).

/// `println!` for a program's messages: a reader that has gone (`ddp-train ... | head -1`)
/// is no reason to fail, nor to stop what the program was doing, as `println!`'s panic on
/// the closed stdout would; the line is dropped.
#[allow(dead_code)] // Not every file that includes it writes to both streams.
fn print_line(line: impl std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// [`print_line`] for stderr, `eprintln!` without its panic.
#[allow(dead_code)]
fn eprint_line(line: impl std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}
