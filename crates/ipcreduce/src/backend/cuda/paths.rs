//! The one table of the cuda backend's paths: every kernel path of every operation, with the
//! code a call's identity carries, the name results print, the operation, whether it works on
//! registered buffers, and the kernel that runs it. Everything that names or numbers a path
//! (the call identity, mismatch messages, kernel names, the bench's JSON, the NVRTC defines)
//! reads it from here, so two paths can never share a code or a name.

use crate::backend::SgOp;
use crate::types::{DType, ReduceOp};

/// The cuda backend's data paths (kernels, see kernels/*.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CudaPath {
    /// Data and flags pushed together into every peer's LL area; no barrier.
    OneShotLl,
    /// [`CudaPath::OneShotLl`] with 12 data bytes per 16-byte line instead of 8.
    OneShotLl12,
    /// Input copied into the shared workspace, every rank's copy read.
    OneShotStaged,
    /// Input copied into the workspace, reduce-scatter by loads, all-gather by stores.
    TwoShotStaged,
    /// Registered buffers: every rank's input read where it is.
    OneShotReg,
    /// Registered buffers: reduce-scatter by loads, all-gather by stores into every output.
    TwoShotReg,
    /// [`CudaPath::OneShotReg`] with 16 packs in flight per thread (one block per SM).
    OneShotRegDeep,
    /// [`CudaPath::TwoShotReg`] with 16 packs in flight per thread (one block per SM).
    TwoShotRegDeep,
    /// Registered buffers, two ranks, out of place: copy-engine pushes, a local reduce kernel.
    Ce,
    /// Reduce-scatter staged through the workspace.
    ReduceScatterStaged,
    /// Reduce-scatter reading every rank's registered send where it is.
    ReduceScatterReg,
    /// All-gather staged through the workspace.
    AllGatherStaged,
    /// All-gather reading every rank's registered shard where it is.
    AllGatherReg,
    /// A call of zero elements (any operation): the LL kernel with one line of no data, so the
    /// ranks still exchange their call identity and keep their call numbers paired.
    Empty,
    /// All-reduce + residual add + RMSNorm: input copied into the workspace, every rank's rows
    /// read and summed, the row's norm in the same kernel (kernels/fused.cu).
    FusedOneShot,
    /// The reference add + RMSNorm of an already all-reduced buffer (a local kernel, no peers:
    /// what the tests compare the fused kernels with).
    FusedReference,
    /// All-reduce + residual add + RMSNorm, rows dealt to ranks: each rank reduces and
    /// normalises its rows, pushes their outputs into every peer's workspace, and copies the
    /// peers' rows' outputs from its own (kernels/fused.cu).
    FusedTwoShot,
    /// All-reduce + residual add + RMSNorm for small calls: every row's lines pushed into every
    /// peer's LL area with their flags, each row summed and normalised by the block that owns
    /// it on every rank, no barrier (kernels/fused_ll.cu).
    FusedLl,
    /// Two ranks, host-staged transport: each chunk copied into host memory and the peer's
    /// copied out of it by the copy engines, the two directions of the PCIe link in flight
    /// together, a local reduce kernel (ce.rs).
    CeStaged,
}

/// How a path's kernel is named: `ipcr_<stem>[_w<W>]_<dtype>[_<op>]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelName {
    pub stem: &'static str,
    /// One kernel per world-size class (`-DIPCR_W`), named with `_w<W>`.
    pub per_world: bool,
    /// One kernel per reduction op (all-gather reduces nothing: one per dtype).
    pub per_op: bool,
}

/// One row of [`TABLE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathRow {
    pub path: CudaPath,
    /// Carried by the call identity; unique, never 0.
    pub code: u32,
    /// As `last_path`, the bench and its JSON print it.
    pub name: &'static str,
    /// The NVRTC define that gives the kernels the code (`-D<define>=<code>`).
    pub define: &'static str,
    /// The operation the path runs (None: [`CudaPath::Empty`], any of them).
    pub op: Option<SgOp>,
    /// Reads or writes registered buffers where they are (zero-copy).
    pub registered: bool,
    pub kernel: KernelName,
}

