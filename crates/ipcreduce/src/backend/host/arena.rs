//! One rank's shared workspace: a memfd holding a signal area, two data slots and a
//! "symmetric heap", mapped `MAP_SHARED` by every rank of the communicator.
//!
//! ```text
//! offset 0      Control (signal area, 4 KiB): header, abort word, flag lines
//! CONTROL       slot 0  (slot_bytes)   \ double-buffered staging for chunks
//! + slot_bytes  slot 1  (slot_bytes)   /
//! heap_off      heap    (heap_bytes)   zero-copy user buffers (see `heap.rs`)
//! ```
//!
//! Every flag line has exactly one writer (the arena's owner) and is read by the peers, so
//! each sits alone in its own cache line: no false sharing between flags of different purpose.

use super::sync::Signal;
use crate::error::{Error, Result};
use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Cache line size used for padding.
pub(crate) const LINE: usize = 64;
/// Bytes reserved for [`Control`] at the start of every arena.
pub(crate) const CONTROL_BYTES: usize = 4096;
/// Data of a one-shot chunk this small travels inside the ready line itself, so a peer
/// fetches one cache line per call instead of two. (What is left of the line after the
/// stamp: three f32 or six 16-bit elements.)
pub(crate) const INLINE_BYTES: usize = 12;
/// `src_off` value meaning "the data is in the ready line's inline bytes".
pub(crate) const SRC_INLINE: u64 = u64::MAX;

const MAGIC: u64 = u64::from_le_bytes(*b"IPCRHOST");
/// 2: the ready line's stamp carries where the call's input lies (`place`).
const VERSION: u32 = 2;
const PAGE: usize = 4096;

/// Sizes of the areas of an arena; every rank of a communicator must use the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    pub slot_bytes: usize,
    pub heap_bytes: usize,
}

impl Layout {
    /// `workspace_bytes` is split into two slots, each rounded up to whole pages.
    pub fn new(workspace_bytes: usize, heap_bytes: usize) -> Layout {
        let slot = (workspace_bytes / 2).max(PAGE).next_multiple_of(PAGE);
        Layout {
            slot_bytes: slot,
            heap_bytes: heap_bytes.next_multiple_of(PAGE),
        }
    }

    pub fn slot_off(&self, slot: usize) -> usize {
        CONTROL_BYTES + slot * self.slot_bytes
    }

    pub fn heap_off(&self) -> usize {
        CONTROL_BYTES + 2 * self.slot_bytes
    }

    pub fn total(&self) -> usize {
        self.heap_off() + self.heap_bytes
    }
}

/// Immutable facts about an arena, written by its owner before the fd is shared.
#[repr(C, align(64))]
pub(crate) struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    world: AtomicU32,
    rank: AtomicU64,
    slot_bytes: AtomicU64,
    heap_bytes: AtomicU64,
}

/// Ready flag of one slot plus the call stamp and the location of the chunk's data.
/// Written (stamp first, epoch last with release) by the owner; read by peers after
/// they acquired the epoch. One line, so a small call costs one line transfer per peer.
#[repr(C, align(64))]
pub(crate) struct ReadyLine {
    pub sig: Signal,
    /// Sequence number of the all-reduce call (1 = first).
    pub seq: AtomicU64,
    /// Element count of the whole call.
    pub count: AtomicU64,
    /// Offset in the owner's arena of this chunk's input, or [`SRC_INLINE`].
    pub src_off: AtomicU64,
    /// In place or not, and where the call's input lies in the owner's heap (`stamp.rs`).
    pub place: AtomicU64,
    /// dtype | op << 8 | algo << 16 | operation << 24 (codes from `types.rs`, `SgOp`).
    pub codes: AtomicU32,
    /// Data of tiny one-shot calls. Written before the epoch's release store and read after
    /// its acquire load; the protocol never lets the owner rewrite it while a peer reads it.
    pub inline: UnsafeCell<[u8; INLINE_BYTES]>,
}

/// "My reduced shard of this slot's chunk is published at `red_off`" (two-shot).
#[repr(C, align(64))]
pub(crate) struct ReducedLine {
    pub sig: Signal,
    pub red_off: AtomicU64,
}

/// A bare flag in its own line.
#[repr(C, align(64))]
pub(crate) struct SignalLine {
    pub sig: Signal,
}

/// Bytes of reason text an aborting rank leaves for its peers.
const ABORT_TEXT_BYTES: usize = 496;

