//! The `Communicator` class. Every call into the library runs with the GIL released: a
//! collective waits for the other ranks, and they may need this process's other threads.

use crate::errors::{to_py, InvalidArgumentError};
use crate::hostbuf::HostBuf;
use crate::registered::RegisteredBuffer;
use ipcreduce::bootstrap::RankInfo;
use ipcreduce::{Algorithm, BackendChoice, BackendKind, Config, DType, Fabric, ReduceOp};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// One rank's membership in a job. Built by `ipcreduce.init`.
#[pyclass(frozen, module = "ipcreduce._native")]
pub struct Communicator {
    /// None once closed. Locked only with the GIL released.
    inner: Mutex<Option<ipcreduce::Communicator>>,
    rank: usize,
    world: usize,
    backend: BackendKind,
    /// What the data crosses, as every rank agreed at init (host-staged: no registration).
    fabric: Fabric,
    /// Aborts and reports without the lock, which a call in flight holds.
    abort: ipcreduce::AbortHandle,
    /// One clone per registered buffer not yet freed: close() refuses while any exists, since
    /// tensors over them would point at unmapped memory.
    live: Arc<()>,
}

/// Parses a Python string argument with the library's parser; errors are invalid arguments.
fn parse<T: std::str::FromStr<Err = String>>(what: &str, s: &str) -> PyResult<T> {
    s.parse()
        .map_err(|e| InvalidArgumentError::new_err(format!("{what}: {e}")))
}

impl Communicator {
    pub(crate) fn backend_kind(&self) -> BackendKind {
        self.backend
    }

    fn lock(&self) -> MutexGuard<'_, Option<ipcreduce::Communicator>> {
        // A panic inside the library leaves the communicator as it was; keep using the lock.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn invalid(&self, op: &'static str, detail: impl Into<String>) -> PyErr {
        to_py(ipcreduce::Error::invalid(self.rank, op, detail))
    }

    /// The library's raw all-reduce with the GIL released.
    ///
    /// # Safety
    /// `send` and `recv` are valid for `count` elements of `dtype` in the backend's address
    /// space until the call has completed (on `stream` for cuda).
    #[allow(clippy::too_many_arguments)]
    unsafe fn raw(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Algorithm,
        stream: usize,
    ) -> PyResult<()> {
        self.with(py, "all_reduce", move |c| {
            // SAFETY: the caller's contract; the library checks null, alignment, overlap and
            // (cuda) that both pointers are device memory of its GPU.
            unsafe {
                c.all_reduce_raw(
                    send as *const c_void,
                    recv as *mut c_void,
                    count,
                    dtype,
                    op,
                    algo,
                    stream as *mut c_void,
                )
            }
        })
    }

    /// Runs `f` on the open communicator with the GIL released.
    pub(crate) fn with<T: Send>(
        &self,
        py: Python<'_>,
        op: &'static str,
        f: impl FnOnce(&mut ipcreduce::Communicator) -> ipcreduce::Result<T> + Send,
    ) -> PyResult<T> {
        let rank = self.rank;
        py.detach(|| {
            let mut guard = self.lock();
            match guard.as_mut() {
                Some(c) => f(c),
                None => Err(ipcreduce::Error::invalid(
                    rank,
                    op,
                    "the communicator is closed",
                )),
            }
        })
        .map_err(to_py)
    }
}

