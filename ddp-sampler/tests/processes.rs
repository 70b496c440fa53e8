//! The cross-process guarantee, tested with real processes: separate runs of the
//! `ddp-sampler-indices` binary print the same indices for the same arguments, and the same
//! indices as this process computes.

use std::process::{Command, Output};

use ddp_sampler::DistributedSampler;

/// Runs `ddp-sampler-indices` with the space-separated `args`.
fn run(args: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ddp-sampler-indices"))
        .args(args.split_whitespace())
        .output()
        .expect("ddp-sampler-indices starts")
}

/// The stdout of a successful run, failing the test on a non-zero exit.
fn stdout_of(args: &str) -> String {
    let output = run(args);
    assert!(
        output.status.success(),
        "ddp-sampler-indices {args} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("indices are ASCII")
}

/// The indices printed by a successful run.
fn indices_of(args: &str) -> Vec<usize> {
    stdout_of(args)
        .split_whitespace()
        .map(|n| n.parse().expect("an index"))
        .collect()
}

#[test]
fn two_processes_print_the_same_indices() {
    let args = "--len 100000 --replicas 8 --rank 5 --seed 1234 --epoch 7";
    let first = stdout_of(args);
    let second = stdout_of(args);
    assert_eq!(first.len(), second.len());
    assert_eq!(first, second);

    let mut here = DistributedSampler::builder(100_000, 8, 5)
        .seed(1234)
        .build()
        .expect("valid sampler");
    here.set_epoch(7);
    assert_eq!(indices_of(args), here.indices());
}

#[test]
fn processes_for_every_rank_together_cover_the_dataset_exactly() {
    let mut all: Vec<usize> = (0..3)
        .flat_map(|rank| {
            indices_of(&format!(
                "--len 1000 --replicas 3 --rank {rank} --seed 5 --exact"
            ))
        })
        .collect();
    assert_eq!(all.len(), 1000);
    all.sort_unstable();
    assert_eq!(all, (0..1000).collect::<Vec<_>>());
}

#[test]
fn a_resumed_process_prints_the_rest_of_the_epoch() {
    let full = indices_of("--len 50 --replicas 2 --rank 1 --epoch 3");
    let rest = indices_of("--len 50 --replicas 2 --rank 1 --epoch 3 --from 20");
    assert_eq!(full.len(), 25);
    assert_eq!(rest, full[20..]);
}

#[test]
fn unshuffled_process_output_is_pytorchs() {
    assert_eq!(
        stdout_of("--len 10 --replicas 4 --rank 2 --no-shuffle"),
        "2 6 0\n"
    );
    assert_eq!(
        stdout_of("--len 11 --replicas 4 --rank 3 --no-shuffle --drop-last"),
        "3 7\n"
    );
}

#[test]
fn invalid_arguments_exit_with_status_2_and_the_reason() {
    let output = run("--len 3 --replicas 4 --rank 0 --exact");
    assert_eq!(output.status.code(), Some(2));
    assert!(output.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with(
            "ddp-sampler-indices: dataset_len 3 leaves some of the 4 replicas without samples \
             under Partition::Exact, which needs dataset_len >= 4\n"
        ),
        "stderr was: {stderr}"
    );
    let output = run("--len ten --replicas 4 --rank 0");
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr)
        .starts_with("ddp-sampler-indices: --len expects a non-negative integer, got 'ten'\n"));
}

#[test]
fn help_names_every_option_and_exits_0() {
    let output = run("--help");
    assert_eq!(output.status.code(), Some(0));
    let help = String::from_utf8(output.stdout).unwrap();
    assert!(
        help.starts_with("usage: ddp-sampler-indices --len N"),
        "{help}"
    );
    for option in [
        "--len N",
        "--replicas R",
        "--rank r",
        "--seed S",
        "--epoch E",
        "--no-shuffle",
        "--drop-last",
        "--exact",
        "--from K",
    ] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(option)),
            "{option} is not explained: {help}"
        );
    }
}

#[test]
fn an_argument_that_is_not_utf8_is_refused_naming_it() {
    use std::os::unix::ffi::OsStrExt;
    let output = Command::new(env!("CARGO_BIN_EXE_ddp-sampler-indices"))
        .arg("--len")
        .arg(std::ffi::OsStr::from_bytes(b"1\xff"))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with(
            "ddp-sampler-indices: argument '1\u{fffd}' is not valid UTF-8 (U+FFFD marks the \
             bytes that are not)\n"
        ),
        "{stderr}"
    );
}
