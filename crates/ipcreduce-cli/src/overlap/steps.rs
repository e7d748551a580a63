//! The timed loops: training steps (compute pieces and bucketed all-reduces on two streams,
//! timed with events) and the compute kernel's calibration.

use super::*;

/// One step loop of `algo` (None: compute only); this rank's step times in milliseconds,
/// warm-up steps included.
pub(super) fn run_steps(
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
pub(super) fn calibrate_agreed(
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
pub(super) fn calibrate(gpu: &Gpu, target_us: f64) -> Result<u32> {
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
pub(super) fn time_pieces(gpu: &Gpu, iters: u32, count: usize) -> Result<f64> {
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

pub(super) fn min_of(n: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..n {
        best = best.min(f()?);
    }
    Ok(best)
}

pub(super) fn median_of(n: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    let v = (0..n).map(|_| f()).collect::<Result<Vec<f64>>>()?;
    Ok(Stats::of(&v).map_or(0.0, |s| s.median))
}
