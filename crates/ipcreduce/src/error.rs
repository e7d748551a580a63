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

    /// A CUDA driver, NVRTC or NCCL call failed.
    #[error("rank {rank}: {op} failed: {detail}")]
    Cuda {
        rank: usize,
        op: String,
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

    pub fn invalid(rank: usize, op: &'static str, detail: impl Into<String>) -> Self {
        Error::InvalidArgument {
            rank,
            op,
            detail: detail.into(),
        }
    }
}
