//! Tests of residency.rs: the CTA caps from the device, the MPS share and the loaded kernels (no GPU).

use super::*;

const H200: usize = 132;

fn room(
    device_sms: usize,
    usable: usize,
    sharing: usize,
    wide_per_sm: usize,
    deep_per_sm: usize,
) -> Room {
    let r = rank_sms(usable, device_sms, sharing);
    Room {
        wide: r * wide_per_sm,
        deep: r * deep_per_sm,
        device_sms,
        rank_sms: r,
        sharing,
    }
}

#[test]
fn the_drivers_affinity_limits_where_smaller() {
    assert_eq!(usable_sms(H200, None), H200);
    assert_eq!(usable_sms(H200, Some(40)), 40);
    assert_eq!(usable_sms(12, Some(40)), 12);
    // A MIG slice reports its own SM count as the device's.
    assert_eq!(usable_sms(16, Some(16)), 16);
    assert_eq!(usable_sms(H200, Some(0)), H200, "0 = not reported");
}

#[test]
fn ranks_sharing_a_gpu_split_its_sms() {
    assert_eq!(rank_sms(H200, H200, 1), H200);
    assert_eq!(rank_sms(H200, H200, 4), 33);
    assert_eq!(rank_sms(H200, H200, 8), 16);
    // Limited clients may all be placed on the same SMs: they split their share.
    assert_eq!(rank_sms(12, H200, 4), 3);
    assert_eq!(rank_sms(12, H200, 1), 12);
    assert_eq!(rank_sms(2, H200, 8), 0);
    assert_eq!(rank_sms(H200, 16, 32), 0);
    assert_eq!(rank_sms(200, H200, 2), 66, "no more than the device");
    assert_eq!(
        rank_sms(H200, H200, 0),
        H200,
        "no sharing count: the whole device"
    );
}

#[test]
fn a_gpu_of_its_own_keeps_the_policy_cap() {
    let c = caps(&room(H200, H200, 1, 2, 1), None, 64, 128).unwrap();
    assert_eq!(
        c,
        Caps {
            cap: 64,
            deep_cap: 64
        }
    );
}

#[test]
fn shared_and_limited_gpus_get_what_is_resident() {
    // Four ranks on an H200: 33 SMs each, 66 wide CTAs (policy 64), 33 deep.
    assert_eq!(
        caps(&room(H200, H200, 4, 2, 1), None, 64, 128).unwrap(),
        Caps {
            cap: 64,
            deep_cap: 33
        }
    );
    // Eight: 16 SMs each.
    assert_eq!(
        caps(&room(H200, H200, 8, 2, 1), None, 64, 128).unwrap(),
        Caps {
            cap: 32,
            deep_cap: 16
        }
    );
    // MPS at 10 % (12 SMs), eight ranks: every rank's blocks may land on the same 12 SMs,
    // so each holds one of them: 2 and 1.
    let r = room(H200, 12, 8, 2, 1);
    assert_eq!(
        caps(&r, None, 64, 128).unwrap(),
        Caps {
            cap: 2,
            deep_cap: 1
        }
    );
    // MPS at 10 %, four ranks: 3 SMs each, 6 and 3.
    let r = room(H200, 12, 4, 2, 1);
    assert_eq!(
        caps(&r, None, 64, 128).unwrap(),
        Caps {
            cap: 6,
            deep_cap: 3
        }
    );
    // MPS at 3 % (2 SMs): one rank 4 and 2; four ranks cannot all be resident there.
    let r = room(H200, 2, 1, 2, 1);
    assert_eq!(
        caps(&r, None, 64, 128).unwrap(),
        Caps {
            cap: 4,
            deep_cap: 2
        }
    );
    let r = room(H200, 2, 4, 2, 1);
    assert!(caps(&r, None, 64, 128).is_err());
    // A 16-SM MIG slice, two ranks.
    assert_eq!(
        caps(&room(16, 16, 2, 2, 1), None, 64, 128).unwrap(),
        Caps {
            cap: 16,
            deep_cap: 8
        }
    );
    // Kernels that fit fewer blocks per SM than their launch bounds promise shrink the cap.
    assert_eq!(
        caps(&room(H200, H200, 8, 1, 1), None, 64, 128).unwrap(),
        Caps {
            cap: 16,
            deep_cap: 16
        }
    );
}

