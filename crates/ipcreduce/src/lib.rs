//! # ipcreduce
//!
//! All-reduce between the GPUs (CUDA IPC / peer memory) or the processes (shared memory) of
//! one machine, with NCCL side by side.
//!
//! | module | what is there |
//! |---|---|
//! | [`Communicator`] | the public API: init, all-reduce (raw pointers, host slices) |
//! | [`Config`] | every knob, and the `IPCREDUCE_*` environment variables |
//! | [`bootstrap`] | control plane: Unix-socket rendezvous, all-gather, fd passing, liveness |
//! | [`plan`] | pure decisions: algorithm choice, chunks |
//! | [`shards`] | shard boundaries of reduce-scatter, all-gather and the hierarchical all-reduce |
//! | [`backend::host`] | shared-memory data plane, reduction loops in Rust |
//! | [`backend::cuda`] | CUDA IPC data plane: workspaces, NVRTC kernels, NCCL |
//! | [`fused`] | all-reduce + residual add + RMSNorm in one call: arguments and numerics |
//! | [`reference`] | deterministic test data and the float64 reference |
//!
//! The `ipcreduce` command (bench, check, overlap, launch) lives in the `ipcreduce-cli` crate.

pub mod abort;
pub mod backend;
pub mod bootstrap;
mod communicator;
pub mod config;
pub mod element;
pub mod error;
pub mod flight;
pub mod fused;
pub mod host_profile;
mod phases;
pub mod plan;
pub mod reference;
pub mod shards;
pub mod tune;
pub mod types;

pub use backend::RegisteredBuffer;
pub use communicator::{AbortHandle, Communicator};
pub use config::{Config, Options, Pdl, Sharing, Topology, Transport};
pub use plan::{Fabric, PathInfo};

/// Cores online on this machine. Not `available_parallelism`: `launch` binds each rank to one
/// core, and a rank must still know how many its peers can use.
pub fn machine_cores() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    if n > 0 {
        n as usize
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}
pub use element::Element;
pub use error::{Error, Result};
pub use fused::AddRmsNorm;
pub use types::{Algorithm, BackendChoice, BackendKind, DType, ReduceOp};
