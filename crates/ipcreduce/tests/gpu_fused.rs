//! The fused all-reduce + residual add + RMSNorm on a real GPU (feature `gpu`): ranks are
//! processes of this test binary sharing one GPU under MPS (scripts/device/fused.sh).
//!
//! - a random sweep of shapes (odd hidden sizes, 1 token, widths not a multiple of 16) at
//!   worlds 2, 4 and 8, every dtype, both algorithms, plain and registered buffers, in place
//!   and not, with and without the FP8 output: the fused call equals `all_reduce_raw` followed
//!   by the reference kernel bit for bit and equals the independent CPU reference
//!   (tests/common/fused_ref.rs) bit for bit, every rank passing its own residual, weight and
//!   FP8 scale (none equal to another rank's: a path that normalised a row with another rank's
//!   would fail);
//! - the same sweep with each path forced (`IPCREDUCE_FUSED_PATH=oneshot|twoshot|ll`; LL
//!   only for the shapes it takes), every call checked to have taken it;
//! - CUDA graph replays of the fused call with inputs that change between replays (auto, and
//!   two-shot and LL forced);
//! - ranks that pass another shape, eps, outputs or algorithm (so another path): a mismatch on
//!   every rank, promptly.
//!
//! `GPU_FUSED_WORLDS` (a list such as "2,4"; default 2, 4 and 8) narrows the sweeps' worlds,
//! and `GPU_FUSED_PATHS` (such as "ll"; default all three) the forced sweep's paths, so that a
//! run with little time can take them one step each.

#[path = "gpu_fused/bufs.rs"]
mod bufs;
mod common;

use bufs::{
    alloc, ck, differences, download, forced_path, forced_takes, fused_args, pair,
    unfused_sequence, upload, Bufs, Stream, FUSED_PATH,
};
use common::fused_ref::{Case, Tensor};
use common::{say, Job, Rank, Spawn, SECRET};
use cudarc::driver::sys;
use ipcreduce::{Algorithm, BackendChoice, Communicator, Config, DType};
use std::io::Write;
use std::time::{Duration, Instant};

const ROLE: &str = "IPCREDUCE_GPU_FUSED_ROLE";
const CASE: &str = "GPU_FUSED_CASE";
const T: Duration = Duration::from_secs(600);
/// How soon every rank must see a mismatch (the kernels' timeout is 8 s).
const PROMPT: Duration = Duration::from_secs(2);

fn play_rank_if_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let code = match role.as_str() {
        "sweep" => rank_sweep(),
        "graph" => rank_graph(),
        "mismatch" => rank_mismatch(),
        other => panic!("unknown role {other}"),
    };
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

fn join(timeout: Option<Duration>) -> Communicator {
    let cfg = Config {
        backend: BackendChoice::Cuda,
        // Small slots: the larger cases cross several chunks of rows.
        workspace_bytes: Some(4 << 20),
        timeout,
        ..Config::default()
    };
    Communicator::init(&cfg).expect("cuda communicator")
}

