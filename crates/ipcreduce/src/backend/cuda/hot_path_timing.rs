//! CPU timings of the pure pieces of an eager all-reduce's host path, for comparing changes
//! to it without a GPU: `cargo test --release -p ipcreduce --lib hot_path_timing -- --ignored
//! --nocapture`. Ignored by default (timings, not checks). Each piece runs in a loop of
//! [`ITERS`] calls on warm caches, so the numbers are a lower bound of what a real call (with
//! a driver launch between two calls) pays.

use super::calls::CallLedger;
use super::identity::{CallIdentity, RegionAt};
use super::kernel_args::{KernelArgs, Shared};
use super::paths::CudaPath;
use super::pointers::{Facts, Kind, PointerCache};
use super::registry::Registry;
use crate::abort::AbortState;
use crate::backend::SgOp;
use crate::bootstrap::Notices;
use crate::flight::{CallId, Recorder};
use crate::plan::{self, Fabric, GridLimits, StagedKnobs};
use crate::tune::{Entry, Table};
use crate::types::{Algorithm, BackendKind, DType, ReduceOp};
use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

const ITERS: u64 = 1_000_000;

/// Mean ns per call of `f` over [`ITERS`] calls (after a warm-up), printed under `name`.
fn time(name: &str, mut f: impl FnMut(u64)) -> f64 {
    for i in 0..ITERS / 10 {
        f(i);
    }
    let t = Instant::now();
    for i in 0..ITERS {
        f(i);
    }
    let ns = t.elapsed().as_nanos() as f64 / ITERS as f64;
    println!("{name:<40} {ns:8.1} ns");
    ns
}

fn limits() -> GridLimits {
    GridLimits {
        ll_max: plan::ll_default_max_bytes(2, Fabric::Peer),
        cap: 64,
        fixed: None,
        ce_min: 0,
        ce_staged_min: 0,
        deep: true,
        deep_cap: 64,
        ll12: false,
        staged: StagedKnobs::default(),
    }
}

fn ident(count: u64) -> CallIdentity {
    CallIdentity {
        op: SgOp::AllReduce,
        path: CudaPath::OneShotLl,
        dtype: DType::Bf16,
        reduce: ReduceOp::Sum,
        count,
        in_place: false,
        send: None,
        recv: None,
        fused: None,
        origin: None,
    }
}

/// A tuned table of six rows for two ranks and 2-byte elements, stored out of order.
fn tuned_table() -> Table {
    let mut t = Table::builtin();
    let row = |min: usize, max: usize, algo: &str| Entry {
        world: 2,
        elem_bytes: 2,
        min_bytes: min,
        max_bytes: max,
        algo: algo.into(),
        ctas: Some(8),
        chunk: None,
        time_us: 5.0,
        measured_bytes: min,
    };
    t.entries = vec![
        row(1 << 20, 4 << 20, "twoshot"),
        row(0, 4 << 10, "oneshot"),
        row(4 << 10, 64 << 10, "oneshot"),
        row(64 << 10, 256 << 10, "oneshot"),
        row(256 << 10, 1 << 20, "two-shot"),
        row(4 << 20, usize::MAX, "twoshot"),
    ];
    t
}

