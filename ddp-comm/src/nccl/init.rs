//! Creating a communicator: a non-blocking `ncclCommInitRankConfig`, polled until it is
//! done, it fails, or the timeout passes (the module's documentation says why). NCCL's
//! `NCCL_COMM_BLOCKING=1` would silently make it blocking again: it is refused first.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_sys::{ncclComm_t, ncclConfig_t, ncclResult_t, ncclUniqueId, Cudart, Nccl};

use super::inflight::InFlight;
use super::{check_cuda, last_error, nccl_text, settle, with_last_error, NcclComm, Unsettled};
use crate::error::{CommError, Diagnosis};
use crate::store::heartbeat::Heartbeat;

/// NCCL's variable that overrides the communicator's `blocking` setting.
pub(crate) const COMM_BLOCKING_ENV: &str = "NCCL_COMM_BLOCKING";

/// Refuses a process whose `NCCL_COMM_BLOCKING` (read through `get`) says 1. NCCL applies it
/// over the config's `blocking = 0` (`envConfigOverride`), and a blocking
/// `ncclCommInitRankConfig` waits, with no timeout, for every rank to join: a peer that died
/// after the barrier before init would hang this rank for good. NCCL reads the value as
/// `strtoll(value, NULL, 0)` and acts on 0 and 1 only, so `0x1` or ` 1` count too and `0`,
/// other numbers or text do not. (A `NCCL_COMM_BLOCKING=1` line in `~/.nccl.conf` or
/// `/etc/nccl.conf` has the same effect and is not seen here.)
pub(crate) fn refuse_blocking_init(get: impl Fn(&str) -> Option<String>) -> Result<(), CommError> {
    let Some(value) = get(COMM_BLOCKING_ENV) else {
        return Ok(());
    };
    if c_integer(&value) != Some(1) {
        return Ok(());
    }
    Err(CommError::MalformedEnv {
        var: COMM_BLOCKING_ENV.to_string(),
        value,
        expected: "unset or 0: it makes NCCL's communicator init blocking, which waits \
                   without a timeout for a rank that never joins; ddp-comm's non-blocking \
                   init is bounded by the rendezvous and collective timeouts"
            .to_string(),
    })
}

