//! `ipcreduce topo`: for every pair of ranks, peer access (`cuDeviceGetP2PAttribute`), the link
//! (NVML), whether the communicator's cross-process mapping test passed, and the path `auto`
//! takes. A table on stdout, and JSON with `--json PATH`.
//!
//! The ranks build a cuda communicator with the transport left to `auto` (unless
//! `IPCREDUCE_TRANSPORT` forces one): its start-up checks (P2P query, mapping, a cross-process
//! write/read through every mapping on every rank) decide peer memory or host staging for the
//! whole job; the pair that made it fall back is named in the table (its mapping column) and in
//! rank 0's log. On peer memory, the path says whether the PCIe policy applies (pairs
//! classified PCIe, or `IPCREDUCE_TOPOLOGY=pcie`).

mod gpu;
mod link;

use crate::cli::{join, refuse, relaunch_unless_rank, RankArgs};
use gpu::{Gpu, P2p};
use ipcreduce::backend::Fallback;
use ipcreduce::{BackendChoice, Communicator, Fabric};
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
    /// "peer", "pcie-peer" (the PCIe policy) or "host-staged": what `auto` runs on.
    #[serde(default)]
    pub fabric: String,
    /// The pair and check that made `auto` stage through host memory, in words.
    #[serde(default)]
    pub fallback: Option<String>,
    pub gpus: Vec<Gpu>,
    pub pairs: Vec<Pair>,
}

/// The fallback in words, as the log line says it.
fn fallback_words(f: &Fallback) -> String {
    let who = if f.rank == f.peer {
        format!("rank {} could not set up peer memory", f.rank)
    } else {
        format!("rank {} cannot use rank {}", f.rank, f.peer)
    };
    format!("{who} ({}: {})", f.check, f.detail)
}

