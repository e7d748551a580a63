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

    /// Whether this kind of error means the communicator is dead wherever it arises (timeout,
    /// peer lost, mismatch, abort): only a new communicator can go on. Note that any error of
    /// a call the ranks make together (an argument error included) aborts the communicator on
    /// every rank (see `Communicator::is_aborted`); errors of calls no peer takes part in
    /// (`Communicator::host_buffer`, say) leave it usable.
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

    /// The same error under another numbering of the ranks (a communicator over a subset of
    /// the job numbers its ranks its own way): `rank` maps the rank that saw the error, `peer`
    /// the peer it names. Variants without a rank come back unchanged.
    pub fn map_ranks(
        mut self,
        rank: impl FnOnce(usize) -> usize,
        peer: impl FnOnce(usize) -> usize,
    ) -> Self {
        let (r, p) = self.ranks_mut();
        if let Some(r) = r {
            *r = rank(*r);
        }
        if let Some(p) = p {
            *p = peer(*p);
        }
        self
    }

    /// The rank that saw the error and the peer it names, where the variant has them. Every
    /// variant is listed so that a new one has to say which of its fields are ranks.
    fn ranks_mut(&mut self) -> (Option<&mut usize>, Option<&mut usize>) {
        match self {
            Error::Config(_) | Error::CudaUnavailable(_) | Error::Io { .. } => (None, None),
            Error::InvalidArgument { rank, .. }
            | Error::Aborted { rank, .. }
            | Error::Cuda { rank, .. }
            | Error::CudaDriver { rank, .. } => (Some(rank), None),
            Error::Bootstrap { rank, peer, .. } => (Some(rank), peer.as_mut()),
            Error::PeerLost { rank, peer, .. }
            | Error::Timeout { rank, peer, .. }
            | Error::Mismatch { rank, peer, .. }
            | Error::PeerAccess { rank, peer, .. } => (Some(rank), Some(peer)),
        }
    }

    /// The same error with `place` (where it happened, e.g. "inside node 1") in its text:
    /// after the operation, or after the detail where the operation is a fixed name.
    /// Argument errors (the caller's, wherever they are), peer-access errors (their two ranks
    /// place them), aborts (their reason is an earlier error, placed already) and the errors
    /// that belong to no rank come back unchanged.
    pub fn at_place(mut self, place: &str) -> Self {
        match &mut self {
            Error::Timeout { op, .. }
            | Error::Mismatch { op, .. }
            | Error::PeerLost { op, .. }
            | Error::Cuda { op, .. }
            | Error::CudaDriver { op, .. } => *op = format!("{op} ({place})"),
            Error::Bootstrap { detail, .. } => *detail = format!("{detail} ({place})"),
            Error::InvalidArgument { .. }
            | Error::PeerAccess { .. }
            | Error::Aborted { .. }
            | Error::Config(_)
            | Error::CudaUnavailable(_)
            | Error::Io { .. } => {}
        }
        self
    }
}

/// How an error names its flight record (see [`Error::with_flight_record`]).
const FLIGHT_NOTE: &str = " (flight record: ";

impl Error {
    /// The same error naming the file where this rank's flight recorder wrote its last calls
    /// (see `crate::flight`): after the detail or reason, or after the operation where the
    /// variant has no free text (timeouts, as [`Error::at_place`]).
    pub fn with_flight_record(mut self, path: &std::path::Path) -> Self {
        let note = format!("{FLIGHT_NOTE}{})", path.display());
        match &mut self {
            Error::Timeout { op, .. } | Error::Io { op, .. } => op.push_str(&note),
            Error::Config(detail)
            | Error::CudaUnavailable(detail)
            | Error::InvalidArgument { detail, .. }
            | Error::Bootstrap { detail, .. }
            | Error::PeerLost { detail, .. }
            | Error::Mismatch { detail, .. }
            | Error::Aborted { reason: detail, .. }
            | Error::Cuda { detail, .. }
            | Error::CudaDriver { detail, .. }
            | Error::PeerAccess { detail, .. } => detail.push_str(&note),
        }
        self
    }

