//! The kernels' phase stamps on a real GPU (feature `gpu`): ranks are processes of this test
//! binary sharing one GPU under MPS, traced (`IPCREDUCE_TRACE`, with the event timeline
//! `IPCREDUCE_TIMELINE=1`). A few calls on each path (LL, staged one-shot and two-shot,
//! registered one-shot and two-shot, and at two ranks the copy-engine path); one call of each
//! is made late on purpose by the last rank. In the trace files every block of every call has
//! start and end stamps, its stamps in order, within the call's event span; and in the late
//! call every other rank's longest wait is for the late rank, and about as long as the delay.
//! The copy-engine calls have one row per barrier and per chunk, the chunks' with their reduce.
//! The reduce-scatter, all-gather and fused add + RMSNorm calls after them are stamped too.

mod common;

use common::{say, Job, Rank, Spawn};
use ipcreduce::backend::cuda::memory::DeviceAlloc;
use ipcreduce::{Algorithm, BackendChoice, Communicator, Config, DType, ReduceOp};
use serde_json::Value;
use std::ffi::c_void;
use std::io::Write;
use std::time::Duration;

const ROLE: &str = "IPCREDUCE_GPU_TRACE_ROLE";
const T: Duration = Duration::from_secs(300);
/// How late the last rank makes one call of each path.
const DELAY: Duration = Duration::from_millis(30);
/// Calls per path; the one at index LATE is the late one.
const CALLS: usize = 4;
const LATE: usize = 2;
/// Stamps against the event spans: both are put on the host clock through anchors a few
/// microseconds off, and the events bracket the launch, not the first block.
const SLACK_NS: u64 = 100_000;
/// The all-reduce cases of `rank_phases`.
const CASES: usize = 6;
/// The copy-engine case: f32 elements (40 MiB: a 20 MiB share per rank, 3 chunks of at most
/// 8 MiB), and the size from which registered calls take the copy-engine path at two ranks.
const CE_COUNT: usize = 10 << 20;
const CE_MIN_BYTES: usize = 16 << 20;
/// The host-staged copy-engine case (`ce_staged_rows`): f32 elements (256 KiB), in chunks of
/// CE_STAGED_CHUNK bytes (`IPCREDUCE_STAGED_CHUNK`): 4 chunks.
const CE_STAGED_COUNT: usize = 64 << 10;
const CE_STAGED_CHUNK: usize = 64 << 10;
/// The fused calls' shape (f32): 1 MiB per rank, several rows per block.
const FUSED_TOKENS: usize = 64;
const FUSED_HIDDEN: usize = 4096;

fn play_rank_if_child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let code = match role.as_str() {
        "phases" => rank_phases(),
        "ce-staged" => rank_ce_staged(),
        other => panic!("unknown role {other}"),
    };
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

/// Before a late call: every rank's stream idle and every rank here, then the last rank waits
/// DELAY, so the others' kernels wait for it.
fn arrive_late(c: &mut Communicator) {
    c.synchronize().unwrap();
    c.bootstrap().all_gather(&[0u8]).unwrap();
    if c.rank() == c.world() - 1 {
        std::thread::sleep(DELAY);
    }
}

