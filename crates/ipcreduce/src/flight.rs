//! The flight recorder: every rank keeps the identities of its last N collective calls
//! (sequence number, operation, path, count, dtype, reduction, in place or not, stream, host
//! start and end times) in a fixed ring, and writes them to a file when a call fails, so that
//! what every rank was doing when a job broke can be lined up afterwards
//! (`ipcreduce trace summarize`; the format is in docs/tracing.md).
//!
//! The ring is allocated once, at init: recording a call writes one fixed-size entry and reads
//! the time stamp counter twice (a few ns each; the system clock costs 20-60 ns a read, as
//! much as a fifth of an 8-byte host call), with no allocation and no lock (a communicator is
//! used from one thread at a time). The counter is turned into wall-clock time when the ring
//! is written out, from two readings of both (at init and at the dump).
//! `IPCREDUCE_FLIGHT_TIMES=0` keeps the identities without times, for the smallest calls
//! (docs/tracing.md has the measured costs).
//!
//! `IPCREDUCE_FLIGHT=N` sets the ring's size (default [`DEFAULT_CAPACITY`]; 0 turns
//! recording and dumps off). The file goes to `IPCREDUCE_FLIGHT_DIR` (which `ipcreduce launch
//! --log-dir DIR` sets to DIR for its ranks), else the temp directory, and is named after the
//! job id and the rank: `ipcreduce-flight-<job>-rank<r>.jsonl`.
//!
//! `IPCREDUCE_TRACE=DIR` also writes the ring when the communicator is closed (dropped), failed
//! or not, as `ipcreduce-trace-<job>-rank<r>.jsonl` in DIR: the input of `ipcreduce trace
//! export` for a job that ran to its end.
//!
//! `IPCREDUCE_TIMELINE=1` (cuda) adds when each call ran on its stream ([`timeline`]: events
//! around its work, or its kernel's phase stamps where it stamps them), read back when the
//! ring is written; `IPCREDUCE_NVTX=1` an NVTX range per call ([`nvtx`]). With
//! `IPCREDUCE_TRACE` the cuda kernels also stamp their phases per block ([`stamps`]), written
//! into each call's line of the trace.

pub mod nvtx;
pub mod stamps;
pub mod timeline;

use crate::backend::SgOp;
use crate::error::{Error, Result};
use crate::types::{Algorithm, DType, ReduceOp};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Entries kept when `IPCREDUCE_FLIGHT` is unset (about 64 bytes each).
pub const DEFAULT_CAPACITY: usize = 1024;
/// Largest ring `IPCREDUCE_FLIGHT` may ask for (64 MiB of entries).
pub const MAX_CAPACITY: usize = 1 << 20;
/// The `flight_record` field of a dump's header line: the format's version.
pub const FORMAT_VERSION: u32 = 1;

/// How far a recorded call got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Begun and not returned: the call the rank was in when the dump was written.
    Running,
    /// Returned Ok (on cuda: enqueued; the stream may still run it).
    Ok,
    /// Returned an error.
    Failed,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Ok => "ok",
            State::Failed => "failed",
        }
    }
}

/// One recorded call. `Copy` and fixed-size: the ring is written in place.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    /// 1 for the communicator's first collective call, as the errors' `#N` on the host backend.
    pub seq: u64,
    pub op: SgOp,
    /// What ran: the resolved algorithm's name (all-reduce), or the kernel path the backend
    /// chose alone (reduce-scatter and all-gather on cuda, "reduce-scatter-reg"...); None
    /// where nothing says (the host backend's reduce-scatter and all-gather).
    pub path: Option<&'static str>,
    /// The cuda all-reduce's kernel path (`oneshot-ll`, `twoshot-reg`, `ce`, `nccl`...; what
    /// `Communicator::last_path` names), set once the call was enqueued; None elsewhere.
    pub kernel: Option<&'static str>,
    /// The call's count argument (all-gather: sendcount; reduce-scatter: recvcount).
    pub count: u64,
    pub dtype: DType,
    pub reduce: ReduceOp,
    pub in_place: bool,
    /// The `CUstream` passed (0: the communicator's own, or the host backend).
    pub stream: u64,
    /// Host wall clock (ns since the Unix epoch) when the call began and returned (0: not yet;
    /// in the ring itself: [`stamp`] ticks, turned into ns by [`Recorder::entries`]).
    pub start_ns: u64,
    pub end_ns: u64,
    pub state: State,
    /// When it ran on its stream (host wall-clock ns; 0: unknown, or no device timeline).
    pub dev_start_ns: u64,
    pub dev_end_ns: u64,
}

