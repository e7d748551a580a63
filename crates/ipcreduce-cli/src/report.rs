//! `ipcreduce report RESULTS.json [more.json]`: the goals table of the bandwidth work
//! (BENCHMARKS.md) as Markdown, computed from the JSON that `bench` and `overlap` write, so
//! the figures in the document come from the run and are never copied by hand.
//!
//! Goals (two GPUs, sum, same run as NCCL, eager and graph, registered buffers unless said):
//! - up to 64 KiB: graph at most 2.5 us and eager at most 5 us;
//! - 256 KiB - 2 MiB: 2x NCCL; 8 - 32 MiB: 1.5x NCCL; from 128 MiB: 370 GB/s bus bandwidth;
//! - plain buffers never slower than NCCL; at most 16 CTAs from 32 MiB;
//! - `auto` within 5% of the best path; the training step 1.25x faster than NCCL's.
//!
//! Host-backend JSON (`meta.backend` = "host") has the goals of the comparison with OpenMPI
//! (BENCHMARKS.md, `scripts/host/mpi-compare.sh`), judged against MPI's CSV given beside it
//! (`bytes,us,algbw,busbw,wrong` per line): at two ranks no slower than MPI up to 4 KiB and
//! 1.5x MPI's bus bandwidth from 512 KiB to 8 MiB; at more ranks no slower than MPI from
//! 512 KiB to 8 MiB.

use serde_json::Value;
use std::collections::BTreeSet;
use std::fmt::Write;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct ReportArgs {
    /// JSON files of `bench` (any number, e.g. one per dtype or size range) and of `overlap`;
    /// for host-backend runs, MPI's CSV of the same sizes (`scripts/host/mpi-compare.sh`).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// One bench row, as much as the report needs.
#[derive(Debug, Clone)]
struct Row {
    algo: String,
    mode: String,
    registered: bool,
    dtype: String,
    op: String,
    bytes: u64,
    time_us: f64,
    busbw: f64,
    path: Option<String>,
    ctas: Option<u64>,
    wrong: u64,
}

fn bench_row(v: &Value) -> Option<Row> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    Some(Row {
        algo: s("algo")?,
        mode: s("mode").unwrap_or_else(|| "eager".into()),
        registered: v
            .get("registered")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        dtype: s("dtype")?,
        op: s("op").unwrap_or_else(|| "sum".into()),
        bytes: v.get("bytes")?.as_u64()?,
        time_us: v.get("time_us")?.as_f64()?,
        busbw: v.get("busbw_gbps")?.as_f64()?,
        path: s("path").or_else(|| s("ran")),
        ctas: v.get("ctas").and_then(Value::as_u64),
        wrong: v.get("wrong").and_then(Value::as_u64).unwrap_or(0),
    })
}

/// The goal of a message size, if the issue sets one for it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Goal {
    Latency { graph_us: f64, eager_us: f64 },
    Ratio(f64),
    Busbw(f64),
}

fn goal_of(bytes: u64) -> Option<Goal> {
    match bytes {
        b if b <= 64 * KIB => Some(Goal::Latency {
            graph_us: 2.5,
            eager_us: 5.0,
        }),
        b if (256 * KIB..=2 * MIB).contains(&b) => Some(Goal::Ratio(2.0)),
        b if (8 * MIB..=32 * MIB).contains(&b) => Some(Goal::Ratio(1.5)),
        b if b >= 128 * MIB => Some(Goal::Busbw(370.0)),
        _ => None,
    }
}

fn goal_text(g: Option<Goal>) -> String {
    match g {
        Some(Goal::Latency { graph_us, eager_us }) => {
            format!("graph <= {graph_us} us, eager <= {eager_us} us")
        }
        Some(Goal::Ratio(r)) => format!(">= {r}x NCCL"),
        Some(Goal::Busbw(b)) => format!(">= {b} GB/s busbw"),
        None => "-".into(),
    }
}

pub fn size_text(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b >> 20),
        b if b >= KIB && b % KIB == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// The rows of one (dtype, op), and lookups in them.
struct Sweep<'a> {
    rows: Vec<&'a Row>,
}

