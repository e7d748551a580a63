//! The entry points that create, end and query communicators: each hands the call to the real
//! NCCL, and after a successful init makes the ipcreduce communicator beside it
//! ([`crate::comm`]; inside a group, at the group's end: [`crate::group`]).

use crate::comm::{accelerate_new, lookup, lookup_blocking, mark_non_blocking, remove};
use crate::errors;
use crate::group;
use crate::log;
use crate::types::*;
use std::ffi::{c_char, c_int};

/// A bad `IPCREDUCE_NCCL` refuses every new communicator (with the reason).
fn check_mode() -> Result<log::Mode, NcclResult> {
    log::mode().map_err(|e| {
        errors::set_global(e);
        INVALID_ARGUMENT
    })
}

/// What follows a real init: `r` is its result, `*out` the new communicator.
///
/// # Safety
/// `out` is null or the caller's communicator slot, which NCCL filled when `r` is success.
unsafe fn after_init(r: NcclResult, out: *mut Comm, blocking: bool, what: &str) -> NcclResult {
    if r != SUCCESS || out.is_null() {
        return r;
    }
    // SAFETY: filled by NCCL on success.
    let comm = unsafe { *out };
    if comm.is_null() || log::mode() == Ok(log::Mode::Off) {
        return r;
    }
    mark_non_blocking(comm, !blocking);
    if group::in_group() {
        // A grouped init completes at ncclGroupEnd: our all-gathers through it wait till then.
        group::made_in_group(comm, blocking, what);
        return r;
    }
    accelerate_new(comm, blocking, what)
}

