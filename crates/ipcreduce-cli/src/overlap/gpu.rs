//! This rank's GPU resources for the benchmark: streams, the compute kernel, the gradients,
//! through cudarc and the library's public API.

use super::*;
use crate::gpu::{driver, DeviceMem};
use cudarc::driver::result;

/// This rank's GPU resources for the benchmark, in the communicator's (primary) context.
pub(super) struct Gpu {
    pub(super) rank: usize,
    pub(super) grad_bytes: usize,
    pub(super) registered: bool,
    /// Priority of the communication stream (lower is higher).
    pub(super) comm_priority: i32,
    // Fields drop in this order after `Drop::drop` has waited for the streams: memory first
    // (nothing can use it any more), then streams, the module, and the context last.
    pub(super) sink: DeviceMem,
    pub(super) grads: Option<Memory>,
    pub(super) reduced: Option<Memory>,
    /// The communicator's own stream: uploads, poisoning and read-backs (the communicator
    /// waits for it at teardown).
    pub(super) setup: sys::CUstream,
    pub(super) compute: Arc<cs::CudaStream>,
    pub(super) comm: Arc<cs::CudaStream>,
    /// The compute kernel; it keeps its module loaded.
    pub(super) kernel: cs::CudaFunction,
    pub(super) blocks: u32,
    pub(super) ctx: Arc<cs::CudaContext>,
}

impl Gpu {
    /// On the communicator's GPU and context; `registered`: the gradients and their reduced
    /// copy in buffers from `Communicator::alloc` (collective), so calls are zero-copy.
    pub(super) fn new(comm: &mut Communicator, grad_bytes: usize, registered: bool) -> Result<Gpu> {
        let rank = comm.rank();
        let ctx = comm_context(comm)?;
        // Through the kernel cache, to a CUBIN for this GPU: no driver JIT, no compile at all
        // once cached (as the library's kernels).
        let kernel = crate::gpu::load_kernels(
            &ctx,
            rank,
            "compute.cu",
            kernels::COMPUTE_SOURCE,
            &[COMPUTE_KERNEL],
        )?
        .remove(0);
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cu(rank, "SM count query"))?;
        // Two blocks per SM: every SM busy, with room left for the all-reduce's blocks (they
        // must get on the GPU while compute runs, or nothing would overlap).
        let blocks = u32::try_from(sms).unwrap_or(1).max(1) * 2;
        let compute = ctx.new_stream().map_err(cu(rank, "cuStreamCreate"))?;
        // The all-reduces on the highest priority, as training frameworks do: a bucket's
        // blocks get on the SMs as soon as some compute block finishes, instead of queueing
        // behind the whole compute piece.
        let (_, highest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(cu(rank, "cuCtxGetStreamPriorityRange"))?;
        let comm_stream = ctx
            .new_stream_with_priority(highest)
            .map_err(cu(rank, "cuStreamCreateWithPriority"))?;
        ctx.bind_to_thread()
            .map_err(cu(rank, "binding the context"))?;
        let setup = comm
            .cuda_stream()
            .ok_or_else(|| Error::invalid(rank, "overlap", "the communicator has no cuda stream"))?
            as sys::CUstream;
        let sink = DeviceMem::new(blocks as usize * COMPUTE_THREADS as usize * 4, rank)?;
        let grads = Memory::new(comm, grad_bytes, registered)?;
        let reduced = Memory::new(comm, grad_bytes, registered)?;
        Ok(Gpu {
            rank,
            grad_bytes,
            registered,
            comm_priority: highest,
            sink,
            grads: Some(grads),
            reduced: Some(reduced),
            setup,
            compute,
            comm: comm_stream,
            kernel,
            blocks,
            ctx,
        })
    }

    pub(super) fn grads_ptr(&self) -> u64 {
        self.grads.as_ref().map_or(0, Memory::ptr)
    }

    pub(super) fn reduced_ptr(&self) -> u64 {
        self.reduced.as_ref().map_or(0, Memory::ptr)
    }

    /// Waits for the work, then frees the gradients (collectively when registered).
    pub(super) fn free(mut self, comm: &mut Communicator) -> Result<()> {
        self.bind()?;
        self.sync()?;
        for m in [self.grads.take(), self.reduced.take()]
            .into_iter()
            .flatten()
        {
            m.free(comm);
        }
        Ok(())
    }

    pub(super) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cu(self.rank, "binding the context"))
    }

    /// Enqueues one compute piece of `iters` FMA rounds per thread on the compute stream.
    pub(super) fn launch_piece(&self, iters: u32) -> Result<()> {
        self.bind()?;
        let mut out: sys::CUdeviceptr = self.sink.ptr;
        let mut iters = iters;
        let mut params = [
            (&mut out as *mut sys::CUdeviceptr).cast::<c_void>(),
            (&mut iters as *mut u32).cast::<c_void>(),
        ];
        // SAFETY: the kernel takes (float*, unsigned int), matching `params` (copied at
        // launch); it writes one float per thread of the grid, which is what `sink` holds.
        unsafe {
            result::launch_kernel(
                self.kernel.cu_function(),
                (self.blocks, 1, 1),
                (COMPUTE_THREADS, 1, 1),
                0,
                self.compute.cu_stream(),
                &mut params,
            )
        }
        .map_err(driver(self.rank, "launching the compute kernel"))
    }

    /// Copies `data` into the gradients. On our stream and waited for: a plain copy from
    /// pageable memory may return before its DMA lands, and non-blocking streams would not
    /// wait for it.
    pub(super) fn upload(&self, data: &[u8]) -> Result<()> {
        assert!(data.len() <= self.grad_bytes);
        self.bind()?;
        // SAFETY: in bounds of our allocation; `data` outlives the synchronize below.
        unsafe { result::memcpy_htod_async(self.grads_ptr(), data, self.setup) }.map_err(
            driver(
                self.rank,
                format!("copying {} bytes of gradients to the device", data.len()),
            ),
        )?;
        self.sync()
    }

    /// Copies the reduced gradients into `out`.
    pub(super) fn download(&self, out: &mut [u8]) -> Result<()> {
        assert!(out.len() <= self.grad_bytes);
        self.sync()?;
        // SAFETY: in bounds of our allocation; `out` outlives the synchronize below.
        let what = format!("copying {} bytes of results from the device", out.len());
        unsafe { result::memcpy_dtoh_async(out, self.reduced_ptr(), self.setup) }
            .map_err(driver(self.rank, what))?;
        self.sync()
    }

    /// Fills the output with NaNs (all-ones bf16), so a bucket that is never written fails.
    pub(super) fn poison_reduced(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: our allocation, whole.
        unsafe { result::memset_d8_async(self.reduced_ptr(), 0xFF, self.grad_bytes, self.setup) }
            .map_err(driver(self.rank, "poisoning the reduced gradients"))?;
        self.sync()
    }

    /// Waits for the three streams.
    pub(super) fn sync(&self) -> Result<()> {
        self.compute
            .synchronize()
            .map_err(cu(self.rank, "compute stream synchronize"))?;
        self.comm
            .synchronize()
            .map_err(cu(self.rank, "communication stream synchronize"))?;
        // SAFETY: the communicator's stream, alive as long as the communicator (which
        // outlives this struct).
        unsafe { result::stream::synchronize(self.setup) }
            .map_err(driver(self.rank, "communicator stream synchronize"))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Work may still be queued after an error: wait for it before the memory it uses is
        // freed (the fields drop after this).
        if let Err(e) = self.bind().and_then(|()| self.sync()) {
            tracing::warn!(rank = self.rank, "synchronize at teardown failed: {e}");
        }
    }
}
