//! Registered (zero-copy) device buffers: memory every rank maps, so that all-reduces inside it
//! need no staging copy. Exported to torch through `__cuda_array_interface__`; the tensor keeps
//! the buffer object alive, and the buffer keeps its communicator alive.
//!
//! The communicator is held as a plain Python object: this module needs nothing of `comm.rs`
//! (which makes these buffers), so the two stay a one-way dependency.

use crate::errors::to_py;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::{Arc, Mutex};

/// The buffer itself and the token the communicator counts live buffers by; None once freed.
pub type Slot = Option<(ipcreduce::RegisteredBuffer, Arc<()>)>;

/// `bytes` bytes of device memory registered with every rank of a communicator.
#[pyclass(frozen, weakref, module = "ipcreduce._native")]
pub struct RegisteredBuffer {
    pub slot: Mutex<Slot>,
    ptr: u64,
    bytes: usize,
    rank: usize,
    /// The `Communicator` that made it: it stays alive (and mapped) while a tensor over this
    /// buffer exists, and `free` checks by identity that it is the one freeing it.
    owner: Py<PyAny>,
}

impl RegisteredBuffer {
    pub fn new(
        buf: ipcreduce::RegisteredBuffer,
        token: Arc<()>,
        rank: usize,
        owner: Py<PyAny>,
    ) -> Self {
        RegisteredBuffer {
            ptr: buf.ptr(),
            bytes: buf.bytes(),
            slot: Mutex::new(Some((buf, token))),
            rank,
            owner,
        }
    }

    /// Takes the buffer out for freeing; None if it was freed already.
    pub fn take(&self) -> Slot {
        self.slot.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn is_live(&self) -> bool {
        self.slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Whether `comm` is the communicator that made this buffer.
    pub fn owned_by(&self, comm: &Bound<'_, PyAny>) -> bool {
        self.owner.is(comm)
    }
}

#[pymethods]
impl RegisteredBuffer {
    /// Device address in this process.
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }

    #[getter]
    fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether the buffer is still registered (not freed).
    #[getter]
    fn live(&self) -> bool {
        self.is_live()
    }

    /// The CUDA Array Interface (version 3; C-contiguous, so no strides) of the whole buffer as
    /// bytes, for `torch.as_tensor(buf, device=...)`. Work on it is ordered by the caller's
    /// streams.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if !self.is_live() {
            return Err(to_py(ipcreduce::Error::invalid(
                self.rank,
                "__cuda_array_interface__",
                "the registered buffer was freed",
            )));
        }
        let d = PyDict::new(py);
        d.set_item("shape", (self.bytes,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.ptr, false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "RegisteredBuffer(ptr={:#x}, bytes={}, live={})",
            self.ptr,
            self.bytes,
            self.is_live()
        )
    }
}
