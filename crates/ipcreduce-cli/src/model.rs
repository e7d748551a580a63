//! `ipcreduce model`: the scale model of a hierarchical all-reduce (ipcreduce inside each
//! node, NCCL between nodes) against flat NCCL over every GPU, on paper.
//!
//! Per-GPU times in microseconds for an all-reduce of `S` bytes on `N` nodes of `G` GPUs
//! (see docs/multinode.md for the derivation and where each default comes from):
//!
//! - intra-node phase (reduce-scatter, or all-gather) through peer memory:
//!   `t_intra = a_ipc / 2 + (G-1)/G * S / B_ipc`
//!   (half of a two-shot all-reduce at the measured bus bandwidth `B_ipc`)
//! - hop latency of an NCCL all-reduce over `N` nodes of `g` ranks, the better of ring and
//!   tree, as NCCL's own tuning model counts hops (`h_nvl` per NVLink hop, `h_ring` and
//!   `h_tree` per network hop):
//!   `lat(N, g) = min((2 (Ng-1) - 2 (N-1)) h_nvl + 2 (N-1) h_ring,
//!                    2 ((g-1) h_nvl + ceil(log2 N) h_tree))`
//! - inter-node NCCL all-reduce of one shard `S/G` among the `N` ranks with the same local
//!   rank (one per node), each through its own NIC of `B_net`:
//!   `t_net = a_nccl + lat(N, 1) + 2 (N-1)/N * (S/G) / B_net`
//! - hierarchical, phases one after the other: `t_rs + t_net + t_ag`
//! - hierarchical, phases overlapped by chunking (a lower bound): every fixed cost once, plus
//!   the larger of the network's bandwidth term and both intra-node phases' (they share the
//!   GPU's NVLink and SMs)
//! - flat NCCL over `P = N G` GPUs, its `G` rings each through one NIC per node:
//!   `t_flat = a_nccl + lat(N, G) + 2 (P-1)/P * S / (G B_net)`

use std::fmt::Write;

/// What the model assumes; times in microseconds, bandwidths in GB/s (1e9 bytes/s).
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct Params {
    /// GPUs per node.
    #[arg(long, default_value_t = 8)]
    pub gpus: usize,
    /// ipcreduce's intra-node all-reduce bus bandwidth, GB/s (measured: 271-277 at 128 MiB -
    /// 1 GiB, bf16, registered, 2 x H200 over NVLink, commit 37b172f; BENCHMARKS.md).
    #[arg(long, default_value_t = 277.0)]
    pub intra_busbw: f64,
    /// ipcreduce's small-message all-reduce time, us (measured: 3.3-4.1 in CUDA graphs, 8 B -
    /// 64 KiB, same run).
    #[arg(long, default_value_t = 3.3)]
    pub intra_lat_us: f64,
    /// Network bandwidth per GPU, GB/s (400 Gb/s = 50 GB/s, one NIC per GPU).
    #[arg(long, default_value_t = 50.0)]
    pub net_gbs: f64,
    /// Latency of one NVLink hop in NCCL's model, us (tuning.cc: 0.47-0.52 for LL, x1.8 with
    /// several nodes).
    #[arg(long, default_value_t = 0.9)]
    pub nvlink_hop_us: f64,
    /// Latency of one network hop of NCCL's ring, us (tuning.cc, LL).
    #[arg(long, default_value_t = 2.7)]
    pub ring_hop_us: f64,
    /// Latency of one network hop of NCCL's tree, us (tuning.cc, LL).
    #[arg(long, default_value_t = 5.0)]
    pub tree_hop_us: f64,
    /// NCCL's fixed cost per call, us (measured: 6.0 for 8 B in a CUDA graph, 2 x H200).
    #[arg(long, default_value_t = 6.0)]
    pub nccl_call_us: f64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            gpus: 8,
            intra_busbw: 277.0,
            intra_lat_us: 3.3,
            net_gbs: 50.0,
            nvlink_hop_us: 0.9,
            ring_hop_us: 2.7,
            tree_hop_us: 5.0,
            nccl_call_us: 6.0,
        }
    }
}