#[test]
#[ignore = "timings, not checks: run with --ignored --nocapture"]
fn hot_path_timing() {
    time("clock: Instant::now", |_| {
        black_box(Instant::now());
    });
    time("clock: flight::stamp", |_| {
        black_box(crate::flight::stamp());
    });

    let id = ident(4096);
    time("identity: encode + digest", |i| {
        let id = CallIdentity {
            count: black_box(4096 + (i & 1)),
            ..id
        };
        black_box(id.encode());
        black_box(id.digest());
    });

    let abort = AbortState::new();
    // What Communicator::recorded and attempt did per call (Bootstrap::abort_state, twice)
    // and do now (Bootstrap::abort, borrowed).
    time("abort state: 2 Arc clones + is_aborted", |_| {
        for _ in 0..2 {
            let a = black_box(&abort).clone();
            black_box(a.is_aborted());
        }
    });
    time("abort state: borrowed + is_aborted", |_| {
        for _ in 0..2 {
            black_box(black_box(&*abort).is_aborted());
        }
    });
    let notices = Arc::new(Notices::default());
    let ledger = CallLedger::new(0, abort, notices);
    let words = id.encode();
    time("ledger: record", |i| {
        ledger.record(i + 1, &id, &words);
    });

    let mut flight = Recorder::new(crate::flight::DEFAULT_CAPACITY, None);
    let call = CallId {
        op: SgOp::AllReduce,
        count: 4096,
        dtype: DType::Bf16,
        reduce: ReduceOp::Sum,
        in_place: false,
        stream: 0x1234 as *mut _,
    };
    time("flight: begin + path + end", |_| {
        flight.begin(black_box(&call));
        flight.path(Algorithm::OneShot);
        flight.end(true);
    });

    let lim = limits();
    time("plan: choose + cuda_path + threads", |i| {
        let bytes = black_box(8192 + (i as usize & 1) * 2);
        let algo = plan::choose(
            Algorithm::Auto,
            None,
            BackendKind::Cuda,
            Fabric::Peer,
            2,
            bytes,
        );
        let (path, grid) = plan::cuda_path(algo, bytes, false, false, &lim, None);
        black_box(plan::block_threads(path, bytes, grid, 512));
        black_box(plan::staged_chunk_bytes(Fabric::Peer, bytes, 1 << 22, None));
        black_box(plan::staged_round(Fabric::Peer, None));
    });

    let empty = Table::builtin();
    time("tune: lookup, empty table", |i| {
        black_box(empty.lookup(2, 2, black_box(8192 + i as usize % 2)));
    });
    let tuned = tuned_table();
    time("tune: lookup + algorithm, 6 rows", |i| {
        let e = tuned.lookup(2, 2, black_box(8192 + i as usize % 2));
        black_box(e.and_then(Entry::algorithm));
    });

    let mut pointers = PointerCache::default();
    for k in 0..8u64 {
        pointers.insert(Facts {
            kind: Kind::Device,
            ordinal: 0,
            start: (k + 1) << 32,
            bytes: 1 << 30,
            whole: true,
        });
    }
    time("pointers: cache hit, send + recv", |_| {
        black_box(pointers.get(black_box((3 << 32) + 4096)));
        black_box(pointers.get(black_box((3 << 32) + 8192)));
    });

    let registry = Registry::default();
    time("registry: peers_of + 2 lookups, none", |_| {
        let (s, r) = (black_box(3u64 << 32), black_box((3u64 << 32) + 8192));
        black_box(registry.lookup(s, 8192).is_some() && registry.lookup(r, 8192).is_some());
        black_box(registry.peers_of(s, r, 8192, 2));
    });
    let region = RegionAt { id: 1, offset: 0 };
    black_box(region);

    let mut events: HashMap<usize, usize> = HashMap::new();
    for s in 0..4 {
        events.insert(0x5000 + s * 64, s);
    }
    time("events: HashMap get (SipHash)", |_| {
        black_box(events.get(&black_box(0x5000 + 64)));
    });

    let shared = KernelArgs::shared(&Shared {
        rank: 0,
        world: 2,
        bases: [0x10_0000; super::kernels::MAX_RANKS],
        counters: 0x900,
        err: 0x980,
        abort_flag: 0x7000,
        host_err: 0x7004,
        slot_bytes: 1 << 22,
        timeout: std::time::Duration::from_secs(5),
        mode: 0,
    });
    // The per-call build before the shared fields were kept (launcher.rs at b5670a5): the
    // loop over the ranks' workspaces, the timeout's conversion, and a second encode for the
    // digest. A reference for the line below it.
    let bases = [0x10_0000u64; super::kernels::MAX_RANKS];
    time("kernel args: old per-call build (ref)", |i| {
        let id = CallIdentity {
            count: black_box(4096 + (i & 1)),
            ..id
        };
        let words = id.encode();
        let world = black_box(2usize);
        let mut a = KernelArgs::default();
        for (r, base) in bases.iter().enumerate().take(world) {
            a.sig[r] = *base;
            a.ll[r] = base + super::kernels::SIG_BYTES as u64;
            a.data[r] = base + super::kernel_args::data_offset(world);
        }
        let timeout = black_box(std::time::Duration::from_secs(5));
        black_box(KernelArgs {
            send: 0xa0,
            recv: 0xb0,
            count: 4096,
            counters: 0x900,
            slot_bytes: 1 << 22,
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            digest: id.digest(),
            seq: i,
            ident: words,
            rank: 0,
            world: world as i32,
            ..a
        });
    });
    time("kernel args: encode + for_call", |i| {
        let words = CallIdentity {
            count: black_box(4096 + (i & 1)),
            ..id
        }
        .encode();
        black_box(shared.for_call((0xa0, 0xb0, 4096), &words, i, None));
    });

    let mut captures = super::captures::Captures::default();
    time("captures: origin, eager", |_| {
        black_box(captures.origin(black_box(None)));
    });
}