impl<'a> Sweep<'a> {
    fn get(&self, algo: &str, mode: &str, registered: bool, bytes: u64) -> Option<&'a Row> {
        self.rows.iter().copied().find(|r| {
            r.algo == algo && r.mode == mode && r.registered == registered && r.bytes == bytes
        })
    }

    /// The fastest ipcreduce algorithm other than auto (same mode and registration).
    fn best(&self, mode: &str, registered: bool, bytes: u64) -> Option<&'a Row> {
        self.rows
            .iter()
            .copied()
            .filter(|r| {
                r.algo != "nccl"
                    && r.algo != "auto"
                    && r.mode == mode
                    && r.registered == registered
                    && r.bytes == bytes
            })
            .min_by(|a, b| a.time_us.total_cmp(&b.time_us))
    }
}

fn pair(a: Option<f64>, b: Option<f64>, digits: usize) -> String {
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.digits$}"));
    format!("{} / {}", f(a), f(b))
}

fn verdict(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "met",
        Some(false) => "**missed**",
        None => "-",
    }
}

/// Whether the goal holds for our (eager, graph) rows against NCCL's.
fn judge(goal: Option<Goal>, ours: [Option<&Row>; 2], nccl: [Option<&Row>; 2]) -> Option<bool> {
    let goal = goal?;
    let ratio = |i: usize| Some(nccl[i]?.time_us / ours[i]?.time_us);
    match goal {
        Goal::Latency { graph_us, eager_us } => {
            Some(ours[0]?.time_us <= eager_us && ours[1]?.time_us <= graph_us)
        }
        Goal::Ratio(want) => {
            let got: Vec<f64> = (0..2).filter_map(ratio).collect();
            (!got.is_empty()).then(|| got.iter().all(|r| *r >= want))
        }
        Goal::Busbw(want) => {
            let got: Vec<f64> = ours.iter().flatten().map(|r| r.busbw).collect();
            (!got.is_empty()).then(|| got.iter().all(|b| *b >= want))
        }
    }
}

/// The Markdown report of every (dtype, op) in the bench rows, then the training loop.
pub fn render(benches: &[Value], overlaps: &[Value], mpi: &[MpiRow]) -> String {
    let rows: Vec<Row> = benches
        .iter()
        .filter_map(|d| d.get("rows").and_then(Value::as_array))
        .flatten()
        .filter_map(bench_row)
        .collect();
    let mut out = String::new();
    let host = benches
        .first()
        .is_some_and(|d| d["meta"]["backend"].as_str() == Some("host"));
    if let Some(meta) = benches.first().map(|d| &d["meta"]) {
        let field = |k: &str| meta[k].as_str().unwrap_or("not recorded").to_string();
        let device = meta["devices"]
            .get(0)
            .and_then(Value::as_str)
            .unwrap_or("not recorded");
        // The host backend has no driver and no NCCL: nothing to say about them.
        let gpu = if host {
            String::new()
        } else {
            format!(
                ", driver {}, NCCL {}",
                field("driver"),
                field("nccl_version")
            )
        };
        let _ = writeln!(
            out,
            "Run: {device} (world {}){gpu}, commit `{}`, {}.\n",
            meta["world"],
            field("commit"),
            field("date"),
        );
    }
    let kinds: BTreeSet<(String, String)> = rows
        .iter()
        .map(|r| (r.dtype.clone(), r.op.clone()))
        .collect();
    for (dtype, op) in kinds {
        let sweep = Sweep {
            rows: rows
                .iter()
                .filter(|r| r.dtype == dtype && r.op == op)
                .collect(),
        };
        if host {
            let world = benches[0]["meta"]["world"].as_u64().unwrap_or(0);
            render_host_sweep(&mut out, &dtype, &op, world, &sweep, mpi);
        } else {
            render_sweep(&mut out, &dtype, &op, &sweep);
        }
    }
    if !overlaps.is_empty() {
        render_overlap(&mut out, overlaps);
    }
    out
}

