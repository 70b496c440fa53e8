//! Collectives on CPU tensors and slices with real processes on loopback, over shared memory
//! (the default between ranks on one host) and over TCP (`DDP_TRANSPORT=tcp`), and over a
//! ring that mixes both (ranks told they sit on different hosts): every rank asserts the
//! exact values it ends with, and the transport that carried them.

mod common;

use common::{rank_world, run_world, worker};
use ddp_comm::{Backend, LinkKind, ProcessGroup, ReduceOp};
use tch::Tensor;

const SIZES: [usize; 4] = [0, 1, 7, 1_000_003];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

trait TestElem: tch::kind::Element + ddp_comm::Element + std::fmt::Debug {
    const SIGNED: bool;
    const FLOAT: bool;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! test_elem {
    ($($t:ty: $signed:expr, $float:expr;)*) => {$(
        impl TestElem for $t {
            const SIGNED: bool = $signed;
            const FLOAT: bool = $float;
            fn from_f64(v: f64) -> Self { v as $t }
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
test_elem! { f32: true, true; f64: true, true; i32: true, false; i64: true, false; u8: false, false; }

/// Rank `r`'s value at index `i`: small integers, exact in every dtype even when summed
/// over five ranks, periodic in `i` with period 11.
fn value<T: TestElem>(r: usize, i: usize) -> f64 {
    let base = ((r * 31 + i * 7) % 11 + r) as f64;
    let v = if T::SIGNED { base - 5.0 } else { base };
    if T::FLOAT {
        v + 0.25
    } else {
        v
    }
}

fn expected<T: TestElem>(op: ReduceOp, n: usize, i: usize) -> f64 {
    let vals = (0..n).map(|r| value::<T>(r, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Avg => {
            let sum: f64 = vals.sum();
            if T::FLOAT {
                sum / n as f64
            } else {
                (sum / n as f64).trunc()
            }
        }
        ReduceOp::Max => vals.fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.fold(f64::MAX, f64::min),
    }
}

fn check_all_reduce<T: TestElem>(group: &ProcessGroup) {
    let (rank, n) = (group.rank(), group.world_size());
    for size in SIZES {
        let mine: Vec<T> = (0..size)
            .map(|i| T::from_f64(value::<T>(rank, i)))
            .collect();
        for op in OPS {
            // `value` has period 11 in `i`, so 11 expected values cover every element.
            let table: Vec<f64> = (0..11).map(|i| expected::<T>(op, n, i)).collect();
            let mut t = Tensor::from_slice(&mine);
            group.all_reduce(&mut t, op).unwrap();
            assert_eq!(t.size(), [size as i64]);
            let got: Vec<T> = Vec::try_from(&t).unwrap();
            for (i, g) in got.iter().enumerate() {
                let want = table[i % 11];
                let ok = if T::FLOAT {
                    (g.to_f64() - want).abs() <= 1e-6 * want.abs().max(1.0)
                } else {
                    g.to_f64() == want
                };
                assert!(ok, "{} {op:?} size {size} world {n} rank {rank}: element {i} is {g:?}, expected {want}", std::any::type_name::<T>());
            }
        }
    }
}

/// Joins the group and checks that its links are the ones the test asked for: TCP with
/// `DDP_TRANSPORT=tcp`, shared memory otherwise (all ranks on this host).
fn join() -> ProcessGroup {
    let group = ProcessGroup::from_env().unwrap();
    let layout = group.ring_layout();
    let (rank, n) = rank_world();
    if n == 1 {
        assert_eq!((layout.to_next, layout.from_prev), (None, None));
        return group;
    }
    let want = match std::env::var("DDP_TRANSPORT").as_deref() {
        Ok("tcp") => LinkKind::Tcp,
        _ => LinkKind::SharedMemory,
    };
    assert_eq!(layout.order, (0..n).collect::<Vec<_>>());
    assert_eq!(
        (layout.next, layout.prev),
        ((rank + 1) % n, (rank + n - 1) % n)
    );
    assert_eq!(
        (layout.to_next, layout.from_prev),
        (Some(want), Some(want)),
        "rank {rank}"
    );
    group
}

fn all_reduce_body() {
    let group = join();
    assert_eq!(group.backend(), Backend::Cpu);
    assert_eq!((group.rank(), group.world_size()), rank_world());
    check_all_reduce::<f32>(&group);
    check_all_reduce::<f64>(&group);
    check_all_reduce::<i32>(&group);
    check_all_reduce::<i64>(&group);
    check_all_reduce::<u8>(&group);
    let (rank, n) = rank_world();
    // Bools travel as bytes: Sum and Max say whether any rank is true, Min whether every
    // rank is; Avg is refused on every rank before the ranks meet.
    let mine = [rank == 0, true, false, rank % 2 == 1];
    for (op, want) in [
        (ReduceOp::Sum, [true, true, false, n > 1]),
        (ReduceOp::Max, [true, true, false, n > 1]),
        (ReduceOp::Min, [n == 1, true, false, false]),
    ] {
        let mut t = Tensor::from_slice(&mine);
        group.all_reduce(&mut t, op).unwrap();
        assert_eq!(t.kind(), tch::Kind::Bool);
        assert_eq!(Vec::<bool>::try_from(&t).unwrap(), want, "{op:?}");
    }
    let mut t = Tensor::from_slice(&mine);
    match group.all_reduce(&mut t, ReduceOp::Avg) {
        Err(ddp_comm::CommError::InvalidArgument(why)) => assert!(why.contains("bool"), "{why}"),
        other => panic!("Avg of bools: {other:?}"),
    }
    let mut t = Tensor::from_slice(&mine);
    group.broadcast(&mut t, n - 1).unwrap();
    assert_eq!(
        Vec::<bool>::try_from(&t).unwrap(),
        [n == 1, true, false, (n - 1) % 2 == 1]
    );
    // The slice API gives the same results without tensors.
    let mut v: Vec<i64> = (0..1000).map(|i| (rank * i) as i64).collect();
    group.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
    let tri = (n * (n - 1) / 2) as i64;
    assert!(
        v.iter().enumerate().all(|(i, x)| *x == tri * i as i64),
        "slice sum"
    );
    println!("rank {rank}: all_reduce ok");
}

macro_rules! world_tests {
    ($($name:ident: $n:expr, $body:ident, $transport:expr;)*) => {$(
        #[test]
        fn $name() {
            if worker() {
                return $body();
            }
            let outputs = run_world(stringify!($name), $n, &[("DDP_TRANSPORT", $transport.to_string())]);
            for (rank, out) in outputs.iter().enumerate() {
                assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("rank {rank}: ")), "rank {rank} did not report");
            }
        }
    )*};
}

/// Asynchronous collectives: issued back to back, mixed with blocking ones, they run in the
/// order issued on every rank and give the blocking results; half types reduce in `f32`
/// steps rounded to the type.
fn async_body() {
    let group = std::sync::Arc::new(join());
    let (rank, n) = rank_world();
    let sizes = [1usize, 7, 1000, 250_001];
    let tensors: Vec<Tensor> = sizes
        .iter()
        .map(|&size| {
            let v: Vec<f32> = (0..size).map(|i| value::<f32>(rank, i) as f32).collect();
            Tensor::from_slice(&v)
        })
        .collect();
    let mut works: Vec<_> = tensors
        .iter()
        .map(|t| group.all_reduce_async(t, ReduceOp::Sum))
        .collect();
    // A blocking collective issued now waits for the queued ones, keeping its place.
    let mut blocking = Tensor::from_slice(&[rank as i64 + 1]);
    group.all_reduce(&mut blocking, ReduceOp::Max).unwrap();
    assert_eq!(i64::try_from(&blocking).unwrap(), n as i64);
    assert!(works.iter().all(|w| w.is_completed()));
    let root_data = Tensor::from_slice(&[rank as f64; 5]);
    works.push(group.broadcast_async(&root_data, n - 1));
    let avg = Tensor::from_slice(&[rank as f32 * 2.0; 3]);
    works.push(group.all_reduce_async(&avg, ReduceOp::Avg));
    for w in works {
        w.wait().unwrap();
    }
    for (t, &size) in tensors.iter().zip(&sizes) {
        let got: Vec<f32> = Vec::try_from(t).unwrap();
        for (i, g) in got.iter().enumerate() {
            let want = expected::<f32>(ReduceOp::Sum, n, i) as f32;
            assert!(
                (g - want).abs() <= 1e-4,
                "size {size} element {i}: {g} vs {want}"
            );
        }
    }
    assert_eq!(
        Vec::<f64>::try_from(&root_data).unwrap(),
        [(n - 1) as f64; 5]
    );
    let mean = (0..n).map(|r| r as f32 * 2.0).sum::<f32>() / n as f32;
    assert_eq!(Vec::<f32>::try_from(&avg).unwrap(), [mean; 3]);
    // bf16 and f16: 1.5 + rank / 4 per rank sums exactly in both types.
    for kind in [tch::Kind::BFloat16, tch::Kind::Half] {
        let mut t = Tensor::full([9], 1.5 + rank as f64 / 4.0, (kind, tch::Device::Cpu));
        group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        let want = (0..n).map(|r| 1.5 + r as f64 / 4.0).sum::<f64>();
        let got: Vec<f64> = Vec::try_from(&t.to_kind(tch::Kind::Double)).unwrap();
        assert_eq!(got, [want; 9], "{kind:?}");
    }
    println!("rank {rank}: async ok");
}

/// Where rank `r` of a tensor of `size` elements holds a NaN: rank 0 at 0 and rank 1 at 1 in
/// two elements (the latency path, where rank 0's buffer is the destination); in a larger
/// tensor (the bandwidth path) each rank in the first piece and in the last one, which are
/// reduced into different ranks' bytes.
fn nan_at(r: usize, size: usize) -> Vec<usize> {
    match size {
        2 => (r < 2).then_some(r).into_iter().collect(),
        _ => vec![r, size - 1 - 2 * r],
    }
}

/// `Max` and `Min` keep a NaN wherever any rank holds one, in every float type, on either
/// path, and give the exact maximum or minimum elsewhere (as `torch.maximum`).
fn nan_body() {
    let group = join();
    let (rank, n) = rank_world();
    let finite = |r: usize, i: usize| ((i * 7 + r * 31) % 11) as f64 - 5.0;
    for kind in [
        tch::Kind::Float,
        tch::Kind::Double,
        tch::Kind::Half,
        tch::Kind::BFloat16,
    ] {
        for size in [2usize, 1_000_003] {
            let mut mine: Vec<f64> = (0..size).map(|i| finite(rank, i)).collect();
            for i in nan_at(rank, size) {
                mine[i] = f64::NAN;
            }
            let nans: Vec<usize> = (0..n).flat_map(|r| nan_at(r, size)).collect();
            for op in [ReduceOp::Max, ReduceOp::Min] {
                let mut t = Tensor::from_slice(&mine).to_kind(kind);
                group.all_reduce(&mut t, op).unwrap();
                let got = Vec::<f64>::try_from(&t.to_kind(tch::Kind::Double)).unwrap();
                for (i, g) in got.iter().enumerate() {
                    let ranks = (0..n).map(|r| finite(r, i));
                    let ok = if nans.contains(&i) {
                        g.is_nan()
                    } else if op == ReduceOp::Max {
                        *g == ranks.fold(f64::MIN, f64::max)
                    } else {
                        *g == ranks.fold(f64::MAX, f64::min)
                    };
                    assert!(
                        ok,
                        "{kind:?} {op:?} size {size} rank {rank}: element {i} is {g}"
                    );
                }
            }
        }
    }
    println!("rank {rank}: nan ok");
}

world_tests! {
    async_collectives_world_1: 1, async_body, "auto";
    async_collectives_world_3_shm: 3, async_body, "auto";
    async_collectives_world_2_tcp: 2, async_body, "tcp";
    all_reduce_world_1: 1, all_reduce_body, "auto";
    all_reduce_world_2_shm: 2, all_reduce_body, "auto";
    all_reduce_world_3_shm: 3, all_reduce_body, "auto";
    all_reduce_world_4_shm: 4, all_reduce_body, "auto";
    all_reduce_world_5_shm: 5, all_reduce_body, "auto";
    all_reduce_world_2_tcp: 2, all_reduce_body, "tcp";
    all_reduce_world_3_tcp: 3, all_reduce_body, "tcp";
    all_reduce_world_4_tcp: 4, all_reduce_body, "tcp";
    all_reduce_world_5_tcp: 5, all_reduce_body, "tcp";
    broadcast_world_1: 1, broadcast_body, "auto";
    broadcast_world_2_shm: 2, broadcast_body, "auto";
    broadcast_world_3_shm: 3, broadcast_body, "auto";
    broadcast_world_4_shm: 4, broadcast_body, "auto";
    broadcast_world_5_shm: 5, broadcast_body, "auto";
    broadcast_world_2_tcp: 2, broadcast_body, "tcp";
    broadcast_world_3_tcp: 3, broadcast_body, "tcp";
    broadcast_world_4_tcp: 4, broadcast_body, "tcp";
    broadcast_world_5_tcp: 5, broadcast_body, "tcp";
    all_gather_world_1: 1, all_gather_body, "auto";
    all_gather_world_2_shm: 2, all_gather_body, "auto";
    all_gather_world_3_shm: 3, all_gather_body, "auto";
    all_gather_world_4_shm: 4, all_gather_body, "auto";
    all_gather_world_5_shm: 5, all_gather_body, "auto";
    all_gather_world_2_tcp: 2, all_gather_body, "tcp";
    all_gather_world_3_tcp: 3, all_gather_body, "tcp";
    all_gather_world_4_tcp: 4, all_gather_body, "tcp";
    all_gather_world_5_tcp: 5, all_gather_body, "tcp";
    all_reduce_64_mib_world_2_shm: 2, big_body, "auto";
    all_reduce_64_mib_world_3_tcp: 3, big_body, "tcp";
    barrier_waits_for_the_slowest_rank_shm: 3, barrier_body, "auto";
    barrier_waits_for_the_slowest_rank_tcp: 3, barrier_body, "tcp";
    max_and_min_keep_nan_world_2_shm: 2, nan_body, "auto";
    max_and_min_keep_nan_world_3_tcp: 3, nan_body, "tcp";
    avg_is_sum_divided_or_sum_of_divided_world_2_shm: 2, avg_body, "auto";
    avg_is_sum_divided_or_sum_of_divided_world_3_shm: 3, avg_body, "auto";
    avg_is_sum_divided_or_sum_of_divided_world_5_shm: 5, avg_body, "auto";
    avg_is_sum_divided_or_sum_of_divided_world_2_tcp: 2, avg_body, "tcp";
    avg_is_sum_divided_or_sum_of_divided_world_3_tcp: 3, avg_body, "tcp";
    avg_is_sum_divided_or_sum_of_divided_world_5_tcp: 5, avg_body, "tcp";
}

fn check_broadcast<T: TestElem>(group: &ProcessGroup, sizes: &[usize]) {
    let (rank, n) = (group.rank(), group.world_size());
    for &size in sizes {
        for root in 0..n {
            let data: Vec<T> = (0..size)
                .map(|i| {
                    T::from_f64(if rank == root {
                        value::<T>(root, i)
                    } else {
                        0.0
                    })
                })
                .collect();
            let mut t = Tensor::from_slice(&data);
            group.broadcast(&mut t, root).unwrap();
            let got: Vec<T> = Vec::try_from(&t).unwrap();
            for (i, g) in got.iter().enumerate() {
                assert_eq!(
                    g.to_f64(),
                    value::<T>(root, i),
                    "broadcast size {size} root {root} rank {rank} element {i}"
                );
            }
        }
    }
}

fn broadcast_body() {
    let group = join();
    check_broadcast::<f32>(&group, &SIZES);
    check_broadcast::<f64>(&group, &SIZES[..3]);
    check_broadcast::<i32>(&group, &SIZES[..3]);
    check_broadcast::<i64>(&group, &SIZES);
    check_broadcast::<u8>(&group, &SIZES[..3]);
    // Slices, and a root out of range is an error, not a hang.
    let (rank, n) = rank_world();
    let mut v = vec![rank as u8; 5];
    group.broadcast_slice(&mut v, n - 1).unwrap();
    assert_eq!(v, vec![(n - 1) as u8; 5]);
    let err = group.broadcast_slice(&mut v, n).unwrap_err();
    assert!(
        matches!(err, ddp_comm::CommError::RankOutOfRange { rank: r, .. } if r == n),
        "{err}"
    );
    println!("rank {rank}: broadcast ok");
}

fn all_gather_body() {
    let group = join();
    let (rank, n) = rank_world();
    let t = Tensor::from_slice(&[rank as f32 * 10.0, 1.0, 2.0, 3.0, 4.0, 5.0]).reshape([2, 3]);
    let parts = group.all_gather(&t).unwrap();
    assert_eq!(parts.len(), n);
    for (r, p) in parts.iter().enumerate() {
        assert_eq!(p.size(), [2, 3]);
        let got: Vec<f32> = Vec::try_from(&p.flatten(0, -1)).unwrap();
        assert_eq!(
            got,
            vec![r as f32 * 10.0, 1.0, 2.0, 3.0, 4.0, 5.0],
            "rank {rank} gathered from {r}"
        );
    }
    let scalar = Tensor::from(rank as i64 * 3);
    let parts = group.all_gather(&scalar).unwrap();
    let got: Vec<i64> = parts.iter().map(|p| p.int64_value(&[])).collect();
    assert_eq!(got, (0..n as i64).map(|r| r * 3).collect::<Vec<_>>());
    // Into a reused output of any shape; a wrong size is refused before the ranks meet.
    let mut out = Tensor::full(
        [3, n as i64 * 2],
        -1.0,
        (tch::Kind::Float, tch::Device::Cpu),
    );
    let mine = Tensor::from_slice(&[rank as f32, 0.5, 1.5, 2.5, 3.5, 4.5]);
    group.all_gather_into(&mine, &mut out).unwrap();
    let got: Vec<f32> = Vec::try_from(&out.flatten(0, -1)).unwrap();
    let want: Vec<f32> = (0..n)
        .flat_map(|r| [r as f32, 0.5, 1.5, 2.5, 3.5, 4.5])
        .collect();
    assert_eq!(got, want, "rank {rank}: all_gather_into");
    let mut short = Tensor::zeros([n as i64 * 6 - 1], (tch::Kind::Float, tch::Device::Cpu));
    let err = group.all_gather_into(&mine, &mut short).unwrap_err();
    assert!(
        matches!(err, ddp_comm::CommError::InvalidArgument(_)),
        "{err:?}"
    );
    // In place, as PyTorch's `all_gather_into_tensor(out, out.narrow(0, rank * n, n))`.
    let f32_cpu = (tch::Kind::Float, tch::Device::Cpu);
    let mut out = Tensor::full([n as i64 * 3], -1.0, f32_cpu);
    let mut chunk = out.narrow(0, rank as i64 * 3, 3);
    chunk.copy_(&Tensor::from_slice(&[rank as f32, 7.0, 8.0]));
    group.all_gather_into(&chunk, &mut out).unwrap();
    let got: Vec<f32> = Vec::try_from(&out).unwrap();
    let want: Vec<f32> = (0..n).flat_map(|r| [r as f32, 7.0, 8.0]).collect();
    assert_eq!(got, want, "rank {rank}: all_gather_into in place");
    // The output's first chunk as every rank's input: in place on rank 0, overlapping the
    // output elsewhere on the others, which gather from a copy; every rank meets alike.
    let mut out = Tensor::full([n as i64 * 3], -1.0, f32_cpu);
    let mut first = out.narrow(0, 0, 3);
    first.copy_(&Tensor::from_slice(&[rank as f32, 2.0, 3.0]));
    group.all_gather_into(&first, &mut out).unwrap();
    let got: Vec<f32> = Vec::try_from(&out).unwrap();
    let want: Vec<f32> = (0..n).flat_map(|r| [r as f32, 2.0, 3.0]).collect();
    assert_eq!(
        got, want,
        "rank {rank}: all_gather_into from the first chunk"
    );
    // An input that overlaps the output at no rank's place is gathered from its values at
    // the call, on every rank.
    let base = Tensor::zeros([n as i64 * 3 + 1], f32_cpu);
    let mut out = base.narrow(0, 0, n as i64 * 3);
    let mut input = base.narrow(0, 1, 3);
    input.copy_(&Tensor::from_slice(&[rank as f32, 0.25, 0.75]));
    group.all_gather_into(&input, &mut out).unwrap();
    let got: Vec<f32> = Vec::try_from(&out).unwrap();
    let want: Vec<f32> = (0..n).flat_map(|r| [r as f32, 0.25, 0.75]).collect();
    assert_eq!(
        got, want,
        "rank {rank}: all_gather_into from an overlapping input"
    );
    // Byte strings of different lengths, including empty and large ones.
    for scale in [1usize, 40_000] {
        let mine = vec![rank as u8 + 1; rank * 3 * scale];
        let all = group.all_gather_bytes(&mine).unwrap();
        for (r, bytes) in all.iter().enumerate() {
            assert_eq!(
                bytes,
                &vec![r as u8 + 1; r * 3 * scale],
                "rank {rank}: bytes from {r}"
            );
        }
    }
    println!("rank {rank}: all_gather ok");
}

fn big_body() {
    let group = join();
    let (rank, n) = rank_world();
    let len = 16 << 20; // 64 MiB of f32
    let data: Vec<f32> = (0..len).map(|i| (i % 1000) as f32 + rank as f32).collect();
    let mut t = Tensor::from_slice(&data);
    drop(data);
    group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    let got: Vec<f32> = Vec::try_from(&t).unwrap();
    let offset = (n * (n - 1) / 2) as f32;
    for (i, g) in got.iter().enumerate() {
        let want = n as f32 * (i % 1000) as f32 + offset;
        assert_eq!(*g, want, "rank {rank} element {i}");
    }
    println!("rank {rank}: 64 MiB ok");
}

/// Rank `r`'s value at index `i` for [`avg_body`]: 64 scrambled bits.
fn scrambled(r: usize, i: usize) -> u64 {
    let x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (r as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
    x ^ (x >> 29)
}

/// `Avg` gives, bit for bit, what `Sum` gives divided by the world size element by element
/// (floats divided in their type, integers' wrapped sums truncated toward zero), and for
/// bf16 and f16 the `Sum` of every rank's values divided first (through `f32`, as NCCL
/// divides those types first), so that it does not overflow. Lengths are odd and take both paths: the latency
/// path (1, 7, 1001 elements), the ring (300,007: over `SMALL_BYTES` in every dtype and
/// world) and, in f32, a buffer over the 16 MiB from which the ring receives with streaming
/// stores (4,194,311 elements).
fn avg_body() {
    use tch::Kind;
    let group = join();
    let (rank, n) = rank_world();
    let small = [1usize, 7, 1001, 300_007];
    let all = [1usize, 7, 1001, 300_007, 4_194_311];
    for (kind, sizes) in [
        (Kind::Float, &all[..]),
        (Kind::Double, &small[..]),
        (Kind::BFloat16, &small[..]),
        (Kind::Half, &small[..]),
        (Kind::Int64, &small[..]),
    ] {
        for &size in sizes {
            let mine = if kind == Kind::Int64 {
                let v: Vec<i64> = (0..size).map(|i| scrambled(rank, i) as i64).collect();
                Tensor::from_slice(&v)
            } else {
                // Fractions in [-1000, 1000): sums and quotients round in every type.
                let v: Vec<f64> = (0..size)
                    .map(|i| (scrambled(rank, i) % 2_000_003) as f64 / 1000.0017 - 1000.0)
                    .collect();
                Tensor::from_slice(&v).to_kind(kind)
            };
            let mut sum = mine.copy();
            group.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
            // Half precision divides each rank's values first (NCCL's ncclAvg), in f32.
            let mut divided_first = (mine.to_kind(Kind::Float) / n as f64).to_kind(kind);
            group.all_reduce(&mut divided_first, ReduceOp::Sum).unwrap();
            let mut avg = mine;
            group.all_reduce(&mut avg, ReduceOp::Avg).unwrap();
            let floats = |t: &Tensor| Vec::<f32>::try_from(&t.to_kind(Kind::Float)).unwrap();
            let divided = |s: f32| s / n as f32;
            let (want, got): (Vec<u64>, Vec<u64>) = match kind {
                Kind::Float => (
                    floats(&sum)
                        .into_iter()
                        .map(|s| u64::from(divided(s).to_bits()))
                        .collect(),
                    floats(&avg)
                        .into_iter()
                        .map(|a| u64::from(a.to_bits()))
                        .collect(),
                ),
                Kind::Double => {
                    let f = |t: &Tensor| Vec::<f64>::try_from(t).unwrap();
                    (
                        f(&sum)
                            .into_iter()
                            .map(|s| (s / n as f64).to_bits())
                            .collect(),
                        f(&avg).into_iter().map(f64::to_bits).collect(),
                    )
                }
                Kind::BFloat16 | Kind::Half => {
                    // The f32 values are exact in the type.
                    let bits = |v: f32| match kind {
                        Kind::Half => half::f16::from_f32(v).to_bits(),
                        _ => half::bf16::from_f32(v).to_bits(),
                    };
                    let bits_of = |t: &Tensor| floats(t).into_iter().map(|v| u64::from(bits(v)));
                    (bits_of(&divided_first).collect(), bits_of(&avg).collect())
                }
                _ => {
                    let i = |t: &Tensor| Vec::<i64>::try_from(t).unwrap();
                    (
                        i(&sum).into_iter().map(|s| (s / n as i64) as u64).collect(),
                        i(&avg).into_iter().map(|a| a as u64).collect(),
                    )
                }
            };
            assert_eq!(got.len(), size);
            if let Some(at) = (0..size).find(|&i| got[i] != want[i]) {
                panic!(
                    "{kind:?} size {size} world {n} rank {rank}: Avg element {at} has bits {:#x}, expected {:#x}",
                    got[at], want[at]
                );
            }
        }
    }
    // Every rank's 40000 in f16: the sum (80000 on 2 ranks) is past f16's range, the average
    // is not.
    let mut big = Tensor::from_slice(&[40000.0f32]).to_kind(Kind::Half);
    group.all_reduce(&mut big, ReduceOp::Avg).unwrap();
    assert_eq!(f32::try_from(&big.to_kind(Kind::Float)).unwrap(), 40000.0);
    println!("rank {rank}: avg ok");
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process on the host, so that times
/// taken by different ranks compare.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_MONOTONIC)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn barrier_body() {
    let group = join();
    let (rank, n) = rank_world();
    group.barrier().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300 * rank as u64));
    // Every rank reads the host's monotonic clock just before it enters the barrier and just
    // after it leaves: a rank can only leave once every rank has entered, so every rank's
    // leaving time is at least every rank's arrival time, the last one's (rank n-1's, 600 ms
    // after rank 0's) included. No tolerance: the clock is one for all processes, and each
    // reading is ordered with the barrier's messages. A barrier that did not wait would let
    // rank 0 leave some 600 ms before rank n-1 arrives.
    let arrive = monotonic_ns();
    group.barrier().unwrap();
    let leave = monotonic_ns();
    let mut mine = arrive.to_le_bytes().to_vec();
    mine.extend(leave.to_le_bytes());
    let times: Vec<(u64, u64)> = group
        .all_gather_bytes(&mine)
        .unwrap()
        .iter()
        .map(|b| {
            let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
            (word(0), word(8))
        })
        .collect();
    assert_eq!(times.len(), n);
    let (last, last_arrival) = (0..n).map(|q| (q, times[q].0)).max_by_key(|t| t.1).unwrap();
    for (r, &(_, left)) in times.iter().enumerate() {
        assert!(
            left >= last_arrival,
            "rank {r} left the barrier {} ns before rank {last} arrived (seen by rank {rank})",
            last_arrival - left
        );
    }
    println!(
        "rank {rank}: barrier ok, left {} ms after rank {last} arrived",
        (leave - last_arrival) / 1_000_000
    );
}

/// The ring order the crate promises: hosts in the order of their lowest rank, each host's
/// ranks in a row.
fn expected_order(hosts: &[&str]) -> Vec<usize> {
    let mut order: Vec<usize> = Vec::new();
    for r in 0..hosts.len() {
        if !order.iter().any(|&o| hosts[o] == hosts[r]) {
            order.extend((r..hosts.len()).filter(|&q| hosts[q] == hosts[r]));
        }
    }
    order
}

/// A rank of a job whose ranks were told (by `DDP_HOST_ID`, published through the
/// rendezvous) that they sit on the hosts listed in `HOSTS`; the ranks in `TCP_RANKS` run
/// with `DDP_TRANSPORT=tcp`. Checks the ring and the link kinds, then every collective.
fn spanning_body() {
    let group = ProcessGroup::from_env().unwrap();
    let (rank, n) = rank_world();
    let hosts_var = std::env::var("HOSTS").unwrap();
    let hosts: Vec<&str> = hosts_var.split(',').collect();
    let tcp_ranks: Vec<usize> = std::env::var("TCP_RANKS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|r| r.parse().ok())
        .collect();
    let order = expected_order(&hosts);
    let layout = group.ring_layout();
    assert_eq!(layout.order, order, "rank {rank}");
    let pos = order.iter().position(|&r| r == rank).unwrap();
    let (next, prev) = (order[(pos + 1) % n], order[(pos + n - 1) % n]);
    assert_eq!((layout.next, layout.prev), (next, prev));
    let kind = |a: usize, b: usize| {
        if hosts[a] == hosts[b] && !tcp_ranks.contains(&a) && !tcp_ranks.contains(&b) {
            LinkKind::SharedMemory
        } else {
            LinkKind::Tcp
        }
    };
    assert_eq!(
        (layout.to_next, layout.from_prev),
        (Some(kind(rank, next)), Some(kind(prev, rank))),
        "rank {rank}"
    );
    check_all_reduce::<f32>(&group);
    check_all_reduce::<i64>(&group);
    check_all_reduce::<u8>(&group);
    check_broadcast::<f64>(&group, &SIZES);
    let parts = group.all_gather(&Tensor::from(rank as i32 * 7)).unwrap();
    let got: Vec<i64> = parts.iter().map(|p| p.int64_value(&[])).collect();
    assert_eq!(got, (0..n as i64).map(|r| r * 7).collect::<Vec<_>>());
    let mine = vec![rank as u8; 1000 * rank + 3];
    for (r, bytes) in group.all_gather_bytes(&mine).unwrap().iter().enumerate() {
        assert_eq!(bytes, &vec![r as u8; 1000 * r + 3]);
    }
    group.barrier().unwrap();
    println!(
        "rank {rank}: spanning ok, to_next={:?} from_prev={:?}",
        layout.to_next.unwrap(),
        layout.from_prev.unwrap()
    );
}

/// Runs `spanning_body` on `hosts` (one entry per rank), with `tcp_ranks` forced to TCP, and
/// returns the link kinds the ranks reported.
fn run_spanning(test: &str, hosts: &[&str], tcp_ranks: &[usize]) -> Vec<String> {
    let list = hosts.join(",");
    let tcp: Vec<String> = tcp_ranks.iter().map(usize::to_string).collect();
    let tcp = tcp.join(",");
    let outputs = common::run_world_each(test, hosts.len(), |r| {
        let mut env = vec![
            ("HOSTS", list.clone()),
            ("TCP_RANKS", tcp.clone()),
            ("DDP_HOST_ID", hosts[r].to_string()),
        ];
        if tcp_ranks.contains(&r) {
            env.push(("DDP_TRANSPORT", "tcp".to_string()));
        }
        env
    });
    outputs
        .iter()
        .enumerate()
        .map(|(rank, out)| {
            let line = common::lines_with(out, &format!("rank {rank}: spanning ok, "));
            assert_eq!(
                line.len(),
                1,
                "rank {rank} did not report:\n{}",
                common::show(out)
            );
            line[0].clone()
        })
        .collect()
}

/// Two nodes that reach the store at different addresses: rank 0 at 127.0.0.1, rank 1 at
/// 127.0.0.2, as when the master's host name maps to loopback on its own node (Debian's
/// `127.0.1.1`) and to its network address elsewhere. Rank 0's store and ring listener
/// answer on every interface, as c10d's TCPStore does, and rank 1 reaches rank 0's listener
/// at the store's address.
#[test]
fn nodes_that_reach_the_store_at_different_addresses_meet() {
    if worker() {
        return spanning_body();
    }
    two_nodes_meet(
        "nodes_that_reach_the_store_at_different_addresses_meet",
        &[("LOCAL_WORLD_SIZE", "1"), ("GROUP_RANK", "{rank}")],
    );
}

/// Ranks 0 and 1 as two nodes (`a` and `b`) that reach the store at 127.0.0.1 and 127.0.0.2,
/// with `more` variables (`{rank}` in a value becomes the rank): each ring link is TCP.
fn two_nodes_meet(name: &str, more: &[(&str, &str)]) {
    let outputs = common::run_world_each(name, 2, |r| {
        let mut vars = vec![
            ("HOSTS", "a,b".to_string()),
            ("DDP_HOST_ID", ["a", "b"][r].to_string()),
            ("MASTER_ADDR", ["127.0.0.1", "127.0.0.2"][r].to_string()),
            ("LOCAL_RANK", "0".to_string()),
        ];
        vars.extend(
            more.iter()
                .map(|(k, v)| (*k, v.replace("{rank}", &r.to_string()))),
        );
        vars
    });
    for (rank, out) in outputs.iter().enumerate() {
        assert_eq!(
            common::lines_with(out, &format!("rank {rank}: spanning ok, ")),
            ["to_next=Tcp from_prev=Tcp"],
            "{}",
            common::show(out)
        );
    }
}

#[test]
fn nodes_without_a_local_world_size_meet_as_several_nodes() {
    if worker() {
        return spanning_body();
    }
    two_nodes_meet(
        "nodes_without_a_local_world_size_meet_as_several_nodes",
        &[("LOCAL_WORLD_SIZE", ""), ("DDP_RDZV_TIMEOUT_S", "20")],
    );
}

#[test]
fn a_job_spanning_two_hosts_uses_shared_memory_inside_and_tcp_between() {
    if worker() {
        return spanning_body();
    }
    // Ring 0 -> 2 -> 4 (host a, shared memory), 4 -> 1 (tcp), 1 -> 3 (host b, shared
    // memory), 3 -> 0 (tcp).
    let kinds = run_spanning(
        "a_job_spanning_two_hosts_uses_shared_memory_inside_and_tcp_between",
        &["a", "b", "a", "b", "a"],
        &[],
    );
    assert_eq!(
        kinds,
        [
            "to_next=SharedMemory from_prev=Tcp",
            "to_next=SharedMemory from_prev=Tcp",
            "to_next=SharedMemory from_prev=SharedMemory",
            "to_next=Tcp from_prev=SharedMemory",
            "to_next=Tcp from_prev=SharedMemory",
        ]
    );
}

#[test]
fn a_rank_that_forces_tcp_gets_tcp_links_and_the_others_keep_shared_memory() {
    if worker() {
        return spanning_body();
    }
    let kinds = run_spanning(
        "a_rank_that_forces_tcp_gets_tcp_links_and_the_others_keep_shared_memory",
        &["h", "h", "h", "h"],
        &[1],
    );
    assert_eq!(
        kinds,
        [
            "to_next=Tcp from_prev=SharedMemory",
            "to_next=Tcp from_prev=Tcp",
            "to_next=SharedMemory from_prev=Tcp",
            "to_next=SharedMemory from_prev=SharedMemory",
        ]
    );
}

/// Values that are not exact in floating point, so that any difference in the order of
/// reduction would show in the bits.
fn inexact(rank: usize, i: usize) -> f64 {
    ((i as f64 + 1.0) * (rank as f64 + 0.37)).sin() * 1e3 / 7.0
}

#[test]
fn shared_memory_and_tcp_give_identical_bits() {
    if worker() {
        let (rank, n) = rank_world();
        let shm = ProcessGroup::from_env().unwrap();
        let second: u16 = std::env::var("SECOND_PORT").unwrap().parse().unwrap();
        let mut opts = ddp_comm::Options::from_env()
            .unwrap()
            .transport(ddp_comm::Transport::Tcp)
            .run_id("identical-bits-tcp");
        opts.env.master_port = second;
        let tcp = ProcessGroup::new(opts).unwrap();
        assert_eq!(shm.ring_layout().to_next, Some(LinkKind::SharedMemory));
        assert_eq!(tcp.ring_layout().to_next, Some(LinkKind::Tcp));
        // Both sides of the latency path's limit, and a size whose pieces are uneven.
        for len in [1usize, 999, 40_000, 1_000_003] {
            let values: Vec<f64> = (0..len).map(|i| inexact(rank, i)).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let mut a = Tensor::from_slice(&values);
                let mut b = Tensor::from_slice(&values).to_kind(tch::Kind::Float);
                let mut c = Tensor::from_slice(&values);
                let mut d = b.copy();
                shm.all_reduce(&mut a, op).unwrap();
                shm.all_reduce(&mut b, op).unwrap();
                tcp.all_reduce(&mut c, op).unwrap();
                tcp.all_reduce(&mut d, op).unwrap();
                let (a, c) = (
                    Vec::<f64>::try_from(&a).unwrap(),
                    Vec::<f64>::try_from(&c).unwrap(),
                );
                let (b, d) = (
                    Vec::<f32>::try_from(&b).unwrap(),
                    Vec::<f32>::try_from(&d).unwrap(),
                );
                assert!(
                    a.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "f64 {op:?} len {len}: shared memory and TCP differ on rank {rank}"
                );
                assert!(
                    b.iter().zip(&d).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "f32 {op:?} len {len}: shared memory and TCP differ on rank {rank}"
                );
                // And the result is the sum it should be, within rounding.
                let want: f64 = (0..n).map(|r| inexact(r, len - 1)).sum::<f64>()
                    / if op == ReduceOp::Avg { n as f64 } else { 1.0 };
                assert!((a[len - 1] - want).abs() < 1e-9, "{} vs {want}", a[len - 1]);
            }
        }
        println!("rank {rank}: identical ok");
        return;
    }
    let second = common::free_port();
    let outputs = run_world(
        "shared_memory_and_tcp_give_identical_bits",
        3,
        &[("SECOND_PORT", second.to_string())],
    );
    for (rank, out) in outputs.iter().enumerate() {
        assert_eq!(
            common::lines_with(out, &format!("rank {rank}: ")),
            ["identical ok"]
        );
    }
}

/// A rank of one SLURM step: `SLURM_*` variables only, as `srun` sets them. It sums
/// `rank + 1 + 100 * step` over its step's ranks.
fn slurm_step_body() {
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_PORT",
    ] {
        assert!(std::env::var_os(var).is_none(), "{var} is set");
    }
    let group = ProcessGroup::from_env().unwrap();
    let step: f64 = std::env::var("SLURM_STEP_ID").unwrap().parse().unwrap();
    let (rank, n) = (group.rank(), group.world_size());
    let mut t = Tensor::from_slice(&[rank as f64 + 1.0 + 100.0 * step]);
    group.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    // Slow enough that the steps overlap.
    group.barrier().unwrap();
    println!(
        "rank {rank} of step {step}: {} of {n}",
        t.double_value(&[0])
    );
}

/// The port a SLURM step's ranks derive from its job and step ids (ddp-comm's README).
fn slurm_port(job: u16, step: u16) -> u16 {
    20000 + (job % 10000 + step * 1009) % 10000
}

/// Two steps of one SLURM job, started at once on one node (`srun ... & srun ... & wait`),
/// with one `DDP_SECRET`: each meets on its own port under its own run id
/// (`JOB.STEP`), and sums over its own two ranks only.
#[test]
fn two_slurm_steps_of_one_job_running_at_once_meet_apart() {
    const TEST: &str = "two_slurm_steps_of_one_job_running_at_once_meet_apart";
    if worker() {
        return slurm_step_body();
    }
    let free = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
    // A job id whose two step ports are free now (after a seed from this process's id).
    let job = (0..10000u16)
        .map(|i| (i + std::process::id() as u16 % 10000) % 10000)
        .find(|&job| free(slurm_port(job, 0)) && free(slurm_port(job, 1)))
        .expect("a free pair of ports in 20000..30000");
    let spawn = |step: usize, rank: usize| {
        let mut cmd = common::worker_command(TEST);
        for var in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "DDP_RUN_ID",
            "TORCHELASTIC_RUN_ID",
        ] {
            cmd.env_remove(var);
        }
        cmd.env("SLURM_JOB_ID", job.to_string())
            .env("SLURM_STEP_ID", step.to_string())
            .env("SLURM_PROCID", rank.to_string())
            .env("SLURM_LOCALID", rank.to_string())
            .env("SLURM_NTASKS", "2")
            .env("SLURM_TASKS_PER_NODE", "2")
            .env("SLURM_STEP_NODELIST", "localhost")
            .env("SLURM_JOB_NODELIST", "localhost")
            .env("DDP_RDZV_TIMEOUT_S", "60")
            .env("DDP_OP_TIMEOUT_S", "60");
        ddp_testkit::job_secret().apply(&mut cmd);
        cmd.spawn().unwrap()
    };
    // (step, rank), step by step.
    let children = [(0, 0), (0, 1), (1, 0), (1, 1)]
        .into_iter()
        .map(|(step, rank)| spawn(step, rank))
        .collect();
    let outputs = common::wait_all(children, std::time::Duration::from_secs(120));
    for (i, out) in outputs.iter().enumerate() {
        let (step, rank) = (i / 2, i % 2);
        assert!(
            out.status.success(),
            "step {step} rank {rank}:\n{}",
            common::show(out)
        );
        let sum = 3 + 200 * step;
        assert_eq!(
            common::lines_with(out, &format!("rank {rank} of step {step}: ")),
            [format!("{sum} of 2")],
            "{}",
            common::show(out)
        );
    }
}
