//! The symmetric heap: user buffers carved out of the rank's own arena, so peers can read
//! them directly and an all-reduce whose input lies there needs no copy into the workspace.

use super::arena::Mapping;
use crate::element::Element;
use crate::error::{Error, Result};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

/// Allocation granule: whole pages, so buffers never share a cache line or a page.
const GRANULE: usize = 4096;

/// First-fit allocator over the heap area `[start, end)` of the arena (arena offsets).
pub(crate) struct HeapAlloc {
    /// Free ranges `(offset, len)`, sorted by offset, never adjacent (coalesced).
    free: Vec<(usize, usize)>,
}

impl HeapAlloc {
    pub fn new(start: usize, len: usize) -> HeapAlloc {
        HeapAlloc {
            free: if len > 0 { vec![(start, len)] } else { vec![] },
        }
    }

    /// Reserves `bytes` (rounded up to the granule). Deterministic: the same sequence of
    /// calls on every rank yields the same offsets.
    pub fn take(&mut self, bytes: usize) -> Option<(usize, usize)> {
        let len = bytes.max(1).checked_next_multiple_of(GRANULE)?;
        let i = self.free.iter().position(|&(_, l)| l >= len)?;
        let (off, l) = self.free[i];
        if l == len {
            self.free.remove(i);
        } else {
            self.free[i] = (off + len, l - len);
        }
        Some((off, len))
    }

    pub fn give(&mut self, off: usize, len: usize) {
        let i = self.free.partition_point(|&(o, _)| o < off);
        self.free.insert(i, (off, len));
        // Coalesce with the right then the left neighbour.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

/// Bytes in the rank's symmetric heap. Peers read it in place, so an all-reduce whose send
/// buffer lies here skips the copy into the workspace.
///
/// The buffer keeps the arena mapped, so it stays valid even if its communicator is dropped
/// first (it then simply is ordinary memory).
pub struct SymmetricBuffer {
    map: Arc<Mapping>,
    alloc: Arc<Mutex<HeapAlloc>>,
    /// Offset in the arena.
    off: usize,
    bytes: usize,
    reserved: usize,
}

impl SymmetricBuffer {
    pub(crate) fn new(
        map: Arc<Mapping>,
        alloc: Arc<Mutex<HeapAlloc>>,
        bytes: usize,
    ) -> Result<SymmetricBuffer> {
        let got = alloc.lock().unwrap_or_else(|e| e.into_inner()).take(bytes);
        let Some((off, reserved)) = got else {
            return Err(Error::Config(format!(
                "symmetric heap exhausted: cannot allocate {bytes} bytes (raise \
                 IPCREDUCE_HOST_HEAP_MB)"
            )));
        };
        let buf = SymmetricBuffer {
            map,
            alloc,
            off,
            bytes,
            reserved,
        };
        // SAFETY: [off, off + bytes) lies in our mapping and nobody else references it yet.
        unsafe { std::ptr::write_bytes(buf.map.base().add(off), 0, bytes) };
        Ok(buf)
    }

    /// Offset of the buffer in its arena (the same on every rank that allocated alike).
    pub fn offset(&self) -> usize {
        self.off
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    pub fn as_ptr(&self) -> *const u8 {
        // SAFETY: off lies inside the mapping.
        unsafe { self.map.base().add(self.off) }
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: off lies inside the mapping.
        unsafe { self.map.base().add(self.off) }
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the range is ours alone in this process; peers only read it during
        // collectives that borrow this buffer.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.bytes) }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self makes the access exclusive in this process.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), self.bytes) }
    }
}

impl Drop for SymmetricBuffer {
    fn drop(&mut self) {
        self.alloc
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .give(self.off, self.reserved);
    }
}

/// A typed [`SymmetricBuffer`]: `len` elements of `T`, usable as a slice, and all-reduced
/// without copy-in when passed to [`crate::Communicator::all_reduce_host`] (as send buffer)
/// or [`crate::Communicator::all_reduce_host_in_place`].
pub struct HostBuffer<T: Element> {
    buf: SymmetricBuffer,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> HostBuffer<T> {
    pub(crate) fn new(buf: SymmetricBuffer, len: usize) -> HostBuffer<T> {
        debug_assert!(buf.len() >= len * std::mem::size_of::<T>());
        HostBuffer {
            buf,
            len,
            _t: PhantomData,
        }
    }

    /// The untyped buffer.
    pub fn raw(&self) -> &SymmetricBuffer {
        &self.buf
    }
}

impl<T: Element> Deref for HostBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // The buffer holds len elements and is page aligned, so the cast cannot fail.
        bytemuck::cast_slice(&self.buf.as_bytes()[..self.len * std::mem::size_of::<T>()])
    }
}

impl<T: Element> DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        let bytes = self.len * std::mem::size_of::<T>();
        bytemuck::cast_slice_mut(&mut self.buf.as_bytes_mut()[..bytes])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_coalesces() {
        let mut h = HeapAlloc::new(8192, 10 * GRANULE);
        let a = h.take(1).unwrap();
        let b = h.take(GRANULE + 1).unwrap();
        let c = h.take(GRANULE).unwrap();
        assert_eq!((a.0, b.0, c.0), (8192, 8192 + GRANULE, 8192 + 3 * GRANULE));
        assert!(h.take(7 * GRANULE).is_none());
        h.give(b.0, b.1);
        h.give(a.0, a.1);
        assert_eq!(h.take(3 * GRANULE).unwrap().0, 8192);
        h.give(8192, 3 * GRANULE);
        h.give(c.0, c.1);
        assert_eq!(h.free, vec![(8192, 10 * GRANULE)]);
    }
}
