//! The all-reduce within one node: the path for the call's size and buffers (plan::cuda_path,
//! with the agreed limits and the tuning table), its identity, and one kernel through the
//! launcher, or a copy-engine pipeline (ce.rs) for large calls of two ranks: registered over
//! peer memory, or any on the host-staged transport.
//!
//! NCCL, count-0 calls and jobs across nodes are told apart before this (ops.rs).
//!
//! An eager call the same as the last one (buffers, size, element type, reduction, algorithm,
//! registered buffers unchanged) reuses what the last one came to ([`Prepared`]): a training
//! loop repeats its calls, and the path, kernel, block and arguments, identity words and digest
//! included, are a function of those inputs and of what is fixed for the communicator's life.
//! So does a call that differs from the last in its plain (unregistered) buffers alone, as a
//! framework's calls on freshly allocated tensors do: plain buffers are no part of the path or
//! the identity, so only the arguments' send and recv change ([`Prepared::moved_to`]).

use super::ce;
use super::identity::{CallIdentity, RegionAt, IDENT_WORDS};
use super::kernels::MAX_RANKS;
use super::launcher::{CallArgs, Kernel, KernelArgs, KernelHandle, Launcher, THREADS};
use super::paths::CudaPath;
use super::registry::Registry;
use crate::backend::SgOp;
use crate::error::Result;
use crate::plan::Fabric;
use crate::types::{Algorithm, DType, ReduceOp};

/// Every rank's send and recv as mapped here, for a call on registered buffers.
type ZeroCopy = ([u64; MAX_RANKS], [u64; MAX_RANKS]);

/// What an eager call's [`Inputs`] came to: everything of its launch but the call number and
/// the stream. The rest it was derived from is fixed for the communicator's life (the
/// launcher's limits, fabric, slot, workspaces, world; the kernels, whose modules are never
/// unloaded) except the tuning table, on whose change the owner drops this (ops.rs).
pub(super) struct Prepared {
    inputs: Inputs,
    path: CudaPath,
    f: KernelHandle,
    grid: u32,
    threads: u32,
    /// The call's arguments; the call number is set per call.
    args: KernelArgs,
    /// Its identity (eager) and words, for the ledger.
    ident: CallIdentity,
    words: [u32; IDENT_WORDS],
}

/// What a call's path, kernel and arguments depend on, beyond the communicator's constants.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Inputs {
    send: u64,
    recv: u64,
    count: usize,
    dtype: DType,
    op: ReduceOp,
    algo: Algorithm,
    /// [`Registry::changes`]: whether the buffers are registered, where, and the peers' views.
    registry: u64,
}

impl Prepared {
    /// Whether `inputs` differ from the ones this was made from in the buffers alone, in place
    /// alike, on a path that reads no registered buffer. A call of them whose buffers are not
    /// registered either runs the same kernel on the same grid with the same identity: the
    /// path depends on registration and size alone (plan::cuda_path; the one path that takes
    /// registered buffers and ignores it, LL, is taken by both alike), and plain buffers enter
    /// neither the identity nor any argument but send and recv.
    fn moved_to(&self, inputs: &Inputs) -> bool {
        let (a, b) = (&self.inputs, inputs);
        !self.path.registered()
            && (a.send == a.recv) == (b.send == b.recv)
            && Inputs {
                send: b.send,
                recv: b.recv,
                ..*a
            } == *b
    }

    /// Whether a call of `inputs` runs what this came to: the same inputs, or other buffers
    /// (`plain`: not registered ones, asked only then) where [`Prepared::moved_to`] allows.
    fn serves(&self, inputs: &Inputs, plain: impl FnOnce() -> bool) -> bool {
        self.inputs == *inputs || (self.moved_to(inputs) && plain())
    }

    /// Made ready for a call of `inputs` (the same, or [`Prepared::moved_to`] them): its
    /// buffers in the arguments.
    fn serve(&mut self, inputs: Inputs) {
        if self.inputs != inputs {
            self.args.send = inputs.send;
            self.args.recv = inputs.recv;
            self.inputs = inputs;
        }
    }
}

