//! The identity of one call: everything the ranks must agree on before any of them touches a
//! peer's data. It travels in the kernel's arguments as [`IDENT_WORDS`] words; the kernels
//! post it on every peer's identity board, compare its digest in the first barrier, derive the
//! LL lines' flag from it, and on a difference leave both ranks' words in the error record, so
//! the host names both calls in words (see kernels/prims.cuh).

use super::paths::CudaPath;
use crate::backend::SgOp;
use crate::types::{DType, ReduceOp};

/// Words of an encoded identity (`IDENT_WORDS` in kernels/prims.cuh).
pub const IDENT_WORDS: usize = 10;

/// Where a zero-copy call's buffer lies: registered region `id` (the same on every rank for
/// corresponding buffers), `offset` bytes into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionAt {
    pub id: u32,
    pub offset: u64,
}

/// What a fused all-reduce + residual add + RMSNorm call adds to the identity (its tokens are
/// `count / hidden`; `in_place` is `out == input`). Carried in the words of the registered
/// regions, which its (staged) path has none of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedShape {
    pub hidden: u64,
    pub eps_bits: u32,
    /// The FP8 output is written.
    pub fp8: bool,
    /// `residual_out == residual`.
    pub residual_in_place: bool,
}

/// Where a call was issued from: captured into a CUDA graph (a replay runs it), or eager when
/// None. Graphs are numbered per communicator in the order their first call of ours was
/// captured, calls in capture order within each; ranks that capture the same graphs number them
/// alike, so a replay meets the same call of the same graph on every peer, and a replay against
/// an eager call, or against another graph, is a mismatch instead of a pairing of unrelated
/// buffers. Both numbers are kept modulo [`ORIGIN_WRAP`] (12 bits each in the flags word).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Captured {
    /// The graph's number (1, 2, ...), mod [`ORIGIN_WRAP`].
    pub graph: u32,
    /// The call's index within its graph's capture (0, 1, ...), mod [`ORIGIN_WRAP`].
    pub index: u32,
}

/// Graph numbers and call indices wrap at this value.
pub const ORIGIN_WRAP: u32 = 1 << 12;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallIdentity {
    pub op: SgOp,
    pub path: CudaPath,
    pub dtype: DType,
    pub reduce: ReduceOp,
    /// Elements (all-reduce: of the message; reduce-scatter and all-gather: of the whole).
    pub count: u64,
    pub in_place: bool,
    /// Zero-copy calls: the registered regions of send and recv (None on the staged paths,
    /// whose buffers are private to each rank).
    pub send: Option<RegionAt>,
    pub recv: Option<RegionAt>,
    /// Fused calls: the shape, eps and outputs (then `send` and `recv` are None).
    pub fused: Option<FusedShape>,
    /// Captured into a CUDA graph (None: eager). The operations build their identity with
    /// None; the launcher stamps the origin of the call it issues ([`CallIdentity::issued`]).
    pub origin: Option<Captured>,
}

/// Flags-word bit of an identity that carries a [`FusedShape`].
const FLAG_FUSED: u32 = 1 << 3;
/// Flags-word bit of a captured call; its graph number is in bits 8-19, its index in 20-31.
const FLAG_CAPTURED: u32 = 1 << 4;
const ORIGIN_GRAPH_SHIFT: u32 = 8;
const ORIGIN_INDEX_SHIFT: u32 = 20;

fn op_code(op: SgOp) -> u32 {
    op.code() + 1
}

fn op_words(op: SgOp) -> &'static str {
    match op {
        SgOp::AllReduce => "all-reduce",
        SgOp::ReduceScatter => "reduce-scatter",
        SgOp::AllGather => "all-gather",
        SgOp::AddRmsNorm => "all-reduce+add+rmsnorm",
    }
}

impl CallIdentity {
    /// This identity as issued from `origin`.
    pub fn issued(&self, origin: Option<Captured>) -> CallIdentity {
        CallIdentity { origin, ..*self }
    }

