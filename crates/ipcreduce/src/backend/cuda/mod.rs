//! CUDA backend: one process per GPU (or several under MPS), peer memory through CUDA IPC.
//!
//! Start-up (once per communicator): pick the GPU (see [`Config::pick_device`]), compile the
//! kernels with NVRTC, create and share the workspaces ([`workspace`]), check every pair of
//! ranks for real (P2P query + a cross-process write/read), optionally build NCCL beside us.
//! A call: validate, stamp nothing on the host, launch one kernel on the caller's stream. All
//! protocol state is on the device (see kernels/prims.cuh), so calls can be graph-captured.

mod ce;
pub mod driver;
mod hier;
pub mod identity;
pub mod kernels;
pub mod memory;
mod nccl;
pub mod paths;
mod peers;
mod pointers;
mod registry;
mod residency;
mod scatter_gather;
mod streams;
mod teardown;
#[cfg(feature = "test-support")]
mod testbufs;
mod workspace;
// Workspaces over peer memory or staged through host memory (IPCREDUCE_TRANSPORT).
mod host_staged;
mod modules;
mod topology;
mod transport;

use crate::abort::AbortState;
use crate::backend::{BackendMeta, BackendOps, RegisteredBuffer, SgOp};
use crate::bootstrap::Bootstrap;
use crate::config::{Config, Pdl};
use crate::error::{Error, Result};
use crate::plan::{CudaPath, Fabric, GridLimits, PathInfo};
use crate::types::{Algorithm, BackendKind, DType, ReduceOp};
use cudarc::driver::{safe as cs, sys};
use driver::ck;
use identity::{CallIdentity, RegionAt, IDENT_WORDS};
use kernels::{
    ll_bytes, rec, ERR_MISMATCH, ERR_TIMEOUT, LL_MAX_BYTES, MAX_BLOCKS, MAX_RANKS, SIG_BYTES,
    STATE_ERR_WORD,
};
use memory::{DeviceAlloc, MappedHostWords};
use modules::Loaded;
use peers::device_uuid;
use registry::Registry;

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Weak};
use transport::SharedWorkspaces;

/// Default bytes of one data slot (the workspace holds two). Larger messages are chunked.
const DEFAULT_SLOT_BYTES: usize = 16 << 20;
/// Where the data slots of a `world`-rank workspace start: after the signal and LL areas.
fn data_offset(world: usize) -> u64 {
    (SIG_BYTES + ll_bytes(world)) as u64
}
/// Where the start-up mapping test writes its probe: the LL area, cleared after the test.
const PROBE_OFFSET: u64 = SIG_BYTES as u64;
/// Threads per block of the all-reduce kernels (their `__launch_bounds__`).
const THREADS: u32 = 512;
/// Most CTAs a kernel uses by default (a policy); fewer where they would not all be resident
/// beside the other ranks' (see residency.rs).
const DEFAULT_CTA_CAP: usize = 64;

// Words of the host-mapped area shared with the kernels.
const W_ABORT: usize = 0;
// The kernels' error record (kernels::rec, REC_* in kernels/prims.cuh).
const W_ERR: usize = 1;

/// Kernel arguments; must match `struct Args` in kernels/prims.cuh field by field.
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
    digest: u64,
    seq: u64,
    ident: [u32; IDENT_WORDS],
    rank: i32,
    world: i32,
    aligned: i32,
    lane: i32,
    check: i32,
    mode: i32,
    chunk_bytes: u64,
}

/// Whether this process can use the cuda backend (driver, a GPU, NVRTC).
pub fn usable() -> Result<()> {
    require_driver(driver::driver_present())?;
    cudarc::driver::result::init()
        .map_err(|e| Error::CudaUnavailable(format!("cuInit failed: {e}")))?;
    let n = cs::CudaContext::device_count()
        .map_err(|e| Error::CudaUnavailable(format!("cuDeviceGetCount failed: {e}")))?;
    if n == 0 {
        return Err(Error::CudaUnavailable("no CUDA device visible".into()));
    }
    kernels::require_nvrtc()
}

/// The first check of [`usable`]: cudarc panics on use when libcuda is missing.
fn require_driver(present: bool) -> Result<()> {
    if present {
        return Ok(());
    }
    Err(Error::CudaUnavailable(
        "libcuda.so not found (no NVIDIA driver)".into(),
    ))
}

