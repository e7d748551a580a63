//! `ipcreduce trace summarize FILES_OR_DIR...`: lines up the flight records the ranks of a job
//! wrote when a call failed (see `ipcreduce::flight` and docs/tracing.md) and says where they
//! diverged: the first call a rank never made or made differently, else the first call that
//! failed; which rank arrived last there, which ranks arrived last most often, and how long
//! each rank waited for each other (waits.rs).
//! `ipcreduce trace export` turns the same files into a Chrome / Perfetto trace (export.rs),
//! `ipcreduce trace plot` a window of them into a PNG timeline (plot.rs).

mod export;
mod phases;
mod plot;
mod records;
mod waits;

use records::{files, load, Dump, Ident, Rec};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct TraceArgs {
    #[command(subcommand)]
    pub what: TraceCmd,
}

#[derive(clap::Subcommand, Debug)]
pub enum TraceCmd {
    /// Line up the ranks' flight records (files, or directories holding them) and say where
    /// they diverged.
    Summarize {
        /// Flight-record files (ipcreduce-flight-JOB-rankR.jsonl), or directories holding them.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Print the summary as JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write the ranks' records (flight records, or traces of IPCREDUCE_TRACE) as one
    /// trace-event JSON file that Perfetto and chrome://tracing open: one track per rank.
    Export {
        /// Flight-record or trace files, or directories holding them.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// `chrome` or `perfetto`: the same trace-event JSON (Perfetto reads Chrome's format).
        #[arg(long, default_value = "chrome", value_parser = ["chrome", "perfetto"])]
        format: String,
        /// Where to write it; `-` (the default): standard output.
        #[arg(short, long, default_value = "-")]
        output: PathBuf,
    },
    /// Draw a window of one job's calls as a PNG timeline: a lane per rank, each call's host
    /// time and, where recorded, when it ran on its stream.
    Plot {
        /// Flight-record or trace files of one job, or directories holding them.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// The PNG to write.
        #[arg(short, long)]
        output: PathBuf,
        /// The calls to draw, FIRST-LAST (default: the last 16 every rank recorded).
        #[arg(long)]
        calls: Option<String>,
        /// Title above the timeline (default: the job, its world and the window).
        #[arg(long)]
        title: Option<String>,
    },
}

/// Where the records part.
#[derive(Debug, Serialize, PartialEq)]
struct Divergence {
    seq: u64,
    /// `never_made` (a rank's record ends before this call), `different` (ranks made it with
    /// other arguments), `failed` (made alike, but it did not complete on every rank), or
    /// `last` (the last call, made alike and returned everywhere: the failure came later, e.g.
    /// while it ran on a cuda stream).
    kind: &'static str,
    /// The call as most ranks made it (ties: as the lowest rank did), and those ranks.
    call: Ident,
    ranks: Vec<usize>,
    /// The ranks that made it differently, with what differs.
    different: Vec<Odd>,
    /// The ranks that never made it, with the last call they made.
    never_made: Vec<Odd>,
    /// The ranks on which it did not return Ok.
    failed_on: Vec<usize>,
    /// The ranks to look at: those that made it differently or never made it; for a call
    /// made alike that failed, the ranks that left no record (a dead rank writes none).
    culprits: Vec<usize>,
}

#[derive(Debug, Serialize, PartialEq)]
struct Odd {
    rank: usize,
    detail: String,
}

#[derive(Debug, Serialize, PartialEq)]
struct Arrival {
    seq: u64,
    rank: usize,
    first_rank: usize,
    after_us: f64,
}

#[derive(Debug, Serialize, PartialEq)]
struct Straggler {
    rank: usize,
    last_in: usize,
    mean_after_us: f64,
}

#[derive(Debug, Serialize)]
struct RankError {
    rank: usize,
    file: PathBuf,
    error: String,
}

#[derive(Debug, Serialize)]
struct JobSummary {
    job: String,
    world: usize,
    ranks: Vec<usize>,
    /// Ranks with no record: dead (no process left to write one), or never failed.
    missing: Vec<usize>,
    /// Calls every recorded rank still had in its ring.
    first_seq: u64,
    last_seq: u64,
    divergence: Option<Divergence>,
    /// Times: only when every record comes from one host (one wall clock).
    last_arrival: Option<Arrival>,
    /// The call whose last rank came latest after the first, over every call compared.
    latest_arrival: Option<Arrival>,
    stragglers: Vec<Straggler>,
    /// How long each rank waited for each other over the calls compared (one host only).
    waits: Option<waits::Waits>,
    /// The kernels' phases per path and each rank's wait per peer per call, from the phase
    /// stamps (each rank's own clock: any hosts).
    phases: Option<phases::Summary>,
    same_host: bool,
    errors: Vec<RankError>,
}

/// One dump per rank, in rank order: of the same rank twice (a failure's dump and the trace
/// at close, or the job id reused), the latest.
fn latest_per_rank(mut dumps: Vec<Dump>) -> Vec<Dump> {
    dumps.sort_by_key(|d| (d.header.rank, std::cmp::Reverse(d.header.dumped_ns)));
    dumps.dedup_by_key(|d| d.header.rank);
    dumps
}

/// Whether every record comes from one host (one wall clock for their times).
fn one_host(dumps: &[Dump]) -> bool {
    dumps
        .windows(2)
        .all(|w| w[0].header.host == w[1].header.host)
}

fn summarize_job(dumps: Vec<Dump>) -> JobSummary {
    let dumps = latest_per_rank(dumps);
    let world = dumps.iter().map(|d| d.header.world).max().unwrap_or(0);
    let ranks: Vec<usize> = dumps.iter().map(|d| d.header.rank).collect();
    let missing: Vec<usize> = (0..world).filter(|r| !ranks.contains(r)).collect();
    let first_kept = |d: &Dump| d.recs.keys().next().copied().unwrap_or(u64::MAX);
    let last = |d: &Dump| d.recs.keys().next_back().copied().unwrap_or(0);
    let first_seq = dumps.iter().map(first_kept).max().unwrap_or(1).max(1);
    let last_seq = dumps.iter().map(last).max().unwrap_or(0);
    let same_host = one_host(&dumps);
    // Traces written at close after a run with no failure have no last call to blame.
    let failed = dumps.iter().any(|d| d.header.error.is_some());
    let mut divergence = None;
    for seq in first_seq..=last_seq {
        if let Some(d) = diverges_at(&dumps, &missing, seq, failed && seq == last_seq) {
            divergence = Some(d);
            break;
        }
    }
    let (last_arrival, latest_arrival, stragglers) = if same_host {
        arrivals(
            &dumps,
            first_seq,
            last_seq,
            divergence.as_ref().map(|d| d.seq),
        )
    } else {
        (None, None, Vec::new())
    };
    let waits = same_host
        .then(|| waits::waits(&dumps, first_seq, last_seq))
        .flatten();
    let phases = phases::summary(&dumps, first_seq, last_seq);
    JobSummary {
        phases,
        job: dumps[0].header.job.clone(),
        world,
        ranks,
        missing,
        first_seq,
        last_seq,
        divergence,
        last_arrival,
        latest_arrival,
        stragglers,
        waits,
        same_host,
        errors: dumps
            .iter()
            .filter_map(|d| {
                Some(RankError {
                    rank: d.header.rank,
                    file: d.file.clone(),
                    error: d.header.error.clone()?,
                })
            })
            .collect(),
    }
}

/// How call `seq` parts the records, if it does; `last`: the last call recorded, which stands
/// for the failure every record was written for even when every rank returned from it (on
/// cuda a call returns once enqueued: the failure comes while it runs).
fn diverges_at(dumps: &[Dump], missing: &[usize], seq: u64, last: bool) -> Option<Divergence> {
    let made: Vec<(usize, &Rec)> = dumps
        .iter()
        .filter_map(|d| d.recs.get(&seq).map(|r| (d.header.rank, r)))
        .collect();
    let never_made: Vec<Odd> = dumps
        .iter()
        .filter(|d| !d.recs.contains_key(&seq))
        .map(|d| Odd {
            rank: d.header.rank,
            detail: match d.recs.values().next_back() {
                Some(r) => format!(
                    "its last call was #{} {} ({})",
                    r.seq,
                    r.ident().describe(),
                    r.state
                ),
                None => "it recorded no call".into(),
            },
        })
        .collect();
    // Groups of ranks that made the call alike, largest first (ties: the lowest rank's).
    let mut groups: Vec<(Ident, Vec<usize>)> = Vec::new();
    for (rank, r) in &made {
        let id = r.ident();
        match groups
            .iter_mut()
            .find(|(g, _)| g.differences(&id).is_empty())
        {
            Some((_, rs)) => rs.push(*rank),
            None => groups.push((id, vec![*rank])),
        }
    }
    groups.sort_by_key(|(_, rs)| (std::cmp::Reverse(rs.len()), rs[0]));
    let failed_on: Vec<usize> = made
        .iter()
        .filter(|(_, r)| r.state != "ok")
        .map(|(rank, _)| *rank)
        .collect();
    let (call, ranks) = groups.first().cloned()?;
    let different: Vec<Odd> = groups[1..]
        .iter()
        .flat_map(|(id, rs)| {
            rs.iter().map(|r| Odd {
                rank: *r,
                detail: id.differences(&call).join(", "),
            })
        })
        .collect();
    let mut culprits: Vec<usize> = different
        .iter()
        .chain(&never_made)
        .map(|o| o.rank)
        .collect();
    culprits.sort_unstable();
    let kind = if !never_made.is_empty() {
        "never_made"
    } else if !different.is_empty() {
        "different"
    } else if !failed_on.is_empty() {
        culprits = missing.to_vec();
        "failed"
    } else if last {
        culprits = missing.to_vec();
        "last"
    } else {
        return None;
    };
    Some(Divergence {
        seq,
        kind,
        call,
        ranks,
        different,
        never_made,
        failed_on,
        culprits,
    })
}

/// Who began call `seq` last and how long after the first rank, from every rank's host start
/// time (None unless every rank recorded one).
fn arrival(dumps: &[Dump], seq: u64) -> Option<Arrival> {
    let starts: Vec<(usize, u64)> = dumps
        .iter()
        .map(|d| Some((d.header.rank, d.recs.get(&seq)?.start_ns?)))
        .collect::<Option<_>>()?;
    if starts.len() < 2 {
        return None;
    }
    let (first_rank, t0) = *starts.iter().min_by_key(|(r, t)| (*t, *r))?;
    let (rank, t1) = *starts
        .iter()
        .max_by_key(|(r, t)| (*t, std::cmp::Reverse(*r)))?;
    Some(Arrival {
        seq,
        rank,
        first_rank,
        after_us: (t1 - t0) as f64 / 1e3,
    })
}

/// Who started call `at` last (the divergence, else the last call), the call whose last rank
/// came latest, and per rank how often it was the last to start a call and how late on
/// average, over every call all ranks made.
fn arrivals(
    dumps: &[Dump],
    first: u64,
    last: u64,
    at: Option<u64>,
) -> (Option<Arrival>, Option<Arrival>, Vec<Straggler>) {
    let mut per: BTreeMap<usize, (usize, f64)> = BTreeMap::new();
    let mut latest: Option<Arrival> = None;
    for seq in first..=last {
        if let Some(a) = arrival(dumps, seq) {
            let e = per.entry(a.rank).or_default();
            e.0 += 1;
            e.1 += a.after_us;
            if latest.as_ref().is_none_or(|l| a.after_us > l.after_us) {
                latest = Some(a);
            }
        }
    }
    let mut stragglers: Vec<Straggler> = per
        .into_iter()
        .map(|(rank, (n, sum))| Straggler {
            rank,
            last_in: n,
            mean_after_us: sum / n as f64,
        })
        .collect();
    stragglers.sort_by_key(|s| (std::cmp::Reverse(s.last_in), s.rank));
    (arrival(dumps, at.unwrap_or(last)), latest, stragglers)
}

fn list(ranks: &[usize]) -> String {
    let s: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    format!(
        "{} {}",
        if ranks.len() == 1 { "rank" } else { "ranks" },
        s.join(", ")
    )
}

fn text(s: &JobSummary) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "job {} (world {}): flight records of {}",
        s.job,
        s.world,
        list(&s.ranks)
    );
    if !s.missing.is_empty() {
        let _ = writeln!(
            o,
            "no record: {} (died before writing one, or never saw a failure)",
            list(&s.missing)
        );
    }
    let _ = writeln!(o, "calls #{}-#{} compared", s.first_seq, s.last_seq);
    match &s.divergence {
        None if s.last_seq == 0 => {
            let _ = writeln!(o, "no call recorded on any rank");
        }
        None => {
            let _ = writeln!(
                o,
                "no divergence: every rank made calls #{}-#{} alike and none failed",
                s.first_seq, s.last_seq
            );
        }
        Some(d) => {
            let what = match d.kind {
                "never_made" => "a rank never made it",
                "different" => "made differently",
                "failed" => "made alike, did not complete everywhere",
                _ => "the last call, made alike and returned on every rank: the failure came after it was issued",
            };
            let culprits = match d.culprits.as_slice() {
                [] => String::new(),
                c => format!("; look at {}", list(c)),
            };
            let _ = writeln!(o, "first divergence: call #{} ({what}){culprits}", d.seq);
            let _ = writeln!(o, "  {}: {}", list(&d.ranks), d.call.describe());
            for x in &d.different {
                let _ = writeln!(o, "  rank {} made it differently: {}", x.rank, x.detail);
            }
            for x in &d.never_made {
                let _ = writeln!(
                    o,
                    "  rank {} never made call #{}: {}",
                    x.rank, d.seq, x.detail
                );
            }
            if !d.failed_on.is_empty() {
                let _ = writeln!(o, "  not completed on {}", list(&d.failed_on));
            }
            if !s.missing.is_empty() {
                let _ = writeln!(
                    o,
                    "  unknown for {}: no record (dead, or never saw a failure)",
                    list(&s.missing)
                );
            }
        }
    }
    match &s.last_arrival {
        Some(a) => {
            let _ = writeln!(
                o,
                "last to arrive at #{}: rank {}, {:.1} us after rank {}",
                a.seq, a.rank, a.after_us, a.first_rank
            );
        }
        None if !s.same_host => {
            let _ = writeln!(
                o,
                "arrival times not compared: the records come from different hosts"
            );
        }
        None => {}
    }
    if let Some(a) = &s.latest_arrival {
        let _ = writeln!(
            o,
            "latest arrival: #{}: rank {}, {:.1} us after rank {}",
            a.seq, a.rank, a.after_us, a.first_rank
        );
    }
    if !s.stragglers.is_empty() {
        let parts: Vec<String> = s
            .stragglers
            .iter()
            .map(|x| {
                format!(
                    "rank {} in {} (mean {:.1} us late)",
                    x.rank, x.last_in, x.mean_after_us
                )
            })
            .collect();
        let _ = writeln!(o, "last to arrive, per call: {}", parts.join("; "));
    }
    if let Some(w) = &s.waits {
        o.push_str(&waits::text(w));
    }
    if let Some(p) = &s.phases {
        o.push_str(&phases::text(p));
    }
    if s.errors.is_empty() {
        let _ = writeln!(o, "errors: none");
    } else {
        let _ = writeln!(o, "errors:");
    }
    for e in &s.errors {
        let _ = writeln!(o, "  {}", e.error);
    }
    o
}

