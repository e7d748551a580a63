//! The fused all-reduce + residual add + RMSNorm of raw pointers (`Communicator.
//! all_reduce_add_rms_norm`), as the torch layer calls it. The library checks the pointers
//! (null, alignment, aliasing, device) and the call identity (shape, eps, which outputs are
//! written) across the ranks; this layer only refuses pointers of the wrong address space.

use crate::comm::Communicator;
use crate::errors::InvalidArgumentError;
use ipcreduce::{AddRmsNorm, Algorithm, BackendKind, DType};
use pyo3::prelude::*;
use std::ffi::c_void;

/// The library's name of the operation, in every error of this layer.
const OP: &str = "all_reduce_add_rms_norm";

/// The tensors of one fused call: addresses (0 = none) and the shape.
pub struct FusedArgs {
    pub input: usize,
    pub residual: usize,
    pub weight: usize,
    pub out: usize,
    pub residual_out: usize,
    pub fp8_out: usize,
    pub fp8_scale: usize,
    pub tokens: usize,
    pub hidden: usize,
    pub eps: f32,
}

/// Parses a Python string argument with the library's parser; errors are invalid arguments.
fn parse<T: std::str::FromStr<Err = String>>(what: &str, s: &str) -> PyResult<T> {
    s.parse()
        .map_err(|e| InvalidArgumentError::new_err(format!("{what}: {e}")))
}

/// See `Communicator.all_reduce_add_rms_norm`.
///
/// # Safety
/// Every non-zero address is valid for its tensor's size (`tokens * hidden` elements of
/// `dtype`; the weight `hidden`; fp8_out `tokens * hidden` bytes; the scale one f32) in the
/// backend's address space until the call has completed (on `stream` for cuda).
#[allow(clippy::too_many_arguments)]
pub unsafe fn all_reduce_add_rms_norm(
    comm: &Communicator,
    py: Python<'_>,
    a: FusedArgs,
    dtype: &str,
    on_device: bool,
    algo: &str,
    stream: usize,
) -> PyResult<()> {
    let dtype = parse::<DType>("dtype", dtype)?;
    let algo = parse::<Algorithm>("algo", algo)?;
    // Host pointers on the cuda backend, or device pointers on the host backend, would be
    // dereferenced in the wrong address space: refuse them here.
    match (on_device, comm.backend_kind()) {
        (true, BackendKind::Host) => {
            return Err(comm.invalid(
                OP,
                "CUDA tensors need the cuda backend (this communicator runs the host one)",
            ))
        }
        (false, BackendKind::Cuda) => {
            return Err(comm.invalid(
                OP,
                "CPU tensors need the host backend (this communicator runs the cuda one)",
            ))
        }
        _ => {}
    }
    // Addresses travel as integers: the closure below runs without the GIL on another
    // thread's terms, and raw pointers are not Send.
    comm.with(py, OP, move |c| {
        let args = AddRmsNorm {
            input: a.input as *const c_void,
            residual: a.residual as *const c_void,
            weight: a.weight as *const c_void,
            out: a.out as *mut c_void,
            residual_out: a.residual_out as *mut c_void,
            fp8_out: a.fp8_out as *mut c_void,
            fp8_scale: a.fp8_scale as *const c_void,
            tokens: a.tokens,
            hidden: a.hidden,
            dtype,
            eps: a.eps,
        };
        // SAFETY: the caller's contract above; the library checks null, alignment, aliasing
        // and (cuda) that every pointer is device memory of its GPU.
        unsafe { c.all_reduce_add_rms_norm_raw(&args, algo, stream as *mut c_void) }
    })
}
