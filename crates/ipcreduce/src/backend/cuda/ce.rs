//! Copy-engine path: two ranks, registered buffers, out of place, large messages. The copy
//! engines move the data over NVLink and leave the SMs to the caller's compute; a small kernel
//! reduces locally. Rank r owns shard r of the message:
//! 1. push our input's shard q (the peer's) into the peer's output, where it waits to be
//!    reduced (the peer's output doubles as its scratch: no workspace, no size limit);
//! 2. barrier: the peer's input for our shard has landed in our output;
//! 3. reduce in place, in rank order with f32 accumulation: output = op(in_0, in_1), so the
//!    result is bitwise the one of every other path;
//! 4. push our reduced shard into the peer's output.
//!
//! The shards are cut into chunks that take turns on `LANES` streams forked from the caller's
//! stream (events; capturable in CUDA graphs), so the copies of one chunk overlap the reduction
//! of another. The cross-process order comes from one-block barrier kernels (`ipcr_ce_barrier`),
//! which wait with the same deadline, abort check and error record as every kernel: no wait
//! here can hang. Per lane and call: a barrier "inputs ready, outputs free, same call" (with the
//! stamp check), one barrier per chunk, and one "every push has landed" at the end.

use super::driver;
use super::kernels::{CHECK_BEGIN, CHECK_STAMPS, MAX_BLOCKS};
use super::launcher::{CallArgs, Kernel, KernelArgs, Launcher};
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
            streams.push(ctx.new_stream().map_err(|e| {
                super::driver::from_cudarc(rank, "stream creation (copy-engine path)", e)
            })?);
            joins.push(Event::new(rank)?);
        }
        Ok(Lanes {
            fork: Event::new(rank)?,
            joins,
            streams,
        })
    }
}

/// Byte offset and length of chunk `k` of `s` (elements of `size` bytes, `chunk` per chunk).
fn part(s: Span, k: usize, chunk: usize, size: usize) -> (u64, usize) {
    let a = (s.start + k * chunk).min(s.end);
    let b = (s.start + (k + 1) * chunk).min(s.end);
    ((a * size) as u64, (b - a) * size)
}

/// The copy-engine path's lanes, made at its first call.
pub(super) struct Engine {
    // The lanes (streams and events) go before the context they were made in.
    lanes: Option<Lanes>,
    ctx: Arc<cs::CudaContext>,
}

impl Engine {
    pub fn new(ctx: Arc<cs::CudaContext>) -> Engine {
        Engine { lanes: None, ctx }
    }

    /// The lanes, made now if this is the path's first call.
    pub fn lanes(&mut self, rank: usize) -> Result<&Lanes> {
        if self.lanes.is_none() {
            self.lanes = Some(Lanes::new(&self.ctx, rank)?);
        }
        Ok(self.lanes.as_ref().expect("made above"))
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
    let (dtype, op, stream) = (call.dtype, call.op, call.stream);
    let rank = l.rank;
    let lane = |j: usize| lanes.streams[j].cu_stream();
    let size = dtype.size();
    let peer = 1 - rank;
    let count = args.count as usize;
    let mine = shard(count, 2, rank, 16 / size);
    let theirs = shard(count, 2, peer, 16 / size);
    let chunk = CHUNK_BYTES / size;
    // Both ranks cut the same number of chunks: every lane passes the same barriers.
    let chunks = mine.len().max(theirs.len()).div_ceil(chunk).max(1);
    let (send, recv, peer_recv) = (args.send, args.recv, args.rrecv[peer]);
    let reduce = l.gpu.function(crate::plan::CudaPath::Ce, dtype, op, rank)?;

    let copy = |dst: u64, src: u64, bytes: usize, s: sys::CUstream, what: &str| {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie in registered buffers (ours, and the peer's mapped here),
        // inside the call's send/recv, which the caller vouched for; `s` is a lane.
        unsafe {
            driver::copy_async(dst, src, bytes, s, rank, || {
                format!("copy-engine push of {bytes} bytes ({what}) to rank {peer}")
            })
        }
    };
    // `first`: the lane's first barrier of the call, which compares the call's stamps; lane
    // 0's also starts the call (advances the call counter, posts the identity).
    let barrier = |j: usize, first: bool| {
        let mut a = *args;
        a.lane = (FIRST_LANE_SLOT + j) as i32;
        a.check = match (first, j) {
            (true, 0) => CHECK_STAMPS | CHECK_BEGIN,
            (true, _) => CHECK_STAMPS,
            _ => 0,
        };
        let k = Kernel {
            f: l.gpu.ce_barrier(),
            grid: 1,
            threads: BARRIER_THREADS,
            stream: lane(j),
        };
        l.launch(k, &mut a, || {
            format!("launching the copy-engine barrier (lane {j})")
        })
    };
    let record_wait = |ev: &Event, from: sys::CUstream, to: sys::CUstream| {
        // SAFETY: plain stream ordering on streams and an event of our context (the
        // caller's stream as its call vouched).
        unsafe {
            driver::event_record(ev.0, from, rank, || {
                "cuEventRecord (copy-engine path)".into()
            })?;
            driver::stream_wait(to, ev.0, rank, || {
                "cuStreamWaitEvent (copy-engine path)".into()
            })
        }
    };

    for j in 0..LANES {
        record_wait(&lanes.fork, stream, lane(j))?;
        barrier(j, true)?; // inputs ready, outputs free, the same call on both ranks
    }
    for k in 0..chunks {
        let j = k % LANES;
        let (off, bytes) = part(theirs, k, chunk, size);
        copy(peer_recv + off, send + off, bytes, lane(j), "input")?;
        barrier(j, false)?; // the peer's input for our chunk k has landed
        let (off, bytes) = part(mine, k, chunk, size);
        if bytes > 0 {
            let mut a = *args;
            a.send = send + off;
            a.recv = recv + off;
            let n = bytes / size;
            a.count = n as u64;
            let kernel = Kernel {
                f: reduce,
                grid: ctas,
                threads: REDUCE_THREADS,
                stream: lane(j),
            };
            l.launch(kernel, &mut a, || {
                format!("launching the copy-engine reduce ({n} x {dtype} {op})")
            })?;
        }
        copy(peer_recv + off, recv + off, bytes, lane(j), "result")?;
    }
    for j in 0..LANES {
        barrier(j, false)?; // every push into our output has landed
        record_wait(&lanes.joins[j], lane(j), stream)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
