//! What the CUDA-side commands (bench, overlap, tune) share: the communicator's GPU context,
//! and cudarc errors mapped to ours.

use cudarc::driver::{safe as cs, sys, DriverError};
use ipcreduce::backend::cuda::driver::ck;
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

/// The (primary) context of the GPU the communicator runs on. The cuda backend leaves its
/// context current on the thread that created it; asking the driver which device that is
/// keeps the commands on the communicator's GPU whatever picked it (configuration,
/// local rank, an earlier context).
pub fn comm_context(comm: &Communicator) -> Result<Arc<cs::CudaContext>> {
    let rank = comm.rank();
    let mut device: sys::CUdevice = 0;
    // SAFETY: writes one device handle; fails cleanly when no context is current.
    ck(unsafe { sys::cuCtxGetDevice(&mut device) }, rank, || {
        "cuCtxGetDevice (the communicator's GPU)".into()
    })?;
    let ordinal = usize::try_from(device).map_err(|_| Error::Cuda {
        rank,
        op: "cuCtxGetDevice".into(),
        detail: format!("device {device}"),
    })?;
    cs::CudaContext::new(ordinal).map_err(cu(rank, "context creation"))
}

/// Compiles one of the commands' kernel sources for the context's GPU and loads `names`.
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
    let ptx = ipcreduce::backend::cuda::kernels::compile_source(file, source, &arch, &[]).map_err(
        |e| match e {
            Error::Cuda { op, detail, .. } => Error::Cuda { rank, op, detail },
            other => other,
        },
    )?;
    let module = ctx.load_module(ptx).map_err(|e| Error::Cuda {
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
