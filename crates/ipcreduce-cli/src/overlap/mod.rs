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

mod gpu;
mod plan;
mod report;
mod steps;
#[cfg(test)]
mod tests;

use crate::cli::{join, parse_size, relaunch_unless_rank, RankArgs};
use crate::gpu::{comm_context, cu, Memory};
use crate::harness::{gather_f64, gather_u64, RunMeta};
use cudarc::driver::{safe as cs, sys};
use ipcreduce::backend::cuda::kernels::{self, COMPUTE_KERNEL, COMPUTE_THREADS};
use ipcreduce::error::{Error, Result};
use ipcreduce::reference::{count_wrong_par, fill_input_par};
use ipcreduce::types::{Algorithm, BackendChoice, BackendKind, DType, ReduceOp};
use ipcreduce::Communicator;
use std::ffi::c_void;
use std::sync::Arc;

use gpu::Gpu;
use plan::Plan;
pub use plan::{slowest_per_step, Bucket, Stats};
use report::*;
use steps::*;

/// Element type of the gradients.
pub(super) const DTYPE: DType = DType::Bf16;
/// At most this many buckets: every bucket is a kernel launch and an all-reduce per step.
pub const MAX_BUCKETS: usize = 1 << 16;
/// At most this many timed steps: every rank's per-step times go through the bootstrap.
pub const MAX_STEPS: usize = 1_000_000;
/// Steps whose timing events are in flight at once: after this many the host waits for the
/// GPU and reads the times, so the event arrays stay small whatever `--steps` is.
pub(super) const TIMING_WINDOW: usize = 256;

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
pub(super) struct Calibration {
    /// FMA rounds per thread of one compute piece.
    pub(super) piece_iters: u32,
    /// One piece alone, as measured on rank 0 (median of a few).
    pub(super) piece_us: f64,
    /// A whole step's pieces back to back without communication (slowest rank).
    pub(super) compute_step_ms: f64,
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
pub(super) fn overlap(args: &OverlapArgs) -> Result<i32> {
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
pub(super) fn slowest_steps(comm: &mut Communicator, timed: &[f64]) -> Result<Vec<f64>> {
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
pub(super) fn compute_only_row(s: &Stats) -> Row {
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
pub(super) fn nccl_ratio(rows: &[Row]) -> Option<f64> {
    let nccl = rows.iter().find(|r| r.algo == Algorithm::Nccl)?;
    let ours = rows
        .iter()
        .find(|r| r.algo == Algorithm::Auto)
        .or_else(|| rows.iter().find(|r| r.algo != Algorithm::Nccl))?;
    Some(nccl.step_ms.mean / ours.step_ms.mean)
}
