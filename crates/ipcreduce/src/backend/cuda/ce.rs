//! Copy-engine paths of two ranks: the copy engines move the data and leave the SMs to the
//! caller's compute; a small kernel reduces locally, in rank order with f32 accumulation, so
//! every result is bitwise the one of every other path.
//!
//! [`launch`]: registered buffers, out of place, large messages, over NVLink. Rank r owns
//! shard r of the message:
//! 1. push our input's shard q (the peer's) into the peer's output, where it waits to be
//!    reduced (the peer's output doubles as its scratch: no workspace, no size limit);
//! 2. barrier: the peer's input for our shard has landed in our output;
//! 3. reduce in place: output = op(in_0, in_1);
//! 4. push our reduced shard into the peer's output.
//!
//! [`launch_staged`]: the host-staged transport (no peer access), large messages. Each chunk
//! of our input is copied into our slot in host memory, the peer's copy of it out of the
//! peer's slot into a device scratch, and reduced with our input into the output. Its copies
//! run on two streams of their own (one per direction of the link), beside the lanes.
//!
//! The chunks take turns on `LANES` streams forked from the caller's stream (events;
//! capturable in CUDA graphs), so the copies of one chunk overlap the work of another. The
//! cross-process order comes from one-block barrier kernels (`ipcr_ce_barrier`), which wait
//! with the same deadline, abort check and error record as every kernel: no wait here can
//! hang. Per lane and call: a barrier "inputs ready, outputs free, same call" (with the stamp
//! check), then barriers per chunk.
//!
//! Traced (`IPCREDUCE_TRACE`), the barriers and reduces stamp their phases like every kernel,
//! one row of the phase-stamp ring each ([`Rows`]): a barrier's start says the copies before it
//! on its lane are done, its peer stamp when the peer's lane was there too; a chunk's row ends
//! with its reduce. So a trace shows each chunk's copies and reduce without an event between
//! them (events would cost an eager call microseconds of host time).

use super::driver;
use super::kernels::{CHECK_BEGIN, CHECK_ROW_REDUCED, CHECK_STAMPS, MAX_BLOCKS};
use super::launcher::{CallArgs, Kernel, KernelArgs, Launcher};
use super::memory::DeviceAlloc;
use crate::error::Result;
use crate::plan::{shard, Span};
use cudarc::driver::{safe as cs, sys};
use std::sync::Arc;

/// Streams that take the chunks in turn.
const LANES: usize = 2;
/// Counter and flag slots of the lanes: the last ones (see `ipcr_ce_barrier`).
const FIRST_LANE_SLOT: usize = MAX_BLOCKS - LANES;
/// Bytes of a shard per chunk (measured best for a plain CE pipeline on H200: 8 MB).
const CHUNK_BYTES: usize = 8 << 20;
const BARRIER_THREADS: u32 = 32;
const REDUCE_THREADS: u32 = 512;

/// An event for stream ordering only (no timing).
struct Event(sys::CUevent);

// SAFETY: a CUevent handle may be used from any thread of the process; the communicator that
// owns it is used by one thread at a time (&mut self).
unsafe impl Send for Event {}

impl Event {
    fn new(rank: usize) -> Result<Event> {
        let ev = driver::event_create(rank, || "cuEventCreate (copy-engine path)".into())?;
        Ok(Event(ev))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by cuEventCreate, destroyed once.
        unsafe { driver::event_destroy(self.0) }
    }
}

/// The lane streams and the events that fork them from, and join them to, the caller's stream.
pub(super) struct Lanes {
    fork: Event,
    joins: Vec<Event>,
    streams: Vec<Arc<cs::CudaStream>>,
}

impl Lanes {
    fn new(ctx: &Arc<cs::CudaContext>, rank: usize) -> Result<Lanes> {
        let mut streams = Vec::new();
        let mut joins = Vec::new();
        for _ in 0..LANES {
            streams.push(new_stream(ctx, rank)?);
            joins.push(Event::new(rank)?);
        }
        Ok(Lanes {
            fork: Event::new(rank)?,
            joins,
            streams,
        })
    }
}

fn new_stream(ctx: &Arc<cs::CudaContext>, rank: usize) -> Result<Arc<cs::CudaStream>> {
    ctx.new_stream()
        .map_err(|e| super::driver::from_cudarc(rank, "stream creation (copy-engine path)", e))
}

