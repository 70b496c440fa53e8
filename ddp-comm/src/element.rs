//! Element types, reduction operators, and the reduction kernels of the CPU links.

/// How values from different ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Sum over ranks divided by the world size (integer types: truncated toward zero, as
    /// NCCL's `ncclAvg`; on the CPU links f16 and bf16 divide each rank's values first, in
    /// f32, so that the sum does not overflow, as NCCL divides those types first).
    Avg,
    /// Element-wise maximum; on the CPU links a NaN from any rank wins, as in
    /// `torch.maximum` (NCCL's `fmaxf` drops it).
    Max,
    /// Element-wise minimum; NaN as for [`ReduceOp::Max`].
    Min,
}

/// Element type of a buffer taking part in a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `u8`.
    U8,
    /// `i8`.
    I8,
    /// `i16`.
    I16,
    /// `i32`.
    I32,
    /// `i64`.
    I64,
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// IEEE half: CPU reductions compute each step in `f32` and round to nearest even, as
    /// PyTorch's CPU kernels and Gloo do.
    F16,
    /// bfloat16, reduced on the CPU like [`DType::F16`].
    BF16,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A plain numeric type that the byte-level collectives accept (`all_reduce_slice` etc.).
///
/// Sealed: implemented for `u8`, `i8`, `i16`, `i32`, `i64`, `f32`, `f64`, types for which
/// every bit pattern is a valid value.
pub trait Element: sealed::Sealed + bytemuck::Pod + Send + Sync + PartialOrd + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
}

trait Arith: Element {
    fn add(self, other: Self) -> Self;
    /// Divides every value by `n`.
    fn divide(values: &mut [Self], n: usize);
    /// Whether `self` is NaN (never for integers).
    fn is_nan(self) -> bool;
}

macro_rules! int_element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
        impl Arith for $t {
            #[inline(always)]
            fn add(self, other: Self) -> Self { self.wrapping_add(other) }
            fn divide(values: &mut [Self], n: usize) {
                values.iter_mut().for_each(|v| *v = (*v as i128 / n as i128) as $t);
            }
            #[inline(always)]
            fn is_nan(self) -> bool { false }
        }
    )*};
}
int_element!(u8 => U8, i8 => I8, i16 => I16, i32 => I32, i64 => I64);

macro_rules! float_element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
        impl Arith for $t {
            #[inline(always)]
            fn add(self, other: Self) -> Self { self + other }
            fn divide(values: &mut [Self], n: usize) {
                let d = n as $t;
                if n.is_power_of_two() {
                    // `x * 2^-k` and `x / 2^k` round the same real number: the same bits,
                    // from a multiplication that costs a fraction of a division.
                    let r = 1.0 / d;
                    values.iter_mut().for_each(|v| *v *= r);
                } else {
                    values.iter_mut().for_each(|v| *v /= d);
                }
            }
            #[inline(always)]
            fn is_nan(self) -> bool { <$t>::is_nan(self) }
        }
    )*};
}
float_element!(f32 => F32, f64 => F64);

/// A half-precision type, reduced through `f32` one step at a time: each partial result is
/// rounded back to the type, as Gloo's and PyTorch's CPU kernels round `a + b`. Conversions
/// work on slices, so that they vectorise (F16C for IEEE half where the CPU has it).
trait HalfFloat: Copy + bytemuck::Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl HalfFloat for half::f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

impl HalfFloat for half::bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = half::bf16::from_bits(bf16_bits(*s));
        }
    }
}

/// `value` rounded to the nearest bfloat16, ties to even (c10's `round_to_nearest_even`),
/// without branches so that the loop vectorises; NaN stays a (quiet) NaN.
#[inline(always)]
fn bf16_bits(value: f32) -> u16 {
    let x = value.to_bits();
    let rounded = (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((x >> 16) | 0x40) as u16;
    if x & 0x7FFF_FFFF > 0x7F80_0000 {
        quiet_nan
    } else {
        rounded
    }
}

/// Elements converted to `f32` at a time.
const HALF_CHUNK: usize = 1024;

fn reduce_half<H: HalfFloat>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    let (dst, src) = (half_mut::<H>(dst), half_ref::<H>(src));
    let (mut a, mut b) = ([0f32; HALF_CHUNK], [0f32; HALF_CHUNK]);
    for (d, s) in dst.chunks_mut(HALF_CHUNK).zip(src.chunks(HALF_CHUNK)) {
        let (a, b) = (&mut a[..d.len()], &mut b[..d.len()]);
        H::widen(d, a);
        H::widen(s, b);
        let pairs = a.iter_mut().zip(b.iter());
        match op {
            ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(x, y)| *x += *y),
            ReduceOp::Max => {
                pairs.for_each(|(x, y)| *x = if *y > *x || y.is_nan() { *y } else { *x })
            }
            ReduceOp::Min => {
                pairs.for_each(|(x, y)| *x = if *y < *x || y.is_nan() { *y } else { *x })
            }
        }
        H::narrow(a, d);
    }
}

