//! Communicator life: the ipcreduce communicator made beside NCCL's, and the entry points
//! that create, end and query communicators.
//!
//! After the real NCCL has made a communicator, every rank contributes a small record
//! ([`rendezvous`]) to an all-gather through that very communicator: whether it can run
//! ipcreduce, which machine it is on, and rank 0's random rendezvous name and secret. If every
//! rank can and all share one machine, they make an ipcreduce communicator (cuda backend)
//! over a Unix socket named by rank 0's nonce, then all-gather again whether that worked:
//! only if it did on every rank is the communicator accelerated, so all ranks always take the
//! same path for the same call.

use crate::avg::Scaler;
use crate::errors::{self, Slot};
use crate::log;
use crate::types::*;
use ipcreduce::{AbortHandle, Communicator, Error};
use std::ffi::{c_char, c_int};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

pub mod rendezvous;

/// An accelerated communicator.
pub struct Accel {
    pub rank: usize,
    pub world: usize,
    pub comm: Mutex<Communicator>,
    /// Reaches the communicator without its lock (abort and async errors from a watchdog).
    pub abort: AbortHandle,
    /// The last error of ours on it, for `ncclGetLastError`.
    pub error: Slot,
    /// The kernels of `ncclAvg`'s division, loaded at its first call.
    pub scaler: OnceLock<Result<Scaler, String>>,
}

impl Accel {
    /// Records `e` and returns the NCCL code for it.
    pub fn fail(&self, e: &Error) -> NcclResult {
        self.error.set(&format!("ipcreduce-nccl: {e}"));
        code_of(e)
    }

    /// Divides the `count` elements of `dt` at `p` by the world size, on `stream`.
    ///
    /// # Safety
    /// `p` is device memory of the communicator's context, current on this thread.
    pub unsafe fn divide(
        &self,
        p: *mut std::ffi::c_void,
        count: usize,
        dt: ipcreduce::DType,
        stream: Stream,
    ) -> ipcreduce::Result<()> {
        let scaler = self.scaler.get_or_init(|| Scaler::load(self.rank));
        let done = match scaler {
            // SAFETY: the caller's contract.
            Ok(s) => unsafe { s.launch(p, count, dt, self.world, stream, self.rank) },
            Err(e) => Err(e.clone()),
        };
        done.map_err(|detail| Error::Cuda {
            rank: self.rank,
            op: "ncclAvg".into(),
            detail,
        })
    }
}

/// NCCL's code for one of our errors: what NCCL returns for the same kind of failure.
pub fn code_of(e: &Error) -> NcclResult {
    match e {
        Error::InvalidArgument { .. } => INVALID_ARGUMENT,
        Error::Mismatch { .. } | Error::Config(_) => INVALID_USAGE,
        Error::PeerLost { .. } | Error::Timeout { .. } | Error::Aborted { .. } => REMOTE_ERROR,
        Error::Cuda { .. } | Error::CudaDriver { .. } | Error::CudaUnavailable(_) => {
            UNHANDLED_CUDA_ERROR
        }
        Error::Io { .. } | Error::Bootstrap { .. } => SYSTEM_ERROR,
        _ => INTERNAL_ERROR,
    }
}

/// NCCL communicator (address) -> ours. Few communicators live at once: a list will do.
static COMMS: RwLock<Vec<(usize, Arc<Accel>)>> = RwLock::new(Vec::new());

/// The accelerated communicator behind `comm`, if any.
pub fn lookup(comm: Comm) -> Option<Arc<Accel>> {
    let list = COMMS.read().unwrap_or_else(|p| p.into_inner());
    list.iter()
        .find(|(c, _)| *c == comm as usize)
        .map(|(_, a)| a.clone())
}

fn remove(comm: Comm) -> Option<Arc<Accel>> {
    let mut list = COMMS.write().unwrap_or_else(|p| p.into_inner());
    let i = list.iter().position(|(c, _)| *c == comm as usize)?;
    Some(list.swap_remove(i).1)
}

