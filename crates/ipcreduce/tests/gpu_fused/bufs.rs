//! The fused GPU tests' device side: a stream, the case's tensors (plain or in a registered
//! buffer), copies to and from them, the call's arguments, the bitwise comparison and the
//! unfused sequence the fused call is compared with; the path the knob forces.

pub use super::common::cuda::{ck, Stream};
use super::common::fused_ref::{Case, Tensor};
use cudarc::driver::sys;
use ipcreduce::backend::cuda::memory::DeviceAlloc;
use ipcreduce::{AddRmsNorm, Algorithm, Communicator, DType, ReduceOp};
use std::ffi::c_void;

/// Device memory of the test: a plain allocation, or part of a registered buffer.
pub enum Mem {
    Plain(DeviceAlloc),
    At(u64),
}

impl Mem {
    pub fn ptr(&self) -> u64 {
        match self {
            Mem::Plain(d) => d.ptr,
            Mem::At(p) => *p,
        }
    }
}

/// One case's device tensors.
pub struct Bufs {
    pub input: Mem,
    pub residual: Mem,
    pub weight: Mem,
    pub out: Mem,
    pub residual_out: Mem,
    pub fp8: Mem,
    pub scale: Mem,
    /// The unfused sequence's outputs.
    pub sum: Mem,
    pub ref_out: Mem,
    pub ref_residual_out: Mem,
    pub ref_fp8: Mem,
}

pub fn upload(dst: u64, data: &[u8], s: &Stream) {
    // SAFETY: in bounds (the caller sized the buffer); synchronized before `data` can go away.
    ck(
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, data.as_ptr().cast(), data.len(), s.0) },
        "upload",
    );
    s.sync();
}

pub fn download(src: u64, n: usize, s: &Stream) -> Vec<u8> {
    let mut out = vec![0u8; n];
    // SAFETY: the caller passes a live device range of n bytes.
    ck(
        unsafe { sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, n, s.0) },
        "download",
    );
    s.sync();
    out
}

/// Allocates the case's tensors: plain allocations, or slices of one registered buffer every
/// rank allocates alike (`reg`, at the same offsets everywhere).
pub fn alloc(
    c: &mut Communicator,
    bytes: usize,
    hidden_bytes: usize,
    elems: usize,
    reg: bool,
) -> (Bufs, Option<ipcreduce::RegisteredBuffer>) {
    let rank = c.rank();
    let sizes = [
        bytes,
        bytes,
        hidden_bytes,
        bytes,
        bytes,
        elems,
        4,
        bytes,
        bytes,
        bytes,
        elems,
    ];
    let (mems, buf) = if reg {
        let padded: Vec<usize> = sizes.iter().map(|b| b.div_ceil(256) * 256).collect();
        let buf = c.alloc(padded.iter().sum()).expect("registered buffer");
        let mut at = buf.ptr();
        let mut v = Vec::new();
        for p in padded {
            v.push(Mem::At(at));
            at += p as u64;
        }
        (v, Some(buf))
    } else {
        let v = sizes
            .iter()
            .map(|b| Mem::Plain(DeviceAlloc::new((*b).max(16), rank).unwrap()))
            .collect();
        (v, None)
    };
    let mut it = mems.into_iter();
    let mut next = || it.next().unwrap();
    let b = Bufs {
        input: next(),
        residual: next(),
        weight: next(),
        out: next(),
        residual_out: next(),
        fp8: next(),
        scale: next(),
        sum: next(),
        ref_out: next(),
        ref_residual_out: next(),
        ref_fp8: next(),
    };
    (b, buf)
}

