//! Traces of whole jobs on the host backend: three ranks (processes started by `ipcreduce
//! launch`) with `IPCREDUCE_TRACE=DIR` make eight calls and close; `ipcreduce trace export`
//! must give one track per rank with every call as a slice, in order, and `ipcreduce trace
//! summarize` and the export must both name the rank that was made late on purpose and by
//! how much. Each rank also writes the part of its run from call #3 to #5 into a directory of
//! its own (`Communicator::write_trace`), which must hold just those calls. A second job
//! mismatches a count at call #5: the export must mark it on the odd rank and the error on
//! every rank. The calls, counts, delay and ranks are this file's own
//! script.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ipcreduce");
const ROLE: &str = "IPCREDUCE_TRACE_TEST_ROLE";
/// Where each rank writes the trace of calls [`PART_FIRST`]..=[`LATE_SEQ`].
const PART_DIR: &str = "IPCREDUCE_TRACE_TEST_PART";
const PART_FIRST: u64 = 3;
const WORLD: usize = 3;
/// Calls each rank makes: #1-#6 all-reduces, #7 a reduce-scatter, #8 an all-gather.
const CALLS: u64 = 8;
/// The rank that sleeps before call [`LATE_SEQ`] (straggle) or passes another count there
/// (mismatch).
const ODD: usize = 1;
const LATE_SEQ: u64 = 5;
const DELAY: Duration = Duration::from_millis(200);
/// How far the reported lateness may be from [`DELAY`]: 20%.
const TOLERANCE: f64 = 0.2;

// ---------------------------------------------------------------------------------------
// Rank side

/// One rank of the job (runs only under `ipcreduce launch` with the role set).
#[test]
fn trace_rank() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    use ipcreduce::{Algorithm, BackendChoice, Communicator, Config, ReduceOp};
    let config = Config {
        backend: BackendChoice::Host,
        timeout: Some(Duration::from_secs(10)),
        ..Config::default()
    };
    let mut comm = Communicator::init(&config).expect("init");
    let rank = comm.rank();
    let mut mark = 0;
    for seq in 1..=6u64 {
        if seq == PART_FIRST {
            mark = comm.traced_calls();
        }
        let mut count = 100 + seq as usize;
        if rank == ODD && seq == LATE_SEQ {
            match role.as_str() {
                "straggle" => std::thread::sleep(DELAY),
                _ => count += 1,
            }
        }
        let send = vec![1.0f32; count];
        let mut recv = vec![0.0f32; count];
        if let Err(e) = comm.all_reduce_host(&send, &mut recv, ReduceOp::Sum, Algorithm::Auto) {
            println!("@@ ERR {rank} {e}");
            return;
        }
        if seq == LATE_SEQ {
            let part = std::env::var(PART_DIR).expect("part dir");
            let f = comm.write_trace(&part, mark).expect("write_trace");
            println!("@@ PART {rank} {}", f.display());
        }
    }
    let send = vec![1.0f32; 8 * WORLD];
    let mut recv = vec![0.0f32; 8];
    comm.reduce_scatter_host(&send, &mut recv, ReduceOp::Sum)
        .expect("reduce-scatter");
    let mut all = vec![0.0f32; 8 * WORLD];
    comm.all_gather_host(&recv, &mut all).expect("all-gather");
    println!("@@ OK {rank}");
    // The trace is written when the communicator goes.
    drop(comm);
}

