//! Reduce-scatter and all-gather on the host backend, through its all-reduce: exact and cheap
//! to keep right, not fast (the host backend is the reference and CI's way to test semantics).
//!
//! - reduce-scatter: the whole send all-reduced into a scratch buffer (rank order, f32, one
//!   rounding: the cuda kernels' result), then this rank's shard copied out;
//! - all-gather: a scratch buffer of negative zeros with this rank's shard written in,
//!   all-reduced with sum. `x + (-0) = x` exactly for every value (negative zero, infinities
//!   and NaN included), so every shard arrives bit for bit.
//!
//! The all-reduce is stamped as the operation it serves, so ranks in different operations
//! still fail with a mismatch.

use super::HostComm;
use crate::backend::SgOp;
use crate::error::{Error, Result};
use crate::shards::Shards;
use crate::types::{Algorithm, BackendKind, DType, ReduceOp};

/// The bits of -0.0 in `dtype`, little-endian.
fn negative_zero(dtype: DType) -> &'static [u8] {
    match dtype {
        DType::F32 => &[0, 0, 0, 0x80],
        DType::F16 | DType::Bf16 => &[0, 0x80],
    }
}

impl HostComm {
    /// # Safety
    /// As [`crate::backend::BackendOps::scatter_gather_raw`].
    pub(super) unsafe fn scatter_gather(
        &mut self,
        what: SgOp,
        send: *const u8,
        recv: *mut u8,
        shards: Shards,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if shards.parts != self.world || what == SgOp::AllReduce {
            return Err(Error::invalid(
                self.rank,
                what.name(),
                format!("{} shards for {} ranks", shards.parts, self.world),
            ));
        }
        let size = dtype.size();
        let own = shards.span(self.rank);
        let (whole, mine) = (shards.total * size, own.len() * size);
        let algo = crate::plan::choose(
            Algorithm::Auto,
            None,
            BackendKind::Host,
            crate::plan::Fabric::Peer,
            self.world,
            whole,
        );
        let mut scratch = vec![0u8; whole];
        match what {
            SgOp::ReduceScatter => {
                // SAFETY: `send` holds `whole` bytes (caller); `scratch` is ours.
                unsafe {
                    self.all_reduce_as(
                        what,
                        send,
                        scratch.as_mut_ptr(),
                        shards.total,
                        dtype,
                        op,
                        algo,
                    )?;
                    // `recv` may be `send`'s shard (in place): scratch is a copy, so no overlap.
                    std::ptr::copy_nonoverlapping(
                        scratch.as_ptr().add(own.start * size),
                        recv,
                        mine,
                    );
                }
            }
            _ => {
                for e in scratch.chunks_exact_mut(size) {
                    e.copy_from_slice(negative_zero(dtype));
                }
                let p = scratch.as_mut_ptr();
                // SAFETY: `send` holds `mine` bytes, `recv` `whole` (caller); `scratch` is ours.
                unsafe {
                    std::ptr::copy_nonoverlapping(send, p.add(own.start * size), mine);
                    self.all_reduce_as(what, p, p, shards.total, dtype, ReduceOp::Sum, algo)?;
                    std::ptr::copy_nonoverlapping(p, recv, whole);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_zero_is_negative_zero() {
        let f = f32::from_le_bytes(negative_zero(DType::F32).try_into().unwrap());
        assert!(f == 0.0 && f.is_sign_negative());
        let h = u16::from_le_bytes(negative_zero(DType::F16).try_into().unwrap());
        let h = half::f16::from_bits(h);
        assert!(h.to_f32() == 0.0 && h.is_sign_negative());
        let b = u16::from_le_bytes(negative_zero(DType::Bf16).try_into().unwrap());
        assert!(half::bf16::from_bits(b).is_sign_negative());
    }
}