const fn row(
    path: CudaPath,
    code: u32,
    name: &'static str,
    define: &'static str,
    op: Option<SgOp>,
    registered: bool,
    kernel: (&'static str, bool, bool),
) -> PathRow {
    PathRow {
        path,
        code,
        name,
        define,
        op,
        registered,
        kernel: KernelName {
            stem: kernel.0,
            per_world: kernel.1,
            per_op: kernel.2,
        },
    }
}

const AR: Option<SgOp> = Some(SgOp::AllReduce);
const RS: Option<SgOp> = Some(SgOp::ReduceScatter);
const AG: Option<SgOp> = Some(SgOp::AllGather);
const FU: Option<SgOp> = Some(SgOp::AddRmsNorm);

/// Every path, in the order of [`CudaPath`] (row `i` is the path of code `i + 1`).
#[rustfmt::skip]
pub const TABLE: [PathRow; 19] = [
    row(CudaPath::OneShotLl, 1, "oneshot-ll", "IPCR_PATH_ONESHOT_LL", AR, false, ("oneshotll", false, true)),
    row(CudaPath::OneShotLl12, 2, "oneshot-ll12", "IPCR_PATH_ONESHOT_LL12", AR, false, ("oneshotll12", false, true)),
    row(CudaPath::OneShotStaged, 3, "oneshot-staged", "IPCR_PATH_ONESHOT_STAGED", AR, false, ("oneshot", true, true)),
    row(CudaPath::TwoShotStaged, 4, "twoshot-staged", "IPCR_PATH_TWOSHOT_STAGED", AR, false, ("twoshot", true, true)),
    row(CudaPath::OneShotReg, 5, "oneshot-reg", "IPCR_PATH_ONESHOT_REG", AR, true, ("oneshotreg", true, true)),
    row(CudaPath::TwoShotReg, 6, "twoshot-reg", "IPCR_PATH_TWOSHOT_REG", AR, true, ("twoshotreg", true, true)),
    row(CudaPath::OneShotRegDeep, 7, "oneshot-reg16", "IPCR_PATH_ONESHOT_REG16", AR, true, ("oneshotreg16", true, true)),
    row(CudaPath::TwoShotRegDeep, 8, "twoshot-reg16", "IPCR_PATH_TWOSHOT_REG16", AR, true, ("twoshotreg16", true, true)),
    row(CudaPath::Ce, 9, "ce", "IPCR_PATH_CE", AR, true, ("cereduce", false, true)),
    row(CudaPath::ReduceScatterStaged, 10, "reduce-scatter-staged", "IPCR_PATH_REDUCE_SCATTER_STAGED", RS, false, ("reducescatter", true, true)),
    row(CudaPath::ReduceScatterReg, 11, "reduce-scatter-reg", "IPCR_PATH_REDUCE_SCATTER_REG", RS, true, ("reducescatterreg", true, true)),
    row(CudaPath::AllGatherStaged, 12, "all-gather-staged", "IPCR_PATH_ALL_GATHER_STAGED", AG, false, ("allgather", false, false)),
    row(CudaPath::AllGatherReg, 13, "all-gather-reg", "IPCR_PATH_ALL_GATHER_REG", AG, true, ("allgatherreg", false, false)),
    // The LL kernel, run with count 0.
    row(CudaPath::Empty, 14, "empty", "IPCR_PATH_EMPTY", None, false, ("oneshotll", false, true)),
    row(CudaPath::FusedOneShot, 15, "fused-oneshot", "IPCR_PATH_FUSED_ONESHOT", FU, false, ("fusedoneshot", true, false)),
    row(CudaPath::FusedReference, 16, "fused-reference", "IPCR_PATH_FUSED_REFERENCE", FU, false, ("fusedref", false, false)),
    row(CudaPath::FusedTwoShot, 17, "fused-twoshot", "IPCR_PATH_FUSED_TWOSHOT", FU, false, ("fusedtwoshot", true, false)),
    row(CudaPath::FusedLl, 18, "fused-ll", "IPCR_PATH_FUSED_LL", FU, false, ("fusedll", true, false)),
    // The copy-engine path's reduce kernel, its peer's chunk read from a device scratch.
    row(CudaPath::CeStaged, 19, "ce-staged", "IPCR_PATH_CE_STAGED", AR, false, ("cereduce", false, true)),
];

/// The copy-engine path's barrier kernel (one block, any dtype).
pub const CE_BARRIER_KERNEL: &str = "ipcr_ce_barrier";

impl CudaPath {
    /// Every path, [`TABLE`]'s order.
    pub const ALL: [CudaPath; 19] = {
        let mut all = [CudaPath::Empty; 19];
        let mut i = 0;
        while i < TABLE.len() {
            all[i] = TABLE[i].path;
            i += 1;
        }
        all
    };

    /// The all-reduce paths [`crate::plan::cuda_path`] chooses from.
    pub const ALL_REDUCE: [CudaPath; 10] = [
        CudaPath::OneShotLl,
        CudaPath::OneShotLl12,
        CudaPath::OneShotStaged,
        CudaPath::TwoShotStaged,
        CudaPath::OneShotReg,
        CudaPath::TwoShotReg,
        CudaPath::OneShotRegDeep,
        CudaPath::TwoShotRegDeep,
        CudaPath::Ce,
        CudaPath::CeStaged,
    ];

    pub fn row(self) -> &'static PathRow {
        // The enum's order is the table's (checked by a test).
        &TABLE[self as usize]
    }

    pub fn name(self) -> &'static str {
        self.row().name
    }

    pub fn code(self) -> u32 {
        self.row().code
    }

    pub fn registered(self) -> bool {
        self.row().registered
    }

    /// The path with identity code `code`, if any.
    pub fn from_code(code: u32) -> Option<CudaPath> {
        TABLE.iter().find(|r| r.code == code).map(|r| r.path)
    }

    /// Whether the kernel is compiled for one block per SM (more registers): ranks sharing a
    /// GPU get fewer of its CTAs ([`crate::plan::GridLimits::deep_cap`]).
    pub fn one_block_per_sm(self) -> bool {
        matches!(self, CudaPath::OneShotRegDeep | CudaPath::TwoShotRegDeep)
    }

    /// The reduce-scatter or all-gather path, plain or registered.
    pub fn scatter_gather(op: SgOp, registered: bool) -> CudaPath {
        match (op, registered) {
            (SgOp::ReduceScatter, false) => CudaPath::ReduceScatterStaged,
            (SgOp::ReduceScatter, true) => CudaPath::ReduceScatterReg,
            (_, true) => CudaPath::AllGatherReg,
            (_, false) => CudaPath::AllGatherStaged,
        }
    }

    /// The op a call of this path runs (all-gather reduces nothing: always sum).
    pub fn effective_op(self, op: ReduceOp) -> ReduceOp {
        match self.row().kernel.per_op {
            true => op,
            false => ReduceOp::Sum,
        }
    }

    /// Name of the kernel of this path for one (dtype, op), in the module compiled for
    /// world-size class `w` (see [`super::kernels::world_class`]).
    pub fn kernel_name(self, w: usize, dtype: DType, op: ReduceOp) -> String {
        let k = self.row().kernel;
        let d = match dtype {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        };
        let mut name = format!("ipcr_{}", k.stem);
        if k.per_world {
            name += &format!("_w{w}");
        }
        name += &format!("_{d}");
        if k.per_op {
            name += &format!("_{}", op.name());
        }
        name
    }
}