/// Why the owner gave up: a word (0 while alive) and the reason in words. Written once, so
/// the word stays cached read-only in every peer and checking it on each call costs nothing.
#[repr(C, align(64))]
pub(crate) struct AbortLine {
    word: AtomicU64,
    /// Taken by the first failure, which alone writes the text.
    claimed: AtomicU32,
    text_len: AtomicU32,
    text: UnsafeCell<[u8; ABORT_TEXT_BYTES]>,
}

impl AbortLine {
    /// Publishes `word` (non-zero) and `reason`, unless an earlier failure already did.
    pub fn publish(&self, word: u64, reason: &str) {
        if self.claimed.swap(1, Ordering::AcqRel) != 0 {
            return;
        }
        let mut n = reason.len().min(ABORT_TEXT_BYTES);
        while !reason.is_char_boundary(n) {
            n -= 1;
        }
        // SAFETY: only the claimant writes the text, once, before the word's release store;
        // readers touch it only after acquiring a non-zero word.
        unsafe { std::ptr::copy_nonoverlapping(reason.as_ptr(), self.text.get().cast(), n) };
        self.text_len.store(n as u32, Ordering::Relaxed);
        self.word.store(word, Ordering::Release);
    }

    /// The word, 0 while the owner is alive.
    pub fn word(&self) -> u64 {
        self.word.load(Ordering::Acquire)
    }

    /// The reason text; meaningful once `word()` returned non-zero.
    pub fn text(&self) -> String {
        let n = (self.text_len.load(Ordering::Relaxed) as usize).min(ABORT_TEXT_BYTES);
        // SAFETY: written once before the word was published (see `publish`).
        let bytes = unsafe { std::slice::from_raw_parts(self.text.get().cast::<u8>(), n) };
        String::from_utf8_lossy(bytes).into_owned()
    }
}

/// The signal area at the start of every arena.
#[repr(C)]
pub(crate) struct Control {
    pub header: Header,
    pub abort: AbortLine,
    pub ready: [ReadyLine; 2],
    pub reduced: [ReducedLine; 2],
    /// Epoch of the last chunk of the owner's last finished call (zero-copy end barrier).
    pub done: SignalLine,
    /// Count of barriers the owner entered (`HostComm::barrier`).
    pub barrier: SignalLine,
}

const _: () = assert!(std::mem::size_of::<Control>() <= CONTROL_BYTES);
const _: () = assert!(std::mem::size_of::<ReadyLine>() == LINE);
const _: () = assert!(std::mem::size_of::<ReducedLine>() == LINE);
const _: () = assert!(std::mem::size_of::<AbortLine>() == 8 * LINE);

