//! The stamp every rank writes next to its ready flag: the call's arguments, compared by
//! each peer before it touches the data, so mismatched calls fail instead of reading garbage
//! or out of bounds.

use super::arena::ReadyLine;
use crate::backend::SgOp;
use crate::fused::{self, Shape};
use crate::types::{Algorithm, DType, ReduceOp};
use std::sync::atomic::Ordering;

/// The arguments of a call as every rank stamps them next to its ready flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stamp {
    pub(super) seq: u64,
    pub(super) count: u64,
    /// dtype | op << 8 | algo << 16 | operation << 24.
    pub(super) codes: u32,
    /// [`IN_PLACE`] | (1 + offset in the owner's arena of the call's input, when it lies in
    /// the symmetric heap; 0 when it does not). The identity epoch of a fused call holds its
    /// shape here instead (`fused.rs`).
    pub(super) place: u64,
}

/// `Stamp::place` bit of an in-place call.
const IN_PLACE: u64 = 1 << 63;

impl Stamp {
    pub fn new(seq: u64, count: usize, dtype: DType, op: ReduceOp, algo: Algorithm) -> Stamp {
        Stamp {
            seq,
            count: count as u64,
            codes: dtype.code() | op.code() << 8 | algo.code() << 16,
            place: 0,
        }
    }

    /// The stamp of the all-reduce that runs `what` (reduce-scatter and all-gather run one).
    pub fn of(mut self, what: SgOp) -> Stamp {
        self.codes |= what.code() << 24;
        self
    }

    /// The stamp of a call in place or not whose input lies at `heap` (its offset in the
    /// owner's arena) when it lies in the symmetric heap. Ranks must agree on both, as on a
    /// registered buffer's offset on cuda: heap buffers are allocated like a collective, so a
    /// rank whose input lies elsewhere is running another call than its peers.
    pub fn placed(mut self, in_place: bool, heap: Option<usize>) -> Stamp {
        self.place = heap.map_or(0, |h| (1 + h as u64) & !IN_PLACE);
        if in_place {
            self.place |= IN_PLACE;
        }
        self
    }
    /// Reads a peer's stamp (after acquiring its epoch, which orders these loads).
    pub fn read(line: &ReadyLine) -> Stamp {
        Stamp {
            seq: line.seq.load(Ordering::Relaxed),
            count: line.count.load(Ordering::Relaxed),
            codes: line.codes.load(Ordering::Relaxed),
            place: line.place.load(Ordering::Relaxed),
        }
    }

    /// Writes our stamp (before the epoch's release store, which publishes it).
    pub fn write(&self, line: &ReadyLine) {
        line.seq.store(self.seq, Ordering::Relaxed);
        line.count.store(self.count, Ordering::Relaxed);
        line.codes.store(self.codes, Ordering::Relaxed);
        line.place.store(self.place, Ordering::Relaxed);
    }

    /// What differs, in words ("count 100 vs 200").
    pub fn diff(&self, peer: &Stamp) -> String {
        if let Some(d) = fused_diff(self, peer) {
            return d;
        }
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
        if (self.place ^ peer.place) & IN_PLACE != 0 {
            parts.push(format!(
                "{} vs {}",
                in_place_name(self.place),
                in_place_name(peer.place)
            ));
        }
        let (a, b) = (self.place & !IN_PLACE, peer.place & !IN_PLACE);
        if a != b {
            parts.push(format!("input {} vs {}", heap_name(a), heap_name(b)));
        }
        parts.join(", ")
    }

    /// The call in words ("all_reduce #3 of 100 float, sum, oneshot, out of place"), for
    /// errors that name both ranks' calls.
    pub fn describe(&self) -> String {
        if let Some(d) = fused_describe(self) {
            return d;
        }
        let name = |field| code_name(self.codes, field);
        let mut s = format!(
            "{} #{} of {} {}, {}, {}, {}",
            name(3),
            self.seq,
            self.count,
            name(0),
            name(1),
            name(2),
            in_place_name(self.place)
        );
        let heap = self.place & !IN_PLACE;
        if heap != 0 {
            s.push_str(&format!(", input {}", heap_name(heap)));
        }
        s
    }
}

fn in_place_name(place: u64) -> &'static str {
    if place & IN_PLACE != 0 {
        "in place"
    } else {
        "out of place"
    }
}

/// Where the input lies, from a `place` without its in-place bit.
fn heap_name(heap: u64) -> String {
    match heap {
        0 => "not in the arena".into(),
        h => format!("in the arena at offset {}", h - 1),
    }
}

