//! The public entry point: a communicator over the ranks of one job.

use crate::backend::{self, BackendMeta, BackendOps};
#[cfg(feature = "test-support")]
use crate::backend::{BufId, Call};
use crate::bootstrap::{Bootstrap, RankInfo};
use crate::config::Config;
use crate::element::{as_bytes, as_bytes_mut, Element};
use crate::error::{Error, Result};
use crate::plan;
use crate::types::{Algorithm, BackendChoice, BackendKind, DType, ReduceOp};
use std::ffi::c_void;

/// A group of ranks that all-reduce together.
pub struct Communicator {
    // Field order matters: the backend (mappings of peers' memory) goes before the bootstrap
    // (connections) so a peer never sees us leave while we still use its memory.
    backend: Box<dyn BackendOps>,
    boot: Bootstrap,
    algo_env: Option<Algorithm>,
    /// `Config::reg_oneshot_max_bytes`: `Auto`'s one-shot limit for zero-copy calls.
    reg_oneshot_max: Option<usize>,
    /// Rank 0's tuning table (see [`crate::tune`]), consulted by `Auto`.
    tune: crate::tune::Table,
    /// Process-unique: marks the registered buffers this communicator made, so that `free`
    /// can refuse another communicator's (their own ids are small integers per communicator).
    token: u64,
    /// The last calls' identities, written to a file when a call fails (see [`crate::flight`]).
    flight: crate::flight::Recorder,
}

