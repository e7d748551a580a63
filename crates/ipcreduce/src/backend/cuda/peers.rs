//! Checks that every pair of ranks can really reach each other's memory: the P2P query for
//! peers on other GPUs, and a cross-process write/read through every mapping.

use super::driver;
use super::PROBE_OFFSET;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use cudarc::driver::{safe as cs, sys};
use std::collections::HashMap;

/// The cross-process test that P2P queries alone cannot give: every rank writes a pattern of
/// its own into its workspace (the LL area, cleared after the test), then reads every rank's through its mapping
/// (`base(rank)`). Collective: every rank passes both barriers whatever it saw; returns the
/// first failure `(peer, why)` this rank saw.
pub(super) fn mapping_test(
    boot: &mut Bootstrap,
    base: impl Fn(usize) -> sys::CUdeviceptr,
    what: &str,
) -> Result<Option<(usize, String)>> {
    let rank = boot.rank();
    let pattern = |r: usize| -> [u8; 16] {
        let mut p = [0u8; 16];
        for (i, b) in p.iter_mut().enumerate() {
            *b = (0xA5 ^ (r as u8).wrapping_mul(31) ^ (i as u8).wrapping_mul(7)) | 1;
        }
        p
    };
    let mine = pattern(rank);
    // SAFETY: 16 bytes inside our own workspace. The copy may return before its DMA lands:
    // synchronize before telling the peers.
    let wrote = unsafe {
        driver::copy_to_device(base(rank) + PROBE_OFFSET, &mine, rank, || {
            "writing the cross-process probe".into()
        })
    }
    .and_then(|_| driver::ctx_synchronize(rank, || "cuCtxSynchronize".into()));
    boot.barrier()?;
    let mut seen = wrote.err().map(|e| (rank, e.to_string()));
    for peer in 0..boot.world() {
        if seen.is_some() {
            break;
        }
        let mut got = [0u8; 16];
        // SAFETY: 16 bytes inside the peer's mapped workspace.
        let res = unsafe {
            driver::copy_from_device(&mut got, base(peer) + PROBE_OFFSET, rank, || {
                format!("reading rank {peer}'s probe through {what}")
            })
        };
        if let Err(e) = res {
            seen = Some((peer, e.to_string()));
        } else if got != pattern(peer) {
            seen = Some((
                peer,
                format!("read back {got:02x?} instead of the peer's pattern through {what}"),
            ));
        }
    }
    // Nobody writes into the probed area again before every rank has read the probes.
    boot.barrier()?;
    Ok(seen)
}

pub(super) use super::driver::device_uuid;

/// The GPUs this process sees, by UUID: (ordinal, device handle).
pub(super) fn visible_devices(rank: usize) -> Result<HashMap<Vec<u8>, (i32, sys::CUdevice)>> {
    let count = cs::CudaContext::device_count().unwrap_or(0);
    let mut visible = HashMap::new();
    for ord in 0..count {
        if let Some(dev) = driver::device_of_ordinal(ord) {
            visible.insert(device_uuid(dev, rank)?, (ord, dev));
        }
    }
    Ok(visible)
}

/// For every peer on another GPU: that GPU must be visible here and reachable by P2P.
pub(super) fn check_peer_access(
    rank: usize,
    device: sys::CUdevice,
    uuids: &[Vec<u8>],
) -> Result<()> {
    let mine = &uuids[rank];
    let visible = visible_devices(rank)?;
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
        if !driver::can_access_peer(device, peer_dev, rank)? {
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
