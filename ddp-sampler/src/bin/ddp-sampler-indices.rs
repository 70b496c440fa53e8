//! `ddp-sampler-indices`: prints one rank's sample indices for one epoch, one line of
//! space-separated numbers, so that runs in separate processes (or on other machines, or by
//! another implementation of the documented algorithm) can be compared byte for byte.
//!
//! ```text
//! ddp-sampler-indices --len N --replicas R --rank r [--seed S] [--epoch E]
//!                     [--no-shuffle] [--drop-last] [--exact] [--from K]
//! ```
//!
//! `--help` prints what each option means. Exits with status 2 and a message on stderr when
//! the arguments are invalid.

use std::fmt::Write as _;
use std::process::ExitCode;

use ddp_sampler::{DistributedSampler, Partition};

const USAGE: &str = "usage: ddp-sampler-indices --len N --replicas R --rank r [--seed S] \
                     [--epoch E] [--no-shuffle] [--drop-last] [--exact] [--from K]";

/// `--help`'s words on each option, with the defaults.
const HELP: &str = concat!(
    "  --len N        samples in the data set\n",
    "  --replicas R   ranks sharing it\n",
    "  --rank r       the rank whose indices are printed, 0 to R-1\n",
    "  --seed S       the shuffle's seed, the same on every rank (default 0)\n",
    "  --epoch E      the epoch, as set_epoch(E) (default 0)\n",
    "  --no-shuffle   the data set's order (shuffle=False)\n",
    "  --drop-last    floor(N/R) indices per rank, the order's tail dropped, instead of\n",
    "                 ceil(N/R) with the order repeated from its start (drop_last=True)\n",
    "  --exact        every index exactly once, ranks' lengths differing by at most one\n",
    "  --from K       this rank's indices from its K-th on, as a run resumed after K (default 0)",
);

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

/// The command line, or `None` for `--help`.
fn parse(argv: impl Iterator<Item = std::ffi::OsString>) -> Result<Option<Args>, String> {
    let mut argv = argv.map(|arg| {
        arg.into_string().map_err(|arg| {
            format!(
                "argument '{}' is not valid UTF-8 (U+FFFD marks the bytes that are not)",
                arg.to_string_lossy()
            )
        })
    });
    let mut args = Args::default();
    while let Some(flag) = argv.next().transpose()? {
        let mut value = || argv.next().transpose();
        match flag.as_str() {
            "--len" => args.len = Some(number(&flag, value()?)?),
            "--replicas" => args.replicas = Some(number(&flag, value()?)?),
            "--rank" => args.rank = Some(number(&flag, value()?)?),
            "--seed" => args.seed = number(&flag, value()?)?,
            "--epoch" => args.epoch = number(&flag, value()?)?,
            "--from" => args.from = number(&flag, value()?)?,
            "--no-shuffle" => args.no_shuffle = true,
            "--drop-last" => args.drop_last = true,
            "--exact" => args.exact = true,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    Ok(Some(args))
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
    let line = parse(std::env::args_os().skip(1)).and_then(|args| args.map(run).transpose());
    match line {
        Ok(Some(line)) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Ok(None) => {
            println!("{USAGE}\n\n{HELP}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("ddp-sampler-indices: {message}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