impl Entry {
    const EMPTY: Entry = Entry {
        seq: 0,
        op: SgOp::AllReduce,
        path: None,
        kernel: None,
        count: 0,
        dtype: DType::F32,
        reduce: ReduceOp::Sum,
        in_place: false,
        stream: 0,
        start_ns: 0,
        end_ns: 0,
        state: State::Running,
        dev_start_ns: 0,
        dev_end_ns: 0,
    };

    /// The entry as one JSON line (no newline).
    pub fn to_json(&self) -> String {
        let nonzero = |v: u64| (v != 0).then_some(v);
        serde_json::json!({
            "seq": self.seq,
            "op": self.op.name(),
            "path": self.path,
            "kernel": self.kernel,
            "count": self.count,
            "dtype": self.dtype.name(),
            "reduce": self.reduce.name(),
            "in_place": self.in_place,
            "stream": format!("{:#x}", self.stream),
            "start_ns": nonzero(self.start_ns),
            "end_ns": nonzero(self.end_ns),
            "state": self.state.name(),
            "dev_start_ns": nonzero(self.dev_start_ns),
            "dev_end_ns": nonzero(self.dev_end_ns),
        })
        .to_string()
    }
}

/// What a call is, as its caller gave it.
#[derive(Debug, Clone, Copy)]
pub struct CallId {
    pub op: SgOp,
    pub count: usize,
    pub dtype: DType,
    pub reduce: ReduceOp,
    pub in_place: bool,
    pub stream: *mut std::ffi::c_void,
}

/// Who this rank is, for the dump's name and header.
#[derive(Debug, Clone)]
pub struct Identity {
    pub job: String,
    pub rank: usize,
    pub world: usize,
    pub host: String,
}

/// One communicator's ring and where its dump goes.
pub struct Recorder {
    ring: Box<[Entry]>,
    /// Calls begun so far: the last one's `seq`.
    calls: u64,
    /// Where the current (last begun) call's entry is.
    cur: usize,
    /// [`stamp`] and the wall clock read together at init.
    origin: (u64, u64),
    /// Whether calls are time-stamped (`IPCREDUCE_FLIGHT_TIMES`, default on).
    times: bool,
    who: Option<Identity>,
    dir: Option<PathBuf>,
    /// The file written at the first failure; later failures name it again.
    dumped: Option<PathBuf>,
    /// `IPCREDUCE_TRACE`: where the ring goes at close.
    trace_dir: Option<PathBuf>,
    /// The first failure's words, for the trace written at close.
    error: Option<String>,
    /// `IPCREDUCE_TIMELINE=1`: whether a device timeline is wanted, and the timeline once the
    /// cuda backend is up ([`Recorder::attach_device`]).
    timeline_wanted: bool,
    timeline: Option<Box<timeline::Timeline>>,
    /// `IPCREDUCE_NVTX=1`: a range per call.
    nvtx: Option<nvtx::Ranges>,
    /// With `IPCREDUCE_TRACE` on cuda: the kernels' phase stamps.
    stamps: Option<std::sync::Arc<dyn stamps::Source>>,
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A time stamp: the time stamp counter on x86_64 (invariant and common to all cores on the
/// CPUs this runs on), else the wall clock in ns.
#[inline]
pub fn stamp() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions (x86_64 always has it).
        unsafe { std::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        now_ns()
    }
}

/// Turns stamps into wall-clock ns by the line through two (stamp, ns) readings.
fn to_ns(t: u64, (t0, n0): (u64, u64), (t1, n1): (u64, u64)) -> u64 {
    if t == 0 {
        return 0;
    }
    if cfg!(not(target_arch = "x86_64")) || t1 <= t0 {
        return t;
    }
    let per_tick = (n1.saturating_sub(n0)) as f64 / (t1 - t0) as f64;
    (n0 as f64 + (t as f64 - t0 as f64) * per_tick) as u64
}

impl Recorder {
    /// A recorder of `capacity` entries (0: off) dumping into `dir` (None: the temp dir).
    pub fn new(capacity: usize, dir: Option<PathBuf>) -> Recorder {
        Recorder {
            ring: vec![Entry::EMPTY; capacity].into_boxed_slice(),
            calls: 0,
            cur: 0,
            origin: (stamp(), now_ns()),
            times: true,
            who: None,
            dir,
            dumped: None,
            trace_dir: None,
            error: None,
            timeline_wanted: false,
            timeline: None,
            nvtx: None,
            stamps: None,
        }
    }