/// One configuration's predicted times, us.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    pub flat: f64,
    /// Phases one after the other.
    pub hier: f64,
    /// Phases overlapped (lower bound for a chunked implementation).
    pub hier_overlapped: f64,
    /// Share of `hier` spent in the two intra-node phases.
    pub intra_share: f64,
}

/// Bytes over GB/s, in microseconds.
fn us(bytes: f64, gbs: f64) -> f64 {
    bytes / (gbs * 1e3)
}

impl Params {
    /// Hop latency of an NCCL all-reduce over `nodes` nodes of `per_node` ranks: the better
    /// of ring and tree.
    fn hops(&self, nodes: usize, per_node: usize) -> f64 {
        let (n, g) = (nodes as f64, per_node as f64);
        let inter = 2.0 * (n - 1.0);
        let intra = 2.0 * (n * g - 1.0) - inter;
        let ring = intra * self.nvlink_hop_us + inter * self.ring_hop_us;
        let log2n = (usize::BITS - nodes.saturating_sub(1).leading_zeros()) as f64;
        let tree = 2.0 * ((g - 1.0) * self.nvlink_hop_us + log2n * self.tree_hop_us);
        ring.min(tree)
    }

    /// Bandwidth term of one intra-node phase (reduce-scatter or all-gather) of `bytes`.
    fn intra_bw(&self, bytes: f64) -> f64 {
        let g = self.gpus as f64;
        us((g - 1.0) / g * bytes, self.intra_busbw)
    }

    /// Predicted times for an all-reduce of `bytes` on `nodes` nodes.
    pub fn predict(&self, nodes: usize, bytes: f64) -> Prediction {
        let (n, g) = (nodes as f64, self.gpus as f64);
        let p = n * g;
        let flat = self.nccl_call_us
            + self.hops(nodes, self.gpus)
            + us(2.0 * (p - 1.0) / p * bytes, g * self.net_gbs);

        let intra_bw = self.intra_bw(bytes);
        let intra = self.intra_lat_us / 2.0 + intra_bw;
        let net_bw = us(2.0 * (n - 1.0) / n * bytes / g, self.net_gbs);
        let net_fixed = self.nccl_call_us + self.hops(nodes, 1);
        let hier = 2.0 * intra + net_fixed + net_bw;
        let hier_overlapped = self.intra_lat_us + net_fixed + (2.0 * intra_bw).max(net_bw);
        Prediction {
            flat,
            hier,
            hier_overlapped,
            intra_share: 2.0 * intra / hier,
        }
    }

    /// The model as a Markdown table: one row per (nodes, size).
    pub fn table(&self, nodes: &[usize], sizes: &[usize]) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "| nodes x GPUs | size | flat NCCL us | hierarchical us | intra-node share | \
             hierarchical, overlapped us | flat / hierarchical | flat / overlapped |"
        );
        let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
        for &n in nodes {
            for &s in sizes {
                let p = self.predict(n, s as f64);
                let _ = writeln!(
                    t,
                    "| {n} x {} | {} | {:.1} | {:.1} | {:.0}% | {:.1} | {:.2}x | {:.2}x |",
                    self.gpus,
                    human(s),
                    p.flat,
                    p.hier,
                    p.intra_share * 100.0,
                    p.hier_overlapped,
                    p.flat / p.hier,
                    p.flat / p.hier_overlapped
                );
            }
        }
        t
    }
}

fn human(bytes: usize) -> String {
    const UNITS: [(usize, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (u, name) in UNITS {
        if bytes >= u && bytes.is_multiple_of(u) {
            return format!("{} {name}", bytes / u);
        }
    }
    format!("{bytes} B")
}

#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    #[command(flatten)]
    pub params: Params,
    /// Node counts, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4,8,16,32,64")]
    pub nodes: Vec<usize>,
    /// Message sizes, comma separated (K, M, G suffixes).
    #[arg(long, value_delimiter = ',', value_parser = crate::cli::parse_size,
          default_value = "64K,1M,16M,256M,1G")]
    pub sizes: Vec<usize>,
}

