//! `ipcreduce topo`: for every pair of ranks, peer access (`cuDeviceGetP2PAttribute`), the link
//! (NVML), whether the communicator's cross-process mapping test passed, and the path `auto`
//! takes. A table on stdout, and JSON with `--json PATH`.
//!
//! The ranks build a cuda communicator with the transport left to `auto` (unless
//! `IPCREDUCE_TRANSPORT` forces one): its start-up checks (P2P query, mapping, a cross-process
//! write/read through every mapping on every rank) decide peer memory or host staging for the
//! whole job, and rank 0's log names the pair that made it fall back.

mod gpu;
mod link;

use crate::cli::{join, relaunch_unless_rank, RankArgs};
use gpu::{Gpu, P2p};
use ipcreduce::{BackendChoice, Communicator};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

#[derive(clap::Args, Debug, Clone)]
pub struct TopoArgs {
    /// Number of ranks to start (default: one per GPU).
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Also write the result as JSON to this file.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// One ordered pair of ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pair {
    pub rank: usize,
    pub peer: usize,
    /// None when both ranks use the same GPU.
    pub p2p: Option<P2p>,
    pub link: String,
    pub mapping: String,
    pub path: String,
}

/// What `topo --json` writes.
#[derive(Debug, Serialize, Deserialize)]
pub struct Report {
    /// "peer" or "host-staged": the transport every rank took.
    pub transport: String,
    pub gpus: Vec<Gpu>,
    pub pairs: Vec<Pair>,
}

/// The mapping test's outcome and `auto`'s path for one pair, from what the communicator
/// chose for the job (`host_staged`) and what CUDA and NVML say about the pair.
pub fn mapping_and_path(host_staged: bool, p2p: Option<&P2p>, link: &str) -> (String, String) {
    let same_gpu = p2p.is_none();
    let no_p2p = p2p.is_some_and(|p| p.access != Some(true));
    if host_staged {
        let mapping = if no_p2p {
            "not run: no P2P; host-staged passed"
        } else {
            "peer failed for some pair (rank 0's log names it); host-staged passed"
        };
        return (mapping.into(), "host-staged (through host memory)".into());
    }
    let via = if same_gpu {
        "same GPU"
    } else if link.starts_with("NVLink") {
        "NVLink"
    } else if link.starts_with("PCIe") {
        "PCIe P2P"
    } else {
        "P2P, link unknown"
    };
    ("passed".into(), format!("peer memory ({via})"))
}

/// This rank's pairs with every other rank.
fn my_pairs(gpus: &[Gpu], me: usize, host_staged: bool) -> Result<Vec<Pair>, String> {
    let links = link::Links::open();
    let mine = &gpus[me];
    let my_dev = gpu::device(mine.ordinal)?;
    let mut out = Vec::new();
    for peer in gpus.iter().filter(|g| g.rank != me) {
        let (p2p, link) = if peer.uuid == mine.uuid {
            (None, "same GPU".to_string())
        } else {
            let p2p = match gpu::visible_ordinal(&peer.uuid) {
                Some(o) => gpu::p2p(my_dev, gpu::device(o)?),
                // Not visible in this process: CUDA cannot be asked, and neither can peer
                // memory be used.
                None => P2p {
                    access: Some(false),
                    performance_rank: None,
                    native_atomics: None,
                },
            };
            (Some(p2p), links.between(mine, peer))
        };
        let (mapping, path) = mapping_and_path(host_staged, p2p.as_ref(), &link);
        out.push(Pair {
            rank: me,
            peer: peer.rank,
            p2p,
            link,
            mapping,
            path,
        });
    }
    Ok(out)
}

fn yes_no(v: Option<bool>) -> &'static str {
    match v {
        Some(true) => "yes",
        Some(false) => "no",
        None => "?",
    }
}

/// The report as a Markdown table.
pub fn table(r: &Report) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "# transport: {}", r.transport);
    for g in &r.gpus {
        let _ = writeln!(
            t,
            "# rank {}: GPU {} {} (PCI {})",
            g.rank, g.ordinal, g.uuid, g.bus_id
        );
    }
    let _ = writeln!(
        t,
        "| rank | peer | P2P access | perf rank | atomics | link | mapping test | auto's path |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
    for p in &r.pairs {
        let (access, perf, atomics) = match &p.p2p {
            None => ("same GPU", "-".to_string(), "-"),
            Some(q) => (
                yes_no(q.access),
                q.performance_rank.map_or("?".into(), |v| v.to_string()),
                yes_no(q.native_atomics),
            ),
        };
        let _ = writeln!(
            t,
            "| {} | {} | {access} | {perf} | {atomics} | {} | {} | {} |",
            p.rank, p.peer, p.link, p.mapping, p.path
        );
    }
    t
}

