//! All-reduce + residual add + RMSNorm (+ optional FP8 output) in one call: the end of every
//! tensor-parallel decoder layer.
//!
//! # Numerics (every backend, every path: bitwise the same)
//! Per element `i` of row `t` (`x_q` = rank q's input, `r` = residual, `w` = weight):
//! 1. `s = round(x_0 + x_1 + ... + x_{W-1})`: the sum in rank order 0..W-1 in f32, rounded
//!    once to the dtype (exactly the all-reduce's result);
//! 2. `residual_out = round(f32(s) + f32(r))`;
//! 3. the row's sum of squares of `f32(residual_out)` over the fixed tree of [`ss_tree`]:
//!    256 lanes, lane `j` accumulating elements `j, j + 256, ...` in increasing order with a
//!    fused multiply-add, then the lanes summed pairwise (lane `j` += lane `j + h` for
//!    h = 128, 64, ..., 1), all in f32;
//! 4. `mean = ss / hidden`, `rstd = 1 / sqrt(mean + eps)` (IEEE division and square root,
//!    both correctly rounded);
//! 5. `y = (f32(residual_out) * rstd) * f32(w)` in f32, `out = round(y)` (one rounding);
//! 6. `fp8_out = e4m3_satfinite(y / scale)` from the unrounded `y` (round to nearest even,
//!    saturated to +-448, NaN stays NaN).
//!
//! Rounding is to nearest even. Since every step is defined, the fused call equals the unfused
//! sequence (all-reduce, then the reference add + norm with the same tree) bit for bit.
//!
//! Each rank's `residual`, `weight` and fp8 scale are its own and need not match the other
//! ranks' (the shape, the eps bits and the outputs are what ranks must agree on): on every path a
//! rank's outputs are the all-reduced sum followed by the add + norm with its own. The
//! two-shot path moves the sums of each rank's rows once (each row summed by one rank, its sum
//! read by every rank) and every rank normalises every row.
//!
//! # Arguments
//! Pointers are aligned at least to their element (fp8: 1 byte, scale: 4 bytes); the cuda
//! kernels pick the widest vector every pointer and the row stride allow. `tokens` 0 is a call
//! like any other (its identity is compared; no buffer is touched). Aliasing: `out` may equal
//! `input` and `residual_out` may equal `residual` (in place, as inference servers call it);
//! any other overlap between the six buffers is refused (the kernels read a row's input and
//! residual and write its outputs in an order only those exact aliases survive).

use crate::error::{Error, Result};
use crate::plan::{self, Fabric};
use crate::types::{Algorithm, BackendKind, DType};
use std::ffi::c_void;

/// One fused call's tensors: rows = tokens, each `hidden` elements of `dtype` (bf16/f16/f32).
#[derive(Clone, Copy, Debug)]
pub struct AddRmsNorm {
    /// [tokens, hidden], this rank's partial sums.
    pub input: *const c_void,
    /// [tokens, hidden].
    pub residual: *const c_void,
    /// [hidden], same dtype.
    pub weight: *const c_void,
    /// [tokens, hidden]: the normalised rows.
    pub out: *mut c_void,
    /// [tokens, hidden]: rounded(sum) + residual, rounded.
    pub residual_out: *mut c_void,
    /// Null, or [tokens, hidden] e4m3 = sat(out_f32 / scale).
    pub fp8_out: *mut c_void,
    /// Null, or one f32 (device memory on cuda, host on host).
    pub fp8_scale: *const c_void,
    pub tokens: usize,
    pub hidden: usize,
    pub dtype: DType,
    pub eps: f32,
}

/// Lanes of the sum-of-squares tree (a power of two; the cuda kernels' threads per row).
pub const SS_LANES: usize = 256;

/// The operation's name in errors.
pub const NAME: &str = "all_reduce_add_rms_norm";

/// What every rank must agree on besides the dtype and the path: part of the call identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub tokens: usize,
    pub hidden: usize,
    pub eps_bits: u32,
    /// The FP8 output is written.
    pub fp8: bool,
    /// `out == input`.
    pub out_in_place: bool,
    /// `residual_out == residual`.
    pub residual_in_place: bool,
}