/// Runs one case: the fused call and the unfused sequence on `s`, then compares both with each
/// other and with the CPU reference. Returns the differences (empty: right).
#[allow(clippy::too_many_arguments)]
fn run_case(
    c: &mut Communicator,
    s: &Stream,
    case: &Case,
    algo: Algorithm,
    in_place: bool,
    reg: bool,
    unfused: bool,
) -> Vec<String> {
    let (d, n, h) = (case.dtype, case.tokens * case.hidden, case.hidden);
    let bytes = n * d.size();
    let (b, buf) = alloc(c, bytes, h * d.size(), n, reg);
    let mut input = Tensor::new(d, &case.inputs[c.rank()]);
    // This rank's own residual, weight and scale (every rank's differ).
    let rank = c.rank();
    let mut residual = Tensor::new(d, &case.residuals[rank]);
    let mut weight = Tensor::new(d, &case.weights[rank]);
    let scale = case.scale_of(rank).unwrap_or(1.0).to_le_bytes();
    let load = |b: &Bufs, input: &mut Tensor, residual: &mut Tensor| {
        upload(b.input.ptr(), input.bytes(), s);
        upload(b.residual.ptr(), residual.bytes(), s);
    };
    load(&b, &mut input, &mut residual);
    upload(b.weight.ptr(), weight.bytes(), s);
    upload(b.scale.ptr(), &scale, s);
    // The unfused sequence first (it reads input and residual, which the in-place fused call
    // overwrites).
    let stream = s.ptr();
    if unfused {
        // SAFETY: every buffer holds its tensor; device memory of this rank's GPU.
        unsafe { unfused_sequence(c, case, &b, algo, stream) };
    }
    s.sync();
    let (out, res_out) = if in_place {
        (b.input.ptr(), b.residual.ptr())
    } else {
        (b.out.ptr(), b.residual_out.ptr())
    };
    let args = fused_args(
        case,
        b.input.ptr(),
        out,
        b.residual.ptr(),
        res_out,
        b.fp8.ptr(),
        &b,
    );
    // SAFETY: every buffer holds its tensor; device memory of this rank's GPU.
    let r = unsafe { c.all_reduce_add_rms_norm_raw(&args, algo, stream) };
    if let Err(e) = r {
        return vec![format!("fused call failed: {e}")];
    }
    let mut bad = Vec::new();
    if let Some(want) = forced_path() {
        let took = c.last_path().map(|p| p.name);
        if took != Some(want) {
            bad.push(format!("took {took:?}, forced {want}"));
        }
    }
    s.sync();
    if let Err(e) = c.synchronize() {
        return vec![format!("after the fused call: {e}")];
    }
    // (what, ours, the unfused sequence's, the CPU reference's); fp8 bytes compared as 16-bit
    // words (`differences` takes a dtype).
    let want = case.expected(rank);
    let cpu = |v: &[f32]| Tensor::new(d, v).bytes().to_vec();
    let (o, r) = (b.ref_out.ptr(), b.ref_residual_out.ptr());
    let mut checks = vec![
        ("out", out, o, cpu(&want.out)),
        ("residual_out", res_out, r, cpu(&want.residual_out)),
    ];
    if case.scale.is_some() {
        checks.push(("fp8", b.fp8.ptr(), b.ref_fp8.ptr(), pair(&want.fp8)));
    }
    for (what, ours, theirs, cpu) in checks {
        let fp8 = what == "fp8";
        let (dt, len) = if fp8 { (DType::F16, n) } else { (d, bytes) };
        let get = |p| {
            let v = download(p, len, s);
            if fp8 {
                pair(&v)
            } else {
                v
            }
        };
        let got = get(ours);
        if unfused {
            bad.extend(differences(
                &format!("{what} vs unfused"),
                dt,
                &got,
                &get(theirs),
            ));
        }
        bad.extend(differences(&format!("{what} vs cpu"), dt, &got, &cpu));
    }
    if let Some(buf) = buf {
        drop(b);
        c.free(buf).expect("free");
    }
    bad
}