/// What C's `strtoll(text, NULL, 0)` reads from `text`: leading white space, a sign, then a
/// hexadecimal (`0x`), octal (`0`) or decimal number, as far as its digits go (0 when there
/// are none); `None` when it overflows (`ERANGE`, which NCCL treats as unset).
fn c_integer(text: &str) -> Option<i64> {
    let t = text.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let (negative, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let hex = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X"));
    let (radix, digits) = match hex {
        Some(rest) if rest.starts_with(|c: char| c.is_ascii_hexdigit()) => (16, rest),
        _ if t.starts_with('0') => (8, t),
        _ => (10, t),
    };
    let mut value: i64 = 0;
    for d in digits.chars().map_while(|c| c.to_digit(radix)) {
        value = value
            .checked_mul(i64::from(radix))?
            .checked_add(i64::from(d))?;
    }
    Some(if negative { -value } else { value })
}

impl NcclComm {
    /// `cudaSetDevice(device)`, then a non-blocking `ncclCommInitRankConfig`, polled until
    /// it is done, it fails, or `init_timeout` passes (see the module's documentation); its
    /// collectives then time out after `op_timeout`.
    pub(crate) fn init(
        rank: usize,
        world: usize,
        device: usize,
        id: ncclUniqueId,
        init_timeout: Duration,
        op_timeout: Duration,
        heartbeat: Arc<Heartbeat>,
    ) -> Result<Self, CommError> {
        let nccl = Nccl::load()?;
        let cudart = Cudart::load()?;
        let ordinal = device as c_int;
        // SAFETY: plain CUDA runtime call with a device ordinal.
        check_cuda("cudaSetDevice", unsafe { (cudart.cudaSetDevice)(ordinal) })?;
        let failed = |what: String, diagnosis: Diagnosis| CommError::NcclInit {
            rank,
            device,
            what,
            diagnosis: Box::new(diagnosis),
        };
        let abort = |comm: ncclComm_t| {
            if !comm.is_null() {
                // SAFETY: `comm` came from ncclCommInitRankConfig and is not used again.
                unsafe { (nccl.ncclCommAbort)(comm) };
            }
        };
        let mut config = ncclConfig_t::initializer();
        config.blocking = 0;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let start = Instant::now();
        // SAFETY: `comm` is a valid out-pointer, `config` a valid config that outlives the
        // call (NCCL copies it); `id` is passed by value as the C API expects.
        let rc = unsafe {
            (nccl.ncclCommInitRankConfig)(&mut comm, world as c_int, id, rank as c_int, &mut config)
        };
        let nccl_failed = |prefix: &str, rc: ncclResult_t| {
            let detail = with_last_error(rc, &nccl_text(nccl, rc), &last_error(nccl, comm));
            abort(comm);
            Err(failed(
                format!("failed: {prefix}{detail}"),
                Diagnosis::default(),
            ))
        };
        if rc != ncclResult_t::ncclSuccess && rc != ncclResult_t::ncclInProgress {
            return nccl_failed("ncclCommInitRankConfig: ", rc);
        }
        if comm.is_null() {
            let what = "failed: ncclCommInitRankConfig returned no communicator".to_string();
            return Err(failed(what, Diagnosis::default()));
        }
        match settle(nccl, comm, "ncclCommInitRankConfig", start, init_timeout) {
            Ok(()) => {}
            Err(Unsettled::Failed { rc, .. }) => return nccl_failed("", rc),
            Err(Unsettled::TimedOut) => {
                // Diagnose first: the heartbeats say which rank never joined.
                let diagnosis = heartbeat.diagnose();
                abort(comm);
                let what = format!("timed out after {init_timeout:?}");
                return Err(failed(what, diagnosis));
            }
        }
        Ok(NcclComm {
            nccl,
            cudart,
            comm,
            side: None,
            device: ordinal,
            timeout: op_timeout,
            inflight: InFlight::new(),
            heartbeat,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(value: Option<&str>) -> bool {
        let got = refuse_blocking_init(|name| {
            assert_eq!(name, "NCCL_COMM_BLOCKING");
            value.map(str::to_string)
        });
        match got {
            Ok(()) => false,
            Err(e @ CommError::MalformedEnv { .. }) => {
                let text = e.to_string();
                assert!(text.contains("NCCL_COMM_BLOCKING"), "{text}");
                assert!(text.contains("without a timeout"), "{text}");
                true
            }
            Err(e) => panic!("unexpected error {e:?}"),
        }
    }

    /// Every value NCCL reads as 1 is refused, and only those.
    #[test]
    fn a_blocking_override_is_refused_as_nccl_reads_it() {
        for one in ["1", " 1", "\t+1", "01", "0x1", "0X01", "1abc", "1 "] {
            assert!(refused(Some(one)), "{one:?} was accepted");
        }
        for other in [
            None,
            Some(""),
            Some("0"),
            Some("2"),
            Some("-1"),
            Some("true"),
            Some("yes"),
            Some("0x"),
            Some("99999999999999999999"),
        ] {
            assert!(!refused(other), "{other:?} was refused");
        }
    }

    #[test]
    fn c_integers_are_read_as_strtoll_reads_them() {
        for (text, want) in [
            ("12", Some(12)),
            ("  -12x", Some(-12)),
            ("0x1f", Some(31)),
            ("017", Some(15)),
            ("08", Some(0)),
            ("0x", Some(0)),
            ("x1", Some(0)),
            ("9223372036854775808", None),
        ] {
            assert_eq!(c_integer(text), want, "{text:?}");
        }
    }
}
