//! The real NCCL every call is forwarded to: found once, at the first call that needs it.
//!
//! Order: `IPCREDUCE_NCCL_LIB` (that file and nothing else); a `libnccl.so.2` already loaded
//! in the process (the one the program linked or its framework loaded: PyTorch's wheel loads
//! its own); the dynamic loader's search for `libnccl.so.2`; every `LD_LIBRARY_PATH` folder
//! and the system folders; the `nvidia-nccl` package beside a loaded PyTorch. A candidate that
//! turns out to be this library (installed under NCCL's name) is skipped.

use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The loaded real NCCL.
pub struct Real {
    handle: *mut c_void,
    pub path: String,
}

// SAFETY: a dlopen handle may be used from any thread.
unsafe impl Send for Real {}
unsafe impl Sync for Real {}

static REAL: OnceLock<Result<Real, String>> = OnceLock::new();

/// The real NCCL, or why there is none (the same text every time).
pub fn real() -> Result<&'static Real, &'static str> {
    REAL.get_or_init(find).as_ref().map_err(|e| e.as_str())
}

impl Real {
    /// The address of `name` in the real library.
    pub fn sym(&self, name: &CStr) -> Result<*mut c_void, String> {
        // SAFETY: a live handle and a C string.
        let p = unsafe { libc::dlsym(self.handle, name.as_ptr()) };
        if p.is_null() {
            return Err(format!(
                "ipcreduce-nccl: the real NCCL ({}) has no {} (an older NCCL than 2.28?)",
                self.path,
                name.to_string_lossy()
            ));
        }
        Ok(p)
    }
}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a C string valid until the next dl call on this thread.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        return "unknown dlopen error".into();
    }
    unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
}

/// Exported only by this library: a copy of it under NCCL's name (a folder on
/// `LD_LIBRARY_PATH` with `libnccl.so.2` pointing here) is recognised and skipped, never
/// forwarded to.
#[no_mangle]
#[used]
pub static ipcreduce_nccl_forwarder: u32 = 1;

/// Whether `handle` is this library or a copy of it.
fn is_self(handle: *mut c_void) -> bool {
    // SAFETY: a live handle; the symbol name is a C string.
    !unsafe { libc::dlsym(handle, c"ipcreduce_nccl_forwarder".as_ptr()) }.is_null()
}

/// The path the loader gave `handle`.
fn handle_path(handle: *mut c_void, fallback: &str) -> String {
    // SAFETY: a live handle; dladdr of one of its symbols names its file.
    let sym = unsafe { libc::dlsym(handle, c"ncclGetVersion".as_ptr()) };
    if !sym.is_null() {
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        if unsafe { libc::dladdr(sym, &mut info) } != 0 && !info.dli_fname.is_null() {
            return unsafe { CStr::from_ptr(info.dli_fname) }
                .to_string_lossy()
                .into_owned();
        }
    }
    fallback.to_string()
}

/// Opens `name` with `flags`; a handle that is this library is closed and refused.
fn open(name: &str, flags: i32) -> Result<Option<Real>, String> {
    let c = CString::new(name).map_err(|_| format!("{name:?} holds a NUL byte"))?;
    // SAFETY: a C string; flags are dlopen's.
    let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
    if h.is_null() {
        return Err(dlerror());
    }
    if is_self(h) {
        // SAFETY: the handle from the dlopen above.
        unsafe { libc::dlclose(h) };
        return Ok(None);
    }
    Ok(Some(Real {
        handle: h,
        path: handle_path(h, name),
    }))
}

fn find() -> Result<Real, String> {
    let now = libc::RTLD_NOW | libc::RTLD_LOCAL;
    if let Some(path) = std::env::var_os("IPCREDUCE_NCCL_LIB").filter(|v| !v.is_empty()) {
        let path = path.to_string_lossy().into_owned();
        return match open(&path, now) {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(format!(
                "ipcreduce-nccl: IPCREDUCE_NCCL_LIB={path} is this library, not the real NCCL"
            )),
            Err(e) => Err(format!(
                "ipcreduce-nccl: cannot load the real NCCL from IPCREDUCE_NCCL_LIB={path}: {e}"
            )),
        };
    }
    let mut tried = Vec::new();
    // Already loaded: what the program would have called without us.
    if let Ok(Some(r)) = open("libnccl.so.2", now | libc::RTLD_NOLOAD) {
        return Ok(r);
    }
    match open("libnccl.so.2", now) {
        Ok(Some(r)) => return Ok(r),
        Ok(None) => tried.push("libnccl.so.2 (the loader found this library)".to_string()),
        Err(e) => tried.push(e),
    }
    for path in candidates() {
        if !path.is_file() {
            continue;
        }
        match open(&path.to_string_lossy(), now) {
            Ok(Some(r)) => return Ok(r),
            Ok(None) => {}
            Err(e) => tried.push(e),
        }
    }
    Err(format!(
        "ipcreduce-nccl: no real NCCL (libnccl.so.2) found to forward to; set \
         IPCREDUCE_NCCL_LIB to its path. Tried: {}",
        tried.join("; ")
    ))
}

/// `libnccl.so.2` in the folders the loader searches, then beside a loaded PyTorch.
fn candidates() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .collect();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/local/lib",
        "/usr/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs.extend(torch_nccl_dirs());
    dirs.into_iter().map(|d| d.join("libnccl.so.2")).collect()
}

/// `site-packages/nvidia/nccl/lib` beside each loaded `site-packages/torch/lib/libtorch*.so`.
fn torch_nccl_dirs() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for obj in loaded_objects() {
        let p = Path::new(&obj);
        let is_torch = p
            .file_name()
            .map(|n| n.to_string_lossy().starts_with("libtorch"))
            .unwrap_or(false);
        if let (true, Some(lib)) = (is_torch, p.parent()) {
            if let Some(site) = lib.parent().and_then(Path::parent) {
                out.push(site.join("nvidia/nccl/lib"));
            }
        }
    }
    out
}

/// File names of every object loaded in the process.
fn loaded_objects() -> Vec<String> {
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> i32 {
        // SAFETY: the loader passes a live info; data is our Vec.
        let out = unsafe { &mut *(data as *mut Vec<String>) };
        let name = unsafe { (*info).dlpi_name };
        if !name.is_null() {
            let s = unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned();
            if !s.is_empty() {
                out.push(s);
            }
        }
        0
    }
    let mut out: Vec<String> = Vec::new();
    // SAFETY: the callback only reads what the loader hands it.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut out as *mut Vec<String> as *mut c_void) };
    out
}
