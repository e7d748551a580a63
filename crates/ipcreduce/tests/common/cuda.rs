//! The GPU tests' driver helpers (tests/gpu.rs, tests/gpu_fused.rs): a checked driver result
//! and a non-blocking stream destroyed on drop.

use cudarc::driver::sys;
use std::ffi::c_void;

/// Fails the test unless the driver call succeeded; `what` names the call.
pub fn ck(res: sys::CUresult, what: &str) {
    assert_eq!(res, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// A non-blocking stream of the current context.
pub struct Stream(pub sys::CUstream);

impl Stream {
    pub fn new() -> Stream {
        let mut s = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: creates one stream, destroyed in Drop.
        ck(
            unsafe { sys::cuStreamCreate(&mut s, flags) },
            "cuStreamCreate",
        );
        Stream(s)
    }
    pub fn ptr(&self) -> *mut c_void {
        self.0.cast()
    }
    pub fn sync(&self) {
        // SAFETY: a live stream.
        ck(
            unsafe { sys::cuStreamSynchronize(self.0) },
            "cuStreamSynchronize",
        );
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: ours, destroyed once.
        unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}
