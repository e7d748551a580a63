//! The streams a communicator's calls run on.
//!
//! A call runs on the stream its caller names, as CUDA defines it: handle 0 is the legacy
//! default stream (never our private one). Two rules follow:
//! - **Order**: calls of one communicator happen in call order even when they come on
//!   different streams (the kernels of consecutive calls share the workspace). On every change
//!   of stream the new stream waits for an event recorded after the previous call.
//! - **Teardown**: the communicator must not free memory that a call on any stream may still
//!   use. An event is recorded after every call on a caller's stream (the caller may destroy
//!   that stream before dropping us); streams that live as long as we do (our own, the legacy
//!   default stream) get theirs when needed. Drop waits for all of them, within a deadline.
//!
//! Calls captured into a CUDA graph are ordered by the graph and the stream it is launched on:
//! nothing is recorded or waited for during capture. Every call asks CUDA whether its stream
//! is capturing ([`capture`]): the answer names the call's origin (eager, or which graph),
//! which goes into its identity (captures.rs).
//!
//! The decisions ([`Tracker`]) are plain logic over an [`Events`] implementation, so they are
//! tested without a GPU; [`CudaEvents`] carries them out with the driver.

use super::driver;
use crate::error::Result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A stream handle as a map key.
pub(super) type Key = usize;

/// `CU_STREAM_LEGACY`: another name of the legacy default stream.
const LEGACY_ALIAS: Key = 0x1;
/// `CU_STREAM_PER_THREAD`: one handle for a different stream in every thread, so two calls
/// under it may be on two streams.
const PER_THREAD: Key = 0x2;

/// What the tracker asks of CUDA.
pub(super) trait Events {
    /// Records the stream's event (creating it the first time) after the work enqueued so far.
    fn record(&mut self, stream: Key) -> Result<()>;
    /// Makes `waiter` wait for the event last recorded on `on`.
    fn wait(&mut self, waiter: Key, on: Key) -> Result<()>;
    /// Whether the event last recorded on `stream` has completed.
    fn done(&mut self, stream: Key) -> Result<bool>;
    /// Forgets the stream's event (it completed; the stream may be gone).
    fn forget(&mut self, stream: Key);
    /// Streams that have an event.
    fn streams(&self) -> Vec<Key>;
    /// How many streams have an event (checked after every call: no list made).
    fn count(&self) -> usize;
}

/// Keeps the calls of one communicator ordered across streams and knows what to wait for.
pub(super) struct Tracker {
    /// Our private stream.
    own: Key,
    /// The stream of the last call (outside capture).
    last: Option<Key>,
    /// Streams that live as long as we do and had work since their event was last recorded.
    dirty: Vec<Key>,
}

/// Above this many tracked caller streams, completed ones are forgotten.
const PRUNE_ABOVE: usize = 32;

impl Tracker {
    pub fn new(own: Key) -> Tracker {
        Tracker {
            own,
            last: None,
            dirty: Vec::new(),
        }
    }

    /// Our own stream and the legacy default stream outlive every call.
    fn lasting(&self, s: Key) -> bool {
        s == self.own || s == 0 || s == LEGACY_ALIAS
    }

    /// Before a call on `s`: if the previous call ran on another stream, `s` waits for it.
    pub fn before(&mut self, ev: &mut impl Events, s: Key, capturing: bool) -> Result<()> {
        if capturing {
            return Ok(());
        }
        match self.last {
            // The per-thread handle may name another thread's stream than the last call's:
            // waiting for its event (recorded after that call) costs one wait and keeps order.
            Some(p) if p != s || s == PER_THREAD => {
                if self.lasting(p) {
                    // Caller streams got their event right after the call.
                    ev.record(p)?;
                    self.dirty.retain(|d| *d != p);
                }
                ev.wait(s, p)
            }
            _ => Ok(()),
        }
    }

    /// After a call was enqueued on `s`.
    pub fn after(&mut self, ev: &mut impl Events, s: Key, capturing: bool) -> Result<()> {
        if capturing {
            return Ok(());
        }
        if self.lasting(s) {
            if !self.dirty.contains(&s) {
                self.dirty.push(s);
            }
        } else {
            // Every call, not only on a change of stream: the caller may destroy its stream
            // right after this call, and then teardown has only this event to know when the
            // call's work is done (recording on a destroyed stream later is not allowed).
            ev.record(s)?;
            if ev.count() > PRUNE_ABOVE {
                for k in ev.streams() {
                    if k != s && !self.lasting(k) && ev.done(k)? {
                        ev.forget(k);
                    }
                }
            }
        }
        self.last = Some(s);
        Ok(())
    }

