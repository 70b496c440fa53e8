//! When the job started: the launcher's start, which every rank of every attempt gets in
//! [`DDP_JOB_STARTED`], so that a rank restarted after a failure counts its time limit from
//! the job's start, as the scheduler's limit counts, not from its own.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::LaunchError;

/// When the launcher started the job (before its first attempt), set for every rank it
/// starts, the same in every attempt: Unix time in seconds with nine decimals (nanoseconds),
/// as `date +%s.%N` prints it, by the wall clock (the one clock that processes compare).
pub const DDP_JOB_STARTED: &str = "DDP_JOB_STARTED";

/// How far ahead of this process's clock [`job_started`] takes a start as now rather than
/// refusing it.
const FUTURE_SLACK: Duration = Duration::from_secs(60);

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
/// started by ddp-run). A start up to a minute ahead of this process's clock (a clock stepped
/// back since the launcher read it) is now.
///
/// Fails with [`LaunchError::Invalid`], naming the variable, when it is not Unix seconds or
/// lies further in the future: a time limit counted from a wrong start would be wrong.
pub fn job_started() -> Result<Option<SystemTime>, LaunchError> {
    let value = std::env::var_os(DDP_JOB_STARTED).map(|v| v.to_string_lossy().into_owned());
    job_started_from(value.as_deref(), SystemTime::now()).map_err(LaunchError::Invalid)
}

/// [`job_started`] from the variable's `value`, at `now`.
fn job_started_from(value: Option<&str>, now: SystemTime) -> Result<Option<SystemTime>, String> {
    let Some(value) = value else {
        return Ok(None);
    };
    let at = parse(value.trim()).ok_or_else(|| {
        format!(
            "{DDP_JOB_STARTED} is `{value}`, not the job's start in Unix seconds (as \
             `date +%s.%N` prints it): it is set by ddp-run for the ranks it starts; unset it \
             or correct it"
        )
    })?;
    match at.duration_since(now) {
        Ok(ahead) if ahead > FUTURE_SLACK => Err(format!(
            "{DDP_JOB_STARTED} is `{value}`, {} s after this machine's clock: the job cannot \
             have started in the future; unset it or correct it",
            ahead.as_secs()
        )),
        Ok(_) => Ok(Some(now)),
        Err(_) => Ok(Some(at)),
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
    fn the_start_is_refused_only_when_unreadable_or_in_the_future() {
        let now = at(1_700_000_000, 0);
        assert_eq!(job_started_from(None, now), Ok(None));
        let past = job_started_from(Some(" 1699990000.25\n"), now);
        assert_eq!(past, Ok(Some(at(1_699_990_000, 250_000_000))));
        // A clock stepped back a little since the launcher read it: now.
        assert_eq!(job_started_from(Some("1700000030"), now), Ok(Some(now)));
        let ahead = job_started_from(Some("1700000100"), now).unwrap_err();
        assert!(
            ahead.starts_with("DDP_JOB_STARTED is `1700000100`, 100 s after this machine's clock"),
            "{ahead}"
        );
        let garbage = job_started_from(Some("yesterday"), now).unwrap_err();
        assert!(
            garbage.starts_with("DDP_JOB_STARTED is `yesterday`, not the job's start in Unix"),
            "{garbage}"
        );
    }
}
