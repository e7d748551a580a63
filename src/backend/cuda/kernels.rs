//! The CUDA C kernels (kernels/*.cu, kept in the repository as source) compiled by NVRTC
//! once per process for the device's compute capability, and the table of their entry points.

use crate::error::{Error, Result};
use crate::types::{Algorithm, DType, ReduceOp};

/// Source of the all-reduce kernels.
pub const ALLREDUCE_SOURCE: &str = include_str!("kernels/allreduce.cu");

/// Sizes the kernels are compiled with; the host side must lay memory out the same way.
pub const MAX_RANKS: usize = 8;
pub const MAX_BLOCKS: usize = 128;
/// Bytes of the signal area at the start of every workspace.
pub const SIG_BYTES: usize = MAX_BLOCKS * MAX_RANKS * 4;

/// Name of the kernel for one (algorithm, dtype, op).
pub fn kernel_name(algo: Algorithm, dtype: DType, op: ReduceOp) -> String {
    let a = match algo {
        Algorithm::OneShot => "oneshot",
        Algorithm::TwoShot => "twoshot",
        other => panic!("no kernel for algorithm {other}"),
    };
    let d = match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::Bf16 => "bf16",
    };
    format!("ipcr_{a}_{d}_{}", op.name())
}

/// Whether NVRTC can be loaded in this process.
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes dlopen with cudarc's candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles the all-reduce kernels to PTX for `arch` (e.g. "sm_90"). Needs only NVRTC, no GPU.
pub fn compile(arch: &str) -> Result<cudarc::nvrtc::Ptx> {
    if !nvrtc_present() {
        return Err(Error::CudaUnavailable(
            "NVRTC (libnvrtc.so) not found: add CUDA's lib64 (or the nvidia-cuda-nvrtc wheel's lib) to LD_LIBRARY_PATH".into(),
        ));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".into(),
            // Keep adds and multiplies separate so every build rounds the same way.
            "--fmad=false".into(),
        ],
        name: Some("allreduce.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(ALLREDUCE_SOURCE, opts).map_err(|e| Error::Cuda {
        rank: 0,
        op: format!("NVRTC compile of allreduce.cu for {arch}"),
        detail: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_constants_match_the_kernel_source() {
        for (name, value) in [("MAX_RANKS", MAX_RANKS), ("MAX_BLOCKS", MAX_BLOCKS)] {
            let line = format!("#define {name} {value}");
            assert!(ALLREDUCE_SOURCE.contains(&line), "kernel source lacks `{line}`");
        }
    }

    #[test]
    fn every_kernel_name_is_defined_in_the_source() {
        for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
            for dtype in DType::ALL {
                for op in ReduceOp::ALL {
                    let name = kernel_name(algo, dtype, op);
                    let (a, rest) = name.trim_start_matches("ipcr_").split_once('_').unwrap();
                    let (d, o) = rest.split_once('_').unwrap();
                    assert!(ALLREDUCE_SOURCE.contains(&format!("KERNELS({d}, {o},")), "{name}");
                    assert!(["oneshot", "twoshot"].contains(&a));
                }
            }
        }
    }

    /// Compiles every kernel with NVRTC. Needs libnvrtc but no GPU; CI installs NVRTC and sets
    /// `IPCREDUCE_REQUIRE_NVRTC=1` so a missing library fails the test instead of skipping it.
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !nvrtc_present() {
            assert!(
                std::env::var_os("IPCREDUCE_REQUIRE_NVRTC").is_none(),
                "IPCREDUCE_REQUIRE_NVRTC is set but NVRTC cannot be loaded"
            );
            eprintln!("skipped: NVRTC not installed");
            return;
        }
        for arch in ["sm_80", "sm_90"] {
            let ptx = compile(arch).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
                for dtype in DType::ALL {
                    for op in ReduceOp::ALL {
                        let name = kernel_name(algo, dtype, op);
                        assert!(text.contains(&format!(".entry {name}")), "{arch}: {name} missing");
                    }
                }
            }
            // 16-byte accesses must be there (the whole point of the packed loads).
            assert!(text.contains("ld.global.cg.v4.u32") || text.contains("ld.global.cg.v4.b32"), "{arch}: no 16-byte loads");
        }
    }
}
