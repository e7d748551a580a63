//! Registered (zero-copy) buffers: device memory every rank has mapped from every peer, so the
//! kernels read the peers' inputs and write the peers' outputs where they are, with no staging
//! copy through the workspace.
//!
//! - [`alloc`]: collective; each rank creates `bytes` with `cuMemCreate` (POSIX fd handle),
//!   the fds go to every peer over the bootstrap (SCM_RIGHTS) and each peer maps them once.
//! - [`register`]: collective; the same for memory the caller allocated with `cuMemCreate` and
//!   mapped (its handle is retained with `cuMemRetainAllocationHandle` and exported).
//! - [`Registry`]: the regions of this communicator, looked up by address range on every call
//!   (the last hit is cached). Region `k` is the `k`-th registration on every rank, so the peer
//!   address of `ptr` is the peer's region start plus `ptr`'s offset in ours: ranks must pass
//!   the same offsets into corresponding buffers.
//!
//! Releasing a region drops our mappings; a peer's mapping of our memory keeps the physical
//! memory alive until the peer drops it too, so no rank can ever touch freed memory.

use super::identity::RegionAt;
use super::kernels::MAX_RANKS;
use super::workspace::{export_fd, export_vmm, import_vmm, Mapping};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::cell::Cell;
use std::os::fd::{AsFd, OwnedFd};

/// Our own side of a region.
enum Own {
    /// Created by [`alloc`]: mapped here, released with the region.
    Allocated { _mapping: Mapping },
    /// The caller's memory ([`register`]): only our reference to its handle is released.
    Retained(sys::CUmemGenericAllocationHandle),
}

impl Drop for Own {
    fn drop(&mut self) {
        if let Own::Retained(handle) = *self {
            // SAFETY: releases the reference cuMemRetainAllocationHandle gave us, once.
            let res = unsafe { super::driver::release(handle) };
            if res != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!("releasing a registered buffer's handle failed: {res:?}");
            }
        }
    }
}

/// One registered buffer as every rank sees it.
pub struct Region {
    pub id: u64,
    /// Start and length of the buffer in this process.
    pub base: u64,
    pub bytes: usize,
    /// Where every rank's corresponding buffer starts in this process (own included).
    pub peers: Vec<u64>,
    // Peer mappings before our own memory: dropped first.
    _maps: Vec<Mapping>,
    _own: Own,
}

/// The registered buffers of one communicator.
#[derive(Default)]
pub struct Registry {
    /// Sorted by `base`; never overlapping.
    regions: Vec<Region>,
    last_hit: Cell<usize>,
    /// Changes so far (a buffer registered or freed): what was derived from the regions
    /// before is stale when this moved (allreduce.rs keeps a call's across calls).
    changes: u64,
}

impl Registry {
    /// The region holding `[ptr, ptr + len)` and `ptr`'s offset in it.
    pub fn lookup(&self, ptr: u64, len: usize) -> Option<(&Region, u64)> {
        let i = find(&self.regions, self.last_hit.get(), ptr, len, |r| {
            (r.base, r.bytes)
        })?;
        self.last_hit.set(i);
        let r = &self.regions[i];
        Some((r, ptr - r.base))
    }

    /// Where call identities name `[ptr, ptr + bytes)`: its region and `ptr`'s offset in it.
    pub fn region_at(&self, ptr: u64, bytes: usize) -> Option<RegionAt> {
        let (r, offset) = self.lookup(ptr, bytes.max(1))?;
        Some(RegionAt {
            id: r.id as u32,
            offset,
        })
    }

    /// Every rank's send and recv as mapped here (of `world` ranks), when both lie in
    /// registered buffers.
    pub fn peers_of(
        &self,
        send: u64,
        recv: u64,
        bytes: usize,
        world: usize,
    ) -> Option<([u64; MAX_RANKS], [u64; MAX_RANKS])> {
        let (rs, so) = self.lookup(send, bytes)?;
        let (rr, ro) = self.lookup(recv, bytes)?;
        let (mut s, mut r) = ([0u64; MAX_RANKS], [0u64; MAX_RANKS]);
        for p in 0..world {
            s[p] = rs.peers[p] + so;
            r[p] = rr.peers[p] + ro;
        }
        Some((s, r))
    }

    pub fn insert(&mut self, region: Region, rank: usize) -> Result<()> {
        let end = region.base + region.bytes as u64;
        if let Some(other) = self
            .regions
            .iter()
            .find(|r| region.base < r.base + r.bytes as u64 && r.base < end)
        {
            return Err(Error::invalid(
                rank,
                "register",
                format!(
                    "[{:#x}, {end:#x}) overlaps registered buffer #{} at {:#x}",
                    region.base, other.id, other.base
                ),
            ));
        }
        let at = self.regions.partition_point(|r| r.base < region.base);
        self.regions.insert(at, region);
        self.changes += 1;
        Ok(())
    }

