//! Checked driver calls: every failure becomes an [`Error::Cuda`] that names the rank and what
//! was being done. The raw `cudarc::driver::sys` calls of the backend go through [`ck`].

use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::CStr;

/// Turns a `CUresult` into our error, naming the rank and the operation.
pub fn ck(res: sys::CUresult, rank: usize, op: impl FnOnce() -> String) -> Result<()> {
    if res == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(Error::Cuda {
        rank,
        op: op(),
        detail: describe(res),
    })
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
    // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  <date>"
    let kernel = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|t| {
            let line = t.lines().next()?.to_string();
            let after = line.split("Kernel Module").nth(1)?;
            after.split_whitespace().next().map(str::to_string)
        });
    match (kernel, cuda) {
        (Some(k), Some(c)) => Some(format!("{k} ({c})")),
        (k, c) => k.or(c),
    }
}