fn render_sweep(out: &mut String, dtype: &str, op: &str, sweep: &Sweep) {
    let registered = sweep.rows.iter().any(|r| r.registered);
    let sizes: BTreeSet<u64> = sweep.rows.iter().map(|r| r.bytes).collect();
    let buffers = if registered {
        "registered"
    } else {
        "plain (no registered rows)"
    };
    let _ = writeln!(
        out,
        "### {dtype} {op}, ipcreduce `auto` on {buffers} buffers\n"
    );
    let _ = writeln!(
        out,
        "| size | goal | ipcreduce eager / graph (us) | NCCL eager / graph (us) | ratio eager / graph | busbw eager / graph (GB/s) | path, CTAs | auto vs best | plain: ratio eager / graph | met |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|");
    let modes = ["eager", "graph"];
    let mut plain_worst: Option<(f64, u64, &str)> = None;
    let mut auto_worst: Option<(f64, u64, &str, bool)> = None;
    let mut big_ctas: Option<u64> = None;
    let mut big_seen = false;
    let mut wrong = 0;
    for &bytes in &sizes {
        let ours = modes.map(|m| sweep.get("auto", m, registered, bytes));
        let plain = modes.map(|m| sweep.get("auto", m, false, bytes));
        let nccl = modes.map(|m| sweep.get("nccl", m, false, bytes));
        let ratio = |o: [Option<&Row>; 2], i: usize| Some(nccl[i]?.time_us / o[i]?.time_us);
        for (i, m) in modes.iter().enumerate() {
            if let Some(r) = ratio(plain, i) {
                if plain_worst.is_none_or(|w| r < w.0) {
                    plain_worst = Some((r, bytes, m));
                }
            }
            for reg in [false, true] {
                let (Some(a), Some(b)) =
                    (sweep.get("auto", m, reg, bytes), sweep.best(m, reg, bytes))
                else {
                    continue;
                };
                let over = a.time_us / b.time_us;
                if auto_worst.is_none_or(|w| over > w.0) {
                    auto_worst = Some((over, bytes, m, reg));
                }
            }
        }
        if bytes >= 32 * MIB {
            big_seen = true;
            for r in ours.iter().chain(plain.iter()).flatten() {
                if let Some(c) = r.ctas {
                    big_ctas = Some(big_ctas.map_or(c, |b| b.max(c)));
                }
            }
        }
        wrong += sweep
            .rows
            .iter()
            .filter(|r| r.bytes == bytes)
            .map(|r| r.wrong)
            .sum::<u64>();
        let shown = ours[1].or(ours[0]);
        let path = shown.map_or("-".to_string(), |r| {
            let ctas = r.ctas.map_or("?".to_string(), |c| c.to_string());
            format!("{}, {ctas}", r.path.as_deref().unwrap_or("?"))
        });
        let vs_best = {
            let m = if ours[1].is_some() { "graph" } else { "eager" };
            match (
                sweep.get("auto", m, registered, bytes),
                sweep.best(m, registered, bytes),
            ) {
                (Some(a), Some(b)) => format!("{:+.0}%", (a.time_us / b.time_us - 1.0) * 100.0),
                _ => "-".into(),
            }
        };
        let goal = goal_of(bytes);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            size_text(bytes),
            goal_text(goal),
            pair(ours[0].map(|r| r.time_us), ours[1].map(|r| r.time_us), 2),
            pair(nccl[0].map(|r| r.time_us), nccl[1].map(|r| r.time_us), 2),
            pair(ratio(ours, 0), ratio(ours, 1), 2),
            pair(ours[0].map(|r| r.busbw), ours[1].map(|r| r.busbw), 1),
            path,
            vs_best,
            pair(ratio(plain, 0), ratio(plain, 1), 2),
            verdict(judge(goal, ours, nccl)),
        );
    }
    let _ = writeln!(out);
    let line = match plain_worst {
        Some((r, b, m)) => format!(
            "{}: worst ratio {r:.2} at {} ({m})",
            verdict(Some(r >= 1.0)),
            size_text(b)
        ),
        None => "- (no NCCL rows)".into(),
    };
    let _ = writeln!(out, "- Plain buffers never slower than NCCL: {line}.");
    let line = match (big_seen, big_ctas) {
        (false, _) => "- (no size of 32 MiB or more)".into(),
        (true, None) => "- (the rows do not say how many CTAs ran)".into(),
        (true, Some(c)) => format!("{}: at most {c} CTAs", verdict(Some(c <= 16))),
    };
    let _ = writeln!(out, "- At most 16 CTAs from 32 MiB: {line}.");
    let line = match auto_worst {
        Some((o, b, m, reg)) => format!(
            "{}: worst {:+.1}% at {} ({m}, {})",
            verdict(Some(o <= 1.05)),
            (o - 1.0) * 100.0,
            size_text(b),
            if reg { "registered" } else { "plain" }
        ),
        None => "- (no other algorithm measured)".into(),
    };
    let _ = writeln!(out, "- `auto` within 5% of the best path: {line}.");
    let _ = writeln!(out, "- Wrong elements in these rows: {wrong}.\n");
}

