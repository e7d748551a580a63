//! The kernels' phase stamps in trace files (the `phases` field the library writes with
//! `IPCREDUCE_TRACE` on cuda, docs/tracing.md), read by the command: `ipcreduce trace export`
//! gives every block of every rank a track of phase slices, and `trace summarize` names the
//! peer a rank waited for longest, in text and JSON. The files are made up here: two ranks,
//! three calls, rank 1 late by 250 us in call #2.

use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ipcreduce");
const T0: u64 = 1_700_000_000_000_000_000;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ipcreduce-trace-phases-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Rank `rank`'s trace: calls #1-#3, two blocks each; in #2 rank 0's blocks wait 250 us for
/// rank 1.
fn write(dir: &std::path::Path, rank: u64) {
    write_kernels(dir, rank, |_| None);
}

/// [`write`], each call's record naming the kernel path `kernel(seq)` (as the cuda all-reduce's
/// records do; None: no `kernel` field, as in older files).
fn write_kernels(dir: &std::path::Path, rank: u64, kernel: impl Fn(u64) -> Option<&'static str>) {
    let mut body = json!({
        "flight_record": 1, "job": "ph", "rank": rank, "world": 2, "host": "h", "pid": 1,
        "capacity": 8, "calls": 3, "dumped_ns": T0 + 1_000_000_000, "written": "close",
        "error": null,
    })
    .to_string();
    for seq in 1..=3u64 {
        let start = T0 + seq * 1_000_000;
        let wait = if seq == 2 && rank == 0 {
            250_000
        } else {
            3_000
        };
        let blocks: Vec<Value> = (0..2u64)
            .map(|b| {
                let s = start + 5_000 + b * 100;
                json!({"block": b, "start_ns": s, "peers": [[1 - rank, s + wait]],
                       "reduce_ns": s + wait + 10_000, "gather_ns": null,
                       "end_ns": s + wait + 12_000})
            })
            .collect();
        let mut rec = json!({
            "seq": seq, "op": "all_reduce", "path": "oneshot", "count": 1024,
            "dtype": "float", "reduce": "sum", "in_place": false, "stream": "0x0",
            "start_ns": start, "end_ns": start + 4_000, "state": "ok",
            "dev_start_ns": start + 4_000, "dev_end_ns": start + 400_000,
            "phases": {"kseq": seq, "tick_ns": 32, "blocks": blocks},
        });
        if let Some(k) = kernel(seq) {
            rec["kernel"] = json!(k);
        }
        body.push('\n');
        body.push_str(&rec.to_string());
    }
    std::fs::write(
        dir.join(format!("ipcreduce-trace-ph-rank{rank}.jsonl")),
        body,
    )
    .unwrap();
}

fn run(args: &[&str], dir: &std::path::Path) -> String {
    let out = Command::new(BIN).args(args).arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn phases_are_block_tracks_and_the_late_peer_is_named() {
    let d = dir("late");
    write(&d, 0);
    write(&d, 1);
    let t: Value =
        serde_json::from_str(&run(&["trace", "export", "--format", "perfetto"], &d)).expect("JSON");
    let ev = t["traceEvents"].as_array().unwrap();
    for rank in 0..2u64 {
        let tracks: Vec<&Value> = ev
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["pid"] == rank)
            .filter(|e| e["args"]["name"].as_str().unwrap().starts_with("block "))
            .collect();
        assert_eq!(tracks.len(), 2, "rank {rank}: {t}");
        let phases: Vec<&Value> = ev
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == "phase" && e["pid"] == rank)
            .collect();
        // Three calls, two blocks, wait + reduce + finish.
        assert_eq!(phases.len(), 18, "rank {rank}");
        assert!(phases
            .iter()
            .all(|e| e["args"]["path"] == "oneshot" && e["args"]["bytes"] == 4096));
        let wait = phases
            .iter()
            .find(|e| e["args"]["seq"] == 2 && e["name"] == format!("wait for peer {}", 1 - rank))
            .unwrap();
        let want = if rank == 0 { 250.0 } else { 3.0 };
        assert!(
            (wait["dur"].as_f64().unwrap() - want).abs() < 1e-6,
            "{wait}"
        );
    }
    let text = run(&["trace", "summarize"], &d);
    assert!(text.contains("kernel phases"), "{text}");
    assert!(
        text.contains("#2 oneshot:") && text.contains("longest: rank 0 for rank 1, 250.0 us"),
        "{text}"
    );
    let j: Value = serde_json::from_str(&run(&["trace", "summarize", "--json"], &d)).unwrap();
    let p = &j["jobs"][0]["phases"];
    assert_eq!(p["paths"][0]["path"], "oneshot", "{p}");
    assert_eq!(p["paths"][0]["median_us"]["reduce"], 10.0, "{p}");
    assert_eq!(p["calls"][1]["longest"], json!([0, 1, 250.0]), "{p}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn phases_are_summed_up_per_kernel_path_where_the_records_name_one() {
    let d = dir("kernels");
    let kernel = |seq| Some(if seq == 3 { "ce" } else { "oneshot-ll" });
    write_kernels(&d, 0, kernel);
    write_kernels(&d, 1, kernel);
    let j: Value = serde_json::from_str(&run(&["trace", "summarize", "--json"], &d)).unwrap();
    let paths = j["jobs"][0]["phases"]["paths"].as_array().unwrap().clone();
    let named: Vec<(&str, u64)> = paths
        .iter()
        .map(|p| (p["path"].as_str().unwrap(), p["calls"].as_u64().unwrap()))
        .collect();
    // Two ranks' records per call.
    assert_eq!(named, [("ce", 2), ("oneshot-ll", 4)], "{paths:?}");
    let t: Value =
        serde_json::from_str(&run(&["trace", "export", "--format", "perfetto"], &d)).unwrap();
    let ev = t["traceEvents"].as_array().unwrap();
    let phase_of = |seq: u64| {
        ev.iter()
            .find(|e| e["cat"] == "phase" && e["args"]["seq"] == seq)
            .unwrap()
    };
    assert_eq!(phase_of(3)["args"]["kernel"], "ce");
    assert_eq!(phase_of(1)["args"]["kernel"], "oneshot-ll");
    std::fs::remove_dir_all(&d).ok();
}
