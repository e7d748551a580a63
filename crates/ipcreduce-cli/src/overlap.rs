//! `ipcreduce overlap`: a training-loop benchmark, compute overlapped with a bucketed
//! all-reduce of the gradients, run with ipcreduce and with NCCL on the same buffers.
//!
//! One step emulates data-parallel backprop: the gradients (`--grad-bytes` of bf16) become
//! ready bucket by bucket (`--bucket-bytes`), and each bucket is all-reduced as soon as it is
//! ready while the compute of the next one goes on:
//!
//! ```text
//! compute stream:  [piece 0][piece 1][piece 2] ...              (--compute-us in all)
//!                          \ ev 0   \ ev 1   \ ev 2
//! comm stream:              [reduce 0][reduce 1][reduce 2] ...  (out of place)
//! ```
//!
//! A step starts on the compute stream once the previous step's last all-reduce is done (the
//! optimizer needs every reduced gradient), and ends when both streams are done. Its time is
//! measured on the device with CUDA events, from the start to the later of the two ends. The
//! host reads the events every 256 steps (waiting for the GPU then), so the step after each
//! read may carry a few microseconds of launch latency. A step's reported time is its slowest
//! rank's; the table summarises those over the timed steps.
//!
//! Everything runs on the communicator's GPU and context. The gradients and their reduced copy
//! are registered buffers from `Communicator::alloc` (zero-copy calls; `--plain` for staged
//! ones), the all-reduces go on a stream of the highest priority (as training frameworks do),
//! and uploads and read-backs on the communicator's own stream. Before the algorithms, the
//! same steps run without communication: the exposed communication of an algorithm is its
//! mean step minus that compute-only mean. Run it with two `--compute-us` values (the device
//! script runs 2000 and 8000) to see a communication-bound and a compute-bound step.
//!
//! The compute pieces are a compute-bound kernel (kernels/compute.cu) calibrated once at
//! start so that one piece lasts `--compute-us / buckets`. The gradients are filled once with
//! the reference input; after each algorithm's loop the reduced gradients (poisoned before the
//! loop) are checked element by element against the float64 reference. Any wrong element
//! makes the exit status 1.

use crate::cli::{join, parse_size, relaunch_unless_rank, RankArgs};
use crate::gpu::{comm_context, cu, Memory};
use crate::harness::{gather_f64, gather_u64, RunMeta};
use cudarc::driver::{safe as cs, sys};
use ipcreduce::backend::cuda::driver::ck;
use ipcreduce::backend::cuda::kernels::{self, COMPUTE_KERNEL, COMPUTE_THREADS};
use ipcreduce::backend::cuda::memory::DeviceAlloc;
use ipcreduce::error::{Error, Result};
use ipcreduce::reference::{count_wrong_par, fill_input_par};
use ipcreduce::types::{Algorithm, BackendChoice, BackendKind, DType, ReduceOp};
use ipcreduce::Communicator;
use std::ffi::c_void;
use std::sync::Arc;

/// Element type of the gradients.
const DTYPE: DType = DType::Bf16;
/// At most this many buckets: every bucket is a kernel launch and an all-reduce per step.
pub const MAX_BUCKETS: usize = 1 << 16;
/// At most this many timed steps: every rank's per-step times go through the bootstrap.
pub const MAX_STEPS: usize = 1_000_000;
/// Steps whose timing events are in flight at once: after this many the host waits for the
/// GPU and reads the times, so the event arrays stay small whatever `--steps` is.
const TIMING_WINDOW: usize = 256;

#[derive(clap::Args, Debug, Clone)]
pub struct OverlapArgs {
    #[command(flatten)]
    pub ranks: RankArgs,
    /// Timed training steps per algorithm.
    #[arg(long, default_value_t = 1000)]
    pub steps: usize,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    /// Bytes of bf16 gradients all-reduced per step (K, M, G suffixes).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub grad_bytes: usize,
    /// Bytes per bucket (one all-reduce each; the last one takes the rest).
    #[arg(long, default_value = "25M", value_parser = parse_size)]
    pub bucket_bytes: usize,
    /// Target duration of the compute phase of one step, in microseconds (0: no compute).
    #[arg(long, default_value_t = 2000)]
    pub compute_us: u64,
    /// Algorithms to compare, comma separated (auto, oneshot, twoshot, nccl).
    #[arg(
        short = 'a',
        long = "algo",
        value_delimiter = ',',
        default_value = "auto,nccl"
    )]
    pub algos: Vec<Algorithm>,
    /// Gradients in plain device memory (staged calls) instead of registered buffers from
    /// `Communicator::alloc` (zero-copy calls).
    #[arg(long)]
    pub plain: bool,
    /// Write the results as JSON to this file (rank 0).
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Seed of the gradient data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// One bucket of the gradients: bytes `[offset, offset + bytes)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Bucket {
    pub offset: usize,
    pub bytes: usize,
}

/// Splits `total` bytes into buckets of `bucket` bytes rounded down to a multiple of `elem`
/// (so every bucket starts on an element), the last one holding the rest.
pub fn buckets(total: usize, bucket: usize, elem: usize) -> Result<Vec<Bucket>, String> {
    if elem == 0 {
        return Err("element size 0".into());
    }
    if total == 0 || !total.is_multiple_of(elem) {
        return Err(format!(
            "--grad-bytes {total} must be a positive multiple of the {elem}-byte element"
        ));
    }
    let bucket = bucket / elem * elem;
    if bucket == 0 {
        return Err(format!(
            "--bucket-bytes must hold at least one {elem}-byte element"
        ));
    }
    let n = total.div_ceil(bucket);
    if n > MAX_BUCKETS {
        return Err(format!(
            "{total} bytes in buckets of {bucket} make {n} buckets (at most {MAX_BUCKETS})"
        ));
    }
    Ok((0..n)
        .map(|k| {
            let offset = k * bucket;
            Bucket {
                offset,
                bytes: bucket.min(total - offset),
            }
        })
        .collect())
}