/// The records in `inputs`, grouped by job.
fn jobs(inputs: &[PathBuf]) -> Result<BTreeMap<String, Vec<Dump>>, String> {
    let mut jobs: BTreeMap<String, Vec<Dump>> = BTreeMap::new();
    for f in files(inputs)? {
        let d = load(&f)?;
        jobs.entry(d.header.job.clone()).or_default().push(d);
    }
    Ok(jobs)
}

fn summarize(inputs: &[PathBuf], json: bool) -> Result<String, String> {
    let jobs = jobs(inputs)?;
    let summaries: Vec<JobSummary> = jobs.into_values().map(summarize_job).collect();
    if json {
        let v = serde_json::json!({ "jobs": summaries });
        return Ok(serde_json::to_string_pretty(&v).expect("plain data") + "\n");
    }
    Ok(summaries.iter().map(text).collect::<Vec<_>>().join("\n"))
}

/// `trace plot`: the one job in `inputs`, its window, drawn.
fn plot_job(
    inputs: &[PathBuf],
    output: &std::path::Path,
    calls: Option<&str>,
    title: Option<String>,
) -> Result<String, String> {
    let mut jobs = jobs(inputs)?;
    if jobs.len() > 1 {
        let names: Vec<&String> = jobs.keys().collect();
        return Err(format!(
            "records of {} jobs ({names:?}): pass the files of one",
            jobs.len()
        ));
    }
    let (job, dumps) = jobs.pop_first().ok_or("no records")?;
    let dumps = latest_per_rank(dumps);
    let same_clock = one_host(&dumps);
    let calls = calls.map(plot::parse_calls).transpose()?;
    let (first, last) = plot::window(&dumps, calls)?;
    let lanes = plot::lanes(&dumps, first, last, same_clock)?;
    let title = title.unwrap_or_else(|| {
        format!(
            "job {job} (world {}): calls #{first}-#{last}, host time above, stream time below{}",
            dumps.iter().map(|d| d.header.world).max().unwrap_or(0),
            if same_clock {
                ""
            } else {
                " (hosts differ: each rank from its own first call)"
            }
        )
    });
    plot::draw(&lanes, &title, output)?;
    Ok(format!(
        "wrote {} (calls #{first}-#{last} of {} ranks)",
        output.display(),
        lanes.len()
    ))
}

pub fn run(args: TraceArgs) -> i32 {
    match args.what {
        TraceCmd::Plot {
            inputs,
            output,
            calls,
            title,
        } => match plot_job(&inputs, &output, calls.as_deref(), title) {
            Ok(line) => {
                eprintln!("{line}");
                0
            }
            Err(e) => {
                eprintln!("error: {e}");
                1
            }
        },
        TraceCmd::Export {
            inputs,
            format,
            output,
        } => match export::run(&inputs, &format, &output) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("error: {e}");
                1
            }
        },
        TraceCmd::Summarize { inputs, json } => match summarize(&inputs, json) {
            Ok(out) => {
                print!("{out}");
                0
            }
            Err(e) => {
                eprintln!("error: {e}");
                1
            }
        },
    }
}
