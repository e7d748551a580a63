//! Device and host memory: allocation, zeroing, copies, host registration.

use super::ck;
use crate::error::Result;
use cudarc::driver::sys;

/// Zeroes `bytes` at device address `ptr`.
///
/// # Safety
/// The range must be device memory no kernel uses meanwhile.
pub unsafe fn zero(
    ptr: sys::CUdeviceptr,
    bytes: usize,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    // SAFETY: as the caller vouched.
    ck(unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes) }, rank, what)
}

/// Device memory of `bytes` (at least 1).
pub fn mem_alloc(bytes: usize, rank: usize) -> Result<sys::CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: writes one pointer; a zero-byte request is rounded up to 1.
    ck(
        unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) },
        rank,
        || format!("cuMemAlloc({bytes} bytes)"),
    )?;
    Ok(ptr)
}

/// Frees what [`mem_alloc`] gave; a failure is logged (it runs in Drop).
///
/// # Safety
/// `ptr` came from [`mem_alloc`], is freed once and no work uses it any more.
pub unsafe fn mem_free(ptr: sys::CUdeviceptr) {
    // SAFETY: as the caller vouched.
    let res = unsafe { sys::cuMemFree_v2(ptr) };
    if res != sys::CUresult::CUDA_SUCCESS {
        tracing::warn!("cuMemFree failed: {res:?}");
    }
}

/// Pinned host memory of `bytes`, mapped into the device's address space: the host pointer,
/// and its device address (or the error of asking for it, the memory then still allocated).
pub fn host_alloc_mapped(
    bytes: usize,
    rank: usize,
) -> Result<(*mut std::ffi::c_void, Result<sys::CUdeviceptr>)> {
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
    // SAFETY: allocates `bytes` of pinned memory, writes one pointer.
    ck(
        unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) },
        rank,
        || "cuMemHostAlloc(mapped words)".into(),
    )?;
    let mut device = 0;
    // SAFETY: host is a live mapped allocation.
    let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) };
    Ok((
        host,
        ck(mapped, rank, || "cuMemHostGetDevicePointer".into()).map(|()| device),
    ))
}

/// Frees what [`host_alloc_mapped`] gave; a failure is logged (it runs in Drop).
///
/// # Safety
/// `host` came from [`host_alloc_mapped`], is freed once and no work uses it any more.
pub unsafe fn free_host(host: *mut std::ffi::c_void) {
    // SAFETY: as the caller vouched.
    let res = unsafe { sys::cuMemFreeHost(host) };
    if res != sys::CUresult::CUDA_SUCCESS {
        tracing::warn!("cuMemFreeHost failed: {res:?}");
    }
}

/// Enqueues a copy of `bytes` from device address `src` to `dst` on `stream`.
///
/// # Safety
/// Both ranges must be device memory valid until the copy ran; `stream` a live stream.
pub unsafe fn copy_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    // SAFETY: as the caller vouched.
    ck(
        unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream) },
        rank,
        what,
    )
}

/// Enqueues a copy of `src` (host memory) to device address `dst` on `stream`.
///
/// # Safety
/// `dst` must hold `src.len()` bytes; `src` must outlive the copy (wait for `stream`).
pub unsafe fn copy_to_device_async(
    dst: sys::CUdeviceptr,
    src: &[u8],
    stream: sys::CUstream,
    rank: usize,
) -> Result<()> {
    // SAFETY: as the caller vouched.
    ck(
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream) },
        rank,
        || format!("copying {} bytes to the device", src.len()),
    )
}

/// Enqueues a copy from device address `src` into `dst` (host memory) on `stream`.
///
/// # Safety
/// `src` must hold `dst.len()` bytes; `dst` must outlive the copy (wait for `stream`).
pub unsafe fn copy_from_device_async(
    dst: &mut [u8],
    src: sys::CUdeviceptr,
    stream: sys::CUstream,
    rank: usize,
) -> Result<()> {
    // SAFETY: as the caller vouched.
    ck(
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), stream) },
        rank,
        || format!("copying {} bytes from the device", dst.len()),
    )
}

/// Copies `src` (host memory) to device address `dst`; the copy may return before its DMA
/// lands (synchronize before others read it).
///
/// # Safety
/// `dst` must hold `src.len()` bytes of device memory.
pub unsafe fn copy_to_device(
    dst: sys::CUdeviceptr,
    src: &[u8],
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    // SAFETY: as the caller vouched.
    ck(
        unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) },
        rank,
        what,
    )
}

