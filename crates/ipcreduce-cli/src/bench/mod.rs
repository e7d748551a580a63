//! `ipcreduce bench`: nccl-tests-style timing table, every timed call checked.
//!
//! For each registration (plain buffers, and with `--registered` buffers from
//! `Communicator::alloc` as well), dtype, size, algorithm and mode (eager, and CUDA graph with
//! `-G K`): the timed loop runs `x <- f(all_reduce(x))`, where the refresh `f` checks each
//! call's output against its exact value and writes the next, different input from it (see
//! [`pattern`]). A stale read, a missed element or a wrong sum in any call, warm-up and timed
//! ones alike, counts as wrong; the host then checks the last call's output again itself.
//! On cuda the refresh alone is timed the same way and subtracted, so `time_us` is the
//! all-reduce's share. On host, where calls are synchronous and a refresh between them would be
//! timed with them, the calls run back to back on inputs prepared before the timed span, cycling
//! through a few buffer pairs, and each pair's output is checked after it, in several rounds
//! (see host.rs). Times are the slowest
//! rank's (host: the median of the rounds, with their spread); any wrong element makes the exit
//! status non-zero.

pub mod algos;
pub(crate) mod cuda;
pub(crate) mod host;
pub mod pattern;
mod startup;

use crate::cli::{join, parse_size, refuse, relaunch_with_progress, typed_flag, RankArgs, Usage};
use crate::harness::{gather_f64, gather_u64, RunMeta};
use ipcreduce::error::{Error, Result};
use ipcreduce::types::{Algorithm, BackendKind, DType, ReduceOp};
use ipcreduce::Communicator;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub ranks: RankArgs,
    /// Algorithms, comma separated: auto, oneshot, twoshot, nccl, nccl-shm (NCCL with
    /// NCCL_P2P_DISABLE=1: its shared-memory transport; not together with nccl), or all.
    #[arg(short = 'a', long = "algo", default_value = "all")]
    pub algos: String,
    /// Smallest message in bytes (K, M, G suffixes).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    pub min_bytes: usize,
    /// Largest message in bytes (default 32M on cuda, 8M on host, where a sweep to 32M takes
    /// minutes on a small machine).
    #[arg(short = 'e', long = "maxbytes", value_parser = parse_size)]
    pub max_bytes: Option<usize>,
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
    /// Seed of the input patterns.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also run every ipcreduce algorithm on registered (zero-copy) buffers from
    /// `Communicator::alloc` (cuda), beside the plain ones.
    #[arg(long)]
    pub registered: bool,
    /// cuda: the input refresh before each call lets the next kernel launch at once
    /// (programmatic dependent launch), as PDL-aware producers do (e.g. GEMM libraries on
    /// Hopper): ipcreduce's kernels launched with PDL then start during the refresh and wait
    /// on the device for it (IPCREDUCE_PDL: eager calls by default, captured ones too with 1);
    /// NCCL's launch as usual.
    #[arg(long)]
    pub pdl_producer: bool,
    /// cuda: the input refresh after each call is launched with programmatic dependent launch
    /// and waits on the device for the call (a PDL-aware consumer): it launches while the
    /// call's kernel runs where that kernel lets it (IPCREDUCE_PDL_TRIGGER).
    #[arg(long)]
    pub pdl_consumer: bool,
}

/// One line of the table / one JSON row.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub algo: Algorithm,
    /// What `auto` resolved to (same as algo otherwise).
    pub ran: Algorithm,
    /// The library's name of the path that ran (kernel family, copy engine...), else `ran`.
    pub path: String,
    /// Thread blocks the path used, when the library says.
    pub ctas: Option<u32>,
    /// Whether the buffers came from `Communicator::alloc`.
    pub registered: bool,
    /// Whether the library ran the call without a staging copy, when it says.
    pub zero_copy: Option<bool>,
    /// NCCL rows: which NCCL ("default", or "shm": P2P off, its shared-memory transport).
    pub nccl: Option<algos::NcclFlavor>,
    pub dtype: DType,
    pub op: ReduceOp,
    pub mode: &'static str,
    pub bytes: usize,
    pub count: usize,
    /// Per call: the loop's time minus the refresh's (slowest rank); with several rounds
    /// (host), the median over the rounds of the slowest rank's mean.
    pub time_us: f64,
    /// The fastest and slowest round (each the slowest rank's mean; equal to `time_us` when
    /// one round was measured).
    pub time_min_us: f64,
    pub time_max_us: f64,
    /// Rounds measured.
    pub rounds: usize,
    /// Per call of the loop, all-reduce and refresh together (slowest rank).
    pub gross_us: f64,
    /// Per refresh alone (slowest rank).
    pub refresh_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    /// Checked calls per rank (warm-up and timed).
    pub calls: u64,
    /// Wrong output elements over every call (checked on the device) plus wrong elements
    /// of the last output (checked on the host), summed over ranks.
    pub wrong: u64,
}

