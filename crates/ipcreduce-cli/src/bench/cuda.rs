//! The benchmark's timed loop on the cuda backend.
//!
//! One measurement: the first input is generated on the device, then every call is an
//! all-reduce followed by the refresh kernel (refresh.cu), which checks that call's output
//! on the device and writes the next input from it. The loop runs eagerly or as CUDA graph
//! replays (the refresh is captured with the call, its iteration counter lives on the device).
//! The refresh alone is timed the same way, before and after the loop, and the smaller of the
//! two is subtracted: `time_us` is the all-reduce's share.
//! After the loop the host reads the final output back and checks every element itself.

use super::pattern;
use super::{Measure, Measured};
use crate::gpu::{comm_context, cu, driver, launch, load_kernels, DeviceMem, Memory};
use cudarc::driver::{result, safe as cs, sys};
use ipcreduce::error::{Error, Result};
use ipcreduce::types::{DType, ReduceOp};
use ipcreduce::Communicator;
use std::ffi::c_void;
use std::sync::Arc;

pub const REFRESH_SOURCE: &str = include_str!("refresh.cu");
const REFRESH_THREADS: u32 = 512;
/// Bytes of `struct State` in refresh.cu: {u32 iter, u32 blocks_done, u64 wrong}.
const STATE_BYTES: usize = 16;

/// How the refresh takes part in programmatic dependent launch (`bench --pdl-producer`,
/// `--pdl-consumer`).
#[derive(Debug, Clone, Copy, Default)]
pub struct RefreshPdl {
    /// It lets the next kernel launch at once.
    pub producer: bool,
    /// It is launched with PDL and waits on the device for the kernel before it.
    pub consumer: bool,
}

/// Must match `struct RefreshArgs` in refresh.cu field by field.
#[repr(C)]
#[derive(Clone, Copy)]
struct RefreshArgs {
    send: u64,
    recv: u64,
    count: u64,
    seed: u64,
    state: u64,
    rank: i32,
    world: i32,
    op: i32,
    check: i32,
    early: i32,
}

/// Buffers, stream and kernels of one dtype's sweep.
pub struct CudaRunner {
    rank: usize,
    send: Option<Memory>,
    recv: Option<Memory>,
    /// The measured loop's state, and a scratch one for timing the refresh alone.
    state: DeviceMem,
    scratch: DeviceMem,
    capacity: usize,
    refresh: [cs::CudaFunction; 3],
    max_grid: u32,
    /// How the refresh takes part in programmatic dependent launch.
    pdl: RefreshPdl,
    stream: Arc<cs::CudaStream>,
    ctx: Arc<cs::CudaContext>,
}