impl Inputs {
    fn of(call: &CallArgs, algo: Algorithm, registry: &Registry) -> Inputs {
        Inputs {
            send: call.send,
            recv: call.recv,
            count: call.count,
            dtype: call.dtype,
            op: call.op,
            algo,
            registry: registry.changes(),
        }
    }
}

/// Enqueues the all-reduce `call` with algorithm `algo` (a begun call of at least one
/// element, see [`Launcher::begin`]). `last`: what the last eager call came to, reused when
/// this one has the same inputs, else replaced by this one's (eager, a kernel of ours: the
/// copy-engine path is not kept).
pub(super) fn launch(
    l: &mut Launcher,
    registry: &Registry,
    engine: &mut ce::Engine,
    call: &CallArgs,
    algo: Algorithm,
    last: &mut Option<Prepared>,
) -> Result<()> {
    let inputs = Inputs::of(call, algo, registry);
    let eager = l.origin.is_none();
    let plain = || plain_buffers(l, registry, call);
    if let Some(p) = reusable(last.as_mut(), &inputs, eager, plain) {
        return again(l, p, call, inputs);
    }
    let (send, recv, count) = (call.send, call.recv, call.count);
    let (dtype, op) = (call.dtype, call.op);
    let bytes = call.bytes();
    let (path, grid, zero_copy) = path_of(l, registry, call, algo);
    let f = l.function(path, dtype, op)?;
    l.took(path, grid);
    let zero_copy = zero_copy.filter(|_| path.registered());
    let registered =
        |ptr| -> Option<RegionAt> { zero_copy.and_then(|_| registry.region_at(ptr, bytes)) };
    let ident = CallIdentity {
        op: SgOp::AllReduce,
        path,
        dtype,
        reduce: op,
        count: count as u64,
        in_place: send == recv,
        send: registered(send),
        recv: registered(recv),
        fused: None,
        origin: None,
    };
    let mut args = l.kernel_args(call, &ident, zero_copy);
    let knobs = l.limits.staged;
    args.chunk_bytes =
        crate::plan::staged_chunk_bytes(l.fabric, bytes, l.slot_bytes, knobs.chunk) as u64;
    args.mode |=
        (crate::plan::staged_round(l.fabric, knobs.round) << crate::plan::MODE_ROUND_SHIFT) as i32;
    if path == CudaPath::Ce {
        let lanes = engine.lanes(l.rank)?;
        return ce::launch(l, lanes, &args, call, grid);
    }
    if path == CudaPath::CeStaged {
        let (lanes, staged, scratch) = engine.staged().ok_or_else(|| {
            crate::error::Error::invalid(
                l.rank,
                "all-reduce",
                "the host-staged copy-engine path was chosen but not prepared at start-up",
            )
        })?;
        let chunk = crate::plan::ce_staged_chunk_bytes(bytes, l.slot_bytes, knobs.chunk);
        return ce::launch_staged(l, lanes, staged, scratch, &args, call, chunk, grid);
    }
    let threads = crate::plan::block_threads(path, bytes, grid, THREADS);
    if eager {
        *last = Some(Prepared {
            inputs,
            path,
            f: KernelHandle(f),
            grid,
            threads,
            args,
            ident,
            words: args.ident,
        });
    }
    let k = Kernel {
        f,
        grid,
        threads,
        stream: call.stream,
    };
    l.launch(k, &mut args, || what(path, call))
}

/// The path and grid [`launch`] runs `call` by `algo` with, and every rank's view of its
/// buffers when they are registered (whether the path reads them in place or not).
pub(super) fn path_of(
    l: &Launcher,
    registry: &Registry,
    call: &CallArgs,
    algo: Algorithm,
) -> (CudaPath, u32, Option<ZeroCopy>) {
    let bytes = call.bytes();
    let zero_copy = registry.peers_of(call.send, call.recv, bytes, l.world);
    // The tuned CTA count of the row for this size, when the call runs that row's algorithm
    // (on peer memory: tables are not measured staged through host memory, which has its own
    // measured rule; the staged paths take it, the LL one keeps its own rule below it).
    let tuned = match l.fabric {
        Fabric::HostStaged => Some(crate::plan::host_staged_ctas(bytes)),
        _ => Some(&l.tune)
            .and_then(|t| t.lookup(l.world, call.dtype.size(), bytes))
            .filter(|e| e.algorithm() == Some(algo))
            .and_then(|e| e.ctas)
            .map(|c| c as usize),
    };
    let (path, grid) = crate::plan::cuda_path(
        algo,
        bytes,
        zero_copy.is_some(),
        call.send == call.recv,
        &l.limits,
        tuned,
    );
    (path, grid, zero_copy)
}