/// The next communicator's [`Communicator::token`] (0 is never handed out: no owner).
static NEXT_TOKEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Communicator {
    /// Joins the job described by the environment (see [`RankInfo::from_env`]); `config`'s
    /// unset knobs come from the environment (see [`Config::resolve`]).
    pub fn init(config: &Config) -> Result<Communicator> {
        Self::with_rank_info(RankInfo::from_env()?, config)
    }

    /// Joins the job described by `info`.
    pub fn with_rank_info(info: RankInfo, config: &Config) -> Result<Communicator> {
        let mut phases = crate::phases::Phases::start("init");
        crate::host_profile::init();
        let config = config.resolve()?;
        let mut flight = crate::flight::Recorder::from_env()?;
        let algo_env = config.algo;
        let reg_oneshot_max = config.reg_oneshot_max_bytes;
        let mut boot = Bootstrap::connect(info, config.timeout())?;
        phases.mark("bootstrap");
        flight.identify(crate::flight::Identity {
            job: boot.info().job_id.clone(),
            rank: boot.rank(),
            world: boot.world(),
            host: boot.info().host_id.clone(),
        });
        let kind = agree_on_backend(&mut boot, config.backend)?;
        boot.layout().check_backend(kind)?;
        let mut backend: Box<dyn BackendOps> = match kind {
            BackendKind::Host => Box::new(backend::host::HostComm::new(&mut boot, &config)?),
            // Across hosts: peer memory inside each node, NCCL between nodes.
            BackendKind::Cuda if boot.layout().node_count() > 1 => Box::new(
                backend::cuda::CudaComm::new_across_nodes(&mut boot, &config)?,
            ),
            BackendKind::Cuda => Box::new(backend::cuda::CudaComm::new(&mut boot, &config)?),
        };
        if let Some(c) = backend
            .as_any_mut()
            .downcast_mut::<backend::cuda::CudaComm>()
        {
            flight.attach_stamps(c.phase_stamps());
        }
        phases.mark("backend");
        if kind == BackendKind::Cuda {
            // Its context is current on this thread now.
            flight.attach_device();
        }
        // The tuning hook: every rank uses rank 0's measured table.
        let tune = crate::tune::agree(&mut boot, kind, backend.device(), backend.fabric())?;
        backend.use_tuning(&tune);
        phases.mark("tuning table");
        phases.log(boot.rank());
        Ok(Communicator {
            backend,
            boot,
            algo_env,
            reg_oneshot_max,
            tune,
            token: NEXT_TOKEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            flight,
        })
    }

    pub fn rank(&self) -> usize {
        self.boot.rank()
    }

    /// Makes the communicator unusable on every rank at once: calls in flight stop (kernels and
    /// host waits poll the flag), later calls fail with [`Error::Aborted`] carrying `reason`,
    /// and every peer is told within milliseconds (the liveness connections). May be called
    /// from another thread through [`Communicator::abort_handle`].
    pub fn abort(&self, reason: impl Into<String>) {
        self.boot.abort_state().abort(reason);
    }

    /// Whether the communicator is aborted (here or on any rank that told us): every call
    /// then fails with [`Error::Aborted`]; only a new communicator can go on.
    pub fn is_aborted(&self) -> bool {
        self.boot.abort_state_ref().is_aborted()
    }

    /// Runs one call that peers take part in, under the rule that makes errors seen by every
    /// rank:
    /// - on an aborted communicator it is refused at once with [`Error::Aborted`] (the first
    ///   reason, naming the rank that failed and why);
    /// - if it fails on this rank for any reason (a bad argument, a buffer the backend refuses,
    ///   an unavailable algorithm, a failed step), it returns that error unchanged and aborts
    ///   the communicator with it, which every peer learns at once: they are, or will be,
    ///   waiting in the same call, and a rank that returned alone would leave them waiting for
    ///   the full timeout and pair every later call off by one. That includes calls that
    ///   cannot even be described (slices of different lengths, a count that overflows): peers
    ///   cannot tell a call never made from a late one.
    ///
    /// Not under this rule, since no peer waits on them: queries (`unavailable`, `resolve`,
    /// `async_error`, ...), [`Communicator::host_buffer`] (a local allocation; the caller may
    /// free memory and retry) and the registered-buffer calls on the host backend, which
    /// refuse alike on every rank before anything collective starts. Ask
    /// [`Communicator::unavailable`] before requesting an algorithm that may be missing.
    fn collective<R>(&mut self, call: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        if let Some(e) = self.refusal() {
            return Err(self.flight.note(e));
        }
        self.attempt(call)
    }

    /// The error a call on an aborted communicator is refused with, if it is aborted.
    fn refusal(&self) -> Option<Error> {
        // The flag first: a healthy communicator's call takes no lock here.
        let state = self.boot.abort_state_ref();
        let reason = state.is_aborted().then(|| state.reason()).flatten()?;
        Some(Error::Aborted {
            rank: self.rank(),
            reason,
        })
    }

    /// [`Self::collective`] past the refusal: runs `call`, aborting the communicator if it fails.
    fn attempt<R>(&mut self, call: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        let r = call(self);
        if let Err(e) = r {
            // A failure the backend already turned into an abort (mismatch, timeout, a peer's
            // abort) keeps its first reason: this is a no-op then. Peers are told before the
            // flight record is written, and without its file (they name their own).
            self.boot.abort_state_ref().abort(e.to_string());
            return Err(self.flight.note(e));
        }
        r
    }

    /// A host-slice call, which checks its slices and calls a raw one: [`Self::attempt`], not
    /// [`Self::collective`], since the raw call refuses an aborted communicator itself,
    /// recording the call it refuses (see [`Self::recorded`]).
    fn slice_call<R>(&mut self, call: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        self.attempt(call)
    }

    /// [`Self::collective`] for a call the flight recorder keeps: `id` is what the caller
    /// asked for, recorded before the call and marked when it returns.
    fn recorded<R>(
        &mut self,
        id: crate::flight::CallId,
        call: impl FnOnce(&mut Self) -> Result<R>,
    ) -> Result<R> {
        if let Some(e) = self.refusal() {
            // A peer's abort that reached this rank before its call: the call is still this
            // rank's first failure, recorded as such, so that every rank's record and trace
            // show the call it was making. Later refusals leave the ring as it was.
            if !self.flight.has_failed() {
                self.flight.begin(&id);
                self.flight.end(false);
            }
            return Err(self.flight.note(e));
        }
        self.attempt(|c| {
            c.flight.begin(&id);
            let r = call(c);
            c.flight.end(r.is_ok());
            r
        })
    }

    /// The error that made the communicator unusable, or one a kernel recorded, if any; does
    /// not wait (as `ncclCommGetAsyncError`). A watchdog polls it.
    pub fn async_error(&self) -> Option<Error> {
        self.backend.async_error()
    }

    /// cuda: the GPU ordinal the communicator runs on (its primary context): where callers
    /// allocate the buffers they pass. None on the host backend.
    pub fn cuda_device(&self) -> Option<usize> {
        self.backend.device()
    }

    /// cuda: the communicator's own stream (a `CUstream`), for callers without one; work
    /// on it is waited for at teardown like any call's. None on the host backend.
    pub fn cuda_stream(&self) -> Option<*mut c_void> {
        self.backend.own_stream()
    }

    /// A handle another thread (a watchdog) can keep to abort this communicator and see
    /// whether it is aborted.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            rank: self.rank(),
            state: self.boot.abort_state(),
        }
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

    /// What the data crosses (cuda: peer memory, under the PCIe policy or not, or host
    /// staging), as every rank agreed at init; it shapes `Auto`'s rules.
    pub fn fabric(&self) -> crate::plan::Fabric {
        self.backend.fabric()
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
            self.backend.fabric(),
            self.world(),
            bytes,
        )
    }

    /// The algorithm a call of `count` elements of `dtype` runs with `requested`: `Auto`
    /// takes the tuning table's choice for this world, element size and size when it has one
    /// (and it can run), else [`Communicator::resolve`]'s size rule.
    pub fn resolve_for(&self, requested: Algorithm, dtype: DType, bytes: usize) -> Algorithm {
        self.resolve_call(requested, dtype, bytes, false)
    }

    /// [`Communicator::resolve_for`] for a call whose send and recv lie in registered buffers
    /// when `zero_copy` (cuda): without a tuned row, `Auto` follows
    /// [`plan::choose_zero_copy`]'s size rule for them.
    pub fn resolve_call(
        &self,
        requested: Algorithm,
        dtype: DType,
        bytes: usize,
        zero_copy: bool,
    ) -> Algorithm {
        // Tables are keyed by the GPUs and their P2P, not by the transport: one measured on
        // peer memory says nothing about staging through host memory (forced, or a fallback).
        let tunable = self.backend.fabric() != crate::plan::Fabric::HostStaged;
        if requested == Algorithm::Auto && self.algo_env.is_none() && tunable {
            let tuned = self
                .tune
                .lookup(self.world(), dtype.size(), bytes)
                .and_then(crate::tune::Entry::algorithm)
                .filter(|a| self.backend.unavailable(*a).is_none());
            if let Some(a) = tuned {
                return a;
            }
        }
        if zero_copy && self.backend() == BackendKind::Cuda {
            return plan::choose_zero_copy(
                requested,
                self.algo_env,
                self.world(),
                bytes,
                self.reg_oneshot_max,
            );
        }
        self.resolve(requested, bytes)
    }

    /// The tuning table every rank uses (rank 0's; empty: the built-in rules).
    pub fn tune_table(&self) -> &crate::tune::Table {
        &self.tune
    }

    /// All-reduce on raw pointers: device pointers and a `CUstream` (null = the legacy
    /// default stream, as in CUDA; [`Self::cuda_stream`] is the communicator's own) for cuda,
    /// host pointers for host. This is what language
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
        let id = crate::flight::CallId {
            op: backend::SgOp::AllReduce,
            count,
            dtype,
            reduce: op,
            in_place: send == recv.cast_const(),
            stream,
        };
        crate::host_profile::begin();
        let r = self.recorded(id, |c| {
            c.check_args(send, recv, count, dtype)?;
            // Count 0 goes to the backend too: it is a call like any other, whose identity
            // every rank compares (a count-0 call against a real one is a mismatch).
            let bytes = count * dtype.size();
            let zero_copy = c.backend.zero_copy_call(send as u64, recv as u64, bytes);
            let algo = c.resolve_call(algo, dtype, bytes, zero_copy);
            c.flight.path(algo);
            c.flight.device_work(|| {
                c.backend
                    .stamps_all_reduce(send as u64, recv as u64, count, dtype, op, algo)
            });
            crate::host_profile::lap(crate::host_profile::Phase::Checks);
            // SAFETY: checked above; the caller vouches for the memory.
            let r = unsafe {
                c.backend
                    .all_reduce_raw(send, recv, count, dtype, op, algo, stream)
            };
            crate::host_profile::lap(crate::host_profile::Phase::Rest);
            // The kernel path, for the trace.
            if let Some(name) = r.is_ok().then(|| c.path_ran(count)).flatten() {
                c.flight.kernel(name);
            }
            r
        });
        crate::host_profile::end(r.is_ok());
        r
    }

    /// All-reduce of `args.input` over the ranks, then residual add and RMSNorm (and an FP8
    /// copy of the result when `args.fp8_out` is set), in one call; the numerics and the
    /// aliasing rules are [`crate::fused`]'s. `algo`: `Auto` (chosen by size), `OneShot` or
    /// `TwoShot`; others are refused. Every rank must pass the same shape, eps and outputs
    /// (a difference is a mismatch error on every rank).
    ///
    /// # Safety
    /// The pointers must be valid for the sizes [`crate::AddRmsNorm`] gives (device pointers
    /// of this communicator's device on cuda, host pointers on host), on `stream` (cuda;
    /// null = the communicator's stream).
    pub unsafe fn all_reduce_add_rms_norm_raw(
        &mut self,
        args: &crate::fused::AddRmsNorm,
        algo: Algorithm,
        stream: *mut c_void,
    ) -> Result<()> {
        let id = crate::flight::CallId {
            op: backend::SgOp::AddRmsNorm,
            count: args.tokens.wrapping_mul(args.hidden),
            dtype: args.dtype,
            reduce: ReduceOp::Sum,
            in_place: args.out.cast_const() == args.input,
            stream,
        };
        self.recorded(id, |c| {
            let shape = crate::fused::check(c.rank(), args)?;
            let algo = match algo {
                Algorithm::Auto | Algorithm::OneShot | Algorithm::TwoShot => {
                    // IPCREDUCE_ALGO applies as to the all-reduce, but nccl has no fused form.
                    let requested = match (algo, c.algo_env) {
                        (Algorithm::Auto, Some(e)) if e != Algorithm::Nccl => e,
                        (a, _) => a,
                    };
                    crate::fused::choose(
                        requested,
                        c.backend(),
                        c.backend.fabric(),
                        c.world(),
                        &shape,
                        args.dtype.size(),
                    )
                }
                other => {
                    return Err(Error::invalid(
                        c.rank(),
                        crate::fused::NAME,
                        format!("runs auto, oneshot or twoshot, not {other}"),
                    ))
                }
            };
            c.flight.path(algo);
            c.flight
                .device_work(|| c.backend.stamps_fused(&shape, args.dtype.size(), algo));
            // SAFETY: checked above; the caller vouches for the memory.
            unsafe { c.backend.add_rms_norm_raw(args, algo, stream) }
        })
    }

    /// The reference add + RMSNorm (cuda): `args.input` holds rows already all-reduced; the
    /// same epilogue as [`Self::all_reduce_add_rms_norm_raw`] runs on them, on this rank alone
    /// (no peers, no call number), so tests can compare the fused call with the unfused one.
    ///
    /// # Safety
    /// As [`Self::all_reduce_add_rms_norm_raw`].
    #[cfg(feature = "test-support")]
    pub unsafe fn add_rms_norm_reference_raw(
        &mut self,
        args: &crate::fused::AddRmsNorm,
        stream: *mut c_void,
    ) -> Result<()> {
        let rank = self.rank();
        match self
            .backend
            .as_any_mut()
            .downcast_mut::<backend::cuda::CudaComm>()
        {
            // SAFETY: forwarded contract.
            Some(c) => unsafe { c.add_rms_norm_reference(args, stream) },
            None => Err(Error::invalid(
                rank,
                crate::fused::NAME,
                "the reference kernel needs the cuda backend",
            )),
        }
    }

    /// All-reduce of host slices (host backend).
    pub fn all_reduce_host<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<()> {
        self.slice_call(|c| {
            c.require_host("all_reduce_host")?;
            if send.len() != recv.len() {
                return Err(Error::invalid(
                    c.rank(),
                    "all_reduce_host",
                    format!("send has {} elements, recv {}", send.len(), recv.len()),
                ));
            }
            let (s, r) = (as_bytes(send), as_bytes_mut(recv));
            // SAFETY: both are live slices of the right length; &/&mut guarantee no overlap.
            unsafe {
                c.all_reduce_raw(
                    s.as_ptr().cast(),
                    r.as_mut_ptr().cast(),
                    send.len(),
                    T::DTYPE,
                    op,
                    algo,
                    std::ptr::null_mut(),
                )
            }
        })
    }

    /// In-place all-reduce of a host slice (host backend).
    pub fn all_reduce_host_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<()> {
        self.slice_call(|c| {
            c.require_host("all_reduce_host_in_place")?;
            let b = as_bytes_mut(buf);
            let p = b.as_mut_ptr().cast::<c_void>();
            // SAFETY: one live slice used as both input and output.
            unsafe { c.all_reduce_raw(p, p, buf.len(), T::DTYPE, op, algo, std::ptr::null_mut()) }
        })
    }

    /// `len` zeroed elements in this rank's shared arena (host backend). An all-reduce whose
    /// send buffer lies there (out of place, or in place) skips the copy into the workspace:
    /// peers read it directly. Allocate like a collective (same lengths, same order on every
    /// rank): a call's input must lie at the same offset on every rank, or in the arena on
    /// none, else it fails with a mismatch on every rank. The buffer stays valid after the
    /// communicator is dropped.
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
            // No buffer is touched: any pointers (null included) will do.
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

    /// Why `algo` cannot run on this communicator, if it cannot.
    pub fn unavailable(&self, algo: Algorithm) -> Option<String> {
        self.backend.unavailable(algo)
    }

    /// Waits until the work this communicator enqueued is finished (cuda), and reports an
    /// error a kernel recorded.
    pub fn synchronize(&mut self) -> Result<()> {
        // A kernel's error is a failed call: every rank learns it (see `collective`).
        self.collective(|c| c.backend.synchronize())
    }
}

