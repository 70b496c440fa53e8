//! Ring schedules: which byte ranges a rank sends to its successor and receives from its
//! predecessor, in which order, and which received segment each send waits for.
//!
//! The schedules are pure data, built once per call into reusable vectors; `cpu.rs`
//! executes them over the links. Every piece is cut into segments of at most `segment` bytes so
//! that a rank forwards segment `j` as soon as it has received (and reduced) it, while
//! segment `j + 1` is still on the wire: this is what pipelines the ring.

/// The ring order of a world: hosts in the order of their lowest rank, and each host's
/// ranks in a row in rank order, so that a ring over `h` hosts crosses between hosts `h`
/// times (with one host: rank order). `hosts[r]` is rank `r`'s host identity.
pub(crate) fn host_order(hosts: &[&str]) -> Vec<usize> {
    let mut firsts: Vec<&str> = Vec::new();
    for host in hosts {
        if !firsts.contains(host) {
            firsts.push(host);
        }
    }
    firsts
        .iter()
        .flat_map(|h| (0..hosts.len()).filter(move |&r| hosts[r] == *h))
        .collect()
}

/// A byte range of the working buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    /// Offset in bytes.
    pub off: usize,
    /// Length in bytes.
    pub len: usize,
}

/// A segment to send once `after` received segments are complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SendSeg {
    pub span: Span,
    pub after: usize,
}

/// What a received segment does to the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recv {
    /// Overwrites it.
    Copy,
    /// Combines into it.
    Reduce,
    /// Combines into it, and completes the reduction of these bytes: the last
    /// reduce-scatter hop, at the piece's owner, where an average divides them.
    ReduceLast,
}

/// A segment to receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecvSeg {
    pub span: Span,
    pub recv: Recv,
}

/// One rank's part of a ring collective.
#[derive(Debug, Default)]
pub(crate) struct Schedule {
    pub sends: Vec<SendSeg>,
    pub recvs: Vec<RecvSeg>,
}

/// Splits `total` bytes of `elem`-byte elements into `parts` element-aligned spans whose
/// sizes differ by at most one element.
pub(crate) fn split_even(total: usize, elem: usize, parts: usize, out: &mut Vec<Span>) {
    out.clear();
    let elems = total / elem;
    let (base, extra) = (elems / parts, elems % parts);
    let mut off = 0;
    for i in 0..parts {
        let len = (base + usize::from(i < extra)) * elem;
        out.push(Span { off, len });
        off += len;
    }
}

fn segments(span: Span, segment: usize) -> impl Iterator<Item = Span> {
    let count = span.len.div_ceil(segment);
    (0..count).map(move |j| {
        let off = span.off + j * segment;
        Span {
            off,
            len: segment.min(span.off + span.len - off),
        }
    })
}

impl Schedule {
    /// A ring pass: in step `t` send piece `steps[t].0`, receive piece `steps[t].1` as
    /// `steps[t].2` says. The piece sent in step `t > 0` must be the one received in step
    /// `t - 1`; its segment `j` waits for that received segment `j`.
    pub(crate) fn ring(
        &mut self,
        pieces: &[Span],
        steps: impl Iterator<Item = (usize, usize, Recv)>,
        segment: usize,
    ) {
        self.sends.clear();
        self.recvs.clear();
        let mut prev: Option<(usize, usize)> = None; // (piece, index of its first recv segment)
        for (send, recv, how) in steps {
            match prev {
                None => self
                    .sends
                    .extend(segments(pieces[send], segment).map(|span| SendSeg { span, after: 0 })),
                Some((piece, first)) => {
                    debug_assert_eq!(
                        piece, send,
                        "ring step sends a piece it did not just receive"
                    );
                    self.sends
                        .extend(
                            segments(pieces[send], segment)
                                .enumerate()
                                .map(|(j, span)| SendSeg {
                                    span,
                                    after: first + j + 1,
                                }),
                        );
                }
            }
            prev = Some((recv, self.recvs.len()));
            self.recvs
                .extend(segments(pieces[recv], segment).map(|span| RecvSeg { span, recv: how }));
        }
    }