/// The mapping test's outcome and `auto`'s path for the pair (`rank`, `peer`), from what the
/// communicator chose for the job (`fabric`, and the pair that failed, if any) and what CUDA
/// and NVML say about the pair.
pub fn mapping_and_path(
    fabric: Fabric,
    fallback: Option<&Fallback>,
    (rank, peer): (usize, usize),
    p2p: Option<&P2p>,
    link: &str,
) -> (String, String) {
    let same_gpu = p2p.is_none();
    let no_p2p = p2p.is_some_and(|p| p.access != Some(true));
    if fabric == Fabric::HostStaged {
        let mapping = match fallback {
            Some(f) if (f.rank, f.peer) == (rank, peer) || (f.rank, f.peer) == (peer, rank) => {
                format!("FAILED: {}; host-staged passed", fallback_words(f))
            }
            Some(f) => format!("not needed: {}; host-staged passed", fallback_words(f)),
            None if no_p2p => "not run: no P2P; host-staged passed".into(),
            None => "not run: host transport forced; host-staged passed".into(),
        };
        return (mapping, fabric.describe());
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
    let path = match fabric {
        Fabric::PciePeer => format!(
            "peer memory ({via}), PCIe policy: pushes in passes, at most {} CTAs",
            ipcreduce::plan::PCIE_CTA_CAP
        ),
        _ => format!("peer memory ({via})"),
    };
    ("passed".into(), path)
}

/// This rank's pairs with every other rank.
fn my_pairs(
    gpus: &[Gpu],
    me: usize,
    fabric: Fabric,
    fallback: Option<&Fallback>,
) -> Result<Vec<Pair>, String> {
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
        let (mapping, path) =
            mapping_and_path(fabric, fallback, (me, peer.rank), p2p.as_ref(), &link);
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
    let _ = writeln!(t, "# transport: {}, auto's path: {}", r.transport, r.fabric);
    if let Some(f) = &r.fallback {
        let _ = writeln!(t, "# host-staged because {f}");
    }
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
    // What every rank agreed on at init: the transport and policy, and why.
    let fabric = comm.fabric();
    let host_staged = fabric == Fabric::HostStaged;
    let fallback = comm.meta().fallback;
    let mine = gpu::describe(me, ordinal).map_err(|e| format!("rank {me}: {e}"))?;
    let boot = comm.bootstrap();
    let gpus: Vec<Gpu> = decode_all(&boot.all_gather(&json(&mine)).map_err(|e| e.to_string())?)?;
    // Every rank gathers, even when its own queries failed, so nobody waits for it in vain.
    let pairs =
        my_pairs(&gpus, me, fabric, fallback.as_ref()).map_err(|e| format!("rank {me}: {e}"));
    let sent = json(&pairs);
    let all: Vec<Result<Vec<Pair>, String>> =
        decode_all(&boot.all_gather(&sent).map_err(|e| e.to_string())?)?;
    if me != 0 {
        return pairs.map(|_| None);
    }
    let all: Vec<Vec<Pair>> = all.into_iter().collect::<Result<_, _>>()?;
    Ok(Some(Report {
        transport: if host_staged { "host-staged" } else { "peer" }.into(),
        fabric: serde_json::to_value(fabric)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
        fallback: fallback.as_ref().map(fallback_words),
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
        trace: None,
    };
    if !crate::launch::in_rank() {
        if let Err(e) = ipcreduce::backend::cuda::usable() {
            return refuse(&format!(
                "topo: no usable GPU here ({e}); there are no GPU links to show. The host \
                 backend (`bench`/`check --backend host`) moves data between processes \
                 through shared memory instead"
            ));
        }
    }
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
        let (peer, host) = (Fabric::Peer, Fabric::HostStaged);
        let one = (0, 1);
        let (m, p) = mapping_and_path(peer, None, one, Some(&p2p(true)), "NVLink x18 via NVSwitch");
        assert_eq!((m.as_str(), p.as_str()), ("passed", "peer memory (NVLink)"));
        let (_, p) = mapping_and_path(peer, None, one, Some(&p2p(true)), "PCIe, same switch");
        assert_eq!(p, "peer memory (PCIe P2P)");
        let (_, p) = mapping_and_path(peer, None, one, None, "same GPU");
        assert_eq!(p, "peer memory (same GPU)");
        let (m, p) = mapping_and_path(host, None, one, Some(&p2p(false)), "PCIe, across sockets");
        assert!(
            m.starts_with("not run: no P2P") && p.starts_with("host-staged"),
            "{m}"
        );
        let (m, _) = mapping_and_path(host, None, one, Some(&p2p(true)), "unknown (NVML: missing)");
        assert!(m.contains("forced"), "{m}");
    }

    #[test]
    fn the_failed_pair_is_named_and_the_policy_shown() {
        let f = Fallback {
            rank: 1,
            peer: 0,
            check: "P2P query".into(),
            detail: "denied by IPCREDUCE_DENY_PEER (a test)".into(),
        };
        let host = Fabric::HostStaged;
        for pair in [(1, 0), (0, 1)] {
            let (m, p) = mapping_and_path(host, Some(&f), pair, Some(&p2p(true)), "NVLink x18");
            assert!(
                m.starts_with("FAILED: rank 1 cannot use rank 0 (P2P query: denied"),
                "{m}"
            );
            assert!(p.starts_with("host-staged"), "{p}");
        }
        let (m, _) = mapping_and_path(host, Some(&f), (2, 3), Some(&p2p(true)), "NVLink x18");
        assert!(m.starts_with("not needed: rank 1 cannot use rank 0"), "{m}");
        let (m, p) = mapping_and_path(
            Fabric::PciePeer,
            None,
            (0, 1),
            Some(&p2p(true)),
            "PCIe, same switch",
        );
        assert_eq!(m, "passed");
        assert!(
            p.starts_with("peer memory (PCIe P2P), PCIe policy: pushes in passes"),
            "{p}"
        );
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
            fabric: "peer".into(),
            fallback: None,
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
