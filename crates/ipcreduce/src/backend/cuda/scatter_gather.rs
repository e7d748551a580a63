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
use super::paths::CudaPath;
use super::{CudaComm, KernelArgs, THREADS};
use crate::backend::SgOp;
use crate::error::{Error, Result};
use crate::plan::PathInfo;
use crate::shards::Shards;
use crate::types::{DType, ReduceOp};
use cudarc::driver::sys;

/// Kernel arguments; must match `struct SgArgs` in kernels/scatter_gather.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct SgKernelArgs {
    a: KernelArgs,
    total: u64,
    per: u64,
}

impl CudaComm {
    /// Enqueues one reduce-scatter (`send`: `shards.total` elements, `recv`: shard `rank`'s) or
    /// all-gather (`send`: shard `rank`'s, `recv`: `shards.total`) on `stream` (0: the legacy
    /// default stream). Arguments were checked by the caller (sizes, overlap, in-place forms).
    ///
    /// # Safety
    /// Both pointers must be device memory of this communicator's GPU, valid for the sizes
    /// above.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn enqueue_scatter_gather(
        &mut self,
        what: SgOp,
        send: u64,
        recv: u64,
        shards: Shards,
        dtype: DType,
        op: ReduceOp,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.bind()?;
        if shards.parts != self.world || what == SgOp::AllReduce {
            return Err(Error::invalid(
                self.rank,
                what.name(),
                format!(
                    "{} shards for a communicator of {} ranks",
                    shards.parts, self.world
                ),
            ));
        }
        let size = dtype.size();
        let (whole, own) = (shards.total * size, shards.span(self.rank).len() * size);
        let (send_bytes, recv_bytes) = match what {
            SgOp::ReduceScatter => (whole, own),
            _ => (own, whole),
        };
        let name = what.name();
        for (ptr, bytes, which) in [(send, send_bytes, "send"), (recv, recv_bytes, "recv")] {
            if bytes > 0 {
                self.check_buffer(name, ptr, bytes, which)?;
            }
        }
        self.in_stream_order(stream, |c| {
            c.launch_sg(what, send, recv, shards, dtype, op, stream)
        })
    }

    /// Every rank's copy of the data this rank's kernel reads, when it lies in registered
    /// buffers: reduce-scatter reads every rank's send (at the same offset on every rank);
    /// all-gather reads every rank's own shard, from its send, or in place from its recv.
    fn sg_sources(
        &self,
        what: SgOp,
        send: u64,
        recv: u64,
        shards: Shards,
        size: usize,
    ) -> Option<[u64; MAX_RANKS]> {
        let mut out = [0u64; MAX_RANKS];
        let own = shards.span(self.rank);
        let in_place_ag = what == SgOp::AllGather && send == recv + (own.start * size) as u64;
        if in_place_ag {
            let (r, off) = self.registry.lookup(recv, shards.total * size)?;
            for (p, o) in out.iter_mut().enumerate().take(self.world) {
                *o = r.peers[p] + off + (shards.span(p).start * size) as u64;
            }
            return Some(out);
        }
        let bytes = match what {
            SgOp::ReduceScatter => shards.total * size,
            _ => own.len() * size,
        };
        let (r, off) = self.registry.lookup(send, bytes.max(1))?;
        for (p, o) in out.iter_mut().enumerate().take(self.world) {
            *o = r.peers[p] + off;
        }
        Some(out)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_sg(
        &mut self,
        what: SgOp,
        send: u64,
        recv: u64,
        shards: Shards,
        dtype: DType,
        op: ReduceOp,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.check_health()?;
        self.seq += 1;
        if shards.total == 0 {
            return self.launch_empty(what, dtype, op, stream);
        }
        let size = dtype.size();
        // Peer memory only: the host-staged transport has no registered buffers.
        let sources = self
            .ws
            .sharing()
            .and_then(|_| self.sg_sources(what, send, recv, shards, size));
        let path = CudaPath::scatter_gather(what, sources.is_some());
        let grid = match self.limits.fixed {
            Some(f) => f,
            None => crate::plan::default_ctas(path, shards.total * size),
        }
        .clamp(1, self.limits.cap.max(1)) as u32;
        let op = path.effective_op(op);
        let f = self.gpu.function(path, dtype, op, self.rank)?;
        self.last_path = Some(PathInfo {
            name: path.name(),
            ctas: grid,
            registered: path.registered(),
        });
        // Zero-copy: the memory the peers read, which must be the same region at the same
        // offset on every rank (they address it through their own mapping of our region):
        // reduce-scatter's send; all-gather's send, or in place the gather buffer (recv) whose
        // shard `rank` is the send. What only this rank writes (reduce-scatter's recv, an
        // out-of-place all-gather's recv) may lie anywhere: NCCL's in-place forms put it at a
        // different offset on every rank.
        let own = shards.span(self.rank).len() * size;
        let in_place = match what {
            SgOp::ReduceScatter => recv == send + (shards.span(self.rank).start * size) as u64,
            _ => send == recv + (shards.span(self.rank).start * size) as u64,
        };
        let registered = sources.is_some();
        let (read_send, read_recv) = match (what, in_place) {
            (SgOp::ReduceScatter, _) => (Some((send, shards.total * size)), None),
            (_, false) => (Some((send, own)), None),
            (_, true) => (None, Some((recv, shards.total * size))),
        };
        let at = |r: Option<(u64, usize)>| {
            r.filter(|_| registered)
                .and_then(|(p, b)| self.region_at(p, b))
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
        };
        let mut a = self.kernel_args(send, recv, shards.total, &ident, None);
        if let Some(src) = sources {
            a.rsend = src;
            // Where the kernel reads: reduce-scatter every send at our shard, all-gather the
            // start of every rank's shard (already in `src`).
            let shift = match what {
                SgOp::ReduceScatter => (shards.span(self.rank).start * size) as u64,
                _ => 0,
            };
            a.aligned = src[..self.world].iter().all(|p| (p + shift) % 16 == 0) as i32;
        }
        let mut args = SgKernelArgs {
            a,
            total: shards.total as u64,
            per: shards.per as u64,
        };
        self.launch_kernel(f, grid, THREADS, stream, &mut args, || {
            format!(
                "launching the {} kernel ({} x {dtype}, {} per shard)",
                path.name(),
                shards.total,
                shards.per
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