/// Copies from device address `src` into `dst` (host memory), waiting for the copy.
///
/// # Safety
/// `src` must hold `dst.len()` bytes of device memory mapped here.
pub unsafe fn copy_from_device(
    dst: &mut [u8],
    src: sys::CUdeviceptr,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    // SAFETY: as the caller vouched.
    ck(
        unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()) },
        rank,
        what,
    )
}

/// Registers `len` bytes of host memory at `host` with the current context (mapped into the
/// device's address space) and returns their device address.
///
/// # Safety
/// `host` must be a live, page-aligned mapping of `len` bytes, unregistered with
/// [`host_unregister`] before it is unmapped.
pub unsafe fn host_register(
    host: *mut std::ffi::c_void,
    len: usize,
    rank: usize,
    what: &dyn Fn() -> String,
) -> Result<sys::CUdeviceptr> {
    let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: as the caller vouched.
    ck(
        unsafe { sys::cuMemHostRegister_v2(host, len, flags) },
        rank,
        || format!("cuMemHostRegister of {} ({len} bytes)", what()),
    )?;
    let mut device = 0;
    // SAFETY: `host` is registered with DEVICEMAP just above.
    let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) };
    if let Err(e) = ck(mapped, rank, || {
        format!("cuMemHostGetDevicePointer of {}", what())
    }) {
        // SAFETY: registered above, once.
        unsafe { host_unregister(host) };
        return Err(e);
    }
    Ok(device)
}

/// Unregisters what [`host_register`] registered; a failure is logged (it runs in Drop).
///
/// # Safety
/// `host` was registered by [`host_register`], once, and is still mapped.
pub unsafe fn host_unregister(host: *mut std::ffi::c_void) {
    // SAFETY: as the caller vouched.
    let res = unsafe { sys::cuMemHostUnregister(host) };
    if res != sys::CUresult::CUDA_SUCCESS {
        tracing::warn!("cuMemHostUnregister of a host-staged workspace failed: {res:?}");
    }
}

/// Attributes `attrs` of `ptr` in one `cuPointerGetAttributes` call, each in a zeroed 8-byte
/// slot: the driver writes a 4-byte enum, bool or int, or an 8-byte address or size, at the
/// slot's start (little-endian, so the slot reads the value). For a pointer CUDA does not know
/// it still succeeds and leaves every attribute zero.
pub fn pointer_attributes<const N: usize>(
    ptr: u64,
    mut attrs: [sys::CUpointer_attribute; N],
) -> std::result::Result<[u64; N], sys::CUresult> {
    let mut slots = [0u64; N];
    let mut data: Vec<*mut std::ffi::c_void> =
        slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
    // SAFETY: N attributes, N writable 8-byte slots that outlive the call; `ptr` is only
    // looked up.
    let res = unsafe {
        sys::cuPointerGetAttributes(N as u32, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr)
    };
    if res != sys::CUresult::CUDA_SUCCESS {
        return Err(res);
    }
    Ok(slots)
}

/// The allocation holding `ptr`: (start, bytes). Fails cleanly for pointers the driver does
/// not know.
pub fn address_range(ptr: u64) -> std::result::Result<(u64, usize), sys::CUresult> {
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: writes two values; `ptr` is only looked up.
    let res = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    if res != sys::CUresult::CUDA_SUCCESS {
        return Err(res);
    }
    Ok((base, size))
}

/// A reference to the handle of the `cuMemCreate` allocation mapped at `ptr`, to be given
/// back with [`release`].
pub fn retain_allocation_handle(
    ptr: u64,
) -> std::result::Result<sys::CUmemGenericAllocationHandle, sys::CUresult> {
    let mut handle = 0;
    // SAFETY: writes one handle; `ptr` is only looked up.
    let res =
        unsafe { sys::cuMemRetainAllocationHandle(&mut handle, ptr as *mut std::ffi::c_void) };
    if res != sys::CUresult::CUDA_SUCCESS {
        return Err(res);
    }
    Ok(handle)
}

/// Gives back one reference to an allocation handle.
///
/// # Safety
/// The caller holds that reference (from `cuMemCreate`, an import or
/// [`retain_allocation_handle`]) and gives it back once.
pub unsafe fn release(handle: sys::CUmemGenericAllocationHandle) -> sys::CUresult {
    // SAFETY: as the caller vouched.
    unsafe { sys::cuMemRelease(handle) }
}