/// Buffers owned by the backend, for the benchmark and the checks (`test-support` feature).
#[cfg(feature = "test-support")]
impl Communicator {
    fn test_buffers(&mut self) -> &mut dyn backend::TestBuffers {
        let any = self.backend.as_any_mut();
        if any.is::<backend::host::HostComm>() {
            any.downcast_mut::<backend::host::HostComm>()
                .expect("checked above")
        } else {
            any.downcast_mut::<backend::cuda::CudaComm>()
                .expect("the backend is host or cuda")
        }
    }

    pub fn test_alloc(&mut self, bytes: usize) -> Result<BufId> {
        self.test_buffers().alloc(bytes)
    }
    pub fn test_free(&mut self, id: BufId) {
        self.test_buffers().free(id)
    }
    pub fn test_write(&mut self, id: BufId, data: &[u8]) -> Result<()> {
        self.test_buffers().write(id, data)
    }
    pub fn test_read(&mut self, id: BufId, out: &mut [u8]) -> Result<()> {
        self.test_buffers().read(id, out)
    }
    /// Runs one call on backend-owned buffers (algorithm resolved here).
    pub fn test_run(&mut self, call: &Call) -> Result<()> {
        let c = self.test_resolved(call);
        // Recorded as the public calls are, so that the fault scenarios leave flight records.
        self.flight.begin(&crate::flight::CallId {
            op: backend::SgOp::AllReduce,
            count: c.count,
            dtype: c.dtype,
            reduce: c.op,
            in_place: c.send == c.recv,
            // The stream it runs on (the device timeline records its events there).
            stream: self.backend.own_stream().unwrap_or(std::ptr::null_mut()),
        });
        self.flight.path(c.algo);
        self.flight.device_work(|| false);
        let r = self.test_buffers().run(&c);
        self.flight.end(r.is_ok());
        r.map_err(|e| self.flight.note(e))
    }