    /// Ring all-reduce on `n` pieces: `n - 1` reduce-scatter steps, then `n - 1` all-gather
    /// steps. Afterwards every rank holds every piece fully reduced; piece `c` was reduced
    /// in the same order on the way to its owner, so all ranks hold identical bytes. The
    /// owner receives it last as [`Recv::ReduceLast`], before it forwards it.
    pub(crate) fn all_reduce(&mut self, pieces: &[Span], rank: usize, segment: usize) {
        let n = pieces.len();
        let at = |k: isize| (rank as isize + k).rem_euclid(n as isize) as usize;
        let reduce_scatter = (0..n - 1).map(|t| {
            let how = if t == n - 2 {
                Recv::ReduceLast
            } else {
                Recv::Reduce
            };
            (at(-(t as isize)), at(-(t as isize) - 1), how)
        });
        let all_gather = (0..n - 1).map(|s| (at(1 - s as isize), at(-(s as isize)), Recv::Copy));
        self.ring(pieces, reduce_scatter.chain(all_gather), segment);
    }

    /// Ring all-gather: rank `r` starts with piece `r` and ends with all `n` pieces.
    pub(crate) fn all_gather(&mut self, pieces: &[Span], rank: usize, segment: usize) {
        let n = pieces.len();
        let at = |k: isize| (rank as isize + k).rem_euclid(n as isize) as usize;
        self.ring(
            pieces,
            (0..n - 1).map(|t| (at(-(t as isize)), at(-(t as isize) - 1), Recv::Copy)),
            segment,
        );
    }

