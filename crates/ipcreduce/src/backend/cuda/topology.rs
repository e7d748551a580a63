//! The links between the ranks' GPUs as the PCIe policy sees them, agreed by every rank.
//!
//! A pair of distinct GPUs with P2P access but without native atomics over the link is taken
//! as PCIe: NVLink carries atomics natively, PCIe P2P (through a switch or the root complex)
//! reports none. CUDA says nothing more precise without NVML (`ipcreduce topo` asks NVML for
//! the link itself). Ranks sharing a GPU are no pair at all. `Config::topology` /
//! `IPCREDUCE_TOPOLOGY` forces the answer and must be the same on every rank.

use super::peers::visible_devices;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::plan::Topology;
use crate::plan::{self, Fabric};
use cudarc::driver::sys;

/// Whether `src` reaches `dst` by P2P over PCIe (see the module's note).
fn pcie_link(src: sys::CUdevice, dst: sys::CUdevice) -> bool {
    use sys::CUdevice_P2PAttribute as A;
    let get = |attr: A| super::driver::p2p_attribute(attr, src, dst);
    get(A::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED) == Some(1)
        && get(A::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED) == Some(0)
}

/// Whether this rank reaches any peer's GPU (a different one) over PCIe.
fn sees_pcie(rank: usize, device: sys::CUdevice, uuids: &[Vec<u8>]) -> Result<bool> {
    let visible = visible_devices(rank)?;
    Ok(uuids.iter().enumerate().any(|(peer, uuid)| {
        peer != rank
            && uuid != &uuids[rank]
            && visible
                .get(uuid)
                .is_some_and(|&(_, dev)| pcie_link(device, dev))
    }))
}

fn code(t: Option<Topology>) -> u8 {
    match t {
        None => 0,
        Some(Topology::Pcie) => 1,
        Some(Topology::Nvlink) => 2,
    }
}

/// The fabric from every rank's report `[forced topology, saw a PCIe pair]`; an error when
/// the ranks' settings differ. Pure, so every rank decides the same.
pub fn decide(reports: &[Vec<u8>], host_staged: bool, forced: Option<Topology>) -> Result<Fabric> {
    let name = |c: Option<&u8>| match c {
        Some(0) => "auto",
        Some(1) => "pcie",
        Some(2) => "nvlink",
        _ => "a malformed report",
    };
    if let Some(rank) = reports
        .iter()
        .position(|r| r.first() != Some(&code(forced)))
    {
        return Err(Error::Config(format!(
            "the topology (Config::topology or IPCREDUCE_TOPOLOGY) differs between ranks: \
             this rank has {}, rank {rank} {}",
            forced.map_or("auto", Topology::name),
            name(reports[rank].first())
        )));
    }
    let any_pcie = reports.iter().any(|r| r.get(1) == Some(&1));
    Ok(plan::fabric(host_staged, forced, any_pcie))
}

/// Collective: the fabric every rank takes, from the transport (`host_staged`), the forced
/// topology and every rank's pairs.
pub fn agree(
    boot: &mut Bootstrap,
    device: sys::CUdevice,
    uuids: &[Vec<u8>],
    host_staged: bool,
    forced: Option<Topology>,
) -> Result<Fabric> {
    let rank = boot.rank();
    // A failed query counts as no PCIe pair (logged): every rank must reach the exchange.
    let pcie = !host_staged
        && forced.is_none()
        && sees_pcie(rank, device, uuids).unwrap_or_else(|e| {
            tracing::warn!(rank, "PCIe classification failed, taken as NVLink: {e}");
            false
        });
    let reports = boot.all_gather(&[code(forced), pcie as u8])?;
    let fabric = decide(&reports, host_staged, forced)?;
    if rank == 0 && fabric != Fabric::Peer {
        tracing::info!(
            "path between GPUs: {} (topology {}, transport {})",
            fabric.describe(),
            forced.map_or("classified", Topology::name),
            if host_staged { "host" } else { "peer" }
        );
    }
    Ok(fabric)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_pcie_pair_takes_the_policy_unless_forced_or_host_staged() {
        let clean = vec![vec![0, 0], vec![0, 0]];
        let one = vec![vec![0, 0], vec![0, 1]];
        assert_eq!(decide(&clean, false, None).unwrap(), Fabric::Peer);
        assert_eq!(decide(&one, false, None).unwrap(), Fabric::PciePeer);
        assert_eq!(decide(&one, true, None).unwrap(), Fabric::HostStaged);
        let forced = vec![vec![1, 0], vec![1, 0]];
        assert_eq!(
            decide(&forced, false, Some(Topology::Pcie)).unwrap(),
            Fabric::PciePeer
        );
        let nv = vec![vec![2, 1], vec![2, 0]];
        assert_eq!(
            decide(&nv, false, Some(Topology::Nvlink)).unwrap(),
            Fabric::Peer
        );
    }

    #[test]
    fn ranks_with_different_topology_settings_all_fail() {
        let reports = vec![vec![1, 0], vec![0, 0]];
        let err = decide(&reports, false, Some(Topology::Pcie))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("IPCREDUCE_TOPOLOGY") && err.contains("rank 1 auto"),
            "{err}"
        );
        let err = decide(&reports, false, None).unwrap_err().to_string();
        assert!(err.contains("rank 0 pcie"), "{err}");
        let err = decide(&[vec![]], false, None).unwrap_err().to_string();
        assert!(err.contains("malformed"), "{err}");
    }
}
