//! Reduce-scatter and all-gather (NCCL's semantics) on the host backend, with real processes:
//! results against the float64 reference and bitwise against the all-reduce, the in-place
//! forms, argument checks, ranks calling different operations, and a missing or dead rank in
//! either operation.

mod common;

use common::{say, Job, Spawn};
use ipcreduce::{
    reference, Algorithm, BackendChoice, Communicator, Config, DType, Error, ReduceOp,
};
use std::ffi::c_void;
use std::io::Write;
use std::time::{Duration, Instant};

const ROLE: &str = "IPCREDUCE_SG_ROLE";
const T: Duration = Duration::from_secs(60);

fn play_rank_if_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let code = match role.as_str() {
        "semantics" => rank_semantics(),
        "mismatch" => rank_mismatch(),
        r if r.starts_with("timeout-") => rank_timeout(&r["timeout-".len()..]),
        r if r.starts_with("death-") => rank_death(&r["death-".len()..]),
        other => panic!("unknown role {other}"),
    };
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

fn join() -> Communicator {
    join_with(None)
}

fn join_with(timeout: Option<Duration>) -> Communicator {
    let config = Config {
        backend: BackendChoice::Host,
        timeout,
        ..Config::default()
    };
    Communicator::init(&config).expect("communicator init")
}

/// The communicator's timeout in the timeout and death roles.
const TIMEOUT: Duration = Duration::from_millis(1000);

/// One reduce-scatter (`rs`) or all-gather (`ag`) of 64 elements per rank.
fn one_op(c: &mut Communicator, op: &str) -> ipcreduce::Result<()> {
    let world = c.world();
    match op {
        "rs" => {
            let mut out = vec![0f32; 64];
            c.reduce_scatter_host(&vec![1f32; world * 64], &mut out, ReduceOp::Sum)
        }
        "ag" => {
            let mut out = vec![0f32; world * 64];
            c.all_gather_host(&[1f32; 64], &mut out)
        }
        other => panic!("unknown operation {other}"),
    }
}

/// Prints the error's kind with the rank and peer it names, then the time and the text:
/// `KIND RANK PEER MS TEXT` (peer `-` where the kind has none).
fn report(e: &Error, ms: u128) -> String {
    let (kind, rank, peer) = match e {
        Error::Timeout { rank, peer, .. } => ("TIMEOUT", *rank, peer.to_string()),
        Error::PeerLost { rank, peer, .. } => ("PEERLOST", *rank, peer.to_string()),
        Error::Aborted { rank, .. } => ("ABORTED", *rank, "-".into()),
        Error::Mismatch { rank, peer, .. } => ("MISMATCH", *rank, peer.to_string()),
        _ => ("OTHER", usize::MAX, "-".into()),
    };
    format!("{kind} {rank} {peer} {ms} {e}")
}

/// The last rank skips the second operation until the parent, having heard the others time
/// out, lets it go (a line on stdin): no sleep decides the order.
fn rank_timeout(op: &str) -> i32 {
    let mut c = join_with(Some(TIMEOUT));
    one_op(&mut c, op).expect("the first operation, on every rank");
    if c.rank() == c.world() - 1 {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "GO");
    }
    let t0 = Instant::now();
    match one_op(&mut c, op) {
        Ok(()) => say("UNEXPECTED Ok"),
        Err(e) => say(format!("RESULT {}", report(&e, t0.elapsed().as_millis()))),
    }
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
    0
}

/// The last rank vanishes (no destructors, no goodbye) after the first operation.
fn rank_death(op: &str) -> i32 {
    let mut c = join_with(Some(Duration::from_secs(30)));
    one_op(&mut c, op).expect("the first operation, on every rank");
    if c.rank() == c.world() - 1 {
        std::process::exit(0);
    }
    let t0 = Instant::now();
    match one_op(&mut c, op) {
        Ok(()) => say("UNEXPECTED Ok"),
        Err(e) => say(format!("RESULT {}", report(&e, t0.elapsed().as_millis()))),
    }
    0
}