/// A `MAP_SHARED` mapping of an arena, unmapped on drop.
pub(crate) struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all concurrent access goes through atomics
// (Control) or is ordered by the protocol's release/acquire flags (data areas).
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only hands out raw pointers and atomic references.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the whole of `fd` (its size from fstat) read-write and shared.
    pub fn map(fd: impl AsFd, what: &str) -> Result<Mapping> {
        let st = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&fd.as_fd()))
            .map_err(|e| io(what, e))?;
        let len = usize::try_from(st.st_size).unwrap_or(0);
        let Some(nz) = std::num::NonZeroUsize::new(len) else {
            return Err(Error::io(what, std::io::Error::other("arena has size 0")));
        };
        use nix::sys::mman::{MapFlags, ProtFlags};
        // SAFETY: a fresh mapping chosen by the kernel; it aliases no Rust object.
        let ptr = unsafe {
            nix::sys::mman::mmap(
                None,
                nz,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| io(what, e))?;
        Ok(Mapping {
            base: ptr.cast(),
            len,
        })
    }

    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub fn control(&self) -> &Control {
        // SAFETY: every arena is at least CONTROL_BYTES long (checked in `verify`/`create`),
        // page-aligned, and Control consists of atomics and UnsafeCells only, so shared
        // references to it are sound even though other processes write it concurrently.
        unsafe { &*(self.base.as_ptr() as *const Control) }
    }

    /// Whether `[off, off + bytes)` lies inside the mapping.
    pub fn contains(&self, off: u64, bytes: usize) -> bool {
        usize::try_from(off)
            .ok()
            .and_then(|o| o.checked_add(bytes))
            .is_some_and(|end| end <= self.len)
    }

    /// Pre-faults `[off, off + bytes)` so first calls do not pay page faults. Best effort:
    /// older kernels lack MADV_POPULATE_*, which only costs speed.
    pub fn populate(&self, off: usize, bytes: usize, write: bool) {
        let advice = if write {
            libc::MADV_POPULATE_WRITE
        } else {
            libc::MADV_POPULATE_READ
        };
        if bytes == 0 || off + bytes > self.len {
            return;
        }
        // SAFETY: the range lies inside our mapping; populate advice changes no contents.
        unsafe {
            libc::madvise(self.base.as_ptr().add(off).cast::<c_void>(), bytes, advice);
        }
    }

    /// Checks that a peer's arena was built with the same layout for the same job slot.
    pub fn verify(&self, layout: &Layout, world: usize, rank: usize) -> Result<()> {
        let bad = |d: String| {
            Err(Error::io(
                "mapping a peer's arena",
                std::io::Error::other(d),
            ))
        };
        if self.len != layout.total() {
            return bad(format!(
                "rank {rank}'s arena has {} bytes, expected {} (different workspace or heap size?)",
                self.len,
                layout.total()
            ));
        }
        let h = &self.control().header;
        let got = (
            h.magic.load(Ordering::Acquire),
            h.version.load(Ordering::Relaxed),
            h.world.load(Ordering::Relaxed) as usize,
            h.rank.load(Ordering::Relaxed) as usize,
            h.slot_bytes.load(Ordering::Relaxed) as usize,
            h.heap_bytes.load(Ordering::Relaxed) as usize,
        );
        let want = (
            MAGIC,
            VERSION,
            world,
            rank,
            layout.slot_bytes,
            layout.heap_bytes,
        );
        if got != want {
            return bad(format!(
                "rank {rank}'s arena header (magic, version, world, rank, slot, heap) is \
                 {got:?}, expected {want:?}"
            ));
        }
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own this mapping; nothing borrows it any more (owners of raw pointers
        // into it hold an Arc<Mapping>, so the last one drops it).
        unsafe {
            let _ = nix::sys::mman::munmap(self.base.cast(), self.len);
        }
    }
}

/// Creates this rank's arena: a sealed-size memfd, mapped, header written, control area and
/// slots pre-faulted. Returns the fd (to share with the peers) and our mapping.
pub(crate) fn create(layout: &Layout, world: usize, rank: usize) -> Result<(OwnedFd, Mapping)> {
    let fd = sealed_memfd(c"ipcreduce-host", layout.total())?;
    let map = Mapping::map(&fd, "mapping our arena")?;
    // The heap stays sparse: its pages are only allocated when a user buffer touches them.
    map.populate(0, layout.heap_off(), true);
    let h = &map.control().header;
    h.world.store(world as u32, Ordering::Relaxed);
    h.rank.store(rank as u64, Ordering::Relaxed);
    h.version.store(VERSION, Ordering::Relaxed);
    h.slot_bytes
        .store(layout.slot_bytes as u64, Ordering::Relaxed);
    h.heap_bytes
        .store(layout.heap_bytes as u64, Ordering::Relaxed);
    h.magic.store(MAGIC, Ordering::Release);
    Ok((fd, map))
}

/// A new memfd of `len` bytes (zero-filled) whose size is sealed: peers that map it could
/// otherwise shrink it under our mapping and make us SIGBUS. Used by the host backend's arenas
/// and the cuda backend's host-staged workspaces.
pub(crate) fn sealed_memfd(name: &std::ffi::CStr, len: usize) -> Result<OwnedFd> {
    use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
    let fd = memfd_create(
        name,
        MemFdCreateFlag::MFD_CLOEXEC | MemFdCreateFlag::MFD_ALLOW_SEALING,
    )
    .map_err(|e| io("memfd_create", e))?;
    let len = i64::try_from(len).map_err(|_| io("arena size", nix::errno::Errno::EOVERFLOW))?;
    nix::unistd::ftruncate(&fd, len).map_err(|e| io("ftruncate of the arena", e))?;
    // Peers could otherwise shrink our file under our mapping and make us SIGBUS.
    // SAFETY: plain fcntl on an fd we own.
    let r = unsafe {
        libc::fcntl(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    };
    if r != 0 {
        return Err(Error::io(
            "sealing the arena",
            std::io::Error::last_os_error(),
        ));
    }
    Ok(fd)
}

fn io(what: &str, e: nix::errno::Errno) -> Error {
    Error::io(what.to_string(), std::io::Error::from(e))
}
