//! The flight recorder as a job meets it, on the host backend: three ranks (processes started
//! by `ipcreduce launch`) make six good calls, then call #7 goes wrong (the last rank passes
//! another count, or dies). Every surviving rank's error must name its flight-record file,
//! and `ipcreduce trace summarize` on those files must name call #7 and rank 2, in its text and
//! its JSON. The expected calls, counts and ranks are this file's own script.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ipcreduce");
const ROLE: &str = "IPCREDUCE_FLIGHT_TEST_ROLE";
const WORLD: usize = 3;
const CULPRIT: usize = 2;
/// The failing call's sequence number: six good calls come before it.
const BAD_SEQ: u64 = 7;
const COUNT: usize = 100;

// ---------------------------------------------------------------------------------------
// Rank side

/// One rank of the job (runs only under `ipcreduce launch` with the role set).
#[test]
fn flight_rank() {
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
    // Calls #1-#4: all-reduces of growing counts; #5 a reduce-scatter, #6 an all-gather.
    for i in 1..=4 {
        let send = vec![1.0f32; 60 + i];
        let mut recv = vec![0.0f32; 60 + i];
        comm.all_reduce_host(&send, &mut recv, ReduceOp::Sum, Algorithm::Auto)
            .expect("good all-reduce");
    }
    let send = vec![1.0f32; 8 * WORLD];
    let mut recv = vec![0.0f32; 8];
    comm.reduce_scatter_host(&send, &mut recv, ReduceOp::Sum)
        .expect("good reduce-scatter");
    let mut all = vec![0.0f32; 8 * WORLD];
    comm.all_gather_host(&recv, &mut all)
        .expect("good all-gather");
    // Call #7.
    let mut count = COUNT;
    if rank == CULPRIT {
        match role.as_str() {
            "kill" => {
                // Let the others get inside the call, then die without a word.
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: raising a signal on ourselves.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            _ => count += 1,
        }
    }
    let send = vec![1.0f32; count];
    let mut recv = vec![0.0f32; count];
    match comm.all_reduce_host(&send, &mut recv, ReduceOp::Sum, Algorithm::Auto) {
        Ok(()) => println!("@@ OK {rank}"),
        Err(e) => println!("@@ ERR {rank} {e}"),
    }
    // A later call is refused; its error names the same file.
    if let Err(e) = comm.all_reduce_host(&send, &mut recv, ReduceOp::Sum, Algorithm::Auto) {
        println!("@@ LATER {rank} {e}");
    }
}

// ---------------------------------------------------------------------------------------
// Parent side

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ipcreduce-flight-{tag}-{}", std::process::id()));
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

/// Runs the job with `role`, its flight records into `dir`; returns the ranks' `@@` lines.
fn job(role: &str, dir: &Path, extra_env: &[(&str, &str)]) -> (Vec<String>, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["launch", "-n", &WORLD.to_string(), "--grace", "5", "--"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "flight_rank",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ROLE, role)
        .env("IPCREDUCE_FLIGHT_DIR", dir)
        .env_remove("IPCREDUCE_RANK")
        .env_remove("RANK")
        .env_remove("IPCREDUCE_FLIGHT");
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let out = bounded(cmd, Duration::from_secs(60));
    let all = text(&out);
    let lines = all
        .lines()
        .filter_map(|l| l.find("@@ ").map(|i| l[i + 3..].to_string()))
        .collect();
    (lines, all)
}

/// The error line of `kind` (ERR, LATER) of `rank`.
fn line<'a>(lines: &'a [String], kind: &str, rank: usize, all: &str) -> &'a str {
    let prefix = format!("{kind} {rank} ");
    lines
        .iter()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {kind} line from rank {rank}:\n{all}"))
}

/// The flight-record file an error names, checked to exist in `dir` and hold `rank`'s calls
/// #1 to #7 (the last one not completed).
fn named_file(error: &str, dir: &Path, rank: usize) -> PathBuf {
    let at = error
        .find("(flight record: ")
        .unwrap_or_else(|| panic!("rank {rank}'s error names no flight record: {error}"));
    let rest = &error[at + "(flight record: ".len()..];
    let file = PathBuf::from(&rest[..rest.find(".jsonl)").expect("closing") + ".jsonl".len()]);
    assert_eq!(file.parent(), Some(dir), "{error}");
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("ipcreduce-flight-launch-"), "{name}");
    assert!(name.ends_with(&format!("-rank{rank}.jsonl")), "{name}");
    let body = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let recs: Vec<Value> = body
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs[0]["rank"], rank as u64, "{body}");
    assert_eq!(recs[0]["world"], WORLD as u64, "{body}");
    let seqs: Vec<u64> = recs[1..]
        .iter()
        .map(|r| r["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, (1..=BAD_SEQ).collect::<Vec<_>>(), "{body}");
    let ops: Vec<&str> = recs[1..]
        .iter()
        .map(|r| r["op"].as_str().unwrap())
        .collect();
    assert_eq!(
        ops,
        [
            "all_reduce",
            "all_reduce",
            "all_reduce",
            "all_reduce",
            "reduce_scatter",
            "all_gather",
            "all_reduce"
        ],
        "{body}"
    );
    assert_eq!(recs[1]["count"], 61, "{body}");
    assert_eq!(recs[1]["state"], "ok", "{body}");
    assert_ne!(recs[7]["state"], "ok", "{body}");
    file
}

fn summarize(dir: &Path, json: bool) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(["trace", "summarize"]).arg(dir);
    if json {
        cmd.arg("--json");
    }
    let out = bounded(cmd, Duration::from_secs(30));
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8(out.stdout).unwrap()
}