entry! {
    fn ncclCommInitRank / pncclCommInitRank(out: *mut Comm, nranks: c_int, id: UniqueId, rank: c_int) -> NcclResult {
        // Inside a group NCCL must see the group first (several inits per thread).
        group::before_other("ncclCommInitRank");
        if let Err(r) = check_mode() {
            return r;
        }
        let f = real_fn!(ncclCommInitRank(*mut Comm, c_int, UniqueId, c_int) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: the caller's arguments, unchanged; then our slot check.
        unsafe { after_init(f(out, nranks, id, rank), out, true, "ncclCommInitRank") }
    }

    fn ncclCommInitRankConfig / pncclCommInitRankConfig(out: *mut Comm, nranks: c_int, id: UniqueId, rank: c_int, config: *mut std::ffi::c_void) -> NcclResult {
        // Inside a group NCCL must see the group first (several inits per thread).
        group::before_other("ncclCommInitRankConfig");
        if let Err(r) = check_mode() {
            return r;
        }
        let f = real_fn!(ncclCommInitRankConfig(*mut Comm, c_int, UniqueId, c_int, *mut std::ffi::c_void) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: as above; the config is the caller's initialised one.
        unsafe {
            let blocking = is_blocking(config);
            after_init(f(out, nranks, id, rank, config), out, blocking, "ncclCommInitRankConfig")
        }
    }

    fn ncclCommInitRankScalable / pncclCommInitRankScalable(out: *mut Comm, nranks: c_int, rank: c_int, nid: c_int, ids: *mut UniqueId, config: *mut std::ffi::c_void) -> NcclResult {
        // Inside a group NCCL must see the group first (several inits per thread).
        group::before_other("ncclCommInitRankScalable");
        if let Err(r) = check_mode() {
            return r;
        }
        let f = real_fn!(ncclCommInitRankScalable(*mut Comm, c_int, c_int, c_int, *mut UniqueId, *mut std::ffi::c_void) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: as above.
        unsafe {
            let blocking = is_blocking(config);
            after_init(f(out, nranks, rank, nid, ids, config), out, blocking, "ncclCommInitRankScalable")
        }
    }

    fn ncclCommSplit / pncclCommSplit(comm: Comm, color: c_int, key: c_int, out: *mut Comm, config: *mut std::ffi::c_void) -> NcclResult {
        // Inside a group NCCL must see the group first (several inits per thread).
        group::before_other("ncclCommSplit");
        if let Err(r) = check_mode() {
            return r;
        }
        let f = real_fn!(ncclCommSplit(Comm, c_int, c_int, *mut Comm, *mut std::ffi::c_void) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: as above; a rank that passes NCCL_SPLIT_NOCOLOR gets a null communicator,
        // which after_init leaves alone (it takes no part in the new one's all-gathers).
        unsafe {
            let blocking = if config.is_null() { lookup_blocking(comm) } else { is_blocking(config) };
            after_init(f(comm, color, key, out, config), out, blocking, "ncclCommSplit")
        }
    }

    fn ncclCommShrink / pncclCommShrink(comm: Comm, exclude: *mut c_int, nexclude: c_int, out: *mut Comm, config: *mut std::ffi::c_void, flags: c_int) -> NcclResult {
        // Inside a group NCCL must see the group first (several inits per thread).
        group::before_other("ncclCommShrink");
        if let Err(r) = check_mode() {
            return r;
        }
        let f = real_fn!(ncclCommShrink(Comm, *mut c_int, c_int, *mut Comm, *mut std::ffi::c_void, c_int) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: as above.
        unsafe {
            let blocking = if config.is_null() { lookup_blocking(comm) } else { is_blocking(config) };
            after_init(f(comm, exclude, nexclude, out, config, flags), out, blocking, "ncclCommShrink")
        }
    }

    fn ncclCommDestroy / pncclCommDestroy(comm: Comm) -> NcclResult {
        // Inside a group NCCL must see the group first (several inits per thread).
        group::before_other("ncclCommDestroy");
        // Ours goes first: its teardown waits for its work on the caller's streams, and the
        // peers' mappings are released before NCCL's connections close.
        drop(remove(comm));
        mark_non_blocking(comm, false);
        log::forwarded("ncclCommDestroy");
        let f = real_fn!(ncclCommDestroy(Comm) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: the caller's communicator.
        unsafe { f(comm) }
    }

    fn ncclCommFinalize / pncclCommFinalize(comm: Comm) -> NcclResult {
        group::before_other("ncclCommFinalize");
        log::forwarded("ncclCommFinalize");
        let f = real_fn!(ncclCommFinalize(Comm) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: the caller's communicator.
        let r = unsafe { f(comm) };
        // Ours holds no operation of its own to flush (its work is on the caller's streams),
        // but an error it had is the communicator's: finalize reports it, as NCCL does its own.
        match lookup(comm).and_then(|a| a.abort.error().map(|e| a.fail(&e))) {
            Some(ours) if r == SUCCESS => ours,
            _ => r,
        }
    }

    fn ncclCommAbort / pncclCommAbort(comm: Comm) -> NcclResult {
        // Inside a group NCCL must see the group first (several inits per thread).
        group::before_other("ncclCommAbort");
        if let Some(a) = remove(comm) {
            // Kernels and waits in flight poll the flag; the peers learn it at once.
            a.abort.abort(format!("ncclCommAbort on rank {}", a.rank));
            drop(a);
        }
        mark_non_blocking(comm, false);
        log::forwarded("ncclCommAbort");
        let f = real_fn!(ncclCommAbort(Comm) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: the caller's communicator.
        unsafe { f(comm) }
    }

    fn ncclCommRevoke / pncclCommRevoke(comm: Comm, flags: c_int) -> NcclResult {
        // Inside a group NCCL must see the group first (several inits per thread).
        group::before_other("ncclCommRevoke");
        if let Some(a) = lookup(comm) {
            a.abort.abort(format!("ncclCommRevoke on rank {}", a.rank));
        }
        log::forwarded("ncclCommRevoke");
        let f = real_fn!(ncclCommRevoke(Comm, c_int) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: the caller's communicator.
        unsafe { f(comm, flags) }
    }

    fn ncclCommGetAsyncError / pncclCommGetAsyncError(comm: Comm, err: *mut NcclResult) -> NcclResult {
        if let (Some(a), false) = (lookup(comm), err.is_null()) {
            if let Some(e) = a.abort.error() {
                // SAFETY: the caller's result slot, checked non-null.
                unsafe { *err = a.fail(&e) };
                return SUCCESS;
            }
        }
        let f = real_fn!(ncclCommGetAsyncError(Comm, *mut NcclResult) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: the caller's arguments.
        unsafe { f(comm, err) }
    }

    fn ncclGetLastError / pncclGetLastError(comm: Comm) -> *const c_char {
        if let Some(text) = lookup(comm).and_then(|a| a.error.get()) {
            return text;
        }
        // No communicator: the latest error of ours, as NCCL answers with its latest.
        if let (true, Some(text)) = (comm.is_null(), errors::last()) {
            return text;
        }
        let f = real_fn!(ncclGetLastError(Comm) -> *const c_char, errors::global().unwrap_or(c"".as_ptr()));
        // SAFETY: the caller's communicator.
        unsafe { f(comm) }
    }

    fn ncclGetErrorString / pncclGetErrorString(r: NcclResult) -> *const c_char {
        let f = real_fn!(ncclGetErrorString(NcclResult) -> *const c_char, error_string(r).as_ptr());
        // SAFETY: a plain value.
        unsafe { f(r) }
    }
}