impl CudaRunner {
    pub fn new(comm: &mut Communicator, capacity: usize, registered: bool) -> Result<CudaRunner> {
        let rank = comm.rank();
        let ctx = comm_context(comm)?;
        ctx.bind_to_thread()
            .map_err(cu(rank, "binding the context"))?;
        let funcs = load_kernels(
            &ctx,
            rank,
            "refresh.cu",
            REFRESH_SOURCE,
            &["ipcr_refresh_f32", "ipcr_refresh_f16", "ipcr_refresh_bf16"],
        )?;
        let refresh: [cs::CudaFunction; 3] = funcs.try_into().map_err(|_| Error::Cuda {
            rank,
            op: "loading refresh.cu".into(),
            detail: "expected three kernels".into(),
        })?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cu(rank, "SM count query"))?;
        let stream = ctx.new_stream().map_err(cu(rank, "cuStreamCreate"))?;
        // Collective when registered: every rank allocates the same sizes in the same order.
        let send = Memory::new(comm, capacity, registered)?;
        let recv = Memory::new(comm, capacity, registered)?;
        Ok(CudaRunner {
            rank,
            send: Some(send),
            recv: Some(recv),
            state: DeviceMem::new(STATE_BYTES, rank)?,
            scratch: DeviceMem::new(STATE_BYTES, rank)?,
            capacity,
            refresh,
            // Enough blocks to fill the GPU a few times over; the loop is grid-strided.
            max_grid: u32::try_from(sms).unwrap_or(1).max(1) * 4,
            pdl: RefreshPdl::default(),
            stream,
            ctx,
        })
    }

    /// How the refresh takes part in programmatic dependent launch (see refresh.cu).
    pub fn with_pdl(mut self, pdl: RefreshPdl) -> CudaRunner {
        self.pdl = pdl;
        self
    }

    /// Frees the buffers (collectively when registered).
    pub fn free(mut self, comm: &mut Communicator) {
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(rank = self.rank, "synchronize before freeing: {e}");
        }
        for m in [self.send.take(), self.recv.take()].into_iter().flatten() {
            m.free(comm);
        }
    }

    fn ptrs(&self) -> (u64, u64) {
        let p = |m: &Option<Memory>| m.as_ref().map_or(0, Memory::ptr);
        (p(&self.send), p(&self.recv))
    }

    fn kernel(&self, dtype: DType) -> &cs::CudaFunction {
        match dtype {
            DType::F32 => &self.refresh[0],
            DType::F16 => &self.refresh[1],
            _ => &self.refresh[2],
        }
    }

    /// Enqueues one refresh (see refresh.cu) on our stream.
    fn launch_refresh(&self, m: &Measure, state: u64, check: bool) -> Result<()> {
        let (send, recv) = self.ptrs();
        let mut args = RefreshArgs {
            send,
            recv,
            count: m.count as u64,
            seed: m.seed,
            state,
            rank: self.rank as i32,
            world: m.world as i32,
            op: op_code(m.op),
            check: i32::from(check),
            early: i32::from(self.pdl.producer),
        };
        let grid = (m.count.div_ceil(REFRESH_THREADS as usize) as u64)
            .clamp(1, u64::from(self.max_grid)) as u32;
        let mut params = [(&mut args as *mut RefreshArgs).cast::<c_void>()];
        // SAFETY: the kernel takes one RefreshArgs (copied at launch); it touches `count`
        // elements of our send and recv buffers (capacity checked in `measure`) and the
        // 16-byte state.
        unsafe {
            launch(
                self.kernel(m.dtype).cu_function(),
                (grid, REFRESH_THREADS),
                self.stream.cu_stream(),
                params.as_mut_ptr(),
                self.pdl.consumer,
            )
        }
        .map_err(driver(
            self.rank,
            format!("launching the refresh kernel ({} x {})", m.count, m.dtype),
        ))
    }

    /// Sets a state to {iter, 0, 0}.
    fn reset_state(&self, state: u64, iter: u32) -> Result<()> {
        let mut bytes = [0u8; STATE_BYTES];
        bytes[..4].copy_from_slice(&iter.to_le_bytes());
        // SAFETY: 16 bytes into our 16-byte allocation; synchronized before `bytes` goes.
        unsafe { result::memcpy_htod_async(state, &bytes, self.stream.cu_stream()) }
            .map_err(driver(self.rank, "writing the refresh state"))?;
        self.sync()
    }

    /// (next iteration, wrong count) of a state.
    fn read_state(&self, state: u64) -> Result<(u32, u64)> {
        let mut bytes = [0u8; STATE_BYTES];
        self.sync()?;
        // SAFETY: 16 bytes from our allocation into a live array, waited for below.
        unsafe { result::memcpy_dtoh_async(&mut bytes, state, self.stream.cu_stream()) }
            .map_err(driver(self.rank, "reading the refresh state"))?;
        self.sync()?;
        let iter = u32::from_le_bytes(bytes[..4].try_into().unwrap_or_default());
        let wrong = u64::from_le_bytes(bytes[8..].try_into().unwrap_or_default());
        Ok((iter, wrong))
    }

    fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(cu(self.rank, "bench stream synchronize"))
    }

    /// Poisons the output and writes the first input (iteration 0) on the device.
    fn prepare(&self, m: &Measure) -> Result<()> {
        let (_, recv) = self.ptrs();
        // SAFETY: the first `bytes` of our recv buffer.
        unsafe {
            result::memset_d8_async(
                recv,
                0xFF,
                m.count * m.dtype.size(),
                self.stream.cu_stream(),
            )
        }
        .map_err(driver(self.rank, "poisoning the output"))?;
        self.reset_state(self.state.ptr, u32::MAX)?;
        self.launch_refresh(m, self.state.ptr, false)?;
        self.sync()
    }

    /// Times `one` (which enqueues one unit of work on our stream): eager `warmup` + `iters`
    /// units, or graphs of `k` units. Returns (microseconds per unit, units enqueued in all).
    fn time_loop(
        &self,
        comm: &mut Communicator,
        m: &Measure,
        mut one: impl FnMut(&mut Communicator) -> Result<()>,
    ) -> Result<(f64, u64)> {
        let rank = self.rank;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .ctx
            .new_event(flags)
            .map_err(cu(rank, "cuEventCreate"))?;
        let end = self
            .ctx
            .new_event(flags)
            .map_err(cu(rank, "cuEventCreate"))?;
        let iters = m.iters.max(1);
        let (timed, total) = match m.graph {
            None => {
                for _ in 0..m.warmup {
                    one(comm)?;
                }
                self.sync()?;
                start
                    .record(&self.stream)
                    .map_err(cu(rank, "cuEventRecord"))?;
                for _ in 0..iters {
                    one(comm)?;
                }
                (iters, m.warmup + iters)
            }
            Some(k) => {
                let k = k.max(1);
                self.sync()?;
                let g = crate::gpu::capture(&self.stream, comm, k, &mut one)?;
                let (warm, reps) = (m.warmup.div_ceil(k).max(1), iters.div_ceil(k));
                for _ in 0..warm {
                    g.launch().map_err(cu(rank, "cuGraphLaunch"))?;
                }
                self.sync()?;
                start
                    .record(&self.stream)
                    .map_err(cu(rank, "cuEventRecord"))?;
                for _ in 0..reps {
                    g.launch().map_err(cu(rank, "cuGraphLaunch"))?;
                }
                (reps * k, (warm + reps) * k)
            }
        };
        end.record(&self.stream)
            .map_err(cu(rank, "cuEventRecord"))?;
        self.sync()?;
        // Kernels record failures (timeouts, mismatches) on the device; this surfaces them.
        comm.synchronize()?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(cu(rank, "cuEventElapsedTime"))?;
        Ok((f64::from(ms) * 1e3 / timed as f64, total as u64))
    }

    /// Microseconds per refresh launched alone, the measured loop's way (eager or graphs), on
    /// the scratch state.
    fn time_refresh(&self, comm: &mut Communicator, m: &Measure) -> Result<f64> {
        self.reset_state(self.scratch.ptr, 0)?;
        let (us, _) =
            self.time_loop(comm, m, |_| self.launch_refresh(m, self.scratch.ptr, true))?;
        Ok(us)
    }

    /// One measurement (see the module comment).
    pub fn measure(&self, comm: &mut Communicator, m: &Measure) -> Result<Measured> {
        let bytes = m.count * m.dtype.size();
        if bytes > self.capacity {
            return Err(Error::invalid(
                self.rank,
                "bench",
                "message exceeds the buffers",
            ));
        }
        self.ctx
            .bind_to_thread()
            .map_err(cu(self.rank, "binding the context"))?;
        // The refresh alone, same launches, on a scratch state (its checks fail: ignored),
        // timed before the measured loop and again after it (see `refresh_us` below). Before
        // `prepare`: it overwrites the input that `prepare` then writes afresh.
        let refresh_before_us = self.time_refresh(comm, m)?;
        self.prepare(m)?;
        comm.bootstrap().barrier()?;
        let (send, recv) = self.ptrs();
        let stream = self.stream.cu_stream() as *mut c_void;
        let (gross_us, calls) = self.time_loop(comm, m, |comm| {
            // SAFETY: both buffers hold `capacity` >= bytes on the communicator's GPU, do not
            // overlap, and live until `free` (after a synchronize).
            unsafe {
                comm.all_reduce_raw(
                    send as *const c_void,
                    recv as *mut c_void,
                    m.count,
                    m.dtype,
                    m.op,
                    m.algo,
                    stream,
                )?;
            }
            self.launch_refresh(m, self.state.ptr, true)
        })?;
        let (next_iter, wrong_calls) = self.read_state(self.state.ptr)?;
        if u64::from(next_iter) != calls {
            return Err(Error::invalid(
                self.rank,
                "bench",
                format!("the refresh ran {next_iter} times for {calls} calls"),
            ));
        }
        // The last call's output, checked here element by element.
        let mut out = vec![0u8; bytes];
        // SAFETY: `bytes` from our recv buffer into `out`, waited for below.
        unsafe { result::memcpy_dtoh_async(&mut out, recv, self.stream.cu_stream()) }.map_err(
            driver(
                self.rank,
                format!("copying {bytes} bytes of results from the device"),
            ),
        )?;
        self.sync()?;
        let salts = pattern::salts(m.seed, m.world);
        let wrong_final = pattern::count_wrong(m.dtype, m.op, &salts, next_iter - 1, &out, m.world);
        // The smaller of the two: a refresh loop slowed by the machine (another process, a
        // clock change) would otherwise be subtracted in full and make the all-reduce look
        // faster than it is, even faster than nothing. With the smaller one, noise in the
        // refresh's timing can only make the reported time larger.
        let refresh_us = refresh_before_us.min(self.time_refresh(comm, m)?);
        let mut rounds = [0.0; super::MAX_ROUNDS];
        rounds[0] = gross_us - refresh_us;
        Ok(Measured {
            gross_us,
            refresh_us,
            calls,
            wrong_calls,
            wrong_final,
            rounds,
            nrounds: 1,
        })
    }
}

