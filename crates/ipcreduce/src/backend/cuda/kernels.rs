//! The CUDA C kernels (kernels/*.cu, kept in the repository as source) compiled by NVRTC
//! once per process for the device's compute capability, and the table of their entry points.

use crate::error::{Error, Result};
use crate::plan::CudaPath;
use crate::types::{DType, ReduceOp};

/// Source of the all-reduce kernels.
pub const ALLREDUCE_SOURCE: &str = include_str!("kernels/allreduce.cu");
/// Source of the reduce-scatter and all-gather kernels, appended to [`ALLREDUCE_SOURCE`] (it
/// uses that file's barriers and helpers).
pub const SCATTER_GATHER_SOURCE: &str = include_str!("kernels/scatter_gather.cu");
/// Integer names and f16/bf16 conversions, prepended to every source [`compile_source`] builds.
pub const CONVERT_SOURCE: &str = include_str!("kernels/convert.cuh");
/// Source of the compute-bound kernel `ipcreduce overlap` runs beside the all-reduce.
pub const COMPUTE_SOURCE: &str = include_str!("kernels/compute.cu");
/// Entry point in [`COMPUTE_SOURCE`] and its block size (its `__launch_bounds__`).
pub const COMPUTE_KERNEL: &str = "ipcr_compute_fma";
pub const COMPUTE_THREADS: u32 = 256;

/// Sizes the kernels are compiled with; the host side must lay memory out the same way.
pub const MAX_RANKS: usize = 8;
pub const MAX_BLOCKS: usize = 128;
/// Bytes of the signal area at the start of every workspace: flags (u32) and two parities of
/// call stamps (u64) per (block, rank).
pub const SIG_BYTES: usize = MAX_BLOCKS * MAX_RANKS * (4 + 2 * 8);
/// Largest message the low-latency one-shot handles.
pub const LL_MAX_BYTES: usize = 1024 * 1024;

/// Bytes of the LL area after the signal area of a `world`-rank workspace: two parities of
/// lines (16 bytes per 8 data bytes) from every rank (`LL_BYTES(world)` in allreduce.cu).
pub fn ll_bytes(world: usize) -> usize {
    2 * world * (LL_MAX_BYTES / 8) * 16
}

/// The compile-time world-size bound (`-DIPCR_W`) of the module that serves `world` ranks: it
/// sets the reduction's unroll (8 / W packs per rank in flight per thread).
pub fn world_class(world: usize) -> usize {
    match world {
        0..=2 => 2,
        3..=4 => 4,
        _ => 8,
    }
}

/// Error codes the kernels leave in the error record.
pub const ERR_TIMEOUT: u32 = 1;
pub const ERR_ABORTED: u32 = 2;
pub const ERR_MISMATCH: u32 = 3;

/// The arguments a call stamps into its peers' signal area (see allreduce.cu): ranks whose
/// stamps differ fail with a mismatch. `path` is [`CudaPath::code`].
pub fn stamp(count: usize, dtype: DType, op: ReduceOp, path: u32) -> u64 {
    ((count as u64 & 0xFF_FFFF_FFFF) << 24)
        | ((path as u64 & 0xFF) << 16)
        | ((dtype.code() as u64) << 8)
        | op.code() as u64
}

