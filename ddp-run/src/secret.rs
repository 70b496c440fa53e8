//! The job's secret: 128 random bits from the OS, drawn once per job (the same for every
//! attempt and every rank) and given to the ranks only in their environment (`DDP_SECRET`,
//! hexadecimal), never on a command line and never in a message. ddp-comm's ranks prove it
//! to each other on every connection without sending it.

use crate::{LaunchConfig, LaunchError};

/// The environment variable that holds the job's secret (hexadecimal), which ddp-comm's
/// ranks prove to each other on every connection. Not torchrun's: ddp-run's own, given only
/// in the environment.
pub const DDP_SECRET: &str = "DDP_SECRET";

/// Random bytes of a secret the launcher draws.
pub const SECRET_BYTES: usize = 16;

/// A job's secret. Its `Debug` does not show it; only [`JobSecret::apply`] writes it, into a
/// command's environment.
///
/// ```
/// use std::process::Command;
///
/// let a = ddp_run::JobSecret::generate()?;
/// let b = ddp_run::JobSecret::generate()?;
/// assert_ne!(a, b);
/// assert_eq!(format!("{a:?}"), "JobSecret(<hidden>)");
/// let mut cmd = Command::new("true");
/// a.apply(&mut cmd); // DDP_SECRET=<32 hexadecimal digits>
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct JobSecret(String);

impl JobSecret {
    /// 128 fresh random bits from the OS.
    pub fn generate() -> std::io::Result<Self> {
        let mut bytes = [0u8; SECRET_BYTES];
        getrandom::fill(&mut bytes)
            .map_err(|e| std::io::Error::other(format!("no random bytes from the OS: {e}")))?;
        Ok(JobSecret(
            bytes.iter().map(|b| format!("{b:02x}")).collect(),
        ))
    }

    /// A secret given as text (as `DDP_SECRET` holds it): 32 to 128 hexadecimal digits, an
    /// even number, as ddp-comm accepts. `None` otherwise.
    pub fn from_hex(text: &str) -> Option<Self> {
        let text = text.trim();
        let ok = (32..=128).contains(&text.len())
            && text.len().is_multiple_of(2)
            && text.bytes().all(|b| b.is_ascii_hexdigit());
        ok.then(|| JobSecret(text.to_ascii_lowercase()))
    }

    /// Sets `DDP_SECRET` on `cmd`.
    pub fn apply<'c>(&self, cmd: &'c mut std::process::Command) -> &'c mut std::process::Command {
        cmd.env(DDP_SECRET, &self.0)
    }
}

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobSecret(<hidden>)")
    }
}

/// The secret of a job: `DDP_SECRET` from the configuration's variables, else from the
/// launcher's own environment (every node of a job must be given the same), else a fresh
/// one on a single node; `None` for several nodes without one (their ranks fall back to the
/// user's key file, see ddp-comm's README).
pub(crate) fn job_secret(config: &LaunchConfig) -> Result<Option<JobSecret>, LaunchError> {
    let given = config.given_secret();
    match given {
        Some(text) => text
            .to_str()
            .and_then(JobSecret::from_hex)
            .map(Some)
            .ok_or_else(|| {
                LaunchError::Invalid(format!(
                    "{DDP_SECRET} is set but is not 32 to 128 hexadecimal digits ({} \
                     characters; its value is not shown): unset it, and ddp-run draws a \
                     fresh secret for a single node; several nodes need the same one, e.g. \
                     from `openssl rand -hex 16`",
                    text.len()
                ))
            }),
        None if config.nnodes == 1 => JobSecret::generate()
            .map(Some)
            .map_err(|e| LaunchError::Invalid(format!("cannot draw the job's secret: {e}"))),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_secrets_are_128_bits_of_hex_and_differ() {
        let a = JobSecret::generate().unwrap();
        assert_eq!(a.0.len(), 32);
        assert!(a.0.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, JobSecret::generate().unwrap());
    }

    #[test]
    fn given_secrets_are_checked() {
        let hex = "0123456789ABCDEF0123456789abcdef";
        assert_eq!(
            JobSecret::from_hex(hex).unwrap().0,
            hex.to_ascii_lowercase()
        );
        for bad in [&hex[..30], &hex[1..], "g123456789abcdef0123456789abcdef"] {
            assert_eq!(JobSecret::from_hex(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_job_gets_the_configured_secret_else_a_fresh_one_on_one_node() {
        let hex = "00112233445566778899aabbccddeeff";
        let mut config = LaunchConfig::new("true", 2);
        config.env.push((DDP_SECRET.into(), hex.into()));
        assert_eq!(job_secret(&config).unwrap(), JobSecret::from_hex(hex));
        config.env.push((DDP_SECRET.into(), "short".into()));
        let err = job_secret(&config).unwrap_err().to_string();
        assert!(
            err.contains("5 characters") && !err.contains("short"),
            "{err}"
        );
        if std::env::var_os(DDP_SECRET).is_none() {
            let single = LaunchConfig::new("true", 2);
            let (a, b) = (job_secret(&single).unwrap(), job_secret(&single).unwrap());
            assert!(a.is_some() && a != b);
            let nodes = LaunchConfig {
                nnodes: 2,
                ..LaunchConfig::new("true", 2)
            };
            assert_eq!(job_secret(&nodes).unwrap(), None);
        }
    }
}
