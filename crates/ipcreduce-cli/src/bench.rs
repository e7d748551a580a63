//! `ipcreduce bench`: nccl-tests-style timing table, every timed size checked.
//!
//! For each dtype, size, algorithm and mode (eager, and CUDA graph with `-G K`): fresh random
//! input, poisoned output, warm-up, timed calls (CUDA events on cuda, wall clock on host), then
//! the output of the timed calls is checked element by element against the float64 reference.
//! Times are the slowest rank's; any wrong element makes the exit status non-zero.

use crate::cli::{join, parse_size, relaunch_unless_rank, RankArgs};
use crate::harness::{gather_f64, gather_u64, prepare, verify, Buffers, RunMeta};
use ipcreduce::backend::Call;
use ipcreduce::error::Result;
use ipcreduce::types::{Algorithm, BackendKind, DType, ReduceOp};
use ipcreduce::Communicator;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub ranks: RankArgs,
    /// Algorithms, comma separated: auto, oneshot, twoshot, nccl, or all.
    #[arg(short = 'a', long = "algo", default_value = "all")]
    pub algos: String,
    /// Smallest message in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest message in bytes.
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = parse_size)]
    pub max_bytes: usize,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    pub step: usize,
    /// Data types, comma separated: float, half, bfloat16 (or f32, f16, bf16), or all.
    #[arg(short = 'd', long = "datatype", default_value = "float")]
    pub dtypes: String,
    /// Reduction: sum, max or min.
    #[arg(short = 'o', long = "op", default_value = "sum")]
    pub op: ReduceOp,
    /// Timed iterations per size.
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    pub iters: usize,
    /// Warm-up iterations per size.
    #[arg(short = 'w', long = "warmup", default_value_t = 5)]
    pub warmup: usize,
    /// Also time K calls captured in one CUDA graph (0 = eager only).
    #[arg(short = 'G', long = "cudagraph", default_value_t = 0)]
    pub graph: usize,
    /// Write the results as JSON to this file (rank 0).
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Seed of the random input data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// One line of the table / one JSON row.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub algo: Algorithm,
    /// What `auto` resolved to (same as algo otherwise).
    pub ran: Algorithm,
    pub dtype: DType,
    pub op: ReduceOp,
    pub mode: &'static str,
    pub bytes: usize,
    pub count: usize,
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    pub wrong: u64,
}

#[derive(Debug, serde::Serialize)]
struct Meta {
    #[serde(flatten)]
    run: RunMeta,
    iters: usize,
    warmup: usize,
    graph_calls: usize,
}

pub fn run(args: BenchArgs) -> i32 {
    if let Some(code) = relaunch_unless_rank(&args.ranks) {
        return code;
    }
    match bench(&args) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn parse_list<T>(s: &str, all: &[T]) -> Result<Vec<T>, String>
where
    T: Copy + std::str::FromStr<Err = String>,
{
    if s.eq_ignore_ascii_case("all") {
        return Ok(all.to_vec());
    }
    s.split(',').map(|p| p.trim().parse()).collect()
}

fn sizes(min: usize, max: usize, step: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        v.push(s);
        s = match s.checked_mul(step.max(2)) {
            Some(n) => n,
            None => break,
        };
    }
    v
}

/// Runs the sweep; Ok(false) when any result was wrong.
fn bench(args: &BenchArgs) -> Result<bool> {
    let all_algos = [
        Algorithm::Auto,
        Algorithm::OneShot,
        Algorithm::TwoShot,
        Algorithm::Nccl,
    ];
    let bad = |e: String| ipcreduce::Error::Config(e);
    let algos = parse_list(&args.algos, &all_algos).map_err(bad)?;
    let dtypes = parse_list(&args.dtypes, &DType::ALL).map_err(bad)?;
    let mut comm = join(&args.ranks, algos.contains(&Algorithm::Nccl))?;
    let rank = comm.rank();
    let mut modes = vec![("eager", None)];
    if args.graph > 0 {
        if comm.backend() == BackendKind::Cuda {
            modes.push(("graph", Some(args.graph)));
        } else if rank == 0 {
            println!("# -G ignored: CUDA graphs need the cuda backend");
        }
    }
    let algos: Vec<Algorithm> = algos
        .into_iter()
        .filter(|a| match comm.unavailable(*a) {
            Some(why) => {
                if rank == 0 {
                    println!("# {a}: unavailable: {why}");
                }
                false
            }
            None => true,
        })
        .collect();

    if rank == 0 {
        println!(
            "# {:>10} {:>11} {:>8} {:>5} {:>8} {:>5} {:>10} {:>8} {:>8} {:>6}",
            "size",
            "count",
            "type",
            "redop",
            "algo",
            "mode",
            "time(us)",
            "algbw",
            "busbw",
            "#wrong"
        );
        println!(
            "# {:>10} {:>11} {:>8} {:>5} {:>8} {:>5} {:>10} {:>8} {:>8} {:>6}",
            "(B)", "(elements)", "", "", "", "", "", "(GB/s)", "(GB/s)", ""
        );
    }
    let mut rows = Vec::new();
    let mut all_ok = true;
    let sizes = sizes(args.min_bytes, args.max_bytes, args.step);
    for &dtype in &dtypes {
        let max = sizes.last().copied().unwrap_or(0).max(dtype.size());
        let bufs = Buffers::new(&mut comm, max)?;
        for (si, &bytes) in sizes.iter().enumerate() {
            let count = (bytes / dtype.size()).max(1);
            for &algo in &algos {
                for &(mode, graph) in &modes {
                    let seed = args.seed ^ ((si as u64) << 32) ^ ((algo.code() as u64) << 48);
                    let call = Call {
                        send: bufs.send,
                        recv: bufs.recv,
                        count,
                        dtype,
                        op: args.op,
                        algo,
                        offset: 0,
                    };
                    let row = time_one(&mut comm, &call, mode, graph, args, seed)?;
                    all_ok &= row.wrong == 0;
                    if rank == 0 {
                        print_row(&row);
                    }
                    rows.push(row);
                }
            }
        }
        bufs.free(&mut comm);
    }
    if rank == 0 {
        if let Some(path) = &args.json {
            write_json(&comm, args, &rows, path)?;
        }
        let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
        println!("# rows: {}, wrong elements: {wrong}", rows.len());
    }
    Ok(all_ok)
}