    /// `IPCREDUCE_FLIGHT` and `IPCREDUCE_FLIGHT_DIR` (see the module doc); an empty value
    /// counts as unset.
    pub fn from_env() -> Result<Recorder> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`Recorder::from_env`] over any variable source.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Recorder> {
        let get = |k: &str| get(k).filter(|v| !v.is_empty());
        let capacity = match get("IPCREDUCE_FLIGHT") {
            None => DEFAULT_CAPACITY,
            Some(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| *n <= MAX_CAPACITY)
                .ok_or_else(|| {
                    Error::Config(format!(
                        "IPCREDUCE_FLIGHT={v:?}: expected the number of calls the flight \
                         recorder keeps, 0 (off) to {MAX_CAPACITY}"
                    ))
                })?,
        };
        let times = match get("IPCREDUCE_FLIGHT_TIMES").as_deref().map(str::trim) {
            None | Some("1") => true,
            Some("0") => false,
            Some(v) => {
                return Err(Error::Config(format!(
                    "IPCREDUCE_FLIGHT_TIMES={v:?}: expected 1 (time-stamp every call, the \
                     default) or 0 (identities only)"
                )))
            }
        };
        let trace_dir = get("IPCREDUCE_TRACE").map(PathBuf::from);
        if trace_dir.is_some() && capacity == 0 {
            return Err(Error::Config(
                "IPCREDUCE_TRACE is set but IPCREDUCE_FLIGHT=0 keeps no calls to trace: unset \
                 one of them"
                    .into(),
            ));
        }
        let timeline_wanted =
            match get("IPCREDUCE_TIMELINE").as_deref().map(str::trim) {
                None | Some("0") => false,
                Some("1") if capacity == 0 => return Err(Error::Config(
                    "IPCREDUCE_TIMELINE=1 but IPCREDUCE_FLIGHT=0 keeps no calls to time: unset \
                     one of them"
                        .into(),
                )),
                Some("1") => true,
                Some(v) => {
                    return Err(Error::Config(format!(
                        "IPCREDUCE_TIMELINE={v:?}: expected 1 (record when each call ran on its \
                     stream) or 0 (off, the default)"
                    )))
                }
            };
        let mut r = Self::new(capacity, get("IPCREDUCE_FLIGHT_DIR").map(PathBuf::from));
        r.times = times;
        r.trace_dir = trace_dir;
        r.timeline_wanted = timeline_wanted;
        r.nvtx = match get("IPCREDUCE_NVTX").as_deref().map(str::trim) {
            None | Some("0") => None,
            Some("1") => nvtx::load(get("IPCREDUCE_NVTX_LIB").as_deref()).map(nvtx::Ranges::new),
            Some(v) => {
                return Err(Error::Config(format!(
                    "IPCREDUCE_NVTX={v:?}: expected 1 (an NVTX range per call) or 0 (off, the \
                     default)"
                )))
            }
        };
        Ok(r)
    }

    /// Names the rank (once the bootstrap has connected); before that nothing is dumped.
    pub fn identify(&mut self, who: Identity) {
        self.who = Some(who);
    }

    pub fn capacity(&self) -> usize {
        self.ring.len()
    }

    /// The cuda backend is up, its context current on this thread: starts the device timeline
    /// if `IPCREDUCE_TIMELINE=1` asked for one.
    pub fn attach_device(&mut self) {
        if !self.timeline_wanted || self.timeline.is_some() {
            return;
        }
        self.timeline = timeline::Timeline::new(self.ring.len()).map(Box::new);
        if self.timeline.is_none() {
            tracing::warn!("IPCREDUCE_TIMELINE=1: no CUDA context current; no device timeline");
        }
    }

    /// The kernels' phase stamps (the cuda backend's ring, while tracing).
    pub fn attach_stamps(&mut self, source: Option<std::sync::Arc<dyn stamps::Source>>) {
        self.stamps = source;
    }

