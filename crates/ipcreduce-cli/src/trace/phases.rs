//! The kernels' phase stamps in a trace (cuda, `IPCREDUCE_TRACE`: each call's `phases` field,
//! see `ipcreduce::flight::stamps`): per block of a call, when it started, first saw each
//! peer, finished its reduction and its gather, and ended, on the rank's host clock.
//!
//! A block's time is cut into phases: "wait for peer p" from its start to when it first saw p
//! (its first barrier with p, or p's first LL line), "reduce" from the last of those to its
//! reduce stamp, "gather" from there to its gather stamp (two-shot staged), and "finish" from
//! its last stamp to its end (the closing barrier, the call counter). A rank's wait for a peer
//! is measured on the rank's own clock from its own start, so ranks need no common clock.

use super::records::{Block, Dump, Rec};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// One block's phases: (name, begin ns, end ns), in time order of their ends.
pub(super) fn spans(b: &Block) -> Vec<(String, u64, u64)> {
    let Some(start) = b.start_ns else {
        return Vec::new();
    };
    let mut out: Vec<(String, u64, u64)> = b
        .peers
        .iter()
        .map(|&(p, t)| (format!("wait for peer {p}"), start, t.max(start)))
        .collect();
    let mut last = out.iter().map(|s| s.2).max().unwrap_or(start);
    for (name, at) in [("reduce", b.reduce_ns), ("gather", b.gather_ns)] {
        if let Some(t) = at {
            out.push((name.to_string(), last, t.max(last)));
            last = t.max(last);
        }
    }
    if let Some(e) = b.end_ns {
        if e > last {
            out.push(("finish".to_string(), last, e));
        }
    }
    out
}

/// Chrome trace events of call `r`'s stamps on rank process `pid`: one track per block
/// (`tid` from `BLOCK_TID`, named once per rank in `named`), an `X` event per phase.
pub(super) fn events(
    pid: usize,
    r: &Rec,
    bytes: u64,
    ts: &dyn Fn(u64) -> f64,
    named: &mut std::collections::BTreeSet<usize>,
) -> Vec<Value> {
    const BLOCK_TID: usize = 100;
    let mut out = Vec::new();
    let Some(p) = &r.phases else { return out };
    for b in &p.blocks {
        let tid = BLOCK_TID + b.block;
        if named.insert(b.block) {
            out.push(
                json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                            "args": {"name": format!("block {}", b.block)}}),
            );
            out.push(
                json!({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                            "args": {"sort_index": tid}}),
            );
        }
        for (name, begin, end) in spans(b) {
            out.push(json!({
                "name": name, "cat": "phase", "ph": "X", "ts": ts(begin),
                "dur": (end - begin) as f64 / 1e3, "pid": pid, "tid": tid,
                "args": {"seq": r.seq, "kseq": p.kseq, "path": r.path, "kernel": r.kernel,
                         "bytes": bytes, "block": b.block, "tick_ns": p.tick_ns},
            }));
        }
    }
    out
}

/// Per path: calls with stamps and the median of each phase (us; a call's phase is the
/// longest of its blocks', "wait for peer p" folded into "wait for peers").
#[derive(Debug, Serialize, PartialEq)]
pub(super) struct PathPhases {
    pub path: String,
    pub calls: usize,
    pub median_us: BTreeMap<String, f64>,
}

/// One call's wait per peer on every rank that stamped it (us, the longest over its blocks),
/// and the longest of them.
#[derive(Debug, Serialize, PartialEq)]
pub(super) struct CallWaits {
    pub seq: u64,
    pub path: Option<String>,
    /// (rank, [(peer, us)]).
    pub waits: Vec<(usize, Vec<(usize, f64)>)>,
    /// (rank, peer, us): the longest wait of the call.
    pub longest: Option<(usize, usize, f64)>,
}

