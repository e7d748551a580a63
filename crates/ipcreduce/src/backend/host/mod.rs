//! Host backend: ranks are processes of one machine sharing memory (memfd arenas).
//!
//! Each rank owns one arena (see `arena.rs`) and maps every peer's arena once, at creation.
//! A call is cut into chunks (at most a slot, at most 1 MiB); chunk `k` of the
//! communicator's life is *epoch* `k` (1, 2, ...) and uses slot `epoch % 2`. Per epoch a rank
//! 1. puts its input where peers can read it (its slot, its heap or the ready line itself),
//! 2. publishes `ready[slot] = epoch` with a stamp of the call's arguments,
//! 3. waits for every peer's `ready[slot] >= epoch`, compares stamps, then reduces
//!    (one-shot: all of the chunk; two-shot: its shard, published as `reduced[slot]`,
//!    then gathers the peers' shards).
//!
//! Double buffering is the end barrier: a rank reaches epoch `e + 2` (and rewrites slot
//! `e % 2`) only after it saw every peer's `ready(e + 1)`, and a peer publishes that only
//! once it has finished everything it read for epoch `e`. So consecutive calls need no extra
//! synchronisation. Only zero-copy calls (input in the symmetric heap, which the user may
//! overwrite as soon as the call returns) end with a `done` barrier.

pub(crate) mod arena;
#[cfg(feature = "test-support")]
mod buffers;
mod failure;
mod fused;
mod heap;
mod oneshot;
mod reduce;
mod scatter_gather;
mod stamp;
mod sync;
#[cfg(test)]
mod tests;
mod twoshot;

pub use heap::{HostBuffer, SymmetricBuffer};

use crate::abort::AbortState;
use crate::backend::{BackendMeta, BackendOps, SgOp};
#[cfg(feature = "test-support")]
use crate::backend::{BufId, Call};
use crate::bootstrap::Bootstrap;
use crate::config::Config;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::types::{Algorithm, BackendKind, DType, ReduceOp};
use arena::{Control, Layout, Mapping, SRC_INLINE};
use failure::Fail;
use heap::HeapAlloc;
use stamp::Stamp;
use std::ffi::c_void;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
#[cfg(feature = "test-support")]
use std::time::Instant;
use sync::SpinPolicy;

/// Default data area: two slots of 4 MiB.
pub const DEFAULT_WORKSPACE_BYTES: usize = 8 << 20;
/// Largest chunk, even when slots are larger. Per-chunk sync costs ~1 us; among 128 KiB to
/// 4 MiB, 1 MiB timed best for 0.5-8 MiB messages at 2 ranks on the 2-core dev VM (by ~10%:
/// cross-core line transfers dominate whatever the chunk size).
const MAX_CHUNK_BYTES: usize = 1 << 20;
/// Two-shot shards start on multiples of this many bytes.
const SHARD_ALIGN_BYTES: usize = 64;

/// The shared-memory communicator of one rank.
pub struct HostComm {
    rank: usize,
    world: usize,
    layout: Layout,
    /// Every rank's arena, by rank (our own included), mapped for the communicator's life.
    arenas: Vec<Arc<Mapping>>,
    /// `arenas[q].base()`, kept flat for the hot path.
    bases: Vec<*mut u8>,
    abort: Arc<AbortState>,
    timeout: Duration,
    policy: SpinPolicy,
    /// Last epoch used (one per chunk); 0 before the first call.
    epoch: u64,
    /// All-reduce calls made so far (the stamp's sequence number).
    seq: u64,
    /// Barriers entered so far.
    barriers: u64,
    heap: Arc<Mutex<HeapAlloc>>,
    #[cfg(feature = "test-support")]
    bufs: buffers::Buffers,
    /// Scratch for the source list of a reduction (no allocation per call).
    srcs: Vec<*const u8>,
}

// SAFETY: the raw pointers point into mappings this struct keeps alive (and into user
// buffers only during a call); nothing is tied to the creating thread.
unsafe impl Send for HostComm {}

impl HostComm {
    /// Creates our arena, exchanges arena fds with every rank and maps theirs.
    pub fn new(boot: &mut Bootstrap, config: &Config) -> Result<HostComm> {
        let (rank, world) = (boot.rank(), boot.world());
        let layout = Layout::new(
            config.workspace_bytes.unwrap_or(DEFAULT_WORKSPACE_BYTES),
            config.host_heap_bytes(),
        );
        let (fd, own) = arena::create(&layout, world, rank)?;
        let fds = boot.all_gather_fds(fd.as_fd())?;
        drop(fd);
        Self::from_parts(
            rank,
            world,
            boot.abort_state(),
            layout,
            own,
            fds,
            config.timeout(),
        )
    }