fn rank_sweep() -> i32 {
    let mut c = join(None);
    let world = c.world();
    let s = Stream::new();
    let cases: usize = std::env::var("GPU_FUSED_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let mut done = 0;
    let mut shapes: Vec<Case> = (0..cases)
        .map(|k| Case::random(5000 + k as u64, world))
        .collect();
    // Decode sizes, a row wider than the 256 lanes many times over, more rows than a 2 MiB
    // slot holds (several chunks, on either path), fewer rows than ranks (two-shot ranks that
    // own none), an odd width below one 16-byte pack, and a prefill size.
    for (i, (tokens, hidden)) in [
        (1, 4096),
        (8, 8192),
        (32, 16384),
        (129, 4099),
        (3, 4095),
        (1, 7),
        (512, 4096),
    ]
    .into_iter()
    .enumerate()
    {
        for dtype in DType::ALL {
            shapes.push(Case::with(
                77 + i as u64,
                world,
                tokens,
                hidden,
                dtype,
                1e-6,
                Some(0.02),
            ));
        }
    }
    for (k, case) in shapes.iter().enumerate() {
        if !forced_takes(case.tokens, case.hidden, case.dtype) {
            continue;
        }
        let algo = [Algorithm::Auto, Algorithm::OneShot, Algorithm::TwoShot][k % 3];
        for (in_place, reg) in [(false, false), (true, false), (false, true), (true, true)] {
            let bad = run_case(&mut c, &s, case, algo, in_place, reg, true);
            if !bad.is_empty() {
                say(format!(
                    "BAD case {k} ({} x {} {} eps {} fp8 {:?} {algo} in place {in_place} registered {reg}): {}",
                    case.tokens, case.hidden, case.dtype, case.eps, case.scale, bad.join("; ")
                ));
                return 1;
            }
            done += 1;
        }
    }
    say(format!("DONE {done}"));
    0
}

/// A fused call captured in a CUDA graph, replayed with new inputs each time (uploaded before
/// the replay), checked against the CPU reference.
fn rank_graph() -> i32 {
    let mut c = join(None);
    let (rank, world) = (c.rank(), c.world());
    let s = Stream::new();
    let mut done = 0;
    for (tokens, hidden, dtype) in [
        (1, 4096, DType::Bf16),
        (16, 8191, DType::F16),
        (64, 2048, DType::F32),
    ] {
        if !forced_takes(tokens, hidden, dtype) {
            continue;
        }
        let first = Case::with(1, world, tokens, hidden, dtype, 1e-6, Some(0.05));
        let n = tokens * hidden;
        let bytes = n * dtype.size();
        let (b, _) = alloc(&mut c, bytes, hidden * dtype.size(), n, false);
        let args = fused_args(
            &first,
            b.input.ptr(),
            b.out.ptr(),
            b.residual.ptr(),
            b.residual_out.ptr(),
            b.fp8.ptr(),
            &b,
        );
        // The scale of every replay's case (Case::scale_of depends on the rank only).
        let scale = first.scale_of(rank).unwrap();
        upload(b.scale.ptr(), &scale.to_le_bytes(), &s);
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: capture on our stream, ended below.
        ck(
            unsafe { sys::cuStreamBeginCapture_v2(s.0, mode) },
            "begin capture",
        );
        // SAFETY: buffers hold the shape; captured, run at each replay.
        unsafe { c.all_reduce_add_rms_norm_raw(&args, Algorithm::Auto, s.ptr()) }
            .unwrap_or_else(|e| panic!("capture: {e}"));
        if let Some(want) = forced_path() {
            assert_eq!(c.last_path().map(|p| p.name), Some(want), "captured");
        }
        let mut graph = std::ptr::null_mut();
        // SAFETY: ends our capture.
        ck(
            unsafe { sys::cuStreamEndCapture(s.0, &mut graph) },
            "end capture",
        );
        let mut exec = std::ptr::null_mut();
        // SAFETY: instantiates the graph just captured.
        ck(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
            "instantiate",
        );
        for replay in 0..8u64 {
            let case = Case::with(100 + replay, world, tokens, hidden, dtype, 1e-6, Some(0.05));
            upload(
                b.input.ptr(),
                Tensor::new(dtype, &case.inputs[rank]).bytes(),
                &s,
            );
            upload(
                b.residual.ptr(),
                Tensor::new(dtype, &case.residuals[rank]).bytes(),
                &s,
            );
            upload(
                b.weight.ptr(),
                Tensor::new(dtype, &case.weights[rank]).bytes(),
                &s,
            );
            // SAFETY: our instantiated graph on our stream.
            ck(unsafe { sys::cuGraphLaunch(exec, s.0) }, "graph launch");
            s.sync();
            let want = case.expected(rank);
            let mut bad = differences(
                "out",
                dtype,
                &download(b.out.ptr(), bytes, &s),
                Tensor::new(dtype, &want.out).bytes(),
            );
            bad.extend(differences(
                "residual_out",
                dtype,
                &download(b.residual_out.ptr(), bytes, &s),
                Tensor::new(dtype, &want.residual_out).bytes(),
            ));
            bad.extend(differences(
                "fp8",
                DType::F16,
                &pair(&download(b.fp8.ptr(), n, &s)),
                &pair(&want.fp8),
            ));
            if !bad.is_empty() {
                say(format!(
                    "BAD graph {tokens} x {hidden} {dtype} replay {replay}: {}",
                    bad.join("; ")
                ));
                return 1;
            }
            done += 1;
        }
        // SAFETY: ours, after the last replay was synchronized.
        unsafe {
            sys::cuGraphExecDestroy(exec);
            sys::cuGraphDestroy(graph);
        }
    }
    if let Some(e) = c.async_error() {
        panic!("after the graphs: {e}");
    }
    say(format!("DONE {done}"));
    0
}

/// The last rank passes another shape, eps or outputs: every rank must fail with a mismatch
/// naming what differs, promptly.
fn rank_mismatch() -> i32 {
    let mut c = join(Some(Duration::from_secs(8)));
    let s = Stream::new();
    let world = c.world();
    let odd = c.rank() + 1 == world;
    let what = std::env::var(CASE).unwrap();
    let good = Case::with(3, world, 4, 64, DType::Bf16, 1e-6, None);
    // "algo": the last rank asks for two-shot, the others one-shot: another path.
    let algo = match (what.as_str(), odd) {
        ("algo", true) => Algorithm::TwoShot,
        _ => Algorithm::OneShot,
    };
    assert!(run_case(&mut c, &s, &good, Algorithm::OneShot, false, false, true).is_empty());
    let (mut tokens, mut hidden, mut eps, mut scale) = (4, 64, 1e-6f32, None);
    if odd {
        match what.as_str() {
            "tokens" => tokens = 5,
            "hidden" => hidden = 65,
            "transposed" => (tokens, hidden) = (64, 4),
            "eps" => eps = 1e-5,
            "fp8" => scale = Some(1.0),
            "algo" => {}
            other => panic!("unknown case {other}"),
        }
    }
    let case = Case::with(3, world, tokens, hidden, DType::Bf16, eps, scale);
    let t0 = Instant::now();
    // The fused call alone: an all-reduce first would fail on the count already.
    let bad = run_case(&mut c, &s, &case, algo, false, false, false);
    let ms = t0.elapsed().as_millis();
    say(format!("RESULT {ms} {}", bad.join("; ")));
    0
}

// ---------------------------------------------------------------------------------------
// Parent side

fn run_role(test: &str, role: &str, world: usize, extra: &[(&str, &str)]) -> Vec<(usize, String)> {
    let job = Job::new("gpufused", &format!("{role}{world}"));
    let spec = Spawn {
        test,
        role_var: ROLE,
        role,
        world,
        extra,
        hold: false,
    };
    let _ = SECRET;
    let mut ranks: Vec<Rank> = common::spawn_world(&spec, &job);
    let mut lines = Vec::new();
    for r in &mut ranks {
        let m = r.next(T);
        lines.push((r.rank, m));
    }
    for r in &mut ranks {
        r.wait(T);
    }
    lines
}

fn expect_done(lines: &[(usize, String)], what: &str) {
    let counts: Vec<usize> = lines
        .iter()
        .map(|(rank, m)| {
            m.strip_prefix("DONE ")
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{what} rank {rank}: {m}"))
        })
        .collect();
    assert!(
        counts.iter().all(|n| *n > 0 && *n == counts[0]),
        "{what}: {counts:?}"
    );
    eprintln!("{what}: {} checked per rank", counts[0]);
}

/// The values of `IPCREDUCE_FUSED_PATH` the forced sweep takes, in its order.
const FORCED_PATHS: [&str; 3] = ["twoshot", "ll", "oneshot"];

/// The forced sweep's paths: `GPU_FUSED_PATHS` (a list such as "ll" or "oneshot,twoshot"), or
/// all of [`FORCED_PATHS`].
fn sweep_paths() -> Vec<&'static str> {
    let Ok(list) = std::env::var("GPU_FUSED_PATHS") else {
        return FORCED_PATHS.to_vec();
    };
    let paths: Vec<&'static str> = list
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            *FORCED_PATHS
                .iter()
                .find(|known| **known == p)
                .unwrap_or_else(|| panic!("GPU_FUSED_PATHS: twoshot, ll or oneshot, not {p}"))
        })
        .collect();
    assert!(!paths.is_empty(), "GPU_FUSED_PATHS names no path");
    paths
}

