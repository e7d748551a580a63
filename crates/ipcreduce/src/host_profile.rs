//! `IPCREDUCE_HOST_PROFILE=1`: where the host time of a rank's raw all-reduce calls goes,
//! summed per phase and printed to stderr when the communicator is dropped, so that a run
//! shows what an eager call costs before its kernel (launch-bound small messages are decided
//! there). Off (the default) every lap is one relaxed load of a flag; on, a clock read
//! (`Instant`, about 20 ns) per phase boundary, which the printed means include.
//!
//! The phases of one call, in order: `checks` (the communicator's argument checks, path choice,
//! flight recorder), `pointers` (the backend's buffer checks), `capture` (the stream's capture
//! status), `order` (waits for the communicator's work on another stream), `prepare` (plan,
//! kernel, arguments, identity), `launch` (the driver's launch), `after` (the stream's event
//! after the call), `rest` (the rest of the backend's call: on the host backend the whole
//! collective), `finish` (the flight recorder's end of the call). A phase a call does not
//! reach (the host backend has no `capture`, a count-0 call no `pointers`) adds nothing; a call
//! that fails is not counted.
//!
//! The clock is per thread (a communicator is used from one thread at a time) and the sums are
//! per process: the summary covers every communicator of the process.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The phases, in call order (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Checks,
    Pointers,
    Capture,
    Order,
    Prepare,
    Launch,
    After,
    Rest,
    Finish,
}

impl Phase {
    pub const ALL: [Phase; 9] = [
        Phase::Checks,
        Phase::Pointers,
        Phase::Capture,
        Phase::Order,
        Phase::Prepare,
        Phase::Launch,
        Phase::After,
        Phase::Rest,
        Phase::Finish,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Checks => "checks",
            Phase::Pointers => "pointers",
            Phase::Capture => "capture",
            Phase::Order => "order",
            Phase::Prepare => "prepare",
            Phase::Launch => "launch",
            Phase::After => "after",
            Phase::Rest => "rest",
            Phase::Finish => "finish",
        }
    }
}

/// `IPCREDUCE_HOST_PROFILE=1`, as read at the latest communicator init.
static ENABLED: AtomicBool = AtomicBool::new(false);
static NS: [AtomicU64; 9] = [const { AtomicU64::new(0) }; 9];
static CALLS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The last lap's time of the call this thread is in, if it is timed.
    static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Reads `IPCREDUCE_HOST_PROFILE` (at communicator init).
pub fn init() {
    let on = std::env::var("IPCREDUCE_HOST_PROFILE").is_ok_and(|v| v == "1");
    ENABLED.store(on, Ordering::Relaxed);
}

#[inline]
fn on() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

// The entry points are inlined into the hot path as the flag's load and a branch; the timed
// work is out of line, so that profiling off costs no call either.

/// A call starts: its clock starts.
#[inline]
pub fn begin() {
    if on() {
        begin_timed();
    }
}

#[inline(never)]
fn begin_timed() {
    LAST.with(|l| l.set(Some(Instant::now())));
}

/// The time since the last lap of this call goes to `phase`.
#[inline]
pub fn lap(phase: Phase) {
    if on() {
        lap_timed(phase);
    }
}

#[inline(never)]
fn lap_timed(phase: Phase) {
    LAST.with(|l| {
        if let Some(t) = l.get() {
            let now = Instant::now();
            NS[phase as usize].fetch_add((now - t).as_nanos() as u64, Ordering::Relaxed);
            l.set(Some(now));
        }
    });
}

/// The call ended: `ok` ones are counted (the sums of failed ones stay, a few at most).
#[inline]
pub fn end(ok: bool) {
    if on() {
        end_timed(ok);
    }
}

#[inline(never)]
fn end_timed(ok: bool) {
    lap_timed(Phase::Finish);
    LAST.with(|l| l.set(None));
    if ok {
        CALLS.fetch_add(1, Ordering::Relaxed);
    }
}

/// The summary: calls, then each phase's mean and the total, in microseconds.
pub fn summary() -> String {
    let calls = CALLS.load(Ordering::Relaxed);
    let n = calls.max(1) as f64;
    let mut total = 0.0;
    let mut s = format!("host profile of {calls} all-reduce calls, mean us:");
    for p in Phase::ALL {
        let us = NS[p as usize].load(Ordering::Relaxed) as f64 / n / 1000.0;
        total += us;
        s.push_str(&format!(" {}={us:.3}", p.name()));
    }
    s.push_str(&format!(" total={total:.3}"));
    s
}

/// At a communicator's drop: prints the summary when profiling is on.
pub fn report(rank: usize) {
    if on() {
        eprintln!("ipcreduce: rank {rank}: {}", summary());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_up_per_phase_and_only_finished_calls_count() {
        ENABLED.store(true, Ordering::Relaxed);
        begin();
        std::thread::sleep(std::time::Duration::from_millis(20));
        lap(Phase::Launch);
        end(true);
        // A lap outside a call (no begin) adds nothing.
        lap(Phase::Order);
        ENABLED.store(false, Ordering::Relaxed);
        let launch = NS[Phase::Launch as usize].load(Ordering::Relaxed);
        assert!(launch >= 20_000_000, "{launch} ns");
        assert_eq!(NS[Phase::Order as usize].load(Ordering::Relaxed), 0);
        assert_eq!(CALLS.load(Ordering::Relaxed), 1);
        let s = summary();
        assert!(
            s.starts_with("host profile of 1 all-reduce calls, mean us: checks="),
            "{s}"
        );
        assert!(s.contains(" launch=2"), "{s}");
    }
}
