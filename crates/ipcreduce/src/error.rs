//! The one error type of the library. Every variant that concerns a collective names the rank
//! that saw it, the peer involved (when there is one) and the operation.

use std::time::Duration;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Missing or contradictory configuration (environment variables, CLI flags).
    #[error("configuration error: {0}")]
    Config(String),

    /// A caller passed something unusable (null pointer, bad count, unsupported dtype...).
    #[error("rank {rank}: invalid argument to {op}: {detail}")]
    InvalidArgument {
        rank: usize,
        op: &'static str,
        detail: String,
    },

    /// The control plane (Unix socket rendezvous) failed.
    #[error("rank {rank}: bootstrap {op} failed{}: {detail}", peer_suffix(*.peer))]
    Bootstrap {
        rank: usize,
        peer: Option<usize>,
        op: &'static str,
        detail: String,
    },

    /// A peer process died or closed its connection.
    #[error("rank {rank}: peer rank {peer} is gone (during {op}): {detail}")]
    PeerLost {
        rank: usize,
        peer: usize,
        op: String,
        detail: String,
    },

    /// A bounded wait expired.
    #[error("rank {rank}: {op} #{seq} timed out after {waited:?} waiting for peer rank {peer}")]
    Timeout {
        rank: usize,
        peer: usize,
        op: String,
        seq: u64,
        waited: Duration,
    },

    /// Ranks called the same collective with different arguments.
    #[error("rank {rank}: {op} #{seq} does not match peer rank {peer}: {detail}")]
    Mismatch {
        rank: usize,
        peer: usize,
        op: String,
        seq: u64,
        detail: String,
    },

    /// The communicator was aborted earlier (peer death, timeout) and can no longer be used.
    #[error("rank {rank}: communicator is aborted: {reason}")]
    Aborted { rank: usize, reason: String },

    /// The CUDA backend cannot be used on this machine (no driver, no GPU, no NVRTC...).
    #[error("CUDA backend unavailable: {0}")]
    CudaUnavailable(String),

    /// An NVRTC or NCCL call, or a CUDA step without a driver result code, failed.
    #[error("rank {rank}: {op} failed: {detail}")]
    Cuda {
        rank: usize,
        op: String,
        detail: String,
    },

    /// A CUDA driver call failed with `code` (see [`Error::is_out_of_memory`]).
    #[error("rank {rank}: {op} failed: {detail}")]
    CudaDriver {
        rank: usize,
        op: String,
        code: cudarc::driver::sys::CUresult,
        /// The driver's name and description of `code`.
        detail: String,
    },

    /// Peer-to-peer access or a cross-process mapping does not work between two GPUs/ranks.
    #[error("rank {rank}: peer access to rank {peer} failed ({op}): {detail}")]
    PeerAccess {
        rank: usize,
        peer: usize,
        op: &'static str,
        detail: String,
    },

    #[error("I/O error during {op}: {source}")]
    Io {
        op: String,
        #[source]
        source: std::io::Error,
    },
}

fn peer_suffix(peer: Option<usize>) -> String {
    match peer {
        Some(p) => format!(" with rank {p}"),
        None => String::new(),
    }
}

impl Error {
    pub fn io(op: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            op: op.into(),
            source,
        }
    }

    /// The CUDA driver's result code, when a driver call failed.
    pub fn cuda_code(&self) -> Option<cudarc::driver::sys::CUresult> {
        match self {
            Error::CudaDriver { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the device ran out of memory: the caller may free memory and retry.
    pub fn is_out_of_memory(&self) -> bool {
        self.cuda_code() == Some(cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    }

    /// Whether the communicator is dead after this error (timeout, peer lost, mismatch,
    /// abort): only a new communicator can go on. Argument errors leave it usable.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. }
                | Error::PeerLost { .. }
                | Error::Mismatch { .. }
                | Error::Aborted { .. }
        )
    }

    pub fn invalid(rank: usize, op: &'static str, detail: impl Into<String>) -> Self {
        Error::InvalidArgument {
            rank,
            op,
            detail: detail.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;

    fn driver(code: CUresult) -> Error {
        Error::CudaDriver {
            rank: 1,
            op: "cuMemAlloc(4096 bytes)".into(),
            code,
            detail: format!("{code:?}"),
        }
    }

    #[test]
    fn out_of_memory_is_told_apart() {
        let oom = driver(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        assert!(oom.is_out_of_memory());
        assert_eq!(oom.cuda_code(), Some(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(oom.to_string().contains("rank 1") && oom.to_string().contains("cuMemAlloc"));
        assert!(!driver(CUresult::CUDA_ERROR_INVALID_VALUE).is_out_of_memory());
        let text_only = Error::Cuda {
            rank: 0,
            op: "NCCL init".into(),
            detail: "out of memory".into(),
        };
        assert!(!text_only.is_out_of_memory());
        assert_eq!(text_only.cuda_code(), None);
    }

    #[test]
    fn fatal_errors_are_the_ones_that_kill_the_communicator() {
        let aborted = Error::Aborted {
            rank: 0,
            reason: "rank 2 died".into(),
        };
        assert!(aborted.is_fatal());
        assert!(!Error::invalid(0, "all_reduce", "null buffer pointer").is_fatal());
        assert!(!driver(CUresult::CUDA_ERROR_OUT_OF_MEMORY).is_fatal());
    }
}