/// The sweeps' worlds: `GPU_FUSED_WORLDS`, or 2, 4 and 8.
fn sweep_worlds() -> Vec<usize> {
    let worlds: Vec<usize> = std::env::var("GPU_FUSED_WORLDS")
        .unwrap_or_default()
        .split([',', ' '])
        .filter(|w| !w.is_empty())
        .map(|w| w.parse().expect("GPU_FUSED_WORLDS: a list of world sizes"))
        .collect();
    if worlds.is_empty() {
        vec![2, 4, 8]
    } else {
        worlds
    }
}

#[test]
fn fused_equals_all_reduce_plus_reference_at_worlds_2_4_8() {
    play_rank_if_child();
    let test = "fused_equals_all_reduce_plus_reference_at_worlds_2_4_8";
    for world in sweep_worlds() {
        expect_done(
            &run_role(test, "sweep", world, &[]),
            &format!("sweep world {world}"),
        );
    }
}

/// Each path forced for every call (so `Auto`, `OneShot` and `TwoShot` all run it): the same
/// sweep (GPU_FUSED_CASES random shapes and the fixed ones), every call checked to have taken
/// the path.
#[test]
fn fused_paths_forced_by_the_knob_equal_the_reference_at_worlds_2_4_8() {
    play_rank_if_child();
    let test = "fused_paths_forced_by_the_knob_equal_the_reference_at_worlds_2_4_8";
    for path in sweep_paths() {
        for world in sweep_worlds() {
            expect_done(
                &run_role(test, "sweep", world, &[(FUSED_PATH, path)]),
                &format!("{path} sweep world {world}"),
            );
        }
    }
}