/// Each path's calls; one of each late on the last rank (after every rank's stream is idle, so
/// the others' kernels wait for it). Says `LATE <seq>` per late call, then `DONE <calls>`.
fn rank_phases() -> i32 {
    let config = Config {
        backend: BackendChoice::Cuda,
        workspace_bytes: Some(4 << 20),
        ce_min_bytes: Some(CE_MIN_BYTES),
        ..Config::default()
    };
    let mut c = Communicator::init(&config).expect("cuda communicator");
    let rank = c.rank();
    let bytes = CE_COUNT * 4;
    let (send, recv) = (
        DeviceAlloc::new(bytes, rank).unwrap(),
        DeviceAlloc::new(bytes, rank).unwrap(),
    );
    let (rs, rr) = (c.alloc(bytes).unwrap(), c.alloc(bytes).unwrap());
    // (count of f32, algorithm, registered): LL, staged one-shot (several chunks), staged
    // two-shot, registered one-shot and two-shot, and the copy-engine path (two ranks; a
    // registered two-shot at three).
    let cases: [(usize, Algorithm, bool); CASES] = [
        (1000usize, Algorithm::OneShot, false),
        (1 << 20, Algorithm::OneShot, false),
        (1 << 20, Algorithm::TwoShot, false),
        (100_003, Algorithm::OneShot, true),
        (1 << 20, Algorithm::TwoShot, true),
        (CE_COUNT, Algorithm::TwoShot, true),
    ];
    let mut made = 0;
    for &(count, algo, registered) in &cases {
        let (s, r) = if registered {
            (rs.ptr(), rr.ptr())
        } else {
            (send.ptr, recv.ptr)
        };
        for i in 0..CALLS {
            if i == LATE {
                arrive_late(&mut c);
            }
            // SAFETY: device buffers of this rank's GPU of `bytes` >= count * 4.
            unsafe {
                c.all_reduce_raw(
                    s as *const c_void,
                    r as *mut c_void,
                    count,
                    DType::F32,
                    ReduceOp::Sum,
                    algo,
                    std::ptr::null_mut(),
                )
            }
            .unwrap_or_else(|e| panic!("{count} x f32 {algo}: {e}"));
            made += 1;
            if i == LATE {
                say(format!("LATE {}", c.traced_calls()));
            }
        }
    }
    // Reduce-scatter and all-gather, plain and registered: their trace lines name the kernel
    // path the backend chose (the test checks the four names) and carry their stamps.
    let n = 4096;
    for (s, r) in [(send.ptr, recv.ptr), (rs.ptr(), rr.ptr())] {
        // SAFETY: device buffers of this rank's GPU of `bytes` >= n * world * 4, apart.
        unsafe {
            c.reduce_scatter_raw(
                s as *const c_void,
                r as *mut c_void,
                n,
                DType::F32,
                ReduceOp::Sum,
                std::ptr::null_mut(),
            )
            .unwrap_or_else(|e| panic!("reduce-scatter of {n} x f32: {e}"));
            c.all_gather_raw(
                s as *const c_void,
                r as *mut c_void,
                n,
                DType::F32,
                std::ptr::null_mut(),
            )
            .unwrap_or_else(|e| panic!("all-gather of {n} x f32: {e}"));
        }
    }
    // The fused all-reduce + add + RMSNorm on its one-shot and two-shot kernels, twice each:
    // stamped like the all-reduce (rows summed as `reduce`, two-shot's rows normalised as
    // `gather`). The values are whatever the buffers hold: only the stamps are checked.
    let weight = DeviceAlloc::new(FUSED_HIDDEN * 4, rank).unwrap();
    for algo in [Algorithm::OneShot, Algorithm::TwoShot] {
        for _ in 0..2 {
            let args = ipcreduce::AddRmsNorm {
                input: send.ptr as *const c_void,
                residual: rs.ptr() as *const c_void,
                weight: weight.ptr as *const c_void,
                out: recv.ptr as *mut c_void,
                residual_out: rr.ptr() as *mut c_void,
                fp8_out: std::ptr::null_mut(),
                fp8_scale: std::ptr::null(),
                tokens: FUSED_TOKENS,
                hidden: FUSED_HIDDEN,
                dtype: DType::F32,
                eps: 1e-6,
            };
            // SAFETY: device buffers of this rank's GPU of `bytes` >= tokens * hidden * 4,
            // apart; the weight holds `hidden` elements.
            unsafe { c.all_reduce_add_rms_norm_raw(&args, algo, std::ptr::null_mut()) }
                .unwrap_or_else(|e| panic!("fused {algo}: {e}"));
        }
    }
    c.synchronize().unwrap();
    drop(c); // writes the trace (IPCREDUCE_TRACE)
    say(format!("DONE {made}"));
    0
}

/// CALLS all-reduces of plain buffers on the host-staged copy-engine path (the environment
/// forces the host transport and the path from 64 KiB), the one at LATE late on the last rank.
/// Says `LATE <seq>`, then `DONE <calls>`.
fn rank_ce_staged() -> i32 {
    let config = Config {
        backend: BackendChoice::Cuda,
        ..Config::default()
    };
    let mut c = Communicator::init(&config).expect("cuda communicator");
    let rank = c.rank();
    let bytes = CE_STAGED_COUNT * 4;
    let (send, recv) = (
        DeviceAlloc::new(bytes, rank).unwrap(),
        DeviceAlloc::new(bytes, rank).unwrap(),
    );
    for i in 0..CALLS {
        if i == LATE {
            arrive_late(&mut c);
        }
        // SAFETY: device buffers of this rank's GPU of `bytes` = count * 4, apart.
        unsafe {
            c.all_reduce_raw(
                send.ptr as *const c_void,
                recv.ptr as *mut c_void,
                CE_STAGED_COUNT,
                DType::F32,
                ReduceOp::Sum,
                Algorithm::Auto,
                std::ptr::null_mut(),
            )
        }
        .unwrap_or_else(|e| panic!("{CE_STAGED_COUNT} x f32 host-staged copy-engine: {e}"));
        if i == LATE {
            say(format!("LATE {}", c.traced_calls()));
        }
    }
    c.synchronize().unwrap();
    drop(c); // writes the trace (IPCREDUCE_TRACE)
    say(format!("DONE {CALLS}"));
    0
}

