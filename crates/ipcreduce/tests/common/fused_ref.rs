//! The independent reference of the fused all-reduce + residual add + RMSNorm (tests/fused.rs
//! on the host backend, tests/gpu_fused.rs on cuda): the sum in rank order in f32, rounded with
//! the `half` crate, the sum of squares over the documented tree (256 strided lanes, fused
//! multiply-add, pairwise), FP8 by nearest search over every e4m3 code; and the exact f64
//! RMSNorm of `residual_out` that bounds it.

#![allow(dead_code)]

use half::{bf16, f16};
use ipcreduce::DType;
use std::ffi::c_void;

/// splitmix64: every rank generates every rank's data from the same seed.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Rounds an f32 to `dtype` and back (round to nearest even, by the `half` crate).
pub fn round(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::Bf16 => bf16::from_f32(x).to_f32(),
        other => unreachable!("{other}"),
    }
}

pub fn ulp(dtype: DType, x: f64) -> f64 {
    let mant = match dtype {
        DType::F32 => 23,
        DType::F16 => 10,
        DType::Bf16 => 7,
        other => unreachable!("{other}"),
    };
    let min_exp = match dtype {
        DType::F16 => -14,
        _ => -126,
    };
    let e = (x.abs().log2().floor() as i32).max(min_exp);
    2f64.powi(e - mant)
}

