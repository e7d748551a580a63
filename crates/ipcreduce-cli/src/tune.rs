//! `ipcreduce tune`: measures which algorithm and CTA count is fastest on this machine for
//! every message size and element size at this world size, and writes the tuning table
//! (`ipcreduce::tune`) that every communicator's `Auto` then consults (rank 0's copy).
//!
//! Each CTA count is a communicator of its own (the grid is fixed per communicator); the
//! default one also runs NCCL. Calls are timed like `bench` (registered buffers, except on the
//! host-staged transport, which has none; the input refreshed and every call checked on the
//! device, CUDA graph replays), and a wrong element fails the run. Rows of other world sizes
//! already in the file are kept. On the host-staged transport the table is its own
//! (`tune-staged.txt`, its key with P2P off: `TuneKey::through`).
//!
//! On the host backend it measures one-shot against two-shot (no CTAs there) with `bench`'s
//! host loop (back-to-back calls, each buffer pair's last output checked, the median of its
//! rounds, slowest rank) and writes the host table (`tune-host.txt`, keyed by the CPU:
//! `TuneKey::of_host`).

use crate::bench::cuda::CudaRunner;
use crate::bench::host::HostRunner;
use crate::bench::{measure_sane, parse_list, sizes, Measure};
use crate::cli::{parse_size, relaunch_with_progress, RankArgs};
use crate::harness::gather_f64;
use ipcreduce::error::{Error, Result};
use ipcreduce::plan::Fabric;
use ipcreduce::tune::{self, Sample, Table, TuneKey};
use ipcreduce::types::{Algorithm, BackendChoice, BackendKind, DType, ReduceOp};
use ipcreduce::{Communicator, Config};
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct TuneArgs {
    #[command(flatten)]
    pub ranks: RankArgs,
    /// Smallest message measured.
    #[arg(short = 'b', long = "minbytes", default_value = "4K", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest message measured (default 1G on cuda, 16M on host, where every rank holds a
    /// round of inputs and outputs in memory).
    #[arg(short = 'e', long = "maxbytes", value_parser = parse_size)]
    pub max_bytes: Option<usize>,
    /// Factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
    pub step: usize,
    /// Element types measured, one per element size (bf16 stands for 2 bytes, f32 for 4).
    #[arg(short = 'd', long = "datatype", default_value = "bf16,f32")]
    pub dtypes: String,
    /// CTA counts tried besides the library's own choice (comma separated; empty: none).
    /// Ignored on the host backend (no CTAs there).
    #[arg(long, default_value = "8,16,32,64")]
    pub ctas: String,
    /// Where to write the table (default: IPCREDUCE_TUNE_FILE, else the cache directory).
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
    /// Also write every measurement as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The timed loop of the backend tuned.
enum Runner {
    Cuda(CudaRunner),
    Host(HostRunner),
}

/// Timed calls and warm-up calls for a size: enough for a stable mean, few for large ones.
/// (On host they are a floor: the loop runs rounds of a few milliseconds each.)
pub fn iterations(bytes: usize) -> (usize, usize) {
    match bytes {
        b if b <= 1 << 20 => (50, 10),
        b if b <= 32 << 20 => (20, 5),
        _ => (5, 2),
    }
}

pub fn run(args: TuneArgs) -> i32 {
    // No bar with --json: such runs are scripted.
    if let Some(code) = relaunch_with_progress(&args.ranks, args.json.is_none()) {
        return code;
    }
    match tune_here(&args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn tune_here(args: &TuneArgs) -> Result<()> {
    let bad = |e: String| Error::Config(e);
    let dtypes = parse_list(&args.dtypes, &DType::ALL).map_err(bad)?;
    let mut grids: Vec<Option<usize>> = vec![None];
    // Auto may resolve to the host backend too: known once the first communicator is up.
    let mut host = args.ranks.backend == BackendChoice::Host;
    if !args.ctas.trim().is_empty() && !host {
        for c in args.ctas.split(',') {
            let n = c
                .trim()
                .parse::<usize>()
                .map_err(|_| bad(format!("--ctas: '{c}' is not a number")))?;
            grids.push(Some(n));
        }
    }
    let mut samples: Vec<(usize, Sample)> = Vec::new(); // (element size, sample)
    let mut world_key: Option<(usize, usize, Option<TuneKey>, Fabric)> = None;
    let mut progress: Option<crate::progress::Reporter> = None;
    let mut done = 0u64;
    for &grid in &grids {
        if host && grid.is_some() {
            break; // one communicator: no CTAs on host
        }
        let config = Config {
            backend: args.ranks.backend,
            blocks: grid,
            with_nccl: grid.is_none(),
            ..Config::default()
        };
        let mut comm = Communicator::init(&config)?;
        host |= comm.backend() == BackendKind::Host;
        let max_bytes = args
            .max_bytes
            .unwrap_or(if host { 16 << 20 } else { 1 << 30 });
        let sizes = sizes(args.min_bytes, max_bytes, args.step);
        let (rank, world) = (comm.rank(), comm.world());
        // One step per (grid, dtype, size): every algorithm of it measured.
        let steps = if host { 1 } else { grids.len() };
        let total = (steps * dtypes.len() * sizes.len()) as u64;
        let progress =
            progress.get_or_insert_with(|| crate::progress::Reporter::new(rank, total, "sizes"));
        if world_key.is_none() {
            let fabric = comm.fabric();
            let key = if host {
                Some(TuneKey::of_host())
            } else {
                // Through host memory a table of its own (TuneKey::through).
                comm.cuda_device()
                    .and_then(TuneKey::of_machine)
                    .map(|k| k.through(fabric))
            };
            world_key = Some((rank, world, key, fabric));
        }
        let algos: Vec<Algorithm> = [Algorithm::OneShot, Algorithm::TwoShot, Algorithm::Nccl]
            .into_iter()
            .filter(|a| comm.unavailable(*a).is_none())
            .collect();
        for &dtype in &dtypes {
            let capacity = sizes.last().copied().unwrap_or(0).max(dtype.size());
            let mut runner = if host {
                Runner::Host(HostRunner::new(&comm, capacity, false)?)
            } else {
                // Registered (zero-copy) buffers where the peers' memory is mapped; through
                // host memory there are none, and the calls copy in as users' calls do.
                let registered = comm.fabric() != Fabric::HostStaged;
                Runner::Cuda(CudaRunner::new(&mut comm, capacity, registered)?)
            };
            for &bytes in &sizes {
                let (iters, warmup) = iterations(bytes);
                for &algo in &algos {
                    let m = Measure {
                        dtype,
                        op: ReduceOp::Sum,
                        algo,
                        count: (bytes / dtype.size()).max(1),
                        world,
                        seed: 3 ^ (bytes as u64) << 20,
                        warmup,
                        iters,
                        graph: (!host).then_some(10),
                    };
                    let got = measure_sane(&mut comm, &m, |comm| match &mut runner {
                        Runner::Cuda(r) => r.measure(comm, &m),
                        Runner::Host(r) => r.measure(comm, &m),
                    })?;
                    let wrong = got.wrong_calls + got.wrong_final;
                    if wrong != 0 {
                        return Err(Error::invalid(
                            rank,
                            "tune",
                            format!(
                                "{wrong} wrong elements: {algo} {bytes} B {dtype}, grid {grid:?}"
                            ),
                        ));
                    }
                    let t = gather_f64(&mut comm, got.gross_us - got.refresh_us)?
                        .into_iter()
                        .fold(f64::NEG_INFINITY, f64::max);
                    let path = comm.last_path();
                    let sample = Sample {
                        bytes,
                        algo: algo.name().to_string(),
                        ctas: path
                            .map(|p| p.ctas)
                            .filter(|_| algo != Algorithm::Nccl && !host),
                        chunk: None,
                        time_us: t,
                    };
                    if rank == 0 {
                        println!(
                            "  {:>8} {:>11} {:>8} {:>14} {:>5} {:>10.2}",
                            dtype.name(),
                            bytes,
                            algo.name(),
                            path.map_or("-", |p| p.name),
                            sample.ctas.map_or("-".into(), |c| c.to_string()),
                            t
                        );
                    }
                    samples.push((dtype.size(), sample));
                }
                done += 1;
                progress.step(done);
            }
            if let Runner::Cuda(r) = runner {
                r.free(&mut comm);
            }
        }
    }
    let Some((0, world, key, fabric)) = world_key else {
        return Ok(());
    };
    let key = key.ok_or_else(|| bad("this machine's key (GPU, driver) cannot be read".into()))?;
    let backend = if host {
        BackendKind::Host
    } else {
        BackendKind::Cuda
    };
    let path = match &args.output {
        Some(p) => p.clone(),
        None => tune::cache_path_for(backend, fabric, |k| std::env::var(k).ok())
            .ok_or_else(|| bad("no place for the table: set IPCREDUCE_TUNE_FILE or HOME".into()))?,
    };
    write_table(&path, &key, world, &samples)?;
    if let Some(j) = &args.json {
        let rows: Vec<serde_json::Value> = samples
            .iter()
            .map(|(e, s)| {
                serde_json::json!({"world": world, "elem_bytes": e, "bytes": s.bytes,
                    "algo": s.algo, "ctas": s.ctas, "time_us": s.time_us})
            })
            .collect();
        let key = serde_json::json!({"gpu": key.gpu, "gpus": key.gpus, "p2p": key.p2p,
            "driver": key.driver});
        let text = serde_json::to_string_pretty(&serde_json::json!({"key": key, "samples": rows}))
            .map_err(|e| bad(e.to_string()))?;
        std::fs::write(j, text).map_err(|e| Error::io(format!("writing {}", j.display()), e))?;
    }
    Ok(())
}

/// Merges this world's rows into the table at `path` (rows of other worlds kept when the file
/// is this machine's) and writes it; prints the rows.
fn write_table(
    path: &std::path::Path,
    key: &TuneKey,
    world: usize,
    samples: &[(usize, Sample)],
) -> Result<()> {
    let (mut table, _) = tune::load(Some(path), key);
    table.key = Some(key.clone());
    let mut elems: Vec<usize> = samples.iter().map(|(e, _)| *e).collect();
    elems.sort_unstable();
    elems.dedup();
    for elem in elems {
        let mine: Vec<Sample> = samples
            .iter()
            .filter(|(e, _)| *e == elem)
            .map(|(_, s)| s.clone())
            .collect();
        table.replace(world, elem, tune::from_samples(world, elem, &mine));
    }
    print_table(&table);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    std::fs::write(path, table.to_text())
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    println!("# wrote {}", path.display());
    Ok(())
}

fn print_table(t: &Table) {
    println!("# world elem      from        to     algo  ctas  time(us) at size");
    for e in &t.entries {
        let to = if e.max_bytes == usize::MAX {
            "-".to_string()
        } else {
            e.max_bytes.to_string()
        };
        println!(
            "  {:>5} {:>4} {:>9} {:>9} {:>8} {:>5} {:>9.2} {}",
            e.world,
            e.elem_bytes,
            e.min_bytes,
            to,
            e.algo,
            e.ctas.map_or("-".into(), |c| c.to_string()),
            e.time_us,
            e.measured_bytes
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iterations_shrink_with_size() {
        assert_eq!(iterations(4096), (50, 10));
        assert_eq!(iterations(8 << 20), (20, 5));
        assert_eq!(iterations(1 << 30), (5, 2));
    }

    #[test]
    fn the_table_file_merges_worlds() {
        let dir = std::env::temp_dir().join(format!("ipcreduce-tune-cli-{}", std::process::id()));
        let path = dir.join("sub").join(tune::FILE_NAME);
        let key = TuneKey {
            gpu: "G".into(),
            gpus: 2,
            p2p: true,
            driver: "1".into(),
        };
        let s = |bytes, algo: &str, t| Sample {
            bytes,
            algo: algo.into(),
            ctas: Some(8),
            chunk: None,
            time_us: t,
        };
        let world2 = vec![(2, s(4096, "oneshot", 3.0)), (2, s(4096, "twoshot", 4.0))];
        write_table(&path, &key, 2, &world2).unwrap();
        let world4 = vec![(2, s(4096, "twoshot", 3.0)), (4, s(4096, "oneshot", 1.0))];
        write_table(&path, &key, 4, &world4).unwrap();
        let (t, note) = tune::load(Some(&path), &key);
        assert_eq!(note, None);
        assert_eq!(t.lookup(2, 2, 100).unwrap().algo, "oneshot");
        assert_eq!(t.lookup(4, 2, 100).unwrap().algo, "twoshot");
        assert_eq!(t.lookup(4, 4, 100).unwrap().algo, "oneshot");
        assert!(t.lookup(8, 2, 100).is_none());
        std::fs::remove_dir_all(&dir).ok();
    }
}
