//! Shared workspaces: each rank allocates one, exports it, and maps every peer's.
//!
//! Two ways to share device memory between processes:
//! - `Vmm` (default): `cuMemCreate` with a POSIX fd handle, the fd passed to peers over the
//!   bootstrap socket (SCM_RIGHTS), imported, mapped with `cuMemMap` and opened with
//!   `cuMemSetAccess`. No global names, nothing to leak if a process dies.
//! - `Ipc`: `cuMemAlloc` + `cudaIpcGetMemHandle`-style handles (`cuIpcGetMemHandle` /
//!   `cuIpcOpenMemHandle`), the seed's way, for drivers or setups where the first fails.
//!
//! `Config::sharing` (`IPCREDUCE_SHARE=vmm|ipc`) picks one; by default VMM is tried and IPC
//! used if it fails.

use super::driver;
use crate::bootstrap::Bootstrap;
use crate::config::Sharing;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A mapping of one rank's shared memory into this process (own or a peer's).
pub(super) enum Mapping {
    /// VMM: reserved range + mapped handle.
    Vmm {
        ptr: sys::CUdeviceptr,
        size: usize,
        handle: sys::CUmemGenericAllocationHandle,
    },
    /// cuMemAlloc'd by this process (own workspace in IPC mode).
    Owned { ptr: sys::CUdeviceptr },
    /// Opened from a peer's IPC handle.
    Opened { ptr: sys::CUdeviceptr },
}

impl Mapping {
    pub(super) fn ptr(&self) -> sys::CUdeviceptr {
        match self {
            Mapping::Vmm { ptr, .. } | Mapping::Owned { ptr } | Mapping::Opened { ptr } => *ptr,
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: each arm releases exactly what its constructor acquired, once.
        let res = unsafe {
            match *self {
                Mapping::Vmm { ptr, size, handle } => {
                    let a = driver::unmap(ptr, size);
                    let b = driver::address_free(ptr, size);
                    let c = driver::release(handle);
                    [a, b, c]
                        .into_iter()
                        .find(|r| *r != sys::CUresult::CUDA_SUCCESS)
                        .unwrap_or(sys::CUresult::CUDA_SUCCESS)
                }
                Mapping::Owned { ptr } => driver::ipc_free(ptr),
                Mapping::Opened { ptr } => driver::ipc_close(ptr),
            }
        };
        if res != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!("releasing a workspace mapping failed: {res:?}");
        }
    }
}

/// Every rank's workspace, mapped into this process. Index = rank.
pub struct Workspaces {
    maps: Vec<Mapping>,
    pub size: usize,
    pub mode: Sharing,
}

impl Workspaces {
    /// Device address of `rank`'s workspace in this process.
    pub fn base(&self, rank: usize) -> sys::CUdeviceptr {
        self.maps[rank].ptr()
    }

    /// Collective: allocates this rank's workspace of at least `bytes`, shares it, maps all.
    pub fn create(
        boot: &mut Bootstrap,
        device: sys::CUdevice,
        bytes: usize,
        forced: Option<Sharing>,
    ) -> Result<Workspaces> {
        let rank = boot.rank();
        let modes: &[Sharing] = match forced {
            Some(Sharing::Vmm) => &[Sharing::Vmm],
            Some(Sharing::Ipc) => &[Sharing::Ipc],
            None => &[Sharing::Vmm, Sharing::Ipc],
        };
        let mut last_err = None;
        for &mode in modes {
            // Every rank must pick the same mode: agree on whether the local export worked.
            let local = match mode {
                Sharing::Vmm => export_vmm(device, bytes, rank).map(Local::Vmm),
                Sharing::Ipc => export_ipc(bytes, rank).map(|(m, h)| Local::Ipc((m, h, bytes))),
            };
            let ok = boot.all_gather(&[local.is_ok() as u8])?;
            match local {
                Ok(local) if ok.iter().all(|v| v == &[1]) => {
                    return import_all(boot, device, local, mode);
                }
                Ok(_) => {
                    let peer = ok.iter().position(|v| v != &[1]).unwrap_or(0);
                    last_err = Some(Error::PeerAccess {
                        rank,
                        peer,
                        op: "workspace export",
                        detail: format!("{} sharing failed on that rank", mode.name()),
                    });
                }
                Err(e) => {
                    tracing::info!(rank, "{} workspace export failed: {e}", mode.name());
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| Error::Config("no sharing mode".into())))
    }
}

enum Local {
    Vmm((Mapping, OwnedFd)),
    Ipc((Mapping, sys::CUipcMemHandle, usize)),
}

fn vmm_prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all-zero is its documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop
}

/// Reserves an address range, maps `handle` there and gives `device` read/write access.
fn map_handle(
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
    device: sys::CUdevice,
    rank: usize,
    what: &str,
) -> Result<Mapping> {
    // SAFETY: reserve/map/set-access on a range we own; undone by Mapping's Drop (or here,
    // step by step, when a step fails); `handle` is the caller's reference, ours from here.
    unsafe {
        let ptr =
            match driver::address_reserve(size, rank, || format!("cuMemAddressReserve for {what}"))
            {
                Ok(ptr) => ptr,
                Err(e) => {
                    driver::release(handle);
                    return Err(e);
                }
            };
        if let Err(e) = driver::mem_map(ptr, size, handle, rank, || format!("cuMemMap of {what}")) {
            driver::address_free(ptr, size);
            driver::release(handle);
            return Err(e);
        }
        let mapping = Mapping::Vmm { ptr, size, handle };
        driver::set_access(ptr, size, device, rank, || {
            format!("cuMemSetAccess (peer access) on {what}")
        })?;
        Ok(mapping)
    }
}

