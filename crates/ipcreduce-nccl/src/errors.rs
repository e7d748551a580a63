//! The texts `ncclGetLastError` returns for what this library itself refused or failed.
//!
//! NCCL hands out a pointer that stays valid after the call; ours are leaked on purpose so
//! that no caller ever holds a dangling one (errors are rare: one per failure, not per call).

use std::ffi::{c_char, CString};
use std::sync::atomic::{AtomicPtr, Ordering};

/// A process-wide error: no real NCCL, or a bad `IPCREDUCE_NCCL`.
static GLOBAL: AtomicPtr<c_char> = AtomicPtr::new(std::ptr::null_mut());
/// The latest error of ours, process-wide or of any communicator: what
/// `ncclGetLastError(NULL)` returns, as NCCL's does for its own (PyTorch asks so, after an
/// error code, to explain it).
static LAST: AtomicPtr<c_char> = AtomicPtr::new(std::ptr::null_mut());

/// Keeps `msg` for good and returns it as a C string.
pub fn leak(msg: &str) -> *mut c_char {
    let c = CString::new(msg.replace('\0', " ")).expect("NUL bytes were replaced");
    c.into_raw()
}

/// Records a process-wide error (also printed once: it usually explains a failing job).
pub fn set_global(msg: &str) {
    let text = leak(msg);
    LAST.store(text, Ordering::Release);
    let old = GLOBAL.swap(text, Ordering::AcqRel);
    if old.is_null() {
        // As a log line: whole, and prefixed with the rank where it is known.
        let text = msg.strip_prefix("ipcreduce-nccl: ").unwrap_or(msg);
        crate::log::write_stderr(&crate::log::line(None, format_args!("{text}")));
    }
}

/// The last process-wide error, if any.
pub fn global() -> Option<*const c_char> {
    let p = GLOBAL.load(Ordering::Acquire);
    (!p.is_null()).then_some(p as *const c_char)
}

/// The latest error of ours, if any (see [`LAST`]).
pub fn last() -> Option<*const c_char> {
    let p = LAST.load(Ordering::Acquire);
    (!p.is_null()).then_some(p as *const c_char)
}

/// An error slot of one communicator.
#[derive(Default)]
pub struct Slot(AtomicPtr<c_char>);

impl Slot {
    /// Records `msg` as this communicator's error, and as the latest of the process.
    pub fn set(&self, msg: &str) {
        let text = leak(msg);
        self.0.store(text, Ordering::Release);
        LAST.store(text, Ordering::Release);
    }

    pub fn get(&self) -> Option<*const c_char> {
        let p = self.0.load(Ordering::Acquire);
        (!p.is_null()).then_some(p as *const c_char)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn a_communicators_error_is_the_processs_latest() {
        // PyTorch explains an error code with ncclGetLastError(NULL): that must be ours.
        let slot = Slot::default();
        slot.set("ipcreduce-nccl: rank 0: communicator is aborted: rank 1 died");
        let text = |p: *const c_char| unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_string();
        assert_eq!(text(slot.get().unwrap()), text(last().unwrap()));
        assert!(text(last().unwrap()).contains("rank 1 died"));
        // A later one, of another communicator, replaces it there but not in the first slot.
        Slot::default().set("ipcreduce-nccl: rank 0: second");
        assert!(text(last().unwrap()).ends_with("second"));
        assert!(text(slot.get().unwrap()).contains("rank 1 died"));
    }
}
