//! The kernel variants: the entry points compiled together (one protocol file's kernels, or one
//! flavour of them, for one dtype and op, at one world-size class), their NVRTC options, and their compilation straight
//! to a CUBIN for the device's real architecture (`sm_XX`: no PTX left for the driver to JIT),
//! through the on-disk cache ([`super::cache`]).
//!
//! Compiling every kernel of every path at once took tens of seconds per rank (NVRTC, then the
//! driver's JIT of all of it); a job needs a handful. A variant is selected by preprocessor
//! guards around the entry points (`-DIPCR_ONE_GROUP -DIPCR_GROUP_<NAME>`, `-DIPCR_SEL_*`, see
//! prims.cuh): the source is the same for every variant, only the entry points emitted differ.

use super::cache::{self, Outcome};
use super::{all_sources, allreduce_options, options, require_nvrtc, CE_BARRIER_KERNEL};
use super::{world_class, CONVERT_SOURCE};
use crate::error::{Error, Result};
use crate::plan::CudaPath;
use crate::types::{DType, ReduceOp};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The entry points of one kernel source file, compiled together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Group {
    /// ll.cu: the LL one-shot (8 data bytes per line), also the empty call's kernel.
    Ll,
    /// ll.cu: the LL one-shot with 12 data bytes per line (`IPCREDUCE_LL_DATA=12`).
    Ll12,
    /// staged.cu: one-shot and two-shot through the workspace.
    Staged,
    /// zerocopy.cu: the registered one-shot and two-shot, 8 loads in flight
    /// (`IPCREDUCE_REG_LOADS=8`).
    ZeroCopy,
    /// zerocopy.cu: the deep registered one-shot and two-shot (16 loads, the default).
    ZeroCopyDeep,
    /// ce.cu: the copy-engine path's reduce kernel and its barrier kernel.
    Ce,
    /// scatter_gather.cu: reduce-scatter and all-gather, staged and registered.
    ScatterGather,
    /// fused.cu: all-reduce + residual add + RMSNorm, and its reference kernel (sum only).
    Fused,
}

impl Group {
    pub const ALL: [Group; 8] = [
        Group::Ll,
        Group::Ll12,
        Group::Staged,
        Group::ZeroCopy,
        Group::ZeroCopyDeep,
        Group::Ce,
        Group::ScatterGather,
        Group::Fused,
    ];

    /// The group whose module holds `path`'s kernels.
    pub fn of(path: CudaPath) -> Group {
        use CudaPath::*;
        match path {
            OneShotLl | Empty => Group::Ll,
            OneShotLl12 => Group::Ll12,
            OneShotStaged | TwoShotStaged => Group::Staged,
            OneShotReg | TwoShotReg => Group::ZeroCopy,
            OneShotRegDeep | TwoShotRegDeep => Group::ZeroCopyDeep,
            Ce | CeStaged => Group::Ce,
            ReduceScatterStaged | ReduceScatterReg | AllGatherStaged | AllGatherReg => {
                Group::ScatterGather
            }
            FusedOneShot | FusedTwoShot | FusedLl | FusedReference => Group::Fused,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Group::Ll => "ll",
            Group::Ll12 => "ll12",
            Group::Staged => "staged",
            Group::ZeroCopy => "zerocopy",
            Group::ZeroCopyDeep => "zerocopy16",
            Group::Ce => "ce",
            Group::ScatterGather => "scatter_gather",
            Group::Fused => "fused",
        }
    }

    /// The guard that emits this group's entry points (prims.cuh, `IPCR_ONE_GROUP`).
    fn define(self) -> &'static str {
        match self {
            Group::Ll => "IPCR_GROUP_LL",
            Group::Ll12 => "IPCR_GROUP_LL12",
            Group::Staged => "IPCR_GROUP_STAGED",
            Group::ZeroCopy => "IPCR_GROUP_ZEROCOPY",
            Group::ZeroCopyDeep => "IPCR_GROUP_ZEROCOPY16",
            Group::Ce => "IPCR_GROUP_CE",
            Group::ScatterGather => "IPCR_GROUP_SCATTER_GATHER",
            Group::Fused => "IPCR_GROUP_FUSED",
        }
    }

    /// The paths whose kernels this group holds.
    pub fn paths(self) -> impl Iterator<Item = CudaPath> {
        CudaPath::ALL
            .into_iter()
            .filter(move |p| Group::of(*p) == self)
    }
}

impl CudaPath {
    /// Whether the path's kernels stamp their phases when traced (prims.cuh): the all-reduce
    /// kernels of ll.cu, staged.cu and zerocopy.cu, the reduce-scatter and all-gather
    /// kernels of scatter_gather.cu (their start, end and barriers), the staged fused
    /// and LL fused kernels of fused.cu and fused_ll.cu (start, the peers first seen, rows
    /// summed, rows normalised, end), and the copy-engine paths' barriers and reduces of ce.cu
    /// (a row per barrier and per chunk, ce.rs `Rows`). The fused reference (no call) keeps its
    /// plain variant while tracing.
    pub fn phase_stamped(self) -> bool {
        matches!(
            Group::of(self),
            Group::Ll
                | Group::Ll12
                | Group::Staged
                | Group::ZeroCopy
                | Group::ZeroCopyDeep
                | Group::ScatterGather
                | Group::Ce
        ) || matches!(
            self,
            CudaPath::FusedOneShot | CudaPath::FusedTwoShot | CudaPath::FusedLl
        )
    }
}

