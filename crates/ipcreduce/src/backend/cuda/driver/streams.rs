//! Events and streams: stream order, completion, capture status.

use super::{ck, driver_error};
use crate::error::Result;
use cudarc::driver::sys;

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

/// The id of the capture `stream` takes part in (unique in the process), or None when it is
/// not capturing. A capture already invalidated still counts: the call fails with it.
///
/// # Safety
/// `stream` is a live stream.
pub unsafe fn stream_capture(stream: sys::CUstream, rank: usize) -> Result<Option<u64>> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    // SAFETY: writes the status and the id; the other outputs are optional (null); the stream
    // as the caller vouched.
    ck(
        unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream,
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        },
        rank,
        || format!("cuStreamGetCaptureInfo on stream {:#x}", stream as usize),
    )?;
    Ok((status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE).then_some(id))
}
