//! The phase-stamp ring of one communicator (with `IPCREDUCE_TRACE`; see "Phase stamps" in
//! kernels/prims.cuh and [`crate::flight::stamps`]): device memory the traced kernels stamp
//! into, copied into a pinned host mirror when the trace is read, and the GPU clock's tick and
//! anchors against the host's wall clock.
//!
//! Why device memory: each stamp written across PCIe into host-mapped memory made an eager
//! call's kernel end later (the grid's writes are flushed before it completes): 1.26x the
//! untraced time at 64 KiB and 1.14x at 256 KiB, against 1.04x and 1.06x with the stamps in
//! device memory (one H100 under MPS, bench/results/2026-12-07-h100-trace-ring/). The ring is
//! read only when a trace is written (at close, at a failure, `write_trace`), so its copy costs
//! nothing per call. The copy runs on a private non-blocking stream on a copy engine, so it
//! does not queue behind a kernel that still waits for a peer (every such wait is bounded and
//! a timed-out kernel returns: the context stays usable); it is waited for at most
//! [`ANCHOR_WAIT`], and a copy that has not finished by then leaves the stamps of the previous
//! read (each word carries its call's tag, so an older word is never taken for a newer call's).
//!
//! The anchors come from a one-thread kernel on the same stream that reads %globaltimer and
//! writes it into mapped memory; the host spins on that word and reads its own clock when it
//! lands (a PCIe write, about a microsecond). At a read the GPU may be stuck in a call that
//! waits for a peer: the anchor is then given up after [`ANCHOR_WAIT`] and the start's anchor
//! alone is used (no drift correction), so writing a trace never waits on the GPU for long.

use super::driver;
use super::kernels::variants::{self, Target};
use crate::error::Result;
use crate::flight::stamps::{self, CallStamps, Clock};
use cudarc::driver::{safe as cs, sys};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// Pinned host memory: the ring's mirror ([`stamps::WORDS`]), then the clock kernel's
    /// output ([`CLOCK_WORDS`]).
    host: *mut u64,
    /// `host`'s device address (the clock kernel writes its output there).
    mapped: u64,
    /// The ring itself, in device memory: the address the traced kernels stamp into.
    ring: u64,
    /// A copy of the ring into the mirror did not finish in time and may still run: the ring
    /// and the mirror are then leaked rather than freed under it, and not copied again.
    copy_pending: AtomicBool,
    rank: usize,
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
        let clock = Mutex::new(ClockKernel::new(ctx, target, rank)?);
        let words = stamps::WORDS + CLOCK_WORDS;
        let (host, mapped) = driver::host_alloc_mapped(words * 8, rank)?;
        let mapped = match mapped {
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
        let ring = match Self::device_ring(rank) {
            Ok(r) => r,
            Err(e) => {
                // SAFETY: allocated above, never used.
                unsafe { driver::free_host(host.cast()) };
                return Err(e);
            }
        };
        let mut ring = PhaseRing {
            host,
            mapped,
            ring,
            copy_pending: AtomicBool::new(false),
            calls: Mutex::new(vec![(0, 0); stamps::CALLS]),
            current: AtomicU64::new(0),
            clock,
            rank,
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

    /// The ring in device memory, zeroed (a zero word is no call's: call numbers start at 1).
    fn device_ring(rank: usize) -> Result<u64> {
        let bytes = stamps::WORDS * 8;
        let ring = driver::mem_alloc(bytes, rank)?;
        // SAFETY: just allocated; no kernel has its address.
        if let Err(e) =
            unsafe { driver::zero(ring, bytes, rank, || "zeroing the phase-stamp ring".into()) }
        {
            // SAFETY: allocated above, never used.
            unsafe { driver::mem_free(ring) };
            return Err(e);
        }
        Ok(ring)
    }

    /// The ring's device address for call `kseq`'s kernel arguments (`Args::phases`), which
    /// the call's kernels stamp under the flight recorder's current call.
    pub fn note(&self, kseq: u64) -> u64 {
        let seq = self.current.load(Ordering::Relaxed);
        let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        calls[kseq as usize % stamps::CALLS] = (kseq, seq);
        self.ring
    }

    /// Copies the ring into the mirror, waited for at most [`ANCHOR_WAIT`] (see the module
    /// doc); where it cannot, the mirror keeps the previous read's stamps.
    fn pull(&self) {
        let rank = self.rank;
        let k = self.clock.lock().unwrap_or_else(|e| e.into_inner());
        if self.copy_pending.load(Ordering::Acquire) || k.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: the mirror is WORDS words of our pinned memory, the ring as many; the copy
        // is waited for below, or the mirror is never freed (copy_pending).
        let mirror =
            unsafe { std::slice::from_raw_parts_mut(self.host.cast::<u8>(), stamps::WORDS * 8) };
        // SAFETY: as above.
        if let Err(e) = unsafe { driver::copy_from_device_async(mirror, self.ring, k.stream, rank) }
        {
            tracing::warn!(rank, "phase stamps: the ring's copy failed: {e}");
            return;
        }
        let until = Instant::now() + ANCHOR_WAIT;
        loop {
            // SAFETY: a live stream of ours.
            match unsafe { sys::cuStreamQuery(k.stream) } {
                sys::CUresult::CUDA_SUCCESS => return,
                sys::CUresult::CUDA_ERROR_NOT_READY if Instant::now() <= until => {
                    std::hint::spin_loop()
                }
                r => {
                    // Not finished in time, or failed: either way it may still be queued.
                    self.copy_pending.store(true, Ordering::Release);
                    let what = if r == sys::CUresult::CUDA_ERROR_NOT_READY {
                        format!("did not finish within {ANCHOR_WAIT:?}")
                    } else {
                        format!("failed ({r:?})")
                    };
                    tracing::warn!(
                        rank,
                        "phase stamps: the ring's copy {what}; the trace keeps the stamps read \
                         before, and the ring is not read again"
                    );
                    return;
                }
            }
        }
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
        let out = self.mapped + (stamps::WORDS * 8) as u64;
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
        if self.copy_pending.load(Ordering::Acquire) {
            return; // a copy may still read the ring and write the mirror: both leaked
        }
        // The ring's context current on whichever thread drops the last owner.
        let clock = self.clock.get_mut().unwrap_or_else(|e| e.into_inner());
        if clock.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: allocated by cuMemAlloc and cuMemHostAlloc, freed once; the last owner goes
        // after every kernel that had their addresses finished (else teardown.rs leaks it).
        unsafe {
            driver::mem_free(self.ring);
            driver::free_host(self.host.cast());
        }
    }
}

impl stamps::Source for PhaseRing {
    fn set_call(&self, seq: u64) {
        self.current.store(seq, Ordering::Relaxed);
    }

    fn read(&self) -> (Vec<CallStamps>, u64) {
        self.pull();
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