fn op_code(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max => 1,
        _ => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipcreduce::backend::cuda::kernels;

    /// Compiles refresh.cu with NVRTC (no GPU needed); `IPCREDUCE_REQUIRE_NVRTC=1` turns a
    /// skip into a failure. Every kernel is there and takes one argument of our struct's size.
    #[test]
    fn refresh_kernel_compiles_and_matches_its_arguments() {
        if !kernels::nvrtc_for_tests() {
            return;
        }
        for arch in ["sm_80", "sm_90"] {
            let ptx = kernels::compile_source("refresh.cu", REFRESH_SOURCE, arch, &[])
                .unwrap_or_else(|e| panic!("{e}"))
                .to_src();
            for name in ["ipcr_refresh_f32", "ipcr_refresh_f16", "ipcr_refresh_bf16"] {
                assert!(ptx.contains(&format!(".entry {name}")), "{arch}: {name}");
                let param = format!("{name}_param_0[{}]", std::mem::size_of::<RefreshArgs>());
                assert!(ptx.contains(&param), "{arch}: {name} does not take {param}");
            }
            assert!(
                ptx.contains("atom.global.add.u64"),
                "{arch}: wrong count not summed"
            );
        }
        assert!(REFRESH_SOURCE.contains(&format!("#define REFRESH_THREADS {REFRESH_THREADS}")));
    }
}
