//! Which ranks share a host: the job's nodes.
//!
//! Every rank says which host it runs on (hostname plus boot id, or `IPCREDUCE_HOST_ID`);
//! ranks with the same id form a node. Nodes are numbered by their lowest rank, and ranks
//! within a node by rank. Every node must hold the same number of ranks: the hierarchical
//! all-reduce pairs local rank i of every node, so uneven nodes are refused rather than
//! handled.

use crate::error::{Error, Result};
use crate::types::BackendKind;

/// This host's id: `hostname/boot id`. The boot id tells apart hosts that share a name
/// (containers, cloned images) and a host from itself after a reboot.
pub fn machine_host_id() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    let name = read("/proc/sys/kernel/hostname").unwrap_or_else(|| "unknown-host".into());
    match read("/proc/sys/kernel/random/boot_id") {
        Some(boot) => format!("{name}/{boot}"),
        None => name,
    }
}

/// Host ids travel in the bootstrap and appear in messages: printable and short.
pub(crate) fn check_host_id(id: &str, var: &str) -> Result<()> {
    if id.is_empty() || id.len() > 255 || id.chars().any(|c| c.is_control()) {
        return Err(Error::Config(format!(
            "{var}={id:?} is not a valid host id (1 to 255 printable characters)"
        )));
    }
    Ok(())
}

/// The job's nodes as seen from one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    rank: usize,
    /// Ranks of each node, ascending; nodes ordered by their lowest rank.
    nodes: Vec<Vec<usize>>,
    /// Host id of each node.
    hosts: Vec<String>,
    /// Node of each rank.
    node_of: Vec<usize>,
}

impl Layout {
    /// Groups ranks by `host_ids` (indexed by rank); refuses nodes of unequal size.
    pub fn from_host_ids(rank: usize, host_ids: &[String]) -> Result<Layout> {
        let mut nodes: Vec<Vec<usize>> = Vec::new();
        let mut hosts: Vec<String> = Vec::new();
        let mut node_of = Vec::with_capacity(host_ids.len());
        for (r, id) in host_ids.iter().enumerate() {
            let n = match hosts.iter().position(|h| h == id) {
                Some(n) => n,
                None => {
                    hosts.push(id.clone());
                    nodes.push(Vec::new());
                    hosts.len() - 1
                }
            };
            nodes[n].push(r);
            node_of.push(n);
        }
        let layout = Layout {
            rank,
            nodes,
            hosts,
            node_of,
        };
        layout.check_even()?;
        Ok(layout)
    }

    fn check_even(&self) -> Result<()> {
        let first = self.nodes.first().map_or(0, Vec::len);
        if self.nodes.iter().all(|n| n.len() == first) {
            return Ok(());
        }
        let list: Vec<String> = (0..self.nodes.len())
            .map(|n| {
                format!(
                    "node {n} (host {}) has {} rank(s): {}",
                    self.hosts[n],
                    self.nodes[n].len(),
                    fmt_list(&self.nodes[n])
                )
            })
            .collect();
        Err(Error::Bootstrap {
            rank: self.rank,
            peer: None,
            op: "node grouping",
            detail: format!(
                "nodes have different numbers of ranks; ipcreduce needs the same number on \
                 every node (start the same number of ranks per host): {}",
                list.join("; ")
            ),
        })
    }

    /// Number of nodes (hosts) in the job.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// This rank's node.
    pub fn node(&self) -> usize {
        self.node_of[self.rank]
    }

    /// This rank's index among the ranks of its node.
    pub fn local_rank(&self) -> usize {
        let mine = &self.nodes[self.node()];
        mine.iter().position(|&r| r == self.rank).unwrap_or(0)
    }

    /// Ranks per node (the same on every node).
    pub fn local_size(&self) -> usize {
        self.nodes[self.node()].len()
    }

    /// The ranks of node `n`, ascending.
    pub fn node_ranks(&self, n: usize) -> &[usize] {
        &self.nodes[n]
    }

    /// The node of rank `r`.
    pub fn node_of(&self, r: usize) -> usize {
        self.node_of[r]
    }

    /// Host id of node `n`.
    pub fn host_id(&self, n: usize) -> &str {
        &self.hosts[n]
    }

    /// The ranks with local rank `i` on every node, by node: the groups an inter-node
    /// all-reduce of shard `i` runs in.
    pub fn same_local_rank(&self, i: usize) -> Vec<usize> {
        self.nodes
            .iter()
            .filter_map(|n| n.get(i).copied())
            .collect()
    }