    /// `call` with its algorithm resolved as a public call on the same kind of buffers would
    /// be: the tuning table, then the zero-copy rule for registered buffers or the plain one.
    fn test_resolved(&mut self, call: &Call) -> Call {
        let mut c = *call;
        let zero_copy = self.test_buffers().zero_copy(&c);
        c.algo = self.resolve_call(c.algo, c.dtype, c.count * c.dtype.size(), zero_copy);
        c
    }
    /// Across nodes (cuda): mean microseconds of the hierarchical all-reduce's three steps
    /// (intra-node reduce-scatter, NCCL between nodes, intra-node all-gather) of `call`; None
    /// within one node or on the host backend.
    pub fn test_time_phases(
        &mut self,
        call: &Call,
        warmup: usize,
        iters: usize,
    ) -> Result<Option<[f64; 3]>> {
        match self
            .backend
            .as_any_mut()
            .downcast_mut::<backend::cuda::CudaComm>()
        {
            Some(cuda) => cuda.time_phases(call, warmup, iters),
            None => Ok(None),
        }
    }

    /// Mean microseconds per call; see [`backend::TestBuffers::time`].
    pub fn test_time(
        &mut self,
        call: &Call,
        warmup: usize,
        iters: usize,
        graph: Option<usize>,
    ) -> Result<f64> {
        let c = self.test_resolved(call);
        self.test_buffers().time(&c, warmup, iters, graph)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Collective and bounded (see the backends' `leave`); then the backend's memory goes,
        // then the connections (field order).
        self.backend.leave(&mut self.boot);
        // After the leave, so that peers are not kept waiting for a file write; before the
        // backend's context goes (field order), which the device timeline's events belong to.
        self.flight.close_all();
        crate::host_profile::report(self.rank());
    }
}

/// Aborts a communicator from any thread; see [`Communicator::abort_handle`].
#[derive(Clone)]
pub struct AbortHandle {
    rank: usize,
    state: std::sync::Arc<crate::abort::AbortState>,
}

impl AbortHandle {
    /// As [`Communicator::abort`].
    pub fn abort(&self, reason: impl Into<String>) {
        self.state.abort(reason)
    }

