//! CUDA backend: one process per GPU (or several under MPS), peer memory through CUDA IPC.
//!
//! Start-up (once per communicator): pick the GPU (`local_rank % device count`), compile the
//! kernels with NVRTC, create and share the workspaces ([`workspace`]), check every pair of
//! ranks for real (P2P query + a cross-process write/read), optionally build NCCL beside us.
//! A call: validate, stamp nothing on the host, launch one kernel on the caller's stream. All
//! protocol state is on the device (see kernels/allreduce.cu), so calls can be graph-captured.

pub mod driver;
pub mod kernels;
pub mod memory;
mod nccl;
mod registry;
mod workspace;

use crate::abort::AbortState;
use crate::backend::{BackendMeta, BackendOps, BufId, Call, RegisteredBuffer};
use crate::bootstrap::Bootstrap;
use crate::communicator::Options;
use crate::error::{Error, Result};
use crate::plan::{CudaPath, GridLimits, PathInfo};
use crate::types::{Algorithm, BackendKind, DType, ReduceOp};
use cudarc::driver::{safe as cs, sys};
use driver::ck;
use kernels::{
    ERR_MISMATCH, ERR_TIMEOUT, LL_BYTES, LL_MAX_BYTES, MAX_BLOCKS, MAX_RANKS, SIG_BYTES,
};
use memory::{DeviceAlloc, MappedHostWords};
use registry::Registry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Weak};
use workspace::{ShareMode, Workspaces};

/// Default bytes of one data slot (the workspace holds two). Larger messages are chunked.
const DEFAULT_SLOT_BYTES: usize = 16 << 20;
/// Where the data slots start in a workspace: after the signal and LL areas.
const DATA_OFFSET: u64 = (SIG_BYTES + LL_BYTES) as u64;
/// Threads per block of the all-reduce kernels (their `__launch_bounds__`).
const THREADS: u32 = 512;
/// Most CTAs a kernel uses by default on a GPU of its own; ranks sharing a GPU share this
/// (every CTA of every rank must be resident at once: two 512-thread CTAs fit per SM).
const DEFAULT_CTA_CAP: usize = 64;
const SHARED_GPU_CTAS: usize = 192;

// Words of the host-mapped area shared with the kernels.
const W_ABORT: usize = 0;
// {code, peer, block, barrier, their stamp (2 words), ours (2 words), call number (2 words)}
const W_ERR: usize = 1;

/// Kernel arguments; must match `struct Args` in kernels/allreduce.cu field by field.
#[repr(C)]
#[derive(Clone, Copy)]
struct KernelArgs {
    send: u64,
    recv: u64,
    count: u64,
    data: [u64; MAX_RANKS],
    ll: [u64; MAX_RANKS],
    sig: [u64; MAX_RANKS],
    rsend: [u64; MAX_RANKS],
    rrecv: [u64; MAX_RANKS],
    counters: u64,
    abort_flag: u64,
    err: u64,
    host_err: u64,
    slot_bytes: u64,
    timeout_ns: u64,
    stamp: u64,
    seq: u64,
    rank: i32,
    world: i32,
    aligned: i32,
}

/// Whether this process can use the cuda backend (driver, a GPU, NVRTC).
pub fn usable() -> Result<()> {
    if !driver::driver_present() {
        return Err(Error::CudaUnavailable(
            "libcuda.so not found (no NVIDIA driver)".into(),
        ));
    }
    cudarc::driver::result::init()
        .map_err(|e| Error::CudaUnavailable(format!("cuInit failed: {e}")))?;
    let n = cs::CudaContext::device_count()
        .map_err(|e| Error::CudaUnavailable(format!("cuDeviceGetCount failed: {e}")))?;
    if n == 0 {
        return Err(Error::CudaUnavailable("no CUDA device visible".into()));
    }
    kernels::require_nvrtc()
}

pub struct CudaComm {
    // Declaration order is drop order: everything that needs the context goes before it.
    rank: usize,
    world: usize,
    ordinal: usize,
    device: sys::CUdevice,
    bufs: Vec<Option<TestBuf>>,
    registry: Registry,
    next_region: u64,
    last_path: Option<PathInfo>,
    nccl: std::result::Result<nccl::Nccl, String>,
    words: Arc<MappedHostWords>,
    /// Private device state: counters[MAX_BLOCKS][2], then the error word.
    state: DeviceAlloc,
    ws: Workspaces,
    limits: GridLimits,
    slot_bytes: usize,
    timeout: std::time::Duration,
    abort: Arc<AbortState>,
    devices: Vec<String>,
    /// Calls issued so far (for error messages).
    seq: u64,
    stream: Arc<cs::CudaStream>,
    ctx: Arc<cs::CudaContext>,
    gpu: Arc<Loaded>,
}

