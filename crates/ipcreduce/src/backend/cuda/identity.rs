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
mod tests {
    use super::*;

    fn ar(path: CudaPath, count: u64) -> CallIdentity {
        CallIdentity {
            op: SgOp::AllReduce,
            path,
            dtype: DType::F32,
            reduce: ReduceOp::Sum,
            count,
            in_place: false,
            send: None,
            recv: None,
            fused: None,
            origin: None,
        }
    }

    #[test]
    fn encode_decode_round_trip() {
        let mut cases = vec![
            ar(CudaPath::OneShotLl, 0),
            ar(CudaPath::TwoShotStaged, 1 << 40),
        ];
        for path in CudaPath::ALL {
            for op in SgOp::ALL {
                for dtype in DType::ALL {
                    cases.push(CallIdentity {
                        op,
                        path,
                        dtype,
                        reduce: ReduceOp::Min,
                        count: 123_456_789_012,
                        in_place: true,
                        send: Some(RegionAt {
                            id: 7,
                            offset: (5 << 32) + 4096,
                        }),
                        recv: path.registered().then_some(RegionAt { id: 0, offset: 0 }),
                        fused: None,
                        origin: None,
                    });
                }
            }
        }
        for fp8 in [false, true] {
            cases.push(CallIdentity {
                op: SgOp::AddRmsNorm,
                path: CudaPath::FusedOneShot,
                dtype: DType::Bf16,
                count: 32 * 8192,
                in_place: !fp8,
                fused: Some(FusedShape {
                    hidden: (3 << 32) + 8192,
                    eps_bits: 1e-6f32.to_bits(),
                    fp8,
                    residual_in_place: fp8,
                }),
                ..ar(CudaPath::OneShotLl, 0)
            });
        }
        // Every case again as captured, at the ends of the numbers' ranges.
        let captured: Vec<CallIdentity> = cases
            .iter()
            .zip(
                [(1, 0), (ORIGIN_WRAP - 1, ORIGIN_WRAP - 1), (2, 77)]
                    .iter()
                    .cycle(),
            )
            .map(|(id, &(graph, index))| id.issued(Some(Captured { graph, index })))
            .collect();
        cases.extend(captured);
        for id in cases {
            let w = id.encode();
            assert_eq!(CallIdentity::decode(&w), Some(id), "{w:?}");
            assert_ne!(id.digest(), 0);
        }
        assert_eq!(CallIdentity::decode(&[0; IDENT_WORDS]), None);
    }

    #[test]
    fn both_calls_are_described_in_words() {
        let reg = |id, offset| Some(RegionAt { id, offset });
        let mine = CallIdentity {
            path: CudaPath::OneShotRegDeep,
            count: 67_108_864,
            send: reg(2, 0),
            recv: reg(3, 0),
            ..ar(CudaPath::OneShotLl, 0)
        };
        let theirs = CallIdentity {
            op: SgOp::ReduceScatter,
            path: CudaPath::ReduceScatterReg,
            send: reg(2, 4096),
            recv: None,
            ..mine
        };
        let text = describe_mismatch(0, &mine, 1, Some(&theirs));
        assert_eq!(
            text,
            "rank 0: all-reduce oneshot-reg16 67108864 x float sum out of place, send region 2 +0, \
             recv region 3 +0; rank 1: reduce-scatter reduce-scatter-reg 67108864 x float sum out \
             of place, send region 2 +4096, recv not registered; they differ in operation, path, \
             send buffer, recv buffer"
        );
        let empty = CallIdentity {
            path: CudaPath::Empty,
            count: 0,
            ..ar(CudaPath::OneShotLl, 0)
        };
        let text = describe_mismatch(1, &empty, 0, Some(&ar(CudaPath::OneShotLl, 4096)));
        assert!(
            text.starts_with("rank 1: all-reduce empty 0 x float sum"),
            "{text}"
        );
        assert!(
            text.contains("rank 0: all-reduce oneshot-ll 4096 x float sum"),
            "{text}"
        );
        assert!(text.ends_with("they differ in path, count"), "{text}");
        let unknown = describe_mismatch(1, &empty, 0, None);
        assert!(unknown.contains("rank 0: another call"), "{unknown}");
    }

