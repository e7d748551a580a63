//! `ipcreduce split` (jobs across nodes, cuda): where the time of the hierarchical all-reduce
//! goes. Per size: the whole call (checked against the reference first), then its three steps
//! timed with events between them (intra-node reduce-scatter, NCCL all-reduce between nodes,
//! intra-node all-gather), and flat NCCL over the whole job beside it when NCCL runs there.
//! Over loopback sockets (nodes played on one machine) the NCCL column says nothing about a
//! real network: it shows only that the step runs and what it costs here.

use crate::cli::{join, parse_size, relaunch_unless_rank, RankArgs};
use crate::harness::{gather_f64, run_checked, utc_now, Buffers};
use ipcreduce::backend::Call;
use ipcreduce::error::Result;
use ipcreduce::types::{Algorithm, DType, ReduceOp};

#[derive(clap::Args, Debug, Clone)]
pub struct SplitArgs {
    #[command(flatten)]
    pub ranks: RankArgs,
    /// Message sizes, comma separated (e.g. 64K,1M,16M).
    #[arg(long, default_value = "64K,1M,16M,128M", value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Vec<usize>,
    /// Element type.
    #[arg(short = 'd', long, default_value = "bfloat16")]
    pub dtype: DType,
    /// Timed calls per size (after warm-up).
    #[arg(short = 'n', long, default_value_t = 20)]
    pub iters: usize,
    /// Warm-up calls per size.
    #[arg(short = 'w', long, default_value_t = 5)]
    pub warmup: usize,
    /// Write the rows as JSON here (rank 0).
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

#[derive(Debug, serde::Serialize)]
struct Row {
    bytes: usize,
    count: usize,
    dtype: &'static str,
    path: Option<&'static str>,
    wrong: f64,
    total_us: f64,
    /// The three steps (None within one node, where there is no hierarchy).
    reduce_scatter_us: Option<f64>,
    nccl_between_nodes_us: Option<f64>,
    all_gather_us: Option<f64>,
    /// Flat NCCL over the whole job, when it runs here.
    flat_nccl_us: Option<f64>,
}

pub fn run(args: SplitArgs) -> i32 {
    if let Some(code) = relaunch_unless_rank(&args.ranks) {
        return code;
    }
    match split(&args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// The slowest rank's value: a collective takes as long as its last rank.
fn slowest(comm: &mut ipcreduce::Communicator, v: f64) -> Result<f64> {
    Ok(gather_f64(comm, v)?.into_iter().fold(0.0, f64::max))
}

fn split(args: &SplitArgs) -> Result<()> {
    let mut comm = join(&args.ranks, true)?;
    let rank = comm.rank();
    let layout = comm.bootstrap().layout().clone();
    let biggest = args.sizes.iter().copied().max().unwrap_or(0).max(16);
    let bufs = Buffers::new(&mut comm, biggest)?;
    let nccl = comm.unavailable(Algorithm::Nccl).is_none();
    if rank == 0 {
        println!(
            "# split: world {}, {} node(s) of {}, {}, flat NCCL {}",
            comm.world(),
            layout.node_count(),
            layout.local_size(),
            args.dtype,
            if nccl { "beside" } else { "unavailable" }
        );
        println!(
            "{:>12} {:>10} {:>20} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "bytes", "count", "path", "wrong", "total_us", "rs_us", "nccl_us", "ag_us", "flat_us"
        );
    }
    let mut rows = Vec::new();
    for (k, &bytes) in args.sizes.iter().enumerate() {
        let count = (bytes / args.dtype.size()).max(1);
        let call = Call {
            send: bufs.send,
            recv: bufs.recv,
            count,
            dtype: args.dtype,
            op: ReduceOp::Sum,
            algo: Algorithm::Auto,
            offset: 0,
        };
        let checked = run_checked(&mut comm, &call, 1000 + k as u64)?;
        let path = comm.last_path().map(|p| p.name);
        let wrong = gather_f64(&mut comm, checked.wrong as f64)?
            .iter()
            .sum::<f64>();
        let total = comm.test_time(&call, args.warmup, args.iters, None)?;
        let total = slowest(&mut comm, total)?;
        // Every rank gets the same answer (the same layout), so all take part or none.
        let mut p = [None; 3];
        if let Some(phases) = comm.test_time_phases(&call, args.warmup, args.iters)? {
            for (i, v) in phases.iter().enumerate() {
                p[i] = Some(slowest(&mut comm, *v)?);
            }
        }
        let flat = if nccl {
            let c = Call {
                algo: Algorithm::Nccl,
                ..call
            };
            let t = comm.test_time(&c, args.warmup, args.iters, None)?;
            Some(slowest(&mut comm, t)?)
        } else {
            None
        };
        let row = Row {
            bytes: count * args.dtype.size(),
            count,
            dtype: args.dtype.name(),
            path,
            wrong,
            total_us: total,
            reduce_scatter_us: p[0],
            nccl_between_nodes_us: p[1],
            all_gather_us: p[2],
            flat_nccl_us: flat,
        };
        if rank == 0 {
            let us = |t: Option<f64>| t.map_or("-".into(), |t| format!("{t:.1}"));
            println!(
                "{:>12} {:>10} {:>20} {:>6} {:>10.1} {:>10} {:>10} {:>10} {:>10}",
                row.bytes,
                row.count,
                row.path.unwrap_or("-"),
                row.wrong,
                row.total_us,
                us(row.reduce_scatter_us),
                us(row.nccl_between_nodes_us),
                us(row.all_gather_us),
                us(row.flat_nccl_us)
            );
        }
        rows.push(row);
    }
    bufs.free(&mut comm);
    if rank == 0 {
        if let Some(path) = &args.json {
            let doc = serde_json::json!({
                "date": utc_now(),
                "commit": env!("IPCREDUCE_GIT_COMMIT"),
                "world": comm.world(),
                "nodes": layout.node_count(),
                "ranks_per_node": layout.local_size(),
                "devices": comm.meta().devices,
                "nccl_version": comm.meta().nccl_version,
                "note": "NCCL between nodes over loopback sockets when the nodes share a machine: not a network figure",
                "rows": rows,
            });
            let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
            std::fs::write(path, text).map_err(|e| ipcreduce::Error::Io {
                op: format!("writing {}", path.display()),
                source: e,
            })?;
        }
        let bad = rows.iter().filter(|r| r.wrong > 0.0).count();
        println!("{} sizes, {bad} with wrong elements", rows.len());
    }
    Ok(())
}