fn rank_main(comm: &mut Communicator) -> Result<Option<Report>, String> {
    let me = comm.rank();
    let ordinal = comm
        .cuda_device()
        .ok_or_else(|| format!("rank {me}: topo needs the cuda backend"))?;
    // The device descriptions say ", host-staged" when the communicator stages through host
    // memory (the same on every rank).
    let host_staged = comm
        .meta()
        .devices
        .iter()
        .any(|d| d.contains("host-staged"));
    let mine = gpu::describe(me, ordinal).map_err(|e| format!("rank {me}: {e}"))?;
    let boot = comm.bootstrap();
    let gpus: Vec<Gpu> = decode_all(&boot.all_gather(&json(&mine)).map_err(|e| e.to_string())?)?;
    // Every rank gathers, even when its own queries failed, so nobody waits for it in vain.
    let pairs = my_pairs(&gpus, me, host_staged).map_err(|e| format!("rank {me}: {e}"));
    let sent = json(&pairs);
    let all: Vec<Result<Vec<Pair>, String>> =
        decode_all(&boot.all_gather(&sent).map_err(|e| e.to_string())?)?;
    if me != 0 {
        return pairs.map(|_| None);
    }
    let all: Vec<Vec<Pair>> = all.into_iter().collect::<Result<_, _>>()?;
    Ok(Some(Report {
        transport: if host_staged { "host-staged" } else { "peer" }.into(),
        gpus,
        pairs: all.into_iter().flatten().collect(),
    }))
}

/// JSON bytes for the bootstrap's all-gather (our own types always serialize).
fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

fn decode_all<T: for<'de> Deserialize<'de>>(blobs: &[Vec<u8>]) -> Result<Vec<T>, String> {
    blobs
        .iter()
        .enumerate()
        .map(|(r, b)| serde_json::from_slice(b).map_err(|e| format!("rank {r}'s report: {e}")))
        .collect()
}

pub fn run(args: TopoArgs) -> i32 {
    let ranks = RankArgs {
        backend: BackendChoice::Cuda,
        ranks: args.ranks,
    };
    if let Some(code) = relaunch_unless_rank(&ranks) {
        return code;
    }
    let mut comm = match join(&ranks, false) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    match rank_main(&mut comm) {
        Ok(None) => 0,
        Ok(Some(report)) => {
            print!("{}", table(&report));
            if let Some(path) = &args.json {
                let text = serde_json::to_string_pretty(&report).unwrap_or_default();
                if let Err(e) = std::fs::write(path, text) {
                    eprintln!("error: writing {}: {e}", path.display());
                    return 1;
                }
            }
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p2p(access: bool) -> P2p {
        P2p {
            access: Some(access),
            performance_rank: Some(0),
            native_atomics: Some(access),
        }
    }

    #[test]
    fn paths_follow_the_transport_and_the_link() {
        let (m, p) = mapping_and_path(false, Some(&p2p(true)), "NVLink x18 via NVSwitch");
        assert_eq!((m.as_str(), p.as_str()), ("passed", "peer memory (NVLink)"));
        let (_, p) = mapping_and_path(false, Some(&p2p(true)), "PCIe, same switch");
        assert_eq!(p, "peer memory (PCIe P2P)");
        let (_, p) = mapping_and_path(false, None, "same GPU");
        assert_eq!(p, "peer memory (same GPU)");
        let (m, p) = mapping_and_path(true, Some(&p2p(false)), "PCIe, across sockets");
        assert!(
            m.starts_with("not run: no P2P") && p.starts_with("host-staged"),
            "{m}"
        );
        let (m, _) = mapping_and_path(true, Some(&p2p(true)), "unknown (NVML: missing)");
        assert!(m.contains("rank 0's log"), "{m}");
    }

    #[test]
    fn table_and_json_round_trip() {
        let gpus: Vec<Gpu> = (0..2)
            .map(|r| Gpu {
                rank: r,
                ordinal: r,
                uuid: format!("GPU-{r}"),
                bus_id: format!("0000:0{r}:00.0"),
            })
            .collect();
        let pair = |rank, peer| Pair {
            rank,
            peer,
            p2p: Some(p2p(true)),
            link: "NVLink x18".into(),
            mapping: "passed".into(),
            path: "peer memory (NVLink)".into(),
        };
        let r = Report {
            transport: "peer".into(),
            gpus,
            pairs: vec![pair(0, 1), pair(1, 0)],
        };
        let t = table(&r);
        assert!(
            t.contains("| 0 | 1 | yes | 0 | yes | NVLink x18 | passed | peer memory (NVLink) |"),
            "{t}"
        );
        assert_eq!(t.lines().filter(|l| l.starts_with("| ")).count(), 3, "{t}");
        let back: Report = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.pairs, r.pairs);
        assert_eq!(back.gpus, r.gpus);
    }
}
