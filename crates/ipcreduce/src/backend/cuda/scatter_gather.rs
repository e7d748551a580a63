//! Reduce-scatter and all-gather through peer memory (kernels/scatter_gather.cu): the public
//! operations of their own, and the intra-node halves of the hierarchical all-reduce.
//!
//! A call is one kernel on the caller's stream, in order with the communicator's other calls,
//! with the all-reduce's protections: arguments stamped and compared in the first barrier
//! (a rank that called another operation, count, dtype or op fails with a mismatch), every
//! wait bounded, the abort flag polled. Plain buffers are staged through the workspace in
//! chunks; a registered send (or, for an in-place all-gather, a registered recv) is read where
//! it lies. Nothing is decided on the host between calls, so calls can be graph-captured.

use super::identity::CallIdentity;
use super::kernels::MAX_RANKS;
use super::launcher::{CallArgs, Kernel, KernelArgs, Launcher, THREADS};
use super::paths::CudaPath;
use super::registry::Registry;
use crate::backend::SgOp;
use crate::error::Result;
use crate::shards::Shards;

/// Kernel arguments; must match `struct SgArgs` in kernels/scatter_gather.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct SgKernelArgs {
    a: KernelArgs,
    total: u64,
    per: u64,
}

/// Bytes of send and recv of `what` over `shards` for `rank` (elements of `size` bytes).
pub(super) fn buffer_bytes(what: SgOp, shards: Shards, rank: usize, size: usize) -> (usize, usize) {
    let (whole, own) = (shards.total * size, shards.span(rank).len() * size);
    match what {
        SgOp::ReduceScatter => (whole, own),
        _ => (own, whole),
    }
}

/// Every rank's copy of the data this rank's kernel reads, when it lies in registered
/// buffers: reduce-scatter reads every rank's send (at the same offset on every rank);
/// all-gather reads every rank's own shard, from its send, or in place from its recv.
fn sources(
    l: &Launcher,
    registry: &Registry,
    what: SgOp,
    call: &CallArgs,
    shards: Shards,
) -> Option<[u64; MAX_RANKS]> {
    let (send, recv, size) = (call.send, call.recv, call.dtype.size());
    let mut out = [0u64; MAX_RANKS];
    let own = shards.span(l.rank);
    let in_place_ag = what == SgOp::AllGather && send == recv + (own.start * size) as u64;
    if in_place_ag {
        let (r, off) = registry.lookup(recv, shards.total * size)?;
        for (p, o) in out.iter_mut().enumerate().take(l.world) {
            *o = r.peers[p] + off + (shards.span(p).start * size) as u64;
        }
        return Some(out);
    }
    let bytes = match what {
        SgOp::ReduceScatter => shards.total * size,
        _ => own.len() * size,
    };
    let (r, off) = registry.lookup(send, bytes.max(1))?;
    for (p, o) in out.iter_mut().enumerate().take(l.world) {
        *o = r.peers[p] + off;
    }
    Some(out)
}

/// Enqueues one reduce-scatter (`call.send`: `shards.total` elements, `call.recv`: shard
/// `rank`'s) or all-gather (`call.send`: shard `rank`'s, `call.recv`: `shards.total`), a call
/// of its own (begun here). Arguments were checked by the caller (sizes, overlap, in-place
/// forms, device memory of our GPU).
pub(super) fn launch(
    l: &mut Launcher,
    registry: &Registry,
    what: SgOp,
    shards: Shards,
    call: &CallArgs,
) -> Result<()> {
    l.begin()?;
    let (send, recv, dtype, stream) = (call.send, call.recv, call.dtype, call.stream);
    if shards.total == 0 {
        return l.empty(what, dtype, call.op, stream);
    }
    let size = dtype.size();
    // Peer memory only: the host-staged transport has no registered buffers.
    let sources = Some(())
        .filter(|_| l.peer_memory)
        .and_then(|_| sources(l, registry, what, call, shards));
    let path = CudaPath::scatter_gather(what, sources.is_some());
    let grid = match l.limits.fixed {
        Some(f) => f,
        None => crate::plan::default_ctas(path, shards.total * size),
    }
    .clamp(1, l.limits.cap.max(1)) as u32;
    let op = path.effective_op(call.op);
    let f = l.function(path, dtype, op)?;
    l.took(path, grid);
    // Zero-copy: the memory the peers read, which must be the same region at the same
    // offset on every rank (they address it through their own mapping of our region):
    // reduce-scatter's send; all-gather's send, or in place the gather buffer (recv) whose
    // shard `rank` is the send. What only this rank writes (reduce-scatter's recv, an
    // out-of-place all-gather's recv) may lie anywhere: NCCL's in-place forms put it at a
    // different offset on every rank.
    let own = shards.span(l.rank).len() * size;
    let in_place = match what {
        SgOp::ReduceScatter => recv == send + (shards.span(l.rank).start * size) as u64,
        _ => send == recv + (shards.span(l.rank).start * size) as u64,
    };
    let registered = sources.is_some();
    let (read_send, read_recv) = match (what, in_place) {
        (SgOp::ReduceScatter, _) => (Some((send, shards.total * size)), None),
        (_, false) => (Some((send, own)), None),
        (_, true) => (None, Some((recv, shards.total * size))),
    };
    let at = |r: Option<(u64, usize)>| {
        r.filter(|_| registered)
            .and_then(|(p, b)| registry.region_at(p, b))
    };
    let ident = CallIdentity {
        op: what,
        path,
        dtype,
        reduce: op,
        count: shards.total as u64,
        in_place,
        send: at(read_send),
        recv: at(read_recv),
        fused: None,
        origin: None,
    };
    let whole = CallArgs {
        count: shards.total,
        ..*call
    };
    let mut a = l.kernel_args(&whole, &ident, None);
    if let Some(src) = sources {
        a.rsend = src;
        // Where the kernel reads: reduce-scatter every send at our shard, all-gather the
        // start of every rank's shard (already in `src`).
        let shift = match what {
            SgOp::ReduceScatter => (shards.span(l.rank).start * size) as u64,
            _ => 0,
        };
        a.aligned = src[..l.world].iter().all(|p| (p + shift) % 16 == 0) as i32;
    }
    let mut args = SgKernelArgs {
        a,
        total: shards.total as u64,
        per: shards.per as u64,
    };
    let k = Kernel {
        f,
        grid,
        threads: THREADS,
        stream,
    };
    l.launch(k, &mut args, || {
        format!(
            "launching the {} kernel ({} x {dtype}, {} per shard)",
            path.name(),
            shards.total,
            shards.per
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{DType, ReduceOp};

    /// The PTX's parameter must be exactly our struct's size, or the kernel reads garbage.
    #[test]
    fn sg_args_size_matches_the_ptx() {
        if !super::super::kernels::nvrtc_for_tests() {
            return;
        }
        let ptx = super::super::kernels::compile("sm_90", 4).unwrap().to_src();
        let want = format!("_param_0[{}]", std::mem::size_of::<SgKernelArgs>());
        for path in [
            CudaPath::ReduceScatterStaged,
            CudaPath::ReduceScatterReg,
            CudaPath::AllGatherStaged,
            CudaPath::AllGatherReg,
        ] {
            let name = path.kernel_name(4, DType::Bf16, ReduceOp::Max);
            let at = ptx
                .find(&format!(".entry {name}("))
                .unwrap_or_else(|| panic!("{name} missing"));
            let head = &ptx[at..at + 300.min(ptx.len() - at)];
            assert!(
                head.contains(&want),
                "{name}: parameter is not {want}: {head}"
            );
        }
    }
}
