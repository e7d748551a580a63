//! The phase-stamp ring of one communicator (with `IPCREDUCE_TRACE`; see "Phase stamps" in
//! kernels/prims.cuh and [`crate::flight::stamps`]): host-mapped pinned memory the traced
//! kernels stamp into, which the host reads without a CUDA call, and the GPU clock's tick and
//! anchors against the host's wall clock.
//!
//! The anchors come from a one-thread kernel on a private stream that reads %globaltimer and
//! writes it into mapped memory; the host spins on that word and reads its own clock when it
//! lands (a PCIe write, about a microsecond). At a read the GPU may be stuck in a call that
//! waits for a peer: the anchor is then given up after [`ANCHOR_WAIT`] and the start's anchor
//! alone is used (no drift correction), so writing a trace never waits on the GPU for long.

use super::driver;
use super::kernels::variants::{self, Target};
use crate::error::Result;
use crate::flight::stamps::{self, CallStamps, Clock};
use cudarc::driver::{safe as cs, sys};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The clock kernel: out[0] = globaltimer at its end, out[1] = the smallest non-zero step of
/// the globaltimer over `spins` reads, then out[2] = `mark` (written last: the host spins on it).
const CLOCK_SOURCE: &str = r#"
extern "C" __global__ void ipcr_phase_clock(volatile u64 *out, int spins, u64 mark) {
    u64 prev, t, step = ~0ull;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(prev));
    for (int i = 0; i < spins; i++) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t != prev) {
            if (t - prev < step) step = t - prev;
            prev = t;
        }
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[0] = t;
    out[1] = step;
    __threadfence_system();
    out[2] = mark;
    __threadfence_system();
}
"#;

/// Reads of the globaltimer for the tick (a few hundred microseconds; 1 us ticks show).
const TICK_SPINS: i32 = 100_000;
/// How long an anchor is waited for.
const ANCHOR_WAIT: Duration = Duration::from_millis(200);
/// Words after the ring: the clock kernel's output.
const CLOCK_WORDS: usize = 3;

pub(super) struct PhaseRing {
    host: *mut u64,
    device: u64,
    /// Per ring slot: (kernel call number, flight call number) of the call that owns it.
    calls: Mutex<Vec<(u64, u64)>>,
    /// The flight recorder's current call (see [`stamps::Source::set_call`]).
    current: AtomicU64,
    clock: Mutex<ClockKernel>,
    tick_ns: u64,
    start: (u64, u64),
}

struct ClockKernel {
    ctx: Arc<cs::CudaContext>,
    _module: Arc<cs::CudaModule>,
    f: cs::CudaFunction,
    stream: sys::CUstream,
    mark: u64,
}