    /// Builds the communicator from our mapped arena and every rank's arena fd (indexed by
    /// rank; ours is ignored). The fds are closed on return: the mappings keep the memory.
    fn from_parts(
        rank: usize,
        world: usize,
        abort: Arc<AbortState>,
        layout: Layout,
        own: Mapping,
        fds: Vec<OwnedFd>,
        timeout: Duration,
    ) -> Result<HostComm> {
        if fds.len() != world || rank >= world {
            return Err(Error::invalid(
                rank,
                "host communicator",
                format!("got {} arena fds for world size {world}", fds.len()),
            ));
        }
        let mut own = Some(Arc::new(own));
        let mut arenas = Vec::with_capacity(world);
        for (q, fd) in fds.iter().enumerate() {
            if q == rank {
                arenas.push(own.take().expect("own arena used once"));
                continue;
            }
            let m = Mapping::map(fd, "mapping a peer's arena")?;
            m.verify(&layout, world, q)?;
            // Fault in our page tables for the peer's flags and slots now, not in call 1.
            m.populate(0, layout.heap_off(), false);
            arenas.push(Arc::new(m));
        }
        drop(fds);
        let heap = HeapAlloc::new(layout.heap_off(), layout.heap_bytes);
        Ok(HostComm {
            rank,
            world,
            layout,
            bases: arenas.iter().map(|m| m.base()).collect(),
            arenas,
            abort,
            timeout,
            policy: SpinPolicy::for_world(world),
            epoch: 0,
            seq: 0,
            barriers: 0,
            heap: Arc::new(Mutex::new(heap)),
            #[cfg(feature = "test-support")]
            bufs: buffers::Buffers::default(),
            srcs: Vec::with_capacity(world),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Allocates `bytes` in our symmetric heap. Call it like a collective (same sizes, same
    /// order on every rank) and the buffers get the same offsets everywhere, as calls require:
    /// every call's stamp says where its input lies, and ranks whose inputs lie at different
    /// offsets (or one in the heap, one not) fail with a mismatch, as on cuda.
    pub fn alloc_symmetric(&mut self, bytes: usize) -> Result<SymmetricBuffer> {
        SymmetricBuffer::new(self.arenas[self.rank].clone(), self.heap.clone(), bytes)
    }

    /// A typed symmetric buffer of `len` zeroed elements.
    pub fn host_buffer<T: Element>(&mut self, len: usize) -> Result<HostBuffer<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            Error::invalid(self.rank, "host_buffer", format!("{len} elements overflow"))
        })?;
        Ok(HostBuffer::new(self.alloc_symmetric(bytes)?, len))
    }

    /// Returns once every rank has entered it (through shared memory, no syscalls).
    pub fn barrier(&mut self) -> Result<()> {
        self.check_alive("barrier", self.barriers + 1)?;
        self.barriers += 1;
        let n = self.barriers;
        self.own().barrier.sig.publish(n);
        for q in self.peers() {
            let r = self.wait_signal(q, &self.ctrl(q).barrier.sig, n);
            r.map_err(|f| self.fail(f, "barrier", n))?;
        }
        Ok(())
    }

    // --- accessors used by the protocols ------------------------------------------------

    fn ctrl(&self, q: usize) -> &Control {
        self.arenas[q].control()
    }

    fn own(&self) -> &Control {
        self.ctrl(self.rank)
    }

    /// Peers in the order we wait for them: starting after us, so ranks do not all queue on
    /// rank 0's lines first.
    fn peers(&self) -> impl Iterator<Item = usize> {
        let (rank, world) = (self.rank, self.world);
        (1..world).map(move |i| (rank + i) % world)
    }

    /// Next epoch and the slot it uses.
    fn next_epoch(&mut self) -> (u64, usize) {
        self.epoch += 1;
        (self.epoch, (self.epoch % 2) as usize)
    }

    fn chunk_elems(&self, dtype: DType) -> usize {
        (self.layout.slot_bytes.min(MAX_CHUNK_BYTES) / dtype.size()).max(1)
    }

    /// Where our input chunk starting at `send` lies in our own heap, if it does.
    fn heap_offset(&self, send: *const u8, bytes: usize) -> Option<usize> {
        let base = self.bases[self.rank] as usize;
        let lo = base + self.layout.heap_off();
        let hi = base + self.layout.total();
        let s = send as usize;
        (s >= lo && s.checked_add(bytes)? <= hi).then(|| s - base)
    }

    /// Publishes our ready line for `slot`: stamp and data location first, epoch last.
    fn publish_ready(&self, slot: usize, epoch: u64, stamp: &Stamp, src_off: u64) {
        let line = &self.own().ready[slot];
        stamp.write(line);
        line.src_off.store(src_off, Ordering::Relaxed);
        line.sig.publish(epoch);
    }

    /// Waits for peer `q`'s ready line of `slot` to reach `epoch`, checks its stamp against
    /// ours and that its data (`bytes` at its `src_off`) lies inside its arena. Returns a
    /// pointer to the peer's chunk.
    fn wait_ready(
        &self,
        q: usize,
        slot: usize,
        epoch: u64,
        stamp: &Stamp,
        bytes: usize,
    ) -> Result<*const u8, Fail> {
        let line = &self.ctrl(q).ready[slot];
        if let Err(f) = self.wait_signal(q, &line.sig, epoch) {
            // Stopped by an abort: when it is a peer's verdict on this very call (a mismatch
            // found first elsewhere), the stamps are there to report it as such on this rank
            // too, whichever rank it waited for.
            let stopped = matches!(f, Fail::Local | Fail::Peer { .. });
            return Err(match self.published_mismatch(slot, epoch, stamp) {
                Some(m) if stopped => m,
                _ => f,
            });
        }
        let theirs = Stamp::read(line);
        if theirs != *stamp {
            return Err(self.mismatch(q, stamp, &theirs));
        }
        let off = line.src_off.load(Ordering::Relaxed);
        if off == SRC_INLINE && bytes <= arena::INLINE_BYTES {
            return Ok(line.inline.get().cast::<u8>().cast_const());
        }
        if !self.arenas[q].contains(off, bytes) {
            return Err(Fail::Mismatch {
                peer: q,
                detail: format!("rank {q} published its data outside its arena (offset {off})"),
            });
        }
        // SAFETY: checked to lie inside peer q's mapping.
        Ok(unsafe { self.bases[q].add(off as usize) }.cast_const())
    }

    /// The mismatch with peer `q`'s stamp `theirs`: what differs, then both calls in words.
    fn mismatch(&self, q: usize, ours: &Stamp, theirs: &Stamp) -> Fail {
        Fail::Mismatch {
            peer: q,
            detail: format!(
                "{} (rank {}: {}; rank {q}: {})",
                ours.diff(theirs),
                self.rank,
                ours.describe(),
                theirs.describe()
            ),
        }
    }

    /// The first peer whose stamp for `epoch` is published and differs from ours, if any.
    fn published_mismatch(&self, slot: usize, epoch: u64, stamp: &Stamp) -> Option<Fail> {
        self.peers().find_map(|q| {
            let line = &self.ctrl(q).ready[slot];
            if line.sig.get() < epoch {
                return None;
            }
            let theirs = Stamp::read(line);
            (theirs != *stamp).then(|| self.mismatch(q, stamp, &theirs))
        })
    }

    /// The call's identity on its own (no data): one epoch whose stamp every rank compares.
    /// A count-0 call is a call like any other, so a rank making one while a peer makes
    /// another call fails with a mismatch on both, instead of pairing later calls off by one.
    fn handshake(&mut self, stamp: &Stamp) -> Result<(), Fail> {
        let (epoch, slot) = self.next_epoch();
        self.publish_ready(slot, epoch, stamp, SRC_INLINE);
        for q in self.peers() {
            self.wait_ready(q, slot, epoch, stamp, 0)?;
        }
        Ok(())
    }

    /// Runs one all-reduce (algorithm resolved).
    ///
    /// # Safety
    /// As [`BackendOps::all_reduce_raw`].
    unsafe fn all_reduce(
        &mut self,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.all_reduce_as(SgOp::AllReduce, send, recv, count, dtype, op, algo) }
    }

