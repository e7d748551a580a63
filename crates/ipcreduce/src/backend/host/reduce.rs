//! Reduction loops: any number of sources (in rank order), f32 accumulation, one rounding to
//! the element type at the end, one or two destinations.
//!
//! Work is done in blocks of [`BLOCK`] elements held in fixed-size f32 arrays, which LLVM
//! turns into straight-line vector code. The tail goes through the very same block function
//! on zero-padded copies, so every element is computed by identical arithmetic wherever it
//! lies: results do not depend on alignment, chunking or sharding, which is what makes
//! one-shot and two-shot bitwise equal.

use crate::types::{DType, ReduceOp};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Elements per block.
pub(crate) const BLOCK: usize = 64;
const MAX_ELEM: usize = 4;

/// An element type as loaded into / stored from f32 blocks.
trait Lanes {
    const SIZE: usize;
    /// Loads BLOCK elements from `src` (no alignment required).
    unsafe fn load(src: *const u8, out: &mut [f32; BLOCK]);
    /// Rounds BLOCK values to the element type and stores them at `dst`.
    unsafe fn store(v: &[f32; BLOCK], dst: *mut u8);
    /// Stores BLOCK values at offset `off` of every destination, rounding only once.
    #[inline(always)]
    unsafe fn store_all(v: &[f32; BLOCK], dsts: &[*mut u8], off: usize) {
        if let [d] = dsts {
            // SAFETY (caller): d is writable for BLOCK elements at off.
            return unsafe { Self::store(v, d.add(off)) };
        }
        let mut packed = [0u8; BLOCK * MAX_ELEM];
        // SAFETY (caller): every destination is writable for BLOCK elements at off.
        unsafe {
            Self::store(v, packed.as_mut_ptr());
            for d in dsts {
                std::ptr::copy_nonoverlapping(packed.as_ptr(), d.add(off), BLOCK * Self::SIZE);
            }
        }
    }
}

struct F32;
struct F16;
struct Bf16;

impl Lanes for F32 {
    const SIZE: usize = 4;
    #[inline(always)]
    unsafe fn load(src: *const u8, out: &mut [f32; BLOCK]) {
        // SAFETY (caller): src is readable for BLOCK elements.
        *out = unsafe { std::ptr::read_unaligned(src.cast::<[f32; BLOCK]>()) };
    }
    #[inline(always)]
    unsafe fn store(v: &[f32; BLOCK], dst: *mut u8) {
        // SAFETY (caller): dst is writable for BLOCK elements.
        unsafe { std::ptr::write_unaligned(dst.cast::<[f32; BLOCK]>(), *v) };
    }
}

impl Lanes for Bf16 {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load(src: *const u8, out: &mut [f32; BLOCK]) {
        // SAFETY (caller): src is readable for BLOCK elements.
        let raw = unsafe { std::ptr::read_unaligned(src.cast::<[u16; BLOCK]>()) };
        for i in 0..BLOCK {
            // bf16 is the top half of an f32: widening is exact.
            out[i] = f32::from_bits((raw[i] as u32) << 16);
        }
    }
    #[inline(always)]
    unsafe fn store(v: &[f32; BLOCK], dst: *mut u8) {
        let mut raw = [0u16; BLOCK];
        for i in 0..BLOCK {
            raw[i] = f32_to_bf16_bits(v[i]);
        }
        // SAFETY (caller): dst is writable for BLOCK elements.
        unsafe { std::ptr::write_unaligned(dst.cast::<[u16; BLOCK]>(), raw) };
    }
}

/// Round-to-nearest-even f32 -> bf16, branch-free so it vectorises; same results as
/// `half::bf16::from_f32` (NaNs stay quiet NaNs).
#[inline(always)]
fn f32_to_bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x0040;
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        nan as u16
    } else {
        rounded as u16
    }
}

