//! Rust element types that map to a [`DType`], and conversions used by the host backend,
//! the reference and the tests.

use crate::types::DType;
use half::{bf16, f16};

mod sealed {
    /// Only this crate's element types: `DTYPE` decides how many bytes a call reads, so a
    /// type claiming a dtype of another size would make safe code read past its slice.
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A scalar that can be all-reduced: `f32`, `half::f16`, `half::bf16`. Sealed: no other type
/// can implement it, so safe code cannot claim a wrong [`DType`]:
///
/// ```compile_fail,E0277
/// use ipcreduce::{DType, Element};
/// // Plain old data, but not one of ours: 1 byte claiming to be a 4-byte float.
/// #[derive(Clone, Copy)]
/// #[repr(transparent)]
/// struct Byte(u8);
/// unsafe impl bytemuck::Zeroable for Byte {}
/// unsafe impl bytemuck::Pod for Byte {}
/// impl Element for Byte {
///     const DTYPE: DType = DType::F32;
///     fn to_f32(self) -> f32 { self.0 as f32 }
///     fn from_f32(v: f32) -> Self { Byte(v as u8) }
/// }
/// ```
pub trait Element: sealed::Sealed + bytemuck::Pod + Send + Sync + 'static {
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

/// Views a slice of elements as bytes.
pub fn as_bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

/// Views a mutable slice of elements as bytes.
pub fn as_bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element type's size is its dtype's: what the seal guarantees for callers.
    #[test]
    fn sizes_match_dtypes() {
        fn check<T: Element>() {
            assert_eq!(std::mem::size_of::<T>(), T::DTYPE.size(), "{}", T::DTYPE);
        }
        check::<f32>();
        check::<f16>();
        check::<bf16>();
    }

    #[test]
    fn byte_views_are_little_endian_values() {
        let mut v = [1.5f32, -2.0];
        assert_eq!(as_bytes(&v)[..4], 1.5f32.to_le_bytes());
        as_bytes_mut(&mut v)[4..].copy_from_slice(&3.0f32.to_le_bytes());
        assert_eq!(v, [1.5, 3.0]);
        let h = [bf16::from_f32(1.0)];
        assert_eq!(load_f64(DType::Bf16, as_bytes(&h), 0), 1.0);
    }
}
