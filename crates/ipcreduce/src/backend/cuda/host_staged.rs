//! Host-staged workspaces: every rank's workspace (signal area, LL area, data slots) lives in a
//! memfd in host memory instead of on its GPU, for GPUs that cannot reach each other's memory
//! (P2P off, VMs, GPUs under different root complexes).
//!
//! Every rank creates one sealed memfd, passes it to the peers over the bootstrap socket
//! (SCM_RIGHTS, as the host backend's arenas), maps every rank's `MAP_SHARED`, and registers each
//! mapping with its GPU (`cuMemHostRegister`, DEVICEMAP | PORTABLE). The device pointers from
//! `cuMemHostGetDevicePointer` take the place of the peer-memory mappings, so the kernels of
//! kernels run unchanged: every store to a "peer workspace" is a PCIe write into
//! host memory and every load a PCIe read, with no peer access between GPUs at all.
//!
//! Why the kernels stay correct here:
//! - Barriers: data stores, `__threadfence_system`, then a `st.release.sys` flag; the reader
//!   polls with `ld.acquire.sys`. System scope covers host memory and every GPU that maps it.
//! - Low-latency one-shot: each 16-byte line is {data.lo, flag, data.hi, flag} and the reader
//!   accepts it only when both flags match, so it needs each aligned 8-byte half {data, flag}
//!   to arrive whole, not the 16 bytes. Aligned 8-byte accesses are not split over PCIe (one
//!   TLP, naturally aligned); NCCL's LL protocol makes the same assumption on its PCIe and
//!   shared-memory transports. `auto` therefore keeps LL on this transport.

use super::driver;
use crate::backend::host::arena::{sealed_memfd, Mapping};
use crate::bootstrap::Bootstrap;
use crate::error::Result;
use cudarc::driver::sys;
use std::os::fd::AsFd;

/// Host page size: `cuMemHostRegister` wants page-aligned ranges (mmap gives the start).
const PAGE: usize = 4096;

/// One rank's memfd, mapped into this process and registered with the current context.
struct Region {
    /// Unregistered before the mapping is unmapped: field order is drop order.
    registered: Registered,
    _map: Mapping,
}

/// A `cuMemHostRegister`ed range, unregistered on drop.
struct Registered {
    host: *mut std::ffi::c_void,
    device: sys::CUdeviceptr,
}

// SAFETY: `host` is the address of a process-wide shared mapping, valid on every thread; it is
// handed to the driver and written from Rust only by `HostWorkspaces::clear` (&self, before any
// kernel runs).
unsafe impl Send for Registered {}

impl Drop for Registered {
    fn drop(&mut self) {
        // SAFETY: `host` was registered by us, once, and is still mapped (the Mapping drops after).
        unsafe { driver::host_unregister(self.host) }
    }
}

/// Every rank's host-staged workspace, mapped and registered in this process. Index = rank.
pub struct HostWorkspaces {
    regions: Vec<Region>,
    pub size: usize,
}

impl HostWorkspaces {
    /// Device address of `rank`'s workspace in this process.
    pub fn base(&self, rank: usize) -> sys::CUdeviceptr {
        self.regions[rank].registered.device
    }

    /// Zeroes `bytes` at the start of this rank's workspace from the host side.
    pub fn clear(&self, rank: usize, bytes: usize) {
        let r = &self.regions[rank];
        assert!(bytes <= self.size);
        // SAFETY: in bounds of the mapping; no kernel runs on this communicator yet and peers
        // touch our workspace only after the start-up barrier that follows.
        unsafe { std::ptr::write_bytes(r.registered.host.cast::<u8>(), 0, bytes) };
    }

    /// Collective: creates this rank's memfd of at least `bytes`, shares it, maps and
    /// registers every rank's. Every rank takes part in every exchange whatever fails locally,
    /// and a local failure is returned as `Err((peer, reason))` (the rank whose workspace could
    /// not be opened) for the caller to agree on with the other ranks.
    pub fn create(
        boot: &mut Bootstrap,
        bytes: usize,
    ) -> Result<std::result::Result<HostWorkspaces, (usize, String)>> {
        let rank = boot.rank();
        let size = bytes.next_multiple_of(PAGE);
        let own = sealed_memfd(c"ipcreduce-cuda-host", size).and_then(|fd| {
            let map = Mapping::map(&fd, "mapping our host-staged workspace")?;
            // Pages allocated now, not on the GPU's first touch through PCIe.
            map.populate(0, size, true);
            Ok((fd, map))
        });
        // The fd exchange needs an fd from every rank: agree first that every rank has one.
        let ok = boot.all_gather(&[own.is_ok() as u8])?;
        let (fd, own_map) = match own {
            Ok(v) if ok.iter().all(|v| v == &[1]) => v,
            Ok(_) => {
                let peer = ok.iter().position(|v| v != &[1]).unwrap_or(rank);
                return Ok(Err((peer, "that rank could not create its memfd".into())));
            }
            Err(e) => return Ok(Err((rank, e.to_string()))),
        };
        let fds = boot.all_gather_fds(fd.as_fd())?;
        let mut own_map = Some(own_map);
        let mut regions = Vec::with_capacity(fds.len());
        for (peer, peer_fd) in fds.into_iter().enumerate() {
            let map = if peer == rank {
                own_map.take().expect("our own mapping is taken once")
            } else {
                match Mapping::map(&peer_fd, "mapping a peer's host-staged workspace") {
                    Ok(m) => m,
                    Err(e) => return Ok(Err((peer, e.to_string()))),
                }
            };
            if !map.contains(0, size) {
                return Ok(Err((
                    peer,
                    format!("its workspace is smaller than {size} bytes"),
                )));
            }
            match register(&map, size, rank, peer) {
                Ok(registered) => regions.push(Region {
                    registered,
                    _map: map,
                }),
                Err(e) => return Ok(Err((peer, e.to_string()))),
            }
        }
        Ok(Ok(HostWorkspaces { regions, size }))
    }
}

/// Registers `map` (its whole length) with the current context and returns its device address.
fn register(map: &Mapping, len: usize, rank: usize, whose: usize) -> Result<Registered> {
    let host = map.base().cast::<std::ffi::c_void>();
    // SAFETY: a live, page-aligned mapping of `len` bytes; unregistered by Registered's Drop.
    let device = unsafe {
        driver::host_register(host, len, rank, &|| {
            format!("rank {whose}'s host-staged workspace")
        })?
    };
    Ok(Registered { host, device })
}
