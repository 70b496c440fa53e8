//! Flat buckets: many tensors of one dtype and device laid end to end in one buffer, so that
//! one collective carries them all.

use tch::{Kind, Tensor};

/// One flat buffer and the tensors it carries.
#[derive(Debug)]
pub(crate) struct Bucket {
    /// The buffer: the members' elements end to end.
    pub(crate) flat: Tensor,
    /// (index into the owner's list, offset, numel) of each member, in bucket order.
    pub(crate) members: Vec<(usize, i64, i64)>,
}

impl Bucket {
    /// A zeroed buffer of `kind` on `device` for `named[members[..]]` (all of that dtype and
    /// device), laid end to end in `members`' order.
    pub(crate) fn new(
        named: &[(String, Tensor)],
        kind: Kind,
        device: tch::Device,
        members: Vec<usize>,
    ) -> Bucket {
        let mut offset = 0i64;
        let mut placed = Vec::with_capacity(members.len());
        for k in members {
            let numel = named[k].1.numel() as i64;
            placed.push((k, offset, numel));
            offset += numel;
        }
        Bucket {
            flat: Tensor::zeros([offset], (kind, device)),
            members: placed,
        }
    }

    /// The part of the buffer that holds member `offset..offset + numel`.
    pub(crate) fn slot(&self, offset: i64, numel: i64) -> Tensor {
        self.flat.narrow(0, offset, numel)
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.flat.numel() * self.flat.kind().elt_size_in_bytes()
    }
}

impl Drop for Bucket {
    /// The buffer is used on other streams than the one it was allocated on (the stream
    /// current when the buckets were made): autograd's, the collectives' side stream, and the
    /// stream of the thread that syncs the gradients, whose copies out of it may still be
    /// queued when a rebuild drops it. libtorch's caching allocator would hand its memory to
    /// the allocating stream's next allocation at once; recorded on the dropping thread's
    /// current stream, it waits for the work queued there so far, which comes after the other
    /// uses (that stream waited for the collectives, which waited for the hooks' copies). A
    /// no-op on the CPU.
    fn drop(&mut self) {
        if let Err(e) = tch_ext::record_current_stream(&self.flat) {
            tracing::warn!("ddp: a bucket's memory was released without its stream: {e}");
        }
    }
}

/// Groups `named[order[..]]` into flat buckets by dtype and device, in `order`, as PyTorch's
/// `_compute_bucket_assignment_by_size` with `[first_cap, cap]` does: each tensor joins its
/// dtype's open bucket, which closes once it holds `first_cap` bytes or more (the first of
/// its dtype) or `cap` (the others). So a bucket passes its cap by at most its last tensor;
/// a small first bucket starts communication early.
pub(crate) fn make_buckets(
    named: &[(String, Tensor)],
    order: &[usize],
    first_cap: usize,
    cap: usize,
) -> Vec<Bucket> {
    struct Open {
        kind: Kind,
        device: tch::Device,
        members: Vec<usize>,
        bytes: usize,
        closed_before: usize,
    }
    let mut open: Vec<Open> = Vec::new();
    let mut closed: Vec<(Kind, tch::Device, Vec<usize>)> = Vec::new();
    for &k in order {
        let t = &named[k].1;
        let (kind, device) = (t.kind(), t.device());
        let bytes = t.numel() * kind.elt_size_in_bytes();
        let slot = match open
            .iter()
            .position(|o| o.kind == kind && o.device == device)
        {
            Some(i) => i,
            None => {
                open.push(Open {
                    kind,
                    device,
                    members: Vec::new(),
                    bytes: 0,
                    closed_before: 0,
                });
                open.len() - 1
            }
        };
        let o = &mut open[slot];
        let limit = if o.closed_before == 0 { first_cap } else { cap };
        o.members.push(k);
        o.bytes += bytes;
        if o.bytes >= limit {
            closed.push((kind, device, std::mem::take(&mut o.members)));
            o.bytes = 0;
            o.closed_before += 1;
        }
    }
    closed.extend(
        open.into_iter()
            .filter(|o| !o.members.is_empty())
            .map(|o| (o.kind, o.device, o.members)),
    );
    closed
        .into_iter()
        .map(|(kind, device, members)| Bucket::new(named, kind, device, members))
        .collect()
}

/// Copies each member of `named` into its place in its bucket.
pub(crate) fn pack(named: &[(String, Tensor)], buckets: &[Bucket]) {
    for bucket in buckets {
        for &(k, offset, numel) in &bucket.members {
            bucket.slot(offset, numel).copy_(&named[k].1.reshape([-1]));
        }
    }
}

