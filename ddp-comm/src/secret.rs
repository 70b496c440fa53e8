//! The job's secret: the key of the handshake every connection between ranks starts with
//! (`auth.rs`). It never crosses the wire and is never printed.
//!
//! Where it comes from: `DDP_SECRET` (at least 128 bits in hexadecimal; `ddp-run` writes a
//! fresh one for every job), or the program ([`Options::with_secret`](crate::Options::with_secret)),
//! or, as a fallback, the run id. The fallback is as strong as the run id is hard to guess, which is
//! not at all for `"ddp-comm"`, a `SLURM_JOB_ID` or a `TORCHELASTIC_RUN_ID` (see the
//! crate's README, "Security").

use sha2::{Digest, Sha256};

/// Environment variable holding the job's secret: at least 32 hexadecimal digits (128 bits).
pub const SECRET_ENV: &str = "DDP_SECRET";
/// Fewest random bytes accepted in a secret (128 bits).
pub const MIN_SECRET_BYTES: usize = 16;
/// Most bytes accepted in a secret.
pub const MAX_SECRET_BYTES: usize = 64;

/// Where a [`Secret`] came from: it decides what a failed handshake tells the user to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SecretOrigin {
    /// The `DDP_SECRET` environment variable.
    Env,
    /// Given by the program ([`Secret::from_bytes`]).
    Given,
    /// Derived from the run id, for lack of either: anyone who knows the run id knows it.
    RunId,
}

/// The key of the connection handshake. Its `Debug` shows only where it came from.
#[derive(Clone)]
pub struct Secret {
    key: [u8; 32],
    origin: SecretOrigin,
}

impl Secret {
    /// A secret from random bytes the program holds (at least [`MIN_SECRET_BYTES`], at most
    /// [`MAX_SECRET_BYTES`]); every rank must be given the same. `None` for another length.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        (MIN_SECRET_BYTES..=MAX_SECRET_BYTES)
            .contains(&bytes.len())
            .then(|| Self::derive(b"bytes", bytes, SecretOrigin::Given))
    }

    /// A secret from its hexadecimal text (as `DDP_SECRET` holds it). `None` unless it is
    /// 32 to 128 hexadecimal digits, an even number.
    pub fn from_hex(text: &str) -> Option<Self> {
        let bytes = decode_hex(text.trim())?;
        Self::from_bytes(&bytes)
    }

    /// The fallback: a secret derived from the run id. It protects against ranks of other
    /// jobs, not against anyone who can guess the run id.
    pub fn from_run_id(run_id: &str) -> Self {
        Self::derive(b"run-id", run_id.as_bytes(), SecretOrigin::RunId)
    }

    /// `DDP_SECRET`'s secret, or the reason it cannot be used (which never quotes it).
    pub(crate) fn from_env_value(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let mut secret = Self::from_hex(text).ok_or_else(|| {
            format!(
                "<hidden: {} characters, {}>",
                text.len(),
                if decode_hex(text).is_some() {
                    "hexadecimal of another length"
                } else {
                    "not all hexadecimal digits"
                }
            )
        })?;
        secret.origin = SecretOrigin::Env;
        Ok(secret)
    }

    /// Where it came from.
    pub fn origin(&self) -> SecretOrigin {
        self.origin
    }

    /// What to check when a peer's secret differs from this one.
    pub(crate) fn hint(&self) -> &'static str {
        match self.origin {
            SecretOrigin::Env => "check that every rank was given the same DDP_SECRET",
            SecretOrigin::Given => {
                "check that every rank was given the same secret (Options::with_secret)"
            }
            SecretOrigin::RunId => {
                "DDP_SECRET is not set, so the secret comes from the run id: check that every \
                 rank has the same DDP_RUN_ID / TORCHELASTIC_RUN_ID / SLURM_JOB_ID, or give \
                 them all the same DDP_SECRET"
            }
        }
    }

    pub(crate) fn key(&self) -> &[u8; 32] {
        &self.key
    }

    /// Every origin's bytes are hashed under their own label, so a run id can never stand
    /// for a `DDP_SECRET` with the same bytes.
    fn derive(label: &[u8], bytes: &[u8], origin: SecretOrigin) -> Self {
        let mut hash = Sha256::new();
        hash.update(b"ddp-comm secret\0");
        hash.update(label);
        hash.update(b"\0");
        hash.update(bytes);
        Secret {
            key: hash.finalize().into(),
            origin,
        }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({:?}, <hidden>)", self.origin)
    }
}

impl PartialEq for Secret {
    /// Constant time in the key.
    fn eq(&self, other: &Self) -> bool {
        self.origin == other.origin
            && self
                .key
                .iter()
                .zip(&other.key)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl Eq for Secret {}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    let digits = text.as_bytes();
    if digits.len() % 2 != 0 {
        return None;
    }
    let value = |d: u8| (d as char).to_digit(16).map(|v| v as u8);
    digits
        .chunks_exact(2)
        .map(|pair| Some((value(pair[0])? << 4) | value(pair[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "00112233445566778899aabbccddeeff";

    #[test]
    fn hex_secrets_of_128_bits_and_more_are_accepted() {
        let a = Secret::from_hex(HEX).unwrap();
        assert_eq!(a, Secret::from_hex(&HEX.to_uppercase()).unwrap());
        assert_eq!(a, Secret::from_bytes(&decode_hex(HEX).unwrap()).unwrap());
        assert_ne!(a, Secret::from_hex(&HEX.replace('0', "1")).unwrap());
        assert!(Secret::from_hex(&HEX.repeat(4)).is_some());
        for bad in [
            &HEX[..30],
            &HEX[1..],
            "zz112233445566778899aabbccddeeff",
            "",
        ] {
            assert!(Secret::from_hex(bad).is_none(), "{bad}");
        }
        assert!(Secret::from_hex(&HEX.repeat(5)).is_none());
    }

    #[test]
    fn origins_never_share_a_key() {
        let env = Secret::from_env_value(HEX).unwrap();
        assert_eq!(env.origin(), SecretOrigin::Env);
        assert_eq!(env.key(), Secret::from_hex(HEX).unwrap().key());
        assert_ne!(Secret::from_run_id(HEX).key(), env.key());
        assert_eq!(
            Secret::from_run_id("job").key(),
            Secret::from_run_id("job").key()
        );
        assert_ne!(
            Secret::from_run_id("job").key(),
            Secret::from_run_id("job2").key()
        );
    }

    #[test]
    fn nothing_shows_the_secret() {
        let s = Secret::from_hex(HEX).unwrap();
        assert_eq!(format!("{s:?}"), "Secret(Given, <hidden>)");
        let why = Secret::from_env_value(&HEX[..30]).unwrap_err();
        assert_eq!(
            why,
            "<hidden: 30 characters, hexadecimal of another length>"
        );
        assert!(!why.contains(&HEX[..10]));
    }
}
