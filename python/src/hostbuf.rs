//! Host memory handed over through the buffer protocol (numpy arrays, memoryviews, array.array).

use ipcreduce::DType;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;

/// A C-contiguous buffer of a dtype the library reduces. Holding it keeps the exporter's memory
/// alive and its size fixed (numpy refuses to resize an exported array).
pub struct HostBuf {
    pub buf: PyUntypedBuffer,
    pub dtype: DType,
}

impl HostBuf {
    /// Reads `obj`'s buffer; the error text says what is wrong with it (the caller adds rank
    /// and operation).
    pub fn get(obj: &Bound<'_, PyAny>, writable: bool) -> Result<HostBuf, String> {
        let buf = PyUntypedBuffer::get(obj).map_err(|e| {
            format!(
                "a {} does not export a buffer ({e}); pass a numpy array or a torch tensor",
                type_name(obj)
            )
        })?;
        let format = buf.format().to_string_lossy().into_owned();
        let dtype = dtype_of(&format, buf.item_size()).ok_or_else(|| {
            format!(
                "element format {format:?} ({} bytes) is not reduced: use float32 or float16 \
                 (bfloat16 has no numpy dtype: pass a torch tensor)",
                buf.item_size()
            )
        })?;
        if !buf.is_c_contiguous() {
            return Err("the array is not C-contiguous (use numpy.ascontiguousarray)".into());
        }
        if writable && buf.readonly() {
            return Err("the output array is read-only".into());
        }
        Ok(HostBuf { buf, dtype })
    }

    pub fn addr(&self) -> usize {
        self.buf.buf_ptr() as usize
    }

    pub fn count(&self) -> usize {
        self.buf.item_count()
    }
}

/// The struct-module format of a native-endian float32 or float16, with or without a byte-order
/// prefix.
fn dtype_of(format: &str, item_size: usize) -> Option<DType> {
    let f = format.trim_start_matches(['@', '=', '<']);
    let little = cfg!(target_endian = "little");
    if format.starts_with('<') && !little {
        return None;
    }
    match (f, item_size) {
        ("f", 4) => Some(DType::F32),
        ("e", 2) => Some(DType::F16),
        _ => None,
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}
