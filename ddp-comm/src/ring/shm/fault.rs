//! The checks of the ring indices a shared-memory peer writes: the peer can write anything
//! into the segment, so `head` and `tail` are validated before they index the ring; and the
//! forged tail (feature `fault-injection`) that tests those checks across two processes.

/// A value the peer wrote into a shared segment that no correct peer can write: the
/// segment cannot be used any more.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RingFault {
    /// The sender's `head` claims more unread bytes than the ring holds, or went back.
    #[error(
        "its head {head} is impossible: this side consumed {tail} bytes and last saw head \
         {seen}, in a ring of {capacity} bytes"
    )]
    Head {
        head: u32,
        tail: u32,
        seen: u32,
        capacity: usize,
    },
    /// The receiver's `tail` is past `head`, more than the ring behind it, or went back.
    #[error(
        "its tail {tail} is impossible: this side wrote {head} bytes and last saw tail \
         {seen}, in a ring of {capacity} bytes"
    )]
    Tail {
        tail: u32,
        head: u32,
        seen: u32,
        capacity: usize,
    },
}

/// The receiver's check of the sender's `head`: this side consumed up to `tail` and last
/// accepted `seen`. A valid head is at most `capacity` bytes ahead of `tail` and not behind
/// `seen` (wrapping byte counts); returns the unread bytes, at most `capacity`.
pub(crate) fn check_head(
    tail: u32,
    seen: u32,
    head: u32,
    capacity: usize,
) -> Result<usize, RingFault> {
    let unread = head.wrapping_sub(tail) as usize;
    let known = seen.wrapping_sub(tail) as usize;
    if unread > capacity || unread < known {
        return Err(RingFault::Head {
            head,
            tail,
            seen,
            capacity,
        });
    }
    Ok(unread)
}

/// The sender's check of the receiver's `tail`: this side wrote up to `head` and last
/// accepted `seen`. A valid tail lies between `seen` and `head`, at most `capacity` bytes
/// behind `head` (wrapping byte counts); returns the free bytes, at most `capacity`.
pub(crate) fn check_tail(
    head: u32,
    seen: u32,
    tail: u32,
    capacity: usize,
) -> Result<usize, RingFault> {
    let used = head.wrapping_sub(tail) as usize;
    let known = head.wrapping_sub(seen) as usize;
    if used > capacity || used > known {
        return Err(RingFault::Tail {
            tail,
            head,
            seen,
            capacity,
        });
    }
    Ok(capacity - used)
}

/// The tail a receiver publishes: its own, but for the multi-process test of a peer that
/// writes an impossible one (`ddp-comm/tests/corrupt_ring.rs`): with the `fault-injection`
/// feature only, and `DDP_COMM_TEST_FORGE_TAIL` set, a tail 1 GiB past it, which no sender
/// can have written.
pub(super) fn published_tail(tail: u32) -> u32 {
    static FORGE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let forge = cfg!(feature = "fault-injection")
        && *FORGE.get_or_init(|| std::env::var_os("DDP_COMM_TEST_FORGE_TAIL").is_some());
    if forge {
        tail.wrapping_add(1 << 30)
    } else {
        tail
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN_CAPACITY: usize = super::super::MIN_CAPACITY;

    #[test]
    fn forged_heads_are_refused() {
        let cap = MIN_CAPACITY;
        // (tail, seen, head) -> unread bytes or a fault.
        assert_eq!(check_head(0, 0, 0, cap), Ok(0));
        assert_eq!(check_head(0, 0, cap as u32, cap), Ok(cap));
        assert_eq!(check_head(u32::MAX - 9, u32::MAX - 9, 20, cap), Ok(30));
        for (tail, seen, head) in [
            (0, 0, cap as u32 + 1),                   // more than the ring holds
            (100, 100, 99),                           // behind this side's tail (wraps to ~4 GiB)
            (0, 500, 400),                            // went back from a head already accepted
            (0, 0, u32::MAX),                         // garbage
            (u32::MAX - 9, u32::MAX - 9, cap as u32), // past capacity across the wrap
        ] {
            assert_eq!(
                check_head(tail, seen, head, cap),
                Err(RingFault::Head {
                    head,
                    tail,
                    seen,
                    capacity: cap
                }),
                "tail {tail} seen {seen} head {head}"
            );
        }
    }

    #[test]
    fn forged_tails_are_refused() {
        let cap = MIN_CAPACITY;
        // (head, seen, tail) -> free bytes or a fault.
        assert_eq!(check_tail(0, 0, 0, cap), Ok(cap));
        assert_eq!(check_tail(cap as u32, 0, 0, cap), Ok(0));
        assert_eq!(check_tail(10, u32::MAX - 5, 3, cap), Ok(cap - 7));
        for (head, seen, tail) in [
            (100, 0, 101),                                    // past what was written
            (cap as u32 + 10, 10, 5), // went back from a tail already accepted
            (0, 0, u32::MAX),         // garbage (one byte "ahead" of head)
            (2 * cap as u32, cap as u32 - 1, cap as u32 - 1), // more than the ring behind head
        ] {
            assert_eq!(
                check_tail(head, seen, tail, cap),
                Err(RingFault::Tail {
                    tail,
                    head,
                    seen,
                    capacity: cap
                }),
                "head {head} seen {seen} tail {tail}"
            );
        }
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

            /// Whatever head the peer writes, an accepted one leaves at most the ring's
            /// capacity to read, exactly the bytes between tail and head, and never less
            /// than was already accepted.
            #[test]
            fn an_accepted_head_stays_inside_the_ring(
                tail in any::<u32>(),
                known in 0usize..=4 * MIN_CAPACITY,
                ahead in 0u64..=8 * MIN_CAPACITY as u64,
                anything in any::<u32>(),
                wild in any::<bool>(),
                scale in 0u32..3,
            ) {
                let cap = MIN_CAPACITY << scale;
                let seen = tail.wrapping_add(known.min(cap) as u32);
                let head = if wild { anything } else { tail.wrapping_add(ahead as u32) };
                if let Ok(unread) = check_head(tail, seen, head, cap) {
                    prop_assert!(unread <= cap);
                    prop_assert_eq!(tail.wrapping_add(unread as u32), head);
                    prop_assert!(unread >= known.min(cap));
                }
            }

            /// Whatever tail the peer writes, an accepted one leaves at most the ring's
            /// capacity free, lies between the tail already accepted and head, and never
            /// frees bytes not yet written.
            #[test]
            fn an_accepted_tail_stays_inside_the_ring(
                head in any::<u32>(),
                known in 0usize..=4 * MIN_CAPACITY,
                behind in 0u64..=8 * MIN_CAPACITY as u64,
                anything in any::<u32>(),
                wild in any::<bool>(),
                scale in 0u32..3,
            ) {
                let cap = MIN_CAPACITY << scale;
                let seen = head.wrapping_sub(known.min(cap) as u32);
                let tail = if wild { anything } else { head.wrapping_sub(behind as u32) };
                if let Ok(free) = check_tail(head, seen, tail, cap) {
                    prop_assert!(free <= cap);
                    let used = cap - free;
                    prop_assert_eq!(tail.wrapping_add(used as u32), head);
                    prop_assert!(used <= known.min(cap));
                }
            }
        }
    }
}
