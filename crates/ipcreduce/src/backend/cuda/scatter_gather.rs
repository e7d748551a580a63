//! Reduce-scatter and all-gather through peer memory (kernels/scatter_gather.cu): the public
//! operations of their own, and the intra-node halves of the hierarchical all-reduce.
//!
//! A call is one kernel on the caller's stream, in order with the communicator's other calls,
//! with the all-reduce's protections: arguments stamped and compared in the first barrier
//! (a rank that called another operation, count, dtype or op fails with a mismatch), every
//! wait bounded, the abort flag polled. Plain buffers are staged through the workspace in
//! chunks; a registered send (or, for an in-place all-gather, a registered recv) is read where
//! it lies. Nothing is decided on the host between calls, so calls can be graph-captured.

use super::{driver, kernels, CudaComm, KernelArgs, THREADS};
use crate::backend::SgOp;
use crate::error::{Error, Result};
use crate::plan::PathInfo;
use crate::shards::Shards;
use crate::types::{DType, ReduceOp};
use cudarc::driver::{safe as cs, sys};
use kernels::MAX_RANKS;
use std::collections::HashMap;
use std::sync::Arc;

/// The kernels of the two operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum SgPath {
    RsStaged,
    RsReg,
    AgStaged,
    AgReg,
}

impl SgPath {
    const ALL: [SgPath; 4] = [
        SgPath::RsStaged,
        SgPath::RsReg,
        SgPath::AgStaged,
        SgPath::AgReg,
    ];

    fn of(op: SgOp, registered: bool) -> SgPath {
        match (op, registered) {
            (SgOp::ReduceScatter, false) => SgPath::RsStaged,
            (SgOp::ReduceScatter, true) => SgPath::RsReg,
            (_, true) => SgPath::AgReg,
            (_, false) => SgPath::AgStaged,
        }
    }

    fn name(self) -> &'static str {
        match self {
            SgPath::RsStaged => "reduce-scatter-staged",
            SgPath::RsReg => "reduce-scatter-reg",
            SgPath::AgStaged => "all-gather-staged",
            SgPath::AgReg => "all-gather-reg",
        }
    }

    fn registered(self) -> bool {
        matches!(self, SgPath::RsReg | SgPath::AgReg)
    }

    /// Stamped with the call's arguments (after the all-reduce paths' codes, see
    /// `kernels::describe_stamp_difference`): a rank in another operation fails with a mismatch.
    fn code(self) -> u32 {
        match self {
            SgPath::RsStaged => 7,
            SgPath::RsReg => 8,
            SgPath::AgStaged => 9,
            SgPath::AgReg => 10,
        }
    }

    fn kernel_name(self, w: usize, dtype: DType, op: ReduceOp) -> String {
        let d = match dtype {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        };
        match self {
            SgPath::RsStaged => format!("ipcr_reducescatter_w{w}_{d}_{}", op.name()),
            SgPath::RsReg => format!("ipcr_reducescatterreg_w{w}_{d}_{}", op.name()),
            SgPath::AgStaged => format!("ipcr_allgather_{d}"),
            SgPath::AgReg => format!("ipcr_allgatherreg_{d}"),
        }
    }

    /// The op a call of this path runs (all-gather reduces nothing: always stamped as sum).
    fn effective_op(self, op: ReduceOp) -> ReduceOp {
        match self {
            SgPath::AgStaged | SgPath::AgReg => ReduceOp::Sum,
            _ => op,
        }
    }

    /// CTAs by the bytes of the whole (`total` elements); DEFAULTS in the spirit of
    /// `plan::cuda_path`'s, to be measured.
    fn ctas(self, bytes: usize) -> usize {
        const M: usize = 1 << 20;
        match (self.registered(), bytes) {
            (_, b) if b <= 256 << 10 => 8,
            (true, b) if b <= M => 16,
            (true, _) => 32,
            (false, b) if b <= 2 * M => 16,
            (false, b) if b <= 16 * M => 32,
            (false, _) => 64,
        }
    }
}

/// The loaded kernels of one module, by (path, dtype, op).
pub(super) type Funcs = HashMap<(SgPath, DType, ReduceOp), cs::CudaFunction>;

/// Loads every reduce-scatter and all-gather kernel of the module of world class `w`.
pub(super) fn load(module: &Arc<cs::CudaModule>, w: usize, rank: usize) -> Result<Funcs> {
    let mut funcs = HashMap::new();
    for path in SgPath::ALL {
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                let name = path.kernel_name(w, dtype, op);
                let f = module
                    .load_function(&name)
                    .map_err(|e| driver::from_cudarc(rank, format!("loading kernel {name}"), e))?;
                funcs.insert((path, dtype, op), f);
            }
        }
    }
    Ok(funcs)
}

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
        let size = dtype.size();
        // Peer memory only: the host-staged transport has no registered buffers.
        let sources = self
            .ws
            .sharing()
            .and_then(|_| self.sg_sources(what, send, recv, shards, size));
        let path = SgPath::of(what, sources.is_some());
        let grid = match self.limits.fixed {
            Some(f) => f,
            None => path.ctas(shards.total * size),
        }
        .clamp(1, self.limits.cap.max(1)) as u32;
        let op = path.effective_op(op);
        let f = self.gpu.sg[&(path, dtype, op)].cu_function();
        self.last_path = Some(PathInfo {
            name: path.name(),
            ctas: grid,
            registered: path.registered(),
        });
        let stamp = kernels::stamp(shards.total, dtype, op, path.code());
        let mut a = self.kernel_args(send, recv, shards.total, stamp, None);
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

    #[test]
    fn every_kernel_is_in_the_source_and_codes_are_named() {
        let src = kernels::SCATTER_GATHER_SOURCE;
        for path in SgPath::ALL {
            let stem = path.kernel_name(2, DType::F32, ReduceOp::Sum);
            let stem = stem.split("_w2").next().unwrap().trim_end_matches("_f32");
            assert!(src.contains(&format!("{stem}_")), "{path:?}: {stem}");
            let s = kernels::stamp(10, DType::F32, ReduceOp::Sum, path.code());
            let other = kernels::stamp(10, DType::F32, ReduceOp::Sum, 1);
            let text = kernels::describe_stamp_difference(s, other);
            assert!(
                text.contains(path.name().trim_end_matches("-staged")),
                "{text}"
            );
        }
    }

    #[test]
    fn ctas_grow_with_size_and_all_gather_ignores_the_op() {
        assert!(SgPath::RsStaged.ctas(1 << 10) < SgPath::RsStaged.ctas(1 << 30));
        assert!(SgPath::AgReg.ctas(1 << 30) <= 64);
        assert_eq!(SgPath::AgReg.effective_op(ReduceOp::Max), ReduceOp::Sum);
        assert_eq!(SgPath::RsReg.effective_op(ReduceOp::Max), ReduceOp::Max);
    }

    /// The PTX's parameter must be exactly our struct's size, or the kernel reads garbage.
    #[test]
    fn sg_args_size_matches_the_ptx() {
        if !kernels::nvrtc_for_tests() {
            return;
        }
        let ptx = kernels::compile("sm_90", 4).unwrap().to_src();
        let want = format!("_param_0[{}]", std::mem::size_of::<SgKernelArgs>());
        for path in SgPath::ALL {
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