#[test]
fn a_fixed_block_count_must_fit() {
    let r = room(H200, H200, 8, 2, 1);
    assert_eq!(
        caps(&r, Some(32), 64, 128).unwrap(),
        Caps {
            cap: 32,
            deep_cap: 16
        }
    );
    let e = caps(&r, Some(33), 64, 128).unwrap_err();
    assert!(e.contains("blocks 33") && e.contains("at most 32"), "{e}");
    assert!(e.contains("16 SMs of 132") && e.contains("8 ranks"), "{e}");
    // A GPU of its own: anything up to the kernels' maximum.
    let r = room(H200, H200, 1, 2, 1);
    assert_eq!(
        caps(&r, Some(128), 64, 128).unwrap(),
        Caps {
            cap: 128,
            deep_cap: 128
        }
    );
}

#[test]
fn no_room_is_an_error_not_a_hang() {
    let r = room(H200, 1, 8, 2, 1);
    let e = caps(&r, None, 64, 128).unwrap_err();
    assert!(
        e.contains("no kernel grid fits") && e.contains("0 SMs of 132"),
        "{e}"
    );
}

/// The promise of [`promised`] is the sources' launch bounds, and shared memory (which
/// could limit occupancy below them) is used only by the fused kernels, one `FusedShared` per
/// block: a segment of FUSED_THREADS x FUSED_SEG_PACKS 16-byte packs of the narrowest dtype as
/// f32, two rows' 256 lanes and rstd (a block's halves), which two blocks of an SM must fit well within its 228 KiB
/// ([`check_fits`] measures every kernel loaded anyway).
#[test]
fn the_promised_blocks_are_the_kernels_launch_bounds() {
    use crate::backend::cuda::kernels::KERNEL_SOURCES;
    let all: String = KERNEL_SOURCES.iter().map(|(_, s)| *s).collect();
    assert!(all.contains("__launch_bounds__(512, MIN_BLOCKS) NAME(const Args a)"));
    assert!(all.contains("__launch_bounds__(512, 2) NAME(const SgArgs g)"));
    let define = |src: &str, name: &str| -> usize {
        let at = src
            .find(&format!("#define {name} "))
            .unwrap_or_else(|| panic!("fused.cu defines {name}"));
        let rest = &src[at + name.len() + 9..];
        rest[..rest.find('\n').unwrap()].trim().parse().unwrap()
    };
    for (name, src) in KERNEL_SOURCES {
        let shared = src.matches("__shared__").count();
        if name == "fused.cu" || name == "fused_ll.cu" {
            assert_eq!(
                shared,
                src.matches("__shared__ FusedShared<D> sh;").count(),
                "{name}: shared memory beyond FusedShared limits occupancy too"
            );
            if name == "fused.cu" {
                assert!(src.contains(
                    "float seg[SEG];\n    float lanes[2][FUSED_LANES];\n    float rstd[2];\n"
                ));
                let elements =
                    define(src, "FUSED_THREADS") * define(src, "FUSED_SEG_PACKS") * 16 / 2;
                let bytes = 4 * (elements + 2 * define(src, "FUSED_LANES") + 2);
                assert!(
                    2 * bytes <= 64 << 10,
                    "two fused blocks take {} bytes",
                    2 * bytes
                );
            }
        } else {
            assert_eq!(shared, 0, "{name}: shared memory limits occupancy too");
        }
    }
    // ENTRY(MIN_BLOCKS, ...) of every entry point: 1 exactly for the deep kernels.
    let entries: Vec<&str> = all
        .match_indices("ENTRY(")
        .map(|(i, _)| &all[i..all.len().min(i + 40)])
        .filter(|e| e.starts_with("ENTRY(1,") || e.starts_with("ENTRY(2,"))
        .collect();
    assert!(entries.len() >= 8, "{entries:?}");
    for e in entries {
        let deep = e.contains("reg16");
        assert_eq!(e.starts_with("ENTRY(1,"), deep, "{e}");
        let min = if deep { 1 } else { 2 };
        assert_eq!(promised(deep), min, "{e}");
    }
    for p in crate::plan::CudaPath::ALL {
        let stem = p.row().kernel.stem;
        assert_eq!(p.one_block_per_sm(), stem.ends_with("16"), "{p:?}");
    }
}

#[test]
fn every_rank_takes_the_smallest_room() {
    let a = room(H200, H200, 4, 2, 1);
    let b = room(H200, 12, 4, 2, 1);
    let s = smallest(&[a, b, a]).unwrap();
    assert_eq!((s.wide, s.deep, s.rank_sms), (6, 3, 3));
    assert_eq!(Room::from_bytes(&b.to_bytes()), Some(b));
    assert_eq!(Room::from_bytes(&[0; 7]), None);
    assert_eq!(smallest(&[]), None);
}