/// Chunks of the host-staged path in flight at once: chunk k uses position k % DEPTH of both
/// ranks' staging slots and of our scratch. With two, a chunk's copy into host memory waited
/// for the chunk two before to be read by both ranks, a copy and two barriers (each tens of
/// microseconds through host memory) later; four leave the copies that slack.
const STAGED_DEPTH: usize = 4;

/// The host-staged path's own streams and events, beside the barrier lanes: its copies run on
/// streams of their own, so that no barrier (a kernel waiting for the peer through host
/// memory) stands between two copies of one direction of the link.
pub(super) struct StagedLanes {
    /// Copies into host memory (0) and out of it (1).
    copies: [Arc<cs::CudaStream>; 2],
    /// Join the copy streams into the caller's stream (eager calls).
    joins: [Event; 2],
    /// Our copy of a chunk into host memory is done (copy stream 0 to lane 0).
    copied_in: Event,
    /// A chunk is in both ranks' slots (lane 0 to copy stream 1).
    ready: Event,
    /// Our copy of the peer's chunk out of host memory is done (copy stream 1 to lane 1).
    copied_out: Event,
    /// Slot position p is read by both ranks and may be written again (lane 1 to copy stream 0).
    freed: [Event; STAGED_DEPTH],
    /// Scratch position p is reduced and may be written again (lane 1 to copy stream 1).
    drained: [Event; STAGED_DEPTH],
}

impl StagedLanes {
    fn new(ctx: &Arc<cs::CudaContext>, rank: usize) -> Result<StagedLanes> {
        let events = || -> Result<[Event; STAGED_DEPTH]> {
            Ok([
                Event::new(rank)?,
                Event::new(rank)?,
                Event::new(rank)?,
                Event::new(rank)?,
            ])
        };
        Ok(StagedLanes {
            copies: [new_stream(ctx, rank)?, new_stream(ctx, rank)?],
            joins: [Event::new(rank)?, Event::new(rank)?],
            copied_in: Event::new(rank)?,
            ready: Event::new(rank)?,
            copied_out: Event::new(rank)?,
            freed: events()?,
            drained: events()?,
        })
    }
}

/// Byte offset and length of chunk `k` of `s` (elements of `size` bytes, `chunk` per chunk).
fn part(s: Span, k: usize, chunk: usize, size: usize) -> (u64, usize) {
    let a = (s.start + k * chunk).min(s.end);
    let b = (s.start + (k + 1) * chunk).min(s.end);
    ((a * size) as u64, (b - a) * size)
}

/// The copy-engine paths' lanes, made at their first call (or at start-up for the host-staged
/// path), and the host-staged path's copy streams and device scratch.
pub(super) struct Engine {
    // The lanes (streams and events) and the scratch go before the context they were made in.
    lanes: Option<Lanes>,
    staged: Option<StagedLanes>,
    /// Host-staged: `STAGED_DEPTH` chunks of the peer's input, one per slot position.
    scratch: Option<DeviceAlloc>,
    ctx: Arc<cs::CudaContext>,
}

impl Engine {
    pub fn new(ctx: Arc<cs::CudaContext>) -> Engine {
        Engine {
            lanes: None,
            staged: None,
            scratch: None,
            ctx,
        }
    }

    /// The lanes, made now if this is the path's first call.
    pub fn lanes(&mut self, rank: usize) -> Result<&Lanes> {
        if self.lanes.is_none() {
            self.lanes = Some(Lanes::new(&self.ctx, rank)?);
        }
        Ok(self.lanes.as_ref().expect("made above"))
    }

    /// Makes the host-staged path's lanes, copy streams and its scratch (as many bytes as
    /// the two staging slots of `slot_bytes`), at start-up: neither a stream nor memory may be
    /// made while the caller's stream is being captured into a graph.
    pub fn prepare_staged(&mut self, rank: usize, slot_bytes: usize) -> Result<()> {
        self.lanes(rank)?;
        self.staged = Some(StagedLanes::new(&self.ctx, rank)?);
        self.scratch = Some(DeviceAlloc::new(2 * slot_bytes, rank)?);
        Ok(())
    }

    /// The lanes, copy streams and scratch of the host-staged path
    /// ([`Engine::prepare_staged`]).
    pub fn staged(&self) -> Option<(&Lanes, &StagedLanes, &DeviceAlloc)> {
        match (&self.lanes, &self.staged, &self.scratch) {
            (Some(l), Some(c), Some(s)) => Some((l, c, s)),
            _ => None,
        }
    }
}

