//! The texts `ncclGetLastError` returns for what this library itself refused or failed.
//!
//! NCCL hands out a pointer that stays valid after the call; ours are leaked on purpose so
//! that no caller ever holds a dangling one (errors are rare: one per failure, not per call).

use std::ffi::{c_char, CString};
use std::sync::atomic::{AtomicPtr, Ordering};

/// A process-wide error: no real NCCL, or a bad `IPCREDUCE_NCCL`.
static GLOBAL: AtomicPtr<c_char> = AtomicPtr::new(std::ptr::null_mut());

/// Keeps `msg` for good and returns it as a C string.
pub fn leak(msg: &str) -> *mut c_char {
    let c = CString::new(msg.replace('\0', " ")).expect("NUL bytes were replaced");
    c.into_raw()
}

/// Records a process-wide error (also printed once: it usually explains a failing job).
pub fn set_global(msg: &str) {
    let old = GLOBAL.swap(leak(msg), Ordering::AcqRel);
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

/// An error slot of one communicator.
#[derive(Default)]
pub struct Slot(AtomicPtr<c_char>);

impl Slot {
    pub fn set(&self, msg: &str) {
        self.0.store(leak(msg), Ordering::Release);
    }

    pub fn get(&self) -> Option<*const c_char> {
        let p = self.0.load(Ordering::Acquire);
        (!p.is_null()).then_some(p as *const c_char)
    }
}
