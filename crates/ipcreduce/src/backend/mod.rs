//! Data planes. Each backend implements [`BackendOps`]; [`crate::Communicator`] picks the
//! algorithm (see [`crate::plan`]) and hands the call to its backend.

pub mod cuda;
pub mod host;

use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::plan::PathInfo;
use crate::types::{Algorithm, BackendKind, DType, ReduceOp};
use std::ffi::c_void;

/// A collective operation, for stamps, errors and the backends' entry points.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SgOp {
    AllReduce,
    ReduceScatter,
    AllGather,
    /// All-reduce + residual add + RMSNorm in one call (see [`crate::fused`]).
    AddRmsNorm,
}

impl SgOp {
    pub const ALL: [SgOp; 4] = [
        SgOp::AllReduce,
        SgOp::ReduceScatter,
        SgOp::AllGather,
        SgOp::AddRmsNorm,
    ];

    /// The name errors use.
    pub fn name(self) -> &'static str {
        match self {
            SgOp::AllReduce => "all_reduce",
            SgOp::ReduceScatter => "reduce_scatter",
            SgOp::AllGather => "all_gather",
            SgOp::AddRmsNorm => "all_reduce_add_rms_norm",
        }
    }

    /// Its code in call stamps.
    pub fn code(self) -> u32 {
        match self {
            SgOp::AllReduce => 0,
            SgOp::ReduceScatter => 1,
            SgOp::AllGather => 2,
            SgOp::AddRmsNorm => 3,
        }
    }
}

/// Handle of a test/benchmark buffer owned by a backend (`test-support`).
#[cfg(feature = "test-support")]
pub type BufId = usize;

/// One all-reduce call on backend-owned buffers, as the backends see it (algorithm already
/// resolved; `test-support`).
#[cfg(feature = "test-support")]
#[derive(Debug, Clone, Copy)]
pub struct Call {
    pub send: BufId,
    pub recv: BufId,
    pub count: usize,
    pub dtype: DType,
    pub op: ReduceOp,
    pub algo: Algorithm,
    /// Bytes from the start of both buffers where the data begins (a multiple of the element
    /// size): exercises pointers that are not 16-byte aligned.
    pub offset: usize,
}

/// A buffer every rank registered together ([`crate::Communicator::alloc`] or `register`):
/// all-reduce calls whose send and recv lie in registered buffers read and write them directly,
/// with no staging copy. Freed by [`crate::Communicator::free`] (collective) or when the
/// communicator is dropped. It carries the identity of the communicator that made it, so
/// another communicator refuses to free it.
#[derive(Debug, PartialEq, Eq)]
pub struct RegisteredBuffer {
    ptr: u64,
    bytes: usize,
    id: u64,
    /// The making communicator's process-unique token (0 until the communicator sets it).
    owner: u64,
}

impl RegisteredBuffer {
    pub(crate) fn new(ptr: u64, bytes: usize, id: u64) -> Self {
        RegisteredBuffer {
            ptr,
            bytes,
            id,
            owner: 0,
        }
    }
    /// The buffer marked as made by the communicator with `token`.
    pub(crate) fn owned_by(mut self, token: u64) -> Self {
        self.owner = token;
        self
    }
    pub(crate) fn is_owned_by(&self, token: u64) -> bool {
        self.owner == token
    }
    /// Device address of the buffer in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    pub(crate) fn id(&self) -> u64 {
        self.id
    }
}

/// The error of the registered-buffer calls on a backend without them.
pub(crate) fn needs_cuda(rank: usize, op: &'static str) -> Error {
    Error::invalid(
        rank,
        op,
        "registered device buffers need the cuda backend (the host backend's zero-copy buffers come from host_buffer)",
    )
}

/// Facts about a backend for reports.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct BackendMeta {
    pub devices: Vec<String>,
    pub driver: Option<String>,
    pub nccl_version: Option<String>,
    /// cuda: why `auto` staged through host memory (the failed pair and check), if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback: Option<Fallback>,
}

/// The pair whose start-up check made `auto` take the host-staged transport.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Fallback {
    /// The rank that saw the failure, and the rank it could not use (itself: its own setup).
    pub rank: usize,
    pub peer: usize,
    /// The check ("P2P query", "workspace mapping", "cross-process read") and what it said.
    pub check: String,
    pub detail: String,
}

/// What a backend offers the communicator.
pub trait BackendOps: Send {
    fn kind(&self) -> BackendKind;

    /// The concrete backend, for the few calls that only one backend offers.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;

    /// Enqueues (cuda) or runs (host) one all-reduce. `algo` is never `Auto`.
    ///
    /// # Safety
    /// `send` and `recv` must be valid for `count * dtype.size()` bytes in the backend's
    /// address space (device pointers for cuda); they may be equal (in place) but must not
    /// otherwise overlap. `stream` is a `CUstream` (null = the communicator's own stream) for
    /// cuda and ignored by host.
    #[allow(clippy::too_many_arguments)]
    unsafe fn all_reduce_raw(
        &mut self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
        stream: *mut c_void,
    ) -> Result<()>;

    /// Enqueues (cuda) or runs (host) one reduce-scatter (`what`: send holds `shards.total`
    /// elements, recv this rank's shard) or all-gather (send this rank's shard, recv
    /// `shards.total`). Arguments were checked by the communicator.
    ///
    /// # Safety
    /// As [`BackendOps::all_reduce_raw`], for those sizes; the in-place forms are NCCL's
    /// (recv = send + shard start for reduce-scatter, send = recv + shard start for all-gather).
    #[allow(clippy::too_many_arguments)]
    unsafe fn scatter_gather_raw(
        &mut self,
        what: SgOp,
        send: *const c_void,
        recv: *mut c_void,
        shards: crate::shards::Shards,
        dtype: DType,
        op: ReduceOp,
        stream: *mut c_void,
    ) -> Result<()>;