/// A GPU's context and the compiled kernels, made once per process and GPU: compiling with
/// NVRTC and loading the module cost seconds, and communicators may be created many times.
/// Kept for the life of the process.
struct Loaded {
    ctx: Arc<cs::CudaContext>,
    _module: Arc<cs::CudaModule>,
    funcs: HashMap<(CudaPath, DType, ReduceOp), cs::CudaFunction>,
}

/// A test/benchmark buffer: plain device memory, or registered (zero-copy) memory.
enum TestBuf {
    Plain(DeviceAlloc),
    Registered(RegisteredBuffer),
}

impl TestBuf {
    fn ptr_bytes(&self) -> (u64, usize) {
        match self {
            TestBuf::Plain(a) => (a.ptr, a.bytes),
            TestBuf::Registered(b) => (b.ptr(), b.bytes()),
        }
    }
}

impl Loaded {
    /// The module for GPU `ordinal` and world-size class `w` ([`kernels::world_class`]).
    fn get(ordinal: usize, w: usize, rank: usize) -> Result<Arc<Loaded>> {
        type Cache = HashMap<(usize, usize), Arc<Loaded>>;
        static CACHE: std::sync::OnceLock<std::sync::Mutex<Cache>> = std::sync::OnceLock::new();
        let mut cache = CACHE
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(l) = cache.get(&(ordinal, w)) {
            return Ok(l.clone());
        }
        let cuda = |op: &str, e: cudarc::driver::DriverError| Error::Cuda {
            rank,
            op: op.into(),
            detail: e.to_string(),
        };
        let ctx = cs::CudaContext::new(ordinal).map_err(|e| cuda("context creation", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda("compute capability query", e))?;
        let ptx = kernels::compile(&format!("sm_{major}{minor}"), w).map_err(|e| match e {
            Error::Cuda { op, detail, .. } => Error::Cuda { rank, op, detail },
            other => other,
        })?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| cuda("loading the NVRTC module", e))?;
        let mut funcs = HashMap::new();
        let mut regs = Vec::new();
        for path in CudaPath::ALL {
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    let kname = kernels::kernel_name(path, w, dtype, op);
                    let f = module
                        .load_function(&kname)
                        .map_err(|e| cuda(&format!("loading kernel {kname}"), e))?;
                    if dtype == DType::Bf16 && op == ReduceOp::Sum {
                        regs.push(format!("{} {}", path.name(), kernel_resources(&f)));
                    }
                    funcs.insert((path, dtype, op), f);
                }
            }
        }
        // What the compiler made of the kernels (the budget: 64 registers, no local memory).
        tracing::info!(
            rank,
            "kernels for world class {w}, bf16 sum: {}",
            regs.join(", ")
        );
        let l = Arc::new(Loaded {
            ctx,
            _module: module,
            funcs,
        });
        cache.insert((ordinal, w), l.clone());
        Ok(l)
    }
}

