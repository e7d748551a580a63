//! The fused all-reduce + residual add + RMSNorm on the host backend, ranks as processes.
//!
//! Expectations come from a reference written here, independent of the library: the sum in
//! rank order in f32, rounded with the `half` crate, the sum of squares over the documented
//! tree (256 strided lanes, fused multiply-add, pairwise), FP8 by nearest search over every
//! e4m3 code. Since the reference follows the same order, `residual_out`, `out` and `fp8_out`
//! are compared bitwise; `out` is also checked against an exact f64 RMSNorm of `residual_out`
//! (within 1 ulp of f16/bf16, 4e-6 relative more for the f32 steps), which bounds the numerics.
//!
//! Ranks report on stdout with `@@ ` lines; the parent judges.

mod common;

use common::fused_ref::{Case, Tensor};
use common::{say, Job, Rank, Spawn};
use ipcreduce::{AddRmsNorm, Algorithm, BackendChoice, Communicator, Config, DType, Error};
use std::io::{Read, Write};
use std::time::{Duration, Instant};

const ROLE: &str = "IPCREDUCE_FUSED_ROLE";
const CASE: &str = "FUSED_CASE";
/// Failures must be seen by every rank well within this (the timeout is 10 s).
const FAST: Duration = Duration::from_millis(2000);
const T: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------------
// Rank side

fn play_rank_if_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let code = match role.as_str() {
        "correct" => rank_correct(),
        "mismatch" => rank_mismatch(),
        "invalid" => rank_invalid(),
        other => panic!("unknown role {other}"),
    };
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

fn join() -> Communicator {
    let config = Config {
        backend: BackendChoice::Host,
        // Small slots: the larger cases cross several chunks.
        workspace_bytes: Some(64 << 10),
        timeout: Some(Duration::from_secs(10)),
        ..Config::default()
    };
    Communicator::init(&config).expect("communicator init")
}

/// Keeps the communicator until the parent heard every rank (a rank that leaves early is
/// reported dead to slower peers, which would then see that instead).
fn hold(c: Communicator) {
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(c);
}

/// How a call places its outputs.
#[derive(Clone, Copy, Debug)]
enum Place {
    Out,
    /// out == input, residual_out == residual.
    InPlace,
}

/// Runs `case` on this rank and compares every output bitwise; returns the mismatches.
fn run_case(c: &mut Communicator, case: &Case, algo: Algorithm, place: Place) -> Vec<String> {
    let (d, n) = (case.dtype, case.tokens * case.hidden);
    let mut input = Tensor::new(d, &case.inputs[c.rank()]);
    let mut residual = Tensor::new(d, &case.residuals[c.rank()]);
    let mut weight = Tensor::new(d, &case.weights[c.rank()]);
    let mut out = Tensor::new(d, &vec![f32::NAN; n]);
    let mut res_out = Tensor::new(d, &vec![f32::NAN; n]);
    let mut fp8 = vec![0xAAu8; n.max(1)];
    let scale = case.scale_of(c.rank()).unwrap_or(0.0);
    let (out_p, res_p) = match place {
        Place::Out => (out.ptr(), res_out.ptr()),
        Place::InPlace => (input.ptr(), residual.ptr()),
    };
    let args = AddRmsNorm {
        input: input.ptr(),
        residual: residual.ptr(),
        weight: weight.ptr(),
        out: out_p,
        residual_out: res_p,
        fp8_out: if case.scale.is_some() {
            fp8.as_mut_ptr().cast()
        } else {
            std::ptr::null_mut()
        },
        fp8_scale: if case.scale.is_some() {
            (&scale as *const f32).cast()
        } else {
            std::ptr::null()
        },
        tokens: case.tokens,
        hidden: case.hidden,
        dtype: d,
        eps: case.eps,
    };
    // SAFETY: every tensor holds its shape's elements; host pointers on the host backend.
    let r = unsafe { c.all_reduce_add_rms_norm_raw(&args, algo, std::ptr::null_mut()) };
    if let Err(e) = r {
        return vec![format!("call failed: {e}")];
    }
    let (got_out, got_res) = match place {
        Place::Out => (&mut out, &mut res_out),
        Place::InPlace => (&mut input, &mut residual),
    };
    let want = case.expected(c.rank());
    let mut bad = Vec::new();
    #[allow(clippy::needless_range_loop)] // four tensors indexed alike
    for i in 0..n {
        let (o, r) = (got_out.get(i), got_res.get(i));
        if r.to_bits() != want.residual_out[i].to_bits() {
            bad.push(format!(
                "residual_out[{i}] {r} want {}",
                want.residual_out[i]
            ));
        }
        if o.to_bits() != want.out[i].to_bits() {
            bad.push(format!("out[{i}] {o} want {}", want.out[i]));
        }
        if case.scale.is_some() && fp8[i] != want.fp8[i] {
            bad.push(format!("fp8[{i}] {:#x} want {:#x}", fp8[i], want.fp8[i]));
        }
    }
    bad.truncate(5);
    bad
}

