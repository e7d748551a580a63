//! The backend's entry points ([`BackendOps`]): each call is bound to our context, its
//! buffers checked, ordered with the communicator's work on other streams, and handed to its
//! operation (allreduce.rs, scatter_gather.rs, hier.rs across nodes, NCCL when asked for),
//! which runs it through the launcher (launcher.rs).

use super::launcher::CallArgs;
use super::{
    allreduce, driver, fused_path, hier, nccl, pointers, registry, scatter_gather, streams,
    CudaComm,
};
use crate::backend::{BackendMeta, BackendOps, RegisteredBuffer, SgOp};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};
use crate::host_profile::{self, Phase};
use crate::plan::{Fabric, PathInfo};
use crate::shards::Shards;
use crate::types::{Algorithm, BackendKind, DType, ReduceOp};
use cudarc::driver::sys;
use std::ffi::c_void;

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
        self.bind()?;
        let call = CallArgs {
            send: send as u64,
            recv: recv as u64,
            count,
            dtype,
            op,
            // CUDA's meaning: 0 is the legacy default stream.
            stream: stream as sys::CUstream,
        };
        let bytes = call.bytes();
        // A count-0 call reads and writes nothing: its pointers may be anything, null included.
        if count > 0 {
            self.check_buffer("all_reduce", call.send, bytes, "send")?;
            if call.recv != call.send {
                self.check_buffer("all_reduce", call.recv, bytes, "recv")?;
            }
        }
        host_profile::lap(Phase::Pointers);
        self.enqueue(&call, algo).map_err(|e| self.in_job(e))
    }

    unsafe fn add_rms_norm_raw(
        &mut self,
        args: &crate::fused::AddRmsNorm,
        algo: Algorithm,
        stream: *mut c_void,
    ) -> Result<()> {
        self.bind()?;
        let name = SgOp::AddRmsNorm.name();
        if self.inter.is_some() {
            return Err(Error::invalid(
                self.inter.as_ref().map_or(self.rank, hier::Inter::rank),
                name,
                "not available yet for jobs across nodes (the all-reduce is)",
            ));
        }
        let shape = crate::fused::check(self.rank, args)?;
        if shape.tokens > 0 {
            let (size, n) = (args.dtype.size(), shape.count());
            for (ptr, bytes, what) in [
                (args.input as u64, n * size, "input"),
                (args.residual as u64, n * size, "residual"),
                (args.weight as u64, shape.hidden * size, "weight"),
                (args.out as u64, n * size, "out"),
                (args.residual_out as u64, n * size, "residual_out"),
                (args.fp8_out as u64, n, "fp8_out"),
                (args.fp8_scale as u64, 4, "fp8_scale"),
            ] {
                if ptr != 0 {
                    self.check_buffer(name, ptr, bytes, what)?;
                }
            }
        }
        let stream = stream as sys::CUstream;
        self.in_stream_order(stream, |c| {
            c.launch.begin()?;
            super::fused::launch(&mut c.launch, args, &shape, algo, stream)
        })
        .map_err(|e| self.in_job(e))
    }

    unsafe fn scatter_gather_raw(
        &mut self,
        what: SgOp,
        send: *const c_void,
        recv: *mut c_void,
        shards: Shards,
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
        let call = CallArgs {
            send: send as u64,
            recv: recv as u64,
            count: shards.total,
            dtype,
            op,
            stream: stream as sys::CUstream,
        };
        // SAFETY: forwarded contract.
        unsafe { self.scatter_gather(what, shards, &call) }
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
        self.launch.check_health().map_err(|e| self.in_job(e))?;
        waited.map_err(|e| self.in_job(e))
    }

    fn async_error(&self) -> Option<Error> {
        self.launch.check_health().err().map(|e| self.in_job(e))
    }

    fn device(&self) -> Option<usize> {
        Some(self.ordinal)
    }

    fn fabric(&self) -> Fabric {
        self.launch.fabric
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
        self.launch.last_path
    }

    fn zero_copy_call(&self, send: u64, recv: u64, bytes: usize) -> bool {
        self.registry.lookup(send, bytes).is_some() && self.registry.lookup(recv, bytes).is_some()
    }

    fn stamps_all_reduce(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
    ) -> bool {
        // Only our kernels within the node stamp (not NCCL, the empty call, the job across nodes).
        if self.launch.phases.is_none() || self.route(count, algo) != Route::InNode {
            return false;
        }
        let call = CallArgs {
            send,
            recv,
            count,
            dtype,
            op,
            stream: std::ptr::null_mut(),
        };
        allreduce::phase_stamped(
            &self.launch,
            &self.registry,
            &call,
            algo,
            self.prepared.as_ref(),
        )
    }

    fn stamps_fused(&self, s: &crate::fused::Shape, size: usize, algo: Algorithm) -> bool {
        // The path the launch will take (a shape it refuses runs nothing, so no stamps).
        self.launch.phases.is_some()
            && s.tokens > 0
            && self.inter.is_none()
            && fused_path::layout(
                self.rank,
                self.launch.world,
                self.launch.fused_forced,
                algo,
                self.launch.slot_bytes,
                s,
                size,
            )
            .is_ok_and(|l| l.path.phase_stamped())
    }

    fn stamps_scatter_gather(&self, total: usize) -> bool {
        // Every path of scatter_gather.rs stamps (kernel_variants.rs); an empty call runs the
        // empty kernel, left to its events as for the all-reduce.
        self.launch.phases.is_some() && total > 0 && self.inter.is_none()
    }

    fn use_tuning(&mut self, table: &crate::tune::Table) {
        self.launch.tune = table.clone();
        // The kept call's CTA count may have come from the old table.
        self.prepared = None;
    }
}

