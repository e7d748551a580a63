//! The cuda backend on a real GPU: `cargo test --release -p ipcreduce --features gpu --test gpu`
//! (compiled only with the `gpu` feature). Ranks are processes (this test binary again, as in
//! tests/host_allreduce.rs); several share one GPU under MPS (scripts/device/gpu-tests.sh).
//!
//! - every dtype, op and algorithm through `all_reduce_raw` at world 2, 4 and 8;
//! - stale-data chains `x <- all_reduce(x)` on a stream without host synchronization;
//! - CUDA graph replays with inputs that change between replays;
//! - streams: handle 0 is the legacy default stream; calls that switch streams stay ordered;
//! - teardown with work in flight, in both sharing modes;
//! - registered (zero-copy) buffers: every path on them, eager and in CUDA graph replays, in
//!   place and out of place, the copy-engine path; cuMemAlloc memory refused by register;
//! - the caller's buffers: another GPU's memory, page-locked and pageable host memory refused
//!   by every rank (the communicator stays usable), memory seen before reduced right;
//! - reduce-scatter and all-gather: plain and registered buffers, in place and out of place,
//!   eager and in CUDA graph replays, against the all-reduce (bitwise) and every rank's input;
//! - the low-latency wrap: more than 200,000 LL one-shot calls, every result checked, built so
//!   that a sequence number kept in 16 bits accepts a line left 65,536 calls earlier;
//! - hostile calls: ranks that call different operations, registered buffers or offsets, or
//!   count 0 against a real call, at LL, one-shot, two-shot and copy-engine sizes: every rank
//!   fails promptly with a mismatch naming both calls; LL8 and LL12 stress with count-0 calls
//!   between, eager and in graphs, every result checked.

mod common;

use common::chain::{self, Expect};
use common::cuda::{ck, Stream};
use common::{say, Job, Rank, Spawn, SECRET};
use cudarc::driver::sys;
use ipcreduce::backend::cuda::memory::DeviceAlloc;
use ipcreduce::{
    reference, Algorithm, BackendChoice, Communicator, Config, DType, ReduceOp, Sharing,
};
use std::ffi::c_void;
use std::io::Write;
use std::time::Duration;

const ROLE: &str = "IPCREDUCE_GPU_ROLE";

// ---------------------------------------------------------------------------------------
// Rank side

fn play_rank_if_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let code = match role.as_str() {
        "sweep" => rank_sweep(),
        "chain" => rank_chain(),
        "graph" => rank_graph(),
        "streams" => rank_streams(),
        "teardown" => rank_teardown(),
        "llwrap" => rank_ll_wrap(),
        "device" => rank_device(),
        "registered" => rank_registered(),
        "pointers" => rank_pointers(),
        "scatter_gather" => rank_scatter_gather(),
        "hostile" => rank_hostile(),
        "graph_origin" => rank_graph_origin(),
        "graph_after_close" => rank_graph_after_close(),
        "share_refused" => rank_share_refused(),
        "staged_offsets" => rank_staged_offsets(),
        other => panic!("unknown role {other}"),
    };
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

fn config(sharing: Option<Sharing>) -> Config {
    Config {
        backend: BackendChoice::Cuda,
        // Small slots: large messages cross several chunks.
        workspace_bytes: Some(4 << 20),
        sharing,
        ..Config::default()
    }
}

fn join() -> Communicator {
    Communicator::init(&config(None)).expect("cuda communicator")
}

/// Under a 10 % MPS share asking for more CTAs than can be resident at once (IPCREDUCE_BLOCKS)
/// is an init error naming the limit, on every rank (each computes it from the same agreed room).
fn rank_share_refused() -> i32 {
    let e = match Communicator::init(&config(None)) {
        Ok(_) => panic!("IPCREDUCE_BLOCKS=16 accepted under a 10 % MPS share"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("can be resident at once"), "{e}");
    say("DONE 1");
    0
}

/// A non-blocking stream of the caller's own.
/// A CUDA graph captured from the calls `body` makes on `stream`, instantiated; destroyed on
/// drop (after the caller synchronized its last replay).
struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

impl Graph {
    fn capture(stream: &Stream, body: impl FnOnce()) -> Graph {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: capture on our stream; ended below.
        ck(
            unsafe { sys::cuStreamBeginCapture_v2(stream.0, mode) },
            "begin capture",
        );
        body();
        let mut graph = std::ptr::null_mut();
        // SAFETY: ends the capture begun above.
        ck(
            unsafe { sys::cuStreamEndCapture(stream.0, &mut graph) },
            "end capture",
        );
        let mut exec = std::ptr::null_mut();
        // SAFETY: instantiates the captured graph.
        ck(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
            "instantiate",
        );
        Graph { graph, exec }
    }

    fn launch(&self, stream: &Stream) {
        // SAFETY: launches our instantiated graph on our stream.
        ck(
            unsafe { sys::cuGraphLaunch(self.exec, stream.0) },
            "graph launch",
        );
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: ours, destroyed once; every test synchronizes its stream before dropping.
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}

fn sync(stream: sys::CUstream) {
    // SAFETY: a live stream (or 0, the legacy default stream).
    ck(
        unsafe { sys::cuStreamSynchronize(stream) },
        "cuStreamSynchronize",
    );
}

fn upload(dst: &DeviceAlloc, data: &[u8], stream: sys::CUstream) {
    assert!(data.len() <= dst.bytes);
    // SAFETY: in bounds; synchronized before `data` can go away.
    ck(
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst.ptr, data.as_ptr().cast(), data.len(), stream) },
        "upload",
    );
    sync(stream);
}

fn download(src: u64, out: &mut [u8], stream: sys::CUstream) {
    // SAFETY: the caller passes a live device range of out.len() bytes.
    ck(
        unsafe { sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, out.len(), stream) },
        "download",
    );
    sync(stream);
}

/// `count` elements, `send` and `recv` device pointers, on `stream`.
#[allow(clippy::too_many_arguments)]
fn reduce(
    c: &mut Communicator,
    send: u64,
    recv: u64,
    count: usize,
    dtype: DType,
    op: ReduceOp,
    algo: Algorithm,
    stream: *mut c_void,
) {
    // SAFETY: device buffers of this rank's GPU holding `count` elements.
    unsafe {
        c.all_reduce_raw(
            send as *const c_void,
            recv as *mut c_void,
            count,
            dtype,
            op,
            algo,
            stream,
        )
    }
    .unwrap_or_else(|e| panic!("{count} x {dtype} {op} {algo}: {e}"));
}

/// Every rank's fingerprint must be rank 0's.
fn same_everywhere(c: &mut Communicator, out: &[u8], what: &str) {
    let fp = reference::fingerprint(out).to_le_bytes();
    let all = c.bootstrap().all_gather(&fp).expect("all_gather");
    assert!(all.iter().all(|f| f[..] == fp), "{what}: ranks differ");
}

/// Every dtype, op and algorithm, sizes from 1 element to several chunks, out of place and
/// in place, checked against the float64 reference and bitwise across ranks.
fn rank_sweep() -> i32 {
    let mut c = join();
    let (rank, world) = (c.rank(), c.world());
    let s = Stream::new();
    let sizes = [1usize, 7, 1000, 16384, 65537, (3 << 20) + 5];
    let max = sizes.iter().max().unwrap() * 4;
    let (send, recv) = (
        DeviceAlloc::new(max, rank).unwrap(),
        DeviceAlloc::new(max, rank).unwrap(),
    );
    let mut checked = 0;
    let mut paths = std::collections::BTreeSet::new();
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            for algo in [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Auto] {
                for (k, &count) in sizes.iter().enumerate() {
                    let bytes = count * dtype.size();
                    let seed = (checked as u64) << 8 | k as u64;
                    let mut input = vec![0u8; bytes];
                    reference::fill_input(dtype, seed, rank, &mut input);
                    let in_place = k % 2 == 1;
                    upload(&send, &input, s.0);
                    let out_ptr = if in_place { send.ptr } else { recv.ptr };
                    if !in_place {
                        upload(&recv, &vec![0xFF; bytes], s.0);
                    }
                    reduce(&mut c, send.ptr, out_ptr, count, dtype, op, algo, s.ptr());
                    paths.insert(c.last_path().expect("a path").name);
                    let mut out = vec![0u8; bytes];
                    download(out_ptr, &mut out, s.0);
                    let what = format!("{count} x {dtype} {op} {algo} in_place={in_place}");
                    let wrong = reference::count_wrong(dtype, op, seed, world, &out);
                    assert_eq!(wrong, 0, "rank {rank}: {what}: {wrong} wrong");
                    same_everywhere(&mut c, &out, &what);
                    checked += 1;
                }
            }
        }
    }
    expect_copy_engine(world, &paths, "IPCREDUCE_CE_STAGED_MIN", "ce-staged");
    say(format!("DONE {checked}"));
    0
}

/// With the knob `knob` set at two ranks, the copy-engine path `path` it turns on must be
/// among the paths taken (else a test of it would pass on the SM kernels).
fn expect_copy_engine(
    world: usize,
    paths: &std::collections::BTreeSet<&str>,
    knob: &str,
    path: &str,
) {
    if std::env::var_os(knob).is_some() && world == 2 {
        assert!(
            paths.contains(path),
            "{path} (the copy-engine path of {knob}) not taken: {paths:?}"
        );
    }
}

