//! Values in torchrun's agent store, tagged with the job's secret.
//!
//! The agent's c10d TCPStore has no authentication (`c10d.rs`): anyone who reaches it can
//! change any key. So every value a rank writes there carries a tag, and every value it
//! reads must carry a good one:
//!
//! ```text
//! stored value = value | HMAC-SHA256(secret, "ddp-comm store value" | prefix | key | value)
//! ```
//!
//! with the context, the key prefix (run id, group and generation: `/ddp-comm/<run
//! id>/<group>/g<generation>/`) and the key each preceded by its length as a `u64` (LE), so
//! no tag is good for another key, group, start of the ranks or run id. (Jobs that share a run id, such as
//! torchrun's default `none`, and take their secret from the same key file share the secret
//! too, and so accept each other's tags.) A value without a good tag is an error naming its
//! key: a stranger cannot redirect a rank to an address of its own, pass itself off as a
//! host, hand over an NCCL unique id, or forge an `abort` reason. What a
//! stranger still can: delete keys or replay a key's earlier value of the same group (the
//! heartbeats), add to the counters (`join/<rank>`, `generation`, `alive/<g>`: not tagged,
//! being the store's own arithmetic), or write garbage, each of which stops the rendezvous or misleads a
//! diagnosis, never joins it.

use std::net::IpAddr;

use hmac::Mac;

use crate::error::CommError;
use crate::security::auth::{self, PROOF_LEN};
use crate::security::secret::Secret;
use crate::store::Store;

/// The context every tag starts with.
const CONTEXT: &[u8] = b"ddp-comm store value";
/// Bytes of a tag.
const TAG_LEN: usize = PROOF_LEN;

/// `inner`, whose values are tagged with the job's secret on `set` and checked on `get`.
#[derive(Debug)]
pub(crate) struct Signed<S> {
    inner: S,
    secret: Secret,
    /// The prefix the inner store puts before every key (the c10d client's).
    prefix: String,
}

impl<S: Store> Signed<S> {
    /// Tags what goes into `inner`, whose keys all carry `prefix`.
    pub(crate) fn new(inner: S, secret: Secret, prefix: String) -> Self {
        Signed {
            inner,
            secret,
            prefix,
        }
    }

    fn mac(&self, key: &str, value: &[u8]) -> hmac::Hmac<sha2::Sha256> {
        let mut mac = auth::keyed(&self.secret);
        for part in [CONTEXT, self.prefix.as_bytes(), key.as_bytes()] {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac.update(value);
        mac
    }
}

impl<S: Store> Store for Signed<S> {
    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let mut tagged = Vec::with_capacity(value.len() + TAG_LEN);
        tagged.extend_from_slice(value);
        tagged.extend_from_slice(&self.mac(key, value).finalize().into_bytes());
        self.inner.set(key, &tagged)
    }

    fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, CommError> {
        let Some(mut value) = self.inner.get(key)? else {
            return Ok(None);
        };
        let good = value.len() >= TAG_LEN && {
            let tag = value.split_off(value.len() - TAG_LEN);
            // Constant time.
            self.mac(key, &value).verify_slice(&tag).is_ok()
        };
        if !good {
            return Err(CommError::Store {
                addr: self.inner.addr().to_string(),
                detail: format!(
                    "the value of '{key}' is forged: it does not carry this job's tag, so a \
                     process without this rank's secret wrote it (a stranger that reached \
                     the unauthenticated agent store, or a rank whose secret differs: {})",
                    self.secret.hint()
                ),
            });
        }
        Ok(Some(value))
    }

    fn add(&mut self, key: &str, delta: i64) -> Result<i64, CommError> {
        self.inner.add(key, delta)
    }

    fn check(&mut self, keys: &[String]) -> Result<bool, CommError> {
        self.inner.check(keys)
    }

    fn addr(&self) -> &str {
        self.inner.addr()
    }

    fn local_ip(&self) -> IpAddr {
        self.inner.local_ip()
    }

    fn peer_ip(&self) -> IpAddr {
        self.inner.peer_ip()
    }
}
