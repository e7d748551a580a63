//! CUDA backend: one process per GPU (or several under MPS), peer memory through CUDA IPC.
//!
//! Start-up (once per communicator, init.rs): pick the GPU (see [`crate::config::Config::pick_device`]),
//! compile the kernels with NVRTC (modules.rs), create and share the workspaces
//! ([`workspace`], transport.rs), check every pair of ranks for real (P2P query + a
//! cross-process write/read), optionally build NCCL beside us. A call: validate, stamp nothing
//! on the host, launch one kernel on the caller's stream. All protocol state is on the device
//! (see kernels/prims.cuh), so calls can be graph-captured.
//!
//! Which file does what:
//!
//! | file | job |
//! |---|---|
//! | `mod.rs` | [`CudaComm`]: what one communicator owns, and in which order it is dropped |
//! | `init.rs` | start-up: the GPU, the agreed limits, workspaces, fabric, NCCL |
//! | `ops.rs` | the entry points ([`crate::backend::BackendOps`]): bind, check buffers, stream order, dispatch |
//! | `launcher.rs` | every call: its arguments, identity stamp, kernel launch, error record |
//! | `kernel_args.rs` | the kernels' argument struct: the fields shared by every call, built once, and one call's |
//! | `calls.rs` | the eager calls' identities on the host, and the peers' count-0 calls compared with them |
//! | `allreduce.rs` | the all-reduce within a node: the path, its kernel; the last eager call's, reused by a repeat |
//! | `scatter_gather.rs` | reduce-scatter and all-gather |
//! | `ce.rs` | the copy-engine all-reduces of two ranks: registered over peer memory, or through host memory on the host-staged transport (large) |
//! | `fused.rs`, `fused_path.rs` | the fused all-reduce + add + RMSNorm: its kernels' launch; which path, the rows' layout |
//! | `hier.rs` | jobs across nodes: the hierarchical all-reduce, NCCL between nodes |
//! | `paths.rs`, `identity.rs` | the path table; a call's identity and its words |
//! | `modules.rs`, `kernels.rs`, `kernels/` | NVRTC kernels, loaded per GPU |
//! | `regions.rs`, `registry.rs` | registered (zero-copy) buffers |
//! | `pointers.rs` | what the caller's other buffers are (the driver asked once per allocation) |
//! | `streams.rs` | order across the caller's streams; what teardown waits for |
//! | `workspace.rs`, `transport.rs`, `host_staged.rs`, `peers.rs`, `topology.rs` | workspaces and the fabric |
//! | `residency.rs` | how many CTAs every rank can keep resident |
//! | `memory.rs` | small owners of device and mapped host memory |
//! | `driver.rs`, `driver/` | the backend's raw driver calls (residency.rs's and modules.rs's aside), as small wrappers whose errors name the rank and the operation |
//! | `nccl.rs` | NCCL, as a baseline and between nodes |
//! | `teardown.rs` | leaving a job: bounded waits, what is leaked rather than freed |
//! | `testbufs.rs` | backend-owned buffers and timing for the benchmark (`test-support`) |
//! | `hot_path_timing.rs` | (tests) CPU timings of an eager call's pure pieces, ignored by default |
//!
//! An operation is a function over the [`launcher::Launcher`] (and the registry where it reads
//! registered buffers), never an `impl` of [`CudaComm`]: only `ops.rs` dispatches to them.

mod allreduce;
mod calls;
mod captures;
mod ce;
pub mod driver;
mod fused;
mod fused_path;
mod hier;
#[cfg(test)]
mod hot_path_timing;
pub mod identity;
mod init;
mod kernel_args;
pub mod kernels;
mod launcher;
pub mod memory;
mod nccl;
mod ops;
pub mod paths;
mod peers;
mod phase_ring;
mod pointers;
mod regions;
mod registry;
mod residency;
mod scatter_gather;
mod streams;
mod teardown;
#[cfg(feature = "test-support")]
mod testbufs;
mod workspace;
// Workspaces over peer memory or staged through host memory (IPCREDUCE_TRANSPORT).
mod host_staged;
mod modules;
mod topology;
mod transport;

use crate::error::{Error, Result};
use cudarc::driver::{safe as cs, sys};
// The workspace layout and block size, as peers.rs and residency.rs know them.
use launcher::{Launcher, PROBE_OFFSET, THREADS};
use registry::Registry;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use transport::SharedWorkspaces;

/// Whether this process can use the cuda backend (driver, a GPU, NVRTC).
pub fn usable() -> Result<()> {
    require_driver(driver::driver_present())?;
    cudarc::driver::result::init()
        .map_err(|e| Error::CudaUnavailable(format!("cuInit failed: {e}")))?;
    let n = cs::CudaContext::device_count()
        .map_err(|e| Error::CudaUnavailable(format!("cuDeviceGetCount failed: {e}")))?;
    if n == 0 {
        return Err(Error::CudaUnavailable("no CUDA device visible".into()));
    }
    kernels::require_nvrtc()
}

/// The first check of [`usable`]: cudarc panics on use when libcuda is missing.
fn require_driver(present: bool) -> Result<()> {
    if present {
        return Ok(());
    }
    Err(Error::CudaUnavailable(
        "libcuda.so not found (no NVIDIA driver)".into(),
    ))
}

pub struct CudaComm {
    // Declaration order is drop order: everything that needs the context goes before it.
    /// Jobs across hosts: NCCL between nodes and the node's group this communicator runs over
    /// (see hier.rs); None within one host.
    inter: Option<hier::Inter>,
    rank: usize,
    world: usize,
    ordinal: usize,
    device: sys::CUdevice,
    #[cfg(feature = "test-support")]
    bufs: Vec<Option<testbufs::TestBuf>>,
    /// Registered (zero-copy) buffers; freed in Drop unless work may still run on them.
    registry: ManuallyDrop<Registry>,
    /// What the caller's other buffers are, by allocation (see pointers.rs).
    pointers: pointers::PointerCache,
    /// Streams and events of the copy-engine path, made at its first call.
    ce: ce::Engine,
    next_region: u64,
    nccl: std::result::Result<nccl::Nccl, String>,
    /// Stream order and what teardown waits for (see streams.rs).
    streams: streams::Tracker,
    events: streams::CudaEvents,
    /// The origin of each call: eager, or captured (see captures.rs).
    captures: captures::Captures,
    /// What every call goes through, with the memory kernels use (freed in Drop unless work
    /// may still run on it, see teardown.rs).
    launch: Launcher,
    /// What the last eager all-reduce came to, for the next one with the same inputs (see
    /// allreduce.rs).
    prepared: Option<allreduce::Prepared>,
    ws: ManuallyDrop<SharedWorkspaces>,
    /// Set by teardown: what must not be freed.
    leak: teardown::Leak,
    /// Whether teardown ran (else Drop waits for our work itself).
    left: bool,
    devices: Vec<String>,
    stream: Arc<cs::CudaStream>,
    ctx: Arc<cs::CudaContext>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unusable_without_a_driver_is_an_error_not_a_panic() {
        let err = require_driver(false).unwrap_err();
        assert!(err.to_string().contains("libcuda"), "{err}");
        require_driver(true).unwrap();
        // On this machine, whatever it has: an answer, never a panic.
        match (driver::driver_present(), usable()) {
            (false, Err(e)) => assert!(e.to_string().contains("libcuda"), "{e}"),
            (false, Ok(())) => panic!("usable without a driver"),
            (true, _) => {}
        }
    }
}