/// Who runs an all-reduce ([`CudaComm::route`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    /// NCCL (`Algorithm::Nccl`).
    Nccl,
    /// Count 0: the empty kernel, which compares the identity only.
    Empty,
    /// The job spans nodes: the hierarchical all-reduce.
    AcrossNodes,
    /// Our kernels (or copy engines) within the node.
    InNode,
}

impl CudaComm {
    /// One all-reduce on `call.stream`, in order with the communicator's calls on other
    /// streams.
    pub(super) fn enqueue(&mut self, call: &CallArgs, algo: Algorithm) -> Result<()> {
        self.in_stream_order(call.stream, |c| c.all_reduce(call, algo))
    }

    /// The all-reduce `call` by algorithm `algo`: NCCL, an empty call, the hierarchical one
    /// across nodes, or one of ours within the node.
    fn all_reduce(&mut self, call: &CallArgs, algo: Algorithm) -> Result<()> {
        self.launch.begin()?;
        match self.route(call.count, algo) {
            Route::Nccl => self.all_reduce_nccl(call),
            Route::Empty => self
                .launch
                .empty(SgOp::AllReduce, call.dtype, call.op, call.stream),
            Route::AcrossNodes => {
                let inter = self.inter.as_mut().expect("Route::AcrossNodes has one");
                hier::all_reduce(&mut self.launch, &self.registry, inter, call, &mut |_| {
                    Ok(())
                })
            }
            Route::InNode => allreduce::launch(
                &mut self.launch,
                &self.registry,
                &mut self.ce,
                call,
                algo,
                &mut self.prepared,
            ),
        }
    }

    /// Who runs an all-reduce of `count` elements by `algo` (what [`Self::all_reduce`] does,
    /// and what [`BackendOps::stamps_all_reduce`] asks).
    fn route(&self, count: usize, algo: Algorithm) -> Route {
        if algo == Algorithm::Nccl {
            Route::Nccl
        } else if count == 0 {
            Route::Empty
        } else if self.inter.is_some() {
            Route::AcrossNodes
        } else {
            Route::InNode
        }
    }

    /// The all-reduce `call` handed to NCCL.
    fn all_reduce_nccl(&mut self, call: &CallArgs) -> Result<()> {
        self.launch.last_path = Some(PathInfo {
            name: "nccl",
            ctas: 0,
            registered: false,
        });
        let rank = self.rank;
        let nccl = self.nccl.as_mut().map_err(|why| {
            Error::invalid(rank, "all_reduce", format!("NCCL unavailable: {why}"))
        })?;
        // SAFETY: pointers checked by the caller.
        unsafe {
            nccl.all_reduce(
                call.send as *const c_void,
                call.recv as *mut c_void,
                call.count,
                call.dtype,
                call.op,
                call.stream,
            )
        }
    }

    /// Checks and enqueues one reduce-scatter (`call.send`: `shards.total` elements,
    /// `call.recv`: shard `rank`'s) or all-gather (`call.send`: shard `rank`'s, `call.recv`:
    /// `shards.total`), in order with the communicator's other calls. Sizes, overlap and
    /// in-place forms were checked by the caller.
    ///
    /// # Safety
    /// Both pointers must be device memory of this communicator's GPU, valid for the sizes
    /// above.
    unsafe fn scatter_gather(&mut self, what: SgOp, shards: Shards, call: &CallArgs) -> Result<()> {
        self.bind()?;
        if shards.parts != self.world || what == SgOp::AllReduce {
            return Err(Error::invalid(
                self.rank,
                what.name(),
                format!(
                    "{} shards for a communicator of {} ranks",
                    shards.parts, self.world
                ),
            ));
        }
        let size = call.dtype.size();
        let (send_bytes, recv_bytes) = scatter_gather::buffer_bytes(what, shards, self.rank, size);
        let name = what.name();
        for (ptr, bytes, which) in [
            (call.send, send_bytes, "send"),
            (call.recv, recv_bytes, "recv"),
        ] {
            if bytes > 0 {
                self.check_buffer(name, ptr, bytes, which)?;
            }
        }
        self.in_stream_order(call.stream, |c| {
            scatter_gather::launch(&mut c.launch, &c.registry, what, shards, call)
        })
    }