/// One compilation unit: a group's entry points for one dtype and (effective) op, at one
/// world-size class ([`world_class`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Variant {
    pub group: Group,
    /// The world-size class (2, 4 or 8), `-DIPCR_W`.
    pub w: usize,
    pub dtype: DType,
    pub op: ReduceOp,
    /// With the phase stamps (`-DIPCR_TRACE`, prims.cuh): compiled, cached and loaded apart
    /// from the plain variant, and only while tracing.
    pub trace: bool,
}

impl Variant {
    /// The variant holding the kernel of `path` for (`dtype`, `op`) at world-size class `w`.
    pub fn of(path: CudaPath, w: usize, dtype: DType, op: ReduceOp) -> Variant {
        Variant {
            group: Group::of(path),
            w,
            dtype,
            op: path.effective_op(op),
            trace: false,
        }
    }

    /// This variant with the phase stamps (`on`) or without.
    pub fn traced(self, on: bool) -> Variant {
        Variant { trace: on, ..self }
    }

    /// Every variant `auto` (or an explicit algorithm, registered or not, any operation) can
    /// pick at world-size class `w`: what `ipcreduce warmup` compiles.
    pub fn every(w: usize) -> Vec<Variant> {
        let mut all = Vec::new();
        for group in Group::ALL {
            // The copy-engine path is written for two ranks (world class 2).
            if group == Group::Ce && w != 2 {
                continue;
            }
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    // The fused kernels only sum: their max and min variants would be empty.
                    if group == Group::Fused && op != ReduceOp::Sum {
                        continue;
                    }
                    all.push(Variant {
                        group,
                        w,
                        dtype,
                        op,
                        trace: false,
                    });
                }
            }
        }
        all
    }

    /// Every world-size class of 1 to `max_world` ranks.
    pub fn classes(max_world: usize) -> Vec<usize> {
        let mut c: Vec<usize> = (1..=max_world.max(1)).map(world_class).collect();
        c.dedup();
        c
    }

    /// The kernels of this variant: every path of the group it serves, and its entry point.
    /// (All-gather reduces nothing: its kernels are in the sum variant only.)
    pub fn kernels(self) -> Vec<(CudaPath, String)> {
        self.group
            .paths()
            .filter(|p| p.effective_op(self.op) == self.op)
            .map(|p| (p, p.kernel_name(self.w, self.dtype, self.op)))
            .collect()
    }

    /// Entry points beside the paths' kernels (the copy-engine barrier, in the ce group).
    pub fn extra_kernels(self) -> &'static [&'static str] {
        match self.group {
            Group::Ce => &[CE_BARRIER_KERNEL],
            _ => &[],
        }
    }

    /// NVRTC's options after the architecture: the module's (world class, path codes), then
    /// the guards that select this variant's entry points.
    pub fn options(self) -> Vec<String> {
        let (dt, d) = match self.dtype {
            DType::F32 => ("f32", "F32"),
            DType::F16 => ("f16", "F16"),
            DType::Bf16 => ("bf16", "BF16"),
        };
        let op = match self.op {
            ReduceOp::Sum => "OpSum",
            ReduceOp::Max => "OpMax",
            ReduceOp::Min => "OpMin",
        };
        let mut o = allreduce_options(self.w);
        o.push("-DIPCR_ONE_GROUP".into());
        o.push(format!("-D{}", self.group.define()));
        o.push(format!("-DIPCR_SEL_DT={dt}"));
        o.push(format!("-DIPCR_SEL_OPN={}", self.op.name()));
        o.push(format!("-DIPCR_SEL_D={d}"));
        o.push(format!("-DIPCR_SEL_OP={op}"));
        if self.op == ReduceOp::Sum {
            o.push("-DIPCR_SEL_GATHER".into());
        }
        if self.trace {
            o.push("-DIPCR_TRACE".into());
        }
        o
    }

    /// For messages: "ll w2 f32 sum".
    pub fn label(self) -> String {
        format!(
            "{} w{} {} {}{}",
            self.group.name(),
            self.w,
            self.dtype,
            self.op.name(),
            if self.trace { " traced" } else { "" }
        )
    }
}

/// The source every variant is compiled from (the guards pick the entry points).
pub fn source() -> String {
    format!("{CONVERT_SOURCE}\n{}", all_sources())
}

/// NVRTC's version ("13.0"), or why it cannot be read.
pub fn nvrtc_version() -> Result<String> {
    require_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    let res = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if res != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Cuda {
            rank: 0,
            op: "nvrtcVersion".into(),
            detail: format!("{res:?}"),
        });
    }
    Ok(format!("{major}.{minor}"))
}

/// The CUDA driver's version as `cuDriverGetVersion` gives it (e.g. 13000), 0 without a driver.
pub fn driver_version_number() -> i32 {
    if !super::super::driver::driver_present() {
        return 0;
    }
    let mut v = 0;
    // SAFETY: writes one int.
    let res = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    if res == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        v
    } else {
        0
    }
}

