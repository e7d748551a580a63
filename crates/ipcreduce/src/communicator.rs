//! The public entry point: a communicator over the ranks of one job.

use crate::backend::{self, BackendMeta, BackendOps, BufId, Call};
use crate::bootstrap::{Bootstrap, RankInfo};
use crate::element::{as_bytes, as_bytes_mut, Element};
use crate::error::{Error, Result};
use crate::plan;
use crate::types::{Algorithm, BackendChoice, BackendKind, DType, ReduceOp};
use std::ffi::c_void;
use std::time::Duration;

/// How a communicator is built.
#[derive(Debug, Clone)]
pub struct Options {
    pub backend: BackendChoice,
    /// Bound on every wait (bootstrap and collectives). `IPCREDUCE_TIMEOUT_MS` overrides.
    pub timeout: Duration,
    /// Bytes of shared workspace per rank (data area); messages above it are chunked.
    /// None = the backend's default.
    pub workspace_bytes: Option<usize>,
    /// Build an NCCL communicator beside ours (cuda backend), for `Algorithm::Nccl`.
    pub with_nccl: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            backend: BackendChoice::Auto,
            timeout: timeout_from_env().unwrap_or(Duration::from_secs(30)),
            workspace_bytes: None,
            with_nccl: false,
        }
    }
}

