//! Locking that survives a panicking holder: the one helper the group, the heartbeat and the
//! communication thread share, in a module of its own so that none of them imports another
//! for it; and the counted slots that bound the handshakes in progress on a listener.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Locks `m`, taking the guard back if a panic poisoned it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One of at most `max` handshakes in progress on a listener, counted in `count` until it
/// is dropped, however its handshake ends (a panic included).
pub(crate) struct Pending(Arc<AtomicUsize>);

impl Pending {
    /// A slot, or `None` when `max` are taken.
    pub(crate) fn take(count: &Arc<AtomicUsize>, max: usize) -> Option<Self> {
        if count.fetch_add(1, Ordering::SeqCst) >= max {
            count.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Pending(count.clone()))
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
