//! Where a rank learns who it is: ipcreduce's own variables, or torchrun's.

use crate::error::{Error, Result};
use std::path::PathBuf;

/// Identity of this process in its job.
#[derive(Debug, Clone)]
pub struct RankInfo {
    pub rank: usize,
    pub world: usize,
    /// Index of this rank among the ranks of this host (selects the GPU).
    pub local_rank: usize,
    /// The job's rendezvous socket.
    pub socket: PathBuf,
    /// Identifies the job; ranks of another job are refused.
    pub job_id: String,
    /// Per-job secret handed out by `ipcreduce launch`; None when started by another launcher.
    pub secret: Option<String>,
}

impl RankInfo {
    /// Reads `IPCREDUCE_RANK`/`IPCREDUCE_WORLD_SIZE`/`IPCREDUCE_LOCAL_RANK`/`IPCREDUCE_SOCKET`/
    /// `IPCREDUCE_JOB_ID`/`IPCREDUCE_SECRET`, falling back to torchrun's `RANK`/`WORLD_SIZE`/
    /// `LOCAL_RANK` (socket derived from the job id).
    pub fn from_env() -> Result<RankInfo> {
        Err(Error::Config("RankInfo::from_env not implemented".into()))
    }
}