/// Describes how two stamps differ, e.g. "count 100 vs 200". `theirs == 0`: only a hash of
/// the peer's arguments was seen (the low-latency path), so only ours can be told.
pub fn describe_stamp_difference(mine: u64, theirs: u64) -> String {
    let fields = |s: u64| (s >> 24, (s >> 16) & 0xFF, (s >> 8) & 0xFF, s & 0xFF);
    let (mc, ma, md, mo) = fields(mine);
    let (tc, ta, td, to) = fields(theirs);
    let name = |table: &[&str], v: u64| table.get(v as usize).copied().unwrap_or("?").to_string();
    // Indexed by CudaPath::code (0 and 3 unused by kernels).
    let algos = [
        "auto",
        "oneshot",
        "twoshot",
        "nccl",
        "oneshot-reg",
        "twoshot-reg",
        "ce",
        // The reduce-scatter and all-gather paths (scatter_gather.rs).
        "reduce-scatter",
        "reduce-scatter-reg",
        "all-gather",
        "all-gather-reg",
        "oneshot-reg16",
        "twoshot-reg16",
    ];
    let dtypes = ["float", "half", "bfloat16"];
    let ops = ["sum", "max", "min"];
    if theirs == 0 {
        return format!(
            "the peer's count, dtype, op or algorithm differ from this rank's ({mc} x {} {}, {})",
            name(&dtypes, md),
            name(&ops, mo),
            name(&algos, ma)
        );
    }
    let mut parts = Vec::new();
    if mc != tc {
        parts.push(format!("count {mc} vs {tc}"));
    }
    if ma != ta {
        parts.push(format!(
            "algorithm {} vs {}",
            name(&algos, ma),
            name(&algos, ta)
        ));
    }
    if md != td {
        parts.push(format!(
            "dtype {} vs {}",
            name(&dtypes, md),
            name(&dtypes, td)
        ));
    }
    if mo != to {
        parts.push(format!("op {} vs {}", name(&ops, mo), name(&ops, to)));
    }
    if parts.is_empty() {
        "identical arguments".into()
    } else {
        parts.join(", ")
    }
}

/// The copy-engine path's barrier kernel (one block, any dtype).
pub const CE_BARRIER_KERNEL: &str = "ipcr_ce_barrier";

/// Name of the kernel of `path` for one (dtype, op), in the module compiled for world-size
/// class `w` (see [`world_class`]).
pub fn kernel_name(path: CudaPath, w: usize, dtype: DType, op: ReduceOp) -> String {
    let d = match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::Bf16 => "bf16",
    };
    let p = match path {
        CudaPath::OneShotLl => return format!("ipcr_oneshotll_{d}_{}", op.name()),
        CudaPath::OneShotLl12 => return format!("ipcr_oneshotll12_{d}_{}", op.name()),
        CudaPath::OneShotStaged => "oneshot",
        CudaPath::TwoShotStaged => "twoshot",
        CudaPath::OneShotReg => "oneshotreg",
        CudaPath::TwoShotReg => "twoshotreg",
        CudaPath::OneShotRegDeep => "oneshotreg16",
        CudaPath::TwoShotRegDeep => "twoshotreg16",
        // Two ranks only: one kernel in every module.
        CudaPath::Ce => return format!("ipcr_cereduce_{d}_{}", op.name()),
    };
    format!("ipcr_{p}_w{w}_{d}_{}", op.name())
}

/// Whether NVRTC can be loaded in this process.
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes dlopen with cudarc's candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Fails with a clear error when NVRTC cannot be loaded (cudarc would panic on use).
pub fn require_nvrtc() -> Result<()> {
    if nvrtc_present() {
        return Ok(());
    }
    Err(Error::CudaUnavailable(
        "NVRTC (libnvrtc.so) not found: add CUDA's lib64 (or the nvidia-cuda-nvrtc wheel's lib) to LD_LIBRARY_PATH".into(),
    ))
}

/// Compiles `source` (named `name` in messages) to PTX for `arch` with the options every
/// kernel of the crate uses, plus `extra`, after [`CONVERT_SOURCE`]. Needs only NVRTC, no GPU. Public for the
/// command's own kernels (the benchmark's input refresh), so every source compiles one way.
pub fn compile_source(
    name: &str,
    source: &str,
    arch: &str,
    extra: &[&str],
) -> Result<cudarc::nvrtc::Ptx> {
    require_nvrtc()?;
    let opts = cudarc::nvrtc::CompileOptions {
        options: options(arch, extra),
        name: Some(name.into()),
        ..Default::default()
    };
    let source = format!("{CONVERT_SOURCE}\n{source}");
    cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| Error::Cuda {
        rank: 0,
        op: format!("NVRTC compile of {name} for {arch}"),
        detail: e.to_string(),
    })
}

/// NVRTC's options for every kernel of the crate, then `extra`.
fn options(arch: &str, extra: &[&str]) -> Vec<String> {
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    options.extend(extra.iter().map(|o| o.to_string()));
    options
}