/// Summary of a series of step times (milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Stats {
    pub mean: f64,
    pub median: f64,
    /// Nearest-rank 99th percentile: the smallest value with at least 99% of the series at or
    /// below it.
    pub p99: f64,
    pub min: f64,
    pub max: f64,
    /// Population standard deviation (divides by n): the spread of these steps, not an
    /// estimate for other runs.
    pub stddev: f64,
}

impl Stats {
    /// None for an empty series.
    pub fn of(values: &[f64]) -> Option<Stats> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let mean = v.iter().sum::<f64>() / n as f64;
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        // ceil(0.99 n) in integers, so 100 values give index 98, not a float-rounded 99.
        let p99 = v[(99 * n).div_ceil(100).clamp(1, n) - 1];
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        Some(Stats {
            mean,
            median,
            p99,
            min: v[0],
            max: v[n - 1],
            stddev: var.sqrt(),
        })
    }
}

/// For each step, the slowest rank's time: a data-parallel step is as slow as its slowest
/// rank. Series of different lengths are cut to the shortest.
pub fn slowest_per_step(per_rank: &[Vec<f64>]) -> Vec<f64> {
    let n = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (0..n)
        .map(|i| {
            per_rank
                .iter()
                .map(|r| r[i])
                .fold(f64::NEG_INFINITY, f64::max)
        })
        .collect()
}

/// What the options ask for, validated before any rank starts.
#[derive(Debug, Clone)]
struct Plan {
    buckets: Vec<Bucket>,
    algos: Vec<Algorithm>,
}

impl Plan {
    fn new(args: &OverlapArgs) -> Result<Plan, String> {
        if args.steps == 0 || args.steps > MAX_STEPS {
            return Err(format!("--steps must be between 1 and {MAX_STEPS}"));
        }
        let buckets = buckets(args.grad_bytes, args.bucket_bytes, DTYPE.size())?;
        let mut algos = Vec::new();
        for a in &args.algos {
            if !algos.contains(a) {
                algos.push(*a);
            }
        }
        if algos.is_empty() {
            return Err("-a names no algorithm".into());
        }
        Ok(Plan { buckets, algos })
    }
}

/// One line of the table / one JSON row. Times are each step's slowest rank (see
/// [`slowest_per_step`]), summarised over the timed steps.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub algo: Algorithm,
    /// What the algorithm runs for a full bucket (`auto` resolved).
    pub ran: Algorithm,
    /// The library's path, CTAs and zero-copy for the last bucket (`last_path`).
    pub path: Option<String>,
    pub ctas: Option<u32>,
    pub zero_copy: Option<bool>,
    pub steps: usize,
    pub step_ms: Stats,
    /// Exposed communication: the mean step minus the mean compute-only step.
    pub exposed_ms: f64,
    /// Wrong elements of the reduced gradients, summed over ranks.
    pub wrong: u64,
}

/// The compute kernel's calibration (rank 0's, used by every rank).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
struct Calibration {
    /// FMA rounds per thread of one compute piece.
    piece_iters: u32,
    /// One piece alone, as measured on rank 0 (median of a few).
    piece_us: f64,
    /// A whole step's pieces back to back without communication (slowest rank).
    compute_step_ms: f64,
}