/// Creates `bytes` (rounded up to the granularity) of device memory that can be exported as a
/// POSIX fd, maps it here, and returns the mapping and the fd.
pub(super) fn export_vmm(
    device: sys::CUdevice,
    bytes: usize,
    rank: usize,
) -> Result<(Mapping, OwnedFd)> {
    let prop = vmm_prop(device);
    let size =
        bytes.div_ceil(driver::granularity(&prop, rank)?) * driver::granularity(&prop, rank)?;
    // One physical allocation, owned by the Mapping below.
    let handle = driver::mem_create(size, &prop, rank)?;
    let fd = export_fd(handle, rank)?;
    let mapping = map_handle(handle, size, device, rank, "own workspace")?;
    Ok((mapping, fd))
}

fn export_ipc(bytes: usize, rank: usize) -> Result<(Mapping, sys::CUipcMemHandle)> {
    let ptr = driver::ipc_alloc(bytes, rank, || {
        format!("cuMemAlloc({bytes} bytes) for the workspace")
    })?;
    // Owned by the Mapping (freed if the handle cannot be had).
    let mapping = Mapping::Owned { ptr };
    let handle = driver::ipc_handle(ptr, rank)?;
    Ok((mapping, handle))
}

fn import_all(
    boot: &mut Bootstrap,
    device: sys::CUdevice,
    local: Local,
    mode: Sharing,
) -> Result<Workspaces> {
    let rank = boot.rank();
    let world = boot.world();
    let mut maps: Vec<Option<Mapping>> = (0..world).map(|_| None).collect();
    let size;
    match local {
        Local::Vmm((own, fd)) => {
            let Mapping::Vmm { size: s, .. } = own else {
                unreachable!("VMM export yields a VMM mapping")
            };
            size = s;
            let sizes = boot.all_gather(&(size as u64).to_le_bytes())?;
            let fds = boot.all_gather_fds(std::os::fd::AsFd::as_fd(&fd))?;
            maps[rank] = Some(own);
            for (peer, peer_fd) in fds.iter().enumerate() {
                if peer == rank {
                    continue;
                }
                let peer_size = u64::from_le_bytes(sizes[peer][..8].try_into().map_err(|_| {
                    Error::Bootstrap {
                        rank,
                        peer: Some(peer),
                        op: "workspace size exchange",
                        detail: "short message".into(),
                    }
                })?) as usize;
                let m = import_vmm(peer_fd, peer_size, device, rank, peer, "workspace")?;
                maps[peer] = Some(m);
            }
        }
        Local::Ipc((own, handle, bytes)) => {
            size = bytes;
            let raw: [u8; 64] = handle.reserved.map(|c| c as u8);
            let all = boot.all_gather(&raw)?;
            maps[rank] = Some(own);
            for (peer, h) in all.iter().enumerate() {
                if peer == rank {
                    continue;
                }
                let arr: [u8; 64] = h.as_slice().try_into().map_err(|_| Error::Bootstrap {
                    rank,
                    peer: Some(peer),
                    op: "IPC handle exchange",
                    detail: format!("expected 64 bytes, got {}", h.len()),
                })?;
                let handle = sys::CUipcMemHandle {
                    reserved: arr.map(|b| b as std::ffi::c_char),
                };
                // The peer's allocation, closed by Mapping's Drop.
                let ptr = driver::ipc_open(handle, rank, || {
                    format!("cuIpcOpenMemHandle of rank {peer}'s workspace")
                })
                .map_err(|e| peer_access(rank, peer, "open IPC handle", e))?;
                maps[peer] = Some(Mapping::Opened { ptr });
            }
        }
    }
    Ok(Workspaces {
        maps: maps
            .into_iter()
            .map(|m| m.expect("every rank mapped"))
            .collect(),
        size,
        mode,
    })
}

/// Exports `handle` as a POSIX fd (ours to close). On failure the handle is released: the
/// caller's reference to it is gone either way.
pub(super) fn export_fd(handle: sys::CUmemGenericAllocationHandle, rank: usize) -> Result<OwnedFd> {
    let fd = match driver::export_posix_fd(handle, rank) {
        Ok(fd) => fd,
        Err(e) => {
            // SAFETY: drops the caller's reference, as documented.
            unsafe { driver::release(handle) };
            return Err(e);
        }
    };
    // SAFETY: the driver handed us a fresh fd.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Imports a peer's allocation of `size` bytes from its fd and maps it here (`what` names it in
/// errors, e.g. "workspace").
pub(super) fn import_vmm(
    fd: &OwnedFd,
    size: usize,
    device: sys::CUdevice,
    rank: usize,
    peer: usize,
    what: &str,
) -> Result<Mapping> {
    // The peer's allocation, from its fd (the driver dups it).
    let handle = driver::import_posix_fd(fd.as_raw_fd(), rank, || {
        format!("cuMemImportFromShareableHandle of rank {peer}'s {what}")
    })
    .map_err(|e| peer_access(rank, peer, "import", e))?;
    map_handle(handle, size, device, rank, &format!("rank {peer}'s {what}"))
        .map_err(|e| peer_access(rank, peer, "map", e))
}

fn peer_access(rank: usize, peer: usize, op: &'static str, e: Error) -> Error {
    Error::PeerAccess {
        rank,
        peer,
        op,
        detail: e.to_string(),
    }
}
