//! The compiled kernels of one GPU: per (device, world-size class), the kernel variants
//! ([`kernels::variants`]) loaded as calls first need them, and the lookup of a path's entry
//! point.
//!
//! Nothing is compiled at start: a variant (one protocol file's kernels for one dtype and op) is
//! compiled to a CUBIN for the device's architecture, or read from the on-disk cache, and
//! loaded (`cuModuleLoadData`) on the first call that needs it. A job that only all-reduces f32
//! sums on small messages loads one variant.
//!
//! Stream capture. A call being captured into a CUDA graph may be the first to need a
//! variant, and module loading counts as a "potentially unsafe" call: in the default (global)
//! capture mode it would invalidate the capture of any stream of the process. Module loading is
//! no stream operation (nothing of it is recorded in, or ordered with, the graph), so the load
//! is made legal by switching this thread to relaxed capture mode around it
//! (`cuThreadExchangeStreamCaptureMode`, restored after), see [`RelaxedCapture`]. The captured
//! launch then refers to a function that is fully loaded (`cuFuncLoad`), so no lazy load happens
//! at launch or replay either.

use super::{driver, kernels, residency};
use crate::error::{Error, Result};
use crate::plan::CudaPath;
use crate::types::{DType, ReduceOp};
use cudarc::driver::{safe as cs, sys};
use kernels::variants::{self, Target, Variant};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// A GPU's context and the kernel variants loaded so far, made once per process, GPU and
/// world-size class, and kept for the life of the process (communicators may be created many
/// times; loaded modules are never unloaded, so the raw function handles stay valid).
pub(super) struct Loaded {
    pub(super) ctx: Arc<cs::CudaContext>,
    /// World-size class of every variant loaded here.
    w: usize,
    /// The device's architecture and the tool versions (the cache key's).
    target: Target,
    state: Mutex<State>,
    /// The copy-engine path's barrier kernel, plain and traced (with the phase stamps): set
    /// by the first copy-engine variant of its kind loaded (every copy-engine call looks its
    /// reduce kernel up, and so loads it, first).
    ce_barrier: [OnceLock<cs::CudaFunction>; 2],
    /// Whether the GPU has programmatic dependent launch (compute capability 9.0 and up).
    pub(super) pdl_capable: bool,
}

#[derive(Default)]
struct State {
    modules: Vec<Arc<cs::CudaModule>>,
    /// Keyed by path, dtype, op and whether traced (the phase-stamp variants, see
    /// [`Variant::traced`]).
    funcs: HashMap<(CudaPath, DType, ReduceOp, bool), cs::CudaFunction>,
}

