//! Test data and the float64 reference every result is checked against.
//!
//! Inputs come from a counter-based hash of (seed, rank, index), so any rank can compute any
//! rank's input, and so the reference, without exchanging data and without storing it.

use crate::element::{load_f64, store_f64};
use crate::types::{DType, ReduceOp};

/// SplitMix64 finaliser: a good 64-bit mix, cheap enough to run per element.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Input element `i` of `rank`, already rounded to `dtype`: uniform in [-1, 1).
#[inline]
pub fn input_value(dtype: DType, seed: u64, rank: usize, i: usize) -> f64 {
    let h = mix(seed ^ mix((rank as u64) << 40 ^ i as u64));
    let u = (h >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    round_to(dtype, 2.0 * u - 1.0)
}

/// Rounds an f64 to the nearest value representable in `dtype`.
#[inline]
pub fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F32 => v as f32 as f64,
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::Bf16 => half::bf16::from_f64(v).to_f64(),
    }
}

/// Fills `out` (count elements of `dtype`) with `rank`'s input.
pub fn fill_input(dtype: DType, seed: u64, rank: usize, out: &mut [u8]) {
    let count = out.len() / dtype.size();
    for i in 0..count {
        store_f64(dtype, out, i, input_value(dtype, seed, rank, i));
    }
}

/// Relative rounding unit of `dtype` (half an ulp at 1.0).
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f64::powi(2.0, -24),
        DType::F16 => f64::powi(2.0, -11),
        DType::Bf16 => f64::powi(2.0, -8),
    }
}

/// Reference value of element `i` and the sum of the inputs' magnitudes (for the bound).
#[inline]
pub fn reference(dtype: DType, op: ReduceOp, seed: u64, world: usize, i: usize) -> (f64, f64) {
    let first = input_value(dtype, seed, 0, i);
    let mut acc = first;
    let mut mag = first.abs();
    for r in 1..world {
        let v = input_value(dtype, seed, r, i);
        acc = op.apply_f64(acc, v);
        mag += v.abs();
    }
    (acc, mag)
}

/// Whether `got` is an acceptable result for the exact value `exact`.
///
/// Accumulation happens in f32 (error at most world x 2^-24 x sum|x|), then the result is
/// rounded once to `dtype` (half an ulp of the result). Max and min must be exact.
#[inline]
pub fn acceptable(
    dtype: DType,
    op: ReduceOp,
    world: usize,
    got: f64,
    exact: f64,
    mag: f64,
) -> bool {
    acceptable_within(dtype, op, world, got, exact, mag, 0.0)
}

/// [`acceptable`], with `extra` more absolute error allowed for sums (roundings of partial
/// sums, see [`count_wrong_nodes_par`]).
#[inline]
pub fn acceptable_within(
    dtype: DType,
    op: ReduceOp,
    world: usize,
    got: f64,
    exact: f64,
    mag: f64,
    extra: f64,
) -> bool {
    if !got.is_finite() {
        return false;
    }
    match op {
        ReduceOp::Max | ReduceOp::Min => got == exact,
        ReduceOp::Sum => {
            let accum = world as f64 * f64::powi(2.0, -23) * mag;
            let rounding = 2.0 * unit_roundoff(dtype) * (exact.abs() + accum);
            (got - exact).abs() <= accum + rounding + extra + 1e-30
        }
    }
}

/// Counts the elements of `out` that are not acceptable results of the all-reduce of
/// every rank's input.
pub fn count_wrong(dtype: DType, op: ReduceOp, seed: u64, world: usize, out: &[u8]) -> usize {
    let count = out.len() / dtype.size();
    (0..count)
        .filter(|&i| {
            let (exact, mag) = reference(dtype, op, seed, world, i);
            !acceptable(dtype, op, world, load_f64(dtype, out, i), exact, mag)
        })
        .count()
}

/// [`count_wrong`] spread over the machine's cores (large buffers take seconds on one).
pub fn count_wrong_par(dtype: DType, op: ReduceOp, seed: u64, world: usize, out: &[u8]) -> usize {
    par_count(out.len() / dtype.size(), |i| {
        let (exact, mag) = reference(dtype, op, seed, world, i);
        !acceptable(dtype, op, world, load_f64(dtype, out, i), exact, mag)
    })
}