/// The staged kernels at user pointers off 16-byte alignment (their own input then comes from
/// their slot's copy, not from the input itself) and at aligned ones, one-shot and two-shot,
/// every dtype and op, sizes from one element to many chunks, in place and out of place.
fn rank_staged_offsets() -> i32 {
    let mut c = join();
    let (rank, world) = (c.rank(), c.world());
    let s = Stream::new();
    let sizes = [1usize, 9, 40_001, 300_007];
    let max = sizes.iter().max().unwrap() * 4 + 64;
    let (send, recv) = (
        DeviceAlloc::new(max, rank).unwrap(),
        DeviceAlloc::new(max, rank).unwrap(),
    );
    let mut checked = 0;
    for dtype in DType::ALL {
        for op in ReduceOp::ALL {
            for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
                for (k, &count) in sizes.iter().enumerate() {
                    // Input off alignment by one element, output by three; or both aligned.
                    let (si, ri) = [(1, 3), (0, 0), (0, 5), (2, 0)][k];
                    let (sp, rp) = (
                        send.ptr + (si * dtype.size()) as u64,
                        recv.ptr + (ri * dtype.size()) as u64,
                    );
                    let bytes = count * dtype.size();
                    let seed = (checked as u64) << 8 | 0x80 | k as u64;
                    let mut input = vec![0u8; bytes];
                    reference::fill_input(dtype, seed, rank, &mut input);
                    let in_place = (checked / 4) % 2 == 1;
                    let out_ptr = if in_place { sp } else { rp };
                    // SAFETY: inside our allocations, on our stream.
                    ck(
                        unsafe { sys::cuMemcpyHtoDAsync_v2(sp, input.as_ptr().cast(), bytes, s.0) },
                        "upload",
                    );
                    if !in_place {
                        let poison = vec![0xFFu8; bytes];
                        // SAFETY: as above.
                        ck(
                            unsafe {
                                sys::cuMemcpyHtoDAsync_v2(rp, poison.as_ptr().cast(), bytes, s.0)
                            },
                            "poison",
                        );
                    }
                    reduce(&mut c, sp, out_ptr, count, dtype, op, algo, s.ptr());
                    let mut out = vec![0u8; bytes];
                    download(out_ptr, &mut out, s.0);
                    let what =
                        format!("{count} x {dtype} {op} {algo} at +{si}/+{ri} in_place={in_place}");
                    let wrong = reference::count_wrong(dtype, op, seed, world, &out);
                    assert_eq!(wrong, 0, "rank {rank}: {what}: {wrong} wrong");
                    same_everywhere(&mut c, &out, &what);
                    checked += 1;
                }
            }
        }
    }
    say(format!("DONE {checked}"));
    0
}

/// Chains of in-place calls on one stream with no host synchronization; each step's result
/// is copied aside on the same stream and all are checked at the end.
fn rank_chain() -> i32 {
    let mut c = join();
    let s = Stream::new();
    // 4.8 MB of f32: the whole buffer crosses the 2 MB slots, its small prefixes do not.
    let len = 1_200_007;
    let mut checked = 0;
    for dtype in DType::ALL {
        for lead in 0..3 {
            let algos = [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Auto];
            let order: Vec<_> = (0..3).map(|k| algos[(lead + k) % 3]).collect();
            let steps = chain::steps(len, chain::max_steps(dtype, c.world()), &order);
            checked += run_chain(&mut c, dtype, &steps, s.0);
        }
    }
    say(format!("DONE {checked}"));
    0
}

/// Runs `steps` in place on `stream`, snapshots each step's buffer behind it on the same
/// stream, synchronizes once at the end and checks every snapshot. Returns the steps checked.
fn run_chain(
    c: &mut Communicator,
    dtype: DType,
    steps: &[chain::Step],
    st: sys::CUstream,
) -> usize {
    let (rank, world) = (c.rank(), c.world());
    let len = steps.iter().map(|s| s.count).max().unwrap();
    let bytes = len * dtype.size();
    let x = DeviceAlloc::new(bytes, rank).unwrap();
    let snaps = DeviceAlloc::new(bytes * steps.len(), rank).unwrap();
    upload(&x, &chain::input(dtype, rank, len), st);
    for (k, step) in steps.iter().enumerate() {
        reduce(
            c,
            x.ptr,
            x.ptr,
            step.count,
            dtype,
            ReduceOp::Sum,
            step.algo,
            st.cast(),
        );
        // SAFETY: both ranges inside our allocations, on the step's stream.
        ck(
            unsafe { sys::cuMemcpyDtoDAsync_v2(snaps.ptr + (k * bytes) as u64, x.ptr, bytes, st) },
            "snapshot",
        );
    }
    c.synchronize().expect("synchronize");
    sync(st);
    let mut all = vec![0u8; bytes * steps.len()];
    download(snaps.ptr, &mut all, st);
    check_chain(
        dtype,
        world,
        rank,
        steps,
        |k| &all[k * bytes..(k + 1) * bytes],
        |_| String::new(),
    )
}

/// Checks the buffer after every step of a chain against [`Expect`] (`after(k)`: its bytes
/// after step k; `where_(k)`: more words naming step k); returns the steps checked.
fn check_chain<'a>(
    dtype: DType,
    world: usize,
    rank: usize,
    steps: &[chain::Step],
    after: impl Fn(usize) -> &'a [u8],
    where_: impl Fn(usize) -> String,
) -> usize {
    let len = steps.iter().map(|s| s.count).max().unwrap();
    let mut want = Expect::new(dtype, world, rank, len);
    for (k, step) in steps.iter().enumerate() {
        want.apply(step);
        let what = format!("{dtype} step {k} {step:?}{}", where_(k));
        want.check(after(k), &what)
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
    steps.len()
}

/// The chain of `steps` across streams: step k on `streams[k % len]` after `before(k,
/// stream)`, reading buffer k and writing buffer k + 1, so that only the library orders the
/// calls (a snapshot behind an in-place call would be the caller's work on the buffer, which
/// the next call on another stream need not wait for). Buffer k + 1 starts as step k must
/// leave it, but with the elements step k writes zero: a call that overtook the call before it
/// reads zeros and its result is wrong. Every buffer is checked after one synchronize.
fn run_stream_chain(
    c: &mut Communicator,
    dtype: DType,
    steps: &[chain::Step],
    streams: &[sys::CUstream],
    mut before: impl FnMut(usize, sys::CUstream),
) -> usize {
    let (rank, world) = (c.rank(), c.world());
    let len = steps.iter().map(|s| s.count).max().unwrap();
    let bytes = len * dtype.size();
    let bufs = DeviceAlloc::new(bytes * (steps.len() + 1), rank).unwrap();
    let buf = |k: usize| bufs.ptr + (k * bytes) as u64;
    let mut start = chain::input(dtype, rank, len);
    let mut want = Expect::new(dtype, world, rank, len);
    for step in steps {
        want.apply(step);
        start.extend(want.bytes(step.count));
    }
    upload(&bufs, &start, streams[0]);
    for (k, step) in steps.iter().enumerate() {
        let st = streams[k % streams.len()];
        before(k, st);
        reduce(
            c,
            buf(k),
            buf(k + 1),
            step.count,
            dtype,
            ReduceOp::Sum,
            step.algo,
            st.cast(),
        );
    }
    c.synchronize().expect("synchronize");
    for st in streams {
        sync(*st);
    }
    let mut all = vec![0u8; bytes * (steps.len() + 1)];
    download(bufs.ptr, &mut all, streams[0]);
    check_chain(
        dtype,
        world,
        rank,
        steps,
        |k| &all[(k + 1) * bytes..(k + 2) * bytes],
        |k| format!(" on stream {}", k % streams.len()),
    )
}

/// CUDA graphs: two calls (two algorithms, two outputs) captured once, replayed with a new
/// input each time; both outputs checked after every replay.
fn rank_graph() -> i32 {
    let mut c = join();
    let (rank, world) = (c.rank(), c.world());
    let s = Stream::new();
    let mut checked = 0;
    let mut paths = std::collections::BTreeSet::new();
    let pairs = [
        (1000usize, Algorithm::OneShot, Algorithm::TwoShot),
        (16384, Algorithm::OneShot, Algorithm::Auto),
        (300_001, Algorithm::TwoShot, Algorithm::OneShot),
        ((2 << 20) + 3, Algorithm::Auto, Algorithm::TwoShot),
    ];
    for dtype in DType::ALL {
        for &(count, a, b) in &pairs {
            let bytes = count * dtype.size();
            let send = DeviceAlloc::new(bytes, rank).unwrap();
            let (ra, rb) = (
                DeviceAlloc::new(bytes, rank).unwrap(),
                DeviceAlloc::new(bytes, rank).unwrap(),
            );
            let g = Graph::capture(&s, || {
                reduce(
                    &mut c,
                    send.ptr,
                    ra.ptr,
                    count,
                    dtype,
                    ReduceOp::Sum,
                    a,
                    s.ptr(),
                );
                paths.insert(c.last_path().expect("a path").name);
                reduce(
                    &mut c,
                    send.ptr,
                    rb.ptr,
                    count,
                    dtype,
                    ReduceOp::Sum,
                    b,
                    s.ptr(),
                );
                paths.insert(c.last_path().expect("a path").name);
            });
            for replay in 0..12u64 {
                let seed = replay << 32 | count as u64;
                let mut input = vec![0u8; bytes];
                reference::fill_input(dtype, seed, rank, &mut input);
                upload(&send, &input, s.0);
                g.launch(&s);
                for (out, algo) in [(&ra, a), (&rb, b)] {
                    let mut got = vec![0u8; bytes];
                    download(out.ptr, &mut got, s.0);
                    let wrong = reference::count_wrong(dtype, ReduceOp::Sum, seed, world, &got);
                    assert_eq!(
                        wrong, 0,
                        "rank {rank}: graph replay {replay}: {count} x {dtype} {algo}"
                    );
                    checked += 1;
                }
            }
        }
    }
    if let Some(e) = c.async_error() {
        panic!("after the graphs: {e}");
    }
    expect_copy_engine(world, &paths, "IPCREDUCE_CE_STAGED_MIN", "ce-staged");
    say(format!("DONE {checked}"));
    0
}

/// Registered buffers: each case captured once into a CUDA graph and replayed with new inputs
/// (the peers' addresses are fixed at capture), then run eagerly; the path it took must be a
/// zero-copy one (or LL for small one-shot calls). `register` refuses cuMemAlloc memory with
/// a message that says how to allocate; `free` is collective.
fn rank_registered() -> i32 {
    // A refused registration aborts its communicator on every rank (registration is
    // collective): it gets one of its own.
    {
        let mut refused = hostile_comm("register-refused", None);
        let rank = refused.rank();
        let plain = DeviceAlloc::new(1 << 20, rank).unwrap();
        // SAFETY: refused before the memory is used.
        let err = unsafe { refused.register(plain.ptr, 1 << 20) }.unwrap_err();
        assert!(
            matches!(
                err,
                ipcreduce::Error::InvalidArgument { .. } | ipcreduce::Error::Aborted { .. }
            ),
            "rank {rank}: {err:?}"
        );
        let err = err.to_string();
        assert!(err.contains("Communicator::alloc"), "{err}");
    }
    let mut c = join();
    let (rank, world) = (c.rank(), c.world());
    let s = Stream::new();
    let max = 4 << 20;
    let (a, b) = (c.alloc(max).unwrap(), c.alloc(max).unwrap());
    assert_eq!(a.bytes(), max);
    let cases = [
        (1000usize, Algorithm::OneShot, false),
        (100_003, Algorithm::OneShot, false),
        (100_003, Algorithm::OneShot, true),
        (100_003, Algorithm::TwoShot, false),
        ((1 << 20) - 3, Algorithm::Auto, false),
        ((1 << 20) - 3, Algorithm::TwoShot, true),
    ];
    let mut checked = 0;
    let mut paths = std::collections::BTreeSet::new();
    for dtype in DType::ALL {
        for &(count, algo, in_place) in &cases {
            let bytes = count * dtype.size();
            let recv = if in_place { a.ptr() } else { b.ptr() };
            let g = Graph::capture(&s, || {
                reduce(
                    &mut c,
                    a.ptr(),
                    recv,
                    count,
                    dtype,
                    ReduceOp::Sum,
                    algo,
                    s.ptr(),
                );
            });
            let path = c.last_path().expect("a path");
            assert!(
                path.registered || path.name.starts_with("oneshot-ll"),
                "{count} x {dtype} {algo}: {path:?}"
            );
            paths.insert(path.name);
            for replay in 0..4u64 {
                let seed = replay << 40 | (count as u64) << 8 | dtype.code() as u64;
                let mut input = vec![0u8; bytes];
                reference::fill_input(dtype, seed, rank, &mut input);
                // SAFETY: in bounds of `a`; synchronized before `input` goes away.
                ck(
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(a.ptr(), input.as_ptr().cast(), bytes, s.0)
                    },
                    "upload",
                );
                if replay < 3 {
                    g.launch(&s);
                } else {
                    reduce(
                        &mut c,
                        a.ptr(),
                        recv,
                        count,
                        dtype,
                        ReduceOp::Sum,
                        algo,
                        s.ptr(),
                    );
                }
                let mut got = vec![0u8; bytes];
                download(recv, &mut got, s.0);
                let wrong = reference::count_wrong(dtype, ReduceOp::Sum, seed, world, &got);
                assert_eq!(
                    wrong, 0,
                    "rank {rank}: {count} x {dtype} {algo} in place {in_place}, {}, replay {replay}",
                    path.name
                );
                same_everywhere(&mut c, &got, "registered");
                checked += 1;
            }
        }
    }
    if let Some(e) = c.async_error() {
        panic!("after the registered calls: {e}");
    }
    expect_copy_engine(world, &paths, "IPCREDUCE_CE_MIN", "ce");
    c.free(a).unwrap();
    c.free(b).unwrap();
    say(format!("DONE {checked}"));
    0
}