/// `-D` options that give the kernels every path's code (`-DIPCR_PATH_TWOSHOT_REG=6`), so the
/// device code never spells a number of its own.
pub fn nvrtc_defines() -> Vec<String> {
    TABLE
        .iter()
        .map(|r| format!("-D{}={}", r.define, r.code))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn codes_names_and_defines_are_unique_and_rows_in_order() {
        for (i, r) in TABLE.iter().enumerate() {
            assert_eq!(r.path as usize, i, "{:?} out of order", r.path);
            assert_eq!(r.code as usize, i + 1, "{:?}", r.path);
            assert_eq!(CudaPath::from_code(r.code), Some(r.path));
            assert!(!r.name.is_empty() && r.define.starts_with("IPCR_PATH_"));
        }
        let codes: HashSet<_> = TABLE.iter().map(|r| r.code).collect();
        let names: HashSet<_> = TABLE.iter().map(|r| r.name).collect();
        let defines: HashSet<_> = TABLE.iter().map(|r| r.define).collect();
        assert_eq!(codes.len(), TABLE.len());
        assert_eq!(names.len(), TABLE.len());
        assert_eq!(defines.len(), TABLE.len());
        assert!(!codes.contains(&0), "0 means no path");
        assert_eq!(CudaPath::from_code(0), None);
        assert_eq!(CudaPath::ALL.len(), TABLE.len());
    }

    /// The names results print must not change (bench JSON, tune tables, Python tests).
    #[test]
    fn names_results_print_are_kept() {
        let want = [
            (CudaPath::OneShotLl, "oneshot-ll"),
            (CudaPath::OneShotLl12, "oneshot-ll12"),
            (CudaPath::OneShotStaged, "oneshot-staged"),
            (CudaPath::TwoShotStaged, "twoshot-staged"),
            (CudaPath::OneShotReg, "oneshot-reg"),
            (CudaPath::TwoShotReg, "twoshot-reg"),
            (CudaPath::OneShotRegDeep, "oneshot-reg16"),
            (CudaPath::TwoShotRegDeep, "twoshot-reg16"),
            (CudaPath::Ce, "ce"),
            (CudaPath::ReduceScatterStaged, "reduce-scatter-staged"),
            (CudaPath::ReduceScatterReg, "reduce-scatter-reg"),
            (CudaPath::AllGatherStaged, "all-gather-staged"),
            (CudaPath::AllGatherReg, "all-gather-reg"),
            (CudaPath::FusedOneShot, "fused-oneshot"),
            (CudaPath::FusedReference, "fused-reference"),
            (CudaPath::FusedTwoShot, "fused-twoshot"),
            (CudaPath::FusedLl, "fused-ll"),
            (CudaPath::CeStaged, "ce-staged"),
        ];
        for (p, name) in want {
            assert_eq!(p.name(), name);
        }
    }

    #[test]
    fn operations_and_registration() {
        for p in CudaPath::ALL_REDUCE {
            assert_eq!(p.row().op, Some(SgOp::AllReduce), "{p:?}");
        }
        for op in [SgOp::ReduceScatter, SgOp::AllGather] {
            for reg in [false, true] {
                let p = CudaPath::scatter_gather(op, reg);
                assert_eq!(p.row().op, Some(op));
                assert_eq!(p.registered(), reg);
            }
        }
        assert_eq!(
            CudaPath::AllGatherReg.effective_op(ReduceOp::Max),
            ReduceOp::Sum
        );
        assert_eq!(
            CudaPath::ReduceScatterReg.effective_op(ReduceOp::Max),
            ReduceOp::Max
        );
        assert_eq!(
            CudaPath::TwoShotReg.kernel_name(4, DType::Bf16, ReduceOp::Max),
            "ipcr_twoshotreg_w4_bf16_max"
        );
        assert_eq!(
            CudaPath::AllGatherStaged.kernel_name(4, DType::F16, ReduceOp::Max),
            "ipcr_allgather_f16"
        );
        assert_eq!(
            CudaPath::Empty.kernel_name(8, DType::F32, ReduceOp::Min),
            CudaPath::OneShotLl.kernel_name(8, DType::F32, ReduceOp::Min)
        );
        assert!(nvrtc_defines().contains(&"-DIPCR_PATH_TWOSHOT_REG=6".to_string()));
        assert_eq!(
            CudaPath::FusedOneShot.kernel_name(4, DType::Bf16, ReduceOp::Sum),
            "ipcr_fusedoneshot_w4_bf16"
        );
        assert_eq!(
            CudaPath::FusedReference.kernel_name(8, DType::F16, ReduceOp::Sum),
            "ipcr_fusedref_f16"
        );
        assert_eq!(
            CudaPath::FusedTwoShot.kernel_name(2, DType::F32, ReduceOp::Sum),
            "ipcr_fusedtwoshot_w2_f32"
        );
        for p in [
            CudaPath::FusedOneShot,
            CudaPath::FusedTwoShot,
            CudaPath::FusedLl,
            CudaPath::FusedReference,
        ] {
            assert_eq!(p.row().op, Some(SgOp::AddRmsNorm));
            assert_eq!(p.effective_op(ReduceOp::Max), ReduceOp::Sum);
        }
    }
}
