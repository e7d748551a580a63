//! Reading flight records and traces: the files (or the directories holding them) and their
//! lines, and what two ranks' records of one call must agree on.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A dump's first line.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct Header {
    pub flight_record: u32,
    pub job: String,
    pub rank: usize,
    pub world: usize,
    pub host: String,
    pub dumped_ns: u64,
    /// The first failure; None in a trace written at close after calls that all went well.
    #[serde(default)]
    pub error: Option<String>,
}

/// One recorded call.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct Rec {
    pub seq: u64,
    pub op: String,
    pub path: Option<String>,
    /// The cuda all-reduce's kernel path (`oneshot-ll`, `ce`, ...; absent in older files).
    #[serde(default)]
    pub kernel: Option<String>,
    pub count: u64,
    pub dtype: String,
    pub reduce: String,
    pub in_place: bool,
    #[serde(default)]
    pub stream: Option<String>,
    pub start_ns: Option<u64>,
    #[serde(default)]
    pub end_ns: Option<u64>,
    pub state: String,
    /// When the call ran on its stream (cuda, `IPCREDUCE_TIMELINE=1`), host wall-clock ns.
    #[serde(default)]
    pub dev_start_ns: Option<u64>,
    #[serde(default)]
    pub dev_end_ns: Option<u64>,
    /// The kernels' phase stamps (cuda, `IPCREDUCE_TRACE`), see phases.rs.
    #[serde(default)]
    pub phases: Option<Phases>,
}

/// A call's `phases` field: the kernels' stamps per block (host ns), read by phases.rs.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub(super) struct Phases {
    pub kseq: u64,
    #[serde(default)]
    pub tick_ns: u64,
    pub blocks: Vec<Block>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
pub(super) struct Block {
    pub block: usize,
    pub start_ns: Option<u64>,
    /// (peer, first seen), host ns.
    #[serde(default)]
    pub peers: Vec<(usize, u64)>,
    pub reduce_ns: Option<u64>,
    pub gather_ns: Option<u64>,
    pub end_ns: Option<u64>,
}

/// What ranks must agree on: everything but the times and the stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(super) struct Ident {
    pub op: String,
    pub count: u64,
    pub dtype: String,
    pub reduce: String,
    pub in_place: bool,
    pub path: Option<String>,
}

impl Rec {
    pub(super) fn ident(&self) -> Ident {
        Ident {
            op: self.op.clone(),
            count: self.count,
            dtype: self.dtype.clone(),
            reduce: self.reduce.clone(),
            in_place: self.in_place,
            path: self.path.clone(),
        }
    }
}

impl Ident {
    pub(super) fn describe(&self) -> String {
        let place = if self.in_place { ", in place" } else { "" };
        let path = self
            .path
            .as_deref()
            .map(|p| format!(" ({p})"))
            .unwrap_or_default();
        format!(
            "{} count {} {} {}{place}{path}",
            self.op, self.count, self.dtype, self.reduce
        )
    }

    /// `field mine vs theirs` for each field that differs.
    pub(super) fn differences(&self, want: &Ident) -> Vec<String> {
        let mut d = Vec::new();
        let mut cmp = |name: &str, a: String, b: String| {
            if a != b {
                d.push(format!("{name} {a} vs {b}"));
            }
        };
        cmp("op", self.op.clone(), want.op.clone());
        cmp("count", self.count.to_string(), want.count.to_string());
        cmp("dtype", self.dtype.clone(), want.dtype.clone());
        cmp("reduce", self.reduce.clone(), want.reduce.clone());
        cmp(
            "in_place",
            self.in_place.to_string(),
            want.in_place.to_string(),
        );
        // A call refused before its path was chosen (the communicator was aborted already)
        // has none: that is no difference.
        if let (Some(a), Some(b)) = (&self.path, &want.path) {
            cmp("path", a.clone(), b.clone());
        }
        d
    }
}

pub(super) struct Dump {
    pub file: PathBuf,
    pub header: Header,
    pub recs: BTreeMap<u64, Rec>,
}