// ---------------------------------------------------------------------------------------
// Parent side

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ipcreduce-trace-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `cmd`, killing it if it outlives `within`.
fn bounded(mut cmd: Command, within: Duration) -> Output {
    let t0 = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start");
    // The output is small: reading it after the exit cannot block on a full pipe.
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > within {
            let _ = child.kill();
            panic!("{cmd:?} ran past {within:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs the job with `role`, its traces into `dir`; returns the ranks' `@@` lines.
fn job(role: &str, dir: &Path) -> (Vec<String>, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["launch", "-n", &WORLD.to_string(), "--grace", "5", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "trace_rank",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ROLE, role)
        .env("IPCREDUCE_TRACE", dir)
        .env(PART_DIR, dir.join("part"))
        .env("IPCREDUCE_FLIGHT_DIR", dir.join("flight"))
        .env_remove("IPCREDUCE_RANK")
        .env_remove("RANK")
        .env_remove("IPCREDUCE_FLIGHT")
        .env_remove("IPCREDUCE_FLIGHT_TIMES");
    let out = bounded(cmd, Duration::from_secs(60));
    let all = text(&out);
    let lines = all
        .lines()
        .filter_map(|l| l.find("@@ ").map(|i| l[i + 3..].to_string()))
        .collect();
    (lines, all)
}

fn cli(args: &[&str], dir: &Path) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(args).arg(dir);
    let out = bounded(cmd, Duration::from_secs(30));
    assert!(out.status.success(), "{args:?}: {}", text(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// The export of `dir`, parsed, through a file (`-o`) as a user would open it.
fn export(dir: &Path, format: &str) -> Value {
    let file = dir.join(format!("trace-{format}.json"));
    let mut cmd = Command::new(BIN);
    cmd.args(["trace", "export", "--format", format, "-o"])
        .arg(&file)
        .arg(dir);
    let out = bounded(cmd, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out));
    let body = std::fs::read_to_string(&file).unwrap();
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

fn events(trace: &Value) -> &Vec<Value> {
    trace["traceEvents"].as_array().expect("traceEvents")
}

/// Rank `pid`'s call slices (`X` on the host track), as in the file.
fn slices(trace: &Value, pid: usize) -> Vec<&Value> {
    events(trace)
        .iter()
        .filter(|e| e["ph"] == "X" && e["pid"] == pid as u64 && e["cat"] == "call")
        .collect()
}

/// The host track's tracks and names as the trace declares them.
fn process_names(trace: &Value) -> Vec<(u64, String)> {
    let mut v: Vec<(u64, String)> = events(trace)
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    v.sort();
    v
}

fn within(got_us: f64, want: Duration) -> bool {
    let want_us = want.as_secs_f64() * 1e6;
    (got_us - want_us).abs() <= TOLERANCE * want_us
}

#[test]
fn a_late_rank_is_named_with_its_delay_by_the_summary_and_the_export() {
    let dir = scratch("straggle");
    let (lines, all) = job("straggle", &dir);
    for rank in 0..WORLD {
        assert!(lines.contains(&format!("OK {rank}")), "{all}");
        let f = dir.join(format!("ipcreduce-trace-{}-rank{rank}.jsonl", job_id(&dir)));
        assert!(
            f.exists(),
            "no trace of rank {rank} in {}: {all}",
            dir.display()
        );
    }
    // No call failed: no flight record was written.
    assert!(!dir.join("flight").exists(), "{all}");

    // The part each rank wrote: calls #3-#5 only, the late one among them.
    let part = dir.join("part");
    for rank in 0..WORLD {
        let f = part.join(format!("ipcreduce-trace-{}-rank{rank}.jsonl", job_id(&dir)));
        assert!(
            lines.contains(&format!("PART {rank} {}", f.display())),
            "{all}"
        );
        let body = std::fs::read_to_string(&f).unwrap();
        let seqs: Vec<u64> = body
            .lines()
            .skip(1)
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["seq"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(seqs, (PART_FIRST..=LATE_SEQ).collect::<Vec<_>>(), "{body}");
    }
    let text = cli(&["trace", "summarize"], &part);
    assert!(
        text.contains(&format!(
            "no divergence: every rank made calls #{PART_FIRST}-#{LATE_SEQ} alike"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("latest arrival: #{LATE_SEQ}: rank {ODD}, ")),
        "{text}"
    );
    assert_eq!(slices(&export(&part, "chrome"), ODD).len(), 3);

    // The summary, in text and JSON.
    let text = cli(&["trace", "summarize"], &dir);
    assert!(text.contains("flight records of ranks 0, 1, 2"), "{text}");
    assert!(
        text.contains("no divergence: every rank made calls #1-#8 alike and none failed"),
        "{text}"
    );
    assert!(text.contains("errors: none"), "{text}");
    assert!(
        text.contains(&format!("latest arrival: #{LATE_SEQ}: rank {ODD}, ")),
        "{text}"
    );
    let v: Value = serde_json::from_str(&cli(&["trace", "summarize", "--json"], &dir)).unwrap();
    let late = &v["jobs"][0]["latest_arrival"];
    assert_eq!(late["seq"], LATE_SEQ, "{v}");
    assert_eq!(late["rank"], ODD, "{v}");
    let us = late["after_us"].as_f64().unwrap();
    assert!(
        within(us, DELAY),
        "rank {ODD} late by {us} us, slept {DELAY:?}: {v}"
    );
    assert!(v["jobs"][0]["divergence"].is_null(), "{v}");
    // The wait matrix: every other rank waited about the delay for the late one, which
    // itself waited for nobody that long.
    let waits = &v["jobs"][0]["waits"];
    assert_eq!(waits["calls"], CALLS, "{v}");
    let waited = |i: usize, j: usize| waits["total_us"][i][j].as_f64().unwrap();
    for r in (0..WORLD).filter(|&r| r != ODD) {
        assert!(
            within(waited(r, ODD), DELAY),
            "rank {r} waited {} us for rank {ODD}, which slept {DELAY:?}: {v}",
            waited(r, ODD)
        );
        assert!(
            waited(ODD, r) < TOLERANCE * DELAY.as_secs_f64() * 1e6,
            "rank {ODD} waited {} us for rank {r}: {v}",
            waited(ODD, r)
        );
    }
    assert!(
        text.contains(&format!("waits over {CALLS} calls, ms")),
        "{text}"
    );

    // The export: one process per rank, every call a slice, in order and not overlapping.
    for format in ["chrome", "perfetto"] {
        let t = export(&dir, format);
        assert_eq!(
            process_names(&t),
            [
                (0, "rank 0".into()),
                (1, "rank 1".into()),
                (2, "rank 2".into())
            ],
            "{t}"
        );
        let mut late_start = [0.0f64; WORLD];
        for (rank, start) in late_start.iter_mut().enumerate() {
            let s = slices(&t, rank);
            let seqs: Vec<u64> = s
                .iter()
                .map(|e| e["args"]["seq"].as_u64().unwrap())
                .collect();
            assert_eq!(seqs, (1..=CALLS).collect::<Vec<_>>(), "rank {rank}: {t}");
            for w in s.windows(2) {
                let end = w[0]["ts"].as_f64().unwrap() + w[0]["dur"].as_f64().unwrap();
                assert!(end <= w[1]["ts"].as_f64().unwrap() + 1e-3, "{w:?}");
            }
            let ops: Vec<&str> = s
                .iter()
                .map(|e| e["args"]["op"].as_str().unwrap())
                .collect();
            assert_eq!(&ops[5..], ["all_reduce", "reduce_scatter", "all_gather"]);
            let first = s[0];
            assert_eq!(first["args"]["count"], 101, "{first}");
            assert_eq!(first["args"]["dtype"], "float", "{first}");
            assert_eq!(first["args"]["bytes"], 404, "{first}");
            assert_eq!(first["args"]["state"], "ok", "{first}");
            assert!(
                first["name"]
                    .as_str()
                    .unwrap()
                    .starts_with("all_reduce 404 B"),
                "{first}"
            );
            *start = s[LATE_SEQ as usize - 1]["ts"].as_f64().unwrap();
        }
        // From the slices themselves: the late rank began call #5 last, by about the delay.
        let (last, &t_last) = late_start
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap();
        let t_first = late_start.iter().copied().fold(f64::MAX, f64::min);
        assert_eq!(last, ODD, "{late_start:?}");
        assert!(within(t_last - t_first, DELAY), "{late_start:?}");
        let s = slices(&t, ODD)[LATE_SEQ as usize - 1];
        assert!(within(s["args"]["late_us"].as_f64().unwrap(), DELAY), "{s}");
        // The others waited for it: an instant on their tracks.
        for rank in (0..WORLD).filter(|r| *r != ODD) {
            let waits: Vec<&Value> = events(&t)
                .iter()
                .filter(|e| {
                    e["ph"] == "i"
                        && e["pid"] == rank as u64
                        && e["args"]["seq"] == LATE_SEQ
                        && e["name"] == format!("wait: rank {ODD} arrived")
                })
                .collect();
            assert_eq!(waits.len(), 1, "rank {rank}: {t}");
            assert!(within(
                waits[0]["args"]["waited_us"].as_f64().unwrap(),
                DELAY
            ));
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_mismatch_is_marked_on_the_odd_rank_and_the_error_on_every_rank() {
    let dir = scratch("mismatch");
    let (lines, all) = job("mismatch", &dir);
    for rank in 0..WORLD {
        assert!(
            lines.iter().any(|l| l.starts_with(&format!("ERR {rank} "))),
            "{all}"
        );
    }
    let t = export(&dir, "chrome");
    let marks: Vec<&Value> = events(&t)
        .iter()
        .filter(|e| e["ph"] == "i" && e["name"].as_str().unwrap().starts_with("mismatch at #"))
        .collect();
    assert_eq!(marks.len(), 1, "{t}");
    assert_eq!(marks[0]["pid"], ODD, "{t}");
    assert_eq!(
        marks[0]["name"],
        format!("mismatch at #{LATE_SEQ}: count 106 vs 105"),
        "{t}"
    );
    for rank in 0..WORLD {
        let s = slices(&t, rank);
        assert_eq!(s.len(), LATE_SEQ as usize, "rank {rank}: {t}");
        assert_eq!(s[LATE_SEQ as usize - 1]["args"]["state"], "failed", "{t}");
        let err: Vec<&Value> = events(&t)
            .iter()
            .filter(|e| {
                e["ph"] == "i"
                    && e["pid"] == rank as u64
                    && e["name"] == format!("error: all_reduce #{LATE_SEQ}")
            })
            .collect();
        assert_eq!(err.len(), 1, "rank {rank}: {t}");
        let words = err[0]["args"]["error"].as_str().unwrap();
        assert!(words.contains(&format!("rank {rank}")), "{words}");
        assert!(words.contains("105") && words.contains("106"), "{words}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The job id of the traces in `dir` (ipcreduce-trace-JOB-rankR.jsonl).
fn job_id(dir: &Path) -> String {
    let name = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .find(|n| n.starts_with("ipcreduce-trace-"))
        .unwrap_or_else(|| panic!("no trace in {}", dir.display()));
    let rest = &name["ipcreduce-trace-".len()..];
    rest[..rest.rfind("-rank").unwrap()].to_string()
}

/// Traces written by hand as a cuda run with `IPCREDUCE_TIMELINE=1` writes them: the device
/// spans become a second track of each rank, placed on the same clock as the host calls.
#[test]
fn device_spans_are_a_track_of_their_own_on_the_host_clock() {
    let dir = scratch("device");
    let t0 = 1_700_000_000_000_000_000u64;
    for rank in 0..2u64 {
        let mut body = serde_json::json!({
            "flight_record": 1, "job": "dev", "rank": rank, "world": 2, "host": "h",
            "pid": 1, "capacity": 8, "calls": 3, "dumped_ns": t0 + 1_000_000_000,
            "written": "close", "error": null,
        })
        .to_string();
        for seq in 1..=3u64 {
            // Host call: 10 us from t0 + seq ms (rank 1 starts 2 us later); device span: from
            // 4 us after the host start, 50 us long; rank 1's call #3 has none (not finished
            // when the trace was written).
            let start = t0 + seq * 1_000_000 + rank * 2_000;
            let dev = !(rank == 1 && seq == 3);
            body.push('\n');
            body.push_str(
                &serde_json::json!({
                    "seq": seq, "op": "all_reduce", "path": "twoshot", "count": 1 << 20,
                    "dtype": "bfloat16", "reduce": "sum", "in_place": true, "stream": "0x5a",
                    "start_ns": start, "end_ns": start + 10_000, "state": "ok",
                    "dev_start_ns": dev.then_some(start + 4_000),
                    "dev_end_ns": dev.then_some(start + 54_000),
                })
                .to_string(),
            );
        }
        std::fs::write(
            dir.join(format!("ipcreduce-trace-dev-rank{rank}.jsonl")),
            body,
        )
        .unwrap();
    }
    let t = export(&dir, "perfetto");
    assert_eq!(t["otherData"]["jobs"][0]["zero_ns"], t0 + 1_000_000, "{t}");
    for rank in 0..2u64 {
        let named = events(&t).iter().any(|e| {
            e["ph"] == "M"
                && e["pid"] == rank
                && e["tid"] == 2
                && e["args"]["name"] == "device (stream order)"
        });
        assert!(named, "rank {rank}: {t}");
        let dev: Vec<&Value> = events(&t)
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == rank && e["cat"] == "device")
            .collect();
        assert_eq!(dev.len(), if rank == 0 { 3 } else { 2 }, "rank {rank}: {t}");
        for (i, e) in dev.iter().enumerate() {
            let seq = i as u64 + 1;
            assert_eq!(e["tid"], 2, "{e}");
            assert_eq!(e["args"]["seq"], seq, "{e}");
            assert_eq!(e["name"], "all_reduce 2 MiB twoshot", "{e}");
            let want_ts = ((seq - 1) * 1_000_000 + rank * 2_000 + 4_000) as f64 / 1e3;
            assert!((e["ts"].as_f64().unwrap() - want_ts).abs() < 1e-6, "{e}");
            assert!((e["dur"].as_f64().unwrap() - 50.0).abs() < 1e-6, "{e}");
            assert!(
                (e["args"]["queued_us"].as_f64().unwrap() - 4.0).abs() < 1e-6,
                "{e}"
            );
        }
        let host = slices(&t, rank as usize);
        assert_eq!(host.len(), 3, "{t}");
        assert_eq!(host[0]["args"]["stream"], "0x5a", "{t}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
