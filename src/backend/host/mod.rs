//! Host backend: ranks are processes of one machine sharing memory (memfd arenas).
//!
//! Each rank owns one arena (see [`arena`]) and maps every peer's arena once, at creation.
//! A call is cut into chunks of at most one slot; chunk `k` of the communicator's life is
//! *epoch* `k` (1, 2, ...) and uses slot `epoch % 2`. Per epoch a rank
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

mod arena;
mod heap;
mod oneshot;
mod reduce;
mod sync;
#[cfg(test)]
mod tests;
mod twoshot;

pub use heap::{HostBuffer, SymmetricBuffer};

use crate::abort::AbortState;
use crate::backend::{BackendMeta, BackendOps, BufId, Call};
use crate::bootstrap::Bootstrap;
use crate::communicator::Options;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::types::{Algorithm, BackendKind, DType, ReduceOp};
use arena::{Control, Layout, Mapping, ReadyLine, SRC_INLINE};
use heap::HeapAlloc;
use std::ffi::c_void;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use sync::{Signal, SpinPolicy, WaitError};

/// Default data area: two slots of 4 MiB.
pub const DEFAULT_WORKSPACE_BYTES: usize = 8 << 20;
/// Default symmetric heap (virtual: pages are only allocated when buffers touch them).
pub const DEFAULT_HEAP_BYTES: usize = 64 << 20;
/// Largest chunk, even when slots are larger: small enough that a chunk written by one
/// core is still in cache when peers read it, large enough that per-chunk sync is noise.
const MAX_CHUNK_BYTES: usize = 1 << 20;
/// Two-shot shards start on multiples of this many bytes.
const SHARD_ALIGN_BYTES: usize = 64;

/// Reads `IPCREDUCE_HOST_HEAP_MB` (size of the symmetric heap; all ranks must agree).
fn heap_bytes_from_env() -> Result<usize> {
    match std::env::var("IPCREDUCE_HOST_HEAP_MB") {
        Ok(v) if !v.is_empty() => v
            .parse::<usize>()
            .ok()
            .and_then(|mb| mb.checked_mul(1 << 20))
            .ok_or_else(|| Error::Config(format!("IPCREDUCE_HOST_HEAP_MB={v} is not a size"))),
        _ => Ok(DEFAULT_HEAP_BYTES),
    }
}

/// The arguments of a call as every rank stamps them next to its ready flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    seq: u64,
    count: u64,
    codes: u32,
}

impl Stamp {
    fn new(seq: u64, count: usize, dtype: DType, op: ReduceOp, algo: Algorithm) -> Stamp {
        Stamp {
            seq,
            count: count as u64,
            codes: dtype.code() | op.code() << 8 | algo.code() << 16,
        }
    }

    fn read(line: &ReadyLine) -> Stamp {
        Stamp {
            seq: line.seq.load(Ordering::Relaxed),
            count: line.count.load(Ordering::Relaxed),
            codes: line.codes.load(Ordering::Relaxed),
        }
    }

    /// What differs, in words ("count 100 vs 200").
    fn diff(&self, peer: &Stamp) -> String {
        let name = |c: u32, field: u32| -> String {
            let v = (c >> (8 * field)) & 0xFF;
            let all: Vec<String> = match field {
                0 => DType::ALL
                    .iter()
                    .map(|d| (d.code(), d.name()))
                    .filter(|x| x.0 == v)
                    .map(|x| x.1.to_string())
                    .collect(),
                1 => ReduceOp::ALL
                    .iter()
                    .map(|o| (o.code(), o.name()))
                    .filter(|x| x.0 == v)
                    .map(|x| x.1.to_string())
                    .collect(),
                _ => [
                    Algorithm::Auto,
                    Algorithm::OneShot,
                    Algorithm::TwoShot,
                    Algorithm::Nccl,
                ]
                .iter()
                .filter(|a| a.code() == v)
                .map(|a| a.name().to_string())
                .collect(),
            };
            all.into_iter()
                .next()
                .unwrap_or_else(|| format!("code {v}"))
        };
        let mut parts = Vec::new();
        if self.seq != peer.seq {
            parts.push(format!("call #{} vs #{}", self.seq, peer.seq));
        }
        if self.count != peer.count {
            parts.push(format!("count {} vs {}", self.count, peer.count));
        }
        for (field, what) in [(0, "dtype"), (1, "op"), (2, "algorithm")] {
            let (a, b) = (name(self.codes, field), name(peer.codes, field));
            if a != b {
                parts.push(format!("{what} {a} vs {b}"));
            }
        }
        parts.join(", ")
    }
}

