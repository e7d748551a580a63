//! The device timeline (cuda, `IPCREDUCE_TIMELINE=1`): when each recorded call ran on its
//! stream. Two CUDA events per call, recorded on the call's own stream just before the backend
//! enqueues its work and just after, so the kernels are untouched and the span covers every
//! path (kernels, copy engines, NCCL). A call whose kernel stamps its phases (with
//! `IPCREDUCE_TRACE`) records none: its span is its blocks' first start and last end
//! (`CallStamps::span`), since two timed events between consecutive kernels cost an eager call
//! 7-8 us (measured on an H100 under MPS: 2.2-4.3x an untraced call up to 256 KiB, where the
//! stamps alone cost 1.0-1.5x). The events live in a ring of at most
//! [`MAX_CALLS`] pairs (created on first use, then re-recorded), and are read back only when
//! the flight ring is written (a failure's dump, or the trace at close): a call not finished by
//! then has no device span, and nothing ever waits for the stream.
//!
//! Event times are turned into host wall-clock ns through two anchors, each an event recorded
//! on a private, empty stream and waited for between two readings of the wall clock: one when
//! the timeline is made, one at the read. The GPU's clock drifts against the host's (9 ppm
//! measured on an H200: 10 us over the 1.2 s of a bench), so event times are measured back
//! from the read's anchor and scaled by the two clocks' ratio between the anchors ([`fit`]).
//! `cuEventElapsedTime` gives float milliseconds (resolution about 0.5 us, and the float's 24
//! bits: 6 us of rounding for an event 100 s before the read).
//!
//! Off (the default), the recorder holds no timeline: recording a call tests one `Option`.

use cudarc::driver::sys;
use std::collections::HashMap;

/// Event pairs kept at most (the flight ring may be larger; older calls then have no span).
pub const MAX_CALLS: usize = 4096;

struct Slot {
    seq: u64,
    begin: sys::CUevent,
    end: sys::CUevent,
    /// The begin event was recorded for `seq` (a call captured into a graph records none).
    begun: bool,
    /// Both events were recorded for `seq`.
    recorded: bool,
}

/// One communicator's event ring.
pub struct Timeline {
    ctx: sys::CUcontext,
    slots: Vec<Slot>,
    /// Slots at most (`Vec::capacity` may be larger than asked).
    cap: usize,
    /// A driver call failed: recording stopped (said once, as a warning).
    broken: bool,
    /// The first anchor (see the module doc), if it could be taken.
    start: Option<(sys::CUevent, u64)>,
}

/// Host ns per device ns between two anchors `device_ms` apart on the GPU's clock and
/// `host_ns` apart on the host's; 1 where they are too close to tell or disagree beyond any
/// drift (0.1%: one of them is wrong).
pub fn fit(device_ms: f32, host_ns: u64) -> f64 {
    let device_ns = f64::from(device_ms) * 1e6;
    if device_ns < 1e8 {
        return 1.0;
    }
    let scale = host_ns as f64 / device_ns;
    if (scale - 1.0).abs() > 1e-3 {
        1.0
    } else {
        scale
    }
}

/// The host time of an event `ms_before` (GPU clock) before the anchor taken at host `at_ns`.
pub fn host_ns(ms_before: f32, at_ns: u64, scale: f64) -> u64 {
    at_ns.saturating_sub((f64::from(ms_before) * 1e6 * scale) as u64)
}

// SAFETY: the handles are the driver's; the communicator (and so its timeline) is used from
// one thread at a time, and the driver's calls may come from any thread with the context
// current (bound before each use).
unsafe impl Send for Timeline {}