impl CudaComm {
    pub fn new(boot: &mut Bootstrap, opts: &Options) -> Result<CudaComm> {
        usable()?;
        let rank = boot.rank();
        let world = boot.world();
        if world > MAX_RANKS {
            return Err(Error::invalid(
                rank,
                "init",
                format!("world size {world} exceeds the cuda backend's maximum of {MAX_RANKS}"),
            ));
        }
        let cuda = |op: &str, e: cudarc::driver::DriverError| Error::Cuda {
            rank,
            op: op.into(),
            detail: e.to_string(),
        };
        let count = cs::CudaContext::device_count().map_err(|e| cuda("cuDeviceGetCount", e))?;
        let ordinal = boot.info().local_rank % count as usize;
        let gpu = Loaded::get(ordinal, kernels::world_class(world), rank)?;
        let ctx = gpu.ctx.clone();
        ctx.bind_to_thread()
            .map_err(|e| cuda("binding the context", e))?;
        let stream = ctx.new_stream().map_err(|e| cuda("stream creation", e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());

        let device = ctx.cu_device();
        let uuids = boot.all_gather(&device_uuid(device, rank)?)?;
        // Ranks that share a GPU (MPS) share its SMs: every block of every rank must be resident
        // at once (blocks wait for their peers), so the grid shrinks as more ranks share.
        let sharing = uuids
            .iter()
            .map(|a| uuids.iter().filter(|b| *b == a).count())
            .max()
            .unwrap_or(1);
        let fixed = env_usize("IPCREDUCE_BLOCKS")?.map(|b| b.clamp(1, MAX_BLOCKS));
        let cap = match fixed {
            Some(_) => MAX_BLOCKS,
            None => DEFAULT_CTA_CAP.min(SHARED_GPU_CTAS / sharing),
        };
        let slot_bytes = opts
            .workspace_bytes
            .map(|b| b / 2)
            .or(env_usize("IPCREDUCE_SLOT_BYTES")?)
            .unwrap_or(DEFAULT_SLOT_BYTES);
        let slot_bytes = (slot_bytes.max(64 << 10) / 256) * 256;
        // Messages up to this size take the low-latency one-shot (0 disables it).
        let ll_max = env_usize("IPCREDUCE_LL_MAX")?
            .unwrap_or(crate::plan::LL_DEFAULT_MAX_BYTES)
            .min(LL_MAX_BYTES);
        let limits = GridLimits { ll_max, cap, fixed };
        // Every rank must compute the same grid for every call and use the same slot size: the
        // protocol pairs block b with block b and alternates slots by chunk count.
        let mine = [
            cap as u64,
            fixed.unwrap_or(0) as u64,
            slot_bytes as u64,
            ll_max as u64,
        ]
        .map(u64::to_le_bytes)
        .concat();
        let all = boot.all_gather(&mine)?;
        if let Some(peer) = all.iter().position(|v| v != &mine) {
            return Err(Error::Mismatch {
                rank,
                peer,
                op: "init".into(),
                seq: 0,
                detail: "IPCREDUCE_BLOCKS / IPCREDUCE_SLOT_BYTES / IPCREDUCE_LL_MAX (or the GPU sharing) differ between ranks"
                    .into(),
            });
        }

        let ws = Workspaces::create(
            boot,
            device,
            SIG_BYTES + LL_BYTES + 2 * slot_bytes,
            ShareMode::from_env()?,
        )?;
        if ws.size < SIG_BYTES + LL_BYTES + 2 * slot_bytes {
            return Err(Error::Cuda {
                rank,
                op: "workspace creation".into(),
                detail: format!(
                    "got {} bytes, need {}",
                    ws.size,
                    SIG_BYTES + LL_BYTES + 2 * slot_bytes
                ),
            });
        }
        let state = DeviceAlloc::new(MAX_BLOCKS * 2 * 4 + 64, rank)?;
        let words = Arc::new(MappedHostWords::new(16, rank)?);
        // SAFETY: zeroing memory we own (signal area of our workspace, private state).
        unsafe {
            ck(
                sys::cuMemsetD8_v2(ws.base(rank), 0, SIG_BYTES + LL_BYTES),
                rank,
                || "clearing the signal and LL areas".into(),
            )?;
            ck(sys::cuMemsetD8_v2(state.ptr, 0, state.bytes), rank, || {
                "clearing the protocol state".into()
            })?;
            ck(sys::cuCtxSynchronize(), rank, || "cuCtxSynchronize".into())?;
        }
        let abort = boot.abort_state();
        let weak: Weak<MappedHostWords> = Arc::downgrade(&words);
        abort.on_abort(Box::new(move || {
            if let Some(w) = weak.upgrade() {
                w.set(W_ABORT, 1);
            }
        }));

        let devices: Vec<String> = {
            let names = boot.all_gather(format!("{name} (GPU {ordinal})").as_bytes())?;
            names
                .iter()
                .map(|n| String::from_utf8_lossy(n).into_owned())
                .collect()
        };
        check_peer_access(rank, device, &uuids)?;

        let mut comm = CudaComm {
            rank,
            world,
            ordinal,
            device,
            registry: Registry::default(),
            next_region: 0,
            last_path: None,
            ctx,
            stream,
            gpu,
            ws,
            state,
            words,
            limits,
            slot_bytes,
            timeout: opts.timeout,
            abort,
            nccl: Err("not requested".into()),
            bufs: Vec::new(),
            devices,
            seq: 0,
        };
        comm.cross_process_check(boot)?;

        let shared_gpu = (0..world).any(|i| (0..i).any(|j| uuids[i] == uuids[j]));
        if opts.with_nccl {
            comm.nccl = if shared_gpu && std::env::var_os("IPCREDUCE_NCCL_SHARED_GPU").is_none() {
                // Keep the exchange inside Nccl::init out of it: no rank calls it.
                Err("NCCL refuses two ranks on one GPU (set IPCREDUCE_NCCL_SHARED_GPU=1 to run it over loopback sockets)".into())
            } else {
                nccl::Nccl::init(boot, shared_gpu).map_err(|e| e.to_string())
            };
        }
        Ok(comm)
    }

    /// Writes a rank-specific pattern into our workspace, then reads every peer's through its
    /// mapping: the real cross-process test that P2P queries alone cannot give.
    fn cross_process_check(&mut self, boot: &mut Bootstrap) -> Result<()> {
        let rank = self.rank;
        let pattern = |r: usize| -> [u8; 16] {
            let mut p = [0u8; 16];
            for (i, b) in p.iter_mut().enumerate() {
                *b = (0xA5 ^ (r as u8).wrapping_mul(31) ^ (i as u8).wrapping_mul(7)) | 1;
            }
            p
        };
        let probe = self.ws.base(rank) + DATA_OFFSET;
        let mine = pattern(rank);
        // SAFETY: 16 bytes inside our own data area.
        ck(
            unsafe { sys::cuMemcpyHtoD_v2(probe, mine.as_ptr().cast(), 16) },
            rank,
            || "writing the cross-process probe".into(),
        )?;
        // The copy may return before its DMA lands: wait before telling the peers.
        // SAFETY: no arguments.
        ck(unsafe { sys::cuCtxSynchronize() }, rank, || {
            "cuCtxSynchronize".into()
        })?;
        boot.barrier()?;
        for peer in 0..self.world {
            let mut got = [0u8; 16];
            let addr = self.ws.base(peer) + DATA_OFFSET;
            // SAFETY: 16 bytes inside the peer's mapped data area.
            let res = unsafe { sys::cuMemcpyDtoH_v2(got.as_mut_ptr().cast(), addr, 16) };
            ck(res, rank, || format!("reading rank {peer}'s probe")).map_err(|e| {
                Error::PeerAccess {
                    rank,
                    peer,
                    op: "cross-process read",
                    detail: e.to_string(),
                }
            })?;
            if got != pattern(peer) {
                return Err(Error::PeerAccess {
                    rank,
                    peer,
                    op: "cross-process read",
                    detail: format!(
                        "read back {got:02x?} instead of the peer's pattern through the {} mapping",
                        self.ws.mode.name()
                    ),
                });
            }
        }
        boot.barrier()
    }

    fn cuda_err(&self, op: String, e: cudarc::driver::DriverError) -> Error {
        Error::Cuda {
            rank: self.rank,
            op,
            detail: e.to_string(),
        }
    }

    /// Fails if the communicator was aborted or a kernel recorded a failure.
    fn check_health(&self) -> Result<()> {
        let code = self.words.get(W_ERR);
        if code != 0 {
            let peer = self.words.get(W_ERR + 1) as usize;
            // The call that failed, as the kernel recorded it (not the latest one issued).
            let seq = self.words.get(W_ERR + 8) as u64 | (self.words.get(W_ERR + 9) as u64) << 32;
            let err = match code {
                ERR_TIMEOUT => Error::Timeout {
                    rank: self.rank,
                    peer,
                    op: "all_reduce (kernel barrier)".into(),
                    seq,
                    waited: self.timeout,
                },
                ERR_MISMATCH => {
                    let word64 = |i| {
                        self.words.get(W_ERR + i) as u64
                            | (self.words.get(W_ERR + i + 1) as u64) << 32
                    };
                    let (theirs, mine) = (word64(4), word64(6));
                    Error::Mismatch {
                        rank: self.rank,
                        peer,
                        op: "all_reduce".into(),
                        seq,
                        detail: kernels::describe_stamp_difference(mine, theirs),
                    }
                }
                _ => Error::Aborted {
                    rank: self.rank,
                    reason: self
                        .abort
                        .reason()
                        .unwrap_or_else(|| format!("kernel stopped waiting for rank {peer}")),
                },
            };
            self.abort.abort(err.to_string());
            return Err(err);
        }
        if self.abort.is_aborted() {
            return Err(Error::Aborted {
                rank: self.rank,
                reason: self.abort.reason().unwrap_or_default(),
            });
        }
        Ok(())
    }

    /// `zero_copy`: every rank's send and recv as mapped here (registered buffers).
    fn kernel_args(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        stamp: u64,
        zero_copy: Option<([u64; MAX_RANKS], [u64; MAX_RANKS])>,
    ) -> KernelArgs {
        let mut data = [0u64; MAX_RANKS];
        let mut ll = [0u64; MAX_RANKS];
        let mut sig = [0u64; MAX_RANKS];
        for r in 0..self.world {
            sig[r] = self.ws.base(r);
            ll[r] = self.ws.base(r) + SIG_BYTES as u64;
            data[r] = self.ws.base(r) + DATA_OFFSET;
        }
        let (rsend, rrecv) = zero_copy.unwrap_or(([0; MAX_RANKS], [0; MAX_RANKS]));
        let all16 = |v: &[u64; MAX_RANKS]| v[..self.world].iter().all(|p| p % 16 == 0);
        KernelArgs {
            send,
            recv,
            count: count as u64,
            data,
            ll,
            sig,
            rsend,
            rrecv,
            counters: self.state.ptr,
            abort_flag: self.words.device + 4 * W_ABORT as u64,
            err: self.state.ptr + (MAX_BLOCKS * 2 * 4) as u64,
            host_err: self.words.device + 4 * W_ERR as u64,
            slot_bytes: self.slot_bytes as u64,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            stamp,
            seq: self.seq,
            rank: self.rank as i32,
            world: self.world as i32,
            aligned: all16(&rsend) as i32 | (all16(&rrecv) as i32) << 1,
        }
    }

    /// Every rank's send and recv as mapped here, when both lie in registered buffers.
    fn zero_copy(
        &self,
        send: u64,
        recv: u64,
        bytes: usize,
    ) -> Option<([u64; MAX_RANKS], [u64; MAX_RANKS])> {
        let (rs, so) = self.registry.lookup(send, bytes)?;
        let (rr, ro) = self.registry.lookup(recv, bytes)?;
        let (mut s, mut r) = ([0u64; MAX_RANKS], [0u64; MAX_RANKS]);
        for p in 0..self.world {
            s[p] = rs.peers[p] + so;
            r[p] = rr.peers[p] + ro;
        }
        Some((s, r))
    }

    fn stream_or_own(&self, stream: *mut c_void) -> sys::CUstream {
        if stream.is_null() {
            self.stream.cu_stream()
        } else {
            stream as sys::CUstream
        }
    }

    /// Rejects device pointers that belong to another GPU.
    fn check_pointer(&self, ptr: u64, what: &str) -> Result<()> {
        let mut ordinal: i32 = -1;
        // SAFETY: writes one int.
        let res = unsafe {
            sys::cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            )
        };
        if res != sys::CUresult::CUDA_SUCCESS {
            return Err(Error::invalid(
                self.rank,
                "all_reduce",
                format!(
                    "{what} buffer {ptr:#x} is not CUDA device memory ({})",
                    driver::describe(res)
                ),
            ));
        }
        if ordinal as usize != self.ordinal {
            return Err(Error::invalid(
                self.rank,
                "all_reduce",
                format!(
                    "{what} buffer is on GPU {ordinal}, the communicator on GPU {}",
                    self.ordinal
                ),
            ));
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.check_health()?;
        self.seq += 1;
        if algo == Algorithm::Nccl {
            self.last_path = Some(PathInfo {
                name: "nccl",
                ctas: 0,
                registered: false,
            });
            let rank = self.rank;
            let nccl = self.nccl.as_mut().map_err(|why| {
                Error::invalid(rank, "all_reduce", format!("NCCL unavailable: {why}"))
            })?;
            // SAFETY: pointers checked by the caller.
            return unsafe {
                nccl.all_reduce(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    dtype,
                    op,
                    stream,
                )
            };
        }
        let bytes = count * dtype.size();
        let zero_copy = self.zero_copy(send, recv, bytes);
        let (path, grid) =
            crate::plan::cuda_path(algo, bytes, zero_copy.is_some(), send == recv, &self.limits);
        let f = self.gpu.funcs[&(path, dtype, op)].cu_function();
        self.last_path = Some(PathInfo {
            name: path.name(),
            ctas: grid,
            registered: path.registered(),
        });
        let stamp = kernels::stamp(count, dtype, op, path.code());
        let zero_copy = zero_copy.filter(|_| path.registered());
        let mut args = self.kernel_args(send, recv, count, stamp, zero_copy);
        let mut params = [(&mut args as *mut KernelArgs).cast::<c_void>()];
        let rank = self.rank;
        // SAFETY: the kernel reads `args` (copied at launch) and only touches the buffers in it,
        // which the caller vouched for and we own.
        ck(
            unsafe {
                sys::cuLaunchKernel(
                    f,
                    grid,
                    1,
                    1,
                    THREADS,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            rank,
            || {
                format!(
                    "launching the {} kernel ({count} x {dtype} {op})",
                    path.name()
                )
            },
        )
    }
}

impl BackendOps for CudaComm {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    unsafe fn all_reduce_raw(
        &mut self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
        stream: *mut c_void,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.cuda_err("binding the context".into(), e))?;
        let bytes = count * dtype.size();
        // Registered buffers are known to be ours; anything else is asked of the driver.
        if self.registry.lookup(send as u64, bytes).is_none() {
            self.check_pointer(send as u64, "send")?;
        }
        if recv as u64 != send as u64 && self.registry.lookup(recv as u64, bytes).is_none() {
            self.check_pointer(recv as u64, "recv")?;
        }
        let stream = self.stream_or_own(stream);
        self.launch(send as u64, recv as u64, count, dtype, op, algo, stream)
    }

    fn alloc_registered(&mut self, boot: &mut Bootstrap, bytes: usize) -> Result<RegisteredBuffer> {
        self.bind()?;
        if bytes == 0 {
            return Err(Error::invalid(self.rank, "alloc", "zero bytes"));
        }
        let id = self.next_region;
        let region = registry::alloc(boot, self.device, bytes, id)?;
        self.next_region += 1;
        let buf = RegisteredBuffer::new(region.base, region.bytes, id);
        self.registry.insert(region, self.rank)?;
        Ok(buf)
    }

    unsafe fn register(
        &mut self,
        boot: &mut Bootstrap,
        ptr: u64,
        bytes: usize,
    ) -> Result<RegisteredBuffer> {
        self.bind()?;
        if bytes == 0 {
            return Err(Error::invalid(self.rank, "register", "zero bytes"));
        }
        let id = self.next_region;
        let region = registry::register(boot, self.device, ptr, bytes, id)?;
        self.next_region += 1;
        let buf = RegisteredBuffer::new(region.base, region.bytes, id);
        self.registry.insert(region, self.rank)?;
        Ok(buf)
    }

    fn free_registered(&mut self, boot: &mut Bootstrap, buf: RegisteredBuffer) -> Result<()> {
        self.bind()?;
        // Every kernel of ours (on any stream) that may touch it is done, then every peer's.
        // SAFETY: no arguments.
        ck(unsafe { sys::cuCtxSynchronize() }, self.rank, || {
            "cuCtxSynchronize before freeing a registered buffer".into()
        })?;
        boot.barrier()?;
        self.registry.remove(buf.id()).map(drop).ok_or_else(|| {
            Error::invalid(
                self.rank,
                "free",
                format!("buffer {:#x} is not registered here", buf.ptr()),
            )
        })
    }

    fn alloc_test_registered(&mut self, boot: &mut Bootstrap, bytes: usize) -> Result<BufId> {
        let buf = self.alloc_registered(boot, bytes)?;
        self.bufs.push(Some(TestBuf::Registered(buf)));
        Ok(self.bufs.len() - 1)
    }

    fn last_path(&self) -> Option<PathInfo> {
        self.last_path
    }

    fn unavailable(&self, algo: Algorithm) -> Option<String> {
        match (algo, &self.nccl) {
            (Algorithm::Nccl, Err(why)) => Some(why.clone()),
            _ => None,
        }
    }

    fn meta(&self) -> BackendMeta {
        BackendMeta {
            devices: self.devices.clone(),
            driver: driver::driver_version(),
            nccl_version: nccl::version(),
        }
    }

    fn alloc(&mut self, bytes: usize) -> Result<BufId> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.cuda_err("binding the context".into(), e))?;
        let buf = DeviceAlloc::new(bytes, self.rank)?;
        self.bufs.push(Some(TestBuf::Plain(buf)));
        Ok(self.bufs.len() - 1)
    }

