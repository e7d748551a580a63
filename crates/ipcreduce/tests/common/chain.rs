//! Stale-data chains: `x <- all_reduce(x)` over and over on one buffer, in place, without
//! synchronizing between calls, with a different count (a prefix of the buffer) and algorithm
//! at each step. A call that read a peer's previous data (a stale slot, a flag left by an
//! earlier call) gives a value off by a factor of the world size, so every element of every
//! step is checked exactly.
//!
//! Rank r starts with `f(r, i) = (r + i) % 3 + 1`. An element reduced `m` times holds
//! `world^(m-1) * sum_r f(r, i)` on every rank (its own `f(r, i)` while `m == 0`). The chains
//! are short enough for every value to be exact in its dtype (checked, not assumed).

use ipcreduce::element::{load_f64, store_f64};
use ipcreduce::{Algorithm, DType};

/// One call of a chain: all-reduce the first `count` elements with `algo`.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    pub count: usize,
    pub algo: Algorithm,
}

/// Steps a chain of `dtype` at `world` ranks may have, so that every value stays exact and in
/// range: after m steps an element is at most 3 * world^m, and f16 ends at 65504.
pub fn max_steps(dtype: DType, world: usize) -> usize {
    match dtype {
        DType::F32 => 10,
        DType::F16 => (1..=6usize)
            .take_while(|m| 3.0 * (world as f64).powi(*m as i32) <= 65504.0)
            .last()
            .unwrap_or(1),
        _ => 4,
    }
}

/// A deterministic chain over a buffer of `len` elements: counts jump between the whole
/// buffer, tiny prefixes and odd middles (a small call right after a large one is where a
/// stale line shows), algorithms cycle through `algos`.
pub fn steps(len: usize, n: usize, algos: &[Algorithm]) -> Vec<Step> {
    let shapes = [
        len,
        1,
        len / 2 + 3,
        7,
        len,
        (len / 3).max(1),
        2,
        len - len / 5,
    ];
    (0..n)
        .map(|k| Step {
            count: shapes[k % shapes.len()].clamp(1, len),
            algo: algos[k % algos.len()],
        })
        .collect()
}

fn f(rank: usize, i: usize) -> f64 {
    ((rank + i) % 3 + 1) as f64
}

/// Rank `rank`'s starting buffer of `len` elements.
pub fn input(dtype: DType, rank: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len * dtype.size()];
    for i in 0..len {
        store_f64(dtype, &mut out, i, f(rank, i));
    }
    out
}

/// What every element must hold after the steps so far.
pub struct Expect {
    dtype: DType,
    world: usize,
    rank: usize,
    /// Times each element was reduced.
    reduced: Vec<u32>,
}

impl Expect {
    pub fn new(dtype: DType, world: usize, rank: usize, len: usize) -> Expect {
        Expect {
            dtype,
            world,
            rank,
            reduced: vec![0; len],
        }
    }

    /// Records one step.
    pub fn apply(&mut self, step: &Step) {
        for m in &mut self.reduced[..step.count] {
            *m += 1;
        }
    }

    fn value(&self, i: usize) -> f64 {
        match self.reduced[i] {
            0 => f(self.rank, i),
            m => {
                let sum: f64 = (0..self.world).map(|r| f(r, i)).sum();
                (self.world as f64).powi(m as i32 - 1) * sum
            }
        }
    }

    /// The whole buffer as it must be now, with the first `poison` elements zero instead
    /// (a value no chain element ever holds: every one is at least 1).
    pub fn bytes(&self, poison: usize) -> Vec<u8> {
        let mut out = vec![0u8; self.reduced.len() * self.dtype.size()];
        for i in poison..self.reduced.len() {
            store_f64(self.dtype, &mut out, i, self.value(i));
        }
        out
    }

    /// `Err` names the first wrong element (and how many are wrong).
    pub fn check(&self, got: &[u8], what: &str) -> Result<(), String> {
        let size = self.dtype.size();
        assert_eq!(
            got.len(),
            self.reduced.len() * size,
            "{what}: buffer length"
        );
        let mut want = vec![0u8; size];
        let mut first = None;
        let mut wrong = 0usize;
        for i in 0..self.reduced.len() {
            let v = self.value(i);
            store_f64(self.dtype, &mut want, 0, v);
            assert_eq!(
                load_f64(self.dtype, &want, 0),
                v,
                "{what}: the chain is too long for {} (value {v} is not exact)",
                self.dtype
            );
            if got[i * size..(i + 1) * size] != want[..] {
                wrong += 1;
                first.get_or_insert((i, v, load_f64(self.dtype, got, i)));
            }
        }
        match first {
            None => Ok(()),
            Some((i, v, g)) => Err(format!(
                "{what}: {wrong} wrong elements; first: element {i} is {g}, want {v} \
                 (reduced {} times)",
                self.reduced[i]
            )),
        }
    }
}