    /// Work on our own stream that did not go through [`Tracker::after`] (test buffers).
    pub fn used_own(&mut self) {
        if !self.dirty.contains(&self.own) {
            self.dirty.push(self.own);
        }
    }

    /// Records an event on every stream that may still run our work; then waits for all of
    /// them until `deadline`. Ok(true) when everything finished, Ok(false) at the deadline.
    pub fn drain(&mut self, ev: &mut impl Events, deadline: Instant) -> Result<bool> {
        for s in std::mem::take(&mut self.dirty) {
            ev.record(s)?;
        }
        let mut pending = ev.streams();
        loop {
            let mut still = Vec::new();
            for s in pending {
                if !ev.done(s)? {
                    still.push(s);
                }
            }
            if still.is_empty() {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            pending = still;
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// [`Events`] with real CUDA events, one per stream.
pub(super) struct CudaEvents {
    rank: usize,
    events: HashMap<Key, sys::CUevent>,
    /// The stream whose event was used last and that event: a caller's calls come on one
    /// stream, and its event after each call is then found without hashing the handle.
    /// Always an entry of `events` (cleared when that entry goes).
    last: Option<(Key, sys::CUevent)>,
}

// SAFETY: CUDA events may be used from any thread; we hold them behind &mut.
unsafe impl Send for CudaEvents {}

impl CudaEvents {
    pub fn new(rank: usize) -> CudaEvents {
        CudaEvents {
            rank,
            events: HashMap::new(),
            last: None,
        }
    }

    fn event(&mut self, stream: Key) -> Result<sys::CUevent> {
        if let Some((k, e)) = self.last {
            if k == stream {
                return Ok(e);
            }
        }
        let e = match self.events.get(&stream) {
            Some(e) => *e,
            None => {
                // Destroyed in forget() or Drop.
                let e = driver::event_create(self.rank, || "cuEventCreate (stream order)".into())?;
                self.events.insert(stream, e);
                e
            }
        };
        self.last = Some((stream, e));
        Ok(e)
    }
}

impl Events for CudaEvents {
    fn record(&mut self, stream: Key) -> Result<()> {
        let e = self.event(stream)?;
        // SAFETY: our event on the caller's stream handle.
        unsafe {
            driver::event_record(e, stream as sys::CUstream, self.rank, || {
                format!("cuEventRecord on stream {stream:#x}")
            })
        }
    }

    fn wait(&mut self, waiter: Key, on: Key) -> Result<()> {
        let e = self.event(on)?;
        // SAFETY: our event; the waiter is the caller's live stream.
        unsafe {
            driver::stream_wait(waiter as sys::CUstream, e, self.rank, || {
                format!("stream {waiter:#x} waiting for the previous call on stream {on:#x}")
            })
        }
    }

    fn done(&mut self, stream: Key) -> Result<bool> {
        let Some(&e) = self.events.get(&stream) else {
            return Ok(true);
        };
        // SAFETY: our event.
        unsafe {
            driver::event_done(e, self.rank, || {
                format!("cuEventQuery (work on stream {stream:#x})")
            })
        }
    }

    fn forget(&mut self, stream: Key) {
        if self.last.is_some_and(|(k, _)| k == stream) {
            self.last = None;
        }
        if let Some(e) = self.events.remove(&stream) {
            // SAFETY: our event, destroyed once.
            unsafe { driver::event_destroy(e) };
        }
    }

    fn streams(&self) -> Vec<Key> {
        self.events.keys().copied().collect()
    }
    fn count(&self) -> usize {
        self.events.len()
    }
}

impl Drop for CudaEvents {
    fn drop(&mut self) {
        for (_, e) in self.events.drain() {
            // SAFETY: our event, destroyed once (a pending record completes on its own).
            unsafe { driver::event_destroy(e) };
        }
    }
}

/// The capture `stream` takes part in (its process-wide id), or None. The legacy default
/// stream is never captured (CUDA refuses capture there), so it is not asked.
pub(super) fn capture(stream: sys::CUstream, rank: usize) -> Result<Option<u64>> {
    let key = stream as Key;
    if key == 0 || key == LEGACY_ALIAS {
        return Ok(None);
    }
    // SAFETY: the caller's stream (its call vouched for it), or ours.
    unsafe { driver::stream_capture(stream, rank) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Logs what the tracker asks for; events complete when `finished` says so.
    #[derive(Default)]
    struct Log {
        ops: Vec<String>,
        recorded: HashSet<Key>,
        finished: HashSet<Key>,
    }

    impl Events for Log {
        fn record(&mut self, s: Key) -> Result<()> {
            self.ops.push(format!("record {s}"));
            self.recorded.insert(s);
            Ok(())
        }
        fn wait(&mut self, w: Key, on: Key) -> Result<()> {
            assert!(self.recorded.contains(&on), "waits on {on}, never recorded");
            self.ops.push(format!("wait {w} on {on}"));
            Ok(())
        }
        fn done(&mut self, s: Key) -> Result<bool> {
            Ok(self.finished.contains(&s))
        }
        fn forget(&mut self, s: Key) {
            self.recorded.remove(&s);
            self.ops.push(format!("forget {s}"));
        }
        fn streams(&self) -> Vec<Key> {
            let mut v: Vec<_> = self.recorded.iter().copied().collect();
            v.sort();
            v
        }
        fn count(&self) -> usize {
            self.recorded.len()
        }
    }

    const OWN: Key = 0x500;

    fn call(t: &mut Tracker, ev: &mut Log, s: Key) {
        t.before(ev, s, false).unwrap();
        ev.ops.push(format!("launch {s}"));
        t.after(ev, s, false).unwrap();
    }

    #[test]
    fn a_change_of_stream_waits_for_the_previous_call() {
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        call(&mut t, &mut ev, 0x10);
        call(&mut t, &mut ev, 0x10);
        call(&mut t, &mut ev, 0x20);
        call(&mut t, &mut ev, 0);
        call(&mut t, &mut ev, 0x10);
        assert_eq!(
            ev.ops,
            [
                "launch 16",
                "record 16",
                "launch 16",
                "record 16",
                "wait 32 on 16",
                "launch 32",
                "record 32",
                "wait 0 on 32",
                "launch 0",
                // The legacy stream lives on: its event is recorded when needed.
                "record 0",
                "wait 16 on 0",
                "launch 16",
                "record 16",
            ]
        );
    }

    #[test]
    fn the_per_thread_stream_always_waits_for_the_previous_call() {
        // Handle 0x2 is each thread's own stream: consecutive calls under it may come from two
        // threads, so each waits for the event recorded after the one before.
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        call(&mut t, &mut ev, 0x2);
        call(&mut t, &mut ev, 0x2);
        assert_eq!(
            ev.ops,
            [
                "launch 2",
                "record 2",
                "wait 2 on 2",
                "launch 2",
                "record 2"
            ]
        );
    }

    #[test]
    fn repeated_calls_on_a_lasting_stream_record_and_wait_for_no_event() {
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        call(&mut t, &mut ev, 0);
        call(&mut t, &mut ev, 0x10);
        // A caller's stream gets an event after every call.
        assert_eq!(ev.ops[ev.ops.len() - 1], "record 16");
        call(&mut t, &mut ev, OWN);
        let before = ev.ops.len();
        call(&mut t, &mut ev, OWN);
        call(&mut t, &mut ev, OWN);
        assert_eq!(ev.ops[before..], ["launch 1280", "launch 1280"]);
    }

    #[test]
    fn the_null_stream_is_not_our_stream() {
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        call(&mut t, &mut ev, OWN);
        call(&mut t, &mut ev, 0);
        assert_eq!(
            ev.ops,
            ["launch 1280", "record 1280", "wait 0 on 1280", "launch 0"]
        );
    }

    #[test]
    fn capture_records_and_waits_nothing() {
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        call(&mut t, &mut ev, 0x10);
        t.before(&mut ev, 0x20, true).unwrap();
        t.after(&mut ev, 0x20, true).unwrap();
        // The next eager call still follows the last eager one.
        call(&mut t, &mut ev, 0x10);
        assert_eq!(ev.ops, ["launch 16", "record 16", "launch 16", "record 16"]);
    }

    #[test]
    fn drain_covers_every_stream_and_respects_the_deadline() {
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        call(&mut t, &mut ev, 0x10);
        call(&mut t, &mut ev, 0);
        t.used_own();
        let soon = Instant::now() + Duration::from_millis(20);
        let t0 = Instant::now();
        assert!(!t.drain(&mut ev, soon).unwrap(), "nothing finished yet");
        assert!(t0.elapsed() < Duration::from_secs(2));
        assert_eq!(ev.streams(), [0, 0x10, OWN]);
        ev.finished.extend([0, 0x10, OWN]);
        assert!(t.drain(&mut ev, Instant::now()).unwrap());
    }

    #[test]
    fn many_caller_streams_do_not_pile_up() {
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        for s in 0..200 {
            let stream = 0x1000 + s;
            call(&mut t, &mut ev, stream);
            ev.finished.insert(stream);
        }
        assert!(
            ev.streams().len() <= PRUNE_ABOVE + 1,
            "{}",
            ev.streams().len()
        );
    }
}
