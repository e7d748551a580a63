//! NVTX ranges per call (`IPCREDUCE_NVTX=1`): each recorded call is pushed as a range named
//! `op size path` (`all_reduce 4 KiB oneshot`) while the host issues it, so Nsight Systems
//! shows the library's calls beside the kernels they launch.
//!
//! No link-time dependency: `libnvToolsExt.so.1` (NVTX's shared library, which forwards to the
//! tool that Nsight Systems injects through `NVTX_INJECTION64_PATH`) is opened with `dlopen`
//! once per process, from `IPCREDUCE_NVTX_LIB` if set, else by its name on the loader's path
//! (pip's `nvidia-nvtx` package ships one). Not found: a warning, and no ranges. Off (the
//! default), the recorder holds no NVTX state: recording a call tests one `Option`.

use crate::backend::SgOp;
use crate::types::DType;
use std::ffi::{c_char, c_int, CString};
use std::io::Write;
use std::sync::OnceLock;

/// The two entry points used.
pub struct Fns {
    push: unsafe extern "C" fn(*const c_char) -> c_int,
    pop: unsafe extern "C" fn() -> c_int,
}

/// The library's names tried in order when `IPCREDUCE_NVTX_LIB` is unset.
const NAMES: [&str; 2] = ["libnvToolsExt.so.1", "libnvToolsExt.so"];

fn open(name: &str) -> Result<Fns, String> {
    let c = CString::new(name).map_err(|_| format!("{name:?}: a NUL in the name"))?;
    // SAFETY: dlopen/dlsym with NUL-terminated names; the handle is kept for the process's
    // life (never closed: a tool injected into NVTX must not be unloaded under it).
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if h.is_null() {
            let why = libc::dlerror();
            let why = if why.is_null() {
                "not found".to_string()
            } else {
                std::ffi::CStr::from_ptr(why).to_string_lossy().into_owned()
            };
            return Err(format!("{name}: {why}"));
        }
        let push = libc::dlsym(h, c"nvtxRangePushA".as_ptr());
        let pop = libc::dlsym(h, c"nvtxRangePop".as_ptr());
        if push.is_null() || pop.is_null() {
            return Err(format!("{name}: no nvtxRangePushA/nvtxRangePop in it"));
        }
        Ok(Fns {
            push: std::mem::transmute::<
                *mut libc::c_void,
                unsafe extern "C" fn(*const c_char) -> c_int,
            >(push),
            pop: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn() -> c_int>(pop),
        })
    }
}

/// The process's NVTX entry points, loaded at the first ask (`lib`: `IPCREDUCE_NVTX_LIB`).
pub fn load(lib: Option<&str>) -> Option<&'static Fns> {
    static FNS: OnceLock<Option<Fns>> = OnceLock::new();
    FNS.get_or_init(|| {
        let tried: Vec<Result<Fns, String>> = match lib {
            Some(l) => vec![open(l)],
            None => NAMES.iter().map(|n| open(n)).collect(),
        };
        let mut why = Vec::new();
        for t in tried {
            match t {
                Ok(f) => return Some(f),
                Err(e) => why.push(e),
            }
        }
        tracing::warn!(
            "IPCREDUCE_NVTX=1: no NVTX library ({}); no ranges",
            why.join("; ")
        );
        None
    })
    .as_ref()
}

/// One communicator's ranges: the entry points and a reused name buffer.
pub struct Ranges {
    fns: &'static Fns,
    name: Vec<u8>,
    /// Ranges pushed and not yet popped (0 or 1: calls do not nest).
    open: u32,
    /// The call begun last, for its range once its path is known.
    call: (SgOp, u64, DType),
}

/// `4 KiB`, `1.5 MiB`: the call's size in the range name.
fn size(out: &mut Vec<u8>, bytes: u64) {
    let units = ["B", "KiB", "MiB", "GiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    let _ = if v.fract() == 0.0 {
        write!(out, "{v:.0} {}", units[u])
    } else {
        write!(out, "{v:.1} {}", units[u])
    };
}

/// The range's name, NUL-terminated, into `out`.
pub fn name(out: &mut Vec<u8>, op: &str, count: u64, dtype: DType, path: Option<&str>) {
    out.clear();
    out.extend_from_slice(op.as_bytes());
    out.push(b' ');
    size(out, count * dtype.size() as u64);
    if let Some(p) = path {
        out.push(b' ');
        out.extend_from_slice(p.as_bytes());
    }
    out.push(0);
}

impl Ranges {
    pub fn new(fns: &'static Fns) -> Ranges {
        Ranges {
            fns,
            name: Vec::with_capacity(64),
            open: 0,
            call: (SgOp::AllReduce, 0, DType::F32),
        }
    }

    /// A call begins: an all-reduce's range opens once its path is known ([`Ranges::path`],
    /// before any work is issued); the others' now (the backend picks their path alone).
    pub fn begin(&mut self, op: SgOp, count: u64, dtype: DType) {
        self.call = (op, count, dtype);
        if op != SgOp::AllReduce {
            self.push(op.name(), count, dtype, None);
        }
    }

    /// The current call's path is known.
    pub fn path(&mut self, path: &str) {
        let (op, count, dtype) = self.call;
        self.push(op.name(), count, dtype, Some(path));
    }

    /// Opens the call's range (closing one left open, which a failed call may leave).
    pub fn push(&mut self, op: &str, count: u64, dtype: DType, path: Option<&str>) {
        self.pop();
        name(&mut self.name, op, count, dtype, path);
        // SAFETY: a NUL-terminated name, read during the call.
        unsafe { (self.fns.push)(self.name.as_ptr().cast()) };
        self.open = 1;
    }

    pub fn pop(&mut self) {
        if self.open > 0 {
            // SAFETY: closes the range this communicator pushed on this thread.
            unsafe { (self.fns.pop)() };
            self.open = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_say_op_size_and_path() {
        let mut b = Vec::new();
        name(&mut b, "all_reduce", 1024, DType::F32, Some("oneshot"));
        assert_eq!(b, b"all_reduce 4 KiB oneshot\0");
        name(&mut b, "all_gather", 3, DType::Bf16, None);
        assert_eq!(b, b"all_gather 6 B\0");
        name(&mut b, "all_reduce", 3 << 19, DType::F16, Some("twoshot"));
        assert_eq!(b, b"all_reduce 3 MiB twoshot\0");
        name(&mut b, "reduce_scatter", 768 << 10, DType::F32, None);
        assert_eq!(b, b"reduce_scatter 3 MiB\0");
        name(&mut b, "all_reduce", 1536 << 8, DType::F32, None);
        assert_eq!(b, b"all_reduce 1.5 MiB\0");
    }

    #[test]
    fn a_missing_library_is_named() {
        let e = open("libipcreduce-no-such-nvtx.so.1")
            .err()
            .expect("no such library");
        assert!(e.contains("libipcreduce-no-such-nvtx.so.1"), "{e}");
    }
}