#[pymethods]
impl Communicator {
    /// Joins a job. Rank and world size come from `ipcreduce launch`'s or torchrun's
    /// variables unless given; every other knob not given comes from its `IPCREDUCE_*`
    /// variable (see the README).
    #[new]
    #[pyo3(signature = (
        backend = "auto", timeout = None, *, rank = None, world_size = None, local_rank = None,
        job_id = None, device = None, algo = None, workspace_bytes = None, with_nccl = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        backend: &str,
        timeout: Option<f64>,
        rank: Option<usize>,
        world_size: Option<usize>,
        local_rank: Option<usize>,
        job_id: Option<String>,
        device: Option<usize>,
        algo: Option<&str>,
        workspace_bytes: Option<usize>,
        with_nccl: bool,
    ) -> PyResult<Communicator> {
        let timeout = match timeout {
            Some(t) if !(t.is_finite() && t > 0.0) => {
                return Err(InvalidArgumentError::new_err(format!(
                    "timeout: {t} is not a positive number of seconds"
                )))
            }
            t => t.map(Duration::from_secs_f64),
        };
        let config = Config {
            backend: parse::<BackendChoice>("backend", backend)?,
            timeout,
            algo: algo.map(|a| parse::<Algorithm>("algo", a)).transpose()?,
            device,
            workspace_bytes,
            with_nccl,
            ..Config::default()
        };
        let info = rank_info(rank, world_size, local_rank, job_id).map_err(to_py)?;
        let comm = py
            .detach(|| ipcreduce::Communicator::with_rank_info(info, &config))
            .map_err(to_py)?;
        Ok(Communicator {
            rank: comm.rank(),
            world: comm.world(),
            backend: comm.backend(),
            fabric: comm.fabric(),
            abort: comm.abort_handle(),
            inner: Mutex::new(Some(comm)),
            live: Arc::new(()),
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.world
    }

    /// "cuda" or "host".
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend.name()
    }

    /// What the data crosses, as every rank agreed at init: "peer" (peer memory; also the
    /// host backend's shared memory), "pcie-peer" (peer memory under the PCIe policy) or
    /// "host-staged" (the cuda backend's workspaces in host memory: no registered buffers).
    #[getter]
    fn fabric(&self) -> &'static str {
        match self.fabric {
            Fabric::Peer => "peer",
            Fabric::PciePeer => "pcie-peer",
            Fabric::HostStaged => "host-staged",
        }
    }

    /// All-reduce of host buffers (numpy arrays): in place when `recv` is None. Host backend.
    #[pyo3(signature = (send, recv = None, op = "sum", algo = "auto"))]
    fn all_reduce_buffer(
        &self,
        py: Python<'_>,
        send: &Bound<'_, PyAny>,
        recv: Option<&Bound<'_, PyAny>>,
        op: &str,
        algo: &str,
    ) -> PyResult<()> {
        const OP: &str = "all_reduce";
        let (op, algo) = (
            parse::<ReduceOp>("op", op)?,
            parse::<Algorithm>("algo", algo)?,
        );
        if self.backend != BackendKind::Host {
            return Err(self.invalid(
                OP,
                "host arrays need the host backend; on the cuda backend pass torch CUDA tensors",
            ));
        }
        let s = HostBuf::get(send, recv.is_none()).map_err(|d| self.invalid(OP, d))?;
        let r = recv
            .map(|r| HostBuf::get(r, true))
            .transpose()
            .map_err(|d| self.invalid(OP, d))?;
        if let Some(r) = &r {
            if r.dtype != s.dtype || r.count() != s.count() {
                return Err(self.invalid(
                    OP,
                    format!(
                        "out has {} x {}, the input {} x {}",
                        r.count(),
                        r.dtype,
                        s.count(),
                        s.dtype
                    ),
                ));
            }
        }
        let (sa, ra) = (s.addr(), r.as_ref().map_or(s.addr(), |r| r.addr()));
        // SAFETY: both buffers are held (exported, so neither freed nor resized) until we
        // return, and the host backend's call is complete when it returns.
        unsafe { self.raw(py, sa, ra, s.count(), s.dtype, op, algo, 0) }
    }

    /// All-reduce of raw pointers, as the torch layer calls it: `on_device` says whether they
    /// are CUDA device pointers (cuda backend; `stream` is the `CUstream`, 0 = the legacy
    /// default stream) or host pointers (host backend). The caller vouches that both are
    /// valid for `count` elements of `dtype` until the call has completed on `stream`.
    #[pyo3(signature = (send, recv, count, dtype, on_device, op = "sum", algo = "auto", stream = 0))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_ptr(
        &self,
        py: Python<'_>,
        send: usize,
        recv: usize,
        count: usize,
        dtype: &str,
        on_device: bool,
        op: &str,
        algo: &str,
        stream: usize,
    ) -> PyResult<()> {
        const OP: &str = "all_reduce";
        let dtype = parse::<DType>("dtype", dtype)?;
        let (op, algo) = (
            parse::<ReduceOp>("op", op)?,
            parse::<Algorithm>("algo", algo)?,
        );
        // Host pointers on the cuda backend, or device pointers on the host backend, would be
        // dereferenced in the wrong address space: refuse them here.
        match (on_device, self.backend) {
            (true, BackendKind::Host) => {
                return Err(self.invalid(
                    OP,
                    "CUDA tensors need the cuda backend (this communicator runs the host one)",
                ))
            }
            (false, BackendKind::Cuda) => {
                return Err(self.invalid(
                    OP,
                    "CPU tensors need the host backend (this communicator runs the cuda one)",
                ))
            }
            _ => {}
        }
        // SAFETY: the caller's contract above.
        unsafe { self.raw(py, send, recv, count, dtype, op, algo, stream) }
    }

    /// Fused all-reduce + residual add + RMSNorm of raw pointers, as the torch layer calls
    /// it: `out = rms_norm(residual_out) * weight` with `residual_out = round(sum over ranks
    /// of input) + residual`, for `tokens` rows of `hidden` elements of `dtype` (weight:
    /// `hidden` elements). `fp8_out` (e4m3, `tokens * hidden` bytes) is written when given,
    /// with `scale` the address of one float32 (device memory on cuda, host on host).
    /// Addresses are ints (0 = not given); `on_device` and `stream` as for `all_reduce_ptr`.
    /// The caller vouches that each is valid for its size until the call has completed.
    #[pyo3(signature = (
        input, residual, weight, eps, out, residual_out, tokens, hidden, dtype, on_device,
        fp8_out = 0, scale = 0, algo = "auto", stream = 0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_add_rms_norm(
        &self,
        py: Python<'_>,
        input: usize,
        residual: usize,
        weight: usize,
        eps: f64,
        out: usize,
        residual_out: usize,
        tokens: usize,
        hidden: usize,
        dtype: &str,
        on_device: bool,
        fp8_out: usize,
        scale: usize,
        algo: &str,
        stream: usize,
    ) -> PyResult<()> {
        let args = crate::fused::FusedArgs {
            input,
            residual,
            weight,
            out,
            residual_out,
            fp8_out,
            fp8_scale: scale,
            tokens,
            hidden,
            // The library's eps is a float32 (NaN and negatives stay so: it refuses them).
            eps: eps as f32,
        };
        let dtype = parse::<DType>("dtype", dtype)?;
        let algo = parse::<Algorithm>("algo", algo)?;
        if let Some(why) = crate::fused::wrong_address_space(on_device, self.backend_kind()) {
            return Err(self.invalid(crate::fused::OP, why));
        }
        self.with(py, crate::fused::OP, move |c| {
            // SAFETY: the caller's contract above (every non-zero address valid for its tensor
            // until the call has completed); the library checks null, alignment, aliasing and
            // (cuda) that every pointer is device memory of its GPU.
            unsafe {
                c.all_reduce_add_rms_norm_raw(&args.to_library(dtype), algo, stream as *mut c_void)
            }
        })
    }

    /// Waits for the work this communicator enqueued on its own stream and raises an error a
    /// kernel recorded (timeout, mismatch, peer lost).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, "synchronize", |c| c.synchronize())
    }

    /// Raises the error that made the communicator unusable, if any; does not wait (a
    /// watchdog thread may call it while another thread is inside a call).
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        let err = py.detach(|| match self.inner.try_lock() {
            Ok(guard) => guard.as_ref().and_then(|c| c.async_error()),
            Err(std::sync::TryLockError::Poisoned(e)) => {
                e.into_inner().as_ref().and_then(|c| c.async_error())
            }
            // A call is in flight: what the abort state knows.
            Err(std::sync::TryLockError::WouldBlock) => self.abort.error(),
        });
        match err {
            Some(e) => Err(to_py(e)),
            None => Ok(()),
        }
    }

    /// Makes the communicator unusable at once: calls in flight (in other threads too) stop
    /// and raise, later calls raise, and peers learn it when this rank leaves.
    #[pyo3(signature = (reason = "aborted by the program"))]
    fn abort(&self, reason: &str) {
        self.abort.abort(reason);
    }

    /// Leaves the job (collective and bounded). Later calls raise. Refused while registered
    /// buffers are alive (free them first): their memory goes with the communicator.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let alive = Arc::strong_count(&self.live) - 1;
        if alive > 0 {
            return Err(self.invalid(
                "close",
                format!(
                    "{alive} registered buffer(s) are not freed (tensors from \
                     ipcreduce.torch.empty?): free them first"
                ),
            ));
        }
        let comm = py.detach(|| self.lock().take());
        py.detach(move || drop(comm));
        Ok(())
    }

    /// Collective (every rank, same size, same order): `bytes` of device memory mapped by every
    /// rank. All-reduces whose input and output lie in registered buffers (at the same offsets
    /// on every rank) read and write them directly, eagerly and in CUDA graphs. cuda backend.
    fn alloc(slf: &Bound<'_, Self>, bytes: usize) -> PyResult<RegisteredBuffer> {
        let me = slf.get();
        let buf = me.with(slf.py(), "alloc", move |c| c.alloc(bytes))?;
        Ok(RegisteredBuffer::new(
            buf,
            me.live.clone(),
            me.rank,
            slf.clone().into_any().unbind(),
        ))
    }

    /// Collective: waits for this rank's work and every rank (bounded), then unmaps the buffer.
    /// Tensors over it must not be used afterwards. Freeing a freed buffer does nothing.
    fn free(slf: &Bound<'_, Self>, buf: &Bound<'_, RegisteredBuffer>) -> PyResult<()> {
        let me = slf.get();
        let b = buf.get();
        if !b.owned_by(slf.as_any()) {
            return Err(me.invalid("free", "the buffer belongs to another communicator"));
        }
        let Some((inner, _token)) = b.take() else {
            return Ok(());
        };
        me.with(slf.py(), "free", move |c| c.free(inner))
    }

    /// What the last all-reduce of this rank ran: (path name, CTAs, zero-copy), or None.
    fn last_path(&self, py: Python<'_>) -> PyResult<Option<(&'static str, u32, bool)>> {
        self.with(py, "last_path", |c| {
            Ok(c.last_path().map(|p| (p.name, p.ctas, p.registered)))
        })
    }

    /// Calls this rank's flight recorder has seen: the mark `write_trace` writes the calls
    /// after.
    #[getter]
    fn traced_calls(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, "traced_calls", |c| Ok(c.traced_calls()))
    }

    /// Writes this rank's calls after `since` (a `traced_calls` mark; 0: all it holds) into
    /// `dir` as `ipcreduce-trace-<job>-rank<r>.jsonl`, for `ipcreduce trace export` and
    /// `summarize`; returns the file's path. Not collective.
    #[pyo3(signature = (dir, since = 0))]
    fn write_trace(&self, py: Python<'_>, dir: std::path::PathBuf, since: u64) -> PyResult<String> {
        self.with(py, "write_trace", move |c| {
            c.write_trace(&dir, since)
                .map(|p| p.to_string_lossy().into_owned())
        })
    }

    /// Facts for reports: the devices, driver and NCCL versions.
    fn meta(&self, py: Python<'_>) -> PyResult<HashMap<String, String>> {
        let m = self.with(py, "meta", |c| Ok(c.meta()))?;
        let mut out = HashMap::new();
        out.insert("devices".into(), m.devices.join("; "));
        if let Some(d) = m.driver {
            out.insert("driver".into(), d);
        }
        if let Some(n) = m.nccl_version {
            out.insert("nccl".into(), n);
        }
        Ok(out)
    }

    fn __repr__(&self) -> String {
        format!(
            "Communicator(rank={}, world_size={}, backend={:?})",
            self.rank,
            self.world,
            self.backend.name()
        )
    }
}

/// Who this rank is: the environment's rank variables, or the explicit values over them
/// (the job id, socket and secret still come from the environment unless `job_id` is given).
fn rank_info(
    rank: Option<usize>,
    world: Option<usize>,
    local_rank: Option<usize>,
    job_id: Option<String>,
) -> ipcreduce::Result<RankInfo> {
    if rank.is_none() && world.is_none() && local_rank.is_none() && job_id.is_none() {
        return RankInfo::from_env();
    }
    let (Some(rank), Some(world)) = (rank, world) else {
        return Err(ipcreduce::Error::Config(
            "rank and world_size are given together or not at all".into(),
        ));
    };
    let mut set: HashMap<&str, String> = HashMap::new();
    set.insert("IPCREDUCE_RANK", rank.to_string());
    set.insert("IPCREDUCE_WORLD_SIZE", world.to_string());
    set.insert(
        "IPCREDUCE_LOCAL_RANK",
        local_rank.unwrap_or(rank).to_string(),
    );
    if let Some(j) = job_id {
        set.insert("IPCREDUCE_JOB_ID", j);
    }
    RankInfo::from_lookup(|k| set.get(k).cloned().or_else(|| std::env::var(k).ok()))
}
