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
    /// The part of the buffer that holds member `offset..offset + numel`.
    pub(crate) fn slot(&self, offset: i64, numel: i64) -> Tensor {
        self.flat.narrow(0, offset, numel)
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.flat.numel() * self.flat.kind().elt_size_in_bytes()
    }
}

/// Groups `named[order[..]]` into flat buckets by dtype and device, in `order`: the first
/// bucket of each dtype holds at most `first_cap` bytes, the others at most `cap` (a single
/// larger tensor gets a bucket of its own). PyTorch's `_compute_bucket_assignment_by_size`
/// with `[first_bucket_bytes, bucket_cap]`: a small first bucket starts communication early.
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
        if !o.members.is_empty() && o.bytes + bytes > limit {
            closed.push((kind, device, std::mem::take(&mut o.members)));
            o.bytes = 0;
            o.closed_before += 1;
        }
        o.members.push(k);
        o.bytes += bytes;
    }
    closed.extend(
        open.into_iter()
            .filter(|o| !o.members.is_empty())
            .map(|o| (o.kind, o.device, o.members)),
    );
    closed
        .into_iter()
        .map(|(kind, device, members)| {
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
        })
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

    #[test]
    fn buckets_respect_the_caps_and_the_order() {
        let named = named(&[10, 20, 30, 5]);
        let order = [3, 2, 1, 0];
        // Caps of 40 floats: [p3, p2] = 35 (+20 > 40), then [p1, p0] = 30.
        let buckets = make_buckets(&named, &order, 40 * 4, 40 * 4);
        let layout: Vec<Vec<(usize, i64, i64)>> =
            buckets.iter().map(|b| b.members.clone()).collect();
        assert_eq!(
            layout,
            vec![vec![(3, 0, 5), (2, 5, 30)], vec![(1, 0, 20), (0, 20, 10)]]
        );
        assert_eq!(buckets[0].flat.numel(), 35);
        assert_eq!(buckets[1].bytes(), 120);
        // A tensor larger than the cap gets a bucket of its own.
        assert_eq!(make_buckets(&named, &order, 8, 8).len(), 4);
        // A small first bucket: [p3] (5 floats fit in 6, +30 does not), then [p2], [p1, p0].
        let layout: Vec<Vec<usize>> = make_buckets(&named, &order, 6 * 4, 40 * 4)
            .iter()
            .map(|b| b.members.iter().map(|m| m.0).collect())
            .collect();
        assert_eq!(layout, vec![vec![3], vec![2], vec![1, 0]]);
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
}