pub struct CudaComm {
    // Declaration order is drop order: everything that needs the context goes before it.
    /// Jobs across hosts: NCCL between nodes and the node's group this communicator runs over
    /// (see hier.rs); None within one host.
    inter: Option<hier::Inter>,
    rank: usize,
    world: usize,
    ordinal: usize,
    device: sys::CUdevice,
    #[cfg(feature = "test-support")]
    bufs: Vec<Option<testbufs::TestBuf>>,
    /// Registered (zero-copy) buffers; freed in Drop unless work may still run on them.
    registry: ManuallyDrop<Registry>,
    /// What the caller's other buffers are, by allocation (see pointers.rs).
    pointers: pointers::PointerCache,
    /// Streams and events of the copy-engine path, made at its first call.
    ce: Option<ce::Lanes>,
    next_region: u64,
    last_path: Option<PathInfo>,
    nccl: std::result::Result<nccl::Nccl, String>,
    /// Stream order and what teardown waits for (see streams.rs).
    streams: streams::Tracker,
    events: streams::CudaEvents,
    // Memory kernels use: freed in Drop unless work may still run on it (see teardown.rs).
    words: ManuallyDrop<Arc<MappedHostWords>>,
    /// Private device state: counters[MAX_BLOCKS][2], then the error word.
    state: ManuallyDrop<DeviceAlloc>,
    ws: ManuallyDrop<SharedWorkspaces>,
    /// Set by teardown: what must not be freed.
    leak: teardown::Leak,
    /// Whether teardown ran (else Drop waits for our work itself).
    left: bool,
    limits: GridLimits,
    /// The agreed tuning table: its CTA counts for the calls whose algorithm it chose.
    tune: crate::tune::Table,
    /// What the data crosses (agreed at init): chunk sizes, CTA cap, push order.
    fabric: Fabric,
    slot_bytes: usize,
    timeout: std::time::Duration,
    abort: Arc<AbortState>,
    devices: Vec<String>,
    /// Calls issued so far (for error messages).
    seq: u64,
    /// When kernels are launched with programmatic dependent launch (Off where the GPU lacks
    /// it), and whether the call being issued is (see `launch_kernel`).
    pdl: Pdl,
    launch_pdl: bool,
    /// The LL kernels let the next kernel launch early (MODE_LET_NEXT_LAUNCH).
    let_next_launch: bool,
    stream: Arc<cs::CudaStream>,
    ctx: Arc<cs::CudaContext>,
    gpu: Arc<Loaded>,
}

