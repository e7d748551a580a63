//! Small owners of device and pinned host memory. Drop never panics: a failed free is logged.

use super::driver;
use crate::error::Result;
use cudarc::driver::sys;

/// Plain device memory (cuMemAlloc): test buffers and per-rank private state.
pub struct DeviceAlloc {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
}

impl DeviceAlloc {
    pub fn new(bytes: usize, rank: usize) -> Result<Self> {
        let ptr = driver::mem_alloc(bytes, rank)?;
        Ok(DeviceAlloc { ptr, bytes })
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAlloc and is freed once.
        unsafe { driver::mem_free(self.ptr) }
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
        let (host, mapped) = driver::host_alloc_mapped(len * 4, rank)?;
        // Owned (freed on error too) before the device address is looked at.
        let words = MappedHostWords {
            host: host.cast(),
            device: *mapped.as_ref().unwrap_or(&0),
            len,
        };
        mapped?;
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
        unsafe { driver::free_host(self.host.cast()) }
    }
}
