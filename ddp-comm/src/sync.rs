//! Locking that survives a panicking holder: the one helper the group, the heartbeat, the
//! communication thread and the throttles share, in a module of its own so that none of them
//! imports another for it.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the guard back if a panic poisoned it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