// SAFETY: the pinned memory is the process's; the ring's words are read and written whole with
// volatile accesses, and the host-side tables are behind mutexes. The stream and function are
// driver handles usable from any thread with the context bound (done before each use).
unsafe impl Send for PhaseRing {}
// SAFETY: as above.
unsafe impl Sync for PhaseRing {}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl PhaseRing {
    /// The ring of a communicator on `ctx` (current on this thread), its clock kernel compiled
    /// for `target`, the tick and the first anchor measured.
    pub fn new(ctx: &Arc<cs::CudaContext>, target: &Target, rank: usize) -> Result<Arc<PhaseRing>> {
        let words = stamps::WORDS + CLOCK_WORDS;
        let (host, mapped) = driver::host_alloc_mapped(words * 8, rank)?;
        let device = match mapped {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: just allocated, never used.
                unsafe { driver::free_host(host) };
                return Err(e);
            }
        };
        let host = host.cast::<u64>();
        // SAFETY: `words` u64 of our own pinned memory; no kernel has its address yet.
        unsafe { std::ptr::write_bytes(host, 0, words) };
        let mut ring = PhaseRing {
            host,
            device,
            calls: Mutex::new(vec![(0, 0); stamps::CALLS]),
            current: AtomicU64::new(0),
            clock: Mutex::new(ClockKernel::new(ctx, target, rank)?),
            tick_ns: 0,
            start: (0, 0),
        };
        let (gt, host_ns, tick) = ring.anchor().ok_or_else(|| crate::error::Error::Cuda {
            rank,
            op: "the phase-stamp clock".into(),
            detail: format!("the clock kernel did not answer within {ANCHOR_WAIT:?}"),
        })?;
        ring.tick_ns = tick;
        ring.start = (gt, host_ns);
        tracing::info!(rank, "phase stamps on: globaltimer tick {tick} ns");
        Ok(Arc::new(ring))
    }

    /// The ring's device address for call `kseq`'s kernel arguments (`Args::phases`), which
    /// the call's kernels stamp under the flight recorder's current call.
    pub fn note(&self, kseq: u64) -> u64 {
        let seq = self.current.load(Ordering::Relaxed);
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls[kseq as usize % stamps::CALLS] = (kseq, seq);
        self.device
    }

    fn word(&self, i: usize) -> u64 {
        assert!(i < stamps::WORDS + CLOCK_WORDS);
        // SAFETY: in bounds of our pinned memory; volatile: the GPU writes it.
        unsafe { self.host.add(i).read_volatile() }
    }

    /// (globaltimer, host ns, tick) from the clock kernel, None when it does not answer in time.
    fn anchor(&self) -> Option<(u64, u64, u64)> {
        let mut k = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        k.mark += 1;
        let out = self.device + (stamps::WORDS * 8) as u64;
        let (mut out, mut spins, mut mark) = (out, TICK_SPINS, k.mark);
        let mut params = [
            (&mut out as *mut u64).cast::<std::ffi::c_void>(),
            (&mut spins as *mut i32).cast(),
            (&mut mark as *mut u64).cast(),
        ];
        k.ctx.bind_to_thread().ok()?;
        // SAFETY: the kernel writes three words of our pinned memory, which outlives it (the
        // ring is leaked where work may still run, teardown.rs).
        let r = unsafe {
            driver::launch(
                k.f.cu_function(),
                1,
                1,
                k.stream,
                params.as_mut_ptr(),
                false,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!("phase stamps: clock kernel launch failed ({r:?})");
            return None;
        }
        let until = Instant::now() + ANCHOR_WAIT;
        let done = stamps::WORDS + 2;
        while self.word(done) != k.mark {
            if Instant::now() > until {
                return None;
            }
            std::hint::spin_loop();
        }
        let host_ns = now_ns();
        Some((
            self.word(stamps::WORDS),
            host_ns,
            self.word(stamps::WORDS + 1),
        ))
    }
}

impl ClockKernel {
    fn new(ctx: &Arc<cs::CudaContext>, target: &Target, rank: usize) -> Result<ClockKernel> {
        let cuda = |op: &str, e: cudarc::driver::DriverError| driver::from_cudarc(rank, op, e);
        let (cubin, _) =
            variants::source_cubin("the phase-stamp clock", CLOCK_SOURCE, target, &[])?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.to_vec()))
            .map_err(|e| cuda("loading the phase-stamp clock", e))?;
        let f = module
            .load_function("ipcr_phase_clock")
            .map_err(|e| cuda("loading ipcr_phase_clock", e))?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: writes one handle; destroyed in Drop.
        driver::ck(
            unsafe { sys::cuStreamCreate(&mut stream, flags) },
            rank,
            || "cuStreamCreate (phase-stamp clock)".into(),
        )?;
        Ok(ClockKernel {
            ctx: ctx.clone(),
            _module: module,
            f,
            stream,
            mark: 0,
        })
    }
}

impl Drop for ClockKernel {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: our stream, not used again.
            unsafe { sys::cuStreamDestroy_v2(self.stream) };
        }
    }
}

impl Drop for PhaseRing {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, freed once; the last owner goes after every
        // kernel that had its address finished (else teardown.rs leaks it).
        unsafe { driver::free_host(self.host.cast()) }
    }
}

impl stamps::Source for PhaseRing {
    fn set_call(&self, seq: u64) {
        self.current.store(seq, Ordering::Relaxed);
    }

    fn read(&self) -> (Vec<CallStamps>, u64) {
        let at = self.anchor().map(|(gt, ns, _)| (gt, ns));
        let clock = Clock::new(self.tick_ns, self.start, at);
        let calls = self.calls.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (
            stamps::decode(|i| self.word(i), &calls, &clock),
            self.tick_ns,
        )
    }
}

impl super::CudaComm {
    /// The ring the kernels stamp into while tracing, for the flight recorder's traces.
    pub fn phase_stamps(&self) -> Option<Arc<dyn stamps::Source>> {
        let ring = self.launch.phases.clone()?;
        Some(ring)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_clock_kernel_compiles() {
        if !super::super::kernels::nvrtc_for_tests() {
            return;
        }
        let ptx = super::super::kernels::compile_source("clock", super::CLOCK_SOURCE, "sm_90", &[])
            .unwrap_or_else(|e| panic!("{e}"))
            .to_src();
        assert!(ptx.contains("ipcr_phase_clock") && ptx.contains("%globaltimer"));
    }
}