/// One line of MPI's CSV (`bench/mpi/mpi_allreduce.c`): bytes, us, algbw, busbw, wrong.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MpiRow {
    pub bytes: u64,
    pub time_us: f64,
    pub busbw: f64,
    pub wrong: u64,
}

/// Parses MPI's CSV; the error names the line.
pub fn parse_mpi_csv(text: &str) -> Result<Vec<MpiRow>, String> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let bad = || {
            format!(
                "line {}: expected bytes,us,algbw,busbw,wrong: {line:?}",
                i + 1
            )
        };
        let [bytes, us, _, busbw, wrong] = f[..] else {
            return Err(bad());
        };
        rows.push(MpiRow {
            bytes: bytes.parse().map_err(|_| bad())?,
            time_us: us.parse().map_err(|_| bad())?,
            busbw: busbw.parse().map_err(|_| bad())?,
            wrong: wrong.parse().map_err(|_| bad())?,
        });
    }
    Ok(rows)
}

/// A host goal against MPI at a size: the least speed-up (MPI time / ours) or busbw ratio.
#[derive(Debug, Clone, Copy, PartialEq)]
enum HostGoal {
    /// ipcreduce's time at most MPI's.
    NoSlower,
    /// ipcreduce's bus bandwidth at least this many times MPI's.
    Busbw(f64),
}

fn host_goal_of(world: u64, bytes: u64) -> Option<HostGoal> {
    match (world, bytes) {
        (2, b) if b <= 4 * KIB => Some(HostGoal::NoSlower),
        (2, b) if (512 * KIB..=8 * MIB).contains(&b) => Some(HostGoal::Busbw(1.5)),
        (w, b) if w > 2 && (512 * KIB..=8 * MIB).contains(&b) => Some(HostGoal::NoSlower),
        _ => None,
    }
}

/// The host backend's sweep against MPI's figures of the same sizes.
fn render_host_sweep(
    out: &mut String,
    dtype: &str,
    op: &str,
    world: u64,
    sweep: &Sweep,
    mpi: &[MpiRow],
) {
    let _ = writeln!(
        out,
        "### {dtype} {op}, host backend `auto` against OpenMPI, world {world}\n"
    );
    let _ = writeln!(
        out,
        "| size | goal | ipcreduce (us) | MPI (us) | speed-up | busbw ipcreduce / MPI (GB/s) | met |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|");
    let sizes: BTreeSet<u64> = sweep.rows.iter().map(|r| r.bytes).collect();
    let mut wrong = 0;
    for &bytes in &sizes {
        let ours = sweep.get("auto", "eager", false, bytes);
        let theirs = mpi.iter().find(|m| m.bytes == bytes);
        wrong += sweep
            .rows
            .iter()
            .filter(|r| r.bytes == bytes)
            .map(|r| r.wrong)
            .sum::<u64>();
        let goal = host_goal_of(world, bytes);
        let met = match (goal, ours, theirs) {
            (Some(HostGoal::NoSlower), Some(o), Some(m)) => Some(o.time_us <= m.time_us),
            (Some(HostGoal::Busbw(x)), Some(o), Some(m)) => Some(o.busbw >= x * m.busbw),
            _ => None,
        };
        let goal_text = match goal {
            Some(HostGoal::NoSlower) => "no slower than MPI".to_string(),
            Some(HostGoal::Busbw(x)) => format!(">= {x}x MPI's busbw"),
            None => "-".into(),
        };
        let f2 = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        let speed = match (ours, theirs) {
            (Some(o), Some(m)) => format!("{:.2}x", m.time_us / o.time_us),
            _ => "-".into(),
        };
        let _ = writeln!(
            out,
            "| {} | {goal_text} | {} | {} | {speed} | {} | {} |",
            size_text(bytes),
            f2(ours.map(|r| r.time_us)),
            f2(theirs.map(|m| m.time_us)),
            pair(ours.map(|r| r.busbw), theirs.map(|m| m.busbw), 2),
            verdict(met),
        );
    }
    let _ = writeln!(out);
    if mpi.is_empty() {
        let _ = writeln!(
            out,
            "- No MPI figures given: pass MPI's CSV of the same run (`scripts/host/mpi-compare.sh`) \
             beside the JSON to judge the goals."
        );
    } else {
        let mpi_wrong: u64 = mpi.iter().map(|m| m.wrong).sum();
        let _ = writeln!(out, "- Wrong elements in MPI's rows: {mpi_wrong}.");
    }
    let _ = writeln!(out, "- Wrong elements in these rows: {wrong}.\n");
}

