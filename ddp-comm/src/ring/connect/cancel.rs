//! Stopping both halves of a ring's connection (`connect.rs`) once either fails.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::error::CommError;

/// Which half of [`ring`](super::ring) stopped the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Half {
    Connecting,
    /// The accepting half, or an `abort` it read in the store.
    Accepting,
}

/// What stops both halves of [`ring`](super::ring) once either fails: a flag their loops
/// check, and the socket of the connecting half's handshake in progress, shut down so that
/// a blocked read returns at once.
#[derive(Debug, Default)]
pub(super) struct Cancel {
    set: AtomicBool,
    first: Mutex<Option<Half>>,
    socket: Mutex<Option<OwnedFd>>,
}

impl Cancel {
    /// Stops both halves; `by` failed (the first caller is remembered).
    pub(super) fn stop(&self, by: Half) {
        if let Ok(mut first) = self.first.lock() {
            first.get_or_insert(by);
        }
        self.set.store(true, Ordering::SeqCst);
        if let Ok(socket) = self.socket.lock() {
            if let Some(fd) = socket.as_ref() {
                let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
            }
        }
    }

    pub(super) fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    /// The half that failed first.
    pub(super) fn first(&self) -> Option<Half> {
        self.first.lock().ok().and_then(|first| *first)
    }

    /// An error unless the halves go on (`what`: where this half was).
    pub(super) fn check(&self, what: &str) -> Result<(), CommError> {
        if self.is_set() {
            return Err(CommError::io(
                what.to_string(),
                io::Error::new(
                    io::ErrorKind::Interrupted,
                    "the other half of the ring failed",
                ),
            ));
        }
        Ok(())
    }

    /// Makes `socket` (the connecting half's handshake) the one a stop shuts down, until the
    /// returned guard drops; shut down at once if the halves are stopped already.
    pub(super) fn watch(&self, socket: BorrowedFd<'_>) -> Result<Watched<'_>, CommError> {
        let fd = socket
            .try_clone_to_owned()
            .map_err(|e| CommError::io("watching a ring handshake", e))?;
        if let Ok(mut slot) = self.socket.lock() {
            if self.is_set() {
                let _ = rustix::net::shutdown(&fd, rustix::net::Shutdown::Both);
            }
            *slot = Some(fd);
        }
        Ok(Watched(self))
    }
}

/// A socket [`Cancel::watch`]es; dropping the guard forgets it.
pub(super) struct Watched<'a>(&'a Cancel);

impl Drop for Watched<'_> {
    fn drop(&mut self) {
        if let Ok(mut slot) = self.0.socket.lock() {
            *slot = None;
        }
    }
}