/// The phase-stamp rows of one call's kernels (`Args::trace_row`; what they stamp: ce.cu).
/// Both paths: lane j's first barrier stamps the row of its lane slot (`FIRST_LANE_SLOT + j`,
/// where the barrier's peer check stamps the peer). Then the registered path gives chunk k (its
/// barrier, then its reduce) row k and lane j's last barrier row `chunks + j`; the host-staged
/// path gives chunk k's barrier on lane 0 (its copy into host memory is done on both ranks) row
/// 2k and its barrier and reduce on lane 1 row 2k + 1. A kernel whose row would reach the lane
/// slots is launched without stamps: a call of more chunks (registered: more than 124, 8 MiB of
/// each rank's share each, about 2 GiB; host-staged: more than 63, a sixteenth of the call
/// each, at most half a staging slot) shows its first ones.
struct Rows;

impl Rows {
    fn first(lane: usize) -> usize {
        FIRST_LANE_SLOT + lane
    }

    fn chunk(k: usize) -> usize {
        k
    }

    fn last(chunks: usize, lane: usize) -> usize {
        chunks + lane
    }

    fn staged_in(k: usize) -> usize {
        2 * k
    }

    fn staged_out(k: usize) -> usize {
        2 * k + 1
    }

    /// `a` stamps row `row` (the first barriers' lane slots, or a row below them), else
    /// nothing (no ring).
    fn set(a: &mut KernelArgs, row: usize, first: bool) {
        if first || row < FIRST_LANE_SLOT {
            a.trace_row = row as i32;
        } else {
            a.phases = 0;
        }
    }
}

/// What both paths enqueue: copies, barriers, reduces and stream order, on one call's lanes.
struct Enqueue<'a> {
    l: &'a Launcher,
    lanes: &'a Lanes,
    args: &'a KernelArgs,
    call: &'a CallArgs,
}

impl Enqueue<'_> {
    /// Whether the call runs the phase-stamp variants (tracing).
    fn traced(&self) -> bool {
        self.l.phases.is_some()
    }

    fn lane(&self, j: usize) -> sys::CUstream {
        self.lanes.streams[j].cu_stream()
    }

    /// A copy of `bytes` on `stream` (a lane, or a copy stream of the host-staged path; none
    /// of 0 bytes); `what` names it in an error.
    ///
    /// # Safety
    /// Both ranges must lie in memory the call may touch: its send and recv (which the caller
    /// vouched for), the peer's registered buffers or workspace as mapped here, our scratch.
    unsafe fn copy(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: sys::CUstream,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: as the caller vouched; the stream is one of our context.
        unsafe { driver::copy_async(dst, src, bytes, stream, self.l.rank, what) }
    }

    /// Lane `j`'s barrier with the peer's lane `j`. `first`: the lane's first of the call,
    /// which compares the call's stamps; lane 0's also starts the call (advances the call
    /// counter, posts the identity). Traced, it stamps phase-stamp row `row`, whose reduce and
    /// end a reduce kernel behind it stamps when `reduced`.
    fn barrier(&self, j: usize, first: bool, row: usize, reduced: bool) -> Result<()> {
        let mut a = *self.args;
        a.lane = (FIRST_LANE_SLOT + j) as i32;
        a.check = match (first, j) {
            (true, 0) => CHECK_STAMPS | CHECK_BEGIN,
            (true, _) => CHECK_STAMPS,
            _ => 0,
        };
        if reduced {
            a.check |= CHECK_ROW_REDUCED;
        }
        Rows::set(&mut a, row, first);
        let k = Kernel {
            f: self.l.gpu.ce_barrier(self.traced()),
            grid: 1,
            threads: BARRIER_THREADS,
            stream: self.lane(j),
        };
        self.l.launch(k, &mut a, || {
            format!("launching the copy-engine barrier (lane {j})")
        })
    }

    /// The reduce on lane `j` of `bytes` at byte offset `off` of the call: recv = op(send,
    /// `theirs`), `theirs` the peer's input as copied here. Traced, it ends phase-stamp row
    /// `row` (its barrier's, which was told so).
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        f: sys::CUfunction,
        ctas: u32,
        j: usize,
        off: u64,
        bytes: usize,
        theirs: u64,
        row: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let (dtype, op) = (self.call.dtype, self.call.op);
        let mut a = *self.args;
        Rows::set(&mut a, row, false);
        a.send += off;
        a.recv += off;
        a.rsend[1 - self.l.rank] = theirs;
        let n = bytes / dtype.size();
        a.count = n as u64;
        let kernel = Kernel {
            f,
            grid: ctas,
            threads: REDUCE_THREADS,
            stream: self.lane(j),
        };
        self.l.launch(kernel, &mut a, || {
            format!("launching the copy-engine reduce ({n} x {dtype} {op})")
        })
    }

    /// `ev` marks what `from` has enqueued so far.
    fn record(&self, ev: &Event, from: sys::CUstream) -> Result<()> {
        // SAFETY: an event of our context on a stream of it (the caller's as its call
        // vouched).
        unsafe {
            driver::event_record(ev.0, from, self.l.rank, || {
                "cuEventRecord (copy-engine path)".into()
            })
        }
    }

    /// `to` waits for `ev`'s last record.
    fn wait(&self, ev: &Event, to: sys::CUstream) -> Result<()> {
        // SAFETY: as in `record`.
        unsafe {
            driver::stream_wait(to, ev.0, self.l.rank, || {
                "cuStreamWaitEvent (copy-engine path)".into()
            })
        }
    }

    /// `to` waits for what `from` has enqueued so far.
    fn record_wait(&self, ev: &Event, from: sys::CUstream, to: sys::CUstream) -> Result<()> {
        self.record(ev, from)?;
        self.wait(ev, to)
    }

    /// Forks every lane from the caller's stream and passes its first barrier: inputs ready,
    /// outputs and slots free, the same call on both ranks.
    fn begin(&self) -> Result<()> {
        for j in 0..LANES {
            self.record_wait(&self.lanes.fork, self.call.stream, self.lane(j))?;
            self.barrier(j, true, Rows::first(j), false)?;
        }
        Ok(())
    }

    /// Joins every lane into the caller's stream.
    fn end(&self) -> Result<()> {
        for j in 0..LANES {
            self.record_wait(&self.lanes.joins[j], self.lane(j), self.call.stream)?;
        }
        Ok(())
    }
}