fn render_overlap(out: &mut String, docs: &[Value]) {
    let _ = writeln!(out, "### Training loop (`overlap`)\n");
    let _ = writeln!(
        out,
        "| configuration | algo | step mean / median (ms) | compute alone (ms) | exposed communication (ms) | NCCL / ipcreduce | goal | met | wrong |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|");
    for d in docs {
        let args = &d["meta"]["args"];
        let config = format!(
            "{} MiB in {} MiB buckets, compute {} us",
            args["grad_bytes"].as_u64().unwrap_or(0) >> 20,
            args["bucket_bytes"].as_u64().unwrap_or(0) >> 20,
            args["compute_us"]
        );
        let ratio = d["nccl_over_ipcreduce_mean"].as_f64();
        // The compute-only steps of the same run; older files have only the calibration.
        let compute = d["compute_only_ms"]["mean"]
            .as_f64()
            .or_else(|| d["calibration"]["compute_step_ms"].as_f64());
        for r in d["rows"].as_array().into_iter().flatten() {
            let f = |k: &str| r["step_ms"][k].as_f64().unwrap_or(f64::NAN);
            let nccl = r["algo"] == "nccl";
            let exposed = r["exposed_ms"]
                .as_f64()
                .or_else(|| compute.map(|c| f("mean") - c));
            let _ = writeln!(
                out,
                "| {config} | {} | {:.3} / {:.3} | {} | {} | {} | {} | {} | {} |",
                r["algo"].as_str().unwrap_or("?"),
                f("mean"),
                f("median"),
                compute.map_or("-".into(), |c| format!("{c:.3}")),
                exposed.map_or("-".into(), |e| format!("{e:.3}")),
                if nccl {
                    "-".into()
                } else {
                    ratio.map_or("-".into(), |r| format!("{r:.2}"))
                },
                if nccl { "-" } else { ">= 1.25" },
                if nccl {
                    "-"
                } else {
                    verdict(ratio.map(|r| r >= 1.25))
                },
                r["wrong"],
            );
        }
    }
    let _ = writeln!(out);
}