    pub fn remove(&mut self, id: u64) -> Option<Region> {
        let i = self.regions.iter().position(|r| r.id == id)?;
        self.last_hit.set(0);
        self.changes += 1;
        Some(self.regions.remove(i))
    }

    /// How many times the regions changed: equal counts, equal regions.
    pub fn changes(&self) -> u64 {
        self.changes
    }
}

/// Index of the range (by `span`: start, length; sorted, disjoint) holding `[ptr, ptr + len)`;
/// `hint` (the last hit) is tried first.
pub(super) fn find<T>(
    items: &[T],
    hint: usize,
    ptr: u64,
    len: usize,
    span: impl Fn(&T) -> (u64, usize),
) -> Option<usize> {
    let end = ptr.checked_add(len as u64)?;
    let inside = |t: &T| {
        let (base, bytes) = span(t);
        ptr >= base && end <= base + bytes as u64
    };
    if items.get(hint).is_some_and(inside) {
        return Some(hint);
    }
    let i = items.partition_point(|t| span(t).0 <= ptr).checked_sub(1)?;
    inside(&items[i]).then_some(i)
}

/// Collective: `bytes` of new device memory on every rank, mapped by every peer.
pub fn alloc(boot: &mut Bootstrap, device: sys::CUdevice, bytes: usize, id: u64) -> Result<Region> {
    let rank = boot.rank();
    same_on_every_rank(boot, "alloc", bytes as u64, "size")?;
    let local = export_vmm(device, bytes, rank);
    let (own, fd) = agree(boot, "alloc", local)?;
    let (base, size) = match own {
        Mapping::Vmm { ptr, size, .. } => (ptr, size),
        _ => unreachable!("export_vmm maps with cuMemMap"),
    };
    let (peers, maps) = exchange(boot, device, fd, base, size, 0, "registered buffer")?;
    Ok(Region {
        id,
        base,
        bytes,
        peers,
        _maps: maps,
        _own: Own::Allocated { _mapping: own },
    })
}

/// Collective: `[ptr, ptr + bytes)`, inside memory the caller allocated with `cuMemCreate`
/// (POSIX fd handle type) and mapped, made visible to every peer.
pub fn register(
    boot: &mut Bootstrap,
    device: sys::CUdevice,
    ptr: u64,
    bytes: usize,
    id: u64,
) -> Result<Region> {
    let rank = boot.rank();
    same_on_every_rank(boot, "register", bytes as u64, "size")?;
    let local = export_callers(ptr, bytes, rank);
    // (Our reference to the handle is released if any rank failed.)
    let (own, fd, mapped_base, mapped_size) = agree(boot, "register", local)?;
    let (peers, maps) = exchange(
        boot,
        device,
        fd,
        mapped_base,
        mapped_size,
        ptr - mapped_base,
        "registered buffer",
    )?;
    Ok(Region {
        id,
        base: ptr,
        bytes,
        peers,
        _maps: maps,
        _own: own,
    })
}

const HOW_TO_ALLOCATE: &str = "register() takes memory from cuMemCreate with \
     requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, mapped with cuMemMap; \
     cudaMalloc/cuMemAlloc/pool memory cannot be shared this way: use Communicator::alloc";

/// Our side of [`register`]: the allocation holding `ptr`, its retained handle exported as an
/// fd, and where it is mapped here.
fn export_callers(ptr: u64, bytes: usize, rank: usize) -> Result<(Own, OwnedFd, u64, usize)> {
    let refuse =
        |what: String| Error::invalid(rank, "register", format!("{what}: {HOW_TO_ALLOCATE}"));
    let (base, size) = super::driver::address_range(ptr).map_err(|res| {
        refuse(format!(
            "{ptr:#x} is not device memory ({})",
            super::driver::describe(res)
        ))
    })?;
    if ptr + bytes as u64 > base + size as u64 {
        return Err(refuse(format!(
            "[{ptr:#x}, +{bytes}) runs past its allocation [{base:#x}, +{size})"
        )));
    }
    // A reference to the handle of the allocation mapped at ptr: given back by Own's Drop, or
    // by export_fd when the export fails.
    let handle = super::driver::retain_allocation_handle(ptr).map_err(|res| {
        refuse(format!(
            "{ptr:#x} was not allocated with cuMemCreate ({})",
            super::driver::describe(res)
        ))
    })?;
    let fd = export_fd(handle, rank).map_err(|e| {
        refuse(format!(
            "its allocation cannot be exported as a POSIX fd ({e})"
        ))
    })?;
    Ok((Own::Retained(handle), fd, base, size))
}