pub fn run(args: OverlapArgs) -> i32 {
    // Argument and backend errors are found before any rank starts, so they print once.
    if let Err(e) = Plan::new(&args) {
        eprintln!("error: {e}");
        return 2;
    }
    if args.ranks.backend == BackendChoice::Host {
        eprintln!("error: overlap needs the cuda backend (compute and NCCL run on GPUs)");
        return 2;
    }
    if let Err(e) = ipcreduce::backend::cuda::usable() {
        eprintln!("error: overlap needs the cuda backend: {e}");
        return 2;
    }
    if let Some(code) = relaunch_unless_rank(&args.ranks) {
        return code;
    }
    match overlap(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

/// Runs the benchmark on this rank; the exit status (0, 1 when any result was wrong, 2 when
/// the ranks did not get the cuda backend).
fn overlap(args: &OverlapArgs) -> Result<i32> {
    let plan = Plan::new(args).map_err(Error::Config)?;
    let mut comm = join(&args.ranks, plan.algos.contains(&Algorithm::Nccl))?;
    let rank = comm.rank();
    if comm.backend() != BackendKind::Cuda {
        // Every rank sees the same agreed backend, so all of them stop here.
        if rank == 0 {
            eprintln!(
                "error: overlap needs the cuda backend, the ranks got {} (use --backend cuda to see why)",
                comm.backend()
            );
        }
        return Ok(2);
    }
    let algos = crate::bench::available(&mut comm, &plan.algos)?;
    if algos.is_empty() {
        return Err(Error::Config(
            "none of the requested algorithms can run here".into(),
        ));
    }

    let grad_bytes = args.grad_bytes;
    let gpu = Gpu::new(&mut comm, grad_bytes, !args.plain)?;
    // The gradients never change: the compute pieces write elsewhere, so after any number of
    // steps `reduced` must hold the sum of every rank's input.
    let mut host = vec![0u8; grad_bytes];
    fill_input_par(DTYPE, args.seed, rank, &mut host);
    gpu.upload(&host)?;

    let nb = plan.buckets.len();
    let cal = calibrate_agreed(&mut comm, &gpu, args.compute_us, nb)?;
    if rank == 0 {
        print_header(args, &plan, &comm, &gpu, &cal);
    }

    let total_steps = args.warmup + args.steps;
    // The same steps without communication: what a step costs when nothing is exposed.
    comm.bootstrap().barrier()?;
    let times = run_steps(
        &mut comm,
        &gpu,
        &plan.buckets,
        None,
        cal.piece_iters,
        total_steps,
    )?;
    let compute_only = slowest_steps(&mut comm, &times[args.warmup.min(times.len())..])?;
    let compute_only = Stats::of(&compute_only)
        .ok_or_else(|| Error::invalid(rank, "overlap", "no compute-only step was timed"))?;
    if rank == 0 {
        print_row(&compute_only_row(&compute_only));
    }
    let mut rows = Vec::new();
    for &algo in &algos {
        gpu.poison_reduced()?;
        comm.bootstrap().barrier()?;
        let times = run_steps(
            &mut comm,
            &gpu,
            &plan.buckets,
            Some(algo),
            cal.piece_iters,
            total_steps,
        )?;
        // Kernels record failures (timeouts, mismatches) on the device; this surfaces them.
        comm.synchronize()?;
        let path = comm.last_path();
        gpu.download(&mut host)?;
        let wrong_here = count_wrong_par(DTYPE, ReduceOp::Sum, args.seed, comm.world(), &host);
        let wrong: u64 = gather_u64(&mut comm, wrong_here as u64)?.iter().sum();
        let slow = slowest_steps(&mut comm, &times[args.warmup.min(times.len())..])?;
        let step_ms = Stats::of(&slow)
            .ok_or_else(|| Error::invalid(rank, "overlap", format!("{algo}: no step was timed")))?;
        let row = Row {
            algo,
            ran: comm.resolve_for(algo, DTYPE, plan.buckets[0].bytes),
            path: path.map(|p| p.name.to_string()),
            ctas: path.map(|p| p.ctas),
            zero_copy: path.map(|p| p.registered),
            steps: slow.len(),
            step_ms,
            exposed_ms: step_ms.mean - compute_only.mean,
            wrong,
        };
        if rank == 0 {
            print_row(&row);
        }
        rows.push(row);
    }
    let ratio = nccl_ratio(&rows);
    if rank == 0 {
        if let Some(r) = ratio {
            println!(
                "# nccl mean / ipcreduce mean: {r:.3} (above 1: ipcreduce's steps are faster)"
            );
        }
        if let Some(path) = &args.json {
            let meta = Meta {
                run: RunMeta::collect(&comm),
                args: args_json(args, &plan),
            };
            write_json(&report_json(&meta, &cal, &compute_only, &rows, ratio), path)?;
        }
    }
    gpu.free(&mut comm)?;
    Ok(if rows.iter().all(|r| r.wrong == 0) {
        0
    } else {
        1
    })
}

/// Each step's slowest rank over this rank's `timed` steps (collective).
fn slowest_steps(comm: &mut Communicator, timed: &[f64]) -> Result<Vec<f64>> {
    let mine: Vec<u8> = timed.iter().flat_map(|t| t.to_le_bytes()).collect();
    let per_rank: Vec<Vec<f64>> = comm
        .bootstrap()
        .all_gather(&mine)?
        .iter()
        .map(|b| {
            b.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect()
        })
        .collect();
    Ok(slowest_per_step(&per_rank))
}

/// The table line of the compute-only steps.
fn compute_only_row(s: &Stats) -> Row {
    Row {
        algo: Algorithm::Auto,
        ran: Algorithm::Auto,
        path: Some("compute only".into()),
        ctas: None,
        zero_copy: None,
        steps: 0,
        step_ms: *s,
        exposed_ms: 0.0,
        wrong: 0,
    }
}

/// NCCL's mean step time over ipcreduce's (`auto` if it ran, else the first other algorithm).
fn nccl_ratio(rows: &[Row]) -> Option<f64> {
    let nccl = rows.iter().find(|r| r.algo == Algorithm::Nccl)?;
    let ours = rows
        .iter()
        .find(|r| r.algo == Algorithm::Auto)
        .or_else(|| rows.iter().find(|r| r.algo != Algorithm::Nccl))?;
    Some(nccl.step_ms.mean / ours.step_ms.mean)
}

/// One step loop of `algo` (None: compute only); this rank's step times in milliseconds,
/// warm-up steps included.
fn run_steps(
    comm: &mut Communicator,
    gpu: &Gpu,
    buckets: &[Bucket],
    algo: Option<Algorithm>,
    piece_iters: u32,
    total_steps: usize,
) -> Result<Vec<f64>> {
    let rank = gpu.rank;
    let window = total_steps.clamp(1, TIMING_WINDOW);
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let new_events = |n: usize, flags: Option<sys::CUevent_flags>| -> Result<Vec<cs::CudaEvent>> {
        (0..n)
            .map(|_| gpu.ctx.new_event(flags).map_err(cu(rank, "cuEventCreate")))
            .collect()
    };
    let start = new_events(window, timing)?;
    let compute_end = new_events(window, timing)?;
    let comm_end = new_events(window, timing)?;
    // Only order the streams (no timing: cheaper to record). Re-recording one for the next
    // step is safe: a stream wait binds to the record made before it, not to later ones.
    let ready = new_events(buckets.len(), None)?;
    let comm_stream = gpu.comm.cu_stream() as *mut c_void;

    let mut times = Vec::with_capacity(total_steps);
    for step in 0..total_steps {
        let w = step % window;
        if step > 0 {
            // The next step's compute needs every reduced gradient of this one (optimizer).
            let prev = &comm_end[(step - 1) % window];
            gpu.compute
                .wait(prev)
                .map_err(cu(rank, "cuStreamWaitEvent"))?;
        }
        start[w]
            .record(&gpu.compute)
            .map_err(cu(rank, "cuEventRecord"))?;
        gpu.comm
            .wait(&start[w])
            .map_err(cu(rank, "cuStreamWaitEvent"))?;
        for (k, b) in buckets.iter().enumerate() {
            if piece_iters > 0 {
                gpu.launch_piece(piece_iters)?;
            }
            // No algorithm: the compute-only run (the same pieces, nothing reduced).
            let Some(algo) = algo else { continue };
            ready[k]
                .record(&gpu.compute)
                .map_err(cu(rank, "cuEventRecord"))?;
            gpu.comm
                .wait(&ready[k])
                .map_err(cu(rank, "cuStreamWaitEvent"))?;
            let send = (gpu.grads_ptr() + b.offset as u64) as *const c_void;
            let recv = (gpu.reduced_ptr() + b.offset as u64) as *mut c_void;
            // SAFETY: both ranges lie inside our allocations of grad_bytes (buckets cover
            // exactly grad_bytes) and do not overlap; the stream belongs to the communicator's
            // context, and the buffers outlive the loop (synchronized below).
            unsafe {
                comm.all_reduce_raw(
                    send,
                    recv,
                    b.bytes / DTYPE.size(),
                    DTYPE,
                    ReduceOp::Sum,
                    algo,
                    comm_stream,
                )?;
            }
        }
        compute_end[w]
            .record(&gpu.compute)
            .map_err(cu(rank, "cuEventRecord"))?;
        comm_end[w]
            .record(&gpu.comm)
            .map_err(cu(rank, "cuEventRecord"))?;
        if w == window - 1 || step == total_steps - 1 {
            // The window's events are about to be reused: read them all first.
            gpu.sync()?;
            for j in 0..=w {
                // The comm stream ends after the last piece anyway (it waits for it); taking
                // the later of the two keeps the time right if that ever changes.
                let compute = start[j]
                    .elapsed_ms(&compute_end[j])
                    .map_err(cu(rank, "cuEventElapsedTime"))?;
                let reduce = start[j]
                    .elapsed_ms(&comm_end[j])
                    .map_err(cu(rank, "cuEventElapsedTime"))?;
                times.push(f64::from(compute.max(reduce)));
            }
        }
    }
    Ok(times)
}

/// Calibrates on every rank and uses rank 0's result everywhere, so every rank does the same
/// work per step (as data-parallel replicas do).
fn calibrate_agreed(
    comm: &mut Communicator,
    gpu: &Gpu,
    compute_us: u64,
    pieces: usize,
) -> Result<Calibration> {
    if compute_us == 0 {
        return Ok(Calibration::default());
    }
    let target_us = compute_us as f64 / pieces as f64;
    let mine = calibrate(gpu, target_us)?;
    let all = gather_u64(comm, u64::from(mine))?;
    let piece_iters = u32::try_from(all[0]).unwrap_or(u32::MAX).max(1);
    let piece_us = median_of(5, || Ok(time_pieces(gpu, piece_iters, 1)? * 1e3))?;
    let step_ms = median_of(3, || time_pieces(gpu, piece_iters, pieces))?;
    let piece_us = gather_f64(comm, piece_us)?[0];
    let compute_step_ms = gather_f64(comm, step_ms)?.into_iter().fold(0.0, f64::max);
    Ok(Calibration {
        piece_iters,
        piece_us,
        compute_step_ms,
    })
}

/// FMA rounds per thread that make one piece last `target_us` on this GPU. A launch has a
/// fixed cost besides the rounds, so the cost per round comes from two sizes (t(2n) - t(n)),
/// both long enough (at least 200 us) for event timing to be precise.
fn calibrate(gpu: &Gpu, target_us: f64) -> Result<u32> {
    time_pieces(gpu, 1, 1)?; // first launch: module and clocks warm up
    let mut n: u32 = 1024;
    let mut t1 = min_of(3, || time_pieces(gpu, n, 1))? * 1e3;
    while t1 < 200.0 && n < (1 << 28) {
        n *= 2;
        t1 = min_of(3, || time_pieces(gpu, n, 1))? * 1e3;
    }
    let t2 = min_of(3, || time_pieces(gpu, 2 * n, 1))? * 1e3;
    // Guard against noise making the difference tiny or negative.
    let per_round = ((t2 - t1) / f64::from(n)).max(t2 / f64::from(2 * n) / 4.0);
    let fixed = (t1 - per_round * f64::from(n)).max(0.0);
    let rounds = ((target_us - fixed) / per_round).round();
    Ok(rounds.clamp(1.0, f64::from(u32::MAX)) as u32)
}

/// Milliseconds `count` back-to-back pieces of `iters` rounds take on the compute stream.
fn time_pieces(gpu: &Gpu, iters: u32, count: usize) -> Result<f64> {
    let rank = gpu.rank;
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let a = gpu
        .ctx
        .new_event(flags)
        .map_err(cu(rank, "cuEventCreate"))?;
    let b = gpu
        .ctx
        .new_event(flags)
        .map_err(cu(rank, "cuEventCreate"))?;
    a.record(&gpu.compute).map_err(cu(rank, "cuEventRecord"))?;
    for _ in 0..count {
        gpu.launch_piece(iters)?;
    }
    b.record(&gpu.compute).map_err(cu(rank, "cuEventRecord"))?;
    let ms = a.elapsed_ms(&b).map_err(cu(rank, "cuEventElapsedTime"))?;
    Ok(f64::from(ms))
}

fn min_of(n: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..n {
        best = best.min(f()?);
    }
    Ok(best)
}

fn median_of(n: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    let v = (0..n).map(|_| f()).collect::<Result<Vec<f64>>>()?;
    Ok(Stats::of(&v).map_or(0.0, |s| s.median))
}

/// This rank's GPU resources for the benchmark, in the communicator's (primary) context.
struct Gpu {
    rank: usize,
    grad_bytes: usize,
    registered: bool,
    /// Priority of the communication stream (lower is higher).
    comm_priority: i32,
    // Fields drop in this order after `Drop::drop` has waited for the streams: memory first
    // (nothing can use it any more), then streams, the module, and the context last.
    sink: DeviceAlloc,
    grads: Option<Memory>,
    reduced: Option<Memory>,
    /// The communicator's own stream: uploads, poisoning and read-backs (the communicator
    /// waits for it at teardown).
    setup: sys::CUstream,
    compute: Arc<cs::CudaStream>,
    comm: Arc<cs::CudaStream>,
    /// The compute kernel; it keeps its module loaded.
    kernel: cs::CudaFunction,
    blocks: u32,
    ctx: Arc<cs::CudaContext>,
}

impl Gpu {
    /// On the communicator's GPU and context; `registered`: the gradients and their reduced
    /// copy in buffers from `Communicator::alloc` (collective), so calls are zero-copy.
    fn new(comm: &mut Communicator, grad_bytes: usize, registered: bool) -> Result<Gpu> {
        let rank = comm.rank();
        let ctx = comm_context(comm)?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cu(rank, "compute capability query"))?;
        let ptx = kernels::compile_compute(&format!("sm_{major}{minor}")).map_err(|e| match e {
            Error::Cuda { op, detail, .. } => Error::Cuda { rank, op, detail },
            other => other,
        })?;
        let module = ctx
            .load_module(ptx)
            .map_err(cu(rank, "loading the compute module"))?;
        let kernel = module
            .load_function(COMPUTE_KERNEL)
            .map_err(cu(rank, "loading the compute kernel"))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cu(rank, "SM count query"))?;
        // Two blocks per SM: every SM busy, with room left for the all-reduce's blocks (they
        // must get on the GPU while compute runs, or nothing would overlap).
        let blocks = u32::try_from(sms).unwrap_or(1).max(1) * 2;
        let compute = ctx.new_stream().map_err(cu(rank, "cuStreamCreate"))?;
        // The all-reduces on the highest priority, as training frameworks do: a bucket's
        // blocks get on the SMs as soon as some compute block finishes, instead of queueing
        // behind the whole compute piece.
        let (_, highest) = cudarc::driver::result::stream::get_priority_range()
            .map_err(cu(rank, "cuCtxGetStreamPriorityRange"))?;
        let comm_stream = ctx
            .new_stream_with_priority(highest)
            .map_err(cu(rank, "cuStreamCreateWithPriority"))?;
        ctx.bind_to_thread()
            .map_err(cu(rank, "binding the context"))?;
        let setup = comm
            .cuda_stream()
            .ok_or_else(|| Error::invalid(rank, "overlap", "the communicator has no cuda stream"))?
            as sys::CUstream;
        let sink = DeviceAlloc::new(blocks as usize * COMPUTE_THREADS as usize * 4, rank)?;
        let grads = Memory::new(comm, grad_bytes, registered)?;
        let reduced = Memory::new(comm, grad_bytes, registered)?;
        Ok(Gpu {
            rank,
            grad_bytes,
            registered,
            comm_priority: highest,
            sink,
            grads: Some(grads),
            reduced: Some(reduced),
            setup,
            compute,
            comm: comm_stream,
            kernel,
            blocks,
            ctx,
        })
    }

    fn grads_ptr(&self) -> u64 {
        self.grads.as_ref().map_or(0, Memory::ptr)
    }

    fn reduced_ptr(&self) -> u64 {
        self.reduced.as_ref().map_or(0, Memory::ptr)
    }

    /// Waits for the work, then frees the gradients (collectively when registered).
    fn free(mut self, comm: &mut Communicator) -> Result<()> {
        self.bind()?;
        self.sync()?;
        for m in [self.grads.take(), self.reduced.take()]
            .into_iter()
            .flatten()
        {
            m.free(comm);
        }
        Ok(())
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cu(self.rank, "binding the context"))
    }

    /// Enqueues one compute piece of `iters` FMA rounds per thread on the compute stream.
    fn launch_piece(&self, iters: u32) -> Result<()> {
        self.bind()?;
        let mut out: sys::CUdeviceptr = self.sink.ptr;
        let mut iters = iters;
        let mut params = [
            (&mut out as *mut sys::CUdeviceptr).cast::<c_void>(),
            (&mut iters as *mut u32).cast::<c_void>(),
        ];
        // SAFETY: the kernel takes (float*, unsigned int), matching `params` (copied at
        // launch); it writes one float per thread of the grid, which is what `sink` holds.
        ck(
            unsafe {
                sys::cuLaunchKernel(
                    self.kernel.cu_function(),
                    self.blocks,
                    1,
                    1,
                    COMPUTE_THREADS,
                    1,
                    1,
                    0,
                    self.compute.cu_stream(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            self.rank,
            || "launching the compute kernel".into(),
        )
    }

    /// Copies `data` into the gradients. On our stream and waited for: a plain copy from
    /// pageable memory may return before its DMA lands, and non-blocking streams would not
    /// wait for it.
    fn upload(&self, data: &[u8]) -> Result<()> {
        assert!(data.len() <= self.grad_bytes);
        self.bind()?;
        // SAFETY: in bounds of our allocation; `data` outlives the synchronize below.
        ck(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    self.grads_ptr(),
                    data.as_ptr().cast(),
                    data.len(),
                    self.setup,
                )
            },
            self.rank,
            || format!("copying {} bytes of gradients to the device", data.len()),
        )?;
        self.sync()
    }

    /// Copies the reduced gradients into `out`.
    fn download(&self, out: &mut [u8]) -> Result<()> {
        assert!(out.len() <= self.grad_bytes);
        self.sync()?;
        // SAFETY: in bounds of our allocation; `out` outlives the synchronize below.
        ck(
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    out.as_mut_ptr().cast(),
                    self.reduced_ptr(),
                    out.len(),
                    self.setup,
                )
            },
            self.rank,
            || format!("copying {} bytes of results from the device", out.len()),
        )?;
        self.sync()
    }

    /// Fills the output with NaNs (all-ones bf16), so a bucket that is never written fails.
    fn poison_reduced(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: our allocation, whole.
        ck(
            unsafe { sys::cuMemsetD8Async(self.reduced_ptr(), 0xFF, self.grad_bytes, self.setup) },
            self.rank,
            || "poisoning the reduced gradients".into(),
        )?;
        self.sync()
    }

    /// Waits for the three streams.
    fn sync(&self) -> Result<()> {
        self.compute
            .synchronize()
            .map_err(cu(self.rank, "compute stream synchronize"))?;
        self.comm
            .synchronize()
            .map_err(cu(self.rank, "communication stream synchronize"))?;
        // SAFETY: the communicator's stream, alive as long as the communicator (which
        // outlives this struct).
        ck(
            unsafe { sys::cuStreamSynchronize(self.setup) },
            self.rank,
            || "communicator stream synchronize".into(),
        )
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Work may still be queued after an error: wait for it before the memory it uses is
        // freed (the fields drop after this).
        if let Err(e) = self.bind().and_then(|()| self.sync()) {
            tracing::warn!(rank = self.rank, "synchronize at teardown failed: {e}");
        }
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

fn print_header(
    args: &OverlapArgs,
    plan: &Plan,
    comm: &Communicator,
    gpu: &Gpu,
    cal: &Calibration,
) {
    let (first, last) = (plan.buckets[0], plan.buckets[plan.buckets.len() - 1]);
    println!(
        "# overlap: {} steps (+{} warm-up), {:.1} MiB of {} gradients in {} buckets of {:.1} MiB (last {:.1} MiB), sum",
        args.steps,
        args.warmup,
        mib(args.grad_bytes),
        DTYPE.name(),
        plan.buckets.len(),
        mib(first.bytes),
        mib(last.bytes)
    );
    if args.compute_us == 0 {
        println!("# compute: none (--compute-us 0): the steps time the all-reduce alone");
    } else {
        println!(
            "# compute: {} us per step asked; {} pieces of {} FMA rounds x {} blocks x {} threads, {:.1} us each alone (rank 0); all pieces alone: {:.3} ms (slowest rank)",
            args.compute_us,
            plan.buckets.len(),
            cal.piece_iters,
            gpu.blocks,
            COMPUTE_THREADS,
            cal.piece_us,
            cal.compute_step_ms
        );
    }
    println!(
        "# auto runs {} for a full bucket, {} for the last; times are each step's slowest rank",
        comm.resolve(Algorithm::Auto, first.bytes),
        comm.resolve(Algorithm::Auto, last.bytes)
    );
    println!(
        "# gradients in {} buffers; communication stream priority {} (lower is higher); exposed = mean step - mean compute-only step",
        if gpu.registered { "registered (zero-copy)" } else { "plain (staged)" },
        gpu.comm_priority
    );
    println!(
        "# {:>18} {:>7} {:>9} {:>10} {:>9} {:>9} {:>9} {:>10} {:>11} {:>7}",
        "algo",
        "steps",
        "mean(ms)",
        "median(ms)",
        "p99(ms)",
        "min(ms)",
        "max(ms)",
        "stddev(ms)",
        "exposed(ms)",
        "#wrong"
    );
}

fn algo_label(r: &Row) -> String {
    if r.steps == 0 {
        "compute-only".into()
    } else if r.algo == Algorithm::Auto {
        format!("auto:{}", r.ran)
    } else {
        r.algo.name().to_string()
    }
}

fn print_row(r: &Row) {
    let s = &r.step_ms;
    println!(
        "  {:>18} {:>7} {:>9.3} {:>10.3} {:>9.3} {:>9.3} {:>9.3} {:>10.3} {:>11.3} {:>7}",
        algo_label(r),
        r.steps,
        s.mean,
        s.median,
        s.p99,
        s.min,
        s.max,
        s.stddev,
        r.exposed_ms,
        r.wrong
    );
}

#[derive(Debug, serde::Serialize)]
struct Meta {
    #[serde(flatten)]
    run: RunMeta,
    /// The options as run (bucket size after rounding to the element).
    args: serde_json::Value,
}

fn write_json(doc: &serde_json::Value, path: &std::path::Path) -> Result<()> {
    let text = serde_json::to_string_pretty(doc).map_err(|e| Error::Config(e.to_string()))?;
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

fn args_json(args: &OverlapArgs, plan: &Plan) -> serde_json::Value {
    let last = plan.buckets[plan.buckets.len() - 1];
    serde_json::json!({
        "steps": args.steps,
        "warmup": args.warmup,
        "grad_bytes": args.grad_bytes,
        "bucket_bytes": plan.buckets[0].bytes,
        "last_bucket_bytes": last.bytes,
        "buckets": plan.buckets.len(),
        "dtype": DTYPE,
        "op": ReduceOp::Sum,
        "compute_us": args.compute_us,
        "buffers": if args.plain { "plain" } else { "registered" },
        "algos": plan.algos,
        "seed": args.seed,
    })
}

fn report_json(
    meta: &Meta,
    cal: &Calibration,
    compute_only: &Stats,
    rows: &[Row],
    ratio: Option<f64>,
) -> serde_json::Value {
    serde_json::json!({
        "meta": meta,
        "calibration": cal,
        "compute_only_ms": compute_only,
        "rows": rows,
        "nccl_over_ipcreduce_mean": ratio,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: OverlapArgs,
    }

    fn parse(argv: &[&str]) -> OverlapArgs {
        let mut full = vec!["overlap"];
        full.extend_from_slice(argv);
        Cli::try_parse_from(full)
            .unwrap_or_else(|e| panic!("{e}"))
            .args
    }

    #[test]
    fn defaults() {
        let a = parse(&[]);
        assert_eq!(a.steps, 1000);
        assert_eq!(a.warmup, 20);
        assert_eq!(a.grad_bytes, 1 << 30);
        assert_eq!(a.bucket_bytes, 25 << 20);
        assert_eq!(a.compute_us, 2000);
        assert_eq!(a.algos, vec![Algorithm::Auto, Algorithm::Nccl]);
        assert_eq!(a.seed, 1);
        assert!(a.json.is_none());
        assert_eq!(a.ranks.backend, BackendChoice::Auto);
        assert!(a.ranks.ranks.is_none());
        let plan = Plan::new(&a).unwrap();
        // 1 GiB in 25 MiB buckets: 40 full ones and 24 MiB left.
        assert_eq!(plan.buckets.len(), 41);
        assert_eq!(plan.buckets[40].bytes, 24 << 20);
    }

    #[test]
    fn options_parse() {
        let a = parse(&[
            "--steps",
            "10",
            "--grad-bytes",
            "64M",
            "--bucket-bytes",
            "4m",
            "--compute-us",
            "0",
            "-a",
            "twoshot,nccl,twoshot",
            "--warmup",
            "0",
            "--json",
            "/tmp/x.json",
            "--backend",
            "cuda",
            "--ranks",
            "2",
        ]);
        assert_eq!((a.steps, a.warmup, a.compute_us), (10, 0, 0));
        assert_eq!((a.grad_bytes, a.bucket_bytes), (64 << 20, 4 << 20));
        assert_eq!(a.ranks.backend, BackendChoice::Cuda);
        assert_eq!(a.ranks.ranks, Some(2));
        assert_eq!(a.json.as_deref(), Some(std::path::Path::new("/tmp/x.json")));
        let plan = Plan::new(&a).unwrap();
        assert_eq!(plan.algos, vec![Algorithm::TwoShot, Algorithm::Nccl]);
        assert_eq!(plan.buckets.len(), 16);

        let bad = |argv: &[&str]| {
            let mut full = vec!["overlap"];
            full.extend_from_slice(argv);
            Cli::try_parse_from(full).is_err()
        };
        assert!(bad(&["-a", "ring"]));
        assert!(bad(&["--grad-bytes", "1T"]));
        assert!(bad(&["--steps", "-1"]));
        assert!(Plan::new(&parse(&["--steps", "0"])).is_err());
        assert!(Plan::new(&parse(&["--grad-bytes", "3"])).is_err());
        assert!(Plan::new(&parse(&["--bucket-bytes", "1"])).is_err());
    }

    #[test]
    fn buckets_cover_the_gradients_exactly() {
        let b = buckets(10, 4, 2).unwrap();
        assert_eq!(
            b,
            vec![
                Bucket {
                    offset: 0,
                    bytes: 4
                },
                Bucket {
                    offset: 4,
                    bytes: 4
                },
                Bucket {
                    offset: 8,
                    bytes: 2
                },
            ]
        );
        // Bucket size rounded down to the element: 5 -> 4.
        assert_eq!(buckets(10, 5, 2).unwrap(), b);
        // One bucket when it is larger than everything.
        assert_eq!(
            buckets(8, 100, 2).unwrap(),
            vec![Bucket {
                offset: 0,
                bytes: 8
            }]
        );
        assert!(buckets(0, 4, 2).is_err());
        assert!(buckets(9, 4, 2).is_err());
        assert!(buckets(8, 1, 2).is_err());
        assert!(buckets(MAX_BUCKETS * 2 + 2, 2, 2).is_err());

        for (total, bucket) in [(1usize << 30, 25usize << 20), (1000, 998), (6, 6), (2, 2)] {
            let b = buckets(total, bucket, 2).unwrap();
            let mut next = 0;
            for (i, x) in b.iter().enumerate() {
                assert_eq!(x.offset, next, "contiguous");
                assert_eq!(x.offset % 2, 0, "aligned");
                assert!(x.bytes > 0 && x.bytes % 2 == 0);
                if i + 1 < b.len() {
                    assert_eq!(x.bytes, bucket / 2 * 2, "only the last is partial");
                }
                next += x.bytes;
            }
            assert_eq!(next, total, "covers everything");
        }
    }

    #[test]
    fn statistics_of_known_series() {
        let s = Stats::of(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]).unwrap();
        assert_eq!(s.mean, 5.0);
        assert_eq!(s.stddev, 2.0);
        assert_eq!(s.median, 4.5);
        assert_eq!((s.min, s.max), (2.0, 9.0));
        assert_eq!(s.p99, 9.0);

        let odd = Stats::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!(
            (odd.median, odd.mean, odd.min, odd.max),
            (2.0, 2.0, 1.0, 3.0)
        );

        // 1..=100: the 99th percentile is 99 (nearest rank), 1..=1000: 990.
        let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = Stats::of(&v).unwrap();
        assert_eq!((s.p99, s.median, s.mean), (99.0, 50.5, 50.5));
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(Stats::of(&v).unwrap().p99, 990.0);

        let one = Stats::of(&[1.5]).unwrap();
        assert_eq!(
            (one.mean, one.median, one.p99, one.stddev),
            (1.5, 1.5, 1.5, 0.0)
        );
        assert!(Stats::of(&[]).is_none());
    }

    #[test]
    fn each_step_takes_its_slowest_rank() {
        let per_rank = vec![vec![1.0, 5.0, 2.0], vec![3.0, 1.0, 2.5, 9.0]];
        assert_eq!(slowest_per_step(&per_rank), vec![3.0, 5.0, 2.5]);
        assert!(slowest_per_step(&[]).is_empty());
    }

    #[test]
    fn json_report_has_meta_args_and_rows() {
        let args = parse(&["--grad-bytes", "10", "--bucket-bytes", "5"]);
        let plan = Plan::new(&args).unwrap();
        let meta = Meta {
            run: crate::harness::RunMeta {
                backend: BackendKind::Cuda,
                world: 2,
                devices: vec!["GPU 0".into(), "GPU 1".into()],
                driver: None,
                nccl_version: Some("2.28.3".into()),
                commit: env!("IPCREDUCE_GIT_COMMIT"),
                date: crate::harness::utc_now(),
                host_cores: 1,
            },
            args: args_json(&args, &plan),
        };
        let row = Row {
            algo: Algorithm::Auto,
            ran: Algorithm::TwoShot,
            path: Some("twoshot-reg".into()),
            ctas: Some(16),
            zero_copy: Some(true),
            steps: 2,
            step_ms: Stats::of(&[1.0, 3.0]).unwrap(),
            exposed_ms: 0.5,
            wrong: 0,
        };
        let compute = Stats::of(&[1.5]).unwrap();
        let doc = report_json(&meta, &Calibration::default(), &compute, &[row], Some(1.25));
        assert_eq!(doc["meta"]["world"], 2);
        assert_eq!(doc["meta"]["args"]["bucket_bytes"], 4);
        assert_eq!(doc["meta"]["args"]["last_bucket_bytes"], 2);
        assert_eq!(doc["meta"]["args"]["buckets"], 3);
        assert_eq!(doc["meta"]["args"]["dtype"], "bf16");
        assert_eq!(doc["meta"]["args"]["algos"][1], "nccl");
        assert_eq!(doc["rows"][0]["ran"], "twoshot");
        assert_eq!(doc["rows"][0]["step_ms"]["mean"], 2.0);
        assert_eq!(doc["nccl_over_ipcreduce_mean"], 1.25);
        assert_eq!(doc["compute_only_ms"]["mean"], 1.5);
        assert_eq!(doc["rows"][0]["exposed_ms"], 0.5);
        assert_eq!(doc["rows"][0]["path"], "twoshot-reg");
        assert_eq!(doc["meta"]["args"]["buffers"], "registered");
    }

    #[test]
    fn ratio_is_nccl_over_auto() {
        let row = |algo, mean| Row {
            algo,
            ran: algo,
            path: None,
            ctas: None,
            zero_copy: None,
            steps: 1,
            step_ms: Stats::of(&[mean]).unwrap(),
            exposed_ms: 0.0,
            wrong: 0,
        };
        let rows = vec![row(Algorithm::Auto, 2.0), row(Algorithm::Nccl, 3.0)];
        assert_eq!(nccl_ratio(&rows), Some(1.5));
        assert_eq!(nccl_ratio(&rows[..1]), None);
        let rows = vec![row(Algorithm::Nccl, 3.0), row(Algorithm::TwoShot, 1.5)];
        assert_eq!(nccl_ratio(&rows), Some(2.0));
    }

    /// Compiles compute.cu with NVRTC. Needs libnvrtc but no GPU; like
    /// `kernels_compile_with_nvrtc`, `IPCREDUCE_REQUIRE_NVRTC=1` turns a skip into a failure.
    #[test]
    fn compute_kernel_compiles_with_nvrtc() {
        if !kernels::nvrtc_for_tests() {
            return;
        }
        for arch in ["sm_80", "sm_90"] {
            let ptx = kernels::compile_compute(arch).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            assert!(
                text.contains(&format!(".entry {COMPUTE_KERNEL}")),
                "{arch}: {COMPUTE_KERNEL} missing"
            );
            // The FMA loop must survive optimisation, and the result must be stored.
            assert!(text.contains("fma.rn.f32"), "{arch}: no FMA in the PTX");
            assert!(text.contains("st.global"), "{arch}: result not stored");
            // Two parameters: the output pointer (8 bytes) and the round count (4 bytes).
            assert!(text.contains(".param .u64"), "{arch}: pointer parameter");
            assert!(text.contains(".param .u32"), "{arch}: count parameter");
        }
    }

    #[test]
    fn kernel_constants_match_the_source() {
        assert!(
            kernels::COMPUTE_SOURCE.contains(&format!("#define COMPUTE_THREADS {COMPUTE_THREADS}"))
        );
        assert!(kernels::COMPUTE_SOURCE.contains(&format!(
            "{COMPUTE_KERNEL}(float* __restrict__ out, unsigned int iters)"
        )));
    }
}