pub fn run(args: ModelArgs) -> i32 {
    if args.params.gpus == 0 || args.nodes.contains(&0) {
        eprintln!("error: --gpus and --nodes must be at least 1");
        return 2;
    }
    let p = &args.params;
    let positive = [p.intra_busbw, p.net_gbs];
    if positive.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
        eprintln!("error: bandwidths must be positive");
        return 2;
    }
    print!("{}", p.table(&args.nodes, &args.sizes));
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn hops_are_the_better_of_ring_and_tree() {
        let p = Params::default();
        assert!(close(p.hops(1, 1), 0.0));
        // One node of 8: ring 14 NVLink hops (12.6), tree 2 * 7 (12.6).
        assert!(close(p.hops(1, 8), 12.6));
        // 2 nodes of 1: ring 2 network hops (5.4) against tree 2 * 1 * 5.
        assert!(close(p.hops(2, 1), 5.4));
        // 64 nodes of 8: ring 896 NVLink + 126 network hops; tree 2 * (7 * 0.9 + 6 * 5).
        assert!(close(p.hops(64, 8), 72.6));
        // 5 nodes of 1: ring 8 * 2.7 = 21.6; tree 2 * ceil(log2 5) * 5 = 30.
        assert!(close(p.hops(5, 1), 21.6));
    }

    #[test]
    fn formulas_by_hand_for_two_nodes_of_eight() {
        let p = Params::default();
        let s = 1e9; // 1 GB
        let got = p.predict(2, s);
        // flat: 6 + hops(2, 8) + 2 * 15/16 * 1e9 / (400 GB/s); hops: ring 28 * 0.9 +
        // 2 * 2.7 = 30.6, tree 2 * (7 * 0.9 + 5) = 22.6.
        assert!(close(got.flat, 6.0 + 22.6 + 4687.5), "{got:?}");
        // intra phase: 1.65 + 7/8 * 1e9 / 277 GB/s
        let intra_bw = 0.875e9 / 277e3;
        let intra = 1.65 + intra_bw;
        // net: 6 + 5.4 + 2 * 1/2 * 1e9 / 8 / 50 GB/s = 11.4 + 2500
        let net = 11.4 + 2500.0;
        assert!(close(got.hier, 2.0 * intra + net), "{got:?}");
        let overlapped = 3.3 + 11.4 + (2.0 * intra_bw).max(2500.0);
        assert!(close(got.hier_overlapped, overlapped), "{got:?}");
        assert!(close(got.intra_share, 2.0 * intra / (2.0 * intra + net)));
    }

    #[test]
    fn hierarchy_saves_hops_on_small_messages_and_needs_fast_intra_phases_on_large() {
        let p = Params::default();
        // Small, 64 nodes: flat pays the tree's NVLink chain (12.6 us) that the hierarchy
        // replaces with ipcreduce's 3.3 us.
        let small = p.predict(64, 65536.0);
        assert!(small.hier < small.flat - 5.0, "{small:?}");
        // Large: at the measured 277 GB/s the intra-node phases dominate and flat wins.
        let big = p.predict(8, 1e9);
        assert!(big.intra_share > 0.5 && big.hier > big.flat, "{big:?}");
        // Intra phases above (G-1) * B_net = 350 GB/s, overlapped, beat flat on bandwidth.
        let fast = Params {
            intra_busbw: 400.0,
            ..Params::default()
        };
        let big = fast.predict(64, 1e9);
        assert!(big.hier_overlapped < big.flat, "{big:?}");
        let slower = Params {
            intra_busbw: 300.0,
            ..Params::default()
        };
        let big = slower.predict(64, 1e9);
        assert!(big.hier_overlapped > big.flat, "{big:?}");
    }

    #[test]
    fn one_node_is_one_intra_all_reduce_plus_an_idle_network_call() {
        let p = Params::default();
        let got = p.predict(1, 1e6);
        // No network bytes and no hops: NCCL's fixed cost remains.
        let intra = 1.65 + 0.875e6 / 277e3;
        assert!(close(got.hier, 2.0 * intra + 6.0), "{got:?}");
    }

    #[test]
    fn table_has_a_row_per_case() {
        let t = Params::default().table(&[2, 64], &[65536, 1 << 30]);
        let rows: Vec<&str> = t.lines().collect();
        assert_eq!(rows.len(), 2 + 4, "{t}");
        assert!(rows[2].starts_with("| 2 x 8 | 64 KiB |"), "{t}");
        assert!(rows[5].starts_with("| 64 x 8 | 1 GiB |"), "{t}");
    }
}