/// Enqueues the copy-engine all-reduce of `args` (registered buffers, two ranks, out of place)
/// on `call`'s stream; `ctas` for the reduce kernel.
pub(super) fn launch(
    l: &Launcher,
    lanes: &Lanes,
    args: &KernelArgs,
    call: &CallArgs,
    ctas: u32,
) -> Result<()> {
    let q = Enqueue {
        l,
        lanes,
        args,
        call,
    };
    let size = call.dtype.size();
    let rank = l.rank;
    let peer = 1 - rank;
    let count = args.count as usize;
    let mine = shard(count, 2, rank, 16 / size);
    let theirs = shard(count, 2, peer, 16 / size);
    let chunk = CHUNK_BYTES / size;
    // Both ranks cut the same number of chunks: every lane passes the same barriers.
    let chunks = mine.len().max(theirs.len()).div_ceil(chunk).max(1);
    let (send, recv, peer_recv) = (args.send, args.recv, args.rrecv[peer]);
    let reduce = l.gpu.function_of(
        crate::plan::CudaPath::Ce,
        call.dtype,
        call.op,
        q.traced(),
        rank,
    )?;
    let push = |what: &'static str, bytes: usize| {
        move || format!("copy-engine push of {bytes} bytes ({what}) to rank {peer}")
    };

    q.begin()?;
    for k in 0..chunks {
        let j = k % LANES;
        let (off, bytes) = part(theirs, k, chunk, size);
        // SAFETY: our send and the peer's registered recv, within the call's bytes.
        unsafe {
            q.copy(
                peer_recv + off,
                send + off,
                bytes,
                q.lane(j),
                push("input", bytes),
            )?
        };
        let (off, bytes) = part(mine, k, chunk, size);
        // The peer's input for our chunk k has landed.
        q.barrier(j, false, Rows::chunk(k), bytes > 0)?;
        // The peer's input was pushed into our recv.
        q.reduce(reduce, ctas, j, off, bytes, recv + off, Rows::chunk(k))?;
        // SAFETY: as above, our recv.
        unsafe {
            q.copy(
                peer_recv + off,
                recv + off,
                bytes,
                q.lane(j),
                push("result", bytes),
            )?
        };
    }
    for j in 0..LANES {
        // Every push into our output has landed.
        q.barrier(j, false, Rows::last(chunks, j), false)?;
    }
    q.end()
}