    /// Enqueues (cuda) or runs (host) one fused all-reduce + residual add + RMSNorm. `algo` is
    /// `OneShot` or `TwoShot`; the arguments were checked by the communicator
    /// ([`crate::fused::check`]).
    ///
    /// # Safety
    /// As [`crate::Communicator::all_reduce_add_rms_norm_raw`].
    unsafe fn add_rms_norm_raw(
        &mut self,
        args: &crate::fused::AddRmsNorm,
        algo: Algorithm,
        stream: *mut c_void,
    ) -> Result<()>;

    /// Why `algo` cannot run here, if it cannot (e.g. NCCL refused two ranks on one GPU).
    fn unavailable(&self, algo: Algorithm) -> Option<String>;

    fn meta(&self) -> BackendMeta;

    /// Waits until all enqueued work is finished.
    fn synchronize(&mut self) -> Result<()>;

    /// The error that made the communicator unusable, or one a kernel recorded, if any,
    /// without waiting (as `ncclCommGetAsyncError`).
    fn async_error(&self) -> Option<Error>;

    /// What the data crosses (see [`crate::plan::Fabric`]).
    fn fabric(&self) -> crate::plan::Fabric {
        crate::plan::Fabric::Peer
    }

    /// cuda: the GPU ordinal this communicator runs on.
    fn device(&self) -> Option<usize> {
        None
    }

    /// cuda: the communicator's own stream (a `CUstream`), for callers that have none.
    fn own_stream(&self) -> Option<*mut c_void> {
        None
    }

    /// Collective part of leaving the job, run before the backend is dropped (with the
    /// bootstrap still connected). Bounded; never fails (problems are logged).
    fn leave(&mut self, _boot: &mut Bootstrap) {}

    // --- registered (zero-copy) buffers: collective, `boot` reaches every rank -----------
    fn alloc_registered(&mut self, boot: &mut Bootstrap, bytes: usize) -> Result<RegisteredBuffer> {
        let _ = bytes;
        Err(needs_cuda(boot.rank(), "alloc"))
    }
    /// # Safety
    /// `[ptr, ptr + bytes)` must stay allocated until the buffer is freed.
    unsafe fn register(
        &mut self,
        boot: &mut Bootstrap,
        ptr: u64,
        bytes: usize,
    ) -> Result<RegisteredBuffer> {
        let _ = (ptr, bytes);
        Err(needs_cuda(boot.rank(), "register"))
    }
    fn free_registered(&mut self, boot: &mut Bootstrap, buf: RegisteredBuffer) -> Result<()> {
        let _ = buf;
        Err(needs_cuda(boot.rank(), "free"))
    }
    /// The path of the last call issued, where the backend has several.
    fn last_path(&self) -> Option<PathInfo> {
        None
    }
    /// Whether a call on `send` and `recv` would run zero-copy: both lie in registered buffers
    /// (`Auto` has its own size rule for them).
    fn zero_copy_call(&self, send: u64, recv: u64, bytes: usize) -> bool {
        let _ = (send, recv, bytes);
        false
    }
    /// Whether the all-reduce of these arguments (`algo` resolved), made now, runs a kernel
    /// that stamps its phases on the device (cuda, while tracing): the flight recorder's
    /// device timeline then takes its span from the stamps and records no events around it.
    fn stamps_all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
    ) -> bool {
        let _ = (send, recv, count, dtype, op, algo);
        false
    }
    /// Whether a reduce-scatter or all-gather of `total` elements over all shards, made now,
    /// runs a kernel that stamps its phases (as [`Self::stamps_all_reduce`]).
    fn stamps_scatter_gather(&self, total: usize) -> bool {
        let _ = total;
        false
    }
    /// Whether the fused call of shape `s` (elements of `size` bytes, `algo` chosen), made
    /// now, runs a kernel that stamps its phases (as [`Self::stamps_all_reduce`]).
    fn stamps_fused(&self, s: &crate::fused::Shape, size: usize, algo: Algorithm) -> bool {
        let _ = (s, size, algo);
        false
    }
    /// The tuning table every rank agreed on, for the CTA counts it measured.
    fn use_tuning(&mut self, table: &crate::tune::Table) {
        let _ = table;
    }
}

/// Backend-owned buffers and timing, for the benchmark and the correctness sweeps: not part
/// of the data plane, compiled only with the `test-support` feature.
#[cfg(feature = "test-support")]
pub trait TestBuffers {
    fn alloc(&mut self, bytes: usize) -> Result<BufId>;
    fn free(&mut self, id: BufId);
    fn write(&mut self, id: BufId, data: &[u8]) -> Result<()>;
    fn read(&mut self, id: BufId, out: &mut [u8]) -> Result<()>;
    /// Whether `call`'s send and recv are both registered (zero-copy) buffers, so that `Auto`
    /// follows the zero-copy rule for it as a public call on those buffers would.
    fn zero_copy(&mut self, call: &Call) -> bool {
        let _ = call;
        false
    }
    /// Runs `call` on the backend's own buffers.
    fn run(&mut self, call: &Call) -> Result<()>;
    /// Mean time of one call in microseconds over `iters` calls after `warmup`.
    /// `graph = Some(k)`: capture k calls in a CUDA graph and time its replays instead.
    fn time(
        &mut self,
        call: &Call,
        warmup: usize,
        iters: usize,
        graph: Option<usize>,
    ) -> Result<f64>;
}
