//! The CUDA C kernels (kernels/*.cu, kept in the repository as source), their layout constants
//! and NVRTC options. A communicator compiles them one variant at a time as calls need them,
//! to CUBIN, through an on-disk cache ([`variants`], [`cache`]); [`compile`] builds the whole
//! set to PTX at once (for the tests and for reading what the compiler made of them).

use super::identity::IDENT_WORDS;
use super::paths::nvrtc_defines;
use crate::error::{Error, Result};

// The variants compiled one at a time (kernel_variants.rs) and their on-disk cache
// (kernel_cache.rs): children of this module, which owns the sources and options.
#[path = "kernel_cache.rs"]
pub mod cache;
#[path = "kernel_variants.rs"]
pub mod variants;

/// The kernel primitives every protocol's source is built on (layout, arguments, barriers,
/// identity board, LL lines); first of [`KERNEL_SOURCES`].
pub const PRIMS_SOURCE: &str = include_str!("kernels/prims.cuh");
/// The protocols' sources, in the order they are concatenated for NVRTC (each uses only what
/// comes before it: scatter_gather.cu uses staged.cu's slots).
pub const KERNEL_SOURCES: [(&str, &str); 8] = [
    ("prims.cuh", PRIMS_SOURCE),
    ("ll.cu", include_str!("kernels/ll.cu")),
    ("staged.cu", include_str!("kernels/staged.cu")),
    ("zerocopy.cu", include_str!("kernels/zerocopy.cu")),
    ("ce.cu", include_str!("kernels/ce.cu")),
    (
        "scatter_gather.cu",
        include_str!("kernels/scatter_gather.cu"),
    ),
    ("fused.cu", include_str!("kernels/fused.cu")),
    ("fused_ll.cu", include_str!("kernels/fused_ll.cu")),
];
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
/// call stamps (u64) per (block, rank), then the identity board (16 u64 per rank).
pub const SIG_BYTES: usize = MAX_BLOCKS * MAX_RANKS * (4 + 2 * 8) + MAX_RANKS * BOARD_WORDS * 8;
/// u64 words of one rank's identity board entry (`BOARD_WORDS` in prims.cuh).
pub const BOARD_WORDS: usize = 16;
/// Words of the host-mapped error record (`REC_*` in prims.cuh).
pub mod rec {
    use super::IDENT_WORDS;
    pub const CODE: usize = 0;
    pub const PEER: usize = 1;
    pub const BLOCK: usize = 2;
    pub const WHERE: usize = 3;
    pub const CALL: usize = 4;
    pub const SEQ: usize = 6;
    pub const THEIRS_KNOWN: usize = 8;
    pub const MINE: usize = 9;
    pub const THEIRS: usize = MINE + IDENT_WORDS;
    pub const WORDS: usize = THEIRS + IDENT_WORDS;
}
/// Private state words (`STATE_*` in prims.cuh): the error word, then {call number (u64),
/// blocks done, staged chunk counter}.
pub const STATE_ERR_WORD: usize = 2 * MAX_BLOCKS;
pub const STATE_CALL_WORD: usize = 2 * MAX_BLOCKS + 4;
/// Largest message the low-latency one-shot handles.
pub const LL_MAX_BYTES: usize = 1024 * 1024;

/// Bytes of the LL area after the signal area of a `world`-rank workspace: two parities of
/// lines (16 bytes per 8 data bytes) from every rank (`LL_BYTES(world)` in prims.cuh).
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

/// `Args::check` bits of the copy-engine barrier kernel (`CHECK_*` in prims.cuh): compare the
/// call's stamps; this barrier starts the call (advances the call counter, posts the identity);
/// (traced) a reduce kernel follows on the lane and ends the barrier's phase-stamp row.
pub const CHECK_STAMPS: i32 = 1;
pub const CHECK_BEGIN: i32 = 2;
pub const CHECK_ROW_REDUCED: i32 = 4;

pub use super::paths::CE_BARRIER_KERNEL;

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

