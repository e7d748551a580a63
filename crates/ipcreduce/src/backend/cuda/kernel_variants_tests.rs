//! Tests of kernel_variants.rs: groups and variants, keys, CUBINs (NVRTC, no GPU).

use super::*;

#[test]
fn every_path_has_one_group_and_every_kernel_one_variant() {
    for path in CudaPath::ALL {
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                let v = Variant::of(path, 4, dtype, op);
                let name = path.kernel_name(4, dtype, op);
                assert!(
                    v.kernels().iter().any(|(p, n)| *p == path && *n == name),
                    "{path:?} {dtype} {op}: {name} not in {v:?}"
                );
            }
        }
    }
    // All-gather reduces nothing: its max/min calls use the sum variant's kernel.
    assert_eq!(
        Variant::of(CudaPath::AllGatherReg, 2, DType::F16, ReduceOp::Max).op,
        ReduceOp::Sum
    );
    let rs_max = Variant::of(CudaPath::ReduceScatterReg, 2, DType::F16, ReduceOp::Max);
    assert!(rs_max.kernels().iter().all(|(p, _)| p.row().kernel.per_op));
    assert_eq!(Variant::classes(8), vec![2, 4, 8]);
    assert_eq!(Variant::classes(2), vec![2]);
    assert_eq!(Variant::classes(3), vec![2, 4]);
    // 7 groups x 9 (dtype, op) at two ranks, the copy-engine group only there, and the fused
    // group's 3 dtypes (sum only).
    assert_eq!(Variant::every(2).len(), 66);
    assert_eq!(Variant::every(8).len(), 57);
}

#[test]
fn the_key_follows_the_variant_and_the_target() {
    let t = Target {
        arch: "sm_90".into(),
        nvrtc: "13.0".into(),
        driver: 13000,
    };
    let v = Variant::of(CudaPath::OneShotLl, 2, DType::F32, ReduceOp::Sum);
    let k = key(v, &t);
    assert_eq!(k, key(v, &t.clone()));
    let other_op = Variant {
        op: ReduceOp::Max,
        ..v
    };
    let other_w = Variant { w: 4, ..v };
    let other_group = Variant {
        group: Group::Staged,
        ..v
    };
    for (what, k2) in [
        ("tracing", key(v.traced(true), &t)),
        ("op", key(other_op, &t)),
        ("world class", key(other_w, &t)),
        ("group", key(other_group, &t)),
        (
            "arch",
            key(
                v,
                &Target {
                    arch: "sm_80".into(),
                    ..t.clone()
                },
            ),
        ),
        (
            "nvrtc",
            key(
                v,
                &Target {
                    nvrtc: "12.9".into(),
                    ..t.clone()
                },
            ),
        ),
        (
            "driver",
            key(
                v,
                &Target {
                    driver: 12080,
                    ..t.clone()
                },
            ),
        ),
    ] {
        assert_ne!(k, k2, "the key ignores the {what}");
    }
}

/// A variant compiled to a CUBIN for sm_90 (NVRTC, no GPU): an ELF image holding exactly the
/// variant's entry points.
#[test]
fn a_variant_compiles_to_a_cubin_with_its_entry_points_only() {
    if !super::super::nvrtc_for_tests() {
        return;
    }
    let v = Variant::of(CudaPath::OneShotLl, 2, DType::Bf16, ReduceOp::Max);
    let t0 = std::time::Instant::now();
    let cubin = compile_cubin(v, "sm_90").unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{}: {} bytes in {:?}", v.label(), cubin.len(), t0.elapsed());
    assert_eq!(&cubin[..4], b"\x7fELF", "not an ELF image");
    let has = |name: &str| {
        cubin
            .windows(name.len() + 1)
            .any(|w| &w[..name.len()] == name.as_bytes() && w[name.len()] == 0)
    };
    assert!(has("ipcr_oneshotll_bf16_max"));
    assert!(
        !has("ipcr_oneshotll12_bf16_max"),
        "the 12-byte LL kernel is compiled apart"
    );
    assert!(
        !has("ipcr_oneshotll_bf16_sum"),
        "another op's kernel was emitted"
    );
    assert!(
        !has("ipcr_oneshot_w2_bf16_max"),
        "another group's kernel was emitted"
    );
    // Every group: its kernels, its extra entry points, nothing of another group.
    for group in Group::ALL {
        let v = Variant {
            group,
            w: 4,
            dtype: DType::F16,
            op: ReduceOp::Sum,
            trace: false,
        };
        let cubin = compile_cubin(v, "sm_90").unwrap_or_else(|e| panic!("{e}"));
        for (_, name) in v.kernels() {
            assert!(cubin_has(&cubin, &name), "{}: {name} missing", v.label());
        }
        for name in v.extra_kernels() {
            assert!(cubin_has(&cubin, name), "{}: {name} missing", v.label());
        }
        for other in Group::ALL.into_iter().filter(|g| *g != group) {
            for (_, name) in (Variant { group: other, ..v }).kernels() {
                assert!(!cubin_has(&cubin, &name), "{}: holds {name}", v.label());
            }
        }
        // The phase-stamp variant, which a traced communicator loads, compiles alike.
        if group.paths().any(CudaPath::phase_stamped) {
            let v = v.traced(true);
            let cubin = compile_cubin(v, "sm_90").unwrap_or_else(|e| panic!("{e}"));
            for (_, name) in v.kernels() {
                assert!(cubin_has(&cubin, &name), "{}: {name} missing", v.label());
            }
            for name in v.extra_kernels() {
                assert!(cubin_has(&cubin, name), "{}: {name} missing", v.label());
            }
        }
    }
    let sg_max = compile_cubin(
        Variant::of(CudaPath::ReduceScatterStaged, 4, DType::F16, ReduceOp::Max),
        "sm_90",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(cubin_has(&sg_max, "ipcr_reducescatter_w4_f16_max"));
    assert!(
        !cubin_has(&sg_max, "ipcr_allgather_f16"),
        "all-gather is in the sum variant"
    );
    // A virtual architecture has no CUBIN: refused with a message, not a crash.
    let e = compile_cubin(v, "compute_90").unwrap_err().to_string();
    assert!(e.contains("compute_90"), "{e}");
}

fn cubin_has(cubin: &[u8], name: &str) -> bool {
    cubin
        .windows(name.len() + 1)
        .any(|w| &w[..name.len()] == name.as_bytes() && w[name.len()] == 0)
}