#[derive(Debug, Serialize, PartialEq)]
pub(super) struct Summary {
    pub paths: Vec<PathPhases>,
    pub calls: Vec<CallWaits>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The phase summary of one job's records over calls `first..=last` (None: no stamps).
pub(super) fn summary(dumps: &[Dump], first: u64, last: u64) -> Option<Summary> {
    let mut per_path: BTreeMap<String, (usize, BTreeMap<String, Vec<f64>>)> = BTreeMap::new();
    let mut calls = Vec::new();
    for seq in first..=last {
        let mut waits = Vec::new();
        let mut path = None;
        for d in dumps {
            let Some(r) = d.recs.get(&seq) else { continue };
            let Some(p) = &r.phases else { continue };
            // By the kernel path where the record names one (the cuda all-reduce: `oneshot-ll`,
            // `twoshot-reg`, `ce`, whose rows are barriers and chunks, not thread blocks), else
            // by its path; records that name neither (the host backend's reduce-scatter and
            // all-gather, or files of older versions) under their operation's name.
            let key = r
                .kernel
                .clone()
                .or_else(|| r.path.clone())
                .unwrap_or_else(|| r.op.clone());
            path = path.or(Some(key.clone()));
            let entry = per_path.entry(key).or_default();
            entry.0 += 1;
            let mut longest: BTreeMap<String, f64> = BTreeMap::new();
            let mut peer_wait: BTreeMap<usize, f64> = BTreeMap::new();
            for b in &p.blocks {
                for (name, begin, end) in spans(b) {
                    let us = (end - begin) as f64 / 1e3;
                    let name = if name.starts_with("wait for peer") {
                        "wait for peers".to_string()
                    } else {
                        name
                    };
                    let e = longest.entry(name).or_insert(0.0);
                    *e = e.max(us);
                }
                if let Some(s) = b.start_ns {
                    for &(peer, t) in &b.peers {
                        let e = peer_wait.entry(peer).or_insert(0.0);
                        *e = e.max(t.saturating_sub(s) as f64 / 1e3);
                    }
                }
            }
            for (name, us) in longest {
                entry.1.entry(name).or_default().push(us);
            }
            waits.push((d.header.rank, peer_wait.into_iter().collect::<Vec<_>>()));
        }
        if waits.is_empty() {
            continue;
        }
        let longest = waits
            .iter()
            .flat_map(|(r, w)| w.iter().map(move |&(p, us)| (*r, p, us)))
            .max_by(|a, b| a.2.total_cmp(&b.2));
        calls.push(CallWaits {
            seq,
            path,
            waits,
            longest,
        });
    }
    if calls.is_empty() {
        return None;
    }
    let paths = per_path
        .into_iter()
        .map(|(path, (n, phases))| PathPhases {
            path,
            calls: n,
            median_us: phases.into_iter().map(|(k, v)| (k, median(v))).collect(),
        })
        .collect();
    Some(Summary { paths, calls })
}

/// Calls listed one per line in the text (the JSON has every call).
const CALLS_SHOWN: usize = 16;

/// The summary as text: a line per path, then the last calls' waits.
pub(super) fn text(s: &Summary) -> String {
    use std::fmt::Write;
    let mut o = String::from("kernel phases (median of the calls' longest block, us):\n");
    for p in &s.paths {
        let parts: Vec<String> = p
            .median_us
            .iter()
            .map(|(k, v)| format!("{k} {v:.1}"))
            .collect();
        let _ = writeln!(
            o,
            "  {} ({} rank-calls): {}",
            p.path,
            p.calls,
            parts.join(", ")
        );
    }
    let skip = s.calls.len().saturating_sub(CALLS_SHOWN);
    if skip > 0 {
        let _ = writeln!(
            o,
            "wait per peer (the last {CALLS_SHOWN} calls; --json has all):"
        );
    } else {
        let _ = writeln!(o, "wait per peer:");
    }
    for c in &s.calls[skip..] {
        let ranks: Vec<String> = c
            .waits
            .iter()
            .map(|(r, w)| {
                let w: Vec<String> = w.iter().map(|(p, us)| format!("{p}:{us:.1}")).collect();
                format!("rank {r} [{}]", w.join(" "))
            })
            .collect();
        let longest = c.longest.map_or(String::new(), |(r, p, us)| {
            format!("; longest: rank {r} for rank {p}, {us:.1} us")
        });
        let _ = writeln!(
            o,
            "  #{} {}: {}{longest}",
            c.seq,
            c.path.as_deref().unwrap_or("?"),
            ranks.join(", ")
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::super::records::{made_up, Phases};
    use super::*;

    fn block(b: usize, start: u64, peers: &[(usize, u64)], reduce: u64, end: u64) -> Block {
        Block {
            block: b,
            start_ns: Some(start),
            peers: peers.to_vec(),
            reduce_ns: Some(reduce),
            gather_ns: None,
            end_ns: Some(end),
        }
    }

    /// Two ranks, two calls; in call 2 rank 0 waits 40 us for rank 1 (late), rank 1 none.
    fn dumps() -> Vec<Dump> {
        let mut out = Vec::new();
        for rank in 0..2usize {
            let peer = 1 - rank;
            let mut recs = Vec::new();
            for seq in 1..=2u64 {
                let t = seq * 1_000_000;
                let wait = if seq == 2 && rank == 0 { 40_000 } else { 2_000 };
                let mut r = made_up::rec(seq, Some(t), Some(t + 100_000), None);
                r.path = Some("oneshot_ll".into());
                r.phases = Some(Phases {
                    kseq: seq,
                    tick_ns: 32,
                    blocks: (0..2)
                        .map(|b| {
                            block(
                                b,
                                t + 1_000,
                                &[(peer, t + 1_000 + wait)],
                                t + 1_000 + wait + 3_000,
                                t + 1_000 + wait + 4_000,
                            )
                        })
                        .collect(),
                });
                recs.push(r);
            }
            out.push(made_up::dump(rank, 2, "h", recs));
        }
        out
    }

    #[test]
    fn a_block_is_cut_into_waits_reduce_and_finish() {
        let b = block(3, 100, &[(1, 150), (2, 400)], 900, 1000);
        let s = spans(&b);
        let names: Vec<&str> = s.iter().map(|x| x.0.as_str()).collect();
        assert_eq!(
            names,
            ["wait for peer 1", "wait for peer 2", "reduce", "finish"]
        );
        assert_eq!((s[1].1, s[1].2), (100, 400));
        assert_eq!((s[2].1, s[2].2), (400, 900));
        // Not started: nothing to draw.
        assert!(spans(&Block {
            start_ns: None,
            ..b
        })
        .is_empty());
    }

    #[test]
    fn the_summary_names_the_late_peer_and_the_medians_per_path() {
        let d = dumps();
        let s = summary(&d, 1, 2).expect("stamps");
        assert_eq!(s.paths.len(), 1);
        let p = &s.paths[0];
        assert_eq!((p.path.as_str(), p.calls), ("oneshot_ll", 4));
        assert_eq!(p.median_us["reduce"], 3.0);
        assert_eq!(p.median_us["wait for peers"], 2.0);
        let c2 = &s.calls[1];
        assert_eq!(c2.seq, 2);
        assert_eq!(c2.longest, Some((0, 1, 40.0)));
        let t = text(&s);
        assert!(t.contains("longest: rank 0 for rank 1, 40.0 us"), "{t}");
    }

    #[test]
    fn every_phase_is_an_x_event_on_its_block_track() {
        let d = dumps();
        let r = &d[0].recs[&2];
        let mut named = Default::default();
        let ev = events(7, r, 16, &|ns| ns as f64 / 1e3, &mut named);
        let x: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
        // Two blocks: wait, reduce, finish each.
        assert_eq!(x.len(), 6);
        assert!(x
            .iter()
            .all(|e| e["pid"] == 7 && e["args"]["seq"] == 2 && e["args"]["bytes"] == 16));
        assert_eq!(x[0]["name"], "wait for peer 1");
        assert_eq!(x[0]["dur"], 40.0);
        assert_eq!(x[0]["tid"], 100);
        assert_eq!(x[3]["tid"], 101);
        // Tracks are named once per rank.
        assert_eq!(ev.iter().filter(|e| e["name"] == "thread_name").count(), 2);
        assert!(events(7, r, 16, &|ns| ns as f64, &mut named)
            .iter()
            .all(|e| e["ph"] == "X"));
    }
}