/// Reads `IPCREDUCE_TIMEOUT_MS`.
pub fn timeout_from_env() -> Option<Duration> {
    std::env::var("IPCREDUCE_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis)
}

/// A group of ranks that all-reduce together.
pub struct Communicator {
    // Field order matters: the backend (mappings of peers' memory) goes before the bootstrap
    // (connections) so a peer never sees us leave while we still use its memory.
    backend: Box<dyn BackendOps>,
    boot: Bootstrap,
    algo_env: Option<Algorithm>,
}

impl Communicator {
    /// Joins the job described by the environment (see [`RankInfo::from_env`]).
    pub fn init(opts: &Options) -> Result<Communicator> {
        Self::with_rank_info(RankInfo::from_env()?, opts)
    }

    /// Joins the job described by `info`.
    pub fn with_rank_info(info: RankInfo, opts: &Options) -> Result<Communicator> {
        let algo_env = Algorithm::from_env().map_err(Error::Config)?;
        let mut boot = Bootstrap::connect(info, opts.timeout)?;
        let kind = agree_on_backend(&mut boot, opts.backend)?;
        let backend: Box<dyn BackendOps> = match kind {
            BackendKind::Host => Box::new(backend::host::HostComm::new(&mut boot, opts)?),
            BackendKind::Cuda => Box::new(backend::cuda::CudaComm::new(&mut boot, opts)?),
        };
        Ok(Communicator {
            backend,
            boot,
            algo_env,
        })
    }

    pub fn rank(&self) -> usize {
        self.boot.rank()
    }

    pub fn world(&self) -> usize {
        self.boot.world()
    }

    pub fn backend(&self) -> BackendKind {
        self.backend.kind()
    }

    pub fn meta(&self) -> BackendMeta {
        self.backend.meta()
    }

    /// The bootstrap, for exchanging small control messages between ranks.
    pub fn bootstrap(&mut self) -> &mut Bootstrap {
        &mut self.boot
    }

    /// The algorithm a call of `bytes` bytes runs with `requested`.
    pub fn resolve(&self, requested: Algorithm, bytes: usize) -> Algorithm {
        plan::choose(
            requested,
            self.algo_env,
            self.backend(),
            self.world(),
            bytes,
        )
    }

    /// All-reduce on raw pointers: device pointers and a `CUstream` (null = the
    /// communicator's stream) for cuda, host pointers for host. This is what language
    /// bindings call. `send == recv` is the in-place form.
    ///
    /// # Safety
    /// Both pointers must be valid for `count * dtype.size()` bytes and must not overlap
    /// unless equal; on cuda they must belong to this communicator's device.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce_raw(
        &mut self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
        stream: *mut c_void,
    ) -> Result<()> {
        self.check_args(send, recv, count, dtype)?;
        if count == 0 {
            return Ok(());
        }
        let algo = self.resolve(algo, count * dtype.size());
        self.backend
            .all_reduce_raw(send, recv, count, dtype, op, algo, stream)
    }

    /// All-reduce of host slices (host backend).
    pub fn all_reduce_host<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<()> {
        self.require_host("all_reduce_host")?;
        if send.len() != recv.len() {
            return Err(Error::invalid(
                self.rank(),
                "all_reduce_host",
                format!("send has {} elements, recv {}", send.len(), recv.len()),
            ));
        }
        let (s, r) = (as_bytes(send), as_bytes_mut(recv));
        // SAFETY: both are live slices of the right length; &/&mut guarantee no overlap.
        unsafe {
            self.all_reduce_raw(
                s.as_ptr().cast(),
                r.as_mut_ptr().cast(),
                send.len(),
                T::DTYPE,
                op,
                algo,
                std::ptr::null_mut(),
            )
        }
    }

    /// In-place all-reduce of a host slice (host backend).
    pub fn all_reduce_host_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<()> {
        self.require_host("all_reduce_host_in_place")?;
        let b = as_bytes_mut(buf);
        let p = b.as_mut_ptr().cast::<c_void>();
        // SAFETY: one live slice used as both input and output.
        unsafe { self.all_reduce_raw(p, p, buf.len(), T::DTYPE, op, algo, std::ptr::null_mut()) }
    }

    /// `len` zeroed elements in this rank's shared arena (host backend). An all-reduce whose
    /// send buffer lies there (out of place, or in place) skips the copy into the workspace:
    /// peers read it directly. Allocate like a collective (same lengths, same order on every
    /// rank). The buffer stays valid after the communicator is dropped.
    pub fn host_buffer<T: Element>(&mut self, len: usize) -> Result<backend::host::HostBuffer<T>> {
        self.require_host("host_buffer")?;
        let rank = self.rank();
        match self
            .backend
            .as_any_mut()
            .downcast_mut::<backend::host::HostComm>()
        {
            Some(host) => host.host_buffer(len),
            None => Err(Error::invalid(
                rank,
                "host_buffer",
                "needs the host backend",
            )),
        }
    }

    fn require_host(&self, op: &'static str) -> Result<()> {
        if self.backend() != BackendKind::Host {
            return Err(Error::invalid(
                self.rank(),
                op,
                "host slices need the host backend; use all_reduce_raw with device pointers",
            ));
        }
        Ok(())
    }

    fn check_args(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        let rank = self.rank();
        if count == 0 {
            return Ok(());
        }
        if send.is_null() || recv.is_null() {
            return Err(Error::invalid(rank, "all_reduce", "null buffer pointer"));
        }
        let bytes = count
            .checked_mul(dtype.size())
            .filter(|b| *b <= isize::MAX as usize);
        let Some(bytes) = bytes else {
            return Err(Error::invalid(
                rank,
                "all_reduce",
                format!("count {count} of {dtype} overflows the address space"),
            ));
        };
        let (s, r) = (send as usize, recv as usize);
        if s % dtype.size() != 0 || r % dtype.size() != 0 {
            return Err(Error::invalid(
                rank,
                "all_reduce",
                format!("buffers must be aligned to the {dtype} element size"),
            ));
        }
        if s != r && s < r + bytes && r < s + bytes {
            return Err(Error::invalid(
                rank,
                "all_reduce",
                "send and recv overlap without being equal",
            ));
        }
        Ok(())
    }

    // --- buffers owned by the backend, for the benchmark and the checks ---------------

    pub fn unavailable(&self, algo: Algorithm) -> Option<String> {
        self.backend.unavailable(algo)
    }
    pub fn test_alloc(&mut self, bytes: usize) -> Result<BufId> {
        self.backend.alloc(bytes)
    }
    pub fn test_free(&mut self, id: BufId) {
        self.backend.free(id)
    }
    pub fn test_write(&mut self, id: BufId, data: &[u8]) -> Result<()> {
        self.backend.write(id, data)
    }
    pub fn test_read(&mut self, id: BufId, out: &mut [u8]) -> Result<()> {
        self.backend.read(id, out)
    }
    /// Runs one call on backend-owned buffers (algorithm resolved here).
    pub fn test_run(&mut self, call: &Call) -> Result<()> {
        let mut c = *call;
        c.algo = self.resolve(c.algo, c.count * c.dtype.size());
        self.backend.run(&c)
    }
    pub fn synchronize(&mut self) -> Result<()> {
        self.backend.synchronize()
    }
    /// Mean microseconds per call; see [`BackendOps::time`].
    pub fn test_time(
        &mut self,
        call: &Call,
        warmup: usize,
        iters: usize,
        graph: Option<usize>,
    ) -> Result<f64> {
        let mut c = *call;
        c.algo = self.resolve(c.algo, c.count * c.dtype.size());
        self.backend.time(&c, warmup, iters, graph)
    }
}

