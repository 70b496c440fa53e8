//! Choosing a free port for a single-node rendezvous.
//!
//! A port the kernel hands out for `127.0.0.1:0` comes from the ephemeral range, the same range
//! it draws the local ports of outgoing connections from: between the moment the launcher
//! frees its probe and the moment rank 0 listens, any process's new connection may take it.
//! Ports below that range are never handed out that way, so a free one stays free unless
//! another program binds it explicitly.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// Lowest port tried.
const LOW: u16 = 20_000;

/// A port on 127.0.0.1 that was free a moment ago, chosen at random below Linux's ephemeral
/// range (`/proc/sys/net/ipv4/ip_local_port_range`, usually from 32768), so that outgoing
/// connections cannot take it before rank 0 listens on it. Falls back to a port the kernel
/// chooses when that range is too small to search.
pub fn free_port() -> std::io::Result<u16> {
    let high = ephemeral_start().min(32_768);
    if high > LOW + 1000 {
        let span = u32::from(high - LOW);
        let mut seed = seed();
        for _ in 0..1000 {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let port = LOW + ((seed >> 8) % span) as u16;
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()
        .map(|a| a.port())
}

/// The first port of the ephemeral range (32768 when it cannot be read).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A different starting point for every call in every process.
fn seed() -> u32 {
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let calls = CALLS.fetch_add(1, Ordering::Relaxed);
    nanos ^ std::process::id().wrapping_mul(2_654_435_761) ^ calls.wrapping_mul(40_503)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_below_the_ephemeral_range_and_never_one_in_use() {
        let start = ephemeral_start();
        let mut held = Vec::new();
        for _ in 0..20 {
            let port = free_port().unwrap();
            if start.min(32_768) > LOW + 1000 {
                assert!((LOW..start).contains(&port), "{port}");
            }
            assert!(
                !held
                    .iter()
                    .any(|l: &TcpListener| l.local_addr().unwrap().port() == port),
                "{port} is in use by this test"
            );
            // Keep it busy, so that later calls must pass it over. (Another program on the
            // machine may have taken it meanwhile: then there is nothing to hold.)
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
                held.push(l);
            }
        }
    }
}
