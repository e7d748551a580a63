//! The link between two GPUs, from NVML (loaded at run time by nvml-wrapper): NVLink (direct
//! or through NVSwitch, with the link count), else the PCIe path (NVML's common ancestor).
//! Without NVML every link is "unknown".

use super::gpu::{normalize_bus_id, Gpu};
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::enum_wrappers::nv_link::IntDeviceType;
use nvml_wrapper::{Device, Nvml};

/// NVML_NVLINK_MAX_LINKS of current drivers (Hopper has 18).
const MAX_LINKS: u32 = 18;

/// NVML, or why it is missing.
pub struct Links {
    nvml: Result<Nvml, String>,
}

impl Links {
    pub fn open() -> Links {
        Links {
            nvml: Nvml::init().map_err(|e| e.to_string()),
        }
    }

    /// Describes the link from `a` to `b` (different GPUs).
    pub fn between(&self, a: &Gpu, b: &Gpu) -> String {
        let nvml = match &self.nvml {
            Ok(n) => n,
            Err(e) => return format!("unknown (NVML: {e})"),
        };
        let dev = |g: &Gpu| {
            nvml.device_by_uuid(g.uuid.as_str())
                .map_err(|e| format!("unknown (NVML, {}: {e})", g.uuid))
        };
        let (da, db) = match (dev(a), dev(b)) {
            (Ok(x), Ok(y)) => (x, y),
            (Err(e), _) | (_, Err(e)) => return e,
        };
        let (direct, switch_a) = nvlinks(&da, &b.bus_id);
        let (_, switch_b) = nvlinks(&db, &a.bus_id);
        if direct > 0 {
            return format!("NVLink x{direct}");
        }
        if switch_a > 0 && switch_b > 0 {
            return format!("NVLink x{switch_a} via NVSwitch");
        }
        match da.topology_common_ancestor(db) {
            Ok(level) => pcie_path(level).into(),
            Err(e) => format!("unknown (NVML topology: {e})"),
        }
    }
}

/// Active NVLinks of `dev`: (to the GPU at `peer_bus`, to NVSwitches).
fn nvlinks(dev: &Device<'_>, peer_bus: &str) -> (u32, u32) {
    let (mut direct, mut switch) = (0, 0);
    for i in 0..MAX_LINKS {
        let link = dev.link_wrapper_for(i);
        if !matches!(link.is_active(), Ok(true)) {
            continue;
        }
        if matches!(link.remote_device_type(i), Ok(IntDeviceType::Switch)) {
            switch += 1;
        } else if link
            .remote_pci_info()
            .is_ok_and(|p| normalize_bus_id(&p.bus_id) == peer_bus)
        {
            direct += 1;
        }
    }
    (direct, switch)
}

/// NVML's common ancestor of two GPUs, in words.
pub fn pcie_path(level: TopologyLevel) -> &'static str {
    match level {
        TopologyLevel::Internal => "PCIe, same board",
        TopologyLevel::Single => "PCIe, same switch",
        TopologyLevel::Multiple => "PCIe, several switches",
        TopologyLevel::HostBridge => "PCIe, through the host bridge",
        TopologyLevel::Node => "PCIe, across host bridges (one NUMA node)",
        TopologyLevel::System => "PCIe, across sockets",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pcie_paths_in_words() {
        assert_eq!(pcie_path(TopologyLevel::Single), "PCIe, same switch");
        assert_eq!(pcie_path(TopologyLevel::System), "PCIe, across sockets");
    }

    #[test]
    fn without_nvml_links_are_unknown() {
        let links = Links {
            nvml: Err("libnvidia-ml.so not found".into()),
        };
        let g = |r| Gpu {
            rank: r,
            ordinal: r,
            uuid: format!("GPU-{r}"),
            bus_id: format!("0000:0{r}:00.0"),
        };
        assert_eq!(
            links.between(&g(0), &g(1)),
            "unknown (NVML: libnvidia-ml.so not found)"
        );
    }
}
