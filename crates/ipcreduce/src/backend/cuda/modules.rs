//! The compiled kernels of one GPU: NVRTC's module per (device, world-size class), loaded once
//! per process, and the lookup of a path's entry point.

use super::{driver, kernels};
use crate::error::{Error, Result};
use crate::plan::CudaPath;
use crate::types::{DType, ReduceOp};
use cudarc::driver::{safe as cs, sys};
use std::collections::HashMap;
use std::sync::Arc;

/// A GPU's context and the compiled kernels, made once per process and GPU: compiling with
/// NVRTC and loading the module cost seconds, and communicators may be created many times.
/// Kept for the life of the process.
pub(super) struct Loaded {
    pub(super) ctx: Arc<cs::CudaContext>,
    _module: Arc<cs::CudaModule>,
    /// Every path's kernels (paths.rs), all-reduce, reduce-scatter and all-gather.
    funcs: HashMap<(CudaPath, DType, ReduceOp), cs::CudaFunction>,
    /// The copy-engine path's barrier kernel.
    ce_barrier: cs::CudaFunction,
    /// Whether the GPU has programmatic dependent launch (compute capability 9.0 and up).
    pub(super) pdl_capable: bool,
}

impl Loaded {
    /// The module for GPU `ordinal` and world-size class `w` ([`kernels::world_class`]).
    pub(super) fn get(ordinal: usize, w: usize, rank: usize) -> Result<Arc<Loaded>> {
        type Cache = HashMap<(usize, usize), Arc<Loaded>>;
        static CACHE: std::sync::OnceLock<std::sync::Mutex<Cache>> = std::sync::OnceLock::new();
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
        let ptx = kernels::compile(&format!("sm_{major}{minor}"), w).map_err(|e| match e {
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
        })?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| cuda("loading the NVRTC module", e))?;
        let mut funcs = HashMap::new();
        let mut regs = Vec::new();
        for path in CudaPath::ALL {
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    let kname = path.kernel_name(w, dtype, op);
                    let f = module
                        .load_function(&kname)
                        .map_err(|e| cuda(&format!("loading kernel {kname}"), e))?;
                    if dtype == DType::Bf16 && op == ReduceOp::Sum && path != CudaPath::Empty {
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
        let ce_barrier = module
            .load_function(kernels::CE_BARRIER_KERNEL)
            .map_err(|e| cuda("loading the copy-engine barrier kernel", e))?;
        let l = Arc::new(Loaded {
            ctx,
            _module: module,
            funcs,
            ce_barrier,
            pdl_capable: major >= 9,
        });
        cache.insert((ordinal, w), l.clone());
        Ok(l)
    }

    /// The kernel of `path` for `dtype` and `op` (a raw handle, valid while this module lives,
    /// which is the life of the process).
    pub(super) fn function(
        &self,
        path: CudaPath,
        dtype: DType,
        op: ReduceOp,
        rank: usize,
    ) -> Result<sys::CUfunction> {
        self.funcs
            .get(&(path, dtype, op))
            .map(|f| f.cu_function())
            .ok_or_else(|| {
                Error::invalid(
                    rank,
                    "kernel lookup",
                    format!("no {} kernel for {dtype} {op}", path.name()),
                )
            })
    }

    /// The copy-engine path's barrier kernel.
    pub(super) fn ce_barrier(&self) -> sys::CUfunction {
        self.ce_barrier.cu_function()
    }

    /// Every loaded kernel with its path (for the occupancy figures of residency.rs).
    pub(super) fn loaded_functions(
        &self,
    ) -> impl Iterator<Item = (CudaPath, sys::CUfunction)> + '_ {
        self.funcs
            .iter()
            .map(|((p, _, _), f)| (*p, f.cu_function()))
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
