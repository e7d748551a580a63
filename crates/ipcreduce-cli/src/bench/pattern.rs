//! The benchmark's data: small-integer inputs that change every call, and their exact
//! results. The device twin of this file is `refresh.cu`; both must compute the same values
//! (the host checks the device's final output with these functions, so any difference fails
//! every row).
//!
//! Input element `i` of `rank` at iteration `iter` is an integer in -16..=15. Sums of up to 8
//! of them are exact in f32, f16 and bf16 whatever the order, so a result is right only if it
//! is equal to the expected value. Consecutive iterations differ at every element (an odd
//! step modulo 32), so a sum that reads any rank's previous input is wrong.

use ipcreduce::element::load_f64;
use ipcreduce::types::{DType, ReduceOp};

/// Largest world the patterns stay exact for (8 x 16 = 128 fits bf16's 8-bit significand).
pub const MAX_WORLD: usize = 8;

fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// Per-rank salt, from the seed and the rank only.
pub fn salt(seed: u64, rank: usize) -> u32 {
    let r = (rank as u32).wrapping_add(1);
    lowbias32(
        seed as u32 ^ lowbias32(((seed >> 32) as u32).wrapping_add(0x9e37_79b9u32.wrapping_mul(r))),
    )
}

/// Input element `i` at `iter` of `rank`, whose salt is `salt`. Rank 0 steps by an odd
/// amount, the others by an even non-zero one (modulo 32): a sum that reads one rank's
/// previous input, or every rank's, differs.
#[inline]
pub fn value(salt: u32, rank: usize, iter: u32, i: u64) -> i32 {
    value_of_hash(hash(salt, i), rank, iter)
}

/// The hash behind element `i` of the rank with this salt, the same at every iteration.
#[inline]
fn hash(salt: u32, i: u64) -> u32 {
    lowbias32(i as u32 ^ lowbias32((i >> 32) as u32 ^ salt))
}

/// [`value`] from the element's [`hash`].
#[inline]
fn value_of_hash(h: u32, rank: usize, iter: u32) -> i32 {
    let step = if rank == 0 {
        2 * (h & 15) + 1
    } else {
        2 * (h % 15) + 2
    };
    ((h >> 4).wrapping_add(iter.wrapping_mul(step)) & 31) as i32 - 16
}

/// The exact all-reduce of element `i` at `iter` over ranks with these salts.
#[inline]
pub fn expected(op: ReduceOp, salts: &[u32], iter: u32, i: u64) -> f64 {
    reduce(
        op,
        salts.iter().enumerate().map(|(r, &s)| value(s, r, iter, i)),
    )
}

/// The ranks' values reduced in rank order.
#[inline]
fn reduce(op: ReduceOp, mut values: impl Iterator<Item = i32>) -> f64 {
    let first = f64::from(values.next().expect("at least one rank"));
    values.fold(first, |acc, v| op.apply_f64(acc, f64::from(v)))
}

/// Most bytes of hashes a [`Pattern`] holds; larger messages hash at every use.
pub const HASHES_MAX_BYTES: usize = 64 << 20;

/// One measurement's pattern: the ranks' salts and, within [`HASHES_MAX_BYTES`], every rank's
/// hashes of the message's elements, made once. The inputs and results made from it then cost
/// a few integer operations per element and rank instead of a hash each (the host bench makes
/// them once per measurement, on the cores its ranks share). Its values and results are those
/// of [`value`] and [`expected`].
pub struct Pattern {
    salts: Vec<u32>,
    /// Element-major: element `i` of rank `r` at `i * world + r`.
    hashes: Option<Vec<u32>>,
}

impl Pattern {
    /// The pattern of `count` elements at `world` ranks from `seed`.
    pub fn new(seed: u64, world: usize, count: usize) -> Pattern {
        let salts = salts(seed, world);
        let fits = count.saturating_mul(world).saturating_mul(4) <= HASHES_MAX_BYTES;
        let hashes = fits.then(|| {
            let mut h = Vec::with_capacity(count * world);
            for i in 0..count as u64 {
                h.extend(salts.iter().map(|&s| hash(s, i)));
            }
            h
        });
        Pattern { salts, hashes }
    }

    /// [`value`] of element `i` of `rank` at `iter`.
    #[inline]
    pub fn value(&self, rank: usize, iter: u32, i: usize) -> i32 {
        match &self.hashes {
            Some(h) => value_of_hash(h[i * self.salts.len() + rank], rank, iter),
            None => value(self.salts[rank], rank, iter, i as u64),
        }
    }

    /// [`expected`] of element `i` at `iter`.
    #[inline]
    pub fn expected(&self, op: ReduceOp, iter: u32, i: usize) -> f64 {
        let world = self.salts.len();
        match &self.hashes {
            Some(h) => reduce(
                op,
                h[i * world..][..world]
                    .iter()
                    .enumerate()
                    .map(|(r, &h)| value_of_hash(h, r, iter)),
            ),
            None => expected(op, &self.salts, iter, i as u64),
        }
    }

    /// [`count_wrong`] of `out` as the result of iteration `iter`, from this pattern.
    pub fn count_wrong(
        &self,
        dtype: DType,
        op: ReduceOp,
        iter: u32,
        out: &[u8],
        ranks_here: usize,
    ) -> u64 {
        count_wrong_by(dtype, out, ranks_here, |i| self.expected(op, iter, i))
    }
}

/// The salts of every rank of a world.
pub fn salts(seed: u64, world: usize) -> Vec<u32> {
    (0..world).map(|r| salt(seed, r)).collect()
}

