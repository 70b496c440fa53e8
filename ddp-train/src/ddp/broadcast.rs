//! Broadcasts of rank 0's tensors: the first one of a model's states, in buckets of bounded
//! size, and those of the buffers before each training step.

use std::sync::Arc;

use ddp_comm::ProcessGroup;
use tch::{Device, Kind, Tensor};

use super::bucket::{pack, unpack, Bucket};
use super::DdpError;

/// The most bytes one bucket of the first broadcast holds, unless a single tensor is larger:
/// PyTorch's `broadcast_bucket_size` (250 MiB), which its `_sync_module_states` hands to
/// `_broadcast_coalesced`.
pub(super) const BROADCAST_BUCKET_BYTES: usize = 250 * 1024 * 1024;

/// Broadcasts rank 0's values of every tensor of `named` to every rank, in buckets of at
/// most `cap` bytes (a larger tensor alone), one at a time: each bucket's buffer is freed
/// before the next is allocated, so the broadcast needs at most one bucket of memory beyond
/// the model (one flat buffer of everything would double it). On CUDA the host waits for
/// each bucket (it would otherwise queue every bucket at once, each kept alive until its
/// collective completes); this runs once, at construction.
pub(super) fn sync_module_states(
    pg: &Arc<ProcessGroup>,
    named: &[(String, Tensor)],
    cap: usize,
) -> Result<(), DdpError> {
    for (kind, device, members) in capped_groups(named, cap) {
        let bucket = Bucket::new(named, kind, device, members);
        broadcast_tensors(pg, named, std::slice::from_ref(&bucket), Wait::Host)?;
    }
    Ok(())
}

/// Groups `named`'s tensors, in order, by dtype and device into buckets of at most `cap`
/// bytes: a tensor that would take its dtype's open bucket past `cap` closes it and opens
/// the next, so only a tensor larger than `cap` makes a bucket larger (holding it alone).
/// Buckets in the order they close, then the open ones by their first tensor.
fn capped_groups(named: &[(String, Tensor)], cap: usize) -> Vec<(Kind, Device, Vec<usize>)> {
    let mut open: Vec<(Kind, Device, Vec<usize>, usize)> = Vec::new();
    let mut closed = Vec::new();
    for (k, (_, t)) in named.iter().enumerate() {
        let (kind, device) = (t.kind(), t.device());
        let bytes = t.numel() * kind.elt_size_in_bytes();
        let slot = match open.iter().position(|o| (o.0, o.1) == (kind, device)) {
            Some(i) => i,
            None => {
                open.push((kind, device, Vec::new(), 0));
                open.len() - 1
            }
        };
        let o = &mut open[slot];
        if !o.2.is_empty() && o.3.saturating_add(bytes) > cap {
            closed.push((kind, device, std::mem::take(&mut o.2)));
            o.3 = 0;
        }
        o.2.push(k);
        o.3 += bytes;
    }
    closed.extend(
        open.into_iter()
            .filter(|o| !o.2.is_empty())
            .map(|(kind, device, members, _)| (kind, device, members)),
    );
    closed
}

/// What the caller waits for after a CUDA bucket's broadcast.
#[derive(Clone, Copy)]
pub(super) enum Wait {
    /// The current stream waits, not the host: the forward that follows is queued at once
    /// (as PyTorch's DDP does).
    Stream,
    /// The host waits for the device to finish it.
    Host,
}