impl CudaComm {
    pub fn new(boot: &mut Bootstrap, config: &Config) -> Result<CudaComm> {
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
        let cuda = |op: &str, e: cudarc::driver::DriverError| driver::from_cudarc(rank, op, e);
        let count = cs::CudaContext::device_count().map_err(|e| cuda("cuDeviceGetCount", e))?;
        let ordinal = config.pick_device(
            current_device(rank)?,
            boot.info().local_rank,
            count as usize,
        )?;
        let gpu = Loaded::get(ordinal, kernels::world_class(world), rank)?;
        let pdl = Pdl::resolve(config.pdl, gpu.pdl_capable);
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
        // Config::blocks / IPCREDUCE_BLOCKS: one CTA count for every SM path (tuning); else
        // the count follows the message size (plan::cuda_path), up to the cap.
        let fixed = config.blocks;
        if fixed.is_some_and(|b| b == 0 || b > MAX_BLOCKS) {
            return Err(Error::Config(format!(
                "blocks {} (Config::blocks or IPCREDUCE_BLOCKS): 1 to {MAX_BLOCKS}",
                fixed.unwrap_or(0)
            )));
        }
        // What every rank's grid can count on being resident (the smallest room of any rank).
        let room = residency::agree(boot, residency::measure(&gpu, device, sharing, rank)?)?;
        let residency::Caps { cap, deep_cap } =
            residency::caps(&room, fixed, DEFAULT_CTA_CAP, MAX_BLOCKS)
                .map_err(|why| Error::invalid(rank, "init", why))?;
        let slot_bytes = config.workspace_bytes.map_or(DEFAULT_SLOT_BYTES, |b| b / 2);
        let slot_bytes = (slot_bytes.max(64 << 10) / 256) * 256;
        // Messages up to this size take the low-latency one-shot (0 disables it).
        // NVLink peer memory assumed here; on another fabric the default is set below.
        let ll_max = config.ll_max_bytes(world, Fabric::Peer);
        if ll_max > LL_MAX_BYTES {
            return Err(Error::Config(format!(
                "low-latency limit {ll_max} bytes (Config::ll_max_bytes or IPCREDUCE_LL_MAX): \
                 at most {LL_MAX_BYTES}"
            )));
        }
        // The copy-engine path is written for two ranks.
        let ce_min = match world {
            2 => config
                .ce_min_bytes
                .unwrap_or(crate::plan::CE_DEFAULT_MIN_BYTES),
            _ => 0,
        };
        let deep = match config.reg_loads.unwrap_or(crate::plan::REG_LOADS_DEFAULT) {
            8 => false,
            16 => true,
            n => {
                return Err(Error::Config(format!(
                "zero-copy loads in flight {n} (Config::reg_loads or IPCREDUCE_REG_LOADS): 8 or 16"
            )))
            }
        };
        // Validated by Config: 8 or 12.
        let ll12 = config.ll_data_bytes == Some(12);
        let mut limits = GridLimits {
            ll_max,
            cap,
            fixed,
            ce_min,
            deep,
            deep_cap,
            ll12,
        };
        // Every rank must compute the same grid for every call and use the same slot size: the
        // protocol pairs block b with block b and alternates slots by chunk count.
        let mine = [
            cap as u64,
            fixed.unwrap_or(0) as u64,
            slot_bytes as u64,
            ll_max as u64,
            ce_min as u64,
            deep as u64,
            ll12 as u64,
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
                detail: "IPCREDUCE_BLOCKS / IPCREDUCE_SLOT_BYTES / IPCREDUCE_LL_MAX / IPCREDUCE_CE_MIN / IPCREDUCE_REG_LOADS / IPCREDUCE_LL_DATA (or the GPU sharing) differ between ranks"
                    .into(),
            });
        }

        // Also checks every pair (P2P query, mapping, cross-process read) for the transport.
        let bytes = data_offset(world) as usize + 2 * slot_bytes;
        let ws = SharedWorkspaces::open(boot, device, bytes, &uuids, config)?;
        if ws.size < bytes {
            return Err(Error::Cuda {
                rank,
                op: "workspace creation".into(),
                detail: format!("got {} bytes, need {bytes}", ws.size),
            });
        }
        // The PCIe policy (or none) from the transport, IPCREDUCE_TOPOLOGY and the pairs.
        let fabric = topology::agree(
            boot,
            device,
            &uuids,
            ws.sharing().is_none(),
            config.topology,
        )?;
        // Every rank takes the same fabric, so every rank adjusts the same way.
        limits.ll_max = config.ll_max_bytes(world, fabric);
        config.check_ll_data(fabric)?;
        if fabric == Fabric::PciePeer && fixed.is_none() {
            limits.cap = limits.cap.min(crate::plan::PCIE_CTA_CAP);
            limits.deep_cap = limits.deep_cap.min(limits.cap);
        }
        let state = DeviceAlloc::new(MAX_BLOCKS * 2 * 4 + 64, rank)?;
        let words = Arc::new(MappedHostWords::new(W_ERR + rec::WORDS, rank)?);
        // SAFETY: zeroing memory we own (signal area of our workspace, private state).
        unsafe {
            ws.clear(rank, data_offset(world) as usize)?;
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
            // The transport and policy, so results say how they were made.
            let via = match fabric {
                Fabric::PciePeer => ", PCIe policy",
                _ => ws.note(),
            };
            let names = boot.all_gather(format!("{name} (GPU {ordinal}{via})").as_bytes())?;
            names
                .iter()
                .map(|n| String::from_utf8_lossy(n).into_owned())
                .collect()
        };

        let own = stream.cu_stream() as streams::Key;
        let mut comm = CudaComm {
            inter: None,
            rank,
            world,
            ordinal,
            device,
            registry: ManuallyDrop::new(Registry::default()),
            pointers: pointers::PointerCache::default(),
            ce: None,
            next_region: 0,
            last_path: None,
            ctx,
            stream,
            gpu,
            streams: streams::Tracker::new(own),
            events: streams::CudaEvents::new(rank),
            ws: ManuallyDrop::new(ws),
            state: ManuallyDrop::new(state),
            words: ManuallyDrop::new(words),
            leak: teardown::Leak::Nothing,
            left: false,
            limits,
            tune: crate::tune::Table::builtin(),
            fabric,
            slot_bytes,
            timeout: config.timeout(),
            abort,
            nccl: Err("not requested".into()),
            #[cfg(feature = "test-support")]
            bufs: Vec::new(),
            devices,
            seq: 0,
            pdl,
            launch_pdl: false,
            // Not where ranks share a GPU (unless forced): see let_next_kernel_launch.
            let_next_launch: pdl.trigger(config.pdl_trigger, sharing),
        };
        // Every rank's signal area is cleared before any kernel writes into it.
        boot.barrier()?;

        let shared_gpu = (0..world).any(|i| (0..i).any(|j| uuids[i] == uuids[j]));
        if config.with_nccl {
            comm.nccl = if shared_gpu && !config.nccl_shared_gpu() {
                // Keep the exchange inside Nccl::init out of it: no rank calls it.
                Err("NCCL refuses two ranks on one GPU (set IPCREDUCE_NCCL_SHARED_GPU=1 to run it over loopback sockets)".into())
            } else {
                nccl::Nccl::init(boot, shared_gpu).map_err(|e| e.to_string())
            };
        }
        tracing::debug!(
            rank,
            "programmatic dependent launch: {:?}, LL kernels let the next launch early: {}",
            comm.pdl,
            comm.let_next_launch
        );
        Ok(comm)
    }

    fn cuda_err(&self, op: String, e: cudarc::driver::DriverError) -> Error {
        driver::from_cudarc(self.rank, op, e)
    }

    /// Fails if the communicator was aborted or a kernel recorded a failure.
    fn check_health(&self) -> Result<()> {
        let code = self.words.get(W_ERR + rec::CODE);
        if code != 0 {
            let word = |i| self.words.get(W_ERR + i);
            let peer = word(rec::PEER) as usize;
            // The call that failed, as the kernel recorded it (not the latest one issued).
            let seq = word(rec::SEQ) as u64 | (word(rec::SEQ + 1) as u64) << 32;
            let ident = |at: usize| {
                let mut w = [0u32; IDENT_WORDS];
                for (k, x) in w.iter_mut().enumerate() {
                    *x = word(at + k);
                }
                CallIdentity::decode(&w)
            };
            let mine = ident(rec::MINE);
            let op = mine.map_or("all_reduce", |m| m.op.name());
            let err = match code {
                ERR_TIMEOUT => Error::Timeout {
                    rank: self.rank,
                    peer,
                    op: format!("{op} (kernel wait)"),
                    seq,
                    waited: self.timeout,
                },
                ERR_MISMATCH => {
                    let theirs = (word(rec::THEIRS_KNOWN) != 0)
                        .then(|| ident(rec::THEIRS))
                        .flatten();
                    let detail = match &mine {
                        Some(m) => identity::describe_mismatch(self.rank, m, peer, theirs.as_ref()),
                        None => "the error record holds no readable call".into(),
                    };
                    Error::Mismatch {
                        rank: self.rank,
                        peer,
                        op: op.into(),
                        seq,
                        detail,
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
        ident: &CallIdentity,
        zero_copy: Option<([u64; MAX_RANKS], [u64; MAX_RANKS])>,
    ) -> KernelArgs {
        let mut data = [0u64; MAX_RANKS];
        let mut ll = [0u64; MAX_RANKS];
        let mut sig = [0u64; MAX_RANKS];
        for r in 0..self.world {
            sig[r] = self.ws.base(r);
            ll[r] = self.ws.base(r) + SIG_BYTES as u64;
            data[r] = self.ws.base(r) + data_offset(self.world);
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
            err: self.state.ptr + (STATE_ERR_WORD * 4) as u64,
            host_err: self.words.device + 4 * W_ERR as u64,
            slot_bytes: self.slot_bytes as u64,
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            digest: ident.digest(),
            seq: self.seq,
            ident: ident.encode(),
            rank: self.rank as i32,
            world: self.world as i32,
            aligned: all16(&rsend) as i32 | (all16(&rrecv) as i32) << 1,
            lane: 0,
            check: 0,
            mode: (self.fabric.kernel_mode()
                | if self.let_next_launch {
                    crate::plan::MODE_LET_NEXT_LAUNCH
                } else {
                    0
                }) as i32,
            chunk_bytes: self.slot_bytes as u64,
        }
    }

    /// A call of zero elements of operation `what`: the LL kernel with one line of no data
    /// ([`CudaPath::Empty`]), so it still meets the peers' calls, is compared with them (a
    /// count-0 call against a real one is a mismatch on every rank) and advances the call
    /// number with theirs. Its pointers are never read (they may be null).
    fn launch_empty(
        &mut self,
        what: SgOp,
        dtype: DType,
        op: ReduceOp,
        stream: sys::CUstream,
    ) -> Result<()> {
        let path = CudaPath::Empty;
        let reduce = match what {
            SgOp::AllGather => ReduceOp::Sum,
            _ => op,
        };
        // Where nothing is read or written, pointers and placement are nobody's business.
        let ident = CallIdentity {
            op: what,
            path,
            dtype,
            reduce,
            count: 0,
            in_place: false,
            send: None,
            recv: None,
        };
        let f = self.gpu.function(path, dtype, reduce, self.rank)?;
        self.last_path = Some(PathInfo {
            name: path.name(),
            ctas: 1,
            registered: false,
        });
        let mut args = self.kernel_args(0, 0, 0, &ident, None);
        let threads = crate::plan::block_threads(path, 0, 1, THREADS);
        self.launch_kernel(f, 1, threads, stream, &mut args, || {
            format!("launching the empty {} kernel", what.name())
        })
    }

    /// The registered region holding `[ptr, ptr + bytes)` and `ptr`'s offset in it.
    fn region_at(&self, ptr: u64, bytes: usize) -> Option<RegionAt> {
        let (r, offset) = self.registry.lookup(ptr, bytes.max(1))?;
        Some(RegionAt {
            id: r.id as u32,
            offset,
        })
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

    /// Refuses a buffer of `bytes` at `ptr` the kernels cannot use in operation `op` (named in
    /// the error): another GPU's memory or host memory (the kernel's access would fault and end
    /// the process's CUDA context). Registered buffers are known to be ours; for anything else
    /// the driver is asked once per allocation (pointers.rs), so later calls in it cost no query.
    fn check_buffer(&mut self, op: &'static str, ptr: u64, bytes: usize, what: &str) -> Result<()> {
        if self.registry.lookup(ptr, bytes).is_some() {
            return Ok(());
        }
        self.check_pointer_for(op, ptr, what)
    }

    /// The driver's side of [`Self::check_buffer`].
    fn check_pointer_for(&mut self, op: &'static str, ptr: u64, what: &str) -> Result<()> {
        let rank = self.rank;
        let (facts, asked) = match self.pointers.get(ptr) {
            Some(f) => (f, false),
            None => {
                let f = pointers::query(ptr).map_err(|res| {
                    Error::invalid(
                        rank,
                        op,
                        format!(
                            "{what} buffer {ptr:#x}: cuPointerGetAttributes failed ({})",
                            driver::describe(res)
                        ),
                    )
                })?;
                (f, true)
            }
        };
        facts
            .judge(ptr, what, self.ordinal)
            .map_err(|why| Error::invalid(rank, op, why))?;
        // Only what passed is kept: a refused range may be freed and come back as memory of
        // this GPU, and is then asked about again.
        if asked {
            self.pointers.insert(facts);
        }
        Ok(())
    }

    /// One call on `stream`, in order with the communicator's calls on other streams.
    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
        stream: sys::CUstream,
    ) -> Result<()> {
        self.in_stream_order(stream, |c| {
            c.launch(send, recv, count, dtype, op, algo, stream)
        })
    }

    /// Runs `issue` (which enqueues on `stream`) in order with the communicator's work on
    /// its other streams.
    fn in_stream_order(
        &mut self,
        stream: sys::CUstream,
        issue: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let key = stream as streams::Key;
        // The capture status decides whether the tracker may record and wait on events (not
        // during capture: the graph orders its calls), and, with Pdl::Eager, whether kernels
        // are launched with programmatic dependent launch. Where neither depends on it, the
        // query is skipped: repeated calls on the legacy default stream (PyTorch's default)
        // or on our own stream.
        let needed = self.pdl == Pdl::Eager || !self.streams.quiet(key);
        let capturing = needed && streams::capturing(stream, self.rank)?;
        self.launch_pdl = self.pdl.for_call(capturing);
        self.streams.before(&mut self.events, key, capturing)?;
        issue(self)?;
        self.streams.after(&mut self.events, key, capturing)
    }

    /// Waits (bounded) for all work this communicator enqueued on any stream.
    fn wait_all(&mut self, op: &str) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.cuda_err("binding the context".into(), e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.cuda_err(format!("{op}: stream synchronize"), e))?;
        // Kernels give up by themselves after the timeout; allow them that and a margin.
        let deadline = std::time::Instant::now() + self.timeout + std::time::Duration::from_secs(2);
        if self.streams.drain(&mut self.events, deadline)? {
            return Ok(());
        }
        Err(Error::Cuda {
            rank: self.rank,
            op: op.into(),
            detail: format!(
                "work enqueued by this communicator still runs after {:?}",
                self.timeout
            ),
        })
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
        if count == 0 {
            return self.launch_empty(SgOp::AllReduce, dtype, op, stream);
        }
        if self.inter.is_some() {
            return self.launch_hierarchical(send, recv, count, dtype, op, stream);
        }
        let bytes = count * dtype.size();
        let zero_copy = self.zero_copy(send, recv, bytes);
        // The tuned CTA count of the row for this size, when the call runs that row's algorithm
        // (on peer memory: tables are not measured staged through host memory).
        let tuned = Some(&self.tune)
            .filter(|_| self.fabric != crate::plan::Fabric::HostStaged)
            .and_then(|t| t.lookup(self.world, dtype.size(), bytes))
            .filter(|e| e.algorithm() == Some(algo))
            .and_then(|e| e.ctas)
            .map(|c| c as usize);
        let (path, grid) = crate::plan::cuda_path(
            algo,
            bytes,
            zero_copy.is_some(),
            send == recv,
            &self.limits,
            tuned,
        );
        let f = self.gpu.function(path, dtype, op, self.rank)?;
        self.last_path = Some(PathInfo {
            name: path.name(),
            ctas: grid,
            registered: path.registered(),
        });
        let zero_copy = zero_copy.filter(|_| path.registered());
        let registered = |ptr| zero_copy.and_then(|_| self.region_at(ptr, bytes));
        let ident = CallIdentity {
            op: SgOp::AllReduce,
            path,
            dtype,
            reduce: op,
            count: count as u64,
            in_place: send == recv,
            send: registered(send),
            recv: registered(recv),
        };
        let mut args = self.kernel_args(send, recv, count, &ident, zero_copy);
        args.chunk_bytes =
            crate::plan::staged_chunk_bytes(self.fabric, bytes, self.slot_bytes) as u64;
        if path == CudaPath::Ce {
            return self.launch_ce(&args, dtype, op, grid, stream);
        }
        let threads = crate::plan::block_threads(path, bytes, grid, THREADS);
        self.launch_kernel(f, grid, threads, stream, &mut args, || {
            format!(
                "launching the {} kernel ({count} x {dtype} {op})",
                path.name()
            )
        })
    }

    /// Launches `f` on `stream` with `args` (copied at launch). With programmatic dependent
    /// launch (`self.launch_pdl`, set per call from `self.pdl`), the kernel may start while the kernel before it on `stream` finishes:
    /// every entry point waits on the device for that kernel's completion before it reads
    /// anything (`wait_for_previous_kernel` in convert.cuh), so stream order holds and only the
    /// launch gap is hidden. Stream capture turns the attribute into a programmatic edge of the
    /// graph.
    fn launch_kernel<A>(
        &self,
        f: sys::CUfunction,
        grid: u32,
        threads: u32,
        stream: sys::CUstream,
        args: &mut A,
        what: impl FnOnce() -> String,
    ) -> Result<()> {
        // `A`: the kernel's one by-value parameter (KernelArgs, or a struct that starts with it).
        let mut params = [(args as *mut A).cast::<c_void>()];
        // SAFETY: the kernel reads `args` (copied at launch) and only touches the buffers in it,
        // which the caller vouched for and we own.
        ck(
            unsafe {
                driver::launch(
                    f,
                    grid,
                    threads,
                    stream,
                    params.as_mut_ptr(),
                    self.launch_pdl,
                )
            },
            self.rank,
            what,
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
        // The calling thread may have no context or another one current (cuCtxGetCurrent, a
        // thread-local read; cuCtxSetCurrent only when it differs).
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.cuda_err("binding the context".into(), e))?;
        let bytes = count * dtype.size();
        // A count-0 call reads and writes nothing: its pointers may be anything, null included.
        if count > 0 {
            self.check_buffer("all_reduce", send as u64, bytes, "send")?;
            if recv as u64 != send as u64 {
                self.check_buffer("all_reduce", recv as u64, bytes, "recv")?;
            }
        }
        // CUDA's meaning: 0 is the legacy default stream.
        let stream = stream as sys::CUstream;
        self.enqueue(send as u64, recv as u64, count, dtype, op, algo, stream)
            .map_err(|e| self.in_job(e))
    }

    unsafe fn scatter_gather_raw(
        &mut self,
        what: SgOp,
        send: *const c_void,
        recv: *mut c_void,
        shards: crate::shards::Shards,
        dtype: DType,
        op: ReduceOp,
        stream: *mut c_void,
    ) -> Result<()> {
        if self.inter.is_some() {
            return Err(Error::invalid(
                self.inter.as_ref().map_or(self.rank, hier::Inter::rank),
                what.name(),
                "not available yet for jobs across nodes (the all-reduce is)",
            ));
        }
        // SAFETY: forwarded contract.
        unsafe {
            self.enqueue_scatter_gather(
                what,
                send as u64,
                recv as u64,
                shards,
                dtype,
                op,
                stream as sys::CUstream,
            )
        }
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
            fallback: self.ws.fallback.as_ref().map(|f| crate::backend::Fallback {
                rank: f.rank,
                peer: f.peer,
                check: f.check.to_string(),
                detail: f.detail.clone(),
            }),
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        let waited = self.wait_all("synchronize");
        // What a kernel recorded explains a failed wait better than the wait does.
        self.check_health().map_err(|e| self.in_job(e))?;
        waited.map_err(|e| self.in_job(e))
    }

    fn async_error(&self) -> Option<Error> {
        self.check_health().err().map(|e| self.in_job(e))
    }

    fn device(&self) -> Option<usize> {
        Some(self.ordinal)
    }

    fn fabric(&self) -> Fabric {
        self.fabric
    }

    fn own_stream(&self) -> Option<*mut c_void> {
        Some(self.stream.cu_stream().cast())
    }

    fn leave(&mut self, boot: &mut Bootstrap) {
        self.with_node_boot(boot, |c, b| c.teardown(b))
    }

    // Registration is a collective of the node's ranks (the ones that map each other's memory):
    // through the node's group when the job spans nodes. The closures call the node-local
    // steps, never these methods again (the group is taken out while they run).
    fn alloc_registered(&mut self, boot: &mut Bootstrap, bytes: usize) -> Result<RegisteredBuffer> {
        self.with_node_boot(boot, |c, b| {
            let device = c.device;
            c.add_region("alloc", bytes, |id| registry::alloc(b, device, bytes, id))
                .map_err(|e| c.in_job(e))
        })
    }

    unsafe fn register(
        &mut self,
        boot: &mut Bootstrap,
        ptr: u64,
        bytes: usize,
    ) -> Result<RegisteredBuffer> {
        self.with_node_boot(boot, |c, b| {
            let device = c.device;
            c.add_region("register", bytes, |id| {
                registry::register(b, device, ptr, bytes, id)
            })
            .map_err(|e| c.in_job(e))
        })
    }

    fn free_registered(&mut self, boot: &mut Bootstrap, buf: RegisteredBuffer) -> Result<()> {
        self.with_node_boot(boot, |c, b| c.free_here(b, buf).map_err(|e| c.in_job(e)))
    }

    fn last_path(&self) -> Option<PathInfo> {
        self.last_path
    }

    fn zero_copy_call(&self, send: u64, recv: u64, bytes: usize) -> bool {
        self.registry.lookup(send, bytes).is_some() && self.registry.lookup(recv, bytes).is_some()
    }

    fn use_tuning(&mut self, table: &crate::tune::Table) {
        self.tune = table.clone();
    }
}

impl CudaComm {
    /// `alloc_registered` and `register`: checks, then `make` shares the region (collective)
    /// under the next id, which is used up only if that succeeded (ids stay equal on every
    /// rank), and the registry takes it.
    fn add_region(
        &mut self,
        op: &'static str,
        bytes: usize,
        make: impl FnOnce(u64) -> Result<registry::Region>,
    ) -> Result<RegisteredBuffer> {
        self.bind()?;
        self.require_peer_memory(op, bytes)?;
        let id = self.next_region;
        let region = make(id)?;
        self.next_region += 1;
        let buf = RegisteredBuffer::new(region.base, region.bytes, id);
        self.registry.insert(region, self.rank)?;
        Ok(buf)
    }

    /// Frees registered `buf` among the ranks of `boot` (the node's).
    fn free_here(&mut self, boot: &mut Bootstrap, buf: RegisteredBuffer) -> Result<()> {
        // Our work on every stream that may touch it is done (bounded), then every peer's.
        self.wait_all("free")?;
        boot.barrier()?;
        self.remove_region(buf.id()).ok_or_else(|| {
            Error::invalid(
                self.rank,
                "free",
                format!("buffer {:#x} is not registered here", buf.ptr()),
            )
        })
    }

    /// Unregisters region `id` (its memory is released with it) and forgets what was known
    /// about its addresses, which may next hold anything. None if it was not registered.
    fn remove_region(&mut self, id: u64) -> Option<()> {
        let region = self.registry.remove(id)?;
        self.pointers.forget(region.base, region.bytes as u64);
        Some(())
    }

    /// Registered buffers are read and written by the peers' kernels: they need the peer
    /// transport (every rank takes the same transport, so all refuse together).
    fn require_peer_memory(&self, op: &'static str, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Err(Error::invalid(self.rank, op, "zero bytes"));
        }
        if self.ws.sharing().is_none() {
            return Err(Error::invalid(
                self.rank,
                op,
                "registered buffers need peer memory, and this communicator stages through \
                 host memory (IPCREDUCE_TRANSPORT=host, or peer access failed at start)",
            ));
        }
        Ok(())
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.cuda_err("binding the context".into(), e))
    }
}

