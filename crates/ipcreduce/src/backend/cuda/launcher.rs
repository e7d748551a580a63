//! The launcher: what every call of every operation goes through, whatever its path.
//!
//! - [`CallArgs`]: one call's buffers, size, element type, reduction and stream;
//! - [`Launcher::begin`]: refuses a call after a failure and numbers it (`seq`);
//! - [`Launcher::kernel_args`]: the kernels' arguments, with the call's identity stamped in
//!   them ([`CallIdentity`]: every rank compares its peers' before it touches their data);
//! - [`Launcher::launch`]: one kernel on the caller's stream (programmatic dependent launch
//!   where chosen);
//! - [`Launcher::empty`]: a call of zero elements, which still meets its peers' calls;
//! - [`Launcher::check_health`]: the kernels' error record (and the abort state) as our error.
//!
//! The operations (allreduce.rs, scatter_gather.rs, ce.rs, hier.rs) choose a path and fill
//! the arguments; nothing here depends on which operation runs.

use super::calls::CallLedger;
use super::driver::{self, ck};
use super::identity::{self, CallIdentity, IDENT_WORDS};
use super::kernel_args::Shared;
pub(super) use super::kernel_args::{data_offset, KernelArgs};
use super::kernels::{rec, ERR_MISMATCH, ERR_TIMEOUT, MAX_RANKS, SIG_BYTES, STATE_ERR_WORD};
use super::memory::{DeviceAlloc, MappedHostWords};
use super::modules::Loaded;
use super::paths::CudaPath;
use super::phase_ring::PhaseRing;
use crate::abort::AbortState;
use crate::backend::SgOp;
use crate::config::Pdl;
use crate::error::{Error, Result};
use crate::plan::{Fabric, GridLimits, PathInfo};
use crate::types::{DType, ReduceOp};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::Duration;

/// Threads per block of the all-reduce kernels (their `__launch_bounds__`).
pub(super) const THREADS: u32 = 512;

// Words of the host-mapped area shared with the kernels.
pub(super) const W_ABORT: usize = 0;
// The kernels' error record (kernels::rec, REC_* in kernels/prims.cuh).
pub(super) const W_ERR: usize = 1;

/// Where the start-up mapping test writes its probe: the LL area, cleared after the test.
pub(super) const PROBE_OFFSET: u64 = SIG_BYTES as u64;

/// One call as the caller made it. `count`: elements of the whole message (all-reduce: of
/// each buffer; reduce-scatter: of send; all-gather: of recv). `stream` 0 is the legacy
/// default stream. The pointers were checked by the caller (device memory of our GPU).
#[derive(Clone, Copy, Debug)]
pub(super) struct CallArgs {
    pub send: u64,
    pub recv: u64,
    pub count: usize,
    pub dtype: DType,
    pub op: ReduceOp,
    pub stream: sys::CUstream,
}

impl CallArgs {
    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }
}

/// One kernel launch: the function, its grid and block, and the stream.
#[derive(Clone, Copy)]
pub(super) struct Kernel {
    pub f: sys::CUfunction,
    pub grid: u32,
    pub threads: u32,
    pub stream: sys::CUstream,
}