/// `count` elements of rank `r`'s input in `dtype`, as bytes (u32 storage keeps it aligned).
fn input(dtype: DType, seed: u64, r: usize, count: usize) -> Vec<u32> {
    let mut v = vec![0u32; (count * dtype.size()).div_ceil(4)];
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
    reference::fill_input(dtype, seed, r, &mut bytes[..count * dtype.size()]);
    v
}

fn bytes(v: &[u32], n: usize) -> &[u8] {
    &bytemuck::cast_slice(v)[..n]
}

/// For every dtype, op and count: reduce-scatter out of place and in place equals the shard of
/// the all-reduce, bit for bit, and is acceptable against the reference; all-gather out of
/// place and in place returns every rank's input bit for bit.
fn rank_semantics() -> i32 {
    let mut c = join();
    let (rank, world) = (c.rank(), c.world());
    let mut cases = 0;
    for dtype in DType::ALL {
        let size = dtype.size();
        for op in ReduceOp::ALL {
            for count in [1usize, 3, 1000, 70_001] {
                let seed = (count * 31 + op.code() as usize) as u64;
                let total = count * world;
                // The whole, all-reduced, for comparison.
                let send = input(dtype, seed, rank, total);
                let mut full = vec![0u32; send.len()];
                let (s, f) = (
                    send.as_ptr().cast::<c_void>(),
                    full.as_mut_ptr().cast::<c_void>(),
                );
                // SAFETY: live buffers of `total` elements.
                unsafe {
                    c.all_reduce_raw(
                        s,
                        f,
                        total,
                        dtype,
                        op,
                        Algorithm::Auto,
                        std::ptr::null_mut(),
                    )
                }
                .expect("all_reduce");
                let want =
                    &bytes(&full, total * size)[rank * count * size..(rank + 1) * count * size];
                let mut recv = vec![0u32; (count * size).div_ceil(4)];
                // SAFETY: send holds world * count elements, recv count.
                unsafe {
                    c.reduce_scatter_raw(
                        s,
                        recv.as_mut_ptr().cast(),
                        count,
                        dtype,
                        op,
                        std::ptr::null_mut(),
                    )
                }
                .expect("reduce_scatter");
                assert_eq!(
                    bytes(&recv, count * size),
                    want,
                    "reduce_scatter {dtype} {op} {count}"
                );
                // The reference, element by element of our shard.
                for i in 0..count {
                    let (exact, mag) =
                        reference::reference(dtype, op, seed, world, rank * count + i);
                    let got = ipcreduce::element::load_f64(dtype, bytes(&recv, count * size), i);
                    assert!(
                        reference::acceptable(dtype, op, world, got, exact, mag),
                        "{dtype} {op} {count}: element {i} = {got}, exact {exact}"
                    );
                }
                // In place: recv = send + rank * count.
                let mut inplace = send.clone();
                let base = inplace.as_mut_ptr().cast::<u8>();
                // SAFETY: one live buffer of world * count elements; recv is its shard.
                unsafe {
                    let r = base.add(rank * count * size);
                    c.reduce_scatter_raw(
                        base.cast(),
                        r.cast(),
                        count,
                        dtype,
                        op,
                        std::ptr::null_mut(),
                    )
                }
                .expect("reduce_scatter in place");
                let got =
                    &bytes(&inplace, total * size)[rank * count * size..(rank + 1) * count * size];
                assert_eq!(got, want, "reduce_scatter in place {dtype} {op} {count}");
                cases += 2;
            }
        }
        for count in [1usize, 5, 4097] {
            let seed = count as u64;
            let mine = input(dtype, seed, rank, count);
            let mut recv = vec![0u32; (count * world * size).div_ceil(4)];
            // SAFETY: send holds count elements, recv world * count.
            unsafe {
                c.all_gather_raw(
                    mine.as_ptr().cast(),
                    recv.as_mut_ptr().cast(),
                    count,
                    dtype,
                    std::ptr::null_mut(),
                )
            }
            .expect("all_gather");
            for r in 0..world {
                let theirs = input(dtype, seed, r, count);
                let at = r * count * size;
                assert_eq!(
                    &bytes(&recv, world * count * size)[at..at + count * size],
                    bytes(&theirs, count * size),
                    "all_gather {dtype} {count}: rank {r}'s part"
                );
            }
            // In place: send = recv + rank * count.
            let mut inplace = vec![0u32; recv.len()];
            let base = inplace.as_mut_ptr().cast::<u8>();
            // SAFETY: one live buffer of world * count elements; send is its shard.
            unsafe {
                let s = base.add(rank * count * size);
                std::ptr::copy_nonoverlapping(bytes(&mine, count * size).as_ptr(), s, count * size);
                c.all_gather_raw(
                    s.cast_const().cast(),
                    base.cast(),
                    count,
                    dtype,
                    std::ptr::null_mut(),
                )
            }
            .expect("all_gather in place");
            assert_eq!(inplace, recv, "all_gather in place {dtype} {count}");
            cases += 2;
        }
    }
    // The typed forms and their checks.
    let send: Vec<f32> = (0..world * 4).map(|i| (i + rank) as f32).collect();
    let mut mine = vec![0f32; 4];
    c.reduce_scatter_host(&send, &mut mine, ReduceOp::Sum)
        .expect("reduce_scatter_host");
    let want: Vec<f32> = (0..4)
        .map(|i| (0..world).map(|r| (rank * 4 + i + r) as f32).sum())
        .collect();
    assert_eq!(mine, want);
    let mut all = vec![0f32; world * 4];
    c.all_gather_host(&mine, &mut all).expect("all_gather_host");
    let e = c
        .all_gather_host(&mine, &mut all[1..])
        .unwrap_err()
        .to_string();
    // Every rank makes the same bad call: a rank refuses it itself, or finds the communicator
    // already aborted by a peer's refusal of it (which names that peer).
    let own = format!("rank {rank}: invalid argument to all_gather: ");
    let peers = format!("rank {rank}: communicator is aborted: rank ");
    assert!(
        (e.starts_with(&own) || e.starts_with(&peers))
            && e.contains(&format!("the larger buffer has {} elements", world * 4 - 1)),
        "{e}"
    );
    // A refused call aborts the communicator on every rank, with the first refusal (every
    // rank made the same one) as the reason. (The overlap refusal is one call per
    // communicator too: api.rs and hostile.rs check refusals one at a time.)
    match c.all_gather_host(&mine, &mut all) {
        Err(Error::Aborted { reason, .. }) => {
            assert!(
                reason.contains(&format!("the larger buffer has {} elements", world * 4 - 1)),
                "{reason}"
            )
        }
        other => panic!("expected Aborted after the refusals, got {other:?}"),
    }
    say(format!("DONE {cases}"));
    0
}

