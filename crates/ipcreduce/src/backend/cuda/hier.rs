//! Jobs across hosts: the hierarchical all-reduce.
//!
//! Each node's ranks form a group of their own ([`Bootstrap::node_group`], over a Unix socket,
//! sharing the job's abort state); the peer-memory communicator ([`super::CudaComm`]) is built over
//! that group, and one NCCL communicator per local rank spans the nodes (local rank i of every
//! node; its unique id made by node 0's rank i and sent through the job's bootstrap). An
//! all-reduce of `count` elements is then, on the caller's stream:
//!
//! 1. reduce-scatter inside the node (peer memory): rank i of the node gets the node's sum of
//!    shard i (16-byte aligned shards, see [`Shards::aligned16`]), in place in its recv;
//! 2. NCCL all-reduce of shard i, in place, among the ranks with local rank i (between nodes);
//! 3. all-gather inside the node (peer memory), from each rank's shard in its recv.
//!
//! Every rank ends with the same bits: steps 2 and 3 only copy what one NCCL reduction made.
//! f16 and bf16 are rounded twice (the node's sum, then NCCL's reduction of the node sums),
//! f32 accumulates in f32 throughout. Each step is stamped like a call of its own (a rank
//! calling with other arguments fails with a mismatch inside its node), and the NCCL
//! communicator is aborted with the job.

use super::launcher::{CallArgs, Launcher};
use super::nccl::Nccl;
use super::registry::Registry;
use super::scatter_gather;
use crate::backend::SgOp;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::plan::PathInfo;
use crate::shards::Shards;

/// Names the NCCL step in errors (and tells them apart from the node's steps').
const BETWEEN_NODES: &str = "between nodes";

/// What a communicator across nodes has beside the node's peer-memory communicator.
pub(super) struct Inter {
    /// NCCL among the ranks with this rank's local rank, one per node.
    nccl: Nccl,
    /// The node's group (taken out while a collective of the node runs over it).
    pub(super) group: Option<Bootstrap>,
    /// This rank in the job, its node, the node's ranks (by local rank) and the job's ranks
    /// in `nccl` (by node).
    rank: usize,
    node: usize,
    node_ranks: Vec<usize>,
    members: Vec<usize>,
}

impl Inter {
    /// NCCL among the ranks with this rank's local rank (one per node), beside the node's
    /// communicator built over `group`. Collective over the job (`boot`).
    pub(super) fn new(boot: &mut Bootstrap, group: Bootstrap) -> Result<Inter> {
        let layout = boot.layout().clone();
        let (rank, node) = (boot.rank(), layout.node());
        let members = layout.same_local_rank(layout.local_rank());
        let nccl =
            Nccl::init_among(boot, &members, "ipcreduce-inter").map_err(|e| Error::Cuda {
                rank,
                op: format!(
                    "NCCL between nodes (node {node}, local rank {}, with ranks {members:?})",
                    layout.local_rank()
                ),
                detail: e.to_string(),
            })?;
        Ok(Inter {
            nccl,
            group: Some(group),
            rank,
            node,
            node_ranks: layout.node_ranks(node).to_vec(),
            members,
        })
    }

    /// An error of the node's communicator in the job's terms: the job's rank numbers (the
    /// node's communicator numbers its ranks by local rank), and the node in the operation.
    pub(super) fn in_job(&self, e: Error) -> Error {
        job_terms(e, self.rank, self.node, &self.node_ranks)
    }
}

