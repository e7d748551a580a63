//! What the CUDA-side commands (bench, overlap, tune) share: the communicator's GPU context,
//! device memory, and cudarc errors mapped to ours.

use cudarc::driver::{result, safe as cs, sys, DriverError};
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

/// Maps a cudarc error of a raw driver call to ours, keeping the driver's result code (as
/// the library's errors do), naming the rank and what was being done.
pub fn driver(rank: usize, op: impl Into<String>) -> impl FnOnce(DriverError) -> Error {
    let op = op.into();
    move |e| Error::CudaDriver {
        rank,
        op,
        code: e.0,
        detail: match (e.error_name(), e.error_string()) {
            (Ok(name), Ok(text)) => {
                format!("{}: {}", name.to_string_lossy(), text.to_string_lossy())
            }
            _ => format!("{:?}", e.0),
        },
    }
}

/// Launches `f` (one-dimensional grid and block, no dynamic shared memory) on `stream` with
/// `params`, with programmatic dependent launch when `pdl`, as the library launches its own
/// kernels (`ipcreduce::backend::cuda::driver::launch`), the result as cudarc's error.
///
/// # Safety
/// As for the library's `launch`: `params` must point to the kernel's parameters as
/// `cuLaunchKernel` takes them, each valid for the launch; the kernel must only touch memory
/// the caller vouches for.
pub unsafe fn launch(
    f: sys::CUfunction,
    (grid, threads): (u32, u32),
    stream: sys::CUstream,
    params: *mut *mut std::ffi::c_void,
    pdl: bool,
) -> std::result::Result<(), DriverError> {
    // SAFETY: passed on as the caller vouched.
    unsafe { ipcreduce::backend::cuda::driver::launch(f, grid, threads, stream, params, pdl) }
        .result()
}

/// Plain device memory of the current context, freed on drop.
pub struct DeviceMem {
    pub ptr: sys::CUdeviceptr,
}

impl DeviceMem {
    /// `bytes` (at least 1) of the context current on this thread.
    pub fn new(bytes: usize, rank: usize) -> Result<DeviceMem> {
        // SAFETY: allocates; the pointer is owned by the DeviceMem and freed once, in Drop.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(driver(rank, format!("cuMemAlloc({bytes} bytes)")))?;
        Ok(DeviceMem { ptr })
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        // SAFETY: from cuMemAlloc, freed once; the owners wait for their work first.
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!("cuMemFree failed: {e}");
        }
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

/// `k` calls of `one`, captured from `stream` (thread-local mode) into an instantiated graph:
/// how the timed loops replay what users capture.
pub fn capture(
    stream: &Arc<cs::CudaStream>,
    comm: &mut Communicator,
    k: usize,
    one: &mut dyn FnMut(&mut Communicator) -> Result<()>,
) -> Result<cs::CudaGraph> {
    let rank = comm.rank();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(cu(rank, "cuStreamBeginCapture"))?;
    let mut captured = Ok(());
    for _ in 0..k {
        captured = one(comm);
        if captured.is_err() {
            break;
        }
    }
    // The capture is ended whatever a call returned, so the stream is usable again.
    let g = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .map_err(cu(rank, "cuStreamEndCapture"))?;
    captured?;
    g.ok_or_else(|| Error::Cuda {
        rank,
        op: "graph capture".into(),
        detail: "captured an empty graph".into(),
    })
}

/// Device memory for the buffers an all-reduce reads and writes: plain, or registered with
/// every peer by `Communicator::alloc` (zero-copy calls).
pub enum Memory {
    Plain(DeviceMem),
    Registered(ipcreduce::RegisteredBuffer),
}

impl Memory {
    /// Collective when `registered`: every rank allocates the same sizes in the same order.
    pub fn new(comm: &mut Communicator, bytes: usize, registered: bool) -> Result<Memory> {
        Ok(if registered {
            Memory::Registered(comm.alloc(bytes)?)
        } else {
            Memory::Plain(DeviceMem::new(bytes, comm.rank())?)
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