/// What a traced job left: the late calls' sequence numbers (as rank 0 said them), the ranks'
/// trace files in rank order, and their folder (the caller removes it).
struct Traced {
    late: Vec<u64>,
    files: Vec<std::path::PathBuf>,
    dir: std::path::PathBuf,
}

/// Runs `world` ranks of `test` playing `role`, traced (`IPCREDUCE_TRACE` with the timeline)
/// with `extra` set too; each says `LATE <seq>` per late call, then `DONE <done>`.
fn run_traced(
    test: &str,
    role: &str,
    name: &str,
    world: usize,
    extra: &[(&str, &str)],
    done: usize,
) -> Traced {
    let job = Job::new("gputrace", name);
    let dir =
        std::env::temp_dir().join(format!("ipcreduce-gpu-trace-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_s = dir.display().to_string();
    let mut env = vec![
        ("IPCREDUCE_TRACE", dir_s.as_str()),
        ("IPCREDUCE_TIMELINE", "1"),
    ];
    env.extend_from_slice(extra);
    let spec = Spawn {
        test,
        role_var: ROLE,
        role,
        world,
        extra: &env,
        hold: false,
    };
    let mut ranks: Vec<Rank> = common::spawn_world(&spec, &job);
    let mut late = Vec::new();
    for (i, r) in ranks.iter_mut().enumerate() {
        loop {
            let m = r.next(T);
            if let Some(s) = m.strip_prefix("LATE ") {
                if i == 0 {
                    late.push(s.parse::<u64>().unwrap());
                }
            } else {
                assert_eq!(m, format!("DONE {done}"), "rank {i}");
                break;
            }
        }
    }
    for r in &mut ranks {
        r.wait_ok(T);
    }
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    assert_eq!(files.len(), world, "{files:?}");
    Traced { late, files, dir }
}

/// The calls of one rank's trace file, in order.
fn lines_of(file: &std::path::Path) -> Vec<Value> {
    let text = std::fs::read_to_string(file).unwrap();
    text.lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .collect()
}

/// The all-reduces of one rank's trace file, in order (other recorded calls left out).
fn calls_of(file: &std::path::Path) -> Vec<Value> {
    let mut calls = lines_of(file);
    calls.retain(|c| c["op"] == "all_reduce");
    calls
}

fn ns(v: &Value) -> Option<u64> {
    v.as_u64()
}

/// The lines of `lines` whose operation is one of `ops`, in order.
fn calls_of_ops<'a>(lines: &'a [Value], ops: &[&str]) -> Vec<&'a Value> {
    lines
        .iter()
        .filter(|c| ops.iter().any(|op| c["op"] == *op))
        .collect()
}

/// The `path` of each call ("" where it has none).
fn paths_of<'a>(calls: &[&'a Value]) -> Vec<&'a str> {
    calls
        .iter()
        .map(|c| c["path"].as_str().unwrap_or(""))
        .collect()
}