    /// Runs `issue` (which enqueues on `stream`) in order with the communicator's work on
    /// its other streams.
    pub(super) fn in_stream_order(
        &mut self,
        stream: sys::CUstream,
        issue: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let key = stream as streams::Key;
        // The capture decides the call's origin (stamped into its identity, so a replay never
        // pairs with an eager call or another graph's call on a peer), whether the tracker may
        // record and wait on events (not during capture: the graph orders its calls), and,
        // with Pdl::Eager, whether kernels are launched with programmatic dependent launch.
        let capture = streams::capture(stream, self.rank)?;
        host_profile::lap(Phase::Capture);
        let capturing = capture.is_some();
        self.launch.origin = self.captures.origin(capture);
        self.launch.launch_pdl = self.launch.pdl.for_call(capturing);
        self.streams.before(&mut self.events, key, capturing)?;
        host_profile::lap(Phase::Order);
        issue(self)?;
        host_profile::lap(Phase::Launch);
        let r = self.streams.after(&mut self.events, key, capturing);
        host_profile::lap(Phase::After);
        r
    }

    /// The reference add + RMSNorm of an already all-reduced `args.input` on `stream` (no
    /// peers: for the tests' comparison with the fused call).
    ///
    /// # Safety
    /// As [`crate::Communicator::all_reduce_add_rms_norm_raw`].
    #[cfg(feature = "test-support")]
    pub unsafe fn add_rms_norm_reference(
        &mut self,
        args: &crate::fused::AddRmsNorm,
        stream: *mut c_void,
    ) -> Result<()> {
        self.bind()?;
        super::fused::reference(&self.launch, args, stream as sys::CUstream)
    }

    /// Waits (bounded) for all work this communicator enqueued on any stream.
    pub(super) fn wait_all(&mut self, op: &str) -> Result<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| self.cuda_err(format!("{op}: stream synchronize"), e))?;
        // Kernels give up by themselves after the timeout; allow them that and a margin.
        let timeout = self.launch.timeout;
        let deadline = std::time::Instant::now() + timeout + std::time::Duration::from_secs(2);
        if self.streams.drain(&mut self.events, deadline)? {
            return Ok(());
        }
        Err(Error::Cuda {
            rank: self.rank,
            op: op.into(),
            detail: format!("work enqueued by this communicator still runs after {timeout:?}"),
        })
    }

    /// Refuses a buffer of `bytes` at `ptr` the kernels cannot use in operation `op` (named in
    /// the error): another GPU's memory or host memory (the kernel's access would fault and end
    /// the process's CUDA context), or one that runs past the end of its allocation (the
    /// kernels would read and write what lies behind it). Registered buffers are known to be
    /// ours; for anything else the driver is asked once per allocation (pointers.rs), so later
    /// calls in it cost no query.
    fn check_buffer(&mut self, op: &'static str, ptr: u64, bytes: usize, what: &str) -> Result<()> {
        if self.registry.lookup(ptr, bytes).is_some() {
            return Ok(());
        }
        let rank = self.rank;
        let failed = |at: u64, res| {
            let piece = if at == ptr {
                String::new()
            } else {
                format!(" at {at:#x}")
            };
            let why = driver::describe(res);
            format!("{what} buffer {ptr:#x}: cuPointerGetAttributes{piece} failed ({why})")
        };
        let mine = self.ordinal;
        self.pointers
            .check(ptr, bytes, what, mine, |at| {
                pointers::query(at).map_err(|res| failed(at, res))
            })
            .map_err(|why| Error::invalid(rank, op, why))
    }

    /// An error of the node's communicator in the job's terms (see hier.rs); as it is within
    /// one node.
    pub(super) fn in_job(&self, e: Error) -> Error {
        match &self.inter {
            Some(i) => i.in_job(e),
            None => e,
        }
    }

    /// Runs `f` with the bootstrap the node's collectives use: the node's group when the job
    /// spans nodes, else `boot` (the job's).
    pub(super) fn with_node_boot<R>(
        &mut self,
        boot: &mut Bootstrap,
        f: impl FnOnce(&mut Self, &mut Bootstrap) -> R,
    ) -> R {
        let taken = self.inter.as_mut().and_then(|i| i.group.take());
        match taken {
            None => f(self, boot),
            Some(mut group) => {
                let r = f(self, &mut group);
                if let Some(i) = self.inter.as_mut() {
                    i.group = Some(group);
                }
                r
            }
        }
    }

    pub(super) fn cuda_err(&self, op: String, e: cudarc::driver::DriverError) -> Error {
        driver::from_cudarc(self.rank, op, e)
    }

    pub(super) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.cuda_err("binding the context".into(), e))
    }
}