/// What a rank publishes in its arena's abort word when it gives up, so peers waiting on it
/// leave at once instead of running into their own timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AbortWord {
    /// Gave up waiting for `culprit`.
    Timeout { culprit: usize },
    /// Found `culprit`'s arguments different from its own.
    Mismatch { culprit: usize },
    /// Aborted for another reason (a peer died, or a cascade).
    Other,
}

impl AbortWord {
    fn encode(self) -> u64 {
        match self {
            AbortWord::Timeout { culprit } => 1 << 56 | culprit as u64,
            AbortWord::Mismatch { culprit } => 2 << 56 | culprit as u64,
            AbortWord::Other => 3 << 56,
        }
    }

    fn decode(w: u64) -> Option<AbortWord> {
        let culprit = (w & 0xFFFF_FFFF) as usize;
        match w >> 56 {
            0 => None,
            1 => Some(AbortWord::Timeout { culprit }),
            2 => Some(AbortWord::Mismatch { culprit }),
            _ => Some(AbortWord::Other),
        }
    }
}

/// Why a protocol step stopped.
enum Fail {
    Timeout {
        peer: usize,
        waited: Duration,
    },
    Mismatch {
        peer: usize,
        detail: String,
    },
    /// Our AbortState was set (by the liveness watcher, or an earlier failure).
    Local,
    /// Peer `by` published an abort word.
    Peer {
        by: usize,
        word: AbortWord,
        waiting_on: Option<usize>,
        waited: Duration,
    },
}

/// Plain heap buffer handed out by [`BackendOps::alloc`].
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Option<AlignedBuf> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 64).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(AlignedBuf { ptr, layout, len })
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

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
    bufs: Vec<Option<AlignedBuf>>,
    /// Scratch for the source list of a reduction (no allocation per call).
    srcs: Vec<*const u8>,
}

// SAFETY: the raw pointers point into mappings this struct keeps alive (and into user
// buffers only during a call); nothing is tied to the creating thread.
unsafe impl Send for HostComm {}