/// The rank whose trace file this is (`...-rank<R>.jsonl`).
fn rank_of(file: &std::path::Path) -> usize {
    let name = file.file_name().unwrap().to_string_lossy().to_string();
    name.rsplit("rank")
        .next()
        .and_then(|s| s.strip_suffix(".jsonl"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{name}"))
}

/// Checks one call's phases; returns the rank's longest wait per peer (ns).
fn check_call(rank: usize, call: &Value) -> Vec<(usize, u64)> {
    let seq = call["seq"].as_u64().unwrap();
    let what = format!("rank {rank} call #{seq} ({})", call["path"]);
    let p = &call["phases"];
    let blocks = p["blocks"]
        .as_array()
        .unwrap_or_else(|| panic!("{what}: no phases"));
    assert!(!blocks.is_empty(), "{what}: no block stamped");
    let dev = (ns(&call["dev_start_ns"]), ns(&call["dev_end_ns"]));
    let mut waits: std::collections::BTreeMap<usize, u64> = Default::default();
    for b in blocks {
        let start = ns(&b["start_ns"]).unwrap_or_else(|| panic!("{what}: {b} has no start"));
        let end = ns(&b["end_ns"]).unwrap_or_else(|| panic!("{what}: {b} has no end"));
        let mut order = vec![start];
        let peers: Vec<(usize, u64)> = b["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| (x[0].as_u64().unwrap() as usize, x[1].as_u64().unwrap()))
            .collect();
        let last_peer = peers.iter().map(|x| x.1).max();
        order.extend(last_peer);
        order.extend(ns(&b["reduce_ns"]));
        order.extend(ns(&b["gather_ns"]));
        order.push(end);
        // One tick of the globaltimer (1 us on some GPUs) between the block's threads.
        let tick = p["tick_ns"].as_u64().unwrap_or(0).max(1_000);
        assert!(
            order.windows(2).all(|w| w[0] <= w[1] + tick),
            "{what}: block stamps out of order: {b}"
        );
        assert!(
            peers.iter().all(|&(_, t)| t + tick >= start),
            "{what}: a peer seen before the start: {b}"
        );
        if let (Some(ds), Some(de)) = dev {
            assert!(
                start + SLACK_NS >= ds && end <= de + SLACK_NS,
                "{what}: block {start}..{end} outside the event span {ds}..{de}: {b}"
            );
        }
        for (peer, t) in peers {
            let w = waits.entry(peer).or_default();
            *w = (*w).max(t.saturating_sub(start));
        }
    }
    waits.into_iter().collect()
}

/// A copy-engine call's rows (ce.rs `Rows`): a row per chunk whose reduce stamped it, the two
/// lanes' last barriers, the two lanes' first barriers in the last two rows (their lane slots);
/// barriers' rows without a reduce.
fn check_ce_rows(rank: usize, call: &Value) {
    let what = format!("rank {rank} copy-engine call #{}", call["seq"]);
    assert_eq!(call["kernel"], "ce", "{what}: the kernel path");
    let blocks = call["phases"]["blocks"].as_array().unwrap();
    let rows: Vec<u64> = blocks
        .iter()
        .map(|b| b["block"].as_u64().unwrap())
        .collect();
    let chunks = (CE_COUNT * 4 / 2).div_ceil(8 << 20) as u64;
    let mut want: Vec<u64> = (0..chunks + 2).collect();
    want.extend([126, 127]);
    assert_eq!(rows, want, "{what}: rows");
    for b in blocks {
        let row = b["block"].as_u64().unwrap();
        let chunk = row < chunks;
        assert_eq!(b["reduce_ns"].is_u64(), chunk, "{what}: reduce stamp: {b}");
        assert_eq!(
            b["peers"].as_array().unwrap().len(),
            1,
            "{what}: the peer seen once: {b}"
        );
    }
}

/// A host-staged copy-engine call's rows (ce.rs `Rows`): per chunk k, row 2k (lane 0's barrier
/// once both ranks' copies into host memory are done) and row 2k + 1 (lane 1's barrier, then
/// the reduce, which stamps it); the two lanes' first barriers in their lane slots, 126 and 127.
fn check_ce_staged_rows(rank: usize, call: &Value) {
    let what = format!("rank {rank} host-staged copy-engine call #{}", call["seq"]);
    assert_eq!(call["kernel"], "ce-staged", "{what}: the kernel path");
    let blocks = call["phases"]["blocks"].as_array().unwrap();
    let rows: Vec<u64> = blocks
        .iter()
        .map(|b| b["block"].as_u64().unwrap())
        .collect();
    let chunks = (CE_STAGED_COUNT * 4).div_ceil(CE_STAGED_CHUNK) as u64;
    let mut want: Vec<u64> = (0..2 * chunks).collect();
    want.extend([126, 127]);
    assert_eq!(rows, want, "{what}: rows");
    for b in blocks {
        let row = b["block"].as_u64().unwrap();
        let reduced = row < 2 * chunks && row % 2 == 1;
        assert_eq!(
            b["reduce_ns"].is_u64(),
            reduced,
            "{what}: reduce stamp: {b}"
        );
        assert_eq!(
            b["peers"].as_array().unwrap().len(),
            1,
            "{what}: the peer seen once: {b}"
        );
    }
}

/// Checks the late call `seq` in `rank`'s trace: the late rank waited for no one; every other rank's longest wait was for the late rank, and about
/// as long as the delay. `waits`: the call's longest wait per peer ([`check_call`]).
fn check_late(rank: usize, late_rank: usize, seq: u64, waits: &[(usize, u64)]) {
    let delay = DELAY.as_nanos() as u64;
    if rank == late_rank {
        // The late rank found everyone there already.
        assert!(
            waits.iter().all(|w| w.1 < delay / 2),
            "rank {rank} #{seq}: the late rank waited: {waits:?}"
        );
    } else {
        let longest = waits.iter().max_by_key(|w| w.1).copied();
        let (peer, w) = longest.unwrap_or_else(|| panic!("#{seq}: no waits"));
        assert_eq!(peer, late_rank, "rank {rank} #{seq}: {waits:?}");
        assert!(
            w >= delay * 8 / 10 && w <= delay * 3,
            "rank {rank} #{seq}: waited {w} ns for a {delay} ns delay: {waits:?}"
        );
    }
}

/// The host-staged copy-engine path traced, at two ranks: every call's rows as ce.rs lays them
/// out, each row's stamps in order and within the call's span, and the late call's wait for the
/// late rank.
#[test]
fn host_staged_copy_engine_rows_and_a_late_rank() {
    play_rank_if_child();
    let world = 2;
    let chunk = CE_STAGED_CHUNK.to_string();
    let extra = [
        ("IPCREDUCE_TRANSPORT", "host"),
        ("IPCREDUCE_CE_STAGED_MIN", "65536"),
        ("IPCREDUCE_STAGED_CHUNK", chunk.as_str()),
    ];
    let Traced { late, files, dir } = run_traced(
        "host_staged_copy_engine_rows_and_a_late_rank",
        "ce-staged",
        "ce-staged",
        world,
        &extra,
        CALLS,
    );
    assert_eq!(late.len(), 1, "{late:?}");
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        let rank = rank_of(file);
        let calls = calls_of(file);
        assert_eq!(calls.len(), CALLS, "{name}");
        for call in &calls {
            let waits = check_call(rank, call);
            check_ce_staged_rows(rank, call);
            let seq = call["seq"].as_u64().unwrap();
            if late.contains(&seq) {
                check_late(rank, world - 1, seq, &waits);
            }
        }
    }
    eprintln!("{CALLS} host-staged copy-engine calls per rank checked");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn phase_stamps_per_block_and_a_late_rank() {
    play_rank_if_child();
    for world in [2usize, 3] {
        let Traced { late, files, dir } = run_traced(
            "phase_stamps_per_block_and_a_late_rank",
            "phases",
            &format!("phases{world}"),
            world,
            &[],
            CASES * CALLS,
        );
        assert_eq!(late.len(), CASES, "{late:?}");
        let late_rank = world - 1;
        for file in &files {
            let name = file.file_name().unwrap().to_string_lossy().to_string();
            let rank = rank_of(file);
            let calls = calls_of(file);
            assert_eq!(calls.len(), CASES * CALLS, "{name}");
            for call in &calls {
                let waits = check_call(rank, call);
                if world == 2 && call["count"].as_u64() == Some(CE_COUNT as u64) {
                    check_ce_rows(rank, call);
                }
                let seq = call["seq"].as_u64().unwrap();
                if late.contains(&seq) {
                    check_late(rank, late_rank, seq, &waits);
                }
            }
        }
        for file in &files {
            let name = file.file_name().unwrap().to_string_lossy().to_string();
            let rank = rank_of(file);
            let lines = lines_of(file);
            let sg = calls_of_ops(&lines, &["reduce_scatter", "all_gather"]);
            assert_eq!(
                paths_of(&sg),
                [
                    "reduce-scatter-staged",
                    "all-gather-staged",
                    "reduce-scatter-reg",
                    "all-gather-reg"
                ],
                "{name}"
            );
            for call in &sg {
                let blocks = call["phases"]["blocks"].as_array();
                assert!(
                    blocks.is_some_and(|b| !b.is_empty()),
                    "{name}: {} #{} has no stamped block",
                    call["op"],
                    call["seq"]
                );
            }
            let fused = calls_of_ops(&lines, &["all_reduce_add_rms_norm"]);
            assert_eq!(
                paths_of(&fused),
                ["oneshot", "oneshot", "twoshot", "twoshot"],
                "{name}"
            );
            for call in &fused {
                let what = format!("{name}: fused #{} ({})", call["seq"], call["path"]);
                // Order, and within the call's span, as every stamped call.
                check_call(rank, call);
                let two_shot = call["path"] == "twoshot";
                for b in call["phases"]["blocks"].as_array().unwrap() {
                    assert!(b["reduce_ns"].is_u64(), "{what}: no reduce stamp: {b}");
                    assert_eq!(
                        b["gather_ns"].is_u64(),
                        two_shot,
                        "{what}: a normalise stamp on two-shot only: {b}"
                    );
                    assert!(
                        !b["peers"].as_array().unwrap().is_empty(),
                        "{what}: no peer seen: {b}"
                    );
                }
            }
        }
        eprintln!(
            "world {world}: {} all-reduces, 4 reduce-scatters / all-gathers and 4 fused calls \
             per rank checked",
            CASES * CALLS
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