/// Whether `call` runs a kernel that stamps its phases (asked before its launch while
/// tracing): the path `last` took when the call has its inputs (a loop's calls work nothing out
/// twice), else the path worked out as the launch will.
pub(super) fn phase_stamped(
    l: &Launcher,
    registry: &Registry,
    call: &CallArgs,
    algo: Algorithm,
    last: Option<&Prepared>,
) -> bool {
    let plain = || plain_buffers(l, registry, call);
    let path = match kept_path(last, &Inputs::of(call, algo, registry), plain) {
        Some(path) => path,
        None => path_of(l, registry, call, algo).0,
    };
    path.phase_stamped()
}

/// The path `last` took, if a call of `inputs` takes it too (eager or captured alike: the path
/// depends on the inputs alone): the same inputs, or other buffers (`plain`: not registered)
/// on an unregistered path.
fn kept_path(
    last: Option<&Prepared>,
    inputs: &Inputs,
    plain: impl FnOnce() -> bool,
) -> Option<CudaPath> {
    last.filter(|p| p.serves(inputs, plain)).map(|p| p.path)
}

/// Whether neither of `call`'s buffers is registered (the registry's view of them, as
/// [`path_of`] takes it).
fn plain_buffers(l: &Launcher, registry: &Registry, call: &CallArgs) -> bool {
    registry
        .peers_of(call.send, call.recv, call.bytes(), l.world)
        .is_none()
}

/// `last`, if a call of `inputs` may reuse it: eager calls only (a captured call's identity
/// holds its place in the graph, new each time) that it serves ([`Prepared::serves`]).
fn reusable<'a>(
    last: Option<&'a mut Prepared>,
    inputs: &Inputs,
    eager: bool,
    plain: impl FnOnce() -> bool,
) -> Option<&'a mut Prepared> {
    last.filter(|p| eager && p.serves(inputs, plain))
}

/// The eager call `call` of `inputs`, which `p` may serve ([`reusable`]): as the full path
/// would issue it (the path taken, the identity in the ledger, the arguments of this call
/// number and buffers).
fn again(l: &mut Launcher, p: &mut Prepared, call: &CallArgs, inputs: Inputs) -> Result<()> {
    l.took(p.path, p.grid);
    l.issued(&p.ident, &p.words);
    p.serve(inputs);
    // In place: the launch copies the arguments, and the kept ones differ only in these.
    p.args.seq = l.seq;
    p.args.phases = l.phases_for_call();
    let k = Kernel {
        f: p.f.0,
        grid: p.grid,
        threads: p.threads,
        stream: call.stream,
    };
    let path = p.path;
    l.launch(k, &mut p.args, || what(path, call))
}