/// Fails on every rank if `value` differs between ranks (naming the first that differs).
fn same_on_every_rank(boot: &mut Bootstrap, op: &str, value: u64, what: &str) -> Result<()> {
    let all = boot.all_gather(&value.to_le_bytes())?;
    if let Some(peer) = all.iter().position(|v| v[..] != value.to_le_bytes()[..]) {
        return Err(Error::Mismatch {
            rank: boot.rank(),
            peer,
            op: op.into(),
            seq: 0,
            detail: format!(
                "{what} {value} here, {} there (every rank must call with the same size, in the same order)",
                le_u64(&all[peer]).map_or("?".into(), |v| v.to_string())
            ),
        });
    }
    Ok(())
}

fn le_u64(b: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(..8)?.try_into().ok()?))
}

/// Every rank learns whether every rank's local step worked, so they fail together.
fn agree<T>(boot: &mut Bootstrap, op: &str, local: Result<T>) -> Result<T> {
    let all = boot.all_gather(&[local.is_ok() as u8])?;
    match local {
        Err(e) => Err(e),
        Ok(v) => match all.iter().position(|x| x[..] != [1]) {
            None => Ok(v),
            Some(peer) => Err(Error::PeerAccess {
                rank: boot.rank(),
                peer,
                op: "registered buffer",
                detail: format!("{op} failed on that rank"),
            }),
        },
    }
}

/// Sends our fd (of an allocation of `size` bytes mapped here at `mapped`, the buffer at
/// `offset` in it) to every peer and maps theirs. Returns every rank's buffer start as seen
/// here, and the mappings.
fn exchange(
    boot: &mut Bootstrap,
    device: sys::CUdevice,
    fd: OwnedFd,
    mapped: u64,
    size: usize,
    offset: u64,
    what: &str,
) -> Result<(Vec<u64>, Vec<Mapping>)> {
    let rank = boot.rank();
    let mut mine = (size as u64).to_le_bytes().to_vec();
    mine.extend_from_slice(&offset.to_le_bytes());
    let info = boot.all_gather(&mine)?;
    let fds = boot.all_gather_fds(fd.as_fd())?;
    let mut peers = vec![0u64; boot.world()];
    let mut maps = Vec::new();
    let mut result = Ok(());
    for (peer, peer_fd) in fds.iter().enumerate() {
        if peer == rank {
            peers[peer] = mapped + offset;
            continue;
        }
        let (Some(peer_size), Some(peer_off)) =
            (le_u64(&info[peer]), info[peer].get(8..).and_then(le_u64))
        else {
            result = Err(Error::Bootstrap {
                rank,
                peer: Some(peer),
                op: "registered buffer exchange",
                detail: "short message".into(),
            });
            break;
        };
        match import_vmm(peer_fd, peer_size as usize, device, rank, peer, what) {
            Ok(m) => {
                peers[peer] = m.ptr() + peer_off;
                maps.push(m);
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    // Fail together: a rank that could not map a peer must not leave the others believing the
    // buffer is usable.
    agree(boot, "mapping a peer's buffer", result)?;
    Ok((peers, maps))
}

#[cfg(test)]
mod tests {
    use super::find;

    #[test]
    fn lookup_finds_the_range_holding_the_whole_span() {
        let r: [(u64, usize); 3] = [(0x1000, 0x100), (0x2000, 0x1000), (0x8000, 0x10)];
        let span = |t: &(u64, usize)| *t;
        assert_eq!(find(&r, 0, 0x1000, 0x100, span), Some(0));
        assert_eq!(find(&r, 0, 0x1010, 0x10, span), Some(0));
        assert_eq!(find(&r, 0, 0x10f0, 0x20, span), None, "runs past the end");
        assert_eq!(find(&r, 0, 0x2800, 0x800, span), Some(1));
        assert_eq!(find(&r, 2, 0x2800, 0x801, span), None);
        assert_eq!(find(&r, 1, 0x8008, 8, span), Some(2));
        assert_eq!(find(&r, 0, 0x0fff, 1, span), None, "before the first");
        assert_eq!(find(&r, 0, 0x1800, 1, span), None, "between two");
        assert_eq!(
            find(&r, 7, 0x9000, 1, span),
            None,
            "after the last; bad hint"
        );
        assert_eq!(find(&r, 0, u64::MAX - 1, 8, span), None, "overflow");
        assert_eq!(find::<(u64, usize)>(&[], 0, 0x1000, 1, span), None);
    }
}