/// The options of the kernel module for world-size class `w`: the path codes of the one table
/// (paths.rs), the world class.
fn allreduce_options(w: usize) -> Vec<String> {
    // Keep adds and multiplies separate so every build rounds the same way.
    let mut o = vec!["--fmad=false".to_string(), format!("-DIPCR_W={w}")];
    o.extend(nvrtc_defines());
    o
}

/// The kernel module's source: the primitives, then every protocol's kernels.
fn all_sources() -> String {
    KERNEL_SOURCES
        .iter()
        .map(|(name, src)| format!("// ---- {name}\n{src}\n"))
        .collect()
}

/// Compiles the all-reduce kernels for world-size class `w` ([`world_class`]) to PTX for `arch`
/// (e.g. "sm_90"). Needs only NVRTC, no GPU.
pub fn compile(arch: &str, w: usize) -> Result<cudarc::nvrtc::Ptx> {
    let extra = allreduce_options(w);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    compile_source("ipcreduce kernels", &all_sources(), arch, &extra)
}

/// Registers, spills and stack frame of one kernel as ptxas reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resources {
    pub kernel: String,
    pub registers: u32,
    /// Bytes of spill stores plus spill loads (0: everything fits in registers).
    pub spill_bytes: u32,
    /// Bytes of its stack frame: spills, local arrays, and what a call to a function that is
    /// not inlined (printf) needs.
    pub stack_bytes: u32,
}

/// What ptxas makes of the all-reduce kernels for world-size class `w` on the real architecture
/// `arch` (e.g. "sm_90"): NVRTC compiles them on to machine code with `-Xptxas=-v` and its log
/// is read. Needs only NVRTC, no GPU (at load the driver reports the same registers, see
/// `kernel_resources` in mod.rs). Takes seconds: for tests and diagnostics.
pub fn resources(arch: &str, w: usize) -> Result<Vec<Resources>> {
    resources_with(arch, w, &[])
}