    /// Why the communicator was aborted, if it was.
    pub fn error(&self) -> Option<Error> {
        self.state.reason().map(|reason| Error::Aborted {
            rank: self.rank,
            reason,
        })
    }
}

// --- registered (zero-copy) buffers and path reports (cuda data plane) ---------------------

impl Communicator {
    /// Collective (every rank, same size, same order): `bytes` of device memory that every peer
    /// maps. An all-reduce whose send and recv lie in registered buffers (at the same offsets on
    /// every rank) reads and writes them directly, with no staging copy; this also holds inside
    /// CUDA graphs. cuda backend only (the host backend's zero-copy buffers: [`Self::host_buffer`]).
    pub fn alloc(&mut self, bytes: usize) -> Result<crate::RegisteredBuffer> {
        let token = self.token;
        self.registered_call(|c| c.backend.alloc_registered(&mut c.boot, bytes))
            .map(|b| b.owned_by(token))
    }

    /// Collective: registers `[ptr, ptr + bytes)` of memory the caller allocated with
    /// `cuMemCreate` (POSIX fd handle type) and mapped; anything else is refused with an error
    /// that says how to allocate.
    ///
    /// # Safety
    /// The memory must stay allocated and mapped until the buffer is freed or the communicator
    /// is dropped.
    pub unsafe fn register(&mut self, ptr: u64, bytes: usize) -> Result<crate::RegisteredBuffer> {
        let token = self.token;
        // SAFETY: forwarded contract.
        self.registered_call(|c| unsafe { c.backend.register(&mut c.boot, ptr, bytes) })
            .map(|b| b.owned_by(token))
    }

