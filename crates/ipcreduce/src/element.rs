//! Rust element types that map to a [`DType`], and conversions used by the host backend,
//! the reference and the tests.

use crate::types::DType;
use half::{bf16, f16};

/// A scalar that can be all-reduced.
pub trait Element: Copy + Send + Sync + 'static + bytemuck_like::Pod {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Marker for plain-old-data element types whose bytes may be viewed as `u8`.
pub mod bytemuck_like {
    /// # Safety
    /// Implementors have no padding and every bit pattern is a valid value.
    pub unsafe trait Pod {}
    unsafe impl Pod for f32 {}
    unsafe impl Pod for half::f16 {}
    unsafe impl Pod for half::bf16 {}
}

/// Views a slice of elements as bytes.
pub fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: T is Pod (no padding), so every byte is initialised.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Views a mutable slice of elements as bytes.
pub fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: T is Pod: any byte pattern written is a valid T.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Decodes element `i` of a little-endian byte buffer of `dtype` to f64.
#[inline]
pub fn load_f64(dtype: DType, bytes: &[u8], i: usize) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()) as f64,
        DType::F16 => f16::from_le_bytes(bytes[2 * i..2 * i + 2].try_into().unwrap()).to_f64(),
        DType::Bf16 => bf16::from_le_bytes(bytes[2 * i..2 * i + 2].try_into().unwrap()).to_f64(),
    }
}

/// Encodes `v` (rounded to nearest) into element `i` of a byte buffer of `dtype`.
#[inline]
pub fn store_f64(dtype: DType, bytes: &mut [u8], i: usize, v: f64) {
    match dtype {
        DType::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&(v as f32).to_le_bytes()),
        DType::F16 => bytes[2 * i..2 * i + 2].copy_from_slice(&f16::from_f64(v).to_le_bytes()),
        DType::Bf16 => bytes[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
    }
}
