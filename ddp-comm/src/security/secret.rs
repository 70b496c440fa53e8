//! The job's secret: the key of the handshake every connection between ranks starts with
//! (`auth.rs`). It never crosses the wire and is never printed.
//!
//! Where it comes from: `DDP_SECRET` (at least 128 bits in hexadecimal; `ddp-run` writes a
//! fresh one for every job), or the program ([`Options::with_secret`](crate::Options::with_secret)),
//! or, as a fallback, the user's key file (`key_file.rs`: `DDP_SECRET_FILE`, else
//! `~/.config/ddp/secret`) together with the run id. Never the run id alone: a run id is no
//! secret (`"ddp-comm"`, a `SLURM_JOB_ID` from `squeue`, torchrun's `--rdzv-id` in argv).
//! See the crate's README, "Security".

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::CommError;
use crate::security::key_file::{self, decode_hex};

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
    /// Derived from the user's key file and the run id, for lack of either: every rank of
    /// the job must read the same file (one host, or a shared home folder).
    KeyFile,
}

/// The key of the connection handshake. Its `Debug` shows only where it came from.
#[derive(Clone)]
pub struct Secret {
    key: [u8; 32],
    origin: SecretOrigin,
    /// The key file, for [`SecretOrigin::KeyFile`].
    file: Option<PathBuf>,
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

    /// The secret of the key file at `path` (created with fresh random digits, mode 0600, if
    /// it does not exist; its folder must) for the run `run_id`: ranks that read the same
    /// file and share the run id have the same secret, and other run ids get other secrets.
    /// The file must belong to this user, be readable by no one else, and hold 32 to 128
    /// hexadecimal digits ([`CommError::SecretFile`] otherwise, never quoting it).
    pub fn from_key_file(path: &Path, run_id: &str) -> Result<Self, CommError> {
        Self::key_file(path, false, run_id)
    }

    /// The fallback when neither `DDP_SECRET` nor the program gave a secret: the key file
    /// `explicit` (`DDP_SECRET_FILE`), else the user's default one, whose folder is made if
    /// need be.
    pub(crate) fn fallback(explicit: Option<&Path>, run_id: &str) -> Result<Self, CommError> {
        let (path, make_folder) = match explicit {
            Some(path) => (path.to_path_buf(), false),
            None => {
                let path =
                    key_file::default_path(|name| std::env::var_os(name)).ok_or_else(|| {
                        CommError::MissingEnv {
                            var: crate::SECRET_ENV.into(),
                            why: "neither HOME nor XDG_CONFIG_HOME is set, so there is no key \
                              file (~/.config/ddp/secret) to take the job's secret from: set \
                              DDP_SECRET to the same 32 hexadecimal digits on every rank, \
                              e.g. from `openssl rand -hex 16`, or DDP_SECRET_FILE"
                                .into(),
                        }
                    })?;
                (path, true)
            }
        };
        Self::key_file(&path, make_folder, run_id)
    }

    /// A random secret for a group that makes no connection (a group of one).
    pub(crate) fn unused() -> Result<Self, CommError> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| CommError::Io {
            context: "drawing a secret".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
        Ok(Self::derive(b"bytes", &bytes, SecretOrigin::Given))
    }

    fn key_file(path: &Path, make_folder: bool, run_id: &str) -> Result<Self, CommError> {
        let (bytes, made) =
            key_file::read_or_create(path, make_folder, MIN_SECRET_BYTES..=MAX_SECRET_BYTES)?;
        if made {
            tracing::info!(
                "ddp-comm: created the key file {} (mode 0600) for the ranks' handshakes",
                path.display()
            );
        }
        // The file's bytes are length-prefixed, so no (file, run id) pair can stand for another.
        let mut material = (bytes.len() as u32).to_le_bytes().to_vec();
        material.extend_from_slice(&bytes);
        material.extend_from_slice(run_id.as_bytes());
        let mut secret = Self::derive(b"key-file", &material, SecretOrigin::KeyFile);
        secret.file = Some(path.to_path_buf());
        Ok(secret)
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

    /// The key file it was derived from, for [`SecretOrigin::KeyFile`].
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// What to check when a peer's secret differs from this one.
    pub(crate) fn hint(&self) -> String {
        match (self.origin, &self.file) {
            (SecretOrigin::Env, _) => "check that every rank was given the same DDP_SECRET".into(),
            (SecretOrigin::Given, _) => {
                "check that every rank was given the same secret (Options::with_secret)".into()
            }
            (SecretOrigin::KeyFile, file) => format!(
                "DDP_SECRET is not set, so the secret comes from the key file {} and the run \
                 id: ranks on hosts that do not share this file have different secrets; give \
                 every rank the same DDP_SECRET (e.g. `export DDP_SECRET=$(openssl rand -hex \
                 16)` where the job is submitted) or a DDP_SECRET_FILE they all share, and \
                 check that they have the same DDP_RUN_ID / TORCHELASTIC_RUN_ID / SLURM_JOB_ID and \
                 SLURM_STEP_ID",
                file.as_deref().unwrap_or(Path::new("?")).display()
            ),
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
            file: None,
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
    }

    #[test]
    fn a_key_file_gives_one_secret_per_run_id_and_never_the_run_id_alone() {
        let dir = ddp_testkit::temp_dir("ddp-comm-secret");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let job = Secret::from_key_file(&a, "job").unwrap();
        assert_eq!(job.origin(), SecretOrigin::KeyFile);
        assert_eq!(job.file(), Some(a.as_path()));
        assert_eq!(job, Secret::from_key_file(&a, "job").unwrap());
        assert_ne!(job, Secret::from_key_file(&a, "job2").unwrap());
        // Another file (another host without a shared home) is another secret.
        assert_ne!(job.key(), Secret::from_key_file(&b, "job").unwrap().key());
        // The file's digits as DDP_SECRET are not the key-file secret either.
        let digits = std::fs::read_to_string(&a).unwrap();
        assert_ne!(job.key(), Secret::from_hex(&digits).unwrap().key());
        assert!(
            job.hint().contains(&a.display().to_string()),
            "{}",
            job.hint()
        );
        assert!(!format!("{job:?}").contains(digits.trim()));
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
