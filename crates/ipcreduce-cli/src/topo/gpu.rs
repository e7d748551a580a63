//! What CUDA says about this rank's GPU and its peers: identity (UUID, PCI bus id) and the
//! peer-to-peer attributes of every pair (`cuDeviceGetP2PAttribute`).

use cudarc::driver::sys;
use serde::{Deserialize, Serialize};

/// One rank's GPU, as every rank learns it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    pub rank: usize,
    pub ordinal: usize,
    /// NVML's spelling: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// `dddd:bb:dd.f`, lower case (see [`normalize_bus_id`]).
    pub bus_id: String,
}

/// Peer-to-peer attributes of (this GPU -> a peer's GPU); None where the query failed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct P2p {
    pub access: Option<bool>,
    pub performance_rank: Option<i32>,
    pub native_atomics: Option<bool>,
}

fn ck(r: sys::CUresult, what: &str) -> Result<(), String> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {r:?}"))
    }
}

/// The device handle of `ordinal`.
pub fn device(ordinal: usize) -> Result<sys::CUdevice, String> {
    let mut dev = 0;
    // SAFETY: writes one device handle.
    ck(
        unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) },
        "cuDeviceGet",
    )?;
    Ok(dev)
}

/// This process's view of `ordinal`.
pub fn describe(rank: usize, ordinal: usize) -> Result<Gpu, String> {
    let dev = device(ordinal)?;
    // SAFETY: a plain C struct filled by the driver.
    let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
    ck(
        unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, dev) },
        "cuDeviceGetUuid",
    )?;
    let bytes: Vec<u8> = uuid.bytes.iter().map(|b| *b as u8).collect();
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: the driver writes at most `len` bytes, NUL-terminated.
    ck(
        unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) },
        "cuDeviceGetPCIBusId",
    )?;
    // SAFETY: NUL-terminated by the driver within the buffer.
    let bus = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    Ok(Gpu {
        rank,
        ordinal,
        uuid: nvml_uuid(&bytes),
        bus_id: normalize_bus_id(&bus),
    })
}

/// The ordinal, in this process, of the GPU with `uuid` (None: not visible here, e.g. another
/// `CUDA_VISIBLE_DEVICES`).
pub fn visible_ordinal(uuid: &str) -> Option<usize> {
    let mut count = 0;
    // SAFETY: writes one int.
    if unsafe { sys::cuDeviceGetCount(&mut count) } != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    (0..count as usize).find(|&o| describe(0, o).is_ok_and(|g| g.uuid == uuid))
}

/// P2P attributes from `src` to `dst`.
pub fn p2p(src: sys::CUdevice, dst: sys::CUdevice) -> P2p {
    use sys::CUdevice_P2PAttribute as A;
    let get = |attr: A| {
        let mut v = 0;
        // SAFETY: writes one int.
        let r = unsafe { sys::cuDeviceGetP2PAttribute(&mut v, attr, src, dst) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
    };
    P2p {
        access: get(A::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED).map(|v| v != 0),
        performance_rank: get(A::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK),
        native_atomics: get(A::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED).map(|v| v != 0),
    }
}

/// NVML's UUID text from CUDA's 16 bytes.
pub fn nvml_uuid(b: &[u8]) -> String {
    let hex: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    let h = hex.concat();
    if h.len() != 32 {
        return format!("GPU-{h}");
    }
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// CUDA writes `0000:18:00.0`, NVML `00000000:18:00.0`: both become `0000:18:00.0`.
pub fn normalize_bus_id(s: &str) -> String {
    let s = s.trim().trim_end_matches('\0').to_ascii_lowercase();
    match s.split_once(':') {
        Some((domain, rest)) => match u32::from_str_radix(domain, 16) {
            Ok(d) => format!("{d:04x}:{rest}"),
            Err(_) => s,
        },
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_of_cuda_and_nvml_agree() {
        assert_eq!(normalize_bus_id("0000:18:00.0"), "0000:18:00.0");
        assert_eq!(normalize_bus_id("00000000:18:00.0"), "0000:18:00.0");
        assert_eq!(normalize_bus_id("00000001:AB:00.0\0"), "0001:ab:00.0");
    }

    #[test]
    fn uuids_in_nvml_form() {
        let b: Vec<u8> = (0..16).collect();
        assert_eq!(nvml_uuid(&b), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f");
    }
}