/// The launch in words, for its error.
fn what(path: CudaPath, call: &CallArgs) -> String {
    format!(
        "launching the {} kernel ({} x {} {})",
        path.name(),
        call.count,
        call.dtype,
        call.op
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> Inputs {
        Inputs {
            send: 0x1000,
            recv: 0x2000,
            count: 4096,
            dtype: DType::Bf16,
            op: ReduceOp::Sum,
            algo: Algorithm::OneShot,
            registry: 0,
        }
    }

    /// What a one-shot LL call of [`inputs`] left.
    fn prepared() -> Prepared {
        let ident = CallIdentity {
            op: SgOp::AllReduce,
            path: CudaPath::OneShotLl,
            dtype: DType::Bf16,
            reduce: ReduceOp::Sum,
            count: 4096,
            in_place: false,
            send: None,
            recv: None,
            fused: None,
            origin: None,
        };
        Prepared {
            inputs: inputs(),
            path: CudaPath::OneShotLl,
            f: KernelHandle(std::ptr::null_mut()),
            grid: 1,
            threads: 256,
            args: KernelArgs::default(),
            ident,
            words: ident.encode(),
        }
    }

    /// Each input of a call in turn, changed.
    fn changed_inputs() -> Vec<Inputs> {
        let other = inputs();
        vec![
            Inputs {
                send: 0x1010,
                ..other
            },
            Inputs {
                recv: 0x1000,
                ..other
            },
            Inputs {
                count: 4097,
                ..other
            },
            Inputs {
                dtype: DType::F16,
                ..other
            },
            Inputs {
                op: ReduceOp::Max,
                ..other
            },
            Inputs {
                algo: Algorithm::TwoShot,
                ..other
            },
            Inputs {
                registry: 1,
                ..other
            },
        ]
    }

    /// The inputs of [`changed_inputs`] that differ in their buffers alone (the first two: the
    /// second makes the call in place, which the last was not).
    const MOVED: usize = 2;

    #[test]
    fn only_an_eager_call_of_the_same_inputs_reuses_the_last() {
        let mut p = prepared();
        let never = || -> bool { panic!("registration asked of the same buffers") };
        assert!(reusable(Some(&mut p), &inputs(), true, never).is_some());
        assert!(
            reusable(Some(&mut p), &inputs(), false, never).is_none(),
            "captured"
        );
        assert!(reusable(None, &inputs(), true, never).is_none());
        for changed in &changed_inputs()[MOVED..] {
            assert!(reusable(Some(&mut p), changed, true, || true).is_none());
        }
    }

    #[test]
    fn other_plain_buffers_reuse_the_last_unless_in_place_or_registered() {
        let mut p = prepared();
        let moved = Inputs {
            send: 0x5000,
            recv: 0x6000,
            ..inputs()
        };
        assert!(reusable(Some(&mut p), &moved, true, || true).is_some());
        assert!(
            reusable(Some(&mut p), &moved, true, || false).is_none(),
            "the new buffers are registered"
        );
        assert!(
            reusable(Some(&mut p), &changed_inputs()[1], true, || true).is_none(),
            "now in place"
        );
        p.path = CudaPath::TwoShotReg;
        assert!(
            reusable(Some(&mut p), &moved, true, || true).is_none(),
            "the last read registered buffers"
        );
    }

    #[test]
    fn a_reused_call_runs_on_its_own_buffers() {
        let mut p = prepared();
        p.args.send = 0x1000;
        p.args.recv = 0x2000;
        let moved = Inputs {
            send: 0x5000,
            recv: 0x6000,
            ..inputs()
        };
        let (words, digest) = (p.words, p.args.digest);
        assert!(p.moved_to(&moved));
        p.serve(moved);
        assert_eq!((p.args.send, p.args.recv), (0x5000, 0x6000));
        assert!(p.inputs == moved);
        assert_eq!(p.words, words, "plain buffers are no part of the identity");
        assert_eq!(p.args.digest, digest);
        // Back to the first buffers: the same again.
        p.serve(inputs());
        assert_eq!((p.args.send, p.args.recv), (0x1000, 0x2000));
    }

    #[test]
    fn the_kept_path_answers_only_for_the_same_inputs() {
        let p = prepared();
        let never = || -> bool { panic!("registration asked of the same buffers") };
        assert_eq!(
            kept_path(Some(&p), &inputs(), never),
            Some(CudaPath::OneShotLl)
        );
        assert_eq!(kept_path(None, &inputs(), never), None);
        for changed in &changed_inputs()[MOVED..] {
            assert_eq!(kept_path(Some(&p), changed, || true), None);
        }
        assert_eq!(
            kept_path(Some(&p), &changed_inputs()[0], || true),
            Some(CudaPath::OneShotLl)
        );
        assert_eq!(kept_path(Some(&p), &changed_inputs()[0], || false), None);
    }
}