impl Shape {
    /// Elements of one [tokens, hidden] tensor.
    pub fn count(&self) -> usize {
        self.tokens * self.hidden
    }

    /// The outputs in words ("out, residual_out, fp8").
    pub fn outputs(&self) -> &'static str {
        if self.fp8 {
            "out, residual_out, fp8_out"
        } else {
            "out, residual_out"
        }
    }

    /// The shape in words, for mismatch errors.
    pub fn describe(&self) -> String {
        let place = |b: bool| if b { "in place" } else { "out of place" };
        format!(
            "{} x {}, eps {:e}, outputs {}, out {}, residual {}",
            self.tokens,
            self.hidden,
            f32::from_bits(self.eps_bits),
            self.outputs(),
            place(self.out_in_place),
            place(self.residual_in_place)
        )
    }

    /// The fields in which two shapes differ.
    pub fn differences(&self, other: &Shape) -> Vec<&'static str> {
        let mut d = Vec::new();
        for (differs, what) in [
            (self.tokens != other.tokens, "tokens"),
            (self.hidden != other.hidden, "hidden"),
            (self.eps_bits != other.eps_bits, "eps"),
            (self.fp8 != other.fp8, "outputs"),
            (self.out_in_place != other.out_in_place, "out in place"),
            (
                self.residual_in_place != other.residual_in_place,
                "residual in place",
            ),
        ] {
            if differs {
                d.push(what);
            }
        }
        d
    }
}

/// The algorithm a fused call of shape `s` (elements of `size` bytes) runs: `requested` unless
/// it is `Auto`, which the host backend resolves as it does the all-reduce (the same
/// all-reduce runs inside), and the cuda backend as `OneShot` at every size: on one H200 with
/// two and four ranks under MPS (2026-12-04, `fused-bench` with each path forced) the one-shot
/// kernel beat two-shot (1.01-3.43x its time) at every shape of hidden 4096-16384 x tokens
/// 1-512 (bench/results/2026-12-04-h200-mps-fused-paths/). `OneShot` takes the LL kernel for
/// short rows and small calls, where that was faster (backend/cuda/fused_path.rs `ll_auto`).
/// Two-shot stays for `TwoShot` and `IPCREDUCE_FUSED_PATH`, to be measured across GPUs. Every input
/// is part of the call's identity or agreed at init, so every rank chooses alike.
pub fn choose(
    requested: Algorithm,
    backend: BackendKind,
    fabric: Fabric,
    world: usize,
    s: &Shape,
    size: usize,
) -> Algorithm {
    let bytes = s.count() * size;
    match (requested, backend) {
        (Algorithm::Auto, BackendKind::Cuda) => Algorithm::OneShot,
        (Algorithm::Auto, _) => plan::choose(Algorithm::Auto, None, backend, fabric, world, bytes),
        (other, _) => other,
    }
}