fn ok(r: sys::CUresult) -> bool {
    r == sys::CUresult::CUDA_SUCCESS
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl Timeline {
    /// A timeline of the context current on this thread (the backend's, bound at init), for
    /// `calls` calls (capped at [`MAX_CALLS`]); None where no context is current.
    pub fn new(calls: usize) -> Option<Timeline> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one handle.
        if !ok(unsafe { sys::cuCtxGetCurrent(&mut ctx) }) || ctx.is_null() {
            return None;
        }
        let cap = calls.clamp(1, MAX_CALLS);
        let mut t = Timeline {
            ctx,
            slots: Vec::with_capacity(cap),
            cap,
            broken: false,
            start: None,
        };
        t.start = t.anchor();
        Some(t)
    }

    fn fail(&mut self, what: &str, r: sys::CUresult) {
        if !self.broken {
            tracing::warn!("device timeline: {what} failed ({r:?}); no more device spans");
        }
        self.broken = true;
    }

    /// The calling thread may have another context current (as the backend's own bind).
    fn bind(&mut self) -> bool {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a thread-local read, then a set of our own (live) context.
        unsafe {
            if ok(sys::cuCtxGetCurrent(&mut cur)) && cur == self.ctx {
                return true;
            }
            let r = sys::cuCtxSetCurrent(self.ctx);
            if !ok(r) {
                self.fail("binding the context", r);
                return false;
            }
        }
        true
    }

    fn slot(&mut self, seq: u64) -> Option<&mut Slot> {
        let i = ((seq - 1) % self.cap as u64) as usize;
        // Calls whose span comes from their kernels' stamps record no events: the slots of
        // the calls before this one may not exist yet.
        while self.slots.len() <= i {
            let mut ev = [std::ptr::null_mut(); 2];
            for e in &mut ev {
                // SAFETY: writes one handle; timing enabled (the default flags).
                let r =
                    unsafe { sys::cuEventCreate(e, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) };
                if !ok(r) {
                    self.fail("cuEventCreate", r);
                    return None;
                }
            }
            self.slots.push(Slot {
                seq: 0,
                begin: ev[0],
                end: ev[1],
                begun: false,
                recorded: false,
            });
        }
        self.slots.get_mut(i)
    }

    /// Before call `seq`'s work is enqueued on `stream`.
    pub fn begin(&mut self, seq: u64, stream: *mut std::ffi::c_void) {
        if self.broken || !self.bind() {
            return;
        }
        let stream = stream as sys::CUstream;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: queries the caller's stream, which the call itself uses.
        let r = unsafe { sys::cuStreamIsCapturing(stream, &mut status) };
        // Captured into a graph: the events would be graph nodes with no times of their own.
        let plain = ok(r) && status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let Some(slot) = self.slot(seq) else { return };
        slot.seq = seq;
        slot.begun = false;
        slot.recorded = false;
        if !plain {
            return;
        }
        let begin = slot.begin;
        // SAFETY: our event, the caller's stream.
        let r = unsafe { sys::cuEventRecord(begin, stream) };
        if ok(r) {
            slot.begun = true;
        } else {
            self.fail("cuEventRecord", r);
        }
    }

    /// After call `seq`'s work was enqueued (Ok or not) on `stream`.
    pub fn end(&mut self, seq: u64, stream: *mut std::ffi::c_void) {
        if self.broken || self.slots.is_empty() {
            return;
        }
        let i = ((seq - 1) % self.cap as u64) as usize;
        // Begun for this call: its stream was not capturing then, nor is it now (a capture
        // begins and ends between calls, on the caller's side).
        let Some(slot) = self.slots.get(i).filter(|s| s.seq == seq && s.begun) else {
            return;
        };
        let end = slot.end;
        // SAFETY: our event, the caller's stream.
        let r = unsafe { sys::cuEventRecord(end, stream as sys::CUstream) };
        if ok(r) {
            self.slots[i].recorded = true;
        } else {
            self.fail("cuEventRecord", r);
        }
    }

    /// Per call whose two events have completed: its device begin and end, host wall-clock
    /// ns. Never waits for a call's stream.
    pub fn spans(&mut self) -> HashMap<u64, (u64, u64)> {
        let mut out = HashMap::new();
        if self.slots.is_empty() || !self.bind() {
            return out;
        }
        let Some((anchor, at_ns)) = self.anchor() else {
            return out;
        };
        // SAFETY: two of our completed events (the entry point this CUDA version has).
        let elapsed = |from: sys::CUevent| unsafe {
            cudarc::driver::result::event::elapsed(from, anchor).ok()
        };
        let scale = self
            .start
            .and_then(|(ev, ns)| Some(fit(elapsed(ev)?, at_ns.saturating_sub(ns))))
            .unwrap_or(1.0);
        let before = |e: sys::CUevent| Some(host_ns(elapsed(e)?, at_ns, scale));
        for s in self.slots.iter().filter(|s| s.recorded) {
            // SAFETY: our events; a query does not wait.
            let done = unsafe { ok(sys::cuEventQuery(s.begin)) && ok(sys::cuEventQuery(s.end)) };
            if !done {
                continue;
            }
            if let (Some(b), Some(e)) = (before(s.begin), before(s.end)) {
                out.insert(s.seq, (b, e.max(b)));
            }
        }
        // SAFETY: ours, completed.
        unsafe { sys::cuEventDestroy_v2(anchor) };
        out
    }

    /// An event recorded now on a private empty stream, and the wall clock at that moment (the
    /// middle of the readings around its record and wait).
    fn anchor(&mut self) -> Option<(sys::CUevent, u64)> {
        let mut stream: sys::CUstream = std::ptr::null_mut();
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: a stream and an event of our own, destroyed here or by the caller.
        unsafe {
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            if !ok(sys::cuStreamCreate(&mut stream, flags)) {
                return None;
            }
            let flags = sys::CUevent_flags::CU_EVENT_DEFAULT as u32;
            if !ok(sys::cuEventCreate(&mut ev, flags)) {
                sys::cuStreamDestroy_v2(stream);
                return None;
            }
            let t0 = now_ns();
            let r = sys::cuEventRecord(ev, stream);
            // An empty stream: the event completes at once (the wait is bounded by the GPU
            // reaching it, not by any call's work).
            let waited = ok(r) && ok(sys::cuEventSynchronize(ev));
            let t1 = now_ns();
            sys::cuStreamDestroy_v2(stream);
            if !waited {
                sys::cuEventDestroy_v2(ev);
                return None;
            }
            Some((ev, t0 + (t1 - t0) / 2))
        }
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        if !self.bind() {
            return;
        }
        if let Some((ev, _)) = self.start {
            // SAFETY: our event, never used again.
            unsafe { sys::cuEventDestroy_v2(ev) };
        }
        for s in &self.slots {
            // SAFETY: our events, never used again.
            unsafe {
                sys::cuEventDestroy_v2(s.begin);
                sys::cuEventDestroy_v2(s.end);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drifting_gpu_clock_is_scaled_to_the_host_clock_between_the_anchors() {
        // The GPU's clock runs 9 ppm slow: 1.2 s of host time are 1.2 s - 10.8 us on it.
        let host_span = 1_200_000_000u64;
        let device_ms = (host_span as f64 * (1.0 - 9e-6) / 1e6) as f32;
        let scale = fit(device_ms, host_span);
        assert!((scale - 1.0 - 9e-6).abs() < 1e-7, "{scale}");
        // An event at the first anchor lands on it within a microsecond (the float's rounding);
        // unscaled it would be 10.8 us late.
        let at = 5_000_000_000u64;
        let t = host_ns(device_ms, at, scale);
        assert!(t.abs_diff(at - host_span) < 1_000, "{t}");
        assert!(host_ns(device_ms, at, 1.0).abs_diff(at - host_span) > 10_000);
        // Anchors too close, or a ratio no clock drifts by: no scaling.
        assert_eq!(fit(50.0, 50_000_000), 1.0);
        assert_eq!(fit(1000.0, 1_100_000_000), 1.0);
    }

    /// On a GPU (ignored elsewhere): spans of work on a stream come back in order, inside the
    /// host window they were issued and waited in, and what recording costs the host per call
    /// (two event records and two capture queries), against the same loop without it:
    /// `cargo test --release -p ipcreduce --lib flight::timeline -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn spans_on_a_gpu_and_their_cost() {
        let ctx = cudarc::driver::CudaContext::new(0).expect("a GPU");
        ctx.bind_to_thread().unwrap();
        let stream = ctx.new_stream().unwrap();
        let s = stream.cu_stream().cast::<std::ffi::c_void>();
        let mut buf = stream.alloc_zeros::<u8>(256 << 20).unwrap();
        let mut t = Timeline::new(64).expect("a context is current");
        let t0 = now_ns();
        // Calls 4 and 5 record nothing (their span would come from their kernels' stamps):
        // call 6 still gets a slot of its own.
        for seq in [1u64, 2, 3, 6] {
            t.begin(seq, s);
            stream.memset_zeros(&mut buf).unwrap();
            t.end(seq, s);
        }
        stream.synchronize().unwrap();
        let t1 = now_ns();
        let spans = t.spans();
        assert_eq!(spans.len(), 4, "{spans:?}");
        assert!(
            spans.contains_key(&6) && !spans.contains_key(&4),
            "{spans:?}"
        );
        let mut last_end = t0;
        for seq in [1u64, 2, 3, 6] {
            let (b, e) = spans[&seq];
            // The anchor's error (the midpoint of a record and a wait) is a few us.
            let slack = 50_000;
            assert!(
                b + slack >= last_end && e >= b && e <= t1 + slack,
                "{seq}: {spans:?} {t0} {t1}"
            );
            last_end = e;
        }
        // Host cost per call, the stream kept busy by nothing but the events.
        let n = 20_000u64;
        let time = |on: bool, t: &mut Timeline| {
            let a = std::time::Instant::now();
            for seq in 1..=n {
                if on {
                    t.begin(seq, s);
                    t.end(seq, s);
                }
                std::hint::black_box(seq);
            }
            a.elapsed().as_nanos() as f64 / n as f64
        };
        let mut t = Timeline::new(MAX_CALLS).unwrap();
        let off = time(false, &mut t);
        let on = time(true, &mut t);
        stream.synchronize().unwrap();
        println!("device timeline: {on:.0} ns per call on, {off:.1} ns off (host time)");
        drop(t);
    }
}