    /// Whether a device timeline is being recorded.
    pub fn has_timeline(&self) -> bool {
        self.timeline.is_some()
    }

    /// Records the start of a call; it becomes the current entry.
    #[inline]
    pub fn begin(&mut self, id: &CallId) {
        self.calls += 1;
        if let Some(r) = &mut self.nvtx {
            r.begin(id.op, id.count as u64, id.dtype);
        }
        let n = self.ring.len();
        if n == 0 {
            return;
        }
        // The next slot without a division: calls are numbered from 1, slots from 0.
        self.cur = if self.calls == 1 || self.cur + 1 == n {
            0
        } else {
            self.cur + 1
        };
        self.ring[self.cur] = Entry {
            seq: self.calls,
            op: id.op,
            path: None,
            kernel: None,
            count: id.count as u64,
            dtype: id.dtype,
            reduce: id.reduce,
            in_place: id.in_place,
            stream: id.stream as u64,
            start_ns: if self.times { stamp() } else { 0 },
            end_ns: 0,
            state: State::Running,
            dev_start_ns: 0,
            dev_end_ns: 0,
        };
        if let Some(s) = &self.stamps {
            s.set_call(self.calls);
        }
    }

    #[inline]
    fn current(&mut self) -> Option<&mut Entry> {
        if self.calls == 0 {
            return None;
        }
        self.ring.get_mut(self.cur)
    }

    /// Says what the current call runs.
    #[inline]
    pub fn path(&mut self, path: Algorithm) {
        if let Some(e) = self.current() {
            e.path = Some(path.name());
        }
        if let Some(r) = &mut self.nvtx {
            r.path(path.name());
        }
    }

    /// Says which kernel path the current all-reduce ran (cuda), once it was enqueued.
    #[inline]
    pub fn kernel(&mut self, name: &'static str) {
        if let Some(e) = self.current() {
            e.kernel = Some(name);
        }
    }

    /// Says which kernel path the current call took, where the backend chose it alone
    /// (reduce-scatter, all-gather): after it was enqueued, so the range NVTX opened at the
    /// start keeps the operation's name alone.
    #[inline]
    pub fn path_taken(&mut self, name: &'static str) {
        if let Some(e) = self.current() {
            e.path.get_or_insert(name);
        }
    }

    /// The current call's work is about to be enqueued on its stream (after its checks):
    /// where a device timeline is recorded, its span begins here, with an event on the
    /// stream, unless `stamped()` says its kernel stamps its phases (cuda, `IPCREDUCE_TRACE`),
    /// whose first start and last end are then its span: events between consecutive kernels
    /// cost an eager call several microseconds (timeline.rs). `stamped` is asked only then.
    #[inline]
    pub fn device_work(&mut self, stamped: impl FnOnce() -> bool) {
        let Some(t) = &mut self.timeline else { return };
        let Some(e) = self.ring.get(self.cur).filter(|_| self.calls > 0) else {
            return;
        };
        if stamped() {
            return;
        }
        t.begin(e.seq, e.stream as *mut std::ffi::c_void);
    }

    /// Records the end of the current call.
    #[inline]
    pub fn end(&mut self, ok: bool) {
        if let Some(r) = &mut self.nvtx {
            r.pop();
        }
        let times = self.times;
        let Some(e) = self.current() else { return };
        e.end_ns = if times { stamp() } else { 0 };
        e.state = if ok { State::Ok } else { State::Failed };
        let (seq, stream) = (e.seq, e.stream);
        if let Some(t) = &mut self.timeline {
            t.end(seq, stream as *mut std::ffi::c_void);
        }
    }

    /// The kept entries, oldest first, their times in wall-clock ns.
    pub fn entries(&self) -> Vec<Entry> {
        let n = self.ring.len() as u64;
        let first = self.calls.saturating_sub(n) + 1;
        let now = (stamp(), now_ns());
        (first..=self.calls)
            .map(|s| {
                let mut e = self.ring[((s - 1) % n) as usize];
                e.start_ns = to_ns(e.start_ns, self.origin, now);
                e.end_ns = to_ns(e.end_ns, self.origin, now);
                e
            })
            .collect()
    }

