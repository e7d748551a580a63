//! `ipcreduce trace export`: the ranks' records of a job as one Chrome trace-event JSON file
//! (the format chrome://tracing and Perfetto's UI open): each rank a process, its host calls
//! one track of slices (`X` events: the call from its host start to its return, with its
//! identity in `args`), its device spans another track when the records have them
//! (`IPCREDUCE_TIMELINE`), a track per kernel block with its phases when the kernels stamped
//! them (`IPCREDUCE_TRACE` on cuda, phases.rs), and instant events where a rank waited for the last one to arrive,
//! where a call failed and where the ranks' records part.
//!
//! Clocks: ranks of one host stamp calls with that host's wall clock (see `ipcreduce::flight`),
//! so their times are put on the trace as they are. Ranks of another host are shifted so that
//! the first call every rank completed ends at the same time on both hosts: a collective cannot
//! return on one rank before every rank has joined it, so its ends are the closest thing to a
//! common instant the records hold (off by the call's own skew, microseconds). `otherData`
//! says which alignment each host got.

use super::records::{Dump, Rec};
use serde_json::{json, Value};
use std::path::Path;

/// The track of host calls, in each rank's process.
const HOST_TID: u64 = 1;
/// The track of device spans (cuda, `IPCREDUCE_TIMELINE=1`).
const DEVICE_TID: u64 = 2;
/// Process ids of one job's ranks: `job index * PID_STRIDE + rank`.
const PID_STRIDE: usize = 1000;

pub(super) fn run(
    inputs: &[std::path::PathBuf],
    format: &str,
    output: &Path,
) -> Result<(), String> {
    // Both names write the same JSON: Perfetto reads Chrome's trace-event format as it is.
    if !matches!(format, "chrome" | "perfetto") {
        return Err(format!("--format {format}: expected chrome or perfetto"));
    }
    let jobs: Vec<Vec<Dump>> = super::jobs(inputs)?
        .into_values()
        .map(super::latest_per_rank)
        .collect();
    let text = serde_json::to_string(&trace(&jobs)).expect("plain data") + "\n";
    if output == Path::new("-") {
        print!("{text}");
        Ok(())
    } else {
        std::fs::write(output, text).map_err(|e| format!("writing {}: {e}", output.display()))
    }
}

fn dtype_bytes(dtype: &str) -> u64 {
    match dtype {
        "float" => 4,
        _ => 2,
    }
}

/// `400 B`, `4 KiB`, `1.5 MiB`.
fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", units[u])
    } else {
        format!("{v:.1} {}", units[u])
    }
}

/// A call's slice name: operation, size (count times the element size) and path.
fn name(r: &Rec) -> String {
    let path = r
        .path
        .as_deref()
        .map(|p| format!(" {p}"))
        .unwrap_or_default();
    format!("{} {}{path}", r.op, human(r.count * dtype_bytes(&r.dtype)))
}

/// Per dump, the ns to add to its times, and per host how it was aligned.
fn offsets(dumps: &[Dump]) -> (Vec<i64>, Vec<Value>) {
    let host0 = &dumps[0].header.host;
    // The first call every rank has a completed record of, with its end time.
    let common = dumps[0].recs.keys().copied().find(|seq| {
        dumps.iter().all(|d| {
            d.recs
                .get(seq)
                .is_some_and(|r| r.state == "ok" && r.end_ns.is_some())
        })
    });
    let first_end = |host: &str, seq: u64| -> u64 {
        dumps
            .iter()
            .filter(|d| d.header.host == host)
            .filter_map(|d| d.recs.get(&seq)?.end_ns)
            .min()
            .unwrap_or(0)
    };
    let mut hosts: Vec<&str> = dumps.iter().map(|d| d.header.host.as_str()).collect();
    hosts.sort_unstable();
    hosts.dedup();
    let mut notes = Vec::new();
    let mut by_host = std::collections::BTreeMap::new();
    for h in hosts {
        let (off, how) = if h == host0 {
            (0i64, "reference clock".to_string())
        } else if let Some(seq) = common {
            (
                first_end(host0, seq) as i64 - first_end(h, seq) as i64,
                format!("shifted so that call #{seq} ends with the reference host's"),
            )
        } else {
            (
                0,
                "not aligned: no call completed on every rank".to_string(),
            )
        };
        by_host.insert(h, off);
        notes.push(json!({"host": h, "offset_ns": off, "alignment": how}));
    }
    (
        dumps
            .iter()
            .map(|d| by_host[d.header.host.as_str()])
            .collect(),
        notes,
    )
}

