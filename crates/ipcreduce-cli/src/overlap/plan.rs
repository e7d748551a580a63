//! What the options ask for: the buckets of the gradients and the algorithms, and the
//! summaries of step times.

use super::*;

/// One bucket of the gradients: bytes `[offset, offset + bytes)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Bucket {
    pub offset: usize,
    pub bytes: usize,
}

/// Splits `total` bytes into buckets of `bucket` bytes rounded down to a multiple of `elem`
/// (so every bucket starts on an element), the last one holding the rest.
pub fn buckets(total: usize, bucket: usize, elem: usize) -> Result<Vec<Bucket>, String> {
    if elem == 0 {
        return Err("element size 0".into());
    }
    if total == 0 || !total.is_multiple_of(elem) {
        return Err(format!(
            "--grad-bytes {total} must be a positive multiple of the {elem}-byte element"
        ));
    }
    let bucket = bucket / elem * elem;
    if bucket == 0 {
        return Err(format!(
            "--bucket-bytes must hold at least one {elem}-byte element"
        ));
    }
    let n = total.div_ceil(bucket);
    if n > MAX_BUCKETS {
        return Err(format!(
            "{total} bytes in buckets of {bucket} make {n} buckets (at most {MAX_BUCKETS})"
        ));
    }
    Ok((0..n)
        .map(|k| {
            let offset = k * bucket;
            Bucket {
                offset,
                bytes: bucket.min(total - offset),
            }
        })
        .collect())
}

/// Summary of a series of step times (milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Stats {
    pub mean: f64,
    pub median: f64,
    /// Nearest-rank 99th percentile: the smallest value with at least 99% of the series at or
    /// below it.
    pub p99: f64,
    pub min: f64,
    pub max: f64,
    /// Population standard deviation (divides by n): the spread of these steps, not an
    /// estimate for other runs.
    pub stddev: f64,
}

impl Stats {
    /// None for an empty series.
    pub fn of(values: &[f64]) -> Option<Stats> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let mean = v.iter().sum::<f64>() / n as f64;
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        // ceil(0.99 n) in integers, so 100 values give index 98, not a float-rounded 99.
        let p99 = v[(99 * n).div_ceil(100).clamp(1, n) - 1];
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        Some(Stats {
            mean,
            median,
            p99,
            min: v[0],
            max: v[n - 1],
            stddev: var.sqrt(),
        })
    }
}

/// For each step, the slowest rank's time: a data-parallel step is as slow as its slowest
/// rank. Series of different lengths are cut to the shortest.
pub fn slowest_per_step(per_rank: &[Vec<f64>]) -> Vec<f64> {
    let n = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (0..n)
        .map(|i| {
            per_rank
                .iter()
                .map(|r| r[i])
                .fold(f64::NEG_INFINITY, f64::max)
        })
        .collect()
}

/// What the options ask for, validated before any rank starts.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) buckets: Vec<Bucket>,
    pub(super) algos: Vec<Algorithm>,
}

impl Plan {
    pub(super) fn new(args: &OverlapArgs) -> Result<Plan, String> {
        if args.steps == 0 || args.steps > MAX_STEPS {
            return Err(format!("--steps must be between 1 and {MAX_STEPS}"));
        }
        let buckets = buckets(args.grad_bytes, args.bucket_bytes, DTYPE.size())?;
        let mut algos = Vec::new();
        for a in &args.algos {
            if !algos.contains(a) {
                algos.push(*a);
            }
        }
        if algos.is_empty() {
            return Err("-a names no algorithm".into());
        }
        Ok(Plan { buckets, algos })
    }
}