    fn free(&mut self, id: BufId) {
        if let Some(slot) = self.bufs.get_mut(id) {
            if let Some(TestBuf::Registered(buf)) = slot.take() {
                // Not collective: peers' mappings keep the memory alive until they drop them.
                if let Err(e) = self.stream.synchronize() {
                    tracing::warn!(rank = self.rank, "synchronize before freeing failed: {e}");
                }
                self.registry.remove(buf.id());
            }
        }
    }

    fn write(&mut self, id: BufId, data: &[u8]) -> Result<()> {
        let (ptr, bytes) = self.buf(id)?;
        assert!(data.len() <= bytes);
        // On our stream, then waited for: a plain cuMemcpyHtoD from pageable memory may return
        // before its DMA lands, and our (non-blocking) stream would not wait for it.
        // SAFETY: in bounds of our allocation; `data` outlives the synchronize below.
        ck(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    ptr,
                    data.as_ptr().cast(),
                    data.len(),
                    self.stream.cu_stream(),
                )
            },
            self.rank,
            || format!("copying {} bytes to the device", data.len()),
        )?;
        self.synchronize()
    }

    fn read(&mut self, id: BufId, out: &mut [u8]) -> Result<()> {
        self.synchronize()?;
        let (ptr, bytes) = self.buf(id)?;
        assert!(out.len() <= bytes);
        // SAFETY: in bounds of our allocation; `out` outlives the synchronize below.
        ck(
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    out.as_mut_ptr().cast(),
                    ptr,
                    out.len(),
                    self.stream.cu_stream(),
                )
            },
            self.rank,
            || format!("copying {} bytes from the device", out.len()),
        )?;
        self.synchronize()
    }

    fn run(&mut self, call: &Call) -> Result<()> {
        let (s, r) = (self.buf(call.send)?, self.buf(call.recv)?);
        let end = call.offset + call.count * call.dtype.size();
        if end > s.1 || end > r.1 {
            return Err(Error::invalid(self.rank, "run", "call exceeds its buffers"));
        }
        let (s, r) = (s.0 + call.offset as u64, r.0 + call.offset as u64);
        let stream = self.stream.cu_stream();
        self.launch(s, r, call.count, call.dtype, call.op, call.algo, stream)
    }

    fn synchronize(&mut self) -> Result<()> {
        let res = self.stream.synchronize();
        self.check_health()?;
        res.map_err(|e| self.cuda_err("stream synchronize".into(), e))
    }

    fn time(
        &mut self,
        call: &Call,
        warmup: usize,
        iters: usize,
        graph: Option<usize>,
    ) -> Result<f64> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .ctx
            .new_event(flags)
            .map_err(|e| self.cuda_err("cuEventCreate".into(), e))?;
        let end = self
            .ctx
            .new_event(flags)
            .map_err(|e| self.cuda_err("cuEventCreate".into(), e))?;
        let iters = iters.max(1);
        let calls = match graph {
            None => {
                for _ in 0..warmup {
                    self.run(call)?;
                }
                self.synchronize()?;
                start
                    .record(&self.stream)
                    .map_err(|e| self.cuda_err("cuEventRecord".into(), e))?;
                for _ in 0..iters {
                    self.run(call)?;
                }
                iters
            }
            Some(k) => {
                let k = k.max(1);
                self.synchronize()?;
                self.stream
                    .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(|e| self.cuda_err("cuStreamBeginCapture".into(), e))?;
                let mut captured = Ok(());
                for _ in 0..k {
                    captured = self.run(call);
                    if captured.is_err() {
                        break;
                    }
                }
                let g = self
                    .stream
                    .end_capture(sys::CUgraphInstantiate_flags(0))
                    .map_err(|e| self.cuda_err("cuStreamEndCapture".into(), e))?;
                captured?;
                let g = g.ok_or_else(|| Error::Cuda {
                    rank: self.rank,
                    op: "graph capture".into(),
                    detail: "captured an empty graph".into(),
                })?;
                let reps = iters.div_ceil(k);
                for _ in 0..warmup.div_ceil(k).max(1) {
                    g.launch()
                        .map_err(|e| self.cuda_err("cuGraphLaunch".into(), e))?;
                }
                self.synchronize()?;
                start
                    .record(&self.stream)
                    .map_err(|e| self.cuda_err("cuEventRecord".into(), e))?;
                for _ in 0..reps {
                    g.launch()
                        .map_err(|e| self.cuda_err("cuGraphLaunch".into(), e))?;
                }
                reps * k
            }
        };
        end.record(&self.stream)
            .map_err(|e| self.cuda_err("cuEventRecord".into(), e))?;
        self.synchronize()?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(|e| self.cuda_err("cuEventElapsedTime".into(), e))?;
        Ok(ms as f64 * 1000.0 / calls as f64)
    }
}

