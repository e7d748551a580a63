//! `ncclGroupStart`/`ncclGroupEnd`: NCCL runs a group's calls as one fused operation at its
//! end. Here a group opens at the real NCCL only when it must: a group whose one call is a
//! collective ipcreduce can run (PyTorch and nccl-tests wrap single calls so) runs it on
//! ipcreduce at `ncclGroupEnd`; at the first other call the real group is opened, the held
//! call handed to NCCL inside it, and everything after it forwarded as a whole.
//!
//! Queries (version, counts, errors) do not open the real group.

use crate::coll::{self, Args};
use crate::log;
use crate::types::*;
use std::cell::RefCell;

#[derive(Default)]
struct State {
    /// Depth of this thread's `ncclGroupStart`s.
    depth: u32,
    /// How many of them were handed to the real NCCL.
    real: u32,
    /// The group's one call so far, ours to run at the end.
    held: Option<Args>,
    /// A failure while opening the real group for a call that cannot return it: the group's
    /// end does.
    error: NcclResult,
    /// Communicators initialised inside the open group: (address, blocking, call).
    made: Vec<(usize, bool, String)>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

/// Whether this thread is between `ncclGroupStart` and its `ncclGroupEnd`.
pub fn in_group() -> bool {
    STATE.with(|s| s.borrow().depth > 0)
}

/// Opens the real group (as deep as ours) and hands it the held call.
fn open_real() -> NcclResult {
    let (opens, held) = STATE.with(|s| {
        let mut s = s.borrow_mut();
        let opens = s.depth - s.real;
        s.real = s.depth;
        (opens, s.held.take())
    });
    let start = real_fn!(ncclGroupStart() -> NcclResult, SYSTEM_ERROR);
    for _ in 0..opens {
        // SAFETY: no arguments.
        let r = unsafe { start() };
        if r != SUCCESS {
            return r;
        }
    }
    match held {
        Some(h) => coll::forward(&h, "a group of several calls"),
        None => SUCCESS,
    }
}

/// Entry points that only ask something: they leave a group as it is.
const QUERIES: [&str; 8] = [
    "ncclGetVersion",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclCommCount",
    "ncclCommCuDevice",
    "ncclCommUserRank",
    "ncclCommGetAsyncError",
    "ncclGetUniqueId",
];

/// Before any other entry point is forwarded: inside a group it opens the real one.
pub fn before_other(name: &str) {
    if !in_group() || QUERIES.contains(&name) {
        return;
    }
    let r = open_real();
    if r != SUCCESS {
        STATE.with(|s| s.borrow_mut().error = r);
    }
}

/// The failure kept for the group's end, if any (then cleared).
fn take_error() -> NcclResult {
    STATE.with(|s| std::mem::replace(&mut s.borrow_mut().error, SUCCESS))
}

/// A collective inside a group.
pub fn collective(args: Args) -> NcclResult {
    let first = STATE.with(|s| {
        let s = s.borrow();
        s.real == 0 && s.held.is_none()
    });
    if first && coll::ours(&args).is_ok() {
        STATE.with(|s| s.borrow_mut().held = Some(args));
        return SUCCESS;
    }
    let r = open_real();
    if r != SUCCESS {
        return r;
    }
    coll::forward(&args, "inside a group")
}

/// Called when this thread's outermost group ends with `result`: the communicators made in
/// it are complete now. Several at once are ranks of one process (several GPUs per thread),
/// whose all-gathers would wait on each other: those stay NCCL's.
fn group_ended(result: NcclResult) -> NcclResult {
    let pending = STATE.with(|s| std::mem::take(&mut s.borrow_mut().made));
    if result != SUCCESS || pending.is_empty() {
        return result;
    }
    if pending.len() > 1 {
        log::note(format_args!(
            "{} communicators made in one group (several GPUs per thread): every call forwarded",
            pending.len()
        ));
        return result;
    }
    let (comm, blocking, what) = &pending[0];
    crate::comm::accelerate_new(*comm as Comm, *blocking, &format!("{what} (grouped)"))
}

/// This thread's outermost group ended without running (`ncclGroupSimulateEnd`): the
/// communicators made in it are left to NCCL.
fn group_discarded() {
    STATE.with(|s| s.borrow_mut().made.clear());
}

/// `comm`, made inside this thread's open group (blocking or not, by the entry point `what`):
/// accelerated when the outermost group ends.
pub fn made_in_group(comm: Comm, blocking: bool, what: &str) {
    STATE.with(|s| {
        s.borrow_mut()
            .made
            .push((comm as usize, blocking, what.to_string()))
    });
}

entry! {
    fn ncclGroupStart / pncclGroupStart() -> NcclResult {
        log::forwarded("ncclGroupStart (deferred)");
        STATE.with(|s| s.borrow_mut().depth += 1);
        SUCCESS
    }

    fn ncclGroupSimulateEnd / pncclGroupSimulateEnd(sim: *mut std::ffi::c_void) -> NcclResult {
        // NCCL ends the group here too (estimating instead of launching): the real group is
        // opened (the held call handed to it, to be estimated) and closed by it.
        log::forwarded("ncclGroupSimulateEnd");
        let opened = if in_group() { open_real() } else { SUCCESS };
        let f = real_fn!(ncclGroupSimulateEnd(*mut std::ffi::c_void) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: the caller's info struct.
        let r = unsafe { f(sim) };
        let left = STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.depth = s.depth.saturating_sub(1);
            s.real = s.real.saturating_sub(1);
            s.depth
        });
        let r = if opened != SUCCESS { opened } else { r };
        if left == 0 {
            // The communicators made in a simulated group stay NCCL's (alike on every rank).
            group_discarded();
        }
        r
    }

    fn ncclGroupEnd / pncclGroupEnd() -> NcclResult {
        let (depth, real) = STATE.with(|s| {
            let s = s.borrow();
            (s.depth, s.real)
        });
        if depth == 0 || real == depth {
            // Unbalanced (NCCL's own error for it), or this level is open at the real NCCL.
            log::forwarded("ncclGroupEnd");
            let f = real_fn!(ncclGroupEnd() -> NcclResult, SYSTEM_ERROR);
            // SAFETY: no arguments.
            let r = unsafe { f() };
            let left = STATE.with(|s| {
                let mut s = s.borrow_mut();
                s.depth = s.depth.saturating_sub(1);
                s.real = s.real.saturating_sub(1);
                s.depth
            });
            let r = if r == SUCCESS { take_error() } else { r };
            return if depth > 0 && left == 0 { group_ended(r) } else { r };
        }
        // This level never reached NCCL.
        let (left, held) = STATE.with(|s| {
            let mut s = s.borrow_mut();
            s.depth -= 1;
            let held = if s.depth == 0 { s.held.take() } else { None };
            (s.depth, held)
        });
        if left > 0 {
            return SUCCESS;
        }
        let r = match take_error() {
            SUCCESS => held.map_or(SUCCESS, |h| coll::run(&h)),
            e => e,
        };
        group_ended(r)
    }
}
