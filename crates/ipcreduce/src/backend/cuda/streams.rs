//! The streams a communicator's calls run on, and the order of its calls and graph replays.
//!
//! A call runs on the stream its caller names, as CUDA defines it: handle 0 is the legacy
//! default stream (never our private one). The rules:
//! - **Order**: the kernels of consecutive calls share the workspace and the protocol counters,
//!   so all the work of one communicator runs in the order the host issued it, whatever the
//!   streams: eager calls, and replays of CUDA graphs that captured calls. Before any call was
//!   captured, on every change of stream the new stream waits for an event recorded after the
//!   previous call. Once one was, every call waits for and records one order event: eager calls
//!   with plain waits and records, captured calls with external event nodes (the graph waits,
//!   at each replay, for the order event as last recorded before the replay was launched, and
//!   records it after the call). So a replay on any stream follows every call and replay
//!   issued before it, and an eager call on any stream follows every replay launched before it.
//!   The first captured call also waits (at replay) for the last eager call's event. Work the
//!   caller enqueues on its streams between our calls is the caller's to order.
//! - **Teardown**: the communicator must not free memory that a call on any stream may still
//!   use. An event is recorded after every call on a stream that may be destroyed before us
//!   (every stream but the legacy default stream, whose event is recorded when needed). Drop
//!   waits for all of them and for the order event, within a deadline. Graphs keep the memory
//!   their kernels use alive themselves (a CUDA user object, see [`hold_in_graph`]): a replay
//!   after the communicator closed finds the abort word raised and stops, reading no freed
//!   memory of ours.
//!
//! The decisions ([`Tracker`]) are plain logic over an [`Events`] implementation, so they are
//! tested without a GPU; [`CudaEvents`] carries them out with the driver.

use super::driver::{ck, driver_error};
use crate::error::Result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A stream handle as a map key.
pub(super) type Key = usize;

/// `CU_STREAM_LEGACY`: another name of the legacy default stream.
const LEGACY_ALIAS: Key = 0x1;

/// The key of the order event (see the module comment); other events are keyed by the stream
/// whose calls they follow.
pub(super) const ORDER: Key = usize::MAX;

/// What the tracker asks of CUDA. Events are named by [`Key`]: a stream's, or [`ORDER`].
/// `captured`: the stream is capturing, so the operation becomes an external event node of the
/// graph (it records or waits at every replay) instead of happening now.
pub(super) trait Events {
    /// Records `event` (creating it the first time) on `stream` after the work enqueued so far.
    fn record(&mut self, event: Key, stream: Key, captured: bool) -> Result<()>;
    /// Makes `waiter` wait for `event` as last recorded.
    fn wait(&mut self, waiter: Key, event: Key, captured: bool) -> Result<()>;
    /// Whether `event` as last recorded has completed.
    fn done(&mut self, event: Key) -> Result<bool>;
    /// Forgets `event` (it completed; its stream may be gone).
    fn forget(&mut self, event: Key);
    /// The events that exist.
    fn streams(&self) -> Vec<Key>;
}

/// Keeps the calls of one communicator ordered across streams and graphs, and knows what to
/// wait for.
pub(super) struct Tracker {
    /// Our private stream (test buffers use it outside calls).
    own: Key,
    /// The stream of the last eager call.
    last: Option<Key>,
    /// Streams that live as long as we do and had work since their event was last recorded.
    dirty: Vec<Key>,
    /// A call was captured: from then on every call goes through the order event.
    graphs: bool,
}

/// Above this many tracked caller streams, completed ones are forgotten.
const PRUNE_ABOVE: usize = 32;

impl Tracker {
    pub fn new(own: Key) -> Tracker {
        Tracker {
            own,
            last: None,
            dirty: Vec::new(),
            graphs: false,
        }
    }

    /// The legacy default stream outlives every call and can never capture. (Our own stream
    /// outlives us too, but a caller may capture on it: it gets an event after every call like
    /// a caller's stream, so that the first graph can wait for it.)
    fn lasting(&self, s: Key) -> bool {
        s == 0 || s == LEGACY_ALIAS
    }

    /// Whether a call on `s` asks nothing of CUDA whether or not `s` is capturing: no call was
    /// captured yet, `s` ran the previous call (nothing to wait for) and outlives us (its event
    /// is recorded when needed, not after every call). The caller may then skip the
    /// capture-status query and pass `capturing = false`: the only difference it makes is
    /// marking `s` as having had work, which at worst records one more event when draining.
    pub fn quiet(&self, s: Key) -> bool {
        !self.graphs && self.last == Some(s) && self.lasting(s)
    }