    /// The words the kernels carry: {op | path << 8 | dtype << 16 | reduce op << 24, flags
    /// (in place, send registered, recv registered, fused, captured; the graph number and the
    /// call's index in it), count (2), send region, recv region, send offset (2), recv
    /// offset (2)}.
    pub fn encode(&self) -> [u32; IDENT_WORDS] {
        let region = |r: Option<RegionAt>| r.map_or((0, 0), |r| (r.id, r.offset));
        let (sid, soff) = region(self.send);
        let (rid, roff) = region(self.recv);
        let origin = self.origin.map_or(0, |o| {
            FLAG_CAPTURED
                | (o.graph % ORIGIN_WRAP) << ORIGIN_GRAPH_SHIFT
                | (o.index % ORIGIN_WRAP) << ORIGIN_INDEX_SHIFT
        });
        let flags = self.in_place as u32
            | (self.send.is_some() as u32) << 1
            | (self.recv.is_some() as u32) << 2
            | if self.fused.is_some() { FLAG_FUSED } else { 0 }
            | origin;
        let mut w = [
            op_code(self.op)
                | (self.path.code() & 0xFF) << 8
                | (self.dtype.code() & 0xFF) << 16
                | (self.reduce.code() & 0xFF) << 24,
            flags,
            self.count as u32,
            (self.count >> 32) as u32,
            sid,
            rid,
            soff as u32,
            (soff >> 32) as u32,
            roff as u32,
            (roff >> 32) as u32,
        ];
        if let Some(f) = self.fused {
            debug_assert!(self.send.is_none() && self.recv.is_none());
            w[4] = f.hidden as u32;
            w[5] = (f.hidden >> 32) as u32;
            w[6] = f.eps_bits;
            w[7] = f.fp8 as u32 | (f.residual_in_place as u32) << 1;
        }
        w
    }

    /// The identity of `w`, or None if a field holds no known value.
    pub fn decode(w: &[u32; IDENT_WORDS]) -> Option<CallIdentity> {
        let byte = |k: u32| (w[0] >> (8 * k)) & 0xFF;
        let op = SgOp::ALL.into_iter().find(|o| op_code(*o) == byte(0))?;
        let path = CudaPath::from_code(byte(1))?;
        let dtype = DType::ALL.into_iter().find(|d| d.code() == byte(2))?;
        let reduce = ReduceOp::ALL.into_iter().find(|o| o.code() == byte(3))?;
        let wide = |lo: usize| w[lo] as u64 | (w[lo + 1] as u64) << 32;
        let at = |bit: u32, id: u32, off: u64| {
            (w[1] & (1 << bit) != 0).then_some(RegionAt { id, offset: off })
        };
        let origin = (w[1] & FLAG_CAPTURED != 0).then(|| Captured {
            graph: (w[1] >> ORIGIN_GRAPH_SHIFT) % ORIGIN_WRAP,
            index: (w[1] >> ORIGIN_INDEX_SHIFT) % ORIGIN_WRAP,
        });
        if w[1] & FLAG_FUSED != 0 {
            return Some(CallIdentity {
                op,
                path,
                dtype,
                reduce,
                count: wide(2),
                in_place: w[1] & 1 != 0,
                send: None,
                recv: None,
                fused: Some(FusedShape {
                    hidden: wide(4),
                    eps_bits: w[6],
                    fp8: w[7] & 1 != 0,
                    residual_in_place: w[7] & 2 != 0,
                }),
                origin,
            });
        }
        Some(CallIdentity {
            op,
            path,
            dtype,
            reduce,
            count: wide(2),
            in_place: w[1] & 1 != 0,
            send: at(1, w[4], wide(6)),
            recv: at(2, w[5], wide(8)),
            fused: None,
            origin,
        })
    }

    /// 64-bit digest of the encoded words, never 0 (the barrier stamps and the LL flags).
    pub fn digest(&self) -> u64 {
        digest(&self.encode())
    }

    /// The call in words, e.g. "all-reduce oneshot-reg16 67108864 x float sum out of place,
    /// send region 2 +0, recv region 3 +0"; a captured call adds ", in CUDA graph 1 as its
    /// call 0" (the mismatch of a replay against an eager call names the origin).
    pub fn describe(&self) -> String {
        let what = self.describe_call();
        match self.origin {
            Some(o) => format!("{what}, in CUDA graph {} as its call {}", o.graph, o.index),
            None => what,
        }
    }