/// Enqueues ~`mib` MiB of memset on `stream`: work that delays what follows on it.
fn delay(scratch: &DeviceAlloc, mib: usize, stream: sys::CUstream) {
    let words = (mib << 20).min(scratch.bytes) / 4;
    // SAFETY: inside our scratch allocation.
    ck(
        unsafe { sys::cuMemsetD32Async(scratch.ptr, 0x1234_5678, words, stream) },
        "delay memset",
    );
}

fn rank_streams() -> i32 {
    let mut c = join();
    let (rank, world) = (c.rank(), c.world());
    let scratch = DeviceAlloc::new(512 << 20, rank).unwrap();
    let mut checked = 0;

    // 1. Handle 0 is the legacy default stream: the input is written there, behind slow work,
    //    and the call on handle 0 must see it (on a private stream it would race).
    let count = 1 << 16;
    let (send, recv) = (
        DeviceAlloc::new(count * 4, rank).unwrap(),
        DeviceAlloc::new(count * 4, rank).unwrap(),
    );
    for round in 0..20u32 {
        let value = (rank as u32 + 1 + round) as f32;
        delay(&scratch, 512, std::ptr::null_mut());
        // SAFETY: inside `send`, on the legacy default stream.
        ck(
            unsafe {
                sys::cuMemsetD32Async(send.ptr, value.to_bits(), count, std::ptr::null_mut())
            },
            "input memset",
        );
        reduce(
            &mut c,
            send.ptr,
            recv.ptr,
            count,
            DType::F32,
            ReduceOp::Sum,
            Algorithm::Auto,
            std::ptr::null_mut(),
        );
        let mut out = vec![0u8; count * 4];
        download(recv.ptr, &mut out, std::ptr::null_mut());
        let want: f32 = (0..world).map(|r| (r as u32 + 1 + round) as f32).sum();
        let got: &[f32] = bytemuck::cast_slice(&out);
        let bad = got.iter().filter(|v| **v != want).count();
        assert_eq!(
            bad, 0,
            "rank {rank}: round {round} on stream 0: {bad} wrong (want {want})"
        );
        checked += 1;
    }

    // 2. Calls that switch between streams stay in call order: every other step is delayed
    //    on its own stream, so without ordering the next step (another stream) would overtake.
    let (a, b) = (Stream::new(), Stream::new());
    let streams = [a.0, b.0, std::ptr::null_mut()];
    for dtype in [DType::F32, DType::Bf16] {
        let algos = [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Auto];
        let steps = chain::steps(200_003, chain::max_steps(dtype, c.world()), &algos);
        checked += run_stream_chain(&mut c, dtype, &steps, &streams, |k, st| {
            if k % 2 == 0 {
                delay(&scratch, 256, st);
            }
        });
    }
    say(format!("DONE {checked}"));
    0
}

/// Communicators dropped with work still in flight (on a caller's stream and on stream 0),
/// in both sharing modes; rank 0 leaves first. After Drop the work must be complete and
/// right, and nothing may crash.
fn rank_teardown() -> i32 {
    let base = ipcreduce::bootstrap::RankInfo::from_env().unwrap();
    // The stream outlives every communicator, so it needs a context of its own first: the
    // device's primary context, the one the communicators then find current and use.
    let count = cudarc::driver::safe::CudaContext::device_count().unwrap() as usize;
    let ctx = cudarc::driver::safe::CudaContext::new(base.local_rank % count).unwrap();
    ctx.bind_to_thread().unwrap();
    let s = Stream::new();
    let mut checked = 0;
    for cycle in 0..6usize {
        let sharing = [Sharing::Vmm, Sharing::Ipc][cycle % 2];
        let stream = if cycle % 3 == 2 {
            std::ptr::null_mut()
        } else {
            s.0
        };
        let info = ipcreduce::bootstrap::RankInfo::new(
            base.rank,
            base.world,
            base.socket.with_file_name(format!("t{cycle}.sock")),
            format!("teardown{cycle}"),
            base.secret.clone(),
        )
        .unwrap();
        let mut c = Communicator::with_rank_info(info, &config(Some(sharing))).unwrap();
        let (rank, world) = (c.rank(), c.world());
        let dtype = DType::F32;
        let steps = chain::steps(
            100_003,
            chain::max_steps(dtype, world),
            &[Algorithm::OneShot, Algorithm::TwoShot],
        );
        let len = steps.iter().map(|s| s.count).max().unwrap();
        let x = DeviceAlloc::new(len * 4, rank).unwrap();
        upload(&x, &chain::input(dtype, rank, len), stream);
        for step in &steps {
            reduce(
                &mut c,
                x.ptr,
                x.ptr,
                step.count,
                dtype,
                ReduceOp::Sum,
                step.algo,
                stream.cast(),
            );
        }
        if rank != 0 {
            // Rank 0 leaves first: its teardown must wait for ours (the barrier).
            std::thread::sleep(Duration::from_millis(200));
        }
        drop(c);
        // SAFETY: queries a live stream.
        let res = unsafe { sys::cuStreamQuery(stream) };
        assert_eq!(
            res,
            sys::CUresult::CUDA_SUCCESS,
            "cycle {cycle} ({sharing:?}): work still pending on the stream after Drop"
        );
        let mut out = vec![0u8; len * 4];
        download(x.ptr, &mut out, stream);
        let mut want = Expect::new(dtype, world, rank, len);
        for step in &steps {
            want.apply(step);
        }
        want.check(&out, &format!("teardown cycle {cycle} ({sharing:?})"))
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        checked += 1;
    }
    say(format!("DONE {checked}"));
    0
}