impl CudaComm {
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.cuda_err("binding the context".into(), e))
    }

    fn buf(&self, id: BufId) -> Result<(u64, usize)> {
        self.bufs
            .get(id)
            .and_then(|b| b.as_ref())
            .map(TestBuf::ptr_bytes)
            .ok_or_else(|| Error::invalid(self.rank, "buffer", format!("no buffer #{id}")))
    }
}

impl Drop for CudaComm {
    fn drop(&mut self) {
        // Finish our work (registered buffers may be in use on the caller's streams too) before
        // unmapping anything a kernel may still touch.
        if let Err(e) = self.stream.synchronize() {
            tracing::warn!(rank = self.rank, "synchronize at teardown failed: {e}");
        }
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: no arguments.
            let res = unsafe { sys::cuCtxSynchronize() };
            if res != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(
                    rank = self.rank,
                    "cuCtxSynchronize at teardown failed: {res:?}"
                );
            }
        }
    }
}

fn device_uuid(device: sys::CUdevice, rank: usize) -> Result<Vec<u8>> {
    // SAFETY: a plain C struct filled by the driver.
    let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
    ck(
        unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, device) },
        rank,
        || "cuDeviceGetUuid".into(),
    )?;
    Ok(uuid.bytes.iter().map(|b| *b as u8).collect())
}