    fn describe_call(&self) -> String {
        let place = if self.in_place {
            "in place"
        } else {
            "out of place"
        };
        if let Some(f) = self.fused {
            let tokens = self.count.checked_div(f.hidden).unwrap_or(0);
            let residual = if f.residual_in_place {
                "in place"
            } else {
                "out of place"
            };
            let outputs = if f.fp8 {
                "out, residual_out, fp8_out"
            } else {
                "out, residual_out"
            };
            return format!(
                "{} {} {tokens} x {} {}, eps {:e}, outputs {outputs}, out {place}, residual \
                 {residual}",
                op_words(self.op),
                self.path.name(),
                f.hidden,
                self.dtype.name(),
                f32::from_bits(f.eps_bits)
            );
        }
        let mut s = format!(
            "{} {} {} x {} {} {place}",
            op_words(self.op),
            self.path.name(),
            self.count,
            self.dtype.name(),
            self.reduce.name()
        );
        for (what, r) in [("send", self.send), ("recv", self.recv)] {
            if let Some(r) = r {
                s += &format!(", {what} region {} +{}", r.id, r.offset);
            } else if self.path.registered() {
                s += &format!(", {what} not registered");
            }
        }
        s
    }

    /// The fields in which `self` and `other` differ, in words ("operation, count").
    pub fn differences(&self, other: &CallIdentity) -> Vec<&'static str> {
        let mut d = Vec::new();
        let mut check = |differs: bool, what| {
            if differs {
                d.push(what);
            }
        };
        check(self.op != other.op, "operation");
        check(self.path != other.path, "path");
        check(self.dtype != other.dtype, "dtype");
        check(self.reduce != other.reduce, "op");
        let (fa, fb) = (self.fused, other.fused);
        let both = fa.zip(fb);
        let count = match both {
            Some((a, b)) if a.hidden == b.hidden => "tokens",
            Some(_) => "tokens x hidden",
            None => "count",
        };
        check(self.count != other.count, count);
        if let Some((a, b)) = both {
            check(a.hidden != b.hidden, "hidden");
            check(a.eps_bits != b.eps_bits, "eps");
            check(a.fp8 != b.fp8, "outputs");
            check(
                a.residual_in_place != b.residual_in_place,
                "residual in place",
            );
        } else {
            check(fa.is_some() != fb.is_some(), "shape");
        }
        check(self.in_place != other.in_place, "in place");
        check(self.send != other.send, "send buffer");
        check(self.recv != other.recv, "recv buffer");
        check(
            self.origin.is_some() != other.origin.is_some(),
            "origin (eager call against CUDA graph replay)",
        );
        check(
            self.origin.is_some() && other.origin.is_some() && self.origin != other.origin,
            "CUDA graph or call within it",
        );
        d
    }
}

/// FNV-1a over the words, then a 64-bit finalizer; 0 becomes 1 (0 means "no stamp").
pub fn digest(w: &[u32; IDENT_WORDS]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in w {
        h ^= *x as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let h = mix64(h);
    if h == 0 {
        1
    } else {
        h
    }
}

/// splitmix64's finalizer.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The flag of an LL line of call number `call` with identity digest `digest` (`ll_flag` in
/// kernels/prims.cuh): never 0, which marks a line nobody wrote since its reader cleared it.
pub fn ll_flag(digest: u64, call: u64) -> u32 {
    (digest as u32).wrapping_add((call as u32).wrapping_mul(0x9E37_79B9)) | 1
}

/// The message of a mismatch between this rank's call and a peer's: both calls in full, then
/// what differs. `theirs` None: the peer's identity could not be read (only its digest
/// differed).
pub fn describe_mismatch(
    rank: usize,
    mine: &CallIdentity,
    peer: usize,
    theirs: Option<&CallIdentity>,
) -> String {
    match theirs {
        Some(t) => {
            let d = mine.differences(t);
            let what = if d.is_empty() {
                "the call number (ranks out of step)".to_string()
            } else {
                d.join(", ")
            };
            format!(
                "rank {rank}: {}; rank {peer}: {}; they differ in {what}",
                mine.describe(),
                t.describe()
            )
        }
        None => format!(
            "rank {rank}: {}; rank {peer}: another call (its identity was not readable in time)",
            mine.describe()
        ),
    }
}

#[cfg(test)]
#[path = "identity_tests.rs"]
mod tests;
