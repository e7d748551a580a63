//! Contexts and devices: the current context's device, devices by ordinal, P2P
//! attributes and access, UUIDs.

use super::ck;
use crate::error::Result;
use cudarc::driver::sys;

/// The device of the CUDA context current on this thread, None when none is.
pub fn current_context_device(rank: usize) -> Result<Option<sys::CUdevice>> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one handle (null when no context is current).
    ck(unsafe { sys::cuCtxGetCurrent(&mut ctx) }, rank, || {
        "cuCtxGetCurrent".into()
    })?;
    if ctx.is_null() {
        return Ok(None);
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes one device handle of the current context.
    ck(unsafe { sys::cuCtxGetDevice(&mut dev) }, rank, || {
        "cuCtxGetDevice".into()
    })?;
    Ok(Some(dev))
}

/// The device of ordinal `ordinal`, None if the driver has none.
pub fn device_of_ordinal(ordinal: i32) -> Option<sys::CUdevice> {
    let mut d: sys::CUdevice = 0;
    // SAFETY: writes one device handle.
    (unsafe { sys::cuDeviceGet(&mut d, ordinal) } == sys::CUresult::CUDA_SUCCESS).then_some(d)
}

/// Waits for all work of the current context.
pub fn ctx_synchronize(rank: usize, what: impl FnOnce() -> String) -> Result<()> {
    // SAFETY: no arguments; waits for the current context.
    ck(unsafe { sys::cuCtxSynchronize() }, rank, what)
}

/// One P2P attribute of the pair (`src`, `dst`), None where the driver does not answer.
pub fn p2p_attribute(
    attr: sys::CUdevice_P2PAttribute,
    src: sys::CUdevice,
    dst: sys::CUdevice,
) -> Option<i32> {
    let mut v = 0;
    // SAFETY: writes one int.
    let r = unsafe { sys::cuDeviceGetP2PAttribute(&mut v, attr, src, dst) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
}

/// The UUID of `device`, as bytes.
pub fn device_uuid(device: sys::CUdevice, rank: usize) -> Result<Vec<u8>> {
    // SAFETY: a plain C struct filled by the driver.
    let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
    // SAFETY: writes one struct.
    ck(
        unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, device) },
        rank,
        || "cuDeviceGetUuid".into(),
    )?;
    Ok(uuid.bytes.iter().map(|b| *b as u8).collect())
}

/// Whether `device` can map `peer`'s memory (the driver's P2P query).
pub fn can_access_peer(device: sys::CUdevice, peer: sys::CUdevice, rank: usize) -> Result<bool> {
    let mut can = 0;
    // SAFETY: writes one int.
    ck(
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, device, peer) },
        rank,
        || "cuDeviceCanAccessPeer".into(),
    )?;
    Ok(can != 0)
}