#[derive(Debug, serde::Serialize)]
struct Meta {
    #[serde(flatten)]
    run: RunMeta,
    iters: usize,
    warmup: usize,
    graph_calls: usize,
    seed: u64,
    timing: &'static str,
    /// NCCL_P2P_DISABLE as NCCL saw it in this run (None: unset).
    nccl_p2p_disable: Option<String>,
    /// IPCREDUCE_PDL as set in this run (None: unset, the default).
    ipcreduce_pdl: Option<String>,
    /// The refresh let the next kernel launch early (`--pdl-producer`).
    pdl_producer: bool,
    /// The refresh was launched with programmatic dependent launch (`--pdl-consumer`).
    pdl_consumer: bool,
    /// IPCREDUCE_PDL_TRIGGER as set in this run (None: unset, the default).
    ipcreduce_pdl_trigger: Option<String>,
    /// Communicator init and the first checked call after it (slowest rank).
    startup: Option<startup::Startup>,
}

/// What one measurement asks for.
#[derive(Debug, Clone, Copy)]
pub struct Measure {
    pub dtype: DType,
    pub op: ReduceOp,
    pub algo: Algorithm,
    pub count: usize,
    pub world: usize,
    pub seed: u64,
    pub warmup: usize,
    pub iters: usize,
    /// Calls per CUDA graph (None: eager).
    pub graph: Option<usize>,
}

/// What one measurement found on this rank.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    pub gross_us: f64,
    pub refresh_us: f64,
    pub calls: u64,
    pub wrong_calls: u64,
    pub wrong_final: u64,
    /// Per round, this rank's time per call (us); the first `nrounds` are used. The cuda loop
    /// measures one round; the host loop several (see host.rs).
    pub rounds: [f64; MAX_ROUNDS],
    pub nrounds: usize,
}

/// Most rounds one measurement reports.
pub const MAX_ROUNDS: usize = 8;

/// The backend's timed loop.
enum Runner {
    Cuda(cuda::CudaRunner),
    Host(host::HostRunner),
}

impl Runner {
    fn new(
        comm: &mut Communicator,
        capacity: usize,
        registered: bool,
        pdl: cuda::RefreshPdl,
    ) -> Result<Runner> {
        Ok(match comm.backend() {
            BackendKind::Cuda => {
                Runner::Cuda(cuda::CudaRunner::new(comm, capacity, registered)?.with_pdl(pdl))
            }
            _ => Runner::Host(host::HostRunner::new(comm, capacity, registered)?),
        })
    }

    fn measure(&mut self, comm: &mut Communicator, m: &Measure) -> Result<Measured> {
        match self {
            Runner::Cuda(r) => r.measure(comm, m),
            Runner::Host(r) => r.measure(comm, m),
        }
    }

    fn free(self, comm: &mut Communicator) {
        if let Runner::Cuda(r) = self {
            r.free(comm);
        }
    }
}