fn rank_ll_wrap() -> i32 {
    let mut c = join();
    let (rank, world) = (c.rank(), c.world());
    let calls: usize = std::env::var("GPU_TEST_LL_CALLS").map_or(200_704, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("GPU_TEST_LL_CALLS={v} is not a number"))
    });
    let s = Stream::new();
    let (send, recv) = (
        DeviceAlloc::new(64 << 10, rank).unwrap(),
        DeviceAlloc::new(64 << 10, rank).unwrap(),
    );
    let dtype = DType::F32;
    let mut input = vec![0u8; 64 << 10];
    let mut out = vec![0u8; 64 << 10];
    for i in 0..calls {
        let count = common::ll_sizes::ll_count(i);
        let bytes = count * 4;
        // A fresh input every call: a stale line carries the data of 65,536 calls ago.
        let seed = i as u64;
        reference::fill_input(dtype, seed, rank, &mut input[..bytes]);
        upload(&send, &input[..bytes], s.0);
        if i % 65_536 == 0 && rank != 0 {
            // Let rank 0 reach our lines before we write them: a check of 16 bits of the
            // sequence accepts what the large call 65,536 calls ago left there.
            std::thread::sleep(Duration::from_millis(5));
        }
        reduce(
            &mut c,
            send.ptr,
            recv.ptr,
            count,
            dtype,
            ReduceOp::Sum,
            Algorithm::OneShot,
            s.ptr(),
        );
        download(recv.ptr, &mut out[..bytes], s.0);
        let wrong = reference::count_wrong(dtype, ReduceOp::Sum, seed, world, &out[..bytes]);
        assert_eq!(
            wrong, 0,
            "rank {rank}: LL call {i} ({bytes} bytes): {wrong} wrong elements"
        );
        if (i + 1) % 50_000 == 0 && rank == 0 {
            eprintln!("LL wrap: {} calls checked", i + 1);
        }
    }
    say(format!("DONE {calls}"));
    0
}

/// What the communicator accepts as send and recv buffers (asked of the driver once per
/// allocation, then known by address range): this GPU's device memory, anywhere inside the
/// allocation; not another GPU's, page-locked host or pageable host memory, refused on every
/// rank before anything is enqueued, so the communicator stays usable.
fn rank_pointers() -> i32 {
    let mut c = join();
    let (rank, world) = (c.rank(), c.world());
    let ordinal = c.cuda_device().expect("a cuda device");
    let n = 4096;
    let x = DeviceAlloc::new(n * 4, rank).unwrap();
    let mut checked = 0;
    // Calls on the allocation seen before (whole, then a part inside it) on the legacy
    // default stream, chained without synchronizing: x <- sum(x) three times.
    for (off, count) in [(0, n), (1024, n - 1024)] {
        let init = vec![(rank + 1) as f32; n];
        upload(&x, bytemuck::cast_slice(&init), std::ptr::null_mut());
        let p = x.ptr + 4 * off as u64;
        for _ in 0..3 {
            let stream = std::ptr::null_mut();
            reduce(
                &mut c,
                p,
                p,
                count,
                DType::F32,
                ReduceOp::Sum,
                Algorithm::Auto,
                stream,
            );
        }
        let mut out = vec![0f32; count];
        download(p, bytemuck::cast_slice_mut(&mut out), std::ptr::null_mut());
        let w = world as f32;
        let want = w * w * (w * (w + 1.0) / 2.0);
        assert!(
            out.iter().all(|v| *v == want),
            "offset {off}: {} != {want}",
            out[0]
        );
        checked += 1;
    }
    // A refused call aborts the communicator on every rank (the peers made the same call, so a
    // rank may see a peer's refusal as Aborted before its own check runs): each refusal gets a
    // communicator of its own, and the refused rank's error must name the reason, either as
    // its own InvalidArgument or as the abort that carries it.
    let mut case = 0;
    let mut refuse = |send: u64, recv: u64, count: usize, why: &str| {
        case += 1;
        let mut r_comm = hostile_comm(&format!("pointers-{case}"), None);
        // SAFETY: refused before anything is enqueued (what this checks).
        let r = unsafe {
            r_comm.all_reduce_raw(
                send as *const c_void,
                recv as *mut c_void,
                count,
                DType::F32,
                ReduceOp::Sum,
                Algorithm::Auto,
                std::ptr::null_mut(),
            )
        };
        let e = r.expect_err(why);
        let text = e.to_string();
        match &e {
            ipcreduce::Error::InvalidArgument { rank: r, .. } => {
                assert_eq!(*r, rank, "{e}");
            }
            ipcreduce::Error::Aborted { .. } => {}
            other => panic!("rank {rank}: {why}: not a refusal: {other:?}"),
        }
        assert!(text.contains(why), "{e} lacks '{why}'");
        // Dead afterwards: the next call is refused with the same reason.
        // SAFETY: nothing is enqueued on a refused call.
        let again = unsafe {
            r_comm.all_reduce_raw(
                x.ptr as *const c_void,
                x.ptr as *mut c_void,
                n,
                DType::F32,
                ReduceOp::Sum,
                Algorithm::Auto,
                std::ptr::null_mut(),
            )
        };
        match again {
            Err(ipcreduce::Error::Aborted { reason, .. }) => {
                assert!(reason.contains(why), "rank {rank}: later call: {reason}")
            }
            other => panic!("rank {rank}: a call after the refusal ({why}): {other:?}"),
        }
    };
    let mut pinned: *mut c_void = std::ptr::null_mut();
    // SAFETY: allocates page-locked host memory, freed below.
    ck(
        unsafe { sys::cuMemHostAlloc(&mut pinned, n * 4, 0) },
        "cuMemHostAlloc",
    );
    refuse(pinned as u64, pinned as u64, n, "send buffer");
    refuse(x.ptr, pinned as u64, n, "page-locked host memory");
    // SAFETY: ours, freed once; nothing was enqueued on it.
    ck(unsafe { sys::cuMemFreeHost(pinned) }, "cuMemFreeHost");
    let pageable = vec![0f32; n];
    refuse(pageable.as_ptr() as u64, x.ptr, n, "not CUDA device memory");
    // A count larger than the buffer: it would run past the end of its allocation (cuMemAlloc:
    // the allocation must hold it whole).
    let half = x.ptr + 2 * n as u64;
    let past = format!(
        "send buffer {half:#x} of {} bytes runs past the end of its allocation",
        4 * n
    );
    refuse(half, half, n, &past);
    // Mapped memory (cuMemMap, as PyTorch's expandable segments): one piece mapped, the next
    // reserved but not: a buffer over both runs into memory that is not this GPU's.
    {
        use ipcreduce::backend::cuda::driver as d;
        // SAFETY: a plain C struct; all-zero is its documented default.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = ordinal as i32;
        let g = d::granularity(&prop, rank).unwrap();
        let handle = d::mem_create(g, &prop, rank).unwrap();
        let base = d::address_reserve(2 * g, rank, || "test reserve".into()).unwrap();
        // SAFETY: our reservation and handle, undone below in reverse order.
        unsafe {
            d::mem_map(base, g, handle, rank, || "test map".into()).unwrap();
            d::set_access(base, g, ordinal as i32, rank, || "test access".into()).unwrap();
        }
        let inside = base + g as u64 / 2;
        // f32: from the middle of the piece to the middle of the hole.
        let count = g / 4;
        // What this driver says of the piece and of the hole behind it (in the log).
        for (name, at) in [("piece", inside), ("hole", base + g as u64)] {
            use sys::CUpointer_attribute as A;
            let attrs = [
                A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                A::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
                A::CU_POINTER_ATTRIBUTE_MAPPING_SIZE,
            ];
            match d::pointer_attributes(at, attrs) {
                Ok([s, n, ms, mn]) => eprintln!(
                    "rank {rank}: cuMemMap {name} {at:#x} (reserved [{base:#x}, +{:#x}), mapped \
                     +{g:#x}): range [{s:#x}, +{n:#x}), mapping [{ms:#x}, +{mn:#x})",
                    2 * g
                ),
                Err(e) => eprintln!("rank {rank}: cuMemMap {name} {at:#x}: {e:?}"),
            }
        }
        refuse(inside, inside, count, "that is not GPU");
        // As the recv buffer of a call whose send buffer is fine.
        let y = DeviceAlloc::new(g, rank).unwrap();
        let past = format!("recv buffer {inside:#x} of {g} bytes runs past the end");
        refuse(y.ptr, inside, count, &past);
        // SAFETY: nothing was enqueued on the mapping (the calls were refused).
        unsafe {
            d::unmap(base, g);
            d::address_free(base, 2 * g);
            d::release(handle);
        }
    }
    checked += 1;
    let count = cudarc::driver::safe::CudaContext::device_count().unwrap() as usize;
    if count > 1 {
        let other = cudarc::driver::safe::CudaContext::new((ordinal + 1) % count).unwrap();
        other.bind_to_thread().unwrap();
        let y = DeviceAlloc::new(n * 4, rank).unwrap();
        refuse(
            y.ptr,
            y.ptr,
            n,
            &format!("the communicator on GPU {ordinal}"),
        );
        other.bind_to_thread().unwrap();
        drop(y);
        eprintln!("rank {rank}: another GPU's memory refused");
    } else {
        eprintln!("rank {rank}: SKIPPED other-GPU refusal (one GPU)");
    }
    // Still usable, and the memory seen before still passes.
    reduce(
        &mut c,
        x.ptr,
        x.ptr,
        n,
        DType::F32,
        ReduceOp::Sum,
        Algorithm::Auto,
        std::ptr::null_mut(),
    );
    c.synchronize().unwrap();
    checked += 1;
    say(format!("DONE {checked}"));
    0
}

