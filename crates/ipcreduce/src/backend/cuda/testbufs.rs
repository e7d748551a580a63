//! Backend-owned device buffers and CUDA-event timing for the benchmark and the correctness
//! sweeps (`test-support` feature): kept apart from the data plane.

use super::launcher::CallArgs;
use super::memory::DeviceAlloc;
use super::workspace::Mapping;
use super::{driver, hier, CudaComm};
use crate::backend::{BackendOps, BufId, Call, RegisteredBuffer, TestBuffers};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use cudarc::driver::sys;

impl TestBuffers for CudaComm {
    fn zero_copy(&mut self, call: &Call) -> bool {
        let registered = |id: BufId| {
            matches!(
                self.bufs.get(id).and_then(Option::as_ref),
                Some(TestBuf::Registered(..))
            )
        };
        registered(call.send) && registered(call.recv)
    }

    fn alloc(&mut self, bytes: usize) -> Result<BufId> {
        self.bind()?;
        let buf = DeviceAlloc::new(bytes, self.rank)?;
        self.bufs.push(Some(TestBuf::Plain(buf)));
        Ok(self.bufs.len() - 1)
    }

    fn free(&mut self, id: BufId) {
        let Some(TestBuf::Registered(buf, own)) = self.bufs.get_mut(id).and_then(Option::take)
        else {
            return;
        };
        // Not collective: a peer's mapping keeps the memory alive until it drops it. Our own
        // kernels must be done with it first; if they are not, it stays until teardown.
        match self.wait_all("freeing a registered test buffer") {
            Ok(()) => {
                self.remove_region(buf.id());
                drop(own);
            }
            // Leaked (memory our work may still use), like teardown does.
            Err(e) => {
                tracing::warn!(rank = self.rank, "{e}: the buffer stays registered");
                std::mem::forget(own);
            }
        }
    }

    fn write(&mut self, id: BufId, data: &[u8]) -> Result<()> {
        let (ptr, bytes) = self.buf(id)?;
        assert!(data.len() <= bytes);
        // On our stream, then waited for: a plain cuMemcpyHtoD from pageable memory may return
        // before its DMA lands, and our (non-blocking) stream would not wait for it.
        // SAFETY: in bounds of our allocation; `data` outlives the synchronize below.
        unsafe { driver::copy_to_device_async(ptr, data, self.stream.cu_stream(), self.rank)? };
        self.synchronize()
    }

    fn read(&mut self, id: BufId, out: &mut [u8]) -> Result<()> {
        self.synchronize()?;
        let (ptr, bytes) = self.buf(id)?;
        assert!(out.len() <= bytes);
        // SAFETY: in bounds of our allocation; `out` outlives the synchronize below.
        unsafe { driver::copy_from_device_async(out, ptr, self.stream.cu_stream(), self.rank)? };
        self.synchronize()
    }

    fn run(&mut self, call: &Call) -> Result<()> {
        let (s, r) = (self.buf(call.send)?, self.buf(call.recv)?);
        let end = call.offset + call.count * call.dtype.size();
        if end > s.1 || end > r.1 {
            return Err(Error::invalid(self.rank, "run", "call exceeds its buffers"));
        }
        let (s, r) = (s.0 + call.offset as u64, r.0 + call.offset as u64);
        // The path of a caller's call (stream order included), on our own stream.
        let args = CallArgs {
            send: s,
            recv: r,
            count: call.count,
            dtype: call.dtype,
            op: call.op,
            stream: self.stream.cu_stream(),
        };
        self.enqueue(&args, call.algo)
    }

    fn time(
        &mut self,
        call: &Call,
        warmup: usize,
        iters: usize,
        graph: Option<usize>,
    ) -> Result<f64> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .ctx
            .new_event(flags)
            .map_err(|e| self.cuda_err("cuEventCreate".into(), e))?;
        let end = self
            .ctx
            .new_event(flags)
            .map_err(|e| self.cuda_err("cuEventCreate".into(), e))?;
        let iters = iters.max(1);
        let calls = match graph {
            None => {
                for _ in 0..warmup {
                    self.run(call)?;
                }
                self.synchronize()?;
                start
                    .record(&self.stream)
                    .map_err(|e| self.cuda_err("cuEventRecord".into(), e))?;
                for _ in 0..iters {
                    self.run(call)?;
                }
                iters
            }
            Some(k) => {
                let k = k.max(1);
                self.synchronize()?;
                self.stream
                    .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(|e| self.cuda_err("cuStreamBeginCapture".into(), e))?;
                let mut captured = Ok(());
                for _ in 0..k {
                    captured = self.run(call);
                    if captured.is_err() {
                        break;
                    }
                }
                let g = self
                    .stream
                    .end_capture(sys::CUgraphInstantiate_flags(0))
                    .map_err(|e| self.cuda_err("cuStreamEndCapture".into(), e))?;
                captured?;
                let g = g.ok_or_else(|| Error::Cuda {
                    rank: self.rank,
                    op: "graph capture".into(),
                    detail: "captured an empty graph".into(),
                })?;
                let reps = iters.div_ceil(k);
                for _ in 0..warmup.div_ceil(k).max(1) {
                    g.launch()
                        .map_err(|e| self.cuda_err("cuGraphLaunch".into(), e))?;
                }
                self.synchronize()?;
                start
                    .record(&self.stream)
                    .map_err(|e| self.cuda_err("cuEventRecord".into(), e))?;
                for _ in 0..reps {
                    g.launch()
                        .map_err(|e| self.cuda_err("cuGraphLaunch".into(), e))?;
                }
                reps * k
            }
        };
        end.record(&self.stream)
            .map_err(|e| self.cuda_err("cuEventRecord".into(), e))?;
        self.synchronize()?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| self.cuda_err("cuEventElapsedTime".into(), e))?;
        Ok(ms as f64 * 1000.0 / calls as f64)
    }
}