    /// Where the dump goes.
    pub fn file(&self) -> Option<PathBuf> {
        let who = self.who.as_ref()?;
        let dir = self.dir.clone().unwrap_or_else(std::env::temp_dir);
        Some(dir.join(format!(
            "ipcreduce-flight-{}-rank{}.jsonl",
            who.job, who.rank
        )))
    }

    /// Whether a failure was recorded already (the ring is then kept as it was).
    pub fn has_failed(&self) -> bool {
        self.error.is_some()
    }

    /// `error` with the dump's file named in it: the ring is written at the first failure
    /// (later ones name the same file; the ring no longer changes once the communicator is
    /// aborted). Off, or when the file cannot be written (a warning says why), the error comes
    /// back unchanged.
    pub fn note(&mut self, error: Error) -> Error {
        let path = match &self.dumped {
            Some(p) => p.clone(),
            None => match self.dump(&error) {
                Some(p) => p,
                None => return error,
            },
        };
        // A call made of others (host slices over raw pointers) passes its inner call's error
        // on, already noted.
        if error.flight_record().as_deref() == Some(path.as_path()) {
            return error;
        }
        error.with_flight_record(&path)
    }

    fn dump(&mut self, error: &Error) -> Option<PathBuf> {
        if self.ring.is_empty() {
            return None;
        }
        let words = error.to_string();
        self.error = Some(words.clone());
        let path = self.file()?;
        let spans = self.spans();
        match self.write(&path, Some(&words), "error", &spans, 0) {
            Ok(()) => {
                self.dumped = Some(path.clone());
                Some(path)
            }
            Err(e) => {
                tracing::warn!("flight recorder: could not write {}: {e}", path.display());
                None
            }
        }
    }

    /// Calls recorded so far (the latest call's number): the mark a [`Recorder::write_trace`]
    /// of the calls after it takes.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Writes the calls after `since` (a [`Recorder::calls`] mark; 0: all) that the ring still
    /// holds into `dir`, as the close trace is written (`ipcreduce-trace-<job>-rank<r>.jsonl`,
    /// replacing one of that name there, `written: "trace"`), for `ipcreduce trace export` of
    /// a part of a run. Fails when recording is off (`IPCREDUCE_FLIGHT=0`) or the file cannot
    /// be written.
    pub fn write_trace(&mut self, dir: &Path, since: u64) -> std::result::Result<PathBuf, String> {
        if self.ring.is_empty() {
            return Err("IPCREDUCE_FLIGHT=0 keeps no calls to write".into());
        }
        let path = self
            .trace_in(dir)
            .ok_or("the recorder has no job identity yet")?;
        self.write_trace_file(&path, "trace", since)
            .map_err(|e| format!("could not write {}: {e}", path.display()))?;
        Ok(path)
    }

    /// The trace's file in `dir`: `ipcreduce-trace-<job>-rank<r>.jsonl` (None before the
    /// recorder knows its job).
    fn trace_in(&self, dir: &Path) -> Option<PathBuf> {
        let who = self.who.as_ref()?;
        Some(dir.join(format!(
            "ipcreduce-trace-{}-rank{}.jsonl",
            who.job, who.rank
        )))
    }

    /// Where the trace goes at close (`IPCREDUCE_TRACE`), if it is on.
    pub fn trace_file(&self) -> Option<PathBuf> {
        self.trace_in(self.trace_dir.as_ref()?)
    }

    /// Writes the calls after `since`, with the first failure if any and the device spans
    /// read back now, to the trace file `path` (`written`: `close` or `trace`).
    fn write_trace_file(&mut self, path: &Path, written: &str, since: u64) -> std::io::Result<()> {
        let error = self.error.clone();
        let spans = self.spans();
        self.write(path, error.as_deref(), written, &spans, since)
    }

    /// At close: with `IPCREDUCE_TRACE` set, writes the ring (and the first failure, if any)
    /// into its directory; a write that fails is a warning, never an error of the close.
    pub fn close(&mut self) {
        let Some(path) = self.trace_file() else {
            return;
        };
        if let Err(e) = self.write_trace_file(&path, "close", 0) {
            tracing::warn!("trace: could not write {}: {e}", path.display());
        }
    }

    /// The device spans read back so far (empty without a timeline).
    fn spans(&mut self) -> std::collections::HashMap<u64, (u64, u64)> {
        self.timeline
            .as_mut()
            .map(|t| t.spans())
            .unwrap_or_default()
    }