/// The device is the caller's: the CUDA context current on the thread (made on another GPU
/// than local_rank % count picks, where there are several), else the configured one.
fn rank_device() -> i32 {
    let base = ipcreduce::bootstrap::RankInfo::from_env().unwrap();
    let count = cudarc::driver::safe::CudaContext::device_count().unwrap() as usize;
    let current = (base.local_rank + 1) % count;
    // Makes device `current`'s primary context current on this thread.
    let _ctx = cudarc::driver::safe::CudaContext::new(current).unwrap();
    let mut checked = 0;
    for (cycle, chosen) in [None, Some(count - 1)].into_iter().enumerate() {
        let info = ipcreduce::bootstrap::RankInfo::new(
            base.rank,
            base.world,
            base.socket.with_file_name(format!("d{cycle}.sock")),
            format!("device{cycle}"),
            base.secret.clone(),
        )
        .unwrap();
        let cfg = Config {
            device: chosen,
            ..config(None)
        };
        let mut c = Communicator::with_rank_info(info, &cfg).unwrap();
        let want = chosen.unwrap_or(current);
        assert_eq!(
            c.cuda_device(),
            Some(want),
            "config {chosen:?}, current {current}"
        );
        // A call on its own stream works there.
        let x = DeviceAlloc::new(4096, c.rank()).unwrap();
        let stream = c.cuda_stream().expect("a cuda stream");
        reduce(
            &mut c,
            x.ptr,
            x.ptr,
            1024,
            DType::F32,
            ReduceOp::Sum,
            Algorithm::Auto,
            stream,
        );
        c.synchronize().unwrap();
        checked += 1;
    }
    say(format!("DONE {checked}"));
    0
}

// ---------------------------------------------------------------------------------------
// Parent side

/// Generous: graph and sweep runs compile nothing but move gigabytes under MPS.
const T: Duration = Duration::from_secs(600);

/// Every rank's output, once each has exited (the ones still running after a bounded wait are
/// killed first).
fn every_rank_diag(ranks: &mut [Rank]) -> String {
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while ranks.iter_mut().any(|r| !r.has_exited()) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut all = String::new();
    for r in ranks.iter_mut() {
        if !r.has_exited() {
            r.kill();
            let _ = r.wait(Duration::from_secs(5));
        }
        all.push_str(&r.diag());
        all.push('\n');
    }
    all
}

/// How many checks every rank of `role` at `world` reports: the number of checked calls its
/// loops make as they stand (a role whose loops change updates its number here), so a role
/// whose loops shrank, or skipped a part, fails instead of passing with fewer checks. None:
/// the count depends on the machine (GPUs present) or on a knob that narrowed the role.
fn expected_checks(role: &str, world: usize) -> Option<usize> {
    let knob = |v: &str| std::env::var(v).ok();
    Some(match role {
        "sweep" => 162,
        "staged_offsets" => 72,
        "graph" => 288,
        "graph_origin" => 2,
        "graph_after_close" => 1,
        // Three chains (leads) per dtype of 10 (f32) + 6 (f16) + 4 (bf16) steps; at 8 ranks
        // f16 stops at 4 (3 * 8^5 would pass 65504, chain::max_steps).
        "chain" if world == 8 => 54,
        "chain" => 60,
        "streams" => 34,
        "registered" => 72,
        "scatter_gather" => 240,
        "share_refused" => 1,
        "teardown" => 6,
        "hostile" if knob("GPU_TEST_HOSTILE_ONLY").is_some() => return None,
        "hostile" => 6332,
        "llwrap" => match knob("GPU_TEST_LL_CALLS") {
            Some(n) => n.parse().ok()?,
            None => 200_704,
        },
        // One more check where a second GPU is there to refuse, or to pick.
        "pointers" | "device" => return None,
        _ => return None,
    })
}

/// Runs `role` at each world size; every rank must report `DONE n`, n the role's
/// [`expected_checks`] (n > 0 where it has none).
fn run_role(test: &str, role: &str, worlds: &[usize], extra: &[(&str, &str)]) {
    // One job on the GPU at a time, even when the harness runs tests in parallel: the ranks
    // of two jobs would compete for the SMs their kernels need resident together.
    static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_JOB.lock().unwrap_or_else(|e| e.into_inner());
    for &world in worlds {
        let job = Job::new("gpu", &format!("{role}{world}"));
        let spec = Spawn {
            test,
            role_var: ROLE,
            role,
            world,
            extra,
            hold: false,
        };
        let mut ranks: Vec<Rank> = common::spawn_world(&spec, &job);
        let mut counts = Vec::new();
        for i in 0..ranks.len() {
            let m = ranks[i].try_next(T);
            let n = m
                .as_deref()
                .and_then(|m| m.strip_prefix("DONE "))
                .and_then(|n| n.parse::<usize>().ok());
            let Some(n) = n else {
                // What every rank saw, not only the first to fail: a failure on one rank is
                // often explained by what another rank did at the same moment.
                let all = every_rank_diag(&mut ranks);
                panic!("{role} world {world}: rank {i} said {m:?}\n{all}");
            };
            assert!(n > 0, "rank {i} checked nothing");
            counts.push(n);
        }
        for r in &mut ranks {
            r.wait_ok(T);
        }
        assert!(
            counts.iter().all(|n| *n == counts[0]),
            "{role} world {world}: {counts:?}"
        );
        if let Some(want) = expected_checks(role, world) {
            assert_eq!(
                counts[0], want,
                "{role} world {world}: every rank checked {} calls, not {want}",
                counts[0]
            );
        }
        eprintln!("{role} world {world}: {} checked per rank", counts[0]);
    }
}

#[test]
fn every_dtype_op_and_algorithm_at_worlds_2_4_8() {
    play_rank_if_child();
    run_role(
        "every_dtype_op_and_algorithm_at_worlds_2_4_8",
        "sweep",
        &[2, 4, 8],
        &[],
    );
}

/// The host-staged transport's pipelined kernels: 64 KiB chunks (calls of up to 192 of them:
/// both slot parities reused within and across calls), an odd CTA count (uneven pieces), the
/// copy-in interleaved with the reads by rounds of 1 and 4 packs per thread and not at all
/// (0): every dtype, op and algorithm, sizes from one element to many chunks, in place and
/// out of place, aligned and not, at worlds 2 and 4.
#[test]
fn host_staged_pipeline_every_dtype_op_at_worlds_2_4() {
    play_rank_if_child();
    for round in ["0", "1", "4"] {
        let env = [
            ("IPCREDUCE_TRANSPORT", "host"),
            ("IPCREDUCE_STAGED_CHUNK", "65536"),
            ("IPCREDUCE_STAGED_CTAS", "3"),
            ("IPCREDUCE_STAGED_ROUND", round),
        ];
        let name = "host_staged_pipeline_every_dtype_op_at_worlds_2_4";
        run_role(name, "sweep", &[2, 4], &env);
        run_role(name, "staged_offsets", &[2, 4], &env);
    }
}

/// The host-staged transport's kernels captured in CUDA graphs and replayed with changing
/// inputs, with their default knobs and with 64 KiB chunks.
#[test]
fn host_staged_graph_replays() {
    play_rank_if_child();
    let name = "host_staged_graph_replays";
    run_role(name, "graph", &[2, 4], &[("IPCREDUCE_TRANSPORT", "host")]);
    let small = [
        ("IPCREDUCE_TRANSPORT", "host"),
        ("IPCREDUCE_STAGED_CHUNK", "65536"),
    ];
    run_role(name, "graph", &[2], &small);
}

/// The host-staged copy-engine path from 64 KiB on, in 64 KiB chunks (many per call: both
/// slot parities and both scratch halves reused within and across calls): every dtype, op and
/// algorithm, in place and out of place, aligned and not, eager and captured in CUDA graphs
/// beside the staged kernels' calls.
#[test]
fn host_staged_copy_engine_eager_and_in_graphs() {
    play_rank_if_child();
    let env = [
        ("IPCREDUCE_TRANSPORT", "host"),
        ("IPCREDUCE_CE_STAGED_MIN", "65536"),
        ("IPCREDUCE_STAGED_CHUNK", "65536"),
    ];
    let name = "host_staged_copy_engine_eager_and_in_graphs";
    for role in ["sweep", "staged_offsets", "graph"] {
        run_role(name, role, &[2], &env);
    }
}

#[test]
fn a_small_mps_share_shrinks_the_grids_and_never_hangs() {
    // Every rank's MPS client may use 10 % of the GPU's threads (12 of 132 SMs), and MPS may
    // run all clients' blocks on the same SMs: the grids must shrink until every rank's blocks
    // fit there at once. A grid that did not would wait for blocks that never start, and the
    // sweep's calls would time out instead of passing.
    play_rank_if_child();
    let test = "a_small_mps_share_shrinks_the_grids_and_never_hangs";
    let share = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10");
    run_role(test, "sweep", &[2, 4, 8], &[share]);
    // 12 SMs for two ranks: 6 SMs, 12 CTAs each; 16 cannot be resident.
    run_role(
        test,
        "share_refused",
        &[2],
        &[share, ("IPCREDUCE_BLOCKS", "16")],
    );
}

#[test]
fn stale_data_chains_without_synchronizing() {
    play_rank_if_child();
    run_role(
        "stale_data_chains_without_synchronizing",
        "chain",
        &[2, 4, 8],
        &[],
    );
}

#[test]
fn graph_replays_with_changing_inputs() {
    play_rank_if_child();
    run_role("graph_replays_with_changing_inputs", "graph", &[2, 4], &[]);
}