/// The options of the all-reduce module for world-size class `w`.
fn allreduce_options(w: usize) -> [String; 2] {
    // Keep adds and multiplies separate so every build rounds the same way.
    ["--fmad=false".into(), format!("-DIPCR_W={w}")]
}

/// The all-reduce module's source: the all-reduce kernels, then the reduce-scatter and
/// all-gather ones built on them.
fn all_sources() -> String {
    format!("{ALLREDUCE_SOURCE}\n{SCATTER_GATHER_SOURCE}")
}

/// Compiles the all-reduce kernels for world-size class `w` ([`world_class`]) to PTX for `arch`
/// (e.g. "sm_90"). Needs only NVRTC, no GPU.
pub fn compile(arch: &str, w: usize) -> Result<cudarc::nvrtc::Ptx> {
    let extra = allreduce_options(w);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    compile_source("allreduce.cu", &all_sources(), arch, &extra)
}

/// Registers and spills of one kernel as ptxas reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resources {
    pub kernel: String,
    pub registers: u32,
    /// Bytes of spill stores plus spill loads (0: everything fits in registers).
    pub spill_bytes: u32,
}

/// What ptxas makes of the all-reduce kernels for world-size class `w` on the real architecture
/// `arch` (e.g. "sm_90"): NVRTC compiles them on to machine code with `-Xptxas=-v` and its log
/// is read. Needs only NVRTC, no GPU (at load the driver reports the same registers, see
/// `kernel_resources` in mod.rs). Takes seconds: for tests and diagnostics.
pub fn resources(arch: &str, w: usize) -> Result<Vec<Resources>> {
    use cudarc::nvrtc::result;
    require_nvrtc()?;
    let fail = |what: &str, detail: String| Error::Cuda {
        rank: 0,
        op: format!("NVRTC {what} of allreduce.cu for {arch}"),
        detail,
    };
    let source = std::ffi::CString::new(format!("{CONVERT_SOURCE}\n{}", all_sources()))
        .map_err(|e| fail("source", e.to_string()))?;
    let prog = result::create_program(&source, Some(c"allreduce.cu"))
        .map_err(|e| fail("program creation", e.to_string()))?;
    let extra = allreduce_options(w);
    let mut opts: Vec<&str> = extra.iter().map(String::as_str).collect();
    opts.push("-Xptxas=-v");
    let opts = options(arch, &opts);
    // SAFETY: `prog` was just created and is destroyed once, below; `source` outlives it.
    let compiled = unsafe { result::compile_program(prog, &opts) };
    let log = unsafe { result::get_program_log(prog) };
    let _ = unsafe { result::destroy_program(prog) };
    let log: String = log
        .map_err(|e| fail("log", e.to_string()))?
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8 as char)
        .collect();
    compiled.map_err(|e| fail("compile", format!("{e}: {log}")))?;
    Ok(parse_ptxas_log(&log))
}

/// The kernels of a `ptxas -v` log: "Compiling entry function 'NAME'", then its "N bytes spill
/// stores, M bytes spill loads" and "Used R registers" lines.
pub fn parse_ptxas_log(log: &str) -> Vec<Resources> {
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let mut out: Vec<Resources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            out.push(Resources {
                kernel: name.to_string(),
                registers: 0,
                spill_bytes: 0,
            });
        } else if let Some(k) = out.last_mut() {
            if line.contains("spill stores") {
                k.spill_bytes = number_before(line, "bytes spill stores").unwrap_or(0)
                    + number_before(line, "bytes spill loads").unwrap_or(0);
            } else if let Some(r) = number_before(line, "registers") {
                k.registers = r;
            }
        }
    }
    out
}

/// Compiles the compute kernel of `ipcreduce overlap` ([`COMPUTE_SOURCE`]) to PTX for `arch`.
/// Same options as [`compile`] except `--fmad=false`: this kernel is timed, not checked, and
/// uses explicit `fmaf` anyway. Needs only NVRTC, no GPU.
pub fn compile_compute(arch: &str) -> Result<cudarc::nvrtc::Ptx> {
    compile_source("compute.cu", COMPUTE_SOURCE, arch, &[])
}