impl HostComm {
    /// Creates our arena, exchanges arena fds with every rank and maps theirs.
    pub fn new(boot: &mut Bootstrap, opts: &Options) -> Result<HostComm> {
        let (rank, world) = (boot.rank(), boot.world());
        let layout = Layout::new(
            opts.workspace_bytes.unwrap_or(DEFAULT_WORKSPACE_BYTES),
            heap_bytes_from_env()?,
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
            opts.timeout,
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
            bufs: Vec::new(),
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
    /// order on every rank) and the buffers get the same offsets everywhere; correctness does
    /// not depend on it, since every call publishes where its input lies.
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
        self.check_alive()?;
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
        line.seq.store(stamp.seq, Ordering::Relaxed);
        line.count.store(stamp.count, Ordering::Relaxed);
        line.codes.store(stamp.codes, Ordering::Relaxed);
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
        self.wait_signal(q, &line.sig, epoch)?;
        let theirs = Stamp::read(line);
        if theirs != *stamp {
            return Err(Fail::Mismatch {
                peer: q,
                detail: stamp.diff(&theirs),
            });
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

    /// Bounded wait for `sig` (in peer `q`'s arena) to reach `target`.
    fn wait_signal(&self, q: usize, sig: &Signal, target: u64) -> Result<(), Fail> {
        let mut why = None;
        let r = sync::wait(sig, target, self.timeout, self.policy, &mut || {
            why = self.poll_aborts(false);
            why.is_some()
        });
        match r {
            Ok(()) => Ok(()),
            Err(WaitError::Timeout { waited }) => Err(Fail::Timeout { peer: q, waited }),
            Err(WaitError::Stopped { waited }) => Err(match why {
                Some(Fail::Peer { by, word, .. }) => Fail::Peer {
                    by,
                    word,
                    waiting_on: Some(q),
                    waited,
                },
                Some(f) => f,
                None => Fail::Local,
            }),
        }
    }

    /// Our own abort state, then every peer's abort word. At the start of a call
    /// (`entering`), a peer's mismatch verdict is not yet ours: the peer published its stamp
    /// for this call before giving up, so going on lets this rank find the mismatch itself
    /// and report it as such.
    fn poll_aborts(&self, entering: bool) -> Option<Fail> {
        if self.abort.is_aborted() {
            return Some(Fail::Local);
        }
        for q in self.peers() {
            let w = self.ctrl(q).abort.word.load(Ordering::Acquire);
            match AbortWord::decode(w) {
                Some(AbortWord::Mismatch { .. }) if entering => continue,
                None => continue,
                Some(_) => {}
            }
            if let Some(word) = AbortWord::decode(w) {
                return Some(Fail::Peer {
                    by: q,
                    word,
                    waiting_on: None,
                    waited: Duration::ZERO,
                });
            }
        }
        None
    }

    /// Fails fast when the communicator is already dead.
    fn check_alive(&self) -> Result<()> {
        match self.poll_aborts(true) {
            None => Ok(()),
            Some(f) => Err(self.fail(f, "all_reduce", self.seq + 1)),
        }
    }

    /// Turns a protocol failure into the error to return, and makes the communicator dead:
    /// our abort word (so peers stop waiting for us), our AbortState (so later calls fail
    /// fast), and a wake-up for peers asleep on our flags.
    fn fail(&self, f: Fail, op: &str, seq: u64) -> Error {
        let rank = self.rank;
        let (err, word, reason) = match f {
            Fail::Timeout { peer, waited } => {
                let reason =
                    format!("rank {rank} timed out in {op} #{seq} waiting for rank {peer}");
                let e = Error::Timeout {
                    rank,
                    peer,
                    op: op.into(),
                    seq,
                    waited,
                };
                (e, AbortWord::Timeout { culprit: peer }, reason)
            }
            Fail::Mismatch { peer, detail } => {
                let reason = format!(
                    "{op} #{seq} arguments differ between ranks {rank} and {peer}: {detail}"
                );
                let e = Error::Mismatch {
                    rank,
                    peer,
                    op: op.into(),
                    seq,
                    detail,
                };
                (e, AbortWord::Mismatch { culprit: peer }, reason)
            }
            Fail::Local => {
                let reason = self.abort.reason().unwrap_or_else(|| "aborted".into());
                (
                    Error::Aborted {
                        rank,
                        reason: reason.clone(),
                    },
                    AbortWord::Other,
                    reason,
                )
            }
            Fail::Peer {
                by,
                word,
                waiting_on,
                waited,
            } => match word {
                // Someone already gave up on the rank we are waiting for: that is our timeout
                // too, reported now rather than after the rest of our own deadline.
                AbortWord::Timeout { culprit } if waiting_on == Some(culprit) => {
                    let reason = format!(
                        "rank {by} timed out waiting for rank {culprit} (in {op} #{seq} here)"
                    );
                    let e = Error::Timeout {
                        rank,
                        peer: culprit,
                        op: op.into(),
                        seq,
                        waited,
                    };
                    (e, AbortWord::Timeout { culprit }, reason)
                }
                AbortWord::Timeout { culprit } => {
                    let reason = format!("rank {by} timed out waiting for rank {culprit}");
                    (
                        Error::Aborted {
                            rank,
                            reason: reason.clone(),
                        },
                        AbortWord::Other,
                        reason,
                    )
                }
                AbortWord::Mismatch { culprit } => {
                    let reason =
                        format!("rank {by} found its arguments differ from rank {culprit}'s");
                    (
                        Error::Aborted {
                            rank,
                            reason: reason.clone(),
                        },
                        AbortWord::Other,
                        reason,
                    )
                }
                AbortWord::Other => {
                    let reason = format!("rank {by} aborted");
                    (
                        Error::Aborted {
                            rank,
                            reason: reason.clone(),
                        },
                        AbortWord::Other,
                        reason,
                    )
                }
            },
        };
        let own = self.own();
        let _ =
            own.abort
                .word
                .compare_exchange(0, word.encode(), Ordering::AcqRel, Ordering::Relaxed);
        self.abort.abort(reason);
        for l in &own.ready {
            l.sig.wake_all();
        }
        for l in &own.reduced {
            l.sig.wake_all();
        }
        own.done.sig.wake_all();
        own.barrier.sig.wake_all();
        err
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
        if !matches!(algo, Algorithm::OneShot | Algorithm::TwoShot) {
            return Err(Error::invalid(
                self.rank,
                "all_reduce",
                format!("the host backend runs oneshot or twoshot, not {algo}"),
            ));
        }
        self.check_alive()?;
        if count == 0 {
            return Ok(());
        }
        self.seq += 1;
        let seq = self.seq;
        let bytes = count * dtype.size();
        if self.world == 1 {
            if send != recv.cast_const() {
                // SAFETY: caller guarantees both valid and non-overlapping when different.
                unsafe { std::ptr::copy_nonoverlapping(send, recv, bytes) };
            }
            return Ok(());
        }
        let job = Job {
            send,
            recv,
            count,
            dtype,
            op,
            stamp: Stamp::new(seq, count, dtype, op, algo),
            heap_off: self.heap_offset(send, bytes),
        };
        // SAFETY: forwarded contract.
        let r = unsafe {
            match algo {
                Algorithm::OneShot => oneshot::run(self, &job),
                _ => twoshot::run(self, &job),
            }
        };
        let zero_copy = r.as_ref().is_ok_and(|zc| *zc);
        r.map_err(|f| self.fail(f, "all_reduce", seq))?;
        // Always say we are done (one store to a line nobody else writes); a zero-copy rank
        // must then wait for everyone, since its caller may overwrite the input on return.
        let e = self.epoch;
        self.own().done.sig.publish(e);
        if zero_copy {
            for q in self.peers() {
                let r = self.wait_signal(q, &self.ctrl(q).done.sig, e);
                r.map_err(|f| self.fail(f, "all_reduce", seq))?;
            }
        }
        Ok(())
    }

    fn buf(&self, id: BufId) -> Result<&AlignedBuf> {
        self.bufs
            .get(id)
            .and_then(|b| b.as_ref())
            .ok_or_else(|| Error::invalid(self.rank, "buffer", format!("no buffer {id}")))
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

    fn unavailable(&self, algo: Algorithm) -> Option<String> {
        match algo {
            Algorithm::Nccl => Some("NCCL is cuda-only".into()),
            _ => None,
        }
    }

    fn meta(&self) -> BackendMeta {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        BackendMeta {
            devices: vec![format!("host: {cores} cores")],
            driver: None,
            nccl_version: None,
        }
    }

    fn alloc(&mut self, bytes: usize) -> Result<BufId> {
        let b = AlignedBuf::new(bytes).ok_or_else(|| {
            Error::invalid(self.rank, "alloc", format!("cannot allocate {bytes} bytes"))
        })?;
        self.bufs.push(Some(b));
        Ok(self.bufs.len() - 1)
    }

    fn free(&mut self, id: BufId) {
        if let Some(b) = self.bufs.get_mut(id) {
            *b = None;
        }
    }

    fn write(&mut self, id: BufId, data: &[u8]) -> Result<()> {
        let b = self.buf(id)?;
        if data.len() > b.len {
            return Err(Error::invalid(
                self.rank,
                "write",
                "data larger than the buffer",
            ));
        }
        // SAFETY: the buffer holds at least data.len() bytes and is ours.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.ptr.as_ptr(), data.len()) };
        Ok(())
    }

    fn read(&mut self, id: BufId, out: &mut [u8]) -> Result<()> {
        let b = self.buf(id)?;
        if out.len() > b.len {
            return Err(Error::invalid(
                self.rank,
                "read",
                "read larger than the buffer",
            ));
        }
        // SAFETY: as in write.
        unsafe { std::ptr::copy_nonoverlapping(b.ptr.as_ptr(), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    fn run(&mut self, call: &Call) -> Result<()> {
        let bytes = call.count.checked_mul(call.dtype.size());
        let (s, r) = (self.buf(call.send)?, self.buf(call.recv)?);
        if bytes.is_none_or(|b| b > s.len || b > r.len) {
            return Err(Error::invalid(
                self.rank,
                "run",
                "count exceeds the buffers",
            ));
        }
        let (s, r) = (s.ptr.as_ptr().cast_const(), r.ptr.as_ptr());
        // SAFETY: both buffers hold the call's bytes; distinct ids never overlap.
        unsafe { self.all_reduce(s, r, call.count, call.dtype, call.op, call.algo) }
    }

    fn synchronize(&mut self) -> Result<()> {
        // Host calls are synchronous.
        Ok(())
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
