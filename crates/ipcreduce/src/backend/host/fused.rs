//! All-reduce + residual add + RMSNorm on the host backend: the reference of the numerics in
//! [`crate::fused`], run through the host all-reduce (rank order, f32, one rounding) and a
//! per-row epilogue in Rust.
//!
//! A call is one identity epoch (its stamp holds the shape, see stamp.rs, `fused_ident`), then
//! the all-reduce's epochs.

use super::stamp;
use super::HostComm;
use crate::backend::SgOp;
use crate::error::{Error, Result};
use crate::fused::{self, AddRmsNorm};
use crate::types::{Algorithm, DType, ReduceOp};
use half::{bf16, f16};

/// An element type as the epilogue reads and writes it.
trait Elem: Copy {
    fn f32(self) -> f32;
    fn round(v: f32) -> Self;
}
impl Elem for f32 {
    fn f32(self) -> f32 {
        self
    }
    fn round(v: f32) -> f32 {
        v
    }
}
impl Elem for f16 {
    fn f32(self) -> f32 {
        self.to_f32()
    }
    fn round(v: f32) -> f16 {
        f16::from_f32(v)
    }
}
impl Elem for bf16 {
    fn f32(self) -> f32 {
        self.to_f32()
    }
    fn round(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}

/// The epilogue over all rows: `sum` is the all-reduced input (already rounded to `T`).
///
/// # Safety
/// `a`'s pointers valid for its shape (checked by [`fused::check`]); in-place aliasing as
/// allowed there: each element is read before it is written.
unsafe fn epilogue<T: Elem>(a: &AddRmsNorm, sum: &[T]) {
    let h = a.hidden;
    let scale = if a.fp8_out.is_null() {
        None
    } else {
        // SAFETY: checked non-null and aligned; one f32 (caller).
        Some(unsafe { a.fp8_scale.cast::<f32>().read() })
    };
    // SAFETY: the weight is `hidden` elements (caller) and no output overlaps it (checked).
    let w = unsafe { std::slice::from_raw_parts(a.weight.cast::<T>(), h) };
    let mut row = vec![0f32; h];
    for t in 0..a.tokens {
        let base = t * h;
        for (i, r) in row.iter_mut().enumerate() {
            // SAFETY: element base + i of residual lies inside it (caller); read before
            // residual_out (which may be residual) is written.
            let res = unsafe { a.residual.cast::<T>().add(base + i).read() };
            let v = T::round(sum[base + i].f32() + res.f32());
            // SAFETY: as above, for residual_out.
            unsafe { a.residual_out.cast::<T>().add(base + i).write(v) };
            *r = v.f32();
        }
        let rstd = fused::rstd(fused::ss_tree(row.iter().copied()), h, a.eps);
        for (i, r) in row.iter().enumerate() {
            let y = (r * rstd) * w[i].f32();
            // SAFETY: out (maybe input, which the all-reduce has finished reading) holds the
            // element.
            unsafe { a.out.cast::<T>().add(base + i).write(T::round(y)) };
            if let Some(s) = scale {
                // SAFETY: fp8_out holds tokens x hidden bytes (caller).
                unsafe {
                    a.fp8_out
                        .cast::<u8>()
                        .add(base + i)
                        .write(fused::e4m3_satfinite(y / s))
                };
            }
        }
    }
}

impl HostComm {
    /// # Safety
    /// As [`crate::backend::BackendOps::add_rms_norm_raw`].
    pub(super) unsafe fn add_rms_norm(&mut self, a: &AddRmsNorm, algo: Algorithm) -> Result<()> {
        if !matches!(algo, Algorithm::OneShot | Algorithm::TwoShot) {
            return Err(Error::invalid(
                self.rank,
                fused::NAME,
                format!("the host backend runs oneshot or twoshot, not {algo}"),
            ));
        }
        let shape = fused::check(self.rank, a)?;
        let seq = self.seq + 1;
        self.check_alive(fused::NAME, seq)?;
        if self.world > 1 {
            let stamp = stamp::fused_ident(seq, &shape, a.dtype, algo);
            self.handshake(&stamp)
                .map_err(|f| self.fail(f, fused::NAME, seq))?;
        }
        let count = shape.count();
        let mut sum = vec![0u8; count * a.dtype.size()];
        // SAFETY: input holds `count` elements (caller); `sum` is ours. The all-reduce numbers
        // itself `seq` (the handshake's), and its zero-copy end barrier means no peer still
        // reads `input` when `out` (which may be it) is written below.
        unsafe {
            self.all_reduce_as(
                SgOp::AddRmsNorm,
                a.input.cast(),
                sum.as_mut_ptr(),
                count,
                a.dtype,
                ReduceOp::Sum,
                algo,
            )?;
        }
        if count == 0 {
            return Ok(());
        }
        // SAFETY: `sum` holds `count` elements of the dtype (bytes of any alignment are copied
        // into a typed vector first).
        unsafe {
            match a.dtype {
                DType::F32 => epilogue::<f32>(a, &typed(&sum)),
                DType::F16 => epilogue::<f16>(a, &typed(&sum)),
                DType::Bf16 => epilogue::<bf16>(a, &typed(&sum)),
            }
        }
        Ok(())
    }
}

/// `bytes` as elements of `T` (little-endian plain bits).
fn typed<T: Copy + Default>(bytes: &[u8]) -> Vec<T> {
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut v = vec![T::default(); n];
    // SAFETY: v holds n * size_of::<T>() bytes; f32/f16/bf16 accept any bits.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr().cast::<u8>(), bytes.len())
    };
    v
}