fn time_one(
    comm: &mut Communicator,
    call: &Call,
    mode: &'static str,
    graph: Option<usize>,
    args: &BenchArgs,
    seed: u64,
) -> Result<Row> {
    let world = comm.world();
    let bytes = call.count * call.dtype.size();
    prepare(comm, call, seed)?;
    comm.synchronize()?;
    comm.bootstrap().barrier()?;
    let t = comm.test_time(call, args.warmup, args.iters, graph)?;
    // The output now holds the result of the last timed call: check all of it.
    let wrong_here = verify(comm, call, seed)?.wrong as u64;
    let time_us = gather_f64(comm, t)?.into_iter().fold(0.0, f64::max);
    let wrong = gather_u64(comm, wrong_here)?.iter().sum();
    let algbw = bytes as f64 / time_us / 1e3;
    let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
    Ok(Row {
        algo: call.algo,
        ran: comm.resolve(call.algo, bytes),
        dtype: call.dtype,
        op: call.op,
        mode,
        bytes,
        count: call.count,
        time_us,
        algbw_gbps: algbw,
        busbw_gbps: busbw,
        wrong,
    })
}

fn print_row(r: &Row) {
    let algo = if r.algo == Algorithm::Auto {
        format!("auto:{}", short(r.ran))
    } else {
        r.algo.name().to_string()
    };
    println!(
        "  {:>10} {:>11} {:>8} {:>5} {:>8} {:>5} {:>10.2} {:>8.2} {:>8.2} {:>6}",
        r.bytes,
        r.count,
        r.dtype.name(),
        r.op.name(),
        algo,
        r.mode,
        r.time_us,
        r.algbw_gbps,
        r.busbw_gbps,
        r.wrong
    );
}

fn short(a: Algorithm) -> &'static str {
    match a {
        Algorithm::OneShot => "1s",
        Algorithm::TwoShot => "2s",
        Algorithm::Nccl => "nccl",
        Algorithm::Auto => "auto",
        // Algorithm is non-exhaustive: a future one prints its own name.
        _ => a.name(),
    }
}

fn write_json(
    comm: &Communicator,
    args: &BenchArgs,
    rows: &[Row],
    path: &std::path::Path,
) -> Result<()> {
    let meta = Meta {
        run: RunMeta::collect(comm),
        iters: args.iters,
        warmup: args.warmup,
        graph_calls: args.graph,
    };
    let doc = serde_json::json!({ "meta": meta, "rows": rows });
    let text =
        serde_json::to_string_pretty(&doc).map_err(|e| ipcreduce::Error::Config(e.to_string()))?;
    std::fs::write(path, text)
        .map_err(|e| ipcreduce::Error::io(format!("writing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_sweep_is_geometric_and_inclusive() {
        assert_eq!(sizes(8, 64, 2), vec![8, 16, 32, 64]);
        assert_eq!(sizes(8, 100, 4), vec![8, 32]);
        assert_eq!(sizes(0, 1, 2), vec![1]);
    }

    #[test]
    fn lists_parse() {
        let a = parse_list("oneshot,nccl", &[Algorithm::Auto]).unwrap();
        assert_eq!(a, vec![Algorithm::OneShot, Algorithm::Nccl]);
        assert_eq!(parse_list("all", &DType::ALL).unwrap().len(), 3);
        assert!(parse_list::<DType>("f64", &DType::ALL).is_err());
    }
}