impl Lanes for F16 {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load(src: *const u8, out: &mut [f32; BLOCK]) {
        // SAFETY (caller): src is readable for BLOCK elements; f16 is plain bits.
        let raw = unsafe { std::ptr::read_unaligned(src.cast::<[f16; BLOCK]>()) };
        // half converts 8 at a time with F16C when the CPU has it (detected at run time).
        raw.convert_to_f32_slice(out);
    }
    #[inline(always)]
    unsafe fn store(v: &[f32; BLOCK], dst: *mut u8) {
        let mut raw = [f16::ZERO; BLOCK];
        raw.convert_from_f32_slice(v);
        // SAFETY (caller): dst is writable for BLOCK elements.
        unsafe { std::ptr::write_unaligned(dst.cast::<[f16; BLOCK]>(), raw) };
    }
}

/// f16 through F16C (8 conversions per instruction). Only used inside kernels compiled
/// with `f16c`, picked at run time when the CPU has it; rounding is round-to-nearest-even
/// like the software path.
#[cfg(target_arch = "x86_64")]
struct F16Hw;

#[cfg(target_arch = "x86_64")]
impl Lanes for F16Hw {
    const SIZE: usize = 2;
    #[inline]
    #[target_feature(enable = "avx,f16c")]
    unsafe fn load(src: *const u8, out: &mut [f32; BLOCK]) {
        use std::arch::x86_64::*;
        for i in 0..BLOCK / 8 {
            // SAFETY (caller): src is readable for BLOCK elements; out holds BLOCK.
            unsafe {
                let h = _mm_loadu_si128(src.add(16 * i).cast());
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * i), _mm256_cvtph_ps(h));
            }
        }
    }
    #[inline]
    #[target_feature(enable = "avx,f16c")]
    unsafe fn store(v: &[f32; BLOCK], dst: *mut u8) {
        use std::arch::x86_64::*;
        for i in 0..BLOCK / 8 {
            // SAFETY (caller): dst is writable for BLOCK elements.
            unsafe {
                let f = _mm256_loadu_ps(v.as_ptr().add(8 * i));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(f);
                _mm_storeu_si128(dst.add(16 * i).cast(), h);
            }
        }
    }
}

/// bf16 with AVX2 integer ops: the same round-to-nearest-even and NaN rule as
/// [`f32_to_bf16_bits`]. Loading interleaves each 16-element group with zeros (which puts
/// every bf16 in the top half of an f32, i.e. converts it) in the order `unpack` produces;
/// storing packs with the exact inverse permutation. Reductions are elementwise and every
/// source is loaded alike, so the order inside a block never matters.
#[cfg(target_arch = "x86_64")]
struct Bf16Hw;

#[cfg(target_arch = "x86_64")]
impl Lanes for Bf16Hw {
    const SIZE: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load(src: *const u8, out: &mut [f32; BLOCK]) {
        use std::arch::x86_64::*;
        let zero = _mm256_setzero_si256();
        for i in 0..BLOCK / 16 {
            // SAFETY (caller): src is readable for BLOCK elements; out holds BLOCK.
            unsafe {
                let x = _mm256_loadu_si256(src.add(32 * i).cast());
                let lo = _mm256_unpacklo_epi16(zero, x);
                let hi = _mm256_unpackhi_epi16(zero, x);
                _mm256_storeu_ps(out.as_mut_ptr().add(16 * i), _mm256_castsi256_ps(lo));
                _mm256_storeu_ps(out.as_mut_ptr().add(16 * i + 8), _mm256_castsi256_ps(hi));
            }
        }
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn store(v: &[f32; BLOCK], dst: *mut u8) {
        use std::arch::x86_64::*;
        #[inline]
        #[target_feature(enable = "avx2")]
        fn round(b: __m256i) -> __m256i {
            let top = _mm256_srli_epi32::<16>(b);
            let lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
            let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
            let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
            let abs = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFF_FFFF));
            let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7F80_0000));
            let quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x0040));
            _mm256_blendv_epi8(rounded, quiet, nan)
        }
        for i in 0..BLOCK / 16 {
            // SAFETY (caller): dst is writable for BLOCK elements.
            unsafe {
                let lo = round(_mm256_castps_si256(_mm256_loadu_ps(v.as_ptr().add(16 * i))));
                let hi = round(_mm256_castps_si256(_mm256_loadu_ps(
                    v.as_ptr().add(16 * i + 8),
                )));
                // Values are <= 0xFFFF, so unsigned saturation is exact; packus works per
                // 128-bit lane, undoing unpacklo/unpackhi.
                _mm256_storeu_si256(dst.add(32 * i).cast(), _mm256_packus_epi32(lo, hi));
            }
        }
    }
}