/// For every peer on another GPU: that GPU must be visible here and reachable by P2P.
fn check_peer_access(rank: usize, device: sys::CUdevice, uuids: &[Vec<u8>]) -> Result<()> {
    let mine = &uuids[rank];
    let count = cs::CudaContext::device_count().unwrap_or(0);
    let mut visible = HashMap::new();
    for ord in 0..count {
        let mut dev = 0;
        // SAFETY: writes one device handle.
        if unsafe { sys::cuDeviceGet(&mut dev, ord) } == sys::CUresult::CUDA_SUCCESS {
            visible.insert(device_uuid(dev, rank)?, (ord, dev));
        }
    }
    for (peer, uuid) in uuids.iter().enumerate() {
        if peer == rank || uuid == mine {
            continue;
        }
        let Some(&(ord, peer_dev)) = visible.get(uuid) else {
            return Err(Error::PeerAccess {
                rank,
                peer,
                op: "P2P query",
                detail:
                    "the peer's GPU is not visible to this process (CUDA_VISIBLE_DEVICES differs?)"
                        .into(),
            });
        };
        let mut can = 0;
        // SAFETY: writes one int.
        ck(
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, device, peer_dev) },
            rank,
            || "cuDeviceCanAccessPeer".into(),
        )?;
        if can == 0 {
            return Err(Error::PeerAccess {
                rank,
                peer,
                op: "P2P query",
                detail: format!("this GPU cannot access GPU {ord} directly (no P2P path)"),
            });
        }
    }
    Ok(())
}