impl Loaded {
    /// The kernels of GPU `ordinal` at world-size class `w` ([`kernels::world_class`]): the
    /// context, no kernel yet.
    pub(super) fn get(ordinal: usize, w: usize, rank: usize) -> Result<Arc<Loaded>> {
        type Cache = HashMap<(usize, usize), Arc<Loaded>>;
        static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
        let mut cache = CACHE
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(l) = cache.get(&(ordinal, w)) {
            return Ok(l.clone());
        }
        let cuda = |op: &str, e: cudarc::driver::DriverError| driver::from_cudarc(rank, op, e);
        let ctx = cs::CudaContext::new(ordinal).map_err(|e| cuda("context creation", e))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cuda("compute capability query", e))?;
        let target = Target::here(&format!("sm_{major}{minor}")).map_err(|e| at_rank(e, rank))?;
        let l = Arc::new(Loaded {
            ctx,
            w,
            target,
            state: Mutex::default(),
            ce_barrier: [OnceLock::new(), OnceLock::new()],
            pdl_capable: major >= 9,
        });
        cache.insert((ordinal, w), l.clone());
        Ok(l)
    }

    /// The kernel of `path` for `dtype` and `op` (a raw handle, valid for the life of the
    /// process), the variant with the phase stamps when `traced`, compiled or read from the
    /// cache and loaded if this is its first use (legal inside a stream capture, see the
    /// module's comment).
    pub(super) fn function_of(
        &self,
        path: CudaPath,
        dtype: DType,
        op: ReduceOp,
        traced: bool,
        rank: usize,
    ) -> Result<sys::CUfunction> {
        let key = (path, dtype, path.effective_op(op), traced);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = state.funcs.get(&key) {
            return Ok(f.cu_function());
        }
        let v = Variant::of(path, self.w, dtype, op).traced(traced);
        self.load(&mut state, v, rank)?;
        state
            .funcs
            .get(&key)
            .map(|f| f.cu_function())
            .ok_or_else(|| {
                Error::invalid(
                    rank,
                    "kernel lookup",
                    format!("no {} kernel for {dtype} {op}", path.name()),
                )
            })
    }

    fn load(&self, state: &mut State, v: Variant, rank: usize) -> Result<()> {
        let cuda = |op: &str, e: cudarc::driver::DriverError| driver::from_cudarc(rank, op, e);
        let start = Instant::now();
        let _relaxed = RelaxedCapture::enter(rank)?;
        let (cubin, outcome) = variants::cubin(v, &self.target).map_err(|e| at_rank(e, rank))?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.to_vec()))
            .map_err(|e| cuda(&format!("loading the {} kernels", v.label()), e))?;
        let mut regs = Vec::new();
        for (path, name) in v.kernels() {
            let f = module
                .load_function(&name)
                .map_err(|e| cuda(&format!("loading kernel {name}"), e))?;
            self.force_load(&f, &name, rank)?;
            // The CTA caps of residency.rs were set at init for kernels not loaded yet: this
            // one must fit as many blocks per SM as they promised.
            residency::check_fits(path, f.cu_function(), &name, rank)?;
            regs.push(format!("{name} {}", kernel_resources(&f)));
            state.funcs.insert((path, v.dtype, v.op, v.trace), f);
        }
        for name in v.extra_kernels() {
            let f = module
                .load_function(name)
                .map_err(|e| cuda(&format!("loading kernel {name}"), e))?;
            self.force_load(&f, name, rank)?;
            let _ = self.ce_barrier[usize::from(v.trace)].set(f);
        }
        state.modules.push(module);
        let took = start.elapsed();
        // What the compiler made of the kernels (the budget: 64 registers, no local memory).
        // (The device scripts grep "kernels for world class".)
        tracing::info!(
            rank,
            "kernels for world class {}, {} {}, {} ({outcome:?}, {:.0} ms): {}",
            v.w,
            v.dtype,
            v.op.name(),
            v.group.name(),
            took.as_secs_f64() * 1e3,
            regs.join(", ")
        );
        Ok(())
    }

    /// Loads the function's code now where the driver loads lazily (CUDA_MODULE_LOADING=LAZY,
    /// the default), so that no load is left for a launch inside a capture.
    fn force_load(&self, f: &cs::CudaFunction, name: &str, rank: usize) -> Result<()> {
        // cuFuncLoad came with CUDA 12.4; older drivers load eagerly or at first launch.
        if self.target.driver < 12040 {
            return Ok(());
        }
        // SAFETY: a function of a module that stays loaded.
        driver::ck(unsafe { sys::cuFuncLoad(f.cu_function()) }, rank, || {
            format!("cuFuncLoad({name})")
        })
    }

    /// The architecture and tool versions kernels are compiled for here.
    pub(super) fn target(&self) -> &Target {
        &self.target
    }

    /// The copy-engine path's barrier kernel, the traced one when `traced` (null until a
    /// copy-engine variant of that kind is loaded, which the copy-engine path's reduce-kernel
    /// lookup does before any barrier launch; a null function is refused by the launch, as an
    /// error naming the barrier).
    pub(super) fn ce_barrier(&self, traced: bool) -> sys::CUfunction {
        self.ce_barrier[usize::from(traced)]
            .get()
            .map_or(std::ptr::null_mut(), |f| f.cu_function())
    }

    /// Every loaded kernel with its path (for the occupancy figures of residency.rs).
    pub(super) fn loaded_functions(&self) -> Vec<(CudaPath, sys::CUfunction)> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state
            .funcs
            .iter()
            .map(|((p, _, _, _), f)| (*p, f.cu_function()))
            .collect()
    }
}

/// This thread in relaxed stream-capture mode while it lives (module loading is legal then even
/// while a stream of the process is capturing; see the module's comment), the previous mode
/// restored on drop.
struct RelaxedCapture {
    previous: sys::CUstreamCaptureMode,
}

impl RelaxedCapture {
    fn enter(rank: usize) -> Result<RelaxedCapture> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: exchanges this thread's mode (one enum) with the driver.
        driver::ck(
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) },
            rank,
            || "cuThreadExchangeStreamCaptureMode(relaxed) before loading kernels".into(),
        )?;
        Ok(RelaxedCapture { previous: mode })
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: as in `enter`; restores the mode this thread had.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
}

/// `e` as rank `rank`'s (the kernel compiler knows no ranks).
fn at_rank(e: Error, rank: usize) -> Error {
    match e {
        Error::Cuda { op, detail, .. } => Error::Cuda { rank, op, detail },
        Error::CudaDriver {
            op, code, detail, ..
        } => Error::CudaDriver {
            rank,
            op,
            code,
            detail,
        },
        other => other,
    }
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