// --- registered (zero-copy) buffers and path reports (cuda data plane) ---------------------

impl Communicator {
    /// Collective (every rank, same size, same order): `bytes` of device memory that every peer
    /// maps. An all-reduce whose send and recv lie in registered buffers (at the same offsets on
    /// every rank) reads and writes them directly, with no staging copy; this also holds inside
    /// CUDA graphs. cuda backend only (the host backend's zero-copy buffers: [`Self::host_buffer`]).
    pub fn alloc(&mut self, bytes: usize) -> Result<crate::RegisteredBuffer> {
        self.backend.alloc_registered(&mut self.boot, bytes)
    }

    /// Collective: registers `[ptr, ptr + bytes)` of memory the caller allocated with
    /// `cuMemCreate` (POSIX fd handle type) and mapped; anything else is refused with an error
    /// that says how to allocate.
    ///
    /// # Safety
    /// The memory must stay allocated and mapped until the buffer is freed or the communicator
    /// is dropped.
    pub unsafe fn register(&mut self, ptr: u64, bytes: usize) -> Result<crate::RegisteredBuffer> {
        self.backend.register(&mut self.boot, ptr, bytes)
    }

    /// Collective: waits for this rank's work and for every rank (bounded), then unmaps. Buffers
    /// not freed are released when the communicator is dropped.
    pub fn free(&mut self, buf: crate::RegisteredBuffer) -> Result<()> {
        self.backend.free_registered(&mut self.boot, buf)
    }

    /// What the last all-reduce issued by this rank ran: path, CTAs, zero-copy or not.
    pub fn last_path(&self) -> Option<crate::PathInfo> {
        self.backend.last_path()
    }

    /// Collective: a registered backend-owned buffer for the benchmark and the checks (used
    /// like [`Self::test_alloc`]'s).
    pub fn test_alloc_registered(&mut self, bytes: usize) -> Result<BufId> {
        self.backend.alloc_test_registered(&mut self.boot, bytes)
    }
}

/// All ranks must run the same backend: each says what it can run, and `Auto` picks cuda only
/// if every rank can.
fn agree_on_backend(boot: &mut Bootstrap, choice: BackendChoice) -> Result<BackendKind> {
    let cuda_ok = match choice {
        BackendChoice::Host => false,
        _ => backend::cuda::usable().is_ok(),
    };
    let all = boot.all_gather(&[cuda_ok as u8])?;
    let everyone_cuda = all.iter().all(|v| v.first() == Some(&1));
    match choice {
        BackendChoice::Host => Ok(BackendKind::Host),
        BackendChoice::Auto => Ok(if everyone_cuda {
            BackendKind::Cuda
        } else {
            BackendKind::Host
        }),
        BackendChoice::Cuda => {
            backend::cuda::usable()?;
            if let Some(peer) = all.iter().position(|v| v.first() != Some(&1)) {
                return Err(Error::Bootstrap {
                    rank: boot.rank(),
                    peer: Some(peer),
                    op: "backend agreement",
                    detail: "the cuda backend was asked for but that rank cannot use CUDA".into(),
                });
            }
            Ok(BackendKind::Cuda)
        }
    }
}