    /// [`Self::all_reduce`] on behalf of `what` (an all-reduce, or the one a reduce-scatter
    /// or all-gather runs): stamped and named in errors as `what`, so that ranks in different
    /// operations fail with a mismatch.
    ///
    /// # Safety
    /// As [`BackendOps::all_reduce_raw`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn all_reduce_as(
        &mut self,
        what: SgOp,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<()> {
        let name = what.name();
        if !matches!(algo, Algorithm::OneShot | Algorithm::TwoShot) {
            return Err(Error::invalid(
                self.rank,
                name,
                format!("the host backend runs oneshot or twoshot, not {algo}"),
            ));
        }
        self.check_alive(name, self.seq + 1)?;
        self.seq += 1;
        let seq = self.seq;
        let bytes = count * dtype.size();
        if self.world == 1 {
            if send != recv.cast_const() && count > 0 {
                // SAFETY: caller guarantees both valid and non-overlapping when different.
                unsafe { std::ptr::copy_nonoverlapping(send, recv, bytes) };
            }
            return Ok(());
        }
        // A count-0 call has no buffers (its pointers may be null or dangling): nothing to
        // place, only its identity to compare.
        let heap_off = (count > 0).then(|| self.heap_offset(send, bytes)).flatten();
        let in_place = count > 0 && send == recv.cast_const();
        let job = Job {
            send,
            recv,
            count,
            dtype,
            op,
            stamp: Stamp::new(seq, count, dtype, op, algo)
                .of(what)
                .placed(in_place, heap_off),
            heap_off,
        };
        // SAFETY: forwarded contract.
        let r = unsafe {
            match algo {
                _ if count == 0 => self.handshake(&job.stamp).map(|()| false),
                Algorithm::OneShot => oneshot::run(self, &job),
                _ => twoshot::run(self, &job),
            }
        };
        let zero_copy = r.as_ref().is_ok_and(|zc| *zc);
        r.map_err(|f| self.fail(f, name, seq))?;
        // Always say we are done (one store to a line nobody else writes); a zero-copy rank
        // must then wait for everyone, since its caller may overwrite the input on return.
        let e = self.epoch;
        self.own().done.sig.publish(e);
        if zero_copy {
            for q in self.peers() {
                let r = self.wait_signal(q, &self.ctrl(q).done.sig, e);
                r.map_err(|f| self.fail(f, name, seq))?;
            }
        }
        Ok(())
    }
}