/// [`count_wrong_par`] for a job of several nodes (`nodes`: the ranks of each): the
/// hierarchical all-reduce rounds each node's partial sum to `dtype`, then reduces the partial
/// sums between nodes (NCCL), which rounds again for f16 and bf16. Each of those at most
/// `2 * nodes` roundings is bounded by the unit roundoff times the sum of the partials'
/// magnitudes, which is added to [`acceptable`]'s bound. f32 accumulates in f32 throughout
/// (already covered); max and min stay exact. One node: [`count_wrong_par`].
pub fn count_wrong_nodes_par(
    dtype: DType,
    op: ReduceOp,
    seed: u64,
    nodes: &[Vec<usize>],
    out: &[u8],
) -> usize {
    let world: usize = nodes.iter().map(Vec::len).sum();
    if nodes.len() <= 1 || dtype == DType::F32 || op != ReduceOp::Sum {
        return count_wrong_par(dtype, op, seed, world, out);
    }
    let slack = 2.0 * nodes.len() as f64 * unit_roundoff(dtype);
    par_count(out.len() / dtype.size(), |i| {
        let (exact, mag) = reference(dtype, op, seed, world, i);
        let partials: f64 = nodes
            .iter()
            .map(|n| {
                n.iter()
                    .map(|&r| input_value(dtype, seed, r, i))
                    .sum::<f64>()
                    .abs()
            })
            .sum();
        let got = load_f64(dtype, out, i);
        !acceptable_within(dtype, op, world, got, exact, mag, slack * partials)
    })
}

/// How many of `0..count` satisfy `wrong`, spread over the machine's cores.
fn par_count(count: usize, wrong: impl Fn(usize) -> bool + Sync) -> usize {
    par_count_shared(count, 1, wrong)
}

/// How many of `0..count` satisfy `wrong`, spread over one rank's share of the machine's
/// cores when `ranks_here` ranks share it: one thread where the ranks fill the cores (more
/// would take cores from the other ranks), and below 64 Ki elements.
pub fn par_count_shared(
    count: usize,
    ranks_here: usize,
    wrong: impl Fn(usize) -> bool + Sync,
) -> usize {
    if count < 1 << 16 {
        return (0..count).filter(|&i| wrong(i)).count();
    }
    // Asked only for large counts: on Linux it reads the cgroup's CPU quota from files (tens
    // of microseconds), which a small output's check would spend on every call.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores / ranks_here.max(1);
    if threads <= 1 {
        return (0..count).filter(|&i| wrong(i)).count();
    }
    let per = count.div_ceil(threads);
    let wrong = &wrong;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (lo, hi) = ((t * per).min(count), ((t + 1) * per).min(count));
                s.spawn(move || (lo..hi).filter(|&i| wrong(i)).count())
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(usize::MAX))
            .sum()
    })
}

/// Fills `out` with `rank`'s input, spread over the machine's cores.
pub fn fill_input_par(dtype: DType, seed: u64, rank: usize, out: &mut [u8]) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let elems_per = (out.len() / dtype.size()).div_ceil(threads).max(1 << 14);
    std::thread::scope(|s| {
        for (t, part) in out.chunks_mut(elems_per * dtype.size()).enumerate() {
            s.spawn(move || {
                let base = t * elems_per;
                for i in 0..part.len() / dtype.size() {
                    store_f64(dtype, part, i, input_value(dtype, seed, rank, base + i));
                }
            });
        }
    });
}

/// Fills a buffer with a value no correct result can hold (NaN), so unwritten elements show.
pub fn poison(out: &mut [u8]) {
    out.fill(0xFF); // all-ones is a NaN in f32, f16 and bf16
}