/// Rank 1 all-gathers while the others reduce-scatter the same number of bytes: every rank
/// fails with a mismatch naming the operations.
fn rank_mismatch() -> i32 {
    let mut c = join();
    let world = c.world();
    let r = if c.rank() == 1 {
        let mut out = vec![0f32; world * 8];
        c.all_gather_host(&[1f32; 8], &mut out)
    } else {
        let mut out = vec![0f32; 8];
        c.reduce_scatter_host(&vec![1f32; world * 8], &mut out, ReduceOp::Sum)
    };
    match r {
        Err(e @ ipcreduce::Error::Mismatch { .. }) => say(format!("MISMATCH {e}")),
        other => say(format!("UNEXPECTED {other:?}")),
    }
    // Stay until the parent heard everyone: a rank that leaves early looks dead to the others.
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
    0
}

fn spawn(test: &str, role: &str, world: usize, hold: bool) -> Vec<common::Rank> {
    let job = Job::new("sg", &format!("{role}{world}"));
    let spec = Spawn {
        test,
        role_var: ROLE,
        role,
        world,
        extra: &[],
        hold,
    };
    let ranks = common::spawn_world(&spec, &job);
    // The job's directory goes when the ranks are done (they hold the socket until then).
    std::mem::forget(job);
    ranks
}

