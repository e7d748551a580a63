//! Communicator life: the ipcreduce communicator made beside NCCL's (its entry points:
//! [`crate::comm_entries`]).
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
    /// NCCL windows (addresses) also registered with ipcreduce ([`crate::window`]).
    pub windows: Mutex<Vec<(usize, ipcreduce::RegisteredBuffer)>>,
}

impl Accel {
    /// Records `e` and returns the NCCL code for it.
    pub fn fail(&self, e: &Error) -> NcclResult {
        self.error.set(&format!("ipcreduce-nccl: {e}"));
        code_of(e)
    }

    /// After a panic inside one of our calls (`what`): the communicator aborted (peers learn it
    /// at once), the reason kept for `ncclGetLastError`, NCCL's internal error returned.
    pub fn panicked(&self, what: impl std::fmt::Display) -> NcclResult {
        let why = format!("rank {}: ipcreduce panicked in {what}", self.rank);
        self.abort.abort(why.clone());
        self.error.set(&format!("ipcreduce-nccl: {why}"));
        INTERNAL_ERROR
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

pub fn remove(comm: Comm) -> Option<Arc<Accel>> {
    let mut list = COMMS.write().unwrap_or_else(|p| p.into_inner());
    let i = list.iter().position(|(c, _)| *c == comm as usize)?;
    Some(list.swap_remove(i).1)
}

fn insert(comm: Comm, a: Accel) {
    let mut list = COMMS.write().unwrap_or_else(|p| p.into_inner());
    list.push((comm as usize, Arc::new(a)));
}

/// Makes the ipcreduce communicator for the complete NCCL communicator `comm`.
pub fn accelerate_new(comm: Comm, blocking: bool, what: &str) -> NcclResult {
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
                    "{what}: rank {} of {}: ipcreduce communicator ready ({})",
                    a.rank,
                    a.world,
                    crate::BUILD
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

/// Non-blocking communicators (addresses): their splits and shrinks without a config are too.
static NON_BLOCKING: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Whether a split or shrink of `parent` is blocking when it has no config of its own.
pub fn lookup_blocking(parent: Comm) -> bool {
    let list = NON_BLOCKING.lock().unwrap_or_else(|p| p.into_inner());
    !list.contains(&(parent as usize))
}

pub fn mark_non_blocking(comm: Comm, non_blocking: bool) {
    let mut list = NON_BLOCKING.lock().unwrap_or_else(|p| p.into_inner());
    list.retain(|c| *c != comm as usize);
    if non_blocking {
        list.push(comm as usize);
    }
}