impl CudaComm {
    pub(super) fn buf(&self, id: BufId) -> Result<(u64, usize)> {
        self.bufs
            .get(id)
            .and_then(|b| b.as_ref())
            .map(TestBuf::ptr_bytes)
            .ok_or_else(|| Error::invalid(self.rank, "buffer", format!("no buffer #{id}")))
    }

    /// A registered (zero-copy) test buffer: collective, like [`BackendOps::alloc_registered`].
    pub fn alloc_test_registered(&mut self, boot: &mut Bootstrap, bytes: usize) -> Result<BufId> {
        self.with_node_boot(boot, |c, b| c.alloc_test_registered_here(b, bytes))
    }

    /// [`Self::alloc_test_registered`] over the node's bootstrap.
    fn alloc_test_registered_here(&mut self, boot: &mut Bootstrap, bytes: usize) -> Result<BufId> {
        // Every second one is created here and registered, so that the checks exercise both
        // `register` (caller's cuMem memory) and `alloc`. Same order on every rank.
        let (buf, own) = if self.bufs.len() % 2 == 1 {
            self.bind()?;
            let (mapping, _fd) = super::workspace::export_vmm(self.device, bytes, self.rank)?;
            // SAFETY: the mapping stays in the TestBuf beside the registration and goes after it
            // (free above; at drop the registry goes first, see teardown.rs).
            let buf = unsafe { self.register(boot, mapping.ptr(), bytes)? };
            (buf, Some(mapping))
        } else {
            (self.alloc_registered(boot, bytes)?, None)
        };
        self.bufs.push(Some(TestBuf::Registered(buf, own)));
        Ok(self.bufs.len() - 1)
    }
}

/// The time of each step of the hierarchical all-reduce, for the benchmark (`test-support`).
impl CudaComm {
    /// Mean microseconds of the intra-node reduce-scatter, the NCCL all-reduce between nodes
    /// and the intra-node all-gather of `call` on backend-owned buffers, over `iters` calls
    /// after `warmup` (events between the steps, on the communicator's stream). None when the
    /// job has one node.
    pub fn time_phases(
        &mut self,
        call: &crate::backend::Call,
        warmup: usize,
        iters: usize,
    ) -> Result<Option<[f64; 3]>> {
        use crate::backend::TestBuffers;
        if self.inter.is_none() {
            return Ok(None);
        }
        for _ in 0..warmup {
            self.run(call)?;
        }
        self.synchronize_here()?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let events = (0..4)
            .map(|_| self.ctx.new_event(flags))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| self.cuda_err("cuEventCreate".into(), e))?;
        let (send, recv) = (self.buf(call.send)?.0, self.buf(call.recv)?.0);
        let (send, recv) = (send + call.offset as u64, recv + call.offset as u64);
        let stream = self.stream.cu_stream();
        let mut total = [0f64; 3];
        for _ in 0..iters.max(1) {
            let args = CallArgs {
                send,
                recv,
                count: call.count,
                dtype: call.dtype,
                op: call.op,
                stream,
            };
            self.in_stream_order(stream, |c| {
                let inter = c.inter.as_mut().expect("checked above");
                let (own, rank) = (&c.stream, c.rank);
                hier::all_reduce(&mut c.launch, &c.registry, inter, &args, &mut |k| {
                    events[k]
                        .record(own)
                        .map_err(|e| super::driver::from_cudarc(rank, "cuEventRecord", e))
                })
            })?;
            self.synchronize_here()?;
            for (k, t) in total.iter_mut().enumerate() {
                let ms = events[k]
                    .elapsed_ms(&events[k + 1])
                    .map_err(|e| self.cuda_err("cuEventElapsedTime".into(), e))?;
                *t += ms as f64 * 1000.0;
            }
        }
        Ok(Some(total.map(|t| t / iters.max(1) as f64)))
    }

    fn synchronize_here(&mut self) -> Result<()> {
        crate::backend::BackendOps::synchronize(self)
    }
}

/// A test/benchmark buffer: plain device memory, or registered (zero-copy) memory.
pub(super) enum TestBuf {
    Plain(DeviceAlloc),
    /// With the caller-side memory when it was made here and then registered.
    Registered(RegisteredBuffer, Option<Mapping>),
}

impl TestBuf {
    fn ptr_bytes(&self) -> (u64, usize) {
        match self {
            TestBuf::Plain(a) => (a.ptr, a.bytes),
            TestBuf::Registered(b, _) => (b.ptr(), b.bytes()),
        }
    }
}