    /// Refuses a job of several nodes for `what`, saying why (`missing`).
    pub fn require_single_node(&self, what: &str, missing: &str) -> Result<()> {
        if self.node_count() == 1 {
            return Ok(());
        }
        Err(Error::Config(format!(
            "rank {}: {what} works within one host, but this job spans {} nodes of {} rank(s) \
             (node {} is host {}); {missing}",
            self.rank,
            self.node_count(),
            self.local_size(),
            self.node(),
            self.host_id(self.node())
        )))
    }

    /// Refuses a backend that cannot serve this job's nodes: the host backend works within
    /// one host; the cuda backend spans hosts with its hierarchical all-reduce (peer memory
    /// inside each node, NCCL between nodes).
    pub fn check_backend(&self, kind: BackendKind) -> Result<()> {
        match kind {
            BackendKind::Host => self.require_single_node(
                "the host backend (shared memory)",
                "it stays single-host by design: run one job per host, or use the cuda backend \
                 (peer memory inside each node, NCCL between nodes)",
            ),
            BackendKind::Cuda => Ok(()),
        }
    }
}

/// `0-3` for a run, `0, 2, 5` otherwise.
fn fmt_list(ranks: &[usize]) -> String {
    match (ranks.first(), ranks.last()) {
        (Some(a), Some(b)) if ranks.len() > 2 && b - a + 1 == ranks.len() => format!("{a}-{b}"),
        _ => ranks
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn groups_by_host_in_order_of_lowest_rank() {
        // Interleaved placement: ranks 0, 2 on host b; 1, 3 on host a.
        let hosts = ids(&["b", "a", "b", "a"]);
        let l = Layout::from_host_ids(3, &hosts).unwrap();
        assert_eq!(l.node_count(), 2);
        assert_eq!((l.node(), l.local_rank(), l.local_size()), (1, 1, 2));
        assert_eq!(l.node_ranks(0), &[0, 2]);
        assert_eq!(l.node_ranks(1), &[1, 3]);
        assert_eq!(l.host_id(0), "b");
        assert_eq!(l.same_local_rank(0), vec![0, 1]);
        assert_eq!(l.same_local_rank(1), vec![2, 3]);
        assert_eq!(l.node_of(2), 0);
    }

    #[test]
    fn one_host_is_one_node() {
        let l = Layout::from_host_ids(2, &ids(&["h", "h", "h"])).unwrap();
        assert_eq!(
            (l.node_count(), l.node(), l.local_rank(), l.local_size()),
            (1, 0, 2, 3)
        );
        assert!(l.require_single_node("x", "y").is_ok());
    }

    #[test]
    fn uneven_nodes_are_refused_naming_them() {
        let e = Layout::from_host_ids(0, &ids(&["a", "a", "a", "b", "b"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 0"), "{e}");
        assert!(e.contains("node 0 (host a) has 3 rank(s): 0-2"), "{e}");
        assert!(e.contains("node 1 (host b) has 2 rank(s): 3, 4"), "{e}");
    }

    #[test]
    fn multi_node_refusal_names_the_reason() {
        let l = Layout::from_host_ids(1, &ids(&["a", "b"])).unwrap();
        let e = l
            .require_single_node("the host backend", "use one host")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 1") && e.contains("spans 2 nodes") && e.contains("use one host"),
            "{e}"
        );
        let e = l.check_backend(BackendKind::Host).unwrap_err().to_string();
        assert!(
            e.contains("host backend") && e.contains("single-host"),
            "{e}"
        );
        // The cuda backend spans nodes (hierarchical all-reduce).
        assert!(l.check_backend(BackendKind::Cuda).is_ok());
        let one = Layout::from_host_ids(0, &ids(&["a", "a"])).unwrap();
        assert!(one.check_backend(BackendKind::Host).is_ok());
        assert!(one.check_backend(BackendKind::Cuda).is_ok());
    }

    #[test]
    fn machine_id_has_the_boot_id() {
        let id = machine_host_id();
        check_host_id(&id, "id").unwrap();
        if std::path::Path::new("/proc/sys/kernel/random/boot_id").exists() {
            assert!(id.contains('/'), "{id}");
        }
        for bad in ["", "a\nb", &"h".repeat(256)] {
            match check_host_id(bad, "IPCREDUCE_HOST_ID") {
                Err(Error::Config(m)) => assert!(
                    m.contains(&format!("IPCREDUCE_HOST_ID={bad:?}"))
                        && m.contains("1 to 255 printable characters"),
                    "{m}"
                ),
                other => panic!("host id {bad:?}: expected Error::Config, got {other:?}"),
            }
        }
    }
}