#[test]
fn programmatic_dependent_launch_in_graphs_and_chains() {
    // Every launch with programmatic dependent launch, captured ones too (IPCREDUCE_PDL=1), and
    // the LL kernels letting the next kernel launch at once (IPCREDUCE_PDL_TRIGGER=1, forced:
    // by default off where ranks share a GPU; worlds 2 and 4 keep the grids small enough for
    // the early successors to fit beside every rank's kernel): graph replays with changing
    // inputs and unsynchronized chains, every result checked.
    play_rank_if_child();
    let pdl = [("IPCREDUCE_PDL", "1"), ("IPCREDUCE_PDL_TRIGGER", "1")];
    let test = "programmatic_dependent_launch_in_graphs_and_chains";
    run_role(test, "graph", &[2, 4], &pdl);
    run_role(test, "chain", &[2, 4], &pdl);
}

#[test]
fn default_stream_and_switching_streams() {
    play_rank_if_child();
    run_role(
        "default_stream_and_switching_streams",
        "streams",
        &[2, 4],
        &[],
    );
}

#[test]
fn teardown_with_work_in_flight() {
    play_rank_if_child();
    run_role("teardown_with_work_in_flight", "teardown", &[2, 4], &[]);
}

#[test]
fn the_device_is_the_callers() {
    play_rank_if_child();
    run_role("the_device_is_the_callers", "device", &[2], &[]);
}

#[test]
fn registered_buffers_eager_and_in_graphs() {
    play_rank_if_child();
    run_role(
        "registered_buffers_eager_and_in_graphs",
        "registered",
        &[2, 4, 8],
        &[],
    );
}

#[test]
fn registered_buffers_shallow_kernels_and_short_ll() {
    // The zero-copy kernels with 8 packs in flight (two blocks per SM) and LL only up to 64 KiB,
    // so one-shot zero-copy runs from there on: the variants the defaults do not take.
    play_rank_if_child();
    run_role(
        "registered_buffers_shallow_kernels_and_short_ll",
        "registered",
        &[2, 4, 8],
        &[("IPCREDUCE_REG_LOADS", "8"), ("IPCREDUCE_LL_MAX", "65536")],
    );
}

#[test]
fn registered_buffers_with_ll12_lines() {
    // The low-latency one-shot with 12 data bytes per line (IPCREDUCE_LL_DATA=12) on the
    // registered calls' sizes, odd counts and in place included.
    play_rank_if_child();
    run_role(
        "registered_buffers_with_ll12_lines",
        "registered",
        &[2, 4, 8],
        &[("IPCREDUCE_LL_DATA", "12")],
    );
}

#[test]
fn registered_buffers_through_the_copy_engine() {
    play_rank_if_child();
    run_role(
        "registered_buffers_through_the_copy_engine",
        "registered",
        &[2],
        &[("IPCREDUCE_CE_MIN", "65536")],
    );
}

#[test]
fn the_callers_buffers_are_checked() {
    play_rank_if_child();
    run_role("the_callers_buffers_are_checked", "pointers", &[2], &[]);
}

#[test]
fn low_latency_sequence_wrap() {
    play_rank_if_child();
    run_role("low_latency_sequence_wrap", "llwrap", &[2], &[]);
}

/// Reduce-scatter and all-gather on plain and registered buffers, out of place and in place
/// (NCCL's forms), eager and replayed from a CUDA graph: reduce-scatter must equal the
/// all-reduce's shard bit for bit (same rank order, f32 accumulation), all-gather every rank's
/// input bit for bit, and every path must have been taken.
fn rank_scatter_gather() -> i32 {
    let mut c = join();
    let (rank, world) = (c.rank(), c.world());
    let s = Stream::new();
    // Up to several staged chunks (4 MiB workspace: 2 MiB slots, 2 MiB / world per shard).
    let counts = [1usize, 7, 1000, 65_537, (1 << 20) + 3];
    let max = world * counts.iter().max().unwrap() * 4;
    let plain = [
        DeviceAlloc::new(max, rank).unwrap(),
        DeviceAlloc::new(max, rank).unwrap(),
    ];
    let reg = [c.alloc(max).unwrap(), c.alloc(max).unwrap()];
    let full = DeviceAlloc::new(max, rank).unwrap();
    let mut paths = std::collections::BTreeSet::new();
    let mut checked = 0;
    for (k, &count) in counts.iter().enumerate() {
        for dtype in DType::ALL {
            let op = if k % 2 == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Max
            };
            let size = dtype.size();
            let (shard, whole) = (count * size, world * count * size);
            let seed = (k as u64) << 8 | dtype.code() as u64;
            let mut input = vec![0u8; whole];
            reference::fill_input(dtype, seed, rank, &mut input);
            // What reduce-scatter must give: our shard of the all-reduce.
            upload(&plain[0], &input, s.0);
            reduce(
                &mut c,
                plain[0].ptr,
                full.ptr,
                world * count,
                dtype,
                op,
                Algorithm::TwoShot,
                s.ptr(),
            );
            let mut want = vec![0u8; whole];
            download(full.ptr, &mut want, s.0);
            // The all-reduce must itself be right (the reference, not the library), element
            // by element; then our shard of it is what reduce-scatter must give, bit for bit.
            let wrong_full = reference::count_wrong(dtype, op, seed, world, &want);
            assert_eq!(
                wrong_full,
                0,
                "rank {rank}: the two-shot all-reduce of {} x {dtype} {op} has {wrong_full} wrong",
                world * count
            );
            let want = &want[rank * shard..(rank + 1) * shard];
            let mine = &input[..shard];
            for registered in [false, true] {
                let (a, b) = if registered {
                    (reg[0].ptr(), reg[1].ptr())
                } else {
                    (plain[0].ptr, plain[1].ptr)
                };
                for in_place in [false, true] {
                    for graph in [false, true] {
                        let what = format!(
                            "{count} x {dtype} {op} registered={registered} in_place={in_place} graph={graph}"
                        );
                        // Reduce-scatter: send a (whole), recv b or a's shard.
                        let recv = if in_place {
                            a + (rank * shard) as u64
                        } else {
                            b
                        };
                        let rs = |c: &mut Communicator| {
                            // SAFETY: device buffers of `max` bytes on this rank's GPU.
                            unsafe {
                                c.reduce_scatter_raw(
                                    a as *const c_void,
                                    recv as *mut c_void,
                                    count,
                                    dtype,
                                    op,
                                    s.ptr(),
                                )
                            }
                            .unwrap_or_else(|e| panic!("reduce_scatter {what}: {e}"));
                        };
                        ck(
                            // SAFETY: in bounds of `a`; synchronized below.
                            unsafe {
                                sys::cuMemcpyHtoDAsync_v2(a, input.as_ptr().cast(), whole, s.0)
                            },
                            "upload",
                        );
                        let g = graph.then(|| Graph::capture(&s, || rs(&mut c)));
                        match &g {
                            Some(g) => g.launch(&s),
                            None => rs(&mut c),
                        }
                        paths.insert(c.last_path().expect("a path").name);
                        let mut got = vec![0u8; shard];
                        download(recv, &mut got, s.0);
                        if got != want {
                            let differ = (0..count)
                                .filter(|&i| {
                                    got[i * size..(i + 1) * size] != want[i * size..(i + 1) * size]
                                })
                                .collect::<Vec<_>>();
                            panic!(
                                "rank {rank}: reduce_scatter {what} (path {:?}): {} of {count} \
                                 elements differ from the all-reduce's shard, first at {:?}",
                                c.last_path().map(|p| p.name),
                                differ.len(),
                                &differ[..differ.len().min(8)]
                            );
                        }
                        drop(g);
                        // All-gather: send b (or a's shard, in place), recv a.
                        let send = if in_place {
                            a + (rank * shard) as u64
                        } else {
                            b
                        };
                        // SAFETY: in bounds; synchronized by the download below.
                        unsafe {
                            ck(sys::cuMemsetD8Async(a, 0xFF, whole, s.0), "poison");
                            ck(
                                sys::cuMemcpyHtoDAsync_v2(send, mine.as_ptr().cast(), shard, s.0),
                                "upload",
                            );
                        }
                        let ag = |c: &mut Communicator| {
                            // SAFETY: device buffers of `max` bytes on this rank's GPU.
                            unsafe {
                                c.all_gather_raw(
                                    send as *const c_void,
                                    a as *mut c_void,
                                    count,
                                    dtype,
                                    s.ptr(),
                                )
                            }
                            .unwrap_or_else(|e| panic!("all_gather {what}: {e}"));
                        };
                        let g = graph.then(|| Graph::capture(&s, || ag(&mut c)));
                        match &g {
                            Some(g) => g.launch(&s),
                            None => ag(&mut c),
                        }
                        paths.insert(c.last_path().expect("a path").name);
                        let mut got = vec![0u8; whole];
                        download(a, &mut got, s.0);
                        for r in 0..world {
                            let mut theirs = vec![0u8; whole];
                            reference::fill_input(dtype, seed, r, &mut theirs);
                            assert!(
                                got[r * shard..(r + 1) * shard] == theirs[..shard],
                                "rank {rank}: all_gather {what}: rank {r}'s part"
                            );
                        }
                        drop(g);
                        checked += 2;
                    }
                }
            }
        }
    }
    if let Some(e) = c.async_error() {
        panic!("after the reduce-scatter and all-gather calls: {e}");
    }
    for p in [
        "reduce-scatter-staged",
        "reduce-scatter-reg",
        "all-gather-staged",
        "all-gather-reg",
    ] {
        assert!(paths.contains(p), "{p} never ran: {paths:?}");
    }
    let [r0, r1] = reg;
    c.free(r0).unwrap();
    c.free(r1).unwrap();
    say(format!("DONE {checked}"));
    0
}

#[test]
fn reduce_scatter_and_all_gather_plain_registered_and_in_graphs() {
    play_rank_if_child();
    run_role(
        "reduce_scatter_and_all_gather_plain_registered_and_in_graphs",
        "scatter_gather",
        &[2, 4],
        &[],
    );
}

