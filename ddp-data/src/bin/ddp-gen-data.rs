//! `ddp-gen-data`: writes a synthetic ODIR sample (`full_df.csv` + `preprocessed_images/`),
//! the same files for the same settings.
//!
//! ```text
//! ddp-gen-data --out DIR [--images N] [--size PX] [--seed S] [--quality Q] [--test-images N]
//! ```
//!
//! `--test-images N` also writes a held-out test split of N images into `DIR/test/`: a
//! labelled folder for `ddp-train evaluate`, whose `preprocessed_images/` is an unlabelled
//! folder of `<id>_left.jpg` / `<id>_right.jpg` for `ddp-train predict`.
//!
//! It needs no libtorch:
//! `cargo build -p ddp-data --no-default-features --features odir --bin ddp-gen-data`.
//! `cargo xtask gen-data` and the launcher's built-in sample run it. Exits with status 2 and
//! the usage on a bad command line, 1 when the sample cannot be written.

use std::error::Error;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use ddp_data::odir::synthetic::{generate, SyntheticConfig};

const USAGE: &str =
    "usage: ddp-gen-data --out DIR [--images N] [--size PX] [--seed S] [--quality Q] \
     [--test-images N]";

/// `--help`'s words on each option, with the defaults.
const HELP: &str = concat!(
    "  --out DIR          a new or empty folder to write full_df.csv and preprocessed_images/ into\n",
    "  --images N         fundus-like images, two per patient (default 600)\n",
    "  --size PX          their side, 32 to 4096 (default 256)\n",
    "  --seed S           the same seed writes the same files (default 0)\n",
    "  --quality Q        JPEG quality, 1 to 100 (default 90)\n",
    "  --test-images N    also a held-out test split of N images in DIR/test/ (default 0: none)",
);

/// The parsed command line.
#[derive(Debug)]
struct Args {
    out: PathBuf,
    config: SyntheticConfig,
}

fn number<T: std::str::FromStr>(flag: &str, value: Option<String>) -> Result<T, String> {
    let value = value.ok_or_else(|| format!("{flag} needs a value"))?;
    value
        .parse()
        .map_err(|_| format!("{flag} expects a non-negative integer, got '{value}'"))
}

fn parse(argv: impl Iterator<Item = std::ffi::OsString>) -> Result<Option<Args>, String> {
    // Every argument is text: the sample's folder is recorded in text (annotations, the
    // trainer's config.json), so a name that is not UTF-8 is refused, not mangled.
    let mut argv = argv.map(|arg| {
        arg.into_string().map_err(|arg| {
            format!(
                "argument '{}' is not valid UTF-8 (U+FFFD marks the bytes that are not): \
                 give another path",
                arg.to_string_lossy()
            )
        })
    });
    let mut out = None;
    let mut config = SyntheticConfig::default();
    while let Some(arg) = argv.next().transpose()? {
        // `--flag=value` as well as `--flag value`.
        let (flag, mut inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = || inline.take().map(Ok).or_else(|| argv.next()).transpose();
        match flag.as_str() {
            "--out" => out = Some(PathBuf::from(value()?.ok_or("--out needs a value")?)),
            "--images" => config.images = number(&flag, value()?)?,
            "--size" => config.size = number(&flag, value()?)?,
            "--seed" => config.seed = number(&flag, value()?)?,
            "--quality" => config.quality = number(&flag, value()?)?,
            "--test-images" => config.test_images = number(&flag, value()?)?,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument '{other}'")),
        }
    }
    let out = out.ok_or("--out is required")?;
    // A range the generator refuses is a bad command line too (status 2), found before any
    // file is written.
    config.validate().map_err(|e| e.to_string())?;
    Ok(Some(Args { out, config }))
}

/// `err` and its causes, joined by ": ".
fn chain(err: &dyn Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

fn main() -> ExitCode {
    let args = match parse(std::env::args_os().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{USAGE}\n\n{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("error: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let started = Instant::now();
    match generate(&args.out, &args.config) {
        Ok(summary) => {
            println!(
                "ddp-gen-data: {} images of {} patients ({}x{} px) in {} ({:.1} s); label \
                 counts N D G C A H M O: {:?}",
                summary.images,
                summary.patients,
                args.config.size,
                args.config.size,
                summary.root.display(),
                started.elapsed().as_secs_f64(),
                summary.label_counts
            );
            if let Some(test) = &summary.test {
                println!(
                    "ddp-gen-data: test split: {} images of {} patients in {} (unlabelled \
                     images in {})",
                    test.images,
                    test.patients,
                    test.root.display(),
                    test.root.join("preprocessed_images").display()
                );
            }
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!(
                "error: cannot write a synthetic ODIR sample in {}: {}",
                args.out.display(),
                chain(&err)
            );
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_help_states_the_defaults_the_sample_uses() {
        let d = SyntheticConfig::default();
        for (option, default) in [
            ("--images N", d.images.to_string()),
            ("--size PX", d.size.to_string()),
            ("--seed S", d.seed.to_string()),
            ("--quality Q", d.quality.to_string()),
            ("--test-images N", d.test_images.to_string()),
        ] {
            let line = HELP.lines().find(|l| l.trim_start().starts_with(option));
            let line = line.unwrap_or_else(|| panic!("no line for {option}"));
            assert!(line.contains(&format!("(default {default}")), "{line}");
        }
    }

    #[test]
    fn values_outside_the_generators_ranges_are_refused_at_parse() {
        use std::ffi::OsString;
        for (flag, value, message) in [
            (
                "--size",
                "16",
                "invalid synthetic image size: expected 32 to 4096 pixels, found 16",
            ),
            (
                "--quality",
                "0",
                "invalid JPEG quality: expected 1 to 100, found 0",
            ),
            (
                "--images",
                "0",
                "invalid synthetic image count: expected at least 1, found 0",
            ),
        ] {
            let argv = ["--out", "/tmp/s", flag, value].map(OsString::from);
            assert_eq!(parse(argv.into_iter()).err().as_deref(), Some(message));
        }
    }

    #[test]
    fn an_argument_that_is_not_utf8_is_refused_naming_it() {
        use std::ffi::OsString;
        use std::os::unix::ffi::OsStringExt;
        let bad = || OsString::from_vec(b"/tmp/s\xff".to_vec());
        let expected = "argument '/tmp/s\u{fffd}' is not valid UTF-8 (U+FFFD marks the bytes \
                        that are not): give another path";
        for argv in [
            vec![OsString::from("--out"), bad()],
            vec![OsString::from("--images"), OsString::from("4"), bad()],
        ] {
            assert_eq!(parse(argv.into_iter()).err().as_deref(), Some(expected));
        }
        let good = ["--out", "/tmp/s", "--images=4"].map(OsString::from);
        let args = parse(good.into_iter()).unwrap().unwrap();
        assert_eq!((args.out, args.config.images), (PathBuf::from("/tmp/s"), 4));
    }
}