/// For tests that need NVRTC: false (skip) where it is missing, unless CI's
/// `IPCREDUCE_REQUIRE_NVRTC` is set, which turns a missing NVRTC into a failure. Public for the
/// tests of the crates built on this one.
#[doc(hidden)]
pub fn nvrtc_for_tests() -> bool {
    if nvrtc_present() {
        return true;
    }
    assert!(
        std::env::var_os("IPCREDUCE_REQUIRE_NVRTC").is_none(),
        "IPCREDUCE_REQUIRE_NVRTC is set but NVRTC cannot be loaded"
    );
    eprintln!("skipped: NVRTC not installed");
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_constants_match_the_kernel_source() {
        for (name, value) in [("MAX_RANKS", MAX_RANKS), ("MAX_BLOCKS", MAX_BLOCKS)] {
            let line = format!("#define {name} {value}");
            assert!(
                ALLREDUCE_SOURCE.contains(&line),
                "kernel source lacks `{line}`"
            );
        }
        assert!(ALLREDUCE_SOURCE
            .contains("#define SIG_BYTES (FLAG_BYTES + 2 * MAX_BLOCKS * MAX_RANKS * 8)"));
        assert!(ALLREDUCE_SOURCE.contains("#define FLAG_BYTES (MAX_BLOCKS * MAX_RANKS * 4)"));
        assert!(ALLREDUCE_SOURCE.contains(&format!(
            "#define LL_MAX_BYTES ({} * 1024)",
            LL_MAX_BYTES / 1024
        )));
        assert!(ALLREDUCE_SOURCE.contains("#define LL_LINES (LL_MAX_BYTES / 8)"));
        for (name, value) in [
            ("MODE_PUSH_PASSES", crate::plan::MODE_PUSH_PASSES),
            ("MODE_LET_NEXT_LAUNCH", crate::plan::MODE_LET_NEXT_LAUNCH),
        ] {
            let line = format!("#define {name} {value}");
            assert!(
                ALLREDUCE_SOURCE.contains(&line),
                "kernel source lacks `{line}`"
            );
        }
        assert!(ALLREDUCE_SOURCE.contains("#define LL_BYTES(world) (2 * (world) * LL_LINES * 16)"));
        assert_eq!(ll_bytes(2), 8 << 20);
        let codes = format!("ERR_TIMEOUT = {ERR_TIMEOUT}, ERR_ABORTED = {ERR_ABORTED}, ERR_MISMATCH = {ERR_MISMATCH}");
        assert!(
            ALLREDUCE_SOURCE.contains(&codes),
            "error codes differ from `{codes}`"
        );
    }

    #[test]
    fn stamps_tell_what_differs() {
        let one = CudaPath::OneShotStaged.code();
        let a = stamp(100, DType::F32, ReduceOp::Sum, one);
        let b = stamp(200, DType::Bf16, ReduceOp::Sum, one);
        assert_ne!(a, b);
        assert_eq!(
            describe_stamp_difference(a, b),
            "count 100 vs 200, dtype float vs bfloat16"
        );
        let c = stamp(
            100,
            DType::F32,
            ReduceOp::Max,
            CudaPath::TwoShotStaged.code(),
        );
        assert_eq!(
            describe_stamp_difference(a, c),
            "algorithm oneshot vs twoshot, op sum vs max"
        );
        let d = stamp(100, DType::F32, ReduceOp::Sum, CudaPath::TwoShotReg.code());
        assert_eq!(
            describe_stamp_difference(a, d),
            "algorithm oneshot vs twoshot-reg"
        );
        for path in CudaPath::ALL {
            let s = stamp(100, DType::F32, ReduceOp::Sum, path.code());
            let text = describe_stamp_difference(a, s);
            assert!(!text.contains('?'), "{path:?}: {text}");
        }
        let unknown = describe_stamp_difference(a, 0);
        assert!(unknown.contains("100 x float sum, oneshot"), "{unknown}");
    }

    #[test]
    fn every_kernel_name_is_defined_in_the_source() {
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                let name = kernel_name(CudaPath::TwoShotReg, 4, dtype, op);
                let rest = name.trim_start_matches("ipcr_twoshotreg_w4_");
                let (d, o) = rest.split_once('_').unwrap();
                assert!(
                    ALLREDUCE_SOURCE.contains(&format!("KERNELS({d}, {o},")),
                    "{name}"
                );
            }
        }
        for path in CudaPath::ALL {
            let stem = kernel_name(path, 2, DType::F32, ReduceOp::Sum)
                .trim_start_matches("ipcr_")
                .split('_')
                .next()
                .unwrap()
                .to_string();
            assert!(
                ALLREDUCE_SOURCE.contains(&format!("ipcr_{stem}_")),
                "{path:?}: no ipcr_{stem}_ entry point"
            );
        }
        assert_eq!([1, 2, 3, 4, 5, 8].map(world_class), [2, 2, 4, 4, 8, 8]);
    }

    #[test]
    fn ptxas_logs_are_read_per_kernel() {
        let log = "ptxas info    : 25 bytes gmem
ptxas info    : Compiling entry function 'ipcr_a' for 'sm_90'
ptxas info    : Function properties for ipcr_a
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 55 registers, used 1 barriers
ptxas info    : Compiling entry function 'ipcr_b' for 'sm_90'
ptxas         .     40 bytes stack frame, 52 bytes spill stores, 84 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 40 bytes cumulative stack size
";
        let r = parse_ptxas_log(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            (r[0].kernel.as_str(), r[0].registers, r[0].spill_bytes),
            ("ipcr_a", 55, 0)
        );
        assert_eq!(
            (r[1].kernel.as_str(), r[1].registers, r[1].spill_bytes),
            ("ipcr_b", 64, 136)
        );
    }

    /// The register budgets of allreduce.cu's invariant (5), as ptxas (through NVRTC, no GPU)
    /// compiles the zero-copy and LL kernels for sm_90: the two-blocks-per-SM kernels in 64
    /// registers, the deep ones in 128, none spilling at two or four ranks.
    #[test]
    fn zero_copy_and_ll_kernels_fit_their_register_budget() {
        if !nvrtc_for_tests() {
            return;
        }
        for w in [2, 4] {
            let all = resources("sm_90", w).unwrap_or_else(|e| panic!("{e}"));
            for path in [
                CudaPath::OneShotLl,
                CudaPath::OneShotLl12,
                CudaPath::OneShotReg,
                CudaPath::TwoShotReg,
                CudaPath::OneShotRegDeep,
                CudaPath::TwoShotRegDeep,
            ] {
                for dtype in DType::ALL {
                    let name = kernel_name(path, w, dtype, ReduceOp::Sum);
                    let k = all
                        .iter()
                        .find(|k| k.kernel == name)
                        .unwrap_or_else(|| panic!("{name} not in the ptxas log"));
                    let budget = if path.one_block_per_sm() { 128 } else { 64 };
                    eprintln!(
                        "w{w} {name}: {} registers, {} B spilled",
                        k.registers, k.spill_bytes
                    );
                    assert!(k.registers > 0 && k.registers <= budget, "{k:?}");
                    assert_eq!(k.spill_bytes, 0, "{k:?}");
                }
            }
        }
    }

    /// Compiles every kernel with NVRTC. Needs libnvrtc but no GPU; CI installs NVRTC and sets
    /// `IPCREDUCE_REQUIRE_NVRTC=1` so a missing library fails the test instead of skipping it.
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !nvrtc_for_tests() {
            return;
        }
        for (arch, w) in [("sm_80", 8), ("sm_90", 2), ("sm_90", 4)] {
            let ptx = compile(arch, w).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            for path in CudaPath::ALL {
                for dtype in DType::ALL {
                    for op in ReduceOp::ALL {
                        let name = kernel_name(path, w, dtype, op);
                        assert!(
                            text.contains(&format!(".entry {name}")),
                            "{arch}: {name} missing"
                        );
                    }
                }
            }
            // 16-byte accesses must be there (the whole point of the packed loads).
            assert!(
                text.contains("ld.global.cg.v4.u32") || text.contains("ld.global.cg.v4.b32"),
                "{arch}: no 16-byte loads"
            );
        }
    }
}
