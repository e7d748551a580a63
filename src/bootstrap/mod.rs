//! Control plane: ranks of one host meet over a Unix domain socket.
//!
//! Rank 0 listens on the job's socket; the others connect, prove they belong to the job
//! (same uid via SO_PEERCRED, the per-job secret) and say hello (rank, world size, job id).
//! Over these connections the ranks then exchange small byte blobs (all-gather), file
//! descriptors (SCM_RIGHTS) and barriers. A second connection per rank carries only liveness:
//! when a process dies, rank 0 notices the closed connection and tells the survivors, whose
//! [`AbortState`] is then set.

mod env;
pub use env::RankInfo;

use crate::abort::AbortState;
use crate::error::Result;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

/// A connected group of ranks.
pub struct Bootstrap {
    info: RankInfo,
    abort: Arc<AbortState>,
}

impl Bootstrap {
    /// Joins the job described by `info`. Every wait is bounded by `timeout`.
    pub fn connect(info: RankInfo, timeout: Duration) -> Result<Bootstrap> {
        let _ = timeout;
        Ok(Bootstrap {
            info,
            abort: AbortState::new(),
        })
    }

    pub fn rank(&self) -> usize {
        self.info.rank
    }

    pub fn world(&self) -> usize {
        self.info.world
    }

    pub fn info(&self) -> &RankInfo {
        &self.info
    }

    /// The communicator's abort state; the liveness watcher sets it when a peer dies.
    pub fn abort_state(&self) -> Arc<AbortState> {
        self.abort.clone()
    }

    /// Every rank contributes `mine`; returns all contributions indexed by rank.
    pub fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let _ = mine;
        todo!("bootstrap all_gather")
    }

    /// Every rank contributes one file descriptor; returns one fd per rank (own = a dup).
    pub fn all_gather_fds(&mut self, mine: BorrowedFd<'_>) -> Result<Vec<OwnedFd>> {
        let _ = mine;
        todo!("bootstrap all_gather_fds")
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<()> {
        todo!("bootstrap barrier")
    }
}