pub fn run(args: BenchArgs) -> i32 {
    if let Err(e) = check_args(&args) {
        return refuse(&e);
    }
    // No bar with --json: such runs are scripted.
    if let Some(code) = relaunch_with_progress(&args.ranks, args.json.is_none()) {
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

/// Refuses, before any rank starts, a command line that would run nothing, run something
/// other than asked, or fail in every rank; the message quotes the flag as typed.
fn check_args(args: &BenchArgs) -> Result<(), Usage> {
    let flag = |short, long| typed_flag(Some(short), long);
    let p2p_env = std::env::var("NCCL_P2P_DISABLE").ok();
    // select's messages start with "-a LIST:"; quote the flag as typed instead.
    algos::select(&args.algos, p2p_env.as_deref())
        .map_err(|e| e.replacen("-a ", &format!("{} ", flag('a', "algo")), 1))?;
    let dtypes = parse_list(&args.dtypes, &DType::ALL)
        .map_err(|e| format!("{} {}: {e}", flag('d', "datatype"), args.dtypes))?;
    check_sweep(
        &dtypes,
        args.min_bytes,
        // Without -e the sweep ends at the backend's default, or at -b when that is larger.
        args.max_bytes.unwrap_or(usize::MAX),
        args.step,
        [
            flag('b', "minbytes"),
            flag('e', "maxbytes"),
            flag('f', "stepfactor"),
        ],
    )?;
    if args.iters == 0 {
        return Err(format!(
            "{} 0: each size needs at least one timed call",
            flag('n', "iters")
        ));
    }
    if let Some(n) = args.ranks.ranks.filter(|n| *n > pattern::MAX_WORLD) {
        return Err(format!(
            "--ranks {n}: bench checks exact results for at most {} ranks",
            pattern::MAX_WORLD
        ));
    }
    Ok(())
}

/// The size sweep `min, min*step, ... <= max` must hold at least one size, grow, and give
/// every size as a whole number of elements of every dtype (then `count * size` is the size
/// shown). `flags` are the minimum's, maximum's and step's as typed.
pub(crate) fn check_sweep(
    dtypes: &[DType],
    min: usize,
    max: usize,
    step: usize,
    flags: [String; 3],
) -> Result<(), Usage> {
    let [b, e, f] = flags;
    if step < 2 {
        return Err(format!(
            "{f} {step}: each size is the previous one times this factor, so it must be at \
             least 2"
        ));
    }
    if min > max {
        return Err(format!(
            "{b} is {}, larger than {e} ({}): no size to run",
            bytes_text(min),
            bytes_text(max)
        ));
    }
    let widest = dtypes.iter().copied().max_by_key(|d| d.size());
    if let Some(d) = widest.filter(|d| min == 0 || !min.is_multiple_of(d.size())) {
        let size = d.size();
        return Err(format!(
            "{b} {min}: not a whole number of {} elements ({size} bytes each); take a \
             multiple of {size}, e.g. {b} {}",
            d.name(),
            min.div_ceil(size).max(1) * size
        ));
    }
    Ok(())
}

/// `1073741824 B (1 GiB)`, or `8 B`.
fn bytes_text(b: usize) -> String {
    let short = crate::report::size_text(b as u64);
    if short == format!("{b} B") {
        short
    } else {
        format!("{b} B ({short})")
    }
}

pub(crate) fn parse_list<T>(s: &str, all: &[T]) -> Result<Vec<T>, String>
where
    T: Copy + std::str::FromStr<Err = String>,
{
    if s.eq_ignore_ascii_case("all") {
        return Ok(all.to_vec());
    }
    s.split(',').map(|p| p.trim().parse()).collect()
}

pub(crate) fn sizes(min: usize, max: usize, step: usize) -> Vec<usize> {
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

/// The algorithms every rank can run, in the order asked; rank 0 says why others are left out.
pub(crate) fn available(comm: &mut Communicator, algos: &[Algorithm]) -> Result<Vec<Algorithm>> {
    let mut keep = Vec::new();
    for &a in algos {
        let why = comm.unavailable(a);
        // NCCL may fail on one rank only: running it on the others would leave them waiting.
        let all = gather_u64(comm, u64::from(why.is_none()))?;
        if all.iter().all(|v| *v == 1) {
            keep.push(a);
        } else if comm.rank() == 0 {
            let why = why.unwrap_or_else(|| "unavailable on another rank".into());
            println!("# {a}: unavailable: {why}");
        }
    }
    Ok(keep)
}

/// Runs the sweep; Ok(false) when any result was wrong.
fn bench(args: &BenchArgs) -> Result<bool> {
    let bad = |e: String| ipcreduce::Error::Config(e);
    let p2p_env = std::env::var("NCCL_P2P_DISABLE").ok();
    let selection = algos::select(&args.algos, p2p_env.as_deref()).map_err(bad)?;
    let dtypes = parse_list(&args.dtypes, &DType::ALL).map_err(bad)?;
    if selection.set_p2p_disable {
        // Before NCCL's first init in this process (in `join`), which reads it once; no other
        // thread runs yet.
        std::env::set_var("NCCL_P2P_DISABLE", "1");
    }
    let algos = selection.algos.clone();
    let init_start = std::time::Instant::now();
    let mut comm = join(&args.ranks, algos.contains(&Algorithm::Nccl))?;
    let init = init_start.elapsed();
    let (rank, world) = (comm.rank(), comm.world());
    if world > pattern::MAX_WORLD {
        return Err(bad(format!(
            "bench checks exact results for at most {} ranks, this job has {world}",
            pattern::MAX_WORLD
        )));
    }
    let mut modes = vec![("eager", None)];
    if args.graph > 0 {
        if comm.backend() == BackendKind::Cuda {
            modes.push(("graph", Some(args.graph)));
        } else if rank == 0 {
            println!("# -G ignored: CUDA graphs need the cuda backend");
        }
    }
    let mut registrations = vec![false];
    if args.registered {
        match registration_unavailable(&comm) {
            None => registrations.push(true),
            Some(why) if rank == 0 => println!("# --registered: unavailable: {why}"),
            Some(_) => {}
        }
    }
    let algos = available(&mut comm, &algos)?;
    let cuda = comm.backend() == BackendKind::Cuda;
    let max_bytes = args.max_bytes.unwrap_or(
        if cuda {
            DEFAULT_MAX_CUDA
        } else {
            DEFAULT_MAX_HOST
        }
        .max(args.min_bytes),
    );

    let pdl = cuda::RefreshPdl {
        producer: args.pdl_producer,
        consumer: args.pdl_consumer,
    };
    // The table's first row's call, once, timed from the end of init (kernels compiled or
    // read from the cache on first use): the start-up figures. With -G, captured in a graph:
    // the first use of a kernel then happens inside a stream capture.
    let first_graph = modes.iter().find_map(|&(_, g)| g);
    let startup = match (dtypes.first(), algos.first()) {
        (Some(&dtype), Some(&algo)) => {
            let first = startup::Probe {
                dtype,
                op: args.op,
                algo,
                bytes: args.min_bytes,
                graph: first_graph,
            };
            Some(startup::measure(&mut comm, init, first, pdl)?)
        }
        _ => None,
    };
    if rank == 0 {
        if let Some(s) = &startup {
            s.print();
        }
        print_legend(args, cuda, max_bytes);
        print_header(cuda);
    }
    let mut rows = Vec::new();
    let sizes = sizes(args.min_bytes, max_bytes, args.step);
    let measurements = registrations.len() * dtypes.len() * sizes.len() * algos.len() * modes.len();
    let mut progress = crate::progress::Reporter::new(rank, measurements as u64, "rows");
    for &registered in &registrations {
        for &dtype in &dtypes {
            let capacity = sizes.last().copied().unwrap_or(0).max(dtype.size());
            let mut runner = Runner::new(&mut comm, capacity, registered, pdl)?;
            for &bytes in &sizes {
                let count = (bytes / dtype.size()).max(1);
                // NCCL does not use our registration: its rows would repeat the plain ones.
                for &algo in algos
                    .iter()
                    .filter(|a| !(registered && **a == Algorithm::Nccl))
                {
                    for &(mode, graph) in &modes {
                        let m = Measure {
                            dtype,
                            op: args.op,
                            algo,
                            count,
                            world,
                            seed: args.seed ^ (bytes as u64) << 20 ^ u64::from(algo.code()) << 56,
                            warmup: args.warmup,
                            iters: args.iters,
                            graph,
                        };
                        let got = measure_sane(&mut comm, &m, |comm| runner.measure(comm, &m))?;
                        let mut row = make_row(&mut comm, &m, mode, registered, &got)?;
                        if algo == Algorithm::Nccl {
                            row.nccl = Some(selection.nccl);
                            row.path = selection.nccl.path().into();
                        }
                        if rank == 0 {
                            print_row(&row, cuda);
                        }
                        rows.push(row);
                        // Between measurements: the next one's timing starts after this.
                        progress.step(rows.len() as u64);
                    }
                }
            }
            runner.free(&mut comm);
        }
    }
    if rank == 0 {
        if let Some(path) = &args.json {
            write_json(&comm, args, &rows, startup.as_ref(), path)?;
        }
        let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
        println!("# rows: {}, wrong elements: {wrong}", rows.len());
    }
    let startup_wrong = startup.as_ref().map_or(0, |s| s.wrong);
    Ok(startup_wrong == 0 && rows.iter().all(|r| r.wrong == 0))
}

/// Why registered buffers cannot be benchmarked here, if they cannot (the same on every rank).
fn registration_unavailable(comm: &Communicator) -> Option<String> {
    if comm.backend() != BackendKind::Cuda {
        return Some("registered buffers need the cuda backend".into());
    }
    (comm.fabric() == ipcreduce::plan::Fabric::HostStaged).then(|| {
        "registered buffers need peer memory, and this communicator stages through host memory"
            .into()
    })
}

/// What the library says ran for the last call: (path, CTAs, zero-copy); the algorithm when it
/// says nothing (host backend).
fn last_path(
    comm: &Communicator,
    algo: Algorithm,
    dtype: DType,
    bytes: usize,
) -> (String, Option<u32>, Option<bool>) {
    match comm.last_path() {
        Some(p) => (p.name.to_string(), Some(p.ctas), Some(p.registered)),
        // The tuning table's choice where it has one, as the call took it.
        None => (
            comm.resolve_for(algo, dtype, bytes).name().to_string(),
            None,
            None,
        ),
    }
}

/// How many times a measurement is taken when a rank's time comes out as nothing or less.
const SANE_ATTEMPTS: usize = 3;

/// `measure`, taken again when any rank's time per call is zero or negative: what the
/// machine's noise in the subtracted refresh loop can give (see bench/cuda.rs), never a time
/// to report. Collective: every rank sees the same gathered times, so all measure again
/// together; after `SANE_ATTEMPTS` it is an error naming the rank and the times.
pub(crate) fn measure_sane(
    comm: &mut Communicator,
    m: &Measure,
    mut measure: impl FnMut(&mut Communicator) -> Result<Measured>,
) -> Result<Measured> {
    for attempt in 1..=SANE_ATTEMPTS {
        let got = measure(comm)?;
        let least = got.rounds[..got.nrounds]
            .iter()
            .copied()
            // NaN-aware: f64::min would drop a NaN round in favour of a good one.
            .fold(f64::INFINITY, |least, t| {
                if t.is_nan() || least.is_nan() {
                    f64::NAN
                } else {
                    least.min(t)
                }
            });
        let all = gather_f64(comm, least)?;
        let Some(bad) = all.iter().position(|t| t.is_nan() || *t <= 0.0) else {
            return Ok(got);
        };
        if attempt == SANE_ATTEMPTS {
            return Err(Error::invalid(
                comm.rank(),
                "bench",
                format!(
                    "{} bytes {}: rank {bad} timed {:.3} us per call (the calls with the \
                     refresh {:.3} us, the refresh alone {:.3} us on this rank) in each of \
                     {SANE_ATTEMPTS} attempts: the machine is too noisy to time this size",
                    m.count * m.dtype.size(),
                    m.algo,
                    all[bad],
                    got.gross_us,
                    got.refresh_us
                ),
            ));
        }
    }
    unreachable!("the last attempt returns")
}

/// Gathers one measurement from every rank into a row (collective).
fn make_row(
    comm: &mut Communicator,
    m: &Measure,
    mode: &'static str,
    registered: bool,
    got: &Measured,
) -> Result<Row> {
    let world = comm.world();
    let bytes = m.count * m.dtype.size();
    let slowest = |v: Vec<f64>| v.into_iter().fold(f64::NEG_INFINITY, f64::max);
    // Per round, the slowest rank's time; then the median and spread of the rounds.
    let mut per_round = Vec::with_capacity(got.nrounds);
    for &t in &got.rounds[..got.nrounds] {
        per_round.push(slowest(gather_f64(comm, t)?));
    }
    let mut sorted = per_round.clone();
    sorted.sort_by(f64::total_cmp);
    let time_us = sorted[sorted.len() / 2];
    let (time_min_us, time_max_us) = (sorted[0], sorted[sorted.len() - 1]);
    let gross_us = slowest(gather_f64(comm, got.gross_us)?);
    let refresh_us = slowest(gather_f64(comm, got.refresh_us)?);
    let wrong = gather_u64(comm, got.wrong_calls + got.wrong_final)?
        .iter()
        .sum();
    let algbw = bytes as f64 / time_us / 1e3;
    let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
    let (path, ctas, zero_copy) = last_path(comm, m.algo, m.dtype, bytes);
    Ok(Row {
        algo: m.algo,
        ran: comm.resolve_call(m.algo, m.dtype, bytes, registered),
        path,
        ctas,
        registered,
        zero_copy,
        nccl: None,
        dtype: m.dtype,
        op: m.op,
        mode,
        bytes,
        count: m.count,
        time_us,
        time_min_us,
        time_max_us,
        rounds: got.nrounds,
        gross_us,
        refresh_us,
        algbw_gbps: algbw,
        busbw_gbps: busbw,
        calls: got.calls,
        wrong,
    })
}

/// `-e` without a value: cuda.
const DEFAULT_MAX_CUDA: usize = 32 << 20;
/// `-e` without a value: host (a sweep to 32 MiB takes minutes on two cores).
const DEFAULT_MAX_HOST: usize = 8 << 20;

/// The columns: (name, unit, width, cuda only).
const COLUMNS: [(&str, &str, usize, bool); 13] = [
    ("size", "(B)", 10, false),
    ("count", "(elements)", 11, false),
    ("type", "", 8, false),
    ("redop", "", 5, false),
    ("algo", "", 8, false),
    ("path", "", 14, false),
    ("ctas", "", 4, true),
    ("reg", "", 3, true),
    ("mode", "", 5, true),
    ("time(us)", "", 10, false),
    ("algbw", "(GB/s)", 8, false),
    ("busbw", "(GB/s)", 8, false),
    ("#wrong", "", 6, false),
];

/// What the columns mean, before the table (rank 0): what is timed and over which calls,
/// what `auto:1s` says, where the path comes from.
fn print_legend(args: &BenchArgs, cuda: bool, max_bytes: usize) {
    let default_e = if args.max_bytes.is_none() {
        " (the default; -e for larger)"
    } else {
        ""
    };
    println!(
        "# sizes {} to {}{default_e}, x{} each step",
        bytes_text(args.min_bytes),
        bytes_text(max_bytes),
        args.step
    );
    let how = if cuda {
        "the loop's time (call + input refresh) minus the refresh's, per call"
    } else {
        "calls back to back on inputs prepared before the timed span, cycling through buffer \
         pairs that fit one core's L2 (at least two), each pair's last output checked after it; \
         per round as many untimed lead-in calls as timed ones, then each rank's mean, the \
         slowest rank's, median of 7 rounds (at least the timed calls asked for, more for small \
         messages: rounds of about 10 ms)"
    };
    println!(
        "# time(us): mean per call over {} timed calls after {} warm-up calls, of the slowest \
         rank; {how}",
        args.iters.max(1),
        args.warmup
    );
    println!(
        "# algo: as asked; auto:1s / auto:2s is auto, which ran one-shot / two-shot at that size"
    );
    if cuda {
        println!(
            "# path: what the library ran (kernel family, copy engine, nccl); ctas: its thread \
             blocks; reg: registered (zero-copy) buffers; mode: eager, or graph (-G calls per \
             CUDA graph)"
        );
    } else {
        println!("# path: the algorithm the host backend ran");
    }
    println!(
        "# algbw: size / time; busbw: algbw x 2(world-1)/world (nccl-tests); #wrong: wrong \
         elements over the outputs checked, warm-up included"
    );
}

fn print_header(cuda: bool) {
    for line in [0, 1] {
        let mut text = String::from("#");
        for &(name, unit, width, cuda_only) in &COLUMNS {
            if cuda_only && !cuda {
                continue;
            }
            let cell = if line == 0 { name } else { unit };
            text.push_str(&format!(" {cell:>width$}"));
        }
        println!("{}", text.trim_end());
    }
}

/// How a row names its algorithm: `auto:<what ran>` for auto.
pub(crate) fn algo_label(algo: Algorithm, ran: Algorithm) -> String {
    if algo == Algorithm::Auto {
        format!("auto:{}", short(ran))
    } else {
        algo.name().to_string()
    }
}

fn print_row(r: &Row, cuda: bool) {
    let cells = [
        r.bytes.to_string(),
        r.count.to_string(),
        r.dtype.name().to_string(),
        r.op.name().to_string(),
        algo_label(r.algo, r.ran),
        r.path.clone(),
        r.ctas.map_or("-".to_string(), |c| c.to_string()),
        if r.registered { "yes" } else { "no" }.to_string(),
        r.mode.to_string(),
        format!("{:.2}", r.time_us),
        format!("{:.2}", r.algbw_gbps),
        format!("{:.2}", r.busbw_gbps),
        r.wrong.to_string(),
    ];
    let mut text = String::from(" ");
    for (cell, &(_, _, width, cuda_only)) in cells.iter().zip(&COLUMNS) {
        if cuda_only && !cuda {
            continue;
        }
        text.push_str(&format!(" {cell:>width$}"));
    }
    println!("{text}");
}

fn short(a: Algorithm) -> &'static str {
    match a {
        Algorithm::OneShot => "1s",
        Algorithm::TwoShot => "2s",
        other => other.name(),
    }
}

fn write_json(
    comm: &Communicator,
    args: &BenchArgs,
    rows: &[Row],
    startup: Option<&startup::Startup>,
    path: &std::path::Path,
) -> Result<()> {
    let meta = Meta {
        run: RunMeta::collect(comm),
        iters: args.iters,
        warmup: args.warmup,
        graph_calls: args.graph,
        seed: args.seed,
        timing: "time_us: per call, (all-reduce + input refresh) minus the refresh alone (cuda); \
                 host: back-to-back calls on inputs prepared before the timed span, each rank's \
                 mean per round, the slowest rank's, median of the rounds (time_min_us and \
                 time_max_us: the fastest and slowest round); every call's output checked",
        nccl_p2p_disable: std::env::var("NCCL_P2P_DISABLE").ok(),
        ipcreduce_pdl: std::env::var("IPCREDUCE_PDL").ok(),
        pdl_producer: args.pdl_producer,
        pdl_consumer: args.pdl_consumer,
        ipcreduce_pdl_trigger: std::env::var("IPCREDUCE_PDL_TRIGGER").ok(),
        startup: startup.cloned(),
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

    fn single_rank(tag: &str) -> Communicator {
        let dir =
            std::env::temp_dir().join(format!("ipcreduce-bench-{tag}-{}", std::process::id()));
        let info =
            ipcreduce::bootstrap::RankInfo::new(0, 1, dir.join("s.sock"), "bench-test", None)
                .unwrap();
        let config = ipcreduce::Config {
            backend: ipcreduce::BackendChoice::Host,
            ..ipcreduce::Config::default()
        };
        Communicator::with_rank_info(info, &config).unwrap()
    }

    fn timed(round: f64) -> Measured {
        let mut rounds = [0.0; MAX_ROUNDS];
        rounds[..2].copy_from_slice(&[3.0, round]);
        Measured {
            gross_us: 10.0,
            refresh_us: 10.0 - round,
            calls: 1,
            wrong_calls: 0,
            wrong_final: 0,
            rounds,
            nrounds: 2,
        }
    }

    fn a_measure() -> Measure {
        Measure {
            dtype: DType::F32,
            op: ReduceOp::Sum,
            algo: Algorithm::Auto,
            count: 2,
            world: 1,
            seed: 0,
            warmup: 0,
            iters: 1,
            graph: None,
        }
    }

    /// A round of nothing or less (the refresh alone timed slower than the calls with it) is
    /// measured again, and kept only once every round is a time.
    #[test]
    fn a_non_positive_time_is_measured_again() {
        let mut comm = single_rank("again");
        let mut given = [-14.5, 0.0, f64::NAN, 2.5].into_iter();
        let mut taken = 0;
        let got = measure_sane(&mut comm, &a_measure(), |_| {
            taken += 1;
            Ok(timed(given.next().unwrap()))
        });
        // The third (NaN) is the last attempt: an error, not a time.
        let e = got
            .expect_err("three bad attempts are an error")
            .to_string();
        assert_eq!(taken, SANE_ATTEMPTS);
        assert!(
            e.contains("rank 0 timed NaN us") && e.contains("8 bytes"),
            "{e}"
        );
        let got = measure_sane(&mut comm, &a_measure(), |_| {
            taken += 1;
            Ok(timed(if taken < 5 { -1.0 } else { 2.5 }))
        })
        .unwrap();
        assert_eq!(taken, 5);
        assert_eq!(got.rounds[1], 2.5);
    }

    #[test]
    fn lists_parse() {
        let a = parse_list("oneshot,nccl", &[Algorithm::Auto]).unwrap();
        assert_eq!(a, vec![Algorithm::OneShot, Algorithm::Nccl]);
        assert_eq!(parse_list("all", &DType::ALL).unwrap().len(), 3);
        assert!(parse_list::<DType>("f64", &DType::ALL).is_err());
    }
}