/// "N regs, M B local" of a loaded kernel, for the log.
fn kernel_resources(f: &cs::CudaFunction) -> String {
    use sys::CUfunction_attribute::{
        CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES as LOCAL, CU_FUNC_ATTRIBUTE_NUM_REGS as REGS,
    };
    let get = |attr| {
        let mut v = 0;
        // SAFETY: writes one int for a loaded function.
        let res = unsafe { sys::cuFuncGetAttribute(&mut v, attr, f.cu_function()) };
        if res == sys::CUresult::CUDA_SUCCESS {
            v.to_string()
        } else {
            "?".into()
        }
    };
    format!("{} regs, {} B local", get(REGS), get(LOCAL))
}

fn env_usize(name: &str) -> Result<Option<usize>> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => v
            .parse()
            .map(Some)
            .map_err(|_| Error::Config(format!("{name}={v}: expected a positive integer"))),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The PTX declares the kernel's parameter as a byte array of the struct's size: it must
    /// equal ours, or the kernel would read garbage.
    #[test]
    fn kernel_args_size_matches_the_ptx() {
        if !kernels::nvrtc_for_tests() {
            return;
        }
        let ptx = kernels::compile("sm_90", 2).unwrap().to_src();
        let want = format!("_param_0[{}]", std::mem::size_of::<KernelArgs>());
        assert!(ptx.contains(&want), "PTX parameter is not {want}");
    }

    #[test]
    fn unusable_without_a_driver_is_an_error_not_a_panic() {
        if driver::driver_present() {
            return;
        }
        let err = usable().unwrap_err();
        assert!(err.to_string().contains("libcuda"), "{err}");
    }
}