/// Enqueues the host-staged copy-engine all-reduce of `args` (two ranks, host-staged
/// transport: `args.data` are the ranks' data areas in host memory, two slots of
/// `args.slot_bytes`) on `call`'s stream, in chunks of `chunk_bytes` (at most a
/// `STAGED_DEPTH`th of the data area and of the scratch); `ctas` for the reduce kernel.
///
/// Chunk k uses position p = k % `STAGED_DEPTH` of both ranks' data areas and of our scratch.
/// Eager, four streams, so that each direction of the PCIe link carries one copy after another
/// and the barriers (kernels that meet the peer's through host memory) wait beside them
/// (captured into a graph, the copy streams are the lanes themselves):
/// - copy stream 0: (k >= DEPTH: wait `freed[p]`, recorded at chunk k - DEPTH) copy chunk k of
///   our send into our position p; event `copied_in`;
/// - lane 0: barrier: chunk k is in both ranks' slots; event `ready`;
/// - copy stream 1: wait `ready` (and k >= DEPTH: `drained[p]`); copy the peer's chunk k into
///   our scratch's position p; event `copied_out`;
/// - lane 1: barrier: both ranks have read chunk k's slots; event `freed[p]`; reduce recv =
///   op(send, scratch) for chunk k; event `drained[p]`.
///
/// Each event is waited for once, before it is recorded again (in the order enqueued here), so
/// one event per edge serves every chunk.
///
/// Across calls: a call's first barriers meet the peer's only once the peer's previous call
/// has ended (its streams joined into its stream, which forked this call's), so no slot is
/// written while the peer still reads it; and a call ends only after its last barrier on lane
/// 1, passed when both ranks have read every slot (each rank's copies out of host memory are
/// in order on one stream), so the staged kernels' next call may write its slots at once. In
/// place is safe: recv's chunk k is written only after copy stream 0 copied send's chunk k, and
/// later chunks read other elements.
#[allow(clippy::too_many_arguments)]
pub(super) fn launch_staged(
    l: &Launcher,
    lanes: &Lanes,
    staged: &StagedLanes,
    scratch: &DeviceAlloc,
    args: &KernelArgs,
    call: &CallArgs,
    chunk_bytes: usize,
    ctas: u32,
) -> Result<()> {
    let q = Enqueue {
        l,
        lanes,
        args,
        call,
    };
    let rank = l.rank;
    let peer = 1 - rank;
    let size = call.dtype.size();
    let position_bytes = 2 * args.slot_bytes as usize / STAGED_DEPTH;
    let scratch_position = scratch.bytes / STAGED_DEPTH;
    let chunk = (chunk_bytes.min(position_bytes).min(scratch_position) / size).max(1);
    // Smaller chunks at both ends, where one direction of the link would idle for a chunk.
    let pieces = crate::plan::ce_staged_pieces(args.count as usize, size, chunk);
    let chunks = pieces.len();
    let reduce = l.gpu.function_of(
        crate::plan::CudaPath::CeStaged,
        call.dtype,
        call.op,
        q.traced(),
        rank,
    )?;
    let slot = |r: usize, k: usize| args.data[r] + (k % STAGED_DEPTH * position_bytes) as u64;
    let scratch_at = |k: usize| scratch.ptr + (k % STAGED_DEPTH * scratch_position) as u64;
    // Captured into a CUDA graph, the copies stay on the lanes (copy stream 0 is lane 0, copy
    // stream 1 lane 1, each in the order listed above): with copy streams of their own, graphs
    // of these calls ran 1.3-12x slower than graphs with the copies on the lanes (two ranks
    // under MPS on one H100, 2026-12-07, bench/results/2026-12-07-h100-ce-staged-streams/: 763
    // against 63 us a call at 64 KiB, where an eager call took 61 us), for a reason not found.
    // On the lanes, every event edge below still holds and each lane adds its own order.
    let captured = l.origin.is_some();
    let (up, down) = if captured {
        (q.lane(0), q.lane(1))
    } else {
        (staged.copies[0].cu_stream(), staged.copies[1].cu_stream())
    };

    q.begin()?;
    // Our copies into host memory start once lane 0's first barrier says every slot is free.
    q.record_wait(&staged.ready, q.lane(0), up)?;
    for (k, piece) in pieces.iter().enumerate() {
        let (off, bytes) = ((piece.start * size) as u64, piece.len() * size);
        let p = k % STAGED_DEPTH;
        if k >= STAGED_DEPTH {
            q.wait(&staged.freed[p], up)?;
        }
        // SAFETY: chunk k of our send (within the call's bytes) into our position p (bytes <=
        // the position).
        unsafe {
            q.copy(slot(rank, k), args.send + off, bytes, up, || {
                format!(
                    "copy-engine copy of {bytes} bytes into our host-staged slot (for rank {peer})"
                )
            })?
        };
        q.record_wait(&staged.copied_in, up, q.lane(0))?;
        q.barrier(0, false, Rows::staged_in(k), false)?; // chunk k is in both ranks' slots
        q.record_wait(&staged.ready, q.lane(0), down)?;
        if k >= STAGED_DEPTH {
            q.wait(&staged.drained[p], down)?;
        }
        // SAFETY: the peer's position p as mapped here, into position p of our scratch (bytes
        // <= the position).
        unsafe {
            q.copy(scratch_at(k), slot(peer, k), bytes, down, || {
                format!("copy-engine copy of {bytes} bytes out of rank {peer}'s host-staged slot")
            })?
        };
        q.record_wait(&staged.copied_out, down, q.lane(1))?;
        // Both ranks have read chunk k's slots.
        q.barrier(1, false, Rows::staged_out(k), bytes > 0)?;
        let again = k + STAGED_DEPTH < chunks;
        if again {
            q.record(&staged.freed[p], q.lane(1))?;
        }
        q.reduce(
            reduce,
            ctas,
            1,
            off,
            bytes,
            scratch_at(k),
            Rows::staged_out(k),
        )?;
        if again {
            q.record(&staged.drained[p], q.lane(1))?;
        }
    }
    if !captured {
        q.record_wait(&staged.joins[0], up, call.stream)?;
        q.record_wait(&staged.joins[1], down, call.stream)?;
    }
    q.end()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kernel_of_a_call_stamps_its_own_row_or_none() {
        let stamped = |row: usize, first: bool| {
            let mut a = KernelArgs {
                phases: 0x1000,
                ..KernelArgs::default()
            };
            Rows::set(&mut a, row, first);
            (a.phases != 0).then_some(a.trace_row as usize)
        };
        for chunks in [1usize, 3, 60, 200] {
            let mut rows = Vec::new();
            for j in 0..LANES {
                rows.push(stamped(Rows::first(j), true));
                rows.push(stamped(Rows::last(chunks, j), false));
            }
            for k in 0..chunks {
                rows.push(stamped(Rows::chunk(k), false));
            }
            let mut seen: Vec<usize> = rows.iter().flatten().copied().collect();
            // The first barriers always; every row inside the ring, none twice.
            assert!(seen.contains(&(MAX_BLOCKS - 1)) && seen.contains(&(MAX_BLOCKS - 2)));
            assert!(seen.iter().all(|&r| r < MAX_BLOCKS));
            let n = seen.len();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), n, "{chunks} chunks: a row twice");
            // Every kernel of a call of few chunks stamps.
            if chunks + LANES <= FIRST_LANE_SLOT {
                assert_eq!(n, rows.len(), "{chunks} chunks");
            }
        }
        // Host-staged: two rows per chunk.
        let mut seen: Vec<usize> = (0..100)
            .flat_map(|k| [Rows::staged_in(k), Rows::staged_out(k)])
            .filter_map(|r| stamped(r, false))
            .collect();
        assert_eq!(seen.len(), FIRST_LANE_SLOT);
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), FIRST_LANE_SLOT);
    }

    #[test]
    fn chunks_cover_each_shard_once() {
        for count in [1usize, 7, 8, 4096, (3 << 20) + 5] {
            for size in [2usize, 4] {
                let chunk = 1000;
                for r in 0..2 {
                    let s = shard(count, 2, r, 16 / size);
                    let chunks = shard(count, 2, 0, 16 / size)
                        .len()
                        .max(shard(count, 2, 1, 16 / size).len())
                        .div_ceil(chunk)
                        .max(1);
                    let mut next = (s.start * size) as u64;
                    for k in 0..chunks {
                        let (off, bytes) = part(s, k, chunk, size);
                        if bytes > 0 {
                            assert_eq!(off, next);
                            next += bytes as u64;
                        }
                    }
                    assert_eq!(next, (s.end * size) as u64, "count {count} size {size}");
                }
            }
        }
    }
}
