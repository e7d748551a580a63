//! The all-reduce within one node: the path for the call's size and buffers (plan::cuda_path,
//! with the agreed limits and the tuning table), its identity, and one kernel through the
//! launcher, or the copy-engine pipeline (ce.rs) for large registered calls of two ranks.
//!
//! NCCL, count-0 calls and jobs across nodes are told apart before this (ops.rs).

use super::ce;
use super::identity::{CallIdentity, RegionAt};
use super::launcher::{CallArgs, Kernel, Launcher, THREADS};
use super::paths::CudaPath;
use super::registry::Registry;
use crate::backend::SgOp;
use crate::error::Result;
use crate::plan::Fabric;
use crate::types::Algorithm;

/// Enqueues the all-reduce `call` with algorithm `algo` (a begun call of at least one
/// element, see [`Launcher::begin`]).
pub(super) fn launch(
    l: &mut Launcher,
    registry: &Registry,
    engine: &mut ce::Engine,
    call: &CallArgs,
    algo: Algorithm,
) -> Result<()> {
    let (send, recv, count) = (call.send, call.recv, call.count);
    let (dtype, op) = (call.dtype, call.op);
    let bytes = call.bytes();
    let zero_copy = registry.peers_of(send, recv, bytes, l.world);
    // The tuned CTA count of the row for this size, when the call runs that row's algorithm
    // (on peer memory: tables are not measured staged through host memory, which has its own
    // measured rule; the staged paths take it, the LL one keeps its own rule below it).
    let tuned = match l.fabric {
        Fabric::HostStaged => Some(crate::plan::host_staged_ctas(bytes)),
        _ => Some(&l.tune)
            .and_then(|t| t.lookup(l.world, dtype.size(), bytes))
            .filter(|e| e.algorithm() == Some(algo))
            .and_then(|e| e.ctas)
            .map(|c| c as usize),
    };
    let (path, grid) = crate::plan::cuda_path(
        algo,
        bytes,
        zero_copy.is_some(),
        send == recv,
        &l.limits,
        tuned,
    );
    let f = l.function(path, dtype, op)?;
    l.took(path, grid);
    let zero_copy = zero_copy.filter(|_| path.registered());
    let registered =
        |ptr| -> Option<RegionAt> { zero_copy.and_then(|_| registry.region_at(ptr, bytes)) };
    let ident = CallIdentity {
        op: SgOp::AllReduce,
        path,
        dtype,
        reduce: op,
        count: count as u64,
        in_place: send == recv,
        send: registered(send),
        recv: registered(recv),
        fused: None,
        origin: None,
    };
    let mut args = l.kernel_args(call, &ident, zero_copy);
    let knobs = l.limits.staged;
    args.chunk_bytes =
        crate::plan::staged_chunk_bytes(l.fabric, bytes, l.slot_bytes, knobs.chunk) as u64;
    args.mode |=
        (crate::plan::staged_round(l.fabric, knobs.round) << crate::plan::MODE_ROUND_SHIFT) as i32;
    if path == CudaPath::Ce {
        let lanes = engine.lanes(l.rank)?;
        return ce::launch(l, lanes, &args, call, grid);
    }
    let threads = crate::plan::block_threads(path, bytes, grid, THREADS);
    let k = Kernel {
        f,
        grid,
        threads,
        stream: call.stream,
    };
    l.launch(k, &mut args, || {
        format!(
            "launching the {} kernel ({count} x {dtype} {op})",
            path.name()
        )
    })
}
