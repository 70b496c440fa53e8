//! `ddp-sampler-indices`: prints one rank's sample indices for one epoch, one line of
//! space-separated numbers, so that runs in separate processes (or on other machines, or by
//! another implementation of the documented algorithm) can be compared byte for byte.
//!
//! ```text
//! ddp-sampler-indices --len N --replicas R --rank r [--seed S] [--epoch E]
//!                     [--no-shuffle] [--drop-last] [--exact] [--from K]
//! ```
//!
//! Exits with status 2 and a message on stderr when the arguments are invalid.

use std::fmt::Write as _;
use std::process::ExitCode;

use ddp_sampler::{DistributedSampler, Partition};

const USAGE: &str = "usage: ddp-sampler-indices --len N --replicas R --rank r [--seed S] \
                     [--epoch E] [--no-shuffle] [--drop-last] [--exact] [--from K]";

/// The parsed command line.
#[derive(Debug, Default)]
struct Args {
    len: Option<usize>,
    replicas: Option<usize>,
    rank: Option<usize>,
    seed: u64,
    epoch: u64,
    no_shuffle: bool,
    drop_last: bool,
    exact: bool,
    from: usize,
}

fn number<T: std::str::FromStr>(flag: &str, value: Option<String>) -> Result<T, String> {
    let value = value.ok_or_else(|| format!("{flag} needs a value"))?;
    value
        .parse()
        .map_err(|_| format!("{flag} expects a non-negative integer, got '{value}'"))
}

fn parse(mut argv: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut args = Args::default();
    while let Some(flag) = argv.next() {
        match flag.as_str() {
            "--len" => args.len = Some(number(&flag, argv.next())?),
            "--replicas" => args.replicas = Some(number(&flag, argv.next())?),
            "--rank" => args.rank = Some(number(&flag, argv.next())?),
            "--seed" => args.seed = number(&flag, argv.next())?,
            "--epoch" => args.epoch = number(&flag, argv.next())?,
            "--from" => args.from = number(&flag, argv.next())?,
            "--no-shuffle" => args.no_shuffle = true,
            "--drop-last" => args.drop_last = true,
            "--exact" => args.exact = true,
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    Ok(args)
}

fn run(args: Args) -> Result<String, String> {
    let missing = |flag: &str| format!("{flag} is required");
    let len = args.len.ok_or_else(|| missing("--len"))?;
    let replicas = args.replicas.ok_or_else(|| missing("--replicas"))?;
    let rank = args.rank.ok_or_else(|| missing("--rank"))?;
    let partition = if args.exact {
        Partition::Exact
    } else {
        Partition::Padded
    };
    let mut sampler = DistributedSampler::builder(len, replicas, rank)
        .shuffle(!args.no_shuffle)
        .seed(args.seed)
        .drop_last(args.drop_last)
        .partition(partition)
        .build()
        .map_err(|err| err.to_string())?;
    sampler.set_epoch(args.epoch);
    let mut line = String::new();
    for (i, index) in sampler
        .iter_from(args.from)
        .map_err(|e| e.to_string())?
        .enumerate()
    {
        let sep = if i == 0 { "" } else { " " };
        // Writing to a String cannot fail.
        let _ = write!(line, "{sep}{index}");
    }
    Ok(line)
}

fn main() -> ExitCode {
    match parse(std::env::args().skip(1)).and_then(run) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("ddp-sampler-indices: {message}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
