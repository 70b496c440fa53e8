//! Collectives on CPU tensors and slices with real processes on loopback: every rank
//! asserts the exact values it ends with.

mod common;

use common::{rank_world, run_world, worker};
use ddp_comm::{Backend, ProcessGroup, ReduceOp};
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

fn all_reduce_body() {
    let group = ProcessGroup::from_env().unwrap();
    assert_eq!(group.backend(), Backend::Tcp);
    assert_eq!((group.rank(), group.world_size()), rank_world());
    check_all_reduce::<f32>(&group);
    check_all_reduce::<f64>(&group);
    check_all_reduce::<i32>(&group);
    check_all_reduce::<i64>(&group);
    check_all_reduce::<u8>(&group);
    // The slice API gives the same results without tensors.
    let (rank, n) = rank_world();
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
    ($($name:ident: $n:expr, $body:ident;)*) => {$(
        #[test]
        fn $name() {
            if worker() {
                return $body();
            }
            let outputs = run_world(stringify!($name), $n, &[]);
            for (rank, out) in outputs.iter().enumerate() {
                assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("rank {rank}: ")), "rank {rank} did not report");
            }
        }
    )*};
}

world_tests! {
    all_reduce_world_1: 1, all_reduce_body;
    all_reduce_world_2: 2, all_reduce_body;
    all_reduce_world_3: 3, all_reduce_body;
    all_reduce_world_4: 4, all_reduce_body;
    all_reduce_world_5: 5, all_reduce_body;
    broadcast_world_1: 1, broadcast_body;
    broadcast_world_2: 2, broadcast_body;
    broadcast_world_3: 3, broadcast_body;
    broadcast_world_4: 4, broadcast_body;
    broadcast_world_5: 5, broadcast_body;
    all_gather_world_1: 1, all_gather_body;
    all_gather_world_2: 2, all_gather_body;
    all_gather_world_3: 3, all_gather_body;
    all_gather_world_5: 5, all_gather_body;
    all_reduce_64_mib_world_2: 2, big_body;
    barrier_waits_for_the_slowest_rank: 3, barrier_body;
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
    let group = ProcessGroup::from_env().unwrap();
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
    let group = ProcessGroup::from_env().unwrap();
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
    let group = ProcessGroup::from_env().unwrap();
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

fn barrier_body() {
    let group = ProcessGroup::from_env().unwrap();
    let (rank, n) = rank_world();
    group.barrier().unwrap();
    let start = std::time::Instant::now();
    std::thread::sleep(std::time::Duration::from_millis(300 * rank as u64));
    group.barrier().unwrap();
    let waited = start.elapsed();
    // Nobody leaves the barrier before the slowest rank (rank n-1) has arrived.
    assert!(
        waited.as_millis() >= 300 * (n as u128 - 1),
        "rank {rank} left after {waited:?}"
    );
    println!("rank {rank}: barrier ok after {waited:?}");
}