// ---------------------------------------------------------------------------------------
// Hostile calls

/// What one rank calls in a hostile case (f32, sum; `count` elements per rank's all-reduce, the
/// same `count` as the whole of a reduce-scatter or an all-gather).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Hostile {
    /// All-reduce of plain buffers.
    AllReduce,
    /// Reduce-scatter of plain buffers (the whole is `count`).
    ReduceScatter,
    /// All-gather of plain buffers (the whole is `count`).
    AllGather,
    /// All-reduce from registered buffer `a` (or `b`) at byte `offset` into registered `c`.
    AllReduceReg { b: bool, offset: usize },
    /// Reduce-scatter from registered `a` into registered `c`.
    ReduceScatterReg,
    /// All-reduce of zero elements (null pointers).
    Empty,
}

/// A communicator of its own for one hostile case (each case leaves its communicator dead): a
/// socket per case, so a fast rank never meets the previous case's ranks.
fn hostile_comm(case: &str, ll_data: Option<usize>) -> Communicator {
    let base = ipcreduce::bootstrap::RankInfo::from_env().expect("rank info");
    let dir = base.socket.parent().expect("socket dir").to_path_buf();
    let info = ipcreduce::bootstrap::RankInfo::new(
        base.rank,
        base.world,
        dir.join(format!("{case}.sock")),
        case.to_string(),
        Some(SECRET.into()),
    )
    .unwrap();
    let cfg = Config {
        timeout: Some(HOSTILE_TIMEOUT),
        ll_data_bytes: ll_data,
        ..config(None)
    };
    Communicator::with_rank_info(info, &cfg).unwrap_or_else(|e| panic!("{case}: init: {e}"))
}

/// The kernels' bound on every wait in the hostile cases: a mismatch must be named long
/// before it (within [`HOSTILE_PROMPT`]), not found by it.
const HOSTILE_TIMEOUT: Duration = Duration::from_millis(8000);
/// How soon every rank must fail: the wait loops look at the peers' identities every 1024
/// spins (microseconds) and the error record is read on the next synchronize.
const HOSTILE_PROMPT: Duration = Duration::from_secs(2);

/// Issues `what` and synchronizes; the first error, or None if the call completed.
fn hostile_call(
    c: &mut Communicator,
    what: Hostile,
    count: usize,
    bufs: &HostileBufs,
    stream: &Stream,
) -> Option<ipcreduce::Error> {
    let world = c.world();
    let per = count / world;
    let (a, b, cc) = (bufs.reg[0].ptr(), bufs.reg[1].ptr(), bufs.reg[2].ptr());
    let (p, q) = (bufs.plain[0].ptr, bufs.plain[1].ptr);
    let s = stream.ptr();
    let t0 = std::time::Instant::now();
    // SAFETY: every buffer holds `count` f32 (and 4096 bytes more); count 0 passes null.
    let issued = unsafe {
        match what {
            Hostile::AllReduce => c.all_reduce_raw(
                p as *const c_void,
                q as *mut c_void,
                count,
                DType::F32,
                ReduceOp::Sum,
                Algorithm::Auto,
                s,
            ),
            Hostile::ReduceScatter => c.reduce_scatter_raw(
                p as *const c_void,
                q as *mut c_void,
                per,
                DType::F32,
                ReduceOp::Sum,
                s,
            ),
            Hostile::AllGather => {
                c.all_gather_raw(p as *const c_void, q as *mut c_void, per, DType::F32, s)
            }
            Hostile::AllReduceReg { b: other, offset } => c.all_reduce_raw(
                ((if other { b } else { a }) + offset as u64) as *const c_void,
                cc as *mut c_void,
                count,
                DType::F32,
                ReduceOp::Sum,
                // Two-shot: zero-copy at every size (one-shot takes LL lines when small,
                // which never read a peer's buffer).
                Algorithm::TwoShot,
                s,
            ),
            Hostile::ReduceScatterReg => c.reduce_scatter_raw(
                a as *const c_void,
                cc as *mut c_void,
                per,
                DType::F32,
                ReduceOp::Sum,
                s,
            ),
            Hostile::Empty => c.all_reduce_raw(
                std::ptr::null(),
                std::ptr::null_mut(),
                0,
                DType::F32,
                ReduceOp::Sum,
                Algorithm::Auto,
                s,
            ),
        }
    };
    let enqueued = t0.elapsed();
    let err = issued.err().or_else(|| c.synchronize().err());
    // Where the time went, in the rank's log: enqueueing (the host) or waiting (the kernels).
    eprintln!(
        "rank {}: {what:?}: enqueued in {enqueued:?}, done after {:?}",
        c.rank(),
        t0.elapsed()
    );
    err
}

struct HostileBufs {
    plain: [DeviceAlloc; 2],
    reg: [ipcreduce::RegisteredBuffer; 3],
}

/// The words every rank's error must hold for a case where rank 1 called `odd` and every other
/// rank `base`: both calls, by what tells them apart.
fn hostile_words(base: Hostile, odd: Hostile) -> Vec<&'static str> {
    let words = |h: Hostile| match h {
        Hostile::AllReduce => vec!["all-reduce"],
        Hostile::ReduceScatter | Hostile::ReduceScatterReg => vec!["reduce-scatter"],
        Hostile::AllGather => vec!["all-gather"],
        Hostile::AllReduceReg { b: true, .. } => vec!["send region 1 "],
        Hostile::AllReduceReg { offset: 4096, .. } => vec!["send region 0 +4096"],
        Hostile::AllReduceReg { .. } => vec!["send region 0 +0"],
        Hostile::Empty => vec!["all-reduce empty 0 x float"],
    };
    let mut w = words(base);
    w.extend(words(odd));
    w.push("rank 1: ");
    w
}

/// Rank 1 calls `odd`, every other rank `base`, with the same count: every rank must fail
/// within [`HOSTILE_PROMPT`] with a mismatch (or the abort that carries one) naming both calls.
fn hostile_case(name: &str, count: usize, base: Hostile, odd: Hostile) {
    let mut c = hostile_comm(name, None);
    let rank = c.rank();
    let s = Stream::new();
    let bytes = count * 4 + 4096;
    let bufs = HostileBufs {
        plain: [
            DeviceAlloc::new(bytes, rank).unwrap(),
            DeviceAlloc::new(bytes, rank).unwrap(),
        ],
        reg: [
            c.alloc(bytes).unwrap(),
            c.alloc(bytes).unwrap(),
            c.alloc(bytes).unwrap(),
        ],
    };
    let what = if rank == 1 { odd } else { base };
    // Every rank starts the case together (the bootstrap's barrier, not a sleep).
    c.bootstrap().barrier().expect("barrier");
    let t0 = std::time::Instant::now();
    let err = hostile_call(&mut c, what, count, &bufs, &s);
    let took = t0.elapsed();
    let err = err.unwrap_or_else(|| {
        panic!("rank {rank}: {name}: {what:?} against {odd:?}/{base:?} returned Ok")
    });
    let text = err.to_string();
    // Every rank's outcome, in its own log (shown for every rank when the test fails).
    eprintln!("rank {rank}: {name}: {what:?}: {took:?}: {text}");
    assert!(
        matches!(err, ipcreduce::Error::Mismatch { .. })
            || matches!(err, ipcreduce::Error::Aborted { .. }) && text.contains("differ in"),
        "rank {rank}: {name}: not a mismatch: {err:?}"
    );
    for w in hostile_words(base, odd) {
        assert!(
            text.contains(w),
            "rank {rank}: {name}: the error does not name `{w}`: {text}"
        );
    }
    assert!(
        took < HOSTILE_PROMPT,
        "rank {rank}: {name}: failed after {took:?} (timeout {HOSTILE_TIMEOUT:?}): {text}"
    );
    // The communicator is dead: its buffers go with it.
    drop(bufs);
    drop(c);
}

/// LL8 and LL12 calls with changing data and sizes, count-0 calls between them (on every
/// rank: their call numbers must stay paired), eager and in graph replays; every result
/// against the reference. Returns the calls checked.
fn ll_stress(ll_data: usize) -> usize {
    let mut c = hostile_comm(&format!("llstress{ll_data}"), Some(ll_data));
    let (rank, world) = (c.rank(), c.world());
    let s = Stream::new();
    let max = 64 << 10;
    let (send, recv) = (
        DeviceAlloc::new(max, rank).unwrap(),
        DeviceAlloc::new(max, rank).unwrap(),
    );
    let dtype = DType::F32;
    let mut input = vec![0u8; max];
    let mut out = vec![0u8; max];
    let mut checked = 0;
    let empty = |c: &mut Communicator| {
        // SAFETY: count 0 reads and writes nothing.
        unsafe {
            c.all_reduce_raw(
                std::ptr::null(),
                std::ptr::null_mut(),
                0,
                dtype,
                ReduceOp::Sum,
                Algorithm::OneShot,
                s.ptr(),
            )
        }
        .unwrap_or_else(|e| panic!("count 0: {e}"));
    };
    for i in 0..3000usize {
        let count = 1 + (i.wrapping_mul(2_654_435_761) >> 5) % (max / 4);
        let bytes = count * 4;
        let seed = (ll_data as u64) << 32 | i as u64;
        reference::fill_input(dtype, seed, rank, &mut input[..bytes]);
        upload(&send, &input[..bytes], s.0);
        if i % 3 == 0 {
            empty(&mut c);
        }
        let out_ptr = if i % 2 == 0 { send.ptr } else { recv.ptr };
        reduce(
            &mut c,
            send.ptr,
            out_ptr,
            count,
            dtype,
            ReduceOp::Sum,
            Algorithm::OneShot,
            s.ptr(),
        );
        let path = c.last_path().expect("a path").name;
        assert!(path.starts_with("oneshot-ll"), "{count}: {path}");
        download(out_ptr, &mut out[..bytes], s.0);
        let wrong = reference::count_wrong(dtype, ReduceOp::Sum, seed, world, &out[..bytes]);
        assert_eq!(
            wrong, 0,
            "rank {rank}: LL{ll_data} call {i} ({bytes} B): {wrong} wrong"
        );
        checked += 1;
    }
    // Graphs: an LL call and a count-0 call captured together, replayed with new inputs.
    for count in [1usize, 1000, 16_384] {
        let bytes = count * 4;
        let g = Graph::capture(&s, || {
            reduce(
                &mut c,
                send.ptr,
                recv.ptr,
                count,
                dtype,
                ReduceOp::Sum,
                Algorithm::OneShot,
                s.ptr(),
            );
            empty(&mut c);
        });
        for replay in 0..50u64 {
            let seed = 1 << 48 | (count as u64) << 8 | replay;
            reference::fill_input(dtype, seed, rank, &mut input[..bytes]);
            upload(&send, &input[..bytes], s.0);
            g.launch(&s);
            download(recv.ptr, &mut out[..bytes], s.0);
            let wrong = reference::count_wrong(dtype, ReduceOp::Sum, seed, world, &out[..bytes]);
            assert_eq!(
                wrong, 0,
                "rank {rank}: LL{ll_data} graph {count} replay {replay}: {wrong} wrong"
            );
            checked += 1;
        }
    }
    if let Some(e) = c.async_error() {
        panic!("rank {rank}: after the LL{ll_data} stress: {e}");
    }
    checked
}