pub fn run(args: ReportArgs) -> i32 {
    let mut benches = Vec::new();
    let mut overlaps = Vec::new();
    let mut mpi = Vec::new();
    for p in &args.inputs {
        if p.extension().is_some_and(|e| e == "csv") {
            match std::fs::read_to_string(p)
                .map_err(|e| e.to_string())
                .and_then(|t| parse_mpi_csv(&t))
            {
                Ok(rows) => mpi.extend(rows),
                Err(e) => {
                    eprintln!("error: {}: {e}", p.display());
                    return 1;
                }
            }
            continue;
        }
        let doc = std::fs::read_to_string(p)
            .map_err(|e| format!("reading {}: {e}", p.display()))
            .and_then(|t| {
                serde_json::from_str::<Value>(&t)
                    .map_err(|e| format!("parsing {}: {e}", p.display()))
            });
        match doc {
            Ok(d) if d.get("nccl_over_ipcreduce_mean").is_some() => overlaps.push(d),
            Ok(d) if d.get("rows").is_some() => benches.push(d),
            Ok(_) => {
                eprintln!(
                    "error: {}: neither a bench nor an overlap JSON",
                    p.display()
                );
                return 1;
            }
            Err(e) => {
                eprintln!("error: {e}");
                return 1;
            }
        }
    }
    print!("{}", render(&benches, &overlaps, &mpi));
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(algo: &str, mode: &str, reg: bool, bytes: u64, t: f64, ctas: Option<u64>) -> Value {
        serde_json::json!({
            "algo": algo, "mode": mode, "registered": reg, "dtype": "bf16", "op": "sum",
            "bytes": bytes, "time_us": t, "busbw_gbps": bytes as f64 / t / 1e3,
            "path": algo, "ctas": ctas, "wrong": 0,
        })
    }

    fn bench() -> Value {
        let mut rows = Vec::new();
        for (bytes, ours, nccl) in [
            (8u64, 2.0, 6.0),
            (512 * KIB, 8.0, 10.0),
            (128 * MIB, 300.0, 400.0),
        ] {
            for mode in ["eager", "graph"] {
                let extra = if mode == "eager" { 2.0 } else { 0.0 };
                rows.push(row("auto", mode, true, bytes, ours + extra, Some(8)));
                rows.push(row(
                    "twoshot",
                    mode,
                    true,
                    bytes,
                    ours + extra - 0.5,
                    Some(8),
                ));
                rows.push(row(
                    "auto",
                    mode,
                    false,
                    bytes,
                    nccl * 0.9 + extra,
                    Some(32),
                ));
                rows.push(row("nccl", mode, false, bytes, nccl + extra, None));
            }
        }
        serde_json::json!({"meta": {"world": 2, "devices": ["NVIDIA H200 (GPU 0)"],
            "driver": "580", "nccl_version": "2.28.3", "commit": "abc", "date": "d"},
            "rows": rows})
    }

    #[test]
    fn goals_are_computed_from_the_rows() {
        let md = render(&[bench()], &[], &[]);
        let line = |prefix: &str| {
            md.lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no line {prefix}:\n{md}"))
                .to_string()
        };
        // 8 B: eager 4 us <= 5, graph 2 us <= 2.5: met; ratio 8/4 and 6/2.
        let small = line("| 8 B |");
        assert!(small.contains("| 4.00 / 2.00 |"), "{small}");
        assert!(small.contains("| 2.00 / 3.00 |"), "{small}");
        assert!(small.ends_with("| met |"), "{small}");
        // 512 KiB: ratio 12/10 and 10/8 < 2: missed.
        let mid = line("| 512 KiB |");
        assert!(mid.contains(">= 2x NCCL"), "{mid}");
        assert!(mid.ends_with("| **missed** |"), "{mid}");
        // auto is 0.5 us slower than two-shot: +6% in graph mode at 512 KiB.
        assert!(mid.contains("| +7% |") || mid.contains("| +6% |"), "{mid}");
        // 128 MiB at 300 us is 447 GB/s busbw at world 2... busbw in the rows is algbw here:
        // 134217728 / 300 / 1e3 = 447 >= 370 in graph, 443 in eager: met.
        let big = line("| 128 MiB |");
        assert!(big.ends_with("| met |"), "{big}");
        assert!(big.contains("| auto, 8 |"), "{big}");
        // Plain buffers at 0.9x NCCL's time are faster: met. CTAs at 128 MiB: 32 > 16.
        assert!(
            md.contains("- Plain buffers never slower than NCCL: met"),
            "{md}"
        );
        assert!(
            md.contains("At most 16 CTAs from 32 MiB: **missed**: at most 32 CTAs"),
            "{md}"
        );
        assert!(
            md.contains("within 5% of the best path: **missed**"),
            "{md}"
        );
        assert!(md.contains("Wrong elements in these rows: 0."), "{md}");
        assert!(md.starts_with("Run: NVIDIA H200 (GPU 0) (world 2), driver 580, NCCL 2.28.3"));
    }

    #[test]
    fn training_loop_rows_and_ratio() {
        let ov = serde_json::json!({
            "meta": {"args": {"grad_bytes": 1u64 << 30, "bucket_bytes": 25u64 << 20, "compute_us": 2000}},
            "calibration": {"compute_step_ms": 2.5},
            "compute_only_ms": {"mean": 2.0},
            "rows": [
                {"algo": "auto", "step_ms": {"mean": 4.0, "median": 3.9}, "wrong": 0},
                {"algo": "nccl", "step_ms": {"mean": 5.5, "median": 5.4}, "wrong": 0}
            ],
            "nccl_over_ipcreduce_mean": 1.375
        });
        let md = render(&[], &[ov], &[]);
        let auto = md.lines().find(|l| l.contains("| auto |")).unwrap();
        assert!(
            auto.contains("1024 MiB in 25 MiB buckets, compute 2000 us"),
            "{auto}"
        );
        assert!(
            auto.contains("| 4.000 / 3.900 | 2.000 | 2.000 | 1.38 | >= 1.25 | met | 0 |"),
            "{auto}"
        );
        let nccl = md.lines().find(|l| l.contains("| nccl |")).unwrap();
        assert!(nccl.contains("| 3.500 |"), "{nccl}");
    }

    #[test]
    fn sizes_and_goals() {
        assert_eq!(size_text(8), "8 B");
        assert_eq!(size_text(64 * KIB), "64 KiB");
        assert_eq!(size_text(1 << 30), "1 GiB");
        assert_eq!(goal_of(128 * KIB), None);
        assert_eq!(goal_of(2 * MIB), Some(Goal::Ratio(2.0)));
        assert_eq!(goal_of(8 * MIB), Some(Goal::Ratio(1.5)));
        assert_eq!(goal_of(1 << 30), Some(Goal::Busbw(370.0)));
    }

    #[test]
    fn host_runs_get_the_mpi_goals_and_no_gpu_fields() {
        let rows: Vec<Value> = [(8u64, 0.4, 1.0), (1024, 1.0, 0.8), (2 * MIB, 400.0, 0.0)]
            .iter()
            .map(|&(bytes, t, _)| {
                let mut r = row("auto", "eager", false, bytes, t, None);
                r["dtype"] = "f32".into();
                r
            })
            .collect();
        let doc = serde_json::json!({"meta": {"backend": "host", "world": 2,
            "devices": ["host: 2 cores"], "driver": null, "nccl_version": null,
            "commit": "abc", "date": "d"}, "rows": rows});
        // MPI: 8 B slower than ours (met), 1 KiB faster (missed); 2 MiB busbw 2x ours' 1/1.5.
        let ours_2m = (2 * MIB) as f64 / 400.0 / 1e3;
        let mpi = parse_mpi_csv(&format!(
            "8,0.9,0,0.01,0\n1024,0.5,0,2.0,0\n{},600,0,{},0\n",
            2 * MIB,
            ours_2m / 1.6
        ))
        .unwrap();
        let md = render(std::slice::from_ref(&doc), &[], &mpi);
        assert!(
            md.starts_with("Run: host: 2 cores (world 2), commit `abc`, d."),
            "{md}"
        );
        assert!(
            !md.contains('?') && !md.contains("NCCL") && !md.contains("graph"),
            "{md}"
        );
        let line = |p: &str| md.lines().find(|l| l.starts_with(p)).unwrap().to_string();
        let small = line("| 8 B |");
        assert!(
            small.contains("| no slower than MPI | 0.40 | 0.90 | 2.25x |"),
            "{small}"
        );
        assert!(small.ends_with("| met |"), "{small}");
        assert!(line("| 1 KiB |").ends_with("| **missed** |"), "{md}");
        let big = line("| 2 MiB |");
        assert!(
            big.contains(">= 1.5x MPI's busbw") && big.ends_with("| met |"),
            "{big}"
        );
        // Without MPI's figures nothing is judged, and the report says what to pass.
        let md = render(&[doc], &[], &[]);
        assert!(md.contains("No MPI figures given"), "{md}");
        let judged = md
            .lines()
            .filter(|l| l.starts_with("| ") && !l.starts_with("| size"));
        assert!(
            judged.clone().count() == 3 && judged.clone().all(|l| l.ends_with("| - |")),
            "{md}"
        );
        assert!(parse_mpi_csv("8,1,2\n").unwrap_err().contains("line 1"));
    }
}
