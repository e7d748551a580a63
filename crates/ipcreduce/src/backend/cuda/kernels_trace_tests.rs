//! The phase stamps (`-DIPCR_TRACE`, prims.cuh) against the kernels without them: off, the
//! stamps compile to nothing; on, the traced kernels fit the budgets the host plans with.

use super::*;
use crate::plan::CudaPath;
use crate::types::{DType, ReduceOp};

/// The kernel sources with every stamp statement (`TRACE_PHASE/BLOCK/PEER(...);`) removed.
fn sources_without_stamps() -> (String, usize) {
    let mut removed = 0;
    let text: String = all_sources()
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            let stamp = ["TRACE_PHASE(", "TRACE_BLOCK(", "TRACE_PEER("]
                .iter()
                .any(|m| t.starts_with(m))
                && t.contains(");");
            removed += stamp as usize;
            !stamp
        })
        .map(|l| format!("{l}\n"))
        .collect();
    (text, removed)
}

fn ptx(source: &str, w: usize, extra: &[&str]) -> String {
    let mut opts = allreduce_options(w);
    opts.extend(extra.iter().map(|o| o.to_string()));
    let opts: Vec<&str> = opts.iter().map(String::as_str).collect();
    compile_source("ipcreduce kernels", source, "sm_90", &opts)
        .unwrap_or_else(|e| panic!("{e}"))
        .to_src()
}

#[test]
fn untraced_kernels_are_the_kernels_without_stamps() {
    if !nvrtc_for_tests() {
        return;
    }
    let (bare, removed) = sources_without_stamps();
    // Start, end, reduce and peers in ll.cu, staged.cu and zerocopy.cu, and the barrier's.
    assert!(removed >= 20, "only {removed} stamp statements found");
    // (One world class: every compile of every kernel takes a minute on a busy machine.)
    {
        let w = 2;
        let off = ptx(&all_sources(), w, &[]);
        assert_eq!(
            off,
            ptx(&bare, w, &[]),
            "w{w}: the kernels without -DIPCR_TRACE differ from those without the stamps"
        );
        let on = ptx(&all_sources(), w, &["-DIPCR_TRACE"]);
        let timer = |p: &str| p.matches("%globaltimer").count();
        assert!(
            timer(&on) > timer(&off),
            "w{w}: the traced kernels read the clock no more often"
        );
    }
}

#[test]
fn traced_kernels_fit_their_register_budget() {
    if !nvrtc_for_tests() {
        return;
    }
    let mut over = Vec::new();
    // World class 4, where the plain kernels are tightest (64 registers, spills allowed in
    // the LL ones). Classes 2 and 8 keep the same registers (55-64, 122-128; ptxas for sm_90).
    {
        let w = 4;
        let off = resources("sm_90", w).unwrap_or_else(|e| panic!("{e}"));
        let on = resources_with("sm_90", w, &["-DIPCR_TRACE"]).unwrap_or_else(|e| panic!("{e}"));
        for path in [
            CudaPath::OneShotLl,
            CudaPath::OneShotLl12,
            CudaPath::OneShotStaged,
            CudaPath::TwoShotStaged,
            CudaPath::OneShotReg,
            CudaPath::TwoShotReg,
            CudaPath::OneShotRegDeep,
            CudaPath::TwoShotRegDeep,
            CudaPath::ReduceScatterStaged,
            CudaPath::ReduceScatterReg,
            CudaPath::AllGatherStaged,
            CudaPath::AllGatherReg,
            CudaPath::FusedOneShot,
            CudaPath::FusedTwoShot,
            CudaPath::FusedLl,
        ] {
            assert!(path.phase_stamped(), "{path:?} is not traced");
            for dtype in DType::ALL {
                let name = path.kernel_name(w, dtype, ReduceOp::Sum);
                let find = |all: &[Resources]| {
                    all.iter()
                        .find(|k| k.kernel == name)
                        .cloned()
                        .unwrap_or_else(|| panic!("{name} not in the ptxas log"))
                };
                let (a, b) = (find(&off), find(&on));
                eprintln!(
                    "w{w} {name}: {} -> {} registers, {} -> {} B spilled (traced)",
                    a.registers, b.registers, a.spill_bytes, b.spill_bytes
                );
                // The residency caps (residency.rs) hold for the traced kernels too: as many
                // blocks per SM, so within the same registers.
                let budget = if path.one_block_per_sm() { 128 } else { 64 };
                if b.registers > budget {
                    over.push(format!("{b:?} (budget {budget})"));
                }
                // The stamps' own registers (the ring's address, a time) spill where the
                // plain kernel is at its limit already (the staged and LL ones at 64): a
                // cost of tracing only, bounded here.
                if b.spill_bytes > a.spill_bytes + 128 {
                    over.push(format!("{b:?} spills more than {a:?}"));
                }
            }
        }
    }
    assert!(over.is_empty(), "{over:#?}");
}

#[test]
fn the_ring_layout_is_the_kernels() {
    use crate::flight::stamps;
    let define = |name: &str| -> usize {
        let line = PRIMS_SOURCE
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("{name} not in prims.cuh"));
        let v = line.split_whitespace().nth(2).unwrap();
        v.parse().unwrap_or_else(|_| panic!("{line}"))
    };
    assert_eq!(define("PH_CALLS"), stamps::CALLS);
    assert_eq!(define("PH_START"), stamps::START);
    assert_eq!(define("PH_REDUCE"), stamps::REDUCE);
    assert_eq!(define("PH_GATHER"), stamps::GATHER);
    assert_eq!(define("PH_END"), stamps::END);
    assert_eq!(define("PH_PEER"), stamps::PEER);
    assert_eq!(MAX_BLOCKS, stamps::BLOCKS);
    assert_eq!(MAX_RANKS, stamps::PEERS);
    assert!(
        stamps::CALLS.is_power_of_two(),
        "the kernels mask, not divide"
    );
}