fn rank_hostile() -> i32 {
    let world: usize = std::env::var("IPCREDUCE_WORLD_SIZE")
        .unwrap()
        .parse()
        .unwrap();
    // GPU_TEST_HOSTILE_ONLY="6 7": only those cases (indices into `cases`), without the LL
    // stress: to look at one case closely.
    let only: Option<Vec<usize>> = std::env::var("GPU_TEST_HOSTILE_ONLY").ok().map(|v| {
        v.split_whitespace()
            .filter_map(|k| k.parse().ok())
            .collect()
    });
    let mut checked = if only.is_some() {
        0
    } else {
        ll_stress(8) + ll_stress(12)
    };
    // Sizes of the LL, one-shot, two-shot and (two registered ranks) copy-engine paths; counts
    // that every world cuts into whole shards.
    let cases = [
        (Hostile::AllReduce, Hostile::ReduceScatter),
        (Hostile::AllReduce, Hostile::AllGather),
        (Hostile::ReduceScatter, Hostile::AllGather),
        (
            Hostile::AllReduceReg {
                b: false,
                offset: 0,
            },
            Hostile::ReduceScatterReg,
        ),
        (
            Hostile::AllReduceReg {
                b: false,
                offset: 0,
            },
            Hostile::AllReduceReg { b: true, offset: 0 },
        ),
        (
            Hostile::AllReduceReg {
                b: false,
                offset: 0,
            },
            Hostile::AllReduceReg {
                b: false,
                offset: 4096,
            },
        ),
        // On one GPU shared by the ranks, the count-0 kernel may not get onto the GPU beside
        // the peers' full grids at the two-shot sizes: the mismatch is then found on the host,
        // where the count-0 call is told to every peer (backend/cuda/calls.rs).
        (Hostile::AllReduce, Hostile::Empty),
        (
            Hostile::AllReduceReg {
                b: false,
                offset: 0,
            },
            Hostile::Empty,
        ),
    ];
    for bytes in [4usize << 10, 256 << 10, 4 << 20, 64 << 20] {
        let count = bytes / 4 / (8 * world) * (8 * world);
        for (k, &(base, odd)) in cases.iter().enumerate() {
            if only.as_ref().is_some_and(|o| !o.contains(&k)) {
                continue;
            }
            hostile_case(&format!("hostile{world}-{bytes}-{k}"), count, base, odd);
            checked += 1;
        }
    }
    say(format!("DONE {checked}"));
    0
}

#[test]
fn hostile_calls_fail_promptly_on_every_rank() {
    play_rank_if_child();
    run_role(
        "hostile_calls_fail_promptly_on_every_rank",
        "hostile",
        &[2, 4, 8],
        &[],
    );
}

/// A graph case's communicator (of its own, see [`hostile_comm`]), stream and send and recv
/// buffers of [`GRAPH_CASE_COUNT`] floats.
fn graph_case(name: &str) -> (Communicator, Stream, DeviceAlloc, DeviceAlloc) {
    let c = hostile_comm(name, None);
    let rank = c.rank();
    let bytes = GRAPH_CASE_COUNT * 4;
    let (send, recv) = (
        DeviceAlloc::new(bytes, rank).unwrap(),
        DeviceAlloc::new(bytes, rank).unwrap(),
    );
    (c, Stream::new(), send, recv)
}

const GRAPH_CASE_COUNT: usize = 4096;

/// One all-reduce of `send`'s floats into `recv` on `s`, captured into a graph.
fn captured_all_reduce(
    c: &mut Communicator,
    s: &Stream,
    send: &DeviceAlloc,
    recv: &DeviceAlloc,
) -> Graph {
    let count = send.bytes / 4;
    Graph::capture(s, || {
        reduce(
            c,
            send.ptr,
            recv.ptr,
            count,
            DType::F32,
            ReduceOp::Sum,
            Algorithm::OneShot,
            s.ptr(),
        )
    })
}

/// A replay paired with an eager call, or with a call of another graph, on the other ranks:
/// every rank must fail promptly with a mismatch that names the origin, not reduce the two
/// together. Case `eager`: rank 0 replays, the others call eagerly. Case `graphs`: every rank
/// captures graphs 1 and 2; rank 0 replays 2, the others 1.
fn rank_graph_origin() -> i32 {
    let mut checked = 0;
    for (case, words) in [
        ("eager", "origin (eager call against CUDA graph replay)"),
        ("graphs", "CUDA graph or call within it"),
    ] {
        let (mut c, s, send, recv) = graph_case(&format!("origin-{case}"));
        let rank = c.rank();
        let first = captured_all_reduce(&mut c, &s, &send, &recv);
        let second = (case == "graphs").then(|| captured_all_reduce(&mut c, &s, &send, &recv));
        c.bootstrap().barrier().expect("barrier");
        let t0 = std::time::Instant::now();
        let issued = match (rank, &second) {
            (0, Some(g)) => {
                g.launch(&s);
                Ok(())
            }
            (_, Some(_)) | (0, None) => {
                first.launch(&s);
                Ok(())
            }
            (_, None) => {
                // SAFETY: this rank's device buffers of GRAPH_CASE_COUNT floats.
                unsafe {
                    c.all_reduce_raw(
                        send.ptr as *const c_void,
                        recv.ptr as *mut c_void,
                        GRAPH_CASE_COUNT,
                        DType::F32,
                        ReduceOp::Sum,
                        Algorithm::OneShot,
                        s.ptr(),
                    )
                }
            }
        };
        // A replay is no call the communicator sees: wait for the stream, then read the
        // error record.
        sync(s.0);
        let err = issued
            .err()
            .or_else(|| c.synchronize().err())
            .or_else(|| c.async_error())
            .unwrap_or_else(|| {
                panic!("rank {rank}: origin {case}: the mispaired call returned Ok")
            });
        let took = t0.elapsed();
        let text = err.to_string();
        assert!(
            text.contains(words),
            "rank {rank}: origin {case}: the error does not name `{words}`: {text}"
        );
        assert!(
            took < HOSTILE_PROMPT,
            "rank {rank}: origin {case}: failed after {took:?}: {text}"
        );
        if rank == 0 {
            eprintln!("origin {case}: {took:?}: {text}");
        }
        drop((first, second));
        drop(c);
        checked += 1;
    }
    say(format!("DONE {checked}"));
    0
}

/// A graph replayed after its communicator was dropped: the communicator's state stays behind,
/// marked closed, and the graph's first kernel stops (a trap) instead of reading or writing
/// the freed workspace. The replay must fail on every rank; the process's CUDA context is
/// lost after it, so nothing is freed and the rank exits at once.
fn rank_graph_after_close() -> i32 {
    let (mut c, s, send, recv) = graph_case("after-close");
    let rank = c.rank();
    let g = captured_all_reduce(&mut c, &s, &send, &recv);
    // One good replay first: the graph works while its communicator lives.
    g.launch(&s);
    sync(s.0);
    c.bootstrap().barrier().expect("barrier");
    drop(c);
    g.launch(&s);
    // SAFETY: our live stream.
    let res = unsafe { sys::cuStreamSynchronize(s.0) };
    assert_ne!(
        res,
        sys::CUresult::CUDA_SUCCESS,
        "rank {rank}: a graph replayed after its communicator was dropped completed"
    );
    eprintln!("rank {rank}: replay after close: {res:?}");
    // The context is lost: freeing anything would fail.
    std::mem::forget((g, s, send, recv));
    say("DONE 1");
    0
}

#[test]
fn a_graph_replay_paired_with_an_eager_call_or_another_graph_fails_on_every_rank() {
    play_rank_if_child();
    run_role(
        "a_graph_replay_paired_with_an_eager_call_or_another_graph_fails_on_every_rank",
        "graph_origin",
        &[2, 4],
        &[],
    );
}

/// Faults its ranks' CUDA contexts on purpose: gpu-tests.sh runs the tests named
/// `..._after_close_...` last.
#[test]
fn a_graph_replayed_after_close_traps_before_touching_memory() {
    play_rank_if_child();
    run_role(
        "a_graph_replayed_after_close_traps_before_touching_memory",
        "graph_after_close",
        &[2],
        &[],
    );
}
