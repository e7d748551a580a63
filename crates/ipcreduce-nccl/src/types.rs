//! NCCL 2.28's C types (nccl.h, nccl_device/core.h), as they cross the ABI.

use std::ffi::{c_char, c_int, c_void};

/// `ncclResult_t`.
pub type NcclResult = c_int;
pub const SUCCESS: NcclResult = 0;
pub const UNHANDLED_CUDA_ERROR: NcclResult = 1;
pub const SYSTEM_ERROR: NcclResult = 2;
pub const INTERNAL_ERROR: NcclResult = 3;
pub const INVALID_ARGUMENT: NcclResult = 4;
pub const INVALID_USAGE: NcclResult = 5;
pub const REMOTE_ERROR: NcclResult = 6;
pub const IN_PROGRESS: NcclResult = 7;

/// `ncclComm_t`, `ncclWindow_t`, `cudaStream_t`: opaque pointers.
pub type Comm = *mut c_void;
pub type Window = *mut c_void;
pub type Stream = *mut c_void;

/// `NCCL_WIN_COLL_SYMMETRIC`: a window whose collectives pass the same offset on every rank.
pub const WIN_COLL_SYMMETRIC: c_int = 0x01;

/// `ncclDataType_t`, `ncclRedOp_t`, `ncclScalarResidence_t`: C enums, `int` wide.
pub type DataType = c_int;
pub type RedOp = c_int;
pub type Residence = c_int;

pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`, passed by value (128 bytes, in memory on x86-64).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// `ncclTeam_t`, passed and returned by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Team {
    pub n_ranks: c_int,
    pub rank: c_int,
    pub stride: c_int,
}

/// The head of `ncclConfig_t` (every version starts so): only `blocking` is read here.
#[repr(C)]
pub struct ConfigHead {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
}

/// Whether a communicator made with `config` is blocking (NCCL's default when unset).
///
/// # Safety
/// `config` is null or points to an `ncclConfig_t` the caller initialised.
pub unsafe fn is_blocking(config: *const c_void) -> bool {
    if config.is_null() {
        return true;
    }
    // SAFETY: the caller's config starts with this head (NCCL_CONFIG_INITIALIZER).
    let head = unsafe { &*(config as *const ConfigHead) };
    head.blocking != 0
}

/// `ncclDataType_t` values.
pub mod dtype {
    use super::DataType;
    pub const FLOAT16: DataType = 6;
    pub const FLOAT32: DataType = 7;
    pub const BFLOAT16: DataType = 9;
}

/// `ncclRedOp_t` values.
pub mod op {
    use super::RedOp;
    pub const SUM: RedOp = 0;
    pub const MAX: RedOp = 2;
    pub const MIN: RedOp = 3;
    pub const AVG: RedOp = 4;
}

/// The element types ipcreduce reduces; others are NCCL's alone.
pub fn to_dtype(d: DataType) -> Option<ipcreduce::DType> {
    match d {
        dtype::FLOAT32 => Some(ipcreduce::DType::F32),
        dtype::FLOAT16 => Some(ipcreduce::DType::F16),
        dtype::BFLOAT16 => Some(ipcreduce::DType::Bf16),
        _ => None,
    }
}

/// The operators ipcreduce has (avg is a sum, then a division: see `coll`); prod and
/// premul-sum stay NCCL's.
pub fn to_op(o: RedOp) -> Option<ipcreduce::ReduceOp> {
    match o {
        op::SUM => Some(ipcreduce::ReduceOp::Sum),
        op::MAX => Some(ipcreduce::ReduceOp::Max),
        op::MIN => Some(ipcreduce::ReduceOp::Min),
        _ => None,
    }
}

/// `ncclGetErrorString`'s words, for when no real NCCL could be loaded.
pub fn error_string(r: NcclResult) -> &'static std::ffi::CStr {
    match r {
        SUCCESS => c"no error",
        UNHANDLED_CUDA_ERROR => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        SYSTEM_ERROR => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        INTERNAL_ERROR => c"internal error - please report this issue to the NCCL developers",
        INVALID_ARGUMENT => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        INVALID_USAGE => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        REMOTE_ERROR => c"remote process exited or there was a network error",
        IN_PROGRESS => c"NCCL operation in progress",
        _ => c"unknown result code",
    }
}

/// `ncclAllReduce`'s and `ncclReduceScatter`'s C signature (nccl.h).
pub type Reduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    DataType,
    RedOp,
    Comm,
    Stream,
) -> NcclResult;
/// `ncclAllGather`'s.
pub type Gather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, DataType, Comm, Stream) -> NcclResult;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abi_sizes_match_nccl_h() {
        // nccl.h: NCCL_UNIQUE_ID_BYTES 128; ncclTeam is three ints.
        assert_eq!(std::mem::size_of::<UniqueId>(), 128);
        assert_eq!(std::mem::size_of::<Team>(), 12);
        // ncclConfig_t: size_t size; unsigned magic, version; int blocking at byte 16.
        assert_eq!(std::mem::offset_of!(ConfigHead, blocking), 16);
    }

    #[test]
    fn only_ipcreduce_dtypes_and_ops_are_taken() {
        // nccl.h numbering: int8 0 .. float16 6, float32 7, float64 8, bfloat16 9, fp8 10/11.
        let taken: Vec<i32> = (0..12).filter(|d| to_dtype(*d).is_some()).collect();
        assert_eq!(taken, vec![6, 7, 9]);
        // sum 0, prod 1, max 2, min 3, avg 4, premul-sum handles from 5 on.
        let ops: Vec<i32> = (0..8).filter(|o| to_op(*o).is_some()).collect();
        assert_eq!(ops, vec![0, 2, 3]);
    }

    #[test]
    fn unset_config_is_blocking() {
        let mut head = ConfigHead {
            size: 0,
            magic: 0xcafebeef,
            version: 22809,
            blocking: i32::MIN,
        };
        // SAFETY: null, or a live head.
        unsafe {
            assert!(is_blocking(std::ptr::null()));
            assert!(is_blocking(&head as *const ConfigHead as *const c_void));
            head.blocking = 0;
            assert!(!is_blocking(&head as *const ConfigHead as *const c_void));
        }
    }
}