/// Checks `a` on the calling rank (everything a rank can see alone) and returns its shape.
pub fn check(rank: usize, a: &AddRmsNorm) -> Result<Shape> {
    let bad = |detail: String| Err(Error::invalid(rank, NAME, detail));
    if a.eps.is_nan() || a.eps < 0.0 || a.eps.is_infinite() {
        return bad(format!("eps must be finite and >= 0, got {}", a.eps));
    }
    if a.hidden == 0 {
        return bad("hidden must be at least 1".into());
    }
    let size = a.dtype.size();
    let bytes = a
        .tokens
        .checked_mul(a.hidden)
        .and_then(|n| n.checked_mul(size))
        .filter(|b| *b <= isize::MAX as usize);
    let Some(bytes) = bytes else {
        return bad(format!(
            "tokens {} x hidden {} of {} overflows the address space",
            a.tokens, a.hidden, a.dtype
        ));
    };
    if a.fp8_out.is_null() != a.fp8_scale.is_null() {
        return bad("fp8_out and fp8_scale come together (both null or both set)".into());
    }
    let shape = Shape {
        tokens: a.tokens,
        hidden: a.hidden,
        eps_bits: a.eps.to_bits(),
        fp8: !a.fp8_out.is_null(),
        out_in_place: a.tokens > 0 && a.out.cast_const() == a.input,
        residual_in_place: a.tokens > 0 && a.residual_out.cast_const() == a.residual,
    };
    if a.tokens == 0 {
        // No buffer is touched: any pointers (null included) will do.
        return Ok(shape);
    }
    let elems = a.tokens * a.hidden;
    let mut bufs: Vec<(&str, usize, usize, usize)> = vec![
        ("input", a.input as usize, bytes, size),
        ("residual", a.residual as usize, bytes, size),
        ("weight", a.weight as usize, a.hidden * size, size),
        ("out", a.out as usize, bytes, size),
        ("residual_out", a.residual_out as usize, bytes, size),
    ];
    if shape.fp8 {
        bufs.push(("fp8_out", a.fp8_out as usize, elems, 1));
        bufs.push(("fp8_scale", a.fp8_scale as usize, 4, 4));
    }
    for &(name, p, _, align) in &bufs {
        if p == 0 {
            return bad(format!("{name} is a null pointer"));
        }
        if p % align != 0 {
            return bad(format!(
                "{name} ({p:#x}) is not aligned to its element size ({align} bytes)"
            ));
        }
    }
    let allowed = |x: &str, y: &str| {
        matches!(
            (x, y),
            ("input", "out")
                | ("out", "input")
                | ("residual", "residual_out")
                | ("residual_out", "residual")
        )
    };
    for (i, &(n1, p1, b1, _)) in bufs.iter().enumerate() {
        for &(n2, p2, b2, _) in &bufs[i + 1..] {
            let overlap = p1 < p2 + b2 && p2 < p1 + b1;
            if overlap && !(p1 == p2 && allowed(n1, n2)) {
                return bad(format!(
                    "{n1} and {n2} overlap (only out == input and residual_out == residual \
                     may alias)"
                ));
            }
        }
    }
    Ok(shape)
}

/// The sum-of-squares tree of the numerics above over the values `v` of one row (f32 of
/// `residual_out`): the reference every kernel reproduces.
pub fn ss_tree(v: impl IntoIterator<Item = f32>) -> f32 {
    let mut lanes = [0f32; SS_LANES];
    for (i, x) in v.into_iter().enumerate() {
        let l = &mut lanes[i % SS_LANES];
        *l = x.mul_add(x, *l);
    }
    let mut h = SS_LANES / 2;
    while h > 0 {
        for j in 0..h {
            lanes[j] += lanes[j + h];
        }
        h /= 2;
    }
    lanes[0]
}

/// `1 / sqrt(ss / hidden + eps)`, as the numerics define it.
pub fn rstd(ss: f32, hidden: usize, eps: f32) -> f32 {
    1.0 / (ss / hidden as f32 + eps).sqrt()
}