    /// Before a call on `s`: `s` waits for the work issued before it (see the module comment).
    pub fn before(&mut self, ev: &mut impl Events, s: Key, capturing: bool) -> Result<()> {
        if capturing {
            if !self.graphs {
                // The order event covers nothing yet: at every replay, wait for the last eager
                // call's event as last recorded (a lasting stream gets its event now: it
                // cannot be capturing).
                if let Some(p) = self.last {
                    if self.lasting(p) {
                        ev.record(p, p, false)?;
                        self.dirty.retain(|d| *d != p);
                    }
                    ev.wait(s, p, true)?;
                }
            }
            return ev.wait(s, ORDER, true);
        }
        if self.graphs {
            // A replay may have been launched since the last call: only the order event knows.
            return ev.wait(s, ORDER, false);
        }
        match self.last {
            Some(p) if p != s => {
                if self.lasting(p) {
                    // Caller streams got their event right after the call.
                    ev.record(p, p, false)?;
                    self.dirty.retain(|d| *d != p);
                }
                ev.wait(s, p, false)
            }
            _ => Ok(()),
        }
    }

    /// After a call was enqueued on `s`.
    pub fn after(&mut self, ev: &mut impl Events, s: Key, capturing: bool) -> Result<()> {
        if capturing {
            self.graphs = true;
            return ev.record(ORDER, s, true);
        }
        if self.graphs {
            // Covers this call for later calls and replays, and for teardown (every piece of
            // work waited for the one before it).
            ev.record(ORDER, s, false)?;
        } else if self.lasting(s) {
            if !self.dirty.contains(&s) {
                self.dirty.push(s);
            }
        } else {
            // Every call, not only on a change of stream: the caller may destroy its stream
            // right after this call, and then teardown has only this event to know when the
            // call's work is done (recording on a destroyed stream later is not allowed).
            ev.record(s, s, false)?;
            if ev.streams().len() > PRUNE_ABOVE {
                for k in ev.streams() {
                    if k != s && k != ORDER && !self.lasting(k) && ev.done(k)? {
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
    /// them (and the order event) until `deadline`. Ok(true) when everything finished, Ok(false)
    /// at the deadline.
    pub fn drain(&mut self, ev: &mut impl Events, deadline: Instant) -> Result<bool> {
        for s in std::mem::take(&mut self.dirty) {
            ev.record(s, s, false)?;
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
}

// SAFETY: CUDA events may be used from any thread; we hold them behind &mut.
unsafe impl Send for CudaEvents {}

impl CudaEvents {
    pub fn new(rank: usize) -> CudaEvents {
        CudaEvents {
            rank,
            events: HashMap::new(),
        }
    }

    fn event(&mut self, stream: Key) -> Result<sys::CUevent> {
        if let Some(e) = self.events.get(&stream) {
            return Ok(*e);
        }
        let mut e: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: creates one event, destroyed in forget() or Drop.
        ck(
            unsafe { sys::cuEventCreate(&mut e, flags) },
            self.rank,
            || "cuEventCreate (stream order)".into(),
        )?;
        self.events.insert(stream, e);
        Ok(e)
    }
}

impl Events for CudaEvents {
    fn record(&mut self, event: Key, stream: Key, captured: bool) -> Result<()> {
        let e = self.event(event)?;
        let flags = if captured {
            sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32
        } else {
            0
        };
        // SAFETY: our event on the caller's stream handle.
        ck(
            unsafe { sys::cuEventRecordWithFlags(e, stream as sys::CUstream, flags) },
            self.rank,
            || {
                format!(
                    "cuEventRecord ({}) on stream {stream:#x}",
                    what(event, captured)
                )
            },
        )
    }

    fn wait(&mut self, waiter: Key, event: Key, captured: bool) -> Result<()> {
        let e = self.event(event)?;
        let flags = if captured {
            sys::CUevent_wait_flags::CU_EVENT_WAIT_EXTERNAL as u32
        } else {
            0
        };
        // SAFETY: our event; the waiter is the caller's live stream.
        ck(
            unsafe { sys::cuStreamWaitEvent(waiter as sys::CUstream, e, flags) },
            self.rank,
            || format!("stream {waiter:#x} waiting for {}", what(event, captured)),
        )
    }

    fn done(&mut self, stream: Key) -> Result<bool> {
        let Some(&e) = self.events.get(&stream) else {
            return Ok(true);
        };
        // SAFETY: our event.
        match unsafe { sys::cuEventQuery(e) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            res => Err(driver_error(
                self.rank,
                format!("cuEventQuery (work on stream {stream:#x})"),
                res,
            )),
        }
    }

    fn forget(&mut self, stream: Key) {
        if let Some(e) = self.events.remove(&stream) {
            // SAFETY: our event, destroyed once.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
    }

    fn streams(&self) -> Vec<Key> {
        self.events.keys().copied().collect()
    }
}

/// An event as error messages name it.
fn what(event: Key, captured: bool) -> String {
    let e = match event {
        ORDER => "the order event".to_string(),
        s => format!("the previous call on stream {s:#x}"),
    };
    if captured {
        format!("{e}, as an external node of the graph being captured")
    } else {
        e
    }
}

impl Drop for CudaEvents {
    fn drop(&mut self) {
        for (_, e) in self.events.drain() {
            // SAFETY: our event, destroyed once (a pending record completes on its own).
            unsafe { sys::cuEventDestroy_v2(e) };
        }
    }
}

/// Whether `stream` is capturing into a CUDA graph.
pub(super) fn capturing(stream: sys::CUstream, rank: usize) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: writes one enum.
    ck(
        unsafe { sys::cuStreamIsCapturing(stream, &mut status) },
        rank,
        || format!("cuStreamIsCapturing on stream {:#x}", stream as usize),
    )?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Makes the graph that `stream` is capturing into hold `keep` until the graph, and every
/// executable graph made from it, is destroyed and its launches have completed; then the
/// driver hands `keep` to `release`. The driver calls that from a thread of its own where no
/// CUDA call is allowed: `release` must only pass `keep` on (see memory::release_later).
pub(super) fn hold_in_graph<T: Send + 'static>(
    stream: sys::CUstream,
    keep: T,
    release: fn(T),
    rank: usize,
) -> Result<()> {
    struct Held<T> {
        keep: T,
        release: fn(T),
    }
    unsafe extern "C" fn destroy<T>(p: *mut std::ffi::c_void) {
        // SAFETY: `p` is the Box made below, handed to the driver once and destroyed once.
        let held = unsafe { Box::from_raw(p.cast::<Held<T>>()) };
        (held.release)(held.keep);
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let (mut id, mut graph, mut n) = (0, std::ptr::null_mut(), 0usize);
    let (mut deps, mut edges) = (std::ptr::null(), std::ptr::null());
    // SAFETY: writes the capture's status, id, graph and dependencies (the driver's arrays).
    ck(
        unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream,
                &mut status,
                &mut id,
                &mut graph,
                &mut deps,
                &mut edges,
                &mut n,
            )
        },
        rank,
        || format!("cuStreamGetCaptureInfo on stream {:#x}", stream as usize),
    )?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || graph.is_null() {
        return Err(crate::error::Error::invalid(
            rank,
            "all_reduce",
            format!(
                "stream {:#x}: the capture is not active ({status:?}); a capture invalidated by \
                 an earlier error cannot take more calls",
                stream as usize
            ),
        ));
    }
    let ptr = Box::into_raw(Box::new(Held { keep, release })).cast();
    let mut object = std::ptr::null_mut();
    let flags = sys::CUuserObject_flags_enum::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32;
    // SAFETY: the object owns `ptr` from here on (one reference, ours); `destroy` frees it.
    let made = unsafe { sys::cuUserObjectCreate(&mut object, ptr, Some(destroy::<T>), 1, flags) };
    if made != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the driver did not take `ptr`: freed here, once.
        unsafe { destroy::<T>(ptr) };
        return Err(driver_error(rank, "cuUserObjectCreate".into(), made));
    }
    let moved = sys::CUuserObjectRetain_flags_enum::CU_GRAPH_USER_OBJECT_MOVE as u32;
    // SAFETY: moves our one reference to the graph being captured.
    let held = unsafe { sys::cuGraphRetainUserObject(graph, object, 1, moved) };
    if held != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: our reference was not moved: dropping it runs `destroy`.
        unsafe { sys::cuUserObjectRelease(object, 1) };
        return Err(driver_error(
            rank,
            "cuGraphRetainUserObject (the captured graph keeps the communicator's memory)".into(),
            held,
        ));
    }
    Ok(())
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

    fn name(k: Key) -> String {
        match k {
            ORDER => "ORDER".into(),
            k => k.to_string(),
        }
    }

    fn node(captured: bool) -> &'static str {
        if captured {
            " (node)"
        } else {
            ""
        }
    }

    impl Events for Log {
        fn record(&mut self, e: Key, s: Key, captured: bool) -> Result<()> {
            self.ops.push(match e == s {
                true => format!("record {s}"),
                false => format!("record {} on {s}{}", name(e), node(captured)),
            });
            self.recorded.insert(e);
            Ok(())
        }
        fn wait(&mut self, w: Key, e: Key, captured: bool) -> Result<()> {
            // The order event may be waited for before it was ever recorded (a no-op in CUDA);
            // a stream's event never is.
            assert!(
                e == ORDER || self.recorded.contains(&e),
                "waits on {e}, never recorded"
            );
            self.ops
                .push(format!("wait {w} on {}{}", name(e), node(captured)));
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
    }

    const OWN: Key = 0x500;

    fn call(t: &mut Tracker, ev: &mut Log, s: Key) {
        t.before(ev, s, false).unwrap();
        ev.ops.push(format!("launch {s}"));
        t.after(ev, s, false).unwrap();
    }

    fn captured(t: &mut Tracker, ev: &mut Log, s: Key) {
        t.before(ev, s, true).unwrap();
        ev.ops.push(format!("capture {s}"));
        t.after(ev, s, true).unwrap();
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
    fn only_repeated_calls_on_the_legacy_stream_are_quiet() {
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        assert!(!t.quiet(0), "no call yet");
        call(&mut t, &mut ev, 0);
        assert!(t.quiet(0) && !t.quiet(OWN) && !t.quiet(0x10));
        call(&mut t, &mut ev, 0x10);
        // A caller's stream gets an event after every call: never quiet.
        assert!(!t.quiet(0x10) && !t.quiet(0));
        // Our own stream too: a caller may capture on it.
        call(&mut t, &mut ev, OWN);
        assert!(!t.quiet(OWN));
        call(&mut t, &mut ev, LEGACY_ALIAS);
        assert!(t.quiet(LEGACY_ALIAS));
        // What a quiet call would do: nothing at all.
        let before = ev.ops.len();
        call(&mut t, &mut ev, LEGACY_ALIAS);
        call(&mut t, &mut ev, LEGACY_ALIAS);
        assert_eq!(ev.ops[before..], ["launch 1", "launch 1"]);
        // Once a call was captured, nothing is quiet: a replay may have run since.
        captured(&mut t, &mut ev, 0x10);
        assert!(!t.quiet(LEGACY_ALIAS));
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
    fn a_graph_follows_the_eager_calls_and_they_follow_its_replays() {
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        call(&mut t, &mut ev, 0x10);
        captured(&mut t, &mut ev, 0x20);
        captured(&mut t, &mut ev, 0x20);
        // Eager calls after it, on any stream: through the order event, every call.
        call(&mut t, &mut ev, 0x10);
        call(&mut t, &mut ev, 0x10);
        call(&mut t, &mut ev, 0);
        // A second graph, on the stream the first eager call ran on.
        captured(&mut t, &mut ev, 0x10);
        assert_eq!(
            ev.ops,
            [
                "launch 16",
                "record 16",
                // The first captured call: at replay, after the last eager call as last
                // recorded, and after earlier replays.
                "wait 32 on 16 (node)",
                "wait 32 on ORDER (node)",
                "capture 32",
                "record ORDER on 32 (node)",
                "wait 32 on ORDER (node)",
                "capture 32",
                "record ORDER on 32 (node)",
                "wait 16 on ORDER",
                "launch 16",
                "record ORDER on 16",
                "wait 16 on ORDER",
                "launch 16",
                "record ORDER on 16",
                "wait 0 on ORDER",
                "launch 0",
                "record ORDER on 0",
                "wait 16 on ORDER (node)",
                "capture 16",
                "record ORDER on 16 (node)",
            ]
        );
        assert!(t.graphs);
    }

    #[test]
    fn a_first_capture_after_the_legacy_stream_records_its_event_first() {
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        call(&mut t, &mut ev, 0);
        call(&mut t, &mut ev, 0);
        captured(&mut t, &mut ev, OWN);
        assert_eq!(
            ev.ops,
            [
                "launch 0",
                "launch 0",
                // The legacy stream cannot be capturing: its event is recorded now.
                "record 0",
                "wait 1280 on 0 (node)",
                "wait 1280 on ORDER (node)",
                "capture 1280",
                "record ORDER on 1280 (node)",
            ]
        );
    }

    #[test]
    fn a_capture_on_the_stream_of_the_last_call_waits_for_its_event() {
        // Our own stream, as a caller without a stream of its own would capture on it.
        let (mut t, mut ev) = (Tracker::new(OWN), Log::default());
        call(&mut t, &mut ev, OWN);
        captured(&mut t, &mut ev, OWN);
        assert_eq!(
            ev.ops,
            [
                "launch 1280",
                "record 1280",
                "wait 1280 on 1280 (node)",
                "wait 1280 on ORDER (node)",
                "capture 1280",
                "record ORDER on 1280 (node)",
            ]
        );
    }

    #[test]
    fn drain_covers_every_stream_and_the_order_event() {
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
        // After a capture, the order event is waited for too.
        captured(&mut t, &mut ev, 0x20);
        call(&mut t, &mut ev, 0x10);
        assert!(
            !t.drain(&mut ev, Instant::now()).unwrap(),
            "order event pending"
        );
        ev.finished.insert(ORDER);
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