fn rank_correct() -> i32 {
    let mut c = join();
    let world = c.world();
    let cases: usize = std::env::var("FUSED_CASES").unwrap().parse().unwrap();
    let mut done = 0;
    for k in 0..cases {
        let case = Case::random(1000 + k as u64, world);
        let algo = [Algorithm::Auto, Algorithm::OneShot, Algorithm::TwoShot][k % 3];
        let place = if k % 4 == 3 {
            Place::InPlace
        } else {
            Place::Out
        };
        let bad = run_case(&mut c, &case, algo, place);
        if !bad.is_empty() {
            say(format!(
                "BAD case {k} ({} x {} {} eps {} fp8 {:?} {algo} {place:?}): {}",
                case.tokens,
                case.hidden,
                case.dtype,
                case.eps,
                case.scale,
                bad.join("; ")
            ));
            return 1;
        }
        done += 1;
    }
    // Fixed shapes: one token, a wide row across chunks, each dtype, both algorithms.
    for (i, (tokens, hidden)) in [(1, 4096), (64, 4096), (3, 8191)].into_iter().enumerate() {
        for dtype in DType::ALL {
            for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
                let case = Case::with(7 + i as u64, world, tokens, hidden, dtype, 1e-6, Some(0.02));
                let bad = run_case(&mut c, &case, algo, Place::Out);
                if !bad.is_empty() {
                    say(format!(
                        "BAD {tokens} x {hidden} {dtype} {algo}: {}",
                        bad.join("; ")
                    ));
                    return 1;
                }
                done += 1;
            }
        }
    }
    say(format!("DONE {done}"));
    0
}

/// The odd rank (the last) passes another shape, eps or outputs than its peers.
fn rank_mismatch() -> i32 {
    let mut c = join();
    let odd = c.rank() + 1 == c.world();
    let case = std::env::var(CASE).unwrap();
    let (mut tokens, mut hidden, mut eps, mut scale) = (4, 64, 1e-6f32, None);
    if odd {
        match case.as_str() {
            "tokens" => tokens = 5,
            "hidden" => hidden = 65,
            "transposed" => (tokens, hidden) = (64, 4),
            "eps" => eps = 1e-5,
            "fp8" => scale = Some(1.0),
            other => panic!("unknown case {other}"),
        }
    }
    let good = Case::with(3, c.world(), 4, 64, DType::Bf16, 1e-6, None);
    // Call 0, good: it also brings the ranks into the odd call together.
    let bad = run_case(&mut c, &good, Algorithm::OneShot, Place::Out);
    assert!(bad.is_empty(), "{bad:?}");
    let odd_case = Case::with(3, c.world(), tokens, hidden, DType::Bf16, eps, scale);
    let t0 = Instant::now();
    let r = run_case(&mut c, &odd_case, Algorithm::OneShot, Place::Out);
    let ms = t0.elapsed().as_millis();
    say(format!("RESULT {ms} {}", r.join("; ")));
    hold(c);
    0
}

/// The odd rank makes an invalid call; its peers a good one.
fn rank_invalid() -> i32 {
    let mut c = join();
    let odd = c.rank() + 1 == c.world();
    let case = std::env::var(CASE).unwrap();
    let n = 4 * 64;
    let mut input = Tensor::new(DType::F16, &vec![1.0; n]);
    let mut residual = Tensor::new(DType::F16, &vec![0.5; n]);
    let mut weight = Tensor::new(DType::F16, &[1.0; 64]);
    let mut out = Tensor::new(DType::F16, &vec![0.0; n]);
    let mut res_out = Tensor::new(DType::F16, &vec![0.0; n]);
    let mut fp8 = vec![0u8; n];
    let mut args = AddRmsNorm {
        input: input.ptr(),
        residual: residual.ptr(),
        weight: weight.ptr(),
        out: out.ptr(),
        residual_out: res_out.ptr(),
        fp8_out: std::ptr::null_mut(),
        fp8_scale: std::ptr::null(),
        tokens: 4,
        hidden: 64,
        dtype: DType::F16,
        eps: 1e-6,
    };
    let mut algo = Algorithm::Auto;
    if odd {
        match case.as_str() {
            "eps-negative" => args.eps = -1e-6,
            "eps-nan" => args.eps = f32::NAN,
            "hidden-0" => args.hidden = 0,
            "fp8-without-scale" => args.fp8_out = fp8.as_mut_ptr().cast(),
            "null-weight" => args.weight = std::ptr::null(),
            "misaligned" => args.residual = residual.ptr().cast::<u8>().wrapping_add(1).cast(),
            "overlap" => args.out = res_out.ptr().cast::<u8>().wrapping_add(2).cast(),
            "overflow" => args.tokens = usize::MAX / 2,
            "nccl" => algo = Algorithm::Nccl,
            other => panic!("unknown case {other}"),
        }
    }
    let t0 = Instant::now();
    // SAFETY: the tensors hold the shape (the odd rank's bad arguments are refused before use).
    let r = unsafe { c.all_reduce_add_rms_norm_raw(&args, algo, std::ptr::null_mut()) };
    let ms = t0.elapsed().as_millis();
    let kind = match &r {
        Ok(()) => "OK",
        Err(Error::InvalidArgument { .. }) => "INVALID",
        Err(Error::Aborted { .. }) => "ABORTED",
        Err(Error::Mismatch { .. }) => "MISMATCH",
        Err(_) => "OTHER",
    };
    let text = r.err().map_or(String::new(), |e| e.to_string());
    say(format!("RESULT {kind} {ms} {text}"));
    hold(c);
    0
}