/// A reduction operator on f32.
trait Combine {
    fn apply(a: f32, b: f32) -> f32;
}
struct Sum;
struct Max;
struct Min;
impl Combine for Sum {
    #[inline(always)]
    fn apply(a: f32, b: f32) -> f32 {
        a + b
    }
}
impl Combine for Max {
    // Written as a compare-select so it maps onto maxps; inputs are never NaN in practice
    // and every rank computes the same thing either way.
    #[inline(always)]
    fn apply(a: f32, b: f32) -> f32 {
        if b > a {
            b
        } else {
            a
        }
    }
}
impl Combine for Min {
    #[inline(always)]
    fn apply(a: f32, b: f32) -> f32 {
        if b < a {
            b
        } else {
            a
        }
    }
}

/// Accumulates one block of every source (rank order) into `acc`.
#[inline(always)]
unsafe fn block<T: Lanes, O: Combine>(srcs: &[*const u8], off: usize, acc: &mut [f32; BLOCK]) {
    // SAFETY (caller): every source is readable for BLOCK elements at `off`.
    unsafe {
        T::load(srcs[0].add(off), acc);
        let mut tmp = [0f32; BLOCK];
        for s in &srcs[1..] {
            T::load(s.add(off), &mut tmp);
            for i in 0..BLOCK {
                acc[i] = O::apply(acc[i], tmp[i]);
            }
        }
    }
}

#[inline(always)]
unsafe fn reduce_typed<T: Lanes, O: Combine>(srcs: &[*const u8], dsts: &[*mut u8], n: usize) {
    let full = n / BLOCK;
    let mut acc = [0f32; BLOCK];
    for b in 0..full {
        let off = b * BLOCK * T::SIZE;
        // SAFETY (caller): sources and destinations hold n >= (b+1) * BLOCK elements.
        unsafe {
            block::<T, O>(srcs, off, &mut acc);
            T::store_all(&acc, dsts, off);
        }
    }
    let rem = n - full * BLOCK;
    if rem == 0 {
        return;
    }
    // The tail: same block code on zero-padded copies, so no element is computed differently.
    let off = full * BLOCK * T::SIZE;
    let bytes = rem * T::SIZE;
    let mut pad = [[0u8; BLOCK * MAX_ELEM]; 2];
    // SAFETY: sources/destinations hold `rem` more elements at `off`; the pads hold a block.
    unsafe {
        std::ptr::copy_nonoverlapping(srcs[0].add(off), pad[0].as_mut_ptr(), bytes);
        T::load(pad[0].as_ptr(), &mut acc);
        let mut tmp = [0f32; BLOCK];
        for s in &srcs[1..] {
            std::ptr::copy_nonoverlapping(s.add(off), pad[1].as_mut_ptr(), bytes);
            T::load(pad[1].as_ptr(), &mut tmp);
            for i in 0..BLOCK {
                acc[i] = O::apply(acc[i], tmp[i]);
            }
        }
        T::store(&acc, pad[0].as_mut_ptr());
        for d in dsts {
            std::ptr::copy_nonoverlapping(pad[0].as_ptr(), d.add(off), bytes);
        }
    }
}

type Kernel = unsafe fn(&[*const u8], &[*mut u8], usize);

