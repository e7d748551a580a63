//! What the CUDA-side commands (bench, overlap, tune) share: the communicator's GPU context,
//! and cudarc errors mapped to ours.

use cudarc::driver::{safe as cs, DriverError};
use ipcreduce::backend::cuda::memory::DeviceAlloc;
use ipcreduce::error::{Error, Result};
use ipcreduce::Communicator;
use std::sync::Arc;

/// Maps a cudarc error to ours, naming the rank and the call.
pub fn cu(rank: usize, op: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda {
        rank,
        op: op.into(),
        detail: e.to_string(),
    }
}

/// The (primary) context of the GPU the communicator runs on, so the commands' buffers,
/// streams and kernels are on its GPU whatever picked it (configuration, local rank, an
/// earlier context).
pub fn comm_context(comm: &Communicator) -> Result<Arc<cs::CudaContext>> {
    let rank = comm.rank();
    let ordinal = comm
        .cuda_device()
        .ok_or_else(|| Error::invalid(rank, "GPU context", "the communicator is not on cuda"))?;
    cs::CudaContext::new(ordinal).map_err(cu(rank, "context creation"))
}

/// Device memory for the buffers an all-reduce reads and writes: plain, or registered with
/// every peer by `Communicator::alloc` (zero-copy calls).
pub enum Memory {
    Plain(DeviceAlloc),
    Registered(ipcreduce::RegisteredBuffer),
}

impl Memory {
    /// Collective when `registered`: every rank allocates the same sizes in the same order.
    pub fn new(comm: &mut Communicator, bytes: usize, registered: bool) -> Result<Memory> {
        Ok(if registered {
            Memory::Registered(comm.alloc(bytes)?)
        } else {
            Memory::Plain(DeviceAlloc::new(bytes, comm.rank())?)
        })
    }

    pub fn ptr(&self) -> u64 {
        match self {
            Memory::Plain(m) => m.ptr,
            Memory::Registered(m) => m.ptr(),
        }
    }

    /// Registered memory is freed collectively (after the caller waited for its work); plain
    /// memory on drop.
    pub fn free(self, comm: &mut Communicator) {
        match self {
            Memory::Plain(m) => drop(m),
            Memory::Registered(m) => {
                if let Err(e) = comm.free(m) {
                    tracing::warn!(rank = comm.rank(), "freeing a registered buffer: {e}");
                }
            }
        }
    }
}

/// Compiles one of the commands' kernel sources for the context's GPU (to a CUBIN, through the
/// kernel cache: no driver JIT, and no compilation at all once cached) and loads `names`.
pub fn load_kernels(
    ctx: &Arc<cs::CudaContext>,
    rank: usize,
    file: &str,
    source: &str,
    names: &[&str],
) -> Result<Vec<cs::CudaFunction>> {
    let (major, minor) = ctx
        .compute_capability()
        .map_err(cu(rank, "compute capability query"))?;
    let arch = format!("sm_{major}{minor}");
    use ipcreduce::backend::cuda::kernels::variants::{source_cubin, Target};
    let at_rank = |e| match e {
        Error::Cuda { op, detail, .. } => Error::Cuda { rank, op, detail },
        other => other,
    };
    let target = Target::here(&arch).map_err(at_rank)?;
    let (cubin, _) = source_cubin(file, source, &target, &[]).map_err(at_rank)?;
    let image = cudarc::nvrtc::Ptx::from_binary(cubin.to_vec());
    let module = ctx.load_module(image).map_err(|e| Error::Cuda {
        rank,
        op: format!("loading {file}"),
        detail: e.to_string(),
    })?;
    names
        .iter()
        .map(|n| {
            module.load_function(n).map_err(|e| Error::Cuda {
                rank,
                op: format!("loading kernel {n} of {file}"),
                detail: e.to_string(),
            })
        })
        .collect()
}