/// Wrong elements of `out` as the result of iteration `iter`, spread over this rank's share of
/// the cores: `ranks_here` ranks share the machine, and with as many ranks as cores or more, one
/// thread. Threads beyond the share took cores from the other ranks, and the host backend's
/// calls after such a check ran slower, even after as many untimed calls as timed ones (2-core
/// machine, 4 ranks at 2 MiB, 2026-12-07: 1126-1302 us a call against 958-1015 with the check
/// on one thread).
pub fn count_wrong(
    dtype: DType,
    op: ReduceOp,
    salts: &[u32],
    iter: u32,
    out: &[u8],
    ranks_here: usize,
) -> u64 {
    count_wrong_by(dtype, out, ranks_here, |i| {
        expected(op, salts, iter, i as u64)
    })
}

/// Elements of `out` that differ from `expected(i)`, over `ranks_here`'s share of the cores.
pub fn count_wrong_by(
    dtype: DType,
    out: &[u8],
    ranks_here: usize,
    expected: impl Fn(usize) -> f64 + Sync,
) -> u64 {
    let count = out.len() / dtype.size();
    ipcreduce::reference::par_count_shared(count, ranks_here, |i| {
        load_f64(dtype, out, i) != expected(i)
    }) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipcreduce::element::store_f64;

    #[test]
    fn values_are_small_integers_that_change_every_iteration() {
        let salts = salts(7, 4);
        for i in 0..10_000u64 {
            for iter in 0..40u32 {
                for (r, &s) in salts.iter().enumerate() {
                    let v = value(s, r, iter, i);
                    assert!((-16..=15).contains(&v));
                    assert_ne!(v, value(s, r, iter + 1, i), "element {i} iteration {iter}");
                }
                // Every rank's previous input: the sum differs too.
                let (now, next) = (
                    expected(ReduceOp::Sum, &salts, iter, i),
                    expected(ReduceOp::Sum, &salts, iter + 1, i),
                );
                assert_ne!(now, next, "element {i} iteration {iter}");
            }
        }
        // Ranks and seeds differ.
        assert_ne!(salt(7, 0), salt(7, 1));
        assert_ne!(salt(7, 0), salt(8, 0));
        assert_ne!(salt(1, 0), salt(1 << 32, 0));
    }

    #[test]
    fn sums_of_a_full_world_are_exact_in_every_dtype() {
        let salts = salts(1, MAX_WORLD);
        for dtype in DType::ALL {
            let mut buf = vec![0u8; dtype.size()];
            for i in 0..5000u64 {
                let want = expected(ReduceOp::Sum, &salts, 3, i);
                store_f64(dtype, &mut buf, 0, want);
                assert_eq!(load_f64(dtype, &buf, 0), want, "{dtype}");
            }
        }
    }

    /// `count_wrong` counts exactly the elements that differ from the iteration's result, and
    /// a right output of one iteration is wrong as the output of the next (a stale result).
    #[test]
    fn wrong_elements_and_stale_outputs_are_counted() {
        let (dtype, op, world, n) = (DType::Bf16, ReduceOp::Sum, 2, 64);
        let salts = salts(5, world);
        let mut recv = vec![0u8; n * 2];
        for i in 0..n {
            let want = f64::from(value(salts[0], 0, 0, i as u64))
                + f64::from(value(salts[1], 1, 0, i as u64));
            store_f64(dtype, &mut recv, i, want);
        }
        assert_eq!(count_wrong(dtype, op, &salts, 0, &recv, 1), 0);
        store_f64(dtype, &mut recv, 5, 1000.0);
        assert_eq!(count_wrong(dtype, op, &salts, 0, &recv, 1), 1);
        store_f64(dtype, &mut recv, 5, expected(op, &salts, 0, 5));
        assert_eq!(count_wrong(dtype, op, &salts, 1, &recv, 1), n as u64);
    }

    /// A pattern with its hashes made once gives the values and results of hashing every time,
    /// as does one too large to hold them.
    #[test]
    fn patterns_agree_with_hashing_every_time() {
        for world in [1usize, 2, 4, 8] {
            let salts = salts(11, world);
            let n = 3000;
            let held = Pattern::new(11, world, n);
            assert!(held.hashes.is_some());
            let hashed = Pattern {
                salts: salts.clone(),
                hashes: None,
            };
            for iter in [0u32, 1, 7, 1000] {
                for i in 0..n {
                    for pattern in [&held, &hashed] {
                        for (r, &s) in salts.iter().enumerate() {
                            assert_eq!(pattern.value(r, iter, i), value(s, r, iter, i as u64));
                        }
                    }
                    for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                        for pattern in [&held, &hashed] {
                            assert_eq!(
                                pattern.expected(op, iter, i),
                                expected(op, &salts, iter, i as u64)
                            );
                        }
                    }
                }
            }
        }
        assert!(Pattern::new(1, 8, HASHES_MAX_BYTES / 32 + 1)
            .hashes
            .is_none());
    }

    /// The device twin carries the same constants.
    #[test]
    fn kernel_uses_the_same_hash() {
        let src = super::super::cuda::REFRESH_SOURCE;
        for needle in [
            "0x7feb352du",
            "0x846ca68bu",
            "0x9e3779b9u * (u32)(rank + 1)",
            "rank == 0 ? 2u * (h & 15u) + 1u : 2u * (h % 15u) + 2u",
            "& 31u) - 16",
            "#define MAX_RANKS 8",
        ] {
            assert!(src.contains(needle), "refresh.cu lacks `{needle}`");
        }
    }
}