/// What every call uses, agreed by every rank at start-up, and the call counter.
pub(super) struct Launcher {
    pub rank: usize,
    pub world: usize,
    pub gpu: Arc<Loaded>,
    /// The kernels' arguments every call passes alike (workspaces, device state, host
    /// words, limits: fixed for the communicator's life), copied into each call's.
    shared: KernelArgs,
    // Memory kernels use: freed by the communicator's Drop unless work may still run on it
    // (see teardown.rs).
    pub words: ManuallyDrop<Arc<MappedHostWords>>,
    /// Private device state: counters[MAX_BLOCKS][2], then the error word.
    pub state: ManuallyDrop<DeviceAlloc>,
    pub limits: GridLimits,
    /// The agreed tuning table: its CTA counts for the calls whose algorithm it chose.
    pub tune: crate::tune::Table,
    /// What the data crosses (agreed at init): chunk sizes, CTA cap, push order.
    pub fabric: Fabric,
    /// Whether the workspaces are peer memory (registered buffers are possible), not staged
    /// through host memory.
    pub peer_memory: bool,
    pub slot_bytes: usize,
    pub timeout: Duration,
    pub abort: Arc<AbortState>,
    /// Calls issued so far (for error messages and the kernels' stamps).
    pub seq: u64,
    /// The eager calls' identities, against which the peers' count-0 calls are compared.
    calls: Arc<CallLedger>,
    pub last_path: Option<PathInfo>,
    /// When kernels are launched with programmatic dependent launch (Off where the GPU lacks
    /// it), and whether the call being issued is (see [`Launcher::launch`]).
    pub pdl: Pdl,
    pub launch_pdl: bool,
    /// Where the call being issued comes from (set per call with `launch_pdl`): stamped into
    /// its identity, so that a graph replay never pairs with an eager call or another graph's
    /// call on a peer (see [`identity::Captured`]).
    pub origin: Option<identity::Captured>,
    /// The LL kernels let the next kernel launch early (MODE_LET_NEXT_LAUNCH).
    pub let_next_launch: bool,
    /// The fused path every fused call takes, if forced (see fused_path.rs).
    pub fused_forced: Option<CudaPath>,
    /// The kernels of the last few calls' kinds: a repeated call finds its kernel here,
    /// without the shared table's lock and hash (see [`Launcher::function`]).
    recent: [Option<(FnKey, KernelHandle)>; RECENT_KERNELS],
    /// With `IPCREDUCE_TRACE`: the phase-stamp ring, and the kernels are the traced variants.
    pub phases: Option<Arc<PhaseRing>>,
}

/// A loaded kernel's handle, kept across calls.
#[derive(Clone, Copy)]
pub(super) struct KernelHandle(pub sys::CUfunction);
// SAFETY: a CUfunction is a handle the driver accepts from any thread of the process; its module
// is never unloaded (modules.rs), so it stays valid wherever the communicator moves.
unsafe impl Send for KernelHandle {}

/// What names a kernel: its path, element type and reduction.
type FnKey = (CudaPath, DType, ReduceOp);
/// Kernels remembered per communicator: a training step alternates a few kinds of call.
const RECENT_KERNELS: usize = 4;

/// What [`Launcher::new`] takes beside the memory it owns.
pub(super) struct Agreed {
    pub limits: GridLimits,
    pub fabric: Fabric,
    pub peer_memory: bool,
    pub slot_bytes: usize,
    pub timeout: Duration,
    pub pdl: Pdl,
    pub let_next_launch: bool,
    /// The fused path every fused call takes (`IPCREDUCE_FUSED_PATH`), if forced.
    pub fused_forced: Option<CudaPath>,
}

impl Launcher {
    pub fn new(
        (rank, world): (usize, usize),
        gpu: Arc<Loaded>,
        bases: [u64; MAX_RANKS],
        (words, state): (Arc<MappedHostWords>, DeviceAlloc),
        (abort, calls): (Arc<AbortState>, Arc<CallLedger>),
        agreed: Agreed,
    ) -> Launcher {
        let shared = KernelArgs::shared(&Shared {
            rank,
            world,
            bases,
            counters: state.ptr,
            err: state.ptr + (STATE_ERR_WORD * 4) as u64,
            abort_flag: words.device + 4 * W_ABORT as u64,
            host_err: words.device + 4 * W_ERR as u64,
            slot_bytes: agreed.slot_bytes,
            timeout: agreed.timeout,
            mode: (agreed.fabric.kernel_mode()
                | if agreed.let_next_launch {
                    crate::plan::MODE_LET_NEXT_LAUNCH
                } else {
                    0
                }) as i32,
        });
        Launcher {
            rank,
            world,
            gpu,
            shared,
            words: ManuallyDrop::new(words),
            state: ManuallyDrop::new(state),
            limits: agreed.limits,
            tune: crate::tune::Table::builtin(),
            fabric: agreed.fabric,
            peer_memory: agreed.peer_memory,
            slot_bytes: agreed.slot_bytes,
            timeout: agreed.timeout,
            abort,
            seq: 0,
            calls,
            last_path: None,
            pdl: agreed.pdl,
            launch_pdl: false,
            origin: None,
            let_next_launch: agreed.let_next_launch,
            fused_forced: agreed.fused_forced,
            recent: [None; RECENT_KERNELS],
            phases: None,
        }
    }