/// [`resources`] with `extra` options (`-DIPCR_TRACE`: the traced kernels).
pub fn resources_with(arch: &str, w: usize, extra: &[&str]) -> Result<Vec<Resources>> {
    use cudarc::nvrtc::result;
    require_nvrtc()?;
    let fail = |what: &str, detail: String| Error::Cuda {
        rank: 0,
        op: format!("NVRTC {what} of the ipcreduce kernels for {arch}"),
        detail,
    };
    let source = std::ffi::CString::new(format!("{CONVERT_SOURCE}\n{}", all_sources()))
        .map_err(|e| fail("source", e.to_string()))?;
    let prog = result::create_program(&source, Some(c"ipcreduce.cu"))
        .map_err(|e| fail("program creation", e.to_string()))?;
    let base = allreduce_options(w);
    let mut opts: Vec<&str> = base.iter().map(String::as_str).collect();
    opts.extend_from_slice(extra);
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

/// The kernels of a `ptxas -v` log: "Compiling entry function 'NAME'", then its "N bytes stack
/// frame, S bytes spill stores, M bytes spill loads" and "Used R registers" lines. Functions it
/// calls get "Function properties for CALLEE" and a stack line of their own, after the kernel's:
/// those are not the kernel's.
pub fn parse_ptxas_log(log: &str) -> Vec<Resources> {
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let mut out: Vec<Resources> = Vec::new();
    // Whether the stack lines read now are the current kernel's (not a callee's).
    let mut own = false;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            out.push(Resources {
                kernel: name.to_string(),
                registers: 0,
                spill_bytes: 0,
                stack_bytes: 0,
            });
            own = true;
        } else if let Some(k) = out.last_mut() {
            if let Some(of) = line.split("Function properties for ").nth(1) {
                own = of.trim() == k.kernel;
            } else if line.contains("spill stores") {
                if own {
                    k.spill_bytes = number_before(line, "bytes spill stores").unwrap_or(0)
                        + number_before(line, "bytes spill loads").unwrap_or(0);
                    k.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                }
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
    use crate::plan::CudaPath;
    use crate::types::{DType, ReduceOp};

    #[test]
    fn layout_constants_match_the_kernel_source() {
        let src = PRIMS_SOURCE;
        for (name, value) in [
            ("MAX_RANKS", MAX_RANKS),
            ("MAX_BLOCKS", MAX_BLOCKS),
            ("IDENT_WORDS", IDENT_WORDS),
            ("BOARD_WORDS", BOARD_WORDS),
        ] {
            let line = format!("#define {name} {value}");
            assert!(src.contains(&line), "kernel source lacks `{line}`");
        }
        assert!(src.contains("#define SIG_BYTES (FLAG_BYTES + STAMP_BYTES + BOARD_BYTES)"));
        assert!(src.contains("#define FLAG_BYTES (MAX_BLOCKS * MAX_RANKS * 4)"));
        assert!(src.contains("#define STAMP_BYTES (2 * MAX_BLOCKS * MAX_RANKS * 8)"));
        assert!(src.contains("#define BOARD_BYTES (MAX_RANKS * BOARD_WORDS * 8)"));
        assert!(src.contains(&format!(
            "#define LL_MAX_BYTES ({} * 1024)",
            LL_MAX_BYTES / 1024
        )));
        assert!(src.contains("#define LL_LINES (LL_MAX_BYTES / 8)"));
        assert!(src.contains("#define STATE_ERR (2 * MAX_BLOCKS)"));
        assert!(src.contains("#define STATE_CALL (2 * MAX_BLOCKS + 4)"));
        assert_eq!(
            (STATE_ERR_WORD, STATE_CALL_WORD),
            (2 * MAX_BLOCKS, 2 * MAX_BLOCKS + 4)
        );
        for (name, value) in [
            ("REC_CODE", rec::CODE),
            ("REC_PEER", rec::PEER),
            ("REC_BLOCK", rec::BLOCK),
            ("REC_WHERE", rec::WHERE),
            ("REC_CALL", rec::CALL),
            ("REC_SEQ", rec::SEQ),
            ("REC_THEIRS_KNOWN", rec::THEIRS_KNOWN),
            ("REC_MINE", rec::MINE),
        ] {
            let line = format!("#define {name} {value}\n");
            assert!(src.contains(&line), "kernel source lacks `{line}`");
        }
        assert!(src.contains("#define REC_THEIRS (REC_MINE + IDENT_WORDS)"));
        assert!(src.contains("#define REC_WORDS (REC_THEIRS + IDENT_WORDS)"));
        for (name, value) in [
            ("MODE_PUSH_PASSES", crate::plan::MODE_PUSH_PASSES),
            ("MODE_LET_NEXT_LAUNCH", crate::plan::MODE_LET_NEXT_LAUNCH),
            ("MODE_ROUND_SHIFT", crate::plan::MODE_ROUND_SHIFT),
            ("CHECK_STAMPS", CHECK_STAMPS as u32),
            ("CHECK_BEGIN", CHECK_BEGIN as u32),
            ("CHECK_ROW_REDUCED", CHECK_ROW_REDUCED as u32),
        ] {
            let line = format!("#define {name} {value}");
            assert!(src.contains(&line), "kernel source lacks `{line}`");
        }
        assert!(src.contains("#define LL_BYTES(world) (2 * (world) * LL_LINES * 16)"));
        assert_eq!(ll_bytes(2), 8 << 20);
        let codes = format!("ERR_TIMEOUT = {ERR_TIMEOUT}, ERR_ABORTED = {ERR_ABORTED}, ERR_MISMATCH = {ERR_MISMATCH}");
        assert!(src.contains(&codes), "error codes differ from `{codes}`");
        // The LL flag is the host's (identity::ll_flag): same multiplier.
        assert!(
            src.contains("((u32)digest + (u32)call * 0x9E3779B9u) | 1u"),
            "prims.cuh's ll_flag differs from identity::ll_flag"
        );
    }

    #[test]
    fn every_kernel_name_is_defined_in_the_sources() {
        let all = all_sources();
        for path in CudaPath::ALL {
            let stem = path.row().kernel.stem;
            let entry = match path.row().kernel.per_world {
                true => format!("ipcr_{stem}_w##W##_##DT"),
                false => format!("ipcr_{stem}_##DT"),
            };
            assert!(all.contains(&entry), "{path:?}: no `{entry}` entry point");
        }
        assert!(all.contains(&format!("void __launch_bounds__(32) {CE_BARRIER_KERNEL}(")));
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
ptxas info    : Compiling entry function 'ipcr_c' for 'sm_90'
ptxas info    : Function properties for ipcr_c
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 63 registers, used 1 barriers, 16 bytes cumulative stack size
ptxas info    : Function properties for _Z6calleev
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
";
        let r = parse_ptxas_log(log);
        let got: Vec<_> = r
            .iter()
            .map(|k| (k.kernel.as_str(), k.registers, k.spill_bytes, k.stack_bytes))
            .collect();
        // ipcr_c's numbers are its own, not those of the function it calls.
        assert_eq!(
            got,
            [
                ("ipcr_a", 55, 0, 0),
                ("ipcr_b", 64, 136, 40),
                ("ipcr_c", 63, 12, 16)
            ]
        );
    }

    /// The register budgets of prims.cuh's invariant (5), as ptxas (through NVRTC, no GPU)
    /// compiles the zero-copy and LL kernels for sm_90: the two-blocks-per-SM kernels in 64
    /// registers, the deep ones in 128, none spilling at two or four ranks.
    #[test]
    fn zero_copy_and_ll_kernels_fit_their_register_budget() {
        if !nvrtc_for_tests() {
            return;
        }
        let mut over = Vec::new();
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
                    let name = path.kernel_name(w, dtype, ReduceOp::Sum);
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
                    // The LL kernels above two ranks hold a line of every peer (W x 16 bytes)
                    // at 64 registers: a 16-bit pack of 8 floats on top spills 32 (f16) and 40
                    // (bf16) bytes at world class 4 (ptxas for sm_90; local memory, L1-cached,
                    // off the wait loop); the f16 zero-copy two-shot spills 8 bytes there since
                    // its barriers carry the call number. Anything more, or a spill anywhere
                    // else, fails.
                    let allowed = match (path, w, dtype) {
                        (CudaPath::OneShotLl | CudaPath::OneShotLl12, 4, _) => 40,
                        (CudaPath::TwoShotReg, 4, DType::F16) => 8,
                        _ => 0,
                    };
                    if k.spill_bytes > allowed {
                        over.push(format!("{k:?} (at most {allowed} B)"));
                    }
                    // A frame with nothing spilled is a call that was not inlined (printf) or
                    // a local array: registers and stack on the hot path of every call. Above
                    // two ranks the LL kernels keep the W lines they peeked in one (ll_wait,
                    // not inlined, takes each by reference): 64 bytes at world class 4.
                    let ll_lines_array =
                        matches!(path, CudaPath::OneShotLl | CudaPath::OneShotLl12) && w == 4;
                    if k.spill_bytes == 0 && k.stack_bytes > 0 && !ll_lines_array {
                        over.push(format!("{k:?} (a stack frame without spills)"));
                    }
                }
            }
        }
        assert!(
            over.is_empty(),
            "over the spill budget:\n{}",
            over.join("\n")
        );
    }

    /// Compiles every kernel with NVRTC, with the path table's defines, and finds every kernel
    /// of the table in the PTX. Needs libnvrtc but no GPU; CI installs NVRTC and sets
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
                        let name = path.kernel_name(w, dtype, op);
                        assert!(
                            text.contains(&format!(".entry {name}")),
                            "{arch}: {name} missing"
                        );
                    }
                }
            }
            assert!(
                text.contains(&format!(".entry {CE_BARRIER_KERNEL}(")),
                "{arch}: {CE_BARRIER_KERNEL} missing"
            );
            // The LL lines: 64-bit halves of one 16-byte access.
            assert!(
                text.contains("ld.volatile.global.v2.u64")
                    && text.contains("st.volatile.global.v2.u64"),
                "{arch}: no .v2.u64 LL line accesses"
            );
            // 16-byte accesses must be there (the whole point of the packed loads).
            assert!(
                text.contains("ld.global.cg.v4.u32") || text.contains("ld.global.cg.v4.b32"),
                "{arch}: no 16-byte loads"
            );
        }
    }
}

#[cfg(test)]
#[path = "kernels_trace_tests.rs"]
mod trace_tests;
