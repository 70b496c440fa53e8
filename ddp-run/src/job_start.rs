//! When the job started: the launcher's start, which every rank of every attempt gets in
//! [`DDP_JOB_STARTED`], so that a rank restarted after a failure counts its time limit from
//! the job's start, as the scheduler's limit counts, not from its own.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::LaunchError;

/// When the launcher started the job (before its first attempt), set for every rank it
/// starts, the same in every attempt: Unix time in seconds with nine decimals (nanoseconds),
/// as `date +%s.%N` prints it, by the wall clock (the one clock that processes compare).
/// A launcher that inherits a valid one (an outer launcher's, or a job script's `export
/// DDP_JOB_STARTED=$(date +%s.%N)`) passes on the earlier of it and its own start.
pub const DDP_JOB_STARTED: &str = "DDP_JOB_STARTED";

/// `at` as [`DDP_JOB_STARTED`] writes it: `SECONDS.NANOSECONDS`, nine decimals.
pub(crate) fn format(at: SystemTime) -> String {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    format!("{}.{:09}", since.as_secs(), since.subsec_nanos())
}

/// A [`DDP_JOB_STARTED`] value: whole seconds since the Unix epoch, with up to nine
/// decimals (more are cut). `None` for anything else.
fn parse(value: &str) -> Option<SystemTime> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (secs, fraction) = match value.split_once('.') {
        Some((secs, fraction)) if digits(fraction) => (secs, fraction),
        Some(_) => return None,
        None => (value, ""),
    };
    if !digits(secs) {
        return None;
    }
    let nanos = format!("{:0<9}", &fraction[..fraction.len().min(9)]);
    let since = Duration::new(secs.parse().ok()?, nanos.parse().ok()?);
    UNIX_EPOCH.checked_add(since)
}

/// When the job started, from [`DDP_JOB_STARTED`] (`None` when it is not set: a rank not
/// started by ddp-run), as it reads: a start after this process's clock (a clock stepped
/// back since the launcher read it) is the caller's to take as now.
///
/// Fails with [`LaunchError::Invalid`], naming the variable, when it is not Unix seconds: a
/// time limit counted from a wrong start would be wrong.
pub fn job_started() -> Result<Option<SystemTime>, LaunchError> {
    let value = std::env::var_os(DDP_JOB_STARTED).map(|v| v.to_string_lossy().into_owned());
    job_started_from(value.as_deref()).map_err(LaunchError::Invalid)
}

/// [`job_started`] from the variable's `value`.
fn job_started_from(value: Option<&str>) -> Result<Option<SystemTime>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    parse(value.trim()).map(Some).ok_or_else(|| {
        format!(
            "{DDP_JOB_STARTED} is `{value}`, not the job's start in Unix seconds (as \
             `date +%s.%N` prints it): it is set by ddp-run for the ranks it starts; unset it \
             or correct it"
        )
    })
}

/// The job's start for a launcher that starts at `now`: the earlier of `now` and the start
/// it inherited in [`DDP_JOB_STARTED`], so that a launcher inside another (or run twice by a
/// job script that set the variable) does not count the job again from its own start; and
/// the warning to give where that start is more than a minute old ([`stale_warning`]).
pub(crate) fn launcher_start(now: SystemTime) -> (SystemTime, Option<String>) {
    let inherited = std::env::var_os(DDP_JOB_STARTED).map(|v| v.to_string_lossy().into_owned());
    let start = earlier_than_inherited(inherited.as_deref(), now);
    (start, stale_warning(start, now))
}

/// The warning that the job's start, `start`, inherited by a launcher started at `now`, is
/// more than a minute older than it: a stale `export` in a job script reaches every job
/// (`sbatch --export=ALL`), and each rank with a time limit would stop at its first step.
fn stale_warning(start: SystemTime, now: SystemTime) -> Option<String> {
    let age = now.duration_since(start).ok()?.as_secs();
    if age <= 60 {
        return None;
    }
    let (hours, minutes, seconds) = (age / 3600, age / 60 % 60, age % 60);
    let age = match hours {
        0 => format!("{minutes}m{seconds}s"),
        _ => format!("{hours}h{minutes}m"),
    };
    Some(format!(
        "ranks with a --time-limit count it from an inherited {DDP_JOB_STARTED} {age} ago: \
         unset it if that is not this job's start"
    ))
}

/// `now`, or the `inherited` start where that is valid and earlier.
fn earlier_than_inherited(inherited: Option<&str>, now: SystemTime) -> SystemTime {
    match inherited.and_then(|v| parse(v.trim())) {
        Some(at) => at.min(now),
        None => now,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64, nanos: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, nanos)
    }

    #[test]
    fn a_start_goes_through_the_variable_to_the_nanosecond() {
        let start = at(1_700_000_000, 123_456_789);
        assert_eq!(format(start), "1700000000.123456789");
        assert_eq!(format(at(5, 7)), "5.000000007");
        assert_eq!(parse(&format(start)), Some(start));
        // What `date +%s` and `date +%s.%N` print, and fewer or more decimals.
        assert_eq!(parse("1700000000"), Some(at(1_700_000_000, 0)));
        assert_eq!(parse("1700000000.5"), Some(at(1_700_000_000, 500_000_000)));
        assert_eq!(
            parse("1700000000.1234567891"),
            Some(at(1_700_000_000, 123_456_789))
        );
        for bad in [
            "",
            ".5",
            "17.",
            "-1",
            "1e9",
            "17.-5",
            "1 2",
            "2024-01-01",
            "17.5.1",
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_start_is_refused_only_when_unreadable() {
        assert_eq!(job_started_from(None), Ok(None));
        let past = job_started_from(Some(" 1699990000.25\n"));
        assert_eq!(past, Ok(Some(at(1_699_990_000, 250_000_000))));
        // A start after the clock (stepped back since the launcher read it) is the caller's.
        assert_eq!(
            job_started_from(Some("4102444800")),
            Ok(Some(at(4_102_444_800, 0)))
        );
        let garbage = job_started_from(Some("yesterday")).unwrap_err();
        assert!(
            garbage.starts_with("DDP_JOB_STARTED is `yesterday`, not the job's start in Unix"),
            "{garbage}"
        );
    }

    /// A launcher inside another, or run a second time by a job script, keeps the earlier
    /// start it inherited; an unreadable or later one is its own start's.
    #[test]
    fn a_launcher_keeps_an_earlier_start_it_inherited() {
        let now = at(1_700_000_000, 0);
        assert_eq!(earlier_than_inherited(None, now), now);
        assert_eq!(
            earlier_than_inherited(Some("1699992800.5\n"), now),
            at(1_699_992_800, 500_000_000)
        );
        assert_eq!(earlier_than_inherited(Some("1700000100"), now), now);
        assert_eq!(earlier_than_inherited(Some("yesterday"), now), now);
        assert_eq!(earlier_than_inherited(Some(""), now), now);
    }

    /// An inherited start more than a minute before the launcher's is said, with its age.
    #[test]
    fn an_old_inherited_start_is_warned_of() {
        let now = at(1_700_000_000, 0);
        let ago = |secs: u64| stale_warning(at(1_700_000_000 - secs, 0), now);
        assert_eq!(
            ago(3 * 3600 + 12 * 60 + 5).as_deref(),
            Some(
                "ranks with a --time-limit count it from an inherited DDP_JOB_STARTED 3h12m \
                 ago: unset it if that is not this job's start"
            )
        );
        assert!(ago(61).unwrap().contains(" 1m1s ago: "));
        assert_eq!(ago(60), None);
        assert_eq!(ago(0), None);
    }
}
