//! Small owners of device and pinned host memory. Drop never panics: a failed free is logged.

use super::driver::ck;
use crate::error::Result;
use cudarc::driver::sys;

/// Plain device memory (cuMemAlloc): test buffers and per-rank private state.
pub struct DeviceAlloc {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
}

impl DeviceAlloc {
    pub fn new(bytes: usize, rank: usize) -> Result<Self> {
        let mut ptr = 0;
        // SAFETY: writes one pointer; a zero-byte request is rounded up to 1.
        ck(
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) },
            rank,
            || format!("cuMemAlloc({bytes} bytes)"),
        )?;
        Ok(DeviceAlloc { ptr, bytes })
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAlloc and is freed once.
        let res = unsafe { sys::cuMemFree_v2(self.ptr) };
        if res != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!("cuMemFree failed: {res:?}");
        }
    }
}

/// Pinned host memory mapped into the device's address space: words that the host and the
/// kernels both read and write (abort flag, error record).
pub struct MappedHostWords {
    host: *mut u32,
    pub device: sys::CUdeviceptr,
    len: usize,
}

// SAFETY: the memory is process-global pinned memory; access goes through volatile reads/writes.
unsafe impl Send for MappedHostWords {}
// SAFETY: as above; each word is read and written whole with volatile accesses.
unsafe impl Sync for MappedHostWords {}

impl MappedHostWords {
    pub fn new(len: usize, rank: usize) -> Result<Self> {
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: allocates len words of pinned memory.
        ck(
            unsafe { sys::cuMemHostAlloc(&mut host, len * 4, flags) },
            rank,
            || "cuMemHostAlloc(mapped words)".into(),
        )?;
        let mut device = 0;
        // SAFETY: host is a live mapped allocation.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) };
        let words = MappedHostWords {
            host: host.cast(),
            device,
            len,
        };
        ck(mapped, rank, || "cuMemHostGetDevicePointer".into())?;
        for i in 0..len {
            words.set(i, 0);
        }
        Ok(words)
    }

    pub fn get(&self, i: usize) -> u32 {
        assert!(i < self.len);
        // SAFETY: in bounds; volatile because the GPU writes it behind the compiler's back.
        unsafe { self.host.add(i).read_volatile() }
    }

    pub fn set(&self, i: usize, v: u32) {
        assert!(i < self.len);
        // SAFETY: in bounds; volatile because the GPU reads it.
        unsafe { self.host.add(i).write_volatile(v) }
    }
}

impl Drop for MappedHostWords {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc, freed once.
        let res = unsafe { sys::cuMemFreeHost(self.host.cast()) };
        if res != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!("cuMemFreeHost failed: {res:?}");
        }
    }
}