/// Every e4m3 code's value (0x7F and 0xFF are NaN).
pub fn e4m3_value(code: u8) -> f32 {
    let e = ((code >> 3) & 0xF) as i32;
    let m = (code & 7) as f32;
    let v = if e == 0 {
        m * 2f32.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    if code & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// e4m3 satfinite by search: the nearest finite code, ties to the even code.
pub fn e4m3_nearest(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(448.0) as f64;
    let mut best = 0u8;
    for code in 0u8..=0x7E {
        let (d, b) = (
            (e4m3_value(code) as f64 - a).abs(),
            (e4m3_value(best) as f64 - a).abs(),
        );
        if d < b || (d == b && code % 2 == 0) {
            best = code;
        }
    }
    sign | best
}

/// One call's inputs on every rank, and the expected outputs (values as f32 of the dtype).
/// Every rank passes its own residual, weight and fp8 scale (none equal to another rank's), so
/// a path that normalised a row with another rank's would differ from the reference.
pub struct Case {
    pub tokens: usize,
    pub hidden: usize,
    pub dtype: DType,
    pub eps: f32,
    /// Rank 0's fp8 scale (see [`Case::scale_of`]), or no fp8 output.
    pub scale: Option<f32>,
    /// inputs[q]: rank q's partial sums.
    pub inputs: Vec<Vec<f32>>,
    /// residuals[q], weights[q]: rank q's.
    pub residuals: Vec<Vec<f32>>,
    pub weights: Vec<Vec<f32>>,
}

pub struct Expected {
    pub residual_out: Vec<f32>,
    pub out: Vec<f32>,
    pub fp8: Vec<u8>,
}

impl Case {
    pub fn random(seed: u64, world: usize) -> Case {
        let mut g = Rng(seed);
        let dtype = [DType::F32, DType::F16, DType::Bf16][g.below(3)];
        let tokens = [1, 1, 2, 3, 5, 8, 17][g.below(7)];
        let hidden = [1, 3, 7, 15, 127, 255, 257, 300, 1000, 1001, 2048, 4099][g.below(12)];
        let eps = [0.0, 1e-6, 1e-5, 0.5][g.below(4)];
        let scale = [None, Some(0.01f32), Some(1.0)][g.below(3)];
        Case::with(seed, world, tokens, hidden, dtype, eps, scale)
    }

    pub fn with(
        seed: u64,
        world: usize,
        tokens: usize,
        hidden: usize,
        dtype: DType,
        eps: f32,
        scale: Option<f32>,
    ) -> Case {
        let mut g = Rng(seed ^ 0xF00D);
        let n = tokens * hidden;
        let mut gen = |lo, hi, n| -> Vec<f32> {
            (0..n)
                .map(|_| round(dtype, g.uniform(lo, hi) as f32))
                .collect()
        };
        let inputs = (0..world).map(|_| gen(-2.0, 2.0, n)).collect();
        let residuals = (0..world).map(|_| gen(-1.0, 1.0, n)).collect();
        let weights = (0..world).map(|_| gen(0.5, 1.5, hidden)).collect();
        Case {
            tokens,
            hidden,
            dtype,
            eps,
            scale,
            inputs,
            residuals,
            weights,
        }
    }

    /// Rank q's fp8 scale: rank 0's times 1 + q / 4 (every rank's another).
    pub fn scale_of(&self, rank: usize) -> Option<f32> {
        self.scale.map(|s| s * (1.0 + rank as f32 / 4.0))
    }

    /// Rank `rank`'s outputs: the all-reduced sum, then the add + norm with that rank's
    /// residual, weight and scale.
    pub fn expected(&self, rank: usize) -> Expected {
        let (residual, weight) = (&self.residuals[rank], &self.weights[rank]);
        let scale = self.scale_of(rank);
        let (h, d) = (self.hidden, self.dtype);
        let n = self.tokens * h;
        let mut e = Expected {
            residual_out: vec![0.0; n],
            out: vec![0.0; n],
            fp8: vec![0; n],
        };
        for t in 0..self.tokens {
            let row = t * h..(t + 1) * h;
            for i in row.clone() {
                let mut acc = self.inputs[0][i];
                for x in &self.inputs[1..] {
                    acc += x[i];
                }
                e.residual_out[i] = round(d, round(d, acc) + residual[i]);
            }
            let mut lanes = [0f32; 256];
            for (k, i) in row.clone().enumerate() {
                let r = e.residual_out[i];
                lanes[k % 256] = r.mul_add(r, lanes[k % 256]);
            }
            for half in [128, 64, 32, 16, 8, 4, 2, 1] {
                for j in 0..half {
                    lanes[j] += lanes[j + half];
                }
            }
            let rstd = 1.0 / (lanes[0] / h as f32 + self.eps).sqrt();
            // The exact RMSNorm of the rounded residual_out, for the 1-ulp bound.
            let ms: f64 = row
                .clone()
                .map(|i| (e.residual_out[i] as f64).powi(2))
                .sum::<f64>()
                / h as f64;
            let exact_rstd = 1.0 / (ms + self.eps as f64).sqrt();
            for (k, i) in row.enumerate() {
                let y = (e.residual_out[i] * rstd) * weight[k];
                e.out[i] = round(d, y);
                if let Some(s) = scale {
                    e.fp8[i] = e4m3_nearest(y / s);
                }
                let exact = e.residual_out[i] as f64 * exact_rstd * weight[k] as f64;
                // Half types: 1 ulp (the rounding, plus f32 errors far below it); f32: the
                // f32 errors themselves (sequential lanes of up to 17 terms, 8 tree levels).
                let tol = ulp(d, exact) + 4e-6 * exact.abs();
                assert!(
                    !exact.is_finite() || (e.out[i] as f64 - exact).abs() <= tol,
                    "reference out {} vs exact {exact} at {i} ({h} wide, {d})",
                    e.out[i]
                );
            }
        }
        e
    }
}

/// A tensor in memory of the dtype, aligned for any element.
pub struct Tensor {
    pub words: Vec<u64>,
    pub dtype: DType,
    pub len: usize,
}

impl Tensor {
    pub fn new(dtype: DType, values: &[f32]) -> Tensor {
        let mut t = Tensor {
            words: vec![0; (values.len() * dtype.size()).div_ceil(8).max(1)],
            dtype,
            len: values.len(),
        };
        for (i, v) in values.iter().enumerate() {
            t.set(i, *v);
        }
        t
    }
    pub fn bytes(&mut self) -> &mut [u8] {
        let n = self.len * self.dtype.size();
        // SAFETY: words hold at least n bytes.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), n) }
    }
    pub fn set(&mut self, i: usize, v: f32) {
        let d = self.dtype;
        let b = self.bytes();
        match d {
            DType::F32 => b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
            DType::F16 => b[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
            DType::Bf16 => b[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
            other => unreachable!("{other}"),
        }
    }
    pub fn get(&mut self, i: usize) -> f32 {
        let d = self.dtype;
        let b = self.bytes();
        match d {
            DType::F32 => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
            DType::F16 => f16::from_le_bytes(b[2 * i..2 * i + 2].try_into().unwrap()).to_f32(),
            DType::Bf16 => bf16::from_le_bytes(b[2 * i..2 * i + 2].try_into().unwrap()).to_f32(),
            other => unreachable!("{other}"),
        }
    }
    pub fn ptr(&mut self) -> *mut c_void {
        self.words.as_mut_ptr().cast()
    }
}
