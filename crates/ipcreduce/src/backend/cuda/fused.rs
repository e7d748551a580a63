//! The fused all-reduce + residual add + RMSNorm on the cuda backend (numerics:
//! [`crate::fused`]; kernels, layout and ordering: kernels/fused.cu).
//!
//! One kernel per call: [`FusedOneShot`](super::paths::CudaPath::FusedOneShot) (the input staged through the workspace in
//! chunks of whole rows, every rank's rows summed in rank order, each row normalised in the
//! same kernel) or [`FusedTwoShot`](super::paths::CudaPath::FusedTwoShot) (rows dealt to ranks, each summed once by
//! its owner, every row's sum read by every rank and normalised there with its own residual
//! and weight) or, for small calls,
//! [`FusedLl`](super::paths::CudaPath::FusedLl) (the rows' lines pushed into every peer's LL
//! area, no barrier); which one and how the rows lie in a slot:
//! fused_path.rs. Its identity carries the path, the shape, the eps bits and the outputs
//! ([`FusedShape`]), so ranks that differ in any of them fail with a mismatch on every rank.
//! The reference kernel ([`FusedReference`](super::paths::CudaPath::FusedReference)) runs the same epilogue on an
//! already all-reduced buffer, for the tests' bitwise comparison.
//!
//! Not yet here: reading registered buffers in place (registered buffers are staged like any
//! other).

use super::fused_path::{self, Layout};
use super::identity::{CallIdentity, FusedShape};
use super::kernels::MAX_BLOCKS;
use super::launcher::{CallArgs, Kernel, KernelArgs, Launcher, THREADS};
#[cfg(any(test, feature = "test-support"))]
use super::paths::CudaPath;
use crate::backend::SgOp;
use crate::error::Result;
use crate::fused::{self, AddRmsNorm, Shape};
use crate::types::{Algorithm, ReduceOp};
use cudarc::driver::sys;

/// `struct FusedArgs` in kernels/fused.cu, field by field.
#[repr(C)]
#[derive(Clone, Copy)]
struct FusedKernelArgs {
    a: KernelArgs,
    residual: u64,
    weight: u64,
    residual_out: u64,
    fp8_out: u64,
    fp8_scale: u64,
    tokens: u64,
    hidden: u64,
    rows_per_chunk: u64,
    slot_stride: u64,
    eps: f32,
    pass_rows: u32,
}

/// Rows the reference kernel deals to a block at a time (a pair, by the block's halves).
#[cfg(feature = "test-support")]
const REFERENCE_PASS_ROWS: usize = 2;

fn kernel_args(
    a: KernelArgs,
    args: &AddRmsNorm,
    layout: &Layout,
    pass_rows: usize,
) -> FusedKernelArgs {
    FusedKernelArgs {
        a,
        residual: args.residual as u64,
        weight: args.weight as u64,
        residual_out: args.residual_out as u64,
        fp8_out: args.fp8_out as u64,
        fp8_scale: args.fp8_scale as u64,
        tokens: args.tokens as u64,
        hidden: args.hidden as u64,
        rows_per_chunk: layout.rows_per_chunk as u64,
        slot_stride: layout.stride as u64,
        eps: args.eps,
        pass_rows: pass_rows as u32,
    }
}

/// Enqueues one fused call (a begun call: [`Launcher::begin`]) on `stream` with `algo`
/// (`OneShot` or `TwoShot`, chosen: [`fused::choose`]). The arguments were checked
/// ([`fused::check`]) and the buffers are device memory of our GPU.
pub(super) fn launch(
    l: &mut Launcher,
    args: &AddRmsNorm,
    s: &Shape,
    algo: Algorithm,
    stream: sys::CUstream,
) -> Result<()> {
    let dtype = args.dtype;
    if s.tokens == 0 {
        return l.empty(SgOp::AddRmsNorm, dtype, ReduceOp::Sum, stream);
    }
    let layout = fused_path::layout(
        l.rank,
        l.world,
        l.fused_forced,
        algo,
        l.slot_bytes,
        s,
        dtype.size(),
    )?;
    let path = layout.path;
    // Every rank derives the grid from the identity (path, rows, slot) and the agreed cap.
    let grid = fused_path::grid(&layout, l.world, l.limits.cap, MAX_BLOCKS);
    let f = l.function(path, dtype, ReduceOp::Sum)?;
    l.took(path, grid);
    let ident = CallIdentity {
        op: SgOp::AddRmsNorm,
        path,
        dtype,
        reduce: ReduceOp::Sum,
        count: s.count() as u64,
        in_place: s.out_in_place,
        send: None,
        recv: None,
        fused: Some(FusedShape {
            hidden: s.hidden as u64,
            eps_bits: s.eps_bits,
            fp8: s.fp8,
            residual_in_place: s.residual_in_place,
        }),
        origin: None,
    };
    let call = call_args(args, s, stream);
    let pass_rows = fused_path::pass_rows(&layout, l.world, l.limits.cap);
    let mut k = kernel_args(l.kernel_args(&call, &ident, None), args, &layout, pass_rows);
    let kernel = Kernel {
        f,
        grid,
        threads: THREADS,
        stream,
    };
    l.launch(kernel, &mut k, || {
        format!(
            "launching the {} kernel ({} x {} {dtype})",
            path.name(),
            s.tokens,
            s.hidden
        )
    })
}

