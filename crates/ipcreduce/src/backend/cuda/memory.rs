//! Small owners of device and pinned host memory. Drop never panics: a failed free is logged.

use super::driver::ck;
use crate::error::Result;
use cudarc::driver::{safe as cs, sys};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

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

/// Memory the kernels use, owned by the communicator and kept alive by the CUDA graphs that
/// captured its calls ([`Kept::keep`]). Only the communicator reaches the value (Kept is not
/// Clone); a graph's [`KeepAlive`] only delays the drop.
pub struct Kept<T>(Arc<T>);

/// A share of a [`Kept`] that gives no access: it only keeps the value alive.
pub struct KeepAlive<T>(#[allow(dead_code)] Arc<T>);

// SAFETY: one Kept reaches the value, from the thread that holds it; the KeepAlives never do.
// So the value is never shared between threads, only dropped on whichever thread lets go last,
// which `T: Send` allows.
unsafe impl<T: Send> Send for Kept<T> {}
// SAFETY: as above: a KeepAlive gives no access at all.
unsafe impl<T: Send> Send for KeepAlive<T> {}

impl<T> Kept<T> {
    pub fn new(value: T) -> Kept<T> {
        Kept(Arc::new(value))
    }

    pub fn keep(&self) -> KeepAlive<T> {
        KeepAlive(Arc::clone(&self.0))
    }
}

impl<T> std::ops::Deref for Kept<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Memory to release on a thread of ours, with its context bound: what a CUDA graph held (see
/// streams::hold_in_graph) is handed back from the driver's destructor thread, where no CUDA
/// call (cuMemFree, cuMemUnmap) is allowed.
pub struct Released {
    // Declaration order is drop order: the memory before the context.
    pub held: Box<dyn Send>,
    pub ctx: Arc<cs::CudaContext>,
}

type Queue = (Mutex<Vec<Released>>, Condvar);

/// Queues `r` for the release thread (started the first time). Makes no CUDA call, so a
/// user object's destructor may call it.
pub fn release_later(r: Released) {
    static QUEUE: OnceLock<Arc<Queue>> = OnceLock::new();
    let q = QUEUE.get_or_init(|| {
        let q: Arc<Queue> = Arc::default();
        let mine = q.clone();
        let started = std::thread::Builder::new()
            .name("ipcreduce-release".into())
            .spawn(move || release_loop(&mine));
        if let Err(e) = started {
            // Then what graphs held stays allocated until the process ends.
            tracing::warn!("no release thread: {e}");
        }
        q
    });
    q.0.lock().unwrap_or_else(|e| e.into_inner()).push(r);
    q.1.notify_one();
}

fn release_loop(q: &Queue) {
    loop {
        let batch = {
            let mut v = q.0.lock().unwrap_or_else(|e| e.into_inner());
            while v.is_empty() {
                v = q.1.wait(v).unwrap_or_else(|e| e.into_inner());
            }
            std::mem::take(&mut *v)
        };
        for r in batch {
            if let Err(e) = r.ctx.bind_to_thread() {
                tracing::warn!("releasing what a CUDA graph held: binding the context: {e}");
            }
            drop(r);
        }
    }
}