// ---------------------------------------------------------------------------------------
// Parent side

fn spawn(
    test: &str,
    role: &str,
    tag: &str,
    world: usize,
    extra: &[(&str, &str)],
) -> (Job, Vec<Rank>) {
    let job = Job::new("fused", tag);
    let spec = Spawn {
        test,
        role_var: ROLE,
        role,
        world,
        extra,
        hold: role != "correct",
    };
    let ranks = common::spawn_world(&spec, &job);
    (job, ranks)
}

#[test]
fn fused_matches_the_reference_at_worlds_2_and_4() {
    play_rank_if_child();
    for world in [2, 4] {
        let test = "fused_matches_the_reference_at_worlds_2_and_4";
        let (_job, mut ranks) = spawn(
            test,
            "correct",
            &format!("c{world}"),
            world,
            &[("FUSED_CASES", "60")],
        );
        for r in &mut ranks {
            let line = r.next(T);
            if line != "DONE 78" {
                let rank = r.rank;
                panic!("world {world} rank {rank}: {line}: {}", r.diag());
            }
        }
        for r in &mut ranks {
            r.wait_ok(T);
        }
    }
}

#[test]
fn shape_eps_and_outputs_must_agree_on_every_rank() {
    play_rank_if_child();
    let test = "shape_eps_and_outputs_must_agree_on_every_rank";
    for (case, world, what) in [
        ("tokens", 2, "tokens"),
        ("hidden", 4, "hidden"),
        ("transposed", 2, "hidden"),
        ("eps", 2, "eps"),
        ("fp8", 4, "outputs"),
    ] {
        let (_job, mut ranks) = spawn(test, "mismatch", case, world, &[(CASE, case)]);
        for r in &mut ranks {
            let line = r.next(T);
            let rest = line
                .strip_prefix("RESULT ")
                .unwrap_or_else(|| panic!("{case}: {line}: {}", r.diag()));
            let (ms, text) = rest.split_once(' ').unwrap();
            let ms: u128 = ms.parse().unwrap();
            assert!(ms < FAST.as_millis(), "{case} rank {}: {ms} ms", r.rank);
            assert!(
                text.contains("call failed") && text.contains(what),
                "{case} rank {}: {text}",
                r.rank
            );
            // Names the odd rank (the last) on every rank.
            assert!(
                text.contains(&format!("rank {}", world - 1)),
                "{case}: {text}"
            );
        }
        for r in &mut ranks {
            r.wait_ok(T);
        }
    }
}

#[test]
fn invalid_arguments_fail_there_and_abort_the_peers_promptly() {
    play_rank_if_child();
    let test = "invalid_arguments_fail_there_and_abort_the_peers_promptly";
    for (case, detail) in [
        ("eps-negative", "eps must be finite and >= 0"),
        ("eps-nan", "eps must be finite and >= 0"),
        ("hidden-0", "hidden must be at least 1"),
        ("fp8-without-scale", "fp8_out and fp8_scale come together"),
        ("null-weight", "weight is a null pointer"),
        ("misaligned", "residual"),
        ("overlap", "out and residual_out overlap"),
        ("overflow", "overflows the address space"),
        ("nccl", "not nccl"),
    ] {
        let (_job, mut ranks) = spawn(test, "invalid", case, 2, &[(CASE, case)]);
        for r in &mut ranks {
            let line = r.next(T);
            let parts: Vec<&str> = line.splitn(4, ' ').collect();
            assert_eq!(parts[0], "RESULT", "{case}: {line}: {}", r.diag());
            let ms: u128 = parts[2].parse().unwrap();
            assert!(ms < FAST.as_millis(), "{case} rank {}: {ms} ms", r.rank);
            let text = parts.get(3).copied().unwrap_or("");
            assert!(text.contains(detail), "{case} rank {}: {line}", r.rank);
            if r.rank == 1 {
                assert_eq!(parts[1], "INVALID", "{case}: {line}");
                assert!(text.contains("rank 1"), "{case}: {line}");
            } else {
                assert_eq!(parts[1], "ABORTED", "{case}: {line}");
            }
        }
        for r in &mut ranks {
            r.wait_ok(T);
        }
    }
}