#[test]
fn reduce_scatter_and_all_gather_have_nccls_semantics() {
    play_rank_if_child();
    for world in [2, 3, 4] {
        let mut ranks = spawn(
            "reduce_scatter_and_all_gather_have_nccls_semantics",
            "semantics",
            world,
            false,
        );
        for r in &mut ranks {
            let done = r.expect("DONE", T);
            assert_eq!(done, (3 * (3 * 4 * 2 + 3 * 2)).to_string(), "{}", r.diag());
        }
        for r in &mut ranks {
            r.wait_ok(T);
        }
    }
}

#[test]
fn ranks_in_different_operations_fail_with_a_mismatch() {
    play_rank_if_child();
    let mut ranks = spawn(
        "ranks_in_different_operations_fail_with_a_mismatch",
        "mismatch",
        3,
        true,
    );
    for r in &mut ranks {
        let m = r.expect("MISMATCH", T);
        assert!(
            m.contains(&format!("rank {}", r.rank))
                && m.contains("operation")
                && m.contains("all_gather")
                && m.contains("reduce_scatter"),
            "rank {}: {m}",
            r.rank
        );
    }
    for r in &mut ranks {
        r.wait_ok(T);
    }
}

/// `KIND RANK PEER MS TEXT` of a rank's RESULT line.
fn parse_result(m: &str) -> (String, usize, String, u64, String) {
    let p: Vec<&str> = m.splitn(5, ' ').collect();
    assert_eq!(p.len(), 5, "{m}");
    (
        p[0].to_string(),
        p[1].parse().unwrap_or(usize::MAX),
        p[2].to_string(),
        p[3].parse().unwrap(),
        p[4].to_string(),
    )
}

#[test]
fn a_missing_rank_times_out_in_either_operation() {
    play_rank_if_child();
    let world = 3;
    let culprit = world - 1;
    for op in ["rs", "ag"] {
        let test = "a_missing_rank_times_out_in_either_operation";
        let mut ranks = spawn(test, &format!("timeout-{op}"), world, true);
        for r in ranks.iter_mut().filter(|r| r.rank != culprit) {
            let m = r.expect("RESULT", T);
            let (kind, rank, peer, ms, text) = parse_result(&m);
            assert_eq!(
                (kind.as_str(), rank, peer.as_str()),
                ("TIMEOUT", r.rank, "2"),
                "{op}: {m}"
            );
            // The 1 s timeout, not much more: a rank waits out its own deadline once.
            assert!(
                (1000..3000).contains(&ms),
                "{op}: timed out after {ms} ms: {m}"
            );
            assert!(text.contains("waiting for peer rank 2"), "{op}: {m}");
        }
        ranks[culprit].send_line("GO");
        let m = ranks[culprit].expect("RESULT", T);
        let (kind, rank, _, ms, text) = parse_result(&m);
        // The late rank finds the communicator given up on it, at once.
        assert_eq!((kind.as_str(), rank), ("ABORTED", culprit), "{op}: {m}");
        assert!(text.contains("waiting for rank 2"), "{op}: {m}");
        assert!(
            ms < 500,
            "{op}: the late call took {ms} ms to be refused: {m}"
        );
        for r in &mut ranks {
            r.wait_ok(T);
        }
    }
}

#[test]
fn a_dead_rank_is_named_in_either_operation() {
    play_rank_if_child();
    let world = 3;
    for op in ["rs", "ag"] {
        let test = "a_dead_rank_is_named_in_either_operation";
        let mut ranks = spawn(test, &format!("death-{op}"), world, false);
        for r in ranks.iter_mut().take(world - 1) {
            let m = r.expect("RESULT", T);
            let (kind, rank, peer, ms, text) = parse_result(&m);
            assert_eq!(rank, r.rank, "{op}: {m}");
            assert!(
                kind == "ABORTED" || (kind == "PEERLOST" && peer == "2"),
                "{op}: expected an abort or a lost peer 2: {m}"
            );
            assert!(text.contains("rank 2 died"), "{op}: {m}");
            // The liveness connection closes with the process; the timeout is 30 s.
            assert!(ms < 2000, "{op}: noticed after {ms} ms: {m}");
            r.wait_ok(T);
        }
    }
}