    /// The flight record this error names, if it names one (the last one it names: an abort's
    /// reason may carry the first failing rank's).
    pub fn flight_record(&self) -> Option<std::path::PathBuf> {
        let text = self.to_string();
        let at = text.rfind(FLIGHT_NOTE)? + FLIGHT_NOTE.len();
        let end = text[at..].find(".jsonl)")? + ".jsonl".len();
        Some(std::path::PathBuf::from(&text[at..at + end]))
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

    /// Rank 1's all_reduce #3 waited for peer rank 2.
    fn timeout() -> Error {
        Error::Timeout {
            rank: 1,
            peer: 2,
            op: "all_reduce".into(),
            seq: 3,
            waited: Duration::from_secs(1),
        }
    }

    /// Rank 1 could not reach the rendezvous (no peer).
    fn connect_refused() -> Error {
        Error::Bootstrap {
            rank: 1,
            peer: None,
            op: "connect",
            detail: "refused".into(),
        }
    }

    /// One of each variant that names a rank: rank 1, peer 2 where there is a peer.
    fn with_ranks() -> Vec<Error> {
        vec![
            Error::invalid(1, "all_reduce", "null buffer pointer"),
            Error::Bootstrap {
                rank: 1,
                peer: Some(2),
                op: "exchange",
                detail: "closed".into(),
            },
            Error::PeerLost {
                rank: 1,
                peer: 2,
                op: "all_reduce".into(),
                detail: "EOF".into(),
            },
            timeout(),
            Error::Mismatch {
                rank: 1,
                peer: 2,
                op: "all_reduce".into(),
                seq: 3,
                detail: "count 1 vs 2".into(),
            },
            Error::Aborted {
                rank: 1,
                reason: "a peer died".into(),
            },
            Error::Cuda {
                rank: 1,
                op: "NCCL init".into(),
                detail: "x".into(),
            },
            driver(CUresult::CUDA_ERROR_INVALID_VALUE),
            Error::PeerAccess {
                rank: 1,
                peer: 2,
                op: "cuIpcOpenMemHandle",
                detail: "x".into(),
            },
        ]
    }

    #[test]
    fn map_ranks_renumbers_the_rank_and_the_peer_of_every_variant() {
        for e in with_ranks() {
            let before = e.to_string();
            let has_peer = before.contains("rank 2");
            let text = e.map_ranks(|r| r + 10, |p| p + 20).to_string();
            assert!(text.starts_with("rank 11: "), "{before} -> {text}");
            assert_eq!(text.contains("rank 22"), has_peer, "{before} -> {text}");
        }
        let mapped = timeout().map_ranks(|r| r + 10, |p| p + 20);
        assert!(matches!(
            mapped,
            Error::Timeout {
                rank: 11,
                peer: 22,
                seq: 3,
                ..
            }
        ));
        // A bootstrap error without a peer keeps none; errors without a rank keep their text.
        let no_peer = connect_refused().map_ranks(|r| r + 10, |_| panic!("no peer to map"));
        assert!(matches!(
            no_peer,
            Error::Bootstrap {
                rank: 11,
                peer: None,
                ..
            }
        ));
        let unranked = [
            Error::Config("IPCREDUCE_X is not a number".into()),
            Error::CudaUnavailable("no driver".into()),
            Error::io("read", std::io::Error::other("x")),
        ];
        for e in unranked {
            let before = e.to_string();
            let after = e.map_ranks(|_| panic!("no rank"), |_| panic!("no peer"));
            assert_eq!(after.to_string(), before);
        }
    }

    #[test]
    fn at_place_names_the_place_after_the_operation_or_the_detail() {
        let e = timeout().at_place("inside node 4");
        assert!(
            e.to_string().contains("all_reduce (inside node 4) #3"),
            "{e}"
        );
        let b = connect_refused().at_place("inside node 4");
        assert!(b.to_string().ends_with("refused (inside node 4)"), "{b}");
        let arg = Error::invalid(1, "all_reduce", "null buffer pointer");
        let before = arg.to_string();
        assert_eq!(arg.at_place("inside node 4").to_string(), before);
    }
}
