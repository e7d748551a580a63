//! Tests of identity.rs: the call identity's words, digest, origin and descriptions (no GPU).

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
