//! Symmetric windows: zero-copy collectives on buffers a program registered with
//! `ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC)` (PyTorch's NCCL memory pool with
//! `symm=True`, vLLM's and others' symmetric buffers, usually from `ncclMemAlloc`).
//!
//! NCCL's contract for such a window is the one ipcreduce's registered buffers need: the
//! registration is collective, the size the same on every rank, and every collective that
//! passes a buffer inside it passes, on every rank, the same offset from the window's start
//! (and if one rank passes a registered buffer, every rank does). So after the real NCCL has
//! made the window, the same buffer is registered with ipcreduce too
//! ([`ipcreduce::Communicator::register`], collective over ipcreduce's own bootstrap): an
//! all-reduce whose send and recv both lie in such windows then reads and writes the peers'
//! buffers where they are, with no staging copy. The offsets are part of every call's
//! identity, so a program that breaks the contract gets a mismatch error on every rank, never
//! a wrong sum.
//!
//! Taken only where every rank decides alike ([`refusal`]): the window is symmetric, NCCL
//! returned it at once (outside a group; inside one, NCCL fills it at the group's end) and
//! non-null (NCCL returns a null window where it does not support windows, and then a
//! deregistration could not name ours). ipcreduce's registration itself ends alike on every
//! rank (a rank whose memory cannot be shared fails them all), and its failure never fails
//! the NCCL call: such a window's buffers take the staged path. `ncclCommRegister` (one
//! rank's registration, any offsets) stays NCCL's alone.

use crate::comm::{lookup, Accel};
use crate::log;
use crate::types::*;
use std::ffi::{c_int, c_void};

/// Whether ipcreduce leaves the window NCCL returned (`window_null`) to NCCL alone, and why;
/// `None` when it registers it too. Depends on nothing that may differ between ranks.
pub fn refusal(flags: c_int, window_null: bool, in_group: bool) -> Option<&'static str> {
    if flags & WIN_COLL_SYMMETRIC == 0 {
        Some("not NCCL_WIN_COLL_SYMMETRIC: its offsets may differ between ranks")
    } else if in_group {
        Some("registered inside a group: NCCL fills the window at the group's end")
    } else if window_null {
        Some("NCCL returned no window (it supports none on this communicator)")
    } else {
        None
    }
}

/// After the real NCCL registered `[buff, buff + size)` as `window` on `comm`: the same
/// buffer registered with ipcreduce where [`refusal`] allows. Never changes the call's result.
///
/// # Safety
/// `buff` is the caller's memory of `size` bytes, registered with NCCL as `window`; it stays
/// allocated until the window is deregistered (NCCL's contract).
pub unsafe fn register(
    comm: Comm,
    buff: *mut c_void,
    size: usize,
    window: Window,
    flags: c_int,
    in_group: bool,
) {
    let Some(a) = ours(comm) else { return };
    if let Some(why) = refusal(flags, window.is_null(), in_group) {
        log::note_rank(
            a.rank,
            format_args!("ncclCommWindowRegister {buff:p} +{size}: staged path ({why})"),
        );
        return;
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut c = a.comm.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the caller's contract; ipcreduce releases its mappings at the
        // deregistration (or with the communicator), before NCCL's contract lets the memory go.
        unsafe { c.register(buff as u64, size) }
    }));
    match r {
        Ok(Ok(buf)) => {
            log::note_rank(
                a.rank,
                format_args!("ncclCommWindowRegister {buff:p} +{size}: zero-copy"),
            );
            a.windows
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((window as usize, buf));
        }
        // Said even without IPCREDUCE_NCCL=log: the program asked for zero-copy.
        Ok(Err(e)) => log::write_stderr(&log::line(
            Some(a.rank),
            format_args!("ncclCommWindowRegister {buff:p} +{size}: staged path ({e})"),
        )),
        Err(_) => log::write_stderr(&log::line(
            Some(a.rank),
            format_args!("ncclCommWindowRegister {buff:p} +{size}: staged path (panicked)"),
        )),
    }
}

/// Before the real NCCL deregisters `window`: ipcreduce's registration of it, if any, freed
/// (collective, as the deregistration is: it waits for this rank's work on the buffer and for
/// every rank, bounded). An error is the call's.
pub fn deregister(comm: Comm, window: Window) -> NcclResult {
    let Some(a) = ours(comm) else {
        return SUCCESS;
    };
    let buf = {
        let mut list = a.windows.lock().unwrap_or_else(|p| p.into_inner());
        match list.iter().position(|(w, _)| *w == window as usize) {
            Some(i) => list.swap_remove(i).1,
            None => return SUCCESS,
        }
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut c = a.comm.lock().unwrap_or_else(|p| p.into_inner());
        c.free(buf)
    }));
    match r {
        Ok(Ok(())) => {
            log::note_rank(a.rank, format_args!("ncclCommWindowDeregister {window:p}"));
            SUCCESS
        }
        Ok(Err(e)) => a.fail(&e),
        Err(_) => a.panicked("ncclCommWindowDeregister"),
    }
}

/// The accelerated communicator behind `comm`, unless `IPCREDUCE_NCCL=off`.
fn ours(comm: Comm) -> Option<std::sync::Arc<Accel>> {
    log::accelerating().then(|| lookup(comm)).flatten()
}

entry! {
    fn ncclCommWindowRegister / pncclCommWindowRegister(comm: Comm, buff: *mut c_void, size: usize, win: *mut Window, flags: c_int) -> NcclResult {
        crate::group::before_other("ncclCommWindowRegister");
        // Inside the caller's group NCCL fills the window only at ncclGroupEnd.
        let in_group = crate::group::in_group();
        log::forwarded("ncclCommWindowRegister");
        let f = real_fn!(ncclCommWindowRegister(Comm, *mut c_void, usize, *mut Window, c_int) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: the caller's arguments, unchanged.
        let r = unsafe { f(comm, buff, size, win, flags) };
        if r == SUCCESS && !win.is_null() {
            // SAFETY: NCCL filled the caller's slot (null where it made no window); the
            // buffer's contract is NCCL's.
            unsafe { register(comm, buff, size, *win, flags, in_group) };
        }
        r
    }

    fn ncclCommWindowDeregister / pncclCommWindowDeregister(comm: Comm, win: Window) -> NcclResult {
        crate::group::before_other("ncclCommWindowDeregister");
        // Ours first: no kernel of ours touches the buffer once NCCL lets it go.
        let ours = deregister(comm, win);
        log::forwarded("ncclCommWindowDeregister");
        let f = real_fn!(ncclCommWindowDeregister(Comm, Window) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: the caller's arguments, unchanged.
        let r = unsafe { f(comm, win) };
        if r == SUCCESS {
            ours
        } else {
            r
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_symmetric_windows_made_at_once_are_registered() {
        // NCCL_WIN_COLL_SYMMETRIC is bit 0 (nccl.h); other bits (strict ordering) do not matter.
        assert_eq!(refusal(0x1, false, false), None);
        assert_eq!(refusal(0x3, false, false), None);
        assert!(refusal(0x0, false, false).unwrap().contains("SYMMETRIC"));
        assert!(refusal(0x2, false, false).unwrap().contains("SYMMETRIC"));
        assert!(refusal(0x1, false, true).unwrap().contains("group"));
        assert!(refusal(0x1, true, false).unwrap().contains("no window"));
    }
}