    /// Collective: waits for this rank's work and for every rank (bounded), then unmaps. Buffers
    /// not freed are released when the communicator is dropped.
    /// A buffer another communicator made is refused with [`Error::InvalidArgument`] (its id
    /// would name one of ours).
    pub fn free(&mut self, buf: crate::RegisteredBuffer) -> Result<()> {
        self.registered_call(|c| {
            if !buf.is_owned_by(c.token) {
                return Err(Error::invalid(
                    c.rank(),
                    "free",
                    format!(
                        "the registered buffer at {:#x} ({} bytes) belongs to another \
                         communicator; free it with the one whose alloc or register made it",
                        buf.ptr(),
                        buf.bytes()
                    ),
                ));
            }
            c.backend.free_registered(&mut c.boot, buf)
        })
    }

    /// A registered-buffer call: collective on cuda (see `collective`); on the host backend,
    /// which has none, refused alike on every rank before anything collective starts, so the
    /// communicator stays usable.
    fn registered_call<R>(&mut self, call: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        if self.backend() == BackendKind::Host {
            return call(self);
        }
        self.collective(call)
    }

    /// What the last all-reduce issued by this rank ran: path, CTAs, zero-copy or not.
    pub fn last_path(&self) -> Option<crate::PathInfo> {
        self.backend.last_path()
    }

    /// The path the backend took for the call just enqueued, of `elements` in all: none for a
    /// call of none, which runs no kernel (the backend's last path is then the call before's).
    fn path_ran(&self, elements: usize) -> Option<&'static str> {
        (elements > 0)
            .then(|| self.backend.last_path())
            .flatten()
            .map(|p| p.name)
    }

    /// Tells the flight recorder the path the backend took for the call just enqueued (the
    /// operations whose path the backend chooses alone), of `elements` in all.
    fn note_path_taken(&mut self, elements: usize) {
        if let Some(name) = self.path_ran(elements) {
            self.flight.path_taken(name);
        }
    }

    /// Calls this rank's flight recorder has seen (the latest call's number): the mark that
    /// [`Self::write_trace`] writes the calls after.
    pub fn traced_calls(&self) -> u64 {
        self.flight.calls()
    }

    /// Writes this rank's calls after `since` (a [`Self::traced_calls`] mark; 0: every call
    /// the recorder still holds, the last `IPCREDUCE_FLIGHT`) into `dir` as
    /// `ipcreduce-trace-<job>-rank<r>.jsonl`, the file `IPCREDUCE_TRACE` writes at close
    /// (replaced if there), for `ipcreduce trace export` / `summarize` of a part of a run; with
    /// `IPCREDUCE_TIMELINE=1`, when each call ran on its stream. Not collective: each rank
    /// writes its own, into the same `dir`. Returns the file's path.
    pub fn write_trace(
        &mut self,
        dir: impl AsRef<std::path::Path>,
        since: u64,
    ) -> Result<std::path::PathBuf> {
        let rank = self.rank();
        self.flight
            .write_trace(dir.as_ref(), since)
            .map_err(|why| Error::invalid(rank, "write_trace", why))
    }