    /// The phase stamps per flight call, as its trace line's `phases` field (a call made of
    /// several kernel calls keeps its last), and with a device timeline the spans of the
    /// calls that recorded no events (their kernels' first start and last end).
    #[allow(clippy::type_complexity)]
    fn phases(
        &self,
    ) -> (
        std::collections::HashMap<u64, serde_json::Value>,
        std::collections::HashMap<u64, (u64, u64)>,
    ) {
        let Some(s) = &self.stamps else {
            return Default::default();
        };
        let (calls, tick) = s.read();
        let spans = match self.timeline {
            Some(_) => calls
                .iter()
                .filter_map(|c| Some((c.seq, c.span()?)))
                .collect(),
            None => Default::default(),
        };
        (
            calls.iter().map(|c| (c.seq, c.to_json(tick))).collect(),
            spans,
        )
    }

    /// At the communicator's end, while its context still lives: the trace (above), then the
    /// timeline's events go.
    pub fn close_all(&mut self) {
        self.close();
        self.timeline = None;
    }

    /// Header line, then the entries oldest first; written beside and renamed, so a reader
    /// never sees half a file. `written`: `error` (the first failure's dump) or `close`.
    fn write(
        &self,
        path: &Path,
        error: Option<&str>,
        written: &str,
        spans: &std::collections::HashMap<u64, (u64, u64)>,
        since: u64,
    ) -> std::io::Result<()> {
        let who = self.who.as_ref().expect("file() checked it");
        let header = serde_json::json!({
            "flight_record": FORMAT_VERSION,
            "job": who.job,
            "rank": who.rank,
            "world": who.world,
            "host": who.host,
            "pid": std::process::id(),
            "capacity": self.ring.len(),
            "calls": self.calls,
            "dumped_ns": now_ns(),
            "written": written,
            "since": since,
            "error": error,
        });
        let mut text = header.to_string();
        text.push('\n');
        let (phases, stamped) = self.phases();
        for mut e in self.entries().into_iter().filter(|e| e.seq > since) {
            if let Some(&(b, d)) = spans.get(&e.seq).or_else(|| stamped.get(&e.seq)) {
                (e.dev_start_ns, e.dev_end_ns) = (b, d);
            }
            match phases.get(&e.seq) {
                Some(p) => {
                    let mut line: serde_json::Value =
                        serde_json::from_str(&e.to_json()).expect("an entry's own JSON");
                    line["phases"] = p.clone();
                    text.push_str(&line.to_string());
                }
                None => text.push_str(&e.to_json()),
            }
            text.push('\n');
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension(format!("jsonl.{}.tmp", std::process::id()));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
#[path = "flight/stamps_tests.rs"]
mod stamps_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn call(count: usize) -> CallId {
        CallId {
            op: SgOp::AllReduce,
            count,
            dtype: DType::F32,
            reduce: ReduceOp::Sum,
            in_place: false,
            stream: std::ptr::null_mut(),
        }
    }

    fn who(job: &str) -> Identity {
        Identity {
            job: job.into(),
            rank: 3,
            world: 4,
            host: "h".into(),
        }
    }

    #[test]
    fn the_ring_keeps_the_last_calls_in_order() {
        let mut r = Recorder::new(4, None);
        for c in 1..=10 {
            r.begin(&call(c * 100));
            r.path(Algorithm::OneShot);
            r.end(c != 10);
        }
        let e = r.entries();
        let seqs: Vec<u64> = e.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [7, 8, 9, 10]);
        assert_eq!(e[0].count, 700);
        assert_eq!(e[3].state, State::Failed);
        assert_eq!(e[2].state, State::Ok);
        assert!(e.iter().all(|e| e.start_ns > 0 && e.end_ns >= e.start_ns));
        // Fewer calls than room.
        let mut r = Recorder::new(8, None);
        r.begin(&call(5));
        let e = r.entries();
        assert_eq!(e.len(), 1);
        assert_eq!((e[0].seq, e[0].state, e[0].end_ns), (1, State::Running, 0));
    }

    /// The path the backend chose alone is kept where the call named none, and never
    /// replaces the algorithm an all-reduce resolved; it goes into the JSON line as "path".
    #[test]
    fn the_path_taken_fills_only_an_unnamed_path() {
        let mut r = Recorder::new(4, None);
        r.begin(&call(8));
        r.path_taken("reduce-scatter-reg");
        r.end(true);
        r.begin(&call(8));
        r.path(Algorithm::TwoShot);
        r.path_taken("twoshot-reg");
        r.end(true);
        r.begin(&call(8));
        r.end(true);
        let e = r.entries();
        let paths: Vec<Option<&str>> = e.iter().map(|e| e.path).collect();
        assert_eq!(paths, [Some("reduce-scatter-reg"), Some("twoshot"), None]);
        let line: serde_json::Value = serde_json::from_str(&e[0].to_json()).unwrap();
        assert_eq!(line["path"], "reduce-scatter-reg");
        let line: serde_json::Value = serde_json::from_str(&e[2].to_json()).unwrap();
        assert!(line["path"].is_null(), "{line}");
    }

    /// The all-reduce's kernel path goes into its line as "kernel", beside the algorithm; a
    /// call that names none has null, and a new call never inherits the last one's.
    #[test]
    fn the_kernel_path_is_the_current_calls_own() {
        let mut r = Recorder::new(4, None);
        r.begin(&call(8));
        r.path(Algorithm::TwoShot);
        r.kernel("ce");
        r.end(true);
        r.begin(&call(8));
        r.path(Algorithm::TwoShot);
        r.end(true);
        let lines: Vec<serde_json::Value> = r
            .entries()
            .iter()
            .map(|e| serde_json::from_str(&e.to_json()).unwrap())
            .collect();
        assert_eq!(
            (&lines[0]["path"], &lines[0]["kernel"]),
            (&"twoshot".into(), &"ce".into())
        );
        assert!(lines[1]["kernel"].is_null(), "{}", lines[1]);
    }

    #[test]
    fn times_come_out_as_the_wall_clock() {
        let mut r = Recorder::new(4, None);
        let before = now_ns();
        r.begin(&call(1));
        std::thread::sleep(std::time::Duration::from_millis(20));
        r.end(true);
        // Calibration over a short span still has to land within a millisecond.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let after = now_ns();
        let e = r.entries()[0];
        let ms = 1_000_000;
        assert!(
            e.start_ns + ms >= before && e.start_ns <= before + ms,
            "{e:?} {before}"
        );
        let took = e.end_ns - e.start_ns;
        assert!((19 * ms..=30 * ms).contains(&took), "{took} ns");
        assert!(e.end_ns < after, "{e:?} {after}");
    }

    #[test]
    fn off_records_nothing_and_leaves_errors_alone() {
        let mut r = Recorder::new(0, None);
        r.identify(who("off"));
        r.begin(&call(1));
        r.path(Algorithm::OneShot);
        r.end(true);
        assert!(r.entries().is_empty());
        let e = r.note(Error::invalid(3, "all_reduce", "null buffer pointer"));
        assert_eq!(
            e.to_string(),
            "rank 3: invalid argument to all_reduce: null buffer pointer"
        );
    }

    #[test]
    fn the_first_failure_writes_the_file_and_every_error_names_it() {
        let dir =
            std::env::temp_dir().join(format!("ipcreduce-flight-unit-{}", std::process::id()));
        let mut r = Recorder::new(16, Some(dir.clone()));
        r.identify(who("unit-job"));
        r.begin(&call(64));
        r.end(true);
        r.begin(&call(65));
        let first = r.note(Error::Aborted {
            rank: 3,
            reason: "rank 0 died".into(),
        });
        let file = dir.join("ipcreduce-flight-unit-job-rank3.jsonl");
        assert_eq!(first.flight_record(), Some(file.clone()));
        assert!(
            first.to_string().contains(&file.display().to_string()),
            "{first}"
        );
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[0]["flight_record"], 1);
        assert_eq!(lines[0]["rank"], 3);
        assert_eq!(lines[0]["world"], 4);
        assert_eq!(lines[0]["job"], "unit-job");
        assert!(lines[0]["error"].as_str().unwrap().contains("rank 0 died"));
        assert_eq!(lines[1]["seq"], 1);
        assert_eq!(lines[1]["state"], "ok");
        assert_eq!(lines[2]["count"], 65);
        assert_eq!(lines[2]["state"], "running");
        assert!(lines[2]["end_ns"].is_null());
        // A later error names the same file, and noting twice does not repeat it.
        let later = r.note(Error::Aborted {
            rank: 3,
            reason: "refused".into(),
        });
        assert_eq!(later.flight_record(), Some(file.clone()));
        let again = r.note(later);
        assert_eq!(
            again.to_string().matches("flight record").count(),
            1,
            "{again}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_trace_is_written_at_close_with_the_first_failure() {
        let dir = std::env::temp_dir().join(format!("ipcreduce-trace-unit-{}", std::process::id()));
        let get = |k: &str| match k {
            "IPCREDUCE_TRACE" => Some(dir.display().to_string()),
            "IPCREDUCE_FLIGHT_DIR" => Some(dir.join("flight").display().to_string()),
            _ => None,
        };
        let mut r = Recorder::from_lookup(get).unwrap();
        r.identify(who("tr"));
        r.begin(&call(7));
        r.end(true);
        r.close();
        let file = dir.join("ipcreduce-trace-tr-rank3.jsonl");
        let read = || -> Vec<serde_json::Value> {
            std::fs::read_to_string(&file)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let lines = read();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["written"], "close");
        assert!(lines[0]["error"].is_null());
        assert_eq!(lines[1]["count"], 7);
        // A failure later: its dump goes to the flight directory, and the trace at close has
        // both calls and the error.
        r.begin(&call(8));
        let e = r.note(Error::invalid(3, "all_reduce", "null buffer pointer"));
        assert_eq!(
            e.flight_record(),
            Some(dir.join("flight").join("ipcreduce-flight-tr-rank3.jsonl"))
        );
        r.close();
        let lines = read();
        assert_eq!(lines.len(), 3);
        assert!(lines[0]["error"]
            .as_str()
            .unwrap()
            .contains("null buffer pointer"));
        assert_eq!(lines[2]["state"], "running");
        // Tracing with no ring is refused.
        let off = |k: &str| match k {
            "IPCREDUCE_TRACE" => Some("/tmp".to_string()),
            "IPCREDUCE_FLIGHT" => Some("0".to_string()),
            _ => None,
        };
        let e = Recorder::from_lookup(off)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("IPCREDUCE_TRACE"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// What recording costs per call (begin, path, end: two stamps and one entry written), in CPU
    /// time:
    /// `cargo test --release -p ipcreduce --lib flight::tests::cost -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn cost() {
        for times in [true, false] {
            let mut r = Recorder::new(DEFAULT_CAPACITY, None);
            r.times = times;
            let id = call(2);
            let n = 2_000_000u32;
            // This thread's CPU time, not the wall clock: other processes on the machine would
            // count otherwise.
            let cpu = || {
                let mut t = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: writes one timespec.
                unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
                t.tv_sec as f64 * 1e9 + t.tv_nsec as f64
            };
            let t = cpu();
            for _ in 0..n {
                r.begin(std::hint::black_box(&id));
                r.path(Algorithm::OneShot);
                r.end(true);
            }
            let ns = (cpu() - t) / f64::from(n);
            println!("flight recorder, times {times}: {ns:.1} ns per call");
            assert_eq!(r.entries().len(), DEFAULT_CAPACITY);
        }
    }

    #[test]
    fn bad_sizes_are_refused_by_name() {
        let env = |v: &'static str| move |k: &str| (k == "IPCREDUCE_FLIGHT").then(|| v.to_string());
        assert_eq!(
            Recorder::from_lookup(env("")).unwrap().capacity(),
            DEFAULT_CAPACITY
        );
        assert_eq!(Recorder::from_lookup(env("0")).unwrap().capacity(), 0);
        assert_eq!(Recorder::from_lookup(env("32")).unwrap().capacity(), 32);
        let times =
            |v: &'static str| move |k: &str| (k == "IPCREDUCE_FLIGHT_TIMES").then(|| v.to_string());
        assert!(Recorder::from_lookup(times("1")).unwrap().times);
        assert!(!Recorder::from_lookup(times("0")).unwrap().times);
        let e = Recorder::from_lookup(times("yes"))
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("IPCREDUCE_FLIGHT_TIMES"), "{e}");
        for bad in ["x", "-1", "99999999999"] {
            let e = Recorder::from_lookup(env(bad))
                .err()
                .expect(bad)
                .to_string();
            assert!(e.contains("IPCREDUCE_FLIGHT"), "{e}");
        }
    }
}