/// Name of byte `field` of a codes word (0 dtype, 1 op, 2 algorithm, 3 operation).
pub(super) fn code_name(codes: u32, field: u32) -> String {
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

/// `Stamp::place` bit of a fused call's identity epoch (an all-reduce's place never has it:
/// arena offsets stay far below 2^62).
const FUSED_IDENT: u64 = 1 << 62;
const TOKENS_MAX: u64 = (1 << 24) - 1;

/// The stamp of a fused call's identity epoch (fused.rs), which holds what the all-reduce's
/// stamps cannot: `count` = hidden, `place` = [`FUSED_IDENT`] | output flags << 56 | tokens
/// (24 bits, saturated) << 32 | eps bits. Tokens beyond 2^24 - 1 are still compared, through
/// the all-reduce's count (tokens x hidden, with hidden equal).
pub(super) fn fused_ident(seq: u64, s: &Shape, dtype: DType, algo: Algorithm) -> Stamp {
    let mut st = Stamp::new(seq, s.hidden, dtype, ReduceOp::Sum, algo).of(SgOp::AddRmsNorm);
    let flags = s.fp8 as u64 | (s.out_in_place as u64) << 1 | (s.residual_in_place as u64) << 2;
    st.place =
        FUSED_IDENT | flags << 56 | (s.tokens as u64).min(TOKENS_MAX) << 32 | s.eps_bits as u64;
    st
}

/// The shape an identity stamp holds (tokens saturated at 2^24 - 1), or None for any other.
fn shape_of(st: &Stamp) -> Option<Shape> {
    (st.place & FUSED_IDENT != 0).then(|| {
        let flags = st.place >> 56;
        Shape {
            tokens: ((st.place >> 32) & TOKENS_MAX) as usize,
            hidden: st.count as usize,
            eps_bits: st.place as u32,
            fp8: flags & 1 != 0,
            out_in_place: flags & 2 != 0,
            residual_in_place: flags & 4 != 0,
        }
    })
}

/// [`Stamp::describe`] of a fused identity stamp.
fn fused_describe(st: &Stamp) -> Option<String> {
    let s = shape_of(st)?;
    let more = if s.tokens as u64 == TOKENS_MAX {
        " (or more tokens)"
    } else {
        ""
    };
    Some(format!(
        "{} #{} of {} {}{more}, {}",
        fused::NAME,
        st.seq,
        code_name(st.codes, 0),
        s.describe(),
        code_name(st.codes, 2)
    ))
}

/// [`Stamp::diff`] when either stamp is a fused identity stamp.
fn fused_diff(a: &Stamp, b: &Stamp) -> Option<String> {
    let (sa, sb) = (shape_of(a), shape_of(b));
    if sa.is_none() && sb.is_none() {
        return None;
    }
    let mut parts = Vec::new();
    if a.seq != b.seq {
        parts.push(format!("call #{} vs #{}", a.seq, b.seq));
    }
    for (field, what) in [(3, "operation"), (0, "dtype"), (2, "algorithm")] {
        let (x, y) = (code_name(a.codes, field), code_name(b.codes, field));
        if x != y {
            parts.push(format!("{what} {x} vs {y}"));
        }
    }
    match (sa, sb) {
        (Some(x), Some(y)) => parts.extend(x.differences(&y).into_iter().map(String::from)),
        _ if parts.is_empty() => parts.push("the call's step (ranks out of step)".into()),
        _ => {}
    }
    Some(parts.join(", "))
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

    #[test]
    fn diff_and_describe_name_the_placement() {
        let a = Stamp::new(3, 100, DType::F32, ReduceOp::Sum, Algorithm::OneShot);
        let plain = a.placed(false, None);
        let at = |off| a.placed(false, Some(off));
        assert_eq!(
            plain.diff(&a.placed(true, None)),
            "out of place vs in place"
        );
        assert_eq!(
            at(8192).diff(&at(12288)),
            "input in the arena at offset 8192 vs in the arena at offset 12288"
        );
        assert_eq!(
            at(0).diff(&plain),
            "input in the arena at offset 0 vs not in the arena"
        );
        assert_eq!(at(8192).diff(&at(8192)), "");
        assert_eq!(
            a.of(SgOp::AllGather).placed(true, Some(64)).describe(),
            "all_gather #3 of 100 float, sum, oneshot, in place, input in the arena at offset 64"
        );
        assert_eq!(
            plain.describe(),
            "all_reduce #3 of 100 float, sum, oneshot, out of place"
        );
    }
}