/// The device of the CUDA context current on this thread, if there is one: a caller that
/// made its own context current (PyTorch does) gets its communicator on that GPU.
fn current_device(rank: usize) -> Result<Option<usize>> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one handle (null when no context is current).
    ck(unsafe { sys::cuCtxGetCurrent(&mut ctx) }, rank, || {
        "cuCtxGetCurrent".into()
    })?;
    if ctx.is_null() {
        return Ok(None);
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: writes one device handle of the current context.
    ck(unsafe { sys::cuCtxGetDevice(&mut dev) }, rank, || {
        "cuCtxGetDevice".into()
    })?;
    let count = cs::CudaContext::device_count().unwrap_or(0);
    for ordinal in 0..count {
        let mut d: sys::CUdevice = 0;
        // SAFETY: writes one device handle.
        if unsafe { sys::cuDeviceGet(&mut d, ordinal) } == sys::CUresult::CUDA_SUCCESS && d == dev {
            return Ok(Some(ordinal as usize));
        }
    }
    Ok(None)
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
        let err = require_driver(false).unwrap_err();
        assert!(err.to_string().contains("libcuda"), "{err}");
        require_driver(true).unwrap();
        // On this machine, whatever it has: an answer, never a panic.
        match (driver::driver_present(), usable()) {
            (false, Err(e)) => assert!(e.to_string().contains("libcuda"), "{e}"),
            (false, Ok(())) => panic!("usable without a driver"),
            (true, _) => {}
        }
    }
}