/// The launcher's view of a fused call: the rows in, the normalised rows out, summed.
fn call_args(args: &AddRmsNorm, s: &fused::Shape, stream: sys::CUstream) -> CallArgs {
    CallArgs {
        send: args.input as u64,
        recv: args.out as u64,
        count: s.count(),
        dtype: args.dtype,
        op: ReduceOp::Sum,
        stream,
    }
}

/// Enqueues the reference add + RMSNorm on `stream`: `args.input` holds the all-reduced rows.
/// A local kernel: no peer, no call number, no identity exchanged.
#[cfg(feature = "test-support")]
pub(super) fn reference(l: &Launcher, args: &AddRmsNorm, stream: sys::CUstream) -> Result<()> {
    let s = fused::check(l.rank, args)?;
    if s.tokens == 0 {
        return Ok(());
    }
    let path = CudaPath::FusedReference;
    let dtype = args.dtype;
    let f = l
        .gpu
        .function_of(path, dtype, ReduceOp::Sum, false, l.rank)?;
    let ident = CallIdentity {
        op: SgOp::AddRmsNorm,
        path,
        dtype,
        reduce: ReduceOp::Sum,
        count: s.count() as u64,
        in_place: s.out_in_place,
        send: None,
        recv: None,
        fused: None,
        origin: None,
    };
    let call = call_args(args, &s, stream);
    let all = Layout {
        path,
        rows_per_chunk: s.tokens,
        stride: s.hidden * dtype.size(),
    };
    let mut k = kernel_args(
        l.kernel_args(&call, &ident, None),
        args,
        &all,
        REFERENCE_PASS_ROWS,
    );
    let grid = s.tokens.div_ceil(REFERENCE_PASS_ROWS).min(1 << 16) as u32;
    let kernel = Kernel {
        f,
        grid,
        threads: THREADS,
        stream,
    };
    l.launch(kernel, &mut k, || {
        format!("launching the {} kernel", path.name())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels;
    use crate::types::DType;

    /// The tree's width and the rows per pass are the kernel's.
    #[test]
    fn the_kernel_source_agrees_with_the_host() {
        let src = kernels::KERNEL_SOURCES
            .iter()
            .find(|(n, _)| *n == "fused.cu")
            .expect("fused.cu is compiled with the other kernels")
            .1;
        assert!(src.contains(&format!("#define FUSED_LANES {}", fused::SS_LANES)));
        assert!(src.contains(&format!("#define FUSED_THREADS {THREADS}")));
        assert!(THREADS as usize >= fused::SS_LANES);
    }

    /// The fused kernels compile with NVRTC (no GPU) for Ampere (software e4m3) and Hopper
    /// (the cvt instruction), every entry point present with the argument size of
    /// [`FusedKernelArgs`], and within the budget of the kernels they share the GPU with (two
    /// blocks of 512 threads per SM: 64 registers), without spills.
    #[test]
    fn fused_kernels_compile_and_fit_their_register_budget() {
        if !kernels::nvrtc_for_tests() {
            return;
        }
        let size = std::mem::size_of::<FusedKernelArgs>();
        let names = |w| {
            DType::ALL.into_iter().flat_map(move |d| {
                [
                    CudaPath::FusedOneShot,
                    CudaPath::FusedTwoShot,
                    CudaPath::FusedLl,
                    CudaPath::FusedReference,
                ]
                .map(|p| p.kernel_name(w, d, ReduceOp::Sum))
            })
        };
        for w in [2, 8] {
            let ptx = kernels::compile("sm_90", w)
                .unwrap_or_else(|e| panic!("{e}"))
                .to_src();
            for name in names(w) {
                let at = ptx
                    .find(&format!(".entry {name}("))
                    .unwrap_or_else(|| panic!("w{w}: {name} missing"));
                let decl = &ptx[at..ptx.len().min(at + 200)];
                assert!(decl.contains(&format!("_param_0[{size}]")), "{decl}");
            }
            assert!(ptx.contains("cvt.rn.satfinite.e4m3x2.f32"));
        }
        // Every kernel's figures are printed before the verdict (all over budget named at once).
        let mut over = Vec::new();
        for w in [2, 4, 8] {
            let all = kernels::resources("sm_90", w).unwrap_or_else(|e| panic!("{e}"));
            for name in names(w) {
                let k = all.iter().find(|k| k.kernel == name).unwrap();
                eprintln!(
                    "{name}: {} registers, {} B spilled, {} B stack",
                    k.registers, k.spill_bytes, k.stack_bytes
                );
                if !(k.registers > 0 && k.registers <= 64)
                    || (k.spill_bytes, k.stack_bytes) != (0, 0)
                {
                    over.push(format!("{k:?}"));
                }
            }
        }
        assert!(over.is_empty(), "over the budget: {over:#?}");
        let ptx = kernels::compile("sm_80", 2)
            .unwrap_or_else(|e| panic!("{e}"))
            .to_src();
        assert!(ptx.contains(".entry ipcr_fusedoneshot_w2_bf16("));
        assert!(ptx.contains(".entry ipcr_fusedtwoshot_w2_bf16("));
        assert!(ptx.contains(".entry ipcr_fusedll_w2_bf16("));
        assert!(!ptx.contains("e4m3x2"), "sm_80 has no e4m3 conversion");
    }
}