macro_rules! kernels {
    ($name:ident, $f16:ty, $bf16:ty $(, $feat:literal)?) => {
        mod $name {
            use super::*;
            $(#[target_feature(enable = $feat)])?
            unsafe fn k<T: Lanes, O: Combine>(s: &[*const u8], d: &[*mut u8], n: usize) {
                // SAFETY: forwarded contract of `reduce`.
                unsafe { reduce_typed::<T, O>(s, d, n) }
            }
            pub(super) fn pick(dtype: DType, op: ReduceOp) -> Kernel {
                match (dtype, op) {
                    (DType::F32, ReduceOp::Sum) => k::<F32, Sum>,
                    (DType::F32, ReduceOp::Max) => k::<F32, Max>,
                    (DType::F32, ReduceOp::Min) => k::<F32, Min>,
                    (DType::F16, ReduceOp::Sum) => k::<$f16, Sum>,
                    (DType::F16, ReduceOp::Max) => k::<$f16, Max>,
                    (DType::F16, ReduceOp::Min) => k::<$f16, Min>,
                    (DType::Bf16, ReduceOp::Sum) => k::<$bf16, Sum>,
                    (DType::Bf16, ReduceOp::Max) => k::<$bf16, Max>,
                    (DType::Bf16, ReduceOp::Min) => k::<$bf16, Min>,
                }
            }
        }
    };
}

kernels!(baseline, F16, Bf16);
#[cfg(target_arch = "x86_64")]
kernels!(avx2, F16Hw, Bf16Hw, "avx2,f16c");

/// The kernel for `dtype`/`op` on this CPU. Every rank of a host job runs on the same CPU,
/// and add/max/min give the same bits in SSE and AVX, so the choice never breaks bitwise
/// agreement between ranks.
pub(crate) fn kernel(dtype: DType, op: ReduceOp) -> Kernel {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        return avx2::pick(dtype, op);
    }
    baseline::pick(dtype, op)
}

