//! Plain, 64-byte aligned heap buffers for [`crate::backend::TestBuffers::alloc`]: the honest
//! "user memory" path of the benchmark and the checks (zero-copy buffers live in `heap.rs`).

use crate::backend::BufId;
use crate::error::{Error, Result};
use std::alloc::Layout;
use std::ptr::NonNull;

/// One zeroed, 64-byte aligned allocation.
pub(super) struct AlignedBuf {
    pub ptr: NonNull<u8>,
    layout: Layout,
    pub len: usize,
}

impl AlignedBuf {
    pub fn new(len: usize) -> Option<AlignedBuf> {
        let layout = Layout::from_size_align(len.max(1), 64).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(AlignedBuf { ptr, layout, len })
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The buffers of one communicator, by id.
#[derive(Default)]
pub(super) struct Buffers {
    bufs: Vec<Option<AlignedBuf>>,
}

impl Buffers {
    pub fn alloc(&mut self, rank: usize, bytes: usize) -> Result<BufId> {
        let b = AlignedBuf::new(bytes).ok_or_else(|| {
            Error::invalid(rank, "alloc", format!("cannot allocate {bytes} bytes"))
        })?;
        self.bufs.push(Some(b));
        Ok(self.bufs.len() - 1)
    }

    pub fn free(&mut self, id: BufId) {
        if let Some(b) = self.bufs.get_mut(id) {
            *b = None;
        }
    }

    pub fn get(&self, rank: usize, id: BufId) -> Result<&AlignedBuf> {
        self.bufs
            .get(id)
            .and_then(|b| b.as_ref())
            .ok_or_else(|| Error::invalid(rank, "buffer", format!("no buffer {id}")))
    }

    pub fn write(&mut self, rank: usize, id: BufId, data: &[u8]) -> Result<()> {
        let b = self.get(rank, id)?;
        if data.len() > b.len {
            return Err(Error::invalid(rank, "write", "data larger than the buffer"));
        }
        // SAFETY: the buffer holds at least data.len() bytes and is ours.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.ptr.as_ptr(), data.len()) };
        Ok(())
    }

    pub fn read(&self, rank: usize, id: BufId, out: &mut [u8]) -> Result<()> {
        let b = self.get(rank, id)?;
        if out.len() > b.len {
            return Err(Error::invalid(rank, "read", "read larger than the buffer"));
        }
        // SAFETY: as in write.
        unsafe { std::ptr::copy_nonoverlapping(b.ptr.as_ptr(), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}