    /// Collective: a registered backend-owned buffer for the benchmark and the checks (used
    /// like [`Self::test_alloc`]'s; cuda backend).
    #[cfg(feature = "test-support")]
    pub fn test_alloc_registered(&mut self, bytes: usize) -> Result<BufId> {
        let rank = self.rank();
        match self
            .backend
            .as_any_mut()
            .downcast_mut::<backend::cuda::CudaComm>()
        {
            Some(cuda) => cuda.alloc_test_registered(&mut self.boot, bytes),
            None => Err(backend::needs_cuda(rank, "alloc")),
        }
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

// --- reduce-scatter and all-gather (NCCL's semantics) ---------------------------------------

impl Communicator {
    /// Reduce-scatter: `send` holds `world * recvcount` elements on every rank; rank r's `recv`
    /// gets `recvcount` elements, the reduction (rank order, f32 accumulation, one rounding, as
    /// the all-reduce) of elements `[r * recvcount, (r + 1) * recvcount)` of every rank's send.
    /// In place when `recv == send + rank * recvcount` elements. On cuda a registered `send`
    /// is read where it lies (zero-copy); calls can be captured in CUDA graphs.
    ///
    /// # Safety
    /// As [`Self::all_reduce_raw`], for those sizes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_scatter_raw(
        &mut self,
        send: *const c_void,
        recv: *mut c_void,
        recvcount: usize,
        dtype: DType,
        op: ReduceOp,
        stream: *mut c_void,
    ) -> Result<()> {
        let what = backend::SgOp::ReduceScatter;
        let shards = crate::shards::Shards::even(recvcount, self.world());
        let id = sg_call(what, self.rank(), recvcount, dtype, op, send, recv, stream);
        self.recorded(id, |c| {
            c.check_sg_args(what, send, recv, shards, dtype)?;
            c.flight
                .device_work(|| c.backend.stamps_scatter_gather(shards.total));
            // Count 0 included: see `all_reduce_raw`.
            // SAFETY: checked above; the caller vouches for the memory.
            unsafe {
                c.backend
                    .scatter_gather_raw(what, send, recv, shards, dtype, op, stream)
            }?;
            c.note_path_taken(shards.total);
            Ok(())
        })
    }

    /// All-gather: `send` holds `sendcount` elements; every rank's `recv` gets
    /// `world * sendcount`, rank r's send at `[r * sendcount, (r + 1) * sendcount)`, bit for
    /// bit. In place when `send == recv + rank * sendcount` elements. On cuda a registered
    /// `send` (or, in place, a registered `recv`) is read where it lies.
    ///
    /// # Safety
    /// As [`Self::all_reduce_raw`], for those sizes.
    pub unsafe fn all_gather_raw(
        &mut self,
        send: *const c_void,
        recv: *mut c_void,
        sendcount: usize,
        dtype: DType,
        stream: *mut c_void,
    ) -> Result<()> {
        let what = backend::SgOp::AllGather;
        let shards = crate::shards::Shards::even(sendcount, self.world());
        let id = sg_call(
            what,
            self.rank(),
            sendcount,
            dtype,
            ReduceOp::Sum,
            send,
            recv,
            stream,
        );
        self.recorded(id, |c| {
            c.check_sg_args(what, send, recv, shards, dtype)?;
            c.flight
                .device_work(|| c.backend.stamps_scatter_gather(shards.total));
            // Count 0 included: see `all_reduce_raw`.
            // SAFETY: checked above; the caller vouches for the memory.
            unsafe {
                c.backend
                    .scatter_gather_raw(what, send, recv, shards, dtype, ReduceOp::Sum, stream)
            }?;
            c.note_path_taken(shards.total);
            Ok(())
        })
    }

    /// Reduce-scatter of host slices (host backend): `recv.len() * world == send.len()`.
    pub fn reduce_scatter_host<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.slice_call(|c| {
            c.require_host("reduce_scatter_host")?;
            c.require_len("reduce_scatter", send.len(), recv.len() * c.world())?;
            let (s, r) = (as_bytes(send), as_bytes_mut(recv));
            // SAFETY: live slices of the checked lengths; &/&mut guarantee no overlap.
            unsafe {
                c.reduce_scatter_raw(
                    s.as_ptr().cast(),
                    r.as_mut_ptr().cast(),
                    recv.len(),
                    T::DTYPE,
                    op,
                    std::ptr::null_mut(),
                )
            }
        })
    }