#[cfg(test)]
/// Reduces `n` elements: `dst[i] = op(srcs[0][i], srcs[1][i], ...)` for every `dst`.
///
/// # Safety
/// Every source must be readable and every destination writable for `n` elements of
/// `dtype`. A destination may equal a source (in place) but must not otherwise overlap one.
pub(crate) unsafe fn reduce(
    dtype: DType,
    op: ReduceOp,
    srcs: &[*const u8],
    dsts: &[*mut u8],
    n: usize,
) {
    assert!(!srcs.is_empty());
    // SAFETY: forwarded contract; `kernel` only picks an implementation the CPU supports.
    unsafe { kernel(dtype, op)(srcs, dsts, n) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::{load_f64, store_f64};
    use crate::reference;
    use half::bf16;

    fn run(dtype: DType, inputs: &[Vec<u8>], n: usize, k: Kernel) -> Vec<u8> {
        let srcs: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr()).collect();
        let mut a = vec![0xFFu8; n * dtype.size()];
        let mut b = vec![0xFFu8; n * dtype.size()];
        // SAFETY: all buffers hold n elements.
        unsafe { k(&srcs, &[a.as_mut_ptr(), b.as_mut_ptr()], n) };
        assert_eq!(a, b, "both destinations get the same bits");
        a
    }

    #[test]
    fn every_dtype_op_and_length_matches_the_reference() {
        let seed = 11;
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                for world in [1, 2, 3, 8] {
                    for n in (0..200).chain([1000, 4097]) {
                        let inputs: Vec<Vec<u8>> = (0..world)
                            .map(|r| {
                                let mut v = vec![0u8; n * dtype.size()];
                                reference::fill_input(dtype, seed, r, &mut v);
                                v
                            })
                            .collect();
                        let out = run(dtype, &inputs, n, kernel(dtype, op));
                        let wrong = reference::count_wrong(dtype, op, seed, world, &out);
                        assert_eq!(wrong, 0, "{dtype} {op} world {world} n {n}");
                        let base = run(dtype, &inputs, n, baseline::pick(dtype, op));
                        assert_eq!(out, base, "SIMD and baseline kernels agree bitwise");
                    }
                }
            }
        }
    }

    #[test]
    fn result_does_not_depend_on_offset_or_split() {
        // Reducing a range in pieces (as chunks and shards do) gives the same bits as at once.
        let (dtype, op, n, world) = (DType::Bf16, ReduceOp::Sum, 777, 3);
        let inputs: Vec<Vec<u8>> = (0..world)
            .map(|r| {
                let mut v = vec![0u8; n * 2];
                reference::fill_input(dtype, 5, r, &mut v);
                v
            })
            .collect();
        let whole = run(dtype, &inputs, n, kernel(dtype, op));
        let mut pieces = vec![0u8; n * 2];
        for (s, e) in [(0, 13), (13, 400), (400, 777)] {
            let srcs: Vec<*const u8> = inputs.iter().map(|v| v[s * 2..].as_ptr()).collect();
            // SAFETY: each piece lies inside the buffers.
            unsafe { reduce(dtype, op, &srcs, &[pieces[s * 2..].as_mut_ptr()], e - s) };
        }
        assert_eq!(whole, pieces);
    }

    #[test]
    fn in_place_and_rounding() {
        // In place on source 0. 1 + 2^-8 + 2^-8 is accumulated in f32 (exactly 1 + 2^-7,
        // a bf16 value) and rounded once; rounding after each add would give 1 (ties to even).
        let dtype = DType::Bf16;
        let mut a = vec![0u8; 2];
        let mut b = vec![0u8; 2];
        let mut c = vec![0u8; 2];
        store_f64(dtype, &mut a, 0, 1.0);
        store_f64(dtype, &mut b, 0, f64::powi(2.0, -8));
        store_f64(dtype, &mut c, 0, f64::powi(2.0, -8));
        let p = a.as_mut_ptr();
        // SAFETY: one-element buffers, in place on a.
        unsafe { reduce(dtype, ReduceOp::Sum, &[p, b.as_ptr(), c.as_ptr()], &[p], 1) };
        assert_eq!(load_f64(dtype, &a, 0), 1.0 + f64::powi(2.0, -7));
    }

    #[test]
    fn bf16_rounding_matches_half() {
        for bits in (0..=u32::MAX).step_by(65_521).chain([
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0001,
            0x7F7F_FFFF,
            0x0000_8000,
            0x3F80_8000,
            0x3F81_8000,
        ]) {
            let x = f32::from_bits(bits);
            assert_eq!(
                f32_to_bf16_bits(x),
                bf16::from_f32(x).to_bits(),
                "{bits:#x}"
            );
        }
    }
}

#[cfg(test)]
mod bench {
    use super::*;
    use std::time::Instant;

    /// `cargo test --release --lib host::reduce::bench -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn kernel_throughput() {
        for n in [4096usize, 32768, 131072, 524288] {
            for (dtype, world) in [
                (DType::F32, 2),
                (DType::F32, 4),
                (DType::Bf16, 2),
                (DType::F16, 2),
            ] {
                let bytes = n * dtype.size();
                let ins: Vec<Vec<u8>> = (0..world).map(|_| vec![0u8; bytes]).collect();
                let mut a = vec![0u8; bytes];
                let mut b = vec![0u8; bytes];
                let srcs: Vec<*const u8> = ins.iter().map(|v| v.as_ptr()).collect();
                let k = kernel(dtype, ReduceOp::Sum);
                let iters = (1 << 30) / (bytes * world);
                let mut best = f64::MAX;
                for _ in 0..5 {
                    let t = Instant::now();
                    for _ in 0..iters {
                        // SAFETY: buffers of n elements.
                        unsafe { k(&srcs, &[a.as_mut_ptr(), b.as_mut_ptr()], n) };
                    }
                    best = best.min(t.elapsed().as_secs_f64() / iters as f64);
                }
                println!(
                    "{dtype:>8} world {world} {bytes:>8} B: {:7.2} us, {:6.2} GB/s of input",
                    best * 1e6,
                    (bytes * world) as f64 / best / 1e9
                );
            }
        }
    }
}
