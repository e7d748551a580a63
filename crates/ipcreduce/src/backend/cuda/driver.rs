//! Checked driver calls: every failure becomes an [`Error::CudaDriver`] that names the rank and
//! what was being done, and keeps the driver's result code. The raw `cudarc::driver::sys` calls of the backend go
//! through [`ck`], most of them in the small wrappers of
//! [`device`], [`memory`], [`streams`] and [`vmm`]: each returns our error naming the rank and what was
//! being done; those that write memory or take a caller's handle stay `unsafe` (the caller
//! vouches for the pointer or the handle).

mod device;
mod memory;
mod streams;
mod vmm;

pub use device::*;
pub use memory::*;
pub use streams::*;
pub use vmm::*;

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