/// The fused call's (or the reference's) arguments over `b`.
pub fn fused_args(
    case: &Case,
    input: u64,
    out: u64,
    residual: u64,
    residual_out: u64,
    fp8: u64,
    b: &Bufs,
) -> AddRmsNorm {
    AddRmsNorm {
        input: input as *const c_void,
        residual: residual as *const c_void,
        weight: b.weight.ptr() as *const c_void,
        out: out as *mut c_void,
        residual_out: residual_out as *mut c_void,
        fp8_out: if case.scale.is_some() {
            fp8 as *mut c_void
        } else {
            std::ptr::null_mut()
        },
        fp8_scale: if case.scale.is_some() {
            b.scale.ptr() as *const c_void
        } else {
            std::ptr::null()
        },
        tokens: case.tokens,
        hidden: case.hidden,
        dtype: case.dtype,
        eps: case.eps,
    }
}

/// Bitwise comparison of two tensors of `dtype` (NaNs of any payload equal each other: the
/// CPU and the GPU make different NaN bits), the first few differences in words.
pub fn differences(what: &str, dtype: DType, got: &[u8], want: &[u8]) -> Vec<String> {
    let size = dtype.size();
    let mut bad = Vec::new();
    for (i, (g, w)) in got.chunks(size).zip(want.chunks(size)).enumerate() {
        let nan = |b: &[u8]| {
            let mut t = Tensor::new(dtype, &[0.0]);
            t.bytes().copy_from_slice(b);
            t.get(0).is_nan()
        };
        if g != w && !(size > 1 && nan(g) && nan(w)) {
            bad.push(format!("{what}[{i}] {g:02x?} want {w:02x?}"));
        }
    }
    bad.truncate(3);
    bad
}

/// The unfused sequence: the all-reduce of the input into `sum`, then the reference kernel.
///
/// # Safety
/// Every buffer of `b` holds its tensor (device memory of this rank's GPU).
pub unsafe fn unfused_sequence(
    c: &mut Communicator,
    case: &Case,
    b: &Bufs,
    algo: Algorithm,
    stream: *mut c_void,
) {
    let (d, n) = (case.dtype, case.tokens * case.hidden);
    // SAFETY: forwarded contract.
    unsafe {
        c.all_reduce_raw(
            b.input.ptr() as *const c_void,
            b.sum.ptr() as *mut c_void,
            n,
            d,
            ReduceOp::Sum,
            algo,
            stream,
        )
        .unwrap_or_else(|e| panic!("all-reduce: {e}"));
        let r = fused_args(
            case,
            b.sum.ptr(),
            b.ref_out.ptr(),
            b.residual.ptr(),
            b.ref_residual_out.ptr(),
            b.ref_fp8.ptr(),
            b,
        );
        c.add_rms_norm_reference_raw(&r, stream)
            .unwrap_or_else(|e| panic!("reference: {e}"));
    }
}

/// The knob that forces the fused path (backend/cuda/fused_path.rs).
pub const FUSED_PATH: &str = "IPCREDUCE_FUSED_PATH";

/// The path name `IPCREDUCE_FUSED_PATH` forces on every fused call, if it does.
pub fn forced_path() -> Option<&'static str> {
    match std::env::var(FUSED_PATH).ok()?.as_str() {
        "oneshot" => Some("fused-oneshot"),
        "twoshot" => Some("fused-twoshot"),
        "ll" => Some("fused-ll"),
        _ => None,
    }
}

/// Whether `case` can run on the LL path (backend/cuda/fused_path.rs `ll_fits`): rows of whole
/// 8-byte lines, at most the LL area's 1 MiB per rank. Forced LL refuses the others, so the
/// forced sweep leaves them out.
pub fn ll_fits(tokens: usize, hidden: usize, dtype: DType) -> bool {
    (hidden * dtype.size()).is_multiple_of(8) && tokens * hidden * dtype.size() <= 1 << 20
}

/// Whether the forced path (if any) takes this shape.
pub fn forced_takes(tokens: usize, hidden: usize, dtype: DType) -> bool {
    forced_path() != Some("fused-ll") || ll_fits(tokens, hidden, dtype)
}

/// FP8 bytes widened to 16-bit words (NaN-agnostic comparison does not apply: e4m3 has one
/// NaN code per sign, which both sides produce alike).
pub fn pair(b: &[u8]) -> Vec<u8> {
    b.iter().flat_map(|x| [*x, 0]).collect()
}