    #[test]
    fn fused_calls_name_their_shape_and_what_differs() {
        let shape = FusedShape {
            hidden: 4096,
            eps_bits: 1e-6f32.to_bits(),
            fp8: false,
            residual_in_place: true,
        };
        let mine = CallIdentity {
            op: SgOp::AddRmsNorm,
            path: CudaPath::FusedOneShot,
            dtype: DType::Bf16,
            count: 8 * 4096,
            fused: Some(shape),
            ..ar(CudaPath::OneShotLl, 0)
        };
        assert_eq!(
            mine.describe(),
            "all-reduce+add+rmsnorm fused-oneshot 8 x 4096 bfloat16, eps 1e-6, outputs out, \
             residual_out, out out of place, residual in place"
        );
        let other = |f: FusedShape, count| CallIdentity {
            fused: Some(f),
            count,
            ..mine
        };
        let d = |t: &CallIdentity| mine.differences(t);
        assert_eq!(d(&other(shape, 9 * 4096)), ["tokens"]);
        let wider = FusedShape {
            hidden: 8192,
            ..shape
        };
        assert_eq!(d(&other(wider, 4 * 8192)), ["hidden"]);
        assert_eq!(d(&other(wider, 8 * 8192)), ["tokens x hidden", "hidden"]);
        let eps = FusedShape {
            eps_bits: 1e-5f32.to_bits(),
            ..shape
        };
        assert_eq!(d(&other(eps, 8 * 4096)), ["eps"]);
        let fp8 = FusedShape { fp8: true, ..shape };
        assert_eq!(d(&other(fp8, 8 * 4096)), ["outputs"]);
        assert_ne!(mine.digest(), other(eps, 8 * 4096).digest());
        assert_ne!(mine.digest(), other(fp8, 8 * 4096).digest());
        // Against an all-reduce of the same count: the operation, the path and the shape.
        let ar = CallIdentity {
            count: 8 * 4096,
            dtype: DType::Bf16,
            ..ar(CudaPath::OneShotStaged, 0)
        };
        assert_eq!(d(&ar), ["operation", "path", "shape"]);
    }

    #[test]
    fn digests_and_flags_tell_calls_apart_and_are_never_zero() {
        let a = ar(CudaPath::OneShotLl, 100).digest();
        let b = ar(CudaPath::OneShotLl, 101).digest();
        assert_ne!(a, b);
        let mut seen = std::collections::HashSet::new();
        for d in [a, b, 0, 1, u64::MAX] {
            for call in (0..100_000u64).chain([u32::MAX as u64, u64::MAX]) {
                let f = ll_flag(d, call);
                assert_ne!(f, 0, "digest {d:#x} call {call}");
                if d == a {
                    seen.insert(f);
                }
            }
        }
        // Consecutive calls of one identity get different flags: 100,000 calls, 100,000 flags
        // (and the two far ones).
        assert!(seen.len() >= 100_000, "{}", seen.len());
        assert_ne!(ll_flag(a, 5), ll_flag(b, 5));
        // Identities that differ get different flags for the same call (the low words of
        // well-mixed digests): every count of one path, at one call number.
        let flags: std::collections::HashSet<u32> = (1..=10_000u64)
            .map(|n| ll_flag(ar(CudaPath::OneShotLl, n).digest(), 7))
            .collect();
        assert!(flags.len() >= 9_990, "{}", flags.len());
    }

    #[test]
    fn a_replay_against_an_eager_call_or_another_graph_is_a_difference_named_in_words() {
        let eager = ar(CudaPath::OneShotLl, 4096);
        let g1 = eager.issued(Some(Captured { graph: 1, index: 0 }));
        let g1_next = eager.issued(Some(Captured { graph: 1, index: 1 }));
        let g2 = eager.issued(Some(Captured { graph: 2, index: 0 }));
        // Every pair of different origins stamps differently, so the kernels see a mismatch.
        let all = [eager, g1, g1_next, g2];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a.digest(), b.digest(), "{a:?} {b:?}");
            }
        }
        assert_eq!(
            g1.differences(&eager),
            vec!["origin (eager call against CUDA graph replay)"]
        );
        assert_eq!(g1.differences(&g2), vec!["CUDA graph or call within it"]);
        assert_eq!(
            g1.differences(&g1_next),
            vec!["CUDA graph or call within it"]
        );
        assert!(g1.differences(&g1).is_empty());
        let msg = describe_mismatch(0, &g1, 1, Some(&eager));
        assert_eq!(
            msg,
            "rank 0: all-reduce oneshot-ll 4096 x float sum out of place, in CUDA graph 1 as its \
             call 0; rank 1: all-reduce oneshot-ll 4096 x float sum out of place; they differ in \
             origin (eager call against CUDA graph replay)"
        );
        // The numbers wrap instead of spilling into other fields.
        let wrapped = eager.issued(Some(Captured {
            graph: ORIGIN_WRAP + 3,
            index: 2 * ORIGIN_WRAP + 5,
        }));
        let back = CallIdentity::decode(&wrapped.encode()).unwrap();
        assert_eq!(back.origin, Some(Captured { graph: 3, index: 5 }));
        assert_eq!(
            CallIdentity {
                origin: None,
                ..back
            },
            eager
        );
    }
}
