//! The fused all-reduce + residual add + RMSNorm of raw pointers (`Communicator.
//! all_reduce_add_rms_norm` in comm.rs), as the torch layer calls it: its arguments, and the
//! one check of this layer. The library checks the pointers (null, alignment, aliasing,
//! device) and the call identity (shape, eps, which outputs are written) across the ranks;
//! this layer only refuses pointers of the wrong address space.

use ipcreduce::{AddRmsNorm, BackendKind, DType};
use std::ffi::c_void;

/// The library's name of the operation, in every error of this layer.
pub const OP: &str = "all_reduce_add_rms_norm";

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

impl FusedArgs {
    /// The library's arguments of the call, the addresses made pointers again (they travel as
    /// integers: the call runs without the GIL on another thread, and raw pointers are not
    /// Send).
    pub fn to_library(&self, dtype: DType) -> AddRmsNorm {
        AddRmsNorm {
            input: self.input as *const c_void,
            residual: self.residual as *const c_void,
            weight: self.weight as *const c_void,
            out: self.out as *mut c_void,
            residual_out: self.residual_out as *mut c_void,
            fp8_out: self.fp8_out as *mut c_void,
            fp8_scale: self.fp8_scale as *const c_void,
            tokens: self.tokens,
            hidden: self.hidden,
            dtype,
            eps: self.eps,
        }
    }
}

/// Why tensors on the device (`on_device`) or on the CPU cannot go to a communicator of
/// `backend`, if they cannot: host pointers on the cuda backend, or device pointers on the
/// host backend, would be dereferenced in the wrong address space.
pub fn wrong_address_space(on_device: bool, backend: BackendKind) -> Option<&'static str> {
    match (on_device, backend) {
        (true, BackendKind::Host) => {
            Some("CUDA tensors need the cuda backend (this communicator runs the host one)")
        }
        (false, BackendKind::Cuda) => {
            Some("CPU tensors need the host backend (this communicator runs the cuda one)")
        }
        _ => None,
    }
}
