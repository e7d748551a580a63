//! Checked driver calls: every failure becomes an [`Error::CudaDriver`] that names the rank and
//! what was being done, and keeps the driver's result code. The raw `cudarc::driver::sys` calls of the backend go
//! through [`ck`].

use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::CStr;

/// Turns a `CUresult` into our error, naming the rank and the operation.
pub fn ck(res: sys::CUresult, rank: usize, op: impl FnOnce() -> String) -> Result<()> {
    if res == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(driver_error(rank, op(), res))
}

/// The error for a failed driver call `op` with result `res`.
pub fn driver_error(rank: usize, op: String, res: sys::CUresult) -> Error {
    Error::CudaDriver {
        rank,
        op,
        code: res,
        detail: describe(res),
    }
}

/// Launches `f` (one-dimensional grid and block, no dynamic shared memory) on `stream` with
/// `params`, with programmatic dependent launch when `pdl`: the kernel may then start while
/// the kernel before it on `stream` finishes, so it must wait on the device
/// (`griddepcontrol.wait`) before it reads anything that kernel wrote. Under stream capture the
/// attribute becomes a programmatic edge of the graph.
///
/// # Safety
/// `params` must point to the kernel's parameters as `cuLaunchKernel` takes them, each valid
/// for the launch; the kernel must only touch memory the caller vouches for.
pub unsafe fn launch(
    f: sys::CUfunction,
    grid: u32,
    threads: u32,
    stream: sys::CUstream,
    params: *mut *mut std::ffi::c_void,
    pdl: bool,
) -> sys::CUresult {
    // SAFETY: an all-zero attribute is plain data (id 0, a zeroed value union); both fields
    // that matter are set below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: u32::from(pdl),
    };
    // SAFETY: `config` and `attr` outlive the call; `params` as the caller vouched.
    unsafe { sys::cuLaunchKernelEx(&config, f, params, std::ptr::null_mut()) }
}

/// Our error for one of cudarc's (which keeps the result code too).
pub fn from_cudarc(rank: usize, op: impl Into<String>, e: cudarc::driver::DriverError) -> Error {
    driver_error(rank, op.into(), e.0)
}

/// The driver's name and description of an error code.
pub fn describe(res: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver returns pointers to static strings, or leaves them null.
    unsafe {
        sys::cuGetErrorName(res, &mut name);
        sys::cuGetErrorString(res, &mut text);
        let name = if name.is_null() {
            format!("{res:?}")
        } else {
            CStr::from_ptr(name).to_string_lossy().into_owned()
        };
        if text.is_null() {
            name
        } else {
            format!("{name}: {}", CStr::from_ptr(text).to_string_lossy())
        }
    }
}

/// Whether libcuda can be loaded (cudarc panics on use when it cannot).
pub fn driver_present() -> bool {
    // SAFETY: only probes dlopen with cudarc's candidate names.
    unsafe { sys::is_culib_present() }
}

/// The kernel driver's version (e.g. "580.159.04") and the CUDA version it supports
/// (e.g. "CUDA 13.0"), as far as they can be read.
pub fn driver_version() -> Option<String> {
    let mut v = 0;
    // SAFETY: writes one int.
    let res = unsafe { sys::cuDriverGetVersion(&mut v) };
    let cuda = (res == sys::CUresult::CUDA_SUCCESS)
        .then(|| format!("CUDA {}.{}", v / 1000, (v % 1000) / 10));
    // e.g. "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release ..."
    let kernel = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|t| t.lines().next().and_then(version_token));
    match (kernel, cuda) {
        (Some(k), Some(c)) => Some(format!("{k} ({c})")),
        (k, c) => k.or(c),
    }
}

/// The first token of `line` shaped like a driver version ("580.159.04").
fn version_token(line: &str) -> Option<String> {
    line.split_whitespace()
        .find(|t| {
            let parts: Vec<&str> = t.split('.').collect();
            parts.len() >= 2
                && parts
                    .iter()
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

// Small wrappers of the driver calls the backend makes: each returns our error naming the
// rank and what was being done. Those that write memory or take a caller's handle stay
// `unsafe` (the caller vouches for the pointer or the handle).

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

/// An event for stream ordering only (no timing); destroy it with [`event_destroy`].
pub fn event_create(rank: usize, what: impl FnOnce() -> String) -> Result<sys::CUevent> {
    let mut ev = std::ptr::null_mut();
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: writes one handle, owned by the caller.
    ck(unsafe { sys::cuEventCreate(&mut ev, flags) }, rank, what)?;
    Ok(ev)
}

/// Destroys an event of [`event_create`]; a failure is logged (it runs in Drop).
///
/// # Safety
/// `ev` came from [`event_create`] and is destroyed once.
pub unsafe fn event_destroy(ev: sys::CUevent) {
    // SAFETY: as the caller vouched (a pending record completes on its own).
    let res = unsafe { sys::cuEventDestroy_v2(ev) };
    if res != sys::CUresult::CUDA_SUCCESS {
        tracing::warn!("cuEventDestroy failed: {res:?}");
    }
}

/// Records `ev` on `stream`.
///
/// # Safety
/// `ev` is a live event of ours, `stream` a live stream of its context.
pub unsafe fn event_record(
    ev: sys::CUevent,
    stream: sys::CUstream,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    // SAFETY: as the caller vouched.
    ck(unsafe { sys::cuEventRecord(ev, stream) }, rank, what)
}

/// Makes `stream` wait for `ev`'s last record.
///
/// # Safety
/// As [`event_record`].
pub unsafe fn stream_wait(
    stream: sys::CUstream,
    ev: sys::CUevent,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    // SAFETY: as the caller vouched.
    ck(unsafe { sys::cuStreamWaitEvent(stream, ev, 0) }, rank, what)
}

/// Whether the work before `ev`'s last record is done: Ok(true), Ok(false) while it runs.
///
/// # Safety
/// `ev` is a live event of ours.
pub unsafe fn event_done(
    ev: sys::CUevent,
    rank: usize,
    what: impl FnOnce() -> String,
) -> Result<bool> {
    // SAFETY: as the caller vouched.
    match unsafe { sys::cuEventQuery(ev) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        res => Err(driver_error(rank, what(), res)),
    }
}

/// Whether `stream` is being captured into a graph.
///
/// # Safety
/// `stream` is a live stream (or 0, the legacy default stream).
pub unsafe fn stream_capturing(stream: sys::CUstream, rank: usize) -> Result<bool> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: writes one enum; the stream as the caller vouched.
    ck(
        unsafe { sys::cuStreamIsCapturing(stream, &mut status) },
        rank,
        || format!("cuStreamIsCapturing on stream {:#x}", stream as usize),
    )?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
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

#[cfg(test)]
mod tests {
    use super::version_token;

    #[test]
    fn driver_version_is_found_in_either_format() {
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U16)  Thu";
        let closed = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023";
        assert_eq!(version_token(open).as_deref(), Some("580.159.04"));
        assert_eq!(version_token(closed).as_deref(), Some("535.104.05"));
        assert_eq!(version_token("no version here"), None);
    }
}
