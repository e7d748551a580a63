//! The fused all-reduce + residual add + RMSNorm on the cuda backend (numerics: [`crate::fused`]).

use super::CudaComm;
use crate::error::{Error, Result};
use crate::fused::{self, AddRmsNorm};
use crate::types::Algorithm;
use std::ffi::c_void;

/// Enqueues one fused call on `stream`.
///
/// # Safety
/// As [`crate::Communicator::all_reduce_add_rms_norm_raw`].
pub(super) unsafe fn run(
    c: &mut CudaComm,
    args: &AddRmsNorm,
    algo: Algorithm,
    stream: *mut c_void,
) -> Result<()> {
    let _ = (args, algo, stream);
    Err(Error::invalid(
        c.rank,
        fused::NAME,
        "not available on the cuda backend yet",
    ))
}
