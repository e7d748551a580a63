//! Checks that every pair of ranks can really reach each other's memory: the P2P query for
//! peers on other GPUs, and a cross-process write/read through every mapping.

use super::driver::ck;
use super::{CudaComm, DATA_OFFSET};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use cudarc::driver::{safe as cs, sys};
use std::collections::HashMap;

impl CudaComm {
    /// Writes a rank-specific pattern into our workspace, then reads every peer's through its
    /// mapping: the real cross-process test that P2P queries alone cannot give.
    pub(super) fn cross_process_check(&mut self, boot: &mut Bootstrap) -> Result<()> {
        let rank = self.rank;
        let pattern = |r: usize| -> [u8; 16] {
            let mut p = [0u8; 16];
            for (i, b) in p.iter_mut().enumerate() {
                *b = (0xA5 ^ (r as u8).wrapping_mul(31) ^ (i as u8).wrapping_mul(7)) | 1;
            }
            p
        };
        let probe = self.ws.base(rank) + DATA_OFFSET;
        let mine = pattern(rank);
        // SAFETY: 16 bytes inside our own data area.
        ck(
            unsafe { sys::cuMemcpyHtoD_v2(probe, mine.as_ptr().cast(), 16) },
            rank,
            || "writing the cross-process probe".into(),
        )?;
        // The copy may return before its DMA lands: wait before telling the peers.
        // SAFETY: no arguments.
        ck(unsafe { sys::cuCtxSynchronize() }, rank, || {
            "cuCtxSynchronize".into()
        })?;
        boot.barrier()?;
        for peer in 0..self.world {
            let mut got = [0u8; 16];
            let addr = self.ws.base(peer) + DATA_OFFSET;
            // SAFETY: 16 bytes inside the peer's mapped data area.
            let res = unsafe { sys::cuMemcpyDtoH_v2(got.as_mut_ptr().cast(), addr, 16) };
            ck(res, rank, || format!("reading rank {peer}'s probe")).map_err(|e| {
                Error::PeerAccess {
                    rank,
                    peer,
                    op: "cross-process read",
                    detail: e.to_string(),
                }
            })?;
            if got != pattern(peer) {
                return Err(Error::PeerAccess {
                    rank,
                    peer,
                    op: "cross-process read",
                    detail: format!(
                        "read back {got:02x?} instead of the peer's pattern through the {} mapping",
                        self.ws.mode.name()
                    ),
                });
            }
        }
        boot.barrier()
    }
}

pub(super) fn device_uuid(device: sys::CUdevice, rank: usize) -> Result<Vec<u8>> {
    // SAFETY: a plain C struct filled by the driver.
    let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
    ck(
        unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, device) },
        rank,
        || "cuDeviceGetUuid".into(),
    )?;
    Ok(uuid.bytes.iter().map(|b| *b as u8).collect())
}

/// For every peer on another GPU: that GPU must be visible here and reachable by P2P.
pub(super) fn check_peer_access(
    rank: usize,
    device: sys::CUdevice,
    uuids: &[Vec<u8>],
) -> Result<()> {
    let mine = &uuids[rank];
    let count = cs::CudaContext::device_count().unwrap_or(0);
    let mut visible = HashMap::new();
    for ord in 0..count {
        let mut dev = 0;
        // SAFETY: writes one device handle.
        if unsafe { sys::cuDeviceGet(&mut dev, ord) } == sys::CUresult::CUDA_SUCCESS {
            visible.insert(device_uuid(dev, rank)?, (ord, dev));
        }
    }
    for (peer, uuid) in uuids.iter().enumerate() {
        if peer == rank || uuid == mine {
            continue;
        }
        let Some(&(ord, peer_dev)) = visible.get(uuid) else {
            return Err(Error::PeerAccess {
                rank,
                peer,
                op: "P2P query",
                detail:
                    "the peer's GPU is not visible to this process (CUDA_VISIBLE_DEVICES differs?)"
                        .into(),
            });
        };
        let mut can = 0;
        // SAFETY: writes one int.
        ck(
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, device, peer_dev) },
            rank,
            || "cuDeviceCanAccessPeer".into(),
        )?;
        if can == 0 {
            return Err(Error::PeerAccess {
                rank,
                peer,
                op: "P2P query",
                detail: format!("this GPU cannot access GPU {ord} directly (no P2P path)"),
            });
        }
    }
    Ok(())
}
