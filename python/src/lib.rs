//! `ipcreduce._native`: the Python extension over the ipcreduce library. The pure-Python
//! package (`ipcreduce/__init__.py`, `ipcreduce/torch.py`) builds the user-facing API on it.
//!
//! | module | what is there |
//! |---|---|
//! | `comm.rs` | the `Communicator` class: init, all-reduce of buffers and raw pointers |
//! | `fused.rs` | the fused all-reduce + residual add + RMSNorm of raw pointers |
//! | `registered.rs` | registered (zero-copy) device buffers, exported to torch |
//! | `hostbuf.rs` | reading numpy arrays and other buffer-protocol objects |
//! | `errors.rs` | the exception classes and the mapping from library errors |

mod comm;
mod errors;
mod fused;
mod hostbuf;
mod registered;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<comm::Communicator>()?;
    m.add_class::<registered::RegisteredBuffer>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