    /// The kernel of `path` for `dtype` and `op`, loaded on its first use (see
    /// [`Loaded::function_of`]); the last few are remembered here, newest first.
    pub fn function(
        &mut self,
        path: CudaPath,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<sys::CUfunction> {
        let key = (path, dtype, op);
        let hit = self.recent.iter().enumerate().find_map(|(i, e)| match e {
            Some((k, f)) if *k == key => Some((i, f.0)),
            _ => None,
        });
        if let Some((i, f)) = hit {
            self.recent[..=i].rotate_right(1);
            return Ok(f);
        }
        let traced = self.phases.is_some() && path.phase_stamped();
        let f = self.gpu.function_of(path, dtype, op, traced, self.rank)?;
        self.recent.rotate_right(1);
        self.recent[0] = Some((key, KernelHandle(f)));
        Ok(f)
    }

    /// Every call starts here: refused after a failure, else numbered.
    pub fn begin(&mut self) -> Result<()> {
        self.check_health()?;
        self.seq += 1;
        Ok(())
    }

    /// Records the path the call takes (for [`crate::backend::BackendOps::last_path`]).
    pub fn took(&mut self, path: CudaPath, ctas: u32) {
        self.last_path = Some(PathInfo {
            name: path.name(),
            ctas,
            registered: path.registered(),
        });
    }

    /// Fails if the communicator was aborted or a kernel recorded a failure.
    pub fn check_health(&self) -> Result<()> {
        let code = self.words.get(W_ERR + rec::CODE);
        if code != 0 {
            let err = self.recorded(code);
            self.abort.abort(err.to_string());
            return Err(err);
        }
        if self.abort.is_aborted() {
            return Err(Error::Aborted {
                rank: self.rank,
                reason: self.abort.reason().unwrap_or_default(),
            });
        }
        Ok(())
    }

    /// The error the kernels recorded (non-zero `code`), in words.
    fn recorded(&self, code: u32) -> Error {
        let word = |i| self.words.get(W_ERR + i);
        let peer = word(rec::PEER) as usize;
        // The call that failed, as the kernel recorded it (not the latest one issued).
        let seq = word(rec::SEQ) as u64 | (word(rec::SEQ + 1) as u64) << 32;
        let ident = |at: usize| {
            let mut w = [0u32; IDENT_WORDS];
            for (k, x) in w.iter_mut().enumerate() {
                *x = word(at + k);
            }
            CallIdentity::decode(&w)
        };
        let mine = ident(rec::MINE);
        let op = mine.map_or("all_reduce", |m| m.op.name());
        match code {
            ERR_TIMEOUT => Error::Timeout {
                rank: self.rank,
                peer,
                op: format!("{op} (kernel wait)"),
                seq,
                waited: self.timeout,
            },
            ERR_MISMATCH => {
                let theirs = (word(rec::THEIRS_KNOWN) != 0)
                    .then(|| ident(rec::THEIRS))
                    .flatten();
                let detail = match &mine {
                    Some(m) => identity::describe_mismatch(self.rank, m, peer, theirs.as_ref()),
                    None => "the error record holds no readable call".into(),
                };
                Error::Mismatch {
                    rank: self.rank,
                    peer,
                    op: op.into(),
                    seq,
                    detail,
                }
            }
            _ => Error::Aborted {
                rank: self.rank,
                reason: self
                    .abort
                    .reason()
                    .unwrap_or_else(|| format!("kernel stopped waiting for rank {peer}")),
            },
        }
    }

    /// The kernels' arguments for `call`, stamped with `ident` as issued from `self.origin`
    /// (kept in the ledger when eager, see [`Launcher::issued`]). `zero_copy`: every rank's
    /// send and recv as mapped here (registered buffers).
    pub fn kernel_args(
        &self,
        call: &CallArgs,
        ident: &CallIdentity,
        zero_copy: Option<([u64; MAX_RANKS], [u64; MAX_RANKS])>,
    ) -> KernelArgs {
        let ident = &ident.issued(self.origin);
        let words = ident.encode();
        self.issued(ident, &words);
        KernelArgs {
            phases: self.phases_for_call(),
            ..self.shared.for_call(
                (call.send, call.recv, call.count),
                &words,
                self.seq,
                zero_copy,
            )
        }
    }

    /// The phase-stamp ring for the current call's arguments (`Args::phases`; 0 when not
    /// tracing), noted in the ring as this call's.
    pub fn phases_for_call(&self) -> u64 {
        self.phases.as_ref().map_or(0, |r| r.note(self.seq))
    }

    /// The current call (`self.seq`) is issued with identity `ident`, encoded as `words`: an
    /// eager one goes into the ledger, against which the peers' count-0 calls are compared.
    pub fn issued(&self, ident: &CallIdentity, words: &[u32; IDENT_WORDS]) {
        if ident.origin.is_none() {
            self.calls.record(self.seq, ident, words);
        }
    }

    /// Launches `k` with `args` (copied at launch). With programmatic dependent launch
    /// (`self.launch_pdl`, set per call from `self.pdl`), the kernel may start while the kernel
    /// before it on the stream finishes: every entry point waits on the device for that
    /// kernel's completion before it reads anything (`wait_for_previous_kernel` in
    /// convert.cuh), so stream order holds and only the launch gap is hidden. Stream capture
    /// turns the attribute into a programmatic edge of the graph.
    pub fn launch<A>(&self, k: Kernel, args: &mut A, what: impl FnOnce() -> String) -> Result<()> {
        // `A`: the kernel's one by-value parameter (KernelArgs, or a struct that starts with it).
        let mut params = [(args as *mut A).cast::<c_void>()];
        // What came before the launch (plan, kernel, arguments): the driver's call is the
        // caller's `launch` phase (ops.rs).
        crate::host_profile::lap(crate::host_profile::Phase::Prepare);
        // SAFETY: the kernel reads `args` (copied at launch) and only touches the buffers in it,
        // which the caller vouched for and we own.
        ck(
            unsafe {
                driver::launch(
                    k.f,
                    k.grid,
                    k.threads,
                    k.stream,
                    params.as_mut_ptr(),
                    self.launch_pdl,
                )
            },
            self.rank,
            what,
        )
    }

    /// A call of zero elements of operation `what`: the LL kernel with one line of no data
    /// ([`CudaPath::Empty`]), so it still meets the peers' calls, is compared with them (a
    /// count-0 call against a real one is a mismatch on every rank) and advances the call
    /// number with theirs. Its pointers are never read (they may be null).
    pub fn empty(
        &mut self,
        what: SgOp,
        dtype: DType,
        op: ReduceOp,
        stream: sys::CUstream,
    ) -> Result<()> {
        let path = CudaPath::Empty;
        let reduce = match what {
            SgOp::AllGather => ReduceOp::Sum,
            _ => op,
        };
        // Where nothing is read or written, pointers and placement are nobody's business.
        let ident = CallIdentity {
            op: what,
            path,
            dtype,
            reduce,
            count: 0,
            in_place: false,
            send: None,
            recv: None,
            fused: None,
            origin: None,
        };
        let f = self.function(path, dtype, reduce)?;
        self.took(path, 1);
        let call = CallArgs {
            send: 0,
            recv: 0,
            count: 0,
            dtype,
            op: reduce,
            stream,
        };
        let mut args = self.kernel_args(&call, &ident, None);
        let threads = crate::plan::block_threads(path, 0, 1, THREADS);
        let k = Kernel {
            f,
            grid: 1,
            threads,
            stream,
        };
        self.launch(k, &mut args, || {
            format!("launching the empty {} kernel", what.name())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The PTX declares the kernel's parameter as a byte array of the struct's size: it must
    /// equal ours, or the kernel would read garbage.
    #[test]
    fn kernel_args_size_matches_the_ptx() {
        if !super::super::kernels::nvrtc_for_tests() {
            return;
        }
        let ptx = super::super::kernels::compile("sm_90", 2).unwrap().to_src();
        let want = format!("_param_0[{}]", std::mem::size_of::<KernelArgs>());
        assert!(ptx.contains(&want), "PTX parameter is not {want}");
    }
}