/// f32 -> FP8 e4m3 (OCP "fn": no infinities, one NaN pattern per sign), round to nearest even,
/// finite values saturated to +-448 (CUDA's `__NV_SATFINITE`); NaN gives 0x7F.
pub fn e4m3_satfinite(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7E;
    }
    // Subnormals of e4m3 are multiples of 2^-9; normals have 3 mantissa bits, exponent
    // bias 7 (smallest normal 2^-6).
    let bits = a.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32 - 127;
    let q = if exp < -6 {
        // Quantise to multiples of 2^-9 with ties to even (exact in f32: a * 512 < 64).
        let m = a * 512.0;
        let r = m.round_ties_even();
        r as u32 // 0..=8: 8 is the smallest normal (0x08), which the encoding gives as is
    } else {
        // Keep 3 mantissa bits: round the 23-bit mantissa to 3 with ties to even.
        let mant = bits & 0x7F_FFFF;
        let keep = mant >> 20;
        let rest = mant & 0xF_FFFF;
        let half = 0x8_0000;
        let up = rest > half || (rest == half && keep & 1 == 1);
        let e = (exp + 7) as u32;
        // A carry out of the mantissa bumps the exponent, which the plain add does.
        ((e << 3) | keep) + up as u32
    };
    // 448 = 0x7E is the largest finite; a round-up past it saturates.
    sign | q.min(0x7E) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_known_values() {
        // Values from the OCP FP8 specification's table for E4M3.
        let cases: [(f32, u8); 12] = [
            (0.0, 0x00),
            (-0.0, 0x80),
            (1.0, 0x38),
            (-2.0, 0xC0),
            (448.0, 0x7E),
            (1e9, 0x7E),
            (-1e9, 0xFE),
            (2f32.powi(-6), 0x08),
            (2f32.powi(-9), 0x01),
            (2f32.powi(-10), 0x00), // tie between 0 and 2^-9: to even (0)
            (3.0 * 2f32.powi(-10), 0x02), // tie between 1 and 2 ulps: to even (2)
            (1.0625, 0x38),         // tie between 1.0 and 1.125: to even (1.0)
        ];
        for (x, want) in cases {
            assert_eq!(e4m3_satfinite(x), want, "{x}");
        }
        assert_eq!(e4m3_satfinite(1.1875), 0x3A); // tie 1.125/1.25 -> 1.25 (even mantissa 2)
        assert_eq!(e4m3_satfinite(464.0), 0x7E); // rounds past 448: saturated
        assert_eq!(e4m3_satfinite(f32::NAN), 0x7F);
    }

    #[test]
    fn e4m3_round_trips_every_finite_code() {
        // Decode each code independently and check it encodes back to itself.
        for code in 0u8..=0x7E {
            let e = (code >> 3) as i32;
            let m = (code & 7) as f32;
            let v = if e == 0 {
                m * 2f32.powi(-9)
            } else {
                (1.0 + m / 8.0) * 2f32.powi(e - 7)
            };
            assert_eq!(e4m3_satfinite(v), code, "{v}");
            assert_eq!(e4m3_satfinite(-v), code | 0x80, "-{v}");
        }
    }

    #[test]
    fn auto_takes_one_shot_on_cuda_at_every_size() {
        let shape = |tokens, hidden| Shape {
            tokens,
            hidden,
            eps_bits: 0,
            fp8: false,
            out_in_place: false,
            residual_in_place: false,
        };
        let cuda = |world, s: &Shape| {
            choose(
                Algorithm::Auto,
                BackendKind::Cuda,
                Fabric::Peer,
                world,
                s,
                2,
            )
        };
        // From one row to 512 x 16384 bf16 (16 MiB), at every world size.
        for world in [1, 2, 4, 8] {
            for (tokens, hidden) in [(1, 7), (1, 4096), (128, 8192), (512, 16384)] {
                assert_eq!(
                    cuda(world, &shape(tokens, hidden)),
                    Algorithm::OneShot,
                    "{world} ranks, {tokens} x {hidden}"
                );
            }
        }
        // Requested algorithms stay; the host backend follows the all-reduce's rule.
        for a in [Algorithm::OneShot, Algorithm::TwoShot] {
            assert_eq!(
                choose(a, BackendKind::Cuda, Fabric::Peer, 2, &shape(1, 8), 2),
                a
            );
        }
        let host = |world, s: &Shape| {
            choose(
                Algorithm::Auto,
                BackendKind::Host,
                Fabric::Peer,
                world,
                s,
                2,
            )
        };
        let s = shape(512, 4096);
        assert_eq!(
            host(2, &s),
            plan::choose(
                Algorithm::Auto,
                None,
                BackendKind::Host,
                Fabric::Peer,
                2,
                4 << 20
            )
        );
    }

    #[test]
    fn ss_tree_is_the_pairwise_sum_of_strided_lanes() {
        // 512 ones: every lane holds 2, the tree adds 256 of them exactly.
        assert_eq!(ss_tree(std::iter::repeat_n(1.0, 512)), 512.0);
        assert_eq!(ss_tree([3.0]), 9.0);
        assert_eq!(rstd(4.0, 1, 0.0), 0.5);
    }
}