/// What a CUBIN is compiled for, beside the variant: the architecture and the tool versions
/// that make it (all part of the cache key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    /// A real architecture, e.g. "sm_90".
    pub arch: String,
    pub nvrtc: String,
    /// `cuDriverGetVersion` (0: no driver where it was compiled).
    pub driver: i32,
}

impl Target {
    /// For `arch` with this machine's NVRTC and driver.
    pub fn here(arch: &str) -> Result<Target> {
        Ok(Target {
            arch: arch.to_string(),
            nvrtc: nvrtc_version()?,
            driver: driver_version_number(),
        })
    }
}

/// Compiles `variant` with NVRTC to a CUBIN for `arch` (a real `sm_XX`). Needs only NVRTC,
/// no GPU. Takes a fraction of a second to a few seconds: callers go through [`cubin`].
pub fn compile_cubin(variant: Variant, arch: &str) -> Result<Vec<u8>> {
    let extra = variant.options();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    nvrtc_cubin(
        &format!("the {} kernels", variant.label()),
        &source(),
        &options(arch, &extra),
        arch,
    )
}

/// NVRTC's CUBIN of `source` with `opts` (which name the real architecture `arch`).
fn nvrtc_cubin(what: &str, source: &str, opts: &[String], arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    require_nvrtc()?;
    let fail = |step: &str, detail: String| Error::Cuda {
        rank: 0,
        op: format!("NVRTC {step} of {what} for {arch}"),
        detail,
    };
    let source = std::ffi::CString::new(source).map_err(|e| fail("source", e.to_string()))?;
    let prog = result::create_program(&source, Some(c"ipcreduce.cu"))
        .map_err(|e| fail("program creation", e.to_string()))?;
    // SAFETY: `prog` was just created and is destroyed once, below; `source` outlives it; the
    // CUBIN buffer is sized by NVRTC's own figure.
    unsafe {
        let got = match result::compile_program(prog, opts) {
            Ok(()) => {
                let mut size = 0usize;
                let r = sys::nvrtcGetCUBINSize(prog, &mut size);
                if r != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                    Err(fail(
                        "CUBIN size",
                        format!("{r:?}, {size} bytes (is {arch} a real architecture?)"),
                    ))
                } else {
                    let mut buf = vec![0u8; size];
                    match sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) {
                        sys::nvrtcResult::NVRTC_SUCCESS => Ok(buf),
                        r => Err(fail("CUBIN", format!("{r:?}"))),
                    }
                }
            }
            Err(e) => {
                let log: String = result::get_program_log(prog)
                    .map(|l| {
                        l.iter()
                            .take_while(|c| **c != 0)
                            .map(|c| *c as u8 as char)
                            .collect()
                    })
                    .unwrap_or_default();
                Err(fail("compile", format!("{e}: {log}")))
            }
        };
        let _ = result::destroy_program(prog);
        got
    }
}

/// A command's own kernel source (`name`, e.g. the benchmark's input refresh) compiled like
/// the crate's ([`super::compile_source`]'s options and prelude) to a CUBIN for `target`,
/// through the same memory and disk caches as the variants.
pub fn source_cubin(
    name: &str,
    source: &str,
    target: &Target,
    extra: &[&str],
) -> Result<(Arc<[u8]>, Outcome)> {
    let full = format!("{CONVERT_SOURCE}\n{source}");
    let opts = options(&target.arch, extra);
    let key = cache::key_text(&full, &target.arch, &target.nvrtc, target.driver, &opts);
    through_caches(key, || nvrtc_cubin(name, &full, &opts, &target.arch))
}

/// The cache key of `variant` for `target`: everything the CUBIN depends on.
pub fn key(variant: Variant, target: &Target) -> String {
    let mut opts = options(&target.arch, &[]);
    opts.extend(variant.options());
    cache::key_text(&source(), &target.arch, &target.nvrtc, target.driver, &opts)
}

/// The CUBIN of `variant` for `target`: from this process's memory, else the cache directory
/// ([`cache::Cache::from_env`]), else compiled (and stored). Kept in memory for the life of the
/// process, so several GPUs of one process, or a directory that cannot be written, compile once.
pub fn cubin(variant: Variant, target: &Target) -> Result<(Arc<[u8]>, Outcome)> {
    through_caches(key(variant, target), || {
        compile_cubin(variant, &target.arch)
    })
}

fn through_caches(
    key: String,
    compile: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<(Arc<[u8]>, Outcome)> {
    type Mem = Mutex<HashMap<String, Arc<[u8]>>>;
    static MEM: OnceLock<Mem> = OnceLock::new();
    let mem = MEM.get_or_init(Default::default);
    if let Some(c) = mem.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok((c.clone(), Outcome::Memory));
    }
    let (bytes, outcome) = cache::Cache::from_env().get(&key, compile)?;
    mem.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, bytes.clone());
    Ok((bytes, outcome))
}

#[cfg(test)]
#[path = "kernel_variants_tests.rs"]
mod tests;
