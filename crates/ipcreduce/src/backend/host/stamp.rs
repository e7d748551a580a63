//! The stamp every rank writes next to its ready flag: the call's arguments, compared by
//! each peer before it touches the data, so mismatched calls fail instead of reading garbage
//! or out of bounds.

use super::arena::ReadyLine;
use crate::backend::SgOp;
use crate::types::{Algorithm, DType, ReduceOp};
use std::sync::atomic::Ordering;

/// The arguments of a call as every rank stamps them next to its ready flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stamp {
    seq: u64,
    count: u64,
    /// dtype | op << 8 | algo << 16 | operation << 24.
    codes: u32,
}

impl Stamp {
    pub fn new(seq: u64, count: usize, dtype: DType, op: ReduceOp, algo: Algorithm) -> Stamp {
        Stamp {
            seq,
            count: count as u64,
            codes: dtype.code() | op.code() << 8 | algo.code() << 16,
        }
    }

    /// The stamp of the all-reduce that runs `what` (reduce-scatter and all-gather run one).
    pub fn of(mut self, what: SgOp) -> Stamp {
        self.codes |= what.code() << 24;
        self
    }

    /// Reads a peer's stamp (after acquiring its epoch, which orders these loads).
    pub fn read(line: &ReadyLine) -> Stamp {
        Stamp {
            seq: line.seq.load(Ordering::Relaxed),
            count: line.count.load(Ordering::Relaxed),
            codes: line.codes.load(Ordering::Relaxed),
        }
    }

    /// Writes our stamp (before the epoch's release store, which publishes it).
    pub fn write(&self, line: &ReadyLine) {
        line.seq.store(self.seq, Ordering::Relaxed);
        line.count.store(self.count, Ordering::Relaxed);
        line.codes.store(self.codes, Ordering::Relaxed);
    }

    /// What differs, in words ("count 100 vs 200").
    pub fn diff(&self, peer: &Stamp) -> String {
        let mut parts = Vec::new();
        if self.seq != peer.seq {
            parts.push(format!("call #{} vs #{}", self.seq, peer.seq));
        }
        if self.count != peer.count {
            parts.push(format!("count {} vs {}", self.count, peer.count));
        }
        for (field, what) in [(3, "operation"), (0, "dtype"), (1, "op"), (2, "algorithm")] {
            let (a, b) = (code_name(self.codes, field), code_name(peer.codes, field));
            if a != b {
                parts.push(format!("{what} {a} vs {b}"));
            }
        }
        parts.join(", ")
    }
}

/// Name of byte `field` of a codes word (0 dtype, 1 op, 2 algorithm, 3 operation).
fn code_name(codes: u32, field: u32) -> String {
    let v = (codes >> (8 * field)) & 0xFF;
    let algos = [
        Algorithm::Auto,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::Nccl,
    ];
    let name = match field {
        0 => DType::ALL.iter().find(|d| d.code() == v).map(|d| d.name()),
        1 => ReduceOp::ALL
            .iter()
            .find(|o| o.code() == v)
            .map(|o| o.name()),
        3 => SgOp::ALL.iter().find(|o| o.code() == v).map(|o| o.name()),
        _ => algos.iter().find(|a| a.code() == v).map(|a| a.name()),
    };
    name.map_or_else(|| format!("code {v}"), str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_names_every_difference() {
        let a = Stamp::new(3, 100, DType::F32, ReduceOp::Sum, Algorithm::OneShot);
        let b = Stamp::new(4, 200, DType::Bf16, ReduceOp::Max, Algorithm::TwoShot);
        assert_eq!(
            a.diff(&b),
            "call #3 vs #4, count 100 vs 200, dtype float vs bfloat16, op sum vs max, \
             algorithm oneshot vs twoshot"
        );
        assert_eq!(a.diff(&a), "");
        let rs = a.of(SgOp::ReduceScatter);
        assert_eq!(a.diff(&rs), "operation all_reduce vs reduce_scatter");
    }
}