fn meta(pid: usize, tid: Option<u64>, what: &str, args: Value) -> Value {
    let mut v = json!({"name": what, "ph": "M", "pid": pid, "args": args});
    if let Some(t) = tid {
        v["tid"] = json!(t);
    }
    v
}

fn instant(pid: usize, tid: u64, ts: f64, name: String, args: Value) -> Value {
    json!({"name": name, "ph": "i", "s": "t", "ts": ts, "pid": pid, "tid": tid, "cat": "event",
           "args": args})
}

/// The trace of every job (a job's dumps are one per rank, in rank order).
pub(super) fn trace(jobs: &[Vec<Dump>]) -> Value {
    let mut events = Vec::new();
    let mut other = Vec::new();
    // Aligned times of every job, and the earliest as the trace's zero.
    let aligned: Vec<(Vec<i64>, Vec<Value>)> = jobs.iter().map(|d| offsets(d)).collect();
    let base = jobs
        .iter()
        .zip(&aligned)
        .flat_map(|(dumps, (offs, _))| {
            dumps.iter().zip(offs).flat_map(|(d, o)| {
                d.recs
                    .values()
                    .filter_map(move |r| Some(r.start_ns? as i64 + o))
            })
        })
        .min()
        .unwrap_or(0);
    let many = jobs.len() > 1;
    for (j, (dumps, (offs, notes))) in jobs.iter().zip(aligned).enumerate() {
        let missing: Vec<usize> = {
            let world = dumps.iter().map(|d| d.header.world).max().unwrap_or(0);
            (0..world)
                .filter(|r| !dumps.iter().any(|d| d.header.rank == *r))
                .collect()
        };
        let first = dumps
            .iter()
            .filter_map(|d| d.recs.keys().next().copied())
            .max();
        let last = dumps
            .iter()
            .filter_map(|d| d.recs.keys().next_back().copied())
            .max();
        let failed = dumps.iter().any(|d| d.header.error.is_some());
        let divergence = match (first, last) {
            (Some(a), Some(b)) => {
                (a..=b).find_map(|s| super::diverges_at(dumps, &missing, s, failed && s == b))
            }
            _ => None,
        };
        other.push(json!({
            "job": dumps[0].header.job,
            "ranks": dumps.iter().map(|d| d.header.rank).collect::<Vec<_>>(),
            "missing": missing,
            "clocks": notes,
            "zero_ns": base,
        }));
        for (d, off) in dumps.iter().zip(offs) {
            let rank = d.header.rank;
            let pid = j * PID_STRIDE + rank;
            let ts = |ns: u64| (ns as i64 + off - base) as f64 / 1e3;
            let label = if many {
                format!("{} rank {rank}", d.header.job)
            } else {
                format!("rank {rank}")
            };
            events.push(meta(pid, None, "process_name", json!({"name": label})));
            events.push(meta(
                pid,
                None,
                "process_sort_index",
                json!({"sort_index": pid}),
            ));
            events.push(meta(
                pid,
                Some(HOST_TID),
                "thread_name",
                json!({"name": "calls (host)"}),
            ));
            let mut device_named = false;
            let mut blocks_named = std::collections::BTreeSet::new();
            let mut error_told = false;
            for r in d.recs.values() {
                let Some(start) = r.start_ns else { continue };
                let end = r.end_ns.unwrap_or(d.header.dumped_ns).max(start);
                let mut args = json!({
                    "seq": r.seq, "op": r.op, "count": r.count, "dtype": r.dtype,
                    "reduce": r.reduce, "in_place": r.in_place, "path": r.path,
                    "kernel": r.kernel, "stream": r.stream, "state": r.state,
                    "bytes": r.count * dtype_bytes(&r.dtype),
                });
                if let Some(a) = super::arrival(dumps, r.seq) {
                    let last_start = dumps
                        .iter()
                        .find(|x| x.header.rank == a.rank)
                        .and_then(|x| x.recs.get(&r.seq)?.start_ns)
                        .unwrap_or(start);
                    args["last_rank"] = json!(a.rank);
                    if a.rank == rank {
                        args["late_us"] = json!(a.after_us);
                    } else {
                        let waited = last_start.saturating_sub(start) as f64 / 1e3;
                        args["waited_us"] = json!(waited);
                        if waited > 0.0 {
                            events.push(instant(
                                pid,
                                HOST_TID,
                                ts(last_start),
                                format!("wait: rank {} arrived", a.rank),
                                json!({"seq": r.seq, "waited_us": waited}),
                            ));
                        }
                    }
                }
                events.push(json!({
                    "name": name(r), "cat": "call", "ph": "X", "ts": ts(start),
                    "dur": (end - start) as f64 / 1e3, "pid": pid, "tid": HOST_TID, "args": args,
                }));
                let bytes = r.count * dtype_bytes(&r.dtype);
                events.extend(super::phases::events(pid, r, bytes, &ts, &mut blocks_named));
                if r.state != "ok" {
                    let error = match (&d.header.error, error_told) {
                        (Some(e), false) => e.clone(),
                        _ => format!("{} #{} {}", r.op, r.seq, r.state),
                    };
                    error_told = true;
                    let what = if r.state == "running" {
                        "inside when the record was written"
                    } else {
                        "error"
                    };
                    events.push(instant(
                        pid,
                        HOST_TID,
                        ts(end),
                        format!("{what}: {} #{}", r.op, r.seq),
                        json!({"seq": r.seq, "error": error}),
                    ));
                }
                if let (Some(b), Some(e)) = (r.dev_start_ns, r.dev_end_ns) {
                    if !device_named {
                        device_named = true;
                        events.push(meta(
                            pid,
                            Some(DEVICE_TID),
                            "thread_name",
                            json!({"name": "device (stream order)"}),
                        ));
                    }
                    events.push(json!({
                        "name": name(r), "cat": "device", "ph": "X", "ts": ts(b),
                        "dur": e.saturating_sub(b) as f64 / 1e3, "pid": pid, "tid": DEVICE_TID,
                        "args": {"seq": r.seq, "queued_us": b.saturating_sub(start) as f64 / 1e3},
                    }));
                }
            }
            if let Some(dv) = &divergence {
                divergence_marks(&mut events, dv, d, pid, &ts);
            }
        }
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {"ipcreduce_trace": 1, "jobs": other},
    })
}

/// On a rank that made the diverging call differently, or never made it: an instant at its
/// record of that call (or after its last call) saying how.
fn divergence_marks(
    events: &mut Vec<Value>,
    dv: &super::Divergence,
    d: &Dump,
    pid: usize,
    ts: &dyn Fn(u64) -> f64,
) {
    let rank = d.header.rank;
    let args = json!({"seq": dv.seq, "kind": dv.kind, "expected": dv.call.describe()});
    if let Some(x) = dv.different.iter().find(|x| x.rank == rank) {
        if let Some(t) = d.recs.get(&dv.seq).and_then(|r| r.start_ns) {
            events.push(instant(
                pid,
                HOST_TID,
                ts(t),
                format!("mismatch at #{}: {}", dv.seq, x.detail),
                args,
            ));
        }
    } else if dv.never_made.iter().any(|x| x.rank == rank) {
        if let Some(t) = d
            .recs
            .values()
            .next_back()
            .and_then(|r| r.end_ns.or(r.start_ns))
        {
            events.push(instant(
                pid,
                HOST_TID,
                ts(t),
                format!("never made #{}", dv.seq),
                args,
            ));
        }
    }
}
