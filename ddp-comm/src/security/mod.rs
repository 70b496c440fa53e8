//! Trust between ranks: every connection proves the job's secret before anything else
//! crosses it, and strangers cost a bounded amount.
//!
//! - `secret.rs`: [`Secret`](crate::Secret), the key of the handshake, and where it comes from.
//! - `key_file.rs`: the per-user key file the secret is derived from when no launcher gave one.
//! - `auth.rs`: the mutual challenge–response every connection starts with (the store's and
//!   the ring's).
//! - `throttle.rs`: rate-limited warnings about strangers, and the counted slots of the
//!   handshakes in progress on a listener.

pub(crate) mod auth;
pub(crate) mod key_file;
pub(crate) mod secret;
pub(crate) mod throttle;