    /// Pipelined broadcast along the ring from `root`: the root sends, every other rank
    /// receives and (unless its successor is the root) forwards each segment as it arrives.
    pub(crate) fn broadcast(
        &mut self,
        len: usize,
        n: usize,
        rank: usize,
        root: usize,
        segment: usize,
    ) {
        self.sends.clear();
        self.recvs.clear();
        let whole = Span { off: 0, len };
        let position = (rank + n - root) % n;
        if position == 0 {
            self.sends
                .extend(segments(whole, segment).map(|span| SendSeg { span, after: 0 }));
            return;
        }
        self.recvs
            .extend(segments(whole, segment).map(|span| RecvSeg {
                span,
                recv: Recv::Copy,
            }));
        if position + 1 < n {
            self.sends.extend(
                segments(whole, segment)
                    .enumerate()
                    .map(|(j, span)| SendSeg { span, after: j + 1 }),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Marks a value whose reduction a [`Recv::ReduceLast`] completed.
    const DONE: u32 = 1 << 31;

    /// Runs schedules of all ranks in lock step on in-memory buffers (sum over u32, with
    /// [`DONE`] set by the last reduction, which must meet unmarked values, as every
    /// reduction must) and returns every rank's buffer.
    fn simulate(
        n: usize,
        mut bufs: Vec<Vec<u32>>,
        build: impl Fn(&mut Schedule, usize),
    ) -> Vec<Vec<u32>> {
        let scheds: Vec<Schedule> = (0..n)
            .map(|r| {
                let mut s = Schedule::default();
                build(&mut s, r);
                s
            })
            .collect();
        // Each rank's receives are matched, in order, with its predecessor's sends.
        let mut sent = vec![0usize; n];
        let mut received = vec![0usize; n];
        loop {
            let mut progressed = false;
            for r in 0..n {
                let prev = (r + n - 1) % n;
                let (s, rs) = (&scheds[prev], &scheds[r]);
                if received[r] < rs.recvs.len()
                    && sent[prev] < s.sends.len()
                    && s.sends[sent[prev]].after <= received[prev]
                {
                    let (send, recv) = (s.sends[sent[prev]], rs.recvs[received[r]]);
                    assert_eq!(send.span.len, recv.span.len);
                    let data: Vec<u32> =
                        bufs[prev][send.span.off / 4..][..send.span.len / 4].to_vec();
                    for (d, v) in bufs[r][recv.span.off / 4..][..recv.span.len / 4]
                        .iter_mut()
                        .zip(data)
                    {
                        *d = match recv.recv {
                            Recv::Copy => v,
                            Recv::Reduce | Recv::ReduceLast => {
                                assert_eq!((*d | v) & DONE, 0, "rank {r} reduces a finished value");
                                let sum = *d + v;
                                if recv.recv == Recv::ReduceLast {
                                    sum | DONE
                                } else {
                                    sum
                                }
                            }
                        };
                    }
                    sent[prev] += 1;
                    received[r] += 1;
                    progressed = true;
                }
            }
            if !progressed {
                break;
            }
        }
        for r in 0..n {
            assert_eq!(
                sent[r],
                scheds[r].sends.len(),
                "rank {r} did not send everything"
            );
            assert_eq!(
                received[r],
                scheds[r].recvs.len(),
                "rank {r} did not receive everything"
            );
        }
        bufs
    }

    /// Every element's sum is completed once, on one rank, before it is forwarded: every
    /// rank ends with every sum marked [`DONE`].
    #[test]
    fn all_reduce_schedule_sums_for_every_world_and_size() {
        for n in 2..=5 {
            for elems in [1usize, 7, 64, 1001] {
                let bufs: Vec<Vec<u32>> = (0..n)
                    .map(|r| (0..elems).map(|i| (r * 1000 + i) as u32).collect())
                    .collect();
                let want: Vec<u32> = (0..elems)
                    .map(|i| (0..n).map(|r| (r * 1000 + i) as u32).sum::<u32>() | DONE)
                    .collect();
                let mut pieces = Vec::new();
                split_even(elems * 4, 4, n, &mut pieces);
                let out = simulate(n, bufs, |s, r| s.all_reduce(&pieces, r, 64));
                for (r, b) in out.iter().enumerate() {
                    assert_eq!(b, &want, "n={n} elems={elems} rank={r}");
                }
            }
        }
    }

    #[test]
    fn broadcast_and_all_gather_schedules_deliver_every_byte() {
        for n in 2..=5 {
            for root in 0..n {
                let bufs: Vec<Vec<u32>> = (0..n)
                    .map(|r| vec![if r == root { 9 } else { 0 }; 100])
                    .collect();
                let out = simulate(n, bufs, |s, r| s.broadcast(400, n, r, root, 48));
                assert!(
                    out.iter().all(|b| b.iter().all(|v| *v == 9)),
                    "n={n} root={root}"
                );
            }
            let mut pieces = Vec::new();
            split_even(n * 40, 4, n, &mut pieces);
            let bufs: Vec<Vec<u32>> = (0..n)
                .map(|r| {
                    (0..n * 10)
                        .map(|i| if i / 10 == r { i as u32 } else { 0 })
                        .collect()
                })
                .collect();
            let out = simulate(n, bufs, |s, r| s.all_gather(&pieces, r, 16));
            let want: Vec<u32> = (0..n * 10).map(|i| i as u32).collect();
            assert!(out.iter().all(|b| b == &want), "n={n}");
        }
    }

    #[test]
    fn the_ring_visits_each_host_in_a_row() {
        assert_eq!(host_order(&["a", "a", "a"]), [0, 1, 2]);
        assert_eq!(host_order(&["a", "b", "a", "b"]), [0, 2, 1, 3]);
        assert_eq!(host_order(&["b", "a", "b", "c", "a"]), [0, 2, 1, 4, 3]);
        assert_eq!(host_order(&["x"]), [0]);
    }

    #[test]
    fn schedules_over_a_permuted_ring_deliver_each_rank_its_pieces() {
        // The backend passes rank-indexed pieces in ring order; the gather must still put
        // rank r's contribution at rank r's offset on every rank.
        let order = host_order(&["a", "b", "a", "b", "c"]);
        let n = order.len();
        let mut by_rank = Vec::new();
        split_even(n * 40, 4, n, &mut by_rank);
        let by_position: Vec<Span> = order.iter().map(|&r| by_rank[r]).collect();
        let bufs: Vec<Vec<u32>> = order
            .iter()
            .map(|&r| {
                (0..n * 10)
                    .map(|i| if i / 10 == r { 1 + i as u32 } else { 0 })
                    .collect()
            })
            .collect();
        let out = simulate(n, bufs, |s, p| s.all_gather(&by_position, p, 16));
        let want: Vec<u32> = (0..n * 10).map(|i| 1 + i as u32).collect();
        assert!(out.iter().all(|b| b == &want), "{out:?}");
    }

    #[test]
    fn even_split_is_element_aligned_and_complete() {
        let mut out = Vec::new();
        split_even(7 * 8, 8, 3, &mut out);
        assert_eq!(
            out,
            vec![
                Span { off: 0, len: 24 },
                Span { off: 24, len: 16 },
                Span { off: 40, len: 16 }
            ]
        );
    }
}