/// One call as the protocols see it.
struct Job {
    send: *const u8,
    recv: *mut u8,
    count: usize,
    dtype: DType,
    op: ReduceOp,
    stamp: Stamp,
    /// Offset of `send` in our arena when it lies in our symmetric heap.
    heap_off: Option<usize>,
}

impl BackendOps for HostComm {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    unsafe fn all_reduce_raw(
        &mut self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
        _stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.all_reduce(send.cast(), recv.cast(), count, dtype, op, algo) }
    }

    unsafe fn add_rms_norm_raw(
        &mut self,
        args: &crate::fused::AddRmsNorm,
        algo: Algorithm,
        _stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.add_rms_norm(args, algo) }
    }

    unsafe fn scatter_gather_raw(
        &mut self,
        what: SgOp,
        send: *const c_void,
        recv: *mut c_void,
        shards: crate::shards::Shards,
        dtype: DType,
        op: ReduceOp,
        _stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        unsafe { self.scatter_gather(what, send.cast(), recv.cast(), shards, dtype, op) }
    }

    fn unavailable(&self, algo: Algorithm) -> Option<String> {
        match algo {
            Algorithm::Nccl => Some("NCCL is cuda-only".into()),
            _ => None,
        }
    }

    fn meta(&self) -> BackendMeta {
        let cores = crate::machine_cores();
        BackendMeta {
            devices: vec![format!("host: {cores} cores")],
            driver: None,
            nccl_version: None,
            fallback: None,
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        // Host calls are synchronous.
        Ok(())
    }

    fn async_error(&self) -> Option<Error> {
        self.abort.reason().map(|reason| Error::Aborted {
            rank: self.rank,
            reason,
        })
    }
}

#[cfg(feature = "test-support")]
impl crate::backend::TestBuffers for HostComm {
    fn alloc(&mut self, bytes: usize) -> Result<BufId> {
        self.bufs.alloc(self.rank, bytes)
    }

    fn free(&mut self, id: BufId) {
        self.bufs.free(id)
    }

    fn write(&mut self, id: BufId, data: &[u8]) -> Result<()> {
        self.bufs.write(self.rank, id, data)
    }

    fn read(&mut self, id: BufId, out: &mut [u8]) -> Result<()> {
        self.bufs.read(self.rank, id, out)
    }

    fn run(&mut self, call: &Call) -> Result<()> {
        let end = call
            .count
            .checked_mul(call.dtype.size())
            .and_then(|b| b.checked_add(call.offset));
        let (s, r) = (
            self.bufs.get(self.rank, call.send)?,
            self.bufs.get(self.rank, call.recv)?,
        );
        if end.is_none_or(|e| e > s.len || e > r.len) {
            return Err(Error::invalid(
                self.rank,
                "run",
                "offset + count exceeds the buffers",
            ));
        }
        // SAFETY: offset + bytes fits both buffers (checked above).
        let (s, r) = unsafe {
            (
                s.ptr.as_ptr().cast_const().add(call.offset),
                r.ptr.as_ptr().add(call.offset),
            )
        };
        // SAFETY: both buffers hold the call's bytes; distinct ids never overlap.
        unsafe { self.all_reduce(s, r, call.count, call.dtype, call.op, call.algo) }
    }

    fn time(
        &mut self,
        call: &Call,
        warmup: usize,
        iters: usize,
        graph: Option<usize>,
    ) -> Result<f64> {
        if graph.is_some() {
            return Err(Error::invalid(
                self.rank,
                "time",
                "CUDA graphs do not exist on the host backend",
            ));
        }
        for _ in 0..warmup {
            self.run(call)?;
        }
        // Start together, so no rank's time includes waiting for a late peer.
        self.barrier()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            self.run(call)?;
        }
        Ok(t0.elapsed().as_secs_f64() * 1e6 / iters.max(1) as f64)
    }
}