/// Copies each bucket's parts back into the members of `named`.
pub(crate) fn unpack(named: &[(String, Tensor)], buckets: &[Bucket]) {
    for bucket in buckets {
        for &(k, offset, numel) in &bucket.members {
            let mut t = named[k].1.shallow_clone();
            t.copy_(&bucket.slot(offset, numel).view_as(&t));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(sizes: &[i64]) -> Vec<(String, Tensor)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                (
                    format!("p{i}"),
                    Tensor::zeros([n], (Kind::Float, tch::Device::Cpu)),
                )
            })
            .collect()
    }

    /// The layouts torch 2.13's `dist._compute_bucket_assignment_by_size` gives for float
    /// tensors of 10, 20, 30 and 5 elements taken in the order 3, 2, 1, 0.
    #[test]
    fn buckets_are_assigned_as_pytorch_assigns_them() {
        let named = named(&[10, 20, 30, 5]);
        let order = [3, 2, 1, 0];
        let layout = |first_cap, cap| -> Vec<Vec<usize>> {
            make_buckets(&named, &order, first_cap, cap)
                .iter()
                .map(|b| b.members.iter().map(|m| m.0).collect())
                .collect()
        };
        // [160]: p3 + p2 + p1 = 55 floats, 220 bytes >= 160, closes; p0 alone.
        let buckets = make_buckets(&named, &order, 160, 160);
        assert_eq!(
            buckets
                .iter()
                .map(|b| b.members.clone())
                .collect::<Vec<_>>(),
            vec![vec![(3, 0, 5), (2, 5, 30), (1, 35, 20)], vec![(0, 0, 10)]]
        );
        assert_eq!((buckets[0].flat.numel(), buckets[1].bytes()), (55, 40));
        // [8]: every tensor passes the cap alone.
        assert_eq!(layout(8, 8), vec![vec![3], vec![2], vec![1], vec![0]]);
        // [24, 160]: p3 (20 bytes) stays open, + p2 passes 24; then p1 + p0 reach 160.
        assert_eq!(layout(24, 160), vec![vec![3, 2], vec![1, 0]]);
    }

    #[test]
    fn pack_and_unpack_are_inverse() {
        let named = named(&[3, 2]);
        named[0]
            .1
            .shallow_clone()
            .copy_(&Tensor::from_slice(&[1f32, 2., 3.]));
        named[1]
            .1
            .shallow_clone()
            .copy_(&Tensor::from_slice(&[4f32, 5.]));
        let buckets = make_buckets(&named, &[1, 0], usize::MAX, usize::MAX);
        pack(&named, &buckets);
        assert_eq!(
            Vec::<f32>::try_from(&buckets[0].flat).unwrap(),
            [4., 5., 1., 2., 3.]
        );
        let _ = buckets[0].flat.shallow_clone().g_mul_scalar_(2.0);
        unpack(&named, &buckets);
        assert_eq!(Vec::<f32>::try_from(&named[0].1).unwrap(), [2., 4., 6.]);
        assert_eq!(Vec::<f32>::try_from(&named[1].1).unwrap(), [8., 10.]);
    }

    /// Buckets made with stream A current (as at DDP's construction), read on stream B behind
    /// half a second of work (`unpack`'s copies, as the syncing thread's stream reads them),
    /// then dropped with B current, as a rebuild drops the old ones. A tensor of the bucket's
    /// size allocated on A next and filled at once (A is idle) must not get its memory:
    /// without the bucket's record on the dropping thread's stream, libtorch's caching
    /// allocator hands the block straight back on A and B's copies read the fill.
    #[test]
    fn a_dropped_bucket_keeps_its_memory_until_the_dropping_stream_has_read_it() {
        use super::super::comm_hook::gpu_tests::{gpu, keep_busy, settle, two_streams};
        use tch_ext::{set_current_stream, CudaEvent};
        if !gpu() {
            return;
        }
        let device = tch::Device::Cuda(0);
        let (a, b) = two_streams();
        // An odd size, so that no other free block fits it exactly.
        let len = 1_000_003;
        let named = vec![("p".to_string(), Tensor::zeros([len], (Kind::Float, device)))];
        let on_a = set_current_stream(a).unwrap();
        let buckets = make_buckets(&named, &[0], usize::MAX, usize::MAX);
        let _ = buckets[0].flat.shallow_clone().fill_(3.0);
        let filled = CudaEvent::new(0).unwrap();
        filled.record(&a).unwrap();
        drop(on_a);
        let on_b = set_current_stream(b).unwrap();
        b.wait_event(&filled).unwrap();
        keep_busy(0.5);
        unpack(&named, &buckets);
        let b_done = CudaEvent::new(0).unwrap();
        b_done.record(&b).unwrap();
        drop(buckets);
        drop(on_b);
        let on_a = set_current_stream(a).unwrap();
        let intruder = Tensor::full([len], 99.0, (Kind::Float, device));
        drop(on_a);
        settle(&b_done, &a, &b, &intruder);
        let p = &named[0].1;
        assert_eq!(
            (p.min().double_value(&[]), p.max().double_value(&[])),
            (3.0, 3.0),
            "the copies out of the bucket read memory that stream A reused"
        );
    }
}