fn the_job(json: &str) -> Value {
    let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}:\n{json}"));
    let jobs = v["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 1, "{json}");
    jobs[0].clone()
}

#[test]
fn a_mismatched_count_is_named_in_every_dump_and_in_the_summary() {
    let dir = scratch("mismatch");
    let (lines, all) = job("mismatch", &dir, &[]);
    for rank in 0..WORLD {
        let err = line(&lines, "ERR", rank, &all);
        let file = named_file(err, &dir, rank);
        let later = line(&lines, "LATER", rank, &all);
        assert!(
            later.contains(&format!("(flight record: {})", file.display())),
            "{later}"
        );
    }
    let text = summarize(&dir, false);
    assert!(text.contains("flight records of ranks 0, 1, 2"), "{text}");
    assert!(
        text.contains("first divergence: call #7 (made differently); look at rank 2"),
        "{text}"
    );
    assert!(
        text.contains("ranks 0, 1: all_reduce count 100 float sum"),
        "{text}"
    );
    assert!(
        text.contains("rank 2 made it differently: count 101 vs 100"),
        "{text}"
    );
    let j = the_job(&summarize(&dir, true));
    let d = &j["divergence"];
    assert_eq!(d["seq"], BAD_SEQ, "{j}");
    assert_eq!(d["kind"], "different", "{j}");
    assert_eq!(d["culprits"], serde_json::json!([CULPRIT]), "{j}");
    assert_eq!(d["ranks"], serde_json::json!([0, 1]), "{j}");
    assert_eq!(d["call"]["count"], COUNT as u64, "{j}");
    assert_eq!(d["different"][0]["rank"], CULPRIT, "{j}");
    assert_eq!(d["different"][0]["detail"], "count 101 vs 100", "{j}");
    assert_eq!(j["missing"], serde_json::json!([]), "{j}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_killed_rank_is_named_by_the_survivors_dumps_and_the_summary() {
    let dir = scratch("kill");
    let (lines, all) = job("kill", &dir, &[]);
    for rank in 0..CULPRIT {
        let err = line(&lines, "ERR", rank, &all);
        assert!(err.contains("rank 2"), "{err}");
        named_file(err, &dir, rank);
    }
    assert!(!lines.iter().any(|l| l.starts_with("ERR 2")), "{all}");
    let text = summarize(&dir, false);
    assert!(text.contains("flight records of ranks 0, 1"), "{text}");
    assert!(text.contains("no record: rank 2"), "{text}");
    assert!(text.contains("first divergence: call #7"), "{text}");
    assert!(text.contains("look at rank 2"), "{text}");
    let j = the_job(&summarize(&dir, true));
    assert_eq!(j["missing"], serde_json::json!([CULPRIT]), "{j}");
    assert_eq!(j["divergence"]["seq"], BAD_SEQ, "{j}");
    assert_eq!(j["divergence"]["kind"], "failed", "{j}");
    assert_eq!(
        j["divergence"]["culprits"],
        serde_json::json!([CULPRIT]),
        "{j}"
    );
    assert_eq!(
        j["divergence"]["failed_on"],
        serde_json::json!([0, 1]),
        "{j}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn with_the_recorder_off_errors_name_no_file_and_none_is_written() {
    let dir = scratch("off");
    let (lines, all) = job("mismatch", &dir, &[("IPCREDUCE_FLIGHT", "0")]);
    for rank in 0..WORLD {
        let err = line(&lines, "ERR", rank, &all);
        assert!(err.contains("count"), "{err}");
        assert!(!err.contains("flight record"), "{err}");
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "{all}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Records written by hand: rank 1's ring ends at call #4 (it never made #5), rank 2 was the
/// last to start calls #2 and #3 (300 and 500 us after the first) and rank 0 call #4 (100 us).
#[test]
fn summarize_names_a_call_never_made_and_the_late_ranks() {
    let dir = scratch("hand");
    let t0 = 1_700_000_000_000_000_000u64;
    // (rank, calls made, start offset in ns of each call)
    let starts: [[u64; 5]; 3] = [
        [0, 0, 0, 100_000, 0],
        [10_000, 0, 0, 0, 0],
        [0, 300_000, 500_000, 0, 0],
    ];
    for (rank, made) in [(0usize, 5u64), (1, 4), (2, 5)] {
        let mut body = serde_json::json!({
            "flight_record": 1, "job": "hand", "rank": rank, "world": 3, "host": "h",
            "pid": 1, "capacity": 8, "calls": made, "dumped_ns": t0 + 1_000_000_000,
            "error": format!("rank {rank}: all_reduce #5 timed out"),
        })
        .to_string();
        for seq in 1..=made {
            body.push('\n');
            let state = if seq == made { "failed" } else { "ok" };
            body.push_str(
                &serde_json::json!({
                    "seq": seq, "op": "all_reduce", "path": "oneshot", "count": 8,
                    "dtype": "float", "reduce": "sum", "in_place": false, "stream": "0x0",
                    "start_ns": t0 + seq * 1_000_000 + starts[rank][seq as usize - 1],
                    "end_ns": null, "state": if rank == 1 && seq == 4 { "ok" } else { state },
                })
                .to_string(),
            );
        }
        std::fs::write(
            dir.join(format!("ipcreduce-flight-hand-rank{rank}.jsonl")),
            body,
        )
        .unwrap();
    }
    let text = summarize(&dir, false);
    assert!(
        text.contains("first divergence: call #5 (a rank never made it); look at rank 1"),
        "{text}"
    );
    assert!(
        text.contains("rank 1 never made call #5: its last call was #4"),
        "{text}"
    );
    let j = the_job(&summarize(&dir, true));
    assert_eq!(j["divergence"]["seq"], 5, "{j}");
    assert_eq!(j["divergence"]["kind"], "never_made", "{j}");
    assert_eq!(j["divergence"]["never_made"][0]["rank"], 1, "{j}");
    // Calls #1-#4 have every rank's start; #5 lacks rank 1's, so no arrival there.
    let s = &j["stragglers"];
    assert_eq!(s[0]["rank"], 2, "{j}");
    assert_eq!(s[0]["last_in"], 2, "{j}");
    assert!(
        (s[0]["mean_after_us"].as_f64().unwrap() - 400.0).abs() < 1e-6,
        "{j}"
    );
    let late: Vec<(u64, u64)> = s
        .as_array()
        .unwrap()
        .iter()
        .map(|x| (x["rank"].as_u64().unwrap(), x["last_in"].as_u64().unwrap()))
        .collect();
    assert_eq!(late, [(2, 2), (0, 1), (1, 1)], "{j}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Records where every rank made the same calls and returned from all of them (a cuda call
/// returns once enqueued; the failure came while it ran), rank 1 of 3 left none: the last
/// call stands for the failure, and the rank without a record is the one to look at.
#[test]
fn summarize_points_past_the_last_call_when_every_rank_returned() {
    let dir = scratch("after");
    for rank in [0usize, 2] {
        let mut body = serde_json::json!({
            "flight_record": 1, "job": "after", "rank": rank, "world": 3, "host": "h",
            "pid": 1, "capacity": 8, "calls": 3, "dumped_ns": 5,
            "error": format!("rank {rank}: communicator is aborted: rank 1 died"),
        })
        .to_string();
        for seq in 1..=3u64 {
            body.push('\n');
            body.push_str(
                &serde_json::json!({
                    "seq": seq, "op": "all_reduce", "path": "oneshot", "count": 16 * seq,
                    "dtype": "bfloat16", "reduce": "sum", "in_place": true, "stream": "0x0",
                    "start_ns": null, "end_ns": null, "state": "ok",
                })
                .to_string(),
            );
        }
        std::fs::write(
            dir.join(format!("ipcreduce-flight-after-rank{rank}.jsonl")),
            body,
        )
        .unwrap();
    }
    let text = summarize(&dir, false);
    assert!(text.contains("no record: rank 1"), "{text}");
    assert!(
        text.contains("first divergence: call #3 (the last call"),
        "{text}"
    );
    assert!(text.contains("look at rank 1"), "{text}");
    assert!(
        text.contains("ranks 0, 2: all_reduce count 48 bfloat16 sum, in place"),
        "{text}"
    );
    let j = the_job(&summarize(&dir, true));
    assert_eq!(j["divergence"]["kind"], "last", "{j}");
    assert_eq!(j["divergence"]["seq"], 3, "{j}");
    assert_eq!(j["divergence"]["culprits"], serde_json::json!([1]), "{j}");
    // No times recorded: no arrival claimed.
    assert!(j["last_arrival"].is_null(), "{j}");
    assert_eq!(j["stragglers"], serde_json::json!([]), "{j}");
    std::fs::remove_dir_all(&dir).ok();
}