pub(super) fn load(file: &Path) -> Result<Dump, String> {
    let text =
        std::fs::read_to_string(file).map_err(|e| format!("reading {}: {e}", file.display()))?;
    let mut lines = text.lines().enumerate();
    let bad = |n: usize, e: serde_json::Error| format!("{} line {}: {e}", file.display(), n + 1);
    let (n, first) = lines
        .next()
        .ok_or_else(|| format!("{}: empty, not a flight record", file.display()))?;
    let header: Header = serde_json::from_str(first).map_err(|e| bad(n, e))?;
    if header.flight_record != 1 {
        return Err(format!(
            "{}: flight record format {} (this ipcreduce reads 1)",
            file.display(),
            header.flight_record
        ));
    }
    let mut recs = BTreeMap::new();
    for (n, l) in lines.filter(|(_, l)| !l.trim().is_empty()) {
        let r: Rec = serde_json::from_str(l).map_err(|e| bad(n, e))?;
        recs.insert(r.seq, r);
    }
    Ok(Dump {
        file: file.to_path_buf(),
        header,
        recs,
    })
}

/// The files named, and in the directories named those called `ipcreduce-flight-*.jsonl`
/// (written at a failure) or `ipcreduce-trace-*.jsonl` (written at close, `IPCREDUCE_TRACE`).
pub(super) fn files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    for p in inputs {
        if p.is_dir() {
            let rd = std::fs::read_dir(p).map_err(|e| format!("reading {}: {e}", p.display()))?;
            let mut found: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| {
                    f.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                        (n.starts_with("ipcreduce-flight-") || n.starts_with("ipcreduce-trace-"))
                            && n.ends_with(".jsonl")
                    })
                })
                .collect();
            found.sort();
            out.extend(found);
        } else {
            out.push(p.clone());
        }
    }
    if out.is_empty() {
        return Err(format!(
            "no flight records or traces (ipcreduce-flight-*.jsonl, ipcreduce-trace-*.jsonl) in {}",
            inputs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(out)
}

/// Records made up for the tests of the modules that read them (waits.rs, plot.rs).
#[cfg(test)]
pub(super) mod made_up {
    use super::{Dump, Header, Rec};

    /// An `ok` all-reduce of 4 floats, call `seq`, at these host and device times (ns).
    pub fn rec(seq: u64, start: Option<u64>, end: Option<u64>, dev: Option<(u64, u64)>) -> Rec {
        Rec {
            seq,
            op: "all_reduce".into(),
            path: None,
            kernel: None,
            count: 4,
            dtype: "float".into(),
            reduce: "sum".into(),
            in_place: false,
            stream: None,
            start_ns: start,
            end_ns: end,
            state: "ok".into(),
            dev_start_ns: dev.map(|d| d.0),
            dev_end_ns: dev.map(|d| d.1),
            phases: None,
        }
    }

    /// Rank `rank`'s record of job "j" (`world` ranks) on `host`, holding `recs`.
    pub fn dump(rank: usize, world: usize, host: &str, recs: Vec<Rec>) -> Dump {
        Dump {
            file: format!("rank{rank}").into(),
            header: Header {
                flight_record: 1,
                job: "j".into(),
                rank,
                world,
                host: host.into(),
                dumped_ns: 0,
                error: None,
            },
            recs: recs.into_iter().map(|r| (r.seq, r)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Ident;

    fn ident(count: u64, path: Option<&str>) -> Ident {
        Ident {
            op: "all_reduce".into(),
            count,
            dtype: "float".into(),
            reduce: "sum".into(),
            in_place: false,
            path: path.map(Into::into),
        }
    }

    #[test]
    fn a_call_refused_before_its_path_was_chosen_differs_only_in_what_it_names() {
        let ran = ident(105, Some("oneshot"));
        assert!(ident(105, None).differences(&ran).is_empty());
        assert!(ran.differences(&ident(105, None)).is_empty());
        assert_eq!(
            ident(106, None).differences(&ran),
            vec!["count 106 vs 105".to_string()]
        );
        assert_eq!(
            ident(105, Some("twoshot")).differences(&ran),
            vec!["path twoshot vs oneshot".to_string()]
        );
    }
}