/// The hierarchical all-reduce of `call` (see the module's text), calling `mark(k)` before
/// step k (0, 1, 2) and after the last (3): where the phase timing records its events. Each
/// step is a call of its own (begun by the step).
pub(super) fn all_reduce(
    l: &mut Launcher,
    registry: &Registry,
    inter: &mut Inter,
    call: &CallArgs,
    mark: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<()> {
    let (dtype, op, stream) = (call.dtype, call.op, call.stream);
    let size = dtype.size();
    let shards = Shards::aligned16(call.count, l.world, size);
    let mine = shards.span(l.rank);
    let at = call.recv + (mine.start * size) as u64;
    mark(0)?;
    // Errors of the node's steps are put in the job's terms by the caller (all_reduce_raw).
    let scatter = CallArgs { recv: at, ..*call };
    scatter_gather::launch(l, registry, SgOp::ReduceScatter, shards, &scatter)?;
    let intra = l.last_path;
    mark(1)?;
    if !mine.is_empty() {
        let (rank, node, members) = (inter.rank, inter.node, &inter.members);
        // SAFETY: `at` holds our shard (`mine.len()` elements) of `recv`, which the caller
        // vouched for.
        unsafe {
            inter.nccl.all_reduce(
                at as *const std::ffi::c_void,
                at as *mut std::ffi::c_void,
                mine.len(),
                dtype,
                op,
                stream,
            )
        }
        .map_err(|e| Error::Cuda {
            rank,
            op: format!("all_reduce {BETWEEN_NODES} (node {node}, NCCL with ranks {members:?})"),
            detail: e.to_string(),
        })?;
    }
    mark(2)?;
    let gather = CallArgs { send: at, ..*call };
    scatter_gather::launch(l, registry, SgOp::AllGather, shards, &gather)?;
    mark(3)?;
    let registered = intra.is_some_and(|p| p.registered);
    l.last_path = Some(PathInfo {
        name: if registered {
            "hierarchical-reg"
        } else {
            "hierarchical"
        },
        ctas: intra.map_or(0, |p| p.ctas),
        registered,
    });
    Ok(())
}

/// `e`, an error of node `node`'s communicator (which numbers the node's ranks by local rank),
/// in the job's terms: this rank's job rank `rank`, peers by their job rank (`node_ranks`, by
/// local rank), the node named in the operation.
fn job_terms(e: Error, rank: usize, node: usize, node_ranks: &[usize]) -> Error {
    // The NCCL step's errors are made in the job's terms already.
    if matches!(&e, Error::Cuda { op, .. } if op.contains(BETWEEN_NODES)) {
        return e;
    }
    // The node's communicator numbers this rank and its peers by local rank; the rank that
    // saw the error is this one.
    e.map_ranks(|_| rank, |p| node_ranks.get(p).copied().unwrap_or(p))
        .at_place(&format!("inside node {node}"))
}

impl Inter {
    /// This rank in the job.
    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    /// Makes NCCL end with ncclCommAbort (the job is aborted or work may still run).
    pub(super) fn abort_on_drop(&mut self) {
        self.nccl.abort_on_drop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_errors_name_job_ranks_and_the_node() {
        // Node 1 holds job ranks 2 and 3; local rank 1 (job rank 3) timed out waiting for
        // local rank 0 (job rank 2).
        let e = Error::Timeout {
            rank: 1,
            peer: 0,
            op: "all_reduce (kernel barrier)".into(),
            seq: 4,
            waited: std::time::Duration::from_secs(1),
        };
        let text = job_terms(e, 3, 1, &[2, 3]).to_string();
        assert!(text.starts_with("rank 3:"), "{text}");
        assert!(
            text.contains("peer rank 2") && text.contains("inside node 1"),
            "{text}"
        );
        let m = Error::Mismatch {
            rank: 0,
            peer: 1,
            op: "all_reduce".into(),
            seq: 1,
            detail: "count 1 vs 2".into(),
        };
        let text = job_terms(m, 2, 1, &[2, 3]).to_string();
        assert!(
            text.contains("rank 2:") && text.contains("peer rank 3"),
            "{text}"
        );
        // The NCCL step's own errors stay as they are.
        let n = Error::Cuda {
            rank: 3,
            op: format!("all_reduce {BETWEEN_NODES} (node 1, NCCL with ranks [1, 3])"),
            detail: "x".into(),
        };
        assert_eq!(
            job_terms(n, 3, 1, &[2, 3]).to_string(),
            "rank 3: all_reduce between nodes (node 1, NCCL with ranks [1, 3]) failed: x"
        );
    }
}