    /// All-gather of host slices (host backend): `send.len() * world == recv.len()`.
    pub fn all_gather_host<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.slice_call(|c| {
            c.require_host("all_gather_host")?;
            c.require_len("all_gather", recv.len(), send.len() * c.world())?;
            let (s, r) = (as_bytes(send), as_bytes_mut(recv));
            // SAFETY: live slices of the checked lengths; &/&mut guarantee no overlap.
            unsafe {
                c.all_gather_raw(
                    s.as_ptr().cast(),
                    r.as_mut_ptr().cast(),
                    send.len(),
                    T::DTYPE,
                    std::ptr::null_mut(),
                )
            }
        })
    }

    fn require_len(&self, op: &'static str, got: usize, want: usize) -> Result<()> {
        if got == want {
            return Ok(());
        }
        Err(Error::invalid(
            self.rank(),
            op,
            format!(
                "the larger buffer has {got} elements, world ({}) times the smaller one's is {want}",
                self.world()
            ),
        ))
    }

    /// Null, overflow, alignment and overlap checks of a reduce-scatter or all-gather; the only
    /// overlap allowed is NCCL's in-place form.
    fn check_sg_args(
        &self,
        what: backend::SgOp,
        send: *const c_void,
        recv: *mut c_void,
        shards: crate::shards::Shards,
        dtype: DType,
    ) -> Result<()> {
        let (rank, op) = (self.rank(), what.name());
        if shards.per == 0 {
            // No buffer is touched: any pointers (null included) will do.
            return Ok(());
        }
        if send.is_null() || recv.is_null() {
            return Err(Error::invalid(rank, op, "null buffer pointer"));
        }
        let whole = shards
            .total
            .checked_mul(dtype.size())
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::invalid(
                    rank,
                    op,
                    format!(
                        "{} x {} elements of {dtype} overflow the address space",
                        shards.parts, shards.per
                    ),
                )
            })?;
        let own_start = shards.span(rank).start * dtype.size();
        let own = shards.span(rank).len() * dtype.size();
        let (s, r) = (send as usize, recv as usize);
        if s % dtype.size() != 0 || r % dtype.size() != 0 {
            return Err(Error::invalid(
                rank,
                op,
                format!("buffers must be aligned to the {dtype} element size"),
            ));
        }
        let (send_bytes, recv_bytes, in_place) = match what {
            backend::SgOp::ReduceScatter => (whole, own, r == s + own_start),
            _ => (own, whole, s == r + own_start),
        };
        if !in_place && s < r + recv_bytes && r < s + send_bytes {
            return Err(Error::invalid(
                rank,
                op,
                "send and recv overlap other than in NCCL's in-place form (reduce-scatter: \
                 recv = send + rank * count; all-gather: send = recv + rank * count)",
            ));
        }
        Ok(())
    }
}

/// A reduce-scatter's or all-gather's identity for the flight recorder, in place in NCCL's
/// form (as `check_sg_args` defines it): the rank's shard of the larger buffer is the other.
#[allow(clippy::too_many_arguments)]
fn sg_call(
    what: backend::SgOp,
    rank: usize,
    count: usize,
    dtype: DType,
    reduce: ReduceOp,
    send: *const c_void,
    recv: *mut c_void,
    stream: *mut c_void,
) -> crate::flight::CallId {
    let own_start = rank.wrapping_mul(count).wrapping_mul(dtype.size());
    let (s, r) = (send as usize, recv as usize);
    let in_place = match what {
        backend::SgOp::ReduceScatter => r == s.wrapping_add(own_start),
        _ => s == r.wrapping_add(own_start),
    };
    crate::flight::CallId {
        op: what,
        count,
        dtype,
        reduce,
        in_place,
        stream,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn single_rank(tag: &str) -> Communicator {
        let dir = std::env::temp_dir().join(format!("ipcreduce-comm-{tag}-{}", std::process::id()));
        let info = RankInfo::new(0, 1, dir.join("s.sock"), "comm-test", None).unwrap();
        let config = Config {
            backend: BackendChoice::Host,
            ..Config::default()
        };
        Communicator::with_rank_info(info, &config).unwrap()
    }

    #[test]
    fn free_refuses_a_buffer_of_another_communicator() {
        let (mut a, b) = (single_rank("a"), single_rank("b"));
        assert_ne!(a.token, b.token);
        // Same small id as one of `a`'s would have: only the token tells them apart.
        let theirs = crate::RegisteredBuffer::new(0x10000, 4096, 1).owned_by(b.token);
        match a.free(theirs) {
            Err(Error::InvalidArgument {
                rank: 0,
                op,
                detail,
            }) => {
                assert_eq!(op, "free");
                assert!(
                    detail.contains("0x10000")
                        && detail.contains("4096 bytes")
                        && detail.contains("belongs to another communicator"),
                    "{detail}"
                );
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        // Ours gets past the ownership check to the backend (which has no registered buffers
        // on host, and says so).
        let ours = crate::RegisteredBuffer::new(0x10000, 4096, 1).owned_by(a.token);
        match a.free(ours) {
            Err(Error::InvalidArgument { detail, .. }) => {
                assert!(detail.contains("need the cuda backend"), "{detail}")
            }
            other => panic!("expected the host backend's refusal, got {other:?}"),
        }
        // Neither aborted it: nothing collective starts on the host backend.
        assert!(!a.is_aborted());
    }
}