/// A 64-bit fingerprint of a buffer, to compare results bitwise across ranks cheaply.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for chunk in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(w));
    }
    mix(h ^ bytes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the hierarchical all-reduce computes for 2 nodes of 2 ranks: each node's sum in
    /// f32 rounded to the dtype, then the two rounded once more.
    #[test]
    fn node_partials_rounded_twice_pass_only_the_nodes_bound() {
        let nodes = vec![vec![0, 1], vec![2, 3]];
        let count = 20_000;
        for dtype in [DType::Bf16, DType::F16] {
            let mut out = vec![0u8; count * dtype.size()];
            for i in 0..count {
                let node = |n: &Vec<usize>| {
                    let s: f32 = n.iter().map(|&r| input_value(dtype, 3, r, i) as f32).sum();
                    round_to(dtype, s as f64)
                };
                let sum = (node(&nodes[0]) as f32 + node(&nodes[1]) as f32) as f64;
                store_f64(dtype, &mut out, i, round_to(dtype, sum));
            }
            assert_eq!(
                count_wrong_nodes_par(dtype, ReduceOp::Sum, 3, &nodes, &out),
                0
            );
            // The one-group bound is too tight for it (cancellation): the nodes' bound is needed.
            assert!(
                count_wrong_par(dtype, ReduceOp::Sum, 3, 4, &out) > 0,
                "{dtype}"
            );
            // A result off by far more than the roundings still fails.
            for i in 0..count {
                let v = load_f64(dtype, &out, i);
                store_f64(dtype, &mut out, i, v + 0.25);
            }
            assert_eq!(
                count_wrong_nodes_par(dtype, ReduceOp::Sum, 3, &nodes, &out),
                count
            );
        }
    }

    #[test]
    fn exact_sum_is_accepted_and_a_wrong_one_is_not() {
        for dtype in DType::ALL {
            let world = 4;
            let count = 1000;
            let mut out = vec![0u8; count * dtype.size()];
            for i in 0..count {
                let (exact, _) = reference(dtype, ReduceOp::Sum, 7, world, i);
                store_f64(dtype, &mut out, i, exact);
            }
            assert_eq!(
                count_wrong(dtype, ReduceOp::Sum, 7, world, &out),
                0,
                "{dtype}"
            );
            // A result that misses one rank's contribution must be caught.
            let (partial, _) = reference(dtype, ReduceOp::Sum, 7, world - 1, 3);
            store_f64(dtype, &mut out, 3, partial);
            assert_eq!(
                count_wrong(dtype, ReduceOp::Sum, 7, world, &out),
                1,
                "{dtype}"
            );
            poison(&mut out);
            assert_eq!(
                count_wrong(dtype, ReduceOp::Sum, 7, world, &out),
                count,
                "{dtype}"
            );
        }
    }

    #[test]
    fn parallel_versions_agree_with_serial_ones() {
        let dtype = DType::F16;
        let count = 200_003;
        let mut a = vec![0u8; count * 2];
        let mut b = vec![0u8; count * 2];
        fill_input(dtype, 9, 1, &mut a);
        fill_input_par(dtype, 9, 1, &mut b);
        assert_eq!(a, b);
        // a is rank 1's input, not the sum: nearly every element is wrong.
        let serial = count_wrong(dtype, ReduceOp::Sum, 9, 2, &a);
        assert!(serial > count / 2);
        assert_eq!(count_wrong_par(dtype, ReduceOp::Sum, 9, 2, &a), serial);
    }

    #[test]
    fn max_and_min_must_be_exact() {
        let dtype = DType::F32;
        let (exact, mag) = reference(dtype, ReduceOp::Max, 1, 3, 0);
        assert!(acceptable(dtype, ReduceOp::Max, 3, exact, exact, mag));
        assert!(!acceptable(
            dtype,
            ReduceOp::Max,
            3,
            exact + 1e-6,
            exact,
            mag
        ));
    }

    #[test]
    fn inputs_differ_by_rank_and_stay_in_range() {
        let a: Vec<f64> = (0..64).map(|i| input_value(DType::Bf16, 1, 0, i)).collect();
        let b: Vec<f64> = (0..64).map(|i| input_value(DType::Bf16, 1, 1, i)).collect();
        assert_ne!(a, b);
        assert!(a.iter().all(|v| (-1.0..=1.0).contains(v)));
    }
}