fn insert(comm: Comm, a: Accel) {
    let mut list = COMMS.write().unwrap_or_else(|p| p.into_inner());
    list.push((comm as usize, Arc::new(a)));
}

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
    if crate::group::in_group() {
        // A grouped init completes at ncclGroupEnd: our all-gathers through it wait till then.
        PENDING.with(|p| {
            p.borrow_mut()
                .push((comm as usize, blocking, what.to_string()))
        });
        return r;
    }
    accelerate_new(comm, blocking, what)
}

thread_local! {
    /// Communicators initialised inside this thread's open group: (address, blocking, call).
    static PENDING: std::cell::RefCell<Vec<(usize, bool, String)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Called when this thread's outermost group ends with `result`: the communicators made in
/// it are complete now. Several at once are ranks of one process (several GPUs per thread),
/// whose all-gathers would wait on each other: those stay NCCL's.
pub fn group_ended(result: NcclResult) -> NcclResult {
    let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
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
    accelerate_new(*comm as Comm, *blocking, &format!("{what} (grouped)"))
}

/// This thread's outermost group ended without running (`ncclGroupSimulateEnd`): the
/// communicators made in it are left to NCCL.
pub fn group_discarded() {
    PENDING.with(|p| p.borrow_mut().clear());
}

/// Makes the ipcreduce communicator for the complete NCCL communicator `comm`.
fn accelerate_new(comm: Comm, blocking: bool, what: &str) -> NcclResult {
    if !blocking {
        // Its init may still run: a collective through it now could not be waited for here.
        log::note(format_args!(
            "{what}: a non-blocking communicator: every call forwarded"
        ));
        return SUCCESS;
    }
    let made = std::panic::catch_unwind(|| rendezvous::accelerate(comm)).unwrap_or_else(|_| {
        Err((
            INTERNAL_ERROR,
            format!("ipcreduce-nccl: {what}: panicked while making the ipcreduce communicator"),
        ))
    });
    match made {
        Ok(Some(a)) => {
            log::note_rank(
                a.rank,
                format_args!(
                    "{what}: rank {} of {}: ipcreduce communicator ready",
                    a.rank, a.world
                ),
            );
            insert(comm, a);
            SUCCESS
        }
        Ok(None) => SUCCESS,
        Err((code, msg)) => {
            errors::set_global(&msg);
            code
        }
    }
}

entry! {
    fn ncclCommInitRank / pncclCommInitRank(out: *mut Comm, nranks: c_int, id: UniqueId, rank: c_int) -> NcclResult {
        // Inside a group NCCL must see the group first (several inits per thread).
        crate::group::before_other("ncclCommInitRank");
        if let Err(r) = check_mode() {
            return r;
        }
        let f = real_fn!(ncclCommInitRank(*mut Comm, c_int, UniqueId, c_int) -> NcclResult, SYSTEM_ERROR);
        // SAFETY: the caller's arguments, unchanged; then our slot check.
        unsafe { after_init(f(out, nranks, id, rank), out, true, "ncclCommInitRank") }
    }

    fn ncclCommInitRankConfig / pncclCommInitRankConfig(out: *mut Comm, nranks: c_int, id: UniqueId, rank: c_int, config: *mut std::ffi::c_void) -> NcclResult {
        // Inside a group NCCL must see the group first (several inits per thread).
        crate::group::before_other("ncclCommInitRankConfig");
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
        crate::group::before_other("ncclCommInitRankScalable");
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
        crate::group::before_other("ncclCommSplit");
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
        crate::group::before_other("ncclCommShrink");
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
        crate::group::before_other("ncclCommDestroy");
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
        crate::group::before_other("ncclCommFinalize");
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
        crate::group::before_other("ncclCommAbort");
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
        crate::group::before_other("ncclCommRevoke");
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

/// Non-blocking communicators (addresses): their splits and shrinks without a config are too.
static NON_BLOCKING: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Whether a split or shrink of `parent` is blocking when it has no config of its own.
fn lookup_blocking(parent: Comm) -> bool {
    let list = NON_BLOCKING.lock().unwrap_or_else(|p| p.into_inner());
    !list.contains(&(parent as usize))
}

fn mark_non_blocking(comm: Comm, non_blocking: bool) {
    let mut list = NON_BLOCKING.lock().unwrap_or_else(|p| p.into_inner());
    list.retain(|c| *c != comm as usize);
    if non_blocking {
        list.push(comm as usize);
    }
}
