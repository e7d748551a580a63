//! Registered (zero-copy) buffers as the communicator keeps them: ids that stay equal on every
//! rank, the checks before a collective registration, and freeing (see registry.rs for the
//! regions themselves).

use super::{registry, CudaComm};
use crate::backend::RegisteredBuffer;
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};

impl CudaComm {
    /// `alloc_registered` and `register`: checks, then `make` shares the region (collective)
    /// under the next id, which is used up only if that succeeded (ids stay equal on every
    /// rank), and the registry takes it.
    pub(super) fn add_region(
        &mut self,
        op: &'static str,
        bytes: usize,
        make: impl FnOnce(u64) -> Result<registry::Region>,
    ) -> Result<RegisteredBuffer> {
        self.bind()?;
        self.require_peer_memory(op, bytes)?;
        let id = self.next_region;
        let region = make(id)?;
        self.next_region += 1;
        let buf = RegisteredBuffer::new(region.base, region.bytes, id);
        self.registry.insert(region, self.rank)?;
        Ok(buf)
    }

    /// Frees registered `buf` among the ranks of `boot` (the node's).
    pub(super) fn free_here(&mut self, boot: &mut Bootstrap, buf: RegisteredBuffer) -> Result<()> {
        // Our work on every stream that may touch it is done (bounded), then every peer's.
        self.wait_all("free")?;
        boot.barrier()?;
        self.remove_region(buf.id()).ok_or_else(|| {
            Error::invalid(
                self.rank,
                "free",
                format!("buffer {:#x} is not registered here", buf.ptr()),
            )
        })
    }

    /// Unregisters region `id` (its memory is released with it) and forgets what was known
    /// about its addresses, which may next hold anything. None if it was not registered.
    pub(super) fn remove_region(&mut self, id: u64) -> Option<()> {
        let region = self.registry.remove(id)?;
        self.pointers.forget(region.base, region.bytes as u64);
        Some(())
    }

    /// Registered buffers are read and written by the peers' kernels: they need the peer
    /// transport (every rank takes the same transport, so all refuse together).
    fn require_peer_memory(&self, op: &'static str, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Err(Error::invalid(self.rank, op, "zero bytes"));
        }
        if self.ws.sharing().is_none() {
            return Err(Error::invalid(
                self.rank,
                op,
                "registered buffers need peer memory, and this communicator stages through \
                 host memory (IPCREDUCE_TRANSPORT=host, or peer access failed at start)",
            ));
        }
        Ok(())
    }
}