/// Broadcasts rank 0's values of `named`, laid out in `buckets`, into every rank's tensors.
pub(super) fn broadcast_tensors(
    pg: &Arc<ProcessGroup>,
    named: &[(String, Tensor)],
    buckets: &[Bucket],
    wait: Wait,
) -> Result<(), DdpError> {
    if pg.rank() == 0 {
        pack(named, buckets);
    }
    for bucket in buckets {
        if bucket.flat.device().is_cuda() {
            let work = pg.broadcast_async(&bucket.flat, 0);
            match wait {
                Wait::Stream => work.wait_stream()?,
                Wait::Host => work.wait()?,
            }
        } else {
            pg.broadcast(&mut bucket.flat.shallow_clone(), 0)?;
        }
    }
    if pg.rank() != 0 {
        unpack(named, buckets);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::tests::on_ranks;
    use super::super::{DdpOptions, DistributedDataParallel};
    use super::*;
    use tch::nn::{Init, VarStore};

    /// Tensors of 12, 20, 48, 8 and 8 bytes (float), 16 and 24 (double), interleaved, with a
    /// cap of 40 bytes: each bucket stays within the cap but for the 48-byte tensor, alone.
    #[test]
    fn the_first_broadcast_s_buckets_stay_within_the_cap() {
        let t = |n: i64, kind| Tensor::zeros([n], (kind, Device::Cpu));
        let named: Vec<(String, Tensor)> = [
            t(3, Kind::Float),
            t(2, Kind::Double),
            t(5, Kind::Float),
            t(12, Kind::Float),
            t(3, Kind::Double),
            t(2, Kind::Float),
            t(2, Kind::Float),
        ]
        .into_iter()
        .enumerate()
        .map(|(i, t)| (format!("t{i}"), t))
        .collect();
        let cap = 40;
        let groups = capped_groups(&named, cap);
        let members: Vec<(Kind, Vec<usize>)> =
            groups.iter().map(|(k, _, m)| (*k, m.clone())).collect();
        assert_eq!(
            members,
            [
                (Kind::Float, vec![0, 2]),
                (Kind::Float, vec![3]),
                (Kind::Float, vec![5, 6]),
                (Kind::Double, vec![1, 4]),
            ]
        );
        let bytes = |k: usize| named[k].1.numel() * named[k].1.kind().elt_size_in_bytes();
        let largest = (0..named.len()).map(bytes).max().unwrap_or(0);
        for (_, _, m) in &groups {
            assert!(m.iter().map(|&k| bytes(k)).sum::<usize>() <= cap.max(largest));
        }
        // Without a cap, one bucket per dtype, as the buffers' broadcast lays them out.
        let whole: Vec<Vec<usize>> = capped_groups(&named, usize::MAX)
            .into_iter()
            .map(|g| g.2)
            .collect();
        assert_eq!(whole, [vec![0, 2, 3, 5, 6], vec![1, 4]]);
    }

    /// Two ranks that initialised their parameters (float and double), a frozen parameter and
    /// buffers (float and int64) differently hold rank 0's values after a construction whose first broadcast
    /// goes in buckets of at most 8 bytes (one tensor each, but for two 1-element ones).
    #[test]
    fn a_construction_with_small_buckets_gives_every_rank_rank_0_s_values() {
        let values = on_ranks(2, |rank, pg| {
            let vs = VarStore::new(Device::Cpu);
            let root = vs.root();
            let c = 1.0 + rank as f64;
            let _ = root.var("a", &[3], Init::Const(c));
            let _ = root.var("b", &[1], Init::Const(2.0 * c));
            let _ = root.var("c", &[1], Init::Const(3.0 * c));
            let frozen = root.var("frozen", &[2, 2], Init::Const(4.0 * c));
            let _ = frozen.set_requires_grad(false);
            let _ = root.var_copy("mean", &Tensor::from_slice(&[5.0 * c, 6.0 * c]));
            let count = Tensor::from_slice(&[7 * (rank as i64 + 1); 2]);
            let _ = root.sub("bn").add("count", count, false);
            let _ = root.zeros_no_train("running", &[3]).fill_(8.0 * c);
            let ddp = DistributedDataParallel::unhooked(&vs, pg, DdpOptions::default(), &[], 8)
                .map_err(|e| e.to_string())?;
            drop(ddp);
            let mut all: Vec<(String, Vec<f64>)> = vs
                .variables()
                .into_iter()
                .map(|(n, t)| {
                    let flat = t.to_kind(Kind::Double).reshape([-1]);
                    (n, Vec::<f64>::try_from(&flat).unwrap())
                })
                .collect();
            all.sort_by(|a, b| a.0.cmp(&b.0));
            Ok::<_, String>(all)
        });
        let want: Vec<(String, Vec<f64>)> = [
            ("a", vec![1.0; 3]),
            ("b", vec![2.0]),
            ("bn.count", vec![7.0; 2]),
            ("c", vec![3.0]),
            ("frozen", vec![4.0; 4]),
            ("mean", vec![5.0, 6.0]),
            ("running", vec![8.0; 3]),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_string(), v))
        .collect();
        assert_eq!(values, [Ok(want.clone()), Ok(want)]);
    }
}