fn divide_half<H: HalfFloat>(buf: &mut [u8], n: usize) {
    let mut a = [0f32; HALF_CHUNK];
    for v in half_mut::<H>(buf).chunks_mut(HALF_CHUNK) {
        let a = &mut a[..v.len()];
        H::widen(v, a);
        f32::divide(a, n);
        H::narrow(a, v);
    }
}

fn half_mut<H: HalfFloat>(bytes: &mut [u8]) -> &mut [H] {
    if bytes.is_empty() {
        return &mut [];
    }
    bytemuck::cast_slice_mut(bytes)
}

fn half_ref<H: HalfFloat>(bytes: &[u8]) -> &[H] {
    if bytes.is_empty() {
        return &[];
    }
    bytemuck::cast_slice(bytes)
}

/// Views a byte buffer as elements. Panics if a non-empty buffer is misaligned or not a
/// whole number of elements: callers only pass tensor storage, `Vec<T>`-backed scratch and
/// element-aligned offsets into them. An empty buffer is fine wherever it points (bytemuck
/// would check the alignment of its pointer).
fn cast_mut<T: Element>(bytes: &mut [u8]) -> &mut [T] {
    if bytes.is_empty() {
        return &mut [];
    }
    bytemuck::cast_slice_mut(bytes)
}

fn cast<T: Element>(bytes: &[u8]) -> &[T] {
    if bytes.is_empty() {
        return &[];
    }
    bytemuck::cast_slice(bytes)
}

/// Views a typed slice as bytes.
pub(crate) fn as_bytes_mut<T: Element>(values: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(values)
}

/// `Max` and `Min` keep a NaN on either side (`torch.maximum`): which rank's buffer is the
/// destination depends on the path and the piece, so dropping one would make the result
/// depend on the tensor's size and the NaN's place.
fn reduce_typed<T: Arith>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    let dst = cast_mut::<T>(dst);
    let src = cast::<T>(src);
    let pairs = dst.iter_mut().zip(src);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(d, s)| *d = d.add(*s)),
        ReduceOp::Max => pairs.for_each(|(d, s)| {
            if *s > *d || s.is_nan() {
                *d = *s
            }
        }),
        ReduceOp::Min => pairs.for_each(|(d, s)| {
            if *s < *d || s.is_nan() {
                *d = *s
            }
        }),
    }
}

/// `dst[i] = dst[i] op src[i]` for byte buffers of element type `dtype` (`Avg` sums; the
/// sum is divided once it is complete, see [`finish_avg`]).
pub(crate) fn reduce(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    match dtype {
        DType::U8 => reduce_typed::<u8>(op, dst, src),
        DType::I8 => reduce_typed::<i8>(op, dst, src),
        DType::I16 => reduce_typed::<i16>(op, dst, src),
        DType::I32 => reduce_typed::<i32>(op, dst, src),
        DType::I64 => reduce_typed::<i64>(op, dst, src),
        DType::F32 => reduce_typed::<f32>(op, dst, src),
        DType::F64 => reduce_typed::<f64>(op, dst, src),
        DType::F16 => reduce_half::<half::f16>(op, dst, src),
        DType::BF16 => reduce_half::<half::bf16>(op, dst, src),
    }
}

fn divide_typed<T: Arith>(buf: &mut [u8], n: usize) {
    T::divide(cast_mut::<T>(buf), n);
}