#[test]
fn fused_forced_paths_graph_replays_with_changing_inputs() {
    play_rank_if_child();
    let test = "fused_forced_paths_graph_replays_with_changing_inputs";
    for path in ["twoshot", "ll"] {
        for world in [2, 4, 8] {
            expect_done(
                &run_role(test, "graph", world, &[(FUSED_PATH, path)]),
                &format!("{path} graph world {world}"),
            );
        }
    }
}

#[test]
fn fused_graph_replays_with_changing_inputs() {
    play_rank_if_child();
    let test = "fused_graph_replays_with_changing_inputs";
    for world in [2, 4] {
        expect_done(
            &run_role(test, "graph", world, &[]),
            &format!("graph world {world}"),
        );
    }
}

#[test]
fn fused_shape_mismatch_fails_on_every_rank() {
    play_rank_if_child();
    let test = "fused_shape_mismatch_fails_on_every_rank";
    for (case, world, word) in [
        ("tokens", 2, "tokens"),
        ("hidden", 4, "hidden"),
        ("transposed", 2, "hidden"),
        ("eps", 2, "eps"),
        ("fp8", 4, "outputs"),
        ("algo", 2, "path"),
    ] {
        for (rank, line) in run_role(test, "mismatch", world, &[(CASE, case)]) {
            let rest = line
                .strip_prefix("RESULT ")
                .unwrap_or_else(|| panic!("{case} rank {rank}: {line}"));
            let (ms, text) = rest.split_once(' ').unwrap_or((rest, ""));
            let ms: u128 = ms.parse().unwrap();
            assert!(
                ms < PROMPT.as_millis(),
                "{case} rank {rank}: {ms} ms: {text}"
            );
            assert!(
                text.contains("fused call failed") || text.contains("after the fused call"),
                "{case} rank {rank}: {text}"
            );
            assert!(text.contains(word), "{case} rank {rank}: {text}");
        }
    }
}