/// Divides every element by `n` (the last step of `Avg`), each on its own: dividing a buffer
/// in parts gives the same bytes as dividing it whole.
pub(crate) fn finish_avg(dtype: DType, buf: &mut [u8], n: usize) {
    match dtype {
        DType::U8 => divide_typed::<u8>(buf, n),
        DType::I8 => divide_typed::<i8>(buf, n),
        DType::I16 => divide_typed::<i16>(buf, n),
        DType::I32 => divide_typed::<i32>(buf, n),
        DType::I64 => divide_typed::<i64>(buf, n),
        DType::F32 => divide_typed::<f32>(buf, n),
        DType::F64 => divide_typed::<f64>(buf, n),
        DType::F16 => divide_half::<half::f16>(buf, n),
        DType::BF16 => divide_half::<half::bf16>(buf, n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_combine_element_wise() {
        let mut a = [1.0f32, 5.0, -2.0];
        let mut b = [2.0f32, 3.0, -7.0];
        for (op, want) in [
            (ReduceOp::Sum, [3.0, 8.0, -9.0]),
            (ReduceOp::Max, [2.0, 5.0, -2.0]),
            (ReduceOp::Min, [1.0, 3.0, -7.0]),
        ] {
            let mut d = a;
            reduce(DType::F32, op, as_bytes_mut(&mut d), as_bytes_mut(&mut b));
            assert_eq!(d, want, "{op:?}");
        }
        reduce(
            DType::F32,
            ReduceOp::Avg,
            as_bytes_mut(&mut a),
            as_bytes_mut(&mut b),
        );
        finish_avg(DType::F32, as_bytes_mut(&mut a), 2);
        assert_eq!(a, [1.5, 4.0, -4.5]);
    }

    #[test]
    fn half_types_add_in_f32_and_round_to_nearest_even() {
        use half::{bf16, f16};
        // 1 + 2^-8 is not a bf16 (8 significant bits): the tie rounds to the even 1.0; one
        // ulp more rounds up to 1 + 2^-7.
        let mut a = [
            bf16::from_f32(1.0),
            bf16::from_f32(1.0),
            bf16::from_f32(-3.0),
        ];
        let b = [
            bf16::from_f32(1.0 / 256.0),
            bf16::from_f32(3.0 / 256.0),
            bf16::from_f32(2.0),
        ];
        reduce(
            DType::BF16,
            ReduceOp::Sum,
            bytemuck::cast_slice_mut(&mut a),
            bytemuck::cast_slice(&b),
        );
        assert_eq!(a.map(bf16::to_f32), [1.0, 1.015625, -1.0]);
        let mut h = [f16::from_f32(3.0), f16::from_f32(-1.0)];
        let g = [f16::from_f32(4.0), f16::from_f32(2.0)];
        reduce(
            DType::F16,
            ReduceOp::Max,
            bytemuck::cast_slice_mut(&mut h),
            bytemuck::cast_slice(&g),
        );
        assert_eq!(h.map(f16::to_f32), [4.0, 2.0]);
        finish_avg(DType::F16, bytemuck::cast_slice_mut(&mut h), 2);
        assert_eq!(h.map(f16::to_f32), [2.0, 1.0]);
    }

    #[test]
    fn bf16_rounding_matches_the_half_crate_everywhere() {
        // Every bf16 value, and every f32 halfway and one ulp around it between two of them.
        for hi in 0..=u16::MAX {
            for low in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                let f = f32::from_bits((u32::from(hi) << 16) | low);
                let ours = bf16_bits(f);
                let theirs = half::bf16::from_f32(f).to_bits();
                if f.is_nan() {
                    assert!(half::bf16::from_bits(ours).is_nan(), "{hi:#x} {low:#x}");
                } else {
                    assert_eq!(ours, theirs, "{f:e} ({hi:#x} {low:#x})");
                }
            }
        }
    }

    #[test]
    fn long_half_buffers_reduce_across_chunks_element_by_element() {
        use half::{bf16, f16};
        let n = 3 * HALF_CHUNK + 5;
        let value = |i: usize, k: f32| ((i * 7919) % 1000) as f32 * k - 333.3;
        let a32: Vec<f32> = (0..n).map(|i| value(i, 0.37)).collect();
        let b32: Vec<f32> = (0..n).map(|i| value(i + 1, -0.71)).collect();
        let mut a: Vec<bf16> = a32.iter().map(|&v| bf16::from_f32(v)).collect();
        let b: Vec<bf16> = b32.iter().map(|&v| bf16::from_f32(v)).collect();
        let want: Vec<bf16> = a
            .iter()
            .zip(&b)
            .map(|(x, y)| bf16::from_f32((x.to_f32() + y.to_f32()) / 2.0))
            .collect();
        reduce(
            DType::BF16,
            ReduceOp::Avg,
            bytemuck::cast_slice_mut(&mut a),
            bytemuck::cast_slice(&b),
        );
        // Avg sums (rounded), then divides by 2, which is exact.
        finish_avg(DType::BF16, bytemuck::cast_slice_mut(&mut a), 2);
        assert_eq!(a, want);
        let mut h: Vec<f16> = a32.iter().map(|&v| f16::from_f32(v)).collect();
        let g: Vec<f16> = b32.iter().map(|&v| f16::from_f32(v)).collect();
        let want: Vec<f16> = h
            .iter()
            .zip(&g)
            .map(|(x, y)| f16::from_f32(x.to_f32().max(y.to_f32())))
            .collect();
        reduce(
            DType::F16,
            ReduceOp::Max,
            bytemuck::cast_slice_mut(&mut h),
            bytemuck::cast_slice(&g),
        );
        assert_eq!(h, want);
    }

    /// The float types as the tests see them.
    trait TestFloat: bytemuck::Pod {
        const DTYPE: DType;
        fn of(v: f64) -> Self;
        fn get(self) -> f64;
    }

    macro_rules! test_float {
        ($($t:ty => $d:ident, $of:expr, $get:expr;)*) => {$(
            impl TestFloat for $t {
                const DTYPE: DType = DType::$d;
                fn of(v: f64) -> Self { $of(v) }
                fn get(self) -> f64 { $get(self) }
            }
        )*};
    }
    test_float! {
        f32 => F32, |v| v as f32, f64::from;
        f64 => F64, |v| v, |v| v;
        half::f16 => F16, half::f16::from_f64, half::f16::to_f64;
        half::bf16 => BF16, half::bf16::from_f64, half::bf16::to_f64;
    }

    /// A NaN at each position in turn, in the destination, the source or both, over more
    /// than one chunk of the half types' conversions and every lane of a vector: `Max` and
    /// `Min` give NaN there and the exact maximum or minimum everywhere else.
    fn max_and_min_keep_nan_everywhere<T: TestFloat>() {
        let n = HALF_CHUNK + 33;
        let a: Vec<T> = (0..n)
            .map(|i| T::of((i * 37 % 101) as f64 - 50.0))
            .collect();
        let b: Vec<T> = (0..n)
            .map(|i| T::of((i * 53 % 103) as f64 - 51.0))
            .collect();
        let name = std::any::type_name::<T>();
        for op in [ReduceOp::Max, ReduceOp::Min] {
            for at in 0..n {
                for (in_dst, in_src) in [(true, false), (false, true), (true, true)] {
                    let (mut d, mut s) = (a.clone(), b.clone());
                    if in_dst {
                        d[at] = T::of(f64::NAN);
                    }
                    if in_src {
                        s[at] = T::of(f64::NAN);
                    }
                    reduce(
                        T::DTYPE,
                        op,
                        bytemuck::cast_slice_mut(&mut d),
                        bytemuck::cast_slice(&s),
                    );
                    for (i, got) in d.iter().map(|v| v.get()).enumerate() {
                        let (x, y) = (a[i].get(), b[i].get());
                        let ok = match (i == at, op) {
                            (true, _) => got.is_nan(),
                            (false, ReduceOp::Max) => got == x.max(y),
                            (false, _) => got == x.min(y),
                        };
                        assert!(
                            ok,
                            "{name} {op:?}, NaN at {at} (dst {in_dst}, src {in_src}): {i} is {got}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn max_and_min_keep_a_nan_from_either_side_in_every_float_type() {
        max_and_min_keep_nan_everywhere::<f32>();
        max_and_min_keep_nan_everywhere::<f64>();
        max_and_min_keep_nan_everywhere::<half::f16>();
        max_and_min_keep_nan_everywhere::<half::bf16>();
    }

    /// Over every world size up to 64 and values of every magnitude (subnormals, NaN and
    /// infinities among them), including the powers of two that multiply instead.
    #[test]
    fn average_divides_each_float_exactly_as_division_does() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut bits = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let wide: Vec<f64> = (0..4096).map(|_| f64::from_bits(bits())).collect();
        let narrow: Vec<f32> = (0..4096).map(|_| f32::from_bits(bits() as u32)).collect();
        for n in 1..=64 {
            let mut w = wide.clone();
            finish_avg(DType::F64, bytemuck::cast_slice_mut(&mut w), n);
            for (got, v) in w.iter().zip(&wide) {
                let want = v / n as f64;
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{v:e} / {n}"
                );
            }
            let mut f = narrow.clone();
            finish_avg(DType::F32, as_bytes_mut(&mut f), n);
            for (got, v) in f.iter().zip(&narrow) {
                let want = v / n as f32;
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{v:e} / {n}"
                );
            }
        }
    }

    #[test]
    fn integer_average_truncates_toward_zero_and_sum_wraps() {
        let mut v = [7i64, -7, 9];
        finish_avg(DType::I64, as_bytes_mut(&mut v), 2);
        assert_eq!(v, [3, -3, 4]);
        let mut a = [250u8];
        let mut b = [10u8];
        reduce(
            DType::U8,
            ReduceOp::Sum,
            as_bytes_mut(&mut a),
            as_bytes_mut(&mut b),
        );
        assert_eq!(a, [4]);
    }
}
